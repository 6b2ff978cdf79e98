"""A socket's connection events for several watchers at once: ZeroMQ gives a socket one monitor (a
second replaces the first), so each monitored socket gets one, read on a thread of its own, and
every watcher is called there with the events it asked for (the scheduler's dropped workers, and
common.curve's refused handshakes on the same socket; a client's refusal by its server, and the gateway's
dropped connection to the scheduler)."""

from __future__ import annotations

import itertools
import os
import threading
import weakref
from collections.abc import Callable

import structlog
import zmq
from zmq.utils.monitor import parse_monitor_message

log = structlog.get_logger()

Watcher = Callable[[zmq.Event, int], None]  # (event, its value)
MONITORED = (zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
             | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_SUCCEEDED)

_lock = threading.Lock()
# by the socket object: a closed socket's address may be a new socket's, which needs a monitor of its own
_watchers: weakref.WeakKeyDictionary[zmq.Socket, list[tuple[int, Watcher]]] = weakref.WeakKeyDictionary()
_numbers = itertools.count(1)


def watch(sock: zmq.Socket, events: int, watcher: Watcher) -> None:
    """Call ``watcher(event, value)`` on the monitor's thread for each of ``events`` (within
    :data:`MONITORED`) on ``sock``; it must not block, nor touch ``sock`` (hand work to the socket's
    own thread, e.g. ``loop.call_soon_threadsafe``)."""
    assert events & ~MONITORED == 0, "ask for MONITORED events only"
    with _lock:
        if sock in _watchers:
            _watchers[sock].append((events, watcher))
            return
        watchers = _watchers[sock] = [(events, watcher)]
        address = f"inproc://tiller-monitor-{os.getpid()}-{next(_numbers)}"
        sock.monitor(address, MONITORED)
    context = zmq.Context.shadow(sock.context.underlying)  # a plain context: the thread reads synchronously
    threading.Thread(target=_read, args=(context, address, watchers), name="socket-events", daemon=True).start()


def _read(context: zmq.Context, address: str, watchers: list[tuple[int, Watcher]]) -> None:
    monitor = context.socket(zmq.PAIR)
    monitor.connect(address)
    try:
        while True:
            try:
                event = parse_monitor_message(monitor.recv_multipart())
            except zmq.ContextTerminated:
                return
            if event["event"] == zmq.EVENT_MONITOR_STOPPED:  # the socket closed
                return
            for events, watcher in list(watchers):
                if event["event"] & events:
                    try:
                        watcher(event["event"], int(event["value"]))
                    except Exception:  # one watcher's bug must not stop the others
                        log.exception("socket_events.watcher_failed")
    finally:
        monitor.close(0)
