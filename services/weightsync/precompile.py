"""Compiles the numba kernels of weightsync's codec and receivers into numba's on-disk cache.

Compiling them all from nothing takes over a minute on one core (84 s here), and numba
does it lazily: the first publish, the first subscriber's first delta, or the first test
to touch them would pay it, past their deadlines. `make install` runs this once
(``python -m services.weightsync.precompile``), so services and tests start from the cache
(about a second to load); the test session runs it again first, which costs that second when the
cache is there and the minute, outside any test's timeout, when not.

It drives the public paths on tiny tensors of every dtype: each format's encoder with and
without context and index, decoding in place and into fresh buffers, keyframe chunks, the
service's own encode and in-place receive of a version chain.

numba compiles on one core, and the kernels compile once per word size (16-bit dtypes,
32-bit ones): with ``workers`` > 1 the codec paths of each word size compile in a process
of their own first (each one's cache entries written under a lock, see
:func:`_serialised_cache_writes`), then one pass over everything loads them and compiles
what is left (55-63 s instead of 84 s from an empty cache on a two-core machine).
"""
from __future__ import annotations

import contextlib
import fcntl
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from meridian.tensors import RawTensor, weights_hash
from services.weightsync import codec
from services.weightsync.codec.format import _EXP_FIELD
from services.weightsync.receiver import Decoder
from services.weightsync.versions import Carried, encode_version

#: Element counts: one not a multiple of four (the word-parallel kernels' tail), one tiny.
_SIZES = (4099, 64)


def _values(dtype: str, n: int, rng: np.random.Generator) -> np.ndarray:
    floats = rng.normal(0, 0.02, n)
    if dtype == "fp32":
        return floats.astype(np.float32).view(np.uint32)
    if dtype == "fp16":
        return floats.astype(np.float16).view(np.uint16)
    return (floats.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _stepped(bits: np.ndarray, dtype: str, rng: np.random.Generator, fraction: float) -> np.ndarray:
    """A few elements one unit in the last place away, a tenth of them by an exponent."""
    out = bits.copy()
    idx = rng.choice(bits.size, max(1, int(bits.size * fraction)), replace=False)
    step = rng.choice([-1, 1], idx.size).astype(np.int64)
    step[: max(1, idx.size // 10)] <<= _EXP_FIELD[dtype][0]  # one exponent step: a power of two
    out[idx] = (out[idx].astype(np.int64) + step).astype(bits.dtype)
    return out


def _chain(dtype: str, n: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Sparse steps, then a dense one (over a fifth changed: keyframe chunks)."""
    v0 = _values(dtype, n, rng)
    v1 = _stepped(v0, dtype, rng, 0.05)
    v2 = _stepped(v1, dtype, rng, 0.05)
    return [v0, v1, v2, _stepped(v2, dtype, rng, 0.5)]


def _codec_paths(dtype: str, chain: list[np.ndarray]) -> None:
    """Every format's encoder (with context and index where it has them) and decoder,
    in place and into fresh buffers."""
    for fmt in codec.FORMAT_VERSIONS:
        context = index = None
        for old, new in zip(chain, chain[1:]):
            chunks = codec.encode_tensor("w", new, old, dtype, chunk_elems=1024, format_version=fmt, context=context, index=index)
            held = old.copy()
            fresh = np.empty_like(old)
            for j, chunk in enumerate(chunks):
                ctx = context[j] if context is not None else None
                idx = codec.ensure_index(chunk.payload, old, index[j] if index is not None else None)
                codec.decode_chunk_into(chunk.payload, fresh, old, context=ctx, index=idx)
                codec.decode_chunk_into(chunk.payload, held, held, context=ctx, index=idx)
            if not np.array_equal(held, new) or not np.array_equal(fresh, new):
                raise RuntimeError(f"precompile: {dtype} format {fmt} did not round-trip")
            context = [c.changes for c in chunks] if fmt >= 2 else None
            index = [c.index for c in chunks] if fmt == 3 else None


def _service_paths(chains: dict[str, list[np.ndarray]]) -> None:
    """The origin's encoding of a version chain and a receiver applying it in place."""
    versions = [{d: RawTensor(d, (c[i].size,), c[i]) for d, c in chains.items()} for i in range(len(next(iter(chains.values()))))]
    decoder = Decoder(None, -1, in_place=True)
    carried: Carried | None = None
    for v, weights in enumerate(versions):
        enc = encode_version(v, weights, versions[v - 1] if v else None, v - 1, 2048, carried=carried)
        carried = enc.carried
        decoder.begin(enc.manifest)
        for i, payload in enumerate(enc.chunks):
            decoder.add_chunk(i, payload)
        decoder.finish()
    decoder.revert_last()
    weights_hash(versions[0])


#: The dtypes whose kernels share signatures (their raw bits are the same word size).
_WORD_SIZES = (("bf16", "fp16"), ("fp32",))


def _all_paths() -> None:
    rng = np.random.default_rng(0)
    for n in _SIZES:
        chains = {dtype: _chain(dtype, n, rng) for dtype in codec.DTYPES}
        for dtype, chain in chains.items():
            _codec_paths(dtype, chain)
        _service_paths(chains)


def _word_size_paths(dtypes: tuple[str, ...], lock_path: str) -> None:
    """One worker's share: the codec paths of ``dtypes`` (one word size)."""
    with _serialised_cache_writes(Path(lock_path)):
        rng = np.random.default_rng(0)
        for dtype in dtypes:
            _codec_paths(dtype, _chain(dtype, _SIZES[0], rng))


@contextlib.contextmanager
def _serialised_cache_writes(lock_path: Path) -> Iterator[None]:
    """Makes numba's cache writes one at a time across processes (an exclusive lock on
    ``lock_path``). A write reads a function's index, picks a data file name, and writes
    both: two processes writing entries of one function at once would lose one entry, or
    leave an index naming the other's data file. Compiling, the slow part, stays parallel."""
    from numba.core import caching

    original = caching.IndexDataCacheFile.save

    def save(self: caching.IndexDataCacheFile, key: object, data: object) -> None:
        with open(lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            original(self, key, data)

    caching.IndexDataCacheFile.save = save  # type: ignore[method-assign]
    try:
        yield
    finally:
        caching.IndexDataCacheFile.save = original  # type: ignore[method-assign]


def precompile(workers: int = 1) -> float:
    """Compiles (or loads from the cache) every weightsync kernel; returns the seconds
    taken. ``workers`` > 1: each word size's codec paths first in processes of their own."""
    started = time.perf_counter()
    if workers > 1:
        with tempfile.TemporaryDirectory(prefix="meridian-precompile-") as tmp:
            lock = str(Path(tmp) / "numba-cache.lock")
            # spawn: a fresh interpreter per worker, nothing of this one's state forked.
            with ProcessPoolExecutor(min(workers, len(_WORD_SIZES)), mp_context=multiprocessing.get_context("spawn")) as pool:
                for done in [pool.submit(_word_size_paths, dtypes, lock) for dtypes in _WORD_SIZES]:
                    done.result()
            with _serialised_cache_writes(Path(lock)):
                _all_paths()
    else:
        _all_paths()
    return time.perf_counter() - started


def warm() -> float:
    """Loads the kernels a weightsync service runs (an origin's encoding, a receiver's
    in-place decoding and index upkeep) for every dtype, from numba's cache (compiling what
    is missing there): what a service does before it reports SERVING, so that its first
    version does not pay for it (0.18 s here from the cache). Returns the seconds taken."""
    started = time.perf_counter()
    rng = np.random.default_rng(0)
    _service_paths({dtype: _chain(dtype, _SIZES[0], rng) for dtype in codec.DTYPES})
    return time.perf_counter() - started


def main() -> int:
    """``python -m services.weightsync.precompile``: fills numba's cache, says how long it took."""
    cores = len(os.sched_getaffinity(0))
    print(f"weightsync kernels compiled in {precompile(cores):.1f} s ({cores} core(s))", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
