"""What a service says when it cannot start in a container: a warm-up failure is logged
with its message (an OSError's path, a Redis reply), not only repr()'s arguments, and the
envsandbox process backend refuses to start, saying why, when it cannot make cgroups
(Docker mounts the cgroup file systems read-only)."""
from __future__ import annotations

import asyncio
import errno
import logging
import tomllib
from pathlib import Path

import pytest

from meridian import grpc_runtime
from meridian.errors import FailedPrecondition
from services.envsandbox import process_backend


def test_describe_error_keeps_the_path_and_the_cause() -> None:
    read_only = OSError(errno.EROFS, "Read-only file system", "/sys/fs/cgroup/memory/meridian-envsandbox")
    try:
        try:
            raise read_only
        except OSError as exc:
            raise RuntimeError("cgroups") from exc
    except RuntimeError as outer:
        text = grpc_runtime.describe_error(outer)
    assert text.startswith("RuntimeError: cgroups")
    assert "OSError: [Errno 30] Read-only file system: '/sys/fs/cgroup/memory/meridian-envsandbox'" in text


def test_describe_error_follows_an_implicit_context_unless_it_was_suppressed() -> None:
    """An error raised while handling another (a cleanup that failed too) says both; one
    raised ``from None`` was written to replace its context, which stays out."""
    def failing(suppress: bool) -> BaseException:
        try:
            try:
                raise OSError(errno.ENOSPC, "No space left on device")
            except OSError:
                if suppress:
                    raise RuntimeError("checkpoint failed") from None
                raise RuntimeError("checkpoint failed")  # noqa: B904 - the implicit context is the case under test
        except RuntimeError as exc:
            return exc

    assert grpc_runtime.describe_error(failing(False)) == "RuntimeError: checkpoint failed (from) OSError: [Errno 28] No space left on device"
    assert grpc_runtime.describe_error(failing(True)) == "RuntimeError: checkpoint failed"


def test_describe_error_of_an_exception_without_message() -> None:
    assert grpc_runtime.describe_error(TimeoutError()) == "TimeoutError: TimeoutError()"
    assert grpc_runtime.describe_error(None) == "unknown error"


class _FailingService:
    """A service whose warm-up raises ``exc``."""

    service_names: tuple[str, ...] = ()

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def register(self, server: object) -> None:
        pass

    async def start(self) -> None:
        raise self.exc

    async def stop(self) -> None:
        pass


def test_warm_up_failure_is_logged_with_its_message(caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]) -> None:
    exc = OSError(errno.EROFS, "Read-only file system", "/sys/fs/cgroup/memory/x")
    config = grpc_runtime.ServerConfig(host="127.0.0.1", port=0, insecure=True)
    with caplog.at_level(logging.ERROR), pytest.raises(SystemExit):
        asyncio.run(grpc_runtime.run_server("envsandbox", _FailingService(exc), config))
    logged = " ".join(r.getMessage() for r in caplog.records if "warm-up failed" in r.getMessage())
    printed = capsys.readouterr().out
    for text in (logged, printed):
        assert "Read-only file system: '/sys/fs/cgroup/memory/x'" in text, text


def test_backend_refuses_to_start_without_cgroups(monkeypatch: pytest.MonkeyPatch) -> None:
    def read_only() -> None:
        raise OSError(errno.EROFS, "Read-only file system", "/sys/fs/cgroup/memory/meridian-envsandbox")

    monkeypatch.setattr(process_backend, "Cgroups", read_only)
    with pytest.raises(FailedPrecondition) as info:
        process_backend._make_cgroups()
    message = str(info.value)
    assert "cannot create its cgroups (/sys/fs/cgroup/memory/meridian-envsandbox)" in message
    assert "read-only" in message and "remount" in message


def test_entrypoint_refuses_before_the_service_when_it_cannot_isolate() -> None:
    """The envsandbox image's entry point exits 78 with its reasons unless told not to;
    without problems it execs the service. (Run for real by deploy/compose-smoke.)"""
    script = (Path(__file__).resolve().parents[2] / "deploy" / "envsandbox-entrypoint.sh").read_text()
    refuse = script.index("exit 78")
    assert script.index("THIS CONTAINER CANNOT ISOLATE SANDBOXES") < refuse < script.index('exec "$@"')
    assert "MERIDIAN_ENVSANDBOX_SKIP_PREFLIGHT" in script


def test_installed_envsandbox_has_its_launcher_source() -> None:
    """The process backend compiles launcher/sandbox_exec.c at start: an installed (not
    editable) package, as in the images, must carry it, and the task suites."""
    repo = Path(__file__).resolve().parents[2]
    patterns = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["services.envsandbox"]
    package = repo / "services" / "envsandbox"
    needed = [f for f in package.rglob("*") if f.is_file() and f.suffix not in (".py", ".pyc") and "__pycache__" not in f.parts]
    assert any(f.name == "sandbox_exec.c" for f in needed)
    missing = [str(f.relative_to(package)) for f in needed if not any(f.relative_to(package).match(pattern) or _glob_match(package, f, pattern) for pattern in patterns)]
    assert not missing, f"not in the package data of services.envsandbox: {missing}"


def _glob_match(package: Path, path: Path, pattern: str) -> bool:
    return path in set(package.glob(pattern))
