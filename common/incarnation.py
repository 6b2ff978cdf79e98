"""Incarnations: which life of a peer process the work we handed it lives in.

Every service draws an incarnation id when it starts (:func:`new_incarnation`) and announces it in its
hellos and heartbeat replies. A peer that hears a new id knows that everything it had in flight at the
old one is gone: a process that restarts keeps no request, lease or sequence of its previous life.

:class:`PeerWatch` is the pure decision part: fed with what was heard from one peer and when, it says
when the work in flight there must be given up. It owns no socket and no timer; its caller feeds it
heartbeat replies, connection drops and clock ticks.
"""

from __future__ import annotations

import functools
import secrets
import time
from dataclasses import dataclass


def new_incarnation() -> str:
    """A fresh id: a start time (readable in logs) and 8 random hex digits."""
    return f"{int(time.time())}-{secrets.token_hex(4)}"


@functools.cache
def process_incarnation() -> str:
    """This process's incarnation, drawn once."""
    return new_incarnation()


@dataclass
class PeerWatch:
    """One peer's liveness as seen from a process that hands it work.

    The work in flight there is lost when the peer answers with a different incarnation, when its
    connection dropped and it did not answer again within ``suspect_grace_s``, or when it was silent
    for ``silence_s`` while work was in flight (a host that vanished without closing its connection).
    After a loss the next incarnation heard is adopted as is: work started since then belongs to it.
    """

    silence_s: float
    suspect_grace_s: float
    incarnation: str | None = None  # the one the work in flight belongs to (None: not known yet)
    last_heard: float | None = None
    suspect_since: float | None = None  # when the connection dropped, until the peer answers again

    def heard(self, incarnation: str, now: float) -> str | None:
        """A heartbeat reply naming ``incarnation`` arrived; the reason the work is lost, if it is."""
        previous = self.incarnation
        self.incarnation, self.last_heard, self.suspect_since = incarnation, now, None
        if previous is not None and previous != incarnation:
            return f"it restarted (incarnation {previous} -> {incarnation})"
        return None

    def disconnected(self, now: float) -> None:
        """The connection to the peer dropped: it must answer again soon."""
        if self.suspect_since is None:
            self.suspect_since = now

    def check(self, now: float, busy: bool) -> str | None:
        """On a clock tick: the reason the work in flight is lost, if it is (``busy``: there is some)."""
        if self.suspect_since is not None and now - self.suspect_since > self.suspect_grace_s:
            return f"its connection dropped and it did not answer within {self.suspect_grace_s:g} s"
        if busy and self.last_heard is not None and now - self.last_heard > self.silence_s:
            return f"it did not answer for {self.silence_s:g} s"
        return None

    def forget(self, now: float) -> None:
        """The loss was acted on: the next incarnation heard is taken as it is."""
        self.incarnation, self.suspect_since, self.last_heard = None, None, now
