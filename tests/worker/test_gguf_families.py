"""A GGUF of each family Tiller reads the blocks of (Llama: q and k rows permuted; Qwen2: q/k/v biases, rows as
they are; Qwen3: q/k norms; Phi-3: fused attn_qkv and gate|up ffn_up; Gemma 2 and 3: sandwich norms, tied output)
is served natively, its blocks on Tiller's kernel with ``weights=auto`` and dense with ``fp32``, and its greedy
tokens equal transformers' loading the same file (which dequantizes it); another architecture's blocks are
refused by name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from transformers import AutoModelForCausalLM

from common import model_cache
from common.config import Settings
from common.model_source import resolve_model
from services.worker.engine import Engine
from services.worker.gguf_blocks import ARCHS, architecture, read_blocks
from services.worker.gguf_linear import BlockLinear
from services.worker.model_loader import load_model
from tests.worker.conftest import assert_greedy_as_transformers
from tests.worker.gguf_writer import FAMILIES, LAYERS, write_gguf


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_gguf(request, tmp_path_factory, worker_settings) -> tuple[str, Path, Path]:
    """(the transformers model type, the file, a cache whose kernels are the session's)."""
    embedded = resolve_model(Settings()).gguf
    assert embedded is not None
    folder = tmp_path_factory.mktemp(request.param)
    cache = folder / "cache"
    cache.mkdir()
    (cache / model_cache.KERNELS).symlink_to(worker_settings.cache_dir / model_cache.KERNELS)
    return request.param, write_gguf(FAMILIES[request.param], embedded, folder / f"tiny-{request.param}.gguf"), cache


@pytest.mark.parametrize("weights", ["auto", "fp32"])
def test_a_gguf_of_each_family_is_served_natively_as_transformers_reads_it(family_gguf, weights, gguf_kernel) -> None:
    model_type, path, cache = family_gguf
    loaded = load_model(Settings(model=str(path), device="cpu", weights=weights, cache_dir=cache),
                        lambda progress, message: None)
    assert loaded.config.model_type == model_type and loaded.config.num_hidden_layers == LAYERS
    assert loaded.weights == ("gguf" if weights == "auto" else "fp32")
    engine = Engine(loaded, num_blocks=32)
    assert engine.fallback_reason is None
    if weights == "auto":  # every projection's blocks as they ship (Gemma's post-normed inside a NormedOutput)
        assert all(isinstance(getattr(p, "linear", p), BlockLinear)
                   for layer in engine.runner.layers for p in layer.projections())
    oracle = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    assert_greedy_as_transformers(engine, oracle, 12)


def test_blocks_of_an_architecture_tiller_does_not_read_are_refused_by_name(tmp_path) -> None:
    path = tmp_path / "tiny-falcon.gguf"
    writer = GGUFWriter(str(path), "falcon")
    writer.add_tensor("blk.0.attn_qkv.weight", quantize(np.ones((4, 32), np.float32), GGMLQuantizationType.Q8_0),
                      raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert architecture(path) == "falcon" and "falcon" not in ARCHS
    with pytest.raises(ValueError, match="no GGUF blocks of architecture 'falcon'"):
        read_blocks(path, 1, 1)
    with pytest.raises(ValueError, match="no GGUF file"):
        architecture(Path(__file__))
