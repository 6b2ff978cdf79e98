"""ZeroMQ ROUTER/DEALER helpers over asyncio, speaking the multipart frames of :mod:`common.wire`.

A frame list on the wire is ``[header, *binary]`` from a DEALER, and ``[identity, header, *binary]``
at a ROUTER. Binary frames are sent zero-copy (``copy=False``) when large.
"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import os
import stat
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import structlog
import zmq
import zmq.asyncio

from common import wire
from common.config import Curve
from common.curve import client_side, server_side, watch_refusal
from common.errors import WireError

log = structlog.get_logger()

Frames = Sequence[bytes | memoryview]
_ZERO_COPY_MIN = 64 * 1024
# plain ints: no enum arithmetic
_EVENTS, _POLLIN, _POLLOUT, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.POLLOUT), int(zmq.NOBLOCK)


class PeerLost(Exception):
    """A request's peer died or restarted before it replied (:meth:`Dealer.abandon`), or refused this
    socket's CURVE handshake (:attr:`Dealer.refusal`)."""


def ensure_ipc_dir(endpoint: str) -> None:
    """Make an ipc endpoint's directory, owner-only (its sockets take any peer that can reach them)."""
    if endpoint.startswith("ipc://"):
        if (fixed := owner_only_dir(Path(endpoint[len("ipc://") :]).parent)) is not None:
            log.warning("ipc.dir_fixed", endpoint=endpoint, note=fixed)


def owner_only_dir(directory: Path) -> str | None:
    """Make ``directory`` if needed and see that only this user may enter it: one of ours that others
    may enter is fixed (chmod go-rwx; what was done is returned, to be said), one of another user's is
    refused (:class:`PermissionError`): its owner could reach or replace our sockets."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = directory.stat()
    if info.st_uid != os.geteuid():
        raise PermissionError(f"the ipc socket directory {directory} belongs to uid {info.st_uid}, not to this user "
                              f"(uid {os.geteuid()}): its owner could reach or replace Tiller's sockets; use a run "
                              f"directory of your own (TILLER_RUN_DIR)")
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        directory.chmod(stat.S_IMODE(info.st_mode) & 0o700)
        return (f"the ipc socket directory {directory} was open to other users ({stat.filemode(info.st_mode)}); "
                f"made owner-only (drwx------)")
    return None


def bind_address(endpoint: str) -> str:
    """The address to bind for ``endpoint``: a tcp endpoint naming a host (not an IP) binds every
    interface, so one setting serves both the binding service and its peers (``tcp://scheduler:5555``)."""
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint[len("tcp://") :].rpartition(":")
        try:
            ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            if host != "*":
                return f"tcp://*:{port}"
    return endpoint


def bind(sock: zmq.Socket, endpoint: str, curve: Curve) -> None:
    """The one way a socket binds: CURVE server on tcp when keys are configured, an owner-only
    directory and socket file on ipc."""
    ensure_ipc_dir(endpoint)
    server_side(sock, endpoint, curve)
    sock.bind(bind_address(endpoint))
    if endpoint.startswith("ipc://") and not endpoint.startswith("ipc://@"):  # (@: an abstract socket, no file)
        Path(endpoint[len("ipc://") :]).chmod(0o600)


def connect(sock: zmq.Socket, endpoint: str, curve: Curve) -> None:
    """The one way a socket connects: CURVE client on tcp when keys are configured."""
    client_side(sock, endpoint, curve)
    sock.connect(endpoint)


def heartbeat(sock: zmq.Socket, interval_s: float, timeout_s: float) -> None:
    """ZeroMQ heartbeats on ``sock``'s connections: a peer whose host vanished (no FIN, no RST)
    is disconnected after ``timeout_s`` instead of never. Set before bind or connect (a bound
    socket's listener copies the options it had when it was bound)."""
    sock.setsockopt(zmq.HEARTBEAT_IVL, int(interval_s * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(timeout_s * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TTL, int(timeout_s * 1000))


def copy_flag(frames: Frames) -> bool:
    """Whether to send ``frames`` copied (all small) or zero-copy (one is large)."""
    return all(len(f) < _ZERO_COPY_MIN for f in frames)


class LoopReader:
    """A socket read from the event loop's reader callback, without pyzmq's futures: each message
    goes to ``on_frames`` as it is read, with no future, task or coroutine switch per message, and
    sends are plain non-blocking sends (:meth:`send` waits for room when there is none).

    ZeroMQ's descriptor is edge-triggered and only says that the socket's state may have changed:
    the callback reads until ``EVENTS`` says nothing is left (which also re-arms it), and a send,
    which may take the wake-up of a message that arrived meanwhile, schedules a read when one waits.
    """

    def __init__(self, sock: zmq.asyncio.Socket, on_frames: Callable[[list[bytes]], None]) -> None:
        self._sync = zmq.Socket.shadow(sock.underlying)
        self._on_frames = on_frames
        self._loop = asyncio.get_running_loop()
        self._fd = self._sync.getsockopt(zmq.FD)
        self._writers: list[asyncio.Future[None]] = []  # sends waiting for room
        self._loop.add_reader(self._fd, self._drain)
        self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        sync = self._sync
        while (events := sync.getsockopt(_EVENTS)) & _POLLIN:
            self._on_frames(sync.recv_multipart(_NOBLOCK))
        if events & _POLLOUT and self._writers:
            writers, self._writers = self._writers, []
            for writer in writers:
                if not writer.done():
                    writer.set_result(None)

    def try_send(self, frames: Frames, copy: bool) -> bool:
        """Send without waiting; False when the socket has no room (or, with ``ZMQ_IMMEDIATE``, no peer)."""
        try:
            self._sync.send_multipart(frames, _NOBLOCK, copy=copy)
        except zmq.Again:
            return False
        if self._sync.getsockopt(_EVENTS) & _POLLIN:
            self._loop.call_soon(self._drain)
        return True

    async def send(self, frames: Frames, copy: bool) -> None:
        """Send, waiting while there is no room; cancelled, it sends nothing."""
        while not self.try_send(frames, copy):
            writer = self._loop.create_future()
            self._writers.append(writer)
            self._loop.call_soon(self._drain)  # the room may have come before the writer waited
            await writer

    def close(self) -> None:
        if not self._loop.is_closed():
            self._loop.remove_reader(self._fd)


MAX_MESSAGE_BYTES = 256 << 20  # a bound socket drops a peer whose message is larger (ZeroMQ's MAXMSGSIZE)


class Router:
    """A bound ROUTER socket: receive validated messages from many peers, reply to any of them."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        *,
        curve: Curve | None = None,
        max_msg_bytes: int = MAX_MESSAGE_BYTES,
        heartbeat_s: tuple[float, float] | None = None,
    ) -> None:
        """``curve``: the keys of a tcp endpoint (settings.curve; none: plaintext); ``heartbeat_s``:
        (interval, timeout) of ZeroMQ heartbeats on every peer's connection."""
        self.endpoint = endpoint
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        if heartbeat_s is not None:
            heartbeat(self.sock, *heartbeat_s)
        bind(self.sock, endpoint, curve or Curve())
        self._reader: LoopReader | None = None  # with serve(): the socket, read and written without futures

    async def recv(self) -> tuple[bytes, wire.Message, list[bytes]]:
        """Next well-formed message as (peer identity, header, binary frames).

        A malformed frame is answered with an ``Error`` (code ``invalid_request``) and skipped.
        """
        while True:
            parts = await self.sock.recv_multipart()
            if (message := self._parse(parts)) is not None:
                return message

    def _parse(self, parts: list[bytes]) -> tuple[bytes, wire.Message, list[bytes]] | None:
        """A well-formed message's (identity, header, binary frames); None for a malformed one,
        which is logged and answered with an ``Error``."""
        if len(parts) < 2:
            log.warning("wire.short_frame", endpoint=self.endpoint, parts=len(parts))
            return None
        try:
            return parts[0], wire.decode(parts[1]), parts[2:]
        except WireError as exc:
            log.warning("wire.malformed", endpoint=self.endpoint, error=str(exc))
            self.post(parts[0], wire.Error(code="invalid_request", message=str(exc)))
            return None

    def serve(self, handle: Callable[[bytes, wire.Message, list[bytes]], None]) -> None:
        """Hand every well-formed message to ``handle(identity, header, binary)`` as it arrives, from
        the event loop's reader callback: no future, task or coroutine switch per message (for a socket
        as busy as the workers' step results). Use it instead of :meth:`recv`, not with it."""

        def on_frames(parts: list[bytes]) -> None:
            if (message := self._parse(parts)) is None:
                return
            try:
                handle(*message)
            except Exception:  # a bug handling one message must not stop the others
                log.exception("router.handler_failed", endpoint=self.endpoint, type=type(message[1]).__name__)

        self._reader = LoopReader(self.sock, on_frames)

    async def send(self, identity: bytes, msg: wire.Msg, binary: Frames = ()) -> None:
        self.post(identity, msg, binary)

    def post(self, identity: bytes, msg: wire.Msg, binary: Frames = ()) -> None:
        """Send now: a ROUTER never waits (a message to a peer that is gone, or whose queue is full, is
        dropped), so the message is on its way, in order with the others, when this returns."""
        frames = [identity, wire.encode(msg), *binary]
        if self._reader is None:
            self.sock.send_multipart(frames, copy=copy_flag(binary))
        else:
            self._reader.try_send(frames, copy_flag(binary))

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
        self.sock.close(0)


class Dealer:
    """A connected DEALER: request/reply matched by ``mid`` plus unsolicited messages to a handler.

    Replies (messages with a ``mid``) resolve their pending request's future, or are dropped when it
    timed out; unsolicited messages (``mid`` 0) go to ``on_message`` if given, else are dropped. The
    socket is read from the event loop's reader callback (:class:`LoopReader`), so ``on_message``
    runs there, once per message, and must not block.

    ``immediate``: a message is only queued on a live connection (``ZMQ_IMMEDIATE``): while the peer
    is down a send waits, and a request that timed out or was abandoned meanwhile is never sent, so a
    restarted peer does not get work its sender already gave up (ZeroMQ otherwise keeps it queued and
    delivers it on reconnecting).
    """

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        *,
        curve: Curve | None = None,
        identity: bytes | None = None,
        on_message: Callable[[wire.Message, list[bytes]], None] | None = None,
        immediate: bool = False,
    ) -> None:
        self.endpoint = endpoint
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IMMEDIATE, int(immediate))
        if identity is not None:
            self.sock.setsockopt(zmq.IDENTITY, identity)
        self._on_message = on_message
        self._pending: dict[int, asyncio.Future[tuple[wire.Message, list[bytes]]]] = {}
        self._mids = itertools.count(1)
        self._reader: LoopReader | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.refusal: str | None = None  # why the server refused this socket's handshakes for good
        watch_refusal(self.sock, endpoint, curve or Curve(), self._refused)  # before connecting: no event missed
        connect(self.sock, endpoint, curve or Curve())

    def start(self) -> None:
        if self._reader is None:
            self._loop = asyncio.get_running_loop()
            self._reader = LoopReader(self.sock, self._on_frames)

    def _refused(self, reason: str) -> None:
        """(On the monitor's thread.) Every request fails from now on, the waiting ones at once."""
        self.refusal = reason
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.abandon, reason)

    def _on_frames(self, parts: list[bytes]) -> None:
        try:
            msg = wire.decode(parts[0])
        except WireError as exc:
            log.warning("wire.malformed", endpoint=self.endpoint, error=str(exc))
            return
        if msg.mid:  # a reply; one whose request already timed out is dropped
            future = self._pending.pop(msg.mid, None)
            if future is not None and not future.done():
                future.set_result((msg, parts[1:]))
            else:
                log.debug("dealer.late_reply", endpoint=self.endpoint, type=type(msg).__name__)
        elif self._on_message is not None:
            try:
                self._on_message(msg, parts[1:])
            except Exception:  # a handler bug must not stop the reading
                log.exception("dealer.handler_failed", endpoint=self.endpoint)
        else:
            log.debug("dealer.unmatched", endpoint=self.endpoint, type=type(msg).__name__)

    async def send(self, msg: wire.Msg, binary: Frames = ()) -> None:
        """Send ``msg``, waiting while the socket has no room (with ``immediate``: no live peer)."""
        self.start()
        assert self._reader is not None
        await self._reader.send([wire.encode(msg), *binary], copy_flag(binary))

    async def request(self, msg: wire.Msg, binary: Frames = (), *, timeout: float = 10.0) -> tuple[wire.Message, list[bytes]]:
        """Send ``msg`` with a fresh ``mid`` and wait for the reply carrying it; :class:`PeerLost` at once
        where the server refused this socket's keys."""
        self.start()
        msg.mid = next(self._mids)
        future: asyncio.Future[tuple[wire.Message, list[bytes]]] = asyncio.get_running_loop().create_future()
        self._pending[msg.mid] = future
        if self.refusal is not None:  # (a refusal after this line abandons the future)
            self._pending.pop(msg.mid)
            raise PeerLost(self.refusal)
        sending = asyncio.ensure_future(self.send(msg, binary))
        try:
            async with asyncio.timeout(timeout):  # the send too: it waits while the peer's queue is full
                await asyncio.wait((sending, future), return_when=asyncio.FIRST_COMPLETED)
                if future.done() and not sending.done():  # abandoned while the send waited: never send it
                    sending.cancel()
                else:
                    await sending
                return await future
        finally:
            sending.cancel()  # a send cut short by the timeout is not sent later either
            self._pending.pop(msg.mid, None)

    def abandon(self, reason: str) -> None:
        """Fail every request still waiting for its reply with :class:`PeerLost`: the peer that had them died."""
        for future in self._pending.values():
            if not future.done():
                future.set_exception(PeerLost(reason))

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
        self.sock.close(0)


async def probe_health(endpoint: str, timeout: float = 2.0, curve: Curve | None = None) -> wire.HealthReply | None:
    """Ask a service for its health; None when it does not answer in time."""
    ctx = zmq.asyncio.Context.instance()
    dealer = Dealer(ctx, endpoint, curve=curve)
    try:
        reply, _ = await dealer.request(wire.Health(), timeout=timeout)
    except (asyncio.TimeoutError, zmq.ZMQError):
        return None
    finally:
        dealer.close()
    return reply if isinstance(reply, wire.HealthReply) else None


def reply_mid(request: Any) -> int:
    """The ``mid`` a reply to ``request`` must carry."""
    return int(getattr(request, "mid", 0) or 0)
