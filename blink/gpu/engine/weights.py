"""Model weights on the GPU in bf16, with the QKV and gate/up projections fused.

bf16 lives in CuPy uint16 arrays (CuPy has no bf16 dtype; the kernels and cuBLAS read the bits).
Per layer (H hidden, I intermediate, hd head_dim, nq/nkv heads, shapes (out, in) as in HF):
    attn_norm (H,)  qkv (nq*hd + 2*nkv*hd, H) = [q_proj; k_proj; v_proj]  q_norm, k_norm (hd,)
    qkv_bias (nq*hd + 2*nkv*hd,) = [q; k; v] projection biases (qwen2)
    o (H, nq*hd)  mlp_norm (H,)  gate_up (2*I, H) = [gate_proj; up_proj]  down (H, I)
MoE layers (qwen3_moe; E experts of intermediate size Im) instead of gate_up and down:
    router (E, H)  experts_gate_up (E, 2*Im, H) = [gate_proj; up_proj] per expert  experts_down (E, H, Im)
    (transformers 5's Qwen3MoeExperts layout: each expert's rows contiguous, what blink/gpu/engine/csrc/moe.cu streams)
With fp8 (--quantization fp8; blink/gpu/engine/fp8_weights.py) qkv, o, gate_up and down, and a MoE
layer's experts_gate_up and experts_down, are Fp8Linear (uint8 e4m3 codes + float32 per-row scales),
quantized on the GPU as the tensors stream in (the router stays bf16); with fp8_head the LM head too
(vocab, H) (an untied one streamed through the staging buffer in pieces of rows, never held in bf16;
a tied one quantized from the bf16 embedding once it is loaded: its own FP8 copy).
Sources: blink.models.weights.Bf16Tensors (`from_bf16`: canonical tensors as bf16 bits, one at a
time, each copied into its rows of arrays allocated up front; what the CUDA device loads, so the
host never holds the model), HF-named float32 host dicts rounded to bf16 (`from_host`: tests and
the numpy comparisons), or random weights generated on the GPU by a counter-based kernel (an 8B
model in seconds, no host copy).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from blink.gpu.engine.fp8_weights import FP8_EXPERTS, FP8_PROJECTIONS, Fp8Linear, Fp8Loader, quantize_head
from blink.gpu.toolchain.cuda_api import Driver
from blink.gpu.toolchain.kernels import Kernels
from blink.models.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from blink.models.config import ModelConfig
from blink.models.fp8 import Fp8Weight

__all__ = ["GpuWeights", "LayerWeights", "bf16_bits_to_f32", "f32_to_bf16_bits"]  # the bf16 helpers: re-exported


@dataclass
class LayerWeights:
    attn_norm: object
    qkv: object
    q_norm: object | None
    k_norm: object | None
    o: object
    mlp_norm: object
    gate_up: object | None  # None in MoE layers
    down: object | None
    qkv_bias: object | None = None  # (nq*hd + 2*nkv*hd,) = [q; k; v] biases (qwen2)
    router: object | None = None  # (E, H)  MoE layers only
    experts_gate_up: object | None = None  # (E, 2*Im, H)
    experts_down: object | None = None  # (E, H, Im)


class GpuWeights:
    def __init__(
        self, config: ModelConfig, embed: object, final_norm: object, lm_head: object, layers: list[LayerWeights]
    ) -> None:
        self.config = config
        self.embed = embed
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.layers = layers

    @property
    def nbytes(self) -> int:
        arrays = {id(a): a for a in self._arrays()}
        return sum(int(a.nbytes) for a in arrays.values())

    def _arrays(self) -> Iterator[object]:
        yield from (self.embed, self.final_norm, self.lm_head)
        for lw in self.layers:
            for a in vars(lw).values():
                if a is not None:
                    yield a

    @property
    def bytes_per_step(self) -> int:
        """Bytes a decode step reads: every weight once, except the embedding table (only its
        gathered rows are read) unless it doubles as the LM head."""
        return self.nbytes - (0 if self.lm_head is self.embed else int(self.embed.nbytes))  # type: ignore[attr-defined]

    def active_bytes_per_step(self, experts_read: int | None = None) -> int:
        """bytes_per_step with each MoE layer counting only `experts_read` of its experts (default
        num_experts_per_tok: what a batch-1 decode step reads); equal to it for dense models."""
        c = self.config
        n = c.num_experts_per_tok if experts_read is None else experts_read
        unread = 0
        for lw in self.layers:
            if lw.router is not None:
                per = (int(lw.experts_gate_up.nbytes) + int(lw.experts_down.nbytes)) // c.num_experts  # type: ignore[attr-defined]
                unread += (c.num_experts - n) * per
        return self.bytes_per_step - unread

    @staticmethod
    def shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
        h, i = c.hidden_size, c.intermediate_size
        E, im = c.num_experts, c.moe_intermediate_size
        return {
            "router": (E, h),
            "experts_gate_up": (E, 2 * im, h),
            "experts_down": (E, h, im),
            "attn_norm": (h,),
            "qkv": (c.q_size + 2 * c.kv_size, h),
            "qkv_bias": (c.q_size + 2 * c.kv_size,),
            "q_norm": (c.head_dim,),
            "k_norm": (c.head_dim,),
            "o": (h, c.q_size),
            "mlp_norm": (h,),
            "gate_up": (2 * i, h),
            "down": (h, i),
        }

    @classmethod
    def empty(cls, config: ModelConfig, fp8: bool = False, fp8_head: bool = False) -> GpuWeights:
        """Uninitialised device arrays of every weight of `config` (the LM head is the embedding when
        tied); `fp8`: the linear layers' projections and experts as Fp8Linear (blink.gpu.engine.fp8_weights);
        `fp8_head`: an untied LM head too (a tied one is quantized from the embedding after loading)."""
        import cupy as cp

        c, sh = config, cls.shapes(config)

        def a(key: str) -> object:
            if fp8 and key in (*FP8_PROJECTIONS, *FP8_EXPERTS):
                return Fp8Linear.empty(sh[key])  # type: ignore[arg-type]
            return cp.empty(sh[key], dtype=cp.uint16)

        layers = []
        for li in range(c.num_layers):
            moe = c.layer_is_moe(li)
            layers.append(
                LayerWeights(
                    attn_norm=a("attn_norm"),
                    qkv=a("qkv"),
                    q_norm=a("q_norm") if c.qk_norm else None,
                    k_norm=a("k_norm") if c.qk_norm else None,
                    o=a("o"),
                    mlp_norm=a("mlp_norm"),
                    gate_up=None if moe else a("gate_up"),
                    down=None if moe else a("down"),
                    qkv_bias=a("qkv_bias") if c.attn_bias else None,
                    router=a("router") if moe else None,
                    experts_gate_up=a("experts_gate_up") if moe else None,
                    experts_down=a("experts_down") if moe else None,
                )
            )
        embed = cp.empty((c.vocab_size, c.hidden_size), dtype=cp.uint16)
        head_shape = (c.vocab_size, c.hidden_size)
        if c.tie_word_embeddings:
            lm_head = embed
        else:
            lm_head = Fp8Linear.empty(head_shape) if fp8_head else cp.empty(head_shape, dtype=cp.uint16)
        return cls(c, embed, a("attn_norm"), lm_head, layers)

    @classmethod
    def from_bf16(
        cls,
        config: ModelConfig,
        tensors: Iterable[tuple[str, np.ndarray]],
        fp8: Fp8Loader | None = None,
        fp8_head: bool = False,
    ) -> GpuWeights:
        """From canonical tensors as bf16 bits (uint16; blink.models.weights.Bf16Tensors), in any
        order: each is copied into its rows of the fused arrays, allocated before the first (from
        pageable memory: the host array may go once `set` returns). The host holds one tensor at a time.
        With `fp8`, the linear layers' tensors are quantized into their FP8 rows as they come, and with
        `fp8_head` the LM head (a tied one from the loaded embedding, at the end).
        ValueError for a name that is not the config's, or given twice, a wrong shape or dtype, or
        one missing at the end."""
        if fp8_head and fp8 is None:
            raise ValueError("an FP8 LM head needs FP8 weights (an Fp8Loader)")
        w = cls.empty(config, fp8=fp8 is not None, fp8_head=fp8_head)
        dst = dict(w.hf_tensors())  # name -> the C-contiguous device view its bits go to
        for name, bits in tensors:
            view = dst.pop(name, None)
            if view is None:
                raise ValueError(f"{name}: not a weight of {config.name}, or given twice")
            if isinstance(view, Fp8Linear):
                if isinstance(bits, Fp8Weight):  # an FP8 checkpoint's: its codes and scales as stored
                    view.codes.set(np.ascontiguousarray(bits.codes))  # type: ignore[attr-defined]
                    view.scales.set(np.ascontiguousarray(bits.scales))  # type: ignore[attr-defined]
                else:
                    fp8.put(view, bits)  # type: ignore[union-attr]
                continue
            if isinstance(bits, Fp8Weight):
                raise ValueError(f"{name}: an FP8 tensor for a bf16 engine (EngineConfig.quantization is not fp8)")
            if bits.dtype != np.uint16 or bits.shape != view.shape:  # type: ignore[attr-defined]
                raise ValueError(f"{name}: {bits.dtype} {bits.shape}, expected uint16 {view.shape}")  # type: ignore[attr-defined]
            view.set(np.ascontiguousarray(bits))  # type: ignore[attr-defined]
        if dst:
            raise ValueError(f"weights of {config.name} missing: {list(dst)[:5]}")
        if fp8_head and config.tie_word_embeddings:
            quantize_head(w, fp8.driver, fp8.kernels)  # type: ignore[union-attr]
        return w

    @classmethod
    def from_host(cls, config: ModelConfig, w: dict[str, np.ndarray]) -> GpuWeights:
        """From HF-named float32 (or any float) numpy arrays, rounded to bf16 on upload."""
        import cupy as cp

        def up(a: np.ndarray) -> object:
            return cp.asarray(f32_to_bf16_bits(a))

        def experts(li: int, p: str) -> dict[str, object]:
            """A MoE layer's router and experts, uploaded expert by expert (no host copy of the stack)."""
            if not config.layer_is_moe(li):
                return {
                    "gate_up": up(np.concatenate([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]], 0)),
                    "down": up(w[p + "mlp.down_proj.weight"]),
                }
            sh = cls.shapes(config)
            gu = cp.empty(sh["experts_gate_up"], dtype=cp.uint16)
            dn = cp.empty(sh["experts_down"], dtype=cp.uint16)
            for e in range(config.num_experts):
                x = f"{p}mlp.experts.{e}."
                gu[e] = up(np.concatenate([w[x + "gate_proj.weight"], w[x + "up_proj.weight"]], axis=0))
                dn[e] = up(w[x + "down_proj.weight"])
            return {"gate_up": None, "down": None, "router": up(w[p + "mlp.gate.weight"]),
                    "experts_gate_up": gu, "experts_down": dn}  # fmt: skip

        layers = []
        for li in range(config.num_layers):
            p = f"model.layers.{li}."
            layers.append(
                LayerWeights(
                    attn_norm=up(w[p + "input_layernorm.weight"]),
                    qkv=up(np.concatenate([w[p + f"self_attn.{x}_proj.weight"] for x in "qkv"], axis=0)),
                    q_norm=up(w[p + "self_attn.q_norm.weight"]) if config.qk_norm else None,
                    k_norm=up(w[p + "self_attn.k_norm.weight"]) if config.qk_norm else None,
                    o=up(w[p + "self_attn.o_proj.weight"]),
                    mlp_norm=up(w[p + "post_attention_layernorm.weight"]),
                    qkv_bias=up(np.concatenate([w[p + f"self_attn.{x}_proj.bias"] for x in "qkv"]))
                    if config.attn_bias
                    else None,
                    **experts(li, p),  # type: ignore[arg-type]
                )
            )
        embed = up(w["model.embed_tokens.weight"])
        lm_head = embed if config.tie_word_embeddings or "lm_head.weight" not in w else up(w["lm_head.weight"])
        return cls(config, embed, up(w["model.norm.weight"]), lm_head, layers)

    @classmethod
    def random(
        cls, config: ModelConfig, driver: Driver, kernels: Kernels, stream: int, seed: int = 0, logit_scale: float = 4.0
    ) -> GpuWeights:
        """Random bf16 weights of the config's real shapes, generated on the GPU.

        Uniform weights with std 1/sqrt(fan_in) keep activations O(1) through any depth; norm
        weights are 1 +- 0.1; the LM head gives logits of std ~logit_scale, so greedy choices are
        not coin flips between near-ties."""
        import cupy as cp

        fn = kernels["fill_random_bf16"]

        def rnd(name: str, shape: tuple[int, ...], std: float, bias: float = 0.0) -> object:
            a = cp.empty(shape, dtype=cp.uint16)
            n = int(a.size)
            s = zlib.crc32(name.encode()) ^ (seed * 0x9E3779B1)
            driver.launch(
                fn,
                (min(65535, (n + 255) // 256), 1, 1),
                (256, 1, 1),
                kernels.args("fill_random_bf16", {"out": a, "n": n, "seed": s, "scale": std * 3.0**0.5, "bias": bias}),
                stream,
                name="fill_random_bf16",
            )
            return a

        c, sh = config, cls.shapes(config)

        def mlp(li: int, p: str) -> dict[str, object]:
            if not c.layer_is_moe(li):
                return {
                    "gate_up": rnd(p + "gate_up", sh["gate_up"], c.hidden_size**-0.5),
                    "down": rnd(p + "down", sh["down"], c.intermediate_size**-0.5),
                }
            # Router logits of std ~2 (a peaked but not degenerate top-k), experts as dense MLPs.
            return {"gate_up": None, "down": None,
                    "router": rnd(p + "router", sh["router"], 2.0 * c.hidden_size**-0.5),
                    "experts_gate_up": rnd(p + "experts_gate_up", sh["experts_gate_up"], c.hidden_size**-0.5),
                    "experts_down": rnd(p + "experts_down", sh["experts_down"], c.moe_intermediate_size**-0.5)}  # fmt: skip

        layers = []
        for li in range(c.num_layers):
            p = f"L{li}."
            layers.append(
                LayerWeights(
                    attn_norm=rnd(p + "attn_norm", sh["attn_norm"], 0.1 / 3**0.5, 1.0),
                    qkv=rnd(p + "qkv", sh["qkv"], c.hidden_size**-0.5),
                    q_norm=rnd(p + "q_norm", sh["q_norm"], 0.1 / 3**0.5, 1.0) if c.qk_norm else None,
                    k_norm=rnd(p + "k_norm", sh["k_norm"], 0.1 / 3**0.5, 1.0) if c.qk_norm else None,
                    o=rnd(p + "o", sh["o"], c.q_size**-0.5),
                    mlp_norm=rnd(p + "mlp_norm", sh["mlp_norm"], 0.1 / 3**0.5, 1.0),
                    qkv_bias=rnd(p + "qkv_bias", sh["qkv_bias"], 0.5) if c.attn_bias else None,
                    **mlp(li, p),  # type: ignore[arg-type]
                )
            )
        embed = rnd("embed", (c.vocab_size, c.hidden_size), 1.0)
        lm_head = (
            embed
            if c.tie_word_embeddings
            else rnd("lm_head", (c.vocab_size, c.hidden_size), logit_scale * c.hidden_size**-0.5)
        )
        final_norm = rnd("final_norm", (c.hidden_size,), 0.1 / 3**0.5, 1.0)
        return cls(config, embed, final_norm, lm_head, layers)

    def hf_tensors(self) -> Iterator[tuple[str, object]]:
        """(HF name, uint16 bf16 view) pairs; fused tensors are split back into HF's pieces."""
        c = self.config
        yield "model.embed_tokens.weight", self.embed
        yield "model.norm.weight", self.final_norm
        if not c.tie_word_embeddings:
            yield "lm_head.weight", self.lm_head
        for li, lw in enumerate(self.layers):
            p = f"model.layers.{li}."
            yield p + "input_layernorm.weight", lw.attn_norm
            q, kv = c.q_size, c.kv_size
            yield p + "self_attn.q_proj.weight", lw.qkv[:q]
            yield p + "self_attn.k_proj.weight", lw.qkv[q : q + kv]
            yield p + "self_attn.v_proj.weight", lw.qkv[q + kv :]
            if c.attn_bias:
                yield p + "self_attn.q_proj.bias", lw.qkv_bias[:q]  # type: ignore[index]
                yield p + "self_attn.k_proj.bias", lw.qkv_bias[q : q + kv]  # type: ignore[index]
                yield p + "self_attn.v_proj.bias", lw.qkv_bias[q + kv :]  # type: ignore[index]
            if c.qk_norm:
                yield p + "self_attn.q_norm.weight", lw.q_norm
                yield p + "self_attn.k_norm.weight", lw.k_norm
            yield p + "self_attn.o_proj.weight", lw.o
            yield p + "post_attention_layernorm.weight", lw.mlp_norm
            if lw.router is not None:
                yield p + "mlp.gate.weight", lw.router
                im = c.moe_intermediate_size
                for e in range(c.num_experts):
                    x = f"{p}mlp.experts.{e}."
                    yield x + "gate_proj.weight", lw.experts_gate_up[e, :im]  # type: ignore[index]
                    yield x + "up_proj.weight", lw.experts_gate_up[e, im:]  # type: ignore[index]
                    yield x + "down_proj.weight", lw.experts_down[e]  # type: ignore[index]
                continue
            i = c.intermediate_size
            yield p + "mlp.gate_proj.weight", lw.gate_up[:i]
            yield p + "mlp.up_proj.weight", lw.gate_up[i:]
            yield p + "mlp.down_proj.weight", lw.down
