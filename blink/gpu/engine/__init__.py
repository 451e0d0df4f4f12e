"""The model engine: weights on the GPU, the step's kernels and their launches, the CUDA-graph cache, the step ABI."""
