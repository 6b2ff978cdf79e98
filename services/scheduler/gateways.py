"""The gateways the scheduler streams to, as their heartbeats show them: one entry per ZeroMQ identity
(``gateway-<host>-<pid>``: several gateway processes are several peers), with the incarnation it announced.

Pure bookkeeping: the scheduler feeds it every frontend message and its clock, and cancels the requests of
the identities it reports lost (silent past ``limits.gateway_silence_s``, or heard again under a new
incarnation). Only a gateway that sent a heartbeat is watched: a one-off client (``tiller check``) is not.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from common import wire


@dataclass
class Peer:
    incarnation: str
    last_heard: float


class Gateways:
    def __init__(self, silence_s: float) -> None:
        self.silence_s = silence_s
        self.peers: dict[bytes, Peer] = {}

    def heard(self, identity: bytes, incarnation: str | None, now: float) -> bool:
        """A message from ``identity`` (``incarnation``: it was a heartbeat naming it); True when the
        requests of its previous life are lost (it restarted under the same identity)."""
        peer = self.peers.get(identity)
        if peer is None:
            if incarnation is not None:
                self.peers[identity] = Peer(incarnation, now)
            return False
        peer.last_heard = now
        if incarnation is None or incarnation == peer.incarnation:
            return False
        restarted = bool(peer.incarnation)  # "": a gateway that names none
        peer.incarnation = incarnation
        return restarted

    def expired(self, now: float) -> list[bytes]:
        """The gateways silent past ``silence_s``, forgotten: their requests must be cancelled."""
        gone = [identity for identity, peer in self.peers.items() if now - peer.last_heard > self.silence_s]
        for identity in gone:
            del self.peers[identity]
        return gone

    def figures(self, requests: Counter[bytes], now: float) -> list[wire.GatewayPeer]:
        """Each watched gateway's line of the scheduler's health (``requests``: live requests per identity)."""
        return [wire.GatewayPeer(gateway=identity.decode(errors="replace"), incarnation=peer.incarnation,
                                 requests=requests[identity], silent_s=round(now - peer.last_heard, 3))
                for identity, peer in sorted(self.peers.items())]
