"""Models by Hugging Face name (`blink serve org/model`), resolved through huggingface_hub: the
local cache first, HF_HUB_OFFLINE honoured, one clear line when the model cannot be had. No
network: a tiny HF-format model is written into the test's own Hugging Face cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from blink.models import hub
from blink.testing import ServeProcess

REPO = "test-org/tiny-chat"
MAX_POSITION = 600  # not a power of two, not 8192: the served context must be exactly this
ROOT = Path(__file__).resolve().parents[1]


def write_hf_model(d: Path) -> None:
    """config.json + model.safetensors + tokenizer files of the tiny-llama shape."""
    from safetensors.numpy import save_file

    from blink.models.checkpoint_config import to_hf_config
    from blink.models.config import preset
    from blink.models.registry import synthetic_tokenizer
    from blink.models.weights import random_weights

    c = preset("tiny-llama")
    d.mkdir(parents=True, exist_ok=True)
    hf = to_hf_config(c) | {"max_position_embeddings": MAX_POSITION}
    (d / "config.json").write_text(json.dumps(hf))
    w = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in random_weights(c).items()}
    save_file(w, str(d / "model.safetensors"))
    tok = synthetic_tokenizer(c)
    (d / "tokenizer.json").write_text(tok._tok.to_str())
    (d / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": tok.chat_template, "bos_token": "<|bos|>", "eos_token": "<|eos|>"})
    )


def hf_cache_with(cache: Path, repo: str) -> Path:
    """The Hugging Face cache layout (models--org--name/{refs/main, snapshots/<sha>/...})."""
    sha = "0123456789abcdef0123456789abcdef01234567"
    base = cache / ("models--" + repo.replace("/", "--"))
    write_hf_model(base / "snapshots" / sha)
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(sha)
    return base / "snapshots" / sha


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("hf") / "hub"
    hf_cache_with(cache, REPO)
    return cache


def test_names_that_are_repo_ids(tmp_path, monkeypatch):
    assert hub.is_repo_id("HuggingFaceTB/SmolLM2-135M-Instruct") and hub.is_repo_id("meta-llama/Llama-3.1-8B")
    for spec in ("default", "random:tiny-llama", "tiny-llama", "model.gguf", "a/b/c", "org/x.gguf"):
        assert not hub.is_repo_id(spec), spec
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "m").mkdir()
    monkeypatch.chdir(tmp_path)  # an existing relative directory org/m is a path, not a name
    assert not hub.is_repo_id("org/m")


def test_cached_model_resolves_offline(hf_cache):
    path = hub.resolve(REPO, offline=True, cache_dir=hf_cache)
    assert (path / "config.json").is_file() and path.parent.name == "snapshots"


def test_offline_and_not_cached_is_one_clear_line(hf_cache):
    with pytest.raises(hub.HubError) as e:
        hub.resolve("test-org/not-there", offline=True, cache_dir=hf_cache)
    msg = str(e.value)
    assert "'test-org/not-there'" in msg and "HF_HUB_OFFLINE" in msg and "\n" not in msg


def test_online_downloads_what_the_cache_lacks(monkeypatch, tmp_path):
    """Not cached and online: a second snapshot_download call that may download (recorded, no network)."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    got = tmp_path / "snap"
    write_hf_model(got)
    calls = []

    def fake(repo_id, **kw):
        calls.append(kw["local_files_only"])
        if kw["local_files_only"]:
            raise LocalEntryNotFoundError("not cached")
        assert "*.safetensors" in kw["allow_patterns"] and "*.bin" not in kw["allow_patterns"]
        return str(got)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    assert hub.resolve("org/m", offline=False) == got and calls == [True, False]
    calls.clear()
    with pytest.raises(hub.HubError, match="HF_HUB_OFFLINE"):
        hub.resolve("org/m", offline=True)
    assert calls == [True]  # offline: the cache only


def _env(hf_cache: Path) -> dict[str, str]:
    return {**os.environ, "HF_HUB_CACHE": str(hf_cache), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


def test_cli_offline_missing_model_is_one_line_without_traceback(hf_cache):
    r = subprocess.run(
        [sys.executable, "-m", "blink.cli", "serve", "test-org/not-there", "--device", "emulated"],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(hf_cache),
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0 and "HF_HUB_OFFLINE" in r.stderr


def test_serve_by_name_uses_the_models_context_length(hf_cache):
    """`blink serve org/model` from the cache: served under that name, max_model_len = the
    model's max_position_embeddings, and max_tokens beyond it a 400 in vLLM's words."""
    s = ServeProcess([REPO, "--device", "emulated"], timeout=180, env=_env(hf_cache))
    url = s.url
    try:
        models = json.loads(urllib.request.urlopen(url + "/v1/models", timeout=10).read())
        card = models["data"][0]
        assert card["id"] == REPO and card["max_model_len"] == MAX_POSITION
        body = {"model": REPO, "prompt": "hello", "max_tokens": MAX_POSITION}
        req = urllib.request.Request(
            url + "/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"}
        )
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        err = json.loads(e.value.read())["error"]
        assert e.value.code == 400 and err["param"] == "max_tokens"
        assert f"maximum context length is {MAX_POSITION} tokens" in err["message"]
        body["max_tokens"] = 3
        req = urllib.request.Request(
            url + "/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"}
        )
        out = json.loads(urllib.request.urlopen(req, timeout=60).read())
        assert out["model"] == REPO and out["usage"]["completion_tokens"] >= 1
    finally:
        s.stop(timeout=30)
