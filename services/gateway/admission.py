"""The admission pipeline: every generation, on every surface (WebSocket, REST/SSE, OpenAI, AICI
``/v1/run``, Salience, Evergreen), passes the same checks and leaves the same traces.

- :meth:`Admission.admit`: the rate limit (per user with auth, else per client address), then the content filter
  on what the client wrote;
- :meth:`Admission.screens_out`: the content filter on generated text (the surface withholds it and ends the request);
- :meth:`Admission.record`: the request's record in the session store, owned by its tenant, once it is accepted;
- :meth:`Admission.tokens` and :meth:`Admission.end`: ``tiller:requests_total{surface,outcome}``, latency, token
  counts, the active-streams gauge and the record's completion, whatever way the request ends.

Auth, which comes before all of this, is :mod:`services.gateway.auth`. No sockets, no asyncio here: the
store's record calls are fire-and-forget, so a surface calls these from anywhere and tests use fakes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from common.errors import CONTENT_FILTER
from services.gateway.deps import Gateway
from services.gateway.protocol import GatewayError
from services.gateway.tenants import Tenant

# Finish reasons that end a generation normally, with a completion.
COMPLETED = ("length", "stop", "cancelled")


def record_error(outcome: str) -> str:
    """What a request record's ``error`` says for an outcome: nothing for a normal end (a filtered
    generation included), else the error code."""
    return "" if outcome in (*COMPLETED, CONTENT_FILTER) else outcome


class Admission:
    """One request's passage through the gateway, from the moment a surface takes it."""

    def __init__(self, gw: Gateway, *, rid: str, surface: str, client: str, tenant: Tenant,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.gw = gw
        self.rid = rid
        self.surface = surface
        self.client = client  # the caller's address
        self.tenant = tenant
        self._clock = clock
        self.started_at = clock()
        self._first_token_at: float | None = None
        self._recorded = False
        self._ended = False
        gw.metrics.active_streams.labels(surface).inc()
        self._generated = gw.metrics.generation_tokens.labels(surface)  # counted per event: looked up once

    async def admit(self, written: str, param: str = "prompt") -> None:
        """Count the request against its tenant's rate limit, then screen what the client wrote (for
        chat: the messages' contents, not the template around them); raise the refusal."""
        await self.gw.limiter.check(self.tenant.rate_key(self.client))
        if self.gw.text.refused(written):
            raise GatewayError(CONTENT_FILTER, f"the {param} was refused by the content filter", param=param)

    def written_tokens(self, token_ids: Iterable[int]) -> str:
        """The text of token ids a client sent, to screen (vocabulary spellings joined; no tokenizer call)."""
        return "".join(self.gw.text.token_text(t) for t in token_ids)

    def screens_out(self, generated: str) -> bool:
        """Whether generated text matches the content filter: the surface must not send it."""
        return bool(generated) and self.gw.text.refused(generated)

    def record(self, *, prompt: str, params: dict[str, Any]) -> None:
        """The request's record (``GET /v1/requests/{id}``), once it is accepted."""
        self.gw.store.record_request(self.rid, owner=self.tenant.user, surface=self.surface,
                                     model=self.gw.settings.served_model_name, prompt=prompt, params=params)
        self._recorded = True

    def tokens(self, count: int) -> None:
        """``count`` generated tokens delivered (the first ones set the time to first token)."""
        if count and self._first_token_at is None:
            self._first_token_at = self._clock()
            self.gw.metrics.time_to_first_token.labels(self.surface).observe(self._first_token_at - self.started_at)
        self._generated.inc(count)

    def end(self, outcome: str, *, text: str = "", prompt_tokens: int = 0, completion_tokens: int = 0) -> float:
        """The request ended with ``outcome`` (a finish reason or an error code); the seconds it took.
        Only the first call counts."""
        elapsed = self._clock() - self.started_at
        if self._ended:
            return elapsed
        self._ended = True
        metrics, surface = self.gw.metrics, self.surface
        metrics.active_streams.labels(surface).dec()
        metrics.requests.labels(surface, outcome).inc()
        metrics.request_latency.labels(surface).observe(elapsed)
        if self._recorded:
            metrics.prompt_tokens.labels(surface).inc(prompt_tokens)
            self.gw.store.record_completion(self.rid, generated_text=text, finish_reason=outcome,
                                            prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                            error=record_error(outcome))
        return elapsed
