"""Incremental detokenization with stop strings.

Turns a growing list of generated token ids into text deltas that are safe to stream: a delta never
ends inside a UTF-8 character, and never shows text that could still become a stop string. When a
stop string completes, the text before it is released and the rest is dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

REPLACEMENT_CHAR = "\ufffd"


def decoder(tokenizer: object) -> Callable[[list[int]], str]:
    """``tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)``; for a
    transformers fast tokenizer whose class keeps the stock decode, its Rust backend's decode, which
    is all that call does once the wrapper has checked its arguments (the wrapper costs several times
    the decoding itself, and a stream decodes twice per token)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and _stock_decode(type(tokenizer)):
        return partial(backend.decode, skip_special_tokens=True)
    return partial(tokenizer.decode, skip_special_tokens=True, clean_up_tokenization_spaces=False)  # type: ignore[attr-defined]


def _stock_decode(cls: type) -> bool:
    import transformers

    return (cls.decode is transformers.PreTrainedTokenizerBase.decode  # type: ignore[attr-defined]
            and cls._decode is transformers.TokenizersBackend._decode)  # type: ignore[attr-defined]


@dataclass
class TextStream:
    """Per-request detokenizer; ``tokenizer`` is a transformers tokenizer."""

    tokenizer: object
    stop: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    text: str = ""  # every decoded character so far
    released: int = 0  # characters of ``text`` already handed out
    stopped_by: str | None = None
    _prefix_offset: int = 0
    _read_offset: int = 0

    def __post_init__(self) -> None:
        self._decode = decoder(self.tokenizer)

    def _append_token(self, token_id: int) -> None:
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self.ids[self._prefix_offset :])
        if new_text.endswith(REPLACEMENT_CHAR) or len(new_text) <= len(prefix_text):
            return  # an incomplete UTF-8 sequence (or a token with no text): wait for more
        self.text += new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.ids)

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; return the newly releasable text. Sets ``stopped_by`` when a stop string ends it."""
        out: list[str] = []
        for token_id in token_ids:
            if self.stopped_by is not None:
                break
            self._append_token(token_id)
            out.append(self._release())
        return "".join(out)

    def _release(self) -> str:
        start = self.released
        earliest: tuple[int, str] | None = None
        for stop in self.stop:
            index = self.text.find(stop, max(0, start - len(stop) + 1))
            if index != -1 and (earliest is None or index < earliest[0]):
                earliest = (index, stop)
        if earliest is not None:
            end = max(earliest[0], start)
            self.stopped_by = earliest[1]
            self.text = self.text[:end]
            self.released = end
            return self.text[start:end]
        end = len(self.text) - self._held_back()
        if end <= start:
            return ""
        self.released = end
        return self.text[start:end]

    def _held_back(self) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        held = 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(self.text)), held, -1):
                if self.text.endswith(stop[:k]):
                    held = k
                    break
        return held

    def flush(self) -> str:
        """Release everything held back (at the end of generation for reasons other than a stop string)."""
        if self.stopped_by is not None:
            return ""
        tail = self.text[self.released :]
        self.released = len(self.text)
        return tail
