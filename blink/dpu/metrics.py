"""/metrics: the frontend's counters and histograms (prometheus_client) plus the device's
counters and the ring's occupancy, read from the ring header when the scrape comes.

Every series exists twice where vLLM has a name for it: Blink's (`blink_*`) and vLLM's
(`vllm:*`, label `model_name`), so that dashboards and alerts written for a vLLM server keep
working after the switch.

Several frontend processes on one port (deploy.frontends > 1): prometheus_client's multiprocess
mode. `enable_multiprocess(folder, identifier)`, called once when such a process starts, makes
every counter and histogram of that process live in a memory-mapped file of `folder` named after
`identifier` (the frontend's index); whichever frontend answers a scrape merges every file, so
/metrics describes the whole server. A frontend restarted after a crash reopens its own file and
continues its counts. The live series (device, ring) come from the answering frontend.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import prometheus_client as prom
from prometheus_client import values
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from blink.protocol.layout import DEVICE_COUNTERS, DEVICE_GAUGES
from blink.protocol.wire import RingStats

from .mask_timing import MASK_LATENCY_EDGES_S

prom.disable_created_metrics()  # the *_created series vLLM dashboards do not use

DEVICE_FIELDS = DEVICE_GAUGES + DEVICE_COUNTERS  # exported from the ring header

_STAGE_BUCKETS = (2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0, 5.0)
_LAT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_REQ_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5))  # vLLM's 1-2-5 series

_multiproc_dir: pathlib.Path | None = None  # set by enable_multiprocess (one per process)


def enable_multiprocess(folder: str | os.PathLike, identifier: str, restore: bool) -> None:
    """Make this process's metrics one part of a multi-process /metrics. Call before any Metrics
    is made. identifier: the same for a process and its restarted successor (the frontend
    index); restore: continue the counts a predecessor of that identifier left in `folder`
    (otherwise they are stale, e.g. from an earlier deployment, and removed)."""
    global _multiproc_dir
    path = pathlib.Path(folder)
    if not restore:
        remove_files(path, identifier)
    path.mkdir(parents=True, exist_ok=True)
    # prometheus_client opens its files in the folder this variable names (set here, at the edge
    # of the process); the identifier replaces the pid in the file names.
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(path)
    values.ValueClass = values.MultiProcessValue(lambda: identifier)
    _multiproc_dir = path


def remove_files(folder: str | os.PathLike, identifier: str | None = None) -> None:
    """The metric files of one process (a clean stop), or of all (the deployment goes away)."""
    for f in pathlib.Path(folder).glob("*.db"):
        if identifier is None or f.stem.rsplit("_", 1)[-1] == identifier:
            f.unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # the last one out removes the folder
        pathlib.Path(folder).rmdir()


_FRONTEND_HELP = {
    "slot_faults": "requests ended because their slot showed a record no conforming device writes",
    "constraint_failures": "structured output requests ended because the grammar engine failed them",
}


@dataclass
class LiveState:
    """What a scrape reads from the backend at that moment."""

    up: bool
    ring: RingStats
    device: dict[str, int]  # DEVICE_FIELDS, from the ring header
    mask_latency: Sequence[int] = ()  # MaskLatency.snapshot: per bucket of MASK_LATENCY_EDGES_S (+ one above), sum ns
    frontend: dict[str, int] = field(default_factory=dict)  # the token reader's counts (frontend_counters)


@dataclass
class Finished:
    """One request's figures when it ends, for the histograms (times in seconds; None: unknown)."""

    n_prompt: int
    n_gen: int
    e2e: float
    finish: Sequence[str]  # OpenAI finish_reason per choice
    queue: float | None = None  # arrival to device admission (choice 0)
    prefill: float | None = None  # device admission to first token
    decode: float | None = None  # first token to last


class _LiveCollector(Collector):
    """Device and ring series, read from the backend when the scrape comes."""

    def __init__(self, model_name: str, live: Callable[[], LiveState]) -> None:
        self.model_name, self.live = model_name, live

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
        st = self.live()
        yield GaugeMetricFamily("blink_device_up", "1 when the device is serving", value=int(st.up))
        ring = {"slots": st.ring.n_slots, "busy_slots": st.ring.busy_slots, "free_slots": st.ring.free_slots}
        ring["queued"] = st.ring.queued
        for k, v in ring.items():
            yield GaugeMetricFamily(f"blink_ring_{k}", f"ring {k.replace('_', ' ')} (this frontend)", value=v)
        for k, v in st.device.items():
            if k in DEVICE_GAUGES:
                yield GaugeMetricFamily(f"blink_device_{k}", f"device {k.replace('_', ' ')}", value=v)
            else:
                yield CounterMetricFamily(f"blink_device_{k}", f"device {k.replace('_', ' ')}", value=v)

        def vllm(name: str, v: float, help_: str) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, help_, labels=["model_name"])
            g.add_metric([self.model_name], v)
            return g

        dev = st.device
        yield vllm("vllm:num_requests_running", dev.get("running", 0), "requests in the running batch")
        waiting = dev.get("waiting", 0) + st.ring.queued
        yield vllm("vllm:num_requests_waiting", waiting, "requests waiting (device queue + frontend queue)")
        usage = kv_usage(dev)
        yield vllm("vllm:kv_cache_usage_perc", usage, "KV cache usage (1 = full)")
        yield vllm("vllm:gpu_cache_usage_perc", usage, "KV cache usage (1 = full; the older name)")
        for name, help_ in (("queries", "prompt tokens looked up"), ("hits", "prompt tokens found")):
            c = CounterMetricFamily(f"vllm:prefix_cache_{name}", f"prefix cache: {help_}", labels=["model_name"])
            c.add_metric([self.model_name], dev.get(f"prefix_cache_{name}", 0))
            yield c
        if st.mask_latency:
            yield mask_latency_family(st.mask_latency)
        for k, v in st.frontend.items():
            yield CounterMetricFamily(f"blink_frontend_{k}", _FRONTEND_HELP.get(k, k.replace("_", " ")), value=v)


def mask_latency_family(snapshot: Sequence[int]) -> HistogramMetricFamily:
    """blink_mask_latency_seconds: per constrained token, the token reader's cycle that read it to the
    post of the next mask (blink/dpu/mask_timing.py: MaskLatency.snapshot, the counts then the sum)."""
    cum, buckets = 0, []
    for edge, c in zip((*map(str, MASK_LATENCY_EDGES_S), "+Inf"), snapshot[:-1], strict=True):
        cum += int(c)
        buckets.append((edge, cum))
    help_ = "structured output: token read (reader cycle start) to its next mask posted"
    return HistogramMetricFamily("blink_mask_latency_seconds", help_, buckets=buckets, sum_value=snapshot[-1] * 1e-9)


def kv_usage(device: dict[str, int]) -> float:
    total = device.get("kv_blocks_total", 0)
    return round(1.0 - device.get("kv_blocks_free", 0) / total, 6) if total else 0.0


class Metrics:
    """The frontend's series. `live`: the backend's state, read at each scrape."""

    def __init__(self, model_name: str, live: Callable[[], LiveState]) -> None:
        self.model_name = model_name
        self.registry = prom.CollectorRegistry(auto_describe=False)
        self._live = _LiveCollector(model_name, live)
        r, lab = self.registry, ["model_name"]
        # plain counts of this process, for the periodic stats line
        self.n_prompt = self.n_gen = 0
        self.requests = prom.Counter(
            "blink_requests", "HTTP requests by endpoint and outcome", ["endpoint", "outcome"], registry=r
        )
        self.prompt_tokens = prom.Counter("blink_prompt_tokens", "prompt tokens submitted", registry=r)
        self.generation_tokens = prom.Counter("blink_generation_tokens", "tokens delivered to clients", registry=r)
        self.cancelled = prom.Counter("blink_cancelled", "requests cancelled because the client went away", registry=r)
        self.ttft = prom.Histogram(
            "blink_time_to_first_token_seconds",
            "HTTP request received to first token read",
            buckets=_LAT_BUCKETS,
            registry=r,
        )
        self.itl = prom.Histogram(
            "blink_inter_token_latency_seconds", "time between tokens of a stream", buckets=_LAT_BUCKETS, registry=r
        )
        self.e2e = prom.Histogram(
            "blink_request_latency_seconds", "HTTP request received to last token", buckets=_LAT_BUCKETS, registry=r
        )
        # The first token's path, stage by stage (frontend and device stamp one wall clock).
        self.stages = [
            prom.Histogram(f"blink_first_token_{name}_seconds", help_, buckets=_STAGE_BUCKETS, registry=r)
            for name, help_ in (
                ("submit", "HTTP request received to slot published (parse, tokenize, claim)"),
                ("admit", "slot published to device admission"),
                ("launch", "device admission to the launch of the step that sampled the first token"),
                ("device", "that launch to the first token in the ring (prefill, publish)"),
                ("read", "first token in the ring to token reader"),
                ("write", "token reader to first response byte written"),
            )
        ]

        def vc(name: str, help_: str, extra: Sequence[str] = ()) -> prom.Counter:
            return prom.Counter(name, help_, [*lab, *extra], registry=r)

        def vh(name: str, help_: str, buckets: Sequence[float] = _REQ_BUCKETS) -> prom.Histogram:
            return prom.Histogram(name, help_, lab, buckets=buckets, registry=r).labels(model_name)

        self.v_prompt = vc("vllm:prompt_tokens", "prompt tokens submitted").labels(model_name)
        self.v_gen = vc("vllm:generation_tokens", "tokens delivered to clients").labels(model_name)
        self.v_success = vc("vllm:request_success", "requests finished, by finish reason", ["finished_reason"])
        self.v_ttft = vh("vllm:time_to_first_token_seconds", "time to first token", _LAT_BUCKETS)
        self.v_e2e = vh("vllm:e2e_request_latency_seconds", "request latency")
        self.v_itl = vh("vllm:inter_token_latency_seconds", "time between tokens", _LAT_BUCKETS)
        self.v_tpot = vh("vllm:time_per_output_token_seconds", "time per output token", _LAT_BUCKETS)
        self.v_prompt_h = vh("vllm:request_prompt_tokens", "prompt tokens per request", _TOKEN_BUCKETS)
        self.v_gen_h = vh("vllm:request_generation_tokens", "generated tokens per request", _TOKEN_BUCKETS)
        self.v_queue = vh("vllm:request_queue_time_seconds", "request received to device admission")
        self.v_prefill = vh("vllm:request_prefill_time_seconds", "device admission to first token")
        self.v_decode = vh("vllm:request_decode_time_seconds", "first token to last token")

    # -- observations ------------------------------------------------------------------------
    def request(self, endpoint: str, outcome: str) -> None:
        self.requests.labels(endpoint, outcome).inc()

    def prompt(self, n: int) -> None:
        self.n_prompt += n
        self.prompt_tokens.inc(n)
        self.v_prompt.inc(n)

    def tokens(self, n: int, gap: float | None) -> None:
        """n new tokens of one choice; gap: seconds since that choice's previous tokens (None: its first)."""
        self.n_gen += n
        self.generation_tokens.inc(n)
        self.v_gen.inc(n)
        if gap is not None and n:
            for _ in range(n):
                self.itl.observe(gap / n)
                self.v_itl.observe(gap / n)
                self.v_tpot.observe(gap / n)

    def first(self, ttft: float) -> None:
        self.ttft.observe(ttft)
        self.v_ttft.observe(ttft)

    def first_token(self, t_http_ns: int, timing: Sequence[int], t_write_ns: int) -> None:
        """Record the stages of one request's first token; timing = [submit, admit, launch, first, read] ns."""
        if len(timing) != 5 or not timing[1] or not timing[2] or not timing[3]:
            return
        t = (t_http_ns, *timing, t_write_ns)
        for h, a, b in zip(self.stages, t, t[1:], strict=False):
            h.observe(max(0, b - a) * 1e-9)

    def finished(self, f: Finished) -> None:
        """A request answered in full."""
        self.e2e.observe(f.e2e)
        self.v_e2e.observe(f.e2e)
        self.v_prompt_h.observe(f.n_prompt)
        self.v_gen_h.observe(f.n_gen)
        for reason in f.finish:
            self.v_success.labels(self.model_name, reason).inc()
        for h, v in ((self.v_queue, f.queue), (self.v_prefill, f.prefill), (self.v_decode, f.decode)):
            if v is not None:
                h.observe(max(0.0, v))

    def aborted(self, n_choices: int) -> None:
        """The client went away before the end."""
        self.cancelled.inc()
        self.v_success.labels(self.model_name, "abort").inc(n_choices)

    # -- exposition --------------------------------------------------------------------------
    def render(self) -> bytes:
        """The exposition text: every frontend's series in multiprocess mode, else this one's."""
        if _multiproc_dir is None:
            reg = self.registry
            reg.register(self._live)
            try:
                return prom.generate_latest(reg)
            finally:
                reg.unregister(self._live)
        reg = prom.CollectorRegistry(auto_describe=False)
        MultiProcessCollector(reg, str(_multiproc_dir))
        reg.register(self._live)
        return prom.generate_latest(reg)


class StatsLine:
    """The periodic log line an operator reads (vLLM's "Avg prompt throughput ..."): running,
    waiting, KV usage, and prompt / generation tokens per second since the previous line. An idle
    server logs one idle line, then nothing until something happens."""

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics
        self.t, self.p, self.g = time.monotonic(), metrics.n_prompt, metrics.n_gen
        self.cache: tuple[int, int] | None = None  # the device's (queries, hits) at the previous line
        self.idle = False

    def line(self, st: LiveState) -> str | None:
        now = time.monotonic()
        dt = max(now - self.t, 1e-9)
        p, g = (self.m.n_prompt - self.p) / dt, (self.m.n_gen - self.g) / dt
        self.t, self.p, self.g = now, self.m.n_prompt, self.m.n_gen
        dev = st.device
        running, waiting = dev.get("running", 0), dev.get("waiting", 0) + st.ring.queued
        idle = st.up and not (p or g or running or waiting)
        if idle and self.idle:
            return None
        self.idle = idle
        return (
            f"prompt {p:.1f} tok/s, generation {g:.1f} tok/s, running {running}, "
            f"waiting {waiting}, KV cache {100 * kv_usage(dev):.1f} %{self._hit_rate(dev)}"
            + ("" if st.up else ", device DOWN")
        )

    def _hit_rate(self, dev: dict[str, int]) -> str:
        """The prefix cache's hit rate (prompt tokens) since the previous line; "" before any query."""
        now = (dev.get("prefix_cache_queries", 0), dev.get("prefix_cache_hits", 0))
        prev, self.cache = self.cache or (0, 0), now
        dq, dh = now[0] - prev[0], now[1] - prev[1]
        return f", prefix cache hit rate {100 * dh / dq:.1f} %" if dq > 0 else ""
