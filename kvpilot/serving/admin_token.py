"""The admin token: where it comes from and how a request proves it holds it."""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping
from pathlib import Path

ENV_VAR = "KVPILOT_ADMIN_TOKEN"


class AdminTokenError(ValueError):
    """The configured token source is unusable (unreadable or empty file)."""


def load_admin_token(
    token_file: str | os.PathLike[str] | None = None, environ: Mapping[str, str] | None = None
) -> str | None:
    """The token from `--admin-token-file` (wins) or `$KVPILOT_ADMIN_TOKEN`; None means no auth.

    A configured but empty source is an error, never "no auth": a broken Secret mount must not
    silently open the admin routes.
    """
    env = os.environ if environ is None else environ
    if token_file is not None:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as exc:
            raise AdminTokenError(f"cannot read the admin token file: {exc.strerror}") from None
        if not token:
            raise AdminTokenError("the admin token file is empty")
        return token
    if ENV_VAR in env:
        token = env[ENV_VAR].strip()
        if not token:
            raise AdminTokenError(f"${ENV_VAR} is set but empty")
        return token
    return None


def bearer_token(authorization_header: str | None) -> bytes | None:
    """The token of an `Authorization: Bearer <token>` header, as raw bytes; None for anything else."""
    if not authorization_header:
        return None
    scheme, _, presented = authorization_header.partition(" ")
    if scheme.lower() != "bearer" or not presented.strip():
        return None
    try:
        # A header that is not valid UTF-8 reaches us with surrogate escapes: keep its raw bytes.
        return presented.strip().encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return None


def authorized(authorization_header: str | None, token: str | None) -> bool:
    """True when no token is configured, or the header is `Bearer <token>` (compared in constant time)."""
    if token is None:
        return True
    raw = bearer_token(authorization_header)
    return raw is not None and hmac.compare_digest(raw, token.encode())
