"""The scheduler's CPU per token in a steady decode: ``--seqs`` sequences on one simulated worker (the sim's
``SimWorker``), every step of the real core built, encoded, decoded and applied and its events encoded, as
the service does; the worker's own work is not counted. Each figure is the best of ``--repeats`` runs of
``--steps`` steps, after the sequences reached ``--warm`` tokens, without and with a stop string (whose text
is worked out off the step's path, ``SchedulerCore.emit_deferred``).

    python deploy/loadtest/scheduler_decode_bench.py [--seqs 256] [--warm 20]
    PYTHONPATH=<other checkout> python <this checkout>/deploy/loadtest/scheduler_decode_bench.py   # another tree's core
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scheduler_sim import EOS, VOCAB_HIGH, VOCAB_LOW, SimWorker, as_the_scheduler_starts  # noqa: E402

from common import wire  # noqa: E402
from common.config import Controllers, Limits, Sessions  # noqa: E402
from common.textstream import TextStream  # noqa: E402
from services.scheduler.core import SchedulerCore  # noqa: E402

PROMPT_TOKENS = 20
KV_TOKENS = 1 << 22


def decode_us(tokenizer, args: argparse.Namespace, stop: list[str]) -> float:
    """Best µs of scheduler CPU per token over the repeats."""
    max_tokens = args.warm + (args.repeats + 1) * args.steps + 8
    core = SchedulerCore(Limits(max_batch_size=args.seqs), Sessions(), Controllers(),
                         lambda stop, **options: TextStream(tokenizer, stop=stop, **options))
    worker = SimWorker(b"w", KV_TOKENS // 16)
    core.worker_hello(b"w", wire.WorkerHello(worker_id="w", stage="ready", vocab_size=49152, max_model_len=1 << 20,
                                             eos_token_ids=[EOS], kv_capacity_tokens=KV_TOKENS,
                                             wire_version=wire.WIRE_VERSION))
    rng = random.Random(0)
    for i in range(args.seqs):
        core.submit(b"gw", wire.Submit(rid=f"r{i}", prompt=wire.pack_tokens(
                                           rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(PROMPT_TOKENS)),
                                       sampling=wire.SamplingParams(temperature=0.0), max_tokens=max_tokens,
                                       ignore_eos=True, stop=stop,
                                       text_at_gateway=not stop))  # as a gateway sends it (common.event_text)
    encoder, decoder = wire.codec._encoder, wire.codec._decoder
    spent, tokens = [0.0], [0]

    def step() -> None:
        started = time.thread_time()
        core.admit()
        dispatches = core.build_steps()
        frames = [encoder.encode(d.step) for d in dispatches]
        spent[0] += time.thread_time() - started
        results = [encoder.encode(worker.step(decoder.decode(frame))) for frame in frames]
        started = time.thread_time()
        for dispatch, frame in zip(dispatches, results):
            result = decoder.decode(frame)
            core.step_done(dispatch.worker, result)
            core.apply(dispatch, result)
            tokens[0] += len(dispatch.followers) + len(dispatch.batch)
        core.end_step()
        core.emit_deferred()
        for _, msg in core.take_output():
            encoder.encode(msg)
        spent[0] += time.thread_time() - started

    while min((len(r.generated) for r in core.running.values()), default=0) < args.warm:
        step()
    best = float("inf")
    for _ in range(args.repeats):
        spent[0], tokens[0] = 0.0, 0
        for _ in range(args.steps):
            step()
        best = min(best, spent[0] / tokens[0])
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--warm", type=int, default=20, help="tokens each sequence generates before the timing")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    tokenizer = as_the_scheduler_starts()
    print(f"{args.seqs} sequences decoding on one simulated worker, from {args.warm} tokens on, best of "
          f"{args.repeats} x {args.steps} steps: the scheduler's CPU µs per token")
    for label, stop in (("no stop string", []), ("stop string '</s>'", ["</s>"])):
        print(f"{label:>22} {decode_us(tokenizer, args, stop):6.2f}")


if __name__ == "__main__":
    main()
