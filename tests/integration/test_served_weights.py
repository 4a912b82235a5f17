"""Served weights are the published weights: a real rollout (vLLM, tiny model) follows a
real weightsync origin, on each CPU code path vLLM's CPU backend takes (this CPU's own,
and an AVX2 one however the test machine is built), on the element path and the full
path. Versions are published by the test, each with a canary computed the trainer's way.

Every guarantee has a test that breaks it on purpose: a dropped tensor, two swapped
tensors and a stale tied output head (the mixed model that vLLM's reload produced) are
each caught, rolled back, and the previous version is still what is served -- checked by
what the engine computes, against a transformers forward pass.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from meridian import canary
from meridian import stack as stack_mod
from meridian.grpc_runtime import open_channel
from meridian.v1 import rollout_pb2 as pb
from meridian.v1 import rollout_pb2_grpc as pb_grpc
from services.trainer.learner import canary_logprobs
from services.weightsync import client as weightsync
from meridian.tensors import RawTensor, from_torch, to_torch

pytestmark = pytest.mark.engine

HOOKS = Path(__file__).parent / "engine_hooks"
PROBE = [1, 504, 2260, 314, 253, 1345, 30, 7, 1180, 42, 9, 88, 4021, 77, 913]
# The tiny model's two bf16 implementations agree to ~0.003 nats: a tight canary.
CANARY_FLAGS = ["--canary-mean-tolerance", "0.03", "--canary-max-tolerance", "0.3"]
SAME = 0.05  # served vs reference on the same weights (bf16 noise is ~0.005 here)
LONG = 600  # tokens of each request an update lands in
CONCURRENT = 3
STEP_DELAY_S = 0.01  # each engine step sleeps this long first (see engine_hooks): LONG steps take >= 6 s

VARIANTS = {
    "native-delta": ({}, "delta"),
    # vLLM's AVX2 kernels and oneDNN-packed linear layers, as on an AVX2-only EPYC. (Capping
    # oneDNN itself at AVX2 makes it decline bf16 and vLLM keep plain weights: another path.)
    "avx2-delta": ({"MERIDIAN_TEST_CPU": "avx2"}, "delta"),
    "native-full": ({}, "full"),
}


@dataclasses.dataclass
class Served:
    """A weightsync origin and a rollout following it; the versions published so far."""

    rollout: str
    weightsync: str
    sabotage: Path
    reference: torch.nn.Module
    canary_ids: list[list[int]]
    path: str
    versions: dict[int, dict[str, RawTensor]] = dataclasses.field(default_factory=dict)

    def publish(self, version: int, weights: dict[str, RawTensor], probe: object = None) -> None:
        probe = probe or self.canary_for(weights)
        asyncio.run(weightsync.publish(self.weightsync, version, weights, canary=probe))
        self.versions[version] = weights

    def canary_for(self, weights: dict[str, RawTensor]) -> object:
        return canary.build(self.canary_ids, canary_logprobs(self.reference, weights, self.canary_ids))

    def status(self) -> pb.RolloutStatus:
        return asyncio.run(_call(self.rollout, "Status", pb.RolloutStatusRequest()))

    def wait_for(self, done, what: str, timeout_s: float = 120) -> pb.RolloutStatus:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout_s
        while not done(status := self.status()):
            assert time.monotonic() < deadline, f"rollout never {what}: {status}"
            time.sleep(0.2)
        return status

    def served_logprobs(self, ids: list[int]) -> tuple[torch.Tensor, int]:
        reply = asyncio.run(_call(self.rollout, "Score", pb.ScoreRequest(token_ids=ids)))
        return torch.tensor(list(reply.logprobs)), reply.policy_version

    def reference_logprobs(self, version: int, ids: list[int]) -> torch.Tensor:
        return torch.tensor(canary_logprobs(self.reference, self.versions[version], [ids])[0])

    def assert_serves(self, version: int) -> None:
        """What the engine computes is ``version`` (and visibly not the one before it)."""
        served, tagged = self.served_logprobs(PROBE)
        assert tagged == version
        diff = (served - self.reference_logprobs(version, PROBE)).abs().max().item()
        assert diff < SAME, f"served log-probs are {diff:.3f} nats off version {version}"
        others = [v for v in self.versions if v != version]
        if others:
            nearest = min((served - self.reference_logprobs(v, PROBE)).abs().max().item() for v in others)
            assert nearest > SAME, f"version {version} is indistinguishable from another ({nearest:.3f})"

    def sabotage_next(self, version: int, kind: str, tensors: list[str] = ()) -> None:  # type: ignore[assignment]
        self.sabotage.write_text(json.dumps({"version": version, "kind": kind, "tensors": list(tensors)}))


async def _call(address: str, method: str, request):  # type: ignore[no-untyped-def]
    async with open_channel(address) as channel:
        return await getattr(pb_grpc.RolloutStub(channel), method)(request)


def _perturb(weights: dict[str, RawTensor], seed: int, fraction: float = 0.05, only: str = "") -> dict[str, RawTensor]:
    """A new version: ``fraction`` of the elements (of tensor ``only``, if given) moved a lot."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, raw in weights.items():
        t = to_torch(raw)
        if only and name != only:
            out[name] = raw
            continue
        mask = torch.rand(t.shape, generator=g) < fraction
        moved = (t.float() * 1.5 + 0.02 * torch.randn(t.shape, generator=g)).to(t.dtype)
        out[name] = from_torch(torch.where(mask, moved, t).clone())
    return out


@pytest.fixture(scope="module", params=list(VARIANTS))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Served]:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cpu_env, path = VARIANTS[request.param]
    run_dir = tmp_path_factory.mktemp(request.param)
    sabotage = run_dir / "sabotage.json"
    base_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HOOKS), os.environ.get("PYTHONPATH", "")])}
    procs: dict[str, object] = {}
    try:
        procs["weightsync"], ws_address, _ = stack_mod.spawn_service("weightsync", ["--insecure", "true", "--data-dir", str(run_dir / "ws")], run_dir, base_env)
        reference = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(tiny_model)
        weights = {n: from_torch(t) for p in sorted(tiny_model.glob("*.safetensors")) for n, t in load_file(p).items()}
        box = Served("", ws_address, sabotage, reference, canary.canary_token_ids(lambda t: tokenizer(t)["input_ids"]), path)
        box.publish(0, weights)
        rollout_env = {**base_env, **cpu_env, "MERIDIAN_TEST_SABOTAGE": str(sabotage), "MERIDIAN_TEST_STEP_DELAY_S": str(STEP_DELAY_S)}
        args = ["--insecure", "true", "--model", str(tiny_model), "--weightsync", ws_address, "--redis-url", "redis://127.0.0.1:9/0", "--envsandbox", "127.0.0.1:9",
                "--max-model-len", "2048", "--update-policy", "pause", "--weight-apply", path, *CANARY_FLAGS]
        procs["rollout"], box.rollout, log = stack_mod.spawn_service("rollout", args, run_dir, rollout_env)
        stack_mod.wait_serving({"rollout": box.rollout}, procs, {"rollout": str(log)}, 600)  # type: ignore[arg-type]
        yield box
    finally:
        pids = {name: proc.pid for name, proc in procs.items()}  # type: ignore[attr-defined]
        stack_mod.Stack(run_dir, pids, {}, {}, "").stop(30)
        assert not [n for n, pid in pids.items() if stack_mod.group_members(pid)]


def test_version_0_is_the_checkpoint(served: Served) -> None:
    served.assert_serves(0)


def test_an_update_is_served_exactly_and_read_back(served: Served) -> None:
    served.publish(1, _perturb(served.versions[0], seed=1))
    # The update's report is recorded just after the version switches: wait for both.
    status = served.wait_for(lambda s: s.policy_version == 1 and s.updates_applied == 1, "served version 1")
    assert status.apply_path == served.path and status.updates_rejected == 0
    if served.path == "delta":
        assert status.readback_elements > 0
    assert 0 < status.canary_mean_diff < 0.03
    served.assert_serves(1)


def test_a_dropped_tensor_is_rolled_back(served: Served) -> None:
    if served.path != "delta":
        pytest.skip("the full path writes whole tensors; its sabotage is the stale head")
    served.sabotage_next(2, "drop", ["model.layers.1.mlp.down_proj.weight"])
    served.publish(2, _perturb(served.versions[1], seed=2))
    status = served.wait_for(lambda s: s.rejected_version == 2, "rejected version 2")
    assert "read back" in status.last_update_error and status.policy_version == 1
    served.assert_serves(1)


def test_swapped_tensors_are_rolled_back(served: Served) -> None:
    if served.path != "delta":
        pytest.skip("the full path writes whole tensors; its sabotage is the stale head")
    served.sabotage_next(3, "swap", ["model.layers.0.self_attn.o_proj.weight", "model.layers.1.self_attn.o_proj.weight"])
    served.publish(3, _perturb(served.versions[2], seed=3))
    status = served.wait_for(lambda s: s.rejected_version == 3, "rejected version 3")
    assert "read back" in status.last_update_error and status.policy_version == 1
    served.assert_serves(1)


def test_a_stale_tied_head_is_caught_by_the_canary(served: Served) -> None:
    """The mixed model of the original bug: embedding new, tied output head old. Only the
    canary can see it here (the sabotage also hides the head from the read-back). On a CPU
    where the engine's head computes with the shared tensor itself (no processed copy, as
    on an AVX2-only CPU), nothing can go stale: the hook says so, and only then is the
    served version 4 not a failure."""
    before = served.status()
    effect = Path(str(served.sabotage) + ".effect")
    effect.unlink(missing_ok=True)
    served.sabotage_next(4, "stale-head")
    served.publish(4, _perturb(served.versions[max(served.versions)], seed=4, fraction=0.5, only="model.embed_tokens.weight"))
    status = served.wait_for(lambda s: s.rejected_version == 4 or s.policy_version == 4, "rejected or served version 4")
    if status.policy_version == 4 and effect.exists() and json.loads(effect.read_text()) == {"stale": False}:
        served.assert_serves(4)  # what it serves is exactly version 4
        pytest.skip("this CPU's engine keeps no processed copy of the tied head: the sabotage left nothing stale to catch")
    assert status.last_update_error.startswith("canary") and status.policy_version == before.policy_version
    served.assert_serves(before.policy_version)


def test_the_next_version_applies_on_top_of_rejected_ones(served: Served) -> None:
    served.sabotage.unlink(missing_ok=True)
    before = served.status()
    served.publish(5, _perturb(served.versions[4], seed=5))
    served.wait_for(lambda s: s.policy_version == 5 and s.updates_applied == before.updates_applied + 1, "served version 5")
    served.assert_serves(5)


GENERATOR = """
import json, sys, threading
import grpc
from meridian.v1 import rollout_pb2 as pb
from meridian.v1 import rollout_pb2_grpc as pb_grpc

address, length, prompts = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
results = {}
started = threading.Event()


def generate(i):
    request = pb.GenerateRequest(prompt_token_ids=prompts[i],
                                 sampling=pb.SamplingParams(temperature=1.0, max_tokens=length, min_tokens=length, seed=7 + i))
    ids, logprobs = [], []
    with grpc.insecure_channel(address) as channel:
        for chunk in pb_grpc.RolloutStub(channel).Generate(request):
            ids += chunk.token_ids
            logprobs += chunk.logprobs
            if not started.is_set():
                started.set()
                print("started", flush=True)
            if chunk.finished:
                results[i] = [ids, logprobs, list(chunk.completion_policy_versions)]


threads = [threading.Thread(target=generate, args=(i,)) for i in range(len(prompts))]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps(results), flush=True)
"""


def test_tokens_carry_the_version_that_sampled_them_across_a_pause(served: Served) -> None:
    """An update lands in the middle of requests under the pause policy: in each, the
    version changes once, every token before the switch matches the old weights' log-probs
    and every token after it the new weights' (the requests' KV is recomputed on the switch)."""
    if served.path != "delta":
        pytest.skip("labelling does not depend on the apply path, and a whole reload may outlast the request")
    old = served.status().policy_version
    upcoming = _perturb(served.versions[old], seed=6)
    probe = served.canary_for(upcoming)  # before the requests: nothing slow while they run
    prompts = [PROBE[: 4 + i] for i in range(CONCURRENT)]
    # The requests stream from another process, so this one is free to publish meanwhile.
    generator = subprocess.Popen(
        [sys.executable, "-c", GENERATOR, served.rollout, str(LONG), json.dumps(prompts)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert generator.stdout is not None and generator.stdout.readline().strip() == "started"
        served.publish(old + 1, upcoming, probe)
        out, _ = generator.communicate(timeout=600)
    finally:
        generator.kill()
        generator.wait()
    results = {int(k): v for k, v in json.loads(out.strip().splitlines()[-1]).items()}
    assert sorted(results) == list(range(CONCURRENT))
    for i, (ids, logprobs, versions) in results.items():
        prompt = prompts[i]
        assert len(versions) == len(ids) == LONG
        switch = next((k for k, v in enumerate(versions) if v != old), len(versions))
        assert 0 < switch < len(ids), f"request {i}: the update did not land mid-request (switch at {switch})"
        assert set(versions[switch:]) == {old + 1}, "the version changes once, to the new one"
        got = torch.tensor(logprobs)
        before = served.reference_logprobs(old, prompt + ids)[len(prompt) :]
        after = served.reference_logprobs(old + 1, prompt + ids)[len(prompt) :]
        assert (got[:switch] - before[:switch]).abs().max().item() < SAME
        assert (got[switch:] - after[switch:]).abs().max().item() < SAME
        assert (got[switch:] - before[switch:]).abs().mean().item() > (got[switch:] - after[switch:]).abs().mean().item()
