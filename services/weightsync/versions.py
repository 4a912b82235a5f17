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
    if base is not None and set(base) != set(weights):
        missing, extra = sorted(set(base) - set(weights)), sorted(set(weights) - set(base))
        raise InvalidArgument(f"version {version} changes the tensor set (missing {missing[:3]}, new {extra[:3]})")
    manifest = pb.Manifest(
        version=version,
        base_version=base_version if base is not None else -1,
        weights_hash=weights_hash(weights),
        codec=CODEC_NAME,
        trace_context=dict(trace_context or {}),
        canary=canary,
        signature=signature,
    )
    chunks: list[bytes] = []
    for name in sorted(weights):
        t = weights[name]
        old = base[name] if base is not None else None
        if old is not None and (old.dtype, old.shape) != (t.dtype, t.shape):
            raise InvalidArgument(f"tensor {name}: {old.dtype}{list(old.shape)} became {t.dtype}{list(t.shape)}")
        manifest.tensors.append(t.meta(name))
        manifest.raw_bytes += t.nbytes
        per_chunk = max(1, chunk_bytes // t.bits.itemsize)
        for piece in codec.encode_tensor(name, t.bits, old.bits if old is not None else None, t.dtype, chunk_elems=per_chunk):
            manifest.chunks.append(
                pb.ChunkRef(index=len(chunks), tensor=name, size=len(piece.payload), sha256=hashlib.sha256(piece.payload).hexdigest())
            )
            chunks.append(piece.payload)
    manifest.encoded_bytes = sum(len(c) for c in chunks)
    return Encoded(manifest, chunks)
