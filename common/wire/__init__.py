"""Typed schemas of every internal message, and their msgpack encoding, one module a channel.

A message on a socket is a multipart frame: one msgpack header (a tagged struct, tag field ``type``), then
zero or more raw binary frames (packed mask bitsets, tensors) that the header describes. Receivers decode
with :func:`decode`, which validates the header against these schemas and raises
:class:`common.errors.WireError` on anything malformed.

| module | what |
|---|---|
| :mod:`.base` | ``Msg``, the bounded field types, ``Principal``, ``Ok`` and ``Error`` |
| :mod:`.sampling` | sampling parameters, sampled tokens, images |
| :mod:`.packing` | the packed per-slot arrays (``pack_tokens`` ...) |
| :mod:`.health` | ``Health``, its reply's figures, ``Alive`` |
| :mod:`.gateway` | gateway <-> scheduler |
| :mod:`.worker` | scheduler <-> worker, ``WIRE_VERSION`` |
| :mod:`.store` | gateway -> session store |
| :mod:`.codec` | the tagged union ``Message``, ``encode``, ``decode`` |

Everything is re-exported here: ``from common import wire`` and ``wire.Submit``. The controller runtime's main
and side channels keep the JSON shapes of the AICI runtime protocol instead (``op`` requests, ``type: ok|error``
replies); their schemas live in :mod:`common.aici_wire`.
"""

from __future__ import annotations

from common.wire.base import Count, Error, Finite, Msg, Ok, Principal, U32
from common.wire.sampling import (
    ImageInput, SampledToken, SamplingParams, SamplingPatch, SteeringPositions, SteeringTerm, TokenLogprob,
)
from common.wire.packing import (
    pack_ids, pack_logprobs, pack_tokens, token_array, token_array_bytes, unpack_ids, unpack_logprobs,
    unpack_tokens,
)
from common.wire.health import (
    Alive, ControllerStepStats, EngineStats, GatewayPeer, Health, HealthReply, ModelFacts, WorkerHealth, WorkerLoad,
    WorkerStage,
)
from common.wire.gateway import (
    Cancel, Events, GatewayAlive, Modify, OutputRequest, Pause, PositionOutput, PositionSpan, Queued, RateHit,
    RateVerdict, RequestFailed, RequestState, Resume, SessionDrop, SessionRef, Submit, TextHandover, TokenEvent,
)
from common.wire.worker import (
    ReadoutResult, ScoreQuery, ScoreResult, SeqFailure, SeqStep, Step, StepAbandon, StepMasks, StepResult,
    WIRE_VERSION, WorkerHello, samples_by_seq,
)
from common.wire.store import (
    EvergreenClose, EvergreenDrop, EvergreenFragment, EvergreenGetNodes, EvergreenNodes, EvergreenPut,
    FeedbackEntry, FeedbackRecorded, GetRequest, RecordCompletion, RecordFeedback, RecordRequest, RequestRecord,
    RequestRecordReply, ResponseDelete, ResponseGet, ResponsePut, ResponseRecord, SalienceBegin, SalienceClose,
    SalienceEnd, SalienceFork, SalienceGet, SalienceOpen, SalienceSession, VectorDelete, VectorFound, VectorGet,
    VectorInfo, VectorInfos, VectorList, VectorLookup, VectorPut, VectorReply, VectorTag, VectorTagInfo, VectorTagList,
    VectorTags,
)
from common.wire.codec import DECODE_ERRORS, Message, WireError, decode, encode  # (WireError: what decode raises)
