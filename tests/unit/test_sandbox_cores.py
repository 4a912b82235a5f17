"""Cores of the sandbox hardening, without a sandbox: the seccomp policy (interpreted
BPF and the Docker profile), workspace writes against a FIFO swapped in mid-write, and the
harness against a check whose grandchild leaves its process group holding the pipe."""
from __future__ import annotations

import errno
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from services.envsandbox import seccomp_policy as sp
from services.envsandbox import workspace_files
from services.envsandbox.sandbox import HARNESS_SOURCE

# x86_64 numbers of a few calls (the policy is built from the launcher's own numbers).
NUMBERS = {"keyctl": 250, "add_key": 248, "io_uring_setup": 425, "unshare": 272, "mount": 165, "clone3": 435, "clone": 56, "ptrace": 101, "prctl": 157}
GETPID = 39


def _program() -> bytes:
    return sp.bpf_program(NUMBERS, sp.AUDIT_ARCH_X86_64)


@pytest.mark.parametrize("name", ["keyctl", "add_key", "io_uring_setup", "unshare", "mount", "ptrace"])
def test_denied_calls_fail_with_eperm(name: str) -> None:
    assert sp.run_bpf(_program(), NUMBERS[name], sp.AUDIT_ARCH_X86_64) == sp.RET_ERRNO | errno.EPERM


def test_clone3_says_enosys_and_clone_is_judged_by_its_flags() -> None:
    prog, arch = _program(), sp.AUDIT_ARCH_X86_64
    assert sp.run_bpf(prog, NUMBERS["clone3"], arch) == sp.RET_ERRNO | errno.ENOSYS
    thread_flags = 0x3D0F00  # what pthread_create passes
    assert sp.run_bpf(prog, NUMBERS["clone"], arch, thread_flags) == sp.RET_ALLOW
    assert sp.run_bpf(prog, NUMBERS["clone"], arch, 17) == sp.RET_ALLOW  # fork: SIGCHLD only
    for flag in (0x10000000, 0x20000000, 0x40000000, 0x00020000, 0x04000000, 0x08000000, 0x02000000):
        assert sp.run_bpf(prog, NUMBERS["clone"], arch, flag | 17) == sp.RET_ERRNO | errno.EPERM


def test_prctl_may_not_touch_the_parent_death_signal() -> None:
    """The launcher arms it so the command dies with the service; the command may not
    clear it or trade SIGKILL for a signal it ignores. Other prctl options pass."""
    prog, arch = _program(), sp.AUDIT_ARCH_X86_64
    assert sp.run_bpf(prog, NUMBERS["prctl"], arch, sp.PR_SET_PDEATHSIG) == sp.RET_ERRNO | errno.EPERM
    for option in (2, 15, 38):  # PR_GET_PDEATHSIG, PR_SET_NAME, PR_SET_NO_NEW_PRIVS
        assert sp.run_bpf(prog, NUMBERS["prctl"], arch, option) == sp.RET_ALLOW


def test_other_calls_pass_and_other_abis_are_killed() -> None:
    prog = _program()
    assert sp.run_bpf(prog, GETPID, sp.AUDIT_ARCH_X86_64) == sp.RET_ALLOW
    assert sp.run_bpf(prog, sp.X32_SYSCALL_BIT | GETPID, sp.AUDIT_ARCH_X86_64) == sp.RET_KILL_PROCESS
    assert sp.run_bpf(prog, GETPID, 0x40000003) == sp.RET_KILL_PROCESS  # i386


def test_docker_profile_carries_the_same_policy() -> None:
    profile = json.loads(sp.docker_profile())
    assert profile["defaultAction"] == "SCMP_ACT_ALLOW"
    denied = {n for rule in profile["syscalls"] if rule["action"] == "SCMP_ACT_ERRNO" and not rule.get("args") for n in rule["names"]}
    assert set(sp.DENIED) | set(sp.NO_SYS) <= denied
    clone_bits = {rule["args"][0]["value"] for rule in profile["syscalls"] if rule["names"] == ["clone"]}
    assert sum(clone_bits) == sp.CLONE_NEW_FLAGS
    [prctl] = [rule for rule in profile["syscalls"] if rule["names"] == ["prctl"]]
    assert prctl["args"] == [{"index": 0, "value": sp.PR_SET_PDEATHSIG, "valueTwo": 0, "op": "SCMP_CMP_EQ"}]


def test_a_fifo_swapped_in_before_the_open_is_refused_without_blocking(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    real_stat = os.stat

    def stat_then_swap(name, *args, **kwargs):  # type: ignore[no-untyped-def]
        try:
            return real_stat(name, *args, **kwargs)
        finally:
            if name == "target" and not (tmp_path / "target").exists():
                os.mkfifo(tmp_path / "target")  # lands between the check and the open

    monkeypatch.setattr(workspace_files.os, "stat", stat_then_swap)
    outcome: list[object] = []
    worker = threading.Thread(target=lambda: outcome.append(_try(lambda: workspace_files.write_file(root, "target", b"x"))), daemon=True)
    worker.start()
    worker.join(5)
    os.close(root)
    assert not worker.is_alive(), "writing over a FIFO blocked"
    assert isinstance(outcome[0], workspace_files.PathError) and stat.S_ISFIFO(os.lstat(tmp_path / "target").st_mode)


def _try(fn):  # type: ignore[no-untyped-def]
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return exc
    return None


HOLDER = r'''
import os, subprocess, sys, time

def check_holds_the_pipe():
    # A grandchild leaves the check's process group and keeps the report pipe open.
    pid = os.fork()
    if pid == 0:
        os.setsid()
        with open("holder.pid", "w") as fh:
            fh.write(str(os.getpid()))
        time.sleep(60)
        os._exit(0)
    time.sleep(60)

def check_fine():
    eq(1 + 1, 2)
'''


def test_a_timed_out_check_cannot_hold_the_harness_up(tmp_path: Path) -> None:
    env = {"PATH": os.environ["PATH"], "MERIDIAN_CHECK_TIMEOUT_S": "1"}
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-I", "-S", "-c", HARNESS_SOURCE, "--stdin", ".tests/test_x.py"],
        input=HOLDER.encode(), capture_output=True, cwd=tmp_path, env=env, timeout=60,
    )
    took = time.monotonic() - t0
    holder = tmp_path / "holder.pid"
    if holder.exists():
        try:
            os.kill(int(holder.read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass
    out = proc.stdout.decode()
    assert "FAIL holds_the_pipe: timed out" in out and "PASS fine" in out, out
    assert took < 15, f"the harness waited {took:.1f}s for a grandchild"
