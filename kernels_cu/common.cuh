// cuflash: device helpers shared by every kernel family.
//
// NVRTC does not define INFINITY (no <math.h>), so the constants are spelled out here.
// Loads and stores of the 16-bit types go through to_float/from_float so that a kernel body is
// written once for every dtype; the dtype is chosen by the variant's #define prelude.
// The same text compiles with NVRTC for the GPU and with g++ for the simulator (cuflash/sim),
// whose runtime supplies the CUDA built-ins and stand-ins for the two toolkit headers below.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#define CUFLASH_NEG_INF (-__int_as_float(0x7f800000))
#define CUFLASH_LOG2E 1.4426950408889634f
#define CUFLASH_FULL_MASK 0xffffffffu

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <class T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Copy rows [0, n_rows) x [0, n_cols) of a tile (row stride `src_row_stride` elements, unit
// column stride) to float32 shared memory with row stride `dst_stride`, using the block's
// NTHREADS threads (threadIdx.x); rows n_rows..max_rows-1 are zero-filled, and nothing outside
// the source rows and columns is read. Callers synchronize.
template <int NTHREADS, class T>
__device__ __forceinline__ void load_tile_f32(float* __restrict__ dst, int dst_stride, const T* __restrict__ src,
                                              long long src_row_stride, int n_rows, int max_rows, int n_cols) {
    for (int e = threadIdx.x; e < max_rows * n_cols; e += NTHREADS) {
        const int r = e / n_cols;
        const int c = e - r * n_cols;
        dst[r * dst_stride + c] = r < n_rows ? to_float(src[r * src_row_stride + c]) : 0.0f;
    }
}

// ---------------------------------------------------------------------------------------------
// Grid decoding and the attention mask, shared by the attention kernels.
//
// Every attention kernel runs a 1-D grid, blockIdx.x = tile + num_tiles * (head + num_heads *
// batch), so gridDim.y/z never limit B*H (tile: a query tile in the forward, a key-tile split in
// the backward; head: a query head in the forward, a kv head in the backward).
struct GridCoord {
    int tile;
    int head;
    long long batch;
};

// The coordinates of block `block` (grid_coord: of this block; a kernel that recomputes them
// after its main loop from ptx_opaque(blockIdx.x) keeps no register for them across the loop).
__device__ __forceinline__ GridCoord grid_coord_of(long long block, int num_tiles, int num_heads) {
    const long long bh = block / num_tiles;
    GridCoord c;
    c.tile = (int)(block % num_tiles);
    c.head = (int)(bh % num_heads);
    c.batch = bh / num_heads;
    return c;
}

__device__ __forceinline__ GridCoord grid_coord(int num_tiles, int num_heads) { return grid_coord_of(blockIdx.x, num_tiles, num_heads); }

// The mask (bottom-right aligned, as in cuflash.reference.masks): query i sees key j iff
//     -window_left <= j - (i + Sk - Sq) <= window_right        (a bound of -1 is unbounded),
// which is the causal mask when window_right = 0. Every bound from -1 to INT32_MAX works: the
// helpers below never add a bound to an index, so nothing wraps (a kernel tests key j of query i
// as window_key_range(i, 1, ...).lo <= j < .hi).
//
// diag_distance is j - (i + Sk - Sq), how far key j lies right of query i's diagonal key,
// written as (j - Sk) + (Sq - i) so that it is exact in 32 bits for every index the kernels
// form (0 <= i < Sq + Br and 0 <= j < Sk + Bc, lengths below 2^31 - 256).
__device__ __forceinline__ int diag_distance(int i, int j, int seqlen_q, int seqlen_k) {
    return (j - seqlen_k) + (seqlen_q - i);
}

// A half-open index range [lo, hi), lo <= hi.
struct IndexRange {
    int lo;
    int hi;
};

// The indices [lo, hi) of an axis of length len_to, 0 <= lo <= hi <= len_to, that the band
// -below <= (to - diagonal partner of from) <= above reaches from some index of [start, start + count)
// of an axis of length len_from, the diagonal being aligned bottom-right (from i, partner
// i + len_to - len_from). Exact in 32 bits for every bound that fits an int: each difference is
// formed only where it cannot overflow. The kernels also ask for padding indices past len_from
// (start + count <= len_from + 256, rest < 0); their range is then still inside [0, len_to].
__device__ __forceinline__ IndexRange band_range(int start, int count, int len_from, int len_to, int below, int above) {
    const int first = len_to - (len_from - start);     // partner of start (may be negative)
    const int rest = len_from - (start + count);       // indices after the last one
    int lo = (below < 0 || first <= below) ? 0 : first - below;
    int hi = (above < 0 || above >= rest) ? len_to : len_to - (rest - above);
    lo = lo < len_to ? lo : len_to;
    IndexRange r;
    r.lo = lo;
    r.hi = hi > lo ? hi : lo;
    return r;
}

// Keys [lo, hi) that some query row of [row0, row0 + rows) sees, 0 <= lo <= hi <= Sk.
__device__ __forceinline__ IndexRange window_key_range(int row0, int rows, int seqlen_q, int seqlen_k, int window_left,
                                                       int window_right) {
    return band_range(row0, rows, seqlen_q, seqlen_k, window_left, window_right);
}

// Query rows [lo, hi) that see some key of [col0, col0 + cols), 0 <= lo <= hi <= Sq (the
// transpose of window_key_range, for the backward's key-tile-major loops).
__device__ __forceinline__ IndexRange window_query_range(int col0, int cols, int seqlen_q, int seqlen_k, int window_left,
                                                         int window_right) {
    return band_range(col0, cols, seqlen_k, seqlen_q, window_right, window_left);
}

// True when every pair of query rows [row0, row0 + rows) and keys [col0, col0 + cols) lies in
// the window (so a tile needs no per-element window mask).
__device__ __forceinline__ bool tile_in_window(int row0, int rows, int col0, int cols, int seqlen_q, int seqlen_k,
                                               int window_left, int window_right) {
    return (window_right < 0 || diag_distance(row0, col0 + cols - 1, seqlen_q, seqlen_k) <= window_right) &&
           (window_left < 0 || diag_distance(row0 + rows - 1, col0, seqlen_q, seqlen_k) >= -window_left);
}

// ---------------------------------------------------------------------------------------------
// Variable-length batches (cuflash.attention_varlen, flash-attn's packed convention): sequence b
// owns query rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) and key rows [cu_seqlens_k[b],
// cu_seqlens_k[b + 1]) of the packed arrays, of which it uses the first seqused_k[b] keys when
// seqused_k is given (FA3). The variants built with CUFLASH_VARLEN 1 (a compile-time axis, so the
// fixed-shape code is untouched) take `varlen` (bit 0: packed; bit 1: seqused_k given) and the
// totals in their seqlen_q / seqlen_k arguments. Every index is clamped into
// [0, total], so whatever a device-resident index holds a kernel reads and writes only inside
// the arrays (a sequence longer than the grid covers keeps its uncovered rows as they were).
struct VarlenSeq {
    int q0, k0;      // first query row and first key row in the packed arrays
    int seqlen_q;    // the sequence's query rows
    int seqlen_k;    // keys it attends to (seqused_k[b] when given)
    int keys;        // key rows it owns (>= seqlen_k; dK/dV rows past seqlen_k are 0)
};

__device__ __forceinline__ int clamp_index(int x, int lo, int hi) { return x < lo ? lo : (x > hi ? hi : x); }

__device__ __forceinline__ VarlenSeq varlen_seq(long long b, int varlen, const int* __restrict__ cu_seqlens_q,
                                                const int* __restrict__ cu_seqlens_k,
                                                const int* __restrict__ seqused_k, int total_q, int total_k) {
    VarlenSeq s;
    s.q0 = clamp_index(cu_seqlens_q[b], 0, total_q);
    s.seqlen_q = clamp_index(cu_seqlens_q[b + 1], s.q0, total_q) - s.q0;
    s.k0 = clamp_index(cu_seqlens_k[b], 0, total_k);
    s.keys = clamp_index(cu_seqlens_k[b + 1], s.k0, total_k) - s.k0;
    s.seqlen_k = (varlen & 2) ? clamp_index(seqused_k[b], 0, s.keys) : s.keys;
    return s;
}

// `x`, which every lane of the (full) warp holds, as a value the compiler knows is warp-uniform:
// __reduce_max_sync (redux.sync, sm_80+) writes a uniform register. Before sm_80, `x` itself.
__device__ __forceinline__ int warp_uniform(int x) {
#if defined(CUFLASH_SIM) || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800)
    return __reduce_max_sync(CUFLASH_FULL_MASK, x);
#else
    return x;
#endif
}

// varlen_seq with every field made warp-uniform by a warp reduction (all lanes hold the same
// values; redux.sync, sm_80+, writes a uniform register): the block's lengths and offsets then
// live in the uniform datapath, as a fixed-shape kernel's arguments do, instead of taking vector
// registers across the main loop (without it ptxas spilled the d128 forward).
__device__ __forceinline__ VarlenSeq varlen_seq_uniform(long long b, int varlen, const int* __restrict__ cu_seqlens_q,
                                                        const int* __restrict__ cu_seqlens_k,
                                                        const int* __restrict__ seqused_k, int total_q, int total_k) {
    VarlenSeq s = varlen_seq(b, varlen, cu_seqlens_q, cu_seqlens_k, seqused_k, total_q, total_k);
    s.q0 = warp_uniform(s.q0);
    s.k0 = warp_uniform(s.k0);
    s.seqlen_q = warp_uniform(s.seqlen_q);
    s.seqlen_k = warp_uniform(s.seqlen_k);
    s.keys = warp_uniform(s.keys);
    return s;
}
