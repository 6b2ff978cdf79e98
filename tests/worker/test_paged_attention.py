"""The native forward over the paged KV cache against a dense forward of the same weights.

A tiny random Llama (grouped-query attention, 4-token blocks, so sequences span many blocks and
blocks land out of order in the pool) runs steps that mix what the engine mixes: fresh and
continued (chunked) prefills beside decodes, short inputs (a controller's splice, a short prompt)
that run as decode rows, one per token, decode rows of different lengths (padded block tables) and
of one length, and forks that share their parent's blocks and copy the partial last one on write.
Every logits row must equal the dense model's last-position logits over the sequence's whole
history: on torch's ops, on the kernel library's fused ops (norms, rotation with the KV write,
decode attention reading the blocks in place), and on the same ops as Triton kernels (in Triton's
interpreter on a CPU: see conftest.py).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from services.worker.gguf_blocks import GROUP, Blocks
from services.worker.gguf_linear import BlockLinear
from services.worker.kv_cache import PagedKVCache
from services.worker.layers.plan import DECODE_ROWS_MAX
from services.worker.models import llama
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

    def __init__(self, model: LlamaForCausalLM, kernels: str) -> None:
        config = model.config
        self.cache = PagedKVCache(num_layers=config.num_hidden_layers, num_kv_heads=config.num_key_value_heads,
                                  head_dim=config.hidden_size // config.num_attention_heads, num_blocks=40,
                                  dtype=torch.float32, device=torch.device("cpu"), block_size=BLOCK)
        self.tables = self.cache.tables
        self.runner = llama.build(model, self.cache, config.max_position_embeddings, kernels=kernels)
        assert (self.runner.kernels.ops is not None) == (kernels != "torch")
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


@pytest.fixture(params=["torch", "library", "triton"])
def kernels(request) -> str:
    if request.param == "library":
        request.getfixturevalue("gguf_kernel")
    return request.param


def test_mixed_steps_equal_the_dense_forward(model: LlamaForCausalLM, kernels: str) -> None:
    paged = Paged(model, kernels)
    long = DECODE_ROWS_MAX + 1  # the shortest input that runs as a prefill; shorter ones run as decode rows
    _check(model, paged, paged.step({1: _tokens(long + 4, 1), 2: _tokens(5, 2)}))  # a fresh prefill, a short prompt
    for i in range(3):  # rows of different lengths: padded block tables, masked keys
        _check(model, paged, paged.step({1: _tokens(1, 10 + i), 2: _tokens(1, 20 + i)}))
    _check(model, paged, paged.step({3: _tokens(long, 3), 1: _tokens(1, 30)}))  # a prefill beside a decode
    # its second chunk (a continued prefill) beside a decode and a splice (decode rows of one sequence)
    _check(model, paged, paged.step({3: _tokens(long + 2, 4), 2: _tokens(1, 31), 1: _tokens(4, 32)}))
    _check(model, paged, paged.step({2: _tokens(DECODE_ROWS_MAX, 33), 3: _tokens(1, 34)}))  # the longest splice
    for i in range(5):
        _check(model, paged, paged.step({1: _tokens(1, 40 + i), 2: _tokens(1, 50 + i), 3: _tokens(1, 60 + i)}))


def test_forks_share_blocks_and_decode_apart(model: LlamaForCausalLM, kernels: str) -> None:
    paged = Paged(model, kernels)
    _check(model, paged, paged.step({1: _tokens(10, 5)}))  # ends inside its third block
    paged.fork(1, 2)
    paged.fork(1, 3)
    assert paged.tables.seqs[2] == paged.tables.seqs[1] == paged.tables.seqs[3]
    for i in range(6):  # each writes to its own copy of the partial block
        _check(model, paged, paged.step({s: _tokens(1, 100 * s + i) for s in (1, 2, 3)}))
    shared = set(paged.tables.seqs[1][:2])
    assert shared == set(paged.tables.seqs[2][:2]) == set(paged.tables.seqs[3][:2])
    assert len({paged.tables.seqs[s][2] for s in (1, 2, 3)}) == 3
    _check(model, paged, paged.step({2: _tokens(3, 7), 3: _tokens(1, 8)}))  # a fork's splice beside a decode


def _q8_layer(modules: list[torch.nn.Linear]) -> BlockLinear:
    """``modules`` side by side as one Q8_0 block layer (their weights rounded to 8 bits)."""
    weight = torch.cat([m.weight.detach() for m in modules])
    scale = (weight.view(weight.shape[0], -1, GROUP).abs().amax(-1) / 127).half().float().clamp_min(2**-14)
    q = (weight.view(weight.shape[0], -1, GROUP) / scale.unsqueeze(-1)).round().clamp(-128, 127).to(torch.int8)
    return BlockLinear.of(Blocks("Q8_0", q.view_as(weight), scale, None), None)


def test_whole_decode_layers_equal_the_fused_ops_one_by_one(model: LlamaForCausalLM, gguf_kernel) -> None:
    """On GGUF block weights a step of decode rows only (single tokens and short inputs) runs each layer as
    one call (``decode_layer``): the same ops composed in C++, so the same logits to the bit; a step with a
    prefill goes op by op."""
    runs = []
    for whole in (True, False):
        paged = Paged(model, "library")
        for layer, source in zip(paged.runner.layers, model.model.layers):
            attn, mlp = source.self_attn, source.mlp
            layer.qkv, layer.o = _q8_layer([attn.q_proj, attn.k_proj, attn.v_proj]), _q8_layer([attn.o_proj])
            layer.mlp.gate_up, layer.mlp.down = _q8_layer([mlp.gate_proj, mlp.up_proj]), _q8_layer([mlp.down_proj])
            assert layer.block_weights() is not None
        kernels = paged.runner.kernels
        kernels.whole_layers = whole
        calls = []
        assert kernels.ops is not None
        layer_op = kernels.ops.decode_layer
        kernels.ops = dataclasses.replace(kernels.ops, decode_layer=lambda *a: calls.append(1) or layer_op(*a))
        steps = [paged.step({1: _tokens(DECODE_ROWS_MAX + 3, 1), 2: _tokens(3, 2)})]  # a prefill: op by op
        paged.fork(1, 3)
        steps += [paged.step({s: _tokens(1, 10 * s + i) for s in (1, 2, 3)}) for i in range(6)]
        steps.append(paged.step({4: _tokens(5, 4), 1: _tokens(1, 5)}))  # a short input: decode rows
        steps.append(paged.step({5: _tokens(DECODE_ROWS_MAX + 1, 6), 2: _tokens(1, 7)}))  # mixed: op by op
        runs.append(steps)
        assert len(calls) == (7 * model.config.num_hidden_layers if whole else 0)
    for whole_step, op_step in zip(*runs):
        for seq_id, row in whole_step.items():
            assert torch.equal(row, op_step[seq_id]), seq_id
