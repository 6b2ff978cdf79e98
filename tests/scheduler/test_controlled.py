"""Controlled requests against a fake controller runtime: forks, fast-forward, splices, stops, failures."""

from __future__ import annotations

import itertools

import msgspec
import pytest

from common import aici_wire, wire
from common.errors import WireError
from common.config import Controllers
from services.scheduler.controlled import BACKTRACK_MARK, MainReply
from services.scheduler.core import Dispatch
from tests.scheduler.harness import BANG, EOS, HE, LD, LLO, WOR, Harness, prompt, reply, seqs_of


class FakeRuntime:
    """Answers the main channel as a controller that samples freely, unless a test says otherwise per
    sequence id (``pre``: a pre_process result; ``mid``: a mid_process result; ``post``: a post result)."""

    def __init__(self) -> None:
        self.pre: dict[int, dict] = {}
        self.mid: dict[int, object] = {}
        self.post: dict[int, dict] = {}
        self.pre_error: dict[int, str] = {}
        self.requests: list[aici_wire.MainRequest] = []
        self.fail_next = ""
        self.pre_default = False  # every controller flags pre_process as the default (it is not called)
        self.waiting: set[int] = set()  # of those that go ahead: the ones whose pre_process waits instead

    merged = False  # answer mid_ahead (mid_process in the post_pre_process call) as the runtime does: see the fixture

    def post_pre_process(self, h: Harness, request: aici_wire.PostPreProcess) -> MainReply:
        self.requests.append(request)
        if self.fail_next:
            error, self.fail_next = self.fail_next, ""
            return reply(error=error)
        bound = {b.seq_id for c in h.core.controlled.requests.values() for b in c.live() if b.assigned}
        bound |= {op.id for op in request.pre_ops}
        waiting = self.waiting & set(request.ahead)
        bound -= waiting
        failed = {s for s in bound if s in self.pre_error}
        data: dict[str, object] = {
            "pre_seqs": {str(s): {"error": self.pre_error.pop(s)} if s in self.pre_error else {"result": self.pre.pop(s, {})}
                         for s in bound},
            "post_seqs": {str(op.id): {"result": self.post.pop(op.id, {})} for op in request.post_ops},
            "waiting": sorted(waiting), "pre_default": sorted(bound) if self.pre_default else [],
        }
        if not (self.merged and request.mid_ahead):
            return reply(request, data)
        # as the runtime's post_pre_mid: mid_process for the ahead sequences that go on, in the same call
        stopped = {int(s) for s, post in data["post_seqs"].items() if post["result"].get("stop")}
        going = [s for s in request.ahead if s in data["pre_default"] and s not in stopped | failed]
        if not going:  # (recorded only when it runs: as mid_process apart)
            data["mid"] = {}
            return reply(request, data)
        mid = self.mid_process(aici_wire.MidProcess(ops=[aici_wire.MidOp(id=s) for s in going]))
        data["mid"], data["mid_ids"] = {"seqs": msgspec.to_builtins(mid.data.seqs)}, going
        return reply(request, data, frames=mid.frames)

    def mid_process(self, request: aici_wire.MidProcess) -> MainReply:
        self.requests.append(request)
        seqs = {str(op.id): {"result": self.mid.pop(op.id, None), "logs": "hi"} for op in request.ops}
        return reply(request, {"seqs": seqs}, frames=[b"MASKS"])


Masks = list[tuple[wire.StepMasks, list[bytes]]]


@pytest.fixture(autouse=True, params=[False, True], ids=["mid_process apart", "mid_ahead"])
def runtime_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Every test against both runtimes: one that runs a step-ahead's mid_process in its post_pre_process call
    (mid_ahead), and one that ignores mid_ahead (the scheduler then calls mid_process apart). The fake records
    the mid_process it ran in the same call among its requests, so the tests read the same calls either way."""
    monkeypatch.setattr(FakeRuntime, "merged", request.param)
    return request.param


def step(h: Harness, rt: FakeRuntime, tokens: dict[str, int] | None = None) -> tuple[list[Dispatch], Masks]:
    """One whole step as the service shell runs it; the StepMasks sent to workers."""
    steps, masks = send(h, rt)
    h.apply(steps, tokens)
    h.core.emit_deferred()
    return steps, masks


def ahead_calls(h: Harness, rt: FakeRuntime, request: aici_wire.PostPreProcess) -> None:
    """The calls of a step that went out before its post_pre_process: that, then mid_process."""
    if (mid := h.core.controlled.ahead_planned(rt.post_pre_process(h, request))) is not None:
        h.core.controlled.mid_done(rt.mid_process(mid))


def send(h: Harness, rt: FakeRuntime) -> tuple[list[Dispatch], Masks]:
    """A step sent and its main-channel calls run, as the service shell does; the StepMasks sent to workers.
    Its result is not applied."""
    h.core.admit()
    plan, request = h.core.plan_controlled()
    if plan.ahead:  # the step goes out first; its post_pre_process and mid_process run during the forward pass
        steps = h.core.build_steps(plan)
        assert request is not None and all(d.step.masks_follow for d in steps)
        ahead_calls(h, rt, request)
        return steps, [h.core.controlled.step_masks(d.step) for d in steps]
    plan = h.core.controlled_planned(plan, None if request is None else rt.post_pre_process(h, request))
    if (first := h.core.mid_first()) is not None:  # plain sequences run: the masks go with the step
        h.core.controlled.mid_done(rt.mid_process(first))
    steps = h.core.build_steps(plan)
    masks = []
    if any(d.step.masks_follow for d in steps):
        mid = h.core.controlled.mid_request()
        assert mid is not None and h.core.controlled.mid_request() is None  # one per step, whatever the workers
        h.core.controlled.mid_done(rt.mid_process(mid))
        masks = [h.core.controlled.step_masks(d.step) for d in steps if d.step.masks_follow]
    return steps, masks


def next_seq_id(h: Harness) -> int:
    """The sequence id the core hands out next (the queued request's, once admitted)."""
    seq_id = next(h.core.state.seq_ids)
    h.core.state.seq_ids = itertools.count(seq_id)
    return seq_id


def controlled(max_tokens: int = 8, n: int = 3, **fields: object) -> tuple[Harness, FakeRuntime]:
    h = Harness(controllers=Controllers(max_forks=4, deadlock_steps=2), prefill_chunk_tokens=16)
    h.worker()
    h.submit("c", prompt(n), max_tokens, controller="ctl-1", **fields)
    return h, FakeRuntime()


def test_the_first_step_binds_the_controller_and_samples_under_its_mask():
    h, rt = controlled()
    steps, masks = step(h, rt, {"c": HE})
    first = rt.requests[0]
    seq_id = h.core.requests["c"].seq_id
    assert isinstance(first, aici_wire.PostPreProcess) and first.reset
    assert first.pre_ops == [aici_wire.PreOp(id=seq_id, req_id="ctl-1")]
    (seq,) = seqs_of(steps, "c")
    assert seq.mask_row == 0 and seq.sample and steps[0].step.masks_follow
    assert masks == [(wire.StepMasks(step_id=steps[0].step.step_id), [b"MASKS"])]
    (event,) = h.events("c")
    assert event.index == 0 and event.text == " he" and event.logs == "hi"


def test_the_controller_hears_each_sampled_token_in_the_next_post_ops():
    h, rt = controlled()
    step(h, rt, {"c": HE})
    step(h, rt, {"c": LLO})
    seq_id = h.core.requests["c"].seq_id
    posts = [r for r in rt.requests if isinstance(r, aici_wire.PostPreProcess)]
    assert posts[1].post_ops == [aici_wire.PostOp(id=seq_id, tokens=[HE])] and not posts[1].reset
    assert posts[1].pre_ops == []


def test_a_controlled_request_ends_with_length_by_the_shared_rule():
    h, rt = controlled(max_tokens=2)
    step(h, rt, {"c": HE})
    assert h.core.controlled_workers() == {h.core.requests["c"].worker}  # its plans need a step there
    step(h, rt, {"c": LLO})
    assert h.core.controlled_workers() == set()
    final = h.final("c")
    assert (final.finish_reason, final.fork_finish, final.completion_tokens) == ("length", "length", 2)
    assert h.text("c") == " hello"


def test_eos_does_not_end_a_controlled_sequence_but_a_stop_token_does():
    h, rt = controlled(stop_token_ids=[BANG])
    step(h, rt, {"c": EOS})
    assert "c" in h.core.requests
    step(h, rt, {"c": BANG})
    final = h.final("c")
    assert (final.finish_reason, final.fork_finish) == ("stop", "eos")


def test_a_stop_string_ends_a_controlled_sequence():
    h, rt = controlled(stop=["llo"])
    step(h, rt, {"c": HE})
    step(h, rt, {"c": LLO})
    assert h.final("c").finish_reason == "stop" and h.text("c") == " he"


def test_a_long_prompt_is_chunked_before_the_controller_is_involved():
    h, rt = controlled(n=40)
    steps, _ = step(h, rt)
    (seq,) = seqs_of(steps, "c")
    assert len(seq.tokens) == 16 and not seq.sample and rt.requests == []
    step(h, rt)
    step(h, rt, {"c": HE})
    assert rt.requests[0].pre_ops and h.generated("c") == [HE]


def test_ff_tokens_are_fed_in_the_same_step_and_counted():
    h, rt = controlled()
    seq_id = next_seq_id(h)
    rt.pre[seq_id] = {"ff_tokens": [WOR, LD]}
    steps, _ = step(h, rt, {"c": BANG})
    (seq,) = seqs_of(steps, "c")
    assert seq.tokens[-2:] == [WOR, LD] and seq.sample
    events = h.events("c")
    assert sum(e.ff_tokens for e in events) == 2 and h.text("c") == " world!"


def test_forks_sample_under_their_own_mask_rows_and_end_together():
    h, rt = controlled(max_tokens=1)
    parent = next_seq_id(h)
    rt.pre[parent] = {"num_forks": 3}
    steps, _ = step(h, rt, {"c": HE, "c/1": LLO, "c/2": WOR})
    seqs = seqs_of(steps, "c")
    assert [s.mask_row for s in seqs] == [0, 1, 2]
    mid = next(r for r in rt.requests if isinstance(r, aici_wire.MidProcess))
    assert [op.clone_id for op in mid.ops] == [None, parent, parent]
    events = h.events("c")
    assert sorted((e.index, e.text) for e in events) == [(0, " he"), (1, "llo"), (2, " wor")]
    assert h.final("c").finish_reason == "length"
    assert h.core.pool.workers[b"w1"].reserved_tokens == 0


def test_too_many_forks_fail_the_branch():
    h, rt = controlled()
    parent = next_seq_id(h)
    rt.pre[parent] = {"num_forks": 9}
    step(h, rt)
    final = h.final("c")
    assert final.finish_reason == "error" and "at most 4 live sequences" in final.error


def test_a_splice_backtracks_after_the_step_and_feeds_its_tokens_next():
    h, rt = controlled()
    step(h, rt, {"c": HE})
    step(h, rt, {"c": LLO})
    seq_id = h.core.requests["c"].seq_id
    rt.mid[seq_id] = {"Splice": {"backtrack": 1, "ff_tokens": [WOR]}}
    steps, masks = step(h, rt, {"c": BANG})  # fed, not sampled: the splice replaces the sample
    assert masks[0][0].failures[0].seq_id == seq_id
    assert h.generated("c") == [HE, LLO]
    nxt, _ = step(h, rt, {"c": LD})
    (seq,) = seqs_of(nxt, "c")
    assert seq.backtrack == 1 and seq.tokens == [WOR]
    post = [r for r in rt.requests if isinstance(r, aici_wire.PostPreProcess)][-1]
    assert post.post_ops == [aici_wire.PostOp(id=seq_id, tokens=[WOR], backtrack=1)]
    assert h.text("c") == " hello" + BACKTRACK_MARK + " world"


def test_forced_tokens_past_max_tokens_are_cut_there_and_end_the_branch_with_length():
    h, rt = controlled(max_tokens=5)
    step(h, rt, {"c": HE})
    seq_id = h.core.requests["c"].seq_id
    rt.mid[seq_id] = {"Splice": {"backtrack": 0, "ff_tokens": [WOR] * 5000}}
    step(h, rt, {"c": BANG})  # fed, not sampled
    final = h.final("c")
    assert (final.finish_reason, final.fork_finish) == ("length", "length")
    assert h.text("c") == " he" + " wor" * 4 and sum(e.ff_tokens for e in h.events("c")) == 4


def test_pre_process_forced_tokens_past_the_context_are_cut_there():
    h = Harness(controllers=Controllers(max_forks=4, deadlock_steps=2), prefill_chunk_tokens=16)
    h.worker(max_model_len=6)
    h.submit("c", prompt(3), 3, controller="ctl-1")
    rt = FakeRuntime()
    rt.pre[next_seq_id(h)] = {"ff_tokens": [WOR] * 50}
    steps, _ = step(h, rt)
    assert all(len(s.tokens) <= 6 for s in seqs_of(steps, "c"))  # nothing past the context is fed
    final = h.final("c")
    assert final.finish_reason == "length" and h.text("c") == " wor" * 3
    assert sum(e.ff_tokens for e in h.events("c")) == 3


def test_a_backtrack_past_the_first_token_fails_the_branch_and_says_why():
    h, rt = controlled(n=3)
    step(h, rt, {"c": HE})
    seq_id = h.core.requests["c"].seq_id
    rt.mid[seq_id] = {"Splice": {"backtrack": 1000, "ff_tokens": [WOR]}}
    step(h, rt, {"c": BANG})
    final = h.final("c")
    assert final.finish_reason == "error" and final.fork_finish == "fail"
    assert "backtracked 1000 tokens, but the sequence holds 4" in final.error


def test_after_a_backtrack_into_the_prompt_max_tokens_counts_from_the_cut():
    h, rt = controlled(max_tokens=3, n=3)
    step(h, rt, {"c": HE})
    seq_id = h.core.requests["c"].seq_id
    rt.mid[seq_id] = {"Splice": {"backtrack": 3, "ff_tokens": [WOR]}}  # the sampled token and 2 of the prompt's
    step(h, rt, {"c": BANG})
    for _ in range(4):
        if "c" in h.core.requests:
            step(h, rt, {"c": LD})
    sampled = [t for e in h.events("c") for t in e.tokens]
    assert h.final("c").finish_reason == "length" and len(sampled) == 3  # HE, LD, LD
    assert h.text("c") == " he" + BACKTRACK_MARK + " wor" + "ld" * 2  # 3 tokens after the cut: max_tokens


def test_beside_plain_sequences_mid_process_runs_first_and_its_masks_go_with_the_step():
    h, rt = controlled()
    h.submit("p", prompt(3), 8)
    steps, masks = step(h, rt, {"c": HE, "p": LLO})
    (dispatch,) = steps
    (seq,) = seqs_of(steps, "c")
    assert not dispatch.step.masks_follow and not masks and dispatch.frames == [b"MASKS"]
    assert seq.sample and seq.mask_row == 0 and seqs_of(steps, "p")[0].sample
    assert h.text("c") == " he" and h.generated("p") == [LLO]
    h.core.control(b"gw", wire.Cancel(rid="p"))
    steps, masks = step(h, rt, {"c": LLO})  # alone again: mid_process overlaps the forward pass
    assert steps[0].step.masks_follow and not steps[0].frames and masks[0][1] == [b"MASKS"]


def test_beside_plain_sequences_a_spliced_sequence_is_fed_not_sampled():
    h, rt = controlled()
    h.submit("p", prompt(3), 8)
    step(h, rt, {"c": HE})
    seq_id = h.core.requests["c"].seq_id
    rt.mid[seq_id] = {"Splice": {"backtrack": 1, "ff_tokens": [WOR]}}
    steps, _ = step(h, rt, {"c": BANG})
    (seq,) = seqs_of(steps, "c")
    assert not seq.sample and seq.mask_row == -1 and steps[0].frames == []
    nxt, _ = step(h, rt, {"c": LD})
    (seq,) = seqs_of(nxt, "c")
    assert seq.backtrack == 1 and seq.tokens == [WOR] and h.text("c") == " he" + BACKTRACK_MARK + " world"


def test_an_ended_forks_worker_free_waits_while_the_next_controlled_part_is_planned():
    h, rt = controlled()
    parent = next_seq_id(h)
    rt.pre[parent] = {"num_forks": 2}
    step(h, rt, {"c": HE, "c/1": LLO})
    fork = h.core.controlled.requests["c"].branches[1].seq_id
    h.core.admit()
    plan, request = h.core.plan_controlled()  # its calls run in the background meanwhile
    h.core.controlled._end(h.core.controlled.by_seq[fork], "aici-stop")
    h.core.end_step()  # a plain step's results came in
    assert fork not in h.core.to_free.get(b"w1", [])
    h.core.build_steps(h.core.controlled_planned(plan, rt.post_pre_process(h, request)))
    h.core.end_step()
    assert fork in h.core.to_free[b"w1"]


def test_a_new_runtime_incarnation_fails_the_requests_bound_to_the_old_one_at_once():
    h, rt = controlled()
    h.submit("plain", prompt(3), 8)
    step(h, rt, {"c": HE})
    h.core.controlled.runtime_heard("100-aaaa")  # the first one heard: nothing is lost
    h.core.controlled.runtime_heard("100-aaaa")
    assert "c" in h.core.requests and not h.failures("c")
    h.submit("d", prompt(3), 4, controller="ctl-2")  # instantiated on the new runtime, not bound yet
    h.core.admit()
    h.core.plan_controlled()
    h.core.controlled.runtime_heard("")  # a reply that names none (an older runtime) changes nothing
    h.core.controlled.runtime_heard("200-bbbb")
    (failed,) = h.failures("c")
    assert failed.code == "service_unavailable" and failed.recoverable
    assert "restarted (incarnation 100-aaaa -> 200-bbbb)" in failed.message
    assert "d" in h.core.requests and "plain" in h.core.requests and not h.failures("d")


def test_a_stop_from_mid_process_ends_the_request():
    h, rt = controlled()
    seq_id = next_seq_id(h)
    rt.mid[seq_id] = "Stop"
    _, masks = step(h, rt, {"c": HE})
    assert "ended in mid_process" in masks[0][0].failures[0].message
    final = h.final("c")
    assert (final.finish_reason, final.fork_finish) == ("stop", "aici-stop")
    step(h, rt)
    assert rt.requests[-1] == aici_wire.PostPreProcess(freed=[seq_id])


def test_a_controller_error_fails_its_branch_and_the_request_reports_it():
    h, rt = controlled()
    step(h, rt, {"c": HE})
    rt.pre_error[h.core.requests["c"].seq_id] = "boom in pre_process"
    step(h, rt)
    final = h.final("c")
    assert (final.finish_reason, final.fork_finish, final.error) == ("error", "fail", "boom in pre_process")


def test_a_failing_runtime_fails_every_controlled_request_and_nothing_else():
    h, rt = controlled()
    h.submit("plain", prompt(3), 8)
    step(h, rt, {"c": HE})
    rt.fail_next = "the controller runtime did not answer post_pre_process within 5 s"
    step(h, rt)
    (failed,) = h.failures("c")
    assert failed.code == "service_unavailable" and failed.recoverable and "did not answer" in failed.message
    assert "plain" in h.core.requests and not h.failures("plain")


def test_a_cancelled_controlled_request_is_reported_freed_to_the_runtime():
    h, rt = controlled()
    step(h, rt, {"c": HE})
    seq_id = h.core.requests["c"].seq_id
    h.core.control(b"gw", wire.Cancel(rid="c"))
    assert h.final("c").finish_reason == "cancelled"
    h.submit("c2", prompt(3), 4, controller="ctl-2")
    step(h, rt)
    assert rt.requests[-2].freed == [seq_id]


def test_branches_suspended_too_long_end_in_deadlock():
    h, rt = controlled()
    seq_id = next_seq_id(h)
    for _ in range(3):
        rt.pre[seq_id] = {"suspend": True}
        steps, _ = step(h, rt)
        assert not seqs_of(steps, "c") or not seqs_of(steps, "c")[0].sample
    final = h.final("c")
    assert (final.finish_reason, final.fork_finish) == ("stop", "deadlock")


def test_a_reply_that_does_not_match_the_protocol_is_refused_and_fails_the_controlled_requests():
    h, rt = controlled()
    step(h, rt, {"c": HE})
    seq_id = h.core.requests["c"].seq_id
    plan, request = h.core.plan_controlled()
    assert request is not None
    with pytest.raises(WireError, match="Expected `int`, got `str` - at `\\$.data.pre_seqs") as bad:
        reply(request, {"pre_seqs": {str(seq_id): {"result": {"num_forks": "two"}}}})
    h.core.controlled_planned(plan, reply(error=f"bad reply from the controller runtime: {bad.value}"))
    (failed,) = h.failures("c")
    assert failed.code == "service_unavailable" and "$.data.pre_seqs" in failed.message


# -- steps that go ahead of their post_pre_process (controllers.step_ahead) ---------------------------


def ahead_pair(**fields: object) -> tuple[Harness, FakeRuntime]:
    """Two controlled requests whose controllers flag pre_process as the default, one step in (bound)."""
    h, rt = controlled(**fields)
    h.submit("d", prompt(3, start=20), 8, controller="ctl-2")
    rt.pre_default = True
    step(h, rt, {"c": HE, "d": WOR})
    return h, rt


def one_default(controllers: Controllers) -> tuple[Harness, FakeRuntime]:
    """One controlled request whose controller flags pre_process as the default, one step in, under ``controllers``."""
    h = Harness(controllers=controllers, prefill_chunk_tokens=16)
    h.worker()
    h.submit("c", prompt(3), 8, controller="ctl-1")
    rt = FakeRuntime()
    rt.pre_default = True
    step(h, rt, {"c": HE})
    return h, rt


def test_a_step_goes_ahead_when_every_controller_flags_its_pre_process_as_the_default():
    h, rt = ahead_pair()
    ahead_steps, masks = step(h, rt, {"c": LLO, "d": LD})
    c, d = h.core.requests["c"].seq_id, h.core.requests["d"].seq_id
    post_pre, mid = rt.requests[-2:]
    # the step fed the sampled tokens and went out before the runtime heard of them; the calls are the usual ones
    assert [(s.seq_id, s.tokens, s.mask_row) for s in ahead_steps[0].step.seqs] == [(c, [HE], 0), (d, [WOR], 1)]
    assert isinstance(post_pre, aici_wire.PostPreProcess) and post_pre.ahead == [c, d]
    assert post_pre.post_ops == [aici_wire.PostOp(id=c, tokens=[HE]), aici_wire.PostOp(id=d, tokens=[WOR])]
    assert isinstance(mid, aici_wire.MidProcess) and [op.id for op in mid.ops] == [c, d]
    assert masks == [(wire.StepMasks(step_id=ahead_steps[0].step.step_id), [b"MASKS"])]
    assert h.text("c") == " hello" and h.text("d") == " world"


def test_a_step_goes_ahead_after_a_splice_of_forced_tokens_feeding_them():
    h, rt = one_default(Controllers(pipeline=False))
    c = h.core.requests["c"].seq_id
    rt.mid[c] = {"Splice": {"backtrack": 0, "ff_tokens": [LLO, WOR]}}
    step(h, rt, {"c": BANG})  # went ahead feeding HE; spliced instead of sampling
    ahead_steps, _ = step(h, rt, {"c": LD})
    post_pre = rt.requests[-2]
    assert ahead_steps[0].step.masks_follow and [(s.seq_id, s.tokens) for s in ahead_steps[0].step.seqs] == [
        (c, [LLO, WOR])]
    assert post_pre.ahead == [c] and post_pre.post_ops == [aici_wire.PostOp(id=c, tokens=[LLO, WOR])]
    assert h.text("c") == " hello world"


def test_no_step_goes_ahead_beside_plain_sequences_or_without_the_flag():
    h, rt = ahead_pair()
    h.submit("p", prompt(2), 8)
    h.core.admit()
    assert not h.core.plan_controlled()[0].ahead  # a plain sequence runs: it must not wait for masks
    h2, rt2 = controlled()
    step(h2, rt2, {"c": HE})
    assert not h2.core.plan_controlled()[0].ahead  # its pre_process was called: it may fork, suspend, ...
    h3, _ = one_default(Controllers(step_ahead=False))
    assert not h3.core.plan_controlled()[0].ahead  # switched off


def test_a_sequence_whose_pre_process_waits_is_fed_not_sampled_then_sampled_by_the_usual_step():
    h, rt = ahead_pair()
    c, d = h.core.requests["c"].seq_id, h.core.requests["d"].seq_id
    rt.waiting = {c}
    ahead_steps, masks = step(h, rt, {"c": LLO, "d": LD})
    ((step_masks, frames),) = masks
    assert [f.seq_id for f in step_masks.failures] == [c]
    assert [op.id for op in rt.requests[-1].ops] == [d]
    assert frames == [bytes(5) + b"MASKS"]  # d's row moved to its place in the step (row 1), c's left empty
    assert h.text("c") == " he" and h.text("d") == " world"
    rt.waiting = set()
    usual, _ = step(h, rt, {"c": LLO, "d": BANG})
    post_pre = rt.requests[-2]
    assert post_pre.ahead == [] and [op.id for op in post_pre.post_ops] == [d]  # c's token was reported already
    (seq_c,) = [s for s in usual[0].step.seqs if s.seq_id == c]
    assert seq_c.tokens == [HE] and seq_c.backtrack == 1 and seq_c.sample  # computed again to sample after it
    assert h.text("c") == " hello" and h.text("d") == " world!"


def test_a_stop_in_post_process_of_a_step_that_went_ahead_ends_only_that_branch():
    h, rt = ahead_pair()
    c, d = h.core.requests["c"].seq_id, h.core.requests["d"].seq_id
    rt.post[c] = {"stop": True}
    _, masks = step(h, rt, {"c": LLO, "d": LD})
    ((step_masks, _),) = masks
    assert [f.seq_id for f in step_masks.failures] == [c]
    assert h.final("c").fork_finish == "aici-stop" and h.text("c") == " he"
    assert h.text("d") == " world" and "d" in h.core.requests
    rt.post[d] = {"stop": True}
    before = len(rt.requests)
    _, masks = step(h, rt, {"d": BANG})
    assert len(rt.requests) == before + 1  # every branch stopped: no mid_process
    assert [f.seq_id for f in masks[0][0].failures] == [d] and masks[0][1] == []
    assert h.final("d").fork_finish == "aici-stop"


def test_a_failed_runtime_call_of_a_step_that_went_ahead_fails_its_requests():
    h, rt = ahead_pair()
    c, d = h.core.requests["c"].seq_id, h.core.requests["d"].seq_id
    rt.fail_next = "the controller runtime did not answer post_pre_process within 5 s"
    _, masks = step(h, rt, {"c": LLO, "d": LD})
    assert {f.seq_id for f in masks[0][0].failures} == {c, d}  # the worker samples neither
    failed = h.failures("c") + h.failures("d")
    assert len(failed) == 2 and all("did not answer" in f.message for f in failed)


# -- steps that follow the one in flight (controllers.pipeline) ---------------------------------------


def follow(h: Harness) -> list[Dispatch]:
    """The next step, built and sent before the result of the one in flight (its calls wait for that)."""
    plan = h.core.follow_controlled()
    assert plan is not None and plan.follows
    steps = h.core.build_steps(plan)
    assert steps and all(d.step.masks_follow for d in steps)
    return steps


def arrive(h: Harness, rt: FakeRuntime, done: list[Dispatch], following: list[Dispatch],
           tokens: dict[str, int] | None = None, **kw: object) -> Masks:
    """``done``'s result comes back while ``following`` runs: it is applied, then ``following``'s calls run;
    the StepMasks sent for ``following``."""
    h.apply(done, tokens, **kw)
    h.core.emit_deferred()
    ahead_calls(h, rt, h.core.controlled.follow_request())
    return [h.core.controlled.step_masks(d.step) for d in following]


def failed_seqs(masks: Masks) -> list[int]:
    return [f.seq_id for step_masks, _ in masks for f in step_masks.failures]


def test_a_step_follows_the_one_in_flight_and_its_calls_wait_for_that_result():
    h, rt = ahead_pair()
    c, d = h.core.requests["c"].seq_id, h.core.requests["d"].seq_id
    first, _ = send(h, rt)
    calls = len(rt.requests)
    nxt = follow(h)
    assert [(s.seq_id, s.tokens, s.follow, s.sample, s.mask_row, s.backtrack) for s in nxt[0].step.seqs] == [
        (c, [], True, True, 0, 0), (d, [], True, True, 1, 0)]  # each feeds what it samples in the step in flight
    assert len(rt.requests) == calls and h.core.follow_controlled() is None  # one step follows, its calls wait
    masks = arrive(h, rt, first, nxt, {"c": LLO, "d": LD})
    post_pre, mid = rt.requests[-2:]
    assert isinstance(post_pre, aici_wire.PostPreProcess) and post_pre.ahead == [c, d] and not post_pre.pre_ops
    assert post_pre.post_ops == [aici_wire.PostOp(id=c, tokens=[LLO]), aici_wire.PostOp(id=d, tokens=[LD])]
    assert isinstance(mid, aici_wire.MidProcess) and [op.id for op in mid.ops] == [c, d]
    assert masks == [(wire.StepMasks(step_id=nxt[0].step.step_id), [b"MASKS"])]
    third = follow(h)
    h.apply(nxt, {"c": WOR, "d": BANG})
    assert h.text("c") == " hello wor" and h.text("d") == " world!"
    branch = h.core.controlled.by_seq[c]
    assert branch.kv_len == len(branch.tokens) - 1  # the step in flight feeds the last sample
    assert [s.seq_id for s in third[0].step.seqs] == [c, d] and h.core.controlled.followed_steps == 2


def test_sampling_changed_while_a_step_is_in_flight_goes_with_the_step_that_follows_it():
    h, rt = ahead_pair()
    c = h.core.requests["c"].seq_id
    first, _ = send(h, rt)
    h.core.control(b"gw", wire.Modify(rid="c", patch=wire.SamplingPatch(temperature=0.5)))
    nxt = follow(h)
    sampling = {s.seq_id: s.sampling for s in nxt[0].step.seqs}
    assert sampling[c] is not None and sampling[c].temperature == 0.5 and list(sampling.values()).count(None) == 1
    arrive(h, rt, first, nxt, {"c": LLO, "d": LD})
    assert all(s.sampling is None for s in follow(h)[0].step.seqs)  # sent once


@pytest.mark.parametrize("how", ["stop token", "stop string", "post_process", "worker failure"])
def test_a_sequence_that_the_token_in_flight_ends_is_fed_not_sampled_and_freed(how):
    fields = {"stop token": {"stop_token_ids": [LLO]}, "stop string": {"stop": ["llo"]}}.get(how, {})
    h, rt = ahead_pair(**fields)
    c, d = h.core.requests["c"].seq_id, h.core.requests["d"].seq_id
    first, _ = send(h, rt)
    nxt = follow(h)
    if how == "post_process":
        rt.post[c] = {"stop": True}  # when it hears of LLO
    failures = {"c": "the KV pool is exhausted"} if how == "worker failure" else None
    masks = arrive(h, rt, first, nxt, {"c": LLO, "d": LD}, failures=failures)
    assert failed_seqs(masks) == [c]  # the worker does not sample it
    h.apply(nxt, {"c": WOR, "d": BANG})
    expected = {"stop token": "eos", "stop string": "stop", "post_process": "aici-stop", "worker failure": "fail"}
    assert h.final("c").fork_finish == expected[how]
    assert WOR not in h.generated("c") and h.text("d") == " world!"
    assert c in follow(h)[0].step.free  # its sequence goes with the next step
    assert "c" not in h.core.requests and "d" in h.core.requests


@pytest.mark.parametrize("where", ["post_process", "mid_process"])
def test_a_request_its_calls_end_finishes_at_once_not_when_the_step_feeding_it_is_done(where):
    h, rt = ahead_pair()
    c, d = h.core.requests["c"].seq_id, h.core.requests["d"].seq_id
    first, _ = send(h, rt)
    nxt = follow(h)
    if where == "post_process":
        rt.post[c] = {"stop": True}  # when it hears of LLO
    else:
        rt.mid[c] = "Stop"
    masks = arrive(h, rt, first, nxt, {"c": LLO, "d": LD})
    assert failed_seqs(masks) == [c]  # nxt feeds it, and samples nothing for it
    assert not [e for e in h.events("c") if e.finish_reason]  # before the shell's call, as before
    h.core.end_controlled()  # the service shell, once the calls are done (nxt still computing)
    final = h.final("c")
    assert (final.fork_finish, final.finish_reason, final.completion_tokens) == ("aici-stop", "stop", 2)
    assert h.text("c") == " hello" and "c" not in h.core.requests
    assert h.text("d") == " world" and not [e for e in h.events("d") if e.finish_reason]  # d's events wait
    events = len(h.events("c"))
    h.apply(nxt, {"c": WOR, "d": BANG})  # nxt's result changes nothing for c
    h.core.end_step()
    assert len(h.events("c")) == events and h.text("d") == " world!"
    assert c in follow(h)[0].step.free  # its sequence goes with the next step


def test_a_sequence_whose_token_in_flight_is_its_last_needs_no_following_step():
    h, rt = ahead_pair(max_tokens=2)
    c, d = h.core.requests["c"].seq_id, h.core.requests["d"].seq_id
    first, _ = send(h, rt)
    nxt = follow(h)
    assert [s.seq_id for s in nxt[0].step.seqs] == [d]
    masks = arrive(h, rt, first, nxt, {"c": LLO, "d": LD})
    assert rt.requests[-2].ahead == [d] and failed_seqs(masks) == []
    final = h.final("c")
    assert (final.finish_reason, final.completion_tokens) == ("length", 2) and h.text("c") == " hello"


def test_a_stop_in_mid_process_ends_only_its_sequence_and_the_others_follow():
    h, rt = ahead_pair()
    c, d = h.core.requests["c"].seq_id, h.core.requests["d"].seq_id
    rt.mid[c] = "Stop"
    first, masks = send(h, rt)
    assert failed_seqs(masks) == [c]
    nxt = follow(h)
    assert [s.seq_id for s in nxt[0].step.seqs] == [d]
    arrive(h, rt, first, nxt, {"c": LLO, "d": LD})
    assert h.final("c").fork_finish == "aici-stop" and h.text("c") == " he" and h.text("d") == " world"


def test_a_pre_process_that_must_run_first_holds_the_sequence_and_its_usual_step_forks_from_the_fed_token():
    h, rt = ahead_pair()
    c, d = h.core.requests["c"].seq_id, h.core.requests["d"].seq_id
    first, _ = send(h, rt)
    nxt = follow(h)
    rt.waiting = {c}  # its controller no longer flags pre_process as the default
    masks = arrive(h, rt, first, nxt, {"c": LLO, "d": LD})
    assert failed_seqs(masks) == [c] and [op.id for op in rt.requests[-1].ops] == [d]
    assert h.core.follow_controlled() is None  # c needs its pre_process: the next step waits for this result
    h.apply(nxt, {"c": WOR, "d": BANG})
    assert h.text("c") == " hello"  # fed, not sampled
    rt.waiting, rt.pre_default = set(), False
    rt.pre[c] = {"num_forks": 2}
    usual, _ = step(h, rt, {"c": WOR, "c/1": LD, "d": HE})
    post_pre, mid = rt.requests[-2:]
    assert post_pre.ahead == [] and [op.id for op in post_pre.post_ops] == [d]  # c's LLO was reported already
    seqs = {s.seq_id: s for s in usual[0].step.seqs}
    fork = h.core.controlled.requests["c"].branches[1].seq_id
    # the follower fed LLO: the parent computes it again to sample after it, the fork copies the KV that holds it
    assert (seqs[c].tokens, seqs[c].backtrack, seqs[c].sample) == ([LLO], 1, True)
    assert (seqs[fork].fork_of, seqs[fork].tokens, seqs[fork].backtrack) == (c, [], 0)
    assert [(op.id, op.clone_id) for op in mid.ops] == [(c, None), (fork, c), (d, None)]
    texts = {i: "".join(e.text for e in h.events("c") if e.index == i) for i in (0, 1)}
    assert texts == {0: " hello wor", 1: "ld"} and h.text("d") == " world! he"


def test_a_splice_that_backtracks_in_a_following_step_takes_the_fed_token_out_of_the_kv():
    h, rt = ahead_pair()
    c = h.core.requests["c"].seq_id
    first, _ = send(h, rt)
    nxt = follow(h)
    rt.mid[c] = {"Splice": {"backtrack": 1, "ff_tokens": [WOR]}}
    masks = arrive(h, rt, first, nxt, {"c": LLO, "d": LD})
    assert failed_seqs(masks) == [c]
    assert h.core.follow_controlled() is None  # c spliced back: its next step is planned the usual way
    h.apply(nxt, {"c": BANG, "d": BANG})
    usual, _ = step(h, rt, {"c": LD, "d": HE})
    (seq,) = [s for s in usual[0].step.seqs if s.seq_id == c]
    assert (seq.backtrack, seq.tokens, seq.follow) == (1, [WOR], False)  # the follower fed LLO
    post_pre = [r for r in rt.requests if isinstance(r, aici_wire.PostPreProcess)][-1]
    assert aici_wire.PostOp(id=c, tokens=[WOR], backtrack=1) in post_pre.post_ops
    assert h.text("c") == " hello" + BACKTRACK_MARK + " world"
    assert BANG not in h.generated("c")


def test_a_splice_of_forced_tokens_in_a_following_step_is_fed_by_the_step_after_it_which_follows_too():
    """A grammar's forced tokens (a Splice, backtrack 0) keep the steps pipelined: the next step goes out before
    the result of the one in flight, feeding the splice and sampling after it, and its calls hear of the splice."""
    h, rt = ahead_pair()
    c, d = h.core.requests["c"].seq_id, h.core.requests["d"].seq_id
    first, _ = send(h, rt)
    nxt = follow(h)
    rt.mid[c] = {"Splice": {"backtrack": 0, "ff_tokens": [WOR, LD]}}
    masks = arrive(h, rt, first, nxt, {"c": LLO, "d": LD})
    assert failed_seqs(masks) == [c]  # fed LLO, not sampled
    third = follow(h)
    assert [(s.seq_id, s.tokens, s.follow, s.sample, s.mask_row) for s in third[0].step.seqs] == [
        (c, [WOR, LD], False, True, 0), (d, [], True, True, 1)]
    masks = arrive(h, rt, nxt, third, {"c": BANG, "d": BANG})  # c's BANG was not sampled: it is dropped
    post_pre, mid = rt.requests[-2:]
    assert post_pre.ahead == [c, d] and post_pre.post_ops == [aici_wire.PostOp(id=c, tokens=[WOR, LD]),
                                                              aici_wire.PostOp(id=d, tokens=[BANG])]
    assert [op.id for op in mid.ops] == [c, d] and failed_seqs(masks) == []
    h.apply(third, {"c": BANG, "d": HE})
    h.core.emit_deferred()
    assert h.text("c") == " hello world!" and h.text("d") == " world! he"
    branch = h.core.controlled.by_seq[c]
    assert branch.tokens[-5:] == [HE, LLO, WOR, LD, BANG] and branch.kv_len == len(branch.tokens) - 1


def test_a_splice_that_reaches_max_tokens_needs_no_following_step():
    h, rt = ahead_pair()
    c, d = h.core.requests["c"].seq_id, h.core.requests["d"].seq_id
    first, _ = send(h, rt)
    nxt = follow(h)
    rt.mid[c] = {"Splice": {"backtrack": 0, "ff_tokens": [WOR] * 6}}  # 2 generated + 6 = max_tokens 8
    arrive(h, rt, first, nxt, {"c": LLO, "d": LD})
    third = follow(h)
    assert [s.seq_id for s in third[0].step.seqs] == [d]
    h.apply(nxt, {"c": BANG, "d": BANG})
    assert h.final("c").finish_reason == "length" and h.text("c") == " hello" + " wor" * 6
    assert sum(e.ff_tokens for e in h.events("c")) == 6


def test_a_controller_error_in_a_following_steps_calls_fails_only_its_sequence():
    h, rt = ahead_pair()
    c, d = h.core.requests["c"].seq_id, h.core.requests["d"].seq_id
    first, _ = send(h, rt)
    nxt = follow(h)
    rt.pre_error[c] = "boom in pre_process"
    masks = arrive(h, rt, first, nxt, {"c": LLO, "d": LD})
    assert failed_seqs(masks) == [c]
    third = follow(h)
    assert [s.seq_id for s in third[0].step.seqs] == [d]
    rt.fail_next = "the controller runtime did not answer post_pre_process within 5 s"
    masks = arrive(h, rt, nxt, third, {"c": WOR, "d": BANG})
    final = h.final("c")
    assert (final.fork_finish, final.error, h.text("c")) == ("fail", "boom in pre_process", " hello")
    assert failed_seqs(masks) == [d] and "did not answer" in h.failures("d")[0].message
    assert h.text("d") == " world!"


def test_a_request_cancelled_while_its_following_step_runs_is_fed_not_sampled():
    h, rt = ahead_pair()
    c, d = h.core.requests["c"].seq_id, h.core.requests["d"].seq_id
    first, _ = send(h, rt)
    nxt = follow(h)
    h.core.control(b"gw", wire.Cancel(rid="c"))
    masks = arrive(h, rt, first, nxt, {"c": LLO, "d": LD})
    post_pre = rt.requests[-2]
    assert failed_seqs(masks) == [c] and post_pre.ahead == [d] and post_pre.freed == [c]
    assert h.final("c").finish_reason == "cancelled" and h.generated("c") == [HE]
    assert c in follow(h)[0].step.free


def test_a_worker_lost_with_two_controlled_steps_in_flight_leaves_nothing_behind():
    h, rt = ahead_pair()
    c, d = h.core.requests["c"].seq_id, h.core.requests["d"].seq_id
    send(h, rt)
    nxt = follow(h)
    h.core.worker_lost(b"w1", "the worker died")
    assert {f.code for rid in "cd" for f in h.failures(rid)} == {"service_unavailable"}
    # neither result comes; the follower's calls still run: the runtime hears that the sequences ended
    ahead_calls(h, rt, h.core.controlled.follow_request())
    post_pre = rt.requests[-1]
    assert isinstance(post_pre, aici_wire.PostPreProcess) and post_pre.ahead == [] and post_pre.freed == [c, d]
    assert set(failed_seqs([h.core.controlled.step_masks(nxt[0].step)])) == {c, d}
    h.worker(b"w2")
    h.submit("e", prompt(3), 4, controller="ctl-3")
    steps, _ = step(h, rt, {"e": HE})  # a new request starts the usual way
    assert steps[0].worker == b"w2" and rt.requests[-2].pre_ops and h.generated("e") == [HE]


def test_no_step_follows_before_the_masks_beside_a_binding_or_plain_sequences_or_when_switched_off():
    h, rt = ahead_pair()
    h.core.admit()
    plan, request = h.core.plan_controlled()
    assert plan.ahead and request is not None
    h.core.build_steps(plan)
    assert h.core.follow_controlled() is None  # the masks of the step in flight are not settled yet
    ahead_calls(h, rt, request)
    h.submit("e", prompt(3), 4, controller="ctl-3")
    h.core.admit()
    assert h.core.follow_controlled() is None  # a new controlled request waits to be bound
    h.core.control(b"gw", wire.Cancel(rid="e"))
    h.submit("p", prompt(2), 8)
    h.core.admit()
    assert h.core.follow_controlled() is None  # a plain sequence runs: no step may wait for masks
    h.core.control(b"gw", wire.Cancel(rid="p"))
    assert h.core.follow_controlled() is not None
    h2, rt2 = one_default(Controllers(pipeline=False))
    steps, _ = send(h2, rt2)
    assert steps[0].step.masks_follow and h2.core.follow_controlled() is None  # switched off


def test_mid_ahead_rows_of_a_sequence_that_ended_while_the_call_ran_are_left_out():
    """The runtime ran mid_process in the post_pre_process call (mid_ahead) for both sequences, but one was
    cancelled meanwhile: the worker samples the other under its own row, moved to its place in the step, and a
    sequence the runtime gave no mid_process result is fed, not sampled."""
    h, rt = ahead_pair()
    c, d = h.core.requests["c"].seq_id, h.core.requests["d"].seq_id
    first, _ = send(h, rt)
    nxt = follow(h)
    h.apply(first, {"c": LLO, "d": LD})
    request = h.core.controlled.follow_request()
    assert request.mid_ahead and request.ahead == [c, d]
    h.core.control(b"gw", wire.Cancel(rid="c"))  # while the call runs
    outcome = {"result": None}
    data = {"pre_seqs": {str(c): {}, str(d): {}}, "post_seqs": {str(c): {}, str(d): {}}, "pre_default": [c, d],
            "mid": {"seqs": {str(c): outcome, str(d): outcome}}, "mid_ids": [c, d]}
    assert h.core.controlled.ahead_planned(reply(request, data, frames=[b"CCCCDDDD"])) is None  # no call of its own
    ((masks, frames),) = [h.core.controlled.step_masks(x.step) for x in nxt]
    assert [f.seq_id for f in masks.failures] == [c] and frames == [bytes(4) + b"DDDD"]
    h.apply(nxt, {"d": BANG})
    assert h.text("d") == " world!" and h.final("c").finish_reason == "cancelled"
    # a runtime that ran it for one sequence only: the other one has no result, it is fed, not sampled
    third = follow(h)
    request = h.core.controlled.follow_request()
    e_data = {"pre_seqs": {str(d): {}}, "post_seqs": {str(d): {}}, "pre_default": [d], "mid": {"seqs": {}},
              "mid_ids": []}
    h.core.controlled.ahead_planned(reply(request, e_data, frames=[]))
    ((masks, frames),) = [h.core.controlled.step_masks(x.step) for x in third]
    assert [f.seq_id for f in masks.failures] == [d] and frames == []
    h.core.end_step()
    assert "no mid_process result" in h.final("d").error
