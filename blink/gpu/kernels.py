"""Build (nvcc -cubin, cached by content hash) and load the engine's CUDA kernels.

Sources live in blink/gpu/csrc/. A cubin is rebuilt only when its source, the shared headers or
the flags change; the cache can be filled on a machine without a GPU and carried along.
"""

from __future__ import annotations

import hashlib
import pathlib
import shutil
import subprocess

from blink.gpu.cuda_api import Driver

CSRC = pathlib.Path(__file__).resolve().parent / "csrc"
SOURCES = ("model_kernels.cu", "attention.cu", "prefill_attention.cu", "flash_decode.cu", "sampling.cu")
HEADERS = ("common.cuh",)
NVCC_FLAGS = ("-arch=sm_90", "-O3", "-std=c++17", "-cubin", "--expt-relaxed-constexpr")
DEFAULT_CACHE = pathlib.Path(__file__).resolve().parents[2] / "build" / "kernels"


def nvcc_path() -> str | None:
    return shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if pathlib.Path("/usr/local/cuda/bin/nvcc").exists() else None
    )


def cubin_key(source: str) -> str:
    h = hashlib.sha256()
    for name in HEADERS:
        h.update((CSRC / name).read_bytes())
    h.update((CSRC / source).read_bytes())
    h.update(" ".join(NVCC_FLAGS).encode())
    return h.hexdigest()[:16]


def build(source: str, cache_dir: pathlib.Path = DEFAULT_CACHE) -> pathlib.Path:
    """Return the cubin of csrc/<source>, compiling it if the cache lacks this version."""
    out = cache_dir / f"{pathlib.Path(source).stem}-{cubin_key(source)}.cubin"
    if out.exists():
        return out
    nvcc = nvcc_path()
    if nvcc is None:
        raise RuntimeError(f"no cached {out.name} and no nvcc to build it")
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    cmd = [nvcc, *NVCC_FLAGS, "-I", str(CSRC), "-o", str(tmp), str(CSRC / source)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"nvcc failed for {source}:\n{res.stderr}")
    tmp.replace(out)
    return out


def build_all(cache_dir: pathlib.Path = DEFAULT_CACHE) -> list[pathlib.Path]:
    return [build(s, cache_dir) for s in SOURCES]


class Kernels:
    """Function handles of every engine kernel, by name (`kernels["add_rmsnorm"]`)."""

    def __init__(self, driver: Driver, cache_dir: pathlib.Path = DEFAULT_CACHE) -> None:
        self.driver = driver
        self.modules = [driver.module_load(str(p)) for p in build_all(cache_dir)]
        self._fns: dict[str, int] = {}

    def __getitem__(self, name: str) -> int:
        fn = self._fns.get(name)
        if fn is None:
            for mod in self.modules:
                try:
                    fn = self.driver.get_function(mod, name)
                    break
                except RuntimeError:
                    continue
            if fn is None:
                raise KeyError(f"kernel {name} not found in {SOURCES}")
            self._fns[name] = fn
        return fn


if __name__ == "__main__":
    for p in build_all():
        print(p)
