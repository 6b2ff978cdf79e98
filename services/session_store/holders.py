"""Which stored Evergreen sessions still have a live gateway behind them (pure: fed ids and times).

A gateway names its live Evergreen sessions in each heartbeat (``GatewayAlive.evergreen``). A stored
session that no heartbeat named for ``grace_s`` belongs to a gateway that died mid-session (a gateway
that ends a session closes it itself): its node rows are orphans. A session first seen by a sweep
gets the whole grace from then, so a store that restarts drops nothing a live gateway still renews.
"""

from __future__ import annotations

from collections.abc import Iterable


class EvergreenHolders:
    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.renewed: dict[str, float] = {}  # session id -> last heartbeat naming it (or first sweep seeing it)

    def renew(self, session_ids: Iterable[str], now: float) -> None:
        for session_id in session_ids:
            self.renewed[session_id] = now

    def orphans(self, stored: Iterable[str], now: float) -> list[str]:
        """The ``stored`` sessions nobody renewed within the grace; sessions no longer stored are forgotten."""
        stored = set(stored)
        for gone in self.renewed.keys() - stored:
            del self.renewed[gone]
        stale = []
        for session_id in sorted(stored):
            if now - self.renewed.setdefault(session_id, now) > self.grace_s:
                stale.append(session_id)
                del self.renewed[session_id]
        return stale
