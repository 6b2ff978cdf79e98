"""deploy/loadtest/scheduler_sim.py, small: the benchmark runs the real scheduler core to the end of its
workload, and what it prints says what KV-aware placement must do (the figures themselves are the
benchmark's, not asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _percent(cell: str) -> float:
    assert cell.endswith("%"), cell
    return float(cell[:-1])


def test_the_sim_runs_its_workload_to_the_end_and_kv_aware_placement_keeps_each_conversation() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "deploy/loadtest/scheduler_sim.py"), "--workers", "2",
                           "--seqs", "16", "--turns", "2"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {}  # kind of loop -> its cells from "steps" on
    for cells in (line.split() for line in done.stdout.splitlines()):
        if cells[:1] == ["2"]:  # the rows of the 2-worker runs
            rows["per worker" if cells[1] == "per" else cells[1]] = cells[3:] if cells[1] == "per" else cells[2:]
    assert set(rows) == {"lockstep", "per worker"}, done.stdout
    for cells in rows.values():  # steps, core µs/step, µs/seq, tok/s, idle and longest wait x2, hit kv, ...
        steps, tokens_s = int(cells[0]), float(cells[3].replace(",", ""))
        hit_kv, hit_rnd, hit_max = _percent(cells[8]), _percent(cells[9]), _percent(cells[11])
        turns_kv, turns_rnd = _percent(cells[12]), _percent(cells[13])
        assert steps > 0 and tokens_s > 0
        assert hit_rnd < hit_kv <= hit_max  # placement reuses more than random, never more than there is
        assert turns_kv == 100.0 and turns_rnd < turns_kv  # every later turn found its whole conversation parked
