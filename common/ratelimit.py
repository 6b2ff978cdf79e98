"""The sliding one-minute window of request start times behind ``limits.rate_limit_per_minute``: kept by the
gateway when it is alone, by the session store for several gateways sharing a port (docs/scale-out.md)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

WINDOW_S = 60.0


class SlidingWindow:
    """Request start times per client (a user, else an address) over the last minute.

    Exact (unlike a token bucket, a client never gets more than the limit in any 60 s), and bounded:
    a client holds at most ``per_minute`` timestamps, and idle clients are swept once a window.
    """

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = per_minute
        self._clock = clock
        self._hits: dict[str, deque[float]] = {}
        self._last_sweep = clock()

    def hit(self, client: str) -> float | None:
        """Count one request from ``client``: None when it is within the limit (0 disables), else the
        seconds until one will be (the refused request is not counted)."""
        if self.limit <= 0:
            return None
        now = self._clock()
        horizon = now - WINDOW_S
        if now - self._last_sweep > WINDOW_S:
            self._sweep(horizon)
            self._last_sweep = now
        hits = self._hits.setdefault(client, deque())
        while hits and hits[0] <= horizon:
            hits.popleft()
        if len(hits) >= self.limit:
            return hits[0] - horizon
        hits.append(now)
        return None

    def _sweep(self, horizon: float) -> None:
        for client in [c for c, hits in self._hits.items() if not hits or hits[-1] <= horizon]:
            del self._hits[client]
