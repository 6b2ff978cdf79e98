"""The optional I/O area (ABI.md "Fast path"): process args written into guest memory, results read from
it, pre_process skipped when the guest flags it as the default, mid_process computed by the host when the guest
declares it the mask of one of its constraints, and every misuse a clean error."""

from __future__ import annotations

import ctypes

import pytest

from common import aici_wire
from services.controller_runtime.constraints import Constraint, ConstraintKind
from services.controller_runtime.registry import RegistryError
from tests.controller_runtime.conftest import LIMITS, mid, row, start
from tests.controller_runtime.wat import POST_OK, controller

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


def declaring_guest(tokens: list[int], flags: str) -> bytes:
    """init_prompt creates a regex constraint, commits ``tokens`` to it and stores ``flags`` (a WAT expression of
    the constraint's handle $c) in its I/O area; mid_process traps, so any call of it shows."""
    words = "".join("\\%02x" % b for t in tokens for b in t.to_bytes(4, "little"))
    init = f"""(local $c i32)
      (local.set $c (call $c_new (i32.const 0) (i32.const 17000) (i32.const {len(REGEX)})))
      (drop (call $c_commit (local.get $c) (i32.const 17100) (i32.const {len(tokens)})))
      (i32.store (i32.const {IO + 4}) {flags})
      (call $ret (i32.const 1024) (i32.const 2))"""
    return controller(init_prompt=init, mid="unreachable", extra=io_export(),
                      data=f'{io_header()} (data (i32.const 17000) "{REGEX}") (data (i32.const 17100) "{words}")')


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
