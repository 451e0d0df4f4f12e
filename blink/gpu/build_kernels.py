"""Fill a kernel cache ahead of time (no GPU needed): every engine kernel and the scheduler; or,
with --params, regenerate the kernels' signature file (needs nvcc).

    python -m blink.gpu.build_kernels [--arch 90] [--cache-dir DIR]
    python -m blink.gpu.build_kernels --params
"""

from __future__ import annotations

import argparse

from blink.gpu.scheduler import scheduler
from blink.gpu.toolchain import kernels


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m blink.gpu.build_kernels", description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, action="append", help="compute capability, e.g. 90 (repeatable; default 90)")
    ap.add_argument(
        "--cache-dir", default=str(kernels.DEFAULT_CACHE), help="where the cubins go (default: %(default)s)"
    )
    ap.add_argument("--params", action="store_true", help=f"regenerate {kernels.PARAMS_FILE.name} (nvcc -E) and exit")
    args = ap.parse_args(argv)
    if args.params:
        kernels.PARAMS_FILE.write_text(kernels.render_params())
        print(kernels.PARAMS_FILE)
        return 0
    for arch in args.arch or [90]:
        for p in [*kernels.build_all(args.cache_dir, arch), scheduler.build_cubin(args.cache_dir, arch)]:
            print(p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
