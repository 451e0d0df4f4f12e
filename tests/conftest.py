"""Hardware tiers: `gpu` tests run only where a CUDA device is usable, `rdma` tests only where an
RDMA device exists. Everything else runs everywhere (CI: 2 cores, no GPU)."""

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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (make gpu-test OUT=dir on a machine with one)")
    skip_rdma = pytest.mark.skip(reason="needs an RDMA device")
    for item in items:
        if "gpu" in item.keywords and not gpu_available():
            item.add_marker(skip_gpu)
        if "rdma" in item.keywords and not rdma_available():
            item.add_marker(skip_rdma)
