"""Who a call is for, on every surface: the user that owns what it stores (:mod:`common.tenancy`) and the key of
its rate limit. Pure: surfaces pass their headers (HTTP) or metadata (gRPC).

Identification (``settings.api_auth``): with tokens configured, a call presenting one is its user's, admin iff
the user is in ``admins``; a call presenting none (a surface ``everywhere`` does not guard) is the implicit user
``default_user``, never admin. Without tokens, the ``user_header`` names the user (as rLLM expects a front proxy
to set it), else it is ``default_user``; admin iff the ``role_header`` says ``admin``, or, without that header,
the user is in ``admins``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

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

