"""From a GENERATE input's flattened chunks to the chat turns of its prompt.

Text chunks (``text/plain``, and any other ``text/*``) are concatenated into turns; a turn ends at
an ``application/x-protobuf; type=EndOfTurn`` chunk or where the role changes. A chunk's role comes
from its metadata (``user`` when empty; the server marks its GENERATE outputs ``assistant``). Any
other media type is refused: the model takes text only.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.protos.evergreen.v2 import evergreen_pb2 as eg
from services.gateway.evergreen.errors import SessionAbort

END_OF_TURN = "application/x-protobuf; type=EndOfTurn"
ROLES = ("system", "user", "assistant")
DEFAULT_ROLE = "user"


def _parse(mimetype: str) -> tuple[str, dict[str, str]]:
    main, *params = (p.strip() for p in mimetype.split(";"))
    pairs = (p.partition("=") for p in params if p)
    return main.lower(), {k.strip().lower(): v.strip().strip('"') for k, _, v in pairs}


def is_end_of_turn(mimetype: str) -> bool:
    main, params = _parse(mimetype)
    return main == "application/x-protobuf" and params.get("type") in ("EndOfTurn", "evergreen.v2.EndOfTurn")


def is_text(mimetype: str) -> bool:
    return _parse(mimetype)[0].startswith("text/")


def check_media(node_id: str, metadata: eg.ChunkMetadata, model: str) -> None:
    """Refuse a chunk the model cannot take, or a role the chat template does not know."""
    if not (is_text(metadata.mimetype) or is_end_of_turn(metadata.mimetype)):
        raise SessionAbort.invalid(
            f"node {node_id!r}: mimetype {metadata.mimetype!r} cannot be given to {model}, which takes text only "
            f"(text/* chunks and {END_OF_TURN!r} markers)"
        )
    if metadata.role and metadata.role not in ROLES:
        raise SessionAbort.invalid(f"node {node_id!r}: role {metadata.role!r} is not one of {', '.join(ROLES)}")


@dataclass
class _Turn:
    role: str
    parts: list[str]


def to_turns(chunks: list[tuple[str, eg.ChunkMetadata, bytes]]) -> list[dict[str, str]]:
    """``(node id, metadata, payload)`` chunks in order as chat messages ``{"role", "content"}``."""
    turns: list[_Turn] = []
    open_turn: _Turn | None = None
    for node_id, metadata, payload in chunks:
        if is_end_of_turn(metadata.mimetype):
            open_turn = None
            continue
        try:
            text = payload.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SessionAbort.invalid(f"node {node_id!r}: text is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
        role = metadata.role or DEFAULT_ROLE
        if open_turn is None or open_turn.role != role:
            open_turn = _Turn(role, [])
            turns.append(open_turn)
        open_turn.parts.append(text)
    messages = [{"role": t.role, "content": "".join(t.parts)} for t in turns]
    if not messages:
        raise SessionAbort.invalid("the GENERATE input holds no text: no text/* chunk, only end-of-turn markers or none")
    return messages
