"""Device-side semantics shared by every device: scheduler policy, KV block manager, sampling,
and the Python ring interpreter used by the emulated device and the host-driven CUDA loop."""
