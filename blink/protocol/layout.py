"""The ring: the one data structure shared by the frontend ("DPU") roles and the device.

Everything about the ring's bytes is defined here, once. The CUDA header
`blink/gpu/scheduler/csrc/blink_ring.h` is generated from these dtypes by `blink.protocol.cgen`
(a test fails when the checked-in header is stale).

Memory map of a ring (all offsets in bytes from the start of the mapping)::

    0                      HEADER_DTYPE (512 B)
    slots_offset           SLOT_DTYPE x n_slots (208 B each)
    prompt_arena_offset    int32 x prompt_arena_tokens   (frontend writes, device reads; see below)
    output_arena_offset    int32 x n_slots x output_capacity  (device writes, frontend reads)
    logprob_arena_offset   LOGPROB_DTYPE x n_slots x output_capacity  (device writes, frontend reads)
    mask_arena_offset      uint32 x n_masks x mask_words  (frontend writes, device reads; see below)

A slot's region of the prompt arena, from prompt_offset (int32 words):

    prompt_len tokens | n_logit_bias x LOGIT_BIAS_DTYPE | prompt logprob records (PROMPT_LOGPROBS)
        | n_block_keys x BLOCK_KEY_DTYPE (at block_keys_offset)

The frontend writes the tokens, the logit bias and the block keys before PREFILL_PENDING. With SlotFlags.PROMPT_LOGPROBS the
device writes `prompt_logprob_record(n_logprobs)` records at word prompt_logprobs_offset, record j
for prompt token j (j >= 1; record 0 is not written), all before it publishes the first generated
token: the frontend reads them once generated >= 1.

Block keys (prefix caching, DeviceFeatures.PREFIX_CACHING): key i names the KV of prompt tokens
[0, (i + 1) * kv_block_size): the frontend chains them (blink/dpu/prefix_keys.py: blake2b-128 over
the parent key and the block's token ids, the chain seeded by header.kv_cache_key and
kv_block_size), one per full block of the prompt (n_block_keys <= prompt_len // kv_block_size; fewer,
or none, is allowed and only caches less: a frontend writes what fits its region of the arena). The device matches the longest run of leading keys it
holds, prefills from the first unmatched token and stores slot.cached_tokens before the first
token's `generated` store. The keys are hints: a device without the feature ignores them.

Logprob arena: with SlotFlags.LOGPROBS, the record of generated token k of slot s is at
[s, k % output_capacity], written before `generated` covers k (the token's own release order).

Mask arena (structured output): n_masks allowed-token bitmasks of mask_words uint32 words each
(bit t % 32 of word t // 32 set = token t may be sampled; tokens past the mask are not). A mask
covers a vocabulary of up to 32 * mask_words tokens (152,064 by default: 19,008 B a mask), so the
arena has fewer masks than slots (ring.mask_slots): a constrained request takes one for its life
(slot.mask_slot = index + 1; 0 = unconstrained) and gives it back when its slot is released. The
frontend writes the mask for generated token k, then stores slot.mask_position = k + 1 (release; over
a Transport, the bits' write completes before the position's store is applied). The device reads the
gate when it samples the slot, at the end of the step that computed the slot's last position, not
when it plans the step: a constrained slot whose input token is known joins the step's forward pass
like any other, and its sampler then loads mask_position (acquire: ld.acquire.sys on CUDA, then a
barrier before the bits are loaded) and, when it reads k + 1, masks the logits with the bits. So the
mask for token k + 1, which the frontend can only compute after reading token k, normally arrives
while the next step's forward pass runs. Otherwise (the mask is late) the slot gives no token in that
step: nothing is published for it, `generated` does not move, and the step's K/V at its last position
is not taken as final (it is computed again, no prefix-cache block is registered on its strength);
the next step computes and samples that position again. No other slot waits. The device counts such
rows in header.mask_late_rows. The mask for token 0 is
written with the request, before PREFILL_PENDING (mask_position = 1). The frontend writes the mask for
k + 1 only after reading token k, so it never rewrites a mask being sampled with.

Ownership (single writer per word; no cross-party atomics, because GPU atomics on
host-mapped memory are not atomic with respect to the host):

    slot.state   EMPTY -> PREFILL_PENDING                  frontend (after writing the request)
                 PREFILL_PENDING -> PREFILL_PROCESSING      device (CAS among device threads)
                 ... -> DECODE_PROCESSING <-> DECODE_PAUSED device
                 ... -> DECODE_COMPLETED                    device (after the last token is published)
                 DECODE_COMPLETED -> EMPTY                  frontend (after reading every token)
    slot.cancel       frontend sets 1; cleared by frontend only while the slot is EMPTY
    slot.generated    device, release-store after the token is in the output arena
    slot.consumed     frontend, after reading tokens (flow control for the output ring)
    logprob arena, prompt logprob records   device (before the `generated` store that covers them)
    slot.mask_slot    frontend, before PREFILL_PENDING (constant for the request)
    slot.mask_position  frontend, release-store after the mask's bits (any state of a held slot)
    mask arena        frontend-written (the mask of a held slot's mask_slot), device-read
    slot.n_block_keys, block_keys_offset, block keys   frontend, before PREFILL_PENDING (in the slot's
                 own region of the prompt arena, after the rest of the request)
    slot.cached_tokens              device (at admission, before the first `generated` store)
    slot.t_submit_ns, t_read_ns     frontend;  t_admit_ns, t_launch_ns, t_first_ns     device
                 (the first token's path, one wall clock: the GPU scheduler adds a calibrated
                 offset to %globaltimer, see blink.gpu.scheduler.scheduler.GpuScheduler._clock_offset)
    header.submit_seq / cancel_seq   frontend doorbells, stored after the slot writes. The one
                 exception to single-writer words: F frontend processes may share a ring, each
                 owning the slots s with s % F == its index. Each stores seq * F + index with its
                 own seq increasing, a plain aligned 8-byte store (no read-modify-write), so every
                 store writes a value no store wrote before and the device, which only compares
                 the doorbell with the last value it saw, never misses a change.
    header.reset_cache_seq   frontend doorbell like submit_seq (seq * F + index): the device drops
                 every key of its prefix cache (blocks in use keep their KV, unnamed). An operator
                 action: a server rings it only with --allow-reset-prefix-cache; the ring agent
                 takes it from any authenticated frontend, as its other doorbells
    header device fields (status, heartbeat, stats, kv counters)   device

Output ring: token k of slot s is at output[s, k % output_capacity]. The device never
writes token k while k - consumed >= output_capacity; such a slot sits in DECODE_PAUSED
until the frontend catches up. Generation length is unbounded (max_new_tokens may be
UNLIMITED).

The byte offsets of a ring of given sizes and numpy views over it: blink.protocol.ring_geometry.
"""

from __future__ import annotations

import enum

import numpy as np

RING_MAGIC = 0x474E524B4E494C42  # b"BLINKRNG" little-endian
RING_VERSION = 6
MAX_STOP_IDS = 8  # stop token ids carried in a slot (EOS included by the frontend)
UNLIMITED = 0xFFFFFFFF  # max_new_tokens value meaning "until a stop condition or the context ends"
HEADER_BYTES = 512
SLOT_BYTES = 208
MAX_LOGPROBS = 20  # top alternatives per logprob record (OpenAI's top_logprobs limit)
MAX_LOGIT_BIAS = 1024  # logit_bias entries per request (vLLM checks each against the vocabulary only)
ALIGN = 4096  # arenas start on page boundaries
DEFAULT_MASK_VOCAB = 152_064  # tokens a mask covers by default (Qwen2/3's 151,936 rounded up)
BLOCK_KEY_WORDS = 4  # int32 words of a block key (128 bits)


class SlotState(enum.IntEnum):
    EMPTY = 0
    PREFILL_PENDING = 1
    PREFILL_PROCESSING = 2
    DECODE_PROCESSING = 3
    DECODE_PAUSED = 4
    DECODE_COMPLETED = 5


class FinishReason(enum.IntEnum):
    NONE = 0
    STOP = 1  # a stop token id (EOS included) was sampled; it is published as the last token
    LENGTH = 2  # max_new_tokens reached
    CONTEXT = 3  # the model's context (max_context) is full
    CANCELLED = 4  # slot.cancel was seen
    ERROR = 5  # the device rejected the request (see slot.error)


class SlotError(enum.IntEnum):
    NONE = 0
    PROMPT_TOO_LONG = 1  # prompt_len + 1 > max_context
    BAD_PROMPT = 2  # prompt_len == 0, prompt outside the arena, or a token id >= vocab_size
    BAD_PARAMS = 3  # a sampling parameter outside sampling_params.py's ranges, n_stop > MAX_STOP_IDS
    NO_KV_SPACE = 4  # the prompt alone needs more KV blocks than the cache has
    DEVICE_FAULT = 5  # a launch failed; the request cannot continue


class DeviceStatus(enum.IntEnum):
    STARTING = 0  # ring created, device not serving yet
    READY = 1  # scheduler running
    STOPPING = 2  # shutdown flag seen, draining
    STOPPED = 3  # clean exit
    FAILED = 4  # unrecoverable device error (header.fault holds a code)


class SlotFlags(enum.IntFlag):
    NONE = 0
    # 1 is unused: greedy is temperature < sampling_params.SAMPLING_EPS, encoded nowhere else
    LOGPROBS = 2  # a logprob record per generated token in the logprob arena (n_logprobs alternatives)
    PROMPT_LOGPROBS = 4  # a record per prompt token at prompt_logprobs_offset (n_logprobs alternatives)


class DeviceFeatures(enum.IntFlag):
    """What a device implements beyond the base protocol (header.features); the frontend refuses
    requests that need a missing one with a 400."""

    NONE = 0
    LOGPROBS = 1  # SlotFlags.LOGPROBS
    PROMPT_LOGPROBS = 2  # SlotFlags.PROMPT_LOGPROBS
    PENALTIES = 4  # presence / frequency / repetition penalties, min_p, logit_bias
    TOKEN_MASK = 8  # slot.mask_slot: allowed-token bitmasks from the mask arena (structured output)
    PREFIX_CACHING = 16  # block keys are matched (slot.n_block_keys; the frontend writes none without it)


# fmt: off
HEADER_DTYPE = np.dtype([
    # identity and geometry: written once by whoever creates the ring
    ("magic", "<u8"),                # RING_MAGIC
    ("version", "<u4"),              # RING_VERSION
    ("header_bytes", "<u4"),         # HEADER_BYTES
    ("n_slots", "<u4"),              # number of slot records
    ("slot_bytes", "<u4"),           # SLOT_BYTES
    ("prompt_arena_tokens", "<u4"),  # int32 tokens in the prompt arena
    ("output_capacity", "<u4"),      # int32 tokens per slot in the output arena (a ring per slot)
    ("slots_offset", "<u8"),         # byte offset of slot 0
    ("prompt_arena_offset", "<u8"),  # byte offset of the prompt arena
    ("output_arena_offset", "<u8"),  # byte offset of the output arena
    ("total_bytes", "<u8"),          # size of the whole mapping
    # device description: written by the device before status becomes READY
    ("vocab_size", "<u4"),           # logits width; prompt ids must be below it
    ("max_context", "<u4"),          # prompt + generated tokens per request
    ("max_batch", "<u4"),            # sequences per decode step
    ("kv_block_size", "<u4"),        # tokens per KV block
    ("kv_blocks_total", "<u4"),      # blocks in the pool
    ("kv_blocks_free", "<u4"),       # blocks free now (device-updated every step)
    ("device_status", "<u4"),        # DeviceStatus
    ("fault", "<u4"),                # device fault code when FAILED (CUDA error or SlotError)
    # frontend -> device
    ("shutdown", "<u4"),             # 1: finish in-flight work, then STOPPED; 2: stop now
    ("_pad0", "<u4"),
    ("submit_seq", "<u8"),           # incremented after a slot becomes PREFILL_PENDING
    ("cancel_seq", "<u8"),           # incremented after a slot's cancel flag is set
    # device -> frontend: liveness and statistics (monotonic counters)
    ("heartbeat", "<u8"),            # incremented at least every millisecond while serving
    ("heartbeat_ns", "<u8"),         # device clock (ns since the Unix epoch) at the last beat
    ("steps", "<u8"),                # decode steps run
    ("prefill_steps", "<u8"),        # prefill launches run
    ("tokens_generated", "<u8"),     # tokens published
    ("prompt_tokens", "<u8"),        # prompt tokens prefilled
    ("requests_admitted", "<u8"),    # PREFILL_PENDING -> PREFILL_PROCESSING transitions
    ("requests_completed", "<u8"),   # -> DECODE_COMPLETED transitions
    ("launches", "<u8"),             # graph launches (device-side or host-side)
    ("relaunches", "<u8"),           # scheduler tail self-relaunches
    ("launch_errors", "<u8"),        # failed launches (retries not counted)
    ("running", "<u4"),              # sequences in the decode batch now
    ("waiting", "<u4"),              # claimed or pending requests not yet in the batch
    ("sched_ns_total", "<u8"),       # scheduler time outside graphs (launch + poll + bookkeeping)
    ("step_ns_total", "<u8"),        # wall time of decode steps
    ("scan_ns_total", "<u8"),        # time spent scanning the slots
    ("scans", "<u8"),                # slot scans performed
    ("features", "<u4"),             # DeviceFeatures, written before device_status READY
    ("logprob_top", "<u4"),          # alternatives per logprob-arena record (MAX_LOGPROBS)
    ("logprob_arena_offset", "<u8"), # byte offset of the logprob arena
    ("mask_arena_offset", "<u8"),    # byte offset of the mask arena
    ("n_masks", "<u4"),              # bitmasks in the mask arena (0: no structured output)
    ("mask_words", "<u4"),           # uint32 words per bitmask
    # prefix caching (see "Block keys" above)
    ("kv_cache_key", "<u8"),         # identity of the device's KV for given tokens (model); seeds the key chain
    ("reset_cache_seq", "<u8"),      # frontend doorbell: drop every key of the prefix cache
    ("prefix_cache_queries", "<u8"), # prompt tokens of admitted requests (first admission), vLLM's queries
    ("prefix_cache_hits", "<u8"),    # of those, tokens found in the cache
    ("prefix_cache_resets", "<u8"),  # reset_cache_seq changes acted on
    ("kv_blocks_cached", "<u4"),     # blocks holding a registered key (in use or evictable)
    # structured output (see the mask arena)
    ("mask_late_rows", "<u8"),       # constrained rows that gave no token in a step: their mask was not
                                     # published when they were sampled (each sat out that step)
], align=True)

SLOT_DTYPE = np.dtype([
    ("state", "<u4"),                # SlotState
    ("cancel", "<u4"),               # 1 = cancel requested by the frontend
    ("request_id", "<u8"),           # frontend's id, echoed for sanity checks
    ("prompt_offset", "<u4"),        # first token of the prompt, in int32 units into the prompt arena
    ("prompt_len", "<u4"),           # prompt tokens
    ("max_new_tokens", "<u4"),       # >= 1, or UNLIMITED
    ("min_new_tokens", "<u4"),       # stop ids are ignored before this many tokens
    ("temperature", "<f4"),          # < SAMPLING_EPS (sampling_params.py) = greedy; the frontend writes 0
    ("top_p", "<f4"),                # (0, 1]
    ("seed", "<u8"),                 # sampling stream: token k uses counter (seed, k)
    ("top_k", "<u4"),                # 0 = off
    ("n_stop", "<u4"),               # valid entries of stop_ids
    ("stop_ids", "<i4", (MAX_STOP_IDS,)),  # sampled token in this set ends the request (published)
    ("generated", "<u4"),            # tokens published so far (device, release)
    ("consumed", "<u4"),             # tokens the frontend has read (frontend)
    ("finish_reason", "<u2"),        # FinishReason, valid once state == DECODE_COMPLETED
    ("error", "<u2"),                # SlotError when finish_reason == ERROR
    ("flags", "<u4"),                # SlotFlags
    ("t_submit_ns", "<u8"),          # frontend clock when the request was published
    ("t_admit_ns", "<u8"),           # device clock when the slot was claimed
    ("t_first_ns", "<u8"),           # device clock when the first token was published
    # sampling extensions (blink/device/sampling.py defines each)
    ("presence_penalty", "<f4"),     # 0 = off
    ("frequency_penalty", "<f4"),    # 0 = off
    ("repetition_penalty", "<f4"),   # 1 = off (0 is read as 1); > 0
    ("min_p", "<f4"),                # 0 = off; [0, 1]
    ("n_logprobs", "<u4"),           # alternatives per logprob record, <= MAX_LOGPROBS
    ("n_logit_bias", "<u4"),         # LOGIT_BIAS_DTYPE entries after the prompt, <= MAX_LOGIT_BIAS
    ("prompt_logprobs_offset", "<u4"),  # int32 word in the prompt arena of prompt logprob record 0
    ("n_block_keys", "<u4"),         # BLOCK_KEY_DTYPE entries at block_keys_offset (prefix caching)
    # the first token's path (TTFT trace; one wall clock, see the ownership table)
    ("t_launch_ns", "<u8"),          # device clock at the launch of the step that sampled the first token
    ("t_read_ns", "<u8"),            # frontend clock when its token reader read the first token
    ("group", "<u8"),                # the API request this is a choice of (n > 1), 0 = none: the device
                                     # admits at most group_cap(max_batch) running sequences of a group
    # structured output (see the mask arena)
    ("mask_slot", "<u4"),            # 0 = unconstrained; m + 1 = samples under bitmask m of the mask arena
    ("mask_position", "<u4"),        # k + 1: the bitmask for generated token k is published (frontend, release)
    ("block_keys_offset", "<u4"),    # int32 word in the prompt arena of block key 0
    ("cached_tokens", "<u4"),        # prompt tokens taken from the prefix cache (device, at admission)
    ("_pad2", "<u4", (2,)),
], align=True)

# One logprob record: the logprob of the chosen token and its top alternatives (most likely first,
# the lower id first on ties). Records in the logprob arena hold MAX_LOGPROBS alternatives (the
# unused tail is not written); prompt records hold n_logprobs (prompt_logprob_record).
LOGPROB_DTYPE = np.dtype([
    ("logprob", "<f4"),              # of the token the record belongs to
    ("top_ids", "<i4", (MAX_LOGPROBS,)),
    ("top_logprobs", "<f4", (MAX_LOGPROBS,)),
], align=True)

LOGIT_BIAS_DTYPE = np.dtype([
    ("token", "<i4"),                # < vocab_size
    ("bias", "<f4"),                 # added to the logit; in [-100, 100]
], align=True)

# A full KV block's key: 128 bits, the digest's bytes in order (words loaded as 4 x u32 on the GPU:
# the prompt arena is int32-aligned only).
BLOCK_KEY_DTYPE = np.dtype([
    ("words", "<u4", (BLOCK_KEY_WORDS,)),
], align=True)
# fmt: on

assert HEADER_DTYPE.itemsize <= HEADER_BYTES, HEADER_DTYPE.itemsize

# Header fields the device keeps up to date while serving: monotonic counters (a restarted
# device continues them; frontends export them as counters) and gauges (current values).
DEVICE_COUNTERS = (
    "steps",
    "prefill_steps",
    "tokens_generated",
    "prompt_tokens",
    "requests_admitted",
    "requests_completed",
    "launches",
    "relaunches",
    "launch_errors",
    "sched_ns_total",
    "step_ns_total",
    "scan_ns_total",
    "scans",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "prefix_cache_resets",
    "mask_late_rows",
)
DEVICE_GAUGES = (
    "device_status",
    "heartbeat",
    "running",
    "waiting",
    "kv_blocks_free",
    "kv_blocks_total",
    "kv_blocks_cached",
)

assert SLOT_DTYPE.itemsize == SLOT_BYTES, SLOT_DTYPE.itemsize

# The ownership table's frontend words, as the ring agent enforces them (blink/protocol/ring_access.py):
# the record words a frontend stores while its slot holds a request (each whole), and the header
# doorbells it rings (seq * F + index). Every other word of a held slot and of the header is the device's.
FRONTEND_SLOT_WORDS = ("state", "cancel", "consumed", "t_read_ns", "mask_position")
FRONTEND_DOORBELLS = ("submit_seq", "cancel_seq", "reset_cache_seq")
assert set(FRONTEND_SLOT_WORDS) <= set(SLOT_DTYPE.names) and set(FRONTEND_DOORBELLS) <= set(HEADER_DTYPE.names)
assert set(DEVICE_COUNTERS + DEVICE_GAUGES) <= set(HEADER_DTYPE.names)

TOKEN_DTYPE = np.dtype("<i4")


def prompt_logprob_record(n: int) -> np.dtype:
    """A prompt logprob record with n alternatives (packed: 1 + 2n int32 words)."""
    return np.dtype([("logprob", "<f4"), ("top_ids", "<i4", (n,)), ("top_logprobs", "<f4", (n,))])


def prompt_region_words(prompt_len: int, n_logit_bias: int, prompt_logprobs: int | None, n_block_keys: int = 0) -> int:
    """int32 words of a slot's prompt-arena region (see the memory map); prompt_logprobs: the
    alternatives per prompt record, None when the request wants none."""
    words = prompt_len + 2 * n_logit_bias + BLOCK_KEY_WORDS * n_block_keys
    if prompt_logprobs is not None:
        words += prompt_len * prompt_logprob_record(prompt_logprobs).itemsize // 4
    return words
