"""bench/paper/evaluate.py, bench/paper/plots.py and bench/paper/hogs.py on the CPU: the hogs load the cores they are
given, the plots draw every figure from JSON alone, and the evaluation runs end to end on the emulated
device (so a GPU run does not find the harness's bugs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from bench.paper import evaluate, hogs, plots
from blink.bench_report import CDF_QUANTILES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_hogs_run_pinned_on_their_cores_and_stop():
    core = sorted(os.sched_getaffinity(0))[0]
    with hogs.Hogs([core, core], "mix") as h:
        assert h.kinds() == ["compress", "memory"]
        pids = [p.pid for p in h.procs]
        before = [_cpu_s(pid) for pid in pids]
        for pid in pids:
            assert os.sched_getaffinity(pid) == {core}
        # working, not sleeping: each gains CPU time. Two hogs share one core, which the other tests
        # keep busy too, so give them a generous deadline rather than a fixed window; a sleeping hog
        # never gets there.
        t_end = time.monotonic() + 30.0
        while not all(_cpu_s(pid) - t0 > 0.05 for pid, t0 in zip(pids, before, strict=True)):
            assert time.monotonic() < t_end, [_cpu_s(pid) - t0 for pid, t0 in zip(pids, before, strict=True)]
            time.sleep(0.1)
    assert all(not os.path.exists(f"/proc/{pid}/stat") or "Z" in open(f"/proc/{pid}/stat").read() for pid in pids)
    assert hogs.parse_cores("2-4,7") == [2, 3, 4, 7]
    with pytest.raises(ValueError):
        hogs.Hogs([core], "pbzip")


def _bench(rate: float | str, ttft: float, tpot: float) -> dict:
    q = [float(x) for x in CDF_QUANTILES]
    stats = lambda v: {"mean": v, "median": v, "p50": v, "p90": 1.5 * v, "p99": 2 * v}  # noqa: E731
    return {
        "request_rate": rate,
        "request_throughput": 10.0 if rate == "inf" else float(rate),
        "output_throughput": 1000.0,
        "ttft_ms": stats(ttft),
        "tpot_ms": stats(tpot),
        "itl_ms": stats(tpot),
        "cdf_quantiles": q,
        "cdf_ms": {
            k: [v * (1 + i / 100) for i in range(len(q))] for k, v in (("ttft", ttft), ("tpot", tpot), ("itl", tpot))
        },
        "timeline": {"bin_s": 0.1, "tokens": [50] * 40 + [0] * 20 + [50] * 20},
    }


def synthetic_docs() -> list[dict]:
    """One JSON of each part, shaped as bench/paper/evaluate.py writes them (numbers made up)."""
    meta = {"device": "h200", "device_name": "NVIDIA H200", "commit": "abc1234", "date": "2026-12-01T00:00:00Z"}
    closed = lambda v: {"steady_tok_per_s": v, **_bench("inf", 20, 6)}  # noqa: E731
    interf = {
        s: {
            "closed": {"idle": closed(40000.0), "hogs": closed(20000.0 if s == "host" else 39000.0), "retention": 0.5},
            "open": [{"rate": r, "load": ld, **_bench(r, 18, 6)} for r in (12.0, 24.0) for ld in ("idle", "hogs")],
        }
        for s in ("gpu", "host")
    }
    stop = {
        s: {
            **_bench("inf", 20, 6),
            "stopped_at_s": 4.0,
            "resumed_at_s": 6.0,
            "ratio_stopped_over_before": 1.0,
            "longest_gap_stopped_ms": 20.0,
        }  # fmt: skip
        for s in ("gpu", "host")
    }
    rows = [{"batch": b, "workload": w, "makespan_s": 1.0} for b in (16, 64) for w in ("short/short", "long/long")]
    return [
        {"what": "interference", **meta, "results": interf},
        {"what": "cpu", **meta, "results": {"gpu": {"device_cpu_s_per_mtok": 0.58}, "host": {"device_cpu_s_per_mtok": 136}}},
        {"what": "sigstop", **meta, "results": {**stop, "host": {"error": "RuntimeError: made up"}}},
        {"what": "sweep", **meta, "results": {s: {"rows": [_bench(r, 20 + i, 6) for i, r in enumerate((4.0, 8.0, "inf"))]} for s in ("gpu", "host")}},
        {"what": "ablation", **meta, "results": {"gpu": {"rows": rows}, "host": {"rows": rows}},
         "ratio_host_over_gpu": [{**r, "ratio": 1.2} for r in rows]},
        {"what": "peer", **meta, "blink": {"output_throughput": 10480.0}, "transformers": {"output_tok_per_s": 924.0}},
        {"what": "smol", **meta, "model": "SmolLM2.gguf",
         "results": {s: {"interference": interf[s], "sigstop": stop[s]} for s in ("gpu", "host")}},
        {"what": "prefix", **meta, "results": {"gpu": prefix_runs(), "host": {"error": "RuntimeError: made up"}}},
        {"what": "prefix_cache", "name": "prefix_cache_smollm2", **meta, "device": "NVIDIA H200", "scheduler": "gpu",
         "results": prefix_runs()["results"]},  # bench/serving/prefix_cache.py's own JSON
        {"bench": "throughput", "gpu": {}},  # an older benchmark's JSON: skipped
    ]  # fmt: skip


def prefix_runs() -> dict:
    """One scheduler's prefix caching runs, on and off, as bench/serving/prefix_cache.py returns them."""
    runs = lambda t: {  # noqa: E731
        "shared@8": {**_bench(8.0, t, 6), "prefix_cache_hit_rate": 0.9 if t < 50 else 0.0},
        "multiturn": {**_bench(4.0, 2 * t, 6), "prefix_cache_hit_rate": 0.6 if t < 50 else 0.0},
        "noreuse": {**_bench("inf", 100, 6), "prefix_cache_hit_rate": 0.0},
        "claim_to_launch": {"match_ms": 0.1, "no_match_ms": 0.1},
    }
    return {"results": {"on": runs(14), "off": runs(150)}, "ratios_on_over_off": {"ttft_p50_shared@8": 0.09}}


def test_plots_draw_every_figure_from_json_alone(tmp_path):
    files = []
    for i, doc in enumerate(synthetic_docs()):
        files.append(str(tmp_path / f"{i}.json"))
        with open(files[-1], "w") as f:
            json.dump(doc, f, allow_nan=False)
    written = plots.draw(files, str(tmp_path / "fig"))
    names = sorted(os.path.basename(p).split("-")[0] for p in written)
    assert names == sorted(
        ["interference", "latency_cdf", "cpu", "sigstop", "sweep", "ablation", "peer", "smol", "prefix"]
        + ["prefix_cache_smollm2"]
    )
    for p in written:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(p) > 10_000
    assert all(p.endswith("-h200-abc1234.png") for p in written)


@pytest.mark.slow
def test_paper_quick_end_to_end_on_the_emulated_device(tmp_path):
    """Every server part against real `blink serve` processes (both scheduler labels; the emulated
    device has one scheduler), strict JSON named <part>-emulated-<commit>.json, figures from them."""
    sg = tmp_path / "sg.json"
    convs = [
        {"conversations": [{"from": "human", "value": f"question {i} " * (3 + i % 5)}, {"from": "gpt", "value": "answer " * (6 + i % 7)}]}
        for i in range(40)
    ]  # fmt: skip
    sg.write_text(json.dumps(convs))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "bench.paper.evaluate", "--device", "emulated", "--quick", "--commit", "c0ffee1",
           "--parts", "interference,cpu,sigstop,sweep,ablation", "--sharegpt", str(sg), "--out", str(out)]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "==== bench/paper/evaluate.py summary ====" in r.stdout and "FAILED" not in r.stdout
    docs = {}
    for part in ("interference", "cpu", "sigstop", "sweep", "ablation"):
        path = out / f"{part}-emulated-c0ffee1.json"
        docs[part] = json.loads(path.read_text(), parse_constant=lambda c, p=path: pytest.fail(f"{c} in {p}"))
        d = docs[part]
        assert d["what"] == part and d["device"] == "emulated" and d["commit"] == "c0ffee1"
        assert "bench.paper.evaluate" in d["command"] and set(d["results"]) == {"gpu", "host"}
    for sched in ("gpu", "host"):
        c = docs["interference"]["results"][sched]["closed"]
        assert c["idle"]["steady_tok_per_s"] > 0 and c["hogs"]["steady_tok_per_s"] > 0 and c["idle"]["failed"] == 0
        assert [(o["rate"], o["load"]) for o in docs["interference"]["results"][sched]["open"]] == [
            (4.0, "idle"),
            (4.0, "hogs"),
        ]
        # the TTFT bound: the prompt prefilled alone (device stage of 8 one-token requests) and
        # each open-loop run's mean decode step, from the server's /metrics
        tb = docs["interference"]["results"][sched]["ttft_bound"]
        assert tb["alone_requests"] == 8 and tb["prefill_alone_ms"] > 0
        assert [(r["rate"], r["load"]) for r in tb["rows"]] == [(4.0, "idle"), (4.0, "hogs")]
        assert all(r["limit_ms"] > tb["prefill_alone_ms"] + 2 for r in tb["rows"])
        cpu = docs["cpu"]["results"][sched]
        assert cpu["device_cpu_s"] > 0 and cpu["device_cpu_s_per_mtok"] > 0 and cpu["total_output_tokens"] > 0
        st = docs["sigstop"]["results"][sched]
        # the emulated device is the device process: stopped, it publishes nothing (what was in flight aside)
        assert (
            st["tok_per_s_before"] > 0 and st["ratio_stopped_over_before"] < 0.5 and st["longest_gap_stopped_ms"] > 500
        )
        assert [row["request_rate"] for row in docs["sweep"]["results"][sched]["rows"]] == [4.0, "inf"]
        assert all(row["completed"] > 0 and row["failed"] == 0 for row in docs["sweep"]["results"][sched]["rows"])
        assert len(docs["ablation"]["results"][sched]["rows"]) == 2
    assert len(docs["ablation"]["ratio_host_over_gpu"]) == 2
    written = plots.draw(sorted(str(p) for p in out.glob("*.json")), str(tmp_path / "fig"))
    assert len(written) == 6  # interference, latency_cdf, cpu, sigstop, sweep, ablation


@pytest.mark.slow
def test_paper_prefix_part_on_the_emulated_device(tmp_path):
    """The prefix caching part: two real `blink serve` processes (caching on, off), bench/serving/
    prefix_cache.py's workloads at tiny sizes, strict JSON, its TTFT CDF figure."""
    sg = tmp_path / "sg.json"
    turns = lambda i: [  # noqa: E731
        m for k in range(4)
        for m in ({"from": "human", "value": f"question {i} {k} " * (2 + (i + k) % 4)}, {"from": "gpt", "value": "answer " * (4 + i % 5)})
    ]  # fmt: skip
    sg.write_text(json.dumps([{"conversations": turns(i)} for i in range(8)]))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "bench.paper.evaluate", "--device", "emulated", "--quick", "--commit", "c0ffee1",
           "--parts", "prefix", "--schedulers", "gpu", "--sharegpt", str(sg), "--out", str(out)]  # fmt: skip
    r = subprocess.run(
        cmd, capture_output=True, text=True, timeout=280, env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "prefix caching multi-turn hit rate" in r.stdout
    path = out / "prefix-emulated-c0ffee1.json"
    doc = json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in {path}"))
    assert doc["what"] == "prefix" and doc["device"] == "emulated" and set(doc["results"]) == {"gpu"}
    g = doc["results"]["gpu"]
    assert "--no-enable-prefix-caching" in g["servers"]["off"] and "--enable-prefix-caching" in g["servers"]["on"]
    on, off = g["results"]["on"], g["results"]["off"]
    assert set(on) == set(off) == {"shared@4", "multiturn", "noreuse", "claim_to_launch"}
    assert all(
        v["failed"] == 0 and v["completed"] > 0 for rs in (on, off) for k, v in rs.items() if k != "claim_to_launch"
    )
    assert on["shared@4"]["prefix_cache_hit_rate"] > 0.5 and on["multiturn"]["prefix_cache_hit_rate"] > 0.2
    assert off["shared@4"]["prefix_cache_hit_rate"] == 0.0 and on["noreuse"]["prefix_cache_hit_rate"] == 0.0
    assert {"ttft_p50_shared@4", "ttft_p50_multiturn", "noreuse_throughput"} == set(g["ratios_on_over_off"])
    (png,) = plots.draw([str(path)], str(tmp_path / "fig"))
    assert os.path.basename(png) == "prefix-emulated-c0ffee1.png" and os.path.getsize(png) > 10_000


def test_paper_json_has_no_nan_or_infinity():
    """A part's numbers go through evaluate.finite before the strict dump: NaN and inf become null."""

    doc = evaluate.finite({"a": float("nan"), "b": [1.0, float("inf"), {"c": -float("inf")}], "d": "inf", "e": 2})
    assert json.loads(json.dumps(doc, allow_nan=False)) == {
        "a": None,
        "b": [1.0, None, {"c": None}],
        "d": "inf",
        "e": 2,
    }


def test_paper_server_that_does_not_start_is_a_failure_not_a_crash(tmp_path):
    """A server that exits at start is recorded (summary, exit code 1), and the other scheduler's
    server is still tried: one bad start must not lose the rest of the run."""
    cmd = [sys.executable, "-m", "bench.paper.evaluate", "--device", "emulated", "--quick",
           "--parts", "ablation", "--model", "random:no-such-preset", "--out", str(tmp_path)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 1, r.stdout + r.stderr
    failed = r.stdout.split("FAILED: ", 1)[1]
    assert "gpu server (random:no-such-preset)" in failed and "host server (random:no-such-preset)" in failed
    assert not list(tmp_path.glob("*.json"))
