"""The shipped controllers (controllers/wasm/*.wasm as committed) driven in-process through the controller
runtime with the real tokenizer and model-free token streams (random, lowest-id, or a scripted text)."""

import ast
import json

import jsonschema
import numpy as np
import pytest
import regex as pyregex

from services.controller_runtime.wasm import ControllerError, WasmController
from tests.controllers.driver import ControllerFailed, Run, module, pick_lowest, pick_text


def pick_random(seed: int, prefer_eos: bool = False):
    rng = np.random.default_rng(seed)

    def pick(seq, allowed):
        if prefer_eos and pick.eos in set(allowed.tolist()):
            return pick.eos
        return int(rng.choice(allowed))
    return pick


def random_picker(host, seed, prefer_eos=False):
    p = pick_random(seed, prefer_eos)
    p.eos = host.tok.eos_token
    return p


def generated_tokens(run, seq=None):
    seq = seq or run.seqs[0]
    return seq.tokens[seq.prompt_len:]


# -- yesno ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["lowest", "highest"])
def test_yesno_answers_one_token_yes_or_no(host, which):
    yes, no = host.tok.tokenize(b"Yes")[0], host.tok.tokenize(b"No")[0]
    masks = []

    def pick(seq, allowed):
        masks.append(sorted(allowed.tolist()))
        return int(allowed[0] if which == "lowest" else allowed[-1])

    run = Run(host, module("yesno"), "", "Is the sky blue? Answer:", pick).run()
    assert masks == [sorted([yes, no])]
    assert generated_tokens(run) == [min(yes, no) if which == "lowest" else max(yes, no)]
    assert run.text() in ("Yes", "No")
    assert run.seqs[0].events[-1] == "post:stop" and not run.seqs[0].error


# -- uppercase ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 2])
def test_uppercase_forces_a_capital_every_fourth_byte_and_stops_after_50(host, seed):
    run = Run(host, module("uppercase"), "", "Write a tweet about rain:", random_picker(host, seed)).run()
    seq = run.seqs[0]
    assert "splice:0" not in " ".join(seq.events)   # a real prompt: nothing invented
    gen = generated_tokens(run)
    assert len(gen) == 50 and seq.events[-1] == "post:stop"
    data = b"".join(host.tok.token_bytes[t] for t in gen)
    assert len(data) >= 50
    assert all(65 <= data[i] <= 90 for i in range(0, len(data), 4)), data


def test_uppercase_invents_a_prompt_for_an_empty_one(host):
    run = Run(host, module("uppercase"), "", [], random_picker(host, 7)).run()
    seq = run.seqs[0]
    invented = host.tok.tokenize(b"Here's a tweet:\n")
    assert seq.tokens[: len(invented)] == invented
    assert seq.events[0] == f"splice:0:{len(invented)}"
    data = b"".join(host.tok.token_bytes[t] for t in seq.tokens[len(invented):])
    assert len(seq.tokens) - len(invented) == 50
    assert all(65 <= data[i] <= 90 for i in range(0, len(data), 4)), data


def test_uppercase_state_survives_a_fork(host):
    """Fork = new instance with the parent's memory and globals: the SDK heap, the recognizer stack and the token
    count carry over, and the two copies then diverge independently."""
    rng = np.random.default_rng(9)
    parent = host.instantiate(module("uppercase"), b"", prompt=host.tok.tokenize(b"Write:"), seq_id=1)
    out = {1: [], 2: []}

    def step(inst, key):
        inst.pre_process()
        res, allowed = host.mid(inst, [key])
        if res == "Stop":
            return True
        tok = int(rng.choice(allowed))
        out[key].append(tok)
        return inst.post_process([tok], 0).stop

    for _ in range(10):
        step(parent, 1)
    child = parent.fork(2)
    out[2] = list(out[1])
    done = {1: False, 2: False}
    while not all(done.values()):
        for key, inst in ((1, parent), (2, child)):
            if not done[key]:
                done[key] = step(inst, key)
    assert len(out[1]) == len(out[2]) == 50 and out[1][:10] == out[2][:10] and out[1] != out[2]
    for toks in out.values():
        data = b"".join(host.tok.token_bytes[t] for t in toks)
        assert all(65 <= data[i] <= 90 for i in range(0, len(data), 4)), data


# -- constrain ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(4))
def test_constrain_regex_output_matches(host, seed):
    rx = r"[0-9]{3}-[a-z]{2,4}( [A-Z][a-z]{0,5})?"
    run = Run(host, module("constrain"), {"regex": rx}, "Code:", random_picker(host, seed), max_steps=60).run()
    assert pyregex.fullmatch(rx, run.text()), run.text()
    assert run.seqs[0].events[-1] in ("post:stop", "mid:stop") and not run.seqs[0].error


@pytest.mark.parametrize("seed", range(4))
def test_constrain_choices(host, seed):
    choices = ["red", "green", "light blue", "blue-ish"]
    run = Run(host, module("constrain"), {"choices": choices}, "Color:", random_picker(host, seed)).run()
    assert run.text() in choices


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "pet": {"enum": ["cat", "dog"]}},
          "required": ["name", "age", "pet"], "additionalProperties": False}


@pytest.mark.parametrize("seed", range(3))
def test_constrain_json_schema_output_validates(host, seed):
    run = Run(host, module("constrain"), {"json_schema": SCHEMA}, "JSON:", random_picker(host, seed, True),
              max_steps=120).run()
    jsonschema.validate(json.loads(run.text()), SCHEMA)


def test_constrain_json_schema_as_string_and_scripted_model(host):
    want = '{"name":"Ann","age":42,"pet":"dog"}'
    run = Run(host, module("constrain"), {"json_schema": json.dumps(SCHEMA)}, "JSON:", pick_text(host, want)).run()
    assert run.text() == want


LARK = 'start: expr\nexpr: term (("+"|"-") term)*\nterm: NUM | "(" expr ")"\nNUM: /[0-9]{1,3}/'
YACC = """%start expr
%%
expr : term | expr "+" term ;
term : NUM | "(" expr ")" ;
NUM : "/[0-9]{1,3}/" ;
"""


@pytest.mark.parametrize("arg", [{"grammar": LARK, "syntax": "lark"}, {"grammar": LARK},
                                 {"grammar": YACC, "syntax": "yacc"}, {"yacc": YACC}])
@pytest.mark.parametrize("seed", range(2))
def test_constrain_grammar_output_parses(host, arg, seed):
    run = Run(host, module("constrain"), {**arg, "max_tokens": 60}, "Sum:", random_picker(host, seed, True),
              max_steps=80).run()
    text = run.text()
    tree = ast.parse(text, mode="eval")   # the grammar is a subset of Python expressions
    assert all(isinstance(n, (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub)) for n in ast.walk(tree))


def test_constrain_grammar_scripted(host):
    run = Run(host, module("constrain"), {"grammar": YACC, "syntax": "yacc"}, "Sum:", pick_text(host, "(1+22)+333")
              ).run()
    assert run.text() == "(1+22)+333"


def test_constrain_without_constraint_allows_every_token(host):
    sizes = []

    def pick(seq, allowed):
        sizes.append(len(allowed))
        return int(allowed[100 + len(sizes)])

    run = Run(host, module("constrain"), {"max_tokens": 3}, "Hi", pick).run()
    assert sizes == [host.tok.vocab_size] * 3 and len(generated_tokens(run)) == 3


def test_constrain_stop_string_and_max_tokens(host):
    run = Run(host, module("constrain"), {"stop": ["\n", "END"]}, "Say:", pick_text(host, "hello there\nmore")).run()
    assert run.text().startswith("hello there\n") and "more" not in run.text()
    run = Run(host, module("constrain"), {"stop": "END", "max_tokens": 4}, "Say:",
              pick_text(host, "one two three four five six")).run()
    assert len(generated_tokens(run)) == 4
    run = Run(host, module("constrain"), {"regex": "[a-z ]+", "stop": ["ee"]}, "Say:",
              pick_text(host, "a tree grows")).run()
    assert "ee" in run.text() and "grows" not in run.text()


def test_constrain_lets_the_runtime_commit_its_tokens_and_max_tokens_still_holds(host, monkeypatch):
    """constrain declares its post_process to be its constraint's commit for as many tokens as max_tokens leaves
    (at most 63: ABI.md "Fast path", flags bits 2-7): the runtime commits them itself and hands them over before
    it next calls the guest, which counts them (and stops at max_tokens exactly) without committing them again."""
    invoked = []
    invoke = WasmController.invoke

    def counted(self, export, arg, *args, **kwargs):
        invoked.append((export, b'"committed":true' in arg))
        return invoke(self, export, arg, *args, **kwargs)

    monkeypatch.setattr(WasmController, "invoke", counted)
    rng = np.random.default_rng(0)
    eos = host.tok.eos_token
    run = Run(host, module("constrain"), {"regex": "[a-z ]+", "max_tokens": 70}, "Say:",
              lambda seq, allowed: int(rng.choice(allowed[allowed != eos])), max_steps=80).run()
    assert len(generated_tokens(run)) == 70 and pyregex.fullmatch("[a-z ]+", run.text()), run.text()
    assert run.seqs[0].events == ["post:stop"] and not run.seqs[0].error
    # 63 tokens committed by the runtime, handed over with the 64th; then 5 (70 - 64 - 1), handed over with the 70th
    assert invoked == [("aici_init_prompt", False)] + [("aici_post_process", True), ("aici_post_process", False)] * 2


def counted(pick):
    """``pick``, counting its calls (the steps that sampled) in ``.calls``."""
    def counting(seq, allowed):
        counting.calls += 1
        return pick(seq, allowed)
    counting.calls = 0
    return counting


def splices(run) -> list[int]:
    """The token counts of the Splices the controller answered in mid_process (all with backtrack 0)."""
    events = [e.split(":") for e in run.seqs[0].events if e.startswith("splice:")]
    assert all(bt == "0" for _, bt, _ in events)
    return [int(n) for _, _, n in events]


def test_constrain_fast_forward_splices_what_the_grammar_forces_in_the_host_and_in_the_guest_alike(host, monkeypatch):
    """With fast_forward, the tokens the JSON schema forces (two or more) come as one Splice instead of one sampled
    step each; the host answers the declared mid_process itself, and the guest, when it is called, answers the
    same; the text is the one the model wanted either way."""
    want = '{"name":"Ann","age":42,"pet":"dog"}'
    runs = {}
    for label, arg in (("sampled", {"json_schema": SCHEMA}), ("host", {"json_schema": SCHEMA, "fast_forward": True})):
        pick = counted(pick_text(host, want))
        runs[label] = (Run(host, module("constrain"), arg, "JSON:", pick).run(), pick.calls)
    monkeypatch.setattr(WasmController, "mid_constraint", property(lambda self: (0, 0)))  # no declared mid_process
    pick = counted(pick_text(host, want))
    runs["guest"] = (Run(host, module("constrain"), {"json_schema": SCHEMA, "fast_forward": True}, "JSON:",
                         pick).run(), pick.calls)
    (sampled, n_sampled), (fast, n_fast), (guest, n_guest) = runs["sampled"], runs["host"], runs["guest"]
    assert sampled.text() == fast.text() == guest.text() == want
    assert splices(sampled) == [] and len(generated_tokens(sampled)) == n_sampled
    assert splices(fast) and min(splices(fast)) >= 2 and n_fast + sum(splices(fast)) == len(generated_tokens(fast))
    assert n_fast < n_sampled and (guest.seqs[0].tokens, n_guest) == (fast.seqs[0].tokens, n_fast)
    assert splices(guest) == splices(fast) and fast.seqs[0].events[-1] in ("post:stop", "mid:stop")


@pytest.mark.parametrize("seed", range(3))
def test_constrain_fast_forward_with_a_random_model_validates_and_keeps_to_max_tokens(host, seed):
    run = Run(host, module("constrain"), {"json_schema": SCHEMA, "fast_forward": True}, "JSON:",
              random_picker(host, seed, True), max_steps=120).run()
    jsonschema.validate(json.loads(run.text()), SCHEMA)
    assert splices(run) and not run.seqs[0].error
    cut = Run(host, module("constrain"), {"json_schema": SCHEMA, "fast_forward": True, "max_tokens": 2}, "JSON:",
              random_picker(host, seed, True)).run()
    assert len(generated_tokens(cut)) == 2 and splices(cut) == [2]  # '{"' 'name' forced, no further
    stops = Run(host, module("constrain"), {"json_schema": SCHEMA, "fast_forward": True, "stop": "zz"}, "JSON:",
                random_picker(host, seed, True), max_steps=120).run()
    assert splices(stops) == []  # stop strings need each token's text: nothing spliced past them


def test_declctrl_gen_fast_forward_splices_forced_tokens(host):
    want = '{"name":"Bo","age":7,"pet":"cat"}'
    prog = {"steps": [{"Gen": {"json_schema": SCHEMA, "fast_forward": True, "set_var": "j"}}]}
    run = Run(host, module("declctrl"), prog, "JSON:", pick_text(host, want)).run()
    assert run.text() == want and run.var("j") == want and splices(run) and min(splices(run)) >= 2


@pytest.mark.parametrize("arg,reason", [
    ({"regex": "(("}, "host rejected the constraint"),
    ({"regex": "a+", "fast_forward": 1}, "fast_forward must be true or false"),
    ({"grammar": "start: ", "syntax": "cobol"}, "syntax must be"),
    ({"json_schema": 12}, "json_schema must be"),
    ({"max_tokens": -1}, "max_tokens must be"),
    ({"choices": []}, "choices must be a non-empty array"),
    ({"stop": [""]}, "stop strings must be non-empty"),
    ({"regex": "a+", "json_shcema": {}}, "unknown key \"json_shcema\""),
    ("not json", "bad controller_arg"),
])
def test_constrain_bad_arg_is_a_clean_error(host, arg, reason):
    with pytest.raises(ControllerFailed) as exc:
        Run(host, module("constrain"), arg, "x", pick_lowest)
    assert "aici_host_stop" in exc.value.error
    assert "constrain: bad controller_arg" in exc.value.logs and reason in exc.value.logs


# -- declctrl -------------------------------------------------------------------------------------------

def test_declctrl_fixed_gen_choose_set_stop(host):
    prog = {"steps": [
        {"Fixed": {"text": " The answer is"}},
        {"Gen": {"rx": " [0-9]{1,3}", "set_var": "num"}},
        {"Fixed": {"text": ". Color:"}},
        {"Choose": {"options": [" red", " blue"], "set_var": "color"}},
        {"Set": {"var": "summary", "value": "{{num}}/{{color}}"}},
        {"Set": {"var": "summary", "value": "!", "append": True}},
        {"Fixed": {"text": " Done{{color}}."}},
        {"Stop": {}},
        {"Fixed": {"text": " never"}},
    ]}
    run = Run(host, module("declctrl"), prog, "Q:", pick_text(host, " The answer is 42. Color: blue")).run()
    assert run.text() == " The answer is 42. Color: blue Done blue."
    assert run.var("num") == " 42" and run.var("color") == " blue" and run.var("summary") == " 42/ blue!"
    assert not run.seqs[0].error
    assert any(s["WriteVar"]["name"] == "num" for s in run.seqs[0].storage)


def test_args_and_results_beyond_the_sdk_io_area_take_the_blob_calls(host):
    """A prompt and ff_tokens whose JSON is longer than the SDK's 4 KiB I/O area still get through."""
    text = " a b c d e f g h" * 200
    prompt = host.tok.tokenize(("word " * 1200).encode())
    assert len(json.dumps({"prompt": prompt})) > 4096 and len(host.tok.tokenize(text.encode())) > 1000
    run = Run(host, module("declctrl"), {"steps": [{"Fixed": {"text": text}}, {"Stop": {}}]}, prompt,
              pick_lowest).run()
    assert run.text() == text and not run.seqs[0].error


def test_declctrl_gen_stop_at_max_tokens_and_eos_backtrack(host):
    eos = host.tok.eos_token
    prog = {"steps": [
        {"Gen": {"stop_at": "!", "set_var": "a"}},
        {"Fixed": {"text": "|"}},
        {"Gen": {"max_tokens": 2, "set_var": "b"}},
        {"Fixed": {"text": "|"}},
        {"Gen": {"set_var": "c"}},   # the scripted model ends this one with EOS -> backtracked
        {"Fixed": {"text": "|end"}},
    ]}
    script = "Hi there!|one two|tail"   # tokens: Hi, ' there', '!', '|', one, ' two', '|', tail
    run = Run(host, module("declctrl"), prog, "Q:", pick_text(host, script, eos_after=True)).run()
    seq = run.seqs[0]
    assert (run.var("a"), run.var("b"), run.var("c")) == ("Hi there", "one two", "tail")
    assert run.text() == "Hi there!|one two|tail|end"
    assert eos not in seq.tokens
    assert "splice:1:" in " ".join(seq.events), seq.events   # the EOS was taken back with the next Fixed


def test_declctrl_following_a_label_backtracks(host):
    prog = {"steps": [
        {"Fixed": {"text": " Answer:", "label": "q"}},
        {"Gen": {"max_tokens": 3, "set_var": "first", "label": "g"}},
        {"Fixed": {"text": " Again:", "following": "q"}},   # drops the 3 generated tokens
        {"Gen": {"max_tokens": 2, "set_var": "second"}},
        {"Fixed": {"text": ".", "following": "q"}},         # and again
    ]}
    run = Run(host, module("declctrl"), prog, "Q:", random_picker(host, 11)).run()
    seq = run.seqs[0]
    answer = host.tok.tokenize(b" Answer:")
    assert seq.tokens[seq.prompt_len:] == answer + host.tok.tokenize(b".")
    splices = [e for e in seq.events if e.startswith("splice:")]
    again = len(host.tok.tokenize(b" Again:"))
    assert splices == [f"splice:0:{len(answer)}", "splice:3:%d" % again, "splice:%d:1" % (again + 2)]
    assert len(host.tok.tokenize(run.var("first").encode())) >= 1 and run.var("second")


def test_declctrl_json_schema_gen(host):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    prog = {"steps": [{"Fixed": {"text": "Result: "}}, {"Gen": {"json_schema": schema, "set_var": "j"}},
                      {"Fixed": {"text": "\n"}}]}
    run = Run(host, module("declctrl"), prog, "Q:", random_picker(host, 3, True)).run()
    jsonschema.validate(json.loads(run.var("j")), schema)
    assert run.text() == f"Result: {run.var('j')}\n"


def test_declctrl_fork_branches_share_variables_and_wait(host):
    prog = {"steps": [
        {"Fixed": {"text": " Start."}},
        {"Fork": {"branches": [
            [{"Fixed": {"text": " French:"}}, {"Gen": {"max_tokens": 4, "set_var": "french"}}],
            [{"Fixed": {"text": " German:"}}, {"Gen": {"max_tokens": 2, "set_var": "german"}}],
            [{"Wait": {"vars": ["french", "german"]}}, {"Fixed": {"text": " Both: {{french}} / {{german}}"}}],
        ]}},
        {"Fixed": {"text": " End."}},
    ]}
    run = Run(host, module("declctrl"), prog, "Q:", random_picker(host, 5)).run()
    assert len(run.seqs) == 3
    fr, de, waiter = run.seqs
    assert all(not s.error for s in run.seqs), [s.error for s in run.seqs]
    assert run.text(fr).startswith(" Start. French:") and run.text(fr).endswith(" End.")
    assert run.text(de).startswith(" Start. German:") and run.text(de).endswith(" End.")
    assert "suspend" in waiter.events
    assert run.text(waiter) == f" Start. Both: {run.var('french')} / {run.var('german')} End."
    assert run.var("french") and run.var("german")


def test_declctrl_fork_without_the_fork_capability_is_a_clean_error(host):
    prog = {"steps": [{"Fork": {"branches": [[{"Fixed": {"text": " a"}}], [{"Fixed": {"text": " b"}}]]}}]}
    inst = host.instantiate(module("declctrl"), prog, prompt=[1, 2], caps={"fork": False})
    with pytest.raises(ControllerError, match="aici_host_stop"):
        inst.pre_process()
    assert "Fork needs the host's \"fork\" capability" in inst.host.logs_text()


def test_declctrl_wait_gives_up_after_max_steps(host):
    prog = {"steps": [{"Fork": {"branches": [[{"Fixed": {"text": " a"}}],
                                             [{"Wait": {"vars": ["never"], "max_steps": 5}}]]}}]}
    run = Run(host, module("declctrl"), prog, "Q:", pick_lowest).run()
    done, waiter = run.seqs
    assert not done.error and run.text(done) == " a"
    assert waiter.events.count("suspend") == 5
    assert "aici_host_stop" in waiter.error and "Wait gave up" in waiter.logs


@pytest.mark.parametrize("prog,reason", [
    ({"steps": [{"Jump": {}}]}, "unknown or malformed step"),
    ({"steps": [{"Fixed": {"txt": "a"}}]}, "Fixed needs"),
    ({"steps": [{"Fork": {"branches": []}}]}, "Fork needs"),
    ({"steps": [{"Fork": {"branches": [[{"Wait": {"vars": "x"}}]]}}]}, "Wait needs"),
    ({"stepz": []}, "controller_arg must be"),
    ({"steps": [{"Gen": {"rx": "[a-"}}]}, "host rejected the constraint"),
    ({"steps": [{"Fixed": {"text": "a", "following": "nowhere"}}]}, "Fixed follows an unknown label"),
    ({"steps": [{"Fixed": {"text": "a", "label": 3}}]}, "label must be a string"),
    ({"steps": [{"Fixed": {"text": "a", "label": "a"}}, {"Gen": {"max_tokens": 1, "label": "g"}},
                {"Fixed": {"text": "b", "following": "a"}}, {"Fixed": {"text": "c", "following": "g"}}]},
     "Fixed follows an unknown label"),   # g's text was backtracked away
])
def test_declctrl_bad_program_is_a_clean_error(host, prog, reason):
    try:   # program errors fail instantiate; constraint errors fail the step that reaches the Gen
        seq = Run(host, module("declctrl"), prog, "x", pick_lowest).run().seqs[0]
        error, logs = seq.error, seq.logs
    except ControllerFailed as exc:
        error, logs = exc.error, exc.logs
    assert "aici_host_stop" in error
    assert reason in logs
