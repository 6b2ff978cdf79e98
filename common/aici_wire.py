"""The controller runtime's channels, in the JSON shapes of the AICI runtime protocol, carried as msgpack.

Requests carry ``op``; replies are ``{"type": "ok" | "error", "data": ...}``. The main channel is
step-synchronous (one request outstanding); the side channel is asynchronous and every request and
reply carries ``$rid`` (and requests ``$auth``).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Generic, Literal, TypeVar, Union

import msgspec

from common.errors import WireError
from common.wire import DECODE_ERRORS, SteeringTerm


# Counts and token ids a controller returns (u32 in the ABI): a negative one is an invalid result. (A backtrack of
# -1 was taken as is and left its request waiting for a step that never came.)
NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class MainOp(msgspec.Struct, tag_field="op", kw_only=True, forbid_unknown_fields=False):
    pass


class Ping(MainOp, tag="ping"):
    pass


class Tokens(MainOp, tag="tokens"):
    pass


class PostOp(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The tokens the engine appended to sequence ``id`` since the controller last saw it (the sampled
    token, or a Splice's ff_tokens) after removing ``backtrack`` tokens."""

    id: int
    tokens: list[int] = []
    backtrack: int = 0


class PreOp(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Bind the controller instantiated for ``req_id`` to the new sequence ``id``. Tiller: what its steering and
    readout host calls know (ABI.md "Steering and readouts"): the worker's readout ``concepts`` and
    ``readout_layers``, the model's ``num_layers`` (0: unknown), and the layers of each vector the request's own
    steering carries, by id."""

    id: int
    req_id: str
    concepts: list[str] = []
    readout_layers: list[int] = []
    num_layers: int = 0
    vectors: dict[str, list[int]] = {}


class SeqReadout(msgspec.Struct, array_like=True):
    """The readout of the last position the worker fed for sequence ``id``: float32 [readout layers][concepts],
    little-endian (``SeqStep.readouts``)."""

    id: int
    values: bytes


class PostPreProcess(MainOp, tag="post_pre_process"):
    post_ops: list[PostOp] = []
    pre_ops: list[PreOp] = []
    freed: list[int] = []
    reset: bool = False  # Tiller: drop every bound sequence first (a scheduler's first call after it started)
    # Tiller: sequences whose next step already went out (fed their sampled token, to sample under this step's
    # mask): their pre_process runs only where the controller flags it as its default (so it is not called);
    # the others' waits for the next call (``PostPreProcessReply.waiting``)
    ahead: list[int] = []
    # Tiller: then run mid_process, in the same call, for the ``ahead`` sequences that go on (post_process neither
    # stopped nor failed them, and their pre_process is the default), in ``ahead`` order: one round trip a step
    # instead of two (``PostPreProcessReply.mid``, its mask rows in the reply's binary frame)
    mid_ahead: bool = False
    # Tiller: the readouts the worker returned since the last call, for the sequences that asked (tiller_readout);
    # set before any callback of this call runs
    readouts: list[SeqReadout] = []


class MidOp(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Run mid_process for ``id``; with ``clone_id`` the sequence is first forked from that parent."""

    id: int
    clone_id: int | None = None


class MidProcess(MainOp, tag="mid_process"):
    ops: list[MidOp] = []


MainRequest = Union[Ping, Tokens, PostPreProcess, MidProcess]


# -- controller callback results (JSON from a guest, dicts from a native controller) ------------------

class PreProcessResult(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    num_forks: NonNegative = 1  # 0 = stop, >1 = fork into that many
    suspend: bool = False
    ff_tokens: list[NonNegative] = []


class PostProcessResult(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    stop: bool = False


class Splice(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    backtrack: NonNegative = 0
    ff_tokens: list[NonNegative] = []


class MidBranch(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """``{"SampleWithBias": {}}`` or ``{"Splice": {...}}``; exactly one key."""

    SampleWithBias: dict | None = None
    Splice: Splice | None = None


MidProcessResult = Union[Literal["Stop"], MidBranch]


# -- main-channel replies: an ok reply's ``data`` -------------------------------------------------

class SeqOutcome(msgspec.Struct, kw_only=True):
    """One sequence's callback in a reply: its ``result`` or ``error``, and what it printed, stored, cost."""

    error: str = ""
    logs: str = ""
    storage: list[Any] = []
    micros: int = 0


class InitOutcome(SeqOutcome):
    """instantiate's outcome (the side channel's reply data): ``result`` is ``{}`` when it succeeded."""

    result: dict[str, Any] | None = None


class PostOutcome(SeqOutcome):
    result: PostProcessResult | None = None


class PreOutcome(SeqOutcome):
    result: PreProcessResult | None = None


class MidOutcome(SeqOutcome):
    result: MidProcessResult | None = None  # None samples, as SampleWithBias does


class SeqSteering(msgspec.Struct, kw_only=True):
    """Sequence ``id``'s whole activation steering from its next fed token on, as its controller set it last
    (``tiller_steer``; [] none)."""

    id: int
    terms: list[SteeringTerm]


class HostEffects(msgspec.Struct, kw_only=True):
    """Tiller, in every main-channel reply but ping's and tokens': what the call's controllers asked of the
    scheduler through host calls (ABI.md "Steering and readouts"): steering changes, and the sequences that asked
    for readouts in it (from then on, each step reads out the last position it feeds)."""

    steering: list[SeqSteering] = []
    readouts_on: list[int] = []


class MidProcessReply(HostEffects):
    """Per sequence id (as a string); the mask rows follow in the reply's binary frame."""

    seqs: dict[str, MidOutcome] = {}
    num_seqs: int = 0


class PostPreProcessReply(HostEffects):
    """Per sequence id (as a string): post_process of the post_ops, pre_process of every bound sequence."""

    post_seqs: dict[str, PostOutcome] = {}
    pre_seqs: dict[str, PreOutcome] = {}
    waiting: list[int] = []  # Tiller: ``ahead`` sequences whose pre_process was not run (not in pre_seqs)
    pre_default: list[int] = []  # Tiller: those whose controller flags pre_process as the default (not called)
    # Tiller, for ``mid_ahead``: the mid_process that ran (None: none was asked for, or the runtime does not know
    # mid_ahead), for the sequences ``mid_ids`` in the order of their mask rows
    mid: MidProcessReply | None = None
    mid_ids: list[int] = []


class Pong(msgspec.Struct, kw_only=True):
    pong: int = 1


class TokensReply(msgspec.Struct, kw_only=True):
    vocab_size: int
    eos_token_id: int


D = TypeVar("D")


class MainOk(msgspec.Struct, Generic[D], tag_field="type", tag="ok"):
    """A main-channel ok reply; ``data`` is the reply type of the request's op (:data:`REPLY_DATA`).
    ``incarnation``: the runtime process's life (common.incarnation; a restarted one bound nothing)."""

    data: D
    incarnation: str = ""


class MainError(msgspec.Struct, tag_field="type", tag="error"):
    error: str
    is_user_error: bool = False
    data: dict[str, Any] = {}
    incarnation: str = ""


REPLY_DATA: dict[type[MainOp], type] = {Ping: Pong, Tokens: TokensReply, PostPreProcess: PostPreProcessReply,
                                        MidProcess: MidProcessReply}
_reply_decoders = {op: msgspec.msgpack.Decoder(Union[MainOk[data], MainError]) for op, data in REPLY_DATA.items()}
_main_decoder = msgspec.msgpack.Decoder(MainRequest)
_encoder = msgspec.msgpack.Encoder()


def encode(obj: Any) -> bytes:
    return _encoder.encode(obj)


def decode_main(frame: bytes) -> MainRequest:
    try:
        return _main_decoder.decode(frame)
    except DECODE_ERRORS as exc:
        raise WireError(f"malformed main-channel request: {exc}") from exc


def decode_main_reply(request: MainRequest, frame: bytes) -> MainOk[Any] | MainError:
    """The reply to ``request``, its ``data`` typed by the request's op; anything else raises WireError."""
    try:
        return _reply_decoders[type(request)].decode(frame)
    except DECODE_ERRORS as exc:
        raise WireError(f"malformed reply: {exc}") from exc


def module_arg_text(arg: Any) -> str:
    """AICI's module_arg: a string is passed as is, any other JSON value serialized as serde_json does
    (compact, UTF-8); a missing one is empty."""
    if arg is None:
        return ""
    return arg if isinstance(arg, str) else json.dumps(arg, separators=(",", ":"), ensure_ascii=False)


class SideRequestError(WireError):
    """A side-channel request that is a map but not a valid one; ``rid`` is its ``$rid`` (any type) or None."""

    def __init__(self, message: str, rid: Any) -> None:
        super().__init__(message)
        self.rid = rid


def decode_side(frame: bytes) -> dict[str, Any]:
    """A side-channel request: a map with a string ``$rid`` and ``op``; anything else raises WireError
    (SideRequestError for a map, carrying whatever ``$rid`` it had so that the error reply echoes it)."""
    try:
        request = msgspec.msgpack.decode(frame)
    except DECODE_ERRORS as exc:
        raise WireError(f"malformed side-channel request: {exc}") from exc
    if not isinstance(request, dict):
        raise WireError("side-channel request must be a map")
    if not isinstance(request.get("$rid"), str):
        raise SideRequestError("side-channel request needs a string $rid", request.get("$rid"))
    return request


def decode_reply(frame: bytes) -> dict[str, Any]:
    """A side-channel reply as a dict with ``type`` ok|error and ``data``; anything else raises WireError."""
    try:
        reply = msgspec.msgpack.decode(frame)
    except DECODE_ERRORS as exc:
        raise WireError(f"malformed reply: {exc}") from exc
    if not isinstance(reply, dict) or reply.get("type") not in ("ok", "error"):
        raise WireError(f"reply without type ok|error: {reply!r:.200}")
    return reply


def ok(data: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"type": "ok", "data": data, **extra}


def error(message: str, **extra: Any) -> dict[str, Any]:
    return {"type": "error", "error": message, "data": {}, **extra}
