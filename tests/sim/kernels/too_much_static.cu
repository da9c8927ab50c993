// 52 KB of static shared memory: over the 48 KB limit of every arch. NVRTC (ptxas) rejects it at
// compile time; the simulator at run time, when the block declares it.
extern "C" __global__ void too_much_static(float* out) {
    __shared__ float big[13 * 1024];
    big[threadIdx.x] = 1.0f;
    __syncthreads();
    out[threadIdx.x] = big[(threadIdx.x + 1) % blockDim.x];
}

