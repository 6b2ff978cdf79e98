"""The gateway's side channel to the controller runtime (the AICI runtime protocol): asynchronous requests matched by
``$rid``, each carrying the caller as ``$auth``; and how a caller is identified.

Identification (``settings.api_auth``): when tokens are configured, a request must carry
``Authorization: Bearer <token>`` (or pyaici's ``api-key: <token>``) and the token's user is the
caller, admin iff its name is in ``admins``. Otherwise the caller is the user named by the
``x-user-id`` header (as rLLM expects a front proxy to set it), or ``default_user``; it is admin iff
an ``x-user-role`` header says ``admin`` (rLLM's rule), or, without that header, its name is in
``admins``.
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from dataclasses import dataclass
from typing import Any

import structlog
import zmq
import zmq.asyncio
from starlette.requests import HTTPConnection
from zmq.utils.monitor import recv_monitor_message

from common import aici_wire
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
from services.gateway.auth import presented_token

log = structlog.get_logger()

MAX_LOGS_IN_MESSAGE = 2000  # the tail of a failed init's logs quoted in its error message


class Unauthorized(TillerError):
    """No valid credentials for the controller API."""

    def __init__(self, message: str) -> None:
        super().__init__(INVALID_REQUEST, message)


@dataclass(frozen=True)
class Caller:
    user: str
    is_admin: bool

    def auth(self) -> dict[str, Any]:
        return {"user": self.user, "is_admin": self.is_admin}


def caller_of(conn: HTTPConnection, settings: Settings) -> Caller:
    """The caller of an HTTP or WebSocket request (see the module docstring); Unauthorized if none."""
    auth = settings.api_auth
    if auth.tokens:
        user = auth.tokens.get(presented_token(conn.headers, auth.key_header))
        if user is None:
            raise Unauthorized(f"the controller API needs 'Authorization: Bearer <token>' (or '{auth.key_header}: "
                               "<token>') with a known token")
        return Caller(user=user, is_admin=user in auth.admins)
    user = conn.headers.get(auth.user_header) or auth.default_user
    role = conn.headers.get(auth.role_header)
    return Caller(user=user, is_admin=user in auth.admins if role is None else role == "admin")


# what a side-channel refusal may name besides invalid_request (a user past their controller budget)
REFUSAL_CODES = frozenset({INVALID_REQUEST, RATE_LIMITED})


def format_caller(conn: HTTPConnection, settings: Settings) -> Caller:
    """Who runs the JSON controller the gateway starts for an OpenAI ``response_format``, for any client: the
    caller a request names (its token's user; without tokens, the user header), else the default user. Its
    controller time and live requests count against that user's budget, not one account shared by all."""
    try:
        user = caller_of(conn, settings).user
    except Unauthorized:  # no token where tokens are configured: the OpenAI API serves it all the same
        user = settings.api_auth.default_user
    return Caller(user=user, is_admin=False)


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

    async def call(self, op: str, caller: Caller, **fields: Any) -> dict[str, Any]:
        """Run ``op``; its ``data``, or ControllerError with the runtime's message."""
        reply = await self._exchange(op, caller, fields)
        if reply["type"] != "ok":
            raise ControllerError.refused(reply, op)
        return reply.get("data") or {}

    async def _exchange(self, op: str, caller: Caller, fields: dict[str, Any]) -> dict[str, Any]:
        """Send ``op`` and wait for the reply with its ``$rid``."""
        self.start()
        if self._down:
            raise _runtime_down()
        rid = str(uuid.uuid4())
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[rid] = future
        try:
            await self._sock.send(aici_wire.encode({"$rid": rid, "$auth": caller.auth(), "op": op, **fields}))
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

    async def mk_module(self, caller: Caller, wasm: bytes) -> dict[str, Any]:
        return await self.call("mk_module", caller, binary=base64.b64encode(wasm).decode("ascii"))

    async def set_tags(self, caller: Caller, module_id: str, tags: list[str]) -> dict[str, Any]:
        return await self.call("set_tags", caller, module_id=module_id, tags=tags)

    async def get_tags(self, caller: Caller) -> dict[str, Any]:
        return await self.call("get_tags", caller)

    async def instantiate(
        self, caller: Caller, req_id: str, prompt: list[int], module_id: str, module_arg: str
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
