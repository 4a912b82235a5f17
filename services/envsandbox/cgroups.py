"""Per-sandbox cgroups (memory, pids, CPU) on cgroup v2 or v1, and cleanup of stale ones.

Layout: ``<controller root>/<parent>/meridian-envsandbox/<instance>/<sandbox id>``, where
``<instance>`` is ``<service pid>-<its start time>``. A restarted service removes every
instance folder whose owner no longer runs (killing what is still inside first), so a
SIGKILLed service leaves nothing behind once it is started again.
"""
from __future__ import annotations

import dataclasses
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
            # global threadgroup lock (an RCU grace period, ~10 ms per hierarchy).
            procs.append(str(folder / ("tasks" if self.version == 1 else "cgroup.procs")))
        return procs

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

    def oom_killed(self, sandbox_id: str) -> bool:
        """Whether the kernel's OOM killer has acted in the sandbox's memory cgroup."""
        if self.version == 2:
            events = self.bases[""] / self.instance / sandbox_id / "memory.events"
            try:
                for line in events.read_text().splitlines():
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value) > 0
            except OSError:
                return False
            return False
        try:
            text = (self.bases["memory"] / self.instance / sandbox_id / "memory.oom_control").read_text()
        except OSError:
            return False
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value) > 0
        return False

    def remove(self, sandbox_id: str) -> None:
        """Kills whatever is left in the sandbox's cgroups and removes them."""
        for base in self.bases.values():
            _remove_tree(base / self.instance / sandbox_id)

    def remove_instance(self) -> None:
        for base in self.bases.values():
            _remove_tree(base / self.instance)

    def cleanup_stale(self) -> list[str]:
        """Removes instance folders whose service no longer runs; returns their names."""
        removed = set()
        for base in self.bases.values():
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
