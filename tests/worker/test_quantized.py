"""Weight-only quantized projections (services/worker/quantized.py) on the default model's GGUF.

The dense model the other worker tests run was converted from this same GGUF, so it is the
reference: its weights are the GGUF's blocks dequantized. The packed layers must hold those blocks
exactly, compute what a matmul over the dequantized weights computes (torch's packed kernels within
bfloat16 rounding: they take bfloat16 activations; Tiller's own kernel within float32 rounding, see
test_gguf_kernel.py), and the quantized engine must decode greedily what the dense engine decodes. Where two greedy outputs part, the test reports the dense model's top-2
logit gap there: a near-tie is shown, never skipped.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from services.worker.engine import Engine
from services.worker.gguf_blocks import Blocks
from services.worker.gguf_linear import BlockLinear
from services.worker.model_loader import load_model
from services.worker.quantized import (
    GgufLinears,
    Int4Packed,
    Int8Linears,
    Int8Packed,
    TiledLinears,
    bf16_parts,
    weights_mode,
)
from tests.worker.conftest import Driver

NEW_TOKENS = 32
# logits: a parting where the dense model's top two are closer than this is a near-tie, reported. Tiller's
# kernel ('gguf') differs from the dense model by float32 rounding only; torch's exact packing
# ('gguf-int4pack', what 'gguf' falls back to) by bfloat16 activations (8 significant bits: about 0.06 on
# a logit of 15; measured: a parting at a gap of 0.052); rounding the scales too (gguf-bf16) moves logits
# further (measured: a parting at a gap of 0.13).
NEAR_TIE = {"gguf": 0.01, "gguf-int4pack": 0.1, "gguf-bf16": 0.25}
BF16_ROUNDING = 2.0**-8  # relative: a bfloat16 output (8 significant bits) is within half a unit of this


def test_the_gguf_blocks_are_the_dense_models_weights(blocks, loaded) -> None:
    params = dict(loaded.model.named_parameters(remove_duplicate=False))
    kinds = {b.kind for b in blocks.values()}
    assert kinds == {"Q4_1", "Q8_0"} and len(blocks) == 30 * 7 + 1
    for name, b in blocks.items():
        assert torch.equal(b.dequantize(), params[name].detach()), name


def test_two_bfloat16_parts_hold_every_scale_and_zero_exactly(blocks) -> None:
    for name, b in blocks.items():
        zero = b.minimum + 8 * b.scale if b.minimum is not None else 8 * b.scale
        for values in (b.scale, 16 * b.scale, zero):
            hi, lo = bf16_parts(values, 2)
            assert torch.equal(hi.float() + lo.float(), values), name
        one = bf16_parts(b.scale, 1)[0].float()
        assert not torch.equal(one, b.scale)  # one part alone rounds (gguf-bf16)


def _q4_0(b: Blocks) -> Blocks:
    """A Q4_0 matrix from real codes and scales (the default model ships none)."""
    return Blocks("Q4_0", b.q, b.scale, None)


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.q_proj.weight", "model.layers.7.mlp.down_proj.weight",
                                  "model.embed_tokens.weight", "q4_0"])
def test_a_packed_linear_equals_a_matmul_over_the_dequantized_weights(blocks, name: str) -> None:
    b = _q4_0(blocks["model.layers.1.mlp.up_proj.weight"]) if name == "q4_0" else blocks[name]
    weight = b.dequantize()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, weight.shape[1], generator=g)
    bias = torch.randn(weight.shape[0], generator=g)
    residual = torch.randn(5, weight.shape[0], generator=g)
    reference = x.bfloat16().float() @ weight.t() + bias  # the kernel's inputs are bfloat16
    scale = reference.abs().max()
    layer = Int4Packed.of(b, bias, parts=2)
    assert (layer(x) - reference).abs().max() <= BF16_ROUNDING * scale
    assert (layer.add_to(residual, x) - residual - reference).abs().max() <= 2 * BF16_ROUNDING * scale
    # one bfloat16 part per scale: the weights themselves off by up to 2^-9, still close, not as close
    rounded = Int4Packed.of(b, bias, parts=1)
    assert (rounded(x) - reference).abs().max() <= 4 * BF16_ROUNDING * scale
    assert (layer(x) - reference).abs().max() < (rounded(x) - reference).abs().max()
    assert (layer(x) - x @ weight.t() - bias).abs().max() > 0  # bfloat16 activations: not float32 math


def test_int8_rows_equal_a_matmul_over_their_own_dequantized_weights(loaded) -> None:
    weight = loaded.model.model.layers[3].mlp.gate_proj.weight.detach()
    layer = Int8Packed(weight, None)
    own = layer.codes.float() * layer.scales.float()[:, None]
    assert (own - weight).abs().max() <= layer.scales.float().max() / 2 * 1.01  # rounded to the nearest step
    x = torch.randn(4, weight.shape[1], generator=torch.Generator().manual_seed(1))
    reference = x.bfloat16().float() @ own.t()
    assert (layer(x) - reference).abs().max() <= BF16_ROUNDING * reference.abs().max()


def test_weights_setting_resolution() -> None:
    assert weights_mode("auto", "cpu", has_gguf=True, pretrained=True) == "gguf-bf16"  # no kernel library
    assert weights_mode("auto", "cpu", has_gguf=True, pretrained=True, kernel=lambda: True) == "gguf"
    assert weights_mode("auto", "cpu", has_gguf=True, pretrained=True, sharded=True, kernel=lambda: True) == "fp32"
    assert weights_mode("auto", "cpu", has_gguf=False, pretrained=True) == "fp32"
    assert weights_mode("auto", "cpu", has_gguf=True, pretrained=False) == "fp32"  # random:smollm2
    assert weights_mode("auto", "cuda", has_gguf=True, pretrained=True) == "fp32"
    assert weights_mode("int8", "cpu", has_gguf=False, pretrained=True) == "int8"
    with pytest.raises(ValueError, match="packed CPU kernels"):
        weights_mode("gguf", "cuda", has_gguf=True, pretrained=True)
    with pytest.raises(ValueError, match="shipped as a GGUF"):
        weights_mode("gguf", "cpu", has_gguf=False, pretrained=True)


def _top2_gap(model, ids: list[int]) -> float:
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, -1]
    top = logits.topk(2).values
    return float(top[0] - top[1])


def _gguf_linears(mode: str, loaded, blocks) -> GgufLinears:
    """The GGUF's blocks over ``loaded``'s model: 'gguf' on Tiller's kernel, 'gguf-int4pack' and
    'gguf-bf16' on torch's packed kernel (exact, and with scales rounded)."""
    return GgufLinears(loaded.model, blocks, 1 if mode == "gguf-bf16" else 2, kernel=mode == "gguf")


@pytest.mark.parametrize("mode", ["gguf", "gguf-int4pack", "gguf-bf16"])
def test_the_quantized_engine_decodes_greedily_as_the_dense_model(mode, loaded, blocks, engine, prompts,
                                                                   gguf_kernel) -> None:
    packed = dataclasses.replace(loaded, weights=mode, linears=_gguf_linears(mode, loaded, blocks),
                                 kernel=mode == "gguf")
    quantized = Driver(Engine(packed, num_blocks=64))
    dense = Driver(engine)
    for i, prompt in enumerate(prompts):
        want = dense.generate(300 + i, prompt, NEW_TOKENS)
        got = quantized.generate(i, prompt, NEW_TOKENS)
        if got == want:
            continue
        at = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)
        gap = _top2_gap(loaded.model, prompt + want[:at])
        message = f"{mode}: prompt {i} parts from the dense model at token {at} where its top-2 logit gap is {gap:.4f}"
        assert gap < NEAR_TIE[mode], message
        warnings.warn(message, stacklevel=1)


@pytest.mark.parametrize("mode", ["gguf", "gguf-bf16", "int8", "fp32"])
def test_a_quantized_worker_keeps_no_dense_copy_of_what_it_packed(mode, worker_settings, loaded, blocks, prompts,
                                                                  gguf_kernel) -> None:
    """The loader's quantized model, once its engine is built, holds dense storage only for what the
    packed layers do not replace (the token embedding and the norms), and decodes as a packed engine
    over a model that kept its dense weights. 'fp32' on Tiller's kernel packs the dense weights
    into its tiles the same way."""
    released = load_model(worker_settings.model_copy(update={"weights": mode}), lambda progress, message: None)
    assert released.weights == mode
    quantized = Driver(Engine(released, num_blocks=64))
    embedding = released.model.get_input_embeddings().weight  # tied to the output projection: kept
    projections = [m for m in released.model.modules() if isinstance(m, torch.nn.Linear) and m.weight is not embedding]
    assert len(projections) == 7 * loaded.config.num_hidden_layers
    assert all(m.weight.device.type == "meta" for m in projections)
    if mode.startswith("gguf"):
        assert isinstance(released.linears, GgufLinears) and not released.linears.blocks  # the codes, packed, let go
        assert released.linears.layout is (BlockLinear if mode == "gguf" else Int4Packed)
    dense = sum(p.numel() * p.element_size() for p in released.model.parameters() if p.device.type != "meta")
    layers = loaded.config.num_hidden_layers
    norms = (2 * layers + 1) * loaded.config.hidden_size * 4
    assert embedding.device.type == "cpu" and dense <= embedding.numel() * embedding.element_size() + norms
    if mode == "fp32":
        assert isinstance(released.linears, TiledLinears) and released.kernel
    kept = {"int8": Int8Linears(), "fp32": TiledLinears()}.get(mode) or _gguf_linears(mode, loaded, blocks)
    kept_model = dataclasses.replace(loaded, weights=mode, linears=kept, kernel=mode in ("gguf", "fp32"))
    reference = Driver(Engine(kept_model, num_blocks=64))
    assert quantized.generate(0, prompts[0], 8) == reference.generate(1, prompts[0], 8)
