"""The Evergreen protocol end to end with a grpcio client on the real stack.

The Evergreen spec's three examples run as written (the video of the first is a text transcript, since the
model takes text only; the real video/mp4 is refused). Greedy output is compared with transformers
on the flattened prompt rendered by the tokenizer's chat template, as the gateway renders it.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

import grpc
import httpx
import pytest
from google.protobuf import any_pb2, struct_pb2

from common import wire
from common.protos.evergreen.v2 import evergreen_pb2 as eg
from common.protos.evergreen.v2 import evergreen_pb2_grpc as eg_grpc
from common.sockets import Dealer
from services.gateway.evergreen.service import SESSION_ID_HEADER
from services.gateway.evergreen.turns import END_OF_TURN

RPC_TIMEOUT_S = 120.0
MAX_TOKENS = 24
NOVEL = "Write a heroic novel about a half-eaten jam doughnut."
QUESTION_1 = "Write a summary of this video: "
TRANSCRIPT = ["Lap 52 of the Monaco Grand Prix. Senna leads Prost ", "by four seconds as the rain starts."]


# -- building messages ------------------------------------------------------------------------


def config(**fields: object) -> any_pb2.Any:
    struct = struct_pb2.Struct()
    struct.update(fields)
    packed = any_pb2.Any()
    packed.Pack(struct)
    return packed


GREEDY = config(max_tokens=MAX_TOKENS, temperature=0)


def generate(input_id: str, output_id: str, *, names=("prompt", "response"), configs=(GREEDY,), error: str | None = None,
             target: str = "") -> eg.Action:
    outputs = [eg.NamedParameter(name=names[1], id=output_id)]
    if error is not None:
        outputs.append(eg.NamedParameter(name="error", id=error))
    return eg.Action(
        name="GENERATE" if error is None else "TRY_GENERATE",
        inputs=[eg.NamedParameter(name=names[0], id=input_id)],
        outputs=outputs,
        configs=list(configs),
        target_spec=eg.TargetSpec(id=target),
    )


def action(name: str, input_name: str, input_id: str, *configs: any_pb2.Any) -> eg.Action:
    return eg.Action(name=name, inputs=[eg.NamedParameter(name=input_name, id=input_id)], configs=list(configs))


def text(node_id: str, data: str, *, seq: int = 0, continued: bool = False, role: str = "", meta: bool | None = None,
         mimetype: str = "text/plain") -> eg.NodeFragment:
    chunk = eg.Chunk(data=data.encode())
    if meta if meta is not None else seq == 0:
        chunk.metadata.CopyFrom(eg.ChunkMetadata(mimetype=mimetype, role=role))
    return eg.NodeFragment(id=node_id, seq=seq, continued=continued, chunk_fragment=chunk)


def ref(node_id: str, uri: str, *, seq: int = 0, continued: bool = False, mimetype: str | None = "text/plain") -> eg.NodeFragment:
    chunk = eg.Chunk(ref=uri)
    if mimetype is not None:
        chunk.metadata.CopyFrom(eg.ChunkMetadata(mimetype=mimetype))
    return eg.NodeFragment(id=node_id, seq=seq, continued=continued, chunk_fragment=chunk)


def eot(node_id: str) -> eg.NodeFragment:
    return eg.NodeFragment(id=node_id, chunk_fragment=eg.Chunk(metadata=eg.ChunkMetadata(mimetype=END_OF_TURN)))


def parent(node_id: str, *children: str, seq: int = 0, continued: bool = False) -> eg.NodeFragment:
    return eg.NodeFragment(id=node_id, seq=seq, continued=continued, child_ids=list(children))


def msg(*items: eg.NodeFragment | eg.Action) -> eg.SessionMessage:
    return eg.SessionMessage(
        node_fragments=[i for i in items if isinstance(i, eg.NodeFragment)],
        actions=[i for i in items if isinstance(i, eg.Action)],
    )


# -- running sessions -------------------------------------------------------------------------


@dataclass
class Result:
    session_id: str
    messages: list[eg.SessionMessage]
    code: grpc.StatusCode
    details: str
    nodes: dict[str, list[eg.NodeFragment]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for m in self.messages:
            for f in m.node_fragments:
                self.nodes.setdefault(f.id, []).append(f)

    def text(self, node_id: str) -> str:
        """An output node's text, after checking its framing: seq 0.., metadata on seq 0 only,
        ``continued`` on every fragment but the last."""
        frags = self.nodes[node_id]
        assert [f.seq for f in frags] == list(range(len(frags)))
        assert [f.continued for f in frags] == [True] * (len(frags) - 1) + [False]
        assert frags[0].chunk_fragment.metadata.mimetype in ("text/plain", "application/json")
        assert not any(f.chunk_fragment.HasField("metadata") for f in frags[1:])
        return b"".join(f.chunk_fragment.data for f in frags).decode()


def channel(stack) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(f"127.0.0.1:{stack.settings.grpc_port}")


async def paced(messages: Iterable[eg.SessionMessage | float]) -> AsyncIterator[eg.SessionMessage]:
    """Messages in order; a number is a pause of that many seconds."""
    for m in messages:
        if isinstance(m, (int, float)):
            await asyncio.sleep(m)
        else:
            yield m


async def run_session(stack, *messages: eg.SessionMessage | float) -> Result:
    async with channel(stack) as ch:
        call = eg_grpc.EvergreenServiceStub(ch).StartSession(paced(messages), timeout=RPC_TIMEOUT_S)
        received = []
        try:
            async for m in call:
                received.append(m)
        except grpc.aio.AioRpcError:
            pass
        metadata = dict(await call.initial_metadata())
        return Result(metadata.get(SESSION_ID_HEADER, ""), received, await call.code(), await call.details() or "")


async def stored_fragments(stack, session_id: str) -> list[wire.EvergreenFragment]:
    import zmq.asyncio

    dealer = Dealer(zmq.asyncio.Context.instance(), stack.settings.endpoint("session_store"))
    try:
        reply, _ = await dealer.request(wire.EvergreenGetNodes(session_id=session_id))
    finally:
        dealer.close()
    assert isinstance(reply, wire.EvergreenNodes), reply
    return reply.fragments


def expected_greedy(stack, hf_greedy, turns: list[dict[str, str]], max_tokens: int = MAX_TOKENS) -> str:
    """What greedy decoding gives for these chat turns, rendered as the gateway renders ``messages``."""
    rendered = stack.tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
    ids = stack.tokenizer(rendered, add_special_tokens=False).input_ids
    return stack.tokenizer.decode(hf_greedy(ids, max_tokens), skip_special_tokens=True)


@pytest.fixture(scope="module")
def video_parts(stack):
    """The first example's ``file://path/to/file/part{1,2}`` under the allow-listed root: a transcript
    standing in for the video."""
    root = stack.settings.evergreen_ref_root / "path/to/file"
    root.mkdir(parents=True, exist_ok=True)
    for i, part in enumerate(TRANSCRIPT, 1):
        (root / f"part{i}").write_text(part)
    return root


def long_video_question(mimetype: str = "text/plain") -> list[eg.SessionMessage]:
    return [
        msg(generate("prompt_1", "response_1")),
        msg(parent("prompt_1", "question_1", "video_1")),
        msg(text("question_1", QUESTION_1)),
        msg(ref("video_1", "file://path/to/file/part1", continued=True, mimetype=mimetype)),
        # the spec's note: "Metadata in the second chunk can be omitted" — and our rule requires it
        msg(ref("video_1", "file://path/to/file/part2", seq=1, mimetype=None)),
    ]


# -- the spec's examples ----------------------------------------------------------------------


async def test_long_video_question_then_follow_up(stack, hf_greedy, video_parts):
    """Example 1, with the follow-up that reuses prompt_1 and response_1 without re-sending them."""
    follow_up = [
        msg(generate("prompt_2", "response_2")),
        msg(parent("prompt_2", "prompt_1", "response_1", "question_2")),
        msg(text("question_2", "Who's winning?")),
    ]
    result = await run_session(stack, *long_video_question(), *follow_up)
    assert result.code == grpc.StatusCode.OK, result.details
    turn_1 = {"role": "user", "content": QUESTION_1 + "".join(TRANSCRIPT)}
    response_1 = result.text("response_1")
    assert response_1 == expected_greedy(stack, hf_greedy, [turn_1])
    assert result.nodes["response_1"][0].chunk_fragment.metadata.role == "assistant"
    turns_2 = [turn_1, {"role": "assistant", "content": response_1}, {"role": "user", "content": "Who's winning?"}]
    assert result.text("response_2") == expected_greedy(stack, hf_greedy, turns_2)
    assert len(result.nodes["response_1"]) > 2  # streamed, not one piece
    assert await stored_fragments(stack, result.session_id) == []  # the session's nodes are gone


async def test_long_video_question_with_a_real_video_is_refused(stack, video_parts):
    result = await run_session(stack, *long_video_question("video/mp4"))
    assert result.code == grpc.StatusCode.INVALID_ARGUMENT
    assert result.details == (
        "node 'video_1': mimetype 'video/mp4' cannot be given to SmolLM2-135M-Instruct, which takes text only "
        "(text/* chunks and 'application/x-protobuf; type=EndOfTurn' markers)"
    )
    assert "response_1" not in result.nodes


async def test_customized_generate_with_end_of_turn(stack, hf_greedy):
    result = await run_session(
        stack,
        msg(
            generate("prompt_1", "response_1", names=("text", "text")),
            parent("prompt_1", "prompt_1_text", "prompt_1_eot"),
            text("prompt_1_text", NOVEL),
            eot("prompt_1_eot"),
        ),
    )
    assert result.code == grpc.StatusCode.OK, result.details
    assert result.text("response_1") == expected_greedy(stack, hf_greedy, [{"role": "user", "content": NOVEL}])


async def test_streamed_chain(stack, hf_greedy):
    result = await run_session(
        stack,
        msg(generate("prompt_1", "response_1", names=("text", "text"))),
        msg(parent("prompt_1", "prompt_1_text", continued=True)),
        msg(text("prompt_1_text", NOVEL)),
        0.2,
        msg(parent("prompt_1", "prompt_1_eot", seq=1)),
        msg(eot("prompt_1_eot")),
    )
    assert result.code == grpc.StatusCode.OK, result.details
    assert result.text("response_1") == expected_greedy(stack, hf_greedy, [{"role": "user", "content": NOVEL}])


# -- ordering, reuse, concurrency -------------------------------------------------------------


async def test_out_of_order_arrival(stack, hf_greedy):
    """Leaves before their parents, a leaf's seq 1 before its seq 0, duplicates, the action last."""
    result = await run_session(
        stack,
        msg(text("t", "brave.", seq=1)),
        msg(text("t", "Tell a story about a knight who is ", continued=True)),
        msg(text("t", "ignored duplicate", continued=True)),
        msg(text("sys", "You are a poet.", role="system")),
        msg(parent("root", "sys", "t")),
        msg(generate("root", "out")),
    )
    assert result.code == grpc.StatusCode.OK, result.details
    turns = [{"role": "system", "content": "You are a poet."},
             {"role": "user", "content": "Tell a story about a knight who is brave."}]
    assert result.text("out") == expected_greedy(stack, hf_greedy, turns)


async def test_multi_turn_chain_and_concurrent_actions(stack, hf_greedy):
    """A second action declared at once waits for response_1; two independent actions run together."""
    result = await run_session(
        stack,
        msg(
            generate("p1", "response_1"),
            generate("p2", "response_2"),
            generate("other", "response_3"),
            parent("p2", "p1", "response_1", "q2"),
            parent("p1", "q1"),
            text("q1", "Name a colour."),
            text("q2", "And another one?"),
            text("other", "What is 2 + 2?"),
        ),
    )
    assert result.code == grpc.StatusCode.OK, result.details
    r1 = result.text("response_1")
    assert r1 == expected_greedy(stack, hf_greedy, [{"role": "user", "content": "Name a colour."}])
    assert result.text("response_3") == expected_greedy(stack, hf_greedy, [{"role": "user", "content": "What is 2 + 2?"}])
    turns = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": r1},
             {"role": "user", "content": "And another one?"}]
    assert result.text("response_2") == expected_greedy(stack, hf_greedy, turns)
    order = [f.id for m in result.messages for f in m.node_fragments]
    assert order.index("response_2") > max(i for i, n in enumerate(order) if n == "response_1")
    # response_1 and response_3 interleave: they ran concurrently
    first_3, last_1 = order.index("response_3"), max(i for i, n in enumerate(order) if n == "response_1")
    assert first_3 < last_1


async def test_the_store_mirrors_the_live_graph(stack):
    async with channel(stack) as ch:
        queue: asyncio.Queue[eg.SessionMessage | None] = asyncio.Queue()

        async def requests() -> AsyncIterator[eg.SessionMessage]:
            while (m := await queue.get()) is not None:
                yield m

        call = eg_grpc.EvergreenServiceStub(ch).StartSession(requests(), timeout=RPC_TIMEOUT_S)
        session_id = dict(await call.initial_metadata())[SESSION_ID_HEADER]
        await queue.put(msg(generate("p", "r", configs=[config(max_tokens=3, temperature=0)]), text("p", "Hi")))
        frags = [m async for m in _until_final(call, "r")]
        await asyncio.sleep(0.5)  # the mirror is fire-and-forget
        stored = await stored_fragments(stack, session_id)
        assert [(f.node_id, f.seq) for f in stored] == [("p", 0)] + [("r", i) for i in range(len(frags))]
        assert eg.NodeFragment.FromString(stored[0].fragment) == text("p", "Hi")
        await queue.put(None)
        assert [m async for m in call] == [] and await call.code() == grpc.StatusCode.OK
    await asyncio.sleep(0.5)
    assert await stored_fragments(stack, session_id) == []


async def _until_final(call, node_id: str) -> AsyncIterator[eg.NodeFragment]:
    async for m in call:
        for f in m.node_fragments:
            if f.id == node_id:
                yield f
                if not f.continued:
                    return


# -- abort rules ------------------------------------------------------------------------------

INVALID = grpc.StatusCode.INVALID_ARGUMENT
TEXT = eg.ChunkMetadata(mimetype="text/plain")


def nested(depth: int) -> list[eg.NodeFragment]:
    return [parent(f"n{i}", f"n{i + 1}") for i in range(depth)] + [text(f"n{depth}", "deep")]


ABORTS = {
    "seq after final": (
        [msg(text("a", "x")), msg(text("a", "y", seq=1))],
        INVALID, "node 'a': fragment seq 1 follows its final fragment (seq 0)",
    ),
    "metadata after seq 0 (the first example verbatim)": (
        [msg(ref("video_1", "file://path/to/file/part1", continued=True)),
         msg(ref("video_1", "file://path/to/file/part2", seq=1, mimetype="video/mp4"))],
        INVALID, "node 'video_1': seq 1 carries metadata; only the fragment with seq 0 may",
    ),
    "cycle": (
        [msg(parent("a", "b")), msg(parent("b", "c")), msg(parent("c", "a"))],
        INVALID, "cycle in the node graph: c → a → b → c",
    ),
    "nesting limit": (
        [msg(*nested(65))], INVALID, "node 'n64' → 'n65': the node graph would nest 65 levels deep; the limit is 64",
    ),
    "output id reused (a received node)": (
        [msg(text("p", "hi"), generate("p", "p"))], INVALID,
        "output node 'p' is not new: node ids of outputs must not be reused",
    ),
    "output id reused (another action's output)": (
        [msg(generate("p", "r"), generate("q", "r"))], INVALID,
        "output node 'r' is not new: node ids of outputs must not be reused",
    ),
    "client writes an output node": (
        [msg(generate("p", "r")), msg(text("r", "forged"))], INVALID,
        "node 'r' is an action's output: only the server writes it",
    ),
    "drop of an output being written": (
        [msg(text("p", "Hi"), generate("p", "r"), action("DROP", "node", "r"))], grpc.StatusCode.FAILED_PRECONDITION,
        "DROP: node 'r' is still being written",
    ),
    "unknown action": (
        [msg(eg.Action(name="TRANSLATE"))], INVALID,
        "unknown action 'TRANSLATE'; this server provides GENERATE, TRY_GENERATE, DROP, SET_TTL, CANCEL",
    ),
    "unknown input name": (
        [msg(generate("p", "r", names=("image", "response")))], INVALID,
        "GENERATE: unknown input 'image' (takes 'prompt' or 'text')",
    ),
    "unknown output name": (
        [msg(generate("p", "r", names=("prompt", "video")))], INVALID,
        "GENERATE: unknown output 'video' (takes 'response' or 'text')",
    ),
    "unknown target": (
        [msg(generate("p", "r", target="gpt-9"))], grpc.StatusCode.NOT_FOUND,
        "GENERATE: target 'gpt-9' not found; this server serves 'SmolLM2-135M-Instruct'",
    ),
    "ref scheme": (
        [msg(ref("v", "https://example.com/video.mp4"))], INVALID,
        "ref 'https://example.com/video.mp4': only file:// refs are supported (scheme 'https')",
    ),
    "ref escape": (
        [msg(ref("v", "file://path/../../../etc/passwd"))], INVALID,
        "ref 'file://path/../../../etc/passwd': '..' is not allowed in a ref",
    ),
    "ref outside the root": (
        [msg(ref("v", "file:///etc/passwd"))], INVALID, re.compile(r"ref 'file:///etc/passwd': outside the allowed directory '.*evergreen_files'"),
    ),
    "missing ref file": (
        [msg(generate("v", "r"), ref("v", "file://nothing/here"))], INVALID,
        "ref 'file://nothing/here': cannot be read (No such file or directory)",
    ),
    "image input": (
        [msg(generate("p", "r"), parent("p", "q", "img"), text("q", "Describe:"),
             eg.NodeFragment(id="img", chunk_fragment=eg.Chunk(metadata=eg.ChunkMetadata(mimetype="image/webp"), data=b"RIFF")))],
        INVALID, re.compile(r"node 'img': mimetype 'image/webp' cannot be given to SmolLM2-135M-Instruct"),
    ),
    # failures found while the action starts, with the client's side already closed: the failure
    # must still end the session, never the session's normal end overtaking it
    "input text not UTF-8": (
        [msg(generate("p", "r"), eg.NodeFragment(id="p", chunk_fragment=eg.Chunk(metadata=TEXT, data=b"\xff\xfe")))],
        INVALID, "node 'p': text is not valid UTF-8 (invalid start byte at byte 0)",
    ),
    "input without text": ([msg(generate("p", "r"), eot("p"))], INVALID,
                           "the GENERATE input holds no text: no text/* chunk, only end-of-turn markers or none"),
    "leaf without metadata": (
        [msg(generate("p", "r"), parent("p", "q"), parent("q", continued=True), text("q", "lost?", seq=1))],
        INVALID, "node 'q': seq 0 of a leaf must carry metadata with a mimetype",
    ),
    "input never completes": (
        [msg(generate("p", "r"), parent("p", "q", "later"), text("q", "Hi"))], INVALID,
        "GENERATE('p' → 'r'): the client closed its stream before the action's input 'p' was complete",
    ),
    "input contains its own output": (
        [msg(generate("p", "r"), parent("p", "q", "r"), text("q", "Hi"))], INVALID,
        "GENERATE('p' → 'r'): the input contains the action's own output 'r'",
    ),
    "inputs waiting for each other's outputs": (  # found while the client's side is open, not at its close
        [msg(generate("pa", "r1"), generate("pb", "r2"), parent("pa", "q", "r2"), parent("pb", "q", "r1"),
             text("q", "Hi")), 1.0],
        INVALID, "the inputs of GENERATE('pa' → 'r1') and GENERATE('pb' → 'r2') wait for each other's outputs",
    ),
    "bad config": (
        [msg(generate("p", "r", configs=[config(temperature=-1)]))], INVALID,
        "GENERATE: configs.temperature: Input should be greater than or equal to 0 (got -1)",
    ),
    "controller": (
        [msg(generate("p", "r", configs=[config(controller="regex", controller_arg="[0-9]+")]))],
        grpc.StatusCode.UNIMPLEMENTED, re.compile(r"controllers are not supported on the Evergreen surface yet"),
    ),
    "context length": (
        [msg(generate("p", "r", configs=[config(max_tokens=4000)]), text("p", "Hi"))],
        grpc.StatusCode.OUT_OF_RANGE, re.compile(r"GENERATE\('p' → 'r'\): the prompt \(\d+ tokens\) plus max_tokens \(4000\)"),
    ),
}


@pytest.mark.parametrize("case", ABORTS, ids=list(ABORTS))
async def test_abort_rules(stack, video_parts, case):
    messages, code, details = ABORTS[case]
    result = await run_session(stack, *messages)
    assert result.code == code, result.details
    if isinstance(details, re.Pattern):
        assert details.search(result.details), result.details
    else:
        assert result.details == details
    await asyncio.sleep(0.3)
    assert await stored_fragments(stack, result.session_id) == []  # the session's nodes are dropped


async def test_a_client_still_sending_after_its_bad_message_learns_the_reason(stack):
    """The status waits for a client that goes on sending to close its side (evergreen.abort_grace_s):
    grpc's asyncio client turns a write landing after the status into INTERNAL "Internal error from
    Core" (grpc/grpc#36066). Here every message after the bad first one would race the status."""
    bad = [msg(text("p", "a", continued=True)), msg(text("p", "b", seq=1, meta=True))]  # metadata past seq 0
    after = [msg(text(f"t{i}", "more")) for i in range(40)]
    for _ in range(5):
        result = await run_session(stack, *bad, *after)
        assert result.code == INVALID, result.details
        assert "metadata" in result.details, result.details


async def test_duplicates_and_default_fields_do_not_abort(stack):
    result = await run_session(
        stack,
        msg(eg.Action(name="GENERATE", inputs=[eg.NamedParameter(name="prompt", id="p")],
                      outputs=[eg.NamedParameter(name="response", id="r")], configs=[config(max_tokens=2)])),
        msg(eg.NodeFragment(id="p", chunk_fragment=eg.Chunk(metadata=eg.ChunkMetadata(mimetype="text/plain"), data=b"Hi"))),
        msg(text("p", "retry with other content")),
    )
    assert result.code == grpc.StatusCode.OK, result.details
    assert result.nodes["r"][-1].continued is False


# -- extensions: DROP, SET_TTL, CANCEL, per-action failures -----------------------------------


async def test_drop_makes_an_input_wait_again(stack, hf_greedy):
    result = await run_session(
        stack,
        msg(text("q", "A question that is dropped.")),
        msg(action("DROP", "node", "q")),
        msg(generate("q", "r")),
        0.3,
        msg(text("q", "What is the capital of France?")),  # a dropped id may be sent again
    )
    assert result.code == grpc.StatusCode.OK, result.details
    assert result.text("r") == expected_greedy(stack, hf_greedy, [{"role": "user", "content": "What is the capital of France?"}])


async def test_set_ttl_expires_a_subtree(stack):
    result = await run_session(
        stack,
        msg(parent("p", "q"), text("q", "Hi"), action("SET_TTL", "node", "p", config(ttl_s=0.2))),
        0.6,
        msg(generate("p", "r")),  # p and q have expired: the input never completes
    )
    assert result.code == INVALID
    assert result.details == "GENERATE('p' → 'r'): the client closed its stream before the action's input 'p' was complete"


async def test_set_ttl_needs_a_positive_ttl(stack):
    result = await run_session(stack, msg(action("SET_TTL", "node", "p", config(ttl_s=0))))
    assert result.code == INVALID and result.details == "SET_TTL: configs.ttl_s: Input should be greater than 0 (got 0)"


async def test_cancel_ends_the_output_early(stack):
    long = config(max_tokens=400, temperature=0, ignore_eos=True)
    async with channel(stack) as ch:
        queue: asyncio.Queue[eg.SessionMessage | None] = asyncio.Queue()

        async def requests() -> AsyncIterator[eg.SessionMessage]:
            while (m := await queue.get()) is not None:
                yield m

        call = eg_grpc.EvergreenServiceStub(ch).StartSession(requests(), timeout=RPC_TIMEOUT_S)
        await queue.put(msg(generate("p", "r", configs=[long]), text("p", "Count to a thousand.")))
        frags = []
        async for m in call:
            frags += m.node_fragments
            if len(frags) == 3:
                await queue.put(msg(action("CANCEL", "output", "r")))
                await queue.put(None)
            if frags[-1].continued is False:
                break
        assert [m async for m in call] == [] and await call.code() == grpc.StatusCode.OK
    assert frags[-1].id == "r" and len(frags) < 400


async def test_cancel_of_a_pending_action_and_of_an_unknown_output(stack):
    result = await run_session(stack, msg(generate("p", "r"), action("CANCEL", "output", "r")))
    assert result.code == grpc.StatusCode.OK, result.details
    assert result.text("r") == ""
    result = await run_session(stack, msg(action("CANCEL", "output", "nothing")))
    assert result.code == INVALID and result.details == "CANCEL: node 'nothing' is not the output of a GENERATE action"


async def test_per_action_failures_are_reported_when_asked_for(stack, hf_greedy):
    unreported = generate("p", "r5", configs=[config(max_tokens=4000)])
    unreported.name = "TRY_GENERATE"  # without an error output: its failure only ends its output
    result = await run_session(
        stack,
        msg(generate("p", "r1", configs=[config(max_tokens=4000)], error="e1"), text("p", "Hi")),
        msg(generate("img", "r2", error="e2"),
            eg.NodeFragment(id="img", chunk_fragment=eg.Chunk(metadata=eg.ChunkMetadata(mimetype="image/png")))),
        msg(generate("p", "r3", error="e3")),
        msg(generate("never", "r4", error="e4"), unreported),  # "never" is never sent
    )
    assert result.code == grpc.StatusCode.OK, result.details
    e1 = json.loads(result.text("e1"))
    assert e1["status"] == "OUT_OF_RANGE" and "plus max_tokens (4000)" in e1["message"]
    assert json.loads(result.text("e2"))["message"].startswith("node 'img': mimetype 'image/png' cannot be given")
    assert json.loads(result.text("e4")) == {
        "status": "INVALID_ARGUMENT",
        "message": "TRY_GENERATE('never' → 'r4'): the client closed its stream before the action's input 'never' "
                   "was complete",
    }
    assert result.text("r1") == result.text("r2") == result.text("r4") == result.text("r5") == ""
    assert result.text("r3") == expected_greedy(stack, hf_greedy, [{"role": "user", "content": "Hi"}])
    assert "e3" not in result.nodes


async def test_plain_generate_has_no_error_output(stack):
    plain = generate("p", "r", error="e")
    plain.name = "GENERATE"
    result = await run_session(stack, msg(plain, text("p", "Hi")))
    assert result.code == INVALID and "'error'" in result.details


# -- robustness -------------------------------------------------------------------------------


async def test_bad_input_never_hurts_other_sessions_or_http(stack, hf_greedy):
    async def garbage() -> tuple[grpc.StatusCode, str]:
        async with channel(stack) as ch:
            call = ch.stream_stream("/evergreen.v2.EvergreenService/StartSession")(
                paced([b"\xff\xff\xff"]), timeout=RPC_TIMEOUT_S
            )
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in call:
                    pass
            return err.value.code(), err.value.details()

    good = run_session(stack, msg(generate("p", "r"), text("p", "Hi")))
    bad = [run_session(stack, *ABORTS[case][0]) for case in ("cycle", "nesting limit", "unknown action")]
    results = await asyncio.gather(good, garbage(), *bad)
    assert results[0].code == grpc.StatusCode.OK
    assert results[0].text("r") == expected_greedy(stack, hf_greedy, [{"role": "user", "content": "Hi"}])
    assert results[1] == (INVALID, ("the request is not a valid evergreen.v2.SessionMessage message: Error parsing "
                                   "message with type 'evergreen.v2.SessionMessage': Wire format was corrupt"))
    assert all(r.code == INVALID for r in results[2:])
    async with httpx.AsyncClient(base_url=stack.http_url) as client:
        assert (await client.get("/health")).status_code == 200
        body = {"prompt": "Hi", "max_tokens": 2, "temperature": 0}
        assert (await client.post("/v1/generate", json=body, timeout=60)).status_code == 200


async def test_client_gone_mid_generation_frees_the_sequence(stack):
    long = config(max_tokens=400, temperature=0, ignore_eos=True)
    async with channel(stack) as ch:
        call = eg_grpc.EvergreenServiceStub(ch).StartSession(
            paced([msg(generate("p", "r", configs=[long]), text("p", "Hi")), 60.0]), timeout=RPC_TIMEOUT_S
        )
        session_id = dict(await call.initial_metadata())[SESSION_ID_HEADER]
        async for _ in call:
            break
        call.cancel()
    deadline = time.monotonic() + 10
    while True:
        health = await asyncio.to_thread(stack.scheduler_health)
        if health["running"] == 0 and health["queued"] == 0:
            break
        assert time.monotonic() < deadline, "the scheduler still runs the abandoned sequence"
        await asyncio.sleep(0.1)
    await asyncio.sleep(0.3)
    assert await stored_fragments(stack, session_id) == []
