"""The engine: live sequences, their KV blocks and sampling state, and one batched step at a time.

A sequence starts the first time its id appears in a step (that SeqStep carries its sampling
parameters, or ``fork_of`` names the live sequence it copies) and lives until it appears in
``Step.free``. A sequence that fails (bad input, KV pool exhausted, a mask that allows nothing, a
fork of an unknown sequence, a backtrack past its start) is released on the spot and reported in
``StepResult.failures``; the other sequences of the step go on. The same id used again later
starts a new sequence.

Each SeqStep is applied in the order :class:`common.wire.SeqStep` gives:

1. **fork** (``fork_of``): every fork of a step is taken first, from the sequences as they stood
   before the step (so a parent's own SeqStep in the same step, even a failing one, does not
   change what its forks get). The parent must be live before the step: one that is unknown,
   failed earlier, new in this step or listed in its ``free`` fails the fork only, as does a
   ``seq_id`` that is already live. The fork shares all of the parent's KV blocks (copy-on-write), and
   inherits its token history and sampling parameters (replaced when its SeqStep carries
   ``sampling``). Its random generator is *reseeded deterministically*: when the parent has a
   generator (a seed), the fork's generator is seeded with the first 63 bits of BLAKE2b(the
   parent generator's state at the fork, the number of forks the parent made before); the
   parent's own draws are untouched. So forks of one parent differ from each other and from the
   parent, and a rerun with the same seeds and the same steps gives the same tokens. A fork whose
   SeqStep carries a *different* seed starts a fresh generator from that seed instead (as a new
   sequence with that seed would); without a parent seed the fork draws from torch's global
   generator, as its parent does.
2. **backtrack**: the last ``backtrack`` tokens are dropped (history and KV); past the start of
   the sequence the sequence fails.
3. **feed** ``tokens``: a prompt chunk, fast-forward tokens or the last sampled token; any number,
   in any phase. Full blocks of the fed tokens already in the prefix cache are referenced instead
   of computed (``StepResult.cached_tokens``); the last fed token is always computed when the
   step samples. Empty ``tokens`` are allowed after a fork or backtrack with ``sample`` set: the
   sequence's last token is then computed again (its logits are not kept between steps).
4. **sample** from the logits after the last token.

A SeqStep's ``steering`` replaces its sequence's steering from its fed tokens on (checked when admitted: a bad
term fails the sequence; :mod:`services.worker.steering`), and the runner adds it after the layers it names.

``Step.follows`` lists, packed, the sequences that only go on decoding: each runs as a ``follow``
SeqStep (one the engine keeps per sequence, made once) before the step's ``seqs``. The result's arrays
(``StepResult.tokens``, ``logprobs``, ``top``) have one entry per slot, in that order.

A Step sent with ``masks_follow`` runs in two phases: :meth:`Engine.forward` (steps 1-3 and the
forward pass) while the scheduler's controllers compute the masks, then :meth:`Engine.sample_with`
once its :class:`common.wire.StepMasks` came (the mask rows are checked then, not at admission).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


import numpy as np
import structlog
import torch
from transformers import PretrainedConfig

from common.config import Settings
from common.model_source import load_tokenizer
from common.pooling import vector_bytes
from common.wire import (EngineStats, ReadoutResult, SampledToken, ScoreResult, SeqFailure, SeqStep, Step, StepMasks,
                         StepResult, TokenLogprob, pack_logprobs, pack_tokens, unpack_ids)
from services.worker.hf_fallback import HFFallback
from services.worker.vision import VisionFallback
from services.worker.kv_cache import BlockTables, PagedKVCache, PoolExhausted, bytes_per_token, plan_num_blocks
from services.worker.model_loader import LoadedModel
from services.worker.layers.kernels import KernelChoice
from services.worker.models import family_of, unsupported_reason
from services.worker.models.paged import PagedModel
from services.worker.readouts import Readouts
from services.worker.runner import Runner, SeqInput
from services.worker.steering import Steering, SteeringInvalid, Vectors
from services.worker.tensor_parallel import Ranks
from services.worker.sampler import SeqSampler, mask_allows_any, masked_scores, sample, validate_params
from services.worker.transfer import to_device


log = structlog.get_logger()


@dataclass
class _Seq:
    sampler: SeqSampler
    tokens: list[int] = field(default_factory=list)  # every token fed so far; len() is the cached length
    forks: int = 0  # forks made of this sequence so far (seeds each fork's generator apart)
    last_sample: int | None = None  # sampled and not fed yet: what a ``follow`` SeqStep feeds
    follow: SeqStep | None = None  # the follow SeqStep that stands for it in ``Step.follows`` (made once)
    steering: Steering | None = None  # what it adds to the residual stream (None: nothing)


def layer_kernels(loaded: LoadedModel, gpu_kernels: str) -> KernelChoice:
    """Whose ops run around the native forward's matmuls: the kernel library's where its kernel
    serves the projections (a decode step's layer is then one call), Triton's on a GPU where the
    setting asks, else torch's."""
    if loaded.kernel:
        return "library"
    return "triton" if loaded.device.type == "cuda" and gpu_kernels == "triton" else "torch"


def _kv_shape(config: PretrainedConfig) -> tuple[int, int, int]:
    """(layers, key/value heads, head dim) of a decoder config (a vision-language config's text part)."""
    config = config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return config.num_hidden_layers, kv_heads, head_dim


@dataclass
class _Masks:
    """A step's mask rows in host memory: ``index`` maps a mask row number to its row in ``words``
    (packed bitsets), ``allows_any`` says which rows allow at least one token."""

    index: dict[int, int]
    words: np.ndarray
    allows_any: np.ndarray


class _Invalid(Exception):
    """A sequence's part of a step cannot run; the message goes to the scheduler."""


@dataclass
class Forwarded:
    """A step between its forward pass and its sampling (see :meth:`Engine.forward`)."""

    step: Step
    failures: list[SeqFailure]
    sampling: list[SeqStep]  # the accepted sequences to sample, in the order of the logits rows
    logits: torch.Tensor | None
    cached: dict[int, int]
    scores: dict[int, list[ScoreResult]]
    readouts: dict[int, list[ReadoutResult]]
    residuals: dict[int, list[ReadoutResult]]
    pooled: dict[int, bytes]
    elapsed_s: float  # time spent on the step so far (not counting a wait for its masks)
    slots: dict[int, int]  # seq_id -> its slot (``Step.slot_ids``)
    size: int  # the step's slots


def _plain_decode(s: SeqStep, tokens: list[int]) -> bool:
    """One token fed and sampled after, nothing else asked (see Engine._admit_decode)."""
    return (
        len(tokens) == 1 and s.sample and s.sampling is None and not s.backtrack and s.fork_of is None
        and not s.images and not s.scores and not s.readouts and not s.pool and not s.residuals and s.steering is None
    )


def _check_mask(s: SeqStep, masks: _Masks | None) -> None:
    """A sampling sequence's mask row, when it names one, must be in the frame and allow a token
    (``masks`` None: the masks follow the step and are checked before sampling)."""
    if s.mask_row < 0 or masks is None:
        return
    index = masks.index.get(s.mask_row)
    if index is None:
        raise _Invalid(f"sequence {s.seq_id}: mask row {s.mask_row} is missing from the step's mask frame")
    if not masks.allows_any[index]:
        raise _Invalid(f"sequence {s.seq_id}: its mask allows no token")


class Engine:
    """Runs :class:`common.wire.Step` messages against a loaded model."""

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        num_blocks: int,
        native: bool = True,
        cuda_graph_batch: int = 0,
        readouts: Readouts | None = None,
        ranks: Ranks | None = None,
        gpu_kernels: str = "torch",
    ) -> None:
        """``num_blocks``: KV pool size including the reserved null block. ``native=False`` forces
        the transformers fallback even for a supported architecture. ``cuda_graph_batch`` > 0 on a
        GPU replays decode steps of up to that many sequences from CUDA graphs. ``ranks``: this
        engine is one rank of a tensor-parallel worker (its shard planned), holding its KV heads.
        ``gpu_kernels``: the ``gpu_kernels`` setting."""
        self.loaded = loaded
        self.device = loaded.device
        self.vocab_size = loaded.vocab_size
        self.max_model_len = loaded.max_model_len
        config = loaded.config
        reason = unsupported_reason(config, loaded.max_model_len) if native else "native forward disabled"
        self.fallback_reason = reason  # None: the native forward runs
        self.runner: Runner
        self.cache: PagedKVCache | None = None
        if reason is not None and ranks is not None:
            raise ValueError(f"tensor parallel needs the native forward: {reason}")
        if reason is None:
            layers, kv_heads, head_dim = _kv_shape(config)
            if ranks is not None:
                kv_heads = ranks.plan(config).num_kv_heads
            cache = PagedKVCache(
                num_layers=layers,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                num_blocks=num_blocks,
                dtype=loaded.dtype,
                device=loaded.device,
            )
            self.cache = cache
            self.tables = cache.tables
            family = family_of(config)
            assert family is not None
            # tensor parallel shards dense weights and runs torch's ops around them
            runner = family.build(loaded.model, cache, loaded.max_model_len, loaded.linears if ranks is None else None,
                                  layer_kernels(loaded, gpu_kernels) if ranks is None else "torch",
                                  None if ranks is None else ranks.shard)
            if cuda_graph_batch > 0 and loaded.device.type == "cuda" and ranks is None:
                runner.enable_cuda_graphs(cuda_graph_batch, -(-loaded.max_model_len // cache.tables.block_size))
            if readouts is not None:
                runner.tap_layers = frozenset(readouts.layers)
            self.runner = runner
            self.backend = "paged+cuda_graphs" if runner.graphs is not None else "paged"
            if runner.kernels.ops is not None and loaded.device.type == "cuda":
                self.backend += "+triton"
        else:
            log.info("worker.fallback_forward", reason=reason)
            self.tables = BlockTables(num_blocks, prefix_caching=False)
            fallback = VisionFallback(loaded.model, loaded.vision) if loaded.vision else HFFallback(loaded.model)
            if not fallback.can_capture:
                readouts = None
            elif readouts is not None:
                fallback.tap_layers = frozenset(readouts.layers)
            self.runner = fallback
            self.backend = "transformers"
        self.readouts = readouts
        text = config.get_text_config()
        self.num_layers = text.num_hidden_layers
        self.vectors = Vectors(self.num_layers, text.hidden_size, loaded.dtype, loaded.device, readouts)
        self.seqs: dict[int, _Seq] = {}
        self.fed_tokens = 0  # tokens fed by accepted SeqSteps, and how many of them the cache gave
        self.cached_tokens = 0

    @classmethod
    def create(cls, loaded: LoadedModel, settings: Settings, ranks: Ranks | None = None) -> Engine:
        """An engine whose KV pool holds ``max_batch_size`` full-length sequences, or what memory
        allows. Tensor-parallel ranks plan with the whole model's KV per token (on the CPU they
        share one host's memory; on GPUs it is conservative) and agree on the smallest pool."""
        token_bytes = bytes_per_token(*_kv_shape(loaded.config), loaded.dtype)
        num_blocks = plan_num_blocks(
            max_batch_size=settings.limits.max_batch_size,
            max_model_len=loaded.max_model_len,
            token_bytes=token_bytes,
            device=loaded.device,
            memory_fraction=settings.limits.kv_memory_fraction,
            cpu_max_bytes=settings.limits.kv_cpu_max_bytes,
        )
        if ranks is not None:
            num_blocks = ranks.agree(num_blocks)
        graphs = settings.limits.max_batch_size if settings.limits.cuda_graphs else 0
        readouts = Readouts.build(  # dropped by a runner that cannot capture hidden states
            settings.sessions,
            num_layers=loaded.config.get_text_config().num_hidden_layers,
            unembedding=loaded.model.get_output_embeddings().weight.detach(),
            tokenizer=loaded.tokenizer if loaded.tokenizer is not None else load_tokenizer(settings),
            dtype=loaded.dtype,
        )
        return cls(loaded, num_blocks=num_blocks, cuda_graph_batch=graphs, readouts=readouts, ranks=ranks,
                   gpu_kernels=settings.gpu_kernels)

    def capture_graphs(self) -> int:
        """Capture the CUDA graphs of every decode bucket now (a no-op without them); returns
        how many graphs the runner holds."""
        graphs = getattr(self.runner, "graphs", None)
        if graphs is None:
            return 0
        graphs.capture_all()
        return graphs.captured

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the whole pool holds (live, cached and free blocks alike)."""
        return self.tables.capacity_tokens

    def stats(self) -> EngineStats:
        """Pool and prefix-cache figures (:class:`EngineStats` says what each counts)."""
        tables, allocator = self.tables, self.tables.allocator
        return EngineStats(
            backend=self.backend,
            weights=self.loaded.weights,
            active_seqs=len(self.seqs),
            kv_capacity_tokens=tables.capacity_tokens,
            kv_free_tokens=tables.empty_tokens,
            kv_cached_tokens=tables.cached_tokens,
            kv_used_tokens=tables.capacity_tokens - tables.free_tokens,
            kv_block_size=tables.block_size,
            kv_blocks_total=allocator.num_blocks - 1,
            kv_blocks_free=allocator.num_empty,
            kv_blocks_cached=allocator.num_cached,
            kv_blocks_used=allocator.num_blocks - 1 - allocator.num_free,
            kv_evictions=allocator.evictions,
            prefix_caching=bool(tables.prefix_caching),
            prefix_fed_tokens=self.fed_tokens,
            prefix_cached_tokens=self.cached_tokens,
            prefix_hit_rate=self.cached_tokens / self.fed_tokens if self.fed_tokens else 0.0,
        )

    def drop_prefix_cache(self) -> int:
        """Empty the prefix cache of unreferenced blocks (live sequences keep theirs, and their
        full blocks stay reusable); returns how many blocks were dropped. For benchmarks of cold
        prefill, or after anything that changes what keys and values a token prefix gives."""
        return self.tables.allocator.drop_cached()

    def free(self, seq_ids: Iterable[int]) -> None:
        """Release sequences (unknown ids are ignored)."""
        for seq_id in seq_ids:
            self.seqs.pop(seq_id, None)
            self.tables.release(seq_id)
            self.runner.release(seq_id)

    def step(self, step: Step, mask_frame: bytes | memoryview | None = None) -> StepResult:
        """Free ``step.free``, fork, backtrack, feed every SeqStep, sample where asked.
        Per-sequence problems become ``failures``; an exception means a bug, and the caller fails
        the whole step."""
        masks = self._mask_rows(step.seqs, mask_frame)
        forwarded = self.forward(step, masks)
        return self._sample(forwarded, forwarded.sampling, masks)

    @torch.inference_mode()
    def forward(self, step: Step, masks: _Masks | None = None) -> Forwarded:
        """The first phase of :meth:`step`: free, fork, backtrack, feed and run the forward pass,
        keeping the logits of the sequences to sample. ``masks`` None: the masks follow
        (``Step.masks_follow``) and :meth:`sample_with` checks them."""
        started = time.perf_counter()
        self.free(list(self.seqs) if step.free_all else step.free)
        batch = self._batch(step)
        failures: list[SeqFailure] = []
        counts: dict[int, int] = {}
        for s in batch:
            counts[s.seq_id] = counts.get(s.seq_id, 0) + 1
        candidates: list[SeqStep] = []
        for s in batch:
            if counts[s.seq_id] > 1:
                self._fail(failures, s, _Invalid(f"sequence {s.seq_id} appears {counts[s.seq_id]} times in step {step.step_id}"))
            else:
                candidates.append(s)
        ready: list[SeqStep] = []
        for s in candidates:  # all forks first: they copy the parents as they were before the step
            try:
                if s.fork_of is not None:
                    self._fork(s)
                ready.append(s)
            except _Invalid as exc:
                self._fail(failures, s, exc)
        inputs: list[SeqInput] = []
        accepted: list[SeqStep] = []
        cached: dict[int, int] = {}
        for s in ready:
            try:
                tokens = self._follow_feed(s) if s.follow else s.tokens
                item, hits = self._admit(s, tokens, masks)
            except _Invalid as exc:
                self._fail(failures, s, exc)
                continue
            accepted.append(s)
            self.fed_tokens += len(tokens)
            self.cached_tokens += hits
            if item is not None:
                inputs.append(item)
            if hits:
                cached[s.seq_id] = hits
        copies = self.tables.take_copies()
        if copies and self.cache is not None:
            self.cache.copy_blocks(copies)

        logits: torch.Tensor | None = None
        if inputs:
            logits = self.runner.forward(inputs)  # one row per sampling sequence, in order
        for s in accepted:
            self.tables.commit(s.seq_id, self.seqs[s.seq_id].tokens)
        scores, readouts, residuals, pooled = self._position_outputs(inputs, {s.seq_id: s for s in accepted})
        sampling = [s for s in accepted if s.sample]  # each has an input: the last fed token is computed
        slots = {s.seq_id: slot for slot, s in enumerate(batch)}  # a repeated id failed: its slot does not matter
        return Forwarded(step, failures, sampling, logits, cached, scores, readouts, residuals, pooled,
                         time.perf_counter() - started, slots, len(batch))

    def _batch(self, step: Step) -> list[SeqStep]:
        """The step's SeqSteps in slot order: a follow SeqStep for each of ``follows`` (the same object
        every step), then ``seqs``."""
        batch = []
        for seq_id in unpack_ids(step.follows):
            seq = self.seqs.get(seq_id)
            if seq is None:  # it fails as a follow of an unknown sequence
                batch.append(SeqStep(seq_id=seq_id, tokens=[], follow=True))
                continue
            if seq.follow is None:
                seq.follow = SeqStep(seq_id=seq_id, tokens=[], follow=True)
            batch.append(seq.follow)
        return batch + step.seqs

    @torch.inference_mode()
    def sample_with(self, forwarded: Forwarded, masks: StepMasks, mask_frame: bytes | memoryview | None) -> StepResult:
        """The second phase of a ``masks_follow`` step, once its StepMasks came: the sequences in
        ``masks.failures`` stay fed and are not sampled (nor reported); the others' mask rows are
        checked (a missing row or one that allows nothing fails that sequence), then they are sampled."""
        started = time.perf_counter()
        rows = self._mask_rows(forwarded.sampling, mask_frame)
        skipped = {f.seq_id for f in masks.failures}
        keep: list[SeqStep] = []
        for s in forwarded.sampling:
            if s.seq_id in skipped:
                continue
            try:
                _check_mask(s, rows)
                keep.append(s)
            except _Invalid as exc:
                self._fail(forwarded.failures, s, exc)
        forwarded.elapsed_s += time.perf_counter() - started
        return self._sample(forwarded, keep, rows)

    def abandon(self, forwarded: Forwarded, message: str) -> StepResult:
        """End a ``masks_follow`` step whose masks never came: its sampling sequences fail."""
        for s in forwarded.sampling:
            self._fail(forwarded.failures, s, _Invalid(f"sequence {s.seq_id}: {message}"))
        return self._sample(forwarded, [], self._mask_rows([], None))

    def _fail(self, failures: list[SeqFailure], s: SeqStep, exc: Exception) -> None:
        failures.append(SeqFailure(seq_id=s.seq_id, message=str(exc)))
        self.free([s.seq_id])

    @torch.inference_mode()
    def _sample(self, forwarded: Forwarded, sampling: list[SeqStep], masks: _Masks) -> StepResult:
        """Sample ``sampling`` (a subsequence of ``forwarded.sampling``) and build the step's result."""
        started = time.perf_counter()
        sampled: list[SampledToken] = []
        if sampling:
            logits = forwarded.logits
            assert logits is not None
            if len(sampling) < len(forwarded.sampling):
                row_of = {s.seq_id: i for i, s in enumerate(forwarded.sampling)}
                logits = logits[to_device([row_of[s.seq_id] for s in sampling], logits.device)]
            masked = self._masked(logits, sampling, masks)
            seqs = [self.seqs[s.seq_id] for s in sampling]
            sampled = sample(logits, [q.sampler for q in seqs], [q.tokens for q in seqs], masked)
            for q, t in zip(seqs, sampled):
                q.last_sample = t.token_id
        tokens, logprobs = [-1] * forwarded.size, [0.0] * forwarded.size
        top = {}
        for s, t in zip(sampling, sampled):
            slot = forwarded.slots[s.seq_id]
            tokens[slot], logprobs[slot] = t.token_id, t.logprob
            if t.top:
                top[slot] = t.top
        step = forwarded.step
        allocator = self.tables.allocator
        blocks_new, blocks_gone = allocator.take_events(everything=step.free_all)
        return StepResult(
            mid=step.mid,
            step_id=step.step_id,
            tokens=pack_tokens(tokens),
            logprobs=pack_logprobs(logprobs),
            top=top,
            failures=forwarded.failures,
            forward_ms=(forwarded.elapsed_s + time.perf_counter() - started) * 1000,
            cached_tokens=forwarded.cached,
            scores=forwarded.scores,
            readouts=forwarded.readouts,
            residuals=forwarded.residuals,
            pooled=forwarded.pooled,
            kv_free_tokens=self.tables.empty_tokens,
            kv_cached_tokens=self.tables.cached_tokens,
            blocks_new=blocks_new,
            blocks_gone=blocks_gone,
        )

    def _position_outputs(self, inputs: list[SeqInput], steps: dict[int, SeqStep]) -> tuple[
        dict[int, list[ScoreResult]], dict[int, list[ReadoutResult]], dict[int, list[ReadoutResult]], dict[int, bytes]
    ]:
        """Answers to the steps' ``scores``, ``readouts``, ``residuals`` and ``pool`` from the runner's captured
        hidden states."""
        captured = getattr(self.runner, "captured", None)
        scores: dict[int, list[ScoreResult]] = {}
        readouts: dict[int, list[ReadoutResult]] = {}
        residuals: dict[int, list[ReadoutResult]] = {}
        pooled: dict[int, bytes] = {}
        if captured is None:
            return scores, readouts, residuals, pooled
        runner = self.runner
        assert isinstance(runner, (PagedModel, HFFallback))
        row_of: dict[tuple[int, int], int] = {}
        for item in inputs:
            for p in item.capture:
                row_of[(item.seq_id, p)] = len(row_of)
        score_rows = [(seq_id, q) for seq_id, s in steps.items() for q in s.scores]
        if score_rows:
            index = to_device([row_of[(seq_id, q.position)] for seq_id, q in score_rows], self.device)
            logprobs = runner._logits(captured.final[index]).log_softmax(-1)
            targets = to_device([q.target for _, q in score_rows], self.device)
            picked = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1).tolist()
            k = max(steps[seq_id].top_logprobs for seq_id, _ in score_rows)
            top_ids, top_lps = ([[]] * len(score_rows), [[]] * len(score_rows))
            if k > 0:
                top = logprobs.topk(min(k, self.vocab_size), dim=-1)
                top_ids, top_lps = top.indices.tolist(), top.values.tolist()
            for j, (seq_id, q) in enumerate(score_rows):
                n = steps[seq_id].top_logprobs
                alternatives = [TokenLogprob(token_id=a, logprob=b) for a, b in zip(top_ids[j][:n], top_lps[j][:n])]
                scores.setdefault(seq_id, []).append(ScoreResult(q.position, q.target, picked[j], alternatives))
        readout_rows = [(seq_id, p) for seq_id, s in steps.items() for p in s.readouts]
        if readout_rows and self.readouts is not None:
            index = to_device([row_of[key] for key in readout_rows], self.device)
            hidden = [captured.layers[layer][index] for layer in self.readouts.layers]
            values = self.readouts.project(hidden, runner.final_norm_of).cpu().numpy().astype("<f4")
            for j, (seq_id, p) in enumerate(readout_rows):
                readouts.setdefault(seq_id, []).append(ReadoutResult(p, values[j].tobytes()))
        for seq_id, s in steps.items():
            if s.pool:
                index = to_device([row_of[(seq_id, p)] for p in s.pool], self.device)
                states = runner.final_norm_of(captured.final[index]).float()
                pooled[seq_id] = vector_bytes(states.sum(0).cpu().numpy())
            if s.residuals:
                index = to_device([row_of[(seq_id, p)] for p in s.residuals], self.device)
                states = torch.stack([captured.layers[layer][index] for layer in s.residual_layers], dim=1)
                values = states.float().cpu().numpy().astype("<f4")  # [positions, layers, hidden]
                residuals[seq_id] = [ReadoutResult(p, values[j].tobytes()) for j, p in enumerate(s.residuals)]
        return scores, readouts, residuals, pooled

    def _mask_rows(self, seqs: list[SeqStep], frame: bytes | memoryview | None) -> _Masks:
        """The packed mask rows these sequences refer to, in host memory; a frame too short for a
        row leaves that row out (its sequence then fails in ``_check_mask``)."""
        wanted = sorted({s.mask_row for s in seqs if s.mask_row >= 0})
        if not wanted or frame is None:
            return _Masks({}, np.empty((0, 0), dtype=np.int32), np.empty(0, dtype=bool))
        words_per_row = -(-self.vocab_size // 32)
        packed = np.frombuffer(frame, dtype="<i4", count=(len(frame) // 4 // words_per_row) * words_per_row)
        packed = packed.reshape(-1, words_per_row)
        rows = [r for r in wanted if r < packed.shape[0]]
        words = packed[rows]
        return _Masks({r: i for i, r in enumerate(rows)}, words, mask_allows_any(words, self.vocab_size))

    def _masked(self, logits: torch.Tensor, sampling: list[SeqStep], masks: _Masks) -> torch.Tensor | None:
        """``logits`` (a row per sequence of ``sampling``) with -inf for the tokens the sequences' mask rows
        do not allow (None: no masks): one host-to-device copy of the packed rows, then ``masked_scores``
        over the rows that have one."""
        rows = [masks.index[s.mask_row] if s.mask_row >= 0 else -1 for s in sampling]
        if max(rows) < 0:
            return None
        masked = [i for i, r in enumerate(rows) if r >= 0]
        words = to_device(masks.words[[rows[i] for i in masked]], self.device, torch.int32)
        if len(masked) == len(sampling):
            return masked_scores(logits, words, self.vocab_size)
        index = to_device(masked, self.device)
        scores = logits.clone()
        scores[index] = masked_scores(logits[index], words, self.vocab_size)
        return scores

    def _fork(self, s: SeqStep) -> None:
        """Start ``s.seq_id`` as a copy of ``s.fork_of`` (see the module docstring)."""
        parent = self.seqs.get(s.fork_of) if s.fork_of is not None else None
        if s.seq_id in self.seqs:
            raise _Invalid(f"sequence {s.seq_id} already exists: fork_of is only valid on a sequence's first step")
        if parent is None or s.fork_of == s.seq_id:
            raise _Invalid(f"sequence {s.seq_id}: cannot fork unknown sequence {s.fork_of}")
        self.tables.fork(s.fork_of, s.seq_id)
        self.runner.fork(s.fork_of, s.seq_id)
        self.seqs[s.seq_id] = _Seq(sampler=parent.sampler.fork(parent.forks), tokens=list(parent.tokens),
                                   steering=parent.steering)
        parent.forks += 1

    def _truncate(self, seq_id: int, seq: _Seq, length: int) -> None:
        del seq.tokens[length:]
        self.tables.truncate(seq_id, length)
        self.runner.truncate(seq_id, length)

    def _stage_images(self, s: SeqStep, tokens: list[int], first: int) -> None:
        """Hand the runner the images whose blocks are in ``tokens[first:]``, about to be computed."""
        if not isinstance(self.runner, VisionFallback):
            raise _Invalid(f"sequence {s.seq_id}: the served model is text-only; it takes no images")
        try:
            self.runner.stage_images(s.seq_id, tokens, first, s.images)
        except ValueError as exc:
            raise _Invalid(f"sequence {s.seq_id}: {exc}") from exc

    def _capture(self, s: SeqStep, start: int, end: int) -> tuple[int, ...]:
        """The positions whose hidden states ``s.scores``, ``s.readouts``, ``s.residuals`` and ``s.pool`` need,
        validated: they must be fed in this step, i.e. in ``[start, end)``."""
        capture = tuple(sorted({q.position for q in s.scores} | set(s.readouts) | set(s.pool) | set(s.residuals)))
        if not capture:
            return capture
        if isinstance(self.runner, HFFallback) and not self.runner.can_capture:
            raise _Invalid(f"sequence {s.seq_id}: per-position logprobs, readouts, residuals and embeddings need a "
                           "decoder with layers and a final norm; this model's transformers class has none")
        if s.readouts and self.readouts is None:
            raise _Invalid(f"sequence {s.seq_id}: this worker has no readouts configured")
        if s.residuals and not s.residual_layers:
            raise _Invalid(f"sequence {s.seq_id}: residuals need residual_layers")
        if any(not 0 <= layer < self.num_layers for layer in s.residual_layers):
            raise _Invalid(f"sequence {s.seq_id}: residual layers must be in [0, {self.num_layers})")
        if len(set(s.pool)) != len(s.pool):
            raise _Invalid(f"sequence {s.seq_id}: pooled positions must differ")
        if len(set(s.residuals)) != len(s.residuals):
            raise _Invalid(f"sequence {s.seq_id}: residual positions must differ")
        if capture[0] < start or capture[-1] >= end:
            raise _Invalid(f"sequence {s.seq_id}: output positions must be among those fed, [{start}, {end})")
        if any(not 0 <= q.target < self.vocab_size for q in s.scores):
            raise _Invalid(f"sequence {s.seq_id}: score targets must be token ids in [0, {self.vocab_size})")
        if not 0 <= s.top_logprobs <= self.vocab_size:
            raise _Invalid(f"sequence {s.seq_id}: top_logprobs must be in [0, {self.vocab_size}]")
        return capture

    def _follow_feed(self, s: SeqStep) -> list[int]:
        """What a ``follow`` SeqStep feeds: the token its sequence sampled last (once)."""
        seq = self.seqs.get(s.seq_id)
        if s.tokens:
            raise _Invalid(f"sequence {s.seq_id}: a follow step carries no tokens")
        if seq is None or seq.last_sample is None:
            raise _Invalid(f"sequence {s.seq_id}: follow, but it has no sampled token to feed")
        return [seq.last_sample]

    def _admit_decode(self, s: SeqStep, tokens: list[int], seq: _Seq, masks: _Masks | None) -> SeqInput:
        """``_admit`` for the commonest SeqStep, one token fed to a live sequence and sampled after:
        no prefix lookup (a single token to sample after is always computed), no forks, backtracks
        or parameter changes to apply. Keeps big decode batches cheap on the host."""
        token = tokens[0]
        if not 0 <= token < self.vocab_size:
            raise _Invalid(f"sequence {s.seq_id}: token ids must be in [0, {self.vocab_size})")
        start = len(seq.tokens)
        if start >= self.max_model_len:
            raise _Invalid(f"sequence {s.seq_id} would reach {start + 1} tokens, over max_model_len {self.max_model_len}")
        _check_mask(s, masks)
        with self._pool_errors(s.seq_id, start + 1):
            self.tables.prepare_write(s.seq_id, start)
            self.tables.reserve(s.seq_id, start + 1)
        seq.tokens.append(token)
        seq.last_sample = None
        return self._input(seq, s.seq_id, tokens, start, True)

    @staticmethod
    def _input(seq: _Seq, seq_id: int, tokens: list[int], start: int, logits: bool, capture: tuple[int, ...] = (),
               layers: tuple[int, ...] = ()) -> SeqInput:
        """What the runner computes for ``seq``: ``tokens`` fed at ``start``, under its steering."""
        steering = None if seq.steering is None else seq.steering.deltas
        return SeqInput(seq_id=seq_id, tokens=tokens, start=start, logits=logits, capture=capture, layers=layers,
                        steering=steering, output_start=seq.sampler.params.output_start)

    def _steering(self, s: SeqStep) -> Steering | None:
        """The steering ``s`` sets, checked (call only when it sets one)."""
        assert s.steering is not None
        if s.steering and isinstance(self.runner, HFFallback) and not self.runner.can_steer:
            raise _Invalid(f"sequence {s.seq_id}: steering needs a decoder with layers; this model's transformers "
                           "class has none")
        try:
            return self.vectors.resolve(s.steering, s.vectors)
        except SteeringInvalid as exc:
            raise _Invalid(f"sequence {s.seq_id}: {exc}") from exc

    @contextmanager
    def _pool_errors(self, seq_id: int, end: int) -> Iterator[None]:
        """Turns the pool running out of blocks into this sequence's failure."""
        try:
            yield
        except PoolExhausted as exc:
            raise _Invalid(
                f"KV cache exhausted: sequence {seq_id} needs room for {end} tokens ({exc}; "
                f"capacity {self.tables.capacity_tokens} tokens)"
            ) from exc

    def _admit(self, s: SeqStep, tokens: list[int], masks: _Masks | None) -> tuple[SeqInput | None, int]:
        """Validate one SeqStep feeding ``tokens``, start or update its sequence, backtrack, reuse cached
        prefix blocks and reserve the rest. Returns what the forward pass must compute for it (None:
        nothing, every fed token came from the cache) and how many fed tokens the cache gave."""
        seq = self.seqs.get(s.seq_id)
        if seq is not None and _plain_decode(s, tokens):
            return self._admit_decode(s, tokens, seq, masks), 0
        if seq is None and s.sampling is None:
            raise _Invalid(f"sequence {s.seq_id} is unknown and its step carries no sampling parameters")
        if s.sampling is not None:
            problem = validate_params(s.sampling, self.vocab_size)
            if problem is not None:
                raise _Invalid(problem)
        length = len(seq.tokens) if seq is not None else 0
        if s.backtrack < 0:
            raise _Invalid(f"sequence {s.seq_id}: backtrack must be >= 0, got {s.backtrack}")
        if s.backtrack > length:
            raise _Invalid(f"sequence {s.seq_id}: cannot backtrack {s.backtrack} tokens, it holds only {length}")
        length -= s.backtrack
        if not tokens:
            if not (s.sample and (s.fork_of is not None or s.backtrack > 0)):
                raise _Invalid(f"sequence {s.seq_id}: no tokens to feed")
            if length == 0:
                raise _Invalid(f"sequence {s.seq_id}: nothing left to sample after (backtracked to empty)")
        elif min(tokens) < 0 or max(tokens) >= self.vocab_size:
            raise _Invalid(f"sequence {s.seq_id}: token ids must be in [0, {self.vocab_size})")
        end = length + len(tokens)
        if end > self.max_model_len:
            raise _Invalid(f"sequence {s.seq_id} would reach {end} tokens, over max_model_len {self.max_model_len}")
        if s.sample:
            _check_mask(s, masks)
        capture = self._capture(s, length if tokens else length - 1, end)
        steering = self._steering(s) if s.steering is not None else None

        if seq is None:
            assert s.sampling is not None
            seq = self.seqs[s.seq_id] = _Seq(sampler=SeqSampler(s.sampling))
            self.tables.set_domain(s.seq_id, s.cache_domain)
        elif s.sampling is not None:
            seq.sampler.update(s.sampling)
        if s.steering is not None:
            if steering is not seq.steering and seq.tokens:  # changed mid-way: its KV from here is not its chain's
                self.tables.seal(s.seq_id)
            seq.steering = steering
        if s.backtrack:
            self._truncate(s.seq_id, seq, length)
        feed = tokens
        if not feed:  # sample again after the last token: compute it again
            feed = seq.tokens[-1:]
            self._truncate(s.seq_id, seq, length - 1)
        start = len(seq.tokens)
        limit = start + len(feed) - (1 if s.sample else 0)
        if capture:  # asked-about positions are computed, never taken from the cache
            limit = min(limit, capture[0])
        with self._pool_errors(s.seq_id, end):
            first = self.tables.match_prefix(s.seq_id, seq.tokens, feed, limit)
            self.tables.prepare_write(s.seq_id, first)
            self.tables.reserve(s.seq_id, end)
        seq.tokens += feed
        seq.last_sample = None
        hits = first - start if tokens else 0
        if first == end:
            return None, hits
        if s.images:
            self._stage_images(s, seq.tokens, first)
        layers = tuple(s.residual_layers) if s.residuals else ()
        return self._input(seq, s.seq_id, feed[first - start :], first, s.sample, capture, layers), hits
