"""Per-user quotas (``settings.tenants``, ``steering.max_vectors_per_user``; docs/tenants.md): the one decision each
limit's keeper asks. Pure: the keeper counts what the user holds (the session store their sessions, their tokens
and their steering vectors, the scheduler the user's live generations, the controller runtime the modules they
uploaded) and refuses with :class:`QuotaExceeded`, which every surface answers as HTTP 429 ``rate_limited`` / gRPC
``RESOURCE_EXHAUSTED``.
"""

from __future__ import annotations

from common.errors import RATE_LIMITED


class QuotaExceeded(Exception):
    """A call that would take its user past a quota; the message names the setting."""

    code = RATE_LIMITED

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def check(setting: str, limit: int, user: str, held: int, adding: int, what: str, section: str = "tenants") -> None:
    """Raise :class:`QuotaExceeded` when ``user``, holding ``held`` ``what``, may not hold ``adding`` more under
    ``<section>.<setting>`` = ``limit`` (0: no limit). Taking nothing more is always allowed."""
    if limit <= 0 or adding <= 0 or held + adding <= limit:
        return
    raise QuotaExceeded(f"user {user!r} holds {held} {what}; {adding} more would pass {section}.{setting} = {limit}")
