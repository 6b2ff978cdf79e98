"""A decoding request's plain token events travel packed (``wire.Events``' arrays), its other events as
TokenEvents after them; requests whose events carry more (top logprobs, prompt outputs), or whose text the
scheduler works out, are never packed, so that a gateway reading the packed entries first keeps every
request's order. The text of a ``text_at_gateway`` request is worked out by its gateway (common.event_text)
until a Modify gives it stop strings and the scheduler takes it over. The gateway's side reads them over a
real socket."""

from __future__ import annotations

import asyncio

import pytest
import zmq.asyncio

from common import wire
from common.config import Settings
from common.errors import INVALID_REQUEST
from common.sockets import Router, reply_mid
from common.textstream import TextStream
from services.gateway.scheduler_client import SchedulerClient, StreamItem
from tests.scheduler.harness import HE, LD, LLO, WOR, FakeTokenizer, Harness, prompt


def events_messages(h: Harness) -> list[wire.Events]:
    return [m for _, m in h.take() if isinstance(m, wire.Events)]


def test_a_plain_request_s_tokens_come_packed_without_text_and_its_last_event_after_them_in_one_message() -> None:
    h = Harness()
    h.worker()
    h.submit("r", prompt(4), 3)
    h.cycle({"r": HE})
    h.cycle({"r": LLO})
    h.cycle({"r": WOR})  # the third and last: its finish event carries it
    (msg,) = events_messages(h)
    assert msg.rids == ["r", "r"] and wire.unpack_tokens(msg.tokens) == [HE, LLO]
    assert wire.unpack_logprobs(msg.logprobs) == [-0.5, -0.5]
    (last,) = msg.events
    assert last.finish_reason == "length" and [t.token_id for t in last.tokens] == [WOR]
    assert [t.token_id for e in msg.token_events() for t in e.tokens] == [HE, LLO, WOR]
    assert all(e.text == "" for e in msg.token_events())  # the scheduler worked out no text
    assert h.text("r") == " hello wor"  # the gateway did, from the tokens


def test_a_gateway_that_leaves_the_text_to_the_scheduler_gets_it_in_events() -> None:
    h = Harness()
    h.worker()
    h.submit("r", prompt(4), 3, text_at_gateway=False)
    h.run({"r": [HE, LLO, WOR]})
    (msg,) = events_messages(h)
    assert msg.rids == [] and [e.text for e in msg.events] == [" he", "llo", " wor"]


def test_text_at_gateway_is_refused_with_stop_strings_or_a_controller() -> None:
    h = Harness()
    h.worker()
    for fields in ({"stop": ["x"]}, {"controller": "ctl"}):
        reply = h.core.submit(b"gw", wire.Submit(rid="r", prompt=wire.pack_tokens(prompt(4)), max_tokens=3,
                                                 text_at_gateway=True, sampling=wire.SamplingParams(), **fields))
        assert isinstance(reply, wire.Error) and reply.code == INVALID_REQUEST and "text_at_gateway" in reply.message
    assert not h.core.requests


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


def test_stop_strings_given_mid_stream_hand_the_text_to_the_scheduler_in_order() -> None:
    h = Harness()
    h.worker()
    h.submit("r", prompt(4), 6)
    h.cycle({"r": HE})  # packed, its text worked out by the gateway
    h.core.control(b"gw", wire.Modify(rid="r", patch=wire.SamplingPatch(stop=["zz"])))
    h.cycle({"r": LLO})  # deferred: its text is worked out after the step, by the scheduler
    h.core.control(b"gw", wire.Modify(rid="r", patch=wire.SamplingPatch(stop=[])))
    h.cycle({"r": WOR})  # stop strings gone: still the scheduler's text, never packed again
    h.cycle({"r": LD})
    before, handover, after = h.take()
    assert isinstance(before[1], wire.Events) and before[1].rids == ["r"] and not before[1].events
    assert handover[1] == wire.TextHandover(rid="r")
    assert isinstance(after[1], wire.Events) and after[1].rids == []
    assert [e.text for e in after[1].events] == ["llo", " wor", "ld"]
    assert [t.token_id for e in h.events("r") for t in e.tokens] == [HE, LLO, WOR, LD]
    assert h.text("r") == " hello world"


def test_a_stop_string_given_mid_stream_matches_text_the_gateway_worked_out() -> None:
    h = Harness()
    h.worker()
    h.submit("r", prompt(4), 8)
    h.cycle({"r": HE})
    h.cycle({"r": LLO})  # " hello" released by the gateway
    h.core.control(b"gw", wire.Modify(rid="r", patch=wire.SamplingPatch(stop=["lo wor"])))
    h.cycle({"r": WOR})  # completes "lo wor", begun in text released before
    h.cycle()
    final = h.final("r")
    assert final.finish_reason == "stop" and final.stop_reason == "lo wor"
    assert h.text("r") == " hello" and "r" not in h.core.requests


def test_packed_arrays_that_do_not_match_are_refused() -> None:
    msg = wire.Events(rids=["a", "b"], tokens=wire.pack_tokens([1]), logprobs=wire.pack_logprobs([0.0]))
    with pytest.raises(ValueError, match="2 rids, 1 tokens"):
        msg.token_events()


async def test_the_gateway_works_out_the_text_routes_packed_events_first_and_drops_only_malformed_arrays(
        tmp_path) -> None:
    settings = Settings(run_dir=tmp_path)
    ctx = zmq.asyncio.Context.instance()
    scheduler = Router(ctx, settings.endpoint("scheduler"))
    client = SchedulerClient(settings, ctx, lambda: TextStream(FakeTokenizer()))

    async def submitted(rid: str, **fields: object) -> tuple[bytes, wire.Submit, asyncio.Queue[StreamItem]]:
        """Submit ``rid`` through the client, answered as the scheduler would: its identity, the Submit, its queue."""
        queue = client.open_stream(rid)
        submit = wire.Submit(rid=rid, prompt=wire.pack_tokens(prompt(4)), max_tokens=8,
                             sampling=wire.SamplingParams(), **fields)
        sending = asyncio.create_task(client.submit(submit))
        while True:
            identity, msg, _ = await asyncio.wait_for(scheduler.recv(), 5)
            if isinstance(msg, wire.Submit):
                await scheduler.send(identity, wire.Queued(rid=rid, waiting=1, mid=reply_mid(msg)))
                await sending
                return identity, msg, queue

    try:
        client.start()
        identity, submit, queue = await submitted("r")
        assert submit.text_at_gateway
        last = wire.TokenEvent(rid="r", tokens=[wire.SampledToken(WOR, -0.5)], finish_reason="length")
        await scheduler.send(identity, wire.Events(events=[last], rids=["r", "r"], tokens=wire.pack_tokens([HE, LLO]),
                                                   logprobs=wire.pack_logprobs([-0.5, -0.25])))
        got = [await asyncio.wait_for(queue.get(), 5) for _ in range(3)]
        assert [(e.tokens[0].token_id, e.tokens[0].logprob, e.text) for e in got] == [
            (HE, -0.5, " he"), (LLO, -0.25, "llo"), (WOR, -0.5, " wor")]
        assert got[-1].finish_reason == "length"
        # after a TextHandover, the scheduler's text is what the client gets
        identity, _, handed = await submitted("h")
        await scheduler.send(identity, wire.Events(rids=["h"], tokens=wire.pack_tokens([HE]),
                                                   logprobs=wire.pack_logprobs([0.0])))
        await scheduler.send(identity, wire.TextHandover(rid="h"))
        await scheduler.send(identity, wire.Events(events=[wire.TokenEvent(
            rid="h", tokens=[wire.SampledToken(LLO, 0.0)], text="LLO", finish_reason="stop", stop_reason="x")]))
        assert [(await asyncio.wait_for(handed.get(), 5)).text for _ in range(2)] == [" he", "LLO"]
        # a request with stop strings is the scheduler's to work out from the start
        _, submit, _ = await submitted("s", stop=["x"])
        assert not submit.text_at_gateway
        # a scheduler that packs wrongly loses its packed entries, not the events beside them
        await scheduler.send(identity, wire.Events(events=[last], rids=["r"], tokens=b"\x01"))
        assert (await asyncio.wait_for(queue.get(), 5)).tokens == last.tokens
        assert queue.empty()
    finally:
        client.close()
        scheduler.close()
