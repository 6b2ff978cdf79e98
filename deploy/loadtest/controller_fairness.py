"""Fair controller time: 4 plain streams' tokens/s alone, then beside 12 looping controllers, in one run.

The looping controllers belong to one user (``x-user-id: mallory``): each of 12 clients submits a
``/v1/run`` whose controller spins in ``mid_process`` until its deadline, and submits again as soon as
it ends, for as long as the plain streams run. The plain streams (another user) are OpenAI completions
of ``--tokens`` greedy tokens each. Printed: both aggregate rates, their ratio, and what became of the
looping requests (ended at their deadline, refused by the user's CPU budget or live-request cap), and
where the time went in each phase: every service's CPU seconds (when this script started the stack) and
the scheduler's main-channel wall time (post_pre_process/mid_process calls, which hold up the steps
that share a forward pass with controlled sequences).

    python deploy/loadtest/controller_fairness.py            # starts a stack serving the default weights (TILLER_* settings win)
    python deploy/loadtest/controller_fairness.py --url http://127.0.0.1:8080
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

PROMPTS = ["The history of the lighthouse", "A recipe for bread", "The rules of chess", "How rivers form"]
LOOPERS = 12
ABUSER = {"x-user-id": "mallory"}
SERVICES = ("gateway", "scheduler", "worker", "controller_runtime", "session_store")
TICKS = os.sysconf("SC_CLK_TCK")


class Phases:
    """CPU seconds of the stack's processes and the scheduler's main-channel wall time, per phase."""

    def __init__(self, pids: dict[str, int], scheduler_endpoint: str) -> None:
        self.pids = pids
        self.endpoint = scheduler_endpoint
        self.rows: list[tuple[str, float, dict[str, float], float]] = []

    def _cpu(self) -> dict[str, float]:
        out = {}
        for name, pid in self.pids.items():
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            out[name] = (int(fields[11]) + int(fields[12])) / TICKS
        return out

    async def _main_s(self) -> float:
        from common.sockets import probe_health

        reply = await probe_health(self.endpoint, timeout=5.0)
        return reply.facts.controller_steps.main_s if reply is not None and reply.facts else float("nan")

    async def measure(self, name: str, run: Callable[[], Awaitable[float]]) -> float:
        cpu, main_s, started = self._cpu(), await self._main_s(), time.perf_counter()
        result = await run()
        wall = time.perf_counter() - started
        after, main_after = self._cpu(), await self._main_s()
        self.rows.append((name, wall, {k: after[k] - cpu[k] for k in cpu}, main_after - main_s))
        return result

    def print(self) -> None:
        print(f"{'phase':<8} {'wall s':>7} " + " ".join(f"{n[:10]:>10}" for n in self.pids) + "  main-channel s")
        for name, wall, cpu, main_s in self.rows:
            print(f"{name:<8} {wall:7.1f} " + " ".join(f"{cpu[n]:10.1f}" for n in self.pids) + f"  {main_s:14.1f}")
        print("(CPU seconds of each service during the phase; main-channel s: the scheduler's wall time in "
              "post_pre_process/mid_process calls)")


async def plain_streams(http: httpx.AsyncClient, model: str, tokens: int) -> float:
    """4 concurrent greedy completions; their aggregate tokens/s."""
    async def one(prompt: str) -> int:
        r = await http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": tokens,
                                                     "temperature": 0, "ignore_eos": True})
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    started = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in PROMPTS))
    return sum(counts) / (time.perf_counter() - started)


async def looper(http: httpx.AsyncClient, module_id: str, stop: asyncio.Event, outcomes: Counter[str]) -> None:
    """Submit a spinning controller again and again until ``stop``."""
    while not stop.is_set():
        r = await http.post("/v1/run", headers=ABUSER, json={"controller": module_id, "prompt": "Spin:",
                                                             "max_tokens": 64})
        text = r.text
        if r.status_code != 200:
            outcomes["budget or cap refusal" if "controller CPU time" in text or "controlled requests running" in text
                     else f"HTTP {r.status_code}"] += 1
            await asyncio.sleep(0.05)
        elif "deadline" in text:
            outcomes["ended at its deadline"] += 1
        elif "controller CPU time" in text:
            outcomes["failed by the CPU budget"] += 1
        else:  # name it by its error, if it has one
            error = re.search(r'"error":\s*"([^"]{1,60})', text)
            outcomes[f"other ({error.group(1)}...)" if error else "other"] += 1


async def bench(url: str, tokens: int, phases: Phases | None) -> None:
    from common.config import get_settings
    from tests.controller_runtime.wat import controller

    settings = get_settings()
    model = settings.served_model_name
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(900.0)) as http:
        r = await http.post("/v1/controllers", content=bytes(controller(mid="(loop $l (br $l))")),
                            headers={**ABUSER, "content-type": "application/wasm"})
        r.raise_for_status()
        module_id = r.json()["module_id"]
        await plain_streams(http, model, 8)  # warm-up

        def plain() -> Awaitable[float]:
            return plain_streams(http, model, tokens)

        alone = await (phases.measure("alone", plain) if phases else plain())
        stop, outcomes = asyncio.Event(), Counter()
        loopers = [asyncio.create_task(looper(http, module_id, stop, outcomes)) for _ in range(LOOPERS)]
        await asyncio.sleep(1.0)  # the looping controllers are running
        beside = await (phases.measure("beside", plain) if phases else plain())
        stop.set()
        await asyncio.gather(*loopers)
    c = settings.controllers
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"model {settings.model}, 4 plain streams x {tokens} greedy tokens; {LOOPERS} looping controllers of one user "
          f"(user_cpu_share {c.user_cpu_share:g} s/s, burst {c.user_cpu_burst_s:g} s, "
          f"max_controlled_per_user {c.max_controlled_per_user}, mid deadline {c.mid_deadline_ms:g} ms)")
    print(f"plain streams alone:                 {alone:8.1f} tok/s")
    print(f"plain streams beside the loopers:    {beside:8.1f} tok/s")
    print(f"ratio (beside / alone):              {beside / alone:8.2f}  ({(beside / alone - 1) * 100:+.0f}% tokens/s)")
    print("looping requests: " + ", ".join(f"{n} {what}" for what, n in outcomes.most_common()))
    if phases:
        phases.print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128, help="tokens per plain stream")
    parser.add_argument("--url", help="a running gateway's HTTP URL; default: start a stack")
    args = parser.parse_args()
    stack, phases = None, None
    url = args.url
    if url is None:
        from tests.stack import served_settings, start_stack

        stack = start_stack(Path(tempfile.mkdtemp(prefix="tiller-fairness-")), **served_settings())
        url = stack.http_url
        phases = Phases({name: stack.pid(name) for name in SERVICES}, stack.settings.endpoint("scheduler"))
    try:
        asyncio.run(bench(url, args.tokens, phases))
    finally:
        if stack is not None:
            stack.down()


if __name__ == "__main__":
    main()
