"""A refused gRPC client stream reaches the client as UNAUTHENTICATED, every time.

The server runs in its own process (as the gateway does): grpc's asyncio client turns the server's status into
INTERNAL when one of its writes lands after the server ended the call, a race that only shows across processes.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest

from tests.stack import free_port

SERVER = """
import asyncio, sys, grpc
from common.config import Settings
from services.gateway.grpc_server import AuthInterceptor

async def echo(requests, context):
    async for request in requests:
        yield request

async def main():
    settings = Settings(api_auth={"tokens": {"right": "ana"}, "everywhere": True})
    server = grpc.aio.server(interceptors=[AuthInterceptor(settings)])
    handler = grpc.stream_stream_rpc_method_handler(echo)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("evergreen.v1.Echo", {"Echo": handler}),))
    server.add_insecure_port("127.0.0.1:" + sys.argv[1])
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""
CALLS = 150


@pytest.fixture
def address() -> Iterator[str]:
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        yield f"127.0.0.1:{port}"
    finally:
        server.kill()
        server.wait()


async def _codes(address: str, metadata: tuple) -> set[tuple[grpc.StatusCode, str]]:
    seen = set()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = channel.stream_stream("/evergreen.v1.Echo/Echo")
        for _ in range(CALLS):
            async def one() -> AsyncIterator[bytes]:
                yield b"hello"

            try:
                replies = [reply async for reply in stub(one(), metadata=metadata, timeout=10)]
                seen.add((grpc.StatusCode.OK, repr(replies)))
            except grpc.aio.AioRpcError as error:
                seen.add((error.code(), error.details()))
    return seen


async def test_every_refused_stream_says_unauthenticated(address):
    assert await _codes(address, (("authorization", "Bearer nope"),)) == {
        (grpc.StatusCode.UNAUTHENTICATED, "the bearer token is not valid")}


async def test_an_accepted_stream_is_served(address):
    assert await _codes(address, (("authorization", "Bearer right"),)) == {(grpc.StatusCode.OK, "[b'hello']")}
