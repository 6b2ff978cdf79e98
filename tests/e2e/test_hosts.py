"""Several hosts over tcp://: the scheduler (with the gateway, store and controller runtime, `tiller
up --workers 0`) in one network namespace, a worker in each of two others (`tiller worker
--scheduler tcp://...`). Greedy output equals transformers on both workers, a prompt whose
prefix a worker caches and a session's next turn go where their KV is, pulling one host's cable
leaves the other serving and tells the clients of the lost requests, and a worker that joins
again is used again."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import grpc
import httpx
import pytest

from common.config import Settings
from common.protos.salience.v1 import salience_pb2 as pb
from common.protos.salience.v1 import salience_pb2_grpc as pb_grpc
from services.gateway.salience.service import CACHED_TOKENS_TRAILER
from tests.e2e.test_salience import generate, greedy
from tests.netns import Host, Hosts, unavailable
from tests.stack import ROOT, Stack, free_port, settings_of

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=unavailable() or "")

T = TypeVar("T")
WORKER_PORT = 5557
READY_S = 300
MODEL = Settings().served_model_name


class Cluster:
    """``hub_env``: more of the hub's settings (TILLER_*)."""

    def __init__(self, hosts: Hosts, run_dir: Path, **hub_env: str) -> None:
        self.hosts = hosts
        self.run_dir = run_dir
        self.http_port, self.grpc_port = free_port(), free_port()
        self.base_env = {k: v for k, v in os.environ.items() if not k.startswith("TILLER_")}
        self.base_env.update(
            PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
            OMP_NUM_THREADS="1",
            TILLER_DEVICE="cpu",
            TILLER_DISTRIBUTED__HEARTBEAT_TIMEOUT_S="3",
        )
        hub_env = dict(
            self.base_env,
            TILLER_RUN_DIR=str(run_dir / "hub"),
            TILLER_HTTP_HOST=hosts.hub.address,
            TILLER_HTTP_PORT=str(self.http_port),
            TILLER_GRPC_PORT=str(self.grpc_port),
            TILLER_WORKER_ENDPOINT=f"tcp://0.0.0.0:{WORKER_PORT}",
            TILLER_READY_TIMEOUT_S=str(READY_S),
            **hub_env,
        )
        self.stack = Stack(run_dir / "hub", hub_env, settings_of(hub_env))
        (run_dir / "hub").mkdir(parents=True)
        self.url = f"http://{hosts.hub.address}:{self.http_port}"

    def up(self, workers: list[tuple[Host, dict[str, str]]] | None = None,
           ready: int = 2) -> list[subprocess.Popen[bytes]]:
        """Start the hub and a worker on each host of ``workers`` (with its extra settings; default:
        every other host), wait for ``ready`` of them; the workers' processes."""
        command = [sys.executable, "-m", "common.cli", "up", "--workers", "0"]
        starting = self.hosts.hub.popen(command, dict(self.stack.env), self.run_dir / "up.log")
        if workers is None:
            workers = [(host, {}) for host in self.hosts.others]
        started = [self.start_worker(host, **env) for host, env in workers]
        if starting.wait(timeout=READY_S + 30) != 0:
            raise RuntimeError(f"tiller up failed:\n{(self.run_dir / 'up.log').read_text()}\n{self.stack.logs()}")
        self.wait_for_workers(ready)
        return started

    def start_worker(self, host: Host, **extra_env: str) -> subprocess.Popen[bytes]:
        env = dict(self.base_env, TILLER_RUN_DIR=str(self.run_dir / host.name), TILLER_LIMITS__MAX_BATCH_SIZE="4",
                   **extra_env)
        scheduler = f"tcp://{self.hosts.hub_address_for(host)}:{WORKER_PORT}"
        return host.popen([sys.executable, "-m", "common.cli", "worker", "--scheduler", scheduler], env,
                          self.run_dir / f"{host.name}.log")

    def workers(self) -> list[dict]:
        return [w for w in self.stack.scheduler_health()["workers"] if w["stage"] == "ready"]

    def wait_for_workers(self, n: int) -> list[dict]:
        deadline = time.monotonic() + READY_S
        while time.monotonic() < deadline:
            ready = self.workers()
            if len(ready) == n:
                return ready
            time.sleep(0.5)
        raise AssertionError(f"not {n} ready workers: {self.stack.scheduler_health()['workers']}")

    def placed(self) -> dict[str, dict[str, int]]:
        return {w["worker"]: w["placed"] for w in self.workers()}


def brought_up(others: int, run_dir: Path, make: Callable[[Hosts, Path], T]) -> Iterator[T]:
    """``make(hosts, run_dir)`` on ``others`` hosts besides the hub, up (``up()``) until the caller is done,
    then its stack down and the hosts gone: the body of a cluster fixture."""
    with Hosts(others=others) as hosts:
        made = make(hosts, run_dir)
        try:
            made.up()
            yield made
        finally:
            made.stack.down()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from brought_up(2, tmp_path_factory.mktemp("hosts"), Cluster)


def _completion(client: httpx.Client, prompt: list[int], max_tokens: int) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return client.post("/v1/completions", json=body, timeout=300)


async def _completions(url: str, prompts: list[list[int]], max_tokens: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0}
        return await asyncio.gather(*(client.post("/v1/completions", json={**body, "prompt": p}) for p in prompts))


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text)


@pytest.fixture(scope="module")
def tokenizer():
    from common.model_source import load_tokenizer

    return load_tokenizer(Settings())


def test_both_workers_generate_what_transformers_does(cluster: Cluster, tokenizer, hf_greedy) -> None:
    prompts = [_ids(tokenizer, "The capital of France is"), _ids(tokenizer, "def fibonacci(n):")]
    responses = asyncio.run(_completions(cluster.url, prompts, 16))
    for prompt, response in zip(prompts, responses):
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == tokenizer.decode(hf_greedy(prompt, 16))
    placed = cluster.placed()
    assert len(placed) == 2 and all(p.get("load", 0) >= 1 for p in placed.values()), placed  # one each


def test_a_cached_prefix_and_a_session_turn_go_where_their_kv_is(cluster: Cluster, tokenizer) -> None:
    preamble = _ids(tokenizer, "Background: " + "the river flows north past the old mill and the stone bridge. " * 6)
    with httpx.Client(base_url=cluster.url) as client:
        first = _completion(client, preamble + _ids(tokenizer, " Question one?"), 4)
        assert first.status_code == 200, first.text
        before = cluster.placed()
        second = _completion(client, preamble + _ids(tokenizer, " Question two?"), 4)
        assert second.status_code == 200, second.text
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 48
    after = cluster.placed()
    gained = [w for w in after if after[w].get("prefix", 0) == before[w].get("prefix", 0) + 1]
    assert len(gained) == 1, (before, after)

    async def session_turns() -> tuple[int, int]:
        async with grpc.aio.insecure_channel(f"{cluster.hosts.hub.address}:{cluster.grpc_port}") as channel:
            stub = pb_grpc.SalienceStub(channel)
            opened = await stub.OpenSession(pb.OpenSessionRequest(model=cluster.stack.settings.served_model_name))
            session = opened.session_id
            prompt = _ids(tokenizer, "A long conversation about sailing boats and the wind on the open sea.")
            turn = await generate(stub, session_id=session, append_tokens=prompt, offset=0, max_tokens=4, **greedy())
            history = prompt + turn.decoded
            more = _ids(tokenizer, " And then?")
            again = await generate(stub, session_id=session, append_tokens=more, offset=len(history), max_tokens=4,
                                   **greedy())
            return int(again.trailers[CACHED_TOKENS_TRAILER]), len(history)

    # the second turn continues the sequence parked on the first turn's worker: all but the last
    # token of the history is reused (only that worker ever held it)
    cached, history = asyncio.run(session_turns())
    assert cached >= history - 1


def test_a_lost_host_tells_its_clients_and_the_other_keeps_serving(cluster: Cluster, tokenizer, hf_greedy) -> None:
    lost_host = cluster.hosts.others[1]
    prompts = [_ids(tokenizer, "Once upon a time"), _ids(tokenizer, "The best way to learn")]

    async def run() -> list[httpx.Response]:
        requests = asyncio.create_task(_completions(cluster.url, prompts, 200))
        deadline = time.monotonic() + 60
        while sum(w["running"] for w in await asyncio.to_thread(cluster.workers)) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        workers = await asyncio.to_thread(cluster.workers)
        assert all(w["running"] == 1 for w in workers), workers  # one on each host
        cluster.hosts.cut(lost_host)
        cluster.hosts.kill(lost_host)
        return await requests

    responses = asyncio.run(run())
    failed = [r for r in responses if r.status_code != 200]
    assert len(failed) == 1, [r.text for r in responses]
    assert "lost" in failed[0].text, failed[0].text
    assert len(cluster.wait_for_workers(1)) == 1
    with httpx.Client(base_url=cluster.url) as client:
        prompt = _ids(tokenizer, "The capital of Italy is")
        response = _completion(client, prompt, 8)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == tokenizer.decode(hf_greedy(prompt, 8))

    # the host comes back and its new worker takes work again
    cluster.hosts.mend(lost_host)
    cluster.start_worker(lost_host)
    cluster.wait_for_workers(2)
    before = cluster.placed()
    prompts = [_ids(tokenizer, "Rain in Spain"), _ids(tokenizer, "Seven bridges of")]
    responses = asyncio.run(_completions(cluster.url, prompts, 8))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    after = cluster.placed()
    assert all(sum(after[w].values()) > sum(before.get(w, {}).values()) for w in after), (before, after)
