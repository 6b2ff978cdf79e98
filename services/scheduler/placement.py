"""Which worker a new sequence goes to: where its KV already is, else where there is room.

Pure decision logic (no sockets, no clocks). In order of preference:

1. **session**: the worker holding the session's parked sequence (its next turn only feeds what
   is new);
2. **prefix**: the worker whose prefix cache holds the longest run of the prompt's leading full
   blocks, as the :class:`PrefixIndex` knows it from the workers' block events and from the
   prompts it placed there since (the idea of SGLang's cache-aware router and llm-d's KV-aware
   scheduling);
3. **hash**: a prompt no worker caches goes to the worker its first block ranks highest by
   rendezvous hashing, so the requests sharing a new prefix (a system prompt seen for the first time,
   or many at once before any block event is back) gather on one worker instead of each filling
   another worker's cache with it; ties between equal matches are broken the same way;
4. **load**: a prompt shorter than a block goes to the worker running the fewest sequences (then the
   one with the most free KV).

Only workers running at most ``balance`` sequences beyond the least loaded one compete for 2 and 3:
affinity yields to load there, and as the rendezvous ranking is the same for every request of a
prefix, its overflow goes to the same next worker rather than anywhere.

A worker qualifies only when its free KV can hold the sequence. Forks and backtracks of a live or
parked sequence never come here: they stay on their parent's worker.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from common import wire
from common.blocks import BLOCK_SIZE, domain_root, prefix_keys

if TYPE_CHECKING:
    from services.scheduler.requests import LiveRequest
    from services.scheduler.workers import WorkerInfo


@dataclass(frozen=True)
class Candidate:
    """A ready worker as placement sees it."""

    identity: bytes
    free_tokens: int  # KV not promised to admitted requests or parked sessions
    running: int  # sequences admitted to it


@dataclass(frozen=True)
class Decision:
    identity: bytes
    reason: Literal["session", "prefix", "hash", "load"]
    matched_blocks: int = 0  # leading prompt blocks the chosen worker's prefix cache holds


class PrefixIndex:
    """Which workers' prefix caches hold which blocks, by 64-bit block key (common.blocks): the
    blocks each worker reported, and the blocks of prompts just placed on it (*promised*: its
    prefill has not run yet, but a request sharing the prefix meanwhile should follow it there, as
    SGLang's router counts a prompt in a worker's tree when it routes it). A promise lasts until the
    worker reports the block, or until newer promises push it out: a worker holds at most so many
    blocks, so older promises than that never came true (the request was cancelled, the block
    evicted before it was reported)."""

    def __init__(self) -> None:
        # block key -> its holders as a bit mask of worker bits: an int, which the cyclic garbage collector
        # never walks (a set per key made every full collection walk a hundred thousand sets)
        self._holders: dict[int, int] = {}
        self._bits: dict[bytes, int] = {}  # worker -> its bit (1 << i)
        self._workers: dict[int, bytes] = {}  # bit -> worker
        self._keys: dict[bytes, set[int]] = {}
        self._promised: dict[bytes, dict[int, None]] = {}  # worker -> promised keys, oldest first

    def _bit(self, worker: bytes) -> int:
        bit = self._bits.get(worker)
        if bit is None:
            bit = 1
            while bit in self._workers:  # the lowest free one: a worker forgotten holds nothing any more
                bit <<= 1
            self._bits[worker], self._workers[bit] = bit, worker
        return bit

    def apply(self, worker: bytes, new: Iterable[int], gone: Iterable[int]) -> None:
        """A worker's block events: blocks it registered, then blocks it forgot."""
        keys = self._keys.setdefault(worker, set())
        promised = self._promised.get(worker, {})
        bit, holders = self._bit(worker), self._holders
        for key in new:
            keys.add(key)
            promised.pop(key, None)
            holders[key] = holders.get(key, 0) | bit
        for key in gone:
            keys.discard(key)
            if key not in promised:
                self._unhold(key, bit)

    def promise(self, worker: bytes, keys: Iterable[int], limit: int) -> None:
        """A prompt of these block keys was placed on ``worker``, which holds at most ``limit`` blocks."""
        reported = self._keys.get(worker, set())
        promised = self._promised.setdefault(worker, {})
        bit, holders = self._bit(worker), self._holders
        for key in keys:
            if key not in reported:
                promised.pop(key, None)  # the newest promise last
                promised[key] = None
                holders[key] = holders.get(key, 0) | bit
        while len(promised) > limit:
            key = next(iter(promised))
            del promised[key]
            if key not in reported:
                self._unhold(key, bit)

    def _unhold(self, key: int, bit: int) -> None:
        holders = self._holders.get(key)
        if holders is not None:
            if holders & ~bit:
                self._holders[key] = holders & ~bit
            else:
                del self._holders[key]

    def forget(self, worker: bytes) -> None:
        """A worker left, or its cache will be reported afresh."""
        bit = self._bits.pop(worker, None)
        if bit is None:
            return
        for key in self._keys.pop(worker, set()) | self._promised.pop(worker, {}).keys():
            self._unhold(key, bit)
        del self._workers[bit]

    def blocks(self, worker: bytes) -> int:
        """Blocks ``worker`` reported (its promises not counted)."""
        return len(self._keys.get(worker, ()))

    def matches(self, keys: Sequence[int], workers: Iterable[bytes]) -> dict[bytes, int]:
        """For each of ``workers``, how many of the leading ``keys`` its cache holds in a row."""
        found = dict.fromkeys(workers, 0)
        alive = 0
        for worker in found:
            alive |= self._bits.get(worker, 0)
        names, holders_of = self._workers, self._holders
        depth = 0
        for depth, key in enumerate(keys):  # (each worker's count is written once, when its run ends)
            holders = holders_of.get(key, 0)
            ended = alive & ~holders
            if ended:
                while ended:
                    low = ended & -ended
                    found[names[low]] = depth
                    ended ^= low
                alive &= holders
                if not alive:
                    return found
        else:
            depth = len(keys)
        while alive:
            low = alive & -alive
            found[names[low]] = depth
            alive ^= low
        return found


def rendezvous(identity: bytes, key: int) -> bytes:
    """How highly ``key`` ranks a worker (highest random weight hashing): stable across processes,
    and a worker leaving or joining only moves the keys it ranked first."""
    return hashlib.blake2b(key.to_bytes(8, "little", signed=True) + identity, digest_size=8).digest()


def choose(
    candidates: Sequence[Candidate],
    needed: int,
    prompt_keys: Sequence[int],
    index: PrefixIndex,
    *,
    session_worker: bytes | None = None,
    balance: int = 8,
) -> Decision | None:
    """The worker for a new sequence needing ``needed`` KV tokens (see the module docstring);
    None when no worker has the room now."""
    fits = [c for c in candidates if c.free_tokens >= needed]
    if not fits:
        return None
    if session_worker is not None and any(c.identity == session_worker for c in fits):
        return Decision(session_worker, "session")
    if not prompt_keys:
        return Decision(min(fits, key=lambda c: (c.running, -c.free_tokens)).identity, "load")
    fewest_running = min(c.running for c in fits)
    balanced = [c.identity for c in fits if c.running <= fewest_running + balance]
    matched = index.matches(prompt_keys, balanced)
    best = max(balanced, key=lambda identity: (matched[identity], rendezvous(identity, prompt_keys[0])))
    if matched[best]:
        return Decision(best, "prefix", matched[best])
    return Decision(best, "hash")


@dataclass
class WorkerFigures:
    """What placement counts per worker: its decisions by reason, and its prefix cache's hits."""

    placed: Counter[str] = field(default_factory=Counter)
    prompt_tokens: int = 0  # tokens of prompt chunks sent to it
    hit_tokens: int = 0  # of those, tokens whose KV its prefix cache gave


class KVAwarePlacement:
    """The scheduler core's ``place`` policy (see :func:`choose`), and the prefix index and figures
    it keeps from the workers' step results (:meth:`observe`)."""

    def __init__(self, balance: int = 8) -> None:
        self.balance = balance
        self.index = PrefixIndex()
        self.figures: dict[bytes, WorkerFigures] = {}

    def __call__(self, request: LiveRequest, workers: Sequence[WorkerInfo]) -> bytes | None:
        candidates = [Candidate(w.identity, w.unreserved, w.running) for w in workers if w.suspect_since is None]
        keys = request.block_keys
        if keys is None:  # hashed once: a request that waits for room is placed again at every admission
            root = domain_root(request.submit.cache_domain)  # the worker names its blocks in the same chain
            keys = request.block_keys = list(prefix_keys(request.prompt, root=root))
        decision = choose(candidates, request.needed_tokens, keys, self.index, balance=self.balance)
        if decision is None:
            return None
        capacity = next(w.capacity for w in workers if w.identity == decision.identity)
        self.index.promise(decision.identity, keys, capacity // BLOCK_SIZE)
        self.figures.setdefault(decision.identity, WorkerFigures()).placed[decision.reason] += 1
        return decision.identity

    def forget(self, worker: bytes) -> None:
        """A worker was lost (the core's ``worker_gone``): its cache and figures with it."""
        self.index.forget(worker)
        self.figures.pop(worker, None)

    def observe(self, worker: bytes, step: wire.Step, result: wire.StepResult) -> None:
        """A worker's step result: its block events, and its prefix cache's hits on prompt chunks."""
        self.index.apply(worker, result.blocks_new, result.blocks_gone)
        figures = self.figures.setdefault(worker, WorkerFigures())
        figures.prompt_tokens += sum(len(s.tokens) for s in step.seqs if len(s.tokens) > 1)
        figures.hit_tokens += sum(result.cached_tokens.values())

    def worker_figures(self, worker: WorkerInfo) -> wire.WorkerLoad:
        """One worker's line of the scheduler's model facts (and the gateway's /metrics)."""
        figures = self.figures.get(worker.identity, WorkerFigures())
        free = worker.capacity if worker.kv_free_tokens is None else worker.kv_free_tokens
        cached = worker.kv_cached_tokens if worker.kv_free_tokens is not None else 0
        return wire.WorkerLoad(
            worker=worker.identity.decode(errors="replace"),
            stage=worker.hello.stage,
            device=worker.hello.device,
            running=worker.running,
            kv_capacity_tokens=worker.capacity,
            kv_used_tokens=worker.capacity - free - cached,
            kv_cached_tokens=cached,
            kv_free_tokens=free,
            kv_reserved_tokens=worker.reserved_tokens,
            prefix_blocks_indexed=self.index.blocks(worker.identity),
            prefix_hit_rate=figures.hit_tokens / figures.prompt_tokens if figures.prompt_tokens else 0.0,
            placed=dict(figures.placed),
            forward=worker.hello.forward,
            fallback_reason=worker.hello.fallback_reason,
        )
