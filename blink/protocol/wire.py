"""Wire types between the frontend roles (and, later, between Ray actors).

Only msgspec Structs: they encode to compact msgpack arrays (`array_like`), skip fields that
hold their default (`omit_defaults`), and are not tracked by the GC (`gc=False`: they hold
no reference cycles). Nothing here is pickled. The ring itself is not a wire type; its
layout lives in `layout.py`.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from .layout import FinishReason, SlotError
from .sampling_params import SamplingParams

_OPTS = dict(array_like=True, omit_defaults=True, gc=False, frozen=True)


class SubmitRequest(msgspec.Struct, **_OPTS):
    """A tokenized request, ready for a slot: what the tokenizer role hands the slot tracker."""

    request_id: int  # frontend-unique, echoed in the slot record
    prompt_ids: list[int]  # the full prompt (chat template applied)
    max_new_tokens: int  # >= 1, or layout.UNLIMITED
    min_new_tokens: int = 0  # stop ids are ignored before this many tokens
    stop_ids: list[int] = []  # EOS included by the tokenizer role unless ignore_eos
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    group: int = 0  # the API request this is one of n > 1 choices of (slot.group); 0 = none
    grammar: str = ""  # structured output: the grammar engine's text (blink/dpu/structured.py); "" = none


class Logprob(msgspec.Struct, **_OPTS):
    """A token's logprob and its top alternatives (a logprob record of the ring)."""

    logprob: float
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class TokenEvent(msgspec.Struct, **_OPTS):
    """New tokens of one request, from the token reader. `finish_reason` != NONE ends the stream."""

    request_id: int
    token_ids: list[int] = []
    finish_reason: int = FinishReason.NONE  # layout.FinishReason
    error: int = SlotError.NONE  # layout.SlotError when finish_reason == ERROR
    message: str = ""  # human-readable cause of an ERROR (device failure, rejected request)
    logprobs: list[Logprob] = []  # one per token_ids entry, when the request asked for them
    prompt_logprobs: list[Logprob] | None = None  # prompt tokens 1.. (with the first tokens only)
    cached_tokens: int = 0  # on the first event: prompt tokens the device took from its prefix cache

    @property
    def finished(self) -> bool:
        return self.finish_reason != FinishReason.NONE


class CancelRequest(msgspec.Struct, **_OPTS):
    """Ask for a request's slot to be cancelled (client gone, stop string matched)."""

    request_id: int


class DeviceHealth(msgspec.Struct, **_OPTS):
    """The token reader's view of the device, from the ring header."""

    ok: bool  # serving: status READY and the heartbeat advancing
    status: int  # layout.DeviceStatus
    heartbeat: int  # last heartbeat counter read
    message: str = ""  # why not ok


class RingStats(msgspec.Struct, **_OPTS):
    """Frontend-side occupancy of one ring, for routing and /metrics."""

    n_slots: int
    busy_slots: int  # slots this frontend holds (claimed, not yet released)
    queued: int  # requests waiting for a slot
    free_slots: int


def encode(msg: msgspec.Struct) -> bytes:
    return msgspec.msgpack.encode(msg)


def decoder(kind: type[msgspec.Struct]) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(kind)


class DeviceSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything a device process is given, and the only thing: the launch layer (blink/launch.py)
    builds it once from the server's config and hands it over as JSON on the command line. Each
    device derives its own engine and scheduler settings from it, inside its process.
    Zero means "the device sizes it" wherever a field says so."""

    ring: str  # /dev/shm/<ring>, created by the launcher before the device starts
    kind: str  # "emulated" (numpy on the CPU) | "cuda"; never "auto": resolved before the spec exists
    model: str  # blink.models.registry spec: default, a .gguf, an HF dir, random:<preset>
    scheduler: str  # cuda: "gpu" (persistent scheduler kernel) | "host" (host-driven loop)
    max_batch: int  # sequences per step
    max_num_batched_tokens: int  # tokens per step: every decode + prefill chunks
    mixed_tokens: int = (
        0  # budget of a step that carries decodes (device/policy.py step_budget); 0 = max_num_batched_tokens
    )
    kv_block_size: int  # tokens per KV block
    num_kv_blocks: int  # KV pool in blocks; 0 = sized by the device
    kv_cache_fraction: float  # cuda: share of the free GPU memory for the KV pool when num_kv_blocks is 0
    max_context: int  # tokens per sequence; 0 = the model's limit
    seed: int = 0  # seed of random weights
    executor: str = ""  # emulated: executor factory "module:function" (tests); "" = the numpy model
    debug: bool = False  # a start-up error with its traceback (blink serve --log-level debug), else one line
    kernel_cache: str = (
        ""  # cuda: directory of the compiled kernels; "" = blink.gpu.toolchain.build.default_cache_dir()
    )
    quantization: str = ""  # "fp8": linear layers' weights in FP8 e4m3, per-channel scales; "" = as the checkpoint
    fp8_lm_head: bool | None = None  # with FP8 weights, the LM head in FP8 too; None = the device's default
    kv_cache_dtype: str = "auto"  # "fp8": K/V stored as FP8 e4m3, scale 1 (blink.models.fp8.kv_round); "auto" = model's
    prefix_caching: bool = True  # match the slots' block keys against cached KV blocks (layout.py)

    def __post_init__(self) -> None:
        if self.kind not in ("emulated", "cuda") or self.scheduler not in ("gpu", "host"):
            raise ValueError(f"device spec: kind {self.kind!r} / scheduler {self.scheduler!r}")
        if (
            min(self.max_batch, self.max_num_batched_tokens, self.kv_block_size) < 1
            or min(self.num_kv_blocks, self.max_context, self.mixed_tokens) < 0
        ):
            raise ValueError(f"device spec: sizes out of range in {self}")
        if self.executor and ":" not in self.executor:
            raise ValueError(f"device spec: executor must be 'module:function', got {self.executor!r}")
        if self.quantization not in ("", "fp8"):
            raise ValueError(f"device spec: quantization {self.quantization!r}")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"device spec: kv_cache_dtype {self.kv_cache_dtype!r}")


# -- ring access frames (TcpTransport <-> ring agent; RDMA bootstrap) -------------------------
# One frame on the socket = 4-byte little-endian length + a msgpack-encoded AgentFrame. The tag
# (first array element) says which message it is. A connection opens with the handshake of
# agent_auth.py (hello, challenge, auth, welcome); nothing else is accepted before it completes.
_FRAME = dict(array_like=True, omit_defaults=True, gc=False, frozen=True, tag_field="op")
AGENT_PROTOCOL = 2
MAX_BATCH_ENTRIES = 1 << 18  # writes or reads in one RingBatch (checked while decoding, before allocating)
_Nonce = Annotated[bytes, msgspec.Meta(min_length=16, max_length=64)]
_Mac = Annotated[bytes, msgspec.Meta(max_length=64)]


class AgentHello(msgspec.Struct, tag="hello", **_FRAME):
    """Client -> agent, first frame of a connection: the client's challenge to the agent."""

    version: int = AGENT_PROTOCOL
    nonce: _Nonce = b"\0" * 16


class AgentChallenge(msgspec.Struct, tag="challenge", **_FRAME):
    """Agent -> client: the agent's proof that it holds the secret (over both nonces), and its own
    challenge to the client."""

    nonce: _Nonce
    proof: _Mac


class AgentAuth(msgspec.Struct, tag="auth", **_FRAME):
    """Client -> agent: the client's proof, and the slot partition it asks for: `owner` of `owners`
    (the slots s with s % owners == owner). owner -1: whichever is free; owners 0: the agent's count."""

    proof: _Mac
    owner: int = -1
    owners: int = 0


class AgentWelcome(msgspec.Struct, tag="welcome", **_FRAME):
    """Agent -> client: the ring it serves. `identity` is new whenever the agent (re)opens a ring,
    so a client that reconnects can tell a restarted ring from the one it knew."""

    version: int
    size: int  # bytes of the ring
    identity: int
    ring: str  # the ring's name on the GPU host (for logs)
    rdma: str = ""  # RDMA device the agent can register the ring with ("" = none)
    host: str = ""  # the GPU host's boot id (transport.host_id)
    file: str = ""  # the ring file's identity there (transport.file_id): a frontend that sees the
    # same file under /dev/shm/<ring> on the same host can map it instead (auto -> shm)
    owner: int = 0  # the slot partition granted to this connection: slots s % owners == owner
    owners: int = 1


class RingBatch(msgspec.Struct, tag="batch", **_FRAME):
    """Writes applied in order, then reads in order (Transport.transact), one round trip."""

    writes: Annotated[list[tuple[int, bytes]], msgspec.Meta(max_length=MAX_BATCH_ENTRIES)] = []  # (offset, bytes)
    reads: Annotated[list[tuple[int, int]], msgspec.Meta(max_length=MAX_BATCH_ENTRIES)] = []  # (offset, length)
    reply: bool = True  # False: a posted batch (writes only); the agent answers nothing, and closes
    # the connection if it fails (the client checked its ranges, so that is a broken agent or ring)


class RingReply(msgspec.Struct, tag="reply", **_FRAME):
    """The reads' bytes concatenated in request order, or why the batch failed."""

    data: bytes = b""
    error: str = ""
    range_error: bool = False  # the error is an out-of-range access (the caller's bug)
    busy: bool = False  # at attach: the partition asked for is held (by a connection closing, maybe)


class RdmaHello(msgspec.Struct, tag="rdma_hello", **_FRAME):
    """Frontend -> agent, once at start-up, after the handshake: its RC queue pair, to be connected
    to a new one on the GPU host that can reach the ring's memory region."""

    qpn: int
    psn: int
    gid: str  # "" on an InfiniBand link without GRH (then lid is used)
    lid: int
    mtu: int  # ibv_mtu enum value of the frontend's port


class RdmaWelcome(msgspec.Struct, tag="rdma_welcome", **_FRAME):
    """Agent -> frontend: the GPU host's queue pair and the ring's memory region."""

    qpn: int
    psn: int
    gid: str
    lid: int
    mtu: int
    rkey: int
    addr: int  # virtual address of ring byte 0 in the region
    size: int


AgentFrame = AgentHello | AgentChallenge | AgentAuth | AgentWelcome | RingBatch | RingReply | RdmaHello | RdmaWelcome
