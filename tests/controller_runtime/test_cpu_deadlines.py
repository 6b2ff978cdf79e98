"""Deadlines count the controller's CPU time: a busy host that holds the runtime off the CPU fails no controller
and spends no user's budget; a controller that computes past its deadline still fails.

The runtime is starved for real: the call runs on a thread at nice 15 pinned to one core, beside a process that
spins on that core (about 3 % of it for the call).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import wasmtime

from common.config import Controllers
from controllers.native.base import NativeController
from services.controller_runtime.runtime import Runtime
from services.controller_runtime.wasm import Ticker
from tests.controller_runtime.conftest import mid, start, wire_runtime
from tests.controller_runtime.wat import MID_SAMPLE, controller, ret_const

DEADLINE_MS = 100.0
LIMITS = Controllers(max_memory_bytes=4 << 20, mid_deadline_ms=DEADLINE_MS, user_cpu_share=1e-6, user_cpu_burst_s=10.0)
CORE = min(os.sched_getaffinity(0))


@pytest.fixture
def runtime(tmp_path, engine, tokenizer) -> Runtime:
    return wire_runtime(LIMITS, tmp_path, engine, tokenizer)


@pytest.fixture
def busy_core() -> Iterator[None]:
    spinner = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{CORE}}})\nwhile True: pass"])
    time.sleep(0.2)
    yield
    spinner.kill()
    spinner.wait()


def starved(call: Callable[[], Any]) -> tuple[Any, float]:
    """``call``'s result and wall seconds, run on a low-priority thread sharing :data:`CORE` with the spinner."""
    out: list = []

    def run() -> None:
        os.sched_setaffinity(0, {CORE})  # this thread only
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 15)
        began = time.perf_counter()
        out.append(call())
        out.append(time.perf_counter() - began)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return out[0], out[1]


def counting(iterations: int) -> bytes:
    """A controller whose mid_process counts to ``iterations`` before it samples."""
    return controller(extra="(func $count (param $n i32) (loop $l (br_if $l (i32.ne (local.tee $n (i32.sub "
                             "(local.get $n) (i32.const 1))) (i32.const 0)))))",
                      mid=f"(call $count (i32.const {iterations})) (call $ret_bias (i32.const 4096)) "
                          + ret_const(1300, MID_SAMPLE))


def iterations_per_ms(runtime: Runtime) -> float:
    start(runtime, counting(10_000_000), 90)
    began = time.thread_time()
    data, _ = mid(runtime, (90, None))
    assert data["seqs"]["90"]["error"] == "", data
    runtime.free([90])
    return 10_000_000 / ((time.thread_time() - began) * 1000)


def test_a_wasm_controller_held_off_the_cpu_keeps_its_deadline(runtime, busy_core):
    per_ms = iterations_per_ms(runtime)
    start(runtime, counting(int(per_ms * DEADLINE_MS / 4)), 1)  # a quarter of the deadline's computing
    (data, _), wall_s = starved(lambda: mid(runtime, (1, None)))
    assert wall_s * 1000 > 2 * DEADLINE_MS, "the busy core did not hold the call off the CPU"
    assert data["seqs"]["1"]["error"] == ""
    start(runtime, controller(mid="(loop $l (br $l))"), 2)
    (data, _), wall_s = starved(lambda: mid(runtime, (2, None)))
    assert f"deadline of {DEADLINE_MS:g} ms exceeded" in data["seqs"]["2"]["error"]


class Waits(NativeController):
    """A native controller whose mid_process takes twice the mid deadline off the CPU (``wait``: as when a busy
    host holds the runtime off it) or computing (``spin``)."""

    def mid_process(self, fork_group: list[int]) -> object:
        seconds = 2 * DEADLINE_MS / 1000
        if self.module_arg == b"wait":
            time.sleep(seconds)
        else:
            end = time.thread_time() + seconds
            while time.thread_time() < end:
                pass
        self.host.return_logit_bias(b"\xff" * (4 * ((self.host.vocab_size + 31) // 32)))
        return {"SampleWithBias": {}}


def test_a_native_deadline_counts_the_controllers_cpu_time_and_so_do_the_charges(runtime):
    runtime.natives["waits"] = Waits
    start(runtime, "native:waits", 1, arg="wait")
    start(runtime, "native:waits", 2, arg="spin")
    credit = runtime.budgets.credit_s("local", time.monotonic())
    data, _ = mid(runtime, (1, None))
    assert data["seqs"]["1"]["error"] == "" and data["seqs"]["1"]["micros"] >= 2000 * DEADLINE_MS  # wall, reported
    assert runtime.budgets.credit_s("local", time.monotonic()) > credit - DEADLINE_MS / 1000 / 2  # hardly charged
    data, _ = mid(runtime, (2, None))
    assert f"mid_process: deadline of {DEADLINE_MS:g} ms exceeded" in data["seqs"]["2"]["error"]
    assert "ms of CPU" in data["seqs"]["2"]["error"]
    assert runtime.budgets.credit_s("local", time.monotonic()) < credit - 2 * DEADLINE_MS / 1000 * 0.9


@pytest.mark.parametrize("share, counted", [(1.0, 100), (0.4, 41), (0.0, 2)])
def test_the_ticker_counts_the_cpu_time_a_long_call_had(monkeypatch, share, counted):
    """A thread on the CPU ``share`` of the time, in 100 ticks of one long call: its CPU time accrues across
    ticks (the first two ticks count as on the wall clock)."""
    ticker = Ticker(wasmtime.Engine(), period=0.001)  # asleep: nothing calls it but this test
    cpu = [0.0]
    monkeypatch.setattr(time, "pthread_getcpuclockid", lambda thread: 99)
    monkeypatch.setattr(time, "clock_gettime", lambda clock: cpu[0])
    ticker.running[12345] = object()  # one controller's call, running throughout
    ticks = 0
    for _ in range(100):
        ticks += ticker._computed()
        cpu[0] += share * 0.001
    assert ticks == counted
    ticker.running[12345] = None
    assert ticker._computed() and 12345 not in ticker._seen
