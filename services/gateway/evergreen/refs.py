"""External chunk refs: ``file://`` URIs under one allow-listed directory, nothing else.

``file:///abs/path`` must lie under the root; ``file://rel/path`` (the spec's own form,
``file://path/to/file/part1``) is taken relative to the root. ``..`` components, symlinks leading
out of the root and every other scheme are refused.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from urllib.parse import unquote, urlsplit

import grpc

from services.gateway.evergreen.errors import SessionAbort


def resolve_ref(uri: str, root: Path) -> Path:
    """The file ``uri`` names under ``root`` (resolved); any other ref aborts with the reason."""
    parts = urlsplit(uri)
    if parts.scheme != "file":
        scheme = f"scheme {parts.scheme!r}" if parts.scheme else "no scheme"
        raise SessionAbort.invalid(f"ref {uri!r}: only file:// refs are supported ({scheme})")
    host = "" if parts.netloc in ("", "localhost") else parts.netloc
    path = PurePosixPath(unquote(host + parts.path)) if host else PurePosixPath(unquote(parts.path))
    if ".." in path.parts:
        raise SessionAbort.invalid(f"ref {uri!r}: '..' is not allowed in a ref")
    if str(path) in (".", "/"):
        raise SessionAbort.invalid(f"ref {uri!r}: names no file")
    target = Path(path) if path.is_absolute() else root / path
    resolved = target.resolve()
    if not resolved.is_relative_to(root):
        raise SessionAbort.invalid(f"ref {uri!r}: outside the allowed directory {str(root)!r}")
    return resolved


def read_ref(uri: str, root: Path, limit: int) -> bytes:
    """The bytes of a ref (at most ``limit``); a missing or unreadable file aborts."""
    path = resolve_ref(uri, root)
    try:
        with path.open("rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise SessionAbort.invalid(f"ref {uri!r}: cannot be read ({exc.strerror or exc})") from None
    if len(data) > limit:
        raise SessionAbort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"ref {uri!r}: larger than the session's {limit} byte limit")
    return data
