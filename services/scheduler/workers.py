"""The workers connected to the scheduler: their announced state, liveness, and step round-trips."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from common import wire
from common.blocks import prefix_keys
from services.scheduler.placement import Candidate, PrefixIndex, choose


@dataclass
class WorkerInfo:
    identity: bytes
    hello: wire.WorkerHello
    last_seen: float = field(default_factory=time.monotonic)
    reserved_tokens: int = 0  # KV reserved by admitted requests
    in_flight: dict[int, asyncio.Future[wire.StepResult]] = field(default_factory=dict)  # step_id -> its result
    suspect_since: float | None = None  # set when a peer disconnected: answer soon or be dropped
    kv_free_tokens: int | None = None  # as its last step result reported (None: no step yet)
    fresh: bool = True  # no step sent yet: the first one drops whatever the worker holds (Step.free_all)
    kv_cached_tokens: int = 0  # unreferenced prefix-cache blocks, as its last step result reported
    fed_tokens: int = 0  # prompt tokens sent to it, and how many of them its prefix cache gave
    hit_tokens: int = 0
    running: int = 0  # sequences admitted to it
    placed: Counter[str] = field(default_factory=Counter)  # placement decisions by reason

    @property
    def ready(self) -> bool:
        return self.hello.stage == "ready"

    @property
    def capacity(self) -> int:
        return self.hello.kv_capacity_tokens


class WorkerPool:
    """Tracks workers by ZeroMQ identity. The newest hello wins for an identity."""

    def __init__(self, balance: int = 8) -> None:
        self.workers: dict[bytes, WorkerInfo] = {}
        self.index = PrefixIndex()  # which worker's prefix cache holds which blocks
        self.balance = balance  # see placement.choose

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

    def pick_for(self, tokens: int, prompt: Sequence[int]) -> WorkerInfo | None:
        """The ready worker for a new sequence of ``tokens`` KV tokens starting with ``prompt``
        (see placement.choose); None when none has the room now."""
        candidates = [Candidate(w.identity, w.capacity - w.reserved_tokens, w.running)
                      for w in self.ready() if w.suspect_since is None]
        decision = choose(candidates, tokens, list(prefix_keys(prompt)), self.index, balance=self.balance)
        if decision is None:
            return None
        worker = self.workers[decision.identity]
        worker.placed[decision.reason] += 1
        return worker

    def on_result(self, worker: WorkerInfo, result: wire.StepResult, fed: int) -> None:
        """A step result's KV figures and block events; ``fed``: prompt tokens its step sent."""
        if result.kv_free_tokens >= 0:
            worker.kv_free_tokens = result.kv_free_tokens
        if result.kv_cached_tokens >= 0:
            worker.kv_cached_tokens = result.kv_cached_tokens
        worker.fed_tokens += fed
        worker.hit_tokens += sum(result.cached_tokens.values())
        self.index.apply(worker.identity, result.blocks_new, result.blocks_gone)

    def stats(self) -> list[dict[str, object]]:
        """Per worker, for health replies and /metrics."""
        return [
            {
                "worker": w.identity.decode(errors="replace"),
                "stage": w.hello.stage,
                "device": w.hello.device,
                "running": w.running,
                "kv_capacity_tokens": w.capacity,
                "kv_free_tokens": w.capacity if w.kv_free_tokens is None else w.kv_free_tokens,
                "kv_cached_tokens": w.kv_cached_tokens,
                "kv_used_tokens": w.capacity - (w.capacity if w.kv_free_tokens is None else w.kv_free_tokens),
                "kv_reserved_tokens": w.reserved_tokens,
                "prefix_blocks_indexed": self.index.blocks(w.identity),
                "prefix_hit_rate": w.hit_tokens / w.fed_tokens if w.fed_tokens else 0.0,
                "placed": dict(w.placed),
            }
            for w in self.workers.values()
        ]

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
        self.index.forget(identity)
        return self.workers.pop(identity, None)
