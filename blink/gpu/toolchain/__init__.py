"""The CUDA toolchain: NVRTC builds (build), the driver and cuBLAS through ctypes (cuda_api, cudart), kernel loading and launch by name (kernels)."""
