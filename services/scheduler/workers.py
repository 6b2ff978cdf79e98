"""The scheduler's table of workers: what each announced, the KV promised on it, its liveness marks.

Pure data: the service shell sets the liveness marks (``last_seen``, ``suspect_since``) and owns the
sockets and step round-trips; the core reads and updates the KV figures. ``least_loaded`` is the
default placement of a new sequence.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common import wire
from services.scheduler.batch_ceiling import BatchCeiling

if TYPE_CHECKING:
    from services.scheduler.requests import LiveRequest


@dataclass
class WorkerInfo:
    identity: bytes
    hello: wire.WorkerHello
    last_seen: float = 0.0
    reserved_tokens: int = 0  # KV reserved by admitted requests and parked sessions
    suspect_since: float | None = None  # set when a peer disconnected: answer soon or be dropped
    kv_free_tokens: int | None = None  # as its last step result reported (None: no step yet)
    kv_cached_tokens: int = 0  # likewise: blocks that only hold reusable prefixes
    fresh: bool = True  # no step sent yet: the first one drops whatever the worker holds (Step.free_all)
    running: int = 0  # sequences admitted to it
    batch: BatchCeiling | None = None  # where its decode throughput stops growing (limits.adaptive_batch)
    steps_out: int = 0  # steps sent to it whose results are not applied yet

    @property
    def ready(self) -> bool:
        return self.hello.stage == "ready"

    @property
    def capacity(self) -> int:
        return self.hello.kv_capacity_tokens

    @property
    def unreserved(self) -> int:
        return self.capacity - self.reserved_tokens


# Where a new sequence for a request runs (it needs ``request.needed_tokens`` of KV): the identity of
# one of ``workers`` (the ready ones), or None when none can hold it now.
Place = Callable[["LiveRequest", Sequence[WorkerInfo]], "bytes | None"]


def least_loaded(request: LiveRequest, workers: Sequence[WorkerInfo]) -> bytes | None:
    """The worker with the most unreserved KV, if it can hold the request."""
    best = max(workers, key=lambda w: w.unreserved, default=None)
    return best.identity if best is not None and best.unreserved >= request.needed_tokens else None


class WorkerPool:
    """Workers by ZeroMQ identity. The newest hello wins for an identity."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.workers: dict[bytes, WorkerInfo] = {}
        self.clock = clock

    def on_hello(self, identity: bytes, hello: wire.WorkerHello) -> WorkerInfo:
        info = self.workers.get(identity)
        if info is None:
            info = WorkerInfo(identity=identity, hello=hello)
            self.workers[identity] = info
        else:
            info.hello = hello
        self.touch(identity)
        return info

    def touch(self, identity: bytes) -> None:
        info = self.workers.get(identity)
        if info is not None:
            info.last_seen = self.clock()
            info.suspect_since = None

    def ready(self) -> list[WorkerInfo]:
        return [w for w in self.workers.values() if w.ready]

    def first_ready(self) -> WorkerInfo | None:
        """The first ready worker (model facts come from it: every submit and step reads them)."""
        return next((w for w in self.workers.values() if w.ready), None)

    def summary(self) -> wire.WorkerStage:
        """The best stage among workers, for health replies."""
        if not self.workers:
            return wire.WorkerStage()
        rank = {"ready": 3, "loading": 2, "failed": 1}
        best = max(self.workers.values(), key=lambda w: (rank.get(w.hello.stage, 0), w.hello.progress))
        return wire.WorkerStage(stage=best.hello.stage, progress=100 if best.ready else best.hello.progress,
                                message=best.hello.message, workers=len(self.workers), device=best.hello.device)

    def drop(self, identity: bytes) -> WorkerInfo | None:
        return self.workers.pop(identity, None)
