"""Signed policy versions: the trainer signs each version it publishes with an Ed25519
key; the origin, relays and rollout subscribers verify before they store, serve or apply.

What is signed (:func:`signed_bytes`) is what the trainer produced, never how a
version travels: the version number, the tensors' names, dtypes and shapes, the canary,
the manifest's ``weights_hash`` and ``content_sha256``, a sha256 over every tensor's raw
bytes. The encoding (base version, keyframe or delta, codec, chunk list) is left out on
purpose: the origin chooses the base, makes keyframes beside deltas, and relays build
compacted deltas for late joiners, all without the key. That is safe because a receiver
checks what it decoded against the signed digest before it stores or applies the
version: whatever base or chunks a relay sends, the result is the trainer's weights or it
is refused.

``weights_hash`` alone would not do: its per-tensor part is an additive element hash
(see :mod:`meridian.elementhash`) that someone choosing many elements can steer, so a
forger could keep it while changing the weights. ``content_sha256`` costs receivers one
full pass over the weights per version (sha256, several tensors at once) and only when
verification is configured.

Pure core: no gRPC. Failures raise :class:`SignatureRefused` (PERMISSION_DENIED).
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import os
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from meridian.errors import MeridianError
from meridian.tensors import RawTensor
from meridian.v1 import weightsync_pb2 as pb

#: Prefixes that keep these bytes from ever meaning anything else (another message
#: signed with the same key, another digest).
SIGNED_DOMAIN = b"meridian.weightsync.version.v1\0"
CONTENT_DOMAIN = b"meridian.weightsync.content.v1\0"

_HASH_THREADS = os.cpu_count() or 1


class SignatureRefused(MeridianError):
    """A version (or a Publish) whose signature is missing, does not verify with the
    trusted key, or whose weights differ from what the signature covers."""

    status = "PERMISSION_DENIED"


# ---------------------------------------------------------------- keys


def generate_signing_key(private_path: Path, public_path: Path) -> None:
    """Writes a new Ed25519 key pair: the private key as PKCS8 PEM (mode 0600, created
    that way, never readable by others), the public key as SubjectPublicKeyInfo PEM."""
    private_path, public_path = Path(private_path), Path(public_path)
    key = Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    public_pem = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    private_path.parent.mkdir(parents=True, exist_ok=True)
    public_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(private_pem)
    os.chmod(private_path, 0o600)  # an existing file keeps its mode through O_CREAT
    public_path.write_bytes(public_pem)


def key_id(public_key: Ed25519PublicKey) -> str:
    """The key's fingerprint: hex sha256 of its DER SubjectPublicKeyInfo."""
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()


def _read_pem(path: Path, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read the {what} {path}: {exc.strerror}") from None


def load_private_key(path: Path) -> Ed25519PrivateKey:
    """The Ed25519 private key in PEM file ``path`` (ValueError naming the file otherwise)."""
    try:
        key = serialization.load_pem_private_key(_read_pem(path, "signing key"), password=None)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"signing key {path} is not an unencrypted PEM private key: {exc}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"signing key {path} is a {type(key).__name__}, not an Ed25519 key")
    return key


def load_public_key(path: Path) -> Ed25519PublicKey:
    """The Ed25519 public key in PEM file ``path`` (ValueError naming the file otherwise)."""
    try:
        key = serialization.load_pem_public_key(_read_pem(path, "verify key"))
    except ValueError as exc:
        raise ValueError(f"verify key {path} is not a PEM public key: {exc}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError(f"verify key {path} is a {type(key).__name__}, not an Ed25519 key")
    return key


# ---------------------------------------------------------------- what is signed


def _text(value: str) -> bytes:
    raw = value.encode()
    return struct.pack("<I", len(raw)) + raw


def signed_bytes(version: int, weights_hash: str, content_sha256: str, tensors: Iterable[pb.TensorMeta], canary: pb.Canary) -> bytes:
    """The canonical bytes a version's signature covers: every field length-prefixed,
    integers little-endian, tensors in name order, canary log-probs as the float32 the
    manifest carries (so a reader in any language rebuilds the same bytes)."""
    out = [SIGNED_DOMAIN, struct.pack("<q", version), _text(weights_hash), _text(content_sha256)]
    metas = sorted(tensors, key=lambda m: m.name)
    out.append(struct.pack("<I", len(metas)))
    for meta in metas:
        out += [_text(meta.name), struct.pack("<iI", meta.dtype, len(meta.shape)), struct.pack(f"<{len(meta.shape)}q", *meta.shape)]
    out.append(struct.pack("<I", len(canary.sequences)))
    for seq in canary.sequences:
        out.append(struct.pack(f"<I{len(seq.token_ids)}i", len(seq.token_ids), *seq.token_ids))
        out.append(struct.pack(f"<I{len(seq.logprobs)}f", len(seq.logprobs), *seq.logprobs))
    return b"".join(out)


def tensor_sha256(t: RawTensor) -> bytes:
    """sha256 of one tensor's raw bytes (a part of :func:`content_digest`)."""
    # hashlib releases the GIL on large buffers: tensors hash in parallel on the pool.
    return hashlib.sha256(memoryview(np.ascontiguousarray(t.bits)).cast("B")).digest()


def content_digest(weights: Mapping[str, RawTensor], known: Mapping[str, bytes] | None = None) -> str:
    """sha256 over every tensor's name, dtype, shape and the sha256 of its raw bytes, in
    name order: collision resistant, unlike the additive ``weights_hash``. ``known``: the
    raw-bytes sha256 of tensors hashed already (the others are hashed now)."""
    known = known or {}
    names = sorted(n for n in weights if n not in known)
    if _HASH_THREADS > 1 and len(names) > 1:
        with concurrent.futures.ThreadPoolExecutor(min(_HASH_THREADS, len(names))) as pool:
            digests = dict(zip(names, pool.map(tensor_sha256, (weights[n] for n in names))))
    else:
        digests = {n: tensor_sha256(weights[n]) for n in names}
    digests.update((n, d) for n, d in known.items() if n in weights)
    return content_from_digests([(n, t.dtype, tuple(t.shape), digests[n]) for n, t in weights.items()])


def content_from_digests(items: Iterable[tuple[str, str, tuple[int, ...], bytes]]) -> str:
    """:func:`content_digest` from each tensor's (name, dtype, shape, sha256 of its raw
    bytes), in any order: what a sharded trainer's rank 0 combines from its ranks' parts."""
    h = hashlib.sha256(CONTENT_DOMAIN)
    for name, dtype, shape, digest in sorted(items):
        h.update(_text(name) + _text(dtype) + struct.pack(f"<I{len(shape)}q", len(shape), *shape) + digest)
    return h.hexdigest()


# ---------------------------------------------------------------- signing and verifying


class Signer:
    """Signs versions with one private key (the trainer's)."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._key = private_key
        self.key_id = key_id(private_key.public_key())

    @classmethod
    def load(cls, path: Path | str) -> Signer:
        return cls(load_private_key(Path(path)))

    def sign(self, version: int, weights_hash: str, weights: Mapping[str, RawTensor], canary: pb.Canary | None) -> pb.VersionSignature:
        """The signature of ``version`` with these weights (one full pass for the digest)."""
        content = content_digest(weights)
        metas = [weights[n].meta(n) for n in weights]
        payload = signed_bytes(version, weights_hash, content, metas, canary or pb.Canary())
        return pb.VersionSignature(content_sha256=content, key_id=self.key_id, signature=self._key.sign(payload))

    def sign_digests(self, version: int, weights_hash: str, content: str, tensors: Iterable[pb.TensorMeta], canary: pb.Canary | None) -> pb.VersionSignature:
        """The same signature as :meth:`sign` from digests combined elsewhere (a sharded
        trainer: no process holds the whole weights)."""
        payload = signed_bytes(version, weights_hash, content, tensors, canary or pb.Canary())
        return pb.VersionSignature(content_sha256=content, key_id=self.key_id, signature=self._key.sign(payload))


class Verifier:
    """Checks versions against one trusted public key."""

    def __init__(self, public_key: Ed25519PublicKey) -> None:
        self._key = public_key
        self.key_id = key_id(public_key)

    @classmethod
    def load(cls, path: Path | str) -> Verifier:
        return cls(load_public_key(Path(path)))

    def check(self, version: int, weights_hash: str, tensors: Iterable[pb.TensorMeta], canary: pb.Canary, signature: pb.VersionSignature) -> None:
        """Raises :class:`SignatureRefused` unless ``signature`` is the trusted key's over
        these fields (``signature.content_sha256`` included; the weights are checked
        against it apart, see :meth:`check_content`)."""
        if not signature.signature:
            raise SignatureRefused(f"version {version} is unsigned; this receiver only takes versions signed by key {self.key_id[:16]}")
        payload = signed_bytes(version, weights_hash, signature.content_sha256, tensors, canary)
        try:
            self._key.verify(signature.signature, payload)
        except InvalidSignature:
            if signature.key_id and signature.key_id != self.key_id:
                reason = f"it was signed by key {signature.key_id[:16]}, not the trusted key {self.key_id[:16]}"
            else:
                reason = f"its signature does not verify with key {self.key_id[:16]} (forged, or a covered field was changed)"
            raise SignatureRefused(f"version {version} refused: {reason}") from None

    def check_manifest(self, manifest: pb.Manifest) -> None:
        """A manifest as it arrives from upstream, before any of its chunks is taken."""
        self.check(manifest.version, manifest.weights_hash, manifest.tensors, manifest.canary, manifest.signature)

    def check_content(
        self, version: int, signature: pb.VersionSignature, weights: Mapping[str, RawTensor], tensor_sha256s: Mapping[str, bytes] | None = None
    ) -> None:
        """Raises :class:`SignatureRefused` unless ``weights`` are the ones the (already
        verified) signature covers. ``tensor_sha256s``: the sha256 of tensors the caller
        already hashed in their final state (a decoder, as each tensor's last chunk was
        written); the others are hashed here."""
        got = content_digest(weights, tensor_sha256s)
        if got != signature.content_sha256:
            raise SignatureRefused(
                f"version {version} refused: its weights' content digest {got[:16]} is not the signed {signature.content_sha256[:16]}"
            )


def load_verifier(path: str) -> Verifier | None:
    """The verifier of a ``--verify-key`` flag (empty: verification off)."""
    return Verifier.load(path) if path else None


def load_signer(path: str) -> Signer | None:
    """The signer of a ``--signing-key`` flag (empty: versions go out unsigned)."""
    return Signer.load(path) if path else None
