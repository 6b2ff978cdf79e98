"""Controller-runtime overhead per sequence per step, at 1, 16 and 64 concurrent sequences.

One step = what the scheduler asks each step: ``post_pre_process`` (post_process of the sampled token,
then pre_process) and ``mid_process`` (mask into the reply frame), including msgpack decoding of the
request and encoding of the reply, in-process (no socket). Controllers: a trivial Wasm controller
(all-ones mask), the shipped Wasm ``constrain`` controller with a JSON schema (llguidance mask + commit
every step), and the native ``constrained`` controller with the same schema.

    .venv/bin/python deploy/loadtest/controller_runtime_bench.py [--steps 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
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
DOCUMENT = ('{"name":"Ada Lovelace","age":36,"tags":["math","poetry","engines","notes","analysis","bernoulli",'
            '"babbage","london","countess","programs","music","looms","numbers","cards","mill","store","tables"]}')

TRIVIAL_WAT = """(module
  (import "env" "aici_host_return_process_result" (func $ret (param i32 i32)))
  (import "env" "aici_host_return_logit_bias" (func $bias (param i32)))
  (memory (export "memory") 2)
  (data (i32.const 1024) "{}")
  (data (i32.const 1100) "{\\"num_forks\\":1,\\"suspend\\":false,\\"ff_tokens\\":[]}")
  (data (i32.const 1200) "{\\"stop\\":false}")
  (data (i32.const 1300) "{\\"SampleWithBias\\":{}}")
  (data (i32.const 4096) "%s")
  (func (export "aici_init"))
  (func (export "aici_create") (result i32) (i32.const 1))
  (func (export "aici_init_prompt") (param i32) (call $ret (i32.const 1024) (i32.const 2)))
  (func (export "aici_pre_process") (param i32) (call $ret (i32.const 1100) (i32.const 46)))
  (func (export "aici_mid_process") (param i32) (call $bias (i32.const 4096)) (call $ret (i32.const 1300) (i32.const 21)))
  (func (export "aici_post_process") (param i32) (call $ret (i32.const 1200) (i32.const 14))))""" % ("\\ff" * 8192)


def run_case(runtime: Runtime, ref: str, arg: object, n: int, tokens: list[int]) -> float:
    """µs per sequence per step for ``n`` sequences of controller ``ref`` fed ``tokens``."""
    for i in range(n):
        ok, result = runtime.instantiate(f"b{i}", [1], ref, arg)
        assert ok, result.error
    step = aici_wire.encode({"op": "post_pre_process", "post_ops": [], "freed": [],
                             "pre_ops": [{"id": i, "req_id": f"b{i}"} for i in range(n)]})
    mid = aici_wire.encode({"op": "mid_process", "ops": [{"id": i} for i in range(n)]})
    elapsed = 0.0
    for tok in tokens:
        start = time.perf_counter()
        reply = runtime.post_pre_process(aici_wire.decode_main(step))
        aici_wire.encode(aici_wire.MainOk(data=reply))
        data, rows = runtime.mid_process(aici_wire.decode_main(mid))
        aici_wire.encode(aici_wire.MainOk(data=data))
        elapsed += time.perf_counter() - start
        errors = [s.error for s in data.seqs.values() if s.error]
        assert not errors, errors[:1]
        step = aici_wire.encode({"op": "post_pre_process", "pre_ops": [], "freed": [],
                                 "post_ops": [{"id": i, "tokens": [tok], "backtrack": 0} for i in range(n)]})
    runtime.free(list(range(n)))
    return elapsed / (len(tokens) * n) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=64, help="steps per case (the JSON document is cut to this)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--levels", default="1,16,64", help="concurrent sequences, comma-separated")
    args = parser.parse_args()
    levels = [int(n) for n in args.levels.split(",")]

    settings = Settings()
    tokenizer = TokenizerInfo.from_directory(resolve_model(settings).directory)
    engine = WasmEngine(settings.controllers, tokenizer)
    registry = ModuleRegistry(Path(tempfile.mkdtemp(prefix="crt-bench-")), engine)
    runtime = Runtime(settings.controllers, tokenizer, engine, registry,
                      load_native_controllers(settings.controllers.native))
    trivial = registry.create(wasmtime.wat2wasm(TRIVIAL_WAT), "bench")["module_id"]
    constrain = registry.create((ROOT / "controllers/wasm/constrain.wasm").read_bytes(), "bench")["module_id"]
    doc_tokens = tokenizer.tokenize(DOCUMENT.encode())[: args.steps]
    cases = [
        ("trivial wasm", trivial, "", [42] * len(doc_tokens)),
        ("json-schema wasm (constrain.wasm)", constrain, {"json_schema": SCHEMA}, doc_tokens),
        ("json-schema native:constrained", "native:constrained", {"json_schema": SCHEMA, "max_tokens": 10_000},
         doc_tokens),
    ]
    print(f"controller runtime overhead, µs per sequence per step (post_pre_process + mid_process, "
          f"msgpack included), median of {args.repeats}; {len(doc_tokens)} steps; target {TARGET_US:g} µs")
    print(f"{'controller':38} " + " ".join(f"{f'n={n}':>9}" for n in levels) + f"   vs target at n={levels[-1]}")
    for name, ref, arg, tokens in cases:
        figures = [statistics.median(run_case(runtime, ref, arg, n, tokens) for _ in range(args.repeats))
                   for n in levels]
        print(f"{name:38} " + " ".join(f"{f:9.1f}" for f in figures) + f"   {figures[-1] / TARGET_US:.2f}x")


if __name__ == "__main__":
    main()
