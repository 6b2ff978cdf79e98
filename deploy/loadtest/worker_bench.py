"""Decode speed of the worker engine vs ``transformers.generate`` (greedy, same prompt, same weights, same process).

    .venv/bin/python deploy/loadtest/worker_bench.py [--new-tokens 64] [--batch 1 16] [--repeats 3]
        [--weights fp32 gguf gguf-bf16 int8]
    # on a GPU, the default model's shapes and a Llama-1B shape, random bf16 weights:
    python deploy/loadtest/worker_bench.py --models random:smollm2 llama-1b --batch 1 16 64 256

Reads the usual settings (TILLER_MODEL, TILLER_DEVICE, ...); ``--models`` runs several models in
one go: each is a model setting (``smollm2``, ``random:<dir>``, a model directory) or ``llama-1b``
(random weights shaped like Llama-3.2-1B). For each batch size it prints, for both, the prefill
time (prompt to first token), the median ms per decode step and the decode tokens/s it gives, the
process's CPU ms per decode step (the figure a shared machine skews least), and end-to-end
tokens/s. Engine runs start with an empty prefix cache (cold prefill, comparable with generate);
the ``engine+pc`` row repeats them with the prompt's full blocks already cached, as a second
request sharing the prompt would find them. Each figure is the best of ``--repeats`` runs,
and steps are timed one by one (generate through a stopping criterion), so a busy machine skews
the medians less than the totals. It also prints whether the engine's greedy tokens equal
generate's for the first sequence of each batch. ``--weights`` runs the engine once per weights
setting (see common/config.py), after the first on the same loaded model, and closes with each
one's decode tokens/s against the first's; ``--gpu-kernels torch triton`` likewise runs it once per
``gpu_kernels`` setting (torch's ops around the matmuls, or Tiller's Triton kernels).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, StoppingCriteria, StoppingCriteriaList

from common.config import Settings, get_settings
from common.model_source import load_tokenizer
from common.wire import SamplingParams, SeqStep, Step, pack_ids, unpack_tokens
from services.worker.engine import Engine
from services.worker.kv_cache import BLOCK_SIZE
from services.worker.model_loader import LoadedModel, load_model, pick_device, pick_dtype

PROMPT = [{"role": "user", "content": "Write a short story about a lighthouse keeper who finds a message in a bottle."}]


# Llama-3.2-1B's shapes (random weights: only the shapes matter for speed)
LLAMA_1B = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rope_theta=500000.0,
    tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001,
)
SYNTHETIC_PROMPT_TOKENS = 48


@dataclass
class Run:
    prefill_s: float  # from the start to the first token
    step_s: list[float]  # each later decode step
    tokens: list[int]  # the first sequence's generated tokens
    step_cpu_s: float  # CPU time of this process per later decode step (mean): what a busy machine skews least

    @property
    def total_s(self) -> float:
        return self.prefill_s + sum(self.step_s)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class _StepClock(StoppingCriteria):
    """Timestamps every token generate produces (it asks once per step); never stops it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stamps: list[float] = []
        self.cpu_stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: object) -> torch.Tensor:
        _sync(self.device)
        self.stamps.append(time.perf_counter())
        self.cpu_stamps.append(time.process_time())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def bench_generate(model, prompt: list[int], batch: int, new_tokens: int, device: torch.device) -> Run:
    ids = torch.tensor([prompt] * batch, device=device)
    clock = _StepClock(device)
    _sync(device)
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=model.config.eos_token_id,
            stopping_criteria=StoppingCriteriaList([clock]),
        )
    assert out.shape[1] == len(prompt) + new_tokens
    stamps = [started, *clock.stamps]
    cpu = clock.cpu_stamps
    return Run(prefill_s=stamps[1] - stamps[0], step_s=[b - a for a, b in zip(stamps[1:], stamps[2:])],
               tokens=out[0, len(prompt):].tolist(), step_cpu_s=(cpu[-1] - cpu[0]) / max(1, len(cpu) - 1))


def bench_engine(engine: Engine, prompt: list[int], batch: int, new_tokens: int, run: int, warm: bool = False) -> Run:
    """``warm``: keep the prefix cache (the prompt's blocks are cached by earlier runs); else empty it."""
    greedy = SamplingParams(temperature=0)
    seq_ids = [run * 1000 + i for i in range(batch)]
    if not warm:
        engine.drop_prefix_cache()
    _sync(engine.device)
    started = time.perf_counter()
    result = engine.step(Step(step_id=0, seqs=[SeqStep(seq_id=s, tokens=prompt, sampling=greedy) for s in seq_ids]))
    _sync(engine.device)
    prefill = time.perf_counter() - started
    assert not result.failures, result.failures
    steps = []
    tokens = [unpack_tokens(result.tokens)[0]]
    follows = pack_ids(seq_ids)  # decoding, they follow: each feeds its own last sample, as the scheduler sends them
    cpu_started = time.process_time()
    for step_id in range(1, new_tokens):
        started = time.perf_counter()
        result = engine.step(Step(step_id=step_id, seqs=[], follows=follows))
        _sync(engine.device)
        steps.append(time.perf_counter() - started)
        tokens.append(unpack_tokens(result.tokens)[0])
    step_cpu_s = (time.process_time() - cpu_started) / max(1, len(steps))
    engine.free(seq_ids)
    return Run(prefill_s=prefill, step_s=steps, tokens=tokens, step_cpu_s=step_cpu_s)


def load(spec: str, settings: Settings) -> tuple[LoadedModel, list[int]]:
    """The model named by ``spec`` (see the module docstring) and the prompt to use with it."""
    if spec != "llama-1b":
        model_settings = settings.model_copy(update={"model": spec})
        loaded = load_model(model_settings, lambda progress, message: None, keep_dense=True)  # generate runs on it too
        tokenizer = load_tokenizer(model_settings)
        return loaded, tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_dict=False)
    device = pick_device(settings.device)
    dtype = pick_dtype(settings.dtype, device)
    torch.manual_seed(settings.seed)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**LLAMA_1B), dtype=dtype).to(device).eval()
    loaded = LoadedModel(model=model, config=model.config, name=spec, device=device, dtype=dtype,
                         eos_token_ids=[LLAMA_1B["eos_token_id"]],
                         max_model_len=min(settings.limits.max_model_len, LLAMA_1B["max_position_embeddings"]))
    prompt = torch.randint(1000, 100000, (SYNTHETIC_PROMPT_TOKENS,), generator=torch.Generator().manual_seed(0))
    return loaded, prompt.tolist()


def _first_difference(a: list[int], b: list[int]) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"differ from token {i}"
    return "equal" if len(a) == len(b) else "differ in length"


@dataclass
class Figures:
    """One implementation at one batch size: the best of the repeats."""

    impl: str  # generate, engine or engine+pc
    batch: int
    prefill_ms: float
    step_ms: float  # median decode step
    cpu_ms: float  # CPU time per decode step
    e2e_tok_s: float  # prompt to last token
    greedy: str  # the engine's first sequence against generate's ("" for generate itself)

    @property
    def decode_tok_s(self) -> float:
        return self.batch * 1000 / self.step_ms


def bench_model(spec: str, settings: Settings, batches: list[int], new_tokens: int, repeats: int) -> list[Figures]:
    """Prints the model's table (see the module docstring) and returns its rows."""
    loaded, prompt = load(spec, settings)
    batch_limit = max(batches)
    blocks_per_seq = -(-(len(prompt) + new_tokens + BLOCK_SIZE) // BLOCK_SIZE)
    graphs = batch_limit if settings.limits.cuda_graphs else 0
    engine = Engine(loaded, num_blocks=batch_limit * blocks_per_seq + 1, cuda_graph_batch=graphs,
                    gpu_kernels=settings.gpu_kernels)
    engine.capture_graphs()  # as the worker does at start-up
    n = new_tokens
    print(
        f"\nmodel={spec} weights={loaded.weights} device={loaded.device} dtype={loaded.dtype} "
        f"threads={torch.get_num_threads()} "
        f"backend={engine.backend} prompt={len(prompt)} tokens new={n} repeats={repeats}"
    )
    # Packed weights drop the dense projections they replace: generate would run on empty (meta)
    # weights and give NaN logits, so it runs only beside dense weights.
    dense = loaded.weights == "fp32"
    if not dense:
        print(f"(weights={loaded.weights}: the transformers model lost its dense projections; no generate rows)")
    # Warm both paths up once (allocator, kernels, lazy pages of the KV pool, CUDA graphs).
    for batch in batches:
        bench_engine(engine, prompt, batch, n, run=0)
    if dense:
        bench_generate(loaded.model, prompt, 1, 2, loaded.device)

    print(f"{'impl':<10}{'batch':>6}{'prefill ms':>12}{'ms/step':>10}{'cpu ms/step':>13}{'decode tok/s':>14}"
          f"{'e2e tok/s':>11}  greedy vs generate")
    rows: list[Figures] = []
    for batch in batches:
        runs: dict[str, list[Run]] = {"generate": [], "engine": [], "engine+pc": []} if dense else {
            "engine": [], "engine+pc": []}
        for r in range(repeats):  # interleaved, so a busy spell hits both alike
            if dense:
                runs["generate"].append(bench_generate(loaded.model, prompt, batch, n, loaded.device))
            runs["engine"].append(bench_engine(engine, prompt, batch, n, run=r + 1))
            runs["engine+pc"].append(bench_engine(engine, prompt, batch, n, run=r + 101, warm=True))
        want = runs["generate"][0].tokens if dense else None
        for impl, results in runs.items():
            step = min(statistics.median(run.step_s) for run in results)
            row = Figures(
                impl=impl,
                batch=batch,
                prefill_ms=min(run.prefill_s for run in results) * 1000,
                step_ms=step * 1000,
                cpu_ms=min(run.step_cpu_s for run in results) * 1000,
                e2e_tok_s=batch * n / min(run.total_s for run in results),
                greedy="" if want is None or impl == "generate" else _first_difference(results[0].tokens, want),
            )
            rows.append(row)
            print(
                f"{impl:<10}{batch:>6}{row.prefill_ms:>12.1f}{row.step_ms:>10.2f}{row.cpu_ms:>13.2f}"
                f"{row.decode_tok_s:>14.1f}{row.e2e_tok_s:>11.1f}  {row.greedy}"
            )
    by = {(row.impl, row.batch): row for row in rows}
    for batch in batches if dense else []:
        ratio = by[("engine", batch)].decode_tok_s / by[("generate", batch)].decode_tok_s
        print(f"{spec} batch {batch}: engine decode {ratio:.1f}x generate's")
    if 1 in batches:
        for batch in batches:
            if batch != 1:
                ratio = by[("engine", batch)].e2e_tok_s / by[("engine", 1)].e2e_tok_s
                print(f"{spec} engine batch {batch} vs batch 1 (e2e tok/s): {ratio:.1f}x")
    del engine, loaded
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=None, help="model settings to run (default: TILLER_MODEL)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeats", type=int, default=3, help="best of N runs")
    parser.add_argument("--weights", nargs="+", default=None, help="weights settings to run (default: TILLER_WEIGHTS)")
    parser.add_argument("--gpu-kernels", nargs="+", default=None, choices=["torch", "triton"],
                        help="gpu_kernels settings to run (default: TILLER_GPU_KERNELS)")
    args = parser.parse_args()
    settings = get_settings()
    variants = [{"weights": weights, "gpu_kernels": kernels} for weights in args.weights or [settings.weights]
                for kernels in args.gpu_kernels or [settings.gpu_kernels]]
    for spec in args.models or [settings.model]:
        engine_rows: dict[str, dict[int, Figures]] = {}
        for variant in variants:
            rows = bench_model(spec, settings.model_copy(update=variant), args.batch, args.new_tokens, args.repeats)
            label = " ".join(f"{key}={value}" for key, value in variant.items())
            engine_rows[label] = {row.batch: row for row in rows if row.impl == "engine"}
        first, *others = engine_rows
        for label in others:
            for batch, row in engine_rows[label].items():
                ratio = row.decode_tok_s / engine_rows[first][batch].decode_tok_s
                print(f"{spec} batch {batch}: engine decode with {label} {row.decode_tok_s:.1f} tok/s, "
                      f"{ratio:.2f}x {first}'s")


if __name__ == "__main__":
    main()
