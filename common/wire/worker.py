"""The scheduler <-> worker channel: steps, their results and masks, and the worker's hello (``WIRE_VERSION``)."""

from __future__ import annotations

import msgspec

from common.wire.base import Msg
from common.wire.packing import unpack_ids, unpack_logprobs, unpack_tokens
from common.wire.sampling import ImageInput, SampledToken, SamplingParams, SteeringTerm, TokenLogprob


class ScoreQuery(msgspec.Struct, array_like=True, gc=False):
    position: int
    target: int


class ScoreResult(msgspec.Struct, array_like=True, gc=False):
    position: int
    target: int
    logprob: float
    top: list[TokenLogprob] = []


class ReadoutResult(msgspec.Struct, array_like=True, gc=False):
    position: int
    values: bytes  # float32 [layers][concepts], little-endian


class SeqStep(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """One sequence's part of a step, applied in this order:

    1. ``fork_of`` (only on a sequence's first SeqStep): start as a copy of that live sequence as it
       stood before this step (its KV blocks shared copy-on-write, its sampling params and history).
    2. ``backtrack``: drop that many tokens from the end of the sequence (its KV is truncated).
    3. feed ``tokens`` (a prompt chunk, fast-forward tokens, or the last sampled token); may be empty
       only after a fork or backtrack with ``sample`` set, or with ``follow``.
    4. when ``sample`` is set, sample the next token from the logits after the last fed token.

    ``follow`` (``tokens`` empty): feed the token the worker sampled for this sequence in its previous
    step, which the scheduler has not seen yet; it lets the scheduler send a decode step before the
    previous step's result is back (the worker never waits for it between steps).

    ``sampling`` is sent when a sequence starts or its parameters change. ``mask_row`` indexes the
    step's mask frame (-1: no mask). ``images`` (positions in the whole sequence) are the images
    whose blocks the fed tokens hold; a block is never split between two SeqSteps."""

    seq_id: int
    tokens: list[int]
    sample: bool = True
    follow: bool = False
    sampling: SamplingParams | None = None
    mask_row: int = -1
    fork_of: int | None = None
    backtrack: int = 0
    images: list[ImageInput] = []
    # Per-position outputs (positions fed in this step; never taken from the prefix cache):
    # ``scores``: the logprob of ``target`` under the logits after ``position``, with
    # ``top_logprobs`` alternatives; ``readouts``: the concept readout of the hidden states at each position;
    # ``pool``: the final hidden states (after the final norm) at these positions, summed (StepResult.pooled).
    scores: list[ScoreQuery] = []
    top_logprobs: int = 0
    readouts: list[int] = []
    pool: list[int] = []
    # ``residuals``: the hidden states after each of ``residual_layers`` (0-based decoder layers) at these
    # positions (StepResult.residuals, values float32 [layers][hidden])
    residuals: list[int] = []
    residual_layers: list[int] = []
    # The sequence's activation steering (docs/steering.md), from this step's fed tokens on: sent when it starts or
    # changes ([]: none from now on); a fork starts with its parent's. ``vectors``: the canonical content of every
    # vector it names by id (common.steering.encode).
    steering: list[SteeringTerm] | None = None
    vectors: dict[str, bytes] = {}
    # Read on the step that creates the sequence (a fork is in its parent's domain; sent with ``sampling``):
    # its cache domain (Submit.cache_domain), the seed of its blocks' hash chain (common.blocks.domain_root).
    cache_domain: str = ""


class Step(Msg, tag="step", gc=False):
    """One batched forward pass. ``free`` lists sequences to drop before it runs; ``free_all`` drops
    every sequence first (a scheduler's first step to a worker: what the worker holds belongs to
    requests of a scheduler that is gone, and its sequence ids will be reused).

    ``follows`` (packed, :func:`pack_ids`) are the sequences that only go on decoding, the bulk of a
    step: each feeds the token it sampled last and samples the next with its parameters as they stand,
    as a ``follow`` SeqStep would, without a SeqStep each. ``seqs`` are the others. The step's *slots*
    are ``follows`` in order, then ``seqs``: its result's arrays are in slot order (:meth:`slot_ids`).

    When any ``mask_row`` is set, one binary frame follows: ``n_rows`` packed bitsets, little-endian
    bit order, ``ceil(vocab_size / 32)`` uint32 words a row; bit set = token allowed.
    """

    step_id: int
    seqs: list[SeqStep]
    follows: bytes = b""
    free: list[int] = []
    free_all: bool = False
    # The masks come later, in a StepMasks of the same step_id (no frame follows the Step): the
    # worker runs the forward pass meanwhile and samples once they arrive.
    masks_follow: bool = False

    def slot_ids(self) -> list[int]:
        """The sequence of each slot."""
        return unpack_ids(self.follows) + [s.seq_id for s in self.seqs]


class SeqFailure(msgspec.Struct, kw_only=True, gc=False):
    seq_id: int
    message: str


class StepMasks(Msg, tag="step_masks"):
    """The sampling part of a Step sent with ``masks_follow``, followed by its mask frame (as a
    Step's frame, rows by ``SeqStep.mask_row``). ``failures``: sampling sequences not to sample this
    step (their tokens stay fed), e.g. their controller stopped, spliced or failed."""

    step_id: int
    failures: list[SeqFailure] = []


class StepAbandon(Msg, tag="step_abandon"):
    """Between the ranks of a tensor-parallel worker only: rank 0 gave up waiting for the
    StepMasks of a ``masks_follow`` step, whose sampling sequences fail with ``reason``."""

    step_id: int
    reason: str


class StepResult(Msg, tag="step_result", gc=False):
    step_id: int
    # One entry per slot of the step (``Step.slot_ids``), packed (``pack_tokens``, ``pack_logprobs``):
    # the token sampled (-1: none, the sequence did not sample or failed) and its logprob.
    tokens: bytes = b""
    logprobs: bytes = b""
    top: dict[int, list[TokenLogprob]] = {}  # slot -> the top alternatives (SamplingParams.logprobs > 0)
    failures: list[SeqFailure] = []
    forward_ms: float = 0.0
    cached_tokens: dict[int, int] = {}  # seq_id -> fed tokens whose KV came from the prefix cache
    scores: dict[int, list[ScoreResult]] = {}  # seq_id -> answers to its SeqStep.scores
    readouts: dict[int, list[ReadoutResult]] = {}  # seq_id -> answers to its SeqStep.readouts
    residuals: dict[int, list[ReadoutResult]] = {}  # seq_id -> answers to its SeqStep.residuals
    pooled: dict[int, bytes] = {}  # seq_id -> the sum of its SeqStep.pool positions' states, float32 little-endian
    # the worker's KV pool after the step (-1: not reported): tokens of empty blocks, and of blocks that
    # only hold reusable prefixes (allocations take them when empty ones run out); the rest is in use
    kv_free_tokens: int = -1
    kv_cached_tokens: int = -1
    # block events: keys (common.blocks.block_key) of the prefix blocks the worker's cache registered
    # and forgot since its last step (after a Step with free_all: every block it holds, none gone)
    blocks_new: list[int] = []
    blocks_gone: list[int] = []

    def slots(self) -> tuple[list[int], list[float]]:
        """Each slot's sampled token (-1: none) and its logprob (the alternatives are ``top``'s). ValueError:
        the arrays are malformed (not whole entries, not one each per slot, or ``top`` names a slot past them)."""
        tokens, logprobs = unpack_tokens(self.tokens), unpack_logprobs(self.logprobs)
        if len(tokens) != len(logprobs):
            raise ValueError(f"{len(tokens)} tokens but {len(logprobs)} logprobs")
        if self.top and not all(0 <= slot < len(tokens) for slot in self.top):
            raise ValueError(f"top alternatives for slots {sorted(self.top)} of {len(tokens)}")
        return tokens, logprobs

    def sampled(self) -> list[SampledToken]:
        """Each slot's sampled token (token -1: none), alternatives included (see :meth:`slots`)."""
        tokens, logprobs = self.slots()
        return [SampledToken(token, logprob, self.top.get(slot) or []) for slot, (token, logprob)
                in enumerate(zip(tokens, logprobs))]


def samples_by_seq(step: Step, result: StepResult) -> dict[int, SampledToken]:
    """seq_id -> token of every slot that sampled one (for tools and tests: the scheduler reads the
    result in slot order)."""
    return {seq_id: sampled for seq_id, sampled in zip(step.slot_ids(), result.sampled()) if sampled.token_id >= 0}


# The scheduler-worker protocol's version: bump it with any change to the messages between them (Step, StepResult,
# StepMasks, WorkerHello ...) that a peer running older code would misread. A worker names it in every hello; the
# scheduler places work only on workers of its own version (another one is shown as a failed worker, with why).
WIRE_VERSION = 4


class WorkerHello(Msg, tag="worker_hello"):
    """A worker announces itself (before loading) and reports loading progress until ready."""

    worker_id: str
    stage: str  # "loading" | "ready" | "failed"
    progress: int = 0
    message: str = ""
    model: str = ""
    vocab_size: int = 0
    max_model_len: int = 0
    eos_token_ids: list[int] = []
    device: str = ""
    kv_capacity_tokens: int = 0
    hidden_size: int = 0
    num_layers: int = 0  # decoder layers (a steering layer is 0 .. num_layers - 1)
    readout_concepts: list[str] = []
    readout_layers: list[int] = []
    forward: str = ""  # its engine's backend: "paged" (the native forward, +cuda_graphs, +triton) or "transformers"
    fallback_reason: str = ""  # on "transformers": why the native forward does not serve this model
    incarnation: str = ""  # the worker process's life: a new one holds none of the old one's sequences
    wire_version: int = 0  # WIRE_VERSION of the worker's code (0: code from before versions)
