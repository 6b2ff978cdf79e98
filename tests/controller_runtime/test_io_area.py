"""The optional I/O area (ABI.md "Fast path"): process args written into guest memory, results read from
it, pre_process skipped when the guest flags it as the default, mid_process computed by the host when the guest
declares it the mask of one of its constraints (or the Splice of its forced tokens), post_process answered by the host when the guest declares it that
constraint's commit (the tokens handed over before the guest's next call), and every misuse a clean error."""

from __future__ import annotations

import ctypes

import pytest

from common import aici_wire
from services.controller_runtime.constraints import FINISHED, Constraint, ConstraintKind
from services.controller_runtime.registry import RegistryError
from tests.controller_runtime.conftest import LIMITS, allowed, mid, row, start, wire_runtime
from tests.controller_runtime.wat import POST_OK, controller, ret_const, str_data

IO = 20000  # header: cap, flags, arg_len, result_len; data from IO + 16
CAP = 64


def io_header(cap: int = CAP, flags: int = 0) -> str:
    words = b"".join(v.to_bytes(4, "little") for v in (cap, flags, 0, 0))
    escaped = "".join("\\%02x" % b for b in words)
    return f'(data (i32.const {IO}) "{escaped}")'


def io_export(offset: int = IO) -> str:
    return f'(func (export "tiller_io") (result i32) (i32.const {offset}))'


# post_process logs the argument it finds in the area, then answers POST_OK through the area
LOG_ARG_AND_REPLY_IN_AREA = f"""
  (i32.store (i32.const 16384) (i32.const {IO + 16}))
  (i32.store (i32.const 16388) (i32.load (i32.const {IO + 8})))
  (drop (call $fd_write (i32.const 1) (i32.const 16384) (i32.const 1) (i32.const 16392)))
  (memory.copy (i32.const {IO + 16}) (i32.const 1200) (i32.const {len(POST_OK)}))
  (i32.store (i32.const {IO + 12}) (i32.const {len(POST_OK)}))"""


def post(runtime, seq_id: int, tokens: list[int]) -> dict:
    data = runtime.post_pre_process(aici_wire.PostPreProcess(post_ops=[aici_wire.PostOp(id=seq_id, tokens=tokens)]))
    return data["post_seqs"][str(seq_id)]


def test_args_arrive_and_results_return_through_the_area(runtime):
    start(runtime, controller(post=LOG_ARG_AND_REPLY_IN_AREA, extra=io_export(), data=io_header()), 1)
    start(runtime, controller(), 2)  # a guest without the area, in the same call
    result = post(runtime, 1, [5, 6])
    assert result["error"] == "" and result["result"] == {"stop": False}
    assert result["logs"] == '{"tokens":[5,6],"backtrack":0}'
    assert post(runtime, 2, [5])["result"] == {"stop": False}


def test_a_fork_keeps_using_its_copy_of_the_area(runtime):
    start(runtime, controller(post=LOG_ARG_AND_REPLY_IN_AREA, extra=io_export(), data=io_header()), 1)
    data, _ = mid(runtime, (1, None), (2, 1))
    assert data["seqs"]["2"]["error"] == ""
    assert post(runtime, 2, [9])["logs"] == '{"tokens":[9],"backtrack":0}'
    assert post(runtime, 1, [8])["logs"] == '{"tokens":[8],"backtrack":0}'


def test_an_arg_longer_than_the_area_comes_through_the_blob(runtime):
    # init_prompt answers only if the host marked the arg as absent (arg_len = 0xFFFFFFFF), else traps
    init = f"(if (i32.ne (i32.load (i32.const {IO + 8})) (i32.const -1)) (then unreachable)) " \
           "(call $ret (i32.const 1024) (i32.const 2))"
    module = controller(init_prompt=init, extra=io_export(), data=io_header())
    assert start(runtime, module, 1, prompt=list(range(100, 140)))["error"] == ""  # 200+ bytes > CAP
    with pytest.raises(AssertionError, match="unreachable"):
        start(runtime, module, 2, prompt=[1])


@pytest.mark.parametrize("flags, expected", [(1, ""), (0, "unreachable")])
def test_pre_process_is_skipped_only_when_flagged(runtime, flags, expected):
    pre = start(runtime, controller(pre="unreachable", extra=io_export(), data=io_header(flags=flags)), 1)
    assert expected in pre["error"] if expected else pre["error"] == ""
    if not expected:
        assert pre["result"] == {"suspend": False, "num_forks": 1, "ff_tokens": []} and pre["logs"] == ""


def test_a_result_length_beyond_the_area_ends_only_that_sequence(runtime):
    bad = f"(i32.store (i32.const {IO + 12}) (i32.const {CAP + 1}))"
    start(runtime, controller(post=bad, extra=io_export(), data=io_header()), 1)
    start(runtime, controller(), 2)
    data = runtime.post_pre_process(aici_wire.PostPreProcess(post_ops=[aici_wire.PostOp(id=i, tokens=[5]) for i in (1, 2)]))
    assert f"result_len {CAP + 1} is beyond the I/O area's capacity {CAP}" in data["post_seqs"]["1"]["error"]
    assert data["post_seqs"]["2"] | {"micros": 0} == {"error": "", "result": {"stop": False}, "storage": [],
                                                       "logs": "", "micros": 0}


@pytest.mark.parametrize("offset, cap", [(131070, CAP), (IO, 1 << 20)])
def test_an_area_outside_the_memory_fails_instantiation(runtime, offset, cap):
    ref = runtime.registry.create(controller(extra=io_export(offset), data=io_header(cap=cap)), "test")["module_id"]
    ok, result = runtime.instantiate("r1", [1], ref, "")
    assert not ok and "I/O area is not in the guest's memory" in result["error"]


def test_a_tiller_io_export_of_the_wrong_type_is_rejected_at_upload(runtime):
    wasm = controller(extra='(func (export "tiller_io") (param i32) (result i32) (i32.const 0))')
    with pytest.raises(RegistryError, match="tiller_io"):
        runtime.registry.create(wasm, "test")


REGEX = "ab"  # the constraint of the guests below: OK after "a", finished after "ab"


def declaring_guest(tokens: list[int], flags: str, regex: str = REGEX, mid: str = "unreachable",
                    post: str | None = None, data: str = "") -> bytes:
    """init_prompt creates a ``regex`` constraint, commits ``tokens`` to it and stores ``flags`` (a WAT expression of
    the constraint's handle $c) in its I/O area (of 256 bytes); mid_process traps by default, so any call of it
    shows."""
    words = "".join("\\%02x" % b for t in tokens for b in t.to_bytes(4, "little"))
    init = f"""(local $c i32)
      (local.set $c (call $c_new (i32.const 0) (i32.const 17000) (i32.const {len(regex)})))
      (drop (call $c_commit (local.get $c) (i32.const 17100) (i32.const {len(tokens)})))
      (i32.store (i32.const {IO + 4}) {flags})
      (call $ret (i32.const 1024) (i32.const 2))"""
    return controller(init_prompt=init, mid=mid, post=post, extra=io_export(),
                      data=f'{io_header(cap=256)} (data (i32.const 17000) "{regex}") (data (i32.const 17100) "{words}")'
                           + data)


MID_FROM_C = "(i32.or (i32.const 2) (i32.shl (local.get $c) (i32.const 8)))"


def test_mid_process_declared_as_a_constraints_mask_is_not_called(runtime, tokenizer):
    a = tokenizer.tokenize(b"a")
    start(runtime, declaring_guest(a, MID_FROM_C), 1)
    start(runtime, controller(), 2)
    data, rows = mid(runtime, (1, None), (2, None))
    assert data["seqs"]["1"] | {"micros": 0} == {"error": "", "result": None, "storage": [], "logs": "", "micros": 0}
    expected = Constraint.create(tokenizer, ConstraintKind.REGEX, REGEX)
    assert expected.commit(a) == 0
    buf = bytearray(tokenizer.mask_words * 4)
    expected.fill_mask(ctypes.addressof(ctypes.c_char.from_buffer(buf)), len(buf))
    assert row(rows, 0, tokenizer) == bytes(buf) and any(buf)
    assert row(rows, 1, tokenizer) == b"\xff" * len(buf)


@pytest.mark.parametrize("case", ["no flag bit", "unknown handle", "finished constraint", "fork"])
def test_mid_process_is_called_when_the_declaration_does_not_hold(runtime, tokenizer, case):
    tokens = tokenizer.tokenize(b"ab" if case == "finished constraint" else b"a")
    flags = {"no flag bit": "(i32.shl (local.get $c) (i32.const 8))",
             "unknown handle": "(i32.const 0x6302)"}.get(case, MID_FROM_C)
    start(runtime, declaring_guest(tokens, flags), 1)
    data, _ = mid(runtime, (1, None), *([(2, 1)] if case == "fork" else []))
    assert "aici_mid_process: trap: " in data["seqs"]["1"]["error"]
    assert "unreachable" in data["seqs"]["1"]["error"]


FORCED = "The quick brown fox jumps over[a-z]*"  # forces five tokens ("The" ... " jumps"; " over" may go on)


def mid_ff_from_c(posts: int) -> str:
    """Flags: mid_process is the mask of $c, or (bit 31) the splice of its forced tokens, at most ``posts`` + 1."""
    return f"(i32.or (i32.const {0x80000002 | posts << 2}) (i32.shl (local.get $c) (i32.const 8)))"


@pytest.mark.parametrize("posts, spliced", [(63, 5), (3, 4), (1, 2), (0, 0)])
def test_mid_process_declared_to_fast_forward_splices_the_forced_tokens_without_a_call(runtime, tokenizer, posts,
                                                                                        spliced):
    """Where the constraint forces two tokens or more, the host answers a Splice of them (no more than the declared
    post_process count + 1), else it computes the mask as declared; the guest's mid_process traps if called."""
    start(runtime, declaring_guest([], mid_ff_from_c(posts), regex=FORCED), 1)
    data, rows = mid(runtime, (1, None))
    forced = Constraint.create(tokenizer, ConstraintKind.REGEX, FORCED).ff_tokens()
    assert [tokenizer.token_bytes[t] for t in forced] == [b"The", b" quick", b" brown", b" fox", b" jumps"]
    outcome = data["seqs"]["1"]
    assert outcome["error"] == "" and outcome["logs"] == ""
    if spliced:
        assert outcome["result"] == {"Splice": {"backtrack": 0, "ff_tokens": forced[:spliced]}}
        assert not any(row(rows, 0, tokenizer))  # a row that does not sample is left empty
    else:  # one token at most: sampled under a mask that allows only it
        assert outcome["result"] is None and allowed(row(rows, 0, tokenizer)) == {forced[0]}
    assert constraint_of(runtime, 1).commit(forced) == 0  # the host committed nothing


def test_the_fast_forward_bit_alone_declares_nothing(runtime):
    start(runtime, declaring_guest([], "(i32.or (i32.const 0x80000000) (i32.shl (local.get $c) (i32.const 8)))",
                                   regex=FORCED), 1)
    data, _ = mid(runtime, (1, None))
    assert "unreachable" in data["seqs"]["1"]["error"]


def post_from_c(tokens: int, other_flags: int = 1) -> str:
    """Flags: the host may answer post_process for ``tokens`` tokens by committing them to constraint $c (and by
    default pre_process is the default, so that only post_process and mid_process call the guest)."""
    return f"(i32.or (i32.const {tokens << 2 | other_flags}) (i32.shl (local.get $c) (i32.const 8)))"


def committed(tokens: list[int]) -> str:
    """The argument of the post_process that hands over the tokens the host committed for the guest."""
    return '{"tokens":[%s],"backtrack":0,"committed":true}' % ",".join(map(str, tokens))


def plain(tokens: list[int], backtrack: int = 0) -> str:
    return '{"tokens":[%s],"backtrack":%d}' % (",".join(map(str, tokens)), backtrack)


def post_op(runtime, seq_id: int, tokens: list[int], backtrack: int = 0) -> dict:
    op = aici_wire.PostOp(id=seq_id, tokens=tokens, backtrack=backtrack)
    return runtime.post_pre_process(aici_wire.PostPreProcess(post_ops=[op]))["post_seqs"][str(seq_id)]


def constraint_of(runtime, seq_id: int) -> Constraint:
    (constraint,) = runtime.seqs[seq_id].host.constraints.values()
    return constraint


def posts_left(runtime, seq_id: int) -> int:
    """The count of tokens in the guest's flags word (bits 2-7)."""
    return int.from_bytes(runtime.seqs[seq_id].ctrl.read(IO + 4, 4), "little") >> 2 & 63


def test_post_process_declared_as_a_constraints_commit_is_answered_by_the_host(runtime, tokenizer):
    a, b = tokenizer.tokenize(b"a"), tokenizer.tokenize(b"b")
    start(runtime, declaring_guest([], post_from_c(3), regex="a{3}b", post=LOG_ARG_AND_REPLY_IN_AREA), 1)
    for left in (2, 1, 0):
        result = post(runtime, 1, a)
        assert result | {"micros": 0} == {"error": "", "result": {"stop": False}, "storage": [], "logs": "",
                                          "micros": 0}  # the guest, which logs its argument, was not called
        assert posts_left(runtime, 1) == left
    # the count used up: the guest gets the three tokens committed for it, then this call
    assert post(runtime, 1, b)["logs"] == committed(a * 3) + plain(b)
    constraint = constraint_of(runtime, 1)  # three a's committed (this guest's post_process commits nothing)
    assert not constraint.commit_going(a) and constraint.commit(b) == FINISHED


@pytest.mark.parametrize("case", ["finishing token", "rejected token", "EOS", "backtrack", "beyond the count",
                                  "no count"])
def test_post_process_is_called_when_the_declaration_does_not_hold(runtime, tokenizer, case):
    a, b, c = (tokenizer.tokenize(text) for text in (b"a", b"b", b"c"))
    start(runtime, declaring_guest([], post_from_c(0 if case == "no count" else 2), regex="a{1,3}b",
                                   post=LOG_ARG_AND_REPLY_IN_AREA), 1)
    first = post(runtime, 1, a)["logs"]
    assert first == (plain(a) if case == "no count" else "")
    tokens, backtrack = {"finishing token": (b, 0), "rejected token": (c, 0), "EOS": (a + [tokenizer.eos_token], 0),
                         "backtrack": (a, 1), "beyond the count": (a + a, 0), "no count": (a, 0)}[case]
    handed = "" if case == "no count" else committed(a)
    assert post_op(runtime, 1, tokens, backtrack)["logs"] == handed + plain(tokens, backtrack)
    # the host committed the first a only (left as it was when the declaration did not hold)
    constraint = constraint_of(runtime, 1)
    assert constraint.commit_going(a + a) and constraint.commit(b) == FINISHED


def test_committed_tokens_are_handed_over_before_the_next_call_and_go_with_a_fork(runtime, tokenizer):
    a, b = tokenizer.tokenize(b"a"), tokenizer.tokenize(b"b")
    start(runtime, declaring_guest([], post_from_c(5), regex="a{2}b", mid=None, post=LOG_ARG_AND_REPLY_IN_AREA), 1)
    assert post(runtime, 1, a)["logs"] == post(runtime, 1, a)["logs"] == ""
    data, _ = mid(runtime, (1, None), (2, 1))  # 2 forks from 1: both call mid_process (the flags do not declare it)
    for seq_id in (1, 2):
        assert data["seqs"][str(seq_id)] | {"micros": 0} == {"error": "", "result": None, "storage": [],
                                                             "logs": committed(a * 2), "micros": 0}
        constraint = constraint_of(runtime, seq_id)
        assert not constraint.commit_going(a) and constraint.commit(b) == FINISHED


STOP_IN_AREA = LOG_ARG_AND_REPLY_IN_AREA.replace("(i32.const 1200)", "(i32.const 18000)").replace(
    f"(i32.const {len(POST_OK)})", "(i32.const 13)")


@pytest.mark.parametrize("call", ["pre_process", "mid_process", "post_process"])
def test_a_guest_stopped_by_the_handed_over_tokens_is_not_called_on(runtime, tokenizer, call):
    """The guest's post_process says stop on the tokens handed over: the call they preceded is not made (its
    mid_process traps) and says stop in its own terms."""
    a = tokenizer.tokenize(b"a")
    flags = post_from_c(1, 0 if call == "pre_process" else 1)  # bit 0: pre_process is the default (not called)
    start(runtime, declaring_guest([], flags, regex="a*b", post=STOP_IN_AREA, data=str_data(18000, '{"stop":true}')), 1)
    out = runtime.post_pre_process(aici_wire.PostPreProcess(post_ops=[aici_wire.PostOp(id=1, tokens=a)]))
    assert out["post_seqs"]["1"]["result"] == {"stop": False}
    if call == "pre_process":  # the same call's pre_process: handed over first
        assert out["pre_seqs"]["1"] | {"micros": 0} == {
            "error": "", "result": {"num_forks": 0, "suspend": False, "ff_tokens": []}, "storage": [],
            "logs": committed(a), "micros": 0}
    elif call == "mid_process":
        data, _ = mid(runtime, (1, None), (3, 1))  # a fork: mid_process is called
        assert data["seqs"]["1"]["error"] == "" and data["seqs"]["1"]["result"] == "Stop"
        assert data["seqs"]["1"]["logs"] == committed(a)
    else:
        result = post(runtime, 1, a)
        assert result["error"] == "" and result["result"] == {"stop": True} and result["logs"] == committed(a)


def test_a_sequence_that_went_ahead_gets_pre_process_only_where_flagged_as_the_default(runtime):
    """``ahead`` (the scheduler sent the sequence's step already): a flagged pre_process is skipped as always,
    any other waits for the next call; the reply says which is which."""
    start(runtime, controller(pre="unreachable", extra=io_export(), data=io_header(flags=1)), 1)
    start(runtime, controller(), 3)
    posts = [aici_wire.PostOp(id=i, tokens=[5]) for i in (1, 3)]
    out = runtime.post_pre_process(aici_wire.PostPreProcess(post_ops=posts, ahead=[1, 3]))
    assert out["pre_default"] == [1] and out["waiting"] == [3] and set(out["pre_seqs"]) == {"1"}
    assert out["post_seqs"]["3"]["result"] == {"stop": False} and out["pre_seqs"]["1"]["error"] == ""
    later = runtime.post_pre_process(aici_wire.PostPreProcess())  # the next step's: 3's pre_process runs now
    assert later["waiting"] == [] and later["pre_default"] == [1]
    assert later["pre_seqs"]["3"]["result"] == {"suspend": False, "num_forks": 1, "ff_tokens": []}


def test_post_process_of_a_sequence_that_went_ahead_has_the_mid_deadline(runtime):
    start(runtime, controller(post="(loop $l (br $l))"), 1)
    start(runtime, controller(post="(loop $l (br $l))"), 2)
    posts = [aici_wire.PostOp(id=i, tokens=[5]) for i in (1, 2)]
    out = runtime.post_pre_process(aici_wire.PostPreProcess(post_ops=posts, ahead=[1]))
    assert f"deadline of {LIMITS.mid_deadline_ms:g} ms exceeded" in out["post_seqs"]["1"]["error"]
    assert f"deadline of {LIMITS.post_deadline_ms:g} ms exceeded" in out["post_seqs"]["2"]["error"]


def without_micros(data: object) -> object:
    """A reply's data with every ``micros`` zeroed (timings differ between two runs of the same calls)."""
    if isinstance(data, dict):
        return {k: 0 if k == "micros" else without_micros(v) for k, v in data.items()}
    return [without_micros(v) for v in data] if isinstance(data, list) else data


def test_mid_ahead_runs_mid_process_in_the_same_call_for_the_sequences_that_go_on(runtime, engine, tokenizer, tmp_path):
    """post_pre_mid (``mid_ahead``): the outcomes and mask rows of post_pre_process, then mid_process of the ``ahead``
    sequences that go on, in ``ahead`` order: not one whose post_process stopped it, nor one whose pre_process
    waits (not flagged as the default), nor one not ahead."""
    a = tokenizer.tokenize(b"a")
    apart = wire_runtime(LIMITS, tmp_path / "apart", engine, tokenizer)
    for rt in (runtime, apart):
        start(rt, "native:constrained", 1, arg={"regex": "a+b"})
        # pre_process flagged as the default, but post_process stops it
        start(rt, controller(post=ret_const(16384, '{"stop":true}'), extra=io_export(), data=io_header(flags=1)
                             + str_data(16384, '{"stop":true}')), 2)
        start(rt, controller(), 3)  # pre_process not flagged as the default: it waits
        start(rt, declaring_guest([], "(i32.or (i32.const 3) (i32.shl (local.get $c) (i32.const 8)))"), 4)
        start(rt, "native:constrained", 5, arg={"regex": "a+b"})  # not ahead
    posts = [aici_wire.PostOp(id=i, tokens=a) for i in (1, 2, 3, 4, 5)]
    request = aici_wire.PostPreProcess(post_ops=posts, ahead=[4, 3, 2, 1], mid_ahead=True)
    merged, rows = runtime.post_pre_mid(request)
    separate = apart.post_pre_process(request)
    assert separate["post_seqs"]["2"]["result"] == {"stop": True} and 2 in separate["pre_default"]
    assert separate["waiting"] == [3]
    mid_apart, rows_apart = mid(apart, (4, None), (1, None))
    assert merged["mid_ids"] == [4, 1] and bytes(rows) == bytes(rows_apart) and len(rows) == 2 * tokenizer.mask_words * 4
    assert without_micros(merged["mid"]) == without_micros(mid_apart)
    assert without_micros({k: merged[k] for k in separate if "mid" not in k}) == without_micros(
        {k: v for k, v in separate.items() if "mid" not in k})
    assert row(rows, 0, tokenizer) != row(rows, 1, tokenizer)  # "ab" after "a" (b only) and "a+b" after "a"
    plain, rows = runtime.post_pre_mid(aici_wire.PostPreProcess(ahead=[1]))  # no mid_ahead: nothing more
    assert plain["mid"] is None and plain["mid_ids"] == [] and not rows
