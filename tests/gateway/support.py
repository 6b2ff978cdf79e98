"""Helpers for the gateway's end-to-end tests: a client for the WebSocket protocol, SSE parsing,
and extra real processes (another gateway with other limits, a scheduler without a worker)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import websockets

from tests.stack import ROOT, free_port

MESSAGE_TIMEOUT_S = 60.0
FINAL = ("completion", "error")


async def receive(ws: websockets.ClientConnection, timeout: float = MESSAGE_TIMEOUT_S) -> dict[str, Any]:
    return json.loads(await asyncio.wait_for(ws.recv(), timeout))


async def send(ws: websockets.ClientConnection, message: dict[str, Any] | str) -> None:
    await ws.send(message if isinstance(message, str) else json.dumps(message))


async def collect(ws: websockets.ClientConnection, timeout: float = MESSAGE_TIMEOUT_S) -> list[dict[str, Any]]:
    """Messages up to and including the next completion or error."""
    messages = []
    while True:
        message = await receive(ws, timeout)
        messages.append(message)
        if message["type"] in FINAL:
            return messages


async def generate(ws: websockets.ClientConnection, config: dict[str, Any]) -> list[dict[str, Any]]:
    await send(ws, {"type": "config", **config})
    return await collect(ws)


async def ws_generate(url: str, config: dict[str, Any]) -> list[dict[str, Any]]:
    async with websockets.connect(url) as ws:
        return await generate(ws, config)


def greedy_config(
    *, prompt: str | None = None, messages: list[dict[str, str]] | None = None, max_tokens: int, **options: Any
) -> dict[str, Any]:
    config: dict[str, Any] = {"prompt": prompt} if messages is None else {"messages": messages}
    config["parameters"] = {"max_tokens": max_tokens, "temperature": 0}
    config["options"] = {"include_token_ids": True, **options}
    return config


def kinds(messages: list[dict[str, Any]]) -> list[str]:
    return [m["type"] for m in messages]


def token_ids(messages: list[dict[str, Any]]) -> list[int]:
    return [m["token_id"] for m in messages if m["type"] == "token"]


def parse_sse(body: str) -> list[Any]:
    """The data payloads of a server-sent event stream (JSON decoded, except ``[DONE]``)."""
    events = []
    for block in body.split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            payload = block[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


async def scheduler_idle(stack) -> bool:
    """Nothing running or queued in the stack's scheduler."""
    health = await asyncio.to_thread(stack.scheduler_health)
    return health["running"] == 0 and health["queued"] == 0


async def wait_for(predicate: Any, timeout: float, what: str) -> None:
    """Poll a (possibly async) predicate until it holds."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


def base_env(run_dir: Path, **overrides: str) -> dict[str, str]:
    """The environment of a service process in ``run_dir`` with TILLER_* ``overrides``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TILLER_")}
    env.update(TILLER_RUN_DIR=str(run_dir), PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", **overrides)
    return env


@contextlib.contextmanager
def service(module: str, env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``python -m module`` until the block ends."""
    with log.open("ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", module], env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def gateway(env: dict[str, str], log_dir: Path, timeout: float = 120.0) -> Iterator[str]:
    """A gateway process on a free port; yields its ``host:port`` once it answers HTTP."""
    with gateway_process(env, log_dir, timeout) as (address, _):
        yield address


@contextlib.contextmanager
def gateway_process(env: dict[str, str], log_dir: Path, timeout: float = 120.0,
                    grpc_port: int | None = None) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A gateway process on a free port (gRPC on ``grpc_port``, else another free one); yields its ``host:port``
    and the process once it answers HTTP."""
    port = free_port()
    log = log_dir / f"gateway-{port}.log"
    env = dict(env, TILLER_HTTP_PORT=str(port), TILLER_GRPC_PORT=str(grpc_port or free_port()))
    with service("services.gateway", env, log) as proc:
        deadline = time.monotonic() + timeout
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=1.0)
                break
            except httpx.TransportError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the gateway did not start:\n{log.read_text(errors='replace')}") from None
                time.sleep(0.2)
        yield f"127.0.0.1:{port}", proc
