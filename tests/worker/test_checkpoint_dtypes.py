"""Checkpoints as they ship: a bfloat16 or float16 safetensors model is served with its projections
in their own dtype on Tiller's kernel (float32 activations), a float32 one as float32 tiles, one sharded
into several files with their index like a single file, and the greedy tokens equal transformers' in
float32 on the same weights (the shipped values, widened)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from common.config import Settings
from common.model_source import resolve_model
from services.worker.engine import Engine
from services.worker.gguf_linear import BlockLinear
from services.worker.model_loader import load_model
from tests.worker.conftest import assert_greedy_as_transformers

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def _checkpoint(directory: Path, dtype: torch.dtype, shard: str | None = None) -> Path:
    """A small random Llama saved in ``dtype`` with the default model's tokenizer (``shard``: in safetensors
    files of at most that size, with their ``model.safetensors.index.json``)."""
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to(dtype).save_pretrained(directory, **({"max_shard_size": shard} if shard else {}))
    source = resolve_model(Settings()).directory
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, directory / name)
    return directory


@pytest.mark.parametrize("dtype,kind,shard", [(torch.bfloat16, "BF16", None), (torch.float16, "F16", None),
                                             (torch.float32, "F32", None), (torch.bfloat16, "BF16", "4MB")])
def test_a_checkpoint_is_served_in_the_dtype_it_ships(tmp_path, gguf_kernel, dtype, kind, shard) -> None:
    directory = _checkpoint(tmp_path / "model", dtype, shard)
    assert (directory / "model.safetensors.index.json").is_file() == bool(shard)
    loaded = load_model(Settings(model=str(directory), device="cpu"), lambda progress, message: None)
    assert loaded.kernel and loaded.dtype == torch.float32  # float32 activations and KV
    engine = Engine(loaded, num_blocks=32)
    layer = engine.runner.layers[0]
    assert all(isinstance(p, BlockLinear) and p.kind == kind for p in layer.projections())
    assert isinstance(engine.runner.head, BlockLinear) and engine.runner.head.kind == kind
    assert all(m.weight.device.type == "meta" for m in loaded.model.model.layers[0].mlp.modules()
               if isinstance(m, torch.nn.Linear))  # the dense copies let go once packed

    oracle = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    assert_greedy_as_transformers(engine, oracle, 20)
