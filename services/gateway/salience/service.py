"""The Salience servicer (salience.proto, ``salience.v1``), grpc.aio in the gateway's event loop.

Sessions live in the session store; Generate turns run through the scheduler like every other
surface (see :mod:`services.gateway.salience.turn`). Auth (``sessions.auth_token``, or the ``api_auth``
tokens when they guard every surface) is the gRPC server's, before any RPC here runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import wraps
from typing import Any, TypeVar

import grpc
import structlog
import zmq.asyncio

from common import wire
from common.protos.salience.v1 import salience_pb2 as pb
from common.protos.salience.v1 import salience_pb2_grpc as pb_grpc
from common.errors import INVALID_REQUEST, TillerError
from services.gateway.deps import Gateway
from services.gateway.scheduler_client import HEALTH_MAX_AGE_S, facts_of
from services.gateway.grpc_requests import Malformed, add_servicer, client_address, tenant_of_call, text_metadata
from services.gateway.salience.images import ImageSupport
from services.gateway.salience.store import SessionStoreClient, SessionStoreError
from services.gateway.salience.turn import CACHE_SALT_METADATA, STEERING_METADATA, Abort, Turn

log = structlog.get_logger()

# trailing metadata of a Generate call: prompt tokens whose KV was reused rather than computed
CACHED_TOKENS_TRAILER = "tiller-cached-tokens"
REQUEST_ID_TRAILER = "tiller-request-id"

Reply = TypeVar("Reply")


async def _parsed(gw: Gateway, request: Any, context: grpc.aio.ServicerContext) -> None:
    """The request must have parsed; else the call ends here (a refused request, counted)."""
    if isinstance(request, Malformed):
        gw.metrics.refused("salience", INVALID_REQUEST)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)


def unary(method: Callable[..., Awaitable[Reply]]) -> Callable[..., Awaitable[Reply]]:
    """A request that parsed, and store/validation errors become the call's status."""

    @wraps(method)
    async def handler(self: SalienceServicer, request: Any, context: grpc.aio.ServicerContext) -> Reply:
        await _parsed(self.gw, request, context)
        try:
            return await method(self, request, context)
        except (SessionStoreError, Abort) as exc:
            if exc.status == grpc.StatusCode.INVALID_ARGUMENT:  # no generation: the refusal is counted here
                self.gw.metrics.refused("salience", INVALID_REQUEST)
            await context.abort(exc.status, exc.message)  # raises
            raise

    return handler


class SalienceServicer(pb_grpc.SalienceServicer):
    def __init__(self, gw: Gateway, store: SessionStoreClient, images: ImageSupport) -> None:
        self.gw = gw
        self.store = store
        self.images = images

    def _caller(self, context: grpc.aio.ServicerContext) -> wire.Principal:
        """Whose sessions the call may reach (the session store's owner check)."""
        return tenant_of_call(context, self.gw.settings).principal

    async def _facts(self) -> wire.ModelFacts:
        try:
            return facts_of(await self.gw.scheduler.health(max_age=HEALTH_MAX_AGE_S))
        except TillerError as exc:
            raise Abort(grpc.StatusCode.UNAVAILABLE, exc.message) from None

    @unary
    async def OpenSession(self, request: pb.OpenSessionRequest, context: grpc.aio.ServicerContext) -> pb.OpenSessionResponse:  # noqa: N802
        served = self.gw.settings.served_model_name
        if request.model != served:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"model {request.model!r} is not served here; this server serves {served!r}")
        facts = await self._facts()
        session = await self.store.open(request.model, self._caller(context))
        log.info("salience.session_opened", session_id=session.session_id)
        max_len = facts.max_model_len or self.gw.settings.limits.max_model_len
        return pb.OpenSessionResponse(session_id=session.session_id, max_model_len=max_len)

    @unary
    async def CloseSession(self, request: pb.CloseSessionRequest, context: grpc.aio.ServicerContext) -> pb.CloseSessionResponse:  # noqa: N802
        await self.store.close_session(request.session_id, self._caller(context))
        return pb.CloseSessionResponse()

    @unary
    async def ForkSession(self, request: pb.ForkSessionRequest, context: grpc.aio.ServicerContext) -> pb.ForkSessionResponse:  # noqa: N802
        child = await self.store.fork(request.session_id, request.at_position, self._caller(context))
        log.info("salience.session_forked", session_id=child.session_id, parent=request.session_id, at=request.at_position)
        return pb.ForkSessionResponse(session_id=child.session_id)

    @unary
    async def DumpSession(self, request: pb.DumpSessionRequest, context: grpc.aio.ServicerContext) -> pb.DumpSessionResponse:  # noqa: N802
        session = await self.store.get(request.session_id, self._caller(context))
        return pb.DumpSessionResponse(tokens=session.tokens)

    @unary
    async def GetReadoutManifest(self, request: pb.GetReadoutManifestRequest, context: grpc.aio.ServicerContext) -> pb.ReadoutManifest:  # noqa: N802
        facts = await self._facts()
        return pb.ReadoutManifest(
            concepts=facts.readout_concepts,
            layers=facts.readout_layers,
            hidden_size=facts.hidden_size,
            dtype="float32",
        )

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateEvent]:  # noqa: N802
        await _parsed(self.gw, request, context)
        metadata = text_metadata(context.invocation_metadata())
        turn = Turn(self.gw, self.store, self.images, request, client_address(context.peer()),
                    tenant_of_call(context, self.gw.settings), metadata.get(CACHE_SALT_METADATA, ""),
                    metadata.get(STEERING_METADATA, ""))
        try:
            async for event in turn.run():
                if event.HasField("done"):
                    context.set_trailing_metadata(
                        ((CACHED_TOKENS_TRAILER, str(turn.cached_tokens)), (REQUEST_ID_TRAILER, turn.rid))
                    )
                yield event
        except (SessionStoreError, Abort) as exc:
            await context.abort(exc.status, exc.message)
        finally:
            structlog.contextvars.unbind_contextvars("request_id", "session_id")


async def add_to_server(server: grpc.aio.Server, gw: Gateway) -> None:
    images = await asyncio.to_thread(ImageSupport.load, gw.settings)
    store = SessionStoreClient(gw.settings, zmq.asyncio.Context.instance())
    add_servicer(server, pb.DESCRIPTOR.services_by_name["Salience"], SalienceServicer(gw, store, images))
