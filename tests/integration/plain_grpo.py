"""An independent GRPO reference: a plain loop over the trainer's documented loss, with
none of the trainer's code (no batching, padding, loss module or learner).

Tests compare the learner's weights with it, so a learner defect (the ratio taken
against the wrong log-probs, a wrong advantage, a lost group) cannot cancel out the way
it would against a reference built from the learner itself. It follows the trainer's
defaults: population-std advantages, the decoupled objective with truncated
importance sampling (``tis_cap``), the token mean over the batch, stale samples
dropped, equal-reward groups skipped, gradient clipping, AdamW at a constant rate.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from meridian.v1 import common_pb2


class PlainGrpo:
    """One trajectory at a time through a Hugging Face model; no padding anywhere."""

    def __init__(self, model_dir: Path, lr: float, max_policy_lag: int, tis_cap: float, max_grad_norm: float = 1.0, seed: int = 0) -> None:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.max_policy_lag = max_policy_lag
        self.tis_cap = tis_cap
        self.max_grad_norm = max_grad_norm
        self.version = 0

    def _kept(self, group: list[common_pb2.Trajectory]) -> list[common_pb2.Trajectory]:
        """The group's fresh members, or nothing when fewer than two remain or their rewards tie."""
        fresh = []
        for t in group:
            trained = [v for v, m in zip(t.policy_versions, t.loss_mask) if m]
            lag = self.version - min(trained) if trained else 0
            if lag <= self.max_policy_lag:
                fresh.append(t)
        if len(fresh) < 2 or len({t.reward for t in fresh}) == 1:
            return []
        return fresh

    def step(self, groups: list[list[common_pb2.Trajectory]]) -> bool:
        """One optimizer step over ``groups``; False (and nothing changes) if none is kept."""
        kept = [k for k in (self._kept(g) for g in groups) if k]
        if not kept:
            return False
        terms: list[torch.Tensor] = []
        tokens = 0
        for group in kept:
            rewards = [t.reward for t in group]
            mean = sum(rewards) / len(rewards)
            std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
            for t, r in zip(group, rewards):
                advantage = (r - mean) / (std + 1e-6)
                ids = torch.tensor([[*t.prompt_token_ids, *t.completion_token_ids]])
                logits = self.model(input_ids=ids).logits[0].float()
                p = len(t.prompt_token_ids)
                # Completion token j is predicted by position p + j - 1.
                logp_all = torch.log_softmax(logits[p - 1 : -1], dim=-1)
                logp = logp_all.gather(1, ids[0, p:].unsqueeze(1)).squeeze(1)
                mask = torch.tensor(list(t.loss_mask), dtype=torch.float32)
                behaviour = torch.tensor(list(t.logprobs), dtype=torch.float32)
                # At the proximal policy the ratio is 1 and the clip does not bind, so the
                # surrogate's gradient is that of -A * w * log pi, w = min(pi / pi_behaviour, cap).
                weight = torch.clamp(torch.exp(logp.detach() - behaviour), max=self.tis_cap)
                terms.append(-(advantage * weight * logp * mask).sum())
                tokens += int(mask.sum())
        loss = torch.stack(terms).sum() / max(tokens, 1)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        self.version += 1
        return True

    def parameters(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in self.model.named_parameters()}


def relative_distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], start: dict[str, torch.Tensor]) -> float:
    """||a - b|| / ||a - start||: how far two trainings from ``start`` disagree, relative
    to how far they moved."""
    diff = math.sqrt(sum(float((a[n] - b[n]).double().pow(2).sum()) for n in a))
    moved = math.sqrt(sum(float((a[n] - start[n]).double().pow(2).sum()) for n in a))
    return diff / moved if moved else math.inf
