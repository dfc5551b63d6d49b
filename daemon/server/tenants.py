"""Server-set tenancy: `--tenant-tokens-file` maps API tokens to tenants, and a tenant's requests are salted
by the server, whatever `cache_salt` their body carries.

A `cache_salt` from the body is the caller's word: any caller that knows or guesses another tenant's salt
shares that tenant's blocks and can time its hits (vLLM 53347). With the file, every generation request
must carry `Authorization: Bearer <token>` of a tenant (or the admin token); a tenant's blocks are keyed
by `tenant:<name>` (and `tenant:<name>:<salt>` when its body names a salt of its own), a salt no other
tenant can produce, since the server writes the prefix and names cannot contain ':'. The admin token's
requests keep the salt they name: the operator's canary runs inside a tenant's scope that way.

The file: one `TENANT TOKEN` per line, `#` comments and blank lines ignored; a tenant may have several
tokens, a token only one tenant. Tokens are held as their SHA-256, so a lookup's time tells nothing of
how much of a presented token matched.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from kvpilot.kv.reset_scope import TENANT_NAME, TENANT_SALT_PREFIX
from kvpilot.protocol.limits import MAX_SCOPE_CHARS

MIN_TOKEN_CHARS = 16
MAX_FILE_BYTES = 1 << 20
MAX_TOKENS = 10_000


class TenantFileError(ValueError):
    """The tenant tokens file cannot be used: the daemon refuses to start rather than serve unsalted."""


def load_tenant_tokens(path: str | Path) -> dict[bytes, str]:
    """The file's tokens (by SHA-256) -> tenant; every problem is an error naming its line."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise TenantFileError(f"cannot read the tenant tokens file: {exc.strerror}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise TenantFileError(f"the tenant tokens file is over {MAX_FILE_BYTES} bytes")
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        raise TenantFileError("the tenant tokens file is not UTF-8") from None
    tokens: dict[bytes, str] = {}
    for n, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise TenantFileError(f"tenant tokens file line {n}: expected 'TENANT TOKEN'")
        tenant, token = parts
        if not TENANT_NAME.fullmatch(tenant):
            raise TenantFileError(
                f"tenant tokens file line {n}: a tenant is 1 to 63 letters, digits, '.', '_' or '-'"
            )
        if len(token) < MIN_TOKEN_CHARS:
            raise TenantFileError(
                f"tenant tokens file line {n}: a token has at least {MIN_TOKEN_CHARS} characters"
            )
        digest = _digest(token.encode())
        if digest in tokens:
            raise TenantFileError(f"tenant tokens file line {n}: this token is given twice")
        tokens[digest] = tenant
        if len(tokens) > MAX_TOKENS:
            raise TenantFileError(f"the tenant tokens file has over {MAX_TOKENS} tokens")
    if not tokens:
        raise TenantFileError("the tenant tokens file names no token")
    return tokens


def tenant_of(token: bytes, tokens: dict[bytes, str]) -> str | None:
    return tokens.get(_digest(token))


def tenant_salt(tenant: str, salt: str | None) -> str:
    """The salt a tenant's request is keyed by: the server's prefix, then the body's own salt if any (a
    reset of scope `tenant` clears both: `cache_scope.is_tenants_salt`)."""
    own = TENANT_SALT_PREFIX + tenant
    return own if salt is None else f"{own}:{salt}"


def salt_room(tenant: str) -> int:
    """How long a tenant's own salt may be: `tenant:<name>:<salt>` must fit what a scoped reset can name."""
    return MAX_SCOPE_CHARS - len(TENANT_SALT_PREFIX + tenant) - 1


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()
