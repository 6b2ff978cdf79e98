"""Session store service: a ROUTER answering record/feedback/lookup, Evergreen node, Salience
session and steering vector messages from SQLite.

Gateways' heartbeats (``GatewayAlive``) renew the busy leases of their running Salience turns and
keep their live Evergreen sessions' rows; what a dead gateway held lapses after ``sessions.busy_lease_s``.
Several gateways on one port count their clients' requests here (``RateHit``), against one limit.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time

import structlog
import zmq.asyncio

from common import wire
from common.config import Settings
from common.errors import INTERNAL_ERROR, INVALID_REQUEST
from common.incarnation import process_incarnation
from common.quotas import QuotaExceeded
from common.ratelimit import SlidingWindow
from common.sockets import Router, reply_mid
from services.session_store.db import BadRecord, Store
from services.session_store.holders import EvergreenHolders
from services.session_store.salience import RESOURCE_EXHAUSTED, SalienceSessions, SessionError
from services.session_store.vectors import SteeringVectors, VectorMessage

log = structlog.get_logger()


class SessionStore:
    def __init__(self, settings: Settings) -> None:
        implicit_user = settings.api_auth.default_user  # the owner of what a database made before owners holds
        self.store = Store(settings.db_path, implicit_user)
        self.sessions = SalienceSessions(self.store.conn, settings.sessions.ttl_s, implicit_user, settings.tenants)
        self.vectors = SteeringVectors(self.store.conn, settings.steering)
        self.lease_s = settings.sessions.busy_lease_s
        self.evergreen_holders = EvergreenHolders(self.lease_s)
        self.rates = SlidingWindow(settings.limits.rate_limit_per_minute)  # the gateways' one window (RateHit)
        self.router = Router(zmq.asyncio.Context.instance(), settings.endpoint("session_store"), curve=settings.curve)

    def handle(self, msg: wire.Message) -> wire.Msg:
        if isinstance(msg, wire.Health):
            return wire.HealthReply(service="session_store", ready=True, incarnation=process_incarnation())
        if isinstance(msg, wire.GatewayAlive):
            self.sessions.renew(msg.leases, self.lease_s)
            self.evergreen_holders.renew(msg.evergreen, time.monotonic())
            return wire.Alive(service="session_store", incarnation=process_incarnation())
        if isinstance(msg, wire.RateHit):
            return wire.RateVerdict(retry_after_s=self.rates.hit(msg.client))
        if isinstance(msg, wire.RecordRequest):
            self.store.record_request(msg.rid, msg.owner, msg.surface, msg.model, msg.prompt, msg.params,
                                      msg.created_at)
            return wire.Ok()
        if isinstance(msg, wire.RecordCompletion):
            if not self.store.record_completion(msg.rid, msg.generated_text, msg.finish_reason, msg.prompt_tokens,
                                                msg.completion_tokens, msg.error):
                return wire.Error(code="not_found", message=f"no request {msg.rid!r}", rid=msg.rid)
            return wire.Ok()
        if isinstance(msg, wire.RecordFeedback):
            feedback_id = self.store.record_feedback(msg.rid, msg.caller, msg.rating, msg.text, msg.position)
            if feedback_id is None:
                return wire.Error(code="not_found", message=f"no request {msg.rid!r} to attach feedback to", rid=msg.rid)
            return wire.FeedbackRecorded(feedback_id=feedback_id)
        if isinstance(msg, wire.GetRequest):
            record = self.store.get_request(msg.rid, msg.caller)
            if record is None:
                return wire.Error(code="not_found", message=f"no request {msg.rid!r}", rid=msg.rid)
            return wire.RequestRecordReply(record=record)
        if isinstance(msg, wire.ResponsePut | wire.ResponseGet | wire.ResponseDelete):
            return self._response(msg)
        if isinstance(msg, VectorMessage):
            return self.vectors.handle(msg)
        if isinstance(msg, wire.EvergreenPut):
            self.store.evergreen_put(msg.session_id, [(f.node_id, f.seq, f.fragment) for f in msg.fragments])
            return wire.Ok()
        if isinstance(msg, wire.EvergreenDrop):
            self.store.evergreen_drop(msg.session_id, msg.node_ids)
            return wire.Ok()
        if isinstance(msg, wire.EvergreenClose):
            self.store.evergreen_close(msg.session_id)
            return wire.Ok()
        if isinstance(msg, wire.EvergreenGetNodes):
            return wire.EvergreenNodes(fragments=self.store.evergreen_fragments(msg.session_id))
        if isinstance(msg, wire.SalienceOpen | wire.SalienceClose | wire.SalienceFork | wire.SalienceGet
                      | wire.SalienceBegin | wire.SalienceEnd):
            try:
                return self._salience(msg)
            except SessionError as exc:
                return wire.Error(code=exc.code, message=exc.message)
            except QuotaExceeded as exc:  # the gateway answers RESOURCE_EXHAUSTED
                return wire.Error(code=RESOURCE_EXHAUSTED, message=exc.message)
        return wire.Error(code=INVALID_REQUEST, message=f"the session store does not take {type(msg).__name__}")

    def _response(self, msg: wire.ResponsePut | wire.ResponseGet | wire.ResponseDelete) -> wire.Msg:
        if isinstance(msg, wire.ResponsePut):
            self.store.response_put(msg)
            return wire.Ok()
        not_found = wire.Error(code="not_found", message=f"no response {msg.response_id!r}")
        if isinstance(msg, wire.ResponseGet):
            return self.store.response_get(msg.response_id) or not_found
        return wire.Ok() if self.store.response_delete(msg.response_id) else not_found

    def _salience(self, msg: wire.Message) -> wire.Msg:
        sessions = self.sessions
        if isinstance(msg, wire.SalienceOpen):
            return sessions.open(msg.model, msg.caller)
        if isinstance(msg, wire.SalienceClose):
            if sessions.close(msg.session_id, msg.caller):
                return wire.SalienceSession(session_id=msg.session_id)
            return wire.Ok()
        if isinstance(msg, wire.SalienceFork):
            return sessions.fork(msg.session_id, msg.at_position, msg.caller)
        if isinstance(msg, wire.SalienceGet):
            return sessions.get(msg.session_id, msg.caller)
        if isinstance(msg, wire.SalienceBegin):
            return sessions.begin(msg)
        assert isinstance(msg, wire.SalienceEnd)
        sessions.end(msg)
        return wire.Ok()

    async def expire_sessions(self) -> None:
        """Sweep idle Salience sessions (each access also checks its own TTL)."""
        period = min(self.sessions.ttl_s / 4, 30.0)
        while True:
            await asyncio.sleep(period)
            try:
                if expired := self.sessions.expire():
                    log.info("session_store.sessions_expired", count=expired)
                if expired := self.store.expire_responses():
                    log.info("session_store.responses_expired", count=expired)
            except sqlite3.Error:
                log.exception("session_store.expire_failed")

    async def drop_orphans(self) -> None:
        """Drop the node rows of Evergreen sessions whose gateway stopped renewing them (it died)."""
        while True:
            await asyncio.sleep(self.lease_s / 4)
            try:
                for session_id in self.evergreen_holders.orphans(self.store.evergreen_session_ids(), time.monotonic()):
                    self.store.evergreen_close(session_id)
                    log.info("session_store.evergreen_orphan_dropped", session_id=session_id)
            except sqlite3.Error:
                log.exception("session_store.orphans_failed")

    async def run(self) -> None:
        log.info("session_store.ready", endpoint=self.router.endpoint)
        loop = asyncio.get_running_loop()
        self._sweepers = [loop.create_task(self.expire_sessions()), loop.create_task(self.drop_orphans())]
        while True:
            identity, msg, _ = await self.router.recv()
            try:
                reply = self.handle(msg)
            except BadRecord as exc:
                log.warning("session_store.bad_record", type=type(msg).__name__, error=str(exc))
                reply = wire.Error(code=INVALID_REQUEST, message=str(exc))
            except sqlite3.Error as exc:
                log.exception("session_store.sqlite_failed")
                reply = wire.Error(code=INTERNAL_ERROR, message=f"storage failed: {exc}")
            except Exception as exc:  # a bug handling one message must not stop the store (nor lose the others)
                log.exception("session_store.handler_failed", type=type(msg).__name__)
                reply = wire.Error(code=INTERNAL_ERROR,
                                   message=f"the session store failed: {type(exc).__name__}: {exc}")
            reply.mid = reply_mid(msg)
            await self.router.send(identity, reply)
