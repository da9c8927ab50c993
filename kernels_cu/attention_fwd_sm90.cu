// cuflash: the Hopper (sm_90a) attention forward, FA3's design (Shah et al., "FlashAttention-3",
// 2024, sections 3.1-3.2): warp specialization, the ping-pong schedule of the two consumers and
// the intra-warpgroup overlap of the two GEMMs with the softmax.
//
//   block = 3 warpgroups: warpgroup 0 is the producer (setmaxnreg.dec; one elected thread issues
//   TMA loads: Q once, then K and V tiles into 2-stage rings, K and V each with their own "full"
//   and "empty" mbarriers); warpgroups 1 and 2 are consumers (setmaxnreg.inc) of 64 query rows
//   each (Br = 128). Per key tile of Bc keys a consumer runs S = Q K^T by wgmma with both operands
//   in shared memory (128-byte swizzle, the head dim in 64-element panels), the online softmax on
//   the accumulators in the log2 domain (the scale fused into the exponent's FFMA), converts P to 16-bit registers
//   (the accumulator fragment is the A fragment of the next wgmma) and runs O += P V by wgmma with
//   A from registers and V N-major from shared memory; O is rescaled in registers, divided once at
//   the end, staged in shared memory (over the consumer's own Q rows) and stored by TMA, whose
//   tensor map drops rows past Sq. LSE is written in the natural log.
//   Intra-warpgroup overlap (section 3.2): tile j's S = Q K_j^T and tile j-1's O += P V are issued
//   together; the consumer waits for S only (wait_group 1) and runs its softmax while P V runs.
//   O is rescaled before the next P V is issued (FA3's order), so nothing but the conversion of P
//   waits for the wait that retires P V, and the release of K_j's slot, which ptxas keeps before
//   that wait, waits on the first row's softmax: ptxas issues at least that row's exponentials
//   while P V runs (46-56 of 66 at d128).
//   Ping-pong (section 3.1): the consumers take turns on the tensor cores through two named
//   barriers; each waits for its turn before issuing a tile's wgmmas and hands the turn over
//   right after, so one warpgroup's softmax runs while the other's GEMMs do.
//   The walk over key tiles is compiled as separate loops of one tile body (as FA3 peels its
//   masked tiles): a steady loop with no mask code, and loops that test the right edge (the
//   diagonal, a window's right bound, Sk), the left edge (a window's left bound) or both. The
//   wgmma descriptors are built once: Q's per k step held in registers, K's and V's advanced by
//   constants.
//
//   The load and store stages sit behind one seam (load_q / load_k / load_v / store_o): packed
//   sequences only move their boxes (ragged maps, below); a cp.async gather (paged caches) would
//   replace them without touching the math.
//
// Layout: q (B, Hq, Sq, D), k (B, Hk, Sk, D), v (B, Hk, Sk, Dv), o (B, Hq, Sq, Dv) through 4-d
// tensor maps (any strides TMA can describe: the head dim contiguous, the others multiples of 16
// bytes); head dims below the bucket read as zeros (the maps' out-of-bounds fill) and their
// output columns are dropped by the store; GQA by head / group. Windows are bottom-right
// (flash-attn): key j is visible to row i iff i + Sk - Sq - left <= j <= i + Sk - Sq + right
// (-1: unbounded; causal is right = 0); key tiles no row of the block sees are skipped, the
// boundary tiles masked (CUFLASH_LOCAL; without it only keys past Sk are masked); rows without
// keys give 0 and lse -inf. Blocks take query tiles last first (the longest under a causal mask).
//
// Score modifiers (the CUFLASH_MODS 1 variants; score_mods.cuh): softcap, ALiBi, the additive bias
// and the boolean mask act on each tile's scaled scores in the softmax (before the window mask,
// while the previous tile's P V wgmma runs); the sink joins each row's denominator at the
// epilogue. (Tiles the mask hides completely are computed and masked here, not skipped.) Each
// modifier that is on is one pass over the tile's scores, behind one branch a tile (apply_mods), and
// tile 0 runs in the loop (its P V an empty wgmma group), so the per-score code has one copy. The
// consumer's loops over its accumulator fragments are unrolled: a loop left rolled (as NVVM leaves
// one with the modifier code in its body) puts the fragment in local memory, whose stores read the
// accumulators while the wgmma is in flight, and ptxas then serializes every wgmma (C7514).
//
// Packed batches (the CUFLASH_VARLEN 1 variants; cuflash.attention_varlen with seqused_k): q (total_q,
// Hq, D), k and v (total_k, Hk, D|Dv), o (total_q, Hq, Dv) through ragged tensor maps that clip every
// box at its sequence's end (the load and store seam below); block (tile, head, b) reads sequence
// b's rows and lengths from cu_seqlens_q/k and seqused_k on the device (common.cuh: varlen_seq,
// which clamps them into the arrays), and from there on runs the fixed-shape code on them: causal
// and windows bottom-right per sequence, the key tile that straddles the sequence's end in the
// masked loop, the steady loop unchanged. lse is (Hq, total_q).
//
// KV caches (the CUFLASH_KVCACHE 1 variants; cuflash.attention_with_kvcache): q and o as the
// fixed form's (B, Hq, Sq, D) maps; the keys of sequence b are its cache indices [start, end),
// start = cache_leftpad[b] (0 without), end = cache_seqlens[b] + seqlen_new (read on the device;
// kvcache_append.cu wrote the new rows before this launch). The whole producer warpgroup gathers
// each K and V tile with cp.async into the same swizzled panels TMA would fill (the load seam:
// gather_tile), from row p % page_size of page block_table[b][p / page_size] (paged) or row p of
// cache batch cache_batch_idx[b] (contiguous), keys past the end and columns past the head dim
// zero-filled, never read; it then fences the writes for the async proxy and arrives on the
// tile's "full" barrier (128 arrivals). From there on the math is the fixed form's. Split-KV
// (num_splits > 1; the grid's x is query tile x split): a block takes its split's run of the key
// tiles the device-read lengths give, and writes its normalized float32 O and LSE into o_partial
// and lse_partial (rows (batch, head, query row)) for attention_combine.cu; a split without keys
// writes 0 and -inf. Indices are clamped into the cache; a sequence whose index was out of range
// gets NaN in every row it writes (as the tensor-core KV-cache form). With CUFLASH_MODS (softcap,
// ALiBi, sinks: the modifiers a KV-cache call takes) the modifier forms' per-tile passes run on
// the sequence's keys (ALiBi bottom-right with its device-read Sk); the sink joins split 0's rows
// only, so the combine counts it once a row.
//
// GQA packing (CUFLASH_GQA 1 with CUFLASH_KVCACHE, fixed batches; decode-like calls whose Sq is under a
// tile): a block per (query tile x split, kv head hk, sequence b) whose two consumers' 64 rows each
// hold the G = group query heads of hk (2..64) at P = 64 / G (rounded down) consecutive positions,
// a consumer's row r = p * G + g its position p, head hk * G + g; rows P * G..63 (G not a power of
// two) are dead: zeroed once in shared memory, masked as the consumer's last position, never stored.
// q and o go through 5-d maps (head dim, g, kv head, position, batch) whose box of G heads x P
// positions lands at a consumer's 64-row offset as those rows, 128 bytes each: the panels and
// swizzle the consumers read (for a power of two, P * G = 64: no dead row). The masks take each
// row's position (Rows::pos; the rows' mask edges are set once, so the steady loop is the KV-cache
// form's), the block's key range its first and last positions; lse and the split partials are
// written at each row's head and position, in the unpacked rows' order, so the combine is the same.
// K and V are gathered once per kv head, not once per query head. With CUFLASH_MODS, ALiBi and sinks
// per row (its head's slope, held in Rows::slope, and its head's sink at the epilogue).
//
// Chunked prefill (CUFLASH_VARLEN and CUFLASH_KVCACHE, cuflash.attention_varlen with a block_table):
// q and o through the packed forms' ragged maps, lse (Hq, total_q); sequence b's query rows and its
// key count n_k (cu_seqlens_k's length, seqused_k[b] when given) from varlen_seq on the device, its
// keys cache indices [0, n_k) of block-table row b, gathered by the producer as in the KV-cache
// forms (cache_seq with n_k as the cache length: no left padding, no append, n_k past the
// capacity gives NaN rows). Split-KV as in the KV-cache forms, the partial rows in lse's packed
// order (split, head, total_q row), so the combine takes the batch as one sequence of total_q rows
// (d256: unsplit, a compile-time single split).
//
// TMA over the cache (CUFLASH_KV_TMA 1 with CUFLASH_KVCACHE, the plain and modifier forms; the host's
// choice for contiguous caches and where pages hold whole key tiles): the entry takes k and v tensor maps over
// the cache, dims (head dim, row in page, kv head, page) (a contiguous cache's batches as pages);
// a key tile wholly below the sequence's end and inside one page loads as one box per panel,
// issued by producer thread 0 after its arrive.expect_tx (its one arrival of the tile's 128; the
// other threads arrive where they do for a gathered tile), its page read from the block table per
// tile; the tile across the end (and any across a page's end) is gathered as above, zero-filled
// past the end, so rows past a sequence's keys are never read.
//
// Traced score_mod / mask_mod (the CUFLASH_USER_MOD variants of the modifier forms; score_mods.cuh):
// mod_score applies the traced functions after the built-in modifiers, at (q_idx, kv_idx) = (the
// accumulator element's query row, its key), in the same per-tile code; their captured arrays are
// run-time arguments. Block-sparse masks (CUFLASH_BLOCK_SPARSE 1, a traced mask_mod's block mask):
// a block's 128 query rows lie in one query block of the mask (bs_outer a multiple of 128), and its
// walk is that block's partial key blocks, then its full ones, each as bs_inner / BC tiles: the
// producer loads and the consumers compute the same tile j (BsWalk, in order), so the rings, barriers and
// turns are those of the contiguous walk; empty blocks are never loaded, full tiles run without
// mask_mod (Rows::user_mask), and the causal / window / Sk mask still applies to every tile.
//
// fp8 (the CUFLASH_FP8 1 variants, entry suffix _e4m3; cuflash.attention with float8_e4m3fn q, k, v):
// q and k are e4m3 bytes (B, H, S, D) through the same 4-d maps, 128 head-dim columns per 128-byte
// swizzle row; S = Q K^T is wgmma m64nNk32 .e4m3 (32 head-dim columns a step, both K-major). V must
// be K-major for O = P V (fp8 wgmma has no transpose), so the host passes a key-contiguous copy
// vt (B, Hk, Dv, Sk rounded up to 32) made on the device before the launch, its keys permuted
// within each 32-key block as ptx.cuh documents (key k at row 16(k/16) + 4((k%8)/2) + 2((k/8)%2) +
// k%2): the converted P (cvt.rn.satfinite.e4m3x2, the S accumulator's values in order) is then the
// register-A fragment of m64nNk32 with no exchange between lanes. A V^T tile is one box of Dv rows
// x BC keys (a BC-byte swizzle). The descales (float32 (B, Hk), any strides) are read per block:
// q_descale k_descale into the score scale, v_descale into the epilogue's 1 / l. O (CUFLASH_BF16:
// bf16, else fp16) is staged in a region of its own (Q's tile holds half its bytes) and stored by
// TMA as in the other forms. Plain (no modifiers), causal and windows, GQA; fixed shapes or packed.
// Packed fp8 (CUFLASH_FP8 and CUFLASH_VARLEN, cuflash.attention_varlen): q, k and o through the
// packed forms' ragged maps; V^T is (1, Hk, Dv, P), sequence b's key j at column p[b] + j with
// p[b] = 32 (k0 / 32) + BC b (k0: the sequence's first key row as varlen_seq clamps it), a
// multiple of 32, so the permutation's blocks stay whole, and p[b + 1] - p[b] covers the
// sequence's keys rounded up to whole tiles: its last tile never reads the next sequence's keys
// (whose values could be inf or NaN, and 0 * NaN is NaN). The host's copy computes the same
// p[b] from the same index on the device (attention_fwd_sm90.fp8_value_copy_packed) and leaves
// every column that is no used key 0; keys past the sequence's length are masked as in the other
// packed forms. The descales' batch index is the sequence's.
//
// Defines: CUFLASH_ENTRY, CUFLASH_BF16 (0/1), CUFLASH_D and CUFLASH_DV (head-dim buckets: 64, 96,
// 128, 192, 256; Dv <= D), CUFLASH_BC (keys per tile), CUFLASH_LOCAL (0/1), CUFLASH_MODS (0/1),
// CUFLASH_VARLEN (0/1), CUFLASH_KVCACHE (0/1); with a traced function CUFLASH_USER_MOD and its macros,
// CUFLASH_BLOCK_SPARSE (0/1), CUFLASH_FP8 (0/1; CUFLASH_BF16 is then the output's type), CUFLASH_GQA (0/1),
// CUFLASH_KV_TMA (0/1), CUFLASH_UNSPLIT (0/1: a chunked-prefill form with one split, fixed at compile time).
#include "ptx.cuh"
#include "score_mods.cuh"

#ifndef CUFLASH_KVCACHE
#define CUFLASH_KVCACHE 0
#endif
#ifndef CUFLASH_FP8
#define CUFLASH_FP8 0
#endif
#ifndef CUFLASH_GQA
#define CUFLASH_GQA 0
#endif
#ifndef CUFLASH_UNSPLIT
#define CUFLASH_UNSPLIT 0
#endif
#ifndef CUFLASH_KV_TMA
#define CUFLASH_KV_TMA 0
#endif

#if __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)

namespace fwd_sm90 {

constexpr int D = CUFLASH_D, DV = CUFLASH_DV;
constexpr bool BF16 = CUFLASH_BF16 != 0;
#if CUFLASH_BF16
typedef __nv_bfloat16 elem_t;
#else
typedef __half elem_t;
#endif
constexpr int BR = 128, BC = CUFLASH_BC, STAGES = 2;
constexpr int PANEL = 64;                               // 16-bit head-dim elements per 128-byte swizzle row
// (macros, not constants: a namespace-scope constant is a global of the module, and the other
// forms' cubins stay byte for byte what they were without the fp8 form)
#define PANEL_IN (CUFLASH_FP8 ? 128 : PANEL)            // Q's and K's (fp8: 128 one-byte elements)
#define KSTEP (CUFLASH_FP8 ? 32 : 16)                   // head-dim columns (keys) per wgmma k step
// fp8: V^T tiles in panels of VPANEL keys (DV rows of VPANEL bytes, a VPANEL-byte swizzle): 128
// where BC is a multiple of 128, else 64 (192 keys: three 64-key panels)
#define VPANEL (BC % 128 == 0 ? 128 : 64)
constexpr int NPANEL = (D + PANEL_IN - 1) / PANEL_IN, NPANEL_V = (DV + PANEL - 1) / PANEL;
constexpr int PANEL_Q = BR * 128, PANEL_KV = BC * 128;  // bytes of one panel of Q, K (and 16-bit V, O)
// fp8: a V^T tile is DV rows of BC key bytes (one box, a BC-byte swizzle)
constexpr int Q_BYTES = NPANEL * PANEL_Q, K_BYTES = NPANEL * PANEL_KV, V_BYTES = CUFLASH_FP8 ? DV * BC : NPANEL_V * PANEL_KV;
// The rows' mask edges computed once, not per masked tile (Rows::first / last; 7 instructions
// fewer per masked tile at d128), except in the d256 KV-cache form, whose consumers then spill
// under NVRTC 13 (20 B stores), and the modifier forms: they hold the 4 registers no longer
// than a tile
constexpr bool EDGES_ONCE = !CUFLASH_MODS && !(CUFLASH_KVCACHE && D == 256);
// Registers per thread after setmaxnreg: the producer's (the KV-cache gather needs 48) and the
// consumers'; the GQA-packed and TMA-over-the-cache KV-cache forms at d64 move 8 from each consumer
// to the producer (at 48 their gather loop spilled 4-16 B under NVRTC 12 / 13; the d64 consumers need
// far fewer than 224)
#define PRODUCER_REGS ((CUFLASH_GQA || CUFLASH_KV_TMA) && CUFLASH_KVCACHE && D <= 64 ? 64 : CUFLASH_KVCACHE ? 48 : 40)
#define CONSUMER_REGS ((CUFLASH_GQA || CUFLASH_KV_TMA) && CUFLASH_KVCACHE && D <= 64 ? 224 : 232)
// named barriers: 1, 2 the consumers' epilogues (128 threads); 3, 4 their turns (256 threads)
constexpr int EPILOGUE_BAR = 1, TURN_BAR = 3;
static_assert(D % 16 == 0 && DV % 16 == 0 && BC % 16 == 0 && (CUFLASH_FP8 || NPANEL_V <= NPANEL), "head-dim buckets and tiles");
static_assert(!CUFLASH_GQA || (!CUFLASH_VARLEN && !CUFLASH_FP8 && !CUFLASH_BLOCK_SPARSE && (CUFLASH_KVCACHE || !CUFLASH_MODS)),
              "GQA packing: fixed batches, 16-bit; modifiers in the KV-cache form only");
static_assert(!CUFLASH_KV_TMA || (CUFLASH_KVCACHE && D <= 192), "TMA over the cache: the KV-cache forms, head dims up to 192");
static_assert(!CUFLASH_FP8 || (BC % 64 == 0 && D % 32 == 0 && !CUFLASH_MODS && !CUFLASH_KVCACHE),
              "the fp8 form: fixed shapes or packed, plain, a multiple of 64 keys a tile");


__device__ __forceinline__ unsigned pack(float lo, float hi) {
    return BF16 ? ptx_cvt_pack_bf16x2(lo, hi) : ptx_cvt_pack_f16x2(lo, hi);
}

// Quad reductions: the 4 lanes 4g..4g+3 hold the columns of rows g and g + 8.
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// ---------------------------------------------------------------- the load and store seam (TMA)
// Each stage moves 64-column panels of a box; where the box lies is the form's (Box: the three
// coordinates after the head-dim column).
struct Box {
    int c1, c2, c3;
};
#if CUFLASH_VARLEN
// A packed batch: q, k, v and o through ragged maps (cuflash/runtime/tensor_map.py,
// TensorMap.ragged) of dims (head dim, head, E, end) over the packed rows, E the box's rows:
// element (c, h, r, e) is packed row r + e - E, in bounds iff 0 <= r < E. A box at packed row
// `row` with e = min(end, row + E), r = row - e + E holds rows [row, end) and zeros (loads) or
// nothing (stores) past `end`, the sequence's end: no row of another sequence, and no key past
// seqused_k, is ever read, and a store never spills into the next sequence.
struct Tiles {
    const cuflash_tensor_map *q, *k, *v, *o;
    int h, hk, q0, k0, q_end, k_end;   // the sequence's first query and key rows, and their ends
#if CUFLASH_FP8
    int v0;   // fp8: the sequence's first key column in V^T (a multiple of 32; load_v)
#endif
};
template <int E>
__device__ __forceinline__ Box ragged(int head, int row, int end) {
    const int e = min(end, row + E);
    return Box{head, row - e + E, e};
}
__device__ __forceinline__ Box q_box(const Tiles& t, int m0) { return ragged<BR>(t.h, t.q0 + m0, t.q_end); }
__device__ __forceinline__ Box kv_box(const Tiles& t, int kv0) { return ragged<BC>(t.hk, t.k0 + kv0, t.k_end); }
__device__ __forceinline__ Box o_box(const Tiles& t, int row0) { return ragged<64>(t.h, t.q0 + row0, t.q_end); }
#else
// (B, H, S, D) maps: rows past Sq / Sk are the maps' out-of-bounds rows
struct Tiles {
    const cuflash_tensor_map *q, *k, *v, *o;
    int h, hk, b;
#if CUFLASH_GQA
    int group;   // GQA packing: the query heads of a kv head (2..64; the header comment)
#endif
};
__device__ __forceinline__ Box q_box(const Tiles& t, int m0) { return Box{m0, t.h, t.b}; }
__device__ __forceinline__ Box kv_box(const Tiles& t, int kv0) { return Box{kv0, t.hk, t.b}; }
__device__ __forceinline__ Box o_box(const Tiles& t, int row0) { return Box{row0, t.h, t.b}; }
#endif

#if CUFLASH_GQA
// GQA packing: q and o through 5-d maps (head dim, g, kv head, position, batch); a box of G heads x
// P = 64 / G positions lands at each consumer's 64-row offset as rows r = p * G + g, 128 bytes each,
// the rows a 4-d box fills (rows P * G..63: the dead rows, zeroed once); positions past Sq are the
// maps' out-of-bounds rows
__device__ __forceinline__ void load_q(const Tiles& t, unsigned char* q_s, int m0, unsigned long long* bar) {
    const int per = 64 / t.group, s0 = (m0 >> 6) * per;
    ptx_mbarrier_arrive_expect_tx(bar, 2 * NPANEL * per * t.group * 128);
    for (int p = 0; p < NPANEL; ++p)
        for (int c = 0; c < 2; ++c)
            ptx_tma_load_5d(q_s + p * PANEL_Q + c * 64 * 128, t.q, p * PANEL_IN, 0, t.hk, s0 + c * per, t.b, bar);
}

// GQA packing: a consumer's row lr (0..63) as its position p (lr / G; a dead row, lr >= P * G, takes
// the last position P - 1, so that its masks are a live row's) and head g (lr % G) of the group
struct GqaRow {
    int pos, head;
    bool live;
};
__device__ __forceinline__ GqaRow gqa_row(int lr, int group, int per) {
    const int p = lr / group;
    return GqaRow{min(p, per - 1), lr - p * group, p < per};
}
#else
__device__ __forceinline__ void load_q(const Tiles& t, unsigned char* q_s, int m0, unsigned long long* bar) {
    const Box c = q_box(t, m0);
    ptx_mbarrier_arrive_expect_tx(bar, Q_BYTES);
    for (int p = 0; p < NPANEL; ++p) ptx_tma_load_4d(q_s + p * PANEL_Q, t.q, p * PANEL_IN, c.c1, c.c2, c.c3, bar);
}
#endif

__device__ __forceinline__ void load_k(const Tiles& t, unsigned char* ks, int kv0, unsigned long long* bar) {
    const Box c = kv_box(t, kv0);
    ptx_mbarrier_arrive_expect_tx(bar, K_BYTES);
    for (int p = 0; p < NPANEL; ++p) ptx_tma_load_4d(ks + p * PANEL_KV, t.k, p * PANEL_IN, c.c1, c.c2, c.c3, bar);
}

#if CUFLASH_FP8
// fp8: V^T (B, Hk, Dv, Sk') key-contiguous (the header comment), a box of DV rows x VPANEL keys a
// panel; packed: (1, Hk, Dv, P), sequence b's keys from column t.v0 on, each tile inside its own
// columns (the host's padding: attention_fwd_sm90.fp8_value_starts)
__device__ __forceinline__ void load_v(const Tiles& t, unsigned char* vs, int kv0, unsigned long long* bar) {
    ptx_mbarrier_arrive_expect_tx(bar, V_BYTES);
#if CUFLASH_VARLEN
    for (int p = 0; p < BC / VPANEL; ++p) ptx_tma_load_4d(vs + p * DV * VPANEL, t.v, t.v0 + kv0 + p * VPANEL, 0, t.hk, 0, bar);
#else
    for (int p = 0; p < BC / VPANEL; ++p) ptx_tma_load_4d(vs + p * DV * VPANEL, t.v, kv0 + p * VPANEL, 0, t.hk, t.b, bar);
#endif
}
#else
__device__ __forceinline__ void load_v(const Tiles& t, unsigned char* vs, int kv0, unsigned long long* bar) {
    const Box c = kv_box(t, kv0);
    ptx_mbarrier_arrive_expect_tx(bar, V_BYTES);
    for (int p = 0; p < NPANEL_V; ++p) ptx_tma_load_4d(vs + p * PANEL_KV, t.v, p * PANEL, c.c1, c.c2, c.c3, bar);
}
#endif

// one consumer's 64 x Dv output rows from shared memory (after its named barrier); rows past Sq
// (a packed batch: past the sequence's end) are dropped by the map's bounds
__device__ __forceinline__ void store_o(const Tiles& t, const unsigned char* o_s, int row0) {
#if CUFLASH_GQA
    const int s0 = (row0 >> 6) * (64 / t.group);   // (a consumer's P positions; the box's P * G rows)
    for (int p = 0; p < NPANEL_V; ++p) ptx_tma_store_5d(t.o, p * PANEL, 0, t.hk, s0, t.b, o_s + p * PANEL_Q);
#else
    const Box c = o_box(t, row0);
    for (int p = 0; p < NPANEL_V; ++p) ptx_tma_store_4d(t.o, p * PANEL, c.c1, c.c2, c.c3, o_s + p * PANEL_Q);
#endif
    ptx_bulk_commit();
    ptx_bulk_wait<0>();
}

#if CUFLASH_KVCACHE
// Where sequence b's keys lie in the cache (the header comment), read and clamped on the device.
struct CacheSeq {
    const unsigned char *k, *v;   // the kv head's rows of page (batch) 0
    long long k_page, k_row, v_page, v_row;   // byte strides
    const int* bt_row;            // paged: the sequence's block-table row; else nullptr
    int page_size, num_pages, start, seqlen_k, cache_b, bad;
    int step_pages, step_rows;    // paged: 16 keys are step_pages pages and step_rows rows further on
};
__device__ __forceinline__ CacheSeq cache_seq(int b, int hk, const unsigned char* k_cache, const unsigned char* v_cache,
                                              const long long (&st)[6], const int* __restrict__ cache_seqlens,
                                              const int* __restrict__ leftpad, const int* __restrict__ batch_idx,
                                              const int* __restrict__ block_table, long long bt_stride, int page_size,
                                              int num_pages, int cache_seqlen, int seqlen_new, int capacity, int flags) {
    CacheSeq c;
    const int keys = ((flags & 1) ? cache_seqlens[b] : cache_seqlen) + seqlen_new;
    c.bad = keys < 0 || keys > capacity;
    const int end = clamp_index(keys, 0, capacity);
    const int start = (flags & 2) ? leftpad[b] : 0;
    c.bad |= start < 0 || start > end;
    c.start = clamp_index(start, 0, end);
    c.seqlen_k = end - c.start;
    const int cb = (flags & 4) ? batch_idx[b] : b;
    const bool paged = flags & 8;
    c.bad |= !paged && (cb < 0 || cb >= num_pages);
    c.cache_b = paged ? 0 : clamp_index(cb, 0, num_pages - 1);
    c.bt_row = paged ? block_table + b * bt_stride : nullptr;
    c.k = k_cache + hk * st[2];
    c.v = v_cache + hk * st[5];
    c.k_page = st[0], c.k_row = st[1], c.v_page = st[3], c.v_row = st[4];
    c.page_size = page_size, c.num_pages = num_pages;
    c.step_pages = 16 / page_size, c.step_rows = 16 % page_size;
    return c;
}

// One K or V tile, keys [kv0, kv0 + BC) of the sequence, gathered by the 128 producer threads
// (ptid): chunk ptid % 8 (16 bytes) of rows ptid / 8 + 16 i in each 64-column panel, at its
// 128-byte-swizzle place (the layout a TMA box fills). Keys past Sk and bytes past `dbytes` (the
// head dim) are zero-filled and not read; a page index out of range is clamped and sets `bad`.
template <int NP>
__device__ __forceinline__ void gather_tile(unsigned char* dst, const unsigned char* base, long long page_stride,
                                            long long row_stride, const CacheSeq& c, int kv0, int Sk, int dbytes,
                                            int ptid, int& bad) {
    const int chunk = ptid % 8;
    // a paged cache: this thread's first key's page slot and row, then 16 keys further per row
    // (one division per tile, not one per row)
    int slot = 0, in_page = 0;
    if (c.bt_row != nullptr) {
        const int p0 = c.start + kv0 + ptid / 8;
        slot = p0 / c.page_size;
        in_page = p0 - slot * c.page_size;
    }
    for (int r = ptid / 8; r < BC; r += 16) {
        const int key = kv0 + r, p = c.start + key;
        const bool live = key < Sk;
        long long page = c.cache_b;
        int row = p;
        if (c.bt_row != nullptr) {
            if (live) {
                const int pg = c.bt_row[slot];
                bad |= pg < 0 || pg >= c.num_pages;
                page = clamp_index(pg, 0, c.num_pages - 1);
                row = in_page;
            }
            slot += c.step_pages, in_page += c.step_rows;
            if (in_page >= c.page_size) in_page -= c.page_size, ++slot;
        }
        const unsigned char* src = base + page * page_stride + row * row_stride;
        unsigned char* d = dst + r * 128 + ((chunk ^ (r & 7)) << 4);
#pragma unroll 1
        for (int pn = 0; pn < NP; ++pn) {
            const int cb = pn * 128 + chunk * 16, n = live && cb < dbytes ? 16 : 0;
            ptx_cp_async_16_zfill(d + pn * PANEL_KV, n ? src + cb : base, n);
        }
    }
}

#if CUFLASH_KV_TMA
// TMA over the cache (CUFLASH_KV_TMA; the host's map_k / map_v, dims (head dim, row in page, kv head,
// page), a contiguous cache's batches as its pages): a tile of BC keys wholly below Sk and wholly in
// one page (contiguous: below Sk is enough) is one box at (row in page, hk, page); every other tile
// (the one across Sk, one across a page's end) is gathered, so no row past Sk is ever read. The
// test is the same in every producer thread; `row` and `slot` are the tile's first key's.
__device__ __forceinline__ bool tma_tile(const CacheSeq& c, int kv0, int Sk, int& row, int& slot) {
    row = c.start + kv0, slot = 0;
    if (kv0 + BC > Sk) return false;
    if (c.bt_row == nullptr) return true;
    slot = row / c.page_size;
    row -= slot * c.page_size;
    return row + BC <= c.page_size;
}
// The tile's box by TMA (one thread): its page from the block table (an index out of range is
// clamped and sets `bad`, as in gather_tile), then arrive.expect_tx on the tile's "full" barrier
// (that thread's one arrival of the 128) and NP panels.
template <int NP>
__device__ __forceinline__ void tma_cache_tile(unsigned char* dst, const cuflash_tensor_map* map, const CacheSeq& c,
                                               int hk, int row, int slot, unsigned long long* bar, int& bad) {
    int page = c.cache_b;
    if (c.bt_row != nullptr) {
        const int pg = c.bt_row[slot];
        bad |= pg < 0 || pg >= c.num_pages;
        page = clamp_index(pg, 0, c.num_pages - 1);
    }
    ptx_mbarrier_arrive_expect_tx(bar, NP * PANEL_KV);
    for (int p = 0; p < NP; ++p) ptx_tma_load_4d(dst + p * PANEL_KV, map, p * PANEL, row, hk, page, bar);
}
#endif
#endif

// ------------------------------------------------------------------- the consumer's math
// The wgmma descriptors of a 128-byte-swizzled tile: K-major (Q, K: 16 head-dim columns a step)
// and N-major (V: 16 keys a step). Built once per buffer; the k steps advance them by constants.
__device__ __forceinline__ unsigned long long desc_k_major(const unsigned char* tile) {
    return ptx_wgmma_desc(tile, 16, 1024, 128);
}
__device__ __forceinline__ unsigned long long desc_n_major(const unsigned char* tile) {
    return ptx_wgmma_desc(tile, PANEL_KV, 1024, 128);
}
// fp8: V^T K-major (keys contiguous), rows of VPANEL bytes under a VPANEL-byte swizzle, 32 keys a step
__device__ __forceinline__ unsigned long long desc_vt(const unsigned char* tile) {
    return ptx_wgmma_desc(tile, 16, 8 * VPANEL, VPANEL);
}

// The byte offset of k step kk (KSTEP head-dim columns) in a K-major tile of `rows` rows: 32 bytes
// within a 128-byte swizzle row, then the next panel (64 16-bit or 128 fp8 columns).
__device__ __forceinline__ constexpr unsigned k_step_offset(int kk, int rows) {
    return (kk * KSTEP) / PANEL_IN * rows * 128 + (kk * KSTEP) % PANEL_IN * (CUFLASH_FP8 ? 1 : 2);
}

// Q's descriptors per k step (Q is loop-invariant): built once and held in registers, as
// FA3 does (only K's then change per tile), except in the d256 modifier forms, which have no
// registers left for 16 of them and advance one base instead.
constexpr bool HOIST_Q = !(CUFLASH_MODS && D > 192);
struct QDescs {
    unsigned long long base, step[HOIST_Q ? D / KSTEP : 1];
    __device__ __forceinline__ unsigned long long at(int kk) const {
        return HOIST_Q ? step[kk] : ptx_wgmma_desc_advance(base, k_step_offset(kk, BR));
    }
};

// S = Q K^T for one key tile, issued (not waited for): K-major Q and K, KSTEP head-dim columns a step
__device__ __forceinline__ void issue_s(float (&sc)[BC / 2], const QDescs& dq, unsigned long long dk) {
    ptx_wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / KSTEP; ++kk)
#if CUFLASH_FP8
        ptx_wgmma_ss_e4m3<BC>(sc, dq.at(kk), ptx_wgmma_desc_advance(dk, k_step_offset(kk, BC)), kk > 0);
#else
        ptx_wgmma_ss<BC, BF16, 0, 0>(sc, dq.at(kk), ptx_wgmma_desc_advance(dk, k_step_offset(kk, BC)), kk > 0);
#endif
    ptx_wgmma_commit();
}

// O += P V for one key tile, issued (not waited for): P from registers, V N-major, 16 keys a step
// (fp8: V^T K-major, 32 keys a step, 32 bytes along its swizzle rows). run false: no P V, an empty
// group committed in its place (the modifier forms' tile 0, which runs in their loop)
__device__ __forceinline__ void issue_pv(float (&o)[DV / 2], const unsigned (&pa)[BC / KSTEP][4], unsigned long long dv,
                                         bool run = true) {
    ptx_wgmma_fence();
    if (run) {
#pragma unroll
#if CUFLASH_FP8
        for (int kb = 0; kb < BC / 32; ++kb)   // (32 keys: the panel's next 32 bytes, or the next panel)
            ptx_wgmma_rs_e4m3<DV>(o, pa[kb], ptx_wgmma_desc_advance(dv, (kb * 32) / VPANEL * DV * VPANEL + (kb * 32) % VPANEL), 1);
#else
        for (int kb = 0; kb < BC / 16; ++kb) ptx_wgmma_rs<DV, BF16, 1>(o, pa[kb], ptx_wgmma_desc_advance(dv, kb * 16 * 128), 1);
#endif
    }
    ptx_wgmma_commit();
}

struct Rows {   // what the softmax needs to know of this thread's rows and the mask
    int row0, wrow_lo, wrow_hi, Sq, Sk, diag, window_left, window_right, t;
    float scale_log2;
    // The plain forms: the row max is taken over the raw scores and P = exp2(s * scale_log2 - m) is
    // one FFMA per score. They take positive scales only (the host sends a negative one, which
    // reverses the order, elsewhere) and a zero scale as FLT_MIN (attention_fwd_sm90.scale_arg:
    // every finite score's exponent rounds to 0, as with 0; a hidden score's stays -inf, not
    // NaN): no branch or select on the scale is left in the loop. The modifier forms act on scaled
    // scores: they scale the scores first.
    bool prescale;
    float eff_scale;   // 1 when prescaled, else scale_log2
    // with EDGES_ONCE, the visible keys of rows row0 and row0 + 8, [first, last] (the window's edges
    // and Sk), less this thread's first column 2t, set once: a tile's mask bounds are these less
    // its first key
    int first[2], last[2];
#if CUFLASH_MODS
    ScoreMods mods;   // the score modifiers (score_mods.cuh) and this block's (batch, head) share
    HeadMods hm;
    float inv_cap;    // 1 / hm.cap (0 without softcap)
#endif
#if CUFLASH_BLOCK_SPARSE
    bool user_mask;   // the tile is a partial block's: mask_mod evaluated (a full block's: not)
#endif
#if CUFLASH_GQA
    // GQA packing: row0 is a packed row; the query positions of rows row0 and row0 + 8 plus diag
    // (held in place of diag and the rows' positions, gqa_row)
    int pdiag[2];
#if CUFLASH_MODS
    float slope[2];   // the rows' own heads' ALiBi slopes (* log2 e; 0 without ALiBi)
#endif
#endif
    // the query position of this thread's row row0 + 8 r (row0: a position where the rows are not
    // packed; wrow_lo, wrow_hi always positions); packed, the masks' pos(r) + diag folds to pdiag[r]
    __device__ __forceinline__ int pos(int r) const {
#if CUFLASH_GQA
        return pdiag[r] - diag;
#else
        return row0 + 8 * r;
#endif
    }
};

// A window narrower than a tile tests both edges (two compares a score); with BOTH_BITS it tests one
// bit of a per-row set of the tile's visible scores instead (one 32-bit word: BC / 4 <= 32; ptxas
// moves 7 bits at a time into predicates, R2P, so a score costs its FSEL and a seventh). The local
// forms' right-edge loop (the diagonal) takes the set too (d128: 580 -> 555 instructions a warp
// and tile under NVRTC 12); the left-edge loop and the plain forms' Sk edge do not: there the set
// counted more than the compares (+23 and +11)
constexpr bool BOTH_BITS = EDGES_ONCE && BC / 4 <= 32;
// How many of a row's scores (this thread's column offsets 8p, 8p + 1 from its first column) lie
// left of offset x: 2 per pair before x's, and 0, 1 or 2 of x's own pair (any sign of x).
__device__ __forceinline__ int score_count(int x) { return 2 * (x >> 3) + min(x & 7, 2); }

// Floor and ceiling of x / BC for any sign of x.
__device__ __forceinline__ int floor_tiles(int x) { return x >= 0 ? x / BC : -((BC - 1 - x) / BC); }
__device__ __forceinline__ int ceil_tiles(int x) { return -floor_tiles(-x); }

// Which edges of the visible keys a tile's mask tests (a compile-time axis of the softmax): none
// (the steady loop), the left (a window's left edge), the right (the diagonal, a window's right
// edge, Sk) or both (a window narrower than a tile).
enum Mask { MASK_NONE = 0, MASK_LEFT = 1, MASK_RIGHT = 2, MASK_BOTH = 3 };
template <int M> struct MaskOf {   // a Mask as a type, for a generic lambda
    static constexpr int value = M;
};
// The key tiles [lo, hi) that need no mask for the rows [w.wrow_lo, w.wrow_hi]: no key past Sk
// and (a window) no key left of the last row's first visible key or right of the first row's
// last one. Every other tile of the walk lies before lo (the left window edge) or from hi on (the
// diagonal, Sk): the walk runs them in masked loops around one steady loop.
struct SteadyTiles {
    int lo, hi;
};
__device__ __forceinline__ SteadyTiles steady_tiles(const Rows& w) {
    SteadyTiles st{0, w.Sk / BC};
    if (CUFLASH_LOCAL && w.window_left >= 0) st.lo = ceil_tiles(w.wrow_hi + w.diag - w.window_left);
    if (CUFLASH_LOCAL && w.window_right >= 0) st.hi = min(st.hi, floor_tiles(w.wrow_lo + w.diag + w.window_right + 1));
    return st;
}

#if CUFLASH_MODS
// The modifier forms' per-score reads of the bias (T: float or the kernel's 16-bit type) or the
// boolean mask: row r's key column kv0 + 2t + 8q + e at p[r] + e * cs after q steps of 8 keys
// (byte pointers moved by a constant step: no 64-bit index product per score), read only where
// the row's visible-score set has the score. The bias adds its value in log2 units; the mask
// hides the score where its byte is 0.
template <class T>
__device__ __forceinline__ void read_pass(float (&sc)[BC / 2], const void* head, const long long (&st)[4], int row0,
                                          int here, const unsigned (&vis)[2]) {
    const long long cs = st[3] * (long long)sizeof(T);
    const unsigned char* p[2];
#pragma unroll
    for (int r = 0; r < 2; ++r)
        p[r] = static_cast<const unsigned char*>(head) + ((row0 + 8 * r) * st[2] + here * st[3]) * (long long)sizeof(T);
#pragma unroll
    for (int q = 0; q < BC / 8; ++q) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int i = 4 * q + 2 * r + e;
                if (!((vis[r] >> (2 * q + e)) & 1u)) continue;
                const T v = *reinterpret_cast<const T*>(p[r] + (e ? cs : 0));
                if constexpr (sizeof(T) == 1) {
                    if (v == 0) sc[i] = CUFLASH_NEG_INF;
                } else {
                    sc[i] += to_float(v) * CUFLASH_LOG2E;
                }
            }
            p[r] += 8 * cs;
        }
    }
}

// The score modifiers on one tile's scaled scores (mod_score's, score_mods.cuh), a pass per
// modifier that is on; vis: the rows' visible-score sets (softmax_tile).
__device__ __forceinline__ void apply_mods(float (&sc)[BC / 2], int kv0, const Rows& w, const unsigned (&vis)[2]) {
    const int here = kv0 + 2 * w.t;   // this thread's first key column
    if (w.hm.cap != 0.0f) {   // softcap: x / cap as a product with 1 / cap, taken once per block
#pragma unroll
        for (int i = 0; i < BC / 2; ++i) sc[i] = w.hm.cap * tanhf(sc[i] * w.inv_cap);
    }
#if CUFLASH_GQA
    if (w.mods.alibi != nullptr) {   // ALiBi per row: the rows' heads differ (GQA packing)
#else
    if (w.hm.slope != 0.0f) {   // ALiBi: slope * |j - (i + Sk - Sq)|, the distance an integer (exact)
#endif
        int d0[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) d0[r] = diag_distance(w.pos(r), here, w.Sq, w.Sk);
#pragma unroll
        for (int i = 0; i < BC / 2; ++i) {
            const int d = d0[(i % 4) / 2] + 8 * (i / 4) + i % 2;
#if CUFLASH_GQA
            sc[i] -= w.slope[(i % 4) / 2] * (float)(d < 0 ? -d : d);
#else
            sc[i] -= w.hm.slope * (float)(d < 0 ? -d : d);
#endif
        }
    }
    if (w.hm.bias) {
        if (w.mods.bias_f32) read_pass<float>(sc, w.hm.bias, w.mods.bias_s, w.row0, here, vis);
        else read_pass<elem_t>(sc, w.hm.bias, w.mods.bias_s, w.row0, here, vis);
    }
#if CUFLASH_USER_MOD
    {   // the traced score_mod / mask_mod (mod_score with the built-in modifiers off, done above)
        HeadMods user{0.0f, 0.0f, nullptr, nullptr, w.hm.b, w.hm.h};
#pragma unroll
        for (int i = 0; i < BC / 2; ++i) {
            const int r = (i % 4) / 2, k = 2 * (i / 4) + i % 2;
            if ((vis[r] >> k) & 1u)
#if CUFLASH_BLOCK_SPARSE
                sc[i] = mod_score<elem_t>(w.mods, user, sc[i], w.row0 + 8 * r, here + 8 * (i / 4) + i % 2, w.Sq, w.Sk,
                                          nullptr, w.user_mask);
#else
                sc[i] = mod_score<elem_t>(w.mods, user, sc[i], w.row0 + 8 * r, here + 8 * (i / 4) + i % 2, w.Sq, w.Sk);
#endif
        }
    }
#endif
    if (w.hm.mask) read_pass<unsigned char>(sc, w.hm.mask, w.mods.mask_s, w.row0, here, vis);
}
#endif

// The online softmax of one tile in place (log2 domain): the mask (the edges MASK names; none on
// the tiles of SteadyTiles, whose mask code is not compiled), row max, l rescaled, S -> P in fp32.
// Returns in alpha the factor O must be rescaled by (done by the caller before the next P V is issued).
template <int MASK>
__device__ __forceinline__ void softmax_tile(float (&sc)[BC / 2], int kv0, const Rows& w, float (&m_run)[2],
                                             float (&l_run)[2], float (&alpha)[2]) {
    // The plain forms never prescale, nor branch on the scale: a branch between the waits for S
    // and for P V splits the softmax into blocks, and ptxas then retires P V before most of the
    // exponentials (it issues them in one block, after the reduction, as FA3's loop does).
    if (w.prescale) {   // (the modifier forms: always, known at compile time)
#pragma unroll
        for (int i = 0; i < BC / 2; ++i) sc[i] *= w.scale_log2;
    }
    // the mask, per row: the visible keys of rows row0 and row0 + 8 are [first, last] (the
    // window's edges and Sk), kept here relative to this thread's first column kv0 + 2t, so that a
    // score's test is two compares of a register with its constant column offset
    int lo[2], hi[2];
    constexpr bool SET = BOTH_BITS && (MASK == MASK_BOTH || (CUFLASH_LOCAL && MASK == MASK_RIGHT));
    unsigned vis[2];   // with the set: bit k set where the row's score k is visible
    if (SET) {
#pragma unroll
        for (int r = 0; r < 2; ++r)   // the scores left of last + 1, less those left of first
            vis[r] = ((MASK & MASK_RIGHT) ? ptx_ones_below(max(score_count(w.last[r] - kv0 + 1), 0)) : ~0u) &
                     ~((MASK & MASK_LEFT) ? ptx_ones_below(max(score_count(w.first[r] - kv0), 0)) : 0u);
    } else if (MASK != MASK_NONE) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            if (EDGES_ONCE) {
                lo[r] = w.first[r] - kv0;
                hi[r] = w.last[r] - kv0;
                continue;
            }
            const int row = w.pos(r), here = kv0 + 2 * w.t;
            int first = 0, last = w.Sk - 1;
            if (CUFLASH_LOCAL && w.window_left >= 0) first = max(first, row + w.diag - w.window_left);
            if (CUFLASH_LOCAL && w.window_right >= 0) last = min(last, row + w.diag + w.window_right);
            lo[r] = first - here;
            hi[r] = last - here;
        }
    }
#if CUFLASH_MODS
    // The modifier forms: each modifier that is on is one pass over the scores (a branch per tile,
    // not per score: modifier code runs on no tile of a call without that modifier), in
    // score_mods.cuh's order (softcap, ALiBi, bias, the traced score_mod and mask_mod, the boolean
    // mask), then the window and Sk mask. A row's visible scores are a bit set (bit 2(i / 4) + i % 2
    // for score i of row (i % 4) / 2, as BOTH_BITS): it guards the bias and mask reads (and the
    // traced functions) as the row < Sq, key < Sk test of mod_score did, and masks the scores after.
    // Rows past Sq see no key here (their output is dropped by the store, their lse not written).
    static_assert(BC / 4 <= 32, "the modifier forms' visible-score set is one 32-bit word a row");
    unsigned seen[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = w.pos(r), here = kv0 + 2 * w.t;
        int first = 0, last = w.Sk - 1;
        if (CUFLASH_LOCAL && w.window_left >= 0) first = max(first, row + w.diag - w.window_left);
        if (CUFLASH_LOCAL && w.window_right >= 0) last = min(last, row + w.diag + w.window_right);
        seen[r] = row < w.Sq ? ptx_ones_below(max(score_count(last - here + 1), 0)) &
                                  ~ptx_ones_below(max(score_count(first - here), 0))
                            : 0u;
    }
    apply_mods(sc, kv0, w, seen);
    float mx[2] = {CUFLASH_NEG_INF, CUFLASH_NEG_INF};   // over this tile's scaled, modified scores
#pragma unroll
    for (int i = 0; i < BC / 2; ++i) {
        const int r = (i % 4) / 2;
        float x = sc[i];
        if (!((seen[r] >> (2 * (i / 4) + i % 2)) & 1u)) x = CUFLASH_NEG_INF;
        sc[i] = x;
        mx[r] = fmaxf(mx[r], x);
    }
    float base[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(m_run[r], quad_max(mx[r]) * w.eff_scale);
        base[r] = mx[r] == CUFLASH_NEG_INF ? 0.0f : mx[r];   // a row with no key yet: exp2(-inf) = 0, no NaN
        alpha[r] = exp2f(m_run[r] - base[r]);
        m_run[r] = mx[r];
        l_run[r] *= alpha[r];
    }
#pragma unroll
    for (int i = 0; i < BC / 2; ++i) {
        sc[i] = exp2f(fmaf(sc[i], w.eff_scale, -base[(i % 4) / 2]));
        l_run[(i % 4) / 2] += sc[i];
    }
#else
    // Row by row (rows g and g + 8 of the thread): the mask, the row max over
    // the tile's (unscaled unless prescaled) scores in NACC independent chains joined at the end
    // (not one chain of BC / 4 dependent FMNMX), then the row's exponentials and sum, so that row
    // g's sum is complete before row g + 8's starts (the caller's K release waits on it)
    constexpr int NACC = 4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float mxa[NACC];
#pragma unroll
        for (int i = 2 * r; i < BC / 2; i += (i % 2 ? 3 : 1)) {   // the row's scores: i % 4 in {2r, 2r + 1}
            const int offset = 8 * (i / 4) + i % 2;   // the score's column: kv0 + 2t + offset
            const int a = (2 * (i / 4) + i % 2) % NACC;
            float x = sc[i];
            if (SET) {
                if (!((vis[r] >> (2 * (i / 4) + i % 2)) & 1u)) x = CUFLASH_NEG_INF;
            } else if (((MASK & MASK_LEFT) && offset < lo[r]) || ((MASK & MASK_RIGHT) && offset > hi[r])) {
                x = CUFLASH_NEG_INF;
            }
            sc[i] = x;
            if (2 * (i / 4) + i % 2 < NACC) mxa[a] = x;   // the chain's first score
            else mxa[a] = fmaxf(mxa[a], x);
        }
        float mx = mxa[0];
#pragma unroll
        for (int a = 1; a < NACC; ++a) mx = fmaxf(mx, mxa[a]);
        mx = fmaxf(m_run[r], quad_max(mx) * w.eff_scale);   // -inf * eff_scale > 0 stays -inf
        // a row with no key yet (mx = -inf, every score -inf): exp2(-inf - base) = 0, not NaN, with a
        // finite base; in the steady loop every score is a key's, so mx is finite there
        const float base = MASK == MASK_NONE ? mx : fmaxf(mx, -3.40282347e38f);
        alpha[r] = exp2f(m_run[r] - base);
        m_run[r] = mx;
        float l = l_run[r] * alpha[r];
#pragma unroll
        for (int i = 2 * r; i < BC / 2; i += (i % 2 ? 3 : 1)) {
            sc[i] = exp2f(fmaf(sc[i], w.eff_scale, -base));
            l += sc[i];
        }
        l_run[r] = l;
    }
#endif
}

// O *= the rescale factor of its rows (alpha: rows g and g + 8). Done before the next P V is issued
// (FA3's order), not after the wait that retires the last one: nothing then hangs on that wait,
// and ptxas leaves it after the exponentials instead of hoisting it above them.
__device__ __forceinline__ void rescale_o(float (&o)[DV / 2], const float (&alpha)[2]) {
#pragma unroll
    for (int i = 0; i < DV / 2; ++i) o[i] *= alpha[(i % 4) / 2];
}

#if CUFLASH_FP8
// P (fp32, the S accumulator fragment) into e4m3, four a register: the A fragment of O += P V, 32
// keys a k step. A row's values in accumulator order (q = 0..7 of the 32-key block kb: d[16 kb +
// 4 (q / 2) + q % 2], + 2 for row g + 8) fill A slot q (register 2 (q / 4), + 1 for row g + 8, byte
// q % 4); V^T's keys are permuted to match (the header comment), so no value changes lanes.
__device__ __forceinline__ unsigned pack_e4m3x4(float a, float b, float c, float d) {
    return unsigned(ptx_cvt_pack_e4m3x2(a, b)) | (unsigned(ptx_cvt_pack_e4m3x2(c, d)) << 16);
}
__device__ __forceinline__ void to_a_fragment(const float (&sc)[BC / 2], unsigned (&pa)[BC / 32][4]) {
#pragma unroll
    for (int kb = 0; kb < BC / 32; ++kb) {
        const float* s = sc + 16 * kb;
        pa[kb][0] = pack_e4m3x4(s[0], s[1], s[4], s[5]);
        pa[kb][1] = pack_e4m3x4(s[2], s[3], s[6], s[7]);
        pa[kb][2] = pack_e4m3x4(s[8], s[9], s[12], s[13]);
        pa[kb][3] = pack_e4m3x4(s[10], s[11], s[14], s[15]);
    }
}
#else
// P (fp32, the S accumulator fragment) into 16-bit pairs: the A fragment of O += P V, 16 keys a k step
__device__ __forceinline__ void to_a_fragment(const float (&sc)[BC / 2], unsigned (&pa)[BC / 16][4]) {
#pragma unroll
    for (int i = 0; i < BC / 2; i += 4) {
        const int kb = i / 8, half = (i / 4) % 2;   // columns 8 (i / 4) ..: k step kb, its first or second 8
        pa[kb][2 * half] = pack(sc[i], sc[i + 1]);
        pa[kb][2 * half + 1] = pack(sc[i + 2], sc[i + 3]);
    }
}
#endif

#if CUFLASH_BLOCK_SPARSE
static_assert(!CUFLASH_KVCACHE && !CUFLASH_VARLEN, "the block-sparse form is a fixed-shape form");
struct BsArgs {   // the block mask's lists (score_mods.cuh: CUFLASH_BSPARSE_PARAMS; the entry's, below)
    const int *num, *idx, *full_num, *full_idx;
    long long num_bs, num_hs, idx_bs, idx_hs, idx_rs;
    int outer, inner;
    int* counts;   // the simulator's tile count (bs_count 1): [2 block] partial, [2 block + 1] full
    int count;
};
// One side's walk over a query block's lists, a tile at a time (the producer's and each consumer's
// copies take the same steps): sub-tile s of listed block e, partial blocks (idx) then full ones
// (full_idx); a step is a compare and an add, no division per tile
struct BsWalk {
    const int *idx, *full_idx;   // the query block's lists
    int np, sub, inner, e, s;    // partial blocks, tiles per block, KV_BLOCK; where the walk is
    __device__ __forceinline__ bool partial() const { return e < np; }
    __device__ __forceinline__ int kv0() const { return (e < np ? idx[e] : full_idx[e - np]) * inner + s * BC; }
    __device__ __forceinline__ void next() {
        if (++s == sub) s = 0, ++e;
    }
};
#endif

#if CUFLASH_KVCACHE
struct KvArgs {   // the KV-cache form's arguments (the entry's, below)
    const unsigned char *k_cache, *v_cache;
    long long st[6];   // k's page (batch), row and head strides, then v's, in bytes
    const int *cache_seqlens, *leftpad, *batch_idx, *block_table;
    long long bt_stride, partial_rows;
    int page_size, num_pages, cache_seqlen, seqlen_new, capacity, flags, num_splits, head_dim, head_dim_v;
    float *o_partial, *lse_partial;
};
#endif

#if CUFLASH_FP8
struct Fp8Args {   // the descales (float32 (B, Hk)) and their (batch, kv head) element strides
    const float *q, *k, *v;
    long long st[6];
};
#endif

__device__ void forward(const cuflash_tensor_map& map_q, const cuflash_tensor_map& map_k, const cuflash_tensor_map& map_v,
                        const cuflash_tensor_map& map_o, float* lse, int Sq, int Sk, int Hq, int group, float scale_log2,
                        int window_left, int window_right, const ScoreMods& mods, const int* __restrict__ cu_seqlens_q,
                        const int* __restrict__ cu_seqlens_k, const int* __restrict__ seqused_k, int varlen
#if CUFLASH_KVCACHE
                        , const KvArgs& kv
#endif
#if CUFLASH_BLOCK_SPARSE
                        , const BsArgs& bs
#endif
#if CUFLASH_FP8
                        , const Fp8Args& f8
#endif
                        ) {
    extern __shared__ unsigned char smem_raw[];
    __shared__ __align__(8) unsigned long long q_full;
    // K and V have their own ring slots and barriers: a K slot frees once S is waited for, a
    // V slot once O += P V is, so the next K tile's load does not wait for the current V's use
    __shared__ __align__(8) unsigned long long full_k[STAGES];
    __shared__ __align__(8) unsigned long long full_v[STAGES];
    __shared__ __align__(8) unsigned long long empty_k[STAGES];
    __shared__ __align__(8) unsigned long long empty_v[STAGES];
#if CUFLASH_KVCACHE
    __shared__ int page_bad;   // a producer thread read a page index out of range
#endif
    unsigned char* q_s = ptx_align_smem_1024(smem_raw);             // [NPANEL][BR rows][128 B]
    unsigned char* k_s = q_s + Q_BYTES;                      // [STAGES][NPANEL][BC rows][128 B]
    unsigned char* v_s = k_s + STAGES * K_BYTES;             // [STAGES][NPANEL_V][BC rows][128 B]
    // O's staging: over Q's tile (each consumer its own 64 rows), in fp8 after the V ring (Q's tile
    // has half O's bytes there): [NPANEL_V][BR rows][128 B]
    unsigned char* o_st = CUFLASH_FP8 ? v_s + STAGES * V_BYTES : q_s;
#if CUFLASH_KVCACHE
    // split-KV: blockIdx.x is (query tile, split), the split fastest (CUFLASH_UNSPLIT 1, the host's
    // choice for chunked prefill at d256: nsplit the constant 1, since a run-time count spilled its
    // sequence's offsets there, under NVRTC 12 and 13)
    const int nsplit = CUFLASH_UNSPLIT ? 1 : kv.num_splits, split = blockIdx.x % nsplit;
#if CUFLASH_GQA
    // GQA packing: a block per kv head; consumer c's rows are P = per positions from (m0 / 64 + c) * P
    // of the group's heads h.. (gqa_row)
    const int m0 = (gridDim.x / nsplit - 1 - blockIdx.x / nsplit) * BR, hk = blockIdx.y, h = hk * group, b = blockIdx.z;
    const int per = 64 / group;
#else
    const int m0 = (gridDim.x / nsplit - 1 - blockIdx.x / nsplit) * BR, h = blockIdx.y, b = blockIdx.z, hk = h / group;
#endif
#elif CUFLASH_GQA
    const int m0 = (gridDim.x - 1 - blockIdx.x) * BR, hk = blockIdx.y, h = hk * group, b = blockIdx.z;   // (as above)
    const int per = 64 / group;
#else
    const int m0 = (gridDim.x - 1 - blockIdx.x) * BR, h = blockIdx.y, b = blockIdx.z, hk = h / group;
#endif
#if CUFLASH_VARLEN
    // a packed batch (Sq, Sk: the totals): sequence b's rows and lengths, warp-uniform (common.cuh);
    // the grid covers the longest sequence, and a block past this one's rows leaves at once
#if CUFLASH_KVCACHE && CUFLASH_D == 256
    // (chunked prefill at d256: the sequence's offsets in vector registers; made uniform, they
    // joined the consumers' descriptors in the uniform registers, and NVRTC 13 spilled them and
    // more: 32 B stores, 148 B loads, some inside the key loops)
    const VarlenSeq seq = varlen_seq(b, varlen, cu_seqlens_q, cu_seqlens_k, seqused_k, Sq, Sk);
#else
    const VarlenSeq seq = varlen_seq_uniform(b, varlen, cu_seqlens_q, cu_seqlens_k, seqused_k, Sq, Sk);
#endif
#if CUFLASH_KVCACHE
    // (chunked prefill, split: the split's partial rows, in lse's packed (head, total_q row) order;
    // the epilogue takes O's partial row from this pointer)
    if (nsplit > 1) lse = kv.lse_partial + split * kv.partial_rows;
#endif
    lse += size_t(h) * Sq + seq.q0;   // lse (Hq, total_q): this head's rows of the sequence
    Sq = seq.seqlen_q;
    Sk = seq.seqlen_k;
    if (m0 >= Sq) return;
#if CUFLASH_FP8
    // (V^T's column of the sequence's key 0: p[b] = 32 (k0 / 32) + BC b, the host's fp8_value_starts)
    const Tiles tiles{&map_q, &map_k, &map_v, &map_o, h, hk, seq.q0, seq.k0, seq.q0 + Sq, seq.k0 + Sk,
                      32 * (seq.k0 / 32) + BC * b};
#else
    const Tiles tiles{&map_q, &map_k, &map_v, &map_o, h, hk, seq.q0, seq.k0, seq.q0 + Sq, seq.k0 + Sk};
#endif
#elif CUFLASH_GQA
    const Tiles tiles{&map_q, &map_k, &map_v, &map_o, h, hk, b, group};
#else
    const Tiles tiles{&map_q, &map_k, &map_v, &map_o, h, hk, b};
#endif
#if CUFLASH_KVCACHE
    // the sequence's keys in the cache, from the lengths and indices on the device (chunked
    // prefill: the packed index's key count, Sk above, is the cache length)
    const CacheSeq cs = cache_seq(b, hk, kv.k_cache, kv.v_cache, kv.st, kv.cache_seqlens, kv.leftpad, kv.batch_idx,
                                  kv.block_table, kv.bt_stride, kv.page_size, kv.num_pages,
                                  CUFLASH_VARLEN ? Sk : kv.cache_seqlen, kv.seqlen_new, kv.capacity, kv.flags);
    Sk = cs.seqlen_k;
#endif
    // the warpgroup, read from lane 0 so that the compiler knows it uniform across the warp (it
    // then keeps what derives from it, the consumer's descriptors, in uniform registers)
    const int wg = __shfl_sync(0xffffffffu, int(threadIdx.x / 128), 0);
    // the key tiles some row of the block sees: [tile_lo, tile_hi)
    const int diag = Sk - Sq;
    int kv_lo = 0, kv_hi = Sk;
#if CUFLASH_GQA
    if (CUFLASH_LOCAL) {   // (the block's first and last positions)
        if (window_left >= 0) kv_lo = max(0, (m0 >> 6) * per + diag - window_left);
        if (window_right >= 0) kv_hi = min(Sk, ((m0 >> 6) + 2) * per - 1 + diag + window_right + 1);
    }
#else
    if (CUFLASH_LOCAL) {
        if (window_left >= 0) kv_lo = max(0, m0 + diag - window_left);
        if (window_right >= 0) kv_hi = min(Sk, m0 + BR - 1 + diag + window_right + 1);
    }
#endif
    int tile_lo = kv_lo / BC;
    const int tile_hi = kv_hi > kv_lo ? (kv_hi + BC - 1) / BC : tile_lo;
    int ntiles = tile_hi - tile_lo;
#if CUFLASH_KVCACHE
    if (nsplit > 1) {   // this split's run of the tiles (the last runs may be short or empty)
        const int per = (ntiles + nsplit - 1) / nsplit;
        tile_lo += split * per;
        ntiles = max(0, min(per, ntiles - split * per));
    }
#endif
#if CUFLASH_BLOCK_SPARSE
    // the walk (the header comment): query block m0 / outer's partial key blocks, then its full ones,
    // each as bs_sub tiles of BC keys, taken in order by BsWalk (the window's bounds above
    // do not shorten it: its tiles are masked as they come)
    const long long bs_b = mods.user.batch0 + b;
    const int bs_q = m0 / bs.outer, bs_sub = bs.inner / BC;
    const int bs_np = bs.num[bs_b * bs.num_bs + h * bs.num_hs + bs_q];
    ntiles = (bs_np + bs.full_num[bs_b * bs.num_bs + h * bs.num_hs + bs_q]) * bs_sub;
    const long long bs_at = bs_b * bs.idx_bs + h * bs.idx_hs + bs_q * bs.idx_rs;
    const BsWalk bs_walk0{bs.idx + bs_at, bs.full_idx + bs_at, bs_np, bs_sub, bs.inner, 0, 0};
#endif
    if (threadIdx.x == 0) {
        ptx_mbarrier_init(&q_full, 1);
        for (int s = 0; s < STAGES; ++s) {
            ptx_mbarrier_init(&full_k[s], CUFLASH_KVCACHE ? 128 : 1);   // (a gather: every producer thread arrives)
            ptx_mbarrier_init(&full_v[s], CUFLASH_KVCACHE ? 128 : 1);
            ptx_mbarrier_init(&empty_k[s], 2);   // one arrival per consumer warpgroup
            ptx_mbarrier_init(&empty_v[s], 2);
        }
        ptx_fence_mbarrier_init();
#if CUFLASH_KVCACHE
        page_bad = 0;
#endif
    }
#if CUFLASH_GQA
    if (per * group < 64) {   // the dead rows P * G..63 of each consumer's Q (no box fills them): zeros, once
        const int dead = 64 - per * group;
        for (int i = threadIdx.x; i < NPANEL * 2 * dead * 8; i += blockDim.x) {
            const int row = i / 8 % dead, half = i / (8 * dead) % 2, p = i / (16 * dead);
            *reinterpret_cast<uint4*>(q_s + p * PANEL_Q + (64 * half + per * group + row) * 128 + 16 * (i % 8)) =
                make_uint4(0u, 0u, 0u, 0u);
        }
        ptx_fence_proxy_async();   // (the generic-proxy zeros, before a wgmma (async proxy) reads them)
    }
#endif
    __syncthreads();

    if (wg == 0) {   // ---------------------------------------------------------------- producer
        ptx_setmaxnreg_dec<PRODUCER_REGS>();
#if !CUFLASH_KVCACHE
        if (threadIdx.x / 32 == 0 && ptx_elect_one()) {
            load_q(tiles, q_s, m0, &q_full);
#if CUFLASH_BLOCK_SPARSE
            BsWalk walk = bs_walk0;
#endif
            for (int j = 0; j < ntiles; ++j) {
#if CUFLASH_BLOCK_SPARSE
                const int s = j % STAGES, kv0 = walk.kv0();
                walk.next();
#else
                const int s = j % STAGES, kv0 = (tile_lo + j) * BC;
#endif
                if (j >= STAGES) ptx_mbarrier_wait(&empty_k[s], ((j / STAGES) - 1) & 1);
                load_k(tiles, k_s + s * K_BYTES, kv0, &full_k[s]);
                if (j >= STAGES) ptx_mbarrier_wait(&empty_v[s], ((j / STAGES) - 1) & 1);
                load_v(tiles, v_s + s * V_BYTES, kv0, &full_v[s]);
            }
        }
#else
        // Q by TMA; K and V gathered by all 128 threads, one tile's K and V in flight while the
        // previous one's V lands (cp.async groups: V_{j-1}, K_j, then K_j, V_j)
        if (threadIdx.x / 32 == 0 && ptx_elect_one()) load_q(tiles, q_s, m0, &q_full);
        const int ptid = threadIdx.x;
        int bad = 0;
#if CUFLASH_KV_TMA
        // (a tile by TMA: thread 0 issues it after its arrive.expect_tx, which is its arrival, and
        // the other 127 arrive where a gathered tile's threads do; tma_v: V_{j-1} went by TMA)
        bool tma_v = false;
#endif
        for (int j = 0; j < ntiles; ++j) {
            const int s = j % STAGES, kv0 = (tile_lo + j) * BC;
#if CUFLASH_KV_TMA
            int t_row, t_slot;
            const bool tma = tma_tile(cs, kv0, Sk, t_row, t_slot);
#endif
            if (j >= STAGES) ptx_mbarrier_wait(&empty_k[s], ((j / STAGES) - 1) & 1);
#if CUFLASH_KV_TMA
            if (tma) {
                if (ptid == 0) tma_cache_tile<NPANEL>(k_s + s * K_BYTES, tiles.k, cs, hk, t_row, t_slot, &full_k[s], bad);
            } else
#endif
            gather_tile<NPANEL>(k_s + s * K_BYTES, cs.k, cs.k_page, cs.k_row, cs, kv0, Sk, 2 * kv.head_dim, ptid, bad);
            ptx_cp_async_commit();
            if (j > 0) {   // V_{j-1} has landed
                ptx_cp_async_wait<1>();
                ptx_fence_proxy_async();   // the generic-proxy writes, before wgmma (async proxy) reads them
#if CUFLASH_KV_TMA
                if (!tma_v || ptid != 0)
#endif
                ptx_mbarrier_arrive(&full_v[(j - 1) % STAGES]);
            }
            if (j >= STAGES) ptx_mbarrier_wait(&empty_v[s], ((j / STAGES) - 1) & 1);
#if CUFLASH_KV_TMA
            if (tma) {
                if (ptid == 0) tma_cache_tile<NPANEL_V>(v_s + s * V_BYTES, tiles.v, cs, hk, t_row, t_slot, &full_v[s], bad);
            } else
#endif
            gather_tile<NPANEL_V>(v_s + s * V_BYTES, cs.v, cs.v_page, cs.v_row, cs, kv0, Sk, 2 * kv.head_dim_v, ptid, bad);
            ptx_cp_async_commit();
            ptx_cp_async_wait<1>();   // K_j has landed
            ptx_fence_proxy_async();
#if CUFLASH_KV_TMA
            if (!tma || ptid != 0)
#endif
            ptx_mbarrier_arrive(&full_k[s]);
#if CUFLASH_KV_TMA
            tma_v = tma;
#endif
        }
        if (ntiles > 0) {   // (the consumers read page_bad after this arrival)
            if (bad) atomicOr(&page_bad, 1);
            ptx_cp_async_wait<0>();
            ptx_fence_proxy_async();
#if CUFLASH_KV_TMA
            if (!tma_v || ptid != 0)
#endif
            ptx_mbarrier_arrive(&full_v[(ntiles - 1) % STAGES]);
        }
#endif
        return;
    }

    // ---------------------------------------------------------------------------- consumers
    // Per tile j (FA3 section 3.2, intra-warpgroup overlap): issue S_j = Q K_j^T and O += P_{j-1}
    // V_{j-1} together, wait for S_j only (wait_group 1), run S_j's softmax while the P V wgmma
    // runs, then wait for it, rescale O and convert P_j. Ping-pong (section 3.1): the two
    // consumers take turns on the tensor cores through two named barriers; each waits for its
    // turn before issuing a tile's wgmmas and hands the turn over right after, so one
    // warpgroup's softmax runs while the other's GEMMs do.
    ptx_setmaxnreg_inc<CONSUMER_REGS>();
    const int c = wg - 1;                                     // rows 64c.. of the tile
#if CUFLASH_FP8
    // the descales of (b, hk): q's and k's into the score scale (at least the smallest normal
    // float32, as scale_arg keeps it: a hidden score's exponent stays -inf), v's into 1 / l
    scale_log2 = fmaxf(scale_log2 * f8.q[b * f8.st[0] + hk * f8.st[1]] * f8.k[b * f8.st[2] + hk * f8.st[3]],
                       1.17549435e-38f);
    const float v_descale = f8.v[b * f8.st[4] + hk * f8.st[5]];
#endif
    const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const int row0 = m0 + 64 * c + 16 * warp + g;             // this thread's rows: row0 and row0 + 8
#if CUFLASH_GQA
    const int cpos = ((m0 >> 6) + c) * per;   // (this consumer's first position)
    const GqaRow grow[2] = {gqa_row(16 * warp + g, group, per), gqa_row(16 * warp + g + 8, group, per)};
    Rows rows{row0, cpos, cpos + per - 1, Sq, Sk, diag, window_left, window_right, t, scale_log2,
#else
    Rows rows{row0, m0 + 64 * c, m0 + 64 * c + 63, Sq, Sk, diag, window_left, window_right, t, scale_log2,
#endif
              CUFLASH_MODS != 0, CUFLASH_MODS ? 1.0f : scale_log2, {0, 0}, {0, 0}
#if CUFLASH_MODS
              , mods, head_mods<elem_t>(mods, b, h), mods.cap != 0.0f ? 1.0f / mods.cap : 0.0f
#endif
#if CUFLASH_BLOCK_SPARSE
              , true
#endif
#if CUFLASH_GQA
              , {cpos + grow[0].pos + diag, cpos + grow[1].pos + diag}
#endif
    };
#if CUFLASH_GQA && CUFLASH_MODS
#pragma unroll
    for (int r = 0; r < 2; ++r)   // (the row's head: h + its g)
        rows.slope[r] = mods.alibi ? mods.alibi[b * mods.alibi_bs + (h + grow[r].head) * mods.alibi_hs] *
                                         CUFLASH_LOG2E
                                   : 0.0f;
#endif
#pragma unroll
    for (int r = 0; r < 2 && EDGES_ONCE; ++r) {
        const int row = rows.pos(r);
        int first = 0, last = Sk - 1;
        if (CUFLASH_LOCAL && window_left >= 0) first = max(first, row + diag - window_left);
        if (CUFLASH_LOCAL && window_right >= 0) last = min(last, row + diag + window_right);
        rows.first[r] = first - 2 * t;
        rows.last[r] = last - 2 * t;
    }
    // the wgmma descriptors: this consumer's 64 rows of Q, and stage 0 of the K and V rings (the
    // stage s ones are K_BYTES / V_BYTES further on)
    // (each made opaque to the compiler: it otherwise folds the advances into 64-bit adds with
    // carry and rebuilds the stage descriptors from the addresses inside the first loop)
    QDescs dq;
    dq.base = ptx_opaque(desc_k_major(q_s + 64 * c * 128));
    const unsigned long long dk0 = ptx_opaque(desc_k_major(k_s)), dv0 = ptx_opaque(CUFLASH_FP8 ? desc_vt(v_s) : desc_n_major(v_s));
#pragma unroll
    for (int kk = 0; kk < (HOIST_Q ? D / KSTEP : 0); ++kk) dq.step[kk] = ptx_opaque(ptx_wgmma_desc_advance(dq.base, k_step_offset(kk, BR)));
    float o[DV / 2];
#pragma unroll
    for (int i = 0; i < DV / 2; ++i) o[i] = 0.0f;
    float m_run[2] = {CUFLASH_NEG_INF, CUFLASH_NEG_INF}, l_run[2] = {0.0f, 0.0f}, alpha[2];
    if (CUFLASH_MODS) alpha[0] = alpha[1] = 1.0f;   // (their loop's tile 0 rescales O = 0)
    float sc[BC / 2];
    unsigned pa[BC / KSTEP][4];
    ptx_mbarrier_wait(&q_full, 0);
    // turns: ntiles + 1 per consumer (S_0; S_j with P V_{j-1}; the last P V); each barrier gets
    // as many arrivals as syncs, so consumer 1 arrives once up front and skips its last hand-over
    if (c == 1 && ntiles > 0) ptx_bar_arrive(TURN_BAR + 0, 256);
#if CUFLASH_BLOCK_SPARSE
    BsWalk walk = bs_walk0;
#if defined(CUFLASH_SIM)
    int bs_entered[2] = {0, 0};   // tiles entered: partial, full (the simulator's count)
#endif
#endif
    if (!CUFLASH_MODS && ntiles > 0) {   // (the modifier forms run tile 0 in their loop)
        ptx_mbarrier_wait(&full_k[0], 0);
        ptx_bar_sync(TURN_BAR + c, 256);
        issue_s(sc, dq, dk0);
        ptx_bar_arrive(TURN_BAR + 1 - c, 256);
        ptx_wgmma_wait<0>();
        if (tid == 0) ptx_mbarrier_arrive(&empty_k[0]);
#if CUFLASH_BLOCK_SPARSE
        rows.user_mask = walk.partial();
#if defined(CUFLASH_SIM)
        ++bs_entered[rows.user_mask ? 0 : 1];
#endif
        softmax_tile<CUFLASH_LOCAL ? MASK_BOTH : MASK_RIGHT>(sc, walk.kv0(), rows, m_run, l_run, alpha);
        walk.next();
#else
        softmax_tile<CUFLASH_LOCAL ? MASK_BOTH : MASK_RIGHT>(sc, tile_lo * BC, rows, m_run, l_run, alpha);   // O is 0: O * alpha stays 0
#endif
#if !CUFLASH_FP8
        to_a_fragment(sc, pa);
#endif
    }
    // tile j of the walk, with P V of tile j - 1; mask: a MaskOf<Mask>
    // (j >= 1: unsigned, the stage and phase arithmetic is shifts and masks)
    // (the ring stage s = j % 2 and K's phase (j / 2) % 2 are loop state, updated by constants: V's
    // are tile j - 1's, sv = s ^ 1 and phase ph ^ s ^ 1)
    static_assert(STAGES == 2, "the consumer loop carries a two-stage ring's stage and phase");
    // (and the barriers' shared addresses are taken once: ptxas otherwise rebuilds each from the
    // CTA's shared window every tile)
    // (the modifier forms start the loop at tile 0: one copy of their per-score code, not two)
    constexpr int J0 = CUFLASH_MODS ? 0 : 1;
    unsigned s = J0, ph = 0;   // tile J0's
    // (not in the d256 KV-cache form: held there, they made NVRTC 13 spill, 32 B / 108 B; without
    // the opaque copy ptxas rebuilds them at each use, as before)
    constexpr bool HOLD_BARS = !(CUFLASH_KVCACHE && D == 256);
    const auto held = [](unsigned a) { return HOLD_BARS ? unsigned(ptx_opaque(int(a))) : a; };
    const unsigned bar_fk = held(ptx_smem_addr(full_k)), bar_fv = held(ptx_smem_addr(full_v));
    const unsigned bar_ek = held(ptx_smem_addr(empty_k)), bar_ev = held(ptx_smem_addr(empty_v));
    // (the stage descriptors too, up to D = 128: K's of stage s and V's of stage sv, each flipped
    // between its two stages by one exclusive or; at d256 the two more registers made NVRTC 13
    // spill the windowed form, 12 B / 84 B, so there they are rebuilt from s)
    constexpr bool CARRY_DESCS = D <= 128;
    unsigned long long dks = ptx_wgmma_desc_advance(dk0, J0 * K_BYTES), dvs = ptx_wgmma_desc_advance(dv0, (1 - J0) * V_BYTES);
    const unsigned dk_flip = ptx_opaque(int(ptx_wgmma_desc_advance(dk0, K_BYTES) ^ dk0)), dv_flip = ptx_opaque(int(ptx_wgmma_desc_advance(dv0, V_BYTES) ^ dv0));
    auto tile = [&](unsigned j, auto mask) {
        const unsigned sv = s ^ 1;
        const bool pv = !CUFLASH_MODS || j > 0;   // P_{j-1} V_{j-1} (tile 0 has none)
        rescale_o(o, alpha);   // by tile j - 1's factor, before P_{j-1} V_{j-1} joins O
        ptx_mbarrier_wait(bar_fk + 8 * s, ph);
        if (pv) ptx_mbarrier_wait(bar_fv + 8 * sv, ph ^ sv);
#if CUFLASH_FP8
        // the fp8 form converts P_{j-1} here, after the waits, not after the wait that retired P_{j-2} V:
        // there ptxas 13 hoists the conversions above that wait (under P V) into scratch registers,
        // since the in-flight wgmma still reads pa, and then moves every register of pa (24 MOV a tile
        // at 192 keys: 617 instructions a warp and tile, 593 here; NVRTC 12.9 packs with PRMT either
        // way, 621)
        to_a_fragment(sc, pa);
#endif
        ptx_bar_sync(TURN_BAR + c, 256);
        issue_s(sc, dq, CARRY_DESCS ? dks : ptx_wgmma_desc_advance(dk0, s * K_BYTES));
        issue_pv(o, pa, CARRY_DESCS ? dvs : ptx_wgmma_desc_advance(dv0, sv * V_BYTES), pv);
        ptx_bar_arrive(TURN_BAR + 1 - c, 256);
        ptx_wgmma_wait<1>();                       // S_j is in; P_{j-1} V_{j-1} may still run
#if CUFLASH_BLOCK_SPARSE
        rows.user_mask = walk.partial();   // (tile j: the lambda runs j = 1, 2, ... in order)
#if defined(CUFLASH_SIM)
        ++bs_entered[rows.user_mask ? 0 : 1];
#endif
        softmax_tile<decltype(mask)::value>(sc, walk.kv0(), rows, m_run, l_run, alpha);
        walk.next();
#else
        softmax_tile<decltype(mask)::value>(sc, (tile_lo + j) * BC, rows, m_run, l_run, alpha);
#endif
        // K_j's slot is free since S_j is in. Its release waits on row g's sum (fminf(l, 0) is +0 for
        // every l >= 0, inf or NaN, so thread 0 always arrives): ptxas keeps the wait for P V after
        // this arrival and issues the wait as early as it can, so the arrival decides how many
        // exponentials run under P V (without the dependence: a dozen of 66; with it, row g's 32 at
        // least: 46-56 at d128, 29-33 at d256, counted as docs/kernels.md says)
        if ((tid | __float_as_int(fminf(l_run[0], 0.0f))) == 0) ptx_mbarrier_arrive(bar_ek + 8 * s);
        ptx_wgmma_wait<0>();
        if (pv && tid == 0) ptx_mbarrier_arrive(bar_ev + 8 * sv);
#if !CUFLASH_FP8
        to_a_fragment(sc, pa);
#endif
        ph ^= s;
        s ^= 1;
        if (CARRY_DESCS) {
            dks ^= dk_flip;
            dvs ^= dv_flip;
        }
    };
    // tiles J0.. of the walk (tile 0 ran masked above, but in the modifier forms): left of ta =
    // st.lo - tile_lo a tile needs the left edge tested, from tb = st.hi - tile_lo on the right one; each consumer has its own ta and
    // tb, and as many turns. With ta <= tb: [1, ta) left, [ta, tb) steady, [tb, n) right; with ta > tb (a
    // window narrower than a tile): [1, tb) left, [tb, ta) both, [ta, n) right.
    const SteadyTiles st = steady_tiles(rows);
    const int ta = max(1, min(ntiles, st.lo - tile_lo)), tb = max(1, min(ntiles, st.hi - tile_lo));
    // The modifier forms keep one loop, masked throughout, from tile 0: their per-score modifier
    // code dominates a tile, and more copies of it would multiply the kernel and its ptxas time.
    int j = J0;
    if (CUFLASH_MODS) {
        for (; j < ntiles; ++j) tile(j, MaskOf<CUFLASH_LOCAL ? MASK_BOTH : MASK_RIGHT>{});
    } else {
        if (CUFLASH_LOCAL) {
            for (; j < min(ta, tb); ++j) tile(j, MaskOf<MASK_LEFT>{});
            for (; j < ta; ++j) tile(j, MaskOf<MASK_BOTH>{});
        }
        for (; j < tb; ++j) tile(j, MaskOf<MASK_NONE>{});
        for (; j < ntiles; ++j) tile(j, MaskOf<MASK_RIGHT>{});
    }
    if (ntiles > 0) {
        const int sv = (ntiles - 1) % STAGES;
        rescale_o(o, alpha);
        ptx_mbarrier_wait(&full_v[sv], ((ntiles - 1) / STAGES) & 1);
#if CUFLASH_FP8
        to_a_fragment(sc, pa);   // (the fp8 form: the last P, converted before its P V, as in the loop)
#endif
        ptx_bar_sync(TURN_BAR + c, 256);
        issue_pv(o, pa, CARRY_DESCS ? dvs : ptx_wgmma_desc_advance(dv0, sv * V_BYTES));   // (dvs: the loop left stage sv's)
        if (c == 0) ptx_bar_arrive(TURN_BAR + 1, 256);
        ptx_wgmma_wait<0>();   // (the last V slot is not released: no load waits for it)
    }
#if CUFLASH_BLOCK_SPARSE && defined(CUFLASH_SIM)
    if (bs.count && c == 0 && tid == 0) {   // (the simulator's count of the tiles this block entered)
        const long long blk = blockIdx.x + (long long)gridDim.x * (blockIdx.y + (long long)gridDim.y * blockIdx.z);
        bs.counts[2 * blk] = bs_entered[0];
        bs.counts[2 * blk + 1] = bs_entered[1];
    }
#endif
#if CUFLASH_KVCACHE
    const bool bad = cs.bad || (ntiles > 0 && page_bad);   // (page_bad: set before the last V's arrival)
#endif
    // epilogue: O / l into 16-bit, staged over this consumer's Q rows (128-byte swizzle), TMA store
    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float l = quad_sum(l_run[r]);
#if CUFLASH_GQA
        // (the row's position and head taken again here, not held across the loop, since held values of
        // this kind spill at d256; lse and the partials in the unpacked rows'
        // (batch, head, position) order; a dead row writes none)
        const int pe = 64 / group;
        const GqaRow er = gqa_row(16 * warp + g + 8 * r, group, pe);
        const int epos = ((m0 >> 6) + c) * pe + er.pos;
#endif
#if CUFLASH_MODS && CUFLASH_KVCACHE
        // (split-KV: the sink joins split 0's rows only, so that the combine counts it once a row)
#if CUFLASH_GQA
        const float keep = split == 0 ? sink_fold(mods, h + er.head, m_run[r], l) : 1.0f;   // (the row's head)
#else
        const float keep = split == 0 ? sink_fold(mods, h, m_run[r], l) : 1.0f;
#endif
#elif CUFLASH_MODS
        const float keep = sink_fold(mods, h, m_run[r], l);   // (1 without sinks)
#elif CUFLASH_FP8
        const float keep = v_descale;   // (O of the fp8 V: v_descale O is the descaled V's)
#else
        const float keep = 1.0f;
#endif
        inv[r] = l != 0.0f ? keep / l : 0.0f;   // (NaN l, a row that read a NaN: NaN out, NaN lse)
#if CUFLASH_KVCACHE
        // a split's LSE into lse_partial (rows (batch, head, query row)); an index out of range: NaN
        float row_lse = l != 0.0f ? (m_run[r] + log2f(l)) * 0.69314718055994531f : CUFLASH_NEG_INF;
        if (bad) inv[r] = row_lse = __int_as_float(0x7fc00000);
#if CUFLASH_GQA
        if (t == 0 && er.live && epos < Sq)
            (nsplit > 1 ? kv.lse_partial + split * kv.partial_rows : lse)[(size_t(b) * Hq + h + er.head) * Sq + epos] = row_lse;
#else
        if (t == 0 && row0 + 8 * r < Sq)   // (chunked prefill: lse is the split's partial rows already)
            (nsplit > 1 && !CUFLASH_VARLEN ? kv.lse_partial + split * kv.partial_rows : lse)[(CUFLASH_VARLEN ? 0 : (size_t(b) * Hq + h) * Sq) + row0 + 8 * r] = row_lse;
#endif
#elif CUFLASH_GQA
        if (t == 0 && er.live && epos < Sq)   // (as in the KV-cache form)
            lse[(size_t(b) * Hq + h + er.head) * Sq + epos] = l != 0.0f ? (m_run[r] + log2f(l)) * 0.69314718055994531f : CUFLASH_NEG_INF;
#else
        if (t == 0 && row0 + 8 * r < Sq)
            lse[(CUFLASH_VARLEN ? 0 : (size_t(b) * Hq + h) * Sq) + row0 + 8 * r] = l != 0.0f ? (m_run[r] + log2f(l)) * 0.69314718055994531f : CUFLASH_NEG_INF;
#endif
    }
#if CUFLASH_KVCACHE
    if (nsplit > 1) {   // the split's normalized float32 O, for the combine
#if CUFLASH_GQA
        // (rows in the (batch, head, position) order of the unpacked form's partials: the combine is the same)
        float* op[2];
        bool live[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int pe = 64 / group;
            const GqaRow er = gqa_row(16 * warp + g + 8 * r, group, pe);
            const int epos = ((m0 >> 6) + c) * pe + er.pos;
            live[r] = er.live && epos < Sq;
            op[r] = kv.o_partial + (size_t(split) * kv.partial_rows + (size_t(b) * Hq + h + er.head) * Sq + epos) * kv.head_dim_v;
        }
#pragma unroll
        for (int i = 0; i < DV / 2; i += 2) {
            const int r = (i % 4) / 2, col = 8 * (i / 4) + 2 * t;
            if (live[r] && col < kv.head_dim_v)
                *reinterpret_cast<float2*>(op[r] + col) = make_float2(o[i] * inv[r], o[i + 1] * inv[r]);
        }
#else
        // (chunked prefill: O's partial row 0 of the block is lse's, rows (split, head, total_q row))
        float* op = CUFLASH_VARLEN ? kv.o_partial + size_t(lse - kv.lse_partial) * kv.head_dim_v
                                   : kv.o_partial + (size_t(split) * kv.partial_rows + (size_t(b) * Hq + h) * Sq) * kv.head_dim_v;
#pragma unroll
        for (int i = 0; i < DV / 2; i += 2) {
            const int r = (i % 4) / 2, row = row0 + 8 * r, col = 8 * (i / 4) + 2 * t;
            if (row < Sq && col < kv.head_dim_v)
                *reinterpret_cast<float2*>(op + size_t(row) * kv.head_dim_v + col) = make_float2(o[i] * inv[r], o[i + 1] * inv[r]);
        }
#endif
        return;
    }
#endif
    unsigned char* o_s = o_st + 64 * c * 128;
#pragma unroll
    for (int i = 0; i < DV / 2; i += 2) {
        const int r = (i % 4) / 2, rr = 16 * warp + g + 8 * r, col = 8 * (i / 4) + 2 * t;
        const int p = col / PANEL, cb = (col % PANEL) * 2;   // byte within the 128-byte row
        const int sw = ((cb >> 4) ^ (rr & 7)) << 4 | (cb & 15);
        *reinterpret_cast<unsigned*>(o_s + p * PANEL_Q + rr * 128 + sw) = pack(o[i] * inv[r], o[i + 1] * inv[r]);
    }
    ptx_fence_proxy_async();
    ptx_bar_sync(EPILOGUE_BAR + c, 128);
    if (tid == 0) store_o(tiles, o_s, m0 + 64 * c);
}

}  // namespace fwd_sm90

extern "C" __global__ void __launch_bounds__(384, 1) CUFLASH_ENTRY(const __grid_constant__ cuflash_tensor_map map_q,
#if !CUFLASH_KVCACHE || CUFLASH_KV_TMA
                                                                   const __grid_constant__ cuflash_tensor_map map_k,
                                                                   const __grid_constant__ cuflash_tensor_map map_v,
#endif
                                                                   const __grid_constant__ cuflash_tensor_map map_o,
                                                                   float* lse, int Sq, int Sk, int Hq, int group,
                                                                   float scale_log2, int window_left, int window_right
#if CUFLASH_VARLEN
                                                                   , const int* __restrict__ cu_seqlens_q,
                                                                   const int* __restrict__ cu_seqlens_k,
                                                                   const int* __restrict__ seqused_k, int varlen
#endif
#if CUFLASH_KVCACHE
                                                                   , const unsigned char* __restrict__ k_cache,
                                                                   const unsigned char* __restrict__ v_cache,
                                                                   long long k_page_stride, long long k_row_stride,
                                                                   long long k_head_stride, long long v_page_stride,
                                                                   long long v_row_stride, long long v_head_stride,
                                                                   const int* __restrict__ cache_seqlens,
                                                                   const int* __restrict__ cache_leftpad,
                                                                   const int* __restrict__ cache_batch_idx,
                                                                   const int* __restrict__ block_table,
                                                                   long long block_table_stride, int page_size,
                                                                   int num_pages, int cache_seqlen, int seqlen_new,
                                                                   int cache_capacity, int cache_flags, int num_splits,
                                                                   long long partial_rows, int head_dim, int head_dim_v,
                                                                   float* __restrict__ o_partial,
                                                                   float* __restrict__ lse_partial
#endif
#if CUFLASH_MODS
                                                                   , CUFLASH_MODS_PARAMS
#endif
#if CUFLASH_FP8
                                                                   , const float* __restrict__ q_descale,
                                                                   const float* __restrict__ k_descale,
                                                                   const float* __restrict__ v_descale,
                                                                   long long qd_batch_stride, long long qd_head_stride,
                                                                   long long kd_batch_stride, long long kd_head_stride,
                                                                   long long vd_batch_stride, long long vd_head_stride
#endif
                                                                   ) {
#if CUFLASH_MODS
    const ScoreMods mods = CUFLASH_MODS_INIT;
#else
    const ScoreMods mods{};   // none: every modifier off
#endif
#if !CUFLASH_VARLEN
    const int *cu_seqlens_q = nullptr, *cu_seqlens_k = nullptr, *seqused_k = nullptr, varlen = 0;   // (fixed shapes)
#endif
#if CUFLASH_KVCACHE
    // (K and V are gathered from the caches: the k and v tensor maps are not read)
    const fwd_sm90::KvArgs kv{k_cache, v_cache, {k_page_stride, k_row_stride, k_head_stride, v_page_stride, v_row_stride,
                              v_head_stride}, cache_seqlens, cache_leftpad, cache_batch_idx, block_table,
                              block_table_stride, partial_rows, page_size, num_pages, cache_seqlen, seqlen_new,
                              cache_capacity, cache_flags, num_splits, head_dim, head_dim_v, o_partial, lse_partial};
#if CUFLASH_KV_TMA
    // (TMA over the cache: the k and v maps carry the tiles that lie whole in a page)
    fwd_sm90::forward(map_q, map_k, map_v, map_o, lse, Sq, Sk, Hq, group, scale_log2, window_left, window_right, mods,
                      cu_seqlens_q, cu_seqlens_k, seqused_k, varlen, kv);
#else
    fwd_sm90::forward(map_q, map_q, map_q, map_o, lse, Sq, Sk, Hq, group, scale_log2, window_left, window_right, mods,
                      cu_seqlens_q, cu_seqlens_k, seqused_k, varlen, kv);
#endif
#elif CUFLASH_BLOCK_SPARSE
    const fwd_sm90::BsArgs bs{bs_num, bs_idx, bs_full_num, bs_full_idx, bs_num_bs, bs_num_hs, bs_idx_bs, bs_idx_hs,
                              bs_idx_rs, bs_outer, bs_inner, bs_counts, bs_count};
    fwd_sm90::forward(map_q, map_k, map_v, map_o, lse, Sq, Sk, Hq, group, scale_log2, window_left, window_right, mods,
                      cu_seqlens_q, cu_seqlens_k, seqused_k, varlen, bs);
#elif CUFLASH_FP8
    const fwd_sm90::Fp8Args f8{q_descale, k_descale, v_descale, {qd_batch_stride, qd_head_stride, kd_batch_stride,
                               kd_head_stride, vd_batch_stride, vd_head_stride}};
    fwd_sm90::forward(map_q, map_k, map_v, map_o, lse, Sq, Sk, Hq, group, scale_log2, window_left, window_right, mods,
                      cu_seqlens_q, cu_seqlens_k, seqused_k, varlen, f8);
#else
    fwd_sm90::forward(map_q, map_k, map_v, map_o, lse, Sq, Sk, Hq, group, scale_log2, window_left, window_right, mods,
                      cu_seqlens_q, cu_seqlens_k, seqused_k, varlen);
#endif
}

#endif  // sm_90a
