"""The gateway's link to the scheduler: one Dealer for request/reply, and routing of the token
events the scheduler pushes (one ``Events`` message per step) to per-request queues, with their text
worked out here for the requests submitted ``text_at_gateway`` (common.event_text).

Heartbeats (``GatewayAlive``, answered with the scheduler's incarnation) and the connection's drops
feed a :class:`common.incarnation.PeerWatch`: when the scheduler restarted, or dropped its connection
and did not answer within ``limits.peer_suspect_grace_s``, or stayed silent ``limits.peer_silence_s``,
every live request ends at once with ``service_unavailable`` (retryable). Nothing is resubmitted,
and nothing sent while the scheduler was down reaches the next one (the Dealer's ``immediate``).
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import structlog
import zmq
import zmq.asyncio

from common import socket_events, wire
from common.config import Settings
from common.errors import ERROR_TRAITS, INTERNAL_ERROR, SERVICE_UNAVAILABLE, TillerError
from common.event_text import EventTexts
from common.incarnation import PeerWatch, process_incarnation
from common.sockets import Dealer, PeerLost
from common.textstream import TextStream

log = structlog.get_logger()

COMMAND_TIMEOUT_S = 10.0
HEALTH_TIMEOUT_S = 2.0
# A ready scheduler's health (model facts, worker stage) is reused this long by request admission.
HEALTH_MAX_AGE_S = 1.0
WATCH_TICK_S = 0.2  # how often the scheduler's liveness is judged

StreamItem = wire.TokenEvent | wire.RequestFailed


def facts_of(health: wire.HealthReply) -> wire.ModelFacts:
    """The model facts of the scheduler's health reply (an empty set, no worker, if it sent none)."""
    return health.facts or wire.ModelFacts()


def worker_stage(health: wire.HealthReply) -> wire.WorkerStage:
    """The scheduler's view of its best worker: ``stage`` (absent | loading | ready | failed),
    ``progress``, ``message``. Generation needs a ready worker, not the rest of ``ready``."""
    return facts_of(health).worker


def _as_error(reply: wire.Message, what: str) -> TillerError:
    if isinstance(reply, wire.Error):
        code = reply.code if reply.code in ERROR_TRAITS else INTERNAL_ERROR
        return TillerError(code, reply.message)
    return TillerError(INTERNAL_ERROR, f"unexpected reply from the scheduler to {what}: {type(reply).__name__}")


class SchedulerClient:
    """The gateway's client of the scheduler: commands, health, and the token events routed per request."""

    def __init__(self, settings: Settings, ctx: zmq.asyncio.Context,
                 text_streams: Callable[[], TextStream] | None = None) -> None:
        # immediate: a Submit that waited while the scheduler was down, and was failed here meanwhile,
        # must not reach the next scheduler (it would generate it for nobody)
        # a readable identity of its own (several gateways are several peers to the scheduler: tiller up --gateways)
        self.identity = f"gateway-{socket.gethostname()}-{os.getpid()}"
        self._dealer = Dealer(ctx, settings.endpoint("scheduler"), curve=settings.curve, on_message=self._on_message,
                              identity=self.identity.encode(), immediate=True)
        limits = settings.limits
        self._heartbeat_s = limits.gateway_heartbeat_s
        self._watch = PeerWatch(silence_s=limits.peer_silence_s, suspect_grace_s=limits.peer_suspect_grace_s)
        self._streams: dict[str, asyncio.Queue[StreamItem]] = {}
        self._texts = EventTexts(text_streams)  # None: the scheduler works out every request's text
        self._health: wire.HealthReply | None = None
        self._health_at = 0.0
        self._health_refreshing = False
        self._background: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        self._dealer.start()
        loop = asyncio.get_running_loop()
        # a dropped connection to the scheduler (it died, or the network dropped) is checked at once
        socket_events.watch(self._dealer.sock, zmq.EVENT_DISCONNECTED,
                            lambda _event, _value: loop.call_soon_threadsafe(self._disconnected))
        for background in (self._heartbeat(), self._judge()):
            self._spawn(background)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _heartbeat(self) -> None:
        """Tell the scheduler this gateway lives (``wire.GatewayAlive``): should it die, the scheduler
        cancels its requests instead of generating them for nobody. The reply names the scheduler's
        incarnation."""
        while True:
            self._spawn(self._beat())
            await asyncio.sleep(self._heartbeat_s)

    async def _beat(self) -> None:
        try:
            reply = await self._call(wire.GatewayAlive(incarnation=process_incarnation()), timeout=self._heartbeat_s)
        except TillerError as exc:
            log.debug("scheduler.heartbeat_unanswered", reason=exc.message)
            return
        if isinstance(reply, wire.Alive):
            self._lost(self._watch.heard(reply.incarnation, time.monotonic()))

    async def _judge(self) -> None:
        while True:
            await asyncio.sleep(WATCH_TICK_S)
            self._lost(self._watch.check(time.monotonic(), busy=bool(self._streams)))

    def _disconnected(self) -> None:
        self._watch.disconnected(time.monotonic())
        self._spawn(self._beat())

    def _lost(self, reason: str | None) -> None:
        """The scheduler lost the requests it had: each live one ends now with a retryable error."""
        if reason is None:
            return
        self._watch.forget(time.monotonic())
        message = f"the scheduler was lost ({reason}); this request was not resubmitted: retry it"
        log.warning("scheduler.lost", reason=reason, requests=len(self._streams))
        self._dealer.abandon(message)
        traits = ERROR_TRAITS[SERVICE_UNAVAILABLE]
        self._texts.clear()
        for rid, queue in self._streams.items():
            queue.put_nowait(wire.RequestFailed(rid=rid, code=SERVICE_UNAVAILABLE, message=message,
                                                recoverable=traits[0], recovery_action=traits[1]))

    def close(self) -> None:
        """Close the sockets now (the context's ``term`` waits for every socket: a task's ``finally`` would
        run only once the loop turns again)."""
        for task in self._background:
            task.cancel()
        self._dealer.close()

    def _on_message(self, msg: wire.Message, _binary: list[bytes]) -> None:
        if isinstance(msg, wire.Events):
            try:
                events = msg.token_events()
            except ValueError as exc:  # a scheduler that does not speak this wire: its packed events are lost
                log.error("scheduler.malformed_events", error=str(exc))
                events = msg.events
            fill = self._texts.fill
            for event in events:
                fill(event)
                self._route(event.rid, event)
        elif isinstance(msg, wire.RequestFailed):
            self._texts.close(msg.rid)
            self._route(msg.rid, msg)
        elif isinstance(msg, wire.TextHandover):
            self._texts.close(msg.rid)
        else:
            log.warning("scheduler.unexpected_message", type=type(msg).__name__)

    def _route(self, rid: str, item: StreamItem) -> None:
        queue = self._streams.get(rid)
        if queue is None:  # the request was abandoned here (client gone, regenerate) before its end
            log.debug("scheduler.event_for_closed_stream", rid=rid)
        else:
            queue.put_nowait(item)

    def open_stream(self, rid: str) -> asyncio.Queue[StreamItem]:
        """Register ``rid`` before submitting it, so no event can arrive unrouted."""
        queue: asyncio.Queue[StreamItem] = asyncio.Queue()
        self._streams[rid] = queue
        return queue

    def close_stream(self, rid: str) -> None:
        self._streams.pop(rid, None)
        self._texts.close(rid)

    async def _call(self, msg: wire.Msg, *, timeout: float = COMMAND_TIMEOUT_S) -> wire.Message:
        what = type(msg).__name__
        try:
            reply, _ = await self._dealer.request(msg, timeout=timeout)
        except TimeoutError:
            raise TillerError(INTERNAL_ERROR, f"the scheduler did not answer {what}; is it running?") from None
        except PeerLost as exc:
            raise TillerError(SERVICE_UNAVAILABLE, str(exc)) from None
        return reply

    async def _command(self, msg: wire.Msg, answer: type[wire.Msg] = wire.RequestState) -> None:
        reply = await self._call(msg)
        if not isinstance(reply, answer):
            raise _as_error(reply, type(msg).__name__)

    async def submit(self, submit: wire.Submit) -> None:
        self._texts.submitting(submit)
        try:
            await self._command(submit, wire.Queued)
        except BaseException:
            self._texts.close(submit.rid)
            raise

    async def cancel(self, rid: str) -> None:
        await self._command(wire.Cancel(rid=rid))

    async def pause(self, rid: str) -> None:
        await self._command(wire.Pause(rid=rid))

    async def resume(self, rid: str) -> None:
        await self._command(wire.Resume(rid=rid))

    async def modify(self, rid: str, patch: wire.SamplingPatch, vectors: dict[str, bytes] | None = None) -> None:
        """``vectors``: the canonical content of the vectors ``patch.steering`` names (``Modify.steering_vectors``)."""
        await self._command(wire.Modify(rid=rid, patch=patch, steering_vectors=vectors or {}))

    async def drop_session(self, key: str) -> None:
        """The KV the scheduler keeps for ``key`` between turns may go (a deleted response)."""
        await self._command(wire.SessionDrop(key=key), wire.Ok)

    def cancel_soon(self, rid: str) -> None:
        """Cancel in the background: for cleanup paths (disconnects, task cancellation) that must
        neither wait nor be interrupted by the cancellation they are handling."""
        task = asyncio.get_running_loop().create_task(self._cancel_quietly(rid))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _cancel_quietly(self, rid: str) -> None:
        try:
            await self.cancel(rid)
        except TillerError as exc:  # typically: it had just finished
            log.debug("scheduler.cancel_refused", rid=rid, reason=exc.message)

    def recent_health(self, max_age: float) -> wire.HealthReply | None:
        """The last health reply seen, never waiting: one older than ``max_age`` seconds is refreshed
        in the background (for readers such as /metrics that must answer even without a scheduler)."""
        if time.monotonic() - self._health_at > max_age and not self._health_refreshing:
            self._health_refreshing = True
            task = asyncio.get_running_loop().create_task(self._refresh_health())
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        return self._health

    def health_age(self) -> float:
        """Seconds since the scheduler last answered Health (infinite if it never did)."""
        return time.monotonic() - self._health_at if self._health is not None else float("inf")

    async def _refresh_health(self) -> None:
        try:
            await self.health()
        except TillerError as exc:
            log.debug("scheduler.health_unavailable", reason=exc.message)
        finally:
            self._health_refreshing = False

    async def health(self, max_age: float = 0.0) -> wire.HealthReply:
        """The scheduler's health; a ready reply younger than ``max_age`` seconds is reused."""
        now = time.monotonic()
        cached = self._health
        if cached is not None and worker_stage(cached).stage == "ready" and now - self._health_at <= max_age:
            return cached
        reply = await self._call(wire.Health(), timeout=HEALTH_TIMEOUT_S)
        if not isinstance(reply, wire.HealthReply):
            raise _as_error(reply, "Health")
        self._health, self._health_at = reply, now
        return reply
