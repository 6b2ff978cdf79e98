"""Who a call is for and which cache domain it runs in (services/gateway/tenants.py), without sockets."""

from __future__ import annotations

from common.config import Settings
from services.gateway.tenants import cache_domain, domain_name, identify

TOKENS = {"a-token": "alice", "b-token": "bob", "r-token": "root"}


def settings(**tenants: object) -> Settings:
    return Settings(api_auth={"tokens": TOKENS, "admins": ["root"]}, tenants=tenants)


def test_a_token_names_its_user_and_no_token_is_the_implicit_user_never_admin():
    s = settings()
    alice = identify({"authorization": "Bearer a-token"}, s)
    assert (alice.user, alice.principal.admin, alice.authenticated) == ("alice", False, True)
    assert identify({"api-key": "r-token"}, s).principal.admin
    for headers in ({}, {"authorization": "Bearer wrong"}, {"x-user-id": "root", "x-user-role": "admin"}):
        anyone = identify(headers, s)  # the proxy headers count only without tokens
        assert (anyone.user, anyone.principal.admin, anyone.authenticated) == ("localhost", False, False)
    assert alice.rate_key("10.0.0.1") == "user:alice" and anyone.rate_key("10.0.0.1") == "10.0.0.1"


def test_without_tokens_everyone_is_the_implicit_admin_unless_a_proxy_says_otherwise():
    s = Settings()
    assert identify({}, s).principal.admin
    assert identify({}, s).user == "localhost"
    proxied = identify({"x-user-id": "carol"}, s)
    assert (proxied.user, proxied.principal.admin) == ("carol", False)
    assert identify({"x-user-id": "carol", "x-user-role": "admin"}, s).principal.admin


def test_cache_domains_keep_users_apart_and_a_salt_splits_but_never_joins():
    s = settings()
    alice, bob = (identify({"authorization": f"Bearer {t}"}, s) for t in ("a-token", "b-token"))
    assert cache_domain(alice, None, s) != cache_domain(bob, None, s)
    assert cache_domain(alice, None, s) == cache_domain(alice, None, s) != ""
    assert cache_domain(alice, "x", s) not in (cache_domain(alice, None, s), cache_domain(bob, "x", s))
    assert cache_domain(alice, "x", s) == cache_domain(alice, "x", s)
    shared = settings(cache_isolation="none")
    assert cache_domain(alice, None, shared) == cache_domain(bob, None, shared) == ""
    assert cache_domain(alice, "x", shared) == cache_domain(bob, "x", shared) != ""
    grouped = settings(cache_isolation="groups", cache_groups={"team": ["alice", "bob"]})
    assert domain_name("alice", grouped) == domain_name("bob", grouped) != domain_name("root", grouped)


def test_one_user_or_none_has_no_one_to_keep_apart():
    one = Settings(api_auth={"tokens": {"t1": "alice", "t2": "alice"}})
    assert domain_name("alice", one) == domain_name("localhost", one) == ""
    implicit = Settings()
    assert cache_domain(identify({}, implicit), None, implicit) == ""  # today's clients: today's hashes
