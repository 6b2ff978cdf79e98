"""The controller API with tokens configured (``api_auth.tokens``): a real stack of its own."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import openai
import pytest
import websockets

from tests.gateway.support import gateway, generate, receive, send, ws_generate
from tests.stack import Stack, start_stack

WASM = Path(__file__).resolve().parents[2] / "controllers" / "wasm"


@pytest.fixture(scope="module")
def token_stack(tmp_path_factory: pytest.TempPathFactory) -> Stack:
    started = start_stack(tmp_path_factory.mktemp("auth"),
                          TILLER_API_AUTH__TOKENS=json.dumps({"admin-secret": "localhost", "alice-secret": "alice"}),
                          TILLER_CONTROLLERS__MAX_CONTROLLED_PER_USER="1")
    yield started
    started.down()


async def test_tokens_by_bearer_or_pyaici_api_key(token_stack):
    """``Authorization: Bearer`` and pyaici's ``api-key`` header (its ``#key=`` base URL fragment) both
    authenticate; no or an unknown token is a 401; a token's user owns only its ``<user>.`` tags."""
    async with httpx.AsyncClient(base_url=token_stack.http_url, timeout=60.0) as http:
        for headers in ({}, {"api-key": "wrong"}, {"authorization": "Bearer wrong"}):
            response = await http.get("/v1/controllers/tags", headers=headers)
            assert response.status_code == 401 and "api-key" in response.json()["error"]["message"], response.text
        upload = await http.post("/v1/controllers", content=(WASM / "yesno.wasm").read_bytes(),
                                 headers={"api-key": "admin-secret"})
        assert upload.status_code == 200, upload.text
        module_id = upload.json()["module_id"]
        refused = await http.post("/v1/controllers/tags", json={"module_id": module_id, "tags": ["yesno"]},
                                  headers={"api-key": "alice-secret", "x-user-role": "admin"})
        assert refused.status_code == 400 and "alice." in refused.json()["error"]["message"], refused.text
        tagged = await http.post("/v1/controllers/tags", json={"module_id": module_id, "tags": ["alice.yesno"]},
                                 headers={"authorization": "Bearer alice-secret"})
        assert tagged.status_code == 200 and tagged.json()["tags"][0]["updated_by"] == "alice", tagged.text
        listed = await http.get("/v1/controllers/tags", headers={"api-key": "admin-secret"})
        assert [t["tag"] for t in listed.json()["tags"]] == ["alice.yesno"], listed.text


@pytest.fixture(scope="module")
def guarded_gateway(token_stack, tmp_path_factory: pytest.TempPathFactory):
    """A second gateway on the token stack with ``api_auth.everywhere`` (vLLM's --api-key)."""
    env = dict(token_stack.env, TILLER_API_AUTH__EVERYWHERE="true")
    with gateway(env, tmp_path_factory.mktemp("guarded")) as address:
        yield address


async def test_everywhere_guards_every_surface_but_health(token_stack, guarded_gateway):
    model = token_stack.settings.served_model_name
    async with httpx.AsyncClient(base_url=f"http://{guarded_gateway}", timeout=60.0) as http:
        assert (await http.get("/health")).status_code == 200
        refused = await http.post("/v1/generate", json={"prompt": "Hi", "max_tokens": 1, "stream": False})
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthorized", refused.text
        served = await http.post("/v1/generate", json={"prompt": "Hi", "max_tokens": 1, "stream": False},
                                 headers={"api-key": "alice-secret"})
        assert served.status_code == 200, served.text
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"http://{guarded_gateway}/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=f"http://{guarded_gateway}/v1", api_key="alice-secret", max_retries=0)
    assert client.completions.create(model=model, prompt="Hi", max_tokens=1).usage.completion_tokens == 1
    with pytest.raises(websockets.InvalidStatus) as caught:
        async with websockets.connect(f"ws://{guarded_gateway}/generate"):
            pass
    assert caught.value.response.status_code == 403
    config = {"prompt": "Hi", "parameters": {"max_tokens": 1}}
    async with websockets.connect(f"ws://{guarded_gateway}/generate",
                                  additional_headers={"Authorization": "Bearer alice-secret"}) as ws:
        assert (await generate(ws, config))[-1]["type"] == "completion"
    # the stack's own gateway (tokens, but not everywhere) still serves generation without one
    assert (await ws_generate(token_stack.ws_url, config))[-1]["type"] == "completion"


async def test_a_user_past_their_controller_budget_is_told_to_wait(token_stack):
    """``controllers.max_controlled_per_user`` (1 on this stack): while alice's controlled request runs, her next
    one is refused with 429 ``rate_limited`` on every surface (``/v1/run``, the OpenAI API's JSON mode), other
    users' are not, and alice may start one again once hers ended."""
    headers = {"api-key": "alice-secret"}
    async with httpx.AsyncClient(base_url=token_stack.http_url, timeout=60.0) as http:
        upload = await http.post("/v1/controllers", content=(WASM / "constrain.wasm").read_bytes(),
                                 headers={"api-key": "admin-secret"})
        assert upload.status_code == 200, upload.text
        module_id = upload.json()["module_id"]
        run = {"controller": module_id, "controller_arg": {"regex": "[a-z]+"}, "prompt": "Say hi:", "max_tokens": 2}
        config = {"prompt": "Write a long story:", "controller": module_id, "controller_arg": {"regex": "[a-z ]+"},
                  "parameters": {"max_tokens": 1500, "temperature": 0}}
        async with websockets.connect(token_stack.ws_url, additional_headers=headers) as ws:
            await send(ws, {"type": "config", **config})
            while (await receive(ws))["type"] != "token":  # alice's controlled request runs
                pass
            refused = await http.post("/v1/run", json=run, headers=headers)
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["type"] == "rate_limited", refused.text
            assert "already has 1 controlled requests running" in refused.json()["error"]["message"], refused.text
            client = openai.AsyncOpenAI(base_url=f"{token_stack.http_url}/v1", api_key="alice-secret", max_retries=0)
            with pytest.raises(openai.RateLimitError, match="controlled requests running"):
                await client.chat.completions.create(
                    model=token_stack.settings.served_model_name, messages=[{"role": "user", "content": "Hi"}],
                    max_tokens=4, response_format={"type": "json_object"})
            other = await http.post("/v1/run", json=run, headers={"api-key": "admin-secret"})
            assert other.status_code == 200, other.text
        for _ in range(100):  # her stream closed: the runtime hears that the request ended with the next step
            again = await http.post("/v1/run", json=run, headers=headers)
            if again.status_code != 429:
                break
            await asyncio.sleep(0.1)
        assert again.status_code == 200, again.text
