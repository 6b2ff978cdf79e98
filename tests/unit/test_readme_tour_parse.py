"""The tour test's reading of the README: commands, the output each shows, and the check against it."""

from __future__ import annotations

import pytest

from tests import readme_tour

BLOCK = """curl -s host/a -d '{"x": 1}'
# {"id":"gen_…","text":" Paris.",
#  "usage":{"n":5}}
A=$(echo 1)   # a note, not output
curl -s host/b \\
  -d '{}'
# data: first
# …
# data: [DONE]
python - <<'PY'
print(1)
# 1
if True:
    # an indented comment is code
    print("two")
# 'two'
PY
"""


def test_commands_and_what_they_show():
    got = readme_tour.commands(BLOCK)
    assert [c.first_line for c in got] == ["curl -s host/a -d '{\"x\": 1}'", "A=$(echo 1)   # a note, not output",
                                           "curl -s host/b \\", "python - <<'PY'"]
    assert got[0].shown == ['{"id":"gen_…","text":" Paris.","usage":{"n":5}}']
    assert got[1].shown == []
    assert got[2].text == "curl -s host/b \\\n  -d '{}'" and got[2].shown == ["data: first", "…", "data: [DONE]"]
    assert got[3].shown == ["1", "'two'"] and got[3].text.endswith("\nPY")


def test_a_wrong_output_does_not_match():
    shown = readme_tour.commands(BLOCK)[0].shown
    assert readme_tour.matches(shown, '{"id":"gen_9f2","text":" Paris.","usage":{"n":5}}')
    assert not readme_tour.matches(shown, '{"id":"gen_9f2","text":" London.","usage":{"n":5}}')
    assert not readme_tour.matches(shown, '{"id":"gen_9f2","text":" Paris.","usage":{"n":5}} and more')
    assert not readme_tour.matches([], "anything")
    assert readme_tour.matches([], "")


def test_a_wildcard_line_stands_for_lines_and_blank_lines_are_not_output():
    shown = readme_tour.commands(BLOCK)[2].shown
    assert readme_tour.matches(shown, "data: first\n\ndata: a\n\ndata: b\n\ndata: [DONE]\n\n")
    assert not readme_tour.matches(shown, "data: first\n\ndata: a\n")


@pytest.mark.parametrize("block, message", [
    ("# prose first\ncurl x\n", "no command above it"),
    ("curl x\n#not output\n", "must start with '# '"),
    ("python - <<'PY'\nprint(1)\n", "never closed"),
])
def test_a_malformed_block_is_refused(block, message):
    with pytest.raises(ValueError, match=message):
        readme_tour.commands(block)


def test_only_bash_blocks_are_runnable():
    assert readme_tour.blocks("## A 60-second tour\n```bash\ncurl x\n```\n") == ["curl x\n"]
    with pytest.raises(ValueError, match="python"):
        readme_tour.blocks("```python\nprint(1)\n```\n")


def test_the_tour_section_ends_at_the_next_heading():
    readme = "# T\n\n## A 60-second tour\n\nx\n\n## Where next\n\ny\n"
    assert readme_tour.tour_section(readme) == "## A 60-second tour\n\nx\n"
