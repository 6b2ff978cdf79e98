"""JSON from clients (HTTP bodies, WebSocket frames) parsed with its nesting bounded by
``limits.max_json_depth``: a deeper document is the client's ``invalid_request`` naming the limit, never a
parser's recursion error (Python's parser gives up near 1,000 levels, and everything downstream recurses too)."""

from __future__ import annotations

import json
from typing import Any

from common.errors import INVALID_REQUEST
from services.gateway.protocol import GatewayError


def nesting_depth(value: Any) -> int:
    """How deeply arrays and objects nest in a parsed JSON value (a scalar: 0); no recursion."""
    if not isinstance(value, dict | list):
        return 0
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return deepest


def _too_deep(what: str, max_depth: int) -> GatewayError:
    return GatewayError(INVALID_REQUEST, f"{what} nests JSON arrays and objects deeper than {max_depth} levels "
                                         "(limits.max_json_depth)")


def parse_json(raw: str | bytes, max_depth: int, what: str) -> Any:
    """``raw`` as JSON nested at most ``max_depth`` deep; else ``invalid_request`` naming ``what``."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise GatewayError(INVALID_REQUEST, f"{what} is not valid JSON: {exc}") from None
    except RecursionError:
        raise _too_deep(what, max_depth) from None
    opening = raw.count("[" if isinstance(raw, str) else b"[") + raw.count("{" if isinstance(raw, str) else b"{")
    if opening > max_depth and nesting_depth(data) > max_depth:  # fewer brackets cannot nest deeper
        raise _too_deep(what, max_depth)
    return data
