"""Our own forward pass for Llama-shaped models (Llama, Mistral, Qwen2) over the paged KV cache.

The projections are made by a :class:`services.worker.quantized.LinearFactory`: by default the
transformers modules' own weights, q/k/v and gate/up fused into one matrix each (the modules'
parameters re-pointed at views of them, so nothing is stored twice); or weight-only quantized.

One step flattens every token of every sequence into ``[tokens, hidden]``: each projection and the
MLP is one matmul per step. Attention runs for all decode rows at once, over a padded gather of
their cached keys and values, and per sequence for longer inputs (prefill). Decode rows are the
tokens of single-token inputs and of short ones (``DECODE_ROWS_MAX``: a controller's splice).
Per-step index tensors (slots, gathers, masks, rotary cos/sin) are built once and shared by all
layers.

``kernels="library"`` (float32 on the CPU, with Tiller's kernel library loaded: see
:mod:`services.worker.fused_ops`) runs the rest of each layer on the library's ops too: the norms,
the rotation with the KV write, and the decode rows' attention read from the paged blocks in place
(no gather, no mask), a few calls per layer where torch takes some twenty-five; and a decode-only
step over GGUF block weights runs each whole layer as one call. ``kernels="triton"`` runs the same
ops (not the whole layer) as Triton kernels on a GPU (:mod:`services.worker.triton_ops`). Both round
differently from torch's ops (float32 sums in another order), so the exact path stays torch's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from services.worker import fused_ops
from services.worker.cuda_graphs import DecodeGraphs
from services.worker.gguf_linear import BlockLinear
from services.worker.kv_cache import NULL_BLOCK, PagedKVCache
from services.worker.quantized import DenseLinears, Linear, LinearFactory
from services.worker.runner import Captured, SeqInput
from services.worker.step_plan import Prefill, StepPlan
from services.worker.transfer import to_device

NATIVE_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})
# Inputs of at most this many tokens (a decode token, a controller's splice, a short turn) run as decode
# rows, one per token, each attending to the keys up to its own: every row's keys and values are written
# before any row attends, so row j of an input sees the rows before it. That keeps a step that carries a
# splice on the decode path (a whole layer per call on GGUF weights). Each row reads its context again, so
# longer inputs go as prefills: about 16 tokens is where the two ways cost the same on the CPU kernel
# (deploy/loadtest/splice_bench.py).
DECODE_ROWS_MAX = 16


def _ops(kernels: str, kv: torch.Tensor, head_dim: int, hidden_act: str) -> fused_ops.FusedOps | None:
    """The layer ops ``kernels`` names, where they apply to this pool and model (None: torch's)."""
    if kernels == "library":
        return fused_ops.load(kv, head_dim, hidden_act)
    if kernels == "triton":
        from services.worker import triton_ops  # Triton comes with torch's CUDA builds, not its CPU ones

        return triton_ops.load(kv, head_dim, hidden_act)
    return None


def unsupported_reason(config: PretrainedConfig, max_model_len: int) -> str | None:
    """Why the native forward cannot run this model (None: it can)."""
    if config.model_type not in NATIVE_MODEL_TYPES:
        return f"model type {config.model_type!r} has no native forward"
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or []
    windowed = "sliding_attention" in layer_types if layer_types else True
    if window is not None and windowed and window < max_model_len:
        return f"sliding-window attention ({window} < max_model_len {max_model_len})"
    return None


@dataclass
class _Layer:
    """One decoder layer's weights."""

    input_norm: torch.Tensor
    qkv: Linear
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear

    def block_weights(self, eps: float, intermediate: int) -> tuple | None:
        """The fused ``decode_layer`` op's weight arguments, where all four projections are GGUF
        block layers (None: they are not)."""
        qkv, o, gate_up, down = self.qkv, self.o, self.gate_up, self.down
        if not (isinstance(qkv, BlockLinear) and isinstance(o, BlockLinear) and isinstance(gate_up, BlockLinear)
                and isinstance(down, BlockLinear)):
            return None
        return (self.input_norm, self.post_norm, eps, qkv.records, qkv.code, qkv.bias, o.records, o.code, o.bias,
                gate_up.records, gate_up.code, intermediate, gate_up.bias, down.records, down.code, down.bias)


class PagedLlama:
    """The native runner (see module docstring). Implements :class:`services.worker.runner.Runner`."""

    def __init__(
        self,
        model: PreTrainedModel,
        cache: PagedKVCache,
        max_positions: int,
        linears: LinearFactory | None = None,
        kernels: Literal["torch", "library", "triton"] = "torch",
    ) -> None:
        """``linears`` makes the projections (default: the model's dense weights); ``kernels``: run
        the rest of each layer on torch's ops, the kernel library's or Triton's where they apply (see
        the module docstring)."""
        linears = linears or DenseLinears()
        config = model.config
        self.cache = cache
        self.device = cache.kv.device
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.hidden = config.hidden_size
        self.eps = config.rms_norm_eps
        base = model.model
        act = cache.kv.dtype  # the activations' (a bfloat16 checkpoint's tiles serve float32 ones)
        self.embed = base.embed_tokens.weight.detach().to(act)
        self.final_norm = base.norm.weight.detach().to(act)
        self.head = linears.head(model.get_output_embeddings())
        self.act: Callable[[torch.Tensor], torch.Tensor] = (
            F.silu if config.hidden_act == "silu" else base.layers[0].mlp.act_fn
        )
        self.intermediate = base.layers[0].mlp.gate_proj.out_features
        self.ops = _ops(kernels, cache.kv, self.head_dim, config.hidden_act)
        self.scale = self.head_dim**-0.5
        self.whole_layers = True  # with ops: decode-only steps run a layer per call where the weights allow
        self.cos_table, self.sin_table = self._rotary_tables(base.rotary_emb, max_positions)
        self.graphs: DecodeGraphs | None = None
        self.tap_layers: frozenset[int] = frozenset()  # decoder layers whose hidden states captures keep
        self.captured: Captured | None = None  # the last forward's captures (None: none asked)
        self.layers: list[_Layer] = []
        for layer in base.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(
                _Layer(
                    input_norm=layer.input_layernorm.weight.detach().to(act),
                    qkv=linears.layer([attn.q_proj, attn.k_proj, attn.v_proj]),
                    o=linears.layer([attn.o_proj]),
                    post_norm=layer.post_attention_layernorm.weight.detach().to(act),
                    gate_up=linears.layer([mlp.gate_proj, mlp.up_proj]),
                    down=linears.layer([mlp.down_proj]),
                )
            )

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
            in_place=self.ops is not None,
        )

    def forward(self, inputs: list[SeqInput]) -> torch.Tensor:
        tables = self.cache.tables
        capture = [row for i, item in enumerate(inputs) for row in item.capture]
        self.captured = None
        if self.graphs is not None and not capture and self.graphs.fits(inputs):
            bs = tables.block_size
            fresh = [tables.seqs[item.seq_id][item.start // bs] for item in inputs if item.start % bs == 0]
            if fresh:
                self.cache.zero_blocks(fresh)
            return self.graphs.run(inputs)
        device = self.device
        # Short inputs first, their tokens as decode rows of one batch; longer ones after, one by one.
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i].tokens) > DECODE_ROWS_MAX)
        decode = [(item.seq_id, item.start + j + 1) for item in (inputs[i] for i in order)
                  if len(item.tokens) <= DECODE_ROWS_MAX for j in range(len(item.tokens))]
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_row = [0] * len(inputs)
        first_row = [0] * len(inputs)
        prefills: list[Prefill] = []
        fresh: list[int] = []
        bs = tables.block_size
        for i in order:
            item = inputs[i]
            n, row = len(item.tokens), len(ids)
            fresh += tables.seqs[item.seq_id][-(-item.start // bs) : -(-(item.start + n) // bs)]
            ids += item.tokens
            positions += range(item.start, item.start + n)
            slots += tables.slots(item.seq_id, item.start, item.start + n)
            last_row[i] = row + n - 1
            first_row[i] = row
            if n > DECODE_ROWS_MAX:
                prefills.append(self._plan_prefill(item, row))
        if fresh:
            self.cache.zero_blocks(fresh)
        step = StepPlan(
            slots=to_device(slots, device),
            decode=self._plan_decode(decode) if decode else None,
            num_decode=len(decode),
            prefills=prefills,
        )
        taps: dict[int, torch.Tensor] | None = None
        if capture:
            rows = [first_row[i] + p - item.start for i, item in enumerate(inputs) for p in item.capture]
            taps = {-1: to_device(rows, device)}
        x = self._layers(to_device(ids, device), to_device(positions, device), step, taps)
        if taps is not None:
            rows_t = taps.pop(-1)
            self.captured = Captured(final=x[rows_t], layers=taps)
        wanted = [last_row[i] for i, item in enumerate(inputs) if item.logits]
        if not wanted:
            return torch.empty(0, self.head.out_features, dtype=torch.float32, device=device)
        if wanted != list(range(len(ids))):  # a decode step wants every row, in order: no gather
            x = x[to_device(wanted, device)]
        return self._logits(x)

    def _layers(
        self, ids: torch.Tensor, positions: torch.Tensor, step: StepPlan, taps: dict[int, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """The hidden states after the last decoder layer, one row per fed token. ``taps``, when
        given, holds the captured rows under key -1 and receives them after each tapped layer."""
        x = F.embedding(ids, self.embed)
        if self.ops is not None:
            step.positions = positions
        else:
            step.cos, step.sin = self._rotary(positions)
        # decode-only steps run a layer per call where the ops and the weights allow
        decode_layer = self.ops.decode_layer if self.ops is not None and self.whole_layers else None
        if step.decode is None or step.prefills:
            decode_layer = None
        for index, (layer, kv_slots, kv_blocks) in enumerate(
            zip(self.layers, self.cache.layer_slots, self.cache.layer_blocks)
        ):
            if taps is not None and index - 1 in self.tap_layers:
                taps[index - 1] = x[taps[-1]]
            weights = layer.block_weights(self.eps, self.intermediate) if decode_layer is not None else None
            if weights is not None and decode_layer is not None and step.decode is not None:
                tables, lengths = step.decode
                x = decode_layer(x, *weights, self.cos_table, self.sin_table, step.positions, self.num_heads,
                                 kv_blocks, step.slots, tables, lengths, self.scale)
                continue
            x = self._attention(layer, x, kv_slots, kv_blocks, step)
            h = self._norm(x, layer.post_norm)
            if self.ops is not None:
                h = self.ops.silu_mul(layer.gate_up(h))
            else:
                gate, up = layer.gate_up(h).view(-1, 2, self.intermediate).unbind(1)
                h = self.act(gate).mul_(up)
            x = layer.down.add_to(x, h)
        if taps is not None and len(self.layers) - 1 in self.tap_layers:
            taps[len(self.layers) - 1] = x[taps[-1]]
        return x

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            return self.ops.rms_norm(x, weight, self.eps)
        return torch.rms_norm(x, (self.hidden,), weight, self.eps)

    def final_norm_of(self, h: torch.Tensor) -> torch.Tensor:
        return self._norm(h, self.final_norm)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """float32 logits of final hidden states."""
        return self.head(self._norm(h, self.final_norm)).float()

    def _rotary_tables(self, rotary: nn.Module, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[max_positions, head_dim]`` from the model's rotary module, computed once,
        with sin laid out so that ``rotate_half(x) * sin`` becomes ``roll(x, half) * [-sin_1, sin_2]``."""
        dtype = self.embed.dtype
        probe = torch.zeros(1, dtype=dtype, device=self.device)
        positions = torch.arange(max_positions, device=self.device).unsqueeze(0)
        cos, sin = rotary(probe, positions)
        half = self.head_dim // 2
        sin = torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)
        return cos[0].contiguous(), sin.contiguous()

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[tokens, heads + 2 * kv_heads, head_dim]`` for rotating a whole q|k|v
        projection at once; the value heads get cos 1, sin 0 (left as they are)."""
        cos = self.cos_table.index_select(0, positions).unsqueeze(1)
        sin = self.sin_table.index_select(0, positions).unsqueeze(1)
        tokens, rotated, kept = positions.shape[0], self.num_heads + self.num_kv_heads, self.num_kv_heads
        shape = (tokens, kept, self.head_dim)
        cos = torch.cat((cos.expand(tokens, rotated, -1), cos.new_ones(shape)), dim=1)
        sin = torch.cat((sin.expand(tokens, rotated, -1), sin.new_zeros(shape)), dim=1)
        return cos, sin

    def _plan_decode(self, decode: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """For decode rows ``(seq_id, keys it attends to)``: their block tables, padded to the longest
        with the (zeroed) null block, flattened for one gather; and the key mask ``[n, 1, 1, blocks *
        block_size]``. Always a mask, even where all rows have one length: attention over exactly that
        many keys and no mask differs from this in the last bit, enough to flip a near-tie.
        Fused: the tables ``[n, blocks]`` and each row's keys ``[n]``, read in place."""
        tables = self.cache.tables
        bs = tables.block_size
        width = -(-max(length for _, length in decode) // bs)
        rows = [tables.seqs[seq_id][:width] for seq_id, _ in decode]
        blocks = to_device([r + [NULL_BLOCK] * (width - len(r)) for r in rows], self.device)
        lengths = to_device([length for _, length in decode], self.device)
        if self.ops is not None:
            return blocks, lengths
        valid = torch.arange(width * bs, device=self.device) < lengths.unsqueeze(-1)
        return blocks.view(-1), valid.view(len(decode), 1, 1, width * bs)

    def _plan_prefill(self, item: SeqInput, row: int) -> Prefill:
        n = len(item.tokens)
        if item.start == 0:
            return Prefill(row=row, n=n, blocks=None, mask=None)
        total = item.start + n
        bs = self.cache.tables.block_size
        blocks = self.cache.tables.seqs[item.seq_id][: -(-total // bs)]
        query_pos = torch.arange(item.start, total, device=self.device).unsqueeze(-1)
        mask = torch.arange(len(blocks) * bs, device=self.device) <= query_pos
        return Prefill(row=row, n=n, blocks=to_device(blocks, self.device), mask=mask)

    def _attention(
        self, layer: _Layer, x: torch.Tensor, kv_slots: torch.Tensor, kv_blocks: torch.Tensor, step: StepPlan
    ) -> torch.Tensor:
        """``x`` plus the self-attention of one layer over all its rows; writes this step's keys and
        values into the layer's pool (``kv_slots`` and ``kv_blocks`` are two views of it)."""
        tokens = x.shape[0]
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        h = self._norm(x, layer.input_norm)
        qkv = layer.qkv(h).view(tokens, heads + 2 * kv_heads, dim)
        if self.ops is not None:
            self.ops.rope_store(qkv, self.cos_table, self.sin_table, step.positions, heads + kv_heads, kv_slots,
                                 step.slots)
        else:
            qkv = torch.addcmul(qkv * step.cos, qkv.roll(dim // 2, -1), step.sin)
            kv_slots.index_copy_(0, step.slots, qkv[:, heads:])

        outs: list[torch.Tensor] = []
        if step.decode is not None and self.ops is not None:
            tables, lengths = step.decode
            q = qkv[: step.num_decode, :heads]
            outs.append(self.ops.decode_attention(q, kv_blocks, tables, lengths, self.scale))
        elif step.decode is not None:
            blocks, mask = step.decode
            n = step.num_decode
            # Grouped-query attention without repeating keys: [n, kv_heads, heads/kv_heads, dim].
            q = qkv[:n, :heads].reshape(n, kv_heads, heads // kv_heads, dim)
            kv = kv_blocks.index_select(0, blocks).view(n, mask.shape[-1], 2 * kv_heads, dim)
            k, v = kv[:, :, :kv_heads].transpose(1, 2), kv[:, :, kv_heads:].transpose(1, 2)
            outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).reshape(n, heads * dim))
        for p in step.prefills:
            q = qkv[p.row : p.row + p.n, :heads].transpose(0, 1).unsqueeze(0)
            if p.blocks is None:
                kv = qkv[p.row : p.row + p.n, heads:]
            else:
                kv = kv_blocks.index_select(0, p.blocks).view(-1, 2 * kv_heads, dim)
            k, v = kv[:, :kv_heads].transpose(0, 1).unsqueeze(0), kv[:, kv_heads:].transpose(0, 1).unsqueeze(0)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=p.mask, is_causal=p.mask is None, enable_gqa=True)
            outs.append(out[0].transpose(0, 1).reshape(p.n, heads * dim))
        attn = outs[0] if len(outs) == 1 else torch.cat(outs)
        return layer.o.add_to(x, attn)

