"""The controller API with tokens configured (``api_auth.tokens``): a real stack of its own."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
import websockets

from tests.gateway.support import gateway, generate, ws_generate
from tests.stack import Stack, start_stack

WASM = Path(__file__).resolve().parents[2] / "controllers" / "wasm"


@pytest.fixture(scope="module")
def token_stack(tmp_path_factory: pytest.TempPathFactory) -> Stack:
    started = start_stack(tmp_path_factory.mktemp("auth"),
                          TILLER_API_AUTH__TOKENS=json.dumps({"admin-secret": "localhost", "alice-secret": "alice"}))
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
