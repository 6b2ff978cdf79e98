"""The session store's steering vectors (services/session_store/vectors.py) through its message handler, no sockets:
content addressing, who reaches a vector, tags under common.tags' rules, letting go of a vector, the quota, and all
of it after the store reopens its database."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from common import wire
from common.config import Settings, Steering
from common.steering import SteeringVector, decode, encode, vector_id
from services.session_store.service import SessionStore

ALICE, BOB, ROOT = wire.Principal(user="alice"), wire.Principal(user="bob"), wire.Principal(user="root", admin=True)


def content(seed: int, hidden: int = 4) -> bytes:
    rng = np.random.default_rng(seed)
    return encode(SteeringVector(hidden_size=hidden, directions={2: rng.standard_normal(hidden).astype(np.float32),
                                                                 5: rng.standard_normal(hidden).astype(np.float32)}))


def open_store(run_dir: Path, **steering: int) -> SessionStore:
    return SessionStore(Settings(run_dir=run_dir, steering=Steering(**steering)))


@pytest.fixture
def store(tmp_path: Path) -> SessionStore:
    service = open_store(tmp_path, max_vectors_per_user=3)
    yield service
    service.router.close()
    service.store.close()


def ask(store: SessionStore, msg: wire.Msg) -> wire.Message:
    return wire.decode(wire.encode(store.handle(msg)))  # what the gateway would read


def put(store: SessionStore, data: bytes, who: wire.Principal, tags: list[str] = ()) -> wire.Message:
    return ask(store, wire.VectorPut(caller=who, content=data, tags=list(tags)))


def listed(store: SessionStore, who: wire.Principal) -> list[str]:
    return [v.id for v in ask(store, wire.VectorList(caller=who)).vectors]


def test_a_vector_is_its_content_and_reaches_its_uploaders_and_admins_only(store: SessionStore):
    data = content(1)
    reply = put(store, data, ALICE, ["alice.calm"])
    info = reply.info
    assert info.id == vector_id(data) and info.hidden_size == 4 and info.layers == [2, 5] and info.tags == ["alice.calm"]
    assert info.norms == pytest.approx(list(decode(data).norms().values()))
    assert ask(store, wire.VectorGet(ref="alice.calm", caller=ALICE)).info.id == info.id
    assert ask(store, wire.VectorGet(ref=info.id, caller=ROOT)).info.tags == ["alice.calm"]
    for ref in (info.id, "alice.calm"):  # bob is told what an unknown name gets
        refused = ask(store, wire.VectorGet(ref=ref, caller=BOB))
        assert isinstance(refused, wire.Error) and refused.code == "not_found" and ref in refused.message
    assert listed(store, ALICE) == [info.id] and listed(store, BOB) == [] and listed(store, ROOT) == [info.id]
    found = ask(store, wire.VectorLookup(refs=["alice.calm", info.id], caller=ALICE))
    assert found.ids == [info.id, info.id] and found.contents == {info.id: data}
    assert ask(store, wire.VectorLookup(refs=[info.id], caller=ALICE, cached=[info.id])).contents == {}
    unknown = ask(store, wire.VectorLookup(refs=[info.id, "alice.nope"], caller=ALICE))
    assert unknown.code == "not_found" and "alice.nope" in unknown.message


def test_an_admins_tag_is_everyones_and_a_users_only_theirs(store: SessionStore):
    vid = put(store, content(1), ALICE).info.id
    tagged = ask(store, wire.VectorTag(vector_id=vid, tags=["calm"], caller=ROOT))
    assert [t.tag for t in tagged.tags] == ["calm"] and tagged.tags[0].updated_by == "root"
    assert ask(store, wire.VectorGet(ref="calm", caller=BOB)).info.id == vid  # the catalogue
    assert listed(store, BOB) == [vid]
    assert ask(store, wire.VectorTag(vector_id=vid, tags=["bob.calm"], caller=BOB)).tags[0].tag == "bob.calm"
    assert [t.tag for t in ask(store, wire.VectorTagList(caller=BOB)).tags] == ["bob.calm", "calm"]
    assert [t.tag for t in ask(store, wire.VectorTagList(caller=ALICE)).tags] == ["calm"]
    ask(store, wire.VectorTag(vector_id=vid, tags=["bob.rooted"], caller=ROOT))  # an admin took bob's name first
    for name, message in (("alice.x", "must start with 'bob.'"), ("bob.rooted", "belongs to another user"),
                          ("deadbeefdeadbeefdeadbeef", "looks like a vector id")):
        refused = ask(store, wire.VectorTag(vector_id=vid, tags=["bob.ok", name], caller=BOB))
        assert refused.code == "invalid_request" and message in refused.message
    assert "bob.ok" not in [t.tag for t in ask(store, wire.VectorTagList(caller=BOB)).tags]  # all or nothing
    other = put(store, content(2), ALICE).info.id
    assert ask(store, wire.VectorTag(vector_id=other, tags=["alice.y"], caller=BOB)).code == "not_found"
    refused_put = put(store, content(3), BOB, ["alice.z"])
    assert refused_put.code == "invalid_request" and listed(store, BOB) == [vid]  # nothing stored


def test_deleting_lets_go_and_the_vector_goes_with_its_last_holder(store: SessionStore):
    data = content(1)
    vid = put(store, data, ALICE, ["alice.a"]).info.id
    assert put(store, data, BOB, ["bob.b"]).info.tags == ["bob.b"]
    assert ask(store, wire.VectorDelete(vector_id=vid, caller=wire.Principal(user="carol"))).code == "not_found"
    assert isinstance(ask(store, wire.VectorDelete(vector_id=vid, caller=ALICE)), wire.Ok)
    assert ask(store, wire.VectorGet(ref="alice.a", caller=ALICE)).code == "not_found"  # her tag went with her hold
    assert ask(store, wire.VectorGet(ref=vid, caller=ALICE)).code == "not_found"
    assert ask(store, wire.VectorGet(ref="bob.b", caller=BOB)).info.id == vid  # bob's is his still
    assert ask(store, wire.VectorDelete(vector_id=vid, caller=ALICE)).code == "not_found"
    assert isinstance(ask(store, wire.VectorDelete(vector_id=vid, caller=BOB)), wire.Ok)
    assert listed(store, ROOT) == [] and ask(store, wire.VectorTagList(caller=ROOT)).tags == []
    again = put(store, data, BOB).info.id
    ask(store, wire.VectorTag(vector_id=again, tags=["calm"], caller=ROOT))
    assert isinstance(ask(store, wire.VectorDelete(vector_id=again, caller=ROOT)), wire.Ok)  # an admin's: at once
    assert listed(store, BOB) == [] and ask(store, wire.VectorGet(ref="calm", caller=BOB)).code == "not_found"


def test_the_quota_counts_holdings_and_storing_again_is_free(store: SessionStore):
    ids = [put(store, content(seed), ALICE).info.id for seed in range(3)]
    assert put(store, content(0), ALICE).info.id == ids[0]
    refused = put(store, content(9), ALICE)
    assert refused.code == "rate_limited" and "steering.max_vectors_per_user = 3" in refused.message
    assert isinstance(put(store, content(9), BOB), wire.VectorReply)  # bob's own count


def test_content_that_is_not_canonical_is_refused(store: SessionStore):
    refused = put(store, b"tiller-steering-v1\n" + b"\0" * 3, ALICE)
    assert refused.code == "invalid_request" and "canonical" in refused.message


def test_vectors_and_tags_survive_a_reopened_store(tmp_path: Path):
    first = open_store(tmp_path)
    data = content(4)
    vid = put(first, data, ALICE, ["alice.kept"]).info.id
    first.router.close()
    first.store.close()
    second = open_store(tmp_path)
    try:
        assert ask(second, wire.VectorLookup(refs=["alice.kept"], caller=ALICE)).contents == {vid: data}
    finally:
        second.router.close()
        second.store.close()
