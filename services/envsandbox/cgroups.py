"""Per-sandbox cgroups (memory, pids, CPU) on cgroup v2 or v1, a cgroup per exec to kill
it as a whole, and cleanup of stale ones.

Layout: ``<controller root>/<parent>/meridian-envsandbox/<instance>/<sandbox id>``, where
``<instance>`` is ``<service pid>-<its start time>``. A restarted service removes every
instance folder whose owner no longer runs (killing what is still inside first), so a
SIGKILLed service leaves nothing behind once it is started again.

Every exec joins a cgroup of its own in the cgroup2 hierarchy (the only one on a v2
machine; the ``unified`` mount beside the v1 controllers on a hybrid one):
``.../<sandbox id>/exec-<n>``. Writing ``cgroup.kill`` there kills every process the exec
started, wherever it went (a new session, a daemon, a re-parented grandchild), and
``cgroup.events`` says when none is left. The sandbox's own node kills all its execs at
once (before RunTests).
"""
from __future__ import annotations

import dataclasses
import errno
import logging
import os
import signal
import time
from pathlib import Path

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
GROUP_NAME = "meridian-envsandbox"
V1_CONTROLLERS = ("memory", "pids", "cpu")
CPU_PERIOD_US = 100_000


@dataclasses.dataclass(frozen=True)
class CgroupLimits:
    """One sandbox's cgroup limits. ``memory_bytes`` is the whole memory limit of the
    cgroup: the sandbox's processes and the tmpfs pages and inodes they write, which the
    kernel charges here too (the caller adds their room, see sandbox.tmpfs_charge)."""

    memory_bytes: int
    max_pids: int
    cpus: float


def process_start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (clock ticks since boot), None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def instance_name(pid: int | None = None) -> str:
    pid = pid or os.getpid()
    return f"{pid}-{process_start_time(pid)}"


def _instance_alive(name: str) -> bool:
    pid, _, start = name.partition("-")
    return pid.isdigit() and process_start_time(int(pid)) == start


def cgroup2_mount() -> Path | None:
    """Where the cgroup2 hierarchy is mounted, if anywhere (from /proc/self/mountinfo)."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split(" - ", 1)
        if len(fields) == 2 and fields[1].split()[0] == "cgroup2":
            return Path(fields[0].split()[4])
    return None


def _own_path(controller: str) -> str:
    """This process's cgroup path for ``controller`` ('' on v2) from /proc/self/cgroup."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        if controller in names.split(",") or (controller == "" and names == ""):
            return path
    return "/"


class Cgroups:
    """Creates, fills and removes the cgroups of one service instance."""

    def __init__(self, instance: str | None = None, root: Path = CGROUP_ROOT) -> None:
        self.instance = instance or instance_name()
        self.root = root
        self.version = 2 if (root / "cgroup.controllers").exists() else 1
        self.bases = self._bases()
        for base in self.bases.values():
            (base / self.instance).mkdir(parents=True, exist_ok=True)
        if self.version == 2:
            self._enable_v2_controllers()
        self.kill_base = self._kill_base()
        if self.kill_base is not None:
            (self.kill_base / self.instance).mkdir(parents=True, exist_ok=True)
        self._execs = 0

    def _kill_base(self) -> Path | None:
        """The folder (in the cgroup2 hierarchy) holding the exec cgroups of all instances."""
        if self.version == 2:
            return self.bases[""]
        unified = cgroup2_mount() if self.root == CGROUP_ROOT else None
        if unified is None or not (unified / "cgroup.procs").exists():
            return None
        return unified / GROUP_NAME

    def _bases(self) -> dict[str, Path]:
        """controller ('' for v2) → the folder holding all instances."""
        if self.version == 2:
            return {"": self.root / GROUP_NAME}
        bases = {}
        for controller in V1_CONTROLLERS:
            mount = self.root / controller
            if not mount.is_dir():
                raise OSError(f"cgroup v1 controller {controller} is not mounted at {mount}")
            # Nest under our own cgroup so that limits set around the service still hold.
            own = mount / _own_path(controller).lstrip("/")
            bases[controller] = (own if os.access(own, os.W_OK) else mount) / GROUP_NAME
        return bases

    def _enable_v2_controllers(self) -> None:
        base = self.bases[""]
        for folder in (self.root, base, base / self.instance):
            try:
                (folder / "cgroup.subtree_control").write_text("+memory +pids +cpu")
            except OSError as exc:
                log.warning("cannot enable cgroup controllers in %s: %s", folder, exc)

    def create(self, sandbox_id: str, limits: CgroupLimits) -> list[str]:
        """Makes the sandbox's cgroups; returns the ``cgroup.procs`` files to join."""
        procs = []
        for controller, base in self.bases.items():
            folder = base / self.instance / sandbox_id
            folder.mkdir(exist_ok=True)
            for name, value in self._settings(controller, limits):
                try:
                    (folder / name).write_text(value)
                except FileNotFoundError:
                    pass  # e.g. memory.memsw.* without swap accounting
            # v1: a single-threaded process writing "0" to ``tasks`` moves itself without the
            # global threadgroup lock (an RCU grace period, ~10 ms per hierarchy). On v2 the
            # processes join the exec's cgroup below this one instead (exec_group).
            if self.version == 1:
                procs.append(str(folder / "tasks"))
        return procs

    def exec_group(self, sandbox_id: str) -> Path | None:
        """A new, empty cgroup for one exec of the sandbox (None without cgroup2); join it
        by writing ``0`` to its ``cgroup.procs``."""
        if self.kill_base is None:
            return None
        self._execs += 1
        folder = self.kill_base / self.instance / sandbox_id / f"exec-{self._execs}"
        folder.mkdir(parents=True)
        return folder

    def kill_exec(self, folder: Path | None, timeout_s: float = 10.0) -> None:
        """Kills every process in an exec's cgroup, waits until none is left, removes it."""
        if folder is not None:
            _kill_and_wait(folder, timeout_s)
            _rmdir(folder)

    def kill_sandbox(self, sandbox_id: str, timeout_s: float = 10.0) -> None:
        """Kills every process of every exec of the sandbox and waits until none is left."""
        if self.kill_base is not None:
            folder = self.kill_base / self.instance / sandbox_id
            if folder.is_dir():
                _kill_and_wait(folder, timeout_s)
                return
        for controller, base in self.bases.items():  # no cgroup2: the pids (or v2) cgroup's members
            if controller in ("pids", ""):
                _kill_members(base / self.instance / sandbox_id, timeout_s)

    def _settings(self, controller: str, limits: CgroupLimits) -> list[tuple[str, str]]:
        quota = str(max(1000, int(limits.cpus * CPU_PERIOD_US)))
        if self.version == 2:
            return [
                ("memory.max", str(limits.memory_bytes)),
                ("memory.swap.max", "0"),
                ("pids.max", str(limits.max_pids)),
                ("cpu.max", f"{quota} {CPU_PERIOD_US}"),
            ]
        return {
            "memory": [("memory.limit_in_bytes", str(limits.memory_bytes)), ("memory.memsw.limit_in_bytes", str(limits.memory_bytes))],
            "pids": [("pids.max", str(limits.max_pids))],
            "cpu": [("cpu.cfs_period_us", str(CPU_PERIOD_US)), ("cpu.cfs_quota_us", quota)],
        }[controller]

    def oom_kills(self, sandbox_id: str) -> int:
        """How many processes the kernel's OOM killer has killed in the sandbox's memory
        cgroup so far (its ``oom_kill`` counter; 0 where the kernel has none). An exec
        compares it before and after: one that rose while the command ran, with the
        command killed by SIGKILL, says the memory limit ended it."""
        return oom_kill_count(self.bases["" if self.version == 2 else "memory"] / self.instance / sandbox_id, self.version)

    def _all_bases(self) -> list[Path]:
        return [*self.bases.values(), *([self.kill_base] if self.kill_base is not None and self.kill_base not in self.bases.values() else [])]

    def remove(self, sandbox_id: str) -> None:
        """Kills whatever is left in the sandbox's cgroups and removes them."""
        for base in self._all_bases():
            _remove_tree(base / self.instance / sandbox_id)

    def remove_instance(self) -> None:
        for base in self._all_bases():
            _remove_tree(base / self.instance)

    def cleanup_stale(self) -> list[str]:
        """Removes instance folders whose service no longer runs; returns their names."""
        removed = set()
        for base in self._all_bases():
            if not base.is_dir():
                continue
            for folder in base.iterdir():
                if folder.is_dir() and folder.name != self.instance and not _instance_alive(folder.name):
                    _remove_tree(folder)
                    removed.add(folder.name)
        return sorted(removed)

    def live_sandboxes(self) -> list[str]:
        base = next(iter(self.bases.values())) / self.instance
        return sorted(p.name for p in base.iterdir() if p.is_dir()) if base.is_dir() else []


def oom_kill_count(folder: Path, version: int) -> int:
    """The ``oom_kill`` line of the memory cgroup ``folder``'s ``memory.events`` (cgroup
    ``version`` 2) or ``memory.oom_control`` (1); 0 when the file or the line is missing."""
    try:
        text = (folder / ("memory.events" if version == 2 else "memory.oom_control")).read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value)
    return 0


def _removed(exc: OSError) -> bool:
    """Whether an error on a cgroup file says the cgroup was removed meanwhile: ENOENT once
    it is gone, ENODEV for a file opened before its removal and written or read after.
    A cgroup is removed only once it is empty, so nothing of it runs any more."""
    return exc.errno in (errno.ENOENT, errno.ENODEV)


def _populated(folder: Path) -> bool:
    """Whether any process is in ``folder`` or below (cgroup2's ``cgroup.events``)."""
    try:
        for line in (folder / "cgroup.events").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "populated":
                return value.strip() != "0"
        return bool((folder / "cgroup.procs").read_text().split())
    except OSError as exc:
        if _removed(exc):
            return False
        raise


def _kill_and_wait(folder: Path, timeout_s: float) -> None:
    """``cgroup.kill`` (or, on kernels without it, freeze and SIGKILL every member) and wait
    until the cgroup and all below it are empty; raises when they do not empty in time. A
    cgroup removed meanwhile (a sandbox's teardown removes its exec cgroups while an exec
    ends) is empty: that is no error."""
    deadline = time.monotonic() + timeout_s
    kill_file = folder / "cgroup.kill"
    while True:
        if kill_file.exists():
            try:
                kill_file.write_text("1")
            except OSError as exc:
                if _removed(exc):
                    return
                raise
        else:
            _kill_members(folder, 0.0)
        for _ in range(100):
            if not _populated(folder):
                return
            time.sleep(0.001 if _ < 20 else 0.01)
        if time.monotonic() > deadline:
            raise RuntimeError(f"cgroup {folder} still holds processes after SIGKILL")


def _kill_members(folder: Path, timeout_s: float) -> None:
    """SIGKILLs every member of ``folder`` and its children until none is left (or timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        pids = []
        for procs in [folder / "cgroup.procs", *folder.glob("*/cgroup.procs")]:
            try:
                pids += [int(p) for p in procs.read_text().split()]
            except OSError:
                pass
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.005)


def _rmdir(folder: Path) -> None:
    for attempt in range(20):
        try:
            folder.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.002 * (attempt + 1))
    log.warning("cgroup %s could not be removed", folder)


def _remove_tree(folder: Path) -> None:
    """Depth-first: kill the members of every cgroup below ``folder``, then rmdir it."""
    if not folder.is_dir():
        return
    for child in folder.iterdir():
        if child.is_dir():
            _remove_tree(child)
    for attempt in range(50):
        kill_file = folder / "cgroup.kill"
        if kill_file.exists():
            try:
                kill_file.write_text("1")
            except OSError:
                pass
        try:
            pids = [int(p) for p in (folder / "cgroup.procs").read_text().split()]
        except OSError:
            pids = []
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            folder.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.01 * (attempt + 1))
    log.warning("cgroup %s could not be removed", folder)
