"""The scheduler's end of the controller runtime's main channel against a scripted peer (a real ROUTER on an
ipc:// socket): a reply, a runtime that does not answer in time, a connection that drops during a call, and
no runtime at all. Each failed call names why, and the next call works on a fresh socket."""

from __future__ import annotations

import asyncio
import time

import zmq
import zmq.asyncio

from common import aici_wire
from services.scheduler.main_channel import MainChannel


class Peer:
    """A ROUTER at the runtime's endpoint that answers Ping with Pong unless told to stay silent."""

    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.silent = False
        self.received = 0
        self.task = asyncio.create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            identity, frame = await self.sock.recv_multipart()
            self.received += 1
            assert isinstance(aici_wire.decode_main(frame), aici_wire.Ping)
            if not self.silent:
                reply = aici_wire.MainOk(data=aici_wire.Pong(), incarnation="peer-1")
                await self.sock.send_multipart([identity, aici_wire.encode(reply)])

    def close(self) -> None:
        self.task.cancel()
        self.sock.close(0)


async def test_a_reply_a_silent_runtime_and_a_dropped_connection(tmp_path):
    endpoint = f"ipc://{tmp_path}/main.sock"
    peer = Peer(endpoint)
    channel = MainChannel(endpoint)
    try:
        reply = await channel.call(aici_wire.Ping(), timeout_s=5)
        assert reply.error == "" and isinstance(reply.data, aici_wire.Pong) and channel.incarnation == "peer-1"

        peer.silent = True
        started = time.monotonic()
        reply = await channel.call(aici_wire.Ping(), timeout_s=0.3)
        assert reply.error == "the controller runtime did not answer ping within 0.3 s"
        assert 0.3 <= time.monotonic() - started < 2
        peer.silent = False
        assert await channel.ping() == "ok"  # on the socket that replaced the silent one

        peer.silent = True
        call = asyncio.create_task(channel.call(aici_wire.Ping(), timeout_s=30))
        while peer.received < 4:
            await asyncio.sleep(0.01)
        started = time.monotonic()
        peer.close()  # the runtime dies with the call under way
        reply = await asyncio.wait_for(call, 5)
        assert reply.error.startswith("the controller runtime's connection dropped during ping"), reply.error
        assert time.monotonic() - started < 2

        reply = await channel.call(aici_wire.Ping(), timeout_s=5)  # nobody there now: refused at once
        assert reply.error.startswith("the controller runtime's connection dropped") and "was not sent" in reply.error
        assert await channel.ping() == "unreachable"

        peer = Peer(endpoint)  # a restarted runtime is used again
        async with asyncio.timeout(10):
            while await channel.ping() != "ok":
                await asyncio.sleep(0.05)
    finally:
        channel.close()
        peer.close()
