"""Linear layers of the native forward: dense, or weight-only quantized on torch's packed CPU kernels.

Every projection of a native model (:mod:`services.worker.models`) is a :class:`Linear` made by
a :class:`LinearFactory` from the transformers modules it replaces (several, side by side, for the
fused q|k|v and gate|up projections):

* :class:`TiledLinears`: the modules' own weights in their own dtype (float32, bfloat16, float16),
  laid out in the tiles of Tiller's kernel (``TILLER_WEIGHTS=fp32`` on a CPU where the kernel
  builds): each weight read once a step, and the decoder layer fused as for GGUF blocks.
* :class:`DenseLinears`: the modules' own weights, fused and transposed (``TILLER_WEIGHTS=fp32``
  elsewhere: a GPU, tensor parallel, a CPU without the kernel).
* :class:`GgufLinears`: the GGUF's blocks as they ship. ``TILLER_WEIGHTS=gguf`` serves them on
  Tiller's own kernel (:class:`services.worker.gguf_linear.BlockLinear`: float32 activations, the
  codes read once, float16 scales as shipped) when it builds on this machine, else as below.
  ``gguf-bf16`` (and ``gguf`` without that kernel) uses ``_weight_int4pack_mm_for_cpu``'s packed
  4-bit layout with one scale and zero per 32 weights (scales rounded to bfloat16 for
  ``gguf-bf16``). That kernel computes
  ``w = (q - 8) * scale + zero``, which holds every supported block exactly: Q4_0 is
  ``zero = 0``; Q4_1 (``d * q + m``) is ``scale = d, zero = m + 8d``; Q8_0 (``d * q``, 8-bit)
  is two 4-bit halves of the code ``q + 128 = 16 hi + lo`` side by side along the input, with
  scales ``16d`` and ``d`` and zero ``8d`` on the low half, the input fed twice.
* :class:`Int8Linears`: any model's weights rounded to int8 with one scale per output row
  (``_weight_int8pack_mm``), an approximation for models that ship unquantized.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from services.worker.gguf_blocks import ARCHS, GROUP, Blocks, read_blocks
from services.worker.gguf_linear import BlockLinear, dense_packable
from services.worker.packed_cache import PackedStore


class Linear(Protocol):
    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W^T + b`` for ``x`` ``[rows, in]``."""
        ...

    def add_to(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """``x + h @ W^T + b`` (the residual add folded in where the kernel allows)."""
        ...


class LinearFactory(Protocol):
    def layer(self, modules: list[nn.Linear]) -> Linear:
        """One linear layer computing ``modules``' outputs side by side."""
        ...

    def head(self, module: nn.Linear) -> Linear:
        """The output projection (often tied to the token embedding, which must stay as it is)."""
        ...


def _release(modules: list[nn.Linear], keep: torch.Tensor) -> None:
    """Swap each module's dense weight for a storage-less (meta) tensor of its shape, once packed:
    the packed layer holds all the forward needs. ``keep`` (the token embedding, which may be tied
    to the output projection) stays."""
    for m in modules:
        if m.weight is not keep:
            m.weight = nn.Parameter(torch.empty_like(m.weight, device="meta"), requires_grad=False)


def _bias(modules: list[nn.Linear]) -> torch.Tensor | None:
    has_bias = [m.bias is not None for m in modules]
    if any(has_bias) and not all(has_bias):
        raise ValueError("cannot fuse projections where only some have a bias")
    return torch.cat([m.bias.detach() for m in modules]) if all(has_bias) else None  # type: ignore[union-attr]


class Dense:
    """``x @ weight_t (+ bias)`` on a ``[in, out]`` matrix."""

    def __init__(self, weight_t: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight_t = weight_t
        self.bias = bias
        self.out_features = weight_t.shape[1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.mm(x, self.weight_t) if self.bias is None else torch.addmm(self.bias, x, self.weight_t)

    def add_to(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        out = torch.addmm(x, h, self.weight_t)
        return out if self.bias is None else out.add_(self.bias)


class _Quantized:
    """A weight-only quantized layer: the kernel's output plus bias; residual added after."""

    out_features: int
    bias: torch.Tensor | None

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self._mm(x)
        return out if self.bias is None else out.add_(self.bias)

    def add_to(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return self(h).add_(x)


def bf16_parts(values: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """``values`` (float32) as ``parts`` bfloat16 tensors whose float32 sum gives them back: each
    part rounds what the earlier ones left (two hold any float16 exactly)."""
    out = []
    rest = values.float()
    for _ in range(parts):
        part = rest.bfloat16()
        out.append(part)
        rest = rest - part.float()
    return out


class Int4Packed(_Quantized):
    """``_weight_int4pack_mm_for_cpu`` over 4-bit codes with a scale and zero per 32 weights.

    The kernel is fast only on bfloat16 activations, and then takes bfloat16 scales and zeros; a
    float32 scale is therefore held as ``parts`` bfloat16 parts, each a copy of the codes side by
    side along the input (the input fed that many times): 2 parts hold float16 scales exactly.
    Activations are rounded to bfloat16 on the way in, and the output is bfloat16, widened back.
    """

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor, repeat: int,
                 bias: torch.Tensor | None) -> None:
        """``packed``: the kernel's layout of the codes (see :meth:`pack`); ``scales_zeros``
        ``[groups, out, 2]`` bfloat16; ``repeat``: copies of the input the codes hold side by side."""
        self.packed = packed
        self.scales_zeros = scales_zeros
        self.repeat = repeat
        self.bias = bias
        self.out_features = scales_zeros.shape[1]

    @classmethod
    def pack(cls, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: torch.Tensor | None,
             in_features: int, parts: int = 2) -> Int4Packed:
        """``codes`` ``[out, n * in_features]`` 0..15 (``n`` copies of the input side by side);
        ``scale`` and ``zero`` float32, one per 32 codes."""
        codes = codes.to(torch.int32).repeat(1, parts).contiguous()
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        scales, zeros = torch.cat(bf16_parts(scale, parts), dim=1), torch.cat(bf16_parts(zero, parts), dim=1)
        scales_zeros = torch.stack([scales.t(), zeros.t()], dim=-1).contiguous()  # [groups, out, 2]
        return cls(packed, scales_zeros, codes.shape[1] // in_features, bias)

    def tensors(self) -> dict[str, torch.Tensor]:
        """What :meth:`from_tensors` makes this layer again from (the bias is the model's own)."""
        return {"packed": self.packed, "scales_zeros": self.scales_zeros,
                "repeat": torch.tensor(self.repeat, dtype=torch.int32)}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], bias: torch.Tensor | None) -> Int4Packed:
        return cls(tensors["packed"], tensors["scales_zeros"], int(tensors["repeat"]), bias)

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        x = x.bfloat16()
        if self.repeat > 1:
            x = x.repeat(1, self.repeat)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_zeros).float()

    @classmethod
    def of(cls, blocks: Blocks, bias: torch.Tensor | None, parts: int = 2) -> Int4Packed:
        """The packed form of GGUF blocks (see the module docstring); exact with 2 parts."""
        d, in_features = blocks.scale, blocks.shape[1]
        if blocks.kind == "Q4_0":
            return cls.pack(blocks.q, d, torch.zeros_like(d), bias, in_features, parts)
        if blocks.kind in ("Q4_1", "Q4_K"):  # (Q4_K's float32 scales in two bfloat16 parts: 16 of their 19 bits)
            assert blocks.minimum is not None
            return cls.pack(blocks.q, d, blocks.minimum + 8 * d, bias, in_features, parts)
        if blocks.kind == "Q8_0":
            u = blocks.q.to(torch.int32) + 128
            codes = torch.cat([u >> 4, u & 15], dim=1)
            zero = torch.cat([torch.zeros_like(d), 8 * d], dim=1)
            return cls.pack(codes, torch.cat([16 * d, d], dim=1), zero, bias, in_features, parts)
        raise ValueError(f"no packed kernel for {blocks.kind} blocks")


class Int8Packed(_Quantized):
    """``_weight_int8pack_mm``: int8 weights ``[out, in]`` with one float scale per output row."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        weight = weight.float()
        scales = (weight.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.bfloat16).tiny).bfloat16()
        self.codes = torch.round(weight / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
        self.scales = scales
        self.bias = bias
        self.out_features = weight.shape[0]

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x.bfloat16(), self.codes, self.scales).float()


class DenseLinears:
    """The modules' own weights: fused, transposed and contiguous; each module's parameters are
    re-pointed at their slice, so nothing is stored twice and the transformers model keeps working.

    ``x @ W^T`` with a contiguous ``W^T`` measured up to 2x faster than ``F.linear(x, W)`` for the
    few-row matmuls of decode steps on the CPU (MKL).
    """

    def layer(self, modules: list[nn.Linear]) -> Linear:
        weight = torch.cat([m.weight.detach().t() for m in modules], dim=1).contiguous()
        bias = _bias(modules)
        column = 0
        for m in modules:
            n = m.weight.shape[0]
            m.weight = nn.Parameter(weight[:, column : column + n].t(), requires_grad=False)
            if bias is not None:
                m.bias = nn.Parameter(bias[column : column + n], requires_grad=False)
            column += n
        return Dense(weight, bias)

    def head(self, module: nn.Linear) -> Linear:
        bias = None if module.bias is None else module.bias.detach()
        return Dense(module.weight.detach().t(), bias)


class TiledLinears:
    """The modules' own weights, fused as :class:`DenseLinears` fuses them, on Tiller's kernel as
    dense tiles (:meth:`BlockLinear.of_dense`), in the dtype they load in: exact values, float32
    activations and accumulation. MKL's few-row products on an AMD EPYC ran 1.9-5x slower than the
    tiles (``deploy/loadtest/quant_kernels_bench.py --rows 1 4 16 --kernels fp32 "fp32 tiles"``), and a
    decode step's layers become one kernel call each, a parallel region each instead of some twenty-five.

    A matrix the kernel cannot take (inputs not a multiple of 32) stays a :class:`Dense` layer."""

    def __init__(self, release_from: nn.Module | None = None) -> None:
        """``release_from``: the model whose packed modules' dense weights are dropped once packed
        (the transformers model cannot run afterwards); None keeps them (twice the memory)."""
        self.keep = None if release_from is None else release_from.get_input_embeddings().weight  # type: ignore[operator]

    def layer(self, modules: list[nn.Linear]) -> Linear:
        weight = torch.cat([m.weight.detach() for m in modules])
        if not dense_packable(weight):
            return DenseLinears().layer(modules)
        bias = _bias(modules)
        packed = BlockLinear.of_dense(weight, None if bias is None else bias.float())
        if self.keep is not None:
            _release(modules, self.keep)
        return packed

    def head(self, module: nn.Linear) -> Linear:
        """The output projection, packed beside the module's weight, which stays: the token
        embedding may be tied to it, and readouts project onto it."""
        weight = module.weight.detach()
        if not dense_packable(weight):
            return DenseLinears().head(module)
        return BlockLinear.of_dense(weight, None if module.bias is None else module.bias.detach().float())


class GgufLinears:
    """Packed layers from a GGUF's blocks, keyed by the transformers module they replace; a module
    the GGUF holds no blocks for (a float tensor there) stays dense.

    With a :class:`PackedStore`, a layer packed at an earlier start is taken from it; the blocks
    are read only when a layer is missing there, and once every block is packed the store is saved.
    """

    def __init__(self, model: nn.Module, blocks: dict[str, Blocks] | Callable[[], dict[str, Blocks]], parts: int = 2,
                 release: bool = False, store: PackedStore | None = None, kernel: bool = False) -> None:
        """``blocks``: by parameter name, or what reads them when first needed. ``parts``: bfloat16
        parts per scale (see :class:`Int4Packed`; 2 is exact). ``release``: drop each packed
        module's dense weight (the transformers model cannot run afterwards). ``kernel``: serve the
        blocks exactly on :class:`BlockLinear` (its library loaded) instead of :class:`Int4Packed`."""
        self.parts = parts
        self.layout: type[BlockLinear] | type[Int4Packed] = BlockLinear if kernel else Int4Packed
        self.model = model
        self.keep = model.get_input_embeddings().weight if release else None  # type: ignore[operator]
        self.names = {m: name for name, m in model.named_modules()}
        self._read = blocks if callable(blocks) else lambda: blocks
        self.blocks: dict[nn.Module, Blocks] | None = None  # read at the first layer the store lacks
        self.unpacked: set[nn.Module] = set()  # modules with blocks no layer holds yet
        self.served: set[nn.Module] = set()  # modules whose layer came from the store
        self.store = store
        self.dense = DenseLinears()

    def layer(self, modules: list[nn.Linear]) -> Linear:
        return self._make(modules, lambda: self.dense.layer(modules))

    def head(self, module: nn.Linear) -> Linear:
        return self._make([module], lambda: self.dense.head(module))

    def _make(self, modules: list[nn.Linear], dense: Callable[[], Linear]) -> Linear:
        name = ",".join(self.names[m] for m in modules)
        stored = None if self.store is None else self.store.get(name)
        if stored is not None:
            self.served.update(modules)
            made = self._released(modules, self.layout.from_tensors(stored, _bias(modules)))
        elif self.store is not None and self.store.is_dense(name):
            made = dense()
        else:
            blocks = self._blocks()
            if all(m in blocks for m in modules):
                packed = self._pack(Blocks.cat([blocks[m] for m in modules]), _bias(modules))
                made = self._released(modules, packed)
                tensors: dict[str, torch.Tensor] | None = packed.tensors()
            else:
                made, tensors = dense(), None
            if self.store is not None:
                self.store.put(name, tensors)
        self.unpacked.difference_update(modules)
        if self.store is not None and not self.unpacked:
            self.store.save()
        return made

    def _pack(self, blocks: Blocks, bias: torch.Tensor | None) -> BlockLinear | Int4Packed:
        return BlockLinear.of(blocks, bias) if self.layout is BlockLinear else Int4Packed.of(blocks, bias, self.parts)

    def _blocks(self) -> dict[nn.Module, Blocks]:
        """The blocks by module (the tied output projection's are the embedding's), read once."""
        if self.blocks is None:
            modules = {name: m for m, name in self.names.items()}
            blocks = {modules[name.removesuffix(".weight")]: b for name, b in self._read().items()
                      if name.removesuffix(".weight") in modules}
            embedding = self.model.get_input_embeddings()  # type: ignore[operator]
            output = self.model.get_output_embeddings()  # type: ignore[operator]
            if embedding in blocks and output.weight is embedding.weight:
                blocks[output] = blocks[embedding]
            blocks.pop(embedding, None)  # the embedding itself is read dense (a gather), never packed
            self.blocks = {m: b for m, b in blocks.items() if m not in self.served}
            self.unpacked = set(self.blocks)
        return self.blocks

    def _released(self, modules: list[nn.Linear], packed: Linear) -> Linear:
        if self.keep is not None:  # the blocks too: their codes are one byte per weight
            _release(modules, self.keep)
            for m in modules:
                if self.blocks:
                    self.blocks.pop(m, None)
        return packed


class Int8Linears:
    """Every layer's weights rounded to int8 per output row (the output projection included)."""

    def __init__(self, release_from: nn.Module | None = None) -> None:
        """``release_from``: the model whose packed modules' dense weights are dropped once packed
        (the transformers model cannot run afterwards); None keeps them."""
        self.keep = None if release_from is None else release_from.get_input_embeddings().weight  # type: ignore[operator]

    def layer(self, modules: list[nn.Linear]) -> Linear:
        packed = Int8Packed(torch.cat([m.weight.detach() for m in modules]), _bias(modules))
        if self.keep is not None:
            _release(modules, self.keep)
        return packed

    def head(self, module: nn.Linear) -> Linear:
        return self.layer([module])


def weights_mode(setting: str, device: str, has_gguf: bool, pretrained: bool, sharded: bool = False,
                 kernel: Callable[[], bool] = lambda: False) -> str:
    """The ``weights`` setting resolved for a model on ``device`` (``sharded``: tensor parallel,
    which splits dense weights; ``has_gguf``: shipped as a GGUF whose blocks Tiller reads, see
    :data:`~services.worker.gguf_blocks.ARCHS`): 'fp32' (dense), 'gguf', 'gguf-bf16' or 'int8'; a combination that
    cannot work raises ValueError with the reason. ``kernel``: whether :class:`BlockLinear`'s library
    is there (asked only for 'auto' on a GGUF model): then 'auto' is 'gguf', its blocks exactly."""
    if setting == "auto":
        if device != "cpu" or not has_gguf or not pretrained or sharded:
            return "fp32"
        return "gguf" if kernel() else "gguf-bf16"
    if setting != "fp32" and sharded:
        raise ValueError(f"tensor parallel shards dense weights; weights={setting!r} cannot be sharded (use 'fp32')")
    if setting != "fp32" and device != "cpu":
        raise ValueError(f"weights={setting!r} runs on packed CPU kernels; device is {device!r} (use 'fp32')")
    if setting.startswith("gguf") and not (has_gguf and pretrained):
        raise ValueError(f"weights={setting!r} needs a model shipped as a GGUF of an architecture whose blocks Tiller "
                         f"reads ({', '.join(ARCHS)}) with its trained weights; use 'int8' or 'fp32'")
    return setting


def linear_factory(mode: str, model: nn.Module, gguf: Path | None, store: PackedStore | None = None,
                   kernel: bool = False, keep_dense: bool = False) -> LinearFactory:
    """The factory for a resolved ``mode`` (see :func:`weights_mode`); a quantized one drops the
    model's dense weights as it packs them (only the native forward runs such a model). ``store``:
    the GGUF's layers as packed at an earlier start (see :class:`GgufLinears`); ``kernel``:
    :class:`BlockLinear`'s library is loaded, and serves 'gguf' and 'fp32' (:class:`TiledLinears`);
    ``keep_dense``: 'fp32' keeps the model's own weights as well, so transformers can run it too
    (oracles in tests)."""
    if mode.startswith("gguf"):
        assert gguf is not None
        config = model.config.get_text_config()  # type: ignore[operator, union-attr]
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        return GgufLinears(model, lambda: read_blocks(gguf, heads, kv_heads), parts=2 if mode == "gguf" else 1,
                           release=True, store=store, kernel=kernel and mode == "gguf")
    if mode == "int8":
        return Int8Linears(release_from=model)
    if kernel:
        return TiledLinears(release_from=None if keep_dense else model)
    return DenseLinears()
