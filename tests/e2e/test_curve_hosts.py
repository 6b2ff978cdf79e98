"""CurveZMQ across hosts: the hub (`tiller up --workers 0`, every ZeroMQ endpoint on tcp:// with its
key pair and an authorized_keys directory) in one network namespace, and a worker in each of three
others: one with a listed key, one with a key the hub does not list, one with no key. The first
joins and serves (greedy output equals transformers); the other two are refused (the hub logs the
stranger's address and key, and the keyless handshake), never appear among the scheduler's workers
and so never receive a step, and stop saying why; the stack keeps serving while one tries again."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq.auth

from common.curve import make_key_pair
from tests.e2e.test_hosts import READY_S, WORKER_PORT, Cluster, _completions, _ids, brought_up
from tests.e2e.test_hosts import tokenizer  # noqa: F401 (a fixture)
from tests.netns import Hosts, unavailable
from tests.stack import Stack

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=unavailable() or "")



class KeyedCluster:
    def __init__(self, hosts: Hosts, run_dir: Path) -> None:
        keys = run_dir / "keys"
        self.hub_public, hub_secret = make_key_pair(keys / "hub", "hub")
        self.listed_public, self.listed_secret = make_key_pair(keys / "listed", "listed")
        self.stranger_public, self.stranger_secret = make_key_pair(keys / "stranger", "stranger")
        authorized = keys / "authorized"
        authorized.mkdir()
        (authorized / "listed.key").write_bytes(self.listed_public.read_bytes())
        hub = hosts.hub.address
        ports = {"SCHEDULER": 5551, "CONTROLLER_MAIN": 5552, "CONTROLLER_SIDE": 5553, "SESSION_STORE": 5554}
        endpoints = {name: f"tcp://{hub}:{port}" for name, port in ports.items()}
        self.cluster = Cluster(hosts, run_dir, TILLER_CURVE__SECRET_KEY=str(hub_secret),
                               TILLER_CURVE__AUTHORIZED_KEYS=str(authorized),
                               **{f"TILLER_{name}_ENDPOINT": endpoint for name, endpoint in endpoints.items()})
        self.listed, self.stranger, self.keyless = hosts.others
        self.listed_pid = 0
        self.refused: list[subprocess.Popen[bytes]] = []

    def up(self) -> None:
        server = str(self.hub_public)
        [listed] = self.cluster.up([(self.listed, {"TILLER_CURVE__SECRET_KEY": str(self.listed_secret),
                                                   "TILLER_CURVE__SERVER_KEY": server})], ready=1)
        self.listed_pid = listed.pid  # (`ip netns exec` and `tiller worker` exec: the worker's own pid)
        self.refused = [
            self.cluster.start_worker(self.stranger, TILLER_CURVE__SECRET_KEY=str(self.stranger_secret),
                                      TILLER_CURVE__SERVER_KEY=server),
            self.cluster.start_worker(self.keyless),
        ]

    @property
    def stack(self) -> Stack:
        return self.cluster.stack

    def worker_log(self, host) -> str:
        return (self.cluster.run_dir / f"{host.name}.log").read_text(errors="replace")

    def refusals(self) -> list[dict]:
        lines = (self.cluster.run_dir / "hub" / "logs" / "scheduler.log").read_text(errors="replace").splitlines()
        return [entry for line in lines if '"curve.refused"' in line for entry in [json.loads(line)]]


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KeyedCluster]:
    yield from brought_up(3, tmp_path_factory.mktemp("curve-hosts"), KeyedCluster)


def _refused(keyed: KeyedCluster, worker: subprocess.Popen[bytes], host) -> str:
    """The refused worker's exit: it stops, nonzero, saying why (its log, if it does not)."""
    try:
        code = worker.wait(timeout=READY_S / 2)  # (its refusal comes at its first connection, before it loads)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the refused worker on {host.name} is still running: {keyed.worker_log(host)[-3000:]}")
    assert code != 0
    log = keyed.worker_log(host)
    assert '"worker.refused"' in log and '"worker.ready"' not in log[log.index('"worker.refused"'):], log[-3000:]
    return log


def test_refused_workers_never_join_and_the_listed_one_serves(keyed: KeyedCluster, tokenizer, hf_greedy) -> None:
    prompts = [_ids(tokenizer, "The capital of France is"), _ids(tokenizer, "def fibonacci(n):"),
               _ids(tokenizer, "Rain in Spain"), _ids(tokenizer, "Seven bridges of")]
    seen: set[str] = set()

    async def serve_and_watch() -> list:
        requests = asyncio.create_task(_completions(keyed.cluster.url, prompts, 12))
        while not requests.done():  # the scheduler's workers, sampled while the steps run
            health = await asyncio.to_thread(keyed.cluster.stack.scheduler_health)
            seen.update(w["worker"] for w in health["workers"])
            await asyncio.sleep(0.2)
        return await requests

    responses = asyncio.run(serve_and_watch())
    for prompt, response in zip(prompts, responses):
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == tokenizer.decode(hf_greedy(prompt, 12))
    workers = keyed.cluster.stack.scheduler_health()["workers"]
    assert len(workers) == 1 and seen == {workers[0]["worker"]}, (seen, workers)
    assert workers[0]["worker"].endswith(f"-{keyed.listed_pid}"), workers  # ids: worker-<host name>-<pid>

    stranger, keyless = keyed.refused
    assert "refused this host's key" in _refused(keyed, stranger, keyed.stranger)
    keyless_log = _refused(keyed, keyless, keyed.keyless)
    assert "this host has no CURVE key" in keyless_log
    assert "WARNING: tcp:// endpoints without CURVE keys" in keyless_log  # `tiller worker` said so first
    refused = keyed.refusals()
    stranger_key = zmq.auth.load_certificate(keyed.stranger_public)[0].decode()
    assert any(e.get("key") == stranger_key and e.get("address") == keyed.stranger.address
               and e["reason"] == "Unknown key" for e in refused), refused
    assert any(e.get("zmq_event", "").startswith("HANDSHAKE_FAILED") and e["endpoint"].endswith(f":{WORKER_PORT}")
               for e in refused), refused  # the keyless worker, refused before ZAP is asked


def test_the_stack_keeps_serving_while_a_refused_worker_tries_again(keyed: KeyedCluster, tokenizer) -> None:
    async def serve_while_knocking() -> tuple[list, subprocess.Popen[bytes]]:
        requests = asyncio.create_task(_completions(keyed.cluster.url, [_ids(tokenizer, "Once upon a time")] * 3, 24))
        again = keyed.cluster.start_worker(keyed.stranger, TILLER_CURVE__SECRET_KEY=str(keyed.stranger_secret),
                                           TILLER_CURVE__SERVER_KEY=str(keyed.hub_public))
        return await requests, again

    responses, again = asyncio.run(serve_while_knocking())
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    assert again.wait(timeout=READY_S) != 0
    workers = keyed.cluster.stack.scheduler_health()["workers"]
    assert len(workers) == 1 and workers[0]["worker"].endswith(f"-{keyed.listed_pid}"), workers
