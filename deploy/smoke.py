"""One greedy request on each kind of surface of a running Tiller: the WebSocket protocol, the OpenAI
API (the official ``openai`` SDK) and Evergreen over gRPC. Prints what each answered; exits 1 when one
fails. deploy/compose_check.sh runs it against the container stack.

    .venv/bin/python deploy/smoke.py [--host 127.0.0.1] [--http-port 8080] [--grpc-port 50051]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable

PROMPT = "The capital of France is"
TOKENS = 8


async def websocket(host: str, port: int) -> str:
    import websockets

    config = {"type": "config", "prompt": PROMPT, "parameters": {"max_tokens": TOKENS, "temperature": 0}}
    async with websockets.connect(f"ws://{host}:{port}/generate") as ws:
        await ws.send(json.dumps(config))
        async for raw in ws:
            message = json.loads(raw)
            if message["type"] == "completion":
                return message["generated_text"]
            if message["type"] == "error":
                raise RuntimeError(message)
    raise RuntimeError("the connection closed before the completion")


def openai_chat(host: str, port: int) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=f"http://{host}:{port}/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=TOKENS, temperature=0
    )
    return reply.choices[0].message.content or ""


def evergreen(host: str, port: int) -> str:
    import grpc
    from google.protobuf import any_pb2, struct_pb2

    from common.protos.evergreen.v2 import evergreen_pb2 as eg
    from common.protos.evergreen.v2 import evergreen_pb2_grpc as eg_grpc

    config = any_pb2.Any()
    config.Pack(struct_pb2.Struct(fields={"max_tokens": struct_pb2.Value(number_value=TOKENS),
                                          "temperature": struct_pb2.Value(number_value=0)}))
    message = eg.SessionMessage(
        actions=[eg.Action(name="GENERATE", inputs=[eg.NamedParameter(name="prompt", id="p")],
                           outputs=[eg.NamedParameter(name="response", id="r")], configs=[config])],
        node_fragments=[eg.NodeFragment(id="p", chunk_fragment=eg.Chunk(
            metadata=eg.ChunkMetadata(mimetype="text/plain"), data=PROMPT.encode()))])
    with grpc.insecure_channel(f"{host}:{port}") as channel:
        replies = eg_grpc.EvergreenServiceStub(channel).StartSession(iter([message]), timeout=120)
        return "".join(r.node_fragments[0].chunk_fragment.data.decode() for r in replies if r.node_fragments)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--http-port", type=int, default=8080)
    parser.add_argument("--grpc-port", type=int, default=50051)
    args = parser.parse_args()
    calls: list[tuple[str, Callable[[], str]]] = [
        ("websocket", lambda: asyncio.run(websocket(args.host, args.http_port))),
        ("openai", lambda: openai_chat(args.host, args.http_port)),
        ("grpc evergreen", lambda: evergreen(args.host, args.grpc_port)),
    ]
    failed = 0
    for name, call in calls:
        try:
            print(f"{name:15s} ok   {call()!r}", flush=True)
        except Exception as exc:  # noqa: BLE001 - report every surface, then fail
            print(f"{name:15s} FAIL {type(exc).__name__}: {exc}", flush=True)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
