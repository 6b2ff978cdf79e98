"""Per-client request rate limiting (``limits.rate_limit_per_minute``; 0 disables)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from common.errors import RATE_LIMITED
from services.gateway.protocol import GatewayError

WINDOW_S = 60.0


class RateLimiter:
    """A sliding one-minute window of request start times per client address.

    Exact (unlike a token bucket, a client never gets more than the limit in any 60 s), and bounded:
    a client holds at most ``per_minute`` timestamps, and idle clients are swept once a window.
    """

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._limit = per_minute
        self._clock = clock
        self._hits: dict[str, deque[float]] = {}
        self._last_sweep = clock()

    def check(self, client: str) -> None:
        """Count one request from ``client``; raise ``rate_limited`` when over the limit."""
        if self._limit <= 0:
            return
        now = self._clock()
        horizon = now - WINDOW_S
        if now - self._last_sweep > WINDOW_S:
            self._sweep(horizon)
            self._last_sweep = now
        hits = self._hits.setdefault(client, deque())
        while hits and hits[0] <= horizon:
            hits.popleft()
        if len(hits) >= self._limit:
            retry_after = hits[0] - horizon
            raise GatewayError(
                RATE_LIMITED,
                f"rate limit of {self._limit} requests per minute exceeded; retry in {retry_after:.1f} s",
                retry_after_s=retry_after,
            )
        hits.append(now)

    def _sweep(self, horizon: float) -> None:
        for client in [c for c, hits in self._hits.items() if not hits or hits[-1] <= horizon]:
            del self._hits[client]
