"""The parsed command line as the serving config (blink.config.BlinkConfig), built once here:
defaults < --config FILE (sectioned, or vLLM-style flag names) < flags; the model name resolved to
its local snapshot and the device's prerequisites checked at this edge."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
from typing import Any

from blink import config as C
from blink.models import hub


def vllm_compat(args: argparse.Namespace) -> None:
    """The positional MODEL and vLLM's flags that have no setting here: checked, folded in."""
    model = getattr(args, "model_arg", None)
    if model is not None:
        if getattr(args, "model.spec", None) not in (None, model):
            raise C.ConfigError(f"two models given: {model!r} and --model {getattr(args, 'model.spec')!r}")
        setattr(args, "model.spec", model)
    if getattr(args, "vllm_tp", 1) != 1:
        raise C.ConfigError(
            "--tensor-parallel-size must be 1: a Blink replica is one GPU; for more GPUs, data-parallel "
            "replicas (--ray --data-parallel-size N)"
        )
    if getattr(args, "vllm_dtype", "auto") not in ("auto", "bfloat16", "bf16"):
        raise C.ConfigError(f"--dtype {args.vllm_dtype}: Blink computes in bfloat16 only (auto | bfloat16)")


def config_from_args(args: argparse.Namespace) -> C.BlinkConfig:
    """The serving config. A [deploy] section in the file is checked too (the same file serves
    `blink serve` and `blink deploy`) and applies with --ray only."""
    from blink.actors.config import build as build_with_deploy  # plain dataclasses: no Ray import

    vllm_compat(args)
    return build_with_deploy(args.config, overrides_from_args(args)).serving


def overrides_from_args(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The flags that set a config field (dest "section.field") and were given, by section."""
    overrides: dict[str, dict[str, Any]] = {}
    for key, value in vars(args).items():
        if "." in key and value is not None:
            section, field = key.split(".", 1)
            overrides.setdefault(section, {})[field] = value
    return overrides


def flag_style_config(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """A vLLM-style config file (a flat mapping whose keys are flag names: `model: X`,
    `max-model-len: 4096`, `port: 8000`) becomes those flags, placed before the command line's own
    so that these win, as in vLLM. A sectioned file ([server], [device], ...) is left to C.build."""
    if len(argv) < 2 or argv[0] not in ("serve", "generate"):
        return argv
    for i, tok in enumerate(argv):
        if tok == "--config" and i + 1 < len(argv):
            path, span = argv[i + 1], 2
            break
        if tok.startswith("--config="):
            path, span = tok.split("=", 1)[1], 1
            break
    else:
        return argv
    data = C.load_file(path)
    sections = {*C.SECTIONS, "deploy"}
    if isinstance(data, dict) and all(k in sections and isinstance(v, dict) for k, v in data.items()):
        return argv
    if not isinstance(data, dict):
        raise C.ConfigError(f"{path}: expected a mapping of sections or of flag names")
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[argv[0]]
    by_flag = {opt: a for a in sub._actions for opt in a.option_strings}
    flags: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        action = by_flag.get(flag)
        if action is None or flag in ("--config", "--help"):
            raise C.ConfigError(f"{path}: unknown key {key!r} (not a flag of `blink {argv[0]}`)")
        if isinstance(action, argparse._StoreTrueAction):
            if not isinstance(value, bool):
                raise C.ConfigError(f"{path}: {key} must be true or false")
            flags += [flag] if value else []
        elif isinstance(value, (dict, bool)) or value is None:
            raise C.ConfigError(f"{path}: {key} = {value!r} is not a flag value")
        else:
            flags += [flag, json.dumps(value) if isinstance(value, list) else str(value)]
    return [argv[0], *flags, *argv[1:i], *argv[i + span :]]


def hf_offline() -> bool:
    """HF_HUB_OFFLINE, read here at the edge (huggingface_hub's own truthy values)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def resolve_model_name(cfg: C.BlinkConfig) -> C.BlinkConfig:
    """A Hugging Face name (`org/model`) -> its local snapshot directory, once, here; the API then
    serves the model under that name (as vLLM does) unless --served-model-name says otherwise."""
    spec = cfg.model.spec
    if not hub.is_repo_id(spec):
        return cfg
    path = hub.resolve(spec, hf_offline())
    return cfg.replace(model={"spec": str(path), "name": cfg.model.name or spec})


def check_device(cfg: C.BlinkConfig) -> C.BlinkConfig:
    """For --device cuda: CuPy and NVRTC must be installed (else a ConfigError naming the pip
    command). The kernel cache directory is settled here, where the environment is read
    ($XDG_CACHE_HOME); `auto` itself is resolved by the launch layer."""
    from blink.gpu.toolchain import build

    if cfg.device.kind == "cuda":
        have = (("CuPy", cupy_installed()), ("NVRTC", build.find_nvrtc() is not None))
        missing = [name for name, ok in have if not ok]
        if missing:
            raise C.ConfigError(f"--device cuda needs {' and '.join(missing)}: {build.INSTALL_HINT}")
    if cfg.device.kernel_cache:
        return cfg
    return cfg.replace(device={"kernel_cache": str(build.default_cache_dir(os.environ.get("XDG_CACHE_HOME")))})


def cupy_installed() -> bool:
    return importlib.util.find_spec("cupy") is not None
