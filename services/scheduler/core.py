"""The scheduler's pure core: the live sequences and every decision about them, as data in, data out.

No sockets, no event loop, no tokenizer loading: the service shell (``service.py``) feeds it what
arrives (submits, control messages, worker hellos, step results, main-channel replies) and sends
what it returns (``Dispatch`` steps per worker, the ``Outbox``'s token events and failures per
gateway). One step, as the shell drives it:

1. :meth:`SchedulerCore.admit` moves queued requests onto workers within their KV budgets
   (``place`` picks the worker of a new sequence; a session turn continues its parked sequence).
2. :meth:`plan_controlled` / :meth:`controlled_planned`: the controlled sequences' part of the step
   (the ``post_pre_process`` to send on the main channel, then its reply); or :meth:`follow_controlled`,
   the next one sent before the result of the one in flight.
3. :meth:`build_steps`: one ``Step`` per worker, decoding sequences first (one token each) then
   prompt chunks within ``limits.step_token_budget``, plus the frees owed to each worker.
4. :meth:`apply` per worker result: stop tokens, lengths, prompt outputs, text; the text of a token
   that may complete a stop string is worked out later (:meth:`emit_deferred`), while the next step runs.
5. :meth:`end_step`: controlled requests' events and endings (:meth:`end_controlled` already after the
   main-channel calls, for those the calls ended).

Pipelining (``limits.pipeline_depth`` 2): a decoding sequence already in the step in flight gets a
``follow`` in the next one (the worker feeds the token it sampled); when that token turns out to end
the request (EOS, a stop string), the token sampled after it is dropped. A decoding sequence that goes
on following is one of its worker's *followers* (``batch.WorkerBatch``): every step carries those as a
packed array of ids (``Step.follows``), with no SeqStep and no decision per sequence, and their tokens
come back first in the result's packed arrays. A session turn follows too: the token a follow fed is in
the KV it parks (a placeholder when its turn ended before the scheduler saw it, which the next turn
backtracks over).

Plain and controlled requests share one set of finish rules (``requests.stop_token`` and
``requests.length_reached``); stop strings come from each sequence's ``TextStream``.
"""

from __future__ import annotations

import itertools
import time
from array import array
from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

import numpy as np
import structlog

from common import aici_wire, quotas, wire
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
from common.pooling import vector_bytes
from common.textstream import TextStream, ends_with_flush
from services.scheduler.batch import WorkerBatch
from services.scheduler.batch_ceiling import BatchCeiling
from services.scheduler.controlled import Branch, ControlledSteps, MainReply, Plan
from services.scheduler.requests import LiveRequest, State, stop_tokens, token_limit
from services.scheduler.sessions import WAIT, Placement, SessionKV
from services.scheduler.workers import Place, WorkerInfo, WorkerPool, least_loaded

log = structlog.get_logger()

Item = tuple[LiveRequest | Branch, wire.SeqStep]


@dataclass
class Dispatch:
    """One worker's step, and what its result is applied to (opaque to the shell): the requests of its
    slots, ``followers`` (``Step.follows``) then ``batch`` (``Step.seqs``)."""

    worker: bytes
    info: WorkerInfo  # the worker's life it went to
    step: wire.Step
    followers: list[LiveRequest]
    batch: list[Item]
    frames: list[bytes] = field(default_factory=list)  # the mask frame, when the masks go with the step


def _served(hello: wire.WorkerHello) -> tuple[str, int, int, list[int]]:
    """What a ready worker serves, which every worker of a scheduler must serve alike."""
    return hello.model, hello.vocab_size, hello.max_model_len, sorted(hello.eos_token_ids)


def _describe(served: tuple[str, int, int, list[int]]) -> str:
    model, vocab_size, max_model_len, eos = served
    return f"{model!r} (vocab_size {vocab_size}, max_model_len {max_model_len}, eos_token_ids {eos})"


def _check_result(tokens: list[int], slots: int, top: dict[int, list[wire.TokenLogprob]], vocab_size: int) -> None:
    """ValueError: a step result's tokens are not one per slot of its step, each a token id of the vocabulary or
    -1 (none), or its top alternatives name tokens outside the vocabulary."""
    if len(tokens) != slots:
        raise ValueError(f"{len(tokens)} slots, the step has {slots}")
    if tokens and (min(tokens) < -1 or max(tokens) >= vocab_size):
        bad = sorted({t for t in tokens if not -1 <= t < vocab_size})
        raise ValueError(f"sampled token ids {bad[:8]} outside the vocabulary of {vocab_size}")
    for alternatives in top.values():
        if any(not 0 <= alt.token_id < vocab_size for alt in alternatives):
            raise ValueError(f"top alternatives outside the vocabulary of {vocab_size}")


class PackedEvents:
    """A gateway's packed token events (``wire.Events``) being gathered: the core's per-token loop
    appends to the three lists."""

    __slots__ = ("rids", "tokens", "logprobs")

    def __init__(self) -> None:
        self.rids: list[str] = []
        self.tokens: list[int] = []
        self.logprobs: list[float] = []


class Outbox:
    """Messages for gateways in the order they arose: a step's token events gathered into one
    ``Events`` per gateway (the plain ones packed), a ``RequestFailed`` after the events before it."""

    def __init__(self) -> None:
        # gateway -> its events since the last ``message``: the same dicts for the outbox's life, so the
        # core's per-token loop appends to ``by_gateway[gateway]`` (what ``event`` does) and to
        # ``packed[gateway]``'s lists without a call
        self.by_gateway: dict[bytes, list[wire.TokenEvent]] = defaultdict(list)
        self.packed: dict[bytes, PackedEvents] = defaultdict(PackedEvents)
        self._ready: list[tuple[bytes, wire.Msg]] = []

    def event(self, gateway: bytes, event: wire.TokenEvent) -> None:
        self.by_gateway[gateway].append(event)

    def events_of(self, gateway: bytes) -> list[wire.TokenEvent]:
        """Where ``event`` puts ``gateway``'s next events, until the next ``message``."""
        return self.by_gateway[gateway]

    def message(self, gateway: bytes, msg: wire.Msg) -> None:
        self._close()
        self._ready.append((gateway, msg))

    def _close(self) -> None:
        events, packed = self.by_gateway, self.packed
        for gateway in events.keys() | packed.keys():
            plain = packed.get(gateway) or PackedEvents()
            self._ready.append((gateway, wire.Events(
                events=events.get(gateway, []), rids=plain.rids, tokens=wire.pack_tokens(plain.tokens),
                logprobs=wire.pack_logprobs(plain.logprobs))))
        events.clear()
        packed.clear()

    def take(self) -> list[tuple[bytes, wire.Msg]]:
        self._close()
        ready, self._ready = self._ready, []
        return ready


class SchedulerCore:
    """Every live request of one scheduler (see the module docstring). ``text_stream(stop, keep_stop=,
    skip_special=)`` makes a request's detokenizer (see ``TextStream``); ``place`` is the placement policy of new
    sequences, ``worker_gone`` tells it that a worker was lost (``place`` only sees the workers with room);
    ``clock`` gives monotonic seconds (deadlines, session TTLs)."""

    def __init__(
        self,
        limits: Limits,
        sessions: Sessions,
        controllers: Controllers,
        text_stream: Callable[..., TextStream],
        *,
        place: Place = least_loaded,
        worker_gone: Callable[[bytes], None] = lambda identity: None,
        clock: Callable[[], float] = time.monotonic,
        generations_per_user: int = 0,
    ) -> None:
        self.limits = limits
        self.generations_per_user = generations_per_user  # tenants.max_generations_per_user (0: no limit)
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
        self.controlled = ControlledSteps(self, controllers)

    @property
    def prefill_chunk_tokens(self) -> int:
        return self.limits.prefill_chunk_tokens

    # ------------------------------------------------------------------------------------------
    # model facts, from the first ready worker

    def model_facts(self) -> wire.WorkerHello | None:
        first = self.pool.first_ready()
        return first.hello if first is not None else None

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
        if len(submit.prompt) % 4:
            return refuse(INVALID_REQUEST, f"the prompt is {len(submit.prompt)} bytes, not int32 token ids")
        if not submit.prompt:
            return refuse(INVALID_REQUEST, "the prompt has no tokens")
        if submit.text_at_gateway and (submit.stop or submit.controller):
            return refuse(INVALID_REQUEST, "text_at_gateway is for requests without stop strings or a controller: "
                                           "the scheduler works out the text those need")
        facts = self.model_facts()
        stage = self.pool.summary() if facts is None else None
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
            context_budget(submit.prompt_len, submit.max_tokens, self.max_model_len(), submit.max_tokens)
            if facts is not None and facts.kv_capacity_tokens:  # a worker's whole KV pool could never hold more
                context_budget(submit.prompt_len, submit.max_tokens, facts.kv_capacity_tokens, submit.max_tokens,
                               what="the KV cache")
        except ContextLengthExceeded as exc:
            return refuse(exc.code, exc.message)
        if len(self.queue) >= self.limits.max_queued:
            return refuse(MEMORY_PRESSURE, f"{len(self.queue)} requests are already waiting; try again shortly")
        if self.generations_per_user and submit.tenant:
            live = sum(1 for r in self.requests.values() if r.submit.tenant == submit.tenant)  # only when limited
            try:
                quotas.check("max_generations_per_user", self.generations_per_user, submit.tenant, live, 1,
                             "generations running or queued")
            except quotas.QuotaExceeded as exc:
                return refuse(exc.code, exc.message)
        timeout = submit.timeout_s if submit.timeout_s > 0 else self.limits.request_timeout_s
        request = LiveRequest(
            submit=submit,
            gateway=gateway,
            order=next(self.orders),
            text=None if submit.text_at_gateway else self._text_stream(submit, list(submit.stop)),
            deadline=self.clock() + timeout,
        )
        self.requests[submit.rid] = request
        self.queue.append(request)
        log.info("scheduler.submitted", request_id=submit.rid, prompt_tokens=submit.prompt_len,
                 max_tokens=submit.max_tokens)
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
            self._unfollow(request)
        elif isinstance(msg, wire.Resume):
            request.paused = False
        elif isinstance(msg, wire.Modify):
            if msg.patch.max_tokens is not None:
                try:
                    context_budget(len(request.prompt), msg.patch.max_tokens, self.max_model_len(), msg.patch.max_tokens)
                except ContextLengthExceeded as exc:
                    return wire.Error(code=exc.code, message=exc.message, rid=msg.rid)
            if msg.patch.stop and request.text is None:
                self._hand_text_over(request)
            request.apply_patch(msg.patch)
            request.limit = token_limit(request.submit, self.max_model_len())
            self._unfollow(request)  # its next step carries the new parameters, or is not wanted
            if request.state is not State.QUEUED and len(request.generated) >= request.submit.max_tokens:
                self.finish(request, "length")
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
        self.outbox.message(request.gateway, wire.TextHandover(rid=request.rid))

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
        A new incarnation under a known identity is a restarted worker: the old one's requests are lost.
        A worker refused by :meth:`_hello_refusal` (another ``wire.WIRE_VERSION``, another model) counts as failed
        (never placed on), its message says why."""
        known = self.pool.workers.get(identity)
        if (refusal := self._hello_refusal(identity, hello)) is not None:
            if known is None or known.hello.message != refusal:  # once, not with every hello it repeats
                log.warning("scheduler.worker_refused", worker=identity.decode(errors="replace"), reason=refusal)
            hello = wire.WorkerHello(worker_id=hello.worker_id, stage="failed", incarnation=hello.incarnation,
                                     message=refusal)
        if known is not None and known.hello.incarnation != hello.incarnation:
            self.worker_lost(identity, "the worker restarted")
            known = None
        changed = known is None or (known.hello.stage, known.hello.progress) != (hello.stage, hello.progress)
        self.pool.on_hello(identity, hello)
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
        first = self.pool.first_ready()
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
        self.pool.drop(identity)
        self.worker_gone(identity)
        self.to_free.pop(identity, None)
        self.sessions.drop_worker(identity)
        for request in list(self.running_on.get(identity, {}).values()):
            self.fail(request, SERVICE_UNAVAILABLE, f"{reason}; the request was lost, retry it")
        self.batches.pop(identity, None)

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
            request.kv_tokens = placement.held if placement.held is not None else array("i")
            request.worker = worker.identity
            request.stop_ids = stop_tokens(request.submit, worker.hello.eos_token_ids)
            request.limit = token_limit(request.submit, self.max_model_len())
            request.reserved = request.needed_tokens
            worker.reserved_tokens += request.reserved
            worker.running += 1
            self.running[request.seq_id] = self.running_on[worker.identity][request.seq_id] = request
            if request.controlled:
                self.controlled_on[worker.identity] += 1
                self.controlled_running[request.seq_id] = request
            else:
                self.batches.setdefault(worker.identity, WorkerBatch()).add(request)
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
        while True:  # the batch limit is per worker: a full worker takes no new sequence
            roomy = [w for w in self.pool.ready() if w.running < self._batch_limit(w)]
            if not roomy:
                return None
            identity = self.place(request, roomy)
            if identity is not None:
                return Placement(worker=self.pool.workers[identity])
            if not self.sessions.evict_lru():
                return None

    def _batch_limit(self, worker: WorkerInfo) -> int:
        """How many sequences ``worker`` may run: ``limits.max_batch_size``, or less where its decode
        throughput stopped growing below that (``limits.adaptive_batch``, :mod:`.batch_ceiling`)."""
        return worker.batch.ceiling if worker.batch is not None else self.limits.max_batch_size

    def plan_controlled(self) -> tuple[Plan, aici_wire.PostPreProcess | None]:
        """The controlled part of the next step; send the request (when there is one) and pass its
        reply to :meth:`controlled_planned`, or, for a plan that goes ahead (``plan.ahead``: it goes into
        the step at once), to ``controlled.ahead_planned``."""
        return self.controlled.begin(self.controlled_running.values(), self.limits.step_token_budget,
                                     may_go_ahead=not self._plain_running())

    def follow_controlled(self) -> Plan | None:
        """The next controlled step, to send before the result of the one in flight (``plan.follows``; see
        ``ControlledSteps.follow``): once that result is applied, send ``controlled.follow_request()`` and pass
        its reply to ``controlled.ahead_planned``. None: it waits for the result (plain sequences run, or a
        controlled sequence needs more than its sampled token fed)."""
        if self._plain_running():
            return None
        return self.controlled.follow(self.running.values(), self.max_model_len())

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
        free and fewer than ``limits.pipeline_depth`` steps in flight. The workers of a ``controlled``
        plan must be among ``workers``."""
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
        depth = self.limits.pipeline_depth
        roomy = {identity for identity, worker in self.pool.workers.items()
                 if worker.steps_out < depth and (workers is None or identity in workers)}
        follows: dict[bytes, tuple[list[LiveRequest], bytes]] = {}
        for identity, batch in self.batches.items():
            if identity not in roomy:
                continue
            left = budget.get(identity, self.limits.step_token_budget)
            followers, ids = follows[identity] = batch.follows()
            for request in followers:
                request.in_flight += 1
            items = self._build_batch(batch, left - len(followers))
            if items:
                per_worker[identity] += items
        steps = []
        for identity in set(per_worker) | {i for i, (followers, _) in follows.items() if followers} | {
                i for i, seqs in self.to_free.items() if seqs and i in roomy}:
            worker = self.pool.workers.get(identity)
            if worker is None:
                continue
            batch = per_worker.get(identity, [])
            followers, ids = follows.get(identity, ([], b""))
            step = wire.Step(step_id=next(self.step_ids), seqs=[s for _, s in batch], follows=ids,
                             free=self.to_free.pop(identity, []), free_all=worker.fresh)
            step.masks_follow = self.controlled.awaits_masks(step)
            worker.fresh = False
            worker.steps_out += 1
            steps.append(Dispatch(identity, worker, step, followers, batch, self.controlled.masks_with(step)))
        return steps

    def _build_batch(self, batch: WorkerBatch, left: int) -> list[Item]:
        """A worker's SeqSteps for its plain requests that do not follow, within ``left`` tokens:
        decoding sequences first (one token each), then prompt chunks, each in priority then arrival
        order."""
        items: list[Item] = []
        prefilling: list[LiveRequest] = []
        for request in batch.order():
            if left <= 0:
                break
            if request.paused:
                continue
            if request.fed < len(request.prompt):
                prefilling.append(request)
                continue
            if request.in_flight:  # decoding in the step in flight: feed its sample
                if not self._may_follow(request):
                    continue
                seq = wire.SeqStep(seq_id=request.seq_id, tokens=[], follow=True)
            else:  # decoding: feed the token sampled last
                seq = wire.SeqStep(seq_id=request.seq_id, tokens=[request.generated[-1]])
                self._session_feed(request, seq)
            left -= 1
            self._add(batch, items, request, seq)
        chunk = self.limits.prefill_chunk_tokens
        for request in prefilling:
            if left <= 0:
                break
            if request.in_flight and (request.in_flight > 1 or request.last_sample):
                continue  # a chunk goes while the one before it runs, unless that one samples
            tokens, sample = request.next_chunk(min(chunk, left))
            left -= len(tokens)
            seq = wire.SeqStep(seq_id=request.seq_id, tokens=tokens, sample=sample, images=request.images_in(tokens))
            self._session_feed(request, seq)
            request.fed += len(tokens)
            self._add(batch, items, request, seq)
        return items

    def _add(self, batch: WorkerBatch, items: list[Item], request: LiveRequest, seq: wire.SeqStep) -> None:
        """``seq`` goes into the step, with ``request``'s sampling parameters when they changed; the
        request joins the followers when the step after may follow this one."""
        if request.sampling_dirty:  # (on its first step among others: the worker creates the sequence then)
            seq.sampling = request.submit.sampling
            seq.cache_domain = request.submit.cache_domain
            request.sampling_dirty = False
        request.in_flight += 1
        request.last_sample = seq.sample
        items.append((request, seq))
        if self._may_follow(request):
            batch.join(request)

    @staticmethod
    def _may_follow(request: LiveRequest) -> bool:
        """Whether a step built now may ``follow`` the steps sent with ``request``: the last of them
        samples it, the tokens they sample leave room for one more, and it reads out no decoded
        position (the step feeding a position reads it out; a follow asks for none)."""
        return (request.last_sample and len(request.generated) + request.in_flight < request.limit
                and not request.readout_positions)

    def _observe_batch(self, dispatch: Dispatch, slots: int, forward_ms: float) -> None:
        """A decode-only step's time, for its worker's batch ceiling (a step with a prompt chunk says nothing
        about the decode batch)."""
        if any(len(seq.tokens) > 1 for seq in dispatch.step.seqs):
            return
        info = dispatch.info
        if info.batch is None:
            info.batch = BatchCeiling(self.limits.max_batch_size)
        before = info.batch.ceiling
        info.batch.observe(slots, forward_ms)
        if info.batch.ceiling != before:
            log.info("scheduler.batch_ceiling", worker=dispatch.worker.decode(errors="replace"),
                     ceiling=info.batch.ceiling, was=before, **info.batch.figures())

    def _unfollow(self, request: LiveRequest) -> None:
        """``request``'s next step is built on its own again (it changed, or paused)."""
        if request.follower:
            self.batches[request.worker].leave(request)

    def step_done(self, worker: bytes, result: wire.StepResult) -> None:
        """Note what a step result says about its worker (before :meth:`apply`)."""
        info = self.pool.workers.get(worker)
        if info is not None and result.kv_free_tokens >= 0:
            info.kv_free_tokens = result.kv_free_tokens
            info.kv_cached_tokens = max(result.kv_cached_tokens, 0)

    def apply(self, dispatch: Dispatch, result: wire.StepResult) -> None:
        """Apply one worker's step result: its SeqSteps' parts (prompt outputs, forks, failures,
        readouts, controlled branches), then every sampled token, followers' first. A token is a
        handful of operations inline (this runs for every token): a request without stop strings
        has its text and event made here, one with them defers its text (:meth:`emit_deferred`)."""
        dispatch.info.steps_out -= 1
        followers = dispatch.followers
        failures = {f.seq_id: f.message for f in result.failures}
        slots = len(followers) + len(dispatch.batch)
        try:
            tokens, logprobs = result.slots()
            _check_result(tokens, slots, result.top, dispatch.info.hello.vocab_size)
        except ValueError as exc:  # a broken worker, or one that does not speak this wire: it is dropped
            log.error("scheduler.malformed_result", worker=dispatch.worker.decode(errors="replace"), error=str(exc))
            if self.pool.workers.get(dispatch.worker) is dispatch.info:
                self.worker_lost(dispatch.worker, f"its step result does not fit the step: {exc}")
            return
        top = result.top
        if self.limits.adaptive_batch:
            self._observe_batch(dispatch, slots, result.forward_ms)

        def sampled(slot: int) -> wire.SampledToken:  # a slot's token as events carry it (made only for those)
            return wire.SampledToken(tokens[slot], logprobs[slot], top.get(slot) or [])

        for request in followers:
            request.in_flight -= 1
        if failures:
            for request in followers:
                if request.seq_id in failures:
                    self._seq_failed(request, request.seq_id, failures[request.seq_id])
        taken = self._apply_seqs(dispatch, len(followers), tokens, sampled, failures, result)
        deferred, finished, events, packed = self.deferred, State.FINISHED, self.outbox.by_gateway, self.outbox.packed
        for request, slot in itertools.chain(zip(followers, range(len(followers))), taken):
            if request.state is finished:  # cancelled while its step ran (or failed above)
                continue
            token = tokens[slot]
            if token < 0:
                self.fail(request, INTERNAL_ERROR, "the worker returned no token for this sequence")
                continue
            generated = request.generated
            generated.append(token)
            n = len(generated)
            if token in request.stop_ids:  # requests.stop_token, its set made at admission
                self.finish(request, "stop", wire.TokenEvent(rid=request.rid, tokens=[sampled(slot)]),
                            stop_reason=token)
                continue
            if n >= request.limit:  # requests.length_reached
                self._emit_text(request, wire.TokenEvent(rid=request.rid, tokens=[sampled(slot)]), last=True)
                continue
            if request.follower and n + request.in_flight >= request.limit:
                self.batches[request.worker].leave(request)  # a token in flight may be its last
            text = request.text
            if text is None:  # the gateway works out its text (common.event_text)
                if request.packed:
                    plain = packed[request.gateway]
                    plain.rids.append(request.rid)
                    plain.tokens.append(token)
                    plain.logprobs.append(logprobs[slot])
                else:
                    events[request.gateway].append(wire.TokenEvent(rid=request.rid, tokens=[sampled(slot)]))
            elif text.stop:
                # Its text may complete a stop string: it is worked out once the next step is on its
                # way (the scan costs more than the lookup of a token's text). A stop string found
                # then ends the request, and the token that step samples for it is dropped.
                if not request.deferred:
                    deferred.append(request)
                request.deferred.append(wire.TokenEvent(rid=request.rid, tokens=[sampled(slot)]))
            elif request.deferred:  # its stop strings were taken away (a Modify) with text still to work out
                self._emit_text(request, wire.TokenEvent(rid=request.rid, tokens=[sampled(slot)]), last=False)
            else:  # _emit_text inline: without stop strings nothing ends it here
                events[request.gateway].append(
                    wire.TokenEvent(rid=request.rid, tokens=[sampled(slot)], text=text.push_one(token)))

    def _apply_seqs(self, dispatch: Dispatch, first: int, tokens: list[int],
                    sampled: Callable[[int], wire.SampledToken], failures: dict[int, str],
                    result: wire.StepResult) -> list[tuple[LiveRequest, int]]:
        """The parts of a result that answer the step's SeqSteps (their slots from ``first`` on), but the
        plain sequences' tokens: returns those, each request with its slot."""
        max_len = self.max_model_len()
        taken: list[tuple[LiveRequest, int]] = []
        for slot, (request, seq) in enumerate(dispatch.batch, first):
            if isinstance(request, Branch):
                self.controlled.apply(request, seq, sampled(slot) if tokens[slot] >= 0 else None,
                                      failures.get(seq.seq_id), max_len)
                continue
            request.in_flight -= 1
            if seq.fork_of is not None:
                self.sessions.forked(seq.fork_of)
            if seq.seq_id in failures:
                self._seq_failed(request, seq.seq_id, failures[seq.seq_id])
                continue
            if request.state is State.FINISHED:  # cancelled while its step ran
                continue
            prompt = request.prompt
            if request.applied < len(prompt):
                self._prompt_outputs(request, seq, result)
                request.cached_tokens += result.cached_tokens.get(seq.seq_id, 0)
                request.applied += len(seq.tokens)
                if request.submit.max_tokens == 0 and request.applied == len(prompt):
                    self._finish_prefill(request)
            elif result.readouts:
                self._decoded_readouts(request, seq, result)
            if seq.sample:
                taken.append((request, slot))
        return taken

    def _finish_prefill(self, request: LiveRequest) -> None:
        """End a prefill-only request once its whole prompt ran: its last event carries its embedding, when asked."""
        pooled = request.pooled
        if pooled is None:
            self.finish(request, "length")
        elif not pooled.complete:
            self.fail(request, INTERNAL_ERROR, f"the worker reported {pooled.seen} of the "
                      f"{len(pooled.positions)} pooled positions of this embedding")
        else:
            self.finish(request, "length", wire.TokenEvent(rid=request.rid, embedding=vector_bytes(pooled.vector())))

    def _seq_failed(self, request: LiveRequest, seq_id: int, message: str) -> None:
        """The worker failed ``request``'s sequence (and released it)."""
        if request.state is State.FINISHED:  # a sequence parked while its last step ran: it is gone
            self.sessions.failed(seq_id)
        else:
            self.fail(request, INTERNAL_ERROR, f"the worker failed this sequence: {message}")

    def _emit_text(self, request: LiveRequest, event: wire.TokenEvent, last: bool) -> None:
        """The text of a token event (after the text of the request's tokens before it); finish on a
        completed stop string, or when it was the ``last``."""
        if request.deferred:
            self._emit_deferred_of(request)
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
        if not events or request.state is State.FINISHED:  # none, or cancelled or failed since
            return
        text = request.text
        assert text is not None  # only a request with stop strings defers its text
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

    def end_controlled(self) -> None:
        """After a step's main-channel calls: the controlled requests they ended (``ControlledSteps.flush_ended``)."""
        self.controlled.flush_ended()

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
        if request.text is not None and ends_with_flush(reason, stop_reason):
            event.text += request.text.flush()
        event.finish_reason = reason
        event.stop_reason = stop_reason
        event.prompt_tokens = len(request.prompt)
        event.completion_tokens = len(request.generated)
        event.cached_tokens = request.cached_tokens
        self.outbox.event(request.gateway, event)
        self._release(request, park=park and reason != "timeout")
        log.info("scheduler.finished", request_id=request.rid, reason=reason, completion_tokens=len(request.generated))

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
            if request.controlled:
                self.controlled_on[request.worker] -= 1
                del self.controlled_running[request.seq_id]
            elif (batch := self.batches.get(request.worker)) is not None:
                batch.remove(request)
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
        request.on_worker = True
        if request.fed >= len(request.prompt):  # decoding: the token fed is the last one sampled
            if request.readout_positions:
                position = len(request.prompt) + len(request.generated) - 1
                if position in request.readout_positions:
                    seq.readouts = [position]
            return
        request.kv_tokens.extend(seq.tokens)
        if not request.has_prompt_outputs:
            return
        prompt, start = request.prompt, request.fed
        fed = range(start, start + len(seq.tokens))
        seq.scores = [wire.ScoreQuery(q, prompt[q + 1]) for q in fed if q + 1 in request.logprob_positions
                      and q + 1 < len(prompt)]
        seq.readouts = [p for p in fed if p in request.readout_positions]
        if request.pooled is not None:
            pooled = request.pooled.positions
            seq.pool = list(range(max(fed.start, pooled.start), min(fed.stop, pooled.stop)))
        if seq.scores and request.submit.outputs is not None:
            seq.top_logprobs = request.submit.outputs.top_logprobs

    def _prompt_outputs(self, request: LiveRequest, seq: wire.SeqStep, result: wire.StepResult) -> None:
        """One event with the outputs of the prompt positions this step fed and were asked about (the
        embedding's partial sum is kept for the last event)."""
        if not request.has_prompt_outputs:
            return
        if seq.pool and request.pooled is not None:
            try:
                request.pooled.add(result.pooled.get(seq.seq_id, b""), len(seq.pool))
            except ValueError as exc:
                self.fail(request, INTERNAL_ERROR, f"the worker's pooled hidden states are malformed: {exc}")
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

