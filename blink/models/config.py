"""Model configuration: one frozen dataclass for the Llama family (Llama 2/3.x, SmolLM2, Qwen2/2.5, Qwen3, Phi-3/Phi-4).

Built once at the edge from an HF `config.json` dict or GGUF metadata (checkpoint_config.py), or
from a named preset (random weights, real shapes) and then passed around read-only. Every engine (numpy,
CUDA) derives its shapes from here, so the presets are the shared vocabulary of benchmarks.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

ARCHS = ("llama", "qwen2", "qwen3", "phi3", "qwen3_moe")


class UnsupportedModelError(ValueError):
    """The checkpoint describes an architecture or feature this engine does not implement."""


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `type` is 'llama3' (Llama 3.1+) or 'default' (none)."""

    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self) -> None:
        if self.type not in ("default", "llama3"):
            raise UnsupportedModelError(f"rope scaling type {self.type!r} is not supported (default, llama3)")


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # "llama" | "qwen2" | "qwen3" | "phi3" (Phi-3/Phi-4: a Llama whose checkpoints fuse qkv and gate_up)
    # | "qwen3_moe" (Qwen3 attention; sparse layers route each token to num_experts_per_tok of num_experts MLPs)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    max_position: int
    tie_word_embeddings: bool
    qk_norm: bool  # Qwen3: RMSNorm over each q/k head before RoPE
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    name: str
    rope_scaling: RopeScaling = RopeScaling()
    attn_bias: bool = False  # Qwen2: the q, k and v projections add a bias (o_proj has none)
    # Mixture of experts (qwen3_moe; 0 experts = dense). Layer i is sparse iff i is not in mlp_only_layers and
    # (i + 1) % decoder_sparse_step == 0 (transformers' rule); the other layers run the dense MLP of
    # intermediate_size. Router: softmax over the experts' logits, top num_experts_per_tok, renormalised to sum 1
    # when norm_topk_prob; each expert is a SwiGLU MLP of moe_intermediate_size; no shared expert.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    quantization: str = ""  # "fp8": the checkpoint stores its linear layers in FP8 (blink.models.fp8_checkpoint)

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise UnsupportedModelError(f"arch {self.arch!r} is not supported ({', '.join(ARCHS)})")
        if self.num_experts and not (
            0 < self.num_experts_per_tok <= self.num_experts and self.moe_intermediate_size > 0
        ):
            raise ValueError(
                f"MoE needs 0 < num_experts_per_tok ({self.num_experts_per_tok}) <= num_experts ({self.num_experts}) "
                f"and moe_intermediate_size > 0 ({self.moe_intermediate_size})"
            )
        if self.num_experts and self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step {self.decoder_sparse_step} must be >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def layer_is_moe(self, i: int) -> bool:
        """Layer i routes to experts (transformers' Qwen3MoeDecoderLayer rule)."""
        return self.is_moe and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    def num_params(self, active: bool = False) -> int:
        """Parameter count; `active`: only the num_experts_per_tok experts a token reads (MoE)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 2 * h
        if self.qk_norm:
            attn += 2 * self.head_dim
        if self.attn_bias:
            attn += self.q_size + 2 * self.kv_size
        experts = self.num_experts_per_tok if active else self.num_experts
        moe = self.num_experts * h + experts * 3 * h * self.moe_intermediate_size
        mlp = sum(moe if self.layer_is_moe(li) else 3 * h * i for li in range(self.num_layers))
        return v * h * (1 if self.tie_word_embeddings else 2) + self.num_layers * attn + mlp + h

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """(head_dim/2,) float64 inverse frequencies, with Llama-3 scaling applied (as transformers does)."""
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    rs = config.rope_scaling
    if rs.type == "default":
        return inv
    low_wavelen = rs.original_max_position / rs.low_freq_factor
    high_wavelen = rs.original_max_position / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
    smooth = (rs.original_max_position / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled)


_LLAMA31_SCALING = RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)

# Real shapes of the models the paper evaluates, plus tiny ones for tests.
# fmt: off
_PRESETS: dict[str, ModelConfig] = {
    "llama3-8b": ModelConfig(
        arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0, rope_scaling=_LLAMA31_SCALING,
        rms_eps=1e-5, max_position=131072, tie_word_embeddings=False, qk_norm=False,
        bos_token_id=128000, eos_token_ids=(128009, 128001, 128008), name="llama3-8b",
    ),
    "qwen3-8b": ModelConfig(
        arch="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
        num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1000000.0, rms_eps=1e-6,
        max_position=40960, tie_word_embeddings=False, qk_norm=True,
        bos_token_id=151643, eos_token_ids=(151645, 151643), name="qwen3-8b",
    ),
    "qwen2.5-7b": ModelConfig(
        arch="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
        num_heads=28, num_kv_heads=4, head_dim=128, rope_theta=1000000.0, rms_eps=1e-6,
        max_position=32768, tie_word_embeddings=False, qk_norm=False, attn_bias=True,
        bos_token_id=None, eos_token_ids=(151645, 151643), name="qwen2.5-7b",
    ),
    "qwen3-32b": ModelConfig(
        arch="qwen3", vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_layers=64,
        num_heads=64, num_kv_heads=8, head_dim=128, rope_theta=1000000.0, rms_eps=1e-6,
        max_position=40960, tie_word_embeddings=False, qk_norm=True,
        bos_token_id=151643, eos_token_ids=(151645, 151643), name="qwen3-32b",
    ),
    # microsoft/phi-4: head_dim 128, GQA group 4, plain RoPE (theta 250000), untied head; eos <|im_end|>.
    "phi-4": ModelConfig(
        arch="phi3", vocab_size=100352, hidden_size=5120, intermediate_size=17920, num_layers=40,
        num_heads=40, num_kv_heads=10, head_dim=128, rope_theta=250000.0, rms_eps=1e-5,
        max_position=16384, tie_word_embeddings=False, qk_norm=False,
        bos_token_id=100257, eos_token_ids=(100265,), name="phi-4",
    ),
    # Qwen/Qwen3-30B-A3B: 48 layers, all sparse; 128 experts of 768, top-8 renormalised; 3.3B of 30.5B active.
    "qwen3-30b-a3b": ModelConfig(
        arch="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48,
        num_heads=32, num_kv_heads=4, head_dim=128, rope_theta=1000000.0, rms_eps=1e-6,
        max_position=40960, tie_word_embeddings=False, qk_norm=True,
        bos_token_id=151643, eos_token_ids=(151645, 151643), name="qwen3-30b-a3b",
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
    ),
    "smollm2-135m": ModelConfig(
        arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_eps=1e-5,
        max_position=8192, tie_word_embeddings=True, qk_norm=False,
        bos_token_id=1, eos_token_ids=(2,), name="smollm2-135m",
    ),
    # Tiny shapes keep GQA (group 2), llama3 scaling, tied / untied and qk-norm covered in tests.
    "tiny-llama": ModelConfig(
        arch="llama", vocab_size=512, hidden_size=64, intermediate_size=160, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 32), rms_eps=1e-5, max_position=1024,
        tie_word_embeddings=True, qk_norm=False, bos_token_id=1, eos_token_ids=(2,), name="tiny-llama",
    ),
    "tiny-qwen2": ModelConfig(
        arch="qwen2", vocab_size=640, hidden_size=128, intermediate_size=256, num_layers=2,
        num_heads=8, num_kv_heads=2, head_dim=16, rope_theta=1000000.0, rms_eps=1e-6,
        max_position=1024, tie_word_embeddings=True, qk_norm=False, attn_bias=True,
        bos_token_id=None, eos_token_ids=(2,), name="tiny-qwen2",
    ),
    "tiny-qwen3": ModelConfig(
        arch="qwen3", vocab_size=768, hidden_size=96, intermediate_size=192, num_layers=3,
        num_heads=6, num_kv_heads=2, head_dim=32, rope_theta=1000000.0, rms_eps=1e-6,
        max_position=1024, tie_word_embeddings=False, qk_norm=True,
        bos_token_id=1, eos_token_ids=(2,), name="tiny-qwen3",
    ),
    "tiny-phi3": ModelConfig(
        arch="phi3", vocab_size=512, hidden_size=128, intermediate_size=192, num_layers=2,
        num_heads=8, num_kv_heads=2, head_dim=16, rope_theta=250000.0, rms_eps=1e-5,
        max_position=1024, tie_word_embeddings=False, qk_norm=False,
        bos_token_id=1, eos_token_ids=(2,), name="tiny-phi3",
    ),
    # Layer 1 dense (mlp_only_layers), layers 0 and 2 sparse: 8 experts, top-2.
    "tiny-qwen3-moe": ModelConfig(
        arch="qwen3_moe", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=3,
        num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=1000000.0, rms_eps=1e-6,
        max_position=1024, tie_word_embeddings=False, qk_norm=True,
        bos_token_id=1, eos_token_ids=(2,), name="tiny-qwen3-moe",
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
        mlp_only_layers=(1,),
    ),
}
# fmt: on

PRESET_NAMES = tuple(_PRESETS)


def preset(name: str) -> ModelConfig:
    """A named shape preset (weights come from `blink.models.weights.random_weights`)."""
    try:
        return _PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown model preset {name!r}; known: {', '.join(_PRESETS)}") from None
