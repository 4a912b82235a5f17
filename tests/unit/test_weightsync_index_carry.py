"""The service's chunk format: deltas coded over position indexes (codec format 3) that the
origin's store and every decoder keep current from version to version, so neither pays a
pass over the model per version. A pass shows up as a call of ``codec.build_index``: the
tests count them, which is what fails when an index is dropped, left stale or not restored.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from meridian.errors import DataLoss
from meridian import elementhash
from meridian.tensors import RawTensor, weights_hash
from services.weightsync import codec
from services.weightsync.receiver import Decoder
from services.weightsync.store import VersionStore
from services.weightsync.versions import CHUNK_FORMAT, Encoded, encode_version
from tests.unit.test_weightsync_inplace import _apply, _copy, _same

Weights = dict[str, RawTensor]
CHUNK_BYTES = 8 << 10  # 4096 bf16 elements per chunk: several chunks per tensor


def _bf16(rng: np.random.Generator, n: int) -> np.ndarray:
    return (rng.normal(0, 0.02, n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _versions(count: int, seed: int = 0) -> list[Weights]:
    """bf16 versions where each step moves a few percent of the elements by one or two
    units in the last place (an optimizer step's shape), the small ones included, and a
    few of them across exponents; ``norm`` stays as it is every other version."""
    rng = np.random.default_rng(seed)
    first = {"emb": _bf16(rng, 20_000), "layer.w": _bf16(rng, 12_288), "norm": _bf16(rng, 4000)}
    out = [first]
    for v in range(1, count):
        nxt = {}
        for name, bits in out[-1].items():
            if name == "norm" and v % 2 == 0:
                nxt[name] = bits  # unchanged: its chunk goes out in format 1, the smaller then
                continue
            bits = bits.copy()
            idx = rng.choice(bits.size, size=max(1, bits.size // 25), replace=False)
            step = rng.choice([-2, -1, 1, 2], idx.size)
            # A tenth move by a power of two (an exponent step): small elements cross the
            # index threshold, so indexes change from version to version.
            step[rng.random(idx.size) < 0.1] *= 128
            bits[idx] = (bits[idx].astype(np.int32) + step).astype(np.uint16)
            nxt[name] = bits
        out.append(nxt)
    return [{n: RawTensor("bf16", (b.size,), b) for n, b in v.items()} for v in out]


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts passes that build a position index (``codec.build_index`` calls); the
    chunks built (tensor size, start) go to :data:`BUILT`."""
    count = [0]
    real = codec.build_index
    BUILT.clear()

    def counting(values, dtype, start, count_, *args, **kwargs):
        count[0] += 1
        BUILT.append((values.shape[0], start))
        return real(values, dtype, start, count_, *args, **kwargs)

    monkeypatch.setattr(codec, "build_index", counting)
    yield count


BUILT: list[tuple[int, int]] = []


def _delta_chunks(enc: Encoded) -> list[codec.ChunkHeader]:
    headers = [codec.parse_header(p) for p in enc.chunks]
    return [h for h in headers if h.mode == codec.MODE_DELTA]


def test_the_origin_codes_each_delta_over_the_indexes_the_last_one_left(tmp_path: Path, builds: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    versions = _versions(5)
    store = VersionStore(tmp_path, chunk_bytes=CHUNK_BYTES)
    expected = [weights_hash(w) for w in versions]
    hashed: list[int] = []  # tensors whose element-hash sums were computed in full
    real_sums = elementhash.many_tensor_sums
    monkeypatch.setattr(elementhash, "many_tensor_sums", lambda arrays: hashed.append(len(arrays)) or real_sums(arrays))
    store.publish(0, versions[0])
    assert builds[0] == 0  # a keyframe needs no index
    store.publish(1, versions[1])
    assert hashed == [3, 0]  # the keyframe's sums in full; version 1's moved by its changes
    chunks = len(store.deltas[1].chunks)
    assert builds[0] == chunks  # the first delta builds each chunk's index once
    for v in range(2, 5):
        enc = store.publish(v, versions[v], expected_hash=expected[v])  # the moved sums are right
        assert builds[0] == chunks and sum(hashed) == 3  # later deltas: no pass over the model
        formats = {h.version for h in _delta_chunks(enc)}
        assert formats == ({CHUNK_FORMAT, 1} if v % 2 == 0 else {CHUNK_FORMAT})
        # Coded over an index (the payload names one: a receiver without it builds it).
        assert any(codec.ensure_index(p, versions[v - 1][store.deltas[v].manifest.chunks[i].tensor].bits, None) is not None
                   for i, p in enumerate(enc.chunks))
        builds[0] = chunks
    assert store.deltas[4].carried.indexes == {}  # only the latest's indexes are kept, by the store
    for name, held in store.carried.indexes.items():
        for index in held:
            rebuilt = codec.build_index(versions[4][name].bits, "bf16", index.start, index.count, index.threshold)
            assert np.array_equal(rebuilt.positions, index.positions) and rebuilt.fingerprint == index.fingerprint


def test_an_origin_prepares_the_next_delta_after_a_keyframe_and_encodes_the_same(tmp_path: Path, builds: list[int]) -> None:
    """What an origin builds while it waits after a keyframe (VersionStore.prepare_next)
    spares the next publish its index builds, and that publish stores the very bytes a
    store that built them itself stores."""
    versions = _versions(3, seed=5)
    ahead = VersionStore(tmp_path / "ahead", chunk_bytes=CHUNK_BYTES)
    plain = VersionStore(tmp_path / "plain", chunk_bytes=CHUNK_BYTES)
    for store in (ahead, plain):
        store.publish(0, versions[0])
    assert ahead.prepare_next() and not ahead.prepare_next()  # built once
    builds[0] = 0
    first = ahead.publish(1, versions[1])
    assert builds[0] == 0, "the publish after prepare_next built indexes"
    assert first.chunks == plain.publish(1, versions[1]).chunks
    assert first.manifest.weights_hash == plain.deltas[1].manifest.weights_hash
    assert not ahead.prepare_next()  # a delta leaves its indexes carried: nothing to build
    assert ahead.publish(2, versions[2]).chunks == plain.publish(2, versions[2]).chunks


def test_a_follower_builds_its_indexes_once_and_stays_exact(tmp_path: Path, builds: list[int]) -> None:
    versions = _versions(6, seed=1)
    encs = [encode_version(0, versions[0], None, -1, CHUNK_BYTES)]
    carried = None
    for v in range(1, 6):
        enc = encode_version(v, versions[v], versions[v - 1], v - 1, CHUNK_BYTES, carried=carried)
        carried = enc.carried
        encs.append(enc)
    decoder = Decoder(_copy(versions[1]), 1, in_place=True)
    BUILT.clear()
    _apply(decoder, encs[2])
    assert BUILT  # built from the held weights at the first delta that needs them
    for v in range(3, 6):
        _apply(decoder, encs[v])
        assert _same(decoder.weights, versions[v])
    # Then kept current from the decoded changes: never a chunk's index built twice.
    assert len(BUILT) == len(set(BUILT))


def test_indexes_built_after_a_keyframe_serve_the_first_delta(builds: list[int]) -> None:
    """What a subscriber does while it waits for the next version: after a keyframe, every
    chunk is unindexed; building them from the held weights (the origin's threshold rule on
    the same values) leaves the first delta nothing to build, and it stays exact."""
    versions = _versions(2, seed=3)
    keyframe = encode_version(0, versions[0], None, -1, CHUNK_BYTES)
    delta = encode_version(1, versions[1], versions[0], 0, CHUNK_BYTES)
    decoder = Decoder(None, -1, in_place=True)
    _apply(decoder, keyframe)
    chunks = decoder.unindexed()
    assert len(chunks) == len(keyframe.chunks)
    decoder.build_indexes(chunks[: len(chunks) // 2])
    decoder.build_indexes(chunks[len(chunks) // 2 :])  # as two decode threads split them
    assert decoder.unindexed() == []
    builds[0] = 0
    _apply(decoder, delta)
    assert builds[0] == 0 and _same(decoder.weights, versions[1])
    assert decoder.unindexed() == []  # a delta leaves the indexes of its own chunks


def test_handed_weights_are_indexed_in_the_origins_chunking(builds: list[int]) -> None:
    """Weights handed to a decoder (a restarted follower) listed in the chunks an origin of
    that chunk size cuts them into, built, serve the first delta with no build. In another
    chunking they do not: the delta builds its own, and its format-1 chunks, which need
    none, decode without the index of another chunk (once a DataLoss: "position index is
    for chunk [0, 2048), not [0, 4096)"); still exact."""
    versions = _versions(2, seed=4)
    delta = encode_version(1, versions[1], versions[0], 0, CHUNK_BYTES)
    starts = {(codec.parse_header(p).start, codec.parse_header(p).count) for p in delta.chunks}
    for chunk_bytes, first_delta_builds in ((CHUNK_BYTES, False), (CHUNK_BYTES // 2, True)):
        decoder = Decoder(_copy(versions[0]), 0, in_place=True)
        chunks = decoder.unindexed(chunk_bytes)
        assert ({(s, c) for _, s, c in chunks} == starts) is not first_delta_builds
        decoder.build_indexes(chunks)
        assert decoder.unindexed(chunk_bytes) == []
        builds[0] = 0
        _apply(decoder, delta)
        assert (builds[0] > 0) is first_delta_builds and _same(decoder.weights, versions[1])


def test_revert_and_abort_give_back_the_indexes_of_the_held_version(builds: list[int]) -> None:
    versions = _versions(4, seed=2)
    e1 = encode_version(1, versions[1], versions[0], 0, CHUNK_BYTES)
    e2 = encode_version(2, versions[2], versions[1], 1, CHUNK_BYTES, carried=e1.carried)
    e3 = encode_version(3, versions[3], versions[2], 2, CHUNK_BYTES, carried=e2.carried)
    BUILT.clear()  # the encoder's own
    decoder = Decoder(_copy(versions[0]), 0, in_place=True)
    _apply(decoder, e1)
    _apply(decoder, e2)
    assert decoder.revert_last() == 1 and _same(decoder.weights, versions[1])
    _apply(decoder, e2)  # over the restored indexes of version 1
    decoder.begin(e3.manifest)
    for i in range(len(e3.chunks) // 2):
        decoder.add_chunk(i, e3.chunks[i])
    decoder.abort()
    assert _same(decoder.weights, versions[2])
    _apply(decoder, e3)
    assert _same(decoder.weights, versions[3])
    assert BUILT and len(BUILT) == len(set(BUILT))  # each chunk's index built once, then carried


def test_a_restarted_origin_rebuilds_and_its_followers_still_decode(tmp_path: Path) -> None:
    versions = _versions(5, seed=3)
    store = VersionStore(tmp_path, chunk_bytes=CHUNK_BYTES, keyframe_every=2)
    decoder = Decoder(None, -1, in_place=True)
    for v in range(3):
        _apply(decoder, store.publish(v, versions[v]))
    restarted = VersionStore(tmp_path, chunk_bytes=CHUNK_BYTES, keyframe_every=2)
    assert restarted.latest == 2 and restarted.carried.indexes == {}
    for v in (3, 4):
        _apply(decoder, restarted.publish(v, versions[v]))
        assert _same(decoder.weights, versions[v])


def test_a_stale_index_never_gives_wrong_weights(builds: list[int]) -> None:
    """A decoder whose indexes did not follow a version (a bug the build count alone would
    only see as slowness) must not decode wrong weights: a payload names its index's
    fingerprint, so a different index is rebuilt from the held weights, and a chunk coded
    without one checks the old classes of its changes against the held index and is
    refused (the version reverted) rather than decoded over a stale one."""
    versions = _versions(3, seed=4)
    e1 = encode_version(1, versions[1], versions[0], 0, CHUNK_BYTES)
    e2 = encode_version(2, versions[2], versions[1], 1, CHUNK_BYTES, carried=e1.carried)
    decoder = Decoder(_copy(versions[0]), 0, in_place=True)
    _apply(decoder, e1)
    other = _versions(1, seed=99)[0]  # same shapes, other values: another index, same threshold
    decoder._indexes = {k: codec.build_index(other[k[0]].bits, "bf16", i.start, i.count, i.threshold) for k, i in decoder._indexes.items()}
    builds[0] = 0
    try:
        _apply(decoder, e2)
    except DataLoss:
        decoder.abort()  # what a subscriber does with a failed version
        assert _same(decoder.weights, versions[1]) and decoder.version == 1
    else:
        assert _same(decoder.weights, versions[2])
    assert builds[0] > 0


def test_an_index_follows_a_chunk_sent_in_format_1(builds: list[int]) -> None:
    """A chunk that did not change goes out in format 1 (smaller then); the decoder keeps
    that chunk's index current through it, so the next format-3 delta finds it."""
    rng = np.random.default_rng(6)

    def moved(bits: np.ndarray) -> np.ndarray:
        bits = bits.copy()
        idx = rng.choice(bits.size, bits.size // 7, replace=False)
        bits[idx] = (bits[idx].astype(np.int32) + rng.choice([-1, 1], idx.size)).astype(np.uint16)
        return bits

    b0 = _bf16(rng, 4000)
    b1 = moved(b0)
    b3 = moved(b1)
    versions = [{"norm": RawTensor("bf16", (4000,), b)} for b in (b0, b1, b1, b3)]
    encs, carried = [], None
    for v in range(1, 4):
        encs.append(encode_version(v, versions[v], versions[v - 1], v - 1, CHUNK_BYTES, carried=carried))
        carried = encs[-1].carried
    assert [codec.parse_header(e.chunks[0]).version for e in encs] == [CHUNK_FORMAT, 1, CHUNK_FORMAT]
    decoder = Decoder(_copy(versions[0]), 0, in_place=True)
    BUILT.clear()
    for v, enc in enumerate(encs, start=1):
        _apply(decoder, enc)
        assert _same(decoder.weights, versions[v])
    assert BUILT == [(4000, 0)]  # built at version 1 only


def test_encoding_on_several_threads_stores_the_same_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store encoding tensors on threads writes what one thread writes (deltas, keyframes,
    the weights hash) and leaves the same indexes and sums for the next version; names
    whose order differs from their sizes' catch results filed under the wrong tensor."""
    renamed = {"emb": "z.emb", "layer.w": "a.w", "norm": "m.norm"}
    versions = [{renamed[n]: t for n, t in v.items()} for v in _versions(6, seed=5)]
    threads_seen: set[str] = set()
    real = codec.encode_tensor

    def recording(*args, **kwargs):
        threads_seen.add(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(codec, "encode_tensor", recording)
    one = VersionStore(tmp_path / "one", chunk_bytes=CHUNK_BYTES, keyframe_every=2)
    many = VersionStore(tmp_path / "many", chunk_bytes=CHUNK_BYTES, keyframe_every=2, encode_threads=3)
    for v, weights in enumerate(versions):
        a, b = one.publish(v, weights), many.publish(v, weights)
        assert a.manifest == b.manifest and a.chunks == b.chunks
        assert one.carried.sums == many.carried.sums
        assert {n: [i.positions.tobytes() for i in held] for n, held in one.carried.indexes.items()} == {
            n: [i.positions.tobytes() for i in held] for n, held in many.carried.indexes.items()
        }
    assert one.keyframes.keys() == many.keyframes.keys() and all(one.keyframes[v].chunks == many.keyframes[v].chunks for v in one.keyframes)
    assert sum(name.startswith("ws-encode") for name in threads_seen) >= 2
