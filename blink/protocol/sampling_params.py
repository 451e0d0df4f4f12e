"""A request's sampling parameters: one record from the API edge to the device, and the one
definition of their valid ranges.

The frontend builds a `SamplingParams` from the OpenAI body (blink.dpu.openai_api), checks it with
`problem()` (a 400 naming the field) and writes it into the request's slot (layout.py: the slot's
sampling fields, logit_bias after the prompt). A device reads the same record back at admission
(`from_slot`) and checks it with the same `problem()`, because the ring holds whatever its writer
put there; the CUDA scheduler checks the same ranges from the constants generated into
blink_ring.h (scheduler_ring.cuh, claim_ext). How a device samples with it: blink/device/sampling.py.

Greedy is encoded once: `temperature < SAMPLING_EPS` (vLLM's `_SAMPLING_EPS`: a temperature below
it is greedy). The frontend writes 0 for such a request; a device treats any temperature below the
epsilon as greedy too, so no other encoding (flag, field) exists.
"""

from __future__ import annotations

import math

import msgspec
import numpy as np

from .layout import LOGIT_BIAS_DTYPE, MAX_LOGIT_BIAS, MAX_LOGPROBS, SlotFlags

SAMPLING_EPS = 1e-5  # temperature below this: greedy (vLLM's _SAMPLING_EPS)
MAX_TEMPERATURE = 2.0  # OpenAI's range [0, 2]
MAX_PENALTY = 2.0  # presence / frequency penalties in [-2, 2] (OpenAI)
MAX_LOGIT_BIAS_VALUE = 100.0  # a logit_bias value in [-100, 100] (OpenAI; vLLM clamps to it)
MAX_TOP_K = (1 << 31) - 1  # top_k fits the device's int32; 0 = off


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True):
    """Every parameter that shapes how a request's tokens are chosen (blink/device/sampling.py
    defines each). Defaults are "off" (and temperature 1, as OpenAI)."""

    temperature: float = 1.0  # [0, MAX_TEMPERATURE]; < SAMPLING_EPS: greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # [0, 1]; 0 = off
    seed: int = 0  # [0, 2^64): the counter-based sampling stream
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    repetition_penalty: float = 1.0  # > 0; 1 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]); a repeated id adds up
    logprobs: int = -1  # alternatives in each generated token's logprob record; -1: no records
    prompt_logprobs: int = -1  # alternatives in each prompt token's record; -1: none

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def penalized(self) -> bool:
        """Keeps a penalty state (any penalty or logit_bias): blink.device.sampling steps 1-2."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0 or self.logit_bias
        )

    @property
    def extended(self) -> bool:
        """Uses a sampling extension (DeviceFeatures.PENALTIES, LOGPROBS, PROMPT_LOGPROBS)."""
        return self.penalized or self.min_p != 0.0 or self.logprobs >= 0 or self.prompt_logprobs >= 0

    def problem(self, vocab_size: int = 1 << 31) -> tuple[str, str] | None:
        """(field, why) for the first parameter outside its range, or None when all are valid.
        Every float must be finite."""
        t, p = self.temperature, self.top_p
        if not (math.isfinite(t) and 0.0 <= t <= MAX_TEMPERATURE):
            return "temperature", f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {t}"
        if not (math.isfinite(p) and 0.0 < p <= 1.0):
            return "top_p", f"top_p must be in (0, 1], got {p}"
        if not 0 <= self.top_k <= MAX_TOP_K:
            return "top_k", f"top_k must be >= 0 (or -1 for off), got {self.top_k}"
        if not (math.isfinite(self.min_p) and 0.0 <= self.min_p <= 1.0):
            return "min_p", f"min_p must be in [0, 1], got {self.min_p}"
        if not 0 <= self.seed < 1 << 64:
            return "seed", f"seed must be in [0, 2^64), got {self.seed}"
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (math.isfinite(v) and -MAX_PENALTY <= v <= MAX_PENALTY):
                return name, f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {v}"
        rep = self.repetition_penalty
        if not (math.isfinite(rep) and rep > 0.0):
            return "repetition_penalty", f"repetition_penalty must be > 0, got {rep}"
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            return "logit_bias", f"at most {MAX_LOGIT_BIAS} logit_bias entries"
        for tok, bias in self.logit_bias:
            if not 0 <= tok < vocab_size:
                return "logit_bias", f"logit_bias token id {tok} is outside the vocabulary [0, {vocab_size})"
            if not (math.isfinite(bias) and abs(bias) <= MAX_LOGIT_BIAS_VALUE):
                return "logit_bias", f"logit_bias of token {tok} must be in [-100, 100], got {bias}"
        for name in ("logprobs", "prompt_logprobs"):
            if not -1 <= getattr(self, name) <= MAX_LOGPROBS:
                return name, f"{name} must be in [0, {MAX_LOGPROBS}], got {getattr(self, name)}"
        return None

    # -- the ring encoding (layout.py) ------------------------------------------------------------
    def slot_flags(self) -> SlotFlags:
        flags = SlotFlags.NONE
        if self.logprobs >= 0:
            flags |= SlotFlags.LOGPROBS
        if self.prompt_logprobs >= 0:
            flags |= SlotFlags.PROMPT_LOGPROBS
        return flags

    def write_slot(self, rec: np.ndarray) -> None:
        """Store the parameters into a slot record (a SLOT_DTYPE array element); logit_bias goes
        into the prompt region (bias_words). The slot has one n_logprobs for both record kinds."""
        rec["temperature"] = 0.0 if self.greedy else self.temperature
        rec["top_p"] = self.top_p
        rec["top_k"] = self.top_k
        rec["seed"] = self.seed & 0xFFFFFFFFFFFFFFFF
        rec["min_p"] = self.min_p
        rec["presence_penalty"] = self.presence_penalty
        rec["frequency_penalty"] = self.frequency_penalty
        rec["repetition_penalty"] = self.repetition_penalty
        rec["n_logprobs"] = max(self.logprobs, self.prompt_logprobs, 0)
        rec["n_logit_bias"] = len(self.logit_bias)
        rec["flags"] = (int(rec["flags"]) & ~int(SlotFlags.LOGPROBS | SlotFlags.PROMPT_LOGPROBS)) | self.slot_flags()

    def bias_words(self) -> np.ndarray:
        """logit_bias as int32 words of the prompt region (LOGIT_BIAS_DTYPE entries)."""
        b = np.zeros(len(self.logit_bias), LOGIT_BIAS_DTYPE)
        if self.logit_bias:
            b["token"], b["bias"] = zip(*self.logit_bias, strict=True)
        return b.view(np.int32)

    @classmethod
    def from_slot(cls, rec: np.void, bias: np.ndarray) -> SamplingParams:
        """The parameters a slot record carries (`bias`: its LOGIT_BIAS_DTYPE entries). Fields the
        slot cannot hold exactly (the shared n_logprobs) come back as the device must serve them."""
        flags = int(rec["flags"])
        n = int(rec["n_logprobs"])
        return cls(
            temperature=float(rec["temperature"]),
            top_p=float(rec["top_p"]),
            top_k=int(rec["top_k"]),
            min_p=float(rec["min_p"]),
            seed=int(rec["seed"]),
            presence_penalty=float(rec["presence_penalty"]),
            frequency_penalty=float(rec["frequency_penalty"]),
            repetition_penalty=float(rec["repetition_penalty"]) or 1.0,  # a zeroed field reads as off
            logit_bias=tuple(zip(bias["token"].tolist(), bias["bias"].tolist(), strict=True)),
            logprobs=n if flags & SlotFlags.LOGPROBS else -1,
            prompt_logprobs=n if flags & SlotFlags.PROMPT_LOGPROBS else -1,
        )
