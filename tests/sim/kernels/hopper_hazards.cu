// Planted faults for the sm_90a hazards the simulator must report (tests/sim/test_sim_hopper.py).
// `hopper_hazard` is one warpgroup: a 64 x 64 bf16 tile A is TMA-loaded (128-byte swizzle) and
// S = A A^T computed by wgmma; `mode` plants one fault (0: none):
//   1 no wgmma.fence            2 accumulator read before wait_group   3 no mbarrier wait
//   4 smem written, no fence.proxy.async before the wgmma             5 smem written while a wgmma reads it
//   6 TMA store of smem written without fence.proxy.async            7 plain read of the mbarrier object
//   8 a phase that never completes (expects more bytes than arrive)   9 setmaxnreg of a count not a multiple of 8
//  11 transaction count over 2^20 - 1                                12 a descriptor past the allocation
//  13 a swizzled descriptor inside an atom row                       14 named barrier counts that differ
//  15 a TMA load into a tile a wgmma still reads                     16 no fence.mbarrier_init before TMA
// `hopper_regs_hazard` (three warpgroups) asks setmaxnreg.inc for more registers than any dec frees.
#include "ptx.cuh"

extern "C" __global__ void __launch_bounds__(128) hopper_hazard(const __grid_constant__ cuflash_tensor_map map_a,
                                                                const __grid_constant__ cuflash_tensor_map map_o,
                                                                float* out, int mode) {
    extern __shared__ unsigned char smem_raw[];
    __shared__ __align__(8) unsigned long long bar;
    unsigned char* a_s = smem_raw;   // (the simulator's dynamic shared memory is 1024-byte aligned)
    const int tid = threadIdx.x;
    if (tid == 0) {
        ptx_mbarrier_init(&bar, 1);
        if (mode != 16) ptx_fence_mbarrier_init();
    }
    __syncthreads();
    if (mode == 9) ptx_setmaxnreg_dec<100>();
    if (mode == 14) ptx_bar_sync(1, tid < 64 ? 64 : 128);
    if (tid == 0) {
        ptx_mbarrier_arrive_expect_tx(&bar, mode == 11 ? (1u << 20) : mode == 8 ? 8192u + 16u : 8192u);
        ptx_tma_load_2d(a_s, &map_a, 0, 0, &bar);
    }
    if (mode == 7 && tid == 1) out[0] = float(*reinterpret_cast<volatile unsigned long long*>(&bar) & 1u);
    if (mode != 3) ptx_mbarrier_wait(&bar, 0);
    if (mode == 4) {
        a_s[tid * 2] = 0;   // a generic write into the tile the wgmma reads
        __syncthreads();
    }
    float acc[32];
    for (int i = 0; i < 32; ++i) acc[i] = 0.0f;
    if (mode != 1) ptx_wgmma_fence();
    for (int kk = 0; kk < 4; ++kk) {
        unsigned long long da = ptx_wgmma_desc(a_s + kk * 32, 16, 1024, 128);
        if (mode == 12) da = ptx_wgmma_desc(a_s + 97 * 1024, 16, 1024, 128);
        if (mode == 13) da = ptx_wgmma_desc(a_s + 128, 16, 1024, 128);
        ptx_wgmma_ss<64, true, 0, 0>(acc, da, da, 1);
    }
    ptx_wgmma_commit();
    if (mode == 2) out[tid] = acc[0];
    if (mode == 5 && tid == 3) a_s[4096] = 1;
    if (mode == 15 && tid == 0) {
        ptx_mbarrier_arrive_expect_tx(&bar, 8192u);
        ptx_tma_load_2d(a_s, &map_a, 0, 0, &bar);
    }
    ptx_wgmma_wait<0>();
    for (int i = 0; i < 32; ++i) out[tid * 32 + i] = acc[i];
    if (mode == 6) {
        __syncthreads();
        if (tid == 0) {
            a_s[0] = 7;   // written, then stored by TMA with no fence.proxy.async
            ptx_tma_store_2d(&map_o, 0, 0, a_s);
            ptx_bulk_commit();
            ptx_bulk_wait<0>();
        }
    }
}

extern "C" __global__ void __launch_bounds__(384, 1) hopper_regs_hazard(int* out) {
    ptx_setmaxnreg_inc<240>();   // every warpgroup asks for more; none releases any
    out[threadIdx.x] = 1;
}
