"""Worker test fixtures: the real default model, loaded once per session, and a step driver."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from common.config import Settings
from common.model_source import load_tokenizer, resolve_model
from common.wire import SampledToken, SamplingParams, SeqStep, Step, StepResult, pack_ids, samples_by_seq
from services.worker import kernel_build
from services.worker.engine import Engine
from services.worker.gguf_blocks import Blocks, read_blocks
from services.worker.model_loader import LoadedModel, load_model

GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="session")
def worker_settings() -> Settings:
    return Settings(device="cpu", weights="fp32")  # dense: what transformers, the oracle, runs


@pytest.fixture(scope="session")
def loaded(worker_settings: Settings) -> LoadedModel:
    return load_model(worker_settings, lambda progress, message: None, keep_dense=True)  # transformers runs it too


@pytest.fixture(scope="session")
def gguf_kernel(worker_settings: Settings) -> None:
    """Tiller's GGUF block kernel, built into the settings' cache (once per machine, ~20 s); its tests skip on a
    CPU with neither AVX-512 nor AVX2, where the worker serves torch's int4 kernel instead."""
    if not kernel_build.cpu_supported():
        pytest.skip("this CPU has neither AVX-512 nor AVX2 with FMA and F16C: Tiller's GGUF kernel is not built here")
    assert kernel_build.load(worker_settings.cache_dir), "the kernel did not build: see the worker.kernel_unavailable log"


@pytest.fixture(scope="session")
def blocks(worker_settings: Settings, loaded: LoadedModel) -> dict[str, Blocks]:
    """The default model's GGUF blocks, by transformers' parameter name."""
    gguf = resolve_model(worker_settings).gguf
    assert gguf is not None
    return read_blocks(gguf, loaded.config.num_attention_heads, loaded.config.num_key_value_heads)


@pytest.fixture(scope="session")
def tokenizer(worker_settings: Settings):
    return load_tokenizer(worker_settings)


@pytest.fixture(scope="session")
def prompts(tokenizer) -> list[list[int]]:
    """The greedy-parity prompts: plain text, code, and a chat turn."""
    chat = [{"role": "user", "content": "Explain in a few sentences why the sky is blue."}]
    return [
        tokenizer("The quick brown fox").input_ids,
        tokenizer("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n").input_ids,
        tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=False),
    ]


@pytest.fixture(scope="session")
def engine(loaded: LoadedModel) -> Engine:
    """A shared engine (tests use distinct sequence ids and free what they start)."""
    return Engine(loaded, num_blocks=256)


@pytest.fixture(scope="session")
def reference(loaded: LoadedModel) -> Callable[[list[int], int], list[int]]:
    """greedy(prompt, n): what transformers' generate(do_sample=False) produces after ``prompt``."""

    def greedy(prompt: list[int], max_new_tokens: int) -> list[int]:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = loaded.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=loaded.eos_token_ids[0],
            )
        return out[0, len(prompt) :].tolist()

    return greedy


@dataclass
class Ran:
    """A step's result, with its sampled tokens by sequence (the result carries them in slot order)."""

    result: StepResult
    samples: dict[int, SampledToken]

    def __getattr__(self, name: str) -> object:
        return getattr(self.result, name)


def ran(step: Step, result: StepResult) -> Ran:
    return Ran(result, samples_by_seq(step, result))


class Driver:
    """Feeds an engine step by step."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.step_id = 0

    def step(self, seqs: list[SeqStep], free: list[int] | None = None, mask: bytes | None = None,
             follows: list[int] | None = None) -> Ran:
        self.step_id += 1
        step = Step(step_id=self.step_id, seqs=seqs, free=free or [], follows=pack_ids(follows or []))
        return ran(step, self.engine.step(step, mask))

    def generate(self, seq_id: int, prompt: list[int], n: int, sampling: SamplingParams = GREEDY) -> list[int]:
        """Feed ``prompt`` whole, then decode ``n`` tokens in all; frees the sequence after."""
        result = self.step([SeqStep(seq_id=seq_id, tokens=prompt, sampling=sampling)])
        assert not result.failures, result.failures
        tokens = [result.samples[seq_id].token_id]
        while len(tokens) < n:
            result = self.step([SeqStep(seq_id=seq_id, tokens=[tokens[-1]])])
            assert not result.failures, result.failures
            tokens.append(result.samples[seq_id].token_id)
        self.engine.free([seq_id])
        return tokens


ORACLE_PROMPTS = ([5, 17, 99, 3, 250, 42, 7, 300, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [1000, 2000, 3])


def assert_greedy_as_transformers(engine: Engine, oracle: torch.nn.Module, n: int) -> None:
    """``engine``'s greedy tokens after each of :data:`ORACLE_PROMPTS` (a long one and a short one) equal
    ``oracle``'s (a transformers model on the same weights): exactly ``n`` tokens each."""
    for prompt in ORACLE_PROMPTS:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            want = oracle.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                                   min_new_tokens=n, pad_token_id=0)[0, len(prompt):].tolist()
        assert Driver(engine).generate(hash(tuple(prompt)) % 1000, prompt, n) == want, prompt


@pytest.fixture
def driver(engine: Engine) -> Driver:
    return Driver(engine)
