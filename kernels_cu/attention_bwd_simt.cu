// cuflash: the portable attention backward (SIMT, every dtype, sm_75 and newer).
//
// FlashAttention-2's backward (Dao 2023, Algorithm 2), in three stages selected by the variant:
//
//   CUFLASH_BWD_STAGE 0 (dot):     Dd[i] = rowsum(dO[i] * O[i]) in float32, one warp per row.
//   CUFLASH_BWD_STAGE 1 (main):    one block per (Bc-key tile, kv head, batch). K and V of the tile
//                                  stay in shared memory; the block loops over the query heads that
//                                  share the kv head (GQA) and over the Br-row query tiles that can
//                                  see the tile, recomputing P = exp(S - lse) from Q, K and the
//                                  forward's LSE (never stored), and accumulates
//                                      dV += P^T dO,  dK += scale * dS^T Q   (registers, this block only)
//                                      dQ += dS K                             (float32 workspace, atomicAdd;
//                                                                              see deterministic mode)
//                                  with dS = P * (dO V^T - Dd). dK and dV of a kv head are owned by
//                                  one block, so GQA sums need no atomics.
//   CUFLASH_BWD_STAGE 2 (convert): dq = softmax_scale * dq_accum converted to the input dtype (any
//                                  output strides; the scale is applied once here, not per key tile);
//                                  with num_splits > 1 the per-split partials are summed first, in
//                                  split order 0, 1, ... (a fixed order: deterministic).
//
// Key tiles of a launch: block s of a (kv head, batch) runs key tile tile0 + s, if < tile_end.
// Deterministic mode (run-time, `deterministic` != 0): num_splits blocks per (kv head, batch),
// launched ceil(num_k_tiles / num_splits) times in stream order (tile0 = 0, num_splits, ...);
// block s adds its dQ contributions to its own float32 partial buffer dq_accum + s *
// dq_split_stride (each element gets one add per launch, from one thread, and launches are
// ordered: no unordered atomics, no run-to-run variation); the convert stage
// reduces the partials in a fixed order. The default mode is one launch of one block per key tile
// (num_splits = num_k_tiles) adding into one buffer with atomicAdd. (A loop over key tiles inside
// the block costs this kernel 2x its registers; the tensor-core kernel does not loop either.)
//
// Masks as in the forward (run-time): key j is visible to query i iff j < Sk and
// i + Sk - Sq - window_left <= j <= i + Sk - Sq + window_right (-1 = unbounded side). A row
// whose LSE is -inf saw no key in the forward: its P is 0 (never exp(-inf - -inf)), so it adds
// nothing and its dq stays 0.
//
// Variable-length batches (stage 1, the CUFLASH_VARLEN 1 variants; common.cuh: varlen_seq): the
// block's sequence offsets the base pointers and sets its lengths; Dd and dq_accum are one packed
// sequence of total_q rows. Key tiles past the sequence's keys exit; keys past seqused_k get dK = dV = 0.
//
// Score modifiers (stage 1's CUFLASH_MODS 1 variants; score_mods.cuh), as in the tensor-core
// backward: each visible pair's score is modified as in the forward (softcap, ALiBi, bias, boolean
// mask) before P = exp(z - lse) (the forward's LSE already holds any sink); dS = P (dP - Dd) is the
// gradient of the modified score, written to the float32 dbias workspace when asked (mod_flags &
// 16: each (b, h, i, j) by one thread of one block) and multiplied by the softcap's 1 - tanh^2
// before it meets Q and K.
//
// Dropout (stage 1's CUFLASH_DROPOUT 1 variants; dropout.cuh): with Z a pair's keep bit (the
// forward's) and c = 1 / (1 - p), dV takes P Z c and dS = P (dP Z c - Dd), where Dd = rowsum(dO O)
// of the dropped O.
//
// Variant prelude (cuflash/kernels/attention_bwd_simt.py): CUFLASH_ENTRY, CUFLASH_T, CUFLASH_BWD_STAGE,
// CUFLASH_HEAD_DIM_MAX, CUFLASH_BLOCK_M (Br), CUFLASH_BLOCK_N (Bc), CUFLASH_THREADS,
// CUFLASH_SMEM_BYTES (stage 1's dynamic shared memory; checked below), CUFLASH_MIN_BLOCKS (stage 1),
// CUFLASH_VARLEN, CUFLASH_DROPOUT, CUFLASH_MODS (0/1, stage 1).
#include "common.cuh"
#ifndef CUFLASH_DROPOUT
#define CUFLASH_DROPOUT 0
#endif
#if CUFLASH_DROPOUT
#include "dropout.cuh"
#endif
#include "score_mods.cuh"

typedef CUFLASH_T elem_t;

#define NT CUFLASH_THREADS
#define LOG2E 1.4426950408889634f

#if CUFLASH_BWD_STAGE == 0

// Dd[row] for rows = (batch, head, i) flattened; out and dout with per-tensor strides.
extern "C" __global__ void __launch_bounds__(NT)
CUFLASH_ENTRY(const elem_t* __restrict__ out, const elem_t* __restrict__ dout, float* __restrict__ dd,
              long long o_batch_stride, long long o_head_stride, long long o_row_stride,
              long long do_batch_stride, long long do_head_stride, long long do_row_stride,
              long long num_rows, int num_heads, int seqlen_q, int head_dim_v) {
    const int lane = threadIdx.x & 31;
    const long long row = (long long)blockIdx.x * (NT / 32) + (threadIdx.x >> 5);
    if (row >= num_rows) return;   // whole warps leave together
    const int i = (int)(row % seqlen_q);
    const long long bh = row / seqlen_q;
    const int h = (int)(bh % num_heads);
    const long long b = bh / num_heads;
    const elem_t* o = out + b * o_batch_stride + h * o_head_stride + i * o_row_stride;
    const elem_t* g = dout + b * do_batch_stride + h * do_head_stride + i * do_row_stride;
    float acc = 0.0f;
    for (int c = lane; c < head_dim_v; c += 32) acc = fmaf(to_float(o[c]), to_float(g[c]), acc);
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) acc += __shfl_xor_sync(CUFLASH_FULL_MASK, acc, offset);
    if (lane == 0) dd[row] = acc;
}

#elif CUFLASH_BWD_STAGE == 2

// dq[b, h, i, c] = dq_accum[((b * H + h) * ws_rows + i) * ws_pitch + c], converted to the input
// dtype (ws_rows >= Sq rows per head and ws_pitch >= D: the tensor-core backward's padded workspace;
// the padding is not read). One thread per element of dq (total = B * H * Sq * D).
extern "C" __global__ void __launch_bounds__(NT)
CUFLASH_ENTRY(const float* __restrict__ dq_accum, elem_t* __restrict__ dq,
              long long dq_batch_stride, long long dq_head_stride, long long dq_row_stride,
              long long total, int num_heads, int seqlen_q, int head_dim, int ws_rows, int ws_pitch,
              int num_splits, long long split_stride, float softmax_scale) {
    const long long e = (long long)blockIdx.x * NT + threadIdx.x;
    if (e >= total) return;
    const int c = (int)(e % head_dim);
    const long long row = e / head_dim;
    const int i = (int)(row % seqlen_q);
    const long long bh = row / seqlen_q;
    const int h = (int)(bh % num_heads);
    const long long b = bh / num_heads;
    const long long w = (bh * ws_rows + i) * ws_pitch + c;
    float acc = dq_accum[w];
    for (int s = 1; s < num_splits; ++s) acc += dq_accum[s * split_stride + w];   // fixed order
    dq[b * dq_batch_stride + h * dq_head_stride + i * dq_row_stride + c] = from_float<elem_t>(acc * softmax_scale);
}

#else  // stage 1: the main kernel

#define BR CUFLASH_BLOCK_M
#define BC CUFLASH_BLOCK_N
#define DMAX CUFLASH_HEAD_DIM_MAX
#define ROW (DMAX + 1)                 // padded row of a Q, dO, K or V tile
#define PROW (BC + 1)                  // padded row of P and dS
#define KV_PER_THREAD (BC * DMAX / NT) // dK and dV entries each thread owns
#define SMEM_FLOATS (2 * BC * ROW + 2 * BR * ROW + 2 * BR * PROW + 2 * BR)

static_assert(NT % 32 == 0 && (BC * DMAX) % NT == 0, "the dK/dV tile must split evenly over the threads");
static_assert(SMEM_FLOATS * 4 == CUFLASH_SMEM_BYTES,
              "the variant's shared-memory size (cuflash/kernels/attention_bwd_simt.py) disagrees with this layout");

// CUFLASH_MIN_BLOCKS: the occupancy the register budget aims at (ptxas's own pick spilled a
// little on sm_75 for the 32 bucket). On sm_70 (Volta) ptxas needs 147-229 registers where sm_75+
// fit in 128-168 (at 4 and 3 blocks per SM it spilled 8-528 bytes, NVRTC 12.9): 2 blocks there.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 750
#define BWD_MIN_BLOCKS 2
#else
#define BWD_MIN_BLOCKS CUFLASH_MIN_BLOCKS
#endif
extern "C" __global__ void __launch_bounds__(NT, BWD_MIN_BLOCKS)
CUFLASH_ENTRY(const elem_t* __restrict__ q, const elem_t* __restrict__ k, const elem_t* __restrict__ v,
              const elem_t* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ dd,
              float* __restrict__ dq_accum, elem_t* __restrict__ dk, elem_t* __restrict__ dv,
              long long q_batch_stride, long long q_head_stride, long long q_row_stride,
              long long k_batch_stride, long long k_head_stride, long long k_row_stride,
              long long v_batch_stride, long long v_head_stride, long long v_row_stride,
              long long do_batch_stride, long long do_head_stride, long long do_row_stride,
              long long dk_batch_stride, long long dk_head_stride, long long dk_row_stride,
              long long dv_batch_stride, long long dv_head_stride, long long dv_row_stride,
              long long lse_batch_stride, long long lse_head_stride,
              int num_heads_k, int group_size, int seqlen_q, int seqlen_k, int head_dim, int head_dim_v,
              int num_k_tiles, float softmax_scale, int window_left, int window_right,
              int num_splits, long long dq_split_stride, int deterministic, int tile0, int tile_end,
              const int* __restrict__ cu_seqlens_q, const int* __restrict__ cu_seqlens_k,
              const int* __restrict__ seqused_k, int varlen
#if CUFLASH_DROPOUT
              , unsigned dropout_seed, unsigned dropout_offset, unsigned dropout_threshold, float dropout_scale,
              long long dropout_batch0
#endif
#if CUFLASH_MODS
              , CUFLASH_MODS_PARAMS, float* __restrict__ dbias, long long dbias_batch_stride, long long dbias_head_stride,
              long long dbias_row_stride
#endif
              ) {
    extern __shared__ float smem[];
    float* k_s = smem;                 // [BC][ROW]
    float* v_s = k_s + BC * ROW;       // [BC][ROW]
    float* q_s = v_s + BC * ROW;       // [BR][ROW]
    float* do_s = q_s + BR * ROW;      // [BR][ROW]
    float* p_s = do_s + BR * ROW;      // [BR][PROW]
    float* ds_s = p_s + BR * PROW;     // [BR][PROW]
    float* lse_s = ds_s + BR * PROW;   // [BR], log2 domain
    float* dd_s = lse_s + BR;          // [BR]

    const int tid = threadIdx.x;
    const GridCoord at = grid_coord(num_splits, num_heads_k);
    const int split = at.tile;
    const int tile = tile0 + split;
    if (tile >= tile_end) return;   // the whole block
    float* dq_part = dq_accum + (deterministic ? split * dq_split_stride : 0LL);
    const int head_k = at.head;
    const long long batch = at.batch;
    const int num_heads_q = num_heads_k * group_size;
    // Dd and dq_accum rows: (batch, Hq, stat_rows), or one packed sequence of total_q rows (varlen)
    const int stat_rows = seqlen_q;
    long long stat_batch = batch;
    int stat_q0 = 0, keys = seqlen_k;   // keys: the rows of dK/dV this block may write
    if (CUFLASH_VARLEN) {   // a packed batch: this sequence's rows and lengths (common.cuh)
        const VarlenSeq sq = varlen_seq(batch, varlen, cu_seqlens_q, cu_seqlens_k, seqused_k, seqlen_q, seqlen_k);
        q += sq.q0 * q_row_stride, dout += sq.q0 * do_row_stride, lse += sq.q0;
        k += sq.k0 * k_row_stride, v += sq.k0 * v_row_stride, dk += sq.k0 * dk_row_stride, dv += sq.k0 * dv_row_stride;
        seqlen_q = sq.seqlen_q, seqlen_k = sq.seqlen_k, keys = sq.keys;
        stat_batch = 0, stat_q0 = sq.q0;
    }
    const int col0 = tile * BC;
    if (CUFLASH_VARLEN && col0 >= keys) return;   // a packed sequence shorter than the grid's key tiles (the whole block)
    const int cols = CUFLASH_VARLEN ? max(0, min(BC, seqlen_k - col0)) : min(BC, seqlen_k - col0);   // 0: past seqused_k
    const int store_cols = min(BC, keys - col0);
    const float scale_log2 = softmax_scale * LOG2E;

    load_tile_f32<NT>(k_s, ROW, k + batch * k_batch_stride + head_k * k_head_stride + col0 * k_row_stride, k_row_stride, cols, BC, head_dim);
    load_tile_f32<NT>(v_s, ROW, v + batch * v_batch_stride + head_k * v_head_stride + col0 * v_row_stride, v_row_stride, cols, BC, head_dim_v);

    // Query rows that can see a key of this tile: [row_lo, row_hi).
    const IndexRange rows_seen = window_query_range(col0, cols, seqlen_q, seqlen_k, window_left, window_right);
    const int row_lo = rows_seen.lo, row_hi = (!CUFLASH_VARLEN || cols > 0) ? rows_seen.hi : rows_seen.lo;

    float dk_acc[KV_PER_THREAD], dv_acc[KV_PER_THREAD];
#pragma unroll
    for (int r = 0; r < KV_PER_THREAD; ++r) dk_acc[r] = dv_acc[r] = 0.0f;

#if CUFLASH_MODS
    const ScoreMods mods = CUFLASH_MODS_INIT;
#endif
#if CUFLASH_DROPOUT
    const DropoutArgs dr = {dropout_seed, dropout_offset, dropout_threshold, dropout_scale};
#endif

    for (int hq = head_k * group_size; hq < (head_k + 1) * group_size; ++hq) {
#if CUFLASH_MODS
        const HeadMods hm = head_mods<elem_t>(mods, batch, hq);
        float* dbias_head = dbias + batch * dbias_batch_stride + hq * dbias_head_stride;
#endif
        const elem_t* q_head = q + batch * q_batch_stride + hq * q_head_stride;
        const elem_t* do_head = dout + batch * do_batch_stride + hq * do_head_stride;
        const float* lse_head = lse + batch * lse_batch_stride + hq * lse_head_stride;
        const long long stat_row0 = (stat_batch * num_heads_q + hq) * (long long)stat_rows + stat_q0;   // Dd, dq_accum rows
        for (int row0 = row_lo - (row_lo % BR); row0 < row_hi; row0 += BR) {
            const int rows = min(BR, seqlen_q - row0);
            __syncthreads();   // K/V are loaded; the previous tile's readers are done
            load_tile_f32<NT>(q_s, ROW, q_head + row0 * q_row_stride, q_row_stride, rows, BR, head_dim);
            load_tile_f32<NT>(do_s, ROW, do_head + row0 * do_row_stride, do_row_stride, rows, BR, head_dim_v);
            for (int r = tid; r < BR; r += NT) {
                const float l = r < rows ? lse_head[row0 + r] : CUFLASH_NEG_INF;
                lse_s[r] = l * LOG2E;   // -inf stays -inf
                dd_s[r] = r < rows ? dd[stat_row0 + row0 + r] : 0.0f;
            }
            __syncthreads();

            // P and dS for every (row, key) of the tile.
            for (int e = tid; e < BR * BC; e += NT) {
                const int r = e / BC;
                const int j = e - r * BC;
                const int qi = row0 + r;
                const int kj = col0 + j;
                const IndexRange keys_seen = window_key_range(qi, 1, seqlen_q, seqlen_k, window_left, window_right);
                bool visible = r < rows && j < cols && lse_s[r] != CUFLASH_NEG_INF &&
                               kj >= keys_seen.lo && kj < keys_seen.hi;
#if CUFLASH_MODS
                visible = visible && mask_keeps(mods, hm, qi, kj);
#endif
                float p = 0.0f, ds = 0.0f;
                if (visible) {
                    float s = 0.0f, dp = 0.0f;
                    for (int c = 0; c < head_dim; ++c) s = fmaf(q_s[r * ROW + c], k_s[j * ROW + c], s);
                    for (int c = 0; c < head_dim_v; ++c) dp = fmaf(do_s[r * ROW + c], v_s[j * ROW + c], dp);
                    float z = s * scale_log2;
#if CUFLASH_MODS
                    // the modified score; dS is d/dz, and d/d(scaled score) is dS * dcap
                    float dcap = 1.0f;
                    z = mod_score<elem_t>(mods, hm, z, qi, kj, seqlen_q, seqlen_k, &dcap);
#endif
                    p = exp2f(z - lse_s[r]);
#if CUFLASH_DROPOUT
                    const bool kept = dropout_keep1(dr, (unsigned)(dropout_batch0 + batch), (unsigned)hq, (unsigned)qi,
                                                    (unsigned)kj);
                    ds = p * ((kept ? dp * dropout_scale : 0.0f) - dd_s[r]);
                    p = kept ? p * dropout_scale : 0.0f;   // (dV takes the dropped P)
#else
                    ds = p * (dp - dd_s[r]);
#endif
#if CUFLASH_MODS
                    if (mod_flags & 16) dbias_head[qi * dbias_row_stride + kj] = ds;   // d bias = dS: one writer per pair
                    ds *= dcap;
#endif
                }
                p_s[r * PROW + j] = p;
                ds_s[r * PROW + j] = ds;
            }
            __syncthreads();

            // dV += P^T dO and dK += dS^T Q for the entries this thread owns.
#pragma unroll
            for (int t = 0; t < KV_PER_THREAD; ++t) {
                const int e = tid + t * NT;
                const int j = e / DMAX;
                const int c = e - j * DMAX;
                float sv = 0.0f, sk = 0.0f;
                for (int r = 0; r < rows; ++r) {
                    if (c < head_dim_v) sv = fmaf(p_s[r * PROW + j], do_s[r * ROW + c], sv);
                    if (c < head_dim) sk = fmaf(ds_s[r * PROW + j], q_s[r * ROW + c], sk);
                }
                dv_acc[t] += sv;
                dk_acc[t] += sk;
            }

            // dQ += dS K (the convert stage scales it), accumulated across key tiles (and blocks) with atomics.
            for (int e = tid; e < rows * head_dim; e += NT) {
                const int r = e / head_dim;
                const int c = e - r * head_dim;
                float acc = 0.0f;
                for (int j = 0; j < cols; ++j) acc = fmaf(ds_s[r * PROW + j], k_s[j * ROW + c], acc);
                // deterministic mode: the only add to this element in this launch (launches are
                // ordered), so the atomic's order cannot vary
                atomicAdd(dq_part + (stat_row0 + row0 + r) * head_dim + c, acc);
            }
        }
    }

    // This block owns dK and dV of its key tile and kv head.
    elem_t* dk_tile = dk + batch * dk_batch_stride + head_k * dk_head_stride + col0 * dk_row_stride;
    elem_t* dv_tile = dv + batch * dv_batch_stride + head_k * dv_head_stride + col0 * dv_row_stride;
#pragma unroll
    for (int t = 0; t < KV_PER_THREAD; ++t) {
        const int e = tid + t * NT;
        const int j = e / DMAX;
        const int c = e - j * DMAX;
        if (j < store_cols) {
            if (c < head_dim) dk_tile[j * dk_row_stride + c] = from_float<elem_t>(dk_acc[t] * softmax_scale);
            if (c < head_dim_v) dv_tile[j * dv_row_stride + c] = from_float<elem_t>(dv_acc[t]);
        }
    }
}

#endif
