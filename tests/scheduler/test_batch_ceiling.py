"""A worker's batch ceiling (services/scheduler/batch_ceiling.py): where decode throughput stops growing."""

from __future__ import annotations

import pytest

from services.scheduler.batch_ceiling import MIN_STEPS, STALE_STEPS, BatchCeiling


def saturated_cpu(rows: int) -> float:
    """ms a step: the 2-core machine's default model (worker_bench: 16 rows 59 ms, 64 rows 237 ms)."""
    return 17.0 + 2.6 * rows if rows <= 16 else 3.7 * rows


def gpu(rows: int) -> float:
    return 8.0 + 0.03 * rows


def grow(ceiling: BatchCeiling, cost, sizes=(1, 2, 4, 8, 16, 32, 64), steps=MIN_STEPS) -> list[int]:
    """Steps at each size the ceiling allows, in order, as load rising to 64 streams would run them; the
    ceiling after each size."""
    after = []
    for rows in sizes:
        for _ in range(steps):
            ceiling.observe(min(rows, ceiling.ceiling), cost(min(rows, ceiling.ceiling)))
        after.append(ceiling.ceiling)
    return after


def test_a_saturated_cpu_stops_where_doubling_the_batch_stops_paying():
    ceiling = BatchCeiling(64)
    assert ceiling.ceiling == 64  # nothing measured: the settings' limit
    after = grow(ceiling, saturated_cpu)
    assert after[:5] == [64] * 5  # throughput still rising: the batch may grow
    assert after[-1] == 16, after  # 32 and 64 rows are no faster than 16 (within 5%)


def test_a_gpu_keeps_the_settings_limit():
    ceiling = BatchCeiling(64)
    assert grow(ceiling, gpu) == [64] * 7


@pytest.mark.parametrize("limit", [1, 8])
def test_the_ceiling_never_passes_the_limit(limit):
    ceiling = BatchCeiling(limit)
    assert max(grow(ceiling, saturated_cpu)) <= limit


def test_a_bucket_seen_too_few_times_says_nothing_and_bad_samples_are_ignored():
    ceiling = BatchCeiling(64)
    for rows in (16, 64):
        for _ in range(MIN_STEPS - 1):
            ceiling.observe(rows, saturated_cpu(rows))
    assert ceiling.ceiling == 64
    ceiling.observe(0, 5.0)
    ceiling.observe(16, 0.0)  # a worker that reports no time
    assert ceiling.ceiling == 64


def test_a_ceiling_is_tried_again_once_what_it_rests_on_is_stale():
    ceiling = BatchCeiling(64)
    grow(ceiling, saturated_cpu)
    assert ceiling.ceiling == 16
    for _ in range(STALE_STEPS + 1):  # only 16-row steps now: the larger buckets age out
        ceiling.observe(16, saturated_cpu(16))
    assert ceiling.ceiling == 64
    grow(ceiling, gpu, sizes=(32, 64))  # the load went away: larger batches pay now
    assert ceiling.ceiling == 64
