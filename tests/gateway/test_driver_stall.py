"""The generation driver against a fake scheduler that goes silent: past the request's deadline the
client gets a ``timeout`` error carrying the text so far, and a generation that ended in time leaves
no deadline behind."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from common import wire
from common.config import Settings
from services.gateway import driver
from services.gateway.deps import Gateway
from services.gateway.driver import Generation
from services.gateway.metrics import Metrics
from services.gateway.protocol import CompletionMsg, ErrorMsg, InitMsg, TokenMsg
from services.gateway.ratelimit import RateLimiter
from services.gateway.validation import GenerationRequest
from services.gateway.tenants import identify
from tests.gateway.test_admission_rules import FakeStore, FakeText

TIMEOUT_S = 0.2


class FakePrompts(FakeText):
    async def prompt(self, request: GenerationRequest) -> tuple[str, list[int]]:
        return request.prompt or "", [3, 3]


class SilentScheduler:
    """Accepts a request, then sends only the events a test queues."""

    def __init__(self, events: list[wire.TokenEvent]) -> None:
        self.events = events
        self.queues: dict[str, asyncio.Queue] = {}

    async def health(self, max_age: float = 0.0) -> wire.HealthReply:
        facts = wire.ModelFacts(worker=wire.WorkerStage(stage="ready"), vocab_size=8, max_model_len=64)
        return wire.HealthReply(service="scheduler", ready=True, facts=facts)

    def open_stream(self, rid: str) -> asyncio.Queue:
        self.queues[rid] = asyncio.Queue()
        return self.queues[rid]

    async def submit(self, submit: wire.Submit) -> None:
        for event in self.events:
            self.queues[submit.rid].put_nowait(msgspec.structs.replace(event, rid=submit.rid))

    def close_stream(self, rid: str) -> None:
        pass

    def cancel_soon(self, rid: str) -> None:
        raise AssertionError("a request that ended has nothing to cancel")


def generation(scheduler: SilentScheduler) -> Generation:
    settings = Settings(limits={"request_timeout_s": TIMEOUT_S})
    gw = Gateway(settings=settings, scheduler=scheduler, store=FakeStore(), text=FakePrompts(),
                 limiter=RateLimiter(0), metrics=Metrics(), created=0)
    request = GenerationRequest(prompt="hi", max_tokens=4)
    return Generation(gw, request, rid="gen_1", surface="websocket", client="test",
                      tenant=identify({}, settings))


async def messages(gen: Generation) -> list:
    return [msg async for msg in gen.stream()]


@pytest.fixture(autouse=True)
def no_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(driver, "STALL_GRACE_S", 0.0)


async def test_a_silent_scheduler_ends_the_request_with_timeout_and_the_text_so_far() -> None:
    scheduler = SilentScheduler([wire.TokenEvent(rid="", tokens=[wire.SampledToken(3, -0.1)], text="ok")])
    out = await asyncio.wait_for(messages(generation(scheduler)), 10)
    assert [type(m) for m in out] == [InitMsg, TokenMsg, ErrorMsg]
    error = out[-1]
    assert (error.code, error.request_id, error.generated_text) == ("timeout", "gen_1", "ok")
    assert error.message == f"no result from the scheduler within {TIMEOUT_S:.0f} s"
    assert error.recoverable and error.recovery_action == "retry"


async def test_a_generation_that_ended_in_time_leaves_no_deadline_behind() -> None:
    final = wire.TokenEvent(rid="", tokens=[wire.SampledToken(3, -0.1)], text="ok", finish_reason="length")
    scheduler = SilentScheduler([final])
    out = await asyncio.wait_for(messages(generation(scheduler)), 10)
    assert [type(m) for m in out] == [InitMsg, TokenMsg, CompletionMsg]
    await asyncio.sleep(TIMEOUT_S * 2)
    assert scheduler.queues["gen_1"].empty()


class WorkerlessScheduler(SilentScheduler):
    """A scheduler whose worker is in ``stage`` (absent: none connected)."""

    def __init__(self, stage: str) -> None:
        super().__init__([])
        self.stage = stage

    async def health(self, max_age: float = 0.0) -> wire.HealthReply:
        facts = wire.ModelFacts(worker=wire.WorkerStage(stage=self.stage), vocab_size=8, max_model_len=64)
        return wire.HealthReply(service="scheduler", ready=False, facts=facts)


@pytest.mark.parametrize(("stage", "code"), [("absent", "service_unavailable"), ("loading", "timeout")])
async def test_a_request_waits_for_a_loading_worker_but_not_long_for_a_missing_one(
    monkeypatch: pytest.MonkeyPatch, stage: str, code: str
) -> None:
    monkeypatch.setattr(driver, "LOADING_POLL_S", 0.02)
    settings = Settings(limits={"request_timeout_s": 0.5, "worker_absent_s": 0.1})
    gw = Gateway(settings=settings, scheduler=WorkerlessScheduler(stage), store=FakeStore(), text=FakePrompts(),
                 limiter=RateLimiter(0), metrics=Metrics(), created=0)
    gen = Generation(gw, GenerationRequest(prompt="hi", max_tokens=4), rid="gen_1", surface="websocket",
                     client="test", tenant=identify({}, settings))
    out = await asyncio.wait_for(messages(gen), 10)
    assert isinstance(out[-1], ErrorMsg) and out[-1].code == code and out[-1].recoverable, out[-1]
    if stage == "absent":
        assert out[-1].message == "no model worker has been connected for 0.1 s; retry later"
