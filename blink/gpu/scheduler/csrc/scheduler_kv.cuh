// Blink GPU scheduler, KV side: the block pool and the prefix cache, blink/device/kv_blocks.py's
// policy over device arrays. Included by scheduler.cu before the plan functions.
//
// Every block no running row holds (reference count 0) is in the free queue, a doubly linked list
// over kv_link (next at [b], prev at [nb + b]); kv_free_top counts it, cached blocks included. A new
// allocation takes the front; taking a block with a key evicts the key. A block whose count drops
// to 0 goes to the back when it has a key (least recently used first out), to the front otherwise
// (reused before any cached block). Keys: 128 bits (layout.py "Block keys"), in an open-addressing
// table of hash_mask + 1 entries (linear probing, backward-shift deletion: no tombstones), at least
// twice the pool. A row frees its blocks into the pending list (kv_free, any thread, atomics only);
// thread 0 drains it in order at the start of the next plan. Everything else is thread 0's, in the
// plan phase or right after account (registration), never concurrently.
#pragma once

constexpr uint32_t KEY_WORDS = BLOCK_KEY_WORDS;
constexpr uint32_t HASH_WORDS = KEY_WORDS + 1;  // key words, then block + 1 (0: an empty entry)
constexpr uint32_t KV_KEYED = KEY_WORDS;        // kv_key[b * HASH_WORDS + KV_KEYED]: 1 when b has a key

__device__ __forceinline__ int32_t* q_next(SchedCtl* c) { return (int32_t*)c->kv_link; }
__device__ __forceinline__ int32_t* q_prev(SchedCtl* c, uint32_t nb) { return (int32_t*)c->kv_link + nb; }
__device__ __forceinline__ uint32_t* block_key(SchedCtl* c, uint32_t b) { return (uint32_t*)c->kv_key + (size_t)b * HASH_WORDS; }
__device__ __forceinline__ uint32_t* hash_entry(SchedCtl* c, uint32_t i) { return (uint32_t*)c->kv_hash + (size_t)i * HASH_WORDS; }
__device__ __forceinline__ const uint32_t* slot_key(const SchedCtl* c, const Shared& sh, uint32_t slot, uint32_t i) {
  return (const uint32_t*)c->slot_keys + ((size_t)slot * sh.mbps + i) * KEY_WORDS;
}
__device__ __forceinline__ bool key_eq(const uint32_t* a, const uint32_t* b) {
  return a[0] == b[0] && a[1] == b[1] && a[2] == b[2] && a[3] == b[3];
}
// The key is already a blake2b digest: its first word is a uniform hash.
__device__ __forceinline__ uint32_t key_home(const SchedCtl* c, const uint32_t* k) { return k[0] & c->hash_mask; }

// ---- free queue ----------------------------------------------------------------------------------
__device__ void q_unlink(SchedCtl* c, uint32_t nb, int32_t b) {
  int32_t *nx = q_next(c), *pv = q_prev(c, nb);
  if (pv[b] >= 0) nx[pv[b]] = nx[b]; else c->kv_head = nx[b];
  if (nx[b] >= 0) pv[nx[b]] = pv[b]; else c->kv_tail = pv[b];
  c->kv_free_top--;
}

__device__ void q_push(SchedCtl* c, uint32_t nb, int32_t b, bool back) {
  int32_t *nx = q_next(c), *pv = q_prev(c, nb);
  if (back) {
    nx[b] = -1;
    pv[b] = c->kv_tail;
    if (c->kv_tail >= 0) nx[c->kv_tail] = b; else c->kv_head = b;
    c->kv_tail = b;
  } else {
    pv[b] = -1;
    nx[b] = c->kv_head;
    if (c->kv_head >= 0) pv[c->kv_head] = b; else c->kv_tail = b;
    c->kv_head = b;
  }
  c->kv_free_top++;
}

// ---- key table -----------------------------------------------------------------------------------
__device__ int32_t hash_find(SchedCtl* c, const uint32_t* k) {
  for (uint32_t i = key_home(c, k);; i = (i + 1) & c->hash_mask) {
    const uint32_t* e = hash_entry(c, i);
    if (e[KEY_WORDS] == 0) return -1;
    if (key_eq(e, k)) return (int32_t)e[KEY_WORDS] - 1;
  }
}

__device__ void hash_insert(SchedCtl* c, const uint32_t* k, uint32_t b) {
  uint32_t i = key_home(c, k);
  while (hash_entry(c, i)[KEY_WORDS] != 0) i = (i + 1) & c->hash_mask;
  uint32_t* e = hash_entry(c, i);
  for (uint32_t w = 0; w < KEY_WORDS; ++w) e[w] = k[w];
  e[KEY_WORDS] = b + 1;
  c->kv_cached++;
}

// Remove k (present): backward-shift the entries after it that would no longer be found.
__device__ void hash_erase(SchedCtl* c, const uint32_t* k) {
  const uint32_t m = c->hash_mask;
  uint32_t i = key_home(c, k);
  while (!key_eq(hash_entry(c, i), k)) i = (i + 1) & m;
  for (uint32_t j = (i + 1) & m;; j = (j + 1) & m) {
    uint32_t* ej = hash_entry(c, j);
    if (ej[KEY_WORDS] == 0) break;
    const uint32_t h = key_home(c, ej);
    if (((j - h) & m) >= ((j - i) & m)) {  // ej's home is not in (i, j]: it may move to i
      uint32_t* ei = hash_entry(c, i);
      for (uint32_t w = 0; w < HASH_WORDS; ++w) ei[w] = ej[w];
      i = j;
    }
  }
  hash_entry(c, i)[KEY_WORDS] = 0;
  c->kv_cached--;
}

// ---- blocks --------------------------------------------------------------------------------------
// The front of the free queue, its key evicted, held once.
__device__ int32_t kv_take(SchedCtl* c, uint32_t nb) {
  const int32_t b = c->kv_head;
  q_unlink(c, nb, b);
  uint32_t* k = block_key(c, b);
  if (k[KV_KEYED]) {
    hash_erase(c, k);
    k[KV_KEYED] = 0;
  }
  ((uint32_t*)c->kv_ref)[b] = 1;
  return b;
}

__device__ void kv_release(SchedCtl* c, uint32_t nb, int32_t b) {
  uint32_t& ref = ((uint32_t*)c->kv_ref)[b];
  if (--ref == 0) q_push(c, nb, b, block_key(c, b)[KV_KEYED] != 0);
}

// Thread 0, start of the plan: the blocks rows freed since (each row's tail first, as pushed).
__device__ void kv_drain(SchedCtl* c, uint32_t nb) {
  const uint32_t* p = (const uint32_t*)c->kv_free;
  for (uint32_t i = 0; i < c->kv_pending; ++i) kv_release(c, nb, (int32_t)p[i]);
  c->kv_pending = 0;
}

// Thread 0: n blocks from the free queue into kv_takes[0, n) (n <= kv_free_top), for a parallel
// hand-out by all threads after a barrier.
__device__ void kv_take_n(SchedCtl* c, uint32_t nb, uint32_t n) {
  int32_t* out = (int32_t*)c->kv_takes;
  for (uint32_t i = 0; i < n; ++i) out[i] = kv_take(c, nb);
}

// ---- prefix cache (thread 0) ---------------------------------------------------------------------
// Leading keys of slot `slot` whose blocks are cached, at most `limit`; *idle: how many of those no
// row holds (they leave the free queue when taken).
__device__ uint32_t prefix_match(SchedCtl* c, const Shared& sh, uint32_t slot, uint32_t limit, uint32_t* idle) {
  uint32_t n = 0;
  *idle = 0;
  for (; n < limit; ++n) {
    const int32_t b = hash_find(c, slot_key(c, sh, slot, n));
    if (b < 0) break;
    *idle += ((const uint32_t*)c->kv_ref)[b] == 0;
  }
  return n;
}

// The first n matched blocks (prefix_match said so) into row r's table, a reference taken on each.
__device__ void prefix_take(SchedCtl* c, Shared& sh, uint32_t r, uint32_t n) {
  Row& R = g_rows[r];
  int32_t* t = row_blocks(c, sh, r);
  const uint32_t nb = sh.E->num_kv_blocks;
  for (uint32_t i = 0; i < n; ++i) {
    const int32_t b = hash_find(c, slot_key(c, sh, R.slot, i));
    uint32_t& ref = ((uint32_t*)c->kv_ref)[b];
    if (ref == 0) q_unlink(c, nb, b);
    ref++;
    t[i] = b;
  }
  R.n_blocks = n;
  R.checked = n;
}

// Scheduler._admit's cache part for row r about to be admitted with `len` tokens: the tokens it may
// start from (a multiple of the block size, never the last token's block). 0 without keys.
__device__ uint32_t prefix_hits(SchedCtl* c, const Shared& sh, const Row& R, uint32_t* idle) {
  *idle = 0;
  if (!c->prefix_caching || !R.cache_read || R.n_keys == 0) return 0;
  return prefix_match(c, sh, R.slot, min(R.n_keys, (R.len - 1) / sh.bs), idle);
}

// The row's full blocks among its first `computed` tokens that have keys, registered (first wins).
__device__ void prefix_register(SchedCtl* c, Shared& sh, uint32_t r) {
  Row& R = g_rows[r];
  const uint32_t upto = min(R.n_keys, R.computed / sh.bs);
  const int32_t* t = row_blocks(c, sh, r);
  for (uint32_t i = R.checked; i < upto; ++i) {
    uint32_t* k = block_key(c, (uint32_t)t[i]);
    const uint32_t* key = slot_key(c, sh, R.slot, i);
    if (k[KV_KEYED] || hash_find(c, key) >= 0) continue;
    hash_insert(c, key, (uint32_t)t[i]);
    for (uint32_t w = 0; w < KEY_WORDS; ++w) k[w] = key[w];
    k[KV_KEYED] = 1;
  }
  if (upto > R.checked) R.checked = upto;
}

// Every key forgotten (all threads; the reset doorbell moved). Blocks keep their KV and place.
__device__ void prefix_reset(SchedCtl* c, uint32_t nb) {
  for (uint32_t i = threadIdx.x; i <= c->hash_mask; i += SCHED_THREADS) hash_entry(c, i)[KEY_WORDS] = 0;
  for (uint32_t b = threadIdx.x; b < nb; b += SCHED_THREADS) block_key(c, b)[KV_KEYED] = 0;
  __syncthreads();  // every thread read reset_pending before it is cleared
  if (threadIdx.x == 0) {
    c->kv_cached = 0;
    c->prefix_cache_resets++;
    c->reset_pending = 0;
  }
}
