"""The admission pipeline on every surface: WebSocket, REST, OpenAI completions and chat, AICI ``/v1/run``,
Salience and Evergreen all count against the one rate limit, are screened by the content filter (prompts and
generated text), leave ``requests_total{surface,outcome}`` and request records, and need the token when auth
guards every surface (every HTTP route, the WebSocket and every RPC of both gRPC services walked with no, a
wrong and the right token). Extra gateways beside the shared stack, with those settings."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import grpc
import httpx
import pytest
import websockets
from google.protobuf.message_factory import GetMessageClass
from starlette.routing import Route, WebSocketRoute

from common.protos.evergreen.v2 import evergreen_pb2 as eg
from common.protos.evergreen.v2 import evergreen_pb2_grpc as eg_grpc
from common.protos.salience.v1 import salience_pb2 as pb
from common.protos.salience.v1 import salience_pb2_grpc as pb_grpc
from services.gateway.app import ROUTER_MODULES
from tests.e2e.test_evergreen import config
from tests.gateway.support import call_status, gateway_process, generate, parse_sse
from tests.stack import free_port

TOKEN = "every-surface-token"
SALIENCE_TOKEN = "salience-only-token"
RIGHT = {"authorization": f"Bearer {TOKEN}"}
SURFACES = ["websocket", "rest", "completions", "chat", "embeddings", "run", "salience", "evergreen"]
GRPC_TIMEOUT_S = 120.0


@dataclass
class Guarded:
    """A gateway process: its HTTP and gRPC addresses, the token its calls carry, its stack."""

    http: str
    grpc: str
    headers: dict[str, str]
    stack: object

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return tuple(self.headers.items())


def _gateway(stack, tmp_path_factory, name: str, headers: dict[str, str], **env: str) -> AsyncIterator[Guarded]:
    grpc_port = free_port()
    with gateway_process(dict(stack.env, **env), tmp_path_factory.mktemp(name), grpc_port=grpc_port) as (address, _):
        yield Guarded(address, f"127.0.0.1:{grpc_port}", headers, stack)


@pytest.fixture(scope="module")
def guarded(stack, tmp_path_factory):
    """Auth on every surface (an api_auth token and the Salience token) and a content filter."""
    yield from _gateway(stack, tmp_path_factory, "guarded", RIGHT,
                        TILLER_API_AUTH__TOKENS=json.dumps({TOKEN: "alice"}), TILLER_API_AUTH__EVERYWHERE="true",
                        TILLER_SESSIONS__AUTH_TOKEN=SALIENCE_TOKEN,
                        TILLER_LIMITS__CONTENT_FILTER_PATTERNS=json.dumps(["(?i)forbidden", "Paris"]))


@pytest.fixture(scope="module")
def limited(stack, tmp_path_factory):
    """One generation per surface per minute for this client, in all."""
    yield from _gateway(stack, tmp_path_factory, "limited", {},
                        TILLER_LIMITS__RATE_LIMIT_PER_MINUTE=str(len(SURFACES)))


# -- one generation per surface, its outcome as a code ("ok", an error code, or a gRPC status name) ----


async def _websocket(gw: Guarded, prompt: str, max_tokens: int) -> str:
    config = {"prompt": prompt, "parameters": {"max_tokens": max_tokens, "temperature": 0}}
    async with websockets.connect(f"ws://{gw.http}/generate", additional_headers=gw.headers) as ws:
        final = (await generate(ws, config))[-1]
    return final["error"] if final["type"] == "error" else final["finish_reason"]


def _http_outcome(reply: httpx.Response) -> str:
    if reply.status_code == 200:
        return "ok"
    error = reply.json()["error"]
    return error.get("code") or error["type"]


async def _post(gw: Guarded, path: str, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(base_url=f"http://{gw.http}", headers=gw.headers, timeout=120) as http:
        return await http.post(path, json=body)


async def _rest(gw: Guarded, prompt: str, max_tokens: int) -> str:
    return _http_outcome(await _post(gw, "/v1/generate", {"prompt": prompt, "max_tokens": max_tokens,
                                                          "temperature": 0}))


async def _completions(gw: Guarded, prompt: str, max_tokens: int) -> str:
    reply = await _post(gw, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    return reply.json()["choices"][0]["finish_reason"] if reply.status_code == 200 else _http_outcome(reply)


async def _chat(gw: Guarded, prompt: str, max_tokens: int) -> str:
    reply = await _post(gw, "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}],
                                                     "max_tokens": max_tokens, "temperature": 0})
    return reply.json()["choices"][0]["finish_reason"] if reply.status_code == 200 else _http_outcome(reply)


async def _embeddings(gw: Guarded, prompt: str, max_tokens: int) -> str:
    """An embedding generates nothing: ``max_tokens`` does not apply."""
    return _http_outcome(await _post(gw, "/v1/embeddings", {"input": prompt}))


async def _run(gw: Guarded, prompt: str, max_tokens: int) -> str:
    reply = await _post(gw, "/v1/run", {"controller": "none", "controller_arg": prompt, "max_tokens": max_tokens})
    if reply.status_code != 200:
        return _http_outcome(reply)
    forks = [fork for event in parse_sse(reply.text)[1:-1] for fork in event["forks"]]
    errors = [fork["error"] for fork in forks if fork["error"]]
    assert all("content filter" in e for e in errors), errors
    return [fork["finish_reason"] for fork in forks if "finish_reason" in fork][-1]


async def _salience(gw: Guarded, prompt: str, max_tokens: int) -> str:
    tokens = gw.stack.tokenizer.encode(prompt)
    async with grpc.aio.insecure_channel(gw.grpc) as channel:
        stub = pb_grpc.SalienceStub(channel)
        try:
            session = (await stub.OpenSession(pb.OpenSessionRequest(model=gw.stack.settings.served_model_name),
                                              metadata=gw.metadata)).session_id
            call = stub.Generate(pb.GenerateRequest(session_id=session, append_tokens=tokens, max_tokens=max_tokens,
                                                    top_k=1), metadata=gw.metadata, timeout=GRPC_TIMEOUT_S)
            done = [event.done async for event in call if event.HasField("done")]
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
    return pb.GenerateDone.FinishReason.Name(done[0].finish_reason)


async def _evergreen(gw: Guarded, prompt: str, max_tokens: int) -> str:
    chunk = eg.Chunk(data=prompt.encode(), metadata=eg.ChunkMetadata(mimetype="text/plain"))
    action = eg.Action(name="GENERATE", inputs=[eg.NamedParameter(name="prompt", id="p")],
                       outputs=[eg.NamedParameter(name="response", id="r")],
                       configs=[config(max_tokens=max_tokens, temperature=0)])
    message = eg.SessionMessage(node_fragments=[eg.NodeFragment(id="p", chunk_fragment=chunk)], actions=[action])

    async def requests() -> AsyncIterator[eg.SessionMessage]:
        yield message

    async with grpc.aio.insecure_channel(gw.grpc) as channel:
        call = eg_grpc.EvergreenServiceStub(channel).StartSession(requests(), metadata=gw.metadata,
                                                                  timeout=GRPC_TIMEOUT_S)
        try:
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
        return (await call.code()).name


GENERATE: dict[str, Callable[[Guarded, str, int], Awaitable[str]]] = {
    "websocket": _websocket, "rest": _rest, "completions": _completions, "chat": _chat, "embeddings": _embeddings,
    "run": _run, "salience": _salience, "evergreen": _evergreen,
}
OK = {"websocket": "length", "rest": "ok", "completions": "length", "chat": "length", "embeddings": "ok",
      "run": "length", "salience": "FINISH_REASON_LENGTH", "evergreen": "OK"}
RATE_LIMITED = {"websocket": "rate_limited", "rest": "rate_limited", "completions": "rate_limited",
                "chat": "rate_limited", "embeddings": "rate_limited", "run": "rate_limited",
                "salience": "RESOURCE_EXHAUSTED", "evergreen": "RESOURCE_EXHAUSTED"}
FILTERED = {"websocket": "content_filter", "rest": "content_filter", "completions": "content_filter",
            "chat": "content_filter", "embeddings": "content_filter", "run": "content_filter",
            "salience": "PERMISSION_DENIED", "evergreen": "PERMISSION_DENIED"}
METRIC_SURFACE = {"websocket": "websocket", "rest": "rest", "completions": "openai", "chat": "openai",
                  "embeddings": "openai", "run": "aici", "salience": "salience", "evergreen": "evergreen"}


def requests_total(metrics: str, surface: str, outcome: str) -> float:
    line = f'tiller:requests_total{{outcome="{outcome}",surface="{surface}"}} '
    return sum(float(row[len(line):]) for row in metrics.splitlines() if row.startswith(line))


async def test_every_surface_counts_against_and_obeys_the_rate_limit(limited):
    first = {surface: await GENERATE[surface](limited, "Hello", 1) for surface in SURFACES}
    assert first == OK  # the limit is one per surface: each of these counted once
    second = {surface: await GENERATE[surface](limited, "Hello", 1) for surface in SURFACES}
    assert second == RATE_LIMITED
    metrics = httpx.get(f"http://{limited.http}/metrics").text
    for surface in ("websocket", "rest", "aici", "salience", "evergreen"):
        assert requests_total(metrics, surface, "rate_limited") >= 1, surface
    assert requests_total(metrics, "openai", "rate_limited") == 3
    assert requests_total(metrics, "salience", "length") == requests_total(metrics, "aici", "length") == 1


async def test_every_surface_screens_prompts_with_the_content_filter(guarded):
    refused = {surface: await GENERATE[surface](guarded, "Say something forbidden", 1) for surface in SURFACES}
    assert refused == FILTERED
    metrics = httpx.get(f"http://{guarded.http}/metrics").text
    for surface in set(METRIC_SURFACE.values()):
        assert requests_total(metrics, surface, "content_filter") >= 1, surface


@pytest.mark.parametrize("surface", ["run", "salience"])
async def test_generated_text_is_screened_on_run_and_salience(guarded, surface):
    """The model continues this with "Paris" (a pattern): the stream ends before that text is sent."""
    outcome = await GENERATE[surface](guarded, "The capital of France is", 12)
    assert outcome == FILTERED[surface]


async def test_salience_and_run_leave_request_records(guarded):
    async with grpc.aio.insecure_channel(guarded.grpc) as channel:
        stub = pb_grpc.SalienceStub(channel)
        session = (await stub.OpenSession(pb.OpenSessionRequest(model=guarded.stack.settings.served_model_name),
                                          metadata=guarded.metadata)).session_id
        call = stub.Generate(pb.GenerateRequest(session_id=session, append_tokens=[1, 2, 3], max_tokens=2, top_k=1),
                             metadata=guarded.metadata, timeout=GRPC_TIMEOUT_S)
        [_ async for _ in call]
        salience_rid = dict(await call.trailing_metadata())["tiller-request-id"]
    reply = await _post(guarded, "/v1/run", {"controller": "none", "controller_arg": "Hi", "max_tokens": 2})
    run_rid = parse_sse(reply.text)[0]["id"]
    async with httpx.AsyncClient(base_url=f"http://{guarded.http}", headers=guarded.headers) as http:
        for rid, surface in ((salience_rid, "salience"), (run_rid, "aici")):
            record = (await http.get(f"/v1/requests/{rid}")).json()
            assert record["surface"] == surface and record["completion_tokens"] == 2, record
            assert record["finish_reason"] == "length", record


# -- auth on every route and RPC --------------------------------------------------------------------


def _routes() -> list:
    return [route for module in ROUTER_MODULES for route in module.router.routes]


def _http_routes() -> list[tuple[str, str]]:
    """(method, path) of every HTTP route the gateway serves, path parameters filled in."""
    routes = []
    for route in _routes():
        if isinstance(route, Route):
            path = route.path.replace("{", "").replace("}", "")
            routes += [(method, path) for method in sorted(route.methods - {"HEAD"})]
    return routes


async def test_every_http_route_and_the_websocket_need_the_token(guarded):
    routes = _http_routes()
    assert len(routes) >= 12 and ("POST", "/v1/run") in routes
    assert [r.path for r in _routes() if isinstance(r, WebSocketRoute)] == ["/generate"]
    async with httpx.AsyncClient(base_url=f"http://{guarded.http}", timeout=120) as http:
        for method, path in routes:
            open_route = path in ("/health", "/metrics")
            for headers in ({}, {"authorization": "Bearer nope"}, {"api-key": "nope"}):
                reply = await http.request(method, path, headers=headers)
                assert (reply.status_code != 401) if open_route else (reply.status_code == 401), (method, path, headers)
            for headers in (RIGHT, {"api-key": TOKEN}):
                reply = await http.request(method, path, headers=headers)
                assert reply.status_code != 401 and reply.status_code < 500, (method, path, reply.text)
    for headers in ({}, {"authorization": "Bearer nope"}):
        with pytest.raises(websockets.InvalidStatus):
            async with websockets.connect(f"ws://{guarded.http}/generate", additional_headers=headers):
                pass
    assert await _websocket(guarded, "Hello", 1) == "length"


def _rpcs():
    for file, service in ((eg, "EvergreenService"), (pb, "Salience")):
        for method in file.DESCRIPTOR.services_by_name[service].methods:
            yield method


async def _call(channel: grpc.aio.Channel, method, metadata: tuple) -> tuple[grpc.StatusCode, str]:
    """Call an RPC with an empty request (one empty message on a client stream); its status."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    request = GetMessageClass(method.input_type)()
    kinds = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
             (True, False): channel.stream_unary, (True, True): channel.stream_stream}
    stub = kinds[(method.client_streaming, method.server_streaming)](
        path, request_serializer=type(request).SerializeToString,
        response_deserializer=GetMessageClass(method.output_type).FromString)

    async def one() -> AsyncIterator:
        yield request

    return await call_status(stub(one() if method.client_streaming else request, metadata=metadata,
                                  timeout=GRPC_TIMEOUT_S))


async def test_every_rpc_of_both_grpc_services_needs_the_token(guarded):
    methods = list(_rpcs())
    assert {m.name for m in methods} >= {"StartSession", "OpenSession", "Generate", "DumpSession"}
    async with grpc.aio.insecure_channel(guarded.grpc) as channel:
        for method in methods:
            for metadata in ((), (("authorization", "Bearer nope"),), (("authorization", f"Bearer {SALIENCE_TOKEN}x"),)):
                code, details = await _call(channel, method, metadata)
                assert code == grpc.StatusCode.UNAUTHENTICATED and "token" in details, (method.name, metadata, code)
            rights = [RIGHT, {"api-key": TOKEN}]
            if method.containing_service.name == "Salience":  # its own token too, as documented
                rights.append({"authorization": f"Bearer {SALIENCE_TOKEN}"})
            for headers in rights:
                code, details = await _call(channel, method, tuple(headers.items()))
                assert code not in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INTERNAL,
                                    grpc.StatusCode.UNKNOWN), (method.name, headers, code, details)
        evergreen = next(m for m in methods if m.name == "StartSession")
        code, _ = await _call(channel, evergreen, (("authorization", f"Bearer {SALIENCE_TOKEN}"),))
        assert code == grpc.StatusCode.UNAUTHENTICATED  # the Salience token opens Salience only
