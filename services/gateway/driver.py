"""The generation driver: one request from admission to its last message, for every surface.

:meth:`Generation.stream` yields the protocol's server messages: an ``error`` (refused before it
started), or ``init``, ``status`` while the model loads, ``token`` per generated token, and a final
``completion`` or ``error``. Control actions (stop, pause, resume, modify) act on it meanwhile.
Whatever way the consumer leaves (client gone, task cancelled), the scheduler's sequence is freed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import structlog

from common import wire
from common.admission import context_budget
from common.errors import (
    CONTENT_FILTER,
    ERROR_TRAITS,
    INTERNAL_ERROR,
    INVALID_REQUEST,
    MODEL_LOADING_ERROR,
    SERVICE_UNAVAILABLE,
    TIMEOUT,
    TillerError,
)
from common.wire import Principal
from services.gateway.admission import COMPLETED, Admission
from services.gateway.deps import Gateway
from services.gateway.steering import resolve_steering
from services.gateway.scheduler_client import HEALTH_MAX_AGE_S, StreamItem, facts_of, worker_stage
from services.gateway.protocol import (
    CompletionMsg,
    ErrorMsg,
    GatewayError,
    InitMsg,
    LogprobEntry,
    OutputOptions,
    ServerMsg,
    StatusMsg,
    TokenMsg,
    Usage,
)
from services.gateway.tenants import Tenant, cache_domain
from services.gateway.validation import GenerationRequest, ParametersPatch

log = structlog.get_logger()

LOADING_POLL_S = 1.0
# How long past limits.request_timeout_s the gateway waits on a silent scheduler (which should have
# ended the request with "timeout" itself) before giving up on it.
STALL_GRACE_S = 10.0


class Phase(enum.Enum):
    """Where a generation is; control actions and cleanup depend on it."""

    PREPARING = "preparing"  # validating, tokenizing, starting its controller (moments)
    LOADING = "loading"  # waiting for the model (as long as it loads)
    RUNNING = "running"  # submitted to the scheduler
    DONE = "done"  # its final message is out


class _Resumed:
    """Put in a paused generation's event queue when it resumes: the events held meanwhile go out."""


RESUMED = _Resumed()


class Generation:
    def __init__(
        self, gw: Gateway, request: GenerationRequest, *, rid: str, surface: str, client: str, tenant: Tenant,
        caller: Principal | None = None,
    ) -> None:
        self.rid = rid
        self.request = request  # with modifications applied: what ``regenerate`` runs again
        self.surface = surface
        self.caller = caller  # who runs the request's controller (``$auth``), when it has one
        self._gw = gw
        self._client = client
        self.tenant = tenant  # whose request it is (its record's owner, its rate limit, its cache domain)
        self._phase = Phase.PREPARING
        self._prepared = asyncio.Event()  # set once the phase is past PREPARING
        self._queue: asyncio.Queue[StreamItem | _Resumed] | None = None  # the scheduler's events, once submitted
        self._paused = False  # paused by the client: events are held until it resumes
        self._initialized = False
        self._stop_requested = False
        self._filtered = False
        self._started = time.monotonic()
        self._first_token_at: float | None = None
        self._last_token_at: float | None = None
        self._prompt_len = 0
        self._max_model_len = 0
        self._echo = ""
        self._text = ""  # generated text released so far
        self._tokens = 0  # tokens generated so far
        self._final: wire.TokenEvent | None = None
        # with request.prompt_logprobs: per prompt position, its token and alternatives, as the
        # scheduler reports them (before the first generated token)
        self.prompt_entries: list[list[LogprobEntry]] = []
        self.embedding = b""  # with request.pooling: the pooled vector (common.pooling.vector_bytes), once finished
        self.residual = b""  # with request.residual_layers: the last prompt position's (PositionOutput.residual)

    @property
    def initialized(self) -> bool:
        """Whether ``init`` went out (the request exists under ``rid``)."""
        return self._initialized

    @property
    def finished(self) -> bool:
        return self._phase is Phase.DONE

    @property
    def usage(self) -> Usage:
        """The scheduler's final counts when it sent them, else the gateway's own."""
        final = self._final
        return Usage(
            (final.prompt_tokens if final else 0) or self._prompt_len,
            (final.completion_tokens if final else 0) or self._tokens,
            final.cached_tokens if final else 0,
        )

    # -- the stream ---------------------------------------------------------------------------

    async def stream(self) -> AsyncIterator[ServerMsg]:
        gw = self._gw
        structlog.contextvars.bind_contextvars(request_id=self.rid)
        self._started = time.monotonic()
        self._admission = Admission(gw, rid=self.rid, surface=self.surface, client=self._client, tenant=self.tenant)
        outcome = "cancelled"  # unless a final message says otherwise: the consumer left
        try:
            try:
                async for msg in self._run():
                    if isinstance(msg, CompletionMsg | ErrorMsg):
                        self._enter(Phase.DONE)
                        outcome = msg.finish_reason if isinstance(msg, CompletionMsg) else msg.code
                    yield msg
            except Exception as exc:  # a bug or a broken peer socket: answer, never drop the client silently
                log.exception("request.failed")
                if self._phase is not Phase.DONE:
                    self._enter(Phase.DONE)
                    outcome = INTERNAL_ERROR
                    error = TillerError(INTERNAL_ERROR, f"the gateway failed this request: {exc}")
                    yield ErrorMsg.from_error(error, self.rid if self._initialized else None, self._partial())
        finally:
            if self._phase is Phase.RUNNING:
                gw.scheduler.cancel_soon(self.rid)
            self._enter(Phase.DONE)
            gw.scheduler.close_stream(self.rid)
            usage = self.usage
            elapsed = self._admission.end(outcome, text=self._text, prompt_tokens=usage.prompt_tokens,
                                          completion_tokens=usage.completion_tokens)
            log.info(
                "request.end",
                surface=self.surface,
                outcome=outcome,
                prompt_tokens=usage.prompt_tokens,
                completion_tokens=usage.completion_tokens,
                total_ms=round(elapsed * 1000, 1),
            )

    async def _run(self) -> AsyncIterator[ServerMsg]:
        gw = self._gw
        try:
            prompt_text, prompt_ids = await gw.text.prompt(self.request)
            await self._admission.admit(self.request.written_text(prompt_text))
            health = await gw.scheduler.health(max_age=HEALTH_MAX_AGE_S)
            facts = facts_of(health)
            self._max_model_len = facts.max_model_len or gw.settings.limits.max_model_len
            self._check_logit_bias(facts.vocab_size)
            max_tokens = context_budget(
                len(prompt_ids), self.request.max_tokens, self._max_model_len,
                self.request.default_max_tokens or gw.settings.limits.default_max_tokens,
            )
            steering, vectors = await resolve_steering(gw, self.request.steering, self.tenant.principal)
            if self.request.controller:
                await self._instantiate(prompt_ids)
        except TillerError as exc:
            yield ErrorMsg.from_error(exc)
            return

        self._prompt_len = len(prompt_ids)
        self._echo = prompt_text if self.request.echo else ""
        self._initialized = True
        model_info = {"max_tokens": self._max_model_len, "vocab_size": facts.vocab_size or None}
        yield InitMsg(self.rid, gw.settings.served_model_name, model_info, prompt_text)
        self._admission.record(prompt=prompt_text, params=self.request.record())
        log.info("request.start", surface=self.surface, prompt_tokens=self._prompt_len, max_tokens=max_tokens)

        try:
            async for status in self._wait_for_model(health):
                yield status
            if self._stop_requested:
                yield self._completion("cancelled")
                return
            queue = self._queue = gw.scheduler.open_stream(self.rid)  # type: ignore[assignment]
            self._enter(Phase.RUNNING)
            await gw.scheduler.submit(
                wire.Submit(
                    rid=self.rid,
                    prompt=wire.pack_tokens(prompt_ids),
                    sampling=self._sampling(prompt_ids, facts),
                    max_tokens=max_tokens,
                    stop=list(self.request.stop),
                    include_stop_str=self.request.include_stop_str,
                    skip_special_tokens=self.request.skip_special_tokens,
                    priority=self.request.priority,
                    stop_token_ids=list(self.request.stop_token_ids),
                    ignore_eos=self.request.ignore_eos,
                    timeout_s=gw.settings.limits.request_timeout_s,
                    controller=self.rid if self.request.controller else "",
                    session=self._session(),
                    outputs=self._prompt_scoring(prompt_ids),
                    cache_domain=cache_domain(self.tenant, self.request.cache_salt, gw.settings, steering),
                    tenant=self.tenant.user,
                    steering=steering,
                    steering_vectors=vectors,
                )
            )
            async for msg in self._consume(queue):
                yield msg
        except TillerError as exc:
            yield ErrorMsg.from_error(exc, self.rid, self._partial())

    async def _instantiate(self, prompt_ids: list[int]) -> None:
        """Start the request's controller in the runtime under this request's id (the AICI runtime protocol's ``instantiate``)."""
        side = self._gw.side
        if side is None or self.caller is None:
            raise GatewayError(INVALID_REQUEST, "controllers are not available on this surface", param="controller")
        assert self.request.controller is not None
        await side.instantiate(self.caller, self.rid, prompt_ids, self.request.controller, self.request.controller_arg)

    async def _wait_for_model(self, health: wire.HealthReply) -> AsyncIterator[StatusMsg]:
        """``status: model_loading`` every poll until the worker is ready; its failure is an error."""
        limits = self._gw.settings.limits
        timeout = limits.request_timeout_s
        first: tuple[float, int] | None = None  # (time, progress) of the first poll, for the ETA
        absent_since: float | None = None
        while not self._stop_requested:
            worker = worker_stage(health)
            stage = worker.stage
            if stage == "ready":
                return
            self._enter(Phase.LOADING)
            if stage == "failed":
                raise TillerError(
                    MODEL_LOADING_ERROR, f"the model failed to load: {worker.message or 'no detail given'}"
                )
            now = time.monotonic()
            absent_since = (absent_since or now) if stage == "absent" else None
            if absent_since is not None and now - absent_since > limits.worker_absent_s:
                raise TillerError(SERVICE_UNAVAILABLE, f"no model worker has been connected for "
                                  f"{limits.worker_absent_s:g} s; retry later")
            if now - self._started > timeout:
                raise TillerError(TIMEOUT, f"the model was still loading after {timeout:.0f} s")
            progress = worker.progress
            first = first or (now, progress)
            eta = None
            if progress > first[1]:
                eta = (now - first[0]) / (progress - first[1]) * (100 - progress)
            default = "waiting for a model worker" if stage == "absent" else "loading the model"
            yield StatusMsg("model_loading", progress, worker.message or default, eta)
            await asyncio.sleep(LOADING_POLL_S)
            health = await self._gw.scheduler.health()

    def _enter(self, phase: Phase) -> None:
        self._phase = phase
        if phase is not Phase.PREPARING:
            self._prepared.set()

    async def _consume(self, queue: asyncio.Queue[StreamItem | _Resumed]) -> AsyncIterator[ServerMsg]:
        # a scheduler silent past the request's deadline: one timer per request that queues the
        # failure behind what came before it (not a timeout armed and disarmed per token)
        timeout = self._gw.settings.limits.request_timeout_s
        recoverable, action, _ = ERROR_TRAITS[TIMEOUT]
        stalled = wire.RequestFailed(rid=self.rid, code=TIMEOUT, message=f"no result from the scheduler within "
                                     f"{timeout:.0f} s", recoverable=recoverable, recovery_action=action)
        loop = asyncio.get_running_loop()
        timer = loop.call_at(loop.time() + timeout + STALL_GRACE_S, queue.put_nowait, stalled)
        held: list[wire.TokenEvent] = []  # what came while the client had paused the generation
        try:
            while True:
                item = await queue.get()
                if isinstance(item, _Resumed):
                    events, held = held, []
                elif isinstance(item, wire.RequestFailed):
                    for msg in (m for event in held for m in self._on_event(event)):
                        yield msg
                    yield ErrorMsg.from_failure(item, self._partial())
                    return
                elif self._paused and item.finish_reason is None:
                    held.append(item)  # (a step already in flight when the pause came)
                    continue
                else:
                    events, held = [*held, item], []
                for msg in (m for event in events for m in self._on_event(event)):
                    yield msg
                if events and events[-1].finish_reason is not None:
                    return
        finally:
            timer.cancel()

    def _on_event(self, event: wire.TokenEvent) -> list[ServerMsg]:
        """The messages one token event produces. Text that trips the content filter is never sent:
        the generation is cancelled and completes with ``content_filter``. Only a controlled
        request's first branch (fork index 0) is streamed here; /v1/run shows every branch."""
        if event.index and event.finish_reason is None:
            return []
        if self.request.prompt_logprobs:
            self.prompt_entries += [self._entries(p.token_id, p.logprob, p.top) for p in event.prompt_outputs]
        self.residual = next((p.residual for p in event.prompt_outputs if p.residual), self.residual)
        self._tokens += len(event.tokens)
        if event.finish_reason is not None:
            self._final = event
            self.embedding = event.embedding
        if not self._filtered and event.text and self._admission.screens_out(self._text + event.text):
            self._filtered = True
            if event.finish_reason is None:
                self._gw.scheduler.cancel_soon(self.rid)  # then drain up to its final "cancelled" event
        if self._filtered:
            return [self._completion(CONTENT_FILTER)] if event.finish_reason is not None else []

        out: list[ServerMsg] = []
        now = time.monotonic()
        last_at = self._last_token_at or self._started
        if event.tokens and self._first_token_at is None:
            self._first_token_at = now
        self._admission.tokens(len(event.tokens))
        for i, token in enumerate(event.tokens):
            last = i == len(event.tokens) - 1
            if last:
                self._text += event.text
            out.append(
                TokenMsg(
                    token=event.text if last else "",
                    token_id=token.token_id,
                    generated_text=self._echo + self._text,
                    logprobs=self._logprobs(token),
                    token_s=now - last_at,
                    total_s=now - self._started,
                    finish_reason=event.finish_reason if last else None,
                )
            )
            last_at = now
        if not event.tokens:  # e.g. the held-back text released by a cancellation
            self._text += event.text
        self._last_token_at = last_at

        if event.finish_reason in COMPLETED:
            out.append(self._completion(event.finish_reason, self._stop_reason(event.stop_reason)))
        elif event.finish_reason == "timeout":
            timeout = self._gw.settings.limits.request_timeout_s
            error = TillerError(TIMEOUT, f"the generation exceeded the {timeout:g} s time limit")
            out.append(ErrorMsg.from_error(error, self.rid, self._partial()))
        elif event.finish_reason is not None and event.error:  # its controller failed
            error = TillerError(INVALID_REQUEST, f"the controller failed: {event.error}")
            out.append(ErrorMsg.from_error(error, self.rid, self._partial()))
        elif event.finish_reason is not None:
            error = TillerError(INTERNAL_ERROR, f"the generation ended with {event.finish_reason!r}")
            out.append(ErrorMsg.from_error(error, self.rid, self._partial()))
        return out

    def _check_logit_bias(self, vocab_size: int) -> None:
        outside = [t for t in self.request.logit_bias or {} if vocab_size and t >= vocab_size]
        if outside:
            raise GatewayError(INVALID_REQUEST, f"logit_bias: token id {outside[0]} is outside the vocabulary "
                               f"(0..{vocab_size - 1})", param="logit_bias")

    def _sampling(self, prompt_ids: list[int], facts: wire.ModelFacts) -> wire.SamplingParams:
        """The request's sampling placed after its prompt: the penalties on generated tokens and
        ``min_tokens`` count from the first one, and ``min_tokens`` holds back every stop token."""
        sampling = self.request.sampling()
        sampling.output_start = len(prompt_ids)
        if self.request.min_tokens:
            stops = set(self.request.stop_token_ids)
            if not self.request.ignore_eos:
                stops.update(facts.eos_token_ids)
            vocab = facts.vocab_size
            sampling.suppress = sorted(t for t in stops if t < vocab)  # a token past the vocabulary never comes
        return sampling

    def _session(self) -> wire.SessionRef | None:
        """The chain this request is a turn of, if any: the scheduler parks its KV for the next turn."""
        if not self.request.park_as:
            return None
        return wire.SessionRef(key=self.request.park_as, parent=self.request.continues)

    def _prompt_scoring(self, prompt_ids: list[int]) -> wire.OutputRequest | None:
        """What the scheduler reports of the prompt's positions: every token's logprob but the first's
        (nothing comes before it), when the request asks for prompt logprobs; its embedding, when it asks one."""
        if self.request.pooling is not None:
            return wire.OutputRequest(pooling=self.request.pooling)
        if self.request.residual_layers:
            last = [wire.PositionSpan(start=len(prompt_ids) - 1, end=len(prompt_ids))]
            return wire.OutputRequest(residual_ranges=last, residual_layers=list(self.request.residual_layers))
        if not self.request.prompt_logprobs:
            return None
        first = prompt_ids[0]
        self.prompt_entries = [[LogprobEntry(self._gw.text.token_text(first), first, None)]]
        spans = [wire.PositionSpan(start=1, end=len(prompt_ids))] if len(prompt_ids) > 1 else []
        return wire.OutputRequest(logprob_ranges=spans, top_logprobs=self.request.top_logprobs or 0)

    def _logprobs(self, token: wire.SampledToken) -> list[LogprobEntry] | None:
        if self.request.top_logprobs is None:
            return None
        return self._entries(token.token_id, token.logprob, token.top)

    def _entries(self, token_id: int, logprob: float, top: list[wire.TokenLogprob]) -> list[LogprobEntry]:
        """A token with its logprob, then its ``top_logprobs`` alternatives (see ``alternatives_besides``)."""
        text = self._gw.text.token_text
        if self.request.alternatives_besides:
            top = [alt for alt in top if alt.token_id != token_id]
        return [LogprobEntry(text(token_id), token_id, logprob)] + [
            LogprobEntry(text(alt.token_id), alt.token_id, alt.logprob) for alt in top[: self.request.top_logprobs]
        ]

    def _partial(self) -> str | None:
        return self._echo + self._text if self._text else None

    def _completion(self, reason: str, stop_reason: str | int | None = None) -> CompletionMsg:
        first = None if self._first_token_at is None else self._first_token_at - self._started
        return CompletionMsg(
            self.rid, self._echo + self._text, reason, self.usage, first, time.monotonic() - self._started, stop_reason
        )

    def _stop_reason(self, ended_by: str | int | None) -> str | int | None:
        """What ended the generation as vLLM's ``stop_reason`` says it: the stop string, or the stop token when it is
        one of the request's ``stop_token_ids``; None for the model's EOS (and any other end)."""
        if isinstance(ended_by, int) and ended_by not in self.request.stop_token_ids:
            return None
        return ended_by

    # -- control ------------------------------------------------------------------------------

    async def settled(self) -> None:
        """Return once the generation is past its first moments (submitted, waiting for the model, or over):
        a control sent right after the config acts on it then."""
        await self._prepared.wait()

    async def _require_running(self, action: str) -> None:
        await self.settled()
        if self._phase is Phase.DONE:
            raise GatewayError(INVALID_REQUEST, f"cannot {action}: no generation is running", param="action")
        if self._phase is Phase.LOADING:
            raise GatewayError(
                INVALID_REQUEST, f"cannot {action} yet: the generation waits for the model", param="action"
            )

    async def _control(self, call: Awaitable[None]) -> None:
        """Await a scheduler command; a refusal because the request just ended is no error."""
        try:
            await call
        except TillerError:
            if self._phase is not Phase.DONE:
                raise

    async def stop(self) -> None:
        """Cancel; the stream then ends with a ``completion`` whose finish_reason is ``cancelled``."""
        if self._phase is Phase.DONE:
            raise GatewayError(INVALID_REQUEST, "cannot stop: no generation is running", param="action")
        self._stop_requested = True
        if self._phase is Phase.RUNNING:
            await self._control(self._gw.scheduler.cancel(self.rid))

    async def pause(self) -> None:
        """Pause; from its return on, no token goes out until :meth:`resume` (those of a step already in
        flight are held)."""
        await self._require_running("pause")
        self._paused = True
        try:
            await self._control(self._gw.scheduler.pause(self.rid))
        except BaseException:
            self._release()
            raise

    async def resume(self) -> None:
        await self._require_running("resume")
        await self._control(self._gw.scheduler.resume(self.rid))
        self._release()

    def _release(self) -> None:
        if self._paused:
            self._paused = False
            assert self._queue is not None
            self._queue.put_nowait(RESUMED)

    async def modify(self, patch: ParametersPatch) -> None:
        await self._require_running("modify")
        if patch.max_tokens is not None:
            context_budget(self._prompt_len, patch.max_tokens, self._max_model_len, patch.max_tokens)
        sampling_patch = patch.to_patch()
        vectors: dict[str, bytes] = {}
        if patch.steering is not None:
            sampling_patch.steering, vectors = await resolve_steering(self._gw, patch.steering, self.tenant.principal)
        await self._control(self._gw.scheduler.modify(self.rid, sampling_patch, vectors))
        self.request = self.request.patched(sampling_patch)
        if patch.steering is not None:  # (what regenerate resolves again)
            self.request = dataclasses.replace(self.request, steering=patch.steering)


async def protocol_messages(gen: Generation, options: OutputOptions) -> AsyncIterator[dict[str, Any]]:
    """A generation as the WebSocket protocol's JSON messages (also the REST/SSE twin's).

    Without ``stream`` the token messages are left out, and the completion carries ``token_ids`` and
    ``logprobs`` for the whole generation when they were asked for.
    """
    tokens: list[TokenMsg] = []
    async for msg in gen.stream():
        if isinstance(msg, TokenMsg):
            if options.stream:
                yield msg.to_json(options)
            else:
                tokens.append(msg)
            continue
        out = msg.to_json(options)
        if isinstance(msg, CompletionMsg) and not options.stream:
            if options.include_token_ids:
                out["token_ids"] = [t.token_id for t in tokens]
            if options.include_logprobs is not None:
                out["logprobs"] = [[{"token": e.token, "logprob": e.logprob} for e in t.logprobs or []] for t in tokens]
        yield out
