// Test kernels with planted faults for the simulator's checked mode (tests/sim/test_sim_checked.py).
// Plain CUDA C; each kernel's flag argument turns its fault on (1) or off (0).
#include "common.cuh"

// Reverse 128 values through shared memory; `use_barrier` = 0 plants a missing __syncthreads.
extern "C" __global__ void chk_reverse(const float* __restrict__ x, float* __restrict__ y, int use_barrier) {
    __shared__ float s[128];
    s[threadIdx.x] = x[threadIdx.x];
    if (use_barrier) __syncthreads();
    y[threadIdx.x] = s[127 - threadIdx.x];
}

// Each thread copies x[i] for i < n + extra (extra = 1: one element past the view's end).
extern "C" __global__ void chk_copy(const float* __restrict__ x, float* __restrict__ y, int n, int extra) {
    const int i = threadIdx.x;
    if (i < n + extra) y[i < n ? i : n - 1] = x[i];
}

// Row-wise copy of a strided 2-D view: rows of `cols` elements, `row_stride` apart;
// extra = 1 reads one element beyond each row (the gap: another view's elements).
extern "C" __global__ void chk_rows(const float* __restrict__ x, float* __restrict__ y, int rows, int cols,
                                   long long row_stride, int extra) {
    const int r = blockIdx.x, c = threadIdx.x;
    if (r < rows && c < cols) y[r * cols + c] = x[r * row_stride + c + (c == cols - 1 ? extra : 0)];
}

// Writes y[i] for i <= n - 1 + extra: extra = 1 writes one element past the end.
extern "C" __global__ void chk_write(float* __restrict__ y, int n, int extra) {
    const int i = threadIdx.x;
    if (i < n + extra) y[i] = 1.0f;
}

// Writes through a pointer the plan marks read-only.
extern "C" __global__ void chk_write_input(float* __restrict__ x) {
    x[threadIdx.x] = 2.0f;
}

// Half of the shared array is written; `bad` = 1 reads the unwritten half.
extern "C" __global__ void chk_uninit_shared(float* __restrict__ y, int bad) {
    __shared__ float t[4][16];
    const int i = threadIdx.x;
    if (i < 32) t[i / 16][i % 16] = float(i);
    __syncthreads();
    y[i] = t[(bad ? i : i % 32) / 16][i % 16];
}

// `bad` = 1 leaves the accumulators uninitialized (on the GPU: whatever the registers held).
extern "C" __global__ void chk_uninit_local(const float* __restrict__ x, float* __restrict__ y, int n, int bad) {
    float acc[4];
    if (!bad)
        for (int c = 0; c < 4; ++c) acc[c] = 0.0f;
    for (int i = 0; i < n; ++i) acc[i & 3] += x[i];
    y[threadIdx.x] = acc[0] + acc[1] + acc[2] + acc[3];
}

// Threads 3 and 9 write the same shared word (`bad` = 1) in one barrier phase.
extern "C" __global__ void chk_race(float* __restrict__ y, int bad) {
    __shared__ float w[32];
    w[threadIdx.x] = 0.0f;
    __syncthreads();
    if (threadIdx.x == 3) w[0] = 3.0f;
    if (threadIdx.x == 9) w[bad ? 0 : 1] = 9.0f;
    __syncthreads();
    y[threadIdx.x] = w[threadIdx.x];
}

// Lane 0 overwrites a value the other lanes then read, with __syncwarp between (`sync` = 1) or not.
extern "C" __global__ void chk_warp_sync(float* __restrict__ y, int sync) {
    __shared__ float v[32];
    v[threadIdx.x] = 1.0f;
    __syncthreads();
    if (threadIdx.x == 0) v[0] = 5.0f;
    if (sync) __syncwarp();
    y[threadIdx.x] = v[0];
}

// Shared atomics on a counter (initialized, or not with `bad` = 1) and global atomics.
extern "C" __global__ void chk_atomics(int* __restrict__ total, int bad) {
    __shared__ int count;
    if (!bad && threadIdx.x == 0) count = 0;
    __syncthreads();
    atomicAdd(&count, 1);
    __syncthreads();
    if (threadIdx.x == 0) atomicAdd(total, count);
}

// Thread 0 writes y[at]: any offset, for the slack and guard pages around an argument's copy.
extern "C" __global__ void chk_poke(float* __restrict__ y, long long at) {
    if (threadIdx.x == 0) y[at] = 7.0f;
}
