"""Process-backend sandboxes: a private workspace directory per sandbox, commands run
in their own process group and network namespace with resource limits, a wall-clock
timeout that kills the whole group, and capped output.

This module is the service's pure core: it knows nothing of gRPC.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from meridian.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from services.envsandbox.tasks import TESTS_DIR, Task, TestOutcome, score_output

_SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
_READ_CHUNK = 64 * 1024


@dataclasses.dataclass(frozen=True)
class Limits:
    memory_bytes: int = 512 * 1024 * 1024
    cpu_seconds: float = 30.0
    wall_seconds: float = 20.0
    max_output_bytes: int = 1024 * 1024
    max_file_bytes: int = 64 * 1024 * 1024

    def merged(self, **overrides: float | int) -> "Limits":
        """These limits with every positive override applied."""
        return dataclasses.replace(self, **{k: v for k, v in overrides.items() if v and v > 0})


@dataclasses.dataclass(frozen=True)
class ExecResult:
    exit_code: int
    signal: int
    timed_out: bool
    stdout_truncated: bool
    stderr_truncated: bool
    wall_seconds: float


@dataclasses.dataclass
class Sandbox:
    sandbox_id: str
    workspace: Path
    task: Task | None
    limits: Limits
    created: float
    expires: float
    client_request_id: str = ""
    running: set[asyncio.subprocess.Process] = dataclasses.field(default_factory=set)


def _isolation_prefix() -> list[str]:
    """Runs commands without network interfaces when we may create namespaces."""
    unshare = shutil.which("unshare")
    if unshare and os.geteuid() == 0:
        return [unshare, "--net", "--"]
    return []


def _limits_prefix(limits: Limits) -> list[str]:
    """Resource limits applied by ``prlimit`` in the child.

    A ``preexec_fn`` would run Python (and gRPC's fork handlers) between fork and exec
    in this multi-threaded server, which deadlocks; an exec'd wrapper does not.
    """
    prlimit = shutil.which("prlimit")
    if prlimit is None:
        raise FailedPrecondition("prlimit (util-linux) is required to limit sandboxed commands")
    cpu = max(1, int(limits.cpu_seconds))
    return [
        prlimit,
        f"--as={limits.memory_bytes}",
        f"--cpu={cpu}:{cpu + 1}",
        f"--fsize={limits.max_file_bytes}",
        "--core=0",
        "--",
    ]


def resolve_inside(root: Path, relative: str) -> Path:
    """``root/relative`` if it stays inside ``root`` after following symlinks; else InvalidArgument."""
    if not relative or relative.startswith("/") or "\x00" in relative:
        raise InvalidArgument(f"path must be relative and non-empty: {relative!r}")
    candidate = Path(os.path.realpath(root / relative))
    real_root = Path(os.path.realpath(root))
    if candidate != real_root and real_root not in candidate.parents:
        raise InvalidArgument(f"path escapes the workspace: {relative!r}")
    return candidate


class SandboxManager:
    """Owns every live sandbox of one service process."""

    def __init__(
        self,
        root: Path | None = None,
        default_limits: Limits = Limits(),
        default_ttl_s: float = 600.0,
        max_sandboxes: int = 256,
    ) -> None:
        self.root = Path(root or tempfile.mkdtemp(prefix="meridian-sandboxes-"))
        self.root.mkdir(parents=True, exist_ok=True)
        self.default_limits = default_limits
        self.default_ttl_s = default_ttl_s
        self.max_sandboxes = max_sandboxes
        self._boxes: dict[str, Sandbox] = {}
        self._by_request: dict[str, str] = {}
        self._prefix = _isolation_prefix()

    # ------------------------------------------------------------ lifecycle

    def create(
        self,
        task: Task | None = None,
        files: dict[str, bytes] | None = None,
        limits: Limits | None = None,
        ttl_s: float = 0.0,
        client_request_id: str = "",
    ) -> Sandbox:
        """A new sandbox holding the task's files then ``files``; idempotent per request id."""
        if client_request_id and client_request_id in self._by_request:
            existing = self._boxes.get(self._by_request[client_request_id])
            if existing is not None:
                return existing
        if len(self._boxes) >= self.max_sandboxes:
            raise ResourceExhausted(f"live sandbox limit reached ({self.max_sandboxes}); close some first")
        if ttl_s < 0:
            raise InvalidArgument(f"ttl_seconds must be >= 0, got {ttl_s}")
        sandbox_id = "sbx-" + uuid.uuid4().hex[:16]
        workspace = self.root / sandbox_id
        workspace.mkdir(mode=0o755)
        now = time.time()
        box = Sandbox(
            sandbox_id=sandbox_id,
            workspace=workspace,
            task=task,
            limits=limits or (self.default_limits.merged(**dataclasses.asdict(task.limits)) if task else self.default_limits),
            created=now,
            expires=now + (ttl_s or self.default_ttl_s),
            client_request_id=client_request_id,
        )
        self._boxes[sandbox_id] = box
        if client_request_id:
            self._by_request[client_request_id] = sandbox_id
        try:
            if task is not None:
                self.write_files(sandbox_id, {p: c.encode() for p, c in task.files.items()})
            if files:
                self.write_files(sandbox_id, files)
        except Exception:
            self._remove(box)
            raise
        return box

    def get(self, sandbox_id: str) -> Sandbox:
        try:
            return self._boxes[sandbox_id]
        except KeyError:
            raise NotFound(f"no live sandbox {sandbox_id!r}") from None

    def list(self) -> list[Sandbox]:
        return list(self._boxes.values())

    async def close(self, sandbox_id: str) -> None:
        """Kills whatever still runs in the sandbox and deletes its workspace."""
        box = self.get(sandbox_id)
        for proc in list(box.running):
            _kill_group(proc)
        self._remove(box)

    def _remove(self, box: Sandbox) -> None:
        self._boxes.pop(box.sandbox_id, None)
        if box.client_request_id:
            self._by_request.pop(box.client_request_id, None)
        shutil.rmtree(box.workspace, ignore_errors=True)

    async def reap_expired(self, now: float | None = None) -> list[str]:
        """Closes sandboxes past their time-to-live; returns their ids."""
        now = time.time() if now is None else now
        expired = [b.sandbox_id for b in self._boxes.values() if b.expires <= now]
        for sandbox_id in expired:
            await self.close(sandbox_id)
        return expired

    async def close_all(self) -> None:
        for sandbox_id in list(self._boxes):
            await self.close(sandbox_id)
        shutil.rmtree(self.root, ignore_errors=True)

    def fork(self, sandbox_id: str, count: int) -> list[Sandbox]:
        """``count`` new sandboxes, each with a copy of the source's workspace."""
        if count <= 0 or count > 64:
            raise InvalidArgument(f"fork count must be in 1..64, got {count}")
        src = self.get(sandbox_id)
        if len(self._boxes) + count > self.max_sandboxes:
            raise ResourceExhausted(f"forking {count} would exceed the live sandbox limit ({self.max_sandboxes})")
        copies = []
        for _ in range(count):
            box = self.create(task=None, limits=src.limits, ttl_s=max(1.0, src.expires - time.time()))
            box.task = src.task
            shutil.copytree(src.workspace, box.workspace, symlinks=True, dirs_exist_ok=True)
            copies.append(box)
        return copies

    # ------------------------------------------------------------ files

    def write_files(self, sandbox_id: str, files: dict[str, bytes], mode: int = 0o644) -> None:
        box = self.get(sandbox_id)
        for rel, content in files.items():
            if len(content) > box.limits.max_file_bytes:
                raise InvalidArgument(f"file {rel!r} is {len(content)} bytes, over the {box.limits.max_file_bytes} limit")
            path = resolve_inside(box.workspace, rel)
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.is_symlink():
                path.unlink()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
            with os.fdopen(fd, "wb") as fh:
                fh.write(content)

    def read_files(self, sandbox_id: str, paths: list[str]) -> dict[str, bytes]:
        box = self.get(sandbox_id)
        out = {}
        for rel in paths:
            path = resolve_inside(box.workspace, rel)
            if not path.is_file():
                raise NotFound(f"no file {rel!r} in sandbox {sandbox_id}")
            if path.stat().st_size > box.limits.max_output_bytes:
                raise InvalidArgument(f"file {rel!r} is larger than {box.limits.max_output_bytes} bytes")
            out[rel] = path.read_bytes()
        return out

    # ------------------------------------------------------------ exec

    async def exec(
        self,
        sandbox_id: str,
        argv: list[str],
        stdin: bytes = b"",
        env: dict[str, str] | None = None,
        cwd: str = "",
        timeout_s: float = 0.0,
    ) -> AsyncIterator[tuple[str, bytes] | ExecResult]:
        """Runs ``argv``; yields ``("stdout"|"stderr", bytes)`` chunks, then an ExecResult."""
        box = self.get(sandbox_id)
        if not argv or not argv[0]:
            raise InvalidArgument("argv must name a command")
        workdir = resolve_inside(box.workspace, cwd) if cwd else box.workspace
        if not workdir.is_dir():
            raise InvalidArgument(f"cwd {cwd!r} is not a directory in the sandbox")
        limits = box.limits
        wall = min(timeout_s, limits.wall_seconds) if timeout_s > 0 else limits.wall_seconds
        full_env = {"PATH": _SAFE_PATH, "HOME": str(box.workspace), "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
        full_env.update(env or {})
        start = time.monotonic()
        try:
            proc = await asyncio.create_subprocess_exec(
                *_limits_prefix(limits),
                *self._prefix,
                *argv,
                cwd=workdir,
                env=full_env,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
            )
        except (FileNotFoundError, PermissionError) as exc:
            raise FailedPrecondition(f"cannot start {argv[0]!r}: {exc}") from exc
        box.running.add(proc)
        queue: asyncio.Queue[tuple[str, bytes] | None] = asyncio.Queue()
        budget = {"stdout": limits.max_output_bytes, "stderr": limits.max_output_bytes}
        truncated = {"stdout": False, "stderr": False}

        async def pump(name: str, stream: asyncio.StreamReader) -> None:
            while chunk := await stream.read(_READ_CHUNK):
                keep = chunk[: max(0, budget[name])]
                budget[name] -= len(chunk)
                if len(keep) < len(chunk):
                    truncated[name] = True
                if keep:
                    await queue.put((name, keep))
            await queue.put(None)

        async def feed() -> None:
            assert proc.stdin is not None
            try:
                if stdin:
                    proc.stdin.write(stdin)
                    await proc.stdin.drain()
                proc.stdin.close()
            except (BrokenPipeError, ConnectionResetError):
                pass

        assert proc.stdout is not None and proc.stderr is not None
        tasks = [asyncio.create_task(pump("stdout", proc.stdout)), asyncio.create_task(pump("stderr", proc.stderr)), asyncio.create_task(feed())]
        timed_out = False
        deadline = start + wall
        try:
            open_streams = 2
            while open_streams:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    timed_out = True
                    break
                try:
                    item = await asyncio.wait_for(queue.get(), timeout=remaining)
                except TimeoutError:
                    timed_out = True
                    break
                if item is None:
                    open_streams -= 1
                else:
                    yield item
            if timed_out:
                _kill_group(proc)
            try:
                await asyncio.wait_for(proc.wait(), timeout=max(0.1, deadline - time.monotonic()) if not timed_out else 5)
            except TimeoutError:
                timed_out = True
                _kill_group(proc)
                await proc.wait()
        finally:
            # Whatever the outcome (also a cancelled client), nothing of this exec survives it.
            _kill_group(proc)
            for t in tasks:
                t.cancel()
            box.running.discard(proc)
        code = proc.returncode if proc.returncode is not None else -1
        yield ExecResult(
            exit_code=code if code >= 0 else -1,
            signal=-code if code < 0 else 0,
            timed_out=timed_out,
            stdout_truncated=truncated["stdout"],
            stderr_truncated=truncated["stderr"],
            wall_seconds=time.monotonic() - start,
        )

    async def run_tests(self, sandbox_id: str) -> tuple[TestOutcome, ExecResult, bytes]:
        """Writes the task's hidden tests, runs its test command and scores the output."""
        box = self.get(sandbox_id)
        if box.task is None:
            raise FailedPrecondition(f"sandbox {sandbox_id} was not created from a task")
        task = box.task
        tests_dir = box.workspace / TESTS_DIR
        shutil.rmtree(tests_dir, ignore_errors=True)
        self.write_files(sandbox_id, {f"{TESTS_DIR}/{p}": c.encode() for p, c in task.tests.items()})
        output = bytearray()
        result: ExecResult | None = None
        async for item in self.exec(sandbox_id, task.test_command, timeout_s=task.limits.wall_seconds):
            if isinstance(item, ExecResult):
                result = item
            else:
                output += item[1]
        assert result is not None
        outcome = score_output(task.reward, output.decode(errors="replace"), result.exit_code)
        return outcome, result, bytes(output)


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
