"""Build (nvcc -cubin, cached by content hash) and load the engine's CUDA kernels, and launch them
by parameter name.

Sources live in blink/gpu/csrc/. A cubin is rebuilt only when its source, the shared headers or
the flags change; the cache can be filled on a machine without a GPU and carried along.

Launch arguments are checked against the kernels' own signatures: next to each cubin the build
keeps the parameter list of every `extern "C"` kernel, read from nvcc's preprocessor output (so
kernels defined by macros are listed under their real names). `Kernels.args(name, kwargs)` orders
keyword arguments by that list and converts each to the ctypes value its C type takes; a missing,
unknown or mistyped argument is an error at the launch (during graph capture), not a wrong read.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import pathlib
import re
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


def signatures(source: str, cache_dir: pathlib.Path = DEFAULT_CACHE) -> dict[str, Params]:
    """The kernels of csrc/<source> and their parameters, cached beside its cubin (same key)."""
    out = cache_dir / f"{pathlib.Path(source).stem}-{cubin_key(source)}.params.json"
    if out.exists():
        return {k: tuple(map(tuple, v)) for k, v in json.loads(out.read_text()).items()}  # type: ignore[misc]
    nvcc = nvcc_path()
    if nvcc is None:
        raise RuntimeError(f"no cached {out.name} and no nvcc to build it")
    flags = [f for f in NVCC_FLAGS if f != "-cubin"]
    res = subprocess.run([nvcc, *flags, "-E", "-I", str(CSRC), str(CSRC / source)], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"nvcc -E failed for {source}:\n{res.stderr}")
    sigs = parse_signatures(res.stdout)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")  # another process may be reading it
    tmp.write_text(json.dumps(sigs))
    tmp.replace(out)
    return sigs


def all_signatures(cache_dir: pathlib.Path = DEFAULT_CACHE) -> dict[str, Params]:
    return {k: v for s in SOURCES for k, v in signatures(s, cache_dir).items()}


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

    def __init__(self, driver: Driver, cache_dir: pathlib.Path = DEFAULT_CACHE) -> None:
        self.driver = driver
        self.modules = [driver.module_load(str(p)) for p in build_all(cache_dir)]
        self.params = all_signatures(cache_dir)
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


if __name__ == "__main__":
    for p in build_all():
        print(p)
    print(f"{len(all_signatures())} kernel signatures")
