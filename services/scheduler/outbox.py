"""The core's messages for gateways, gathered in the order they arose."""

from __future__ import annotations

from collections import defaultdict

from common import wire


class PackedEvents:
    """A gateway's packed token events (``wire.Events``) being gathered: the core's per-token loop
    appends to the three lists."""

    __slots__ = ("rids", "tokens", "logprobs")

    def __init__(self) -> None:
        self.rids: list[str] = []
        self.tokens: list[int] = []
        self.logprobs: list[float] = []


class Outbox:
    """Messages for gateways in the order they arose: a step's token events gathered into one
    ``Events`` per gateway (the plain ones packed), a ``RequestFailed`` after the events before it."""

    def __init__(self) -> None:
        # gateway -> its events since the last ``message``: the same dicts for the outbox's life, so the
        # core's per-token loop appends to ``by_gateway[gateway]`` (what ``event`` does) and to
        # ``packed[gateway]``'s lists without a call
        self.by_gateway: dict[bytes, list[wire.TokenEvent]] = defaultdict(list)
        self.packed: dict[bytes, PackedEvents] = defaultdict(PackedEvents)
        self._ready: list[tuple[bytes, wire.Msg]] = []

    def event(self, gateway: bytes, event: wire.TokenEvent) -> None:
        self.by_gateway[gateway].append(event)

    def events_of(self, gateway: bytes) -> list[wire.TokenEvent]:
        """Where ``event`` puts ``gateway``'s next events, until the next ``message``."""
        return self.by_gateway[gateway]

    def message(self, gateway: bytes, msg: wire.Msg) -> None:
        self._close()
        self._ready.append((gateway, msg))

    def _close(self) -> None:
        events, packed = self.by_gateway, self.packed
        for gateway in events.keys() | packed.keys():
            plain = packed.get(gateway) or PackedEvents()
            self._ready.append((gateway, wire.Events(
                events=events.get(gateway, []), rids=plain.rids, tokens=wire.pack_tokens(plain.tokens),
                logprobs=wire.pack_logprobs(plain.logprobs))))
        events.clear()
        packed.clear()

    def take(self) -> list[tuple[bytes, wire.Msg]]:
        self._close()
        ready, self._ready = self._ready, []
        return ready
