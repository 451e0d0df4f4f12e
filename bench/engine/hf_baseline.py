"""transformers on the same GPU and shapes as bench/engine/decode.py and bench/engine/prefill.py: Llama-3-8B
shape, random bf16 weights. Static-cache greedy decode at batch 1 after a 1024-token prompt
(ms/token from the difference of two generate() lengths), prefill of 1k and 4k prompts, and
optionally generate_batch (continuous batching) over N requests x (256 -> 128).

    python -m bench.engine.hf_baseline --out bench/results/hf_h200.json [--batch-requests 256]

`--only-batch` runs generate_batch alone (bench/paper/evaluate.py's peer, on the same workload as Blink's);
`--device cpu` runs on the CPU (a check of the script itself with a tiny preset).
"""

from __future__ import annotations

import argparse
import time

from bench.common import add_commit_arg, metadata, preset_config, write_json


def main(argv: list[str] | None = None) -> int:
    import torch
    import transformers

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prefill", default="1024,4096")
    ap.add_argument("--batch-requests", type=int, default=0, help="generate_batch requests (0 = skip)")
    ap.add_argument("--batch-prompt", type=int, default=256, help="generate_batch prompt tokens")
    ap.add_argument("--batch-new", type=int, default=128, help="generate_batch output tokens")
    ap.add_argument("--only-batch", action="store_true", help="generate_batch only (no batch-1 decode, no prefill)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    add_commit_arg(ap)
    ap.add_argument("--out", default="bench/results/hf.json")
    a = ap.parse_args(argv)
    c = preset_config(a.model, a.layers)
    rs = c.rope_scaling
    hf_cfg = transformers.LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_eps,
        max_position_embeddings=131072,
        rope_theta=c.rope_theta,
        rope_scaling={
            "rope_type": "llama3",
            "factor": rs.factor,
            "low_freq_factor": rs.low_freq_factor,
            "high_freq_factor": rs.high_freq_factor,
            "original_max_position_embeddings": rs.original_max_position,
        },
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(a.device):
        model = transformers.LlamaForCausalLM(hf_cfg).eval()
    torch.set_default_dtype(torch.float32)
    g = torch.Generator(device=a.device).manual_seed(0)
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    res: dict = {
        **metadata(a.commit, argv),
        "model": c.name,
        "layers": c.num_layers,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }

    def gen(ids: torch.Tensor, n: int) -> float:
        sync()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, cache_implementation="static")
        sync()
        return time.perf_counter() - t0

    def prefill_s(x: torch.Tensor, reps: int = 3) -> float:
        with torch.no_grad():
            model(x, logits_to_keep=1)
            sync()
            t0 = time.perf_counter()
            for _ in range(reps):
                model(x, logits_to_keep=1)
            sync()
        return (time.perf_counter() - t0) / reps

    if a.only_batch:
        return generate_batch(a, model, res, sync)
    # generate() with a static cache compiles its decode step (torch.compile) on first use for a
    # cache shape; the same max_new_tokens keeps the shape, so the warm-up run absorbs the compile.
    ids = torch.randint(0, c.vocab_size, (1, a.context), device=a.device, generator=g)
    n = a.new_tokens
    with torch.no_grad():
        t_warm = gen(ids, n + 1)
        t_full = gen(ids, n + 1)
    t_pre = prefill_s(ids)
    res["static_cache_batch1"] = {
        "context": a.context,
        "new_tokens": n,
        "ms_per_token": (t_full - t_pre) / n * 1e3,
        "generate_s": t_full,
        "first_generate_s_incl_compile": t_warm,
        "prefill_s": t_pre,
    }
    pre = []
    for n in [int(x) for x in a.prefill.split(",")]:
        x = torch.randint(0, c.vocab_size, (1, n), device=a.device, generator=g)
        ms = prefill_s(x) * 1e3
        pre.append({"prompt_tokens": n, "ms": ms, "tokens_per_s": n / ms * 1e3})
    res["prefill"] = pre
    write_json(a.out, res)  # rewritten by generate_batch if it runs
    print(
        f"\ntransformers {transformers.__version__}: static cache batch 1 "
        f"{res['static_cache_batch1']['ms_per_token']:.2f} ms/token"
    )
    for p in pre:
        print(f"  prefill {p['prompt_tokens']}: {p['ms']:.1f} ms ({p['tokens_per_s']:.0f} tok/s)")
    return generate_batch(a, model, res, sync) if a.batch_requests else 0


def generate_batch(a: argparse.Namespace, model, res: dict, sync) -> int:
    """transformers' continuous batching (generate_batch): a.batch_requests requests of
    a.batch_prompt random tokens -> a.batch_new tokens each, into res and a.out."""
    import torch
    import transformers

    n, p, o = a.batch_requests, a.batch_prompt, a.batch_new
    inputs = torch.randint(0, model.config.vocab_size, (n, p), generator=torch.Generator().manual_seed(1))
    gcfg = transformers.GenerationConfig(max_new_tokens=o, do_sample=False, eos_token_id=None, pad_token_id=0)
    try:
        sync()
        t0 = time.perf_counter()
        out = model.generate_batch(inputs=inputs.tolist(), generation_config=gcfg)
        sync()
        dt = time.perf_counter() - t0
        ntok = sum(len(r.generated_tokens) for r in out.values())
        res["generate_batch"] = {
            "requests": n,
            "prompt": p,
            "max_new": o,
            "seconds": dt,
            "output_tokens": ntok,
            "output_tok_per_s": ntok / dt,
        }
    except (RuntimeError, TypeError, ValueError, AttributeError, NotImplementedError) as e:
        res["generate_batch"] = {"requests": n, "error": f"{type(e).__name__}: {e}"[:2000]}
    write_json(a.out, res)
    print(f"  generate_batch: {res['generate_batch']}")
    return 0 if "error" not in res["generate_batch"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
