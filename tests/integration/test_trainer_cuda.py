"""The trainer on a GPU, the path ``services.trainer.distributed`` takes when CUDA is there
(NCCL, parameters and optimiser state on the device, FSDP2's gathers on the device).
Skipped without CUDA: CI has no GPU, so these run where one is.

One rank under torchrun, replicated and with FSDP2, on the same batches as one process on
the same GPU: the same losses and weights (to float tolerance; the replay also restores a
checkpoint before its last batch, so a restore that lost the optimiser's moments or the
RNG would show), and the origin stores, byte for byte, what one process publishing the
bf16 of those weights stores. The GPU's losses are the CPU's to float tolerance. A
checkpoint written on the GPU resumes there bit for bit, and on the CPU (a job moved to
other machines) to float tolerance. The canary a GPU trainer publishes with a version is
what a CPU computes from the same bf16 weights, well within the rollouts' tolerance."""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import torch

from meridian.tensors import from_torch
from services.trainer.config import TrainerConfig
from services.trainer.distributed import save_batches
from services.weightsync import client as weightsync
from services.weightsync.signing import generate_signing_key
from benchmarks.support.synthetic import fixed_groups
from tests.conftest import serving
from tests.integration.test_trainer_shard_publish import free_port, origin, run_ranks, store_files, store_of_one_process

SETTINGS = {"lr": 1e-3, "groups_per_step": 2, "threads": 1, "max_policy_lag": 8, "micro_batch": 2}

pytestmark = [pytest.mark.engine, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _flags() -> list[str]:
    return [arg for key, value in SETTINGS.items() for arg in (f"--{key.replace('_', '-')}", str(value))]


def _learner(model: Path, device: str):  # type: ignore[no-untyped-def]
    from services.trainer.learner import Learner

    return Learner(model, TrainerConfig(model=str(model), **SETTINGS), device=device)


@pytest.mark.parametrize("data_parallel", ["ddp", "fsdp"])
def test_one_nccl_rank_trains_resumes_and_publishes_like_one_process(tmp_path: Path, tiny_model: Path, data_parallel: str) -> None:
    generate_signing_key(tmp_path / "key", tmp_path / "key.pub")
    groups = fixed_groups(tiny_model, 4, group_size=3, seed=3)
    batches = [groups[0:2], groups[2:4]]
    save_batches(tmp_path / "batches.pt", batches)
    out = tmp_path / "out"

    async def on_the_gpu() -> None:
        async with serving(origin(tmp_path / "gpu", tmp_path / "key.pub")) as address:
            argv = [
                sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
                "--master-port", str(free_port()), "-m", "services.trainer.distributed", "--model", str(tiny_model),
                "--replay", str(tmp_path / "batches.pt"), "--out", str(out), "--data-parallel", data_parallel,
                "--publish-to", address, "--signing-key", str(tmp_path / "key"), "--device", "cuda", *_flags(),
            ]
            await run_ranks(argv)
            assert await weightsync.latest_version(address) == 1

    asyncio.run(on_the_gpu())
    result = torch.load(out / "result.pt", weights_only=False)

    # One process on the same GPU, without the replay's restore.
    single = _learner(tiny_model, "cuda")
    start = single.policy_weights()
    initial = single.master_weights()
    losses = [single.step(b).loss for b in batches]
    final = single.master_weights()
    print(f"{data_parallel}: losses {result['losses']} vs {losses}")
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(losses), rtol=1e-5, atol=1e-7)
    assert set(result["weights"]) == set(final)
    worst = max(float((result["weights"][n] - final[n]).abs().max()) for n in final)
    print(f"{data_parallel}: largest weight difference from one process {worst:.3g}")
    for name, want in final.items():
        torch.testing.assert_close(result["weights"][name], want, rtol=0, atol=1e-5, msg=name)
    assert any(not torch.equal(final[n], initial[n]) for n in final), "the steps should have changed the weights"

    # What the origin holds is the bf16 of what the rank trained, bit for bit.
    trained = {name: from_torch(t.to(torch.bfloat16)) for name, t in result["weights"].items()}
    want, got = store_of_one_process(tmp_path / "single", tmp_path / "key", [start, trained]), store_files(tmp_path / "gpu")
    assert want.keys() == got.keys()
    for name in want:
        assert got[name] == want[name], f"{name}: the GPU rank's publish stored other bytes than one process"

    # The CPU, on the same batches, trains the same way: fp32 on both, so the losses (sums
    # that nearly cancel, hence the absolute tolerance) and the weights differ only by the
    # order of summation, far less than one step's change (lr, 1e-3, per element).
    cpu = _learner(tiny_model, "cpu")
    cpu_losses = [cpu.step(b).loss for b in batches]
    on_cpu = cpu.master_weights()
    worst = max(float((on_cpu[n] - final[n]).abs().max()) for n in final)
    print(f"{data_parallel}: cpu losses {cpu_losses}, largest weight difference from the gpu {worst:.3g}")
    torch.testing.assert_close(torch.tensor(cpu_losses), torch.tensor(losses), rtol=1e-3, atol=1e-7)
    for name, want in final.items():
        torch.testing.assert_close(on_cpu[name], want, rtol=0, atol=1e-4, msg=name)


def test_a_checkpoint_taken_on_the_gpu_resumes_on_the_gpu_and_on_the_cpu(tmp_path: Path, tiny_model: Path) -> None:
    from services.trainer.checkpoint import load_checkpoint, save_checkpoint

    groups = fixed_groups(tiny_model, 4, group_size=3, seed=5)
    first, last = groups[0:2], groups[2:4]
    gpu = _learner(tiny_model, "cuda")
    gpu.step(first)
    path = save_checkpoint(tmp_path, 1, gpu.state(), {}, keep=2)
    gpu.step(last)
    want = gpu.master_weights()
    for device, tolerance in (("cuda", 0.0), ("cpu", 1e-4)):
        resumed = _learner(tiny_model, device)
        resumed.load_state(load_checkpoint(path)[0])
        assert resumed.step_count == 1
        resumed.step(last)
        got = resumed.master_weights()
        worst = max(float((got[n] - want[n]).abs().max()) for n in want)
        print(f"resumed on {device}: largest weight difference {worst:.3g}")
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=tolerance, msg=f"{device}: {name}")


def test_the_canary_a_gpu_trainer_publishes_is_what_the_cpu_computes_from_the_same_weights(tiny_model: Path) -> None:
    """Rollouts compare the canary with what their engine computes (on a CPU, or another
    GPU): a trainer's device must not move it anywhere near the rejection tolerance."""
    from meridian import canary
    from services.trainer.learner import canary_logprobs

    gpu = _learner(tiny_model, "cuda")
    gpu.step(fixed_groups(tiny_model, 2, group_size=3, seed=7))
    weights = gpu.policy_weights()
    published = gpu.canary(weights)
    cpu = _learner(tiny_model, "cpu")
    verdict = canary.compare(published, canary_logprobs(cpu.module, weights, cpu.canary_ids))
    print(f"canary: gpu vs cpu mean {verdict.mean_diff:.3g}, max {verdict.max_diff:.3g} nats over {verdict.tokens} tokens")
    assert verdict.ok and verdict.max_diff < canary.DEFAULT_MEAN_TOLERANCE / 10, verdict
