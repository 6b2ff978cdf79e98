"""The scheduler's end of the controller runtime's main channel (the AICI runtime protocol)."""

from __future__ import annotations

import asyncio
import time

import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from common import aici_wire
from common.errors import WireError
from common.sockets import ensure_ipc_dir
from services.scheduler.controlled import MainReply


# How often a call waiting for its reply checks the connection.
DROP_CHECK_MS = 100


class MainChannel:
    """A DEALER with strictly one request outstanding. A reply that does not come in time means the
    socket is replaced, so a late reply can never be taken for the answer to the next request. While the
    connection is down (the runtime died, its instances with it) a call fails at once, and so does one
    waiting for its reply when the connection drops: not after the timeout."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.lock = asyncio.Lock()
        self.sock = self._connect()
        self.busy_s = 0.0  # wall time of answered post_pre_process/mid_process calls, IPC included
        self.incarnation = ""  # the runtime's, as its last reply named it

    def _connect(self) -> zmq.asyncio.Socket:
        ensure_ipc_dir(self.endpoint)
        sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        self.monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        # no connection yet, or it dropped and has not come back (a socket replaced after a drop must not
        # wait out a call's timeout on a runtime that is not there: another call may have seen the drop)
        self.down = True
        sock.connect(self.endpoint)
        return sock

    def _replace(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(0)
        self.sock = self._connect()

    async def _dropped(self) -> bool:
        """Whether the connection is down, or dropped since the last look."""
        dropped = self.down
        while await self.monitor.poll(0):
            self.down = (await recv_monitor_message(self.monitor))["event"] == zmq.EVENT_DISCONNECTED
            dropped = dropped or self.down
        return dropped

    async def _up(self) -> bool:
        """Whether the connection is up, waiting a moment for a new socket's to be made."""
        await self._dropped()
        if self.down and await self.monitor.poll(DROP_CHECK_MS):
            await self._dropped()
        return not self.down

    async def call(self, request: aici_wire.MainRequest, timeout_s: float) -> MainReply:
        """Send one request; its ok reply's data (typed by the op) and frames, or why there is none."""
        op = type(request).__struct_config__.tag
        started = time.perf_counter()
        async with self.lock:
            if not await self._up():  # the runtime died between two calls (or is not up yet)
                return MainReply(error=f"the controller runtime's connection dropped (it died or is restarting, its "
                                       f"controllers with it); {op} was not sent")
            await self.sock.send(aici_wire.encode(request))
            deadline = time.monotonic() + timeout_s
            while not await self.sock.poll(DROP_CHECK_MS):
                if await self._dropped():
                    self._replace()
                    return MainReply(error=f"the controller runtime's connection dropped during {op} "
                                           "(it died or restarted, its controllers with it)")
                if time.monotonic() > deadline:
                    self._replace()
                    return MainReply(error=f"the controller runtime did not answer {op} within {timeout_s:g} s")
            parts = await self.sock.recv_multipart()
        try:
            reply = aici_wire.decode_main_reply(request, parts[0])
        except WireError as exc:
            return MainReply(error=f"bad reply from the controller runtime to {op}: {exc}")
        if not isinstance(request, aici_wire.Ping):
            self.busy_s += time.perf_counter() - started
        self.incarnation = reply.incarnation or self.incarnation
        if isinstance(reply, aici_wire.MainError):
            return MainReply(error=f"the controller runtime refused {op}: {reply.error}", incarnation=reply.incarnation)
        return MainReply(data=reply.data, frames=parts[1:], incarnation=reply.incarnation)

    async def ping(self) -> str:
        """"ok", or what is wrong with the runtime (for health replies). With a call under way (a step's
        controllers may take their deadlines) it answers from the connection's state at once: the
        scheduler's health, and every gateway message behind it, never waits for controllers."""
        if self.lock.locked():
            return "unreachable" if self.down else "ok"
        reply = await self.call(aici_wire.Ping(), timeout_s=1.0)
        if "did not answer" in reply.error or "dropped" in reply.error:
            return "unreachable"
        if reply.error.startswith("bad reply"):
            return f"bad reply: {reply.error}"
        return "ok" if isinstance(reply.data, aici_wire.Pong) and reply.data.pong == 1 else "bad reply"
