"""Controller runtime: the main channel (step-synchronous, from the scheduler) and the side channel
(asynchronous, from the gateway), both ROUTER sockets speaking seed 001's shapes."""

from __future__ import annotations

import asyncio

import structlog
import zmq
import zmq.asyncio

from common import aici_wire
from common.config import Settings
from common.errors import WireError
from common.sockets import bind
from common.model_source import load_tokenizer

log = structlog.get_logger()


class ControllerRuntime:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.vocab_size = len(load_tokenizer(settings))
        ctx = zmq.asyncio.Context.instance()
        self.main = self._bind(ctx, settings.endpoint("controller_main"))
        self.side = self._bind(ctx, settings.endpoint("controller_side"))

    @staticmethod
    def _bind(ctx: zmq.asyncio.Context, endpoint: str) -> zmq.asyncio.Socket:
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        bind(sock, endpoint)
        return sock

    def handle_main(self, frame: bytes) -> dict:
        try:
            request = aici_wire.decode_main(frame)
        except WireError as exc:
            return aici_wire.error(str(exc))
        if isinstance(request, aici_wire.Ping):
            return aici_wire.ok({"pong": 1})
        return aici_wire.ok({"vocab_size": self.vocab_size})

    def handle_side(self, frame: bytes) -> dict:
        try:
            request = aici_wire.decode_side(frame)
        except WireError as exc:
            return aici_wire.error(str(exc))
        return aici_wire.error(f"unknown side-channel op {request.get('op')!r}", **{"$rid": request["$rid"]})

    async def _serve(self, sock: zmq.asyncio.Socket, handler) -> None:
        while True:
            parts = await sock.recv_multipart()
            if len(parts) < 2:
                continue
            reply = handler(parts[1])
            await sock.send_multipart([parts[0], aici_wire.encode(reply)])

    async def run(self) -> None:
        log.info("controller_runtime.ready", main=self.settings.endpoint("controller_main"),
                 side=self.settings.endpoint("controller_side"), vocab_size=self.vocab_size)
        await asyncio.gather(self._serve(self.main, self.handle_main), self._serve(self.side, self.handle_side))
