"""The scheduler's pure core: the live sequences and every decision about them, as data in, data out.
``SchedulerCore`` is the facade over its parts, one job each, sharing one ``CoreState`` (:mod:`.state`):
:mod:`.admission`, :mod:`.steps`, :mod:`.results`, :mod:`.endings`, :mod:`.membership` and the
:mod:`.outbox`.

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

import time
from collections.abc import Callable, Iterable

from common import aici_wire, wire
from common.config import Controllers, Limits, Sessions
from common.textstream import TextStream
from services.scheduler.admission import Admission
from services.scheduler.controlled import ControlledSteps, MainReply, Plan
from services.scheduler.endings import Endings
from services.scheduler.membership import Membership
from services.scheduler.requests import LiveRequest
from services.scheduler.results import Results
from services.scheduler.state import CoreState
from services.scheduler.steps import Dispatch, Item, StepBuilder
from services.scheduler.workers import Place, least_loaded

__all__ = ["Dispatch", "Item", "SchedulerCore"]


class SchedulerCore:
    """Every live request of one scheduler (see the module docstring). ``text_stream(stop, keep_stop=,
    skip_special=)`` makes a request's detokenizer (see ``TextStream``); ``place`` is the placement policy of new
    sequences, ``worker_gone`` tells it that a worker was lost (``place`` only sees the workers with room);
    ``clock`` gives monotonic seconds (deadlines, session TTLs). It is also the controlled requests'
    ``controlled.Host``."""

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
        self.state = state = CoreState(limits, sessions, clock)
        self.controlled = ControlledSteps(self, controllers)
        endings = Endings(state, self.controlled)
        admission = Admission(state, endings, text_stream, place, generations_per_user)
        membership = Membership(state, endings, worker_gone)
        results = Results(state, endings, self.controlled, membership.worker_lost)
        # what the shell and the tests read (containers never replaced: these stay the state's)
        self.pool, self.sessions, self.requests = state.pool, state.sessions, state.requests
        self.queue, self.running, self.to_free = state.queue, state.running, state.to_free
        # the calls, each its part's
        self.submit, self.control, self.admit = admission.submit, admission.control, admission.admit
        self.drop_session, self.gateway_lost = admission.drop_session, admission.gateway_lost
        self.expire = admission.expire
        self.worker_hello, self.worker_lost = membership.worker_hello, membership.worker_lost
        self.build_steps = StepBuilder(state, self.controlled).build_steps
        self.step_done, self.apply = results.step_done, results.apply
        self.emit_deferred, self.finish, self.fail = endings.emit_deferred, endings.finish, endings.fail
        self.model_facts, self.max_model_len = state.model_facts, state.max_model_len
        self.new_seq_id, self.free_seq = state.new_seq_id, state.free_seq

    @property
    def prefill_chunk_tokens(self) -> int:
        return self.limits.prefill_chunk_tokens

    def take_output(self) -> list[tuple[bytes, wire.Msg]]:
        """What to send to gateways now: ``Events`` and ``RequestFailed`` messages, in order."""
        return self.state.outbox.take()

    def busy_workers(self) -> set[bytes]:
        """The workers a step may be built for (``CoreState.busy_workers``): the shell visits no others."""
        return self.state.busy_workers()

    # ------------------------------------------------------------------------------------------
    # Host: what controlled requests use (besides finish, fail and the above)

    def reserve(self, worker: bytes, tokens: int) -> None:
        info = self.pool.workers.get(worker)
        if info is not None:
            info.reserved_tokens += tokens

    def emit(self, request: LiveRequest, events: Iterable[wire.TokenEvent]) -> None:
        for event in events:
            self.state.outbox.event(request.gateway, event)

    # ------------------------------------------------------------------------------------------
    # the controlled part of the step

    def plan_controlled(self) -> tuple[Plan, aici_wire.PostPreProcess | None]:
        """The controlled part of the next step; send the request (when there is one) and pass its
        reply to :meth:`controlled_planned`, or, for a plan that goes ahead (``plan.ahead``: it goes into
        the step at once), to ``controlled.ahead_planned``."""
        return self.controlled.begin(self.state.controlled_running.values(), self.limits.step_token_budget,
                                     may_go_ahead=not self._plain_running())

    def follow_controlled(self) -> Plan | None:
        """The next controlled step, to send before the result of the one in flight (``plan.follows``; see
        ``ControlledSteps.follow``): once that result is applied, send ``controlled.follow_request()`` and pass
        its reply to ``controlled.ahead_planned``. None: it waits for the result (plain sequences run, or a
        controlled sequence needs more than its sampled token fed)."""
        if self._plain_running():
            return None
        return self.controlled.follow(self.state.running.values(), self.max_model_len())

    def controlled_workers(self) -> set[bytes]:
        """The workers running controlled requests: a controlled plan needs a step on each of them."""
        return set(self.state.controlled_on)

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
        return any(not r.submit.controller and not r.paused for r in self.state.running.values())

    def end_step(self) -> None:
        """After a step's results: controlled requests' events and endings."""
        self.controlled.flush()

    def end_controlled(self) -> None:
        """After a step's main-channel calls: the controlled requests they ended (``ControlledSteps.flush_ended``)."""
        self.controlled.flush_ended()

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
            num_layers=hello.num_layers,
            readout_concepts=hello.readout_concepts,
            readout_layers=hello.readout_layers,
            parked_sessions=len(self.sessions.parked),
            parked_tokens=self.sessions.parked_tokens(),
        )

