#!/usr/bin/env bash
# AIPerf (NVIDIA's load generator for OpenAI-compatible servers), unchanged, against a running Tiller.
#
#   [AIPERF_REQUESTS=32] [AIPERF_CONCURRENCY=4] [AIPERF_ISL=128] [AIPERF_OSL=32] deploy/loadtest/aiperf.sh \
#       [other aiperf profile options]
#
# AIPerf goes into a virtual environment of its own (AIPERF_VENV, default ~/.cache/tiller/aiperf-venv),
# never into Tiller's: it pins its own transformers. The tokenizer is the served model's local directory
# (no hub access). Streaming chat completions with usage (stream_options.include_usage, as AIPerf asks).
# ignore_eos holds every reply to its OSL (vLLM's extension).
#
# Token counts: AIPerf counts a chat prompt by tokenizing the message text alone, while `usage.prompt_tokens`
# counts the prompt the model reads, chat template included (SmolLM2's adds a default system message:
# 30 tokens on a 128-token message, hence AIPerf's ">10% difference" warning; vLLM counts the same way).
# Completion counts agree within a token (a reply ended by EOS counts the EOS, as vLLM's do).
# Pass --use-server-token-count to take the server's counts.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${TILLER_PYTHON:-$ROOT/.venv/bin/python}
VENV=${AIPERF_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/tiller/aiperf-venv}
AIPERF_VERSION=${AIPERF_VERSION:-0.13.0}
URL=${TILLER_URL:-http://127.0.0.1:${TILLER_HTTP_PORT:-8080}}
OUT=${AIPERF_OUT:-$ROOT/run/aiperf}

if [ ! -x "$VENV/bin/aiperf" ]; then
    echo "installing aiperf==$AIPERF_VERSION into $VENV (once; a few minutes)" >&2
    "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q "aiperf==$AIPERF_VERSION"
fi

cd "$ROOT"
MODEL=$(curl -sf "$URL/v1/models" | "$PY" -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])') || {
    echo "no Tiller answers at $URL (start one with 'make up', or set TILLER_URL)" >&2
    exit 1
}
TOKENIZER=$(PYTHONPATH=$ROOT "$PY" -c 'from common.config import Settings
from common.model_source import resolve_model
print(resolve_model(Settings()).directory)')

exec "$VENV/bin/aiperf" profile \
    --model "$MODEL" --url "$URL" --endpoint-type chat --streaming \
    --tokenizer "$TOKENIZER" \
    --synthetic-input-tokens-mean "${AIPERF_ISL:-128}" --output-tokens-mean "${AIPERF_OSL:-32}" \
    --extra-inputs ignore_eos:true \
    --request-count "${AIPERF_REQUESTS:-32}" --concurrency "${AIPERF_CONCURRENCY:-4}" \
    --ui none --artifact-dir "$OUT" "$@"
