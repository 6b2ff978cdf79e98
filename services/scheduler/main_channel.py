"""The scheduler's end of the controller runtime's main channel (the AICI runtime protocol)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from common import aici_wire
from common.errors import WireError
from common.config import Curve
from common.sockets import LoopReader, connect, ensure_ipc_dir
from services.scheduler.controlled import MainReply


# How long a call waits for a new socket's connection (after a drop) before it is refused.
CONNECT_WAIT_S = 0.1
_DROPPED = object()  # a pending call's answer when the connection dropped


class MainChannel:
    """A DEALER with strictly one request outstanding. A reply that does not come in time means the
    socket is replaced, so a late reply can never be taken for the answer to the next request. While the
    connection is down (the runtime died, its instances with it) a call fails at once, and so does one
    waiting for its reply when the connection drops: not after the timeout.

    The socket and its connection monitor are read from the event loop's reader callbacks
    (``common.sockets.LoopReader``): a reply or a connection event resolves the waiting call directly, with
    no pyzmq future, poll or task per message (with them, this channel took about a fifth of the scheduler's
    time in controlled runs: py-spy ``--gil`` during ``controller_bench.py --json 16``)."""

    def __init__(self, endpoint: str, curve: Curve | None = None) -> None:
        self.endpoint = endpoint
        self.curve = curve or Curve()
        self.lock = asyncio.Lock()
        self._loop = asyncio.get_running_loop()
        self._reply: asyncio.Future | None = None  # the call waiting for its reply
        self._connected = asyncio.Event()  # set while the connection is up
        self._connect()
        self.busy_s = 0.0  # wall time of answered post_pre_process/mid_process calls, IPC included
        self.incarnation = ""  # the runtime's, as its last reply named it

    @property
    def down(self) -> bool:
        """No connection yet, or it dropped and has not come back."""
        return not self._connected.is_set()

    def _connect(self) -> None:
        ensure_ipc_dir(self.endpoint)
        sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        self.monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        # a socket replaced after a drop must not wait out a call's timeout on a runtime that is not there
        # (another call may have seen the drop): it is down until its own monitor says connected
        self._connected.clear()
        connect(sock, self.endpoint, self.curve)
        self.sock = sock
        self._io = LoopReader(sock, self._on_reply)
        self._events = LoopReader(self.monitor, self._on_event)

    def _on_reply(self, parts: list[bytes]) -> None:
        if self._reply is not None and not self._reply.done():
            self._reply.set_result(parts)  # (nothing waits for a stray one: dropped)

    def _on_event(self, parts: list[bytes]) -> None:
        if parse_monitor_message(parts)["event"] == zmq.EVENT_CONNECTED:
            self._connected.set()
            return
        self._connected.clear()
        if self._reply is not None and not self._reply.done():
            self._reply.set_result(_DROPPED)

    def close(self) -> None:
        self._io.close()
        self._events.close()
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(0)

    def _replace(self) -> None:
        self.close()
        self._connect()

    async def _up(self) -> bool:
        """Whether the connection is up, waiting a moment for a new socket's to be made."""
        if self.down:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._connected.wait(), CONNECT_WAIT_S)
        return not self.down

    async def call(self, request: aici_wire.MainRequest, timeout_s: float) -> MainReply:
        """Send one request; its ok reply's data (typed by the op) and frames, or why there is none."""
        op = type(request).__struct_config__.tag
        started = time.perf_counter()
        async with self.lock:
            if not await self._up():  # the runtime died between two calls (or is not up yet)
                return MainReply(error=f"the controller runtime's connection dropped (it died or is restarting, its "
                                       f"controllers with it); {op} was not sent")
            pending = self._reply = self._loop.create_future()
            expiry = self._loop.call_later(timeout_s, lambda: pending.done() or pending.set_result(None))
            try:
                await self._io.send([aici_wire.encode(request)], True)
                parts = await pending
            finally:
                expiry.cancel()
                self._reply = None
            if parts is _DROPPED:
                self._replace()
                return MainReply(error=f"the controller runtime's connection dropped during {op} "
                                       "(it died or restarted, its controllers with it)")
            if parts is None:
                self._replace()
                return MainReply(error=f"the controller runtime did not answer {op} within {timeout_s:g} s")
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
