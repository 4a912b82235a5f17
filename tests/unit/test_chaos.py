"""The pieces of ``meridian chaos`` that need no stack: the seeded fault schedule, the
audit, the trainer's trained-ids log (through crashes at each point of the commit
order), restarting one process of a stack on its port, the link's corrupt control, and
the injector's checks for a fault's moment and for recovery."""
from __future__ import annotations

import asyncio
import collections
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meridian import chaos
from meridian import stack as stack_mod
from meridian.link_emulator import CHUNK_MAGIC, LinkEmulator
from meridian.trajectory_transport import InMemoryGroupTransport, MemoryStreams, TransportConfig
from meridian.v1 import common_pb2
from services.trainer.consumer import ConsumerConfig, GroupConsumer

# ---------------------------------------------------------------- the schedule


def test_the_same_seed_gives_the_same_schedule_and_another_seed_another() -> None:
    assert chaos.plan(7, 20, ["b"]) == chaos.plan(7, 20, ["b"])
    assert chaos.plan(7, 20, ["b"]) != chaos.plan(8, 20, ["b"])


def test_the_schedule_covers_every_kind_on_every_service_of_every_region() -> None:
    schedule = chaos.plan(3, 25, ["b", "c"])
    assert len(schedule) == 25
    assert {(f.kind, f.target) for f in schedule} >= set(chaos.base_faults(["b", "c"]))
    assert {f.kind for f in schedule} == set(chaos.FAULT_KINDS)
    # kill -9 of each service in each region
    killed = {f.target for f in schedule if f.kind in chaos.KILLS}
    for service in ("trainer", "rollout", "weightsync", "envsandbox", "redis", "rollout-b", "weightsync-b", "envsandbox-b", "rollout-c", "weightsync-c", "envsandbox-c"):
        assert service in killed
    for f in schedule:
        low, high = chaos.DOWN_S[f.kind]
        assert low <= f.down_s <= high and 0 <= f.pause_s <= 3
    assert [f.index for f in schedule] == list(range(25))


def test_too_few_faults_or_no_remote_region_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 13"):
        chaos.plan(0, 12, ["b"])
    with pytest.raises(ValueError, match="remote region"):
        chaos.plan(0, 20, [])


# ---------------------------------------------------------------- the audit


def test_the_audit_finds_lost_duplicated_and_unexplained_ids(tmp_path: Path) -> None:
    log = tmp_path / "trained-ids.jsonl"
    log.write_text(
        json.dumps({"group_id": "g1", "trajectory_ids": ["a", "b"], "flat": False}) + "\n"
        + json.dumps({"group_id": "g2", "trajectory_ids": ["c", "d"], "flat": True}) + "\n"
        + json.dumps({"group_id": "g1", "trajectory_ids": ["a", "b"], "flat": False}) + "\n"
        + json.dumps({"group_id": "g9", "trajectory_ids": ["z"], "flat": False}) + "\n"
    )
    trained, flat, missing = chaos.read_trained_log(log)
    audit = chaos.Audit({"a", "b", "c", "d", "e"}, trained)
    assert audit.lost == {"e"}
    assert audit.trained_twice == {"a", "b"}
    assert audit.unexplained == {"z"}
    assert flat == 1 and missing == []
    assert chaos.read_trained_log(tmp_path / "absent.jsonl") == (collections.Counter(), 0, [])
    # A group logged as trained that the final checkpoint's weights do not hold is lost.
    trained, _, missing = chaos.read_trained_log(log, in_checkpoint={"g1", "g9"})
    assert missing == ["g2"] and chaos.Audit({"a", "b", "c", "d"}, trained).lost == {"c", "d"}


def test_checkpointed_groups_reads_the_newest_complete_checkpoint(tmp_path: Path) -> None:
    from services.trainer import checkpoint as ckpt

    assert chaos.checkpointed_groups(tmp_path / "none") is None
    ckpt.save_checkpoint(tmp_path, 3, {}, {"step": 3, "version": 3, "trained_groups": ["g1", "g2"]}, 2)
    assert chaos.checkpointed_groups(tmp_path) == {"g1", "g2"}


# ---------------------------------------------------------------- the trained-ids log

CONFIG = TransportConfig(url="memory://", stream="test:trajectories")


def _group(name: str, rewards: tuple[float, ...] = (0.0, 1.0)) -> list[common_pb2.Trajectory]:
    return [
        common_pb2.Trajectory(
            trajectory_id=f"{name}-{k}", task_id="python/add", group_id=name, group_size=len(rewards), prompt_token_ids=[1],
            completion_token_ids=[2], logprobs=[-0.5], loss_mask=[1], policy_versions=[0], reward=r,
        )
        for k, r in enumerate(rewards)
    ]


def _consumer(streams: MemoryStreams, log: Path) -> GroupConsumer:
    c = GroupConsumer(InMemoryGroupTransport(CONFIG, streams), ConsumerConfig("trainer-0", dedupe_window=100, claim_idle_ms=60_000, claim_every_s=3600))
    c.open_trained_log(log)
    return c


def _lines(log: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


async def _polled(log: Path, *groups: list[common_pb2.Trajectory]) -> tuple[MemoryStreams, InMemoryGroupTransport, GroupConsumer]:
    """A stream holding ``groups`` (published in order) and a started consumer that has read them."""
    streams = MemoryStreams()
    producer = InMemoryGroupTransport(CONFIG, streams)
    for group in groups:
        await producer.publish_group(group)
    c = _consumer(streams, log)
    await c.start()
    await c.poll(10, 0)
    return streams, producer, c


def test_a_group_is_logged_once_when_its_checkpoint_acks_it_not_when_it_is_trained(tmp_path: Path) -> None:
    log = tmp_path / "trained-ids.jsonl"

    async def body() -> None:
        streams, producer, c = await _polled(log, _group("g0"), _group("g1", (1.0, 1.0)))
        c.trained_on(c.take(2))
        assert _lines(log) == []  # trained, not yet covered by a checkpoint
        await c.ack(c.unacked())
        await c.ack({"g0": "whatever"})  # an ack that is not ours again logs nothing
        lines = _lines(log)
        assert [line["group_id"] for line in lines] == ["g0", "g1"]
        assert lines[0]["trajectory_ids"] == ["g0-0", "g0-1"] and lines[0]["how"] == "checkpoint"
        assert [line["flat"] for line in lines] == [False, True]
        assert await producer.pending() == 0

    asyncio.run(body())


def test_a_crash_between_the_log_and_the_ack_logs_the_group_once(tmp_path: Path) -> None:
    log = tmp_path / "trained-ids.jsonl"

    async def body() -> None:
        streams, producer, a = await _polled(log, _group("g0"))
        taken = a.take(1)
        a.trained_on(taken)
        a._log_trained(taken, "checkpoint")  # the log line is written; the XACK never happens
        # Restarted from the checkpoint that lists g0: the redelivery is acked, not logged again.
        b = _consumer(streams, log)
        b.restore(["g0"])
        await b.start()
        await b.recover()
        assert [line["group_id"] for line in _lines(log)] == ["g0"]
        assert await producer.pending() == 0

    asyncio.run(body())


def test_a_crash_between_the_checkpoint_and_the_log_logs_the_redelivery(tmp_path: Path) -> None:
    log = tmp_path / "trained-ids.jsonl"

    async def body() -> None:
        streams, producer, a = await _polled(log, _group("g0"))
        a.trained_on(a.take(1))  # the checkpoint holds g0; the crash comes before its log line
        b = _consumer(streams, log)
        b.restore(["g0"])
        await b.start()
        await b.recover()
        lines = _lines(log)
        assert [(line["group_id"], line["how"]) for line in lines] == [("g0", "covered")]
        assert await producer.pending() == 0

    asyncio.run(body())


def test_a_failed_ack_does_not_log_the_group_twice_when_retried(tmp_path: Path) -> None:
    log = tmp_path / "trained-ids.jsonl"

    async def body() -> None:
        streams, producer, c = await _polled(log, _group("g0"))
        c.trained_on(c.take(1))
        real_ack = c.transport.ack

        async def redis_down(entry_ids: list[str]) -> int:
            raise ConnectionError("redis restarting")

        c.transport.ack = redis_down  # type: ignore[method-assign]
        with pytest.raises(ConnectionError):
            await c.ack(c.unacked())
        c.transport.ack = real_ack  # type: ignore[method-assign]
        await c.ack(c.unacked())  # the next checkpoint acks it again
        assert [line["group_id"] for line in _lines(log)] == ["g0"]
        assert await producer.pending() == 0

    asyncio.run(body())


# ---------------------------------------------------------------- restarting one process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def test_kill_takes_the_whole_group_and_restart_listens_on_the_same_port(tmp_path: Path) -> None:
    port = _free_port()
    # A leader that listens and a child in its group (like an engine worker).
    script = (
        "import socket, subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
        f"s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('127.0.0.1', {port})); s.listen()\n"
        "time.sleep(300)\n"
    )
    argv = [sys.executable, "-c", script]
    log = tmp_path / "svc.log"
    log.write_bytes(b"")
    stack = stack_mod.Stack(tmp_path, {}, {"svc": f"127.0.0.1:{port}"}, {"svc": str(log)}, "", argv={"svc": argv}, env={"MERIDIAN_TEST_MARK": "1"})
    first = stack.restart("svc")  # nothing runs yet: a plain start
    assert _listening(port)
    deadline = time.monotonic() + 10
    while len(stack_mod.group_members(first)) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert "MERIDIAN_TEST_MARK=1" in Path(f"/proc/{first}/environ").read_bytes().decode(errors="replace").replace("\0", "\n")
    stack.kill("svc", signal.SIGKILL)
    assert stack_mod.group_members(first) == [] and not _listening(port)
    second = stack.restart("svc")
    try:
        assert second != first and _listening(port)
        assert stack_mod.Stack.load(tmp_path).pids["svc"] == second  # type: ignore[union-attr]
    finally:
        stack.stop(timeout_s=2)
    assert stack_mod.group_members(second) == []


def test_restart_refuses_a_process_with_no_recorded_command_line(tmp_path: Path) -> None:
    stack = stack_mod.Stack(tmp_path, {}, {}, {}, "")
    with pytest.raises(KeyError, match="no command line"):
        stack.restart("trainer")


def test_pin_ports_writes_the_ports_taken_into_the_command_lines(tmp_path: Path) -> None:
    argv = ["python", "-m", "meridian.cli", "serve", "rollout", "--port", "0", "--metrics-port", "0", "--http-port", "0"]
    stack = stack_mod.Stack(
        tmp_path, {}, {"rollout": "127.0.0.1:4100", "rollout_http": "http://127.0.0.1:4102/v1", "redis": "redis://127.0.0.1:4103/0"}, {}, "",
        metrics={"rollout": "http://127.0.0.1:4101/metrics"}, argv={"rollout": list(argv), "redis": ["redis-server", "--port", "4103"]},
    )
    stack_mod.pin_ports(stack)
    assert stack.argv["rollout"][-6:] == ["--port", "4100", "--metrics-port", "4101", "--http-port", "4102"]
    assert stack.argv["redis"] == ["redis-server", "--port", "4103"]


# ---------------------------------------------------------------- the link's corrupt control


def test_corrupting_the_next_chunk_flips_a_byte_after_the_chunk_magic() -> None:
    payload = b"x" * 100 + CHUNK_MAGIC + b"\x01\x00\x10\x20\x30" + b"y" * 100

    async def body() -> None:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(payload)
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with LinkEmulator(f"127.0.0.1:{port}") as link:
            rule = link.corrupt_once(CHUNK_MAGIC, after=3)
            assert link.counters()["corruptions_armed"] == 1
            reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
            got = await reader.read()
            writer.close()
            assert rule.fired and link.counters()["corruptions_fired"] == 1
        server.close()
        at = 100 + len(CHUNK_MAGIC) + 3
        assert got[at] == payload[at] ^ 0xFF and got[:at] == payload[:at] and got[at + 1 :] == payload[at + 1 :]

    asyncio.run(body())


def test_an_empty_pattern_corrupts_the_next_bytes_carried_whatever_they_are() -> None:
    payload = bytes(range(256)) * 20

    async def body() -> None:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read(1)  # after the rule is set
            writer.write(payload)
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with LinkEmulator(f"127.0.0.1:{port}") as link:
            reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
            rule = link.corrupt_once(b"", after=1000)
            writer.write(b"go")
            got = await reader.read()
            writer.close()
            assert rule.fired
        server.close()
        assert [i for i in range(len(payload)) if got[i] != payload[i]] == [1000] and got[1000] == payload[1000] ^ 0xFF

    asyncio.run(body())


def test_the_link_process_arms_a_corruption_on_sighup(tmp_path: Path) -> None:
    target = _free_port()
    stats = tmp_path / "link.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "meridian.cli", "link", "--target", f"127.0.0.1:{target}", "--stats-file", str(stats)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        assert proc.stdout is not None and b"listening" in proc.stdout.readline()
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 15
        while (json.loads(stats.read_text()) if stats.exists() else {}).get("corruptions_armed") != 1:
            assert time.monotonic() < deadline, "SIGHUP did not arm a corruption"
            time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(10)


# ---------------------------------------------------------------- a Redis restart at an ack


def test_an_ack_that_fails_while_redis_restarts_is_made_by_the_next_checkpoint(tmp_path: Path) -> None:
    """Found by a chaos run: a checkpoint's XACK failing (Redis restarting) stayed in the
    checkpoint task and failed every later checkpoint, so none was written again."""
    from services.weightsync.config import WeightSyncConfig
    from services.weightsync.server import WeightSyncService
    from tests.conftest import serving
    from tests.unit.test_trainer_commit import CountingLearner, Trainer
    from tests.unit.test_trainer_commit import _group as commit_group

    async def body() -> None:
        streams = MemoryStreams()
        async with serving(WeightSyncService(WeightSyncConfig(role="origin", data_dir=str(tmp_path / "ws")))) as address:
            t = Trainer(streams, address, tmp_path / "ckpt", CountingLearner(), checkpoint_every=1)
            for name in ("g1", "g2"):
                await t.transport.publish_group(commit_group(name))
            await t.start()
            real_ack = t.transport.ack

            async def redis_down(entry_ids: list[str]) -> int:
                raise ConnectionError("Connection closed by server.")

            t.transport.ack = redis_down  # type: ignore[method-assign]
            await t.train_one()  # the checkpoint is written, its ack fails: not raised
            assert list(t.consumer.unacked()) == ["g1"] and t.progress.checkpoint_step == 1
            t.transport.ack = real_ack  # type: ignore[method-assign]
            await t.train_one()  # the next checkpoint is written and acks both
            assert t.progress.checkpoint_step == 2 and t.consumer.unacked() == {}
            assert await t.transport.pending() == 0

    asyncio.run(body())


def test_a_group_dropped_whole_is_acked_and_logged_as_dropped_at_once(tmp_path: Path) -> None:
    """Found by a chaos run: a step whose samples were all stale trained nothing, was never
    committed, and its group stayed pending for good (the drain never ended)."""
    log = tmp_path / "trained-ids.jsonl"

    async def body() -> None:
        streams, producer, c = await _polled(log, _group("g0"))
        taken = c.take(1)
        c.trained_on(taken)
        await c.ack_dropped(taken)
        assert c.unacked() == {} and await producer.pending() == 0
        assert [(line["group_id"], line["how"]) for line in _lines(log)] == [("g0", "dropped")]
        await c.ack_dropped(taken)  # again: nothing more
        assert len(_lines(log)) == 1
        # The audit counts it trained although no checkpoint lists it.
        trained, _, missing = chaos.read_trained_log(log, in_checkpoint=set())
        assert missing == [] and set(trained) == {"g0-0", "g0-1"}

    asyncio.run(body())


# ---------------------------------------------------------------- watching for moments and recovery


def test_the_version_served_everywhere_is_held_back_by_a_rollout_that_does_not_answer() -> None:
    """A killed region's rollout must keep "served everywhere" low; otherwise the injector
    takes the other regions' progress for recovery while that region is still down."""
    from meridian.v1 import rollout_pb2

    snap = chaos.Snapshot(rollouts={"rollout": rollout_pb2.RolloutStatus(policy_version=5), "rollout-b": None})
    assert snap.served() == -1
    snap.rollouts["rollout-b"] = rollout_pb2.RolloutStatus(policy_version=3)
    assert snap.served() == 3


def test_a_corrupted_chunk_is_recovered_from_only_once_the_corruption_fired() -> None:
    """A newer version at the relay proves nothing about the corruption if no corrupted
    chunk ever crossed the link: the fault would be counted without having happened."""
    fault = chaos.Fault(0, "corrupt_chunk", "link-b", 0.0, 0.0)
    before = chaos.Snapshot(weightsync={"weightsync": 3, "weightsync-b": 2}, corruptions_fired=0)
    after = chaos.Snapshot(weightsync={"weightsync": 3, "weightsync-b": 3})
    assert not chaos.progressed(fault, after, before, {"corruptions_fired": 0})
    assert not chaos.progressed(fault, after, before, None)  # no stats from the link yet
    assert chaos.progressed(fault, after, before, {"corruptions_fired": 1})


def test_before_checkpoint_is_a_moment_only_while_a_step_is_not_yet_checkpointed() -> None:
    from meridian.v1 import trainer_pb2

    fault = chaos.Fault(0, "trainer_before_checkpoint", "trainer", 0.0, 1.0)
    armed = chaos.Snapshot()

    def at(step: int, checkpoint_step: int) -> bool:
        snap = chaos.Snapshot(trainer=trainer_pb2.TrainerStatus(step=step, checkpoint_step=checkpoint_step))
        return chaos.moment(fault, snap, armed, collections.Counter(), None)  # type: ignore[arg-type] - this kind reads no address

    assert not at(3, 3)
    assert at(4, 3)


# ---------------------------------------------------------------- the run folder


@pytest.mark.parametrize("lost", [0, 1])
def test_a_passing_run_leaves_its_report_and_logs_and_a_failing_one_its_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lost: int
) -> None:
    """``meridian chaos`` without --run-dir, around a stand-in for the run (the stack's
    part is test_chaos's in the integration suite): the trainer's checkpoints and ledger,
    Redis data and credentials go once the run passed, and stay after a failed one."""
    monkeypatch.setattr(chaos.tempfile, "tempdir", str(tmp_path))
    state = ["trainer-checkpoints/trained-ids.jsonl", "redis/appendonly.aof", "credentials/ca.key", "trainer.log"]

    def run(config: chaos.ChaosConfig, run_dir: str) -> tuple[dict, dict, dict]:
        for name in state:
            (Path(run_dir) / name).parent.mkdir(parents=True, exist_ok=True)
            (Path(run_dir) / name).write_text("x")
        leaks = {"trajectories_lost": lost, "trajectories_trained_twice": 0, "sandboxes_leaked": 0, "processes_leaked": 0}
        return {**leaks, "regions_hash_equal": True}, {}, {}

    monkeypatch.setattr(chaos, "run", run)
    assert chaos.main(["--json"]) == lost
    (run_dir,) = tmp_path.iterdir()
    left = sorted(p.relative_to(run_dir).as_posix() for p in run_dir.rglob("*") if p.is_file())
    assert left == (sorted([*state, "chaos-report.json"]) if lost else ["chaos-report.json", "trainer.log"])
