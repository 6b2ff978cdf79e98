"""The Salience servicer's link to the session store, which owns every session's tokens and images."""

from __future__ import annotations

import asyncio

import grpc
import structlog
import zmq.asyncio

from common import wire
from common.config import Settings
from common.sockets import Dealer

log = structlog.get_logger()

STORE_TIMEOUT_S = 10.0

# session store error codes -> gRPC status
STATUS = {
    "not_found": grpc.StatusCode.NOT_FOUND,
    "failed_precondition": grpc.StatusCode.FAILED_PRECONDITION,
    "resource_exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "aborted": grpc.StatusCode.ABORTED,
    "invalid_request": grpc.StatusCode.INVALID_ARGUMENT,
}


class SessionStoreError(Exception):
    def __init__(self, status: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class SessionStoreClient:
    """Sessions in the session store; and, when one is closed, the word to the scheduler that the
    KV it keeps for the session between turns can go."""

    def __init__(self, settings: Settings, ctx: zmq.asyncio.Context) -> None:
        # immediate: a call that timed out (UNAVAILABLE to the client) while the store was down is never
        # delivered to the restarted store; else a Generate told to retry would still commit its tokens
        # and hold the session busy later, for no turn
        self._dealer = Dealer(ctx, settings.endpoint("session_store"), curve=settings.curve, immediate=True)
        self._scheduler = Dealer(ctx, settings.endpoint("scheduler"), curve=settings.curve)
        self._drops: set[asyncio.Task[None]] = set()  # SessionDrops on their way (nobody waits for them)

    def close(self) -> None:
        self._dealer.close()
        self._scheduler.close()

    async def _call(self, msg: wire.Msg) -> wire.Message:
        try:
            reply, _ = await self._dealer.request(msg, timeout=STORE_TIMEOUT_S)
        except TimeoutError:
            raise SessionStoreError(
                grpc.StatusCode.UNAVAILABLE, "the session store did not answer; is it running? retry shortly"
            ) from None
        if isinstance(reply, wire.Error):
            raise SessionStoreError(STATUS.get(reply.code, grpc.StatusCode.INTERNAL), reply.message)
        return reply

    async def _session(self, msg: wire.Msg) -> wire.SalienceSession:
        reply = await self._call(msg)
        if not isinstance(reply, wire.SalienceSession):
            raise SessionStoreError(grpc.StatusCode.INTERNAL, f"unexpected session store reply {type(reply).__name__}")
        return reply

    async def open(self, model: str, caller: wire.Principal) -> wire.SalienceSession:
        return await self._session(wire.SalienceOpen(model=model, caller=caller))

    async def close_session(self, session_id: str, caller: wire.Principal) -> None:
        """Close the session in the store, then tell the scheduler its parked KV may go, without waiting for that:
        the session is closed once the store says so (a stopped scheduler held CloseSession for the store's
        timeout, past a client's shorter deadline)."""
        closed = await self._call(wire.SalienceClose(session_id=session_id, caller=caller))
        if not isinstance(closed, wire.SalienceSession):  # nothing was closed: nothing parked may go either
            return
        drop = asyncio.ensure_future(self._drop(session_id))
        self._drops.add(drop)
        drop.add_done_callback(self._drops.discard)

    async def _drop(self, session_id: str) -> None:
        try:  # best effort: a scheduler that does not answer lets the KV go after the TTL
            await self._scheduler.request(wire.SessionDrop(key=session_id), timeout=STORE_TIMEOUT_S)
        except TimeoutError:
            log.info("salience.session_drop_unanswered", session_id=session_id)

    async def fork(self, session_id: str, at_position: int, caller: wire.Principal) -> wire.SalienceSession:
        return await self._session(wire.SalienceFork(session_id=session_id, caller=caller, at_position=at_position))

    async def get(self, session_id: str, caller: wire.Principal) -> wire.SalienceSession:
        return await self._session(wire.SalienceGet(session_id=session_id, caller=caller))

    async def begin(self, begin: wire.SalienceBegin) -> wire.SalienceSession:
        return await self._session(begin)

    async def end(self, session_id: str, lease: str, append_tokens: list[int]) -> None:
        await self._call(wire.SalienceEnd(session_id=session_id, lease=lease, append_tokens=append_tokens))
