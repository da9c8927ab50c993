// cuflash: the tensor-core attention forward (fp16/bf16, sm_80 and newer).
//
// Same algorithm, masks, arguments and results as attention_fwd_simt.cu (FlashAttention-2,
// Dao 2023, Algorithm 1, with the corrections of docs/kernels.md, "Corrections to the textbook algorithm"), with FA2's work split (Dao 2023,
// §3.3: one warp owns whole query rows, so no warp needs another's partial sums):
//
// * One thread block of NW warps owns a Br = 16 * MT * NW query tile of one (batch, head); warp w
//   owns query rows [16 MT w, 16 MT (w + 1)), MT 16-row fragments of it (MT = 2 for head-dim
//   buckets <= 128: each K and V fragment read from shared memory feeds two mma instead of one,
//   160 shared-memory bytes per mma at d128 instead of 256; MT = 1 above, where the O
//   accumulator fills the registers). Grid is 1-D (blockIdx.x = tile + num_q_tiles * (head +
//   Hq * batch); grid_coord in common.cuh), so gridDim.y/z never limit B*H; the query tiles of a
//   head run last-first, so the causal tiles that see the most keys start first.
// * S = Q K^T and O += P V run on tensor cores: mma.sync.aligned.m16n8k16, f16 or bf16 inputs,
//   f32 accumulators. Operands come from shared memory through ldmatrix (.x4; .trans for V,
//   which is stored key-major); Q's A fragments are re-read every tile (registers hold O and S).
// * P never leaves registers: the S accumulator fragment of two adjacent 8-key blocks is exactly
//   the A fragment of one 16-key k-step (c[0..1] -> a[0]/a[2], c[2..3] -> a[1]/a[3]), packed to
//   16 bits with cvt.rn.{f16,bf16}x2.f32.
// * Softmax in the log2 domain: softmax_scale * log2(e) is scale_log2, and for scale_log2 > 0
//   the row max is taken over the raw scores and P = exp2(s * scale_log2 - m) is one FFMA and
//   one MUFU.EX2 per score (scale_log2 <= 0 multiplies the scores first). Each lane holds two
//   rows per fragment (g and g + 8); the row max is reduced over the 4 lanes of a quad with
//   __shfl_xor_sync every tile; the row sum stays per-lane (each lane's partial sum is rescaled
//   by the same alpha) and is reduced once, after the K/V loop.
// * Shared memory (dynamic, 16-bit elements): Q [Br][Dmax + 8], then STAGES stages of K
//   [Bc][Dmax + 8] and V [Bc][Dmax + 8]. Rows are padded by 16 bytes: the row pitch is an odd
//   number of 16-byte chunks for every bucket (64, 96, 128, 192, 256), so the 8 row addresses of
//   one ldmatrix phase and the 16-byte cp.async writes of 8 consecutive chunks hit distinct bank
//   quads (no bank conflicts, and unlike an XOR swizzle it also works for 12- and 24-chunk rows).
// * Pipeline, STAGES = 2 (buckets <= 128): cp.async (16 bytes, .cg) with commit/wait groups. The
//   prologue issues Q and the first K/V tile as one group. At the top of iteration j each thread
//   waits for its copies of tile j, and one barrier makes every thread's copies visible and
//   every thread done with tile j - 1, whose stage the block then refills with tile j + 1: one
//   barrier per tile, the copy of tile j + 1 overlapping the math of tile j. STAGES = 1 (192,
//   256: one stage fits two blocks per SM, which overlap each other instead): wait and barrier,
//   the math, a barrier, then the refill.
// * Copies: each thread copies the same 16-byte column chunk of rows r0, r0 + kRowsPerPass, ...
//   of every tile, so its source offsets are computed once, before the loop. Tiles with every
//   key below Sk copy without predicates; only the tile that straddles Sk (and a thread whose
//   chunk lies past D or Dv) tests rows and zero-fills.
// * Masks are run-time: K/V tiles no row of the block can see are never visited (causal tiles
//   above the diagonal, tiles outside a window), and only tiles that straddle Sk, the diagonal
//   or a window edge pay for the per-element mask (each row's visible key range computed once
//   per tile); interior tiles run unmasked.
// * Out of view: rows >= Sq / keys >= Sk and columns >= D / Dv are zero-filled by cp.async's
//   src-size (never read); zero V rows keep P * V finite. Output goes through shared memory (the
//   warp's own Q rows) and leaves as 16-byte stores of rows < Sq, columns < Dv.
//
// Needs 16-byte-aligned rows: q, k, v, out and all their strides multiples of 8 elements, and
// D, Dv multiples of 8 (cuflash/kernels/attention_fwd_mma.py: unsupported_reason; the dispatcher falls back
// to the SIMT kernel otherwise).
//
// Variable-length batches (the CUFLASH_VARLEN 1 variants): the block's sequence moves the base
// pointers and sets the lengths before anything else (common.cuh: varlen_seq_uniform; the lengths
// stay in uniform registers, as the fixed form's arguments do); tiles past it exit at once.
//
// KV-cache attention (the CUFLASH_KVCACHE 1 variants; cuflash.attention_with_kvcache, and
// attention_varlen with a block table): the keys of sequence b are its cache indices [start,
// end), start = cache_leftpad[b] (0 without), end = cache_seqlens[b] + seqlen_new (the append
// kernel, kvcache_append.cu, wrote the new keys before this launch), or the key count of a
// packed batch (varlen). A contiguous cache is the fixed-shape kernel with the batch remapped
// (cache_batch_idx) and the base moved to row `start`; a paged cache (cache_flags & 8) gathers
// each tile row by row with cp.async from row p % page_size of page block_table[b][p / page_size].
// The query heads that share a kv head are packed into the rows of one tile (FA3's pack-GQA;
// `pack` heads, packed row r is query row r / pack of head r % pack), so each K/V byte is read once
// per kv head; warps whose rows are all past the sequence's skip the math (they still copy).
// With num_splits > 1 the block handles split `s` of the key tiles (flash-decoding) and writes
// its normalized float32 O and its LSE into o_partial / lse_partial for attention_combine.cu.
// Indices are clamped into the cache; a sequence whose index was out of range (device-resident
// indices the host could not check) gets NaN in every row it writes.
//
// An fp8 KV cache (the CUFLASH_CACHE_FP8 1 variants of the KV-cache form; float8_e4m3fn caches with
// FA3's per-(batch, kv head) k_descale / v_descale): each thread cp.asyncs its 8-byte chunks of
// fp8 K and V (the 16-byte chunks' rows and columns, 8 elements each) into a staging area, and
// after its own wait converts them to the element type in the K/V tile (cvt.rn.f16x2.e4m3x2,
// ptx.cuh: exact, every e4m3 value is a binary16 and a bfloat16 value), which the mma read as
// before. A thread converts only the chunks it copied itself, so one staging buffer is enough:
// it refills it with tile j + 1 at once, and the copy overlaps tile j's math; two barriers per
// tile (the K/V tile is free; the converted tile is visible). The descales are one per block (one
// sequence, one kv head): k_descale[b, h] multiplies scale_log2 (the scores are q . (k * kd)
// scaled), v_descale[b, h] the output rows at the epilogue (O = (P V) vd), in float32, the same
// products as dequantizing each element, summed in another order.
//
// Dropout (the CUFLASH_DROPOUT 1 variants): after the online softmax of a tile, each P element
// whose Philox draw fails the threshold is zeroed and the others scaled by 1 / (1 - p)
// (dropout.cuh); the row sums, and so the LSE, are the undropped softmax's.
//
// Score modifiers (the CUFLASH_MODS 1 variants; score_mods.cuh): softcap, ALiBi, the additive
// bias and the boolean mask act on the scaled scores of every tile before the window mask, and a
// warp whose rows the mask hides from a whole tile skips that tile's math; the sink joins each
// row's denominator at the epilogue (split 0's, under split-KV: the combine keeps it once).
//
// The sm_75 form (CUFLASH_SM75_FORM, ptx.cuh: no cp.async; one stage): where the next tile's
// chunks fit the registers (FWD_REG_STAGE below), each thread issues its global loads of K/V tile
// j + 1 into registers before tile j's math and stores them to the stage after it (after the
// barrier that says every warp is done with the stage), so the load latency hides behind the
// math; elsewhere the refill after the math is a synchronous copy (a load, then its store).
//
// Block-sparse masks (the CUFLASH_BLOCK_SPARSE 1 variants of a traced mask_mod; score_mods.cuh): the
// loop runs over the block mask's partial then full key blocks of the tile's query block instead of a
// contiguous run (tile j's key from the lists, so each refill computes its source from the key), and
// mod_score evaluates mask_mod on the partial tiles only; empty blocks are never entered.
//
// Variant prelude (cuflash/kernels/attention_fwd_mma.py: AttentionFwdMma.defines()):
//   CUFLASH_ENTRY, CUFLASH_T (__half, __nv_bfloat16), CUFLASH_BF16 (0/1), CUFLASH_HEAD_DIM_MAX,
//   CUFLASH_BLOCK_M (Br = 16 * MT * warps), CUFLASH_BLOCK_N (Bc), CUFLASH_THREADS, CUFLASH_M_FRAGS
//   (MT), CUFLASH_STAGES, CUFLASH_MIN_BLOCKS (__launch_bounds__), CUFLASH_SMEM_BYTES (checked below),
//   CUFLASH_VARLEN, CUFLASH_KVCACHE, CUFLASH_DROPOUT, CUFLASH_MODS (0/1), CUFLASH_CACHE_FP8 (1 in the
//   fp8-cache forms only).
#include "ptx.cuh"

typedef CUFLASH_T elem_t;
#ifndef CUFLASH_CACHE_FP8
#define CUFLASH_CACHE_FP8 0
#endif
#if CUFLASH_CACHE_FP8
typedef unsigned char kv_t;   // float8_e4m3fn bytes
#else
typedef elem_t kv_t;
#endif

#define BR CUFLASH_BLOCK_M
#define BC CUFLASH_BLOCK_N
#define DMAX CUFLASH_HEAD_DIM_MAX
#define NT CUFLASH_THREADS
#define MT CUFLASH_M_FRAGS            // 16-row fragments per warp
#define STAGES CUFLASH_STAGES
#define NWARPS (NT / 32)
#define PITCH (DMAX + 8)              // shared-memory row pitch, elements
#define CHUNKS (DMAX / 8)             // 16-byte chunks per row
#define KSTEPS_D (DMAX / 16)          // k-steps of Q K^T
#define NFRAG_S (BC / 8)              // 8-key accumulator blocks of S
#define KSTEPS_N (BC / 16)            // k-steps of P V
#define NFRAG_O (DMAX / 8)            // 8-column accumulator blocks of O
#define STAGE_ELEMS (2 * BC * PITCH)  // one K tile and one V tile
#define LN2 0.6931471805599453f

static_assert(BR == 16 * MT * NWARPS, "each warp owns MT 16-row fragments of the query tile");
static_assert(STAGES == 1 || STAGES == 2, "one or two K/V stages");
static_assert(DMAX % 16 == 0 && BC % 16 == 0, "head-dim bucket and Bc must be multiples of 16");
static_assert(CHUNKS % 2 == 0, "the row pitch must be an odd number of 16-byte chunks");
#ifndef CUFLASH_KVCACHE
#define CUFLASH_KVCACHE 0
#endif
#if CUFLASH_CACHE_FP8
static_assert(CUFLASH_KVCACHE, "an fp8 cache is read by the KV-cache form only");
#define KV8_PITCH (DMAX + 16)   // fp8 staging row pitch, bytes
// Q, one K/V tile of the element type, and the fp8 staging of one K and one V tile
static_assert(2 * (BR * PITCH + STAGE_ELEMS) + 2 * BC * KV8_PITCH == CUFLASH_SMEM_BYTES,
              "the variant's shared-memory size (cuflash/kernels/attention_fwd_mma.py) disagrees with this layout");
#else
static_assert(2 * (BR * PITCH + STAGES * STAGE_ELEMS) == CUFLASH_SMEM_BYTES,
              "the variant's shared-memory size (cuflash/kernels/attention_fwd_mma.py) disagrees with this layout");
#endif

#include "mma_tile.cuh"
#ifndef CUFLASH_DROPOUT
#define CUFLASH_DROPOUT 0
#endif
#if CUFLASH_DROPOUT
#include "dropout.cuh"
#endif
#include "score_mods.cuh"
static_assert(!CUFLASH_BLOCK_SPARSE || (!CUFLASH_KVCACHE && !CUFLASH_VARLEN && MT == 1),
              "a block mask is read by the fixed-shape modifier forms only");

// The copies' thread layout: kRowsPerPass rows of CHUNKS 16-byte chunks per pass, the largest
// power of two with kRowsPerPass * CHUNKS <= NT rows; thread tid < kCopyThreads moves chunk
// tid % CHUNKS of rows tid / CHUNKS + i * kRowsPerPass of every tile, so its offsets are computed
// once and each further row is one address add. The threads from kCopyThreads on (the last warp
// at buckets 96 and 192, whose 12- and 24-chunk rows do not divide 128 threads) copy nothing.
//
// copy_rows: `dst` and `src` already point at (r0, c) of the tile and its source; `pass_stride`
// is kRowsPerPass source rows; `rows_left` = rows in view - r0. A chunk out of view is
// zero-filled from `base`, the array's first element (16-byte aligned even where a length-1 axis
// has an odd stride: cp.async needs an aligned address even when it reads nothing).
constexpr int kRowsPerPassMax = NT / CHUNKS;
constexpr int kRowsPerPass = kRowsPerPassMax >= 32 ? 32 : kRowsPerPassMax >= 16 ? 16 : kRowsPerPassMax >= 8 ? 8
                             : kRowsPerPassMax >= 4 ? 4 : kRowsPerPassMax >= 2 ? 2 : 1;
constexpr int kCopyThreads = kRowsPerPass * CHUNKS;
static_assert(CHUNKS <= NT && BC % kRowsPerPass == 0 && BR % kRowsPerPass == 0,
              "the copies' row passes must tile Bc and Br");

template <int MAX_ROWS>
__device__ __forceinline__ void copy_rows(elem_t* dst, const elem_t* src, const elem_t* base, long long pass_stride,
                                          int rows_left, bool col_ok) {
#pragma unroll
    for (int i = 0; i < MAX_ROWS / kRowsPerPass; ++i) {
        const bool valid = col_ok && i * kRowsPerPass < rows_left;
        ptx_cp_async_16_zfill(dst + i * kRowsPerPass * PITCH, valid ? src + i * pass_stride : base, valid ? 16 : 0);
    }
}

// copy_rows for an interior tile (every row and this thread's column in view): no bounds checks,
// no zero-fill, one address add per row pass.
template <int MAX_ROWS>
__device__ __forceinline__ void copy_rows_interior(elem_t* dst, const elem_t* src, long long pass_stride) {
#pragma unroll
    for (int i = 0; i < MAX_ROWS / kRowsPerPass; ++i) ptx_cp_async_16(dst + i * kRowsPerPass * PITCH, src + i * pass_stride);
}

// FWD_REG_STAGE: 1 in the sm_75 form's one-stage forms without a KV cache where the next tile's
// chunks fit the registers; the next K/V tile then waits in registers across the math (fetch_kv,
// put_kv below): 2 BC / kRowsPerPass uint4 per thread, 16 registers at bucket 64 (128 x 32) and at
// 128 x 16 (the packed form's bucket-128 tile), 32 at 96. Under NVRTC 12.9 and 13.x (ptxas -v,
// sm_75) the fixed tile takes 180 registers at 64 and 232 at 96, the packed 128 x 16 tile 241 at
// 128, no spill; the 128 x 32 tile at 128 spills 16 bytes under both (12 with the loads issued
// before P V instead), the tiles at 192 and 256 spill (56 and 44 bytes under 12.9), and the
// modifier forms at 96 reach 254 (a traced modifier's code would spill), so those keep the
// synchronous refill after the math.
#if CUFLASH_SM75_FORM && STAGES == 1 && !CUFLASH_CACHE_FP8 && !CUFLASH_KVCACHE && \
    (DMAX <= 64 || (DMAX <= 96 && !CUFLASH_MODS) || (DMAX <= 128 && BC <= 16 && !CUFLASH_MODS))
#define FWD_REG_STAGE 1
#else
#define FWD_REG_STAGE 0
#endif

// FWD_M_FLOOR: the running row maximum's start, -FLT_MAX instead of -inf. While a row has seen no
// visible key, its maximum stays here, its sum and O at 0, and exp2(s - m) of a -inf score is exp2(-inf)
// = 0; the loop then needs no test for a maximum of -inf (4 FSETP + 4 FSEL per tile at 128 x 64). The
// epilogue reads the row as empty by its sum (l == 0), never by its maximum; the sink fold's rescale of
// such a row multiplies an O and a sum of 0.
#define FWD_M_FLOOR (-3.40282347e+38f)

// FWD_HOLD_BAND: 1 on sm_90, where the right-edge band bound's base (band_base below) is held in a
// register across the loop (ptx_opaque: ptxas would rebuild it in the mask block from the lane and block
// coordinates, 5 instructions). On sm_80 the held register cost the bf16 d128 steady pass 4 instructions
// (ptxas 12.9 and 13.x), and in the dropout forms at head dim 256 on sm_90 it spilled 4-8 bytes (255
// registers, both majors), so there it is rebuilt.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !CUFLASH_DROPOUT
#define FWD_HOLD_BAND 1
#else
#define FWD_HOLD_BAND 0
#endif

// The band mask (in the loop below): a masked tile tests each key offset from the diagonal once for
// all of a lane's rows. FWD_BAND_TWO_EDGE: 1 where it also takes a left window edge (alone or with a
// right one). The packed two-fragment tiles take the band for a right edge alone (the causal diagonal,
// FWD_BAND_PACKED_CAUSAL) only: with the other two band bodies, ptxas 12.9 spills 4 bytes in the
// packed bf16 d128 tile on sm_90 (255 registers), and every rearrangement tried either spilled or cost
// 6 instructions on the steady path. The causal body alone costs the packed bf16 d128 steady pass
// +6 / -3 instructions on sm_90 and +2 / +3 on sm_80 (NVRTC 12.9 / 13.x), and its diagonal tile 89-98
// fewer (within 1.1% of the fixed form's).
#define FWD_BAND_TWO_EDGE (!(CUFLASH_VARLEN && MT == 2))
#ifndef FWD_BAND_PACKED_CAUSAL
#define FWD_BAND_PACKED_CAUSAL 1
#endif

// A traced function's form (CUFLASH_USER_MOD) is compiled cold on the first call with a new function;
// at head dim 192 without a block mask (64 x 64 tiles, 254-255 registers) that took NVRTC 1.7-2.1 s of CPU
// on a 2-core machine, fully unrolled, most of it in the 32 inlined copies of the function per tile.
// There the modifier loop is rolled over the 8-key blocks (FWD_ROLL_MODS, below: the blocks rotate,
// so every register index stays a constant), the mask's skip test over the blocks too, and S's
// k-steps run four at a time: 0.9-1.2 s, 216-254 registers, no spill (NVRTC 12 and 13, sm_75-sm_90).
// Every other form is unrolled fully, as before.
#define FWD_PRAGMA(x) _Pragma(#x)
#ifndef FWD_ROLL_MODS
#define FWD_ROLL_MODS (CUFLASH_USER_MOD && DMAX == 192 && !CUFLASH_BLOCK_SPARSE)
#endif
#if CUFLASH_USER_MOD && DMAX == 192 && !CUFLASH_BLOCK_SPARSE
#define FWD_UNROLL_S_K FWD_PRAGMA(unroll 4)
#define FWD_UNROLL_ANY FWD_PRAGMA(unroll 1)
#else
#define FWD_UNROLL_S_K FWD_PRAGMA(unroll)
#define FWD_UNROLL_ANY FWD_PRAGMA(unroll)
#endif

// floor(x / BC) for any sign of x.
__device__ __forceinline__ long long floor_div_bc(long long x) { return x >= 0 ? x / BC : -((BC - 1 - x) / BC); }

// The steady tiles of a block's run of n_tiles key tiles from key kv_lo: tiles [lo, hi) lie wholly
// below Sk and inside every row's window for the block's query positions [pos0, pos0 + pos_span)
// (tile_in_window of common.cuh, solved for the tile index once instead of tested per tile); the
// tiles outside need the per-element mask. 64-bit, so no bound near INT32_MAX wraps.
__device__ __forceinline__ IndexRange steady_tiles(int kv_lo, int n_tiles, int pos0, int pos_span, int seqlen_q,
                                                   int seqlen_k, int window_left, int window_right) {
    const long long diag = (long long)seqlen_k - seqlen_q + pos0;   // the diagonal key of row pos0
    long long hi = floor_div_bc((long long)seqlen_k - kv_lo);        // (j + 1) BC <= Sk - kv_lo
    if (window_right >= 0) hi = min(hi, floor_div_bc(diag + window_right + 1 - kv_lo));   // last key <= diag + right
    long long lo = 0;
    if (window_left >= 0) lo = -floor_div_bc(-(diag + pos_span - 1 - window_left - kv_lo));   // first key >= last row's diag - left
    IndexRange r;
    r.lo = (int)min(max(lo, 0ll), (long long)n_tiles);
    r.hi = (int)min(max(hi, (long long)r.lo), (long long)n_tiles);
    return r;
}

#if CUFLASH_KVCACHE
// Where the keys of one sequence live in a KV cache (see the header comment).
struct CacheSeq {
    int start;      // first cache index the sequence keeps
    int seqlen_k;   // keys it attends to
    int cache_b;    // contiguous cache: its cache batch
    int bad;        // 1 when an index was out of range (the rows come out NaN)
};

__device__ __forceinline__ CacheSeq cache_seq(long long b, int keys, int capacity, const int* __restrict__ leftpad,
                                              const int* __restrict__ batch_idx, int num_batches, int flags) {
    CacheSeq c;
    c.bad = keys < 0 || keys > capacity;
    const int end = clamp_index(keys, 0, capacity);
    int start = (flags & 2) ? leftpad[b] : 0;
    c.bad |= start < 0 || start > end;
    c.start = clamp_index(start, 0, end);
    c.seqlen_k = end - c.start;
    int cb = (flags & 4) ? batch_idx[b] : (int)b;
    c.bad |= cb < 0 || cb >= num_batches;
    c.cache_b = clamp_index(cb, 0, num_batches - 1);
    c.start = warp_uniform(c.start), c.seqlen_k = warp_uniform(c.seqlen_k);
    c.cache_b = warp_uniform(c.cache_b), c.bad = warp_uniform(c.bad);
    return c;
}

// Cache index `p` of a paged sequence: row p % page_size of page bt_row[p / page_size], the page
// clamped into [0, num_pages) (`bad` set when it was not).
struct PageRow {
    long long page;
    int row;
};

__device__ __forceinline__ PageRow page_row(const int* __restrict__ bt_row, int p, int page_size, int num_pages, int& bad) {
    const int slot = p / page_size;
    const int page = bt_row[slot];
    bad |= page < 0 || page >= num_pages;
    PageRow r;
    r.page = clamp_index(page, 0, num_pages - 1);
    r.row = p - slot * page_size;
    return r;
}
#endif
#if CUFLASH_CACHE_FP8
// Eight e4m3 bytes (one 8-byte staging chunk, element 0 in the low byte) as eight elements.
__device__ __forceinline__ unsigned dequant2(unsigned b) {
    const unsigned h = ptx_cvt_f16x2_e4m3x2((unsigned short)b);
#if CUFLASH_BF16
    return pack2(__half2float(__ushort_as_half((unsigned short)(h & 0xffffu))),
                 __half2float(__ushort_as_half((unsigned short)(h >> 16))));   // exact
#else
    return h;
#endif
}
__device__ __forceinline__ uint4 dequant8(uint2 w) {
    return make_uint4(dequant2(w.x & 0xffffu), dequant2(w.x >> 16), dequant2(w.y & 0xffffu), dequant2(w.y >> 16));
}
#endif

extern "C" __global__ void __launch_bounds__(NT, CUFLASH_MIN_BLOCKS)
CUFLASH_ENTRY(const elem_t* __restrict__ q, const kv_t* __restrict__ k, const kv_t* __restrict__ v,
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
#if CUFLASH_KVCACHE
              , const int* __restrict__ cache_seqlens, const int* __restrict__ cache_leftpad,
              const int* __restrict__ cache_batch_idx, const int* __restrict__ block_table,
              long long block_table_stride, int page_size, int num_pages, int cache_seqlen, int seqlen_new,
              int cache_capacity, int cache_flags, int pack, int num_splits, long long partial_rows,
              float* __restrict__ o_partial,
              float* __restrict__ lse_partial
#endif
#if CUFLASH_CACHE_FP8
              , const float* __restrict__ k_descale, const float* __restrict__ v_descale,
              long long kd_batch_stride, long long kd_head_stride, long long vd_batch_stride, long long vd_head_stride
#endif
#if CUFLASH_DROPOUT
              , unsigned dropout_seed, unsigned dropout_offset, unsigned dropout_threshold, float dropout_scale,
              long long dropout_batch0
#endif
#if CUFLASH_MODS
              , CUFLASH_MODS_PARAMS
#endif
              ) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    elem_t* q_s = reinterpret_cast<elem_t*>(smem_raw);   // [BR][PITCH]
    elem_t* kv_s = q_s + BR * PITCH;                     // [STAGES][K, V][BC][PITCH]

    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int g = lane / 4;   // fragment row group
    const int t = lane % 4;   // fragment column pair
    // pk query heads per block (pack-GQA; 1 otherwise): packed row r is query row r / pk of head
    // head0 + r % pk. split / nsplit: this block's share of the key tiles (split-KV).
    int pk = 1, nsplit = 1;
#if CUFLASH_KVCACHE
    pk = pack, nsplit = num_splits;
#endif
    const GridCoord at = grid_coord(num_q_tiles * nsplit, num_heads_q / pk);
    int split = at.tile % nsplit;
    const int tile = num_q_tiles - 1 - at.tile / nsplit;   // last tiles (the most keys) first
    int head0 = at.head * pk;
    long long batch = at.batch;
    const int head_k = head0 / group_size;
    int q_first = 0, k_first = 0;   // a packed batch: the sequence's first row in q, out and lse; in k and v
#if CUFLASH_VARLEN
    const int total_q = seqlen_q, total_k = seqlen_k;   // the packed arrays' rows (the arguments' values)
    {   // a packed batch: this sequence's rows and lengths
        const VarlenSeq sq = varlen_seq_uniform(batch, varlen, cu_seqlens_q, cu_seqlens_k, seqused_k, seqlen_q, seqlen_k);
        q += sq.q0 * q_row_stride;   // (out and lse move at the epilogue: their pointers hold no registers in the loop)
        q_first = sq.q0;
#if !CUFLASH_KVCACHE
        k_first = sq.k0;
#endif
        seqlen_q = sq.seqlen_q, seqlen_k = sq.seqlen_k;
    }
#endif
#if CUFLASH_KVCACHE
    const int capacity = cache_capacity;
    const int keys_end = CUFLASH_VARLEN ? seqlen_k : ((cache_flags & 1) ? cache_seqlens[batch] : cache_seqlen) + seqlen_new;
    const CacheSeq cs = cache_seq(batch, keys_end, capacity, cache_leftpad, cache_batch_idx, num_pages, cache_flags);
    seqlen_k = cs.seqlen_k;
    int bad = cs.bad;
    const bool paged = cache_flags & 8;
    const int* bt_row = block_table + batch * block_table_stride;
#endif

    int q_rows = seqlen_q * pk;   // packed rows of this (batch, head group)
    int row0 = tile * BR;
    const int rows = min(BR, q_rows - row0);
    if (CUFLASH_VARLEN && rows <= 0) return;   // a packed sequence shorter than the grid's tiles (the whole block)

    const elem_t* q_tile = q + batch * q_batch_stride + head0 * q_head_stride + row0 * q_row_stride;
#if CUFLASH_KVCACHE
    const long long kv_batch = paged ? 0 : cs.cache_b;
    const kv_t* k_head = k + kv_batch * k_batch_stride + head_k * k_head_stride + (paged ? 0 : cs.start * k_row_stride);
    const kv_t* v_head = v + kv_batch * v_batch_stride + head_k * v_head_stride + (paged ? 0 : cs.start * v_row_stride);
#else
    const elem_t* k_head = k + batch * k_batch_stride + head_k * k_head_stride + k_first * k_row_stride;
    const elem_t* v_head = v + batch * v_batch_stride + head_k * v_head_stride + k_first * v_row_stride;
#endif

    // Keys any row of this tile can see: [kv_lo, kv_hi) (rows are query positions r / pk).
    const int pos0 = row0 / pk, pos_n = (row0 + rows - 1) / pk - pos0 + 1;
    const IndexRange keys = window_key_range(pos0, pos_n, seqlen_q, seqlen_k, window_left, window_right);
    int kv_lo = keys.lo, n_tiles = (keys.hi - keys.lo + BC - 1) / BC;
#if CUFLASH_BLOCK_SPARSE
    // The block mask's key blocks of this tile's query block (score_mods.cuh): its partial ones, then its
    // full ones, each as bs_sub tiles of BC keys; tile jj starts at key bs_kv0(jj).
    // (Only its partial count stays in registers: the row's offset is recomputed per tile from the
    // block's coordinates and the lists' bases and the block size re-read from the parameters, so the
    // d192 forms do not spill.)
    const int bs_np = bs_num[(user_batch0 + batch) * bs_num_bs + head0 * bs_num_hs + row0 / bs_outer];
    n_tiles = (bs_np + bs_full_num[(user_batch0 + batch) * bs_num_bs + head0 * bs_num_hs + row0 / bs_outer]) *
              (bs_inner / BC);
    auto bs_kv0 = [&](int jj) {
        const long long at = (user_batch0 + batch) * bs_idx_bs + head0 * bs_idx_hs + (row0 / bs_outer) * bs_idx_rs;
        const int sub = bs_inner / BC, e = jj / sub;
        return (e < bs_np ? bs_idx[at + e] : bs_full_idx[at + e - bs_np]) * bs_inner + (jj - e * sub) * BC;
    };
#endif
    if (nsplit > 1) {   // split-KV: this block's run of the tiles
        const int per = (n_tiles + nsplit - 1) / nsplit;
        const int first = split * per;
        n_tiles = max(0, min(per, n_tiles - first));
        kv_lo += first * BC;
    }

    // This thread's chunk of every tile copy: its source pointers advance by one tile per copy, so
    // no row-stride product is redone in the loop.
    const int cp_r0 = tid / CHUNKS, cp_c = tid % CHUNKS;
    const int s_thread = cp_r0 * PITCH + cp_c * 8;
    const kv_t* k_src = k_head + (kv_lo + cp_r0) * k_row_stride + cp_c * 8;
    const kv_t* v_src = v_head + (kv_lo + cp_r0) * v_row_stride + cp_c * 8;
    // Tiles j < full_tiles hold no key past Sk; this thread copies them unpredicated when its K and
    // V column chunk is inside D and Dv (per thread: a head dim below its bucket leaves the last
    // chunks zero-filled).
    const int full_tiles = cp_c * 8 < head_dim && cp_c * 8 < head_dim_v ? max(0, (seqlen_k - kv_lo) / BC) : 0;
    // An edge tile's copy tests rows only: rows_left of copy_rows is n - k_row_lim (n - v_row_lim),
    // k_row_lim being this thread's first row cp_r0, or BC (no row) when its chunk lies past D (Dv).
    const int k_row_lim = cp_c * 8 < head_dim ? cp_r0 : BC, v_row_lim = cp_c * 8 < head_dim_v ? cp_r0 : BC;
#if CUFLASH_BLOCK_SPARSE
    // a block-sparse tile at key kv copies unpredicated when it lies below Sk (and this thread's columns in view)
    const bool bs_cols_in = cp_c * 8 < head_dim && cp_c * 8 < head_dim_v;
    auto bs_interior = [&](int kv) { return bs_cols_in && kv + BC <= seqlen_k; };
#endif
#if CUFLASH_CACHE_FP8
    // fp8: this thread's 8-byte chunks (column chunk cp_c of rows cp_r0 + i kRowsPerPass, as the
    // 16-bit copies') of the K/V tile from key kv into the staging area, rows n and on (and chunks
    // past D / Dv) zero-filled; a paged cache's rows through the block table (one look-up when the
    // tile lies in one page). convert_kv8 then turns the same chunks into the element type.
    unsigned char* kv8_s = reinterpret_cast<unsigned char*>(kv_s + STAGE_ELEMS);   // [K, V][BC][KV8_PITCH]
    const int s8_thread = cp_r0 * KV8_PITCH + cp_c * 8;
    const bool k8_col = cp_c * 8 < head_dim, v8_col = cp_c * 8 < head_dim_v;
    auto load_kv8 = [&](int kv) {
        if (kCopyThreads != NT && tid >= kCopyThreads) return;
        const int n = min(BC, seqlen_k - kv);
        const kv_t* ks = k_src;
        const kv_t* vs = v_src;
        bool per_row = false;
        if (paged) {
            const int p0 = cs.start + kv;
            per_row = p0 % page_size + BC > page_size;
            if (!per_row) {
                const PageRow pr = page_row(bt_row, p0, page_size, num_pages, bad);
                ks = k_head + pr.page * k_batch_stride + (pr.row + cp_r0) * k_row_stride + cp_c * 8;
                vs = v_head + pr.page * v_batch_stride + (pr.row + cp_r0) * v_row_stride + cp_c * 8;
            }
        }
#pragma unroll 1
        for (int i = 0; i < BC / kRowsPerPass; ++i) {
            const int r = cp_r0 + i * kRowsPerPass;
            const bool ok = r < n;
            const kv_t* kr = ks + i * kRowsPerPass * k_row_stride;
            const kv_t* vr = vs + i * kRowsPerPass * v_row_stride;
            if (per_row) {
                PageRow pr = {0, 0};
                if (ok) pr = page_row(bt_row, cs.start + kv + r, page_size, num_pages, bad);
                kr = k_head + pr.page * k_batch_stride + pr.row * k_row_stride + cp_c * 8;
                vr = v_head + pr.page * v_batch_stride + pr.row * v_row_stride + cp_c * 8;
            }
            const bool k_ok = ok && k8_col, v_ok = ok && v8_col;
            ptx_cp_async_8_zfill(kv8_s + s8_thread + i * kRowsPerPass * KV8_PITCH, k_ok ? kr : k, k_ok ? 8 : 0);
            ptx_cp_async_8_zfill(kv8_s + BC * KV8_PITCH + s8_thread + i * kRowsPerPass * KV8_PITCH, v_ok ? vr : v,
                                 v_ok ? 8 : 0);
        }
        if (!paged) {
            k_src += BC * k_row_stride;
            v_src += BC * v_row_stride;
        }
    };
    auto convert_kv8 = [&]() {
        if (kCopyThreads != NT && tid >= kCopyThreads) return;
#pragma unroll
        for (int i = 0; i < BC / kRowsPerPass; ++i) {
            const unsigned char* s8 = kv8_s + s8_thread + i * kRowsPerPass * KV8_PITCH;
            elem_t* d = kv_s + s_thread + i * kRowsPerPass * PITCH;
            *reinterpret_cast<uint4*>(d) = dequant8(*reinterpret_cast<const uint2*>(s8));
            *reinterpret_cast<uint4*>(d + BC * PITCH) = dequant8(*reinterpret_cast<const uint2*>(s8 + BC * KV8_PITCH));
        }
    };
    // The descales of this block's (sequence, kv head): flags 16 and 32 say they were given (else 1)
    const float k_ds = (cache_flags & 16) ? k_descale[batch * kd_batch_stride + head_k * kd_head_stride] : 1.0f;
    scale_log2 *= k_ds;   // the scores of q . (k * kd)
#else
    // This thread's rows of a K/V tile from ks / vs (its chunk of the tile's first rows) into stage
    // `st`: unpredicated for an interior tile, else rows n and on (and chunks past D / Dv) zero-filled.
    auto copy_kv = [&](elem_t* st, const elem_t* ks, const elem_t* vs, bool interior, int n) {
        if (kCopyThreads == NT || tid < kCopyThreads) {
            if (interior) {   // every row and this thread's columns in view: unpredicated copies
                copy_rows_interior<BC>(st + s_thread, ks, kRowsPerPass * k_row_stride);
                copy_rows_interior<BC>(st + BC * PITCH + s_thread, vs, kRowsPerPass * v_row_stride);
            } else {   // the tile that straddles Sk (or columns past D / Dv): zero-fill what is out of view
                copy_rows<BC>(st + s_thread, ks, k, kRowsPerPass * k_row_stride, n - k_row_lim, true);
                copy_rows<BC>(st + BC * PITCH + s_thread, vs, v, kRowsPerPass * v_row_stride, n - v_row_lim, true);
            }
        }
    };
    // K/V tile starting at key kv into stage `st`; then the sources move on by one tile.
    auto load_kv = [&](elem_t* st, int kv, bool interior) {
        const int n = min(BC, seqlen_k - kv);
#if CUFLASH_KVCACHE
        if (paged) {
            const int p0 = cs.start + kv;   // the tile's first cache index
            if (p0 % page_size + BC <= page_size) {   // the whole tile in one page: copied as a contiguous one
                const PageRow pr = page_row(bt_row, p0, page_size, num_pages, bad);
                copy_kv(st, k_head + pr.page * k_batch_stride + (pr.row + cp_r0) * k_row_stride + cp_c * 8,
                        v_head + pr.page * v_batch_stride + (pr.row + cp_r0) * v_row_stride + cp_c * 8, interior, n);
                return;
            }
            // row by row through the block table (pages smaller than a tile, or a tile across two);
            // not unrolled: the registers belong to the accumulators
#pragma unroll 1
            for (int i = 0; i < (BC * CHUNKS + NT - 1) / NT; ++i) {
                const int e = tid + i * NT;
                const int r = e / CHUNKS, c = e - r * CHUNKS;
                if ((BC * CHUNKS) % NT == 0 || e < BC * CHUNKS) {
                    const bool kv_ok = r < n;
                    PageRow pr = {0, 0};
                    if (kv_ok) pr = page_row(bt_row, cs.start + kv + r, page_size, num_pages, bad);
                    const bool k_ok = kv_ok && c * 8 < head_dim, v_ok = kv_ok && c * 8 < head_dim_v;
                    const elem_t* ks = k_head + pr.page * k_batch_stride + pr.row * k_row_stride + c * 8;
                    const elem_t* vs = v_head + pr.page * v_batch_stride + pr.row * v_row_stride + c * 8;
                    ptx_cp_async_16_zfill(st + r * PITCH + c * 8, k_ok ? ks : k_head, k_ok ? 16 : 0);
                    ptx_cp_async_16_zfill(st + BC * PITCH + r * PITCH + c * 8, v_ok ? vs : v_head, v_ok ? 16 : 0);
                }
            }
            return;
        }
#endif
#if CUFLASH_BLOCK_SPARSE   // the listed tiles are not consecutive: the sources from kv
        k_src = k_head + (long long)(kv + cp_r0) * k_row_stride + cp_c * 8;
        v_src = v_head + (long long)(kv + cp_r0) * v_row_stride + cp_c * 8;
#endif
        copy_kv(st, k_src, v_src, interior, n);
        k_src += BC * k_row_stride;
        v_src += BC * v_row_stride;
    };
#if FWD_REG_STAGE
    // The refill in two halves: fetch_kv loads this thread's chunks of the K/V tile at key kv into
    // registers (the chunks load_kv would copy; out of view: zeros, nothing read) and moves the
    // sources on; put_kv stores them into the stage.
    uint4 kv_reg[2][BC / kRowsPerPass];
    auto fetch_kv = [&](int kv, bool interior) {
        const int n = min(BC, seqlen_k - kv);
#if CUFLASH_BLOCK_SPARSE
        k_src = k_head + (long long)(kv + cp_r0) * k_row_stride + cp_c * 8;
        v_src = v_head + (long long)(kv + cp_r0) * v_row_stride + cp_c * 8;
#endif
        if (interior && (kCopyThreads == NT || tid < kCopyThreads)) {   // every row and column in view
#pragma unroll
            for (int i = 0; i < BC / kRowsPerPass; ++i) {
                kv_reg[0][i] = ptx_ld_global_16(k_src + i * kRowsPerPass * k_row_stride);
                kv_reg[1][i] = ptx_ld_global_16(v_src + i * kRowsPerPass * v_row_stride);
            }
        } else if (kCopyThreads == NT || tid < kCopyThreads) {   // rows n and on (chunks past D / Dv): zeros
#pragma unroll
            for (int i = 0; i < BC / kRowsPerPass; ++i) {
                kv_reg[0][i] = kv_reg[1][i] = uint4{0u, 0u, 0u, 0u};
                if (i * kRowsPerPass < n - k_row_lim) kv_reg[0][i] = ptx_ld_global_16(k_src + i * kRowsPerPass * k_row_stride);
                if (i * kRowsPerPass < n - v_row_lim) kv_reg[1][i] = ptx_ld_global_16(v_src + i * kRowsPerPass * v_row_stride);
            }
        }
        k_src += BC * k_row_stride;
        v_src += BC * v_row_stride;
    };
    auto put_kv = [&](elem_t* st) {
        if (kCopyThreads == NT || tid < kCopyThreads) {
#pragma unroll
            for (int i = 0; i < BC / kRowsPerPass; ++i) {
                *reinterpret_cast<uint4*>(st + s_thread + i * kRowsPerPass * PITCH) = kv_reg[0][i];
                *reinterpret_cast<uint4*>(st + BC * PITCH + s_thread + i * kRowsPerPass * PITCH) = kv_reg[1][i];
            }
        }
    };
#endif
#endif


    // Prologue: Q and the first K/V tile, one group. A tile that sees no key (causal with
    // Sq > Sk, a window that misses every key) loads nothing: its loop below never runs, so no
    // barrier would order other warps' Q copies before the epilogue's O writes into q_s.
    if (n_tiles > 0) {
        if (CUFLASH_KVCACHE && pk > 1) {   // packed heads: each row's own head and query row
#pragma unroll 1
            for (int i = 0; i < (BR * CHUNKS + NT - 1) / NT; ++i) {
                const int e = tid + i * NT;
                const int r = e / CHUNKS, c = e - r * CHUNKS;
                if ((BR * CHUNKS) % NT == 0 || e < BR * CHUNKS) {
                    const int pr = row0 + r;
                    const bool ok = r < rows && c * 8 < head_dim;
                    const elem_t* q_head = q + batch * q_batch_stride + head0 * q_head_stride;   // row 0: in view
                    const elem_t* src = q_head + (pr % pk) * q_head_stride + (long long)(pr / pk) * q_row_stride + c * 8;
                    ptx_cp_async_16_zfill(q_s + r * PITCH + c * 8, ok ? src : q_head, ok ? 16 : 0);
                }
            }
        } else if (kCopyThreads == NT || tid < kCopyThreads) {
            copy_rows<BR>(q_s + s_thread, q_tile + cp_r0 * q_row_stride + cp_c * 8, q_tile, kRowsPerPass * q_row_stride,
                          rows - cp_r0, cp_c * 8 < head_dim);
        }
#if CUFLASH_CACHE_FP8
        load_kv8(kv_lo);
#elif CUFLASH_BLOCK_SPARSE
        load_kv(kv_s, bs_kv0(0), bs_interior(bs_kv0(0)));
#else
        load_kv(kv_s, kv_lo, 0 < full_tiles);
#endif
    }
    ptx_cp_async_commit();

    // ldmatrix row addresses (elements, relative to a tile base) of this lane:
    //   A (Q, x4): matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15)
    //   B of Q K^T (K, x4): (keys 0-7, k 0-7), (keys 0-7, k 8-15), (keys 8-15, k 0-7), (keys 8-15, k 8-15)
    //   B of P V (V, x4.trans): (keys 0-7, cols 0-7), (keys 8-15, cols 0-7), (keys 0-7, cols 8-15), (keys 8-15, cols 8-15)
    const int mat = lane / 8, mrow = lane % 8;
    const int a_off = (16 * MT * warp + (mat % 2) * 8 + mrow) * PITCH + (mat / 2) * 8;
    const int k_off = ((mat / 2) * 8 + mrow) * PITCH + (mat % 2) * 8;
    const int v_off = ((mat % 2) * 8 + mrow) * PITCH + (mat / 2) * 8;

    float o_acc[MT][NFRAG_O][4];
#pragma unroll
    for (int f = 0; f < MT; ++f)
#pragma unroll
        for (int i = 0; i < NFRAG_O; ++i) o_acc[f][i][0] = o_acc[f][i][1] = o_acc[f][i][2] = o_acc[f][i][3] = 0.0f;
    float m_row[MT][2], l_row[MT][2];   // running max (log2 domain) and this lane's part of the sum
#pragma unroll
    for (int f = 0; f < MT; ++f) m_row[f][0] = m_row[f][1] = FWD_M_FLOOR, l_row[f][0] = l_row[f][1] = 0.0f;
    int qi0 = row0 + 16 * MT * warp + g;   // (packed) row of fragment f's row g: qi0 + 16 f (+ 8)
    const bool warp_active = 16 * MT * warp < rows;
    const int pos_span = (row0 + BR - 1) / pk - pos0 + 1;   // query positions the tile's BR rows span
    // Tiles [steady.lo, steady.hi) need no mask (a tile needs it if it reaches past Sk or some row of
    // the block has a window edge inside it)
    const IndexRange steady = steady_tiles(kv_lo, n_tiles, pos0, pos_span, seqlen_q, seqlen_k, window_left, window_right);
#if !CUFLASH_BLOCK_SPARSE
    // A one-edge tile's band bounds (the mask in the loop): hi = band_base - kv0, lo = hi - window_right -
    // window_left, with band_base formed once (FWD_HOLD_BAND)
    const int band_base_v = (int)((unsigned)window_right + (unsigned)seqlen_k - (unsigned)seqlen_q + (unsigned)qi0 -
                                  2u * (unsigned)t);
    const int band_base = FWD_HOLD_BAND ? ptx_opaque(band_base_v) : band_base_v;
#endif
    // scale_log2 > 0: the max over raw scores, P = exp2(s * scale - m) in one FFMA. Otherwise the
    // scores are scaled first (a negative scale reverses the order; 0 would make -inf * 0 NaN).
    // (The modifier variants scale first too: softcap and the biases act on the scaled scores.)
    const bool prescale = CUFLASH_MODS || !(scale_log2 > 0.0f);
    const float eff_scale = prescale ? 1.0f : scale_log2;
#if CUFLASH_MODS
    const ScoreMods mods = CUFLASH_MODS_INIT;
#endif

#if CUFLASH_BLOCK_SPARSE && defined(CUFLASH_SIM)
    int bs_entered[2] = {0, 0};   // tiles entered: partial, full (the simulator's count)
#endif
    for (int j = 0; j < n_tiles; ++j) {
#if CUFLASH_BLOCK_SPARSE
        const int kv0 = bs_kv0(j);
#if defined(CUFLASH_SIM)
        ++bs_entered[j / (bs_inner / BC) < bs_np ? 0 : 1];
#endif
#else
        const int kv0 = kv_lo + j * BC;
#endif
#if !CUFLASH_CACHE_FP8   // (the 16-bit cache first: the mutation suite numbers its syncs in text order)
        const elem_t* k_s = kv_s + (STAGES == 2 ? j % 2 : 0) * STAGE_ELEMS;
        const elem_t* v_s = k_s + BC * PITCH;
#if FWD_REG_STAGE   // tile j + 1's loads in flight across the barrier and tile j's math
        if (j + 1 < n_tiles) {
#if CUFLASH_BLOCK_SPARSE
            const int kv_next = bs_kv0(j + 1);
            fetch_kv(kv_next, bs_interior(kv_next));
#else
            fetch_kv(kv0 + BC, j + 1 < full_tiles);
#endif
        }
#endif
        ptx_cp_async_wait<0>();   // this thread's copies of tile j (and of Q) have landed
        __syncthreads();          // every thread's; and every thread is done with tile j - 1
        if (STAGES == 2 && j + 1 < n_tiles) {
#if CUFLASH_BLOCK_SPARSE
            const int kv_next = bs_kv0(j + 1);
            load_kv(kv_s + ((j + 1) % 2) * STAGE_ELEMS, kv_next, bs_interior(kv_next));   // the stage tile j - 1 used
#else
            load_kv(kv_s + ((j + 1) % 2) * STAGE_ELEMS, kv0 + BC, j + 1 < full_tiles);   // the stage tile j - 1 used
#endif
            ptx_cp_async_commit();
        }
#else
        const elem_t* k_s = kv_s;
        const elem_t* v_s = k_s + BC * PITCH;
        ptx_cp_async_wait<0>();   // this thread's fp8 chunks of tile j (and its Q copies) have landed
        __syncthreads();          // every thread's Q; and every thread is done with tile j - 1's K/V
        convert_kv8();            // its own chunks: no other thread's copies are read
        if (j + 1 < n_tiles) {    // the staging is this thread's again: tile j + 1 overlaps the math
            load_kv8(kv0 + BC);
            ptx_cp_async_commit();
        }
        __syncthreads();          // tile j's converted K/V, every thread's
#endif

        bool warp_live = !CUFLASH_KVCACHE || warp_active;   // (a warp whose rows are all past the sequence only copies)
#if CUFLASH_MODS
        if (mods.mask && warp_live) {   // a tile the mask hides from every row of the warp costs it no math
            bool any = false;
#pragma unroll
            for (int f = 0; f < MT; ++f)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int pr = qi0 + 16 * f + 8 * h;
                    if (pr >= q_rows) continue;
                    const HeadMods hm = head_mods<elem_t>(mods, batch, head0 + pr % pk);
FWD_UNROLL_ANY
                    for (int n = 0; n < NFRAG_S; ++n)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const int kj = kv0 + 8 * n + 2 * t + e;
                            any |= kj < seqlen_k && mask_keeps(mods, hm, pr / pk, kj);
                        }
                }
            warp_live = __any_sync(CUFLASH_FULL_MASK, any);
        }
#endif
        if (warp_live) {
#if CUFLASH_DROPOUT
            // This lane's keep bits for the tile, drawn before the products (dropout.cuh)
            const DropoutArgs dr = {dropout_seed, dropout_offset, dropout_threshold, dropout_scale};
            const unsigned keep_word = dropout_tile_bits<MT, NFRAG_S>(dr, (unsigned)(dropout_batch0 + batch),
                                                                      (unsigned)head0, qi0, kv0 + 2 * t);
#endif
            // S = Q K^T (16 MT x BC per warp): each K fragment feeds all MT query fragments. The
            // ldmatrix addresses are a tile base plus a byte offset (ptx.cuh: *_at), one [R + immediate]
            // operand each: from element pointers ptxas 12.9 rebuilt every address for sm_80 with an
            // IMAD (62 per tile at bf16 d128).
            float s[MT][NFRAG_S][4];
#pragma unroll
            for (int f = 0; f < MT; ++f)
#pragma unroll
                for (int n = 0; n < NFRAG_S; ++n) s[f][n][0] = s[f][n][1] = s[f][n][2] = s[f][n][3] = 0.0f;
FWD_UNROLL_S_K
            for (int kk = 0; kk < KSTEPS_D; ++kk) {
                unsigned a[MT][4];
#pragma unroll
                for (int f = 0; f < MT; ++f) ptx_ldmatrix_x4_at(a[f], q_s, 2 * (a_off + f * 16 * PITCH + kk * 16));
#pragma unroll
                for (int np = 0; np < NFRAG_S / 2; ++np) {
                    unsigned b[4];
                    ptx_ldmatrix_x4_at(b, k_s, 2 * (k_off + np * 16 * PITCH + kk * 16));
                    const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
#pragma unroll
                    for (int f = 0; f < MT; ++f) {
                        mma16816(s[f][2 * np], a[f], b0);
                        mma16816(s[f][2 * np + 1], a[f], b1);
                    }
                }
            }
            if (prescale) {
#pragma unroll
                for (int f = 0; f < MT; ++f)
#pragma unroll
                    for (int n = 0; n < NFRAG_S; ++n)
#pragma unroll
                        for (int e = 0; e < 4; ++e) s[f][n][e] *= scale_log2;
            }
#if CUFLASH_MODS
            // softcap, ALiBi, bias and the boolean mask (score_mods.cuh), before the window mask
#if FWD_ROLL_MODS
            // (rolled: each pass modifies the 8-key block at n = 0, then rotates the blocks by one, so
            // that every index stays a constant; after NFRAG_S passes each block is back in place)
#pragma unroll 1
            for (int n = 0; n < NFRAG_S; ++n) {
#pragma unroll
                for (int f = 0; f < MT; ++f)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int pr = qi0 + 16 * f + 8 * h;
                        if (pr < q_rows) {   // (a row past the sequence: never stored, never read)
                            const HeadMods hm = head_mods<elem_t>(mods, batch, head0 + pr % pk);
#pragma unroll
                            for (int e = 0; e < 2; ++e) {
                                const int kj = kv0 + 8 * n + 2 * t + e;
                                if (kj < seqlen_k)
                                    s[f][0][2 * h + e] = mod_score<elem_t>(mods, hm, s[f][0][2 * h + e], pr / pk, kj,
                                                                           seqlen_q, seqlen_k);
                            }
                        }
                    }
#pragma unroll
                for (int f = 0; f < MT; ++f) {
                    const float r0 = s[f][0][0], r1 = s[f][0][1], r2 = s[f][0][2], r3 = s[f][0][3];
#pragma unroll
                    for (int m = 0; m + 1 < NFRAG_S; ++m)
#pragma unroll
                        for (int e = 0; e < 4; ++e) s[f][m][e] = s[f][m + 1][e];
                    s[f][NFRAG_S - 1][0] = r0, s[f][NFRAG_S - 1][1] = r1, s[f][NFRAG_S - 1][2] = r2, s[f][NFRAG_S - 1][3] = r3;
                }
            }
#else
#pragma unroll
            for (int f = 0; f < MT; ++f)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int pr = qi0 + 16 * f + 8 * h;
                    if (pr >= q_rows) continue;   // (a row past the sequence: never stored, never read)
                    const HeadMods hm = head_mods<elem_t>(mods, batch, head0 + pr % pk);
#pragma unroll
                    for (int n = 0; n < NFRAG_S; ++n)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const int kj = kv0 + 8 * n + 2 * t + e;
                            if (kj < seqlen_k)
#if CUFLASH_BLOCK_SPARSE
                                s[f][n][2 * h + e] = mod_score<elem_t>(mods, hm, s[f][n][2 * h + e], pr / pk, kj,
                                                                       seqlen_q, seqlen_k, nullptr,
                                                                       j / (bs_inner / BC) < bs_np);   // partial: mask_mod
#else
                                s[f][n][2 * h + e] = mod_score<elem_t>(mods, hm, s[f][n][2 * h + e], pr / pk, kj,
                                                                       seqlen_q, seqlen_k);
#endif
                        }
                }
#endif   // FWD_ROLL_MODS
#endif

            // Mask: a tile needs it only if it reaches past Sk or some row of the block has a window
            // edge inside it. Each row's visible keys are computed once per tile.
#if CUFLASH_BLOCK_SPARSE
            const IndexRange one = steady_tiles(kv0, 1, pos0, pos_span, seqlen_q, seqlen_k, window_left, window_right);
            const bool need_mask = one.lo != 0 || one.hi != 1;   // (this tile alone: inside Sk and every window)
#else
            const bool need_mask = j < steady.lo || j >= steady.hi;
#endif
            if (need_mask) {
                const int kv_past = kv0 - seqlen_k;   // (negative: keys before Sk)
                // The band takes a tile inside Sk, and the tile across Sk when window_right is 0: there
                // every row below Sq sees no key past its diagonal, Sk - Sq + row <= Sk - 1, so the band's
                // right edge hides the keys past Sk too (a row past Sq is never stored, and the copy has
                // zero-filled the keys past Sk, so its scores stay finite).
                if (pk == 1 && (kv_past <= -BC || window_right == 0) && (FWD_BAND_TWO_EDGE || (FWD_BAND_PACKED_CAUSAL && window_left < 0))) {
                    // A tile inside Sk (a causal diagonal or a window edge), without packed heads: score
                    // (f, h, n, e), of key kv0 + 2 t + 8 n + e and row qi0 + 16 f + 8 h, lies d0 + kk right of
                    // its row's diagonal key, kk = 8 (n - 2 f - h) + e. One band of kk holds for all the lane's
                    // rows, so ptxas tests each of the 2 (NFRAG_S + 2 MT - 1) values of kk once (22 compares
                    // at 128 x 64) instead of each of the 64 scores against its row's bounds. Visible: lo <= kk
                    // <= hi. With both edges, and in the block-sparse form, each bound is clamped to kk's
                    // range [KK_MIN, KK_MAX] before d0 is subtracted, so that nothing overflows (d0 lies in
                    // [-Sk - BR, Sq]; the other edge may be any int). One edge alone is not clamped: hi =
                    // window_right - d0 = (row qi0's last visible key) - (kv0 + 2 t), summed in wrapping
                    // arithmetic, is exact because the true value is small. Such a tile lies at or past
                    // steady.hi, so row pos0's last key is below kv0 + BC - 1, and before keys.hi, so above
                    // kv0 - BR: |hi| < BR + BC. Likewise lo = -window_left - d0 (row qi0's first key less
                    // kv0 + 2 t) for a tile before steady.lo. On sm_90 hi is band_base - kv0 (FWD_HOLD_BAND).
                    constexpr int KK_MIN = -8 * (2 * MT - 1), KK_MAX = 8 * (NFRAG_S - 1) + 1;
                    auto d0 = [&]() { return kv_past + (2 * t + seqlen_q - qi0); };
                    auto band = [&](int lo, int hi) {
#pragma unroll
                        for (int f = 0; f < MT; ++f)
#pragma unroll
                            for (int h = 0; h < 2; ++h)
#pragma unroll
                                for (int n = 0; n < NFRAG_S; ++n)
#pragma unroll
                                    for (int e = 0; e < 2; ++e) {
                                        const int kk = 8 * (n - 2 * f - h) + e;
                                        if (kk < lo || kk > hi) s[f][n][2 * h + e] = CUFLASH_NEG_INF;
                                    }
                    };
                    auto lo_k = [&]() { return max(-window_left, d0() + KK_MIN) - d0(); };   // (window_left >= 0)
                    auto hi_k = [&]() { return min(window_right, d0() + KK_MAX) - d0(); };   // (window_right >= 0)
#if CUFLASH_BLOCK_SPARSE
                    if (!FWD_BAND_TWO_EDGE || window_left < 0) band(KK_MIN, hi_k());   // causal, or a right edge alone
                    else if (window_right < 0) band(lo_k(), KK_MAX);                  // a left edge alone
#else
                    // (one edge alone: unclamped, see above; lo = hi - window_right - window_left)
                    const unsigned hi_u = FWD_HOLD_BAND ? (unsigned)band_base - (unsigned)kv0
                                                        : (unsigned)window_right - (unsigned)d0();
                    if (!FWD_BAND_TWO_EDGE || window_left < 0) band(KK_MIN, (int)hi_u);
                    else if (window_right < 0) band((int)(hi_u - (unsigned)window_left - (unsigned)window_right), KK_MAX);
#endif
                    else band(lo_k(), hi_k());
                } else {
#pragma unroll
                    for (int f = 0; f < MT; ++f)
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            const IndexRange seen =
                                window_key_range((qi0 + 16 * f + 8 * h) / pk, 1, seqlen_q, seqlen_k, window_left, window_right);
                            const int lo = seen.lo - kv0 - 2 * t, hi = seen.hi - kv0 - 2 * t;   // in 8 n + (e & 1)
#pragma unroll
                            for (int n = 0; n < NFRAG_S; ++n)
#pragma unroll
                                for (int e = 0; e < 2; ++e) {
                                    const int kj = 8 * n + e;
                                    if (kj < lo || kj >= hi) s[f][n][2 * h + e] = CUFLASH_NEG_INF;
                                }
                        }
                }
            }

            auto rescale_o = [&](int f, const float (&alpha)[2]) {
                // O *= alpha, skipped (exactly: alpha is 1) when no row of the warp's fragment has a
                // new maximum, as most tiles of a long row do not (a NaN alpha is != 1: it rescales).
                if (__any_sync(CUFLASH_FULL_MASK, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
                    for (int i = 0; i < NFRAG_O; ++i) {
                        o_acc[f][i][0] *= alpha[0];
                        o_acc[f][i][1] *= alpha[0];
                        o_acc[f][i][2] *= alpha[1];
                        o_acc[f][i][3] *= alpha[1];
                    }
                }
            };
            // Online softmax per fragment: rows g (elements 0, 1) and g + 8 (elements 2, 3).
            unsigned p[MT][KSTEPS_N][4];
#pragma unroll
            for (int f = 0; f < MT; ++f) {
                float alpha[2];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    // (the max and the sum start from the first pair: an fmaxf with -inf or an add to 0
                    // would stay in the code, as neither folds under IEEE rules; fmaxf drops a NaN, so the
                    // row's maximum is the same)
                    float mx = fmaxf(s[f][0][2 * h], s[f][0][2 * h + 1]);
#pragma unroll
                    for (int n = 1; n < NFRAG_S; ++n) mx = fmaxf(mx, fmaxf(s[f][n][2 * h], s[f][n][2 * h + 1]));
                    mx = fmaxf(mx, __shfl_xor_sync(CUFLASH_FULL_MASK, mx, 1));
                    mx = fmaxf(mx, __shfl_xor_sync(CUFLASH_FULL_MASK, mx, 2));
                    // m_row starts at FWD_M_FLOOR, so m_new is finite or +inf / NaN, and a row with no
                    // visible key yet (every score -inf) takes exp2(-inf + FWD_M_FLOOR's negation) = 0
                    // without a test for -inf - -inf
                    const float m_new = fmaxf(m_row[f][h], mx * eff_scale);
                    alpha[h] = exp2f(m_row[f][h] - m_new);
                    m_row[f][h] = m_new;
#pragma unroll
                    for (int n = 0; n < NFRAG_S; ++n) {
                        s[f][n][2 * h] = exp2f(fmaf(s[f][n][2 * h], eff_scale, -m_new));
                        s[f][n][2 * h + 1] = exp2f(fmaf(s[f][n][2 * h + 1], eff_scale, -m_new));
                    }
                    float sum = s[f][0][2 * h] + s[f][0][2 * h + 1];
#pragma unroll
                    for (int n = 1; n < NFRAG_S; ++n) sum += s[f][n][2 * h] + s[f][n][2 * h + 1];
                    l_row[f][h] = l_row[f][h] * alpha[h] + sum;
                }
                if (MT == 1) rescale_o(f, alpha);   // (before the packing: the d256 packed dropout form spills otherwise)
#if CUFLASH_DROPOUT
                // dropout on P, after the row sums (the LSE stays the undropped softmax's): pair (row, key)
                // kept iff its Philox draw is below the threshold (keep_word), survivors scaled
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int n = 0; n < NFRAG_S; ++n) {
                        const unsigned keep = keep_word >> (2 * ((f * 2 + h) * NFRAG_S + n));
                        s[f][n][2 * h] = (keep & 1u) ? s[f][n][2 * h] * dropout_scale : 0.0f;
                        s[f][n][2 * h + 1] = (keep & 2u) ? s[f][n][2 * h + 1] * dropout_scale : 0.0f;
                    }
#endif
                // P's A fragments, packed as soon as the fragment's P is final (the S accumulator of two
                // adjacent 8-key blocks is the A fragment of one 16-key k-step): 16 registers instead of 32
                // from here on, while the other fragment's softmax and P V run.
#pragma unroll
                for (int kk = 0; kk < KSTEPS_N; ++kk) {
                    p[f][kk][0] = pack2(s[f][2 * kk][0], s[f][2 * kk][1]);
                    p[f][kk][1] = pack2(s[f][2 * kk][2], s[f][2 * kk][3]);
                    p[f][kk][2] = pack2(s[f][2 * kk + 1][0], s[f][2 * kk + 1][1]);
                    p[f][kk][3] = pack2(s[f][2 * kk + 1][2], s[f][2 * kk + 1][3]);
                }
                if (MT == 2) rescale_o(f, alpha);   // (after the packing: the two-fragment tiles spill otherwise)
            }

            // O += P V: each V fragment feeds all MT query fragments.
#pragma unroll
            for (int kk = 0; kk < KSTEPS_N; ++kk) {
#pragma unroll
                for (int dp = 0; dp < NFRAG_O / 2; ++dp) {
                    unsigned b[4];
                    ptx_ldmatrix_x4_trans_at(b, v_s, 2 * (v_off + kk * 16 * PITCH + dp * 16));
                    const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
#pragma unroll
                    for (int f = 0; f < MT; ++f) {
                        mma16816(o_acc[f][2 * dp], p[f][kk], b0);
                        mma16816(o_acc[f][2 * dp + 1], p[f][kk], b1);
                    }
                }
            }
        }
#if !CUFLASH_CACHE_FP8
        if (STAGES == 1 && j + 1 < n_tiles) {
            __syncthreads();   // every thread is done with the one stage
#if FWD_REG_STAGE
            put_kv(kv_s);      // tile j + 1, fetched before the math
#elif CUFLASH_BLOCK_SPARSE
            const int kv_next = bs_kv0(j + 1);
            load_kv(kv_s, kv_next, bs_interior(kv_next));
#else
            load_kv(kv_s, kv0 + BC, j + 1 < full_tiles);
#endif
            ptx_cp_async_commit();
        }
#endif
    }
#if CUFLASH_BLOCK_SPARSE && defined(CUFLASH_SIM)
    if (bs_count && tid == 0) {   // (the simulator's count of the tiles this block entered)
        bs_counts[2 * (long long)blockIdx.x] = bs_entered[0];
        bs_counts[2 * (long long)blockIdx.x + 1] = bs_entered[1];
    }
#endif
    // No cp.async is in flight here: the last iteration issued nothing and waited for everything
    // before it, and a tile without keys issued nothing at all.

    // Epilogue: finish the row sums, normalize, stage O in this warp's own Q rows, store.
    if (MT == 2) {   // The block's coordinates again, from an opaque copy of blockIdx.x: recomputed here,
        // they keep no register across the K/V loop. The two-fragment tiles sit at the 255-register cap
        // and spill without it (16 bytes, bf16 d128 sm_90, NVRTC 13.5); the one-fragment forms spill
        // with it (4-108 bytes at buckets 192 and 256 with the modifiers, dropout or a KV cache on sm_80).
        const GridCoord e = grid_coord_of(ptx_opaque((long long)blockIdx.x), num_q_tiles * nsplit, num_heads_q / pk);
        split = e.tile % nsplit;
        row0 = (num_q_tiles - 1 - e.tile / nsplit) * BR;
        head0 = e.head * pk;
        batch = e.batch;
#if CUFLASH_VARLEN
        const VarlenSeq sq = varlen_seq(batch, varlen, cu_seqlens_q, cu_seqlens_k, seqused_k, total_q, total_k);
        q_first = sq.q0;
        q_rows = sq.seqlen_q * pk;
#endif
        qi0 = row0 + 16 * MT * warp + g;
    }
#if CUFLASH_KVCACHE
    const bool nan_rows = __syncthreads_or(bad);   // an index was out of range: every row NaN
#else
    const bool nan_rows = false;
#endif
    float inv_l[MT][2];
#if CUFLASH_CACHE_FP8
    const float v_ds = (cache_flags & 32) ? v_descale[batch * vd_batch_stride + head_k * vd_head_stride] : 1.0f;
#endif
#pragma unroll
    for (int f = 0; f < MT; ++f)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float l = l_row[f][h];
            l += __shfl_xor_sync(CUFLASH_FULL_MASK, l, 1);
            l += __shfl_xor_sync(CUFLASH_FULL_MASK, l, 2);
            float c = 1.0f;
#if CUFLASH_MODS
            if (split == 0) c = sink_fold(mods, head0 + (qi0 + 16 * f + 8 * h) % pk, m_row[f][h], l);   // (one split's)
#endif
            if (nan_rows) l = __int_as_float(0x7fffffff);
            l_row[f][h] = l;
            inv_l[f][h] = l != 0.0f ? c / l : 0.0f;   // l == 0: no key (O = 0); NaN l stays NaN
#if CUFLASH_CACHE_FP8
            inv_l[f][h] *= v_ds;   // O = (P V) vd
#endif
        }
#if CUFLASH_KVCACHE
    if (nsplit > 1) {   // split-KV: this split's normalized float32 O and LSE, for attention_combine.cu
#pragma unroll
        for (int f = 0; f < MT; ++f)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int pr = qi0 + 16 * f + 8 * h;
                if (pr >= q_rows) continue;
                const long long row = split * partial_rows +
                                      ((batch * num_heads_q + head0 + pr % pk) * (long long)seqlen_q + pr / pk);
                float* o_p = o_partial + row * head_dim_v;
#pragma unroll
                for (int i = 0; i < NFRAG_O; ++i) {
                    const int c = 8 * i + 2 * t;
                    if (c < head_dim_v)
                        *reinterpret_cast<float2*>(o_p + c) =
                            make_float2(o_acc[f][i][2 * h] * inv_l[f][h], o_acc[f][i][2 * h + 1] * inv_l[f][h]);
                }
                if (t == 0)
                    lse_partial[row] = l_row[f][h] != 0.0f ? m_row[f][h] * LN2 + logf(l_row[f][h]) : CUFLASH_NEG_INF;
            }
        return;
    }
#endif
    __syncwarp();   // this warp's ldmatrix reads of its Q rows are done
    elem_t* o_s = q_s + 16 * MT * warp * PITCH;
#pragma unroll
    for (int f = 0; f < MT; ++f)
#pragma unroll
        for (int i = 0; i < NFRAG_O; ++i) {
            const int c = 8 * i + 2 * t;
            elem_t* r = o_s + (16 * f + g) * PITCH + c;
            *reinterpret_cast<unsigned*>(r) = pack2(o_acc[f][i][0] * inv_l[f][0], o_acc[f][i][1] * inv_l[f][0]);
            *reinterpret_cast<unsigned*>(r + 8 * PITCH) = pack2(o_acc[f][i][2] * inv_l[f][1], o_acc[f][i][3] * inv_l[f][1]);
        }
    __syncwarp();
    const int wrow0 = row0 + 16 * MT * warp;
    elem_t* o_head = out + batch * o_batch_stride + head0 * o_head_stride + q_first * o_row_stride;
    constexpr int WARP_CHUNKS = 16 * MT * CHUNKS;
#pragma unroll
    for (int i = 0; i < (WARP_CHUNKS + 31) / 32; ++i) {
        const int e = lane + 32 * i;
        const int r = e / CHUNKS;
        const int c = e - r * CHUNKS;
        const int pr = wrow0 + r;   // packed row: query row pr / pk of head head0 + pr % pk
        if ((WARP_CHUNKS % 32 == 0 || e < WARP_CHUNKS) && pr < q_rows && c * 8 < head_dim_v)
            *reinterpret_cast<uint4*>(o_head + (pr % pk) * o_head_stride + (long long)(pr / pk) * o_row_stride + c * 8) =
                *reinterpret_cast<const uint4*>(o_s + r * PITCH + c * 8);
    }
    if (t == 0) {
        float* lse_head = lse + batch * lse_batch_stride + head0 * lse_head_stride + q_first;
#pragma unroll
        for (int f = 0; f < MT; ++f)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int pr = qi0 + 16 * f + 8 * h;
                if (pr < q_rows)
                    lse_head[(pr % pk) * lse_head_stride + pr / pk] =
                        l_row[f][h] != 0.0f ? m_row[f][h] * LN2 + logf(l_row[f][h]) : CUFLASH_NEG_INF;
            }
    }
}
