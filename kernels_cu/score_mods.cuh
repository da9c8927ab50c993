// cuflash: the score modifiers of docs/conventions.md, "Score modifiers" on the device, shared by the kernels' CUFLASH_MODS
// variants (a call with no modifier runs the variants without them, whose code is unchanged).
//
// Order (docs/conventions.md, "Score modifiers"): scale, softcap, ALiBi and the additive bias, a traced score_mod, the
// boolean mask and a traced mask_mod (then the causal / window mask, then the softmax). Every modifier is a run-time argument, off when its
// value says so (softcap 0, a null pointer):
//   softcap  s <- softcap * tanh(s / softcap)                         (Gemma 2, Riviere et al. 2024)
//   ALiBi    s <- s - slope(b, h) * |i + Sk - Sq - j|                 (Press et al. 2022, bottom-right)
//   bias     s <- s + bias[b, h, i, j]   (strides in elements, 0 on a broadcast axis; q's dtype or f32)
//   mask     s <- -inf where mask[b, h, i, j] == 0  (bool, True = attend, SDPA's meaning)
//   sinks    a logit per head that joins each row's softmax denominator (attends to nothing):
//            applied once, at the epilogue (sink_fold)
// The kernels keep scores in the log2 domain (x = s * scale * log2 e), so a modifier is applied to
// x with its constants scaled by log2 e: softcap * log2 e * tanh(x / (softcap * log2 e)) is
// softcap * tanh(s * scale / softcap) * log2 e exactly (in real arithmetic).
#pragma once

#include "common.cuh"

#ifndef CUFLASH_MODS
#define CUFLASH_MODS 0
#endif

// A traced score_mod / mask_mod (cuflash/runtime/score_mod.py) as one more compile-time choice:
// CUFLASH_USER_MOD bit 1 defines CUFLASH_SCORE_MOD(score, b, h, q_idx, kv_idx, A), bit 2
// CUFLASH_MASK_MOD(b, h, q_idx, kv_idx, A), each one C expression emitted from the traced tree, and in
// the backward CUFLASH_SCORE_MOD_GRAD (d score_mod / d score, which mod_score folds into *dcap)
// (the variant's prelude; its name carries a hash of the two). `score` is in natural units (the
// scaled score after softcap, ALiBi and bias), b the flattened batch index, h the query head,
// q_idx / kv_idx the row of q and of k; their captured arrays are run-time arguments (A.p[n]
// with element strides A.s[n][axis]), so new values need no new compile.
#ifndef CUFLASH_USER_MOD
#define CUFLASH_USER_MOD 0
#endif
#if CUFLASH_USER_MOD
#define CUFLASH_LN2 0.6931471805599453f
struct UserArrays {
    const void* p[4];
    long long s[4][3];
    long long batch0;   // the launch's first batch in the flattened batch index
};
// Python's floor division and modulo, and NumPy's NaN-propagating minimum / maximum.
__device__ __forceinline__ long long cuflash_floordiv_ll(long long a, long long b) {
    const long long q = a / b;
    return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
__device__ __forceinline__ long long cuflash_mod_ll(long long a, long long b) {
    const long long r = a % b;
    return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
__device__ __forceinline__ long long cuflash_abs_ll(long long a) { return a < 0 ? -a : a; }
__device__ __forceinline__ long long cuflash_min_ll(long long a, long long b) { return a < b ? a : b; }
__device__ __forceinline__ long long cuflash_max_ll(long long a, long long b) { return a > b ? a : b; }
__device__ __forceinline__ float cuflash_min_f(float a, float b) { return (a != a || b != b) ? a + b : fminf(a, b); }
__device__ __forceinline__ float cuflash_max_f(float a, float b) { return (a != a || b != b) ? a + b : fmaxf(a, b); }
#define CUFLASH_USER_PARAMS                                                                                       \
    , const void* __restrict__ user_a0, const void* __restrict__ user_a1, const void* __restrict__ user_a2,        \
        const void* __restrict__ user_a3, long long user_s00, long long user_s01, long long user_s02,              \
        long long user_s10, long long user_s11, long long user_s12, long long user_s20, long long user_s21,         \
        long long user_s22, long long user_s30, long long user_s31, long long user_s32, long long user_batch0
#define CUFLASH_USER_INIT                                                                                         \
    , UserArrays{{user_a0, user_a1, user_a2, user_a3},                                                            \
                 {{user_s00, user_s01, user_s02}, {user_s10, user_s11, user_s12}, {user_s20, user_s21, user_s22},   \
                  {user_s30, user_s31, user_s32}},                                                                \
                 user_batch0}
#else
#define CUFLASH_USER_PARAMS
#define CUFLASH_USER_INIT
#endif
// The backward's gradients of a traced score_mod's captured float arrays (CUFLASH_USER_MOD bit 4):
// CUFLASH_SCORE_MOD_ARRAY_GRAD(score, b, h, q_idx, kv_idx, A, G, ds, U) takes, per float read of a
// captured array, ds * d score_mod / d read (at the pair's score), ds being the gradient of score_mod's
// result for the pair (the kernel's dS before the score_mod's and softcap's derivatives), and adds it
// into that array's float32 workspace G.p[n] (element strides G.s[n][axis]) with atomicAdd; a read
// whose index depends on b and h only (the same for the whole tile) sums it into the register U[u]
// instead, and CUFLASH_SCORE_MOD_ARRAY_GRAD_WARP(b, h, A, G, U) adds each U[u], summed across the
// warp, once per warp and tile (cuflash/runtime/score_mod.py: array_grad_c). The float adds' order
// varies from run to run; with deterministic=True the tensor-core backward builds the exact form
// (CUFLASH_AGRAD_EXACT in attention_bwd_mma.cu), whose overloads of these adds sum integers exactly.
#if CUFLASH_USER_MOD & 4
struct UserGrads {
    float* p[4];
    long long s[4][3];
};
// v summed over the warp's 32 lanes (all of them call it), added to *p by lane 0 (nothing for 0).
__device__ __forceinline__ void cuflash_warp_atomic_add(float* p, float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(CUFLASH_FULL_MASK, v, o);
    if ((threadIdx.x & 31) == 0 && v != 0.0f) atomicAdd(p, v);
}
#define CUFLASH_AGRAD_PARAMS                                                                                      \
    , float* __restrict__ user_g0, float* __restrict__ user_g1, float* __restrict__ user_g2,                      \
        float* __restrict__ user_g3, long long user_gs00, long long user_gs01, long long user_gs02,               \
        long long user_gs10, long long user_gs11, long long user_gs12, long long user_gs20, long long user_gs21,  \
        long long user_gs22, long long user_gs30, long long user_gs31, long long user_gs32
#define CUFLASH_AGRAD_INIT                                                                                        \
    UserGrads{{user_g0, user_g1, user_g2, user_g3},                                                               \
              {{user_gs00, user_gs01, user_gs02}, {user_gs10, user_gs11, user_gs12}, {user_gs20, user_gs21, user_gs22}, \
               {user_gs30, user_gs31, user_gs32}}}
#else
#define CUFLASH_AGRAD_PARAMS
#endif

// A block-sparse mask (cuflash.create_block_mask; the CUFLASH_BLOCK_SPARSE 1 variants, which have a
// traced mask_mod): per (batch, head, outer block) the inner blocks a tile loop visits, partial ones
// (bs_num / bs_idx: mask_mod evaluated per pair) and full ones (bs_full_num / bs_full_idx: run without
// it); empty blocks are not listed, so never visited. The forward's outer blocks are query blocks of
// bs_outer rows and its inner ones key blocks of bs_inner keys (the block mask's kv_* index); the
// backward's are the transposed index (q_*: key blocks, and the query blocks that see each). Counts
// are (B, H, outer) and indices (B, H, outer, entries) int32, strides in elements (0 on a broadcast
// batch or head axis); the batch index is user_batch0 + the launch's batch. bs_counts (the simulator
// only, when bs_count is 1) gets each block's tiles entered: [2 blockIdx.x] partial, [2 blockIdx.x + 1] full.
#ifndef CUFLASH_BLOCK_SPARSE
#define CUFLASH_BLOCK_SPARSE 0
#endif
#if CUFLASH_BLOCK_SPARSE
static_assert(CUFLASH_USER_MOD & 2, "a block-sparse variant has a traced mask_mod");
#define CUFLASH_BSPARSE_PARAMS                                                                                    \
    , const int* __restrict__ bs_num, const int* __restrict__ bs_idx, const int* __restrict__ bs_full_num,        \
        const int* __restrict__ bs_full_idx, long long bs_num_bs, long long bs_num_hs, long long bs_idx_bs,       \
        long long bs_idx_hs, long long bs_idx_rs, int bs_outer, int bs_inner, int* __restrict__ bs_counts, int bs_count
#else
#define CUFLASH_BSPARSE_PARAMS
#endif

// The kernel parameters of the modifiers (appended to an entry's signature in CUFLASH_MODS
// variants). mod_flags says which are on: 1 ALiBi, 2 bias, 4 mask, 8 sinks (the pointers of the
// others point at an empty array and are never read); softcap 0 is off.
#define CUFLASH_MODS_PARAMS                                                                                 \
    int mod_flags, float softcap, const float* __restrict__ alibi_slopes, long long alibi_batch_stride,     \
        long long alibi_head_stride,                                                                        \
        const void* __restrict__ attn_bias, int bias_f32, long long bias_batch_stride,                      \
        long long bias_head_stride, long long bias_row_stride, long long bias_col_stride,                   \
        const unsigned char* __restrict__ attn_mask, long long mask_batch_stride, long long mask_head_stride, \
        long long mask_row_stride, long long mask_col_stride, const float* __restrict__ sinks,                    \
        long long sinks_stride CUFLASH_USER_PARAMS CUFLASH_BSPARSE_PARAMS CUFLASH_AGRAD_PARAMS

#define CUFLASH_MODS_INIT                                                                                  \
    ScoreMods{softcap * CUFLASH_LOG2E, (mod_flags & 1) ? alibi_slopes : nullptr, alibi_batch_stride,      \
              alibi_head_stride,                                                                            \
              (mod_flags & 2) ? attn_bias : nullptr, bias_f32,                                              \
              {bias_batch_stride, bias_head_stride, bias_row_stride, bias_col_stride},                      \
              (mod_flags & 4) ? attn_mask : nullptr,                                                        \
              {mask_batch_stride, mask_head_stride, mask_row_stride, mask_col_stride},                      \
              (mod_flags & 8) ? sinks : nullptr, sinks_stride CUFLASH_USER_INIT}

struct ScoreMods {
    float cap;                       // softcap * log2 e (0: off)
    const float* alibi;              // slope of (b, h) at alibi[b * alibi_bs + h * alibi_hs]; null: off
    long long alibi_bs, alibi_hs;
    const void* bias;                // null: off
    int bias_f32;                    // 1: float32, 0: the kernel's 16-bit elem type
    long long bias_s[4];
    const unsigned char* mask;       // null: off
    long long mask_s[4];
    const float* sinks;              // sink of head h at sinks[h * sinks_s]; null: off
    long long sinks_s;
#if CUFLASH_USER_MOD
    UserArrays user;                 // the traced functions' captured arrays
#endif
};

// One (batch, head)'s share of the modifiers: pointers moved to the head, the slope in log2 units.
struct HeadMods {
    float cap, slope;                // softcap * log2 e (0: off); slope * log2 e (0: no ALiBi)
    const void* bias;
    const unsigned char* mask;
#if CUFLASH_USER_MOD
    long long b;                     // the flattened batch index and the query head, for the traced functions
    int h;
#endif
};

template <class T>
__device__ __forceinline__ HeadMods head_mods(const ScoreMods& m, long long b, int h) {
    HeadMods r;
    r.cap = m.cap;
    r.slope = m.alibi ? m.alibi[b * m.alibi_bs + h * m.alibi_hs] * CUFLASH_LOG2E : 0.0f;
    const long long bo = b * m.bias_s[0] + h * m.bias_s[1];
    r.bias = !m.bias ? nullptr
                     : m.bias_f32 ? static_cast<const void*>(static_cast<const float*>(m.bias) + bo)
                                  : static_cast<const void*>(static_cast<const T*>(m.bias) + bo);
    r.mask = m.mask ? m.mask + b * m.mask_s[0] + h * m.mask_s[1] : nullptr;
#if CUFLASH_USER_MOD
    r.b = m.user.batch0 + b;
    r.h = h;
#endif
    return r;
}

// Is key j visible to query i under the boolean mask (true when there is none)?
__device__ __forceinline__ bool mask_keeps(const ScoreMods& m, const HeadMods& hm, int i, int j) {
    return !hm.mask || hm.mask[i * m.mask_s[2] + j * m.mask_s[3]] != 0;
}

// The modified log2-domain score of query i, key j from x = s * scale * log2 e (before the
// causal / window mask). `dcap` (if not null) gets d(softcapped)/d(x): 1 - tanh^2 (1 without softcap).
// `user_mask` false skips the traced mask_mod (a tile a block mask lists as full). `s_user` (CUFLASH_USER_MOD
// bit 4) gets the score the traced score_mod received, in natural units.
template <class T>
__device__ __forceinline__ float mod_score(const ScoreMods& m, const HeadMods& hm, float x, int i, int j,
                                           int seqlen_q, int seqlen_k, float* dcap = nullptr, bool user_mask = true
#if CUFLASH_USER_MOD & 4
                                           , float* s_user = nullptr
#endif
                                           ) {
    if (hm.cap != 0.0f) {
        const float th = tanhf(x / hm.cap);
        x = hm.cap * th;
        if (dcap) *dcap = 1.0f - th * th;
    } else if (dcap) {
        *dcap = 1.0f;
    }
    if (hm.slope != 0.0f) {
        const int d = diag_distance(i, j, seqlen_q, seqlen_k);   // j - (i + Sk - Sq)
        x -= hm.slope * (float)(d < 0 ? -d : d);
    }
    if (hm.bias) {
        const long long off = i * m.bias_s[2] + j * m.bias_s[3];
        x += (m.bias_f32 ? static_cast<const float*>(hm.bias)[off] : to_float(static_cast<const T*>(hm.bias)[off])) *
             CUFLASH_LOG2E;
    }
#if CUFLASH_USER_MOD & 1
    {   // score_mod in natural units; its derivative (the backward's) is the same in both
        const float s_in = x * CUFLASH_LN2;
#if CUFLASH_USER_MOD & 4
        if (s_user) *s_user = s_in;
#endif
        x = CUFLASH_SCORE_MOD(s_in, hm.b, hm.h, i, j, m.user) * CUFLASH_LOG2E;
#ifdef CUFLASH_SCORE_MOD_GRAD
        if (dcap) *dcap *= CUFLASH_SCORE_MOD_GRAD(s_in, hm.b, hm.h, i, j, m.user);
#endif
    }
#endif
#if CUFLASH_USER_MOD & 2
    if (user_mask && !CUFLASH_MASK_MOD(hm.b, hm.h, i, j, m.user)) x = CUFLASH_NEG_INF;
#endif
    if (!mask_keeps(m, hm, i, j)) x = CUFLASH_NEG_INF;
#if CUFLASH_USER_MOD
    if (dcap && x == CUFLASH_NEG_INF) *dcap = 0.0f;   // no probability, no gradient (a non-finite derivative too)
#endif
    return x;
}

// The sink of head h folded into a finished row (log2 domain): the running max m and the row sum
// l become the max and sum over the keys and the sink; returns the factor the row's un-normalized
// O must be multiplied by before dividing by the new l (0 for a row without keys: O = 0).
__device__ __forceinline__ float sink_fold(const ScoreMods& m, int h, float& m_row, float& l_row) {
    if (!m.sinks) return 1.0f;
    const float sk = m.sinks[h * m.sinks_s] * CUFLASH_LOG2E;
    if (sk == CUFLASH_NEG_INF) return 1.0f;              // exp(-inf) adds nothing
    const float m_new = sk != sk ? sk : fmaxf(m_row, sk);   // a NaN sink makes the row NaN (fmaxf would drop it)
    const float c = m_row == CUFLASH_NEG_INF ? 0.0f : exp2f(m_row - m_new);
    l_row = l_row * c + exp2f(sk - m_new);
    m_row = m_new;
    return c;
}
