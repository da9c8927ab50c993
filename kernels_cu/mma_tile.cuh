// cuflash: helpers of the tensor-core kernels (attention_fwd_mma.cu, attention_bwd_mma.cu).
//
// Include after the kernel has defined elem_t, NT (threads per block), PITCH (shared-memory row
// pitch, elements) and CHUNKS (16-byte chunks per row), with CUFLASH_BF16 selecting bf16.
#pragma once

#include "ptx.cuh"

// d += a * b on one m16n8k16 tile (f32 accumulators).
__device__ __forceinline__ void mma16816(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
#if CUFLASH_BF16
    ptx_mma_m16n8k16_bf16_f32(d, a, b, d);
#else
    ptx_mma_m16n8k16_f16_f32(d, a, b, d);
#endif
}

// Two floats rounded to the element type and packed into one 32-bit register (lo in the low half).
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
#if CUFLASH_BF16
    return ptx_cvt_pack_bf16x2(lo, hi);
#else
    return ptx_cvt_pack_f16x2(lo, hi);
#endif
}

// cp.async a tile of MAX_ROWS rows x CHUNKS 16-byte chunks into shared memory (pitch PITCH): rows
// < n_rows and chunks < n_cols / 8 come from `src` (row stride in elements); everything else is
// zero-filled (src-size 0, nothing is read; the address passed is the aligned tile base). When NT
// divides the tile's chunks and is a multiple of CHUNKS (the regular case), a thread copies the
// same chunk of rows r0, r0 + NT / CHUNKS, ...: its offsets cost one multiply per row pass.
//
// In the sm_75 form (CUFLASH_SM75_FORM, ptx.cuh: no cp.async) the regular case stages the tile
// through registers instead: every 16-byte load of the thread first (TOTAL / NT uint4, 4 registers
// each), then every store, so the loads are in flight together and the thread waits for one
// global-memory latency per tile rather than one per chunk; the copy is complete on return.
template <int MAX_ROWS>
__device__ __forceinline__ void load_tile_async(elem_t* dst, const elem_t* __restrict__ src, long long row_stride,
                                                int n_rows, int n_cols) {
    constexpr int TOTAL = MAX_ROWS * CHUNKS;
#if CUFLASH_SM75_FORM
    if constexpr (NT % CHUNKS == 0 && TOTAL % NT == 0) {
        constexpr int RPP = NT / CHUNKS;   // rows per pass
        const int r0 = threadIdx.x / CHUNKS, c = threadIdx.x % CHUNKS;
        const bool col_ok = c * 8 < n_cols;
        const elem_t* s = src + r0 * row_stride + c * 8;
        uint4 staged[TOTAL / NT];
#pragma unroll
        for (int i = 0; i < TOTAL / NT; ++i) {
            staged[i] = uint4{0u, 0u, 0u, 0u};
            if (col_ok && r0 + i * RPP < n_rows) staged[i] = *reinterpret_cast<const uint4*>(s + i * RPP * row_stride);
        }
#pragma unroll
        for (int i = 0; i < TOTAL / NT; ++i) *reinterpret_cast<uint4*>(dst + (r0 + i * RPP) * PITCH + c * 8) = staged[i];
        return;
    }
#endif
    if constexpr (NT % CHUNKS == 0 && TOTAL % NT == 0) {
        constexpr int RPP = NT / CHUNKS;   // rows per pass
        const int r0 = threadIdx.x / CHUNKS, c = threadIdx.x % CHUNKS;
        const bool col_ok = c * 8 < n_cols;
        const elem_t* s = src + r0 * row_stride + c * 8;
#pragma unroll
        for (int i = 0; i < TOTAL / NT; ++i) {
            const bool valid = col_ok && r0 + i * RPP < n_rows;
            ptx_cp_async_16_zfill(dst + (r0 + i * RPP) * PITCH + c * 8, valid ? s + i * RPP * row_stride : src,
                                  valid ? 16 : 0);
        }
    } else {
#pragma unroll
        for (int i = 0; i < (TOTAL + NT - 1) / NT; ++i) {
            const int e = threadIdx.x + i * NT;
            if (TOTAL % NT == 0 || e < TOTAL) {
                const int r = e / CHUNKS;
                const int c = e - r * CHUNKS;
                const bool valid = r < n_rows && c * 8 < n_cols;
                const elem_t* s = valid ? src + r * row_stride + c * 8 : src;
                ptx_cp_async_16_zfill(dst + r * PITCH + c * 8, s, valid ? 16 : 0);
            }
        }
    }
}

// load_tile_async of a tile whose MAX_ROWS rows and CHUNKS chunks are all in view (an interior
// tile): the same copies without predicates or zero-fill, one address per thread and a constant
// step per row pass where NT divides the tile's chunks and is a multiple of CHUNKS (else the
// general form, every test true).
template <int MAX_ROWS>
__device__ __forceinline__ void load_tile_async_full(elem_t* dst, const elem_t* __restrict__ src, long long row_stride) {
    constexpr int TOTAL = MAX_ROWS * CHUNKS;
#if CUFLASH_SM75_FORM
    if constexpr (NT % CHUNKS == 0 && TOTAL % NT == 0) {   // (staged through registers, as above)
        constexpr int RPP = NT / CHUNKS;
        const int r0 = threadIdx.x / CHUNKS, c = threadIdx.x % CHUNKS;
        const elem_t* s = src + r0 * row_stride + c * 8;
        elem_t* d = dst + r0 * PITCH + c * 8;
        uint4 staged[TOTAL / NT];
#pragma unroll
        for (int i = 0; i < TOTAL / NT; ++i) staged[i] = *reinterpret_cast<const uint4*>(s + i * RPP * row_stride);
#pragma unroll
        for (int i = 0; i < TOTAL / NT; ++i) *reinterpret_cast<uint4*>(d + i * RPP * PITCH) = staged[i];
        return;
    }
#endif
    if constexpr (NT % CHUNKS == 0 && TOTAL % NT == 0) {
        constexpr int RPP = NT / CHUNKS;   // rows per pass
        const int r0 = threadIdx.x / CHUNKS, c = threadIdx.x % CHUNKS;
        const elem_t* s = src + r0 * row_stride + c * 8;
        elem_t* d = dst + r0 * PITCH + c * 8;
#pragma unroll
        for (int i = 0; i < TOTAL / NT; ++i) ptx_cp_async_16(d + i * RPP * PITCH, s + i * RPP * row_stride);
    } else {
        load_tile_async<MAX_ROWS>(dst, src, row_stride, MAX_ROWS, CHUNKS * 8);
    }
}
