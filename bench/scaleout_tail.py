"""Where the slow first tokens of a scale-out run come from: TTFT tail by client process and by
arrival time, from a bench/scaleout.py results JSON (open-loop phase).

    python bench/scaleout_tail.py bench/results/scaleout-2xh200-ray-0d40707.json [--skip-s 2]

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
    a = ap.parse_args(argv)
    d = json.loads(Path(a.json).read_text())
    args = d["args"]
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
