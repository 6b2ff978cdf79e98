"""Controller benchmark through the whole stack (gateway -> scheduler -> worker + controller runtime), in one run:

1. Controller overhead per step, in µs per sequence, at 1, 16 and 64 concurrent controlled sequences: the same
   prompts run as plain greedy requests (``/v1/generate``, ignore_eos) and under the shipped ``declctrl``
   controller with one unconstrained ``Gen`` step (``/v1/run``), each sequence producing the same number of
   tokens; overhead = (wall time per step controlled - plain) / sequences. Also what the runtime itself
   reports spending (the ``micros`` of the run events) per sequence per step.
2. JSON-schema-constrained generation (the shipped ``constrain`` controller; with ``--fast-forward on`` it splices
   the tokens the schema forces instead of sampling them, ``both`` runs an arm each way) against unconstrained generation
   of the same prompts and the same token counts, in ``--rounds`` rounds (the arms' order turning each
   round): aggregate tokens/s and their ratio per round, and per arm the medians of time to first token, time
   per streamed step after it (a step's token, or a splice's), the streamed steps of a round, time from the last token to the end of the stream (a constrained request that the grammar
   ends gets its end after its last token), how many of the machine's cores were busy (on a saturated machine
   tokens/s follow the CPU time per token), and each service process's CPU time per token (the figure a shared
   machine spoils least).
   Requests start together but not in step, so per-token times compare only at equal batch sizes: the ratio of
   aggregate tokens/s is the figure to judge.

Starts its own stack serving the default weights (the caller's TILLER_* settings win) unless ``--url`` names a running
gateway (then without the CPU figures).

    python deploy/loadtest/controller_bench.py [--tokens 32] [--levels 1,16,64] [--json 16 --rounds 3]
                                               [--fast-forward off|on|both]
                                               [--url http://127.0.0.1:8080 --scheduler ipc://run/scheduler.sock]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgspec

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench_stack import CpuPerToken, describe_cpu  # noqa: E402
from common.supervisor import SERVICES  # noqa: E402
from services.worker.threads import read_cpu_sample  # noqa: E402  (/proc/stat: the machine's busy CPU time)

CORES = os.sched_getaffinity(0)

TOPICS = ["a lighthouse", "a dragon", "the sea", "a robot", "a city", "a garden", "winter", "a train", "a violin",
          "the moon", "a library", "a storm"]
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "characters": {"type": "array", "items": {"type": "string"}},
        "story": {"type": "string"},
    },
    "required": ["title", "characters", "story"],
}


def prompts(n: int) -> list[str]:
    """Story openings the model continues (an instruction-style prompt makes it emit EOS at once)."""
    return [f"Once upon a time, in a land far away, there was {TOPICS[i % len(TOPICS)]} ({i}). Every day, it"
            for i in range(n)]


class SchedulerStats:
    """The scheduler's own main-channel figures (health ``controller_steps``), when its socket is reachable."""

    def __init__(self, endpoint: str | None) -> None:
        self.endpoint = endpoint

    async def read(self) -> dict[str, float] | None:
        if self.endpoint is None:
            return None
        from common.sockets import probe_health

        reply = await probe_health(self.endpoint, timeout=10.0)
        return msgspec.to_builtins(reply.facts.controller_steps) if reply is not None and reply.facts else None

    @staticmethod
    def describe(before: dict[str, float] | None, after: dict[str, float] | None) -> str:
        if not before or not after or after["seq_steps"] == before["seq_steps"]:
            return ""
        per_seq = (after["main_s"] - before["main_s"]) / (after["seq_steps"] - before["seq_steps"]) * 1e6
        followed = after.get("followed_steps", 0) - before.get("followed_steps", 0)
        return (f"; {per_seq:6.1f} µs in main-channel calls as the scheduler sees them, {followed} steps sent before "
                "the result of the one before them")


@dataclass
class Outcome:
    tokens: int  # tokens the sequence generated (sampled + fast-forwarded)
    micros: int = 0  # time its controller reported
    decode_s: float = 0.0  # from its first streamed token to its last event: steady decoding, no admission/prefill
    streamed: int = 0  # events that brought tokens: a step's sampled token, or a splice's (fast forward)
    ttft_s: float = 0.0  # from sending the request to its first streamed token: admission, start, prefill
    end_s: float = 0.0  # from its last streamed token to the end of its stream (a controller's stop comes after it)
    ff: int = 0  # of its tokens, those its controller spliced in (a grammar's forced tokens) rather than sampled

    @property
    def decode_steps(self) -> int:
        """The events in ``decode_s``."""
        return max(self.streamed - 1, 1)


async def plain(http: httpx.AsyncClient, prompt: str, tokens: int) -> Outcome:
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    sent = time.perf_counter()
    first = last = 0.0
    steps, usage = 0, {}
    async with http.stream("POST", "/v1/generate", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            message = json.loads(line[len("data: "):])
            if message["type"] in ("token", "completion"):
                last = time.perf_counter()
                first = first or last
                steps += message["type"] == "token"
                usage = message.get("usage", usage)
    return Outcome(usage["completion_tokens"], decode_s=last - first, streamed=steps, ttft_s=first - sent,
                   end_s=time.perf_counter() - last)


async def controlled(http: httpx.AsyncClient, module: str, arg: object, prompt: str, tokens: int) -> Outcome:
    body = {"controller": module, "controller_arg": arg, "prompt": prompt, "max_tokens": tokens}
    sent = time.perf_counter()
    async with http.stream("POST", "/v1/run", json=body) as response:
        response.raise_for_status()
        micros, usage, first, last, steps = 0, {}, 0.0, 0.0, 0
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: "):])
            if event["object"] != "run":
                continue
            had = usage.get("sampled_tokens", 0) + usage.get("ff_tokens", 0)
            usage = event["usage"]
            if usage["sampled_tokens"] + usage["ff_tokens"] > had:  # tokens (not only a fork's end or logs)
                last = time.perf_counter()
                first = first or last
                steps += 1
            for fork in event["forks"]:
                micros += fork["micros"]
                if fork["error"]:
                    raise RuntimeError(f"controller failed: {fork['error']}")
    return Outcome(usage["sampled_tokens"] + usage["ff_tokens"], micros, last - first, steps, first - sent,
                   time.perf_counter() - last, usage["ff_tokens"])


@dataclass
class Setup:
    http: httpx.AsyncClient
    sched: SchedulerStats
    cpu: CpuPerToken  # the stack's service processes (none with --url)
    repeat: int  # each overhead batch runs this many times; the fastest counts (the machine may be shared)


@dataclass
class Timing:
    wall_s: float  # the whole batch, admission and prefill included
    step_s: float  # median over its sequences of the time per step while decoding


async def timed(calls: list) -> tuple[Timing, list[Outcome]]:
    started = time.perf_counter()
    results = await asyncio.gather(*calls)
    step = statistics.median(o.decode_s / o.decode_steps for o in results)
    return Timing(time.perf_counter() - started, step), results


def faster(a: Timing, b: Timing) -> Timing:
    return Timing(min(a.wall_s, b.wall_s), min(a.step_s, b.step_s))


async def compare(setup: Setup, controlled_calls, plain_calls) -> tuple[Timing, Timing, list[Outcome]]:
    """Timings of the controlled and the plain batch (the fastest of ``setup.repeat`` runs of each, the two
    alternating so a busy spell on a shared machine hits both), and the controlled outcomes. ``plain_calls``
    gets the token counts the controlled sequences produced."""
    ctrl_t, ctrl = await timed(controlled_calls())
    counts = [o.tokens for o in ctrl]
    plain_t = (await timed(plain_calls(counts)))[0]
    for _ in range(setup.repeat - 1):
        ctrl_t = faster(ctrl_t, (await timed(controlled_calls()))[0])
        plain_t = faster(plain_t, (await timed(plain_calls(counts)))[0])
    return ctrl_t, plain_t, ctrl


async def upload(http: httpx.AsyncClient, name: str) -> str:
    response = await http.post("/v1/controllers", content=(ROOT / "controllers" / "wasm" / f"{name}.wasm").read_bytes())
    response.raise_for_status()
    return response.json()["module_id"]


async def overhead(setup: Setup, declctrl: str, level: int, tokens: int) -> str:
    http, sched = setup.http, setup.sched
    texts = prompts(level)
    gen = {"steps": [{"Gen": {"max_tokens": tokens}}]}
    before = await sched.read()
    # declctrl may end a Gen early on EOS: the plain requests replay exactly the controlled token counts
    ctrl_t, plain_t, ctrl = await compare(
        setup,
        lambda: [controlled(http, declctrl, gen, p, tokens) for p in texts],
        lambda counts: [plain(http, p, n) for p, n in zip(texts, counts)],
    )
    seen = SchedulerStats.describe(before, await sched.read())
    per_seq_us = (ctrl_t.step_s - plain_t.step_s) / level * 1e6
    runtime_us = sum(o.micros for o in ctrl) / sum(o.tokens for o in ctrl)
    return (f"{level:3d} sequences: decode step {plain_t.step_s * 1e3:7.2f} ms plain, {ctrl_t.step_s * 1e3:7.2f} ms "
            f"controlled -> overhead {per_seq_us:8.1f} µs per sequence per step end to end; "
            f"{runtime_us:6.1f} µs in the runtime{seen}")


@dataclass
class Arm:
    """One batch of one arm of the JSON comparison: its wall time, CPU per token and its requests."""

    wall_s: float
    cpu: dict[str, float]  # CPU seconds per token of each service process
    outcomes: list[Outcome]
    busy_cores: float  # the machine's CPU time over the batch (everything on it) / wall time

    @property
    def tokens(self) -> int:
        return sum(o.tokens for o in self.outcomes)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s


async def arm(calls: list, cpu: CpuPerToken) -> Arm:
    cpu.start()
    machine = read_cpu_sample(CORES)
    started = time.perf_counter()
    outcomes = await asyncio.gather(*calls)
    wall = time.perf_counter() - started
    busy = read_cpu_sample(CORES).busy_s - machine.busy_s
    return Arm(wall, cpu.stop(sum(o.tokens for o in outcomes)) if cpu.pids else {}, outcomes, busy / wall)


def describe_arm(label: str, arms: list[Arm]) -> str:
    """The medians over rounds of where one arm's time went, per request and per token."""
    med = statistics.median
    ttft = med(med(o.ttft_s for o in a.outcomes) for a in arms)
    per_token = med(med(o.decode_s / o.decode_steps for o in a.outcomes) for a in arms)
    end = med(med(o.end_s for o in a.outcomes) for a in arms)
    line = (f"  {label:14s} median of rounds: {med(a.tok_s for a in arms):7.1f} tok/s, wall {med(a.wall_s for a in arms):5.2f} s, "
            f"TTFT p50 {ttft * 1e3:6.1f} ms, {per_token * 1e3:6.1f} ms per streamed step after the first, "
            f"{med(sum(o.streamed for o in a.outcomes) for a in arms):.0f} streamed steps a round, "
            f"last token to end p50 {end * 1e3:5.1f} ms")
    line += f", machine busy {med(a.busy_cores for a in arms):4.2f} of {len(CORES)} cores"
    if arms[0].cpu:
        cpu = {name: med(a.cpu[name] for a in arms) for name in arms[0].cpu}
        line += "\n" + describe_cpu(cpu)
    return line


async def constrained_ratio(setup: Setup, constrain: str, n: int, tokens: int, rounds: int,
                            fast_forward: list[bool]) -> list[str]:
    """Constrained and unconstrained batches of the same prompts, alternated (the order turning every round);
    the plain requests generate exactly the token counts the first constrained arm did (ignore_eos). One
    constrained arm per ``fast_forward`` value: with it the grammar's forced tokens are spliced in rather than
    sampled (constrain's option)."""
    http = setup.http
    texts = [p + " Answer as JSON." for p in prompts(n)]

    def ctrl_calls(ff: bool) -> list:
        return [controlled(http, constrain, {"json_schema": SCHEMA, "fast_forward": ff}, p, tokens) for p in texts]

    # greedy, so each round's counts are these (batched near-ties aside: the rounds print their totals)
    spliced = {ff: (await arm(ctrl_calls(ff), CpuPerToken({}))).outcomes for ff in fast_forward}
    counts = [o.tokens for o in spliced[fast_forward[0]]]
    labels = {None: "unconstrained", False: "constrained", True: "constrained+ff"}
    calls = {None: lambda: [plain(http, p, c) for p, c in zip(texts, counts)], **{
        ff: (lambda ff=ff: ctrl_calls(ff)) for ff in fast_forward}}
    order = [*fast_forward, None]
    arms: dict[bool | None, list[Arm]] = {key: [] for key in order}
    lines = []
    for r in range(rounds):
        before = await setup.sched.read()
        for key in order[r % len(order):] + order[: r % len(order)]:
            arms[key].append(await arm(calls[key](), setup.cpu))
        p = arms[None][-1]
        lines.append(f"  round {r + 1}: " + ", ".join(
            f"{labels[ff]} {arms[ff][-1].tok_s:6.1f} tok/s ({arms[ff][-1].tokens} tokens)" for ff in fast_forward)
            + f", unconstrained {p.tok_s:6.1f} tok/s ({p.tokens})"
            + "".join(f" -> {arms[ff][-1].tok_s / p.tok_s:5.2f}x" for ff in fast_forward)
            + SchedulerStats.describe(before, await setup.sched.read()))
    ratios = ", ".join(f"{labels[ff]} {statistics.median(c.tok_s / p.tok_s for c, p in zip(arms[ff], arms[None])):5.2f}x"
                       for ff in fast_forward)
    forced = ""
    if True in spliced:
        ff_arm = spliced[True]
        forced = f", {sum(o.ff for o in ff_arm)} of {sum(o.tokens for o in ff_arm)} with fast_forward spliced in"
    head = (f"JSON schema, {n} concurrent, {sum(counts)} tokens ({min(counts)}-{max(counts)} a request{forced}), "
            f"{rounds} rounds, the arms' order turning: tokens/s against unconstrained, median ratio {ratios}")
    return [head, *lines, *(describe_arm(labels[key], arms[key]) for key in order)]


async def bench(url: str, setup_args: tuple[SchedulerStats, CpuPerToken], levels: list[int], json_n: int,
                tokens: int, repeat: int, rounds: int, fast_forward: list[bool]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0)) as http:
        declctrl, constrain = await upload(http, "declctrl"), await upload(http, "constrain")
        setup = Setup(http, *setup_args, repeat=1)
        if levels:
            await overhead(setup, declctrl, 2, 4)  # warm-up: compile caches, first steps
        await constrained_ratio(setup, constrain, 2, 8, 1, fast_forward)
        setup.repeat = repeat
        lines = [await overhead(setup, declctrl, level, tokens) for level in levels]
        if json_n:
            lines += await constrained_ratio(setup, constrain, json_n, tokens, rounds, fast_forward)
    for line in lines:
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--levels", default="1,16,64", help="concurrent controlled sequences ('': none)")
    parser.add_argument("--json", type=int, default=16, help="concurrent JSON-schema requests (0: none)")
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds of the JSON comparison")
    parser.add_argument("--fast-forward", choices=["off", "on", "both"], default="off",
                        help="constrain splices the tokens the schema forces instead of sampling them (both: one "
                             "constrained arm each way)")
    parser.add_argument("--url", help="a running gateway's HTTP URL; default: start a stack")
    parser.add_argument("--scheduler", help="with --url: the scheduler's endpoint, for its own figures")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each overhead batch; the fastest counts")
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",") if x]
    stack = None
    url, scheduler, cpu = args.url, args.scheduler, CpuPerToken({})
    if url is None:
        from tests.stack import served_settings, start_stack

        stack = start_stack(Path(tempfile.mkdtemp(prefix="tiller-ctrl-bench-")), **served_settings())
        url, scheduler = stack.http_url, stack.settings.endpoint("scheduler")
        cpu = CpuPerToken({name: stack.pid(name) for name in SERVICES})
    try:
        from common.config import get_settings

        settings = stack.settings if stack is not None else get_settings()
        print(f"model {settings.model} ({settings.weights} weights) on {settings.device}, {args.tokens} tokens per "
              f"sequence, greedy; load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
        asyncio.run(bench(url, (SchedulerStats(scheduler), cpu), levels, args.json, args.tokens, args.repeat,
                          args.rounds, {"off": [False], "on": [True], "both": [False, True]}[args.fast_forward]))
        print(f"load average at the end {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    finally:
        if stack is not None:
            stack.down()


if __name__ == "__main__":
    main()
