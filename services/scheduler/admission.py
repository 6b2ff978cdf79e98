"""Admission: a gateway's submits (queued or refused) and control messages, session closes, lost gateways,
deadlines; and moving queued requests onto workers (``place``, a session's parked sequence, the per-worker
batch limit)."""

from __future__ import annotations

from array import array
from collections.abc import Callable

import numpy as np
import structlog

from common import quotas, wire
from common.admission import ContextLengthExceeded, context_budget
from common.errors import INVALID_REQUEST, MEMORY_PRESSURE, MODEL_LOADING_ERROR
from common.textstream import TextStream
from services.scheduler.endings import Endings
from services.scheduler.requests import LiveRequest, State, stop_tokens, token_limit
from services.scheduler.sessions import WAIT, Placement
from services.scheduler.state import CoreState
from services.scheduler.workers import Place, WorkerInfo

log = structlog.get_logger()


class Admission:
    """Requests into ``state`` and onto its workers. ``text_stream`` makes a request's detokenizer, ``place``
    picks a new sequence's worker; ``generations_per_user`` is tenants.max_generations_per_user (0: no limit)."""

    def __init__(self, state: CoreState, endings: Endings, text_stream: Callable[..., TextStream], place: Place,
                 generations_per_user: int) -> None:
        self.state = state
        self.endings = endings
        self.text_stream = text_stream
        self.place = place
        self.generations_per_user = generations_per_user

    def submit(self, gateway: bytes, submit: wire.Submit) -> wire.Msg:
        """Queue a request (Queued) or refuse it (Error)."""

        def refuse(code: str, message: str) -> wire.Error:
            return wire.Error(code=code, message=message, rid=submit.rid)

        if submit.rid in self.state.requests:
            return refuse(INVALID_REQUEST, f"request id {submit.rid!r} is already live")
        if len(submit.prompt) % 4:
            return refuse(INVALID_REQUEST, f"the prompt is {len(submit.prompt)} bytes, not int32 token ids")
        if not submit.prompt:
            return refuse(INVALID_REQUEST, "the prompt has no tokens")
        if submit.text_at_gateway and (submit.stop or submit.controller):
            return refuse(INVALID_REQUEST, "text_at_gateway is for requests without stop strings or a controller: "
                                           "the scheduler works out the text those need")
        facts = self.state.model_facts()
        stage = self.state.pool.summary() if facts is None else None
        if stage is not None and stage.stage == "failed":
            return refuse(MODEL_LOADING_ERROR, f"the model failed to load: {stage.message}")
        if facts is not None:
            ids = np.frombuffer(submit.prompt, dtype="<i4")
            if ids.min() < 0 or ids.max() >= facts.vocab_size:
                return refuse(INVALID_REQUEST, f"prompt token ids must lie in [0, {facts.vocab_size})")
        if submit.max_tokens < 0:
            return refuse(INVALID_REQUEST, "max_tokens must be >= 0 (0: prefill only)")
        if submit.outputs is not None and submit.outputs.pooling and submit.max_tokens:
            return refuse(INVALID_REQUEST, "an embedding (outputs.pooling) is for a prefill-only request (max_tokens 0)")
        try:  # the max_tokens policy: what does not fit is refused, never cut
            context_budget(submit.prompt_len, submit.max_tokens, self.state.max_model_len(), submit.max_tokens)
            if facts is not None and facts.kv_capacity_tokens:  # a worker's whole KV pool could never hold more
                context_budget(submit.prompt_len, submit.max_tokens, facts.kv_capacity_tokens, submit.max_tokens,
                               what="the KV cache")
        except ContextLengthExceeded as exc:
            return refuse(exc.code, exc.message)
        if len(self.state.queue) >= self.state.limits.max_queued:
            return refuse(MEMORY_PRESSURE, f"{len(self.state.queue)} requests are already waiting; try again shortly")
        if self.generations_per_user and submit.tenant:
            live = sum(1 for r in self.state.requests.values() if r.submit.tenant == submit.tenant)  # only when limited
            try:
                quotas.check("max_generations_per_user", self.generations_per_user, submit.tenant, live, 1,
                             "generations running or queued")
            except quotas.QuotaExceeded as exc:
                return refuse(exc.code, exc.message)
        timeout = submit.timeout_s if submit.timeout_s > 0 else self.state.limits.request_timeout_s
        request = LiveRequest(
            submit=submit,
            gateway=gateway,
            order=next(self.state.orders),
            text=None if submit.text_at_gateway else self._text_stream(submit, list(submit.stop)),
            deadline=self.state.clock() + timeout,
        )
        self.state.requests[submit.rid] = request
        self.state.queue.append(request)
        log.info("scheduler.submitted", request_id=submit.rid, prompt_tokens=submit.prompt_len,
                 max_tokens=submit.max_tokens)
        return wire.Queued(rid=submit.rid, waiting=len(self.state.queue))

    def control(self, gateway: bytes, msg: wire.Cancel | wire.Pause | wire.Resume | wire.Modify) -> wire.Msg:
        """Cancel, pause, resume or modify one of ``gateway``'s live requests."""
        request = self.state.requests.get(msg.rid)
        if request is None or request.gateway != gateway:
            return wire.Error(code=INVALID_REQUEST, message=f"no live request {msg.rid!r}", rid=msg.rid)
        if isinstance(msg, wire.Cancel):
            self.endings.finish(request, "cancelled")
        elif isinstance(msg, wire.Pause):
            request.paused = True
            self.state.unfollow(request)
        elif isinstance(msg, wire.Resume):
            request.paused = False
        elif isinstance(msg, wire.Modify):
            if msg.patch.max_tokens is not None:
                try:
                    context_budget(len(request.prompt), msg.patch.max_tokens, self.state.max_model_len(), msg.patch.max_tokens)
                except ContextLengthExceeded as exc:
                    return wire.Error(code=exc.code, message=exc.message, rid=msg.rid)
            if msg.patch.stop and request.text is None:
                self._hand_text_over(request)
            request.apply_patch(msg.patch)
            if msg.patch.steering is not None:
                request.steer(msg.patch.steering, msg.steering_vectors)
            request.limit = token_limit(request.submit, self.state.max_model_len())
            self.state.unfollow(request)  # its next step carries the new parameters, or is not wanted
            if request.state is not State.QUEUED and len(request.generated) >= request.submit.max_tokens:
                self.endings.finish(request, "length")
        return wire.RequestState(rid=request.rid, state=request.state.value, paused=request.paused)

    def _text_stream(self, submit: wire.Submit, stop: list[str]) -> TextStream:
        """A detokenizer of ``submit``'s text, with ``stop`` strings and the text options it asks for."""
        return self.text_stream(stop, keep_stop=submit.include_stop_str, skip_special=submit.skip_special_tokens)

    def _hand_text_over(self, request: LiveRequest) -> None:
        """A ``text_at_gateway`` request got stop strings: its text is worked out here from now on, by a
        stream that took every token generated so far (its gateway's holds the same), and its gateway is
        told so after the events it sent without text (common.event_text)."""
        request.text = self._text_stream(request.submit, [])
        request.text.push(request.generated)
        request.packed = False
        self.state.outbox.message(request.gateway, wire.TextHandover(rid=request.rid))

    def drop_session(self, key: str) -> None:
        """A closed session: its live turns are cancelled and its parked KV let go."""
        for request in [r for r in self.state.requests.values() if r.submit.session and r.submit.session.key == key]:
            self.endings.finish(request, "cancelled", park=False)
        self.state.sessions.drop(key)

    def gateway_lost(self, gateway: bytes) -> int:
        """Cancel the requests of a gateway that died; how many there were."""
        orphans = [r for r in self.state.requests.values() if r.gateway == gateway]
        for request in orphans:
            self.endings.finish(request, "cancelled")
        return len(orphans)

    def expire(self) -> None:
        """Requests past their deadline time out; sessions parked past their TTL are let go."""
        now = self.state.clock()
        for request in list(self.state.requests.values()):
            if now > request.deadline:
                self.endings.finish(request, "timeout")
        self.state.sessions.expire()

    def admit(self) -> None:
        """Move queued requests (priority, then arrival order) onto workers while they fit."""
        state = self.state
        if not state.queue:
            return
        state.queue.sort(key=lambda r: r.sort_key)
        admitted = False
        for request in state.queue:
            if request.paused:
                continue
            placement = self._placement(request)
            if placement is None:
                break  # keep priority order: nothing behind it jumps the queue
            worker = placement.worker
            request.state = State.RUNNING
            request.seq_id = placement.seq_id if placement.seq_id is not None else state.new_seq_id()
            request.fork_of, request.backtrack = placement.fork_of, placement.backtrack
            request.fed = request.applied = request.cached_tokens = placement.start
            request.kv_tokens = placement.held if placement.held is not None else array("i")
            request.worker = worker.identity
            request.stop_ids = stop_tokens(request.submit, worker.hello.eos_token_ids)
            request.limit = token_limit(request.submit, state.max_model_len())
            request.reserved = request.needed_tokens
            worker.reserved_tokens += request.reserved
            worker.running += 1
            state.run(request)
            admitted = True
        if admitted:
            state.queue[:] = [r for r in state.queue if r.state is State.QUEUED]

    def _placement(self, request: LiveRequest) -> Placement | None:
        """Where ``request`` starts: its session's parked sequence when one helps, else a new sequence
        on the worker ``place`` picks, evicting idle sessions' KV for the room; None: not now."""
        needed = request.needed_tokens
        reused = self.state.sessions.reuse(request, needed)
        if reused is WAIT:
            return None
        if isinstance(reused, Placement):
            return reused
        while True:  # the batch limit is per worker: a full worker takes no new sequence
            roomy = [w for w in self.state.pool.ready() if w.running < self._batch_limit(w)]
            if not roomy:
                return None
            identity = self.place(request, roomy)
            if identity is not None:
                return Placement(worker=self.state.pool.workers[identity])
            if not self.state.sessions.evict_lru():
                return None

    def _batch_limit(self, worker: WorkerInfo) -> int:
        """How many sequences ``worker`` may run: ``limits.max_batch_size``, or less where its decode
        throughput stopped growing below that (``limits.adaptive_batch``, :mod:`.batch_ceiling`)."""
        return worker.batch.ceiling if worker.batch is not None else self.state.limits.max_batch_size
