"""``tiller up | down | status``: run the five services under supervisord and wait until they serve
(the operations on a running stack and the model cache are in :mod:`common.cli_ops`)."""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

from pydantic import ValidationError

from common import cli_ops, wire
from common.config import Distributed, Settings, get_settings
from common.sockets import probe_health
from common.startup_checks import busy_ports, gateway_answer, judge_gateway, check_security
from common.supervisor import (
    program_states,
    program_status,
    programs_in_order,
    service_of,
    supervisor_env,
    supervisorctl,
    write_conf,
)

__all__ = ["main", "supervisorctl"]

READY_POLL_S = 0.2  # how often `tiller up` asks whether the services are ready (each ask costs ~ms of CPU)


def _secure_enough(settings: Settings, who: str) -> bool:
    """Say what :func:`check_security` fixed or found unguarded; False (said why) when it refuses the start."""
    security = check_security(settings)
    if security.refusal:
        print(f"{who} cannot start: {security.refusal}", file=sys.stderr)
        return False
    for note in security.notes:
        print(note, file=sys.stderr, flush=True)
    return True


def worker(settings: Settings, scheduler: str) -> int:
    """``tiller worker``: one worker in the foreground, joining the scheduler at ``scheduler``
    (its worker endpoint, e.g. tcp://host-a:5557)."""
    env = dict(os.environ, TILLER_WORKER_ENDPOINT=scheduler or settings.endpoint("worker"), PYTHONUNBUFFERED="1")
    if not _secure_enough(settings.model_copy(update={"worker_endpoint": env["TILLER_WORKER_ENDPOINT"]}), "The worker"):
        return 1
    print(f"Worker joining the scheduler at {env['TILLER_WORKER_ENDPOINT']} (model {settings.model}) ...", flush=True)
    os.execve(sys.executable, [sys.executable, "-m", "services.worker"], env)
    return 1  # not reached


def _add_worker_commands(sub: argparse._SubParsersAction, up_parser: argparse.ArgumentParser) -> None:
    up_parser.add_argument("--workers", type=int, default=None, metavar="N",
                           help="local workers to start (default distributed.local_workers, 1; 0: only remote ones)")
    up_parser.add_argument("--gateways", type=int, default=None, metavar="N",
                           help="gateway processes sharing the HTTP and gRPC ports (default distributed.gateways, 1)")
    worker_parser = sub.add_parser("worker", help="run one worker here that joins a scheduler, in the foreground")
    worker_parser.add_argument("--scheduler", default="", metavar="tcp://HOST:PORT",
                               help="the scheduler's worker endpoint (default: TILLER_WORKER_ENDPOINT)")
    for parser in (up_parser, worker_parser):
        parser.add_argument("--tensor-parallel", type=int, default=None, metavar="N",
                            help="ranks per worker, one per GPU (gloo on the CPU)")


def _with_worker_arguments(settings: Settings, args: argparse.Namespace) -> Settings:
    """``settings`` with ``--workers``, ``--gateways`` and ``--tensor-parallel`` applied, and exported to the
    services that ``tiller up`` starts."""
    given = {"local_workers": getattr(args, "workers", None), "gateways": getattr(args, "gateways", None),
             "tensor_parallel": args.tensor_parallel}
    given = {name: value for name, value in given.items() if value is not None}
    try:
        distributed = Distributed.model_validate({**settings.distributed.model_dump(), **given})
    except ValidationError as exc:
        raise SystemExit(f"tiller: {exc.errors()[0]['loc'][0]}: {exc.errors()[0]['msg']}") from None
    for name, value in given.items():
        os.environ[f"TILLER_DISTRIBUTED__{name.upper()}"] = str(value)
    return settings.model_copy(update={"distributed": distributed})




async def _wait_ready(settings: Settings) -> tuple[bool, str]:
    """Wait for every service: the zmq ones answer Health, every gateway this start launched (their pids)
    answered /health with 200 (several share the port: each poll reaches one the kernel picks)."""
    deadline = time.monotonic() + settings.ready_timeout_s
    last_note = ""
    served: set[int] = set()  # the gateway pids that answered 200
    while time.monotonic() < deadline:
        programs = program_status(settings)
        states = {name: state for name, (state, _, _) in programs.items()}
        broken = [name for name, state in states.items() if state in ("FATAL", "BACKOFF", "EXITED")]
        if broken:
            return False, f"service(s) failed to start: {', '.join(broken)} (see {settings.run_dir}/logs/)"
        store = await probe_health(settings.endpoint("session_store"), timeout=1.0, curve=settings.curve)
        scheduler = await probe_health(settings.endpoint("scheduler"), timeout=2.0, curve=settings.curve)
        if scheduler is not None:
            worker = (scheduler.facts or wire.ModelFacts()).worker
            if worker.stage == "failed":
                return False, f"the worker failed to load the model: {worker.message}"
            note = f"worker: {worker.stage} {worker.progress}% {worker.message}".strip()
            if note != last_note:
                print(f"  {note}", flush=True)
                last_note = note
        gateway_pids = [pid for name, (_, pid, _) in programs.items() if service_of(name) == "gateway"]
        started = {pid for pid in gateway_pids if pid is not None}
        served_by, fatal = judge_gateway(gateway_answer(settings), started, settings)
        if fatal:
            return False, fatal
        served = (served | {served_by}) & started  # a gateway restarted meanwhile must answer again
        gateways_ready = len(served) == len(gateway_pids) > 0
        if store and store.ready and scheduler and scheduler.ready and gateways_ready:
            return True, ""
        await asyncio.sleep(READY_POLL_S)
    return False, f"not ready after {settings.ready_timeout_s:.0f} s (see {settings.run_dir}/logs/)"


def up(settings: Settings, foreground: bool = False) -> int:
    if program_states(settings):
        print("Tiller is already running here; `tiller down` first.", file=sys.stderr)
        return 1
    busy = busy_ports(settings)
    if busy:
        print("Tiller cannot start: " + "; ".join(f"{p.describe()} is in use" for p in busy)
              + " (stop what holds it or move Tiller with that variable)", file=sys.stderr)
        return 1
    if not _secure_enough(settings, "Tiller"):
        return 1
    conf = write_conf(settings, foreground)
    if foreground:
        os.execve(sys.executable, [sys.executable, "-m", "supervisor.supervisord", "-c", str(conf)],
                  supervisor_env(settings, True))
    started = subprocess.run(
        [sys.executable, "-m", "supervisor.supervisord", "-c", str(conf)], env=supervisor_env(settings, False)
    )
    if started.returncode != 0:
        print("supervisord did not start", file=sys.stderr)
        return 1
    print(f"Starting Tiller (model {settings.model}, run directory {settings.run_dir.resolve()}) ...", flush=True)
    ready, reason = asyncio.run(_wait_ready(settings))
    if not ready:
        print(f"Tiller did not come up: {reason}", file=sys.stderr)
        down(settings)  # nothing half-started stays behind (a crash-looping gateway, say); the logs stay
        return 1
    host, tls = settings.http_host, "s" if settings.tls.enabled else ""
    print(
        "Tiller is up:\n"
        f"  WebSocket   ws{tls}://{host}:{settings.http_port}/generate\n"
        f"  REST        http{tls}://{host}:{settings.http_port}/v1/generate\n"
        f"  OpenAI API  http{tls}://{host}:{settings.http_port}/v1\n"
        f"  health      http{tls}://{host}:{settings.http_port}/health\n"
        f"  gRPC        {host}:{settings.grpc_port}{' (TLS)' if tls else ''}\n"
        f"  logs        {settings.run_dir.resolve()}/logs/ (`tiller logs [SERVICE]`)\n"
        f"  supervisor  supervisorctl -c {conf} status\n"
        "Stop it with `make down` (or `tiller down`).",
        flush=True,
    )
    return 0


def down(settings: Settings) -> int:
    if not program_states(settings):
        print("Tiller is not running here.")
        return 0
    supervisorctl(settings, "shutdown")
    pidfile = settings.run_dir / "supervisord.pid"
    for _ in range(100):
        if not pidfile.exists():
            break
        time.sleep(0.1)
    print("Tiller stopped.")
    return 0


def status(settings: Settings) -> int:
    states = program_states(settings)
    if not states:
        print("Tiller is not running here.")
        return 1
    names = programs_in_order(states)
    for name in names:
        print(f"{name:20s} {states.get(name, 'UNKNOWN')}")
    return 0 if all(states.get(name) == "RUNNING" for name in names) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tiller", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    up_parser = sub.add_parser("up", help="start the five services and wait until they are ready")
    up_parser.add_argument("--foreground", action="store_true", help="run supervisord in the foreground (containers)")
    sub.add_parser("down", help="stop every service")
    sub.add_parser("status", help="show each service's state")
    _add_worker_commands(sub, up_parser)
    cli_ops.add_commands(sub)
    args = parser.parse_args(argv)
    settings = get_settings()
    if args.command == "worker":
        return worker(_with_worker_arguments(settings, args), args.scheduler)
    if args.command in cli_ops.COMMANDS:
        return cli_ops.run(args, settings)
    if args.command == "up":
        return up(_with_worker_arguments(settings, args), args.foreground)
    if args.command == "down":
        return down(settings)
    return status(settings)


if __name__ == "__main__":
    sys.exit(main())
