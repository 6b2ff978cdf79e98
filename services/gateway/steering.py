"""Steering vectors' REST API, and the resolver every surface calls for a request's steering (docs/steering.md).

- ``POST /v1/steering/vectors[?tags=<tag>,<tag>]``: the body is the vector file, a GGUF control vector, a
  safetensors file or JSON (common/steering_formats.py), at most ``steering.max_vector_bytes`` (else 413). Its hidden
  size must be the served model's and its layers within the model's decoder layers. Stored (with the tags, all or
  nothing) in the session store -> ``{"id", "hidden_size", "layers", "norms", "tags", "created"}``; ``id`` is the
  SHA-256 of the canonical content, the same whichever format carried it, and ``norms[i]`` is ``layers[i]``'s.
- ``GET /v1/steering/vectors`` -> ``{"vectors": [...]}``, the caller's (newest first); ``GET
  /v1/steering/vectors/{id or tag}`` -> one; ``DELETE /v1/steering/vectors/{id}`` lets go of one the caller uploaded.
- ``GET /v1/steering/tags`` -> ``{"tags": [{"tag", "vector_id", "updated_at", "updated_by"}]}``; ``POST`` with
  ``{"vector_id", "tags": [...]}`` points tags at a vector (AICI's module tags, and their rules: common/tags.py).

Who calls is :func:`services.gateway.side_channel.caller_of`'s answer, as for the controller API. Errors are
``{"error": {"type", "message"}}``: 400 for bad input, 401 without valid credentials, 404 for a vector or tag the
caller does not reach (as for one no one stored), 413 for an oversized file, 429 past
``steering.max_vectors_per_user``, 503 while no worker has said what model it serves.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Annotated, Any, Literal

import structlog
from fastapi import APIRouter
from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from common import wire
from common.errors import INTERNAL_ERROR, INVALID_REQUEST, MODEL_LOADING_ERROR, TillerError
from common.steering import CONCEPT_PREFIX, SteeringError, SteeringVector, encode
from common.steering_formats import parse
from common.wire import Principal, SteeringTerm
from services.gateway.deps import Gateway
from services.gateway.httputil import answer, error_json, gateway_of, read_json_object
from services.gateway.protocol import GatewayError
from services.gateway.scheduler_client import HEALTH_MAX_AGE_S, facts_of
from services.gateway.side_channel import caller_of
from services.gateway.store import NOT_FOUND, StoreError
from services.gateway.validation import Context, StrictModel, validate
from services.gateway.vector_cache import CachedVector

log = structlog.get_logger()
router = APIRouter()

SPEC = 'a list of {"vector": id | tag | "concept:<name>", "scale": number, "layers": [ints], "positions": ' \
       '"all" | "prompt" | "generated"}'


async def model_facts(gw: Gateway) -> wire.ModelFacts:
    return facts_of(await gw.scheduler.health(max_age=HEALTH_MAX_AGE_S))


def model_shape(facts: wire.ModelFacts) -> tuple[int, int]:
    """The served model's (hidden size, decoder layers), as its ready workers told the scheduler;
    ``model_loading_error`` before one has."""
    if not (facts.hidden_size and facts.num_layers):
        raise GatewayError(MODEL_LOADING_ERROR, "the served model's shape is not known yet (no ready worker); retry "
                                                "shortly")
    return facts.hidden_size, facts.num_layers


def check_fits(what: str, hidden_size: int | None, layers: Iterable[int], model: tuple[int, int],
               param: str | None = None) -> None:
    """``invalid_request`` unless ``what``, of ``hidden_size`` (None: a concept's, the model's own) on ``layers``, fits
    the served ``model`` (hidden size, decoder layers)."""
    model_hidden, model_layers = model
    if hidden_size is not None and hidden_size != model_hidden:
        raise GatewayError(INVALID_REQUEST, f"{what} has hidden size {hidden_size}; the served model's is "
                                            f"{model_hidden}", param=param)
    if outside := sorted(layer for layer in layers if layer >= model_layers):
        raise GatewayError(INVALID_REQUEST, f"{what} has layers {outside} outside the served model's {model_layers} "
                                            f"decoder layers (0-{model_layers - 1})", param=param)


def _vector_json(info: wire.VectorInfo) -> dict[str, Any]:
    return {"id": info.id, "hidden_size": info.hidden_size, "layers": info.layers, "norms": info.norms,
            "tags": info.tags, "created": int(info.created_at)}


def _tag_json(info: wire.VectorTagInfo) -> dict[str, Any]:
    return {"tag": info.tag, "vector_id": info.vector_id, "updated_at": int(info.updated_at),
            "updated_by": info.updated_by}


async def _read_vector_file(request: Request, limit: int) -> bytes:
    """The body, read no further than ``limit`` bytes (_TooLarge past them)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _TooLarge(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise _TooLarge(limit)
    return bytes(body)


class _TooLarge(TillerError):
    def __init__(self, limit: int) -> None:
        super().__init__(INVALID_REQUEST, f"the vector file exceeds {limit} bytes (steering.max_vector_bytes)")


# -- vectors ----------------------------------------------------------------------------------------


@router.post("/v1/steering/vectors")
async def upload_vector(request: Request) -> Response:
    gw = gateway_of(request)
    try:
        caller = caller_of(request, gw.settings)
        tags = [t for value in request.query_params.getlist("tags") for t in value.split(",") if t]
        data = await _read_vector_file(request, gw.settings.steering.max_vector_bytes)
        try:
            vector: SteeringVector = await asyncio.to_thread(parse, data)
        except SteeringError as exc:
            raise GatewayError(INVALID_REQUEST, f"not a steering vector: {exc}") from None
        stored = await store_vector(gw, vector, caller, tags, "the uploaded vector")
    except _TooLarge as exc:
        return error_json(exc, status=413)
    except TillerError as exc:
        return error_json(exc)
    return JSONResponse(stored)


async def store_vector(gw: Gateway, vector: SteeringVector, who: Principal, tags: list[str],
                       what: str = "the vector") -> dict[str, Any]:
    """Store ``vector`` for ``who`` (an upload's, a build's), tagged, once it fits the served model; its answer."""
    check_fits(what, vector.hidden_size, vector.layers, model_shape(await model_facts(gw)))
    info = await gw.store.put_vector(who, encode(vector), tags)
    log.info("steering.vector_stored", vector_id=info.id, user=who.user, layers=len(info.layers), tags=info.tags)
    return _vector_json(info)


@router.get("/v1/steering/vectors")
async def list_vectors(request: Request) -> Response:
    async def listed(gw: Gateway, caller: Principal) -> dict[str, Any]:
        return {"vectors": [_vector_json(v) for v in await gw.store.list_vectors(caller)]}
    return await answer(request, listed)


@router.get("/v1/steering/vectors/{ref}")
async def get_vector(request: Request, ref: str) -> Response:
    async def found(gw: Gateway, caller: Principal) -> dict[str, Any]:
        return _vector_json(await gw.store.get_vector(ref, caller))
    return await answer(request, found)


@router.delete("/v1/steering/vectors/{vector_id}")
async def delete_vector(request: Request, vector_id: str) -> Response:
    async def deleted(gw: Gateway, caller: Principal) -> dict[str, Any]:
        await gw.store.delete_vector(vector_id, caller)
        log.info("steering.vector_deleted", vector_id=vector_id, user=caller.user)
        return {"id": vector_id, "deleted": True}
    return await answer(request, deleted)


# -- tags -------------------------------------------------------------------------------------------


class SetTags(StrictModel):
    vector_id: Annotated[str, Field(min_length=1)]
    tags: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]


@router.get("/v1/steering/tags")
async def get_tags(request: Request) -> Response:
    async def seen(gw: Gateway, caller: Principal) -> dict[str, Any]:
        return {"tags": [_tag_json(t) for t in await gw.store.vector_tags(caller)]}
    return await answer(request, seen)


@router.post("/v1/steering/tags")
async def set_tags(request: Request) -> Response:
    async def moved(gw: Gateway, caller: Principal) -> dict[str, Any]:
        body = validate(SetTags, await read_json_object(request), Context.of(gw.settings))
        return {"tags": [_tag_json(t) for t in await gw.store.tag_vector(body.vector_id, body.tags, caller)]}
    return await answer(request, moved)


# -- a request's steering ---------------------------------------------------------------------------


class TermSpec(StrictModel):
    """One entry of a client's steering (docs/steering.md): what it names, and the :class:`SteeringTerm` fields."""

    vector: Annotated[str, Field(min_length=1, max_length=200)]
    scale: float
    layers: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)] | None = None  # None: the vector's
    positions: Literal["all", "prompt", "generated"] = "all"


def parse_spec(spec: object, gw: Gateway) -> list[TermSpec]:
    """A client's steering checked for its shape and the request limits that need no vector: its count, each
    scale's bounds, layers named twice; ``invalid_request`` naming the entry and the setting."""
    limits = gw.settings.steering
    if not isinstance(spec, list):
        raise GatewayError(INVALID_REQUEST, f"steering must be {SPEC}", param="steering")
    if spec and limits.max_vectors_per_request == 0:
        raise GatewayError(INVALID_REQUEST, "steering is turned off on this server (steering.max_vectors_per_request "
                                            "= 0)", param="steering")
    if len(spec) > limits.max_vectors_per_request:
        raise GatewayError(INVALID_REQUEST, f"steering names {len(spec)} vectors; at most "
                                            f"{limits.max_vectors_per_request} are allowed "
                                            "(steering.max_vectors_per_request)", param="steering")
    context = Context.of(gw.settings)
    terms = [validate(TermSpec, entry, context, prefix=f"steering[{i}]") for i, entry in enumerate(spec)]
    for i, term in enumerate(terms):
        if abs(term.scale) > limits.max_scale:  # (NaN and Inf: refused by the model)
            raise GatewayError(INVALID_REQUEST, f"steering[{i}].scale: {term.scale} is outside "
                                                f"[-{limits.max_scale}, {limits.max_scale}] (steering.max_scale)",
                               param=f"steering[{i}].scale")
        if term.layers is not None and len(set(term.layers)) != len(term.layers):
            raise GatewayError(INVALID_REQUEST, f"steering[{i}].layers: a layer is named twice ({term.layers})",
                               param=f"steering[{i}].layers")
    return terms


def _check_concept(i: int, term: TermSpec, facts: wire.ModelFacts) -> None:
    """A concept term names a served readout concept; without layers it steers at the readout layers."""
    name, concepts = term.vector.removeprefix(CONCEPT_PREFIX), facts.readout_concepts
    if not name or (concepts and name not in concepts):
        raise GatewayError(INVALID_REQUEST, f"steering[{i}].vector: {name!r} is not a readout concept of this server "
                                            f"({', '.join(concepts)})", param=f"steering[{i}].vector")
    if term.layers is None and not facts.readout_layers:
        raise GatewayError(INVALID_REQUEST, f"steering[{i}].layers: the readout layers are not known yet; name the "
                                            "layers to steer", param=f"steering[{i}].layers")


async def _fetch(gw: Gateway, refs: list[str], who: Principal) -> dict[str, tuple[str, CachedVector]]:
    """Each ref -> (its vector id, the cached vector); the store says who may use what, the cache saves the bytes."""
    held = gw.vectors.snapshot()
    try:
        found = await gw.store.lookup_vectors(refs, who, cached=list(held))
    except StoreError as exc:
        code = INVALID_REQUEST if exc.code == NOT_FOUND else exc.code
        raise GatewayError(code, f"steering: {exc.message}", param="steering") from None
    resolved = {}
    for ref, vid in zip(refs, found.ids, strict=True):
        if vid in found.contents:
            held[vid] = gw.vectors.add(vid, found.contents[vid])
        elif vid in held:
            gw.vectors.touch(vid)
        else:
            raise GatewayError(INTERNAL_ERROR, f"the session store sent no content for steering vector {vid}")
        resolved[ref] = (vid, held[vid])
    return resolved


async def resolve_steering(gw: Gateway, spec: object, who: Principal) -> tuple[list[SteeringTerm], dict[str, bytes]]:
    """A client's steering (:data:`SPEC`) as the terms a ``Submit`` carries and the canonical content of every
    vector they name by id. Checked against ``settings.steering`` and the served model: each vector or tag must be
    one ``who`` reaches, of the model's hidden size, and every layer within the model and (for a vector) one the
    vector has; ``concept:<name>`` names a readout concept of the served model (any name passes while the gateway
    does not know them: the worker checks). Every refusal is a :class:`GatewayError` with a specific message
    (``invalid_request``; ``model_loading_error`` before the model's shape is known); a peer that does not answer
    is the TillerError its client raises, as on every other path."""
    if spec is None:  # (a request without steering)
        return [], {}
    terms = parse_spec(spec, gw)
    if not terms:
        return [], {}
    facts = await model_facts(gw)
    model = model_shape(facts)
    refs = list(dict.fromkeys(t.vector for t in terms if not t.vector.startswith(CONCEPT_PREFIX)))
    resolved = await _fetch(gw, refs, who) if refs else {}
    out: list[SteeringTerm] = []
    pairs = 0
    for i, term in enumerate(terms):
        if term.vector.startswith(CONCEPT_PREFIX):
            _check_concept(i, term, facts)
            name, layers = term.vector, set(term.layers or facts.readout_layers)
            check_fits(f"steering[{i}]", None, layers, model, param=f"steering[{i}].layers")
        else:
            name, cached = resolved[term.vector]
            check_fits(f"steering vector {name}", cached.hidden_size, cached.layers, model, param=f"steering[{i}]")
            layers = set(cached.layers if term.layers is None else term.layers)
            if missing := sorted(layers - cached.layers):
                raise GatewayError(INVALID_REQUEST, f"steering[{i}].layers: vector {name} has no direction for layers "
                                                    f"{missing} (it has {sorted(cached.layers)})",
                                   param=f"steering[{i}].layers")
        pairs += len(layers)
        out.append(SteeringTerm(vector=name, scale=term.scale, layers=sorted(layers) if term.layers or
                                name.startswith(CONCEPT_PREFIX) else [], positions=term.positions))
    if pairs > gw.settings.steering.max_layers_per_request:
        raise GatewayError(INVALID_REQUEST, f"steering adds {pairs} (vector, layer) pairs; at most "
                                            f"{gw.settings.steering.max_layers_per_request} are allowed "
                                            "(steering.max_layers_per_request)", param="steering")
    return out, {vid: cached.content for vid, cached in resolved.values()}
