"""Compile every triton kernel natively (TTIR -> TTGIR -> LLVM -> PTX -> cubin) for a CUDA target
without a GPU: catches what the interpreter lets through (loop-carried types, dot shapes, constexpr
misuse). Run as a script in a process where TRITON_INTERPRET is off; prints one line per variant.

    PYTHONPATH=tests python tests/kernels/native_compile_check.py [sm] [--quick]   # default sm 90; --quick: bf16 only

(tests/ on PYTHONPATH: the shared cases are support.kernel_cases.)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "run with TRITON_INTERPRET unset"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import BaseBackend, GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import native_specialize_impl  # noqa: E402

from kvpilot.kernels import (  # noqa: E402
    triton_activation,
    triton_attention,
    triton_kv_write,
    triton_norm,
    triton_rotary,
)

# A few bytes of stack are harmless (and ptxas sometimes chooses them); a real spill is hundreds.
MAX_SPILL_BYTES = 64


class _Recorder:
    """Stands in for `kernel[grid]`: records the launch arguments instead of launching."""

    def __init__(self, fn, calls):
        self.fn, self.calls = fn, calls

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((self.fn, args, kwargs))

        return launch


def _compile(fn, args, kwargs, target):
    """Specialise the arguments the way a real launch does (ints equal to 1 become constants, 16-byte
    aligned pointers and multiples of 16 get divisibility hints), then compile."""
    params = fn.arg_names
    values = dict(zip(params, args))
    values.update({k: v for k, v in kwargs.items() if k in params})
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(params):
        v = values[name]
        p = fn.params[i]
        if p.is_constexpr:
            signature[name] = "constexpr"
            constexprs[name] = v
            continue
        kind, spec = native_specialize_impl(BaseBackend, v, False, not p.do_not_specialize, True)
        signature[name] = kind
        if kind == "constexpr":
            constexprs[name] = spec
        elif isinstance(spec, str):
            attrs[(i,)] = BaseBackend.parse_attr(spec)
    opts = {k: v for k, v in kwargs.items() if k in ("num_warps", "num_stages")}
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=opts)


def _resource_usage(compiled) -> dict[str, int]:
    """REG and STACK (spill) per thread, from the cubin, with the cuobjdump triton ships."""
    import subprocess
    import tempfile

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True).stdout
    usage = {}
    for line in out.splitlines():
        for field in line.replace(",", " ").split():
            key, _, val = field.partition(":")
            if key in ("REG", "STACK") and val.isdigit():
                usage[key] = int(val)
    return usage


def _variants(quick: bool):
    from support.kernel_cases import MIXED_BATCH, build_attention_case

    dtypes = (torch.bfloat16,) if quick else (torch.float32, torch.float16, torch.bfloat16)
    heads = ((1, 8, 128), (2, 2, 256)) if quick else ((2, 1, 64), (2, 3, 128), (1, 8, 64), (2, 2, 256))
    for dtype in dtypes:
        for kv, group, d in heads:
            case = build_attention_case(
                *MIXED_BATCH, num_kv_heads=kv, group=group, head_dim=d, block_size=16, dtype=dtype
            )
            decode = build_attention_case(
                [1, 1], [40, 300], num_kv_heads=kv, group=group, head_dim=d, block_size=16, dtype=dtype
            )
            yield (
                f"paged_attention decode {dtype} kv{kv}xg{group} d{d}",
                lambda c=decode: triton_attention.paged_attention(
                    c.query, c.k_cache, c.v_cache, c.meta, c.scale, num_splits=1
                ),
            )
            for splits in (1, 4):
                yield (
                    f"paged_attention {dtype} kv{kv}xg{group} d{d} splits{splits}",
                    lambda c=case, s=splits: triton_attention.paged_attention(
                        c.query, c.k_cache, c.v_cache, c.meta, c.scale, num_splits=s
                    ),
                )
        x = torch.randn(3, 64).to(dtype)
        yield f"rms_norm {dtype}", lambda x=x: triton_norm.rms_norm(x, torch.ones(64, dtype=x.dtype), 1e-6, x)
        yield f"silu_and_mul {dtype}", lambda x=x: triton_activation.silu_and_mul(x)
        q, k = torch.randn(2, 4, 64).to(dtype), torch.randn(2, 2, 64).to(dtype)
        yield (
            f"rotary {dtype}",
            lambda q=q, k=k: triton_rotary.rotary(q, k, torch.tensor([0, 1]), torch.zeros(8, 64)),
        )
        cache = torch.zeros(4, 16, 2, 64, dtype=dtype)
        yield (
            f"write_kv {dtype}",
            lambda k=k, c=cache: triton_kv_write.write_kv(k, k, c, c, torch.tensor([0, 5])),
        )


def main() -> int:
    argv = [a for a in sys.argv[1:] if a != "--quick"]
    sm = int(argv[0]) if argv else 90
    target = GPUTarget("cuda", sm, 32)
    triton_attention._capability = lambda device: (sm // 10, sm % 10)  # tiles follow the target
    triton_attention._fp32_dot_precision = lambda device: "tf32x3"  # what a CUDA launch uses
    kernels = {
        (triton_attention, "_paged_attention_kernel"),
        (triton_attention, "_merge_splits_kernel"),
        (triton_norm, "_rms_norm_kernel"),
        (triton_activation, "_silu_and_mul_kernel"),
        (triton_rotary, "_rotary_kernel"),
        (triton_kv_write, "_write_kv_kernel"),
    }
    calls: list = []
    for mod, name in kernels:
        setattr(mod, name, _Recorder(getattr(mod, name), calls))
    failed = 0
    for label, run in _variants("--quick" in sys.argv):
        calls.clear()
        run()
        for fn, args, kwargs in list(calls):
            try:
                compiled = _compile(fn, args, kwargs, target)
                usage = _resource_usage(compiled)
                if fn.__name__ == "_paged_attention_kernel" and usage.get("STACK", 0) > MAX_SPILL_BYTES:
                    raise RuntimeError(f"registers spill to the stack: {usage}")
                print(f"ok   sm_{sm} {label} {fn.__name__} {usage} smem={compiled.metadata.shared}")
            except Exception as e:  # noqa: BLE001 - report every failure, not the first
                failed += 1
                print(f"FAIL sm_{sm} {label} {fn.__name__}: {type(e).__name__}: {e}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
