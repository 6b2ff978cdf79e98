"""The README's tour as data: its shell commands and the output each one shows, and the check of an output.

Conventions (the tour's own first paragraph states them for readers): inside a ```bash block of the tour
section, a command is a line (with its ``\\`` continuations, or a heredoc up to its terminator); the lines that
start with ``# `` right under it show what it prints, ``#  `` continuing the line above, and ``…`` standing
for anything that changes from run to run. Inside a heredoc (a Python script fed to ``python -``), the
comments that start a line show what the script prints, in order. A comment after a command on its line is a
note; a comment line with no command above it is an error (prose belongs outside the block).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TOUR_HEADING = "## A 60-second tour"
WILDCARD = "…"
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)
_HEREDOC = re.compile(r"<<-?'?(\w+)'?")


@dataclass(frozen=True)
class Command:
    text: str  # what the shell runs
    shown: list[str]  # the output lines the README shows (continuations joined)

    @property
    def first_line(self) -> str:
        return self.text.splitlines()[0]


def tour_section(readme: str) -> str:
    """The tour: from its heading to the next second-level heading."""
    start = readme.index(TOUR_HEADING)
    end = readme.find("\n## ", start + len(TOUR_HEADING))
    return readme[start:] if end < 0 else readme[start:end]


def blocks(section: str) -> list[str]:
    """The section's fenced blocks, all of which must be ```bash (the only kind the test knows how to run)."""
    found = []
    for language, body in _FENCE.findall(section):
        if language != "bash":
            raise ValueError(f"the tour has a ```{language or '(no language)'} block: the tour test runs "
                             f"```bash blocks only")
        found.append(body)
    return found


def _shown(comment: str, shown: list[str]) -> None:
    if comment.startswith("#  ") and shown:
        shown[-1] += comment[3:]
    elif comment == "#" or comment.startswith("# "):
        shown.append(comment[2:])
    else:
        raise ValueError(f"an output line must start with '# ': {comment!r}")


def commands(block: str) -> list[Command]:
    """The block's commands in order, each with the output it shows."""
    lines, out, i = block.splitlines(), [], 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if not line.strip():
            continue
        if line.startswith("#"):
            raise ValueError(f"a comment line with no command above it: {line!r}")
        text, shown = [line], []
        heredoc = _HEREDOC.search(line)
        if heredoc:
            while i < len(lines) and lines[i] != heredoc.group(1):
                if lines[i].startswith("#"):
                    _shown(lines[i], shown)
                text.append(lines[i])
                i += 1
            if i == len(lines):
                raise ValueError(f"heredoc {heredoc.group(1)!r} is never closed")
            text.append(lines[i])
            i += 1
        else:
            while text[-1].endswith("\\") and i < len(lines):
                text.append(lines[i])
                i += 1
        while i < len(lines) and lines[i].startswith("#"):
            _shown(lines[i], shown)
            i += 1
        out.append(Command("\n".join(text), shown))
    return out


def printed(stdout: str) -> str:
    """What a command printed, as the README shows it: no blank lines, no trailing spaces."""
    return "\n".join(line.rstrip() for line in stdout.splitlines() if line.strip())


def matches(shown: list[str], stdout: str) -> bool:
    """Whether ``stdout`` is exactly the shown lines, each ``…`` standing for any text (newlines included)."""
    pattern = ".*?".join(re.escape(part) for part in "\n".join(shown).split(WILDCARD))
    return re.fullmatch(pattern, printed(stdout), re.S) is not None
