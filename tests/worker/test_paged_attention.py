"""The native forward over the paged KV cache against a dense forward of the same weights.

A tiny random Llama (grouped-query attention, 4-token blocks, so sequences span many blocks and
blocks land out of order in the pool) runs steps that mix what the engine mixes: fresh and
continued (chunked) prefills beside decodes, decode rows of different lengths (padded block
tables) and of one length, and forks that share their parent's blocks and copy the partial last
one on write. Every logits row must equal the dense model's last-position logits over the
sequence's whole history.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from services.worker.kv_cache import PagedKVCache
from services.worker.paged_llama import PagedLlama
from services.worker.runner import SeqInput

BLOCK = 4


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         rms_norm_eps=1e-5)
    return LlamaForCausalLM(config).eval()


class Paged:
    """What the engine does around the runner: block tables, copy-on-write, token histories."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        config = model.config
        self.cache = PagedKVCache(num_layers=config.num_hidden_layers, num_kv_heads=config.num_key_value_heads,
                                  head_dim=config.hidden_size // config.num_attention_heads, num_blocks=40,
                                  dtype=torch.float32, device=torch.device("cpu"), block_size=BLOCK)
        self.tables = self.cache.tables
        self.runner = PagedLlama(model, self.cache, config.max_position_embeddings)
        self.history: dict[int, list[int]] = {}

    def fork(self, parent: int, child: int) -> None:
        self.tables.fork(parent, child)
        self.history[child] = list(self.history[parent])

    def step(self, feeds: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Feed tokens to sequences in one step; the logits after each one's last token."""
        inputs = []
        for seq_id, tokens in feeds.items():
            history = self.history.setdefault(seq_id, [])
            self.tables.prepare_write(seq_id, len(history))
            self.tables.reserve(seq_id, len(history) + len(tokens))
            inputs.append(SeqInput(seq_id=seq_id, tokens=tokens, start=len(history), logits=True))
            history += tokens
        self.cache.copy_blocks(self.tables.take_copies())
        with torch.inference_mode():
            logits = self.runner.forward(inputs)
        return {item.seq_id: row for item, row in zip(inputs, logits)}


def _check(model: LlamaForCausalLM, paged: Paged, logits: dict[int, torch.Tensor]) -> None:
    for seq_id, row in logits.items():
        with torch.inference_mode():
            dense = model(torch.tensor([paged.history[seq_id]])).logits[0, -1]
        torch.testing.assert_close(row, dense, rtol=1e-4, atol=1e-4, msg=f"sequence {seq_id}")


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_mixed_steps_equal_the_dense_forward(model: LlamaForCausalLM) -> None:
    paged = Paged(model)
    _check(model, paged, paged.step({1: _tokens(11, 1), 2: _tokens(5, 2)}))  # two fresh prefills
    for i in range(3):  # rows of different lengths: padded block tables, masked keys
        _check(model, paged, paged.step({1: _tokens(1, 10 + i), 2: _tokens(1, 20 + i)}))
    _check(model, paged, paged.step({3: _tokens(6, 3), 1: _tokens(1, 30)}))  # a prefill beside a decode
    _check(model, paged, paged.step({3: _tokens(7, 4), 2: _tokens(1, 31)}))  # its second chunk: a continued prefill
    for i in range(5):
        _check(model, paged, paged.step({1: _tokens(1, 40 + i), 2: _tokens(1, 50 + i), 3: _tokens(1, 60 + i)}))


def test_forks_share_blocks_and_decode_apart(model: LlamaForCausalLM) -> None:
    paged = Paged(model)
    _check(model, paged, paged.step({1: _tokens(10, 5)}))  # ends inside its third block
    paged.fork(1, 2)
    paged.fork(1, 3)
    assert paged.tables.seqs[2] == paged.tables.seqs[1] == paged.tables.seqs[3]
    for i in range(6):  # each writes to its own copy of the partial block
        _check(model, paged, paged.step({s: _tokens(1, 100 * s + i) for s in (1, 2, 3)}))
    shared = set(paged.tables.seqs[1][:2])
    assert shared == set(paged.tables.seqs[2][:2]) == set(paged.tables.seqs[3][:2])
    assert len({paged.tables.seqs[s][2] for s in (1, 2, 3)}) == 3
    _check(model, paged, paged.step({2: _tokens(3, 7), 3: _tokens(1, 8)}))  # a fork's prefill beside a decode
