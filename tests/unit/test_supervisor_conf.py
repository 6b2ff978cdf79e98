"""The supervisord configuration ``tiller up`` writes: the five services, and a program for the extra local
workers or gateways only when there are extra ones (a program that never starts would show as STOPPED and
make ``supervisorctl status`` exit non-zero)."""

from __future__ import annotations

import configparser
from pathlib import Path

import pytest

from common.config import Settings
from common.supervisor import SERVICES, programs_in_order, service_of, supervisor_env, write_conf


def written(tmp_path: Path, **distributed: int) -> configparser.RawConfigParser:
    conf = configparser.RawConfigParser()
    conf.read(write_conf(Settings(run_dir=tmp_path, distributed=distributed), foreground=False))
    assert "%(ENV_" not in (tmp_path / "supervisord.conf").read_text()
    return conf


@pytest.mark.parametrize("workers", [0, 1, 3])
def test_the_written_config_has_a_program_for_every_local_worker(tmp_path: Path, workers: int) -> None:
    conf = written(tmp_path, local_workers=workers)
    more = ["more_workers"] if workers > 1 else []
    assert conf["group:tiller"]["programs"].split(",") == [*SERVICES[:-1], *more, SERVICES[-1]]
    assert conf["program:worker"]["autostart"] == str(workers >= 1).lower()
    if more:
        assert conf["program:more_workers"]["numprocs"] == str(workers - 1)
        assert conf["program:more_workers"]["process_name"] == "worker_%(process_num)d"
        assert conf["program:more_workers"]["command"].endswith("-m services.worker")
    else:
        assert not conf.has_section("program:more_workers")


def test_several_gateways_get_their_program_logs_and_a_fresh_metrics_directory(tmp_path: Path) -> None:
    (tmp_path / "prometheus").mkdir()
    (tmp_path / "prometheus" / "counter_123.db").write_bytes(b"a dead start's samples")
    conf = written(tmp_path, local_workers=2, gateways=3)
    assert conf["group:tiller"]["programs"].split(",") == [*SERVICES[:-1], "more_workers", "gateway",
                                                           "more_gateways"]
    gateways = conf["program:more_gateways"]
    assert gateways["numprocs"] == "2" and gateways["process_name"] == "gateway_%(process_num)d"
    assert gateways["command"].endswith("-m services.gateway") and gateways["priority"] == "40"
    assert gateways["stdout_logfile"] == f"{tmp_path}/logs/gateway_%(process_num)d.log"
    assert list((tmp_path / "prometheus").iterdir()) == []
    assert supervisor_env(Settings(run_dir=tmp_path, distributed={"gateways": 3}), False)[
        "PROMETHEUS_MULTIPROC_DIR"] == str(tmp_path / "prometheus")


def test_one_gateway_is_as_before(tmp_path: Path) -> None:
    conf = written(tmp_path)
    assert not conf.has_section("program:more_gateways")
    assert "PROMETHEUS_MULTIPROC_DIR" not in supervisor_env(Settings(run_dir=tmp_path), False, base={})


def test_programs_are_listed_by_service_then_number() -> None:
    running = ["gateway_10", "gateway_2", "gateway", "worker_1", "scheduler", "session_store", "gateway_1"]
    assert programs_in_order(running) == ["session_store", "controller_runtime", "scheduler", "worker",
                                          "worker_1", "gateway", "gateway_1", "gateway_2", "gateway_10"]
    assert programs_in_order(running, "gateway") == ["gateway", "gateway_1", "gateway_2", "gateway_10"]
    assert programs_in_order([], "worker") == ["worker"]
    assert [service_of(n) for n in ("gateway_3", "session_store", "worker", "scheduler_1")] == [
        "gateway", "session_store", "worker", "scheduler_1"]
