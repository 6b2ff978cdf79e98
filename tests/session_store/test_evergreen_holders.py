"""EvergreenHolders: stored Evergreen sessions no gateway heartbeat renews are orphans (pure)."""

from services.session_store.holders import EvergreenHolders


def test_renewed_sessions_stay_and_unrenewed_ones_go_after_the_grace():
    holders = EvergreenHolders(grace_s=5.0)
    holders.renew(["live"], 0.0)
    assert holders.orphans(["live", "dead"], 1.0) == []  # "dead" is first seen now: it gets the grace too
    holders.renew(["live"], 4.0)
    holders.renew(["live"], 7.0)
    assert holders.orphans(["live", "dead"], 7.0) == ["dead"]
    assert holders.orphans(["live"], 11.0) == []
    assert holders.orphans(["live"], 12.5) == ["live"]  # its gateway stopped renewing it at 7


def test_sessions_closed_meanwhile_are_forgotten():
    holders = EvergreenHolders(grace_s=5.0)
    holders.renew(["a", "b"], 0.0)
    assert holders.orphans(["a"], 1.0) == []
    assert set(holders.renewed) == {"a"}
    assert holders.orphans(["a", "b"], 2.0) == []  # "b" stored again: a new grace from now
    assert holders.orphans(["a", "b"], 6.5) == ["a"]
