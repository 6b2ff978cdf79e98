"""One set of finish rules: EOS, stop tokens, stop strings across token boundaries, lengths, deadlines."""

from common import wire
from tests.scheduler.harness import BANG, EOS, HE, LD, LLO, WOR, Harness, prompt


def test_eos_stops_and_is_not_text():
    h = Harness()
    h.worker()
    h.submit("r", prompt(3), 10)
    h.run({"r": [HE, EOS]})
    final = h.final("r")
    assert (final.finish_reason, final.stop_reason, final.completion_tokens, final.prompt_tokens) == ("stop", EOS, 2, 3)
    assert h.text("r") == " he"


def test_ignore_eos_keeps_going_to_max_tokens():
    h = Harness()
    h.worker()
    h.submit("r", prompt(3), 3, ignore_eos=True)
    h.run({"r": [EOS, EOS, HE]})
    assert h.final("r").finish_reason == "length" and h.generated("r") == [EOS, EOS, HE]


def test_a_stop_token_id_stops_with_its_id():
    h = Harness()
    h.worker()
    h.submit("r", prompt(3), 10, stop_token_ids=[BANG])
    h.run({"r": [HE, BANG, LLO]})
    assert h.final("r").stop_reason == BANG and h.generated("r") == [HE, BANG]


def test_a_stop_string_across_token_boundaries_cuts_the_text_before_it():
    h = Harness()
    h.worker()
    h.submit("r", prompt(3), 10, stop=["llo world"])
    h.run({"r": [HE, LLO, WOR, LD, BANG]})
    final = h.final("r")
    assert final.finish_reason == "stop" and final.stop_reason == "llo world"
    assert h.text("r") == " he" and final.completion_tokens == 4


def test_text_that_may_start_a_stop_string_is_held_back_then_released():
    h = Harness()
    h.worker()
    h.submit("r", prompt(3), 3, stop=["llo!"])
    h.run({"r": [HE, LLO, WOR]})
    texts = [e.text for e in h.events("r")]
    assert texts == [" he", "", "llo wor"]  # "llo" could have begun "llo!"
    assert h.final("r").finish_reason == "length"


def test_max_tokens_ends_with_length():
    h = Harness()
    h.worker()
    h.submit("r", prompt(3), 2)
    h.run({"r": [HE, LLO]})
    assert h.final("r").finish_reason == "length" and h.text("r") == " hello"


def test_a_request_may_fill_the_context_to_its_last_token():
    h = Harness()
    h.worker(max_model_len=20)
    h.submit("r", prompt(17), 3)
    h.run({"r": [HE, LLO, WOR, LD]})
    assert h.final("r").finish_reason == "length" and h.generated("r") == [HE, LLO, WOR]


def test_a_request_past_its_deadline_times_out():
    h = Harness()
    h.worker()
    h.submit("slow", prompt(3), 100, timeout_s=5)
    h.submit("fast", prompt(3), 100)
    h.cycle()
    h.clock.now += 6
    h.core.expire()
    assert h.final("slow").finish_reason == "timeout"
    assert "fast" in h.core.requests


def test_a_token_whose_text_is_still_deferred_is_shown_before_a_cancel():
    h = Harness()
    h.worker()
    h.submit("r", prompt(3), 10)
    h.apply(h.build(), {"r": HE})  # its text is deferred until the next step goes out
    h.core.control(b"gw", wire.Cancel(rid="r"))
    assert h.text("r") == " he" and h.final("r").finish_reason == "cancelled"
