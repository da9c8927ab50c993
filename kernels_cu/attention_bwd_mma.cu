// cuflash: the tensor-core attention backward, main stage (fp16/bf16, sm_80 and newer).
//
// Replaces stage 1 of attention_bwd_simt.cu and takes exactly its arguments; stages 0 (Dd =
// rowsum(dO * O)) and 2 (the float32 dQ workspace, times softmax_scale, to the input dtype, with
// the deterministic mode's fixed-order reduction of the partials) are the SIMT file's
// (cuflash/kernels/attention_bwd_mma.py).
//
// FlashAttention-2's backward (Dao 2023, Algorithm 2 and §3.2): one block of NW = 8 warps owns
// one Bc-key tile of one (kv head, batch): block s of the launch runs key tile tile0 + s (if <
// tile_end; deterministic mode launches once per round of num_splits tiles, see
// attention_bwd_simt.cu). K and V stay in shared memory; the block walks one flat loop over the
// (query head of its kv head (GQA), Br-row query tile that sees the key tile) pairs, so the loop
// over query tiles is the kernel's only loop with tensor instructions. Per query tile, on tensor
// cores (mma.sync m16n8k16, f32 accumulators, operands from shared memory through ldmatrix):
//
//   S  = Q K^T,  dP = dO V^T                          warps S_WM x S_WN over (queries, keys)
//   P  = exp2(S * scale log2 e - lse log2 e),  dS = P * (dP - Dd)     (registers; masked pairs 0)
//   P, dS -> shared memory as [query][key] 16-bit (the other GEMMs split the tile differently)
//   dV += P^T dO,  dK += dS^T Q                       warps KV_WN x KV_WD over (keys, columns);
//                                                     A = P^T / dS^T through ldmatrix.trans
//   dQ += dS K                                        warps Q_WM x Q_WD over (queries, columns),
//                                                     into the float32 workspace: red.global.add
//                                                     .v2.f32 (sm_90; two atomicAdd before), or in
//                                                     deterministic mode this thread's own
//                                                     read-modify-write of its split's partial
//
// Each product is computed once (no warp repeats another's S or dP), and each warp's tile is as
// square as the 8 warps allow (32 x 32 of S at Bc = 128), which bounds the shared-memory bytes
// read per mma (python -m cuflash roofline). dK and dV stay in registers for the whole loop and
// are stored once, dK scaled by softmax_scale; dQ is left unscaled (the convert stage scales it).
//
// Pipeline (STAGES = 2): Q, dO, lse and Dd of a query tile are one cp.async group, double-
// buffered. At the top of iteration i each thread waits for its copies of tile i and one barrier
// makes every thread's copies visible and every thread done with tile i - 1 (its stage, and P/dS),
// after which the block starts the copy of tile i + 1 into the other stage; a second barrier
// orders the P/dS stores before the dV/dK/dQ products read them. STAGES = 1 (shared memory too
// small for two stages): the refill waits for a third barrier at the end of the iteration.
//
// Masks (bottom-right aligned, common.cuh) are run-time and applied only on tiles that need them:
// a tile reaching past Sq or Sk, or with a window edge (the causal diagonal) inside it, computes
// each of this thread's rows' visible key range once and tests its pairs; every other tile is
// unmasked. A masked pair's P and dS are 0 (not 0 * (dP - Dd): a NaN in a V row or in Dd that
// the pair does not see must not reach dS; docs/conventions.md), and an LSE of -inf (a row without keys)
// gives P = 0, never exp2(-inf + inf).
//
// Loads are cp.async (16 bytes, zero-filled beyond Sq/Sk and the head dims; lse and Dd 4 bytes),
// so rows must be 16-byte aligned: q, k, v, dout and their strides multiples of 8 elements, D and
// Dv multiples of 8 (cuflash/kernels/attention_bwd_mma.py: unsupported_reason; the dispatcher falls
// back to the SIMT backward otherwise). A query tile whose rows and columns are all in view (an
// interior tile: Br rows before Sq, D = Dv = the bucket) copies Q and dO without predicates, and
// adds its dQ without a test per element; edge tiles test each chunk (in the plain forms one compare
// of a constant a chunk, at the interior copies' addresses: load_rows_async_edge) and each dQ pair
// (the adds predicated, not branched around).
//
// Addresses: every ldmatrix reads at a tile base plus a per-thread byte offset plus a constant
// (SmemOffsets), one [R + immediate] operand in SASS, so the products carry no address arithmetic.
//
// Shared memory (dynamic, 16-bit elements unless noted; K/V/Q/dO row pitch Dmax + 8 and P/dS row
// pitch Bc + 8, both odd numbers of 16-byte chunks, so ldmatrix phases and the 4-byte P/dS stores
// are free of bank conflicts): K [Bc], V [Bc], Q [STAGES][Br], dO [STAGES][Br], P [Br], dS [Br],
// then lse (natural log, as stored by the forward) and Dd [STAGES][Br] as float32.
//
// Variable-length batches (the CUFLASH_VARLEN 1 variants; common.cuh: varlen_seq_uniform): the
// block's sequence offsets the base pointers and sets its lengths; Dd and the dQ workspace are
// then one packed sequence of total_q rows. Key tiles past the sequence's keys exit; keys past seqused_k get dK = dV = 0.
//
// Score modifiers (the CUFLASH_MODS 1 variants; score_mods.cuh): every tile takes the per-pair
// path, where the pair's score is modified as in the forward (softcap, ALiBi, bias, boolean mask)
// before P = exp(z - lse) (the forward's LSE already holds any sink); dS = P (dP - Dd) is the
// gradient of the modified score, written to the float32 dbias workspace when asked (mod_flags &
// 16: each (b, h, i, j) by one thread of one block, so it is deterministic) and multiplied by the
// softcap's 1 - tanh^2 before it meets Q and K.
//
// Captured-array gradients (CUFLASH_USER_MOD bit 4, a traced score_mod's float arrays; score_mods.cuh):
// each visible pair with dS != 0 adds dS * d score_mod / d read into the float32 workspace of the array
// it reads, at the read's index, with atomicAdd; a read whose index depends on b and h only (a per-head
// slope) is summed in a register over the tile, then across the warp, and added once per warp and tile.
// The order of the float adds varies, so deterministic mode takes the exact form (CUFLASH_AGRAD_EXACT 1):
// each term is split into signed integer limbs and added with 64-bit integer atomics, which give the same
// sums in any order (below: exact_grad_add).
//
// Block-sparse masks (the CUFLASH_BLOCK_SPARSE 1 variants of a traced mask_mod; score_mods.cuh): the
// flat loop walks, per query head of the kv head, the query blocks the block mask's transposed index
// lists for this key tile's block (partial ones, then full ones: mask_mod evaluated on the partial
// tiles only), instead of every query tile that the causal / window mask lets see the keys.
//
// Variant prelude (cuflash/kernels/attention_bwd_mma.py): CUFLASH_ENTRY, CUFLASH_T, CUFLASH_BF16,
// CUFLASH_HEAD_DIM_MAX, CUFLASH_BLOCK_M (Br), CUFLASH_BLOCK_N (Bc), CUFLASH_THREADS,
// CUFLASH_STAGES, CUFLASH_SDP_WARPS_M, CUFLASH_DKV_WARPS_N, CUFLASH_DQ_WARPS_M, CUFLASH_DQ_PASSES,
// CUFLASH_SMEM_BYTES (checked below).
#include "ptx.cuh"

typedef CUFLASH_T elem_t;

#define BR CUFLASH_BLOCK_M
#define BC CUFLASH_BLOCK_N
#define DMAX CUFLASH_HEAD_DIM_MAX
#define NT CUFLASH_THREADS
#define STAGES CUFLASH_STAGES
#define NWARPS (NT / 32)
#define PITCH (DMAX + 8)          // row pitch of K, V, Q, dO (elements)
#define PP (BC + 8)               // row pitch of P and dS
#define CHUNKS (DMAX / 8)         // 16-byte chunks per row
#define KSTEPS_D (DMAX / 16)      // k-steps of S and dP (over the head dim)
#define LOG2E 1.4426950408889634f

// Warp layouts, one per GEMM shape: warps along the first output axis x along the second.
#define S_WM CUFLASH_SDP_WARPS_M           // S, dP: along queries ...
#define S_WN (NWARPS / S_WM)               // ... and keys
#define KV_WN CUFLASH_DKV_WARPS_N          // dK, dV: along keys ...
#define KV_WD (NWARPS / KV_WN)             // ... and columns
#define Q_WM CUFLASH_DQ_WARPS_M            // dQ: along queries ...
#define Q_WD (NWARPS / Q_WM)               // ... and columns
#define MF_S (BR / S_WM / 16)              // a warp's 16-row fragments and 8-column blocks of S, dP
#define NF_S (BC / S_WN / 8)
#define MF_KV (BC / KV_WN / 16)            // ... of dK, dV
#define NF_KV (DMAX / KV_WD / 8)
#define MF_Q (BR / Q_WM / 16)              // ... of dQ
#define NF_Q (DMAX / Q_WD / 8)
#define DQ_PASSES CUFLASH_DQ_PASSES        // dQ in column passes (registers: NF_QP blocks at a time)
#define NF_QP (NF_Q / DQ_PASSES)

static_assert(NWARPS % S_WM == 0 && NWARPS % KV_WN == 0 && NWARPS % Q_WM == 0, "warp layouts must tile the warps");
static_assert(MF_S >= 1 && MF_KV >= 1 && MF_Q >= 1 && BR % (16 * S_WM) == 0 && BC % (16 * KV_WN) == 0 &&
              BR % (16 * Q_WM) == 0, "every warp owns whole 16-row fragments");
static_assert(NF_S % 2 == 0 && NF_KV % 2 == 0 && NF_QP % 2 == 0 && NF_Q % DQ_PASSES == 0 && BC % (16 * S_WN) == 0 &&
              DMAX % (16 * KV_WD) == 0 && DMAX % (16 * Q_WD) == 0, "B operands come as 16-column ldmatrix.x4 pairs");
static_assert(STAGES == 1 || STAGES == 2, "one or two Q/dO stages");
static_assert(DMAX % 16 == 0 && CHUNKS % 2 == 0 && (PP / 8) % 2 == 1, "pitches must be odd chunk counts");
static_assert(NT >= 2 * BR, "one thread per lse and per Dd element of a query tile");
static_assert(2 * (2 * BC * PITCH + 2 * STAGES * BR * PITCH + 2 * BR * PP) + 4 * 2 * STAGES * BR == CUFLASH_SMEM_BYTES,
              "the variant's shared-memory size (cuflash/kernels/attention_bwd_mma.py) disagrees with this layout");

#include "mma_tile.cuh"
#ifndef CUFLASH_DROPOUT
#define CUFLASH_DROPOUT 0
#endif
#if CUFLASH_DROPOUT
#if DMAX == 192
#define CUFLASH_PHILOX_UNROLL 2   // d192: the unrolled rounds' temporaries spill 8 bytes beside dK/dV
#endif
#include "dropout.cuh"
#endif
#include "score_mods.cuh"
static_assert(!CUFLASH_BLOCK_SPARSE || !CUFLASH_VARLEN, "a block mask is read by the fixed-shape modifier forms only");

// Unrolling of the products' k-step loops. A traced function's form (CUFLASH_USER_MOD) is compiled
// cold on the first call with a new function; at head dims 192 and 256, fully unrolled, that took
// NVRTC 1.4-2.0 s of CPU on a 2-core machine. There dQ's column passes and k-steps run as loops, and
// where the spills measured no larger (head dim 192; at 256 on sm_90 and newer, block masks
// excepted) so do dK/dV's k-steps, and S/dP's k-steps four at a time: 0.2-0.5 s less (a loop's
// register arrays stay indexed by constants; the k-step moves only shared-memory offsets and dQ's
// column). Every other form is unrolled fully, as before.
#define BWD_PRAGMA(x) _Pragma(#x)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define BWD_ARCH_SM90 1
#else
#define BWD_ARCH_SM90 0
#endif
#if CUFLASH_USER_MOD && DMAX >= 192
#define UNROLL_DQ_PASSES BWD_PRAGMA(unroll 1)
#if DMAX == 256 && CUFLASH_BLOCK_SPARSE && BWD_ARCH_SM90
#define UNROLL_DQ_K BWD_PRAGMA(unroll)
#else
#define UNROLL_DQ_K BWD_PRAGMA(unroll 1)
#endif
#if DMAX == 192 || (BWD_ARCH_SM90 && !CUFLASH_BLOCK_SPARSE)
#define UNROLL_SDP_K BWD_PRAGMA(unroll 4)
#define UNROLL_KV_K BWD_PRAGMA(unroll 1)
#else
#define UNROLL_SDP_K BWD_PRAGMA(unroll)
#define UNROLL_KV_K BWD_PRAGMA(unroll)
#endif
#else
#define UNROLL_DQ_PASSES BWD_PRAGMA(unroll)
#define UNROLL_DQ_K BWD_PRAGMA(unroll)
#define UNROLL_SDP_K BWD_PRAGMA(unroll)
#define UNROLL_KV_K BWD_PRAGMA(unroll)
#endif

#ifndef CUFLASH_AGRAD_EXACT
#define CUFLASH_AGRAD_EXACT 0
#endif
#if (CUFLASH_USER_MOD & 4) && CUFLASH_AGRAD_EXACT
// Deterministic captured-array gradients (deterministic=True): an element's gradient is AGX_LIMBS signed
// 64-bit limbs of AGX_W bits each (limb i weighs 2^(AGX_W i - 149), 2^-149 being float32's least subnormal
// step, so 12 x 24 bits reach past float32's largest finite value) and a flag word. A finite term m 2^e (m
// the 24-bit significand) adds m << (e mod AGX_W), signed, split into its low AGX_W bits (limb k, >= 0) and
// the rest (limb k + 1, |hi| <= 2^24): integer adds, exact and in any order the same sum (a limb holds 2^39
// terms before it could overflow; cuflash/kernels/attention_bwd_mma.py refuses larger problems). A NaN or
// infinite term ORs 1 (NaN), 2 (+inf) or 4 (-inf) into the flag word. cuflash/kernels/backward_run.py
// turns the limbs into float32 after the launches. The layout of an element: AGX_LIMBS + 1 int64, the
// array's element strides (G.s) counting int64 elements.
#define AGX_W 24
#define AGX_LIMBS 12
struct ExactGradPtr {   // an element's limbs (what G.p[n] + offset gives in this form)
    long long* p;
};
__device__ __forceinline__ ExactGradPtr operator+(ExactGradPtr a, long long off) { return ExactGradPtr{a.p + off}; }
struct ExactGrads {
    ExactGradPtr p[4];
    long long s[4][3];
};
// Out of line: the traced function's terms call it from every pair's code, and inlined copies made the
// head-dim-256 sm_90 form take 2.0-2.2 s of NVRTC 13's CPU to compile, 1.75-1.85 s out of line (idle
// machine; the spill figures of both are in SPILLING_FORMS, cuflash/kernels/attention_bwd_mma.py).
__device__ __noinline__ void exact_grad_add(ExactGradPtr e, float x) {
    const unsigned bits = __float_as_uint(x), ex = (bits >> 23) & 255u;
    if (ex == 255u) {   // NaN or an infinity
        atomicOr(reinterpret_cast<unsigned*>(e.p + AGX_LIMBS), (bits & 0x7fffffu) ? 1u : (bits >> 31) ? 4u : 2u);
        return;
    }
    const unsigned m = (bits & 0x7fffffu) | (ex ? 0x800000u : 0u);
    if (m == 0u) return;
    const int pos = (ex ? (int)ex : 1) - 1;   // the step of m's last bit above 2^-149: 0 .. 253
    const int limb = pos / AGX_W;
    long long v = (long long)m << (pos - limb * AGX_W);
    if (bits >> 31) v = -v;
    const long long hi = v >> AGX_W;   // (arithmetic shift: v = hi 2^AGX_W + lo, 0 <= lo < 2^AGX_W)
    atomicAdd(reinterpret_cast<unsigned long long*>(e.p + limb), (unsigned long long)(v & ((1ll << AGX_W) - 1)));
    if (hi != 0) atomicAdd(reinterpret_cast<unsigned long long*>(e.p + limb + 1), (unsigned long long)hi);
}
// The emitted terms' adds (cuflash/runtime/score_mod.py: array_grad_c), in this form.
__device__ __forceinline__ void atomicAdd(ExactGradPtr e, float x) { exact_grad_add(e, x); }
__device__ __forceinline__ void cuflash_warp_atomic_add(ExactGradPtr e, float v) {   // (fixed shuffle order)
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(CUFLASH_FULL_MASK, v, o);
    if ((threadIdx.x & 31) == 0 && v != 0.0f) exact_grad_add(e, v);
}
#define AGRAD_G                                                                                                    \
    ExactGrads{{{reinterpret_cast<long long*>(user_g0)}, {reinterpret_cast<long long*>(user_g1)},                  \
                {reinterpret_cast<long long*>(user_g2)}, {reinterpret_cast<long long*>(user_g3)}},                 \
               {{user_gs00, user_gs01, user_gs02}, {user_gs10, user_gs11, user_gs12}, {user_gs20, user_gs21, user_gs22}, \
                {user_gs30, user_gs31, user_gs32}}}
#elif CUFLASH_USER_MOD & 4
#define AGRAD_G CUFLASH_AGRAD_INIT
#endif

// One (query head, query tile) step of the block's flat loop.
struct QueryTile {
    int hq;     // query head
    int row0;   // first query row
#if CUFLASH_BLOCK_SPARSE
    int pos;       // its place in the head's list of the block mask's query tiles
    int partial;   // 1: a partial block (mask_mod evaluated), 0: a full one
#endif
};

// This thread's shared-memory byte offsets of the loop's ldmatrix operands: every ldmatrix reads
// at a tile base (uniform) plus one of these plus a constant (one [R + immediate] operand), so no
// address arithmetic is left among the products. Formed once before the loop where the registers
// allow (HOIST_OFFSETS: ptxas 12.9 and 13.x fit them beside the fixed-length, head-dim <= 128
// accumulators), else at the top of each product phase from an opaque copy of the thread index.
struct SmemOffsets {
    unsigned qa;    // A of S, dP: Q, dO rows (from the stage's Q, dO)
    unsigned kb;    // B of S, dP: K, V rows
    unsigned pt;    // A of dV, dK: P^T, dS^T (ldmatrix.trans)
    unsigned dot;   // B of dV, dK: dO, Q stored k-major (ldmatrix.trans)
    unsigned dsa;   // A of dQ: dS rows
    unsigned kt;    // B of dQ: K stored k-major (ldmatrix.trans)
};
#define HOIST_OFFSETS (!CUFLASH_VARLEN && DMAX <= 128)
// The plain forms' loop forms its next query tile once per iteration (the refill's and the next
// one) and tests whether a tile needs a mask against a range of first rows formed before the loop.
// The modifier and dropout forms keep the previous code, so their register allocation, at the edge
// of spilling at head dims 192 and 256, stays as the compile gate measured it.
#define PLAIN_LOOP (!CUFLASH_MODS && !CUFLASH_DROPOUT)
// Deterministic mode's dQ (each block's read-modify-write of its split's partial, no atomics) is a
// compile-time form of the plain forms (CUFLASH_DETERMINISTIC_DQ 1, entry suffix _det): the atomic
// form's loop then holds no branch to it, nor the deterministic one a branch to the atomics. The
// modifier and dropout forms keep the run-time argument `deterministic` (one cubin for both modes).
#ifndef CUFLASH_DETERMINISTIC_DQ
#define CUFLASH_DETERMINISTIC_DQ 0
#endif
static_assert(!CUFLASH_DETERMINISTIC_DQ || PLAIN_LOOP, "the deterministic dQ form is a plain form's");
#define DQ_DETERMINISTIC (PLAIN_LOOP ? CUFLASH_DETERMINISTIC_DQ : deterministic)
// The plain forms' band mask of a masked tile inside Sq and Sk (the loop's P/dS below); not in the
// packed forms, where NVRTC 13 then spilled 16 bytes at head dim 128 on sm_90.
#define BWD_BAND_MASK (!CUFLASH_VARLEN)
// The interior tiles' own dQ adds (no test per element) beside the edge tiles' predicated ones;
// not in the score-modifier forms, where the second path's registers spill at head dims 192 and
// 256 (and every tile takes the per-pair path anyway).
#define INTERIOR_PATHS (!CUFLASH_MODS)
// The fixed plain forms' atomic dQ workspace (backward_run.py): rows per (batch, query head) padded to
// a multiple of BR and a row pitch of DMAX, so every element a tile adds is this head's own (the
// padding, rows past Sq and columns past the head dim, is never read back) and an edge tile adds like
// an interior one, without a test per element. The packed and deterministic forms keep (batch, Hq,
// rows, head_dim) and the tests, and so do head dims 192 and 256 (at 256 it spilled 4 bytes under
// NVRTC 13 on sm_90).
// The host chooses the layout (AttentionBwdMma.dq_padded, which sizes the workspace) and says so
// with CUFLASH_DQ_PADDED; the kernel only checks that the form can take it.
#ifndef CUFLASH_DQ_PADDED
#define CUFLASH_DQ_PADDED 0
#endif
#define DQ_PADDED CUFLASH_DQ_PADDED
static_assert(!DQ_PADDED || (PLAIN_LOOP && !CUFLASH_VARLEN && !CUFLASH_DETERMINISTIC_DQ && DMAX <= 128),
              "the padded dQ workspace: fixed plain forms with atomic dQ, head-dim buckets up to 128");
#define DQ_PITCH (DQ_PADDED ? DMAX : head_dim)
// ... and their edge tiles (rows past Sq or keys past Sk) take the band mask too, with the row and key
// bounds folded into one bound per row (the loop's P/dS below). The other forms keep the per-row key
// range there: with their per-element dQ tests on the edge tile NVRTC 12.9 spilled 8-12 bytes.
#define EDGE_BAND_MASK (BWD_BAND_MASK && DQ_PADDED)
// ... and their own Q/dO copies (no predicates), where they take one address per thread
// (load_tile_async_full's regular case) and the dK/dV accumulators leave room for a second copy
// path (head dims <= 128, and 256 in the plain forms on sm_90 and newer: at 256 it spills on sm_80,
// and in the dropout forms on sm_90).
#define INTERIOR_COPIES \
    (INTERIOR_PATHS && (DMAX <= 128 || (BWD_ARCH_SM90 && PLAIN_LOOP)) && NT % CHUNKS == 0 && BR * CHUNKS % NT == 0)

// ... and the edge tiles' Q/dO copies in the plain forms: load_tile_async's copies at the interior
// copies' addresses, each row's 16 bytes read when the row is before Sq and the chunk before the
// head dim, else zeros (cp.async's ignore-src: the source, a row past Sq, is not read at all, PTX ISA),
// so a copy's test is one compare of a constant. Not in the sm_75 form, whose register-staged copies
// keep load_tile_async's order (every load, then every store).
#define EDGE_COPIES (INTERIOR_COPIES && PLAIN_LOOP && !CUFLASH_SM75_FORM)
// ... and the plain forms' lse / Dd copies: a row past Sq copies from its own address with the source
// ignored (cp.async ignore-src: zeros, nothing read), not from another address selected for it. Not in the
// packed deterministic forms (4 bytes spilled at head dim 128 on sm_90 under NVRTC 12.9 and 13) nor the
// sm_75 form.
#define LSE_IGNORE_SRC (PLAIN_LOOP && !CUFLASH_SM75_FORM && !(CUFLASH_VARLEN && CUFLASH_DETERMINISTIC_DQ))
__device__ __forceinline__ void load_rows_async_edge(elem_t* dst, const elem_t* __restrict__ src, long long row_stride,
                                                     int n_rows, int n_cols) {
    constexpr int RPP = NT / CHUNKS;   // rows per pass (INTERIOR_COPIES: NT % CHUNKS == 0, BR * CHUNKS % NT == 0)
    const int tid = ptx_opaque(static_cast<int>(threadIdx.x));   // (its own addresses: the interior copies' stay as they were)
    const int r0 = tid / CHUNKS, c = tid % CHUNKS;
    const elem_t* s = src + r0 * row_stride + c * 8;
    elem_t* d = dst + r0 * PITCH + c * 8;
    const int seen = c * 8 < ptx_opaque(n_cols) ? ptx_opaque(n_rows) - r0 : 0;   // pass i reads when i RPP < seen
#pragma unroll
    for (int i = 0; i < BR * CHUNKS / NT; ++i)
        ptx_cp_async_16_ignore_src(d + i * RPP * PITCH, s + i * RPP * row_stride, i * RPP >= seen);
}

// A thread's ldmatrix row addresses (elements, relative to a tile base) and its warp's place in
// each GEMM's layout. A: non-transposed (16 rows x 16 k, rows stored m-major): a_off; A from rows
// stored k-major (ldmatrix.trans: P^T, dS^T): pat_off; B from rows stored n-major: b_off; B from
// rows stored k-major (ldmatrix.trans): bt_off (= a_off); A from P/dS rows: pa_off. Matrix order
// as the mma fragments: A (m 0-7, k 0-7), (m 8-15, k 0-7), (m 0-7, k 8-15), (m 8-15, k 8-15);
// B x4: two n8 blocks. Beside the ldmatrix offsets (SmemOffsets), the loop recomputes them from an
// opaque copy of the thread index where they are used (ptx_opaque: masks, P/dS stores, dQ), so
// they do not hold registers across the products.
struct LaneOffsets {
    int g, t, a_off, b_off, pa_off, pat_off;
    int s_row0, s_col0;     // S, dP: first query, first key
    int kv_row0, kv_col0;   // dK, dV: first key, first column
    int q_row0, q_col0;     // dQ: first query, first column
};

__device__ __forceinline__ LaneOffsets lane_offsets(int tid) {
    const int warp = tid / 32, lane = tid % 32, mat = lane / 8, mrow = lane % 8;
    LaneOffsets o;
    o.g = lane / 4;
    o.t = lane % 4;
    o.a_off = ((mat % 2) * 8 + mrow) * PITCH + (mat / 2) * 8;
    o.b_off = ((mat / 2) * 8 + mrow) * PITCH + (mat % 2) * 8;
    o.pa_off = ((mat % 2) * 8 + mrow) * PP + (mat / 2) * 8;
    o.pat_off = ((mat / 2) * 8 + mrow) * PP + (mat % 2) * 8;
    o.s_row0 = (warp % S_WM) * 16 * MF_S;
    o.s_col0 = (warp / S_WM) * 8 * NF_S;
    o.kv_row0 = (warp % KV_WN) * 16 * MF_KV;
    o.kv_col0 = (warp / KV_WN) * 8 * NF_KV;
    o.q_row0 = (warp % Q_WM) * 16 * MF_Q;
    o.q_col0 = (warp / Q_WM) * 8 * NF_Q;
    return o;
}

// The flat loop's per-tile offsets as n * stride with the non-negative index n (query head, row)
// zero-extended, so the 64-bit products need no sign words (their low 64 bits are the signed
// products'): 11-14 instructions fewer per tile at head dim 128. Not at 192, where ptxas 12.9 and
// 13.x then spill (16 compile-gate rows).
#define UNSIGNED_INDEX (DMAX != 192)
__device__ __forceinline__ long long index_times(int n, long long stride) {
    return static_cast<long long>(static_cast<unsigned long long>(static_cast<unsigned>(n)) *
                                  static_cast<unsigned long long>(stride));
}

__device__ __forceinline__ SmemOffsets smem_offsets(int tid) {
    const LaneOffsets o = lane_offsets(tid);
    SmemOffsets r;
    r.qa = 2u * (o.s_row0 * PITCH + o.a_off);
    r.kb = 2u * (o.s_col0 * PITCH + o.b_off);
    r.pt = 2u * (o.kv_row0 + o.pat_off);
    r.dot = 2u * (o.kv_col0 + o.a_off);
    r.dsa = 2u * (o.q_row0 * PP + o.pa_off);
    r.kt = 2u * (o.q_col0 + o.a_off);
    return r;
}

extern "C" __global__ void __launch_bounds__(NT, 1)
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
    extern __shared__ __align__(16) unsigned char smem_raw[];
    elem_t* k_s = reinterpret_cast<elem_t*>(smem_raw);     // [BC][PITCH]
    elem_t* v_s = k_s + BC * PITCH;                        // [BC][PITCH]
    elem_t* q_s = v_s + BC * PITCH;                        // [STAGES][BR][PITCH]
    elem_t* do_s = q_s + STAGES * BR * PITCH;              // [STAGES][BR][PITCH]
    elem_t* p_s = do_s + STAGES * BR * PITCH;              // [BR][PP]
    elem_t* ds_s = p_s + BR * PP;                          // [BR][PP]
    float* lse_s = reinterpret_cast<float*>(ds_s + BR * PP);   // [STAGES][BR]
    float* dd_s = lse_s + STAGES * BR;                         // [STAGES][BR]

    const int tid = threadIdx.x;
    const GridCoord at = grid_coord(num_splits, num_heads_k);
    const int split = at.tile, head_k = at.head;
    const long long batch = at.batch;
    const int tile = tile0 + split;
    if (tile >= tile_end) return;   // the whole block
    const int num_heads_q = num_heads_k * group_size;
    const float scale_log2 = softmax_scale * LOG2E;
    float* dq_part = dq_accum + (DQ_DETERMINISTIC ? split * dq_split_stride : 0LL);
    // Dd and the dQ workspace are (batch, Hq, stat_rows) rows: Sq per batch, or one packed
    // sequence of total_q rows (varlen), where this sequence starts at stat_q0.
    const int stat_rows = seqlen_q, seqlen_k_total = seqlen_k;
    const int ws_rows = DQ_PADDED ? (seqlen_q + BR - 1) / BR * BR : seqlen_q;   // dQ workspace rows per head
    long long stat_batch = batch;
    int stat_q0 = 0, keys = seqlen_k;   // keys: the rows of dK/dV this block may write
    if (CUFLASH_VARLEN) {   // a packed batch: this sequence's rows and lengths (common.cuh)
        const VarlenSeq sq = varlen_seq_uniform(batch, varlen, cu_seqlens_q, cu_seqlens_k, seqused_k, seqlen_q, seqlen_k);
        q += sq.q0 * q_row_stride, dout += sq.q0 * do_row_stride, lse += sq.q0;
        k += sq.k0 * k_row_stride, v += sq.k0 * v_row_stride;   // dk and dv move in the epilogue
        seqlen_q = sq.seqlen_q, seqlen_k = sq.seqlen_k, keys = sq.keys;
        stat_batch = 0, stat_q0 = sq.q0;
    }

    const int col0 = tile * BC;
    if (CUFLASH_VARLEN && col0 >= keys) return;   // a packed sequence shorter than the grid's key tiles
    const int cols = CUFLASH_VARLEN ? max(0, min(BC, seqlen_k - col0)) : min(BC, seqlen_k - col0);   // 0: past seqused_k
    // Query rows that see some key of this tile, [row_lo, row_hi), and the flat loop's length.
    const IndexRange rows_seen = window_query_range(col0, cols, seqlen_q, seqlen_k, window_left, window_right);
    const int first_row0 = rows_seen.lo - rows_seen.lo % BR;
    const int row_hi = rows_seen.hi;
    const int q_tiles = (!CUFLASH_VARLEN || cols > 0) && rows_seen.hi > rows_seen.lo ? (row_hi - first_row0 + BR - 1) / BR : 0;
#if CUFLASH_BLOCK_SPARSE
    // The block mask's transposed index (score_mods.cuh): per query head of the group, the query blocks
    // that see this key tile's key block, partial ones then full ones, each as bs_sub tiles of BR rows.
    const long long bs_b = user_batch0 + batch;
    const long long bs_at = (long long)col0 / bs_outer;
    const int bs_sub = bs_inner / BR;
    const int hq_end = (head_k + 1) * group_size;
    auto bs_len = [&](int hq) {   // query tiles of head hq
        const long long o = bs_b * bs_num_bs + hq * bs_num_hs + bs_at;
        return (bs_num[o] + bs_full_num[o]) * bs_sub;
    };
    auto bs_place = [&](QueryTile at) {   // row0 and partial of at.hq's tile at.pos
        const long long o = bs_b * bs_num_bs + at.hq * bs_num_hs + bs_at;
        const long long io = bs_b * bs_idx_bs + at.hq * bs_idx_hs + bs_at * bs_idx_rs;
        const int e = at.pos / bs_sub, np = bs_num[o];
        at.partial = e < np;
        at.row0 = (at.partial ? bs_idx[io + e] : bs_full_idx[io + e - np]) * bs_inner + (at.pos - e * bs_sub) * BR;
        return at;
    };
    auto bs_settle = [&](QueryTile at) {   // on to the next head with a tile left (none: at.hq = hq_end)
        while (at.hq < hq_end && at.pos >= bs_len(at.hq)) {
            ++at.hq;
            at.pos = 0;
        }
        return at.hq < hq_end ? bs_place(at) : at;
    };
    int n_iter = 0;
    if (!CUFLASH_VARLEN || cols > 0)
        for (int hq = head_k * group_size; hq < hq_end; ++hq) n_iter += bs_len(hq);
#else
    const int n_iter = q_tiles * group_size;
#endif

    // Q, dO, lse, Dd of query tile `at` into stage `st` (one cp.async group with what precedes it).
    // An interior tile (every row and column in view) copies without predicates.
    auto load_query_tile = [&](int st, QueryTile at) {
        const int rows = min(BR, seqlen_q - at.row0);
#if UNSIGNED_INDEX
        const elem_t* q_tile = q + batch * q_batch_stride + index_times(at.hq, q_head_stride) + index_times(at.row0, q_row_stride);
        const elem_t* do_tile =
            dout + batch * do_batch_stride + index_times(at.hq, do_head_stride) + index_times(at.row0, do_row_stride);
#else
        const elem_t* q_tile = q + batch * q_batch_stride + at.hq * q_head_stride + at.row0 * q_row_stride;
        const elem_t* do_tile = dout + batch * do_batch_stride + at.hq * do_head_stride + at.row0 * do_row_stride;
#endif
        if (INTERIOR_COPIES && rows == BR && head_dim == DMAX && head_dim_v == DMAX) {
            load_tile_async_full<BR>(q_s + st * BR * PITCH, q_tile, q_row_stride);
            load_tile_async_full<BR>(do_s + st * BR * PITCH, do_tile, do_row_stride);
        } else if (EDGE_COPIES) {
            load_rows_async_edge(q_s + st * BR * PITCH, q_tile, q_row_stride, rows, head_dim);
            load_rows_async_edge(do_s + st * BR * PITCH, do_tile, do_row_stride, rows, head_dim_v);
        } else {
            load_tile_async<BR>(q_s + st * BR * PITCH, q_tile, q_row_stride, rows, head_dim);
            load_tile_async<BR>(do_s + st * BR * PITCH, do_tile, do_row_stride, rows, head_dim_v);
        }
        if (tid < 2 * BR) {   // threads [0, BR): lse; [BR, 2 BR): Dd (rows >= Sq: 0, masked)
            const int r = tid % BR;
#if UNSIGNED_INDEX
            const float* src = tid < BR ? lse + batch * lse_batch_stride + index_times(at.hq, lse_head_stride)
                                        : dd + index_times(at.hq, stat_rows) + (stat_batch * num_heads_q * stat_rows + stat_q0);
#else
            const float* src = tid < BR ? lse + batch * lse_batch_stride + at.hq * lse_head_stride
                                        : dd + (stat_batch * num_heads_q + at.hq) * (long long)stat_rows + stat_q0;
#endif
            float* dst = (tid < BR ? lse_s : dd_s) + st * BR + r;
            const bool valid = at.row0 + r < seqlen_q;
            if (LSE_IGNORE_SRC)   // (a row past Sq: its address is formed, never read)
                ptx_cp_async_4_ignore_src(dst, src + at.row0 + r, !valid);
            else
                ptx_cp_async_4_zfill(dst, valid ? src + at.row0 + r : src, valid ? 4 : 0);
        }
    };
#if CUFLASH_BLOCK_SPARSE
    auto next_tile = [&](QueryTile at) {
        ++at.pos;
        return bs_settle(at);
    };
    QueryTile cur = bs_settle(QueryTile{head_k * group_size, first_row0, 0, 1});
#else
    auto next_tile = [&](QueryTile at) {
        at.row0 += BR;
        if (at.row0 >= row_hi) {
            at.row0 = first_row0;
            ++at.hq;
        }
        return at;
    };

    QueryTile cur = {head_k * group_size, first_row0};
#endif
    if (n_iter > 0) {   // prologue: K, V and the first query tile, one group
        load_tile_async<BC>(k_s, k + batch * k_batch_stride + head_k * k_head_stride + col0 * k_row_stride,
                            k_row_stride, cols, head_dim);
        load_tile_async<BC>(v_s, v + batch * v_batch_stride + head_k * v_head_stride + col0 * v_row_stride,
                            v_row_stride, cols, head_dim_v);
        load_query_tile(0, cur);
        ptx_cp_async_commit();
    }

    float dk_acc[MF_KV][NF_KV][4], dv_acc[MF_KV][NF_KV][4];
#pragma unroll
    for (int f = 0; f < MF_KV; ++f)
#pragma unroll
        for (int n = 0; n < NF_KV; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) dk_acc[f][n][e] = dv_acc[f][n][e] = 0.0f;

    // The query tiles that need no mask are those whose first row lies in [unmasked.lo, unmasked.hi]
    // (a closed range, empty when lo > hi): all BR rows before Sq, all BC keys before Sk, and every
    // pair in the window (tile_in_window, solved for row0 in 64 bits, then clamped), so a tile's test
    // is two compares of uniform values.
    IndexRange unmasked = {0, seqlen_q - BR};
    if (PLAIN_LOOP) {
        const long long first = (long long)(col0 + BC - 1 - seqlen_k) + seqlen_q - window_right;   // right edge
        const long long last = (long long)(col0 - seqlen_k) + seqlen_q - BR + 1 + window_left;      // left edge
        if (window_right >= 0) unmasked.lo = (int)min(max(first, 0LL), (long long)seqlen_q);
        if (window_left >= 0) unmasked.hi = (int)max(min(last, (long long)unmasked.hi), -1LL);
        if (cols < BC) unmasked.hi = -1;
        unmasked.lo = ptx_opaque(unmasked.lo), unmasked.hi = ptx_opaque(unmasked.hi);   // (formed here, not in the loop)
    }

    const SmemOffsets so_loop = smem_offsets(tid);   // (held across the loop only where HOIST_OFFSETS)

#if CUFLASH_BLOCK_SPARSE && defined(CUFLASH_SIM)
    int bs_entered[2] = {0, 0};   // tiles entered: partial, full (the simulator's count)
#endif
    for (int it = 0; it < n_iter; ++it) {
#if CUFLASH_BLOCK_SPARSE && defined(CUFLASH_SIM)
        ++bs_entered[cur.partial ? 0 : 1];
#endif
        const int st = STAGES == 2 ? it % 2 : 0;
        const elem_t* qs = q_s + st * BR * PITCH;
        const elem_t* dos = do_s + st * BR * PITCH;
        const int row0 = cur.row0;
        const int rows = min(BR, seqlen_q - row0);
        const QueryTile nxt = next_tile(cur);   // (formed once where PLAIN_LOOP: the refill's tile and the next iteration's)
        ptx_cp_async_wait<0>();   // this thread's copies of tile it (and of K, V) have landed
        __syncthreads();          // every thread's; and every thread is done with tile it - 1
        if (STAGES == 2 && it + 1 < n_iter) {
            load_query_tile(st ^ 1, PLAIN_LOOP ? nxt : next_tile(cur));   // the stage tile it - 1 used
            ptx_cp_async_commit();
        }

#if CUFLASH_MODS
        const LaneOffsets l1 = lane_offsets(ptx_opaque(tid));
#endif
#if CUFLASH_DROPOUT
        const LaneOffsets l0 = lane_offsets(ptx_opaque(tid));
        // The keep bits of this lane's S elements, drawn before the products, where registers are
        // free (dropout.cuh: bit 2 ((f * 2 + h) * NF_S + n) + c for row 16 f + 8 h + g, key 8 n + 2 t + c)
        const DropoutArgs dr = {dropout_seed, dropout_offset, dropout_threshold, dropout_scale};
        const unsigned keep_word = dropout_tile_bits<MF_S, NF_S>(dr, (unsigned)(dropout_batch0 + batch), (unsigned)cur.hq,
                                                                 row0 + l0.s_row0 + l0.g, col0 + l0.s_col0 + 2 * l0.t);
#define CUFLASH_KEPT(f, h, n, c) ((keep_word >> (2 * (((f) * 2 + (h)) * NF_S + (n)) + (c))) & 1u)
#endif
        // S = Q K^T and dP = dO V^T for this warp's 16 MF_S queries x 8 NF_S keys.
        const SmemOffsets o1 = HOIST_OFFSETS ? so_loop : smem_offsets(ptx_opaque(tid));
        float s[MF_S][NF_S][4], dp[MF_S][NF_S][4];
#pragma unroll
        for (int f = 0; f < MF_S; ++f)
#pragma unroll
            for (int n = 0; n < NF_S; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[f][n][e] = dp[f][n][e] = 0.0f;
UNROLL_SDP_K
        for (int kk = 0; kk < KSTEPS_D; ++kk) {
            unsigned a[MF_S][4];
#pragma unroll
            for (int f = 0; f < MF_S; ++f) ptx_ldmatrix_x4_at(a[f], qs, o1.qa + 2 * (16 * f * PITCH + kk * 16));
#pragma unroll
            for (int np = 0; np < NF_S / 2; ++np) {
                unsigned b[4];
                ptx_ldmatrix_x4_at(b, k_s, o1.kb + 2 * (16 * np * PITCH + kk * 16));
                const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
#pragma unroll
                for (int f = 0; f < MF_S; ++f) {
                    mma16816(s[f][2 * np], a[f], b0);
                    mma16816(s[f][2 * np + 1], a[f], b1);
                }
            }
#pragma unroll
            for (int f = 0; f < MF_S; ++f) ptx_ldmatrix_x4_at(a[f], dos, o1.qa + 2 * (16 * f * PITCH + kk * 16));
#pragma unroll
            for (int np = 0; np < NF_S / 2; ++np) {
                unsigned b[4];
                ptx_ldmatrix_x4_at(b, v_s, o1.kb + 2 * (16 * np * PITCH + kk * 16));
                const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
#pragma unroll
                for (int f = 0; f < MF_S; ++f) {
                    mma16816(dp[f][2 * np], a[f], b0);
                    mma16816(dp[f][2 * np + 1], a[f], b1);
                }
            }
        }

        // Dropout (CUFLASH_DROPOUT): with Z a pair's keep bit (dropout.cuh) and c = 1 / (1 - p), dV
        // takes P Z c (stored as P) and dS = P (dP Z c - Dd); Z from keep_word (drawn above).
        // P (in s) and dS (in dp). Element e of block (f, n): query row l1.s_row0 + 16 f + l1.g + 8 (e >> 1),
        // key l1.s_col0 + 8 n + 2 t + (e & 1). Per row: lse in the log2 domain (-inf -> +inf: P = 0) and Dd.
#if !CUFLASH_MODS
        const LaneOffsets l1 = lane_offsets(ptx_opaque(tid));   // (formed after the products: no registers held across them)
#endif
        float lse2[MF_S][2], ddr[MF_S][2];
#pragma unroll
        for (int f = 0; f < MF_S; ++f)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = l1.s_row0 + 16 * f + l1.g + 8 * h;
                const float l = lse_s[st * BR + r];
                lse2[f][h] = l == CUFLASH_NEG_INF ? -CUFLASH_NEG_INF : l * LOG2E;
                ddr[f][h] = dd_s[st * BR + r];
            }
        // (the modifier variants take the per-pair path on every tile)
        const bool need_mask = CUFLASH_MODS || (PLAIN_LOOP ? row0 < unmasked.lo || row0 > unmasked.hi
                                                           : rows < BR || cols < BC ||
                                                                 !tile_in_window(row0, BR, col0, BC, seqlen_q, seqlen_k,
                                                                                 window_left, window_right));
#if !CUFLASH_MODS && !CUFLASH_DROPOUT
        // A masked tile of the plain forms. Inside Sq and Sk (a causal diagonal or a window edge), score
        // (f, h, n, c), of row row0 + s_row0 + g + 16 f + 8 h and key col0 + s_col0 + 2 t + 8 n + c, lies
        // d0 + kk right of its row's diagonal key (diag_distance), kk = 8 (n - 2 f - h) + c: one band of
        // kk holds for all the lane's rows, so each of the 2 (NF_S + 2 MF_S - 1) values of kk is tested
        // once (14 at 64 x 128) instead of each score against its row's two bounds, and only against the
        // bounds the window has. Visible: lo <= kk <= hi, each bound clamped to kk's range [KK_MIN,
        // KK_MAX] before d0 is subtracted, so nothing overflows. Other masked tiles (rows past Sq, keys
        // past Sk): in the EDGE_BAND_MASK forms the same bounds with Sq and Sk folded in, one per row and
        // side; elsewhere each row's visible keys [klo, khi) relative to this thread's first key, so a
        // pair's test is two compares of a constant (the modifier and dropout forms, whose registers are
        // shorter, keep the per-pair key index below).
        if (need_mask) {
            auto p_ds = [&](int f, int h, int n, int c, bool visible) {
                float& sv = s[f][n][2 * h + c];
                float& dv_ = dp[f][n][2 * h + c];
                const float p = exp2f(sv * scale_log2 - lse2[f][h]);
                dv_ = visible ? p * (dv_ - ddr[f][h]) : 0.0f;
                sv = visible ? p : 0.0f;
            };
            if (BWD_BAND_MASK && (EDGE_BAND_MASK || (rows == BR && cols == BC))) {
                constexpr int KK_MIN = -8 * (2 * MF_S - 1), KK_MAX = 8 * (NF_S - 1) + 1;
                const int d0 = (col0 + l1.s_col0 + 2 * l1.t - seqlen_k) + (seqlen_q - row0 - l1.s_row0 - l1.g);
                auto band = [&](int lo, int hi) {
#pragma unroll
                    for (int f = 0; f < MF_S; ++f)
#pragma unroll
                        for (int h = 0; h < 2; ++h)
#pragma unroll
                            for (int n = 0; n < NF_S; ++n)
#pragma unroll
                                for (int c = 0; c < 2; ++c) {
                                    const int kk = 8 * (n - 2 * f - h) + c;
                                    p_ds(f, h, n, c, kk >= lo && kk <= hi);
                                }
                };
                auto lo_k = [&]() { return max(-window_left, d0 + KK_MIN) - d0; };   // (window_left >= 0)
                auto hi_k = [&]() { return min(window_right, d0 + KK_MAX) - d0; };   // (window_right >= 0)
                // A tile past Sq or Sk (EDGE_BAND_MASK): for row (f, h), kk <= hi is x = 8 n + c <= hi + 16 f
                // + 8 h, so with the key bound (x < kc: keys before Sk) and the row's (16 f + 8 h < rr: before
                // Sq) it is one bound on x per row (-1 past Sq), formed once for the row's 2 NF_S scores; the
                // left edge, where the window has one, a second.
                auto edge = [&]() {
                    const int rr = rows - l1.s_row0 - l1.g, kc = cols - l1.s_col0 - 2 * l1.t;
                    const int hi = window_right < 0 ? KK_MAX : max(hi_k(), KK_MIN - 1);
                    const int lo = window_left < 0 ? KK_MIN : min(lo_k(), KK_MAX + 1);
#pragma unroll
                    for (int f = 0; f < MF_S; ++f)
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            const int xhi = 16 * f + 8 * h < rr ? min(hi + 16 * f + 8 * h, kc - 1) : -1;
                            const int xlo = lo + 16 * f + 8 * h;
#pragma unroll
                            for (int n = 0; n < NF_S; ++n)
#pragma unroll
                                for (int c = 0; c < 2; ++c)
                                    p_ds(f, h, n, c, 8 * n + c <= xhi && 8 * n + c >= xlo);
                        }
                };
                // (a tile inside Sq and Sk with neither bound needs no mask: need_mask is false there)
                if (EDGE_BAND_MASK && (rows < BR || cols < BC)) {
                    edge();
                } else if (window_left < 0) {
                    band(KK_MIN, hi_k());   // causal, or a right edge alone: one bound
                } else {
                    band(lo_k(), window_right < 0 ? KK_MAX : hi_k());
                }
            } else {
                const int key0 = col0 + l1.s_col0 + 2 * l1.t;
#pragma unroll
                for (int f = 0; f < MF_S; ++f)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int qi = row0 + l1.s_row0 + 16 * f + l1.g + 8 * h;
                        IndexRange seen = window_key_range(qi, 1, seqlen_q, seqlen_k, window_left, window_right);
                        if (qi >= seqlen_q) seen.hi = seen.lo;   // padding rows see nothing
                        const int klo = seen.lo - key0, khi = seen.hi - key0;
#pragma unroll
                        for (int n = 0; n < NF_S; ++n)
#pragma unroll
                            for (int c = 0; c < 2; ++c) p_ds(f, h, n, c, 8 * n + c >= klo && 8 * n + c < khi);
                    }
            }
        } else
#endif
        if (need_mask) {
#if CUFLASH_USER_MOD & 4
            float ug_acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};   // this thread's sums of the tile-uniform gradient terms
#endif
#pragma unroll
            for (int f = 0; f < MF_S; ++f)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int qi = row0 + l1.s_row0 + 16 * f + l1.g + 8 * h;
                    IndexRange seen = window_key_range(qi, 1, seqlen_q, seqlen_k, window_left, window_right);
                    if (qi >= seqlen_q) seen.hi = seen.lo;   // padding rows see nothing
#if CUFLASH_MODS
                    // (per row, from the parameters: nothing of the modifiers stays in registers across rows)
                    const ScoreMods mods = CUFLASH_MODS_INIT;
                    const HeadMods hm = head_mods<elem_t>(mods, batch, cur.hq);
                    float* dbias_row = dbias + batch * dbias_batch_stride + cur.hq * dbias_head_stride + qi * dbias_row_stride;
#endif
#pragma unroll
                    for (int n = 0; n < NF_S; ++n)
#pragma unroll
                        for (int c = 0; c < 2; ++c) {
                            const int kj = col0 + l1.s_col0 + 8 * n + 2 * l1.t + c;
                            bool visible = kj >= seen.lo && kj < seen.hi;
                            float& sv = s[f][n][2 * h + c];
                            float& dv_ = dp[f][n][2 * h + c];
                            float z = sv * scale_log2;
#if CUFLASH_MODS
                            // the modified score; dS is d/dz, and d/d(scaled score) is dS * dcap
                            float dcap = 1.0f;
                            visible = visible && mask_keeps(mods, hm, qi, kj);
#if CUFLASH_USER_MOD & 4
                            float s_user = 0.0f;   // the score the traced score_mod received
#if CUFLASH_BLOCK_SPARSE
                            if (visible) z = mod_score<elem_t>(mods, hm, z, qi, kj, seqlen_q, seqlen_k, &dcap, cur.partial, &s_user);
#else
                            if (visible) z = mod_score<elem_t>(mods, hm, z, qi, kj, seqlen_q, seqlen_k, &dcap, true, &s_user);
#endif
#elif CUFLASH_BLOCK_SPARSE
                            if (visible) z = mod_score<elem_t>(mods, hm, z, qi, kj, seqlen_q, seqlen_k, &dcap, cur.partial);
#else
                            if (visible) z = mod_score<elem_t>(mods, hm, z, qi, kj, seqlen_q, seqlen_k, &dcap);
#endif
#endif
                            const float p = visible ? exp2f(z - lse2[f][h]) : 0.0f;
#if CUFLASH_DROPOUT
                            const bool kept = CUFLASH_KEPT(f, h, n, c);
                            dv_ = visible ? p * ((kept ? dv_ * dropout_scale : 0.0f) - ddr[f][h]) : 0.0f;
                            sv = kept ? p * dropout_scale : 0.0f;
#else
                            dv_ = visible ? p * (dv_ - ddr[f][h]) : 0.0f;
                            sv = p;
#endif
#if CUFLASH_MODS
                            if ((mod_flags & 16) && visible)   // d bias = dS: each (b, h, i, j) by one thread of one block
                                dbias_row[kj] = dv_;
#if CUFLASH_USER_MOD & 4
                            if (visible && z != CUFLASH_NEG_INF && dv_ != 0.0f) {   // the captured arrays' gradients (a hidden pair adds nothing)
                                const auto ug = AGRAD_G;
                                CUFLASH_SCORE_MOD_ARRAY_GRAD(s_user, hm.b, hm.h, qi, kj, mods.user, ug, dv_, ug_acc);
                            }
#endif
                            dv_ *= dcap;
#endif
                        }
                }
#if (CUFLASH_USER_MOD & 4) && defined(CUFLASH_SCORE_MOD_ARRAY_GRAD_WARP)
            {   // the tile-uniform terms: one add per warp (every lane is here: the branch is the block's)
                const ScoreMods mods = CUFLASH_MODS_INIT;
                const HeadMods hm = head_mods<elem_t>(mods, batch, cur.hq);
                const auto ug = AGRAD_G;
                CUFLASH_SCORE_MOD_ARRAY_GRAD_WARP(hm.b, hm.h, mods.user, ug, ug_acc);
            }
#endif
        } else {
#pragma unroll
            for (int f = 0; f < MF_S; ++f)
#pragma unroll
                for (int n = 0; n < NF_S; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const float p = exp2f(s[f][n][e] * scale_log2 - lse2[f][e >> 1]);
#if CUFLASH_DROPOUT
                        const bool kept = CUFLASH_KEPT(f, e >> 1, n, e & 1);
                        dp[f][n][e] = p * ((kept ? dp[f][n][e] * dropout_scale : 0.0f) - ddr[f][e >> 1]);
                        s[f][n][e] = kept ? p * dropout_scale : 0.0f;
#else
                        dp[f][n][e] = p * (dp[f][n][e] - ddr[f][e >> 1]);
                        s[f][n][e] = p;
#endif
                    }
        }
        // P, dS -> shared memory, [query][key], one 4-byte store per (row, key pair) (the thread's
        // offset formed here, not held across the loop: ptx_opaque).
        const int pds_off = (l1.s_row0 + l1.g) * PP + l1.s_col0 + 2 * l1.t;
#pragma unroll
        for (int f = 0; f < MF_S; ++f)
#pragma unroll
            for (int n = 0; n < NF_S; ++n)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int off = pds_off + (16 * f + 8 * h) * PP + 8 * n;
                    *reinterpret_cast<unsigned*>(p_s + off) = pack2(s[f][n][2 * h], s[f][n][2 * h + 1]);
                    *reinterpret_cast<unsigned*>(ds_s + off) = pack2(dp[f][n][2 * h], dp[f][n][2 * h + 1]);
                }
        __syncthreads();   // P and dS are complete

        // dV += P^T dO and dK += dS^T Q for this warp's 16 MF_KV keys x 8 NF_KV columns.
        const SmemOffsets o2 = HOIST_OFFSETS ? so_loop : smem_offsets(ptx_opaque(tid));
UNROLL_KV_K
        for (int kk = 0; kk < BR / 16; ++kk) {
            unsigned a[MF_KV][4];
#pragma unroll
            for (int f = 0; f < MF_KV; ++f) ptx_ldmatrix_x4_trans_at(a[f], p_s, o2.pt + 2 * (kk * 16 * PP + 16 * f));
#pragma unroll
            for (int c = 0; c < NF_KV / 2; ++c) {
                unsigned b[4];
                ptx_ldmatrix_x4_trans_at(b, dos, o2.dot + 2 * (kk * 16 * PITCH + 16 * c));
                const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
#pragma unroll
                for (int f = 0; f < MF_KV; ++f) {
                    mma16816(dv_acc[f][2 * c], a[f], b0);
                    mma16816(dv_acc[f][2 * c + 1], a[f], b1);
                }
            }
#pragma unroll
            for (int f = 0; f < MF_KV; ++f) ptx_ldmatrix_x4_trans_at(a[f], ds_s, o2.pt + 2 * (kk * 16 * PP + 16 * f));
#pragma unroll
            for (int c = 0; c < NF_KV / 2; ++c) {
                unsigned b[4];
                ptx_ldmatrix_x4_trans_at(b, qs, o2.dot + 2 * (kk * 16 * PITCH + 16 * c));
                const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
#pragma unroll
                for (int f = 0; f < MF_KV; ++f) {
                    mma16816(dk_acc[f][2 * c], a[f], b0);
                    mma16816(dk_acc[f][2 * c + 1], a[f], b1);
                }
            }
        }

        // dQ (this warp's 16 MF_Q rows x 8 NF_Q columns) += dS K, unscaled, into the workspace, in
        // DQ_PASSES passes over the columns (the accumulators of one pass: NF_QP blocks).
UNROLL_DQ_PASSES
        for (int pass = 0; pass < DQ_PASSES; ++pass) {
            const SmemOffsets o3 = HOIST_OFFSETS ? so_loop : smem_offsets(ptx_opaque(tid));
            float acc[MF_Q][NF_QP][4];
#pragma unroll
            for (int f = 0; f < MF_Q; ++f)
#pragma unroll
                for (int n = 0; n < NF_QP; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[f][n][e] = 0.0f;
UNROLL_DQ_K
            for (int kk = 0; kk < BC / 16; ++kk) {
                unsigned a[MF_Q][4];
#pragma unroll
                for (int f = 0; f < MF_Q; ++f) ptx_ldmatrix_x4_at(a[f], ds_s, o3.dsa + 2 * (16 * f * PP + kk * 16));
#pragma unroll
                for (int c = 0; c < NF_QP / 2; ++c) {
                    unsigned b[4];
                    ptx_ldmatrix_x4_trans_at(b, k_s, o3.kt + 2 * (kk * 16 * PITCH + pass * 8 * NF_QP + 16 * c));
                    const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
#pragma unroll
                    for (int f = 0; f < MF_Q; ++f) {
                        mma16816(acc[f][2 * c], a[f], b0);
                        mma16816(acc[f][2 * c + 1], a[f], b1);
                    }
                }
            }
            // Rows q_row0 + 16 f + g + 8 h, columns c0 + 8 n + 2 t, +1 (in view: r < rows, c < D): the
            // tile's first element plus this thread's offset, one sum per tile (ptx_opaque: not split
            // into per-thread pointers held across the loop, where registers are short), plus constants.
            const LaneOffsets l2 = lane_offsets(ptx_opaque(tid));
            const int c0 = l2.q_col0 + pass * 8 * NF_QP;   // this pass's first column
#if UNSIGNED_INDEX
            float* dq_thread = dq_part + ptx_opaque(index_times(cur.hq, (long long)ws_rows * DQ_PITCH) +
                                                    (stat_batch * num_heads_q * ws_rows + stat_q0) * DQ_PITCH +
                                                    index_times(row0 + l2.q_row0 + l2.g, DQ_PITCH) + c0 + 2 * l2.t);
#else
            float* dq_thread = dq_part + ptx_opaque(((stat_batch * num_heads_q + cur.hq) * (long long)ws_rows + stat_q0 + row0) *
                                                        DQ_PITCH + (l2.q_row0 + l2.g) * DQ_PITCH + c0 + 2 * l2.t);
#endif
            // an interior tile (every element is in view), or any tile of the padded workspace
            if (INTERIOR_PATHS && !DQ_DETERMINISTIC && (DQ_PADDED || (rows == BR && head_dim == DMAX))) {
#pragma unroll
                for (int f = 0; f < MF_Q; ++f)
#pragma unroll
                    for (int h = 0; h < 2; ++h)
#pragma unroll
                        for (int n = 0; n < NF_QP; ++n)
                            ptx_red_add_f32x2(dq_thread + (16 * f + 8 * h) * DMAX + 8 * n, acc[f][n][2 * h], acc[f][n][2 * h + 1]);
            } else if (DQ_DETERMINISTIC) {   // this thread's elements of its split's partial (warp-uniform branch)
#pragma unroll
                for (int f = 0; f < MF_Q; ++f)
#pragma unroll
                    for (int h = 0; h < 2; ++h)
#pragma unroll
                        for (int n = 0; n < NF_QP; ++n)
                            if ((PLAIN_LOOP && !CUFLASH_VARLEN && rows == BR && head_dim == DMAX) ||   // (an interior tile: no tests; not
                                 // in the packed forms, where the loads in flight spilled 16-32 bytes at head dim 128)
                                (l2.q_row0 + 16 * f + l2.g + 8 * h < rows && c0 + 8 * n + 2 * l2.t < head_dim)) {
                                float2* dst = reinterpret_cast<float2*>(dq_thread + (16 * f + 8 * h) * head_dim + 8 * n);
                                float2 o = *dst;
                                o.x += acc[f][n][2 * h];
                                o.y += acc[f][n][2 * h + 1];
                                *dst = o;
                            }
            } else {   // an edge tile: each element's add under its own predicate (ptxas branches around
                       // each predicated REDG all the same: BSSY/BRA/BSYNC, about 88 instructions for 16 adds)
#pragma unroll
                for (int f = 0; f < MF_Q; ++f)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const bool row_ok = l2.q_row0 + 16 * f + l2.g + 8 * h < rows;
#pragma unroll
                        for (int n = 0; n < NF_QP; ++n) {
                            const bool in_view = row_ok && c0 + 8 * n + 2 * l2.t < head_dim;
                            float* dst = dq_thread + (16 * f + 8 * h) * head_dim + 8 * n;
                            if (INTERIOR_PATHS)   // (the predicate in the asm; the modifier forms test in C++)
                                ptx_red_add_f32x2_if(in_view, dst, acc[f][n][2 * h], acc[f][n][2 * h + 1]);
                            else if (in_view)
                                ptx_red_add_f32x2(dst, acc[f][n][2 * h], acc[f][n][2 * h + 1]);
                        }
                    }
            }
        }
        if (STAGES == 1 && it + 1 < n_iter) {
            __syncthreads();   // every thread is done with the one stage
            load_query_tile(0, PLAIN_LOOP ? nxt : next_tile(cur));
            ptx_cp_async_commit();
        }
        cur = PLAIN_LOOP ? nxt : next_tile(cur);
    }
#if CUFLASH_BLOCK_SPARSE && defined(CUFLASH_SIM)
    if (bs_count && tid == 0) {   // (the simulator's count of the tiles this block entered)
        bs_counts[2 * (long long)blockIdx.x] = bs_entered[0];
        bs_counts[2 * (long long)blockIdx.x + 1] = bs_entered[1];
    }
#endif

    // dK, dV of this warp's keys le.kv_row0 + 16 f + le.g + 8 h, columns le.kv_col0 + 8 n + 2 t, +1.
    const LaneOffsets le = lane_offsets(tid);
    if (CUFLASH_VARLEN) {   // the sequence's first key row, read again (not held across the loop)
        const int k0 = clamp_index(cu_seqlens_k[ptx_opaque(static_cast<int>(batch))], 0, seqlen_k_total);
        dk += k0 * dk_row_stride, dv += k0 * dv_row_stride;
    }
    elem_t* dk_tile = dk + batch * dk_batch_stride + head_k * dk_head_stride;
    elem_t* dv_tile = dv + batch * dv_batch_stride + head_k * dv_head_stride;
#pragma unroll
    for (int f = 0; f < MF_KV; ++f)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int kj = col0 + le.kv_row0 + 16 * f + le.g + 8 * h;
            if (kj >= keys) continue;
#pragma unroll
            for (int n = 0; n < NF_KV; ++n) {
                const int c = le.kv_col0 + 8 * n + 2 * le.t;
                if (c < head_dim)
                    *reinterpret_cast<unsigned*>(dk_tile + kj * dk_row_stride + c) =
                        pack2(dk_acc[f][n][2 * h] * softmax_scale, dk_acc[f][n][2 * h + 1] * softmax_scale);
                if (c < head_dim_v)
                    *reinterpret_cast<unsigned*>(dv_tile + kj * dv_row_stride + c) =
                        pack2(dv_acc[f][n][2 * h], dv_acc[f][n][2 * h + 1]);
            }
        }
}
