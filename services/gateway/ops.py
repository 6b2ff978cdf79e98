"""Operational endpoints: ``GET /health``, ``GET /metrics``, ``GET /v1/requests/{id}``."""

from __future__ import annotations

import os

from fastapi import APIRouter
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from common.errors import ERROR_TRAITS, TillerError
from services.gateway.httputil import gateway_of
from services.gateway.store import NOT_FOUND, StoreError

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 when the scheduler answers and its worker is ready, else 503; the body has the detail and
    the gateway's pid (`tiller up` checks that the gateway it started is the one answering)."""
    gw = gateway_of(request)
    try:
        reply = await gw.engine.health()
    except TillerError as exc:
        return JSONResponse({"status": "unavailable", "message": exc.message, "scheduler": None, "pid": os.getpid()},
                            status_code=503)
    body = {
        "status": "ready" if reply.ready else "not_ready",
        "model": gw.settings.served_model_name,
        "pid": os.getpid(),
        "scheduler": reply.detail,
    }
    return JSONResponse(body, status_code=200 if reply.ready else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    gw = gateway_of(request)
    health = gw.engine.recent_health(max_age=1.0)  # never waits: without a scheduler the gauges stay as they were
    if health is not None:
        gw.metrics.observe_engine(health.detail)
    return Response(gw.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/requests/{rid}")
async def get_request(request: Request, rid: str) -> JSONResponse:
    """A request's record in the session store, feedback included."""
    try:
        return JSONResponse(await gateway_of(request).store.get_request(rid))
    except StoreError as exc:
        status = 404 if exc.code == NOT_FOUND else ERROR_TRAITS[exc.code][2]
        return JSONResponse({"error": {"type": exc.code, "message": exc.message}}, status_code=status)
