"""``tiller up | down | status``: run the five services under supervisord and wait until they serve."""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from pydantic import ValidationError

from common.config import Distributed, Settings, get_settings
from common.sockets import probe_health

HOME = Path(__file__).resolve().parents[1]
SUPERVISOR_CONF = HOME / "deploy" / "supervisord.conf"
SERVICES = ("session_store", "controller_runtime", "scheduler", "worker", "gateway")


def _supervisor_env(settings: Settings, foreground: bool, base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) plus what deploy/supervisord.conf expands."""
    run_dir = settings.run_dir.resolve()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    env = dict(os.environ if base is None else base)
    env.update(
        TILLER_RUN_DIR=str(run_dir),
        TILLER_HOME=str(HOME),
        TILLER_PYTHON=sys.executable,
        TILLER_FOREGROUND="true" if foreground else "false",
        PYTHONUNBUFFERED="1",
    )
    env.update(_local_workers_env(settings.distributed.local_workers, env))
    return env


def _local_workers_env(count: int, env: dict[str, str]) -> dict[str, str]:
    """What deploy/supervisord.conf needs to start ``count`` local workers (worker, then
    worker_1 .. worker_<count-1>); several CPU workers split the cores instead of each taking all."""
    more = max(count - 1, 0)
    extra = {
        "TILLER_WORKER_AUTOSTART": str(count >= 1).lower(),
        "TILLER_MORE_WORKERS": str(max(more, 1)),  # supervisord needs numprocs >= 1: one stays stopped
        "TILLER_MORE_WORKERS_AUTOSTART": str(more >= 1).lower(),
    }
    if count > 1 and "OMP_NUM_THREADS" not in env:
        extra["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // count))
    return extra


def worker(settings: Settings, scheduler: str) -> int:
    """``tiller worker``: one worker in the foreground, joining the scheduler at ``scheduler``
    (its worker endpoint, e.g. tcp://host-a:5557)."""
    env = dict(os.environ, TILLER_WORKER_ENDPOINT=scheduler or settings.endpoint("worker"), PYTHONUNBUFFERED="1")
    print(f"Worker joining the scheduler at {env['TILLER_WORKER_ENDPOINT']} (model {settings.model}) ...", flush=True)
    os.execve(sys.executable, [sys.executable, "-m", "services.worker"], env)
    return 1  # not reached


def _add_worker_commands(sub: argparse._SubParsersAction, up_parser: argparse.ArgumentParser) -> None:
    up_parser.add_argument("--workers", type=int, default=None, metavar="N",
                           help="local workers to start (default distributed.local_workers, 1; 0: only remote ones)")
    worker_parser = sub.add_parser("worker", help="run one worker here that joins a scheduler, in the foreground")
    worker_parser.add_argument("--scheduler", default="", metavar="tcp://HOST:PORT",
                               help="the scheduler's worker endpoint (default: TILLER_WORKER_ENDPOINT)")
    for parser in (up_parser, worker_parser):
        parser.add_argument("--tensor-parallel", type=int, default=None, metavar="N",
                            help="ranks per worker, one per GPU (gloo on the CPU)")


def _with_worker_arguments(settings: Settings, args: argparse.Namespace) -> Settings:
    """``settings`` with ``--workers`` and ``--tensor-parallel`` applied, and exported to the
    services that ``tiller up`` starts."""
    given = {"local_workers": getattr(args, "workers", None), "tensor_parallel": args.tensor_parallel}
    given = {name: value for name, value in given.items() if value is not None}
    try:
        distributed = Distributed.model_validate({**settings.distributed.model_dump(), **given})
    except ValidationError as exc:
        raise SystemExit(f"tiller: {exc.errors()[0]['loc'][0]}: {exc.errors()[0]['msg']}") from None
    for name, value in given.items():
        os.environ[f"TILLER_DISTRIBUTED__{name.upper()}"] = str(value)
    return settings.model_copy(update={"distributed": distributed})


def supervisorctl(
    settings: Settings, *args: str, base_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor.supervisorctl", "-c", str(SUPERVISOR_CONF), *args],
        env=_supervisor_env(settings, False, base_env),
        capture_output=True,
        text=True,
    )


def _program_states(settings: Settings) -> dict[str, str]:
    out = supervisorctl(settings, "status").stdout
    states = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0].startswith("tiller:"):
            states[parts[0].split(":", 1)[1]] = parts[1]
    return states


def _gateway_ready(settings: Settings) -> bool:
    url = f"http://{settings.http_host}:{settings.http_port}/health"
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


async def _wait_ready(settings: Settings) -> tuple[bool, str]:
    """Wait for every service: the zmq ones answer Health, the gateway answers /health with 200."""
    deadline = time.monotonic() + settings.ready_timeout_s
    last_note = ""
    while time.monotonic() < deadline:
        states = _program_states(settings)
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
        if store and store.ready and scheduler and scheduler.ready and _gateway_ready(settings):
            return True, ""
        await asyncio.sleep(0.5)
    return False, f"not ready after {settings.ready_timeout_s:.0f} s (see {settings.run_dir}/logs/)"


def up(settings: Settings, foreground: bool = False) -> int:
    if foreground:
        os.execve(sys.executable, [sys.executable, "-m", "supervisor.supervisord", "-c", str(SUPERVISOR_CONF)],
                  _supervisor_env(settings, True))
    if _program_states(settings):
        print("Tiller is already running here; `tiller down` first.", file=sys.stderr)
        return 1
    started = subprocess.run(
        [sys.executable, "-m", "supervisor.supervisord", "-c", str(SUPERVISOR_CONF)],
        env=_supervisor_env(settings, False),
    )
    if started.returncode != 0:
        print("supervisord did not start", file=sys.stderr)
        return 1
    print(f"Starting Tiller (model {settings.model}, run directory {settings.run_dir.resolve()}) ...", flush=True)
    ready, reason = asyncio.run(_wait_ready(settings))
    if not ready:
        print(f"Tiller did not come up: {reason}", file=sys.stderr)
        return 1
    host = settings.http_host
    print(
        "Tiller is up:\n"
        f"  WebSocket   ws://{host}:{settings.http_port}/generate\n"
        f"  REST        http://{host}:{settings.http_port}/v1/generate\n"
        f"  OpenAI API  http://{host}:{settings.http_port}/v1\n"
        f"  health      http://{host}:{settings.http_port}/health\n"
        f"  gRPC        {host}:{settings.grpc_port}\n"
        f"  logs        {settings.run_dir.resolve()}/logs/\n"
        "Stop it with `make down` (or `tiller down`).",
        flush=True,
    )
    return 0


def down(settings: Settings) -> int:
    if not _program_states(settings):
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
    states = _program_states(settings)
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
    _add_worker_commands(sub, up_parser)
    args = parser.parse_args(argv)
    settings = get_settings()
    if args.command == "worker":
        return worker(_with_worker_arguments(settings, args), args.scheduler)
    if args.command == "up":
        return up(_with_worker_arguments(settings, args), args.foreground)
    if args.command == "down":
        return down(settings)
    return status(settings)


if __name__ == "__main__":
    sys.exit(main())
