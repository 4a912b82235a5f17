"""The process backend's launcher (``sandbox_exec.c``): built from source when the backend
starts, with the machine's C compiler, and asked for this kernel ABI's syscall numbers."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from meridian.errors import FailedPrecondition

SOURCE = Path(__file__).with_name("sandbox_exec.c")


def build(folder: Path) -> Path:
    """Compiles the launcher into ``folder`` (root-owned, not writable by others)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise FailedPrecondition("the process backend builds its launcher with a C compiler: install gcc (make install does)")
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / "sandbox-exec"
    tmp = folder / f".sandbox-exec.{os.getpid()}"
    result = subprocess.run([compiler, "-O2", "-Wall", "-o", str(tmp), str(SOURCE)], capture_output=True, text=True)
    if result.returncode != 0:
        raise FailedPrecondition(f"building the sandbox launcher failed: {result.stderr[-2000:]}")
    os.chmod(tmp, 0o755)
    os.replace(tmp, target)
    return target


def syscall_numbers(launcher: Path, names: list[str]) -> tuple[dict[str, int], int]:
    """The numbers of ``names`` on this architecture (-1: not there) and its audit arch."""
    out = subprocess.run([str(launcher), "--syscall-numbers", *names], capture_output=True, text=True, check=True).stdout
    numbers: dict[str, int] = {}
    arch = 0
    for line in out.splitlines():
        name, value = line.split()
        if name == "@arch":
            arch = int(value)
        else:
            numbers[name] = int(value)
    if not arch:
        raise FailedPrecondition("the sandbox launcher does not know this CPU architecture's system call ABI")
    return numbers, arch
