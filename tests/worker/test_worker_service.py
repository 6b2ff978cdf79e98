"""``python -m services.worker`` as a real process, driven through a ROUTER bound by the test."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog.testing
import zmq

from common import wire
from common.config import Settings
from services.worker.service import SILENT_SCHEDULER_HELLO_S, WorkerService
from tests.worker.conftest import GREEDY

ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 120


class Scheduler:
    """The scheduler's side of the worker socket: a bound ROUTER."""

    def __init__(self, run_dir: Path) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(Settings(run_dir=run_dir).endpoint("worker"))
        self.worker = b""

    def recv(self, timeout_s: float = 30) -> wire.Message:
        assert self.sock.poll(int(timeout_s * 1000)), "the worker did not answer in time"
        identity, header, *_ = self.sock.recv_multipart()
        self.worker = identity
        return wire.decode(header)

    def send(self, *frames: bytes) -> None:
        self.sock.send_multipart([self.worker, *frames])

    def request(self, msg: wire.Msg, *binary: bytes) -> wire.Message:
        """Send and return the next message that is not a hello."""
        self.send(wire.encode(msg), *binary)
        while isinstance(reply := self.recv(), wire.WorkerHello):
            pass
        return reply

    def wait_for_stage(self, stage: str, timeout_s: float = READY_TIMEOUT_S) -> wire.WorkerHello:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            msg = self.recv(timeout_s=deadline - time.monotonic())
            assert isinstance(msg, wire.WorkerHello), msg
            assert msg.stage in ("loading", stage), msg
            if msg.stage == stage:
                return msg
        raise AssertionError(f"no {stage} hello within {timeout_s} s")


def _start_worker(run_dir: Path, **env: str) -> subprocess.Popen[bytes]:
    environment = dict(
        os.environ,
        TILLER_RUN_DIR=str(run_dir),
        TILLER_DEVICE="cpu",
        TILLER_LIMITS__MAX_BATCH_SIZE="4",
        TILLER_WEIGHTS="fp32",  # compared with transformers below
        **env,
    )
    log = open(run_dir / "worker.log", "wb")
    command = [sys.executable, "-m", "services.worker"]
    return subprocess.Popen(command, cwd=ROOT, env=environment, stderr=log, stdout=log)


@pytest.fixture
def scheduler(tmp_path: Path) -> Iterator[Scheduler]:
    side = Scheduler(tmp_path)
    yield side
    side.sock.close(0)


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()


def test_worker_process_serves_steps_and_survives_garbage(
    tmp_path: Path, scheduler: Scheduler, reference, tokenizer
) -> None:
    process = _start_worker(tmp_path)
    try:
        hello = scheduler.wait_for_stage("ready")
        assert scheduler.worker == f"worker-{socket.gethostname()}-{process.pid}".encode()
        assert hello.vocab_size == 49152 and hello.max_model_len == 2048 and hello.eos_token_ids == [2]
        assert hello.device == "cpu" and hello.kv_capacity_tokens >= 4 * 2048
        assert hello.forward == "paged" and hello.fallback_reason == ""  # SmolLM2: the native Llama family

        prompt = tokenizer("The quick brown fox").input_ids
        step = wire.Step(mid=7, step_id=1, seqs=[wire.SeqStep(seq_id=1, tokens=prompt, sampling=GREEDY)])
        result = scheduler.request(step)
        assert isinstance(result, wire.StepResult) and result.mid == 7 and result.step_id == 1
        assert not result.failures and result.forward_ms > 0
        first = wire.samples_by_seq(step, result)[1].token_id
        assert first == reference(prompt, 1)[0]

        scheduler.send(b"\x00 not msgpack")  # malformed: logged and skipped
        scheduler.send(wire.encode(wire.Ok()))  # well-formed but not for a worker: ignored
        step = wire.Step(step_id=2, follows=wire.pack_ids([1]), seqs=[])  # feeds ``first`` itself
        result = scheduler.request(step)
        assert isinstance(result, wire.StepResult) and result.step_id == 2
        assert wire.samples_by_seq(step, result)[1].token_id == reference(prompt, 2)[1]

        health = scheduler.request(wire.Health(mid=9))
        assert isinstance(health, wire.HealthReply) and health.mid == 9 and health.ready
        assert health.worker.engine.active_seqs == 1
        assert scheduler.wait_for_stage("ready")  # Health makes the worker re-announce itself

        result = scheduler.request(wire.Step(step_id=3, seqs=[], free=[1]))
        assert isinstance(result, wire.StepResult) and result.tokens == b"" and not result.failures

        # A scheduler that went silent (it stalled past its liveness limit and dropped the worker on waking)
        # hears from the worker without asking.
        quiet = scheduler.recv(timeout_s=SILENT_SCHEDULER_HELLO_S + 5)
        assert isinstance(quiet, wire.WorkerHello) and quiet.stage == "ready"

        # A restarted scheduler hears from the worker without asking.
        scheduler.sock.close(0)
        restarted = Scheduler(tmp_path)
        try:
            assert restarted.wait_for_stage("ready").kv_capacity_tokens == hello.kv_capacity_tokens
        finally:
            restarted.sock.close(0)
        assert process.poll() is None
    finally:
        _stop(process)


def test_failed_load_is_reported_and_steps_fail(tmp_path: Path, scheduler: Scheduler) -> None:
    process = _start_worker(tmp_path, TILLER_MODEL=str(tmp_path / "no-such-model"))
    try:
        hello = scheduler.wait_for_stage("failed")
        assert "no-such-model" in hello.message
        seqs = [wire.SeqStep(seq_id=4, tokens=[1], sampling=GREEDY), wire.SeqStep(seq_id=5, tokens=[1])]
        result = scheduler.request(wire.Step(step_id=1, seqs=seqs))
        assert isinstance(result, wire.StepResult)
        assert [f.seq_id for f in result.failures] == [4, 5]
        assert all("no-such-model" in f.message for f in result.failures)
        health = scheduler.request(wire.Health())
        assert isinstance(health, wire.HealthReply) and not health.ready and health.worker.stage == "failed"
        assert scheduler.wait_for_stage("failed")  # and it keeps announcing the failure
        assert process.poll() is None
    finally:
        _stop(process)


def test_a_step_that_raises_fails_all_its_sequences_and_frees_them(tmp_path: Path, engine, monkeypatch) -> None:
    service = WorkerService(Settings(run_dir=tmp_path))
    try:
        step = wire.Step(step_id=1, seqs=[wire.SeqStep(seq_id=s, tokens=[1, 2], sampling=GREEDY) for s in (70, 71)])
        result = service._run_step(step, None)
        assert "still loading" in result.failures[0].message and len(result.failures) == 2

        service.engine = engine
        assert not service._run_step(step, None).failures  # 70 and 71 have sampled: they may follow

        def broken(inputs):
            raise RuntimeError("boom")

        monkeypatch.setattr(engine.runner, "forward", broken)
        step = wire.Step(step_id=2, follows=wire.pack_ids([70]), seqs=[wire.SeqStep(seq_id=71, tokens=[3])])
        result = service._run_step(step, None)
        assert [f.seq_id for f in result.failures] == [70, 71]
        assert all("boom" in f.message for f in result.failures)
        assert wire.unpack_tokens(result.tokens) == [-1, -1]  # every slot, followers' too
        assert 70 not in engine.seqs and 71 not in engine.tables.seqs
    finally:
        service.sock.close(0)


def test_a_hello_with_no_connection_to_queue_on_is_dropped_and_said(tmp_path: Path) -> None:
    """A DEALER with no connection (ZeroMQ drops one whose handshake was refused, for good) blocks every send:
    the worker's must return, so its loop goes on to read the monitor event saying why it was refused."""
    service = WorkerService(Settings(run_dir=tmp_path))  # its socket is connected nowhere yet
    sender = threading.Thread(target=service._hello, daemon=True)
    try:
        with structlog.testing.capture_logs() as logs:
            sender.start()
            sender.join(timeout=10)
        assert not sender.is_alive(), "the hello blocked"
        assert [e["type"] for e in logs if e["event"] == "worker.send_dropped"] == ["WorkerHello"], logs
    finally:
        service.sock.close(0)
