"""Start and stop a real Tiller stack (five processes under supervisord) for end-to-end tests."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from unittest import mock

from common.config import Settings
from common.sockets import probe_health
from common.supervisor import program_status, supervisorctl

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Stack:
    run_dir: Path
    env: dict[str, str]
    settings: Settings
    root: Path = ROOT  # the checkout whose code serves
    tokenizer: Any = field(default=None, repr=False)

    @property
    def http_url(self) -> str:
        return f"http{'s' if self.settings.tls.enabled else ''}://127.0.0.1:{self.settings.http_port}"

    @property
    def ws_url(self) -> str:
        return f"ws{'s' if self.settings.tls.enabled else ''}://127.0.0.1:{self.settings.http_port}/generate"

    def _cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "common.cli", *args], env=self.env, cwd=self.root,
                              capture_output=True, text=True, check=check)

    def _supervisorctl(self, *args: str) -> str:
        return supervisorctl(self.settings, *args, base_env=self.env).stdout

    def pid(self, service: str) -> int:
        _, pid, description = program_status(self.settings)[service]
        assert pid is not None, f"{service} is not running: {description}"
        return pid

    def kill(self, service: str, sig: int = signal.SIGKILL) -> None:
        os.kill(self.pid(service), sig)

    def restart(self, service: str) -> None:
        self._supervisorctl("restart", f"tiller:{service}")

    def stop(self, service: str) -> None:
        self._supervisorctl("stop", f"tiller:{service}")

    def start(self, service: str) -> None:
        self._supervisorctl("start", f"tiller:{service}")

    def scheduler_health(self) -> dict[str, Any]:
        async def probe() -> dict[str, Any]:
            reply = await probe_health(self.settings.endpoint("scheduler"), timeout=5.0, curve=self.settings.curve)
            assert reply is not None, "the scheduler did not answer Health"
            return {"ready": reply.ready, **msgspec.to_builtins(reply.facts)}

        return asyncio.run(probe())

    def logs(self) -> str:
        out = []
        for log in sorted((self.run_dir / "logs").glob("*.log")):
            out.append(f"==> {log.name} <==\n" + "\n".join(log.read_text(errors="replace").splitlines()[-30:]))
        return "\n".join(out)

    def up(self) -> None:
        result = self._cli("up", check=False)
        if result.returncode != 0:
            self._cli("down", check=False)
            raise RuntimeError(f"tiller up failed:\n{result.stdout}\n{result.stderr}\n{self.logs()}")

    def down(self) -> None:
        self._cli("down", check=False)


def settings_of(env: dict[str, str]) -> Settings:
    """The services' own view of the environment ``env``."""
    with mock.patch.dict(os.environ, env, clear=True):
        return Settings()


def served_settings() -> dict[str, str]:
    """This process's TILLER_* settings for a benchmark's stack, which serves what a deployment
    serves: the configured weights, else the default (not the fp32 that :func:`start_stack` holds
    the tests to for the ``transformers`` oracle)."""
    configured = {k: v for k, v in os.environ.items() if k.startswith("TILLER_")}
    return {"TILLER_WEIGHTS": Settings.model_fields["weights"].default, **configured}


def start_stack(run_dir: Path, root: Path = ROOT, **env_overrides: str) -> Stack:
    """Start a stack in ``run_dir`` on free ports; ``env_overrides`` are extra TILLER_* variables.
    ``root`` is the checkout whose code the five processes run (another one: a benchmark's baseline tree)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TILLER_")}
    env.update(
        TILLER_RUN_DIR=str(run_dir),
        TILLER_HTTP_PORT=str(free_port()),
        TILLER_GRPC_PORT=str(free_port()),
        TILLER_READY_TIMEOUT_S="300",
        TILLER_WEIGHTS="fp32",  # dense, as the transformers oracle (quantized weights: tests/worker/test_quantized.py)
        PYTHONPATH=os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])]),
    )
    env.update(env_overrides)
    stack = Stack(run_dir=run_dir, env=env, settings=settings_of(env), root=root)
    stack.up()
    return stack
