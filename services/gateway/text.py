"""Prompt handling: tokenization, chat templates, token strings, the content filter.

Tokenizer work runs on one dedicated thread: off the event loop, and never concurrently (a fast
tokenizer mutably borrows its Rust state while encoding and fails when shared across threads).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jinja2

from common.errors import INVALID_REQUEST
from common.event_text import gateway_streams
from common.textstream import TextStream
from services.gateway.protocol import GatewayError
from services.gateway.validation import GenerationRequest


class TextProcessor:
    def __init__(self, tokenizer: Any, content_filter_patterns: list[str]) -> None:
        self._tokenizer = tokenizer
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        self._filters = [re.compile(p) for p in content_filter_patterns]
        self._token_texts: list[str] = []

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def load_token_texts(self) -> None:
        """Decode every vocabulary entry once, so logprob token strings are a list lookup."""
        vocab = len(self._tokenizer)
        self._token_texts = await self._run(self._tokenizer.batch_decode, [[i] for i in range(vocab)])

    async def event_text_streams(self) -> Callable[[], TextStream] | None:
        """The maker of the streams that work out token events' text here (common.event_text), its
        tables built on the tokenizer's thread; None when the scheduler must work out every text."""
        return await self._run(gateway_streams, self._tokenizer)

    def token_text(self, token_id: int) -> str:
        return self._token_texts[token_id] if 0 <= token_id < len(self._token_texts) else ""

    async def prompt(self, request: GenerationRequest, add_special_tokens: bool | None = None) -> tuple[str, list[int]]:
        """The prompt as text (what echo shows, what the filter sees) and as token ids.
        ``add_special_tokens`` None: as generation reads it (a text prompt gets the tokenizer's
        special tokens, rendered chat messages carry their own)."""
        return await self._run(self._prompt, request, add_special_tokens)

    def _prompt(self, request: GenerationRequest, add_special_tokens: bool | None) -> tuple[str, list[int]]:
        if request.messages is not None:
            text = self._render_chat(request)
            return text, self._tokenizer.encode(text, add_special_tokens=bool(add_special_tokens))
        if request.prompt_ids is not None:
            return self._decode(request.prompt_ids, "prompt"), list(request.prompt_ids)
        assert request.prompt is not None
        return request.prompt, self._tokenizer.encode(request.prompt, add_special_tokens=add_special_tokens is not False)

    async def decode(self, ids: list[int], param: str) -> str:
        """The text of token ids (special tokens included), refusing ids outside the vocabulary."""
        return await self._run(self._decode, ids, param)

    async def token_strings(self, ids: list[int]) -> list[str]:
        """The vocabulary entries of token ids, as the tokenizer spells them (not decoded)."""
        return await self._run(self._tokenizer.convert_ids_to_tokens, ids)

    def _decode(self, ids: list[int], param: str) -> str:
        vocab = len(self._tokenizer)
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise GatewayError(
                INVALID_REQUEST, f"{param}: token id {bad} is outside the vocabulary (0..{vocab - 1})", param=param
            )
        return self._tokenizer.decode(ids)

    def _render_chat(self, request: GenerationRequest) -> str:
        if not self._tokenizer.chat_template:
            raise GatewayError(
                INVALID_REQUEST, "messages: this model has no chat template; send a 'prompt'", param="messages"
            )
        kwargs = request.chat_template_kwargs or {}
        try:
            return self._tokenizer.apply_chat_template(
                request.messages,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                tokenize=False,
                **kwargs,
            )
        except jinja2.TemplateError as exc:
            raise GatewayError(
                INVALID_REQUEST, f"messages: the chat template refused them: {exc}", param="messages"
            ) from None
        except Exception as exc:  # a client's template variable of a type the template cannot use
            if not kwargs:
                raise
            raise GatewayError(
                INVALID_REQUEST, f"chat_template_kwargs: the chat template failed with them: {type(exc).__name__}: "
                f"{exc}", param="chat_template_kwargs",
            ) from None

    def refused(self, text: str) -> bool:
        """Whether ``text`` matches a content filter pattern."""
        return any(p.search(text) for p in self._filters)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
