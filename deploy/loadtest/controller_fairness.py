"""Fair controller time: 4 plain streams' tokens/s alone, then beside 12 looping controllers, in one run.

The looping controllers belong to one user (``x-user-id: mallory``): each of 12 clients submits a
``/v1/run`` whose controller spins in ``mid_process`` until its deadline, and submits again as soon as
it ends, for as long as the plain streams run. The plain streams (another user) are OpenAI completions
of ``--tokens`` greedy tokens each. Printed: both aggregate rates, their ratio, and what became of the
looping requests (ended at their deadline, refused by the user's CPU budget or live-request cap).

    python deploy/loadtest/controller_fairness.py            # starts a stack with the TILLER_* environment
    python deploy/loadtest/controller_fairness.py --url http://127.0.0.1:8080
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

PROMPTS = ["The history of the lighthouse", "A recipe for bread", "The rules of chess", "How rivers form"]
LOOPERS = 12
ABUSER = {"x-user-id": "mallory"}


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
        else:
            outcomes["other"] += 1


async def bench(url: str, tokens: int) -> None:
    from common.config import get_settings
    from tests.controller_runtime.wat import controller

    settings = get_settings()
    model = settings.served_model_name
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(900.0)) as http:
        r = await http.post("/v1/controllers", content=controller(mid="(loop $l (br $l))"),
                            headers={**ABUSER, "content-type": "application/wasm"})
        r.raise_for_status()
        module_id = r.json()["module_id"]
        await plain_streams(http, model, 8)  # warm-up
        alone = await plain_streams(http, model, tokens)
        stop, outcomes = asyncio.Event(), Counter()
        loopers = [asyncio.create_task(looper(http, module_id, stop, outcomes)) for _ in range(LOOPERS)]
        await asyncio.sleep(1.0)  # the looping controllers are running
        beside = await plain_streams(http, model, tokens)
        stop.set()
        await asyncio.gather(*loopers)
    c = settings.controllers
    print(f"model {settings.model}, 4 plain streams x {tokens} greedy tokens; {LOOPERS} looping controllers of one user "
          f"(user_cpu_share {c.user_cpu_share:g} s/s, burst {c.user_cpu_burst_s:g} s, "
          f"max_controlled_per_user {c.max_controlled_per_user}, mid deadline {c.mid_deadline_ms:g} ms)")
    print(f"plain streams alone:                 {alone:8.1f} tok/s")
    print(f"plain streams beside the loopers:    {beside:8.1f} tok/s")
    print(f"ratio (beside / alone):              {beside / alone:8.2f}  ({(1 - beside / alone) * 100:+.0f}% slower)")
    print("looping requests: " + ", ".join(f"{n} {what}" for what, n in outcomes.most_common()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128, help="tokens per plain stream")
    parser.add_argument("--url", help="a running gateway's HTTP URL; default: start a stack")
    args = parser.parse_args()
    stack = None
    url = args.url
    if url is None:
        from tests.stack import start_stack

        configured = {k: v for k, v in os.environ.items() if k.startswith("TILLER_")}
        stack = start_stack(Path(tempfile.mkdtemp(prefix="tiller-fairness-")), **configured)
        url = stack.http_url
    try:
        asyncio.run(bench(url, args.tokens))
    finally:
        if stack is not None:
            stack.down()


if __name__ == "__main__":
    main()
