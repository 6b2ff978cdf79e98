"""What ``tiller up`` checks before and while it starts the services: that the ports it will bind are
free, that its peers' sockets are guarded (CURVE keys that load, owner-only ipc directories; tcp
without keys is said loudly), and that what answers on the HTTP port is the gateway it started (not
another server that held the port while ours crash-loops on "address already in use")."""

from __future__ import annotations

import json
import socket
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from common.config import Settings
from common.curve import CurveError, is_tcp, keys_of
from common.sockets import owner_only_dir

_ZMQ_ENDPOINTS = ("scheduler", "worker", "controller_main", "controller_side", "session_store")


@dataclass(frozen=True)
class Port:
    host: str
    port: int
    setting: str  # the environment variable that moves it

    def describe(self) -> str:
        return f"port {self.port} on {self.host} ({self.setting})"


def ports_to_bind(settings: Settings) -> list[Port]:
    """Every TCP port this machine's services bind: HTTP, gRPC and any tcp:// ZeroMQ endpoint."""
    ports = [
        Port(settings.http_host, settings.http_port, "TILLER_HTTP_PORT"),
        Port(settings.http_host, settings.grpc_port, "TILLER_GRPC_PORT"),
    ]
    for name in _ZMQ_ENDPOINTS:
        endpoint = getattr(settings, f"{name}_endpoint")
        parts = urlsplit(endpoint)
        if parts.scheme == "tcp" and parts.port:
            ports.append(Port("0.0.0.0", parts.port, f"TILLER_{name.upper()}_ENDPOINT"))
    return ports


@dataclass(frozen=True)
class SecurityCheck:
    refusal: str  # why the stack must not start ('' when it may)
    notes: list[str]  # what was fixed, and what is unguarded


def check_security(settings: Settings) -> SecurityCheck:
    """Load the CURVE keys and the TLS certificate (a bad one refuses the start), make the run directory
    and every ipc socket directory owner-only (another user's refuses), and name the tcp endpoints
    left plaintext."""
    endpoints = {name: settings.endpoint(name) for name in _ZMQ_ENDPOINTS}
    try:
        keys = keys_of(settings.curve)
    except CurveError as exc:
        return SecurityCheck(str(exc), [])
    if settings.tls.certfile is not None and settings.tls.keyfile is not None:
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(settings.tls.certfile,
                                                                                settings.tls.keyfile)
        except (OSError, ssl.SSLError) as exc:
            return SecurityCheck(f"tls: cannot serve with certfile {settings.tls.certfile} and keyfile "
                                 f"{settings.tls.keyfile}: {exc}", [])
    directories = {settings.run_dir.resolve()}
    directories |= {Path(e[len("ipc://"):]).parent for e in endpoints.values() if e.startswith("ipc://")}
    notes = []
    for directory in sorted(directories):
        try:
            fixed = owner_only_dir(directory)
        except PermissionError as exc:
            return SecurityCheck(str(exc), [])
        if fixed is not None:
            notes.append(fixed)
    plaintext = [f"{name} {endpoint}" for name, endpoint in endpoints.items() if is_tcp(endpoint)]
    if plaintext and keys is None:
        notes.append("WARNING: tcp:// endpoints without CURVE keys (" + ", ".join(plaintext) + "): any host that "
                     "reaches these ports can join as a worker or gateway and read every prompt, unencrypted. "
                     "Make keys with `tiller keys` and set curve.secret_key (docs/security.md).")
    return SecurityCheck("", notes)


def port_is_free(port: Port) -> bool:
    """Whether a server could bind ``port`` now (SO_REUSEADDR as servers set it: TIME_WAIT is free)."""
    family = socket.AF_INET6 if ":" in port.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((port.host, port.port))
        except OSError:
            return False
    return True


def busy_ports(settings: Settings) -> list[Port]:
    return [port for port in ports_to_bind(settings) if not port_is_free(port)]


@dataclass(frozen=True)
class GatewayAnswer:
    status: int
    pid: int | None  # the pid the /health body names (None: not a Tiller gateway's body)


def gateway_answer(settings: Settings, timeout: float = 2.0) -> GatewayAnswer | None:
    """What answers ``GET /health`` on the HTTP port, or None when nothing does."""
    host = {"0.0.0.0": "127.0.0.1", "::": "[::1]"}.get(settings.http_host, settings.http_host)  # bound everywhere
    url = f"{'https' if settings.tls.enabled else 'http'}://{host}:{settings.http_port}/health"
    # our own gateway is asked for its pid: its certificate need not name this address, nor be trusted here
    context = None
    if settings.tls.enabled:
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:  # a 503 while loading still names its pid
        status, raw = exc.code, exc.read()
    except (urllib.error.URLError, OSError):
        return None
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    pid = body.get("pid") if isinstance(body, dict) else None
    return GatewayAnswer(status=status, pid=pid if isinstance(pid, int) else None)


def judge_gateway(answer: GatewayAnswer | None, started_pids: set[int], settings: Settings) -> tuple[int | None, str]:
    """(the started gateway's pid that answered 200, or None; why not ready is fatal, or ''): fatal (a
    non-empty reason) when a server other than the gateways supervisord started answers on the port."""
    if answer is None or not started_pids:
        return None, ""
    if answer.pid not in started_pids:
        who = f"pid {answer.pid}" if answer.pid is not None else "not a Tiller gateway"
        port = Port(settings.http_host, settings.http_port, "TILLER_HTTP_PORT")
        started = ", ".join(str(pid) for pid in sorted(started_pids))
        return None, (f"{port.describe()} is answered by another server ({who}), not by the gateway this "
                      f"start launched (pid {started}): stop that server or set TILLER_HTTP_PORT")
    return (answer.pid if answer.status == 200 else None), ""
