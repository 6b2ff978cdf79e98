"""The workers connected to the scheduler: their announced state, liveness, and step round-trips."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from common import wire


@dataclass
class WorkerInfo:
    identity: bytes
    hello: wire.WorkerHello
    last_seen: float = field(default_factory=time.monotonic)
    reserved_tokens: int = 0  # KV reserved by admitted requests
    in_flight: dict[int, asyncio.Future[wire.StepResult]] = field(default_factory=dict)  # step_id -> its result
    suspect_since: float | None = None  # set when a peer disconnected: answer soon or be dropped
    kv_free_tokens: int | None = None  # as its last step result reported (None: no step yet)
    kv_cached_tokens: int = 0  # likewise: blocks that only hold reusable prefixes
    fresh: bool = True  # no step sent yet: the first one drops whatever the worker holds (Step.free_all)

    @property
    def ready(self) -> bool:
        return self.hello.stage == "ready"

    @property
    def capacity(self) -> int:
        return self.hello.kv_capacity_tokens


class WorkerPool:
    """Tracks workers by ZeroMQ identity. The newest hello wins for an identity."""

    def __init__(self) -> None:
        self.workers: dict[bytes, WorkerInfo] = {}

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
            info.last_seen = time.monotonic()
            info.suspect_since = None

    def ready(self) -> list[WorkerInfo]:
        return [w for w in self.workers.values() if w.ready]

    def pick_for(self, tokens: int) -> WorkerInfo | None:
        """The ready worker with the most free reserved capacity that can hold ``tokens``."""
        best: WorkerInfo | None = None
        for worker in self.ready():
            free = worker.capacity - worker.reserved_tokens
            if free >= tokens and (best is None or free > best.capacity - best.reserved_tokens):
                best = worker
        return best

    def summary(self) -> dict[str, object]:
        """Worker state for health replies: the best stage among workers."""
        if not self.workers:
            return {"stage": "absent", "progress": 0, "message": "no worker has connected yet"}
        rank = {"ready": 3, "loading": 2, "failed": 1}
        best = max(self.workers.values(), key=lambda w: (rank.get(w.hello.stage, 0), w.hello.progress))
        return {
            "stage": best.hello.stage,
            "progress": 100 if best.ready else best.hello.progress,
            "message": best.hello.message,
            "workers": len(self.workers),
            "device": best.hello.device,
        }

    def drop(self, identity: bytes) -> WorkerInfo | None:
        return self.workers.pop(identity, None)
