"""Who may reach a stored object: the one owner check every store of user objects asks (the session store's
sessions, request records and feedback; the controller runtime's tags; steering vectors when they land).

An object belongs to the user who made it. Its owner and admins reach it; to anyone else it does not exist:
the store answers as for an unknown id (NOT_FOUND / 404), never with a hint that the id is taken. Without
``api_auth`` tokens every caller is the one implicit user (``api_auth.default_user``), who owns everything.
"""

from __future__ import annotations

from common.wire import Principal


def may_access(owner: str, who: Principal) -> bool:
    """Whether ``who`` may see and use an object owned by ``owner``."""
    return who.admin or owner == who.user
