"""Controllers end to end (the AICI runtime protocol and ABI, AICI's REST API): the real five services, the shipped Wasm
controllers from controllers/wasm/, and one test controller built here from C with the SDK.

Each test talks HTTP (``/v1/controllers``, tags, ``/v1/run`` SSE) or WebSocket to the gateway; what the
controller lets through is checked against its constraint, and tokens the model chose freely against
transformers greedy. Fault tests run a faulty controller beside a plain request and a well-behaved
controlled one, and check both of those finish correctly.
"""

from __future__ import annotations

import ast
import asyncio
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import torch

from controllers.build import build_one
from tests.gateway.support import greedy_config, parse_sse, token_ids, ws_generate

WASM = Path(__file__).resolve().parents[2] / "controllers" / "wasm"
TIMEOUT = httpx.Timeout(120.0)
PLAIN_PROMPT = "The three primary colors are"
PLAIN_TOKENS = 24

# A test controller: controller_arg picks its behaviour.
#   splice    - pre_process fast-forwards " The answer is", samples 3 free tokens, then mid_process splices
#               (backtrack 2, ff " forty-two."), samples one more free token, logs its token list and stops;
#   loop      - mid_process never returns;  trap - traps on its third mid_process;
#   oom       - grows memory until the limit, then aborts (as an allocator would);
#   badptr    - hands the host a result pointer outside its memory;  trap_init - traps in init_prompt;
#   oov_ff    - pre_process fast-forwards token id 0xFFFFFFFF;  oov_splice - mid_process splices token id vocab_size;
#   follow    - no pre_process (so the scheduler pipelines its steps): samples 4 free tokens, then mid_process
#               splices (backtrack 2, ff " forty-two."), samples 2 more, and post_process logs its token list
#               and stops when it hears of the second;
#   {...}     - (a JSON object) logs its argument and stops in init_prompt.
TEST_CONTROLLER = r"""
#include "aici.h"
enum { SPLICE, LOOP, TRAP, OOM, BADPTR, FOLLOW, OOV_FF, OOV_SPLICE };
static int mode, phase, mids, after_splice;

static void init_prompt(const uint32_t *prompt, uint32_t n) {
    uint32_t len;
    const char *arg = (const char *)aici_read_blob(aici_host_module_arg(), &len);
#define IS(s) (len == sizeof(s) - 1 && !memcmp(arg, s, len))
    if (IS("splice")) mode = SPLICE;
    else if (IS("loop")) mode = LOOP;
    else if (IS("trap")) mode = TRAP;
    else if (IS("oom")) mode = OOM;
    else if (IS("badptr")) mode = BADPTR;
    else if (IS("follow")) mode = FOLLOW;
    else if (IS("oov_ff")) mode = OOV_FF;
    else if (IS("oov_splice")) mode = OOV_SPLICE;
    else if (IS("trap_init")) __builtin_trap();
    else {
        if (len && arg[0] == '{') aici_log(arg, len);
        aici_host_stop();
    }
}

static uint32_t oov[1];

static aici_pre_result pre_process(void) {
    aici_pre_result r = aici_pre_continue();
    if (mode == OOV_FF) {
        oov[0] = 0xFFFFFFFFu;
        r.ff_tokens = oov;
        r.n_ff = 1;
    }
    if (mode == SPLICE && phase == 0) {
        phase = 1;
        r.ff_tokens = aici_tokenize(" The answer is", 14, &r.n_ff);
    }
    return r;
}

static aici_mid_result mid_process(const uint32_t *fork_group, uint32_t n) {
    uint32_t n_ff;
    const uint32_t *ff;
    switch (mode) {
    case LOOP:
        for (volatile uint32_t i = 0;; i++) {}
    case TRAP:
        if (++mids == 3) __builtin_trap();
        return aici_mid_sample();
    case OOM:
        for (;;)
            if (__builtin_wasm_memory_grow(0, 16) == (size_t)-1) __builtin_trap();
    case BADPTR:
        aici_host_return_process_result((const void *)0xFFFFFF00u, 4096);
        return aici_mid_sample();
    case OOV_SPLICE:
        oov[0] = aici_host_vocab_size();
        return aici_mid_splice(0, oov, 1);
    case FOLLOW:
        if (++mids != 5) return aici_mid_sample();
        ff = aici_tokenize(" forty-two.", 11, &n_ff);
        return aici_mid_splice(2, ff, n_ff);
    }
    if (phase == 1 && mids < 3) {
        mids++;
        return aici_mid_sample();
    }
    if (phase == 1) {
        phase = 2;
        ff = aici_tokenize(" forty-two.", 11, &n_ff);
        return aici_mid_splice(2, ff, n_ff);
    }
    if (phase == 2) {
        phase = 3;
        return aici_mid_sample();
    }
    return aici_mid_stop();
}

static int post_process(const uint32_t *tokens, uint32_t n, uint32_t backtrack) {
    if (mode == FOLLOW ? mids <= 5 || ++after_splice < 2 : mode != SPLICE || phase != 3) return 0;
    aici_buf b = {0};
    aici_buf_puts(&b, "TOKENS:");
    aici_json_put_u32s(&b, aici_tokens + aici_n_prompt, aici_n_tokens - aici_n_prompt);
    aici_buf_puts(&b, "\n");
    aici_log(b.p, b.n);
    aici_buf_free(&b);
    return 1;
}

static const aici_ctrl ctrl = {init_prompt, pre_process, mid_process, post_process};
static const aici_ctrl follow_ctrl = {init_prompt, NULL, mid_process, post_process};
const aici_ctrl *aici_controller(void) {
    uint32_t len;
    const char *arg = (const char *)aici_read_blob(aici_host_module_arg(), &len);
    return IS("follow") ? &follow_ctrl : &ctrl;
}
"""


@dataclass
class ForkOut:
    """Everything one branch streamed, deltas joined."""

    text: str = ""
    logs: str = ""
    error: str = ""
    storage: list[Any] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class RunOut:
    events: list[Any]
    forks: dict[int, ForkOut]
    usage: dict[str, int]


def client(stack, **headers: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=stack.http_url, timeout=TIMEOUT, headers=headers)


async def upload(stack, wasm: bytes, **headers: str) -> httpx.Response:
    async with client(stack, **headers) as http:
        return await http.post("/v1/controllers", content=wasm, headers={"content-type": "application/wasm"})


async def run(stack, controller: str, controller_arg: Any = "", *, prompt: str = "", max_tokens: int = 32,
              **extra: Any) -> RunOut:
    """POST /v1/run and read the whole SSE stream; checks its AICI framing."""
    body = {"controller": controller, "controller_arg": controller_arg, "prompt": prompt, "max_tokens": max_tokens,
            **extra}
    async with client(stack) as http:
        response = await http.post("/v1/run", json=body)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(response.text)
    assert events[0]["object"] == "initial-run" and events[0]["id"].startswith("run-"), events[0]
    assert events[0]["model"] == stack.settings.served_model_name
    assert events[-1] == "[DONE]", events[-3:]
    forks: dict[int, ForkOut] = {}
    for event in events[1:-1]:
        assert event["object"] == "run", event
        for fork in event["forks"]:
            out = forks.setdefault(fork["index"], ForkOut())
            assert out.finish_reason is None, f"fork {fork['index']} streamed after it finished: {events}"
            out.text += fork["text"]
            out.logs += fork["logs"]
            out.error += fork["error"]
            out.storage += fork["storage"]
            out.finish_reason = fork.get("finish_reason")
    assert forks and all(f.finish_reason for f in forks.values()), events
    return RunOut(events, forks, events[-2]["usage"])


async def run_error(stack, body: dict[str, Any], **headers: str) -> httpx.Response:
    async with client(stack, **headers) as http:
        return await http.post("/v1/run", json=body)


def hf_next(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0, -1]


@pytest.fixture(scope="module")
def modules(stack) -> dict[str, str]:
    """Module ids of the shipped controllers, uploaded once."""

    async def upload_all() -> dict[str, str]:
        ids = {}
        for path in sorted(WASM.glob("*.wasm")):
            response = await upload(stack, path.read_bytes())
            assert response.status_code == 200, response.text
            ids[path.stem] = response.json()["module_id"]
        return ids

    return asyncio.run(upload_all())


@pytest.fixture(scope="module")
def test_module(stack, have_clang, tmp_path_factory) -> str:
    """The test controller above, compiled with the SDK and uploaded (skips without clang + wasm-ld)."""
    tmp = tmp_path_factory.mktemp("ctrl")
    source = tmp / "tiller_test_ctrl.c"
    source.write_text(TEST_CONTROLLER)
    wasm = build_one(source, tmp).read_bytes()
    response = asyncio.run(upload(stack, wasm))
    assert response.status_code == 200, response.text
    return response.json()["module_id"]


async def plain_greedy(stack) -> list[int]:
    config = greedy_config(prompt=PLAIN_PROMPT, max_tokens=PLAIN_TOKENS)
    config["parameters"]["ignore_eos"] = True
    messages = await ws_generate(stack.ws_url, config)
    assert messages[-1]["type"] == "completion", messages[-1]
    return token_ids(messages)


# -- module registry ------------------------------------------------------------------------------


async def test_module_id_is_sha256_of_the_bytes(stack, modules):
    wasm = (WASM / "yesno.wasm").read_bytes()
    response = await upload(stack, wasm)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["module_id"] == hashlib.sha256(wasm).hexdigest() == modules["yesno"]
    assert body["wasm_size"] == len(wasm)
    assert body["compiled_size"] > 0 and body["time"] >= 0


async def test_upload_tag_and_run_by_tag(stack, modules):
    async with client(stack) as http:
        response = await http.post("/v1/controllers/tags", json={"module_id": modules["yesno"], "tags": ["yesno-e2e"]})
        assert response.status_code == 200, response.text
        assert [t["tag"] for t in response.json()["tags"]] == ["yesno-e2e"]
        listed = (await http.get("/v1/controllers/tags")).json()["tags"]
    tag = next(t for t in listed if t["tag"] == "yesno-e2e")
    assert tag["module_id"] == modules["yesno"] and tag["updated_by"] == "localhost"
    assert [t["updated_at"] for t in listed] == sorted((t["updated_at"] for t in listed), reverse=True)
    out = await run(stack, "yesno-e2e", prompt="Is water wet? Answer:", max_tokens=4)
    assert out.forks[0].text in ("Yes", "No")


# -- shipped controllers ----------------------------------------------------------------------------


async def test_yesno_answers_what_the_model_prefers(stack, modules, hf_model):
    prompt = "Question: Is the sky blue on a clear day? Answer:"
    yes, no = stack.tokenizer.encode("Yes")[0], stack.tokenizer.encode("No")[0]
    logits = hf_next(hf_model, stack.tokenizer(prompt).input_ids)
    expected = "Yes" if logits[yes] >= logits[no] else "No"
    out = await run(stack, modules["yesno"], prompt=prompt, max_tokens=8)
    assert out.forks[0].text == expected
    assert out.forks[0].finish_reason == "aici-stop" and out.usage["sampled_tokens"] == 1


async def test_regex_constraint(stack, modules):
    pattern = r"[0-9]{3}-[0-9]{4}"
    out = await run(stack, modules["constrain"], {"regex": pattern}, prompt="Call me at", max_tokens=20)
    assert re.fullmatch(pattern, out.forks[0].text), out.forks[0]


async def test_json_schema_constraint(stack, modules):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                                           "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    out = await run(stack, modules["constrain"], {"json_schema": schema}, prompt="A person as JSON:", max_tokens=60)
    jsonschema.validate(json.loads(out.forks[0].text), schema)


def greedy_fast_forward(hf_model, stack, prompt_ids: list[int], schema: dict, n: int) -> tuple[list[int], list[int]]:
    """transformers' greedy choices under the JSON schema's masks (llguidance over the runtime's own tokenizer
    info, compact JSON as the runtime compiles schemas), except that where the grammar forces two tokens or more
    they are appended as they are instead of sampled; up to ``n`` tokens. Returns (the tokens, each splice's
    length)."""
    import llguidance
    import llguidance.torch

    from common.model_source import resolve_model
    from services.controller_runtime.tokenizer import TokenizerInfo

    ll = TokenizerInfo.from_directory(resolve_model(stack.settings).directory).ll
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    matcher = llguidance.LLMatcher(ll, grammar)
    bitmask = llguidance.torch.allocate_token_bitmask(1, ll.vocab_size)
    out: list[int] = []
    splices: list[int] = []
    while len(out) < n and not matcher.is_stopped():
        forced = matcher.compute_ff_tokens()[: n - len(out)]
        if len(forced) >= 2:
            assert matcher.consume_tokens(forced)
            out += forced
            splices.append(len(forced))
            continue
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask)
        logits = hf_next(hf_model, prompt_ids + out)[None].clone()
        llguidance.torch.apply_token_bitmask_inplace(logits, bitmask)
        token = int(logits[0].argmax())
        assert matcher.consume_token(token)
        out.append(token)
    return out, splices


async def test_json_schema_fast_forward_is_greedy_with_the_forced_tokens_spliced(stack, modules, hf_model):
    """constrain's fast_forward through the whole stack: the grammar's forced tokens come as splices (counted as
    ff_tokens) and the tokens sampled between them are transformers' greedy choices under the schema's masks on
    exactly that text, so the worker fed each splice where it belongs; the JSON validates."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    prompt = "A person as JSON:"
    expected, splices = greedy_fast_forward(hf_model, stack, stack.tokenizer(prompt).input_ids, schema, 60)
    assert splices, "the schema forces tokens"
    out = await run(stack, modules["constrain"], {"json_schema": schema, "fast_forward": True}, prompt=prompt,
                    max_tokens=60)
    fork = out.forks[0]
    assert fork.error == "" and fork.finish_reason == "aici-stop", fork
    assert fork.text == stack.tokenizer.decode(expected, skip_special_tokens=True), fork.text
    jsonschema.validate(json.loads(fork.text), schema)
    sampled = len(expected) - sum(splices)
    assert out.usage == {"sampled_tokens": sampled, "ff_tokens": sum(splices), "cost": 2 * sampled + sum(splices)}


def greedy_under_regex(hf_model, tokenizer, prompt_ids: list[int], pattern: str, n: int) -> list[int]:
    """transformers' greedy choices with every token outside the regex's allowed set masked out (llguidance's
    own matcher and bitmask over the logits), ``n`` tokens."""
    import llguidance
    import llguidance.hf
    import llguidance.torch
    from transformers import LogitsProcessor, LogitsProcessorList

    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer)
    matcher = llguidance.LLMatcher(ll_tokenizer, llguidance.LLMatcher.grammar_from_regex(pattern))
    bitmask = llguidance.torch.allocate_token_bitmask(1, ll_tokenizer.vocab_size)

    class Masked(LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            if input_ids.shape[1] > len(prompt_ids):
                assert matcher.consume_token(int(input_ids[0, -1])), "greedy took a masked token"
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask)
            llguidance.torch.apply_token_bitmask_inplace(scores, bitmask)
            return scores

    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False,
                                logits_processor=LogitsProcessorList([Masked()]))
    return out[0, len(prompt_ids):].tolist()


async def test_a_long_constrained_generation_is_greedy_under_the_mask(stack, modules, hf_model):
    """Longer than the 63 tokens the runtime commits for constrain.wasm between two of its calls (ABI.md "Fast
    path", the declared post_process): the text is transformers' greedy decoding under the same regex's masks,
    token for token, to the end the constraint sets. The regex allows no end before 260 characters (past the
    63 tokens) and none after 300: a token committed twice (by the runtime, then again by the guest when they
    are handed over) would overrun it and end the generation early."""
    pattern = "[a-z ]{260,300}"
    prompt = "Once upon a time"
    expected = greedy_under_regex(hf_model, stack.tokenizer, stack.tokenizer(prompt).input_ids, pattern, 150)
    assert 64 < len(expected) < 150 and expected[-1] == stack.tokenizer.eos_token_id, expected
    out = await run(stack, modules["constrain"], {"regex": pattern}, prompt=prompt, max_tokens=150)
    fork = out.forks[0]
    assert fork.error == "" and fork.finish_reason == "aici-stop", fork
    assert fork.text == stack.tokenizer.decode(expected, skip_special_tokens=True), fork.text


GRAMMAR = r"""
start: expr
expr: NUMBER OP NUMBER | "(" NUMBER OP NUMBER ")" OP NUMBER
OP: "+" | "-" | "*"
NUMBER: /[1-9][0-9]?/
"""


def parses(text: str) -> bool:
    """Whether ``text`` is a sentence of GRAMMAR: the token sequence it must have, then Python's own parse."""
    number, op = r"[1-9][0-9]?", r"[-+*]"
    if not re.fullmatch(rf"{number}{op}{number}|\({number}{op}{number}\){op}{number}", text):
        return False
    tree = ast.parse(text, mode="eval")
    return all(isinstance(n, (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult))
               for n in ast.walk(tree))


async def test_grammar_constraint(stack, modules):
    out = await run(stack, modules["constrain"], {"grammar": GRAMMAR, "syntax": "lark"}, prompt="Arithmetic: ",
                    max_tokens=20)
    assert parses(out.forks[0].text), out.forks[0]


async def test_choices_constraint(stack, modules):
    options = ["red", "green", "blue"]
    out = await run(stack, modules["constrain"], {"choices": options}, prompt="My favourite colour is", max_tokens=8)
    assert out.forks[0].text in options


async def test_fork_branches_share_variables(stack, modules):
    program = {"steps": [
        {"Fixed": {"text": " Colours:"}},
        {"Fork": {"branches": [
            [{"Wait": {"vars": ["c1"]}}, {"Fixed": {"text": " first={{c1}}"}}],
            [{"Gen": {"max_tokens": 4, "set_var": "c1"}}],
        ]}},
    ]}
    out = await run(stack, modules["declctrl"], program, prompt="Name some colours.", max_tokens=40)
    assert len(out.forks) == 2, out.events
    writes = [cmd["WriteVar"] for f in out.forks.values() for cmd in f.storage if "WriteVar" in cmd]
    assert [w["name"] for w in writes] == ["c1"], out.forks
    value = bytes.fromhex(writes[0]["value"]).decode()
    assert value and out.forks[1].text.endswith(value), out.forks[1]
    assert out.forks[0].text.endswith(f" first={value}"), out.forks[0]  # branch 0 read what branch 1 wrote
    assert all(f.finish_reason == "aici-stop" for f in out.forks.values()), out.forks


async def test_branches_all_waiting_end_in_deadlock(stack, modules):
    """Both branches wait for a variable only the other would set after its own wait: rLLM's deadlock."""
    program = {"steps": [{"Fork": {"branches": [
        [{"Wait": {"vars": ["b"]}}, {"Set": {"var": "a", "value": "1"}}],
        [{"Wait": {"vars": ["a"]}}, {"Set": {"var": "b", "value": "1"}}],
    ]}}]}
    out = await run(stack, modules["declctrl"], program, prompt="Hello", max_tokens=16)
    assert [f.finish_reason for f in out.forks.values()] == ["deadlock", "deadlock"], out.forks
    assert out.usage["sampled_tokens"] == 0 and not any(f.storage for f in out.forks.values()), out.forks


async def test_a_failing_branch_ends_only_itself(stack, modules):
    program = {"steps": [{"Fork": {"branches": [
        [{"Fixed": {"text": " fine"}}],
        [{"Gen": {"regex": "(", "max_tokens": 4}}],  # not a regex: this branch's controller fails
    ]}}]}
    out = await run(stack, modules["declctrl"], program, prompt="Hello", max_tokens=16)
    assert out.forks[1].finish_reason == "fail" and out.forks[1].error, out.forks
    first = out.forks[0]
    assert (first.text, first.finish_reason, first.error) == (" fine", "aici-stop", ""), out.forks


async def test_backtrack_and_ff_tokens(stack, test_module, hf_greedy):
    """ff_tokens and a splice change the text as the controller says; the freely sampled tokens around them
    are transformers' greedy choices on exactly that text (so the worker's KV followed the backtrack)."""
    prompt = "Question: what is six times seven?"
    tok = stack.tokenizer
    prompt_ids, ff1, ff2 = tok(prompt).input_ids, tok.encode(" The answer is"), tok.encode(" forty-two.")
    free = hf_greedy(prompt_ids + ff1, 3)
    last = hf_greedy(prompt_ids + ff1 + free[:1] + ff2, 1)
    out = await run(stack, test_module, "splice", prompt=prompt, max_tokens=32)
    fork = out.forks[0]
    assert fork.error == "" and fork.finish_reason == "aici-stop", fork
    logged = json.loads(re.search(r"TOKENS:(\[.*?\])", fork.logs).group(1))
    assert logged == ff1 + free[:1] + ff2 + last  # the controller's view after the backtrack
    before, _, after = fork.text.partition(" \u21a9 ")
    shown = [tok.decode(ids, skip_special_tokens=True) for ids in (ff1 + free, ff2 + last)]
    assert [before, after] == shown, fork.text
    assert out.usage == {"sampled_tokens": 4, "ff_tokens": len(ff1) + len(ff2), "cost": 8 + len(ff1) + len(ff2)}


async def test_a_splice_and_a_stop_under_pipelined_steps(stack, test_module, hf_greedy):
    """A controller that flags pre_process as the default gets its steps pipelined (each sent before the result
    of the one before it): a splice whose backtrack takes out a token such a step fed, and a stop in post_process
    while the next step is in flight, leave the text and the worker's KV as without pipelining (the free tokens are
    transformers' greedy choices on exactly the text the controller sees)."""
    tok = stack.tokenizer
    prompt_ids, ff = tok(PLAIN_PROMPT).input_ids, tok.encode(" forty-two.")
    free = hf_greedy(prompt_ids, 4)
    last = hf_greedy(prompt_ids + free[:2] + ff, 2)
    before = (await asyncio.to_thread(stack.scheduler_health))["controller_steps"]
    out = await run(stack, test_module, "follow", prompt=PLAIN_PROMPT, max_tokens=32)
    after = (await asyncio.to_thread(stack.scheduler_health))["controller_steps"]
    fork = out.forks[0]
    assert fork.error == "" and fork.finish_reason == "aici-stop", fork
    logged = json.loads(re.search(r"TOKENS:(\[.*?\])", fork.logs).group(1))
    assert logged == free[:2] + ff + last
    before_mark, _, after_mark = fork.text.partition(" \u21a9 ")
    assert [before_mark, after_mark] == [tok.decode(ids, skip_special_tokens=True) for ids in (free, ff + last)]
    assert out.usage == {"sampled_tokens": 6, "ff_tokens": len(ff), "cost": 12 + len(ff)}
    # steps 2-5 (the 5th splices) and 7-8 (the 8th is in flight when post_process stops) went out early
    assert after["followed_steps"] - before["followed_steps"] == 6


def guard_readouts(fork: ForkOut) -> list[tuple[float, str]]:
    """concept_guard's log: per step, the readout it read and whether it steers from then on (one per token heard of:
    none for the last, after which the request ends)."""
    return [(float(v), state) for v, state in re.findall(r"concept_guard: (-?[0-9.]+) (on|off)", fork.logs)]


async def test_concept_guard_lowers_its_concepts_readout_by_steering_against_it(stack, modules):
    """concept_guard (controllers/src/concept_guard.c, and its native twin) on the real stack. Unguarded (a
    threshold never reached) and guarded, the first two readouts are the same: the prompt's last position's, above
    the threshold, so the guard steers against the concept from the token the step samples on (ABI.md "Steering and
    readouts"), and that token's readout, on the same tokens as unguarded, falls well below the unguarded one."""
    prompt, guard = "I am so happy today! I feel", {"concept": "happy", "scale": 30}
    free = await run(stack, modules["concept_guard"], {**guard, "threshold": 1e9}, prompt=prompt, max_tokens=4)
    unguarded = guard_readouts(free.forks[0])
    assert free.forks[0].error == "" and len(unguarded) == 3 and {s for _, s in unguarded} == {"off"}, free.forks
    threshold = unguarded[0][0] - 1.0
    for controller in (modules["concept_guard"], "native:concept_guard"):
        out = await run(stack, controller, {**guard, "threshold": threshold}, prompt=prompt, max_tokens=4)
        guarded = guard_readouts(out.forks[0])
        assert out.forks[0].error == "" and len(guarded) == 3, out.forks
        assert [v for v, _ in guarded[:2]] == pytest.approx([v for v, _ in unguarded[:2]], abs=0.05), guarded
        assert guarded[0][1] == "on" and guarded[2][0] < unguarded[2][0] - 5.0, (guarded, unguarded)


async def test_websocket_config_takes_a_controller(stack, modules):
    config = {"prompt": "Is fire cold? Answer:", "controller": modules["yesno"], "parameters": {"max_tokens": 8,
                                                                                               "temperature": 0}}
    messages = await ws_generate(stack.ws_url, config)
    assert messages[-1]["type"] == "completion", messages[-1]
    assert messages[-1]["generated_text"] in ("Yes", "No")


async def test_rest_generate_takes_a_controller(stack, modules):
    async with client(stack) as http:
        response = await http.post("/v1/generate", json={
            "prompt": "Pick a colour:", "controller": modules["constrain"],
            "controller_arg": {"choices": ["cyan", "magenta"]}, "max_tokens": 8, "stream": False})
    assert response.status_code == 200, response.text
    assert response.json()["generated_text"] in ("cyan", "magenta")


async def test_plain_requests_never_touch_the_runtime(stack, modules):
    async def settled() -> dict[str, float]:  # the last controlled request's ``freed`` may still be on its way
        while True:
            first = (await asyncio.to_thread(stack.scheduler_health))["controller_steps"]
            await asyncio.sleep(0.5)
            again = (await asyncio.to_thread(stack.scheduler_health))["controller_steps"]
            if again == first:
                return first

    before = await settled()
    assert len(await plain_greedy(stack)) == PLAIN_TOKENS
    assert (await settled()) == before
    await run(stack, modules["yesno"], prompt="Is snow white? Answer:", max_tokens=4)
    after = await settled()
    assert after["seq_steps"] > before["seq_steps"] and after["main_s"] > before["main_s"]


# -- faults -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode, message", [
    ("loop", "deadline"),
    ("trap", "trap"),
    ("oom", "memory"),
    ("badptr", "outside its memory"),
    # token ids past the vocabulary were forced as they came: empty text, the run a success
    ("oov_ff", "aici_pre_process returned an invalid result: ff_tokens [4294967295] outside the vocabulary of 49152"),
    ("oov_splice", "mid_process returned an invalid result: Splice.ff_tokens [49152] outside the vocabulary of 49152"),
])
async def test_faulty_controller_ends_only_its_request(stack, test_module, modules, hf_greedy, mode, message):
    expected = hf_greedy(stack.tokenizer(PLAIN_PROMPT).input_ids, PLAIN_TOKENS)
    plain, faulty, good = await asyncio.gather(
        plain_greedy(stack),
        run(stack, test_module, mode, prompt="Tell me a story.", max_tokens=16),
        run(stack, modules["yesno"], prompt="Is ice cold? Answer:", max_tokens=4),
    )
    assert faulty.forks[0].finish_reason == "fail", faulty.events
    assert message in faulty.forks[0].error, faulty.forks[0].error
    assert plain == expected
    assert good.forks[0].text in ("Yes", "No") and good.forks[0].finish_reason == "aici-stop"


async def test_controller_error_on_websocket_is_a_clean_error(stack, test_module):
    messages = await ws_generate(stack.ws_url, {"prompt": "Hello", "controller": test_module, "controller_arg": "trap",
                                                "parameters": {"max_tokens": 16}})
    error = messages[-1]
    assert error["type"] == "error" and "trap" in error["message"] and error["request_id"], error


async def test_trap_at_init_fails_fork_0_in_the_stream(stack, test_module):
    """AICI (rLLM): a controller that fails at instantiate still gets its stream, one ``run`` event failing
    fork 0 with the error and the logs, nothing generated."""
    out = await run(stack, test_module, "trap_init", prompt="Hi")
    assert len(out.events) == 3, out.events  # initial-run, the failure, [DONE]
    fork = out.events[1]["forks"][0]
    assert (fork["index"], fork["finish_reason"], fork["text"]) == (0, "fail", ""), fork
    assert "init" in fork["error"] and "trap" in fork["error"], fork
    assert out.usage == {"sampled_tokens": 0, "ff_tokens": 0, "cost": 0}


async def test_bad_controller_arg_reason_reaches_the_client(stack, modules):
    """The reason a shipped controller refuses its argument is in its logs: /v1/run streams them, the other
    surfaces quote them in the error message."""
    out = await run(stack, modules["constrain"], {"regex": "("}, prompt="Hi")
    fork = out.forks[0]
    assert fork.finish_reason == "fail" and "aici_host_stop" in fork.error, fork
    assert "constrain: bad controller_arg" in fork.logs, fork
    async with client(stack) as http:
        response = await http.post("/v1/generate", json={"prompt": "Hi", "controller": modules["constrain"],
                                                         "controller_arg": {"regex": "("}, "stream": False})
    assert response.status_code == 400, response.text
    assert "constrain: bad controller_arg" in response.json()["error"]["message"], response.text


async def test_json_controller_arg_is_serialized_as_aici_does(stack, test_module):
    """A JSON ``controller_arg`` reaches the controller as serde_json writes it: compact, UTF-8."""
    out = await run(stack, test_module, {"a": [1, "é"], "b": None}, prompt="Hi")
    assert out.forks[0].finish_reason == "fail" and out.forks[0].logs == '{"a":[1,"é"],"b":null}', out.forks


async def test_none_controller_is_plain_generation(stack, hf_greedy):
    """rLLM's ``controller: "none"``: no controller, ``controller_arg`` is the prompt."""
    expected = hf_greedy(stack.tokenizer(PLAIN_PROMPT).input_ids, 8)
    out = await run(stack, "none", PLAIN_PROMPT, max_tokens=8)
    fork = out.forks[0]
    assert fork.text == stack.tokenizer.decode(expected, skip_special_tokens=True), fork
    assert (fork.finish_reason, fork.error, fork.logs) == ("length", "", ""), fork
    assert out.usage == {"sampled_tokens": 8, "ff_tokens": 0, "cost": 16}


async def test_null_sampling_fields_take_their_defaults(stack, modules):
    """rLLM's RunRequest has optional temperature/top_p/top_k/max_tokens: ``null`` is the default."""
    out = await run(stack, modules["yesno"], prompt="Is snow cold? Answer:", temperature=None, top_p=None,
                    top_k=None, max_tokens=None)
    assert out.forks[0].text in ("Yes", "No") and out.forks[0].finish_reason == "aici-stop", out.forks


async def test_unknown_module_is_an_http_error(stack):
    response = await run_error(stack, {"controller": "f" * 64, "prompt": "Hi"})
    assert response.status_code == 400 and "f" * 64 in response.json()["error"]["message"], response.text
    response = await run_error(stack, {"controller": "no-such-tag", "prompt": "Hi"})
    assert response.status_code == 400 and "no-such-tag" in response.json()["error"]["message"], response.text


async def test_malformed_module_upload_is_refused(stack):
    for body in (b"not a wasm module", b"\0asm\x01\0\0\0\x05garbage"):
        response = await upload(stack, body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["message"], response.text
    response = await upload(stack, b"")
    assert response.status_code == 400 and "empty" in response.json()["error"]["message"]


async def test_tags_that_break_the_rules_are_refused(stack, modules):
    async with client(stack) as http:
        for tag in ("9starts-with-digit", "has space", "x" * 51, "a" * 64):
            response = await http.post("/v1/controllers/tags", json={"module_id": modules["yesno"], "tags": [tag]})
            assert response.status_code == 400, (tag, response.text)
        response = await http.post("/v1/controllers/tags", json={"module_id": "0" * 64, "tags": ["fine"]})
        assert response.status_code == 400, response.text
    async with client(stack, **{"x-user-id": "bob"}) as http:  # not an admin: only bob.* tags
        refused = await http.post("/v1/controllers/tags", json={"module_id": modules["yesno"], "tags": ["yesno"]})
        assert refused.status_code == 400 and "bob." in refused.json()["error"]["message"], refused.text
        allowed = await http.post("/v1/controllers/tags", json={"module_id": modules["yesno"], "tags": ["bob.yesno"]})
        assert allowed.status_code == 200, allowed.text
        assert allowed.json()["tags"][0]["updated_by"] == "bob"


async def test_user_role_header_decides_admin(stack, modules):
    """rLLM's ``x-user-role``: ``admin`` makes any user an admin; another role makes even the default user
    (``localhost``) an ordinary one, limited to its own ``<user>.`` tags."""
    async with client(stack, **{"x-user-id": "carol", "x-user-role": "admin"}) as http:
        response = await http.post("/v1/controllers/tags", json={"module_id": modules["yesno"], "tags": ["carol-any"]})
        assert response.status_code == 200, response.text
        assert response.json()["tags"][0]["updated_by"] == "carol"
    async with client(stack, **{"x-user-role": "user"}) as http:
        response = await http.post("/v1/controllers/tags", json={"module_id": modules["yesno"], "tags": ["unowned"]})
        assert response.status_code == 400 and "localhost." in response.json()["error"]["message"], response.text


async def test_run_request_validation(stack):
    response = await run_error(stack, {"prompt": "Hi"})
    assert response.status_code == 400 and "controller" in response.json()["error"]["message"]
    response = await run_error(stack, {"controller": "x", "temperature": -1})
    assert response.status_code == 400 and "temperature" in response.json()["error"]["message"]
