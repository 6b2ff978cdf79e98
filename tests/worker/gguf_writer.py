"""A tiny random-weight GGUF of one llama.cpp architecture, written as llama.cpp names and lays out its tensors,
with the embedded model's tokenizer (a gpt2 BPE, copied from its ``tokenizer.*`` metadata) cut to 2,048 tokens."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS, VOCAB = 64, 4, 2, 128, 2, 2048
HEAD_DIM = HIDDEN // HEADS


@dataclass(frozen=True)
class Family:
    """``arch``'s layer tensors: name → rows (their inputs are ``HIDDEN``, ffn_down's ``FFN``, attn_output's
    attn_q's rows); ``biases``: the matrices with a bias; ``norms``: a layer's norms and their sizes; ``keys``:
    metadata beyond the common ones."""

    arch: str
    matrices: dict[str, int]
    biases: tuple[str, ...] = ()
    norms: dict[str, int] = field(default_factory=lambda: {"attn_norm": HIDDEN, "ffn_norm": HIDDEN})
    keys: dict[str, int | float] = field(default_factory=dict)
    tied: bool = False  # no output.weight: the output projection is the embedding's


def _separate(head_dim: int = HEAD_DIM) -> dict[str, int]:
    return {"attn_q": HEADS * head_dim, "attn_k": KV_HEADS * head_dim, "attn_v": KV_HEADS * head_dim,
            "attn_output": HIDDEN, "ffn_gate": FFN, "ffn_up": FFN, "ffn_down": HIDDEN}


QWEN3_HEAD_DIM = 128  # transformers' Qwen3 default: its GGUF loader reads no head size (every Qwen3's is 128)
FAMILIES = {
    "llama": Family("llama", _separate(), keys={"rope.dimension_count": HEAD_DIM}),  # q and k rows permuted
    "qwen2": Family("qwen2", _separate(), biases=("attn_q", "attn_k", "attn_v")),
    "phi3": Family("phi3", {"attn_qkv": (HEADS + 2 * KV_HEADS) * HEAD_DIM, "attn_output": HIDDEN,
                            "ffn_up": 2 * FFN, "ffn_down": HIDDEN}, keys={"rope.dimension_count": HEAD_DIM}),
    "qwen3": Family("qwen3", _separate(QWEN3_HEAD_DIM),
                    norms={"attn_norm": HIDDEN, "ffn_norm": HIDDEN, "attn_q_norm": QWEN3_HEAD_DIM,
                           "attn_k_norm": QWEN3_HEAD_DIM}, keys={"attention.key_length": QWEN3_HEAD_DIM}),
    "gemma2": Family("gemma2", _separate(), norms={"attn_norm": HIDDEN, "post_attention_norm": HIDDEN,
                                                   "ffn_norm": HIDDEN, "post_ffw_norm": HIDDEN},
                     keys={"attention.key_length": HEAD_DIM, "attention.sliding_window": 4096}, tied=True),
    "gemma3_text": Family("gemma3", _separate(), norms={"attn_norm": HIDDEN, "post_attention_norm": HIDDEN,
                                                        "ffn_norm": HIDDEN, "post_ffw_norm": HIDDEN,
                                                        "attn_q_norm": HEAD_DIM, "attn_k_norm": HEAD_DIM},
                          keys={"attention.key_length": HEAD_DIM, "attention.sliding_window": 4096}, tied=True),
}


@functools.cache
def _tokenizer_fields(source: Path, vocab: int) -> list[tuple[str, object, GGUFValueType, GGUFValueType | None]]:
    """The source's ``tokenizer.*`` metadata (name, value, type, array element type), cut to its first ``vocab``
    tokens and the merges among them (a BPE's tokens come in merge order, so the cut is a tokenizer too, and
    parses in a fraction of the time a 49,152-token one does)."""
    reader = GGUFReader(str(source))
    kept = set(reader.fields["tokenizer.ggml.tokens"].contents()[:vocab])
    fields = []
    for found in reader.fields.values():
        if not found.name.startswith("tokenizer."):
            continue
        value = found.contents()
        if found.name == "tokenizer.ggml.merges":
            value = [m for m in value if m.replace(" ", "") in kept and all(part in kept for part in m.split(" "))]
        elif found.name in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
            value = value[:vocab]
        kind = found.types[0]
        fields.append((found.name, value, kind, found.types[-1] if kind == GGUFValueType.ARRAY else None))
    return fields


def _quantized(writer: GGUFWriter, name: str, weights: np.ndarray, kind: GGMLQuantizationType) -> None:
    writer.add_tensor(name, quantize(weights, kind), raw_dtype=kind)


def write_gguf(family: Family, tokenizer_source: Path, target: Path, seed: int = 0) -> Path:
    """``target``: ``family``'s model of the sizes above, its matrices Q4_1 and Q8_0 by turns, the embedding and
    output Q8_0, norms and biases float32."""
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(target), family.arch)
    for name, value, kind, sub_type in _tokenizer_fields(tokenizer_source, VOCAB):
        writer.add_key_value(name, value, kind, sub_type=sub_type)
    common = {"context_length": 2048, "embedding_length": HIDDEN, "block_count": LAYERS, "feed_forward_length": FFN,
              "attention.head_count": HEADS, "attention.head_count_kv": KV_HEADS, "rope.freq_base": 10000.0,
              "attention.layer_norm_rms_epsilon": 1e-6, "vocab_size": VOCAB}
    for key, value in {**common, **family.keys}.items():
        kind = GGUFValueType.FLOAT32 if isinstance(value, float) else GGUFValueType.UINT32
        writer.add_key_value(f"{family.arch}.{key}", value, kind)

    def normal(*shape: int, std: float) -> np.ndarray:
        return rng.normal(0, std, size=shape).astype(np.float32)

    _quantized(writer, "token_embd.weight", normal(VOCAB, HIDDEN, std=1.0), GGMLQuantizationType.Q8_0)
    kinds = [GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0]
    for layer in range(LAYERS):
        prefix = f"blk.{layer}"
        for name, size in family.norms.items():
            writer.add_tensor(f"{prefix}.{name}.weight", 1 + normal(size, std=0.1))
        for index, (name, rows) in enumerate(family.matrices.items()):
            inputs = {"ffn_down": FFN, "attn_output": family.matrices.get("attn_q", HIDDEN)}.get(name, HIDDEN)
            _quantized(writer, f"{prefix}.{name}.weight", normal(rows, inputs, std=inputs ** -0.5),
                       kinds[(layer + index) % 2])
            if name in family.biases:
                writer.add_tensor(f"{prefix}.{name}.bias", normal(rows, std=0.5))
    writer.add_tensor("output_norm.weight", 1 + normal(HIDDEN, std=0.1))
    if not family.tied:
        _quantized(writer, "output.weight", normal(VOCAB, HIDDEN, std=0.5), GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target
