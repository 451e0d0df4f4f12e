"""Deploy config parsing, pure placement planning, and cluster.yaml against Ray's own validator."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import yaml

from blink.actors.config import ConfigError, DeployConfig, build, from_mapping
from blink.actors.placement import plan_placement

ROOT = Path(__file__).resolve().parents[1]


def test_config_file_with_deploy_section(tmp_path: Path) -> None:
    f = tmp_path / "blink.toml"
    f.write_text(
        '[deploy]\nname = "dp"\nreplicas = 2\n[device]\nkind = "emulated"\n[ring]\nn_slots = 8\n[server]\nport = 0\n'
    )
    cfg = build(str(f))
    assert cfg.name == "dp" and cfg.deploy.replicas == 2 and cfg.serving.device.kind == "emulated"
    assert cfg.serving.ring.n_slots == 8 and cfg.serving.server.port == 0
    assert cfg.gpu_actor_name(1) == "dp-gpu-1" and cfg.ring_name(0) == "blink-dp-ring-0"
    assert DeployConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(AttributeError):
        cfg.deploy.replicas = 3  # type: ignore[misc]  # frozen


@pytest.mark.parametrize(
    "data, msg",
    [
        ({"deploy": {"replica": 2}}, "unknown key deploy.replica"),
        ({"deploy": {"replicas": True}}, "wrong type"),
        ({"deploy": {"replicas": "2"}}, "wrong type"),
        ({"deploy": {"dpu": "maybe"}}, "deploy.dpu"),
        ({"deploy": {"name": "a b"}}, "deploy.name"),
        ({"deploy": {"namespace": "a/b"}}, "deploy.namespace"),
        ({"deploy": 3}, "must be a mapping"),
        ({"deployment": {}}, "unknown config section"),
        ({"ring": {"n_slot": 2}}, "unknown key ring.n_slot"),
    ],
)
def test_config_rejects_bad_input(data: dict, msg: str) -> None:
    with pytest.raises(ConfigError, match=msg):
        from_mapping(data)


def test_overrides_apply_after_file(tmp_path: Path) -> None:
    f = tmp_path / "blink.json"
    f.write_text('{"deploy": {"replicas": 2, "name": "a"}}')
    cfg = build(str(f), {"deploy": {"replicas": 3}, "server": {}})
    assert (cfg.deploy.replicas, cfg.name) == (3, "a")


def _cfg(device: str = "auto", transport: str = "auto", **deploy) -> DeployConfig:
    return from_mapping({"deploy": deploy, "device": {"kind": device}, "ring": {"transport": transport}})


def test_plan_frontend_beside_gpus_without_dpu() -> None:
    plan = plan_placement(_cfg(replicas=2, transport="shm"), [{"CPU": 16, "GPU": 2}])
    assert plan.use_gpu and not plan.use_dpu and plan.strategy == "STRICT_PACK"
    # a transport that reaches other hosts lets the bundles spread (on one node PACK packs them anyway)
    assert plan_placement(_cfg(replicas=2), [{"CPU": 16, "GPU": 2}]).strategy == "PACK"
    assert plan.bundles == ({"CPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 1.0})
    assert plan.gpu_bundle(1) == 2 and plan.frontend_bundle == 0


def test_plan_frontend_on_dpu_node() -> None:
    plan = plan_placement(_cfg(replicas=2), [{"CPU": 16, "GPU": 2}, {"CPU": 4, "dpu": 2}])
    assert plan.use_dpu and plan.strategy == "PACK"
    assert plan.bundles[0] == {"CPU": 1.0, "dpu": 1.0}
    assert all("dpu" not in b for b in plan.bundles[1:])
    off = plan_placement(_cfg(replicas=2, dpu="off", transport="shm"), [{"CPU": 16, "GPU": 2}, {"CPU": 4, "dpu": 2}])
    assert not off.use_dpu and off.strategy == "STRICT_PACK"


def test_plan_frontends_share_the_frontend_bundle() -> None:
    plan = plan_placement(_cfg(replicas=2, frontends=3, frontend_cpus=2.0), [{"CPU": 16, "GPU": 2}])
    assert plan.bundles[0] == {"CPU": 6.0}
    per_replica = _cfg(replicas=0, frontends=0)  # 0 frontends: one per replica
    assert plan_placement(per_replica, [{"CPU": 16, "GPU": 4}]).bundles[0] == {"CPU": 4.0}
    on_dpu = plan_placement(_cfg(replicas=2, frontends=2), [{"CPU": 16, "GPU": 2}, {"CPU": 4, "dpu": 1}])
    assert on_dpu.bundles[0] == {"CPU": 2.0, "dpu": 1.0}  # the actors split the one dpu unit
    with pytest.raises(ConfigError, match="frontends"):
        _cfg(frontends=-1)
    assert _cfg(frontends=0).frontend_count(3) == 3 and _cfg(frontends=2).frontend_count(3) == 2


def test_plan_replicas_zero_means_one_per_gpu() -> None:
    assert plan_placement(_cfg(replicas=0), [{"CPU": 64, "GPU": 8}]).replicas == 8
    with pytest.raises(ConfigError, match="no GPU"):
        plan_placement(_cfg(replicas=0), [{"CPU": 8}])


def test_plan_auto_device_falls_back_to_emulated_without_gpus() -> None:
    plan = plan_placement(_cfg(replicas=2), [{"CPU": 8}])
    assert not plan.use_gpu and all("GPU" not in b for b in plan.bundles)
    with pytest.raises(ConfigError, match="need 2 GPUs"):
        plan_placement(_cfg("cuda", replicas=2), [{"CPU": 8, "GPU": 1}])


def test_plan_rejects_what_cannot_fit() -> None:
    # GPUs on two hosts and no dpu node: shm rings need one host, so refuse up front ...
    two = [{"CPU": 8, "GPU": 1}, {"CPU": 8, "GPU": 1}]
    with pytest.raises(ConfigError, match="one host"):
        plan_placement(_cfg("cuda", replicas=2, transport="shm"), two)
    # ... while tcp / rdma (auto) reach the ring of the other host: the bundles spread
    assert plan_placement(_cfg("cuda", replicas=2), two).strategy == "PACK"
    with pytest.raises(ConfigError, match="require"):
        plan_placement(_cfg(dpu="require"), [{"CPU": 8, "GPU": 1}])
    with pytest.raises(ConfigError, match="room for the frontend"):
        plan_placement(_cfg(frontend_cpus=8.0), [{"CPU": 8, "GPU": 1}, {"CPU": 2, "dpu": 1}])


def _prepared(cfg: dict) -> dict:
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(cfg))
    validate_config(prepared)
    return prepared


def test_cluster_yaml_passes_ray_validation() -> None:
    raw = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    assert raw["provider"]["type"] == "local"
    assert raw["provider"]["head_ip"] and raw["provider"]["worker_ips"]
    prepared = _prepared(raw)
    node_type = prepared["available_node_types"][prepared["head_node_type"]]
    assert node_type["max_workers"] == len(raw["provider"]["worker_ips"])
    text = (ROOT / "cluster.yaml").read_text()
    assert '"dpu"' in text and "pip install" in text
    assert any("blink" in c for c in raw["setup_commands"])
    install = next(c for c in raw["setup_commands"] if "pip install" in c and "$HOME/blink" in c)
    assert "blink[gpu,ray]" in install and "blink[ray]" in install  # ~/blink-venv/bin/ray on every node
    assert "must share" not in text


def test_cluster_yaml_turns_ray_token_authentication_on_everywhere() -> None:
    """Every `ray` command on every node runs with RAY_AUTH_MODE=token, and the launcher copies the
    token to each node (the mode alone, with no shared token, would lock the nodes out of each other)."""
    raw = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    assert raw["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        ray_cmds = [part for c in raw[key] for part in c.split(";") if "bin/ray " in part]
        assert ray_cmds and all("RAY_AUTH_MODE=token" in c for c in ray_cmds), raw[key]
    assert "disabled" not in (ROOT / "cluster.yaml").read_text()
    assert from_mapping({}).deploy.ray_auth == "token"  # `blink deploy` refuses an open cluster by default


def test_ray_validation_catches_a_broken_cluster_yaml() -> None:
    import jsonschema

    raw = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    raw["setup_command"] = raw.pop("setup_commands")  # misspelled key
    with pytest.raises(jsonschema.ValidationError):
        _prepared(raw)


def _site_view(dest: Path, hide: tuple[str, ...]) -> Path:
    """This interpreter's site-packages as symlinks, minus the distributions named in `hide`: a new
    venv that sees it (a .pth) has every dependency already and installs only the hidden ones."""
    import re
    import sysconfig

    dest.mkdir()
    site = Path(sysconfig.get_paths()["purelib"])
    for entry in site.iterdir():
        dist = re.split(r"[-.]", entry.name.lower().lstrip("_"), maxsplit=1)[0]
        if dist not in hide and not entry.name.endswith(".pth") and not entry.name.startswith("__editable__"):
            (dest / entry.name).symlink_to(entry)
    return dest


def _node_env(home: Path, bindir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HOME=str(home), PATH=f"{bindir}{os.pathsep}{env['PATH']}", RAY_USAGE_STATS_ENABLED="0")
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    # the user's pip cache, not the fresh HOME's: the packages the setup installs are fetched once per machine
    env.setdefault("PIP_CACHE_DIR", str(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pip"))
    return env


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_cluster_yaml_setup_installs_ray_and_starts_a_head(tmp_path: Path) -> None:
    """cluster.yaml's own setup commands on a CPU node (the non-GPU branch) in a fresh HOME: they
    leave ~/blink-venv/bin/ray and blink; its head start command then starts Ray from that venv.
    The venv is made without ensurepip and sees this interpreter's packages except ray and blink (a
    .pth; its `pip` runs the view's), so the setup installs exactly those two; the head runs on a free port and is stopped by killing the processes it started (never
    `ray stop`, which stops every Ray node of the user on this machine)."""
    import shutil
    import signal
    import socket
    import subprocess
    import sys
    import tempfile
    import time

    raw = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    home, bindir = tmp_path / "home", tmp_path / "bin"
    home.mkdir(), bindir.mkdir()
    (bindir / "python3").symlink_to(sys.executable)  # the venv gets this interpreter's version
    assert raw["file_mounts"] == {"~/blink": ".", "~/.ray/auth_token": "~/.ray/auth_token"}
    (home / ".ray").mkdir()  # what the launcher's file_mounts copies: Ray's token (the head starts with it)
    (home / ".ray" / "auth_token").write_text("a" * 64)
    (home / ".ray" / "auth_token").chmod(0o600)
    shutil.copytree(ROOT, home / "blink", ignore=shutil.ignore_patterns(".git", ".venv", "build", "results", "*.egg-info", "__pycache__"))  # fmt: skip
    env = _node_env(home, bindir)
    view = _site_view(tmp_path / "site", hide=("ray", "blink", "blink_serve"))
    for cmd in raw["setup_commands"]:
        fast_venv = "-m venv" in cmd  # built without ensurepip: pip comes from the view (a .pth)
        run = cmd.replace("-m venv", "-m venv --without-pip") if fast_venv else cmd
        r = subprocess.run(["bash", "-c", run], env=env, capture_output=True, text=True, timeout=180)
        assert r.returncode == 0, (cmd, r.stdout[-2000:], r.stderr[-2000:])
        if fast_venv:
            (purelib,) = (home / "blink-venv" / "lib").glob("python3*/site-packages")
            (purelib / "_deps_view.pth").write_text(f"{view}\n")
            pip = home / "blink-venv" / "bin" / "pip"
            pip.write_text('#!/bin/sh\nexec "$(dirname "$0")/python" -m pip "$@"\n')
            pip.chmod(0o755)
    venv = home / "blink-venv" / "bin"
    assert (venv / "ray").exists() and (venv / "blink").exists()
    version = subprocess.run([str(venv / "blink"), "--version"], env=env, capture_output=True, text=True, timeout=60)
    assert version.returncode == 0 and version.stdout.startswith("blink "), version

    (head_cmd,) = [c for c in raw["head_start_ray_commands"] if "ray start --head" in c]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    temp = tempfile.mkdtemp(prefix="rayh", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    cmd = head_cmd.replace("--port=6379", f"--port={port}")
    cmd = " ".join(w for w in cmd.split(" ") if not w.startswith("--autoscaling-config"))
    cmd += f" --num-cpus=1 --node-ip-address=127.0.0.1 --temp-dir={temp}"
    head = subprocess.Popen(["bash", "-c", cmd], env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        out = head.communicate(timeout=90)[0].decode()
        assert head.returncode == 0 and "Ray runtime started" in out, out
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            ps = subprocess.run(["ps", "-e", "-o", "pid=,sid="], capture_output=True, text=True).stdout
            for pid in [int(p) for p, s in (line.split() for line in ps.splitlines()) if int(s) == head.pid]:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            time.sleep(2.0)
        shutil.rmtree(temp, ignore_errors=True)
