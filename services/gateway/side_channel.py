"""The gateway's side channel to the controller runtime (the AICI runtime protocol): asynchronous requests matched by
``$rid``, each carrying the caller as ``$auth``; and who may call the controller API.

The caller is identified as on every surface (:func:`services.gateway.tenants.identify`); when tokens are
configured, the controller API needs one (``Authorization: Bearer <token>``, or pyaici's ``api-key: <token>``).
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from typing import Any

import structlog
import zmq
import zmq.asyncio
from starlette.requests import HTTPConnection
from zmq.utils.monitor import recv_monitor_message

from common import aici_wire
from common.wire import Principal
from common.config import Settings
from common.errors import (
    INTERNAL_ERROR,
    INVALID_REQUEST,
    RATE_LIMITED,
    SERVICE_UNAVAILABLE,
    TillerError,
    WireError,
)
from common.sockets import connect, ensure_ipc_dir
from services.gateway.tenants import identify

log = structlog.get_logger()

MAX_LOGS_IN_MESSAGE = 2000  # the tail of a failed init's logs quoted in its error message


class Unauthorized(TillerError):
    """No valid credentials for the controller API."""

    def __init__(self, message: str) -> None:
        super().__init__(INVALID_REQUEST, message)


def caller_of(conn: HTTPConnection, settings: Settings) -> Principal:
    """The caller of an HTTP or WebSocket request to the controller API; Unauthorized if tokens are configured
    and it presents none of them."""
    tenant = identify(conn.headers, settings)
    if settings.api_auth.tokens and not tenant.authenticated:
        key_header = settings.api_auth.key_header
        raise Unauthorized(f"the controller API needs 'Authorization: Bearer <token>' (or '{key_header}: "
                           "<token>') with a known token")
    return tenant.principal


# what a side-channel refusal may name besides invalid_request (a user past their controller budget)
REFUSAL_CODES = frozenset({INVALID_REQUEST, RATE_LIMITED})


def format_caller(conn: HTTPConnection, settings: Settings) -> Principal:
    """Who runs the JSON controller the gateway starts for an OpenAI ``response_format``, for any client: the
    caller a request names (its token's user; without tokens, the user header), else the default user. Its
    controller time and live requests count against that user's budget, not one account shared by all."""
    return Principal(user=identify(conn.headers, settings).user)  # no token where tokens are: the default user


class ControllerError(TillerError):
    """The runtime refused a side-channel request (bad module, unknown tag, trap at init...; ``rate_limited``:
    the user is past their controller budget)."""

    def __init__(self, message: str, code: str = INVALID_REQUEST) -> None:
        super().__init__(code, message)

    @classmethod
    def refused(cls, reply: dict[str, Any], what: str) -> ControllerError:
        """The runtime's error reply to ``what``, under the code it names (a code it may not name: invalid_request)."""
        code = reply.get("code")
        return cls(str(reply.get("error") or f"{what} failed"), code if code in REFUSAL_CODES else INVALID_REQUEST)


class ControllerInitFailed(ControllerError):
    """The controller was created but failed while starting (a trap or ``aici_host_stop`` in init);
    ``result`` is the runtime's SeqResult: ``error``, ``logs`` (often the reason), ``storage``, ``micros``."""

    def __init__(self, result: dict[str, Any]) -> None:
        logs = str(result.get("logs") or "").strip()
        detail = f" (logs: {logs[-MAX_LOGS_IN_MESSAGE:]})" if logs else ""
        super().__init__(f"the controller failed to start: {result['error']}{detail}")
        self.result = result


def _runtime_down() -> TillerError:
    return TillerError(SERVICE_UNAVAILABLE, "the controller runtime is not connected (it died or is restarting); "
                                            "retry shortly")


class SideChannel:
    """A DEALER on the runtime's side channel; many requests in flight, replies matched by ``$rid``.

    While the connection to the runtime is down (it died or restarts) every call fails at once with
    ``service_unavailable``, the calls waiting for a reply when it dropped included."""

    def __init__(self, settings: Settings, ctx: zmq.asyncio.Context) -> None:
        endpoint = settings.endpoint("controller_side")
        ensure_ipc_dir(endpoint)
        self._timeout_s = settings.controllers.side_timeout_s
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        connect(self._sock, endpoint, settings.curve)
        self._pending: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._down = False  # the connection dropped and has not come back

    def start(self) -> None:
        if self._reader is None:
            loop = asyncio.get_running_loop()
            self._reader = loop.create_task(self._read_loop())
            self._watcher = loop.create_task(self._watch_connection())

    def close(self) -> None:
        for task in (self._reader, self._watcher):
            if task is not None:
                task.cancel()
        self._sock.disable_monitor()
        self._monitor.close(0)
        self._sock.close(0)

    async def _watch_connection(self) -> None:
        while True:
            event = await recv_monitor_message(self._monitor)
            self._down = event["event"] == zmq.EVENT_DISCONNECTED
            if self._down:
                log.warning("side_channel.runtime_disconnected", pending=len(self._pending))
                for future in self._pending.values():
                    if not future.done():
                        future.set_exception(_runtime_down())

    async def _read_loop(self) -> None:
        while True:
            parts = await self._sock.recv_multipart()
            try:
                reply = aici_wire.decode_reply(parts[0])
            except WireError as exc:
                log.warning("side_channel.malformed_reply", error=str(exc))
                continue
            future = self._pending.pop(str(reply.get("$rid")), None)
            if future is not None and not future.done():
                future.set_result(reply)

    async def call(self, op: str, caller: Principal, **fields: Any) -> dict[str, Any]:
        """Run ``op``; its ``data``, or ControllerError with the runtime's message."""
        reply = await self._exchange(op, caller, fields)
        if reply["type"] != "ok":
            raise ControllerError.refused(reply, op)
        return reply.get("data") or {}

    async def _exchange(self, op: str, caller: Principal, fields: dict[str, Any]) -> dict[str, Any]:
        """Send ``op`` and wait for the reply with its ``$rid``."""
        self.start()
        if self._down:
            raise _runtime_down()
        rid = str(uuid.uuid4())
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[rid] = future
        try:
            auth = {"user": caller.user, "is_admin": caller.admin}
            await self._sock.send(aici_wire.encode({"$rid": rid, "$auth": auth, "op": op, **fields}))
            async with asyncio.timeout(self._timeout_s):
                reply = await future
        except TimeoutError:
            raise TillerError(INTERNAL_ERROR, f"the controller runtime did not answer {op}; is it running?") from None
        finally:
            self._pending.pop(rid, None)
        return reply

    @property
    def connected(self) -> bool:
        """False while the connection to the runtime is known to be down."""
        return not self._down

    async def mk_module(self, caller: Principal, wasm: bytes) -> dict[str, Any]:
        return await self.call("mk_module", caller, binary=base64.b64encode(wasm).decode("ascii"))

    async def set_tags(self, caller: Principal, module_id: str, tags: list[str]) -> dict[str, Any]:
        return await self.call("set_tags", caller, module_id=module_id, tags=tags)

    async def get_tags(self, caller: Principal) -> dict[str, Any]:
        return await self.call("get_tags", caller)

    async def instantiate(
        self, caller: Principal, req_id: str, prompt: list[int], module_id: str, module_arg: str
    ) -> dict[str, Any]:
        """Instantiate a controller for ``req_id``. A refused request (unknown module, bad prompt) raises
        ControllerError; a controller that fails while starting raises ControllerInitFailed."""
        fields = {"req_id": req_id, "prompt": prompt, "module_id": module_id, "module_arg": module_arg}
        reply = await self._exchange("instantiate", caller, fields)
        data = reply.get("data") or {}
        if data.get("error"):  # the SeqResult of a failed init (AICI answers ok, the runtime error: either works)
            raise ControllerInitFailed(data)
        if reply["type"] != "ok":
            raise ControllerError.refused(reply, "instantiate")
        return data
