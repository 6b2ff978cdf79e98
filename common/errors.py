"""Error types shared by the services and their mapping to the client-facing error vocabulary.

The codes are the WebSocket protocol's error types; every surface maps them onto its own
form (HTTP status, OpenAI error object, gRPC status).
"""

from __future__ import annotations

from dataclasses import dataclass

INVALID_REQUEST = "invalid_request"
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
CONTENT_FILTER = "content_filter"
MEMORY_PRESSURE = "memory_pressure"
TIMEOUT = "timeout"
INTERNAL_ERROR = "internal_error"
MODEL_LOADING_ERROR = "model_loading_error"
RATE_LIMITED = "rate_limited"
# a peer process the request ran on died or restarted: the request is gone, resubmitting it may work
SERVICE_UNAVAILABLE = "service_unavailable"

# code -> (recoverable, recovery_action, HTTP status)
ERROR_TRAITS: dict[str, tuple[bool, str, int]] = {
    INVALID_REQUEST: (True, "fix_request", 400),
    CONTEXT_LENGTH_EXCEEDED: (True, "reduce_prompt", 400),
    CONTENT_FILTER: (False, "none", 400),
    MEMORY_PRESSURE: (True, "retry", 503),
    TIMEOUT: (True, "retry", 504),
    INTERNAL_ERROR: (True, "retry", 500),
    MODEL_LOADING_ERROR: (False, "contact_operator", 503),
    RATE_LIMITED: (True, "wait", 429),
    SERVICE_UNAVAILABLE: (True, "retry", 503),
}


class WireError(ValueError):
    """A frame that does not decode or validate against its schema."""


@dataclass
class TillerError(Exception):
    """An error with a client-facing code from ERROR_TRAITS."""

    code: str
    message: str

    def __post_init__(self) -> None:
        super().__init__(self.message)

    @property
    def recoverable(self) -> bool:
        return ERROR_TRAITS[self.code][0]

    @property
    def recovery_action(self) -> str:
        return ERROR_TRAITS[self.code][1]

    @property
    def http_status(self) -> int:
        return ERROR_TRAITS[self.code][2]
