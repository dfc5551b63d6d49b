"""`python -m kvpilot.kernels.prebuild`: build the project's C kernels (kernels/native.py) into
`$KVPILOT_CACHE/kernels` now, so that a process loads them without a C compiler. The image runs it in a
stage of its own, which alone has the compiler (Containerfile). Prints each library's path; exits 1 where
one cannot be built."""

from __future__ import annotations

import platform
import sys

from kvpilot.kernels import cpu_attention, cpu_elementwise, native, panel_gemm

# Each kernel module's library, by the name its `_library()` asks `native.library` for.
LIBRARIES = {
    "panel_gemm": panel_gemm.SOURCE,
    "cpu_attention": cpu_attention.SOURCE,
    "cpu_elementwise": cpu_elementwise.SOURCE,
}


def main() -> int:
    # the folder is there even where nothing is built (the image copies it whole)
    native.library_path("", "").parent.mkdir(parents=True, exist_ok=True)
    if platform.machine() != "x86_64":
        print(f"the C kernels are for x86-64, not {platform.machine()}: nothing built", file=sys.stderr)
        return 0
    try:
        for name, source in LIBRARIES.items():
            print(native.build(name, source))
    except OSError as exc:
        print(f"prebuild: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
