"""Exponential back-off, the one rule every retry loop of the fan-out and the operator waits by."""

from __future__ import annotations

import random


def backoff_delay(n: int, base_s: float, max_s: float, *, jitter: bool = True) -> float:
    """The wait before the n-th retry (n >= 1): base_s * 2**(n-1), at most max_s. With jitter, a share of it
    drawn between half and all, so that callers that failed together do not all come back together; without,
    the exact figure (for a wait that is reported to people, such as "next try in 40s")."""
    # The exponent is bounded: a loop that keeps failing for days must not overflow the float.
    cap: float = min(max_s, base_s * 2 ** min(max(n - 1, 0), 64))  # typeshed: int ** int is Any
    return cap * random.uniform(0.5, 1.0) if jitter else cap
