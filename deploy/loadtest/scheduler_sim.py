"""The scheduler past this machine: the real scheduler core (no model, no sockets) driving
simulated workers for simulated clients.

Each client is a session of ``--turns`` turns: a prompt made of one of ``--system-prompts`` shared
system prompts, the conversation so far and a new user message, then ``--tokens`` generated tokens.
``--seqs`` clients per worker run at once. Simulated workers keep a prefix cache of 16-token blocks
(LRU, ``--cache-blocks`` each), report cached tokens and block events as real workers do, and
"sample" pseudo-random tokens. The core is driven as the service shell drives it (admit, build the
steps, apply each worker's result, work out the text), one round of steps at a time, the steps and
results encoded and decoded as on the wire.

Printed per worker count: the scheduler's own CPU time per round and per step per worker, whether a
worker with a 5 ms or 20 ms step would wait for it (its next step is prepared while the current one
runs, so a round's CPU time must fit in one step), the tokens/s it could then sustain, and the
share of prompt tokens whose KV was reused (a parked session or a cached prefix) under KV-aware
placement and under random placement (sessions not parked, each turn on a random worker).

    python deploy/loadtest/scheduler_sim.py                 # 8 and 32 workers x 256 sequences
    python deploy/loadtest/scheduler_sim.py --workers 2 --seqs 16 --turns 2   # a quick look
"""

from __future__ import annotations

import argparse
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import structlog

from common import wire
from common.blocks import BLOCK_SIZE, ROOT_HASH, block_hash, block_key
from common.config import Controllers, Limits, Sessions, Settings
from common.model_source import load_tokenizer
from common.service import freeze_startup_heap
from common.textstream import TextStream
from services.scheduler.core import SchedulerCore
from services.scheduler.placement import KVAwarePlacement
from services.scheduler.requests import LiveRequest
from services.scheduler.workers import WorkerInfo

VOCAB_LOW, VOCAB_HIGH = 300, 20000  # ordinary tokens of the default model's vocabulary
EOS = 2


class SimWorker:
    """A worker's bookkeeping without the model: sequences' tokens, an LRU prefix cache of block
    keys with its events, and deterministic pseudo-random samples."""

    def __init__(self, identity: bytes, cache_blocks: int) -> None:
        self.identity = identity
        self.cache_blocks = cache_blocks
        self.cache: OrderedDict[bytes, None] = OrderedDict()  # block names, least recently used first
        self.seqs: dict[int, list[int]] = {}
        self.last: dict[int, int] = {}
        self.new: list[int] = []
        self.gone: list[int] = []

    def _names(self, tokens: Sequence[int]) -> list[bytes]:
        names, parent = [], ROOT_HASH
        for j in range(len(tokens) // BLOCK_SIZE):
            parent = block_hash(parent, tokens[j * BLOCK_SIZE : (j + 1) * BLOCK_SIZE])
            names.append(parent)
        return names

    def _commit(self, tokens: list[int]) -> None:
        for name in self._names(tokens):
            if name in self.cache:
                self.cache.move_to_end(name)
                continue
            self.cache[name] = None
            self.new.append(block_key(name))
            if len(self.cache) > self.cache_blocks:
                old, _ = self.cache.popitem(last=False)
                self.gone.append(block_key(old))

    def step(self, step: wire.Step) -> wire.StepResult:
        if step.free_all:
            self.seqs.clear()
        for seq_id in step.free:
            self.seqs.pop(seq_id, None)
        samples, cached = {}, {}
        for s in step.seqs:
            if s.fork_of is not None:
                self.seqs[s.seq_id] = list(self.seqs.get(s.fork_of, []))
            tokens = self.seqs.setdefault(s.seq_id, [])
            if s.backtrack:
                del tokens[len(tokens) - s.backtrack :]
            feed = [self.last[s.seq_id]] if s.follow else s.tokens
            if not tokens and len(feed) > 1:  # a new sequence: its leading blocks may be cached
                hits = 0
                for name in self._names(feed[: len(feed) - 1]):
                    if name not in self.cache:
                        break
                    hits += 1
                cached[s.seq_id] = hits * BLOCK_SIZE
            tokens += feed
            self._commit(tokens)
            if s.sample or s.follow:
                token = VOCAB_LOW + hash((s.seq_id, len(tokens))) % (VOCAB_HIGH - VOCAB_LOW)
                self.last[s.seq_id] = token
                samples[s.seq_id] = wire.SampledToken(token_id=token, logprob=-1.0)
        new, gone, self.new, self.gone = self.new, self.gone, [], []
        return wire.StepResult(step_id=step.step_id, samples=samples, cached_tokens=cached,
                               kv_free_tokens=(self.cache_blocks - len(self.cache)) * BLOCK_SIZE,
                               blocks_new=new, blocks_gone=gone)


@dataclass
class Client:
    """A session: its turns so far, and the request of the turn in progress."""

    key: str
    system: list[int]
    rng: random.Random
    turns_left: int
    history: list[int] = field(default_factory=list)
    rid: str = ""
    prompt: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)

    def next_prompt(self, user_tokens: int) -> list[int]:
        user = [self.rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(user_tokens)]
        self.prompt = (self.history or list(self.system)) + user
        return self.prompt


def random_placement(seed: int):
    rng = random.Random(seed)

    def place(request: LiveRequest, workers: Sequence[WorkerInfo]) -> bytes | None:
        fits = [w for w in workers if w.unreserved >= request.needed_tokens]
        return rng.choice(fits).identity if fits else None

    return place


@dataclass
class Run:
    rounds: int = 0
    core_s: float = 0.0  # scheduler CPU time of this thread (core calls, encoding and decoding)
    steps: int = 0  # worker steps sent
    decode_tokens: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0


def simulate(args: argparse.Namespace, workers: int, kv_aware: bool, tokenizer) -> Run:
    limits = Limits(max_batch_size=args.seqs, max_queued=workers * args.seqs * 2,
                    step_token_budget=args.step_token_budget)
    sessions = Sessions() if kv_aware else Sessions(kv_tokens_per_session=0)
    place = KVAwarePlacement() if kv_aware else random_placement(args.seed)
    core = SchedulerCore(limits, sessions, Controllers(), lambda stop: TextStream(tokenizer, stop=stop), place=place)
    capacity = args.cache_blocks * BLOCK_SIZE
    sims = {}
    for i in range(workers):
        identity = f"sim-{i}".encode()
        sims[identity] = SimWorker(identity, args.cache_blocks)
        core.worker_hello(identity, wire.WorkerHello(worker_id=identity.decode(), stage="ready", vocab_size=49152,
                                                     max_model_len=8192, eos_token_ids=[EOS],
                                                     kv_capacity_tokens=capacity))
    rng = random.Random(args.seed)
    systems = [[rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(args.system_tokens)]
               for _ in range(args.system_prompts)]
    clients = [Client(f"s{i}", systems[i % len(systems)], random.Random(i), args.turns) for i in range(workers * args.seqs)]
    by_rid: dict[str, Client] = {}
    sampling = wire.SamplingParams(temperature=0.0)
    run = Run()
    encoder, decoder = wire._encoder, wire._decoder

    def submit(client: Client) -> None:
        client.turns_left -= 1
        client.rid, client.generated = f"{client.key}-{client.turns_left}", []
        prompt = client.next_prompt(args.user_tokens)
        run.prompt_tokens += len(prompt)
        by_rid[client.rid] = client
        msg = wire.Submit(rid=client.rid, prompt_ids=prompt, sampling=sampling, max_tokens=args.tokens,
                          ignore_eos=True, session=wire.SessionRef(key=client.key))
        started = time.thread_time()
        reply = core.submit(b"gw", decoder.decode(encoder.encode(msg)))
        run.core_s += time.thread_time() - started
        assert isinstance(reply, wire.Queued), reply

    for client in clients:
        submit(client)
    while by_rid:
        started = time.thread_time()
        core.admit()
        plan, request = core.plan_controlled()
        dispatches = core.build_steps(plan)
        frames = [encoder.encode(d.step) for d in dispatches]
        run.core_s += time.thread_time() - started
        results = [sims[d.worker].step(decoder.decode(f)) for d, f in zip(dispatches, frames)]
        started = time.thread_time()
        for dispatch, result in zip(dispatches, results):
            result = decoder.decode(encoder.encode(result))
            if kv_aware:
                place.observe(dispatch.worker, dispatch.step, result)
            core.step_done(dispatch.worker, result)
            core.apply(dispatch, result)
        core.end_step()
        core.emit_deferred()
        out = core.take_output()
        run.core_s += time.thread_time() - started
        run.rounds += 1
        run.steps += len(dispatches)
        for _, msg in out:
            assert isinstance(msg, wire.Events), msg
            for event in msg.events:
                client = by_rid[event.rid]
                client.generated += [t.token_id for t in event.tokens]
                run.decode_tokens += len(event.tokens)
                if event.finish_reason is not None:
                    run.reused_tokens += event.cached_tokens
                    del by_rid[event.rid]
                    client.history = client.prompt + client.generated
                    if client.turns_left:
                        submit(client)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--seqs", type=int, default=256, help="concurrent sequences (sessions) per worker")
    parser.add_argument("--step-ms", type=float, nargs="+", default=[5.0, 20.0])
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=16, help="generated tokens per turn")
    parser.add_argument("--system-prompts", type=int, default=16)
    parser.add_argument("--system-tokens", type=int, default=96)
    parser.add_argument("--user-tokens", type=int, default=24)
    parser.add_argument("--cache-blocks", type=int, default=4096, help="prefix-cache blocks of one worker")
    parser.add_argument("--step-token-budget", type=int, default=Limits().step_token_budget)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    # the core's per-request info lines would swamp the table (and a real scheduler writes them to a file)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    tokenizer = load_tokenizer(Settings())
    freeze_startup_heap()  # as the scheduler service does once it started
    print(f"{args.seqs} sessions per worker, {args.turns} turns of {args.tokens} tokens, prompts: one of "
          f"{args.system_prompts} system prompts ({args.system_tokens} tokens) + history + {args.user_tokens} new")
    header = (f"{'workers':>7} {'rounds':>6} {'core ms/round':>13} {'µs/step/worker':>14} "
              + " ".join(f"{f'waits@{ms:g}ms':>10} {f'tok/s@{ms:g}ms':>12}" for ms in args.step_ms)
              + f" {'reuse kv':>8} {'reuse rnd':>9} {'ratio':>6}")
    print(header)
    for workers in args.workers:
        kv = simulate(args, workers, True, tokenizer)
        rnd = simulate(args, workers, False, tokenizer)
        per_round = kv.core_s / kv.rounds
        cells = []
        for ms in args.step_ms:
            step_s = ms / 1000
            cells.append(f"{'yes' if per_round > step_s else 'no':>10} "
                         f"{kv.decode_tokens / (kv.rounds * max(step_s, per_round)):>12,.0f}")
        hit_kv, hit_rnd = kv.reused_tokens / kv.prompt_tokens, rnd.reused_tokens / rnd.prompt_tokens
        print(f"{workers:>7} {kv.rounds:>6} {per_round * 1000:>13.2f} {kv.core_s / kv.steps * 1e6:>14.1f} "
              + " ".join(cells)
              + f" {hit_kv:>8.1%} {hit_rnd:>9.1%} {hit_kv / hit_rnd if hit_rnd else float('inf'):>5.1f}x")


if __name__ == "__main__":
    main()
