"""Fair controller time: per-user CPU buckets and the cap on live controlled requests."""

from __future__ import annotations

import time

import pytest

from common import aici_wire
from common.config import Controllers
from common.errors import RATE_LIMITED
from common.wire import Principal
from services.controller_runtime.budget import CpuShare, UserBudgets
from services.controller_runtime.runtime import CallLedger, OverBudget, Runtime
from tests.controller_runtime.conftest import wire_runtime
from tests.controller_runtime.wat import controller


def test_a_bucket_refills_at_the_share_up_to_the_burst():
    b = UserBudgets(share=0.5, burst_s=2.0, max_live=8)
    b.charge("mallory", 2.5, now=0.0)
    assert "used up their controller CPU time" in b.exhausted("mallory", 0.0)
    assert "retry in 1.0 s" in b.exhausted("mallory", 0.0)
    assert b.exhausted("alice", 0.0) == ""  # another user's bucket is their own
    assert b.exhausted("mallory", 1.1) == ""  # refilled past zero
    b.charge("alice", 0.1, now=0.0)
    b.charge("alice", 0.0, now=100.0)
    assert b.credit_s("alice", 100.0) == 2.0  # never above the burst


def test_the_cap_on_live_requests_and_a_share_of_zero_limits_nothing():
    b = UserBudgets(share=0.0, burst_s=1.0, max_live=2)
    b.charge("u", 50.0, now=0.0)
    assert b.exhausted("u", 0.0) == ""
    b.started("u", 0.0)
    b.started("u", 0.0)
    assert "already has 2 controlled requests running" in b.refusal("u", 0.0)
    b.ended("u", 1.0)
    assert b.refusal("u", 1.0) == ""


class OnTheCpu(CpuShare):
    """A main-channel call that spent ``share`` of its wall time on the CPU."""

    def __init__(self, share: float) -> None:
        super().__init__()
        self._share = share

    def share(self) -> float:
        return self._share


def test_a_call_ledger_refuses_a_user_once_their_credit_is_spent_and_charges_them_at_its_end():
    b = UserBudgets(share=1e-6, burst_s=1.0, max_live=8)
    ledger = CallLedger(b, OnTheCpu(1.0))
    assert ledger.allows("mallory") and ledger.allows("alice")
    ledger.spend("mallory", time.perf_counter() - 0.6)  # two callbacks that ran 0.6 s each
    assert ledger.allows("mallory")  # 0.6 of 1.0 spent
    assert b.credit_s("mallory", time.monotonic()) == pytest.approx(1.0, abs=1e-3)  # not charged yet
    ledger.spend("mallory", time.perf_counter() - 0.6)
    assert not ledger.allows("mallory")
    assert "used up their controller CPU time" in ledger.refusal("mallory")
    assert b.credit_s("mallory", time.monotonic()) == pytest.approx(-0.2, abs=1e-2)  # charged when refused
    assert not ledger.allows("mallory") and ledger.refusal("mallory")
    assert ledger.spend("alice", time.perf_counter() - 0.1) >= 100_000 and ledger.allows("alice")
    ledger.settle()
    assert b.credit_s("alice", time.monotonic()) == pytest.approx(0.9, abs=1e-2)
    assert b.credit_s("mallory", time.monotonic()) == pytest.approx(-0.2, abs=1e-2)  # charged once


def test_a_call_ledger_charges_the_share_of_its_time_the_runtime_was_on_the_cpu():
    """A busy host that held the runtime off the CPU for three quarters of a call costs its users nothing."""
    b = UserBudgets(share=1e-6, burst_s=1.0, max_live=8)
    ledger = CallLedger(b, OnTheCpu(0.25))
    assert ledger.spend("alice", time.perf_counter() - 0.4) >= 400_000  # the wall time, as the reply reports it
    ledger.settle()
    assert b.credit_s("alice", time.monotonic()) == pytest.approx(0.9, abs=1e-2)


def test_cpu_share_is_cpu_time_over_wall_time():
    idle = CpuShare()
    time.sleep(0.2)
    assert idle.share() < 0.2 and idle.cpu_s() < 0.04
    busy = CpuShare()
    end = time.thread_time() + 0.1
    while time.thread_time() < end:
        pass
    assert busy.cpu_s() >= 0.1 and busy.share() > idle.share()


@pytest.fixture
def strict(tmp_path, engine, tokenizer) -> Runtime:
    limits = Controllers(max_memory_bytes=4 << 20, mid_deadline_ms=50.0, user_cpu_share=1e-6, user_cpu_burst_s=1.0,
                         max_controlled_per_user=3)
    return wire_runtime(limits, tmp_path, engine, tokenizer)


def bind(runtime: Runtime, module_id: str, seq_id: int, user: str) -> None:
    ok, result = runtime.instantiate(f"r{seq_id}", [1], module_id, "", Principal(user=user))
    assert ok, result
    runtime.post_pre_process(aici_wire.PostPreProcess(pre_ops=[aici_wire.PreOp(id=seq_id, req_id=f"r{seq_id}")]))


def spin_and_fine(runtime: Runtime) -> tuple[str, str]:
    """Module ids: a controller of mallory's that loops in mid_process, a well-behaved one of alice's."""
    spin = runtime.registry.create(controller(mid="(loop $l (br $l))"), "mallory")["module_id"]
    return spin, runtime.registry.create(controller(), "alice")["module_id"]


def test_a_looping_controller_is_charged_to_its_owner_only(strict: Runtime):
    spin, fine = spin_and_fine(strict)
    bind(strict, spin, 1, "mallory")
    bind(strict, spin, 2, "mallory")
    bind(strict, fine, 3, "alice")
    now = time.monotonic()
    strict.budgets.charge("mallory", strict.budgets.credit_s("mallory", now) - 0.001, now)  # 1 ms of credit left
    data, _ = strict.mid_process(aici_wire.MidProcess(ops=[aici_wire.MidOp(id=i) for i in (1, 2, 3)]))
    assert "deadline of 50 ms exceeded" in data["seqs"]["1"]["error"]  # its overrun is charged to mallory...
    assert "used up their controller CPU time" in data["seqs"]["2"]["error"]  # ...who may not run another call
    assert data["seqs"]["3"]["error"] == ""  # alice's controller is not affected
    with pytest.raises(OverBudget, match="used up their controller CPU time") as refused:
        strict.instantiate("r9", [1], spin, "", Principal(user="mallory"))
    assert refused.value.code == RATE_LIMITED
    bind(strict, fine, 4, "alice")


def test_one_users_sequences_share_one_mid_process_deadline_per_step(strict: Runtime):
    spin, fine = spin_and_fine(strict)
    bind(strict, spin, 1, "mallory")
    bind(strict, fine, 2, "alice")
    bind(strict, spin, 3, "mallory")
    data, _ = strict.mid_process(aici_wire.MidProcess(ops=[aici_wire.MidOp(id=i) for i in (1, 2, 3)]))
    assert "deadline of 50 ms exceeded" in data["seqs"]["1"]["error"]
    assert data["seqs"]["2"]["error"] == ""  # alice's deadline is her own
    # mallory's second looping sequence does not hold the step up by another whole deadline
    assert f"deadline of {strict.settings.pre_deadline_ms:g} ms exceeded" in data["seqs"]["3"]["error"]


def test_live_controlled_requests_per_user_are_capped(strict: Runtime):
    fine = strict.registry.create(controller(), "alice")["module_id"]
    for seq_id in (1, 2, 3):
        bind(strict, fine, seq_id, "alice")
    with pytest.raises(OverBudget, match="already has 3 controlled requests running") as refused:
        strict.instantiate("r4", [1], fine, "", Principal(user="alice"))
    assert refused.value.code == RATE_LIMITED  # a 429 to the client, not a 400
    strict.free([2])
    bind(strict, fine, 4, "alice")


@pytest.mark.parametrize("mid, pre, tick", [(50.0, 10.0, 1.0), (7.5, 20.0, 2.0), (10.0, 9.5, 3.0), (4.0, 1.0, 0.3)])
def test_a_users_mid_deadline_is_the_whole_one_exactly_while_they_used_less_than_the_slack(tmp_path, engine, tokenizer,
                                                                                          mid, pre, tick):
    runtime = wire_runtime(Controllers(mid_deadline_ms=mid, pre_deadline_ms=pre, epoch_tick_ms=tick), tmp_path, engine,
                           tokenizer)
    for used in [i * 0.01 for i in range(int(mid * 120))]:
        exact = runtime._mid_deadline_ms(used)
        assert (runtime._mid_full_ms if used < runtime._mid_slack_ms else exact) == exact, used
