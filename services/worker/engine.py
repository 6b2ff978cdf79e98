"""The engine: live sequences, their KV blocks and sampling state, and one batched step at a time.

A sequence starts the first time its id appears in a step (that SeqStep carries its sampling
parameters) and lives until it appears in ``Step.free``. A sequence that fails (bad input, KV pool
exhausted, a mask that allows nothing) is released on the spot and reported in
``StepResult.failures``; the other sequences of the step go on. The same id used again later
starts a new sequence.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import structlog
import torch
from transformers import PretrainedConfig

from common.config import Settings
from common.wire import SeqFailure, SeqStep, Step, StepResult
from services.worker.hf_fallback import HFFallback
from services.worker.kv_cache import BlockTables, PagedKVCache, PoolExhausted, bytes_per_token, plan_num_blocks
from services.worker.model_loader import LoadedModel
from services.worker.paged_llama import PagedLlama, unsupported_reason
from services.worker.runner import Runner, SeqInput
from services.worker.sampler import SeqSampler, sample, unpack_mask, validate_params

log = structlog.get_logger()


@dataclass
class _Seq:
    sampler: SeqSampler
    tokens: list[int] = field(default_factory=list)  # every token fed so far; len() is the cached length


def _kv_shape(config: PretrainedConfig) -> tuple[int, int, int]:
    """(layers, key/value heads, head dim) of a decoder config."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return config.num_hidden_layers, kv_heads, head_dim


class _Invalid(Exception):
    """A sequence's part of a step cannot run; the message goes to the scheduler."""


class Engine:
    """Runs :class:`common.wire.Step` messages against a loaded model."""

    def __init__(self, loaded: LoadedModel, *, num_blocks: int, native: bool = True) -> None:
        """``num_blocks``: KV pool size including the reserved null block. ``native=False`` forces
        the transformers fallback even for a supported architecture."""
        self.loaded = loaded
        self.device = loaded.device
        self.vocab_size = loaded.vocab_size
        self.max_model_len = loaded.max_model_len
        config = loaded.config
        reason = unsupported_reason(config, loaded.max_model_len) if native else "native forward disabled"
        self.runner: Runner
        if reason is None:
            layers, kv_heads, head_dim = _kv_shape(config)
            cache = PagedKVCache(
                num_layers=layers,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                num_blocks=num_blocks,
                dtype=loaded.dtype,
                device=loaded.device,
            )
            self.tables = cache.tables
            self.runner = PagedLlama(loaded.model, cache)
            self.backend = "paged"
        else:
            log.info("worker.fallback_forward", reason=reason)
            self.tables = BlockTables(num_blocks)
            self.runner = HFFallback(loaded.model)
            self.backend = "transformers"
        self.seqs: dict[int, _Seq] = {}

    @classmethod
    def create(cls, loaded: LoadedModel, settings: Settings) -> Engine:
        """An engine whose KV pool holds ``max_batch_size`` full-length sequences, or what memory allows."""
        token_bytes = bytes_per_token(*_kv_shape(loaded.config), loaded.dtype)
        num_blocks = plan_num_blocks(
            max_batch_size=settings.limits.max_batch_size,
            max_model_len=loaded.max_model_len,
            token_bytes=token_bytes,
            device=loaded.device,
        )
        return cls(loaded, num_blocks=num_blocks)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.tables.capacity_tokens

    def stats(self) -> dict[str, int | str]:
        return {
            "backend": self.backend,
            "active_seqs": len(self.seqs),
            "kv_capacity_tokens": self.tables.capacity_tokens,
            "kv_free_tokens": self.tables.free_tokens,
        }

    def free(self, seq_ids: Iterable[int]) -> None:
        """Release sequences (unknown ids are ignored)."""
        for seq_id in seq_ids:
            if self.seqs.pop(seq_id, None) is not None:
                self.tables.release(seq_id)
                self.runner.release(seq_id)

    @torch.inference_mode()
    def step(self, step: Step, mask_frame: bytes | memoryview | None = None) -> StepResult:
        """Free ``step.free``, feed every SeqStep, sample where asked. Per-sequence problems become
        ``failures``; an exception means a bug, and the caller fails the whole step."""
        started = time.perf_counter()
        self.free(step.free)
        failures: list[SeqFailure] = []
        masks = self._mask_rows(step, mask_frame)
        counts: dict[int, int] = {}
        for s in step.seqs:
            counts[s.seq_id] = counts.get(s.seq_id, 0) + 1
        inputs: list[SeqInput] = []
        accepted: list[SeqStep] = []
        for s in step.seqs:
            try:
                if counts[s.seq_id] > 1:
                    raise _Invalid(f"sequence {s.seq_id} appears {counts[s.seq_id]} times in step {step.step_id}")
                inputs.append(self._admit(s, masks))
                accepted.append(s)
            except _Invalid as exc:
                failures.append(SeqFailure(seq_id=s.seq_id, message=str(exc)))
                self.free([s.seq_id])

        samples = {}
        if inputs:
            logits = self.runner.forward(inputs)
            for s in accepted:
                self.seqs[s.seq_id].tokens += s.tokens
            sampling = [s for s in accepted if s.sample]
            if sampling:
                allowed = None
                if any(s.mask_row >= 0 for s in sampling):
                    allowed = torch.ones(len(sampling), self.vocab_size, dtype=torch.bool, device=self.device)
                    for i, s in enumerate(sampling):
                        if s.mask_row >= 0:
                            allowed[i] = masks[s.mask_row]
                seqs = [self.seqs[s.seq_id] for s in sampling]
                tokens = sample(logits, [q.sampler for q in seqs], [q.tokens for q in seqs], allowed)
                samples = {s.seq_id: t for s, t in zip(sampling, tokens)}
        forward_ms = (time.perf_counter() - started) * 1000
        return StepResult(mid=step.mid, step_id=step.step_id, samples=samples, failures=failures, forward_ms=forward_ms)

    def _mask_rows(self, step: Step, frame: bytes | memoryview | None) -> dict[int, torch.Tensor]:
        """The mask rows this step refers to, unpacked to bool ``[vocab]``; a frame too short for a
        row leaves that row out (its sequence then fails in ``_admit``)."""
        wanted = sorted({s.mask_row for s in step.seqs if s.mask_row >= 0})
        if not wanted or frame is None:
            return {}
        row_bytes = -(-self.vocab_size // 32) * 4
        available = len(frame) // row_bytes
        rows = [r for r in wanted if r < available]
        if not rows:
            return {}
        # frombuffer needs a writable buffer; copying only the rows in use keeps that small.
        packed = b"".join(bytes(memoryview(frame)[r * row_bytes : (r + 1) * row_bytes]) for r in rows)
        words = torch.frombuffer(bytearray(packed), dtype=torch.int32).view(len(rows), -1).to(self.device)
        unpacked = unpack_mask(words, self.vocab_size)
        return dict(zip(rows, unpacked))

    def _admit(self, s: SeqStep, masks: dict[int, torch.Tensor]) -> SeqInput:
        """Validate one SeqStep, start or update its sequence and reserve its KV blocks."""
        seq = self.seqs.get(s.seq_id)
        if seq is None and s.sampling is None:
            raise _Invalid(f"sequence {s.seq_id} is unknown and its step carries no sampling parameters")
        if s.sampling is not None:
            problem = validate_params(s.sampling, self.vocab_size)
            if problem is not None:
                raise _Invalid(problem)
        if not s.tokens:
            raise _Invalid(f"sequence {s.seq_id}: no tokens to feed")
        if min(s.tokens) < 0 or max(s.tokens) >= self.vocab_size:
            raise _Invalid(f"sequence {s.seq_id}: token ids must be in [0, {self.vocab_size})")
        start = len(seq.tokens) if seq is not None else 0
        end = start + len(s.tokens)
        if end > self.max_model_len:
            raise _Invalid(f"sequence {s.seq_id} would reach {end} tokens, over max_model_len {self.max_model_len}")
        if s.sample and s.mask_row >= 0:
            mask = masks.get(s.mask_row)
            if mask is None:
                raise _Invalid(f"sequence {s.seq_id}: mask row {s.mask_row} is missing from the step's mask frame")
            if not bool(mask.any()):
                raise _Invalid(f"sequence {s.seq_id}: its mask allows no token")
        try:
            self.tables.reserve(s.seq_id, end)
        except PoolExhausted as exc:
            raise _Invalid(
                f"KV cache exhausted: sequence {s.seq_id} needs room for {end} tokens ({exc}; "
                f"capacity {self.tables.capacity_tokens} tokens)"
            ) from exc
        if seq is None:
            assert s.sampling is not None
            self.seqs[s.seq_id] = _Seq(sampler=SeqSampler(s.sampling, self.device))
        elif s.sampling is not None:
            seq.sampler.update(s.sampling)
        return SeqInput(seq_id=s.seq_id, tokens=s.tokens, start=start, logits=s.sample)
