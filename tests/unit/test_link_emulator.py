"""Where the link emulator's corruption lands (meridian.link_emulator) however TCP cuts
the stream into reads, and the settings ``meridian link`` refuses; the link itself, its
cuts and SIGHUP are in test_chaos and test_regions."""
from __future__ import annotations

import itertools

import pytest

from meridian.link_emulator import CHUNK_MAGIC, LinkConfig, _Corruption, _Direction, _Pump

# Two chunk headers: the rule fires at the first only.
STREAM = b"grpc-frame-head:" + CHUNK_MAGIC + b"0123456789abcdef" + CHUNK_MAGIC + b"tail"


def _carried(reads: list[bytes], rule: _Corruption) -> bytes:
    """The bytes a connection's down pump passes on for ``reads``, in order."""
    pump = _Pump(None, None, _Direction(0.0, 0.0), [rule])  # type: ignore[arg-type] - _corrupt touches neither stream
    return b"".join(pump._corrupt(read) for read in reads)


@pytest.mark.parametrize("after", [0, 3, 12])
def test_the_flipped_byte_is_the_same_wherever_the_reads_split(after: int) -> None:
    """A test that corrupts "the byte 3 past a chunk's magic" relies on that byte being
    hit, even when the magic straddles two reads or the byte arrives reads later; a
    flip elsewhere would test a different failure (a corrupt frame, not a chunk)."""
    target = STREAM.index(CHUNK_MAGIC) + len(CHUNK_MAGIC) + after
    want = bytearray(STREAM)
    want[target] ^= 0xFF
    for i, j in itertools.combinations(range(1, len(STREAM)), 2):
        rule = _Corruption(CHUNK_MAGIC, after)
        got = _carried([STREAM[:i], STREAM[i:j], STREAM[j:]], rule)
        assert got == bytes(want), (i, j)
        assert rule.fired and not rule.armed


@pytest.mark.parametrize(("field", "value"), [("mbit_s", -1.0), ("latency_ms", -5.0)])
def test_a_negative_bandwidth_or_latency_is_refused_by_name(field: str, value: float) -> None:
    """The link reads a negative bandwidth as unlimited and a negative latency as none
    (a wait below zero is skipped): a typo would give a bench or chaos run a fast link
    where it asked for a slow one, silently."""
    with pytest.raises(ValueError, match=field):
        LinkConfig(target="127.0.0.1:1", **{field: value})  # type: ignore[arg-type]
