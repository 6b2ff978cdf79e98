"""Per-position outputs of the engine (Salience scoring and readouts) against transformers: prompt
logprobs across a chunk boundary, positions the prefix cache holds computed anyway, and readouts
from the default words and from a concepts file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from common.config import Sessions
from common.wire import SamplingParams, ScoreQuery, SeqStep, Step, samples_by_seq
from services.worker.engine import Engine
from services.worker.readouts import Readouts, default_layers

GREEDY = SamplingParams(temperature=0)
TEXT = "The quick brown fox jumps over the lazy dog, and then the dog chases the fox back into the woods again."


@pytest.fixture(scope="module")
def readouts(loaded, tokenizer) -> Readouts:
    return Readouts.build(Sessions(), num_layers=loaded.config.num_hidden_layers,
                          unembedding=loaded.model.get_output_embeddings().weight.detach(), tokenizer=tokenizer,
                          dtype=loaded.dtype)


@pytest.fixture(scope="module")
def scorer(loaded, readouts) -> Engine:
    return Engine(loaded, num_blocks=64, readouts=readouts)


@pytest.fixture(scope="module")
def reference(loaded, tokenizer):
    ids = tokenizer.encode(TEXT)
    with torch.inference_mode():
        out = loaded.model(torch.tensor([ids]), output_hidden_states=True)
    return ids, out


def scores(ids: list[int], positions: range) -> list[ScoreQuery]:
    return [ScoreQuery(q, ids[q + 1]) for q in positions if q + 1 < len(ids)]


def test_prompt_logprobs_across_chunks_and_cache_hits(scorer, reference) -> None:
    ids, out = reference
    n = len(ids)
    expected = out.logits[0].float().log_softmax(-1)
    cut = 17  # the second chunk's first position is scored by the first chunk's last row
    first = scorer.step(Step(step_id=1, seqs=[SeqStep(seq_id=1, tokens=ids[:cut], sample=False, sampling=GREEDY,
                                                      scores=scores(ids, range(0, cut)), top_logprobs=2)]))
    second = scorer.step(Step(step_id=2, seqs=[SeqStep(seq_id=1, tokens=ids[cut:], sample=False,
                                                       scores=scores(ids, range(cut, n)))]))
    got = first.scores[1] + second.scores[1]
    assert [s.position for s in got] == list(range(n - 1))
    for s in got:
        assert s.logprob == pytest.approx(expected[s.position, s.target].item(), abs=1e-3)
    assert [t.token_id for t in first.scores[1][5].top] == expected[5].topk(2).indices.tolist()

    # the same prompt again: its full blocks are cached, but a position asked about is computed
    again = scorer.step(Step(step_id=3, seqs=[SeqStep(seq_id=2, tokens=ids, sample=False, sampling=GREEDY,
                                                      scores=scores(ids, range(20, 22)))]))
    assert again.cached_tokens[2] == 16  # the first block only: position 20 is in the second
    assert [s.logprob for s in again.scores[2]] == pytest.approx(
        [expected[q, ids[q + 1]].item() for q in (20, 21)], abs=1e-3)
    scorer.free([1, 2])


def test_readouts_are_the_logit_lens(scorer, readouts, reference, loaded, tokenizer) -> None:
    ids, out = reference
    layers = default_layers(loaded.config.num_hidden_layers)
    assert readouts.layers == layers and layers[-1] == loaded.config.num_hidden_layers - 1
    step = Step(step_id=4, seqs=[SeqStep(seq_id=3, tokens=ids, sample=True, sampling=GREEDY, readouts=[0, 7, len(ids) - 1])])
    result = scorer.step(step)
    assert samples_by_seq(step, result)[3].token_id == out.logits[0, -1].argmax().item()  # sampling still works beside
    norm, last = loaded.model.model.norm, loaded.config.num_hidden_layers - 1
    with torch.inference_mode():
        for r in result.readouts[3]:
            got = np.frombuffer(r.values, dtype="<f4").reshape(len(layers), len(readouts.concepts))
            for i, layer in enumerate(layers):
                hidden = out.hidden_states[layer + 1][0, r.position]
                normed = hidden if layer == last else norm(hidden)
                np.testing.assert_allclose(got[i], (normed @ readouts.matrix.T).float().numpy(), atol=1e-3, rtol=1e-3)
    scorer.free([3])


def test_concepts_file_replaces_the_words(tmp_path: Path, loaded, tokenizer) -> None:
    hidden = loaded.config.hidden_size
    vectors = {"up": [1.0] * hidden, "first": [1.0] + [0.0] * (hidden - 1)}
    path = tmp_path / "concepts.json"
    path.write_text(json.dumps({"concepts": vectors}))
    unembedding = loaded.model.get_output_embeddings().weight.detach()
    built = Readouts.build(Sessions(concepts_file=path, readout_layers=[3, 1]), num_layers=30,
                           unembedding=unembedding, tokenizer=tokenizer, dtype=loaded.dtype)
    assert built.concepts == ["up", "first"] and built.layers == [1, 3]
    assert torch.equal(built.matrix.float(), torch.tensor([vectors["up"], vectors["first"]]))
    path.write_text(json.dumps({"concepts": {"short": [1.0, 2.0]}}))
    with pytest.raises(ValueError, match="must map names"):
        Readouts.build(Sessions(concepts_file=path), num_layers=30, unembedding=unembedding, tokenizer=tokenizer,
                          dtype=loaded.dtype)
    with pytest.raises(ValueError, match="outside"):
        Readouts.build(Sessions(readout_layers=[30]), num_layers=30, unembedding=unembedding, tokenizer=tokenizer,
                          dtype=loaded.dtype)


def test_bad_output_requests_fail_only_their_sequence(scorer, reference) -> None:
    ids, _ = reference
    result = scorer.step(Step(step_id=5, seqs=[
        SeqStep(seq_id=4, tokens=ids[:8], sample=False, sampling=GREEDY, scores=[ScoreQuery(9, 1)]),
        SeqStep(seq_id=5, tokens=ids[:8], sample=False, sampling=GREEDY, scores=[ScoreQuery(2, 10**7)]),
        SeqStep(seq_id=6, tokens=ids[:8], sample=False, sampling=GREEDY, scores=scores(ids, range(0, 8))),
    ]))
    failures = {f.seq_id: f.message for f in result.failures}
    assert "output positions must be among those fed" in failures[4] and "token ids" in failures[5]
    assert len(result.scores[6]) == 8
    scorer.free([6])


def test_pooled_final_states_across_chunks_and_cache_hits(scorer, reference, loaded) -> None:
    """``SeqStep.pool``: the sum of the final hidden states (after the final norm) of the positions a step feeds;
    a chunked prompt's sums add up to the whole prompt's, and a pooled position is computed even when the prefix
    cache holds it."""
    ids, _ = reference
    n, cut = len(ids), 17
    with torch.inference_mode():
        states = loaded.model.model(torch.tensor([ids])).last_hidden_state[0].float().numpy()
    first = scorer.step(Step(step_id=6, seqs=[SeqStep(seq_id=7, tokens=ids[:cut], sample=False, sampling=GREEDY,
                                                      pool=list(range(cut)))]))
    second = scorer.step(Step(step_id=7, seqs=[SeqStep(seq_id=7, tokens=ids[cut:], sample=False,
                                                       pool=list(range(cut, n)))]))
    total = np.frombuffer(first.pooled[7], dtype="<f4") + np.frombuffer(second.pooled[7], dtype="<f4")
    np.testing.assert_allclose(total / n, states.mean(0), atol=1e-4, rtol=1e-4)

    again = scorer.step(Step(step_id=8, seqs=[SeqStep(seq_id=8, tokens=ids, sample=False, sampling=GREEDY,
                                                      pool=[n - 1])]))
    assert again.cached_tokens[8] == (n - 1) // 16 * 16  # every full block before the pooled position
    np.testing.assert_allclose(np.frombuffer(again.pooled[8], dtype="<f4"), states[-1], atol=1e-4, rtol=1e-4)

    bad = scorer.step(Step(step_id=9, seqs=[SeqStep(seq_id=9, tokens=ids[:8], sample=False, sampling=GREEDY,
                                                    pool=[3, 3])]))
    assert "pooled positions must differ" in bad.failures[0].message and not bad.pooled
    scorer.free([7, 8])
