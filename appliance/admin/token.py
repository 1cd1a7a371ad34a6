"""The admin token: written at start to a file only the server's user can read, sent by
the console as a Bearer token."""

from __future__ import annotations

import os
import secrets
from pathlib import Path


class TokenError(RuntimeError):
    """The admin token file is missing or unreadable."""


def write_token(path: Path) -> str:
    """Make a fresh token and write it to `path` (mode 0600, folder 0700); returns it.

    Written to a new file beside it, then renamed over it: a reader never sees it half
    written, and a symlink planted at `path` is replaced, never written through."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    token = secrets.token_urlsafe(32)
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    fd = os.open(temporary, flags, 0o600)
    try:
        os.write(fd, token.encode())
    finally:
        os.close(fd)
    os.replace(temporary, path)
    return token


def read_token(path: Path) -> str:
    """The token a running server wrote to `path`."""
    try:
        token = path.read_text().strip()
    except FileNotFoundError:
        raise TokenError(
            f"no admin token at {path}: is the appliance running on that port "
            "(or was it given another admin.token_file)?"
        ) from None
    except OSError as exc:
        raise TokenError(f"cannot read the admin token {path}: {exc.strerror}") from None
    if not token:
        raise TokenError(f"the admin token file {path} is empty")
    return token


def remove_token(path: Path, token: str) -> None:
    """Delete the file if it still holds our token (another server may have replaced it)."""
    try:
        if path.read_text().strip() == token:
            path.unlink()
    except OSError:
        pass
