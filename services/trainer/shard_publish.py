"""Publishing from a sharded trainer: every rank publishes its part of a version.

Under FSDP2 each rank holds a dim-0 shard of every parameter. Gathering the whole policy
on rank 0 to publish it (what :meth:`Learner.policy_weights` does) costs rank 0 the
whole model's memory and a single-threaded encode at the origin. Instead
(:func:`publish_sharded`, a collective every rank calls with the same arguments):

1. The tensors are partitioned over the ranks by :func:`services.weightsync.parts.partition`
   (whole tensors, size-balanced, deterministic: every rank computes the same owners).
2. Each parameter's bf16 shards are gathered to its owner alone (``dist.gather`` to one
   destination, not ``full_tensor()``'s all-gather), one parameter at a time: a rank ends
   with the tensors it owns, about 1/N of the model, never the whole.
3. Each rank digests its tensors (element-hash sums and sha256 per tensor: a few dozen
   bytes each) and those digests, not the tensors, are gathered to rank 0, which combines
   them into the version's ``weights_hash`` and ``content_sha256`` and signs the version
   once (the key stays in rank 0). Rank 0 broadcasts the signed version header.
4. Every rank opens its own Publish stream with that header plus its part fields. A rank
   that sent its part of the version before encodes this part against it itself
   (:class:`services.weightsync.parts.PartEncoder`: encoding runs on every rank at once) and
   sends the chunk payloads; otherwise it sends the tensors raw and the origin encodes them.
   The origin stores one manifest, byte for byte what a single-process publish of the same
   weights stores.

One process (world size 1) keeps the ordinary single-stream publish.

The trainer service under ``--data-parallel fsdp`` splits this in two (see
:mod:`services.trainer.distributed`): :func:`prepare_part` is the collective part (steps 1
to 3, and the canary through the sharded model), which every rank runs when rank 0 says
so, in order with the training steps; sending (step 4) is network only and runs in the
background beside the next step: on rank 0 in the Committer's publish task, on every other
rank in a :class:`PartSender` thread.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import queue
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

import torch
import torch.distributed as dist

from meridian.tensors import RawTensor, from_torch
from meridian.v1 import weightsync_pb2 as pb
from services.weightsync import client as weightsync
from services.weightsync import parts
from services.weightsync.signing import Signer

log = logging.getLogger(__name__)


def _gather_to_owner(t: torch.Tensor, owner: int, rank: int, world: int) -> torch.Tensor | None:
    """Tensor ``t`` (a DTensor sharded on dim 0, or a plain replicated tensor) whole on rank
    ``owner`` only; None elsewhere. A collective: every rank calls it in the same order."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(t, DTensor):
        return t if rank == owner else None
    if tuple(t.placements) != (Shard(0),) or t.device_mesh.ndim != 1:
        whole = t.full_tensor()  # another layout: the general (all-gather) path
        return whole if rank == owner else None
    shape = tuple(t.shape)
    rows, rest = shape[0], math.prod(shape[1:])
    per = math.ceil(rows / world)  # torch.chunk's split, as FSDP2 shards dim 0
    local = t.to_local().contiguous().reshape(-1).view(torch.uint8)  # bytes: every backend gathers uint8
    itemsize = t.element_size()
    buf = torch.zeros(per * rest * itemsize, dtype=torch.uint8, device=local.device)
    buf[: local.numel()] = local
    gathered = [torch.empty_like(buf) for _ in range(world)] if rank == owner else None
    dist.gather(buf, gathered, dst=owner)
    if gathered is None:
        return None
    pieces = [g[: max(0, min(per, rows - r * per)) * rest * itemsize] for r, g in enumerate(gathered)]
    return torch.cat(pieces).view(t.dtype).reshape(shape)


def owned_weights(module: torch.nn.Module, rank: int, world: int) -> tuple[dict[str, RawTensor], list[list[str]]]:
    """The bf16 policy tensors this rank owns under :func:`parts.partition`, and the
    partition (every rank's names). A collective over every parameter."""
    named = list(module.named_parameters())
    split = parts.partition({name: p.numel() * 2 for name, p in named}, world)  # bf16: 2 bytes an element
    owner = {name: r for r, names in enumerate(split) for name in names}
    mine: dict[str, RawTensor] = {}
    with torch.no_grad():
        for name, p in named:
            # Cast before gathering, as policy_weights does: half the bytes on the wire.
            whole = _gather_to_owner(p.detach().to(torch.bfloat16), owner[name], rank, world)
            if whole is not None:
                mine[name] = from_torch(whole)
    return mine, split


def version_header(
    version: int, mine: Mapping[str, RawTensor], rank: int, signer: Signer | None, canary: pb.Canary | None,
    trace_context: Mapping[str, str] | None = None, metrics: Mapping[str, float] | None = None,
) -> pb.PublishHeader:
    """The version fields every part carries: digests gathered to rank 0, signed there,
    the header broadcast back. A collective."""
    digests = parts.tensor_digests(mine)
    gathered: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(digests, gathered, dst=0)
    box: list[Any] = [None]
    if rank == 0:
        assert gathered is not None
        every: dict[str, parts.TensorDigest] = {}
        for part in gathered:
            every.update(part)
        box[0] = weightsync.version_header_from_digests(version, every, trace_context, metrics, canary, signer).SerializeToString()
    dist.broadcast_object_list(box, src=0)
    return pb.PublishHeader.FromString(box[0])


def publish_sharded(
    module: torch.nn.Module, address: str, version: int, *, signer: Signer | None = None, canary: pb.Canary | None = None,
    trace_context: Mapping[str, str] | None = None, metrics: Mapping[str, float] | None = None, encoder: parts.PartEncoder | None = None,
) -> tuple[pb.PublishResponse, int]:
    """Publishes ``module``'s parameters (bf16) as ``version``, one part per rank; every
    rank calls it with the same arguments (only rank 0's ``signer``, ``canary``,
    ``trace_context`` and ``metrics`` are used). ``encoder``: this rank's, kept from version
    to version, to encode its part itself (see :class:`parts.PartEncoder`). Returns the
    origin's answer and the bytes of the tensors this rank gathered."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine, _ = owned_weights(module, rank, world)
    if world == 1:  # one process: the ordinary single-stream publish
        reply = asyncio.run(weightsync.publish(address, version, mine, trace_context, metrics, canary, signer))
        return reply, sum(t.nbytes for t in mine.values())
    header = version_header(version, mine, rank, signer, canary, trace_context, metrics)
    reply = asyncio.run(weightsync.publish_part(address, header, rank, world, mine, encoder))
    return reply, sum(t.nbytes for t in mine.values())


@dataclasses.dataclass(frozen=True)
class PreparedPart:
    """This rank's part of one version, ready to send: the signed version header every
    part shares (it carries the canary), this rank's index among ``count`` parts, and the
    whole tensors it owns (nothing of the others')."""

    header: pb.PublishHeader
    index: int
    count: int
    weights: dict[str, RawTensor]

    @property
    def version(self) -> int:
        return self.header.version

    @property
    def gathered_bytes(self) -> int:
        """Bytes of the tensors this rank gathered for the part."""
        return sum(t.nbytes for t in self.weights.values())


def prepare_part(
    learner: Any, version: int, *, signer: Signer | None = None, trace_context: Mapping[str, str] | None = None,
    metrics: Mapping[str, float] | None = None,
) -> PreparedPart:
    """This rank's part of ``version`` from a sharded ``learner``
    (:class:`services.trainer.learner.Learner`): its own tensors gathered to it, the canary
    computed through the sharded model (:meth:`Learner.shard_canary`), the version header
    signed on rank 0. A collective: every rank calls it at the same point of the command
    sequence (only rank 0's ``signer``, ``trace_context`` and ``metrics`` are used)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine, _ = owned_weights(learner.module, rank, world)
    probe = learner.shard_canary()
    header = version_header(version, mine, rank, signer, probe, trace_context, metrics)
    return PreparedPart(header, rank, world, mine)


async def send_part(
    address: str, part: PreparedPart, retry_s: Sequence[float], refusals: frozenset[grpc.StatusCode], encoder: parts.PartEncoder | None = None
) -> bool:
    """Sends a follower's part (encoded by ``encoder`` when it can), retried after each of
    ``retry_s`` on transient errors (the origin aborts the version for every part when one
    fails, so every rank retries on the same schedule and the parts meet again). Returns
    whether the origin stored the version; a refusal or the last failure is logged, not
    raised: rank 0, answered the same by the origin, decides what the trainer does."""
    for attempt, pause in enumerate((*retry_s, None)):
        try:
            await weightsync.publish_part(address, part.header, part.index, part.count, part.weights, encoder)
            return True
        except grpc.aio.AioRpcError as exc:
            if exc.code() in refusals or pause is None:
                log.error("version %d part %d of %d was not published: %s %s", part.version, part.index, part.count, exc.code().name, exc.details())
                return False
            log.warning("version %d part %d failed (%s, attempt %d); retrying in %.1f s", part.version, part.index, exc.code().name, attempt + 1, pause)
            await asyncio.sleep(pause)
    raise AssertionError("unreachable")


class PartSender:
    """A follower rank's parts on their way to the origin, beside the next training step:
    one background thread sends them one at a time in the order given (the origin
    assembles one version at a time, in version order, as rank 0's Committer sends its
    own), each with :func:`send_part`'s retries."""

    def __init__(self, address: str, retry_s: Sequence[float], refusals: frozenset[grpc.StatusCode]) -> None:
        self.address = address
        self.retry_s = tuple(retry_s)
        self.refusals = refusals
        self._queue: queue.Queue[PreparedPart | None] = queue.Queue()
        # This rank's part of the last version sent, so that it encodes its next part itself.
        self.encoder = parts.PartEncoder(parts.rank_encode_threads())
        self._thread = threading.Thread(target=self._run, name="part-sender", daemon=True)
        self._thread.start()

    def submit(self, part: PreparedPart) -> None:
        """Queues ``part`` behind the parts queued before it."""
        self._queue.put(part)

    def close(self) -> None:
        """Sends what is queued, then ends the thread."""
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (part := self._queue.get()) is not None:
            try:
                asyncio.run(send_part(self.address, part, self.retry_s, self.refusals, self.encoder))
            except Exception:
                log.exception("sending version %d part %d failed", part.version, part.index)


def record_part(folder: Path | None, part: PreparedPart) -> None:
    """Appends one JSON line about ``part`` (version, index, count, tensors, gathered
    bytes) to ``folder``/parts-rank-<index>.jsonl: what shows that no rank gathered more
    than its part. Nothing without a folder."""
    if folder is None:
        return
    folder.mkdir(parents=True, exist_ok=True)
    line = {"version": part.version, "part": part.index, "parts": part.count, "tensors": sorted(part.weights), "gathered_bytes": part.gathered_bytes}
    with open(folder / f"parts-rank-{part.index}.jsonl", "a") as fh:
        fh.write(json.dumps(line) + "\n")
