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
4. Every rank opens its own Publish stream with that header plus its part fields; the
   origin encodes the parts in parallel and stores one manifest, byte for byte what a
   single-process publish of the same weights stores.

One process (world size 1) keeps the ordinary single-stream publish.
"""
from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from meridian.tensors import RawTensor, from_torch
from meridian.v1 import weightsync_pb2 as pb
from services.weightsync import client as weightsync
from services.weightsync import parts
from services.weightsync.signing import Signer


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
    trace_context: Mapping[str, str] | None = None, metrics: Mapping[str, float] | None = None,
) -> tuple[pb.PublishResponse, int]:
    """Publishes ``module``'s parameters (bf16) as ``version``, one part per rank; every
    rank calls it with the same arguments (only rank 0's ``signer``, ``canary``,
    ``trace_context`` and ``metrics`` are used). Returns the origin's answer and the bytes
    of the tensors this rank gathered and sent."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine, _ = owned_weights(module, rank, world)
    if world == 1:  # one process: the ordinary single-stream publish
        reply = asyncio.run(weightsync.publish(address, version, mine, trace_context, metrics, canary, signer))
        return reply, sum(t.nbytes for t in mine.values())
    header = version_header(version, mine, rank, signer, canary, trace_context, metrics)
    reply = asyncio.run(weightsync.publish_part(address, header, rank, world, mine))
    return reply, sum(t.nbytes for t in mine.values())
