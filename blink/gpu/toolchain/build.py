"""CUDA source -> cubin for one GPU architecture, compiled by NVRTC and cached on disk.

Blink needs no CUDA toolkit: NVRTC (libnvrtc from the `nvidia-cuda-nvrtc` wheel, or a system
CUDA's) compiles each source at first use for the GPU at hand, against the CUDA headers of the
`nvidia-cuda-runtime` / `nvidia-cuda-crt` wheels (or a toolkit's include directory). NVRTC has no
C library: the two C headers the sources include (<stdint.h>, <stddef.h>) are given to it in
memory (RTC_HEADERS), as is INFINITY, which nvcc gets from <math.h>.

Architectures: compute capability 8.0 or newer (bf16 tensor-core MMA, cp.async); older GPUs are
refused with a message naming theirs. A GPU newer than the NVRTC knows gets PTX for the newest
architecture it does know, which the driver compiles at load. TARGET_ARCHS are the architectures CI
compiles every kernel for (tests/test_gpu_compile.py).

Cache: <cache_dir>/<stem>-<arch>-<key>.cubin (or .ptx), key = hash of the sources, headers,
options and NVRTC's major version; written to a temporary name and renamed, so processes building the same
kernel at once do not see half a file. The directory comes from the caller (`blink serve`: the
config's device.kernel_cache, default default_cache_dir()).
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass

GPU_DIR = pathlib.Path(__file__).resolve().parents[1]  # blink/gpu: engine/ and scheduler/ hold the sources
MIN_ARCH = 80
TARGET_ARCHS = (80, 89, 90, 100)  # Ampere, Ada, Hopper, Blackwell: compiled in CI

INSTALL_HINT = "pip install 'blink-serve[cu13]' (CUDA 13 driver) or 'blink-serve[cu12]' (CUDA 12 driver)"

# NVRTC 13.0 (the H200's CUDA 13.0) knows no __builtin_offsetof ("identifier is undefined"); 13.5
# does. Below this version <stddef.h> has no offsetof and the generated headers skip their offset
# asserts (their `#ifdef offsetof`).
OFFSETOF_NVRTC = (13, 5)

RTC_HEADERS = {
    "stdint.h": """#pragma once
typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef long long int64_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
typedef long long intptr_t;
typedef unsigned long long uintptr_t;
#define INT32_MAX 2147483647
#define UINT32_MAX 4294967295u
#ifndef INFINITY
#define INFINITY (__int_as_float(0x7f800000))
#endif
""",
    "stddef.h": """#pragma once
typedef unsigned long size_t;
typedef long ptrdiff_t;
""",
}


class BuildError(RuntimeError):
    """A kernel cannot be built or loaded here; the message says why and what to install."""


def default_cache_dir(xdg_cache_home: str | None = None) -> pathlib.Path:
    """build/kernels of a source checkout (GPU scripts fill and carry it), else the user cache:
    $XDG_CACHE_HOME/blink/kernels, ~/.cache/blink/kernels. The caller reads the environment."""
    root = GPU_DIR.parents[1]
    if (root / "pyproject.toml").is_file():
        return root / "build" / "kernels"
    base = pathlib.Path(xdg_cache_home) if xdg_cache_home else pathlib.Path.home() / ".cache"
    return base / "blink" / "kernels"


def _wheel_dirs() -> list[pathlib.Path]:
    """The directories of the `nvidia` namespace package (the NVIDIA wheels install there)."""
    spec = importlib.util.find_spec("nvidia")
    return [pathlib.Path(p) for p in (spec.submodule_search_locations or [])] if spec else []


def _library_candidates() -> list[str]:
    out = []
    for d in _wheel_dirs():
        out += [str(d / "cu13" / "lib" / "libnvrtc.so.13"), str(d / "cuda_nvrtc" / "lib" / "libnvrtc.so.12")]
    out += ["/usr/local/cuda/lib64/libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"]
    return out


def _include_candidates(major: int) -> list[pathlib.Path]:
    """The wheels' CUDA headers when they hold all the sources need, else a toolkit's."""
    wheels = []
    for d in _wheel_dirs():
        wheels += (
            [d / "cu13" / "include"] if major >= 13 else [d / "cuda_runtime" / "include", d / "cuda_nvcc" / "include"]
        )
    wheels = [p for p in wheels if p.is_dir()]
    if all(any((p / h).is_file() for p in wheels) for h in ("cuda_runtime.h", "cuda_bf16.h", "crt/mma.h")):
        return wheels
    toolkit = pathlib.Path("/usr/local/cuda/include")
    return [toolkit] if (toolkit / "cuda_runtime.h").is_file() else []


def rtc_headers(version: tuple[int, int]) -> dict[str, str]:
    """The in-memory C headers for an NVRTC of this version (offsetof only where it has the builtin)."""
    headers = dict(RTC_HEADERS)
    if version >= OFFSETOF_NVRTC:
        headers["stddef.h"] += "#define offsetof(t, m) __builtin_offsetof(t, m)\n"
    return headers


class Nvrtc:
    """libnvrtc through ctypes: compile one source for one architecture (no GPU needed)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.lib = ctypes.CDLL(path)
        self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        self.version = (major.value, minor.value)
        n = ctypes.c_int()
        self._check(self.lib.nvrtcGetNumSupportedArchs(ctypes.byref(n)), "nvrtcGetNumSupportedArchs")
        archs = (ctypes.c_int * n.value)()
        self._check(self.lib.nvrtcGetSupportedArchs(archs), "nvrtcGetSupportedArchs")
        self.archs = tuple(archs)
        self.include_dirs = _include_candidates(self.version[0])

    def _check(self, res: int, what: str) -> None:
        if res != 0:
            raise BuildError(f"{what}: {self.lib.nvrtcGetErrorString(res).decode()}")

    def compile(
        self, source: pathlib.Path, target: str, options: Sequence[str] = (), include_dirs: Sequence[pathlib.Path] = ()
    ) -> bytes:
        """cubin (target sm_XX) or PTX (compute_XX) of `source`, which may include headers from its own
        directory and `include_dirs`; raises BuildError with NVRTC's log."""
        headers = rtc_headers(self.version)
        names = list(headers)
        hdr = (ctypes.c_char_p * len(names))(*[headers[k].encode() for k in names])
        hnames = (ctypes.c_char_p * len(names))(*[k.encode() for k in names])
        prog = ctypes.c_void_p()
        self._check(
            self.lib.nvrtcCreateProgram(
                ctypes.byref(prog), source.read_bytes(), source.name.encode(), len(names), hdr, hnames
            ),
            "nvrtcCreateProgram",
        )
        try:
            opts = [
                f"-arch={target}",
                "-std=c++17",
                "-include=stdint.h",
                *options,
                f"-I{source.parent}",
                *(f"-I{d}" for d in include_dirs),
            ]
            opts += [f"-I{d}" for d in self.include_dirs]
            argv = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
            res = self.lib.nvrtcCompileProgram(prog, len(opts), argv)
            self.last_log = self._log(prog)
            if res != 0:
                raise BuildError(f"NVRTC {self.version} could not compile {source.name} for {target}:\n{self.last_log}")
            get_size, get = (
                (self.lib.nvrtcGetCUBINSize, self.lib.nvrtcGetCUBIN)
                if target.startswith("sm_")
                else (self.lib.nvrtcGetPTXSize, self.lib.nvrtcGetPTX)
            )
            n = ctypes.c_size_t()
            self._check(get_size(prog, ctypes.byref(n)), "nvrtcGet*Size")
            buf = ctypes.create_string_buffer(n.value)
            self._check(get(prog, buf), "nvrtcGet*")
            return buf.raw if target.startswith("sm_") else buf.raw.rstrip(b"\0")
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))

    def _log(self, prog: ctypes.c_void_p) -> str:
        n = ctypes.c_size_t()
        self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        buf = ctypes.create_string_buffer(n.value)
        self.lib.nvrtcGetProgramLog(prog, buf)
        return buf.value.decode(errors="replace")


_nvrtc: Nvrtc | None = None


def find_nvrtc() -> Nvrtc | None:
    """The first libnvrtc that loads (wheels first, then a system CUDA), or None."""
    global _nvrtc
    if _nvrtc is None:
        for cand in _library_candidates():
            if "/" in cand and not os.path.exists(cand):
                continue
            try:
                _nvrtc = Nvrtc(cand)
                break
            except (OSError, AttributeError, BuildError):  # not loadable, or too old an NVRTC
                continue
    return _nvrtc


def nvrtc() -> Nvrtc:
    found = find_nvrtc()
    if found is None:
        raise BuildError(f"no NVRTC (libnvrtc) found to build the CUDA kernels: {INSTALL_HINT}")
    if not found.include_dirs:
        raise BuildError(f"no CUDA headers (cuda_runtime.h) for NVRTC {found.version}: {INSTALL_HINT}")
    return found


def target_for(cc: int, supported: Sequence[int]) -> str:
    """NVRTC target for a GPU of compute capability cc (e.g. 90): its own cubin when NVRTC knows
    it, else PTX of the newest architecture NVRTC knows (the driver compiles it at load)."""
    if cc < MIN_ARCH:
        raise BuildError(
            f"this GPU has compute capability {cc // 10}.{cc % 10}; Blink needs {MIN_ARCH // 10}.0 or newer "
            "(Ampere, Ada, Hopper, Blackwell)"
        )
    if cc in supported:
        return f"sm_{cc}"
    older = [a for a in supported if a <= cc]
    if not older:
        raise BuildError(f"NVRTC knows no architecture up to compute capability {cc}")
    return f"compute_{max(older)}"


@dataclass(frozen=True)
class Unit:
    """One module to build: a source file, the headers it includes (its key covers them; NVRTC
    searches their directories), extra NVRTC options."""

    source: pathlib.Path
    deps: tuple[pathlib.Path, ...] = ()
    options: tuple[str, ...] = ()

    def include_dirs(self) -> tuple[pathlib.Path, ...]:
        """The headers' directories other than the source's own, in order."""
        dirs = [d.parent for d in self.deps if d.parent != self.source.parent]
        return tuple(dict.fromkeys(dirs))

    def key(self, target: str, version: tuple[int, int]) -> str:
        h = hashlib.sha256()
        for p in (self.source, *self.deps):
            h.update(p.name.encode() + b"\0" + p.read_bytes())
        for text in RTC_HEADERS.values():
            h.update(text.encode())
        # NVRTC's major version only: a cubin from 13.5 loads wherever one from 13.0 does, so a cache
        # filled on one machine serves another with a different minor release
        h.update(f"{target} cuda{version[0]} {' '.join(self.options)}".encode())
        return h.hexdigest()[:16]


def build(unit: Unit, target: str, cache_dir: str | os.PathLike[str]) -> pathlib.Path:
    """Path of `unit`'s cubin/PTX for `target` in cache_dir, compiled unless already there."""
    rtc = nvrtc()
    cache = pathlib.Path(cache_dir)
    ext = ".cubin" if target.startswith("sm_") else ".ptx"
    out = cache / f"{unit.source.stem}-{target}-{unit.key(target, rtc.version)}{ext}"
    if out.exists():
        return out
    image = rtc.compile(unit.source, target, unit.options, unit.include_dirs())
    cache.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    tmp.write_bytes(image)
    os.replace(tmp, out)
    return out
