"""gRPC protocol definitions: checked-in stubs are fresh, and the schemas match their specs.

The expected field names/numbers below are transcribed by hand from the specs,
not read back from our .proto files:
  * salience.v1 from the published salience.proto (whose line breaks were lost in the copy we had);
  * evergreen.v2 from the published google-deepmind/evergreen-spec definitions.
"""

from __future__ import annotations

import hashlib
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from google.protobuf import any_pb2, descriptor, timestamp_pb2

from common.protos import build
from common.protos.evergreen.v2 import evergreen_pb2 as eg
from common.protos.evergreen.v2 import evergreen_pb2_grpc as eg_grpc
from common.protos.salience.v1 import salience_pb2 as sal
from common.protos.salience.v1 import salience_pb2_grpc as sal_grpc

FD = descriptor.FieldDescriptor
REPO = Path(__file__).resolve().parents[2]
# SHA-256 of the published salience.proto's words joined by single spaces (1,442 words): only line
# breaks and indentation may differ from it, nothing lost in a comment.
SALIENCE_PUBLISHED_WORDS_SHA256 = "0e47f9c0a2f57391a29f09363a2c04daa02e2c759cbcef55832f28d5751ea857"

# ---------------------------------------------------------------------------
# (a) checked-in stubs == freshly generated ones
# ---------------------------------------------------------------------------


def test_generated_stubs_are_up_to_date(tmp_path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools is needed to regenerate the stubs")
    build.generate(tmp_path)
    stale = []
    for rel in build.generated_files():
        fresh = (tmp_path / rel).read_bytes()
        checked_in = (build.PROTO_ROOT / rel).read_bytes()
        if fresh != checked_in:
            stale.append(rel)
    assert not stale, f"stale generated stubs {stale}: run `python -m common.protos.build`"


def test_stub_packages_and_imports():
    for rel in build.generated_files():
        d = (build.PROTO_ROOT / rel).parent
        while d != build.PROTO_ROOT.parent:
            assert (d / "__init__.py").is_file(), d
            d = d.parent
    # classes report the module they are importable from
    assert sal.GenerateRequest.__module__ == "common.protos.salience.v1.salience_pb2"
    assert eg.SessionMessage.__module__ == "common.protos.evergreen.v2.evergreen_pb2"
    assert sal.DESCRIPTOR.name == "salience/v1/salience.proto"
    assert eg.DESCRIPTOR.name == "evergreen/v2/evergreen.proto"


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def fields(msg) -> dict[str, tuple[int, int, str]]:
    """name -> (number, type, label) where label is 'repeated' / 'optional' / ''."""
    out = {}
    for f in msg.DESCRIPTOR.fields:
        if f.is_repeated:
            label = "repeated"
        elif f.containing_oneof is not None and f.containing_oneof.name == "_" + f.name:
            label = "optional"  # proto3 `optional` (synthetic oneof)
        else:
            label = ""
        out[f.name] = (f.number, f.type, label)
    return out


def msg_type(msg, name) -> str:
    return msg.DESCRIPTOR.fields_by_name[name].message_type.full_name


# ---------------------------------------------------------------------------
# (b) salience.v1 — expectations transcribed from the published salience.proto
# ---------------------------------------------------------------------------

SALIENCE_MESSAGES = {
    "OpenSessionRequest": {"model": (1, FD.TYPE_STRING, "")},
    "OpenSessionResponse": {"session_id": (1, FD.TYPE_STRING, ""), "max_model_len": (2, FD.TYPE_UINT32, "")},
    "CloseSessionRequest": {"session_id": (1, FD.TYPE_STRING, "")},
    "CloseSessionResponse": {},
    "ForkSessionRequest": {"session_id": (1, FD.TYPE_STRING, ""), "at_position": (2, FD.TYPE_UINT32, "")},
    "ForkSessionResponse": {"session_id": (1, FD.TYPE_STRING, "")},
    "ImageAttachment": {
        "bytes": (1, FD.TYPE_BYTES, ""),
        "mime": (2, FD.TYPE_STRING, ""),
        "pad_range_start": (3, FD.TYPE_UINT32, ""),
        "pad_range_end": (4, FD.TYPE_UINT32, ""),
    },
    "GenerateRequest": {
        "session_id": (1, FD.TYPE_STRING, ""),
        "append_tokens": (2, FD.TYPE_UINT32, "repeated"),
        "offset": (3, FD.TYPE_UINT32, ""),
        "truncating": (4, FD.TYPE_BOOL, ""),
        "max_tokens": (5, FD.TYPE_UINT32, ""),
        "logprobs_ranges": (6, FD.TYPE_MESSAGE, "repeated"),
        "logprob_top_k": (7, FD.TYPE_UINT32, ""),
        "readout_ranges": (8, FD.TYPE_MESSAGE, "repeated"),
        "temperature": (9, FD.TYPE_FLOAT, ""),
        "top_p": (10, FD.TYPE_FLOAT, ""),
        "top_k": (11, FD.TYPE_UINT32, ""),
        "stop_token_ids": (12, FD.TYPE_UINT32, "repeated"),
        "priority": (13, FD.TYPE_INT32, ""),
        "images": (14, FD.TYPE_MESSAGE, "repeated"),
    },
    "PositionRange": {"start": (1, FD.TYPE_UINT32, ""), "end": (2, FD.TYPE_UINT32, "")},
    "GenerateEvent": {"token": (1, FD.TYPE_MESSAGE, ""), "done": (2, FD.TYPE_MESSAGE, "")},
    "Token": {
        "id": (1, FD.TYPE_UINT32, ""),
        "position": (2, FD.TYPE_UINT32, ""),
        "is_prefill": (3, FD.TYPE_BOOL, ""),
        "readout": (4, FD.TYPE_FLOAT, "repeated"),
        "logprobs": (5, FD.TYPE_MESSAGE, "repeated"),
        "sampled_logprob": (6, FD.TYPE_FLOAT, ""),
        "has_sampled_logprob": (7, FD.TYPE_BOOL, ""),
    },
    "TokenLogprob": {"id": (1, FD.TYPE_UINT32, ""), "logprob": (2, FD.TYPE_FLOAT, "")},
    "GenerateDone": {
        "prompt_tokens": (1, FD.TYPE_UINT32, ""),
        "completion_tokens": (2, FD.TYPE_UINT32, ""),
        "total_tokens": (3, FD.TYPE_UINT32, ""),
        "finish_reason": (4, FD.TYPE_ENUM, ""),
    },
    "GetReadoutManifestRequest": {},
    "ReadoutManifest": {
        "concepts": (1, FD.TYPE_STRING, "repeated"),
        "layers": (2, FD.TYPE_UINT32, "repeated"),
        "hidden_size": (3, FD.TYPE_UINT32, ""),
        "dtype": (4, FD.TYPE_STRING, ""),
    },
    "DumpSessionRequest": {"session_id": (1, FD.TYPE_STRING, "")},
    "DumpSessionResponse": {"tokens": (1, FD.TYPE_UINT32, "repeated")},
}

# rpc name -> (request, response, server_streaming)
SALIENCE_RPCS = {
    "OpenSession": ("OpenSessionRequest", "OpenSessionResponse", False),
    "CloseSession": ("CloseSessionRequest", "CloseSessionResponse", False),
    "ForkSession": ("ForkSessionRequest", "ForkSessionResponse", False),
    "Generate": ("GenerateRequest", "GenerateEvent", True),
    "GetReadoutManifest": ("GetReadoutManifestRequest", "ReadoutManifest", False),
    "DumpSession": ("DumpSessionRequest", "DumpSessionResponse", False),
}


def test_salience_package_and_messages():
    assert sal.DESCRIPTOR.package == "salience.v1"
    assert set(sal.DESCRIPTOR.message_types_by_name) == set(SALIENCE_MESSAGES)
    for name, expected in SALIENCE_MESSAGES.items():
        assert fields(getattr(sal, name)) == expected, name


def test_salience_nested_types_oneof_and_packing():
    assert msg_type(sal.GenerateRequest, "logprobs_ranges") == "salience.v1.PositionRange"
    assert msg_type(sal.GenerateRequest, "readout_ranges") == "salience.v1.PositionRange"
    assert msg_type(sal.GenerateRequest, "images") == "salience.v1.ImageAttachment"
    assert msg_type(sal.Token, "logprobs") == "salience.v1.TokenLogprob"
    assert msg_type(sal.GenerateEvent, "token") == "salience.v1.Token"
    assert msg_type(sal.GenerateEvent, "done") == "salience.v1.GenerateDone"
    oneof = sal.GenerateEvent.DESCRIPTOR.oneofs_by_name["event"]
    assert [f.name for f in oneof.fields] == ["token", "done"]
    # `[packed = true]` on Token.readout and DumpSessionResponse.tokens
    assert sal.Token.DESCRIPTOR.fields_by_name["readout"].is_packed
    assert sal.DumpSessionResponse.DESCRIPTOR.fields_by_name["tokens"].is_packed


def test_salience_finish_reason_enum():
    enum = sal.GenerateDone.DESCRIPTOR.enum_types_by_name["FinishReason"]
    assert enum.full_name == "salience.v1.GenerateDone.FinishReason"
    assert {v.name: v.number for v in enum.values} == {
        "FINISH_REASON_UNSPECIFIED": 0,
        "FINISH_REASON_EOS": 1,
        "FINISH_REASON_LENGTH": 2,
        "FINISH_REASON_CANCELLED": 3,
        "FINISH_REASON_STOP_STRING": 4,
    }
    assert sal.GenerateDone.DESCRIPTOR.fields_by_name["finish_reason"].enum_type is enum


def test_salience_service():
    svc = sal.DESCRIPTOR.services_by_name["Salience"]
    assert svc.full_name == "salience.v1.Salience"
    got = {
        m.name: (m.input_type.name, m.output_type.name, m.server_streaming) for m in svc.methods
    }
    assert got == SALIENCE_RPCS
    assert not any(m.client_streaming for m in svc.methods)


def test_salience_round_trip():
    req = sal.GenerateRequest(
        session_id="s-1",
        append_tokens=[151652, 151655, 151655, 151653, 42],
        offset=17,
        truncating=True,
        max_tokens=8,
        logprobs_ranges=[sal.PositionRange(start=17, end=22)],
        logprob_top_k=5,
        readout_ranges=[sal.PositionRange(start=0, end=22)],
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        stop_token_ids=[2, 7],
        priority=-3,
        images=[sal.ImageAttachment(bytes=b"\x89PNG\r\n", mime="image/png", pad_range_start=17, pad_range_end=21)],
    )
    back = sal.GenerateRequest.FromString(req.SerializeToString())
    assert back == req
    assert list(back.append_tokens) == [151652, 151655, 151655, 151653, 42]
    assert back.priority == -3 and back.truncating and back.images[0].bytes == b"\x89PNG\r\n"

    for m in (
        sal.OpenSessionRequest(model="Qwen/Qwen2.5-VL-7B-Instruct"),
        sal.OpenSessionResponse(session_id="s-1", max_model_len=32768),
        sal.ForkSessionRequest(session_id="s-1", at_position=12),
        sal.DumpSessionResponse(tokens=[1, 2, 3, 1 << 31]),
        sal.ReadoutManifest(concepts=["honesty", "fear"], layers=[10, 20], hidden_size=3584, dtype="float16"),
    ):
        assert type(m).FromString(m.SerializeToString()) == m

    tok = sal.GenerateEvent(
        token=sal.Token(
            id=9,
            position=22,
            readout=[0.5, -1.25],
            logprobs=[sal.TokenLogprob(id=9, logprob=-0.125)],
            sampled_logprob=-0.125,
            has_sampled_logprob=True,
        )
    )
    done = sal.GenerateEvent(
        done=sal.GenerateDone(
            prompt_tokens=22, completion_tokens=1, total_tokens=23,
            finish_reason=sal.GenerateDone.FINISH_REASON_LENGTH,
        )
    )
    for ev, which in ((tok, "token"), (done, "done")):
        back = sal.GenerateEvent.FromString(ev.SerializeToString())
        assert back == ev and back.WhichOneof("event") == which
    # field 4, wire type 2: the packed readout [0.5, -1.25] is one length-delimited record
    assert sal.Token(readout=[0.5, -1.25]).SerializeToString() == b"\x22\x08\x00\x00\x00\x3f\x00\x00\xa0\xbf"


def test_salience_proto_is_the_published_one_modulo_whitespace():
    words = (build.PROTO_ROOT / "salience/v1/salience.proto").read_text(encoding="utf-8").split()
    assert hashlib.sha256(" ".join(words).encode()).hexdigest() == SALIENCE_PUBLISHED_WORDS_SHA256


# ---------------------------------------------------------------------------
# (c) evergreen.v2 — expectations transcribed from evergreen-spec
# ---------------------------------------------------------------------------

EVERGREEN_MESSAGES = {
    "SessionMessage": {
        "node_fragments": (1, FD.TYPE_MESSAGE, "repeated"),
        "actions": (2, FD.TYPE_MESSAGE, "repeated"),
    },
    "NodeFragment": {
        "id": (1, FD.TYPE_STRING, ""),
        "seq": (2, FD.TYPE_INT32, ""),
        "continued": (3, FD.TYPE_BOOL, ""),
        "child_ids": (4, FD.TYPE_STRING, "repeated"),
        "chunk_fragment": (5, FD.TYPE_MESSAGE, "optional"),
    },
    "Chunk": {
        "metadata": (1, FD.TYPE_MESSAGE, ""),
        "ref": (3, FD.TYPE_STRING, ""),
        "data": (10, FD.TYPE_BYTES, ""),
    },
    "ChunkMetadata": {
        "mimetype": (1, FD.TYPE_STRING, ""),
        "role": (2, FD.TYPE_STRING, ""),
        "original_file_name": (3, FD.TYPE_STRING, ""),
        "capture_time": (6, FD.TYPE_MESSAGE, ""),
        "experimental": (100, FD.TYPE_MESSAGE, "repeated"),
    },
    "NamedParameter": {"name": (1, FD.TYPE_STRING, ""), "id": (2, FD.TYPE_STRING, "")},
    "TargetSpec": {"id": (1, FD.TYPE_STRING, "")},
    "Action": {
        "name": (2, FD.TYPE_STRING, ""),
        "inputs": (3, FD.TYPE_MESSAGE, "repeated"),
        "outputs": (4, FD.TYPE_MESSAGE, "repeated"),
        "configs": (5, FD.TYPE_MESSAGE, "repeated"),
        "target_spec": (6, FD.TYPE_MESSAGE, ""),
    },
}


def test_evergreen_package_and_messages():
    assert eg.DESCRIPTOR.package == "evergreen.v2"
    assert set(eg.DESCRIPTOR.dependencies) == {any_pb2.DESCRIPTOR, timestamp_pb2.DESCRIPTOR}
    # EndOfTurn is our addition (spec names it only in a mimetype); it must stay empty
    assert set(eg.DESCRIPTOR.message_types_by_name) == set(EVERGREEN_MESSAGES) | {"EndOfTurn"}
    assert not eg.EndOfTurn.DESCRIPTOR.fields and eg.EndOfTurn().SerializeToString() == b""
    for name, expected in EVERGREEN_MESSAGES.items():
        assert fields(getattr(eg, name)) == expected, name


def test_evergreen_field_types_oneof_reserved():
    assert msg_type(eg.SessionMessage, "node_fragments") == "evergreen.v2.NodeFragment"
    assert msg_type(eg.SessionMessage, "actions") == "evergreen.v2.Action"
    assert msg_type(eg.NodeFragment, "chunk_fragment") == "evergreen.v2.Chunk"
    assert msg_type(eg.Chunk, "metadata") == "evergreen.v2.ChunkMetadata"
    assert msg_type(eg.ChunkMetadata, "capture_time") == "google.protobuf.Timestamp"
    assert msg_type(eg.ChunkMetadata, "experimental") == "google.protobuf.Any"
    assert msg_type(eg.Action, "inputs") == "evergreen.v2.NamedParameter"
    assert msg_type(eg.Action, "outputs") == "evergreen.v2.NamedParameter"
    assert msg_type(eg.Action, "configs") == "google.protobuf.Any"
    assert msg_type(eg.Action, "target_spec") == "evergreen.v2.TargetSpec"
    payload = eg.Chunk.DESCRIPTOR.oneofs_by_name["payload"]
    assert [f.name for f in payload.fields] == ["ref", "data"]
    # Action: `reserved 1;`
    assert 1 not in eg.Action.DESCRIPTOR.fields_by_number
    from google.protobuf import descriptor_pb2

    proto = descriptor_pb2.DescriptorProto()
    eg.Action.DESCRIPTOR.CopyToProto(proto)
    assert [(r.start, r.end) for r in proto.reserved_range] == [(1, 2)]


def test_evergreen_service():
    svc = eg.DESCRIPTOR.services_by_name["EvergreenService"]
    assert svc.full_name == "evergreen.v2.EvergreenService"
    [m] = svc.methods
    assert m.name == "StartSession"
    assert m.input_type.full_name == m.output_type.full_name == "evergreen.v2.SessionMessage"
    assert m.client_streaming and m.server_streaming


def test_evergreen_wire_bytes_and_round_trip():
    # hand-encoded: id=1 "a", seq=2 varint 1, continued=3 true, chunk_fragment=5 {data=10 "x"}
    frag = eg.NodeFragment(id="a", seq=1, continued=True, chunk_fragment=eg.Chunk(data=b"x"))
    assert frag.SerializeToString() == b"\x0a\x01a\x10\x01\x18\x01\x2a\x03\x52\x01x"
    assert eg.NodeFragment().HasField("chunk_fragment") is False

    cfg = any_pb2.Any()
    cfg.Pack(timestamp_pb2.Timestamp(seconds=5))
    msg = eg.SessionMessage(
        actions=[
            eg.Action(
                name="GENERATE",
                inputs=[eg.NamedParameter(name="prompt", id="prompt_1")],
                outputs=[eg.NamedParameter(name="response", id="response_1")],
                configs=[cfg],
                target_spec=eg.TargetSpec(id="smollm2"),
            )
        ],
        node_fragments=[
            eg.NodeFragment(id="prompt_1", child_ids=["question_1", "video_1"]),
            eg.NodeFragment(
                id="question_1",
                chunk_fragment=eg.Chunk(
                    metadata=eg.ChunkMetadata(
                        mimetype="text/plain", role="user", capture_time=timestamp_pb2.Timestamp(seconds=1)
                    ),
                    data=b"Write a summary of this video: ",
                ),
            ),
            eg.NodeFragment(
                id="video_1",
                continued=True,
                chunk_fragment=eg.Chunk(
                    metadata=eg.ChunkMetadata(mimetype="video/mp4"), ref="file://path/to/file/part1"
                ),
            ),
        ],
    )
    back = eg.SessionMessage.FromString(msg.SerializeToString())
    assert back == msg
    assert back.node_fragments[2].chunk_fragment.WhichOneof("payload") == "ref"
    assert back.node_fragments[1].chunk_fragment.WhichOneof("payload") == "data"
    unpacked = timestamp_pb2.Timestamp()
    assert back.actions[0].configs[0].Unpack(unpacked) and unpacked.seconds == 5


# ---------------------------------------------------------------------------
# the grpc stubs work end to end (in-process server on a free port)
# ---------------------------------------------------------------------------


class _Salience(sal_grpc.SalienceServicer):
    def Generate(self, request, context):
        for i, t in enumerate(request.append_tokens):
            yield sal.GenerateEvent(token=sal.Token(id=t, position=request.offset + i, is_prefill=True))
        yield sal.GenerateEvent(done=sal.GenerateDone(prompt_tokens=len(request.append_tokens)))


class _Evergreen(eg_grpc.EvergreenServiceServicer):
    def StartSession(self, request_iterator, context):
        for m in request_iterator:
            yield eg.SessionMessage(node_fragments=[eg.NodeFragment(id="echo_" + f.id) for f in m.node_fragments])


def test_grpc_stubs_end_to_end():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    sal_grpc.add_SalienceServicer_to_server(_Salience(), server)
    eg_grpc.add_EvergreenServiceServicer_to_server(_Evergreen(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            events = list(
                sal_grpc.SalienceStub(ch).Generate(sal.GenerateRequest(append_tokens=[5, 6], offset=3), timeout=10)
            )
            assert [e.WhichOneof("event") for e in events] == ["token", "token", "done"]
            assert [(e.token.id, e.token.position) for e in events[:2]] == [(5, 3), (6, 4)]
            with pytest.raises(grpc.RpcError) as err:
                sal_grpc.SalienceStub(ch).OpenSession(sal.OpenSessionRequest(), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED

            out = eg_grpc.EvergreenServiceStub(ch).StartSession(
                iter([eg.SessionMessage(node_fragments=[eg.NodeFragment(id="a")]),
                      eg.SessionMessage(node_fragments=[eg.NodeFragment(id="b")])]),
                timeout=10,
            )
            assert [m.node_fragments[0].id for m in out] == ["echo_a", "echo_b"]
    finally:
        server.stop(None)
