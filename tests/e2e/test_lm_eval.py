"""lm-eval, unchanged, against Tiller: its ``local-completions`` backend (loglikelihoods from prompt
scoring) and ``local-chat-completions`` (greedy answers through the chat template) give the same
per-item results and accuracy as its ``hf`` backend on the same weights, on two small local tasks
(``tests/lm_eval_tasks``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the tasks' data are local files
lm_eval = pytest.importorskip("lm_eval", reason="lm-eval comes with the test extra: pip install -e '.[test]'")

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "tests" / "lm_eval_tasks"


@pytest.fixture(scope="module")
def manager():
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS), include_defaults=False)  # indexing lm-eval's own tasks takes ~30 s


@pytest.fixture
def evaluate(monkeypatch, manager):
    monkeypatch.chdir(ROOT)  # the tasks name their data files from the repository root

    def run(model, task: str, **kwargs) -> tuple[dict, list[dict]]:
        out = lm_eval.simple_evaluate(model=model, tasks=[task], task_manager=manager, log_samples=True,
                                      batch_size=1, **kwargs)
        samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
        return out["results"][task], samples

    return run


@pytest.fixture(scope="module")
def hf_lm(hf_model, stack):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=hf_model, tokenizer=stack.tokenizer, batch_size=1, max_length=2048)


def api_args(stack, route: str, **extra: str) -> str:
    args = {"model": stack.settings.served_model_name, "base_url": f"{stack.http_url}/v1/{route}",
            "num_concurrent": "1", "max_retries": "1", **extra}
    return ",".join(f"{k}={v}" for k, v in args.items())


def test_local_completions_loglikelihoods_equal_hf(stack, evaluate, hf_lm):
    from common.model_source import resolve_model

    tokenizer = resolve_model(stack.settings).directory  # a local tokenizer, as users run it
    ours, our_items = evaluate("local-completions", "tiller_tiny_choice",
                               model_args=api_args(stack, "completions", tokenizer_backend="huggingface",
                                                   tokenizer=str(tokenizer)))
    ref, ref_items = evaluate(hf_lm, "tiller_tiny_choice")
    assert len(our_items) == len(ref_items) == 6
    for got, want in zip(our_items, ref_items, strict=True):
        got_ll = [ll for ll, _ in got["filtered_resps"]]
        want_ll = [ll for ll, _ in want["filtered_resps"]]
        assert got_ll == pytest.approx(want_ll, abs=2e-3), got["doc_id"]
        assert [g for _, g in got["filtered_resps"]] == [g for _, g in want["filtered_resps"]]
        assert got["acc"] == want["acc"]
    assert ours["acc,none"] == ref["acc,none"]


def test_local_chat_completions_answers_equal_hf(stack, evaluate, hf_lm):
    ours, our_items = evaluate("local-chat-completions", "tiller_tiny_answer",
                               model_args=api_args(stack, "chat/completions"), apply_chat_template=True)
    ref, ref_items = evaluate(hf_lm, "tiller_tiny_answer", apply_chat_template=True)
    assert len(our_items) == len(ref_items) == 4
    assert [s["filtered_resps"] for s in our_items] == [s["filtered_resps"] for s in ref_items]
    assert all(s["filtered_resps"][0].strip() for s in our_items)  # real answers, not empty strings
    assert [s["exact_match"] for s in our_items] == [s["exact_match"] for s in ref_items]
    assert ours["exact_match,none"] == ref["exact_match,none"]
