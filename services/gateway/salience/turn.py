"""One Salience Generate call: validate, commit the appended tokens to the session, run the turn
through the scheduler, stream Token events and a Done, and write the decoded tokens back.

The session's busy lease (taken by ``SalienceBegin``) makes the turn the only one on its session.
Whatever way the call ends, the lease is released with exactly the decoded tokens the client was
sent appended: a client that disconnects mid-turn leaves the session as far as it saw it.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import structlog

from common import wire
from common.errors import (
    CONTENT_FILTER,
    CONTEXT_LENGTH_EXCEEDED,
    INTERNAL_ERROR,
    INVALID_REQUEST,
    MEMORY_PRESSURE,
    RATE_LIMITED,
    SERVICE_UNAVAILABLE,
    TIMEOUT,
    TillerError,
)
from common.protos.salience.v1 import salience_pb2 as pb
from services.gateway.admission import Admission
from services.gateway.deps import Gateway, new_request_id
from services.gateway.driver import STALL_GRACE_S
from services.gateway.scheduler_client import HEALTH_MAX_AGE_S, facts_of, worker_stage
from services.gateway.salience.decoded import DecodedTokens, covers, readout_values
from services.gateway.salience.images import ImageError, ImageSupport, check_unattached, prepare_images
from services.gateway.salience.store import SessionStoreClient, SessionStoreError
from services.gateway.steering import resolve_steering
from services.gateway.tenants import Tenant, cache_domain
from services.gateway.validation import MAX_CACHE_SALT_CHARS

log = structlog.get_logger()

Done = pb.GenerateDone
# gRPC metadata of a Generate call: vLLM's cache_salt (salience.proto has no field for it; docs/tenants.md)
CACHE_SALT_METADATA = "tiller-cache-salt"
# gRPC metadata of a Generate call: the turn's activation steering, as JSON (the list the other surfaces take in a
# ``steering`` field; salience.proto has none; docs/steering.md)
STEERING_METADATA = "tiller-steering"

# scheduler failure codes -> gRPC status
FAILURE_STATUS = {
    CONTEXT_LENGTH_EXCEEDED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    MEMORY_PRESSURE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    INVALID_REQUEST: grpc.StatusCode.INVALID_ARGUMENT,
    TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    RATE_LIMITED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    CONTENT_FILTER: grpc.StatusCode.PERMISSION_DENIED,
    SERVICE_UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
}


class Abort(Exception):
    """End the call with a gRPC status."""

    def __init__(self, status: grpc.StatusCode, message: str, outcome: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.outcome = outcome or status.name.lower()  # the requests_total label: an error code when one applies

    @classmethod
    def from_error(cls, exc: TillerError) -> Abort:
        return cls(FAILURE_STATUS.get(exc.code, grpc.StatusCode.INTERNAL), exc.message, exc.code)


def _invalid(message: str) -> Abort:
    return Abort(grpc.StatusCode.INVALID_ARGUMENT, message, INVALID_REQUEST)


@dataclass
class Turn:
    gw: Gateway
    store: SessionStoreClient
    images: ImageSupport
    request: pb.GenerateRequest
    client: str  # the caller's address
    tenant: Tenant  # whose call it is (the sessions it may reach, its rate limit, its cache domain)
    cache_salt: str = ""  # the call's CACHE_SALT_METADATA ("": none)
    steering_json: str = ""  # the call's STEERING_METADATA ("": none)
    rid: str = field(default_factory=lambda: new_request_id("sal-"))
    steering: list[wire.SteeringTerm] = field(default_factory=list)  # resolved from ``steering_json``
    steering_vectors: dict[str, bytes] = field(default_factory=dict)
    sent: list[int] = field(default_factory=list)  # decoded tokens the client was sent
    generated: str = ""  # their text, as the content filter reads it
    cached_tokens: int = 0
    length: int = 0  # the session's length once the call's tokens are appended
    outcome: str = "cancelled"  # how the call ended (the requests_total label); unless set: the client left
    _admission: Admission = field(init=False)

    async def run(self) -> AsyncIterator[pb.GenerateEvent]:
        """The call's events, through the admission pipeline; raises :class:`Abort` (or the store's
        error) for a refused or failed call."""
        structlog.contextvars.bind_contextvars(request_id=self.rid, session_id=self.request.session_id)
        self._admission = Admission(self.gw, rid=self.rid, surface="salience", client=self.client, tenant=self.tenant)
        try:
            async for event in self._run():
                yield event
        except (Abort, SessionStoreError) as exc:
            self.outcome = exc.outcome if isinstance(exc, Abort) else exc.status.name.lower()
            raise
        except Exception:
            self.outcome = INTERNAL_ERROR
            raise
        finally:
            self._admission.end(self.outcome, text=self.generated, prompt_tokens=self.length,
                                completion_tokens=len(self.sent))

    async def _run(self) -> AsyncIterator[pb.GenerateEvent]:
        req = self.request
        health = await self._ready()
        facts = facts_of(health)
        max_len = facts.max_model_len or self.gw.settings.limits.max_model_len
        self._validate(facts.vocab_size, max_len)
        try:
            await self._admission.admit(self._admission.written_tokens(req.append_tokens), "append_tokens")
            await self._resolve_steering()
        except TillerError as exc:
            raise Abort.from_error(exc) from None
        length = self.length = req.offset + len(req.append_tokens)
        try:
            outputs = self._positions(length)
        except Abort:  # judged by the client's offset: a drifted offset is the call's real problem
            await self.store.begin(self._begin(max_len, check_only=True))
            raise
        sampling = self._sampling(outputs, length)
        new_images = await self._images(length)
        started = time.monotonic()
        session = await self.store.begin(self._begin(max_len, new_images))
        self._admission.record(prompt=self._admission.written_tokens(session.tokens), params=self._params())
        ended = False
        try:
            if length == 0:  # nothing to prefill: a no-op call (it refreshed the TTL)
                self.outcome = "length"
                yield pb.GenerateEvent(done=Done(finish_reason=Done.FINISH_REASON_LENGTH))
                return
            with self.gw.store.holdings.lease(session.session_id):  # renewed while the turn runs
                async for event in self._stream(session, outputs, sampling, length):
                    yield event
        except Abort as exc:  # the session kept the call's tokens: say where it stands now, for the retry
            ended = True
            if await self._end(session):
                held = length + len(self.sent)
                exc.message = (f"{exc.message}; the session kept the tokens this call appended and the "
                               f"{len(self.sent)} decoded tokens sent: it now holds {held} tokens (offset {held})")
            raise
        finally:
            if not ended:
                await self._end(session)
            log.info("salience.generate_end", prompt_tokens=length, completion_tokens=len(self.sent),
                     cached_tokens=self.cached_tokens, total_ms=round((time.monotonic() - started) * 1000, 1))

    async def _ready(self) -> wire.HealthReply:
        try:
            health = await self.gw.scheduler.health(max_age=HEALTH_MAX_AGE_S)
        except TillerError as exc:
            raise Abort(grpc.StatusCode.UNAVAILABLE, exc.message) from None
        stage = worker_stage(health)
        if stage.stage != "ready":
            raise Abort(grpc.StatusCode.UNAVAILABLE, f"the model is not ready ({stage.stage}): "
                                                     f"{stage.message or 'retry shortly'}")
        return health

    def _params(self) -> dict[str, object]:
        """The call's parameters as its request record keeps them."""
        req = self.request
        return {"session_id": req.session_id, "offset": req.offset, "max_tokens": req.max_tokens,
                "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "priority": req.priority}

    def _begin(self, max_len: int, images: list[wire.ImageInput] | None = None, *,
               check_only: bool = False) -> wire.SalienceBegin:
        req = self.request
        return wire.SalienceBegin(
            session_id=req.session_id,
            caller=self.tenant.principal,
            offset=req.offset,
            truncating=req.truncating,
            append_tokens=list(req.append_tokens),
            images=images or [],
            max_len=max_len,
            reserve_tokens=req.max_tokens,
            lease_s=self.gw.settings.sessions.busy_lease_s,
            check_only=check_only,
        )

    def _validate(self, vocab_size: int, max_len: int) -> None:
        """The checks that do not depend on the session's length."""
        req = self.request
        limits = self.gw.settings.limits
        if len(self.cache_salt) > MAX_CACHE_SALT_CHARS:
            raise _invalid(f"{CACHE_SALT_METADATA} must be at most {MAX_CACHE_SALT_CHARS} characters")
        if not req.session_id:  # no session has that id: NOT_FOUND, as DumpSession and ForkSession answer it
            raise Abort(grpc.StatusCode.NOT_FOUND, "no session has the empty session_id; open one with OpenSession")
        if vocab_size and any(t >= vocab_size for t in req.append_tokens):
            raise _invalid(f"append_tokens must be token ids in [0, {vocab_size})")
        if not 0 <= req.temperature < math.inf:
            raise _invalid(f"temperature must be finite and >= 0 (0 means the default 1.0), got {req.temperature}")
        if not 0 <= req.top_p <= 1:
            raise _invalid(f"top_p must be in [0, 1] (0 means the default 1.0), got {req.top_p}")
        if req.max_tokens > max_len:  # over the context whatever the session holds: the proto's overflow
            raise Abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"max_tokens {req.max_tokens} is over the model's context of {max_len}")
        if req.max_tokens > limits.max_tokens_cap:
            raise _invalid(f"max_tokens must be at most {limits.max_tokens_cap}, got {req.max_tokens}")
        if req.logprob_top_k > limits.max_top_logprobs:
            raise _invalid(f"logprob_top_k must be at most {limits.max_top_logprobs}, got {req.logprob_top_k}")
        if len(req.stop_token_ids) > limits.max_token_biases:
            raise _invalid(f"at most {limits.max_token_biases} stop_token_ids are allowed, got {len(req.stop_token_ids)}")
        if vocab_size and any(t >= vocab_size for t in req.stop_token_ids):
            raise _invalid(f"stop_token_ids must be token ids in [0, {vocab_size})")
        if not 0 <= req.priority <= 10:
            raise _invalid(f"priority must be in [0, 10] (0 interactive ... 10 batch), got {req.priority}")

    def _positions(self, length: int) -> wire.OutputRequest:
        """The outputs asked for, checked against ``length``, the session's length after the call."""
        req = self.request
        if length == 0 and req.max_tokens > 0:
            raise _invalid("the session is empty: append tokens to generate from")
        spans = {}
        for name, ranges, end in (
            ("logprobs_ranges", req.logprobs_ranges, length + req.max_tokens),
            ("readout_ranges", req.readout_ranges, length + req.max_tokens),
        ):
            for r in ranges:
                if not r.start < r.end <= end:
                    raise _invalid(f"{name} [{r.start}, {r.end}) must be a non-empty range ending at or before {end} "
                                   "(the tokens after append plus max_tokens)")
            spans[name] = [wire.PositionSpan(r.start, r.end) for r in ranges]
        return wire.OutputRequest(
            logprob_ranges=spans["logprobs_ranges"],
            top_logprobs=req.logprob_top_k,
            readout_ranges=spans["readout_ranges"],
        )

    async def _resolve_steering(self) -> None:
        if not self.steering_json:
            return
        try:
            spec = json.loads(self.steering_json)
        except ValueError as exc:
            raise _invalid(f"{STEERING_METADATA} must be a JSON list of steering terms: {exc}") from None
        self.steering, self.steering_vectors = await resolve_steering(self.gw, spec, self.tenant.principal)

    def _sampling(self, outputs: wire.OutputRequest, length: int) -> wire.SamplingParams:
        req = self.request
        decode_logprobs = any(r.end > length for r in outputs.logprob_ranges)
        top_k = req.top_k
        return wire.SamplingParams(
            temperature=0.0 if top_k == 1 else (req.temperature or 1.0),  # top-1 sampling is greedy
            top_p=req.top_p or 1.0,
            top_k=top_k,
            logprobs=req.logprob_top_k if decode_logprobs else None,
            output_start=length,  # (steering's "generated" positions start here)
        )

    async def _images(self, length: int) -> list[wire.ImageInput]:
        req = self.request
        if not req.images:
            try:  # no attachment: the appended tokens may hold no vision token either
                check_unattached(self.images, req.append_tokens, req.offset)
            except ImageError as exc:
                raise Abort(exc.code, exc.message) from None
            return []
        session = await self.store.get(req.session_id, self.tenant.principal)
        tokens = session.tokens[: req.offset] + list(req.append_tokens)
        if len(tokens) != length:
            raise Abort(grpc.StatusCode.FAILED_PRECONDITION,
                        f"offset {req.offset} does not match the session's {len(session.tokens)} tokens")
        try:
            return await prepare_images(self.images, tokens, list(req.images), appended_from=req.offset)
        except ImageError as exc:
            raise Abort(exc.code, exc.message) from None

    async def _stream(
        self, session: wire.SalienceSession, outputs: wire.OutputRequest, sampling: wire.SamplingParams, length: int
    ) -> AsyncIterator[pb.GenerateEvent]:
        req = self.request
        submit = wire.Submit(
            rid=self.rid,
            prompt=wire.pack_tokens(session.tokens),
            sampling=sampling,
            max_tokens=req.max_tokens,
            stop_token_ids=list(req.stop_token_ids),
            priority=req.priority,
            timeout_s=self.gw.settings.limits.request_timeout_s,
            session=wire.SessionRef(key=session.session_id, parent=session.parent),
            outputs=outputs,
            images=session.images,
            cache_domain=self._cache_domain(),
            tenant=self.tenant.user,
            steering=self.steering,
            steering_vectors=self.steering_vectors,
        )
        decoded = DecodedTokens(outputs.readout_ranges)
        decoded_ids: list[int] = []
        final: wire.TokenEvent | None = None
        async for item in self._events(submit):
            for out in item.prompt_outputs:
                if out.position < length:
                    yield pb.GenerateEvent(token=self._prompt_token(out))
                else:  # the readout of a decoded token
                    for token in decoded.readout(out.position, out.readout):
                        yield self._send(token)
            for sampled in item.tokens:
                generated = self.generated + self.gw.text.token_text(sampled.token_id)
                if self._admission.screens_out(generated):  # withheld; what was sent stays committed
                    raise Abort(grpc.StatusCode.PERMISSION_DENIED, "the generated text was refused by the "
                                "content filter", CONTENT_FILTER)
                self.generated = generated
                self._admission.tokens(1)
                token = self._decoded_token(sampled, length + len(decoded_ids), outputs)
                decoded_ids.append(sampled.token_id)
                for ready in decoded.add(token):
                    yield self._send(ready)
            if item.finish_reason is not None:
                final = item
        assert final is not None
        if decoded.waiting() and final.finish_reason in ("stop", "length"):
            # the last token was never fed: one prefill-only step of the session reads it
            waiting = decoded.waiting()
            tail = wire.Submit(
                rid=f"{self.rid}-tail",
                prompt=wire.pack_tokens(session.tokens + decoded_ids),
                sampling=sampling,
                max_tokens=0,
                priority=req.priority,
                timeout_s=self.gw.settings.limits.request_timeout_s,
                session=wire.SessionRef(key=session.session_id, parent=session.parent),
                outputs=wire.OutputRequest(readout_ranges=[wire.PositionSpan(waiting[0], waiting[-1] + 1)]),
                images=session.images,
                cache_domain=self._cache_domain(),
                tenant=self.tenant.user,
                steering=self.steering,
                steering_vectors=self.steering_vectors,
            )
            async for item in self._events(tail):
                for out in item.prompt_outputs:
                    for token in decoded.readout(out.position, out.readout):
                        yield self._send(token)
        self.cached_tokens = final.cached_tokens
        self.outcome = final.finish_reason or ""
        yield pb.GenerateEvent(done=self._done(final, length))

    def _cache_domain(self) -> str:
        return cache_domain(self.tenant, self.cache_salt or None, self.gw.settings, self.steering)

    def _send(self, token: pb.Token) -> pb.GenerateEvent:
        """A decoded token's event; the token counts as sent (committed to the session) from here: a
        cancel arriving while the message is on its way interrupts the yield, and the client may still
        have read it."""
        self.sent.append(token.id)
        return pb.GenerateEvent(token=token)

    async def _events(self, submit: wire.Submit) -> AsyncIterator[wire.TokenEvent]:
        """The scheduler's events of one submitted request, up to its final one; failures raise Abort."""
        scheduler = self.gw.scheduler
        queue = scheduler.open_stream(submit.rid)
        finished = False
        try:
            try:
                await scheduler.submit(submit)
            except TillerError as exc:
                raise Abort.from_error(exc) from None
            deadline = asyncio.get_running_loop().time() + self.gw.settings.limits.request_timeout_s + STALL_GRACE_S
            while True:
                try:
                    async with asyncio.timeout_at(deadline):
                        item = await queue.get()
                except TimeoutError:
                    raise Abort(grpc.StatusCode.DEADLINE_EXCEEDED, "no result from the scheduler in time") from None
                if isinstance(item, wire.RequestFailed):
                    finished = True
                    raise Abort(FAILURE_STATUS.get(item.code, grpc.StatusCode.INTERNAL), item.message, item.code)
                if item.finish_reason is not None:
                    finished = True
                    if item.finish_reason == "timeout":
                        raise Abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the generation exceeded its time limit",
                                    TIMEOUT)
                yield item
                if finished:
                    return
        finally:
            if not finished:
                scheduler.cancel_soon(submit.rid)
            scheduler.close_stream(submit.rid)

    @staticmethod
    def _prompt_token(out: wire.PositionOutput) -> pb.Token:
        token = pb.Token(id=out.token_id, position=out.position, is_prefill=True)
        if out.readout:
            token.readout.extend(readout_values(out.readout))
        if out.logprob is not None:
            token.sampled_logprob, token.has_sampled_logprob = out.logprob, True
            token.logprobs.extend(pb.TokenLogprob(id=t.token_id, logprob=t.logprob) for t in out.top)
        return token

    @staticmethod
    def _decoded_token(sampled: wire.SampledToken, position: int, outputs: wire.OutputRequest) -> pb.Token:
        token = pb.Token(id=sampled.token_id, position=position, is_prefill=False)
        if covers(outputs.logprob_ranges, position):
            token.sampled_logprob, token.has_sampled_logprob = sampled.logprob, True
            token.logprobs.extend(pb.TokenLogprob(id=t.token_id, logprob=t.logprob) for t in sampled.top)
        return token

    def _done(self, final: wire.TokenEvent, length: int) -> pb.GenerateDone:
        reason = {
            "length": Done.FINISH_REASON_LENGTH,
            "cancelled": Done.FINISH_REASON_CANCELLED,
        }.get(final.finish_reason or "", Done.FINISH_REASON_UNSPECIFIED)
        if final.finish_reason == "stop":
            reason = Done.FINISH_REASON_EOS if isinstance(final.stop_reason, int) else Done.FINISH_REASON_STOP_STRING
        completion = len(self.sent)
        return Done(prompt_tokens=length, completion_tokens=completion, total_tokens=length + completion,
                    finish_reason=reason)

    async def _end(self, session: wire.SalienceSession) -> bool:
        """Release the lease with the decoded tokens sent, even while the call is being cancelled;
        False: the store did not take them."""
        task = asyncio.ensure_future(self.store.end(session.session_id, session.lease, list(self.sent)))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            await task
        except Exception as exc:  # the lease expired, or the store is gone: the turn's tokens are lost
            log.warning("salience.end_failed", error=str(exc))
            return False
        return True
