"""The gateway -> session store channel: request records and feedback, Evergreen node graphs, Salience
sessions, stored Responses, steering vectors."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from common.wire.base import Count, Finite, Msg, Principal, U32
from common.wire.sampling import ImageInput


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


# gateway -> session store: steering vectors (docs/steering.md, "Vectors"), content-addressed: a vector's id is the
# SHA-256 of its canonical form (common.steering). A user reaches a vector they uploaded (they hold it), one a tag
# they see points at, and an admin every vector; to anyone else it is unknown (not_found, as an id no one stored).
# Tags follow common.tags. Refusals: not_found, invalid_request (bad content or tag), rate_limited (past
# steering.max_vectors_per_user).


class VectorInfo(msgspec.Struct, kw_only=True):
    """What is known of a stored vector without its content: ``norms[i]`` is the Euclidean norm of layer
    ``layers[i]``'s direction; ``tags`` are the ones pointing at it that the caller sees."""

    id: str
    hidden_size: int
    layers: list[int]
    norms: list[float]
    tags: list[str] = []
    created_at: float = 0.0


class VectorTagInfo(msgspec.Struct, kw_only=True):
    tag: str
    vector_id: str
    updated_at: float
    updated_by: str


class VectorPut(Msg, tag="vector_put"):
    """Store ``content`` (a canonical vector) as ``caller``'s and point ``tags`` at it, all or nothing (a refused
    tag stores nothing); storing a vector again costs nothing. Replied with :class:`VectorReply`."""

    caller: Principal
    content: bytes
    tags: list[str] = []


class VectorGet(Msg, tag="vector_get"):
    """A vector by id or tag; replied with :class:`VectorReply`."""

    ref: str
    caller: Principal


class VectorList(Msg, tag="vector_list"):
    """The vectors ``caller`` reaches, newest first; replied with :class:`VectorInfos`."""

    caller: Principal


class VectorDelete(Msg, tag="vector_delete"):
    """``caller`` lets go of a vector they uploaded, and of their tags on it; the vector itself, with every tag on
    it, goes when no uploader holds it any more (an admin's delete: at once). Replied with Ok."""

    vector_id: str
    caller: Principal


class VectorTag(Msg, tag="vector_tag"):
    """Point ``tags`` at a vector ``caller`` reaches, all or nothing; replied with :class:`VectorTags` (those set)."""

    vector_id: str
    tags: list[str]
    caller: Principal


class VectorTagList(Msg, tag="vector_tag_list"):
    """The tags ``caller`` sees, most recently moved first; replied with :class:`VectorTags`."""

    caller: Principal


class VectorLookup(Msg, tag="vector_lookup"):
    """Resolve a request's steering: the id each of ``refs`` (an id or a tag) names for ``caller``, and the content of
    those not in ``cached`` (ids the gateway holds already: content never changes). Replied with
    :class:`VectorFound`, or not_found naming the first ref ``caller`` does not reach."""

    refs: list[str]
    caller: Principal
    cached: list[str] = []


class VectorReply(Msg, tag="vector"):
    info: VectorInfo


class VectorInfos(Msg, tag="vectors"):
    vectors: list[VectorInfo] = []


class VectorTags(Msg, tag="vector_tags"):
    tags: list[VectorTagInfo] = []


class VectorFound(Msg, tag="vector_found"):
    ids: list[str]  # refs[i]'s vector id
    contents: dict[str, bytes] = {}  # canonical content by id, for the ids not cached
