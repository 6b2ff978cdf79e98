"""GGUF blocks served by Tiller's own CPU kernel (``gguf_kernel.cpp``, built by ``kernel_build.py``).

The kernel reads each block's codes once, keeps the float16 scales (and Q4_1 minimums) as they ship,
dequantizes in registers and multiplies float32 activations with float32 accumulation: the result is a
matmul over the dequantized weights up to float32 rounding. :func:`pack` lays the blocks out for it:
the output features in tiles of 16 and, per tile and block of 32 inputs, one record of the 16
columns' scales, minimums (Q4_1) and codes, interleaved column by column (see the C++ source). Q4_K
blocks keep their nibbles beside float32 scales and minimums; the other types of
:mod:`services.worker.gguf_kquants` (and fused projections of mixed types) become K8 records.
:func:`pack_dense` lays unquantized weights (float32, bfloat16, float16) out in the same tiles, the
values in place of the codes: a dense layer then reads each weight once a step and runs in the
kernel's fused decoder layer like a GGUF one.
"""

from __future__ import annotations

import torch

from services.worker.gguf_blocks import GROUP, Blocks

TILE = 16
KINDS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2, "F32": 3, "BF16": 4, "F16": 5, "Q4_K": 6, "K8": 7}
DENSE_KINDS = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def _half_bytes(values: torch.Tensor, tiles: int, what: str) -> torch.Tensor:
    """``values`` ``[tiles * 16, blocks]`` float32 as float16 bytes ``[tiles, blocks, 32]``."""
    half = values.half()
    if not torch.equal(half.float(), values):
        raise ValueError(f"block {what} are not float16 values (GGUF blocks ship them as float16)")
    return half.reshape(tiles, TILE, -1).transpose(1, 2).contiguous().view(torch.uint8)


def _float_bytes(values: torch.Tensor, tiles: int, groups: int) -> torch.Tensor:
    """``values`` ``[tiles * 16, groups * per]`` float32 as bytes ``[tiles, groups, per * 64]``: per
    record, ``per`` sets (K8's scales: one per 16 inputs) of the 16 columns' values."""
    per = values.shape[1] // groups
    records = values.reshape(tiles, TILE, groups, per).permute(0, 2, 3, 1).contiguous()
    return records.view(torch.uint8).reshape(tiles, groups, -1)


def served(blocks: Blocks) -> Blocks:
    """``blocks`` in a kind the kernel has records for: the types without one of their own as K8."""
    return blocks if blocks.kind in KINDS else blocks.to_k8()


def pack(blocks: Blocks) -> torch.Tensor:
    """The kernel's records of ``blocks`` (a kind of :data:`KINDS`, see :func:`served`): uint8
    ``[tiles, in / 32, record bytes]``, the output features padded with zero weights to whole tiles."""
    if blocks.kind not in KINDS:
        raise ValueError(f"no kernel for {blocks.kind} blocks")
    out, in_features = blocks.shape
    tiles = -(-out // TILE)
    pad = tiles * TILE - out
    q, scale, minimum = blocks.q, blocks.scale, blocks.minimum
    if pad:
        q = torch.cat([q, q.new_zeros(pad, in_features)])
        scale = torch.cat([scale, scale.new_zeros(pad, scale.shape[1])])
        minimum = None if minimum is None else torch.cat([minimum, minimum.new_zeros(pad, minimum.shape[1])])
    groups = in_features // GROUP
    if blocks.kind in ("Q8_0", "K8"):
        codes = q.view(torch.uint8).reshape(tiles, TILE, groups, GROUP).permute(0, 2, 3, 1)
    else:
        pairs = q.to(torch.uint8).reshape(tiles, TILE, groups, GROUP // 2, 2)
        codes = (pairs[..., 0] | (pairs[..., 1] << 4)).permute(0, 2, 3, 1)
    if blocks.kind in ("Q4_K", "K8"):  # float32 scales and minimums
        assert minimum is not None
        parts = [_float_bytes(scale, tiles, groups), _float_bytes(minimum, tiles, groups)]
    else:
        parts = [_half_bytes(scale, tiles, "scales")]
        if minimum is not None:
            parts.append(_half_bytes(minimum, tiles, "minimums"))
    parts.append(codes.reshape(tiles, groups, -1))
    return torch.cat(parts, dim=2).contiguous()


def dense_packable(weight: torch.Tensor) -> bool:
    """Whether :func:`pack_dense` takes ``weight``: a CPU matrix of a dtype the kernel reads whose
    inputs are whole blocks of 32."""
    return weight.device.type == "cpu" and weight.dtype in DENSE_KINDS and weight.shape[1] % GROUP == 0


def pack_dense(weight: torch.Tensor) -> torch.Tensor:
    """The kernel's records of ``weight`` ``[out, in]`` (see :func:`dense_packable`) in its own
    dtype: uint8 ``[tiles, in / 32, 32 * 16 * element bytes]``, per record the 32 inputs' 16 column
    values input by input, the output features padded with zero weights to whole tiles."""
    if not dense_packable(weight):
        raise ValueError(f"no kernel for a {tuple(weight.shape)} {weight.dtype} matrix on {weight.device}")
    out, in_features = weight.shape
    tiles = -(-out // TILE)
    if tiles * TILE != out:
        weight = torch.cat([weight, weight.new_zeros(tiles * TILE - out, in_features)])
    groups = in_features // GROUP
    records = weight.reshape(tiles, TILE, groups, GROUP).permute(0, 2, 3, 1).contiguous()
    return records.view(torch.uint8).reshape(tiles, groups, -1)


class BlockLinear:
    """``x @ W^T + b`` (and ``+ residual`` in :meth:`add_to`) on packed GGUF blocks or dense tiles."""

    def __init__(self, records: torch.Tensor, kind: str, out_features: int, bias: torch.Tensor | None) -> None:
        """The kernel's library must be loaded (``kernel_build.load``)."""
        self.records = records
        self.kind = kind
        self.code = KINDS[kind]
        self.out_features = out_features
        self.bias = bias
        self.op = torch.ops.tiller_gguf.linear.default  # the overload itself: ~1.4 µs less per call than the packet

    @classmethod
    def of(cls, blocks: Blocks, bias: torch.Tensor | None) -> BlockLinear:
        blocks = served(blocks)
        return cls(pack(blocks), blocks.kind, blocks.shape[0], bias)

    @classmethod
    def of_dense(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> BlockLinear:
        return cls(pack_dense(weight), DENSE_KINDS[weight.dtype], weight.shape[0], bias)

    def tensors(self) -> dict[str, torch.Tensor]:
        """What :meth:`from_tensors` makes this layer again from (the bias is the model's own)."""
        return {"records": self.records, "shape": torch.tensor([KINDS[self.kind], self.out_features])}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], bias: torch.Tensor | None) -> BlockLinear:
        code, out_features = (int(v) for v in tensors["shape"])
        kind = next(name for name, c in KINDS.items() if c == code)
        return cls(tensors["records"], kind, out_features, bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x, self.records, self.code, self.out_features, self.bias, None)

    def add_to(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return self.op(h, self.records, self.code, self.out_features, self.bias, x)
