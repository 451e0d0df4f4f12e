"""What a new user meets first: --version, --help, config files (vLLM-style YAML, one blink.toml for
serve and deploy), and the extras (Ray, CUDA) named when missing instead of a traceback."""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from blink import __version__, cli
from blink import config as C

ROOT = Path(__file__).resolve().parents[1]


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"blink {__version__}"


def _subparsers(ap: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    out = {k: v for k, v in sub.choices.items() if k not in cli.RAY_COMMANDS}
    bench = next(a for a in out.pop("bench")._actions if isinstance(a, argparse._SubParsersAction))
    return out | {f"bench {k}": v for k, v in bench.choices.items()}


def test_help_describes_every_flag_with_its_default_and_a_readable_metavar():
    parsers = _subparsers(cli.build_parser())
    assert set(parsers) == {"serve", "generate", "pull", "bench serve"}
    for cmd, p in parsers.items():
        fmt = p._get_formatter()
        for a in p._actions:
            if isinstance(a, argparse._HelpAction) or a.help == argparse.SUPPRESS:
                continue
            assert a.help, f"blink {cmd} {a.option_strings or a.dest}: no help"
            if a.metavar is not None:
                assert "." not in a.metavar and a.metavar.isupper(), (cmd, a.metavar)
            shown = fmt._get_help_string(a) if hasattr(fmt, "_get_help_string") else a.help
            unset = a.default is None or a.default is False
            if isinstance(a, argparse._StoreConstAction):  # a switch: its help says what giving it changes
                assert "(default" not in shown, (cmd, a.option_strings, shown)
            elif a.option_strings and "." in a.dest:  # a config field: its real default is the dataclass's
                assert "(default: " in shown, (cmd, a.option_strings, shown)
            elif a.option_strings and not unset:
                assert "(default" in shown, (cmd, a.option_strings, shown)
    text = parsers["serve"].format_help()
    assert "--port N" in text and "(default: 8000)" in text and "--max-model-len N" in text
    assert "SERVER." not in text and "DEVICE." not in text
    flat = " ".join(text.split())
    assert "(default: )" not in flat and "(default: True)" not in flat and "(default: False)" not in flat
    assert "--disable-log-requests turn off the log line per request (on unless given)" in flat
    assert "--model SPEC default | ORG/NAME" in flat


def test_the_distribution_name_is_not_the_unrelated_blink_and_the_license_is_spdx():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = meta["project"]
    assert project["name"] == "blink-serve" and project["scripts"] == {"blink": "blink.cli:main"}
    assert project["license"] == "Apache-2.0"  # PEP 639 string: setuptools prints no deprecation banner
    assert any(r.startswith("setuptools>=77") for r in meta["build-system"]["requires"])
    for extras in project["optional-dependencies"].values():  # self-references name this distribution
        assert not any(d.startswith("blink[") for d in extras)
    readme = (ROOT / "README.md").read_text()
    assert "pip install blink " not in readme and "pip install 'blink[" not in readme


def test_no_usable_gpu_is_said_once_per_process(caplog):
    import logging

    from blink import launch

    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed here")
    launch.gpu_usable.cache_clear()
    with caplog.at_level(logging.INFO, logger="blink.launch"):
        assert launch.resolve_kind("auto") == "emulated" and launch.resolve_kind("auto") == "emulated"
    assert sum("no usable GPU" in r.getMessage() for r in caplog.records) == 1


def _serve_config(argv: list[str]) -> C.BlinkConfig:
    ap = cli.build_parser()
    return cli.config_from_args(ap.parse_args(cli.flag_style_config(argv, ap)))


def test_vllm_style_yaml_config_keys_are_flag_names(tmp_path: Path):
    f = tmp_path / "config.yaml"
    f.write_text(
        "model: random:tiny-llama\nmax-model-len: 512\nport: 9100\nserved_model_name: m\n"
        'allowed-origins: ["https://a.example"]\ndevice: emulated\n'
    )
    cfg = _serve_config(["serve", "--config", str(f), "--port", "9200"])
    assert cfg.model.spec == "random:tiny-llama" and cfg.device.max_context == 512 and cfg.model.name == "m"
    assert cfg.server.port == 9200  # the command line wins over the file, as in vLLM
    assert cfg.server.allowed_origins == "https://a.example" and cfg.device.kind == "emulated"
    f.write_text("model: x\nmax-modle-len: 512\n")
    with pytest.raises(C.ConfigError, match="unknown key 'max-modle-len'"):
        _serve_config(["serve", "--config", str(f)])
    f.write_text("server:\n  port: 9300\n")  # Blink's sectioned layout, in YAML
    assert _serve_config(["serve", f"--config={f}"]).server.port == 9300


def test_one_toml_with_a_deploy_section_serves_and_deploys(tmp_path: Path):
    from blink.actors.config import build as deploy_build

    f = tmp_path / "blink.toml"
    f.write_text('[server]\nport = 9400\n[device]\nkind = "emulated"\n[deploy]\nreplicas = 2\nname = "dp"\n')
    assert _serve_config(["serve", "--config", str(f)]).server.port == 9400
    d = deploy_build(str(f))
    assert d.deploy.replicas == 2 and d.serving.server.port == 9400
    f.write_text("[deploy]\nreplica = 2\n")  # a typo in [deploy] is caught by plain `serve` too
    with pytest.raises(C.ConfigError, match="deploy.replica"):
        _serve_config(["serve", "--config", str(f)])


def test_ray_is_an_extra_and_its_commands_say_how_to_install_it(monkeypatch, capsys):
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(d.startswith("ray") for d in meta["dependencies"])
    extras = meta["optional-dependencies"]
    assert any(d.startswith("ray") for d in extras["ray"]) and "blink-serve[ray]" in extras["test"]
    assert "'.[test]'" in (ROOT / "Makefile").read_text()  # CI (make test) installs Ray for the Ray tests
    monkeypatch.setattr(cli.commands, "ray_installed", lambda: False)
    for argv in (["deploy"], ["status", "--address", "auto"], ["serve", "--ray", "--device", "emulated"]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert "pip install 'blink-serve[ray]'" in err and "Traceback" not in err


def test_gpu_extras_carry_nvrtc_and_headers_for_both_cuda_majors():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for name, cupy, suffix in (("cu13", "cupy-cuda13x", ""), ("cu12", "cupy-cuda12x", "-cu12")):
        deps = " ".join(extras[name])
        assert cupy in deps and f"nvidia-cuda-nvrtc{suffix}" in deps and f"nvidia-cuda-runtime{suffix}" in deps


def test_device_cuda_without_cupy_prints_the_install_command(monkeypatch, capsys):
    monkeypatch.setattr(cli.config_args, "cupy_installed", lambda: False)
    assert cli.main(["serve", "--device", "cuda", "--model", "random:tiny-llama"]) == 2
    err = capsys.readouterr().err
    assert "CuPy" in err and "pip install 'blink-serve[cu13]'" in err and "Traceback" not in err


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed here")
def test_device_cuda_without_cupy_in_a_real_process():
    r = subprocess.run(
        [sys.executable, "-m", "blink.cli", "generate", "hi", "--device", "cuda", "--model", "random:tiny-llama"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert r.returncode == 2 and "pip install 'blink-serve[cu13]'" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_kernel_cache_dir_is_settled_at_the_edge(monkeypatch, tmp_path: Path):
    from blink.gpu.toolchain import build
    from blink.launch import device_spec

    monkeypatch.setattr(cli.config_args, "cupy_installed", lambda: True)
    monkeypatch.setattr(build, "find_nvrtc", lambda: object())
    cfg = cli.check_device(C.BlinkConfig().replace(device={"kind": "cuda"}))
    assert cfg.device.kernel_cache == str(build.default_cache_dir())
    monkeypatch.setattr(build, "GPU_DIR", tmp_path / "site-packages" / "blink" / "gpu")  # a wheel install
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    cfg = cli.check_device(C.BlinkConfig().replace(device={"kind": "cuda"}))
    assert cfg.device.kernel_cache == str(tmp_path / "xdg" / "blink" / "kernels")
    ap = cli.build_parser()
    args = ap.parse_args(["serve", "--device", "cuda", "--kernel-cache-dir", "/k"])
    cfg = cli.check_device(cli.config_from_args(args))
    assert cfg.device.kernel_cache == "/k" and device_spec(cfg, "r").kernel_cache == "/k"  # what the device gets
