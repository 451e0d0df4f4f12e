"""The GPU-resident scheduler: the persistent kernel (csrc/) and its host-side launcher (scheduler)."""
