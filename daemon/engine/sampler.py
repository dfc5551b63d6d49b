"""Next-token choice from the logits of the sampled positions, batched on the logits' device.

Penalties and `min_tokens` reshape the logits of the rows that ask for them; greedy rows take one batched
argmax; random rows are scaled, cut by top-k / top-p / min-p as one batch and drawn by inverse CDF
(cumulative sum, one uniform per row, binary search). Only seeded rows draw their uniform from a
generator of their own, seeded from the request's seed, so a seeded request samples the same tokens
whatever runs beside it. Logprobs come from the fp32 logits as the model produced them. `sample_step`
takes a scheduled step whole: the prompt logprobs its chunks score, and a row for each chunk that ends.
"""

from __future__ import annotations

import torch

from kvpilot.daemon.engine.outputs import TokenLogprob
from kvpilot.daemon.engine.request import Request
from kvpilot.daemon.engine.scheduler import SchedulerOutput

# Top-p looks at the most likely tokens in growing sets and sorts the whole vocabulary only when even the
# larger set does not reach top_p (a flat distribution at a high temperature).
TOP_P_CANDIDATES = (256, 4096)


class Sampler:
    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def sample(
        self, logits: torch.Tensor, requests: list[Request]
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """One token per row (row i belongs to requests[i]), and its logprob where the request
        asks for logprobs or ranks its sequences (n > 1)."""
        logits = logits.float()
        shaped = _apply_penalties(logits, requests)
        # max(dim).indices is argmax (the first of equal maxima, NaN wins as in argmax) at a fraction of its
        # CPU time over a decode step's logits (docs/performance.md, "Server vs the decode bound").
        tokens = shaped.max(dim=-1).indices
        random_rows = [i for i, r in enumerate(requests) if not r.params.greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            drawn = self._draw(shaped.index_select(0, rows), [requests[i] for i in random_rows])
            tokens.index_copy_(0, rows, drawn)
        token_ids = tokens.tolist()
        logprobs: list[TokenLogprob | None] = [None] * len(requests)
        wanted = [i for i, r in enumerate(requests) if r.params.logprobs is not None or r.params.n > 1]
        if wanted:
            found = token_logprobs(
                logits.index_select(0, torch.tensor(wanted, device=logits.device)),
                [token_ids[i] for i in wanted],
                [requests[i].params.logprobs or 0 for i in wanted],
            )
            for i, lp in zip(wanted, found):
                logprobs[i] = lp
        return token_ids, logprobs

    def sample_step(
        self, out: SchedulerOutput, logits: torch.Tensor
    ) -> dict[str, tuple[int, TokenLogprob | None]]:
        """Score prompt positions (prompt logprobs) and sample every chunk that reaches its end;
        sequences forking off a chunk's request sample their first token from its logits row."""
        rows: list[int] = []
        seqs: list[Request] = []
        first = 0
        for c in out.chunks:
            end = c.start + c.num_tokens
            req = c.request
            if req.prompt_logprobs is not None:
                _score_prompt(req, c.logits_from, min(end, req.num_prompt_tokens - 1), logits[first:])
            first += end - c.logits_from
            if c.sample:
                for seq in (req, *(req.forks if not req.output_token_ids else ())):
                    rows.append(first - 1)
                    seqs.append(seq)
        if not rows:
            return {}
        # A decode step samples every row in order: no need to gather a copy of the logits.
        picked = logits if rows == list(range(len(logits))) else logits[rows]
        tokens, logprobs = self.sample(picked, seqs)
        return {s.request_id: (t, lp) for s, t, lp in zip(seqs, tokens, logprobs)}

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _draw(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        dev = logits.device
        temperature = torch.tensor([r.params.temperature for r in requests], device=dev)
        logits = logits / temperature[:, None]
        top_k = [r.params.top_k for r in requests]
        if any(top_k):
            logits = _top_k(logits, top_k)
        probs = torch.softmax(logits, dim=-1)
        cut = [i for i, r in enumerate(requests) if r.params.top_p < 1.0]
        if cut:
            rows = torch.tensor(cut, device=dev)
            top_p = torch.tensor([requests[i].params.top_p for i in cut], device=dev)
            probs = probs.index_copy(0, rows, _top_p(probs.index_select(0, rows), top_p))
        min_p = [r.params.min_p for r in requests]
        if any(min_p):
            floor = torch.tensor(min_p, device=dev)[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < floor, 0.0)
        # Inverse-CDF draw: one uniform per row (not one per vocabulary entry), so a seeded row's
        # generator advances by one number per step whatever else is in the batch.
        cdf = probs.cumsum(dim=-1)
        uniform = torch.rand(len(requests), 1, device=dev)
        for i, req in enumerate(requests):
            if req.params.seed is not None:
                uniform[i] = torch.rand(1, generator=self._generator(req, req.params.seed, dev), device=dev)
        target = (1.0 - uniform) * cdf[:, -1:]  # in (0, total]: never lands on a zero-probability token
        drawn = torch.searchsorted(cdf, target).squeeze(1).clamp_(max=probs.shape[-1] - 1)
        # Non-finite logits (an overflow) must not take the whole batch down: such a row degrades
        # to greedy on what is finite.
        bad = ~torch.isfinite(probs).all(dim=-1)
        if bool(bad.any()):
            greedy = torch.argmax(torch.nan_to_num(logits, nan=float("-inf")), dim=-1)
            drawn = torch.where(bad, greedy, drawn)
        return drawn

    def _generator(self, req: Request, seed: int, device: torch.device) -> torch.Generator:
        g = self._generators.get(req.request_id)
        if g is None:
            g = torch.Generator(device=device)
            g.manual_seed(seed)
            self._generators[req.request_id] = g
        return g


def _score_prompt(req: Request, start: int, stop: int, logits: torch.Tensor) -> None:
    """Logprobs of prompt tokens start+1 .. stop from the logits of positions start .. stop-1."""
    if stop <= start:
        return
    targets = req.all_token_ids[start + 1 : stop + 1]
    top, scored = req.params.prompt_logprobs, req.prompt_logprobs
    assert top is not None and scored is not None  # only for requests that asked for prompt logprobs
    found = token_logprobs(logits[: stop - start], targets, [top] * len(targets))
    scored[start + 1 : stop + 1] = found


def token_logprobs(logits: torch.Tensor, token_ids: list[int], top: list[int]) -> list[TokenLogprob]:
    """Row i: the logprob of token_ids[i] and the top[i] most likely tokens, from fp32 logits."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(token_ids, device=lp.device)
    chosen = lp.gather(1, ids[:, None]).squeeze(1).tolist()
    k = min(max(top, default=0), lp.shape[-1])
    if k:
        top_lp, top_ids = torch.topk(lp, k, dim=-1)
        values, indices = top_lp.tolist(), top_ids.tolist()
    return [
        TokenLogprob(t, c, tuple(zip(indices[i][: top[i]], values[i][: top[i]])) if top[i] and k else ())
        for i, (t, c) in enumerate(zip(token_ids, chosen))
    ]


def _apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """repetition_penalty (vLLM's: positive logits divided, negative multiplied, for every token of
    the prompt and the output) and min_tokens (EOS and stop ids masked); untouched when unused."""
    shaped = logits
    for i, req in enumerate(requests):
        p = req.params
        banned = set()
        if req.stop_ids_blocked:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(req.eos_token_ids))
        if p.repetition_penalty == 1.0 and not banned:
            continue
        if shaped is logits:
            shaped = logits.clone()
        row = shaped[i]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(req.all_token_ids)), device=logits.device)
            picked = row[seen]
            row[seen] = torch.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
        if banned:
            row[torch.tensor(sorted(banned), device=logits.device)] = float("-inf")
    return shaped


def _top_k(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    vocab = logits.shape[-1]
    k_max = min(max(top_k), vocab)
    kth_values = torch.topk(logits, k_max, dim=-1).values
    kth = torch.tensor([min(k, k_max) - 1 if k > 0 else k_max - 1 for k in top_k], device=logits.device)
    cut = kth_values.gather(1, kth[:, None])
    off = torch.tensor([k == 0 for k in top_k], device=logits.device)[:, None]
    cut = cut.masked_fill(off, float("-inf"))
    return logits.masked_fill(logits < cut, float("-inf"))


def _top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (the first always stays)."""
    vocab = probs.shape[-1]
    for k in (*(min(c, vocab) for c in TOP_P_CANDIDATES), vocab):
        values, indices = torch.topk(probs, k, dim=-1)
        mass = values.cumsum(dim=-1)
        if k == vocab or bool((mass[:, -1] >= top_p).all()):
            break
    keep = (mass - values) < top_p[:, None]
    return torch.zeros_like(probs).scatter_(1, indices, values * keep)
