"""A Dealer with ``immediate`` over real sockets: a request made while its peer is down, and given up
(abandoned or timed out), never reaches the peer's next life; ZeroMQ's default would deliver it."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from common import wire
from common.sockets import Dealer, PeerLost, Router


async def next_message(router: Router, timeout: float) -> wire.Message | None:
    try:
        _, msg, _ = await asyncio.wait_for(router.recv(), timeout)
    except asyncio.TimeoutError:
        return None
    return msg


@pytest.mark.parametrize("give_up", ["abandoned", "timed out"])
async def test_a_request_given_up_while_the_peer_was_down_is_never_delivered(give_up: str, tmp_path) -> None:
    ctx = zmq.asyncio.Context.instance()
    endpoint = f"ipc://{tmp_path}/peer.sock"
    router = Router(ctx, endpoint)
    dealer = Dealer(ctx, endpoint, immediate=True)
    try:
        dealer.start()
        await dealer.send(wire.Health())
        assert isinstance(await next_message(router, 5.0), wire.Health)
        router.sock.close(0)  # the peer dies
        await asyncio.sleep(0.2)
        stale = asyncio.ensure_future(dealer.request(wire.Cancel(rid="stale"), timeout=0.5))
        if give_up == "abandoned":
            await asyncio.sleep(0.1)
            dealer.abandon("the peer was lost")
            with pytest.raises(PeerLost):
                await stale
        else:
            with pytest.raises(TimeoutError):
                await stale
        router = Router(ctx, endpoint)  # its next life
        await asyncio.sleep(0.3)
        await dealer.send(wire.Cancel(rid="fresh"))
        first = await next_message(router, 5.0)
        assert isinstance(first, wire.Cancel) and first.rid == "fresh", first
        assert await next_message(router, 0.3) is None
    finally:
        dealer.close()
        router.sock.close(0)
