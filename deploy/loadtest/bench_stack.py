"""Whole-stack benchmark: plain ``transformers.generate`` vs Tiller streams over WebSocket, in one run.

Prints tokens/s of plain generate on one prompt, of one Tiller stream, and the aggregate of N
concurrent Tiller streams, with time-to-first-token and inter-token latency p50/p99, and the ratios
against the baselines measured in the same run: plain generate and the worker engine alone at batch 1
(the stack's overhead is what one stream loses against the engine). Starts its own stack, with the
caller's TILLER_* settings (model, device, ...), unless ``--url`` is given; then it also prints the CPU
time each service process spent per generated token in each phase (from ``/proc``, Linux), a figure
that survives a busy machine far better than tokens/s.

    python deploy/loadtest/bench_stack.py [--tokens 128] [--streams 16] [--url ws://127.0.0.1:8080/generate]

``--cpu-proxy`` measures what the stack costs per token where a step is as short as on a GPU: a 2-layer,
64-wide model with SmolLM2's tokenizer at random weights (about 1 ms a step on a CPU), torch on one
thread so that the other services have a core of their own.

``--serve-from DIR`` starts the stack from another checkout's code (this script, its client and its
baselines stay this tree's), ``--json FILE`` writes the figures: ``ab_stack.py`` alternates two trees so.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from common.supervisor import SERVICES  # noqa: E402
from common.config import get_settings  # noqa: E402

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


@dataclass
class StreamStats:
    tokens: int = 0
    ttft_s: float = 0.0
    gaps_s: list[float] = field(default_factory=list)
    total_s: float = 0.0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def in_process_baselines(tokens: int) -> tuple[float, float]:
    """Tokens/s of plain ``transformers.generate`` and of the worker engine alone (batch 1, no
    sockets), greedy, on the configured model, device and dtype, for the same prompt."""
    import torch

    from common.config import get_settings
    from common.model_source import load_tokenizer
    from common.wire import SamplingParams, SeqStep, Step, pack_ids
    from services.worker.engine import Engine
    from services.worker.model_loader import load_model

    settings = get_settings()
    loaded = load_model(settings, lambda progress, message: None, keep_dense=True)  # generate runs on it too
    ids = load_tokenizer(settings)(PROMPT).input_ids
    engine = Engine.create(loaded, settings)
    engine.capture_graphs()  # as the worker does at start-up

    def engine_run(n: int) -> None:
        engine.step(Step(step_id=0, seqs=[SeqStep(seq_id=1, tokens=ids, sampling=SamplingParams(temperature=0))]))
        for step_id in range(1, n):  # it follows, as the scheduler sends it
            engine.step(Step(step_id=step_id, seqs=[], follows=pack_ids([1])))
        engine.free([1])

    def timed(run) -> float:
        if loaded.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        if loaded.device.type == "cuda":
            torch.cuda.synchronize()
        return tokens / (time.perf_counter() - start)

    prompt = torch.tensor([ids], device=loaded.device)
    with torch.inference_mode():
        def generate(n: int) -> None:
            loaded.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n,
                                  min_new_tokens=n, do_sample=False, pad_token_id=loaded.eos_token_ids[0])

        generate(8)  # warm-up
        engine_run(tokens)
        generate_tok_s = timed(lambda: generate(tokens))
        engine_tok_s = timed(lambda: engine_run(tokens))
    return generate_tok_s, engine_tok_s


def save_model_without_weights(target: Path, **config_changes: int) -> Path:
    """The default model's config (with ``config_changes``) and tokenizer in ``target``, no weights:
    served as ``random:<target>``, e.g. on a machine without the embedded model."""
    from common.config import Settings
    from common.model_source import resolve_model

    source = resolve_model(Settings(model="random:smollm2")).directory
    target.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        if (source / name).is_file():
            shutil.copy(source / name, target / name)
    config = json.loads((source / "config.json").read_text())
    config.update(config_changes)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target


def cpu_proxy_model() -> str:
    """A random-weights model spec whose decode step is GPU-short on a CPU (see the module docstring)."""
    target = save_model_without_weights(Path(tempfile.mkdtemp(prefix="tiller-proxy-model-")), hidden_size=64,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        intermediate_size=128)
    return f"random:{target}"


def release_accelerator_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


async def one_stream(url: str, tokens: int) -> StreamStats:
    import websockets

    stats = StreamStats()
    config = {
        "type": "config",
        "prompt": PROMPT,
        "parameters": {"max_tokens": tokens, "temperature": 0, "ignore_eos": True},
    }
    async with websockets.connect(url, max_size=None) as ws:
        start = time.perf_counter()
        await ws.send(json.dumps(config))
        last = None
        async for raw in ws:
            msg = json.loads(raw)
            now = time.perf_counter()
            if msg["type"] == "token":
                stats.tokens += 1
                if last is None:
                    stats.ttft_s = now - start
                else:
                    stats.gaps_s.append(now - last)
                last = now
            elif msg["type"] == "completion":
                stats.total_s = now - start
                break
            elif msg["type"] == "error":
                raise RuntimeError(f"stream failed: {msg}")
    return stats


async def streams(url: str, n: int, tokens: int) -> tuple[float, list[StreamStats]]:
    start = time.perf_counter()
    results = await asyncio.gather(*(one_stream(url, tokens) for _ in range(n)))
    elapsed = time.perf_counter() - start
    return sum(r.tokens for r in results) / elapsed, results


def cpu_seconds(pid: int) -> float:
    """CPU time of process ``pid``'s live threads so far, in nanoseconds' precision (``/proc/<pid>/stat``
    counts 10 ms ticks, a third of a stream's 256 tokens' cost on the scheduler)."""
    total = 0
    for schedstat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        try:
            total += int(schedstat.read_text().split()[0])  # time on a CPU, user and system
        except (FileNotFoundError, ProcessLookupError):  # a thread that just ended
            pass
    return total / 1e9


class CpuPerToken:
    """CPU seconds per generated token of each service process over a phase: ``start()`` then ``stop(tokens)``."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.before: dict[str, float] = {}

    def start(self) -> None:
        self.before = {name: cpu_seconds(pid) for name, pid in self.pids.items()}

    def stop(self, tokens: int) -> dict[str, float]:
        return {name: (cpu_seconds(pid) - self.before[name]) / tokens for name, pid in self.pids.items()}


def describe_cpu(per_token: dict[str, float]) -> str:
    parts = "  ".join(f"{name} {seconds * 1e6:6.0f}" for name, seconds in per_token.items())
    return f"{'':28s} CPU us/token: {parts}  (total {sum(per_token.values()) * 1e6:.0f})"


def describe(label: str, tok_s: float, results: list[StreamStats], baseline: float) -> str:
    ttft = [r.ttft_s * 1000 for r in results]
    gaps = [g * 1000 for r in results for g in r.gaps_s]
    return (
        f"{label:28s} {tok_s:8.1f} tok/s  ({tok_s / baseline:5.2f}x plain)  "
        f"TTFT p50 {percentile(ttft, 0.5):7.1f} ms p99 {percentile(ttft, 0.99):7.1f} ms  "
        f"ITL p50 {percentile(gaps, 0.5):6.1f} ms p99 {percentile(gaps, 0.99):6.1f} ms"
    )


@dataclass
class StackFigures:
    generate_tok_s: float  # plain transformers.generate, one sequence
    engine_tok_s: float  # the worker engine alone, batch 1
    single_tok_s: float  # one stream through the whole stack
    many_tok_s: float  # the aggregate of ``streams`` concurrent streams
    single_cpu_s: dict[str, float] = field(default_factory=dict)  # CPU seconds per token by service
    many_cpu_s: dict[str, float] = field(default_factory=dict)

    @property
    def single_vs_engine(self) -> float:
        return self.single_tok_s / self.engine_tok_s


def measure(tokens: int, n_streams: int, url: str | None = None, serve_from: Path = ROOT) -> StackFigures:
    """The baselines in this process, then the streams against ``url`` (default: a stack started with
    this process's TILLER_* settings from the checkout ``serve_from``); prints the table and returns its figures."""
    baseline, engine_alone = in_process_baselines(tokens)
    release_accelerator_memory()  # the model measured in-process is gone: leave the GPU to the stack
    stack = None
    cpu = CpuPerToken({})
    if url is None:
        from tests.stack import served_settings, start_stack

        stack = start_stack(Path(tempfile.mkdtemp(prefix="tiller-bench-")), serve_from, **served_settings())
        url = stack.ws_url
        cpu = CpuPerToken({name: stack.pid(name) for name in SERVICES})
    try:
        asyncio.run(one_stream(url, tokens))  # warm-up
        cpu.start()
        single_tok_s, single = asyncio.run(streams(url, 1, tokens))
        single_cpu = cpu.stop(sum(r.tokens for r in single))
        cpu.start()
        many_tok_s, many = asyncio.run(streams(url, n_streams, tokens))
        many_cpu = cpu.stop(sum(r.tokens for r in many))
    finally:
        if stack is not None:
            stack.down()
    figures = StackFigures(baseline, engine_alone, single_tok_s, many_tok_s, single_cpu, many_cpu)
    settings = get_settings()
    served = "" if serve_from == ROOT else f", served from {serve_from}"
    print(f"model {settings.model} on {settings.device}, {tokens} greedy tokens per stream{served}")
    print(f"{'plain transformers.generate':28s} {baseline:8.1f} tok/s")
    print(f"{'worker engine alone, batch 1':28s} {engine_alone:8.1f} tok/s  ({engine_alone / baseline:5.2f}x plain)")
    print(describe("tiller, 1 stream", single_tok_s, single, baseline))
    if cpu.pids:
        print(describe_cpu(single_cpu))
    print(describe(f"tiller, {n_streams} streams (aggregate)", many_tok_s, many, baseline))
    if cpu.pids:
        print(describe_cpu(many_cpu))
    print(f"per-stream median {statistics.median(r.tokens / r.total_s for r in many):.1f} tok/s")
    print(f"one stream through the whole stack keeps {figures.single_vs_engine:.0%} of the engine's own batch-1 speed")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--url", help="a running stack's WebSocket URL; default: start one")
    parser.add_argument("--cpu-proxy", action="store_true", help="a tiny model, torch on one thread (see above)")
    parser.add_argument("--serve-from", type=Path, default=ROOT, help="the checkout whose code serves (default: this one)")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args()
    if args.cpu_proxy:  # before torch is imported here or in the stack's processes
        os.environ.update(OMP_NUM_THREADS="1", TILLER_DEVICE="cpu")
        os.environ["TILLER_MODEL"] = cpu_proxy_model()
        get_settings.cache_clear()
    figures = measure(args.tokens, args.streams, args.url, args.serve_from.resolve())
    if args.json:
        args.json.write_text(json.dumps(asdict(figures)))


if __name__ == "__main__":
    main()
