"""Who a call is for, on every surface: the user that owns what it stores (:mod:`common.tenancy`), the key of its
rate limit, and the cache domain its KV may be shared in. Pure: surfaces pass their headers (HTTP) or metadata
(gRPC).

Identification (``settings.api_auth``): with tokens configured, a call presenting one is its user's, admin iff
the user is in ``admins``; a call presenting none (a surface ``everywhere`` does not guard) is the implicit user
``default_user``, never admin. Without tokens, the ``user_header`` names the user (as rLLM expects a front proxy
to set it), else it is ``default_user``; admin iff the ``role_header`` says ``admin``, or, without that header,
the user is in ``admins``.

Cache domains (``tenants.cache_isolation``): KV computed for one domain is never reused by another, so neither
``cached_tokens`` nor the time to first token tells one user what another sent. ``user``: each user is a domain
of their own once the tokens name more than one user (else there is no one to keep apart); ``groups``: the users
of one ``tenants.cache_groups`` entry share a domain, anyone else is their own; ``none``: one shared domain. A
request's ``cache_salt`` (vLLM's) splits its domain further: only requests with the same salt, in the same
domain, share KV; a salt never joins two domains.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec

from common import wire
from common.config import Settings
from services.gateway.auth import presented_token


@dataclass(frozen=True)
class Tenant:
    principal: wire.Principal
    authenticated: bool  # named by a configured token

    @property
    def user(self) -> str:
        return self.principal.user

    def rate_key(self, address: str) -> str:
        """What ``limits.rate_limit_per_minute`` counts against: the user with auth, else the client's address."""
        return f"user:{self.user}" if self.authenticated else address


def identify(headers: Mapping[str, str], settings: Settings) -> Tenant:
    """The tenant of a call with these headers or gRPC metadata (see the module docstring)."""
    auth = settings.api_auth
    if auth.tokens:
        user = auth.tokens.get(presented_token(headers, auth.key_header))
        if user is None:
            return Tenant(wire.Principal(user=auth.default_user), authenticated=False)
        return Tenant(wire.Principal(user=user, admin=user in auth.admins), authenticated=True)
    user = headers.get(auth.user_header) or auth.default_user
    role = headers.get(auth.role_header)
    admin = user in auth.admins if role is None else role == "admin"
    return Tenant(wire.Principal(user=user, admin=admin), authenticated=False)


def domain_name(user: str, settings: Settings) -> str:
    """The cache domain ``user`` belongs to ("": the shared one)."""
    tenants = settings.tenants
    if tenants.cache_isolation == "none":
        return ""
    if tenants.cache_isolation == "groups":
        group = next((name for name, users in sorted(tenants.cache_groups.items()) if user in users), None)
        return f"group:{group}" if group is not None else f"user:{user}"
    return f"user:{user}" if len(set(settings.api_auth.tokens.values())) > 1 else ""


def cache_domain(tenant: Tenant, salt: str | None, settings: Settings,
                 steering: Sequence[wire.SteeringTerm] = ()) -> str:
    """``Submit.cache_domain`` for a request of ``tenant`` with ``cache_salt`` ``salt``: "" for the shared domain
    without a salt, else a digest (user names and salts never travel to the scheduler or the workers). A steered
    request's KV differs from an unsteered one's (docs/steering.md): its ``steering`` (vector ids are digests of
    their content) is in the digest, so KV is reused only between requests steered the same way."""
    name = domain_name(tenant.user, settings)
    if not name and not salt and not steering:
        return ""
    key = f"{name}\0{salt or ''}"
    if steering:
        key += "\0" + msgspec.json.encode(list(steering)).decode()
    return hashlib.blake2b(key.encode(), digest_size=16).hexdigest()
