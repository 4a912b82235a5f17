"""A private Docker daemon for tests, benchmarks and the compose smoke run: its own data,
exec root and socket under one folder, no iptables, no default bridge; stopped by its exact
PID. The vfs storage driver by default (works anywhere, but copies every layer whole);
overlay2 for large images (deploy/compose-smoke), with the data kept between runs so
builds reuse their layers.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path


class DockerdUnavailable(RuntimeError):
    """dockerd is not installed (callers skip) — any other start failure is an error."""


class PrivateDockerd:
    def __init__(self, folder: Path | None = None, storage_driver: str = "vfs", keep_data: bool = False, userland_proxy: bool = False) -> None:
        """``keep_data``: stop leaves ``folder/data`` (images, build cache) for the next
        start and removes the rest; ``userland_proxy``: published ports work (without
        iptables only the proxy forwards them)."""
        # Unix socket paths are limited to 108 bytes: keep the folder short.
        self.folder = Path(folder or tempfile.mkdtemp(prefix="mdk-", dir="/tmp"))
        self.socket = self.folder / "d.sock"
        self.base_url = f"unix://{self.socket}"
        self.storage_driver = storage_driver
        self.keep_data = keep_data
        self.userland_proxy = userland_proxy
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 60.0) -> "PrivateDockerd":
        binary = shutil.which("dockerd")
        if binary is None:
            raise DockerdUnavailable("dockerd is not installed (apt package docker.io)")
        for name in ("data", "exec"):
            (self.folder / name).mkdir(parents=True, exist_ok=True)
        # A kept folder may hold the pid file of a daemon that died without removing it.
        pidfile = self.folder / "dockerd.pid"
        with contextlib.suppress(OSError, ValueError):
            if pidfile.exists() and not Path(f"/proc/{int(pidfile.read_text().strip())}").exists():
                pidfile.unlink()
        log = open(self.folder / "dockerd.log", "wb")
        self.proc = subprocess.Popen(
            [
                binary, "--iptables=false", "--ip6tables=false", "--bridge=none", f"--storage-driver={self.storage_driver}",
                "--data-root", str(self.folder / "data"), "--exec-root", str(self.folder / "exec"),
                "--pidfile", str(self.folder / "dockerd.pid"), "-H", self.base_url,
                f"--userland-proxy={str(self.userland_proxy).lower()}", "--log-level=warn",
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        import docker  # the SDK is only needed here and in the docker backend

        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dockerd exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self.socket.exists():
                with contextlib.suppress(Exception):
                    client = docker.DockerClient(base_url=self.base_url, timeout=10)
                    client.ping()
                    client.close()
                    return self
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"dockerd did not answer within {timeout_s} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        try:
            return (self.folder / "dockerd.log").read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None
        # The daemon may leave a mount or two behind (its default network namespace): off
        # with them, innermost first, before the files go.
        with contextlib.suppress(OSError):
            mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
            for mount in sorted((m for m in mounts if m.startswith(f"{self.folder}/")), reverse=True):
                subprocess.run(["umount", "-l", mount], check=False, capture_output=True)
        # vfs layers may hold read-only bits; the daemon's own mounts are gone with it.
        if self.keep_data:
            for path in self.folder.iterdir():
                if path.name != "data":
                    subprocess.run(["rm", "-rf", str(path)], check=False)
        else:
            subprocess.run(["rm", "-rf", str(self.folder)], check=False)


@contextlib.contextmanager
def private_dockerd(folder: Path | None = None) -> Iterator[PrivateDockerd]:
    daemon = PrivateDockerd(folder)
    try:
        yield daemon.start()
    finally:
        daemon.stop()
