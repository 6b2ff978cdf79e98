"""A small random model of an architecture no family file serves, on the transformers fallback, against
transformers' generate (the native families' own tests: test_families.py)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, GPT2Config

from services.worker.engine import Engine
from services.worker.model_loader import LoadedModel
from tests.worker.conftest import Driver

def _loaded(config) -> LoadedModel:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    return LoadedModel(
        model=model,
        config=model.config,
        name="tiny",
        device=torch.device("cpu"),
        dtype=torch.float32,
        eos_token_ids=[],
        max_model_len=128,
    )


def test_an_architecture_no_family_serves_runs_on_the_fallback_as_generate() -> None:
    config = GPT2Config(vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=256)
    loaded = _loaded(config)
    engine = Engine(loaded, num_blocks=32)
    assert engine.backend == "transformers"
    assert engine.fallback_reason is not None and "'gpt2' has no native forward" in engine.fallback_reason
    prompt = [5, 17, 99, 3, 250, 42, 7, 300, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]  # crosses a block boundary
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        want = loaded.model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24, min_new_tokens=24,
            pad_token_id=0,
        )[0, len(prompt):].tolist()
    assert Driver(engine).generate(1, prompt, 24) == want
