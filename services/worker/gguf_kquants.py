"""GGUF block types beyond the 32-weight ones with float16 fields: the 5-bit Q5_0 / Q5_1 and the
K-quants (llama.cpp's 256-weight super-blocks), unpacked into :class:`~services.worker.gguf_blocks.Blocks`
whose float32 scales and minimums hold the ones the file ships exactly.

* ``Q5_0`` (22 bytes): scale ``d``, 32 high bits, 16 bytes of low nibbles; ``w = d * (q - 16)``
* ``Q5_1`` (24 bytes): ``d``, minimum ``m``, the high bits, the nibbles; ``w = d * q + m``
* ``Q4_K`` (144 bytes per 256): float16 ``d`` and ``dmin``, 12 bytes packing eight 6-bit sub-scales and
  sub-minimums, 128 bytes of nibbles; sub-block ``j`` of 32: ``w = d * sc_j * q - dmin * m_j``
* ``Q5_K`` (176 bytes): as Q4_K, with 32 bytes of fifth bits before the nibbles
* ``Q6_K`` (210 bytes): 128 bytes of low nibbles, 64 of high bit pairs, sixteen int8 sub-scales (one per
  16 weights), float16 ``d``; ``w = d * sc_i * (q - 32)``

A float16 times a 6- or 8-bit integer needs at most 19 significant bits, so each sub-block's scale and
minimum is exact in float32, and the products the kernel forms equal the file's dequantized weights up
to float32 rounding. The bit layouts are llama.cpp's (``ggml-quants.c``); the tests check every type
against the ``gguf`` package's own ``dequantize``.
"""

from __future__ import annotations

import numpy as np
import torch

from services.worker.gguf_blocks import GROUP, Blocks

SUPER = 256  # weights per K-quant super-block
SIZES = {"Q5_0": (GROUP, 22), "Q5_1": (GROUP, 24), "Q4_K": (SUPER, 144), "Q5_K": (SUPER, 176), "Q6_K": (SUPER, 210)}


def _halves(raw: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte ``at`` of each block, as float32 ``[..., 1]``."""
    return raw[..., at:at + 2].copy().view(np.float16).astype(np.float32)


def _sub_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's twelve bytes as the eight 6-bit sub-scales and sub-minimums ``[..., 8]`` each: bytes
    0-3 and 4-7 hold sub-blocks 0-3's in their low six bits; bytes 8-11 hold sub-blocks 4-7's low four bits
    of each, whose top two bits are the top bits of bytes 0-3 (scales) and 4-7 (minimums)."""
    p = packed.astype(np.int32)
    low, mid, high = p[..., 0:4], p[..., 4:8], p[..., 8:12]
    scales = np.concatenate([low & 63, (high & 15) | ((low >> 6) << 4)], axis=-1)
    minimums = np.concatenate([mid & 63, (high >> 4) | ((mid >> 6) << 4)], axis=-1)
    return scales, minimums


def _nibble_pairs(qs: np.ndarray) -> np.ndarray:
    """K-quant nibbles ``[..., 4 * 32]`` as codes ``[..., 256]``: each 32 bytes hold two sub-blocks, the
    first in the low nibbles and the second in the high ones."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 32).astype(np.int32)
    return np.stack([chunks & 15, chunks >> 4], axis=-2).reshape(*qs.shape[:-1], SUPER)


def _blocks(kind: str, rows: int, q: np.ndarray, scale: np.ndarray, minimum: np.ndarray | None) -> Blocks:
    def as_torch(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).reshape(rows, -1)

    return Blocks(kind, as_torch(q.astype(np.int8 if kind == "Q6_K" else np.uint8)), as_torch(scale.astype(np.float32)),
                  None if minimum is None else as_torch(minimum.astype(np.float32)))


def decode(kind: str, data: np.ndarray) -> Blocks:
    """Blocks from a tensor's raw bytes ``[out, blocks * bytes_per_block]`` (as gguf reads them)."""
    weights, size = SIZES[kind]
    rows = data.shape[0]
    raw = np.ascontiguousarray(data).reshape(rows, -1, size)
    if kind in ("Q5_0", "Q5_1"):
        d = _halves(raw, 0)
        at = 2 if kind == "Q5_0" else 4
        high = np.unpackbits(raw[..., at:at + 4], axis=-1, bitorder="little").astype(np.int32)  # bit j: weight j
        body = raw[..., at + 4:].astype(np.int32)
        q = np.concatenate([body & 15, body >> 4], axis=-1) | (high << 4)
        minimum = -16 * d if kind == "Q5_0" else _halves(raw, 2)
        return _blocks(kind, rows, q, d, minimum)
    if kind in ("Q4_K", "Q5_K"):
        d, dmin = _halves(raw, 0), _halves(raw, 2)
        sc, m = _sub_scales(raw[..., 4:16])
        q = _nibble_pairs(raw[..., -128:])
        if kind == "Q5_K":  # byte l of the 32 holds bit 4 of weight l of each sub-block, sub-block j in bit j
            fifth = np.unpackbits(raw[..., 16:48, None], axis=-1, bitorder="little")  # [..., l, j]
            q = q | (fifth.swapaxes(-1, -2).reshape(q.shape).astype(np.int32) << 4)
        return _blocks(kind, rows, q, d * sc, -(dmin * m))
    # Q6_K: each 128 weights take 64 bytes of nibbles (weights 0-31 and 64-95 low, 32-63 and 96-127 high)
    # and 32 bytes of bit pairs (weight l's at bits 0-1, l + 32's at 2-3, l + 64's at 4-5, l + 96's at 6-7)
    ql = raw[..., 0:128].reshape(rows, -1, 2, 2, 32).astype(np.int32)  # [half, which 32 bytes, l]
    qh = raw[..., 128:192].reshape(rows, -1, 2, 1, 32).astype(np.int32)
    low = np.stack([ql[..., 0, :] & 15, ql[..., 1, :] & 15, ql[..., 0, :] >> 4, ql[..., 1, :] >> 4], axis=-2)
    pairs = np.stack([(qh[..., 0, :] >> shift) & 3 for shift in (0, 2, 4, 6)], axis=-2)
    q = (low | (pairs << 4)) - 32
    scales = raw[..., 192:208].copy().view(np.int8).astype(np.float32)
    return _blocks(kind, rows, q, _halves(raw, 208) * scales, None)
