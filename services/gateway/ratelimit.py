"""Per-client request rate limiting (``limits.rate_limit_per_minute``; 0 disables).

One gateway counts in its own memory. Several gateways sharing the port (``distributed.gateways``) would each
grant the whole limit, so they count in the session store instead: one ``RateHit`` round trip per request,
the same window for every process. A store that does not answer lets the request through (logged): the
limit is a guard, and a store outage must not stop serving.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import structlog

from common.errors import RATE_LIMITED, TillerError
from common.ratelimit import SlidingWindow
from services.gateway.protocol import GatewayError

log = structlog.get_logger()

# a client's request counted elsewhere: the seconds until it may retry, None when admitted
RemoteHit = Callable[[str], Awaitable[float | None]]


class RateLimiter:
    """Counts here, or with ``remote`` (the session store's window) when several gateways share the limit."""

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic,
                 remote: RemoteHit | None = None) -> None:
        self._window = SlidingWindow(per_minute, clock)
        self._remote = remote

    async def check(self, client: str) -> None:
        """Count one request from ``client``; raise ``rate_limited`` when over the limit."""
        limit = self._window.limit
        if limit <= 0:
            return
        retry_after = self._window.hit(client) if self._remote is None else await self._shared_hit(client)
        if retry_after is not None:
            raise GatewayError(RATE_LIMITED,
                               f"rate limit of {limit} requests per minute exceeded; retry in {retry_after:.1f} s",
                               retry_after_s=retry_after)

    async def _shared_hit(self, client: str) -> float | None:
        assert self._remote is not None
        try:
            return await self._remote(client)
        except TillerError as exc:
            log.warning("ratelimit.store_unanswered", client=client, error=exc.message)
            return None
