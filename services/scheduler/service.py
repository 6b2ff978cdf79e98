"""The scheduler's service shell: sockets, liveness, heartbeats, health and the pipelined step loop.

Gateways connect to the frontend ROUTER and submit requests; workers connect to the worker ROUTER,
announce themselves and execute one batched ``Step`` per message. Every decision is the pure core's
(``core.py``); this module moves messages between the sockets and the core, times the steps and
watches peers.

Steps are pipelined per worker: each worker has up to ``limits.pipeline_depth`` steps in flight, so
it finds its next step waiting when it finishes one, and its next step is built as soon as one of its
results is applied, whatever the other workers are doing: a slow worker never holds back a fast one.
The text of the tokens applied last is worked out while the workers compute. The controlled
sequences' main-channel calls never hold up plain ones: the next step's controlled part (one
``post_pre_process`` for all workers, and ``mid_process`` while plain sequences run) is prepared in
the background while plain steps go on, and joins the first steps built once it is ready and every
worker running controlled requests has room in its pipeline (those workers get no plain steps until
then), its mask frame with it. With no plain sequence running, a step with controlled sequences goes
out with ``masks_follow`` instead: their ``mid_process`` runs while the worker computes the forward
pass, and its masks follow in a ``StepMasks``. When every controlled sequence just sampled a token and its
controller flags pre_process as the default (``controllers.step_ahead``), that step goes out as soon as the
last one's result is in, and its ``post_pre_process`` runs during the forward pass too, before ``mid_process``;
with ``controllers.pipeline`` it goes out even before that result, as soon as the masks of the step in flight
are out (``follow``), and its calls start once that result is applied.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, defaultdict, deque
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import structlog
import zmq
import zmq.asyncio

from common import aici_wire, socket_events, wire
from common.config import Settings
from common.errors import INTERNAL_ERROR, INVALID_REQUEST
from common.incarnation import process_incarnation
from common.model_source import load_tokenizer
from common.sockets import Router, reply_mid
from common.textstream import TextStream, text_table
from services.scheduler.controlled import MainReply, Plan
from services.scheduler.core import Dispatch, SchedulerCore
from services.scheduler.gateways import Gateways
from services.scheduler.main_channel import MainChannel
from services.scheduler.placement import KVAwarePlacement
from services.scheduler.workers import WorkerInfo

log = structlog.get_logger()

# How often the step loop checks that the workers of the steps in flight are still there (and
# times out requests past their deadline); how long it sleeps with no step in flight.
STEP_CHECK_S = 0.1
IDLE_WAIT_S = 0.25
# How often idle workers are pinged, and after how long without an answer they are dropped.
LIVENESS_PING_S = 2.0
LIVENESS_DEAD_S = 10.0


@dataclass(eq=False)
class InFlight:
    """A step sent to its worker, and its result once it is back."""

    dispatch: Dispatch
    worker: WorkerInfo | None  # this life of it: a restart under the same identity is another
    deadline: float  # when the worker counts as lost if it has not answered
    controlled: bool  # planned with controlled sequences: the next plan waits for its result
    follows: bool = False  # went out before the result of the controlled step before it: its calls wait for that
    done: bool = False
    result: wire.StepResult | None = None  # None when done: the worker was lost, nothing to apply


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class Scheduler:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.incarnation = process_incarnation()
        self.limits = settings.limits
        tokenizer = load_tokenizer(settings)
        text_table(tokenizer)  # the text streams' tables, built at start rather than by the first request
        self.placement = KVAwarePlacement(settings.distributed.placement_balance)
        self.core = SchedulerCore(settings.limits, settings.sessions, settings.controllers,
                                  lambda stop, **options: TextStream(tokenizer, stop=stop, **options),
                                  place=self.placement, worker_gone=self.placement.forget,
                                  generations_per_user=settings.tenants.max_generations_per_user)
        ctx = zmq.asyncio.Context.instance()
        self.frontend = Router(ctx, settings.endpoint("scheduler"), curve=settings.curve)
        self.worker_router = Router(ctx, settings.endpoint("worker"), curve=settings.curve, heartbeat_s=(
            settings.distributed.heartbeat_s, settings.distributed.heartbeat_timeout_s))
        self.channel = MainChannel(settings.endpoint("controller_main"), settings.curve)
        self.gateways = Gateways(settings.limits.gateway_silence_s)
        self.flights: dict[bytes, deque[InFlight]] = defaultdict(deque)  # worker -> its steps in flight, oldest first
        self.waiter: asyncio.Future[None] | None = None  # the step loop's sleep, while it sleeps
        self.next_check = 0.0  # when the step loop next checks the workers in flight and the deadlines
        self.background: set[asyncio.Task[None]] = set()
        self.preparing: asyncio.Task[Plan] | None = None  # the next step's controlled part, while its calls run
        self.ahead: aici_wire.PostPreProcess | None = None  # the post_pre_process of a plan going out ahead of it
        self.calls: asyncio.Future[None] | None = None  # the controlled step's main-channel calls, then its StepMasks
        self.masks_owed: list[Dispatch] = []  # steps sent with masks_follow whose StepMasks is not sent yet

    def _flush(self) -> None:
        """Send what the core has for gateways; a state change may let the step loop go on."""
        for gateway, msg in self.core.take_output():
            self.frontend.post(gateway, msg)
        self.wake()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    def wake(self) -> None:
        """Let the step loop go on now if it sleeps (new work, a result back, a worker ready)."""
        if self.waiter is not None:
            _wake(self.waiter)

    # ------------------------------------------------------------------------------------------
    # frontend

    def on_frontend_message(self, gateway: bytes, msg: wire.Message, _binary: list[bytes]) -> None:
        incarnation = msg.incarnation if isinstance(msg, wire.GatewayAlive) else None
        if self.gateways.heard(gateway, incarnation, time.monotonic()):
            self._gateway_lost(gateway, "it restarted")
        if isinstance(msg, wire.Health):  # it waits for the controller runtime: the other messages do not
            self._spawn(self._answer_health(gateway, msg))
            return
        try:
            reply = self._handle_frontend(gateway, msg)
        except Exception as exc:  # a bug handling one message must not stop the scheduler
            reply = self._failed(msg, exc)
        self._reply(gateway, msg, reply)

    async def _answer_health(self, gateway: bytes, msg: wire.Health) -> None:
        try:
            reply: wire.Msg = await self._health()
        except Exception as exc:
            reply = self._failed(msg, exc)
        self._reply(gateway, msg, reply)

    def _failed(self, msg: wire.Message, exc: Exception) -> wire.Error:
        log.error("scheduler.frontend_failed", type=type(msg).__name__, exc_info=exc)
        return wire.Error(code=INTERNAL_ERROR, message=f"scheduler failed: {exc}")

    def _reply(self, gateway: bytes, request: wire.Message, reply: wire.Msg) -> None:
        reply.mid = reply_mid(request)
        self.frontend.post(gateway, reply)
        self._flush()

    def _handle_frontend(self, gateway: bytes, msg: wire.Message) -> wire.Msg:
        if isinstance(msg, wire.Submit):
            return self.core.submit(gateway, msg)
        if isinstance(msg, wire.GatewayAlive):
            return wire.Alive(service="scheduler", incarnation=self.incarnation)
        if isinstance(msg, wire.SessionDrop):
            self.core.drop_session(msg.key)
            return wire.Ok()
        if isinstance(msg, (wire.Cancel, wire.Pause, wire.Resume, wire.Modify)):
            return self.core.control(gateway, msg)
        return wire.Error(code=INVALID_REQUEST, message=f"the scheduler does not take {type(msg).__name__} messages")

    async def _health(self) -> wire.HealthReply:
        controller = await self.channel.ping()
        self.core.controlled.runtime_heard(self.channel.incarnation)
        seq_steps = self.core.controlled.seq_steps
        main_s = self.channel.busy_s
        facts = self.core.facts()
        facts.model = self.settings.served_model_name
        facts.controller_runtime = controller
        facts.controller_steps = wire.ControllerStepStats(
            main_s=round(main_s, 6), seq_steps=seq_steps,
            us_per_seq_step=round(main_s / seq_steps * 1e6, 1) if seq_steps else 0.0,
            followed_steps=self.core.controlled.followed_steps)
        facts.workers = [self.placement.worker_figures(w) for w in self.core.pool.workers.values()]
        facts.gateways = self.gateways.figures(Counter(r.gateway for r in self.core.requests.values()),
                                               time.monotonic())
        ready = self.core.model_facts() is not None and controller == "ok"
        return wire.HealthReply(service="scheduler", ready=ready, facts=facts, incarnation=self.incarnation)

    # ------------------------------------------------------------------------------------------
    # workers

    def on_worker_message(self, identity: bytes, msg: wire.Message, _binary: list[bytes]) -> None:
        self.core.pool.touch(identity)
        if isinstance(msg, wire.StepResult):
            self.core.step_done(identity, msg)
            for flight in self.flights.get(identity, ()):
                if flight.dispatch.step.step_id == msg.step_id:
                    if not flight.done:
                        flight.done, flight.result = True, msg
                        self.placement.observe(identity, flight.dispatch.step, msg)
                        self.wake()
                    break
            else:  # not a step of its in flight (one it was given up on for, or never sent it): nothing to apply
                log.warning("scheduler.unknown_step_result", worker=identity.decode(errors="replace"),
                            step_id=msg.step_id)
        elif isinstance(msg, wire.WorkerHello):
            if self.core.worker_hello(identity, msg):
                log.info("scheduler.worker", worker=identity.decode(errors="replace"), stage=msg.stage,
                         progress=msg.progress, message=msg.message)
            if msg.stage == "ready":
                self.wake()
        elif isinstance(msg, wire.HealthReply):
            pass  # touch() above was the point
        else:  # a peer in the wrong role (a gateway's message to the workers' socket): told, as a malformed one is
            log.warning("scheduler.worker_unexpected", worker=identity.decode(errors="replace"),
                        type=type(msg).__name__)
            self.worker_router.post(identity, wire.Error(
                code=INVALID_REQUEST, message=f"the scheduler's worker socket does not take {type(msg).__name__} "
                                              f"messages", mid=reply_mid(msg)))

    def watch_worker_disconnects(self) -> None:
        """A dropped worker connection makes every worker suspect until it answers again."""
        loop = asyncio.get_running_loop()
        socket_events.watch(self.worker_router.sock, zmq.EVENT_DISCONNECTED,
                            lambda event, value: loop.call_soon_threadsafe(self._worker_connection_dropped))

    def _worker_connection_dropped(self) -> None:
        now = time.monotonic()
        for worker in self.core.pool.workers.values():
            worker.suspect_since = now
            if not self.flights.get(worker.identity):
                self.worker_router.post(worker.identity, wire.Health())

    def _suspect_expired(self, worker: WorkerInfo, now: float) -> bool:
        """Whether a worker whose peer connection dropped stayed silent past the grace."""
        return worker.suspect_since is not None and now - worker.suspect_since > self.limits.peer_suspect_grace_s

    async def check_liveness(self) -> None:
        while True:
            await asyncio.sleep(LIVENESS_PING_S / 4)
            now = time.monotonic()
            for worker in list(self.core.pool.workers.values()):
                if self.flights.get(worker.identity):
                    continue  # the step loop watches it
                silent = now - worker.last_seen
                if self._suspect_expired(worker, now) or silent > LIVENESS_DEAD_S:
                    self.core.worker_lost(worker.identity, "the worker stopped answering")
                elif silent > LIVENESS_PING_S:
                    await self.worker_router.send(worker.identity, wire.Health())
            self.core.expire()
            self._expire_gateways()
            self._flush()

    def _expire_gateways(self) -> None:
        """Cancel the requests of a gateway whose heartbeats stopped: it died with them (a gateway with
        nothing to stream is silent too, and simply stops being watched until its next heartbeat)."""
        for gateway in self.gateways.expired(time.monotonic()):
            self._gateway_lost(gateway, "its heartbeats stopped")

    def _gateway_lost(self, gateway: bytes, reason: str) -> None:
        """Cancel the requests of one gateway (the others' go on)."""
        if orphans := self.core.gateway_lost(gateway):
            log.warning("scheduler.gateway_lost", gateway=gateway.decode(errors="replace"), reason=reason,
                        requests=orphans)

    # ------------------------------------------------------------------------------------------
    # the step loop

    async def step_loop(self) -> None:
        core = self.core
        while True:
            self._check(time.monotonic())
            core.admit()
            if self._send_steps():
                continue  # queue the steps after them at once, where pipelines have room
            if not any(self.flights.values()):
                core.emit_deferred()
                core.end_step()
                self._flush()
                await self._sleep(IDLE_WAIT_S)
                continue
            # The text of the tokens applied last is worked out while the workers compute.
            core.emit_deferred()
            self._flush()
            if not any(flight[0].done for flight in self.flights.values() if flight):
                await self._sleep(max(self.next_check - time.monotonic(), 0.0))
                self._check(time.monotonic())
            applied = False
            for identity, flight in list(self.flights.items()):
                while flight and flight[0].done:
                    done = flight.popleft()
                    # a result of a worker lost meanwhile (a result before it was malformed) is not applied
                    if done.result is not None and core.pool.workers.get(identity) is done.worker:
                        core.apply(done.dispatch, done.result)
                        applied = True
                if not flight and identity not in core.pool.workers:
                    del self.flights[identity]
            if applied:  # not on a mere wake-up mid-step: controlled events then carry only the controllers' time
                core.end_step()
            self._follow_calls()
            self._flush()

    async def _sleep(self, timeout: float) -> None:
        """Until :meth:`wake` or ``timeout`` seconds, whichever comes first."""
        loop = asyncio.get_running_loop()
        self.waiter = waiter = loop.create_future()
        timer = loop.call_later(timeout, _wake, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self.waiter = None

    def _check(self, now: float) -> None:
        """Every ``STEP_CHECK_S``: requests past their deadline time out, and a step whose worker was
        lost (or restarted) meanwhile is done with nothing to apply (its requests have failed already);
        a worker that is past its step's deadline, or stayed silent after its connection dropped, is
        lost."""
        if now < self.next_check:
            return
        self.next_check = now + STEP_CHECK_S
        self.core.expire()
        for identity, flight in self.flights.items():
            for sent in flight:
                if sent.done:
                    continue
                worker = sent.worker
                if worker is None or self.core.pool.workers.get(identity) is not worker:
                    sent.done = True
                elif now > sent.deadline or self._suspect_expired(worker, now):
                    self.core.worker_lost(identity, "the worker died or did not finish its step in time")
                    self._flush()
                    sent.done = True

    def _send_steps(self) -> bool:
        """Build and send the next step of every ready worker whose pipeline has room (with the
        controlled part when it is ready, see the module docstring); whether any went out."""
        core = self.core
        depth = self.limits.pipeline_depth
        roomy = {w.identity for w in core.pool.ready() if len(self.flights[w.identity]) < depth}
        if not roomy:
            return False
        plan = self._controlled_part(roomy)
        steps = core.build_steps(plan, roomy)
        if not steps:
            return False
        calls = None
        follows = plan is not None and plan.follows  # its calls wait for the result in flight (_follow_calls)
        if self.ahead is not None:  # its post_pre_process, then mid_process, run during the forward pass
            calls, self.ahead = self._step_ahead(self.ahead), None
        elif not follows and any(d.step.masks_follow for d in steps):
            mid = core.controlled.mid_request()
            calls = None if mid is None else self._mid_process(mid)
        controlled = bool(plan and plan.per_worker)
        deadline = time.monotonic() + self.limits.worker_step_timeout_s
        for dispatch in steps:
            identity, step = dispatch.worker, dispatch.step
            self.flights[identity].append(InFlight(dispatch, core.pool.workers.get(identity), deadline, controlled,
                                                   follows))
            self.worker_router.post(identity, step, dispatch.frames)
            if step.masks_follow:  # the controllers' mid_process runs while the worker computes the forward pass
                self.masks_owed.append(dispatch)
        if calls is not None:
            self.calls = asyncio.ensure_future(self._controller_calls(calls))
        return True

    def _controlled_part(self, roomy: set[bytes]) -> Plan | None:
        """The controlled part of the steps being built, when it is ready (None: none this time). Its
        main-channel calls run in the background (:meth:`_prepare`): plain steps do not wait for them.
        It is planned and taken only when every worker running controlled requests is in ``roomy``;
        until then those leave ``roomy``, so that they drain. While controlled steps are in flight, only
        a step that follows them may go (:meth:`_follow_part`)."""
        if self.calls is not None:
            return None  # the calls of the controlled step in flight are under way
        if any(f.controlled for flight in self.flights.values() for f in flight):
            return self._follow_part(roomy)  # the controlled sequences' results are not in yet
        if self.preparing is not None and not self.preparing.done():
            return None
        waiting = self.core.controlled_workers()
        if not waiting <= roomy:
            roomy -= waiting
            return None
        if self.preparing is not None:
            plan, self.preparing = self.preparing.result(), None
            return plan
        plan, request = self.core.plan_controlled()
        if request is None:
            return plan
        if plan.ahead:
            self.ahead = request
            return plan
        self.preparing = asyncio.get_running_loop().create_task(self._prepare(plan, request))
        self.preparing.add_done_callback(lambda _: self.wake())
        return None

    def _follow_part(self, roomy: set[bytes]) -> Plan | None:
        """The next controlled step, sent before the results of the one in flight (``controllers.pipeline``,
        ``core.follow_controlled``) when no step went out so already and every worker running controlled
        requests has room; None: it waits for them."""
        if any(f.follows for flight in self.flights.values() for f in flight):
            return None
        if not self.core.controlled_workers() <= roomy:
            return None
        return self.core.follow_controlled()

    def _follow_calls(self) -> None:
        """Start the calls of a step that went out with ``follow`` once no controlled step before it is in flight
        (their results applied, or their worker lost)."""
        if self.core.controlled.followed is None:
            return
        flights = [f for flight in self.flights.values() for f in flight if f.controlled]
        if any(not f.follows for f in flights):
            return
        for f in flights:
            f.follows = False
        request = self.core.controlled.follow_request()
        self.calls = asyncio.ensure_future(self._controller_calls(self._step_ahead(request)))

    async def _prepare(self, plan: Plan, request: aici_wire.PostPreProcess) -> Plan:
        plan = self.core.controlled_planned(plan, await self._main_call(request))
        if (mid := self.core.mid_first()) is not None:
            await self._mid_process(mid)
        self._end_controlled()
        return plan

    async def _main_call(self, request: aici_wire.MainRequest) -> MainReply:
        try:
            reply = await self.channel.call(request, self.settings.controllers.main_timeout_s)
        except Exception as exc:  # a bug must fail the controlled requests, not the step loop
            log.exception("scheduler.main_call_failed")
            return MainReply(error=f"controller step failed: {exc}")
        self.core.controlled.runtime_heard(reply.incarnation)  # before the reply is applied
        return reply

    async def watch_runtime(self) -> None:
        """While controlled requests are live, ping the controller runtime every heartbeat: a restart
        between two steps (its connection's drop unseen) is known by its new incarnation at once."""
        while True:
            await asyncio.sleep(self.settings.distributed.heartbeat_s)
            if self.core.controlled.requests:
                await self.channel.ping()
                self.core.controlled.runtime_heard(self.channel.incarnation)
                self._flush()

    async def _mid_process(self, request: aici_wire.MidProcess) -> None:
        self.core.controlled.mid_done(await self._main_call(request))

    async def _step_ahead(self, request: aici_wire.PostPreProcess) -> None:
        """The main-channel calls of a step that went out ahead of them."""
        mid = self.core.controlled.ahead_planned(await self._main_call(request))
        if mid is not None:
            await self._mid_process(mid)

    def _end_controlled(self) -> None:
        """The controlled requests that main-channel calls just ended end now, their clients told at once."""
        self.core.end_controlled()
        self._flush()

    async def _controller_calls(self, calls: Coroutine[Any, Any, None]) -> None:
        """A controlled step's main-channel calls, then the masks of the steps sent with ``masks_follow`` and the
        requests the calls ended; then the next controlled step may be planned, and the one that follows this
        step goes at once (the step loop, when it wakes, may first apply the result that step would not have
        waited for)."""
        try:
            await calls
        except Exception:  # a bug: the workers give the steps up without their masks (limits.worker_step_timeout_s)
            log.exception("scheduler.controller_calls_failed")
        owed, self.masks_owed = self.masks_owed, []
        for dispatch in owed:
            try:
                self.worker_router.post(dispatch.worker, *self.core.controlled.step_masks(dispatch.step))
            except Exception:  # as above
                log.exception("scheduler.step_masks_failed", step_id=dispatch.step.step_id)
        self._end_controlled()
        self.calls = None
        self.wake()
        if any(f.controlled for flight in self.flights.values() for f in flight):
            self._send_steps()

    async def run(self) -> None:
        log.info("scheduler.listening", frontend=self.frontend.endpoint, workers=self.worker_router.endpoint)
        self.frontend.serve(self.on_frontend_message)
        self.worker_router.serve(self.on_worker_message)
        self.watch_worker_disconnects()
        await asyncio.gather(
            self.step_loop(),
            self.check_liveness(),
            self.watch_runtime(),
        )

