"""The decode bound: the engine's own model weights in a plain torch loop over a static KV cache.

What serving this load cannot beat on the same cores and threads: no HTTP, no scheduler, no paging, no
block tables, no attention plan, no sampler, just the model's matmuls and an attention over contiguous,
preallocated K/V. It computes what the daemon computes for the same prompts (greedy, stopping at EOS),
and `bench/serve.py --vs-bound` checks that its tokens are the daemon's.

The work is the daemon's too, not more: the prompts' common prefix (the shared system prompt, which the
daemon's prefix cache computes once) is prefilled once and its K/V kept once, [Hkv, P, D] per layer,
read by every row's queries in one matmul; the rows' own suffixes are prefilled as one padded batch and
their K/V, with the decoded tokens', go to a static tail cache [B, Hkv, T, D]. Each decode step runs the rows still
unfinished as one batch; a row that stops (EOS or max_tokens) is dropped from the batch.

`compiled=True` (`bench/serve.py --vs-bound --compiled`) runs that forward, prefix, suffixes and decode
steps alike, under torch.compile as the daemon's `-O1` runs its step (daemon/engine/compile/forward.py:
inductor, dynamic shapes). Unlike the daemon's step, the attention and the KV write are in the graph
too: nothing in them is opaque here. A shape torch.compile has not seen compiles on first use (a batch
of one row is a shape of its own): warm it up on the same load before timing it.

    .venv/bin/python bench/torch_bound.py          # the load of bench/serve.py --vs-bound, once
    .venv/bin/python bench/torch_bound.py --compiled   # compiled: once untimed, then once timed
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class _Layer:
    in_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


class TorchBound:
    """`generate(prompts, max_tokens)` with the weights of kvpilot's `LlamaForCausalLM` `model`."""

    def __init__(
        self,
        model,  # noqa: ANN001 - LlamaForCausalLM
        eos_token_ids: frozenset[int],
        compiled: bool = False,
    ) -> None:
        a = model.args
        self.heads, self.kv_heads, self.dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.eps = a.rms_norm_eps
        self.eos = eos_token_ids
        # Dense weights, read back where the engine keeps them in panels (`weights()`): this loop is torch's.
        weights = {name: w.read() for name, w in model.weights().items()}
        self.embed = weights["embed_tokens.weight"]
        self.head = self.embed if model.lm_head is None else weights["lm_head.weight"]
        self.norm = model.norm
        self.rope = model.rope  # [max_position, D]: cat(cos, sin) of the D/2 angles
        self.layers = [
            _Layer(
                layer.input_layernorm,
                weights[f"layers.{i}.self_attn.qkv_proj.weight"],
                layer.self_attn.qkv_proj.bias,
                weights[f"layers.{i}.self_attn.o_proj.weight"],
                layer.post_attention_layernorm,
                weights[f"layers.{i}.mlp.gate_up_proj.weight"],
                weights[f"layers.{i}.mlp.down_proj.weight"],
            )
            for i, layer in enumerate(model.layers)
        ]
        # -O1's settings: torch.compile's default backend (inductor), one graph for every size but 0 and 1
        self._step = torch.compile(self._forward, dynamic=True) if compiled else self._forward

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_tokens: int) -> dict:
        """Greedy completions (EOS included, as OpenAI usage counts it) and the time they took."""
        start = time.perf_counter()
        p = _common_prefix(prompts)
        rows = len(prompts)
        tail_len = max(len(x) for x in prompts) - p + max_tokens
        shape = (rows, self.kv_heads, tail_len, self.dim)
        # prefix[i] / tail[i]: layer i's (K, V); the tail cache is allocated once, for the whole run, as
        # zeros: a slot not written yet is masked, and must not be a NaN that the mask cannot hide.
        prefix: list[tuple[torch.Tensor, torch.Tensor]] = []
        tail = [(torch.zeros(shape), torch.zeros(shape)) for _ in self.layers]
        self._step(torch.tensor([prompts[0][:p]]), torch.arange(p)[None], prefix, None, None, 0, None)
        lens = [len(x) - p for x in prompts]  # each row's tokens in the tail cache
        # The suffixes as one batch, padded on the right to the longest: a padding token's K/V land past
        # its row's suffix, where no real query looks (causal) and the row's decoded tokens overwrite them.
        width = max(lens)
        ids = torch.tensor([x[p:] + [x[-1]] * (width - n) for x, n in zip(prompts, lens)])
        pos = torch.arange(p, p + width).expand(rows, width)
        start_at = torch.zeros(rows, dtype=torch.int64)
        first = self._step(ids, pos, prefix, tail, start_at, width, torch.tensor(lens) - 1)
        out: list[list[int]] = [[t] for t in first.max(-1).indices.tolist()]
        active = [r for r in range(rows) if not self._done(out[r], max_tokens)]
        prefill_s = time.perf_counter() - start
        steps = []
        while active:
            t0 = time.perf_counter()
            ids = torch.tensor([[out[r][-1]] for r in active])
            pos = torch.tensor([[p + lens[r]] for r in active])
            start_at = torch.tensor([lens[r] for r in active])
            last = torch.zeros(len(active), dtype=torch.int64)  # one token a row: the one sampled
            logits = self._step(ids, pos, prefix, tail, start_at, max(lens[r] for r in active) + 1, last)
            for r, t in zip(active, logits.max(-1).indices.tolist()):  # greedy: argmax, at less CPU
                out[r].append(t)
                lens[r] += 1
            keep = [i for i, r in enumerate(active) if not self._done(out[r], max_tokens)]
            if len(keep) < len(active):  # drop the finished rows: later steps do not compute them
                index = torch.tensor(keep, dtype=torch.int64)
                tail = [(k.index_select(0, index), v.index_select(0, index)) for k, v in tail]
                active = [active[i] for i in keep]
            steps.append(time.perf_counter() - t0)
        return {
            **completion_figures(out, time.perf_counter() - start),
            "prefill_seconds": prefill_s,
            "decode_steps": len(steps),
            "decode_step_ms": statistics.median(steps) * 1e3 if steps else None,
            "shared_prefix_tokens": p,
        }

    def _done(self, tokens: list[int], max_tokens: int) -> bool:
        return tokens[-1] in self.eos or len(tokens) >= max_tokens

    def _forward(
        self,
        ids: torch.Tensor,  # [b, n]
        positions: torch.Tensor,  # [b, n]
        prefix: list[tuple[torch.Tensor, torch.Tensor]],
        tail: list[tuple[torch.Tensor, torch.Tensor]] | None,
        tail_start: torch.Tensor | None,  # [b]: where each row's n new tokens go in the tail cache
        width: int,  # tail tokens attended: max(tail_start) + n, passed in so no graph reads a tensor's value
        last: torch.Tensor | None,  # [b]: each row's last real token (the rest is padding)
    ) -> torch.Tensor | None:
        """The logits of each row's last real token, [b, vocab]. Without `tail`, the tokens are the
        prefix: its K/V are appended to `prefix`, no logits. With it, they follow the prefix and each
        row's first `tail_start` tail tokens."""
        b, n = ids.shape
        cs = self.rope[positions]  # [b, n, D]
        half = self.dim // 2
        cos = torch.cat((cs[..., :half], cs[..., :half]), -1)[:, :, None]
        sin = torch.cat((cs[..., half:], cs[..., half:]), -1)[:, :, None]
        mask = None if tail is None else self._mask(n, tail_start, width, prefix[0][0].shape[1])
        h = F.embedding(ids, self.embed)
        for i, w in enumerate(self.layers):
            x = _rms(h, w.in_norm, self.eps)
            qkv = F.linear(x, w.qkv, w.qkv_bias)
            q_size, kv_size = self.heads * self.dim, self.kv_heads * self.dim
            q = _rotate(qkv[..., :q_size].reshape(b, n, self.heads, self.dim), cos, sin)
            k = _rotate(qkv[..., q_size : q_size + kv_size].reshape(b, n, self.kv_heads, self.dim), cos, sin)
            v = qkv[..., q_size + kv_size :].reshape(b, n, self.kv_heads, self.dim)
            if tail is None:
                prefix.append((k[0].transpose(0, 1).contiguous(), v[0].transpose(0, 1).contiguous()))
                o = F.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
                ).transpose(1, 2)
            else:
                o = self._attend(q, k, v, prefix[i], tail[i], tail_start, width, mask)
            h = h + F.linear(o.reshape(b, n, q_size), w.o)
            x = _rms(h, w.post_norm, self.eps)
            gate, up = F.linear(x, w.gate_up).chunk(2, -1)
            h = h + F.linear(F.silu(gate) * up, w.down)
        if tail is None:
            return None
        h = h[torch.arange(b), last]  # only the sampled rows need the LM head
        return F.linear(_rms(h, self.norm, self.eps), self.head)

    def _attend(
        self,
        q: torch.Tensor,  # [b, n, H, D]
        k: torch.Tensor,  # [b, n, Hkv, D]
        v: torch.Tensor,
        prefix: tuple[torch.Tensor, torch.Tensor],  # [Hkv, P, D] each
        tail: tuple[torch.Tensor, torch.Tensor],  # [b, Hkv, T, D] each
        tail_start: torch.Tensor,
        width: int,
        mask: torch.Tensor,  # [b, n, 1, P + L]
    ) -> torch.Tensor:
        """Attention of the new tokens over the shared prefix and their row's tail, after writing
        their K/V into the tail cache. Grouped query heads are rows of their KV head's matmul."""
        b, n, _, d = q.shape
        hkv, g = self.kv_heads, self.heads // self.kv_heads
        rows = torch.arange(b)[:, None]
        at = tail_start[:, None] + torch.arange(n)[None]  # [b, n]
        tail[0][rows, :, at] = k  # advanced indexing puts the [b, n] index first: [b, n, Hkv, D]
        tail[1][rows, :, at] = v
        kt, vt = tail[0][:, :, :width], tail[1][:, :, :width]
        q = q.float() * d**-0.5
        qp = q.view(b, n, hkv, g, d).permute(2, 0, 1, 3, 4).reshape(hkv, b * n * g, d)
        sp = torch.matmul(qp, prefix[0].transpose(1, 2)).view(hkv, b, n, g, -1)
        qt = q.view(b, n, hkv, g, d).permute(0, 2, 1, 3, 4).reshape(b, hkv, n * g, d)
        st = torch.matmul(qt, kt.transpose(2, 3)).view(b, hkv, n, g, width).transpose(0, 1)
        probs = torch.softmax(torch.cat((sp, st), -1) + mask, -1)  # [Hkv, b, n, g, P + L]
        plen = prefix[0].shape[1]
        pp = probs[..., :plen].reshape(hkv, b * n * g, plen)
        out = torch.matmul(pp, prefix[1]).view(hkv, b, n, g, d).permute(1, 2, 0, 3, 4)
        pt = probs[..., plen:].transpose(0, 1).reshape(b, hkv, n * g, width)
        out = out + torch.matmul(pt, vt).view(b, hkv, n, g, d).permute(0, 2, 1, 3, 4)
        return out.reshape(b, n, self.heads, d)

    @staticmethod
    def _mask(n: int, tail_start: torch.Tensor, width: int, plen: int) -> torch.Tensor:
        """[b, n, 1, P + L] additive: the prefix is seen by all; query j of a row sees its tail up to
        its own position tail_start + j (causal), nothing beyond (another row's longer tail)."""
        seen = torch.arange(width)[None, None] <= (tail_start[:, None] + torch.arange(n)[None])[..., None]
        bias = torch.zeros(seen.shape[0], n, 1, plen + width)
        bias[..., plen:].masked_fill_(~seen[:, :, None], float("-inf"))
        return bias


def completion_figures(token_ids: list[list[int]], seconds: float) -> dict:
    """What every side of `bench/serve.py --vs-bound` reports of its completions."""
    tokens = sum(len(t) for t in token_ids)
    return {
        "seconds": seconds,
        "output_tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "completion_tokens": [len(t) for t in token_ids],
        "token_ids": token_ids,
    }


def _common_prefix(prompts: list[list[int]]) -> int:
    """Tokens all prompts start with, leaving each at least one of its own to prefill."""
    p = min(len(x) for x in prompts) - 1
    for x in prompts[1:]:
        p = next((i for i in range(p) if x[i] != prompts[0][i]), p)
    return p


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, Llama/neox layout: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def main() -> int:
    import argparse
    import importlib.util
    from pathlib import Path

    from kvpilot.daemon.engine.loader import load
    from kvpilot.kernels import select_ops

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compiled", action="store_true", help="the forward under torch.compile, as -O1 runs it")
    args = ap.parse_args()
    spec = importlib.util.spec_from_file_location("bench_engine", Path(__file__).with_name("engine.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    loaded = load(None, select_ops("cpu"), torch.float32, torch.device("cpu"))
    prompts = [bench.chat(loaded.tokenizer, q) for q in bench.QUESTIONS]
    bound = TorchBound(loaded.model, loaded.eos_token_ids, compiled=args.compiled)
    if args.compiled:  # compiles every graph the timed run takes
        started = time.perf_counter()
        bound.generate(prompts, 64)
        print(f"compiled (and ran once) in {time.perf_counter() - started:.1f} s")
    r = bound.generate(prompts, 64)
    print(
        f"bound: {r['tokens_per_s']:.1f} tok/s ({r['output_tokens']} tokens in {r['seconds']:.1f} s, "
        f"prefill {r['prefill_seconds']:.2f} s, decode step {r['decode_step_ms']:.0f} ms, "
        f"{torch.get_num_threads()} threads)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
