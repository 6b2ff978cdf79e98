"""What the parts of the scheduler core share: the live requests, by sequence and by worker, the frees
owed to workers, the outbox, and the index of the workers that have work.

The parts (:mod:`.admission`, :mod:`.steps`, :mod:`.results`, :mod:`.endings`, :mod:`.membership`) are each
given this one object; :class:`~services.scheduler.core.SchedulerCore` composes them.
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from collections.abc import Callable

from common import wire
from common.config import Limits, Sessions
from services.scheduler.batch import WorkerBatch
from services.scheduler.outbox import Outbox
from services.scheduler.requests import LiveRequest
from services.scheduler.sessions import SessionKV
from services.scheduler.workers import WorkerPool


class CoreState:
    """The core's shared state. ``running_on`` and ``to_free`` hold entries only for workers with work
    (a sequence running or paused, a free owed): :meth:`busy_workers` reads them, so a step loop turn never
    visits an idle worker."""

    def __init__(self, limits: Limits, sessions: Sessions, clock: Callable[[], float]) -> None:
        self.limits = limits
        self.clock = clock
        self.pool = WorkerPool(clock)
        self.requests: dict[str, LiveRequest] = {}
        self.queue: list[LiveRequest] = []
        self.running: dict[int, LiveRequest] = {}  # seq_id -> request (running or paused)
        # the same by worker (a worker's step is built from its own; no entry: none), and its controlled
        # ones' count (no entry: none)
        self.running_on: dict[bytes, dict[int, LiveRequest]] = defaultdict(dict)
        self.controlled_on: Counter[bytes] = Counter()
        self.controlled_running: dict[int, LiveRequest] = {}  # the controlled ones of ``running``
        self.batches: dict[bytes, WorkerBatch] = {}  # its plain ones: followers and the others
        self.to_free: dict[bytes, list[int]] = defaultdict(list)
        self.outbox = Outbox()
        # tokens accepted from the last step whose text is worked out while the next one runs
        self.deferred: list[LiveRequest] = []  # (their events in ``LiveRequest.deferred``)
        self.orders = itertools.count()
        self.seq_ids = itertools.count(1)
        self.step_ids = itertools.count(1)
        self.sessions = SessionKV(sessions, self.pool, self.free_seq, clock)

    def model_facts(self) -> wire.WorkerHello | None:
        """The model facts, from the first ready worker."""
        first = self.pool.first_ready()
        return first.hello if first is not None else None

    def max_model_len(self) -> int:
        facts = self.model_facts()
        return facts.max_model_len if facts else self.limits.max_model_len

    def new_seq_id(self) -> int:
        return next(self.seq_ids)

    def free_seq(self, worker: bytes, seq_id: int) -> None:
        """Free a worker's sequence with its next step (nothing when the worker is gone)."""
        if worker in self.pool.workers:
            self.to_free[worker].append(seq_id)

    def busy_workers(self) -> set[bytes]:
        """The workers with sequences (running or paused) or frees owed: the only ones a step can be built for."""
        return self.running_on.keys() | self.to_free.keys()

    def run(self, request: LiveRequest) -> None:
        """An admitted request, on ``request.worker``, in the index."""
        worker = request.worker
        self.running[request.seq_id] = self.running_on[worker][request.seq_id] = request
        if request.controlled:
            self.controlled_on[worker] += 1
            self.controlled_running[request.seq_id] = request
        else:
            self.batches.setdefault(worker, WorkerBatch()).add(request)

    def stop(self, request: LiveRequest) -> None:
        """A running request that ended, out of the index (its worker's entries go with its last one)."""
        worker = request.worker
        del self.running[request.seq_id]
        on = self.running_on[worker]
        del on[request.seq_id]
        if not on:
            del self.running_on[worker]
        if request.controlled:
            self.controlled_on[worker] -= 1
            if not self.controlled_on[worker]:
                del self.controlled_on[worker]
            del self.controlled_running[request.seq_id]
        elif (batch := self.batches.get(worker)) is not None:
            batch.remove(request)

    def unfollow(self, request: LiveRequest) -> None:
        """``request``'s next step is built on its own again (it changed, or paused)."""
        if request.follower:
            self.batches[request.worker].leave(request)
