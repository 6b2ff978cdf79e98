"""One worker's plain requests as its steps carry them.

Most of a busy worker's sequences are decoding, each step feeding the token the step before sampled
(``follow``) and sampling the next, with nothing to decide. Those are its *followers*: every step carries
them as one packed array of sequence ids (``Step.follows``), the same array until one joins or leaves,
and their results come back first, in that order, as packed arrays (``StepResult.tokens``). No SeqStep
is built, encoded or decoded for them, and no decision is made per follower and step.

The core builds the SeqSteps of the others one by one, in priority then arrival order: prompt chunks,
paused requests, and decoding ones that cannot follow (their next step must carry new sampling
parameters, read out decoded positions, or is not known to be wanted: the tokens in flight may reach
the request's limit). A request joins the followers when a step that samples it is built and the next
one may follow it; it leaves when it ends or is parked, paused or modified, or when the tokens of the
steps in flight may end it by length (the core's ``apply`` checks that as each token comes in).
"""

from __future__ import annotations

import operator

from common import wire
from services.scheduler.requests import LiveRequest

_sort_key = operator.attrgetter("sort_key")


class WorkerBatch:
    """A worker's plain requests: its followers, in the order of their slots, and the others."""

    def __init__(self) -> None:
        self.followers: dict[int, LiveRequest] = {}  # seq_id -> request, in slot order
        self.others: dict[int, LiveRequest] = {}
        self._order: list[LiveRequest] | None = None  # the others in step order, until they change
        self._follows: tuple[list[LiveRequest], bytes] | None = None  # the followers as a step carries them

    def add(self, request: LiveRequest) -> None:
        """An admitted request."""
        self.others[request.seq_id] = request
        self._order = None

    def remove(self, request: LiveRequest) -> None:
        """A request that ended."""
        if request.follower:
            self.leave(request)
        del self.others[request.seq_id]
        self._order = None

    def join(self, request: LiveRequest) -> None:
        """From the next step on, every step carries ``request`` as a follower."""
        del self.others[request.seq_id]
        self.followers[request.seq_id] = request
        request.follower = True
        self._order = self._follows = None

    def leave(self, request: LiveRequest) -> None:
        """From the next step on, ``request``'s SeqSteps are built one by one again."""
        del self.followers[request.seq_id]
        self.others[request.seq_id] = request
        request.follower = False
        self._order = self._follows = None

    def order(self) -> list[LiveRequest]:
        """The others in priority then arrival order (sorted again only after they changed)."""
        if self._order is None:
            self._order = sorted(self.others.values(), key=_sort_key)
        return self._order

    def follows(self) -> tuple[list[LiveRequest], bytes]:
        """The followers in slot order and their packed ids (``Step.follows``); the same objects until
        one joins or leaves, so a step in flight keeps its own."""
        if self._follows is None:
            self._follows = (list(self.followers.values()), wire.pack_ids(self.followers))
        return self._follows
