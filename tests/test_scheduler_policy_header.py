"""The scheduling policy's constants and limits are defined once (blink.device.policy): the CUDA
scheduler's header is generated from them, its step_budget and group_cap give the Python policy's
values on every case (the header built with the host compiler), and both devices take their limits
from step_limits."""

from __future__ import annotations

import itertools
import pathlib
import re
import shutil
import subprocess
import types

import pytest

from blink.device import policy
from blink.gpu.scheduler import policy_header
from blink.gpu.scheduler import scheduler as S

CXX = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")

MAX_TOKENS = (256, 2048, 8192)
MIXED = (0, 1, 64, 192, 256, 512, 2048, 4096, 9000)
DECODES = (0, 1, 2, 20, 95, 96, 97, 200, 256, 288, 289, 1024)
BACKLOG = (0, 1, 255, 256, 687, 688, 1455, 1456, 4096, 65536, 1 << 20)
CASES = list(itertools.product(MAX_TOKENS, MIXED, DECODES, BACKLOG))


def test_policy_header_is_generated_from_the_policy():
    assert policy_header.HEADER_PATH.read_text() == policy_header.render(), (
        "run `python -m blink.gpu.scheduler.policy_header`"
    )
    assert policy_header.main(["--check"]) == 0
    text = policy_header.HEADER_PATH.read_text()
    assert f"BACKLOG_SCAN = {policy.BACKLOG_SCAN};" in text and f"BACKLOG_FACTOR = {policy.BACKLOG_FACTOR};" in text


def test_the_kernel_build_covers_the_policy_headers():
    names = {p.name for p in S.UNIT.deps}
    assert {"scheduler_policy.cuh", "scheduler_budget.cuh"} <= names
    plan = (S.CSRC / "scheduler_plan.cuh").read_text()
    # no hand copy of a policy constant in the planner: each is defined in the generated header only
    for name in ("BACKLOG_SCAN", "BACKLOG_FACTOR"):
        assert not re.search(rf"(constexpr|#define)[^\n]*\b{name}\b", plan), name


def _run_header_fn(tmp_path: pathlib.Path, call: str, rows: list[tuple[int, ...]]) -> list[int]:
    """blink::<call> of scheduler_budget.cuh, built with the host compiler, on each row of ints."""
    n = len(rows[0])
    names = ", ".join(f"a{i}" for i in range(n))
    src = tmp_path / "fn.cpp"
    src.write_text(
        '#include <cstdio>\n#include "scheduler_budget.cuh"\n'
        f"int main() {{ unsigned {names};\n"
        f'  while (std::scanf("{" ".join(["%u"] * n)}", {", ".join("&a" + str(i) for i in range(n))}) == {n})\n'
        f'    std::printf("%u\\n", blink::{call}({names}));\n'
        "}\n"
    )
    exe = tmp_path / "fn"
    subprocess.run([CXX, "-std=c++17", "-O1", f"-I{S.CSRC}", str(src), "-o", str(exe)], check=True)
    stdin = "".join(" ".join(map(str, r)) + "\n" for r in rows)
    out = subprocess.run([str(exe)], input=stdin, capture_output=True, text=True, check=True).stdout.split()
    return [int(x) for x in out]


@pytest.mark.skipif(CXX is None, reason="no host C++ compiler")
def test_cuda_step_budget_gives_the_python_budget_on_every_case(tmp_path: pathlib.Path):
    got = _run_header_fn(tmp_path, "step_budget", CASES)
    want = [policy.step_budget(t, m, d, b) for t, m, d, b in CASES]
    bad = [(c, w, g) for c, w, g in zip(CASES, want, got, strict=True) if w != g]
    assert len(got) == len(CASES) and not bad, bad[:5]


@pytest.mark.skipif(CXX is None, reason="no host C++ compiler")
def test_cuda_group_cap_gives_the_python_share(tmp_path: pathlib.Path):
    batches = [1, 2, 3, 4, 5, 7, 8, 63, 64, 255, 256, 1024]
    assert _run_header_fn(tmp_path, "group_cap", [(b,) for b in batches]) == [policy.group_cap(b) for b in batches]


def test_step_limits_cap_by_executor_pool_and_rows():
    lim = policy.step_limits(256, 4096, 8192, 100, 16, max_batch=512, max_num_batched_tokens=8192)
    assert lim == policy.StepLimits(256, 4096, 1601, 1024, 0)  # context capped by the pool alone
    lim = policy.step_limits(256, 4096, 8192, 1000, 16, max_batch=64, max_num_batched_tokens=2048, mixed_tokens=256)
    assert (lim.max_batch, lim.max_num_batched_tokens, lim.long_prefill_tokens, lim.mixed_tokens) == (
        64,
        2048,
        512,
        256,
    )
    assert policy.step_limits(256, 128, 4096, 1000, 16).max_batch == 128  # a step carries every decode
    assert policy.step_limits(2048, 4096, 4096, 1000, 16, batch_cap=1024).max_batch == 1024
    for mixed in (4096, 5000):  # a mixed budget at or above the step's tokens is off
        assert policy.step_limits(256, 4096, 4096, 1000, 16, mixed_tokens=mixed).mixed_tokens == 0
    assert policy.step_limits(256, 4096, 4096, 1000, 16, long_prefill_tokens=7).long_prefill_tokens == 7


def test_both_devices_take_their_limits_from_step_limits():
    """The emulated device's ring interpreter and the CUDA scheduler's launcher (no GPU needed for
    its limits) apply the same rule to the same capacity and settings."""
    from blink.device.ring_device import RingDevice, RingDeviceConfig
    from blink.protocol.ring_geometry import RingGeometry, RingView

    dims = types.SimpleNamespace(
        max_seqs=64, max_num_batched_tokens=512, max_context=2048, num_blocks=40, block_size=16
    )
    ex = types.SimpleNamespace(
        max_batch=64,
        max_num_batched_tokens=512,
        max_context=2048,
        num_blocks=40,
        block_size=16,
        vocab_size=100,
        features=0,
    )
    geo = RingGeometry(4, 64, 16)
    view = RingView.create(bytearray(geo.total_bytes), geo)
    settings = dict(max_batch=32, max_num_batched_tokens=256, long_prefill_tokens=0, mixed_tokens=256)
    want = policy.step_limits(64, 512, 2048, 40, 16, **settings, batch_cap=S.MAX_ROWS)
    gpu = S.GpuScheduler(types.SimpleNamespace(dims=dims, driver=None), view, S.GpuSchedulerConfig(**settings))
    assert gpu.limits() == want and want.mixed_tokens == 0 and want.max_context == 641
    dev = RingDevice(view, ex, RingDeviceConfig(**settings))
    assert (dev.max_batch, dev.max_num_batched_tokens, dev.max_context) == want[:3]
    c = dev.sched.config
    assert (c.long_prefill_tokens, c.mixed_tokens) == (want.long_prefill_tokens, want.mixed_tokens)
