"""The local stack without Docker: ``meridian up`` starts its own redis-server (AOF on,
fsynced before every reply, data in the run folder) and the four services as child
processes, waits until each reports SERVING, and records PIDs, addresses and logs in ``<run_dir>/stack.json``;
``meridian down`` stops them in reverse order (SIGTERM, then SIGKILL after a grace
period, always by PID and process group); ``meridian status`` reports health, policy
versions and the trajectory stream."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

from meridian import credentials, regions
from meridian.config import add_config_args, config_from_args, opt
from meridian.regions import parse_regions

STATE_FILE = "stack.json"
SERVICE_ORDER = ("envsandbox", "weightsync", "trainer", "rollout")
_LISTEN = re.compile(r"meridian (\w+) listening on ([\d.]+):(\d+)")
_HTTP_LISTEN = re.compile(r"meridian rollout http listening on ([\d.]+):(\d+)")
_METRICS_LISTEN = re.compile(r"meridian \w+ metrics on ([\d.]+):(\d+)")
#: Metrics endpoints under `meridian up --ports fixed` (auto, and remote regions: free ports).
FIXED_METRICS_PORTS = {"rollout": 9451, "envsandbox": 9452, "trainer": 9453, "weightsync": 9454}


@dataclasses.dataclass
class StackConfig:
    run_dir: str = opt(".meridian/run", "folder for the stack's state file, logs and Redis data")
    model: str = opt("builtin", "model folder for rollout and trainer ('builtin': SmolLM2-135M-Instruct)")
    host: str = opt("127.0.0.1", "address every service listens on")
    ports: str = opt("fixed", "'fixed' (redis 6390, rollout 50051 and HTTP 8051, envsandbox 50052, trainer 50053, weightsync 50054) or 'auto' (free ports)")
    ready_timeout_s: float = opt(900.0, "seconds to wait for every service to report SERVING")
    stop_timeout_s: float = opt(30.0, "seconds to wait after SIGTERM before SIGKILL")
    regions: str = opt("a", "comma-separated region names; the first runs Redis, the trainer and the weightsync origin, each other one an envsandbox, a weightsync relay behind an emulated link to the origin, and a rollout (its services take free ports)")
    link_mbit_s: float = opt(100.0, "bandwidth of each emulated inter-region link, Mbit/s per direction (0: unlimited)")
    link_latency_ms: float = opt(50.0, "one-way latency of each emulated inter-region link, ms")
    sign_versions: bool = opt(True, "the trainer signs every policy version with the credentials' signing key; the weightsync origin, relays and rollouts refuse versions it did not sign")
    engine_cpus: str = opt("auto", "every rollout's --engine-cpus: 'auto' (vLLM's binding), 'none' (unbound) or a CPU list")

    def __post_init__(self) -> None:
        from services.rollout.engine import check_engine_cpus

        if self.ports not in ("fixed", "auto"):
            raise ValueError(f"ports must be fixed or auto, got {self.ports!r}")
        check_engine_cpus(self.engine_cpus)
        parse_regions(self.regions)
        if self.link_mbit_s < 0 or self.link_latency_ms < 0:
            raise ValueError("link_mbit_s and link_latency_ms must be >= 0")


FIXED_PORTS = {"redis": 6390, "rollout": 50051, "envsandbox": 50052, "trainer": 50053, "weightsync": 50054, "rollout_http": 8051}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclasses.dataclass
class Stack:
    """A running local stack, as recorded in its state file."""

    run_dir: Path
    pids: dict[str, int]
    addresses: dict[str, str]
    logs: dict[str, str]
    redis_url: str
    home_region: str = "a"
    #: the stack's credentials folder ('' for a stack recorded without one)
    credentials: str = ""
    #: Prometheus endpoint of each process, by its name in ``pids``.
    metrics: dict[str, str] = dataclasses.field(default_factory=dict)
    #: Each process's command line, with the ports it took written in: what
    #: :meth:`restart` runs again (clients reconnect to the same addresses).
    argv: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    #: Variables the processes got beyond this process's environment (the credentials
    #: folder, and what ``start`` was given): :meth:`restart` gives them again.
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    #: Each process's start time (clock ticks since boot, from /proc): a state file
    #: outliving its stack must not make ``stop`` signal whoever took a PID since.
    starts: dict[str, int] = dataclasses.field(default_factory=dict)

    def save(self) -> None:
        """Records the stack, and makes this process call its services (and Redis) as
        their operator: what ``meridian status`` and the benches rely on."""
        for name, pid in self.pids.items():
            if name not in self.starts and (start := start_time(pid)) is not None:
                self.starts[name] = start
        (self.run_dir / STATE_FILE).write_text(json.dumps(dataclasses.asdict(self), default=str, indent=2))
        self.use_credentials()

    def use_credentials(self) -> None:
        """Calls from this process to the stack's addresses present its operator credentials."""
        if self.credentials:
            credentials.register(self.addresses.values(), credentials.Identity(Path(self.credentials), "operator"))

    @classmethod
    def load(cls, run_dir: Path) -> "Stack | None":
        path = run_dir / STATE_FILE
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        data["run_dir"] = Path(data["run_dir"])
        stack = cls(**data)
        stack.use_credentials()
        return stack

    def stop(self, timeout_s: float = 30.0) -> list[str]:
        """Stops every process in the reverse order of their start (remote regions before
        the home region's services), Redis last; returns what needed SIGKILL."""
        killed = []
        for name in [*reversed([n for n in self.pids if n != "redis"]), "redis"]:
            pid = self.pids.get(name)
            if pid and self.ours(name) and not _terminate(pid, timeout_s):
                killed.append(name)
        (self.run_dir / STATE_FILE).unlink(missing_ok=True)
        credentials.unregister(self.addresses.values())
        return killed

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Sends ``sig`` to process ``name``'s whole group; after SIGKILL, returns once
        every member is gone (a fault as a crash makes it: nothing exits cleanly)."""
        pid = self.pids[name]
        if not self.ours(name):
            return
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            pass
        if sig == signal.SIGKILL:
            _wait_group_empty(pid)
            _reap(pid)

    def restart(self, name: str, timeout_s: float = 120.0) -> int:
        """Starts process ``name`` again with its recorded command line and environment,
        on the same port (Redis with the same data folder and config); returns its new
        PID once it accepts connections. Whatever of the old group still runs is stopped
        first. The caller waits for SERVING where it needs to."""
        argv = self.argv.get(name)
        if not argv:
            raise KeyError(f"no command line recorded for {name!r} (a stack started before restarts were possible?)")
        old = self.pids.get(name)
        if old and self.ours(name) and group_members(old):
            _terminate(old, 10.0)
        env = {**os.environ, **self.env}
        env.pop(credentials.ENV_ROLE, None)
        proc = _spawn(argv, Path(self.logs[name]), env)
        self.pids[name] = proc.pid
        self.starts.pop(name, None)
        self.save()
        host, port = _host_port(self.addresses[name])
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode} on restart; see {self.logs[name]}")
            with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
                return proc.pid
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} did not listen on {host}:{port} within {timeout_s:.0f}s of its restart; see {self.logs[name]}")
            time.sleep(0.1)


    def ours(self, name: str) -> bool:
        """Whether process ``name``'s PID still names the process this stack started. A
        leader that is gone counts as ours: while any member of its group lives, Linux
        does not hand its PID (the group's id) to another process."""
        recorded = self.starts.get(name)
        now = start_time(self.pids[name])
        return recorded is None or now is None or now == recorded


def remove_state(run_dir: Path, keep: frozenset[str] = frozenset()) -> int:
    """Removes what a stopped stack left in ``run_dir`` (Redis data, trainer checkpoints,
    version stores, sandboxes, credentials, configs) except its logs (``*.log``) and the
    entries named in ``keep``; returns the bytes freed. For a run folder nobody asked to
    keep: a job's stack leaves gigabytes there (the built-in model's two trainer
    checkpoints alone are 3.3 GB), and a temporary folder is often memory (tmpfs)."""
    freed = 0
    for entry in run_dir.iterdir():
        if entry.name in keep or (entry.suffix == ".log" and not entry.is_dir()):
            continue
        freed += _disk_bytes(entry)
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    return freed


def empty_temporary_run_dir(run_dir: Path, keep: frozenset[str] = frozenset()) -> None:
    """:func:`remove_state` of a run folder a command made for itself, once its stack has
    stopped, saying on stderr what it freed. A failure is reported, not raised: the
    command's work is over."""
    try:
        freed = remove_state(run_dir, keep)
    except OSError as exc:
        print(f"could not remove the stopped stack's state from {run_dir}: {exc}", file=sys.stderr, flush=True)
        return
    print(f"removed the stopped stack's state from {run_dir} ({freed / 2**30:.1f} GiB: checkpoints, version stores, "
          "Redis data, credentials); its logs stay", file=sys.stderr, flush=True)


def _disk_bytes(path: Path) -> int:
    """The bytes of ``path``'s files, not following links."""
    if not path.is_dir() or path.is_symlink():
        return path.lstat().st_size
    return sum(Path(root, name).lstat().st_size for root, _, names in os.walk(path) for name in names)


def start_time(pid: int) -> int | None:
    """Process ``pid``'s start time in clock ticks since boot (None: no such process)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2 :].split()[19])  # field 22 of proc(5)


def _host_port(address: str) -> tuple[str, int]:
    """(host, port) of ``host:port`` or a ``redis://host:port/db`` URL."""
    hostport = address.split("://", 1)[-1].split("/", 1)[0]
    host, _, port = hostport.rpartition(":")
    return host, int(port)


def _with_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """``argv`` with every ``flag X`` set to ``flag value`` (the last one wins anyway)."""
    out = list(argv)
    for i, arg in enumerate(out[:-1]):
        if arg == flag:
            out[i + 1] = value
    return out


def pin_ports(stack: Stack) -> None:
    """Writes the ports each process took (``--port 0``: a free one) into its recorded
    command line, so that a restart listens where its clients look."""
    for name, argv in stack.argv.items():
        if name == "redis" or name not in stack.addresses:
            continue
        argv = _with_flag(argv, "--port", str(_host_port(stack.addresses[name])[1]))
        if name in stack.metrics:
            argv = _with_flag(argv, "--metrics-port", str(_host_port(stack.metrics[name])[1]))
        if name == "rollout" and "rollout_http" in stack.addresses:
            argv = _with_flag(argv, "--http-port", str(_host_port(stack.addresses["rollout_http"])[1]))
        stack.argv[name] = argv


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child of ours counts as gone once reaped
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return True


def group_members(pgid: int) -> list[int]:
    """Processes of process group ``pgid`` that are still running (zombies are over:
    they hold no resources but their PID, and only their parent can reap them)."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue  # exited while we looked
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def _reap(pid: int) -> None:
    """Collects our own exited child so it does not linger as a zombie."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _terminate(pid: int, timeout_s: float) -> bool:
    """Stops the process group led by ``pid``: SIGTERM to the group; once the leader has
    exited (or after ``timeout_s``) SIGKILL to whatever the group still holds (engine
    workers, helpers that ignore SIGTERM); returns only when no process of the group is
    left. True if the leader exited in time by itself."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + timeout_s
    clean = False
    while time.monotonic() < deadline:
        if not _alive(pid):
            clean = True
            break
        time.sleep(0.1)
    _kill_group(pid)
    _wait_group_empty(pid)
    _reap(pid)
    return clean


def _wait_group_empty(pgid: int, timeout_s: float = 30.0) -> None:
    """Waits until every member of ``pgid`` is gone, killing again as needed (a process
    forked between the kill and now is in the group too)."""
    deadline = time.monotonic() + timeout_s
    while members := group_members(pgid):
        if time.monotonic() > deadline:
            raise RuntimeError(f"process group {pgid} still has {members} after SIGKILL")
        _kill_group(pgid)
        time.sleep(0.05)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _spawn(argv: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    log = open(log_path, "ab")
    # Own session: the whole process tree (vLLM spawns workers) stops as one group.
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True)


def _wait_for_listen(name: str, proc: subprocess.Popen[bytes], log_path: Path, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode} before listening; see {log_path}")
        m = _LISTEN.search(log_path.read_text(errors="replace"))
        if m and m.group(1) == name:
            return f"{m.group(2)}:{m.group(3)}"
        time.sleep(0.1)
    raise TimeoutError(f"{name} did not start listening in {timeout_s:.0f}s; see {log_path}")


def wait_serving(addresses: dict[str, str], procs: dict[str, subprocess.Popen[bytes]], logs: dict[str, str], timeout_s: float) -> None:
    """Waits until every named service reports SERVING on its health service."""
    from meridian.grpc_runtime import check_health

    deadline = time.monotonic() + timeout_s
    pending = set(addresses)
    while pending:
        for name in list(pending):
            if procs[name].poll() is not None:
                raise RuntimeError(f"{name} exited with {procs[name].returncode} during warm-up; see {logs[name]}")
            if asyncio.run(check_health(addresses[name])) == "SERVING":
                pending.discard(name)
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"not SERVING after {timeout_s:.0f}s: {sorted(pending)}; see {[logs[n] for n in sorted(pending)]}")
        time.sleep(0.5)


def spawn_service(
    name: str, args: list[str], run_dir: Path, env: dict[str, str], host: str = "127.0.0.1", port: int = 0, label: str = ""
) -> tuple[subprocess.Popen[bytes], str, Path]:
    """Starts ``meridian serve NAME`` as the leader of its own process group, logging to
    ``run_dir/LABEL.log`` (``label`` defaults to the name; a remote region's copy of a
    service gets its own); returns the process, its address once it listens, and the log."""
    # Metrics on by default, on a free loopback port, unless ``args`` choose.
    metrics = [] if "--metrics-port" in args else ["--metrics-port", "0"]
    argv = [sys.executable, "-m", "meridian.cli", "serve", name, "--host", host, "--port", str(port), *metrics, *args]
    return spawn_listener(name, argv, run_dir / f"{label or name}.log", env)


def spawn_listener(name: str, argv: list[str], log: Path, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], str, Path]:
    """Starts a ``meridian`` process that prints ``meridian NAME listening on host:port``
    (a service, a link) in its own process group; returns it once it listens."""
    log.write_bytes(b"")
    proc = _spawn(argv, log, env)
    try:
        return proc, _wait_for_listen(name, proc, log, 120), log
    except BaseException:
        _terminate(proc.pid, 5.0)
        raise


def _start_redis(run_dir: Path, host: str, port: int, env: dict[str, str], credentials_dir: Path | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """Starts redis-server; with ``credentials_dir`` its users and passwords come from
    there (written to a 0600 config file, never onto the command line) and it speaks TLS
    only, to clients that present a certificate of the deployment's CA (``rediss://``).
    The URL returned names no user: each client logs in as its own role."""
    server = shutil.which("redis-server")
    if server is None:
        raise FileNotFoundError("redis-server not found (make install installs it)")
    data = run_dir / "redis"
    data.mkdir(parents=True, exist_ok=True)
    log = run_dir / "redis.log"
    conf = run_dir / "redis.conf"
    conf.unlink(missing_ok=True)
    fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("" if credentials_dir is None else credentials.redis_acl(credentials.redis_passwords(credentials_dir)))
    # appendfsync always: Redis fsyncs the append-only file before it answers a write, so
    # an XADD a rollout was told succeeded, or an XACK the trainer made after its
    # checkpoint, survives a host crash; exactly-once delivery rests on both.
    # (everysec, Redis' default, can lose the last second of acknowledged writes.)
    listen = ["--port", str(port)]
    tls = None
    if credentials_dir is not None:
        cert, key = credentials.cert_path(credentials_dir, credentials.REDIS_SERVER)
        listen = ["--port", "0", "--tls-port", str(port), "--tls-cert-file", str(cert), "--tls-key-file", str(key),
                  "--tls-ca-cert-file", str(credentials_dir / credentials.CA), "--tls-auth-clients", "yes"]
        tls = _redis_probe_tls(credentials_dir)
    argv = [
        server, str(conf), "--bind", host, *listen, "--dir", str(data), "--appendonly", "yes", "--appendfsync", "always",
        "--save", "", "--daemonize", "no", "--protected-mode", "yes",
    ]
    # Something answering there already would pass the readiness probe below while our
    # server fails to bind: the stack would run against another Redis (other passwords).
    if _answers_redis(host, port) or (tls is not None and _answers_redis(host, port, tls)):
        raise RuntimeError(f"{host}:{port} is in use by another Redis; stop it or choose another port")
    proc = _spawn(argv, log, env)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {proc.returncode}; see {log}")
            if _answers_redis(host, port, tls):
                return proc, f"{'redis' if tls is None else 'rediss'}://{host}:{port}/0"
            time.sleep(0.1)
        raise TimeoutError(f"redis-server did not answer on {host}:{port}; see {log}")
    except BaseException:
        _terminate(proc.pid, 5.0)  # not in the stack's PIDs yet: nothing else would stop it
        raise


def _redis_probe_tls(credentials_dir: Path) -> ssl.SSLContext:
    """A client TLS context for the stack's Redis: the deployment's CA and client certificate."""
    context = ssl.create_default_context(cafile=str(credentials_dir / credentials.CA))
    context.load_cert_chain(*(str(p) for p in credentials.cert_path(credentials_dir, "client")))
    return context


def _answers_redis(host: str, port: int, tls: ssl.SSLContext | None = None) -> bool:
    """Whether a Redis answers PING on ``host:port`` (PONG, or NOAUTH when it wants a
    login), through ``tls`` when given."""
    try:
        with socket.create_connection((host, port), timeout=0.5) as raw:
            with tls.wrap_socket(raw, server_hostname=host) if tls is not None else contextlib.nullcontext(raw) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False


def with_signing(folder: Path, extra_args: dict[str, list[str]]) -> dict[str, list[str]]:
    """``extra_args`` with version signing on: the trainer signs with ``folder``'s signing
    key, the weightsync origin and relays and every rollout verify with its public key
    (a remote region's services take the same extra arguments). Makes the pair when the
    folder has none (one made before versions were signed). Given arguments come after
    these, so a flag given there wins."""
    from services.weightsync.signing import generate_signing_key

    private, public = folder / credentials.SIGNING_KEY, folder / credentials.SIGNING_PUB
    if not (private.exists() and public.exists()):
        generate_signing_key(private, public)
    signing = {"trainer": ["--signing-key", str(private)], "weightsync": ["--verify-key", str(public)], "rollout": ["--verify-key", str(public)]}
    return {name: [*signing.get(name, []), *extra_args.get(name, [])] for name in {*signing, *extra_args}}


def start(config: StackConfig, extra_args: dict[str, list[str]] | None = None, env: dict[str, str] | None = None) -> Stack:
    """Starts the stack and returns once every service is SERVING (stops it all on failure)."""
    run_dir = Path(config.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    existing = Stack.load(run_dir)
    if existing and any(_alive(p) for p in existing.pids.values()):
        raise RuntimeError(f"a stack is already running from {run_dir}; run `meridian down` first")
    # Authenticated with no step of the user's: the run folder's credentials (made on the
    # first start) reach every service through MERIDIAN_CREDENTIALS; each takes its own
    # role (a role set for this process is not theirs).
    creds = credentials.ensure_credentials(run_dir / "credentials", [] if credentials.is_loopback(config.host) else [config.host])
    child_env = {**os.environ, **(env or {}), credentials.ENV_CREDENTIALS: str(creds)}
    child_env.pop(credentials.ENV_ROLE, None)
    extra_args = with_signing(creds, extra_args or {}) if config.sign_versions else (extra_args or {})
    port = (lambda name: free_port(config.host)) if config.ports == "auto" else FIXED_PORTS.__getitem__
    home, *remote = parse_regions(config.regions)
    stack = Stack(run_dir, {}, {}, {}, "", home, credentials=str(creds), env={**(env or {}), credentials.ENV_CREDENTIALS: str(creds)})
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        # Redis listens on loopback whatever --host says (and speaks TLS only).
        redis_host = config.host if credentials.is_loopback(config.host) else "127.0.0.1"
        procs["redis"], stack.redis_url = _start_redis(run_dir, redis_host, port("redis"), child_env, creds)
        stack.pids["redis"] = procs["redis"].pid
        stack.argv["redis"] = [str(a) for a in procs["redis"].args]  # type: ignore[union-attr]
        stack.addresses["redis"] = stack.redis_url
        stack.logs["redis"] = str(run_dir / "redis.log")
        stack.save()

        def launch(name: str, args: list[str]) -> None:
            svc_port = 0 if config.ports == "auto" else port(name)
            metrics = ["--metrics-port", str(0 if config.ports == "auto" else FIXED_METRICS_PORTS[name])]
            procs[name], address, log = spawn_service(name, [*metrics, *args, *extra_args.get(name, [])], run_dir, child_env, config.host, svc_port)
            stack.pids[name], stack.logs[name], stack.addresses[name] = procs[name].pid, str(log), address
            stack.argv[name] = [str(a) for a in procs[name].args]  # type: ignore[union-attr]
            stack.save()

        def serving(names: list[str]) -> None:
            wait_serving({n: stack.addresses[n] for n in names}, procs, stack.logs, config.ready_timeout_s)

        launch("envsandbox", ["--root", str(run_dir / "sandboxes")])
        launch("weightsync", ["--data-dir", str(run_dir / "weightsync")])
        serving(["envsandbox", "weightsync"])
        common = ["--model", config.model, "--redis-url", stack.redis_url]
        launch("trainer", [*common, "--weightsync", stack.addresses["weightsync"], "--checkpoint-dir", str(run_dir / "trainer-checkpoints")])
        http_port = 0 if config.ports == "auto" else port("rollout_http")
        launch("rollout", [
            *common, "--weightsync", stack.addresses["weightsync"], "--envsandbox", stack.addresses["envsandbox"],
            "--http-host", config.host, "--http-port", str(http_port), "--region", home, "--engine-cpus", config.engine_cpus,
        ])
        serving(["trainer", "rollout"])
        # The HTTP API starts during the rollout's warm-up, so its line is there by now.
        if m := _HTTP_LISTEN.search(Path(stack.logs["rollout"]).read_text(errors="replace")):
            stack.addresses["rollout_http"] = f"http://{m.group(1)}:{m.group(2)}/v1"
            stack.save()
        for region in remote:
            start_remote_region(region, config, stack, procs, extra_args, child_env)
    except BaseException:
        stack.stop(config.stop_timeout_s)
        raise
    # Every service printed its metrics line before its warm-up: all are there by now.
    stack.metrics = metrics_endpoints(stack.logs)
    pin_ports(stack)
    stack.save()
    return stack


def metrics_endpoints(logs: dict[str, str]) -> dict[str, str]:
    """The metrics URL each process printed (``meridian <service> metrics on host:port``), by name."""
    found = {}
    for name, log in logs.items():
        if m := _METRICS_LISTEN.search(Path(log).read_text(errors="replace")):
            found[name] = f"http://{m.group(1)}:{m.group(2)}/metrics"
    return found


def start_remote_region(
    region: str, config: StackConfig, stack: Stack, procs: dict[str, subprocess.Popen[bytes]], extra_args: dict[str, list[str]], env: dict[str, str]
) -> None:
    """Starts a remote region (see :mod:`meridian.regions`) beside a running home region
    and waits until its services are SERVING. Its services take free ports, the stack's
    credentials (from ``env``) and the home region's per-service flags (version signing)."""

    def record(name: str, started: tuple[subprocess.Popen[bytes], str, Path]) -> None:
        procs[name], stack.addresses[name], log = started
        stack.pids[name], stack.logs[name] = procs[name].pid, str(log)
        stack.argv[name] = [str(a) for a in procs[name].args]  # type: ignore[union-attr]
        stack.save()

    def launch(service: str, args: list[str]) -> str:
        name = regions.label(service, region)
        # Metrics of the region's services carry its name (rollout labels its own).
        argv = [*([] if service == "rollout" else ["--metrics-region", region]), *args, *extra_args.get(service, [])]
        record(name, spawn_service(service, argv, stack.run_dir, env, config.host, 0, label=name))
        return name

    link = regions.link_argv(region, stack.addresses["weightsync"], config.host, stack.run_dir, config.link_mbit_s, config.link_latency_ms)
    record(link.label, spawn_listener(link.listens_as, link.argv, stack.run_dir / f"{link.label}.log", env))
    sandbox = launch("envsandbox", ["--root", str(stack.run_dir / regions.label("sandboxes", region))])
    relay = launch("weightsync", regions.relay_args(region, stack.addresses[link.label], stack.run_dir))
    wait_serving({n: stack.addresses[n] for n in (sandbox, relay)}, procs, stack.logs, config.ready_timeout_s)
    rollout = launch("rollout", [
        *regions.rollout_args(region, config.model, stack.redis_url, stack.addresses[relay], stack.addresses[sandbox]), "--engine-cpus", config.engine_cpus,
    ])
    wait_serving({rollout: stack.addresses[rollout]}, procs, stack.logs, config.ready_timeout_s)


async def gather_status(stack: Stack) -> dict[str, object]:
    """Health of each service, rollout and trainer versions, and the stream's counters."""
    from meridian.grpc_runtime import check_health, open_channel
    from meridian.trajectory_transport import TransportConfig, open_transport
    from meridian.v1 import rollout_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc, weightsync_pb2, weightsync_pb2_grpc

    out: dict[str, object] = {"services": {}}
    for name in SERVICE_ORDER:
        addr = stack.addresses.get(name, "")
        out["services"][name] = {"address": addr, "health": await check_health(addr) if addr else "NOT STARTED", "pid": stack.pids.get(name)}  # type: ignore[index]
    calls = {
        "rollout": lambda ch: rollout_pb2_grpc.RolloutStub(ch).Status(rollout_pb2.RolloutStatusRequest(), timeout=5),
        "trainer": lambda ch: trainer_pb2_grpc.TrainerStub(ch).Status(trainer_pb2.TrainerStatusRequest(), timeout=5),
        "weightsync": lambda ch: weightsync_pb2_grpc.WeightSyncStub(ch).Status(weightsync_pb2.WeightSyncStatusRequest(), timeout=5),
    }
    for name, call in calls.items():
        if out["services"][name]["health"] != "SERVING":  # type: ignore[index]
            continue
        async with open_channel(stack.addresses[name]) as ch:
            reply = await call(ch)
        out["services"][name]["policy_version"] = reply.latest_version if name == "weightsync" else reply.policy_version  # type: ignore[index]
        if name == "rollout":
            out["services"][name]["rl_admission"] = {  # type: ignore[index]
                "limit": reply.rl_concurrency_limit, "running": reply.rl_running, "preemptions": reply.rl_preemptions,
                "slo_attainment": round(reply.slo_attainment, 4), "rl_token_share": round(reply.rl_token_share, 4),
            }

    async def status_of(service: str, address: str) -> object | None:
        if not address or await check_health(address) != "SERVING":
            return None
        async with open_channel(address) as ch:
            return await calls[service](ch)

    if regions.remote_regions(stack.addresses):
        out["regions"] = await regions.region_status(stack.run_dir, stack.addresses, stack.home_region, status_of)
    transport = open_transport(TransportConfig(url=stack.redis_url))
    try:
        out["stream"] = {"name": transport.config.stream, "groups": await transport.length(), "pending": await transport.pending()}
    except Exception as exc:  # noqa: BLE001 - status reports what it can
        out["stream"] = {"error": str(exc)}
    finally:
        await transport.close()
    return out


def main(command: str, argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog=f"meridian {command}")
    add_config_args(parser, StackConfig, "stack")
    if command == "status":
        parser.add_argument("--json", action="store_true", help="print one JSON object")
        parser.add_argument("--watch", action="store_true", help="a live view, redrawn in place until Ctrl-C (meridian/status_view.py)")
        parser.add_argument("--interval", type=float, default=2.0, metavar="S", help="seconds between --watch frames [default: 2.0]")
    ns = parser.parse_args(argv)
    config = config_from_args(StackConfig, ns, "stack")
    run_dir = Path(config.run_dir).resolve()
    if command == "up":
        stack = start(config)
        print(f"meridian stack up (run folder {run_dir})")
        for name in stack.pids:
            print(f"  {name:<11} {stack.addresses[name]:<28} pid {stack.pids[name]:<8} log {stack.logs[name]}")
        if "rollout_http" in stack.addresses:
            print(f"  {'openai api':<11} {stack.addresses['rollout_http']}  (key: the production token, {stack.credentials}/production.token)")
        print(f"  {'credentials':<11} {stack.credentials}  (other clients: MERIDIAN_CREDENTIALS={stack.credentials})")
        for name, url in stack.metrics.items():
            print(f"  {'metrics':<11} {url:<28} {name}")
        return 0
    stack = Stack.load(run_dir)
    if stack is None:
        print(f"no stack recorded in {run_dir}", file=sys.stderr)
        return 1 if command == "status" else 0
    if command == "down":
        killed = stack.stop(config.stop_timeout_s)
        print("meridian stack down" + (f" (killed after timeout: {', '.join(killed)})" if killed else ""))
        return 0
    if ns.watch:
        from meridian import status_view

        return status_view.watch(lambda: gather_status(stack), stack.metrics, max(ns.interval, 0.1))
    status = asyncio.run(gather_status(stack))
    if ns.json:
        print(json.dumps(status, indent=2))
        return 0
    for name, info in status["services"].items():  # type: ignore[union-attr]
        version = f"  policy version {info['policy_version']}" if "policy_version" in info else ""
        print(f"{name:<11} {info['health']:<12} {info['address']}{version}")
        if "rl_admission" in info:
            a = info["rl_admission"]
            print(f"{'':<11} RL {a['running']}/{a['limit']} running, {a['preemptions']} preempted, SLO attainment {a['slo_attainment']:.3f}, RL token share {a['rl_token_share']:.3f}")
    for region, info in status.get("regions", {}).items():  # type: ignore[union-attr]
        link = info.get("link") or {}
        figures = f", link {link['bytes_down'] / 1e6:.1f} MB down in {link['connections']} connection(s){' (CUT)' if link.get('cut_now') else ''}" if link else ""
        print(f"region {region:<4} serves version {info['served_version']}, weightsync holds {info['weightsync_version']}, lag {info['lag_versions']}{figures}")
    print(f"stream      {status['stream']}")
    return 0
