// Test kernels with planted faults for the hazard classes of issue 16 (tests/sim/test_sim_hazards.py):
// read-modify-write races, global-memory races, misaligned and wild accesses, crashes, spin-waits.
// Plain CUDA C; each kernel's flag argument turns its fault on (1) or off (0).
#include "common.cuh"

// Every thread adds 1 to one shared counter (`bad` = 1: a read-modify-write race) or only thread 0.
extern "C" __global__ void hz_shared_rmw(float* __restrict__ y, int bad) {
    __shared__ float count;
    if (threadIdx.x == 0) count = 0.0f;
    __syncthreads();
    if (bad || threadIdx.x == 0) count += 1.0f;
    __syncthreads();
    if (threadIdx.x == 0) y[0] = count;
}

// x[t] += 1 on an argument the plan marks read-only.
extern "C" __global__ void hz_rmw_input(float* __restrict__ x) { x[threadIdx.x] += 1.0f; }

// Global read-modify-writes: each thread on its own element, or (`bad` = 1) all on y[0].
extern "C" __global__ void hz_global_rmw(float* __restrict__ y, int bad) {
    y[bad ? 0 : threadIdx.x] += 1.0f;
}

// Each block writes its own element, or (`bad` = 1) every block writes y[0].
extern "C" __global__ void hz_global_blocks(float* __restrict__ y, int bad) {
    if (threadIdx.x == 0) y[bad ? 0 : blockIdx.x] = float(blockIdx.x);
}

// Block 1 reads what block 0 writes (`bad` = 1) or its own element.
extern "C" __global__ void hz_global_reader(float* __restrict__ y, int bad) {
    if (threadIdx.x != 0) return;
    if (blockIdx.x == 0) y[0] = 1.0f;
    else y[2] = y[bad ? 0 : 1];
}

// Thread 0 writes y[0], thread 1 reads it: ordered by a __syncthreads (`sync` = 1) or not.
extern "C" __global__ void hz_global_barrier(float* __restrict__ y, int sync) {
    if (threadIdx.x == 0) y[0] = 5.0f;
    if (sync) __syncthreads();
    if (threadIdx.x == 1) y[1] = y[0];
}

// Atomics of every thread of every block on one word: no race.
extern "C" __global__ void hz_global_atomics(int* __restrict__ total) { atomicAdd(total, 1); }

// A float4 load at x + offset: misaligned for an offset that is not a multiple of 4.
extern "C" __global__ void hz_misaligned(const float* __restrict__ x, float* __restrict__ y, int offset) {
    const float4 v = *reinterpret_cast<const float4*>(x + offset);
    y[threadIdx.x] = v.x + v.y + v.z + v.w;
}

// y[t] = x[at]: a far index (an int offset past 2^31 in bytes, ...) reads memory no argument holds.
extern "C" __global__ void hz_far_read(const float* __restrict__ x, float* __restrict__ y, long long at) {
    y[threadIdx.x] = x[at];
}

// An integer division by a run-time zero (the GPU returns an undefined value; the CPU traps).
extern "C" __global__ void hz_divide(int* __restrict__ y, int d) { y[threadIdx.x] = 1000 / d; }

// Warp 0 spins on a volatile shared flag that warp 1 sets (`deadlock` = 1: nobody sets it).
extern "C" __global__ void hz_spin_shared(int* __restrict__ y, int deadlock) {
    __shared__ int flag;
    if (threadIdx.x == 0) flag = 0;
    __syncthreads();
    volatile int* f = &flag;
    if (threadIdx.x < 32) {
        while (*f == 0) {
        }
        y[threadIdx.x] = *f;
    } else if (threadIdx.x == 32 && !deadlock) {
        *f = 7;
    }
}

// Thread 0 spins with atomics on a global flag that thread 32 (another warp) sets (`deadlock` = 1:
// nobody sets it). (Flags between blocks are not supported: the simulator runs a block's threads
// interleaved, but blocks to completion one after another on each worker.)
extern "C" __global__ void hz_spin_atomic(int* __restrict__ flag, int* __restrict__ y, int deadlock) {
    if (threadIdx.x == 0) {
        while (atomicAdd(flag, 0) == 0) {
        }
        y[0] = atomicAdd(flag, 0);
    } else if (threadIdx.x == 32 && !deadlock) {
        atomicExch(flag, 3);
    }
}

// Rounding probes for SimOptions(gpu_numerics=True): out[0..n) = exp2f(x), out[n] = a * b + c
// (contracted to one FMA on the GPU), out[n + 1] = tiny * tiny2 (a subnormal result).
extern "C" __global__ void hz_numerics(const float* __restrict__ x, float* __restrict__ out, int n, float a, float b,
                                       float c, float tiny, float tiny2) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = exp2f(x[i]);
    if (i == 0) {
        out[n] = a * b + c;
        out[n + 1] = tiny * tiny2;
    }
}
