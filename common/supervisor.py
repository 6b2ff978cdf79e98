"""Tiller's five processes under supervisord: the configuration, supervisorctl and what it reports.

``deploy/supervisord.conf`` is a template whose paths are ``%(ENV_TILLER_*)s`` variables. ``tiller up``
writes it out with those values filled in as ``<run_dir>/supervisord.conf``, and every later call
(``tiller down|status|ps|restart``, and a person typing ``supervisorctl -c run/supervisord.conf status``)
reads that file, so none of them depends on the caller's environment.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import xmlrpc.client
from collections.abc import Iterable
from pathlib import Path

from supervisor.xmlrpc import SupervisorTransport

from common.config import Settings

HOME = Path(__file__).resolve().parents[1]
SUPERVISOR_TEMPLATE = HOME / "deploy" / "supervisord.conf"
MORE_TEMPLATE = HOME / "deploy" / "supervisord.more.conf"  # appended per service run N > 1 times (`--workers N`)
SERVICES = ("session_store", "controller_runtime", "scheduler", "worker", "gateway")
# the services `tiller up` may run more than once, and the supervisord priority of their processes
REPEATED_PRIORITY = {"worker": 30, "gateway": 40}
_ENV_REF = re.compile(r"%\(ENV_(\w+)\)s")


def supervisor_env(settings: Settings, foreground: bool, base: dict[str, str] | None = None) -> dict[str, str]:
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
    env.update(_copies_env(process_counts(settings), env, run_dir))
    return env


def process_counts(settings: Settings) -> dict[str, int]:
    """How many processes of each service in :data:`REPEATED_PRIORITY` this host runs."""
    return {"worker": settings.distributed.local_workers, "gateway": settings.distributed.gateways}


def metrics_dir(run_dir: Path) -> Path:
    """Where several gateways keep their Prometheus samples for one /metrics (prometheus_client's multiprocess
    mode, see services/gateway/metrics.py)."""
    return run_dir / "prometheus"


def _copies_env(counts: dict[str, int], env: dict[str, str], run_dir: Path) -> dict[str, str]:
    """What the templates need to start ``counts[service]`` processes of each service (worker, then worker_1
    .. worker_<count-1>; the same for gateways); several CPU workers split the cores instead of each taking
    all, and several gateways share their metrics through files."""
    extra = {"TILLER_WORKER_AUTOSTART": str(counts["worker"] >= 1).lower()}
    for service, count in counts.items():
        extra[f"TILLER_MORE_{service.upper()}S_MEMBER"] = f",more_{service}s" if count > 1 else ""  # the group's
    if counts["worker"] > 1 and "OMP_NUM_THREADS" not in env:
        extra["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // counts["worker"]))
    if counts["gateway"] > 1:
        extra["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir(run_dir))
    return extra


def conf_path(settings: Settings) -> Path:
    return settings.run_dir.resolve() / "supervisord.conf"


def render_conf(template: str, env: dict[str, str]) -> str:
    """The template with every ``%(ENV_NAME)s`` replaced by ``env[NAME]`` (``%`` escaped for supervisord);
    supervisord's own ``%(program_name)s`` and friends stay."""

    def value(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in env:
            raise KeyError(f"{SUPERVISOR_TEMPLATE} names ${name}, which is not set")
        return env[name].replace("%", "%%")

    return _ENV_REF.sub(value, template)


def write_conf(settings: Settings, foreground: bool) -> Path:
    """Write ``<run_dir>/supervisord.conf`` for this start; returns its path. A service run more than once
    gets a program for its second and later processes; several gateways get an empty metrics directory."""
    path = conf_path(settings)
    env = supervisor_env(settings, foreground)
    parts = [render_conf(SUPERVISOR_TEMPLATE.read_text(), env)]
    for service, count in process_counts(settings).items():
        if count > 1:
            parts.append(render_conf(MORE_TEMPLATE.read_text(), {
                **env, "TILLER_MORE_SERVICE": service, "TILLER_MORE_COUNT": str(count - 1),
                "TILLER_MORE_PRIORITY": str(REPEATED_PRIORITY[service])}))
    if "PROMETHEUS_MULTIPROC_DIR" in env:  # the last start's samples (dead pids) must not count
        shutil.rmtree(env["PROMETHEUS_MULTIPROC_DIR"], ignore_errors=True)
        Path(env["PROMETHEUS_MULTIPROC_DIR"]).mkdir(parents=True)
    path.write_text("\n".join(parts))
    return path


def service_of(program: str) -> str:
    """The service a supervisord program runs: ``gateway_1`` -> ``gateway``."""
    base, _, number = program.rpartition("_")
    return base if number.isdigit() and base in REPEATED_PRIORITY else program


def programs_in_order(programs: Iterable[str], service: str | None = None) -> list[str]:
    """``programs`` (of ``service`` only, if given) in :data:`SERVICES` order, each service's later processes
    after its first (``gateway``, ``gateway_1``, ...); a service missing from ``programs`` is listed too."""
    names = set(programs) | set(SERVICES if service is None else [service])

    def rank(name: str) -> tuple[int, int]:
        number = name.rpartition("_")[2] if name != service_of(name) else "0"
        return SERVICES.index(service_of(name)) if service_of(name) in SERVICES else len(SERVICES), int(number)

    return sorted((n for n in names if service is None or service_of(n) == service), key=rank)


def supervisorctl(
    settings: Settings, *args: str, base_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run supervisorctl against this run directory's supervisord (fails cleanly when none runs)."""
    env = dict(os.environ if base_env is None else base_env)
    path = conf_path(settings)
    if not path.is_file():
        return subprocess.CompletedProcess(args, 1, "", f"no supervisord.conf in {path.parent}: Tiller is not running")
    return subprocess.run(
        [sys.executable, "-m", "supervisor.supervisorctl", "-c", str(path), *args],
        env=env,
        capture_output=True,
        text=True,
    )


def program_status(settings: Settings) -> dict[str, tuple[str, int | None, str]]:
    """{service: (state, pid or None, supervisord's description)} of this run directory's
    supervisord, {} when none runs. Asked over its socket from this process: ``tiller up`` polls
    this while the services start, and a ``supervisorctl`` process per poll took ~0.1 CPU seconds
    from them each time."""
    socket_file = settings.run_dir.resolve() / "supervisor.sock"
    if not socket_file.exists():
        return {}
    transport = SupervisorTransport(None, None, f"unix://{socket_file}")
    try:
        infos = xmlrpc.client.ServerProxy("http://localhost", transport=transport).supervisor.getAllProcessInfo()
    except (OSError, xmlrpc.client.Error):  # not running, or going away
        return {}
    finally:
        transport.close()
    return {i["name"]: (i["statename"], i["pid"] or None, i["description"]) for i in infos if i["group"] == "tiller"}


def program_states(settings: Settings) -> dict[str, str]:
    return {name: state for name, (state, _, _) in program_status(settings).items()}
