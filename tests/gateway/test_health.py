"""/health's judgement (pure): 200 while plain generation works, naming what is degraded."""

from common import wire
from services.gateway.ops import assess


def reply(stage: str = "ready", runtime: str = "ok") -> wire.HealthReply:
    facts = wire.ModelFacts(worker=wire.WorkerStage(stage=stage, message="loading weights"), controller_runtime=runtime)
    return wire.HealthReply(service="scheduler", ready=stage == "ready" and runtime == "ok", facts=facts)


def test_everything_up():
    assert assess(reply(), store_answers=True, side_connected=True) == (True, [])


def test_controllers_down_still_serves_and_says_so():
    serving, degraded = assess(reply(runtime="unreachable"), store_answers=True, side_connected=True)
    assert serving and len(degraded) == 1 and degraded[0].startswith("controller_runtime: unreachable")
    serving, degraded = assess(reply(), store_answers=True, side_connected=False)
    assert serving and degraded[0].startswith("controller_runtime: not connected")


def test_store_down_still_serves_and_says_so():
    serving, degraded = assess(reply(), store_answers=False, side_connected=True)
    assert serving and degraded[0].startswith("session_store")


def test_no_ready_worker_does_not_serve():
    serving, degraded = assess(reply(stage="loading"), store_answers=True, side_connected=True)
    assert not serving and degraded == ["worker: loading (loading weights)"]
    serving, _ = assess(wire.HealthReply(service="scheduler", ready=False), store_answers=True, side_connected=True)
    assert not serving
