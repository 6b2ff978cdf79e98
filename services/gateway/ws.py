"""``ws://HOST:PORT/generate``: the WebSocket protocol.

One connection runs at most one generation at a time (a pump task sending its messages) while the
reader handles control and feedback messages. After a completion or an error the connection takes a
new ``config``. Bad client messages get an ``error`` without a ``request_id`` and change nothing
else; the connection stays open. A client that goes away frees its generation's sequence.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import structlog
from fastapi import APIRouter, WebSocket
from starlette.websockets import WebSocketState

from common.errors import INTERNAL_ERROR, INVALID_REQUEST, TillerError
from services.gateway.deps import Gateway, new_request_id
from services.gateway.driver import Generation, protocol_messages
from services.gateway.httputil import client_of, gateway_of, json_text, tenant_of
from services.gateway.protocol import ErrorMsg, GatewayError, StatusMsg
from services.gateway.side_channel import caller_of
from services.gateway.store import NOT_FOUND, StoreError
from services.gateway.validation import (
    Context,
    ControlMessage,
    FeedbackMessage,
    GenerateConfig,
    GenerationRequest,
    Options,
    ParametersPatch,
    parse_client_message,
    validate,
)

log = structlog.get_logger()

router = APIRouter()


@router.websocket("/generate")
async def generate_ws(websocket: WebSocket) -> None:
    await websocket.accept()
    await Connection(gateway_of(websocket), websocket).serve()


class Connection:
    def __init__(self, gw: Gateway, websocket: WebSocket) -> None:
        self._gw = gw
        self._ws = websocket
        self._context = Context.of(gw.settings)
        self._client = client_of(websocket)
        self._tenant = tenant_of(websocket)
        self._send_lock = asyncio.Lock()
        self._configured = False
        self._generation: Generation | None = None  # the running one, or the last one
        self._earlier_rid: str | None = None  # the last generation before it that was started (init sent)
        self._options = Options()
        self._pump: asyncio.Task[None] | None = None

    async def serve(self) -> None:
        try:
            while True:
                event = await self._ws.receive()
                if event["type"] == "websocket.disconnect":
                    break
                await self._on_frame(event.get("text") or event.get("bytes") or b"")
        finally:
            await self._stop_pump()

    async def _send(self, message: dict[str, Any]) -> None:
        async with self._send_lock:
            if self._ws.application_state is WebSocketState.CONNECTED:
                await self._ws.send_text(json_text(message))

    async def _on_frame(self, raw: str | bytes) -> None:
        kind = None
        try:
            message = parse_client_message(raw, self._gw.settings.limits.max_json_depth)
            kind = message.pop("type")
            if kind == "config":
                await self._on_config(message)
            elif not self._configured:
                raise GatewayError(
                    INVALID_REQUEST, f"the first message must be a config message, not {kind!r}", param="type"
                )
            elif kind == "control":
                await self._on_control(validate(ControlMessage, message, self._context))
            else:
                await self._on_feedback(validate(FeedbackMessage, message, self._context))
        except TillerError as exc:
            if kind in (None, "config"):  # a request refused (a control or feedback message is no request)
                self._gw.metrics.refused("websocket", exc.code)
            await self._send(ErrorMsg.from_error(exc).to_json())
        except Exception as exc:  # a bug or a broken peer socket must not end the connection
            log.exception("ws.message_failed")
            await self._send(
                ErrorMsg.from_error(TillerError(INTERNAL_ERROR, f"the gateway failed this message: {exc}")).to_json()
            )

    # -- config and the generation pump ---------------------------------------------------------

    def _running(self) -> Generation | None:
        gen = self._generation
        return gen if gen is not None and not gen.finished else None

    async def _on_config(self, message: dict[str, Any]) -> None:
        self._configured = True
        if self._running():
            raise GatewayError(
                INVALID_REQUEST,
                "a generation is already running on this connection; stop it or wait for its completion",
                param="type",
            )
        config = validate(GenerateConfig, message, self._context)
        self._options = config.options
        await self._start(config.to_request())

    async def _start(self, request: GenerationRequest) -> None:
        previous = self._pump
        if previous is not None:  # its generation is finished: let it flush its last message
            await asyncio.gather(previous, return_exceptions=True)
        if self._generation is not None and self._generation.initialized:
            self._earlier_rid = self._generation.rid
        caller = caller_of(self._ws, self._gw.settings) if request.controller else None
        gen = Generation(
            self._gw, request, rid=new_request_id("gen_"), surface="websocket", client=self._client,
            tenant=self._tenant, caller=caller,
        )
        self._generation = gen
        self._pump = asyncio.get_running_loop().create_task(self._run_pump(gen, self._options))

    async def _run_pump(self, gen: Generation, options: Options) -> None:
        try:
            async with contextlib.aclosing(protocol_messages(gen, options)) as messages:
                async for message in messages:
                    await self._send(message)
        except Exception:  # the socket failed under us: the reader sees the disconnect
            log.info("ws.send_failed", request_id=gen.rid, exc_info=True)

    async def _stop_pump(self) -> None:
        """Cancel the pump, if any: its generation frees the scheduler's sequence on the way out."""
        pump, self._pump = self._pump, None
        if pump is not None and not pump.done():
            pump.cancel()
            await asyncio.gather(pump, return_exceptions=True)

    # -- control and feedback -------------------------------------------------------------------

    async def _on_control(self, control: ControlMessage) -> None:
        if control.action == "regenerate":
            await self._regenerate()
            return
        gen = self._running()
        if gen is None:
            raise GatewayError(INVALID_REQUEST, f"cannot {control.action}: no generation is running", param="action")
        if control.action == "stop":
            await gen.stop()  # acknowledged by the completion (finish_reason "cancelled")
        elif control.action == "pause":
            await gen.pause()
            await self._send(StatusMsg("pause", 100, "generation paused", extra={"request_id": gen.rid}).to_json())
        elif control.action == "resume":
            await gen.resume()
            await self._send(StatusMsg("resume", 100, "generation resumed", extra={"request_id": gen.rid}).to_json())
        else:
            patch = validate(ParametersPatch, control.parameters, self._context, prefix="parameters")
            await gen.modify(patch)
            applied = patch.model_dump(exclude_unset=True)
            await self._send(
                StatusMsg(
                    "modify", 100, "parameters updated", extra={"request_id": gen.rid, "parameters": applied}
                ).to_json()
            )

    async def _regenerate(self) -> None:
        """Cancel the running generation (it sends nothing more) and run the current configuration
        again, modifications included, under a fresh ``init``."""
        previous = self._generation
        if previous is None:
            raise GatewayError(INVALID_REQUEST, "cannot regenerate: no generation has been configured", param="action")
        await self._stop_pump()
        await self._start(previous.request)

    async def _on_feedback(self, feedback: FeedbackMessage) -> None:
        """Feedback is for the running generation, else the last one that started."""
        gen = self._generation
        if gen is not None:
            await gen.settled()  # a config just sent: its request id exists in a moment
        rid = gen.rid if gen is not None and gen.initialized else self._earlier_rid
        if rid is None:
            raise GatewayError(INVALID_REQUEST, "no generation on this connection to give feedback on", param="type")
        try:
            feedback_id = await self._gw.store.record_feedback(
                rid, self._tenant.principal, rating=feedback.rating, text=feedback.text, position=feedback.position
            )
        except StoreError as exc:
            code = INVALID_REQUEST if exc.code == NOT_FOUND else exc.code
            raise TillerError(code, f"feedback not recorded: {exc.message}") from None
        extra = {"request_id": rid, "feedback_id": feedback_id}
        await self._send(StatusMsg("feedback", 100, "feedback recorded", extra=extra).to_json())
