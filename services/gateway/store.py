"""The gateway's link to the session store: request records and Evergreen node mirroring
(fire-and-forget, never on the token path), feedback, lookups and steering vectors; and the heartbeat that keeps
what this gateway holds there (:class:`Holdings`) from lapsing."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any, TypeVar

import structlog
import zmq.asyncio

from common import wire
from common.config import Settings
from common.errors import ERROR_TRAITS, INTERNAL_ERROR, TillerError
from common.incarnation import process_incarnation
from common.sockets import Dealer

log = structlog.get_logger()

NOT_FOUND = "not_found"

R = TypeVar("R", bound=wire.Msg)
RATE_HIT_TIMEOUT_S = 1.0  # a rate check the store leaves unanswered this long admits the request


class StoreError(TillerError):
    """A session store refusal; ``code`` may be ``not_found``, which has no WebSocket error type."""


class Holdings:
    """What this gateway holds at the session store and renews with each heartbeat: the busy leases of
    the Salience sessions it runs a Generate on, and its live Evergreen sessions' node rows. Should the
    gateway die, the heartbeats stop and the store lets them go (``sessions.busy_lease_s``)."""

    def __init__(self) -> None:
        self.leases: Counter[str] = Counter()
        self.evergreen: set[str] = set()

    @contextlib.contextmanager
    def lease(self, session_id: str) -> Iterator[None]:
        self.leases[session_id] += 1
        try:
            yield
        finally:
            self.leases[session_id] -= 1
            if self.leases[session_id] <= 0:
                del self.leases[session_id]

    def heartbeat(self) -> wire.GatewayAlive | None:
        """The heartbeat to send (None: nothing is held)."""
        if not (self.leases or self.evergreen):
            return None
        return wire.GatewayAlive(incarnation=process_incarnation(), leases=sorted(self.leases),
                                 evergreen=sorted(self.evergreen))


class StoreClient:
    def __init__(self, settings: Settings, ctx: zmq.asyncio.Context) -> None:
        self._dealer = Dealer(ctx, settings.endpoint("session_store"), curve=settings.curve)
        self._background: set[asyncio.Task[None]] = set()
        self._heartbeat_s = settings.limits.gateway_heartbeat_s
        self.holdings = Holdings()

    def start(self) -> None:
        task = asyncio.get_running_loop().create_task(self._keep_alive())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _keep_alive(self) -> None:
        while True:
            await asyncio.sleep(self._heartbeat_s)
            if (beat := self.holdings.heartbeat()) is None:
                continue
            try:
                await self._dealer.request(beat, timeout=self._heartbeat_s)
            except TimeoutError:
                log.debug("store.heartbeat_unanswered")

    def close(self) -> None:
        for task in self._background:
            task.cancel()
        self._dealer.close()

    async def _ask(self, msg: wire.Msg, expect: type[R], timeout: float = 10.0) -> R:
        """Send ``msg`` and return its reply, which must be an ``expect``; anything else raises StoreError."""
        what = type(msg).__name__
        try:
            reply, _ = await self._dealer.request(msg, timeout=timeout)
        except TimeoutError:
            raise StoreError(INTERNAL_ERROR, f"the session store did not answer {what}; is it running?") from None
        if isinstance(reply, expect):
            return reply
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
            await self._ask(msg, wire.Ok)
        except StoreError as exc:
            log.warning("store.record_failed", type=type(msg).__name__, code=exc.code, error=exc.message)

    def record_request(self, rid: str, *, owner: str, surface: str, model: str, prompt: str,
                       params: dict[str, Any]) -> None:
        self._fire(
            wire.RecordRequest(
                rid=rid, owner=owner, surface=surface, model=model, prompt=prompt, params=params, created_at=time.time()
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

    async def record_feedback(self, rid: str, caller: wire.Principal, *, rating: float, text: str | None,
                              position: int | None) -> int:
        msg = wire.RecordFeedback(rid=rid, caller=caller, rating=rating, text=text or "", position=position)
        return (await self._ask(msg, wire.FeedbackRecorded)).feedback_id

    async def rate_hit(self, client: str) -> float | None:
        """Count one request of ``client`` in the store's rate window: None when admitted, else the seconds
        until a retry can be (several gateways share one limit; services/gateway/ratelimit.py)."""
        return (await self._ask(wire.RateHit(client=client), wire.RateVerdict, RATE_HIT_TIMEOUT_S)).retry_after_s

    async def answers(self, timeout: float = 0.5) -> bool:
        """Whether the session store answers a Health request within ``timeout`` seconds."""
        try:
            reply, _ = await self._dealer.request(wire.Health(), timeout=timeout)
        except TimeoutError:
            return False
        return isinstance(reply, wire.HealthReply)

    async def get_request(self, rid: str, caller: wire.Principal) -> wire.RequestRecord:
        return (await self._ask(wire.GetRequest(rid=rid, caller=caller), wire.RequestRecordReply)).record

    # -- stored responses (the OpenAI Responses API) ------------------------------------------

    async def put_response(self, msg: wire.ResponsePut) -> None:
        await self._ask(msg, wire.Ok)

    async def get_response(self, response_id: str) -> wire.ResponseRecord:
        """StoreError ``not_found``: unknown, deleted or past its TTL."""
        return await self._ask(wire.ResponseGet(response_id=response_id), wire.ResponseRecord)

    async def delete_response(self, response_id: str) -> None:
        await self._ask(wire.ResponseDelete(response_id=response_id), wire.Ok)

    # -- Evergreen node graphs (the gateway holds the live graph; the store mirrors it) ------

    def evergreen_put(self, session_id: str, fragments: list[wire.EvergreenFragment]) -> None:
        self._fire(wire.EvergreenPut(session_id=session_id, fragments=fragments))

    def evergreen_drop(self, session_id: str, node_ids: list[str]) -> None:
        self._fire(wire.EvergreenDrop(session_id=session_id, node_ids=node_ids))

    def evergreen_close(self, session_id: str) -> None:
        self._fire(wire.EvergreenClose(session_id=session_id))

    # -- steering vectors (docs/steering.md, "Vectors") -----------------------------------------

    async def put_vector(self, caller: wire.Principal, content: bytes, tags: list[str]) -> wire.VectorInfo:
        """Store a canonical vector as ``caller``'s, with ``tags`` (all or nothing)."""
        return (await self._ask(wire.VectorPut(caller=caller, content=content, tags=tags), wire.VectorReply)).info

    async def get_vector(self, ref: str, caller: wire.Principal) -> wire.VectorInfo:
        """StoreError ``not_found``: unknown, deleted, or not ``caller``'s to reach."""
        return (await self._ask(wire.VectorGet(ref=ref, caller=caller), wire.VectorReply)).info

    async def list_vectors(self, caller: wire.Principal) -> list[wire.VectorInfo]:
        return (await self._ask(wire.VectorList(caller=caller), wire.VectorInfos)).vectors

    async def delete_vector(self, vector_id: str, caller: wire.Principal) -> None:
        await self._ask(wire.VectorDelete(vector_id=vector_id, caller=caller), wire.Ok)

    async def tag_vector(self, vector_id: str, tags: list[str], caller: wire.Principal) -> list[wire.VectorTagInfo]:
        return (await self._ask(wire.VectorTag(vector_id=vector_id, tags=tags, caller=caller), wire.VectorTags)).tags

    async def vector_tags(self, caller: wire.Principal) -> list[wire.VectorTagInfo]:
        return (await self._ask(wire.VectorTagList(caller=caller), wire.VectorTags)).tags

    async def lookup_vectors(self, refs: list[str], caller: wire.Principal, cached: list[str]) -> wire.VectorFound:
        """The ids ``refs`` name for ``caller`` and the content of those not ``cached``; StoreError ``not_found``
        naming the first ref ``caller`` does not reach."""
        return await self._ask(wire.VectorLookup(refs=refs, caller=caller, cached=cached), wire.VectorFound)
