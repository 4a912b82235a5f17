"""Shared-prefix packing against the padded batch on a real (tiny) model: the same
per-token log-probs and the same gradients, for a group sharing its prompt and for
rows of two groups, whose common prefix is shorter."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.support.synthetic import fixed_groups
from services.trainer.batch import build_batch, token_logprobs
from services.trainer.packing import pack, packed_logprobs

pytestmark = pytest.mark.engine


def _gradients(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("groups", [1, 2])
def test_packed_logprobs_and_gradients_equal_the_padded_batch(tiny_model: Path, groups: int, attention: str) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation=attention)
    batch = build_batch(fixed_groups(tiny_model, groups, group_size=3, seed=groups), pad_id=0)
    weights = torch.randn_like(batch.target_mask) * batch.target_mask  # any loss over the trained tokens

    padded = token_logprobs(model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits, batch.input_ids)
    (padded * weights).sum().backward()
    padded_grad = _gradients(model)
    model.zero_grad()

    layout = pack(batch.input_ids, batch.attention_mask, batch.target_mask)
    assert layout.input_ids.shape[1] < int(batch.attention_mask.sum()), "the rows' common prefix should be shared"
    packed = packed_logprobs(model, layout, batch.behaviour_logprobs, attention)
    (packed * weights).sum().backward()
    packed_grad = _gradients(model)

    trained = batch.target_mask > 0
    assert torch.allclose(packed[trained], padded[trained], atol=1e-4), (packed[trained] - padded[trained]).abs().max()
    # Untrained positions hold the behaviour log-probs (ratio 1 there, masked anyway).
    assert torch.equal(packed[~trained], batch.behaviour_logprobs[~trained])
    assert float((packed_grad - padded_grad).norm() / padded_grad.norm()) < 1e-4


def test_a_micro_batch_with_nothing_trained_still_runs_backward(tiny_model: Path) -> None:
    # Data-parallel ranks wait for every parameter's gradient, even from a shard
    # whose tokens are all masked.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    batch = build_batch(fixed_groups(tiny_model, 1, group_size=2), pad_id=0)
    nothing = torch.zeros_like(batch.target_mask)
    packed = packed_logprobs(model, pack(batch.input_ids, batch.attention_mask, nothing), batch.behaviour_logprobs)
    assert torch.equal(packed.detach(), batch.behaviour_logprobs)
    packed.sum().backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads) and all(float(g.abs().max()) == 0.0 for g in grads)
