"""The gateway's link to the session store: request records and Evergreen node mirroring
(fire-and-forget, never on the token path), feedback, and lookups."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import structlog
import zmq.asyncio

from common import wire
from common.config import Settings
from common.errors import ERROR_TRAITS, INTERNAL_ERROR, TillerError
from common.sockets import Dealer

log = structlog.get_logger()

NOT_FOUND = "not_found"


class StoreError(TillerError):
    """A session store refusal; ``code`` may be ``not_found``, which has no WebSocket error type."""


class StoreClient:
    def __init__(self, settings: Settings, ctx: zmq.asyncio.Context) -> None:
        self._dealer = Dealer(ctx, settings.endpoint("session_store"))
        self._background: set[asyncio.Task[None]] = set()

    def close(self) -> None:
        for task in self._background:
            task.cancel()
        self._dealer.close()

    async def _ok(self, msg: wire.Msg) -> dict[str, Any]:
        what = type(msg).__name__
        try:
            reply, _ = await self._dealer.request(msg)
        except TimeoutError:
            raise StoreError(INTERNAL_ERROR, f"the session store did not answer {what}; is it running?") from None
        if isinstance(reply, wire.Ok):
            return reply.data
        if isinstance(reply, wire.Error):
            code = reply.code if reply.code in ERROR_TRAITS or reply.code == NOT_FOUND else INTERNAL_ERROR
            raise StoreError(code, reply.message)
        raise StoreError(INTERNAL_ERROR, f"unexpected reply from the session store to {what}: {type(reply).__name__}")

    def _fire(self, msg: wire.Msg) -> None:
        task = asyncio.get_running_loop().create_task(self._logged(msg))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _logged(self, msg: wire.Msg) -> None:
        try:
            await self._ok(msg)
        except StoreError as exc:
            log.warning("store.record_failed", type=type(msg).__name__, code=exc.code, error=exc.message)

    def record_request(self, rid: str, *, surface: str, model: str, prompt: str, params: dict[str, Any]) -> None:
        self._fire(
            wire.RecordRequest(
                rid=rid, surface=surface, model=model, prompt=prompt, params=params, created_at=time.time()
            )
        )

    def record_completion(
        self,
        rid: str,
        *,
        generated_text: str,
        finish_reason: str,
        prompt_tokens: int,
        completion_tokens: int,
        error: str = "",
    ) -> None:
        self._fire(
            wire.RecordCompletion(
                rid=rid,
                generated_text=generated_text,
                finish_reason=finish_reason,
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                error=error,
            )
        )

    async def record_feedback(self, rid: str, *, rating: float, text: str | None, position: int | None) -> int:
        data = await self._ok(wire.RecordFeedback(rid=rid, rating=rating, text=text or "", position=position))
        return int(data["feedback_id"])

    async def get_request(self, rid: str) -> dict[str, Any]:
        return await self._ok(wire.GetRequest(rid=rid))

    # -- Evergreen node graphs (the gateway holds the live graph; the store mirrors it) ------

    def evergreen_put(self, session_id: str, fragments: list[wire.EvergreenFragment]) -> None:
        self._fire(wire.EvergreenPut(session_id=session_id, fragments=fragments))

    def evergreen_drop(self, session_id: str, node_ids: list[str]) -> None:
        self._fire(wire.EvergreenDrop(session_id=session_id, node_ids=node_ids))

    def evergreen_close(self, session_id: str) -> None:
        self._fire(wire.EvergreenClose(session_id=session_id))

    async def evergreen_fragments(self, session_id: str) -> list[list[Any]]:
        """``[node_id, seq, serialized NodeFragment]`` of every stored fragment of a session."""
        return (await self._ok(wire.EvergreenGetNodes(session_id=session_id)))["fragments"]
