"""What a token mask costs the device, through the ring alone: no HTTP frontend, no grammar engine.

    python -m bench.serving.mask_gate RESULTS_DIR [--device emulated|cuda] [--scheduler gpu|host]
        [--model random:llama3-8b] [--streams 32] [--tokens 128] [--commit C]

The device serves a fresh /dev/shm ring (as `blink serve` starts it); this process is the frontend,
written against the ring's numpy views: it submits `--streams` requests of `--tokens` tokens and reads
every slot's `generated` in a tight loop. A constrained request's client publishes the mask of token
k + 1 (every token allowed, so only the protocol's timing is measured) the moment it sees token k:
the bits, then slot.mask_position (blink/protocol/layout.py). TPOT per stream: (time of its last
token - time of its first) / (tokens - 1), as the client saw them. Three runs: unconstrained alone,
constrained alone, both together; for each, the rows the device made sit out a step because their
mask was not yet published (header.mask_late_rows), in all and per constrained token. On the emulated device the default executor is
bench.serving.paced_executor:h200_llama3_8b (a step takes the H200's Llama-3-8B step time), so what
the gate's placement costs shows on a CPU; on cuda it is the real model (random weights).

Writes RESULTS_DIR/mask_gate_<scheduler>-<emulated|gpu name>-<commit>.json.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from bench.common import add_commit_arg, write_json
from bench.serving.structured import device_result
from blink.config import BlinkConfig
from blink.launch import device_spec, start_device
from blink.protocol.layout import SlotState
from blink.protocol.ring_geometry import RingGeometry
from blink.protocol.transport import ShmTransport

PROMPT = 16
PACED = "bench.serving.paced_executor:h200_llama3_8b"


class RingClient:
    """Submits requests and follows them through numpy views of the ring (one process, this host)."""

    def __init__(self, view, streams: int, tokens: int, vocab: int):
        self.v, self.streams, self.tokens = view, streams, tokens
        self.region = view.geo.prompt_arena_tokens // view.geo.n_slots
        self.all_ids = np.zeros(view.geo.mask_words, np.uint32)
        self.all_ids[: vocab // 32] = 0xFFFFFFFF
        if vocab % 32:
            self.all_ids[vocab // 32] = (1 << (vocab % 32)) - 1
        self.rng = np.random.default_rng(0)
        self.stamp = 0
        self.timeout = 600.0

    def submit(self, slot: int, mask: int) -> None:
        v, off = self.v, slot * self.region
        v.prompt_arena[off : off + PROMPT] = self.rng.integers(3, 1000, PROMPT)
        v.slots[slot] = np.zeros((), v.slots.dtype)  # a fresh record: nothing left of the slot's last request
        rec = v.slots[slot]
        rec["request_id"] = slot + 1
        rec["prompt_offset"], rec["prompt_len"] = off, PROMPT
        rec["max_new_tokens"] = self.tokens
        rec["temperature"], rec["top_p"], rec["top_k"] = 0.0, 1.0, 0
        rec["n_stop"] = 0
        rec["mask_slot"], rec["mask_position"] = mask + 1, 0
        if mask >= 0:
            v.mask_arena[mask] = self.all_ids  # token 0's mask comes with the request
            rec["mask_position"] = 1
        self.stamp = max(time.time_ns(), self.stamp + 1)
        rec["t_submit_ns"] = self.stamp
        v.slots["state"][slot] = SlotState.PREFILL_PENDING  # after every field (x86 keeps stores in order)

    def run(self, free: int, masked: int) -> tuple[list[float], list[float]]:
        """Serve `free` unconstrained and `masked` constrained requests at once; TPOT (ms) of each kind."""
        v = self.v
        slots = list(range(free + masked))
        masks = {s: (s - free if s >= free else -1) for s in slots}
        for s in slots:
            self.submit(s, masks[s])
        v.header["submit_seq"] = int(v.header["submit_seq"]) + 1
        gen, state, pos = v.slots["generated"], v.slots["state"], v.slots["mask_position"]
        first, last, seen = {}, {}, dict.fromkeys(slots, 0)
        deadline = time.monotonic() + self.timeout
        live = set(slots)
        while live:
            if time.monotonic() > deadline:
                raise TimeoutError(f"slots {sorted(live)} not done")
            now = time.perf_counter()
            for s in list(live):
                k = int(gen[s])
                if k == seen[s]:
                    if state[s] == SlotState.DECODE_COMPLETED and int(gen[s]) == k:
                        err = int(v.slots["error"][s])
                        if k < self.tokens:
                            raise RuntimeError(f"slot {s} ended after {k} tokens (error {err})")
                        live.discard(s)
                    continue
                if seen[s] == 0:
                    first[s] = now
                seen[s], last[s] = k, now
                if masks[s] >= 0 and k < self.tokens:  # token k - 1 read: publish token k's mask
                    v.mask_arena[masks[s]] = self.all_ids
                    pos[s] = k + 1
                v.slots["consumed"][s] = k
                if k >= self.tokens or state[s] == SlotState.DECODE_COMPLETED:
                    live.discard(s)
        for s in slots:
            while state[s] != SlotState.DECODE_COMPLETED:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"slot {s} not completed: state {int(state[s])}, generated {int(gen[s])}")
                time.sleep(0.001)
            state[s] = SlotState.EMPTY
        tpot = {s: (last[s] - first[s]) / (seen[s] - 1) * 1e3 for s in slots if seen[s] > 1}
        return [tpot[s] for s in slots if masks[s] < 0 and s in tpot], [tpot[s] for s in slots if masks[s] >= 0]


def _stats(ms: list[float], late: int | None = None, tokens: int = 0) -> dict:
    if not ms:
        return {}
    sat_out = {} if late is None else {"sat_out_rows": late, "sat_out_per_token": round(late / max(tokens, 1), 4)}
    return sat_out | {
        "streams": len(ms),
        "tpot_ms_p50": round(float(np.median(ms)), 3),
        "tpot_ms_mean": round(float(np.mean(ms)), 3),
    }


def measure(a: argparse.Namespace) -> dict:
    n = a.streams
    name = f"blink-maskgate-{os.getpid()}"
    geo = RingGeometry(2 * n, 2 * n * 64, a.tokens + 8, n, 152_064)
    transport = ShmTransport.create(name, geo)
    device = {"kind": a.device, "max_batch": 2 * n, "scheduler": a.scheduler}
    if a.device == "emulated":
        device["executor"] = a.device_executor or PACED
    cfg = BlinkConfig().replace(model={"spec": a.model}, device=device)
    proc = start_device(device_spec(cfg, name))
    try:
        proc.wait_ready(transport, a.timeout)
        view = transport.view()
        client = RingClient(view, n, a.tokens, int(view.header["vocab_size"]))
        client.run(4, 4)  # warm-up

        def late() -> int:
            time.sleep(0.05)  # the device's statistics follow its last step
            return int(view.header["mask_late_rows"])

        free, _ = client.run(n, 0)
        l0 = late()
        _, masked = client.run(0, n)
        l1 = late()
        beside, with_free = client.run(n, n)
        l2 = late()
        view.header["shutdown"] = 1
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
        transport.close()
        transport.unlink()
    out = {
        "unconstrained": _stats(free),
        "constrained": _stats(masked, l1 - l0, n * a.tokens),
        "beside": {"unconstrained": _stats(beside), "constrained": _stats(with_free, l2 - l1, n * a.tokens)},
    }
    out["ratio_p50"] = round(out["constrained"]["tpot_ms_p50"] / out["unconstrained"]["tpot_ms_p50"], 3)
    print(out, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="folder for the JSON result")
    ap.add_argument("--model", default="random:llama3-8b")
    ap.add_argument("--device", default="emulated", choices=("emulated", "cuda"))
    ap.add_argument("--scheduler", default="host", choices=("gpu", "host"))
    ap.add_argument("--device-executor", default="", help=f"emulated device's executor (default {PACED})")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--timeout", type=float, default=600)
    add_commit_arg(ap)
    a = ap.parse_args(argv)
    result, where, commit = device_result(a, argv)
    result |= measure(a)
    write_json(os.path.join(a.results, f"mask_gate_{a.scheduler}-{where}-{commit}.json"), result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
