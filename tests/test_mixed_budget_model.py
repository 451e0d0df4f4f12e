"""bench/scheduler/mixed_budget_model.py: the cost-model replay that chose DEFAULT_MIXED_TOKENS."""

from __future__ import annotations

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_default_budget_bounds_the_modelled_itl_tail():
    from bench.scheduler import mixed_budget_model as mod
    from blink.config import DEFAULT_MIXED_TOKENS

    off = mod.simulate(24.0, 0, 300, 256, 128, 256, 2048, 0)
    on = mod.simulate(24.0, DEFAULT_MIXED_TOKENS, 300, 256, 128, 256, 2048, 0)
    assert off["itl_p99"] > 2 * off["itl_p50"]  # whole prompts in 512-token graphs: the ITL tail
    assert on["itl_p99"] <= 1.5 * on["itl_p50"]
    assert on["tpot_p50"] <= off["tpot_p50"] and on["ttft_p50"] <= off["ttft_p50"] + 2.0
    assert on["steps"]["MIXED"] > off["steps"]["MIXED"]  # the prompts take two steps each
