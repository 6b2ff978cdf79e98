"""AICI's REST API (rLLM's shapes): controllers, tags and ``/v1/run``.

- ``POST /v1/controllers``: the raw Wasm module as the body -> ``{module_id, wasm_size, compiled_size,
  time}``; the module id is the sha256 of the bytes.
- ``GET /v1/controllers/tags`` -> ``{"tags": [TagInfo...]}`` newest first; ``POST`` with
  ``{"module_id", "tags": [...]}`` points tags at a module.
- ``POST /v1/run``: ``{controller, controller_arg, prompt, temperature, top_p, top_k, max_tokens}`` ->
  server-sent events: ``initial-run``, then ``run`` events with per-fork text deltas, logs, storage,
  errors and finish reasons and the usage so far, then ``[DONE]``. ``controller`` is a module id, a
  tag, ``native:<name>``, or ``none`` (plain generation from ``controller_arg`` as the prompt when it
  is a string). The controller is instantiated before the stream starts: a request the runtime refuses
  (unknown module or tag) is an HTTP error; a controller that fails while starting gives, as in AICI,
  a stream whose one ``run`` event ends fork 0 with ``finish_reason: "fail"``, its error and logs.
  ``null`` sampling fields mean their defaults (rLLM's ``Option`` fields).

Who calls is decided by :func:`services.gateway.side_channel.caller_of`. Errors are
``{"error": {"type", "message"}}``: 400 for bad requests and refused controllers, 401 without valid
credentials, 413 for an oversized module.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import APIRouter
from pydantic import Field, ValidationInfo, field_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from common import aici_wire, wire
from common.admission import context_budget
from common.errors import CONTENT_FILTER, INTERNAL_ERROR, INVALID_REQUEST, MODEL_LOADING_ERROR, TillerError
from services.gateway.admission import Admission
from services.gateway.deps import Gateway, new_request_id
from services.gateway.scheduler_client import HEALTH_MAX_AGE_S, StreamItem, facts_of, worker_stage
from services.gateway.httputil import (SSE_HEADERS, answer, client_of, error_json, gateway_of, read_json_object, sse,
                                      tenant_of)
from services.gateway.protocol import GatewayError
from services.gateway.side_channel import ControllerInitFailed, SideChannel, caller_of
from services.gateway.steering import resolve_steering
from services.gateway.tenants import cache_domain
from services.gateway.validation import (
    INT64_MAX,
    CacheSalt,
    Context,
    GenerationRequest,
    Int64,
    LimitChecks,
    SteeringSpec,
    StrictModel,
    TopP,
    validate,
)

router = APIRouter()

# Tiller finish reasons of a whole request -> AICI's finish reason for a fork still running at its end.
ABORTED = {"cancelled": "abort", "timeout": "abort", "error": "fail", "length": "length", "stop": "aici-stop",
           CONTENT_FILTER: CONTENT_FILTER}
# The same for ``controller: "none"``: with no controller, a request that stops has sampled EOS.
PLAIN_FINISH = ABORTED | {"stop": "eos"}
NONE_CONTROLLER = "none"


def _side(gw: Gateway) -> SideChannel:
    if gw.side is None:
        raise TillerError(INTERNAL_ERROR, "the controller runtime's side channel is not configured")
    return gw.side


# -- controllers and tags -------------------------------------------------------------------------


@router.post("/v1/controllers")
async def upload_controller(request: Request) -> Response:
    gw = gateway_of(request)
    limit = gw.settings.controllers.max_module_bytes
    try:
        caller = caller_of(request, gw.settings)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                return error_json(TillerError(INVALID_REQUEST, f"the module exceeds {limit} bytes"), status=413)
        if not body:
            raise TillerError(INVALID_REQUEST, "the body must be the controller's Wasm module (it is empty)")
        return JSONResponse(await _side(gw).mk_module(caller, bytes(body)))
    except TillerError as exc:
        return error_json(exc)


class SetTags(StrictModel):
    module_id: Annotated[str, Field(min_length=1)]
    tags: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]


@router.get("/v1/controllers/tags")
async def get_tags(request: Request) -> Response:
    return await answer(request, lambda gw, caller: _side(gw).get_tags(caller))


@router.post("/v1/controllers/tags")
async def set_tags(request: Request) -> Response:
    async def moved(gw: Gateway, caller: wire.Principal) -> Any:
        body = validate(SetTags, await read_json_object(request), Context.of(gw.settings))
        return await _side(gw).set_tags(caller, body.module_id, body.tags)
    return await answer(request, moved)


# -- run ------------------------------------------------------------------------------------------


class RunRequest(StrictModel, LimitChecks):
    """AICI's RunRequest (defaults as rLLM's: greedy, whole context); ``seed`` is a Tiller extension."""

    controller: Annotated[str, Field(min_length=1)]
    controller_arg: Any = ""
    prompt: str = ""
    temperature: Annotated[float, Field(ge=0)] = 0.0
    top_p: TopP = 1.0
    top_k: Annotated[int, Field(ge=-1, le=INT64_MAX)] = -1  # -1 (or 0): disabled
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    seed: Int64 | None = None
    model: str | None = None  # accepted as the vLLM variant does; must name the served model
    cache_salt: CacheSalt | None = None  # vLLM's (docs/tenants.md)
    steering: SteeringSpec | None = None  # Tiller's activation steering (docs/steering.md)

    @field_validator("temperature", "top_p", "top_k", mode="before")
    @classmethod
    def _null_is_default(cls, value: Any, info: ValidationInfo) -> Any:
        return cls.model_fields[info.field_name].default if value is None else value

    @property
    def plain(self) -> bool:
        """``controller: "none"``: no controller; a string ``controller_arg`` is the prompt (rLLM)."""
        return self.controller == NONE_CONTROLLER

    def prompt_text(self) -> str:
        return self.controller_arg if self.plain and isinstance(self.controller_arg, str) else self.prompt

    def sampling(self, prompt_len: int) -> wire.SamplingParams:
        """``prompt_len``: where the generated positions start (steering's ``generated``, docs/steering.md)."""
        return wire.SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=max(self.top_k, 0), seed=self.seed,
            output_start=prompt_len,
        )


@dataclass
class Fork:
    """What the client has been told about one branch."""

    index: int
    finished: bool = False


@dataclass
class RunStream:
    """One ``/v1/run``: turns the scheduler's per-branch events into AICI's ``run`` events."""

    gw: Gateway
    admission: Admission
    prompt_tokens: int
    queue: asyncio.Queue[StreamItem]
    finish_names: dict[str, str] = field(default_factory=lambda: ABORTED)
    forks: dict[int, Fork] = field(default_factory=dict)
    texts: dict[int, str] = field(default_factory=dict)  # each fork's text sent so far (the content filter's view)
    sampled: int = 0
    ff: int = 0
    outcome: str = "cancelled"  # the request's Tiller finish reason, an error code, or (the client left) cancelled

    @property
    def rid(self) -> str:
        return self.admission.rid

    def usage(self) -> dict[str, int]:
        return usage(self.sampled, self.ff)

    def run_event(self, events: list[StreamItem]) -> tuple[dict[str, Any], bool]:
        """One ``run`` event for the events of one step; and whether the request ended."""
        entries: dict[int, dict[str, Any]] = {}

        def entry(index: int) -> dict[str, Any]:
            self.forks.setdefault(index, Fork(index))
            return entries.setdefault(index, {"index": index, "text": "", "error": "", "logs": "", "storage": [],
                                              "micros": 0})

        ended: str | None = None
        for item in events:
            if isinstance(item, wire.RequestFailed):
                entry(0)["error"] = item.message
                ended, self.outcome = "error", item.code
                continue
            self.sampled += len(item.tokens)
            self.ff += item.ff_tokens
            self.admission.tokens(len(item.tokens))
            out = entry(item.index)
            text = self.texts.get(item.index, "") + item.text
            if self.admission.screens_out(text):  # withheld: the request ends here
                out["error"] = "the generated text was refused by the content filter"
                ended = self.outcome = CONTENT_FILTER
                break
            self.texts[item.index] = text
            out["text"] += item.text
            out["logs"] += item.logs
            out["storage"] += item.storage
            out["micros"] += item.micros
            out["error"] = out["error"] or item.error
            if item.fork_finish is not None and not self.forks[item.index].finished:
                out["finish_reason"] = item.fork_finish
                self.forks[item.index].finished = True
            ended = item.finish_reason or ended
            self.outcome = item.finish_reason or self.outcome
        if ended is not None:  # every branch still open ends with the request
            for fork in self.forks.values():
                if not fork.finished:
                    entry(fork.index)["finish_reason"] = self.finish_names.get(ended, "abort")
                    fork.finished = True
        forks = [e for _, e in sorted(entries.items()) if any(e[k] for k in ("text", "error", "logs", "storage"))
                 or "finish_reason" in e]
        for e in forks:  # AICI's field order: finish_reason only when there is one
            if "finish_reason" in e:
                e["finish_reason"] = e.pop("finish_reason")
        return {"object": "run", "forks": forks, "usage": self.usage()}, ended is not None

    async def events(self, model: str) -> AsyncIterator[bytes]:
        yield initial_run(self.rid, model)
        timeout = self.gw.settings.limits.request_timeout_s + 10.0
        done = False
        try:
            while True:
                try:
                    async with asyncio.timeout(timeout):
                        batch = [await self.queue.get()]
                except TimeoutError:
                    batch = [wire.RequestFailed(rid=self.rid, code="timeout", message="no result from the scheduler")]
                while not self.queue.empty():  # the rest of the same step
                    batch.append(self.queue.get_nowait())
                event, done = self.run_event(batch)
                yield sse(event)
                if done:
                    yield sse("[DONE]")
                    return
        finally:
            self.gw.scheduler.close_stream(self.rid)
            if not done or self.outcome == CONTENT_FILTER:  # the client left, or the filter ended it: free its sequences
                self.gw.scheduler.cancel_soon(self.rid)
            self.admission.end(self.outcome, text=self.texts.get(0, ""), prompt_tokens=self.prompt_tokens,
                               completion_tokens=self.sampled)


def usage(sampled: int, ff: int) -> dict[str, int]:
    """AICI's usage: rLLM's cost is two per sampled token and one per fast-forwarded token."""
    return {"sampled_tokens": sampled, "ff_tokens": ff, "cost": 2 * sampled + ff}


def initial_run(rid: str, model: str) -> bytes:
    return sse({"id": rid, "object": "initial-run", "created": int(time.time()), "model": model})


async def failed_start(rid: str, model: str, result: dict[str, Any]) -> AsyncIterator[bytes]:
    """AICI's stream for a controller that failed at instantiate: one ``run`` event failing fork 0."""
    yield initial_run(rid, model)
    fork = {"index": 0, "text": "", "error": str(result["error"]), "logs": str(result.get("logs") or ""),
            "storage": list(result.get("storage") or []), "micros": int(result.get("micros") or 0),
            "finish_reason": "fail"}
    yield sse({"object": "run", "forks": [fork], "usage": usage(0, 0)})
    yield sse("[DONE]")


async def _start_run(gw: Gateway, run: RunRequest, caller: wire.Principal, admission: Admission) -> AsyncIterator[bytes]:
    """Admit, tokenize, check the model, instantiate the controller and submit; the stream's events.
    Errors before the controller runs raise (HTTP errors); a failing controller start is a stream."""
    model = gw.settings.served_model_name
    if run.model is not None and run.model != model:
        raise GatewayError(INVALID_REQUEST, f"model {run.model!r} is not served here", param="model")
    await admission.admit(run.prompt_text())
    if run.prompt_text():
        _, prompt_ids = await gw.text.prompt(GenerationRequest(prompt=run.prompt_text()))
    else:  # AICI's default empty prompt: the start symbol
        tokenizer = gw.text.tokenizer
        start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        prompt_ids = [start]
    health = await gw.scheduler.health(max_age=HEALTH_MAX_AGE_S)
    stage = worker_stage(health).stage
    if stage != "ready":
        raise TillerError(MODEL_LOADING_ERROR, f"the model is not ready (worker: {stage}); retry shortly")
    max_model_len = facts_of(health).max_model_len or gw.settings.limits.max_model_len
    max_tokens = context_budget(len(prompt_ids), run.max_tokens, max_model_len, max_model_len)
    steering, vectors = await resolve_steering(gw, run.steering, admission.tenant.principal)
    rid = admission.rid
    if not run.plain:
        try:
            await _side(gw).instantiate(caller, rid, prompt_ids, run.controller, aici_wire.module_arg_text(run.controller_arg))
        except ControllerInitFailed as exc:
            admission.end(INVALID_REQUEST)
            return failed_start(rid, model, exc.result)
    queue = gw.scheduler.open_stream(rid)
    try:
        await gw.scheduler.submit(
            wire.Submit(
                rid=rid,
                prompt=wire.pack_tokens(prompt_ids),
                sampling=run.sampling(len(prompt_ids)),
                max_tokens=max_tokens,
                timeout_s=gw.settings.limits.request_timeout_s,
                controller="" if run.plain else rid,
                cache_domain=cache_domain(admission.tenant, run.cache_salt, gw.settings, steering),
                tenant=admission.tenant.user,
                steering=steering,
                steering_vectors=vectors,
            )
        )
    except BaseException:
        gw.scheduler.close_stream(rid)
        raise
    admission.record(prompt=run.prompt_text(), params=run.model_dump(exclude={"prompt", "controller_arg", "cache_salt"}))
    return RunStream(gw, admission, len(prompt_ids), queue, PLAIN_FINISH if run.plain else ABORTED).events(model)


@router.post("/v1/run")
async def run(request: Request) -> Response:
    gw = gateway_of(request)
    try:
        caller = caller_of(request, gw.settings)
        body = await read_json_object(request)
        run_request = validate(RunRequest, body, Context.of(gw.settings))
    except TillerError as exc:
        gw.metrics.refused("aici", exc.code)
        return error_json(exc)
    admission = Admission(gw, rid=new_request_id("run-"), surface="aici", client=client_of(request),
                          tenant=tenant_of(request))
    try:
        events = await _start_run(gw, run_request, caller, admission)
    except TillerError as exc:
        admission.end(exc.code)
        return error_json(exc)
    except BaseException:
        admission.end(INTERNAL_ERROR)
        raise
    return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
