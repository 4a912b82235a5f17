"""The demo's held-out statistics and the job's configuration, against hand values."""
from __future__ import annotations

import pytest

from meridian.demo import DemoConfig, HeldOutCurve, paired_bootstrap, summarise_eval
from meridian.train import TrainConfig, task_ids
from meridian.v1 import common_pb2
from services.envsandbox.tasks import TaskSuite


def _sample(reward: float, versions: list[int], mask: list[int]) -> common_pb2.Trajectory:
    return common_pb2.Trajectory(reward=reward, policy_versions=versions, loss_mask=mask)


def _task_sample(task: str, reward: float, version: int) -> common_pb2.Trajectory:
    return common_pb2.Trajectory(task_id=task, reward=reward, policy_versions=[version], loss_mask=[1])


def test_pass_at_1_and_pass_at_k_per_task() -> None:
    per_task = {"a": [1.0, 0.0, 0.0, 0.0], "b": [0.0, 0.0, 0.5, 0.0], "c": [1.0, 1.0, 1.0, 1.0]}
    out = summarise_eval(per_task)
    assert out["pass_at_1"] == pytest.approx((0.25 + 0.0 + 1.0) / 3)
    assert out["pass_at_k"] == pytest.approx(2 / 3) and out["k"] == 4  # a partial reward is no pass
    assert out["samples"] == 12 and out["reward_mean"] == pytest.approx((1.0 + 0.5 + 4.0) / 12)
    assert out["per_task_reward"] == pytest.approx({"a": 0.25, "b": 0.125, "c": 1.0})
    assert out["per_task_rewards"] == per_task


def test_paired_bootstrap_centres_on_the_mean_change() -> None:
    # Every sample of every task goes from 0 to 1: nothing varies, the interval is a point.
    before = {"a": [0.0, 0.0], "b": [0.0, 0.0, 0.0], "c": [0.0]}
    assert paired_bootstrap(before, {"a": [1.0, 1.0], "b": [1.0, 1.0, 1.0], "c": [1.0]}) == pytest.approx((1.0, 1.0, 1.0))
    before = {"a": [0.0] * 8, "b": [1.0, 0.0] * 4, "c": [0.0] * 8, "d": [1.0] * 2 + [0.0] * 6}
    after = {"a": [1.0] * 2 + [0.0] * 6, "b": [1.0, 0.0] * 4, "c": [0.0] * 8, "d": [1.0] * 4 + [0.0] * 4}
    mean, low, high = paired_bootstrap(before, after)
    assert mean == pytest.approx((0.25 + 0.0 + 0.0 + 0.25) / 4)
    # Within-task noise widens the interval beyond resampling the task means alone, which
    # could never go below 0 here (no task lost anything).
    assert low < 0 < mean < high <= 1


def test_job_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="mode"):
        TrainConfig(mode="fast")
    with pytest.raises(ValueError, match="--rollout and --trainer"):
        TrainConfig(rollout="127.0.0.1:1")
    with pytest.raises(ValueError, match="eval_samples"):
        DemoConfig(eval_samples=1)
    assert DemoConfig().mode == "async" and DemoConfig().eval_samples * len(DemoConfig().eval_tasks.split(",")) >= 128


def test_default_held_out_set_is_the_whole_python_eval_split() -> None:
    # Held out means never trained on; the whole split, not the tasks the model happens to
    # do well or badly on (that would pick the result).
    suite = TaskSuite.builtin()
    config = DemoConfig()
    held_out = task_ids(config.eval_tasks)
    assert len(held_out) == len(set(held_out))
    assert set(held_out) == {t.id for t in suite.select(split="eval", kind="python_function")}
    assert {suite.get(t).split for t in task_ids(config.train_tasks)} == {"train"}


def test_held_out_curve_credits_the_oldest_generating_version() -> None:
    curve = HeldOutCurve()
    curve.add([
        _sample(1.0, [3, 3], [1, 1]),
        # Spans an update; the tool output between the turns carries version -1, masked.
        _sample(0.0, [3, -1, 4], [1, 0, 1]),
        _sample(1.0, [4, 5], [1, 1]),
        _sample(1.0, [-1], [0]),  # the model generated nothing: no version to credit
    ])
    assert curve.points() == [
        {"policy_version": 3, "samples": 2, "pass_rate": 0.5},
        {"policy_version": 4, "samples": 1, "pass_rate": 1.0},
    ]


def test_held_out_curve_adjusts_for_the_tasks_each_version_drew() -> None:
    # Version 1 drew only the easy task, version 2 only the hard one, and neither changed
    # from before: the raw rates differ by the slice, the adjusted ones both equal pass@1.
    before = summarise_eval({"easy": [1.0, 1.0, 1.0, 0.0], "hard": [0.0, 0.0, 0.0, 1.0]})
    curve = HeldOutCurve()
    curve.add([_task_sample("easy", r, 1) for r in (1.0, 1.0, 1.0, 0.0)] + [_task_sample("hard", r, 2) for r in (0.0, 1.0, 0.0, 0.0)])
    # Version 3 improved the hard task by 0.5 on its samples: pass@1 0.5 + 0.5.
    curve.add([_task_sample("hard", r, 3) for r in (1.0, 1.0, 0.0, 1.0)] + [_task_sample("unknown", 1.0, 3)])
    points = curve.points(before)
    assert [p["pass_rate"] for p in points] == [0.75, 0.25, 0.8]
    assert [p["pass_at_1_adjusted"] for p in points] == [0.5, 0.5, 1.0]  # a task missing before is left out
    assert "pass_at_1_adjusted" not in curve.points()[0]


def test_report_plots_the_steps_and_the_held_out_curve(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from meridian.train import write_report

    step = {"reward_mean": 0.5, "pass_rate": 0.25, "policy_lag_mean": 0.5, "weightsync_encoded_bytes": 1000, "loss": 0.01}
    summary = {
        "trainer_steps": [{"step": 1, **step}, {"step": 2, **step}],
        "eval_curve": [{"policy_version": 0, "samples": 16, "pass_rate": 0.25, "pass_at_1_adjusted": 0.25}, {"policy_version": 1, "samples": 8, "pass_rate": 0.5, "pass_at_1_adjusted": 0.3}],
        "policy_version_start": 0, "policy_version_end": 2,
        "eval_before": {"pass_at_1": 0.25}, "eval_after": {"pass_at_1": 0.375},
    }
    path = write_report(tmp_path, summary, "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    assert json.loads((tmp_path / "summary.json").read_text()) == summary


def test_extra_trainer_flags_come_last_so_they_win() -> None:
    args = TrainConfig(lr=3e-5, trainer_flags="--threads 1 --attention 'eager'").trainer_args()
    assert args[:2] == ["--lr", "3e-05"] and args[-4:] == ["--threads", "1", "--attention", "eager"]


def test_held_out_requests_stay_under_the_sandboxes_one_request_may_take() -> None:
    """8 tasks x 32 samples in one request needed 256 sandboxes at once, past envsandbox's
    live-sandbox cap: the evaluation asks in batches of tasks, and loses none."""
    import asyncio

    from meridian import demo

    class Recorder:
        def __init__(self) -> None:
            self.requests: list[tuple[list[str], int]] = []

        async def RunEpisodes(self, request, **_):  # type: ignore[no-untyped-def]
            self.requests.append((list(request.task_ids), request.group_size))
            return type("Reply", (), {"trajectories": [common_pb2.Trajectory(task_id=t) for t in request.task_ids for _ in range(request.group_size)]})

    tasks = [f"python/t{i}" for i in range(8)]
    config = DemoConfig(eval_tasks=",".join(tasks), eval_samples=32)
    rollout = Recorder()
    got = asyncio.run(demo._held_out(rollout, config, 32))
    assert all(len(ids) * n <= demo.EVAL_SANDBOXES_PER_REQUEST for ids, n in rollout.requests)
    assert [t for ids, _ in rollout.requests for t in ids] == tasks and len(got) == 8 * 32
    rollout.requests.clear()
    asyncio.run(demo._held_out(rollout, config, 16))  # the default 8 x 16: one request, as before
    assert len(rollout.requests) == 1
