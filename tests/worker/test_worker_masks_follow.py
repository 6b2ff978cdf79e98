"""Steps sent with ``masks_follow``: the worker runs the forward pass first and samples once the
step's StepMasks (failures + mask frame) comes; in the engine and in the real worker process."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from common import wire
from common.wire import SeqFailure, SeqStep, Step, StepMasks, samples_by_seq
from services.worker.engine import Engine
from tests.worker.conftest import GREEDY
from tests.worker.test_worker_service import Scheduler, _start_worker, _stop, scheduler  # noqa: F401 (fixture)


def _reply(scheduler: Scheduler) -> wire.Message:
    """The next message from the worker that is not a hello."""
    while isinstance(msg := scheduler.recv(), wire.WorkerHello):
        pass
    return msg


def _pack(rows: list[list[int]], vocab: int) -> bytes:
    """A mask frame: one packed bitset row per list of allowed tokens."""
    frame = b""
    for allowed in rows:
        bits = np.zeros(-(-vocab // 32) * 32, dtype=np.uint8)
        bits[allowed] = 1
        frame += np.packbits(bits, bitorder="little").tobytes()
    return frame


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    return tokenizer("The quick brown fox").input_ids


def test_controlled_and_plain_sequence_in_one_step(engine: Engine, prompt, reference) -> None:
    vocab = engine.vocab_size
    allowed = [17, 255, 4096]
    want = reference(prompt, 2)
    first = Step(step_id=1, seqs=[SeqStep(seq_id=600, tokens=prompt, sampling=GREEDY)])
    plain = samples_by_seq(first, engine.step(first))
    engine.free([600])

    step = Step(step_id=2, masks_follow=True, seqs=[
        SeqStep(seq_id=601, tokens=prompt, sampling=GREEDY, mask_row=0),
        SeqStep(seq_id=602, tokens=prompt, sampling=GREEDY),
    ])
    forwarded = engine.forward(step)
    result = engine.sample_with(forwarded, StepMasks(step_id=2), _pack([allowed], vocab))
    assert not result.failures and result.step_id == 2
    samples = samples_by_seq(step, result)
    assert samples[601].token_id in allowed
    assert samples[602].token_id == plain[600].token_id == want[0]  # the plain one is unaffected
    # both go on as usual afterwards
    nxt = Step(step_id=3, seqs=[SeqStep(seq_id=602, tokens=[want[0]])])
    assert samples_by_seq(nxt, engine.step(nxt))[602].token_id == want[1]
    engine.free([601, 602])


def test_failures_are_fed_but_not_sampled(engine: Engine, prompt, reference) -> None:
    want = reference(prompt, 2)
    step = Step(step_id=4, masks_follow=True, seqs=[
        SeqStep(seq_id=610, tokens=prompt, sampling=GREEDY, mask_row=0),
        SeqStep(seq_id=611, tokens=prompt, sampling=GREEDY, mask_row=1),
    ])
    forwarded = engine.forward(step)
    masks = StepMasks(step_id=4, failures=[SeqFailure(seq_id=610, message="the controller spliced")])
    frame = _pack([[], [want[0]]], engine.vocab_size)  # row 0 allows nothing, but 610 is not sampled at all
    result = engine.sample_with(forwarded, masks, frame)
    assert not result.failures
    samples = samples_by_seq(step, result)
    assert set(samples) == {611} and samples[611].token_id == want[0]
    assert engine.seqs[610].tokens == prompt  # fed, KV kept: the next step samples after its next token
    nxt = Step(step_id=5, seqs=[SeqStep(seq_id=610, tokens=[want[0]])])
    result = engine.step(nxt)
    assert not result.failures and samples_by_seq(nxt, result)[610].token_id == want[1]
    engine.free([610, 611])


def test_mask_allowing_nothing_or_missing_fails_only_that_sequence(engine: Engine, prompt, reference) -> None:
    step = Step(step_id=6, masks_follow=True, seqs=[
        SeqStep(seq_id=620, tokens=prompt, sampling=GREEDY, mask_row=0),
        SeqStep(seq_id=621, tokens=prompt, sampling=GREEDY, mask_row=5),  # beyond the frame
        SeqStep(seq_id=622, tokens=prompt, sampling=GREEDY),
    ])
    forwarded = engine.forward(step)  # the rows are not looked at before the masks come
    assert [s.seq_id for s in forwarded.sampling] == [620, 621, 622]
    result = engine.sample_with(forwarded, StepMasks(step_id=6), _pack([[]], engine.vocab_size))
    failures = {f.seq_id: f.message for f in result.failures}
    assert "mask allows no token" in failures[620]
    assert "mask row 5 is missing" in failures[621]
    assert samples_by_seq(step, result)[622].token_id == reference(prompt, 1)[0]
    assert 620 not in engine.seqs and 621 not in engine.seqs and 622 in engine.seqs
    engine.free([622])


def test_worker_process_waits_for_masks_and_never_hangs(tmp_path: Path, scheduler: Scheduler, reference,
                                                        tokenizer) -> None:
    process = _start_worker(tmp_path, TILLER_LIMITS__WORKER_STEP_TIMEOUT_S="3")
    try:
        hello = scheduler.wait_for_stage("ready")
        prompt = tokenizer("The quick brown fox").input_ids
        want = reference(prompt, 2)
        seqs = [SeqStep(seq_id=1, tokens=prompt, sampling=GREEDY, mask_row=0),
                SeqStep(seq_id=2, tokens=prompt, sampling=GREEDY)]
        masked = Step(step_id=1, seqs=seqs, masks_follow=True)
        scheduler.send(wire.encode(masked))
        # while the worker waits: Health is answered, a Step and a stale StepMasks wait their turn
        health = scheduler.request(wire.Health(mid=5))
        assert isinstance(health, wire.HealthReply) and health.mid == 5 and health.worker.engine.active_seqs == 2
        plain = Step(step_id=2, seqs=[SeqStep(seq_id=3, tokens=prompt, sampling=GREEDY)])
        scheduler.send(wire.encode(plain))
        scheduler.send(wire.encode(StepMasks(step_id=99)))
        scheduler.send(wire.encode(StepMasks(step_id=1)), _pack([[want[1]]], hello.vocab_size))
        first = scheduler.request(wire.Health(mid=6))  # queued behind the steps: they answer first
        assert isinstance(first, wire.StepResult) and first.step_id == 1 and not first.failures
        assert [t.token_id for t in samples_by_seq(masked, first).values()] == [want[1], want[0]]
        second = _reply(scheduler)
        assert isinstance(second, wire.StepResult) and second.step_id == 2
        assert samples_by_seq(plain, second)[3].token_id == want[0]
        health = _reply(scheduler)
        assert isinstance(health, wire.HealthReply) and health.mid == 6

        # A StepMasks that never comes: the step's sampling sequences fail, clearly, and the worker goes on.
        step = Step(step_id=3, masks_follow=True, seqs=[SeqStep(seq_id=2, tokens=[want[0]], mask_row=0)])
        result = scheduler.request(step)
        assert isinstance(result, wire.StepResult) and result.step_id == 3 and not samples_by_seq(step, result)
        assert [f.seq_id for f in result.failures] == [2]
        assert "StepMasks" in result.failures[0].message and "did not come within 3 s" in result.failures[0].message
        scheduler.send(wire.encode(StepMasks(step_id=3)))  # too late: ignored
        step = Step(step_id=4, seqs=[SeqStep(seq_id=1, tokens=[want[1]])], free=[3])
        result = scheduler.request(step)
        assert isinstance(result, wire.StepResult) and result.step_id == 4 and not result.failures
        assert 1 in samples_by_seq(step, result)
        assert process.poll() is None
    finally:
        _stop(process)
