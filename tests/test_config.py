"""Config: defaults, file formats, CLI precedence, and errors that name the offending key."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from blink import cli
from blink import config as C


def test_defaults_are_safe_and_frozen():
    c = C.BlinkConfig()
    assert c.server.host == "127.0.0.1" and c.server.port == 8000 and c.server.api_key is None
    assert c.device.kind == "auto" and c.device.scheduler == "gpu"
    assert c.ring.prompt_tokens_per_slot == c.ring.prompt_arena_tokens // c.ring.n_slots
    with pytest.raises(AttributeError):
        c.server.port = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    "data,needle",
    [
        ({"server": {"prot": 80}}, "server.prot"),
        ({"servr": {}}, "servr"),
        ({"server": {"port": "80"}}, "server.port"),
        ({"server": {"port": 70000}}, "server.port"),
        ({"server": {"port": True}}, "server.port"),
        ({"ring": {"n_slots": 0}}, "ring.n_slots"),
        ({"ring": {"n_slots": 64, "prompt_arena_tokens": 10}}, "ring.prompt_arena_tokens"),
        ({"device": {"kind": "tpu"}}, "device.kind"),
        ({"device": {"scheduler": "cpu"}}, "device.scheduler"),
        ({"device": {"kv_cache_fraction": 1.5}}, "device.kv_cache_fraction"),
        ({"device": {"kv_cache_fraction": 0.97}}, "device.kv_cache_fraction"),  # an error, not a silent clamp
        ({"device": {"num_kv_blocks": 0}}, "device.num_kv_blocks"),
        ({"device": {"max_batch": None}}, "device.max_batch"),
        ({"model": {"spec": ""}}, "model.spec"),
        ({"server": {"api_key": ""}}, "server.api_key"),
        ({"server": []}, "server"),
        ([1], "mapping"),
    ],
)
def test_errors_name_the_key(data, needle):
    with pytest.raises(C.ConfigError, match=needle.replace(".", r"\.")):
        C.from_mapping(data)


def test_optional_fields_accept_null_and_ints_widen_to_float():
    c = C.from_mapping({"device": {"num_kv_blocks": None, "kv_cache_fraction": 1 // 2 + 0.5, "max_context": 4096}})
    assert c.device.num_kv_blocks is None and c.device.max_context == 4096
    c = C.from_mapping({"server": {"heartbeat_timeout_s": 5}})
    assert c.server.heartbeat_timeout_s == 5.0 and isinstance(c.server.heartbeat_timeout_s, float)


def test_file_formats_and_cli_precedence(tmp_path):
    j = tmp_path / "c.json"
    j.write_text(json.dumps({"server": {"port": 9001, "api_key": "k"}, "device": {"max_batch": 8}}))
    t = tmp_path / "c.toml"
    t.write_text('[server]\nport = 9002\n[model]\nspec = "random:tiny-llama"\n')
    assert C.build(str(j)).server.port == 9001
    c = C.build(str(t))
    assert c.server.port == 9002 and c.model.spec == "random:tiny-llama"
    # flags win over the file; flags not given leave the file's values
    args = cli.build_parser().parse_args(["serve", "--config", str(j), "--port", "9100", "--device", "emulated"])
    c = cli.config_from_args(args)
    assert (c.server.port, c.server.api_key, c.device.max_batch, c.device.kind) == (9100, "k", 8, "emulated")
    bad = tmp_path / "bad.toml"
    bad.write_text("[server\n")
    with pytest.raises(C.ConfigError, match="bad.toml"):
        C.build(str(bad))
    (tmp_path / "c.ini").write_text("")
    with pytest.raises(C.ConfigError, match="unknown config format"):
        C.build(str(tmp_path / "c.ini"))
    with pytest.raises(C.ConfigError, match="cannot read"):
        C.build(str(tmp_path / "missing.json"))


def test_replace_checks_like_a_file():
    c = C.BlinkConfig().replace(server={"port": 1234})
    assert c.server.port == 1234
    with pytest.raises(C.ConfigError, match="server.nope"):
        C.BlinkConfig().replace(server={"nope": 1})


def test_cli_reports_config_errors(tmp_path):
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"server": {"max_queue": -1}}))
    r = subprocess.run(
        [sys.executable, "-m", "blink.cli", "serve", "--config", str(f)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2 and "server.max_queue" in r.stderr


def test_vllm_command_lines_carry_over():
    """`vllm serve MODEL --max-num-seqs ...`: vLLM's names for Blink's settings."""
    from blink import cli

    argv = [
        "serve", "random:tiny-llama", "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
        "--max-model-len", "1024", "--block-size", "32", "--num-gpu-blocks-override", "300",
        "--gpu-memory-utilization", "0.7", "--tensor-parallel-size", "1", "--dtype", "bfloat16",
        "--trust-remote-code", "--disable-log-requests", "--device", "emulated",
    ]  # fmt: skip
    c = cli.config_from_args(cli.build_parser().parse_args(argv))
    d = c.device
    assert c.model.spec == "random:tiny-llama"
    assert (d.max_batch, d.max_num_batched_tokens, d.max_context, d.kv_block_size) == (8, 512, 1024, 32)
    assert (d.num_kv_blocks, d.kv_cache_fraction) == (300, 0.7)
    assert (c.server.log_requests, c.server.log_stats) == (False, True)  # --disable-log-requests
    c = cli.config_from_args(cli.build_parser().parse_args(["serve", "--disable-log-stats", "--allowed-hosts", "a,b"]))
    assert (c.server.log_requests, c.server.log_stats, c.server.hosts) == (True, False, {"a", "b"})
    a = cli.build_parser().parse_args(["serve", "--ray", "--data-parallel-size", "2", "--api-server-count", "3"])
    assert (getattr(a, "deploy.replicas"), getattr(a, "deploy.frontends")) == (2, 3)


def test_prefix_caching_flags():
    from blink.launch import device_spec

    def cfg(*argv: str):
        return cli.config_from_args(cli.build_parser().parse_args(["serve", "--device", "emulated", *argv]))

    on, off = cfg(), cfg("--no-enable-prefix-caching")
    assert on.device.enable_prefix_caching and cfg("--enable-prefix-caching").device.enable_prefix_caching
    assert not off.device.enable_prefix_caching
    assert device_spec(on, "r").prefix_caching and not device_spec(off, "r").prefix_caching
    assert not on.server.allow_reset_prefix_cache and cfg("--allow-reset-prefix-cache").server.allow_reset_prefix_cache


@pytest.mark.parametrize(
    "argv,why",
    [
        (["serve", "m1", "--model", "m2"], "two models"),
        (["serve", "--tensor-parallel-size", "2"], "tensor-parallel-size"),
        (["serve", "-tp", "4"], "tensor-parallel-size"),
        (["serve", "--dtype", "float16"], "bfloat16 only"),
    ],
)
def test_vllm_flags_blink_cannot_honour_are_errors(argv, why, capsys):
    from blink import cli

    assert cli.main(argv) == 2
    assert why in capsys.readouterr().err


def test_chat_template_from_text_or_file(tmp_path):
    from blink.config import ConfigError, ModelConfig

    inline = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert ModelConfig(chat_template=inline).chat_template == inline
    f = tmp_path / "t.jinja"
    f.write_text(inline)
    assert ModelConfig(chat_template=str(f)).chat_template == inline  # read once, at the edge
    with pytest.raises(ConfigError, match="cannot read"):
        ModelConfig(chat_template=str(tmp_path / "missing.jinja"))


def test_chat_template_replaces_the_models():
    from blink.dpu.tokenizer import load_tokenizer

    tok = load_tokenizer("random:tiny-llama", chat_template="{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
    ids = tok.chat_prompt([{"role": "user", "content": "ab"}, {"role": "assistant", "content": "c"}])
    assert tok.tok.decode(ids) == "<ab><c>"
    with pytest.raises(ValueError, match="does not compile"):
        load_tokenizer("random:tiny-llama", chat_template="{% for %}")


def test_device_executor_plugs_a_stand_in_model_into_the_emulated_device_only():
    from blink.launch import device_spec

    ex = "bench.serving.paced_executor:h200_llama3_8b"
    cfg = C.BlinkConfig().replace(device={"kind": "emulated", "executor": ex})
    assert device_spec(cfg, "r").executor == ex
    with pytest.raises(C.ConfigError, match="emulated"):
        device_spec(cfg.replace(device={"kind": "cuda"}), "r")
    with pytest.raises(C.ConfigError, match="module:function"):
        C.DeviceConfig(executor="paced_executor")
