"""The session store's request records, feedback and Evergreen fragments as typed replies (SQLite layer
and service handler, no sockets)."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import msgspec
import pytest

from common import wire
from common.config import Settings
from services.session_store.db import Store
from services.session_store.service import SessionStore

# The JSON shape ``GET /v1/requests/{rid}`` has always had: the requests table's columns, then feedback.
RECORD_KEYS = ["rid", "surface", "model", "prompt", "params", "created_at", "generated_text", "finish_reason",
               "prompt_tokens", "completion_tokens", "error", "finished_at", "feedback"]


ALICE = wire.Principal(user="alice")
BOB = wire.Principal(user="bob")


@pytest.fixture
def service(tmp_path: Path) -> SessionStore:
    service = SessionStore(Settings(run_dir=tmp_path))  # binds its socket under tmp_path; nothing connects
    yield service
    service.router.close()
    service.store.close()


def over_the_wire(reply: wire.Msg) -> wire.Message:
    return wire.decode(wire.encode(reply))


def test_a_record_before_and_after_its_completion_and_feedback(service: SessionStore):
    record = wire.RecordRequest(rid="r1", owner="alice", surface="rest", model="m", prompt="Hi ☃", params={"max_tokens": 2},
                                created_at=5.0)
    assert isinstance(service.handle(record), wire.Ok)
    reply = over_the_wire(service.handle(wire.GetRequest(rid="r1", caller=ALICE)))
    assert isinstance(reply, wire.RequestRecordReply)
    shown = msgspec.to_builtins(reply.record)
    assert list(shown) == RECORD_KEYS
    assert shown["params"] == {"max_tokens": 2} and shown["prompt"] == "Hi ☃" and shown["created_at"] == 5.0
    assert shown["generated_text"] is None and shown["finished_at"] is None and shown["feedback"] == []

    done = wire.RecordCompletion(rid="r1", generated_text="Hello", finish_reason="length", prompt_tokens=3,
                                 completion_tokens=2)
    assert isinstance(service.handle(done), wire.Ok)
    first = over_the_wire(service.handle(wire.RecordFeedback(rid="r1", caller=ALICE, rating=0.5, text="good", position=2)))
    second = over_the_wire(service.handle(wire.RecordFeedback(rid="r1", caller=ALICE, rating=-1)))
    assert isinstance(first, wire.FeedbackRecorded) and second.feedback_id > first.feedback_id
    record = over_the_wire(service.handle(wire.GetRequest(rid="r1", caller=ALICE))).record
    assert (record.generated_text, record.finish_reason, record.prompt_tokens, record.completion_tokens,
            record.error) == ("Hello", "length", 3, 2, "")
    assert record.finished_at is not None and record.finished_at >= 0
    assert [(f.id, f.rating, f.text, f.position) for f in record.feedback] == [
        (first.feedback_id, 0.5, "good", 2), (second.feedback_id, -1.0, "", None)]
    assert list(msgspec.to_builtins(record.feedback[0])) == ["id", "rating", "text", "position", "created_at"]


def test_unknown_requests_are_not_found(service: SessionStore):
    for msg in (wire.GetRequest(rid="nope", caller=ALICE), wire.RecordFeedback(rid="nope", caller=ALICE, rating=1)):
        reply = service.handle(msg)
        assert isinstance(reply, wire.Error) and reply.code == "not_found" and reply.rid == "nope"


def test_evergreen_nodes_come_back_in_node_and_seq_order(service: SessionStore):
    frags = [wire.EvergreenFragment(node_id=n, seq=s, fragment=bytes([s])) for n, s in (("b", 1), ("a", 0), ("b", 0))]
    assert isinstance(service.handle(wire.EvergreenPut(session_id="s", fragments=frags)), wire.Ok)
    reply = over_the_wire(service.handle(wire.EvergreenGetNodes(session_id="s")))
    assert isinstance(reply, wire.EvergreenNodes)
    assert [(f.node_id, f.seq, f.fragment) for f in reply.fragments] == [("a", 0, b"\0"), ("b", 0, b"\0"),
                                                                         ("b", 1, b"\1")]
    assert over_the_wire(service.handle(wire.EvergreenGetNodes(session_id="other"))) == wire.EvergreenNodes()


def test_store_layer_returns_typed_rows(tmp_path: Path):
    store = Store(tmp_path / "db.sqlite3", "localhost")
    try:
        assert store.get_request("x", ALICE) is None and store.evergreen_fragments("s") == []
    finally:
        store.close()


def test_stored_responses_put_get_delete_and_expire(service: SessionStore, monkeypatch):
    """Responses API responses: kept as put (JSON text, the owner with them), replaced when put again, gone once
    deleted or past their TTL (the sweep removes those); unknown ones are not_found."""
    put = wire.ResponsePut(response_id="resp_1", owner="alice", body='{"id": "resp_1"}', input_items="[]",
                           conversation='[{"type": "message"}]', ttl_s=60)
    assert isinstance(service.handle(put), wire.Ok)
    record = over_the_wire(service.handle(wire.ResponseGet(response_id="resp_1")))
    assert isinstance(record, wire.ResponseRecord)
    assert (record.owner, record.body, record.conversation) == ("alice", '{"id": "resp_1"}', '[{"type": "message"}]')
    assert isinstance(service.handle(wire.ResponseDelete(response_id="resp_1")), wire.Ok)
    for msg in (wire.ResponseGet(response_id="resp_1"), wire.ResponseDelete(response_id="resp_1")):
        reply = service.handle(msg)
        assert isinstance(reply, wire.Error) and reply.code == "not_found"

    service.handle(put)
    later = time.time() + 61
    monkeypatch.setattr("services.session_store.db.time.time", lambda: later)
    assert service.handle(wire.ResponseGet(response_id="resp_1")).code == "not_found"  # past its TTL
    assert service.store.expire_responses() == 1


def test_a_malformed_response_put_is_refused_on_the_wire():
    bad = msgspec.msgpack.encode({"type": "response_put", "response_id": "r", "owner": "a", "body": "{}",
                                  "input_items": "[]", "conversation": "[]", "ttl_s": 0})
    with pytest.raises(wire.WireError, match="ttl_s"):
        wire.decode(bad)


def test_another_users_request_and_its_feedback_are_not_found(service: SessionStore):
    service.handle(wire.RecordRequest(rid="r1", owner="alice", surface="rest", model="m", prompt="secret"))
    for who, found in ((BOB, False), (ALICE, True), (wire.Principal(user="root", admin=True), True)):
        reply = service.handle(wire.GetRequest(rid="r1", caller=who))
        feedback = service.handle(wire.RecordFeedback(rid="r1", caller=who, rating=1))
        if found:
            assert isinstance(reply, wire.RequestRecordReply) and isinstance(feedback, wire.FeedbackRecorded)
        else:  # word for word what an unknown id gets, but the id
            unknown = service.handle(wire.GetRequest(rid="r2", caller=who))
            assert isinstance(reply, wire.Error) and reply.code == "not_found"
            assert reply.message == unknown.message.replace("r2", "r1")
            assert isinstance(feedback, wire.Error) and feedback.code == "not_found"
    record = service.handle(wire.GetRequest(rid="r1", caller=ALICE)).record
    assert len(record.feedback) == 2  # bob's was not kept


def test_a_requests_table_made_before_owners_is_migrated_to_the_implicit_user(tmp_path: Path):
    path = tmp_path / "old.sqlite3"
    old = sqlite3.connect(path)
    old.execute("CREATE TABLE requests (rid TEXT PRIMARY KEY, surface TEXT NOT NULL, model TEXT NOT NULL, prompt TEXT "
                "NOT NULL, params TEXT NOT NULL, created_at REAL NOT NULL, generated_text TEXT, finish_reason TEXT, "
                "prompt_tokens INTEGER, completion_tokens INTEGER, error TEXT, finished_at REAL)")
    old.execute("INSERT INTO requests (rid, surface, model, prompt, params, created_at) VALUES "
                "('old', 'rest', 'm', 'hi', '{}', 1.0)")
    old.commit()
    old.close()
    store = Store(path, "localhost")
    try:
        assert store.get_request("old", wire.Principal(user="localhost")).prompt == "hi"
        assert store.get_request("old", ALICE) is None
    finally:
        store.close()


def test_close_says_whether_it_closed_so_that_only_then_parked_kv_goes(service: SessionStore):
    opened = service.handle(wire.SalienceOpen(model="m", caller=ALICE))
    bobs = over_the_wire(service.handle(wire.SalienceClose(session_id=opened.session_id, caller=BOB)))
    assert bobs == wire.Ok()  # as for an unknown id: the gateway sends the scheduler no SessionDrop
    closed = over_the_wire(service.handle(wire.SalienceClose(session_id=opened.session_id, caller=ALICE)))
    assert closed == wire.SalienceSession(session_id=opened.session_id)
    assert over_the_wire(service.handle(wire.SalienceClose(session_id=opened.session_id, caller=ALICE))) == wire.Ok()
