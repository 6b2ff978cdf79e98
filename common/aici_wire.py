"""The controller runtime's channels, in the JSON shapes of seed 001, carried as msgpack.

Requests carry ``op``; replies are ``{"type": "ok" | "error", "data": ...}``. The main channel is
step-synchronous (one request outstanding); the side channel is asynchronous and every request and
reply carries ``$rid`` (and requests ``$auth``).
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from common.errors import WireError


class MainOp(msgspec.Struct, tag_field="op", kw_only=True, forbid_unknown_fields=False):
    pass


class Ping(MainOp, tag="ping"):
    pass


class Tokens(MainOp, tag="tokens"):
    pass


MainRequest = Union[Ping, Tokens]

_main_decoder = msgspec.msgpack.Decoder(MainRequest)
_encoder = msgspec.msgpack.Encoder()


def encode(obj: Any) -> bytes:
    return _encoder.encode(obj)


def decode_main(frame: bytes) -> MainRequest:
    try:
        return _main_decoder.decode(frame)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise WireError(f"malformed main-channel request: {exc}") from exc


def decode_side(frame: bytes) -> dict[str, Any]:
    """A side-channel request: a map with a string ``$rid`` and ``op``; anything else raises WireError."""
    try:
        request = msgspec.msgpack.decode(frame)
    except msgspec.DecodeError as exc:
        raise WireError(f"malformed side-channel request: {exc}") from exc
    if not isinstance(request, dict):
        raise WireError("side-channel request must be a map")
    if not isinstance(request.get("$rid"), str):
        raise WireError("side-channel request needs a string $rid")
    return request


def decode_reply(frame: bytes) -> dict[str, Any]:
    """A reply as a dict with ``type`` ok|error and ``data``; anything else raises WireError."""
    try:
        reply = msgspec.msgpack.decode(frame)
    except msgspec.DecodeError as exc:
        raise WireError(f"malformed reply: {exc}") from exc
    if not isinstance(reply, dict) or reply.get("type") not in ("ok", "error"):
        raise WireError(f"reply without type ok|error: {reply!r:.200}")
    return reply


def ok(data: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"type": "ok", "data": data, **extra}


def error(message: str, **extra: Any) -> dict[str, Any]:
    return {"type": "error", "error": message, "data": {}, **extra}
