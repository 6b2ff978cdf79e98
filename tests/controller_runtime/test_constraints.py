"""The AICI ABI's yacc -> Lark translator, llguidance-backed constraints, and the native example controller."""

from __future__ import annotations

import ctypes
import json

import jsonschema
import llguidance
import pytest

from common import aici_wire
from controllers.native import NativeLoadError, load_native_controllers
from controllers.native.base import NativeController
from services.controller_runtime.constraints import FINISHED, OK, REJECTED, Constraint, ConstraintError
from services.controller_runtime.runtime import UserError
from services.controller_runtime.yacc_lark import YaccError, yacc_to_lark
from tests.controller_runtime.conftest import allowed, mid, row, start

# the AICI ABI's C grammar fragment, abridged (same lexical conventions: SKIP, "/regex/", keywords, // comments)
C_GRAMMAR = r"""
%start translation_unit
%%
SKIP
: "//\*[^*]*\*+([^/*][^*]*\*+)*//"   // block comment
| "///.*/"                           // line comment
| "/\n?[ \t\v\f]*/"                  // white-space
;
IDENTIFIER: "/[a-zA-Z_][0-9a-zA-Z_]*/" ;
CONSTANT
: "/0[xX][0-9a-fA-F]+[uUlL]*?/"
| "/[0-9]+[uUlL]*?/"
;
STRING_LITERAL: '/"(\\.|[^\\"])*"/' ;
primary_expression
: IDENTIFIER
| CONSTANT
| STRING_LITERAL
| "(" expression ")"
;
expression
: primary_expression
| expression "+" primary_expression
| expression "*" primary_expression
;
statement: "return" expression ";" | IDENTIFIER "=" expression ";" ;
translation_unit
: statement
| translation_unit statement
;
"""


def test_yacc_translation_shape():
    lark = yacc_to_lark(C_GRAMMAR)
    lines = lark.splitlines()
    assert lines[0] == "start: r_translation_unit"
    assert r"%ignore /\/\*[^*]*\*+([^\/*][^*]*\*+)*\//" in lines  # '/' inside a regex is escaped for Lark
    assert "CONSTANT: /0[xX][0-9a-fA-F]+[uUlL]*?/ | /[0-9]+[uUlL]*?/" in lines
    assert 'r_statement: "return" r_expression ";" | IDENTIFIER "=" r_expression ";"' in lines
    assert 'IDENTIFIER: (/[a-zA-Z_][0-9a-zA-Z_]*/ & ~("return"))' in lines  # the keyword is reserved
    assert yacc_to_lark("a: 'x' | ;") == 'start: r_a\nr_a: "x" | ""\n'


@pytest.mark.parametrize("program, accepted", [
    ("x = (a + 0x1F) * 3; /* note */ return x;", True),
    ('s = "hi\\"there"; // end\nreturn s;', True),
    ("return x", None),  # an unfinished prefix: accepted so far, not complete
    ("x = 3 3;", False),
    ("x = 3 +;", False),
    ("return = 3;", False),  # a keyword is never an IDENTIFIER (the AICI ABI: keywords win over regexes)
    ("returned = 3; return returned;", True),
])
def test_yacc_grammar_accepts_exactly_c_fragment(tokenizer, program, accepted):
    c = Constraint.create(tokenizer, 3, C_GRAMMAR)
    code = c.commit(tokenizer.tokenize(program.encode()))
    if accepted is False:
        assert code == REJECTED
    else:
        assert code == OK and c.is_accepting() is bool(accepted)


@pytest.mark.parametrize("bad, message", [
    ("a 'x' ;", "expected ':'"),
    ("a: 'x'", "not terminated"),
    ("a: b ;", "undefined rule 'b'"),
    ("", "no rules"),
    ("a: '//' ;", "empty regex"),
    ("%start z\n%%\na: 'x' ;", "start rule 'z'"),
    ("a: 'x' ; A: 'y' ;", None),  # distinct names are fine (rule vs terminal)
    ("a: @ ;", "unexpected character"),
])
def test_yacc_errors(bad, message):
    if message is None:
        assert yacc_to_lark(bad) == 'start: A\nA: "x"\nA_2: "y"\n'
        return
    with pytest.raises(YaccError, match=message):
        yacc_to_lark(bad)


def test_json_schema_constraint_and_eos(tokenizer):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    c = Constraint.create(tokenizer, 1, json.dumps(schema))
    buf = (ctypes.c_uint32 * tokenizer.mask_words)()
    assert c.fill_mask(ctypes.addressof(buf), len(buf) * 4) == OK
    reference = llguidance.LLMatcher(tokenizer.ll, llguidance.LLMatcher.grammar_from_json_schema(
        schema, defaults={"whitespace_flexible": False}))
    assert allowed(bytes(buf)) == allowed(reference.compute_bitmask())
    assert c.commit(tokenizer.tokenize(b'{"n":12')) == OK
    fork = c.fork()
    assert c.commit(tokenizer.tokenize(b"}")) == FINISHED
    jsonschema.validate({"n": 12}, schema)
    assert c.commit([tokenizer.eos_token]) == FINISHED
    assert fork.commit([tokenizer.eos_token]) == REJECTED  # '{"n":12' may not end yet
    assert fork.commit(tokenizer.tokenize(b'"x"')) == REJECTED


@pytest.mark.parametrize("state", ["going", "finished", "in error"])
def test_the_mask_of_a_going_constraint_is_fill_masks_ok_case(tokenizer, state):
    c, reference = (Constraint.create(tokenizer, 0, "ab") for _ in range(2))
    for constraint in (c, reference):
        assert constraint.commit(tokenizer.tokenize(b"ab" if state == "finished" else b"a")) in (OK, FINISHED)
        if state == "in error":
            constraint.matcher.consume_token(tokenizer.tokenize(b"z")[0])
    got, expected = ((ctypes.c_uint32 * tokenizer.mask_words)() for _ in range(2))
    code = reference.fill_mask(ctypes.addressof(expected), len(expected) * 4)
    assert code == {"going": OK, "finished": FINISHED, "in error": REJECTED}[state]
    assert c.fill_mask_going(ctypes.addressof(got), len(got) * 4) == (code == OK)
    if code == OK:
        assert bytes(got) == bytes(expected)


def test_constraint_errors(tokenizer):
    for kind, source in ((0, "(unclosed"), (1, "{not json"), (2, "start: undefined_rule"), (3, "a: b ;"), (9, "x")):
        with pytest.raises(ConstraintError):
            Constraint.create(tokenizer, kind, source)


def test_native_controller_prefix_then_regex(runtime, tokenizer):
    arg = {"prefix": "Answer: ", "regex": "(yes|no)", "store_var": "out"}
    pre = start(runtime, "native:constrained", 1, arg=arg)
    assert pre["error"] == "" and pre["result"]["ff_tokens"] == tokenizer.tokenize(b"Answer: ")
    data, rows = mid(runtime, (1, None))
    assert data["seqs"]["1"]["result"] is None
    reference = llguidance.LLMatcher(tokenizer.ll, llguidance.LLMatcher.grammar_from_regex("(yes|no)"))
    assert allowed(row(rows, 0, tokenizer)) == allowed(reference.compute_bitmask())
    yes = tokenizer.tokenize(b"yes")
    out = runtime.post_pre_process(aici_wire.PostPreProcess(post_ops=[aici_wire.PostOp(id=1, tokens=yes)]))
    assert out["post_seqs"]["1"]["result"] == {"stop": True}
    assert out["pre_default"] == [] and out["pre_seqs"]["1"]["result"]["num_forks"] == 0  # done: pre_process stops it
    assert out["post_seqs"]["1"]["storage"][0]["WriteVar"]["name"] == "out"
    assert runtime.seqs[1].host.get_var("out") == json.dumps(yes).encode()


def test_native_controller_fast_forward_splices_forced_tokens_up_to_max_tokens(runtime, tokenizer):
    regex = "The quick brown fox jumps over[a-z]*"
    forced = Constraint.create(tokenizer, 0, regex).ff_tokens()
    assert len(forced) == 5
    start(runtime, "native:constrained", 1, arg={"regex": regex, "fast_forward": True, "max_tokens": 3})
    data, rows = mid(runtime, (1, None))
    assert data["seqs"]["1"]["result"] == {"Splice": {"backtrack": 0, "ff_tokens": forced[:3]}}
    assert not any(row(rows, 0, tokenizer))
    out = runtime.post_pre_process(aici_wire.PostPreProcess(post_ops=[aici_wire.PostOp(id=1, tokens=forced[:3])]))
    assert out["post_seqs"]["1"]["result"] == {"stop": True}  # max_tokens reached by the splice
    start(runtime, "native:constrained", 2, arg={"regex": regex, "max_tokens": 3})  # without: sampled
    data, rows = mid(runtime, (2, None))
    assert data["seqs"]["2"]["result"] is None and allowed(row(rows, 0, tokenizer)) == {forced[0]}
    ok, result = runtime.instantiate("bad", [1], "native:constrained", {"regex": "a", "fast_forward": "yes"})
    assert not ok and "fast_forward must be true or false" in result["error"]


def test_native_controller_budget_ends_items_in_a_row_before_one_that_would_not_fit(runtime, tokenizer):
    """Items in a row (tool calls) under a budget: at an end of an item, fewer tokens left than the longest item
    took stops the generation there (a whole reply); with room left, or mid-item, it goes on."""
    grammar = 'start: item ("\\n" item)*\nitem: "one two three four" | "five"'
    item = tokenizer.tokenize(b"one two three four")
    more = tokenizer.tokenize(b"\n") + tokenizer.tokenize(b"five")

    def post(seq_id: int, tokens: list[int]) -> dict:
        out = runtime.post_pre_process(aici_wire.PostPreProcess(post_ops=[aici_wire.PostOp(id=seq_id, tokens=tokens)]))
        return out["post_seqs"][str(seq_id)]["result"]

    budget = 2 * len(item) + len(more) - 1  # room for the first item and a short one, not for a long one
    start(runtime, "native:constrained", 1, arg={"lark": grammar, "budget": budget})
    start(runtime, "native:constrained", 2, arg={"lark": grammar})
    assert post(1, item[:-1]) == {"stop": False}  # mid-item
    assert post(1, item[-1:]) == {"stop": False}  # an item ends, room for another as long
    assert post(1, more) == {"stop": True}  # fewer left than the longest item took: ends whole
    assert post(2, item) == {"stop": False} and post(2, more) == {"stop": False}  # no budget: the grammar goes on
    ok, result = runtime.instantiate("bad", [1], "native:constrained", {"lark": grammar, "budget": 0})
    assert not ok and "budget must be a positive integer" in result["error"]


def test_native_controllers_pre_process_is_skipped_while_it_would_be_the_default(runtime, tokenizer):
    start(runtime, "native:constrained", 1, arg={"regex": "a+"})
    calls = []
    instance = runtime.seqs[1]
    instance.obj.pre_process = lambda: calls.append(1) or {"num_forks": 1, "suspend": False, "ff_tokens": []}
    a = tokenizer.tokenize(b"a")
    out = runtime.post_pre_process(aici_wire.PostPreProcess(post_ops=[aici_wire.PostOp(id=1, tokens=a)]))
    assert out["pre_default"] == [1] and out["pre_seqs"]["1"]["result"]["num_forks"] == 1 and calls == []
    instance.obj.prefix = a  # something to fast-forward: pre_process runs
    out = runtime.post_pre_process(aici_wire.PostPreProcess())
    assert out["pre_default"] == [] and calls == [1]


def test_native_controller_fork_and_errors(runtime):
    start(runtime, "native:constrained", 1, arg={"regex": "a+"})
    data, _ = mid(runtime, (1, None), (2, 1))
    assert data["seqs"]["2"]["result"] is None
    assert runtime.seqs[2].obj.host is runtime.seqs[2].host and runtime.seqs[1].obj.host is runtime.seqs[1].host
    ok, result = runtime.instantiate("bad", [1], "native:constrained", {"regex": "(", "prefix": "x"})
    assert not ok and "invalid regex constraint" in result["error"] and "constraint error" in result["logs"]
    ok, result = runtime.instantiate("typo", [1], "native:constrained", {"choices": ["red", "green"]})
    assert not ok and "unknown key 'choices'; the keys are budget, fast_forward, json_schema" in result["error"]
    with pytest.raises(UserError, match="unknown native controller"):
        runtime.instantiate("bad2", [1], "native:nope", "")
    with pytest.raises(NativeLoadError):
        load_native_controllers({"x": "json:loads"})
    with pytest.raises(NativeLoadError):
        load_native_controllers({"x": "no_such_module:Thing"})


class ScriptedMid(NativeController):
    """A native controller whose mid_process returns what its module_arg (JSON) says, after an all-ones mask."""

    def mid_process(self, fork_group: list[int]) -> object:
        self.host.return_logit_bias(b"\xff" * (4 * ((self.host.vocab_size + 31) // 32)))
        return json.loads(self.module_arg)


@pytest.mark.parametrize("returned, error", [
    ({"SampleWithBias": {}}, ""),
    ("Stop", ""),
    ({"Splice": {"ff_tokens": [5]}}, ""),
    ("Go", "mid_process returned an invalid result"),
    (3, "mid_process returned an invalid result"),
    ({"Sample": {}}, "mid_process returned an invalid result"),
    ({"SampleWithBias": {}, "Splice": {}}, "exactly one of SampleWithBias, Splice"),
    ({"Splice": {"backtrack": -2, "ff_tokens": [5]}}, "Expected `int` >= 0 - at `$.Splice.backtrack`"),
    ({"Splice": {"ff_tokens": [5, 10**6]}}, "Splice.ff_tokens [1000000] outside the vocabulary of 49152"),
])
def test_native_mid_process_results_are_checked(runtime, returned, error):
    runtime.natives["scripted"] = ScriptedMid
    start(runtime, "native:scripted", 1, arg=json.dumps(returned))  # a string module_arg is passed as is
    data, _ = mid(runtime, (1, None))
    outcome = data["seqs"]["1"]
    assert error in outcome["error"] if error else outcome["error"] == ""
    if not error:  # the reply's result: null samples, else "Stop" or the Splice as given
        assert outcome["result"] == (None if returned == {"SampleWithBias": {}} else
                                     returned if returned == "Stop" else {"Splice": {"backtrack": 0, "ff_tokens": [5]}})
