"""How many sequences a worker should run at once: where its decode throughput stops growing.

A decode step's cost grows with its rows. On a GPU, or a CPU with compute to spare, it grows far slower than
the rows, and tokens per second rise with the batch; on a CPU whose cores are saturated it grows as fast as
the rows past some size (this project's 2-core machine, the default model: 59 ms a step at 16 sequences,
237 ms at 64, the same tokens a second at four times the latency; `deploy/loadtest/worker_bench.py`), and
the stack around it then serves fewer. Admitting more sequences past that point only slows each one.

:class:`BatchCeiling` watches one worker's decode-only steps (each row one token): per bucket of rows
(powers of two) an exponential average of the rows and of the forward time, so its throughput. The ceiling
is the batch of the smallest bucket that no larger measured bucket beats by :data:`GAIN`, or the settings'
``limits.max_batch_size`` while the largest measured bucket is still the best (the batch may grow, and the
next bucket gets measured). A bucket not seen for :data:`STALE_STEPS` decode steps is forgotten, so a
ceiling is tried again now and then (contexts grow, other load comes and goes). Pure: no clock, no sockets.
"""

from __future__ import annotations

from dataclasses import dataclass

GAIN = 0.05  # a batch twice as large must be this much faster (tokens/s) to be worth its latency
MIN_STEPS = 8  # decode steps a bucket needs before it counts
STALE_STEPS = 4096  # decode steps after which an unseen bucket is forgotten
SMOOTHING = 0.2  # the exponential averages' weight of a new step


@dataclass
class _Bucket:
    rows: float  # averaged
    ms: float  # averaged forward time
    steps: int
    last_seen: int  # the decode step it was last seen at

    @property
    def tokens_per_ms(self) -> float:
        return self.rows / self.ms


class BatchCeiling:
    """One worker's ceiling on running sequences (see the module docstring)."""

    def __init__(self, limit: int) -> None:
        """``limit``: ``limits.max_batch_size``, the ceiling never passed."""
        self.limit = limit
        self.ceiling = limit
        self._buckets: dict[int, _Bucket] = {}  # by rows.bit_length()
        self._steps = 0

    def observe(self, rows: int, forward_ms: float) -> None:
        """A decode-only step of ``rows`` sequences took ``forward_ms`` on the worker."""
        if rows <= 0 or forward_ms <= 0:
            return
        self._steps += 1
        key = rows.bit_length()
        bucket = self._buckets.get(key)
        if bucket is None:
            self._buckets[key] = _Bucket(rows=rows, ms=forward_ms, steps=1, last_seen=self._steps)
        else:
            bucket.rows += SMOOTHING * (rows - bucket.rows)
            bucket.ms += SMOOTHING * (forward_ms - bucket.ms)
            bucket.steps += 1
            bucket.last_seen = self._steps
        if bucket is None or bucket.steps >= MIN_STEPS:
            self.ceiling = self._judge()

    def figures(self) -> dict[str, float]:
        """Each measured bucket's averaged tokens a second, by its averaged rows (for the log)."""
        return {f"rows_{b.rows:.0f}_tok_s": round(1000 * b.tokens_per_ms, 1)
                for _, b in sorted(self._buckets.items()) if b.steps >= MIN_STEPS}

    def _judge(self) -> int:
        horizon = self._steps - STALE_STEPS
        for key in [k for k, b in self._buckets.items() if b.last_seen < horizon]:
            del self._buckets[key]
        measured = sorted((k, b) for k, b in self._buckets.items() if b.steps >= MIN_STEPS)
        for i, (_, bucket) in enumerate(measured):
            larger = measured[i + 1:]
            if not larger:
                break  # the largest measured is the best so far: let the batch grow
            if all(b.tokens_per_ms < (1 + GAIN) * bucket.tokens_per_ms for _, b in larger):
                return max(1, min(self.limit, round(bucket.rows)))
        return self.limit
