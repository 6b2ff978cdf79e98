"""The native runner every family shares: a batched forward over the paged KV cache.

One step flattens every token of every sequence into rows (:func:`services.worker.layers.plan.plan_step`):
the embedding, each decoder layer and the final norm run once per step over all rows, each projection one
matmul. A family (one file under :mod:`services.worker.models`) gives the runner its embedding, its decoder
layers (:class:`DecoderLayer`), its final norm and head; the runner plans the step, rotates, adds the
sequences' steering to the residual stream after the layers it names, captures the hidden states readouts,
scores and residuals ask for, and replays pure-decode steps from CUDA graphs when enabled (unsteered ones).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F

from services.worker.cuda_graphs import DecodeGraphs
from services.worker.kv_cache import PagedKVCache
from services.worker.layers.attention import Rotary
from services.worker.layers.kernels import Kernels
from services.worker.layers.norm import RMSNorm
from services.worker.layers.plan import StepPlan, plan_step
from services.worker.quantized import Linear
from services.worker.runner import Captured, SeqInput
from services.worker.transfer import to_device


class DecoderLayer(Protocol):
    def __call__(self, x: torch.Tensor, kv_slots: torch.Tensor, kv_blocks: torch.Tensor, step: StepPlan) -> torch.Tensor:
        """The hidden states after this layer, one row per fed token; writes the step's keys and values."""
        ...

    def decode_whole(self, x: torch.Tensor, kv_blocks: torch.Tensor, step: StepPlan) -> torch.Tensor | None:
        """A decode-only step's layer as one fused call, where the kernels and weights allow (None: not)."""
        ...


class PagedModel:
    """The native runner (see the module docstring). Implements :class:`services.worker.runner.Runner`."""

    def __init__(self, cache: PagedKVCache, *, embed: torch.Tensor, layers: list[DecoderLayer], final_norm: RMSNorm,
                 head: Linear, rotaries: Sequence[Rotary], heads: int, kv_heads: int, kernels: Kernels,
                 window: int | None = None, embed_scale: float | None = None,
                 logit_softcap: float | None = None) -> None:
        """``rotaries``: the rotary tables the layers rotate with (one per base); ``heads`` and
        ``kv_heads``: this rank's (every layer's); ``window``: the sliding window of the layers that have one
        (the step plan makes their masks); ``embed_scale``: multiplies the token embeddings; ``logit_softcap``:
        the logits become ``logit_softcap * tanh(logits / logit_softcap)``."""
        self.cache = cache
        self.device = cache.kv.device
        self.embed = embed
        self.layers = layers
        self.final_norm = final_norm
        self.head = head
        self.rotaries = tuple(rotaries)
        self.num_heads, self.num_kv_heads = heads, kv_heads
        self.kernels = kernels
        self.window = window
        self.embed_scale, self.logit_softcap = embed_scale, logit_softcap
        self.graphs: DecodeGraphs | None = None
        self.tap_layers: frozenset[int] = frozenset()  # decoder layers whose hidden states captures keep
        self.captured: Captured | None = None  # the last forward's captures (None: none asked)

    def release(self, seq_id: int) -> None:
        """Nothing to drop: all per-sequence state is in the engine's block tables."""

    def fork(self, parent: int, child: int) -> None:
        """Nothing to copy: the block tables share the parent's blocks."""

    def truncate(self, seq_id: int, length: int) -> None:
        """Nothing to cut: the block tables are truncated."""

    def enable_cuda_graphs(self, max_batch: int, max_blocks: int) -> None:
        """Replay pure-decode steps of up to ``max_batch`` sequences from CUDA graphs."""
        self.graphs = DecodeGraphs(
            lambda ids, positions, step: self._logits(self._layers(ids, positions, step)),
            self.cache,
            max_batch=max_batch,
            max_blocks=max_blocks,
            in_place=self.kernels.ops is not None,
            window=self.window,
        )

    def forward(self, inputs: list[SeqInput]) -> torch.Tensor:
        tables = self.cache.tables
        capture = [row for item in inputs for row in item.capture]
        self.captured = None
        # A steered step runs eagerly: the graphs' static buffers hold no steering table yet (a later GPU
        # task), so a decode step with any steered row skips the replay.
        if (self.graphs is not None and not capture and self.graphs.fits(inputs)
                and all(item.steering is None for item in inputs)):
            bs = tables.block_size
            fresh = [tables.seqs[item.seq_id][item.start // bs] for item in inputs if item.start % bs == 0]
            if fresh:
                self.cache.zero_blocks(fresh)
            return self.graphs.run(inputs)
        device = self.device
        rows = plan_step(inputs, self.cache, in_place=self.kernels.ops is not None, window=self.window)
        taps: dict[int, torch.Tensor] | None = None
        tapped = self.tap_layers.union(*(item.layers for item in inputs))
        if capture:
            captured = [rows.first_row[i] + p - item.start for i, item in enumerate(inputs) for p in item.capture]
            taps = {-1: to_device(captured, device)}
        x = self._layers(to_device(rows.ids, device), to_device(rows.positions, device), rows.plan, taps, tapped)
        if taps is not None:
            rows_t = taps.pop(-1)
            self.captured = Captured(final=x[rows_t], layers=taps)
        wanted = [rows.last_row[i] for i, item in enumerate(inputs) if item.logits]
        if not wanted:
            return torch.empty(0, self.head.out_features, dtype=torch.float32, device=device)
        if wanted != list(range(len(rows.ids))):  # a decode step wants every row, in order: no gather
            x = x[to_device(wanted, device)]
        return self._logits(x)

    def _layers(self, ids: torch.Tensor, positions: torch.Tensor, step: StepPlan,
                taps: dict[int, torch.Tensor] | None = None, tapped: frozenset[int] = frozenset()) -> torch.Tensor:
        """The hidden states after the last decoder layer, one row per fed token. ``taps``, when
        given, holds the captured rows under key -1 and receives them after each layer of ``tapped``.
        The step's steering is added to the residual stream after each layer it names, before any tap."""
        x = F.embedding(ids, self.embed)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        fused = self.kernels.ops is not None
        for rotary in self.rotaries:
            rotary.prepare(step, positions, self.num_heads, self.num_kv_heads, fused)
        # decode-only steps run a layer per call where the kernels and the weights allow
        whole = fused and self.kernels.whole_layers and step.decode is not None and not step.prefills
        steering = step.steering
        for index, (layer, kv_slots, kv_blocks) in enumerate(
            zip(self.layers, self.cache.layer_slots, self.cache.layer_blocks)
        ):
            if taps is not None and index - 1 in tapped:
                taps[index - 1] = x[taps[-1]]
            out = layer.decode_whole(x, kv_blocks, step) if whole else None
            x = out if out is not None else layer(x, kv_slots, kv_blocks, step)
            if steering and (add := steering.get(index)) is not None:
                add.apply(x)  # every tensor-parallel rank adds the same to its replicated residual stream
        if taps is not None and len(self.layers) - 1 in tapped:
            taps[len(self.layers) - 1] = x[taps[-1]]
        return x

    def final_norm_of(self, h: torch.Tensor) -> torch.Tensor:
        return self.final_norm(h)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """float32 logits of final hidden states."""
        logits = self.head(self.final_norm(h)).float()
        if self.logit_softcap is None:
            return logits
        return torch.tanh(logits / self.logit_softcap) * self.logit_softcap
