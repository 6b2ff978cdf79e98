"""A client that leaves cancels its request's task, and that cancellation must win even when the
awaited event (a token, a reply) lands in the same turn of the event loop.

Python 3.11's ``asyncio.wait_for`` loses the cancellation in that case: it returns the event and the
task goes on. A non-streaming request whose client disconnected then generated to ``max_tokens`` for
nobody (seen once in a few dozen disconnects under load). Each test delivers the event and cancels
the task after every possible number of loop turns, and requires the cancellation to end the task
whenever it had not finished already.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import pytest
import zmq
import zmq.asyncio

from common import wire
from common.config import Settings
from common.sockets import Dealer, Router
from services.gateway.driver import Generation
from services.gateway.tenants import identify

TURNS = range(6)  # loop turns between delivering the event and cancelling


async def cancel_after_delivery(start: Callable[[], Awaitable[Any]], deliver: Callable[[], None], turns: int) -> str:
    """Start a task, let it block, ``deliver`` its event, wait ``turns`` loop turns, cancel it:
    'cancelled', or 'finished' when it had completed before the cancellation."""
    task = asyncio.ensure_future(start())
    for _ in range(3):
        await asyncio.sleep(0)
    assert not task.done(), "the task should be waiting for its event"
    deliver()
    for _ in range(turns):
        await asyncio.sleep(0)
    if task.done():
        task.result()
        return "finished"
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        return "cancelled"
    return "went on after its cancellation"


@pytest.mark.parametrize("turns", TURNS)
async def test_a_generation_waiting_for_tokens_ends_when_cancelled(turns: int) -> None:
    queue: asyncio.Queue[wire.TokenEvent | wire.RequestFailed] = asyncio.Queue()
    gateway = SimpleNamespace(settings=Settings())
    generation = Generation(gateway, request=None, rid="gen_1", surface="test", client="127.0.0.1",
                            tenant=identify({}, gateway.settings))  # type: ignore[arg-type]

    async def consume() -> list[Any]:
        return [msg async for msg in generation._consume(queue)]

    def token_failure() -> None:  # an item that ends _consume at once, without more gateway state
        queue.put_nowait(wire.RequestFailed(rid="gen_1", code="internal_error", message="x"))

    outcome = await cancel_after_delivery(consume, token_failure, turns)
    assert outcome == "cancelled" if turns == 0 else outcome in ("cancelled", "finished")


@pytest.mark.parametrize("turns", TURNS)
async def test_a_request_to_a_peer_ends_when_cancelled_as_its_reply_lands(turns: int, tmp_path) -> None:
    ctx = zmq.asyncio.Context.instance()
    endpoint = f"ipc://{tmp_path}/peer.sock"
    router = Router(ctx, endpoint)
    dealer = Dealer(ctx, endpoint)
    try:
        def reply() -> None:  # as the dealer's reader resolves a reply
            mid = max(dealer._pending)
            dealer._pending.pop(mid).set_result((wire.Ok(mid=mid), []))

        outcome = await cancel_after_delivery(lambda: dealer.request(wire.Health(), timeout=5.0), reply, turns)
        assert outcome == "cancelled" if turns == 0 else outcome in ("cancelled", "finished")
    finally:
        dealer.close()
        router.sock.close(0)
