"""The gateway's ASGI app: every HTTP/WebSocket surface on one FastAPI app; gRPC beside it in the same loop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import structlog
import zmq.asyncio
from fastapi import FastAPI

from common.config import Settings
from common.model_source import load_tokenizer
from common.service import release_freed_memory
from services.gateway import (aici_rest, embeddings, openai_api, ops, responses, rest, steering, steering_build,
                              tokenize_api, ws)
from services.gateway.token_gate import TokenGate
from services.gateway.deps import Gateway
from services.gateway.scheduler_client import SchedulerClient
from services.gateway.grpc_server import start_grpc, stop_grpc
from services.gateway.metrics import Metrics
from services.gateway.ratelimit import RateLimiter
from services.gateway.side_channel import SideChannel
from services.gateway.store import StoreClient
from services.gateway.text import TextProcessor

log = structlog.get_logger()

# the modules whose ``router`` serves the HTTP routes and the WebSocket
ROUTER_MODULES = (ws, rest, openai_api, embeddings, responses, tokenize_api, ops, aici_rest, steering_build, steering)


def create_app(settings: Settings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tokenizer = await asyncio.to_thread(load_tokenizer, settings)
        text = TextProcessor(tokenizer, settings.limits.content_filter_patterns)
        await text.load_token_texts()
        text_streams = await text.event_text_streams()
        release_freed_memory()
        ctx = zmq.asyncio.Context()
        store = StoreClient(settings, ctx)
        shared = settings.distributed.gateways > 1  # several gateways on the port: one rate window, in the store
        gw = Gateway(
            settings=settings,
            scheduler=SchedulerClient(settings, ctx, text_streams),
            store=store,
            text=text,
            limiter=RateLimiter(settings.limits.rate_limit_per_minute, remote=store.rate_hit if shared else None),
            metrics=Metrics(),
            created=int(time.time()),
            side=SideChannel(settings, ctx),
        )
        gw.scheduler.start()
        gw.store.start()
        gw.side.start()
        app.state.gateway = gw
        grpc_server = await start_grpc(gw)
        log.info("gateway.ready", host=settings.http_host, port=settings.http_port, model=settings.served_model_name)
        try:
            yield
        finally:
            await stop_grpc(grpc_server, settings.shutdown_grace_s)
            gw.scheduler.close()
            gw.side.close()
            gw.store.close()
            text.close()
            ctx.term()

    app = FastAPI(title="Tiller gateway", lifespan=lifespan)
    for module in ROUTER_MODULES:
        app.include_router(module.router)
    if settings.api_auth.everywhere and settings.api_auth.tokens:
        app.add_middleware(TokenGate, settings=settings)
    return app
