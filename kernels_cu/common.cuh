// cuflash: device helpers shared by every kernel family.
//
// NVRTC does not define INFINITY (no <math.h>), so the constants are spelled out here.
// Loads and stores of the 16-bit types go through to_float/from_float so that a kernel body is
// written once for every dtype; the dtype is chosen by the variant's #define prelude.
// The same text compiles with NVRTC for the GPU and with g++ for the simulator (cuflash/_sim),
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
