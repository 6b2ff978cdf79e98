"""The engine on the real default model: greedy parity with transformers, batching, chunked prefill,
sampling, masks, logprobs, and failures that stay local to one sequence."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.wire import SamplingParams, SeqStep, Step, samples_by_seq, unpack_tokens
from services.worker.engine import Engine
from tests.worker.conftest import GREEDY, Driver

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def expected(prompts, reference) -> list[list[int]]:
    want = [reference(p, NEW_TOKENS) for p in prompts]
    assert all(len(w) == NEW_TOKENS for w in want), "a reference stopped early at EOS: pick longer-running prompts"
    return want


def test_greedy_matches_transformers_generate(driver: Driver, prompts, expected) -> None:
    for i, (prompt, want) in enumerate(zip(prompts, expected)):
        got = driver.generate(100 + i, prompt, len(want))
        assert got == want, f"prompt {i}"


def test_batch_with_joins_leaves_and_chunks_matches_generate(driver: Driver, prompts, expected) -> None:
    """A starts alone, B joins at step 3, C joins at step 6 with its prompt in two chunks, A leaves
    after 12 tokens; every sequence still gets exactly transformers' tokens."""
    a, b, c = 200, 201, 202
    out: dict[int, list[int]] = {a: [], b: [], c: []}
    prompt_c = prompts[2]
    half = len(prompt_c) // 2
    free: list[int] = []
    for step in range(NEW_TOKENS + 8):
        seqs: list[SeqStep] = []
        for seq_id, joins, prompt in ((a, 0, prompts[0]), (b, 3, prompts[1])):
            if step == joins:
                seqs.append(SeqStep(seq_id=seq_id, tokens=prompt, sampling=GREEDY))
            elif step > joins and seq_id not in free and len(out[seq_id]) < NEW_TOKENS:
                seqs.append(SeqStep(seq_id=seq_id, tokens=[out[seq_id][-1]]))
        if step == 6:
            seqs.append(SeqStep(seq_id=c, tokens=prompt_c[:half], sample=False, sampling=GREEDY))
        elif step == 7:
            seqs.append(SeqStep(seq_id=c, tokens=prompt_c[half:]))
        elif step > 7 and len(out[c]) < NEW_TOKENS:
            seqs.append(SeqStep(seq_id=c, tokens=[out[c][-1]]))
        leave = [a] if len(out[a]) == 12 and a not in free else []
        free += leave
        seqs = [s for s in seqs if s.seq_id not in leave]
        result = driver.step(seqs, free=leave)
        assert not result.failures, result.failures
        assert set(result.samples) == {s.seq_id for s in seqs if s.sample}
        for seq_id, sampled in result.samples.items():
            out[seq_id].append(sampled.token_id)
    driver.engine.free([b, c])
    assert out[a] == expected[0][:12]
    assert out[b] == expected[1]
    assert out[c] == expected[2]


def test_chunked_prefill_equals_whole_prompt(driver: Driver, prompts) -> None:
    prompt = prompts[2]
    whole = driver.generate(300, prompt, 12)
    seq_id = 301
    chunks = [prompt[i : i + 7] for i in range(0, len(prompt), 7)]
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        result = driver.step([SeqStep(seq_id=seq_id, tokens=chunk, sample=last, sampling=GREEDY if i == 0 else None)])
        assert not result.failures
        assert bool(result.samples) == last
    tokens = [result.samples[seq_id].token_id]
    while len(tokens) < 12:
        tokens.append(driver.step([SeqStep(seq_id=seq_id, tokens=[tokens[-1]])]).samples[seq_id].token_id)
    driver.engine.free([seq_id])
    assert tokens == whole


def test_same_seed_same_tokens(driver: Driver, prompts) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, repetition_penalty=1.1, seed=1234)
    first = driver.generate(400, prompts[0], 24, params)
    second = driver.generate(401, prompts[0], 24, params)
    other = driver.generate(402, prompts[0], 24, SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=99))
    assert first == second
    assert first != other


def test_top_k_one_is_greedy(driver: Driver, prompts, expected) -> None:
    got = driver.generate(410, prompts[1], 16, SamplingParams(temperature=1.0, top_k=1, seed=5))
    assert got == expected[1][:16]


def test_changing_sampling_mid_sequence_applies(driver: Driver, prompts, expected) -> None:
    """Start sampling hot, then switch to greedy: the next token is the argmax after the actual context."""
    seq_id = 420
    hot = SamplingParams(temperature=1.5, seed=7)
    result = driver.step([SeqStep(seq_id=seq_id, tokens=prompts[0], sampling=hot)])
    context = prompts[0] + [result.samples[seq_id].token_id]
    result = driver.step([SeqStep(seq_id=seq_id, tokens=context[-1:], sampling=GREEDY)])
    with torch.inference_mode():
        logits = driver.engine.loaded.model(torch.tensor([context])).logits[0, -1]
    driver.engine.free([seq_id])
    assert result.samples[seq_id].token_id == int(logits.argmax())


def _pack(allowed: list[int], vocab: int) -> bytes:
    bits = np.zeros(-(-vocab // 32) * 32, dtype=np.uint8)
    bits[allowed] = 1
    return np.packbits(bits, bitorder="little").tobytes()  # little-endian words == little bit order bytes


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=1.0, seed=3)])
def test_mask_limits_tokens(driver: Driver, prompts, sampling: SamplingParams) -> None:
    vocab = driver.engine.vocab_size
    allowed = [17, 255, 4096, vocab - 1]
    mask = _pack(allowed, vocab)
    seq_id = 430 if sampling is GREEDY else 431
    # An unmasked neighbour in the same step must be unaffected by the mask.
    result = driver.step(
        [
            SeqStep(seq_id=seq_id, tokens=prompts[0], sampling=sampling, mask_row=0),
            SeqStep(seq_id=seq_id + 10, tokens=prompts[0], sampling=GREEDY),
        ],
        mask=mask,
    )
    seen = [result.samples[seq_id].token_id]
    assert result.samples[seq_id + 10].token_id not in allowed
    for _ in range(8):
        result = driver.step([SeqStep(seq_id=seq_id, tokens=[seen[-1]], mask_row=0)], mask=mask)
        seen.append(result.samples[seq_id].token_id)
    driver.engine.free([seq_id, seq_id + 10])
    assert set(seen) <= set(allowed)


def test_mask_allowing_nothing_fails_only_that_sequence(driver: Driver, prompts) -> None:
    vocab = driver.engine.vocab_size
    mask = _pack([], vocab) + _pack([5], vocab)
    result = driver.step(
        [
            SeqStep(seq_id=440, tokens=prompts[0], sampling=GREEDY, mask_row=0),
            SeqStep(seq_id=441, tokens=prompts[0], sampling=GREEDY, mask_row=1),
            SeqStep(seq_id=442, tokens=prompts[0], sampling=GREEDY, mask_row=2),  # beyond the frame
        ],
        mask=mask,
    )
    driver.engine.free([441])
    assert {f.seq_id for f in result.failures} == {440, 442}
    assert "allows no token" in next(f.message for f in result.failures if f.seq_id == 440)
    assert result.samples[441].token_id == 5


def test_logprobs_match_transformers(driver: Driver, prompts) -> None:
    k = 5
    seq_id = 450
    prompt = prompts[2]
    params = SamplingParams(temperature=0, logprobs=k)
    result = driver.step([SeqStep(seq_id=seq_id, tokens=prompt, sampling=params)])
    samples = [result.samples[seq_id]]
    for i in range(5):
        seqs = [SeqStep(seq_id=seq_id, tokens=[samples[-1].token_id])]
        if i == 0:  # a neighbour in the batch must not change anything
            seqs.append(SeqStep(seq_id=451, tokens=[7], sampling=GREEDY))
        samples.append(driver.step(seqs).samples[seq_id])
    driver.engine.free([seq_id, 451])
    context = prompt + [s.token_id for s in samples]
    with torch.inference_mode():
        logits = driver.engine.loaded.model(torch.tensor([context])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    for i, sampled in enumerate(samples):
        row = logprobs[len(prompt) - 1 + i]
        assert sampled.logprob == pytest.approx(row[sampled.token_id].item(), abs=1e-4)
        assert len(sampled.top) == k
        values = [t.logprob for t in sampled.top]
        assert values == sorted(values, reverse=True)
        want = row.topk(k)
        assert [t.token_id for t in sampled.top] == want.indices.tolist()
        assert np.allclose(values, want.values.tolist(), atol=1e-4)
        assert sampled.top[0].token_id == sampled.token_id  # greedy picks the top alternative
        assert sampled.top[0].logprob == sampled.logprob


def test_pool_exhaustion_fails_only_that_sequence(loaded, prompts) -> None:
    engine = Engine(loaded, num_blocks=5)  # 4 usable blocks: 64 tokens
    driver = Driver(engine)
    short = prompts[0]  # a few tokens
    long = (prompts[2] * 3)[:60]
    result = driver.step(
        [SeqStep(seq_id=1, tokens=short, sampling=GREEDY), SeqStep(seq_id=2, tokens=long, sampling=GREEDY)]
    )
    assert [f.seq_id for f in result.failures] == [2]
    assert "KV cache exhausted" in result.failures[0].message
    token = result.samples[1].token_id
    for _ in range(3):
        result = driver.step([SeqStep(seq_id=1, tokens=[token])])
        assert not result.failures
        token = result.samples[1].token_id
    # Once the first sequence is freed, the long one fits.
    result = driver.step([SeqStep(seq_id=2, tokens=long, sampling=GREEDY)], free=[1])
    assert not result.failures and 2 in result.samples
    assert engine.stats().active_seqs == 1


def test_bad_input_fails_only_that_sequence(driver: Driver, prompts) -> None:
    vocab = driver.engine.vocab_size
    limit = driver.engine.max_model_len
    result = driver.step(
        [
            SeqStep(seq_id=460, tokens=prompts[0]),  # unknown, no sampling parameters
            SeqStep(seq_id=461, tokens=[vocab], sampling=GREEDY),  # out of vocabulary
            SeqStep(seq_id=462, tokens=[1] * (limit + 1), sampling=GREEDY),  # over max_model_len
            SeqStep(seq_id=463, tokens=[], sampling=GREEDY),
            SeqStep(seq_id=464, tokens=[1], sampling=SamplingParams(temperature=-1)),
            SeqStep(seq_id=465, tokens=prompts[0], sampling=GREEDY),
        ]
    )
    driver.engine.free([465])
    assert sorted(f.seq_id for f in result.failures) == [460, 461, 462, 463, 464]
    assert list(result.samples) == [465]
    assert driver.engine.stats().active_seqs == 0


def test_follow_feeds_the_last_sample_and_matches_generate(driver: Driver, prompts, expected) -> None:
    """Steps that feed ``follow`` (the worker's own last sample) give transformers' tokens, next to a
    sequence fed its tokens explicitly in the same steps."""
    a, b = 470, 471
    result = driver.step([SeqStep(seq_id=a, tokens=prompts[0], sampling=GREEDY),
                          SeqStep(seq_id=b, tokens=prompts[1], sampling=GREEDY)])
    got = {a: [result.samples[a].token_id], b: [result.samples[b].token_id]}
    while len(got[a]) < NEW_TOKENS:
        result = driver.step([SeqStep(seq_id=a, tokens=[], follow=True), SeqStep(seq_id=b, tokens=[got[b][-1]])])
        assert not result.failures, result.failures
        for seq_id in (a, b):
            got[seq_id].append(result.samples[seq_id].token_id)
    driver.engine.free([a, b])
    assert got == {a: expected[0], b: expected[1]}


def test_followers_feed_their_last_samples_and_come_first_in_the_result(driver: Driver, prompts, expected) -> None:
    """``Step.follows`` (no SeqStep each) decodes as follow SeqSteps do, giving transformers' tokens; the
    result's arrays are in slot order, followers first, beside a sequence whose prompt starts."""
    a, b, c = 490, 491, 492
    result = driver.step([SeqStep(seq_id=a, tokens=prompts[0], sampling=GREEDY),
                          SeqStep(seq_id=b, tokens=prompts[1], sampling=GREEDY)])
    got = {a: [result.samples[a].token_id], b: [result.samples[b].token_id]}
    result = driver.step([SeqStep(seq_id=c, tokens=prompts[2], sampling=GREEDY)], follows=[b, a])
    assert unpack_tokens(result.tokens) == [result.samples[b].token_id, result.samples[a].token_id,
                                            result.samples[c].token_id]
    got[c] = [result.samples[c].token_id]
    for seq_id in (a, b):
        got[seq_id].append(result.samples[seq_id].token_id)
    while len(got[a]) < NEW_TOKENS:
        result = driver.step([], follows=[a, b, c])
        assert not result.failures, result.failures
        for seq_id in got:
            got[seq_id].append(result.samples[seq_id].token_id)
    driver.engine.free([a, b, c])
    assert got == {a: expected[0], b: expected[1], c: expected[2][:NEW_TOKENS - 1]}


def test_a_follower_that_cannot_go_on_fails_its_slot_only(driver: Driver, prompts) -> None:
    result = driver.step([SeqStep(seq_id=495, tokens=prompts[0], sampling=GREEDY),
                          SeqStep(seq_id=496, tokens=prompts[1], sampling=GREEDY),
                          SeqStep(seq_id=497, tokens=prompts[2], sampling=GREEDY)])
    driver.engine.free([497])
    result = driver.step([SeqStep(seq_id=496, tokens=[], follow=True)], follows=[497, 495, 498, 496])
    failures = {f.seq_id: f.message for f in result.failures}
    assert "no sampled token to feed" in failures[497] and "no sampled token to feed" in failures[498]
    assert "appears 2 times" in failures[496]  # a follower is not sent a SeqStep too
    tokens = unpack_tokens(result.tokens)
    assert [t >= 0 for t in tokens] == [False, True, False, False, False] and set(result.samples) == {495}
    driver.engine.free([495])
    assert driver.engine.stats().active_seqs == 0


def test_follow_without_a_sample_to_feed_fails_only_that_sequence(driver: Driver, prompts) -> None:
    result = driver.step([SeqStep(seq_id=480, tokens=prompts[0], sampling=GREEDY, sample=False),
                          SeqStep(seq_id=481, tokens=prompts[1], sampling=GREEDY),
                          SeqStep(seq_id=482, tokens=prompts[2], sampling=GREEDY)])
    token = result.samples[481].token_id
    result = driver.step([SeqStep(seq_id=480, tokens=[], follow=True),  # fed, never sampled
                          SeqStep(seq_id=481, tokens=[token]),  # its sample was fed explicitly ...
                          SeqStep(seq_id=482, tokens=[token], follow=True),  # tokens and follow
                          SeqStep(seq_id=483, tokens=[], follow=True)])  # unknown
    failures = {f.seq_id: f.message for f in result.failures}
    assert "no sampled token to feed" in failures[480] and "no sampled token to feed" in failures[483]
    assert "a follow step carries no tokens" in failures[482] and list(result.samples) == [481]
    result = driver.step([SeqStep(seq_id=481, tokens=[], follow=True)])  # ... so this feeds the new one
    assert not result.failures and 481 in result.samples
    second = driver.step([SeqStep(seq_id=481, tokens=[], follow=True)])
    assert not second.failures
    driver.engine.free([481])
    assert driver.engine.stats().active_seqs == 0


def test_free_only_step_and_unknown_free_ids(driver: Driver) -> None:
    result = driver.step([], free=[999_999])
    assert result.samples == {} and result.failures == []


def test_free_all_drops_every_sequence_before_the_step(driver: Driver, prompts, expected) -> None:
    driver.step([SeqStep(seq_id=1, tokens=prompts[1], sampling=GREEDY), SeqStep(seq_id=2, tokens=prompts[2], sampling=GREEDY)])
    assert driver.engine.stats().active_seqs == 2
    driver.step_id += 1
    step = Step(step_id=driver.step_id, seqs=[SeqStep(seq_id=1, tokens=prompts[0], sampling=GREEDY)], free_all=True)
    result = driver.engine.step(step)
    assert driver.engine.stats().active_seqs == 1 and samples_by_seq(step, result)[1].token_id == expected[0][0]
    driver.engine.free([1])


def test_fallback_forward_matches_generate(loaded, prompts, expected) -> None:
    engine = Engine(loaded, num_blocks=16, native=False)
    assert engine.backend == "transformers"
    assert Driver(engine).generate(1, prompts[0], 12) == expected[0][:12]
