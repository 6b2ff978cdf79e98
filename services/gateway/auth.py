"""Who may call: one token scheme for every surface (HTTP routes, the WebSocket, both gRPC services).

With ``api_auth.tokens`` and ``api_auth.everywhere`` configured, every surface needs one of those tokens;
Salience also takes ``sessions.auth_token`` (and needs it, when set, even without ``api_auth``). A call presents
its token as ``Authorization: Bearer <token>`` (HTTP header or gRPC metadata), or as the value of
``api_auth.key_header``. Pure: the HTTP middleware and the gRPC interceptor ask :func:`refusal`.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping

from common.config import Settings

HTTP = "http"
EVERGREEN = "evergreen"
SALIENCE = "salience"


def presented_token(headers: Mapping[str, str], key_header: str) -> str:
    """The token a call presents: ``authorization: Bearer <token>``, else the key header's value."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer":
        return token.strip()
    return headers.get(key_header, "").strip()


def accepted_tokens(settings: Settings, surface: str) -> frozenset[str]:
    """The tokens that open ``surface``; none: it is open to every caller."""
    auth = settings.api_auth
    tokens = set(auth.tokens) if auth.everywhere else set()
    if surface == SALIENCE and settings.sessions.auth_token:
        tokens.add(settings.sessions.auth_token)
    return frozenset(tokens)


def refusal(accepted: frozenset[str], token: str, key_header: str) -> str | None:
    """Why a call presenting ``token`` is refused (None: it may pass)."""
    if not accepted:
        return None
    if not token:
        return f"this server needs 'authorization: Bearer <token>' (or '{key_header}: <token>') with a known token"
    if not any(hmac.compare_digest(token.encode(), known.encode()) for known in accepted):
        return "the bearer token is not valid"
    return None
