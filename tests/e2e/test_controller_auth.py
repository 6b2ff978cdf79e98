"""The controller API with tokens configured (``api_auth.tokens``): a real stack of its own."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

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
