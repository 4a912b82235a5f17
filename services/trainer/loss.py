"""GRPO-family loss: group-relative advantages, a token-level clipped
policy-gradient objective against the behaviour log-probs recorded at sampling time,
truncated importance sampling, an optional KL penalty to a reference model, and the
staleness rule (drop or down-weight samples whose policy lags too far).

How the per-token terms become one number (``--loss-aggregation``):

- ``token-mean``: the mean over every trained token of the batch, as in DAPO (Yu et al.
  2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale"): long
  sequences weigh by their length;
- ``seq-mean``: the mean over each sequence's tokens, then over sequences, as in the GRPO
  objective of DeepSeekMath (Shao et al. 2024);
- ``dr-grpo``: the sum over each sequence's tokens divided by a constant token budget,
  then the mean over sequences, with no std scaling of the advantages, as in Dr. GRPO
  (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective"), which
  removes the length and difficulty biases of the other two.

Pure functions over tensors; no I/O. Unit tests check them against hand-computed values.
"""
from __future__ import annotations

import dataclasses

import torch

from services.trainer.config import AGGREGATIONS, STALE_MODES



@dataclasses.dataclass(frozen=True)
class LossConfig:
    clip_low: float = 0.2
    clip_high: float = 0.28
    normalize_std: bool = True
    sample_std: bool = False
    eps: float = 1e-6
    # > 0: decoupled objective. The clipped ratio is taken against the trainer's own
    # log-probs before this update (the proximal policy), and each token is weighted by
    # min(pi_proximal / pi_behaviour, tis_cap): truncated importance sampling that
    # corrects both staleness and the inference/training numeric mismatch without
    # letting one token's weight explode. 0: the coupled objective, ratio against the
    # behaviour log-probs directly (PPO as sampled).
    tis_cap: float = 0.0
    kl_coef: float = 0.0
    aggregation: str = "token-mean"
    token_budget: int = 0

    def __post_init__(self) -> None:
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"loss aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        if self.aggregation == "dr-grpo" and self.token_budget <= 0:
            raise ValueError(f"dr-grpo needs a positive token budget, got {self.token_budget}")

    @property
    def std_scaling(self) -> bool:
        """Whether advantages are divided by the group's std (Dr. GRPO removes it)."""
        return self.normalize_std and self.aggregation != "dr-grpo"


def group_advantages(rewards: torch.Tensor, normalize_std: bool = True, eps: float = 1e-6, sample_std: bool = False) -> torch.Tensor:
    """Advantage of each sample relative to its group: (r - mean) [/ (std + eps)].

    ``rewards`` is 1-D, one group. The std is the population std (divisor n) unless
    ``sample_std`` (divisor n - 1, what ``torch.std`` and TRL use by default). A group
    whose rewards are all equal carries no signal and gets zero advantages.

    The mean and std are taken in float64 and the result cast back to ``rewards``' dtype:
    finite float32 rewards near its maximum (3.4e38) overflow a float32 sum to inf, and
    the advantages, the loss and then every weight would become NaN.
    """
    wide = rewards.to(torch.float64)
    centred = wide - wide.mean()
    if normalize_std and rewards.numel() > 1:
        centred = centred / (wide.std(unbiased=sample_std) + eps)
    return centred.to(rewards.dtype)


def token_scale(mask: torch.Tensor, aggregation: str = "token-mean", token_budget: int = 0) -> torch.Tensor:
    """Per-token factor [B, T] such that the loss is ``sum(per_token * mask * factor)``.

    Computed on the whole batch, so a data-parallel shard that takes its rows of it
    adds up to the whole batch's loss. See the module docstring for the three choices;
    ``token_budget`` is Dr. GRPO's constant (the generation budget of a sequence).
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"loss aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    mask = mask.to(torch.float64)  # exact reciprocals; callers cast to their dtype
    lengths = mask.sum(dim=1, keepdim=True)
    sequences = float((lengths > 0).sum().clamp(min=1.0))
    if aggregation == "token-mean":
        return torch.full_like(mask, 1.0 / max(float(mask.sum()), 1.0))
    if aggregation == "seq-mean":
        return (1.0 / (lengths.clamp(min=1.0) * sequences)).expand_as(mask)
    if token_budget <= 0:
        raise ValueError(f"dr-grpo needs a positive token budget, got {token_budget}")
    return torch.full_like(mask, 1.0 / (token_budget * sequences))


def has_reward_signal(rewards: list[float]) -> bool:
    """False when every reward of the group is the same (its advantages are all zero)."""
    return len(rewards) > 1 and max(rewards) != min(rewards)


def staleness_weight(lag: int, max_policy_lag: int, mode: str, stale_weight: float) -> float:
    """Weight of a sample whose oldest trained token lags the trainer by ``lag`` versions.

    Within the bound: 1. Beyond it: 0 (``drop``) or ``stale_weight`` (``downweight``).
    """
    if mode not in STALE_MODES:
        raise ValueError(f"stale mode must be one of {STALE_MODES}, got {mode!r}")
    if lag <= max_policy_lag:
        return 1.0
    return 0.0 if mode == "drop" else stale_weight


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate exp(d) - d - 1 with d = ref - logp (non-negative, unbiased)."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1.0


def clipped_pg_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: LossConfig = LossConfig(),
    token_weights: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level clipped surrogate, aggregated by ``scale`` (see :func:`token_scale`;
    default: the mean over every unmasked token of these rows).

    All inputs are [B, T] (advantages and ``token_weights`` broadcast per sequence).
    The clip bounds are asymmetric: [1 - clip_low, 1 + clip_high]. A data-parallel
    shard passes its rows of the whole batch's ``scale`` so the shards' gradients add
    up to the full batch's.
    """
    mask = mask.to(logprobs.dtype)
    if config.tis_cap > 0:
        proximal = logprobs.detach()
        ratio = torch.exp(logprobs - proximal)
        raw_is = torch.exp(proximal - behaviour_logprobs)
        is_weight = torch.clamp(raw_is, max=config.tis_cap)
    else:
        ratio = torch.exp(logprobs - behaviour_logprobs)
        raw_is = is_weight = torch.ones_like(ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - config.clip_low, 1.0 + config.clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped) * is_weight
    if token_weights is not None:
        per_token = per_token * token_weights
    kl = None
    if config.kl_coef > 0 and ref_logprobs is not None:
        kl = kl_k3(logprobs, ref_logprobs)
        per_token = per_token + config.kl_coef * kl
    if scale is None:
        scale = token_scale(mask)
    loss = (per_token * mask * scale.to(logprobs.dtype)).sum()
    with torch.no_grad():
        local = mask.sum().clamp(min=1.0)
        out_of_bounds = (ratio < 1.0 - config.clip_low) | (ratio > 1.0 + config.clip_high)
        stats = {
            "ratio_mean": float((ratio * mask).sum() / local),
            "clip_frac": float((out_of_bounds.to(mask.dtype) * mask).sum() / local),
            "tokens": float(mask.sum()),
            "is_weight_mean": float((is_weight * mask).sum() / local),
            "is_truncated_frac": float(((raw_is > config.tis_cap).to(mask.dtype) * mask).sum() / local) if config.tis_cap > 0 else 0.0,
            "kl": float((kl * mask).sum() / local) if kl is not None else 0.0,
        }
    return loss, stats
