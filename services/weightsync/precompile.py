"""Compiles the numba kernels of weightsync's codec and receivers into numba's on-disk cache.

Compiling them all from nothing takes about a minute on a small machine (65 s here on 2
busy cores), and numba does it lazily: the first publish, the first subscriber's first
delta, or the first test to touch them would pay it, past their deadlines. `make install`
runs this once (``python -m services.weightsync.precompile``), so services and tests start
from the cache (about a second to load); the test session runs it again first, which costs
that second when the cache is there and the minute, outside any test's timeout, when not.

It drives the public paths on tiny tensors of every dtype: each format's encoder with and
without context and index, decoding in place and into fresh buffers, keyframe chunks, the
service's own encode and in-place receive of a version chain.
"""
from __future__ import annotations

import sys
import time

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


def precompile() -> float:
    """Compiles (or loads from the cache) every weightsync kernel; returns the seconds taken."""
    started = time.perf_counter()
    rng = np.random.default_rng(0)
    for n in _SIZES:
        chains = {dtype: _chain(dtype, n, rng) for dtype in codec.DTYPES}
        for dtype, chain in chains.items():
            _codec_paths(dtype, chain)
        _service_paths(chains)
    return time.perf_counter() - started


def main() -> int:
    """``python -m services.weightsync.precompile``: fills numba's cache, says how long it took."""
    print(f"weightsync kernels compiled in {precompile():.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
