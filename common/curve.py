"""CurveZMQ on ``tcp://`` sockets: the host key pairs ``tiller keys`` writes, the server and client
side of a socket (:func:`server_side`, :func:`client_side`, called by :mod:`common.sockets` for every
socket it binds or connects), and the ZAP handler that admits only the listed public keys and logs
every peer it refuses.

Keys are zmq.auth certificate files (z85): ``NAME.key`` holds the public key, ``NAME.key_secret``
(owner-only) the pair. ``ipc://`` sockets are left alone: the run directory's permissions guard them.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import structlog
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from common import socket_events
from common.config import Curve

log = structlog.get_logger()

ZAP_DOMAIN = "tiller"
REFUSAL_LOG_INTERVAL_S = 10.0  # a refused peer retries every few hundred ms: one line per peer per interval
# a peer refused before ZAP is asked: no key where one is needed, or a key for another server
_HANDSHAKE_FAILURES = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL


class CurveError(ValueError):
    """A key file that is missing, unreadable, not owner-only or not a key; or a socket left without keys."""


@dataclass(frozen=True)
class Keys:
    """One host's keys, z85: its pair, the public key of the server it connects to, and where the
    public keys of the clients it accepts lie."""

    public: bytes
    secret: bytes
    server_public: bytes
    authorized_dir: Path | None


def is_tcp(endpoint: str) -> bool:
    return endpoint.startswith("tcp://")


def load_public(path: Path) -> bytes:
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise CurveError(f"curve: cannot read the public key {path}: {exc}") from None
    return public


def load_secret(path: Path) -> tuple[bytes, bytes]:
    """(public, secret) from a ``.key_secret`` file, which only its owner may read (as ssh insists)."""
    try:
        public, secret = zmq.auth.load_certificate(path)
        mode = path.stat().st_mode
    except (OSError, ValueError) as exc:
        raise CurveError(f"curve: cannot read the secret key {path}: {exc}") from None
    if secret is None:
        raise CurveError(f"curve: {path} holds a public key only; secret_key names the NAME.key_secret file")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise CurveError(f"curve: the secret key {path} is readable by others (mode {stat.filemode(mode)}): "
                         f"`chmod 600 {path}`, and make a new pair if others may have copied it")
    return public, secret


@lru_cache(maxsize=4)
def keys_of(curve: Curve) -> Keys | None:
    """The keys ``curve`` names, checked; None when none are configured (tcp stays plaintext)."""
    if curve.secret_key is None:
        if curve.server_key is not None or curve.authorized_keys is not None:
            raise CurveError("curve: server_key and authorized_keys need secret_key (this host's own pair)")
        return None
    public, secret = load_secret(curve.secret_key)
    server_public = public if curve.server_key is None else load_public(curve.server_key)
    if curve.authorized_keys is not None and not curve.authorized_keys.is_dir():
        raise CurveError(f"curve: authorized_keys {curve.authorized_keys} is not a directory")
    return Keys(public, secret, server_public, curve.authorized_keys)


def make_key_pair(directory: Path, name: str) -> tuple[Path, Path]:
    """Write ``NAME.key`` and ``NAME.key_secret`` (owner-only from the start) in ``directory``; an
    existing pair is never overwritten (the hosts that trust it would be locked out)."""
    public, secret = directory / f"{name}.key", directory / f"{name}.key_secret"
    for path in (public, secret):
        if path.exists():
            raise CurveError(f"{path} exists: remove it first, or choose another --name")
    directory.mkdir(parents=True, exist_ok=True)
    umask = os.umask(0o077)  # the secret file never exists with wider permissions
    try:
        zmq.auth.create_certificates(directory, name)
    finally:
        os.umask(umask)
    public.chmod(0o644)
    return public, secret


class AuthorizedKeys:
    """The public keys a server accepts: its own and those in the directory, which is read again when
    an unknown key knocks (so a newly listed worker joins without a restart)."""

    def __init__(self, own: bytes, directory: Path | None) -> None:
        self._own = own
        self._directory = directory
        self._keys = self._read()

    def _read(self) -> frozenset[bytes]:
        keys = {self._own}
        if self._directory is not None and self._directory.is_dir():
            for path in sorted(self._directory.glob("*.key")):
                try:
                    keys.add(load_public(path))
                except CurveError as exc:
                    log.warning("curve.bad_authorized_key", path=str(path), error=str(exc))
        return frozenset(keys)

    def allows(self, key: bytes) -> bool:
        if key not in self._keys:
            self._keys = self._read()
        return key in self._keys

    def callback(self, domain: str, key: bytes) -> bool:
        """zmq.auth's credentials-provider hook."""
        return self.allows(key)


class RefusalLog:
    """Which refusals to log: the first of each peer, then one per ``interval_s`` with how many came
    since (a refused peer reconnects every few hundred milliseconds)."""

    def __init__(self, interval_s: float = REFUSAL_LOG_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._last: dict[object, float] = {}
        self._unlogged: dict[object, int] = {}

    def due(self, peer: object, now: float) -> int | None:
        """None: do not log this one; else log it, with the refusals not logged before it."""
        last = self._last.get(peer)
        if last is not None and now - last < self.interval_s:
            self._unlogged[peer] = self._unlogged.get(peer, 0) + 1
            return None
        self._last[peer] = now
        return self._unlogged.pop(peer, 0)


class _Authenticator(ThreadAuthenticator):
    """zmq.auth's ZAP handler, logging each refusal as JSON with the peer's address and key."""

    def __init__(self, context: zmq.Context, service_fields: dict[str, object]) -> None:
        super().__init__(context)
        self._log = log.bind(**service_fields)  # the ZAP thread does not see the main thread's contextvars
        self._request: list[bytes] = []
        self._refusals = RefusalLog()

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        self._request = msg  # its address (frame 3) and key (frame 6) name a refused peer
        await super().handle_zap_message(msg)

    def _send_zap_reply(self, request_id: bytes, status_code: bytes, status_text: bytes,
                        user_id: str = "anonymous") -> None:
        if status_code != b"200":
            msg = self._request
            address = msg[3].decode(errors="replace") if len(msg) > 3 else ""
            key = z85.encode(msg[6]).decode() if len(msg) > 6 and len(msg[6]) == 32 else ""
            if (unlogged := self._refusals.due((address, key), time.monotonic())) is not None:
                self._log.warning("curve.refused", address=address, key=key,
                                  reason=status_text.decode(errors="replace"),
                                  mechanism=msg[5].decode(errors="replace") if len(msg) > 5 else "",
                                  since_last=unlogged)
        super()._send_zap_reply(request_id, status_code, status_text, user_id)


_authenticators: dict[int, _Authenticator] = {}  # by the underlying context: one ZAP handler per context
_lock = threading.Lock()


def _authenticate(sock: zmq.Socket, keys: Keys) -> None:
    """Start ``sock``'s context's ZAP handler, once: ZeroMQ admits any key where none runs."""
    with _lock:
        if sock.context.underlying in _authenticators:
            return
        context = zmq.Context.shadow(sock.context.underlying)  # a plain context: the handler's thread is sync
        auth = _Authenticator(context, dict(structlog.contextvars.get_contextvars()))
        auth.start()
        auth.configure_curve_callback(ZAP_DOMAIN, AuthorizedKeys(keys.public, keys.authorized_dir))
        _authenticators[sock.context.underlying] = auth


def _watch_handshakes(sock: zmq.Socket, endpoint: str) -> None:
    """Log each peer whose handshake fails before ZAP is asked (one without a key, or with a key made for
    another server): ZeroMQ says so only on the socket's monitor."""
    fields = dict(structlog.contextvars.get_contextvars())
    refusals = RefusalLog()

    def refused(event: zmq.Event, value: int) -> None:
        if (unlogged := refusals.due(value, time.monotonic())) is not None:
            log.warning("curve.refused", **fields, endpoint=endpoint, reason="handshake failed: no key, or a key "
                        "for another server", zmq_event=event.name, code=hex(value), since_last=unlogged)

    socket_events.watch(sock, _HANDSHAKE_FAILURES, refused)


class ClientHandshakes:
    """Whether a client's failed handshakes with one server mean it is refused for good (ZeroMQ retries
    none of them, and neither should the client).

    A key the server's ZAP handler turns down (AUTH) or a mechanism the client sees differ from its own
    (PROTOCOL) is final at once. A server that sees the mechanisms differ first closes the connection
    before the client has read its greeting, and the client sees only a handshake cut short (NO_DETAIL),
    which ZeroMQ retries: that is final once it happens :data:`CUT_SHORT_REPEATS` times in a row, since a
    server dying mid-handshake cuts one short too. A handshake that succeeds starts the count again."""

    EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
              | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
    CUT_SHORT_REPEATS = 3

    def __init__(self) -> None:
        self.cut_short = 0

    def refused(self, event: int) -> bool:
        """Whether ``event`` (a socket monitor's) makes the refusal final."""
        if event & zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.cut_short = 0
            return False
        if event & zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            self.cut_short += 1
            return self.cut_short >= self.CUT_SHORT_REPEATS
        return bool(event & (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL))


def watch_refusal(sock: zmq.Socket, endpoint: str, curve: Curve, refused: Callable[[str], None]) -> None:
    """On ``sock``, a client of tcp ``endpoint``: log the server's final refusal of its handshakes (see
    :class:`ClientHandshakes`) once, saying why, and call ``refused(what a caller is told)`` on the
    monitor's thread. ZeroMQ retries none of them: every later send would wait for nothing."""
    if not is_tcp(endpoint):
        return
    handshakes = ClientHandshakes()
    fields = dict(structlog.contextvars.get_contextvars())

    def on_event(event: zmq.Event, _value: int) -> None:
        if handshakes.refused(event):
            log.error("curve.refused_by_server", **fields, endpoint=endpoint,
                      reason=refused_by_server(event, endpoint, curve))
            refused(f"{endpoint} refused this host's CURVE handshake (its keys): see this host's log, "
                    "curve.refused_by_server")

    socket_events.watch(sock, ClientHandshakes.EVENTS, on_event)


def refused_by_server(event: int, endpoint: str, curve: Curve) -> str:
    """What a client whose handshake with ``endpoint`` failed (``event``) is told; ZeroMQ does not retry it."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (f"{endpoint} refused this host's key (curve.secret_key {curve.secret_key}): add its public key "
                f"(the NAME.key beside it) to the curve.authorized_keys directory of the host serving {endpoint}")
    mine = "has no CURVE key" if curve.secret_key is None else "has a CURVE key"
    return (f"the handshake with {endpoint} failed: this host {mine}; both ends need keys (or neither), and "
            f"curve.server_key must be the public key of the host serving {endpoint}")


def server_side(sock: zmq.Socket, endpoint: str, curve: Curve) -> None:
    """Make ``sock``, about to bind ``endpoint``, a CURVE server when keys are configured and the
    endpoint is tcp (else it warns once that tcp is plaintext)."""
    if not is_tcp(endpoint):
        return
    keys = keys_of(curve)
    if keys is None:
        log.warning("curve.plaintext", endpoint=endpoint, note="tcp without curve keys: any host that reaches "
                    "this port may join, unencrypted (see docs/security.md)")
        return
    _authenticate(sock, keys)
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True
    sock.zap_domain = ZAP_DOMAIN.encode()
    _watch_handshakes(sock, endpoint)


def client_side(sock: zmq.Socket, endpoint: str, curve: Curve) -> None:
    """Make ``sock``, about to connect to ``endpoint``, a CURVE client when keys are configured and the
    endpoint is tcp."""
    if not is_tcp(endpoint):
        return
    keys = keys_of(curve)
    if keys is None:
        return
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = keys.server_public
