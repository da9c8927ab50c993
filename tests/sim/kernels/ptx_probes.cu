// Test kernels for every wrapper of kernels_cu/ptx.cuh. One warp per block. Plain CUDA C that
// also compiles with NVRTC (tests/sim/test_sim_nvrtc_compile.py).
#include "ptx.cuh"

// ldmatrix: shared memory holds 16-bit values s[r][c] = r * 16 + c + 1. Lane l = 8j + r passes
// the address of row (j % 2) * 8 + r, column (j / 2) * 8 (plus offset_bytes), so matrix j of an
// .x4 load is the 8x8 block at rows (j % 2) * 8, columns (j / 2) * 8 (the usual A-fragment load).
// Every lane writes its 14 registers to out[lane * 14 ...].
extern "C" __global__ void ldmatrix_probe(unsigned* __restrict__ out, int offset_bytes) {
    __shared__ __align__(16) unsigned short s[32][16];
    const int lane = threadIdx.x;
    for (int i = lane; i < 32 * 16; i += 32) (&s[0][0])[i] = (unsigned short)(i + 1);
    __syncwarp();
    const int j = lane / 8, r = lane % 8;
    const unsigned short* row = &s[(j % 2) * 8 + r][(j / 2) * 8];
    row = reinterpret_cast<const unsigned short*>(reinterpret_cast<const char*>(row) + offset_bytes);
    unsigned a1[1], a2[2], a4[4], t1[1], t2[2], t4[4];
    ptx_ldmatrix_x1(a1, row);
    ptx_ldmatrix_x2(a2, row);
    ptx_ldmatrix_x4(a4, row);
    ptx_ldmatrix_x1_trans(t1, row);
    ptx_ldmatrix_x2_trans(t2, row);
    ptx_ldmatrix_x4_trans(t4, row);
    unsigned* o = out + lane * 14;
    o[0] = a1[0];
    o[1] = a2[0]; o[2] = a2[1];
    o[3] = a4[0]; o[4] = a4[1]; o[5] = a4[2]; o[6] = a4[3];
    o[7] = t1[0];
    o[8] = t2[0]; o[9] = t2[1];
    o[10] = t4[0]; o[11] = t4[1]; o[12] = t4[2]; o[13] = t4[3];
}

// mma with fragments loaded by the PTX ISA formulas from global memory: A (16x16 row-major),
// B (16x8 row-major, K x N), C (16x8 f32); D = A B + C written row-major. 16-bit inputs as raw bits.
__device__ __forceinline__ unsigned pack2(unsigned short lo, unsigned short hi) { return unsigned(lo) | (unsigned(hi) << 16); }

extern "C" __global__ void mma_direct(const unsigned short* __restrict__ A, const unsigned short* __restrict__ B,
                                      const float* __restrict__ C, float* __restrict__ D, int bf16) {
    const int l = threadIdx.x, g = l / 4, c = 2 * (l % 4);
    const unsigned a[4] = {pack2(A[g * 16 + c], A[g * 16 + c + 1]), pack2(A[(g + 8) * 16 + c], A[(g + 8) * 16 + c + 1]),
                           pack2(A[g * 16 + c + 8], A[g * 16 + c + 9]), pack2(A[(g + 8) * 16 + c + 8], A[(g + 8) * 16 + c + 9])};
    const unsigned b[2] = {pack2(B[c * 8 + g], B[(c + 1) * 8 + g]), pack2(B[(c + 8) * 8 + g], B[(c + 9) * 8 + g])};
    const float cc[4] = {C[g * 8 + c], C[g * 8 + c + 1], C[(g + 8) * 8 + c], C[(g + 8) * 8 + c + 1]};
    float d[4];
    if (bf16)
        ptx_mma_m16n8k16_bf16_f32(d, a, b, cc);
    else
        ptx_mma_m16n8k16_f16_f32(d, a, b, cc);
    D[g * 8 + c] = d[0]; D[g * 8 + c + 1] = d[1]; D[(g + 8) * 8 + c] = d[2]; D[(g + 8) * 8 + c + 1] = d[3];
}

// The tensor-core pipeline: cp.async A (16x16) and B^T (8x16, i.e. B column-major) into shared
// memory, wait, ldmatrix the fragments, mma (f16), write D (16x8 row-major). With skip_wait the
// wait is left out and ldmatrix reads shared memory the copies have not reached yet.
extern "C" __global__ void mma_pipeline(const __half* __restrict__ A, const __half* __restrict__ Bt,
                                        float* __restrict__ D, int skip_wait) {
    __shared__ __align__(16) __half As[16][16];
    __shared__ __align__(16) __half Bs[8][16];
    const int lane = threadIdx.x;
    ptx_cp_async_16(&As[0][0] + lane * 8, A + lane * 8);                 // 32 x 16 bytes = A
    if (lane < 16) ptx_cp_async_16(&Bs[0][0] + lane * 8, Bt + lane * 8);  // 16 x 16 bytes = B^T
    ptx_cp_async_commit();
    if (!skip_wait) ptx_cp_async_wait<0>();
    __syncwarp();
    unsigned a[4], b[2];
    ptx_ldmatrix_x4(a, &As[lane % 16][(lane / 16) * 8]);
    ptx_ldmatrix_x2(b, &Bs[lane % 8][((lane / 8) % 2) * 8]);
    const float zero[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    float d[4];
    ptx_mma_m16n8k16_f16_f32(d, a, b, zero);
    const int g = lane / 4, c = 2 * (lane % 4);
    D[g * 8 + c] = d[0]; D[g * 8 + c + 1] = d[1]; D[(g + 8) * 8 + c] = d[2]; D[(g + 8) * 8 + c + 1] = d[3];
}

// cp.async groups: two groups; wait_group<1> lands only the first. out[0..7] after wait<1>,
// out[8..15] after wait<0>, 4 floats per lane-0 copy. Lane 0 only copies; the values are read
// by lane 0 itself (cp.async visibility is per thread until a barrier).
extern "C" __global__ void cp_async_groups(const float* __restrict__ src, float* __restrict__ out, int zfill_bytes) {
    __shared__ __align__(16) float s[12];
    if (threadIdx.x == 0) {
        ptx_cp_async_16(&s[0], src);
        ptx_cp_async_commit();
        ptx_cp_async_16(&s[4], src + 4);
        ptx_cp_async_commit();
        ptx_cp_async_16_zfill(&s[8], src + 8, zfill_bytes);
        ptx_cp_async_commit();
        ptx_cp_async_wait<2>();
        for (int i = 0; i < 8; ++i) out[i] = s[i];
        ptx_cp_async_wait<0>();
        for (int i = 0; i < 12; ++i) out[8 + i] = s[i];
    }
}

// A misaligned cp.async (source offset by `offset_bytes`).
extern "C" __global__ void cp_async_misaligned(const float* __restrict__ src, float* __restrict__ out, int offset_bytes) {
    __shared__ __align__(16) float s[8];
    const char* p = reinterpret_cast<const char*>(src) + offset_bytes;
    ptx_cp_async_16(&s[0], p);
    ptx_cp_async_wait_all();
    out[threadIdx.x] = s[threadIdx.x % 4];
}

// cvt packs: out[2i] = f16x2(lo = x[2i], hi = x[2i+1]), out[2i+1] = bf16x2(same).
extern "C" __global__ void cvt_pack(const float* __restrict__ x, unsigned* __restrict__ out, int n_pairs) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_pairs) return;
    out[2 * i] = ptx_cvt_pack_f16x2(x[2 * i], x[2 * i + 1]);
    out[2 * i + 1] = ptx_cvt_pack_bf16x2(x[2 * i], x[2 * i + 1]);
}
