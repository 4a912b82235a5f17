"""A token bucket for asyncio code: caps the bytes per second a link carries.

Used on both ends of an inter-region link: the server's send side (all Subscribe
and FetchChunk traffic of one weightsync) and a relay's upstream side (what it reads
from its upstream). The link emulator has its own, time-stamped model of a link.
"""
from __future__ import annotations

import asyncio
import time


class TokenBucket:
    """``rate`` bytes per second with a burst of ``burst`` bytes; ``rate <= 0`` is no cap.

    ``take(n)`` may be called with ``n`` larger than the burst: the caller then waits
    for the debt to be paid, so a long run of large messages still averages ``rate``.
    Callers are served in the order they arrive (one lock), so no stream starves.
    """

    def __init__(self, rate: float, burst: float | None = None) -> None:
        self.rate = float(rate)
        self.burst = float(burst if burst is not None else max(rate / 20, 64 * 1024))
        self._tokens = self.burst
        self._stamp = time.monotonic()
        self._lock = asyncio.Lock()
        self.total = 0

    @classmethod
    def mib_per_s(cls, mib_s: float) -> TokenBucket:
        return cls(mib_s * (1 << 20))

    @property
    def enabled(self) -> bool:
        return self.rate > 0

    def _refill(self) -> None:
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now

    async def take(self, n: int) -> None:
        """Waits until ``n`` bytes may go out."""
        self.total += n
        if not self.enabled:
            return
        async with self._lock:
            self._refill()
            self._tokens -= n
            if self._tokens < 0:
                await asyncio.sleep(-self._tokens / self.rate)
                self._refill()
