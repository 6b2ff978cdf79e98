"""Tiller's five processes under supervisord: the configuration, supervisorctl and what it reports.

``deploy/supervisord.conf`` is a template whose paths are ``%(ENV_TILLER_*)s`` variables. ``tiller up``
writes it out with those values filled in as ``<run_dir>/supervisord.conf``, and every later call
(``tiller down|status|ps|restart``, and a person typing ``supervisorctl -c run/supervisord.conf status``)
reads that file, so none of them depends on the caller's environment.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import xmlrpc.client
from pathlib import Path

from supervisor.xmlrpc import SupervisorTransport

from common.config import Settings

HOME = Path(__file__).resolve().parents[1]
SUPERVISOR_TEMPLATE = HOME / "deploy" / "supervisord.conf"
MORE_WORKERS_TEMPLATE = HOME / "deploy" / "supervisord.more_workers.conf"  # appended for `--workers N`, N > 1
SERVICES = ("session_store", "controller_runtime", "scheduler", "worker", "gateway")
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
    env.update(_local_workers_env(settings.distributed.local_workers, env))
    return env


def _local_workers_env(count: int, env: dict[str, str]) -> dict[str, str]:
    """What the templates need to start ``count`` local workers (worker, then worker_1 .. worker_<count-1>);
    several CPU workers split the cores instead of each taking all."""
    more = max(count - 1, 0)
    extra = {
        "TILLER_WORKER_AUTOSTART": str(count >= 1).lower(),
        "TILLER_MORE_WORKERS": str(more),
        "TILLER_MORE_WORKERS_MEMBER": ",more_workers" if more else "",  # the group's programs
    }
    if count > 1 and "OMP_NUM_THREADS" not in env:
        extra["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // count))
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
    """Write ``<run_dir>/supervisord.conf`` for this start; returns its path."""
    path = conf_path(settings)
    env = supervisor_env(settings, foreground)
    template = SUPERVISOR_TEMPLATE.read_text()
    if settings.distributed.local_workers > 1:
        template += "\n" + MORE_WORKERS_TEMPLATE.read_text()
    path.write_text(render_conf(template, env))
    return path


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
