"""Sharded publish: one version sent as several parts, one per trainer rank.

A trainer sharded over N ranks (FSDP) publishes without any rank holding the whole
model:

- **Partition.** :func:`partition` assigns whole tensors to parts by a deterministic rule
  every rank computes alike from the tensor names and sizes: largest first, each to the
  part with the fewest bytes so far (ties: the lower part index), names breaking ties
  between equal sizes. Every tensor lands in exactly one part, and the parts' bytes
  differ by at most the largest tensor.
- **Digests, not tensors, travel between ranks.** Each rank gathers only the tensors it
  owns and computes, per tensor, the additive element-hash sums and the sha256 of its raw
  bytes (:func:`tensor_digests`, a few dozen bytes each). Rank 0 collects these and
  combines them (:func:`combine`) into exactly the ``weights_hash`` and
  ``content_sha256`` a single process computes over the whole weights, signs the version
  once, and hands the signed version header to every rank. Signing on rank 0 keeps the
  key in one process and needs no extra round trip to the origin after the parts.
- **One stream per part.** Each rank's Publish header repeats the version fields and adds
  its part index, the part count, its tensor names and :func:`part_hash` of its tensors.
  The origin checks every part as it arrives, encodes each part's tensors as soon as that
  part is in (one worker per part, against the same base), and once every part arrived
  assembles ONE manifest with the tensors and chunks in name order: the same manifest and
  chunk bytes a single stream of the whole version gives (the chunk payloads of a tensor
  depend only on that tensor and its base; see :func:`versions.encode_tensors`).
- **Rank-side encoding.** A rank that holds its part of the version the origin holds
  (:class:`PartEncoder`) encodes its tensors itself and sends the chunk payloads; the
  origin decodes them (:func:`versions.decode_tensors`, checking the part hash) and stores
  those payloads, the same bytes it would have encoded. Encoding then runs on every rank at
  once, and a part the origin cannot take that way goes raw.

Pure core: no gRPC, no torch.
"""
from __future__ import annotations

import dataclasses
import heapq
import os
from collections.abc import Mapping, Sequence

import numpy as np

from meridian.errors import InvalidArgument
from meridian.tensors import RawTensor, hash_of_sums
from meridian.v1 import weightsync_pb2 as pb
from services.weightsync.versions import Carried, EncodedTensors, encode_tensors

#: How many parts one version may come in (one per trainer rank).
MAX_PARTS = 4096


def partition(sizes: Mapping[str, int], parts: int) -> list[list[str]]:
    """Tensor names per part (each list in name order): whole tensors, largest first, each
    to the part holding the fewest bytes so far. Deterministic: depends only on the names,
    sizes and ``parts``, never on the order of ``sizes``."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    heap = [(0, index) for index in range(parts)]
    out: list[list[str]] = [[] for _ in range(parts)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        load, index = heapq.heappop(heap)
        out[index].append(name)
        heapq.heappush(heap, (load + sizes[name], index))
    return [sorted(names) for names in out]


@dataclasses.dataclass(frozen=True)
class TensorDigest:
    """What rank 0 needs of a tensor another rank owns: its meta and two digests."""

    dtype: str
    shape: tuple[int, ...]
    sums: tuple[int, int]  # additive element-hash sums (meridian.elementhash)
    sha256: bytes  # of the tensor's raw bytes


def tensor_digests(weights: Mapping[str, RawTensor]) -> dict[str, TensorDigest]:
    """Both digests of every tensor of one part (one pass over this part only)."""
    from meridian import elementhash
    from services.weightsync.signing import tensor_sha256

    names = sorted(weights)
    sums = elementhash.many_tensor_sums([np.ascontiguousarray(weights[n].bits) for n in names])
    return {n: TensorDigest(weights[n].dtype, tuple(weights[n].shape), s, tensor_sha256(weights[n])) for n, s in zip(names, sums)}


def combine(digests: Mapping[str, TensorDigest]) -> tuple[str, str]:
    """(weights_hash, content_sha256) of the whole version from every tensor's digest:
    equal to ``weights_hash(weights)`` and ``signing.content_digest(weights)``."""
    from services.weightsync.signing import content_from_digests

    digest = hash_of_sums([(n, d.dtype, d.shape, d.sums) for n, d in digests.items()])
    content = content_from_digests([(n, d.dtype, d.shape, d.sha256) for n, d in digests.items()])
    return digest, content


HashItem = tuple[str, str, tuple[int, ...], tuple[int, int]]


def hash_items(weights: Mapping[str, RawTensor], known: Mapping[str, tuple[int, int]] | None = None) -> list[HashItem]:
    """(name, dtype, shape, element-hash sums) of each tensor: what ``hash_of_sums`` takes,
    so the whole version's weights hash combines from its parts' items. ``known``: sums
    already known (moved by a decoded delta's changes); the others take a pass."""
    from meridian import elementhash

    known = known or {}
    names = sorted(weights)
    missing = [n for n in names if n not in known]
    sums = dict(known) | dict(zip(missing, elementhash.many_tensor_sums([np.ascontiguousarray(weights[n].bits) for n in missing])))
    return [(n, weights[n].dtype, tuple(weights[n].shape), sums[n]) for n in names]


def part_hash(weights: Mapping[str, RawTensor]) -> str:
    """The weights hash over one part's tensors alone (what a part's header carries)."""
    return hash_of_sums(hash_items(weights))


def part_header(version_header: pb.PublishHeader, index: int, count: int, weights: Mapping[str, RawTensor]) -> pb.PublishHeader:
    """Part ``index`` of ``count``'s header: the version's fields and this part's own."""
    header = pb.PublishHeader()
    header.CopyFrom(version_header)
    header.part_index, header.part_count = index, count
    header.part_tensors[:] = sorted(weights)
    header.part_hash = part_hash(weights)
    return header


#: Trailing metadata an origin sends with its ABORTED refusal of a part of one version
#: while it assembles another's parts (it takes one version's parts at a time): nothing of
#: the part was taken, and the same call can succeed once that version is stored or
#: aborted. ``client.publish_part`` sends such a part again; other ABORTED answers (the
#: part's own version aborted) are for its caller's retries, with the other ranks'.
BUSY_METADATA = ("meridian-origin-busy", "another-version")

#: The fields of a part header that are the part's own, not the version's.
PART_FIELDS = ("part_index", "part_count", "part_tensors", "part_hash", "part_encoded", "part_base_version", "part_chunk_bytes")


def version_fields(header: pb.PublishHeader) -> bytes:
    """A part header's version fields, serialised deterministically: equal for every
    part of one version (the part fields cleared: a part sent raw after its encoded
    copy was refused is the same part)."""
    common = pb.PublishHeader()
    common.CopyFrom(header)
    for field in PART_FIELDS:
        common.ClearField(field)
    return common.SerializeToString(deterministic=True)


def check_part_header(header: pb.PublishHeader) -> None:
    """Refuses (INVALID_ARGUMENT) a part header that cannot describe a part."""
    v, i, n = header.version, header.part_index, header.part_count
    if not 2 <= n <= MAX_PARTS:
        raise InvalidArgument(f"version {v}: part_count must be in [2, {MAX_PARTS}] for a sharded publish, got {n}")
    if i >= n:
        raise InvalidArgument(f"version {v}: part_index {i} is not below part_count {n}")
    names = list(header.part_tensors)
    if names != sorted(set(names)):
        raise InvalidArgument(f"version {v} part {i}: part_tensors must be distinct and in name order")
    if not header.part_hash:
        raise InvalidArgument(f"version {v} part {i}: a part must carry its part_hash")


def check_part_tensors(
    header: pb.PublishHeader, weights: Mapping[str, RawTensor], known: Mapping[str, tuple[int, int]] | None = None
) -> list[HashItem]:
    """Refuses (INVALID_ARGUMENT) a part whose received tensors are not the ones its header
    names, or whose bytes do not hash to its ``part_hash``; returns the part's hash items
    (``known``: as for :func:`hash_items`)."""
    v, i = header.version, header.part_index
    if sorted(weights) != list(header.part_tensors):
        missing = sorted(set(header.part_tensors) - set(weights))
        extra = sorted(set(weights) - set(header.part_tensors))
        raise InvalidArgument(f"version {v} part {i}: tensors sent differ from part_tensors (missing {missing[:3]}, unnamed {extra[:3]})")
    items = hash_items(weights, known)
    got = hash_of_sums(items)
    if got != header.part_hash:
        raise InvalidArgument(f"version {v} part {i}: its tensors hash to {got[:12]}, its header says {header.part_hash[:12]}")
    return items


def rank_encode_threads() -> int:
    """Encode threads for one trainer rank: its share of the cores this process may run
    on (its CPU affinity, not the host's count) among the ranks on its host (torchrun's
    ``LOCAL_WORLD_SIZE``), at least one. Every rank encodes at once, beside training:
    ``cpu_count`` threads each would put ranks x cores threads on the host's cores."""
    cores = len(os.sched_getaffinity(0))
    try:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    except ValueError:
        local_ranks = 1
    return max(1, cores // max(1, local_ranks))


class PartEncoder:
    """A trainer rank's side of rank-side encoding: the tensors of its part of the last
    version the origin took (and what their encoding left: position indexes), so that the
    rank encodes its next part itself, against them, and sends chunk payloads instead of
    raw tensors. Encoding then runs on every rank at once, the origin only decodes.

    The origin takes such a part only when it is coded against the version the origin
    holds and in the origin's chunk size, and only when it decodes to the part's hash;
    otherwise the rank sends the part raw and starts again from what it sent
    (:meth:`advance` after every version the origin took, however it went)."""

    def __init__(self, threads: int = 1) -> None:
        self.threads = max(1, threads)
        self.base_version = -1
        self.base: dict[str, RawTensor] = {}
        self.carried = Carried()
        #: Raw bytes per chunk the origin encodes with (0: not known yet; ask its Status).
        self.chunk_bytes = 0
        #: Whether the last part the origin took went encoded.
        self.last_encoded = False

    def can_encode(self, weights: Mapping[str, RawTensor]) -> bool:
        """Whether ``weights`` can be coded against the held base: the same tensors, each
        of the same dtype and shape (a rank whose share changed sends raw)."""
        if self.base_version < 0 or self.chunk_bytes <= 0 or set(self.base) != set(weights):
            return False
        return all((t.dtype, tuple(t.shape)) == (self.base[n].dtype, tuple(self.base[n].shape)) for n, t in weights.items())

    def encode(self, weights: Mapping[str, RawTensor]) -> EncodedTensors:
        """This part's chunk payloads against the held base (``can_encode`` first)."""
        return encode_tensors(dict(weights), self.base, self.chunk_bytes, self.carried, self.threads)

    def advance(self, version: int, weights: Mapping[str, RawTensor], carried: Carried | None) -> None:
        """The origin took ``version``, whose part was ``weights`` (not to be changed after),
        sent encoded (``carried``: what that encoding left) or raw (None)."""
        self.base_version, self.base = version, dict(weights)
        self.carried = carried if carried is not None else Carried()
        self.last_encoded = carried is not None

    def forget(self) -> None:
        """Drops the base (the origin refused an encoded part): the next part goes raw."""
        self.base_version, self.base, self.carried, self.chunk_bytes = -1, {}, Carried(), 0


def check_disjoint(version: int, parts: Sequence[Sequence[str]]) -> None:
    """Refuses (INVALID_ARGUMENT) parts that name one tensor twice."""
    seen: dict[str, int] = {}
    for index, names in enumerate(parts):
        for name in names:
            if name in seen:
                raise InvalidArgument(f"version {version}: tensor {name!r} is in parts {seen[name]} and {index}")
            seen[name] = index
