"""Bounded servers (real in-process gRPC servers on loopback, conftest ``serving``): every
bound answers with its status and a message naming its setting, while a health check on
the same server keeps answering within a second; malformed request bytes answer
INVALID_ARGUMENT on every method of every service; Redis of the local stack fsyncs
every write."""
from __future__ import annotations

import asyncio
import dataclasses
import importlib
import os
import shutil
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meridian.cli import SERVICES
from meridian.grpc_runtime import ServerConfig
from meridian.tensors import RawTensor
from meridian.v1 import weightsync_pb2 as ws
from meridian.v1 import weightsync_pb2_grpc as ws_grpc
from services.weightsync import client
from services.weightsync.config import WeightSyncConfig
from services.weightsync.server import GiB, WeightSyncService
from tests.unit.test_grpc_services import expect_code

T = TypeVar("T")
Serving = Callable[..., Any]
TIMEOUT_S = 60.0  # only guards against a hang
HEALTHY_WITHIN_S = 1.0
#: Truncated: field 1, length 5, two bytes follow. No message type parses it.
GARBAGE = b"\x0a\x05ab"
PARSER_WORDS = ("wire", "decodeerror", "parsing", "truncated", "corrupt")


def run(coro: Awaitable[T]) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, TIMEOUT_S)

    return asyncio.run(bounded())




async def health_seconds(address: str) -> float:
    """Seconds a health check on ``address`` took; it must say SERVING within the bound."""
    async with grpc.aio.insecure_channel(address) as channel:
        start = time.monotonic()
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=HEALTHY_WITHIN_S)
        elapsed = time.monotonic() - start
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    return elapsed


class HealthProbe:
    """Health checks on ``address`` back to back from a thread of their own while in use.

    The in-process server runs on the test's own event loop, so a check made from that
    loop cannot see the loop stall (it would wait out the stall before starting its
    clock); this prober can. Entering waits for a first answer, leaving for one more
    that started after the work ended, so every check that overlapped the work counts."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._probe, daemon=True)

    def _probe(self) -> None:
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while not self._stop.is_set():
                start = time.monotonic()
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=HEALTHY_WITHIN_S)
                    if reply.status != health_pb2.HealthCheckResponse.SERVING:
                        self.failures.append(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
                except grpc.RpcError as exc:
                    self.failures.append(f"{exc.code().name}: {exc.details()}")
                self.latencies.append(time.monotonic() - start)
                time.sleep(0.02)

    async def _answers(self, more_than: int) -> None:
        while len(self.latencies) <= more_than:
            await asyncio.sleep(0.01)

    async def __aenter__(self) -> HealthProbe:
        self._thread.start()
        await self._answers(0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._answers(len(self.latencies) + 1)
        self._stop.set()
        await asyncio.to_thread(self._thread.join)
        assert not self.failures, self.failures
        assert max(self.latencies) < HEALTHY_WITHIN_S, f"slowest health check {max(self.latencies):.2f} s"


async def refused_while_healthy(address: str, code: grpc.StatusCode, call: Awaitable[Any]) -> str:
    """``call`` fails with ``code`` while health checks from another thread answer in time."""
    async with HealthProbe(address):
        return await expect_code(code, call)


# ---------------------------------------------------------------- malformed bytes


class BareService:
    """A service's generated servicer with no behaviour: malformed bytes must be refused
    before any handler runs, so the handlers' own answers (UNIMPLEMENTED) never show."""

    def __init__(self, name: str) -> None:
        _, _, server_module, _ = SERVICES[name]
        self.pb = importlib.import_module(server_module).pb
        self.pb_grpc = importlib.import_module(server_module).pb_grpc
        (self.descriptor,) = self.pb.DESCRIPTOR.services_by_name.values()
        self.service_names = (self.descriptor.full_name,)

    def register(self, server: grpc.aio.Server) -> None:
        name = self.descriptor.name
        getattr(self.pb_grpc, f"add_{name}Servicer_to_server")(getattr(self.pb_grpc, f"{name}Servicer")(), server)

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_malformed_bytes_are_invalid_argument_on_every_method(service: str, grpc_serving: Serving) -> None:
    bare = BareService(service)

    async def main() -> None:
        async with grpc_serving(bare) as address, grpc.aio.insecure_channel(address) as channel:
            checked = 0
            for method in bare.descriptor.methods:
                path = f"/{bare.descriptor.full_name}/{method.name}"
                if method.client_streaming:
                    continue  # only weightsync's Publish: tested on the real service below
                if method.server_streaming:
                    call = channel.unary_stream(path, request_serializer=None, response_deserializer=None)(GARBAGE)

                    async def drain(c: Any = call) -> None:
                        async for _ in c:
                            pass

                    details = await expect_code(grpc.StatusCode.INVALID_ARGUMENT, drain())
                else:
                    details = await expect_code(grpc.StatusCode.INVALID_ARGUMENT, channel.unary_unary(path)(GARBAGE))
                assert details == f"malformed request: the bytes are not a valid {method.input_type.full_name} message"
                assert not any(word in details.lower() for word in PARSER_WORDS)
                checked += 1
            assert checked
            # The health service sits behind the same boundary.
            details = await expect_code(grpc.StatusCode.INVALID_ARGUMENT, channel.unary_unary("/grpc.health.v1.Health/Check")(GARBAGE))
            assert "grpc.health.v1.HealthCheckRequest" in details
            assert await health_seconds(address) < HEALTHY_WITHIN_S

    run(main())


def _weightsync(tmp_path: Path, **overrides: Any) -> WeightSyncService:
    return WeightSyncService(WeightSyncConfig(role="origin", data_dir=str(tmp_path / "ws"), chunk_mb=0.0005, **overrides))


def _weights(seed: int = 0) -> dict[str, RawTensor]:
    rng = np.random.default_rng(seed)
    return {"emb": RawTensor("bf16", (64, 8), rng.integers(0x3C00, 0x3F00, 512, dtype=np.uint16))}


def test_malformed_message_inside_a_publish_stream_is_invalid_argument(tmp_path: Path, grpc_serving: Serving) -> None:
    async def main() -> None:
        async with grpc_serving(_weightsync(tmp_path)) as address, grpc.aio.insecure_channel(address) as channel:
            header = ws.PublishRequest(header=ws.PublishHeader(version=0)).SerializeToString()
            publish = channel.stream_unary("/meridian.v1.WeightSync/Publish", request_serializer=None, response_deserializer=None)
            details = await refused_while_healthy(address, grpc.StatusCode.INVALID_ARGUMENT, publish(iter([header, GARBAGE])))
            assert details == "malformed request: the bytes are not a valid meridian.v1.PublishRequest message"
            assert (await client.publish(address, 0, _weights())).version == 0  # unharmed

    run(main())


# ---------------------------------------------------------------- call limits


async def _open_follow(stub: ws_grpc.WeightSyncStub) -> Any:
    """A follow stream that is surely inside its handler: its first message arrived."""
    call = stub.Subscribe(ws.SubscribeRequest(from_version=-1, follow=True))
    first = await call.read()
    assert first.HasField("manifest")
    return call


def test_max_concurrent_rpcs_refuses_the_call_over_the_limit(tmp_path: Path, grpc_serving: Serving) -> None:
    async def main() -> None:
        config = ServerConfig(max_concurrent_rpcs=2)
        async with grpc_serving(_weightsync(tmp_path), config=config) as address, grpc.aio.insecure_channel(address) as channel:
            await client.publish(address, 0, _weights())
            stub = ws_grpc.WeightSyncStub(channel)
            streams = [await _open_follow(stub), await _open_follow(stub)]
            details = await refused_while_healthy(address, grpc.StatusCode.RESOURCE_EXHAUSTED, stub.Status(ws.WeightSyncStatusRequest()))
            assert "max_concurrent_rpcs=2" in details
            streams.pop().cancel()
            await asyncio.sleep(0.2)  # the server sees the cancellation
            assert (await stub.Status(ws.WeightSyncStatusRequest())).latest_version == 0
            streams.pop().cancel()

    run(main())


def test_probe_streams_cannot_take_the_whole_reserve(tmp_path: Path, grpc_serving: Serving) -> None:
    """Health watches need no token: opened by the hundred they are refused past their own
    cap, and a health check still answers (without the cap they filled gRPC's limit)."""
    from meridian.grpc_runtime import PROBE_STREAMS, RESERVED_RPCS

    async def main() -> None:
        config = ServerConfig(max_concurrent_rpcs=2)
        async with grpc_serving(_weightsync(tmp_path), config=config) as address, grpc.aio.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            watches = []
            refused = None
            for _ in range(2 + RESERVED_RPCS + 8):
                call = health.Watch(health_pb2.HealthCheckRequest())
                try:
                    await call.read()  # the first status: the stream is open in its handler
                except grpc.aio.AioRpcError as exc:
                    refused = exc
                    break
                watches.append(call)
            assert refused is not None and refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused
            assert len(watches) == PROBE_STREAMS
            assert await health_seconds(address) < HEALTHY_WITHIN_S
            for call in watches:
                call.cancel()

    run(main())


def test_subscribe_stream_limit_refuses_the_stream_over_it(tmp_path: Path, grpc_serving: Serving) -> None:
    async def main() -> None:
        async with grpc_serving(_weightsync(tmp_path, max_subscribe_streams=2)) as address, grpc.aio.insecure_channel(address) as channel:
            await client.publish(address, 0, _weights())
            stub = ws_grpc.WeightSyncStub(channel)
            streams = [await _open_follow(stub), await _open_follow(stub)]

            async def third() -> None:
                await _open_follow(stub)

            details = await refused_while_healthy(address, grpc.StatusCode.RESOURCE_EXHAUSTED, third())
            assert "max_subscribe_streams=2" in details and "Subscribe" in details
            # Other methods are not held back by the streams.
            assert (await stub.Status(ws.WeightSyncStatusRequest())).latest_version == 0
            streams.pop().cancel()
            await asyncio.sleep(0.2)
            streams.append(await _open_follow(stub))  # a freed slot is usable again
            for call in streams:
                call.cancel()

    run(main())


# ---------------------------------------------------------------- publish bytes


def _declaring(version: int, shapes: dict[str, tuple[int, ...]], hold: asyncio.Event | None = None) -> AsyncIterator[ws.PublishRequest]:
    """A Publish stream declaring bf16 tensors of ``shapes`` with no data; with ``hold``
    (one tensor only), it then waits for the event and sends the tensor's bytes (zeros)."""
    assert hold is None or len(shapes) == 1

    async def gen() -> AsyncIterator[ws.PublishRequest]:
        yield ws.PublishRequest(header=ws.PublishHeader(version=version))
        for name, shape in shapes.items():
            yield ws.PublishRequest(piece=ws.TensorPiece(meta=ws.TensorMeta(name=name, dtype=ws.DTYPE_BF16, shape=list(shape))))
        if hold is not None:
            await hold.wait()
            (shape,) = shapes.values()
            yield ws.PublishRequest(piece=ws.TensorPiece(offset=0, data=b"\0" * (2 * int(np.prod(shape)))))

    return gen()


def test_publish_declaring_more_than_the_per_publish_cap_is_refused_before_allocating(tmp_path: Path, grpc_serving: Serving) -> None:
    async def main() -> None:
        # Default caps: 2**38 bf16 elements (512 GiB) are declared, nothing sent; a
        # server allocating first would run out of memory instead of answering.
        async with grpc_serving(_weightsync(tmp_path)) as address, grpc.aio.insecure_channel(address) as channel:
            stub = ws_grpc.WeightSyncStub(channel)
            huge = _declaring(0, {"a": (1 << 20, 1 << 4), "b": (1 << 28, 1 << 10)})
            details = await refused_while_healthy(address, grpc.StatusCode.RESOURCE_EXHAUSTED, stub.Publish(huge))
            assert "tensor 'b'" in details and "max_publish_gib=16" in details
            assert (await stub.Status(ws.WeightSyncStatusRequest())).latest_version == -1
            assert (await client.publish(address, 0, _weights())).version == 0

    run(main())


def test_publish_streams_in_flight_share_the_total_cap(tmp_path: Path, grpc_serving: Serving) -> None:
    mib = 1 << 20
    service = _weightsync(tmp_path, max_publish_gib=3 * mib / GiB, max_publish_total_gib=4 * mib / GiB)

    async def main() -> None:
        async with grpc_serving(service) as address, grpc.aio.insecure_channel(address) as channel:
            stub = ws_grpc.WeightSyncStub(channel)
            go = asyncio.Event()
            first = asyncio.ensure_future(stub.Publish(_declaring(0, {"w": (mib,)}, hold=go)))  # 2 MiB, held open
            while service.publish_budget.in_flight == 0:
                await asyncio.sleep(0.01)
            details = await refused_while_healthy(address, grpc.StatusCode.RESOURCE_EXHAUSTED, stub.Publish(_declaring(1, {"v": (3 * mib // 2,)})))
            assert "max_publish_total_gib" in details
            go.set()
            assert (await first).version == 0
            assert service.publish_budget.in_flight == 0  # released when the stream ended
            assert (await stub.Publish(_full(1, mib))).version == 1  # the cap was freed

    run(main())


def _full(version: int, elements: int) -> AsyncIterator[ws.PublishRequest]:
    go = asyncio.Event()
    go.set()
    return _declaring(version, {"w": (elements,)}, hold=go)


# ---------------------------------------------------------------- rollout prompts

KiB = 1024
SLOW_S = 2.0  # what the stand-in tokenizer takes on a large prompt


class SlowTokenizer:
    """Stand-in for the engine's tokenizer: a token per byte (eight at most), and on a
    prompt too large to tokenise inline it sleeps, releasing the GIL as Hugging Face's
    fast tokenizers do, so tokenising it on the event loop would stall health checks."""

    bos_token_id = 1
    all_special_tokens: list[str] = []
    added_tokens_decoder: dict[int, Any] = {}

    def __init__(self) -> None:
        self.calls: list[int] = []

    def _encode(self, text: str) -> list[int]:
        from services.rollout.prompt_limits import INLINE_BYTES

        self.calls.append(len(text))
        if len(text) > INLINE_BYTES:
            time.sleep(SLOW_S)
        return [2 + b % 200 for b in text.encode()[:8]]

    def __call__(self, text: str, **_: Any) -> dict[str, list[int]]:
        return {"input_ids": self._encode(text)}

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool, tokenize: bool) -> str:
        return "".join(m["content"] for m in messages)

    def __len__(self) -> int:
        return 256


class FakeEngine:
    """What the rollout server needs of its engine, without vLLM: one token per request."""

    tokenizer_instance = SlowTokenizer()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.version = 0
        self.tokenizer: SlowTokenizer | None = None

    async def start(self) -> None:
        self.tokenizer = self.tokenizer_instance

    def shutdown(self) -> None:
        pass

    def prompt_problem(self, ids: list[int]) -> str:
        return ""

    async def generate(self, prompt_ids: list[int], sampling: Any, priority: int, request_id: str = "") -> AsyncIterator[Any]:
        from services.rollout.engine import Delta

        yield Delta([7], [-0.5], self.version, "x", True, "length", [self.version])

    async def score(self, token_ids: list[int], priority: int = 0) -> list[float]:
        return [0.0] * len(token_ids)


@pytest.fixture
def rollout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[], Any]:
    """Builds (inside the test's event loop: it opens channels) a rollout service on
    :class:`FakeEngine` with its HTTP API on a free port, and small prompt bounds:
    256 KiB of prompt text, 512 KiB of HTTP body."""
    from services.rollout import server
    from services.rollout.config import RolloutConfig

    FakeEngine.tokenizer_instance = SlowTokenizer()
    monkeypatch.setattr(server, "Engine", FakeEngine)
    monkeypatch.setattr(server, "resolve_model", lambda model: tmp_path)
    monkeypatch.setattr(server, "load_checkpoint_weights", lambda model_dir: {})
    monkeypatch.setattr(server, "weights_hash", lambda weights: "")
    config = RolloutConfig(model="fake", envsandbox="127.0.0.1:1", http_port=0, max_prompt_bytes=256 * KiB, http_max_body_bytes=512 * KiB)
    return lambda **changes: server.RolloutService(dataclasses.replace(config, **changes))


async def _generate(stub: Any, prompt: str) -> list[Any]:
    from meridian.v1 import rollout_pb2 as ro

    return [chunk async for chunk in stub.Generate(ro.GenerateRequest(prompt=prompt))]


async def _healthy_while_tokenising(address: str, tokenizer: SlowTokenizer, work: Awaitable[T]) -> T:
    """Runs ``work``, which tokenises a large prompt, while health checks answer in time."""
    async with HealthProbe(address) as probe:
        result = await work
    assert tokenizer.calls and len(probe.latencies) >= SLOW_S / HEALTHY_WITHIN_S  # checks ran during the tokenising
    return result


def test_generate_refuses_prompt_text_over_the_bound_before_tokenising(rollout: Callable[[], Any], grpc_serving: Serving) -> None:
    from meridian.v1 import rollout_pb2_grpc as ro_grpc

    async def main() -> None:
        async with grpc_serving(rollout()) as address, grpc.aio.insecure_channel(address) as channel:
            stub = ro_grpc.RolloutStub(channel)
            tokenizer = FakeEngine.tokenizer_instance
            tokenizer.calls.clear()
            details = await refused_while_healthy(address, grpc.StatusCode.INVALID_ARGUMENT, _generate(stub, "é" * (128 * KiB + 1)))
            assert f"{256 * KiB + 2} bytes" in details and f"max_prompt_bytes={256 * KiB}" in details
            assert tokenizer.calls == []
            # A large prompt within the bound is tokenised off the event loop.
            chunks = await _healthy_while_tokenising(address, tokenizer, _generate(stub, "a" * (200 * KiB)))
            assert chunks[-1].finished and list(chunks[-1].token_ids) == [7]

    run(main())


def test_prompt_text_of_exactly_max_prompt_bytes_is_taken_and_one_byte_more_is_not() -> None:
    """The bound is inclusive, counted in UTF-8 bytes (what the tokenizer reads)."""
    from services.rollout.prompt_limits import text_bytes, too_long

    assert text_bytes("é" * 4) == 8
    assert too_long(text_bytes("é" * 4), 8) == ""
    assert too_long(text_bytes("é" * 4 + "a"), 8) == "prompt text is 9 bytes, more than this server tokenises (max_prompt_bytes=8)"


def test_generate_refuses_a_temperature_the_engine_would_reject(rollout: Callable[[], Any], grpc_serving: Serving) -> None:
    """NaN, infinity or above 2: INVALID_ARGUMENT naming the field, not the engine's own
    error as INTERNAL."""
    from meridian.v1 import rollout_pb2 as ro
    from meridian.v1 import rollout_pb2_grpc as ro_grpc

    async def main() -> None:
        async with grpc_serving(rollout()) as address, grpc.aio.insecure_channel(address) as channel:
            stub = ro_grpc.RolloutStub(channel)
            for temperature in (float("nan"), float("inf"), 2.5, -0.5):
                request = ro.GenerateRequest(prompt="x", sampling=ro.SamplingParams(temperature=temperature))
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    [c async for c in stub.Generate(request)]
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature must be in [0, 2.0]" in (info.value.details() or ""), temperature
            ok = [c async for c in stub.Generate(ro.GenerateRequest(prompt="x", sampling=ro.SamplingParams(temperature=2.0)))]
            assert ok[-1].finished

    run(main())


def test_http_api_answers_503_past_its_concurrency(rollout: Callable[..., Any], grpc_serving: Serving) -> None:
    """With one request in flight (a slow prompt being tokenised) and a limit of two (its
    connection and its request), a second caller gets 503 at once instead of queueing
    without bound; later calls work."""
    import httpx

    async def main() -> None:
        service = rollout(http_max_concurrency=2)
        async with grpc_serving(service):
            base = f"http://127.0.0.1:{service._http.port}/v1"
            async with httpx.AsyncClient(base_url=base, timeout=30) as slow, httpx.AsyncClient(base_url=base, timeout=30) as other:
                chat = asyncio.create_task(slow.post("/chat/completions", json={"messages": [{"role": "user", "content": "d" * (200 * KiB)}], "max_tokens": 1}))
                await asyncio.sleep(SLOW_S / 4)  # the slow request is being tokenised
                assert (await other.get("/models")).status_code == 503
                assert (await chat).status_code == 200
            async with httpx.AsyncClient(base_url=base, timeout=30) as later:
                assert (await later.get("/models")).status_code == 200

    run(main())


def test_http_api_answers_413_for_a_body_or_prompt_over_its_bound(rollout: Callable[[], Any], grpc_serving: Serving) -> None:
    import httpx

    async def main() -> None:
        service = rollout()
        async with grpc_serving(service) as address, httpx.AsyncClient(base_url=f"http://127.0.0.1:{service._http.port}/v1", timeout=30) as http:
            tokenizer = FakeEngine.tokenizer_instance
            tokenizer.calls.clear()

            async def status_of(**kwargs: Any) -> tuple[int, dict[str, Any]]:
                reply = await http.post("/completions", **kwargs)
                return reply.status_code, reply.json()

            # Declared too large: refused before the body is read.
            declared = {"content": b"{" + b" " * (16 << 20) + b"}", "headers": {"content-type": "application/json"}}
            async with HealthProbe(address):
                code, body = await status_of(**declared)
            assert code == 413 and "http_max_body_bytes=524288" in body["error"]["message"], body

            # Streamed without a length: refused once the bound is passed.
            async def chunks() -> AsyncIterator[bytes]:
                for _ in range(64):
                    yield b" " * (64 * KiB)

            code, body = await status_of(content=chunks(), headers={"content-type": "application/json"})
            assert code == 413 and "http_max_body_bytes" in body["error"]["message"], body

            # A body within its bound whose prompt text is over the prompt bound.
            code, body = await status_of(json={"prompt": "a" * (300 * KiB), "max_tokens": 1})
            assert code == 413 and "max_prompt_bytes" in body["error"]["message"], body
            messages = [{"role": "user", "content": "b" * (150 * KiB)}, {"role": "user", "content": "c" * (150 * KiB)}]
            reply = await http.post("/chat/completions", json={"messages": messages, "max_tokens": 1})
            assert reply.status_code == 413 and reply.json()["error"]["param"] == "messages"
            assert tokenizer.calls == []

            # Within both bounds: tokenised off the event loop, answered.
            chat = http.post("/chat/completions", json={"messages": [{"role": "user", "content": "d" * (200 * KiB)}], "max_tokens": 1})
            reply = await _healthy_while_tokenising(address, tokenizer, chat)
            assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == "x"

    run(main())


def test_run_episodes_refuses_a_group_its_sandbox_budget_could_never_hold(rollout: Callable[..., Any], grpc_serving: Serving) -> None:
    """A group of 8 holds 9 sandboxes at once: under a budget of 5 it could only wait for
    ever, so the call is refused at once, naming the budget, before envsandbox is asked."""
    from meridian.v1 import rollout_pb2 as ro
    from meridian.v1 import rollout_pb2_grpc as ro_grpc

    async def main() -> None:
        service = rollout(sandbox_budget=5, group_size=2, http_port=-1)
        async with grpc_serving(service) as address, grpc.aio.insecure_channel(address) as channel:
            stub = ro_grpc.RolloutStub(channel)
            details = await expect_code(grpc.StatusCode.INVALID_ARGUMENT, stub.RunEpisodes(ro.RunEpisodesRequest(task_ids=["python/add"], group_size=8)))
            assert "needs 9 sandboxes" in details and "sandbox budget is 5" in details, details
            assert (service.budget.held, service.budget.waiting) == (0, 0)

    run(main())


def test_a_rollout_keeps_within_envsandboxs_own_sandbox_limit(rollout: Callable[..., Any], grpc_serving: Serving, tmp_path: Path) -> None:
    """Left at its default budget (256) in front of an envsandbox that holds 4 sandboxes,
    the rollout reads envsandbox's limit and keeps within it: its budget is 4, and a
    group of 4 (5 sandboxes at once) is refused naming envsandbox's limit, before
    envsandbox is asked for a sandbox it would refuse mid-group."""
    from meridian.v1 import rollout_pb2 as ro
    from meridian.v1 import rollout_pb2_grpc as ro_grpc
    from services.envsandbox.config import EnvSandboxConfig
    from services.envsandbox.server import EnvSandboxService

    async def main() -> None:
        sandboxes = EnvSandboxService(EnvSandboxConfig(root=str(tmp_path / "sandboxes"), max_sandboxes=4))
        async with grpc_serving(sandboxes) as sandbox_address:
            service = rollout(envsandbox=sandbox_address, group_size=2, http_port=-1)
            async with grpc_serving(service) as address, grpc.aio.insecure_channel(address) as channel:
                stub = ro_grpc.RolloutStub(channel)
                details = await expect_code(grpc.StatusCode.INVALID_ARGUMENT, stub.RunEpisodes(ro.RunEpisodesRequest(task_ids=["python/add"], group_size=4)))
                assert "needs 5 sandboxes" in details and "envsandbox holds 4 sandboxes at most" in details, details
                assert (service.budget.capacity, service.budget.configured) == (4, 256)
                assert sandboxes.sandboxes.list() == []

    run(main())


def test_run_episodes_samples_nothing_while_held_groups_cannot_be_published(rollout: Callable[..., Any], grpc_serving: Serving, pick_port: Callable[[], int]) -> None:
    """The stream went away with a group sampled: the group is held, RunEpisodes with
    publish answers UNAVAILABLE saying so before it asks envsandbox for anything (more
    groups could not be published either), and the RL workers back off."""
    from meridian.errors import Unavailable
    from meridian.v1 import common_pb2
    from meridian.v1 import rollout_pb2 as ro
    from meridian.v1 import rollout_pb2_grpc as ro_grpc

    async def main() -> None:
        service = rollout(redis_url=f"redis://127.0.0.1:{pick_port()}/0", http_port=-1)
        group = [
            common_pb2.Trajectory(trajectory_id=f"t{k}", task_id="python/add", group_id="g", group_size=2, prompt_token_ids=[1], completion_token_ids=[2], logprobs=[-0.5], loss_mask=[1], policy_versions=[0])
            for k in range(2)
        ]
        async with grpc_serving(service) as address, grpc.aio.insecure_channel(address) as channel:
            with pytest.raises(Unavailable):
                await service.outbox.publish([group])
            request = ro.RunEpisodesRequest(task_ids=["python/add"], group_size=2, publish=True)
            details = await expect_code(grpc.StatusCode.UNAVAILABLE, ro_grpc.RolloutStub(channel).RunEpisodes(request))
            assert "trajectory stream" in details and "1 sampled groups are held" in details, details
            assert await service._backpressure() == "1 sampled groups wait for the trajectory stream"
            assert service.outbox.held_ids() == ["g"]

    run(main())


def test_rl_workers_hold_their_groups_through_a_redis_restart_and_count_them_once_landed(
    rollout: Callable[..., Any], grpc_serving: Serving, restartable_redis: Any
) -> None:
    """Redis goes down while a background RL worker samples: its group is held, the
    workers back off, and once Redis is back the group lands in the stream and counts in
    ``rl_trajectories_published`` (sampling itself is stubbed: no envsandbox here)."""
    from meridian.trajectory_transport import decode_entry
    from meridian.v1 import common_pb2

    async def main() -> None:
        service = rollout(redis_url=restartable_redis.url, http_port=-1, rl_workers=1)
        sampled: list[str] = []

        async def pick_tasks(count: int) -> list[Any]:
            return [object()]

        async def run_groups(tasks: list[Any], group_size: int, sampling: Any) -> list[list[Any]]:
            if sampled:
                await asyncio.Event().wait()  # one group is enough: park this worker
            group_id = f"g{len(sampled)}"
            sampled.append(group_id)
            restartable_redis.stop()  # the outage begins while the group is being sampled
            return [[
                common_pb2.Trajectory(trajectory_id=f"{group_id}-{k}", task_id="python/add", group_id=group_id, group_size=2,
                                      prompt_token_ids=[1], completion_token_ids=[2], logprobs=[-0.5], loss_mask=[1], policy_versions=[0])
                for k in range(2)
            ]]  # fmt: skip

        service._pick_tasks, service._run_groups = pick_tasks, run_groups
        async with grpc_serving(service):
            async with asyncio.timeout(30):
                while service.outbox.held == 0 or service.workers.state == "running":
                    await asyncio.sleep(0.02)
            # What Status reports as rl_trajectories_published and rl_state.
            assert service.workers.published == 0 and service.workers.state.startswith("backoff")
            restartable_redis.start()
            async with asyncio.timeout(30):
                while service.outbox.held:
                    await asyncio.sleep(0.05)
            assert service.workers.published == 2
            entries = await service.transport.redis.xrange(service.config.stream)
            assert [decode_entry(eid, f).group.group_id for eid, f in entries] == ["g0"]

    run(main())


# ---------------------------------------------------------------- durability


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed (deploy/install.sh installs it)")
def test_local_stack_redis_fsyncs_every_acknowledged_write(tmp_path: Path, pick_port: Callable[[], int]) -> None:
    """``meridian up``'s Redis answers a write only after its append-only file is fsynced:
    an acknowledged XADD (a rollout's group) or XACK (the trainer's checkpointed ack)
    survives a host crash, which the exactly-once design needs."""
    import redis

    from meridian import stack

    proc, url = stack._start_redis(tmp_path, "127.0.0.1", pick_port(), dict(os.environ))
    try:
        client_ = redis.Redis.from_url(url)
        try:
            assert client_.config_get("appendonly") == {"appendonly": "yes"}
            assert client_.config_get("appendfsync") == {"appendfsync": "always"}
        finally:
            client_.close()
    finally:
        stack._terminate(proc.pid, 10.0)


def test_local_stack_redis_refuses_a_port_another_redis_answers_on(tmp_path: Path, pick_port: Callable[[], int]) -> None:
    """A Redis left on the port (an old run's) would pass the new one's readiness probe
    while the new one fails to bind, and the stack would run against it: refused, naming
    the port, before anything is started."""
    from meridian import stack

    port = pick_port()
    proc, _ = stack._start_redis(tmp_path / "first", "127.0.0.1", port, dict(os.environ))
    try:
        with pytest.raises(RuntimeError, match=f"127.0.0.1:{port} is in use by another Redis"):
            stack._start_redis(tmp_path / "second", "127.0.0.1", port, dict(os.environ))
        assert not (tmp_path / "second" / "redis.log").exists()  # nothing was started
    finally:
        stack._terminate(proc.pid, 10.0)


class EndlessEngine(FakeEngine):
    """Generates one token every 50 ms up to ``max_tokens``, and records how each
    generation ended (finished, or the exception that closed it)."""

    ended: list[str] = []

    async def generate(self, prompt_ids: list[int], sampling: Any, priority: int, request_id: str = "") -> AsyncIterator[Any]:
        from services.rollout.engine import Delta

        try:
            for _ in range(sampling.max_tokens - 1):
                await asyncio.sleep(0.05)
                yield Delta([7], [-0.5], self.version, "x", False, "", None)
            yield Delta([7], [-0.5], self.version, "x", True, "length", [self.version] * sampling.max_tokens)
            EndlessEngine.ended.append("finished")
        except BaseException as exc:
            EndlessEngine.ended.append(type(exc).__name__)
            raise


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_an_http_client_leaving_aborts_its_generation(stream: bool, rollout: Callable[..., Any], grpc_serving: Serving, monkeypatch: pytest.MonkeyPatch) -> None:
    """A caller that disconnects mid-answer: its generation is closed (the engine aborts
    the request), not run to max_tokens (50 s here) for nobody while it holds capacity.
    A whole (non-streaming) answer ran on before."""
    import httpx

    from services.rollout import server

    monkeypatch.setattr(server, "Engine", EndlessEngine)
    body = {"prompt": "x", "max_tokens": 1000, "stream": stream}

    async def main() -> None:
        service = rollout()
        async with grpc_serving(service):
            EndlessEngine.ended = []  # the warm-up's generation is not the caller's
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service._http.port}/v1", timeout=30) as http:
                async def call() -> None:
                    async with http.stream("POST", "/completions", json=body) as reply:
                        async for _ in reply.aiter_bytes():
                            pass

                caller = asyncio.create_task(call())
                await asyncio.sleep(0.5)  # generating
                caller.cancel()  # closes its connection
                await asyncio.gather(caller, return_exceptions=True)
            for _ in range(200):  # up to 20 s, well before the 50 s of a full answer
                if EndlessEngine.ended:
                    break
                await asyncio.sleep(0.1)
            assert EndlessEngine.ended and EndlessEngine.ended[0] in ("CancelledError", "GeneratorExit"), EndlessEngine.ended

    run(main())
