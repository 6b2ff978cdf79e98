"""PeerWatch: when the work handed to a peer must be given up (pure: fed heartbeats, drops and ticks)."""

from common.incarnation import PeerWatch, new_incarnation, process_incarnation


def watch() -> PeerWatch:
    return PeerWatch(silence_s=5.0, suspect_grace_s=1.0)


def test_incarnations_are_fresh_but_one_per_process():
    assert new_incarnation() != new_incarnation()
    assert process_incarnation() == process_incarnation()


def test_a_steady_peer_loses_nothing():
    w = watch()
    for t in range(10):
        assert w.heard("a", float(t)) is None
        assert w.check(t + 0.5, busy=True) is None


def test_a_new_incarnation_means_the_work_is_lost_and_is_then_adopted():
    w = watch()
    w.heard("a", 0.0)
    assert "restarted" in w.heard("b", 1.0)
    w.forget(1.0)
    assert w.heard("c", 2.0) is None  # work started since the loss belongs to the new life
    assert w.heard("c", 3.0) is None


def test_a_dropped_connection_must_be_answered_within_the_grace():
    w = watch()
    w.heard("a", 0.0)
    w.disconnected(1.0)
    assert w.check(1.9, busy=True) is None
    assert "did not answer within 1 s" in w.check(2.1, busy=False)


def test_a_drop_answered_by_the_same_life_is_a_blip():
    w = watch()
    w.heard("a", 0.0)
    w.disconnected(1.0)
    assert w.heard("a", 1.5) is None
    assert w.check(3.0, busy=True) is None


def test_a_drop_answered_by_a_new_life_is_a_loss():
    w = watch()
    w.heard("a", 0.0)
    w.disconnected(1.0)
    assert w.heard("b", 1.5) is not None


def test_silence_counts_only_while_work_is_in_flight():
    w = watch()
    w.heard("a", 0.0)
    assert w.check(10.0, busy=False) is None
    assert "did not answer for 5 s" in w.check(10.0, busy=True)
    w.forget(10.0)
    assert w.check(12.0, busy=True) is None  # the silence is counted again from the loss


def test_a_peer_never_heard_from_is_not_judged_silent():
    assert watch().check(100.0, busy=True) is None
