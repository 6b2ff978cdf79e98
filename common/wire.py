"""Typed schemas of every internal message, and their msgpack encoding.

A message on a socket is a multipart frame: one msgpack header (a tagged struct below, tag field
``type``), then zero or more raw binary frames (packed mask bitsets, tensors) that the header
describes. Receivers decode with :func:`decode`, which validates the header against these schemas
and raises :class:`common.errors.WireError` on anything malformed.

The controller runtime's main and side channels keep the JSON shapes of the AICI runtime protocol instead (``op``
requests, ``type: ok|error`` replies); their schemas live in :mod:`common.aici_wire`.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable
from typing import Annotated, Any, Literal, Union

import msgspec

from common.errors import WireError

# Bounded fields of the messages whose values a service stores or indexes with as they come (the session store's
# SQLite integers and uint32 token arrays): a value out of range is a malformed message, refused at decode with the
# field named, instead of an OverflowError deep in the service. Token ids and positions are salience.proto's uint32.
Count = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
U32 = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]
Finite = Annotated[float, msgspec.Meta(ge=-1.7976931348623157e308, le=1.7976931348623157e308)]  # no inf, no nan


class Principal(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Who makes a call, as the gateway identified them (``api_auth``): stored objects belong to ``user``, and
    an ``admin`` reaches every user's (:func:`common.tenancy.may_access`)."""

    user: str
    admin: bool = False


class Msg(msgspec.Struct, tag_field="type", kw_only=True, omit_defaults=True):
    """Base of every internal message. ``mid`` matches a reply to its request."""

    mid: int = 0


# ---------------------------------------------------------------------------------------------
# Sampling


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


class SamplingPatch(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Fields a client may change mid-stream (``control: modify``); None leaves a field as it is."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    max_tokens: int | None = None
    stop: list[str] | None = None


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


# ---------------------------------------------------------------------------------------------
# Common replies


class Ok(Msg, tag="ok"):
    """Done; nothing to report back (replies that carry data have their own types)."""


class Error(Msg, tag="error"):
    code: str
    message: str
    rid: str = ""


class Health(Msg, tag="health"):
    pass


class WorkerStage(msgspec.Struct, kw_only=True):
    """The best stage among a scheduler's workers; generation needs ``ready``."""

    stage: str = "absent"  # "absent" | "loading" | "ready" | "failed"
    progress: int = 0
    message: str = "no worker has connected yet"
    workers: int = 0
    device: str = ""


class ControllerStepStats(msgspec.Struct, kw_only=True):
    """Main-channel cost so far: wall time of post_pre_process/mid_process calls, sequence-steps run, and how
    many controlled steps went out before the result of the step before them (``controllers.pipeline``)."""

    main_s: float = 0.0
    seq_steps: int = 0
    us_per_seq_step: float = 0.0
    followed_steps: int = 0


class WorkerLoad(msgspec.Struct, kw_only=True):
    """One worker as the scheduler sees it: its load, its KV pool and how placement used it."""

    worker: str  # its id (the ZeroMQ identity it announced)
    stage: str
    device: str
    running: int
    kv_capacity_tokens: int
    kv_used_tokens: int
    kv_cached_tokens: int
    kv_free_tokens: int
    kv_reserved_tokens: int
    prefix_blocks_indexed: int  # its prefix blocks in the scheduler's placement index
    prefix_hit_rate: float  # share of the prompt tokens placed there whose KV its cache held
    placed: dict[str, int] = {}  # why sequences went there: reason -> count


class GatewayPeer(msgspec.Struct, kw_only=True):
    """One gateway as the scheduler sees it, from its heartbeats (``GatewayAlive``)."""

    gateway: str  # its ZeroMQ identity (gateway-<host>-<pid>)
    incarnation: str
    requests: int  # its live requests
    silent_s: float  # since its last message


class ModelFacts(msgspec.Struct, kw_only=True):
    """The scheduler's health: the served model's facts (from its first ready worker; the configured
    context before one is) and its load. Gateways admit requests against these, and ``/health``
    shows them as they are."""

    worker: WorkerStage = msgspec.field(default_factory=WorkerStage)
    model: str = ""
    vocab_size: int = 0  # 0: no ready worker yet
    max_model_len: int = 0
    eos_token_ids: list[int] = []
    kv_capacity_tokens: int = 0
    kv_free_tokens: int = 0  # empty, as the workers' last steps left it
    kv_cached_tokens: int = 0  # holding reusable prefixes only (evicted on demand)
    kv_used_tokens: int = 0  # holding live sequences
    kv_reserved_tokens: int = 0  # promised to admitted requests and parked sessions
    queued: int = 0
    running: int = 0
    paused: int = 0
    controller_runtime: str = ""  # "ok", or what is wrong with it
    controller_steps: ControllerStepStats = msgspec.field(default_factory=ControllerStepStats)
    hidden_size: int = 0
    readout_concepts: list[str] = []
    readout_layers: list[int] = []
    parked_sessions: int = 0
    parked_tokens: int = 0
    workers: list[WorkerLoad] = []
    gateways: list[GatewayPeer] = []


class EngineStats(msgspec.Struct, kw_only=True):
    """A ready worker's engine: its backend and its KV pool and prefix-cache figures. Blocks: ``total``
    usable, ``free`` (unreferenced, empty), ``cached`` (unreferenced, holding a reusable prefix), ``used``
    by live sequences; ``kv_*_tokens`` count the same in tokens. The hit rate is the share of fed tokens
    whose KV came from the cache."""

    backend: str
    weights: str
    active_seqs: int
    kv_capacity_tokens: int
    kv_free_tokens: int
    kv_cached_tokens: int
    kv_used_tokens: int
    kv_block_size: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_blocks_cached: int
    kv_blocks_used: int
    kv_evictions: int
    prefix_caching: bool
    prefix_fed_tokens: int
    prefix_cached_tokens: int
    prefix_hit_rate: float


class WorkerHealth(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A worker's answer to Health: its stage, and its engine once ready (else its loading progress and
    message, or why loading failed)."""

    stage: str  # "loading" | "ready" | "failed"
    worker_id: str
    model: str
    device: str = ""
    progress: int = 0
    message: str = ""
    engine: EngineStats | None = None


class HealthReply(Msg, tag="health_reply"):
    """``facts``: the scheduler's; ``worker``: a worker's (other services leave both out)."""

    service: str
    ready: bool
    worker: WorkerHealth | None = None
    facts: ModelFacts | None = None
    incarnation: str = ""  # the answering process's life (common.incarnation)


class Alive(Msg, tag="alive"):
    """The answer to a heartbeat: which life of ``service`` answered (see :mod:`common.incarnation`).
    A peer hearing a new ``incarnation`` knows what it had in flight there is gone."""

    service: str
    incarnation: str


# ---------------------------------------------------------------------------------------------
# gateway -> scheduler


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


# ---------------------------------------------------------------------------------------------
# scheduler <-> worker


class ScoreQuery(msgspec.Struct, array_like=True, gc=False):
    position: int
    target: int


class ScoreResult(msgspec.Struct, array_like=True, gc=False):
    position: int
    target: int
    logprob: float
    top: list[TokenLogprob] = []


class ReadoutResult(msgspec.Struct, array_like=True, gc=False):
    position: int
    values: bytes  # float32 [layers][concepts], little-endian


class SeqStep(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """One sequence's part of a step, applied in this order:

    1. ``fork_of`` (only on a sequence's first SeqStep): start as a copy of that live sequence as it
       stood before this step (its KV blocks shared copy-on-write, its sampling params and history).
    2. ``backtrack``: drop that many tokens from the end of the sequence (its KV is truncated).
    3. feed ``tokens`` (a prompt chunk, fast-forward tokens, or the last sampled token); may be empty
       only after a fork or backtrack with ``sample`` set, or with ``follow``.
    4. when ``sample`` is set, sample the next token from the logits after the last fed token.

    ``follow`` (``tokens`` empty): feed the token the worker sampled for this sequence in its previous
    step, which the scheduler has not seen yet; it lets the scheduler send a decode step before the
    previous step's result is back (the worker never waits for it between steps).

    ``sampling`` is sent when a sequence starts or its parameters change. ``mask_row`` indexes the
    step's mask frame (-1: no mask). ``images`` (positions in the whole sequence) are the images
    whose blocks the fed tokens hold; a block is never split between two SeqSteps."""

    seq_id: int
    tokens: list[int]
    sample: bool = True
    follow: bool = False
    sampling: SamplingParams | None = None
    mask_row: int = -1
    fork_of: int | None = None
    backtrack: int = 0
    images: list[ImageInput] = []
    # Per-position outputs (positions fed in this step; never taken from the prefix cache):
    # ``scores``: the logprob of ``target`` under the logits after ``position``, with
    # ``top_logprobs`` alternatives; ``readouts``: the concept readout of the hidden states at each position;
    # ``pool``: the final hidden states (after the final norm) at these positions, summed (StepResult.pooled).
    scores: list[ScoreQuery] = []
    top_logprobs: int = 0
    readouts: list[int] = []
    pool: list[int] = []
    # Read on the step that creates the sequence (a fork is in its parent's domain; sent with ``sampling``):
    # its cache domain (Submit.cache_domain), the seed of its blocks' hash chain (common.blocks.domain_root).
    cache_domain: str = ""


class Step(Msg, tag="step", gc=False):
    """One batched forward pass. ``free`` lists sequences to drop before it runs; ``free_all`` drops
    every sequence first (a scheduler's first step to a worker: what the worker holds belongs to
    requests of a scheduler that is gone, and its sequence ids will be reused).

    ``follows`` (packed, :func:`pack_ids`) are the sequences that only go on decoding, the bulk of a
    step: each feeds the token it sampled last and samples the next with its parameters as they stand,
    as a ``follow`` SeqStep would, without a SeqStep each. ``seqs`` are the others. The step's *slots*
    are ``follows`` in order, then ``seqs``: its result's arrays are in slot order (:meth:`slot_ids`).

    When any ``mask_row`` is set, one binary frame follows: ``n_rows`` packed bitsets, little-endian
    bit order, ``ceil(vocab_size / 32)`` uint32 words a row; bit set = token allowed.
    """

    step_id: int
    seqs: list[SeqStep]
    follows: bytes = b""
    free: list[int] = []
    free_all: bool = False
    # The masks come later, in a StepMasks of the same step_id (no frame follows the Step): the
    # worker runs the forward pass meanwhile and samples once they arrive.
    masks_follow: bool = False

    def slot_ids(self) -> list[int]:
        """The sequence of each slot."""
        return unpack_ids(self.follows) + [s.seq_id for s in self.seqs]


class SeqFailure(msgspec.Struct, kw_only=True, gc=False):
    seq_id: int
    message: str


class StepMasks(Msg, tag="step_masks"):
    """The sampling part of a Step sent with ``masks_follow``, followed by its mask frame (as a
    Step's frame, rows by ``SeqStep.mask_row``). ``failures``: sampling sequences not to sample this
    step (their tokens stay fed), e.g. their controller stopped, spliced or failed."""

    step_id: int
    failures: list[SeqFailure] = []


class StepAbandon(Msg, tag="step_abandon"):
    """Between the ranks of a tensor-parallel worker only: rank 0 gave up waiting for the
    StepMasks of a ``masks_follow`` step, whose sampling sequences fail with ``reason``."""

    step_id: int
    reason: str


class StepResult(Msg, tag="step_result", gc=False):
    step_id: int
    # One entry per slot of the step (``Step.slot_ids``), packed (``pack_tokens``, ``pack_logprobs``):
    # the token sampled (-1: none, the sequence did not sample or failed) and its logprob.
    tokens: bytes = b""
    logprobs: bytes = b""
    top: dict[int, list[TokenLogprob]] = {}  # slot -> the top alternatives (SamplingParams.logprobs > 0)
    failures: list[SeqFailure] = []
    forward_ms: float = 0.0
    cached_tokens: dict[int, int] = {}  # seq_id -> fed tokens whose KV came from the prefix cache
    scores: dict[int, list[ScoreResult]] = {}  # seq_id -> answers to its SeqStep.scores
    readouts: dict[int, list[ReadoutResult]] = {}  # seq_id -> answers to its SeqStep.readouts
    pooled: dict[int, bytes] = {}  # seq_id -> the sum of its SeqStep.pool positions' states, float32 little-endian
    # the worker's KV pool after the step (-1: not reported): tokens of empty blocks, and of blocks that
    # only hold reusable prefixes (allocations take them when empty ones run out); the rest is in use
    kv_free_tokens: int = -1
    kv_cached_tokens: int = -1
    # block events: keys (common.blocks.block_key) of the prefix blocks the worker's cache registered
    # and forgot since its last step (after a Step with free_all: every block it holds, none gone)
    blocks_new: list[int] = []
    blocks_gone: list[int] = []

    def slots(self) -> tuple[list[int], list[float]]:
        """Each slot's sampled token (-1: none) and its logprob (the alternatives are ``top``'s). ValueError:
        the arrays are malformed (not whole entries, not one each per slot, or ``top`` names a slot past them)."""
        tokens, logprobs = unpack_tokens(self.tokens), unpack_logprobs(self.logprobs)
        if len(tokens) != len(logprobs):
            raise ValueError(f"{len(tokens)} tokens but {len(logprobs)} logprobs")
        if self.top and not all(0 <= slot < len(tokens) for slot in self.top):
            raise ValueError(f"top alternatives for slots {sorted(self.top)} of {len(tokens)}")
        return tokens, logprobs

    def sampled(self) -> list[SampledToken]:
        """Each slot's sampled token (token -1: none), alternatives included (see :meth:`slots`)."""
        tokens, logprobs = self.slots()
        return [SampledToken(token, logprob, self.top.get(slot) or []) for slot, (token, logprob)
                in enumerate(zip(tokens, logprobs))]


def samples_by_seq(step: Step, result: StepResult) -> dict[int, SampledToken]:
    """seq_id -> token of every slot that sampled one (for tools and tests: the scheduler reads the
    result in slot order)."""
    return {seq_id: sampled for seq_id, sampled in zip(step.slot_ids(), result.sampled()) if sampled.token_id >= 0}


# Packed per-slot arrays: little-endian, whatever the host's order.
_SWAP = sys.byteorder != "little"


def _pack(typecode: str, values: Iterable[Any]) -> bytes:
    packed = array(typecode, values)
    if _SWAP:
        packed.byteswap()
    return packed.tobytes()


def _unpack(typecode: str, data: bytes) -> list[Any]:
    """ValueError when ``data`` is not whole entries."""
    return _unpack_array(typecode, data).tolist()


def _unpack_array(typecode: str, data: bytes) -> array:
    packed = array(typecode)
    packed.frombytes(data)
    if _SWAP:
        packed.byteswap()
    return packed


def pack_ids(seq_ids: Iterable[int]) -> bytes:
    """Sequence ids as int64 (``Step.follows``)."""
    return _pack("q", seq_ids)


def unpack_ids(data: bytes) -> list[int]:
    return _unpack("q", data)


def pack_tokens(tokens: Iterable[int]) -> bytes:
    """Token ids as int32 (``StepResult.tokens``)."""
    return _pack("i", tokens)


def unpack_tokens(data: bytes) -> list[int]:
    return _unpack("i", data)


def token_array(data: bytes) -> array:
    """Token ids from :func:`pack_tokens` bytes as an ``array("i")``: how the scheduler keeps a prompt and
    a sequence's tokens. Unlike a list it holds no objects, so the cyclic garbage collector never walks it
    (thousands of live prompts as lists made each collection walk millions of ints)."""
    return _unpack_array("i", data)


def token_array_bytes(tokens: array) -> bytes:
    """An ``array("i")`` of token ids as :func:`pack_tokens` packs them (a copy of its memory)."""
    if _SWAP:
        tokens = array("i", tokens)
        tokens.byteswap()
    return tokens.tobytes()


def pack_logprobs(logprobs: Iterable[float]) -> bytes:
    """Logprobs as float32 (``StepResult.logprobs``): they are float32 log-softmax values, so nothing is lost."""
    return _pack("f", logprobs)


def unpack_logprobs(data: bytes) -> list[float]:
    return _unpack("f", data)


assert array("q").itemsize == 8 and array("i").itemsize == 4 and array("f").itemsize == 4


# The scheduler-worker protocol's version: bump it with any change to the messages between them (Step, StepResult,
# StepMasks, WorkerHello ...) that a peer running older code would misread. A worker names it in every hello; the
# scheduler places work only on workers of its own version (another one is shown as a failed worker, with why).
WIRE_VERSION = 3


class WorkerHello(Msg, tag="worker_hello"):
    """A worker announces itself (before loading) and reports loading progress until ready."""

    worker_id: str
    stage: str  # "loading" | "ready" | "failed"
    progress: int = 0
    message: str = ""
    model: str = ""
    vocab_size: int = 0
    max_model_len: int = 0
    eos_token_ids: list[int] = []
    device: str = ""
    kv_capacity_tokens: int = 0
    hidden_size: int = 0
    readout_concepts: list[str] = []
    readout_layers: list[int] = []
    incarnation: str = ""  # the worker process's life: a new one holds none of the old one's sequences
    wire_version: int = 0  # WIRE_VERSION of the worker's code (0: code from before versions)


# ---------------------------------------------------------------------------------------------
# gateway -> session store


class RecordRequest(Msg, tag="record_request"):
    rid: str
    owner: str  # the user whose request it is: only they (and admins) may read it or give feedback on it
    surface: str  # "websocket" | "rest" | "openai" | ...
    model: str
    prompt: str
    params: dict[str, Any] = {}
    created_at: Finite = 0.0


class RecordCompletion(Msg, tag="record_completion"):
    rid: str
    generated_text: str
    finish_reason: str
    prompt_tokens: Count
    completion_tokens: Count
    error: str = ""


class RecordFeedback(Msg, tag="record_feedback"):
    """Replied with :class:`FeedbackRecorded`, or ``Error(code="not_found")`` for an unknown request."""

    rid: str
    caller: Principal
    rating: Finite
    text: str = ""
    position: Count | None = None


class FeedbackRecorded(Msg, tag="feedback_recorded"):
    feedback_id: int


class GetRequest(Msg, tag="get_request"):
    """Replied with :class:`RequestRecordReply`, or ``Error(code="not_found")`` (also for another user's request)."""

    rid: str
    caller: Principal


class FeedbackEntry(msgspec.Struct, kw_only=True):
    """One piece of feedback on a request, as stored."""

    id: int
    rating: float
    text: str
    position: int | None
    created_at: float


class RequestRecord(msgspec.Struct, kw_only=True):
    """A request's stored record; the fields a request has not reached yet (its completion) are None.
    ``GET /v1/requests/{rid}`` shows it as JSON, every field included."""

    rid: str
    surface: str
    model: str
    prompt: str
    params: dict[str, Any]
    created_at: float
    generated_text: str | None
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    error: str | None
    finished_at: float | None
    feedback: list[FeedbackEntry]


class RequestRecordReply(Msg, tag="request_record"):
    record: RequestRecord


# gateway -> session store: Evergreen node graphs, keyed by an Evergreen session id


class EvergreenFragment(msgspec.Struct, kw_only=True, array_like=True):
    """One node fragment as received or produced: ``fragment`` is a serialized ``evergreen.v2.NodeFragment``."""

    node_id: str
    seq: int
    fragment: bytes


class EvergreenPut(Msg, tag="evergreen_put"):
    """Fragments of a session's nodes; a (node, seq) already stored keeps its first fragment."""

    session_id: str
    fragments: list[EvergreenFragment]


class EvergreenDrop(Msg, tag="evergreen_drop"):
    session_id: str
    node_ids: list[str]


class EvergreenClose(Msg, tag="evergreen_close"):
    """The session ended (closed or aborted): every node of it is dropped."""

    session_id: str


class EvergreenGetNodes(Msg, tag="evergreen_get_nodes"):
    """Replied with :class:`EvergreenNodes`."""

    session_id: str


class EvergreenNodes(Msg, tag="evergreen_nodes"):
    """A session's stored fragments in (node, seq) order."""

    fragments: list[EvergreenFragment] = []


# gateway -> session store: Salience sessions (salience.proto). Errors use codes not_found,
# failed_precondition, resource_exhausted and aborted (the gRPC status the gateway answers with). A session
# belongs to the user who opened it (a fork, to the user who forked it): to ``caller``s who are neither it nor
# an admin, every message naming it answers not_found, as for a session that does not exist.


class SalienceOpen(Msg, tag="salience_open"):
    model: str
    caller: Principal  # the session's owner


class SalienceClose(Msg, tag="salience_close"):
    """Replied with the closed session's (empty) SalienceSession; closing an unknown or closed session, or another
    user's, is Ok and changes nothing."""

    session_id: str
    caller: Principal


class SalienceFork(Msg, tag="salience_fork"):
    """A new session with tokens ``[0, at_position)`` and the images wholly inside them."""

    session_id: str
    caller: Principal
    at_position: U32


class SalienceGet(Msg, tag="salience_get"):
    session_id: str
    caller: Principal


class SalienceBegin(Msg, tag="salience_begin"):
    """Start a turn: check ``offset``/``truncating`` (the proto's rule), rewind, append
    ``append_tokens`` and ``images``, and take the session's busy lease (``lease_s``). Refused with
    resource_exhausted when the new length plus ``reserve_tokens`` exceeds ``max_len``. With
    ``check_only`` it only makes those checks (the reply is then an empty session): nothing changes."""

    session_id: str
    caller: Principal
    offset: U32
    max_len: Count
    lease_s: Annotated[float, msgspec.Meta(ge=0.0, le=1e9)]
    truncating: bool = False
    append_tokens: list[U32] = []
    images: list[ImageInput] = []
    reserve_tokens: Count = 0
    check_only: bool = False


class SalienceEnd(Msg, tag="salience_end"):
    """End a turn: append the tokens the client was sent and release the lease."""

    session_id: str
    lease: str
    append_tokens: list[U32] = []


class SalienceSession(Msg, tag="salience_session"):
    """A session's state (the reply to Open, Fork, Get and Begin; ``lease`` only for Begin)."""

    session_id: str
    tokens: list[int] = []
    images: list[ImageInput] = []
    parent: str = ""
    lease: str = ""


# gateway -> session store: stored responses of the OpenAI Responses API (``store: true``)


class ResponsePut(Msg, tag="response_put"):
    """Keep a response: its JSON body, its own input items and the conversation it ends (the items a
    ``previous_response_id`` continues), each JSON text; kept ``ttl_s`` from now. Replied with Ok."""

    response_id: str
    owner: str  # the user who created it: only they see it
    body: str
    input_items: str
    conversation: str
    ttl_s: Annotated[float, msgspec.Meta(gt=0, le=1e12)]


class ResponseGet(Msg, tag="response_get"):
    """Replied with :class:`ResponseRecord`, or ``Error(code="not_found")`` (unknown, deleted or expired)."""

    response_id: str


class ResponseDelete(Msg, tag="response_delete"):
    """Replied with Ok, or ``Error(code="not_found")``."""

    response_id: str


class ResponseRecord(Msg, tag="response_record"):
    response_id: str
    owner: str
    body: str
    input_items: str
    conversation: str
    created_at: float


Message = Union[
    Ok,
    Error,
    Health,
    HealthReply,
    Alive,
    Submit,
    Cancel,
    GatewayAlive,
    RateHit,
    RateVerdict,
    SessionDrop,
    Pause,
    Resume,
    Modify,
    Queued,
    RequestState,
    TextHandover,
    Events,
    RequestFailed,
    Step,
    StepMasks,
    StepAbandon,
    StepResult,
    WorkerHello,
    RecordRequest,
    RecordCompletion,
    RecordFeedback,
    FeedbackRecorded,
    GetRequest,
    RequestRecordReply,
    EvergreenPut,
    EvergreenDrop,
    EvergreenClose,
    EvergreenGetNodes,
    EvergreenNodes,
    SalienceOpen,
    SalienceClose,
    SalienceFork,
    SalienceGet,
    SalienceBegin,
    SalienceEnd,
    SalienceSession,
    ResponsePut,
    ResponseGet,
    ResponseDelete,
    ResponseRecord,
]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Msg) -> bytes:
    return _encoder.encode(msg)


# What decoding a frame raises on malformed input: RecursionError too, for values nested past the decoder's depth
# (even in a field the schema ignores), which crashed the session store and stalled a socket's reader.
DECODE_ERRORS = (msgspec.ValidationError, msgspec.DecodeError, RecursionError)


def decode(header: bytes) -> Message:
    """Decode and validate a header frame; malformed input raises WireError, never anything else."""
    try:
        return _decoder.decode(header)
    except DECODE_ERRORS as exc:
        raise WireError(f"malformed message: {exc}") from exc
