"""The learner: fp32 master weights, AdamW with a warm-up schedule, one GRPO step per
batch of complete groups, the bf16 view of the weights that becomes the next policy
version, and the full training state for checkpoints.

Under ``torch.distributed`` (see ``services.trainer.distributed``) every rank holds the
same batch, takes its shard of the trajectories, and the gradients are averaged over
the ranks, either replicated (every rank a full replica; the gradients are all-reduced
after the backward pass) or by FSDP2 (``fully_shard``: each rank keeps a shard of the
parameters, gradients and optimiser state, and gathers one decoder layer at a time). The
loss of each shard is normalised by the whole batch's token count, so the result equals
the single-process step up to floating-point summation order.

A step that fails on one rank fails on all of them alike (:class:`StepFailed`): the ranks
agree on whether each phase of the step succeeded everywhere before any of them enters
the next phase's collectives (see :meth:`Learner.step`), so none is left waiting in a
collective the others never join, and none updates its weights when another did not.
Where that cannot hold (a rank failed inside a collective the others were in, an update
that failed on some ranks only) every rank raises :class:`GroupFailed` instead, within
``collective_timeout_s`` (see :meth:`Learner.agreed`).
"""
from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import datetime
import hashlib
import logging
import math
import os
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import numpy as np
import torch

from meridian import canary
from meridian.v1 import common_pb2
from meridian.v1 import weightsync_pb2
from services.trainer.batch import Batch, build_batch, policy_lag, token_logprobs
from services.trainer.config import TrainerConfig, cpu_set
from services.trainer.learner_protocol import PASS_REWARD, GroupFailed, LearnerBroken, RankFailed, StepFailed, StepResult
from services.trainer.loss import LossConfig, clipped_pg_loss, has_reward_signal, staleness_weight
from services.trainer.packing import PackedLayout, pack, packed_logprobs, plan_packs
from meridian.tensors import RawTensor, from_torch, to_torch

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Bytes of gradients a replicated learner all-reduces in one call (DistributedDataParallel's default bucket).
GRADIENT_BUCKET_BYTES = 25 * 2**20


@dataclasses.dataclass(frozen=True)
class ModelLimits:
    """What a model can take in: token ids in ``[0, vocab_size)`` (the rows of its
    embedding and of its output head) and sequences of at most ``max_positions`` tokens
    (None: no stated limit). A trajectory outside them crashes the forward pass (an
    embedding index error) or trains on positions the model never learnt."""

    vocab_size: int
    max_positions: int | None

    @classmethod
    def of(cls, module: torch.nn.Module) -> ModelLimits:
        """The limits of a Hugging Face causal LM, read from its layers and its config."""
        sizes = [module.get_input_embeddings().num_embeddings]  # type: ignore[operator]
        head = module.get_output_embeddings()  # type: ignore[operator]
        if head is not None and hasattr(head, "out_features"):
            sizes.append(head.out_features)  # a target id is also a row of the head's output
        config = module.config
        positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        return cls(vocab_size=min(sizes), max_positions=int(positions) if positions else None)

    def problem(self, trajectories: Sequence[common_pb2.Trajectory]) -> str:
        """Why the model cannot train on these trajectories, or '' when it can."""
        for traj in trajectories:
            for field in ("prompt_token_ids", "completion_token_ids"):
                ids = getattr(traj, field)
                if not ids:
                    continue
                low, high = min(ids), max(ids)
                if low < 0 or high >= self.vocab_size:
                    bad = low if low < 0 else high
                    return (
                        f"trajectory {traj.trajectory_id}: token id {bad} in {field} is outside the model's "
                        f"vocabulary of {self.vocab_size} ids (0..{self.vocab_size - 1})"
                    )
            length = len(traj.prompt_token_ids) + len(traj.completion_token_ids)
            if self.max_positions is not None and length > self.max_positions:
                return (
                    f"trajectory {traj.trajectory_id}: {length} tokens ({len(traj.prompt_token_ids)} prompt + "
                    f"{len(traj.completion_token_ids)} completion) exceed the model's {self.max_positions} positions"
                )
        return ""


@dataclasses.dataclass
class Prepared:
    """The groups that will be trained on, their sequence weights, and what was filtered."""

    groups: list[list[common_pb2.Trajectory]]
    weights: list[list[float]]
    dropped_stale: int = 0
    downweighted_stale: int = 0
    dropped_groups: int = 0
    lags: list[int] = dataclasses.field(default_factory=list)


def prepare_groups(groups: list[list[common_pb2.Trajectory]], version: int, config: TrainerConfig) -> Prepared:
    """Applies the staleness bound and the equal-reward rule to complete groups.

    Stale samples are dropped (the group's advantages then come from the rest; a group
    left with fewer than two samples is dropped) or kept with ``stale_weight``.
    """
    out = Prepared([], [])
    for group in groups:
        lags = [policy_lag(t, version) for t in group]
        out.lags.extend(lags)
        weights = [staleness_weight(lag, config.max_policy_lag, config.stale_mode, config.stale_weight) for lag in lags]
        if config.stale_mode == "drop":
            keep = [(t, w) for t, w in zip(group, weights) if w > 0]
            out.dropped_stale += len(group) - len(keep)
            if len(keep) < 2:
                out.dropped_stale += len(keep)
                continue
        else:
            keep = list(zip(group, weights))
            out.downweighted_stale += sum(1 for w in weights if w < 1)
        trajs = [t for t, _ in keep]
        if config.drop_equal_reward_groups and not has_reward_signal([t.reward for t in trajs]):
            out.dropped_groups += 1
            continue
        out.groups.append(trajs)
        out.weights.append([w for _, w in keep])
    return out


def _shard(batch: Batch, rank: int, world: int) -> Batch:
    """Rows ``rank::world`` of the batch (a rank with no rows keeps row 0 at weight 0,
    so it still runs the forward and backward passes whose collectives FSDP's other ranks wait in)."""
    rows = torch.arange(rank, batch.input_ids.shape[0], world)
    empty = rows.numel() == 0
    if empty:
        rows = torch.zeros(1, dtype=torch.long)
    shard = Batch(**{f.name: getattr(batch, f.name)[rows] for f in dataclasses.fields(Batch)})
    if empty:
        shard.token_weights = torch.zeros_like(shard.token_weights)
    return shard


def canary_logprobs(module: torch.nn.Module, weights: dict[str, RawTensor] | None, sequences: list[list[int]]) -> list[list[float]]:
    """Per-token log-probs of ``sequences`` (first token 0) from ``module``'s forward pass
    with its parameters replaced by ``weights`` (checkpoint names, any dtype; None: the
    module's own parameters): the numbers a correct engine serving exactly these weights
    reproduces."""
    device = next(module.parameters()).device
    params = {name: to_torch(t).to(device) for name, t in (weights or {}).items()}
    out = []
    with torch.no_grad():
        for ids in sequences:
            x = torch.tensor([ids], device=device)
            logits = torch.func.functional_call(module, params, (x,)).logits[0, :-1].float()
            picked = torch.log_softmax(logits, dim=-1).gather(-1, x[0, 1:].unsqueeze(-1)).squeeze(-1)
            out.append([0.0, *picked.cpu().tolist()])
    return out


def pin_process(cpus: set[int]) -> None:
    """Runs every thread of this process, and every thread it starts later, on ``cpus``."""
    available = os.sched_getaffinity(0)
    if not cpus <= available:
        raise ValueError(f"cpus {sorted(cpus)} are not all available to this process (it may use {sorted(available)})")
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            os.sched_setaffinity(int(task), cpus)


def _decoder_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks FSDP shards one unit each (Hugging Face causal LMs keep them at ``model.layers``)."""
    layers = getattr(getattr(module, "model", None), "layers", None)
    return list(layers) if layers is not None else []


def _whole(t: torch.Tensor) -> torch.Tensor:
    """``t`` as one whole tensor: FSDP's parameters and norms are DTensors, gathered
    here (a collective: every rank must call it in the same order)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _buckets(tensors: list[torch.Tensor], limit: int) -> Iterator[list[torch.Tensor]]:
    """``tensors`` in order, in runs of one dtype (so each flattens into one tensor) of at
    least ``limit`` bytes, but where the dtype changes and for the last run."""
    bucket: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        if bucket and t.dtype != bucket[0].dtype:
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += t.numel() * t.element_size()
        if size >= limit:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def _describe(error: BaseException | None) -> str:
    """``Type: message`` of ``error``, for the agreement's messages."""
    return "no error" if error is None else f"{type(error).__name__}: {error}"


def _collectives_issued() -> int:
    """How many collectives this rank has issued on the training (default) process group,
    or -1 where the backend does not count them. Ranks that issued different numbers are
    out of step: the group's next collectives would pair up the wrong operations."""
    try:
        group = torch.distributed.distributed_c10d._get_default_group()
        return int(group._get_sequence_number_for_group())
    except (AttributeError, RuntimeError):
        return -1


def resolve_device(setting: str, local_rank: int = 0) -> str:
    """The torch device a ``device`` setting names on this machine: ``auto`` is the GPU
    of ``local_rank`` where torch sees one, else the CPU; ``cuda`` where torch sees no
    GPU is an error that says so (a silent fall-back would train a GPU job on the CPU)."""
    cuda = torch.cuda.is_available()
    if setting == "cuda" and not cuda:
        raise ValueError(f"device 'cuda': torch {torch.__version__} sees no CUDA device here (a CPU build of torch, or no GPU visible to this process)")
    return f"cuda:{local_rank}" if cuda and setting != "cpu" else "cpu"


class Learner:
    """Owns the model and optimizer; knows nothing of Redis or gRPC.

    ``sharded`` learners (FSDP) gather in :meth:`policy_weights`, :meth:`master_weights`,
    :meth:`master_hash` and :meth:`state`, so every rank calls those together."""

    def __init__(self, model_dir: Path, config: TrainerConfig, device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if config.cpus:
            pin_process(cpu_set(config.cpus))
        torch.set_num_threads(config.threads)
        torch.manual_seed(config.seed)
        random.seed(config.seed)
        np.random.seed(config.seed)
        self.config = config
        self.device = torch.device(device)
        self.module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=config.attention).to(self.device)
        self.module.train()
        self.reference = None
        if config.kl_coef > 0:
            # A frozen copy of the starting weights; only built when the KL term is on.
            self.reference = copy.deepcopy(self.module).eval().requires_grad_(False)
        self.model_dir = model_dir
        self.limits = ModelLimits.of(self.module)
        self.rank, self.world = 0, 1
        self.sharded = False
        self._twin: torch.nn.Module | None = None  # the sharded canary's bf16 twin (see shard_canary)
        self._device_mesh: Any = None  # FSDP's mesh of the ranks (see _mesh)
        self._control: Any = None  # the agreement's own process group (see agreed)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            self.rank, self.world = torch.distributed.get_rank(), torch.distributed.get_world_size()
            if self.world > 1:
                # The agreements run in a group of their own (gloo, CPU tensors), so they
                # still work when a failure has left the training group unusable. Its
                # timeout is twice the collectives': a rank stuck in a collective reaches the
                # agreement once that collective timed out, and the others wait for it there.
                timeout = datetime.timedelta(seconds=2 * config.collective_timeout_s)
                self._control = torch.distributed.new_group(backend="gloo", timeout=timeout)
            self._distribute(config.data_parallel)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
        self.canary_ids = canary.canary_token_ids(lambda text: tokenizer(text)["input_ids"])
        # The fused kernel makes one pass over each tensor (2-3x faster than the per-op
        # loop on a CPU); the same update up to rounding.
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=config.lr, weight_decay=config.weight_decay, fused=True)
        warmup = config.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup > 0 else 1.0)
        self.loss_config = LossConfig(
            clip_low=config.clip_low,
            clip_high=config.clip_high,
            normalize_std=config.normalize_std,
            sample_std=config.sample_std,
            tis_cap=config.tis_cap,
            kl_coef=config.kl_coef,
            aggregation=config.loss_aggregation,
            token_budget=config.token_budget,
        )
        self.step_count = 0
        self.version = 0

    def _distribute(self, how: str) -> None:
        if how == "fsdp":
            from torch.distributed.fsdp import fully_shard

            # One FSDP unit per decoder layer, then the rest (embeddings, the tied head,
            # the final norm): a rank holds whole parameters for one layer at a time.
            mesh = self._mesh()
            for layer in _decoder_layers(self.module):
                fully_shard(layer, mesh=mesh)
            fully_shard(self.module, mesh=mesh)
            self.sharded = True
            return
        # Replicated: every rank starts from rank 0's weights (as DistributedDataParallel
        # would) and sums the gradients itself after the backward pass (_reduce_gradients),
        # not in it as DDP does: a rank whose forward or backward pass fails then leaves no
        # other rank waiting in a gradient reduction (see step).
        for t in [*self.module.parameters(), *self.module.buffers()]:
            torch.distributed.broadcast(t.data, src=0)

    # ------------------------------------------------------------ weights

    def policy_weights(self) -> dict[str, RawTensor]:
        """The current policy as bf16, keyed by checkpoint (Hugging Face) names."""
        with torch.no_grad():
            # Cast before gathering: half the bytes on the wire under FSDP.
            return {name: from_torch(_whole(p.detach().to(torch.bfloat16))) for name, p in self.module.named_parameters()}

    def _whole_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, whole fp32 tensor on the CPU) per parameter, one gathered at a time;
        unsharded CPU tensors are the live parameters themselves, not copies."""
        for name, p in self.module.named_parameters():
            yield name, _whole(p.detach()).cpu()

    def master_weights(self) -> dict[str, torch.Tensor]:
        """A copy of the fp32 master weights by checkpoint name, whole and on the CPU."""
        with torch.no_grad():
            return {name: t.clone() for name, t in self._whole_parameters()}

    def canary(self, weights: dict[str, RawTensor]) -> weightsync_pb2.Canary:
        """The canary for a version: log-probs of the fixed sequences from a forward pass
        on exactly ``weights`` (the bf16 tensors being published, not the fp32 masters).
        A learner sharded over several ranks computes the canary of its own weights with
        :meth:`shard_canary` instead (running given whole weights would need them on
        every rank, or the whole model on one)."""
        if not self.sharded:
            return canary.build(self.canary_ids, canary_logprobs(self.module, weights, self.canary_ids))
        if self.world > 1:
            raise RuntimeError("a learner sharded over several ranks computes the canary of its own weights with shard_canary(), a collective every rank joins")
        # One rank: its shard of each tensor is the whole tensor.
        return self._twin_canary({name: to_torch(t) for name, t in weights.items()})

    def shard_canary(self) -> weightsync_pb2.Canary:
        """The canary of the current policy (the bf16 view of the masters, as
        :meth:`policy_weights` publishes it) without any rank holding the whole model: the
        forward pass runs through a bf16 twin sharded like the model, whose FSDP units
        gather one decoder layer at a time. A collective every rank joins; each rank gets
        the same canary. The log-probs are bit for bit those :meth:`canary` gives on one
        process with the same bf16 weights: the same kernels see the same tensors (the
        twin's parameters are bf16 like the published ones; its buffers, e.g. the rotary
        frequencies, are the model's own)."""
        from torch.distributed.tensor import DTensor

        # Local shard to local shard: the twin is laid out like the model over the same ranks.
        return self._twin_canary({name: p.to_local() if isinstance(p, DTensor) else p for name, p in self.module.named_parameters()})

    def _twin_canary(self, local: dict[str, torch.Tensor]) -> weightsync_pb2.Canary:
        """The canary of the twin holding ``local`` (this rank's shard of each parameter,
        any float dtype: rounded to bf16 as policy_weights rounds). A collective."""
        twin = self._bf16_twin()
        with torch.no_grad():
            for name, q in twin.named_parameters():
                q.to_local().copy_(local[name])  # type: ignore[attr-defined]
        try:
            return canary.build(self.canary_ids, canary_logprobs(twin, None, self.canary_ids))
        finally:
            # FSDP keeps the root unit's parameters gathered after a forward (a backward
            # would follow): shard them again, so no rank keeps more than its part.
            for unit in twin.modules():
                if hasattr(unit, "reshard"):
                    unit.reshard()

    def _mesh(self) -> Any:
        """The ranks as one FSDP mesh on the learner's device. FSDP2's own default is the
        machine's accelerator, whatever the learner was told: CPU ranks (gloo) on a
        machine with a GPU would shard onto CUDA devices (rank 1 of two on one GPU fails
        with an invalid device ordinal)."""
        from torch.distributed.device_mesh import init_device_mesh

        if self._device_mesh is None:
            self._device_mesh = init_device_mesh(self.device.type, (self.world,))
        return self._device_mesh

    def _bf16_twin(self) -> torch.nn.Module:
        """A bf16 copy of the model's architecture sharded like it (built once, on every
        rank, without materialising the whole model: on the meta device, then only each
        rank's shards get memory)."""
        if self._twin is not None:
            return self._twin
        from torch.distributed.fsdp import fully_shard
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            twin = AutoModelForCausalLM.from_config(self.module.config, dtype=torch.float32, attn_implementation=self.config.attention)
        for p in twin.parameters():
            p.data = p.data.to(torch.bfloat16)
        for layer in _decoder_layers(twin):
            fully_shard(layer, mesh=self._mesh())
        fully_shard(twin, mesh=self._mesh())
        twin.to_empty(device=self.device)
        # The buffers (rotary frequencies) as the model holds them: to_empty left them unset.
        ours = dict(self.module.named_buffers())
        for name, buf in twin.named_buffers():
            buf.copy_(ours[name])
        self._twin = twin.eval()
        return self._twin

    def load_policy_weights(self, weights: dict[str, RawTensor], version: int) -> None:
        """Starts from a published version (e.g. after a restart without a checkpoint)."""
        params = dict(self.module.named_parameters())
        missing = set(params) - set(weights)
        if missing:
            raise ValueError(f"published version {version} lacks tensors {sorted(missing)[:3]}")
        with torch.no_grad():
            for name, p in params.items():
                whole = to_torch(weights[name]).to(device=self.device, dtype=torch.float32)
                p.copy_(self._like(p, whole))
        self.version = version

    @staticmethod
    def _like(p: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
        """``whole`` laid out like parameter ``p`` (this rank's shard under FSDP)."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        if isinstance(p, DTensor):
            return distribute_tensor(whole, p.device_mesh, p.placements)
        return whole

    def local_elements(self) -> int:
        """Parameter elements this rank holds (the whole model unless sharded)."""
        from torch.distributed.tensor import DTensor

        return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in self.module.parameters())

    def master_hash(self) -> str:
        """sha256 over the fp32 master weights (name, shape, bytes), in name order."""
        h = hashlib.sha256()
        for name, p in sorted(self._whole_parameters(), key=lambda item: item[0]):
            h.update(f"{name}\0{tuple(p.shape)}\0".encode())
            h.update(p.contiguous().numpy().tobytes())
        return h.hexdigest()

    # ------------------------------------------------------------ training state

    def _model_and_optimizer_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        if not self.sharded:
            return {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()}, self.optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        # Whole tensors, keyed by parameter name, on rank 0 only (the others get empty dicts).
        return get_state_dict(self.module, self.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def state(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue bit for bit (under FSDP whole
        tensors on rank 0, and the optimiser state keyed by parameter name). The
        optimiser's tensors are the live ones: copy the state before the next step."""
        model, optimizer = self._model_and_optimizer_state()
        return {
            "model": model,
            "optimizer": optimizer,
            "scheduler": self.scheduler.state_dict(),
            "rng": {
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
                "python": random.getstate(),
                "numpy": np.random.get_state(),
            },
            "step": self.step_count,
            "version": self.version,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state` (every rank passes the same whole state)."""
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

            set_state_dict(
                self.module, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                options=StateDictOptions(full_state_dict=True),
            )
        else:
            self.module.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        rng = state["rng"]
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        self.step_count = int(state["step"])
        self.version = int(state["version"])

    # ------------------------------------------------------------ the step

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if not self.config.autocast_bf16:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    def _micro_batches(self, shard: Batch) -> list[Batch]:
        """``micro_batch`` rows at a time (packed: also at most ``pack_max_tokens``
        positions), each cut to its own longest sequence (rows are right-padded to the
        whole batch's)."""
        rows = shard.input_ids.shape[0]
        size = self.config.micro_batch or rows
        if self.config.pack_prefix:
            ranges = plan_packs(shard.input_ids, shard.attention_mask.sum(dim=1), size, self.config.pack_max_tokens)
        else:
            ranges = [(start, min(start + size, rows)) for start in range(0, rows, size)]
        parts = []
        for start, stop in ranges:
            part = Batch(**{f.name: getattr(shard, f.name)[start:stop].to(self.device) for f in dataclasses.fields(Batch)})
            length = max(2, int(part.attention_mask.sum(dim=1).max()))
            parts.append(
                dataclasses.replace(
                    part,
                    input_ids=part.input_ids[:, :length],
                    attention_mask=part.attention_mask[:, :length],
                    target_mask=part.target_mask[:, : length - 1],
                    behaviour_logprobs=part.behaviour_logprobs[:, : length - 1],
                    token_scale=part.token_scale[:, : length - 1],
                )
            )
        return parts

    def _logprobs(self, model: torch.nn.Module, part: Batch, layout: PackedLayout | None) -> torch.Tensor:
        """Per-token log-probs [B, T-1] of ``part`` under ``model``: packed with the
        rows' common prefix computed once (see services.trainer.packing), or padded."""
        with self._autocast():
            if layout is not None:
                return packed_logprobs(model, layout, part.behaviour_logprobs, self.config.attention)
            return token_logprobs(model(input_ids=part.input_ids, attention_mask=part.attention_mask).logits, part.input_ids)

    def _loss(self, part: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        layout = pack(part.input_ids, part.attention_mask, part.target_mask) if self.config.pack_prefix else None
        logprobs = self._logprobs(self.module, part, layout)
        ref = None
        if self.reference is not None:
            with torch.no_grad():
                ref = self._logprobs(self.reference, part, layout)
        return clipped_pg_loss(
            logprobs, part.behaviour_logprobs, part.advantages, part.target_mask, self.loss_config, part.token_weights, ref, part.token_scale
        )

    def backward(self, batch: Batch) -> tuple[float, dict[str, float]]:
        """Forward and backward passes over this rank's shard of ``batch``, ``micro_batch``
        sequences at a time: every loss is normalised by the whole batch, so the gradients
        accumulate to the whole batch's (the activations of one micro-batch are the
        trainer's peak memory). Returns this rank's part of the loss and its stats
        (token-weighted over the micro-batches)."""
        shard = _shard(batch, self.rank, self.world) if self.world > 1 else batch
        parts = self._micro_batches(shard)
        loss_sum, tokens = 0.0, 0.0
        weighted: collections.Counter[str] = collections.Counter()
        for i, part in enumerate(parts):
            self._gradient_sync(i == len(parts) - 1)
            loss, stats = self._loss(part)
            # Ranks average their gradients; scale so they add up to the full batch's.
            (loss * self.world).backward()
            loss_sum += float(loss.detach())
            tokens += stats["tokens"]
            for key, value in stats.items():
                weighted[key] += value * stats["tokens"]
        merged = {key: value / max(tokens, 1.0) for key, value in weighted.items()}
        merged["tokens"] = tokens
        return loss_sum, merged

    def _gradient_sync(self, last: bool) -> None:
        """FSDP reduces the gradients over the ranks once, in the last micro-batch's
        backward (replicated ranks reduce theirs after the backward passes: _reduce_gradients)."""
        if self.sharded:
            self.module.set_requires_gradient_sync(last)  # type: ignore[operator]

    def _reduce_gradients(self) -> None:
        """Averages the replicas' gradients over the ranks, a bucket at a time (as
        DistributedDataParallel does: each divided by the ranks, then summed). A parameter
        without a gradient on this rank counts as a zero one, so every rank reduces the
        same tensors in the same order."""
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        grads = []
        for p in self.module.parameters():
            if p.requires_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
        for bucket in _buckets(grads, GRADIENT_BUCKET_BYTES):
            flat = _flatten_dense_tensors(bucket).div_(self.world)
            torch.distributed.all_reduce(flat)
            for grad, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                grad.copy_(reduced)

    def _reduce(self, local_loss: float) -> tuple[float, float]:
        """The gradients summed over the ranks (replicated) and clipped; returns the gradient
        norm and the whole batch's loss, both the same on every rank. Collectives only:
        the weights are untouched."""
        if self.world > 1 and not self.sharded:
            self._reduce_gradients()
        grad_norm = self._clip_gradients()
        # The whole batch's loss, summed over the ranks before the update: nothing but the
        # optimizer step comes after, and every rank takes the same decision on it (the
        # gradient norm is already the whole model's).
        reported = torch.tensor(local_loss, dtype=torch.float64, device=self.device)  # this shard's part of the whole batch's loss
        if self.world > 1:
            torch.distributed.all_reduce(reported)
        return grad_norm, float(reported)

    def _agreed(self, work: Callable[[], T], phase: str, fatal: bool = False) -> T:
        """A phase of the step (see :meth:`agreed`): :class:`StepFailed` when it failed."""
        return self.agreed(work, "the step", phase, fatal=fatal, failed=StepFailed)

    def agreed(self, work: Callable[[], T], action: str, phase: str = "", *, fatal: bool = False, failed: type[RankFailed] = RankFailed) -> T:
        """``work()`` on this rank; with several ranks, then an agreement on whether it
        succeeded on every one. Every rank calls this at the same point of rank 0's command
        sequence with its own share of ``action`` (``phase``: where in it, for the message).

        - Succeeded everywhere: ``work``'s result.
        - Failed on some rank, the learners unchanged and the process group still in step:
          every rank raises ``failed`` (a :class:`RankFailed`) naming each failed rank's
          error; ``work`` must then not have changed the learner's state.
        - Failed where that cannot hold: every rank raises :class:`GroupFailed`. That is
          a ``fatal`` action (one that changes the learner: a failure on some ranks leaves
          the learners different), or ranks that stopped at different collectives of the
          training group (one failed inside a collective, or before one, the others were
          in: they waited there until ``collective_timeout_s``, and the group's streams
          are out of step for good), or a training group that no longer answers (a
          collective timed out on it), or a rank that never came to the agreement.

        One process: ``work``'s own exception, or for a ``fatal`` action
        :class:`LearnerBroken` (it may have changed part of the learner)."""
        if self.world == 1:
            return work() if not fatal else self._unbroken(work, f"{action} failed{' ' + phase if phase else ''}")
        result: T | None = None
        error: Exception | None = None
        try:
            result = work()
        except Exception as exc:  # any failure of this rank's share: the others must hear of it
            error = exc
        what = f"{action} failed{' ' + phase if phase else ''}"
        try:
            failures, out_of_step = self._rank_failures(error)
            if failures and not fatal and not out_of_step:
                out_of_step = not self._training_group_works()
        except RuntimeError as exc:  # the agreement's own group: a rank died, or never came
            own = f" (here it failed: {_describe(error)})" if error is not None else ""
            raise GroupFailed(
                f"{action}{' ' + phase if phase else ''}: rank {self.rank} could not agree with the other ranks on its outcome{own}: "
                f"{_describe(exc)}; a rank is gone or never came, so every rank stops (a restart resumes from the checkpoint)"
            ) from (error or exc)
        if not failures:
            return result  # type: ignore[return-value]
        ranks = "; ".join(failures)
        if out_of_step:
            raise GroupFailed(
                f"{what} on {ranks}; the ranks stopped at different collectives or the process group no longer answers, "
                "so it is unusable: every rank stops (a restart resumes from the checkpoint)"
            ) from error
        if fatal:
            raise GroupFailed(
                f"{what} on {ranks}; it changes the learner, so the ranks' learners may now differ: "
                "every rank stops (a restart resumes from the checkpoint)"
            ) from error
        raise failed(f"{what} on {ranks}; every rank abandoned it, the learners are unchanged") from error

    @staticmethod
    def _unbroken(work: Callable[[], T], what: str) -> T:
        """``work()``, whose failure leaves the learner in doubt: :class:`LearnerBroken`."""
        try:
            return work()
        except Exception as exc:
            raise LearnerBroken(
                f"{what} ({_describe(exc)}); it may have changed part of the learner, so training stops here "
                "(a restart resumes from the checkpoint)"
            ) from exc

    def _rank_failures(self, error: Exception | None) -> tuple[list[str], bool]:
        """Every rank's ``error`` ('rank N (Type: message)' per failed rank; [] when none
        failed), and whether the ranks issued different numbers of collectives on the
        training group (they stopped at different ones). A collective of the agreement's
        group: one small all-reduce, and a gather of the errors only when some rank failed."""
        seq = _collectives_issued()
        flags = torch.tensor([0 if error is None else 1, seq, -seq], dtype=torch.int64)
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, group=self._control)
        if not int(flags[0]):
            return [], False
        out_of_step = seq >= 0 and int(flags[1]) != -int(flags[2])
        errors: list[str | None] = [None] * self.world
        torch.distributed.all_gather_object(errors, None if error is None else _describe(error), group=self._control)
        return [f"rank {rank} ({text})" for rank, text in enumerate(errors) if text is not None], out_of_step

    def _training_group_works(self) -> bool:
        """Whether a collective of the training group still completes on every rank (a
        collective that timed out on it leaves it unusable though the ranks issued the
        same collectives). Bounded by ``collective_timeout_s``."""
        ok = True
        try:
            torch.distributed.all_reduce(torch.zeros(1, device=self.device))
        except RuntimeError:
            ok = False
        broken = torch.tensor([0 if ok else 1], dtype=torch.int64)
        torch.distributed.all_reduce(broken, op=torch.distributed.ReduceOp.MAX, group=self._control)
        return not int(broken)

    def _clip_gradients(self) -> float:
        """Clips to ``max_grad_norm`` (0: off); returns the norm over the whole model."""
        params = [p for p in self.module.parameters() if p.grad is not None]
        norm = _whole(torch.nn.utils.get_total_norm([p.grad for p in params]))
        if self.config.max_grad_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.config.max_grad_norm, norm)
        return float(norm)

    def check_group(self, trajectories: Sequence[common_pb2.Trajectory]) -> str:
        """Why this model cannot train on a group, or '' when it can (see :class:`ModelLimits`)."""
        return self.limits.problem(trajectories)

    def step(self, groups: list[list[common_pb2.Trajectory]]) -> StepResult:
        """One optimizer step on complete groups; advances the policy version.

        Groups left with nothing to learn (all stale, or equal rewards) make no step. Nor
        does a batch whose loss or gradient norm is not finite: the update would write NaN
        into every weight (and the next checkpoint would keep it), so the weights, the
        optimizer and the schedule stay as they were and the result says why
        (``stepped=False``, ``skipped``). Whatever raises does so before the update: a
        failed step leaves the learner as it found it, and the caller may retry it. The
        update itself is the exception: an optimizer step that raises may have updated part
        of the weights, so it raises :class:`LearnerBroken` (training stops, a restart
        resumes from the checkpoint) rather than be retried on them.

        Under ``torch.distributed`` every rank calls this with the same groups. The ranks
        agree after building the batch, after the forward and backward passes and after
        the gradient reduction whether that phase succeeded on all of them (:meth:`agreed`);
        if not, every rank raises :class:`StepFailed` there, before any update. Replicated
        ranks run the first two phases without a collective, so any failure of one rank is
        one every rank takes alike. Under FSDP the forward and backward passes are
        collectives themselves: a failure there on some ranks leaves the others in a
        collective until ``collective_timeout_s``, the process group unusable, and every
        rank raises :class:`GroupFailed` instead. The ranks agree after the optimizer step
        too: one that failed on any rank raises :class:`GroupFailed` on every rank (the
        others did update their weights), so none trains on weights that differ.
        """
        start = time.perf_counter()
        prepared, common, batch = self._agreed(lambda: self._prepare(groups), "while building the batch")
        if batch is None:
            return StepResult(self.step_count, 0.0, trajectories=0, groups=0, grad_norm=0.0, seconds=time.perf_counter() - start, stats={}, stepped=False, **common)
        self.optimizer.zero_grad(set_to_none=True)
        local_loss, stats = self._agreed(lambda: self.backward(batch), "in the forward and backward passes")
        grad_norm, loss = self._agreed(lambda: self._reduce(local_loss), "in the gradient reduction")
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)  # the gradients hold inf/NaN: drop them
            why = f"non-finite loss {loss} or gradient norm {grad_norm}: the optimizer step was skipped"
            log.warning("step %d on %d groups: %s", self.step_count + 1, len(prepared.groups), why)
            return StepResult(
                self.step_count, loss, trajectories=0, groups=0, grad_norm=grad_norm, seconds=time.perf_counter() - start,
                stats=stats, stepped=False, skipped=why, **common,
            )
        # The only phase that changes the weights: a failure part-way, or on some ranks
        # only, leaves them partly updated or different (no copy to roll back to: it would
        # double the optimiser's memory), so training stops there (LearnerBroken; with
        # several ranks GroupFailed, on every rank) and a restart resumes from the checkpoint.
        self._agreed(self.optimizer.step, "in the optimizer step", fatal=True)
        self.scheduler.step()
        self.step_count += 1
        self.version += 1
        return StepResult(
            step=self.step_count,
            loss=loss,
            trajectories=int(batch.rewards.numel()),
            groups=len(prepared.groups),
            grad_norm=grad_norm,
            seconds=time.perf_counter() - start,
            stats=stats,
            **common,
        )

    def _prepare(self, groups: list[list[common_pb2.Trajectory]]) -> tuple[Prepared, dict[str, Any], Batch | None]:
        """What a step trains on: the groups left after the staleness and equal-reward
        rules, the step's figures, and their batch (None: nothing left to learn). Local to
        this rank, and changes nothing."""
        prepared = prepare_groups(groups, self.version, self.config)
        rewards = [t.reward for g in groups for t in g]
        common = {
            "dropped_stale": prepared.dropped_stale,
            "downweighted_stale": prepared.downweighted_stale,
            "dropped_groups": prepared.dropped_groups,
            "reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
            "pass_rate": sum(1 for r in rewards if r >= PASS_REWARD) / len(rewards) if rewards else 0.0,
            "lag_mean": sum(prepared.lags) / len(prepared.lags) if prepared.lags else 0.0,
            "lag_max": max(prepared.lags, default=0),
            "lr": float(self.scheduler.get_last_lr()[0]),
        }
        if not prepared.groups:
            return prepared, common, None
        return prepared, common, build_batch(prepared.groups, self.pad_id, self.loss_config, prepared.weights)
