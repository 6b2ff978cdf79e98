"""Users apart on a real stack with tokens for alice, bob, an admin, carol and dave (``api_auth.everywhere``):
every route and RPC that names a stored object answers another user exactly as for an id that does not exist,
its owner and the admin reach it, and so again after the whole stack went down and up; the prefix cache finds
only the caller's own domain's KV; each quota refuses the call that would pass it (docs/tenants.md)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import websockets

from common.protos.salience.v1 import salience_pb2 as pb
from common.protos.salience.v1 import salience_pb2_grpc as pb_grpc
from common.config import Settings
from common.model_source import load_tokenizer
from services.gateway.app import create_app
from services.gateway.salience.service import CACHED_TOKENS_TRAILER
from tests.gateway.support import call_status, collect, receive, send, wait_for
from tests.stack import Stack, start_stack

WASM = Path(__file__).resolve().parents[2] / "controllers" / "wasm"
TOKENS = {"alice-token": "alice", "bob-token": "bob", "root-token": "root", "carol-token": "carol",
          "dave-token": "dave"}
ALICE, BOB, ROOT, CAROL, DAVE = ({"authorization": f"Bearer {token}"} for token in TOKENS)
# quotas (every user's; the walk and cache tests stay well within them, carol and dave reach them)
QUOTAS = {"MAX_SESSIONS_PER_USER": "8", "MAX_SESSION_TOKENS_PER_USER": "200", "MAX_GENERATIONS_PER_USER": "2",
          "MAX_MODULES_PER_USER": "2", "MAX_MODULE_BYTES_PER_USER": "30000"}
RPC_TIMEOUT_S = 120.0
UNKNOWN_SESSION = "sess-" + "0" * 32
UNKNOWN_RID = "cmpl-" + "0" * 32


@pytest.fixture(scope="module")
def tenants(tmp_path_factory: pytest.TempPathFactory) -> Stack:
    started = start_stack(tmp_path_factory.mktemp("tenants"), TILLER_API_AUTH__TOKENS=json.dumps(TOKENS),
                          TILLER_API_AUTH__ADMINS=json.dumps(["root"]), TILLER_API_AUTH__EVERYWHERE="true",
                          **{f"TILLER_TENANTS__{name}": value for name, value in QUOTAS.items()})
    started.tokenizer = load_tokenizer(started.settings)
    yield started
    started.down()


def metadata(headers: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(headers.items())


@dataclass
class Objects:
    """What alice stored: a Salience session, a request record with her feedback, a tag."""

    session: str
    session_tokens: list[int]
    rid: str
    tag: str


async def alice_stores(stack: Stack, http: httpx.AsyncClient, stub: pb_grpc.SalienceStub) -> Objects:
    opened = await stub.OpenSession(pb.OpenSessionRequest(model=stack.settings.served_model_name),
                                    metadata=metadata(ALICE), timeout=RPC_TIMEOUT_S)
    prompt = stack.tokenizer.encode("The secret plan is")
    await call_status(stub.Generate(pb.GenerateRequest(session_id=opened.session_id, append_tokens=prompt,
                                                       max_tokens=0), metadata=metadata(ALICE), timeout=RPC_TIMEOUT_S))
    async with websockets.connect(stack.ws_url, additional_headers=ALICE) as ws:
        await send(ws, {"type": "config", "prompt": "My password is", "parameters": {"max_tokens": 2}})
        rid = (await collect(ws))[0]["request_id"]
        await send(ws, {"type": "feedback", "rating": 1, "text": "mine"})
        assert (await receive(ws))["operation"] == "feedback"
    upload = await http.post("/v1/controllers", content=(WASM / "yesno.wasm").read_bytes(), headers=ALICE)
    tagged = await http.post("/v1/controllers/tags", json={"module_id": upload.json()["module_id"],
                                                           "tags": ["alice.yesno"]}, headers=ALICE)
    assert tagged.status_code == 200, tagged.text

    async def recorded() -> bool:
        return (await http.get(f"/v1/requests/{rid}", headers=ALICE)).json().get("finish_reason") is not None

    await wait_for(recorded, 30, "alice's request record")
    return Objects(opened.session_id, prompt, rid, "alice.yesno")


Check = Callable[[dict[str, str], Objects], Awaitable[tuple[object, object]]]
OK = (grpc.StatusCode.OK, "")


def walk(stack: Stack, http: httpx.AsyncClient, stub: pb_grpc.SalienceStub) -> dict[str, tuple[Check, object]]:
    """Every route and RPC naming a stored object: its check, which returns what the caller got for alice's
    object and what it gets for an id no one has (both comparable values), and what reaching the object gets."""

    def salience(method: str, request: Callable[[str, Objects], object]) -> Check:
        async def check(headers: dict[str, str], objects: Objects) -> tuple[object, object]:
            async def call(session_id: str) -> tuple[object, str]:
                rpc = getattr(stub, method)(request(session_id, objects), metadata=metadata(headers),
                                            timeout=RPC_TIMEOUT_S)
                return await call_status(rpc)
            unknown = await call(UNKNOWN_SESSION)
            return await call(objects.session), (unknown[0], unknown[1].replace(UNKNOWN_SESSION, objects.session))
        return check

    async def record(headers: dict[str, str], objects: Objects) -> tuple[object, object]:
        async def get(rid: str) -> tuple[int, str]:
            answer = await http.get(f"/v1/requests/{rid}", headers=headers)
            return answer.status_code, answer.text if answer.status_code != 200 else ""
        unknown = await get(UNKNOWN_RID)
        return await get(objects.rid), (unknown[0], unknown[1].replace(UNKNOWN_RID, objects.rid))

    async def tags(headers: dict[str, str], objects: Objects) -> tuple[object, object]:
        listed = [t["tag"] for t in (await http.get("/v1/controllers/tags", headers=headers)).json()["tags"]]
        return objects.tag in listed, False

    async def run(headers: dict[str, str], objects: Objects) -> tuple[object, object]:
        async def start(tag: str) -> tuple[int, str]:
            answer = await http.post("/v1/run", json={"controller": tag, "prompt": "Is it?", "max_tokens": 1},
                                     headers=headers)
            return answer.status_code, answer.text if answer.status_code != 200 else ""
        unknown = await start("alice.unknown")
        return await start(objects.tag), (unknown[0], unknown[1].replace("alice.unknown", objects.tag))

    return {
        "GET /v1/requests/{rid}": (record, (200, "")),
        "GET /v1/controllers/tags": (tags, True),
        "POST /v1/run (a tag)": (run, (200, "")),
        "Salience.DumpSession": (salience("DumpSession", lambda s, _: pb.DumpSessionRequest(session_id=s)), OK),
        "Salience.ForkSession": (salience("ForkSession", lambda s, _: pb.ForkSessionRequest(session_id=s,
                                                                                            at_position=2)), OK),
        "Salience.Generate": (salience("Generate", lambda s, o: pb.GenerateRequest(
            session_id=s, offset=len(o.session_tokens), max_tokens=0)), OK),  # a no-op turn: it refreshes the TTL
    }


def test_the_walk_covers_every_route_and_rpc_naming_a_stored_object():
    """A new route with an id in its path, or a new Salience RPC with a session_id, must join the walk."""
    paths = {route.path for route in create_app(Settings()).routes if "{" in getattr(route, "path", "")}
    assert paths <= {"/v1/requests/{rid}", "/v1/models/{model:path}"}, paths  # a model is no stored object
    rpcs = {m.name for m in pb.DESCRIPTOR.services_by_name["Salience"].methods
            if "session_id" in m.input_type.fields_by_name}
    assert rpcs == {"CloseSession", "ForkSession", "DumpSession", "Generate"}  # CloseSession: checked on its own


async def check_apart(stack: Stack, objects: Objects) -> None:
    async with httpx.AsyncClient(base_url=stack.http_url, timeout=120.0) as http, \
            grpc.aio.insecure_channel(f"127.0.0.1:{stack.settings.grpc_port}") as channel:
        stub = pb_grpc.SalienceStub(channel)
        for name, (check, reached) in walk(stack, http, stub).items():
            mine, unknown = await check(BOB, objects)
            assert mine == unknown != reached, f"{name}: bob got {mine}, an unknown id gets {unknown}"
            for who, headers in (("alice", ALICE), ("root", ROOT)):
                got, _ = await check(headers, objects)
                assert got == reached, f"{name}: {who} got {got}"
        # CloseSession is idempotent (salience.proto): bob's answer is an unknown id's (OK) and closes nothing
        for session_id in (objects.session, UNKNOWN_SESSION):
            closed = await call_status(stub.CloseSession(pb.CloseSessionRequest(session_id=session_id),
                                                         metadata=metadata(BOB), timeout=RPC_TIMEOUT_S))
            assert closed == OK
        for headers in (ALICE, ROOT):
            dump = await stub.DumpSession(pb.DumpSessionRequest(session_id=objects.session),
                                          metadata=metadata(headers), timeout=RPC_TIMEOUT_S)
            assert list(dump.tokens) == objects.session_tokens
        record = (await http.get(f"/v1/requests/{objects.rid}", headers=ALICE)).json()
        assert [f["text"] for f in record["feedback"]] == ["mine"]


async def test_another_user_finds_nothing_of_alices_before_and_after_a_restart(tenants: Stack):
    async with httpx.AsyncClient(base_url=tenants.http_url, timeout=120.0) as http, \
            grpc.aio.insecure_channel(f"127.0.0.1:{tenants.settings.grpc_port}") as channel:
        objects = await alice_stores(tenants, http, pb_grpc.SalienceStub(channel))
    await check_apart(tenants, objects)
    tenants.down()  # make down / make up: every process, the session store's SQLite and the tags survive
    tenants.up()
    await check_apart(tenants, objects)


async def test_the_prefix_cache_tells_no_user_what_another_sent(tenants: Stack):
    """bob sending alice's prompt finds none of it cached; alice again, or two requests with one cache_salt,
    do; greedy output is the same whoever computes it."""
    clients = {name: openai.AsyncOpenAI(base_url=f"{tenants.http_url}/v1", api_key=token, max_retries=0)
               for token, name in TOKENS.items()}
    prompt = "Alice wrote this private note to her doctor about the results of the tests last week:"
    assert len(tenants.tokenizer.encode(prompt)) > 16  # at least one whole block to find cached

    async def complete(user: str, **extra: str) -> tuple[str, int]:
        answer = await clients[user].completions.create(
            model=tenants.settings.served_model_name, prompt=prompt, max_tokens=6, temperature=0,
            extra_body=extra)
        details = answer.usage.prompt_tokens_details
        return answer.choices[0].text, details.cached_tokens if details else 0

    first, cached = await complete("alice")
    assert cached == 0
    bobs, cached = await complete("bob")
    assert cached == 0 and bobs == first
    again, cached = await complete("alice")
    assert cached >= 16 and again == first
    salted, cached = await complete("alice", cache_salt="s1")
    assert cached == 0 and salted == first  # a salt splits alice's domain
    salted, cached = await complete("alice", cache_salt="s1")
    assert cached >= 16 and salted == first
    _, cached = await complete("bob", cache_salt="s1")
    assert cached == 0  # a shared salt never joins two users
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        await complete("alice", cache_salt="")


async def test_a_response_shares_kv_only_within_its_cache_salt(tenants: Stack):
    alice = openai.AsyncOpenAI(base_url=f"{tenants.http_url}/v1", api_key="alice-token", max_retries=0)
    words = "The minutes of the board meeting on the merger, which nobody outside the room may read, say that"

    async def respond(**extra: str) -> int:
        answer = await alice.responses.create(model=tenants.settings.served_model_name, input=words, temperature=0,
                                              max_output_tokens=2, store=False, extra_body=extra)
        return answer.usage.input_tokens_details.cached_tokens

    await respond()
    assert await respond() >= 16
    assert await respond(cache_salt="r1") == 0
    assert await respond(cache_salt="r1") >= 16


async def test_salience_turns_share_kv_only_within_their_domain_and_salt(tenants: Stack):
    prompt = tenants.tokenizer.encode("Bob's salary review for this year, strictly confidential and not to be shared, says "
                                      "that his performance was")
    assert len(prompt) > 16
    async with grpc.aio.insecure_channel(f"127.0.0.1:{tenants.settings.grpc_port}") as channel:
        stub = pb_grpc.SalienceStub(channel)

        async def turn(headers: dict[str, str], salt: str = "") -> int:
            extra = (("tiller-cache-salt", salt),) if salt else ()
            opened = await stub.OpenSession(pb.OpenSessionRequest(model=tenants.settings.served_model_name),
                                            metadata=metadata(headers), timeout=RPC_TIMEOUT_S)
            call = stub.Generate(pb.GenerateRequest(session_id=opened.session_id, append_tokens=prompt, max_tokens=1,
                                                    top_k=1), metadata=metadata(headers) + extra, timeout=RPC_TIMEOUT_S)
            async for _ in call:
                pass
            return int(dict(await call.trailing_metadata())[CACHED_TOKENS_TRAILER])

        assert await turn(BOB) == 0
        assert await turn(ALICE) == 0
        assert await turn(BOB) >= 16  # bob's own prompt, in a new session
        assert await turn(BOB, "s") == 0
        assert await turn(BOB, "s") >= 16


async def test_a_user_past_a_session_quota_is_told_which(tenants: Stack):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{tenants.settings.grpc_port}") as channel:
        stub = pb_grpc.SalienceStub(channel)
        opened = [await stub.OpenSession(pb.OpenSessionRequest(model=tenants.settings.served_model_name),
                                         metadata=metadata(CAROL), timeout=RPC_TIMEOUT_S) for _ in range(8)]
        refused = await call_status(stub.OpenSession(pb.OpenSessionRequest(model=tenants.settings.served_model_name),
                                                     metadata=metadata(CAROL), timeout=RPC_TIMEOUT_S))
        assert refused[0] == grpc.StatusCode.RESOURCE_EXHAUSTED and "tenants.max_sessions_per_user = 8" in refused[1]
        session = opened[0].session_id
        too_long = stub.Generate(pb.GenerateRequest(session_id=session, append_tokens=[1] * 150, max_tokens=60),
                                 metadata=metadata(CAROL), timeout=RPC_TIMEOUT_S)
        refused = await call_status(too_long)
        assert refused[0] == grpc.StatusCode.RESOURCE_EXHAUSTED, refused
        assert "tenants.max_session_tokens_per_user = 200" in refused[1]
        fits = stub.Generate(pb.GenerateRequest(session_id=session, append_tokens=[1] * 150, max_tokens=1),
                             metadata=metadata(CAROL), timeout=RPC_TIMEOUT_S)
        assert await call_status(fits) == OK
        await stub.CloseSession(pb.CloseSessionRequest(session_id=session), metadata=metadata(CAROL),
                                timeout=RPC_TIMEOUT_S)
        assert await stub.OpenSession(pb.OpenSessionRequest(model=tenants.settings.served_model_name),
                                      metadata=metadata(CAROL), timeout=RPC_TIMEOUT_S)  # closing one frees its room


async def test_a_user_past_the_generations_quota_gets_429_and_others_go_on(tenants: Stack):
    long = {"type": "config", "prompt": "Tell a very long story:", "parameters": {"max_tokens": 1500}}
    async with websockets.connect(tenants.ws_url, additional_headers=CAROL) as first, \
            websockets.connect(tenants.ws_url, additional_headers=CAROL) as second:
        for ws in (first, second):
            await send(ws, long)
            while (await receive(ws))["type"] != "token":  # running
                pass
        carol = openai.AsyncOpenAI(base_url=f"{tenants.http_url}/v1", api_key="carol-token", max_retries=0)
        with pytest.raises(openai.RateLimitError, match="tenants.max_generations_per_user = 2"):
            await carol.completions.create(model=tenants.settings.served_model_name, prompt="Hi", max_tokens=2)
        with pytest.raises(openai.RateLimitError, match="tenants.max_generations_per_user = 2"):  # the same path
            await carol.embeddings.create(model=tenants.settings.served_model_name, input=["Hi"])
        dave = openai.AsyncOpenAI(base_url=f"{tenants.http_url}/v1", api_key="dave-token", max_retries=0)
        answer = await dave.completions.create(model=tenants.settings.served_model_name, prompt="Hi", max_tokens=2)
        assert answer.usage.completion_tokens == 2
        embedded = await dave.embeddings.create(model=tenants.settings.served_model_name, input=["Hi", "there"])
        assert len(embedded.data) == 2
    # (the connections closed: carol's generations are cancelled, and she may start again)
    async def carol_may() -> bool:
        try:
            await carol.completions.create(model=tenants.settings.served_model_name, prompt="Hi", max_tokens=1)
        except openai.RateLimitError:
            return False
        return True

    await wait_for(carol_may, 30, "carol's generations to end")


async def test_a_user_past_a_module_quota_gets_429(tenants: Stack):
    async with httpx.AsyncClient(base_url=tenants.http_url, timeout=120.0) as http:
        async def upload(name: str, headers: dict[str, str]) -> httpx.Response:
            return await http.post("/v1/controllers", content=(WASM / name).read_bytes(), headers=headers)

        for name in ("uppercase.wasm", "constrain.wasm", "uppercase.wasm"):  # the same one again is free
            assert (await upload(name, CAROL)).status_code == 200
        refused = await upload("declctrl.wasm", CAROL)
        assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limited", refused.text
        assert "tenants.max_modules_per_user = 2" in refused.json()["error"]["message"]
        assert (await upload("declctrl.wasm", DAVE)).status_code == 200  # 21453 bytes
        refused = await upload("constrain.wasm", DAVE)  # + 13799 > 30000
        assert refused.status_code == 429 and "tenants.max_module_bytes_per_user = 30000" in refused.text


async def test_a_bad_cache_salt_is_refused_clearly_on_every_surface(tenants: Stack):
    long = "s" * 1025
    async with httpx.AsyncClient(base_url=tenants.http_url, timeout=120.0, headers=ALICE) as http:
        for path, body in (("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "cache_salt": long}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                                                     "cache_salt": ""}),
                           ("/v1/generate", {"prompt": "Hi", "max_tokens": 1, "cache_salt": long}),
                           ("/v1/responses", {"input": "Hi", "max_output_tokens": 1, "cache_salt": ""}),
                           ("/v1/embeddings", {"input": "Hi", "cache_salt": ""}),
                           ("/v1/run", {"controller": "none", "controller_arg": "Hi", "cache_salt": 7})):
            refused = await http.post(path, json={"model": tenants.settings.served_model_name, **body})
            assert refused.status_code == 400 and "cache_salt" in refused.text, (path, refused.text)
    async with websockets.connect(tenants.ws_url, additional_headers=ALICE) as ws:
        await send(ws, {"type": "config", "prompt": "Hi", "parameters": {"max_tokens": 1, "cache_salt": ""}})
        error = await receive(ws)
        assert error["type"] == "error" and "cache_salt" in error["message"], error
        await send(ws, {"type": "config", "prompt": "Hi", "parameters": {"max_tokens": 1, "cache_salt": "ok"}})
        assert (await collect(ws))[-1]["type"] == "completion"  # the connection goes on
    async with grpc.aio.insecure_channel(f"127.0.0.1:{tenants.settings.grpc_port}") as channel:
        stub = pb_grpc.SalienceStub(channel)
        opened = await stub.OpenSession(pb.OpenSessionRequest(model=tenants.settings.served_model_name),
                                        metadata=metadata(ALICE), timeout=RPC_TIMEOUT_S)
        refused = await call_status(stub.Generate(
            pb.GenerateRequest(session_id=opened.session_id, append_tokens=[1, 2], max_tokens=1),
            metadata=metadata(ALICE) + (("tiller-cache-salt", long),), timeout=RPC_TIMEOUT_S))
        assert refused[0] == grpc.StatusCode.INVALID_ARGUMENT and "tiller-cache-salt" in refused[1], refused
