"""The gateway's side of the text (common.event_text): what it works out from the tokens of a
``text_at_gateway`` request's events equals what the scheduler core would have sent, on the real
tokenizer, and it leaves alone the requests whose text the scheduler works out."""

from __future__ import annotations

import pytest

from common import wire
from common.config import Settings
from common.event_text import EventTexts, gateway_streams
from common.model_source import load_tokenizer
from tests.scheduler.harness import FakeTokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(Settings())


def event(rid: str, tokens: list[int], **fields: object) -> wire.TokenEvent:
    return wire.TokenEvent(rid=rid, tokens=[wire.SampledToken(t, 0.0) for t in tokens], **fields)


def submitted(texts: EventTexts, rid: str, **fields: object) -> wire.Submit:
    submit = wire.Submit(rid=rid, prompt=wire.pack_tokens([1]), sampling=wire.SamplingParams(), max_tokens=8, **fields)
    texts.submitting(submit)
    return submit


def test_the_default_tokenizer_s_text_is_worked_out_at_the_gateway_and_a_non_byte_level_one_s_is_not(tokenizer):
    assert gateway_streams(tokenizer) is not None  # so the stack's end-to-end tests run this path
    assert gateway_streams(FakeTokenizer()) is None
    texts = EventTexts(None)
    assert not submitted(texts, "r").text_at_gateway


def test_characters_split_across_tokens_come_whole_and_the_last_event_releases_the_rest(tokenizer):
    texts = EventTexts(gateway_streams(tokenizer))
    ids = tokenizer.encode("héllo 日本語 wörld", add_special_tokens=False)
    assert submitted(texts, "r").text_at_gateway
    events = [event("r", [t]) for t in ids[:-1]] + [event("r", ids[-1:], finish_reason="length")]
    for e in events:
        texts.fill(e)
    assert "".join(e.text for e in events) == "héllo 日本語 wörld"
    assert all("\ufffd" not in e.text for e in events)
    late = event("r", ids[:1])  # after its last event: no longer this gateway's to work out
    texts.fill(late)
    assert late.text == ""


def test_a_stop_token_s_text_is_never_shown(tokenizer):
    texts = EventTexts(gateway_streams(tokenizer))
    submitted(texts, "r")
    hello, = tokenizer.encode(" hello", add_special_tokens=False)
    first, last = event("r", [hello]), event("r", [tokenizer.eos_token_id], finish_reason="stop",
                                             stop_reason=tokenizer.eos_token_id)
    texts.fill(first)
    texts.fill(last)
    assert (first.text, last.text) == (" hello", "")


def test_requests_with_stop_strings_or_a_controller_and_handed_over_ones_keep_the_scheduler_s_text(tokenizer):
    texts = EventTexts(gateway_streams(tokenizer))
    assert not submitted(texts, "s", stop=["x"]).text_at_gateway
    assert not submitted(texts, "c", controller="ctl").text_at_gateway
    submitted(texts, "h")
    texts.close("h")  # a TextHandover
    submitted(texts, "lost")
    texts.clear()  # the scheduler was lost
    hello, = tokenizer.encode(" hello", add_special_tokens=False)
    for rid in ("s", "c", "h", "lost"):
        given = event(rid, [hello], text="from the scheduler")
        texts.fill(given)
        assert given.text == "from the scheduler"
