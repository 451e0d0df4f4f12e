"""Executor (blink.device.executor) over the CUDA engine, graphs launched from the host.

Each step: copy the StepBatch into the step arena (one H2D copy from pinned memory), launch the
captured graph that fits, wait, read out_tokens. With blink.device.ring_device this serves the
ring with `--device cuda --scheduler host`: the ablation baseline of the GPU-resident scheduler,
which launches the very same graphs from the device.
"""

from __future__ import annotations

import numpy as np

from blink.device.executor import StepBatch
from blink.gpu.engine.engine import Engine, EngineConfig
from blink.models.config import ModelConfig
from blink.protocol.layout import DeviceFeatures
from blink.protocol.ring_geometry import RingView


class HostExecutor:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        d = engine.dims
        self.vocab_size = engine.config.vocab_size
        self.max_context = d.max_context
        self.block_size = d.block_size
        self.num_blocks = d.num_blocks
        self.max_batch = d.max_seqs
        self.max_num_batched_tokens = d.max_num_batched_tokens
        # Logprobs, prompt logprobs, penalties, min_p, logit_bias and token masks run in the graphs when the engine
        # has the tables (EngineConfig.sampling_rows = the ring's n_slots).
        on = engine.fwd.sampling_rows > 0
        every = DeviceFeatures.LOGPROBS | DeviceFeatures.PROMPT_LOGPROBS | DeviceFeatures.PENALTIES
        every |= DeviceFeatures.TOKEN_MASK  # the sampler reads gates and masks from the ring (map_ring)
        self.features = every if on else DeviceFeatures.NONE
        self._registered = 0

    @classmethod
    def create(
        cls, config: ModelConfig, ecfg: EngineConfig, host_weights: dict[str, np.ndarray] | None = None
    ) -> HostExecutor:
        engine = Engine.create(config, ecfg, host_weights)
        engine.capture()
        return cls(engine)

    def map_ring(self, view: RingView) -> None:
        """Map the ring into the device (pinned, as the GPU scheduler maps it): the sampling kernel of a
        step reads each constrained row's gate (slot.mask_position) and bits there, at the end of the
        step (blink.device.executor: the optional map_ring)."""
        from blink.gpu.toolchain import cudart

        self.engine.bind_thread()  # RingDevice.run calls this first thing, maybe in a thread of its own
        self.unmap_ring()
        ptr = int(np.frombuffer(view.buf, np.uint8).ctypes.data)
        self._registered = cudart.host_register(self.engine.driver, ptr, view.geo.total_bytes)
        self.engine.map_ring(self._registered, view.geo)

    def unmap_ring(self) -> None:
        """Release the ring's mapping (before the ring is unmapped: memory still registered when a later
        ring lands at the same address would fail to register). The engine keeps serving other rings."""
        if self._registered:
            from blink.gpu.toolchain import cudart

            self.engine.map_ring(None)
            cudart.host_unregister(self.engine.driver, self._registered)
            self._registered = 0

    def execute(self, batch: StepBatch) -> np.ndarray:
        return self.engine.step(batch)

    def close(self) -> None:
        self.unmap_ring()
        self.engine.close()
