"""The gateway <-> scheduler channel: submits and their control messages, then the token events back."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from common.wire.base import Msg
from common.wire.packing import unpack_logprobs, unpack_tokens
from common.wire.sampling import ImageInput, SampledToken, SamplingParams, SamplingPatch, SteeringTerm, TokenLogprob


class PositionSpan(msgspec.Struct, array_like=True):
    """Absolute token positions ``[start, end)``."""

    start: int
    end: int


class OutputRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Per-position outputs of a request (Salience). ``logprob_ranges``: positions p whose token's
    logprob (given the tokens before p) is reported, prompt positions as ``TokenEvent.prompt_outputs``
    and generated ones on their ``SampledToken``; ``top_logprobs`` alternatives each. ``readout_ranges``:
    positions whose concept readout is reported; a generated token's comes once a step feeds it (the step
    after its sampling), as a ``TokenEvent.prompt_outputs`` entry past the prompt; the last generated
    token is never fed, so its readout is not reported. ``pooling`` (a prefill-only request's, max_tokens 0):
    the prompt's embedding, its final hidden states pooled (common.pooling), on its last ``TokenEvent``."""

    logprob_ranges: list[PositionSpan] = []
    top_logprobs: int = 0
    readout_ranges: list[PositionSpan] = []
    pooling: Literal["", "last", "mean"] = ""  # "": none
    # positions whose residual stream (the hidden states after each of ``residual_layers``, 0-based decoder
    # layers) is reported, as ``PositionOutput.residual`` (what vectors:build takes its differences of)
    residual_ranges: list[PositionSpan] = []
    residual_layers: list[int] = []


class SessionRef(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The stateful session a request is a turn of: the scheduler keeps the sequence's KV on its
    worker after the turn (within the sessions KV budgets) for the next turn of ``key``, and a
    first turn may fork the kept KV of ``parent`` (the session it was forked from)."""

    key: str
    parent: str = ""


class Submit(Msg, tag="submit"):
    rid: str
    # The prompt's token ids as int32 (pack_tokens): what the scheduler checks and compares whole (a session
    # turn against what its parked sequence holds) it reads as bytes, where a list costs an object per token.
    prompt: bytes
    sampling: SamplingParams
    max_tokens: int
    stop: list[str] = []
    include_stop_str: bool = False  # the stop string that ends it stays in its text (vLLM's include_stop_str_in_output)
    skip_special_tokens: bool = True  # special tokens have no text (vLLM's)
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    priority: int = 0  # 0 interactive ... 10 batch
    timeout_s: float = 0.0  # 0: the scheduler's default
    images: list[ImageInput] = []  # every image of the prompt, positions in prompt tokens
    controller: str = ""  # req_id of a controller instantiated on the side channel ("": none)
    session: SessionRef | None = None
    outputs: OutputRequest | None = None  # with max_tokens == 0: prefill only (scoring)
    # The gateway works out the text of this request's events from their tokens (common.event_text): the
    # scheduler sends none, until a TextHandover. Only for a request without stop strings or a controller.
    text_at_gateway: bool = False
    # The KV cache domain (docs/tenants.md): a digest the gateway makes of the user's domain and the request's
    # cache_salt ("": the shared domain). KV is reused only from sequences of the same domain (common.blocks).
    cache_domain: str = ""
    tenant: str = ""  # the user it runs for: what tenants.max_generations_per_user counts ("": not counted)
    # Activation steering (docs/steering.md): the terms, and the canonical content (common.steering.encode) of
    # every vector they name by id ("concept:" ones the worker has). The gateway folds the steering into
    # ``cache_domain``: steered KV is never reused by a request steered otherwise, nor by an unsteered one.
    steering: list[SteeringTerm] = []
    steering_vectors: dict[str, bytes] = {}

    @property
    def prompt_len(self) -> int:
        """Tokens in ``prompt``."""
        return len(self.prompt) // 4


class Cancel(Msg, tag="cancel"):
    rid: str


class GatewayAlive(Msg, tag="gateway_alive"):
    """A gateway's heartbeat (``limits.gateway_heartbeat_s``), answered with ``Alive``.

    To the scheduler: once a gateway sent one, the scheduler cancels its requests when it stays silent
    for ``limits.gateway_silence_s`` (a gateway that died cannot cancel them itself). To the session
    store: ``leases`` (Salience sessions with a Generate running) have their busy lease renewed and
    ``evergreen`` (live Evergreen sessions) keep their node rows; a gateway that died renews nothing,
    so its leases lapse and its Evergreen rows go within seconds."""

    incarnation: str = ""
    leases: list[str] = []
    evergreen: list[str] = []


class RateHit(Msg, tag="rate_hit"):
    """Gateway -> session store, with several gateways on one port: count one request of ``client`` (a user,
    else an address) against ``limits.rate_limit_per_minute``; answered with ``RateVerdict``."""

    client: str


class RateVerdict(Msg, tag="rate_verdict"):
    retry_after_s: float | None = None  # None: counted and admitted; else refused, retry in this many seconds


class SessionDrop(Msg, tag="session_drop"):
    """A session was closed: the KV the scheduler keeps for it between turns can go, and a turn of it
    still running is cancelled (its tokens would go nowhere)."""

    key: str


class Pause(Msg, tag="pause"):
    rid: str


class Resume(Msg, tag="resume"):
    rid: str


class Modify(Msg, tag="modify"):
    rid: str
    patch: SamplingPatch
    steering_vectors: dict[str, bytes] = {}  # the content of the vectors ``patch.steering`` names (as Submit's)


# scheduler -> gateway


class Queued(Msg, tag="queued"):
    """The scheduler took a Submit: ``waiting`` requests (this one included) wait for admission."""

    rid: str
    waiting: int


class TextHandover(Msg, tag="text_handover"):
    """From the next event on, the scheduler sends the text of a ``text_at_gateway`` request: a Modify gave it
    stop strings, which only the scheduler can act on. In order among the ``Events``, after every event whose
    text the gateway works out."""

    rid: str


class RequestState(Msg, tag="request_state"):
    """The answer to Cancel, Pause, Resume and Modify: where the request stands after it."""

    rid: str
    state: str  # "queued" | "running" | "finished"
    paused: bool


class PositionOutput(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """What was asked of one prompt position: the logprob of its token given the tokens before it
    (``logprob`` None when not asked or at position 0), top alternatives, and the concept readout
    (float32 ``[layers][concepts]``, little-endian bytes; empty when not asked)."""

    position: int
    token_id: int
    logprob: float | None = None
    top: list[TokenLogprob] = []
    readout: bytes = b""
    residual: bytes = b""  # OutputRequest.residual_ranges: float32 [residual_layers][hidden], little-endian


class TokenEvent(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """What one step produced for one request.

    ``text`` is the newly releasable text: it never contains a partial stop string nor a partial
    UTF-8 character; held-back text is released on a later event or dropped when it completes a
    stop string. ``tokens`` are the tokens generated this step (a stop string may end text before
    the last of them).
    """

    rid: str
    tokens: list[SampledToken] = []
    text: str = ""
    finish_reason: str | None = None  # "length" | "stop" | "cancelled" | "timeout" | "error"
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # Controlled requests (the AICI runtime protocol): one event per branch per step. ``index`` is the branch's fork
    # index (0: the original sequence); ``fork_finish`` ends that branch only (AICI's reasons: eos,
    # length, stop, aici-stop, fail, abort) while ``finish_reason`` still ends the whole request, on
    # its last event. ``text`` shows a backtrack as " ↩ " followed by the new text (AICI's stream).
    index: int = 0
    fork_finish: str | None = None
    error: str = ""  # why the branch failed (its controller's error)
    logs: str = ""  # the controller's output during this step
    storage: list[Any] = []  # storage write commands the controller executed this step
    micros: int = 0  # time spent in the controller this step
    ff_tokens: int = 0  # tokens the controller fast-forwarded this step
    prompt_outputs: list[PositionOutput] = []  # Submit.outputs at prompt positions (and generated ones' readouts), in position order
    cached_tokens: int = 0  # on the last event: prompt tokens whose KV was reused, not computed
    embedding: bytes = b""  # on the last event, with Submit.outputs.pooling: float32 [hidden], little-endian


class Events(Msg, tag="events", gc=False):
    """All token events of one step for one gateway: one message per step, never one per token.

    Most events are a decoding sequence's next token, nothing else (its text the gateway works out,
    ``Submit.text_at_gateway``): those are packed, as vLLM's engine sends its outputs, entry i of the three
    arrays being ``TokenEvent(rid=rids[i], tokens=[SampledToken(tokens[i], logprobs[i])])``: the scheduler
    appends to three lists where a TokenEvent and a list per token, and the collections they set off, took
    about a sixth of its time (scheduler_sim). The others (a request's last event, prompt outputs, top
    logprobs, text the scheduler works out) are in ``events``; a request's packed entries come before its
    entries there, and :meth:`token_events` gives them all in that order."""

    events: list[TokenEvent] = []
    rids: list[str] = []
    tokens: bytes = b""  # pack_tokens
    logprobs: bytes = b""  # pack_logprobs

    def token_events(self) -> list[TokenEvent]:
        """The packed entries as TokenEvents, then ``events``. ValueError: the arrays are not one entry each."""
        tokens, logprobs = unpack_tokens(self.tokens), unpack_logprobs(self.logprobs)
        if not len(self.rids) == len(tokens) == len(logprobs):
            raise ValueError(f"packed events of {len(self.rids)} rids, {len(tokens)} tokens and "
                             f"{len(logprobs)} logprobs")
        return [TokenEvent(rid=rid, tokens=[SampledToken(token, logprob)])
                for rid, token, logprob in zip(self.rids, tokens, logprobs)] + self.events


class RequestFailed(Msg, tag="request_failed"):
    """A request ended in an error; ``code`` is one of the WebSocket protocol's error types."""

    rid: str
    code: str
    message: str
    recoverable: bool = False
    recovery_action: str = "none"
