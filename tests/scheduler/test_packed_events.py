"""A decoding request's plain token events travel packed (``wire.Events``' arrays), its other events as
TokenEvents after them; requests whose events carry more (top logprobs, prompt outputs) or whose stop
strings changed are never packed, so that a gateway reading the packed entries first keeps every request's
order. The gateway's side reads them over a real socket."""

from __future__ import annotations

import asyncio

import pytest
import zmq.asyncio

from common import wire
from common.config import Settings
from common.sockets import Router
from services.gateway.scheduler_client import SchedulerClient
from tests.scheduler.harness import HE, LD, LLO, WOR, Harness, prompt


def events_messages(h: Harness) -> list[wire.Events]:
    return [m for _, m in h.take() if isinstance(m, wire.Events)]


def test_a_plain_request_s_tokens_come_packed_and_its_last_event_after_them_in_one_message() -> None:
    h = Harness()
    h.worker()
    h.submit("r", prompt(4), 3)
    h.cycle({"r": HE})
    h.cycle({"r": LLO})
    h.cycle({"r": WOR})  # the third and last: its finish event carries it
    (msg,) = events_messages(h)
    assert msg.rids == ["r", "r"] and wire.unpack_tokens(msg.tokens) == [HE, LLO] and msg.texts == [" he", "llo"]
    assert wire.unpack_logprobs(msg.logprobs) == [-0.5, -0.5]
    (last,) = msg.events
    assert last.finish_reason == "length" and [t.token_id for t in last.tokens] == [WOR]
    in_order = msg.token_events()
    assert [t.token_id for e in in_order for t in e.tokens] == [HE, LLO, WOR]
    assert "".join(e.text for e in in_order) == " hello wor"


def test_requests_with_top_logprobs_or_prompt_outputs_are_not_packed() -> None:
    h = Harness()
    h.worker()
    h.submit("top", prompt(4), 3, sampling=wire.SamplingParams(temperature=0.0, logprobs=2))
    h.submit("prompt", prompt(4), 3, outputs=wire.OutputRequest(logprob_ranges=[wire.PositionSpan(1, 3)]))
    h.submit("plain", prompt(4), 3)
    h.run({"top": [HE, LLO, WOR], "prompt": [HE, LLO, WOR], "plain": [HE, LLO, WOR]})
    h.take()
    packed = {rid for _, m in h.sent if isinstance(m, wire.Events) for rid in m.rids}
    assert packed == {"plain"}
    for rid in ("top", "prompt", "plain"):
        assert h.text(rid) == " hello wor", rid


def test_a_request_whose_stop_strings_changed_is_packed_no_more_and_keeps_its_order() -> None:
    h = Harness()
    h.worker()
    h.submit("r", prompt(4), 6)
    h.cycle({"r": HE})  # packed
    h.core.control(b"gw", wire.Modify(rid="r", patch=wire.SamplingPatch(stop=["zz"])))
    h.cycle({"r": LLO})  # deferred: its text is worked out after the step
    h.core.control(b"gw", wire.Modify(rid="r", patch=wire.SamplingPatch(stop=[])))
    h.cycle({"r": WOR})  # stop strings gone: still an event, never packed again
    h.cycle({"r": LD})
    (msg,) = events_messages(h)
    assert msg.rids == ["r"]
    assert [t.token_id for e in msg.token_events() for t in e.tokens] == [HE, LLO, WOR, LD]
    assert "".join(e.text for e in msg.token_events()) == " hello world"


def test_packed_arrays_that_do_not_match_are_refused() -> None:
    msg = wire.Events(rids=["a", "b"], tokens=wire.pack_tokens([1]), logprobs=wire.pack_logprobs([0.0]), texts=["x"])
    with pytest.raises(ValueError, match="2 rids, 1 tokens"):
        msg.token_events()


async def test_the_gateway_routes_packed_events_first_and_drops_only_malformed_packed_arrays(tmp_path) -> None:
    settings = Settings(run_dir=tmp_path)
    ctx = zmq.asyncio.Context.instance()
    scheduler = Router(ctx, settings.endpoint("scheduler"))
    client = SchedulerClient(settings, ctx)
    try:
        client.start()
        queue = client.open_stream("r")
        identity, _, _ = await asyncio.wait_for(scheduler.recv(), 5)  # the gateway's first heartbeat
        last = wire.TokenEvent(rid="r", tokens=[wire.SampledToken(WOR, -0.5)], text=" wor", finish_reason="length")
        await scheduler.send(identity, wire.Events(events=[last], rids=["r", "r"], tokens=wire.pack_tokens([HE, LLO]),
                                                   logprobs=wire.pack_logprobs([-0.5, -0.25]), texts=[" he", "llo"]))
        got = [await asyncio.wait_for(queue.get(), 5) for _ in range(3)]
        assert [(e.tokens[0].token_id, e.tokens[0].logprob, e.text) for e in got] == [
            (HE, -0.5, " he"), (LLO, -0.25, "llo"), (WOR, -0.5, " wor")]
        assert got[-1].finish_reason == "length"
        # a scheduler that packs wrongly loses its packed entries, not the events beside them
        await scheduler.send(identity, wire.Events(events=[last], rids=["r"], tokens=b"\x01", texts=["?"]))
        assert (await asyncio.wait_for(queue.get(), 5)) == last
        assert queue.empty()
    finally:
        client.close()
        scheduler.close()
