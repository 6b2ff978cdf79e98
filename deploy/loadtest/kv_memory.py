"""The worker's resident memory as traffic fills the KV pool on the CPU, with the default pool ceiling
(``limits.kv_cpu_max_bytes``) against a pool sized by free RAM alone (the baseline, the old default),
both measured in one run. Each stack gets the same distinct long prompts one after the other; the
script prints the worker's RSS after start and after the prompts, and what /health says of the pool.

    python deploy/loadtest/kv_memory.py [--prompts 20] [--prompt-tokens 1500]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

UNCAPPED = str(1 << 50)  # a ceiling above any machine's RAM: the pool is sized by kv_memory_fraction alone


def rss_mib(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def distinct_prompt(client: httpx.Client, i: int, tokens: int) -> str:
    """A prompt of at most ``tokens`` tokens that shares no 16-token block with prompt ``i - 1``."""
    words = [f"w{i}x{j}" for j in range(tokens)]
    while (count := client.post("/tokenize", json={"prompt": " ".join(words)}).json()["count"]) > tokens:
        words = words[: int(len(words) * tokens / count * 0.98)]
    return " ".join(words)


def measure(label: str, prompts: int, prompt_tokens: int, **env: str) -> dict[str, float]:
    from tests.stack import start_stack

    stack = start_stack(Path(tempfile.mkdtemp(prefix="tiller-kvmem-")), **env)
    try:
        worker = stack.pid("worker")
        start = rss_mib(worker)
        with httpx.Client(base_url=stack.http_url, timeout=600) as client:
            for i in range(prompts):
                reply = client.post("/v1/generate", json={"prompt": distinct_prompt(client, i, prompt_tokens),
                                                          "max_tokens": 1, "temperature": 0})
                reply.raise_for_status()
            pool = client.get("/health").json()["scheduler"]
        figures = {"start": start, "after": rss_mib(worker), **{k: pool[k] for k in (
            "kv_capacity_tokens", "kv_free_tokens", "kv_cached_tokens", "kv_used_tokens")}}
        print(f"{label:28s} RSS {figures['start']:6.0f} -> {figures['after']:6.0f} MiB; pool "
              f"{pool['kv_capacity_tokens']:,} tokens: free {pool['kv_free_tokens']:,}, "
              f"cached {pool['kv_cached_tokens']:,}, used {pool['kv_used_tokens']:,}", flush=True)
        return figures
    finally:
        stack.down()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    args = parser.parse_args()
    print(f"{args.prompts} prompts of ~{args.prompt_tokens} tokens each, one at a time, CPU", flush=True)
    base = measure("baseline (RAM-sized pool)", args.prompts, args.prompt_tokens,
                   TILLER_DEVICE="cpu", TILLER_LIMITS__KV_CPU_MAX_BYTES=UNCAPPED)
    capped = measure("default (kv_cpu_max_bytes)", args.prompts, args.prompt_tokens, TILLER_DEVICE="cpu")
    print(f"growth: baseline {base['after'] - base['start']:.0f} MiB, default {capped['after'] - capped['start']:.0f} MiB")


if __name__ == "__main__":
    main()
