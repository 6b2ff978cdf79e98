"""Salience benchmark, in one run:

1. Prefix reuse. A ``--turns``-turn conversation: each turn appends ``--turn-tokens`` user tokens and
   decodes ``--max-tokens`` greedily. *reuse*: one session, each turn sends only its delta and the
   server keeps the session's KV between turns. *full*: the same conversation re-sent in full each
   turn, to a fresh session, with a different first token each time so that no KV of an earlier
   turn can be reused. Printed: the time of turn N (Generate call to Done) both ways and the ratio,
   which grows with N (reuse prefills only the new tokens, full prefills everything).
2. Readouts. Scoring calls (``max_tokens=0``) over a ``--score-tokens`` prompt with a concept readout
   at every position vs none; printed as prompt tokens per second (median of ``--rounds``).

Starts its own stack unless ``--address`` (host:port of a gateway's gRPC) is given.

    python deploy/loadtest/salience_bench.py [--turns 20] [--turn-tokens 64] [--max-tokens 8] [--address 127.0.0.1:50051]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from common.config import Settings  # noqa: E402
from common.model_source import load_tokenizer  # noqa: E402
from common.protos.salience.v1 import salience_pb2 as pb  # noqa: E402
from common.protos.salience.v1 import salience_pb2_grpc as pb_grpc  # noqa: E402

TEXT = (
    "The lighthouse keeper climbed the stairs again, counting each step in the dark, and wrote down what the "
    "sea had done that day: the height of the waves, the colour of the sky at dusk, the ships that passed. "
)
TIMEOUT_S = 600.0


class Client:
    def __init__(self, stub: pb_grpc.SalienceStub, model: str, metadata: tuple) -> None:
        self.stub, self.model, self.metadata = stub, model, metadata

    async def open(self) -> str:
        reply = await self.stub.OpenSession(pb.OpenSessionRequest(model=self.model), metadata=self.metadata)
        return reply.session_id

    async def close(self, session_id: str) -> None:
        await self.stub.CloseSession(pb.CloseSessionRequest(session_id=session_id), metadata=self.metadata)

    async def generate(self, **fields) -> tuple[float, list[int]]:
        """(seconds from the call to Done, decoded token ids)."""
        started = time.perf_counter()
        decoded = []
        async for event in self.stub.Generate(pb.GenerateRequest(**fields), metadata=self.metadata, timeout=TIMEOUT_S):
            if event.HasField("done"):
                return time.perf_counter() - started, decoded
            if not event.token.is_prefill:
                decoded.append(event.token.id)
        raise RuntimeError("the stream ended without Done")


def user_turns(tokenizer, turns: int, size: int) -> list[list[int]]:
    """``turns`` chunks of ``size`` tokens of text, each different."""
    ids = tokenizer.encode(" ".join(f"Day {i}. {TEXT}" for i in range(turns * size // 20 + 4)), add_special_tokens=False)
    return [ids[i * size : (i + 1) * size] for i in range(turns)]


async def prefix_reuse(client: Client, chunks: list[list[int]], max_tokens: int, vocab: int) -> None:
    session = await client.open()
    history: list[int] = []
    rows = []
    for n, chunk in enumerate(chunks, 1):
        seconds, decoded = await client.generate(session_id=session, append_tokens=chunk, offset=len(history),
                                                 max_tokens=max_tokens, top_k=1)
        history += chunk + decoded
        rows.append((n, len(history) - len(decoded), seconds))
    await client.close(session)

    print(f"prefix reuse: {len(chunks)} turns of {len(chunks[0])} appended + {max_tokens} decoded tokens")
    print(f"  {'turn':>4} {'context':>8} {'reuse ms':>9} {'full ms':>9} {'full/reuse':>10}")
    for n, context, reuse_s in rows:
        # the same conversation up to turn n, re-sent in full; a distinct first token defeats every cache
        prompt = [(1000 + 7 * n) % vocab] + history[1:context]
        fresh = await client.open()
        full_s, _ = await client.generate(session_id=fresh, append_tokens=prompt, offset=0, max_tokens=max_tokens,
                                          top_k=1)
        await client.close(fresh)
        print(f"  {n:>4} {context:>8} {reuse_s * 1000:>9.1f} {full_s * 1000:>9.1f} {full_s / reuse_s:>10.2f}")


async def readouts(client: Client, tokenizer, tokens: int, rounds: int, vocab: int) -> None:
    base = tokenizer.encode(TEXT * (tokens // 20 + 2), add_special_tokens=False)[: tokens - 1]
    manifest = await client.stub.GetReadoutManifest(pb.GetReadoutManifestRequest(), metadata=client.metadata)
    print(f"readouts: scoring {tokens}-token prompts (max_tokens=0), {len(manifest.layers)} layers x "
          f"{len(manifest.concepts)} concepts per position, median of {rounds}")
    results = {}
    for round_ in range(rounds):
        for label, ranges in (("off", []), ("on", [pb.PositionRange(start=0, end=tokens)])):
            prompt = [(2000 + 13 * round_ + (label == "on")) % vocab] + base  # never reused: cold prefill both ways
            session = await client.open()
            seconds, _ = await client.generate(session_id=session, append_tokens=prompt, offset=0, max_tokens=0,
                                               readout_ranges=ranges)
            await client.close(session)
            results.setdefault(label, []).append(tokens / seconds)
    off, on = statistics.median(results["off"]), statistics.median(results["on"])
    print(f"  readouts off {off:9.1f} tokens/s")
    print(f"  readouts on  {on:9.1f} tokens/s   (on/off {on / off:.2f})")


async def bench(address: str, args: argparse.Namespace, settings: Settings) -> None:
    tokenizer = load_tokenizer(settings)
    vocab = len(tokenizer)
    metadata = (("authorization", f"Bearer {args.token}"),) if args.token else ()
    async with grpc.aio.insecure_channel(address) as channel:
        client = Client(pb_grpc.SalienceStub(channel), settings.served_model_name, metadata)
        warm = await client.open()
        await client.generate(session_id=warm, append_tokens=tokenizer.encode(TEXT), offset=0, max_tokens=2, top_k=1)
        await client.close(warm)
        await prefix_reuse(client, user_turns(tokenizer, args.turns, args.turn_tokens), args.max_tokens, vocab)
        await readouts(client, tokenizer, args.score_tokens, args.rounds, vocab)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--turn-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--score-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--token", default="", help="the bearer token, when the server requires one")
    parser.add_argument("--address", help="a running gateway's gRPC host:port; default: start a stack")
    args = parser.parse_args()
    settings = Settings()
    stack = None
    address = args.address
    if address is None:
        from tests.stack import start_stack

        stack = start_stack(Path(tempfile.mkdtemp(prefix="tiller-salience-bench-")))
        address = f"127.0.0.1:{stack.settings.grpc_port}"
    try:
        asyncio.run(bench(address, args, settings))
    finally:
        if stack is not None:
            stack.down()


if __name__ == "__main__":
    main()
