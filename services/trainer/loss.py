"""GRPO-family loss: group-relative advantages and a token-level clipped
policy-gradient objective against the behaviour log-probs recorded at sampling time.

Pure functions over tensors; no I/O. Unit tests check them against hand-computed values.
"""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class LossConfig:
    clip_low: float = 0.2
    clip_high: float = 0.28
    normalize_std: bool = True
    eps: float = 1e-6


def group_advantages(rewards: torch.Tensor, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Advantage of each sample relative to its group: (r - mean) [/ (std + eps)].

    ``rewards`` is 1-D, one group. A group whose rewards are all equal carries no
    signal and gets zero advantages.
    """
    centred = rewards - rewards.mean()
    if normalize_std and rewards.numel() > 1:
        centred = centred / (rewards.std(unbiased=False) + eps)
    return centred


def clipped_pg_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: LossConfig = LossConfig(),
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level clipped surrogate, averaged over every unmasked token of the batch.

    All inputs are [B, T] (advantages broadcast per sequence). The ratio is taken
    against the behaviour policy, with asymmetric bounds [1 - clip_low, 1 + clip_high].
    """
    mask = mask.to(logprobs.dtype)
    ratio = torch.exp(logprobs - behaviour_logprobs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - config.clip_low, 1.0 + config.clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    tokens = mask.sum().clamp(min=1.0)
    loss = (per_token * mask).sum() / tokens
    with torch.no_grad():
        clip_frac = (((ratio < 1.0 - config.clip_low) | (ratio > 1.0 + config.clip_high)).to(mask.dtype) * mask).sum() / tokens
        stats = {"ratio_mean": float((ratio * mask).sum() / tokens), "clip_frac": float(clip_frac), "tokens": float(mask.sum())}
    return loss, stats
