"""The production cubin of flash_decode.cu, as the driver loads it on the GPU: no decode kernel (every
head dimension and GQA group, over a bf16 or an fp8 cache) uses local memory, where ptxas puts
register spills and stack frames. CI compiles flash_decode.cu at --Ofast-compile=max (a different
register allocation); this reads the build that serves (gpu_check.sh's build part makes it first)."""

from __future__ import annotations

import ctypes

import pytest

pytestmark = pytest.mark.gpu

LOCAL_SIZE_BYTES, NUM_REGS = 3, 4  # CUfunction_attribute


def _attr(drv, fn: int, attr: int) -> int:
    v = ctypes.c_int()
    drv.check(
        drv.lib.cuFuncGetAttribute(ctypes.byref(v), ctypes.c_int(attr), ctypes.c_void_p(fn)), "cuFuncGetAttribute"
    )
    return v.value


@pytest.fixture(scope="module")
def drv():
    import cupy as cp

    from blink.gpu.toolchain.cuda_api import Driver

    cp.cuda.Device().use()
    cp.zeros(1)  # the primary context
    return Driver()


def test_the_attribute_sees_local_memory(drv, tmp_path):
    """The instrument: a kernel that scatters into an array of its own (dynamic indices) reports local
    memory."""
    from blink.gpu.toolchain import build as B

    src = tmp_path / "local.cu"
    src.write_text(
        'extern "C" __global__ void uses_local(const int* idx, float* out) {\n'
        "  float a[64];\n"
        "  for (int i = 0; i < 64; ++i) a[i] = out[i];\n"
        "  for (int i = 0; i < 64; ++i) a[idx[i] & 63] += 1.0f;  // a scatter: no register file holds it\n"
        "  float s = 0.0f;\n"
        "  for (int i = 0; i < 64; ++i) s += a[i] * i;\n"
        "  out[threadIdx.x] = s;\n"
        "}\n"
    )
    cubin = tmp_path / "local.cubin"
    cubin.write_bytes(B.nvrtc().compile(src, "sm_90", ()))
    fn = drv.get_function(drv.module_load(str(cubin)), "uses_local")
    assert _attr(drv, fn, LOCAL_SIZE_BYTES) >= 64 * 4


def test_flash_decode_kernels_use_no_local_memory(drv):
    from blink.gpu.engine.attention_launch import DECODE_GROUPS, FLASH_COMBINE_OF, FLASH_VARIANTS
    from blink.gpu.toolchain import kernels

    module = drv.module_load(str(kernels.build("flash_decode.cu", kernels.DEFAULT_CACHE, kernels.device_arch())))
    names = [
        f"attn_{v}_hd{hd}_g{g}{kv}"
        for v in FLASH_VARIANTS
        for hd in (16, 32, 64, 128)
        for g in DECODE_GROUPS
        for kv in ("", "_fp8kv")
    ]
    names += sorted({f"attn_{FLASH_COMBINE_OF[v]}_combine_hd{hd}" for v in FLASH_VARIANTS for hd in (16, 32, 64, 128)})
    local = {n: _attr(drv, drv.get_function(module, n), LOCAL_SIZE_BYTES) for n in names}
    regs = {n: _attr(drv, drv.get_function(module, n), NUM_REGS) for n in names}
    print(f"{len(names)} kernels; registers {min(regs.values())}..{max(regs.values())}")
    assert len(names) == 132
    assert not {n: b for n, b in local.items() if b}, "local memory (spills or a stack frame)"
