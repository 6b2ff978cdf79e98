"""vLLM's tokenizer endpoints, ``POST /tokenize`` and ``POST /detokenize``.

A prompt or chat messages are tokenized exactly as a completion or chat request renders them, so
``count`` is what that request's ``usage.prompt_tokens`` would say. Nothing reaches the scheduler.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import model_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from common.errors import TillerError
from services.gateway.httputil import gateway_of, read_json_object
from services.gateway.chat_tools import ChatTools, ToolChatMessage
from services.gateway.openai_api import error_response, max_model_len, model_not_found
from services.gateway.protocol import ErrorMsg
from services.gateway.validation import ChatRendering, Context, GenerationRequest, StrictModel, validate

router = APIRouter()


class TokenizeRequest(StrictModel, ChatRendering, ChatTools):
    """vLLM's TokenizeRequest: a ``prompt`` (completions) or ``messages`` (chat, with the request's ``tools``
    described in the prompt as the chat completion renders them)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ToolChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: as generation reads it (true for a prompt, false for messages)
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input_as_generation_reads_it(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either 'prompt' or 'messages'")
        if self.tools and self.messages is None:
            raise ValueError("'tools' go with 'messages'")
        if self.chat_template_kwargs and self.messages is None:
            raise ValueError("'chat_template_kwargs' go with 'messages'")
        return self

    def generation(self) -> GenerationRequest:
        if self.messages is not None:
            return GenerationRequest(messages=self.rendered_messages(), **self.rendering())
        return GenerationRequest(prompt=self.prompt)


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]


async def _parse(request: Request, model: type[StrictModel]) -> Any:
    """The validated body, or the error response to send instead."""
    gw = gateway_of(request)
    try:
        parsed = validate(model, await read_json_object(request),
                          Context.of(gw.settings))
    except TillerError as exc:
        return error_response(ErrorMsg.from_error(exc))
    if parsed.model is not None and parsed.model != gw.settings.served_model_name:
        return model_not_found(parsed.model, gw.settings.served_model_name)
    return parsed


@router.post("/tokenize")
async def tokenize(request: Request) -> Response:
    parsed = await _parse(request, TokenizeRequest)
    if isinstance(parsed, Response):
        return parsed
    text = gateway_of(request).text
    try:
        _, ids = await text.prompt(parsed.generation(), parsed.add_special_tokens)
    except TillerError as exc:
        return error_response(ErrorMsg.from_error(exc))
    return JSONResponse({
        "count": len(ids),
        "max_model_len": await max_model_len(request),
        "tokens": ids,
        "token_strs": await text.token_strings(ids) if parsed.return_token_strs else None,
    })


@router.post("/detokenize")
async def detokenize(request: Request) -> Response:
    parsed = await _parse(request, DetokenizeRequest)
    if isinstance(parsed, Response):
        return parsed
    try:
        return JSONResponse({"prompt": await gateway_of(request).text.decode(parsed.tokens, "tokens")})
    except TillerError as exc:
        return error_response(ErrorMsg.from_error(exc))


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> Response:
    """vLLM's: the tokenizer's special tokens and chat template (what lm-eval's remote tokenizer reads)."""
    tokenizer = gateway_of(request).text.tokenizer
    return JSONResponse({
        "tokenizer_class": type(tokenizer).__name__,
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "pad_token": tokenizer.pad_token,
        "unk_token": tokenizer.unk_token,
        "chat_template": tokenizer.chat_template,
        "model_max_length": await max_model_len(request),
        "vocab_size": len(tokenizer),
    })
