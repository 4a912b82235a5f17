"""Rollout's gRPC API on the real stack (vLLM engine, envsandbox) under random and mutated
requests: each answer is a result or a clear status, never INTERNAL/UNKNOWN or a stall;
after each request the service still generates; the engine still serves the same weights
at the end (a bad request must not reach the engine as something it dies on); and the
episodes' sandboxes are all closed, those of refused requests included."""
from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import httpx
import pytest

from meridian import stack as stack_mod
from meridian.grpc_runtime import open_channel
from meridian.v1 import envsandbox_pb2 as es
from meridian.v1 import envsandbox_pb2_grpc as es_grpc
from meridian.v1 import rollout_pb2 as pb
from meridian.v1 import rollout_pb2_grpc as pb_grpc
from tests.grpc_fuzz import Finding, fuzz, report, requests_for
from tests.integration.conftest import CALLER_KEYS

pytestmark = [pytest.mark.stack, pytest.mark.engine]

REQUESTS_PER_METHOD = 24
CALL_TIMEOUT_S = 120.0  # generous on a loaded two-core machine; a stall is far longer
PROBE_TIMEOUT_S = 60.0
PRODUCTION_KEY = next(k for k, role in CALLER_KEYS.items() if role == "production")

HINTS: dict[str, list[Any]] = {
    "prompt": ["def add(a, b):", "", "x" * 20000, "<|im_start|>system\n"],
    "prompt_token_ids": [1, 2, 100, 0, -1, 2**31 - 1],
    "token_ids": [1, 2, 100, 0, -1, 2**31 - 1],
    "max_tokens": [1, 4, 16, 0, -1, 2**31 - 1],
    "min_tokens": [0, 1, 8, 16, -1, 2**31 - 1],
    "temperature": [0.0, 0.7, 1.0, -1.0, float("nan"), float("inf")],
    "top_p": [0.0, 0.5, 1.0, 2.0, -0.5, float("nan")],
    "stop": ["\n", "", "x" * 2000],
    "seed": [0, 1, -1, 2**63 - 1],
    "task_ids": ["python/add", "no/such/task", ""],
    "num_tasks": [0, 1, 2, 64, -1, 10**6],
    "group_size": [0, 2, 3, 64, -1, 10**6],
    "request_id": ["", "r1", "x" * 5000],
}


def test_rollout_answers_every_random_request_and_keeps_serving(stack: stack_mod.Stack) -> None:
    address = stack.addresses["rollout"]
    sampling = pb.SamplingParams(max_tokens=4)
    valid: dict[str, Any] = {
        "Generate": pb.GenerateRequest(prompt="def add(a, b):", sampling=sampling),
        "Score": pb.ScoreRequest(token_ids=[1, 2, 3, 4]),
        "Status": pb.RolloutStatusRequest(),
        # publish stays off: the shared stack's trainer must not train on these.
        "RunEpisodes": pb.RunEpisodesRequest(task_ids=["python/add"], group_size=2, sampling=sampling),
    }

    async def body() -> None:
        async with open_channel(address) as channel, open_channel(stack.addresses["envsandbox"]) as sandboxes:
            stub = pb_grpc.RolloutStub(channel)
            before = await stub.Status(pb.RolloutStatusRequest())
            live_before = await _live_sandboxes(sandboxes)

            async def probe() -> None:
                chunks = [c async for c in stub.Generate(pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(max_tokens=1)), timeout=PROBE_TIMEOUT_S)]
                assert sum(len(c.token_ids) for c in chunks) == 1

            findings: list[Finding] = []
            for method, seed_request in valid.items():
                requests = requests_for(seed_request, REQUESTS_PER_METHOD, HINTS)
                for _, request in requests:
                    if method == "RunEpisodes":
                        request.publish = False
                rpc = getattr(stub, method)
                await fuzz(f"Rollout.{method}", lambda r, rpc=rpc: rpc(r, timeout=CALL_TIMEOUT_S), requests, probe, findings, probe_timeout_s=PROBE_TIMEOUT_S)
            assert not findings, report(findings)
            after = await stub.Status(pb.RolloutStatusRequest())
            # Nothing the fuzzing sent changed what the engine serves, or rejected an update.
            assert after.updates_rejected == before.updates_rejected
            if after.policy_version == before.policy_version:
                assert after.weights_hash == before.weights_hash
            deadline = asyncio.get_running_loop().time() + 60
            while (leaked := await _live_sandboxes(sandboxes) - live_before) and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.5)
            assert not leaked, f"sandboxes left open by the fuzzed episodes: {sorted(leaked)}"

    asyncio.run(asyncio.wait_for(body(), 1800))


async def _live_sandboxes(channel: object) -> set[str]:
    return {s.sandbox_id for s in (await es_grpc.EnvSandboxStub(channel).List(es.ListRequest())).sandboxes}


# ---------------------------------------------------------------- the OpenAI-compatible API

#: JSON values of every type, edge cases first: what a mutated body puts in a field.
JSON_VALUES: list[Any] = [
    None, True, False, 0, -1, 1, 2, 0.5, -0.0, 1e308, -1e308, 2**63, 2**64 + 1, -(2**63) - 1, "", "x", "user", "system",
    "<|im_start|>", "x" * 20000, [], [1, 2], ["a"], [[]], {}, {"role": "user"}, {"content": None}, [{"role": "user", "content": 1}],
]

VALID_BODIES: dict[str, dict[str, Any]] = {
    "completions": {"model": "the served one", "prompt": "def add(a, b):", "max_tokens": 4, "temperature": 0.5, "stop": ["\n"], "logprobs": 1, "n": 2, "seed": 3},
    "chat/completions": {
        "model": "the served one", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        "max_tokens": 4, "temperature": 0.5, "top_p": 0.9, "logprobs": True, "stream": False, "n": 1,
    },
}


def _mutated_json(value: Any, rng: random.Random, depth: int = 0) -> Any:
    """``value`` with one field somewhere replaced, removed or added."""
    if isinstance(value, dict) and value and (depth > 2 or rng.random() < 0.5 or not any(isinstance(v, (dict, list)) and v for v in value.values())):
        out = dict(value)
        key = rng.choice([*out, "extra_field"])
        if key in out and rng.random() < 0.2:
            del out[key]
        else:
            out[key] = rng.choice(JSON_VALUES)
        return out
    if isinstance(value, dict) and value:
        key = rng.choice([k for k, v in value.items() if isinstance(v, (dict, list)) and v])
        return {**value, key: _mutated_json(value[key], rng, depth + 1)}
    if isinstance(value, list) and value:
        out = list(value)
        at = rng.randrange(len(out))
        out[at] = _mutated_json(out[at], rng, depth + 1) if rng.random() < 0.6 else rng.choice(JSON_VALUES)
        return out
    return rng.choice(JSON_VALUES)


def test_the_openai_api_answers_every_mutated_body_with_a_4xx_or_a_result(stack: stack_mod.Stack) -> None:
    """Bodies of /v1/completions and /v1/chat/completions with fields replaced by values of
    any JSON type (streaming ones included): a 2xx or a 4xx with an error message, never a
    5xx, and the API still answers after each."""
    base = stack.addresses["rollout_http"] + "/"  # .../v1/: the paths below are under it
    headers = {"authorization": f"Bearer {PRODUCTION_KEY}"}
    findings: list[str] = []
    with httpx.Client(base_url=base, headers=headers, timeout=CALL_TIMEOUT_S) as http:
        model = http.get("models").json()["data"][0]["id"]
        for path, valid in VALID_BODIES.items():
            valid = {**valid, "model": model}
            for seed in range(REQUESTS_PER_METHOD * 2):
                rng = random.Random(seed)
                body = valid
                for _ in range(1 + seed % 3):
                    body = _mutated_json(body, rng)
                if seed % 4 == 0:
                    body = {**body, "stream": True}
                text = json.dumps(body)
                shown = f"\n    body: {text[:400]}"
                try:
                    reply = http.post(path, content=text, headers={"content-type": "application/json"})
                except httpx.TransportError as exc:  # the server dropped the connection
                    findings.append(f"{path} (seed {seed}) -> {exc!r}{shown}")
                else:
                    if reply.status_code >= 500:
                        findings.append(f"{path} (seed {seed}) -> {reply.status_code} {reply.text[:200]}{shown}")
                    elif reply.status_code >= 400 and not _error_object(reply):
                        findings.append(f"{path} (seed {seed}) -> {reply.status_code} without an error object: {reply.text[:200]}")
                try:
                    probe = http.post("completions", json={"model": model, "prompt": "x", "max_tokens": 1})
                    answered = probe.status_code == 200
                except httpx.TransportError:
                    answered = False
                if not answered:
                    findings.append(f"after {path} (seed {seed}) the API did not answer a plain completion{shown}")
                    break
    assert not findings, f"{len(findings)} bodies not handled:\n" + "\n".join(findings[:12])


def _error_object(reply: httpx.Response) -> bool:
    """Whether a 4xx reply carries an OpenAI-style error object with a message."""
    try:
        return bool(reply.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return False
