"""Hardware tiers: `gpu` tests run only where a CUDA device is usable, `rdma` tests only where an
RDMA device exists. Everything else runs everywhere (CI: 2 cores, no GPU). The longest files are
collected first (LONG_FILES)."""

from __future__ import annotations

import functools
import os

import pytest


@functools.cache
def gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CUDA driver, no cupy: both mean "no GPU here"
        return False


@functools.cache
def rdma_available() -> bool:
    return os.path.isdir("/sys/class/infiniband") and bool(os.listdir("/sys/class/infiniband"))


# The files that take longest on a 2-core host (a minute or more of one worker's time each, longest
# first), collected before the rest. `make test` hands out whole files in collection order
# (--dist loadfile --no-loadscope-reorder), so both workers start on long files and end on short ones,
# rather than one worker running the Ray tests alone for minutes after the other ran out of files.
# A file left off only loses its head start; tests/test_repo_layout.py checks that each one exists.
LONG_FILES = (
    "test_gpu_compile.py",
    "test_ray_local.py",
    "test_ray_cluster.py",
    "test_e2e_openai.py",
    "test_reference_transformers.py",
    "test_bench_paper.py",
    "conformance/test_generation.py",
    "test_ray_cross_host.py",
    "test_cross_host.py",
    "test_ray_serve.py",
    "test_bench_soak.py",
    "test_cluster_config.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {f"tests/{f}": i for i, f in enumerate(LONG_FILES)}
    items.sort(key=lambda it: rank.get(it.nodeid.split("::")[0], len(rank)))  # stable: files keep their order
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (make gpu-test OUT=dir on a machine with one)")
    skip_rdma = pytest.mark.skip(reason="needs an RDMA device")
    for item in items:
        if "gpu" in item.keywords and not gpu_available():
            item.add_marker(skip_gpu)
        if "rdma" in item.keywords and not rdma_available():
            item.add_marker(skip_rdma)
