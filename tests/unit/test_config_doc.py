"""docs/configuration.md is what common.config_doc prints from the settings object, so it cannot drift."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from common import config_doc
from common.config import Settings

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_docs_configuration_md_is_what_the_generator_prints():
    expected, actual = config_doc.render(), DOC.read_text()
    if actual != expected:
        diff = "".join(list(difflib.unified_diff(actual.splitlines(True), expected.splitlines(True),
                                                 "docs/configuration.md", "generated"))[:60])
        raise AssertionError(f"docs/configuration.md differs from common/config.py's settings; regenerate it with\n"
                             f"    {config_doc.COMMAND}\n{diff}")


def _fields(model: type[BaseModel], prefix: str = "") -> list[tuple[str, object]]:
    out = []
    for name, field in model.model_fields.items():
        section = field.annotation
        if isinstance(section, type) and issubclass(section, BaseModel):
            out += _fields(section, f"{prefix}{name}__")
        else:
            out.append((f"{prefix}{name}", field))
    return out


def test_every_setting_has_a_description_and_a_row():
    doc = config_doc.render()
    for path, field in _fields(Settings):
        assert field.description, f"{path} has no description: give its Field one (it is its documentation)"
        assert f"| `TILLER_{path.upper()}` |" in doc, path


class _Section(BaseModel):
    """A section."""

    max_body_bytes: int = Field(4 << 20, description="the largest <body>")
    names: list[str] = Field(default_factory=lambda: ["a"], description="who | what")


class _Settings(BaseModel):
    mode: Literal["auto", "cpu"] = Field("auto", description="a mode")
    threads: int | None = Field(None, description="``OMP`` threads")
    root: Path = Field(Path("run"), description="where", json_schema_extra={"doc_default": "$HOME/run"})
    empty: str = Field("", description="nothing")
    flag: bool = Field(True, description="on")
    table: dict[str, str] = Field(default_factory=dict, description="map")
    section: _Section = Field(default_factory=_Section)


def test_rows_show_env_var_key_type_default_and_description():
    doc = config_doc.render(_Settings)
    assert "| `TILLER_MODE` | `mode` | one of `'auto'`, `'cpu'` | `auto` | a mode |" in doc
    assert "| `TILLER_THREADS` | `threads` | int or unset | unset | `OMP` threads |" in doc
    assert "| `TILLER_ROOT` | `root` | path | $HOME/run | where |" in doc
    assert "| `TILLER_EMPTY` | `empty` | str | `''` | nothing |" in doc
    assert "| `TILLER_FLAG` | `flag` | bool | `true` | on |" in doc
    assert "| `TILLER_TABLE` | `table` | table str → str | `{}` | map |" in doc
    assert ("| `TILLER_SECTION__MAX_BODY_BYTES` | `section.max_body_bytes` | int | 4194304 (4 MiB) | "
            "the largest &lt;body> |") in doc
    assert '| `TILLER_SECTION__NAMES` | `section.names` | list of str | `["a"]` | who \\| what |' in doc
    assert "\n## section\n\nA section.\n" in doc
    assert "- [`section`](#section): A section." in doc


def test_a_changed_default_changes_the_document():
    class Changed(_Settings):
        flag: bool = Field(False, description="on")

    assert config_doc.render(Changed) != config_doc.render(_Settings)
    assert "| `TILLER_FLAG` | `flag` | bool | `false` | on |" in config_doc.render(Changed)
