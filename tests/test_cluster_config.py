"""Deploy config parsing, pure placement planning, and cluster.yaml against Ray's own validator."""

from __future__ import annotations

import copy
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


def test_ray_validation_catches_a_broken_cluster_yaml() -> None:
    import jsonschema

    raw = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    raw["setup_command"] = raw.pop("setup_commands")  # misspelled key
    with pytest.raises(jsonschema.ValidationError):
        _prepared(raw)
