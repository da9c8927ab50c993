// cuflash: the portable attention forward (SIMT, every dtype, sm_75 and newer).
//
// The textbook fused forward, corrected (docs/kernels.md, "Corrections to the textbook algorithm"):
// one thread block per (Br-row query tile,
// query head, batch); K and V tiles of Bc rows are streamed through shared memory; each query
// row keeps a running maximum m and a running sum l (FlashAttention-2, Dao 2023, Algorithm 1)
// and a float32 accumulator rescaled by exp(m_old - m_new); O is divided by l once, after the
// K/V loop. Scores are kept in the log2 domain (softmax_scale * log2(e) folded into one factor,
// exp2f for the exponentials); the natural-log LSE is m * ln(2) + ln(l).
//
// Masks (run-time): key j is visible to query i iff j < Sk and
//     i + Sk - Sq - window_left <= j <= i + Sk - Sq + window_right   (-1 = unbounded side),
// which is the bottom-right causal mask when window_right = 0. K/V tiles that no row of the
// block can see are never loaded. A row that sees no key keeps m = -inf; it shifts by 0 instead
// of m so exp2f(-inf) = 0 adds nothing (no -inf - -inf = NaN), and it writes O = 0, LSE = -inf.
//
// Work split inside a block of NT threads: TPR = NT / Br consecutive threads own one query row.
// Each computes Bc / TPR of the row's scores (in registers), the group reduces max and sum with
// __shfl_xor_sync, writes P to shared memory, and each thread accumulates Dmax / TPR columns of
// the row's output. Shared memory holds Q (Br x D), one K-or-V tile (Bc x max(D, Dv)) and P
// (Br x Bc), as float32, rows padded by one float against bank conflicts.
//
// Only elements inside the views are read: rows >= Sq, keys >= Sk and columns >= D / Dv are
// never loaded (their shared-memory slots are zero-filled). Offsets are 64-bit. The grid is 1-D
// (blockIdx.x = tile + num_q_tiles * (head + Hq * batch)), so gridDim.y/z never limit B*H.
//
// Score modifiers (the CUFLASH_MODS 1 variants; score_mods.cuh): softcap, ALiBi, the additive
// bias and the boolean mask act on each visible pair's scaled score before the softmax, as in the
// tensor-core kernel; the sink joins each row's denominator at the epilogue (sink_fold).
//
// Dropout (the CUFLASH_DROPOUT 1 variants; dropout.cuh): the row sums (and so the LSE) are the
// undropped softmax's; each P element stored for P V is zeroed unless the Philox draw of its pair
// (batch, head, row, key) passes the threshold, and survivors are scaled by 1 / (1 - p): the same
// keep bits as every other tier and the NumPy path. A thread's keys are strided over the row's
// threads, so each pair is drawn on its own (dropout_keep1: one Philox call per pair).
//
// Variant prelude (cuflash/kernels/attention_fwd_simt.py: AttentionFwdSimt.defines()):
//   CUFLASH_ENTRY, CUFLASH_T (float, __half, __nv_bfloat16), CUFLASH_HEAD_DIM_MAX (bucket of
//   max(D, Dv)), CUFLASH_BLOCK_M (Br), CUFLASH_BLOCK_N (Bc), CUFLASH_THREADS (NT),
//   CUFLASH_SMEM_BYTES (the dynamic shared memory the launcher provides; checked below),
//   CUFLASH_VARLEN, CUFLASH_DROPOUT, CUFLASH_MODS (0/1).
#include "ptx.cuh"   // (and common.cuh)
#ifndef CUFLASH_DROPOUT
#define CUFLASH_DROPOUT 0
#endif
#if CUFLASH_DROPOUT
#include "dropout.cuh"
#endif
#include "score_mods.cuh"
// __launch_bounds__' minimum blocks per SM: 0 (none) for the plain forms; 1 for the modifier and
// dropout forms, whose per-pair code NVRTC 13's ptxas otherwise fits in 96 registers with 20-96
// bytes of spills (d128, sm_75 to sm_90); with 1 it takes about 140 and spills nothing. Also 1 on
// sm_70 (Volta), where NVRTC 12.9 spilled 20-48 bytes in 64-72 registers (packed forms, d32/d64).
#if CUFLASH_MODS || CUFLASH_DROPOUT || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 750)
#define FWD_MIN_BLOCKS 1
#else
#define FWD_MIN_BLOCKS 0
#endif

typedef CUFLASH_T elem_t;

#define BR CUFLASH_BLOCK_M
#define BC CUFLASH_BLOCK_N
#define DMAX CUFLASH_HEAD_DIM_MAX
#define NT CUFLASH_THREADS
#define TPR (NT / BR)
#define COLS_PER_THREAD (BC / TPR)
#define DV_PER_THREAD (DMAX / TPR)
#define Q_STRIDE (DMAX + 1)
#define KV_STRIDE (DMAX + 1)
#define P_STRIDE (BC + 1)
#define SMEM_FLOATS (BR * Q_STRIDE + BC * KV_STRIDE + BR * P_STRIDE)
#define LN2 0.6931471805599453f

static_assert(NT % 32 == 0 && NT % BR == 0, "threads must be whole warps and a multiple of Br");
static_assert(TPR >= 1 && TPR <= 32 && (TPR & (TPR - 1)) == 0, "threads per row must be a power of two <= 32");
static_assert(BC % TPR == 0 && DMAX % TPR == 0, "Bc and the head-dim bucket must split evenly over a row's threads");
static_assert(SMEM_FLOATS * 4 == CUFLASH_SMEM_BYTES,
              "the variant's shared-memory size (cuflash/kernels/attention_fwd_simt.py) disagrees with this layout");

// Reduce over the TPR consecutive lanes that own one row.
__device__ __forceinline__ float row_group_max(float x) {
#pragma unroll
    for (int offset = TPR / 2; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(CUFLASH_FULL_MASK, x, offset));
    return x;
}

__device__ __forceinline__ float row_group_sum(float x) {
#pragma unroll
    for (int offset = TPR / 2; offset > 0; offset >>= 1) x += __shfl_xor_sync(CUFLASH_FULL_MASK, x, offset);
    return x;
}

extern "C" __global__ void __launch_bounds__(NT, FWD_MIN_BLOCKS)
CUFLASH_ENTRY(const elem_t* __restrict__ q, const elem_t* __restrict__ k, const elem_t* __restrict__ v,
              elem_t* __restrict__ out, float* __restrict__ lse,
              long long q_batch_stride, long long q_head_stride, long long q_row_stride,
              long long k_batch_stride, long long k_head_stride, long long k_row_stride,
              long long v_batch_stride, long long v_head_stride, long long v_row_stride,
              long long o_batch_stride, long long o_head_stride, long long o_row_stride,
              long long lse_batch_stride, long long lse_head_stride,
              int num_heads_q, int group_size, int seqlen_q, int seqlen_k, int head_dim, int head_dim_v,
              int num_q_tiles, float scale_log2, int window_left, int window_right,
              const int* __restrict__ cu_seqlens_q, const int* __restrict__ cu_seqlens_k,
              const int* __restrict__ seqused_k, int varlen
#if CUFLASH_DROPOUT
              , unsigned dropout_seed, unsigned dropout_offset, unsigned dropout_threshold, float dropout_scale,
              long long dropout_batch0
#endif
#if CUFLASH_MODS
              , CUFLASH_MODS_PARAMS
#endif
              ) {
    extern __shared__ float smem[];
    float* q_s = smem;                    // [BR][Q_STRIDE]
    float* kv_s = q_s + BR * Q_STRIDE;    // [BC][KV_STRIDE], K then V
    float* p_s = kv_s + BC * KV_STRIDE;   // [BR][P_STRIDE]

    const int tid = threadIdx.x;
    const int row = tid / TPR;            // this thread's row within the tile
    const int sub = tid % TPR;            // its place among the row's threads
    const GridCoord at = grid_coord(num_q_tiles, num_heads_q);
    const int tile = at.tile, head = at.head;
    const long long batch = at.batch;
    const int head_k = head / group_size;
    const int total_q = seqlen_q;
    int k0 = 0;   // packed: the sequence's first key row
    if (CUFLASH_VARLEN) {   // a packed batch: this sequence's rows and lengths (common.cuh)
        const VarlenSeq sq = varlen_seq_uniform(batch, varlen, cu_seqlens_q, cu_seqlens_k, seqused_k, seqlen_q, seqlen_k);
        q += sq.q0 * q_row_stride, k0 = sq.k0;
        seqlen_q = sq.seqlen_q, seqlen_k = sq.seqlen_k;   // out and lse move at the end
    }

    const int row0 = tile * BR;
    const int rows = min(BR, seqlen_q - row0);
    if (CUFLASH_VARLEN && rows <= 0) return;   // a packed sequence shorter than the grid's tiles (the whole block)
    const int qi = row0 + row;            // query index of this thread's row
    const IndexRange row_keys = window_key_range(qi, 1, seqlen_q, seqlen_k, window_left, window_right);   // the keys it sees

    const elem_t* q_tile = q + batch * q_batch_stride + head * q_head_stride + row0 * q_row_stride;
    const elem_t* k_head = k + batch * k_batch_stride + head_k * k_head_stride;
    const elem_t* v_head = v + batch * v_batch_stride + head_k * v_head_stride;

    // Keys any row of this tile can see: [kv_lo, kv_hi).
    const IndexRange keys = window_key_range(row0, rows, seqlen_q, seqlen_k, window_left, window_right);
    const int kv_lo = keys.lo, kv_hi = keys.hi;

    load_tile_f32<NT>(q_s, Q_STRIDE, q_tile, q_row_stride, rows, BR, head_dim);

#if CUFLASH_MODS
    const ScoreMods mods = CUFLASH_MODS_INIT;
    const HeadMods hm = head_mods<elem_t>(mods, batch, head);   // this row's (batch, head)
#endif
#if CUFLASH_DROPOUT
    const DropoutArgs dr = {dropout_seed, dropout_offset, dropout_threshold, dropout_scale};
#endif

    float m = CUFLASH_NEG_INF;   // running max of the row's scores (log2 domain)
    float l = 0.0f;              // running sum of exp2(score - m)
    float acc[DV_PER_THREAD];
#pragma unroll
    for (int c = 0; c < DV_PER_THREAD; ++c) acc[c] = 0.0f;

    for (int kv0 = kv_lo; kv0 < kv_hi; kv0 += BC) {
        const int cols = min(BC, kv_hi - kv0);
        __syncthreads();   // Q is in place; the previous tile's readers of kv_s and p_s are done
        load_tile_f32<NT>(kv_s, KV_STRIDE, k_head + (k0 + kv0) * k_row_stride, k_row_stride, cols, BC, head_dim);
        __syncthreads();

        float s[COLS_PER_THREAD];
#pragma unroll
        for (int c = 0; c < COLS_PER_THREAD; ++c) s[c] = 0.0f;
        const float* q_row = q_s + row * Q_STRIDE;
        for (int d = 0; d < head_dim; ++d) {
            const float qd = q_row[d];
#pragma unroll
            for (int c = 0; c < COLS_PER_THREAD; ++c) s[c] = fmaf(qd, kv_s[(sub + c * TPR) * KV_STRIDE + d], s[c]);
        }
        float tile_max = CUFLASH_NEG_INF;
#pragma unroll
        for (int c = 0; c < COLS_PER_THREAD; ++c) {
            const int j = sub + c * TPR;
            const int kj = kv0 + j;
            const bool visible = j < cols && kj >= row_keys.lo && kj < row_keys.hi;
#if CUFLASH_MODS
            // softcap, ALiBi, bias and the boolean mask (score_mods.cuh), on the pairs the window lets
            // through (a row past the sequence reads no modifier)
            s[c] = visible && row < rows ? mod_score<elem_t>(mods, hm, s[c] * scale_log2, qi, kj, seqlen_q, seqlen_k)
                                         : CUFLASH_NEG_INF;
#else
            s[c] = visible ? s[c] * scale_log2 : CUFLASH_NEG_INF;
#endif
            tile_max = fmaxf(tile_max, s[c]);
        }
        const float m_new = fmaxf(m, row_group_max(tile_max));
        const float shift = m_new == CUFLASH_NEG_INF ? 0.0f : m_new;
        const float alpha = exp2f(m - shift);
        float tile_sum = 0.0f;
#pragma unroll
        for (int c = 0; c < COLS_PER_THREAD; ++c) {
            const float p = exp2f(s[c] - shift);
#if CUFLASH_DROPOUT
            // the row sum takes p, P V the dropped p (dropout.cuh: the pair's keep bit)
            const int j = sub + c * TPR;
            const bool kept = j < cols && dropout_keep1(dr, (unsigned)(dropout_batch0 + batch), (unsigned)head,
                                                        (unsigned)qi, (unsigned)(kv0 + j));
            p_s[row * P_STRIDE + j] = kept ? p * dropout_scale : 0.0f;
#else
            p_s[row * P_STRIDE + sub + c * TPR] = p;
#endif
            tile_sum += p;
        }
        l = l * alpha + row_group_sum(tile_sum);
        m = m_new;
#pragma unroll
        for (int c = 0; c < DV_PER_THREAD; ++c) acc[c] *= alpha;

        __syncthreads();   // every K read is done and P is written
        load_tile_f32<NT>(kv_s, KV_STRIDE, v_head + (k0 + kv0) * v_row_stride, v_row_stride, cols, BC, head_dim_v);
        __syncthreads();

        for (int j = 0; j < cols; ++j) {
            const float p = p_s[row * P_STRIDE + j];
            const float* v_row = kv_s + j * KV_STRIDE;
#pragma unroll
            for (int c = 0; c < DV_PER_THREAD; ++c) {
                const int d = sub + c * TPR;
                if (d < head_dim_v) acc[c] = fmaf(p, v_row[d], acc[c]);
            }
        }
    }

    if (CUFLASH_VARLEN) {   // the sequence's first row, read again (not held across the loop)
        const int q0 = clamp_index(cu_seqlens_q[ptx_opaque(static_cast<int>(batch))], 0, total_q);
        out += q0 * o_row_stride, lse += q0;
    }
    if (row < rows) {
        float c_sink = 1.0f;   // the sink's share of the row (score_mods.cuh: sink_fold)
#if CUFLASH_MODS
        c_sink = sink_fold(mods, head, m, l);
#endif
        const float inv_l = l != 0.0f ? c_sink / l : 0.0f;   // l == 0: no key (O = 0); NaN l stays NaN
        elem_t* o_row = out + batch * o_batch_stride + head * o_head_stride + qi * o_row_stride;
#pragma unroll
        for (int c = 0; c < DV_PER_THREAD; ++c) {
            const int d = sub + c * TPR;
            if (d < head_dim_v) o_row[d] = from_float<elem_t>(acc[c] * inv_l);
        }
        if (sub == 0) {
            lse[batch * lse_batch_stride + head * lse_head_stride + qi] =
                l != 0.0f ? m * LN2 + logf(l) : CUFLASH_NEG_INF;
        }
    }
}
