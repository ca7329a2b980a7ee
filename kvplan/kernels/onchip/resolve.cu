// The on-chip swap-in resolve (docs/kernels.md §2-§3, "The on-chip resolve"): one block per batch row, the row's
// table of wanted tokens, its LRU order and its tail in shared memory. One launch decides everything the Triton
// resolve decides over its prep, insert, place and sort launches: outputs, the filled slots' tokens, the new LRU
// order, the plan (in miss order, or in host-row order with its miss lists in the workspace), miss_count and the
// hits and overflow counters. The plan copy follows in its own launch (kvplan.kernels.copy), as after the Triton
// resolve.
//
// Compiled at first use by NVRTC (kvplan/kernels/onchip/compiler.py) with the call's sizes as constants: the
// prelude the compiler writes declares them (constexpr):
//   THREADS          threads per block (a multiple of 32, <= 1024)
//   S, K, HOT, P     steps (1 single-step), top-k, LRU slots and tail slots per request
//   SPEC             1 on the speculative path
//   BS               the block front end (docs/kernels.md §2a): tokens per block id of top_k_tokens, which then holds
//                    block ids ([B, 1, NB], K = NB * BS); 0: token ids
//   TBS              shared token-table entries (>= 1.5 * next_pow2(S*K), < 32768: occurrence entries are int16)
//   TPS              shared tail-table entries (a power of two >= 2 * P)
//   TOK_DENSE        top_k_tokens rows are dense (occurrence i of a row at offset i; BS > 0: block j of step s at
//                    s * (K / BS) + j): 32-bit offsets instead of the strides' 64-bit products
//   OUT_DENSE        top_k_device_locs rows are dense (occurrence i at offset i)
//   SB, LOG_SB       (SORTED) the sort's block: a power of two >= S*K, and its log2
//   SORTED           the plan goes to the workspace's miss lists and then, sorted by host row, into the plan
//   APART            (SORTED, single-step) the plan stays in miss order; its host-row order goes to workspace words
//   EPOCHS           keep the workspace's epoch words (kvplan.workspace): the share launch that follows reads the
//                    rows' tables as the call's table of host rows
//   SHARE            (SORTED) each plan entry claims its host row in the call's table of host rows here, as the share
//                    launch would after this grid (kvplan.kernels.resolve.share: the same table, entries and
//                    records); the copy, which starts after this grid, checks every record it follows
//   READY            (a plan in miss order) the copy that follows starts per row: each block sets its row's ready
//                    word W_READY to 0 before the copy may launch and to 1 (a release) once its plan and miss_count
//                    are written, and the copy's programs wait for that word (an acquire), not for this grid
//   RPI64, SEQ64     req_pool_indices / seq_lens are int64 (else int32)
//   HAS_NUM_REAL, HAS_COUNTERS
//   CHECK_NEWEST     (single-step) slot HOT serves the newest token unless it names another token (>= 0), else -1
//   W_PADDING        the row word that marks a padding row (kvplan.workspace.PADDING)
//   W_*              int32-word offsets of the workspace regions and row words (kvplan.workspace), WS_TABLE the
//                    row's token-table entries (int64), SIGNATURE the layout's signature, C_HITS/C_OVERFLOW the
//                    counter slots
//
// Every access to a state table is bounded by that table: a request id outside [0, R), tokens outside a row, LRU
// entries outside [0, HOT) and host rows past host_cache_locs take the outcomes kvplan.reference defines.

typedef long long i64;
typedef unsigned int u32;
typedef unsigned long long u64;

#define EMPTY_TOKEN (-1)
#define NO_HOT 0xFFFFFFFFu
#define NO_OCC 0x7FFFFFFF
#define WARPS (THREADS / 32)
#define N_OCC (S * K)
#define IPT ((N_OCC + THREADS - 1) / THREADS)  // occurrences per thread (<= 32: bit masks of a thread's run)
#define HPT ((HOT + THREADS - 1) / THREADS)    // LRU positions per thread (a thread owns a run of them)
#define EPOCH_MASK 0x7FFFFFFF
#define TAG_PERIOD 128
static_assert(!(READY && SORTED), "a sorted plan is published by the launches after the resolve, not per row");
static_assert(!SHARE || (SORTED && EPOCHS), "host rows are claimed from a sorted plan, in tables kept by epochs");

struct Shared {
    int* tab_tok;      // [TBS] token of each entry, EMPTY_TOKEN when free
    int* tab_first;    // [TBS] first occurrence of the entry's token; after the misses are placed, its device row
    u32* tab_hot;      // [TBS] lru position << 16 | slot of the least recently used hot slot holding it
    short* occ_e;      // [N_OCC] each occurrence's entry, -1 when not wanted
    short* old_lru;    // [HOT] the row's lru_slots as read
    short* erank;      // [HOT] an evictable position's rank, or -(1 + its rank among hits)
    short* evict_slot; // [HOT] the m-th evictable position's slot (raw lru value)
    int* tail_tok;     // [TPS] tail table: token
    int* tail_j;       // [TPS] tail table: lowest tail slot holding it with a real row
    int* scan;         // [WARPS + 8] block scans, then the row's counts
    i64* step_len;     // [S] the row's length at each step
};

// The token of occurrence i = s * K + k of a row: read, or (BS > 0) expanded from the block id covering column k; -1
// for a negative id or one whose tokens would pass the int32 range (kvplan.reference.expand_blocks)
__device__ __forceinline__ int token_at(const int* tok_row, i64 tok_s1, i64 tok_s2, int i) {
    const int s = i / K, k = i % K;
    if constexpr (BS > 0) {
        constexpr int BLOCK = BS > 0 ? BS : 1;  // (the branch is compiled for BS = 0 too, though never taken)
        constexpr int LAST = (int)((1LL << 31) / BLOCK - 1);
        const int block = TOK_DENSE ? tok_row[s * (K / BLOCK) + k / BLOCK] : tok_row[s * tok_s1 + (k / BLOCK) * tok_s2];
        return (block >= 0 && block <= LAST) ? block * BLOCK + k % BLOCK : -1;
    } else {
        return TOK_DENSE ? tok_row[i] : tok_row[s * tok_s1 + k * tok_s2];
    }
}

// Where occurrence i = s * K + k of a row outputs its device row
__device__ __forceinline__ int* out_at(int* out_row, i64 out_s1, i64 out_s2, int i) {
    return OUT_DENSE ? out_row + i : out_row + (i / K) * out_s1 + (i % K) * out_s2;
}

// Bitonic sort of WIDTH keys held one per thread by threads [0, WIDTH) (the caller's branch: those threads only),
// ascending by thread; WIDTH a compile-time power of two, so every step's stride and direction are constants.
// Strides below a warp go by shuffles, wider ones through `keys` under barrier 1 of the WIDTH threads.
template <int WIDTH>
__device__ __forceinline__ i64 bitonic_sort(i64 key, i64* keys, int tid) {
#pragma unroll
    for (int size = 2; size <= WIDTH; size <<= 1) {
        const bool up = (tid & size) == 0;
#pragma unroll
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            i64 other;
            if (stride >= 32) {
                keys[tid] = key;
                asm volatile("bar.sync 1, %0;" ::"n"(WIDTH) : "memory");
                other = keys[tid ^ stride];
                asm volatile("bar.sync 1, %0;" ::"n"(WIDTH) : "memory");
            } else {
                other = __shfl_xor_sync(0xFFFFFFFFu, key, stride);
            }
            const bool lower = (tid & stride) == 0;
            // the lower thread of a pair keeps the smaller key in an ascending run, the larger in a descending one
            if (lower == up ? other < key : other > key) key = other;
        }
    }
    return key;
}

__device__ __forceinline__ u32 slot_hash(int token, u32 size) {
    return __umulhi((u32)token * 0x9E3779B1u, size);  // Fibonacci hashing onto [0, size)
}

// Plan entry `offset` (b * plan row stride + its place) claims host row `host` (< HOST_ROW_LIMIT) in the call's table
// of host rows: the `table_rows` rows' workspace tables read as one open-addressing table of table_rows * WS_TABLE
// int64 entries stamp << 55 | host << 24 | offset, each row's part under that row's host-row stamp (its epoch word;
// anything else there is free), exactly as kvplan.kernels.resolve.share._claim_host_rows. Returns the offset of the
// entry that claimed the host row first, or -1 (this entry claimed it, or one pass found no room: it reads the host
// itself). A row whose block has not yet taken its epoch is read under its last one: at worst a host row is read
// twice, or a record names an entry of an earlier call, which the copy checks (the entry it names must hold the same
// host row in this call's plan and read it from the host) and then reads the host instead.
__device__ int claim_host_row(int* ws, i64 ws_stride, int table_rows, i64 host, i64 offset) {
    const u64 total = (u64)table_rows * WS_TABLE;
    u32 mixed = (u32)host * (u32)HASH_LO ^ (u32)(host >> 32) * (u32)HASH_HI;
    mixed ^= mixed >> 15;
    u64 slot = ((u64)mixed * total) >> 32;
    for (u64 probe = 0; probe < total; ++probe) {
        int* row_ws = ws + (i64)(slot / WS_TABLE) * ws_stride;
        const i64 stamp = (i64)(__ldcg(row_ws + W_CURRENT) % TAG_PERIOD) * 2 + 1;
        const i64 key = (stamp << (STAMP_SHIFT - KEY_SHIFT)) | host;
        u64* entry = (u64*)(row_ws + W_KEYS) + (slot % WS_TABLE);
        i64 seen = (i64)__ldcg(entry);
        if ((seen >> STAMP_SHIFT) != stamp) {
            const i64 old = (i64)atomicCAS(entry, (u64)seen, (u64)((key << KEY_SHIFT) | offset));
            if (old == seen) return -1;
            seen = old;  // another entry took it first: its host row, or go on
        }
        if ((seen >> KEY_SHIFT) == key) return (int)(seen & LOW_MASK);
        slot = slot + 1 == total ? 0 : slot + 1;
    }
    return -1;
}

// The row's plan and miss_count published to the copy that waits on its ready word: the block's barrier orders every
// thread's writes before thread 0's release store, which makes them visible with it (every thread calls it)
__device__ __forceinline__ void publish_ready(int* wsr) {
    __syncthreads();
    if (threadIdx.x == 0) asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(wsr + W_READY), "r"(1) : "memory");
}

__device__ __forceinline__ i64 load_index(const void* p, i64 i, int is64) {
    return is64 ? ((const i64*)p)[i] : (i64)((const int*)p)[i];
}

// Exclusive prefix sum of v over the block (every thread calls it); *total gets the sum. Ends with a barrier, so
// the scratch can be reused at once.
__device__ int block_exclusive_scan(int v, int* scratch, int* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int x = v;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        int y = __shfl_up_sync(0xFFFFFFFFu, x, d);
        if (lane >= d) x += y;
    }
    if (lane == 31) scratch[warp] = x;
    __syncthreads();
    if (warp == 0) {
        int w = lane < WARPS ? scratch[lane] : 0;
        int inc = w;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            int y = __shfl_up_sync(0xFFFFFFFFu, inc, d);
            if (lane >= d) inc += y;
        }
        if (lane < WARPS) scratch[lane] = inc - w;
        if (lane == 31) scratch[WARPS] = inc;
    }
    __syncthreads();
    int result = scratch[warp] + x - v;
    *total = scratch[WARPS];
    __syncthreads();
    return result;
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) kvplan_resolve(
    const int* __restrict__ tokens, i64 tok_s0, i64 tok_s1, i64 tok_s2,  // [B, S, K] top_k_tokens
    int* __restrict__ out, i64 out_s0, i64 out_s1, i64 out_s2,           // [B, S, K] top_k_device_locs
    const void* __restrict__ rpi, i64 rpi_stride,                        // [>= B] req_pool_indices
    const void* __restrict__ seq, i64 seq_stride,                        // [>= B*S] seq_lens, request-major
    const int* __restrict__ num_real,                                    // [1] num_real_reqs (HAS_NUM_REAL)
    int batch, int requests,                                             // B, R
    int* __restrict__ dbt, const int* __restrict__ dbl, i64 state_stride,  // [R, HOT + P] tokens, device rows
    short* __restrict__ lru, i64 lru_stride,                             // [R, HOT] lru_slots
    const i64* __restrict__ hcl, i64 hcl_stride, i64 max_len,            // [R, max_len] host_cache_locs
    const int* __restrict__ scratch, i64 scratch_stride, int scratch_cols,  // [R, C] scratch_locs (SPEC)
    i64* __restrict__ miss_src, int* __restrict__ miss_dst, i64 plan_stride,  // [>= B, >= S*K] the plan
    int* __restrict__ miss_count,                                        // [>= B]
    int* __restrict__ ws, i64 ws_stride,                                 // [B, words] the workspace as int32 words
    i64* __restrict__ counters,                                          // [6] (HAS_COUNTERS)
    i64 n_host)                                                          // host_cache rows (SHARE)
{
    extern __shared__ __align__(16) unsigned char smem[];
    Shared sh;
    sh.tab_tok = (int*)smem;
    sh.tab_first = sh.tab_tok + TBS;
    sh.tab_hot = (u32*)(sh.tab_first + TBS);
    sh.tail_tok = (int*)(sh.tab_hot + TBS);
    sh.tail_j = sh.tail_tok + TPS;
    sh.scan = sh.tail_j + TPS;
    sh.step_len = (i64*)(sh.scan + WARPS + 8);  // (WARPS + 8 is even: 8-byte aligned)
    sh.occ_e = (short*)(sh.step_len + S);
    sh.old_lru = sh.occ_e + N_OCC;
    sh.erank = sh.old_lru + HOT;
    sh.evict_slot = sh.erank + HOT;

    const int tid = threadIdx.x;
    const int b = blockIdx.x;
    const i64 b64 = b;
    int* wsr = ws + b64 * ws_stride;
#if __CUDA_ARCH__ >= 900
    // the launch that follows (the share step or the copy) may be scheduled now: it waits for this grid to complete
    // and flush before its first access (griddepcontrol.wait), so only its launch latency overlaps this kernel. READY:
    // the copy waits on the rows' ready words instead, so thread 0 zeroes this row's first (the block's first
    // launch_dependents is its signal): the copy never reads an earlier call's word
    if constexpr (READY) {
        if (tid == 0) {
            wsr[W_READY] = 0;
            __threadfence();
            asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
        }
    } else {
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    }
#else
    if constexpr (READY) {
        if (tid == 0) wsr[W_READY] = 0;  // (no early launch: the copy starts after this grid)
    }
#endif

    // --- the row's tokens first (they need no other load), then its request, whether it is real, its length ----
    const int* tok_row = tokens + b64 * tok_s0;
    int tq[IPT];  // occurrence q * THREADS + tid
#pragma unroll
    for (int q = 0; q < IPT; ++q) {
        const int i = q * THREADS + tid;
        tq[q] = i < N_OCC ? token_at(tok_row, tok_s1, tok_s2, i) : -1;
    }
    int n_real = batch;
    if (HAS_NUM_REAL) n_real = min(max(num_real[0], 0), batch);
    const i64 rid = load_index(rpi, b64 * rpi_stride, RPI64);
    const bool live = b < n_real && rid >= 0 && rid < requests;
    const i64 last_len = load_index(seq, (b64 * S + S - 1) * seq_stride, SEQ64);
    const bool long_row = live && last_len > HOT;

    if (N_OCC > 0) {
        // the row words every copy of the plan reads: no shared entries (a padding row marked: the copies skip its
        // plan row, whatever its count says), the copy's counters at zero
        if (tid < 3) wsr[tid] = (tid == 0 && !live) ? W_PADDING : 0;
        if (tid == 0) { wsr[W_SPAN] = 0; wsr[W_SPAN + 1] = 0; }
    }
    if (EPOCHS && N_OCC > 0) {
        // the row's next epoch; its table emptied when its tags could repeat or its words do not vouch for it
        if (tid == 0) {
            const int fmt = SIGNATURE ^ (int)(ws_stride & 0x3FFFFFFF);
            const int epoch = (wsr[W_EPOCH] + 1) & EPOCH_MASK;
            const int age = (epoch - wsr[W_CLEARED]) & EPOCH_MASK;
            const bool vouched = wsr[W_FORMAT] == fmt && ws[W_FORMAT] == fmt;
            const int empties = (!vouched || age == 0 || age >= TAG_PERIOD) ? 1 : 0;
            wsr[W_CURRENT] = epoch;
            wsr[W_EMPTIES] = empties;
            sh.scan[WARPS + 1] = empties;
        }
        __syncthreads();
        if (sh.scan[WARPS + 1]) {
            i64* keys = (i64*)(wsr + W_KEYS);
            for (int e = tid; e < WS_TABLE; e += THREADS) keys[e] = -1;
        }
        __syncthreads();  // every thread has read the row words before they are rewritten
        if (tid == 0) {
            const int epoch = wsr[W_CURRENT];
            if (wsr[W_EMPTIES]) wsr[W_CLEARED] = epoch;
            wsr[W_EPOCH] = epoch;
            // row 0's format word is read by every block: the share launch that follows writes it
            if (b != 0) wsr[W_FORMAT] = SIGNATURE ^ (int)(ws_stride & 0x3FFFFFFF);
        }
    }

    int* out_row = out + b64 * out_s0;
    if (!live) {
        // padding row (or a request id outside the pool): speculative rows 0 and a zero count, single-step -1
        for (int i = tid; i < N_OCC; i += THREADS) *out_at(out_row, out_s1, out_s2, i) = SPEC ? 0 : -1;
        if (SPEC && tid == 0) miss_count[b] = 0;
        if constexpr (READY) publish_ready(wsr);
        return;
    }
    const int* dbt_row = dbt + rid * state_stride;
    const int* dbl_row = dbl + rid * state_stride;
    if (!long_row || N_OCC == 0) {
        // short row: token t lives at slot t (speculative: any slot of the row; single-step: the first L of K; a
        // block selection: every valid token)
#pragma unroll
        for (int q = 0; q < IPT; ++q) {
            const int i = q * THREADS + tid;
            if (i >= N_OCC) break;
            const i64 t = tq[q];
            const i64 len = SPEC ? load_index(seq, (b64 * S + i / K) * seq_stride, SEQ64) : last_len;
            const bool usable = t >= 0 && t < len && (SPEC ? t < HOT + P : (BS > 0 || (i64)i < last_len));
            *out_at(out_row, out_s1, out_s2, i) = usable ? dbl_row[t] : -1;
        }
        if (tid == 0) miss_count[b] = 0;
        if constexpr (READY) publish_ready(wsr);
        return;
    }

    // --- a long row: its loads issued first (LRU order, the slots' tokens), then the tables emptied -------------
    short* lru_row = lru + rid * lru_stride;
    short lr[HPT];
    int ht[HPT];
#pragma unroll
    for (int q = 0; q < HPT; ++q) {
        const int j = tid * HPT + q;
        lr[q] = j < HOT ? lru_row[j] : (short)-1;
    }
    constexpr bool HOT_AHEAD = HPT <= 4;  // the slots' tokens loaded ahead too (more would spill registers)
    if constexpr (HOT_AHEAD) {
#pragma unroll
        for (int q = 0; q < HPT; ++q) ht[q] = (lr[q] >= 0 && lr[q] < HOT) ? dbt_row[lr[q]] : -1;
    }
    if (SPEC) {
        for (int s = tid; s < S; s += THREADS) sh.step_len[s] = load_index(seq, (b64 * S + s) * seq_stride, SEQ64);
    }
    for (int e = tid; e < TBS; e += THREADS) {
        sh.tab_tok[e] = EMPTY_TOKEN;
        sh.tab_first[e] = NO_OCC;
        sh.tab_hot[e] = NO_HOT;
    }
    if (SPEC) {
        for (int e = tid; e < TPS; e += THREADS) { sh.tail_tok[e] = EMPTY_TOKEN; sh.tail_j[e] = P; }
    }
    if (tid == 0) sh.scan[WARPS + 2] = 0;  // distinct hits
    __syncthreads();
    if (SPEC) {
        // the tail: each token held by a tail slot with a real row, with the lowest such slot
        for (int j = tid; j < P; j += THREADS) {
            const int t = dbt_row[HOT + j];
            if (t >= 0 && dbl_row[HOT + j] >= 0) {
                u32 p = slot_hash(t, TPS);
                while (true) {
                    const int cur = atomicCAS(&sh.tail_tok[p], EMPTY_TOKEN, t);
                    if (cur == EMPTY_TOKEN || cur == t) { atomicMin(&sh.tail_j[p], j); break; }
                    p = (p + 1 == TPS) ? 0 : p + 1;
                }
            }
        }
        __syncthreads();
    }

    // --- occurrences: what needs no table resolved; wanted tokens into the table, each with its first occurrence
    // single-step: the newest token's slot (CHECK_NEWEST: -1 when slot HOT names another token)
    const i64 newest_held = SPEC ? -1 : (i64)dbt_row[HOT];  // (an empty slot, < 0, names no other token)
    const int newest_row = SPEC ? -1 : (!CHECK_NEWEST || newest_held < 0 || newest_held == last_len - 1) ? dbl_row[HOT] : -1;
#pragma unroll
    for (int q = 0; q < IPT; ++q) {
        const int i = q * THREADS + tid;
        if (i >= N_OCC) break;
        const int t = tq[q];
        const i64 len = SPEC ? sh.step_len[i / K] : last_len;
        const bool valid = t >= 0 && (i64)t < len;
        bool resolved = false;
        int pre = -1;
        if (valid) {
            if (SPEC) {
                u32 p = slot_hash(t, TPS);
                while (true) {
                    const int cur = sh.tail_tok[p];
                    if (cur == t) { resolved = true; pre = dbl_row[HOT + sh.tail_j[p]]; break; }
                    if (cur == EMPTY_TOKEN) break;
                    p = (p + 1 == TPS) ? 0 : p + 1;
                }
            } else if ((i64)t == last_len - 1) {
                resolved = true;
                pre = newest_row;
            }
        }
        short entry = -1;
        if (valid && !resolved) {
            u32 p = slot_hash(t, TBS);
            while (true) {
                int cur = sh.tab_tok[p];
                if (cur == EMPTY_TOKEN) cur = atomicCAS(&sh.tab_tok[p], EMPTY_TOKEN, t);
                if (cur == EMPTY_TOKEN || cur == t) { atomicMin(&sh.tab_first[p], i); entry = (short)p; break; }
                p = (p + 1 == TBS) ? 0 : p + 1;
            }
        } else {
            *out_at(out_row, out_s1, out_s2, i) = pre;
        }
        sh.occ_e[i] = entry;
    }
    __syncthreads();

    // --- hot slots in LRU order: hits (the least recently used slot of a token serves it), evictables ranked ---
    // (thread tid owns positions [tid * HPT, tid * HPT + HPT): one scan ranks them all)
    int evictable_here = 0;
    unsigned hit_bits = 0;
#pragma unroll
    for (int q = 0; q < HPT; ++q) {
        const int j = tid * HPT + q;
        if (j >= HOT) break;
        sh.old_lru[j] = lr[q];
        const int t = HOT_AHEAD ? ht[q] : ((lr[q] >= 0 && lr[q] < HOT) ? dbt_row[lr[q]] : -1);
        bool hit = false;
        if (t >= 0) {
            u32 p = slot_hash(t, TBS);
            while (true) {
                const int cur = sh.tab_tok[p];
                if (cur == t) { hit = true; atomicMin(&sh.tab_hot[p], ((u32)j << 16) | (u32)lr[q]); break; }
                if (cur == EMPTY_TOKEN) break;
                p = (p + 1 == TBS) ? 0 : p + 1;
            }
        }
        if (hit) hit_bits |= 1u << q;
        else ++evictable_here;
    }
    int n_evict;
    int rank = block_exclusive_scan(evictable_here, sh.scan, &n_evict);  // (its barriers: every hit recorded)
#pragma unroll
    for (int q = 0; q < HPT; ++q) {
        const int j = tid * HPT + q;
        if (j >= HOT) break;
        if (hit_bits >> q & 1u) {
            sh.erank[j] = (short)(-1 - (j - rank));
        } else {
            sh.erank[j] = (short)rank;
            sh.evict_slot[rank] = lr[q];
            ++rank;
        }
    }

    // --- misses at their first occurrence, ranked in first-occurrence order (blocked: thread tid owns a run) ---
    const int i0 = tid * IPT;
    u32 first_bits = 0, backed_bits = 0;
    int n_backed_here = 0, hits_here = 0;
#pragma unroll
    for (int q = 0; q < IPT; ++q) {
        const int i = i0 + q;
        if (i < N_OCC) {
            const int e = sh.occ_e[i];
            if (e >= 0 && sh.tab_first[e] == i) {
                first_bits |= 1u << q;
                if (sh.tab_hot[e] != NO_HOT) {
                    ++hits_here;
                } else {
                    const int t = sh.tab_tok[e];
                    const i64 host = (i64)t < max_len ? hcl[rid * hcl_stride + t] : -1;
                    if (host >= 0) { backed_bits |= 1u << q; ++n_backed_here; }
                }
            }
        }
    }
    if (hits_here) atomicAdd(&sh.scan[WARPS + 2], hits_here);
    int n_backed;
    int m = block_exclusive_scan(n_backed_here, sh.scan, &n_backed);  // (its barriers order the table reads above)
    const int admitted_n = min(n_backed, n_evict);  // (the scan's barriers also published evict_slot and erank)
    const int placed_n = SPEC ? admitted_n + min(n_backed - admitted_n, scratch_cols) : admitted_n;
    i64* src_to = SORTED ? (i64*)(wsr + W_MISS_HOST) : miss_src + b64 * plan_stride;
    int* dst_to = SORTED ? wsr + W_MISS_LOC : miss_dst + b64 * plan_stride;
    int* dbt_w = dbt + rid * state_stride;
#pragma unroll
    for (int q = 0; q < IPT; ++q) {
        if (!(first_bits >> q & 1u)) continue;
        const int e = sh.occ_e[i0 + q];
        const u32 held = sh.tab_hot[e];
        int loc = -1;
        if (held != NO_HOT) {
            loc = dbl_row[held & 0xFFFFu];
        } else if (backed_bits >> q & 1u) {
            const int t = sh.tab_tok[e];
            const i64 host = hcl[rid * hcl_stride + t];
            bool placed = false;
            if (m < n_evict) {
                const int fill = sh.evict_slot[m];
                if (fill >= 0 && fill < HOT) { loc = dbl_row[fill]; dbt_w[fill] = t; }
                placed = true;
            } else if (SPEC && m - n_evict < scratch_cols) {
                loc = scratch[rid * scratch_stride + (m - n_evict)];
                placed = true;
            }
            if (placed) { src_to[m] = host; dst_to[m] = loc; }
            ++m;
        }
        sh.tab_first[e] = loc;  // the entry's resolution, read by each of its occurrences below
    }
    if (tid == 0) miss_count[b] = placed_n;
    if constexpr (READY) publish_ready(wsr);  // (its barrier also orders the entries' resolutions above)
    else __syncthreads();

    // --- every wanted occurrence outputs its token's row; the LRU order rewritten; the counts -------------------
    for (int i = tid; i < N_OCC; i += THREADS) {
        const int e = sh.occ_e[i];
        if (e >= 0) *out_at(out_row, out_s1, out_s2, i) = sh.tab_first[e];
    }
    for (int j = tid; j < HOT; j += THREADS) {
        const int r = sh.erank[j];
        int to;
        if (r >= 0) to = r >= admitted_n ? r - admitted_n : n_evict - admitted_n + r;  // stale first, then filled
        else to = n_evict + (-1 - r);                                                  // hits last
        lru_row[to] = sh.old_lru[j];
    }
    if (tid == 0) {
        if (HAS_COUNTERS) {
            const int hits = sh.scan[WARPS + 2];
            if (hits > 0) atomicAdd((u64*)&counters[C_HITS], (u64)hits);
            if (n_backed > placed_n) atomicAdd((u64*)&counters[C_OVERFLOW], (u64)(n_backed - placed_n));
        }
    }

    if constexpr (SORTED) {
    // --- the plan in host-row order: a bitonic sort of (host row, miss) keys over the table's memory ----------
    __syncthreads();  // the table is no longer read
    i64* keys = (i64*)sh.tab_tok;  // SB int64 keys fit in tab_tok + tab_first (TBS >= SB)
    const i64* miss_host = (const i64*)(wsr + W_MISS_HOST);
    const int* miss_loc = wsr + W_MISS_LOC;
    int width = 32;
    while (width < placed_n) width <<= 1;
    const i64 limit = (1LL << (62 - LOG_SB)) - 1;
    const i64 unused = 0x7FFFFFFFFFFFFFFFLL;  // sorts last
    if (width <= THREADS) {
        // one key per thread, sorted by the threads below width (each width its own unrolled build)
        i64 key = unused;
        if (tid < placed_n) key = (min(max(miss_host[tid], 0LL), limit) << LOG_SB) | tid;
        if (tid < width) {
            switch (width) {
                case 32: key = bitonic_sort<32>(key, keys, tid); break;
                case 64: key = bitonic_sort<64>(key, keys, tid); break;
                case 128: key = bitonic_sort<128>(key, keys, tid); break;
                case 256: if constexpr (THREADS >= 256) key = bitonic_sort<256>(key, keys, tid); break;
                case 512: if constexpr (THREADS >= 512) key = bitonic_sort<512>(key, keys, tid); break;
                default: if constexpr (THREADS >= 1024) key = bitonic_sort<1024>(key, keys, tid); break;
            }
            keys[tid] = key;
        }
        __syncthreads();
    } else {
        for (int q = tid; q < width; q += THREADS)
            keys[q] = q < placed_n ? (min(max(miss_host[q], 0LL), limit) << LOG_SB) | q : unused;
        __syncthreads();
        for (int size = 2; size <= width; size <<= 1) {
            for (int stride = size >> 1; stride > 0; stride >>= 1) {
                for (int q = tid; q < width; q += THREADS) {
                    const int other = q ^ stride;
                    if (other > q) {
                        const i64 x = keys[q], y = keys[other];
                        const bool up = (q & size) == 0;
                        if ((x > y) == up) { keys[q] = y; keys[other] = x; }
                    }
                }
                __syncthreads();
            }
        }
    }
    i64* plan_src = miss_src + b64 * plan_stride;
    int* plan_dst = miss_dst + b64 * plan_stride;
    int n_shared = 0;
    u32 near = 0, far = 0;  // the span words: HOST_ROW_LIMIT - lowest usable host row, highest + 1
    for (int pos = tid; pos < placed_n; pos += THREADS) {
        const int which = (int)(keys[pos] & (SB - 1));
        const i64 host = miss_host[which];
        if (APART) {
            // the plan in miss order; its host-row order in words the resolve is done with, each miss's place in
            // that order in the old_lru words (kvplan.kernels.hisparse: the share launch and the copy read them)
            plan_src[pos] = miss_host[pos];
            plan_dst[pos] = miss_loc[pos];
            ((i64*)(wsr + W_HOT))[pos] = host;
            wsr[W_OCC_ENTRY + pos] = miss_loc[which];
            wsr[W_OLD_LRU + which] = pos;
        } else {
            plan_src[pos] = host;
            plan_dst[pos] = miss_loc[which];
        }
        if constexpr (SHARE) {
            // the entry's record: the plan entry that claimed its host row first, or -1 (it reads the host); APART:
            // the same record at its place in host-row order, in the miss ranks' words, which the copy walks
            const int entry = APART ? which : pos;
            const bool usable = host >= 0 && host < n_host;
            const int owner = usable ? claim_host_row(ws, ws_stride, batch, host, b64 * plan_stride + entry) : -1;
            wsr[W_SHARED_FROM + entry] = owner;
            if (APART) wsr[W_MISS_RANK + pos] = owner;
            n_shared += owner >= 0;
            if (usable) {
                near = max(near, (u32)(HOST_ROW_LIMIT - host));
                far = max(far, (u32)(host + 1));
            }
        }
    }
    if constexpr (SHARE) {
        // the row words the copy reads: its entries that share, the span of its host rows (zeroed as the block began)
        n_shared = __reduce_add_sync(0xFFFFFFFFu, n_shared);
        near = __reduce_max_sync(0xFFFFFFFFu, near);
        far = __reduce_max_sync(0xFFFFFFFFu, far);
        if ((tid & 31) == 0) {
            if (n_shared) atomicAdd(&wsr[0], n_shared);
            if (far) { atomicMax((u32*)&wsr[W_SPAN], near); atomicMax((u32*)&wsr[W_SPAN + 1], far); }
        }
    }
    }
}
