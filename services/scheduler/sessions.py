"""KV kept on workers between the turns of stateful sessions (Salience).

When a request that is a session turn (``Submit.session``) finishes, its sequence is *parked*
instead of freed: it stays live on its worker, holding its KV blocks, under the session's key.
The next turn of that session takes the parked sequence over: its first step backtracks to the
longest prefix the new prompt shares with what the sequence holds and feeds only the rest. The
first turn of a forked session forks its parent's parked sequence (blocks shared copy-on-write).

Parked sequences are only a cache: the session store holds the tokens, and every Submit carries
the whole prompt, so a parked sequence that is gone (evicted, its worker lost) only costs a
recomputation. A parked sequence is taken over only by a turn of its own cache domain
(``Submit.cache_domain``): its KV is that domain's. Budgets keep idle sessions from starving live requests: a session keeps at most
``kv_tokens_per_session`` tokens, idle sessions together at most ``kv_parked_fraction`` of a
worker's pool, and admission evicts parked sequences (least recently used first) whenever a live
request needs the room.
"""

from __future__ import annotations

import time
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from common import wire
from common.blocks import whole_blocks
from common.config import Sessions
from services.scheduler.requests import LiveRequest
from services.scheduler.workers import WorkerInfo, WorkerPool

log = structlog.get_logger()


@dataclass
class Parked:
    key: str
    seq_id: int
    worker: bytes
    # exactly what the worker's sequence holds (UNSEEN: a token the scheduler never saw), as wire.pack_tokens packs
    # it: compared whole with a turn's prompt, and made a token array again only when a turn takes the sequence
    packed: bytes
    parked_at: float
    domain: str  # the cache domain of the turn that parked it: only a turn of the same one takes it over
    images: list[wire.ImageInput] = field(default_factory=list)  # the images whose blocks it holds

    @property
    def size(self) -> int:
        """Tokens the sequence holds."""
        return len(self.packed) // 4

    @property
    def reserved(self) -> int:
        """The KV it takes on its worker: its tokens in whole blocks."""
        return whole_blocks(self.size)

    def tokens(self) -> array:
        """The tokens the sequence holds, as a new token array."""
        return wire.token_array(self.packed)


@dataclass
class Placement:
    """Where an admitted request runs: on ``worker``, as ``seq_id`` (None: a new id), forked from
    ``fork_of``, after dropping ``backtrack`` tokens; the prompt's first ``start`` tokens are
    already in the sequence's KV."""

    worker: WorkerInfo
    seq_id: int | None = None
    fork_of: int | None = None
    backtrack: int = 0
    start: int = 0
    held: array | None = None  # the tokens the sequence holds before its first step: the request's array from then on


def shared_prefix(a: bytes, b: bytes) -> int:
    """How many leading tokens two int32 token arrays (wire.pack_tokens) share: by bisection on slice
    comparisons, each a memcmp (a turn's prompt most often extends what its session holds: one)."""
    low, high = 0, min(len(a), len(b)) // 4  # a[:low] == b[:low] (in tokens); past high, nothing is known to match
    if a[: 4 * high] == b[: 4 * high]:
        return high
    while high - low > 1:  # a[:high] != b[:high]
        mid = (low + high) // 2
        if a[4 * low : 4 * mid] == b[4 * low : 4 * mid]:
            low = mid
        else:
            high = mid
    return low


def same_images_prefix(held: list[wire.ImageInput], wanted: list[wire.ImageInput], limit: int) -> int:
    """``limit``, cut back to the first image block that does not hold the same image at the same
    place in both lists: equal token ids there do not mean equal KV."""
    differ = {(i.start, i.end, i.data) for i in held} ^ {(i.start, i.end, i.data) for i in wanted}
    return min([limit] + [start for start, _, _ in differ])


# In a parked sequence's tokens: a token that a follow step fed, sampled by a step whose result was
# never applied (the turn ended meanwhile, e.g. on a stop string). No prompt token equals it, so the
# next turn backtracks over it.
UNSEEN = -1

def held_tokens(request: LiveRequest) -> array:
    """What a plain request's sequence holds once every step sent with it has run: the prompt tokens fed,
    then every token sampled but the last (each step after a sample feeds it), UNSEEN for those whose
    results are not applied yet."""
    tokens = array("i", request.kv_tokens)
    if request.fed < len(request.prompt):
        return tokens
    sampled = len(request.generated) + request.in_flight  # once the prompt is fed, every step sent samples it
    fed = max(sampled - 1, 0)
    tokens.extend(request.generated[:fed])
    if fed > len(request.generated):
        tokens.extend([UNSEEN] * (fed - len(request.generated)))
    return tokens


# ``SessionKV.reuse``'s answer when the request's own parked sequence is busy (a fork of it has not
# been copied yet): wait a step rather than change it.
WAIT = object()


class SessionKV:
    def __init__(self, config: Sessions, pool: WorkerPool, free: Callable[[bytes, int], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.pool = pool
        self._free = free  # (worker identity, seq_id): free a sequence with the worker's next step
        self.clock = clock
        self.parked: OrderedDict[str, Parked] = OrderedDict()  # least recently parked first
        self._parked_on: dict[bytes, OrderedDict[str, Parked]] = {}  # the same, by worker (eviction for room on one)
        self.pinned: set[int] = set()  # parked sequences a placed fork has not copied yet
        self._held: Counter[bytes] = Counter()  # worker -> tokens parked on it (kept, not summed: many sessions)

    # -- figures -------------------------------------------------------------------------------

    def held_tokens(self, worker: bytes) -> int:
        return self._held[worker]

    def parked_tokens(self) -> int:
        return sum(p.size for p in self.parked.values())

    # -- admission -----------------------------------------------------------------------------

    def reuse(self, request: LiveRequest, needed: int) -> Placement | None | object:
        """Where a session turn continues from a parked sequence (its session's own, or for a first
        turn its parent's), evicting other idle sessions' KV on that worker for the room; None when
        no parked sequence helps (place it anew), :data:`WAIT` when its own is busy."""
        ref = request.submit.session
        own = self.parked.get(ref.key) if ref else None
        parent = self.parked.get(ref.parent) if ref and ref.parent and own is None else None
        base = own or parent
        if own is not None and own.seq_id in self.pinned:
            return WAIT
        if base is None or base.domain != request.submit.cache_domain:
            return None  # (its own, of another domain, goes when this turn parks)
        placement = self._place_on(base, own is not None, request, needed)
        if placement is None and own is not None:  # it cannot be used: let it go rather than hold it twice
            self._evict(own)
        return placement

    def _place_on(self, base: Parked, own: bool, request: LiveRequest, needed: int) -> Placement | None:
        worker = self.pool.workers.get(base.worker)
        if worker is None or not worker.ready or worker.suspect_since is not None:
            return None
        # never skip a position the request asks outputs about, and always feed at least one token
        common = min(shared_prefix(base.packed, request.submit.prompt), request.first_output_position,
                     len(request.prompt) - 1)
        common = same_images_prefix(base.images, request.submit.images, common)
        if common <= 0 and not own:
            return None
        released = base.reserved if own else 0
        while worker.capacity - worker.reserved_tokens + released < needed:
            if not self._evict_lru(exclude=self.pinned | {base.seq_id}, worker=base.worker):
                return None
        if own:
            self._unpark(base)
            worker.reserved_tokens -= base.reserved
            return Placement(worker, seq_id=base.seq_id, backtrack=base.size - common, start=common,
                             held=base.tokens())
        self.pinned.add(base.seq_id)
        return Placement(worker, fork_of=base.seq_id, backtrack=base.size - common, start=common,
                         held=base.tokens())

    def forked(self, parent: int) -> None:
        """The step carrying a fork of ``parent`` ran (or will never run): it may be evicted again."""
        self.pinned.discard(parent)

    # -- parking -------------------------------------------------------------------------------

    def park(self, request: LiveRequest, worker: WorkerInfo) -> bool:
        """Keep a finished session turn's sequence on its worker; False: free it as usual."""
        ref = request.submit.session
        if ref is None or not request.on_worker:
            return False
        tokens = held_tokens(request)
        if not 0 < len(tokens) <= self.config.kv_tokens_per_session:
            return False
        previous = self.parked.get(ref.key)
        if previous is not None:
            self._evict(previous)
        images = [image for image in request.submit.images if image.end <= len(request.kv_tokens)]
        parked = self.parked[ref.key] = Parked(ref.key, request.seq_id, worker.identity, wire.token_array_bytes(tokens),
                                               self.clock(), request.submit.cache_domain, images)
        self._parked_on.setdefault(worker.identity, OrderedDict())[ref.key] = parked
        self._held[worker.identity] += len(tokens)
        worker.reserved_tokens += parked.reserved
        limit = int(worker.capacity * self.config.kv_parked_fraction)
        while self.held_tokens(worker.identity) > limit:
            if not self._evict_lru(exclude=self.pinned | {request.seq_id}, worker=worker.identity):
                break
        if self.held_tokens(worker.identity) > limit:  # this session alone is over the budget
            self._evict(self.parked[ref.key])
        return True

    def failed(self, seq_id: int) -> None:
        """A sequence parked while its last step ran failed that step: the worker released it."""
        for parked in self.parked.values():
            if parked.seq_id == seq_id:
                self._unpark(parked)
                worker = self.pool.workers.get(parked.worker)
                if worker is not None:
                    worker.reserved_tokens -= parked.reserved
                return

    def expire(self) -> None:
        """Let go of sequences parked longer than the session TTL (their session is closed or idle
        past it; a later turn of a live one recomputes)."""
        cutoff = self.clock() - self.config.ttl_s
        for parked in [p for p in self.parked.values() if p.parked_at < cutoff and p.seq_id not in self.pinned]:
            self._evict(parked)

    def drop(self, key: str) -> None:
        """A closed session's parked sequence goes (unless a fork of it is not copied yet: then
        the TTL takes it)."""
        parked = self.parked.get(key)
        if parked is not None and parked.seq_id not in self.pinned:
            self._evict(parked)

    def drop_worker(self, identity: bytes) -> None:
        """A lost worker took its parked sequences with it."""
        for key in self._parked_on.pop(identity, {}):
            del self.parked[key]
        self._held.pop(identity, None)

    # -- eviction ------------------------------------------------------------------------------

    def _unpark(self, parked: Parked) -> None:
        del self.parked[parked.key]
        del self._parked_on[parked.worker][parked.key]
        self._held[parked.worker] -= parked.size

    def _evict(self, parked: Parked) -> None:
        self._unpark(parked)
        worker = self.pool.workers.get(parked.worker)
        if worker is not None:
            worker.reserved_tokens -= parked.reserved
            self._free(parked.worker, parked.seq_id)
        log.debug("sessions.evicted", session=parked.key, tokens=parked.size)

    def evict_lru(self) -> bool:
        """Free the least recently parked sequence that no placed fork waits for; False: none to free."""
        return self._evict_lru(exclude=self.pinned)

    def _evict_lru(self, exclude: set[int], worker: bytes | None = None) -> bool:
        """Free the least recently parked sequence (on ``worker`` when given); False: none to free."""
        for parked in (self.parked if worker is None else self._parked_on.get(worker, {})).values():
            if parked.seq_id not in exclude:
                self._evict(parked)
                return True
        return False
