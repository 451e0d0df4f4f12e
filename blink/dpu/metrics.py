"""Prometheus text exposition for /metrics: frontend counters and histograms plus the device's
counters read from the ring header. No client library: the format is a few lines of text."""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence

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

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        acc = 0
        for b, c in zip(self.buckets, self.counts, strict=False):
            acc += c
            out.append(f'{self.name}_bucket{{le="{b}"}} {acc}')
        out.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        out += [f"{self.name}_sum {self.sum:.6f}", f"{self.name}_count {self.count}"]
        return out


class Metrics:
    def __init__(self) -> None:
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

    def render(self, ring: Mapping[str, int], device: Mapping[str, int], up: bool) -> str:
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
        for h in (self.ttft, self.itl, self.e2e, *self.stages.values()):
            lines += h.render()
        lines += ["# HELP blink_device_up 1 when the device is serving", "# TYPE blink_device_up gauge"]
        lines.append(f"blink_device_up {int(up)}")
        for k, v in ring.items():
            lines += [f"# TYPE blink_ring_{k} gauge", f"blink_ring_{k} {v}"]
        for k, v in device.items():
            kind = "gauge" if k in DEVICE_GAUGES else "counter"
            suffix = "" if kind == "gauge" or k.endswith("_total") else "_total"
            lines += [f"# TYPE blink_device_{k}{suffix} {kind}", f"blink_device_{k}{suffix} {v}"]
        return "\n".join(lines) + "\n"


DEVICE_FIELDS = DEVICE_GAUGES + DEVICE_COUNTERS  # exported from the ring header
