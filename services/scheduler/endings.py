"""How requests end (finished, failed, released, a session turn's sequence parked), and the text of
their tokens, which may end them on a stop string: worked out inline, or deferred while the next step
runs."""

from __future__ import annotations

import structlog

from common import wire
from common.errors import ERROR_TRAITS
from common.textstream import ends_with_flush
from services.scheduler.controlled import ControlledSteps
from services.scheduler.requests import LiveRequest, State
from services.scheduler.state import CoreState

log = structlog.get_logger()


class Endings:
    """Ends requests on the core's ``state``; a controlled one is also let go of by ``controlled``."""

    def __init__(self, state: CoreState, controlled: ControlledSteps) -> None:
        self.state = state
        self.controlled = controlled

    def finish(
        self,
        request: LiveRequest,
        reason: str,
        event: wire.TokenEvent | None = None,
        stop_reason: str | int | None = None,
        *,
        park: bool = True,
    ) -> None:
        """End ``request`` with ``reason``; a session turn's KV is parked for the next turn unless
        ``park`` is false (or the turn timed out)."""
        if request.state is State.FINISHED:
            return
        self.emit_deferred_of(request)
        if request.state is State.FINISHED:  # its deferred text completed a stop string
            return
        event = event or wire.TokenEvent(rid=request.rid)
        if request.text is not None and ends_with_flush(reason, stop_reason):
            event.text += request.text.flush()
        event.finish_reason = reason
        event.stop_reason = stop_reason
        event.prompt_tokens = len(request.prompt)
        event.completion_tokens = len(request.generated)
        event.cached_tokens = request.cached_tokens
        self.state.outbox.event(request.gateway, event)
        self._release(request, park=park and reason != "timeout")
        log.info("scheduler.finished", request_id=request.rid, reason=reason, completion_tokens=len(request.generated))

    def fail(self, request: LiveRequest, code: str, message: str) -> None:
        """End ``request`` with an error (a ``RequestFailed`` after the events before it)."""
        if request.state is State.FINISHED:
            return
        recoverable, action, _ = ERROR_TRAITS[code]
        self._release(request)
        self.state.outbox.message(request.gateway, wire.RequestFailed(
            rid=request.rid, code=code, message=message, recoverable=recoverable, recovery_action=action))

    def _release(self, request: LiveRequest, park: bool = False) -> None:
        """End a request; a finished session turn's sequence is parked for the next turn (``park``)."""
        state = self.state
        if request.state is State.QUEUED:
            state.queue.remove(request)
        elif request.seq_id in state.running:
            state.stop(request)
            if request.fork_of is not None:  # its fork step was never sent
                state.sessions.forked(request.fork_of)
            worker = state.pool.workers.get(request.worker)
            if worker is not None:
                worker.reserved_tokens -= request.reserved
                worker.running -= 1
                if not (park and state.sessions.park(request, worker)):
                    state.to_free[request.worker].append(request.seq_id)
        request.state = State.FINISHED
        state.requests.pop(request.rid, None)
        if request.submit.controller:
            self.controlled.release(request)

    def emit_text(self, request: LiveRequest, event: wire.TokenEvent, last: bool) -> None:
        """The text of a token event (after the text of the request's tokens before it); finish on a
        completed stop string, or when it was the ``last``."""
        if request.deferred:
            self.emit_deferred_of(request)
            if request.state is State.FINISHED:  # the tokens before it completed a stop string
                return
        text = request.text
        if text is not None:
            event.text = text.push_one(event.tokens[0].token_id)
            if text.stopped_by is not None:
                self.finish(request, "stop", event, stop_reason=text.stopped_by)
                return
        if last:
            self.finish(request, "length", event)
        else:
            self.state.outbox.event(request.gateway, event)

    def emit_deferred(self) -> None:
        """Work out the text of the tokens applied last (the shell calls it while a step runs)."""
        deferred, self.state.deferred = self.state.deferred, []
        for request in deferred:
            self.emit_deferred_of(request)

    def emit_deferred_of(self, request: LiveRequest) -> None:
        """Work out a request's deferred token texts now (or before it ends for another reason):
        ``emit_text`` inline, as it runs for every token."""
        events, request.deferred = request.deferred, []
        if not events or request.state is State.FINISHED:  # none, or cancelled or failed since
            return
        text = request.text
        assert text is not None  # only a request with stop strings defers its text
        out = self.state.outbox.events_of(request.gateway)
        for event in events:
            event.text = text.push_one(event.tokens[0].token_id)
            if text.stopped_by is not None:  # the rest of its events are dropped
                self.finish(request, "stop", event, stop_reason=text.stopped_by)
                return
            out.append(event)
