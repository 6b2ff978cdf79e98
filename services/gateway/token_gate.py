"""``api_auth.everywhere``: with tokens configured, every HTTP route and WebSocket needs one, as
vLLM's ``--api-key`` guards its whole API. Health and metrics stay open for probes and scrapers.
"""

from __future__ import annotations

from starlette.requests import HTTPConnection
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from common.config import Settings
from services.gateway.auth import HTTP, accepted_tokens, presented_token, refusal

OPEN_PATHS = ("/health", "/metrics")
POLICY_VIOLATION = 1008  # WebSocket close code: the handshake is refused (HTTP 403)


class TokenGate:
    """ASGI middleware refusing a request without a configured token: HTTP 401 with an OpenAI-style
    error body, or a refused WebSocket handshake."""

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.settings = settings
        self.tokens = accepted_tokens(settings, HTTP)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        key_header = self.settings.api_auth.key_header
        problem = refusal(self.tokens, presented_token(HTTPConnection(scope).headers, key_header), key_header)
        if problem is None:
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": POLICY_VIOLATION, "reason": "unauthorized"})
            return
        body = {"error": {"message": problem, "type": "authentication_error", "param": None, "code": "unauthorized"}}
        await JSONResponse(body, status_code=401)(scope, receive, send)
