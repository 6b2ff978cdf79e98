"""A GGUF as llama.cpp's Q4_K_M mix makes one of the default model's shapes, named by ``TILLER_MODEL``: its
matrices are served as they ship on Tiller's kernel (Q4_K, Q6_K, and Q5_0 / Q8_0 where a matrix's inputs are
no whole super-block, as llama.cpp falls back), and the greedy tokens equal transformers' on the same file.

The file is the embedded GGUF's first four layers (every tensor of its shapes), its 576-input matrices
requantized by the ``gguf`` package (Q5_0; attn_v Q8_0) and each ffn_down (1,536 inputs) random Q4_K or Q6_K
blocks (the package writes no K-quants), alternately as the mix does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize
from transformers import AutoModelForCausalLM

from common import model_cache
from common.config import Settings
from common.model_source import cache_entries_in_use, resolve_model
from services.worker.engine import Engine
from services.worker.gguf_linear import BlockLinear
from services.worker.model_loader import load_model
from tests.worker.conftest import assert_greedy_as_transformers

LAYERS = 4


def _k_blocks(kind: str, rows: int, inputs: int, seed: int) -> np.ndarray:
    """Random raw ``kind`` blocks with small float16 scales: weights of a trained model's size."""
    weights, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, inputs // weights, size), dtype=np.uint8)
    for at in [208] if kind == "Q6_K" else [0, 2]:
        raw[..., at:at + 2] = rng.uniform(5e-5, 2e-4, size=raw.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def _requantized(source: Path, target: Path) -> Path:
    reader = GGUFReader(str(source))
    writer = GGUFWriter(str(target), "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue  # the writer's own
        value = LAYERS if field.name == "llama.block_count" else field.contents()
        kind = field.types[0]
        writer.add_key_value(field.name, value, kind, sub_type=field.types[-1] if kind == GGUFValueType.ARRAY else None)
    for tensor in reader.tensors:
        parts = tensor.name.split(".")
        if parts[0] == "blk" and int(parts[1]) >= LAYERS:
            continue
        layer = int(parts[1]) if parts[0] == "blk" else 0
        shipped = tensor.tensor_type
        if parts[-2] == "ffn_down":
            kind = GGMLQuantizationType.Q6_K if layer % 2 == 0 else GGMLQuantizationType.Q4_K
            raw = _k_blocks(kind.name, tensor.data.shape[0], int(tensor.shape[0]), seed=layer)
            writer.add_tensor(tensor.name, raw, raw_dtype=kind)
        elif parts[0] == "blk" and shipped == GGMLQuantizationType.Q4_1:
            kind = GGMLQuantizationType.Q8_0 if parts[-2] == "attn_v" else GGMLQuantizationType.Q5_0
            weights = dequantize(tensor.data, shipped)
            writer.add_tensor(tensor.name, quantize(weights, kind), raw_dtype=kind)
        else:
            writer.add_tensor(tensor.name, tensor.data, raw_dtype=shipped)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory) -> Path:
    embedded = resolve_model(Settings()).gguf
    assert embedded is not None
    return _requantized(embedded, tmp_path_factory.mktemp("q4_k_m") / "SmolLM2-135M-Instruct.Q4_K_M-4layers.gguf")


def test_a_q4_k_m_file_is_served_as_it_ships_and_equals_transformers(mixed_gguf: Path, gguf_kernel, worker_settings,
                                                                     tmp_path) -> None:
    cache = tmp_path / "cache"  # the converted file's entry goes here, the built kernel is the session's
    cache.mkdir()
    (cache / model_cache.KERNELS).symlink_to(worker_settings.cache_dir / model_cache.KERNELS)
    settings = Settings(model=str(mixed_gguf), device="cpu", cache_dir=cache)
    source = resolve_model(settings, weights=True)
    assert source.gguf == mixed_gguf and source.pretrained_weights
    assert source.directory.name in cache_entries_in_use(settings)  # `tiller cache clean` keeps it
    loaded = load_model(settings, lambda progress, message: None)
    assert loaded.weights == "gguf" and loaded.kernel and loaded.config.num_hidden_layers == LAYERS
    engine = Engine(loaded, num_blocks=32)
    kinds = [tuple(p.kind for p in layer.projections()) for layer in engine.runner.layers]
    assert all(isinstance(p, BlockLinear) for layer in engine.runner.layers
               for p in layer.projections())
    assert kinds == [("K8", "K8", "K8", "K8" if i % 2 == 0 else "Q4_K") for i in range(LAYERS)], kinds

    oracle = AutoModelForCausalLM.from_pretrained(source.directory, dtype=torch.float32).eval()  # the file, dequantized
    assert_greedy_as_transformers(engine, oracle, 16)


def test_a_gguf_path_that_is_no_file_is_refused_clearly(tmp_path) -> None:
    with pytest.raises(RuntimeError, match="does not exist"):
        resolve_model(Settings(model=str(tmp_path / "missing.gguf"), cache_dir=tmp_path))
