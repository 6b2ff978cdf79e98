"""The scheduler past this machine: the real scheduler core (no model, no sockets) driving
simulated workers for simulated clients.

The workload (the same for both placements, from ``--seed``): ``--seqs`` users per worker, each
holding ``--sessions`` conversations one after another (a new one as soon as the last ends). A
conversation is a session (Salience-style, its KV parked between turns) of 1 to 2x-1 ``--turns``
turns; its first prompt is one of ``--system-prompts`` shared system prompts (half to 1.5x
``--system-tokens`` long) drawn with Zipf(``--zipf``) popularity, as a few applications send most
requests and many send few; each turn appends a user message (1 to 2x-1 ``--user-tokens``) to the
conversation so far and generates ``--tokens`` tokens.

Simulated workers hold a paged KV pool of ``--kv-tokens`` (16-token blocks) as real ones do: live
sequences (parked sessions included) hold their blocks, blocks nobody holds stay cached and the least
recently released are evicted for room; they report cached tokens and block events as real workers do,
and "sample" pseudo-random tokens. Worker i takes ``--step-ms[i % n]`` per step (by
default half 5 ms, half 20 ms), in simulated time that the scheduler's own CPU time also moves. The
core is driven as the service shell drives it (admit, build each worker's next step when its pipeline
of ``limits.pipeline_depth`` has room, apply each result as it comes back, work out the text; the
clients' next turns arrive once the steps after the results applied are out, as the shell reads its
sockets only then), the steps and results encoded and decoded as on the wire; as the baseline, the
lockstep loop the shell had before (every worker's step out together, the next round after all results).

Printed per worker count and loop: the scheduler's CPU time (decoding submits and results, the core's
calls, encoding steps, replies and events; not the simulated clients' or workers' work) per worker step
and per sequence in a step, the tokens/s of the
simulated time, each kind of worker's idle share (time between a step and its next while it had
sequences to run: waiting for the scheduler, or in lockstep for the slower workers) and the longest
such wait, and the **hit
rate**: prompt tokens whose KV was reused (a parked session's, or a cached prefix's) over all prompt
tokens (each turn's whole prompt, history included, as an API bills cached tokens), under KV-aware
placement (the service's) and under random placement (each turn on a random worker with room,
sessions not parked: a turn finds its history only where the worker's cache still has it), and the
most any placement could reuse (**hit max**: a turn's own history, else the longest prefix, in full
blocks, of any prompt sent before it: no placement beats it, so it bounds the ratio too); and the session
hit rate (**turns**): of the turns after a conversation's first, those that reused every full block of
the conversation so far (its history, minus the last token, which a turn always computes). Last, the
cyclic garbage collector's pauses in the KV-aware run (the scheduler's objects and the simulation's share
the process): how many young collections, the longest and all of them together (ms), then the same for the
older generations. With ``--core-calls``, the core's entry points in the per-worker KV-aware run, each timed
on the thread's CPU clock (a timer adds about a microsecond to its call, so the small calls read high).

    python deploy/loadtest/scheduler_sim.py                 # 8 and 32 workers x 256 users
    python deploy/loadtest/scheduler_sim.py --workers 2 --seqs 16 --turns 2   # a quick look
"""

from __future__ import annotations

import argparse
import gc
import itertools
import logging
import random
import time
from array import array
from collections import OrderedDict, defaultdict, deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import structlog

from common import wire
from common.blocks import BLOCK_SIZE, ROOT_HASH, block_hash, block_key, prefix_keys
from common.config import Controllers, Limits, Sessions, Settings
from common.model_source import load_tokenizer
from common.service import freeze_startup_heap
from common.textstream import TextStream, text_table
from services.scheduler.core import Dispatch, SchedulerCore
from services.scheduler.placement import KVAwarePlacement
from services.scheduler.requests import LiveRequest
from services.scheduler.workers import WorkerInfo

VOCAB_LOW, VOCAB_HIGH = 300, 20000  # ordinary tokens of the default model's vocabulary
EOS = 2


class SimWorker:
    """A worker's bookkeeping without the model, as its paged KV pool with a prefix cache works:
    ``kv_blocks`` blocks of 16 tokens; a live sequence holds its full blocks (shared blocks held
    once, by reference count), a block no sequence holds stays cached until the least recently
    released ones are evicted for room. Reports cached tokens and block events as real workers do,
    and "samples" deterministic pseudo-random tokens."""

    def __init__(self, identity: bytes, kv_blocks: int) -> None:
        self.identity = identity
        self.kv_blocks = kv_blocks
        self.refs: dict[bytes, int] = {}  # blocks live sequences hold -> how many hold them
        self.cached: OrderedDict[bytes, None] = OrderedDict()  # blocks no sequence holds, least recently released first
        # token sequences in arrays, which the cyclic garbage collector does not traverse: in the real system they
        # live in other processes, and as lists they would lengthen the scheduler's collections here
        self.seqs: dict[int, array] = {}
        self.names: dict[int, list[bytes]] = {}  # each sequence's full blocks
        self.last: dict[int, int] = {}
        self.new: list[int] = []
        self.gone: list[int] = []

    def _hold(self, name: bytes) -> None:
        if name in self.refs:
            self.refs[name] += 1
            return
        if name in self.cached:
            del self.cached[name]
        else:  # a block new to the cache
            self.new.append(block_key(name))
        self.refs[name] = 1
        while len(self.refs) + len(self.cached) > self.kv_blocks and self.cached:
            old, _ = self.cached.popitem(last=False)
            self.gone.append(block_key(old))

    def _release(self, names: list[bytes]) -> None:
        for name in reversed(names):  # a sequence's last blocks are evicted before its first ones
            self.refs[name] -= 1
            if not self.refs[name]:
                del self.refs[name]
                self.cached[name] = None

    def _extend(self, seq_id: int, feed: list[int]) -> None:
        tokens, names = self.seqs[seq_id], self.names[seq_id]
        tokens.extend(feed)
        for j in range(len(names), len(tokens) // BLOCK_SIZE):
            names.append(block_hash(names[-1] if names else ROOT_HASH, tokens[j * BLOCK_SIZE : (j + 1) * BLOCK_SIZE]))
            self._hold(names[-1])

    def _cached(self, seq_id: int, feed: list[int], limit: int) -> int:
        """How many of the first ``limit`` tokens of ``feed`` the cache holds, as full blocks that
        continue the sequence's own (a real worker looks up every prompt chunk the same way)."""
        tokens, names = self.seqs[seq_id], self.names[seq_id]
        start, j = len(tokens), len(names)  # a partial last block is replaced by a cached full one
        history, limit = tokens[j * BLOCK_SIZE :].tolist() + feed, start + limit
        parent, offset = names[-1] if names else ROOT_HASH, 0
        while (j + 1) * BLOCK_SIZE <= limit:
            parent = block_hash(parent, history[offset : offset + BLOCK_SIZE])
            if parent not in self.refs and parent not in self.cached:
                break
            j, offset = j + 1, offset + BLOCK_SIZE
        return max(start, j * BLOCK_SIZE) - start

    def _free(self, seq_id: int) -> None:
        self.seqs.pop(seq_id, None)
        self._release(self.names.pop(seq_id, []))

    def step(self, step: wire.Step) -> wire.StepResult:
        if step.free_all:
            for seq_id in list(self.seqs):
                self._free(seq_id)
        for seq_id in step.free:
            self._free(seq_id)
        tokens, cached = [], {}
        follows = [wire.SeqStep(seq_id=seq_id, tokens=[], follow=True) for seq_id in wire.unpack_ids(step.follows)]
        for s in follows + step.seqs:
            if s.seq_id not in self.seqs:
                parent = s.fork_of
                self.seqs[s.seq_id] = array("q", self.seqs[parent] if parent is not None else [])
                self.names[s.seq_id] = list(self.names[parent]) if parent is not None else []
                for name in self.names[s.seq_id]:
                    self._hold(name)
            if s.backtrack:
                held, names = self.seqs[s.seq_id], self.names[s.seq_id]
                del held[len(held) - s.backtrack :]
                self._release(names[len(held) // BLOCK_SIZE :])
                del names[len(held) // BLOCK_SIZE :]
            feed = [self.last[s.seq_id]] if s.follow else s.tokens
            hits = self._cached(s.seq_id, feed, len(feed) - s.sample)
            if hits:
                cached[s.seq_id] = hits
            self._extend(s.seq_id, feed)
            token = -1
            if s.sample:
                token = VOCAB_LOW + hash((s.seq_id, len(self.seqs[s.seq_id]))) % (VOCAB_HIGH - VOCAB_LOW)
                self.last[s.seq_id] = token
            tokens.append(token)
        new, gone, self.new, self.gone = self.new, self.gone, [], []
        free = self.kv_blocks - len(self.refs) - len(self.cached)
        return wire.StepResult(step_id=step.step_id, tokens=wire.pack_tokens(tokens),
                               logprobs=wire.pack_logprobs([-1.0] * len(tokens)), cached_tokens=cached,
                               kv_free_tokens=max(free, 0) * BLOCK_SIZE, kv_cached_tokens=len(self.cached) * BLOCK_SIZE,
                               blocks_new=new, blocks_gone=gone)


class Workload:
    """What the simulated users send (see the module docstring); the same for both placements."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        rng = random.Random(args.seed)
        self.systems = [array("i", (rng.randrange(VOCAB_LOW, VOCAB_HIGH)
                                     for _ in range(rng.randint(args.system_tokens // 2, 3 * args.system_tokens // 2))))
                        for _ in range(args.system_prompts)]
        self.popularity = list(itertools.accumulate(1 / (rank + 1) ** args.zipf for rank in range(len(self.systems))))

    def clients(self, n: int) -> list[Client]:
        return [Client(f"u{i}", random.Random(i), self.args.sessions) for i in range(n)]


@dataclass
class Client:
    """A user: conversations one after another, each a session with one of the shared system prompts and
    a few turns; the request of the turn in progress."""

    name: str
    rng: random.Random
    sessions_left: int
    key: str = ""
    turns_left: int = 0
    # int32 arrays, as the workers' (see SimWorker): the clients' token lists must not lengthen the scheduler's
    # collections here either
    history: array = field(default_factory=lambda: array("i"))
    rid: str = ""
    prompt: array = field(default_factory=lambda: array("i"))
    kept: int = 0  # tokens of its conversation before this turn that the turn may reuse (0: a first turn)
    generated: list[int] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return not (self.turns_left or self.sessions_left)

    def next_prompt(self, workload: Workload) -> array:
        """The next turn's prompt: the conversation so far (a new one: a system prompt, drawn by
        popularity), then a user message."""
        args = workload.args
        if not self.turns_left:
            self.sessions_left -= 1
            self.key = f"{self.name}.{self.sessions_left}"
            self.turns_left = self.rng.randint(1, 2 * args.turns - 1)
            self.history = self.rng.choices(workload.systems, cum_weights=workload.popularity)[0]
        self.turns_left -= 1
        user = [self.rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(self.rng.randint(1, 2 * args.user_tokens - 1))]
        self.prompt = self.history + array("i", user)
        self.rid, self.generated = f"{self.key}-{self.turns_left}", []
        return self.prompt


def random_placement(seed: int):
    rng = random.Random(seed)

    def place(request: LiveRequest, workers: Sequence[WorkerInfo]) -> bytes | None:
        fits = [w for w in workers if w.unreserved >= request.needed_tokens]
        return rng.choice(fits).identity if fits else None

    return place


@dataclass
class Run:
    core_s: float = 0.0  # scheduler CPU time of this thread (core calls, encoding and decoding)
    steps: int = 0  # worker steps sent
    seq_steps: int = 0  # sequences in them
    decode_tokens: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    reusable_tokens: int = 0  # the most any placement could reuse (see ``simulate``'s ``submit``)
    later_turns: int = 0  # turns after a conversation's first
    turns_kept: int = 0  # of those, the turns that reused every full block of their conversation so far
    elapsed_s: float = 0.0  # simulated time, first step to last result
    busy_s: dict[float, float] = field(default_factory=lambda: defaultdict(float))  # by worker step time
    idle_s: dict[float, float] = field(default_factory=lambda: defaultdict(float))  # between steps, waiting
    longest_wait_s: dict[float, float] = field(default_factory=lambda: defaultdict(float))  # one such wait
    calls: dict[str, list[float]] = field(default_factory=dict)  # with --core-calls: entry point -> [calls, CPU s]


CORE_CALLS = ("submit", "admit", "build_steps", "plan_controlled", "step_done", "apply", "emit_deferred",
              "take_output", "end_step")


def time_calls(obj: object, names: Sequence[str], into: dict[str, list[float]]) -> None:
    """Count and time (thread CPU) each call of ``obj``'s methods ``names`` into ``into``, by an instance
    attribute that wraps the bound method."""
    for name in names:
        def timed(*args, _method=getattr(obj, name), _spent=into.setdefault(name, [0, 0.0]), **kwargs):
            started = time.thread_time()
            try:
                return _method(*args, **kwargs)
            finally:
                _spent[0] += 1
                _spent[1] += time.thread_time() - started

        setattr(obj, name, timed)


@contextmanager
def collector_pauses(into: dict[int, list[float]]) -> Iterator[None]:
    """Record each cyclic garbage collection's wall time (ms) by generation while in the block."""
    started = [0.0]

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            into[info["generation"]].append((time.perf_counter() - started[0]) * 1e3)

    gc.callbacks.append(timed)
    try:
        yield
    finally:
        gc.callbacks.remove(timed)


def simulate(args: argparse.Namespace, workers: int, kv_aware: bool, lockstep: bool, tokenizer) -> Run:
    """One run of the workload; ``lockstep``: every worker's step goes out together and the next
    waits for all of their results (the scheduler before per-worker pipelines), as the baseline."""
    limits = Limits(max_batch_size=args.seqs, max_queued=workers * args.seqs * 2,
                    step_token_budget=args.step_token_budget)
    sessions = Sessions() if kv_aware else Sessions(kv_tokens_per_session=0)
    place = KVAwarePlacement() if kv_aware else random_placement(args.seed)
    core = SchedulerCore(limits, sessions, Controllers(), lambda stop, **options: TextStream(tokenizer, stop=stop, **options),
                         place=place)
    sims, step_s = {}, {}
    for i in range(workers):
        identity = f"sim-{i}".encode()
        sims[identity] = SimWorker(identity, args.kv_tokens // BLOCK_SIZE)
        step_s[identity] = args.step_ms[i % len(args.step_ms)] / 1000
        core.worker_hello(identity, wire.WorkerHello(worker_id=identity.decode(), stage="ready", vocab_size=49152,
                                                     max_model_len=8192, eos_token_ids=[EOS],
                                                     kv_capacity_tokens=args.kv_tokens, wire_version=wire.WIRE_VERSION))
    workload = Workload(args)
    clients = workload.clients(workers * args.seqs)
    by_rid: dict[str, Client] = {}
    sampling = wire.SamplingParams(temperature=0.0)
    run = Run()
    if args.core_calls and kv_aware and not lockstep:
        time_calls(core, CORE_CALLS, run.calls)
        time_calls(place, ("observe",), run.calls)
    encoder, decoder = wire.codec._encoder, wire.codec._decoder
    now = 0.0  # simulated seconds: the scheduler's CPU time moves it, and waiting for workers
    free_at = dict.fromkeys(sims, 0.0)  # when each worker finishes the steps it was sent
    flights: dict[bytes, int] = dict.fromkeys(sims, 0)  # steps in flight per worker
    groups: deque[tuple[float, list[tuple[Dispatch, bytes]]]] = deque()  # results applied together, oldest first
    waiting: set[bytes] = set()  # workers with nothing in flight but sequences to run

    def scheduler(started: float) -> None:
        nonlocal now
        spent = time.thread_time() - started
        run.core_s += spent
        now += spent

    seen: set[int] = set()  # block keys of every prompt sent so far

    def submit(client: Client) -> None:
        # the bound: a turn's own history (its session kept), or the full blocks of the longest
        # prefix of any prompt sent before (a cache of unlimited size on the worker it went to)
        kept = len(client.history) - 1 if client.turns_left else 0
        prompt = client.next_prompt(workload)
        client.kept = kept
        run.prompt_tokens += len(prompt)
        keys = list(prefix_keys(prompt, limit=(len(prompt) - 1) // BLOCK_SIZE))
        known = next((i for i, key in enumerate(keys) if key not in seen), len(keys))
        run.reusable_tokens += max(kept, known * BLOCK_SIZE)
        seen.update(keys)
        by_rid[client.rid] = client
        frame = encoder.encode(wire.Submit(rid=client.rid, prompt=wire.token_array_bytes(prompt), sampling=sampling,
                                           max_tokens=args.tokens, ignore_eos=True,
                                           session=wire.SessionRef(key=client.key),
                                           text_at_gateway=True))  # as a gateway sends it (common.event_text)
        started = time.thread_time()
        reply = encoder.encode(core.submit(b"gw", decoder.decode(frame)))
        scheduler(started)
        assert isinstance(decoder.decode(reply), wire.Queued), reply

    def output() -> list[bytes]:
        """The messages for the gateway, encoded (the scheduler's work; the clients' is not timed)."""
        return [encoder.encode(msg) for _, msg in core.take_output()]

    def deliver(out: list[bytes]) -> bool:
        """Clients take their events; whether one sent its next turn."""
        submitted = False
        for frame in out:
            msg = decoder.decode(frame)
            assert isinstance(msg, wire.Events), msg
            for rid, token in zip(msg.rids, wire.unpack_tokens(msg.tokens)):  # the packed events: a token each
                by_rid[rid].generated.append(token)
                run.decode_tokens += 1
            for event in msg.events:
                client = by_rid[event.rid]
                client.generated += [t.token_id for t in event.tokens]
                run.decode_tokens += len(event.tokens)
                if event.finish_reason is not None:
                    run.reused_tokens += event.cached_tokens
                    if client.kept:
                        run.later_turns += 1
                        run.turns_kept += event.cached_tokens >= client.kept // BLOCK_SIZE * BLOCK_SIZE
                    del by_rid[event.rid]
                    client.history = client.prompt + array("i", client.generated)
                    if not client.done:
                        submit(client)
                        submitted = True
        return submitted

    for client in clients:
        submit(client)
    now = 0.0
    held: list[bytes] = []  # events of the results applied last, delivered once the steps after them are out
    while by_rid:
        started = time.thread_time()
        core.admit()
        roomy = ({w for w in sims if flights[w] < limits.pipeline_depth} if not lockstep
                 else set(sims) if len(groups) < limits.pipeline_depth else set())
        # as the shell does: the controlled part (none here), then the steps
        dispatches = core.build_steps(core.plan_controlled()[0], roomy) if roomy else []
        frames = [encoder.encode(d.step) for d in dispatches]
        scheduler(started)
        group = []
        for dispatch, frame in zip(dispatches, frames):
            worker = dispatch.worker
            # a step starts once it is sent and the worker's steps before it are done; a worker that
            # had sequences to run (steps whose results are not applied yet, or waiting ones) and
            # sat idle meanwhile waited for the scheduler (or in lockstep for the others)
            start = max(now, free_at[worker])
            if flights[worker] or worker in waiting:
                waited, speed = start - free_at[worker], step_s[worker]
                run.idle_s[speed] += waited
                run.longest_wait_s[speed] = max(run.longest_wait_s[speed], waited)
            free_at[worker] = start + step_s[worker]
            run.busy_s[step_s[worker]] += step_s[worker]
            flights[worker] += 1
            waiting.discard(worker)
            result = encoder.encode(sims[worker].step(decoder.decode(frame)))
            if lockstep:
                group.append((dispatch, result))
            else:
                groups.append((free_at[worker], [(dispatch, result)]))
        if group:
            groups.append((max(free_at[d.worker] for d, _ in group), group))
        run.steps += len(dispatches)
        run.seq_steps += sum(len(d.followers) + len(d.batch) for d in dispatches)
        if dispatches:
            continue  # queue the steps after them at once, where pipelines have room
        started = time.thread_time()
        core.emit_deferred()
        out = held + output()
        held = []
        scheduler(started)
        submitted = deliver(out)
        if not groups and by_rid and not submitted:
            raise RuntimeError(f"the core stalled: {len(by_rid)} requests, none in flight, none built")
        if (submitted and not lockstep) or not groups:
            continue  # new work may start a worker with room (the shell's wake); or every client is done
        # the next result (the oldest round's, in lockstep): a worker's own results come back in order
        now = max(now, groups[0][0] if lockstep else min(at for at, _ in groups))
        ready = [groups.popleft()] if lockstep else sorted((g for g in groups if g[0] <= now), key=lambda g: g[0])
        groups = deque(g for g in groups if g[0] > now) if not lockstep else groups
        started = time.thread_time()
        for _, group in ready:
            for dispatch, frame in group:
                flights[dispatch.worker] -= 1
                result = decoder.decode(frame)
                if kv_aware:
                    place.observe(dispatch.worker, dispatch.step, result)
                core.step_done(dispatch.worker, result)
                core.apply(dispatch, result)
                if not flights[dispatch.worker] and core.pool.workers[dispatch.worker].running:
                    waiting.add(dispatch.worker)
        core.end_step()
        held += output()
        scheduler(started)
        # as in the shell, whose loop builds the next steps before it reads the gateways' messages again:
        # a client's next turn reaches the scheduler after the steps of the workers just applied are out
    run.elapsed_s = now
    return run


def as_the_scheduler_starts():
    """This process set up as the scheduler service is when it starts (its tokenizer, with the text streams'
    tables built and the start-up heap frozen), its per-request info lines off; returns the tokenizer."""
    # the core's per-request info lines would swamp the output (and a real scheduler writes them to a file)
    # (and the logger cached, as common.logging configures the service's)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
                        cache_logger_on_first_use=True)
    settings = Settings()
    tokenizer = load_tokenizer(settings)
    text_table(tokenizer)
    freeze_startup_heap(settings.gc_young_threshold)
    return tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--seqs", type=int, default=256, help="users per worker (each one conversation at a time)")
    parser.add_argument("--step-ms", type=float, nargs="+", default=[5.0, 20.0])
    parser.add_argument("--sessions", type=int, default=2, help="conversations of each user, one after another")
    parser.add_argument("--turns", type=int, default=4, help="mean turns per session (1 to 2x-1)")
    parser.add_argument("--tokens", type=int, default=64, help="generated tokens per turn")
    parser.add_argument("--system-prompts", type=int, default=512, help="distinct shared system prompts")
    parser.add_argument("--zipf", type=float, default=1.0, help="skew of the system prompts' popularity")
    parser.add_argument("--system-tokens", type=int, default=512, help="mean system prompt length (half to 1.5x)")
    parser.add_argument("--user-tokens", type=int, default=48, help="mean new user tokens per turn (1 to 2x-1)")
    parser.add_argument("--kv-tokens", type=int, default=262144, help="KV pool of one worker (prefix cache included)")
    parser.add_argument("--step-token-budget", type=int, default=Limits().step_token_budget)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--core-calls", action="store_true", help="time the core's calls in the per-worker run")
    args = parser.parse_args()
    tokenizer = as_the_scheduler_starts()
    print(f"{args.seqs} users per worker, {args.sessions} conversations each of ~{args.turns} turns of {args.tokens} "
          f"tokens; prompts: one of {args.system_prompts} system prompts (~{args.system_tokens} tokens, "
          f"Zipf {args.zipf:g}) + history + ~{args.user_tokens} new; {args.kv_tokens:,} KV tokens per worker; "
          "hit rate: prompt tokens reused / prompt tokens")
    speeds = sorted(set(args.step_ms))
    print(f"workers: step times {', '.join(f'{ms:g} ms' for ms in args.step_ms)} in turn; idle: a worker's time "
          "between a step and the next while it had sequences to run (waiting for the scheduler, or in lockstep "
          "for the slower workers) / its time")
    print(f"{'workers':>7} {'pipelines':>10} {'steps':>7} {'core µs/step':>12} {'µs/seq':>6} {'tok/s':>8} "
          + " ".join(f"{f'idle@{ms:g}ms, max ms':>17}" for ms in speeds)
          + f" {'hit kv':>7} {'hit rnd':>7} {'ratio':>6} {'hit max':>7} {'turns kv':>8} {'turns rnd':>9} {'ratio':>6}"
          + f" {'gc young n/max/all':>18} {'gc older n/max/all':>18}")
    for workers in args.workers:
        rnd = simulate(args, workers, False, False, tokenizer)
        hit_rnd = rnd.reused_tokens / rnd.prompt_tokens
        turns_rnd = rnd.turns_kept / rnd.later_turns if rnd.later_turns else 0.0
        for lockstep in (True, False):
            pauses: dict[int, list[float]] = defaultdict(list)
            with collector_pauses(pauses):
                kv = simulate(args, workers, True, lockstep, tokenizer)
            gc_ms = " ".join(f"{len(ms):>4} {max(ms, default=0):>6.1f} {sum(ms):>6.0f}"
                             for ms in (pauses[0], pauses[1] + pauses[2]))
            hit_kv = kv.reused_tokens / kv.prompt_tokens
            turns_kv = kv.turns_kept / kv.later_turns if kv.later_turns else 0.0
            idle = " ".join(f"{kv.idle_s[s] / (kv.idle_s[s] + kv.busy_s[s]):>9.1%} {kv.longest_wait_s[s] * 1000:>7.1f}"
                            if kv.busy_s[s] else f"{'-':>17}"
                            for s in (ms / 1000 for ms in speeds))  # "-": fewer workers than step times
            print(f"{workers:>7} {'lockstep' if lockstep else 'per worker':>10} {kv.steps:>7} "
                  f"{kv.core_s / kv.steps * 1e6:>12.1f} {kv.core_s / kv.seq_steps * 1e6:>6.1f} {kv.decode_tokens / kv.elapsed_s:>8,.0f} {idle} "
                  f"{hit_kv:>7.1%} {hit_rnd:>7.1%} {hit_kv / hit_rnd if hit_rnd else float('inf'):>5.1f}x "
                  f"{kv.reusable_tokens / kv.prompt_tokens:>7.1%} {turns_kv:>8.1%} {turns_rnd:>9.1%} "
                  f"{turns_kv / turns_rnd if turns_rnd else float('inf'):>5.1f}x {gc_ms}")
        for name, (calls, spent) in sorted(kv.calls.items(), key=lambda item: -item[1][1]):
            print(f"{'':>7} core call {name:>16}: {calls:>8} calls {spent / calls * 1e6 if calls else 0:>8.1f} µs a call "
                  f"{spent / kv.seq_steps * 1e6:>6.2f} µs a sequence-step")

if __name__ == "__main__":
    main()
