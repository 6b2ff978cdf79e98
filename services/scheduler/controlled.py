"""The controller-aware part of the step loop: requests that carry a controller (``Submit.controller``).

Each step, for the controlled sequences only (the AICI runtime protocol's main channel):

1. ``post_pre_process`` on the main channel: post_ops report what happened to each sequence since the
   controller last saw it (the sampled token; a Splice's backtrack and ff_tokens), pre_ops assign an
   instantiated controller to a sequence whose prompt is about to be fully fed, ``freed`` lists the
   ended sequences. Results: stop, suspend (sit this step out), ff_tokens (appended now, prefilled in
   this step; the runtime already fed them to post_process), num_forks (k > 1: k-1 new sequences,
   branches of the same request, the worker copies the parent's KV copy-on-write).
2. The worker step goes out, with ``Step.masks_follow``: each sequence that runs this step
   is fed what the worker does not hold yet (after a backtrack that reaches into the worker's KV,
   ``SeqStep.backtrack`` truncates it) and is to be sampled under mask row i, its place in the
   ``mid_process`` ops.
3. ``mid_process`` for those sequences (new forks with ``clone_id``) runs while the worker computes
   the forward pass: ``Stop``, ``SampleWithBias`` (the mask row in the reply's binary frame) or
   ``Splice``. Then a ``StepMasks`` carries the reply's mask frame as is to the worker, listing as
   failures (fed, not sampled) the sequences that stopped, spliced or failed; a Splice's backtrack
   and ff_tokens are applied once the step's result is in, and fed on the branch's next step.
   Beside plain sequences, which must not wait for controllers, ``mid_process`` runs before the step
   is built instead, and its mask frame goes with the step (:meth:`ControlledSteps.masks_with`).

With no plain sequence running, a step may go out before its ``post_pre_process`` (:meth:`ControlledSteps.begin`,
``Plan.ahead``), and even before the result of the step before it (:meth:`ControlledSteps.follow`,
``Plan.follows``: each sequence ``follow``s, the worker feeding the token it is sampling now): the calls
then run during its forward pass, and what they decide for a sequence that the step already fed (a stop,
a pre_process that must run first) makes it fed, not sampled (:meth:`ControlledSteps.ahead_planned`). Such a
``post_pre_process`` asks for the step's ``mid_process`` in the same call (``mid_ahead``: one round trip a step).

This module is pure: it talks to the scheduler core through :class:`Host` and to the runtime through
the requests it returns and the replies it is given; the service shell does the I/O.

A controller error or a missed deadline ends only that branch (its event carries the error); the
request ends when its last branch does. Sequences without a controller never reach this module.

Each branch keeps the *logical* token list the controller sees and ``kv_len``, how many of them the
worker holds; what lies beyond is fed on the branch's next step.

Steering and readouts (controllers/ABI.md "Steering and readouts"): each branch has its own steering, the request's
(``Submit.steering``, a Modify's) until its controller sets another (a reply's ``steering``), sent with its next
SeqStep; a fork starts with its parent's. A branch whose controller asked for readouts (``readouts_on``) reads out the
last position of every step that feeds it, and the next ``post_pre_process`` hands that readout to the runtime. (A
steering changed mid-way leaves the sequence's cache domain as it is: its later blocks are for the worker to seal,
``BlockTables.seal``.)
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

from common import aici_wire, wire
from common.config import Controllers
from common.errors import INTERNAL_ERROR, SERVICE_UNAVAILABLE
from common.steering import SteeringError, decode
from common.textstream import TextStream
from services.scheduler.requests import LiveRequest, State, length_reached, stop_token

log = structlog.get_logger()

BACKTRACK_MARK = " \u21a9 "  # AICI's marker for a backtrack in streamed text


@dataclass
class MainReply:
    """The answer to one main-channel request: an ok reply's ``data`` (the op's reply type, e.g.
    :class:`aici_wire.PostPreProcessReply`) and binary frames, or ``error`` (the runtime refused, did not
    answer in time, or answered something that is not the op's reply)."""

    data: Any = None
    frames: list[bytes] = field(default_factory=list)
    error: str = ""
    incarnation: str = ""  # the runtime's life that answered ("": no answer)


class Host(Protocol):
    """What controlled requests need from the scheduler core (and nothing else of it)."""

    prefill_chunk_tokens: int

    def max_model_len(self) -> int: ...
    def model_facts(self) -> wire.WorkerHello | None: ...
    def new_seq_id(self) -> int: ...
    def reserve(self, worker: bytes, tokens: int) -> None: ...
    def free_seq(self, worker: bytes, seq_id: int) -> None: ...
    def emit(self, request: LiveRequest, events: Iterable[wire.TokenEvent]) -> None: ...
    def finish(self, request: LiveRequest, reason: str, event: wire.TokenEvent) -> None: ...
    def fail(self, request: LiveRequest, code: str, message: str) -> None: ...


@dataclass
class Branch:
    """One sequence of a controlled request: the original (index 0) or a fork."""

    request: LiveRequest
    index: int
    seq_id: int
    tokens: list[int]  # prompt + everything generated, as the controller sees it
    text: TextStream
    text_start: int  # tokens[text_start:] are this branch's generated text
    kv_len: int = 0  # leading tokens the worker holds
    kv_backtrack: int = 0  # tokens to drop from the worker's KV on the next step
    assigned: bool = False  # the runtime knows this sequence
    runtime_freed: bool = False  # the runtime was told (``freed``) that it ended
    fork_of: int | None = None  # parent seq id, on this branch's first worker step
    fresh: bool = True  # the worker has not seen this sequence yet
    report_backtrack: int = 0  # what the controller has not been told yet (post_ops)
    report_tokens: list[int] = field(default_factory=list)
    suspended: bool = False
    finished: str | None = None  # the branch's AICI finish reason once it ended
    mid_splice: tuple[int, list[int]] | None = None  # this step's Splice (backtrack, ff_tokens), applied after it
    pre_default: bool = False  # its controller flagged pre_process as the default at its last call: it may go ahead
    held: bool = False  # went ahead, but its pre_process waits for the next step: fed, not sampled
    event: wire.TokenEvent | None = None  # what this step has to say about the branch
    steering: list[wire.SteeringTerm] = field(default_factory=list)  # what its fed tokens are steered with
    steering_dirty: bool = False  # ``steering`` goes with its next SeqStep
    readouts: bool = False  # its controller reads out the last position of each step that feeds it
    readout: bytes = b""  # the last such readout, for the next post_pre_process (b"": none new)

    @property
    def unfed(self) -> list[int]:
        return self.tokens[self.kv_len :]

    def pending_event(self) -> wire.TokenEvent:
        if self.event is None:
            self.event = wire.TokenEvent(rid=self.request.rid, index=self.index)
        return self.event

    def note(self, outcome: aici_wire.SeqOutcome) -> None:
        """Add a runtime result's logs, storage and time to this step's event."""
        event = self.pending_event()
        if outcome.logs:
            event.logs += outcome.logs
        if outcome.storage:  # (most steps store nothing: no list made for them)
            event.storage = [*event.storage, *outcome.storage]
        event.micros += outcome.micros

    def report(self, backtrack: int, tokens: list[int]) -> None:
        """Record a change the controller must hear about in the next post_ops."""
        if backtrack <= len(self.report_tokens):
            del self.report_tokens[len(self.report_tokens) - backtrack :]
        else:
            self.report_backtrack += backtrack - len(self.report_tokens)
            self.report_tokens = []
        self.report_tokens += tokens

    def splice(self, backtrack: int, tokens: list[int]) -> None:
        """Drop ``backtrack`` tokens from the end (fewer than it holds) and append ``tokens`` (logically;
        fed later)."""
        if backtrack:
            unfed = len(self.tokens) - self.kv_len
            if backtrack > unfed:
                self.kv_backtrack += backtrack - unfed
                self.kv_len -= backtrack - unfed
            del self.tokens[len(self.tokens) - backtrack :]
            self._rewind_text()
        self.tokens += tokens
        if tokens:
            self.pending_event().text += self.text.push(tokens)

    def _rewind_text(self) -> None:
        """After a backtrack: detokenize afresh from what is left and mark the cut in the stream."""
        self.text_start = min(self.text_start, len(self.tokens))
        stream = self.text.restarted()
        stream.push(self.tokens[self.text_start :])
        stream.released = len(stream.text)
        self.text = stream
        if self.index == 0:
            self.request.text = stream  # what the scheduler flushes when the request ends
        self.pending_event().text += BACKTRACK_MARK


@dataclass
class Controlled:
    """The branches of one controlled request."""

    request: LiveRequest
    branches: list[Branch]
    indices: itertools.count = field(default_factory=lambda: itertools.count(1))
    suspended_steps: int = 0  # consecutive steps in which every live branch was suspended
    vectors: dict[str, bytes] = field(default_factory=dict)  # every vector its steering carried, by id

    def live(self) -> list[Branch]:
        return [b for b in self.branches if b.finished is None]


@dataclass
class Plan:
    """The controlled part of one step: SeqSteps per worker."""

    per_worker: dict[bytes, list[tuple[Branch, wire.SeqStep]]] = field(default_factory=lambda: defaultdict(list))
    tokens: int = 0
    ahead: bool = False  # its sampling sequences go out before their post_pre_process (see ControlledSteps.begin)
    follows: bool = False  # ... and before the result of the step before it (see ControlledSteps.follow)


@dataclass
class PendingMid:
    """This step's ``mid_process``, run while the workers compute the forward pass."""

    runnable: list[tuple[Branch, int | None]]  # op i samples under mask row i
    seq_ids: set[int]
    sent: bool = False  # its request was handed out
    done: bool = False  # its reply (or failure) was applied
    frame: bytes | None = None  # the reply's mask rows
    skip: dict[int, str] = field(default_factory=dict)  # seq_id -> why it is not sampled this step
    rows: list[int] | None = None  # a step that went ahead: op i's mask row in the step (of num_rows)
    num_rows: int = 0


def spread_rows(frame: bytes, rows: list[int], num_rows: int) -> bytes:
    """A mask frame of ``len(rows)`` rows moved to rows ``rows`` of ``num_rows`` (the others all zero)."""
    size = len(frame) // len(rows)
    out = bytearray(size * num_rows)
    for i, row in enumerate(rows):
        out[row * size : (row + 1) * size] = frame[i * size : (i + 1) * size]
    return bytes(out)


# The Tiller finish reason of a request whose branch 0 ended with an AICI reason.
REQUEST_REASON = {"eos": "stop", "stop": "stop", "aici-stop": "stop", "deadlock": "stop", "length": "length",
                  "fail": "error", "abort": "cancelled"}


class ControlledSteps:
    """Drives every controlled request of one scheduler core (see the module docstring). Main-channel
    calls are data: :meth:`begin` returns the ``post_pre_process`` to send and :meth:`planned` takes
    its reply; :meth:`mid_request` and :meth:`mid_done` do the same for ``mid_process``."""

    def __init__(self, host: Host, settings: Controllers) -> None:
        self.host = host
        self.settings = settings
        self.requests: dict[str, Controlled] = {}
        self.by_seq: dict[int, Branch] = {}
        self.freed: list[int] = []  # ended sequences the runtime has not been told about
        self.free_later: dict[bytes, list[int]] = defaultdict(list)  # worker frees after this step's forks
        self.seq_steps = 0  # controlled sequence-steps (mid_process ops) run so far
        self.followed_steps = 0  # steps that went out before the result of the one before them (follow)
        self.mid: PendingMid | None = None  # this step's mid_process, once the step went out
        self.followed: PendingMid | None = None  # a step that went out with follow: its calls wait for the step before
        self.runtime_fresh = True  # the first post_pre_process resets the runtime (seqs of a previous scheduler)
        self.runtime_incarnation = ""  # the runtime's life the bound controllers live in ("": none heard yet)
        self._assign: list[Branch] = []  # roots bound to their controller by the post_pre_process under way
        # a step's controlled part is being planned: ended forks' worker frees wait until it is built
        # (a fork it makes may copy one of them)
        self.planning = False
        self._post_ops: list[aici_wire.PostOp] = []

    def runtime_heard(self, incarnation: str) -> None:
        """A main-channel reply named the runtime's ``incarnation``. A new one is a restarted runtime:
        the controllers bound to the old one are gone, and their requests fail at once (retryable).
        Controllers not bound yet are left alone: their requests may have been instantiated on the
        new one (one that was not fails at its binding)."""
        previous, self.runtime_incarnation = self.runtime_incarnation, incarnation or self.runtime_incarnation
        if not previous or not incarnation or incarnation == previous:
            return
        log.warning("scheduler.controller_runtime_restarted", previous=previous, incarnation=incarnation)
        message = (f"the controller runtime restarted (incarnation {previous} -> {incarnation}), its controllers "
                   "with it; this request was lost, retry it")
        for controlled in list(self.requests.values()):
            if any(b.assigned for b in controlled.branches):
                self.host.fail(controlled.request, SERVICE_UNAVAILABLE, message)

    def _channel_failed(self, error: str) -> None:
        """The runtime failed a main-channel call: every controlled request fails with the reason."""
        log.warning("scheduler.controller_runtime_failed", error=error)
        for controlled in list(self.requests.values()):
            self.host.fail(controlled.request, SERVICE_UNAVAILABLE, error)

    # -- the step ------------------------------------------------------------------------------------

    def track(self, request: LiveRequest) -> Controlled:
        controlled = self.requests.get(request.rid)
        if controlled is None:
            assert request.text is not None  # a controlled request is never text_at_gateway (SchedulerCore.submit)
            root = Branch(request=request, index=0, seq_id=request.seq_id, tokens=list(request.prompt),
                          text=request.text, text_start=len(request.prompt))
            controlled = self.requests[request.rid] = Controlled(request=request, branches=[root],
                                                                 vectors=dict(request.submit.steering_vectors))
            self.by_seq[root.seq_id] = root
        if request.steering_dirty:  # its Submit's steering, or a Modify's: every branch's from its next step on
            request.steering_dirty = False
            controlled.vectors |= request.submit.steering_vectors
            for branch in controlled.live():
                branch.steering, branch.steering_dirty = list(request.submit.steering), True
        return controlled

    def begin(self, running: Iterable[LiveRequest], budget: int, may_go_ahead: bool = False
              ) -> tuple[Plan, aici_wire.PostPreProcess | None]:
        """The first half of a step's controlled part: prompt chunks fed before a controller is
        involved, and the ``post_pre_process`` to send (None: nothing to ask); pass its reply to
        :meth:`planned`. With ``may_go_ahead`` (no plain sequence runs) and ``controllers.step_ahead``, when
        every live branch just sampled a token and its controller flags pre_process as the default, the plan
        already samples them all (``plan.ahead``): the step goes out with ``masks_follow`` at once, and the
        reply goes to :meth:`ahead_planned` while the worker computes it. The controllers see the same calls
        in the same order; only the forward pass no longer waits for post_pre_process."""
        plan = Plan()
        self.mid = None
        assign: list[Branch] = []
        for request in running:
            if not request.submit.controller or request.state is not State.RUNNING:
                continue
            controlled = self.track(request)
            root = controlled.branches[0]
            if root.assigned or request.paused:
                continue
            remaining = len(request.prompt) - request.fed
            chunk = min(self.host.prefill_chunk_tokens, budget)
            if remaining <= chunk:
                assign.append(root)
            elif chunk > 0:  # a prompt chunk: no controller involved yet
                self._add(plan, root, request.prompt[request.fed : request.fed + chunk].tolist(), sample=False)
                budget -= chunk
        if not (assign or self.freed or any(b.assigned for c in self.requests.values() for b in c.live())):
            return plan, None
        ahead = self._going_ahead(assign, may_go_ahead)
        request = self._request(assign)
        self.planning = True
        if ahead:
            for row, branch in enumerate(ahead):
                self._add(plan, branch, branch.unfed, sample=True, mask_row=row)
            plan.ahead = True
            self.mid = PendingMid([(b, None) for b in ahead], {b.seq_id for b in ahead})
            request.ahead, request.mid_ahead = [b.seq_id for b in ahead], True
        return plan, request

    def _request(self, assign: list[Branch]) -> aici_wire.PostPreProcess:
        """The next ``post_pre_process``: what the runtime has not heard yet (post_ops, ended sequences) and the
        roots to bind to their controllers (``assign``)."""
        post_ops, readouts = [], []
        for controlled in self.requests.values():
            for b in controlled.live():
                if b.assigned and (b.report_tokens or b.report_backtrack):
                    post_ops.append(aici_wire.PostOp(id=b.seq_id, tokens=b.report_tokens, backtrack=b.report_backtrack))
                    b.report_tokens, b.report_backtrack = [], 0
                if b.readout:
                    readouts.append(aici_wire.SeqReadout(id=b.seq_id, values=b.readout))
                    b.readout = b""
        pre_ops = [self._binding(b) for b in assign]
        freed, self.freed = self.freed, []
        self._assign, self._post_ops = assign, post_ops
        return aici_wire.PostPreProcess(post_ops=post_ops, pre_ops=pre_ops, freed=freed, reset=self.runtime_fresh,
                                        readouts=readouts)

    def _binding(self, root: Branch) -> aici_wire.PreOp:
        """The op binding ``root`` to its controller, with what its steering and readout host calls know: the
        worker's readout concepts and layers, and the layers of each vector its request's steering carries."""
        request = root.request
        facts = self.host.model_facts()
        vectors = {}
        for vector_id, data in self.requests[request.rid].vectors.items():
            try:
                vectors[vector_id] = decode(data).layers
            except SteeringError:  # (checked by the gateway: a vector the worker would refuse too)
                continue
        return aici_wire.PreOp(id=root.seq_id, req_id=request.submit.controller, vectors=vectors,
                               concepts=list(facts.readout_concepts) if facts else [],
                               readout_layers=list(facts.readout_layers) if facts else [],
                               num_layers=facts.num_layers if facts else 0)

    def follow(self, running: Iterable[LiveRequest], max_len: int) -> Plan | None:
        """The next step of the sequences that sample in the step in flight, to send before its result is back
        (``controllers.pipeline``; the core asks only while no plain sequence runs): each ``follow``s, the worker
        feeding the token it samples in the step in flight, and samples under this step's masks
        (``masks_follow``). Its calls wait for that result: :meth:`follow_request` gives its post_pre_process,
        whose reply goes to :meth:`ahead_planned` as for a step that went ahead in :meth:`begin` (the controllers
        see the same calls in the same order). A sequence that the token in flight ends (a stop token or
        string, post_process stopping, a worker failure) or whose pre_process must run first is fed, not
        sampled, and dropped or sampled again by a step planned the usual way. A sequence whose controller
        spliced instead of sampling in the step in flight (backtrack 0: a grammar's forced tokens) is fed the
        splice's tokens and sampled after them. None: the next step waits for the result, because this one's
        masks are not settled yet, or a sequence needs more than its sampled token or splice fed (a binding,
        ff_tokens, a backtrack, a fork, a suspension, a pre_process not flagged as the default)."""
        mid = self.mid
        if not (self.settings.pipeline and self.settings.step_ahead) or mid is None or not mid.done:
            return None
        if any(r.submit.controller and not r.paused and not self._bound(r) for r in running):
            return None
        sampling = {b.seq_id for b, _ in mid.runnable if b.seq_id not in mid.skip}
        branches: list[tuple[Branch, list[int] | None]] = []  # each with its splice's tokens to feed, or None
        for controlled in self.requests.values():
            for b in controlled.live():
                if not b.assigned:
                    continue  # a paused request's root, not bound yet
                splice = b.mid_splice[1] if b.mid_splice is not None and not b.mid_splice[0] else None
                if not ((b.seq_id in sampling or splice) and b.pre_default and not b.request.paused):
                    return None
                after = len(b.tokens) + (len(splice) if splice else 1)  # once the token in flight (or splice) is in
                if not length_reached(b.request.submit, after - len(b.request.prompt), after, max_len):
                    branches.append((b, splice))  # (one whose token in flight is its last needs no next step)
        if not branches:
            return None
        plan = Plan(ahead=True, follows=True)
        for row, (b, splice) in enumerate(branches):
            if splice:
                seq = wire.SeqStep(seq_id=b.seq_id, tokens=list(splice), mask_row=row)
            else:
                seq = wire.SeqStep(seq_id=b.seq_id, tokens=[], follow=True, mask_row=row)
            self._steer_step(b, seq, len(b.tokens) + (len(splice) if splice else 1) - 1)
            if b.request.sampling_dirty:
                seq.sampling = b.request.submit.sampling
            plan.per_worker[b.request.worker].append((b, seq))
            plan.tokens += len(seq.tokens) or 1
        for b, _ in branches:
            b.request.sampling_dirty = False
        self.mid = self.followed = PendingMid([(b, None) for b, _ in branches], {b.seq_id for b, _ in branches})
        self.followed_steps += 1
        return plan

    def _bound(self, request: LiveRequest) -> bool:
        controlled = self.requests.get(request.rid)
        return controlled is not None and controlled.branches[0].assigned

    def follow_request(self) -> aici_wire.PostPreProcess:
        """The ``post_pre_process`` of the step that went out with ``follow`` (:meth:`follow`), once the results of
        the step before it are applied (or lost): its sequences that are still live go ``ahead``; pass the
        reply to :meth:`ahead_planned`. (When none is, the sequences that ended are in ``freed``.)"""
        mid, self.followed = self.followed, None
        assert mid is not None and mid is self.mid and not mid.sent
        request = self._request([])
        request.ahead, request.mid_ahead = [b.seq_id for b, _ in mid.runnable if b.finished is None], True
        return request

    def _going_ahead(self, assign: list[Branch], may_go_ahead: bool) -> list[Branch]:
        """The branches of a step that may go out before its post_pre_process: all the live ones, when each
        just sampled a token (or spliced tokens) that is all it needs fed and flags its pre_process as the
        default; [] when any needs more (a binding, a fork, ff_tokens, a backtrack, a suspension)."""
        if assign or not may_go_ahead or not self.settings.step_ahead:
            return []
        ahead = []
        for controlled in self.requests.values():
            for b in controlled.live():
                if not b.assigned:
                    continue  # a prompt chunk, fed without its controller
                if not (b.pre_default and b.report_tokens and not b.report_backtrack
                        and b.unfed == b.report_tokens and not b.kv_backtrack and b.fork_of is None
                        and not b.suspended and not b.request.paused):
                    return []
                ahead.append(b)
        return ahead

    def planned(self, plan: Plan, reply: MainReply) -> Plan:
        """The second half: apply the ``post_pre_process`` reply and plan the sampling sequences
        (their ``mid_process`` runs once the step went out, see :meth:`mid_request`)."""
        assign, self._assign = self._assign, []
        post_ops, self._post_ops = self._post_ops, []
        for b in assign:
            b.assigned = True
        if reply.error:
            self._channel_failed(reply.error)
            return plan
        self.runtime_fresh = False
        try:
            self._readouts_on(reply.data, {b.seq_id for b in assign})  # asked at the binding: from its prompt on
            runnable = self._post_pre_process(post_ops, reply.data)
            for row, (branch, _) in enumerate(runnable):
                self._plan_sample(plan, branch, row)
            # what the calls asked for, from the next SeqSteps on, as when the step goes out ahead of its calls
            self._readouts_on(reply.data)
            self._steer(reply.data, runnable)
        except Exception as exc:  # a bug or a nonsensical runtime reply fails the controlled requests, not the loop
            self._fail_all(exc)
            return Plan()
        if runnable:
            self.mid = PendingMid(runnable, {b.seq_id for b, _ in runnable})
        for items in plan.per_worker.values():
            for branch, _ in items:
                branch.request.sampling_dirty = False
        return plan

    def _fail_all(self, exc: Exception) -> None:
        log.exception("scheduler.controller_step_failed")
        for controlled in list(self.requests.values()):
            self.host.fail(controlled.request, INTERNAL_ERROR, f"controller step failed: {exc}")

    def _plan_sample(self, plan: Plan, branch: Branch, row: int) -> None:
        """Feed the branch what the worker lacks and sample it under mask row ``row``."""
        if not branch.unfed and not (branch.kv_backtrack or branch.fork_of is not None):
            branch.kv_len -= 1  # nothing new to feed: compute the last token again to sample after it
            branch.kv_backtrack += 1
        self._add(plan, branch, branch.unfed, sample=True, mask_row=row)

    def awaits_masks(self, step: wire.Step) -> bool:
        """Whether ``step`` samples a sequence whose mask comes from this step's mid_process, which has
        not run yet (``masks_follow``)."""
        mid = self.mid
        return mid is not None and not mid.done and any(s.sample and s.seq_id in mid.seq_ids for s in step.seqs)

    def masks_with(self, step: wire.Step) -> list[bytes]:
        """The mask frame to send with ``step`` when its mid_process ran before it was built: the
        sequences that are not to sample (a Splice) are only fed."""
        mid = self.mid
        if mid is None or not mid.done:
            return []
        for s in step.seqs:
            if s.seq_id in mid.skip:
                s.sample, s.mask_row = False, -1
        return [mid.frame] if mid.frame is not None and any(s.mask_row >= 0 for s in step.seqs) else []

    def mid_request(self) -> aici_wire.MidProcess | None:
        """This step's ``mid_process`` to send once its worker steps went out; None when it was handed
        out already (the steps of several workers share one) or there is none."""
        mid = self.mid
        if mid is None or mid.sent:
            return None
        mid.sent = True
        self.seq_steps += len(mid.runnable)
        return aici_wire.MidProcess(ops=[aici_wire.MidOp(id=b.seq_id, clone_id=clone) for b, clone in mid.runnable])

    def mid_done(self, reply: MainReply) -> None:
        """Apply this step's ``mid_process`` reply: Stop ends a branch, Splice waits for the step's
        result, anything else samples under the mask row."""
        mid = self.mid
        assert mid is not None
        mid.done = True
        if reply.error:
            self._channel_failed(reply.error)
        else:
            try:
                self._mid_process(mid, reply)
            except Exception as exc:  # as in planned(): the controlled requests fail, the loop goes on
                self._fail_all(exc)
        for branch, _ in mid.runnable:
            if branch.finished is not None:
                mid.skip[branch.seq_id] = f"the sequence ended in mid_process ({branch.finished})"
            elif branch.mid_splice is not None:
                mid.skip[branch.seq_id] = "the controller spliced instead of sampling"

    def step_masks(self, step: wire.Step) -> tuple[wire.StepMasks, list[bytes]]:
        """The StepMasks (and its mask frame) of a step sent with ``masks_follow``, once
        :meth:`mid_done` ran."""
        mid = self.mid
        assert mid is not None and mid.done
        failures = [wire.SeqFailure(seq_id=s.seq_id, message=mid.skip[s.seq_id]) for s in step.seqs if s.seq_id in mid.skip]
        return wire.StepMasks(step_id=step.step_id, failures=failures), [mid.frame] if mid.frame is not None else []

    def _add(self, plan: Plan, branch: Branch, tokens: list[int], *, sample: bool, mask_row: int = -1) -> None:
        request = branch.request
        seq = wire.SeqStep(seq_id=branch.seq_id, tokens=tokens, sample=sample, mask_row=mask_row,
                           backtrack=branch.kv_backtrack)
        if branch.fresh and branch.fork_of is not None:
            seq.fork_of = branch.fork_of
        elif branch.fresh or request.sampling_dirty:
            seq.sampling = request.submit.sampling
            seq.cache_domain = request.submit.cache_domain
        self._steer_step(branch, seq, branch.kv_len + len(tokens) - 1)  # (no tokens: the last one computed again)
        plan.per_worker[request.worker].append((branch, seq))
        plan.tokens += len(tokens)

    def _steer_step(self, branch: Branch, seq: wire.SeqStep, last: int) -> None:
        """``seq``'s steering, when the branch's changed since its last SeqStep, and the readout of ``last`` (the
        last position it feeds) when the branch's controller reads them out."""
        if branch.steering_dirty:
            vectors = self.requests[branch.request.rid].vectors
            seq.steering = list(branch.steering)
            seq.vectors = {t.vector: vectors[t.vector] for t in branch.steering if t.vector in vectors}
            branch.steering_dirty = False
        if branch.readouts:
            seq.readouts = [last]

    def _readouts_on(self, effects: aici_wire.HostEffects, only: Container[int] | None = None) -> None:
        """The branches (of ``only``) whose controllers asked for readouts in a call: from their next SeqStep on."""
        for seq_id in effects.readouts_on:
            if (only is None or seq_id in only) and (branch := self.by_seq.get(seq_id)) is not None:
                branch.readouts = True

    def _steer(self, effects: aici_wire.HostEffects, forks: Sequence[tuple[Branch, int | None]] = ()) -> None:
        """The steering a step's calls set, from the token that step samples on, whether the step went out before
        them or not (ABI.md "Steering and readouts"): so apply it only once that step's SeqSteps are planned. The
        forks made in the call (``forks``: (branch, clone parent)) take the steering their parent set before them."""
        for change in effects.steering:
            targets = [self.by_seq.get(change.id), *(b for b, parent in forks if parent == change.id)]
            for branch in targets:
                if branch is not None and branch.finished is None:
                    branch.steering, branch.steering_dirty = list(change.terms), True

    def _post_pre_process(self, post_ops: list[aici_wire.PostOp], reply: aici_wire.PostPreProcessReply
                          ) -> list[tuple[Branch, int | None]]:
        """Apply a post_pre_process reply; returns the branches to run this step, each with its clone parent."""
        self._post_outcomes(post_ops, reply)
        runnable: list[tuple[Branch, int | None]] = []
        defaults = set(reply.pre_default)
        for controlled in list(self.requests.values()):
            for branch in list(controlled.live()):
                if not branch.assigned:
                    continue
                branch.pre_default = branch.seq_id in defaults
                result = reply.pre_seqs.get(str(branch.seq_id))
                if result is None:
                    self._end(branch, "fail", error="the controller runtime returned no pre_process result")
                    continue
                runnable += self._on_pre(controlled, branch, result)
            self._check_deadlock(controlled)
        return runnable

    def ahead_planned(self, reply: MainReply) -> aici_wire.MidProcess | None:
        """Apply the ``post_pre_process`` reply of a step that went out ahead (:meth:`begin`): the branches
        that stopped, failed or must wait for their pre_process are fed, not sampled. Returns the step's
        ``mid_process`` to send, or None when there is none (its masks are settled: :meth:`step_masks`)."""
        mid = self.mid
        assert mid is not None and not mid.sent
        post_ops, self._post_ops = self._post_ops, []
        if reply.error:
            self.mid_done(reply)
            return None
        try:
            self._post_outcomes(post_ops, reply.data)
            self._readouts_on(reply.data)  # (from their next step on: this one went out)
            self._steer(reply.data)
            waiting, defaults = set(reply.data.waiting), set(reply.data.pre_default)
            kept: list[tuple[Branch, int | None]] = []
            rows: list[int] = []
            for row, (branch, _) in enumerate(mid.runnable):
                if branch.finished is not None:
                    mid.skip[branch.seq_id] = f"the sequence ended in post_process ({branch.finished})"
                    continue
                outcome = reply.data.pre_seqs.get(str(branch.seq_id))
                if outcome is not None and branch.seq_id not in defaults and not outcome.error:
                    self._end(branch, "fail", error="the controller runtime ran pre_process for a sequence "
                                                    "whose step went ahead")
                elif outcome is not None and self._on_pre(self.requests[branch.request.rid], branch, outcome):
                    kept.append((branch, None))
                    rows.append(row)
                    continue
                elif outcome is None and branch.seq_id not in waiting:
                    self._end(branch, "fail", error="the controller runtime returned no pre_process result")
                if branch.finished is None:  # its pre_process waits (or it paused): its next step samples it
                    branch.held = True
                mid.skip[branch.seq_id] = (f"the sequence ended ({branch.finished})" if branch.finished
                                           else "its pre_process runs before its next step")
        except Exception as exc:  # as in planned(): the controlled requests fail, the loop goes on
            self._fail_all(exc)
            kept, rows = [], []
        mid.rows, mid.num_rows, mid.runnable = rows, len(mid.runnable), kept
        if reply.data.mid is not None:  # its mid_process ran in the same call (mid_ahead)
            mid.sent = True
            self.seq_steps += len(kept)
            self.mid_done(MainReply(data=reply.data.mid, frames=self._kept_rows(reply, kept)))
            return None
        if kept:
            return self.mid_request()
        self.mid_done(MainReply(data=aici_wire.MidProcessReply()))
        return None

    @staticmethod
    def _kept_rows(reply: MainReply, kept: list[tuple[Branch, int | None]]) -> list[bytes]:
        """The mask rows of a mid_process run with mid_ahead, for the ``kept`` branches in order: the runtime ran it
        for the sequences that went on as it saw them, and one this scheduler ended or paused meanwhile is not
        sampled (a kept one it did not run for fails, as one missing from a reply does)."""
        frame, ran = reply.frames[0] if reply.frames else b"", reply.data.mid_ids
        if not (kept and frame and ran):
            return []
        if [b.seq_id for b, _ in kept] == ran:
            return [frame]
        size, row = len(frame) // len(ran), {seq_id: i for i, seq_id in enumerate(ran)}
        rows = [row.get(b.seq_id) for b, _ in kept]
        return [b"".join(bytes(size) if i is None else frame[i * size : (i + 1) * size] for i in rows)]

    def _post_outcomes(self, post_ops: list[aici_wire.PostOp], reply: aici_wire.PostPreProcessReply) -> None:
        """The post_process outcomes of a post_pre_process reply: a stop or an error ends the branch."""
        for op in post_ops:
            branch = self.by_seq.get(op.id)
            post = reply.post_seqs.get(str(op.id))
            if branch is None or branch.finished or post is None:
                continue
            branch.note(post)
            if post.error:
                self._end(branch, "fail", error=post.error)
            elif post.result is not None and post.result.stop:
                self._end(branch, "aici-stop")

    def _check_deadlock(self, controlled: Controlled) -> None:
        """A request all of whose branches stay suspended (each waiting for another) for more than
        ``deadlock_steps`` steps ends them all with ``deadlock``, as rLLM does."""
        live = [b for b in controlled.live() if b.assigned]
        if not live or not all(b.suspended for b in live):
            controlled.suspended_steps = 0
            return
        controlled.suspended_steps += 1
        if controlled.suspended_steps > self.settings.deadlock_steps:
            for branch in live:
                self._end(branch, "deadlock")

    def _on_pre(self, controlled: Controlled, branch: Branch, outcome: aici_wire.PreOutcome
                ) -> list[tuple[Branch, int | None]]:
        branch.note(outcome)
        if outcome.error:
            self._end(branch, "fail", error=outcome.error)
            return []
        pre = outcome.result or aici_wire.PreProcessResult()
        num_forks = pre.num_forks
        if num_forks == 0:
            self._end(branch, "aici-stop")
            return []
        if pre.ff_tokens:  # fed to its post_process inside the runtime already: not reported
            self._splice(branch, 0, pre.ff_tokens, report=False)
            if branch.finished:
                return []
        branch.suspended = pre.suspend
        request = branch.request
        if branch.suspended or request.paused:
            return []
        out: list[tuple[Branch, int | None]] = [(branch, None)]
        room = self.settings.max_forks - len(controlled.live())
        if num_forks - 1 > room:
            self._end(branch, "fail", error=f"the controller asked for {num_forks} forks; a request may have at most "
                                            f"{self.settings.max_forks} live sequences")
            return []
        for _ in range(num_forks - 1):
            out.append((self._fork(controlled, branch), branch.seq_id))
        return out

    def _fork(self, controlled: Controlled, parent: Branch) -> Branch:
        request = parent.request
        child = Branch(request=request, index=next(controlled.indices), seq_id=self.host.new_seq_id(),
                       tokens=list(parent.tokens), text=request.text.restarted(),
                       text_start=parent.text_start, assigned=True)
        child.text.push(child.tokens[child.text_start :])
        child.text.released = len(child.text.text)
        if parent.kv_len > 0 and not parent.fresh:  # the parent is live in the worker: copy its KV
            child.fork_of, child.kv_len, child.kv_backtrack = parent.seq_id, parent.kv_len, parent.kv_backtrack
        # its parent's steering and readouts: the worker's copy has the steering the parent's last SeqStep gave
        child.steering, child.readouts = list(parent.steering), parent.readouts
        child.steering_dirty = parent.steering_dirty or (child.fork_of is None and bool(child.steering))
        controlled.branches.append(child)
        self.by_seq[child.seq_id] = child
        self.host.reserve(request.worker, request.needed_tokens)
        return child

    def _mid_process(self, mid: PendingMid, reply: MainReply) -> None:
        seqs = reply.data.seqs
        self._readouts_on(reply.data)  # (from their next step on: this one is under way)
        self._steer(reply.data)
        mid.frame = reply.frames[0] if reply.frames else None
        if mid.frame is not None and mid.rows is not None and mid.rows != list(range(mid.num_rows)):
            mid.frame = spread_rows(mid.frame, mid.rows, mid.num_rows)
        for branch, _ in mid.runnable:
            if branch.finished:
                continue
            outcome = seqs.get(str(branch.seq_id))
            if outcome is None:
                self._end(branch, "fail", error="the controller runtime returned no mid_process result")
                continue
            branch.note(outcome)
            if outcome.error:
                self._end(branch, "fail", error=outcome.error)
                continue
            self._on_mid(branch, outcome.result)

    def _on_mid(self, branch: Branch, mid: aici_wire.MidProcessResult | None) -> None:
        """Stop ends the branch; a Splice waits for the step's result (see :meth:`apply`); anything
        else samples under the branch's mask row (the AICI runtime protocol: a null result as SampleWithBias does)."""
        if mid == "Stop":
            self._end(branch, "aici-stop")
        elif isinstance(mid, aici_wire.MidBranch) and mid.Splice is not None:
            branch.mid_splice = (mid.Splice.backtrack, list(mid.Splice.ff_tokens))

    def _splice(self, branch: Branch, backtrack: int, ff: list[int], *, report: bool = True) -> None:
        """Apply a controller's splice (a mid_process Splice, or pre_process's ``ff_tokens``); its tokens
        are fed on the branch's next step. A backtrack past the sequence's first token fails the branch;
        forced tokens count as generated ones: those past ``max_tokens`` or the context are cut off and
        the branch ends with ``length``."""
        held = len(branch.tokens)
        if backtrack >= held:
            self._end(branch, "fail", error=f"the controller backtracked {backtrack} tokens, but the sequence holds "
                                            f"{held} (its prompt included) and may not become empty")
            return
        kept = held - backtrack
        generated = kept - min(branch.text_start, kept)
        room = min(branch.request.submit.max_tokens - generated, self.host.max_model_len() - kept)
        ff = ff[: max(room, 0)]
        branch.splice(backtrack, ff)
        if report:
            branch.report(backtrack, ff)
        self._count_ff(branch, len(ff))
        self._check_limits(branch, self.host.max_model_len())

    @staticmethod
    def _count_ff(branch: Branch, n: int) -> None:
        branch.pending_event().ff_tokens += n

    # -- results ------------------------------------------------------------------------------------

    def apply(self, branch: Branch, seq: wire.SeqStep, sampled: wire.SampledToken | None, failure: str | None,
              max_len: int, readouts: list[wire.ReadoutResult] | None = None) -> None:
        """The worker ran ``seq`` for ``branch`` (and sampled ``sampled``, or failed it with ``failure``; ``readouts``:
        its answers to ``seq.readouts``): advance it and note what the controller must hear."""
        request = branch.request
        if branch.finished or request.state is State.FINISHED:
            return
        if failure is not None:
            self._end(branch, "fail", error=f"the worker failed this sequence: {failure}")
            return
        if readouts:
            branch.readout = readouts[-1].values
        branch.fresh = False
        branch.fork_of = None
        branch.kv_backtrack = 0
        if not branch.assigned:  # a prompt chunk before the controller's first step
            branch.kv_len += len(seq.tokens)
            request.fed = branch.kv_len
            return
        branch.kv_len = len(branch.tokens)  # everything planned was fed
        request.fed = len(request.prompt)
        if branch.held:  # it went ahead, its pre_process waited: fed, not sampled
            branch.held = False
            return
        if branch.mid_splice is not None:  # fed, not sampled: the controller spliced instead
            (backtrack, ff), branch.mid_splice = branch.mid_splice, None
            self._splice(branch, backtrack, ff)
            return
        if not seq.sample:
            return
        if sampled is None:
            self._end(branch, "fail", error="the worker returned no token for this sequence")
            return
        token = sampled.token_id
        branch.tokens.append(token)
        branch.report(0, [token])
        if branch.index == 0:
            request.generated.append(token)
        event = branch.pending_event()
        event.tokens = [*event.tokens, sampled]
        if stop_token(request.submit, token, eos=()):  # EOS does not end a controlled sequence (AICI): its controller decides
            self._end(branch, "eos")
            return
        event.text += branch.text.push([token])
        self._check_limits(branch, max_len)

    def _check_limits(self, branch: Branch, max_len: int) -> None:
        """End a branch whose text hit a stop string or whose length hit max_tokens or the context. Its
        generated tokens are those after its prompt, or after the point a backtrack into the prompt cut."""
        request = branch.request
        generated = len(branch.tokens) - branch.text_start
        if branch.text.stopped_by is not None:
            self._end(branch, "stop")
        elif length_reached(request.submit, generated, len(branch.tokens), max_len):
            self._end(branch, "length")

    def _end(self, branch: Branch, reason: str, *, error: str = "") -> None:
        """End one branch; the request ends with its last branch."""
        if branch.finished is not None:
            return
        branch.finished = reason
        event = branch.pending_event()
        event.fork_finish = reason
        event.error = error
        if reason not in ("stop", "fail"):
            event.text += branch.text.flush()
        request = branch.request
        if error:
            log.info("scheduler.branch_failed", request_id=request.rid, index=branch.index, seq_id=branch.seq_id,
                     error=error)
        self._free(branch)

    def _free(self, branch: Branch) -> None:
        """Tell the runtime the branch ended; free a fork's worker sequence (the root's goes with the request)."""
        request = branch.request
        if branch.assigned and not branch.runtime_freed:
            branch.runtime_freed = True
            self.freed.append(branch.seq_id)
        if branch.index != 0 and self.by_seq.pop(branch.seq_id, None) is not None:
            self.host.reserve(request.worker, -request.needed_tokens)
            self.free_later[request.worker].append(branch.seq_id)

    def flush(self) -> None:
        """After a step: send each branch's event; end the requests whose last branch ended. Worker
        frees of ended forks go out with the next step (a fork made this step may copy them)."""
        self._release_frees()
        for controlled in list(self.requests.values()):
            self._flush_request(controlled)

    def flush_ended(self) -> None:
        """After a step's main-channel calls: end the requests whose last branch ended in them (a stop in
        post_process or mid_process) at once, not a forward pass later when the step in flight, which feeds
        them but samples nothing for them, is done. The others' events wait for the step's result."""
        for controlled in list(self.requests.values()):
            if not controlled.live():
                self._flush_request(controlled)

    def _flush_request(self, controlled: Controlled) -> None:
        request = controlled.request
        if request.state is State.FINISHED:
            return
        events = [b.event for b in controlled.branches if b.event is not None]
        for b in controlled.branches:
            b.event = None
        if controlled.live():
            self.host.emit(request, events)
            return
        root = controlled.branches[0]
        final = next((e for e in events if e.index == 0), None) or wire.TokenEvent(rid=request.rid)
        self.host.emit(request, [e for e in events if e is not final])
        reason = REQUEST_REASON.get(root.finished or "fail", "error")
        if all(b.finished == "fail" for b in controlled.branches):
            reason = "error"
            final.error = final.error or next((e.error for e in events if e.error), "the controller failed")
        self.host.finish(request, reason, final)

    def release(self, request: LiveRequest) -> None:
        """The request ended (finished, cancelled, failed): forget it and free every branch."""
        controlled = self.requests.pop(request.rid, None)
        if controlled is None:
            return
        for branch in controlled.branches:
            branch.finished = branch.finished or "abort"
            self._free(branch)
        self.by_seq.pop(controlled.branches[0].seq_id, None)
        self._release_frees()

    def built(self) -> None:
        """The planned controlled part went into a step: frees held back go with the next one."""
        self.planning = False

    def _release_frees(self) -> None:
        if self.planning:
            return
        for identity, seq_ids in self.free_later.items():
            for seq_id in seq_ids:
                self.host.free_seq(identity, seq_id)
        self.free_later.clear()
