"""Where the slow first tokens of a scale-out run come from: TTFT tail by client process and by
arrival time, from a bench/scaleout.py results JSON (open-loop phase).

    python bench/scaleout_tail.py bench/results/scaleout-2xh200-ray-0d40707.json [--skip-s 2]

Last, the open-loop TTFT p99 of each replica count against the first one's, with a 95 % bootstrap
interval of their ratio (requests resampled with replacement, --boot times): a p99 taken from a few
hundred requests moves by several per cent from run to run, and this says by how much.

Files written before the records carried the send time and the client process (commit b05516a)
are read too: arrival times are rebuilt from the seed and rate in the file's args, and request i
was sent by client i % client_procs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from loadgen import poisson_offsets  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json")
    ap.add_argument("--skip-s", type=float, default=2.0, help="also report the tail without the first SKIP_S s")
    ap.add_argument("--worst", type=int, default=12)
    ap.add_argument("--boot", type=int, default=2000, help="bootstrap resamples for the p99 ratio")
    a = ap.parse_args(argv)
    d = json.loads(Path(a.json).read_text())
    args = d["args"]
    ttfts: list[tuple[int, np.ndarray]] = []
    for run in d["runs"]:
        ph = run.get("poisson")
        if not ph or "per_request" not in ph:
            continue
        pr = np.array(ph["per_request"], dtype=float)
        n, procs = run["replicas"], ph["client_procs"]
        if pr.shape[1] >= 6:
            sent, client = pr[:, 4], pr[:, 5].astype(int)
        else:  # older records: rebuild arrivals (sent on time, or late: then the tail shows it)
            copies = n if args.get("per_replica") else 1
            n_open = args.get("open_requests") or args["requests"]
            sent = poisson_offsets(n_open, args["rate"], args["seed"], copies=copies)
            client = np.arange(len(pr)) % procs
        ttft = pr[:, 2]
        ttfts.append((n, ttft))
        late = sent >= a.skip_s
        print(f"replicas {n}, {ph['mode']}, {len(pr)} requests, {procs} client processes")
        print(
            f"  TTFT p99 {np.percentile(ttft, 99):.1f} ms; arrivals after {a.skip_s:g} s: "
            f"p99 {np.percentile(ttft[late], 99):.1f} ms, max {ttft[late].max():.0f} ms"
        )
        worst = np.argsort(-ttft)[: a.worst]
        print("  slowest (request, client, sent s, prompt tokens, TTFT ms):")
        print("   ", [(int(i), int(client[i]), round(float(sent[i]), 2), int(pr[i, 0]), int(ttft[i])) for i in worst])
        for k in range(procs):
            sel = client == k
            early, rest = ttft[sel & ~late], ttft[sel & late]
            print(
                f"  client {k}: p99 {np.percentile(ttft[sel], 99):6.1f}  max before {a.skip_s:g} s "
                f"{early.max() if early.size else 0:6.0f}  max after {rest.max() if rest.size else 0:6.0f}"
            )
    rng = np.random.default_rng(0)
    for n, t in ttfts[1:]:
        n0, t0 = ttfts[0]
        ratios = [
            np.percentile(rng.choice(t, t.size), 99) / np.percentile(rng.choice(t0, t0.size), 99) for _ in range(a.boot)
        ]
        lo, hi = np.percentile(ratios, [2.5, 97.5])
        r = np.percentile(t, 99) / np.percentile(t0, 99)
        print(f"TTFT p99, {n} replicas / {n0}: {r:.3f} (95 % bootstrap interval {lo:.3f} - {hi:.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
