"""JSON from clients (HTTP bodies, WebSocket frames) parsed with its nesting bounded by
``limits.max_json_depth``: a deeper document is the client's ``invalid_request`` naming the limit, never a
parser's recursion error (Python's parser gives up near 1,000 levels, and everything downstream recurses too).
Its text must be Unicode: UTF-8 bytes, and no lone surrogate escaped as ``\\ud800`` (Python's parser lets both
through, and the string then fails wherever it is encoded: the tokenizer, a log line, the error naming it)."""

from __future__ import annotations

import json
import re
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


# a UTF-16 surrogate escaped in JSON text: paired ones (an escaped emoji) are fine, a lone one is not Unicode
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _strings(value: Any) -> list[str]:
    """Every string in a parsed JSON value, keys included; no recursion."""
    found, stack = [], [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            found.append(item)
        elif isinstance(item, dict):
            found.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


def _too_deep(what: str, max_depth: int) -> GatewayError:
    return GatewayError(INVALID_REQUEST, f"{what} nests JSON arrays and objects deeper than {max_depth} levels "
                                         "(limits.max_json_depth)")


def parse_json(raw: str | bytes, max_depth: int, what: str) -> Any:
    """``raw`` as JSON nested at most ``max_depth`` deep; else ``invalid_request`` naming ``what``."""
    try:
        text = raw if isinstance(raw, str) else raw.decode()  # strictly: json.loads would let surrogates through
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise GatewayError(INVALID_REQUEST, f"{what} is not valid JSON: {exc}") from None
    except RecursionError:
        raise _too_deep(what, max_depth) from None
    if text.count("[") + text.count("{") > max_depth and nesting_depth(data) > max_depth:  # fewer cannot nest deeper
        raise _too_deep(what, max_depth)
    if _SURROGATE_ESCAPE.search(text):
        for string in _strings(data):
            try:
                string.encode()
            except UnicodeEncodeError:
                raise GatewayError(INVALID_REQUEST, f"{what} is not valid JSON: a string holds a lone UTF-16 "
                                   f"surrogate ({string.encode('utf-8', 'backslashreplace').decode()[:80]!r})") from None
    return data
