"""What of a pod's reply may be reported: a pod's body never reaches a status or a router reply, only its
HTTP status, a short reason of ours, and at most MAX_MESSAGE characters of its OpenAI error message with
anything that looks like a credential redacted. A pod that echoes request headers (a debug server, a proxy's
error page) would otherwise put the Bearer token it was sent into a status its reader may not see otherwise.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

MAX_REPLY_BYTES = 64 << 10  # read of any reset reply: a kvpilot pod's reply with 64 ranks is ~6 KiB
MAX_MESSAGE = 256  # characters of a pod's error message that are reported
REDACTED = "[redacted]"

# (pattern, replacement): the header or key name is kept, so a reader still sees what was redacted
_CREDENTIALS = (
    # an Authorization header as text, whatever its scheme: the rest of its value goes
    (re.compile(r"(?i)\b((?:proxy-)?authorization)[\"']?\s*[:=]\s*[^\n,;}]*"), r"\1: " + REDACTED),
    (re.compile(r"(?i)\b(bearer)\s+[^\s\"',;}]+"), r"\1 " + REDACTED),
    # key=value, key: value or "key": "value" for names that usually hold secrets
    (
        re.compile(
            r"(?i)\b(api[_-]?key|access[_-]?token|token|secret|password|passwd)[\"']?\s*[:=]\s*[\"']?[^\s\"',;}]+"
        ),
        r"\1=" + REDACTED,
    ),
    # long base64 / base64url / hex runs: keys, tokens, hashes
    (re.compile(r"[A-Za-z0-9+/_\-]{32,}={0,2}"), REDACTED),
)


def redact(text: str, secrets: Iterable[str | None] = ()) -> str:
    """`text` with the given secrets (the fleet's own token) and anything credential-like replaced."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, REDACTED)
    for pattern, replacement in _CREDENTIALS:
        text = pattern.sub(replacement, text)
    return text


def reported(message: str, secrets: Iterable[str | None] = ()) -> str:
    """A pod's error message as it may be reported: one line, redacted, at most MAX_MESSAGE characters."""
    one_line = " ".join(str(message).split())
    # Redact before cutting, so a cut never leaves the start of a secret that a pattern would have matched.
    clean = redact(one_line[: MAX_MESSAGE * 8], secrets)
    return clean if len(clean) <= MAX_MESSAGE else clean[: MAX_MESSAGE - 3] + "..."
