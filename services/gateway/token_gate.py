"""``api_auth.everywhere``: with tokens configured, every HTTP route and WebSocket needs one, as
vLLM's ``--api-key`` guards its whole API. Health and metrics stay open for probes and scrapers.
"""

from __future__ import annotations

from starlette.requests import HTTPConnection
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from common.config import Settings
from services.gateway.side_channel import presented_token

OPEN_PATHS = ("/health", "/metrics")
POLICY_VIOLATION = 1008  # WebSocket close code: the handshake is refused (HTTP 403)


class TokenGate:
    """ASGI middleware refusing a request without a configured token: HTTP 401 with an OpenAI-style
    error body, or a refused WebSocket handshake."""

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        if presented_token(HTTPConnection(scope), self.settings) in self.settings.api_auth.tokens:
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": POLICY_VIOLATION, "reason": "unauthorized"})
            return
        key_header = self.settings.api_auth.key_header
        message = f"this server needs 'Authorization: Bearer <token>' (or '{key_header}: <token>') with a known token"
        body = {"error": {"message": message, "type": "authentication_error", "param": None, "code": "unauthorized"}}
        await JSONResponse(body, status_code=401)(scope, receive, send)
