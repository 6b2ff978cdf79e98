"""Every message as one tagged union (``Message``), and its msgpack encoding: ``encode``, and ``decode``, which
validates a header against the schemas and raises ``WireError`` on anything malformed."""

from __future__ import annotations

from typing import Union

import msgspec

from common.errors import WireError
from common.wire.base import Error, Msg, Ok
from common.wire.gateway import (
    Cancel, Events, GatewayAlive, Modify, Pause, Queued, RateHit, RateVerdict, RequestFailed, RequestState, Resume,
    SessionDrop, Submit, TextHandover,
)
from common.wire.health import Alive, Health, HealthReply
from common.wire.store import (
    EvergreenClose, EvergreenDrop, EvergreenGetNodes, EvergreenNodes, EvergreenPut, FeedbackRecorded, GetRequest,
    RecordCompletion, RecordFeedback, RecordRequest, RequestRecordReply, ResponseDelete, ResponseGet, ResponsePut,
    ResponseRecord, SalienceBegin, SalienceClose, SalienceEnd, SalienceFork, SalienceGet, SalienceOpen,
    SalienceSession, VectorDelete, VectorFound, VectorGet, VectorInfos, VectorList, VectorLookup, VectorPut,
    VectorReply, VectorTag, VectorTagList, VectorTags,
)
from common.wire.worker import Step, StepAbandon, StepMasks, StepResult, WorkerHello


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
    VectorPut,
    VectorGet,
    VectorList,
    VectorDelete,
    VectorTag,
    VectorTagList,
    VectorLookup,
    VectorReply,
    VectorInfos,
    VectorTags,
    VectorFound,
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
