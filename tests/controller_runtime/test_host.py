"""The Wasm host against tiny WAT controllers: callbacks, faults confined to one sequence, forks,
storage, constraint masks, the token trie blob."""

from __future__ import annotations

import json
import struct
import time

import llguidance
import pytest

from common import aici_wire
from services.controller_runtime.constraints import Constraint
from services.controller_runtime.host import HostError, RequestState, SeqHost, VariableStore
from services.controller_runtime.wasm import ControllerError, Ticker, WasmController
from tests.controller_runtime.conftest import LIMITS, allowed, mid, row, start
from tests.controller_runtime.wat import MID_SAMPLE, controller, ret_const, str_data

OK_MID = f"(call $ret_bias (i32.const 4096)) {ret_const(1300, MID_SAMPLE)}"


def test_callbacks_and_all_ones_mask(runtime, tokenizer):
    pre = start(runtime, controller(), 1)
    assert pre == {"error": "", "result": {"suspend": False, "num_forks": 1, "ff_tokens": []}, "storage": [],
                   "logs": "", "micros": pre["micros"]}
    data, rows = mid(runtime, (1, None))
    assert data["num_seqs"] == 1 and data["seqs"]["1"]["result"] is None and data["seqs"]["1"]["error"] == ""
    assert allowed(row(rows, 0, tokenizer)) >= set(range(tokenizer.vocab_size))
    post = runtime.post_pre_process(aici_wire.PostPreProcess(post_ops=[aici_wire.PostOp(id=1, tokens=[42])]))
    assert post["post_seqs"]["1"]["result"] == {"stop": False}


@pytest.mark.parametrize("body, expected", [
    ("unreachable", "unreachable"),
    ("(loop $l (br $l))", "deadline of 100 ms exceeded"),
    ("(loop $l (br_if $l (i32.ne (memory.grow (i32.const 16)) (i32.const -1)))) unreachable",
     f"memory {50 * 65536} of {4 << 20} bytes"),  # 2 + 3*16 pages: the 4th grow was refused
    ("(call $ret (i32.const -16) (i32.const 64))", "outside its memory"),
    ("(call $ret_bias (i32.const 131000))", "outside its memory"),
    ("(drop (call $read_blob (i32.const 4) (i32.const 131070) (i32.const 100)))", "outside its memory"),
    ("(drop (call $read_blob (i32.const 77) (i32.const 0) (i32.const 0)))", "unknown blob id 77"),
    # text past max_tokenize_bytes (4096 here) would hold the runtime's thread, and every controlled step, meanwhile
    ("(drop (call $tokenize (i32.const 0) (i32.const 8192)))", "8192 bytes to tokenize in one call, past the 4096"),
    # 2**30 tokens are 2**32 bytes: the length wrapped to 0 (2**30 + 1 tokens to one), and the commit went on
    ("(drop (call $c_commit (i32.const 99) (i32.const 0) (i32.const 1073741824)))",
     "tiller_constraint_commit: guest pointer 0+4294967296 is outside its memory"),
    ("(call $stop)", "aici_host_stop"),
    ("(drop (call $c_bias (i32.const 99)))", "unknown constraint handle 99"),
    ("(drop (call $c_ff (i32.const 98) (i32.const 0) (i32.const 4)))", "unknown constraint handle 98"),
    ("(call $ret (i32.const 1100) (i32.const 10))", "invalid result"),
    (ret_const(1300, MID_SAMPLE), "without returning a logit bias"),
    ("", "aici_host_return_process_result not called"),
])
def test_faults_end_only_their_sequence(runtime, tokenizer, body, expected):
    start(runtime, controller(), 1)
    start(runtime, controller(mid=body), 2)
    start(runtime, controller(), 3)
    data, rows = mid(runtime, (1, None), (2, None), (3, None))
    bad = data["seqs"]["2"]
    assert bad["result"] is None and expected in bad["error"], bad["error"]
    for good, index in (("1", 0), ("3", 2)):
        assert data["seqs"][good]["error"] == "" and data["seqs"][good]["result"] is None
        assert len(allowed(row(rows, index, tokenizer))) >= tokenizer.vocab_size
    assert not any(row(rows, 1, tokenizer))
    # the failed sequence keeps reporting its error; the others go on
    again = runtime.post_pre_process(aici_wire.PostPreProcess(post_ops=[aici_wire.PostOp(id=i, tokens=[5]) for i in (1, 2, 3)]))
    assert "already failed" in again["post_seqs"]["2"]["error"]
    assert again["post_seqs"]["1"]["result"] == {"stop": False} and again["pre_seqs"]["3"]["error"] == ""
    runtime.free([2])
    assert "2" not in runtime.post_pre_process(aici_wire.PostPreProcess())["pre_seqs"]


def test_pre_and_post_have_their_own_deadlines(runtime):
    spin = "(loop $l (br $l))"
    start(runtime, controller(), 1)
    start(runtime, controller(post=spin), 2)
    pre = start(runtime, controller(pre=spin), 3)
    assert f"aici_pre_process: deadline of {LIMITS.pre_deadline_ms:g} ms exceeded" in pre["error"]
    started = time.perf_counter()
    out = runtime.post_pre_process(aici_wire.PostPreProcess(post_ops=[aici_wire.PostOp(id=i, tokens=[5]) for i in (1, 2)]))
    assert time.perf_counter() - started < 1.0  # the spinning post_process was cut off, not waited for
    assert f"aici_post_process: deadline of {LIMITS.post_deadline_ms:g} ms exceeded" in out["post_seqs"]["2"]["error"]
    assert out["post_seqs"]["1"]["result"] == {"stop": False} and out["pre_seqs"]["1"]["error"] == ""


def ticker_sleeps(ticker: Ticker) -> bool:
    """Whether the epoch ticker falls asleep (waiting up to 5 s for it)."""
    for _ in range(500):
        if not ticker.awake:
            return True
        time.sleep(0.01)
    return False


def test_long_call_keeps_the_ticker_awake(runtime):
    """An infinite loop in init (1000 ms deadline), the one guest call left in its span, still times out."""
    module_id = runtime.registry.create(controller(init_prompt="(loop $l (br $l))"), "t")["module_id"]
    ok, result = runtime.instantiate("spin", [1], module_id, "")
    assert not ok and f"deadline of {LIMITS.init_deadline_ms:g} ms exceeded" in result["error"]


def test_a_call_wakes_the_sleeping_ticker(runtime, engine):
    """Right after the ticker fell asleep, a looping call still meets its deadline: within a main-channel op,
    and outside any span (the call itself wakes the ticker and keeps it ticking)."""
    spin = "(loop $l (br $l))"
    start(runtime, controller(post=spin), 1)
    start(runtime, controller(post=spin), 2)
    assert ticker_sleeps(engine.ticker)
    out = runtime.post_pre_process(aici_wire.PostPreProcess(post_ops=[aici_wire.PostOp(id=1, tokens=[5])]))
    assert f"aici_post_process: deadline of {LIMITS.post_deadline_ms:g} ms exceeded" in out["post_seqs"]["1"]["error"]
    assert ticker_sleeps(engine.ticker)
    with pytest.raises(ControllerError, match="deadline of 50 ms exceeded"):
        runtime.seqs[2].ctrl.invoke("aici_post_process", b'{"tokens":[5],"backtrack":0}', 50.0)


def test_the_ticker_ticks_through_a_span_and_sleeps_after_it(runtime, engine):
    """A span wakes nothing by itself; its first guest call wakes the ticker, which stays awake between its
    calls (however long) and falls asleep once the span is closed."""
    start(runtime, controller(), 1)
    ticker = engine.ticker
    assert ticker_sleeps(ticker)
    post = aici_wire.PostPreProcess(post_ops=[aici_wire.PostOp(id=1, tokens=[5])])
    with ticker:
        assert not ticker.awake
        assert runtime.post_pre_process(post)["post_seqs"]["1"]["error"] == ""
        assert ticker.awake
        time.sleep(20 * LIMITS.epoch_tick_ms / 1000)  # ticks with no call running: the open span keeps it awake
        assert ticker.awake
    assert ticker.spans == 0 and ticker_sleeps(ticker)


def test_trap_in_init_is_an_instantiate_error(runtime):
    module_id = runtime.registry.create(controller(init_prompt="unreachable"), "t")["module_id"]
    ok, result = runtime.instantiate("bad", [1], module_id, "")
    assert not ok and "aici_init_prompt: trap" in result["error"] and "bad" not in runtime.pending


@pytest.mark.parametrize("extra, expected", [
    ("(func $trap unreachable) (start $trap)", "instantiation failed: "),
    ("(func $spin (loop $l (br $l))) (start $spin)",
     f"instantiation failed: its start function ran past the deadline of {LIMITS.init_deadline_ms:g} ms"),
    ("(table 1000000 funcref)", "instantiation failed: "),  # past the store's table limit
])
def test_a_module_that_fails_to_instantiate_is_a_failed_start_not_a_refusal(runtime, extra, expected):
    """As AICI: the request's controller failed to start (its result says why), as a trap in its init would."""
    module_id = runtime.registry.create(controller(extra=extra), "t")["module_id"]
    ok, result = runtime.instantiate("bad", [1], module_id, "")
    assert not ok and result["error"].startswith(expected) and "bad" not in runtime.pending
    assert runtime.instantiate("good", [1], runtime.registry.create(controller(), "t")["module_id"], "")[0]


@pytest.mark.parametrize("pages, expected", [
    ("2 2 shared", "the module's memory is shared"),
    (65, f"the module's memory starts at {65 * 65536} bytes, past a controller's limit of {4 << 20} bytes"),
])
def test_a_memory_no_controller_could_have_is_refused_at_upload(runtime, pages, expected):
    with pytest.raises(Exception, match=expected):
        runtime.registry.create(controller(pages=pages), "t")
    runtime.registry.create(controller(pages=64), "t")  # exactly the limit


def test_unbound_instances_expire(runtime, tokenizer):
    module_id = runtime.registry.create(controller(), "t")["module_id"]
    assert runtime.instantiate("old", [1], module_id, "")[0]
    runtime.pending["old"] = (runtime.pending["old"][0] - LIMITS.pending_ttl_s - 1, runtime.pending["old"][1])
    assert runtime.instantiate("new", [1], module_id, "")[0]
    assert set(runtime.pending) == {"new"}
    start(runtime, module_id, 1)
    old = runtime.seqs[1]
    start(runtime, module_id, 1)  # a restarted scheduler reuses id 1: the stale instance is dropped
    assert runtime.seqs[1] is not old and old.host.request.live_seqs == 0


def test_logs_capture_stdout_bounded(runtime, engine, tokenizer):
    # iovec at 16384 -> "hello\n" at 16400; fd 1
    data = str_data(16400, "hello\n") + '(data (i32.const 16384) "\\10\\40\\00\\00\\06\\00\\00\\00")'
    body = "(drop (call $fd_write (i32.const 1) (i32.const 16384) (i32.const 1) (i32.const 16500)))"
    start(runtime, controller(data=data, pre=body + ret_const(1100, '{"num_forks":1,"suspend":false,"ff_tokens":[]}')), 1)
    pre = runtime.post_pre_process(aici_wire.PostPreProcess())["pre_seqs"]["1"]
    assert pre["logs"] == "hello\n"
    # output of the constructor (aici_create) and of init_prompt both reach instantiate's logs
    create = body + "(i32.const 7)"
    module_id = runtime.registry.create(controller(data=data, create=create, init_prompt=body + ret_const(1024, "{}")),
                                        "t")["module_id"]
    ok, result = runtime.instantiate("logs", [1], module_id, "")
    assert ok and result["logs"] == "hello\nhello\n"
    host = SeqHost(tokenizer, RequestState("x", b""), {}, 1024)
    for _ in range(100):
        host.log(b"0123456789")
    assert len(host.logs) <= 1024 and host.logs.endswith(b"0123456789")


STORAGE_CMD = '{"WriteVar":{"name":"v","value":"61","op":"Append","when_version_is":null}}'
COUNTER_MID = (
    "(i32.store (i32.const 30000) (i32.add (i32.load (i32.const 30000)) (i32.const 1)))"
    "(global.set $counter (i32.add (global.get $counter) (i32.const 1)))"
    f"(drop (call $storage (i32.const 2048) (i32.const {len(STORAGE_CMD)})))" + OK_MID
)


def test_fork_shares_variables_but_not_memory(runtime):
    start(runtime, controller(mid=COUNTER_MID, data=str_data(2048, STORAGE_CMD)), 1)
    data, _ = mid(runtime, (1, None))
    assert data["seqs"]["1"]["storage"] == [json.loads(STORAGE_CMD)]
    parent = runtime.seqs[1].ctrl
    data, _ = mid(runtime, (1, None), (2, 1))  # fork 1 -> 2, then both run mid_process
    assert data["seqs"]["1"]["error"] == "" and data["seqs"]["2"]["error"] == ""
    child = runtime.seqs[2].ctrl
    counter = lambda c: struct.unpack("<I", c.read(30000, 4))[0]  # noqa: E731
    assert counter(parent) == 2 and counter(child) == 2  # child started from the parent's 1
    assert parent.exports["counter"].value(parent.store) == 2 and child.exports["counter"].value(child.store) == 2
    child.write(30000, struct.pack("<I", 100))
    assert counter(parent) == 2
    assert runtime.seqs[1].host.request is runtime.seqs[2].host.request
    assert runtime.seqs[1].host.get_var("v") == b"aaa"  # three appends: parent twice, child once
    assert runtime.seqs[2].host.seq_id == 2


def test_fork_group_and_max_forks(runtime):
    fork3 = ret_const(1500, '{"num_forks":3,"suspend":false,"ff_tokens":[]}')
    pre = start(runtime, controller(pre=fork3, data=str_data(1500, '{"num_forks":3,"suspend":false,"ff_tokens":[]}')), 1)
    assert pre["result"]["num_forks"] == 3
    many = '{"num_forks":99,"suspend":false,"ff_tokens":[]}'
    pre = start(runtime, controller(pre=ret_const(1500, many), data=str_data(1500, many)), 5)
    assert "max_forks" in pre["error"]


@pytest.mark.parametrize("phase, result, expected", [
    # negative counts were taken as they came (a Splice's backtrack -1 left its request waiting for good), token ids
    # past the vocabulary too (forced as empty text; a negative one indexed the vocabulary from its end)
    ("pre", '{"num_forks":-1,"suspend":false,"ff_tokens":[]}', "Expected `int` >= 0 - at `$.num_forks`"),
    ("pre", '{"num_forks":1,"suspend":false,"ff_tokens":[-3]}', "Expected `int` >= 0 - at `$.ff_tokens[0]`"),
    ("pre", '{"num_forks":1,"suspend":false,"ff_tokens":[5,49152]}', "ff_tokens [49152] outside the vocabulary of 49152"),
    ("mid", '{"Splice":{"backtrack":-1,"ff_tokens":[5]}}', "Expected `int` >= 0 - at `$.Splice.backtrack`"),
    ("mid", '{"Splice":{"backtrack":0,"ff_tokens":[-1]}}', "Expected `int` >= 0 - at `$.Splice.ff_tokens[0]`"),
    ("mid", '{"Splice":{"backtrack":0,"ff_tokens":[99999999]}}',
     "Splice.ff_tokens [99999999] outside the vocabulary of 49152"),
    # nested past the decoder's depth: a RecursionError failed the whole call, the other sequences' results with it
    ("mid", '{"SampleWithBias":{"a":' + "[" * 2000 + "]" * 2000 + "}}",
     "maximum recursion depth exceeded while deserializing an object"),
])
def test_results_out_of_range_are_invalid_and_end_only_their_sequence(runtime, phase, result, expected):
    body = ret_const(20000, result) if phase == "pre" else f"(call $ret_bias (i32.const 4096)) {ret_const(20000, result)}"
    start(runtime, controller(), 1)
    outcome = start(runtime, controller(**{phase: body}, data=str_data(20000, result)), 2)
    if phase == "mid":
        data, _ = mid(runtime, (1, None), (2, None))
        assert data["seqs"]["1"]["error"] == ""
        outcome = data["seqs"]["2"]
    assert outcome["result"] is None and "returned an invalid result: " in outcome["error"], outcome
    assert expected in outcome["error"]


def test_clones_beyond_max_forks_fail(runtime):
    start(runtime, controller(), 1)
    ops = [(1, None)] + [(100 + i, 1) for i in range(LIMITS.max_forks)]
    data, _ = mid(runtime, *ops)
    errors = [data["seqs"][str(i)]["error"] for i, _ in ops]
    assert errors[:LIMITS.max_forks] == [""] * LIMITS.max_forks
    assert "max_forks" in errors[-1] and runtime.seqs[1].host.request.live_seqs == LIMITS.max_forks


def test_constraints_per_instance_are_bounded(tokenizer):
    host = SeqHost(tokenizer, RequestState("x", b""), {}, 4096, max_constraints=2)
    assert host.constraint_new(0, "a") > 0 and host.constraint_new(0, "b") > 0
    assert host.constraint_new(0, "c") == -1 and b"more than 2 live constraints" in host.logs


def test_variable_store_versions():
    store = VariableStore()
    assert store.execute({"ReadVar": {"name": "x"}}) == ({"VariableMissing": {}}, None)
    resp, logged = store.execute({"WriteVar": {"name": "x", "value": "6869", "op": "Set", "when_version_is": None}})
    assert resp == {"WriteVar": {"version": 1}} and logged["WriteVar"]["value"] == "6869"
    assert store.execute({"WriteVar": {"name": "x", "value": "21", "op": "Append"}})[0] == {"WriteVar": {"version": 2}}
    assert store.execute({"ReadVar": {"name": "x"}})[0] == {"ReadVar": {"version": 2, "value": "686921"}}
    # compare-and-swap: a stale version returns the current value and writes nothing
    assert store.execute({"WriteVar": {"name": "x", "value": "00", "when_version_is": 1}}) == (
        {"ReadVar": {"version": 2, "value": "686921"}}, None)
    assert store.execute({"WriteVar": {"name": "x", "value": "00", "when_version_is": 2}})[0] == {"WriteVar": {"version": 3}}
    assert store.execute({"WriteVar": {"name": "new", "value": "00", "when_version_is": 1}})[0] == {"VariableMissing": {}}
    for bad in ({"Nope": {"name": "x"}}, {"WriteVar": {"name": "x", "value": "zz"}}, [], {"ReadVar": {}}):
        with pytest.raises(HostError):
            store.execute(bad)


def test_variable_store_holds_at_most_max_bytes():
    """A request's variables (names and values) are bounded (controllers.max_storage_bytes): a module appending
    to a variable every step grew the runtime without end."""
    store = VariableStore(max_bytes=10)
    assert store.execute({"WriteVar": {"name": "x", "value": "00" * 5}})[0] == {"WriteVar": {"version": 1}}
    assert store.execute({"WriteVar": {"name": "x", "value": "00" * 4, "op": "Append"}})[0] == {"WriteVar": {"version": 2}}
    with pytest.raises(HostError, match="would hold 11 bytes, past the 10 allowed"):
        store.execute({"WriteVar": {"name": "x", "value": "00", "op": "Append"}})
    with pytest.raises(HostError, match="would hold 12 bytes"):  # its name counts
        store.execute({"WriteVar": {"name": "y", "value": "00"}})
    assert store.execute({"ReadVar": {"name": "x"}})[0] == {"ReadVar": {"version": 2, "value": "00" * 9}}
    store.execute({"WriteVar": {"name": "x", "value": "00"}})  # a smaller value frees the rest
    assert store.execute({"WriteVar": {"name": "y", "value": "00" * 7}})[0] == {"WriteVar": {"version": 1}}


REGEX = r"(yes|no|maybe) [0-9]+"


def test_constraint_mask_matches_llguidance(runtime, tokenizer):
    body = (f"(if (i32.eqz (global.get $counter)) (then (global.set $counter "
            f"(call $c_new (i32.const 0) (i32.const 2048) (i32.const {len(REGEX)})))))"
            "(drop (call $c_bias (global.get $counter)))" + ret_const(1300, MID_SAMPLE))
    start(runtime, controller(mid=body, data=str_data(2048, REGEX)), 1)
    data, rows = mid(runtime, (1, None))
    assert data["seqs"]["1"]["result"] is None, data
    reference = llguidance.LLMatcher(tokenizer.ll, llguidance.LLMatcher.grammar_from_regex(REGEX))
    expected = allowed(reference.compute_bitmask())
    got = allowed(row(rows, 0, tokenizer))
    assert got == expected and tokenizer.tokenize(b"yes")[0] in got and tokenizer.tokenize(b"hello")[0] not in got


FORCED = "The quick brown fox jumps over[a-z]*"


@pytest.mark.parametrize("cap, dst", [(8, 16384), (3, 16384), (0, 16384), (8, 131070)])
def test_constraint_ff_tokens_writes_the_forced_tokens_up_to_cap(runtime, tokenizer, cap, dst):
    """tiller_constraint_ff_tokens(h, dst, cap): the tokens the grammar forces next, at most cap, at dst (their count
    returned, stored here at 16380); a dst outside the guest's memory fails only that sequence."""
    body = (f"(i32.store (i32.const 16380) (call $c_ff (call $c_new (i32.const 0) (i32.const 2048) "
            f"(i32.const {len(FORCED)})) (i32.const {dst}) (i32.const {cap})))" + OK_MID)
    start(runtime, controller(mid=body, data=str_data(2048, FORCED)), 1)
    start(runtime, controller(), 2)
    data, _ = mid(runtime, (1, None), (2, None))
    assert data["seqs"]["2"]["error"] == ""
    if dst + 4 * cap > 131072:
        assert "outside its memory" in data["seqs"]["1"]["error"]
        return
    forced = Constraint.create(tokenizer, 0, FORCED).ff_tokens()
    assert data["seqs"]["1"]["error"] == "" and len(forced) == 5
    n = min(cap, 5)
    written = runtime.seqs[1].ctrl.read(16380, 4 + 4 * n)
    assert struct.unpack(f"<{1 + n}I", written) == (n, *forced[:n])


def test_invalid_constraint_returns_negative_and_logs(runtime):
    bad = "(unclosed"
    body = (f"(if (i32.ge_s (call $c_new (i32.const 0) (i32.const 2048) (i32.const {len(bad)})) (i32.const 0))"
            "(then unreachable))" + OK_MID)
    start(runtime, controller(mid=body, data=str_data(2048, bad)), 1)
    data, _ = mid(runtime, (1, None))
    assert data["seqs"]["1"]["error"] == "" and "constraint error" in data["seqs"]["1"]["logs"]


def test_tokenize_and_module_arg_blobs(runtime, tokenizer):
    text = "Hello world"
    # tokenize "Hello world" then copy blob 2 to 16384 and blob 1 (module arg) to 20000; check from the host
    body = (f"(drop (call $tokenize (i32.const 2048) (i32.const {len(text)})))"
            "(drop (call $read_blob (i32.const 2) (i32.const 16384) (i32.const 64)))"
            "(drop (call $read_blob (i32.const 1) (i32.const 20000) (i32.const 64)))" + OK_MID)
    start(runtime, controller(mid=body, data=str_data(2048, text)), 1, arg={"k": 1})
    mid(runtime, (1, None))
    ctrl = runtime.seqs[1].ctrl
    expected = tokenizer.tokenize(text.encode())
    assert list(struct.unpack(f"<{len(expected)}I", ctrl.read(16384, 4 * len(expected)))) == expected
    assert ctrl.read(20000, 7) == b'{"k":1}'  # serialized as serde_json does: compact


def test_token_trie_blob(tokenizer):
    blob = tokenizer.trie_blob
    magic, hd, trie_bytes, off_bytes, _, vocab, eos = struct.unpack_from("<7I", blob)
    assert (magic, hd, vocab, eos) == (0x558B6FD3, 28, tokenizer.vocab_size, tokenizer.eos_token)
    nodes = struct.unpack_from(f"<{trie_bytes // 4}I", blob, 28)
    offsets = struct.unpack_from(f"<{vocab}I", blob, 28 + trie_bytes)
    data = blob[28 + trie_bytes + off_bytes:]
    token = tokenizer.tokenize(b"Hello")[0]
    assert data[offsets[token] >> 10:(offsets[token] >> 10) + (offsets[token] & 1023)] == b"Hello"

    def lookup(word: bytes) -> int | None:  # walk children by byte, like toktrie's child_at_bytes
        idx = 0
        for b in word:
            child, end = idx + 1, idx + (nodes[2 * idx + 1] >> 8)
            while child < end and nodes[2 * child] & 0xFF != b:
                child += nodes[2 * child + 1] >> 8
            if child >= end:
                return None
            idx = child
        tok = nodes[2 * idx] >> 8
        return None if tok == 0xFFFFFF else tok

    assert nodes[0] & 0xFF == 0xFF and nodes[1] >> 8 == trie_bytes // 8  # root spans every node
    for word in (b"Hello", b" world", b"{", b"\n"):
        assert lookup(word) == tokenizer.tokenize(word)[0]


def test_wasm_controller_direct_fork_copies_host_constraints(engine, tokenizer):
    module = engine.prepare(engine.compile(controller()))
    parent = WasmController(engine, module, SeqHost(tokenizer, RequestState("d", b""), {}, 4096))
    parent.setup(LIMITS.init_deadline_ms)
    handle = parent.host.constraint_new(0, "ab+")
    child = parent.fork(9)
    assert child.handle == parent.handle == 7 and child.host.seq_id == 9
    assert child.host.constraint(handle).commit(tokenizer.tokenize(b"a")) == 0
    assert parent.host.constraint(handle).commit(tokenizer.tokenize(b"x")) < 0  # parent's state is its own
    with pytest.raises(ControllerError, match="does not export"):
        engine.prepare(engine.compile(b"\0asm\1\0\0\0"))


def test_reset_drops_the_bound_sequences_of_a_previous_scheduler(runtime):
    start(runtime, controller(), 1)
    ok, _ = runtime.instantiate("waiting", [1], runtime.registry.create(controller(), "test")["module_id"], "")
    assert ok
    data = runtime.post_pre_process(aici_wire.PostPreProcess(reset=True, pre_ops=[aici_wire.PreOp(id=2, req_id="waiting")]))
    assert list(data["pre_seqs"]) == ["2"] and data["pre_seqs"]["2"]["error"] == ""
    assert list(runtime.seqs) == [2]  # sequence 1 went with the reset; the instance still unbound survived it
