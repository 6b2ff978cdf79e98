"""Shared fixtures: one real Tiller stack per test session, and the transformers oracle."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Tiller's Triton kernels (services/worker/triton_ops.py) then run on CPU tensors in Triton's interpreter;
    # it must be on before Triton is first imported (transformers' model modules import it)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from common.config import Settings
from common.model_source import load_tokenizer, resolve_model
from controllers import build
from tests.stack import Stack, start_stack


@pytest.fixture(scope="session")
def have_clang() -> str:
    """The clang driver for the tests that compile Wasm controllers; they skip without clang + wasm-ld
    (`make test` installs them where it can: deploy/ensure_toolchain.sh)."""
    cc = build.clang()
    if cc is None:
        pytest.skip("clang and wasm-ld are not installed (Debian: apt-get install clang lld; `make test` "
                    "installs them when run as root or with passwordless sudo)")
    return cc


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Stack:
    """The five real processes on the default model, on free ports, in a temporary run directory."""
    started = start_stack(tmp_path_factory.mktemp("stack"))
    started.tokenizer = load_tokenizer(started.settings)
    yield started
    started.down()


@pytest.fixture(scope="session")
def hf_model():
    """The default model loaded by plain transformers: the oracle for greedy decoding."""
    import torch
    from transformers import AutoModelForCausalLM

    source = resolve_model(Settings(), weights=True)
    model = AutoModelForCausalLM.from_pretrained(source.directory, dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="session")
def hf_greedy(hf_model):
    """greedy(prompt_ids, n) -> the n token ids transformers generates greedily after prompt_ids."""
    import torch

    def greedy(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        with torch.inference_mode():
            out = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False)
        return out[0, len(prompt_ids):].tolist()

    return greedy
