"""A ``--turns``-turn conversation on the OpenAI Responses API, three ways, in one run, on one stack:

* *chain*: each turn sends only its new user message with ``previous_response_id``; the server keeps the
  conversation and the previous turn's KV parked (prefills only the new input).
* *resend*: each turn sends the whole conversation so far as input items (``store: false``), as a client of
  a stateless server does; the prefix cache finds the earlier turns' blocks.
* *resend cold*: the same, with a ``cache_salt`` of its own each turn, so no KV of an earlier turn is reused
  (what a server without a prefix cache does).

Each way has a ``cache_salt`` of its own, so none finds another's KV. Greedy decoding; the ways alternate
turn by turn, so a busy machine skews them alike. Printed per turn: the
time to first token (the SDK's first ``response.output_text.delta``), the prompt's tokens and its cached
tokens (``usage.input_tokens_details.cached_tokens``) each way, and the ratios of resend to chain.

    python deploy/loadtest/responses_chain.py [--turns 10] [--max-tokens 16] [--base-url http://127.0.0.1:8000/v1]

Starts its own stack (the configured weights, else the default) unless ``--base-url`` is given.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.stack import served_settings, start_stack  # noqa: E402

QUESTIONS = [
    "Tell me about the lighthouse keeper who counted the stairs every night.",
    "What did he write down about the sea that day?",
    "Which ships passed while he watched?",
    "How did the sky look at dusk?",
    "What did he eat for supper, alone in the tower?",
    "Who came to visit him in the spring?",
    "What did they talk about by the lamp?",
    "How did the storm of that winter begin?",
    "What did the keeper do when the lamp failed?",
    "How does the story end?",
    "What would you call the story?",
    "Summarise the conversation so far in one line.",
]


@dataclass
class Turn:
    id: str
    ttft_s: float
    input_tokens: int
    cached_tokens: int
    text: str


def respond(client: openai.OpenAI, model: str, max_tokens: int, **kwargs) -> Turn:
    """One streamed response: the time to its first text delta and its final usage."""
    started = time.perf_counter()
    first = None
    final = None
    for event in client.responses.create(model=model, temperature=0, max_output_tokens=max_tokens, stream=True,
                                         **kwargs):
        if event.type == "response.output_text.delta" and first is None:
            first = time.perf_counter() - started
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
        if event.type in ("response.failed", "error"):
            raise RuntimeError(f"the response failed: {event}")
    assert final is not None and final.usage is not None, "the stream ended without a final response"
    details = final.usage.input_tokens_details
    return Turn(id=final.id, ttft_s=first if first is not None else time.perf_counter() - started,
                input_tokens=final.usage.input_tokens, cached_tokens=details.cached_tokens if details else 0,
                text=final.output_text)


def run(client: openai.OpenAI, model: str, turns: int, max_tokens: int) -> None:
    previous = None
    conversation: list[dict] = []
    run_id = time.monotonic_ns()  # each way its own cache domain (cache_salt): no way finds another's KV
    respond(client, model, 1, input="Hello.", store=False)  # the stack's first request pays its warm-up
    print(f"turns={turns} max_output_tokens={max_tokens} (greedy)")
    print(f"{'turn':>4} {'chain ttft':>11} {'resend ttft':>12} {'cold ttft':>10} {'resend/chain':>13} "
          f"{'cold/chain':>11}   input / cached tokens: chain, resend, cold")
    totals = {"chain": 0.0, "resend": 0.0, "cold": 0.0}
    for n in range(turns):
        question = QUESTIONS[n % len(QUESTIONS)]
        conversation.append({"role": "user", "content": question})
        resend = respond(client, model, max_tokens, input=list(conversation), store=False,
                         extra_body={"cache_salt": f"resend-{run_id}"})
        cold = respond(client, model, max_tokens, input=list(conversation), store=False,
                       extra_body={"cache_salt": f"cold-{run_id}-{n}"})
        chain = respond(client, model, max_tokens, input=question, store=True,
                        extra_body={"cache_salt": f"chain-{run_id}"},
                        **({"previous_response_id": previous} if previous else {}))
        previous = chain.id
        if chain.text != resend.text:
            print(f"  note: turn {n + 1}'s chain text differs from the resend's: {chain.text!r} vs {resend.text!r}")
        conversation.append({"role": "assistant", "content": resend.text})
        for way, turn in (("chain", chain), ("resend", resend), ("cold", cold)):
            totals[way] += turn.ttft_s
        print(f"{n + 1:>4} {chain.ttft_s * 1e3:>9.1f}ms {resend.ttft_s * 1e3:>10.1f}ms {cold.ttft_s * 1e3:>8.1f}ms "
              f"{resend.ttft_s / chain.ttft_s:>12.2f}x {cold.ttft_s / chain.ttft_s:>10.2f}x   "
              f"{chain.input_tokens}/{chain.cached_tokens}, {resend.input_tokens}/{resend.cached_tokens}, "
              f"{cold.input_tokens}/{cold.cached_tokens}")
    print(f"total ttft: chain {totals['chain']:.2f}s, resend {totals['resend']:.2f}s "
          f"({totals['resend'] / totals['chain']:.2f}x), cold {totals['cold']:.2f}s "
          f"({totals['cold'] / totals['chain']:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--base-url", help="a running gateway's OpenAI base URL; default: start a stack")
    args = parser.parse_args()
    stack = None
    if args.base_url is None:
        stack = start_stack(Path(tempfile.mkdtemp(prefix="tiller-responses-chain-")), **served_settings())
        base_url = f"{stack.http_url}/v1"
        model = stack.settings.served_model_name
    else:
        base_url = args.base_url
        model = openai.OpenAI(base_url=base_url, api_key="unused").models.list().data[0].id
    try:
        run(openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0), model, args.turns, args.max_tokens)
    finally:
        if stack is not None:
            stack.down()


if __name__ == "__main__":
    main()
