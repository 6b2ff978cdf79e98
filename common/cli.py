"""``tiller up | down | status``: run the five services under supervisord and wait until they serve
(the operations on a running stack and the model cache are in :mod:`common.cli_ops`)."""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

from common import cli_ops
from common.config import Settings, get_settings
from common.sockets import probe_health
from common.startup_checks import busy_ports, gateway_answer, judge_gateway
from common.supervisor import (
    SERVICES,
    program_states,
    program_status,
    supervisor_env,
    supervisorctl,
    write_conf,
)

__all__ = ["main", "supervisorctl"]


async def _wait_ready(settings: Settings) -> tuple[bool, str]:
    """Wait for every service: the zmq ones answer Health, the gateway this start launched (its pid)
    answers /health with 200."""
    deadline = time.monotonic() + settings.ready_timeout_s
    last_note = ""
    while time.monotonic() < deadline:
        programs = program_status(settings)
        states = {name: state for name, (state, _, _) in programs.items()}
        broken = [name for name, state in states.items() if state in ("FATAL", "BACKOFF", "EXITED")]
        if broken:
            return False, f"service(s) failed to start: {', '.join(broken)} (see {settings.run_dir}/logs/)"
        store = await probe_health(settings.endpoint("session_store"), timeout=1.0)
        scheduler = await probe_health(settings.endpoint("scheduler"), timeout=2.0)
        if scheduler is not None:
            worker = scheduler.detail.get("worker", {})
            if worker.get("stage") == "failed":
                return False, f"the worker failed to load the model: {worker.get('message')}"
            note = f"worker: {worker.get('stage')} {worker.get('progress', 0)}% {worker.get('message', '')}".strip()
            if note != last_note:
                print(f"  {note}", flush=True)
                last_note = note
        gateway_pid = programs.get("gateway", ("", None, ""))[1]
        gateway_ready, fatal = judge_gateway(gateway_answer(settings), gateway_pid, settings)
        if fatal:
            return False, fatal
        if store and store.ready and scheduler and scheduler.ready and gateway_ready:
            return True, ""
        await asyncio.sleep(0.5)
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
    host = settings.http_host
    print(
        "Tiller is up:\n"
        f"  WebSocket   ws://{host}:{settings.http_port}/generate\n"
        f"  REST        http://{host}:{settings.http_port}/v1/generate\n"
        f"  OpenAI API  http://{host}:{settings.http_port}/v1\n"
        f"  health      http://{host}:{settings.http_port}/health\n"
        f"  gRPC        {host}:{settings.grpc_port}\n"
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
    for name in SERVICES:
        print(f"{name:20s} {states.get(name, 'UNKNOWN')}")
    return 0 if all(states.get(name) == "RUNNING" for name in SERVICES) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tiller", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    up_parser = sub.add_parser("up", help="start the five services and wait until they are ready")
    up_parser.add_argument("--foreground", action="store_true", help="run supervisord in the foreground (containers)")
    sub.add_parser("down", help="stop every service")
    sub.add_parser("status", help="show each service's state")
    cli_ops.add_commands(sub)
    args = parser.parse_args(argv)
    settings = get_settings()
    if args.command in cli_ops.COMMANDS:
        return cli_ops.run(args, settings)
    if args.command == "up":
        return up(settings, args.foreground)
    if args.command == "down":
        return down(settings)
    return status(settings)


if __name__ == "__main__":
    sys.exit(main())
