"""What travels between weightsync peers: one version as a manifest and its chunk
payloads, the codec name manifests carry, and how a version is encoded against the one
before it. Shared by the origin's store and every receiver."""
from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping

from meridian.errors import InvalidArgument
from meridian.tensors import Weights, weights_hash
from meridian.v1 import weightsync_pb2 as pb
from services.weightsync import codec

#: Chunk codec and weights-hash scheme of a manifest; versions stored under another
#: name (e.g. by an older origin) are not recovered, and subscribers refuse them.
CODEC_NAME = "meridian-ctx-rice-v1+ehash2"


@dataclasses.dataclass
class Encoded:
    """One version as sent: a manifest and its chunk payloads (index-aligned)."""

    manifest: pb.Manifest
    chunks: list[bytes]

    @property
    def size(self) -> int:
        return sum(len(c) for c in self.chunks)

    @property
    def is_keyframe(self) -> bool:
        return self.manifest.base_version < 0


def encode_version(
    version: int,
    weights: Weights,
    base: Weights | None,
    base_version: int,
    chunk_bytes: int,
    trace_context: Mapping[str, str] | None = None,
    canary: pb.Canary | None = None,
    signature: pb.VersionSignature | None = None,
) -> Encoded:
    """Encodes ``weights`` as a delta against ``base`` (or a keyframe when base is None);
    ``trace_context``, ``canary`` and the publisher's ``signature`` describe the version
    and go into its manifest as given (the signature covers no part of the encoding)."""
    check_tensor_set(version, weights, base)
    payloads = encode_tensors(weights, base, chunk_bytes)
    return assemble_version(version, weights, payloads, base_version if base is not None else -1, weights_hash(weights), trace_context, canary, signature)


def check_tensor_set(version: int, weights: Weights, base: Weights | None) -> None:
    """Refuses a version whose tensor names differ from its base's (INVALID_ARGUMENT)."""
    if base is not None and set(base) != set(weights):
        missing, extra = sorted(set(base) - set(weights)), sorted(set(weights) - set(base))
        raise InvalidArgument(f"version {version} changes the tensor set (missing {missing[:3]}, new {extra[:3]})")


def encode_tensors(weights: Weights, base: Weights | None, chunk_bytes: int) -> dict[str, list[bytes]]:
    """The chunk payloads of each tensor of ``weights`` (a delta against ``base``'s tensor
    of the same name, or a keyframe when base is None). A tensor's payloads depend only on
    the tensor, its base and ``chunk_bytes``, so disjoint subsets of a version can be
    encoded apart (one worker per sharded-publish part) and assembled into the same
    version (:func:`assemble_version`)."""
    out: dict[str, list[bytes]] = {}
    for name in sorted(weights):
        t = weights[name]
        old = base.get(name) if base is not None else None
        if base is not None and old is None:
            raise InvalidArgument(f"tensor {name!r} is not in the base version")
        if old is not None and (old.dtype, old.shape) != (t.dtype, t.shape):
            raise InvalidArgument(f"tensor {name}: {old.dtype}{list(old.shape)} became {t.dtype}{list(t.shape)}")
        per_chunk = max(1, chunk_bytes // t.bits.itemsize)
        pieces = codec.encode_tensor(name, t.bits, old.bits if old is not None else None, t.dtype, chunk_elems=per_chunk)
        out[name] = [piece.payload for piece in pieces]
    return out


def assemble_version(
    version: int,
    weights: Weights,
    payloads: Mapping[str, list[bytes]],
    base_version: int,
    digest: str,
    trace_context: Mapping[str, str] | None = None,
    canary: pb.Canary | None = None,
    signature: pb.VersionSignature | None = None,
) -> Encoded:
    """One version's manifest and chunks from each tensor's payloads: tensors in name
    order, chunks indexed in that order, ``digest`` as its weights hash (the caller's
    :func:`weights_hash` of ``weights``, or the same hash combined from per-part sums)."""
    manifest = pb.Manifest(
        version=version,
        base_version=base_version,
        weights_hash=digest,
        codec=CODEC_NAME,
        trace_context=dict(trace_context or {}),
        canary=canary,
        signature=signature,
    )
    chunks: list[bytes] = []
    for name in sorted(weights):
        t = weights[name]
        manifest.tensors.append(t.meta(name))
        manifest.raw_bytes += t.nbytes
        for payload in payloads[name]:
            manifest.chunks.append(pb.ChunkRef(index=len(chunks), tensor=name, size=len(payload), sha256=hashlib.sha256(payload).hexdigest()))
            chunks.append(payload)
    manifest.encoded_bytes = sum(len(c) for c in chunks)
    return Encoded(manifest, chunks)
