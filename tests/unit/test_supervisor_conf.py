"""The supervisord configuration ``tiller up`` writes: the five services, and the extra local workers'
program only when there are extra local workers (a program that never starts would show as STOPPED and
make ``supervisorctl status`` exit non-zero)."""

from __future__ import annotations

import configparser
from pathlib import Path

import pytest

from common.config import Settings
from common.supervisor import SERVICES, write_conf


@pytest.mark.parametrize("workers", [0, 1, 3])
def test_the_written_config_has_a_program_for_every_local_worker(tmp_path: Path, workers: int) -> None:
    settings = Settings(run_dir=tmp_path, distributed={"local_workers": workers})
    conf = configparser.RawConfigParser()
    conf.read(write_conf(settings, foreground=False))
    more = ["more_workers"] if workers > 1 else []
    assert conf["group:tiller"]["programs"].split(",") == [*SERVICES[:-1], *more, SERVICES[-1]]
    assert conf["program:worker"]["autostart"] == str(workers >= 1).lower()
    if more:
        assert conf["program:more_workers"]["numprocs"] == str(workers - 1)
        assert conf["program:more_workers"]["process_name"] == "worker_%(process_num)d"
    else:
        assert not conf.has_section("program:more_workers")
    assert "%(ENV_" not in (tmp_path / "supervisord.conf").read_text()
