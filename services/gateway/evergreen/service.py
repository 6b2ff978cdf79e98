"""The EvergreenService servicer (grpc.aio, in the gateway's event loop)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from common.errors import INVALID_REQUEST
from common.protos.evergreen.v2 import evergreen_pb2 as eg
from common.protos.evergreen.v2 import evergreen_pb2_grpc as eg_grpc
from services.gateway.deps import Gateway
from services.gateway.evergreen.errors import SessionAbort
from services.gateway.evergreen.session import Session
from services.gateway.grpc_requests import Malformed, add_servicer, client_address, tenant_of_call

# initial metadata naming the session (its key in the session store, and in the gateway's logs)
SESSION_ID_HEADER = "tiller-evergreen-session-id"


class EvergreenServicer(eg_grpc.EvergreenServiceServicer):
    def __init__(self, gw: Gateway) -> None:
        self._gw = gw

    async def StartSession(  # noqa: N802 (the generated name)
        self, request_iterator: AsyncIterator[eg.SessionMessage | Malformed], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[eg.SessionMessage]:
        session = Session(self._gw, client=client_address(context.peer()),
                          tenant=tenant_of_call(context, self._gw.settings))
        await context.send_initial_metadata(((SESSION_ID_HEADER, session.id),))
        try:
            async for message in session.run(request_iterator):
                yield message
        except SessionAbort as exc:
            if exc.refused:
                self._gw.metrics.refused("evergreen", INVALID_REQUEST)
            await context.abort(exc.status, exc.message)


def add_to_server(server: grpc.aio.Server, gw: Gateway) -> None:
    add_servicer(server, eg.DESCRIPTOR.services_by_name["EvergreenService"], EvergreenServicer(gw))
