// cuflash: probes of the sm_90a instructions of ptx.cuh, small kernels that use nothing else, so
// that the simulator's emulation (cuflash/sim/cusim_sm90.h) and a GPU can be compared on them
// (tests/sim/test_sim_hopper.py; `python -m cuflash check` on an H200).
//
//   hopper_gemm_ss_<swizzle>_<kmajor|nmajor>: C (M x 64, f32) = A (M x K) B, bf16. TMA loads A
//       (K-major) and B (K-major: B stored N x K; N-major: stored K x N, as V is in O = P V) into
//       shared memory with the swizzle, one mbarrier, one warpgroup runs wgmma with both operands
//       from descriptors, K / 16 steps chained on one accumulator.
//   hopper_gemm_rs_<swizzle>_<kmajor|nmajor>: the same with A from registers (each thread loads its
//       fragment from global memory).
//   hopper_pipeline: warp specialization: warpgroup 0 is the producer (setmaxnreg.dec, one elected
//       thread issues TMA loads into a 2-stage ring guarded by "full" and "empty" mbarriers),
//       warpgroups 1 and 2 are consumers (setmaxnreg.inc) of 64 rows each; the epilogue stages C
//       in shared memory (fence.proxy.async, a named barrier) and one thread stores it by TMA.
//   stmatrix_probe, elect_probe: stmatrix x1/x2/x4 (+ .trans), elect.sync.
//   hopper_gemm_e4m3_<ss|rs>: C (M x 64, f32) = A (M x K) B^T, A and B float8_e4m3fn, B stored
//       64 x K: wgmma m64n64k32 .e4m3.e4m3, both operands K-major (the only layout the PTX ISA
//       gives fp8 operands), A from a descriptor or from registers (four e4m3 per register).
//
// Shapes: K a multiple of 64 up to 256; M any (the tensor maps zero-fill rows past M on load and
// drop them on store); a block per 64 (gemm) or 128 (pipeline) rows.
#include "ptx.cuh"

#if __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)

namespace hopper_probe {

constexpr int BN = 64;         // N of every probe GEMM
constexpr int MAX_K = 256;

// Elements of one swizzle panel's row: the swizzle span (bf16), or one 16-byte chunk without one.
template <int SW>
constexpr int panel() { return SW ? SW / 2 : 8; }


// Descriptor of the k16 slice `kk` of a K-major operand of `rows` rows stored as K / W panels of
// rows x W elements (PTX ISA "Shared Memory Matrix Layout": with a swizzle, rows of SW bytes, 8
// rows per atom, SBO = 8 * SW, LBO unused; without, 8 x 16-byte core matrices, SBO = 128 between
// 8-row groups, LBO = the next panel along K).
template <int SW>
__device__ __forceinline__ unsigned long long desc_kmajor(const unsigned char* base, int rows, int kk) {
    constexpr int W = panel<SW>();
    const int k0 = kk * 16, p = k0 / W, inner = k0 % W;
    const unsigned char* start = base + p * rows * W * 2 + inner * 2;
    return SW ? ptx_wgmma_desc(start, 16, 8 * SW, SW) : ptx_wgmma_desc(start, rows * 16, 128, 0);
}

// Descriptor of the k16 slice of an N-major operand (K rows of BN elements) stored as BN / W panels
// of K rows x W elements: with a swizzle, K-rows of SW bytes, 8 per atom (SBO = 8 * SW), the next
// panel along N at LBO = K * SW; without, core matrices of 8 K-rows x 16 bytes, LBO = 128 to the
// next 8 K-rows, SBO = K * 16 to the next 8 columns.
template <int SW>
__device__ __forceinline__ unsigned long long desc_nmajor(const unsigned char* base, int K, int kk) {
    const int k0 = kk * 16;
    return SW ? ptx_wgmma_desc(base + k0 * SW, K * SW, 8 * SW, SW) : ptx_wgmma_desc(base + k0 * 16, 128, K * 16, 0);
}

// Loads of A (64 rows from m0) and B into shared memory through TMA, completing on `bar`. A's map:
// (M, K) with box (64, W); B's: (N, K) box (BN, W) K-major, or (K, N) box (K, W) N-major.
template <int SW, bool NMAJOR>
__device__ __forceinline__ void load_operands(unsigned char* a_s, unsigned char* b_s, const cuflash_tensor_map* map_a,
                                              const cuflash_tensor_map* map_b, int m0, int K, bool with_a,
                                              unsigned long long* bar) {
    constexpr int W = panel<SW>();
    const unsigned bytes = (with_a ? 64 * K * 2 : 0) + BN * K * 2;
    ptx_mbarrier_arrive_expect_tx(bar, bytes);
    if (with_a)
        for (int p = 0; p < K / W; ++p) ptx_tma_load_2d(a_s + p * 64 * W * 2, map_a, p * W, m0, bar);
    if (!NMAJOR) {
        for (int p = 0; p < K / W; ++p) ptx_tma_load_2d(b_s + p * BN * W * 2, map_b, p * W, 0, bar);
    } else {
        for (int p = 0; p < BN / W; ++p) ptx_tma_load_2d(b_s + p * K * W * 2, map_b, p * W, 0, bar);
    }
}

// C rows m0.. from the accumulator fragment: d[i] = D[16j + g + 8 * ((i % 4) / 2)][8 * (i / 4) + 2t + i % 2].
__device__ __forceinline__ void store_fragment(const float (&acc)[BN / 2], float* C, int M, int m0) {
    const int tid = threadIdx.x % 128, j = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    for (int i = 0; i < BN / 2; ++i) {
        const int row = m0 + 16 * j + g + 8 * ((i % 4) / 2), col = 8 * (i / 4) + 2 * t + i % 2;
        if (row < M) C[row * BN + col] = acc[i];
    }
}

template <int SW, bool NMAJOR, bool A_REGS>
__device__ void gemm(const cuflash_tensor_map& map_a, const cuflash_tensor_map& map_b,
                     const unsigned short* A, float* C, int M, int K) {
    extern __shared__ unsigned char smem_raw[];
    __shared__ __align__(8) unsigned long long bar;
    unsigned char* a_s = ptx_align_smem_1024(smem_raw);
    unsigned char* b_s = a_s + 64 * MAX_K * 2;
    const int m0 = blockIdx.x * 64;
    if (threadIdx.x == 0) {
        ptx_mbarrier_init(&bar, 1);
        ptx_fence_mbarrier_init();
    }
    __syncthreads();
    if (threadIdx.x == 0) load_operands<SW, NMAJOR>(a_s, b_s, &map_a, &map_b, m0, K, !A_REGS, &bar);
    float acc[BN / 2];
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0.0f;
    ptx_mbarrier_wait(&bar, 0);
    const int tid = threadIdx.x, j = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    // A from registers: every k16 slice's fragment, loaded before the first wgmma (a wgmma's A
    // registers may not change until its wait_group), mma.m16n8k16's A layout for rows 16j..,
    // zero past M: a0 (g, 2t), a1 (g + 8, 2t), a2 (g, 2t + 8), a3 (g + 8, 2t + 8).
    unsigned a[A_REGS ? MAX_K / 16 : 1][4];
    if (A_REGS)
        for (int kk = 0; kk < K / 16; ++kk)
            for (int r = 0; r < 4; ++r) {
                const int row = m0 + 16 * j + g + 8 * (r % 2), col = kk * 16 + 2 * t + 8 * (r / 2);
                a[kk][r] = row < M ? unsigned(A[row * K + col]) | (unsigned(A[row * K + col + 1]) << 16) : 0u;
            }
    ptx_wgmma_fence();
    for (int kk = 0; kk < K / 16; ++kk) {
        const unsigned long long db = NMAJOR ? desc_nmajor<SW>(b_s, K, kk) : desc_kmajor<SW>(b_s, BN, kk);
        if (A_REGS) {
            ptx_wgmma_rs<BN, true, NMAJOR ? 1 : 0>(acc, a[A_REGS ? kk : 0], db, 1);
        } else {
            ptx_wgmma_ss<BN, true, 0, NMAJOR ? 1 : 0>(acc, desc_kmajor<SW>(a_s, 64, kk), db, 1);
        }
    }
    ptx_wgmma_commit();
    ptx_wgmma_wait<0>();
    store_fragment(acc, C, M, m0);
}

// ---------------------------------------------------------------- warp-specialized pipeline
constexpr int PIPE_BM = 128, PIPE_BK = 64, PIPE_STAGES = 2;
constexpr int PIPE_A_BYTES = PIPE_BM * PIPE_BK * 2, PIPE_B_BYTES = BN * PIPE_BK * 2;

__device__ void pipeline(const cuflash_tensor_map& map_a, const cuflash_tensor_map& map_b,
                         const cuflash_tensor_map& map_c, int K) {
    extern __shared__ unsigned char smem_raw[];
    __shared__ __align__(8) unsigned long long full[PIPE_STAGES];
    __shared__ __align__(8) unsigned long long empty[PIPE_STAGES];
    unsigned char* a_s = ptx_align_smem_1024(smem_raw);                  // [stage][128 rows][64] bf16, 128 B swizzle
    unsigned char* b_s = a_s + PIPE_STAGES * PIPE_A_BYTES;          // [stage][64 rows][64] bf16
    float* c_s = reinterpret_cast<float*>(b_s + PIPE_STAGES * PIPE_B_BYTES);   // [128][64] f32
    const int m0 = blockIdx.x * PIPE_BM, ktiles = K / PIPE_BK;
    const int wg = threadIdx.x / 128;
    if (threadIdx.x == 0) {
        for (int s = 0; s < PIPE_STAGES; ++s) {
            ptx_mbarrier_init(&full[s], 1);
            ptx_mbarrier_init(&empty[s], 2);   // one arrival per consumer warpgroup
        }
        ptx_fence_mbarrier_init();
    }
    __syncthreads();
    if (wg == 0) {   // producer
        ptx_setmaxnreg_dec<40>();
        if (threadIdx.x / 32 == 0 && ptx_elect_one()) {
            for (int kt = 0; kt < ktiles; ++kt) {
                const int s = kt % PIPE_STAGES;
                if (kt >= PIPE_STAGES) ptx_mbarrier_wait(&empty[s], ((kt / PIPE_STAGES) - 1) & 1);
                ptx_mbarrier_arrive_expect_tx(&full[s], PIPE_A_BYTES + PIPE_B_BYTES);
                ptx_tma_load_2d(a_s + s * PIPE_A_BYTES, &map_a, kt * PIPE_BK, m0, &full[s]);
                ptx_tma_load_2d(b_s + s * PIPE_B_BYTES, &map_b, kt * PIPE_BK, 0, &full[s]);
            }
        }
        return;
    }
    ptx_setmaxnreg_inc<232>();
    const int row0 = (wg - 1) * 64;   // this consumer's rows of the tile
    float acc[BN / 2];
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0.0f;
    for (int kt = 0; kt < ktiles; ++kt) {
        const int s = kt % PIPE_STAGES;
        ptx_mbarrier_wait(&full[s], (kt / PIPE_STAGES) & 1);
        ptx_wgmma_fence();
        for (int kk = 0; kk < PIPE_BK / 16; ++kk)
            ptx_wgmma_ss<BN, true, 0, 0>(acc, desc_kmajor<128>(a_s + s * PIPE_A_BYTES + row0 * 128, 64, kk),
                                         desc_kmajor<128>(b_s + s * PIPE_B_BYTES, BN, kk), 1);
        ptx_wgmma_commit();
        ptx_wgmma_wait<0>();
        if (threadIdx.x % 128 == 0) ptx_mbarrier_arrive(&empty[s]);
    }
    // epilogue: the fragment into c_s, then one TMA store of the 128 x 64 box
    const int tid = threadIdx.x % 128, j = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    for (int i = 0; i < BN / 2; ++i)
        c_s[(row0 + 16 * j + g + 8 * ((i % 4) / 2)) * BN + 8 * (i / 4) + 2 * t + i % 2] = acc[i];
    ptx_fence_proxy_async();
    ptx_bar_sync(1, 256);
    if (threadIdx.x == 128) {
        ptx_tma_store_2d(&map_c, 0, m0, c_s);
        ptx_bulk_commit();
        ptx_bulk_wait<0>();
    }
}

// The e4m3 probes: TMA puts each operand in shared memory in the no-swizzle K-major canonical
// layout of 1-byte elements (PTX ISA "Shared Memory Matrix Layout": core matrices of 8 rows x 16
// bytes; one box of `rows` x 16 bytes per 16 K-elements, so element (r, k) lies at (k / 16) rows
// 16 + r 16 + k % 16: SBO = 128 between 8-row groups, LBO = rows * 16 to the next 16 K-bytes), one
// mbarrier, and one warpgroup chains K / 32 wgmma on one accumulator. A from registers:
// mma.m16n8k32's 8-bit A fragment for rows 16j.., the lowest column in the low byte: a0 (g,
// 4t..4t+3), a1 (g + 8, 4t..), a2 (g, 4t + 16..), a3 (g + 8, 4t + 16..).
__device__ __forceinline__ unsigned long long desc_e4m3(const unsigned char* base, int rows, int kk) {
    return ptx_wgmma_desc(base + 2 * kk * rows * 16, rows * 16, 128, 0);
}

template <bool A_REGS>
__device__ void gemm_e4m3(const cuflash_tensor_map& map_a, const cuflash_tensor_map& map_b, const unsigned char* A,
                          float* C, int M, int K) {
    extern __shared__ unsigned char smem_raw[];
    __shared__ __align__(8) unsigned long long bar;
    unsigned char* a_s = ptx_align_smem_1024(smem_raw);
    unsigned char* b_s = a_s + 64 * MAX_K;
    const int m0 = blockIdx.x * 64;
    if (threadIdx.x == 0) {
        ptx_mbarrier_init(&bar, 1);
        ptx_fence_mbarrier_init();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        ptx_mbarrier_arrive_expect_tx(&bar, (A_REGS ? 0 : 64 * K) + BN * K);
        for (int p = 0; p < K / 16; ++p) {
            if (!A_REGS) ptx_tma_load_2d(a_s + p * 64 * 16, &map_a, p * 16, m0, &bar);
            ptx_tma_load_2d(b_s + p * BN * 16, &map_b, p * 16, 0, &bar);
        }
    }
    float acc[BN / 2];
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0.0f;
    const int tid = threadIdx.x, j = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    unsigned a[A_REGS ? MAX_K / 32 : 1][4];
    if (A_REGS)
        for (int kk = 0; kk < K / 32; ++kk)
            for (int r = 0; r < 4; ++r) {
                const int row = m0 + 16 * j + g + 8 * (r % 2), col = kk * 32 + 4 * t + 16 * (r / 2);
                unsigned w = 0;
                for (int e = 0; e < 4; ++e) w |= unsigned(row < M ? A[(long long)row * K + col + e] : 0) << (8 * e);
                a[kk][r] = w;
            }
    ptx_mbarrier_wait(&bar, 0);
    ptx_wgmma_fence();
    for (int kk = 0; kk < K / 32; ++kk) {
        if (A_REGS) ptx_wgmma_rs_e4m3<BN>(acc, a[A_REGS ? kk : 0], desc_e4m3(b_s, BN, kk), 1);
        else ptx_wgmma_ss_e4m3<BN>(acc, desc_e4m3(a_s, 64, kk), desc_e4m3(b_s, BN, kk), 1);
    }
    ptx_wgmma_commit();
    ptx_wgmma_wait<0>();
    store_fragment(acc, C, M, m0);
}

}  // namespace hopper_probe

// (one line per entry: the launcher and NVRTC find entries by their extern "C" declarations)
#define HOPPER_GEMM_ARGS const __grid_constant__ cuflash_tensor_map map_a, const __grid_constant__ cuflash_tensor_map map_b, const unsigned short* A, float* C, int M, int K
extern "C" __global__ void __launch_bounds__(128) hopper_gemm_ss_0_kmajor(HOPPER_GEMM_ARGS) { hopper_probe::gemm<0, false, false>(map_a, map_b, A, C, M, K); }
extern "C" __global__ void __launch_bounds__(128) hopper_gemm_ss_32_kmajor(HOPPER_GEMM_ARGS) { hopper_probe::gemm<32, false, false>(map_a, map_b, A, C, M, K); }
extern "C" __global__ void __launch_bounds__(128) hopper_gemm_ss_64_kmajor(HOPPER_GEMM_ARGS) { hopper_probe::gemm<64, false, false>(map_a, map_b, A, C, M, K); }
extern "C" __global__ void __launch_bounds__(128) hopper_gemm_ss_128_kmajor(HOPPER_GEMM_ARGS) { hopper_probe::gemm<128, false, false>(map_a, map_b, A, C, M, K); }
extern "C" __global__ void __launch_bounds__(128) hopper_gemm_ss_0_nmajor(HOPPER_GEMM_ARGS) { hopper_probe::gemm<0, true, false>(map_a, map_b, A, C, M, K); }
extern "C" __global__ void __launch_bounds__(128) hopper_gemm_ss_32_nmajor(HOPPER_GEMM_ARGS) { hopper_probe::gemm<32, true, false>(map_a, map_b, A, C, M, K); }
extern "C" __global__ void __launch_bounds__(128) hopper_gemm_ss_64_nmajor(HOPPER_GEMM_ARGS) { hopper_probe::gemm<64, true, false>(map_a, map_b, A, C, M, K); }
extern "C" __global__ void __launch_bounds__(128) hopper_gemm_ss_128_nmajor(HOPPER_GEMM_ARGS) { hopper_probe::gemm<128, true, false>(map_a, map_b, A, C, M, K); }
extern "C" __global__ void __launch_bounds__(128) hopper_gemm_rs_128_kmajor(HOPPER_GEMM_ARGS) { hopper_probe::gemm<128, false, true>(map_a, map_b, A, C, M, K); }
extern "C" __global__ void __launch_bounds__(128) hopper_gemm_rs_128_nmajor(HOPPER_GEMM_ARGS) { hopper_probe::gemm<128, true, true>(map_a, map_b, A, C, M, K); }
extern "C" __global__ void __launch_bounds__(128) hopper_gemm_rs_0_nmajor(HOPPER_GEMM_ARGS) { hopper_probe::gemm<0, true, true>(map_a, map_b, A, C, M, K); }
#undef HOPPER_GEMM_ARGS

extern "C" __global__ void __launch_bounds__(384, 1) hopper_pipeline(const __grid_constant__ cuflash_tensor_map map_a,
                                                                     const __grid_constant__ cuflash_tensor_map map_b,
                                                                     const __grid_constant__ cuflash_tensor_map map_c, int K) {
    hopper_probe::pipeline(map_a, map_b, map_c, K);
}

// One warp: r[j] holds lo = 0x100 * (lane + 1) + j, hi = lo + 0x4000 in each lane, stored by stmatrix x1, x2, x4 and their
// .trans forms into 16 x 16 tiles (matrix j at rows (j % 2) * 8, columns (j / 2) * 8), copied out.
extern "C" __global__ void __launch_bounds__(32) stmatrix_probe(unsigned short* out) {
    __shared__ __align__(16) unsigned short tile[6][16][16];
    const int lane = threadIdx.x;
    for (int i = lane; i < 6 * 256; i += 32) (&tile[0][0][0])[i] = 0;
    __syncwarp();
    unsigned r[4];
    for (int j = 0; j < 4; ++j) r[j] = (0x100u * unsigned(lane + 1) + unsigned(j)) * 0x10001u + 0x40000000u;
    const int mat = lane / 8, row = lane % 8;   // lanes 8j..8j+7: the rows of matrix j
    for (int v = 0; v < 6; ++v) {
        const int x = v % 3 == 0 ? 1 : v % 3 == 1 ? 2 : 4;
        void* addr = &tile[v][(mat % 2) * 8 + row][(mat / 2) * 8];
        if (mat >= x) addr = &tile[v][row][0];   // (lanes beyond the x matrices: any aligned address)
        const unsigned r1[1] = {r[0]}, r2[2] = {r[0], r[1]};
        if (v == 0) ptx_stmatrix_x1(addr, r1);
        if (v == 1) ptx_stmatrix_x2(addr, r2);
        if (v == 2) ptx_stmatrix_x4(addr, r);
        if (v == 3) ptx_stmatrix_x1_trans(addr, r1);
        if (v == 4) ptx_stmatrix_x2_trans(addr, r2);
        if (v == 5) ptx_stmatrix_x4_trans(addr, r);
    }
    __syncwarp();
    for (int i = lane; i < 6 * 256; i += 32) out[i] = (&tile[0][0][0])[i];
}

// Per warp: the lane elect.sync picks writes its lane id; every lane counts the winners it saw.
extern "C" __global__ void __launch_bounds__(128) elect_probe(int* leader, int* winners) {
    const bool me = ptx_elect_one();
    if (me) leader[threadIdx.x / 32] = threadIdx.x % 32;
    const unsigned votes = __ballot_sync(0xffffffffu, me);
    winners[threadIdx.x] = __popc(votes);
}

#define HOPPER_GEMM_E4M3_ARGS const __grid_constant__ cuflash_tensor_map map_a, const __grid_constant__ cuflash_tensor_map map_b, const unsigned char* A, float* C, int M, int K
extern "C" __global__ void __launch_bounds__(128) hopper_gemm_e4m3_ss(HOPPER_GEMM_E4M3_ARGS) { hopper_probe::gemm_e4m3<false>(map_a, map_b, A, C, M, K); }
extern "C" __global__ void __launch_bounds__(128) hopper_gemm_e4m3_rs(HOPPER_GEMM_E4M3_ARGS) { hopper_probe::gemm_e4m3<true>(map_a, map_b, A, C, M, K); }

#endif  // sm_90a
