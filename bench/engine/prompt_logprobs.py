"""What prompt logprobs cost on the CUDA engine: one prefill step of T tokens (one sequence, host
launch through Engine.step, wall time including the step arena upload and the readback) without
extensions, with extensions but no scored row (ext_on 1, plp_count 0: the three plp kernels return
at once), and scoring all T - 1 prompt tokens with 1 and with 20 alternatives.

    python -m bench.engine.prompt_logprobs [--models smollm2-135m,llama3-8b] [--tokens 128,512,2048]

Random bf16 weights of the presets' full shapes. Prints a table; writes
bench/results/prompt_logprobs-<gpu>-<commit>.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import numpy as np

from bench.common import git_commit, metadata, result_path
from blink.device.executor import SamplingExt
from blink.models.config import preset
from blink.models.reference import PagedDriver
from blink.protocol.sampling_params import SamplingParams

CASES = ("plain", "ext, no scored rows", "prompt n=1", "prompt n=20")


def _ext(prompt: list[int], n: int) -> SamplingExt:
    T = len(prompt)
    targets = np.array(prompt[1:] + [-1], np.int32) if n >= 0 else np.full(T, -1, np.int32)
    return SamplingExt(
        params=[SamplingParams(prompt_logprobs=n)], slots=np.zeros(1, np.int32), fresh=np.ones(1, bool),
        emit=np.ones(1, bool), targets=targets,
    )  # fmt: skip


def run_model(name: str, tokens: list[int], reps: int) -> list[dict]:
    from blink.gpu.engine.engine import Engine, EngineConfig

    cfg = preset(name)
    Tm = max(tokens)
    ecfg = EngineConfig(
        max_seqs=1, max_num_batched_tokens=Tm, max_context=2 * Tm, num_kv_blocks=2 * Tm // 16 + 8, block_size=16,
        batch_buckets=(1,), token_buckets=tuple(tokens), progress=False, sampling_rows=1,
    )  # fmt: skip
    eng = Engine.create(cfg, ecfg)
    eng.capture(decode=False)
    rng = np.random.default_rng(0)
    rows = []
    for T in tokens:
        prompt = rng.integers(3, cfg.vocab_size, T).tolist()
        ms = {}
        for case, n in zip(CASES, (None, -1, 1, 20), strict=True):
            times = []
            for _ in range(reps + 1):  # the first is a warm-up
                d = PagedDriver(ecfg.num_kv_blocks, 16, eng.dims.max_blocks_per_seq, shuffle_seed=None)
                b = d.step([(0, prompt)])
                b.ext = None if n is None else _ext(prompt, n)
                t0 = time.perf_counter()
                eng.step(b)
                times.append((time.perf_counter() - t0) * 1e3)
            ms[case] = statistics.median(times[1:])
        rows.append({"model": name, "tokens": T, "ms": ms})
        print(f"{name:14} T={T:5} " + "  ".join(f"{c}: {ms[c]:8.2f} ms" for c in CASES), flush=True)
    eng.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2-135m,llama3-8b")
    ap.add_argument("--tokens", default="128,512,2048")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    tokens = sorted(int(t) for t in args.tokens.split(","))
    rows = []
    for name in args.models.split(","):
        rows += run_model(name, tokens, args.reps)
    commit = git_commit()
    res = {"what": __doc__.split("\n\n")[0], **metadata(commit), "cases": list(CASES), "rows": rows}
    gpu = res["gpu"].lower().replace("nvidia ", "").replace(" ", "")
    out = pathlib.Path(args.out) if args.out else result_path("prompt_logprobs", gpu, commit)
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
