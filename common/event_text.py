"""The text of token events, worked out where they arrive (the gateway) from their tokens.

The scheduler must work out a request's text only when stop strings may end it (a stop string ends
the sequence where it completes) or a controller steers it. Every other request goes out with
``Submit.text_at_gateway``: its events come without text, and :class:`EventTexts` works it out from
their tokens with the same :class:`TextStream` the scheduler would have used, as vLLM's frontend
detokenizes what its engine core sends (the scheduler's per-token work is then a token and a logprob
appended to two lists). A Modify that gives such a request stop strings hands its text to the
scheduler, which rebuilds the stream from the tokens it generated (so it holds what this one holds)
and sends ``TextHandover`` in order among the events: the events after it carry their text.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from common import wire
from common.textstream import TextStream, ends_with_flush, text_table


def gateway_streams(tokenizer: object) -> Callable[[], TextStream] | None:
    """A maker of text streams for :class:`EventTexts`, for a byte-level tokenizer (whose streams work
    from a table, never calling the tokenizer: a fast tokenizer must not be called from two threads, and
    the gateway encodes prompts on a thread of its own). None for any other: the scheduler works out
    the text of every request."""
    return partial(TextStream, tokenizer) if text_table(tokenizer) is not None else None


class EventTexts:
    """The text streams of the ``text_at_gateway`` requests one gateway submitted, until their last event."""

    def __init__(self, streams: Callable[[], TextStream] | None) -> None:
        self._streams = streams
        self._open: dict[str, TextStream] = {}

    def submitting(self, submit: wire.Submit) -> None:
        """Before ``submit`` goes out: mark it ``text_at_gateway`` where its text can be worked out here."""
        if self._streams is not None and not submit.stop and not submit.controller and submit.skip_special_tokens:
            submit.text_at_gateway = True
            self._open[submit.rid] = self._streams()

    def close(self, rid: str) -> None:
        """``rid``'s text comes from the scheduler (``TextHandover``), or nobody wants it any more."""
        self._open.pop(rid, None)

    def clear(self) -> None:
        """The scheduler was lost, and every request with it (those whose stream nobody opened too)."""
        self._open.clear()

    def fill(self, event: wire.TokenEvent) -> None:
        """Set the text of ``event`` when it is this gateway's to work out, as the scheduler's core would
        have: a stop token's text is never shown, and the request's last event releases what was held."""
        stream = self._open.get(event.rid)
        if stream is None:
            return
        reason = event.finish_reason
        stop_token = reason == "stop" and isinstance(event.stop_reason, int)
        text = "" if stop_token else stream.push([t.token_id for t in event.tokens])
        if reason is not None:
            if ends_with_flush(reason, event.stop_reason):
                text += stream.flush()
            del self._open[event.rid]
        event.text = text
