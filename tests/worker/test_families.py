"""Every native family (services/worker/models/) at random weights from a small config, against transformers on
the same weights (fp32): a batch of prompts of mixed lengths decoded together, a prefix reused across requests,
a fork, readouts equal to the fallback's, and two tensor-parallel ranks (gloo) equal to one, some of their
inputs steered (every rank adds the same deltas to its replicated residual stream)."""

from __future__ import annotations

import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM, Gemma3TextConfig, PretrainedConfig

from common.wire import SeqStep, Step, samples_by_seq
from services.worker.engine import Engine
from services.worker.kv_cache import PagedKVCache
from services.worker.layers.parallel import Shard
from services.worker.layers.steering import Term, combine
from services.worker.model_loader import LoadedModel
from services.worker.models import FAMILIES, family_of, unsupported_reason
from services.worker.models.tiny import tiny_configs
from services.worker.readouts import Readouts
from services.worker.runner import SeqInput
from tests.worker.conftest import GREEDY, Driver

CONFIGS = tiny_configs()
PROMPTS = [[5, 17, 99], [(7 * i + 3) % 512 for i in range(21)], [(11 * i + 1) % 512 for i in range(40)]]
TOKENS = 12


def test_every_family_is_tested_here() -> None:
    assert {config.model_type for config in CONFIGS.values()} == set(FAMILIES)


def test_a_configuration_its_family_refuses_says_why() -> None:
    embedding_gemma = Gemma3TextConfig.from_dict(CONFIGS["gemma3"].to_dict() | {"use_bidirectional_attention": True})
    assert "bidirectional attention" in unsupported_reason(embedding_gemma, 128)
    assert unsupported_reason(CONFIGS["gemma3"], 128) is None


def _model(config: PretrainedConfig) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # no end, nothing suppressed: the engine here knows no EOS either
    for name, param in model.named_parameters():  # norms away from 1, so a norm left out shows
        if "norm" in name:
            param.data.uniform_(0.5, 1.5)
    return model


def _loaded(model: torch.nn.Module) -> LoadedModel:
    return LoadedModel(model=model, config=model.config, name="tiny", device=torch.device("cpu"), dtype=torch.float32,
                       eos_token_ids=[], max_model_len=128)


def _generate(model: torch.nn.Module, prompt: list[int], n: int = TOKENS) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                             min_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=list(CONFIGS), ids=list(CONFIGS))
def family(request) -> tuple[torch.nn.Module, Engine]:
    model = _model(CONFIGS[request.param])
    engine = Engine(_loaded(model), num_blocks=64)
    assert engine.backend == "paged", request.param
    return model, engine


def test_a_batch_of_mixed_lengths_decodes_as_transformers_generates(family) -> None:
    model, engine = family
    driver = Driver(engine)
    first = driver.step([SeqStep(seq_id=10 + i, tokens=p, sampling=GREEDY) for i, p in enumerate(PROMPTS)])
    got = {10 + i: [first.samples[10 + i].token_id] for i in range(len(PROMPTS))}
    for _ in range(TOKENS - 1):
        ran = driver.step([], follows=list(got))
        for seq_id in got:
            got[seq_id].append(ran.samples[seq_id].token_id)
    engine.free(list(got))
    assert [got[10 + i] for i in range(len(PROMPTS))] == [_generate(model, p) for p in PROMPTS]


def test_a_reused_prefix_and_a_fork_go_on_as_transformers(family) -> None:
    model, engine = family
    driver = Driver(engine)
    shared = PROMPTS[2]
    assert driver.generate(20, shared, 2) == _generate(model, shared, 2)  # its full blocks are cached now
    prompt = shared[:32] + [1, 2, 3]
    first = driver.step([SeqStep(seq_id=21, tokens=prompt, sampling=GREEDY)])
    assert first.cached_tokens[21] == 32
    want = _generate(model, prompt)
    parent, fork = [first.samples[21].token_id], []
    ran = driver.step([SeqStep(seq_id=22, fork_of=21, tokens=[parent[-1]]), SeqStep(seq_id=21, tokens=[parent[-1]])])
    parent.append(ran.samples[21].token_id)
    fork.append(ran.samples[22].token_id)
    for _ in range(TOKENS - 2):
        ran = driver.step([], follows=[21, 22])
        parent.append(ran.samples[21].token_id)
        fork.append(ran.samples[22].token_id)
    engine.free([21, 22])
    assert parent == want and [want[0]] + fork == want  # greedy: the fork goes on as its parent does


def test_readouts_equal_the_fallbacks(family) -> None:
    model, _ = family
    hidden = model.config.hidden_size
    readouts = Readouts(concepts=["a", "b", "c"], layers=[0, 2], matrix=torch.randn(3, hidden, generator=torch.Generator().manual_seed(1)))
    prompt = PROMPTS[1]
    step = Step(step_id=1, seqs=[SeqStep(seq_id=1, tokens=prompt, sampling=GREEDY, readouts=[0, 9, len(prompt) - 1])])
    values, logprobs = [], []
    for native in (True, False):
        engine = Engine(_loaded(model), num_blocks=16, readouts=readouts, native=native)
        assert engine.backend == ("paged" if native else "transformers")
        result = engine.step(step)
        values.append([np.frombuffer(r.values, dtype="<f4") for r in result.readouts[1]])
        sampled = samples_by_seq(step, result)[1]
        assert sampled.token_id == _generate(model, prompt, 1)[0]
        logprobs.append(sampled.logprob)  # the logits themselves (a soft cap leaves the greedy tokens as they are)
    for native, fallback in zip(*values):
        np.testing.assert_allclose(native, fallback, rtol=1e-4, atol=1e-4)
    assert logprobs[0] == pytest.approx(logprobs[1], abs=1e-4)


def _forward(model: torch.nn.Module, shard: Shard | None) -> torch.Tensor:
    """The logits of a step of :data:`PROMPTS` (as prefills) and then of a decode step, on ``shard``; the first
    and last prompts steered (prompt and generated positions apart, the boundary inside the prompt)."""
    config = model.config
    heads = config.num_key_value_heads if shard is None else shard.num_kv_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    cache = PagedKVCache(num_layers=config.num_hidden_layers, num_kv_heads=heads, head_dim=head_dim, num_blocks=16,
                         dtype=torch.float32, device=torch.device("cpu"))
    runner = family_of(config).build(model, cache, 128, None, "torch", shard)
    for seq_id, prompt in enumerate(PROMPTS):
        cache.tables.reserve(seq_id, len(prompt) + 1)
    g = torch.Generator().manual_seed(2)
    hidden = config.hidden_size
    deltas = combine([Term({0: torch.randn(hidden, generator=g), 2: torch.randn(hidden, generator=g)}, 2.0, "prompt"),
                      Term({1: torch.randn(hidden, generator=g)}, -1.0, "all")], torch.float32)
    steer = {0: dict(steering=deltas, output_start=2), 2: dict(steering=deltas, output_start=30)}
    with torch.inference_mode():
        prefill = runner.forward([SeqInput(seq_id=i, tokens=p, start=0, logits=True, **steer.get(i, {}))
                                  for i, p in enumerate(PROMPTS)])
        decode = runner.forward([SeqInput(seq_id=i, tokens=[7], start=len(p), logits=True, **steer.get(i, {}))
                                 for i, p in enumerate(PROMPTS)])
    return torch.cat([prefill, decode])


def _rank(rank: int, port: int, out: str) -> None:
    """One of two ranks: every family's logits on this rank's shard (rank 0 saves them)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        logits = {}
        for name, config in CONFIGS.items():
            model = _model(config)
            logits[name] = _forward(model, Shard.plan(model.config, rank, 2))
        if rank == 0:
            torch.save(logits, out)
    finally:
        dist.destroy_process_group()


def test_two_tensor_parallel_ranks_give_one_ranks_logits(tmp_path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = str(tmp_path / "logits.pt")
    mp.spawn(_rank, args=(port, out), nprocs=2, join=True)  # (one pair of processes: each costs seconds to start)
    sharded = torch.load(out)
    for name, config in CONFIGS.items():
        torch.testing.assert_close(sharded[name], _forward(_model(config), None), rtol=1e-4, atol=1e-4, msg=name)
