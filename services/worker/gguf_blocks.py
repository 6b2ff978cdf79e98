"""A GGUF file's quantized weight matrices as blocks of 32 weights, under transformers' names.

Supported block types (llama.cpp's layouts; each block starts with float16 fields):

* ``Q4_0`` (18 bytes): scale ``d``, 16 bytes of 4-bit codes; ``w = d * (q - 8)``
* ``Q4_1`` (20 bytes): scale ``d``, minimum ``m``, 16 bytes of 4-bit codes; ``w = d * q + m``
* ``Q8_0`` (34 bytes): scale ``d``, 32 signed bytes; ``w = d * q``

and, unpacked by :mod:`services.worker.gguf_kquants`, Q5_0, Q5_1 and the K-quants Q4_K, Q5_K and Q6_K
(so the Q4_K_M and Q5_K_M mixes, which combine them with Q8_0 per tensor). A 4-bit block keeps weight ``j`` in the low nibble of byte ``j`` and weight ``j + 16`` in its high
nibble.

How llama.cpp names and lays out each architecture's projections is :data:`ARCHS`: only Llama's q and k
projections have the rows of each head interleaved for its rotary layout (Qwen2's, Qwen3's, Phi-3's and
Gemma's are written as they are); they are put back in transformers' order here, as transformers does when it
loads a GGUF (rows are whole blocks, so reordering them keeps every block intact). Phi-3's fused
``attn_qkv`` and ``ffn_up`` (gate|up) are transformers' own fused ``qkv_proj`` and ``gate_up_proj``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

GROUP = 32  # weights per block of a scale and minimum (Q6_K and K8: a scale per 16)
_LAYOUT = {"Q4_0": (18, False), "Q4_1": (20, True), "Q8_0": (34, False)}  # bytes per block, has a minimum
_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@dataclass(frozen=True)
class Arch:
    """How llama.cpp writes one ``general.architecture``'s projections: ``names`` maps a layer tensor's
    name (``blk.N.<name>.weight``) to transformers' module under ``model.layers.N``; ``permuted_qk``:
    q and k rows are interleaved per head (undone on reading)."""

    names: dict[str, str]
    permuted_qk: bool = False


ARCHS = {
    "llama": Arch(_NAMES, permuted_qk=True),
    "qwen2": Arch(_NAMES),
    "qwen3": Arch(_NAMES),
    "gemma2": Arch(_NAMES),
    "gemma3": Arch(_NAMES),
    "phi3": Arch({"attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
                  "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"}),
}


@dataclass(frozen=True)
class Blocks:
    """A weight matrix ``[out, in]`` quantized in blocks of 32 along ``in``: codes ``q`` (uint8 0..15
    for the 4-bit types, 0..31 for the 5-bit ones, int8 for Q8_0, Q6_K and K8), ``scale`` float32
    ``[out, in // 32]`` (Q6_K and K8: ``[out, in // 16]``) and, for the types with one, ``minimum``
    float32 ``[out, in // 32]``: ``w = q * scale + minimum`` (Q4_0: ``(q - 8) * scale``).

    K8 is no file's type but the kernel's widest record, which holds every other type exactly
    (:meth:`to_k8`): Q5_0, Q5_1, Q5_K and Q6_K are served as K8, and so is a fused projection whose parts
    ship in different types (a Q4_K_M's q and v, say)."""

    kind: str
    q: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1]

    def dequantize(self) -> torch.Tensor:
        """The float32 weights the blocks stand for."""
        scale = self.scale.repeat_interleave(self.shape[1] // self.scale.shape[1], dim=1)
        if self.kind == "Q4_0":
            return (self.q.float() - 8) * scale
        weights = self.q.float() * scale
        return weights if self.minimum is None else weights + self.minimum.repeat_interleave(GROUP, dim=1)

    def to_k8(self) -> Blocks:
        """The same weights as K8 blocks: signed codes, a scale per 16 inputs, a minimum per 32."""
        if self.kind == "K8":
            return self
        scale = self.scale if self.scale.shape[1] * 16 == self.shape[1] else self.scale.repeat_interleave(2, dim=1)
        minimum = self.minimum if self.minimum is not None else self.scale.new_zeros(self.shape[0], self.shape[1] // GROUP)
        q = self.q.to(torch.int16) - 8 if self.kind == "Q4_0" else self.q
        return Blocks("K8", q.to(torch.int8), scale, minimum)

    def rows(self, index: torch.Tensor) -> Blocks:
        minimum = None if self.minimum is None else self.minimum[index]
        return Blocks(self.kind, self.q[index], self.scale[index], minimum)

    @staticmethod
    def cat(parts: list[Blocks]) -> Blocks:
        """Matrices stacked along ``out`` (fused projections): of one kind, or of several as K8."""
        if len({p.kind for p in parts}) != 1:
            parts = [p.to_k8() for p in parts]
        minimum = None if parts[0].minimum is None else torch.cat([p.minimum for p in parts])  # type: ignore[misc]
        return Blocks(parts[0].kind, torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), minimum)


def decode(kind: str, data: np.ndarray) -> Blocks:
    """Blocks from a tensor's raw bytes ``[out, blocks * bytes_per_block]`` (as gguf reads them)."""
    size, has_min = _LAYOUT[kind]
    raw = np.ascontiguousarray(data).reshape(data.shape[0], -1, size)
    scale = torch.from_numpy(raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    body = raw[..., 4:] if has_min else raw[..., 2:]
    minimum = torch.from_numpy(raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)) if has_min else None
    if kind == "Q8_0":
        q = torch.from_numpy(body.copy().view(np.int8)).reshape(data.shape[0], -1)
    else:
        q = torch.from_numpy(np.concatenate([body & 0x0F, body >> 4], axis=-1)).reshape(data.shape[0], -1)
    return Blocks(kind, q, scale, minimum)


def _unpermute(blocks: Blocks, heads: int) -> Blocks:
    """Undo llama.cpp's rotary row interleaving of a q or k projection with ``heads`` heads."""
    rows = blocks.shape[0]
    order = torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)
    return blocks.rows(order)


_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value type: bytes
_STRING, _ARRAY = 8, 9


def architecture(path: Path) -> str:
    """A GGUF's ``general.architecture``, read from its header alone (``gguf.GGUFReader`` parses every
    field, a tokenizer's too: seconds, at every start)."""
    with path.open("rb") as f:
        def number(size: int) -> int:
            return int.from_bytes(f.read(size), "little")

        def skip(kind: int) -> None:
            if kind == _STRING:
                f.seek(number(8), 1)
            elif kind == _ARRAY:
                inner, count = number(4), number(8)
                if inner in _SCALAR:
                    f.seek(_SCALAR[inner] * count, 1)
                else:
                    for _ in range(count):
                        skip(inner)
            else:
                f.seek(_SCALAR[kind], 1)

        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is no GGUF file")
        f.seek(4 + 8, 1)  # version, tensor count
        for _ in range(number(8)):
            key, kind = f.read(number(8)), number(4)
            if key == b"general.architecture" and kind == _STRING:
                return f.read(number(8)).decode()
            skip(kind)
    return ""


def hf_name(gguf_name: str, arch: Arch = ARCHS["llama"]) -> str | None:
    """transformers' parameter name of a GGUF weight matrix (None: not a projection or embedding)."""
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf_name)
    if match is None or match[2] not in arch.names:
        return None
    return f"model.layers.{match[1]}.{arch.names[match[2]]}.weight"


def read_blocks(path: Path, num_heads: int, num_kv_heads: int) -> dict[str, Blocks]:
    """Every quantized weight matrix of a GGUF of an architecture in :data:`ARCHS`, of a supported
    type, by transformers' parameter name; other tensors (norms, biases, float tensors) are left out."""
    import gguf

    from services.worker import gguf_kquants

    reader = gguf.GGUFReader(str(path))
    name_of_arch = architecture(path)
    if name_of_arch not in ARCHS:
        raise ValueError(f"Tiller reads no GGUF blocks of architecture {name_of_arch!r} (it reads {', '.join(ARCHS)})")
    arch = ARCHS[name_of_arch]
    found: dict[str, Blocks] = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        name = hf_name(tensor.name, arch)
        if name is None or (kind not in _LAYOUT and kind not in gguf_kquants.SIZES):
            continue
        blocks = decode(kind, tensor.data) if kind in _LAYOUT else gguf_kquants.decode(kind, tensor.data)
        if arch.permuted_qk and ".attn_q." in tensor.name:
            blocks = _unpermute(blocks, num_heads)
        elif arch.permuted_qk and ".attn_k." in tensor.name:
            blocks = _unpermute(blocks, num_kv_heads)
        found[name] = blocks
    return found
