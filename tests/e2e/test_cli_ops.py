"""The ``tiller`` command on a real stack: ``ps``, ``logs``, ``restart``, ``check``, supervisorctl used
directly, ``up`` refusing a busy port, and ``cache list|clean`` on a scratch cache directory."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from common import model_cache
from common.config import Settings
from common.model_source import cache_entries_in_use
from common.startup_checks import GatewayAnswer, judge_gateway
from common.supervisor import SERVICES
from tests.gateway.support import wait_for
from tests.stack import ROOT, free_port


def tiller(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "common.cli", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_ps_names_every_service_with_its_pid(stack):
    out = tiller(stack.env, "ps").stdout.splitlines()
    assert [line.split()[0] for line in out] == list(SERVICES)
    for line in out:
        name, state = line.split()[:2]
        assert state == "RUNNING" and f"pid {stack.pid(name)}," in line, line


def test_logs_of_one_service(stack):
    result = tiller(stack.env, "logs", "gateway", "-n", "3")
    assert result.returncode == 0 and 0 < len(result.stdout.splitlines()) <= 3, result
    hyphenated = tiller(stack.env, "logs", "session-store", "-n", "1")  # as the README's prose names it
    assert hyphenated.returncode == 0 and len(hyphenated.stdout.splitlines()) == 1, hyphenated
    expected = (stack.run_dir / "logs" / "gateway.log").read_text().splitlines()[-3:]
    assert result.stdout.splitlines() == expected[-len(result.stdout.splitlines()):]


def test_check_answers_for_every_service(stack):
    for service in SERVICES:
        result = tiller(stack.env, "check", service)
        assert result.returncode == 0 and result.stdout.startswith(f"{service}: ready"), result


def test_check_fails_where_nothing_answers(tmp_path: Path):
    env = {**os.environ, "TILLER_RUN_DIR": str(tmp_path), "TILLER_HTTP_PORT": str(free_port())}
    for service in ("gateway", "session_store"):
        result = tiller(env, "check", service)
        assert result.returncode == 1 and "not ready" in result.stdout, result


def test_plain_supervisorctl_works_on_the_written_config(stack):
    conf = stack.run_dir / "supervisord.conf"
    clean_env = {k: v for k, v in os.environ.items() if not k.startswith("TILLER_")}
    result = subprocess.run([sys.executable, "-m", "supervisor.supervisorctl", "-c", str(conf), "status"],
                            env=clean_env, capture_output=True, text=True, timeout=60)
    listed = {line.split()[0] for line in result.stdout.splitlines()}
    # the five services, all running (nothing else: the extra local workers' program is there with --workers N > 1)
    assert listed == {f"tiller:{s}" for s in SERVICES} and result.returncode == 0, result.stdout


async def test_restart_one_service(stack):
    before = stack.pid("session_store")
    result = tiller(stack.env, "restart", "session_store")
    assert result.returncode == 0 and "session_store: started" in result.stdout, result
    assert stack.pid("session_store") != before

    async def ready() -> bool:
        return (await asyncio.to_thread(tiller, stack.env, "check", "session_store")).returncode == 0

    await wait_for(ready, 30, "the restarted session store to answer")
    async with httpx.AsyncClient(base_url=stack.http_url, timeout=60) as client:  # records are written again
        reply = await client.post("/v1/generate", json={"prompt": "Hi", "max_tokens": 1, "temperature": 0})
        assert reply.status_code == 200

        async def recorded() -> bool:
            return (await client.get(f"/v1/requests/{reply.json()['id']}")).status_code == 200

        await wait_for(recorded, 10, "the request record")


async def test_restarting_the_gateway_ends_its_streams_instead_of_waiting_for_them(stack):
    """A restart under a live stream: the stream is cut after ``shutdown_grace_s`` and the gateway exits on its
    own; supervisord never has to SIGKILL it (it waited for the stream, then was killed 10 s later)."""
    supervisord_log = stack.run_dir / "logs" / "supervisord.log"
    kills_before = supervisord_log.read_text().count("killing 'gateway'")
    async with httpx.AsyncClient(base_url=stack.http_url, timeout=60) as client:
        body = {"prompt": "Count to a thousand:", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        async with client.stream("POST", "/v1/generate", json=body) as reply:
            lines = reply.aiter_lines()
            assert (await anext(lines)).startswith("data: ")  # streaming
            restart = asyncio.create_task(asyncio.to_thread(tiller, stack.env, "restart", "gateway"))
            with pytest.raises(httpx.HTTPError):
                async for _ in lines:  # cut, not finished (1500 tokens take longer than the test)
                    pass
        result = await restart
    assert result.returncode == 0 and "gateway: started" in result.stdout, result
    assert supervisord_log.read_text().count("killing 'gateway'") == kills_before

    async def ready() -> bool:
        return (await asyncio.to_thread(tiller, stack.env, "check", "gateway")).returncode == 0

    await wait_for(ready, 60, "the restarted gateway to answer")


def test_up_names_a_busy_port(tmp_path: Path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        env = {**os.environ, "TILLER_RUN_DIR": str(tmp_path), "TILLER_HTTP_PORT": str(port),
               "TILLER_GRPC_PORT": str(free_port())}
        result = tiller(env, "up")
    assert result.returncode == 1
    assert f"port {port} on 127.0.0.1 (TILLER_HTTP_PORT) is in use" in result.stderr, result
    assert not (tmp_path / "supervisord.pid").exists()  # nothing was started


@pytest.mark.parametrize(("answer", "started", "verdict"), [
    (None, {41}, (None, "")),  # nothing answers yet
    (GatewayAnswer(503, 41), {41}, (None, "")),  # ours, loading
    (GatewayAnswer(200, 41), {41}, (41, "")),
    (GatewayAnswer(200, 42), {41, 42}, (42, "")),  # one of several sharing the port
    (GatewayAnswer(200, None), set(), (None, "")),  # supervisord has no pid for it yet
])
def test_judge_gateway_waits_for_ours(answer, started, verdict):
    assert judge_gateway(answer, started, Settings(http_port=8123)) == verdict


@pytest.mark.parametrize("answer", [GatewayAnswer(200, 7), GatewayAnswer(200, None), GatewayAnswer(404, None)])
def test_judge_gateway_refuses_another_server(answer):
    ready, reason = judge_gateway(answer, {41}, Settings(http_port=8123))
    assert ready is None and "port 8123 on 127.0.0.1 (TILLER_HTTP_PORT) is answered by another server" in reason
    assert "(pid 41)" in reason


def test_the_gateway_stops_on_sigterm_with_its_peers_gone(tmp_path: Path):
    """``tiller down`` stops the services at once: the gateway, whose scheduler is gone by then, must exit
    on SIGTERM rather than wait for supervisord's SIGKILL (its ZeroMQ context's term waited for a socket
    only a cancelled task would have closed)."""
    port = free_port()
    env = {**os.environ, "TILLER_RUN_DIR": str(tmp_path), "TILLER_HTTP_PORT": str(port),
           "TILLER_GRPC_PORT": str(free_port())}
    gateway = subprocess.Popen([sys.executable, "-m", "services.gateway"], env=env, cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def listening() -> bool:
            with socket.socket() as probe:
                return probe.connect_ex(("127.0.0.1", port)) == 0

        deadline = time.monotonic() + 60
        while not listening():
            assert gateway.poll() is None and time.monotonic() < deadline, "the gateway did not start"
            time.sleep(0.2)
        gateway.send_signal(signal.SIGTERM)
        # (uvicorn re-raises the signal once shut down); within supervisord's stopwaitsecs of 10
        assert gateway.wait(timeout=8) in (0, -signal.SIGTERM)
    finally:
        gateway.kill()
        gateway.wait()


def test_cache_clean_keeps_what_is_in_use(tmp_path: Path):
    settings = Settings(cache_dir=tmp_path)
    in_use = sorted(cache_entries_in_use(settings))
    assert "kernels" in in_use  # the worker's compiled kernel libraries (its kernel_build.library_path)
    stale = ["smollm2-a60f0a1eb1a6", "qwen2-vl-tiny-v0"]  # an mtime-keyed conversion, an old version
    for name in [*in_use, *stale]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"x" * 1024)
        (tmp_path / f"{name}.lock").touch()
    env = {**os.environ, "TILLER_CACHE_DIR": str(tmp_path)}
    listing = tiller(env, "cache").stdout
    assert {line.split()[0] for line in listing.splitlines()} == {"in", "stale"}
    assert all(("in use" in line) == any(line.endswith(n) for n in in_use) for line in listing.splitlines())
    assert "removed 2 entries" in tiller(env, "cache", "clean").stdout
    assert sorted(e.path.name for e in model_cache.entries(tmp_path)) == in_use
    assert not any((tmp_path / f"{name}.lock").exists() for name in stale)
    assert f"removed {len(in_use)} entries" in tiller(env, "cache", "clean", "--all").stdout
    assert model_cache.entries(tmp_path) == []


def test_cache_key_is_the_content(tmp_path: Path):
    one, two = tmp_path / "a.gguf", tmp_path / "b.gguf"
    one.write_bytes(b"same bytes")
    two.write_bytes(b"same bytes")
    cache = tmp_path / "cache"
    assert model_cache.content_digest(one, cache) == model_cache.content_digest(two, cache)
    two.write_bytes(b"other bytes")  # a new size and mtime: hashed again, not read from the memo
    assert model_cache.content_digest(one, cache) != model_cache.content_digest(two, cache)
