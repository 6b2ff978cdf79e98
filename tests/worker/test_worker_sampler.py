"""The sampler against transformers' logits processors, on synthetic logits (no model needed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TopKLogitsWarper, TopPLogitsWarper

from common.wire import SamplingParams
from services.worker.sampler import (
    TOP_P_CANDIDATES,
    SeqSampler,
    _argmax,
    _draw,
    _warp,
    mask_allows_any,
    mask_bias,
    masked_scores,
    sample,
    validate_params,
)

VOCAB = 1000


def _sampler(**kw) -> SeqSampler:
    return SeqSampler(SamplingParams(**kw))


def _packed(allowed: np.ndarray) -> np.ndarray:
    padded = np.zeros((allowed.shape[0], -(-VOCAB // 32) * 32), dtype=np.uint8)
    padded[:, :VOCAB] = allowed
    return np.packbits(padded, axis=1, bitorder="little").view("<u4").view(np.int32)


def test_mask_bias_matches_bit_layout() -> None:
    rng = np.random.default_rng(0)
    allowed = rng.random((3, VOCAB)) < 0.3
    got = mask_bias(torch.from_numpy(_packed(allowed).copy()), VOCAB)
    assert got.shape == (3, VOCAB)
    assert torch.equal(got == 0, torch.from_numpy(allowed))
    assert bool(torch.isneginf(got[torch.from_numpy(~allowed)]).all())


def _reference_bias(words: np.ndarray, vocab: int) -> torch.Tensor:
    """The bias a bit-by-bit reading of the packed rows gives (0 allowed, -inf not)."""
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)
    return torch.from_numpy(np.where(bits, np.float32(0), np.float32("-inf")))


def _edge_rows(vocab: int, rng: np.random.Generator) -> np.ndarray:
    """Random rows, then an all-zero row, an all-ones row, and a row with only bit 31 of each word
    set (the sign bit, which arithmetic on int32 words must not smear)."""
    words = rng.integers(-(2**31), 2**31, size=(6, -(-vocab // 32)), dtype=np.int64).astype(np.int32)
    words[3], words[4], words[5] = 0, -1, np.int32(-(2**31))
    return words


@pytest.mark.parametrize("vocab", [VOCAB, 1024, 31, 33, 49152])
def test_mask_bias_equals_a_bitwise_reading(vocab: int) -> None:
    words = _edge_rows(vocab, np.random.default_rng(vocab))
    got = mask_bias(torch.from_numpy(words), vocab)
    assert got.dtype == torch.float32 and got.shape == (6, vocab)
    assert torch.equal(got, _reference_bias(words, vocab))
    assert bool(torch.isneginf(got[3]).all()) and bool((got[4] == 0).all())


@pytest.mark.parametrize("vocab", [VOCAB, 1024, 31, 33, 49152])
def test_the_kernels_masked_scores_are_the_logits_where_allowed_and_minus_inf_elsewhere(gguf_kernel, vocab) -> None:
    """The kernel library's one-pass op (which masked_scores takes once the library is loaded), on logits
    whose rows are strided (a slice of wider rows), with a NaN where a token is not allowed (-inf, where
    the additive bias keeps the NaN) and where one is (kept)."""
    rng = np.random.default_rng(vocab)
    words = _edge_rows(vocab, rng)
    allowed = _reference_bias(words, vocab) == 0
    logits = torch.randn(6, vocab + 7, generator=torch.Generator().manual_seed(vocab))[:, :vocab]
    logits[0, int(np.flatnonzero(~allowed[0].numpy())[0])] = float("nan")
    logits[4, vocab // 2] = float("nan")
    want = torch.where(allowed, logits, torch.tensor(float("-inf")))
    for got in (torch.ops.tiller_gguf.masked_scores(logits, torch.from_numpy(words)),
                masked_scores(logits, torch.from_numpy(words), vocab)):
        assert got.shape == (6, vocab) and got.is_contiguous()
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)) and bool(got[4, vocab // 2].isnan())
    kept = ~torch.isnan(logits[1:])  # no NaN there: the same as the additive bias
    assert torch.equal(masked_scores(logits, torch.from_numpy(words), vocab)[1:][kept],
                       (logits + mask_bias(torch.from_numpy(words), vocab))[1:][kept])
    # logits the op does not take (another dtype, strided columns) get the additive bias
    clean = logits.nan_to_num(0.0)
    for other in (clean.to(torch.bfloat16), torch.stack([clean, clean], dim=-1)[..., 0]):
        assert torch.equal(masked_scores(other, torch.from_numpy(words), vocab),
                           other + mask_bias(torch.from_numpy(words), vocab))


def test_the_kernels_masked_scores_refuse_words_of_another_shape(gguf_kernel) -> None:
    logits, words = torch.randn(2, 64), torch.zeros(2, 2, dtype=torch.int32)
    for bad in (words[:, :1].contiguous(), words[:1], words.long(), torch.zeros(2, 4, dtype=torch.int32)[:, ::2]):
        with pytest.raises(RuntimeError, match="words must be contiguous int32"):
            torch.ops.tiller_gguf.masked_scores(logits, bad)
    with pytest.raises(RuntimeError, match="logits must be float32"):
        torch.ops.tiller_gguf.masked_scores(logits.double(), words)


@pytest.mark.parametrize("vocab", [VOCAB, 1024, 31, 33])
def test_mask_allows_any_equals_a_bitwise_reading(vocab: int) -> None:
    words = _edge_rows(vocab, np.random.default_rng(vocab))
    words[0] = 0
    words[0, -1] = np.array(1 << (vocab - 1) % 32, dtype=np.uint32).view(np.int32)  # only the last token
    want = (_reference_bias(words, vocab) == 0).any(-1).numpy()
    assert mask_allows_any(words, vocab).tolist() == want.tolist()
    assert want[0] and not want[3]


def test_mask_allows_any_ignores_bits_past_the_vocabulary() -> None:
    allowed = np.zeros((3, VOCAB), dtype=bool)
    allowed[1, VOCAB - 1] = True
    words = _packed(allowed)
    words[2, -1] |= np.int32(-(1 << 31))  # bit 31, past the vocabulary (VOCAB is not a multiple of 32)
    assert mask_allows_any(words, VOCAB).tolist() == [False, True, False]


def test_greedy_argmax_follows_torchs_rule() -> None:
    """The first of tied maxima, a NaN as the maximum, an all -inf row at 0; strided rows too."""
    logits = torch.randn(6, VOCAB)
    logits[1, [5, 700]] = 50.0
    logits[2, 300] = float("nan")
    logits[3] = float("-inf")
    logits[4, 999] = float("inf")
    for scores in (logits, logits[::2], logits[:, : VOCAB - 1]):
        assert torch.equal(_argmax(scores), scores.argmax(-1))
    assert _argmax(logits).tolist()[1:5] == [5, 300, 0, 999]


def test_repetition_penalty_matches_transformers() -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, VOCAB) * 3
    history = [3, 3, 10, 500, 999]
    want = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([history]), logits.clone())
    got = sample(logits.clone(), [_sampler(temperature=0, repetition_penalty=1.3)], [history])
    assert got[0].token_id == int(want.argmax())
    # the penalty changes what greedy picks when the favourite was already seen
    logits[0, 10] = 100.0
    got = sample(logits, [_sampler(temperature=0, repetition_penalty=1000.0)], [history])
    assert got[0].token_id != 10


def test_repetition_penalty_per_row_matches_transformers() -> None:
    """Rows with different penalties and history lengths are penalised together, each as
    transformers would penalise it alone; a row without a penalty or a history is untouched."""
    torch.manual_seed(5)
    logits = torch.randn(4, VOCAB) * 3
    histories = [[3, 3, 10, 500, 999], [7], [1, 2], []]
    penalties = [1.3, 0.7, 1.0, 2.0]
    samplers = [_sampler(temperature=0, repetition_penalty=r) for r in penalties]
    got = sample(logits.clone(), samplers, histories)
    for i, (history, penalty) in enumerate(zip(histories, penalties)):
        want = logits[i : i + 1].clone()
        if history:
            want = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([history]), want)
        assert got[i].token_id == int(want.argmax())
        assert got[i].logprob == pytest.approx(torch.log_softmax(logits[i], -1)[got[i].token_id].item(), abs=1e-5)
    # a favourite already seen loses its place in every penalised row of the batch
    logits[0, 10], logits[1, 7] = 50.0, 50.0
    strong = [_sampler(temperature=0, repetition_penalty=1000.0) for _ in range(2)]
    got = sample(logits[:2], strong, [[10], [7]])
    assert got[0].token_id != 10 and got[1].token_id != 7


def test_presence_and_frequency_penalties_count_generated_tokens_only() -> None:
    """OpenAI's penalties as vLLM applies them: the logit of a token generated c times drops by
    c * frequency + presence; prompt tokens (before output_start) do not count."""
    torch.manual_seed(7)
    logits = torch.randn(3, VOCAB)
    history = [5, 6, 7, 7, 7, 8, 5]  # prompt [5, 6, 7], then 7, 7, 8, 5 generated
    params = [dict(presence_penalty=0.5, frequency_penalty=0.25, output_start=3),
              dict(presence_penalty=-1.0, output_start=3), dict(frequency_penalty=0.0, output_start=3)]
    for row, kw in enumerate(params):
        want = logits[row].clone()
        for token, count in ((7, 2), (8, 1), (5, 1)):  # 6 is prompt-only
            want[token] -= count * kw.get("frequency_penalty", 0) + kw.get("presence_penalty", 0)
        favourite = int(want.argmax())
        got = sample(logits, [_sampler(temperature=0, **p) for p in params], [history] * 3)[row]
        assert got.token_id == favourite
        assert got.logprob == pytest.approx(torch.log_softmax(logits[row], -1)[favourite].item(), abs=1e-5)
    # strong enough to push the favourite aside, but only once generated
    logits[0, 7] = 30.0
    strong = _sampler(temperature=0, frequency_penalty=2.0, presence_penalty=2.0, output_start=3)
    assert sample(logits[:1], [strong], [[5, 6, 7, 9]])[0].token_id == 7  # 7 only in the prompt
    assert sample(logits[:1], [strong], [[5, 6, 7] + [7] * 15])[0].token_id != 7  # 30 - 15 * 2 - 2 < 0


def test_logit_bias_moves_the_listed_logits_before_sampling() -> None:
    torch.manual_seed(8)
    logits = torch.randn(2, VOCAB)
    favourite = int(logits[0].argmax())
    biased = _sampler(temperature=0, logit_bias={favourite: -100.0, 11: 5.0, 12: 100.0})
    got = sample(logits, [biased, _sampler(temperature=0)], [[], []])
    assert got[0].token_id == 12 and got[1].token_id == int(logits[1].argmax())  # only its own row moves
    assert got[0].logprob == pytest.approx(torch.log_softmax(logits[0], -1)[12].item(), abs=1e-5)  # raw logprob
    banned = _sampler(temperature=0, logit_bias={favourite: -100.0})
    want = logits[0].clone()
    want[favourite] -= 100
    assert sample(logits[:1], [banned], [[]])[0].token_id == int(want.argmax())


def test_min_tokens_suppresses_stop_tokens_until_enough_were_generated() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 2] = 10.0  # "EOS" is the favourite
    held = _sampler(temperature=0, min_tokens=2, suppress=[2, 3], output_start=4)
    free = _sampler(temperature=0)
    got = sample(logits.clone(), [held, free], [[1, 1, 1, 1, 9], [1]])  # one generated: still held
    assert got[0].token_id not in (2, 3) and got[1].token_id == 2
    assert sample(logits[:1], [held], [[1, 1, 1, 1, 9, 9]])[0].token_id == 2  # two generated: free again


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.8), (50, 0.5), (1, 1.0)])
def test_warp_matches_transformers(top_k: int, top_p: float) -> None:
    torch.manual_seed(1)
    scores = torch.randn(2, VOCAB)
    params = [SamplingParams(temperature=0.7, top_k=top_k, top_p=top_p), SamplingParams(temperature=1.3)]
    got = _warp(params, scores.clone())
    want = scores[:1] / 0.7
    if top_k:
        want = TopKLogitsWarper(top_k)(None, want)
    if top_p < 1:
        want = TopPLogitsWarper(top_p)(None, want)
    assert torch.equal(torch.isinf(got[0]), torch.isinf(want[0]))
    assert torch.allclose(got[0][~torch.isinf(got[0])], want[0][~torch.isinf(want[0])])
    assert torch.allclose(got[1], scores[1] / 1.3)  # a row without top-k/top-p is untouched


@pytest.mark.parametrize("min_p", [0.05, 0.3, 1.0])
def test_min_p_matches_transformers(min_p: float) -> None:
    torch.manual_seed(9)
    scores = torch.randn(2, VOCAB) * 3
    got = _warp([SamplingParams(temperature=0.8, min_p=min_p), SamplingParams(temperature=0.8)], scores.clone())
    want = MinPLogitsWarper(min_p)(None, scores[:1] / 0.8)
    assert torch.equal(torch.isinf(got[0]), torch.isinf(want[0]))
    assert not torch.isinf(got[1]).any()  # a row without min_p keeps every token
    if min_p == 1.0:
        assert (~torch.isinf(got[0])).sum() == 1


def test_top_p_ranks_more_tokens_only_where_needed() -> None:
    torch.manual_seed(4)
    scores = torch.randn(3, 4 * TOP_P_CANDIDATES[-1]) * 0.1  # the top candidates hold far less than 0.9
    # distinct values: tied tokens rank arbitrarily
    scores[1, :5] = 10.0 + torch.arange(5) * 0.01  # peaked: settled among the first candidates
    scores[2, :200] = 6.0 + torch.arange(200) * 1e-3  # settled among the second tier
    got = _warp([SamplingParams(temperature=1.0, top_p=0.9)] * 3, scores.clone())
    want = TopPLogitsWarper(0.9)(None, scores.clone())
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    kept = (~torch.isinf(got)).sum(-1).tolist()
    assert TOP_P_CANDIDATES[-1] < kept[0] < scores.shape[-1]
    assert kept[1] <= 5 and TOP_P_CANDIDATES[0] < kept[2] <= TOP_P_CANDIDATES[-1]


def test_draw_follows_the_distribution_and_never_picks_zero_probability() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.2, 0.3, 0.0]])
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(6)
    for _ in range(4000):
        counts[_draw(probs, [generator])[0]] += 1
    assert counts[[0, 2, 5]].sum() == 0
    assert torch.allclose(counts / counts.sum(), probs[0], atol=0.03)


def test_seeded_rows_are_reproducible_and_independent_of_batch() -> None:
    torch.manual_seed(2)
    logits = torch.randn(3, VOCAB)
    alone = sample(logits[1:2], [_sampler(seed=42)], [[]])[0].token_id
    samplers = [_sampler(seed=1), _sampler(seed=42), _sampler(temperature=0)]
    batched = sample(logits, samplers, [[], [], []])
    assert batched[1].token_id == alone
    assert batched[2].token_id == int(logits[2].argmax())


def test_logprobs_from_raw_logits() -> None:
    torch.manual_seed(3)
    logits = torch.randn(2, VOCAB)
    bias = torch.full((2, VOCAB), float("-inf"))
    bias[:, 7] = 0
    got = sample(logits, [_sampler(temperature=0, logprobs=3), _sampler(temperature=0)], [[], []], bias)
    raw = torch.log_softmax(logits, -1)
    assert got[0].token_id == 7 and got[1].token_id == 7
    assert got[0].logprob == pytest.approx(raw[0, 7].item(), abs=1e-5)
    assert [t.token_id for t in got[0].top] == raw[0].topk(3).indices.tolist()
    assert got[1].top == []


def test_validate_params() -> None:
    assert validate_params(SamplingParams(), VOCAB) is None
    assert "temperature" in validate_params(SamplingParams(temperature=-0.1), VOCAB)
    assert "finite" in validate_params(SamplingParams(temperature=float("inf")), VOCAB)
    assert "temperature" in validate_params(SamplingParams(temperature=float("nan")), VOCAB)
    assert "repetition_penalty" in validate_params(SamplingParams(repetition_penalty=float("inf")), VOCAB)
    assert "top_p" in validate_params(SamplingParams(top_p=0), VOCAB)
    assert "top_k" in validate_params(SamplingParams(top_k=-1), VOCAB)
    assert "min_p" in validate_params(SamplingParams(min_p=1.5), VOCAB)
    assert "repetition_penalty" in validate_params(SamplingParams(repetition_penalty=0), VOCAB)
    assert "logprobs" in validate_params(SamplingParams(logprobs=VOCAB + 1), VOCAB)
    assert "presence_penalty" in validate_params(SamplingParams(presence_penalty=2.5), VOCAB)
    assert "frequency_penalty" in validate_params(SamplingParams(frequency_penalty=float("nan")), VOCAB)
    assert "min_tokens" in validate_params(SamplingParams(min_tokens=-1), VOCAB)
    assert "suppress" in validate_params(SamplingParams(suppress=[VOCAB]), VOCAB)
    assert "logit_bias" in validate_params(SamplingParams(logit_bias={VOCAB: 1.0}), VOCAB)
    assert "logit_bias" in validate_params(SamplingParams(logit_bias={1: 101.0}), VOCAB)


def test_changing_seed_restarts_the_generator_and_other_changes_do_not() -> None:
    sampler = _sampler(seed=5)
    generator = sampler.generator
    sampler.update(SamplingParams(seed=5, temperature=0.5))
    assert sampler.generator is generator and sampler.params.temperature == 0.5
    sampler.update(SamplingParams(seed=6))
    assert sampler.generator is not generator


def test_top_alternatives_per_row_with_different_counts() -> None:
    torch.manual_seed(6)
    logits = torch.randn(3, VOCAB)
    samplers = [_sampler(temperature=0, logprobs=2), _sampler(temperature=0), _sampler(temperature=0.5, seed=1, logprobs=5)]
    got = sample(logits, samplers, [[], [], []])
    raw = torch.log_softmax(logits, -1)
    for row, k in ((0, 2), (2, 5)):
        top = raw[row].topk(k)
        assert [t.token_id for t in got[row].top] == top.indices.tolist()
        assert [t.logprob for t in got[row].top] == pytest.approx(top.values.tolist(), abs=1e-6)
    assert got[1].top == []
    assert got[2].logprob == pytest.approx(raw[2, got[2].token_id].item(), abs=1e-6)


def test_degenerate_parameters_never_break_the_other_rows() -> None:
    """A temperature too small to divide by is greedy (vLLM's rule); a penalty that overflows the
    logits into NaNs still yields a token id inside the vocabulary, and the other rows are sampled
    as if alone."""
    torch.manual_seed(10)
    logits = torch.randn(3, VOCAB)
    samplers = [_sampler(temperature=1e-320), _sampler(temperature=1.0, repetition_penalty=1e-300),
                _sampler(temperature=0.7, seed=4)]
    got = sample(logits, samplers, [[], [1, 2, 3], []])
    assert got[0].token_id == int(logits[0].argmax())
    assert 0 <= got[1].token_id < VOCAB
    assert got[2].token_id == sample(logits[2:], [_sampler(temperature=0.7, seed=4)], [[]])[0].token_id
