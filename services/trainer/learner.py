"""The learner: fp32 master weights, AdamW, one GRPO step per batch of complete groups,
and the bf16 view of the weights that becomes the next policy version."""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from meridian.v1 import common_pb2
from services.trainer.batch import build_batch, token_logprobs
from services.trainer.config import TrainerConfig
from services.trainer.loss import LossConfig, clipped_pg_loss
from services.weightsync.tensors import RawTensor, from_torch, to_torch


@dataclasses.dataclass
class StepResult:
    step: int
    loss: float
    reward_mean: float
    trajectories: int
    groups: int
    grad_norm: float
    seconds: float
    dropped_stale: int
    stats: dict[str, float]


class Learner:
    """Owns the model and optimizer; knows nothing of Redis or gRPC."""

    def __init__(self, model_dir: Path, config: TrainerConfig) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(config.threads)
        torch.manual_seed(config.seed)
        self.config = config
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.train()
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        self.loss_config = LossConfig(clip_low=config.clip_low, clip_high=config.clip_high)
        self.step_count = 0
        self.version = 0

    def policy_weights(self) -> dict[str, RawTensor]:
        """The current policy as bf16, keyed by checkpoint (Hugging Face) names."""
        with torch.no_grad():
            return {name: from_torch(p.detach().to(torch.bfloat16)) for name, p in self.model.named_parameters()}

    def load_policy_weights(self, weights: dict[str, RawTensor], version: int) -> None:
        """Starts from a published version (e.g. after a restart without a checkpoint)."""
        params = dict(self.model.named_parameters())
        missing = set(params) - set(weights)
        if missing:
            raise ValueError(f"published version {version} lacks tensors {sorted(missing)[:3]}")
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(to_torch(weights[name]).to(torch.float32))
        self.version = version

    def split_stale(self, groups: list[list[common_pb2.Trajectory]]) -> tuple[list[list[common_pb2.Trajectory]], int]:
        """Drops samples produced by a policy more than ``max_policy_lag`` versions old."""
        fresh, dropped = [], 0
        floor = self.version - self.config.max_policy_lag
        for group in groups:
            keep = [t for t in group if min((v for v, m in zip(t.policy_versions, t.loss_mask) if m), default=self.version) >= floor]
            dropped += len(group) - len(keep)
            if len(keep) >= 2:
                fresh.append(keep)
            else:
                dropped += len(keep)
        return fresh, dropped

    def step(self, groups: list[list[common_pb2.Trajectory]]) -> StepResult:
        """One optimizer step on complete groups; advances the policy version."""
        start = time.perf_counter()
        fresh, dropped = self.split_stale(groups)
        if not fresh:
            return StepResult(self.step_count, 0.0, 0.0, 0, 0, 0.0, time.perf_counter() - start, dropped, {})
        batch = build_batch(fresh, self.pad_id)
        out = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
        logprobs = token_logprobs(out.logits, batch.input_ids)
        loss, stats = clipped_pg_loss(logprobs, batch.behaviour_logprobs, batch.advantages, batch.target_mask, self.loss_config)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        max_norm = self.config.max_grad_norm if self.config.max_grad_norm > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
        self.optimizer.step()
        self.step_count += 1
        self.version += 1
        return StepResult(
            step=self.step_count,
            loss=float(loss.detach()),
            reward_mean=float(batch.rewards.mean()),
            trajectories=int(batch.rewards.numel()),
            groups=len(fresh),
            grad_norm=grad_norm,
            seconds=time.perf_counter() - start,
            dropped_stale=dropped,
            stats=stats,
        )
