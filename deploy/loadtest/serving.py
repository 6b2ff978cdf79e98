"""What the serving benchmarks share: one OpenAI streaming client per stream, and process memory.

Memory is read from ``/proc`` (Linux): RSS as the issue's tables count it (shared libraries in every
process that maps them) and PSS (each shared page split between the processes mapping it), whose
sum over a stack is what the stack really holds.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from pathlib import Path

import openai

from bench_stack import StreamStats, percentile


async def openai_stream(client: openai.AsyncOpenAI, model: str, prompt: str, tokens: int) -> StreamStats:
    """One streaming completion of exactly ``tokens`` greedy tokens (``ignore_eos``), timed per chunk."""
    stats = StreamStats()
    start = time.perf_counter()
    last = None
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.usage is not None:
            stats.tokens = chunk.usage.completion_tokens
        if not chunk.choices or not chunk.choices[0].text:
            continue
        if last is None:
            stats.ttft_s = now - start
        else:
            stats.gaps_s.append(now - last)
        last = now
    stats.total_s = time.perf_counter() - start
    if not stats.tokens:  # a server without usage in its stream: one chunk per token
        stats.tokens = len(stats.gaps_s) + 1
    return stats


@dataclass
class Level:
    """``streams`` concurrent streams: aggregate tokens/s and latency percentiles in ms."""

    streams: int
    tok_s: float
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float


async def level(base_url: str, model: str, prompt: str, tokens: int, streams: int) -> Level:
    """Run ``streams`` clients at once, each with its own connection."""
    clients = [openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
               for _ in range(streams)]
    try:
        start = time.perf_counter()
        results = await asyncio.gather(*(openai_stream(c, model, prompt, tokens) for c in clients))
        elapsed = time.perf_counter() - start
    finally:
        await asyncio.gather(*(c.close() for c in clients))
    ttft = [r.ttft_s * 1000 for r in results]
    gaps = [g * 1000 for r in results for g in r.gaps_s]
    return Level(streams, sum(r.tokens for r in results) / elapsed, percentile(ttft, 0.5), percentile(ttft, 0.99),
                 percentile(gaps, 0.5), percentile(gaps, 0.99))


@dataclass(frozen=True)
class Memory:
    rss_mb: float
    pss_mb: float

    def __add__(self, other: Memory) -> Memory:
        return Memory(self.rss_mb + other.rss_mb, self.pss_mb + other.pss_mb)


def memory(pid: int) -> Memory:
    """RSS and PSS of one process, in MB."""
    def kb(path: str, key: str) -> int:
        for line in Path(f"/proc/{pid}/{path}").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
        return 0

    return Memory(kb("status", "VmRSS") / 1024, kb("smaps_rollup", "Pss") / 1024)


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has taken since it started, threads that ended
    included (``/proc/<pid>/stat``, in clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
