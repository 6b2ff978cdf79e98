"""Evergreen benchmark: time to the first output fragment when the prompt is streamed in pieces
(the action first, then the Evergreen spec's "streamed chain") vs sent whole in one message.

Two situations, each measured ``--rounds`` times (median and p90 printed):

* back to back: every piece is available at once; streamed pieces go out one SessionMessage each.
  Measured from the first message sent.
* produced over time: a producer (a transcriber, an upstream model) yields one piece every
  ``--pace-ms``. Streamed, each piece is sent when produced; whole, the message is sent once the
  producer is done. Measured from the moment the last piece is produced.

Starts its own stack unless ``--address`` (host:port of a gateway's gRPC) is given.

    python deploy/loadtest/evergreen_bench.py [--pieces 32] [--pace-ms 20] [--rounds 10] [--address 127.0.0.1:50051]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
from google.protobuf import any_pb2, struct_pb2

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from common.protos.evergreen.v2 import evergreen_pb2 as eg  # noqa: E402
from common.protos.evergreen.v2 import evergreen_pb2_grpc as eg_grpc  # noqa: E402

SENTENCE = "The lighthouse keeper climbed the stairs again, counting each step in the dark. "
END_OF_TURN = "application/x-protobuf; type=EndOfTurn"
MAX_TOKENS = 4


def generate_action() -> eg.Action:
    struct = struct_pb2.Struct()
    struct.update({"max_tokens": MAX_TOKENS, "temperature": 0})
    config = any_pb2.Any()
    config.Pack(struct)
    return eg.Action(
        name="GENERATE",
        inputs=[eg.NamedParameter(name="text", id="prompt")],
        outputs=[eg.NamedParameter(name="text", id="response")],
        configs=[config],
    )


def piece_fragments(i: int, last: bool) -> list[eg.NodeFragment]:
    """Piece ``i`` of the prompt: the next seq of the root node and its text leaf (and the end of turn)."""
    children = [f"piece_{i}"] + (["eot"] if last else [])
    out = [
        eg.NodeFragment(id="prompt", seq=i, continued=not last, child_ids=children),
        eg.NodeFragment(
            id=f"piece_{i}",
            chunk_fragment=eg.Chunk(metadata=eg.ChunkMetadata(mimetype="text/plain"), data=SENTENCE.encode()),
        ),
    ]
    if last:
        out.append(eg.NodeFragment(id="eot", chunk_fragment=eg.Chunk(metadata=eg.ChunkMetadata(mimetype=END_OF_TURN))))
    return out


async def session(
    stub: eg_grpc.EvergreenServiceStub, pieces: int, pace_s: float, streamed: bool
) -> tuple[float, float]:
    """(seconds from the first send, seconds from the last piece produced) to the first output fragment."""
    marks: dict[str, float] = {}

    async def requests() -> AsyncIterator[eg.SessionMessage]:
        marks["start"] = time.perf_counter()
        if streamed:
            yield eg.SessionMessage(actions=[generate_action()])
        held: list[eg.NodeFragment] = []
        for i in range(pieces):
            if pace_s and i:
                await asyncio.sleep(pace_s)
            fragments = piece_fragments(i, i == pieces - 1)
            if streamed:
                marks["produced"] = time.perf_counter()
                yield eg.SessionMessage(node_fragments=fragments)
            else:
                held += fragments
        if not streamed:
            marks["produced"] = time.perf_counter()
            yield eg.SessionMessage(actions=[generate_action()], node_fragments=held)

    call = stub.StartSession(requests(), timeout=120)
    async for message in call:
        if any(f.id == "response" for f in message.node_fragments):
            now = time.perf_counter()
            call.cancel()
            return now - marks["start"], now - marks["produced"]
    raise RuntimeError(f"the session ended without output: {await call.code()} {await call.details()}")


def summary(values: list[float]) -> str:
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
    return f"median {statistics.median(values) * 1000:7.1f} ms   p90 {p90 * 1000:7.1f} ms"


async def bench(address: str, pieces: int, pace_s: float, rounds: int) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = eg_grpc.EvergreenServiceStub(channel)
        await session(stub, 2, 0.0, True)  # warm-up
        print(f"prompt: {pieces} pieces of {len(SENTENCE)} characters; output: first fragment of {MAX_TOKENS} tokens")
        for label, pace, index in (("back to back", 0.0, 0), (f"produced every {pace_s * 1000:g} ms", pace_s, 1)):
            print(f"{label} (from {'the first send' if index == 0 else 'the last piece produced'}):")
            for streamed in (True, False):
                times = [(await session(stub, pieces, pace, streamed))[index] for _ in range(rounds)]
                print(f"  {'streamed in pieces' if streamed else 'sent whole':20s} {summary(times)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pieces", type=int, default=32)
    parser.add_argument("--pace-ms", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--address", help="a running gateway's gRPC host:port; default: start a stack")
    args = parser.parse_args()
    stack = None
    address = args.address
    if address is None:
        from tests.stack import start_stack

        stack = start_stack(Path(tempfile.mkdtemp(prefix="tiller-evergreen-bench-")))
        address = f"127.0.0.1:{stack.settings.grpc_port}"
    try:
        asyncio.run(bench(address, args.pieces, args.pace_ms / 1000, args.rounds))
    finally:
        if stack is not None:
            stack.down()


if __name__ == "__main__":
    main()
