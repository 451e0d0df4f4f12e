"""The figures of bench/paper/evaluate.py, drawn from its JSON files alone (no GPU, no server).

    python -m bench.paper.plots bench/results/*.json [--out bench/results/figures]

Each `<part>-<device>-<commit>.json` gives `<figure>-<device>-<commit>.png`:

  interference  interference-*.png  closed-loop output tok/s, idle vs hogs, per scheduler (bars)
                latency_cdf-*.png   TTFT and ITL CDFs of the open-loop runs (rate x load x scheduler)
  cpu           cpu-*.png           the device process's CPU-seconds per million output tokens
  sigstop       sigstop-*.png       tokens per 100 ms, the SIGSTOP window shaded, per scheduler
  sweep         sweep-*.png         TTFT / TPOT / ITL p50 and p99 against the request rate reached
  ablation      ablation-*.png      makespan host loop / GPU scheduler per workload and batch
  peer          peer-*.png          output tok/s of Blink and transformers on the same workload
  smol          smol-*.png          the interference bars and SIGSTOP timeline of the second model
  prefix        prefix-*.png        TTFT CDFs with prefix caching on vs off: shared prefix per rate,
                                    multi-turn (hit rate in the legend), per scheduler; also drawn
                                    from bench/serving/prefix_cache.py's JSON (<its name>-*.png)

Files of other kinds (the older benchmarks' JSON) are skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench.common import RESULTS, short_device

COLORS = {"gpu": "tab:blue", "host": "tab:orange", "blink": "tab:blue", "transformers": "tab:gray"}
LABELS = {"gpu": "GPU scheduler", "host": "host loop"}


def _ok(results: dict) -> dict:
    return {k: v for k, v in results.items() if isinstance(v, dict) and "error" not in v}


def _title(ax: Any, doc: dict, what: str) -> None:
    ax.set_title(f"{what} ({doc.get('device_name', doc.get('device'))}, {doc.get('commit')})", fontsize=10)


def _bars_interference(ax: Any, results: dict) -> None:
    scheds = list(_ok(results))
    for i, sched in enumerate(scheds):
        c = results[sched]["closed"]
        for j, load in enumerate(("idle", "hogs")):
            v = c[load]["steady_tok_per_s"]
            bar = ax.bar(i * 3 + j, v, color=COLORS.get(sched), alpha=1.0 if load == "idle" else 0.5)
            ax.bar_label(bar, [f"{v:,.0f}"], fontsize=8)
        ax.text(i * 3 + 0.5, 0, f"retention {c['retention']:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks([i * 3 + j for i in range(len(scheds)) for j in range(2)])
    ax.set_xticklabels([f"{LABELS.get(s, s)}\n{load}" for s in scheds for load in ("idle", "hogs")], fontsize=8)
    ax.set_ylabel("output tok/s (closed loop, steady)")


def interference(doc: dict, out: str) -> list[str]:
    res = _ok(doc["results"])
    fig, ax = plt.subplots(figsize=(6, 4))
    _bars_interference(ax, res)
    _title(ax, doc, "interference")
    paths = [_save(fig, out, "interference", doc)]
    rows = [(s, r) for s, v in res.items() for r in v.get("open", [])]
    if rows:
        q = doc_quantiles(rows[0][1])
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for ax, key in zip(axes, ("ttft", "itl"), strict=True):
            for sched, r in rows:
                ls = "-" if r["load"] == "idle" else "--"
                ax.plot(r["cdf_ms"][key], q, ls, color=COLORS.get(sched), label=f"{LABELS.get(sched, sched)}, "
                        f"{r['rate']:g} req/s, {r['load']}", alpha=0.5 + 0.5 * (r["rate"] == rows[-1][1]["rate"]))  # fmt: skip
            ax.set_xscale("log")
            ax.set_xlabel(f"{key.upper()} (ms)")
            ax.set_ylabel("fraction of " + ("requests" if key == "ttft" else "token gaps"))
            ax.grid(alpha=0.3)
        axes[1].legend(fontsize=7)
        _title(axes[0], doc, "latency CDF, open loop")
        paths.append(_save(fig, out, "latency_cdf", doc))
    return paths


def doc_quantiles(r: dict) -> list[float]:
    return [q / 100 for q in r["cdf_quantiles"]]


def cpu(doc: dict, out: str) -> list[str]:
    res = _ok(doc["results"])
    fig, ax = plt.subplots(figsize=(5, 4))
    for i, (sched, r) in enumerate(res.items()):
        v = r["device_cpu_s_per_mtok"]
        ax.bar_label(ax.bar(i, max(v, 1e-3), color=COLORS.get(sched)), [f"{v:.2f}"], fontsize=8)
    ax.set_xticks(range(len(res)))
    ax.set_xticklabels([LABELS.get(s, s) for s in res])
    ax.set_yscale("log")
    ax.set_ylabel("device process CPU-s per M output tokens")
    _title(ax, doc, "host CPU per token")
    return [_save(fig, out, "cpu", doc)]


def _timeline(ax: Any, results: dict) -> None:
    for sched, r in _ok(results).items():
        tl = r["timeline"]
        t = [(i + 0.5) * tl["bin_s"] for i in range(len(tl["tokens"]))]
        ax.plot(t, tl["tokens"], color=COLORS.get(sched), label=f"{LABELS.get(sched, sched)}: "
                f"x{r['ratio_stopped_over_before']:.3f}, longest gap {r['longest_gap_stopped_ms']:.0f} ms")  # fmt: skip
        ax.axvspan(r["stopped_at_s"], r["resumed_at_s"], color=COLORS.get(sched), alpha=0.08)
    ax.set_xlabel("s (shaded: device process SIGSTOPped)")
    ax.set_ylabel(f"tokens per {1e3 * tl['bin_s']:.0f} ms")
    ax.legend(fontsize=8)


def sigstop(doc: dict, out: str) -> list[str]:
    fig, ax = plt.subplots(figsize=(8, 4))
    _timeline(ax, doc["results"])
    _title(ax, doc, "SIGSTOP")
    return [_save(fig, out, "sigstop", doc)]


def sweep(doc: dict, out: str) -> list[str]:
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for sched, r in _ok(doc["results"]).items():
        x = [row["request_throughput"] for row in r["rows"]]
        for ax, key in zip(axes, ("ttft_ms", "tpot_ms", "itl_ms"), strict=True):
            for stat, ls in (("median", "-o"), ("p99", "--o")):
                ax.plot(x, [row[key][stat] for row in r["rows"]], ls, color=COLORS.get(sched), ms=3,
                        label=f"{LABELS.get(sched, sched)} {'p50' if stat == 'median' else stat}")  # fmt: skip
            ax.set_xlabel("requests/s completed (ShareGPT lengths)")
            ax.set_ylabel(key.replace("_ms", "").upper() + " (ms)")
            ax.set_yscale("log")
            ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    _title(axes[1], doc, "latency vs load")
    return [_save(fig, out, "sweep", doc)]


def ablation(doc: dict, out: str) -> list[str]:
    ratios = doc.get("ratio_host_over_gpu")
    if not ratios:
        return []
    fig, ax = plt.subplots(figsize=(8, 4))
    names = ["b{}\n{}".format(r["batch"], r["workload"].replace("/", "/\n")) for r in ratios]
    bars = ax.bar(range(len(ratios)), [r["ratio"] for r in ratios], color=COLORS["gpu"])
    ax.bar_label(bars, [f"{r['ratio']:.2f}" for r in ratios], fontsize=8)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(ratios)))
    ax.set_xticklabels(names, fontsize=7)
    ax.set_ylabel("makespan host loop / GPU scheduler")
    _title(ax, doc, "scheduler ablation (Fig. 3)")
    return [_save(fig, out, "ablation", doc)]


def peer(doc: dict, out: str) -> list[str]:
    vals = {}
    if "output_throughput" in doc.get("blink", {}):
        vals["blink"] = doc["blink"]["output_throughput"]
    if "output_tok_per_s" in doc.get("transformers", {}):
        vals["transformers"] = doc["transformers"]["output_tok_per_s"]
    if not vals:
        return []
    fig, ax = plt.subplots(figsize=(5, 4))
    for i, (k, v) in enumerate(vals.items()):
        ax.bar_label(ax.bar(i, v, color=COLORS[k]), [f"{v:,.0f}"], fontsize=8)
    ax.set_xticks(range(len(vals)))
    ax.set_xticklabels(["Blink (GPU scheduler)" if k == "blink" else "transformers generate_batch" for k in vals])
    ax.set_ylabel("output tok/s, same workload")
    _title(ax, doc, "peer on the same GPU")
    return [_save(fig, out, "peer", doc)]


def smol(doc: dict, out: str) -> list[str]:
    res = doc["results"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4))
    _bars_interference(axes[0], {s: v["interference"] for s, v in res.items()})
    _timeline(axes[1], {s: v["sigstop"] for s, v in res.items()})
    _title(axes[0], doc, os.path.basename(str(doc.get("model"))))
    return [_save(fig, out, "smol", doc)]


def _prefix_runs(doc: dict) -> dict[str, dict]:
    """scheduler -> {"on": runs, "off": runs}, from the paper's part or prefix_cache.py's own JSON."""
    if doc["what"] == "prefix_cache":
        return {doc.get("scheduler", "gpu"): doc["results"]}
    return {s: v["results"] for s, v in _ok(doc["results"]).items()}


def _noreuse(r: dict) -> float | None:
    on, off = (r.get(m, {}).get("noreuse", {}).get("output_throughput") for m in ("on", "off"))
    return on / off if on and off else None


def prefix(doc: dict, out: str) -> list[str]:
    runs = _prefix_runs(doc)
    keys = [k for k in next(iter(runs.values()), {}).get("on", {}) if k.startswith("shared@") or k == "multiturn"]
    if not keys:
        return []
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4), squeeze=False)
    for ax, k in zip(axes[0], keys, strict=True):
        for sched, r in runs.items():
            for mode, ls in (("on", "-"), ("off", "--")):
                v = r.get(mode, {}).get(k, {})
                if not v.get("cdf_ms", {}).get("ttft"):
                    continue
                hit = f", hit rate {100 * v['prefix_cache_hit_rate']:.0f} %" if mode == "on" else ""
                ax.plot(v["cdf_ms"]["ttft"], doc_quantiles(v), ls, color=COLORS.get(sched),
                        label=f"{LABELS.get(sched, sched)}, caching {mode}: p50 {v['ttft_ms']['median']:.1f} ms{hit}")  # fmt: skip
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("TTFT (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"shared prefix, {k[7:]} req/s" if k.startswith("shared@") else "multi-turn replay", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    noreuse = [f"{LABELS.get(s, s)} x{r:.3f}" for s, v in runs.items() if (r := _noreuse(v)) is not None]
    model = os.path.basename(str(next(iter(runs.values()))["on"][keys[0]].get("model", "")))
    where = f"{doc.get('device_name', doc.get('device'))}, {doc.get('commit')}"
    tput = f"; no-reuse throughput on / off: {', '.join(noreuse)}" if noreuse else ""
    fig.suptitle(f"prefix caching on vs off, {model} ({where}){tput}", fontsize=10)
    return [_save(fig, out, doc.get("name", doc["what"]), doc)]


FIGURES: dict[str, Callable[[dict, str], list[str]]] = {
    "interference": interference,
    "cpu": cpu,
    "sigstop": sigstop,
    "sweep": sweep,
    "ablation": ablation,
    "peer": peer,
    "smol": smol,
    "prefix": prefix,
    "prefix_cache": prefix,
}


def _save(fig: Any, out: str, name: str, doc: dict) -> str:
    path = os.path.join(out, f"{name}-{short_device(doc['device'])}-{doc['commit']}.png")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def paper_docs(paths: list[str]) -> list[dict]:
    """The bench/paper/evaluate.py results among the files (others skipped)."""
    docs = []
    for p in paths:
        with open(p) as f:
            doc = json.load(f)
        if isinstance(doc, dict) and doc.get("what") in FIGURES:
            docs.append(doc)
    return docs


def draw(paths: list[str], out: str) -> list[str]:
    """Every figure the files allow (an ablation needs both schedulers, a peer figure a result);
    returns the PNG paths."""
    os.makedirs(out, exist_ok=True)
    return [png for doc in paper_docs(paths) for png in FIGURES[doc["what"]](doc, out)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out", default=str(RESULTS / "figures"))
    a = ap.parse_args(argv)
    if not paper_docs(a.files):
        print("no bench/paper/evaluate.py results among the files", file=sys.stderr)
        return 1
    for w in draw(a.files, a.out):
        print(f"wrote {w}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
