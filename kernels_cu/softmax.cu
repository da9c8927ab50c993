// cuflash: row-wise softmax with the online normalizer (Milakov & Gimelshein, "Online normalizer
// calculation for softmax", 2018).
//
// Pass 1 reads the row once, keeping per thread a running maximum m and a running sum d of
// exp(x - m): a new element x > m rescales d by exp(m - x) before adding 1; otherwise it adds
// exp(x - m). Partial (m, d) pairs are merged with the same rescaling (across lanes with
// shuffles, across warps through shared memory). Pass 2 reads the row again and writes
// exp(x - m) / d. HBM traffic: two reads and one write per element. (The seed write-up's version
// scales the block sum twice and never rescales earlier blocks; this is the published recurrence.)
//
// -inf entries contribute exactly 0; a row whose entries are all -inf has no finite normalizer
// and gives NaN, as SciPy and PyTorch do. A NaN or a +inf anywhere in a row makes the whole row
// NaN (as the three-pass exp(x - max) / sum does): such an element puts NaN into d, and NaN in d
// is never dropped, so the merges test d == 0 (no element) rather than m == -inf, and pass 2
// divides every element by it.
//
// Variant prelude (cuflash/kernels/softmax.py: SoftmaxVariant.defines()):
//   CUFLASH_ENTRY           the extern "C" entry name
//   CUFLASH_T               element type: float, __half or __nv_bfloat16
//   CUFLASH_SOFTMAX_WARP    1: one warp per row, blockDim = (32, CUFLASH_ROWS_PER_BLOCK)
//                           0: one block of CUFLASH_THREADS threads per row
//
// Arguments: x, y point at the first element of row 0; element (r, c) of x is
// x[r * x_row_stride + c] (unit stride along the softmax axis), likewise for y.
#include "common.cuh"

typedef CUFLASH_T elem_t;

// Fold one element into the running (m, d).
__device__ __forceinline__ void softmax_online_update(float& m, float& d, float x) {
    if (x > m) {
        // m == -inf: d == 0 (or NaN, kept) and the product is 0. x == +inf has no finite
        // normalizer (exp(x - max) is NaN there): d becomes NaN.
        d = d * expf(m - x) + (x == -CUFLASH_NEG_INF ? __int_as_float(0x7fffffff) : 1.0f);
        m = x;
    } else if (x != CUFLASH_NEG_INF) {
        d += expf(x - m);              // NaN x lands here and poisons d
    }
}

// Merge (m2, d2) into (m, d).
__device__ __forceinline__ void softmax_online_merge(float& m, float& d, float m2, float d2) {
    const float mm = fmaxf(m, m2);   // fmaxf drops a NaN operand; NaN travels in d
    if (mm == CUFLASH_NEG_INF) {      // no finite maximum on either side: 0 + 0, or NaN
        d += d2;
        return;
    }
    // d == 0 exactly when a side saw no element above -inf; a NaN d (even with m == -inf) stays
    d = (d == 0.0f ? 0.0f : d * expf(m - mm)) + (d2 == 0.0f ? 0.0f : d2 * expf(m2 - mm));
    m = mm;
}

__device__ __forceinline__ void softmax_warp_merge(float& m, float& d) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float m2 = __shfl_xor_sync(CUFLASH_FULL_MASK, m, offset);
        const float d2 = __shfl_xor_sync(CUFLASH_FULL_MASK, d, offset);
        softmax_online_merge(m, d, m2, d2);
    }
}

__device__ __forceinline__ void softmax_write_row(const elem_t* __restrict__ xr, elem_t* __restrict__ yr, int n_cols,
                                                  int first, int step, float m, float d) {
    const bool empty = (m == CUFLASH_NEG_INF);
    const float inv = 1.0f / d;
    const float nan = __int_as_float(0x7fffffff);
    for (int c = first; c < n_cols; c += step) {
        const float v = empty ? nan : expf(to_float(xr[c]) - m) * inv;
        yr[c] = from_float<elem_t>(v);
    }
}

#if CUFLASH_SOFTMAX_WARP

extern "C" __global__ void __launch_bounds__(32 * CUFLASH_ROWS_PER_BLOCK)
CUFLASH_ENTRY(const elem_t* __restrict__ x, elem_t* __restrict__ y, long long n_rows, int n_cols,
              long long x_row_stride, long long y_row_stride) {
    const long long row = (long long)blockIdx.x * CUFLASH_ROWS_PER_BLOCK + threadIdx.y;
    if (row >= n_rows) return;   // the whole warp leaves together
    const int lane = threadIdx.x;
    const elem_t* xr = x + row * x_row_stride;
    float m = CUFLASH_NEG_INF, d = 0.0f;
    for (int c = lane; c < n_cols; c += 32) softmax_online_update(m, d, to_float(xr[c]));
    softmax_warp_merge(m, d);
    softmax_write_row(xr, y + row * y_row_stride, n_cols, lane, 32, m, d);
}

#else

#define SOFTMAX_WARPS (CUFLASH_THREADS / 32)

extern "C" __global__ void __launch_bounds__(CUFLASH_THREADS)
CUFLASH_ENTRY(const elem_t* __restrict__ x, elem_t* __restrict__ y, long long n_rows, int n_cols,
              long long x_row_stride, long long y_row_stride) {
    __shared__ float warp_m[SOFTMAX_WARPS];
    __shared__ float warp_d[SOFTMAX_WARPS];
    const long long row = blockIdx.x;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const elem_t* xr = x + row * x_row_stride;
    float m = CUFLASH_NEG_INF, d = 0.0f;
    for (int c = tid; c < n_cols; c += CUFLASH_THREADS) softmax_online_update(m, d, to_float(xr[c]));
    softmax_warp_merge(m, d);
    if (lane == 0) {
        warp_m[warp] = m;
        warp_d[warp] = d;
    }
    __syncthreads();
    m = warp_m[0];
    d = warp_d[0];
#pragma unroll
    for (int w = 1; w < SOFTMAX_WARPS; ++w) softmax_online_merge(m, d, warp_m[w], warp_d[w]);
    softmax_write_row(xr, y + row * y_row_stride, n_cols, tid, CUFLASH_THREADS, m, d);
}

#endif
