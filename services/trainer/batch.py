"""Turns trajectories into padded training tensors, and groups them for GRPO."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch

from meridian.v1 import common_pb2
from services.trainer.loss import group_advantages


@dataclasses.dataclass
class Batch:
    input_ids: torch.Tensor          # [B, T] prompt + completion, right-padded
    attention_mask: torch.Tensor     # [B, T]
    target_mask: torch.Tensor        # [B, T-1] 1 where position t predicts a trained token
    behaviour_logprobs: torch.Tensor  # [B, T-1] aligned with target positions
    advantages: torch.Tensor         # [B, 1]
    rewards: torch.Tensor            # [B]
    token_weights: torch.Tensor      # [B, 1] staleness weight of each sequence (1 within the bound)


class GroupBuffer:
    """Collects trajectories until their GRPO group is complete; drops duplicates."""

    def __init__(self) -> None:
        self._groups: dict[str, dict[str, tuple[str, common_pb2.Trajectory]]] = {}
        self.seen: set[str] = set()
        self._entry_of: dict[str, str] = {}

    def add(self, entry_id: str, traj: common_pb2.Trajectory) -> bool:
        """Adds one trajectory; False when it was already seen (a redelivery)."""
        if traj.trajectory_id in self.seen:
            return False
        self.seen.add(traj.trajectory_id)
        self._entry_of[traj.trajectory_id] = entry_id
        self._groups.setdefault(traj.group_id, {})[traj.trajectory_id] = (entry_id, traj)
        return True

    def holds(self, trajectory_id: str) -> str | None:
        """The entry id under which a trajectory waits in the buffer, or None."""
        return self._entry_of.get(trajectory_id)

    def pop_complete(self, count: int) -> list[list[tuple[str, common_pb2.Trajectory]]]:
        """Exactly ``count`` complete groups, oldest first, removed from the buffer; or none."""
        ready = [gid for gid, members in self._groups.items() if len(members) >= next(iter(members.values()))[1].group_size]
        if len(ready) < count:
            return []
        popped = [list(self._groups.pop(gid).values()) for gid in ready[:count]]
        for group in popped:
            for _, traj in group:
                self._entry_of.pop(traj.trajectory_id, None)
        return popped

    def pending(self) -> int:
        return sum(len(m) for m in self._groups.values())


def build_batch(
    groups: Iterable[list[common_pb2.Trajectory]],
    pad_id: int,
    normalize_std: bool = True,
    weights: Iterable[list[float]] | None = None,
) -> Batch:
    """Pads every trajectory of ``groups`` into one batch with per-sequence advantages.

    ``weights`` (same shape as ``groups``) are per-sequence loss weights, 1 by default.
    """
    groups = list(groups)
    weights = list(weights) if weights is not None else [[1.0] * len(g) for g in groups]
    trajs: list[common_pb2.Trajectory] = []
    advantages: list[torch.Tensor] = []
    flat_weights: list[float] = []
    for group, group_weights in zip(groups, weights, strict=True):
        rewards = torch.tensor([t.reward for t in group], dtype=torch.float32)
        advantages.append(group_advantages(rewards, normalize_std))
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
    )


def policy_lag(traj: common_pb2.Trajectory, trainer_version: int) -> int:
    """Versions between the trainer and the oldest policy that produced a trained token."""
    oldest = min((v for v, m in zip(traj.policy_versions, traj.loss_mask) if m), default=trainer_version)
    return max(0, trainer_version - oldest)


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Log-prob of each next token: [B, T-1] from logits [B, T, V]."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
