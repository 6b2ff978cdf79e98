"""Steering vectors on a real stack (docs/steering.md, "Vectors"): uploaded as JSON, GGUF or safetensors (one id for
one content), listed, found by tag, tagged under the module tags' owner rules between users, let go of by their
uploader only, still there after the session store restarts; and every bad upload refused with its own error while
the stack goes on serving."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pytest
from safetensors.numpy import save

from common.steering import SteeringVector, encode, vector_id
from tests.gateway.support import wait_for
from tests.stack import Stack, start_stack
from tests.steering_files import as_gguf, as_json

TOKENS = {"alice-token": "alice", "bob-token": "bob", "root-token": "root", "carol-token": "carol"}
ALICE, BOB, ROOT, CAROL = ({"authorization": f"Bearer {token}"} for token in TOKENS)
MAX_VECTOR_BYTES = 200_000
VECTORS = "/v1/steering/vectors"


@pytest.fixture(scope="module")
def steer(tmp_path_factory: pytest.TempPathFactory) -> Stack:
    started = start_stack(tmp_path_factory.mktemp("steering"), TILLER_API_AUTH__TOKENS=json.dumps(TOKENS),
                          TILLER_API_AUTH__ADMINS=json.dumps(["root"]),
                          TILLER_STEERING__MAX_VECTOR_BYTES=str(MAX_VECTOR_BYTES),
                          TILLER_STEERING__MAX_VECTORS_PER_USER="2")
    yield started
    started.down()


@pytest.fixture(scope="module")
def shape(steer: Stack) -> tuple[int, int]:
    """The served model's (hidden size, decoder layers), as its worker reports them."""
    facts = steer.scheduler_health()
    return facts["hidden_size"], facts["num_layers"]


def directions(hidden: int, layers: list[int], seed: int) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {layer: rng.standard_normal(hidden).astype(np.float32) for layer in layers}


def id_of(found: dict[int, np.ndarray]) -> str:
    return vector_id(encode(SteeringVector.of(found)))


async def upload(http: httpx.AsyncClient, data: bytes, headers: dict[str, str], tags: str = "") -> httpx.Response:
    return await http.post(VECTORS, content=data, headers=headers, params={"tags": tags} if tags else None)


async def test_each_format_is_one_vector_found_by_id_and_tag_and_kept_apart_between_users(
        steer: Stack, shape: tuple[int, int], tmp_path: Path):
    hidden, layers = shape
    calm = directions(hidden, [1, layers - 1], seed=1)
    async with httpx.AsyncClient(base_url=steer.http_url, timeout=60.0) as http:
        as_json_reply = await upload(http, as_json(calm), ALICE, tags="alice.calm")
        assert as_json_reply.status_code == 200, as_json_reply.text
        shown = as_json_reply.json()
        assert shown["id"] == id_of(calm) and shown["hidden_size"] == hidden and shown["layers"] == [1, layers - 1]
        assert shown["norms"] == pytest.approx([float(np.linalg.norm(calm[k])) for k in (1, layers - 1)])
        assert shown["tags"] == ["alice.calm"]
        gguf = await upload(http, as_gguf(tmp_path, {f"direction.{k}": v for k, v in calm.items()}), ALICE)
        assert gguf.json()["id"] == shown["id"] and gguf.json()["tags"] == ["alice.calm"]  # the same vector
        kind = directions(hidden, [3], seed=2)
        other = (await upload(http, save({"layers.3": kind[3]}), ALICE)).json()
        assert other["id"] == id_of(kind) != shown["id"]

        listed = (await http.get(VECTORS, headers=ALICE)).json()["vectors"]
        assert {v["id"] for v in listed} == {shown["id"], other["id"]}
        assert (await http.get(f"{VECTORS}/alice.calm", headers=ALICE)).json()["id"] == shown["id"]

        # bob is told what an unknown name gets; his own upload of the same content is his to tag
        assert (await http.get(VECTORS, headers=BOB)).json()["vectors"] == []
        for ref in (shown["id"], "alice.calm"):
            hidden_from_bob = await http.get(f"{VECTORS}/{ref}", headers=BOB)
            assert hidden_from_bob.status_code == 404 and hidden_from_bob.json()["error"]["type"] == "not_found"
        tag_alices = await http.post("/v1/steering/tags", json={"vector_id": other["id"], "tags": ["bob.x"]},
                                     headers=BOB)
        assert tag_alices.status_code == 404
        assert (await upload(http, as_json(calm), BOB, tags="bob.calm")).json()["tags"] == ["bob.calm"]
        take = await http.post("/v1/steering/tags", json={"vector_id": shown["id"], "tags": ["alice.calm"]},
                               headers=BOB)
        assert take.status_code == 400 and "must start with 'bob.'" in take.json()["error"]["message"]
        catalogue = await http.post("/v1/steering/tags", json={"vector_id": other["id"], "tags": ["kind"]},
                                    headers=ROOT)
        assert catalogue.status_code == 200 and catalogue.json()["tags"][0]["updated_by"] == "root"
        assert (await http.get(f"{VECTORS}/kind", headers=BOB)).json()["id"] == other["id"]  # an admin's: everyone's
        assert [t["tag"] for t in (await http.get("/v1/steering/tags", headers=BOB)).json()["tags"]] == \
            ["kind", "bob.calm"]

        # only an uploader lets go; the vector goes with its last one (and its tags with it)
        refused = await http.delete(f"{VECTORS}/{other['id']}", headers=BOB)
        assert refused.status_code == 404
        deleted = await http.delete(f"{VECTORS}/{other['id']}", headers=ALICE)
        assert deleted.status_code == 200 and deleted.json() == {"id": other["id"], "deleted": True}
        for headers, ref in ((ALICE, other["id"]), (BOB, "kind")):
            assert (await http.get(f"{VECTORS}/{ref}", headers=headers)).status_code == 404
        assert (await http.get(VECTORS)).status_code == 401  # no token


async def test_vectors_and_tags_survive_a_session_store_restart(steer: Stack, shape: tuple[int, int]):
    hidden, _ = shape
    kept = directions(hidden, [2], seed=3)
    async with httpx.AsyncClient(base_url=steer.http_url, timeout=60.0) as http:
        stored = await upload(http, as_json(kept), ROOT, tags="durable")
        assert stored.status_code == 200, stored.text
        steer.restart("session_store")

        async def back() -> bool:
            reply = await http.get(f"{VECTORS}/durable", headers=ROOT)
            return reply.status_code == 200 and reply.json()["id"] == id_of(kept)

        await wait_for(back, 60, "the session store's vectors after its restart")


async def test_every_bad_upload_gets_its_own_error_and_the_stack_serves_on(steer: Stack, shape: tuple[int, int],
                                                                           tmp_path: Path):
    hidden, layers = shape
    good = directions(hidden, [1], seed=4)
    bad_json = {
        "wrong hidden size": (as_json(directions(hidden + 1, [1], seed=5)), 400,
                              f"hidden size {hidden + 1}; the served model's is {hidden}"),
        "NaN": (b'{"directions": {"1": [' + b"0.5, " * (hidden - 1) + b"NaN]}}", 400, "NaN or Inf"),
        "a layer outside the model": (as_json(directions(hidden, [layers], seed=6)), 400,
                                      f"layers [{layers}] outside the served model's {layers} decoder layers"),
        "an oversized file": (b" " * (MAX_VECTOR_BYTES + 1), 413, "steering.max_vector_bytes"),
        "a malformed GGUF": (as_gguf(tmp_path, {"direction.1": good[1]})[:-9], 400, "not a readable GGUF file"),
        "a GGUF that is no control vector": (as_gguf(tmp_path, {"direction.1": good[1]}, arch="llama"), 400,
                                             "must be a control vector"),
        "a float16 tensor": (save({"1": good[1].astype(np.float16)}), 400, "must be float32"),
        "an empty body": (b"", 400, "empty"),
    }
    async with httpx.AsyncClient(base_url=steer.http_url, timeout=60.0) as http:
        for case, (data, status, message) in bad_json.items():
            reply = await upload(http, data, CAROL)
            assert reply.status_code == status and message in reply.json()["error"]["message"], (case, reply.text)
        for ref in ("0" * 64, "carol.nothing"):
            unknown = await http.get(f"{VECTORS}/{ref}", headers=CAROL)
            assert unknown.status_code == 404 and "unknown steering vector or tag" in unknown.text
        for seed in (7, 8):
            assert (await upload(http, as_json(directions(hidden, [1], seed)), CAROL)).status_code == 200
        over = await upload(http, as_json(directions(hidden, [1], 9)), CAROL)
        assert over.status_code == 429 and "steering.max_vectors_per_user = 2" in over.json()["error"]["message"]
        hers = {v["id"] for v in (await http.get(VECTORS, headers=CAROL)).json()["vectors"] if not v["tags"]}
        assert hers == {id_of(directions(hidden, [1], seed)) for seed in (7, 8)}  # (besides the public "durable")

        completion = await http.post("/v1/completions", headers=CAROL, json={
            "model": steer.settings.served_model_name, "prompt": "Hello", "max_tokens": 2, "temperature": 0})
        assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 2
