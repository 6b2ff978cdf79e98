"""Mutated request bodies (a fixed-seed fuzz) against every JSON surface: each answer is a success or
a client error with the surface's error shape, never a server error, and the stack stays healthy.

The field values are the ones that broke servers before: huge and negative integers, denormal and
enormous floats, wrong types, empty and nested lists, emoji and lone surrogates.
"""

from __future__ import annotations

import json
import random

import httpx
import websockets

from tests.gateway.support import collect, send

VALUES = [None, True, False, 0, -1, 1, 2, 7, 2**31, 2**63, -(2**63) - 1, 2**64, 0.5, -0.5, 1e308, 1e-320, "", "x",
          "abc" * 50, [], [1], [-1], [2**40], ["a"], [[1, 2]], [[]], {}, {"a": 1}, {"1": 5}, [None], "\ud7ff", "😀" * 3]
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n",
          "stop", "stream", "stream_options", "logprobs", "top_logprobs", "echo", "seed", "logit_bias",
          "presence_penalty", "frequency_penalty", "min_p", "min_tokens", "stop_token_ids", "response_format",
          "ignore_eos", "repetition_penalty", "best_of", "suffix", "user", "tools", "tool_choice",
          "add_generation_prompt", "continue_final_message", "add_special_tokens", "tokens", "return_token_strs"]
HTTP_CASES = 150
WS_CASES = 30
# every numeric sampling field at every extreme, on its own (a random mix rarely isolates one)
NUMERIC_FIELDS = ["temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "seed", "max_tokens", "n", "logprobs", "min_tokens"]
EXTREMES = [2**64, -(2**63) - 1, 1e308, 1e-320, -0.5, 0]


def mutate(rng: random.Random, body: dict) -> dict:
    body = json.loads(json.dumps(body))
    for _ in range(rng.randint(1, 3)):
        field = rng.choice(FIELDS)
        if rng.random() < 0.15:
            body.pop(field, None)
        else:
            body[field] = rng.choice(VALUES)
    return body


async def test_mutated_requests_get_answers_or_client_errors_never_server_errors(stack):
    rng = random.Random(11)
    model = stack.settings.served_model_name
    surfaces = [
        ("/v1/completions", {"model": model, "prompt": "Hello", "max_tokens": 3, "temperature": 0}),
        ("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}),
        ("/v1/generate", {"prompt": "Hi", "max_tokens": 2, "stream": False}),
        ("/tokenize", {"prompt": "Hi"}),
        ("/detokenize", {"tokens": [1, 2]}),
    ]
    cases = [(surfaces[0][0], {**surfaces[0][1], field: value}) for field in NUMERIC_FIELDS for value in EXTREMES]
    for _ in range(HTTP_CASES):
        path, base = rng.choice(surfaces)
        cases.append((path, mutate(rng, base)))
    failures = []
    async with httpx.AsyncClient(base_url=stack.http_url, timeout=120) as http:
        for path, body in cases:
            response = await http.post(path, json=body)
            if response.status_code >= 500 or (response.status_code >= 400 and "error" not in response.text):
                failures.append((path, body, response.status_code, response.text[:300]))
            elif "internal_error" in response.text:  # a stream that failed after its 200
                failures.append((path, body, response.status_code, response.text[:300]))
        for _ in range(WS_CASES):
            config = {"type": "config", **mutate(rng, {"prompt": "Hi", "parameters": {"max_tokens": 2}})}
            if rng.random() < 0.5:
                config["parameters"] = mutate(rng, {"max_tokens": 2, "temperature": 0})
            async with websockets.connect(stack.ws_url) as ws:
                await send(ws, config)
                final = (await collect(ws))[-1]
            if final["type"] == "error" and final.get("code") == "internal_error":
                failures.append(("websocket", config, final))
        health = await http.get("/health")
    assert not failures, failures
    assert health.status_code == 200 and health.json()["status"] == "ready"
