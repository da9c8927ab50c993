// cuflash: the Hopper (sm_90a) attention backward, main stage: FA3's design (Shah et al.,
// "FlashAttention-3", 2024, section 3 and its backward): warp specialization, every GEMM on wgmma,
// dQ added to a float32 workspace by bulk reduce-adds instead of atomics.
//
// The dot stage (Dd = rowsum(dO * O)) before and the convert stage (dq = softmax_scale * the
// float32 workspace, in the input dtype) after are the portable ones (attention_bwd_simt.cu,
// cuflash/kernels/backward_run.py); this kernel replaces the main stage only.
//
//   grid = (key tiles, kv heads, batch): one block per BC = 128 keys of one kv head. It walks every
//   (query head of its kv head (GQA), BR = 64-row query tile that sees the key tile) pair in order.
//   block = 3 warpgroups:
//     warpgroup 0, warp 0 (producer): K and V once by TMA; per query tile Q and dO (4-d maps) and
//       its 64 lse and Dd values (boxes of the flat (B * Hq * Sq) float32 arrays) by TMA into a
//       2-stage ring: a "full" mbarrier per stage (the TMA bytes) and an "empty" one that every
//       consumer thread arrives on once it has read the stage (lse and Dd by plain loads, Q and
//       dO through its wgmmas);
//     warpgroup 0, warp 1 (dQ writer): per query tile waits on the named barrier DQ_FULL, adds the
//       64 x D float32 dQ tile from shared memory into the workspace with one
//       cp.reduce.async.bulk .add.f32 (its rows are contiguous there), waits for the read of the
//       shared buffer (wait_group.read) and marks it empty (DQ_EMPTY);
//     warpgroups 1 and 2 (consumers): consumer c owns keys 64c.. of the tile, and dK, dV of those
//       64 keys stay in its registers for the whole walk (setmaxnreg: 240 registers, the
//       producer's warpgroup 24). Per query tile, with the products transposed so that the key
//       axis is wgmma's M (FA3's swap of A and B):
//         S^T  = K Q^T,  dP^T = V dO^T        (ss: K / V and Q / dO K-major, 128-byte swizzle)
//         P^T  = exp2(S^T * scale log2 e - lse),  dS^T = P^T (dP^T - Dd)     (registers)
//         dV  += P^T dO,  dK += dS^T Q         (rs: P^T and dS^T are the accumulators' own A
//                                               fragments; dO / Q N-major: no transpose needed)
//         dS^T -> shared memory (stmatrix; 16-bit, [key][query], 128-byte swizzle), both consumers synced
//                                               (named barrier DS_BAR), then
//         dQ   = dS K                          (ss: dS M-major from that buffer, K N-major;
//                                               consumer c computes columns c * D/2 ..)
//       and dQ goes into the shared dQ buffer (float32 [64][D]) after DQ_EMPTY, then DQ_FULL.
//   dS^T has two buffers: consumer c writes buffer it % 2 only after DS_BAR of the previous tile,
//   which the other consumer reaches only once its dQ wgmma of the tile before has completed.
//   The walk over query tiles runs in loops of one tile body (FA3 peels its masked tiles the same
//   way): a steady loop with no mask code, and masked loops before and after it (the causal
//   diagonal, a window's edges, and every tile of a key tile that reaches past Sk); the first of
//   them takes the tiles that need only each key's lower bound (the causal diagonal inside Sq and
//   Sk, no window's left edge in the tile). The mask clears pairs on the 16-bit P^T and dS^T
//   fragments (mask_fragments).
//   dK (times softmax_scale) and dV are stored once from registers (rows past Sk dropped); dQ
//   is left unscaled (the convert stage scales it).
//   Deterministic mode (`deterministic` != 0, a run-time flag read by the dQ warp only): the key
//   tiles that add to one (head, query tile) add in key-tile order. dq_sem holds a zeroed int32
//   counter per (batch, query head, query tile); the dQ warp's lane 0 waits (ld.acquire) until it
//   equals this block's rank among those key tiles, orders its reduce-add after that
//   (fence.proxy.async.global), and after the reduce-add has completed (wait_group 0, not .read;
//   fence.proxy.async.global) increments it (red.release). The awaited blocks have lower indices,
//   so they were scheduled first. The counters end at the number of key tiles that add; the host
//   zeroes a fresh array per call.
//
// Layout: q, dout (B, Hq, Sq, D), k, v (B, Hk, Sk, D) through 4-d tensor maps (rows past Sq / Sk
// read as zeros); lse, dd (B, Hq, Sq) float32 contiguous (lse: the forward's, natural log);
// dq_accum (B, Hq, Sq, D) float32 contiguous; dk, dv (B, Hk, Sk, D) with element strides. The
// head dim is D = Dv = CUFLASH_D exactly (64, 96 or 128; the host refuses other head dims). The tiles
// hold whole 64-column panels: at D = 96 the second panel's last 32 columns of Q, dO, K and V are the
// tensor maps' zero fill; S^T and dP^T step over D columns only, dV and dK are wgmmas of N = D, and the
// second consumer's dQ wgmma (N = 64) computes 32 zero columns that it does not store.
// Windows are bottom-right: key j is visible to row i iff i + Sk - Sq - left <= j <= i + Sk - Sq +
// right (-1: unbounded; causal is right = 0). A masked pair's P and dS are 0 (never 0 * NaN); rows
// past Sq read another head's lse and Dd (or zeros) and are masked, so the tile reaching past Sq
// is always in a masked loop, as is every tile of a key tile reaching past Sk.
//
// A packed batch (varlen != 0, a run-time form of the same code): grid.z is the sequence; each block
// reads its sequence's first rows and lengths from cu_seqlens_q/k and seqused_k (clamped into the
// arrays: common.cuh, varlen_seq), exits if its key tile starts past the sequence's key rows, and
// then walks the sequence as a fixed shape of Sq = its query rows, Sk = its keys used. Q, dO, K and
// V come through ragged maps (tile_box), so rows past the sequence's end (or past seqused_k) are
// zeros, never another sequence's; lse, Dd and the workspace are (1, Hq, total_q) with the
// sequence's rows from q0 on; dK and dV rows of keys in [seqused_k, key rows) are written 0.
//
// A traced score_mod / mask_mod (the CUFLASH_USER_MOD forms; score_mods.cuh, cuflash/runtime/score_mod.py):
// a fixed-shape form whose consumers wait for S^T and dP^T, then per pair recompute the modified score
// as the forward does (score_mod of the scaled score in natural units, mask_mod on the pairs the causal
// / window mask keeps; mask_mod in the steady loop too), P = exp(modified - lse), dS^T = P (dP^T - Dd)
// times d score_mod / d score (0 for a hidden pair, never 0 * NaN). Bit 4: each pair with dS != 0 adds
// its captured-array gradient terms by atomicAdd (tile-uniform ones summed per warp), so the host does
// not run that form in deterministic mode. CUFLASH_BLOCK_SPARSE 1: the walk, in all three roles, is
// the block mask's transposed index for this key tile's key block (per query head of the group, the
// query blocks that see it, partial ones then full ones, as 64-row tiles; tiles from Sq on skipped),
// mask_mod evaluated on the partial ones only; key blocks hold whole 128-key tiles (the host's rule).
//
// Defines: CUFLASH_ENTRY, CUFLASH_BF16 (0/1), CUFLASH_D (64, 96 or 128); the traced forms' as score_mods.cuh.
#include "ptx.cuh"
#if CUFLASH_USER_MOD
#include "score_mods.cuh"
#define BWD_SM90_USER_PARAMS CUFLASH_USER_PARAMS CUFLASH_BSPARSE_PARAMS CUFLASH_AGRAD_PARAMS
#else
#define BWD_SM90_USER_PARAMS
#endif

#if __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)

namespace bwd_sm90 {

constexpr int D = CUFLASH_D;
constexpr bool BF16 = CUFLASH_BF16 != 0;
#if CUFLASH_BF16
typedef __nv_bfloat16 elem_t;
#else
typedef __half elem_t;
#endif
constexpr int BR = 64, BC = 128, STAGES = 2;
constexpr int PANEL = 64;                                 // head-dim elements per 128-byte swizzle row
constexpr int NPANEL = (D + PANEL - 1) / PANEL;           // (D = 96: the second panel's last 32 columns
constexpr int DP = NPANEL * PANEL;                        //  are the tensor maps' zero fill)
constexpr int PANEL_Q = BR * 128, PANEL_K = BC * 128;     // bytes of one 64-column panel
constexpr int Q_BYTES = NPANEL * PANEL_Q, K_BYTES = NPANEL * PANEL_K;
constexpr int DS_BYTES = BC * BR * 2;                      // dS^T [BC keys][BR queries], 16-bit
constexpr int DQ_BYTES = BR * D * 4;                       // dQ [BR][D], float32 (rows of D: the workspace's)
constexpr int DQN = DP / 2;                                // dQ columns per consumer (D = 96: 64 + 64, the
                                                           // last 32 zero and not stored)
// registers a thread after setmaxnreg: the producer's warpgroup, the consumers' (128 (P + 2 C) <= 65536);
// the block-sparse form's walk of the block mask's lists needs more than 24 in the producer and dQ warp
// (macros, not constants: a namespace-scope constant is one more global in the cubin)
#if CUFLASH_BLOCK_SPARSE && CUFLASH_D == 128
#define PRODUCER_REGS 32   // (the lean form, below: its consumers need all 240; the walk re-reads its fields)
#define CONSUMER_REGS 240
#elif CUFLASH_BLOCK_SPARSE
#define PRODUCER_REGS 40
#define CONSUMER_REGS 232
#else
#define PRODUCER_REGS 24
#define CONSUMER_REGS 240
#endif
// The traced forms at D = 128 (BWD_SM90_LEAN): dK and dV take 128 of the consumers' 240 registers and
// S^T and dP^T 64, so the consumers hold nothing they can recompute. The per-pair loop is rolled over
// 4 pairs at a time (each pass takes the accumulators' first 4 registers, then rotates them by 4, so
// every register index stays a constant: 8 passes put them back in place), dQ is zeroed before its
// wgmma (its registers are free during the traced functions), and the stmatrix rows, the lse address
// and the keys' visible rows are recomputed from the thread index per tile; the block-sparse form's
// producer warpgroup walks with 32 registers, reading the block mask's fields at each use.
#define BWD_SM90_LEAN (CUFLASH_USER_MOD && CUFLASH_D == 128)
// named barriers: DS_BAR the consumers (256), DQ_FULL and DQ_EMPTY the consumers and the dQ warp (288)
constexpr int DS_BAR = 1, DQ_FULL = 2, DQ_EMPTY = 3;
static_assert(D % 32 == 0 && BR == 64, "head-dim panels and the 128-byte rows of dS^T");
// consumer c's dQ columns c * DQN.. as one MN-major B operand: inside one 64-column panel, or whole panels
static_assert(DQN <= PANEL ? PANEL % DQN == 0 : DQN % PANEL == 0, "dQ column halves and the panels");
// dynamic shared memory after 1 KB alignment: K, V, Q[2], dO[2], dS^T[2], dQ, then lse and Dd [2][BR]
// (2 K_BYTES + 4 Q_BYTES + 2 DS_BYTES + DQ_BYTES + 4 BR * 4; the host's smem_bytes adds the 1 KB)

__device__ __forceinline__ unsigned pack(float lo, float hi) {
    return BF16 ? ptx_cvt_pack_bf16x2(lo, hi) : ptx_cvt_pack_f16x2(lo, hi);
}

// the 128-byte-swizzled offset of byte `cb` (< 128) of row `row` of a tile of 128-byte rows
__device__ __forceinline__ int swizzled(int row, int cb) {
    return row * 128 + ((((cb >> 4) ^ (row & 7)) << 4) | (cb & 15));
}

// K-major descriptor (Q, dO, K, V as the operands of S^T and dP^T: 16 head-dim columns a k step)
__device__ __forceinline__ unsigned long long desc_k_major(const unsigned char* tile) {
    return ptx_wgmma_desc(tile, 16, 1024, 128);
}
// MN-major descriptor of a tile of 128-byte rows along K (dO, Q as B of dV / dK; K as B of dQ;
// dS^T as A of dQ): 16 rows a k step, the next 64 columns `panel` bytes on
__device__ __forceinline__ unsigned long long desc_mn_major(const unsigned char* tile, unsigned panel) {
    return ptx_wgmma_desc(tile, panel, 1024, 128);
}
// the byte offset of k step kk (16 head-dim columns) in a K-major tile of `rows` rows
__device__ __forceinline__ constexpr unsigned k_step_offset(int kk, int rows) {
    return (kk * 16) / PANEL * rows * 128 + (kk * 16) % PANEL * 2;
}

// an accumulator (64 x N, f32) as 16-bit A fragments of the next wgmma, 16 columns a k step
template <int N>
__device__ __forceinline__ void to_a_fragment(const float (&acc)[N / 2], unsigned (&a)[N / 16][4]) {
#pragma unroll
    for (int i = 0; i < N / 2; i += 4) {
        const int kb = i / 8, half = (i / 4) % 2;
        a[kb][2 * half] = pack(acc[i], acc[i + 1]);
        a[kb][2 * half + 1] = pack(acc[i + 2], acc[i + 3]);
    }
}

// every register of an accumulator pinned here (ptx_fence_operand)
template <int N>
__device__ __forceinline__ void fence_operands(float (&acc)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) ptx_fence_operand(acc[i]);
}

// the index of the highest set bit of n > 0 (a loop, not recursion: a forced-inline recursive
// function is an error for g++ wherever n is not folded to a constant, as in the simulator's -O1 builds)
__device__ __forceinline__ constexpr int top_bit(unsigned n) {
    int e = 0;
    for (; n > 1; n >>= 1) ++e;
    return e;
}
// float16 bits of 1 <= n < 2048 whose highest set bit is e (exact: 10 fraction bits)
__device__ __forceinline__ constexpr unsigned f16_of_norm(unsigned n, int e) {
    return unsigned(15 + e) << 10 | ((n << (10 - e)) & 0x3FFu);
}
// float16 bits of the integer n (0 <= n < 2048: exact)
__device__ __forceinline__ constexpr unsigned f16_of(int n) {
    return n == 0 ? 0u : f16_of_norm(unsigned(n), top_bit(unsigned(n)));
}

// The causal / window mask on the 16-bit fragments of P^T and dS^T (to_a_fragment's layout: fragment
// [j / 2][2 (j % 2) + r] holds key row r's column offsets 8 j and 8 j + 1 in its low and high half): a
// pair outside [lo[r], hi[r]] (offsets from this thread's first column) becomes +0 whatever its value
// (an inf from another row's lse or a NaN of dP^T included). The bounds as float16 pairs (int -> float
// -> float16 rounds monotonically, so no clamp: each offset is exact), then per fragment register two
// half-wise compares with the constant offsets (set.ge.u32.f16x2: 0xFFFF / 0 per half) and one 3-way
// AND each for P^T and dS^T: 4 instructions per column pair instead of 5 per score.
// HI false: the lower bound only (a tile in which no key's upper bound falls): 3 per column pair.
template <bool HI>
__device__ __forceinline__ void mask_fragments(const int (&lo)[2], const int (&hi)[2], unsigned (&pa)[BR / 16][4],
                                               unsigned (&da)[BR / 16][4]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const unsigned lo2 = ptx_cvt_pack_f16x2(float(lo[r]), float(lo[r]));
        const unsigned hi2 = HI ? ptx_cvt_pack_f16x2(float(hi[r]), float(hi[r])) : 0u;
#pragma unroll
        for (int j = 0; j < BR / 8; ++j) {
            const unsigned k2 = f16_of(8 * j) | f16_of(8 * j + 1) << 16;
            unsigned& p = pa[j / 2][2 * (j % 2) + r];
            unsigned& d = da[j / 2][2 * (j % 2) + r];
            const unsigned ml = ptx_set_ge_f16x2(k2, lo2);
            if (HI) {
                const unsigned mh = ptx_set_ge_f16x2(hi2, k2);
                p = ptx_and3(p, ml, mh);
                d = ptx_and3(d, ml, mh);
            } else {
                p &= ml;
                d &= ml;
            }
        }
    }
}

// the mask a tile needs: none (steady), both bounds, or the lower one only (a causal diagonal tile)
enum Mask { MASK_NONE = 0, MASK_ON = 1, MASK_LO = 2 };
template <int M> struct MaskOf {   // a Mask as a type, for a generic lambda
    static constexpr int value = M;
};

struct Walk {   // what a consumer knows of its block
    int key0;                 // this thread's first key row (the other: key0 + 8)
    int vis_lo[2], vis_hi[2];   // the queries its two key rows see (bottom-right window, Sq, Sk)
    float scale_log2;
#if CUFLASH_USER_MOD
    float scale;              // softmax_scale: the traced score_mod takes the scaled score in natural units
    long long hb;             // the flattened batch index the traced functions see
#endif
};

// The queries [lo, hi] key `key` sees: row i sees it iff i + diag - left <= key <= i + diag +
// right (-1: unbounded), i < Sq, key < Sk; an empty range (hi < lo) for a key past Sk.
__device__ __forceinline__ void visible_rows(int key, int Sq, int Sk, int window_left, int window_right, int& lo,
                                             int& hi) {
    const long long diag = (long long)Sk - Sq;
    long long a = 0, z = Sq - 1;
    if (window_right >= 0) a = max(a, key - diag - window_right);
    if (window_left >= 0) z = min(z, key - diag + window_left);
    if (key >= Sk) z = -1;
    lo = int(min(a, (long long)Sq));
    hi = int(max(z, -1ll));
}

// rows [0, Sk) from the accumulator, rows [Sk, keys) zero (a packed sequence's keys past seqused_k)
__device__ __forceinline__ void store_rows(elem_t* base, long long row_stride, int row0, int Sk, int keys,
                                           const float (&acc)[D / 2], float mul) {
#pragma unroll
    for (int i = 0; i < D / 2; i += 2) {
        const int row = row0 + 8 * ((i % 4) / 2), col = 8 * (i / 4) + 2 * (threadIdx.x % 4);
        if (row < keys)
            *reinterpret_cast<unsigned*>(base + row * row_stride + col) = row < Sk ? pack(acc[i] * mul, acc[i + 1] * mul) : 0u;
    }
}

// Where a tile's TMA box lies: the coordinates after the head-dim column. Fixed shapes: (row, head,
// batch) of a (B, H, S, D) map, rows past S read as zeros. A packed batch (varlen): a ragged map
// (cuflash/runtime/tensor_map.py, TensorMap.ragged) of dims (D, H, E, total + 1), E the box's rows,
// element (c, h, r, e) the packed row r + e - E, in bounds iff 0 <= r < E: the box at packed row
// `row` of a sequence ending at `end` takes e = min(end, row + E), r = row - e + E and holds rows
// [row, end) and zeros after, never a row of another sequence or a key past seqused_k.
struct Box {
    int c1, c2, c3;
};
template <int E>
__device__ __forceinline__ Box tile_box(int varlen, int row0, int end, int row, int head, int b) {
    if (!varlen) return Box{row, head, b};
    const int e = min(end, row0 + row + E);
    return Box{head, row0 + row - e + E, e};
}

#if CUFLASH_USER_MOD
// what the traced forms read besides the plain form's arguments
struct UserCall {
    UserArrays a;   // the captured arrays (a.batch0: the launch's first batch in the flattened index)
#if CUFLASH_USER_MOD & 4
    UserGrads g;    // their gradients' float32 workspaces
#endif
#if CUFLASH_BLOCK_SPARSE
    const int *num, *idx, *full_num, *full_idx;   // the transposed index (per key block: query blocks)
    int num_bs, num_hs, idx_bs, idx_hs, idx_rs;   // (32-bit: the host keeps every list under 2^31 entries)
    int outer, inner;                             // key block, query block sizes
    int* counts;                                  // the simulator's tiles-entered counter (count != 0)
    int count;
#endif
};
#define BWD_SM90_USER_ARG , const UserCall& u_in
#else
#define BWD_SM90_USER_ARG
#endif

#if CUFLASH_BLOCK_SPARSE
// A place in the block-sparse walk: query head h, its tile pos among the listed blocks' 64-row tiles
// (partial blocks first), that tile's first row m0 and whether its block is partial.
struct BsPos {
    int h, pos, m0;
    bool partial;
};
// The walk of key tile n0 over heads [h0, h_end) of batch hb: the first place at or after `at`
// whose tile starts before Sq (h = h_end: none left). (In 32-bit arithmetic: the producer and the
// dQ warp run it with 24 registers.)
template <typename U>   // (const UserCall, or const volatile UserCall: each field read at its use)
__device__ __forceinline__ BsPos bs_settle(U& u, int hb, int n0, int h_end, int Sq, BsPos at) {
    const int blk = n0 / u.outer;
    const int sub = u.inner / BR;
    for (; at.h < h_end; ++at.h, at.pos = 0) {
        const int o = hb * u.num_bs + at.h * u.num_hs + blk;
        const int io = hb * u.idx_bs + at.h * u.idx_hs + blk * u.idx_rs;
        const int np = u.num[o], n = (np + u.full_num[o]) * sub;
        for (; at.pos < n; ++at.pos) {
            const int e = at.pos / sub;
            at.partial = e < np;
            at.m0 = (at.partial ? u.idx[io + e] : u.full_idx[io + e - np]) * u.inner + (at.pos - e * sub) * BR;
            if (at.m0 < Sq) return at;
        }
    }
    return at;
}
#endif

__device__ void backward(const cuflash_tensor_map& map_q, const cuflash_tensor_map& map_k, const cuflash_tensor_map& map_v,
                         const cuflash_tensor_map& map_do, const cuflash_tensor_map& map_lse, const cuflash_tensor_map& map_dd,
                         float* dq_accum, elem_t* dk, elem_t* dv, long long dk_batch_stride, long long dk_head_stride,
                         long long dk_row_stride, long long dv_batch_stride, long long dv_head_stride,
                         long long dv_row_stride, int Sq, int Sk, int Hq, int group, float softmax_scale,
                         int window_left, int window_right, int* dq_sem, int deterministic, int q_tiles,
                         const int* cu_seqlens_q, const int* cu_seqlens_k, const int* seqused_k, int varlen
                         BWD_SM90_USER_ARG) {
    extern __shared__ unsigned char smem_raw[];
    __shared__ __align__(8) unsigned long long kv_full;
    __shared__ __align__(8) unsigned long long full[STAGES];
    __shared__ __align__(8) unsigned long long empty[STAGES];
    unsigned char* k_s = ptx_align_smem_1024(smem_raw);
    unsigned char* v_s = k_s + K_BYTES;
    unsigned char* q_s = v_s + K_BYTES;                     // [STAGES][NPANEL][BR][128 B]
    unsigned char* do_s = q_s + STAGES * Q_BYTES;           // [STAGES][NPANEL][BR][128 B]
    unsigned char* ds_s = do_s + STAGES * Q_BYTES;          // [2][BC][128 B]
    float* dq_s = reinterpret_cast<float*>(ds_s + 2 * DS_BYTES);   // [BR][D]
    float* lse_s = dq_s + BR * D;                           // [STAGES][BR], natural log
    float* dd_s = lse_s + STAGES * BR;                      // [STAGES][BR]
    const int n0 = blockIdx.x * BC, hk = blockIdx.y, b = blockIdx.z;
    const int wg = __shfl_sync(0xffffffffu, int(threadIdx.x / 128), 0);
    // a packed batch (varlen != 0): sequence b's rows from the index (Sq, Sk the arguments' totals
    // until then: the lse / Dd / workspace rows per head, rows_q), its lengths as Sq and Sk, and the
    // (B, Hq, ...) layouts' batch index 0 (bl); fixed shapes: q0 = k0 = 0, keys = Sk, bl = b
    const int rows_q = Sq;
    int q0 = 0, k0 = 0, keys = Sk, bl = b;
    if (varlen) {
        const VarlenSeq sv = varlen_seq_uniform(b, varlen, cu_seqlens_q, cu_seqlens_k, seqused_k, Sq, Sk);
        // (query rows past the longest sequence's tiles, from an index that disagrees with
        // max_seqlen_q, are not walked: the counters of deterministic mode stop there)
        q0 = sv.q0, k0 = sv.k0, keys = sv.keys, Sq = min(sv.seqlen_q, q_tiles * BR), Sk = sv.seqlen_k, bl = 0;
        if (n0 >= keys) return;   // a sequence shorter than the grid's key tiles: no row of its own
    }
    // the query rows that see a key of this tile, as query tiles [t_lo, t_hi), and the tiles
    // [s_lo, s_hi) among them that need no mask (all 64 x 128 pairs visible, no key past Sk)
    // (in 64 bits: window bounds reach 2^31 - 1)
    typedef long long i64;
    const i64 diag = i64(Sk) - Sq;
    i64 row_lo = 0, row_hi = Sq;   // [row_lo, row_hi)
    if (window_right >= 0) row_lo = max(i64(0), n0 - diag - window_right);
    if (window_left >= 0) row_hi = min(i64(Sq), n0 + BC - 1 - diag + window_left + 1);
    // (no walk for a key tile past Sk: a packed sequence's keys past seqused_k, stored as zeros)
    const int t_lo = int(min(row_lo, i64(Sq)) / BR),
              t_hi = row_hi > row_lo && n0 < Sk ? int((row_hi + BR - 1) / BR) : t_lo;
    int s_lo = t_lo, s_hi = t_hi;
    int u_hi = t_lo;   // the tiles [t_lo, u_hi) in which no key's upper bound falls (full rows, keys < Sk)
    if (n0 + BC > Sk) {
        s_hi = s_lo;   // a key tile reaching past Sk: every tile masked
    } else {
        // visible: row i >= n0 + BC - 1 - diag - right (every key left of its right edge) and
        // row i + BR - 1 <= n0 - diag + left (every key right of its left edge)
        if (window_right >= 0)
            s_lo = max(s_lo, int(min(i64(t_hi), (max(i64(0), n0 + BC - 1 - diag - window_right) + BR - 1) / BR)));
        int w_hi = t_hi;   // the tiles before w_hi end inside every key's window
        if (window_left >= 0) {
            const i64 last = n0 - diag + window_left - (BR - 1);   // the last steady tile's first row
            w_hi = last < 0 ? t_lo : int(min(i64(t_hi), last / BR + 1));
            s_hi = last < 0 ? s_lo : int(min(i64(s_hi), last / BR + 1));
        }
        u_hi = max(min(w_hi, Sq / BR), t_lo);
        s_hi = max(min(s_hi, Sq / BR), s_lo);   // (a tile reaching past Sq is masked: its lse and Dd boxes read on)
    }
    const int ntiles = t_hi - t_lo;
#if CUFLASH_BLOCK_SPARSE
    // (the walk's first place; nwalk only says whether there is one)
    const int hb = int(u_in.a.batch0) + b;
    const int h_end = (hk + 1) * group;
    const BsPos bs0 = bs_settle(u_in, hb, n0, h_end, Sq, BsPos{hk * group, 0, 0, false});
    const int nwalk = n0 < Sk && bs0.h < h_end ? 1 : 0;
#else
    const int nwalk = group * ntiles;
#endif
    if (threadIdx.x == 0) {
        ptx_mbarrier_init(&kv_full, 1);
        for (int s = 0; s < STAGES; ++s) {
            ptx_mbarrier_init(&full[s], 1);
            ptx_mbarrier_init(&empty[s], 256);   // every consumer thread (each read the stage's lse and Dd)
        }
        ptx_fence_mbarrier_init();
    }
#if CUFLASH_USER_MOD
    // the traced forms' arguments, read from shared memory in the loops (so the captured arrays'
    // pointers and strides do not stay in the consumers' registers across the walk)
    __shared__ UserCall u_s;
    if (threadIdx.x == 0) u_s = u_in;
#endif
    __syncthreads();
#if CUFLASH_USER_MOD
    const UserCall& u = u_s;
#endif
#if CUFLASH_BLOCK_SPARSE
    // the block mask's fields as the walks read them (BWD_SM90_LEAN: at each use, from shared memory)
#if BWD_SM90_LEAN
    const volatile UserCall& uw = u_s;
#else
    const UserCall& uw = u_s;
#endif
#endif

    if (wg == 0) {   // ------------------------------------------------------- producer, dQ writer
        ptx_setmaxnreg_dec<PRODUCER_REGS>();
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        if (warp == 0 && ptx_elect_one()) {
            if (nwalk > 0) {
                ptx_mbarrier_arrive_expect_tx(&kv_full, 2 * K_BYTES);
                const Box kb = tile_box<BC>(varlen, k0, k0 + Sk, n0, hk, b);
                for (int p = 0; p < NPANEL; ++p) {
                    ptx_tma_load_4d(k_s + p * PANEL_K, &map_k, p * PANEL, kb.c1, kb.c2, kb.c3, &kv_full);
                    ptx_tma_load_4d(v_s + p * PANEL_K, &map_v, p * PANEL, kb.c1, kb.c2, kb.c3, &kv_full);
                }
            }
#if CUFLASH_BLOCK_SPARSE
            int it = 0;
            for (BsPos at = bs0; nwalk && at.h < h_end; ++it, ++at.pos, at = bs_settle(uw, hb, n0, h_end, Sq, at)) {
                const int s = it % STAGES, h = at.h, m0 = at.m0;
#else
            for (int it = 0; it < nwalk; ++it) {
                const int s = it % STAGES, h = hk * group + it / ntiles, m0 = (t_lo + it % ntiles) * BR;
#endif
                if (it >= STAGES) ptx_mbarrier_wait(&empty[s], ((it / STAGES) - 1) & 1);
                ptx_mbarrier_arrive_expect_tx(&full[s], 2 * Q_BYTES + 2 * BR * 4);
                const Box qb = tile_box<BR>(varlen, q0, q0 + Sq, m0, h, b);
                for (int p = 0; p < NPANEL; ++p) {
                    ptx_tma_load_4d(q_s + s * Q_BYTES + p * PANEL_Q, &map_q, p * PANEL, qb.c1, qb.c2, qb.c3, &full[s]);
                    ptx_tma_load_4d(do_s + s * Q_BYTES + p * PANEL_Q, &map_do, p * PANEL, qb.c1, qb.c2, qb.c3, &full[s]);
                }
                // lse and Dd of the tile's rows: boxes of the flat (B * Hq * rows_q) arrays (rows past
                // Sq read the next sequence's or head's values, or zeros; the consumer masks them)
                const int flat = (bl * Hq + h) * rows_q + q0 + m0;
                ptx_tma_load_2d(lse_s + s * BR, &map_lse, flat, 0, &full[s]);
                ptx_tma_load_2d(dd_s + s * BR, &map_dd, flat, 0, &full[s]);
            }
        } else if (warp == 1) {
            // the dQ buffer starts empty: one arrival up front, then one per tile but the last
            if (nwalk > 0) ptx_bar_arrive(DQ_EMPTY, 288);
#if CUFLASH_BLOCK_SPARSE
            BsPos at = bs0;
            for (int it = 0; nwalk && at.h < h_end; ++it) {
                const int h = at.h, m0 = at.m0;
                ++at.pos;
                at = bs_settle(uw, hb, n0, h_end, Sq, at);
                const bool more = at.h < h_end;
#else
            for (int it = 0; it < nwalk; ++it) {
                const int h = hk * group + it / ntiles, m0 = (t_lo + it % ntiles) * BR;
#endif
                ptx_bar_sync(DQ_FULL, 288);
                if (lane == 0) {
                    const int rows = min(BR, Sq - m0);
                    int* sem = nullptr;
                    if (deterministic) {
                        // this block's turn among the key tiles that add to (h, query tile): those that see
                        // it are a run [first, ..] of key tiles (a band), so it is blockIdx.x - first; the
                        // first is the lowest whose last row bound n0 + BC - diag + left passes m0
                        sem = dq_sem + (size_t(b) * Hq + h) * q_tiles + m0 / BR;
                        const i64 v = m0 + diag - window_left - BC;
                        const int first = (window_left < 0 || v < 0) ? 0 : int(v / BC + 1);
                        ptx_wait_eq_acquire(sem, int(blockIdx.x) - first);
                        ptx_fence_proxy_async_global();
                    }
                    ptx_bulk_reduce_add_f32(dq_accum + ((size_t(bl) * Hq + h) * rows_q + q0 + m0) * D, dq_s,
                                            unsigned(rows * D * 4));
                    ptx_bulk_commit();
                    if (deterministic) {   // the add complete (not only read), then the next key tile's turn
                        ptx_bulk_wait<0>();
                        ptx_fence_proxy_async_global();
                        ptx_red_release_add(sem, 1);
                    } else {
                        ptx_bulk_wait_read<0>();
                    }
                }
#if CUFLASH_BLOCK_SPARSE
                if (more) ptx_bar_arrive(DQ_EMPTY, 288);
#else
                if (it + 1 < nwalk) ptx_bar_arrive(DQ_EMPTY, 288);   // (lane 0's arrival follows its wait)
#endif
            }
            if (lane == 0) ptx_bulk_wait<0>();
        }
        return;
    }

    // ------------------------------------------------------------------------------- consumers
    ptx_setmaxnreg_inc<CONSUMER_REGS>();
    const int c = wg - 1;
    const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    Walk w;
    w.key0 = n0 + 64 * c + 16 * warp + g;
    w.scale_log2 = softmax_scale * CUFLASH_LOG2E;
#if CUFLASH_USER_MOD
    w.scale = softmax_scale;
    w.hb = u.a.batch0 + b;
#endif
#if CUFLASH_USER_MOD
    // (unrolled by hand: in the traced forms NVVM may keep the loop and put vis_lo / vis_hi in local memory;
    // the lean form recomputes them in its masked tiles)
#if !BWD_SM90_LEAN
    visible_rows(w.key0, Sq, Sk, window_left, window_right, w.vis_lo[0], w.vis_hi[0]);
    visible_rows(w.key0 + 8, Sq, Sk, window_left, window_right, w.vis_lo[1], w.vis_hi[1]);
#endif
#else
    for (int r = 0; r < 2; ++r) visible_rows(w.key0 + 8 * r, Sq, Sk, window_left, window_right, w.vis_lo[r], w.vis_hi[r]);
#endif
    // descriptors: this consumer's 64 rows of K and V (K-major), Q of stage 0 (K-major; the others of
    // a stage follow from it, below), K's columns c * D/2.. (MN-major, dQ)
    const unsigned long long dk_a = ptx_opaque(desc_k_major(k_s + 64 * c * 128));
    const unsigned long long dv_a = ptx_opaque(desc_k_major(v_s + 64 * c * 128));
    const unsigned long long dq_b = ptx_opaque(desc_k_major(q_s));
    const unsigned long long dkq = ptx_opaque(desc_mn_major(k_s + (c * DQN) / PANEL * PANEL_K + (c * DQN) % PANEL * 2, PANEL_K));
    float dk_acc[D / 2], dv_acc[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) dk_acc[i] = dv_acc[i] = 0.0f;
    // the per-tile accumulators, defined once before the walk (each tile's first wgmma ignores
    // them, scale-d 0): an accumulator undefined on the loop's entry makes NVVM copy some of its
    // registers between the k steps, and ptxas then serializes every wgmma (C7511)
    float st[BR / 2], dpt[BR / 2], dq[DQN / 2];
#pragma unroll
    for (int i = 0; i < BR / 2; ++i) st[i] = dpt[i] = 0.0f;
#pragma unroll
    for (int i = 0; i < DQN / 2; ++i) dq[i] = 0.0f;
    unsigned pa[BR / 16][4], da[BR / 16][4];
    // this lane's stmatrix row of dS^T per k step: matrix lane / 8 (keys + 8 for odd ones, queries
    // + 8 from the third), row lane % 8, 128-byte swizzled
    unsigned st_off[BR / 16];
#pragma unroll
    for (int kb = 0; kb < BR / 16; ++kb) {
        const int row = 64 * c + 16 * warp + lane % 8 + 8 * ((lane / 8) % 2);
        st_off[kb] = swizzled(row, (2 * kb + lane / 16) * 16);
    }
    if (nwalk > 0) ptx_mbarrier_wait(&kv_full, 0);

    // The ring as loop state (as the Hopper forward's consumers carry theirs): the stage s of the
    // walk's tile `it` (it % 2, also its dS^T buffer) and its phase ph ((it / 2) % 2) flip by
    // constants after each tile, the barriers' shared addresses are taken once, and the stage's Q
    // descriptor is carried, flipped by an exclusive or; dO's, the MN-major ones and dS^T's differ
    // from it by constants (their tiles lie at fixed offsets from Q's, and the leading byte offset is
    // a field of the low word), so each k step's descriptor is one add. (Rebuilt from the walk index
    // each tile, the stage's addresses and descriptors cost ptxas about 20 instructions a tile.)
    static_assert(STAGES == 2, "the consumer loop carries a two-stage ring's stage and phase");
    unsigned s = 0, ph = 0;
    const unsigned bar_full = ptx_opaque(int(ptx_smem_addr(full))), bar_empty = ptx_opaque(int(ptx_smem_addr(empty)));
    unsigned long long q_b = dq_b;
    const unsigned q_flip = ptx_opaque(int(ptx_wgmma_desc_advance(dq_b, Q_BYTES) ^ dq_b));
    const float* const lse_t = lse_s + 2 * t;   // (Dd's at a constant offset: dd_s = lse_s + STAGES * BR)
    // the low-word differences from Q's descriptor: dO's tile STAGES * Q_BYTES on; the MN-major
    // leading byte offsets (PANEL_Q, DS_BYTES) against the K-major 16; dS^T's buffer 0 at
    // 2 STAGES Q_BYTES on (buffer 1: DS_BYTES on, where stage 1's Q is Q_BYTES on)
    constexpr unsigned DO_DELTA = STAGES * Q_BYTES >> 4, MN_DELTA = ((PANEL_Q >> 4) - 1) << 16;
    constexpr unsigned DS_DELTA = (2 * STAGES * Q_BYTES >> 4) + (((DS_BYTES >> 4) - 1) << 16);
    const auto desc_plus = [](unsigned long long desc, unsigned delta) {
        return (desc & 0xFFFFFFFF00000000ull) | unsigned(unsigned(desc) + delta);
    };

    // one query tile (the ring's next): h its query head, m0 its first row, MASK a Mask (the causal /
    // window mask), umask whether the traced mask_mod is evaluated
    auto tile = [&](int h, int m0, auto mask, bool umask) {
        constexpr int MASK = decltype(mask)::value;
        // this stage's descriptors (each k step below adds a constant)
        const unsigned long long do_b = desc_plus(q_b, DO_DELTA);
        const unsigned long long q_mn = desc_plus(q_b, MN_DELTA), do_mn = desc_plus(q_b, MN_DELTA + DO_DELTA);
        const unsigned long long ds_a = desc_plus(q_b, DS_DELTA + s * ((DS_BYTES - Q_BYTES) >> 4));
        ptx_mbarrier_wait(bar_full + 8 * s, ph);
        fence_operands(st);
        fence_operands(dpt);
        ptx_wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
            ptx_wgmma_ss<BR, BF16, 0, 0>(st, ptx_wgmma_desc_advance(dk_a, k_step_offset(kk, BC)),
                                         ptx_wgmma_desc_advance(q_b, k_step_offset(kk, BR)), kk > 0);
        ptx_wgmma_commit();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
            ptx_wgmma_ss<BR, BF16, 0, 0>(dpt, ptx_wgmma_desc_advance(dv_a, k_step_offset(kk, BC)),
                                         ptx_wgmma_desc_advance(do_b, k_step_offset(kk, BR)), kk > 0);
        ptx_wgmma_commit();
#if !CUFLASH_USER_MOD
        ptx_wgmma_wait<1>();   // S^T is in; dP^T may still run
        fence_operands(st);
        // P^T: this thread's keys key0, key0 + 8 (rows), queries m0 + 8 (i / 4) + 2t + i % 2 (columns)
        // (an lse of -inf, a row without keys, occurs only in masked tiles, whose mask clears the inf)
        const float* ls = lse_t + s * BR;
        const float* ds = ls + STAGES * BR;
        float nl[BR / 4], dcol[BR / 4];   // -lse log2 e and Dd of this thread's columns (pairs: 8-byte loads)
#pragma unroll
        for (int j = 0; j < BR / 8; ++j) {
            const float2 l2 = *reinterpret_cast<const float2*>(ls + 8 * j);
            const float2 d2 = *reinterpret_cast<const float2*>(ds + 8 * j);
            nl[2 * j] = l2.x * -CUFLASH_LOG2E;
            nl[2 * j + 1] = l2.y * -CUFLASH_LOG2E;
            dcol[2 * j] = d2.x;
            dcol[2 * j + 1] = d2.y;
        }
        // the mask: this thread's key rows see queries [vis_lo, vis_hi], here relative to its first
        // column m0 + 2t (mask_fragments compares them with the constant column offsets)
        int lo[2], hi[2];
        if (MASK) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                lo[r] = w.vis_lo[r] - (m0 + 2 * t);
                hi[r] = w.vis_hi[r] - (m0 + 2 * t);
            }
        }
#pragma unroll
        for (int i = 0; i < BR / 2; ++i) st[i] = exp2f(fmaf(st[i], w.scale_log2, nl[2 * (i / 4) + i % 2]));
        ptx_wgmma_wait<0>();
        fence_operands(dpt);
#pragma unroll
        for (int i = 0; i < BR / 2; ++i) dpt[i] = st[i] * (dpt[i] - dcol[2 * (i / 4) + i % 2]);
        to_a_fragment<BR>(st, pa);
        to_a_fragment<BR>(dpt, da);
        if (MASK) mask_fragments<MASK == MASK_ON>(lo, hi, pa, da);   // a masked pair's P and dS: 0 (never 0 * NaN)
#else
        // the traced forms: S^T and dP^T both in, then per pair the modified score, P and dS^T (lse and
        // Dd read from shared memory per pair, not held: the traced functions need the registers)
        ptx_wgmma_wait<0>();
        fence_operands(st);
        fence_operands(dpt);
#if BWD_SM90_LEAN
        const float* ls = lse_s + 2 * (threadIdx.x % 4) + s * BR;
#else
        const float* ls = lse_t + s * BR;
#endif
        const float* ds = ls + STAGES * BR;
        int lo[2], hi[2];
        if (MASK) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
#if BWD_SM90_LEAN
                int vis_lo, vis_hi;
                visible_rows(w.key0 + 8 * r, Sq, Sk, window_left, window_right, vis_lo, vis_hi);
                lo[r] = vis_lo - (m0 + 2 * t);
                hi[r] = vis_hi - (m0 + 2 * t);
#else
                lo[r] = w.vis_lo[r] - (m0 + 2 * t);
                hi[r] = w.vis_hi[r] - (m0 + 2 * t);
#endif
            }
        }
#if CUFLASH_USER_MOD & 4
        float ug[4] = {0.0f, 0.0f, 0.0f, 0.0f};   // this thread's sums of the tile-uniform gradient terms
#endif
#if BWD_SM90_LEAN
        // (rolled: pass j takes pairs 4 j .. 4 j + 3 in registers 0..3, then rotates by 4)
#pragma unroll 1
        for (int j = 0; j < BR / 8; ++j) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int r = i / 2, offset = 8 * j + i % 2;
#else
#pragma unroll
        for (int i = 0; i < BR / 2; ++i) {
            const int r = (i % 4) / 2, offset = 8 * (i / 4) + i % 2;
#endif
            const int qi = m0 + 2 * t + offset, kj = w.key0 + 8 * r;
            // (the traced functions only see pairs the causal / window mask keeps: rows < Sq, keys < Sk)
            bool keep = !MASK || (offset >= lo[r] && offset <= hi[r]);
            float p = 0.0f, dsv = 0.0f;
            if (keep) {
                const float s_in = st[i] * w.scale;   // the scaled score, natural units
                float z = s_in, grad = 1.0f;
#if CUFLASH_USER_MOD & 1
                z = CUFLASH_SCORE_MOD(s_in, w.hb, h, qi, kj, u.a);
#ifdef CUFLASH_SCORE_MOD_GRAD
                grad = CUFLASH_SCORE_MOD_GRAD(s_in, w.hb, h, qi, kj, u.a);
#endif
#endif
#if CUFLASH_USER_MOD & 2
                if (umask && !CUFLASH_MASK_MOD(w.hb, h, qi, kj, u.a)) keep = false;
#endif
                if (keep) p = exp2f(fmaf(z, CUFLASH_LOG2E, ls[offset] * -CUFLASH_LOG2E));
                dsv = p * (dpt[i] - ds[offset]);
                if (p == 0.0f) dsv = 0.0f;   // no probability, no gradient (never 0 * NaN or 0 * inf)
#if CUFLASH_USER_MOD & 4
                if (dsv != 0.0f) {   // the captured arrays' gradients (a hidden pair adds nothing)
                    CUFLASH_SCORE_MOD_ARRAY_GRAD(s_in, w.hb, h, qi, kj, u.a, u.g, dsv, ug);
                }
#endif
                if (p != 0.0f) dsv *= grad;
            }
            st[i] = p;
            dpt[i] = dsv;
        }
#if BWD_SM90_LEAN
        const float p0 = st[0], p1 = st[1], p2 = st[2], p3 = st[3];
        const float d0 = dpt[0], d1 = dpt[1], d2 = dpt[2], d3 = dpt[3];
#pragma unroll
        for (int e = 0; e + 4 < BR / 2; ++e) st[e] = st[e + 4], dpt[e] = dpt[e + 4];
        st[BR / 2 - 4] = p0, st[BR / 2 - 3] = p1, st[BR / 2 - 2] = p2, st[BR / 2 - 1] = p3;
        dpt[BR / 2 - 4] = d0, dpt[BR / 2 - 3] = d1, dpt[BR / 2 - 2] = d2, dpt[BR / 2 - 1] = d3;
        }
#endif
#if (CUFLASH_USER_MOD & 4) && defined(CUFLASH_SCORE_MOD_ARRAY_GRAD_WARP)
        CUFLASH_SCORE_MOD_ARRAY_GRAD_WARP(w.hb, h, u.a, u.g, ug);   // (every lane of the warp is here)
#endif
        to_a_fragment<BR>(st, pa);
        to_a_fragment<BR>(dpt, da);
#endif
        // dS^T into buffer it % 2 (rows: keys - n0), by stmatrix: the fragment of k step kb is four
        // 8 x 8 matrices (keys 16 warp + 0..7 / 8..15 by queries 16 kb + 0..7 / 8..15)
        unsigned char* dsb = ds_s + s * DS_BYTES;
#if BWD_SM90_LEAN
        const int tx = ptx_opaque(int(threadIdx.x)), ln = tx % 32;   // (st_off recomputed)
        const int st_row = 64 * c + 16 * (tx % 128 / 32) + ln % 8 + 8 * ((ln / 8) % 2);
#pragma unroll
        for (int kb = 0; kb < BR / 16; ++kb) ptx_stmatrix_x4(dsb + swizzled(st_row, (2 * kb + ln / 16) * 16), da[kb]);
#else
#pragma unroll
        for (int kb = 0; kb < BR / 16; ++kb) ptx_stmatrix_x4(dsb + st_off[kb], da[kb]);
#endif
        ptx_fence_proxy_async();   // the generic-proxy stores before wgmma's reads
#if BWD_SM90_LEAN
#pragma unroll
        for (int i = 0; i < DQN / 2; ++i) dq[i] = 0.0f;   // (its first wgmma ignores it: dead until here; before the fence)
#endif
        ptx_wgmma_fence();
#pragma unroll
        for (int kb = 0; kb < BR / 16; ++kb)
            ptx_wgmma_rs<D, BF16, 1>(dv_acc, pa[kb], ptx_wgmma_desc_advance(do_mn, kb * 16 * 128), 1);
#pragma unroll
        for (int kb = 0; kb < BR / 16; ++kb)
            ptx_wgmma_rs<D, BF16, 1>(dk_acc, da[kb], ptx_wgmma_desc_advance(q_mn, kb * 16 * 128), 1);
        ptx_wgmma_commit();
        ptx_bar_sync(DS_BAR, 256);   // both consumers' halves of dS^T are stored
#pragma unroll
        for (int kb = 0; kb < BC / 16; ++kb)
            ptx_wgmma_ss<DQN, BF16, 1, 1>(dq, ptx_wgmma_desc_advance(ds_a, kb * 16 * 128),
                                          ptx_wgmma_desc_advance(dkq, kb * 16 * 128), kb > 0);
        ptx_wgmma_commit();
        ptx_wgmma_wait<1>();   // dV, dK done: the stage's Q and dO are free
        ptx_mbarrier_arrive(bar_empty + 8 * s);
        ptx_wgmma_wait<0>();
        ptx_bar_sync(DQ_EMPTY, 288);   // the dQ warp has read the previous tile's buffer
#pragma unroll
        for (int i = 0; i < DQN / 2; i += 2) {
            const int row = 16 * warp + g + 8 * ((i % 4) / 2), col = c * DQN + 8 * (i / 4) + 2 * t;
            // (D < DP: the second consumer's columns from D on are the zero fill's, not stored)
            if (DP == D || c == 0 || 8 * (i / 4) < D - DQN)
                *reinterpret_cast<float2*>(dq_s + row * D + col) = make_float2(dq[i], dq[i + 1]);
        }
        ptx_fence_proxy_async();
        ptx_bar_arrive(DQ_FULL, 288);
        ph ^= s;
        s ^= 1;
        q_b ^= q_flip;
    };

    const int lo = min(s_lo, t_hi), hi = min(max(s_hi, lo), t_hi);
#if CUFLASH_BLOCK_SPARSE
    // the block mask's tiles; the causal / window mask where a tile is not wholly visible, mask_mod on
    // the partial blocks' tiles only
#if defined(CUFLASH_SIM)
    int entered_partial = 0, entered_full = 0;
#endif
    for (BsPos at = bs0; nwalk && at.h < h_end; ++at.pos, at = bs_settle(uw, hb, n0, h_end, Sq, at)) {
        const int m = at.m0 / BR;
        if (m >= lo && m < hi)
            tile(at.h, at.m0, MaskOf<MASK_NONE>{}, at.partial);
        else
            tile(at.h, at.m0, MaskOf<MASK_ON>{}, at.partial);
#if defined(CUFLASH_SIM)
        entered_partial += at.partial ? 1 : 0;
        entered_full += at.partial ? 0 : 1;
#endif
    }
#if defined(CUFLASH_SIM)
    if (u.count && threadIdx.x == 128) {   // (the simulator's count of the tiles this block entered)
        const long long blk = blockIdx.x + gridDim.x * (blockIdx.y + (long long)gridDim.y * blockIdx.z);
        u.counts[2 * blk] = entered_partial;
        u.counts[2 * blk + 1] = entered_full;
    }
#endif
#elif CUFLASH_USER_MOD
    // (the traced forms: one loop whose tile is masked or steady, two copies of the tile's code rather
    // than three, fewer registers held across the walk)
    for (int gi = 0; gi < group; ++gi)
        for (int m = t_lo; m < t_hi; ++m) {
            if (m >= lo && m < hi)
                tile(hk * group + gi, m * BR, MaskOf<MASK_NONE>{}, true);
            else
                tile(hk * group + gi, m * BR, MaskOf<MASK_ON>{}, true);
        }
#else
    // tiles before lo_end need the lower bound only: no key past Sk, no row past Sq, every key's window
    // reaching past the tile's last row
    const int lo_end = min(lo, u_hi);
    for (int gi = 0; gi < group; ++gi) {
        const int h = hk * group + gi;
        int m = t_lo;
        for (; m < lo_end; ++m) tile(h, m * BR, MaskOf<MASK_LO>{}, true);
        for (; m < lo; ++m) tile(h, m * BR, MaskOf<MASK_ON>{}, true);
        for (; m < hi; ++m) tile(h, m * BR, MaskOf<MASK_NONE>{}, true);
        for (; m < t_hi; ++m) tile(h, m * BR, MaskOf<MASK_ON>{}, true);
    }
#endif
    // (rows past the sequence's key rows are dropped by store_rows, those in [Sk, keys) zero)
    store_rows(dk + bl * dk_batch_stride + hk * dk_head_stride + k0 * dk_row_stride, dk_row_stride, w.key0, Sk, keys,
               dk_acc, softmax_scale);
    store_rows(dv + bl * dv_batch_stride + hk * dv_head_stride + k0 * dv_row_stride, dv_row_stride, w.key0, Sk, keys,
               dv_acc, 1.0f);
}

}  // namespace bwd_sm90

extern "C" __global__ void __launch_bounds__(384, 1) CUFLASH_ENTRY(
    const __grid_constant__ cuflash_tensor_map map_q, const __grid_constant__ cuflash_tensor_map map_k,
    const __grid_constant__ cuflash_tensor_map map_v, const __grid_constant__ cuflash_tensor_map map_do,
    const __grid_constant__ cuflash_tensor_map map_lse, const __grid_constant__ cuflash_tensor_map map_dd, float* dq_accum, bwd_sm90::elem_t* dk,
    bwd_sm90::elem_t* dv, long long dk_batch_stride, long long dk_head_stride, long long dk_row_stride,
    long long dv_batch_stride, long long dv_head_stride, long long dv_row_stride, int Sq, int Sk, int Hq, int group,
    float softmax_scale, int window_left, int window_right, int* dq_sem, int deterministic, int q_tiles,
    const int* cu_seqlens_q, const int* cu_seqlens_k, const int* seqused_k, int varlen BWD_SM90_USER_PARAMS) {
#if CUFLASH_USER_MOD
    const bwd_sm90::UserCall user = {
        {{user_a0, user_a1, user_a2, user_a3},
         {{user_s00, user_s01, user_s02}, {user_s10, user_s11, user_s12}, {user_s20, user_s21, user_s22},
          {user_s30, user_s31, user_s32}},
         user_batch0},
#if CUFLASH_USER_MOD & 4
        CUFLASH_AGRAD_INIT,
#endif
#if CUFLASH_BLOCK_SPARSE
        bs_num, bs_idx, bs_full_num, bs_full_idx, int(bs_num_bs), int(bs_num_hs), int(bs_idx_bs), int(bs_idx_hs),
        int(bs_idx_rs), bs_outer, bs_inner, bs_counts, bs_count,
#endif
    };
#define BWD_SM90_USER_PASS , user
#else
#define BWD_SM90_USER_PASS
#endif
    bwd_sm90::backward(map_q, map_k, map_v, map_do, map_lse, map_dd, dq_accum, dk, dv, dk_batch_stride, dk_head_stride,
                       dk_row_stride, dv_batch_stride, dv_head_stride, dv_row_stride, Sq, Sk, Hq, group, softmax_scale,
                       window_left, window_right, dq_sem, deterministic, q_tiles, cu_seqlens_q, cu_seqlens_k, seqused_k,
                       varlen BWD_SM90_USER_PASS);
}

#endif  // sm_90a
