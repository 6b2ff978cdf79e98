"""Every block of the README's tour, run against a real stack, prints what the README shows.

The stack serves what ``make up`` serves on a CPU (the default weights, not the tests' fp32), since the
tour's outputs are that stack's. Each ```bash block runs in one bash process (so a variable one command sets
reaches the next), with the stack's ports in place of 8080 and 50051 and this interpreter in place of
``.venv/bin/python``; each command must exit 0 and print its shown lines (tests/readme_tour.py).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest

from common.config import Settings
from tests import readme_tour
from tests.stack import ROOT, Stack, start_stack

TOUR = readme_tour.tour_section((ROOT / "README.md").read_text())
BLOCKS = readme_tour.blocks(TOUR)
_STATUS = re.compile(r"\n@@tour (\d+) exit (\d+)@@\n")


@pytest.fixture(scope="module")
def tour_stack(tmp_path_factory: pytest.TempPathFactory) -> Stack:
    if shutil.which("curl") is None:
        pytest.skip("the tour's commands need curl (Debian: apt-get install curl)")
    started = start_stack(tmp_path_factory.mktemp("tour"), TILLER_DEVICE="cpu",
                          TILLER_WEIGHTS=Settings.model_fields["weights"].default)
    yield started
    started.down()


def localised(text: str, stack: Stack) -> str:
    """A command of the README with this stack's ports and this interpreter."""
    out = (text.replace(":8080", f":{stack.settings.http_port}")
           .replace(":50051", f":{stack.settings.grpc_port}")
           .replace(".venv/bin/python", sys.executable))
    assert "8080" not in out and "50051" not in out, f"a port the test does not know how to replace:\n{text}"
    return out


def run_block(commands: list[readme_tour.Command], stack: Stack) -> list[tuple[int, str]]:
    """(exit status, stdout) of each command, run one after the other in one bash process."""
    script = "".join(f"{localised(c.text, stack)}\nprintf '\\n@@tour {i} exit %d@@\\n' $?\n"
                     for i, c in enumerate(commands))
    done = subprocess.run(["bash", "-c", script], cwd=ROOT, env=stack.env, capture_output=True, text=True,
                          timeout=300)
    parts = _STATUS.split(done.stdout)
    results = [(int(parts[k + 2]), parts[k]) for k in range(0, len(parts) - 1, 3)]
    assert len(results) == len(commands), f"the block stopped early:\n{done.stdout}\n{done.stderr}"
    return results


def test_the_tour_shows_what_its_commands_print():
    """Not hollow: the tour's blocks hold commands, and most of them show their output."""
    commands = [c for block in BLOCKS for c in readme_tour.commands(block)]
    assert len(BLOCKS) >= 4 and len(commands) >= 10, (len(BLOCKS), len(commands))
    assert sum(bool(c.shown) for c in commands) >= len(commands) - 1


@pytest.mark.parametrize("block", BLOCKS,
                         ids=[f"{i}-{readme_tour.commands(b)[0].first_line[:30]}" for i, b in enumerate(BLOCKS)])
def test_tour_block(tour_stack: Stack, block: str):
    commands = readme_tour.commands(block)
    wrong = []
    for command, (status, stdout) in zip(commands, run_block(commands, tour_stack)):
        if status != 0 or not readme_tour.matches(command.shown, stdout):
            wrong.append(f"$ {command.first_line}\nexit {status}\nREADME shows:\n" + "\n".join(command.shown)
                         + f"\nprinted:\n{readme_tour.printed(stdout)}")
    assert not wrong, "\n\n".join(wrong) + "\n\n" + tour_stack.logs()[-3000:]
