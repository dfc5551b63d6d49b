"""What the router pays to tokenize a prompt: its SegmentTokenizer (router/routing/segment_tokenizer.py)
against the tokenizer it wraps (the default model's, `encode` as the daemon calls it), on three families of
prompts, each prompt's last line new (no cache keyed on a whole text serves it):

- chat: bench/router_cost.py's chats (one of 8 system prompts, a question of its own), rendered by the
  model's chat template;
- completion: the same as one text, "{system}\\n\\n{question}" (no added token in it: one piece);
- document: a 3 KB document of 40 lines, then a question of its own (a few-shot preamble, a document asked
  about again and again).

Each family: the same prompts through both, CPU time (the thread's clock) per prompt after a warm-up,
with the garbage collector off while timing (the router freezes its start-up objects; a collection here
would land on whichever side it happened to), and the ids compared on every prompt timed. One JSON file
under bench/results/.

    .venv/bin/python bench/prompt_tokens.py            # 10,000 prompts a family
    .venv/bin/python bench/prompt_tokens.py --prompts 2000
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1] / "hack" / "lib"))  # benchkit
import benchkit  # noqa: E402

RESULTS = Path(__file__).parent / "results"
WARM = 1000  # prompts encoded before timing: the system prompts', the document's lines and common words seen

DOCUMENT = "\n".join(
    f"Section {k}: the {w} of the fleet is kept in the runbook, step {k}, with care."
    for k, w in enumerate(["state", "size", "cost", "load", "drift"] * 8)
)


def _families(template: Callable[[list[dict]], str]) -> dict[str, Callable[[int], str]]:
    router_cost = benchkit.bench_module(Path(__file__).parent / "router_cost.py")
    systems = router_cost.SYSTEMS

    def question(i: int) -> str:
        return f"Question {i}: what does step {i % 7} of the runbook do, in brief?"

    return {
        "chat": lambda i: template(
            [{"role": "system", "content": systems[i % 8]}, {"role": "user", "content": question(i)}]
        ),
        "completion": lambda i: f"{systems[i % 8]}\n\n{question(i)}",
        "document": lambda i: f"{DOCUMENT}\n\n{question(i)}",
    }


def _cpu_us(encode: Callable[[str], list[int]], texts: list[str]) -> tuple[float, list[list[int]]]:
    gc.collect()
    gc.disable()
    try:
        start = time.thread_time()
        ids = [encode(t) for t in texts]
        return (time.thread_time() - start) / len(texts) * 1e6, ids
    finally:
        gc.enable()


def measure(prompts: int) -> dict:
    from transformers import AutoTokenizer

    from kvpilot.default_model import ensure_default_model
    from kvpilot.router.routing.segment_tokenizer import SegmentTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ensure_default_model())
    segments = SegmentTokenizer(tokenizer)

    def render(messages: list[dict]) -> str:
        text: str = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return text

    out: dict = {}
    for name, make in _families(render).items():
        texts = [make(i) for i in range(WARM + prompts)]
        specials = (
            name != "chat"
        )  # a chat's text holds its own; a completion gets the model's, as the daemon's
        for t in texts[:WARM]:
            segments.encode(t, specials)
        timed = texts[WARM:]
        ours, ours_ids = _cpu_us(lambda t: segments.encode(t, specials), timed)  # noqa: B023
        theirs, their_ids = _cpu_us(lambda t: tokenizer.encode(t, add_special_tokens=specials), timed)  # noqa: B023
        mismatched = sum(a != list(b) for a, b in zip(their_ids, ours_ids, strict=True))
        if mismatched:
            raise SystemExit(f"{name}: {mismatched} prompts tokenized differently")
        out[name] = {
            "prompts": prompts,
            "chars_mean": round(sum(map(len, timed)) / len(timed)),
            "tokens_mean": round(sum(map(len, their_ids)) / len(their_ids), 1),
            "tokenizer_us": round(theirs, 1),
            "segment_tokenizer_us": round(ours, 1),
            "tokenizer_over_segment_tokenizer": round(theirs / ours, 2),
        }
        print(name, out[name], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=10_000, help=f"prompts timed a family (after {WARM} warm)")
    ap.add_argument("--label", default="", help="a note kept in the JSON (e.g. before/after)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    load = os.getloadavg()
    families = measure(args.prompts)
    doc = benchkit.header("prompt-tokens", load) | {
        "kvpilot_commit": benchkit.git_head(),
        "label": args.label,
        "families": families,
    }
    benchkit.write(args.out or benchkit.default_path(RESULTS, "prompt-tokens"), doc)


if __name__ == "__main__":
    main()
