"""The scheduler: admission, continuous batching and the step loop.

Gateways connect to the frontend ROUTER and submit requests; workers connect to the worker ROUTER,
announce themselves and execute one batched ``Step`` per message. Each loop iteration admits queued
requests, sends every worker one ``Step`` for its sequences, applies the sampled tokens (stop
conditions, detokenization, stop strings) and sends every gateway one ``Events`` message.

Steps are pipelined: up to ``limits.pipeline_depth`` steps are in flight, so a worker finds its next step
waiting when it finishes one. A decoding request in the step before gets a ``follow`` SeqStep (the
worker feeds the token it just sampled); when that token turns out to end the request (EOS, a stop
string), the one sampled after it is dropped.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import defaultdict, deque
from dataclasses import dataclass

import structlog
import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from common import wire
from common.config import Settings
from common.errors import (
    CONTEXT_LENGTH_EXCEEDED,
    ERROR_TRAITS,
    INTERNAL_ERROR,
    INVALID_REQUEST,
    MEMORY_PRESSURE,
    MODEL_LOADING_ERROR,
    SERVICE_UNAVAILABLE,
)
from common.incarnation import process_incarnation
from common.model_source import load_tokenizer
from common.sockets import Router, heartbeat, reply_mid
from common.textstream import TextStream
from services.scheduler.controllers import Branch, ControllerSteps, Plan
from services.scheduler.requests import LiveRequest, State
from services.scheduler.sessions import SessionKV
from services.scheduler.workers import WorkerInfo, WorkerPool

log = structlog.get_logger()

# How often a step waiting for its worker's result checks that the worker is still there.
STEP_CHECK_S = 0.1
# How often idle workers are pinged, and after how long without an answer they are dropped.
LIVENESS_PING_S = 2.0
LIVENESS_DEAD_S = 10.0


class WorkerLost(Exception):
    pass


@dataclass
class InFlight:
    """Steps sent together (one per worker) and their results to come."""

    steps: list[tuple[WorkerInfo, wire.Step, list[tuple[LiveRequest | Branch, wire.SeqStep]]]]
    results: asyncio.Future[list[wire.StepResult | None]]
    controlled: bool  # controlled sequences are in it: the next plan waits for its results


class Scheduler:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.incarnation = process_incarnation()
        self.limits = settings.limits
        self.tokenizer = load_tokenizer(settings)
        ctx = zmq.asyncio.Context.instance()
        self.frontend = Router(ctx, settings.endpoint("scheduler"))
        self.worker_router = Router(ctx, settings.endpoint("worker"))
        heartbeat(self.worker_router.sock, settings.distributed.heartbeat_s, settings.distributed.heartbeat_timeout_s)
        self.pool = WorkerPool()
        self.requests: dict[str, LiveRequest] = {}
        self.queue: list[LiveRequest] = []
        self.running: dict[int, LiveRequest] = {}  # seq_id -> request (running or paused)
        self.to_free: dict[bytes, list[int]] = defaultdict(list)
        self.gateways_seen: dict[bytes, float] = {}  # gateways that send heartbeats -> when last heard from
        self.outbox: dict[bytes, list[wire.TokenEvent]] = defaultdict(list)
        # tokens accepted from the last step whose text is worked out while the next one runs
        self.deferred: list[tuple[LiveRequest, wire.TokenEvent]] = []
        self.wake = asyncio.Event()
        self.orders = itertools.count()
        self.seq_ids = itertools.count(1)
        self.step_ids = itertools.count(1)
        self.controllers = ControllerSteps(self)  # requests with a controller; the main channel
        self.sessions = SessionKV(settings.sessions, self.pool, lambda worker, seq_id: self.to_free[worker].append(seq_id))

    # ------------------------------------------------------------------------------------------
    # model facts, from the first ready worker

    def _model_facts(self) -> wire.WorkerHello | None:
        ready = self.pool.ready()
        return ready[0].hello if ready else None

    def _max_model_len(self) -> int:
        facts = self._model_facts()
        return facts.max_model_len if facts else self.limits.max_model_len

    # ------------------------------------------------------------------------------------------
    # frontend

    async def serve_frontend(self) -> None:
        while True:
            gateway, msg, _ = await self.frontend.recv()
            if gateway in self.gateways_seen or isinstance(msg, wire.GatewayAlive):
                self.gateways_seen[gateway] = time.monotonic()
            try:
                reply = await self._handle_frontend(gateway, msg)
            except Exception as exc:  # a bug handling one message must not stop the scheduler
                log.exception("scheduler.frontend_failed", type=type(msg).__name__)
                reply = wire.Error(code=INTERNAL_ERROR, message=f"scheduler failed: {exc}")
            reply.mid = reply_mid(msg)
            await self.frontend.send(gateway, reply)
            self._flush_events()

    async def _handle_frontend(self, gateway: bytes, msg: wire.Message) -> wire.Msg:
        if isinstance(msg, wire.Submit):
            return self._submit(gateway, msg)
        if isinstance(msg, wire.Health):
            return await self._health()
        if isinstance(msg, wire.GatewayAlive):
            return wire.Alive(service="scheduler", incarnation=self.incarnation)
        if isinstance(msg, wire.SessionDrop):
            for request in [r for r in self.requests.values() if r.submit.session and r.submit.session.key == msg.key]:
                self._finish(request, "cancelled", park=False)
            self.sessions.drop(msg.key)
            return wire.Ok()
        if isinstance(msg, (wire.Cancel, wire.Pause, wire.Resume, wire.Modify)):
            request = self.requests.get(msg.rid)
            if request is None or request.gateway != gateway:
                return wire.Error(code=INVALID_REQUEST, message=f"no live request {msg.rid!r}", rid=msg.rid)
            return self._control(request, msg)
        return wire.Error(code=INVALID_REQUEST, message=f"the scheduler does not take {type(msg).__name__} messages")

    def _submit(self, gateway: bytes, submit: wire.Submit) -> wire.Msg:
        def refuse(code: str, message: str) -> wire.Error:
            return wire.Error(code=code, message=message, rid=submit.rid)

        if submit.rid in self.requests:
            return refuse(INVALID_REQUEST, f"request id {submit.rid!r} is already live")
        if not submit.prompt_ids:
            return refuse(INVALID_REQUEST, "the prompt has no tokens")
        facts = self._model_facts()
        if facts is None and self.pool.summary()["stage"] == "failed":
            return refuse(MODEL_LOADING_ERROR, f"the model failed to load: {self.pool.summary()['message']}")
        if facts is not None and not all(0 <= t < facts.vocab_size for t in submit.prompt_ids):
            return refuse(INVALID_REQUEST, f"prompt token ids must lie in [0, {facts.vocab_size})")
        max_len = self._max_model_len()
        prefill_only = submit.max_tokens == 0  # scoring: feed the prompt, generate nothing
        if len(submit.prompt_ids) + (0 if prefill_only else 1) > max_len:
            return refuse(
                CONTEXT_LENGTH_EXCEEDED,
                f"the prompt has {len(submit.prompt_ids)} tokens; the context holds {max_len} "
                "including at least one generated token",
            )
        if submit.max_tokens < 0:
            return refuse(INVALID_REQUEST, "max_tokens must be >= 0 (0: prefill only)")
        if len(self.queue) >= self.limits.max_queued:
            return refuse(MEMORY_PRESSURE, f"{len(self.queue)} requests are already waiting; try again shortly")
        submit.max_tokens = min(submit.max_tokens, max_len - len(submit.prompt_ids))
        if facts is not None and facts.kv_capacity_tokens:
            # a request larger than a worker's whole KV pool could never be admitted
            submit.max_tokens = min(submit.max_tokens, facts.kv_capacity_tokens - len(submit.prompt_ids))
            if submit.max_tokens < (0 if prefill_only else 1):
                return refuse(CONTEXT_LENGTH_EXCEEDED, f"the prompt does not fit the KV cache ({facts.kv_capacity_tokens} tokens)")
        timeout = submit.timeout_s if submit.timeout_s > 0 else self.limits.request_timeout_s
        request = LiveRequest(
            submit=submit,
            gateway=gateway,
            order=next(self.orders),
            text=TextStream(self.tokenizer, stop=list(submit.stop)),
            deadline=time.monotonic() + timeout,
        )
        self.requests[submit.rid] = request
        self.queue.append(request)
        self.wake.set()
        structlog.contextvars.bind_contextvars(request_id=submit.rid)
        log.info("scheduler.submitted", prompt_tokens=len(submit.prompt_ids), max_tokens=submit.max_tokens)
        structlog.contextvars.unbind_contextvars("request_id")
        return wire.Ok(data={"queued": len(self.queue)})

    def _control(self, request: LiveRequest, msg: wire.Msg) -> wire.Msg:
        if isinstance(msg, wire.Cancel):
            self._finish(request, "cancelled")
        elif isinstance(msg, wire.Pause):
            request.paused = True
        elif isinstance(msg, wire.Resume):
            request.paused = False
            self.wake.set()
        elif isinstance(msg, wire.Modify):
            request.apply_patch(msg.patch)
            if request.state is not State.QUEUED:
                request.submit.max_tokens = min(request.submit.max_tokens, self._max_model_len() - len(request.prompt))
                if len(request.generated) >= request.submit.max_tokens:
                    self._finish(request, "length")
        return wire.Ok(data={"state": request.state.value, "paused": request.paused})

    async def _health(self) -> wire.HealthReply:
        facts = self._model_facts()
        controller = await self.controllers.ping()
        detail = {
            "worker": self.pool.summary(),
            "model": self.settings.served_model_name,
            "vocab_size": facts.vocab_size if facts else 0,
            "max_model_len": self._max_model_len(),
            "eos_token_ids": facts.eos_token_ids if facts else [],
            "kv_capacity_tokens": sum(w.capacity for w in self.pool.ready()),
            # free KV as the workers' last steps left it (a worker with no step yet: all of it)
            "kv_free_tokens": sum(w.capacity if w.kv_free_tokens is None else w.kv_free_tokens
                                  for w in self.pool.ready()),
            # KV promised to admitted requests and parked sessions: what admission control counts
            "kv_reserved_tokens": sum(w.reserved_tokens for w in self.pool.ready()),
            "queued": len(self.queue),
            "running": len(self.running),
            "paused": sum(1 for r in self.requests.values() if r.paused),
            "controller_runtime": controller,
            "controller_steps": self.controllers.stats(),
            "hidden_size": facts.hidden_size if facts else 0,
            "readout_concepts": facts.readout_concepts if facts else [],
            "readout_layers": facts.readout_layers if facts else [],
            **self.sessions.summary(),
        }
        return wire.HealthReply(service="scheduler", ready=facts is not None and controller == "ok", detail=detail,
                                incarnation=self.incarnation)

    # ------------------------------------------------------------------------------------------
    # workers

    async def serve_workers(self) -> None:
        while True:
            identity, msg, _ = await self.worker_router.recv()
            self.pool.touch(identity)
            if isinstance(msg, wire.WorkerHello):
                known = self.pool.workers.get(identity)
                if known is not None and known.hello.incarnation != msg.incarnation:
                    self._lose_worker(known, "the worker restarted")
                    known = None
                changed = known is None or (known.hello.stage, known.hello.progress) != (msg.stage, msg.progress)
                info = self.pool.on_hello(identity, msg)
                if changed:
                    log.info("scheduler.worker", worker=identity.decode(errors="replace"), stage=msg.stage,
                             progress=msg.progress, message=msg.message)
                if info.ready:
                    self.wake.set()
            elif isinstance(msg, wire.StepResult):
                worker = self.pool.workers.get(identity)
                if worker and msg.kv_free_tokens >= 0:
                    worker.kv_free_tokens = msg.kv_free_tokens
                waiting = worker.in_flight.get(msg.step_id) if worker else None
                if waiting is not None and not waiting.done():
                    waiting.set_result(msg)
            elif isinstance(msg, wire.HealthReply):
                pass  # touch() above was the point
            else:
                log.warning("scheduler.worker_unexpected", type=type(msg).__name__)

    async def watch_worker_disconnects(self) -> None:
        """A dropped worker connection makes every worker suspect until it answers again."""
        monitor = self.worker_router.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        while True:
            await recv_monitor_message(monitor)
            now = time.monotonic()
            for worker in self.pool.workers.values():
                worker.suspect_since = now
                if not worker.in_flight:
                    await self.worker_router.send(worker.identity, wire.Health())

    async def check_liveness(self) -> None:
        while True:
            await asyncio.sleep(LIVENESS_PING_S / 4)
            now = time.monotonic()
            for worker in list(self.pool.workers.values()):
                if worker.in_flight:
                    continue
                silent = now - worker.last_seen
                suspect = worker.suspect_since is not None and now - worker.suspect_since > self.limits.peer_suspect_grace_s
                if suspect or silent > LIVENESS_DEAD_S:
                    self._lose_worker(worker, "the worker stopped answering")
                elif silent > LIVENESS_PING_S:
                    await self.worker_router.send(worker.identity, wire.Health())
            self._expire_deadlines()
            self._expire_gateways()
            self.sessions.expire()
            self._flush_events()

    def _expire_gateways(self) -> None:
        """Cancel the requests of a gateway whose heartbeats stopped: it died with them (a gateway with
        nothing to stream is silent too, and simply stops being watched until its next heartbeat)."""
        cutoff = time.monotonic() - self.limits.gateway_silence_s
        for gateway, seen in list(self.gateways_seen.items()):
            if seen >= cutoff:
                continue
            del self.gateways_seen[gateway]
            orphans = [r for r in self.requests.values() if r.gateway == gateway]
            if orphans:
                log.warning("scheduler.gateway_lost", gateway=gateway.hex(), requests=len(orphans))
            for request in orphans:
                self._finish(request, "cancelled")

    def _lose_worker(self, worker: WorkerInfo, reason: str) -> None:
        log.warning("scheduler.worker_lost", worker=worker.identity.decode(errors="replace"), reason=reason)
        self.pool.drop(worker.identity)
        self.to_free.pop(worker.identity, None)
        self.sessions.drop_worker(worker.identity)
        for request in list(self.running.values()):
            if request.worker == worker.identity:
                self._fail(request, SERVICE_UNAVAILABLE, f"{reason}; the request was lost, retry it")

    # ------------------------------------------------------------------------------------------
    # the step loop

    async def step_loop(self) -> None:
        in_flight: deque[InFlight] = deque()
        while True:
            self._expire_deadlines()
            self._admit()
            sent = False
            if len(in_flight) < self.limits.pipeline_depth:
                plan = Plan()
                if not any(f.controlled for f in in_flight):
                    plan = await self.controllers.plan(self.running.values(), self.limits.step_token_budget)
                steps = self._build_steps(plan)
                if steps:
                    results = asyncio.gather(*(self._run_step(worker, step) for worker, step, _ in steps))
                    in_flight.append(InFlight(steps, results, controlled=bool(plan.per_worker)))
                    sent = True
                    await asyncio.sleep(0)  # one turn of the loop sends them
            if not in_flight:
                self._emit_deferred()
                self.controllers.flush()
                self._flush_events()
                self.wake.clear()
                try:
                    await asyncio.wait_for(self.wake.wait(), timeout=0.25)
                except asyncio.TimeoutError:
                    pass
                continue
            if sent and len(in_flight) < self.limits.pipeline_depth:
                continue  # queue the step after it at once
            # The text of the tokens applied last is worked out while the workers compute.
            self._emit_deferred()
            self._flush_events()
            oldest = in_flight.popleft()
            for (worker, _, batch), result in zip(oldest.steps, await oldest.results):
                if result is not None:
                    self._apply(worker, batch, result)
            self.controllers.flush()
            self._flush_events()

    def _admit(self) -> None:
        if not self.queue:
            return
        self.queue.sort(key=lambda r: r.sort_key)
        admitted: list[LiveRequest] = []
        for request in self.queue:
            if len(self.running) >= self.limits.max_batch_size:
                break
            if request.paused:
                continue
            placement = self.sessions.place(request, request.needed_tokens)
            if placement is None:
                break  # keep priority order: nothing behind it jumps the queue
            worker = placement.worker
            request.state = State.RUNNING
            request.seq_id = placement.seq_id if placement.seq_id is not None else next(self.seq_ids)
            request.fork_of, request.backtrack = placement.fork_of, placement.backtrack
            request.fed = request.applied = request.cached_tokens = placement.start
            request.kv_tokens = list(placement.held or [])
            request.worker = worker.identity
            request.reserved = request.needed_tokens
            worker.reserved_tokens += request.reserved
            self.running[request.seq_id] = request
            admitted.append(request)
        if admitted:
            self.queue = [r for r in self.queue if r.state is State.QUEUED]

    def _build_steps(self, controlled: Plan) -> list[tuple[WorkerInfo, wire.Step, list[tuple[LiveRequest | Branch, wire.SeqStep]]]]:
        budget = self.limits.step_token_budget - controlled.tokens
        per_worker: dict[bytes, list[tuple[LiveRequest | Branch, wire.SeqStep]]] = defaultdict(list)
        for identity, items in controlled.per_worker.items():
            per_worker[identity] += [(b, s) for b, s in items if b.finished is None and b.request.state is State.RUNNING]
        # decoding sequences first (one token each), then prompt chunks within the token budget
        max_len = self._max_model_len()
        ordered = sorted(
            (r for r in self.running.values() if not r.paused and not r.submit.controller and self._steppable(r, max_len)),
            key=lambda r: (r.fed < len(r.prompt), r.sort_key),
        )
        for request in ordered:
            if budget <= 0:
                break
            if request.in_flight and request.last_sample:  # decoding in the step before: feed its sample
                seq = wire.SeqStep(seq_id=request.seq_id, tokens=[], follow=True)
                budget -= 1
            else:
                prefill = request.fed < len(request.prompt)
                tokens, sample = request.next_feed(min(self.limits.prefill_chunk_tokens, budget))
                budget -= len(tokens)
                seq = wire.SeqStep(seq_id=request.seq_id, tokens=tokens, sample=sample, images=request.images_in(tokens))
                self._session_feed(request, seq)
                if prefill:
                    request.fed += len(tokens)
            if request.sampling_dirty:
                seq.sampling = request.submit.sampling
                request.sampling_dirty = False
            request.in_flight += 1
            request.last_sample = seq.sample
            per_worker[request.worker].append((request, seq))
        steps = []
        for identity in set(per_worker) | {i for i, seqs in self.to_free.items() if seqs}:
            worker = self.pool.workers.get(identity)
            if worker is None:
                continue
            batch = per_worker.get(identity, [])
            step = wire.Step(step_id=next(self.step_ids), seqs=[s for _, s in batch], free=self.to_free.pop(identity, []),
                             free_all=worker.fresh)
            worker.fresh = False
            steps.append((worker, step, batch))
        return steps

    def _steppable(self, request: LiveRequest, max_len: int) -> bool:
        """Whether a plain request may go into the step being built. With a step of it in flight, only
        a prompt chunk that does not sample, or a ``follow`` of a decoding step whose token will not be
        its last (a session turn never follows: the KV it keeps must hold exactly its tokens)."""
        if not request.in_flight:
            return True
        if request.in_flight > 1 or (request.fed >= len(request.prompt) and not request.last_sample):
            return False
        if not request.last_sample:
            return True
        after = len(request.generated) + 1  # tokens once the step in flight is applied
        return (request.submit.session is None and after < request.submit.max_tokens
                and len(request.prompt) + after < max_len)

    async def _run_step(self, worker: WorkerInfo, step: wire.Step) -> wire.StepResult | None:
        done = worker.in_flight[step.step_id] = asyncio.get_running_loop().create_future()
        deadline = time.monotonic() + self.limits.worker_step_timeout_s
        try:
            step.masks_follow = self.controllers.awaits_masks(step)
            await self.worker_router.send(worker.identity, step)
            if step.masks_follow:  # the controllers' mid_process runs while the worker computes the forward pass
                await self.worker_router.send(worker.identity, *await self.controllers.step_masks(step))
            while True:
                try:
                    return await asyncio.wait_for(asyncio.shield(done), timeout=STEP_CHECK_S)
                except asyncio.TimeoutError:
                    now = time.monotonic()
                    suspect = worker.suspect_since is not None and now - worker.suspect_since > self.limits.peer_suspect_grace_s
                    if now > deadline or suspect or worker.identity not in self.pool.workers:
                        raise WorkerLost("the worker died or did not finish its step in time")
        except WorkerLost as exc:
            self._lose_worker(worker, str(exc))
            return None
        finally:
            worker.in_flight.pop(step.step_id, None)

    def _apply(self, worker: WorkerInfo, batch: list[tuple[LiveRequest | Branch, wire.SeqStep]], result: wire.StepResult) -> None:
        failures = {f.seq_id: f.message for f in result.failures}
        eos = set(worker.hello.eos_token_ids)
        max_len = self._max_model_len()
        for request, seq in batch:
            if isinstance(request, Branch):
                self.controllers.apply(request, seq, result, max_len)
                continue
            request.in_flight -= 1
            if seq.fork_of is not None:
                self.sessions.forked(seq.fork_of)
            if request.state is State.FINISHED:  # cancelled while its step ran
                if seq.seq_id in failures:
                    self.sessions.failed(seq.seq_id)
                continue
            if seq.seq_id in failures:
                self._fail(request, INTERNAL_ERROR, f"the worker failed this sequence: {failures[seq.seq_id]}")
                continue
            if request.applied < len(request.prompt):
                self._prompt_outputs(request, seq, result)
                request.cached_tokens += result.cached_tokens.get(seq.seq_id, 0)
                request.applied += len(seq.tokens)
                if request.submit.max_tokens == 0 and request.applied == len(request.prompt):
                    self._finish(request, "length")
            else:
                request.pending = None
                self._decoded_readouts(request, seq, result)
            if not seq.sample:
                continue
            sampled = result.samples.get(seq.seq_id)
            if sampled is None:
                self._fail(request, INTERNAL_ERROR, "the worker returned no token for this sequence")
                continue
            self._on_token(request, sampled, eos, max_len)

    def _on_token(self, request: LiveRequest, sampled: wire.SampledToken, eos: set[int], max_len: int) -> None:
        token = sampled.token_id
        request.generated.append(token)
        request.pending = token
        submit = request.submit
        event = wire.TokenEvent(rid=request.rid, tokens=[sampled])
        if token in submit.stop_token_ids or (token in eos and not submit.ignore_eos):
            self._finish(request, "stop", event, stop_reason=token)
        elif len(request.generated) >= submit.max_tokens or len(request.prompt) + len(request.generated) >= max_len:
            self._emit_text(request, event, last=True)
        else:
            # Decoding goes on: its text (detokenizing, stop strings) is worked out once the next
            # step is on its way. A stop string found then ends the request, and the token that
            # step samples for it is dropped.
            self.deferred.append((request, event))

    def _emit_text(self, request: LiveRequest, event: wire.TokenEvent, last: bool) -> None:
        """The text of a token event; finish on a completed stop string, or when it was the ``last``."""
        event.text = request.text.push([event.tokens[0].token_id])
        if request.text.stopped_by is not None:
            self._finish(request, "stop", event, stop_reason=request.text.stopped_by)
        elif last:
            self._finish(request, "length", event)
        else:
            self.outbox[request.gateway].append(event)

    def _emit_deferred(self) -> None:
        deferred, self.deferred = self.deferred, []
        for request, event in deferred:
            if request.state is not State.FINISHED:  # it may have been cancelled or failed since
                self._emit_text(request, event, last=False)

    def _emit_deferred_of(self, request: LiveRequest) -> None:
        """Work out a request's deferred token text now (before it ends for another reason)."""
        for i, (deferred, event) in enumerate(self.deferred):
            if deferred is request:
                del self.deferred[i]
                self._emit_text(request, event, last=False)
                return

    def _finish(
        self,
        request: LiveRequest,
        reason: str,
        event: wire.TokenEvent | None = None,
        stop_reason: str | int | None = None,
        *,
        park: bool = True,
    ) -> None:
        """End ``request`` with ``reason``; a session turn's KV is parked for the next turn unless
        ``park`` is false (or the turn timed out)."""
        if request.state is State.FINISHED:
            return
        self._emit_deferred_of(request)
        if request.state is State.FINISHED:  # its deferred text completed a stop string
            return
        event = event or wire.TokenEvent(rid=request.rid)
        if reason != "stop" or isinstance(stop_reason, int):
            event.text += request.text.flush()
        event.finish_reason = reason
        event.stop_reason = stop_reason
        event.prompt_tokens = len(request.prompt)
        event.completion_tokens = len(request.generated)
        event.cached_tokens = request.cached_tokens
        self.outbox[request.gateway].append(event)
        self._release(request, park=park and reason != "timeout")
        structlog.contextvars.bind_contextvars(request_id=request.rid)
        log.info("scheduler.finished", reason=reason, completion_tokens=len(request.generated))
        structlog.contextvars.unbind_contextvars("request_id")

    def _fail(self, request: LiveRequest, code: str, message: str) -> None:
        if request.state is State.FINISHED:
            return
        recoverable, action, _ = ERROR_TRAITS[code]
        self._release(request)
        self._flush_events()
        asyncio.get_running_loop().create_task(
            self.frontend.send(
                request.gateway,
                wire.RequestFailed(rid=request.rid, code=code, message=message, recoverable=recoverable,
                                   recovery_action=action),
            )
        )

    def _release(self, request: LiveRequest, park: bool = False) -> None:
        """End a request; a finished session turn's sequence is parked for the next turn (``park``)."""
        if request.state is State.QUEUED:
            self.queue.remove(request)
        elif request.seq_id in self.running:
            del self.running[request.seq_id]
            if request.fork_of is not None:  # its fork step was never sent
                self.sessions.forked(request.fork_of)
            worker = self.pool.workers.get(request.worker)
            if worker is not None:
                worker.reserved_tokens -= request.reserved
                if not (park and self.sessions.park(request, worker)):
                    self.to_free[request.worker].append(request.seq_id)
        request.state = State.FINISHED
        self.requests.pop(request.rid, None)
        if request.submit.controller:
            self.controllers.release(request)
        self.wake.set()

    def _session_feed(self, request: LiveRequest, seq: wire.SeqStep) -> None:
        """Session-turn parts of a SeqStep: the first one's fork/backtrack of a parked sequence,
        the per-position outputs of the prompt positions it feeds; and what the sequence will hold."""
        if request.fork_of is not None or request.backtrack:
            seq.fork_of, seq.backtrack = request.fork_of, request.backtrack
            request.fork_of, request.backtrack = None, 0
        del request.kv_tokens[len(request.kv_tokens) - seq.backtrack :]
        request.kv_tokens += seq.tokens
        request.on_worker = True
        if request.fed >= len(request.prompt):  # decoding: the token fed is the last one sampled
            position = len(request.prompt) + len(request.generated) - 1
            seq.readouts = [position] if position in request.readout_positions else []
            return
        if not (request.logprob_positions or request.readout_positions):
            return
        prompt, start = request.prompt, request.fed
        fed = range(start, start + len(seq.tokens))
        seq.scores = [wire.ScoreQuery(q, prompt[q + 1]) for q in fed if q + 1 in request.logprob_positions
                      and q + 1 < len(prompt)]
        seq.readouts = [p for p in fed if p in request.readout_positions]
        if seq.scores and request.submit.outputs is not None:
            seq.top_logprobs = request.submit.outputs.top_logprobs

    def _prompt_outputs(self, request: LiveRequest, seq: wire.SeqStep, result: wire.StepResult) -> None:
        """One event with the outputs of the prompt positions this step fed and were asked about."""
        if not (request.logprob_positions or request.readout_positions):
            return
        for score in result.scores.get(seq.seq_id, []):
            request.scored[score.position + 1] = score
        readouts = {r.position: r.values for r in result.readouts.get(seq.seq_id, [])}
        outputs = []
        for p in range(request.applied, request.applied + len(seq.tokens)):
            if p not in request.logprob_positions and p not in request.readout_positions:
                continue
            out = wire.PositionOutput(position=p, token_id=request.prompt[p], readout=readouts.get(p, b""))
            score = request.scored.pop(p, None)
            if score is not None:
                out.logprob, out.top = score.logprob, score.top
            outputs.append(out)
        if outputs:
            self.outbox[request.gateway].append(wire.TokenEvent(rid=request.rid, prompt_outputs=outputs))

    def _decoded_readouts(self, request: LiveRequest, seq: wire.SeqStep, result: wire.StepResult) -> None:
        """The readout of a decoded token, computed by the step that fed it (the one after its sampling),
        as an event of its own (a ``PositionOutput`` past the prompt)."""
        outputs = [wire.PositionOutput(position=r.position, token_id=seq.tokens[0], readout=r.values)
                   for r in result.readouts.get(seq.seq_id, [])]
        if outputs:
            self.outbox[request.gateway].append(wire.TokenEvent(rid=request.rid, prompt_outputs=outputs))

    def _expire_deadlines(self) -> None:
        now = time.monotonic()
        for request in list(self.requests.values()):
            if now > request.deadline:
                self._finish(request, "timeout")

    def _flush_events(self) -> None:
        if not self.outbox:
            return
        outbox, self.outbox = self.outbox, defaultdict(list)
        loop = asyncio.get_running_loop()
        for gateway, events in outbox.items():
            loop.create_task(self.frontend.send(gateway, wire.Events(events=events)))

    async def run(self) -> None:
        log.info("scheduler.listening", frontend=self.frontend.endpoint, workers=self.worker_router.endpoint)
        await asyncio.gather(
            self.serve_frontend(),
            self.serve_workers(),
            self.step_loop(),
            self.check_liveness(),
            self.watch_worker_disconnects(),
        )
