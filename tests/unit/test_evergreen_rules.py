"""Evergreen's pure parts: node-graph rules, refs, turns, action binding and configs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import any_pb2, struct_pb2

from common import wire
from common.config import Settings
from common.protos.evergreen.v2 import evergreen_pb2 as eg
from services.gateway.evergreen.actions import bind
from services.gateway.evergreen.config import GenerateParams, TtlParams, action_config
from services.gateway.evergreen.errors import SessionAbort
from services.gateway.evergreen.graph import NodeGraph
from services.gateway.evergreen.refs import read_ref, resolve_ref
from services.gateway.grpc_requests import client_address
from services.gateway.evergreen.turns import END_OF_TURN, check_media, to_turns

TEXT = eg.ChunkMetadata(mimetype="text/plain")


def text(node_id: str, data: str, *, seq: int = 0, continued: bool = False, meta: bool | None = None) -> eg.NodeFragment:
    chunk = eg.Chunk(data=data.encode())
    if meta if meta is not None else seq == 0:
        chunk.metadata.CopyFrom(TEXT)
    return eg.NodeFragment(id=node_id, seq=seq, continued=continued, chunk_fragment=chunk)


def parent(node_id: str, *children: str, seq: int = 0, continued: bool = False) -> eg.NodeFragment:
    return eg.NodeFragment(id=node_id, seq=seq, continued=continued, child_ids=list(children))


@pytest.fixture
def graph(tmp_path: Path) -> NodeGraph:
    return NodeGraph(max_depth=4, max_nodes=50, max_bytes=1000, ref_root=tmp_path)


@contextlib.contextmanager
def aborts(match: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT) -> Iterator[None]:
    with pytest.raises(SessionAbort, match=match) as info:
        yield
    assert info.value.status == code


def contents(graph: NodeGraph, root: str) -> tuple[list[bytes | str], bool]:
    flat = graph.flatten(root, max_visits=1000)
    return [p for leaf in flat.leaves for p in leaf.parts], flat.complete


def test_children_before_parents_and_streamed_nodes(graph):
    graph.add(text("b", "B0", continued=True))
    assert contents(graph, "root") == ([], False)  # unknown root: waiting, not an error
    graph.add(parent("root", "a", "b", continued=True))
    assert contents(graph, "root") == ([b"B0"], False)
    graph.add(text("a", "A"))
    graph.add(text("b", "B1", seq=1))
    graph.add(parent("root", "c", seq=1))
    assert contents(graph, "root") == ([b"A", b"B0", b"B1"], False)
    graph.add(text("c", "C"))
    assert contents(graph, "root") == ([b"A", b"B0", b"B1", b"C"], True)


def test_fragments_out_of_seq_order(graph):
    graph.add(text("a", "2", seq=2))
    graph.add(text("a", "0", continued=True))
    assert not graph.nodes["a"].complete
    graph.add(text("a", "1", seq=1, continued=True))
    assert contents(graph, "a") == ([b"0", b"1", b"2"], True)


def test_duplicate_seq_keeps_the_first_silently(graph):
    assert graph.add(text("a", "first", continued=True))
    assert not graph.add(text("a", "second"))  # a retry: ignored, even with other content
    assert not graph.add(text("a", "third", meta=True, seq=0))
    graph.add(text("a", "end", seq=1))
    assert contents(graph, "a") == ([b"first", b"end"], True)


def test_a_parent_may_start_with_an_empty_fragment(graph):
    graph.add(parent("p", continued=True))
    graph.add(parent("p", "a", seq=1))
    graph.add(text("a", "A"))
    assert contents(graph, "p") == ([b"A"], True)


def test_defaults_seq_zero_and_final(graph):
    graph.add(eg.NodeFragment(id="a", chunk_fragment=eg.Chunk(metadata=TEXT, data=b"x")))
    assert graph.nodes["a"].final_seq == 0 and graph.nodes["a"].complete


@pytest.mark.parametrize(
    "fragments, match",
    [
        ([text("a", "x"), text("a", "y", seq=1)], r"node 'a': fragment seq 1 follows its final fragment \(seq 0\)"),
        ([text("a", "x", seq=3), text("a", "y", seq=1)], r"seq 1 is marked final but seq 3 already was"),
        ([text("a", "x", seq=3, continued=True), text("a", "y", seq=1)], r"seq 1 is marked final but seq 3 was received"),
        ([text("a", "x", continued=True), text("a", "y", seq=1, meta=True)], r"seq 1 carries metadata; only the fragment with seq 0"),
        ([eg.NodeFragment(id="a", chunk_fragment=eg.Chunk(data=b"x"))], r"seq 0 of a leaf must carry metadata with a mimetype"),
        ([eg.NodeFragment(chunk_fragment=eg.Chunk(metadata=TEXT))], r"a node_fragment has no id"),
        ([eg.NodeFragment(id="a", seq=-1)], r"seq -1 is negative"),
        ([eg.NodeFragment(id="a", child_ids=["b"], chunk_fragment=eg.Chunk(metadata=TEXT))], r"both child_ids and chunk_fragment"),
        ([text("a", "x", continued=True), parent("a", "b", seq=1)], r"mixes content kinds; the node is a leaf"),
        # a leaf's seq 0 without any chunk (so without metadata), before or after the leaf's data
        ([parent("a", continued=True), text("a", "x", seq=1)], r"node 'a': seq 0 of a leaf must carry metadata"),
        ([text("a", "x", seq=1), parent("a", continued=True)], r"node 'a': seq 0 of a leaf must carry metadata"),
        ([parent("a", "a")], r"cycle in the node graph: a → a"),
        ([parent("a", "b"), parent("b", "c"), parent("c", "a")], r"cycle in the node graph: c → a → b → c"),
        ([parent("a", "b"), parent("c", "a"), parent("b", "c")], r"cycle in the node graph: b → c → a → b"),
        ([parent("n1", "n2"), parent("n2", "n3"), parent("n3", "n4"), parent("n4", "n5"), parent("n5", "n6")],
         r"nest 5 levels deep; the limit is 4"),
        ([parent("n4", "n5"), parent("n3", "n4"), parent("n1", "n2"), parent("n2", "n3"), parent("n5", "n6")],
         r"nest 5 levels deep; the limit is 4"),
    ],
)
def test_rules_abort(graph, fragments, match):
    with aborts(match):
        for fragment in fragments:
            graph.add(fragment)


def test_limits(tmp_path):
    small = NodeGraph(max_depth=4, max_nodes=2, max_bytes=1000, ref_root=tmp_path)
    small.add(text("a", "x"))
    small.add(text("b", "x"))
    with aborts("holds its limit of 2 nodes", grpc.StatusCode.RESOURCE_EXHAUSTED):
        small.add(text("c", "x"))
    tiny = NodeGraph(max_depth=4, max_nodes=10, max_bytes=1024, ref_root=tmp_path)
    with aborts("exceeds its limit of 1024 bytes", grpc.StatusCode.RESOURCE_EXHAUSTED):
        tiny.add(text("a", "x" * 1025))


def test_flatten_is_bounded_on_shared_subtrees(graph):
    wide = NodeGraph(max_depth=40, max_nodes=100, max_bytes=1000, ref_root=Path("/"))
    for i in range(30):
        wide.add(parent(f"n{i}", f"n{i + 1}", f"n{i + 1}"))  # 2**30 paths
    with pytest.raises(SessionAbort, match="flattens to more than 1000 nodes"):
        wide.flatten("n0", max_visits=1000)


def test_outputs_must_be_new_and_are_server_written(graph):
    graph.add(text("a", "x"))
    with aborts("output node 'a' is not new"):
        graph.claim_output("a")
    graph.claim_output("out")
    with aborts("output node 'out' is not new"):
        graph.claim_output("out")
    with aborts("node 'out' is an action's output: only the server writes it"):
        graph.add(text("out", "forged"))
    graph.add(text("out", "ok"), from_server=True)


def test_drop_and_descendants(graph):
    graph.add(parent("root", "a", "b"))
    graph.add(text("a", "A"))
    graph.add(text("b", "B"))
    assert sorted(graph.descendants("root")) == ["a", "b", "root"]
    assert graph.drop(["a", "missing"]) == ["a"]
    assert contents(graph, "root") == ([b"B"], False)  # a dropped child is waited for again
    graph.add(text("a", "A2"))
    assert contents(graph, "root") == ([b"A2", b"B"], True)


# -- refs --------------------------------------------------------------------------------


def test_refs(tmp_path):
    (tmp_path / "path/to").mkdir(parents=True)
    (tmp_path / "path/to/part1").write_bytes(b"hello")
    assert resolve_ref("file://path/to/part1", tmp_path) == tmp_path / "path/to/part1"
    assert read_ref(f"file://{tmp_path}/path/to/part1", tmp_path, 100) == b"hello"
    (tmp_path / "link").symlink_to("/etc")
    for uri, match in [
        ("https://example.com/x", "only file:// refs are supported"),
        ("path/to/part1", r"only file:// refs are supported \(no scheme\)"),
        ("file://path/../../etc/passwd", "'..' is not allowed"),
        ("file:///etc/passwd", "outside the allowed directory"),
        ("file://link/passwd", "outside the allowed directory"),
        ("file://", "names no file"),
    ]:
        with aborts(match):
            resolve_ref(uri, tmp_path)
    with aborts("cannot be read"):
        read_ref("file://path/to/missing", tmp_path, 100)
    with aborts("larger than the session's 3 byte limit", grpc.StatusCode.RESOURCE_EXHAUSTED):
        read_ref("file://path/to/part1", tmp_path, 3)


def test_graph_checks_refs_on_arrival(graph):
    with aborts("only file:// refs are supported"):
        graph.add(eg.NodeFragment(id="v", chunk_fragment=eg.Chunk(metadata=TEXT, ref="s3://bucket/key")))


# -- turns -------------------------------------------------------------------------------


def meta(mimetype: str = "text/plain", role: str = "") -> eg.ChunkMetadata:
    return eg.ChunkMetadata(mimetype=mimetype, role=role)


def test_turns():
    eot = meta(END_OF_TURN)
    chunks = [
        ("q", meta(), b"Write a summary of this video: "),
        ("v", meta("text/plain; charset=utf-8"), b"[transcript]"),
        ("r", meta(role="assistant"), b"It is an F1 race."),
        ("q2", meta(), b"Who's winning?"),
        ("e", eot, b""),
        ("q3", meta("text/markdown"), b"*More*"),
    ]
    assert to_turns(chunks) == [
        {"role": "user", "content": "Write a summary of this video: [transcript]"},
        {"role": "assistant", "content": "It is an F1 race."},
        {"role": "user", "content": "Who's winning?"},
        {"role": "user", "content": "*More*"},
    ]
    with aborts("holds no text"):
        to_turns([("e", eot, b"")])
    with aborts("not valid UTF-8"):
        to_turns([("q", meta(), b"\xff")])


def test_media_checks():
    check_media("a", meta(END_OF_TURN), "M")
    check_media("a", meta("application/x-protobuf;type=EndOfTurn"), "M")
    with aborts(r"node 'v': mimetype 'video/mp4' cannot be given to M, which takes text only"):
        check_media("v", meta("video/mp4"), "M")
    with aborts("mimetype 'image/webp'"):
        check_media("i", meta("image/webp"), "M")
    with aborts("role 'robot' is not one of system, user, assistant"):
        check_media("a", meta(role="robot"), "M")


# -- actions and configs -----------------------------------------------------------------


def action(name: str = "GENERATE", inputs=(("prompt", "p"),), outputs=(("response", "r"),), config=None) -> eg.Action:
    a = eg.Action(
        name=name,
        inputs=[eg.NamedParameter(name=n, id=i) for n, i in inputs],
        outputs=[eg.NamedParameter(name=n, id=i) for n, i in outputs],
    )
    if config is not None:
        packed = any_pb2.Any()
        packed.Pack(config)
        a.configs.append(packed)
    return a


def test_bind():
    b = bind(action(name="TRY_GENERATE", outputs=(("text", "r"), ("error", "e"))))
    assert (b.input_id, b.output_id, b.error_id) == ("p", "r", "e")
    assert bind(action(inputs=(("text", "p"),), outputs=())).output_id is None
    for a, match in [
        (action(name="SUMMARIZE"), "unknown action 'SUMMARIZE'; this server provides GENERATE, TRY_GENERATE, DROP, "
         "SET_TTL, CANCEL"),
        (action(inputs=(("image", "p"),)), r"GENERATE: unknown input 'image' \(takes 'prompt' or 'text'\)"),
        (action(outputs=(("video", "r"),)), r"GENERATE: unknown output 'video' \(takes 'response' or 'text'\)"),
        (action(inputs=(("prompt", "p"), ("prompt", "q"))), "input 'prompt' is given twice"),
        (action(inputs=(("prompt", "p"), ("text", "q"))), "give exactly one input"),
        (action(inputs=()), "give exactly one input"),
        (action(outputs=(("response", "r"), ("text", "s"))), "at most one of the outputs"),
        (action(name="DROP", inputs=(("node", "n"),), outputs=(("response", "r"),)), r"unknown output 'response' \(takes none\)"),
    ]:
        with aborts(match):
            bind(a)


def test_generate_config():
    settings = Settings()
    params = action_config(
        action(config=struct_pb2.Struct(fields={
            "max_tokens": struct_pb2.Value(number_value=7),
            "temperature": struct_pb2.Value(number_value=0),
            "stop": struct_pb2.Value(list_value=struct_pb2.ListValue(values=[struct_pb2.Value(string_value="\n")])),
        })),
        GenerateParams,
        settings,
    )
    assert (params.max_tokens, params.temperature, params.stop) == (7, 0.0, ["\n"])
    assert action_config(action(), GenerateParams, settings) == GenerateParams()
    bad = action(config=struct_pb2.Struct(fields={"temperature": struct_pb2.Value(number_value=-1)}))
    with aborts(r"GENERATE: configs.temperature: Input should be greater than or equal to 0"):
        action_config(bad, GenerateParams, settings)
    unknown = action(config=struct_pb2.Struct(fields={"tempreature": struct_pb2.Value(number_value=1)}))
    with aborts(r"configs.tempreature: unknown field"):
        action_config(unknown, GenerateParams, settings)
    with aborts(r"unsupported type 'type.googleapis.com/google.protobuf.Value'; pack a google.protobuf.Struct"):
        action_config(action(config=struct_pb2.Value(number_value=1)), GenerateParams, settings)
    with aborts("SET_TTL: configs: a config is required"):
        action_config(action("SET_TTL", (("node", "n"),), ()), TtlParams, settings, required=True)
    invalid_utf8 = eg.Action(name="GENERATE", configs=[any_pb2.Any(
        type_url="type.googleapis.com/google.protobuf.Struct",
        value=b"\x0a\x07" + b"\x0a\x01\xff" + b"\x12\x02\x08\x00",  # {"\xff": null}: a key that is not UTF-8
    )])
    with aborts("GENERATE: configs: not a valid google.protobuf.Struct"):
        action_config(invalid_utf8, GenerateParams, settings)


def test_client_address():
    assert client_address("ipv4:127.0.0.1:48896") == "127.0.0.1"
    assert client_address("ipv6:[::1]:5000") == "::1"
    assert client_address("unix:/tmp/sock") == "unix:/tmp/sock"


def test_store_messages_round_trip():
    frag = text("a", "x")
    put = wire.EvergreenPut(
        session_id="egs_1", fragments=[wire.EvergreenFragment(node_id="a", seq=0, fragment=frag.SerializeToString())]
    )
    back = wire.decode(wire.encode(put))
    assert back == put and eg.NodeFragment.FromString(back.fragments[0].fragment) == frag
    for m in (wire.EvergreenDrop(session_id="s", node_ids=["a"]), wire.EvergreenClose(session_id="s"),
              wire.EvergreenGetNodes(session_id="s")):
        assert wire.decode(wire.encode(m)) == m
