"""Turns trajectories into padded training tensors, and groups them for GRPO."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch

from meridian.v1 import common_pb2
from services.trainer.loss import LossConfig, group_advantages, token_scale


@dataclasses.dataclass
class Batch:
    input_ids: torch.Tensor          # [B, T] prompt + completion, right-padded
    attention_mask: torch.Tensor     # [B, T]
    target_mask: torch.Tensor        # [B, T-1] 1 where position t predicts a trained token
    behaviour_logprobs: torch.Tensor  # [B, T-1] aligned with target positions
    advantages: torch.Tensor         # [B, 1]
    rewards: torch.Tensor            # [B]
    token_weights: torch.Tensor      # [B, 1] staleness weight of each sequence (1 within the bound)
    token_scale: torch.Tensor        # [B, T-1] each token's factor in the aggregated loss (whole batch)


def build_batch(
    groups: Iterable[list[common_pb2.Trajectory]],
    pad_id: int,
    loss: LossConfig | None = None,
    weights: Iterable[list[float]] | None = None,
) -> Batch:
    """Pads every trajectory of ``groups`` into one batch with per-sequence advantages
    and the loss aggregation's per-token factors (both as ``loss`` says).

    ``weights`` (same shape as ``groups``) are per-sequence loss weights, 1 by default.
    """
    loss = loss or LossConfig()
    groups = list(groups)
    weights = list(weights) if weights is not None else [[1.0] * len(g) for g in groups]
    trajs: list[common_pb2.Trajectory] = []
    advantages: list[torch.Tensor] = []
    flat_weights: list[float] = []
    for group, group_weights in zip(groups, weights, strict=True):
        rewards = torch.tensor([t.reward for t in group], dtype=torch.float32)
        advantages.append(group_advantages(rewards, loss.std_scaling, loss.eps, loss.sample_std))
        trajs.extend(group)
        flat_weights.extend(group_weights)
    length = max(len(t.prompt_token_ids) + len(t.completion_token_ids) for t in trajs)
    b = len(trajs)
    input_ids = torch.full((b, length), pad_id, dtype=torch.long)
    attention = torch.zeros((b, length), dtype=torch.long)
    target_mask = torch.zeros((b, length - 1), dtype=torch.float32)
    behaviour = torch.zeros((b, length - 1), dtype=torch.float32)
    for i, t in enumerate(trajs):
        p, c = len(t.prompt_token_ids), len(t.completion_token_ids)
        input_ids[i, : p + c] = torch.tensor([*t.prompt_token_ids, *t.completion_token_ids], dtype=torch.long)
        attention[i, : p + c] = 1
        # Completion token j sits at position p + j and is predicted from position p + j - 1.
        target_mask[i, p - 1 : p - 1 + c] = torch.tensor(list(t.loss_mask), dtype=torch.float32)
        behaviour[i, p - 1 : p - 1 + c] = torch.tensor(list(t.logprobs), dtype=torch.float32)
    return Batch(
        input_ids=input_ids,
        attention_mask=attention,
        target_mask=target_mask,
        behaviour_logprobs=behaviour,
        advantages=torch.cat(advantages).unsqueeze(1),
        rewards=torch.tensor([t.reward for t in trajs], dtype=torch.float32),
        token_weights=torch.tensor(flat_weights, dtype=torch.float32).unsqueeze(1),
        token_scale=token_scale(target_mask, loss.aggregation, loss.token_budget),
    )


def policy_lag(traj: common_pb2.Trajectory, trainer_version: int) -> int:
    """Versions between the trainer and the oldest policy that produced a trained token."""
    oldest = min((v for v, m in zip(traj.policy_versions, traj.loss_mask) if m), default=trainer_version)
    return max(0, trainer_version - oldest)


#: Positions per chunk of the log-prob computation: 512 x 49,152 fp32 logits is 96 MiB.
LOGPROB_CHUNK = 512


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, chunk: int = LOGPROB_CHUNK) -> torch.Tensor:
    """Log-prob of each next token: [B, T-1] from logits [B, T, V].

    ``logit[target] - logsumexp(logits)`` over ``chunk`` positions at a time: the
    full-vocabulary log-softmax of the batch (4 x B x T x V bytes, kept for the backward
    pass) is never built, nor, under bf16 autocast, an fp32 copy of all the logits.
    """
    rows = []
    positions = logits.shape[1] - 1  # the last position predicts nothing
    for b in range(logits.shape[0]):
        parts = []
        for start in range(0, positions, chunk):
            stop = min(start + chunk, positions)
            piece = logits[b, start:stop].float()
            targets = input_ids[b, start + 1 : stop + 1]
            parts.append(piece.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(piece, dim=-1))
        rows.append(torch.cat(parts) if parts else logits.new_zeros(0, dtype=torch.float32))
    return torch.stack(rows)
