"""Worker membership: hellos (a new worker, its loading progress, a restart, a refusal) and lost workers."""

from __future__ import annotations

from collections.abc import Callable

import structlog

from common import wire
from common.errors import SERVICE_UNAVAILABLE
from services.scheduler.endings import Endings
from services.scheduler.state import CoreState

log = structlog.get_logger()


def _served(hello: wire.WorkerHello) -> tuple[str, int, int, list[int]]:
    """What a ready worker serves, which every worker of a scheduler must serve alike."""
    return hello.model, hello.vocab_size, hello.max_model_len, sorted(hello.eos_token_ids)


def _describe(served: tuple[str, int, int, list[int]]) -> str:
    model, vocab_size, max_model_len, eos = served
    return f"{model!r} (vocab_size {vocab_size}, max_model_len {max_model_len}, eos_token_ids {eos})"


class Membership:
    """The workers joining and leaving ``state.pool``; ``worker_gone`` tells the placement of a lost one."""

    def __init__(self, state: CoreState, endings: Endings, worker_gone: Callable[[bytes], None]) -> None:
        self.state = state
        self.endings = endings
        self.worker_gone = worker_gone

    def worker_hello(self, identity: bytes, hello: wire.WorkerHello) -> bool:
        """A worker announced itself or its loading progress; whether its stage or progress changed.
        A new incarnation under a known identity is a restarted worker: the old one's requests are lost.
        A worker refused by :meth:`_hello_refusal` (another ``wire.WIRE_VERSION``, another model) counts as failed
        (never placed on), its message says why."""
        pool = self.state.pool
        known = pool.workers.get(identity)
        if (refusal := self._hello_refusal(identity, hello)) is not None:
            if known is None or known.hello.message != refusal:  # once, not with every hello it repeats
                log.warning("scheduler.worker_refused", worker=identity.decode(errors="replace"), reason=refusal)
            hello = wire.WorkerHello(worker_id=hello.worker_id, stage="failed", incarnation=hello.incarnation,
                                     message=refusal)
        if known is not None and known.hello.incarnation != hello.incarnation:
            self.worker_lost(identity, "the worker restarted")
            known = None
        changed = known is None or (known.hello.stage, known.hello.progress) != (hello.stage, hello.progress)
        pool.on_hello(identity, hello)
        return changed

    def _hello_refusal(self, identity: bytes, hello: wire.WorkerHello) -> str | None:
        """Why a worker may not be placed on (it then counts as failed, this its message), or None: it speaks
        another ``wire.WIRE_VERSION`` (it would misread our steps, or we its results), or it is ready with
        model facts that are none (no vocabulary, no context) or differ from those of the first ready worker,
        which every request is admitted against (its prompt's token ids, its context)."""
        if hello.wire_version != wire.WIRE_VERSION:
            return (f"worker {hello.worker_id!r} speaks wire version {hello.wire_version}, this scheduler "
                    f"{wire.WIRE_VERSION}: run the same Tiller version on both")
        if hello.stage != "ready":
            return None
        if hello.vocab_size <= 0 or hello.max_model_len <= 0 or hello.kv_capacity_tokens <= 0:
            return (f"worker {hello.worker_id!r} announced ready with vocab_size {hello.vocab_size}, max_model_len "
                    f"{hello.max_model_len} and kv_capacity_tokens {hello.kv_capacity_tokens}: each must be > 0")
        first = self.state.pool.first_ready()
        if first is None or first.identity == identity:
            return None
        facts = _served(hello)
        if facts != (served := _served(first.hello)):
            return (f"worker {hello.worker_id!r} serves {_describe(facts)}, the ready worker "
                    f"{first.hello.worker_id!r} {_describe(served)}: a scheduler's workers serve one model")
        return None

    def worker_lost(self, identity: bytes, reason: str) -> None:
        """A worker died or stopped answering: its requests fail (retryable), its parked KV is gone."""
        log.warning("scheduler.worker_lost", worker=identity.decode(errors="replace"), reason=reason)
        state = self.state
        state.pool.drop(identity)
        self.worker_gone(identity)
        state.to_free.pop(identity, None)
        state.sessions.drop_worker(identity)
        for request in list(state.running_on.get(identity, {}).values()):
            self.endings.fail(request, SERVICE_UNAVAILABLE, f"{reason}; the request was lost, retry it")
        state.batches.pop(identity, None)
