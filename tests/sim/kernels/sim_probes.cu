// Test kernels for the simulator's CUDA built-ins. Plain CUDA C: tests/sim/test_sim_nvrtc_compile.py
// also compiles this file with NVRTC for real GPUs.
#include "common.cuh"

// Block-wide sum (shuffles within warps, shared memory across warps) and each warp's maximum.
extern "C" __global__ void block_reduce(const float* __restrict__ x, float* __restrict__ block_sums,
                                        float* __restrict__ warp_max, int n) {
    __shared__ float partials[32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int i = blockIdx.x * blockDim.x + tid;
    float v = i < n ? x[i] : 0.0f;
    float m = i < n ? x[i] : CUFLASH_NEG_INF;
    for (int o = 16; o > 0; o >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, o);
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    }
    if (i < n) warp_max[i] = m;
    if (lane == 0) partials[warp] = v;
    __syncthreads();
    if (warp == 0) {
        const int nw = (blockDim.x + 31) >> 5;
        float s = lane < nw ? partials[lane] : 0.0f;
        for (int o = 16; o > 0; o >>= 1) s += __shfl_down_sync(0xffffffffu, s, o);
        if (lane == 0) block_sums[blockIdx.x] = s;
    }
}

// Reverse each block's 128 values through shared memory; without the barrier, threads read slots
// that other threads have not written yet.
extern "C" __global__ void reverse_block(const float* __restrict__ x, float* __restrict__ y, int use_barrier) {
    __shared__ float s[128];
    const int base = blockIdx.x * 128;
    s[threadIdx.x] = x[base + threadIdx.x];
    if (use_barrier) __syncthreads();
    y[base + threadIdx.x] = s[127 - threadIdx.x];
}

// Every shuffle flavour and vote, one warp per block; out has 10 ints per lane.
extern "C" __global__ void warp_ops(int* __restrict__ out, int width) {
    const int lane = threadIdx.x;
    const int v = 100 + lane;
    int* o = out + (blockIdx.x * 32 + lane) * 10;
    o[0] = __shfl_sync(0xffffffffu, v, 5, width);
    o[1] = __shfl_sync(0xffffffffu, v, lane + 3, width);
    o[2] = __shfl_up_sync(0xffffffffu, v, 2, width);
    o[3] = __shfl_down_sync(0xffffffffu, v, 3, width);
    o[4] = __shfl_xor_sync(0xffffffffu, v, 5, width);
    o[5] = (int)__ballot_sync(0xffffffffu, (lane % 3) == 0);
    o[6] = __any_sync(0xffffffffu, lane == 17);
    o[7] = __all_sync(0xffffffffu, lane < 31);
    o[8] = __all_sync(0xffffffffu, lane < 32);
    // lower half-warp only, with its own mask
    o[9] = -1;
    if (lane < 16) o[9] = __shfl_xor_sync(0x0000ffffu, v, 1);
    __syncwarp();
    const double d = __shfl_sync(0xffffffffu, 0.5 + lane, 31 - lane);   // 8-byte shuffle
    if (d != 0.5 + (31 - lane)) o[9] = -2;
}

// atomics on global and shared memory; every thread of the grid adds.
extern "C" __global__ void atomics(float* __restrict__ fsum, int* __restrict__ isum, int* __restrict__ imax,
                                   unsigned long long* __restrict__ usum, int* __restrict__ block_counts) {
    __shared__ int count;
    if (threadIdx.x == 0) count = 0;
    __syncthreads();
    const int g = blockIdx.x * blockDim.x + threadIdx.x;
    atomicAdd(fsum, 0.5f);
    atomicAdd(isum, g);
    atomicMax(imax, (g * 37) % 1001);
    atomicAdd(usum, 1ull << 33);
    atomicAdd(&count, 1);
    __syncthreads();
    if (threadIdx.x == 0) block_counts[blockIdx.x] = count;
}

// Built-in index variables on a 3-D grid of 3-D blocks: 8 ints per thread.
extern "C" __global__ void indices(int* __restrict__ out) {
    const int bid = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    const int nt = blockDim.x * blockDim.y * blockDim.z;
    const int tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    int* o = out + (bid * nt + tid) * 8;
    o[0] = threadIdx.x; o[1] = threadIdx.y; o[2] = threadIdx.z;
    o[3] = blockIdx.x; o[4] = blockIdx.y; o[5] = blockIdx.z;
    o[6] = blockDim.x * 100 + blockDim.y * 10 + blockDim.z;
    o[7] = gridDim.x * 100 + gridDim.y * 10 + gridDim.z;
}

// Dynamic shared memory (extern), a 2-D static array and shared memory in a template function.
template <int N>
__device__ float tile_sum(const float* src) {
    __shared__ __align__(16) float tile[N][N + 1];
    const int t = threadIdx.x;
    for (int i = t; i < N * N; i += blockDim.x) tile[i / N][i % N] = src[i];
    __syncthreads();
    float s = 0.0f;
    if (t < N)
        for (int j = 0; j < N; ++j) s += tile[j][t];   // column sums
    __syncthreads();
    return s;
}

extern "C" __global__ void shared_kinds(const float* __restrict__ x, float* __restrict__ out, int n_dyn) {
    extern __shared__ __align__(16) float dyn[];
    for (int i = threadIdx.x; i < n_dyn; i += blockDim.x) dyn[i] = x[i] * 2.0f;
    __syncthreads();
    const float c8 = tile_sum<8>(x);
    const float c4 = tile_sum<4>(x);
    if (threadIdx.x < 8) out[threadIdx.x] = c8;
    if (threadIdx.x < 4) out[8 + threadIdx.x] = c4;
    for (int i = threadIdx.x; i < n_dyn; i += blockDim.x) out[12 + i] = dyn[n_dyn - 1 - i];
}

// Reads shared memory nobody wrote: must see the poison pattern, not zeros.
extern "C" __global__ void read_unwritten(unsigned* __restrict__ out) {
    __shared__ unsigned s[64];
    extern __shared__ unsigned dyn_words[];
    out[threadIdx.x] = s[threadIdx.x];
    out[64 + threadIdx.x] = dyn_words[threadIdx.x];
}

// Large dynamic shared memory: touches the last element.
extern "C" __global__ void big_dynamic(float* out, int n) {
    extern __shared__ float d[];
    for (int i = threadIdx.x; i < n; i += blockDim.x) d[i] = float(i);
    __syncthreads();
    if (threadIdx.x == 0) out[0] = d[n - 1];
}

// Half a warp waits at __syncthreads, the other half at __syncwarp for it: deadlock.
extern "C" __global__ void divergent_barrier(float* out) {
    if (threadIdx.x < 16)
        __syncthreads();
    else
        __syncwarp();
    out[threadIdx.x] = 1.0f;
}

extern "C" __global__ void trap_kernel(float* out) {
    if (threadIdx.x == 7) __trap();
    out[threadIdx.x] = 1.0f;
}

// float -> half / bfloat16 (round to nearest even) and back, through the toolkit intrinsics.
extern "C" __global__ void convert16(const float* __restrict__ x, unsigned short* __restrict__ h,
                                     unsigned short* __restrict__ b, float* __restrict__ back, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const __half hv = __float2half_rn(x[i]);
    const __nv_bfloat16 bv = __float2bfloat16_rn(x[i]);
    h[i] = __half_as_ushort(hv);
    b[i] = __bfloat16_as_ushort(bv);
    back[2 * i] = __half2float(hv);
    back[2 * i + 1] = __bfloat162float(bv);
}

// Device math used by the kernels: 8 results per element.
extern "C" __global__ void device_math(const float* __restrict__ x, float* __restrict__ out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float v = x[i];
    float* o = out + 8 * i;
    o[0] = expf(v);
    o[1] = exp2f(v);
    o[2] = __expf(v);
    o[3] = fmaxf(v, 0.25f);
    o[4] = rsqrtf(fabsf(v) + 1.0f);
    o[5] = __fdividef(v, 3.0f);
    o[6] = logf(fabsf(v) + 1.0f);
    o[7] = fminf(v, -0.25f);
}

// __syncthreads at two call sites in one barrier phase. mode 0: an if/else whose two branches
// each hold a barrier (warp 0 takes one, warp 1 the other); mode 1: per-warp trip counts (warp 0
// loops twice over a barrier, warp 1 once, then meets a barrier after the loop).
extern "C" __global__ void two_barrier_sites(float* out, int mode) {
    const int warp = threadIdx.x / 32;
    if (mode == 0) {
        if (warp == 0)
            __syncthreads();
        else
            __syncthreads();
    } else {
        for (int i = 0; i < (warp == 0 ? 2 : 1); ++i) __syncthreads();
        __syncthreads();
    }
    out[threadIdx.x] = 1.0f;
}

// A shuffle whose full mask names lanes that have exited: lanes 16..31 return first, then lanes
// 0..15 read lane + 16 (mode 1) or, correctly, lane ^ 1 among themselves (mode 0, mask 0xffff).
extern "C" __global__ void shfl_from_exited(float* out, int mode) {
    const int lane = threadIdx.x;
    if (lane >= 16) return;
    const float v = float(lane);
    out[lane] = mode ? __shfl_sync(0xffffffffu, v, lane + 16) : __shfl_xor_sync(0x0000ffffu, v, 1);
}

// Declared for at most 64 threads per block (PTX .maxntid 64).
extern "C" __global__ void __launch_bounds__(2 * 32) bounded64(float* __restrict__ out) {
    out[blockIdx.x * blockDim.x + threadIdx.x] = 1.0f;
}

// out[i] = 2 * in[i] through __restrict__ pointers, and the same without the promise.
extern "C" __global__ void scale_restrict(const float* __restrict__ in, float* __restrict__ out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = 2.0f * in[i];
}
extern "C" __global__ void scale_in_place(const float* in, float* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = 2.0f * in[i];
}
