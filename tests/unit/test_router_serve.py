"""A Router read from the event loop's reader callback (``Router.serve``), over real sockets: every
message reaches the handler while the router sends at the same time (ZeroMQ's descriptor is
edge-triggered: a send can take the wake-up of a message that arrived meanwhile), and a malformed
frame is answered with an error while the messages around it go through."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from common import wire
from common.sockets import Dealer, Router

MESSAGES = 300


async def test_every_message_reaches_the_handler_while_the_router_sends(tmp_path) -> None:
    ctx = zmq.asyncio.Context.instance()
    endpoint = f"ipc://{tmp_path}/served.sock"
    router = Router(ctx, endpoint)
    pushed: list[wire.Message] = []
    dealer = Dealer(ctx, endpoint, on_message=lambda msg, _: pushed.append(msg))
    received: list[wire.Message] = []
    peers: set[bytes] = set()

    def handle(identity: bytes, msg: wire.Message, _binary: list[bytes]) -> None:
        received.append(msg)
        peers.add(identity)
        router.post(identity, wire.Ok(mid=msg.mid))  # a reply from inside the handler

    async def push() -> None:  # sends from outside the handler, between the requests' arrivals
        while len(pushed) < MESSAGES:
            for identity in peers:
                router.post(identity, wire.Alive(service="test", incarnation="pushed"))
            await asyncio.sleep(0.0005)  # ZeroMQ lets a send take in pending commands once a millisecond

    router.serve(handle)
    pusher: asyncio.Future[None] = asyncio.ensure_future(asyncio.sleep(0))
    try:
        dealer.start()
        pusher = asyncio.ensure_future(push())
        # one at a time: each arrival after the router found nothing left is a fresh wake-up to lose
        replies = [await dealer.request(wire.Cancel(rid=str(i)), timeout=2) for i in range(MESSAGES)]
        await asyncio.wait_for(pusher, 10)
        assert sorted(int(m.rid) for m in received if isinstance(m, wire.Cancel)) == list(range(MESSAGES))
        assert all(isinstance(reply, wire.Ok) for reply, _ in replies)
        assert all(isinstance(msg, wire.Alive) for msg in pushed)
    finally:
        pusher.cancel()
        dealer.close()
        router.close()


async def test_a_malformed_frame_is_answered_and_the_next_message_goes_through(tmp_path) -> None:
    ctx = zmq.asyncio.Context.instance()
    endpoint = f"ipc://{tmp_path}/served.sock"
    router = Router(ctx, endpoint)
    received: list[wire.Message] = []
    router.serve(lambda identity, msg, binary: received.append(msg))
    peer = ctx.socket(zmq.DEALER)
    peer.connect(endpoint)
    try:
        await peer.send(b"\xc1 not msgpack")
        reply = wire.decode((await asyncio.wait_for(peer.recv_multipart(), 5))[0])
        assert isinstance(reply, wire.Error) and reply.code == "invalid_request"
        await peer.send(wire.encode(wire.Cancel(rid="after")))
        for _ in range(50):
            if received:
                break
            await asyncio.sleep(0.05)
        assert [m.rid for m in received if isinstance(m, wire.Cancel)] == ["after"]
    finally:
        peer.close(0)
        router.close()
