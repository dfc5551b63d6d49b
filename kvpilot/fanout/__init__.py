"""Reset (or warm) the prefix caches of a list of targets over HTTP: who is called, how often, with what result.

Owned by neither the operator nor the router; both call it. A caller builds `Target`s (a name plus an IP or
a base URL) and `ResetSettings`, makes one `run_fanout` call, and maps the `PodResult`s it gets back to
its own shape (the operator to PrefixCacheReset status, the router to its JSON answer). Nothing here knows
Kubernetes, kopf or either caller's metrics.

- `targets.py`: what is called, and how: `CallSettings` for any call, `ResetSettings` for a reset's.
- `phase.py`: one call or a sequence of calls to every target (a weight update's phases), no reset.
- `engines.py`: how kvpilot's, vLLM's and SGLang's reset endpoints are called and their replies judged.
- `caller.py`: the sliding-window caller: retries, backoff, deadline, shutdown grace (`run_window`, which a
  warm-up runs too).
- `warmup.py`: a warm-up's calls: prompts to every pod and rank, then again, and each pod's warm verdict.
- `results.py`: per-pod and per-rank results, under the daemon's field names.
- `backoff.py`: the exponential back-off of every retry loop, the operator's included.
"""

from kvpilot.fanout.caller import Checkpoint, OnCall, PodGone, run_fanout
from kvpilot.fanout.results import Outcome, PodResult, RankResult, Verified, initial_results
from kvpilot.fanout.targets import CallSettings, ResetSettings, Target

__all__ = [
    "Checkpoint",
    "CallSettings",
    "OnCall",
    "Outcome",
    "PodGone",
    "PodResult",
    "RankResult",
    "ResetSettings",
    "Target",
    "Verified",
    "initial_results",
    "run_fanout",
]
