"""The worker's socket loop: a DEALER connected to the scheduler's ROUTER.

The model loads on a background thread while the main thread keeps the socket: it sends a
``WorkerHello(stage="loading")`` about every second, answers Health, and refuses Steps. Once
loaded it announces ``ready`` and runs each Step on the main thread. A Step with ``masks_follow``
runs its forward pass, then waits (at most ``limits.worker_step_timeout_s``) for its StepMasks before
sampling, answering Health meanwhile and keeping any other message for after the step. A failed load keeps the
process up, announcing ``failed`` every few seconds and failing every Step with the reason, so the
scheduler can report it to clients. A hello also goes out on every (re)connection, after every
Health and after a silence of the scheduler's (``SILENT_SCHEDULER_HELLO_S``), so a restarted scheduler finds its
workers, and one that dropped a worker while it stalled takes it back.
"""

from __future__ import annotations

import contextvars
import os
import socket
import subprocess
import threading
import time
from collections import deque
from typing import Any

import msgspec
import structlog
import zmq
from zmq.utils.monitor import recv_monitor_message

from common import wire
from common.config import Settings
from common.errors import WireError
from common.incarnation import process_incarnation
from common.curve import ClientHandshakes, refused_by_server
from common.sockets import connect, heartbeat
from services.worker.engine import Engine
from services.worker.model_loader import load_model, return_freed_memory
from services.worker.tensor_parallel import Ranks, start_followers
from services.worker.threads import thread_governor

LOADING_HELLO_INTERVAL_S = 1.0
FAILED_HELLO_INTERVAL_S = 2.0
SILENT_SCHEDULER_HELLO_S = 5.0
"""A ready worker that heard nothing from its scheduler for this long says hello again. The scheduler pings an
idle worker every 2 s, so such silence means it is gone or dropped this worker: a scheduler that stalled for
longer than its liveness limit takes its workers for dead when it wakes, and would never hear from them again."""


class _Loader(threading.Thread):
    """Loads the model and builds the engine off the main thread, publishing progress."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(name="model-loader", daemon=True)
        self.settings = settings
        self.progress = 0
        self.message = "starting"
        self.engine: Engine | None = None
        self.ranks: Ranks | None = None  # set first when the worker is tensor parallel
        self.followers: list[subprocess.Popen[bytes]] = []  # its ranks 1..N-1
        self.error: str | None = None
        self.seconds = 0.0
        self._context = contextvars.copy_context()  # the logging context bound by the main thread

    def _report(self, progress: int, message: str) -> None:
        self.progress, self.message = progress, message

    def run(self) -> None:
        self._context.run(self._load)

    def _load(self) -> None:
        started = time.monotonic()
        try:
            if self.settings.distributed.tensor_parallel > 1:
                self._report(0, f"joining {self.settings.distributed.tensor_parallel} tensor-parallel ranks")
                self.ranks, self.followers = start_followers(self.settings)
            loaded = load_model(self.settings, self._report)
            self._report(90, "allocating the KV cache")
            engine = Engine.create(loaded, self.settings, self.ranks)
            if engine.backend.endswith("cuda_graphs"):
                self._report(95, "capturing CUDA graphs of decode steps")
                engine.capture_graphs()
            return_freed_memory()
        except Exception as exc:  # any load failure is reported, never raised
            structlog.get_logger().exception("worker.load_failed")
            self.error = f"{type(exc).__name__}: {exc}"
            return
        self.seconds = time.monotonic() - started
        self.engine = engine  # last: the main thread takes a non-None engine as "ready"


class WorkerService:
    """One worker process: the socket loop around an :class:`Engine` (see the module docstring)."""

    def __init__(self, settings: Settings, log: Any | None = None, threads: int = 1) -> None:
        """``threads``: the CPU threads the worker started with (see threads.py)."""
        self.settings = settings
        self.govern_threads = thread_governor(settings, threads)
        self.log = log or structlog.get_logger()
        self.worker_id = f"worker-{socket.gethostname()}-{os.getpid()}"  # unique across the hosts that join
        self.incarnation = process_incarnation()
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, self.worker_id.encode())
        heartbeat(self.sock, settings.distributed.heartbeat_s, settings.distributed.heartbeat_timeout_s)
        self.endpoint = settings.endpoint("worker")
        self.loader = _Loader(settings)
        self.engine: Engine | None = None
        self.backlog: deque[list[bytes]] = deque()  # messages that came while a step awaited its masks

    @property
    def stage(self) -> str:
        if self.engine is not None:
            return "ready"
        return "failed" if self.loader.error is not None else "loading"

    def run(self) -> None:
        """Serve until interrupted."""
        # Every (re)connection gets a hello: a restarted scheduler learns of a ready worker at once.
        monitor = self.sock.get_monitor_socket(zmq.EVENT_CONNECTED | ClientHandshakes.EVENTS)
        handshakes = ClientHandshakes()
        connect(self.sock, self.endpoint, self.settings.curve)
        self.log.info("worker.start", worker_id=self.worker_id, endpoint=self.endpoint, model=self.settings.model)
        self.loader.start()
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        next_hello = time.monotonic() + LOADING_HELLO_INTERVAL_S
        heard = time.monotonic()  # when the scheduler last sent something
        try:
            while True:
                # Ready: block, but not past the silence that calls for a hello. Loading or failed: wake often
                # so completion and hellos are timely.
                timeout = 0 if self.backlog else SILENT_SCHEDULER_HELLO_S * 1000 if self.engine is not None else 100
                events = dict(poller.poll(timeout))
                if monitor in events:
                    self._on_connection_event(recv_monitor_message(monitor), handshakes)
                if self.backlog:
                    self._handle(self.backlog.popleft())
                elif self.sock in events:
                    heard = time.monotonic()
                    self._handle(self.sock.recv_multipart())
                if self.engine is not None:
                    if time.monotonic() - heard >= SILENT_SCHEDULER_HELLO_S:
                        self._hello()
                        heard = time.monotonic()
                    continue
                if self.loader.engine is not None:
                    self.engine = self.loader.engine
                    self.log.info("worker.ready", load_s=round(self.loader.seconds, 2), **msgspec.structs.asdict(self.engine.stats()))
                    self._hello()
                elif time.monotonic() >= next_hello:
                    self._hello()
                    failed = self.loader.error is not None
                    next_hello = time.monotonic() + (FAILED_HELLO_INTERVAL_S if failed else LOADING_HELLO_INTERVAL_S)
        except KeyboardInterrupt:
            self.log.info("worker.stop")
        finally:
            for follower in self.loader.followers:
                follower.terminate()
            self.sock.disable_monitor()
            monitor.close(0)
            self.sock.close(0)

    def _on_connection_event(self, event: dict, handshakes: ClientHandshakes) -> None:
        if handshakes.refused(event["event"]):  # keys that do not match
            reason = refused_by_server(event["event"], self.endpoint, self.settings.curve)
            self.log.error("worker.refused", endpoint=self.endpoint, reason=reason)
            raise SystemExit(f"worker: {reason}")
        if event["event"] & zmq.EVENT_CONNECTED:
            self._hello()

    def _hello(self) -> None:
        stage = self.stage
        if stage == "ready":
            assert self.engine is not None
            loaded = self.engine.loaded
            hello = wire.WorkerHello(
                worker_id=self.worker_id,
                stage="ready",
                progress=100,
                model=loaded.name,
                vocab_size=self.engine.vocab_size,
                max_model_len=self.engine.max_model_len,
                eos_token_ids=loaded.eos_token_ids,
                device=str(loaded.device),
                kv_capacity_tokens=self.engine.kv_capacity_tokens,
                hidden_size=loaded.config.get_text_config().hidden_size,
                num_layers=loaded.config.get_text_config().num_hidden_layers,
                readout_concepts=self.engine.readouts.concepts if self.engine.readouts else [],
                readout_layers=self.engine.readouts.layers if self.engine.readouts else [],
                forward=self.engine.backend,
                fallback_reason=self.engine.fallback_reason or "",
            )
        elif stage == "failed":
            hello = wire.WorkerHello(worker_id=self.worker_id, stage="failed", message=self.loader.error or "")
        else:
            hello = wire.WorkerHello(
                worker_id=self.worker_id,
                stage="loading",
                progress=min(self.loader.progress, 99),
                message=self.loader.message,
            )
        hello.incarnation, hello.wire_version = self.incarnation, wire.WIRE_VERSION
        self._send(hello)

    def _send(self, msg: wire.Msg) -> None:
        """Send without blocking: a DEALER whose only connection ZeroMQ dropped for good (a refused handshake,
        which it never retries) would block a send forever, before the monitor's event saying why is read."""
        try:
            self.sock.send(wire.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            self.log.warning("worker.send_dropped", type=type(msg).__name__, endpoint=self.endpoint,
                             note="no connection to the scheduler to queue it on")

    def _handle(self, parts: list[bytes]) -> None:
        try:
            msg = wire.decode(parts[0])
        except WireError as exc:
            self.log.warning("worker.malformed_frame", error=str(exc), parts=len(parts))
            return
        if isinstance(msg, wire.Step):
            self._send(self._run_step(msg, parts[1] if len(parts) > 1 else None))
        elif isinstance(msg, wire.Health):
            self._health(msg)
        elif isinstance(msg, wire.StepMasks):  # its step ended already (failed, or waited too long)
            self.log.warning("worker.stale_step_masks", step_id=msg.step_id)
        else:
            self.log.warning("worker.unexpected_message", type=type(msg).__name__)

    def _health(self, msg: wire.Health) -> None:
        health = wire.WorkerHealth(stage=self.stage, worker_id=self.worker_id, model=self.settings.model)
        if self.engine is not None:
            health.engine, health.device = self.engine.stats(), str(self.engine.device)
        elif self.loader.error is not None:
            health.message = self.loader.error
        else:
            health.progress, health.message = self.loader.progress, self.loader.message
        self._send(wire.HealthReply(mid=msg.mid, service="worker", ready=self.engine is not None, worker=health))
        self._hello()

    def _await_masks(self, step_id: int) -> tuple[wire.StepMasks, bytes | None] | None:
        """The StepMasks of ``step_id`` and its frame, or None when it does not come in time.
        Health is answered meanwhile; anything else waits in the backlog."""
        timeout_s = self.settings.limits.worker_step_timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(max(1, int(left * 1000))):
                return None
            parts = self.sock.recv_multipart()
            try:
                msg = wire.decode(parts[0])
            except WireError as exc:
                self.log.warning("worker.malformed_frame", error=str(exc), parts=len(parts))
                continue
            if isinstance(msg, wire.StepMasks) and msg.step_id == step_id:
                return msg, parts[1] if len(parts) > 1 else None
            if isinstance(msg, wire.Health):
                self._health(msg)
            else:
                self.backlog.append(parts)

    def _to_ranks(self, msg: wire.Msg, frame: bytes | None) -> None:
        """A tensor-parallel worker's other ranks run what rank 0 runs (see tensor_parallel)."""
        if self.loader.ranks is not None:
            self.loader.ranks.send([wire.encode(msg)] if frame is None else [wire.encode(msg), frame])

    def _run_step(self, step: wire.Step, mask_frame: bytes | None) -> wire.StepResult:
        if self.engine is None:
            reason = self.loader.error or "model is still loading"
            return _fail_all(step, f"model not available: {reason}")
        self.govern_threads()
        try:
            self._to_ranks(step, mask_frame)
            if not step.masks_follow:
                return self.engine.step(step, mask_frame)
            forwarded = self.engine.forward(step)
            masks = self._await_masks(step.step_id)
            if masks is None:
                timeout_s = self.settings.limits.worker_step_timeout_s
                self.log.warning("worker.step_masks_missing", step_id=step.step_id, timeout_s=timeout_s)
                message = f"the masks of step {step.step_id} (StepMasks) did not come within {timeout_s:g} s"
                self._to_ranks(wire.StepAbandon(step_id=step.step_id, reason=message), None)
                return self.engine.abandon(forwarded, message)
            self._to_ranks(*masks)
            return self.engine.sample_with(forwarded, *masks)
        except Exception as exc:  # a bug in one step fails that step only
            self.log.exception("worker.step_failed", step_id=step.step_id)
            self.engine.free(step.slot_ids())
            return _fail_all(step, f"internal error in step {step.step_id}: {type(exc).__name__}: {exc}")


def _fail_all(step: wire.Step, message: str) -> wire.StepResult:
    seq_ids = step.slot_ids()
    return wire.StepResult(
        mid=step.mid,
        step_id=step.step_id,
        tokens=wire.pack_tokens([-1] * len(seq_ids)),
        logprobs=wire.pack_logprobs([0.0] * len(seq_ids)),
        failures=[wire.SeqFailure(seq_id=seq_id, message=message) for seq_id in seq_ids],
    )
