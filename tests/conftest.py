"""Shared fixtures: a real throw-away redis-server, free loopback ports, and an
in-process gRPC server that wraps a Meridian ``Service`` the way production does
(the ErrorBoundary interceptor plus the standard health service).

pytest-asyncio is not used: tests call ``asyncio.run(...)`` themselves and use the
``serving`` async context manager inside that loop.
"""
from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from meridian import credentials
from meridian.grpc_runtime import Service, ServerConfig, bind, create_server

REDIS_SERVER = "/usr/bin/redis-server"


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compiles weightsync's numba kernels before any test runs (see
    services/weightsync/precompile.py): from an empty cache that takes a minute or two,
    which would otherwise fall inside the first weightsync test's timeout."""
    from services.weightsync.precompile import precompile

    precompile()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _redis_ping(port: int) -> bool:
    """True once redis answers PING with +PONG on ``port``."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def _start_redis(workdir: Path, attempts: int = 3, port: int = 0) -> tuple[subprocess.Popen[bytes], int]:
    """Starts a private redis-server on ``port`` (0: a free one; then it retries with a new
    port if another process won the race)."""
    last_error = ""
    fixed = port
    for _ in range(1 if fixed else attempts):
        port = fixed or free_port()
        log = workdir / f"redis-{port}.log"
        proc = subprocess.Popen(
            [
                REDIS_SERVER,
                "--port", str(port),
                "--bind", "127.0.0.1",
                "--save", "",
                "--appendonly", "no",
                "--dir", str(workdir),
                "--logfile", str(log),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 15.0
        while time.monotonic() < deadline and proc.poll() is None:
            if _redis_ping(port):
                return proc, port
            time.sleep(0.02)
        last_error = log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"
        _stop_process(proc)
    raise RuntimeError(f"redis-server did not come up after {attempts} attempts:\n{last_error}")


def _stop_process(proc: subprocess.Popen[bytes]) -> None:
    """Terminates exactly this process (by its own handle) and reaps it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


class RestartableRedis:
    """A private redis-server that a test can stop and start again on the same port (an
    outage), always stopped at the end."""

    def __init__(self, workdir: Path) -> None:
        self._workdir = workdir
        self._proc, self.port = _start_redis(workdir)
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        _stop_process(self._proc)

    def start(self) -> None:
        """Starts it again, empty, on the same port."""
        if self._proc.poll() is None:
            raise RuntimeError("redis-server is still running")
        self._proc, _ = _start_redis(self._workdir, port=self.port)


@pytest.fixture
def restartable_redis(tmp_path: Path) -> Iterator[RestartableRedis]:
    """A :class:`RestartableRedis` (``url``, ``stop()``, ``start()``)."""
    workdir = tmp_path / "redis"
    workdir.mkdir()
    redis = RestartableRedis(workdir)
    try:
        yield redis
    finally:
        redis.stop()


@pytest.fixture
def redis_url(restartable_redis: RestartableRedis) -> str:
    """``redis://127.0.0.1:PORT/0`` of a fresh, empty, non-persistent redis-server."""
    return restartable_redis.url


@contextlib.asynccontextmanager
async def serving(
    service: Service,
    options: Sequence[tuple[str, Any]] = (),
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    config: ServerConfig | None = None,
    port: int = 0,
    secure: tuple[str, Path] | None = None,
) -> AsyncIterator[str]:
    """Runs ``service`` on a loopback port (``port``, or a free one) inside the running
    loop; yields its address.

    Mirrors :func:`meridian.grpc_runtime.run_server`: the same server (ErrorBoundary with
    the call limits of ``config`` and the service), health (SERVING only after
    ``service.start()`` returned), and on exit stop the server, then the service.
    ``options`` default to gRPC's own (4 MiB messages), not ``config``'s. Plaintext
    without tokens unless ``secure`` is (service name, credentials folder): then mTLS
    with that service's certificate and the token/role interceptor, as ``meridian serve``.
    """
    digest_roles = credentials.token_digests(secure[1]) if secure else None
    server = create_server(service, config or ServerConfig(), interceptors, options=options, digest_roles=digest_roles)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    service.register(server)
    bound = bind(server, "127.0.0.1", port, *secure) if secure else server.add_insecure_port(f"127.0.0.1:{port}")
    if bound == 0 or (port and bound != port):
        raise RuntimeError(f"cannot bind 127.0.0.1:{port or 'a free port'} for the test server")
    port = bound
    await server.start()
    try:
        await service.start()
        for name in ("", *service.service_names):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(grace=None)
        await service.stop()


@pytest.fixture(scope="session")
def credentials_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A credentials folder as ``meridian certs`` makes it, shared by the session."""
    return credentials.make_credentials(tmp_path_factory.mktemp("credentials") / "credentials")


@pytest.fixture
def pick_port() -> Any:
    """The :func:`free_port` helper (test modules cannot import conftest by name)."""
    return free_port


@pytest.fixture
def grpc_serving() -> Any:
    """The :func:`serving` factory, for tests that prefer a fixture to an import."""
    return serving
