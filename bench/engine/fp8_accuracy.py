"""FP8 weights and/or an FP8 KV cache vs bf16 on real weights, with the numpy model (the definition the
devices implement).

    python -m bench.engine.fp8_accuracy                    # SmolLM2-135M-Instruct GGUF, 32 prompts x 64 tokens
    python -m bench.engine.fp8_accuracy --quantization none --kv-cache-dtype fp8   # the FP8 KV cache alone
    python -m bench.engine.fp8_accuracy --model /path/to/hf-dir --prompts 8 --tokens 32 --out x.json
    python -m bench.engine.fp8_accuracy --lm-head bf16     # FP8 projections, the LM head left in bf16
    python -m bench.engine.fp8_accuracy --baseline fp8 --lm-head fp8   # the FP8 LM head's own cost

Both models start from the weights as a bf16 device holds them (rounded to bf16); the fp8 one
quantizes every linear layer (blink.models.fp8), and the LM head unless --lm-head bf16 (default: the
definition's FP8_LM_HEAD). --baseline fp8: the reference is the FP8 model with a bf16 LM head, so the
numbers are the FP8 head's own cost. Greedy decoding of each chat prompt, all prompts
in one packed batch. Reported:
  free-running: share of generated positions whose fp8 token equals the bf16 token at that index,
      and the share of sequences identical throughout (one flip changes the rest of a sequence);
  teacher-forced: the fp8 model scores the bf16 continuation: share of positions where its argmax
      is the bf16 token (the per-token agreement), and the mean / max absolute difference of the
      log-probability of the bf16 token between the two models (per-token loglikelihood).
Writes bench/results/fp8_accuracy-emulated-<commit>.json (or --out) and prints a short table. ~9 min of CPU.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from bench.common import add_commit_arg, git_commit, metadata, result_path, write_json
from blink.models.fp8 import FP8_LM_HEAD, as_device_weight
from blink.models.llama_numpy import LlamaNumpy
from blink.models.registry import resolve_model

TOPICS = (
    "the water cycle", "how a bicycle stays upright", "photosynthesis", "why the sky is blue", "the moon's phases",
    "how vaccines work", "compound interest", "the French revolution", "black holes", "how to brew tea",
    "plate tectonics", "the internet", "bees and pollination", "a healthy breakfast", "how rainbows form",
    "the Roman empire", "electric cars", "how to learn a language", "volcanoes", "the human heart",
    "recycling plastic", "chess openings", "the speed of light", "how bread rises", "climate and weather",
    "the printing press", "how computers add numbers", "dolphins", "saving money", "the solar system",
    "how a refrigerator works", "writing a good essay",
)  # fmt: skip
BLOCK = 16


def prompts(tok: Any, n: int) -> list[list[int]]:
    if n > len(TOPICS):
        raise SystemExit(f"--prompts {n}: at most {len(TOPICS)}")
    return [tok.encode_chat([{"role": "user", "content": f"Explain {t} in a few sentences."}]) for t in TOPICS[:n]]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def greedy(model: LlamaNumpy, ps: list[list[int]], new: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens (S, new), log-prob of each chosen token (S, new)) of greedy decoding, all prompts packed."""
    S = len(ps)
    width = -(-(max(map(len, ps)) + new) // BLOCK)
    bt = np.arange(S * width).reshape(S, width)
    kc = np.zeros(model.kv_cache_shape(S * width, BLOCK), np.float32)
    vc = np.zeros_like(kc)
    lens = np.array([len(p) for p in ps])
    ids, pos = np.concatenate(ps), np.concatenate([np.arange(n) for n in lens])
    cu = np.concatenate([[0], np.cumsum(lens)])
    toks, lps = np.zeros((S, new), np.int64), np.zeros((S, new), np.float32)
    for i in range(new):
        lp = log_softmax(model.forward(ids, pos, cu, bt, kc, vc))
        toks[:, i] = lp.argmax(-1)
        lps[:, i] = lp[np.arange(S), toks[:, i]]
        ids, pos, cu = toks[:, i], lens + i, np.arange(S + 1)
    return toks, lps


def teacher_forced(model: LlamaNumpy, ps: list[list[int]], cont: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(argmax (S, new), log-prob of cont (S, new)) of `model` scoring each prompt + continuation."""
    S, new = cont.shape
    am, lps = np.zeros((S, new), np.int64), np.zeros((S, new), np.float32)
    for s, p in enumerate(ps):
        seq = np.concatenate([p, cont[s]])
        nb = -(-seq.size // BLOCK)
        kc = np.zeros(model.kv_cache_shape(nb, BLOCK), np.float32)
        rows = np.arange(len(p) - 1, seq.size - 1)  # the rows that predict the continuation
        lp = log_softmax(
            model.forward(seq, np.arange(seq.size), np.array([0, seq.size]), np.arange(nb)[None], kc, kc.copy(), rows)
        )
        am[s], lps[s] = lp.argmax(-1), lp[np.arange(new), cont[s]]
    return am, lps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="", help="result JSON (default bench/results/fp8_accuracy-emulated-<commit>.json)")
    add_commit_arg(ap)
    ap.add_argument("--model", default="default")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--quantization", choices=("fp8", "none"), default="fp8", help="weights of the compared model")
    ap.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto", help="KV cache of the compared model")
    ap.add_argument(
        "--lm-head", choices=("fp8", "bf16"), default="fp8" if FP8_LM_HEAD else "bf16",
        help="the compared model's LM head under fp8 weights",
    )  # fmt: skip
    ap.add_argument("--baseline", choices=("bf16", "fp8"), default="bf16", help="fp8: FP8 weights, bf16 LM head")
    a = ap.parse_args()
    t0 = time.time()
    b = resolve_model(a.model)
    w = {k: as_device_weight(v) for k, v in b.weights.items()}
    quant = None if a.quantization == "none" else a.quantization
    head = a.lm_head == "fp8"
    bq = "fp8" if a.baseline == "fp8" else None
    base = LlamaNumpy(b.config, w, quantization=bq, fp8_lm_head=False)
    q = LlamaNumpy(b.config, w, quantization=quant, kv_cache_dtype=a.kv_cache_dtype, fp8_lm_head=head)
    del w
    ps = prompts(b.tokenizer, a.prompts)
    ref, ref_lp = greedy(base, ps, a.tokens)
    got, _ = greedy(q, ps, a.tokens)
    tf_arg, tf_lp = teacher_forced(q, ps, ref)
    d = np.abs(tf_lp - ref_lp)
    first = [int(np.argmax(r != g)) if (r != g).any() else a.tokens for r, g in zip(ref, got, strict=True)]
    res = {
        **metadata(a.commit or git_commit(), gpu="cpu"),
        "model": b.name,
        "source": b.source,
        "prompts": a.prompts,
        "tokens": a.tokens,
        "quantization": a.quantization,
        "kv_cache_dtype": a.kv_cache_dtype,
        "fp8_lm_head": q.fp8_lm_head,
        "baseline": a.baseline,
        "free_running_agreement": float((ref == got).mean()),
        "identical_sequences": float(np.mean([x == a.tokens for x in first])),
        "first_divergence_mean": float(np.mean(first)),
        "teacher_forced_agreement": float((tf_arg == ref).mean()),
        "logprob_abs_diff_mean": float(d.mean()),
        "logprob_abs_diff_max": float(d.max()),
        "seconds": round(time.time() - t0, 1),
    }
    print(f"{'metric':32s} value")
    for k in list(res)[-8:]:
        print(f"{k:32s} {res[k]}")
    name = "fp8_accuracy" if a.kv_cache_dtype == "auto" else f"fp8_accuracy_kv_{a.quantization}"
    name += "" if not q.fp8_lm_head else "_head" if a.baseline == "bf16" else "_head_vs_fp8"
    write_json(a.out or str(result_path(name, "emulated", res["commit"])), res)


if __name__ == "__main__":
    main()
