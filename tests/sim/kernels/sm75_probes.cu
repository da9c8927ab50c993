// Test kernels for the sm_75 (Turing) form of kernels_cu/ptx.cuh, compiled by the simulator for
// sm_75 (tests/sim/test_sim_sm75.py), beside every probe of ptx_probes.cu (its mma_direct: the
// m16n8k16 wrapper, two m16n8k8 on sm_75). One warp per block.
#include "ptx_probes.cu"

// mma.m16n8k8 .f16 with fragments loaded by the PTX ISA formulas (9.7.14.5.7) from global memory:
// A (16x8 row-major), B (8x8 row-major, K x N), C (16x8 f32); D = A B + C written row-major.
// fault plants a wrong layout: 1 swaps A's two registers (rows g + 8 and g), 2 swaps the two
// elements of B's register (rows 2t + 1, 2t), 3 takes B's register from column g's transpose
// (B[g][2t..2t+1], the layout of an A-style row).
extern "C" __global__ void mma_k8_direct(const unsigned short* __restrict__ A, const unsigned short* __restrict__ B,
                                         const float* __restrict__ C, float* __restrict__ D, int fault) {
    const int l = threadIdx.x, g = l / 4, c = 2 * (l % 4);
    unsigned a[2] = {pack2(A[g * 8 + c], A[g * 8 + c + 1]), pack2(A[(g + 8) * 8 + c], A[(g + 8) * 8 + c + 1])};
    unsigned b = pack2(B[c * 8 + g], B[(c + 1) * 8 + g]);
    if (fault == 1) {
        const unsigned t = a[0];
        a[0] = a[1];
        a[1] = t;
    } else if (fault == 2) {
        b = pack2(B[(c + 1) * 8 + g], B[c * 8 + g]);
    } else if (fault == 3) {
        b = pack2(B[g * 8 + c], B[g * 8 + c + 1]);
    }
    const float cc[4] = {C[g * 8 + c], C[g * 8 + c + 1], C[(g + 8) * 8 + c], C[(g + 8) * 8 + c + 1]};
    float d[4];
    ptx_mma_m16n8k8_f16_f32(d, a, b, cc);
    D[g * 8 + c] = d[0]; D[g * 8 + c + 1] = d[1]; D[(g + 8) * 8 + c] = d[2]; D[(g + 8) * 8 + c + 1] = d[3];
}

// The copy wrappers' sm_75 form: lane l copies 16 bytes of src (src_bytes of them: 0 zero-fills)
// into shared memory and, with no wait, reads them back into out. raw issues the cp.async
// instruction itself (the emulation, which sm_75 does not have: an error).
extern "C" __global__ void sm75_copy(const float* __restrict__ src, float* __restrict__ out, int src_bytes, int raw) {
    __shared__ __align__(16) float s[32 * 4];
    const int lane = threadIdx.x;
    if (raw)
        cuflash_ptx_sim::cp_async_16(s + lane * 4, src + lane * 4, 16);
    else
        ptx_cp_async_16_zfill(s + lane * 4, src + lane * 4, src_bytes);
    ptx_cp_async_commit();
    ptx_cp_async_wait<0>();
    __syncwarp();
    for (int i = 0; i < 4; ++i) out[lane * 4 + i] = s[((lane + 1) % 32) * 4 + i];   // a neighbour's chunk
}
