// Probes of the simulator's layouts against images built independently in Python
// (tests/sim/test_sim_hopper_layouts.py): what a TMA load leaves in shared memory, what a TMA store
// takes from it, and which elements a wgmma reads through descriptors the test encodes itself.
#include "ptx.cuh"

// The box at (c0, c1) of `map`, loaded by TMA, copied out byte for byte (`bytes` of it).
extern "C" __global__ void __launch_bounds__(128) tma_raw_load(const __grid_constant__ cuflash_tensor_map map,
                                                               unsigned char* out, int bytes, int c0, int c1) {
    extern __shared__ unsigned char smem[];
    __shared__ __align__(8) unsigned long long bar;
    if (threadIdx.x == 0) {
        ptx_mbarrier_init(&bar, 1);
        ptx_fence_mbarrier_init();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        ptx_mbarrier_arrive_expect_tx(&bar, unsigned(bytes));
        ptx_tma_load_2d(smem, &map, c0, c1, &bar);
    }
    ptx_mbarrier_wait(&bar, 0);
    for (int i = threadIdx.x; i < bytes; i += blockDim.x) out[i] = smem[i];
}

// A shared-memory image written by the threads, stored by TMA as the box at (c0, c1) of `map`.
extern "C" __global__ void __launch_bounds__(128) tma_raw_store(const __grid_constant__ cuflash_tensor_map map,
                                                                const unsigned char* image, int bytes, int c0, int c1) {
    extern __shared__ unsigned char smem[];
    for (int i = threadIdx.x; i < bytes; i += blockDim.x) smem[i] = image[i];
    ptx_fence_proxy_async();
    __syncthreads();
    if (threadIdx.x == 0) {
        ptx_tma_store_2d(&map, c0, c1, smem);
        ptx_bulk_commit();
        ptx_bulk_wait<0>();
    }
}

// D (64 x N) = sum over k16 steps of A B, both operands from shared-memory images the threads copy
// in, through descriptors the test encodes (start offsets relative to the images' base).
template <int N, int TRANS_B>
__device__ void wgmma_raw_impl(const unsigned char* img_a, const unsigned char* img_b, int bytes_a, int bytes_b,
                               const unsigned long long* desc_a, const unsigned long long* desc_b, int ksteps,
                               float* out) {
    extern __shared__ unsigned char smem[];
    unsigned char* a_s = smem;
    unsigned char* b_s = smem + 64 * 1024;
    for (int i = threadIdx.x; i < bytes_a; i += blockDim.x) a_s[i] = img_a[i];
    for (int i = threadIdx.x; i < bytes_b; i += blockDim.x) b_s[i] = img_b[i];
    ptx_fence_proxy_async();
    __syncthreads();
    float acc[N / 2];
    for (int i = 0; i < N / 2; ++i) acc[i] = 0.0f;
    ptx_wgmma_fence();
    for (int kk = 0; kk < ksteps; ++kk)
        ptx_wgmma_ss<N, true, 0, TRANS_B>(acc, desc_a[kk] + (ptx_smem_addr(a_s) >> 4), desc_b[kk] + (ptx_smem_addr(b_s) >> 4), 1);
    ptx_wgmma_commit();
    ptx_wgmma_wait<0>();
    for (int i = 0; i < N / 2; ++i) out[threadIdx.x * (N / 2) + i] = acc[i];
}

// (N = 64 here; wgmma_raw_n<N> below for the other widths the attention kernels use)
extern "C" __global__ void __launch_bounds__(128) wgmma_raw(const unsigned char* img_a, const unsigned char* img_b,
                                                            int bytes_a, int bytes_b, const unsigned long long* desc_a,
                                                            const unsigned long long* desc_b, int ksteps, int trans_b,
                                                            float* out) {
    if (trans_b) wgmma_raw_impl<64, 1>(img_a, img_b, bytes_a, bytes_b, desc_a, desc_b, ksteps, out);
    else wgmma_raw_impl<64, 0>(img_a, img_b, bytes_a, bytes_b, desc_a, desc_b, ksteps, out);
}

#define WGMMA_RAW_ARGS const unsigned char* img_a, const unsigned char* img_b, int bytes_a, int bytes_b, const unsigned long long* desc_a, const unsigned long long* desc_b, int ksteps, int trans_b, float* out
#define WGMMA_RAW_BODY(N) if (trans_b) wgmma_raw_impl<N, 1>(img_a, img_b, bytes_a, bytes_b, desc_a, desc_b, ksteps, out); else wgmma_raw_impl<N, 0>(img_a, img_b, bytes_a, bytes_b, desc_a, desc_b, ksteps, out);
extern "C" __global__ void __launch_bounds__(128) wgmma_raw_n16(WGMMA_RAW_ARGS) { WGMMA_RAW_BODY(16) }
extern "C" __global__ void __launch_bounds__(128) wgmma_raw_n96(WGMMA_RAW_ARGS) { WGMMA_RAW_BODY(96) }
extern "C" __global__ void __launch_bounds__(128) wgmma_raw_n128(WGMMA_RAW_ARGS) { WGMMA_RAW_BODY(128) }
extern "C" __global__ void __launch_bounds__(128) wgmma_raw_n192(WGMMA_RAW_ARGS) { WGMMA_RAW_BODY(192) }
extern "C" __global__ void __launch_bounds__(128) wgmma_raw_n256(WGMMA_RAW_ARGS) { WGMMA_RAW_BODY(256) }
#undef WGMMA_RAW_BODY
#undef WGMMA_RAW_ARGS

// Each of `nops` wgmma m64nNk16 on its own zeroed accumulator, one after another, over one shared-memory
// image (copied in at a 1024-byte-aligned base): op i takes its descriptors' start fields relative to
// that base (desc_a[i], desc_b[i]), A from registers when bit 1 of flags[i] is set (thread t's four
// registers a_regs[4 * (128 * i + t) ..]), B N-major when bit 0 is set, A M-major when bit 2 is.
// out[(128 * i + t) * N / 2 + r] is thread t's accumulator register r.
template <int N>
__device__ void wgmma_each_impl(const unsigned char* img, int bytes, const unsigned long long* desc_a,
                                const unsigned long long* desc_b, const unsigned* a_regs, const int* flags, int nops,
                                float* out) {
    extern __shared__ unsigned char smem_raw[];
    unsigned char* s = ptx_align_smem_1024(smem_raw);
    for (int i = threadIdx.x; i < bytes; i += blockDim.x) s[i] = img[i];
    ptx_fence_proxy_async();
    __syncthreads();
    const unsigned long long base = ptx_smem_addr(s) >> 4;
    for (int op = 0; op < nops; ++op) {
        float acc[N / 2];
        for (int i = 0; i < N / 2; ++i) acc[i] = 0.0f;
        unsigned a[4];
        for (int r = 0; r < 4; ++r) a[r] = a_regs[4 * (128 * op + threadIdx.x) + r];
        const unsigned long long da = desc_a[op] + base, db = desc_b[op] + base;
        ptx_wgmma_fence();
        switch (flags[op]) {
        case 0: ptx_wgmma_ss<N, true, 0, 0>(acc, da, db, 0); break;
        case 1: ptx_wgmma_ss<N, true, 0, 1>(acc, da, db, 0); break;
        case 2: ptx_wgmma_rs<N, true, 0>(acc, a, db, 0); break;
        case 3: ptx_wgmma_rs<N, true, 1>(acc, a, db, 0); break;
        case 4: ptx_wgmma_ss<N, true, 1, 0>(acc, da, db, 0); break;
        default: ptx_wgmma_ss<N, true, 1, 1>(acc, da, db, 0); break;
        }
        ptx_wgmma_commit();
        ptx_wgmma_wait<0>();
        for (int i = 0; i < N / 2; ++i) out[(128 * op + threadIdx.x) * (N / 2) + i] = acc[i];
    }
}

#define WGMMA_EACH_ARGS const unsigned char* img, int bytes, const unsigned long long* desc_a, const unsigned long long* desc_b, const unsigned* a_regs, const int* flags, int nops, float* out
#define WGMMA_EACH_BODY(N) wgmma_each_impl<N>(img, bytes, desc_a, desc_b, a_regs, flags, nops, out);
extern "C" __global__ void __launch_bounds__(128) wgmma_each_n16(WGMMA_EACH_ARGS) { WGMMA_EACH_BODY(16) }
extern "C" __global__ void __launch_bounds__(128) wgmma_each_n32(WGMMA_EACH_ARGS) { WGMMA_EACH_BODY(32) }   // (the Hopper backward's dQ half at d64)
extern "C" __global__ void __launch_bounds__(128) wgmma_each_n64(WGMMA_EACH_ARGS) { WGMMA_EACH_BODY(64) }
extern "C" __global__ void __launch_bounds__(128) wgmma_each_n80(WGMMA_EACH_ARGS) { WGMMA_EACH_BODY(80) }
extern "C" __global__ void __launch_bounds__(128) wgmma_each_n96(WGMMA_EACH_ARGS) { WGMMA_EACH_BODY(96) }
extern "C" __global__ void __launch_bounds__(128) wgmma_each_n112(WGMMA_EACH_ARGS) { WGMMA_EACH_BODY(112) }
extern "C" __global__ void __launch_bounds__(128) wgmma_each_n128(WGMMA_EACH_ARGS) { WGMMA_EACH_BODY(128) }
extern "C" __global__ void __launch_bounds__(128) wgmma_each_n192(WGMMA_EACH_ARGS) { WGMMA_EACH_BODY(192) }
extern "C" __global__ void __launch_bounds__(128) wgmma_each_n256(WGMMA_EACH_ARGS) { WGMMA_EACH_BODY(256) }
#undef WGMMA_EACH_BODY
#undef WGMMA_EACH_ARGS

// ldmatrix / stmatrix with any row addresses: lane l gives the shared row at byte rows[l] of an
// image (copied in, 16-byte rows); ldsm_each writes each lane's registers of x1, x2, x4 and their
// .trans forms to out[lane * 14 ..]; stsm_each stores lane l's registers regs[4 * l ..] by the
// form `form` (0..5: x1, x2, x4, x1.trans, x2.trans, x4.trans) and copies the image out.
extern "C" __global__ void __launch_bounds__(32) ldsm_each(const unsigned char* img, int bytes, const int* rows,
                                                          unsigned* out) {
    extern __shared__ __align__(16) unsigned char sm[];
    for (int i = threadIdx.x; i < bytes; i += 32) sm[i] = img[i];
    __syncwarp();
    const void* row = sm + rows[threadIdx.x];
    unsigned a1[1], a2[2], a4[4], t1[1], t2[2], t4[4];
    ptx_ldmatrix_x1(a1, row);
    ptx_ldmatrix_x2(a2, row);
    ptx_ldmatrix_x4(a4, row);
    ptx_ldmatrix_x1_trans(t1, row);
    ptx_ldmatrix_x2_trans(t2, row);
    ptx_ldmatrix_x4_trans(t4, row);
    const unsigned all[14] = {a1[0], a2[0], a2[1], a4[0], a4[1], a4[2], a4[3], t1[0], t2[0], t2[1], t4[0], t4[1], t4[2], t4[3]};
    for (int i = 0; i < 14; ++i) out[threadIdx.x * 14 + i] = all[i];
}

extern "C" __global__ void __launch_bounds__(32) stsm_each(unsigned char* img, int bytes, const int* rows,
                                                          const unsigned* regs, int form) {
    extern __shared__ __align__(16) unsigned char sm[];
    for (int i = threadIdx.x; i < bytes; i += 32) sm[i] = img[i];
    __syncwarp();
    void* row = sm + rows[threadIdx.x];
    const unsigned* r = regs + 4 * threadIdx.x;
    const unsigned r1[1] = {r[0]}, r2[2] = {r[0], r[1]}, r4[4] = {r[0], r[1], r[2], r[3]};
    if (form == 0) ptx_stmatrix_x1(row, r1);
    if (form == 1) ptx_stmatrix_x2(row, r2);
    if (form == 2) ptx_stmatrix_x4(row, r4);
    if (form == 3) ptx_stmatrix_x1_trans(row, r1);
    if (form == 4) ptx_stmatrix_x2_trans(row, r2);
    if (form == 5) ptx_stmatrix_x4_trans(row, r4);
    __syncwarp();
    for (int i = threadIdx.x; i < bytes; i += 32) img[i] = sm[i];
}
