"""Thin ctypes bindings: the CUDA driver API (modules, launches, capture, graphs) and cuBLAS.

Why ctypes and not CuPy's wrappers: CuPy refuses cuBLAS calls during stream capture, and its
graph objects are instantiated without cudaGraphInstantiateFlagDeviceLaunch. The driver API
handles are the runtime's (a CUgraph is a cudaGraph_t, a CUstream a cudaStream_t), so memory and
streams still come from CuPy. cuBLAS is called on CuPy's own handle, from the libcublas CuPy
loaded (found in /proc/self/maps), so both agree on one library instance.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence

import numpy as np

_vp = ctypes.c_void_p
_u64 = ctypes.c_uint64
# kernel argument types of Driver.launch
P = ctypes.c_uint64  # device pointer
I32 = ctypes.c_int
F32 = ctypes.c_float

CAPTURE_MODE_GLOBAL = 0
GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH = 4
FUNC_ATTR_MAX_DYNAMIC_SHARED = 8

# cuBLAS enums (cublas_api.h / library_types.h)
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUDA_R_32F, CUDA_R_16BF = 0, 14
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1


class CudaError(RuntimeError):
    pass


class HeuristicResult(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t (cublasLt.h, CUDA 12/13): {cublasLtMatmulAlgo_t algo (8 x u64);
    size_t workspaceSize; cublasStatus_t state; float wavesCount; int reserved[4]} = 96 bytes."""

    _fields_ = [
        ("algo", ctypes.c_uint64 * 8),
        ("workspace_size", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("waves_count", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


# CUlaunchAttributeID (cuda.h): the kernel resolves its stream dependency itself (griddepcontrol.wait)
LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: {CUlaunchAttributeID id; char pad[4]; CUlaunchAttributeValue value (a 64-byte
    union)} = 72 bytes."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig: grid, block, dynamic shared memory, stream, attributes."""

    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared_mem_bytes", ctypes.c_uint),
        ("stream", _vp),
        ("attrs", ctypes.POINTER(LaunchAttribute)),
        ("num_attrs", ctypes.c_uint),
    ]


def programmatic_launch_config(
    grid: tuple[int, int, int], block: tuple[int, int, int], smem: int, stream: int
) -> tuple[LaunchConfig, LaunchAttribute]:
    """A launch that may overlap the kernel before it in the stream (programmatic dependent launch);
    the attribute is returned too, as the config only points to it."""
    attr = LaunchAttribute(id=LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value = (1).to_bytes(4, "little") + bytes(60)  # programmaticStreamSerializationAllowed = 1
    cfg = LaunchConfig(
        (ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), smem, _vp(stream), ctypes.pointer(attr), 1
    )
    return cfg, attr


class Driver:
    """The subset of libcuda that the engine uses. Every call checks its CUresult."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")

    def check(self, res: int, what: str) -> None:
        if res != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(ctypes.c_int(res), ctypes.byref(name))
            raise CudaError(f"{what}: CUresult {res} ({name.value.decode() if name.value else '?'})")

    def module_load(self, path: str) -> int:
        mod = _vp()
        self.check(self.lib.cuModuleLoad(ctypes.byref(mod), path.encode()), f"cuModuleLoad({path})")
        return int(mod.value)

    def get_function(self, module: int, name: str) -> int:
        fn = _vp()
        self.check(self.lib.cuModuleGetFunction(ctypes.byref(fn), _vp(module), name.encode()), f"get {name}")
        return int(fn.value)

    def set_max_dynamic_smem(self, fn: int, nbytes: int) -> None:
        self.check(
            self.lib.cuFuncSetAttribute(_vp(fn), ctypes.c_int(FUNC_ATTR_MAX_DYNAMIC_SHARED), ctypes.c_int(nbytes)),
            "cuFuncSetAttribute(max dynamic smem)",
        )

    def launch(
        self,
        fn: int,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: Sequence[ctypes._SimpleCData],
        stream: int,
        smem: int = 0,
        name: str = "kernel",
        programmatic: bool = False,
    ) -> None:
        """cuLaunchKernel; `programmatic`: with programmatic dependent launch (cuLaunchKernelEx), for a kernel
        that waits for the one before it itself (common.cuh's pdl_wait)."""
        ptrs = (_vp * len(args))(*[ctypes.cast(ctypes.pointer(a), _vp) for a in args])
        if programmatic:
            cfg, _attr = programmatic_launch_config(grid, block, smem, stream)
            res = self.lib.cuLaunchKernelEx(ctypes.byref(cfg), _vp(fn), ptrs, None)
            self.check(res, f"cuLaunchKernelEx({name}, grid={grid}, programmatic)")
            return
        self.check(
            self.lib.cuLaunchKernel(
                _vp(fn),
                *[ctypes.c_uint(x) for x in grid],
                *[ctypes.c_uint(x) for x in block],
                ctypes.c_uint(smem),
                _vp(stream),
                ptrs,
                None,
            ),
            f"cuLaunchKernel({name}, grid={grid})",
        )

    def begin_capture(self, stream: int) -> None:
        self.check(self.lib.cuStreamBeginCapture_v2(_vp(stream), ctypes.c_int(CAPTURE_MODE_GLOBAL)), "begin capture")

    def end_capture(self, stream: int) -> int:
        g = _vp()
        self.check(self.lib.cuStreamEndCapture(_vp(stream), ctypes.byref(g)), "end capture")
        return int(g.value)

    def is_capturing(self, stream: int) -> bool:
        """Whether `stream` is capturing (cuStreamIsCapturing: status ACTIVE)."""
        st = ctypes.c_int(0)
        self.check(self.lib.cuStreamIsCapturing(_vp(stream), ctypes.byref(st)), "cuStreamIsCapturing")
        return st.value == 1

    def device_launchable(self, stream: int, fn: Callable[[], None]) -> bool:
        """Capture fn() (work enqueued on `stream`) alone and instantiate it for device launch: False
        if fn raises CudaError, the capture is invalidated, or the instantiation fails (a library
        kernel that a device-launched graph cannot hold)."""
        self.begin_capture(stream)
        ok = True
        try:
            fn()
        except CudaError:
            ok = False
        try:
            graph = self.end_capture(stream)
        except CudaError:
            return False
        try:
            if ok:
                self.graph_exec_destroy(self.instantiate_device_launch(graph))
        except CudaError:
            ok = False
        finally:
            self.graph_destroy(graph)
        return ok

    def graph_node_count(self, graph: int) -> int:
        if not hasattr(self.lib, "cuGraphGetNodes"):
            return -1
        n = ctypes.c_size_t(0)
        self.check(self.lib.cuGraphGetNodes(_vp(graph), None, ctypes.byref(n)), "cuGraphGetNodes")
        return int(n.value)

    def instantiate_device_launch(self, graph: int) -> int:
        ex = _vp()
        self.check(
            self.lib.cuGraphInstantiateWithFlags(
                ctypes.byref(ex), _vp(graph), ctypes.c_ulonglong(GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH)
            ),
            "cuGraphInstantiateWithFlags(DeviceLaunch)",
        )
        return int(ex.value)

    def instantiate(self, graph: int) -> int:
        """A graph exec for host launches only (benchmarks: no device-launch restrictions)."""
        ex = _vp()
        self.check(
            self.lib.cuGraphInstantiateWithFlags(ctypes.byref(ex), _vp(graph), ctypes.c_ulonglong(0)),
            "cuGraphInstantiateWithFlags",
        )
        return int(ex.value)

    def graph_upload(self, exec_: int, stream: int) -> None:
        self.check(self.lib.cuGraphUpload(_vp(exec_), _vp(stream)), "cuGraphUpload")

    def graph_launch(self, exec_: int, stream: int) -> None:
        self.check(self.lib.cuGraphLaunch(_vp(exec_), _vp(stream)), "cuGraphLaunch")

    def graph_destroy(self, graph: int) -> None:
        self.check(self.lib.cuGraphDestroy(_vp(graph)), "cuGraphDestroy")

    def graph_exec_destroy(self, exec_: int) -> None:
        self.check(self.lib.cuGraphExecDestroy(_vp(exec_)), "cuGraphExecDestroy")


def loaded_library_path(fragment: str, exclude: str = "", near: str = "") -> str:
    """Path of a shared library this process has loaded: the first mapping naming `fragment`, or
    the first in the folder of `near` when there is one."""
    import os

    found: list[str] = []
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1]
            if fragment in path and not (exclude and exclude in path):
                found.append(path)
    same = [p for p in found if near and os.path.dirname(p) == os.path.dirname(near)]
    if same or found:
        return (same or found)[0]
    raise CudaError(f"{fragment} is not loaded in this process")


def load_cublaslt() -> ctypes.CDLL:
    """The cuBLASLt next to the libcublas the engine calls (a process with torch may map two; CuPy's,
    loaded here if no cuBLAS call came first), with the argument types of the calls the engine makes."""
    try:
        cublas = loaded_library_path("libcublas.so", "libcublasLt")
    except CudaError:  # nothing has called cuBLAS yet: CuPy's handle loads the library the engine uses
        import cupy as cp

        cp.cuda.device.get_cublas_handle()
        cublas = loaded_library_path("libcublas.so", "libcublasLt")
    lt = ctypes.CDLL(loaded_library_path("libcublasLt.so", near=cublas))
    pp, vp, i32, size = ctypes.POINTER(_vp), _vp, ctypes.c_int, ctypes.c_size_t
    lt.cublasLtCreate.argtypes = [pp]
    lt.cublasLtDestroy.argtypes = [vp]
    lt.cublasLtMatmulDescCreate.argtypes = [pp, i32, i32]
    lt.cublasLtMatmulDescDestroy.argtypes = [vp]
    lt.cublasLtMatmulDescSetAttribute.argtypes = [vp, i32, vp, size]
    lt.cublasLtMatrixLayoutCreate.argtypes = [pp, i32, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64]
    lt.cublasLtMatrixLayoutDestroy.argtypes = [vp]
    lt.cublasLtMatmulPreferenceCreate.argtypes = [pp]
    lt.cublasLtMatmulPreferenceDestroy.argtypes = [vp]
    lt.cublasLtMatmulPreferenceSetAttribute.argtypes = [vp, i32, vp, size]
    lt.cublasLtMatmulAlgoGetHeuristic.argtypes = [vp] * 7 + [i32, vp, ctypes.POINTER(i32)]
    lt.cublasLtMatmul.argtypes = [vp] * 14 + [size, vp]
    return lt


class Cublas:
    """cublasGemmEx on CuPy's handle, bound to one stream with a user workspace.

    The workspace is set AFTER cublasSetStream (which resets it): without a user workspace cuBLAS
    allocates during capture, the graph gets MemAlloc nodes and device-launch instantiation fails.
    The handle is shared: CuPy's own cuBLAS calls point it at CuPy's current stream and drop the
    workspace, so each GEMM binds both again (a few host microseconds); otherwise a GEMM issued after
    a CuPy matmul would run on CuPy's stream, racing the engine's kernels on its own."""

    def __init__(self, stream: int, workspace_ptr: int, workspace_bytes: int) -> None:
        import cupy as cp

        self.handle = int(cp.cuda.device.get_cublas_handle())
        self.lib = ctypes.CDLL(loaded_library_path("libcublas.so", "libcublasLt"))
        vp, ci = _vp, ctypes.c_int
        self.lib.cublasSetStream_v2.argtypes = [vp, vp]
        self.lib.cublasSetWorkspace_v2.argtypes = [vp, vp, ctypes.c_size_t]
        self.lib.cublasSetPointerMode_v2.argtypes = [vp, ci]
        self.lib.cublasGemmEx.argtypes = [vp, ci, ci, ci, ci, ci, vp, vp, ci, ci, vp, ci, ci, vp, vp, ci, ci, ci, ci]
        self.lib.cublasSetSmCountTarget.argtypes = [vp, ci]
        self.stream, self.workspace = stream, (workspace_ptr, workspace_bytes)
        self._bind()
        self._one = np.array([1.0], np.float32)
        self._zero = np.array([0.0], np.float32)

    def _bind(self) -> None:
        """The handle on this stream, with this workspace and host-side scalars."""
        self._check(self.lib.cublasSetStream_v2(self.handle, self.stream), "cublasSetStream")
        self._check(self.lib.cublasSetPointerMode_v2(self.handle, 0), "cublasSetPointerMode(host)")
        self._check(self.lib.cublasSetWorkspace_v2(self.handle, *self.workspace), "cublasSetWorkspace")

    @staticmethod
    def _check(st: int, what: str) -> None:
        if st != 0:
            raise CudaError(f"{what}: cublasStatus {st}")

    def set_sm_count_target(self, n: int) -> None:
        """GEMMs called from now on are sized for `n` SMs (0: all of them). The handle is CuPy's,
        shared by every engine of the process: an engine sets its own target before it records."""
        self._check(self.lib.cublasSetSmCountTarget(self.handle, n), "cublasSetSmCountTarget")

    def linear(
        self, x: int, w: int, y: int, rows: int, n_out: int, k: int, out_f32: bool = False, ldy: int = 0
    ) -> None:
        """Y[rows, n_out] = X[rows, k] @ W[n_out, k]^T, bf16 in, fp32 accumulate, bf16 or fp32 out; `ldy`:
        Y's row stride in elements (default n_out; more: Y is a block of columns of a wider matrix).
        cuBLAS is column-major: row-major Y [rows, n_out] is column-major Y^T [n_out, rows] = W X^T,
        with W [n_out, k] row-major read as op = T and X [rows, k] read as op = N: gemm(T, N, n_out, rows, k)."""
        self._bind()
        self._check(
            self.lib.cublasGemmEx(
                self.handle,
                CUBLAS_OP_T,
                CUBLAS_OP_N,
                n_out,
                rows,
                k,
                self._one.ctypes.data,
                w,
                CUDA_R_16BF,
                k,
                x,
                CUDA_R_16BF,
                k,
                self._zero.ctypes.data,
                y,
                CUDA_R_32F if out_f32 else CUDA_R_16BF,
                ldy or n_out,
                CUBLAS_COMPUTE_32F,
                CUBLAS_GEMM_DEFAULT,
            ),
            f"cublasGemmEx({rows}x{k} @ {n_out}x{k}^T)",
        )
