"""VersionStore, Decoder and raw tensors: bit-exact round trips, recovery and retention."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from meridian.errors import AlreadyExists, DataLoss, FailedPrecondition, InvalidArgument, NotFound
from services.weightsync.receiver import Decoder, decode_all
from services.weightsync import store as store_module
from services.weightsync.store import VersionStore
from services.weightsync.versions import Encoded, encode_version
from meridian.tensors import RawTensor, from_torch, to_torch, weights_hash

Weights = dict[str, RawTensor]
CHUNK_BYTES = 64  # tiny, so every tensor spans several chunks


def _bf16(rng: np.random.Generator, shape: tuple[int, ...]) -> RawTensor:
    # Bit patterns of ordinary bf16 values (sign, exponent near 1.0, random mantissa).
    numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
    values = rng.normal(0, 0.05, numel).astype(np.float32)
    bits = (values.view(np.uint32) >> 16).astype(np.uint16)
    return RawTensor("bf16", shape, bits)


def _initial(seed: int = 0) -> Weights:
    rng = np.random.default_rng(seed)
    return {
        "layer.0.weight": _bf16(rng, (16, 8)),
        "layer.0.bias": _bf16(rng, (33,)),
        "norm.scale": _bf16(rng, ()),  # a scalar
        "head.fp32": RawTensor("fp32", (5, 3), rng.normal(0, 1, 15).astype(np.float32).view(np.uint32)),
    }


def _step(weights: Weights, rng: np.random.Generator) -> Weights:
    """The next version: a few elements of every tensor nudged in their low bits."""
    out = {}
    for name, t in weights.items():
        bits = t.bits.copy()
        idx = rng.choice(bits.size, size=max(1, bits.size // 4), replace=False)
        bits[idx] ^= rng.integers(1, 8, idx.size).astype(bits.dtype)
        out[name] = RawTensor(t.dtype, t.shape, bits)
    return out


def _versions(n: int, seed: int = 0) -> list[Weights]:
    rng = np.random.default_rng(seed + 1)
    versions = [_initial(seed)]
    for _ in range(n - 1):
        versions.append(_step(versions[-1], rng))
    return versions


def _assert_same(a: Weights, b: Weights) -> None:
    assert set(a) == set(b)
    for name in a:
        assert (a[name].dtype, a[name].shape) == (b[name].dtype, b[name].shape), name
        assert np.array_equal(a[name].bits, b[name].bits), name
    assert weights_hash(a) == weights_hash(b)


def _store(path: Path, keep: int = 16, keyframe_every: int = 2) -> VersionStore:
    return VersionStore(path, keep=keep, chunk_bytes=CHUNK_BYTES, keyframe_every=keyframe_every)


@pytest.fixture
def versions() -> list[Weights]:
    return _versions(6)


@pytest.fixture
def filled(tmp_path: Path, versions: list[Weights]) -> VersionStore:
    """A store holding v0 (keyframe) and v1..v5 (deltas; keyframes also at v2 and v4)."""
    store = _store(tmp_path / "ws")
    for v, w in enumerate(versions):
        store.publish(v, w, expected_hash=weights_hash(w))
    return store


# ---------------------------------------------------------------- publishing and planning


def test_first_version_is_keyframe_then_deltas(filled: VersionStore) -> None:
    assert filled.latest == 5
    assert filled.versions() == [0, 1, 2, 3, 4, 5]
    assert filled.keyframes[0].is_keyframe and filled.keyframes[0].manifest.base_version == -1
    for v in range(1, 6):
        assert filled.deltas[v].manifest.base_version == v - 1
    # keyframe_every=2: a keyframe beside the delta of every even version.
    assert sorted(filled.keyframes) == [0, 2, 4]


def test_manifest_describes_the_version(filled: VersionStore, versions: list[Weights]) -> None:
    m = filled.manifest(3)
    assert m.version == 3 and m.base_version == 2
    assert m.weights_hash == weights_hash(versions[3])
    assert m.raw_bytes == sum(t.nbytes for t in versions[3].values())
    assert m.encoded_bytes == sum(c.size for c in m.chunks)
    assert [c.index for c in m.chunks] == list(range(len(m.chunks)))
    assert len(m.chunks) > len(versions[3])  # the small chunk size splits tensors
    assert filled.manifest(-1).version == 5
    with pytest.raises(NotFound):
        filled.manifest(17)


def test_a_version_sends_its_sparsest_tensors_first_and_decodes_the_same() -> None:
    """Decoding costs per element as well as per byte: the sparse delta of a large tensor
    is the most decoding per byte, so it travels first, while the dense one's bytes follow
    ("a.weight" sorts first by name and changes densely: its chunks go last)."""
    from services.weightsync import codec
    from services.weightsync.versions import stream_order
    from tests.synthetic_weights import bf16_weights, copied

    base = bf16_weights(0, 90_000)  # a.weight: 30,000 elements, b.weight: 60,000
    new = copied(base)
    new["a.weight"].bits[::3] += 1
    new["b.weight"].bits[::997] += 1
    enc = encode_version(1, new, base, 0, chunk_bytes=16_384)
    names = [ref.tensor for ref in enc.manifest.chunks]
    assert names == sorted(names, key=lambda n: n != "b.weight")  # b's chunks, then a's
    assert names.count("b.weight") > 1 and names.count("a.weight") > 1
    assert [t.name for t in enc.manifest.tensors] == ["a.weight", "b.weight"]
    for name in ("a.weight", "b.weight"):  # each tensor's chunks in order
        starts = [codec.parse_header(p).start for ref, p in zip(enc.manifest.chunks, enc.chunks) if ref.tensor == name]
        assert starts == sorted(starts)
    _assert_same(decode_all([enc], base, 0).weights, new)
    # Ties keep name order (a keyframe's tensors compress alike).
    assert stream_order({"b": 10, "a": 10}, {"b": 4, "a": 4}) == ["a", "b"]


def test_plan_for_holder_of_v2_is_the_delta_chain(filled: VersionStore, versions: list[Weights]) -> None:
    plan = filled.plan(2)
    assert [(e.manifest.version, e.manifest.base_version) for e in plan] == [(3, 2), (4, 3), (5, 4)]
    decoder = decode_all(plan, versions[2], 2)
    assert decoder.version == 5
    _assert_same(decoder.weights, versions[5])


def test_plan_for_newcomer_is_a_keyframe_of_latest(filled: VersionStore, versions: list[Weights]) -> None:
    (kf,) = filled.plan(-1)
    assert kf.is_keyframe and kf.manifest.version == 5
    decoder = decode_all([kf])
    assert decoder.version == 5
    _assert_same(decoder.weights, versions[5])
    assert kf.manifest.weights_hash == weights_hash(versions[5])


def test_plan_when_up_to_date_is_empty(filled: VersionStore) -> None:
    assert filled.plan(5) == []
    assert filled.plan(9) == []
    assert _store(filled.data_dir.parent / "empty").plan(-1) == []


def test_plan_prefers_keyframe_when_smaller_than_chain(tmp_path: Path) -> None:
    # Every version rewrites every element at random: deltas are as large as keyframes,
    # so from v0 a keyframe of v2 (held, keyframe_every=2) is cheaper than two deltas.
    rng = np.random.default_rng(3)
    store = _store(tmp_path, keyframe_every=2)
    ws = [{"t": RawTensor("bf16", (256,), rng.integers(0, 2**16, 256, dtype=np.uint16))} for _ in range(3)]
    for v, w in enumerate(ws):
        store.publish(v, w)
    (only,) = store.plan(0)
    assert only.is_keyframe and only.manifest.version == 2
    _assert_same(decode_all([only]).weights, ws[2])


def test_republishing_a_held_version_is_accepted_only_with_identical_weights(filled: VersionStore, versions: list[Weights]) -> None:
    # A trainer replaying from its checkpoint publishes the same bytes again: accepted, nothing changes.
    stored = filled.stored_bytes()
    for v in (5, 3):
        held = filled.manifest(v)
        assert filled.publish(v, versions[v]).manifest == held
    assert (filled.latest, filled.stored_bytes()) == (5, stored)
    # Different weights under a held version are refused, and nothing changes.
    with pytest.raises(AlreadyExists, match="version 3 is held with weights hash"):
        filled.publish(3, versions[5])
    with pytest.raises(AlreadyExists):
        filled.publish(5, versions[4])
    # A version older than anything held cannot be checked.
    with pytest.raises(FailedPrecondition, match="no longer held"):
        filled.publish(-1, versions[0])
    assert filled.latest == 5
    _assert_same(filled.weights, versions[5])


def test_empty_version_is_invalid(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument):
        _store(tmp_path).publish(0, {})


def test_changed_tensor_set_is_invalid(filled: VersionStore, versions: list[Weights]) -> None:
    fewer = dict(versions[5])
    del fewer["layer.0.bias"]
    with pytest.raises(InvalidArgument, match="tensor set"):
        filled.publish(6, fewer)
    renamed = dict(versions[5])
    renamed["new.name"] = renamed.pop("layer.0.bias")
    with pytest.raises(InvalidArgument, match="tensor set"):
        filled.publish(6, renamed)
    assert filled.latest == 5


def test_changed_shape_or_dtype_is_invalid(filled: VersionStore, versions: list[Weights]) -> None:
    reshaped = dict(versions[5])
    reshaped["layer.0.weight"] = RawTensor("bf16", (8, 16), versions[5]["layer.0.weight"].bits)
    with pytest.raises(InvalidArgument):
        filled.publish(6, reshaped)
    retyped = dict(versions[5])
    retyped["layer.0.bias"] = RawTensor("fp16", (33,), versions[5]["layer.0.bias"].bits)
    with pytest.raises(InvalidArgument):
        filled.publish(6, retyped)
    assert filled.latest == 5


def test_wrong_expected_hash_is_data_loss_and_stores_nothing(filled: VersionStore, versions: list[Weights]) -> None:
    nxt = _step(versions[5], np.random.default_rng(9))
    with pytest.raises(DataLoss):
        filled.publish(6, nxt, expected_hash=weights_hash(versions[5]))
    assert filled.latest == 5 and 6 not in filled.versions()
    assert not (filled.data_dir / f"{6:010d}").exists()
    # The right hash is accepted afterwards.
    filled.publish(6, nxt, expected_hash=weights_hash(nxt))
    assert filled.latest == 6


def test_trace_context_is_kept_in_manifest(tmp_path: Path, versions: list[Weights]) -> None:
    store = _store(tmp_path)
    store.publish(0, versions[0], trace_context={"traceparent": "00-aa-bb-01"})
    assert dict(store.manifest(0).trace_context) == {"traceparent": "00-aa-bb-01"}


# ---------------------------------------------------------------- disk: recovery and retention


def test_new_store_recovers_latest_from_disk(filled: VersionStore, versions: list[Weights]) -> None:
    again = _store(filled.data_dir)
    assert again.latest == 5
    _assert_same(again.weights, versions[5])
    # Recovery starts from the newest keyframe (v4) and applies the delta after it.
    assert max(again.keyframes) == 4
    # The recovered store keeps serving deltas and accepts the next version.
    decoder = decode_all(again.plan(3), versions[3], 3)
    _assert_same(decoder.weights, versions[5])
    nxt = _step(versions[5], np.random.default_rng(11))
    again.publish(6, nxt)
    _assert_same(decode_all(again.plan(5), versions[5], 5).weights, nxt)


def test_recovery_ignores_incomplete_version(filled: VersionStore, versions: list[Weights]) -> None:
    # A crash mid-write leaves a folder without COMPLETE: it must not count.
    torn = filled.data_dir / f"{6:010d}" / "delta"
    torn.mkdir(parents=True)
    (torn / "manifest.pb").write_bytes(b"garbage")
    again = _store(filled.data_dir)
    assert again.latest == 5
    _assert_same(again.weights, versions[5])


def test_recovery_from_keyframe_plus_long_delta_chain(tmp_path: Path, versions: list[Weights]) -> None:
    store = _store(tmp_path, keep=2, keyframe_every=100)
    for v, w in enumerate(versions):
        store.publish(v, w)
    # Only v0 is a keyframe, so retention must keep every delta recovery needs.
    again = _store(tmp_path, keep=2, keyframe_every=100)
    assert again.latest == 5
    _assert_same(again.weights, versions[5])


def test_retention_deletes_old_versions_but_still_recovers(tmp_path: Path, versions: list[Weights]) -> None:
    store = _store(tmp_path, keep=2, keyframe_every=2)
    for v, w in enumerate(versions):
        store.publish(v, w)
    dirs = sorted(p.name for p in tmp_path.iterdir())
    assert dirs == [f"{4:010d}", f"{5:010d}"]
    assert store.versions() == [4, 5]
    # A holder of a version that is gone gets a keyframe of the latest.
    (kf,) = store.plan(1)
    assert kf.is_keyframe and kf.manifest.version == 5
    _assert_same(decode_all([kf]).weights, versions[5])
    # A holder of v4 still gets the one delta.
    assert [e.manifest.version for e in store.plan(4)] == [5]
    again = _store(tmp_path, keep=2, keyframe_every=2)
    assert again.latest == 5
    _assert_same(again.weights, versions[5])


def test_stored_bytes_counts_everything_held(filled: VersionStore) -> None:
    held = [*filled.deltas.values(), *filled.keyframes.values()]
    assert filled.stored_bytes() == sum(e.size for e in held) > 0


# ---------------------------------------------------------------- Decoder


def _delta(versions: list[Weights], v: int) -> Encoded:
    return encode_version(v, versions[v], versions[v - 1], v - 1, CHUNK_BYTES)


def test_decoder_applies_chunks_in_any_order(versions: list[Weights]) -> None:
    enc = _delta(versions, 1)
    decoder = Decoder(versions[0], 0)
    decoder.begin(enc.manifest)
    for i in reversed(range(len(enc.chunks))):
        decoder.add_chunk(i, enc.chunks[i])
    assert decoder.finish() == 1
    _assert_same(decoder.weights, versions[1])


def test_decoder_corrupted_chunk_is_data_loss(versions: list[Weights]) -> None:
    enc = _delta(versions, 1)
    decoder = Decoder(versions[0], 0)
    decoder.begin(enc.manifest)
    bad = bytearray(enc.chunks[0])
    bad[len(bad) // 2] ^= 0xFF
    with pytest.raises(DataLoss, match="checksum"):
        decoder.add_chunk(0, bytes(bad))
    with pytest.raises(DataLoss):
        decoder.add_chunk(0, enc.chunks[0] + b"\x00")  # wrong size
    # The held version is untouched.
    assert decoder.version == 0
    _assert_same(decoder.weights, versions[0])


def test_decoder_chunk_before_manifest_is_failed_precondition(versions: list[Weights]) -> None:
    enc = _delta(versions, 1)
    decoder = Decoder(versions[0], 0)
    with pytest.raises(FailedPrecondition):
        decoder.add_chunk(0, enc.chunks[0])
    with pytest.raises(FailedPrecondition):
        decoder.finish()


def test_decoder_delta_on_wrong_base_is_failed_precondition(versions: list[Weights]) -> None:
    decoder = Decoder(versions[1], 1)
    with pytest.raises(FailedPrecondition):
        decoder.begin(_delta(versions, 3).manifest)  # based on 2, holder has 1
    with pytest.raises(FailedPrecondition):
        Decoder(None, -1).begin(_delta(versions, 1).manifest)  # holder has nothing


def test_decoder_missing_chunk_at_finish_is_data_loss(versions: list[Weights]) -> None:
    enc = _delta(versions, 1)
    assert len(enc.chunks) > 1
    decoder = Decoder(versions[0], 0)
    decoder.begin(enc.manifest)
    for i in range(len(enc.chunks) - 1):
        decoder.add_chunk(i, enc.chunks[i])
    with pytest.raises(DataLoss, match="missing"):
        decoder.finish()
    assert decoder.version == 0


def test_decoder_chunk_index_out_of_range_is_invalid(versions: list[Weights]) -> None:
    enc = _delta(versions, 1)
    decoder = Decoder(versions[0], 0)
    decoder.begin(enc.manifest)
    with pytest.raises(InvalidArgument):
        decoder.add_chunk(len(enc.chunks), enc.chunks[0])
    with pytest.raises(InvalidArgument):
        decoder.add_chunk(-1, enc.chunks[0])


def test_decoder_hash_mismatch_at_finish_is_data_loss(versions: list[Weights]) -> None:
    # Chunks that check out individually but a manifest hash that does not.
    enc = encode_version(0, versions[0], None, -1, CHUNK_BYTES)
    enc.manifest.weights_hash = weights_hash(versions[1])
    with pytest.raises(DataLoss, match="hash"):
        decode_all([enc])


def test_decoder_keyframe_replaces_whatever_is_held(versions: list[Weights]) -> None:
    kf = encode_version(4, versions[4], None, -1, CHUNK_BYTES)
    decoder = decode_all([kf], versions[1], 1)
    assert decoder.version == 4
    _assert_same(decoder.weights, versions[4])


# ---------------------------------------------------------------- raw tensors


def test_raw_tensor_validates_bits() -> None:
    with pytest.raises(ValueError):
        RawTensor("bf16", (4,), np.zeros(4, dtype=np.uint32))  # wrong bit width
    with pytest.raises(ValueError):
        RawTensor("bf16", (2, 2), np.zeros((2, 2), dtype=np.uint16))  # not 1-D
    with pytest.raises(ValueError):
        RawTensor("fp32", (3,), np.zeros(4, dtype=np.uint32))  # wrong count
    with pytest.raises(ValueError):
        RawTensor("int8", (1,), np.zeros(1, dtype=np.uint8))  # unsupported dtype
    assert RawTensor("fp16", (), np.zeros(1, dtype=np.uint16)).nbytes == 2


def test_raw_tensor_rejects_shape_whose_element_count_overflows() -> None:
    with pytest.raises(ValueError):
        RawTensor("bf16", (2**32, 2**32), np.zeros(0, dtype=np.uint16))


def test_zero_element_tensor_round_trips(tmp_path: Path) -> None:
    empty = RawTensor("bf16", (0, 3), np.zeros(0, dtype=np.uint16))
    w0 = {"empty": empty, "x": RawTensor("bf16", (2,), np.array([1, 2], dtype=np.uint16))}
    w1 = {"empty": empty, "x": RawTensor("bf16", (2,), np.array([1, 3], dtype=np.uint16))}
    store = _store(tmp_path)
    store.publish(0, w0)
    store.publish(1, w1)
    _assert_same(decode_all(store.plan(0), w0, 0).weights, w1)
    _assert_same(decode_all(store.plan(-1)).weights, w1)
    _assert_same(_store(tmp_path).weights, w1)


def test_weights_hash_covers_name_dtype_shape_and_bits() -> None:
    bits = np.arange(6, dtype=np.uint16)
    base = {"a": RawTensor("bf16", (2, 3), bits)}
    h = weights_hash(base)
    assert weights_hash({"a": RawTensor("bf16", (2, 3), bits.copy())}) == h
    assert weights_hash({"b": RawTensor("bf16", (2, 3), bits)}) != h
    assert weights_hash({"a": RawTensor("fp16", (2, 3), bits)}) != h
    assert weights_hash({"a": RawTensor("bf16", (3, 2), bits)}) != h
    flipped = bits.copy()
    flipped[5] ^= 1
    assert weights_hash({"a": RawTensor("bf16", (2, 3), flipped)}) != h


def test_weights_hash_ignores_insertion_order() -> None:
    x = RawTensor("bf16", (1,), np.array([1], dtype=np.uint16))
    y = RawTensor("bf16", (1,), np.array([2], dtype=np.uint16))
    assert weights_hash({"x": x, "y": y}) == weights_hash({"y": y, "x": x})


def test_weights_hash_separates_names_from_shapes() -> None:
    # The NUL separators keep ("a1", shape (2,)) and ("a", shape (12,)) apart.
    two = RawTensor("bf16", (2,), np.zeros(2, dtype=np.uint16))
    twelve = RawTensor("bf16", (12,), np.zeros(12, dtype=np.uint16))
    assert weights_hash({"a1": two}) != weights_hash({"a": twelve})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_torch_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    tensor = torch.randn(3, 5, generator=gen).to(dtype)
    tensor[0, 0] = float("nan")
    tensor[0, 1] = float("-inf")
    tensor[0, 2] = -0.0
    raw = from_torch(tensor)
    assert raw.shape == (3, 5) and raw.bits.ndim == 1
    back = to_torch(raw)
    assert back.dtype == dtype and back.shape == tensor.shape
    int_view = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[dtype]
    assert torch.equal(back.view(int_view), tensor.view(int_view))


def test_from_torch_bf16_bits_are_the_top_half_of_fp32() -> None:
    raw = from_torch(torch.tensor([1.0, -2.0], dtype=torch.bfloat16))
    assert raw.dtype == "bf16"
    assert raw.bits.tolist() == [0x3F80, 0xC000]


def test_from_torch_handles_non_contiguous_and_rejects_other_dtypes() -> None:
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3).t()
    assert not t.is_contiguous()
    raw = from_torch(t)
    assert torch.equal(to_torch(raw), t)
    with pytest.raises(ValueError):
        from_torch(torch.zeros(2, dtype=torch.int32))


# ---------------------------------------------------------------- late joiners: compaction


def _sparse_versions(n: int) -> list[Weights]:
    """Versions where each step moves 1 % of elements by one grid step (Adam-like)."""
    rng = np.random.default_rng(5)
    versions = [{"w": _bf16(rng, (4000,)), "b": _bf16(rng, (64,))}]
    for _ in range(n - 1):
        out = {}
        for name, t in versions[-1].items():
            bits = t.bits.copy()
            idx = rng.choice(bits.size, size=max(1, bits.size // 100), replace=False)
            bits[idx] += 1
            out[name] = RawTensor(t.dtype, t.shape, bits)
        versions.append(out)
    return versions


def test_plan_compacted_sends_one_delta_when_smaller(tmp_path: Path) -> None:
    versions = _sparse_versions(6)
    store = VersionStore(tmp_path, chunk_bytes=1024, keyframe_every=100)
    for v, w in enumerate(versions):
        store.publish(v, w)
    chain = store.plan(1)
    (compacted,) = store.plan_compacted(1)
    assert (compacted.manifest.version, compacted.manifest.base_version) == (5, 1)
    assert compacted.size < sum(e.size for e in chain)
    _assert_same(decode_all([compacted], versions[1], 1).weights, versions[5])
    # Built once, then served from the cache; find() locates it for resumes and re-fetches.
    assert store.plan_compacted(1)[0] is compacted and store.compacted_built == 1
    assert store.find(5, 1) is compacted
    assert store.find(5, 4) is store.deltas[5] and store.find(5, 3) is None
    # One link behind: the plain delta; nothing held: a keyframe; up to date: nothing.
    assert [e.manifest.base_version for e in store.plan_compacted(4)] == [4]
    assert store.plan_compacted(-1)[0].is_keyframe
    assert store.plan_compacted(5) == []
    # A new version makes the cached compacted delta useless.
    nxt = _sparse_versions(7)[6]
    store.publish(6, nxt)
    assert store.compacted == {}


def test_weights_at_rebuilds_held_versions(tmp_path: Path) -> None:
    versions = _sparse_versions(5)
    store = VersionStore(tmp_path, chunk_bytes=1024, keyframe_every=2, keep=3)
    for v, w in enumerate(versions):
        store.publish(v, w)
    assert store.versions() == [2, 3, 4]
    for v in store.versions():
        rebuilt = store.weights_at(v)
        assert rebuilt is not None
        _assert_same(rebuilt, versions[v])
    assert store.weights_at(1) is None  # dropped by retention


def test_token_bucket_paces_to_its_rate() -> None:
    import asyncio
    import time as _time

    from services.weightsync.ratelimit import TokenBucket

    async def main() -> float:
        bucket = TokenBucket(rate=1_000_000, burst=10_000)
        start = _time.monotonic()
        for _ in range(20):
            await bucket.take(10_000)
        return _time.monotonic() - start

    # 200 kB at 1 MB/s with a 10 kB burst needs at least 0.19 s (a lower bound only).
    assert asyncio.run(main()) >= 0.5 * 0.19
    assert not TokenBucket(0).enabled


def test_token_bucket_saves_no_more_than_its_burst_while_idle() -> None:
    """Idle time refills the bucket only up to its burst: a link quiet between versions
    must not send the next version uncapped on tokens saved up meanwhile."""
    import asyncio
    import time as _time

    from services.weightsync.ratelimit import TokenBucket

    async def main() -> float:
        bucket = TokenBucket(rate=1_000_000, burst=10_000)
        await bucket.take(10_000)
        await asyncio.sleep(0.4)  # idle: 400 kB worth of time at the rate
        start = _time.monotonic()
        for _ in range(20):
            await bucket.take(10_000)
        return _time.monotonic() - start

    # After the idle time the bucket holds its 10 kB burst, no more: 200 kB still need
    # at least 0.19 s (a lower bound only).
    assert asyncio.run(main()) >= 0.5 * 0.19


def test_config_rejects_bad_caps() -> None:
    from services.weightsync.config import WeightSyncConfig

    with pytest.raises(ValueError):
        WeightSyncConfig(send_mib_s=-1)
    with pytest.raises(ValueError):
        WeightSyncConfig(keyframe_every=0)


def test_publish_fsyncs_every_file_and_folder_entry_of_the_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before publish returns, each file of the version, the folder they were written in,
    the folder holding the rename and the data folder holding the version's folder are
    fsynced, in an order where nothing is synced before what it names: removing any one
    fsync (or reordering the rename) fails this test."""
    import os

    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    data_dir = (tmp_path / "ws").resolve()
    store = VersionStore(data_dir, chunk_bytes=CHUNK_BYTES, keyframe_every=1000)
    monkeypatch.setattr(os, "fsync", recording_fsync)
    v0, v1 = _versions(2)
    store.publish(0, v0)
    store.publish(1, v1)
    expected = []
    for version, kind in ((0, "keyframe"), (1, "delta")):
        tmp = data_dir / f"{version:010d}" / f"{kind}.tmp"
        expected += [str(tmp / "manifest.pb"), str(tmp / "chunks.bin"), str(tmp / "COMPLETE"), str(tmp), str(tmp.parent), str(data_dir)]
    assert synced == expected


def test_a_relay_store_never_encodes_from_buffers_holding_half_a_version(tmp_path: Path) -> None:
    """A relay applies versions in place to the buffers its store holds as the latest; a
    late joiner's compacted delta or keyframe built while the next version is half
    applied must still be the latest version, not the mix in the buffers."""
    versions = _sparse_versions(7)
    origin = VersionStore(tmp_path / "origin", chunk_bytes=1024, keyframe_every=100)
    relay = VersionStore(tmp_path / "relay", chunk_bytes=1024, keyframe_every=100, live_weights=True)
    decoder = Decoder(None, -1, in_place=True)
    for v in range(6):
        enc = origin.publish(v, versions[v])
        decoder.begin(enc.manifest)
        for i, payload in enumerate(enc.chunks):
            decoder.add_chunk(i, payload)
        decoder.finish()
        relay.add_encoded(enc, decoder.weights)
    nxt = origin.publish(6, versions[6])
    decoder.begin(nxt.manifest)
    for i in range(len(nxt.chunks) // 2):
        decoder.add_chunk(i, nxt.chunks[i])
    assert not all(np.array_equal(relay.weights[n].bits, versions[5][n].bits) for n in versions[5])  # half applied
    (compacted,) = relay.plan_compacted(1)
    assert compacted.manifest.base_version == 1
    _assert_same(decode_all([compacted], versions[1], 1).weights, versions[5])
    _assert_same(decode_all([relay.keyframe_of_latest()]).weights, versions[5])
    decoder.abort()
    _assert_same(relay.weights, versions[5])


# ---------------------------------------------------------------- a failed add leaves no trace


def _version_dirs(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.glob("*/*"))


def test_a_failed_keyframe_step_leaves_no_trace_of_the_version(tmp_path: Path, versions: list[Weights], monkeypatch: pytest.MonkeyPatch) -> None:
    store = _store(tmp_path)  # keyframe_every=2: v2 gets a keyframe beside its delta
    store.publish(0, versions[0])
    store.publish(1, versions[1])
    before = _version_dirs(tmp_path)
    real = store_module.encode_version

    def no_keyframe(version: int, weights: Weights, base: Weights | None, *args: object, **kw: object) -> Encoded:
        if base is None:
            raise OSError(28, "No space left on device")  # the keyframe step fails
        return real(version, weights, base, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(store_module, "encode_version", no_keyframe)
    with pytest.raises(OSError):
        store.publish(2, versions[2])
    # Nothing of v2, on disk or in memory: it was never acknowledged.
    assert store.latest == 1 and store.versions() == [0, 1]
    assert _version_dirs(tmp_path) == before
    assert _store(tmp_path).latest == 1
    monkeypatch.undo()
    # The trainer publishes v2 again, with other weights (it did not replay deterministically).
    other = _step(versions[1], np.random.default_rng(99))
    store.publish(2, other)
    _assert_same(_store(tmp_path).weights, other)


def _store_with_v2_planted(tmp_path: Path, versions: list[Weights]) -> tuple[VersionStore, Path]:
    """A store holding v0 and v1, and v2's complete folder from another store copied in
    (as a failed add or a crash leaves one, never acknowledged): (store, that folder)."""
    elsewhere = _store(tmp_path / "elsewhere")
    for v in range(3):
        elsewhere.publish(v, versions[v])
    store = _store(tmp_path / "ws")
    store.publish(0, versions[0])
    store.publish(1, versions[1])
    planted = store.data_dir / f"{2:010d}"
    shutil.copytree(elsewhere.data_dir / f"{2:010d}", planted)
    return store, planted


def test_a_complete_folder_of_other_bytes_is_rewritten_not_kept(tmp_path: Path, versions: list[Weights]) -> None:
    store, _ = _store_with_v2_planted(tmp_path, versions)  # the trainer's v2 is another
    other = _step(versions[1], np.random.default_rng(99))
    store.publish(2, other)
    again = _store(tmp_path / "ws")
    assert again.latest == 2
    _assert_same(again.weights, other)


def test_a_complete_folder_with_the_same_manifest_but_short_chunks_is_rewritten(tmp_path: Path, versions: list[Weights]) -> None:
    """A folder is kept as the version only when its chunks file has every byte its
    manifest lists: one with the very manifest but a chunks file cut short (a damaged
    disk) is rewritten by the publish, and a restart recovers the version bit-exact."""
    store, planted = _store_with_v2_planted(tmp_path, versions)
    chunks = planted / "delta" / "chunks.bin"
    whole = chunks.read_bytes()
    chunks.write_bytes(whole[: len(whole) // 2])
    store.publish(2, versions[2])
    assert chunks.read_bytes() == whole
    again = _store(tmp_path / "ws")
    assert again.latest == 2
    _assert_same(again.weights, versions[2])


def test_recovery_removes_a_complete_folder_that_was_never_renamed_into_place(tmp_path: Path, versions: list[Weights]) -> None:
    elsewhere = _store(tmp_path / "elsewhere", keyframe_every=100)
    for v in range(3):
        elsewhere.publish(v, versions[v])
    store = _store(tmp_path / "ws", keyframe_every=100)
    store.publish(0, versions[0])
    store.publish(1, versions[1])
    # A crash after v2's files were written and synced, before the rename.
    planted = store.data_dir / f"{2:010d}" / "delta.tmp"
    shutil.copytree(elsewhere.data_dir / f"{2:010d}" / "delta", planted)
    assert (planted / "COMPLETE").exists()
    again = _store(tmp_path / "ws", keyframe_every=100)
    assert again.latest == 1 and again.versions() == [0, 1]
    _assert_same(again.weights, versions[1])
    assert not planted.exists()
