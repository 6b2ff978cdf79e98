"""Controller-runtime overhead per sequence per step, at 1, 16 and 64 concurrent sequences.

One step = what the scheduler asks each step: ``post_pre_process`` (post_process of the sampled token,
then pre_process) and ``mid_process`` (mask into the reply frame), including msgpack decoding of the
request and encoding of the reply, in-process (no socket); once every sequence's controller flags its
pre_process as the default, in one call (``ahead`` with ``mid_ahead``), as the scheduler sends such steps.
Controllers: a trivial Wasm controller (all-ones mask), the same through the I/O area (the ABI's fast path, as the C SDK uses it: the floor of a
Wasm controller), the shipped Wasm ``constrain`` controller with a JSON schema (llguidance mask + commit
every step), and the native ``constrained`` controller with the same schema. Each figure is wall time and,
beside it, the process's CPU time (all threads, the epoch ticker included), which a busy machine inflates
less; each the best of ``--repeats`` runs in fresh processes. Last, what a request costs once: the wall time
of its instantiate (a 200-token prompt) and free, per sequence.

``--baseline DIR`` measures another checkout (e.g. ``git worktree add /tmp/base main``) beside this one: each
repeat runs this script once under each tree's ``PYTHONPATH``, alternately, and both are printed with their
ratio (this tree / the baseline).

    .venv/bin/python deploy/loadtest/controller_runtime_bench.py [--steps 64] [--repeats 3] [--baseline DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import wasmtime

from common import aici_wire
from common.config import Settings
from common.model_source import resolve_model
from controllers.native import load_native_controllers
from services.controller_runtime.registry import ModuleRegistry
from services.controller_runtime.runtime import Runtime
from services.controller_runtime.tokenizer import TokenizerInfo
from services.controller_runtime.wasm import WasmEngine

ROOT = Path(__file__).resolve().parents[2]
TARGET_US = 15.0
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
PROMPT_TOKENS = 200
PROMPT = list(range(1000, 1000 + PROMPT_TOKENS))  # a request's prompt, as the scheduler binds it
DOCUMENT = ('{"name":"Ada Lovelace","age":36,"tags":["math","poetry","engines","notes","analysis","bernoulli",'
            '"babbage","london","countess","programs","music","looms","numbers","cards","mill","store","tables"]}')

def trivial_wat(io_area: bool) -> str:
    """A controller that allows every token. With ``io_area`` it works as the C SDK does through the I/O area
    (ABI.md "Fast path"): results written in guest memory and pre_process flagged as the default (not called),
    so a step is one guest call for post_process and one for mid_process with its one host call (the mask);
    without, three guest calls, each returning its result through the host, and the mask."""
    if io_area:  # the area at 32768: cap 4096, flags 1; its data at 32784, result_len at 32780
        io = '(data (i32.const 32768) "\\00\\10\\00\\00\\01\\00\\00\\00")\n  (func (export "tiller_io") (result i32) (i32.const 32768))'
        mid_ret = "(memory.copy (i32.const 32784) (i32.const 1300) (i32.const 21)) (i32.store (i32.const 32780) (i32.const 21))"
        post_ret = "(memory.copy (i32.const 32784) (i32.const 1200) (i32.const 14)) (i32.store (i32.const 32780) (i32.const 14))"
    else:
        io, mid_ret, post_ret = "", "(call $ret (i32.const 1300) (i32.const 21))", "(call $ret (i32.const 1200) (i32.const 14))"
    return """(module
  (import "env" "aici_host_return_process_result" (func $ret (param i32 i32)))
  (import "env" "aici_host_return_logit_bias" (func $bias (param i32)))
  (memory (export "memory") 2)
  (data (i32.const 1024) "{}")
  (data (i32.const 1100) "{\\"num_forks\\":1,\\"suspend\\":false,\\"ff_tokens\\":[]}")
  (data (i32.const 1200) "{\\"stop\\":false}")
  (data (i32.const 1300) "{\\"SampleWithBias\\":{}}")
  (data (i32.const 4096) "%s")
  %s
  (func (export "aici_init"))
  (func (export "aici_create") (result i32) (i32.const 1))
  (func (export "aici_init_prompt") (param i32) (call $ret (i32.const 1024) (i32.const 2)))
  (func (export "aici_pre_process") (param i32) (call $ret (i32.const 1100) (i32.const 46)))
  (func (export "aici_mid_process") (param i32) (call $bias (i32.const 4096)) %s)
  (func (export "aici_post_process") (param i32) %s))""" % ("\\ff" * 8192, io, mid_ret, post_ret)

def run_case(runtime: Runtime, ref: str, arg: object, n: int, tokens: list[int], gap_s: float = 0.0
             ) -> tuple[float, float, float]:
    """(wall, CPU) µs per sequence per step for ``n`` sequences of controller ``ref`` fed ``tokens``, the steps
    ``gap_s`` apart (the CPU spent in the gaps counts, the wall time not), and the wall µs per sequence of its
    instantiate and free (a request's own cost: prompt of PROMPT_TOKENS tokens)."""
    started = time.perf_counter()
    for i in range(n):
        ok, result = runtime.instantiate(f"b{i}", PROMPT, ref, arg)
        assert ok, result.error
    per_request = time.perf_counter() - started
    step = aici_wire.encode({"op": "post_pre_process", "post_ops": [], "freed": [],
                             "pre_ops": [{"id": i, "req_id": f"b{i}"} for i in range(n)]})
    mid = aici_wire.encode({"op": "mid_process", "ops": [{"id": i} for i in range(n)]})
    # as the scheduler sends a step: ahead once every sequence's controller flags pre_process as the default, with
    # its mid_process in the same call (mid_ahead; a tree without it: the two calls)
    merged = hasattr(runtime, "post_pre_mid")
    elapsed = cpu = 0.0
    for tok in tokens:
        start, start_cpu = time.perf_counter(), time.process_time()
        request = aici_wire.decode_main(step)
        if request.ahead and merged:
            reply, rows = runtime.post_pre_mid(request)
            aici_wire.encode(aici_wire.MainOk(data=reply))
            data = reply.mid
        else:
            reply = runtime.post_pre_process(request)
            aici_wire.encode(aici_wire.MainOk(data=reply))
            data, rows = runtime.mid_process(aici_wire.decode_main(mid))
            aici_wire.encode(aici_wire.MainOk(data=data))
        elapsed += time.perf_counter() - start
        cpu += time.process_time() - start_cpu
        errors = [s.error for s in data.seqs.values() if s.error]
        assert not errors and len(data.seqs) == n, errors[:1] or data.seqs.keys()
        ahead = len(reply.pre_default) == n
        step = aici_wire.encode({"op": "post_pre_process", "pre_ops": [], "freed": [],
                                 "post_ops": [{"id": i, "tokens": [tok], "backtrack": 0} for i in range(n)],
                                 "ahead": list(range(n)) if ahead else [], "mid_ahead": ahead and merged})
        if gap_s:
            start_cpu = time.process_time()
            time.sleep(gap_s)
            cpu += time.process_time() - start_cpu
    started = time.perf_counter()
    runtime.free(list(range(n)))
    per_request += time.perf_counter() - started
    return elapsed / (len(tokens) * n) * 1e6, cpu / (len(tokens) * n) * 1e6, per_request / n * 1e6


def measure(steps: int, levels: list[int], gap_s: float) -> dict[str, list[list[float]]]:
    """One repeat in this process: case name -> [wall, CPU, instantiate + free] µs per level."""
    settings = Settings()
    # deadlines a busy machine cannot overrun (they cost the same whatever their length)
    limits = settings.controllers.model_copy(update={"pre_deadline_ms": 1000.0, "post_deadline_ms": 1000.0,
                                                     "mid_deadline_ms": 1000.0})
    tokenizer = TokenizerInfo.from_directory(resolve_model(settings).directory)
    engine = WasmEngine(limits, tokenizer)
    registry = ModuleRegistry(Path(tempfile.mkdtemp(prefix="crt-bench-")), engine)
    runtime = Runtime(limits, tokenizer, engine, registry, load_native_controllers(limits.native))
    trivial = registry.create(wasmtime.wat2wasm(trivial_wat(io_area=False)), "bench")["module_id"]
    trivial_io = registry.create(wasmtime.wat2wasm(trivial_wat(io_area=True)), "bench")["module_id"]
    constrain = registry.create((ROOT / "controllers/wasm/constrain.wasm").read_bytes(), "bench")["module_id"]
    doc_tokens = tokenizer.tokenize(DOCUMENT.encode())[:steps]
    cases = [
        ("trivial wasm", trivial, "", [42] * len(doc_tokens)),
        ("trivial wasm, I/O area", trivial_io, "", [42] * len(doc_tokens)),
        ("json-schema wasm (constrain.wasm)", constrain, {"json_schema": SCHEMA}, doc_tokens),
        ("json-schema native:constrained", "native:constrained", {"json_schema": SCHEMA, "max_tokens": 10_000},
         doc_tokens),
    ]
    for _, ref, arg, tokens in cases:  # warm up: compiled grammars, lazily built lexer states
        run_case(runtime, ref, arg, 1, tokens)
    return {name: [list(run_case(runtime, ref, arg, n, tokens, gap_s)) for n in levels]
            for name, ref, arg, tokens in cases}


def child_run(tree: Path, steps: int, levels: str, gap_ms: float) -> dict[str, list[list[float]]]:
    """One repeat of this script under ``tree``'s code (its PYTHONPATH), in a fresh process."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, __file__, "--child", "--steps", str(steps), "--levels", levels,
                          "--gap-ms", str(gap_ms)],
                         env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])


def best(runs: list[dict[str, list[list[float]]]]) -> dict[str, list[list[float]]]:
    """The fastest of the runs, each figure: a busy machine only ever adds time."""
    return {name: [[min(r[name][li][k] for r in runs) for k in range(3)]
                   for li in range(len(runs[0][name]))] for name in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=64, help="steps per case (the JSON document is cut to this)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--levels", default="1,16,64", help="concurrent sequences, comma-separated")
    parser.add_argument("--gap-ms", type=float, default=0.0,
                        help="idle time between steps, as a forward pass through the stack (its CPU counts)")
    parser.add_argument("--baseline", type=Path, help="another checkout to measure beside this one, alternately")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    levels = [int(n) for n in args.levels.split(",")]
    if args.child:
        print(json.dumps(measure(args.steps, levels, args.gap_ms / 1000)))
        return
    trees = {"this tree": ROOT} if args.baseline is None else {"baseline": args.baseline.resolve(), "this tree": ROOT}
    runs: dict[str, list] = {label: [] for label in trees}
    for _ in range(args.repeats):
        for label, tree in trees.items():
            runs[label].append(child_run(tree, args.steps, args.levels, args.gap_ms))
    figures = {label: best(r) for label, r in runs.items()}
    print(f"controller runtime overhead, µs per sequence per step (post_pre_process + mid_process, msgpack "
          f"included), wall / process CPU, best of {args.repeats} runs; {args.steps} steps at most"
          f"{f', {args.gap_ms:g} ms apart' if args.gap_ms else ''}; "
          f"target {TARGET_US:g} µs")
    print(f"{'controller':58} " + " ".join(f"{f'n={n}':>13}" for n in levels) + f"   wall vs target at n={levels[-1]}")
    for label, table in figures.items():
        for name, per_level in table.items():
            row = " ".join(f"{wall:6.1f} /{cpu:5.1f}" for wall, cpu, _ in per_level)
            print(f"{(name if len(trees) == 1 else f'{label}: {name}'):58} {row}   {per_level[-1][0] / TARGET_US:.2f}x")
    if args.baseline is not None:
        base, this = figures["baseline"], figures["this tree"]
        for name in this:
            row = " ".join(f"{t[0] / b[0]:6.2f} /{t[1] / b[1]:5.2f}" for t, b in zip(this[name], base[name]))
            print(f"{f'this tree / baseline: {name}':58} {row}")
    print(f"per request: instantiate ({PROMPT_TOKENS}-token prompt) and free, wall µs a sequence, best of "
          f"{args.repeats}, at n=" + ", ".join(str(n) for n in levels))
    for label, table in figures.items():
        for name, per_level in table.items():
            row = " ".join(f"{request:13.0f}" for _, _, request in per_level)
            print(f"{(name if len(trees) == 1 else f'{label}: {name}'):58} {row}")


if __name__ == "__main__":
    main()
