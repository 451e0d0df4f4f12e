"""The `blink` command end to end: generate (the serving stack in-process, no HTTP) and pull."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def test_cli_generate_runs_the_stack_in_process():
    r = subprocess.run(
        [sys.executable, "-m", "blink.cli", "generate", "What is the capital of France?", "--chat", "--max-tokens", "12",
         "--device", "emulated", "--num-kv-blocks", "64", "--max-batch", "2"],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_cli_generate_completion_mode_tiny_model():
    r = subprocess.run(
        [sys.executable, "-m", "blink.cli", "generate", "abc", "--model", "random:tiny-llama", "--max-tokens", "5",
         "--temperature", "1.0", "--seed", "3", "--device", "emulated", "--num-kv-blocks", "32", "--max-batch", "2"],
        capture_output=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.endswith(b"\n")


def test_cli_pull_finds_the_installed_default_model():
    r = subprocess.run([sys.executable, "-m", "blink.cli", "pull"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    path = r.stdout.strip().splitlines()[-1]
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.getsize(path) == 98_362_432


def test_cli_rejects_unknown_pull_target_and_bad_flags():
    r = subprocess.run(
        [sys.executable, "-m", "blink.cli", "pull", "llama-70b"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2 and "expected the default model" in r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "blink.cli", "serve", "--device", "tpu"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2 and "--device" in r.stderr
    for flag in ("--replicas", "--frontends"):
        r = subprocess.run(
            [sys.executable, "-m", "blink.cli", "serve", flag, "2"], capture_output=True, text=True, timeout=60
        )
        assert r.returncode == 2 and f"{flag} needs --ray" in r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "blink.cli", "deploy", "--frontends", "-3"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2 and "deploy.frontends" in r.stderr


def test_bad_model_is_one_line(tmp_path):
    """A folder with config.json and no weights printed 44 lines ending in "No such file
    or directory". One line says what is missing and where; the traceback only with debug."""
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')

    def serve(*args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "blink.cli", "serve", *args, "--device", "emulated", "--port", "0"]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60)

    r = serve(str(tmp_path))
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    line = r.stderr.strip()
    assert str(tmp_path) in line and "no weights (*.safetensors) and no tokenizer.json" in line
    assert "it holds config.json" in line
    r = serve(str(tmp_path / "nowhere"))
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "no such file or folder" in r.stderr
    r = serve("random:no-such-preset")
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "unknown preset" in r.stderr
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file")
    r = serve(str(tmp_path / "bad.gguf"))
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "not a GGUF file" in r.stderr, r.stderr
    r = serve(str(tmp_path), "--log-level", "debug")
    assert r.returncode == 1 and "Traceback" in r.stderr and "no weights" in r.stderr.splitlines()[-1]


def test_serve_process_reads_the_server_and_reports_a_failed_start(tmp_path):
    """blink.testing.ServeProcess (the e2e tests' and the serving benchmarks' server): the URL,
    model, ring and device process read from a real `blink serve`; a clean stop removes the ring;
    a server that exits at once is a RuntimeError carrying its log, not a hang until the timeout."""
    from blink.testing import ServeProcess, cmdline, rss_mib

    args = ["--device", "emulated", "--model", "random:tiny-llama", "--num-kv-blocks", "32", "--n-slots", "2"]
    with ServeProcess(args, timeout=120, log_path=str(tmp_path / "serve.log")) as s:
        assert s.url.startswith("http://127.0.0.1:") and s.model == "tiny-llama" and s.ring
        assert s.get("/health")[0] == 200 and s.metrics()["blink_generation_tokens_total"] == 0
        assert "blink.device.emulated" in cmdline(s.device_pid())
        assert rss_mib(s.device_pid()) > 0 and rss_mib(None) is None
    assert s.proc.returncode == 0 and not os.path.exists(f"/dev/shm/{s.ring}")
    assert "serving tiny-llama on" in (tmp_path / "serve.log").read_text()
    with pytest.raises(RuntimeError, match=r"did not start \(exit code 2\)[\s\S]*no-such-flag"):
        ServeProcess(["--no-such-flag"], timeout=60)
