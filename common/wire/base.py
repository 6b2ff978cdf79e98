"""What every message of :mod:`common.wire` is built on: ``Msg`` (the tagged base), the bounded field types, the
caller (``Principal``), and the replies any channel may give (``Ok``, ``Error``)."""

from __future__ import annotations

from typing import Annotated

import msgspec


# Bounded fields of the messages whose values a service stores or indexes with as they come (the session store's
# SQLite integers and uint32 token arrays): a value out of range is a malformed message, refused at decode with the
# field named, instead of an OverflowError deep in the service. Token ids and positions are salience.proto's uint32.
Count = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
U32 = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]
Finite = Annotated[float, msgspec.Meta(ge=-1.7976931348623157e308, le=1.7976931348623157e308)]  # no inf, no nan


class Principal(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Who makes a call, as the gateway identified them (``api_auth``): stored objects belong to ``user``, and
    an ``admin`` reaches every user's (:func:`common.tenancy.may_access`)."""

    user: str
    admin: bool = False


class Msg(msgspec.Struct, tag_field="type", kw_only=True, omit_defaults=True):
    """Base of every internal message. ``mid`` matches a reply to its request."""

    mid: int = 0


class Ok(Msg, tag="ok"):
    """Done; nothing to report back (replies that carry data have their own types)."""


class Error(Msg, tag="error"):
    code: str
    message: str
    rid: str = ""
