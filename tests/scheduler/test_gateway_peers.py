"""The scheduler's book of gateways (services/scheduler/gateways.py): one peer per ZeroMQ identity, lost when
silent or heard again under a new incarnation; only heartbeating gateways are watched."""

from __future__ import annotations

from collections import Counter

from services.scheduler.gateways import Gateways


def test_each_identity_is_a_peer_of_its_own_and_only_the_silent_one_expires():
    book = Gateways(silence_s=10.0)
    assert not book.heard(b"gateway-h-1", "1-aa", now=0.0)
    assert not book.heard(b"gateway-h-2", "1-bb", now=0.0)
    assert not book.heard(b"gateway-h-1", None, now=8.0)  # any message counts as heard
    assert not book.heard(b"gateway-h-2", "1-bb", now=5.0)
    assert book.expired(now=12.0) == []
    assert book.expired(now=15.5) == [b"gateway-h-2"]
    lines = book.figures(Counter({b"gateway-h-1": 3, b"gateway-h-2": 9}), now=16.0)
    assert [(g.gateway, g.incarnation, g.requests, g.silent_s) for g in lines] == [("gateway-h-1", "1-aa", 3, 8.0)]


def test_a_new_incarnation_under_a_known_identity_loses_the_old_lifes_requests():
    book = Gateways(silence_s=10.0)
    book.heard(b"g", "1-aa", now=0.0)
    assert book.heard(b"g", "2-cc", now=1.0)
    assert not book.heard(b"g", "2-cc", now=2.0)
    assert book.figures(Counter(), now=2.0)[0].incarnation == "2-cc"


def test_a_client_that_never_beats_is_not_watched():
    book = Gateways(silence_s=1.0)
    assert not book.heard(b"tiller-check", None, now=0.0)
    assert book.figures(Counter(), now=0.0) == [] and book.expired(now=100.0) == []
