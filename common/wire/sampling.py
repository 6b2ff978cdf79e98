"""Sampling parameters and sampled tokens, as the gateway, the scheduler and the worker pass them on."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from common.wire.base import Count, Finite

SteeringPositions = Literal["all", "prompt", "generated"]


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 disables
    min_p: float = 0.0  # tokens less likely than min_p times the most likely one are dropped (0 disables)
    repetition_penalty: float = 1.0
    seed: int | None = None
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's logprob and top-k alternatives
    logit_bias: dict[int, float] = {}  # OpenAI's: added to those tokens' logits before anything else
    # OpenAI's penalties on generated tokens: frequency per occurrence, presence once
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0  # ``suppress`` tokens may not be sampled before this many were generated
    suppress: list[int] = []  # the request's stop tokens (EOS unless ignored, stop_token_ids)
    output_start: int = 0  # position of the first generated token: the penalties and min_tokens count from it


class SteeringTerm(msgspec.Struct, kw_only=True, omit_defaults=True, frozen=True):
    """One vector of a request's steering, as the gateway resolved it (docs/steering.md): ``scale`` times the
    vector's direction for layer ``i`` is added to the residual stream after 0-based decoder layer ``i`` (the
    output of transformers' ``model.model.layers[i]``), for each ``i`` of ``layers`` (empty: the vector's own
    layers), at the token positions ``positions`` names: ``prompt`` those before ``SamplingParams.output_start``,
    ``generated`` those from it on, ``all`` both. Several terms add up."""

    vector: str  # the vector's id (common.steering.vector_id) or "concept:<name>" (a readout concept's direction)
    scale: Finite
    layers: list[Annotated[int, msgspec.Meta(ge=0)]] = []
    positions: SteeringPositions = "all"


class SamplingPatch(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Fields a client may change mid-stream (``control: modify``); None leaves a field as it is."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    max_tokens: int | None = None
    stop: list[str] | None = None
    steering: list[SteeringTerm] | None = None  # the request's whole steering from the next token on ([]: none)


class TokenLogprob(msgspec.Struct, array_like=True, gc=False):
    token_id: int
    logprob: float


class SampledToken(msgspec.Struct, array_like=True, gc=False):
    """One generated token with its logprob and top alternatives (empty when not requested)."""

    token_id: int
    logprob: float
    top: list[TokenLogprob] = []


class ImageInput(msgspec.Struct, kw_only=True):
    """An image placed in a token list (vision-language models): the block ``[start, end)`` is
    ``<|vision_start|>``, the ``<|image_pad|>`` tokens its encoder features replace, and
    ``<|vision_end|>``. ``data`` is the encoded image (PNG, JPEG, ...) exactly as the client sent it."""

    start: Count
    end: Count
    data: bytes
    mime: str = ""
