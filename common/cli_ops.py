"""``tiller ps | restart | logs | check | cache | keys``: operations on a running stack, on the model cache,
and the CurveZMQ key pair of a host.

``ps``, ``restart`` and ``logs`` act on the supervisord that ``tiller up`` started in this run
directory; ``check`` asks one service whether it is ready (the container healthchecks use it, where
each service runs alone); ``cache`` lists and cleans the converted models in ``cache_dir``; ``keys``
writes a host's key pair (docs/security.md).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import sys
import time
from pathlib import Path

from common import aici_wire, model_cache, wire
from common.model_source import cache_entries_in_use
from common.config import Settings
from common.curve import CurveError, make_key_pair
from common.sockets import connect, probe_health
from common.startup_checks import gateway_answer
from common.supervisor import SERVICES, program_status, programs_in_order, service_of, supervisorctl

COMMANDS = ("ps", "restart", "logs", "check", "cache", "keys")
RESTART_POLL_S = 0.1  # how often a rolling restart of several gateways asks whether the restarted one serves


def _service(name: str) -> str:
    """A service as named on the command line: ``session-store`` as the architecture's prose names it, or
    ``session_store`` as its package is named."""
    return name.replace("-", "_")


def add_commands(sub: argparse._SubParsersAction) -> None:
    ps = sub.add_parser("ps", help="each service's state, pid and uptime")
    ps.add_argument("service", nargs="?", type=_service, choices=SERVICES)
    restart = sub.add_parser("restart", help="restart one service (or all) under the running supervisord")
    restart.add_argument("service", type=_service, choices=(*SERVICES, "all"))
    logs = sub.add_parser("logs", help="the last lines of a service's log (all services without one)")
    logs.add_argument("service", nargs="?", type=_service, choices=(*SERVICES, "supervisord"))
    logs.add_argument("-n", "--lines", type=int, default=50)
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    check = sub.add_parser("check", help="exit 0 when the service answers its health check as ready (healthchecks)")
    check.add_argument("service", type=_service, choices=SERVICES)
    cache = sub.add_parser("cache", help="list the converted models in cache_dir; `clean` removes stale ones")
    cache.add_argument("action", nargs="?", choices=("list", "clean"), default="list")
    cache.add_argument("--all", action="store_true", help="with clean: also the current model's conversion")
    keys = sub.add_parser("keys", help="make this host's CurveZMQ key pair (NAME.key public, NAME.key_secret "
                          "owner-only)")
    keys.add_argument("directory", nargs="?", type=Path, default=Path("keys"),
                      help="where to write them (default: ./keys)")
    keys.add_argument("--name", default=socket.gethostname(), help="the pair's file name (default: this host's name)")


def run(args: argparse.Namespace, settings: Settings) -> int:
    if args.command == "ps":
        return ps(settings, args.service)
    if args.command == "restart":
        return restart(settings, args.service)
    if args.command == "logs":
        return logs(settings, args.service, args.lines, args.follow)
    if args.command == "check":
        ready, note = asyncio.run(check(settings, args.service))
        print(f"{args.service}: {'ready' if ready else 'not ready'}{f' ({note})' if note else ''}")
        return 0 if ready else 1
    if args.command == "keys":
        return keys(args.directory, args.name)
    return cache(settings, args.action, args.all)


def ps(settings: Settings, service: str | None) -> int:
    programs = program_status(settings)
    if not programs:
        print(f"Tiller is not running here (run directory {settings.run_dir.resolve()}).")
        return 1
    for name in programs_in_order(programs, service):
        state, _, rest = programs.get(name, ("UNKNOWN", None, ""))
        print(f"{name:20s} {state:10s} {rest}".rstrip())
    return 0


def restart(settings: Settings, service: str) -> int:
    """Restart ``service`` (every process of it, one after another: with several gateways the others serve
    meanwhile) or ``all``."""
    programs = program_status(settings)
    if not programs:
        print(f"Tiller is not running here (run directory {settings.run_dir.resolve()}).", file=sys.stderr)
        return 1
    names = ["*"] if service == "all" else programs_in_order(programs, service)
    ok = True
    for name in names:
        result = supervisorctl(settings, "restart", f"tiller:{name}")
        print(result.stdout.strip() or result.stderr.strip())
        ok = ok and result.returncode == 0 and "ERROR" not in result.stdout
        if ok and service == "gateway" and len(names) > 1 and not _serves_again(settings, name):
            print(f"{name} did not answer /health again within {settings.ready_timeout_s:.0f} s", file=sys.stderr)
            return 1
    if ok:
        reload = " (the worker reloads the model)" if service in ("worker", "all") else ""
        print(f"restarted; `tiller status` shows when it serves again{reload}")
    return 0 if ok else 1


def _serves_again(settings: Settings, program: str) -> bool:
    """Whether the restarted gateway ``program`` answers ``/health`` with 200 itself (its new pid) before
    ``ready_timeout_s``: only then may the next gateway go down, so that one always serves the port."""
    deadline = time.monotonic() + settings.ready_timeout_s
    while time.monotonic() < deadline:
        pid = program_status(settings).get(program, ("", None, ""))[1]
        answer = gateway_answer(settings)  # whichever process the kernel picks: polled until it is this one
        if pid is not None and answer is not None and (answer.pid, answer.status) == (pid, 200):
            return True
        time.sleep(RESTART_POLL_S)
    return False


def logs(settings: Settings, service: str | None, lines: int, follow: bool) -> int:
    log_dir = settings.run_dir.resolve() / "logs"
    on_disk = [path.stem for path in log_dir.glob("*.log") if service_of(path.stem) in SERVICES]
    names = ["supervisord"] if service == "supervisord" else programs_in_order(on_disk, service)
    files = [str(log_dir / f"{name}.log") for name in names if (log_dir / f"{name}.log").is_file()]
    if not files:
        print(f"no logs in {log_dir}", file=sys.stderr)
        return 1
    tail = shutil.which("tail")
    if tail is None:  # pragma: no cover - every POSIX system has tail
        print("`tail` is not installed", file=sys.stderr)
        return 1
    os.execv(tail, [tail, "-n", str(lines), *(["-F"] if follow else []), *files])


async def check(settings: Settings, service: str) -> tuple[bool, str]:
    """Whether ``service`` answers as ready, and a note. The worker binds no socket of its own: it is
    judged by what the scheduler reports of its workers."""
    if service == "gateway":
        answer = await asyncio.to_thread(gateway_answer, settings)
        if answer is None:
            return False, f"nothing answers on {settings.http_host}:{settings.http_port}"
        return answer.status == 200, f"/health {answer.status}"
    if service == "controller_runtime":
        return await _ping_controller_runtime(settings)
    if service in ("scheduler", "session_store"):
        reply = await probe_health(settings.endpoint(service), timeout=2.0, curve=settings.curve)
        return (reply is not None and reply.ready), "" if reply is not None else "no answer"
    reply = await probe_health(settings.endpoint("scheduler"), timeout=2.0, curve=settings.curve)
    if reply is None:
        return False, "the scheduler does not answer"
    worker = (reply.facts or wire.ModelFacts()).worker
    return worker.stage == "ready", f"{worker.stage} {worker.message}".strip()


async def _ping_controller_runtime(settings: Settings) -> tuple[bool, str]:
    import zmq
    import zmq.asyncio

    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        connect(sock, settings.endpoint("controller_main"), settings.curve)
        await sock.send(aici_wire.encode(aici_wire.Ping()))
        if not await sock.poll(2000):
            return False, "no answer"
        reply = aici_wire.decode_reply((await sock.recv_multipart())[0])
        return reply.get("type") == "ok", ""
    finally:
        sock.close(0)


def cache(settings: Settings, action: str, everything: bool) -> int:
    entries = model_cache.entries(settings.cache_dir)
    current = cache_entries_in_use(settings)
    if action == "list":
        if not entries:
            print(f"{settings.cache_dir}: empty")
        for entry in entries:
            mark = "in use " if entry.path.name in current else "stale  "
            print(f"{mark}{entry.size_bytes / 2**20:8.0f} MiB  {entry.path}")
        return 0
    doomed = [e for e in entries if everything or e.path.name not in current]
    freed = model_cache.remove(doomed)
    print(f"removed {len(doomed)} entr{'y' if len(doomed) == 1 else 'ies'} from {settings.cache_dir}, "
          f"{freed / 2**20:.0f} MiB freed")
    return 0


def keys(directory: Path, name: str) -> int:
    try:
        public, secret = make_key_pair(directory, name)
    except (CurveError, OSError) as exc:
        print(f"tiller keys: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {public}  (public: copy it into the scheduler host's curve.authorized_keys directory, or, made on\n"
          f"       the scheduler's host, to every host that connects to it as their curve.server_key)\n"
          f"      {secret}  (this host's own pair, owner-only: curve.secret_key; never copy it elsewhere)\n"
          f"this host: TILLER_CURVE__SECRET_KEY={secret.resolve()}")
    return 0
