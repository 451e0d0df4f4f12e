"""Build (NVRTC, cached by content hash: blink.gpu.toolchain.build) and load the engine's CUDA kernels, and
launch them by parameter name.

Sources live in blink/gpu/engine/csrc/ (the scheduler's in blink/gpu/scheduler/csrc/). A cubin is
rebuilt only when its source, the shared headers, the options, the architecture or the NVRTC
version change; the cache can be filled on a machine without a GPU
(`python -m blink.gpu.build_kernels --arch 90 --cache-dir DIR`) and carried along.

Launch arguments are checked against the kernels' own signatures: PARAMS_FILE lists the parameters
of every `extern "C"` kernel, read from nvcc's preprocessor output (so kernels defined by macros are
listed under their real names) when a source changes (`python -m blink.gpu.build_kernels --params`; a
test fails while it is stale). `Kernels.args(name, kwargs)` orders keyword arguments by that list
and converts each to the ctypes value its C type takes; a missing, unknown or mistyped argument is
an error at the launch (during graph capture), not a wrong read.
"""

from __future__ import annotations

import ctypes
import json
import os
import pathlib
import re

from blink.gpu.toolchain import build as B
from blink.gpu.toolchain.cuda_api import Driver

CSRC = B.GPU_DIR / "engine" / "csrc"
SCHEDULER_CSRC = B.GPU_DIR / "scheduler" / "csrc"
INCLUDE = B.GPU_DIR / "engine" / "include"
SOURCES = (
    "model_kernels.cu",
    "prefill_attention.cu",
    "flash_decode.cu",
    "sampling.cu",
    "moe.cu",
    "fp8.cu",
)
HEADERS = ("common.cuh", "kv_cache.cuh", "gemv_fused.cuh", "sys_memory.cuh", "fp8_codes.cuh")
# sampling.cu reads SAMPLING_EPS from the generated ring header (blink/protocol/sampling_params.py)
_EXTRA = {"sampling.cu": (SCHEDULER_CSRC / "blink_ring.h",)}
UNITS = {s: B.Unit(CSRC / s, (*(CSRC / h for h in HEADERS), *_EXTRA.get(s, ()))) for s in SOURCES}
# every kernel Python launches: the engine's and the scheduler's
SOURCE_DIRS = {**{s: CSRC for s in SOURCES}, "scheduler.cu": SCHEDULER_CSRC}
PARAM_SOURCES = tuple(SOURCE_DIRS)
PARAMS_FILE = pathlib.Path(__file__).resolve().parent / "kernel_params.json"
DEFAULT_CACHE = B.default_cache_dir()


def build(source: str, cache_dir: str | os.PathLike[str] = DEFAULT_CACHE, arch: int = 90) -> pathlib.Path:
    """The cubin of csrc/<source> for compute capability `arch`, compiled if the cache lacks it."""
    return B.build(UNITS[source], B.target_for(arch, B.nvrtc().archs), cache_dir)


def build_all(cache_dir: str | os.PathLike[str] = DEFAULT_CACHE, arch: int = 90) -> list[pathlib.Path]:
    """Every engine cubin, the missing ones compiled at once (NVRTC runs without the GIL: a first
    start takes as long as the slowest source, flash_decode.cu, not the sum)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(SOURCES)) as pool:
        return list(pool.map(lambda s: build(s, cache_dir, arch), SOURCES))


def device_arch() -> int:
    """Compute capability of the current CUDA device as an int (9.0 -> 90)."""
    import cupy as cp

    return int(cp.cuda.Device().compute_capability)


Params = tuple[tuple[str, str], ...]  # ((C type, parameter name), ...)
_KERNEL = re.compile(
    r'extern "C" __attribute__\(\(global\)\) void\s+'
    r"(?:__attribute__\(\(launch_bounds\((?:[^()]|\([^()]*\))*\)\)\)\s*)?(\w+)\s*\(([^)]*)\)"
)


def parse_signatures(preprocessed: str) -> dict[str, Params]:
    """Every extern "C" kernel of nvcc -E output: name -> ((C type, parameter name), ...)."""
    out: dict[str, Params] = {}
    for m in _KERNEL.finditer(preprocessed):
        params = []
        for p in m.group(2).replace("__restrict__", " ").split(","):
            if not p.strip():
                continue
            typ, name = " ".join(p.replace("*", " * ").split()).rsplit(" ", 1)
            params.append((typ.replace(" *", "*"), name))
        out[m.group(1)] = tuple(params)
    return out


def source_key(source: str) -> str:
    """Hash of csrc/<source> and the headers it includes: what its kernels' signatures depend on."""
    import hashlib

    h = hashlib.sha256()
    paths = (SOURCE_DIRS[source] / source, *(CSRC / name for name in HEADERS))
    for p in paths:  # not the NVRTC shims or options: they change no signature
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


def nvcc_signatures(source: str) -> dict[str, Params]:
    """The kernels of csrc/<source> as nvcc's preprocessor sees them (NVRTC cannot preprocess
    alone; this runs on development machines only, to make PARAMS_FILE)."""
    import shutil
    import subprocess

    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
    if nvcc is None:
        raise RuntimeError("nvcc is needed to regenerate the kernel signatures")
    cmd = [
        nvcc,
        "-arch=sm_90",
        "-std=c++17",
        "--expt-relaxed-constexpr",
        "-E",
        "-I",
        str(SOURCE_DIRS[source]),
        "-I",
        str(INCLUDE),
        "-I",
        str(SCHEDULER_CSRC),  # blink_ring.h
        "-I",
        str(CSRC),  # sys_memory.cuh (the scheduler's too)
        str(SOURCE_DIRS[source] / source),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"nvcc -E failed for {source}:\n{res.stderr}")
    return parse_signatures(res.stdout)


def render_params() -> str:
    """PARAMS_FILE's text: every engine kernel's parameters, per source, with the source's key."""
    data = {s: {"key": source_key(s), "kernels": nvcc_signatures(s)} for s in PARAM_SOURCES}
    return json.dumps(data, indent=1, sort_keys=True) + "\n"


def signatures(source: str) -> dict[str, Params]:
    """The kernels of csrc/<source> and their parameters, from PARAMS_FILE (generated from nvcc's
    preprocessor output and shipped in the package, so serving needs no nvcc). An entry whose
    source changed since is an error naming the command that regenerates it."""
    entry = json.loads(PARAMS_FILE.read_text()).get(source)
    if entry is None or entry["key"] != source_key(source):
        raise RuntimeError(
            f"{PARAMS_FILE.name} is stale for {source}: run `python -m blink.gpu.build_kernels --params`"
        )
    return {k: tuple(tuple(p) for p in v) for k, v in entry["kernels"].items()}  # type: ignore[misc]


def all_signatures() -> dict[str, Params]:
    return {k: v for s in SOURCES for k, v in signatures(s).items()}


_SCALARS = {
    "int": ctypes.c_int,
    "unsigned": ctypes.c_uint,
    "unsigned int": ctypes.c_uint,
    "uint32_t": ctypes.c_uint32,
    "float": ctypes.c_float,
    "uint64_t": ctypes.c_uint64,
    "unsigned long long": ctypes.c_uint64,
}


def pack_args(kernel: str, params: Params, kwargs: dict[str, object]) -> list:
    """kwargs in the kernel's parameter order as ctypes values: a pointer from an int address, an
    array with .data.ptr (CuPy) or None (null); int/float scalars by their C type; a struct passed
    by value as the ctypes.Structure of the same name."""
    names = [n for _, n in params]
    if set(kwargs) != set(names):
        raise TypeError(
            f"{kernel}: missing {sorted(set(names) - set(kwargs))}, unknown {sorted(set(kwargs) - set(names))}"
        )
    out: list = []
    for typ, name in params:
        v = kwargs[name]
        if typ.endswith("*"):
            if v is not None and not isinstance(v, int):
                v = v.data.ptr  # type: ignore[attr-defined]
            out.append(ctypes.c_uint64(v or 0))
        elif typ in _SCALARS:
            if isinstance(v, ctypes._SimpleCData):
                raise TypeError(f"{kernel}.{name}: pass a Python number, not {type(v).__name__}")
            out.append(_SCALARS[typ](v))  # type: ignore[arg-type]
        elif type(v).__name__ == typ.removeprefix("const ") and isinstance(v, ctypes.Structure):
            out.append(v)
        else:
            raise TypeError(f"{kernel}.{name}: {typ} parameter given {type(v).__name__}")
    return out


class Kernels:
    """Function handles of every engine kernel, by name (`kernels["add_rmsnorm"]`)."""

    def __init__(self, driver: Driver, cache_dir: str | os.PathLike[str] = DEFAULT_CACHE) -> None:
        self.driver = driver
        self.arch = device_arch()
        self.cache_dir = pathlib.Path(cache_dir)
        self.modules = [driver.module_load(str(p)) for p in build_all(cache_dir, self.arch)]
        self.params = all_signatures()
        self._fns: dict[str, int] = {}

    def args(self, name: str, kwargs: dict[str, object]) -> list:
        """The ctypes argument list of kernel `name` from keyword arguments (pack_args)."""
        return pack_args(name, self.params[name], kwargs)

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
