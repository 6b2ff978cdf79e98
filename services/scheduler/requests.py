"""The scheduler's view of one live request: its prompt, progress, stop conditions and text stream."""

from __future__ import annotations

import enum
from array import array
from collections.abc import Collection
from dataclasses import dataclass, field

from common import wire
from common.blocks import whole_blocks
from common.pooling import PooledSum, pooled_positions
from common.textstream import TextStream


def stop_token(submit: wire.Submit, token: int, eos: Collection[int]) -> bool:
    """Whether a sampled token ends its sequence: one of the request's stop tokens, or an ``eos`` token
    unless the request ignores EOS (a controlled sequence passes none: its controller decides)."""
    return token in stop_tokens(submit, eos)


def stop_tokens(submit: wire.Submit, eos: Collection[int]) -> frozenset[int]:
    """The tokens that end the sequence (see ``stop_token``)."""
    return frozenset(submit.stop_token_ids).union(() if submit.ignore_eos else eos)


def length_reached(submit: wire.Submit, generated: int, total: int, max_len: int) -> bool:
    """Whether a sequence of ``total`` tokens, ``generated`` of them sampled, may grow no more."""
    return generated >= submit.max_tokens or total >= max_len


def token_limit(submit: wire.Submit, max_len: int) -> int:
    """How many tokens a plain sequence may generate: ``length_reached`` says yes once it generated
    this many."""
    return min(submit.max_tokens, max_len - submit.prompt_len)


class State(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class LiveRequest:
    """A request from admission to its last event. ``seq_id`` is the worker-side sequence."""

    submit: wire.Submit
    gateway: bytes
    order: int  # arrival order, the tie-breaker after priority
    text: TextStream | None  # None: its gateway works out its text (Submit.text_at_gateway), until a TextHandover
    deadline: float
    state: State = State.QUEUED
    paused: bool = False  # a paused request keeps its place (and KV) but is not stepped or admitted
    reserved: int = 0  # KV tokens reserved on its worker at admission
    seq_id: int = -1
    worker: bytes = b""
    fed: int = 0  # prompt tokens sent to the worker
    applied: int = 0  # prompt tokens whose step results were applied
    generated: list[int] = field(default_factory=list)  # the last one is fed by its next step
    in_flight: int = 0  # steps sent with this request whose results are not applied yet
    deferred: list[wire.TokenEvent] = field(default_factory=list)  # token events whose text is not worked out yet
    last_sample: bool = False  # whether the last step sent samples it (its next step can ``follow``)
    stop_ids: frozenset[int] = frozenset()  # the sampled tokens that end it (requests.stop_tokens), set at admission
    limit: int = 0  # the tokens it may generate (requests.token_limit), set at admission and by a Modify
    follower: bool = False  # in its worker's follow list (services.scheduler.batch): every step carries it
    sampling_dirty: bool = True  # send SamplingParams with the next SeqStep
    steering_dirty: bool = False  # send its steering with the next SeqStep (it has some, or a Modify changed it)
    # Session turns (Salience): the first SeqStep forks ``fork_of`` and/or drops ``backtrack``
    # tokens of a parked sequence; ``kv_tokens`` is what the worker's sequence holds of the prompt once
    # every step sent so far has run (``sessions.held_tokens`` adds the generated tokens), ``on_worker``
    # whether any step was sent. Token arrays (``wire.token_array``), as ``prompt``.
    fork_of: int | None = None
    backtrack: int = 0
    kv_tokens: array = field(default_factory=lambda: array("i"))
    on_worker: bool = False
    # Per-position outputs: the prompt positions asked about, and the logprobs already computed for
    # some of them (a chunk's first position is scored by the step that fed the previous chunk).
    logprob_positions: set[int] = field(default_factory=set)
    readout_positions: set[int] = field(default_factory=set)
    residual_positions: set[int] = field(default_factory=set)  # prompt positions whose residual stream is asked
    scored: dict[int, wire.ScoreResult] = field(default_factory=dict)
    pooled: PooledSum | None = None  # the embedding's positions and their sum so far (Submit.outputs.pooling)
    cached_tokens: int = 0  # prompt tokens whose KV was reused (a parked sequence, the prefix cache)
    block_keys: list[int] | None = None  # the prompt's full blocks' keys (common.blocks), once placement needed them
    # whether its plain token events may be packed (wire.Events): its gateway works out its text, and none of
    # its events carry more than a token (no top logprobs, prompt outputs or readouts); never again once false
    # (so that none of its events that were not packed comes before one that is, in one Events)
    packed: bool = True
    # the submit's fields read for every sequence in every step, as attributes of their own
    rid: str = field(init=False)
    prompt: array = field(init=False)  # wire.token_array: the collector never walks it
    sort_key: tuple[int, int] = field(init=False)  # priority, then arrival order
    controlled: bool = field(init=False)  # its controller decides its steps (services.scheduler.controlled)

    def __post_init__(self) -> None:
        self.rid, self.prompt = self.submit.rid, wire.token_array(self.submit.prompt)
        self.sort_key = (self.submit.priority, self.order)
        self.controlled = bool(self.submit.controller)
        self.steering_dirty = bool(self.submit.steering)
        self.packed = self.text is None and not self.submit.sampling.logprobs  # no top alternatives
        outputs = self.submit.outputs
        if outputs is None:
            return
        self.packed = self.packed and not (outputs.logprob_ranges or outputs.readout_ranges or outputs.pooling
                                           or outputs.residual_ranges)
        n = len(self.prompt)
        if outputs.pooling:
            self.pooled = PooledSum(pooled_positions(outputs.pooling, n))
        for span in outputs.logprob_ranges:
            self.logprob_positions.update(range(max(span.start, 0), min(span.end, n)))
        for span in outputs.readout_ranges:  # decoded positions too: read by the step that feeds them
            self.readout_positions.update(range(max(span.start, 0), min(span.end, n + self.submit.max_tokens)))
        if outputs.residual_layers:
            for span in outputs.residual_ranges:
                self.residual_positions.update(range(max(span.start, 0), min(span.end, n)))

    @property
    def first_output_position(self) -> int:
        """The first prompt position whose hidden states this request needs computed (len(prompt): none)."""
        n = len(self.prompt)
        pooled = [self.pooled.positions.start] if self.pooled is not None else []
        return min([p - 1 for p in self.logprob_positions if p > 0] + [p for p in self.readout_positions if p < n]
                   + pooled + list(self.residual_positions), default=n)

    @property
    def has_prompt_outputs(self) -> bool:
        """Whether any prompt position's outputs were asked (logprobs, readouts, residuals, the embedding)."""
        return bool(self.logprob_positions or self.readout_positions or self.residual_positions
                    or self.pooled is not None)

    @property
    def needed_tokens(self) -> int:
        """KV the request may grow to, in whole blocks (as the worker allocates it): reserved at admission so
        a burst queues instead of overflowing."""
        return whole_blocks(len(self.prompt) + self.submit.max_tokens)

    def next_chunk(self, chunk: int) -> tuple[list[int], bool]:
        """The prompt tokens to feed this step (at most ``chunk``) and whether to sample after them."""
        tokens = self.prompt[self.fed : self._chunk_end(self.fed + chunk)].tolist()
        return tokens, self.fed + len(tokens) == len(self.prompt) and self.submit.max_tokens > 0

    def _chunk_end(self, end: int) -> int:
        """``end``, moved off the inside of an image block: back to the block's start, or past its
        end when the block starts the chunk (the worker encodes an image within one chunk)."""
        for image in self.submit.images:
            if image.start < end < image.end:
                return image.start if image.start > self.fed else image.end
        return end

    def images_in(self, tokens: list[int]) -> list[wire.ImageInput]:
        """The images whose blocks lie in ``tokens``, the prompt chunk about to be fed."""
        if not self.submit.images:
            return []
        end = self.fed + len(tokens)
        return [image for image in self.submit.images if image.start < end and image.end > self.fed]

    def apply_patch(self, patch: wire.SamplingPatch) -> None:
        sampling = self.submit.sampling
        for name in ("temperature", "top_p", "top_k", "repetition_penalty", "seed"):
            value = getattr(patch, name)
            if value is not None:
                setattr(sampling, name, value)
        if patch.max_tokens is not None:
            self.submit.max_tokens = patch.max_tokens
        if patch.stop is not None:  # (stop strings for a text_at_gateway request: the core took its text first)
            self.submit.stop = patch.stop
            if self.text is not None:
                self.text.stop = list(patch.stop)
        self.sampling_dirty = True

    def steer(self, steering: list[wire.SteeringTerm], vectors: dict[str, bytes]) -> None:
        """A Modify's new steering, from the next fed token on. The KV it computes from then on is steered
        otherwise than the request's cache domain says, so the domain becomes its own: a session does not
        park this sequence for a later turn to reuse (the worker stops naming its blocks itself)."""
        if steering == self.submit.steering:
            return
        known = self.submit.steering_vectors | vectors
        self.submit.steering = steering
        self.submit.steering_vectors = {t.vector: known[t.vector] for t in steering if t.vector in known}
        self.submit.cache_domain = f"{self.submit.cache_domain}|steered-mid-stream:{self.rid}"
        self.steering_dirty = True

    def steering_step(self, seq: wire.SeqStep) -> None:
        """Put the request's steering on ``seq`` when it has not gone to the worker yet."""
        if self.steering_dirty:
            seq.steering = list(self.submit.steering)
            seq.vectors = dict(self.submit.steering_vectors)
            self.steering_dirty = False
