"""The one way an Evergreen session ends badly: a gRPC status with a precise message."""

from __future__ import annotations

import grpc

from common.errors import (
    CONTENT_FILTER,
    CONTEXT_LENGTH_EXCEEDED,
    INTERNAL_ERROR,
    INVALID_REQUEST,
    MEMORY_PRESSURE,
    MODEL_LOADING_ERROR,
    RATE_LIMITED,
    SERVICE_UNAVAILABLE,
    TIMEOUT,
)

# the WebSocket protocol's error types (what the generation driver reports) as gRPC status codes
STATUS_OF_CODE: dict[str, grpc.StatusCode] = {
    INVALID_REQUEST: grpc.StatusCode.INVALID_ARGUMENT,
    CONTEXT_LENGTH_EXCEEDED: grpc.StatusCode.OUT_OF_RANGE,
    CONTENT_FILTER: grpc.StatusCode.PERMISSION_DENIED,
    MEMORY_PRESSURE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    INTERNAL_ERROR: grpc.StatusCode.INTERNAL,
    MODEL_LOADING_ERROR: grpc.StatusCode.UNAVAILABLE,
    RATE_LIMITED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    SERVICE_UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
}


class SessionAbort(Exception):
    """Ends the session (or, where the client asked for per-action failures, one action) with ``status``."""

    def __init__(self, status: grpc.StatusCode, message: str, *, refused: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.refused = refused  # the client's message was refused (not a generation's own failure)

    @classmethod
    def invalid(cls, message: str) -> SessionAbort:
        return cls(grpc.StatusCode.INVALID_ARGUMENT, message, refused=True)

    @classmethod
    def from_code(cls, code: str, message: str) -> SessionAbort:
        """From a generation error type (``invalid_request``, ``timeout``, ...)."""
        return cls(STATUS_OF_CODE.get(code, grpc.StatusCode.INTERNAL), message)
