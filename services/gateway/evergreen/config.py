"""Action configs: one ``google.protobuf.Struct`` packed in ``Action.configs`` (an ``Any``).

A Struct needs no proto of ours on the client: ``any.Pack(Struct(...))``. Its keys are validated
with the same rules (and messages) as the WebSocket ``parameters``:

* GENERATE: ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``repetition_penalty``, ``seed``,
  ``stop``, ``ignore_eos``; ``controller`` / ``controller_arg`` are recognised and refused (not yet
  supported on this surface);
* SET_TTL: ``ttl_s``.

Struct numbers are doubles; integral ones are read as integers.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from google.protobuf import json_format, struct_pb2
from google.protobuf.message import DecodeError
from pydantic import BaseModel, Field

from common.config import Settings
from common.protos.evergreen.v2 import evergreen_pb2 as eg
from services.gateway.evergreen.errors import SessionAbort
from services.gateway.protocol import GatewayError
from services.gateway.validation import Context, Parameters, StrictModel, validate

M = TypeVar("M", bound=BaseModel)


class GenerateParams(Parameters):
    controller: str | None = None
    controller_arg: Any = None


class TtlParams(StrictModel):
    ttl_s: Annotated[float, Field(gt=0)]


def _integral(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_integral(v) for v in value]
    if isinstance(value, dict):
        return {k: _integral(v) for k, v in value.items()}
    return value


def action_config(action: eg.Action, model: type[M], settings: Settings, *, required: bool = False) -> M:
    """The action's config validated as ``model`` (its defaults when none is given)."""
    what = f"{action.name}: configs"
    if len(action.configs) > 1:
        raise SessionAbort.invalid(f"{what}: give at most one config (got {len(action.configs)})")
    data: dict[str, Any] = {}
    if action.configs:
        packed = action.configs[0]
        if not packed.Is(struct_pb2.Struct.DESCRIPTOR):
            raise SessionAbort.invalid(
                f"{what}: unsupported type {packed.type_url!r}; pack a google.protobuf.Struct"
            )
        struct = struct_pb2.Struct()
        try:
            packed.Unpack(struct)
        except DecodeError as exc:  # e.g. a string that is not valid UTF-8
            raise SessionAbort.invalid(f"{what}: not a valid google.protobuf.Struct: {exc}") from None
        data = _integral(json_format.MessageToDict(struct))
    elif required:
        raise SessionAbort.invalid(f"{what}: a config is required")
    try:
        return validate(model, data, Context.of(settings), prefix=what)
    except GatewayError as exc:
        raise SessionAbort.invalid(exc.message) from None
