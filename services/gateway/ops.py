"""Operational endpoints: ``GET /health``, ``GET /ready``, ``GET /metrics``, ``GET /v1/requests/{id}``."""

from __future__ import annotations

import os

import msgspec
from fastapi import APIRouter
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from common import wire
from common.errors import ERROR_TRAITS, TillerError
from services.gateway.scheduler_client import HEALTH_MAX_AGE_S, facts_of, worker_stage
from services.gateway.httputil import gateway_of, tenant_of
from services.gateway.store import NOT_FOUND, StoreError

router = APIRouter()


def assess(reply: wire.HealthReply, store_answers: bool, side_connected: bool) -> tuple[bool, list[str]]:
    """Whether plain generation works (the scheduler has a ready worker), and what is degraded: the
    parts that are down while it works, or why it does not."""
    stage = worker_stage(reply)
    serving = stage.stage == "ready"
    degraded = [] if serving else [f"worker: {stage.stage} ({stage.message or 'no detail'})"]
    runtime = facts_of(reply).controller_runtime or "ok"
    if runtime != "ok" or not side_connected:
        degraded.append(f"controller_runtime: {runtime if runtime != 'ok' else 'not connected'} "
                        "(controlled requests and module uploads fail; plain generation works)")
    if not store_answers:
        degraded.append("session_store: not answering (Salience sessions and request records fail)")
    return serving, degraded


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 while plain generation works (the scheduler answers and has a ready worker), else 503; the
    body's ``degraded`` names what is down: ``status`` is ``ready``, ``degraded``, ``not_ready`` or
    ``unavailable`` (no scheduler). ``pid`` is the gateway's (`tiller up` checks that the gateway it
    started is the one answering)."""
    gw = gateway_of(request)
    try:
        reply = await gw.scheduler.health()
    except TillerError as exc:
        return JSONResponse({"status": "unavailable", "message": exc.message, "scheduler": None,
                             "degraded": [f"scheduler: {exc.message}"], "pid": os.getpid()}, status_code=503)
    store_answers = await gw.store.answers()
    serving, degraded = assess(reply, store_answers, gw.side is None or gw.side.connected)
    body = {
        "status": ("degraded" if degraded else "ready") if serving else "not_ready",
        "degraded": degraded,
        "model": gw.settings.served_model_name,
        "pid": os.getpid(),
        "scheduler": msgspec.to_builtins(facts_of(reply)),
    }
    return JSONResponse(body, status_code=200 if serving else 503)


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    """For load balancers: 200 while plain generation works, else 503; cheap (a health reply up to a
    second old is reused)."""
    try:
        reply = await gateway_of(request).scheduler.health(max_age=HEALTH_MAX_AGE_S)
    except TillerError as exc:
        return JSONResponse({"ready": False, "reason": exc.message}, status_code=503)
    stage = worker_stage(reply)
    if stage.stage != "ready":
        return JSONResponse({"ready": False, "reason": f"worker: {stage.stage}"}, status_code=503)
    return JSONResponse({"ready": True})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    gw = gateway_of(request)
    health = gw.scheduler.recent_health(max_age=1.0)  # never waits: without a scheduler the gauges stay as they were
    if health is not None:
        gw.metrics.observe_engine(facts_of(health))
    gw.metrics.scheduler_up.set(gw.scheduler.health_age() <= gw.settings.limits.peer_silence_s)
    return Response(gw.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/requests/{rid}")
async def get_request(request: Request, rid: str) -> JSONResponse:
    """A request's record in the session store, feedback included (404 for another user's, as for an unknown id)."""
    try:
        record = await gateway_of(request).store.get_request(rid, tenant_of(request).principal)
        return JSONResponse(msgspec.to_builtins(record))
    except StoreError as exc:
        status = 404 if exc.code == NOT_FOUND else ERROR_TRAITS[exc.code][2]
        return JSONResponse({"error": {"type": exc.code, "message": exc.message}}, status_code=status)
