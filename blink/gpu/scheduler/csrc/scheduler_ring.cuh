// Blink GPU scheduler, ring side: claims, validation, cancels, publishing, header statistics.
// Included by scheduler.cu after the plan functions (one translation unit: the kernel is one graph).
// The semantics are blink/device/ring_device.py's; the comments name the function mirrored.
#pragma once

// RingDevice._describe (thread 0, first instance).
__device__ void describe(SchedCtl* c, Shared& sh) {
  RingHeader* H = sh.H;
  st_sys(&H->vocab_size, sh.vocab);
  st_sys(&H->max_context, c->max_context);
  st_sys(&H->max_batch, c->max_batch);
  st_sys(&H->kv_block_size, sh.bs);
  st_sys(&H->kv_blocks_total, sh.E->num_kv_blocks);
  st_sys(&H->kv_blocks_free, (uint32_t)c->kv_free_top);
  // logprobs, prompt logprobs, penalties, min_p, logit_bias and token masks when the engine has a
  // table row per slot (and so its mask rows: EngineABI.masks)
  uint32_t every = FEATURE_LOGPROBS | FEATURE_PROMPT_LOGPROBS | FEATURE_PENALTIES;
  if (sh.E->mask_words) every |= FEATURE_TOKEN_MASK;
  const uint32_t cache = c->prefix_caching ? (uint32_t)FEATURE_PREFIX_CACHING : 0u;
  st_sys(&H->features, (sh.E->sampling_rows >= sh.n_slots ? every : 0u) | cache);
  st_sys64(&H->kv_cache_key, c->kv_cache_key);
  c->last_reset_seq = ld_acq_sys64(&H->reset_cache_seq);  // a reset rung before this device is not for it
  st_sys(&H->fault, 0);
  beat(c, sh, gtime());
  set_status(c, sh, DEV_READY);  // release: the description is visible before READY
}

// Statistics into the header: one field per thread, relaxed stores (single writer, monotonic).
__device__ void mirror_stats(SchedCtl* c, Shared& sh) {
  RingHeader* H = sh.H;
  const uint32_t t = threadIdx.x;
  const u64* src[] = {&c->steps, &c->prefill_steps, &c->tokens_generated, &c->prompt_tokens,
                      &c->requests_admitted, &c->requests_completed, &c->launches, &c->relaunches,
                      &c->launch_errors, &c->sched_ns_total, &c->step_ns_total, &c->scan_ns_total, &c->scans,
                      &c->prefix_cache_queries, &c->prefix_cache_hits, &c->prefix_cache_resets,
                      &c->mask_late_rows};
  u64* dst[] = {&H->steps, &H->prefill_steps, &H->tokens_generated, &H->prompt_tokens,
                &H->requests_admitted, &H->requests_completed, &H->launches, &H->relaunches,
                &H->launch_errors, &H->sched_ns_total, &H->step_ns_total, &H->scan_ns_total, &H->scans,
                &H->prefix_cache_queries, &H->prefix_cache_hits, &H->prefix_cache_resets,
                &H->mask_late_rows};
  constexpr uint32_t N = sizeof(src) / sizeof(src[0]);
  if (t < N) st_sys64(dst[t], *src[t]);
  if (t == N) st_sys(&H->running, c->n_run);
  if (t == N + 1) st_sys(&H->waiting, c->n_wait + (c->waitq_tail - c->waitq_head));
  if (t == N + 2) st_sys(&H->kv_blocks_free, (uint32_t)c->kv_free_top);
  if (t == N + 3) st_sys(&H->kv_blocks_cached, c->kv_cached);
}

// Thread 0 at the top of an iteration: heartbeat, shutdown, window.
__device__ void iteration_begin(SchedCtl* c, Shared& sh) {
  const u64 now = gtime();
  sh.t_iter = now;
  sh.kind = KIND_NONE;
  sh.flags = 0;
  sh.nseq = sh.ntok = sh.n_dec = 0;
  sh.n_preempted = 0;
  sh.completed = sh.tokens = sh.late = 0;
  sh.launch_ok = 0;
  sh.dirty = 0;
  sh.action = ACT_RUN;
  sh.beat = now - c->last_beat_ns >= c->beat_ns;
  if (sh.beat) beat(c, sh, now);
  if (c->fault) {
    sh.fault = c->fault;
    sh.action = ACT_EXIT;
    return;
  }
  if (sh.shutdown >= 2) {
    sh.action = ACT_EXIT;
    return;
  }
  if (sh.shutdown == 1) {
    if (c->status != DEV_STOPPING) set_status(c, sh, DEV_STOPPING);
    if (c->n_run == 0 && c->n_wait == 0 && c->waitq_head == c->waitq_tail) {
      sh.action = ACT_EXIT;
      return;
    }
  }
  if (c->here >= c->window) {
    sh.action = ACT_RELAUNCH;
    return;
  }
  // A request that arrived while the last step ran is claimed now, so the step planned next
  // carries it. (overlap() scans right after a launch: an arrival later in that step used to wait
  // for the next step's overlap, then be planned one step after that: a whole extra step of TTFT,
  // which the host loop, scanning before it schedules, never paid.) On the critical path only
  // when the doorbell moved: one PCIe read of submit_seq otherwise.
  sh.do_scan = 0;
  if (sh.shutdown == 0) {
    const u64 submit = ld_acq_sys64(&sh.H->submit_seq);
    if (submit != c->last_submit_seq) {
      c->last_submit_seq = submit;
      sh.do_scan = 1;
      sh.nclaim = 0;
      sh.overflow = 0;
    }
  }
}

// The step of decodes only, every block it needs free (the common case): n_need blocks taken at
// once, this thread's ready rows [lo, hi) given theirs from offsets `off` (ready | need << 16: its
// exclusive block scan) and written into the engine's buffers (all threads).
__device__ __forceinline__ void plan_decode_fast(SchedCtl* c, Shared& sh, uint32_t lo, uint32_t hi, uint32_t off,
                                                 uint32_t n_ready, uint32_t n_need) {
  __syncthreads();  // every thread has read kv_free_top before thread 0 takes the blocks
  if (threadIdx.x == 0) {
    sh.kind = KIND_DECODE;
    kv_take_n(c, sh.E->num_kv_blocks, n_need);
  }
  __syncthreads();
  const int32_t* takes = (const int32_t*)c->kv_takes;
  uint32_t o = off & 0xFFFFu, ob = off >> 16, f = 0;
  for (uint32_t i = lo; i < hi; ++i) {
    const uint32_t r = g_run[i];
    if (!decode_ready(g_rows[r], sh.cap)) continue;
    plan_decode_row(c, sh, r, o, takes, ob);
    f |= fill_seq(c, sh, o, r, g_rows[r].len - 1, 1, o, true);
    ++o;
  }
  if (threadIdx.x == 0) {
    sh.nseq = sh.ntok = sh.n_dec = n_ready;
    ((int32_t*)sh.E->cu_q_lens)[0] = 0;
    *(uint32_t*)sh.E->num_seqs = n_ready;
    *(uint32_t*)sh.E->num_tokens = n_ready;
  }
  const int ext_on = __syncthreads_or(f & FILL_EXT);  // barrier: sh.nseq visible to fill_masks
  if (threadIdx.x == 0) *sh.E->ext_on = (uint32_t)ext_on;
  fill_masks(sh, f);
}

// Scheduler.schedule: every running row ready to decode (arrival order), then prefill chunks in the
// rest of the token budget (a MIXED step runs a prefill graph: KIND_PREFILL). One pass over the
// running rows and one block scan decide; a step of decodes only (no prefill wanted, every block
// it needs free: the common case) is written into the engine's buffers in the same pass (all threads).
__device__ void plan(SchedCtl* c, Shared& sh) {
  if (c->reset_pending) prefix_reset(c, sh.E->num_kv_blocks);  // uniform; ends with thread 0 clearing it
  if (threadIdx.x == 0) kv_drain(c, sh.E->num_kv_blocks);      // the blocks rows freed since the last plan
  __syncthreads();
  fair_share_preempt(c, sh);  // before anything is planned: the victim is in no chunk of this step
  const uint32_t cnt = c->n_run, per = (cnt + SCHED_THREADS - 1) / SCHED_THREADS;
  const uint32_t lo = min(cnt, threadIdx.x * per), hi = min(cnt, lo + per);
  uint32_t ready = 0, need = 0, flags = 0;
  for (uint32_t i = lo; i < hi; ++i) {
    Row& R = g_rows[g_run[i]];
    if (prefilling(R)) {
      flags |= 1;
    } else if (decode_ready(R, sh.cap)) {
      ready++;
      need += ceil_div(R.len, sh.bs) - min(R.n_blocks, ceil_div(R.len, sh.bs));
    }
  }
  for (uint32_t p = threadIdx.x; p < c->n_wait; p += SCHED_THREADS)
    if (!output_full(g_rows[g_wait[p]], sh.cap)) flags |= 2;
  if (flags) atomicOr(&sh.flags, flags);
  uint32_t total;
  const uint32_t off = block_scan(ready | (need << 16), &total, sh.warp_sums);  // barriers: sh.flags visible
  const uint32_t n_ready = total & 0xFFFFu, n_need = total >> 16;
  const bool wants = (sh.flags & 1) || (cnt < c->max_batch && ((sh.flags & 2) || c->waitq_head != c->waitq_tail));
  const int top = c->kv_free_top;
  if (wants) {
    plan_decode(c, sh);  // the decodes (preempting when the pool is short); ends with a barrier
    if (threadIdx.x == 0) {
      sh.n_dec = sh.nseq;
      plan_prefill(c, sh);
      sh.kind = sh.nseq == 0 ? KIND_NONE : sh.nseq > sh.n_dec ? KIND_PREFILL : KIND_DECODE;
    }
    __syncthreads();
    if (sh.kind == KIND_NONE) return;
    fill_engine(c, sh);
  } else if (n_ready == 0) {
    return;  // sh.kind stays KIND_NONE
  } else if (n_need > (uint32_t)top) {
    if (threadIdx.x == 0) {
      plan_decode_seq(c, sh);  // preemption needed: Scheduler._schedule_decode step by step
      sh.kind = sh.nseq ? KIND_DECODE : KIND_NONE;
      sh.n_dec = sh.nseq;
    }
    __syncthreads();
    if (sh.kind == KIND_NONE) return;
    fill_engine(c, sh);
  } else {
    plan_decode_fast(c, sh, lo, hi, off, n_ready, n_need);
  }
  if (threadIdx.x == 0) c->last_kind = sh.kind;
  __syncthreads();
}

// slot_request._validate_sampling (one thread per claim): the sampling parameters' fields, then the
// request's logit_bias entries (after its prompt in the arena) checked and copied into the engine's
// table row of the slot (logits_ext reads them there while the request runs).
__device__ uint32_t claim_ext(Shared& sh, uint32_t s, const RingSlot& r) {
  const EngineABI* E = sh.E;
  const bool feats = E->sampling_rows >= sh.n_slots;
  const float pres = r.presence_penalty, freq = r.frequency_penalty, rep = r.repetition_penalty, mp = r.min_p;
  const uint32_t nb = r.n_logit_bias;
  const bool pen = pres != 0.0f || freq != 0.0f || (rep != 0.0f && rep != 1.0f) || mp != 0.0f || nb != 0;
  if (!feats && ((r.flags & (SLOTFLAG_LOGPROBS | SLOTFLAG_PROMPT_LOGPROBS)) || pen)) return SLOTERR_BAD_PARAMS;
  // blink/protocol/sampling_params.py SamplingParams.problem (repetition 0 reads as 1)
  if (!(fabsf(pres) <= MAX_PENALTY) || !(fabsf(freq) <= MAX_PENALTY) || !isfinite(rep) || rep < 0.0f ||
      !(mp >= 0.0f && mp <= 1.0f))
    return SLOTERR_BAD_PARAMS;
  if (r.n_logprobs > MAX_LOGPROBS || nb > MAX_LOGIT_BIAS) return SLOTERR_BAD_PARAMS;
  if (r.mask_slot != 0 && (!feats || !E->mask_words || r.mask_slot > sh.n_masks)) return SLOTERR_BAD_PARAMS;
  if ((u64)r.prompt_offset + r.prompt_len + 2ull * nb > sh.arena_tokens) return SLOTERR_BAD_PARAMS;
  if ((r.flags & SLOTFLAG_PROMPT_LOGPROBS) &&
      (u64)r.prompt_logprobs_offset + (u64)r.prompt_len * (1ull + 2ull * r.n_logprobs) > sh.arena_tokens)
    return SLOTERR_BAD_PARAMS;
  if (!feats) return 0;
  const uint32_t* src = (const uint32_t*)&sh.arena[r.prompt_offset + r.prompt_len];
  int32_t* ids = E->logit_bias_ids + (size_t)s * E->max_logit_bias;
  float* vals = E->logit_bias_vals + (size_t)s * E->max_logit_bias;
  for (uint32_t j = 0; j < nb; ++j) {
    const int32_t id = (int32_t)ld_sys(src + 2 * j);
    const float v = __uint_as_float(ld_sys(src + 2 * j + 1));
    if (id < 0 || (uint32_t)id >= sh.vocab || !(fabsf(v) <= MAX_LOGIT_BIAS_VALUE)) return SLOTERR_BAD_PARAMS;
    ids[j] = id;
    vals[j] = v;
  }
  E->logit_bias_n[s] = (int32_t)nb;
  return 0;
}

// The block keys of the admitted claims into slot_keys (all threads; ends with a barrier): the
// plan matches and registers them from device memory, not over PCIe.
__device__ void copy_keys(SchedCtl* c, Shared& sh, uint32_t n, uint32_t qlo, uint32_t qhi) {
  const RingSlot* copy = (const RingSlot*)c->slot_copy;
  uint32_t mine = 0;
  for (uint32_t q = qlo; q < qhi; ++q)
    mine += sh.claim_err[q] == 0 ? copy[sh.claim_sorted[q]].n_block_keys * KEY_WORDS : 0;
  uint32_t total;
  uint32_t o = block_scan(mine, &total, sh.warp_sums);
  for (uint32_t q = qlo; q < qhi; ++q) {
    sh.claim_cu[q] = o;
    o += sh.claim_err[q] == 0 ? copy[sh.claim_sorted[q]].n_block_keys * KEY_WORDS : 0;
  }
  if (threadIdx.x == 0) sh.claim_cu[n] = total;
  __syncthreads();
  uint32_t* dst = (uint32_t*)c->slot_keys;
  for (uint32_t j = threadIdx.x; j < total; j += SCHED_THREADS) {
    uint32_t a = 0, b = n;  // last a with claim_cu[a] <= j, past the claims that copy nothing
    while (b - a > 1) { const uint32_t m = (a + b) / 2; if (sh.claim_cu[m] <= j) a = m; else b = m; }
    while (a + 1 < n && sh.claim_cu[a + 1] <= j) ++a;
    const uint32_t slot = sh.claim_sorted[a], w = j - sh.claim_cu[a];
    dst[(size_t)slot * sh.mbps * KEY_WORDS + w] = ld_sys((const uint32_t*)&sh.arena[copy[slot].block_keys_offset + w]);
  }
  __syncthreads();
}

// The n claimed slots copied into slot_copy, then ranked FCFS by (t_submit_ns, slot) into
// sh.claim_sorted (all threads; ends with a barrier).
__device__ __forceinline__ void copy_and_sort_claims(Shared& sh, RingSlot* copy, uint32_t n) {
  for (uint32_t i = threadIdx.x; i < n; i += SCHED_THREADS) {
    const uint32_t s = sh.claim_slot[i];
    const uint32_t* src = (const uint32_t*)&sh.slots[s];
    uint32_t w[SLOT_BYTES / 4];
#pragma unroll
    for (int k = 0; k < (int)(SLOT_BYTES / 4); ++k) w[k] = ld_sys(src + k);
#pragma unroll
    for (int k = 0; k < (int)(SLOT_BYTES / 4); ++k) ((uint32_t*)&copy[s])[k] = w[k];
    sh.claim_key[i] = copy[s].t_submit_ns;
  }
  __syncthreads();
  for (uint32_t i = threadIdx.x; i < n; i += SCHED_THREADS) {  // rank sort: (t_submit_ns, slot)
    const u64 ki = sh.claim_key[i];
    const uint32_t si = sh.claim_slot[i];
    uint32_t rank = 0;
    for (uint32_t j = 0; j < n; ++j) {
      const u64 kj = sh.claim_key[j];
      rank += kj < ki || (kj == ki && sh.claim_slot[j] < si);
    }
    sh.claim_sorted[rank] = si;
  }
  __syncthreads();
}

// The transition to PREFILL_PROCESSING and the first checks (cancel, prompt bounds, context) of this
// thread's claims [qlo, qhi) into sh.claim_err; sh.claim_cu: the prompts' offsets in one token range.
// Returns the total of the prompts that passed (ends with a barrier).
__device__ __forceinline__ uint32_t admit_claims(SchedCtl* c, Shared& sh, const RingSlot* copy, uint32_t n,
                                                 uint32_t qlo, uint32_t qhi) {
  const u64 now = unix_ns(c);
  uint32_t toks = 0;
  for (uint32_t q = qlo; q < qhi; ++q) {
    const uint32_t s = sh.claim_sorted[q];
    const RingSlot& r = copy[s];
    st_sys64(&sh.slots[s].t_admit_ns, now);
    st_rel_sys(&sh.slots[s].state, SLOT_PREFILL_PROCESSING);
    uint32_t e = 0;
    if (r.cancel) e = 0xFF;
    else if (r.prompt_len == 0 || (u64)r.prompt_offset + r.prompt_len > sh.arena_tokens) e = SLOTERR_BAD_PROMPT;
    else if ((u64)r.prompt_len + 1 > c->max_context) e = SLOTERR_PROMPT_TOO_LONG;
    sh.claim_err[q] = e;
    toks += e ? 0 : r.prompt_len;
  }
  uint32_t total;
  uint32_t o = block_scan(toks, &total, sh.warp_sums);
  for (uint32_t q = qlo; q < qhi; ++q) {
    sh.claim_cu[q] = o;
    o += sh.claim_err[q] ? 0 : copy[sh.claim_sorted[q]].prompt_len;
  }
  if (threadIdx.x == 0) sh.claim_cu[n] = total;
  __syncthreads();
  return total;
}

// Every prompt token id in [0, vocab), 4 a thread at a time over the `total` tokens of the claims
// that passed; a claim with one outside gets 0x100 in sh.claim_err (ends with a barrier).
__device__ __forceinline__ void check_prompt_tokens(Shared& sh, const RingSlot* copy, uint32_t n, uint32_t total) {
  for (uint32_t j0 = threadIdx.x; j0 < total; j0 += 4 * SCHED_THREADS) {  // token ids in [0, vocab)
    int32_t v[4];
    uint32_t qq[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const uint32_t j = j0 + u * SCHED_THREADS;
      qq[u] = DEAD;
      if (j >= total) continue;
      uint32_t a = 0, b = n;
      while (b - a > 1) { const uint32_t m = (a + b) / 2; if (sh.claim_cu[m] <= j) a = m; else b = m; }
      while (a + 1 < n && sh.claim_cu[a + 1] <= j) ++a;  // skip zero-length (rejected) entries
      qq[u] = a;
      const RingSlot& r = copy[sh.claim_sorted[a]];
      v[u] = (int32_t)ld_sys((const uint32_t*)&sh.arena[r.prompt_offset + (j - sh.claim_cu[a])]);
    }
#pragma unroll
    for (int u = 0; u < 4; ++u)
      if (qq[u] != DEAD && (v[u] < 0 || (uint32_t)v[u] >= sh.vocab)) atomicOr(&sh.claim_err[qq[u]], 0x100u);
  }
  __syncthreads();
}

// RingDevice._validate of this thread's claims [qlo, qhi): sampling parameters, the extension's
// (claim_ext) and the block keys; the final error into sh.claim_err. Returns how many passed.
__device__ __forceinline__ uint32_t validate_claims(Shared& sh, const RingSlot* copy, uint32_t qlo, uint32_t qhi) {
  uint32_t ok = 0;
  for (uint32_t q = qlo; q < qhi; ++q) {
    const uint32_t s = sh.claim_sorted[q];
    const RingSlot& r = copy[s];
    uint32_t e = sh.claim_err[q];
    if (e == 0) {
      const float t = r.temperature, p = r.top_p;
      if (!(t >= 0.0f && t <= MAX_TEMPERATURE) || !(p > 0.0f && p <= 1.0f) || r.top_k > MAX_TOP_K ||
          r.n_stop > MAX_STOP_IDS || r.max_new_tokens == 0)
        e = SLOTERR_BAD_PARAMS;
      else
        e = claim_ext(sh, s, r);
      if (e == 0 && r.n_block_keys &&  // RingDevice validate_keys: one key per full block at most, in the arena
          (r.n_block_keys > r.prompt_len / sh.bs ||
           (u64)r.block_keys_offset + (u64)KEY_WORDS * r.n_block_keys > sh.arena_tokens))
        e = SLOTERR_BAD_PARAMS;
    } else if (e == 0x100) {
      e = SLOTERR_BAD_PROMPT;
    }
    sh.claim_err[q] = e;
    ok += e == 0;
  }
  return ok;
}

// The claims that passed onto the wait queue in FCFS order (after waitq_tail; the caller moves it),
// the others released and finished (cancelled or with their error). Returns how many were queued
// (ends with a barrier).
__device__ __forceinline__ uint32_t queue_claims(SchedCtl* c, Shared& sh, uint32_t* claim, uint32_t n_slots,
                                                 uint32_t ok, uint32_t qlo, uint32_t qhi) {
  uint32_t n_ok;
  uint32_t o = block_scan(ok, &n_ok, sh.warp_sums);
  uint32_t* wq = (uint32_t*)c->waitq;
  for (uint32_t q = qlo; q < qhi; ++q) {
    const uint32_t s = sh.claim_sorted[q], e = sh.claim_err[q];
    if (e == 0) {
      wq[(c->waitq_tail + o++) % n_slots] = s;
    } else {
      claim[s] = 0;
      if (e == 0xFF) finish_slot(sh, s, FINISH_CANCELLED, SLOTERR_NONE);
      else finish_slot(sh, s, FINISH_ERROR, e & 0xFF);
    }
  }
  __syncthreads();
  return n_ok;
}

// RingDevice._scan + _admit + _validate: claim every PREFILL_PENDING slot, FCFS by t_submit_ns.
__device__ void scan_claims(SchedCtl* c, Shared& sh) {
  const u64 t0 = gtime();
  uint32_t* claim = (uint32_t*)c->claim;
  const uint32_t n_slots = sh.n_slots, per = (n_slots + SCHED_THREADS - 1) / SCHED_THREADS;
  const uint32_t lo = min(n_slots, threadIdx.x * per), hi = min(n_slots, lo + per);
  bool found = false;
  // All of a thread's loads are issued before the first use: one PCIe round trip per 16 slots.
  for (uint32_t base = lo; base < hi; base += 16) {
    uint32_t st[16];
#pragma unroll
    for (int k = 0; k < 16; ++k) st[k] = base + k < hi ? ld_sys(&sh.slots[base + k].state) : SLOT_EMPTY;
#pragma unroll
    for (int k = 0; k < 16; ++k) {
      if (st[k] != SLOT_PREFILL_PENDING) continue;
      const uint32_t s = base + k;
      if (atomicCAS(&claim[s], 0u, 1u) != 0u) continue;
      const uint32_t i = atomicAdd(&sh.nclaim, 1u);
      if (i < MAX_CLAIMS) {
        sh.claim_slot[i] = s;
        found = true;
      } else {
        claim[s] = 0;
        sh.overflow = 1;
      }
    }
  }
  if (found) __threadfence_system();  // acquire: the slot fields are read after the state
  __syncthreads();
  const uint32_t n = min(sh.nclaim, MAX_CLAIMS);
  if (n == 0) {  // the common case: nothing new (uniform across the block: no barrier skipped unevenly)
    if (threadIdx.x == 0) {
      c->scans++;
      c->scan_ns_total += gtime() - t0;
    }
    return;
  }
  RingSlot* copy = (RingSlot*)c->slot_copy;
  copy_and_sort_claims(sh, copy, n);
  // transition + first checks, in FCFS order; q is contiguous per thread for the scans below
  const uint32_t per_q = (n + SCHED_THREADS - 1) / SCHED_THREADS;
  const uint32_t qlo = min(n, threadIdx.x * per_q), qhi = min(n, qlo + per_q);
  const uint32_t total = admit_claims(c, sh, copy, n, qlo, qhi);
  check_prompt_tokens(sh, copy, n, total);
  const uint32_t ok = validate_claims(sh, copy, qlo, qhi);
  const uint32_t n_ok = queue_claims(c, sh, claim, n_slots, ok, qlo, qhi);
  if (c->prefix_caching) copy_keys(c, sh, n, qlo, qhi);
  if (threadIdx.x == 0) {
    c->waitq_tail += n_ok;
    c->requests_admitted += n;
    c->scans++;
    c->scan_ns_total += gtime() - t0;
    if (n) sh.dirty = 1;
  }
}

// While the step runs: doorbells, scan, cancel flags, `consumed` of full output rings.
__device__ void overlap(SchedCtl* c, Shared& sh) {
  RingHeader* H = sh.H;
  if (threadIdx.x == 0) {
    sh.shutdown = ld_acq_sys(&H->shutdown);
    const u64 submit = ld_acq_sys64(&H->submit_seq), cancel = ld_acq_sys64(&H->cancel_seq);
    const u64 now = gtime();
    const bool rescan = now - c->last_scan_ns >= c->rescan_ns;
    sh.do_scan = sh.shutdown == 0 &&
                 (submit != c->last_submit_seq || rescan || sh.overflow || (c->flags & SCHED_FLAG_ALWAYS_SCAN));
    sh.do_cancel = cancel != c->last_cancel_seq || rescan;
    c->last_submit_seq = submit;
    c->last_cancel_seq = cancel;
    if (rescan) c->last_scan_ns = now;
    const u64 reset = ld_acq_sys64(&H->reset_cache_seq);  // acted on by the next plan
    if (reset != c->last_reset_seq) {
      c->last_reset_seq = reset;
      c->reset_pending = 1;
    }
    sh.nclaim = 0;
    sh.overflow = 0;
  }
  __syncthreads();
  if (sh.do_scan) scan_claims(c, sh);
  const uint32_t rows = c->rows_cap;
  if (sh.do_cancel) {
    for (uint32_t r = threadIdx.x; r < rows; r += SCHED_THREADS)
      if (g_rows[r].used) g_rows[r].cancel = ld_sys(&sh.slots[g_rows[r].slot].cancel);
    uint32_t* wq = (uint32_t*)c->waitq;
    for (uint32_t i = c->waitq_head + threadIdx.x; i < c->waitq_tail; i += SCHED_THREADS) {
      const uint32_t s = wq[i % sh.n_slots];
      if (s == DEAD || !ld_sys(&sh.slots[s].cancel)) continue;
      wq[i % sh.n_slots] = DEAD;
      ((uint32_t*)c->claim)[s] = 0;
      finish_slot(sh, s, FINISH_CANCELLED, SLOTERR_NONE);
      sh.dirty = 1;
    }
  }
  for (uint32_t r = threadIdx.x; r < rows; r += SCHED_THREADS) {
    Row& R = g_rows[r];
    if (R.used && output_full(R, sh.cap)) R.consumed = ld_sys(&sh.slots[R.slot].consumed);
  }
  __syncthreads();
}

// Thread 0: spin on the completion word, beating meanwhile.
__device__ void wait_done(SchedCtl* c, Shared& sh) {
  const u64* done = (const u64*)sh.E->done_seq;
  while (ld_acq_gpu64(done) != sh.seq) {
    const u64 now = gtime();
    if (now - c->last_beat_ns >= c->beat_ns) beat(c, sh, now);
    if (now - sh.t_launch > c->graph_timeout_ns) {
      c->fault = FAULT_GRAPH_TIMEOUT;
      sh.fault = FAULT_GRAPH_TIMEOUT;
      st_sys(&sh.H->fault, FAULT_GRAPH_TIMEOUT);
      break;
    }
  }
  sh.t_done = gtime();
}

// RingDevice._write_prompt_logprobs: the records of the step's scored prompt tokens into their slots'
// prompt regions (record p + 1 for the packed token at position p), fenced before any later
// `generated` store (flush, after a barrier) can cover them.
__device__ void publish_prompt_logprobs(Shared& sh) {
  const EngineABI* E = sh.E;
  const uint32_t P = *E->plp_count;
  for (uint32_t j = threadIdx.x; j < P; j += SCHED_THREADS) {
    const uint32_t t = (uint32_t)E->plp_tok[j];
    uint32_t a = 0, b = sh.nseq;  // the chunk holding packed token t: last a with g_plan_cu[a] <= t
    while (b - a > 1) { const uint32_t m = (a + b) / 2; if (g_plan_cu[m] <= t) a = m; else b = m; }
    const Row& R = g_rows[g_plan_row[a]];
    const uint32_t p = g_plan_start[a] + (t - g_plan_cu[a]);
    const uint32_t n = (uint32_t)R.prompt_logprobs;
    uint32_t* dst = (uint32_t*)sh.arena + R.prompt_lp_off + (size_t)(p + 1) * (1 + 2 * n);
    st_sys(dst, __float_as_uint(E->plp_lp[j]));
    for (uint32_t k = 0; k < n; ++k) {
      st_sys(dst + 1 + k, (uint32_t)E->plp_ids[(size_t)j * E->max_logprobs + k]);
      st_sys(dst + 1 + n + k, __float_as_uint(E->plp_lps[(size_t)j * E->max_logprobs + k]));
    }
  }
  if (threadIdx.x < P) __threadfence_system();
}

// Scheduler.update, device side: each sampled token into its row, finish decisions, rows freed.
// The ring sees these in flush(), after the next step is launched (off the critical path).
__device__ void account(SchedCtl* c, Shared& sh) {
  const uint32_t nseq = sh.nseq;
  if (!sh.launch_ok) {
    for (uint32_t i = threadIdx.x; i < nseq; i += SCHED_THREADS) {
      g_ev_k[i] = DEAD;
      if (g_rows[g_plan_row[i]].used) retire_row(c, sh, g_plan_row[i], FINISH_ERROR, SLOTERR_DEVICE_FAULT);
    }
  } else {
    if (sh.kind == KIND_PREFILL && sh.E->sampling_rows && *sh.E->ext_on) publish_prompt_logprobs(sh);
    const int32_t* out_tokens = (const int32_t*)sh.E->out_tokens;
    uint32_t mine = 0, late_rows = 0;
    for (uint32_t i = threadIdx.x; i < nseq; i += SCHED_THREADS) {
      const uint32_t r = g_plan_row[i];
      Row& R = g_rows[r];
      const int32_t tok = g_plan_sample[i] ? out_tokens[i] : 0;
      // NO_TOKEN: the row's mask was late when it was sampled. Nothing is published and its last position
      // is not final (no block registered on it, the length unchanged): the next step computes and samples
      // it again (Scheduler.update).
      const bool late = g_plan_sample[i] && tok == NO_TOKEN;
      R.computed = g_plan_start[i] + g_plan_n[i] - (late ? 1u : 0u);
      late_rows += late;  // header.mask_late_rows: the row sat out this step for lack of its mask
      if (!g_plan_sample[i] || late) {
        g_ev_k[i] = DEAD;
        continue;
      }
      const uint32_t k = generated(R);
      g_ev_nlp[i] = R.logprobs;
      if (R.logprobs >= 0) {  // the step's logprob record: flush() publishes it after the next launch
        const EngineABI* E = sh.E;
        LogprobRecord& rec = g_ev_lp[i];
        rec.logprob = E->chosen_lp[i];
        for (int32_t j = 0; j < R.logprobs; ++j) {
          rec.top_ids[j] = E->top_ids[(size_t)i * E->max_logprobs + j];
          rec.top_logprobs[j] = E->top_lps[(size_t)i * E->max_logprobs + j];
        }
      }
      row_tokens(c, r)[R.len] = tok;
      R.len++;
      uint32_t fin = FINISH_NONE;
      bool stop = false;
      for (uint32_t j = 0; j < R.n_stop && j < MAX_STOP_IDS; ++j) stop |= R.stop_ids[j] == tok;
      if (stop && k >= R.min_new) fin = FINISH_STOP;
      else if (R.max_new != UNLIMITED && k + 1 >= R.max_new) fin = FINISH_LENGTH;
      else if (R.len >= c->max_context) fin = FINISH_CONTEXT;
      g_ev_slot[i] = R.slot;
      g_ev_k[i] = k;
      g_ev_tok[i] = tok;
      g_ev_fin[i] = fin;
      mine++;
      if (fin != FINISH_NONE) {
        free_row(c, sh, r);
        atomicAdd(&sh.completed, 1u);
      }
    }
    if (mine) atomicAdd(&sh.tokens, mine);
    if (late_rows) atomicAdd(&sh.late, late_rows);
  }
  __syncthreads();  // every row's `computed` is in
  if (threadIdx.x == 0) {
    if (c->prefix_caching && sh.launch_ok)  // Scheduler.update: the full blocks the step completed
      for (uint32_t i = 0; i < nseq; ++i)
        if (g_rows[g_plan_row[i]].n_keys) prefix_register(c, sh, g_plan_row[i]);
    g_n_ev = nseq;
    g_ev_ns = unix_ns(c);
    g_ev_launch_ns = sh.t_launch + (u64)c->clock_offset_ns;
    if (sh.kind == KIND_PREFILL) {  // a mixed step counts as a prefill launch, its decodes not as prompt
      c->prefill_steps++;
      c->prompt_tokens += sh.ntok - sh.n_dec;
    } else {
      c->steps++;
      c->step_ns_total += sh.t_done - sh.t_launch;
    }
  }
}

// Cancels seen by the overlap phase, list upkeep, statistics (all threads; ends with a barrier).
__device__ void retire(SchedCtl* c, Shared& sh) {
  const uint32_t rows = c->rows_cap;
  for (uint32_t r = threadIdx.x; r < rows; r += SCHED_THREADS)
    if (g_rows[r].used && g_rows[r].cancel) retire_row(c, sh, r, FINISH_CANCELLED, SLOTERR_NONE);
  __syncthreads();
  if (sh.dirty) {
    compact(g_run, &c->n_run, 1, sh);
    compact(g_wait, &c->n_wait, 0, sh);
  }
  const bool busy = sh.kind != KIND_NONE;
  if (threadIdx.x == 0) {
    c->tokens_generated += sh.tokens;
    c->requests_completed += sh.completed;
    c->mask_late_rows += sh.late;
    if (busy || sh.dirty || sh.completed) g_mirror = 1;
    if (busy) {
      const u64 end = gtime();
      const u64 wait = sh.t_done - sh.t_launched;
      c->plan_ns_total += sh.t_launch - sh.t_iter;
      c->launch_ns_total += sh.t_launched - sh.t_launch;
      c->wait_ns_total += wait;
      c->publish_ns_total += end - sh.t_done;
      c->sched_ns_total += (end - sh.t_iter) - wait;
      c->busy_iters++;
    }
  }
  __syncthreads();
}

// The ring side of the last step (all threads): tokens into the output arena, then `generated`
// (st.release.sys), then the finish word and COMPLETED; then slot states (Scheduler.ring_state)
// and the header statistics.
__device__ void flush(SchedCtl* c, Shared& sh) {
  const uint32_t n_ev = g_n_ev, n_fin = g_n_fin;
  const u64 ev_ns = g_ev_ns, ev_launch_ns = g_ev_launch_ns;
  for (uint32_t i = threadIdx.x; i < n_ev; i += SCHED_THREADS) {
    const uint32_t k = g_ev_k[i];
    if (k == DEAD) continue;
    const uint32_t slot = g_ev_slot[i];
    RingSlot* s = &sh.slots[slot];
    st_sys((uint32_t*)&sh.out[(size_t)slot * sh.cap + k % sh.cap], (uint32_t)g_ev_tok[i]);
    const int32_t nlp = g_ev_nlp[i];
    if (nlp >= 0) {  // the logprob record before `generated` covers it
      const LogprobRecord& rec = g_ev_lp[i];
      LogprobRecord* dst = sh.lp + (size_t)slot * sh.cap + k % sh.cap;
      st_sys((uint32_t*)&dst->logprob, __float_as_uint(rec.logprob));
      for (int32_t j = 0; j < nlp; ++j) {
        st_sys((uint32_t*)&dst->top_ids[j], (uint32_t)rec.top_ids[j]);
        st_sys((uint32_t*)&dst->top_logprobs[j], __float_as_uint(rec.top_logprobs[j]));
      }
    }
    if (k == 0) {
      st_sys64(&s->t_launch_ns, ev_launch_ns);
      st_sys64(&s->t_first_ns, ev_ns);
    }
    st_rel_sys(&s->generated, k + 1);
    const uint32_t fin = g_ev_fin[i];
    if (fin != FINISH_NONE) {
      st_sys((uint32_t*)&s->finish_reason, fin);
      st_rel_sys(&s->state, SLOT_DECODE_COMPLETED);
    }
  }
  __syncthreads();  // a slot's last token before its COMPLETED (a cancel can finish a row that sampled)
  for (uint32_t i = threadIdx.x; i < n_fin; i += SCHED_THREADS) {
    RingSlot* s = &sh.slots[g_fin_slot[i]];
    st_sys((uint32_t*)&s->finish_reason, g_fin_word[i]);
    st_rel_sys(&s->state, SLOT_DECODE_COMPLETED);
  }
  __syncthreads();  // a slot's first token before its DECODE_PROCESSING state
  const uint32_t rows = c->rows_cap;
  for (uint32_t r = threadIdx.x; r < rows; r += SCHED_THREADS) {
    Row& R = g_rows[r];
    if (!R.used) continue;
    uint32_t st;
    if (R.len == R.prompt_len) st = SLOT_PREFILL_PROCESSING;
    else if (R.running && !prefilling(R) && !output_full(R, sh.cap)) st = SLOT_DECODE_PROCESSING;
    else st = SLOT_DECODE_PAUSED;
    if (st != R.ring_state) {
      R.ring_state = st;
      st_rel_sys(&sh.slots[R.slot].state, st);
    }
  }
  __syncthreads();
  if (g_mirror || sh.beat) mirror_stats(c, sh);
  __syncthreads();
  if (threadIdx.x == 0) {
    g_n_ev = 0;
    g_n_fin = 0;
    g_mirror = 0;
  }
}

// Shutdown 2 (stop now) or a fault: finish every live request. Unclaimed PENDING slots stay.
__device__ void abort_all(SchedCtl* c, Shared& sh) {
  const uint32_t reason = sh.fault ? FINISH_ERROR : FINISH_CANCELLED;
  const uint32_t err = sh.fault ? SLOTERR_DEVICE_FAULT : SLOTERR_NONE;
  for (uint32_t r = threadIdx.x; r < c->rows_cap; r += SCHED_THREADS)
    if (g_rows[r].used) release_row(c, sh, r, reason, err);
  uint32_t* wq = (uint32_t*)c->waitq;
  for (uint32_t i = c->waitq_head + threadIdx.x; i < c->waitq_tail; i += SCHED_THREADS) {
    const uint32_t s = wq[i % sh.n_slots];
    if (s == DEAD) continue;
    ((uint32_t*)c->claim)[s] = 0;
    finish_slot(sh, s, reason, err);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    c->waitq_head = c->waitq_tail;
    c->requests_completed += sh.completed;
    c->n_run = c->n_wait = 0;
  }
  __syncthreads();
}
