"""The GPU benchmarks' synthetic steps (bench/common.py): their layout, and that the float64
reference engine accepts them as steps (the CUDA engine loads them through the same StepBatch)."""

from __future__ import annotations

import numpy as np
import pytest

from bench.common import decode_bytes, synthetic_step


def test_prefill_step_layout():
    b = synthetic_step(3, 4, 10, 4, 100, np.random.default_rng(0))
    assert (b.num_seqs, b.num_tokens) == (3, 12)
    np.testing.assert_array_equal(b.cu_q_lens, [0, 4, 8, 12])
    np.testing.assert_array_equal(b.positions.reshape(3, 4), np.tile(np.arange(6, 10), (3, 1)))
    np.testing.assert_array_equal(b.seq_lens, [10, 10, 10])
    assert b.block_tables.shape == (3, 3) and len(np.unique(b.block_tables)) == 9  # ceil(10 / 4) each, disjoint
    assert b.input_ids.dtype == np.int32 and b.input_ids.min() >= 0 and b.input_ids.max() < 100
    assert (b.temperature == 0).all() and (b.top_k == 0).all() and (b.top_p == 1).all()


def test_decode_step_layout():
    b = synthetic_step(5, 1, 33, 16, 50, np.random.default_rng(1))
    assert (b.num_seqs, b.num_tokens) == (5, 5)
    assert (b.positions == 32).all() and (b.seq_lens == 33).all()
    np.testing.assert_array_equal(b.block_tables[1], [3, 4, 5])
    with pytest.raises(ValueError):
        synthetic_step(1, 0, 4, 4, 10, np.random.default_rng(0))
    with pytest.raises(ValueError):
        synthetic_step(1, 5, 4, 4, 10, np.random.default_rng(0))


def test_reference_engine_runs_synthetic_steps():
    from blink.device.numpy_executor import NumpyExecutor
    from blink.models.config import preset
    from blink.models.weights import random_weights

    cfg = preset("tiny-llama")
    ex = NumpyExecutor(
        cfg,
        random_weights(cfg, seed=3),
        num_blocks=64,
        block_size=8,
        max_batch=4,
        max_num_batched_tokens=128,
        max_blocks_per_seq=16,
    )
    rng = np.random.default_rng(2)
    for S, new, ctx in ((4, 20, 20), (4, 1, 21)):  # whole prompts, then one decode token on top of them
        b = synthetic_step(S, new, ctx, 8, cfg.vocab_size, rng)
        lg = ex.forward_logits(b)
        assert lg.shape == (S, cfg.vocab_size) and np.isfinite(lg).all()


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-phi3", "tiny-qwen3-moe"])
@pytest.mark.parametrize("batch", [1, 3, 16])
def test_decode_bytes_counts_the_tensors_a_step_reads(name, batch):
    """decode_bytes against the tensors themselves (random_weights in fp16 = bf16's 2 bytes): all of them,
    less the embedding table but its `batch` gathered rows (unless tied to the LM head), less the
    experts a MoE layer's step does not route to (all but top-k at batch 1; min(E, batch * top-k) read)."""
    from blink.models.config import preset
    from blink.models.weights import random_weights

    c = preset(name)
    w = random_weights(c, dtype=np.float16)
    expect = sum(a.nbytes for a in w.values())
    if not c.tie_word_embeddings:
        expect -= w["model.embed_tokens.weight"].nbytes - batch * c.hidden_size * 2
    read = min(c.num_experts, batch * c.num_experts_per_tok)
    for i in range(c.num_layers):
        if c.layer_is_moe(i):
            per_expert = sum(
                w[f"model.layers.{i}.mlp.experts.0.{p}_proj.weight"].nbytes for p in ("gate", "up", "down")
            )
            expect -= (c.num_experts - read) * per_expert
    got = decode_bytes(c, batch, 100)
    assert got["weights"] == expect
    assert got["kv"] == batch * 100 * c.num_layers * 2 * c.num_kv_heads * c.head_dim * 2
    assert got["total"] == got["weights"] + got["kv"]
    assert got["experts_read_per_layer"] == read


def test_decode_bytes_of_qwen3_30b_a3b_counts_only_the_active_experts():
    """Batch 1 of the real shape reads 8 of 128 experts per layer: ~3.3 B active parameters less the
    embedding table (6.7 GB), not the 30.5 B (61 GB) of every expert."""
    from blink.models.config import preset

    c = preset("qwen3-30b-a3b")
    b = decode_bytes(c, 1, 0)
    assert b["experts_read_per_layer"] == 8 and b["kv"] == 0
    embed = c.vocab_size * c.hidden_size
    assert b["weights"] == 2 * (c.num_params(active=True) - embed + c.hidden_size)
    assert 6.0e9 < b["weights"] < 6.4e9 and 60e9 < 2 * c.num_params() < 62e9
    dense = preset("qwen3-32b")
    assert decode_bytes(dense, 1, 0)["weights"] == 2 * (
        dense.num_params() - dense.vocab_size * dense.hidden_size + dense.hidden_size
    )


def test_decode_traffic_gemm_weights_and_kv_match_the_model():
    """The breakdown's bytes (bench/engine/decode.py --role-breakdown): the GEMMs' weights are the model's
    matmul weights once per step, attention reads every sequence's K and V of every layer."""
    from bench.common import decode_traffic, gemm_roles
    from blink.models.config import preset

    cfg = preset("llama3-8b")
    t = decode_traffic(cfg, 256, 320)
    roles = gemm_roles(cfg)
    assert roles["qkv"] == (6144, 4096) and roles["gate_up"] == (28672, 4096) and roles["down"] == (4096, 14336)
    weights = sum(n * k * 2 * (1 if r == "lm_head" else cfg.num_layers) for r, (n, k) in roles.items())
    assert 15.0e9 < weights < 15.1e9  # Llama-3-8B without the embedding table, bf16
    acts = sum(v["bytes"] for k, v in t.items() if k.startswith("gemm_")) - weights
    assert 0 < acts < 0.1 * weights  # batch 256: 1.27 GB of activations in and out
    kv = 256 * 320 * cfg.num_layers * 2 * cfg.kv_size * 2
    assert kv <= t["attn"]["bytes"] < 1.02 * kv  # + the queries in and the outputs out
    assert t["gemm_down"]["flops"] == 32 * 2.0 * 256 * 4096 * 14336


def test_only_launches_with_roles_keeps_the_projections_of_those_shapes():
    """Roles select projections by their weight's shape, whatever runs them (cuBLAS, a GEMV, a fused GEMV,
    FP8 kernels): Forward.linear(x, w, ...) and Forward.fused_linear(kind, x, w, ...) are filtered; the
    launches inside pass by category; the class's methods are back afterwards."""
    from types import SimpleNamespace

    from bench.common import only_launches

    calls = []

    class Fwd:
        def linear(self, x, w, y, rows, stream, out_f32=False):
            calls.append(("linear", w.shape))
            self.drv.launch(0, (1, 1, 1), (1, 1, 1), (), 0, 0, "gemv_fp8_t1_r2u4")

        def fused_linear(self, kind, x, w, y, T, stream, nw=None):
            calls.append((kind, w.shape))

    fwd = Fwd()
    fwd.drv = SimpleNamespace(launch=lambda *a, **k: calls.append(a[6]))
    fwd.blas = SimpleNamespace(linear=lambda *a: calls.append("cublas"))
    fwd.fp8_gemms = {"outer": SimpleNamespace(matmul=lambda *a: calls.append("fp8_gemm"))}
    qkv, o = SimpleNamespace(shape=(6144, 4096)), SimpleNamespace(shape=(4096, 4096))
    with only_launches(fwd, {"gemm"}, {(6144, 4096)}):
        fwd.linear(0, qkv, 0, 8, 0)
        fwd.linear(0, o, 0, 8, 0)
        fwd.fused_linear("norm", 0, qkv, 0, 1, 0, nw=0)
        fwd.fused_linear("resid", 0, o, 0, 1, 0)
        fwd.drv.launch(0, (1, 1, 1), (1, 1, 1), (), 0, 0, "rope_kv_write")
    assert calls == [("linear", (6144, 4096)), "gemv_fp8_t1_r2u4", ("norm", (6144, 4096))]
    assert "linear" not in vars(fwd) and "fused_linear" not in vars(fwd)  # restored
    calls.clear()
    with only_launches(fwd, {"norm"}):  # no GEMMs: cuBLAS and the FP8 GEMM do nothing
        fwd.blas.linear(1)
        fwd.fp8_gemms["outer"].matmul(1)
        fwd.drv.launch(0, (1, 1, 1), (1, 1, 1), (), 0, 0, "add_rmsnorm")
    assert calls == ["add_rmsnorm"]
    fwd.fp8_gemms["outer"].matmul(1)
    assert calls[-1] == "fp8_gemm"


def test_decode_engine_config_sizes_the_pool_for_the_largest_batch():
    """bench/engine/decode.py and bench/engine/moe_decode.py size their engine here: a bucket per batch timed, the
    largest batch's sequences each with ceil(context / 16) + 1 KV blocks; other fields passed on."""
    from bench.common import decode_engine_config

    e = decode_engine_config([1, 8, 32], 1008, gemv_max_tokens=8)
    assert (e.max_seqs, e.max_num_batched_tokens, e.block_size, e.max_context) == (32, 32, 16, 1040)
    assert e.num_kv_blocks == 32 * (63 + 1) and e.batch_buckets == (1, 8, 32) and e.token_buckets == (32,)
    assert e.gemv_max_tokens == 8
    assert decode_engine_config([4], 1024).num_kv_blocks == 4 * 65  # 1024 / 16 = 64 blocks exactly, + 1


def test_alternate_launches_a_variants_execs_in_turn():
    """An exec cannot be relaunched right after it completes: the timed variants take turns, each
    with its own count (a second variant starts at its own first exec)."""
    from types import SimpleNamespace

    from bench.common import alternate

    launched = []
    eng = SimpleNamespace(s=7, driver=SimpleNamespace(graph_launch=lambda ex, s: launched.append((ex, s))))
    a, b = alternate(eng, [10, 11]), alternate(eng, [20, 21])
    for fn in (a, a, b, a, b):
        fn()
    assert launched == [(10, 7), (11, 7), (20, 7), (10, 7), (21, 7)]


def test_step_rates_and_copy_fraction():
    from bench.common import copy_fraction, step_rates

    bw = {"read_plus_write_GBps": 4000.0}
    r = step_rates(64, 2.0, 4e9, bw)  # 4 GB in 2 ms: 2000 GB/s, half the copy bandwidth
    assert r == {"ms_per_step": 2.0, "tokens_per_s": 32000.0, "bytes_per_step": 4e9, "GBps": 2000.0,
                 "frac_of_copy_bw": 0.5}  # fmt: skip
    assert copy_fraction(1e9, 1.0, bw) == 0.25


def test_preset_config_and_print_breakdown(capsys):
    from bench.common import preset_config, print_breakdown

    assert preset_config("tiny-llama").num_layers > 1 and preset_config("tiny-llama", 1).num_layers == 1
    print_breakdown("batch", {"8": {"gemm": 1.5, "attn": 0.25}})
    assert capsys.readouterr().out == "batch 8 by kernel category (ms): gemm 1.500, attn 0.250; sum 1.750\n"


def test_metadata(monkeypatch):
    """Every bench JSON's date, GPU, commit and command come from common.metadata; the scheduler
    benchmarks keep the key "device" (their rows are keyed "gpu" and "host"), and a process whose
    servers own the GPU passes the name in (nvidia-smi) and asks CUDA nothing."""
    from bench import common

    monkeypatch.setattr(common, "gpu_name", lambda: "cpu")
    m = common.metadata("abc1234", ["bench/x.py", "--flag"])
    assert set(m) == {"date", "gpu", "commit", "command"}
    assert m["commit"] == "abc1234" and m["command"] == "python -m bench.x --flag" and m["gpu"] == "cpu"
    d = common.metadata("abc1234", ["x"], gpu_key="device")
    assert "gpu" not in d and d["device"] == "cpu"

    def no_cuda() -> str:
        raise AssertionError("asked CUDA")

    monkeypatch.setattr(common, "gpu_name", no_cuda)
    g = common.metadata("c", ["x"], gpu="NVIDIA H200", gpu_key="device_name")
    assert g["device_name"] == "NVIDIA H200" and "sms" not in g


def test_the_command_names_a_benchmark_by_its_module(monkeypatch):
    """A benchmark started as a script of this clone is recorded as `python -m bench...`: the command
    reproduces it from any clone, and no result names the machine's paths."""
    from bench import common

    monkeypatch.setattr(common, "gpu_name", lambda: "cpu")
    script = str(common.ROOT / "bench" / "serving" / "http_stall.py")
    for argv in (["python3.12", script, "--schemas", "3"], [script, "--schemas", "3"]):
        assert common.metadata("c", argv)["command"] == "python -m bench.serving.http_stall --schemas 3"
    assert common.metadata("c", ["/elsewhere/x.py", "-q"])["command"] == "/elsewhere/x.py -q"


def test_commit_from_the_command_line_else_this_checkout(monkeypatch):
    """The commit recorded is the one given (--commit); without one, this checkout's HEAD."""
    from bench import common

    monkeypatch.setenv("BLINK_COMMIT", "feed123")  # not read: the command line names the commit
    c = common.git_commit()
    assert c != "feed123" and (c == "unknown" or len(c.removesuffix("-dirty")) >= 7)
    monkeypatch.setattr(common, "gpu_name", lambda: "cpu")
    assert common.metadata("", ["x"])["commit"] == c
    assert common.metadata("abc1234", ["x"])["commit"] == "abc1234"


def test_result_names_follow_one_scheme():
    from bench import common

    assert common.short_device("NVIDIA H200") == "h200"
    p = common.result_path("decode", "h200", "abc1234")
    assert p.parent == common.RESULTS and p.name == "decode-h200-abc1234.json"


def test_decode_traffic_counts_fp8_weights_as_a_byte_and_a_row_scale():
    from bench.common import decode_traffic, gemm_roles
    from blink.models.config import preset

    cfg = preset("llama3-8b")
    bf16, fp8 = decode_traffic(cfg, 1, 1024), decode_traffic(cfg, 1, 1024, fp8=True)
    n, k = gemm_roles(cfg)["down"]
    acts = 2 * k + 2 * n  # one token in and out
    assert fp8["gemm_down"]["bytes"] == cfg.num_layers * (n * k + 4 * n + acts)
    assert bf16["gemm_down"]["bytes"] == cfg.num_layers * (2 * n * k + acts)
    assert fp8["gemm_lm_head"] == bf16["gemm_lm_head"]  # the head stays bf16 unless fp8_head
    V, H = cfg.vocab_size, cfg.hidden_size
    head = decode_traffic(cfg, 1, 1024, fp8=True, fp8_head=True)["gemm_lm_head"]["bytes"]
    assert head == V * H + 4 * V + 2 * H + 4 * V
    assert fp8["attn"] == bf16["attn"] and fp8["gemm_down"]["flops"] == bf16["gemm_down"]["flops"]


def test_decode_step_bytes_of_an_fp8_engine_are_what_it_holds():
    """bench/engine/decode.py's bytes per step: bf16 as common.decode_bytes; FP8 the engine's weights
    (bytes_per_step) + the gathered embedding rows unless the table is the head + the K/V read."""
    from types import SimpleNamespace

    from bench.common import decode_bytes
    from bench.engine.decode import step_bytes
    from blink.models.config import preset

    cfg = preset("llama3-8b")
    embed, head = object(), object()
    w = SimpleNamespace(embed=embed, lm_head=head, bytes_per_step=8_000_000_000)
    eng = SimpleNamespace(fwd=SimpleNamespace(fp8=True, kv_suffix=""), weights=w)
    kv = 2 * 4 * 1024 * cfg.num_layers * 2 * cfg.kv_size
    assert step_bytes(eng, cfg, 4, 1024) == 8_000_000_000 + 4 * cfg.hidden_size * 2 + kv
    eng.fwd.kv_suffix = "_fp8kv"  # an fp8 KV cache: a byte a value
    assert step_bytes(eng, cfg, 4, 1024) == 8_000_000_000 + 4 * cfg.hidden_size * 2 + kv // 2
    eng.fwd.fp8 = False
    assert step_bytes(eng, cfg, 4, 1024) == decode_bytes(cfg, 4, 1024)["total"]


def test_decode_bench_parses_fp8_gemv_configurations_by_their_kernel_labels():
    from bench.engine.decode import parse_fp8_gemv_config

    assert parse_fp8_gemv_config("1=r2p4, 2=r4u2") == {1: (2, 4, "p"), 2: (4, 2)}
    assert parse_fp8_gemv_config("") == {}
    with pytest.raises(SystemExit):
        parse_fp8_gemv_config("4=r2p4")  # not compiled for bucket 4
