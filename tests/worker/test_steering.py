"""Activation steering and residual capture in the worker (services/worker/steering.py, layers/steering.py).

The oracle is the transformers model on the same random weights (fp32) with a forward hook on
``model.model.layers[i]`` adding the same vectors at the same positions, run greedily with its cache: the
engine's greedy tokens must equal it for each position mode, two vectors together, a mixed batch of steered
and unsteered sequences, a change of steering mid-stream, forks, concepts, on torch's ops (Llama, Qwen3, a
sliding window), on the fused CPU ops with whole-layer decode calls, and on the fallback. Residuals equal
``output_hidden_states`` unsteered and the hooked model's layer outputs steered. Each bad steering fails its
sequence alone. Tensor parallel: tests/worker/test_families.py (its two-rank run steers some inputs).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.modeling_utils import PreTrainedModel

from common.steering import SteeringVector, encode, vector_id
from common.wire import SamplingParams, SeqStep, SteeringTerm
from services.worker.engine import Engine
from services.worker.model_loader import LoadedModel
from services.worker.models.tiny import tiny_configs
from services.worker.quantized import TiledLinears
from services.worker.readouts import Readouts
from tests.worker.conftest import Driver

CONFIGS = tiny_configs()
HIDDEN, LAYERS = 64, 3
LONG = [(7 * i + 3) % 512 for i in range(21)]  # a prefill
SHORT = [5, 17, 99, 4]  # decode rows
TOKENS = 6


def _model(name: str) -> PreTrainedModel:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[name], dtype=torch.float32).eval()
    for pname, param in model.named_parameters():
        if "norm" in pname:
            param.data.uniform_(0.5, 1.5)
    return model


def _loaded(model: PreTrainedModel, **kw) -> LoadedModel:
    return LoadedModel(model=model, config=model.config, name="tiny", device=torch.device("cpu"), dtype=torch.float32,
                       eos_token_ids=[], max_model_len=128, **kw)


def _vector(seed: int, layers: list[int], norm: float = 6.0, hidden: int = HIDDEN) -> tuple[str, bytes, SteeringVector]:
    rng = np.random.default_rng(seed)
    directions = {}
    for layer in layers:
        d = rng.standard_normal(hidden)
        directions[layer] = d / np.linalg.norm(d) * norm
    vector = SteeringVector.of(directions)
    data = encode(vector)
    return vector_id(data), data, vector


A = _vector(1, [0, 1])
B = _vector(2, [1, 2])
COVERS = {"all": lambda p, s: True, "prompt": lambda p, s: p < s, "generated": lambda p, s: p >= s}

# (vector, scale, layers, positions, from position, to position) as the oracle adds it
Added = list[tuple[SteeringVector, float, list[int], str, int, int]]
FOREVER = 1 << 30


def _term(vector: tuple[str, bytes, SteeringVector], scale: float = 1.0, layers: list[int] | None = None,
          positions: str = "all") -> SteeringTerm:
    return SteeringTerm(vector=vector[0], scale=scale, layers=layers or [], positions=positions)


def _added(terms: list[SteeringTerm], since: int = 0, until: int = FOREVER) -> Added:
    """What ``terms`` add at positions ``[since, until)``."""
    by_id = {v[0]: v[2] for v in (A, B)}
    return [(by_id[t.vector], t.scale, t.layers or by_id[t.vector].layers, t.positions, since, until) for t in terms]


def _oracle(model: PreTrainedModel, prompt: list[int], n: int, added: Added, output_start: int,
            record: dict[int, torch.Tensor] | None = None) -> list[int]:
    """Greedy tokens of ``model`` with hooks adding ``added`` after its layers (from each term's position on);
    ``record`` receives each layer's (steered) output over the prompt."""
    state = {"start": 0}

    def hook(index: int) -> Callable:
        def add(module, args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            positions = range(state["start"], state["start"] + hidden.shape[1])
            for vector, scale, layers, mode, since, until in added:
                if index in layers:
                    mask = torch.tensor([float(COVERS[mode](p, output_start) and since <= p < until) for p in positions])
                    hidden = hidden + mask[None, :, None] * (scale * torch.from_numpy(vector.directions[index]))
            if record is not None and state["start"] == 0:
                record[index] = hidden[0]
            return (hidden, *output[1:]) if isinstance(output, tuple) else hidden
        return add

    handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(model.model.layers)]
    try:
        cache, feed, out = DynamicCache(config=model.config), list(prompt), []
        with torch.inference_mode():
            for _ in range(n):
                start = state["start"]
                logits = model(torch.tensor([feed]), position_ids=torch.arange(start, start + len(feed)).unsqueeze(0),
                               cache=cache, use_cache=True).logits[0, -1]
                state["start"] += len(feed)
                feed = [int(logits.argmax())]
                out.append(feed[0])
    finally:
        for handle in handles:
            handle.remove()
    return out


def _run(engine: Engine, seqs: dict[int, tuple[list[int], list[SteeringTerm] | None, int]], n: int = TOKENS,
         change: dict[int, tuple[int, list[SteeringTerm]]] | None = None) -> dict[int, list[int]]:
    """Greedy tokens of sequences ``seq_id: (prompt, steering, output_start)`` decoded in one batch; ``change``:
    ``seq_id: (after how many tokens, new steering)``."""
    driver = Driver(engine)
    contents = {v[0]: v[1] for v in (A, B)}
    # each in a cache domain of its own, as the gateway puts differently steered requests: no KV shared
    first = driver.step([SeqStep(seq_id=i, tokens=p, sampling=SamplingParams(temperature=0, output_start=o),
                                 steering=st, vectors=contents if st else {}, cache_domain=f"d{i}")
                         for i, (p, st, o) in seqs.items()])
    assert not first.failures, first.failures
    got = {i: [first.samples[i].token_id] for i in seqs}
    for k in range(1, n):
        changed = [SeqStep(seq_id=i, tokens=[got[i][-1]], steering=terms, vectors=contents)
                   for i, (at, terms) in (change or {}).items() if at == k]
        ran = driver.step(changed, follows=[i for i in seqs if all(s.seq_id != i for s in changed)])
        assert not ran.failures, ran.failures
        for i in seqs:
            got[i].append(ran.samples[i].token_id)
    engine.free(list(seqs))
    return got


MIXED = {  # seq_id: (prompt, steering, output_start)
    1: (LONG, [_term(A, positions="prompt")], len(LONG)),
    2: (SHORT, [_term(A, 1.5, positions="generated")], len(SHORT)),
    3: (LONG, [_term(B, -1.0, [1], positions="all")], len(LONG)),
    4: (SHORT, [_term(A, positions="generated"), _term(B, positions="prompt")], len(SHORT) - 2),  # two vectors
    5: (LONG, None, len(LONG)),  # unsteered beside them
    6: (LONG, [_term(A, positions="generated")], len(LONG) - 5),  # the prompt's last 5 count as generated
}


def _check_mixed(engine: Engine, model: PreTrainedModel) -> None:
    got = _run(engine, MIXED)
    plain = {}
    for i, (prompt, terms, start) in MIXED.items():
        want = _oracle(model, prompt, TOKENS, _added(terms or []), start)
        assert got[i] == want, i
        plain[i] = _oracle(model, prompt, TOKENS, [], start)
    assert sum(got[i] != plain[i] for i in MIXED) >= 3  # the vectors are strong enough to change tokens


@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral-window"])
def test_a_mixed_batch_is_steered_as_hooked_transformers(name: str) -> None:
    model = _model(name)
    engine = Engine(_loaded(model), num_blocks=64)
    assert engine.backend == "paged"
    _check_mixed(engine, model)


def test_the_fused_cpu_ops_with_whole_layer_decode_calls_are_steered(gguf_kernel) -> None:
    model = _model("llama")
    engine = Engine(_loaded(model, linears=TiledLinears(), kernel=True), num_blocks=64)
    runner = engine.runner
    assert runner.kernels.ops is not None and all(layer.block_weights() is not None for layer in runner.layers)
    calls = []
    for layer in runner.layers:  # count the whole-layer calls: steering is added between them
        whole = layer.decode_whole
        layer.decode_whole = lambda *a, whole=whole: calls.append(1) or whole(*a)
    _check_mixed(engine, model)
    assert calls


def test_the_fallback_is_steered_as_hooked_transformers() -> None:
    model = _model("llama")
    engine = Engine(_loaded(model), num_blocks=64, native=False)
    assert engine.backend == "transformers"
    _check_mixed(engine, model)


@pytest.mark.parametrize("native", [True, False])
def test_a_change_mid_stream_and_forks(native: bool) -> None:
    model = _model("qwen3")
    engine = Engine(_loaded(model), num_blocks=64, native=native)
    steer = [_term(A, positions="all")]
    # steering cleared at the step of the 3rd token (its 2nd token fed), and one set at the 4th's
    got = _run(engine, {1: (LONG, steer, len(LONG)), 2: (SHORT, None, len(SHORT))},
               change={1: (2, []), 2: (3, [_term(B, positions="generated")])})
    assert got[1] == _oracle(model, LONG, TOKENS, _added(steer, until=len(LONG) + 1), len(LONG))
    assert got[2] == _oracle(model, SHORT, TOKENS, _added([_term(B, positions="generated")], len(SHORT) + 2), len(SHORT))
    # forks: one inherits its parent's steering, one clears it from its first fed token on
    driver = Driver(engine)
    first = driver.step([SeqStep(seq_id=10, tokens=LONG, sampling=SamplingParams(temperature=0, output_start=len(LONG)),
                                 steering=steer, vectors={A[0]: A[1]})])
    t = first.samples[10].token_id
    ran = driver.step([SeqStep(seq_id=11, fork_of=10, tokens=[t]), SeqStep(seq_id=12, fork_of=10, tokens=[t], steering=[]),
                       SeqStep(seq_id=10, tokens=[t], steering=steer)])
    # the fork whose steering changed names no more blocks (its KV from there is not its chain's); the others do
    assert engine.tables.sealed == {12}
    got = {i: [t, ran.samples[i].token_id] for i in (10, 11, 12)}
    for _ in range(TOKENS - 2):
        ran = driver.step([], follows=[10, 11, 12])
        for i in got:
            got[i].append(ran.samples[i].token_id)
    engine.free([10, 11, 12])
    want = _oracle(model, LONG, TOKENS, _added(steer), len(LONG))
    assert got[10] == got[11] == want
    assert got[12] == _oracle(model, LONG, TOKENS, _added(steer, until=len(LONG)), len(LONG))
    assert not engine.vectors.decoded  # no live sequence names A any more


def test_a_concept_steers_along_its_readout_row() -> None:
    model = _model("llama")
    matrix = torch.randn(2, HIDDEN, generator=torch.Generator().manual_seed(3))
    readouts = Readouts(concepts=["calm", "storm"], layers=[1, 2], matrix=matrix)
    engine = Engine(_loaded(model), num_blocks=64, readouts=readouts)
    terms = [SteeringTerm(vector="concept:storm", scale=8.0), SteeringTerm(vector="concept:calm", scale=-4.0, layers=[0])]
    got = _run(engine, {1: (LONG, terms, len(LONG))})
    unit = [(matrix[i] / matrix[i].norm()).numpy() for i in range(2)]
    concept = [SteeringVector.of({layer: u for layer in range(LAYERS)}) for u in unit]
    want = _oracle(model, LONG, TOKENS, [(concept[1], 8.0, [1, 2], "all", 0, FOREVER),
                                         (concept[0], -4.0, [0], "all", 0, FOREVER)], len(LONG))
    assert got[1] == want and want != _oracle(model, LONG, TOKENS, [], len(LONG))


@pytest.mark.parametrize("native", [True, False])
def test_residuals_equal_the_hidden_states_after_the_layers(native: bool) -> None:
    model = _model("llama")
    engine = Engine(_loaded(model), num_blocks=64, native=native)
    positions, layers = [0, 9, len(LONG) - 1], [1, 0]
    sampling = SamplingParams(temperature=0, output_start=len(LONG))
    with torch.inference_mode():
        hidden = model(torch.tensor([LONG]), output_hidden_states=True).hidden_states  # [i + 1]: after layer i
    recorded: dict[int, torch.Tensor] = {}
    steer = [_term(A, positions="all"), _term(B, 0.5, [2])]
    _oracle(model, LONG, 1, _added(steer), len(LONG), recorded)
    driver = Driver(engine)
    ran = driver.step([
        SeqStep(seq_id=1, tokens=LONG, sampling=sampling, residuals=positions, residual_layers=layers),
        SeqStep(seq_id=2, tokens=LONG, sampling=sampling, residuals=positions, residual_layers=[2, 0],
                steering=steer, vectors={A[0]: A[1], B[0]: B[1]}),
    ])
    engine.free([1, 2])
    assert not ran.failures
    for seq_id, want_layers, want in ((1, layers, lambda layer, p: hidden[layer + 1][0, p]),
                                      (2, [2, 0], lambda layer, p: recorded[layer][p])):
        results = ran.residuals[seq_id]
        assert [r.position for r in results] == positions
        for r in results:
            values = np.frombuffer(r.values, dtype="<f4").reshape(len(want_layers), HIDDEN)
            for j, layer in enumerate(want_layers):
                np.testing.assert_allclose(values[j], want(layer, r.position).numpy(), rtol=1e-4, atol=1e-4)


def test_each_bad_steering_fails_its_sequence_alone() -> None:
    model = _model("llama")
    engine = Engine(_loaded(model), num_blocks=64,
                    readouts=Readouts(concepts=["calm"], layers=[1], matrix=torch.ones(1, HIDDEN)))
    wide = _vector(4, [0], hidden=HIDDEN * 2)
    deep = _vector(5, [7])
    malformed = b"tiller-steering-v1\n" + b"\x00" * 5
    sampling = SamplingParams(temperature=0)

    def seq(seq_id: int, terms: list[SteeringTerm], vectors: dict[str, bytes] | None = None, **kw) -> SeqStep:
        return SeqStep(seq_id=seq_id, tokens=SHORT, sampling=sampling, steering=terms, vectors=vectors or {}, **kw)

    bad = {
        1: (seq(1, [_term(A)]), "is unknown to this worker and its content was not sent"),
        2: (seq(2, [_term(A, layers=[3])], {A[0]: A[1]}), "layer 3 is outside the model's 3 decoder layers"),
        3: (seq(3, [_term(deep)], {deep[0]: deep[1]}), "layer 7 is outside the model's 3 decoder layers"),
        4: (seq(4, [_term(wide)], {wide[0]: wide[1]}), f"has hidden size {2 * HIDDEN}, the model {HIDDEN}"),
        5: (seq(5, [SteeringTerm(vector="concept:storm", scale=1.0)]), "unknown concept (this worker's: calm)"),
        6: (seq(6, [SteeringTerm(vector=vector_id(malformed), scale=1.0)], {vector_id(malformed): malformed}),
            "not a canonical steering vector"),
        7: (seq(7, [_term(A)], {A[0]: B[1]}), f"the content sent has id {B[0]}"),
        8: (seq(8, [_term(A, layers=[2])], {A[0]: A[1]}), "has no direction for layer 2"),
    }
    driver = Driver(engine)
    good = SeqStep(seq_id=9, tokens=SHORT, sampling=sampling)
    ran = driver.step([s for s, _ in bad.values()] + [good])
    messages = {f.seq_id: f.message for f in ran.failures}
    assert set(messages) == set(bad)
    for seq_id, (_, expected) in bad.items():
        assert messages[seq_id].startswith(f"sequence {seq_id}: ") and expected in messages[seq_id], messages[seq_id]
    assert ran.samples[9].token_id == _oracle(model, SHORT, 1, [], len(SHORT))[0]
    assert set(engine.seqs) == {9} and not engine.vectors.decoded
    # a live sequence's vector serves the next one without its content; steering a live one that fails frees it
    ran = driver.step([seq(20, [_term(A)], {A[0]: A[1]})])
    ran = driver.step([seq(21, [_term(A)]), SeqStep(seq_id=9, tokens=[ran.samples[20].token_id], steering=[_term(B)])])
    assert [f.seq_id for f in ran.failures] == [9] and 21 in ran.samples
    engine.free([20, 21])
    assert not engine.vectors.decoded and not engine.seqs


class _Graphs:
    """Stands for the CUDA graphs (none on a CPU): it counts the decode steps it would replay."""

    def __init__(self, vocab: int) -> None:
        self.vocab, self.replays = vocab, 0

    def fits(self, inputs) -> bool:
        return all(len(item.tokens) == 1 for item in inputs)

    def run(self, inputs) -> torch.Tensor:
        self.replays += 1
        return torch.zeros(len(inputs), self.vocab)


def test_a_decode_step_with_a_steered_row_runs_eagerly() -> None:
    model = _model("llama")
    engine = Engine(_loaded(model), num_blocks=64)
    graphs = engine.runner.graphs = _Graphs(engine.vocab_size)
    seqs = {1: (SHORT, [_term(A, positions="generated")], len(SHORT)), 2: (LONG, None, len(LONG))}
    got = _run(engine, seqs)
    assert graphs.replays == 0
    assert got[1] == _oracle(model, SHORT, TOKENS, _added(seqs[1][1]), len(SHORT))
    assert got[2] == _oracle(model, LONG, TOKENS, [], len(LONG))
    _run(engine, {3: (SHORT, None, len(SHORT))}, n=3)  # unsteered decode steps replay
    assert graphs.replays == 2
