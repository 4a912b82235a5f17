"""`meridian down` / Stack.stop: returns only when every process of every group is gone,
including what a service leaves behind (engine workers, helpers ignoring SIGTERM)."""
from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

from meridian import stack as stack_mod

# The leader exits on SIGTERM; its child ignores SIGTERM and would outlive a stop that
# only signals the leader, or that returns as soon as the leader is gone.
_LEAVES_A_WORKER = '(trap "" TERM; exec sleep 300) & (trap "" TERM; exec sleep 300) & wait'


def _spawn_group(command: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(command, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait_members(pgid: int, count: int) -> None:
    deadline = time.monotonic() + 10
    while len(stack_mod.group_members(pgid)) < count:
        assert time.monotonic() < deadline, f"group {pgid} never reached {count} processes"
        time.sleep(0.02)


def test_stop_returns_only_when_every_group_member_is_gone(tmp_path: Path) -> None:
    leader = _spawn_group(["sh", "-c", _LEAVES_A_WORKER])
    other = _spawn_group(["sleep", "300"])
    _wait_members(leader.pid, 3)
    stack = stack_mod.Stack(tmp_path, {"rollout": leader.pid, "redis": other.pid}, {}, {}, "")
    t0 = time.monotonic()
    killed = stack.stop(timeout_s=20)
    took = time.monotonic() - t0
    assert stack_mod.group_members(leader.pid) == [] and stack_mod.group_members(other.pid) == []
    # The leaders exited on SIGTERM by themselves; the workers needed the group's SIGKILL.
    assert killed == [] and took < 15
    assert leader.poll() is not None and other.poll() is not None  # reaped, not zombies


def test_stop_kills_a_group_whose_leader_ignores_sigterm(tmp_path: Path) -> None:
    stubborn = _spawn_group(["sh", "-c", 'trap "" TERM; sleep 300 & wait; sleep 300'])
    _wait_members(stubborn.pid, 2)
    stack = stack_mod.Stack(tmp_path, {"trainer": stubborn.pid}, {}, {}, "")
    assert stack.stop(timeout_s=0.5) == ["trainer"]
    assert stack_mod.group_members(stubborn.pid) == []


def test_group_members_reads_names_with_spaces_and_parentheses(tmp_path: Path) -> None:
    odd = tmp_path / "a b) (c"
    shutil.copy(shutil.which("sleep") or "/bin/sleep", odd)
    proc = _spawn_group([str(odd), "300"])
    try:
        _wait_members(proc.pid, 1)
        assert stack_mod.group_members(proc.pid) == [proc.pid]
    finally:
        proc.kill()
        proc.wait()
    assert stack_mod.group_members(proc.pid) == []


def test_a_stale_state_file_does_not_stop_whoever_took_a_recorded_pid(tmp_path: Path) -> None:
    """A stack.json outliving its stack names PIDs that other processes may hold by now:
    the recorded start time tells them apart, so stop and kill leave them alone."""
    stranger = _spawn_group(["sleep", "300"])
    try:
        _wait_members(stranger.pid, 1)
        start = stack_mod.start_time(stranger.pid)
        assert start is not None
        stale = stack_mod.Stack(tmp_path, {"trainer": stranger.pid}, {}, {}, "", starts={"trainer": start - 1})
        stale.save()
        loaded = stack_mod.Stack.load(tmp_path)
        assert loaded is not None and loaded.starts == {"trainer": start - 1}
        loaded.kill("trainer")
        assert loaded.stop(timeout_s=1) == []
        assert stranger.poll() is None and stack_mod.group_members(stranger.pid) == [stranger.pid]
        # Recorded by save() at start, the same PID is ours and is stopped.
        ours = stack_mod.Stack(tmp_path, {"trainer": stranger.pid}, {}, {}, "")
        ours.save()
        assert ours.starts == {"trainer": start}
        ours.stop(timeout_s=5)
        assert stack_mod.group_members(stranger.pid) == []
    finally:
        stranger.kill()
        stranger.wait()
