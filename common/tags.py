"""Tags: the names users give content-addressed objects (controller modules, steering vectors), and the one set of
rules both keepers apply (services/controller_runtime/registry.py, services/session_store/vectors.py).

A tag is AICI's: it starts with a letter, uses [A-Za-z0-9_.-], is at most 50 characters, and does not look like an
id (more than 20 hex digits). A non-admin may only set ``<user>.<name>`` (the name without dots). A tag belongs to
the user who first set it. A tag an admin set is public (the server's catalogue: every user sees and uses it); any
other tag exists only for its owner and admins (:func:`common.tenancy.may_access`), and to anyone else it is
unknown, as a name no one set. Only its owner or an admin may move it; moving keeps its owner and publicity.
"""

from __future__ import annotations

import re

from common.tenancy import may_access
from common.wire import Principal

MAX_TAG_LEN = 50
_TAG = re.compile(r"[A-Za-z][A-Za-z0-9_.\-]*")
_HEX = re.compile(r"[0-9a-fA-F]+")


class TagError(ValueError):
    """A tag refused: malformed, not the caller's to set, or another user's to move (the message says which)."""


def check_tag(tag: object, user: str, is_admin: bool, kind: str = "module") -> str:
    """``tag`` if ``user`` may set it (see the module docstring); else TagError. ``kind`` names the objects tagged
    (the message for a tag that looks like one's id)."""
    if not isinstance(tag, str) or not tag:
        raise TagError("a tag must be a non-empty string")
    if len(tag) > MAX_TAG_LEN:
        raise TagError(f"tag {tag!r} is longer than {MAX_TAG_LEN} characters")
    if not _TAG.fullmatch(tag):
        raise TagError(f"tag {tag!r} must start with a letter and use only letters, digits, '_', '.', '-'")
    if len(tag) > 20 and _HEX.fullmatch(tag):
        raise TagError(f"tag {tag!r} looks like a {kind} id")
    # one dot after the user's name: a user named 'a' cannot take (nor learn of) user 'a.b''s tag 'a.b.x'
    if not is_admin and not (tag.startswith(f"{user}.") and "." not in tag[len(user) + 1:]):
        raise TagError(f"tag {tag!r} must start with {user + '.'!r} and have no other dot (only admins may "
                       "set other tags)")
    return tag


def visible(owner: str, public: bool, who: Principal) -> bool:
    """Whether ``who`` sees (and may use) a tag owned by ``owner``."""
    return public or may_access(owner, who)


def check_move(tag: str, owner: str | None, who: Principal) -> None:
    """TagError unless ``who`` may point ``tag`` (owned by ``owner``; None: no one set it yet) somewhere."""
    if owner is not None and not may_access(owner, who):
        raise TagError(f"tag {tag!r} belongs to another user; only they or an admin may move it")


def new_tag(who: Principal) -> tuple[str, bool]:
    """The owner and publicity of a tag ``who`` sets first: theirs, public when they are an admin."""
    return who.user, who.admin
