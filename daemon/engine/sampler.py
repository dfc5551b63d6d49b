"""Next-token choice from the logits of the sampled positions.

Greedy rows are one batched argmax. Random rows draw with the request's own generator, seeded from its
`seed` when given, so a seeded request samples the same tokens whatever runs beside it.
"""

from __future__ import annotations

import torch

from kvpilot.daemon.engine.request import Request


class Sampler:
    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        logits = logits.float()
        tokens = torch.argmax(logits, dim=-1).tolist()
        for row, req in enumerate(requests):
            if not req.params.greedy:
                tokens[row] = self._sample_row(logits[row], req)
        return tokens

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _generator(self, req: Request) -> torch.Generator:
        g = self._generators.get(req.request_id)
        if g is None:
            g = torch.Generator()
            if req.params.seed is not None:
                g.manual_seed(req.params.seed)
            else:
                g.seed()
            self._generators[req.request_id] = g
        return g

    def _sample_row(self, logits: torch.Tensor, req: Request) -> int:
        p = req.params
        logits = logits.cpu() / p.temperature
        if p.top_k > 0:
            kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if not bool(torch.isfinite(probs).all()):
            # Non-finite logits (an overflow) must not take the whole engine down in multinomial:
            # this request degrades to greedy on what is finite.
            return int(torch.argmax(torch.nan_to_num(logits, nan=float("-inf"))).item())
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # Keep the smallest set whose mass reaches top_p (the first token always stays).
            drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= p.top_p
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
            probs = probs / probs.sum()
        return int(torch.multinomial(probs, 1, generator=self._generator(req)).item())
