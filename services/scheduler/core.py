"""The scheduler's pure core: the live sequences and every decision about them, as data in, data out.

No sockets, no event loop, no tokenizer loading: the service shell (``service.py``) feeds it what
arrives (submits, control messages, worker hellos, step results, main-channel replies) and sends
what it returns (``Dispatch`` steps per worker, the ``Outbox``'s token events and failures per
gateway). One step, as the shell drives it:

1. :meth:`SchedulerCore.admit` moves queued requests onto workers within their KV budgets
   (``place`` picks the worker of a new sequence; a session turn continues its parked sequence).
2. :meth:`plan_controlled` / :meth:`controlled_planned`: the controlled sequences' part of the step
   (the ``post_pre_process`` to send on the main channel, then its reply).
3. :meth:`build_steps`: one ``Step`` per worker, decoding sequences first (one token each) then
   prompt chunks within ``limits.step_token_budget``, plus the frees owed to each worker.
4. :meth:`apply` per worker result: stop tokens, lengths, prompt outputs; the text of a token that
   does not end its request is worked out later (:meth:`emit_deferred`), while the next step runs.
5. :meth:`end_step`: controlled requests' events and endings.

Pipelining (``limits.pipeline_depth`` 2): a decoding sequence already in the step in flight gets a
``follow`` SeqStep in the next one (the worker feeds the token it sampled); when that token turns out
to end the request (EOS, a stop string), the token sampled after it is dropped. A session turn
follows too: the token a follow fed is in the KV it parks (a placeholder when its turn ended before
the scheduler saw it, which the next turn backtracks over).

Plain and controlled requests share one set of finish rules (``requests.stop_token`` and
``requests.length_reached``); stop strings come from each sequence's ``TextStream``.
"""

from __future__ import annotations

import itertools
import operator
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

import structlog

from common import aici_wire, wire
from common.admission import ContextLengthExceeded, context_budget
from common.config import Controllers, Limits, Sessions
from common.errors import (
    ERROR_TRAITS,
    INTERNAL_ERROR,
    INVALID_REQUEST,
    MEMORY_PRESSURE,
    MODEL_LOADING_ERROR,
    SERVICE_UNAVAILABLE,
)
from common.textstream import TextStream
from services.scheduler.controlled import Branch, ControlledSteps, MainReply, Plan
from services.scheduler.requests import LiveRequest, State, length_reached, stop_tokens
from services.scheduler.sessions import WAIT, Placement, SessionKV
from services.scheduler.workers import Place, WorkerPool, least_loaded

log = structlog.get_logger()

Item = tuple[LiveRequest | Branch, wire.SeqStep]
_sort_key = operator.attrgetter("sort_key")


@dataclass
class Dispatch:
    """One worker's step, and what its result is applied to (opaque to the shell)."""

    worker: bytes
    step: wire.Step
    batch: list[Item]
    frames: list[bytes] = field(default_factory=list)  # the mask frame, when the masks go with the step


class Outbox:
    """Messages for gateways in the order they arose: a step's token events gathered into one
    ``Events`` per gateway, a ``RequestFailed`` after the events before it."""

    def __init__(self) -> None:
        self._events: dict[bytes, list[wire.TokenEvent]] = defaultdict(list)
        self._ready: list[tuple[bytes, wire.Msg]] = []

    def event(self, gateway: bytes, event: wire.TokenEvent) -> None:
        self._events[gateway].append(event)

    def events_of(self, gateway: bytes) -> list[wire.TokenEvent]:
        """Where ``event`` puts ``gateway``'s next events, until the next ``message``."""
        return self._events[gateway]

    def message(self, gateway: bytes, msg: wire.Msg) -> None:
        self._close()
        self._ready.append((gateway, msg))

    def _close(self) -> None:
        self._ready += [(gateway, wire.Events(events=events)) for gateway, events in self._events.items()]
        self._events.clear()

    def take(self) -> list[tuple[bytes, wire.Msg]]:
        self._close()
        ready, self._ready = self._ready, []
        return ready


class SchedulerCore:
    """Every live request of one scheduler (see the module docstring). ``text_stream(stop)`` makes a
    request's detokenizer; ``place`` is the placement policy of new sequences, ``worker_gone`` tells
    it that a worker was lost (``place`` only sees the workers with room); ``clock`` gives monotonic
    seconds (deadlines, session TTLs)."""

    def __init__(
        self,
        limits: Limits,
        sessions: Sessions,
        controllers: Controllers,
        text_stream: Callable[[list[str]], TextStream],
        *,
        place: Place = least_loaded,
        worker_gone: Callable[[bytes], None] = lambda identity: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limits = limits
        self.text_stream = text_stream
        self.place = place
        self.worker_gone = worker_gone
        self.clock = clock
        self.pool = WorkerPool(clock)
        self.requests: dict[str, LiveRequest] = {}
        self.queue: list[LiveRequest] = []
        self.running: dict[int, LiveRequest] = {}  # seq_id -> request (running or paused)
        # the same by worker (a worker's step is built from its own), and its controlled ones' count
        self.running_on: dict[bytes, dict[int, LiveRequest]] = defaultdict(dict)
        self.controlled_on: Counter[bytes] = Counter()
        self._order_on: dict[bytes, list[LiveRequest]] = {}  # its plain ones in step order (see _plain_order)
        self.to_free: dict[bytes, list[int]] = defaultdict(list)
        self.outbox = Outbox()
        # tokens accepted from the last step whose text is worked out while the next one runs
        self.deferred: list[LiveRequest] = []  # (their events in ``LiveRequest.deferred``)
        self.orders = itertools.count()
        self.seq_ids = itertools.count(1)
        self.step_ids = itertools.count(1)
        self.sessions = SessionKV(sessions, self.pool, self.free_seq, clock)
        self.controlled = ControlledSteps(self, controllers)

    @property
    def prefill_chunk_tokens(self) -> int:
        return self.limits.prefill_chunk_tokens

    # ------------------------------------------------------------------------------------------
    # model facts, from the first ready worker

    def model_facts(self) -> wire.WorkerHello | None:
        ready = self.pool.ready()
        return ready[0].hello if ready else None

    def max_model_len(self) -> int:
        facts = self.model_facts()
        return facts.max_model_len if facts else self.limits.max_model_len

    # ------------------------------------------------------------------------------------------
    # gateways

    def submit(self, gateway: bytes, submit: wire.Submit) -> wire.Msg:
        """Queue a request (Queued) or refuse it (Error)."""

        def refuse(code: str, message: str) -> wire.Error:
            return wire.Error(code=code, message=message, rid=submit.rid)

        if submit.rid in self.requests:
            return refuse(INVALID_REQUEST, f"request id {submit.rid!r} is already live")
        if not submit.prompt_ids:
            return refuse(INVALID_REQUEST, "the prompt has no tokens")
        facts = self.model_facts()
        stage = self.pool.summary() if facts is None else None
        if stage is not None and stage.stage == "failed":
            return refuse(MODEL_LOADING_ERROR, f"the model failed to load: {stage.message}")
        if facts is not None and not (min(submit.prompt_ids) >= 0 and max(submit.prompt_ids) < facts.vocab_size):
            return refuse(INVALID_REQUEST, f"prompt token ids must lie in [0, {facts.vocab_size})")
        if submit.max_tokens < 0:
            return refuse(INVALID_REQUEST, "max_tokens must be >= 0 (0: prefill only)")
        try:  # the max_tokens policy: what does not fit is refused, never cut
            context_budget(len(submit.prompt_ids), submit.max_tokens, self.max_model_len(), submit.max_tokens)
            if facts is not None and facts.kv_capacity_tokens:  # a worker's whole KV pool could never hold more
                context_budget(len(submit.prompt_ids), submit.max_tokens, facts.kv_capacity_tokens, submit.max_tokens,
                               what="the KV cache")
        except ContextLengthExceeded as exc:
            return refuse(exc.code, exc.message)
        if len(self.queue) >= self.limits.max_queued:
            return refuse(MEMORY_PRESSURE, f"{len(self.queue)} requests are already waiting; try again shortly")
        timeout = submit.timeout_s if submit.timeout_s > 0 else self.limits.request_timeout_s
        request = LiveRequest(
            submit=submit,
            gateway=gateway,
            order=next(self.orders),
            text=self.text_stream(list(submit.stop)),
            deadline=self.clock() + timeout,
        )
        self.requests[submit.rid] = request
        self.queue.append(request)
        structlog.contextvars.bind_contextvars(request_id=submit.rid)
        log.info("scheduler.submitted", prompt_tokens=len(submit.prompt_ids), max_tokens=submit.max_tokens)
        structlog.contextvars.unbind_contextvars("request_id")
        return wire.Queued(rid=submit.rid, waiting=len(self.queue))

    def control(self, gateway: bytes, msg: wire.Cancel | wire.Pause | wire.Resume | wire.Modify) -> wire.Msg:
        """Cancel, pause, resume or modify one of ``gateway``'s live requests."""
        request = self.requests.get(msg.rid)
        if request is None or request.gateway != gateway:
            return wire.Error(code=INVALID_REQUEST, message=f"no live request {msg.rid!r}", rid=msg.rid)
        if isinstance(msg, wire.Cancel):
            self.finish(request, "cancelled")
        elif isinstance(msg, wire.Pause):
            request.paused = True
        elif isinstance(msg, wire.Resume):
            request.paused = False
        elif isinstance(msg, wire.Modify):
            if msg.patch.max_tokens is not None:
                try:
                    context_budget(len(request.prompt), msg.patch.max_tokens, self.max_model_len(), msg.patch.max_tokens)
                except ContextLengthExceeded as exc:
                    return wire.Error(code=exc.code, message=exc.message, rid=msg.rid)
            request.apply_patch(msg.patch)
            if request.state is not State.QUEUED and len(request.generated) >= request.submit.max_tokens:
                self.finish(request, "length")
        return wire.RequestState(rid=request.rid, state=request.state.value, paused=request.paused)

    def drop_session(self, key: str) -> None:
        """A closed session: its live turns are cancelled and its parked KV let go."""
        for request in [r for r in self.requests.values() if r.submit.session and r.submit.session.key == key]:
            self.finish(request, "cancelled", park=False)
        self.sessions.drop(key)

    def gateway_lost(self, gateway: bytes) -> int:
        """Cancel the requests of a gateway that died; how many there were."""
        orphans = [r for r in self.requests.values() if r.gateway == gateway]
        for request in orphans:
            self.finish(request, "cancelled")
        return len(orphans)

    def expire(self) -> None:
        """Requests past their deadline time out; sessions parked past their TTL are let go."""
        now = self.clock()
        for request in list(self.requests.values()):
            if now > request.deadline:
                self.finish(request, "timeout")
        self.sessions.expire()

    def take_output(self) -> list[tuple[bytes, wire.Msg]]:
        """What to send to gateways now: ``Events`` and ``RequestFailed`` messages, in order."""
        return self.outbox.take()

    # ------------------------------------------------------------------------------------------
    # workers

    def worker_hello(self, identity: bytes, hello: wire.WorkerHello) -> bool:
        """A worker announced itself or its loading progress; whether its stage or progress changed.
        A new incarnation under a known identity is a restarted worker: the old one's requests are lost."""
        known = self.pool.workers.get(identity)
        if known is not None and known.hello.incarnation != hello.incarnation:
            self.worker_lost(identity, "the worker restarted")
            known = None
        changed = known is None or (known.hello.stage, known.hello.progress) != (hello.stage, hello.progress)
        self.pool.on_hello(identity, hello)
        return changed

    def worker_lost(self, identity: bytes, reason: str) -> None:
        """A worker died or stopped answering: its requests fail (retryable), its parked KV is gone."""
        log.warning("scheduler.worker_lost", worker=identity.decode(errors="replace"), reason=reason)
        self.pool.drop(identity)
        self.worker_gone(identity)
        self.to_free.pop(identity, None)
        self.sessions.drop_worker(identity)
        for request in list(self.running_on.get(identity, {}).values()):
            self.fail(request, SERVICE_UNAVAILABLE, f"{reason}; the request was lost, retry it")

    # ------------------------------------------------------------------------------------------
    # Host: what controlled requests use

    def new_seq_id(self) -> int:
        return next(self.seq_ids)

    def reserve(self, worker: bytes, tokens: int) -> None:
        info = self.pool.workers.get(worker)
        if info is not None:
            info.reserved_tokens += tokens

    def free_seq(self, worker: bytes, seq_id: int) -> None:
        """Free a worker's sequence with its next step (nothing when the worker is gone)."""
        if worker in self.pool.workers:
            self.to_free[worker].append(seq_id)

    def emit(self, request: LiveRequest, events: Iterable[wire.TokenEvent]) -> None:
        for event in events:
            self.outbox.event(request.gateway, event)

    # ------------------------------------------------------------------------------------------
    # the step

    def admit(self) -> None:
        """Move queued requests (priority, then arrival order) onto workers while they fit."""
        if not self.queue:
            return
        self.queue.sort(key=lambda r: r.sort_key)
        admitted = False
        for request in self.queue:
            if request.paused:
                continue
            placement = self._placement(request)
            if placement is None:
                break  # keep priority order: nothing behind it jumps the queue
            worker = placement.worker
            request.state = State.RUNNING
            request.seq_id = placement.seq_id if placement.seq_id is not None else self.new_seq_id()
            request.fork_of, request.backtrack = placement.fork_of, placement.backtrack
            request.fed = request.applied = request.cached_tokens = placement.start
            request.kv_tokens = list(placement.held or [])
            request.worker = worker.identity
            request.stop_ids = stop_tokens(request.submit, worker.hello.eos_token_ids)
            request.reserved = request.needed_tokens
            worker.reserved_tokens += request.reserved
            worker.running += 1
            self.running[request.seq_id] = self.running_on[worker.identity][request.seq_id] = request
            self._order_on.pop(worker.identity, None)
            self.controlled_on[worker.identity] += bool(request.submit.controller)
            admitted = True
        if admitted:
            self.queue = [r for r in self.queue if r.state is State.QUEUED]

    def _placement(self, request: LiveRequest) -> Placement | None:
        """Where ``request`` starts: its session's parked sequence when one helps, else a new sequence
        on the worker ``place`` picks, evicting idle sessions' KV for the room; None: not now."""
        needed = request.needed_tokens
        reused = self.sessions.reuse(request, needed)
        if reused is WAIT:
            return None
        if isinstance(reused, Placement):
            return reused
        while True:  # limits.max_batch_size is per worker: a full worker takes no new sequence
            roomy = [w for w in self.pool.ready() if w.running < self.limits.max_batch_size]
            if not roomy:
                return None
            identity = self.place(request, roomy)
            if identity is not None:
                return Placement(worker=self.pool.workers[identity])
            if not self.sessions.evict_lru():
                return None

    def plan_controlled(self) -> tuple[Plan, aici_wire.PostPreProcess | None]:
        """The controlled part of the next step; send the request (when there is one) and pass its
        reply to :meth:`controlled_planned`, or, for a plan that goes ahead (``plan.ahead``: it goes into
        the step at once), to ``controlled.ahead_planned``."""
        return self.controlled.begin(self.running.values(), self.limits.step_token_budget,
                                     may_go_ahead=not self._plain_running())

    def controlled_workers(self) -> set[bytes]:
        """The workers running controlled requests: a controlled plan needs a step on each of them."""
        return {worker for worker, running in self.controlled_on.items() if running}

    def controlled_planned(self, plan: Plan, reply: MainReply | None) -> Plan:
        return plan if reply is None else self.controlled.planned(plan, reply)

    def mid_first(self) -> aici_wire.MidProcess | None:
        """The planned ``mid_process`` to run *before* its step is built, when plain sequences are
        running: a step waiting for its masks would hold them up for as long as the slowest controller
        takes (its masks then go with the step). None: there is none, or no plain sequence runs and it
        runs while the worker computes the forward pass (``masks_follow``)."""
        if not self._plain_running():
            return None
        return self.controlled.mid_request()

    def _plain_running(self) -> bool:
        return any(not r.submit.controller and not r.paused for r in self.running.values())

    def build_steps(self, controlled: Plan | None = None, workers: Collection[bytes] | None = None) -> list[Dispatch]:
        """The next step for each worker (of ``workers``; None: all) that has sequences to run or to
        free. The workers of a ``controlled`` plan must be among ``workers``."""
        if controlled is None:
            controlled = Plan()
        else:
            self.controlled.built()
        per_worker: dict[bytes, list[Item]] = defaultdict(list)
        for identity, items in controlled.per_worker.items():
            per_worker[identity] += [(b, s) for b, s in items if b.finished is None and b.request.state is State.RUNNING]
        # limits.step_token_budget is per worker (each runs its own forward pass)
        budget = {identity: self.limits.step_token_budget - sum(max(len(s.tokens), 1) for _, s in items)
                  for identity, items in per_worker.items()}
        max_len = self.max_model_len()
        on = self.running_on
        for identity in on if workers is None else workers:
            running = on.get(identity)
            if running:
                left = budget.get(identity, self.limits.step_token_budget)
                batch = self._build_batch(identity, running, left, max_len)
                if batch:
                    per_worker[identity] += batch
        steps = []
        for identity in set(per_worker) | {i for i, seqs in self.to_free.items()
                                           if seqs and (workers is None or i in workers)}:
            worker = self.pool.workers.get(identity)
            if worker is None:
                continue
            batch = per_worker.get(identity, [])
            step = wire.Step(step_id=next(self.step_ids), seqs=[s for _, s in batch], free=self.to_free.pop(identity, []),
                             free_all=worker.fresh)
            step.masks_follow = self.controlled.awaits_masks(step)
            worker.fresh = False
            steps.append(Dispatch(identity, step, batch, self.controlled.masks_with(step)))
        return steps

    def _build_batch(self, identity: bytes, running: dict[int, LiveRequest], left: int, max_len: int) -> list[Item]:
        """One worker's plain sequences in its next step, within ``left`` tokens: decoding sequences
        first (one token each), then prompt chunks, each in priority then arrival order."""
        batch: list[Item] = []
        prefilling: list[LiveRequest] = []
        for request in self._plain_order(identity, running):
            if left <= 0:
                break
            if request.paused:
                continue
            if request.fed < len(request.prompt):
                prefilling.append(request)
                continue
            if request.in_flight:
                if not self._follows(request, max_len):
                    continue
                # decoding in the step in flight: feed its sample (the same SeqStep every time, unless
                # its sampling parameters go with it)
                seq = request.follow_step
                if seq is None or request.sampling_dirty:
                    seq = wire.SeqStep(seq_id=request.seq_id, tokens=[], follow=True)
                    request.follow_step = None if request.sampling_dirty else seq
                request.follows += 1
            else:  # decoding: feed the token sampled last
                seq = wire.SeqStep(seq_id=request.seq_id, tokens=[request.pending])
                self._session_feed(request, seq)
            left -= 1
            if request.sampling_dirty:
                seq.sampling = request.submit.sampling
                request.sampling_dirty = False
            request.in_flight += 1
            request.last_sample = True
            batch.append((request, seq))
        chunk = self.limits.prefill_chunk_tokens
        for request in prefilling:
            if left <= 0:
                break
            if request.in_flight and (request.in_flight > 1 or request.last_sample):
                continue  # a chunk goes while the one before it runs, unless that one samples
            tokens, sample = request.next_feed(min(chunk, left))
            left -= len(tokens)
            seq = wire.SeqStep(seq_id=request.seq_id, tokens=tokens, sample=sample, images=request.images_in(tokens))
            self._session_feed(request, seq)
            request.fed += len(tokens)
            if request.sampling_dirty:
                seq.sampling = request.submit.sampling
                request.sampling_dirty = False
            request.in_flight += 1
            request.last_sample = seq.sample
            batch.append((request, seq))
        return batch

    def _plain_order(self, identity: bytes, running: dict[int, LiveRequest]) -> list[LiveRequest]:
        """A worker's plain requests in priority then arrival order; sorted again only after its
        requests changed (admission, release), not every step."""
        order = self._order_on.get(identity)
        if order is None:
            order = self._order_on[identity] = sorted((r for r in running.values() if not r.controlled), key=_sort_key)
        return order

    @staticmethod
    def _follows(request: LiveRequest, max_len: int) -> bool:
        """Whether a decoding request with a step in flight may ``follow`` it: one step in flight that
        samples a token that will not be its last, and no readout of decoded positions (the step
        feeding a position reads it out; a follow asks for none)."""
        if request.in_flight > 1 or not request.last_sample or request.readout_positions:
            return False
        after = len(request.generated) + 1  # tokens once the step in flight is applied
        return not length_reached(request.submit, after, len(request.prompt) + after, max_len)

    def step_done(self, worker: bytes, result: wire.StepResult) -> None:
        """Note what a step result says about its worker (before :meth:`apply`)."""
        info = self.pool.workers.get(worker)
        if info is not None and result.kv_free_tokens >= 0:
            info.kv_free_tokens = result.kv_free_tokens
            info.kv_cached_tokens = max(result.kv_cached_tokens, 0)

    def apply(self, dispatch: Dispatch, result: wire.StepResult) -> None:
        """Apply one worker's step result to the sequences it ran. The common case, a decoding
        sequence's token, is a handful of operations inline (this runs for every token)."""
        failures = {f.seq_id: f.message for f in result.failures}
        max_len = self.max_model_len()
        samples, readouts = result.samples, result.readouts
        deferred, finished = self.deferred, State.FINISHED
        for request, seq in dispatch.batch:
            if isinstance(request, Branch):
                self.controlled.apply(request, seq, result, max_len)
                continue
            request.in_flight -= 1
            if seq.fork_of is not None:
                self.sessions.forked(seq.fork_of)
            if request.state is finished:  # cancelled while its step ran
                if seq.seq_id in failures:
                    self.sessions.failed(seq.seq_id)
                continue
            if seq.seq_id in failures:
                self.fail(request, INTERNAL_ERROR, f"the worker failed this sequence: {failures[seq.seq_id]}")
                continue
            prompt = request.prompt
            if request.applied < len(prompt):
                self._prompt_outputs(request, seq, result)
                request.cached_tokens += result.cached_tokens.get(seq.seq_id, 0)
                request.applied += len(seq.tokens)
                if request.submit.max_tokens == 0 and request.applied == len(prompt):
                    self.finish(request, "length")
            else:
                request.pending = None
                if readouts:
                    self._decoded_readouts(request, seq, result)
            if not seq.sample:
                continue
            sampled = samples.get(seq.seq_id)
            if sampled is None:
                self.fail(request, INTERNAL_ERROR, "the worker returned no token for this sequence")
                continue
            token = sampled.token_id
            generated = request.generated
            generated.append(token)
            request.pending = token
            if request.follows:  # the follow step sent after this one feeds it (at most one is ahead)
                request.follows = 0
                request.kv_tokens.append(token)
            event = wire.TokenEvent(rid=request.rid, tokens=[sampled])
            if token in request.stop_ids:  # requests.stop_token, its set made at admission
                self.finish(request, "stop", event, stop_reason=token)
            elif length_reached(request.submit, len(generated), len(prompt) + len(generated), max_len):
                self._emit_text(request, event, last=True)
            else:
                # Decoding goes on: its text (detokenizing, stop strings) is worked out once the next
                # step is on its way. A stop string found then ends the request, and the token that
                # step samples for it is dropped.
                if not request.deferred:
                    deferred.append(request)
                request.deferred.append(event)

    def _emit_text(self, request: LiveRequest, event: wire.TokenEvent, last: bool) -> None:
        """The text of a token event; finish on a completed stop string, or when it was the ``last``."""
        event.text = request.text.push_one(event.tokens[0].token_id)
        if request.text.stopped_by is not None:
            self.finish(request, "stop", event, stop_reason=request.text.stopped_by)
        elif last:
            self.finish(request, "length", event)
        else:
            self.outbox.event(request.gateway, event)

    def emit_deferred(self) -> None:
        """Work out the text of the tokens applied last (the shell calls it while a step runs)."""
        deferred, self.deferred = self.deferred, []
        for request in deferred:
            self._emit_deferred_of(request)

    def _emit_deferred_of(self, request: LiveRequest) -> None:
        """Work out a request's deferred token texts now (or before it ends for another reason):
        ``_emit_text`` inline, as it runs for every token."""
        events, request.deferred = request.deferred, []
        if request.state is State.FINISHED:  # cancelled or failed since
            return
        text = request.text
        out = self.outbox.events_of(request.gateway)
        for event in events:
            event.text = text.push_one(event.tokens[0].token_id)
            if text.stopped_by is not None:  # the rest of its events are dropped
                self.finish(request, "stop", event, stop_reason=text.stopped_by)
                return
            out.append(event)

    def end_step(self) -> None:
        """After a step's results: controlled requests' events and endings."""
        self.controlled.flush()

    # ------------------------------------------------------------------------------------------
    # endings

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
        self._emit_deferred_of(request)
        if request.state is State.FINISHED:  # its deferred text completed a stop string
            return
        event = event or wire.TokenEvent(rid=request.rid)
        if reason != "stop" or isinstance(stop_reason, int):
            event.text += request.text.flush()
        event.finish_reason = reason
        event.stop_reason = stop_reason
        event.prompt_tokens = len(request.prompt)
        event.completion_tokens = len(request.generated)
        event.cached_tokens = request.cached_tokens
        self.outbox.event(request.gateway, event)
        self._release(request, park=park and reason != "timeout")
        structlog.contextvars.bind_contextvars(request_id=request.rid)
        log.info("scheduler.finished", reason=reason, completion_tokens=len(request.generated))
        structlog.contextvars.unbind_contextvars("request_id")

    def fail(self, request: LiveRequest, code: str, message: str) -> None:
        """End ``request`` with an error (a ``RequestFailed`` after the events before it)."""
        if request.state is State.FINISHED:
            return
        recoverable, action, _ = ERROR_TRAITS[code]
        self._release(request)
        self.outbox.message(request.gateway, wire.RequestFailed(rid=request.rid, code=code, message=message,
                                                                recoverable=recoverable, recovery_action=action))

    def _release(self, request: LiveRequest, park: bool = False) -> None:
        """End a request; a finished session turn's sequence is parked for the next turn (``park``)."""
        if request.state is State.QUEUED:
            self.queue.remove(request)
        elif request.seq_id in self.running:
            del self.running[request.seq_id]
            del self.running_on[request.worker][request.seq_id]
            self._order_on.pop(request.worker, None)
            self.controlled_on[request.worker] -= bool(request.submit.controller)
            if request.fork_of is not None:  # its fork step was never sent
                self.sessions.forked(request.fork_of)
            worker = self.pool.workers.get(request.worker)
            if worker is not None:
                worker.reserved_tokens -= request.reserved
                worker.running -= 1
                if not (park and self.sessions.park(request, worker)):
                    self.to_free[request.worker].append(request.seq_id)
        request.state = State.FINISHED
        self.requests.pop(request.rid, None)
        if request.submit.controller:
            self.controlled.release(request)

    # ------------------------------------------------------------------------------------------
    # per-position outputs and session turns

    def _session_feed(self, request: LiveRequest, seq: wire.SeqStep) -> None:
        """Session-turn parts of a SeqStep: the first one's fork/backtrack of a parked sequence,
        the per-position outputs of the prompt positions it feeds; and what the sequence will hold."""
        if request.fork_of is not None or request.backtrack:
            seq.fork_of, seq.backtrack = request.fork_of, request.backtrack
            request.fork_of, request.backtrack = None, 0
        if seq.backtrack:
            del request.kv_tokens[len(request.kv_tokens) - seq.backtrack :]
        request.kv_tokens += seq.tokens
        request.on_worker = True
        if request.fed >= len(request.prompt):  # decoding: the token fed is the last one sampled
            if request.readout_positions:
                position = len(request.prompt) + len(request.generated) - 1
                if position in request.readout_positions:
                    seq.readouts = [position]
            return
        if not (request.logprob_positions or request.readout_positions):
            return
        prompt, start = request.prompt, request.fed
        fed = range(start, start + len(seq.tokens))
        seq.scores = [wire.ScoreQuery(q, prompt[q + 1]) for q in fed if q + 1 in request.logprob_positions
                      and q + 1 < len(prompt)]
        seq.readouts = [p for p in fed if p in request.readout_positions]
        if seq.scores and request.submit.outputs is not None:
            seq.top_logprobs = request.submit.outputs.top_logprobs

    def _prompt_outputs(self, request: LiveRequest, seq: wire.SeqStep, result: wire.StepResult) -> None:
        """One event with the outputs of the prompt positions this step fed and were asked about."""
        if not (request.logprob_positions or request.readout_positions):
            return
        for score in result.scores.get(seq.seq_id, []):
            request.scored[score.position + 1] = score
        readouts = {r.position: r.values for r in result.readouts.get(seq.seq_id, [])}
        outputs = []
        for p in range(request.applied, request.applied + len(seq.tokens)):
            if p not in request.logprob_positions and p not in request.readout_positions:
                continue
            out = wire.PositionOutput(position=p, token_id=request.prompt[p], readout=readouts.get(p, b""))
            score = request.scored.pop(p, None)
            if score is not None:
                out.logprob, out.top = score.logprob, score.top
            outputs.append(out)
        if outputs:
            self.outbox.event(request.gateway, wire.TokenEvent(rid=request.rid, prompt_outputs=outputs))

    def _decoded_readouts(self, request: LiveRequest, seq: wire.SeqStep, result: wire.StepResult) -> None:
        """The readout of a decoded token, computed by the step that fed it (the one after its sampling),
        as an event of its own (a ``PositionOutput`` past the prompt)."""
        outputs = [wire.PositionOutput(position=r.position, token_id=seq.tokens[0], readout=r.values)
                   for r in result.readouts.get(seq.seq_id, [])]
        if outputs:
            self.outbox.event(request.gateway, wire.TokenEvent(rid=request.rid, prompt_outputs=outputs))

    # ------------------------------------------------------------------------------------------
    # figures

    def facts(self) -> wire.ModelFacts:
        """The core's part of the scheduler's health reply (the shell adds the model's name and the
        controller runtime's state)."""
        ready = self.pool.ready()
        hello = self.model_facts() or wire.WorkerHello(worker_id="", stage="absent")
        return wire.ModelFacts(
            worker=self.pool.summary(),
            vocab_size=hello.vocab_size,
            max_model_len=self.max_model_len(),
            eos_token_ids=hello.eos_token_ids,
            kv_capacity_tokens=sum(w.capacity for w in ready),
            # a worker with no step yet: all of it free
            # the KV pools as the workers' last steps left them (a worker with no step yet: all free):
            # free (empty) + cached (reusable prefixes, evicted on demand) + used = capacity
            kv_free_tokens=sum(w.capacity if w.kv_free_tokens is None else w.kv_free_tokens for w in ready),
            kv_cached_tokens=sum(w.kv_cached_tokens for w in ready),
            kv_used_tokens=sum(w.capacity - w.kv_free_tokens - w.kv_cached_tokens
                               for w in ready if w.kv_free_tokens is not None),
            kv_reserved_tokens=sum(w.reserved_tokens for w in ready),
            queued=len(self.queue),
            running=len(self.running),
            paused=sum(1 for r in self.requests.values() if r.paused),
            hidden_size=hello.hidden_size,
            readout_concepts=hello.readout_concepts,
            readout_layers=hello.readout_layers,
            parked_sessions=len(self.sessions.parked),
            parked_tokens=self.sessions.parked_tokens(),
        )

