"""Prometheus text exposition for /metrics: frontend counters and histograms plus the device's
counters read from the ring header. No client library: the format is a few lines of text.

Several frontend processes serving one port (deploy.frontends > 1) each count what they serve;
each publishes a snapshot of its counters (MetricsShare, a file per frontend in /dev/shm, about
once a second), and whichever frontend answers a scrape adds its peers' snapshots to its own, so
/metrics describes the whole server whichever process the kernel hands the connection to.
"""

from __future__ import annotations

import bisect
import os
import pathlib
from collections.abc import Mapping, Sequence

import msgspec

from blink.protocol.layout import DEVICE_COUNTERS, DEVICE_GAUGES

_STAGE_BUCKETS = (2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0, 5.0)
_LAT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Histogram:
    def __init__(self, name: str, help_: str, buckets: Sequence[float] = _LAT_BUCKETS):
        self.name, self.help = name, help_
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1

    def render(self, name: str = "", labels: str = "") -> list[str]:
        """Exposition lines; `name` / `labels` (e.g. 'model_name="x"'): the same data under another name."""
        name = name or self.name
        lab = f"{labels}," if labels else ""
        out = [f"# HELP {name} {self.help}", f"# TYPE {name} histogram"]
        acc = 0
        for b, c in zip(self.buckets, self.counts, strict=False):
            acc += c
            out.append(f'{name}_bucket{{{lab}le="{b}"}} {acc}')
        out.append(f'{name}_bucket{{{lab}le="+Inf"}} {self.count}')
        tail = f"{{{labels}}}" if labels else ""
        out += [f"{name}_sum{tail} {self.sum:.6f}", f"{name}_count{tail} {self.count}"]
        return out


class HistogramState(msgspec.Struct, array_like=True):
    counts: list[int]
    sum: float
    count: int


class MetricsSnapshot(msgspec.Struct, kw_only=True):
    """One frontend's counters, as its peers read them (msgpack in a /dev/shm file)."""

    requests: list[tuple[str, str, int]]
    prompt_tokens: int
    generation_tokens: int
    cancelled: int
    histograms: dict[str, HistogramState]


class Metrics:
    def __init__(self, model_name: str = "") -> None:
        self.model_name = model_name  # the label of the vLLM-compatible series
        self.requests: dict[tuple[str, str], int] = {}  # (endpoint, outcome) -> count
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.cancelled = 0  # client disconnects and stop-string cancels
        self.ttft = Histogram("blink_time_to_first_token_seconds", "HTTP request received to first token read")
        self.itl = Histogram("blink_inter_token_latency_seconds", "time between tokens of a stream")
        self.e2e = Histogram("blink_request_latency_seconds", "HTTP request received to last token")
        # The first token's path, stage by stage (frontend and device stamp one wall clock).
        self.stages = {
            name: Histogram(f"blink_first_token_{name}_seconds", help_, _STAGE_BUCKETS)
            for name, help_ in (
                ("submit", "HTTP request received to slot published (parse, tokenize, claim)"),
                ("admit", "slot published to device admission"),
                ("device", "device admission to first token in the ring (prefill)"),
                ("read", "first token in the ring to token reader"),
                ("write", "token reader to first response byte written"),
            )
        }

    def first_token(self, t_http_ns: int, timing: Sequence[int], t_write_ns: int) -> None:
        """Record the stages of one request's first token; timing = [submit, admit, first, read] ns."""
        if len(timing) != 4 or not timing[1] or not timing[2]:
            return
        t = (t_http_ns, *timing, t_write_ns)
        for h, a, b in zip(self.stages.values(), t, t[1:], strict=False):
            h.observe(max(0, b - a) * 1e-9)

    def request(self, endpoint: str, outcome: str) -> None:
        k = (endpoint, outcome)
        self.requests[k] = self.requests.get(k, 0) + 1

    def histograms(self) -> list[Histogram]:
        return [self.ttft, self.itl, self.e2e, *self.stages.values()]

    def snapshot(self) -> MetricsSnapshot:
        return MetricsSnapshot(
            requests=[(ep, oc, n) for (ep, oc), n in sorted(self.requests.items())],
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            cancelled=self.cancelled,
            histograms={h.name: HistogramState(list(h.counts), h.sum, h.count) for h in self.histograms()},
        )

    def add(self, snap: MetricsSnapshot) -> None:
        """Add a snapshot's counts to these (peers' counts for a scrape, or this frontend's own
        counts from before a restart). Histograms of other bucket layouts are skipped."""
        for ep, oc, n in snap.requests:
            self.requests[(ep, oc)] = self.requests.get((ep, oc), 0) + n
        self.prompt_tokens += snap.prompt_tokens
        self.generation_tokens += snap.generation_tokens
        self.cancelled += snap.cancelled
        for h in self.histograms():
            st = snap.histograms.get(h.name)
            if st is not None and len(st.counts) == len(h.counts):
                h.counts = [a + b for a, b in zip(h.counts, st.counts, strict=True)]
                h.sum += st.sum
                h.count += st.count

    def render(
        self, ring: Mapping[str, int], device: Mapping[str, int], up: bool, peers: Sequence[MetricsSnapshot] = ()
    ) -> str:
        """The exposition text; `peers`: the other frontends' snapshots, added to these counts."""
        if peers:
            total = Metrics(self.model_name)
            total.add(self.snapshot())
            for snap in peers:
                total.add(snap)
            return total.render(ring, device, up)
        lines = [
            "# HELP blink_requests_total HTTP requests by endpoint and outcome",
            "# TYPE blink_requests_total counter",
        ]
        for (ep, oc), n in sorted(self.requests.items()):
            lines.append(f'blink_requests_total{{endpoint="{ep}",outcome="{oc}"}} {n}')
        for name, v, help_ in (
            ("blink_prompt_tokens_total", self.prompt_tokens, "prompt tokens submitted"),
            ("blink_generation_tokens_total", self.generation_tokens, "tokens delivered to clients"),
            ("blink_cancelled_total", self.cancelled, "requests cancelled because the client went away"),
        ):
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} counter", f"{name} {v}"]
        for h in self.histograms():
            lines += h.render()
        lines += ["# HELP blink_device_up 1 when the device is serving", "# TYPE blink_device_up gauge"]
        lines.append(f"blink_device_up {int(up)}")
        for k, v in ring.items():
            lines += [f"# TYPE blink_ring_{k} gauge", f"blink_ring_{k} {v}"]
        for k, v in device.items():
            kind = "gauge" if k in DEVICE_GAUGES else "counter"
            suffix = "" if kind == "gauge" or k.endswith("_total") else "_total"
            lines += [f"# TYPE blink_device_{k}{suffix} {kind}", f"blink_device_{k}{suffix} {v}"]
        lines += self._vllm_series(ring, device)
        return "\n".join(lines) + "\n"

    def _vllm_series(self, ring: Mapping[str, int], device: Mapping[str, int]) -> list[str]:
        """The same data under vLLM's metric names (vllm:*, label model_name), so that dashboards
        and alerts written for a vLLM server keep working after the switch."""
        lab = f'model_name="{self.model_name}"'
        out: list[str] = []

        def one(name: str, kind: str, v: float, help_: str) -> None:
            nonlocal out
            out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name}{{{lab}}} {v}"]

        one("vllm:num_requests_running", "gauge", device.get("running", 0), "requests in the running batch")
        waiting = device.get("waiting", 0) + ring.get("queued", 0)
        one("vllm:num_requests_waiting", "gauge", waiting, "requests waiting (device queue + frontend queue)")
        total = device.get("kv_blocks_total", 0)
        usage = 1.0 - device.get("kv_blocks_free", 0) / total if total else 0.0
        one("vllm:kv_cache_usage_perc", "gauge", round(usage, 6), "KV cache usage (1 = full)")
        one("vllm:gpu_cache_usage_perc", "gauge", round(usage, 6), "KV cache usage (1 = full; the older name)")
        one("vllm:prompt_tokens_total", "counter", self.prompt_tokens, "prompt tokens submitted")
        one("vllm:generation_tokens_total", "counter", self.generation_tokens, "tokens delivered to clients")
        ok = sum(n for (_, oc), n in self.requests.items() if oc == "ok")
        one("vllm:request_success_total", "counter", ok, "requests answered in full")
        out += self.ttft.render("vllm:time_to_first_token_seconds", lab)
        out += self.e2e.render("vllm:e2e_request_latency_seconds", lab)
        out += self.itl.render("vllm:inter_token_latency_seconds", lab)
        out += self.itl.render("vllm:time_per_output_token_seconds", lab)
        return out


DEVICE_FIELDS = DEVICE_GAUGES + DEVICE_COUNTERS  # exported from the ring header

_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(MetricsSnapshot)


class MetricsShare:
    """The snapshot files of `count` frontends: `<folder>/<prefix>.<index>`, one writer each."""

    def __init__(self, folder: str | os.PathLike, prefix: str, index: int, count: int, restore: bool = False) -> None:
        """restore: this frontend is the same one coming back (a crash and a restart): continue the
        counts its file holds; otherwise (a fresh deployment) the file's counts are stale."""
        if not 0 <= index < count:
            raise ValueError(f"frontend index {index} out of range for {count}")
        self.folder, self.prefix, self.index, self.count = pathlib.Path(folder), prefix, index, count
        self.restore = restore

    def path(self, k: int) -> pathlib.Path:
        return self.folder / f"{self.prefix}.{k}"

    def publish(self, snap: MetricsSnapshot) -> None:
        """Replace this frontend's file at once (write aside, then rename): readers never see half."""
        tmp = self.folder / f".{self.prefix}.{self.index}.tmp"
        tmp.write_bytes(_enc.encode(snap))
        os.replace(tmp, self.path(self.index))

    def read(self, k: int) -> MetricsSnapshot | None:
        try:
            return _dec.decode(self.path(k).read_bytes())
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            return None  # not published yet, or from an older layout

    def peers(self) -> list[MetricsSnapshot]:
        return [s for k in range(self.count) if k != self.index and (s := self.read(k)) is not None]

    def remove_all(self) -> None:
        """Every frontend's file (the deployment is going away)."""
        for k in range(self.count):
            self.path(k).unlink(missing_ok=True)
