"""The agent loop's pure core: tool-call parsing, the token ledger, answer extraction,
and the OpenAI request validation."""
from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from meridian.v1 import envsandbox_pb2 as sbx
from meridian.v1 import envsandbox_pb2_grpc as sbx_grpc
from services.rollout.agent import Ledger, ToolCall, extract_answer, format_observation, parse_tool_call
from services.rollout.openai_api import RequestError, choice_sampling, parse_n, parse_sampling


def test_parse_tool_call_variants() -> None:
    assert parse_tool_call("just an answer") is None
    call = parse_tool_call('thinking <tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>')
    assert call == ToolCall("bash", {"command": "ls"})
    assert parse_tool_call('<tool_call>{"name": "submit"}</tool_call>') == ToolCall("submit", {})
    assert "not closed" in parse_tool_call('<tool_call>{"name": "bash"')  # type: ignore[operator]
    assert "JSON" in parse_tool_call("<tool_call>{nope}</tool_call>")  # type: ignore[operator]
    assert "one of" in parse_tool_call('<tool_call>{"name": "rm"}</tool_call>')  # type: ignore[operator]
    assert "content" in parse_tool_call('<tool_call>{"name": "write_file", "arguments": {"path": "a"}}</tool_call>')  # type: ignore[operator]
    assert "object" in parse_tool_call('<tool_call>{"name": "bash", "arguments": [1]}</tool_call>')  # type: ignore[operator]
    # A lone surrogate escape is the model's error, not an exception that ends its group.
    assert "surrogate" in parse_tool_call('<tool_call>{"name": "bash", "arguments": {"command": "echo \\ud800"}}</tool_call>')  # type: ignore[operator]
    assert "path" in parse_tool_call('<tool_call>{"name": "write_file", "arguments": {"path": "\\udfff", "content": "x"}}</tool_call>')  # type: ignore[operator]
    assert parse_tool_call('<tool_call>{"name": "bash", "arguments": {"command": "echo \\ud83d\\ude00"}}</tool_call>') == ToolCall("bash", {"command": "echo \U0001f600"})


def test_ledger_masks_observations_and_keeps_model_tokens() -> None:
    ledger = Ledger()
    ledger.add_model([5, 6], [-0.1, -0.2], [3, 3])
    ledger.add_observation([7, 8, 9])
    ledger.add_model([10], [-1.0], [4])
    assert ledger.token_ids == [5, 6, 7, 8, 9, 10]
    assert ledger.loss_mask == [1, 1, 0, 0, 0, 1]
    assert ledger.logprobs == [-0.1, -0.2, 0.0, 0.0, 0.0, -1.0]
    assert ledger.policy_versions == [3, 3, -1, -1, -1, 4]
    with pytest.raises(ValueError, match="2 tokens, 1 logprobs"):
        ledger.add_model([1, 2], [-0.5], [0, 0])


def test_extract_answer_and_observation_cap() -> None:
    assert extract_answer("Here:\n```python\ndef f():\n    return 1\n```\nDone") == "def f():\n    return 1\n"
    assert extract_answer("```\nunclosed") == "unclosed"
    assert extract_answer("plain") == "plain"
    capped = format_observation("x" * 5000)
    assert len(capped) < 2100 and "more characters cut" in capped


@pytest.mark.parametrize(
    "body, param",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 5000}, "max_tokens"),
        ({"max_tokens": 2048}, "max_tokens"),  # the whole context: no room for a prompt
        ({"max_completion_tokens": 2048, "max_tokens": 12}, "max_tokens"),  # the newer name wins
        ({"stop": [f"s{i}" for i in range(17)]}, "stop"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 2}, "top_p"),
        ({"stop": [""]}, "stop"),
        ({"seed": 1.5}, "seed"),
        ({"seed": 1 << 64}, "seed"),  # past what vLLM carries: its serialiser overflowed (HTTP 500)
        ({"seed": -1}, "seed"),
    ],
)
def test_openai_sampling_validation(body: dict, param: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(RequestError) as info:
        parse_sampling(body, max_model_len=2048, default_max_tokens=64)
    assert info.value.param == param


@pytest.mark.parametrize("n", [0, 9, 2.0, True, "2"])
def test_openai_n_is_capped(n: object) -> None:
    with pytest.raises(RequestError, match=r"\[1, 8\]") as info:
        parse_n({"n": n}, max_n=8)
    assert info.value.param == "n"


def test_openai_n_choices_get_their_own_seeds() -> None:
    assert parse_n({}, 8) == 1 and parse_n({"n": None}, 8) == 1 and parse_n({"n": 8}, 8) == 8
    seeded = parse_sampling({"seed": 7}, 2048, 64)
    assert [choice_sampling(seeded, i).seed for i in range(3)] == [7, 8, 9]
    assert choice_sampling(parse_sampling({}, 2048, 64), 2).seed is None
    top = parse_sampling({"seed": (1 << 63) - 1}, 2048, 64)
    assert [choice_sampling(top, i).seed for i in range(3)] == [(1 << 63) - 1, 0, 1]  # wrapped, still distinct


def test_the_http_api_answers_400_not_500_for_bodies_no_text_or_parser_takes() -> None:
    """Bodies that are JSON but not text (an unpaired surrogate escape, in a prompt, a
    message or a stop string) or nested past the parser's depth: the caller's error,
    answered 400 with a message, not 500."""
    from fastapi.testclient import TestClient

    from services.rollout.callers import CallerClasses
    from services.rollout.openai_api import create_app

    class Engine:
        tokenizer = None

    app = create_app(Engine(), "m", 2048, 64, CallerClasses({"k": "production"}, "deny"))  # type: ignore[arg-type]
    key = {"authorization": "Bearer k"}
    with TestClient(app, raise_server_exceptions=False) as http:
        for path, body in (
            ("/v1/completions", '{"prompt": "a\\ud800b"}'),
            ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\udfff"}]}'),
            ("/v1/completions", '{"prompt": "x", "stop": ["\\ud800"]}'),
        ):
            reply = http.post(path, content=body, headers={**key, "content-type": "application/json"})
            assert reply.status_code == 400 and "unpaired surrogate" in reply.json()["error"]["message"], (body, reply.text)
        reply = http.post("/v1/completions", content="[" * 5000, headers=key)
        assert reply.status_code == 400 and "nested too deeply" in reply.json()["error"]["message"], reply.text
        # Every route wants a key when keys are on; no generated docs routes are served.
        assert http.get("/v1/models").status_code == 401
        assert http.get("/v1/models", headers=key).status_code == 200
        for route in ("/openapi.json", "/docs", "/redoc"):
            assert http.get(route, headers=key).status_code == 404, route


def test_a_chat_message_that_is_not_an_object_is_400_and_a_bug_is_a_500_in_the_apis_shape() -> None:
    """A message that is a string (found by tests/integration/test_rollout_fuzz.py) used to
    raise past the checks and answer a plain-text 500; it is the caller's error (400).
    Whatever does escape a route (here an engine without a tokenizer) answers 500 with the
    API's error object and a reference to the log, not Starlette's plain text."""
    from fastapi.testclient import TestClient

    from services.rollout.callers import CallerClasses
    from services.rollout.openai_api import create_app

    class Engine:
        tokenizer = None

    app = create_app(Engine(), "m", 2048, 64, CallerClasses({"k": "production"}, "deny"))  # type: ignore[arg-type]
    key = {"authorization": "Bearer k"}
    with TestClient(app, raise_server_exceptions=False) as http:
        for messages in (["hi"], [{"role": "user", "content": "hi"}, 7], [None]):
            reply = http.post("/v1/chat/completions", json={"messages": messages}, headers=key)
            assert reply.status_code == 400 and "needs a role" in reply.json()["error"]["message"], (messages, reply.text)
        reply = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, headers=key)
        assert reply.status_code == 500, reply.text
        err = reply.json()["error"]
        assert err["type"] == "server_error" and err["message"].startswith("internal error (ref="), err


def test_openai_max_completion_tokens_is_honoured_before_max_tokens() -> None:
    """Current OpenAI clients send ``max_completion_tokens`` (``max_tokens`` is deprecated):
    ignored, every such caller would get the server's default length instead of its own."""
    assert parse_sampling({"max_completion_tokens": 12}, 2048, 64).max_tokens == 12
    assert parse_sampling({"max_completion_tokens": 12, "max_tokens": 30}, 2048, 64).max_tokens == 12
    assert parse_sampling({"max_tokens": 2047}, 2048, 64).max_tokens == 2047


@pytest.mark.parametrize(
    ("message", "words"),
    [
        ({"role": "assistant", "content": "", "function_call": {"name": "f", "arguments": "{}"}}, "legacy function_call"),
        ({"role": "user", "content": None}, "content must be a string or a list of text parts"),
        ({"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}, "only an assistant message carries tool_calls"),
        ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "a part of type 'image_url'"),
    ],
)
def test_a_chat_message_the_server_would_render_wrong_is_refused_by_index(message: dict, words: str) -> None:  # type: ignore[type-arg]
    """History the prompt cannot carry as sent (a legacy call the model would not see, a
    user turn with no text, tool calls on a turn that did not make them, an image) is the
    caller's error, naming the message, not a prompt silently missing parts of it."""
    from services.rollout.openai_api import message_text

    assert message_text({"role": "assistant", "content": None}, 0) == ""  # an assistant turn of calls alone
    with pytest.raises(RequestError, match=r"messages\[3\]") as info:
        message_text(message, 3)
    assert words in str(info.value) and info.value.param == "messages"


def test_openai_sampling_defaults_and_passthrough() -> None:
    s = parse_sampling({"temperature": 0, "stop": "END", "seed": 7, "max_tokens": 12}, 2048, 64)
    assert (s.temperature, s.stop, s.seed, s.max_tokens) == (0.0, ("END",), 7, 12)
    assert parse_sampling({}, 2048, 64).max_tokens == 64


def test_rl_workers_back_off_then_run(monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    from services.rollout import rl_workers
    from services.rollout.rl_workers import RLWorkers

    monkeypatch.setattr(rl_workers, "BACKOFF_S", 0.01)

    async def scenario() -> list[str]:
        reasons = ["policy lag 3 > 2", "stream backlog 9 > 5", ""]
        seen: list[str] = []
        ran = 0

        async def backpressure() -> str:
            seen.append(workers.state)
            return reasons.pop(0) if reasons else ""

        async def run_group() -> None:
            nonlocal ran
            ran += 1
            if ran == 2:
                raise RuntimeError("a failed group must not end the worker")
            if ran > 3:
                await asyncio.Event().wait()  # park until stop() cancels the worker

        workers = RLWorkers(1, run_group, backpressure)
        workers.start()
        while ran < 3:
            await asyncio.sleep(0.01)
        await workers.stop()
        return seen

    seen = asyncio.run(scenario())
    # States as seen at each back-pressure check: backed off twice, then running.
    assert seen[:4] == ["starting", "backoff: policy lag 3 > 2", "backoff: stream backlog 9 > 5", "running"]
    assert "backoff: error" in seen


TASK = sbx.Task(id="python/add", instruction="add", answer_path="answer.py")


@contextlib.asynccontextmanager
async def envsandbox_serving(servicer: sbx_grpc.EnvSandboxServicer) -> AsyncIterator[sbx_grpc.EnvSandboxStub]:
    """``servicer`` (a stand-in envsandbox) on a real gRPC server on a free loopback port,
    and a stub to it; the server is stopped on the way out."""
    server = grpc.aio.server()
    sbx_grpc.add_EnvSandboxServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield sbx_grpc.EnvSandboxStub(channel)
    finally:
        await server.stop(grace=None)


class StandInTokenizer:
    """Enough of a tokenizer for a group's prompt: a chat renders as its messages' text,
    which is three tokens; no special tokens."""

    all_special_tokens: list[str] = []
    added_tokens_decoder: dict[int, Any] = {}

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool, tokenize: bool) -> str:
        return "".join(m["content"] for m in messages)

    def __call__(self, text: str, **_: Any) -> dict[str, list[int]]:
        return {"input_ids": [1, 2, 3]}


def test_a_frozen_envsandbox_ends_the_group_at_the_deadline_and_still_closes_its_sandbox(monkeypatch: pytest.MonkeyPatch) -> None:
    """An envsandbox that stops answering (frozen, or replies dropped) while a group forks:
    the call ends at the client deadline (DEADLINE_EXCEEDED), not never, and the base
    sandbox is still closed (under its own deadline)."""
    import asyncio

    from services.rollout import episodes
    from services.rollout.engine import Sampling

    monkeypatch.setattr(episodes, "SANDBOX_CALL_S", 0.3)

    class Frozen(sbx_grpc.EnvSandboxServicer):
        def __init__(self) -> None:
            self.closed: list[str] = []

        async def Create(self, request: sbx.CreateRequest, context: object) -> sbx.SandboxInfo:
            return sbx.SandboxInfo(sandbox_id="base", task_id=request.task_id)

        async def Fork(self, request: sbx.ForkRequest, context: object) -> sbx.ForkResponse:
            await asyncio.Event().wait()  # never answers
            raise AssertionError("unreachable")

        async def Close(self, request: sbx.CloseRequest, context: object) -> sbx.CloseResponse:
            self.closed.append(request.sandbox_id)
            return sbx.CloseResponse()

    class Engine:
        tokenizer = StandInTokenizer()

    async def scenario() -> tuple[grpc.StatusCode, list[str]]:
        servicer = Frozen()
        async with envsandbox_serving(servicer) as stub:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                # 10x the deadline given: a stall fails the test here, not the suite.
                await asyncio.wait_for(episodes.run_group(Engine(), stub, TASK, 2, Sampling(), "m"), 3)  # type: ignore[arg-type]
            return caught.value.code(), servicer.closed

    code, closed = asyncio.run(scenario())
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and closed == ["base"]


def test_a_failed_episode_cancels_its_siblings_and_every_fork_is_closed() -> None:
    """One episode of a group fails (its engine call raises) while another waits: the
    other is cancelled, not left running, and both forks are closed, even though closing
    the base sandbox failed (which used to raise past the forks and leak them). The group's
    sandboxes are leased and held while the episodes run, and none is held after: the
    base, whose Close failed, is left to its lease."""
    import asyncio

    from services.envsandbox.client import LeaseKeeper
    from services.rollout import episodes
    from services.rollout.engine import Sampling

    held_while_running: list[frozenset[str]] = []

    class Boxes(sbx_grpc.EnvSandboxServicer):
        def __init__(self) -> None:
            self.closed: list[str] = []
            self.leases: list[float] = []

        async def Create(self, request: sbx.CreateRequest, context: object) -> sbx.SandboxInfo:
            self.leases.append(request.lease_seconds)
            return sbx.SandboxInfo(sandbox_id="base", task_id=request.task_id)

        async def Fork(self, request: sbx.ForkRequest, context: object) -> sbx.ForkResponse:
            return sbx.ForkResponse(sandboxes=[sbx.SandboxInfo(sandbox_id=f"f{i}") for i in range(request.count)])

        async def Close(self, request: sbx.CloseRequest, context: grpc.aio.ServicerContext) -> sbx.CloseResponse:
            if request.sandbox_id == "base":
                await context.abort(grpc.StatusCode.UNAVAILABLE, "envsandbox is restarting")
            self.closed.append(request.sandbox_id)
            return sbx.CloseResponse()

    class Engine:
        tokenizer = StandInTokenizer()

        async def generate(self, prompt_ids: list[int], sampling: Sampling, priority: int, request_id: str = "") -> Any:
            held_while_running.append(keeper.held)
            if sampling.seed == 0:
                raise RuntimeError("the engine failed episode 0")
            await asyncio.Event().wait()  # episode 1 would wait for ever
            yield  # an async generator, as the real one

    async def scenario() -> list[str]:
        nonlocal keeper
        servicer = Boxes()
        async with envsandbox_serving(servicer) as stub:
            keeper = LeaseKeeper(stub, 30.0)
            with pytest.raises(RuntimeError, match="failed episode 0"):
                await asyncio.wait_for(episodes.run_group(Engine(), stub, TASK, 2, Sampling(seed=0), "m", leases=keeper), 10)  # type: ignore[arg-type]
            assert servicer.leases == [30.0]
            return sorted(servicer.closed)

    keeper = LeaseKeeper(None, 0.0)  # type: ignore[arg-type]
    assert asyncio.run(scenario()) == ["f0", "f1"]
    assert held_while_running and all(held == {"f0", "f1"} for held in held_while_running)
    assert keeper.held == frozenset()


def test_a_group_cancelled_before_its_episodes_start_closes_its_forks() -> None:
    """A group is cancelled (a sibling group failed, or the caller went away) after its
    Fork answered but before its episodes ran, here while it closes the base sandbox:
    no episode runs, so none closes its fork; the group must, and must stop renewing
    them, or the lease keeper would keep them alive until their time-to-live."""
    import asyncio

    from services.envsandbox.client import LeaseKeeper
    from services.rollout import episodes
    from services.rollout.engine import Sampling

    closing_base = asyncio.Event()

    class Boxes(sbx_grpc.EnvSandboxServicer):
        def __init__(self) -> None:
            self.closed: list[str] = []

        async def Create(self, request: sbx.CreateRequest, context: object) -> sbx.SandboxInfo:
            return sbx.SandboxInfo(sandbox_id="base", task_id=request.task_id)

        async def Fork(self, request: sbx.ForkRequest, context: object) -> sbx.ForkResponse:
            return sbx.ForkResponse(sandboxes=[sbx.SandboxInfo(sandbox_id=f"f{i}") for i in range(request.count)])

        async def Close(self, request: sbx.CloseRequest, context: object) -> sbx.CloseResponse:
            if request.sandbox_id == "base":
                closing_base.set()
                await asyncio.Event().wait()  # slow: the group is cancelled meanwhile
            self.closed.append(request.sandbox_id)
            return sbx.CloseResponse()

    class Engine:
        tokenizer = StandInTokenizer()

        async def generate(self, *args: Any, **kwargs: Any) -> Any:
            raise AssertionError("no episode may start in a cancelled group")
            yield

    async def scenario() -> tuple[list[str], frozenset[str]]:
        servicer = Boxes()
        async with envsandbox_serving(servicer) as stub:
            keeper = LeaseKeeper(stub, 30.0)
            group = asyncio.create_task(episodes.run_group(Engine(), stub, TASK, 2, Sampling(), "m", leases=keeper))  # type: ignore[arg-type]
            await asyncio.wait_for(closing_base.wait(), 10)
            group.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(group, 10)
            return sorted(servicer.closed), keeper.held

    closed, held = asyncio.run(scenario())
    assert closed == ["f0", "f1"] and held == frozenset()
