"""Incremental detokenization with stop strings.

Turns a growing list of generated token ids into text deltas that are safe to stream: a delta never
ends inside a UTF-8 character, and never shows text that could still become a stop string. When a
stop string completes, the text before it is released and the rest is dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache, partial

REPLACEMENT_CHAR = "\ufffd"
KEPT_TAIL = 256  # characters a stream lets its released text run past what a stop string may match, before it moves it


@cache
def decoder(tokenizer: object, skip_special: bool = True) -> Callable[[list[int]], str]:
    """``tokenizer.decode(ids, skip_special_tokens=skip_special, clean_up_tokenization_spaces=False)``; for a
    transformers fast tokenizer whose class keeps the stock decode, its Rust backend's decode, which
    is all that call does once the wrapper has checked its arguments (the wrapper costs several times
    the decoding itself, and a stream decodes twice per token). Made once per tokenizer (a stream
    is made per request)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and _stock_decode(type(tokenizer)):
        return partial(backend.decode, skip_special_tokens=skip_special)
    return partial(tokenizer.decode, skip_special_tokens=skip_special, clean_up_tokenization_spaces=False)  # type: ignore[attr-defined]


def _stock_decode(cls: type) -> bool:
    import transformers

    return (cls.decode is transformers.PreTrainedTokenizerBase.decode  # type: ignore[attr-defined]
            and cls._decode is transformers.TokenizersBackend._decode)  # type: ignore[attr-defined]


@cache
def byte_table(tokenizer: object, skip_special: bool = True) -> list[bytes] | None:
    """Each token's bytes (special tokens' empty where ``skip_special``), for a tokenizer whose decoding is
    byte-level BPE's (GPT-2, Llama 3, Qwen, SmolLM): its decode of any ids is then the UTF-8 decoding, invalid bytes
    replaced, of their bytes joined, which a stream can do one token at a time without the tokenizer.
    None for any other tokenizer (or when a token's bytes do not decode to the tokenizer's own text)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.decoder).__name__ != "ByteLevel" or not _stock_decode(type(tokenizer)):
        return None
    to_byte = str.maketrans(_BYTE_LEVEL_CHARS)
    table = [b""] * backend.get_vocab_size(with_added_tokens=True)
    for token, i in backend.get_vocab(with_added_tokens=True).items():
        try:
            table[i] = token.translate(to_byte).encode("latin-1")
        except UnicodeEncodeError:  # a character byte-level BPE never makes: an added token, kept as it is
            table[i] = token.encode()
    added = backend.get_added_tokens_decoder()
    for i, added_token in added.items():
        if added_token.special and skip_special:
            table[i] = b""
        elif table[i].decode("utf-8", "replace") != backend.decode([i], skip_special_tokens=skip_special):
            return None
    return table


@cache
def text_table(tokenizer: object, skip_special: bool = True) -> list[str | None] | None:
    """With a byte table (see ``byte_table``): each token's text when its bytes end on a whole UTF-8
    character (None where they do not: its character goes on in the next token), decoded once
    instead of for every token a stream pushes."""
    table = byte_table(tokenizer, skip_special)
    if table is None:
        return None
    texts: list[str | None] = []
    for token_bytes in table:
        text = token_bytes.decode("utf-8", "replace")
        texts.append(None if text.endswith(REPLACEMENT_CHAR) else text)
    return texts


def _byte_level_chars() -> dict[str, str]:
    """Byte-level BPE's alphabet: the printable character standing for each byte, to that byte (as a
    latin-1 character)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    chars = {chr(b): chr(b) for b in printable}
    chars.update({chr(256 + n): chr(b) for n, b in enumerate(others)})
    return chars


_BYTE_LEVEL_CHARS = _byte_level_chars()


def ends_with_flush(finish_reason: str, stop_reason: str | int | None) -> bool:
    """Whether a request's last event releases what its text stream held back (:meth:`TextStream.flush`): always
    but where a stop string ended it, whose text ends before the stop string (a stop token: the text before it)."""
    return finish_reason != "stop" or isinstance(stop_reason, int)


@dataclass(slots=True)
class TextStream:
    """Per-request detokenizer; ``tokenizer`` is a transformers tokenizer. ``keep_stop``: the stop string that
    ends the text stays in it (vLLM's ``include_stop_str_in_output``), and nothing is held back meanwhile.
    ``skip_special``: special tokens (``<|im_end|>``, ...) have no text (vLLM's ``skip_special_tokens``)."""

    tokenizer: object
    stop: list[str] = field(default_factory=list)
    keep_stop: bool = False
    skip_special: bool = True
    ids: list[int] = field(default_factory=list)
    released: int = 0  # characters of ``text`` (every decoded character so far) already handed out
    stopped_by: str | None = None
    _prefix_offset: int = 0
    _read_offset: int = 0
    _decode: Callable[[list[int]], str] = field(init=False, repr=False)
    _bytes: list[bytes] | None = field(init=False, repr=False)
    _texts: list[str | None] | None = field(init=False, repr=False)
    _pending: bytes = field(init=False, repr=False)  # with a byte table: the bytes after the last complete character
    # ``text`` is the pieces of ``_head`` and then ``_tail``, ``_length`` characters in all: a string grown by
    # ``+=`` in an attribute is copied whole each time, so released text goes to the list, and ``_tail`` keeps
    # only what a stop string may still match (from ``released`` less the longest stop string on)
    _head: list[str] = field(init=False, repr=False)
    _tail: str = field(init=False, repr=False)
    _length: int = field(init=False, repr=False)
    # the ``stop`` list the last release with stop strings scanned the text for (a list set since, by a Modify
    # or a backtrack, must be scanned for in the text released before it too)
    _scanned: list[str] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self._decode = decoder(self.tokenizer, self.skip_special)
        self._bytes = byte_table(self.tokenizer, self.skip_special)
        self._texts = text_table(self.tokenizer, self.skip_special)
        self._pending = b""
        self._head, self._tail, self._length = [], "", 0

    def restarted(self) -> TextStream:
        """A new, empty stream with this one's tokenizer and stop strings."""
        return TextStream(self.tokenizer, stop=list(self.stop), keep_stop=self.keep_stop,
                          skip_special=self.skip_special)

    @property
    def text(self) -> str:
        """Every decoded character so far."""
        if self._head:
            self._tail = "".join(self._head) + self._tail
            self._head = []
        return self._tail

    @text.setter
    def text(self, value: str) -> None:
        self._head, self._tail, self._length = [], value, len(value)
        self._scanned = None

    def _cover(self, position: int) -> int:
        """Make ``_tail`` hold the text from ``position`` on; returns the offset of ``_tail`` in ``text``."""
        base = self._length - len(self._tail)
        if position < base:
            self.text  # noqa: B018 - joined into _tail (a stop string set late, or longer than the tail kept)
            return 0
        return base

    def _append(self, text: str) -> None:
        self._tail += text
        self._length += len(text)

    def _append_token(self, token_id: int) -> None:
        if self._bytes is not None:  # the same text as below, without the tokenizer
            # an id past the tokenizer's vocabulary (a model's padded embedding) has no text, as in decode
            self._pending += self._bytes[token_id] if token_id < len(self._bytes) else b""
            text = self._pending.decode("utf-8", "replace")
            if text and not text.endswith(REPLACEMENT_CHAR):
                self._append(text)
                self._pending = b""
            return
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self.ids[self._prefix_offset :])
        if new_text.endswith(REPLACEMENT_CHAR) or len(new_text) <= len(prefix_text):
            return  # an incomplete UTF-8 sequence (or a token with no text): wait for more
        self._append(new_text[len(prefix_text) :])
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.ids)

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; return the newly releasable text. Sets ``stopped_by`` when a stop string ends it."""
        return "".join([self.push_one(token_id) for token_id in token_ids])

    def push_one(self, token_id: int) -> str:
        """``push([token_id])``."""
        if self.stopped_by is not None:
            return ""
        # the common cases inline: a byte table, nothing pending or held back, and no stop strings, or none
        # that this token's text could begin (nothing held back: none had begun in the text before it; with
        # ``keep_stop`` nothing is held back, so that says nothing)
        stop = self.stop
        if (self._texts is not None and not self._pending and self.released == self._length
                and (not stop or (stop is self._scanned and not self.keep_stop))):
            text = self._texts[token_id] if token_id < len(self._texts) else ""
            if text is None:  # a character goes on in the next token
                self._pending = self._bytes[token_id]  # type: ignore[index]
                return ""
            if not stop:
                if self._tail:
                    self._head.append(self._tail)
                    self._tail = ""
                self._head.append(text)
                self._length += len(text)
                self.released = self._length
                return text
            if not any(s and s[0] in text for s in stop):
                tail = self._tail + text
                if len(tail) > 2 * KEPT_TAIL:  # (what _keep does, by length alone)
                    cut = len(tail) - KEPT_TAIL
                    self._head.append(tail[:cut])
                    tail = tail[cut:]
                self._tail = tail
                self._length += len(text)
                self.released = self._length
                return text
        self._append_token(token_id)
        return self._release()

    def _release(self) -> str:
        start = self.released
        if not self.stop:
            base = self._cover(start)
            self.released = self._length
            return self._keep(base, 0)[start - base :]
        # Every match (found from ``start - len(stop) + 1`` on) and every held-back suffix begins with its stop
        # string's first character, within the last ``longest - 1`` characters before ``start`` or after it:
        # where none of those characters is there, everything is released.
        self._scanned = self.stop
        longest = max(map(len, self.stop))
        reach = max(0, start - longest + 1)  # where a match or a held-back suffix may begin, at the earliest
        base = self._cover(reach)
        tail = self._tail
        window = tail[reach - base :]
        if all(stop and stop[0] not in window for stop in self.stop):
            self.released = self._length
            return self._keep(base, longest)[start - base :]
        earliest: tuple[int, str] | None = None
        for stop in self.stop:
            index = tail.find(stop, max(0, start - len(stop) + 1) - base)
            if index != -1 and (earliest is None or index + base < earliest[0]):
                earliest = (index + base, stop)
        if earliest is not None:
            end = earliest[0] + len(earliest[1]) if self.keep_stop else max(earliest[0], start)
            self.stopped_by = earliest[1]
            self._tail, self._length = tail[: end - base], end
            self.released = end
            return tail[start - base : end - base]
        end = self._length if self.keep_stop else self._length - self._held_back(tail)
        if end <= start:
            return ""
        self.released = end
        return self._keep(base, longest)[start - base : end - base]

    def _keep(self, base: int, longest: int) -> str:
        """``_tail`` as it was (returned, at offset ``base``); what a stop string can no longer match (released
        more than ``longest`` characters ago) moves to ``_head`` when there is much of it."""
        tail = self._tail
        old = self.released - base - longest
        if old > KEPT_TAIL:
            self._head.append(tail[:old])
            self._tail = tail[old:]
        return tail

    def _held_back(self, text: str) -> int:
        """Length of the longest suffix of ``text`` (which holds the last ``longest - 1`` characters at least) that
        is a proper prefix of a stop string."""
        held = 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:k]):
                    held = k
                    break
        return held

    def flush(self) -> str:
        """Release everything held back (at the end of generation for reasons other than a stop string)."""
        if self.stopped_by is not None:
            return ""
        base = self._cover(self.released)
        tail = self._tail[self.released - base :]
        self.released = self._length
        return tail
