// Bulk reduce-add probes (tests/sim/test_sim_bulk_reduce.py): each of the grid's blocks stages its
// slice src[block] (n floats) in shared memory and adds it into the float32 workspace ws with
// cp.reduce.async.bulk .add.f32. `mode` plants one fault (0: none):
//   1 block 1 also writes ws[0] plainly        2 the staged buffer is rewritten before wait_group.read
//   3 the issuing thread reads ws[0] before its wait_group
//   4 another thread of the block writes ws[1] between the issue and the issuer's wait_group
//     (barriers on both sides)
//   5 (no fault) the issuer waits, then after a barrier another thread reads the sum back
#include "ptx.cuh"

extern "C" __global__ void __launch_bounds__(128) bulk_reduce(const float* src, float* ws, int n, int mode) {
    __shared__ __align__(128) float tile[1024];
    const int tid = threadIdx.x;
    for (int i = tid; i < n; i += blockDim.x) tile[i] = src[blockIdx.x * n + i];
    ptx_fence_proxy_async();
    __syncthreads();
    if (tid == 0) {
        if (mode == 1 && blockIdx.x == 1) ws[0] = 1.0f;   // a plain write where other blocks reduce-add
        ptx_bulk_reduce_add_f32(ws, tile, unsigned(n) * 4u);
        ptx_bulk_commit();
        if (mode == 2) tile[0] = 0.0f;   // reused while the reduce may still read it
        if (mode == 3) {                 // read while this thread's own reduce is in flight
            volatile float sink = ws[0];
            (void)sink;
        }
    }
    __syncthreads();
    if (mode == 4 && tid == 33) ws[1] = 2.0f;   // written while thread 0's reduce is in flight
    __syncthreads();
    if (tid == 0) {
        if (mode == 5) ptx_bulk_wait<0>();   // the adds done (not only the staged buffer read)
        else ptx_bulk_wait_read<0>();
    }
    if (mode == 5) {
        __syncthreads();
        if (tid == 33) tile[2] = ws[0];   // after the issuer's wait and a barrier: ordered
    }
}
