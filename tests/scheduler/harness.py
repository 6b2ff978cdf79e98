"""A scheduler core with fake workers, a fake tokenizer and a fake clock: no processes, no sockets."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from common import aici_wire, wire
from common.config import Controllers, Limits, Sessions
from common.event_text import EventTexts
from common.textstream import TextStream
from services.scheduler.controlled import Branch, MainReply
from services.scheduler.core import Dispatch, SchedulerCore
from services.scheduler.workers import Place, least_loaded

# token id -> text; 0-2 are special (skipped when decoding), 2 is EOS
VOCAB = ["<pad>", "<s>", "</s>", "a", "b", "c", " he", "llo", " wor", "ld", "!", " x", "\u00e9"] + [
    f" t{i}" for i in range(13, 64)
]
EOS = 2
HE, LLO, WOR, LD, BANG = 6, 7, 8, 9, 10
SPECIAL = {0, 1, 2}

class FakeTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True, clean_up_tokenization_spaces: bool = False) -> str:
        return "".join(VOCAB[i] for i in ids if not (skip_special_tokens and i in SPECIAL))

class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

def prompt(n: int, start: int = 13) -> list[int]:
    """``n`` ordinary prompt tokens."""
    return [start + i % 40 for i in range(n)]

class Harness:
    """Drives a ``SchedulerCore`` the way the service shell does, with step results made up by the test;
    and reads its output as a gateway does, working out the text of ``text_at_gateway`` requests."""

    def __init__(self, *, place: Place = least_loaded, sessions: Sessions | None = None,
                 controllers: Controllers | None = None, worker_gone: Callable[[bytes], None] = lambda identity: None,
                 generations_per_user: int = 0, **limits: object) -> None:
        self.clock = Clock()
        self.core = SchedulerCore(
            Limits(**limits), sessions or Sessions(), controllers or Controllers(),
            lambda stop, **options: TextStream(FakeTokenizer(), stop=stop, **options),
            place=place, worker_gone=worker_gone, clock=self.clock, generations_per_user=generations_per_user,
        )
        self.sent: list[tuple[bytes, wire.Msg]] = []
        self.texts = EventTexts(lambda: TextStream(FakeTokenizer()))  # the gateway's side (common.event_text)
        self.received: list[wire.TokenEvent | wire.RequestFailed] = []  # the events and failures, texts set

    # -- peers ----------------------------------------------------------------------------------

    def worker(self, identity: bytes = b"w1", *, capacity: int = 4096, max_model_len: int = 2048,
               stage: str = "ready") -> bytes:
        self.core.worker_hello(identity, wire.WorkerHello(
            worker_id=identity.decode(), stage=stage, vocab_size=len(VOCAB), max_model_len=max_model_len,
            eos_token_ids=[EOS], kv_capacity_tokens=capacity, message="boom" if stage == "failed" else "",
            wire_version=wire.WIRE_VERSION))
        return identity

    def submit(self, rid: str, prompt_ids: list[int], max_tokens: int = 16, *, gateway: bytes = b"gw",
               text_at_gateway: bool = True, **fields: object) -> wire.Msg:
        """Submit as a gateway does (``text_at_gateway`` False: as one that leaves every text to the scheduler)."""
        sampling = fields.pop("sampling", wire.SamplingParams(temperature=0.0))
        submit = wire.Submit(rid=rid, prompt=wire.pack_tokens(prompt_ids), max_tokens=max_tokens, sampling=sampling,
                             **fields)
        if text_at_gateway:
            self.texts.submitting(submit)
        return self.core.submit(gateway, submit)

    # -- steps ----------------------------------------------------------------------------------

    def build(self) -> list[Dispatch]:
        """Admit and build the next steps (plain requests only: no main-channel call expected)."""
        self.core.admit()
        plan, request = self.core.plan_controlled()
        assert request is None, "a controlled request needs plan_controlled/controlled_planned"
        return self.core.build_steps(plan)

    def result(self, dispatch: Dispatch, tokens: dict[str, int] | None = None, *,
               failures: dict[str, str] | None = None, **fields: object) -> wire.StepResult:
        """The worker's result for ``dispatch``: ``tokens`` sampled per request id (every sampling
        sequence not named gets token 3), in slot order (followers first)."""
        tokens, failures = tokens or {}, failures or {}
        slots: list[int] = []
        failed = []
        for owner, sample in [(r, True) for r in dispatch.followers] + [(o, s.sample or s.follow) for o, s in dispatch.batch]:
            rid = owner.request.rid if isinstance(owner, Branch) else owner.rid
            key = f"{rid}/{owner.index}" if isinstance(owner, Branch) and owner.index else rid
            if key in failures:
                failed.append(wire.SeqFailure(seq_id=owner.seq_id, message=failures[key]))
            slots.append(tokens.get(key, 3) if sample and key not in failures else -1)
        return wire.StepResult(step_id=dispatch.step.step_id, tokens=wire.pack_tokens(slots),
                               logprobs=wire.pack_logprobs([-0.5] * len(slots)), failures=failed, **fields)

    def apply(self, dispatches: Iterable[Dispatch], tokens: dict[str, int] | None = None, **kw: object) -> None:
        for dispatch in dispatches:
            result = self.result(dispatch, tokens, **kw)
            self.core.step_done(dispatch.worker, result)
            self.core.apply(dispatch, result)
        self.core.end_step()

    def cycle(self, tokens: dict[str, int] | None = None, **kw: object) -> list[Dispatch]:
        """One step at pipeline depth 1: build, apply with ``tokens``, work out the text."""
        steps = self.build()
        self.apply(steps, tokens, **kw)
        self.core.emit_deferred()
        return steps

    def run(self, script: dict[str, list[int]], *, max_steps: int = 100) -> None:
        """Cycle until every request of ``script`` ended, each sampling its tokens in order (then 3s)."""
        scripts = {rid: iter(tokens) for rid, tokens in script.items()}
        for _ in range(max_steps):
            if not any(rid in self.core.requests for rid in script):
                return
            steps = self.build()
            sampling = {owner.rid for d in steps for owner, seq in d.batch
                        if not isinstance(owner, Branch) and (seq.sample or seq.follow)}
            sampling |= {request.rid for d in steps for request in d.followers}
            self.apply(steps, {rid: next(scripts[rid], 3) for rid in sampling if rid in scripts})
            self.core.emit_deferred()
        raise AssertionError("the requests did not end")

    # -- what gateways got ----------------------------------------------------------------------

    def take(self) -> list[tuple[bytes, wire.Msg]]:
        out = self.core.take_output()
        self.sent += out
        for _, sent in out:  # as services.gateway.scheduler_client reads them, off the wire
            msg = wire.decode(wire.encode(sent))
            if isinstance(msg, wire.Events):
                for event in msg.token_events():
                    self.texts.fill(event)
                    self.received.append(event)
            elif isinstance(msg, (wire.RequestFailed, wire.TextHandover)):
                self.texts.close(msg.rid)
                if isinstance(msg, wire.RequestFailed):
                    self.received.append(msg)
        return out

    def events(self, rid: str) -> list[wire.TokenEvent]:
        self.take()
        return [e for e in self.received if isinstance(e, wire.TokenEvent) and e.rid == rid]

    def failures(self, rid: str) -> list[wire.RequestFailed]:
        self.take()
        return [m for m in self.received if isinstance(m, wire.RequestFailed) and m.rid == rid]

    def text(self, rid: str) -> str:
        return "".join(e.text for e in self.events(rid))

    def final(self, rid: str) -> wire.TokenEvent:
        ends = [e for e in self.events(rid) if e.finish_reason is not None]
        assert len(ends) == 1, ends
        return ends[0]

    def generated(self, rid: str) -> list[int]:
        return [t.token_id for e in self.events(rid) for t in e.tokens]

def followed(dispatches: list[Dispatch], rid: str) -> bool:
    """Whether the steps carry ``rid`` as a follower (``Step.follows``, no SeqStep)."""
    return any(request.rid == rid for d in dispatches for request in d.followers)

def seqs_of(dispatches: list[Dispatch], rid: str) -> list[wire.SeqStep]:
    return [seq for d in dispatches for owner, seq in d.batch
            if (owner.request.rid if isinstance(owner, Branch) else owner.rid) == rid]

def reply(request: aici_wire.MainRequest | None = None, data: dict[str, object] | None = None,
          frames: list[bytes] | None = None, error: str = "") -> MainReply:
    """The channel's answer to ``request``: ``error``, or ``data`` sent as the runtime's ok reply and read
    back as the scheduler's main channel reads it (typed by the request's op)."""
    if error:
        return MainReply(error=error)
    assert request is not None
    decoded = aici_wire.decode_main_reply(request, aici_wire.encode(aici_wire.ok(data or {})))
    return MainReply(data=decoded.data, frames=frames or [])
