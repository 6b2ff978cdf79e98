"""Server message rendering (the WebSocket protocol's shapes), the options that shape it, and SSE framing."""

from __future__ import annotations

import json

from common.errors import MEMORY_PRESSURE, RATE_LIMITED, TillerError
from services.gateway.httputil import sse
from services.gateway.protocol import CompletionMsg, ErrorMsg, GatewayError, LogprobEntry, StatusMsg, TokenMsg, Usage
from services.gateway.validation import Options

TOKEN = TokenMsg(
    token=" the",
    token_id=262,
    generated_text="Once upon a time the",
    logprobs=[LogprobEntry(" the", 262, -0.32), LogprobEntry(" a", 253, -1.23)],
    token_s=0.0425,
    total_s=0.1563,
    finish_reason=None,
)


def test_token_message_minimal_and_full():
    assert TOKEN.to_json(Options()) == {
        "type": "token",
        "token": " the",
        "generated_text": "Once upon a time the",
        "finish_reason": None,
        "finished": False,
    }
    full = Options.model_construct(include_token_ids=True, include_logprobs=1, include_timing=True)
    assert TOKEN.to_json(full) == {
        "type": "token",
        "token": " the",
        "token_id": 262,
        "generated_text": "Once upon a time the",
        "logprobs": [{"token": " the", "logprob": -0.32}, {"token": " a", "logprob": -1.23}],
        "timing": {"token_ms": 42.5, "total_ms": 156.3},
        "finish_reason": None,
        "finished": False,
    }


def test_completion_message():
    done = CompletionMsg("gen_1", "text", "length", Usage(4, 100), 0.0452, 1.2405)
    assert done.to_json(Options.model_construct(include_timing=True)) == {
        "type": "completion",
        "request_id": "gen_1",
        "generated_text": "text",
        "finish_reason": "length",
        "usage": {"prompt_tokens": 4, "completion_tokens": 100, "total_tokens": 104},
        "timing": {"first_token_ms": 45.2, "total_ms": 1240.5},
    }
    assert "timing" not in done.to_json(Options())


def test_error_message_from_error():
    error = ErrorMsg.from_error(TillerError(MEMORY_PRESSURE, "queue full"), "gen_1", "partial")
    assert error.to_json() == {
        "type": "error",
        "error": "memory_pressure",
        "message": "queue full",
        "recoverable": True,
        "recovery_action": "retry",
        "request_id": "gen_1",
        "generated_text": "partial",
    }
    assert error.http_status == 503
    limited = ErrorMsg.from_error(GatewayError(RATE_LIMITED, "slow down", retry_after_s=12.34))
    assert limited.to_json()["retry_after"] == 12.3 and limited.to_json()["request_id"] is None


def test_unknown_error_code_becomes_internal_error():
    error = ErrorMsg.from_error(TillerError("exploded", "boom"))
    assert (error.code, error.http_status, error.recoverable) == ("internal_error", 500, True)


def test_status_message():
    assert StatusMsg("model_loading", 67, "Loading", 3.54).to_json() == {
        "type": "status",
        "operation": "model_loading",
        "progress": 67,
        "message": "Loading",
        "eta_seconds": 3.5,
    }
    assert StatusMsg("feedback", 100, "ok", extra={"feedback_id": 3}).to_json()["feedback_id"] == 3


def test_sse_framing():
    assert sse({"type": "token", "token": "é"}) == 'data: {"type":"token","token":"é"}\n\n'.encode()
    assert sse("[DONE]") == b"data: [DONE]\n\n"
    assert json.loads(sse({"a": [1]})[len(b"data: ") :]) == {"a": [1]}
