"""The rollout service on the real stack: the OpenAI-compatible API through the official
client, RL episodes landing in the stream, and proof that weight updates are real
(vLLM's log-probs match a transformers forward pass on the same weights)."""
from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
from pathlib import Path

import grpc
import openai
import pytest
import torch

from meridian import credentials
from meridian import stack as stack_mod
from meridian.grpc_runtime import ClientAuth, open_channel
from meridian.trajectory_transport import RedisGroupTransport, TransportConfig, decode_entry
from meridian.v1 import rollout_pb2 as pb
from meridian.v1 import rollout_pb2_grpc as pb_grpc
from services.weightsync.client import WeightSubscriber
from meridian.tensors import to_torch


pytestmark = [pytest.mark.stack, pytest.mark.engine]


def _client(stack: stack_mod.Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.addresses["rollout_http"], api_key="test-production-key", max_retries=0, timeout=120)


async def _call(address: str, method: str, request):  # type: ignore[no-untyped-def]
    async with open_channel(address) as channel:
        return await getattr(pb_grpc.RolloutStub(channel), method)(request)


def _thread_cpus(pid: int) -> dict[int, set[int]]:
    """The CPUs each thread of process ``pid`` may run on, as the kernel reports them."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended while we looked
            (line,) = [x for x in (task / "status").read_text().splitlines() if x.startswith("Cpus_allowed_list:")]
            out[int(task.name)] = _cpu_list(line.split(":", 1)[1].strip())
    return out


def _cpu_list(text: str) -> set[int]:
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def test_the_engine_runs_on_the_cpus_its_rollout_was_given(stack: stack_mod.Stack) -> None:
    """The shared stack gives its rollout --engine-cpus <last CPU> (tests/integration/conftest.py).
    Read from the kernel: the engine's worker has every thread on that CPU, and no thread
    of the engine's processes is bound anywhere else (the others are unbound). vLLM's own
    binding would put the worker on the first cores."""
    rollout = stack.pids["rollout"]
    allowed = os.sched_getaffinity(rollout)
    argv = stack.argv["rollout"]
    wanted = _cpu_list(argv[len(argv) - 1 - argv[::-1].index("--engine-cpus") + 1])
    if len(allowed) < 2:
        pytest.skip("one CPU: every binding is the same")
    threads = {pid: _thread_cpus(pid) for pid in stack_mod.group_members(rollout) if pid != rollout}
    workers = [pid for pid, cpus in threads.items() if cpus and all(c <= wanted for c in cpus.values())]
    assert workers, f"no engine process runs on {sorted(wanted)} alone: {threads}"
    elsewhere = {pid: {tid: c for tid, c in cpus.items() if not c <= wanted and c != allowed} for pid, cpus in threads.items()}
    assert not any(elsewhere.values()), f"engine threads bound outside {sorted(wanted)}: {elsewhere}"


def test_openai_chat_completion(stack: stack_mod.Stack) -> None:
    client = _client(stack)
    (model,) = [m.id for m in client.models.list().data]
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hi"}], max_tokens=8, temperature=0)
    assert reply.choices[0].message.role == "assistant" and reply.choices[0].message.content
    assert reply.usage.completion_tokens > 0 and reply.choices[0].finish_reason in ("stop", "length")


def test_openai_chat_completion_streaming(stack: stack_mod.Stack) -> None:
    client = _client(stack)
    stream = client.chat.completions.create(model=client.models.list().data[0].id, messages=[{"role": "user", "content": "Count"}], max_tokens=8, temperature=0, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].choices[0].finish_reason in ("stop", "length")
    # Greedy, so the streamed text equals the non-streamed one.
    whole = client.chat.completions.create(model=chunks[0].model, messages=[{"role": "user", "content": "Count"}], max_tokens=8, temperature=0)
    assert whole.choices[0].message.content == text


def test_openai_completions_and_errors(stack: stack_mod.Stack) -> None:
    client = _client(stack)
    model = client.models.list().data[0].id
    reply = client.completions.create(model=model, prompt="def add(a, b):", max_tokens=6, temperature=0)
    assert reply.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(model=model, prompt="def add(a, b):", max_tokens=6, temperature=0, stream=True))
    assert streamed == reply.choices[0].text
    with pytest.raises(openai.BadRequestError, match=r"'n' must be an integer in \[1, 8\]"):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], n=9)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=model, prompt="x", max_tokens=10**7)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    assert client.completions.create(model=model, prompt="still serving", max_tokens=2).choices


def test_openai_logprobs_and_usage_through_the_official_client(stack: stack_mod.Stack) -> None:
    """The engine's log-probs of the sampled tokens, one per completion token, the same
    streamed as whole (greedy); a stream's usage chunk; a field the server would ignore is
    refused by name."""
    client = _client(stack)
    model = client.models.list().data[0].id
    chat = {"model": model, "messages": [{"role": "user", "content": "Count"}], "max_tokens": 8, "temperature": 0}
    whole = client.chat.completions.create(**chat, logprobs=True)  # type: ignore[call-overload]
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens and all(c.logprob <= 0 for c in content)
    chunks = list(client.chat.completions.create(**chat, logprobs=True, stream=True, stream_options={"include_usage": True}))  # type: ignore[call-overload]
    streamed = [c for chunk in chunks if chunk.choices and chunk.choices[0].logprobs for c in chunk.choices[0].logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-3)
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    reply = client.completions.create(model=model, prompt="def add(a, b):", max_tokens=6, temperature=0, logprobs=0)
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == reply.usage.completion_tokens and lp.text_offset[0] == 0
    with pytest.raises(openai.BadRequestError, match="'presence_penalty' is not supported"):
        client.chat.completions.create(**chat, presence_penalty=1.0)  # type: ignore[call-overload]


def test_openai_top_logprobs_are_the_engines_ranking(stack: stack_mod.Stack) -> None:
    """Alternatives as the engine ranks them: k per token, most likely first, a
    distribution's share at most; greedy, the sampled token is the first of them with
    the same log-prob (chat's list, and a completion's map by token text)."""
    client = _client(stack)
    model = client.models.list().data[0].id
    chat = {"model": model, "messages": [{"role": "user", "content": "Count"}], "max_tokens": 8, "temperature": 0}
    for c in client.chat.completions.create(**chat, logprobs=True, top_logprobs=5).choices[0].logprobs.content:  # type: ignore[call-overload]
        top = [(a.token, a.logprob) for a in c.top_logprobs]
        assert len(top) == 5 and [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True), top
        assert math.fsum(math.exp(lp) for _, lp in top) <= 1 + 1e-3, top
        assert top[0] == (c.token, pytest.approx(c.logprob, abs=1e-6)), (c.token, c.logprob, top)
    reply = client.completions.create(model=model, prompt="def add(a, b):", max_tokens=8, temperature=0, logprobs=3)
    lp = reply.choices[0].logprobs
    assert len(lp.top_logprobs) == len(lp.tokens) and all(0 < len(alts) <= 3 for alts in lp.top_logprobs)
    for token, own, alts in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert alts.get(token) == pytest.approx(own, abs=1e-6) and own == pytest.approx(max(alts.values()), abs=1e-6), (token, own, alts)
    with pytest.raises(openai.BadRequestError, match="'top_logprobs' must be an integer in"):
        client.chat.completions.create(**chat, logprobs=True, top_logprobs=21)  # type: ignore[call-overload]


def test_openai_tools_through_the_official_client(stack: stack_mod.Stack) -> None:
    """A conversation with a tool call and its result, and the tools offered, goes through
    the real engine (its template, the stop at a call's closing tag); the reply is either
    content or calls of the offered tool. A forced tool choice is refused by name."""
    client = _client(stack)
    model = client.models.list().data[0].id
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, clear"},
    ]
    for stream in (False, True):
        if stream:
            chunks = list(client.chat.completions.create(model=model, messages=messages, tools=[weather], max_tokens=16, temperature=0, stream=True))  # type: ignore[call-overload]
            finish = chunks[-1].choices[0].finish_reason
            calls = [c for chunk in chunks if chunk.choices and chunk.choices[0].delta.tool_calls for c in chunk.choices[0].delta.tool_calls]
        else:
            reply = client.chat.completions.create(model=model, messages=messages, tools=[weather], max_tokens=16, temperature=0)  # type: ignore[call-overload]
            finish, calls = reply.choices[0].finish_reason, reply.choices[0].message.tool_calls or []
        assert finish in ("stop", "length", "tool_calls") and (finish == "tool_calls") == bool(calls)
        assert all(c.function.name == "get_weather" for c in calls)
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(model=model, messages=messages, tools=[weather], tool_choice="required", max_tokens=4)  # type: ignore[call-overload]


async def _generate_as(address: str, key: str, credentials: str) -> int:
    """Tokens of one Generate call made with API key ``key`` (sent as the call's token)."""
    request = pb.GenerateRequest(prompt="def add(a, b):", sampling=pb.SamplingParams(max_tokens=5, min_tokens=5))
    async with open_channel(address, auth=ClientAuth.load(Path(credentials), "production", token=key)) as channel:
        return sum([len(c.token_ids) async for c in pb_grpc.RolloutStub(channel).Generate(request)])


def test_the_traffic_class_is_the_callers_key_not_the_request(stack: stack_mod.Stack) -> None:
    address = stack.addresses["rollout"]
    status = lambda: asyncio.run(_call(address, "Status", pb.RolloutStatusRequest()))  # noqa: E731
    production = credentials.role_token(Path(stack.credentials), "production")
    for key, counter in (("test-rl-key", "rl_tokens"), ("test-production-key", "production_tokens"), (production, "production_tokens")):
        before = status()
        assert asyncio.run(_generate_as(address, key, stack.credentials)) == 5
        after = status()
        assert getattr(after, counter) - getattr(before, counter) == 5, (key, counter)
    admission = asyncio.run(stack_mod.gather_status(stack))["services"]["rollout"]["rl_admission"]  # type: ignore[index]
    assert admission["rl_token_share"] > 0 and admission["running"] == 0 and 0 <= admission["slo_attainment"] <= 1
    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(_generate_as(address, "forged-key", stack.credentials))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED and "forged" not in (info.value.details() or "")
    forged = openai.OpenAI(base_url=stack.addresses["rollout_http"], api_key="forged-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        forged.completions.create(model="x", prompt="x", max_tokens=2)


def test_openai_n_choices(stack: stack_mod.Stack) -> None:
    client = _client(stack)
    model = client.models.list().data[0].id
    reply = client.completions.create(model=model, prompt="def add(a, b):", max_tokens=6, temperature=1.0, n=3, seed=5)
    assert sorted(c.index for c in reply.choices) == [0, 1, 2] and all(c.text for c in reply.choices)
    # Each seeded choice is reproducible on its own: choice i is the single request with seed 5 + i.
    alone = client.completions.create(model=model, prompt="def add(a, b):", max_tokens=6, temperature=1.0, seed=7)
    assert alone.choices[0].text == reply.choices[2].text
    streamed = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Count"}], max_tokens=5, temperature=0, n=2, stream=True)
    texts = ["", ""]
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts[0] and texts[0] == texts[1]  # greedy: both choices agree


def test_run_episodes_trajectories_are_consistent_and_land_in_the_stream(stack: stack_mod.Stack) -> None:
    rollout = stack.addresses["rollout"]
    request = pb.RunEpisodesRequest(task_ids=["python/add"], group_size=3, publish=True, sampling=pb.SamplingParams(max_tokens=16))
    reply = asyncio.run(_call(rollout, "RunEpisodes", request))
    assert len(reply.trajectories) == 3
    for t in reply.trajectories:
        n = len(t.completion_token_ids)
        assert n and len(t.logprobs) == len(t.loss_mask) == len(t.policy_versions) == n
        for lp, m, v in zip(t.logprobs, t.loss_mask, t.policy_versions):
            # Model tokens: trained, a real log-prob and version; tool output: masked, neither.
            assert (m == 1 and lp <= 0 and v >= 0) or (m == 0 and lp == 0 and v == -1)
        assert t.prompt_token_ids and 0.0 <= t.reward <= 1.0

    async def stream_ids() -> set[str]:
        stream = RedisGroupTransport(TransportConfig(url=stack.redis_url))
        try:
            entries = [decode_entry(eid, fields) for eid, fields in await stream.redis.xrange(stream.config.stream)]
            # Whole groups travel: the group's three trajectories are in one entry.
            return {t.trajectory_id for e in entries if e.group for t in e.group.trajectories}
        finally:
            await stream.close()

    assert {t.trajectory_id for t in reply.trajectories} <= asyncio.run(stream_ids())


def _hf_logprobs(model_dir, weights, token_ids: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Log-probs of ``token_ids`` from a transformers forward pass on the given bf16 weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    if weights is not None:
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, raw in weights.items():
                params[name].copy_(to_torch(raw))
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits.float()
    logp = torch.log_softmax(logits[0, :-1], dim=-1).gather(-1, torch.tensor(token_ids[1:]).unsqueeze(-1)).squeeze(-1)
    return torch.cat([torch.zeros(1), logp])


def _published_weights(stack: stack_mod.Stack):  # type: ignore[no-untyped-def]
    async def fetch():  # type: ignore[no-untyped-def]
        subscriber = WeightSubscriber(stack.addresses["weightsync"], None, -1)
        try:
            async for update in subscriber.updates(follow=False):
                latest = update
            return latest
        finally:
            await subscriber.close()

    return asyncio.run(fetch())


def test_vllm_logprobs_match_transformers_before_and_after_an_update(stack: stack_mod.Stack, tiny_model) -> None:  # type: ignore[no-untyped-def]
    rollout = stack.addresses["rollout"]
    ids = [1, 504, 2260, 314, 253, 1345, 30, 7, 1180, 42, 9, 88]

    def check() -> torch.Tensor:
        update = _published_weights(stack)
        scored = asyncio.run(_call(rollout, "Score", pb.ScoreRequest(token_ids=ids)))
        assert scored.policy_version == update.version
        served = torch.tensor(list(scored.logprobs))
        reference = _hf_logprobs(tiny_model, update.weights, ids)
        assert torch.allclose(served, reference, atol=0.05), (served - reference).abs().max()
        return served

    before = check()
    version = asyncio.run(_call(rollout, "Status", pb.RolloutStatusRequest())).policy_version
    asyncio.run(_call(rollout, "RunEpisodes", pb.RunEpisodesRequest(task_ids=["text/shout"], group_size=4, publish=True, sampling=pb.SamplingParams(max_tokens=16))))
    deadline = time.monotonic() + 180
    while asyncio.run(_call(rollout, "Status", pb.RolloutStatusRequest())).policy_version <= version:
        assert time.monotonic() < deadline, "no new version reached rollout"
        time.sleep(0.5)
    after = check()
    assert (after - before).abs().max() > 0.05, "the update should move the served log-probs"
