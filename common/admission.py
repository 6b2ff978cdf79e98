"""How many tokens a request may generate: one policy for every surface.

The scheduler applies it to every ``Submit`` at admission (it knows the model's context); the gateway
applies the same function with the scheduler's ``ModelFacts`` to answer early and to fill in the
default. Nothing is ever cut silently:

- the prompt must leave room for one generated token (none when ``max_tokens`` is 0: prefill only, as scoring and
  embeddings are);
- an explicit ``max_tokens`` must fit beside the prompt, else ``context_length_exceeded`` naming the
  context, the prompt's tokens and what would fit;
- without one, the default is capped by the room left (vLLM's behaviour).
"""

from __future__ import annotations

from dataclasses import dataclass

from common.errors import CONTEXT_LENGTH_EXCEEDED, TillerError


@dataclass
class ContextLengthExceeded(TillerError):
    """The prompt, or the prompt with ``max_tokens``, does not fit the context; ``param`` is the field to blame."""

    param: str | None = None

    @property
    def recovery_action(self) -> str:
        return "reduce_max_tokens" if self.param == "max_tokens" else super().recovery_action


def context_budget(prompt_tokens: int, max_tokens: int | None, max_model_len: int, default_max_tokens: int, *,
                   what: str = "the model's context") -> int:
    """The tokens to allow the generation (see the module docstring); ``what`` names the limit
    ``max_model_len`` is (the scheduler also holds a request to a worker's whole KV pool)."""
    room = max_model_len - prompt_tokens
    if room < (0 if max_tokens == 0 else 1):
        too_long = "cannot hold it" if max_tokens == 0 else "leaves no room to generate"
        raise ContextLengthExceeded(
            CONTEXT_LENGTH_EXCEEDED,
            f"the prompt has {prompt_tokens} tokens; {what} of {max_model_len} tokens {too_long}",
            param="prompt",
        )
    if max_tokens is None:
        return min(default_max_tokens, room)
    if max_tokens > room:
        raise ContextLengthExceeded(
            CONTEXT_LENGTH_EXCEEDED,
            f"the prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceeds {what} of "
            f"{max_model_len} tokens; ask for at most {room}",
            param="max_tokens",
        )
    return max_tokens
