"""The CUDA scheduler's view of the scheduling policy's constants (blink.device.policy), generated:

    python -m blink.gpu.scheduler.policy_header [--check]

writes csrc/scheduler_policy.cuh; a test fails while it is stale. The limits (batch, tokens per
step, context, long-prefill cap, mixed budget) reach the kernel through the control block, computed
on the host by blink.device.policy.step_limits.
"""

from __future__ import annotations

import pathlib

from blink.device import policy
from blink.protocol.cgen import header_main, header_text

HEADER_PATH = pathlib.Path(__file__).resolve().parent / "csrc" / "scheduler_policy.cuh"


def render() -> str:
    body = [
        "// waiting sequences behind the first whose tokens count in the prefill backlog",
        f"constexpr uint32_t BACKLOG_SCAN = {policy.BACKLOG_SCAN};",
        "// a mixed budget doubles while the backlog is at least this many times its prefill share",
        f"constexpr uint32_t BACKLOG_FACTOR = {policy.BACKLOG_FACTOR};",
        "// a group (the choices of one API request) holds at most 1/GROUP_SHARE_DIVISOR of the batch",
        f"constexpr uint32_t GROUP_SHARE_DIVISOR = {policy.GROUP_SHARE_DIVISOR};",
        "",
    ]
    about = ["The scheduling policy's constants (step_budget, the prefill backlog, group_cap)."]
    return header_text("blink.gpu.scheduler.policy_header", "blink/device/policy.py", about, body)


def main(argv: list[str] | None = None) -> int:
    return header_main(HEADER_PATH, render, "blink.gpu.scheduler.policy_header", argv)


if __name__ == "__main__":
    raise SystemExit(main())
