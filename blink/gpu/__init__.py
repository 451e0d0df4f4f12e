"""The CUDA device: model engine (kernels, cuBLAS, graph cache), host loop and GPU-resident scheduler."""
