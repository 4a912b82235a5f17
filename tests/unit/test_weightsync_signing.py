"""Signed policy versions (services/weightsync/signing.py): keys, what the signature
covers, and the decoder refusing what the trusted key did not sign, whatever encoding
(delta, keyframe, compacted delta) brought the version."""
from __future__ import annotations

import stat
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from meridian.tensors import RawTensor, weights_hash
from meridian.v1 import weightsync_pb2 as pb
from services.weightsync import receiver, signing
from services.weightsync.receiver import Decoder
from services.weightsync.signing import SignatureRefused, Signer, Verifier, content_digest, generate_signing_key, key_id
from services.weightsync.store import VersionStore
from services.weightsync.versions import Encoded, encode_version

Weights = dict[str, RawTensor]
CHUNK_BYTES = 64


def _weights(seed: int = 0) -> Weights:
    rng = np.random.default_rng(seed)
    bits = (rng.normal(0, 0.05, 200).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return {
        "layer.0.weight": RawTensor("bf16", (10, 16), bits[:160].copy()),
        "layer.0.bias": RawTensor("bf16", (40,), bits[160:].copy()),
        "head.fp32": RawTensor("fp32", (3, 5), rng.normal(0, 1, 15).astype(np.float32).view(np.uint32)),
    }


def _step(weights: Weights, seed: int) -> Weights:
    rng = np.random.default_rng(100 + seed)
    out = {}
    for name, t in weights.items():
        bits = t.bits.copy()
        idx = rng.choice(bits.size, size=max(1, bits.size // 5), replace=False)
        bits[idx] ^= rng.integers(1, 8, idx.size).astype(bits.dtype)
        out[name] = RawTensor(t.dtype, t.shape, bits)
    return out


def _copy(weights: Weights) -> Weights:
    return {n: RawTensor(t.dtype, t.shape, t.bits.copy()) for n, t in weights.items()}


CANARY = pb.Canary(sequences=[pb.CanarySequence(token_ids=[1, 5, 9], logprobs=[0.0, -1.25, -0.5])])


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("keys")
    for who in ("trainer", "attacker"):
        generate_signing_key(folder / f"{who}-key.pem", folder / f"{who}-pub.pem")
    return {p.stem: p for p in folder.iterdir()}


@pytest.fixture(scope="module")
def signer(keys: dict[str, Path]) -> Signer:
    return Signer.load(keys["trainer-key"])


@pytest.fixture(scope="module")
def verifier(keys: dict[str, Path]) -> Verifier:
    return Verifier.load(keys["trainer-pub"])


def _signed(signer: Signer, version: int, weights: Weights, base: Weights | None = None, base_version: int = -1) -> Encoded:
    """One version encoded as the origin stores it, with the trainer's signature."""
    signature = signer.sign(version, weights_hash(weights), weights, CANARY)
    return encode_version(version, weights, base, base_version, CHUNK_BYTES, {"traceparent": "x"}, CANARY, signature)


def _apply(decoder: Decoder, enc: Encoded) -> int:
    decoder.begin(enc.manifest)
    for i, payload in enumerate(enc.chunks):
        decoder.add_chunk(i, payload)
    return decoder.finish()


# ---------------------------------------------------------------- keys


def test_generate_signing_key_writes_pem_files_private_one_owner_only(tmp_path: Path) -> None:
    private, public = tmp_path / "creds" / "signing-key.pem", tmp_path / "creds" / "signing-pub.pem"
    generate_signing_key(private, public)
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    assert private.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")  # PKCS8
    assert public.read_bytes().startswith(b"-----BEGIN PUBLIC KEY-----")  # SubjectPublicKeyInfo
    signer, verifier = Signer.load(private), Verifier.load(public)
    assert signer.key_id == verifier.key_id == key_id(verifier._key) and len(signer.key_id) == 64


def test_loading_the_wrong_kind_of_file_names_it(keys: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="trainer-pub.pem"):
        Signer.load(keys["trainer-pub"])  # a public key where the private one belongs
    with pytest.raises(ValueError, match="missing.pem"):
        Verifier.load(tmp_path / "missing.pem")


# ---------------------------------------------------------------- what the signature covers


def test_sign_verify_round_trip(signer: Signer, verifier: Verifier) -> None:
    enc = _signed(signer, 3, _weights())
    verifier.check_manifest(enc.manifest)
    assert enc.manifest.signature.key_id == verifier.key_id and len(enc.manifest.signature.signature) == 64


def _tamper(field: str) -> Callable[[pb.Manifest], None]:
    def change(m: pb.Manifest) -> None:
        if field == "version":
            m.version += 1
        elif field == "weights_hash":
            m.weights_hash = weights_hash(_weights(9))
        elif field == "content_sha256":
            m.signature.content_sha256 = content_digest(_weights(9))
        elif field == "tensor name":
            m.tensors[0].name += "x"
        elif field == "tensor dtype":
            m.tensors[0].dtype = pb.DTYPE_FP16
        elif field == "tensor shape":
            m.tensors[1].shape[:] = [16, 10]
        elif field == "extra tensor":
            m.tensors.add(name="zz.extra", dtype=pb.DTYPE_BF16, shape=[1])
        elif field == "canary token":
            m.canary.sequences[0].token_ids[1] = 6
        elif field == "canary logprob":
            m.canary.sequences[0].logprobs[1] = -1.0
        elif field == "canary dropped":
            m.ClearField("canary")
        elif field == "signature bytes":
            m.signature.signature = bytes(64)
    return change


COVERED = ["version", "weights_hash", "content_sha256", "tensor name", "tensor dtype", "tensor shape", "extra tensor",
           "canary token", "canary logprob", "canary dropped", "signature bytes"]


@pytest.mark.parametrize("field", COVERED)
def test_a_manifest_with_any_covered_field_changed_is_refused(signer: Signer, verifier: Verifier, field: str) -> None:
    enc = _signed(signer, 3, _weights())
    manifest = pb.Manifest()
    manifest.CopyFrom(enc.manifest)
    _tamper(field)(manifest)
    with pytest.raises(SignatureRefused, match=r"version \d+ refused: its signature does not verify"):
        verifier.check_manifest(manifest)


def test_the_encoding_is_not_covered_so_relays_can_re_encode(signer: Signer, verifier: Verifier) -> None:
    # What a relay or the origin chooses (base, keyframe or delta, chunking, trace context)
    # is outside the signature; the decoded result is checked against the signed digest.
    manifest = pb.Manifest()
    manifest.CopyFrom(_signed(signer, 3, _weights()).manifest)
    manifest.base_version, manifest.codec = 1, "other"
    del manifest.chunks[1:]
    manifest.trace_context["traceparent"] = "y"
    verifier.check_manifest(manifest)


def test_a_manifest_re_signed_with_another_key_is_refused(keys: dict[str, Path], verifier: Verifier) -> None:
    attacker = Signer.load(keys["attacker-key"])
    enc = _signed(attacker, 3, _weights())
    with pytest.raises(SignatureRefused, match=f"signed by key {attacker.key_id[:16]}, not the trusted key {verifier.key_id[:16]}"):
        verifier.check_manifest(enc.manifest)
    # Claiming the trusted key's id does not help: the bytes still do not verify.
    enc.manifest.signature.key_id = verifier.key_id
    with pytest.raises(SignatureRefused, match="does not verify"):
        verifier.check_manifest(enc.manifest)


def test_an_unsigned_manifest_is_refused_when_a_key_is_configured(verifier: Verifier) -> None:
    enc = encode_version(3, _weights(), None, -1, CHUNK_BYTES)
    with pytest.raises(SignatureRefused, match="version 3 is unsigned"):
        verifier.check_manifest(enc.manifest)
    with pytest.raises(SignatureRefused, match="unsigned"):
        Decoder(None, -1, verifier=verifier).begin(enc.manifest)


def test_content_digest_sees_every_bit_and_the_layout() -> None:
    w = _weights()
    base = content_digest(w)
    flipped = _copy(w)
    flipped["head.fp32"].bits[7] ^= 1
    reshaped = dict(w, **{"layer.0.bias": RawTensor("bf16", (4, 10), w["layer.0.bias"].bits)})
    renamed = {("x" + n if n == "head.fp32" else n): t for n, t in w.items()}
    assert len({base, content_digest(flipped), content_digest(reshaped), content_digest(renamed)}) == 4
    assert content_digest(_copy(w)) == base


# ---------------------------------------------------------------- the decoder


def test_decoder_with_a_verifier_takes_signed_deltas_in_place(signer: Signer, verifier: Verifier) -> None:
    v0 = _weights()
    v1 = _step(v0, 1)
    decoder = Decoder(_copy(v0), 0, in_place=True, verifier=verifier)
    assert _apply(decoder, _signed(signer, 1, v1, v0, 0)) == 1
    assert all(np.array_equal(decoder.weights[n].bits, v1[n].bits) for n in v1)


def test_each_tensor_is_hashed_once_as_its_last_chunk_is_decoded(signer: Signer, verifier: Verifier, monkeypatch: pytest.MonkeyPatch) -> None:
    """The signed content check overlaps the version's arrival: a tensor is hashed by the
    decode that writes its last chunk (in whatever order chunks come), of its final bytes,
    and finish hashes nothing again."""
    hashed: list[bytes] = []
    real = signing.tensor_sha256

    def recording(t: RawTensor) -> bytes:
        hashed.append(t.bits.tobytes())
        return real(t)

    v0 = _weights()
    v1 = _step(v0, 1)
    enc = _signed(signer, 1, v1, v0, 0)
    monkeypatch.setattr(receiver, "tensor_sha256", recording)
    monkeypatch.setattr(signing, "tensor_sha256", recording)
    assert max(Counter(ref.tensor for ref in enc.manifest.chunks).values()) > 1  # several chunks per tensor
    decoder = Decoder(_copy(v0), 0, in_place=True, verifier=verifier)
    decoder.begin(enc.manifest)
    for i in reversed(range(len(enc.chunks))):
        decoder.add_chunk(i, enc.chunks[i])
    assert sorted(hashed) == sorted(t.bits.tobytes() for t in v1.values())
    assert decoder.finish() == 1 and len(hashed) == len(v1)


def test_an_older_signed_version_is_refused_as_a_replay(signer: Signer, verifier: Verifier) -> None:
    v0 = _weights()
    v1 = _step(v0, 1)
    v2 = _step(v1, 2)
    decoder = Decoder(_copy(v0), 0, in_place=True, verifier=verifier)
    _apply(decoder, _signed(signer, 1, v1, v0, 0))
    _apply(decoder, _signed(signer, 2, v2, v1, 1))
    for old in (_signed(signer, 1, v1), _signed(signer, 2, v2)):  # keyframes: no base to mismatch
        with pytest.raises(SignatureRefused, match="not newer than the held version 2"):
            decoder.begin(old.manifest)
    assert decoder.version == 2 and all(np.array_equal(decoder.weights[n].bits, v2[n].bits) for n in v2)


def _forged_with_the_signed_weights_hash(signer: Signer, v0: Weights) -> tuple[Encoded, Weights]:
    """A version whose weights are not the signed ones although their additive weights
    hash is: the trusted key signs (hash of the forged weights, digest of the real ones).
    Stands in for a forger who steered the additive element hash to a collision."""
    real, forged = _step(v0, 1), _step(v0, 2)
    signature = signer.sign(1, weights_hash(forged), real, CANARY)
    return encode_version(1, forged, v0, 0, CHUNK_BYTES, None, CANARY, signature), forged


def test_decoded_weights_other_than_the_signed_ones_are_refused_and_reverted(signer: Signer, verifier: Verifier) -> None:
    v0 = _weights()
    enc, forged = _forged_with_the_signed_weights_hash(signer, v0)
    verifier.check_manifest(enc.manifest)  # the manifest itself verifies
    held = _copy(v0)
    decoder = Decoder(held, 0, in_place=True, verifier=verifier)
    with pytest.raises(SignatureRefused, match="version 1 refused: its weights' content digest"):
        _apply(decoder, enc)
    assert decoder.version == 0
    assert all(np.array_equal(held[n].bits, v0[n].bits) for n in v0), "the refused version was left in the held buffers"
    # Without a verifier the same bytes pass the additive hash: that is what signing adds.
    assert _apply(Decoder(_copy(v0), 0), enc) == 1


def test_every_encoding_a_store_makes_carries_the_signature_and_verifies(tmp_path: Path, signer: Signer, verifier: Verifier) -> None:
    versions = [_weights()]
    for v in range(1, 4):
        versions.append(_step(versions[-1], v))
    store = VersionStore(tmp_path / "store", keep=8, chunk_bytes=CHUNK_BYTES, keyframe_every=2)
    for v, w in enumerate(versions):
        store.publish(v, w, weights_hash(w), {}, CANARY, signer.sign(v, weights_hash(w), w, CANARY))
    keyframe = store.keyframe_of_latest()
    (compacted,) = store.plan_compacted(1)  # a delta 1 -> 3 built for a late joiner
    assert compacted.manifest.base_version == 1 and keyframe.is_keyframe
    assert _apply(Decoder(None, -1, verifier=verifier), keyframe) == 3
    assert _apply(Decoder(_copy(versions[1]), 1, in_place=True, verifier=verifier), compacted) == 3
    # ... and so do the versions the store recovers from disk.
    again = VersionStore(tmp_path / "store", keep=8, chunk_bytes=CHUNK_BYTES, keyframe_every=2)
    decoder = Decoder(None, -1, verifier=verifier)
    for enc in again.plan(-1):
        _apply(decoder, enc)
    assert decoder.version == 3


# ---------------------------------------------------------------- meridian up


def test_meridian_up_passes_the_signing_flags_each_service_parses(tmp_path: Path) -> None:
    import argparse

    from meridian.config import add_config_args, config_from_args
    from meridian.stack import with_signing
    from services.rollout.config import RolloutConfig
    from services.trainer.config import TrainerConfig
    from services.weightsync.config import WeightSyncConfig

    args = with_signing(tmp_path, {"rollout": ["--verify-key", "mine.pem"], "envsandbox": ["--root", "x"]})
    assert args["envsandbox"] == ["--root", "x"]
    parsed = {}
    for service, cls in (("trainer", TrainerConfig), ("weightsync", WeightSyncConfig), ("rollout", RolloutConfig)):
        parser = argparse.ArgumentParser()
        add_config_args(parser, cls, service)
        parsed[service] = config_from_args(cls, parser.parse_args(args[service]), service)
    assert Signer.load(parsed["trainer"].signing_key).key_id == Verifier.load(parsed["weightsync"].verify_key).key_id
    assert parsed["rollout"].verify_key == "mine.pem"  # a flag the caller gives wins
