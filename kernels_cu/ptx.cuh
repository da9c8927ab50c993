// cuflash: every inline PTX instruction the kernels use, each beside its CPU emulation.
//
// Kernels never write asm elsewhere. Three branches per instruction:
//   CUFLASH_SIM            the CUDA simulator (cuflash/sim): a warp-wide emulation that follows
//                          the fragment layouts of the PTX ISA (sections "Warp-level matrix load
//                          instruction: ldmatrix", "Matrix Fragments for mma.m16n8k16 with
//                          floating point type", "Data Movement and Conversion Instructions:
//                          cp.async", "cvt");
//   __CUDA_ARCH__ >= 800   the PTX instruction itself;
//   otherwise (sm_75)      an equivalent built from sm_75 instructions, or __trap() where none
//                          exists (bf16 mma), so every file still compiles for every target.
//
// Fragment conventions (lane = threadIdx.x % 32, g = lane / 4, t = lane % 4), 16-bit elements are
// packed two per 32-bit register, the lower-indexed element in the low half:
//   mma m16n8k16 A (16x16, row-major): a[0] = A[g][2t..2t+1], a[1] = A[g+8][2t..2t+1],
//                                      a[2] = A[g][2t+8..2t+9], a[3] = A[g+8][2t+8..2t+9]
//   mma m16n8k16 B (16x8, "col"):      b[0] = B[2t..2t+1][g], b[1] = B[2t+8..2t+9][g]
//   C / D (16x8, f32):                 c[0..1] = C[g][2t..2t+1], c[2..3] = C[g+8][2t..2t+1]
//   ldmatrix m8n8 (x1/x2/x4): lanes 8j..8j+7 give the 16-byte-aligned shared-memory addresses
//     of the 8 rows of matrix j; r[j] of a lane holds row g, columns 2t..2t+1 of matrix j
//     (.trans: rows 2t..2t+1 of column g, i.e. the transposed matrix).
//
// Simulator strictness: a cp.async copy lands, by the launch's seed, either at once or only at
// the cp.async.wait_group that covers it (the two ends of what a GPU may do: a buffer refilled
// while others still read it, or read before its wait, gives a wrong result under some seed);
// in checked mode its bytes are "in flight" from issue to that wait and any access to them is
// an error (cusim.h: check_async_issue). cp.async and ldmatrix addresses must
// be 16-byte aligned and in the right state space; an mma is computed once per warp, by the last
// lane to arrive, from all 32 lanes' fragments.
#pragma once

#include "common.cuh"

// CUFLASH_SM75_FORM: the tensor-core wrappers in their sm_75 (Turing) form: m16n8k16 .f16 as two
// m16n8k8, the cp.async wrappers as register-staged synchronous copies (the section "sm_75 form"
// below). On by itself below sm_80; a build for a newer arch may define it to 1 to run the Turing
// form where its instructions also exist (m16n8k8, ldmatrix: sm_75+).
#if !defined(CUFLASH_SM75_FORM)
#if __CUDA_ARCH__ < 800
#define CUFLASH_SM75_FORM 1
#else
#define CUFLASH_SM75_FORM 0
#endif
#endif

// ---------------------------------------------------------------- sm_90a (Hopper) instructions
// Beside the Ampere set: wgmma (PTX ISA 9.7.15 "Asynchronous Warpgroup Level Matrix Multiply-
// Accumulate"), mbarrier (9.7.13.15), TMA (9.7.9.25 "cp.async.bulk.tensor"), bulk groups
// (9.7.9.26/27), fence.proxy.async (9.7.13.4 "membar/fence"), named barriers (9.7.13.1
// "bar.sync / bar.arrive"), setmaxnreg (9.7.17.1), elect.sync (9.7.13.10), stmatrix (9.7.14.5.16).
// The simulator's emulations live in cuflash/sim/cusim_sm90.h; each wrapper here names its PTX.
//
// wgmma m64nNk16 fragments (warpgroup = 4 warps; warp j of it, lane = 4g + t):
//   A from registers (64x16): warp j holds rows 16j..16j+15 as mma.m16n8k16's A above.
//   D (64xN, f32, N/2 registers): d[i] = D[16j + g + 8 * ((i % 4) / 2)][8 * (i / 4) + 2t + i % 2].
//   A or B from shared memory: a 64-bit matrix descriptor (ptx_wgmma_desc); `trans` 0 is K-major
//   (rows of K contiguous: Q, K for S = Q K^T), 1 is M/N-major (V as B of O = P V).
// wgmma m64nNk32 .e4m3 (fp8): A and B are K-major only (no transpose for 8-bit types). A from
//   registers (64x32): warp j holds rows 16j..16j+15 as mma.m16n8k32's 8-bit A, four e4m3 per
//   register, the lowest column in the low byte: a0 = A[g][4t..4t+3], a1 = A[g+8][4t..4t+3],
//   a2 = A[g][4t+16..4t+19], a3 = A[g+8][4t+16..4t+19]. D as for k16.
//   P fragment for O = P V in fp8: the f32 accumulator of S = Q K^T gives thread t keys 8i + 2t,
//   8i + 2t + 1 (i = 0..3) of each 32-key block, but A wants keys 4t..4t+3 and 4t+16..4t+19. Taking
//   the thread's converted accumulator values in order (value q = 0..7 of a row, key 8(q/2) + 2t +
//   q%2, into A slot q: register 2(q/4) (+1 for row g+8), byte q%4) needs no shuffle if V's key
//   rows are permuted to match: within each 32-key block, key k of V goes to row
//   16(k/16) + 4((k%8)/2) + 2((k/8)%2) + k%2 (0,1,4,5,8,9,12,13,2,3,6,7,...), which a transposing
//   copy of V into shared memory can apply as it writes; else the quad exchanges values.
// TMA boxes are described by a tensor map (cuflash/runtime/tensor_map.py) passed as a
// `const __grid_constant__ cuflash_tensor_map` kernel parameter.

// CUtensorMap's size and alignment (the driver's encoding on a GPU, the simulator's own on the CPU).
struct __align__(64) cuflash_tensor_map {
    unsigned long long opaque[16];
};

#if defined(CUFLASH_SIM)
// ============================================================== CPU emulation
namespace cuflash_ptx_sim {

CUSIM_NOSAN inline void check_shared16(const void* p, const char* what) {
    if (reinterpret_cast<uintptr_t>(p) & 15u) cusim::fail("%s: shared address %p is not 16-byte aligned", what, p);
    if (!cusim::is_shared(p, 16)) cusim::fail("%s: address %p is not in the block's shared memory", what, p);
}

// An instruction of sm_80 and newer issued by a kernel built for an older arch (the simulator's
// arch option): an error, as ptxas would refuse it for that target.
CUSIM_NOSAN inline void require_sm80(const char* what) {
#if __CUDA_ARCH__ < 800
    cusim::fail("%s does not exist on sm_%d (it needs sm_80): this kernel was built for sm_%d", what,
                __CUDA_ARCH__ / 10, __CUDA_ARCH__ / 10);
#else
    (void)what;
#endif
}

template <int X, bool TRANS>
CUSIM_NOSAN inline void ldmatrix_compute(cusim::Slot* slots, unsigned lanes) {
    if (lanes != 0xffffffffu) cusim::fail("ldmatrix: all 32 lanes must execute it (live lanes 0x%08x)", lanes);
    for (unsigned l = 0; l < 32; ++l) {
        const unsigned g = l / 4, t = l % 4;
        for (int j = 0; j < X; ++j) {
            uint16_t lo, hi;
            // the shared-memory reads, checked as this (the last arriving) lane's
            const uint16_t *plo, *phi;
            if (!TRANS) {
                const uint16_t* row = reinterpret_cast<const uint16_t*>(slots[8 * j + g].in[0]);
                plo = row + 2 * t;
                phi = row + 2 * t + 1;
            } else {
                plo = reinterpret_cast<const uint16_t*>(slots[8 * j + 2 * t].in[0]) + g;
                phi = reinterpret_cast<const uint16_t*>(slots[8 * j + 2 * t + 1].in[0]) + g;
            }
#ifdef CUSIM_CHECKED
            cusim::check_access(reinterpret_cast<uintptr_t>(plo), 2, false);
            cusim::check_access(reinterpret_cast<uintptr_t>(phi), 2, false);
#endif
            lo = *plo;
            hi = *phi;
            slots[l].out[j] = uint32_t(lo) | (uint32_t(hi) << 16);
        }
    }
}

template <int X, bool TRANS>
CUSIM_NOSAN inline void ldmatrix(uint32_t* r, const void* row_addr) {
    static const char* const names[2][3] = {{"ldmatrix.x1", "ldmatrix.x2", "ldmatrix.x4"},
                                            {"ldmatrix.x1.trans", "ldmatrix.x2.trans", "ldmatrix.x4.trans"}};
    const char* what = names[TRANS][X == 1 ? 0 : X == 2 ? 1 : 2];
    if (cusim::lane_id() < 8u * X) check_shared16(row_addr, what);
    const uint64_t a = reinterpret_cast<uintptr_t>(row_addr);
    cusim::Slot& s = cusim::collective(0xffffffffu, &a, sizeof a, &ldmatrix_compute<X, TRANS>, what);
    for (int j = 0; j < X; ++j) r[j] = s.out[j];
}

template <bool BF16>
CUSIM_NOSAN inline float unpack(uint32_t reg, int hi) {
    const uint16_t b = uint16_t(hi ? reg >> 16 : reg & 0xffffu);
    return BF16 ? cusim::bf16_bits_to_f32(b) : cusim::f16_bits_to_f32(b);
}

// D = A * B + C of an m16n8kK mma (K = 16, or 8 for sm_75's m16n8k8) into every lane's out[0..3] by
// the C/D fragment (c[0..1] = D[g][2t..2t+1], c[2..3] = D[g+8][2t..2t+1]); each element as below.
template <int K>
CUSIM_NOSAN inline void mma_d_out(cusim::Slot* slots, const float (&A)[16][K], const float (&B)[K][8],
                                  const float (&C)[16][8]) {
    float D[16][8];
    for (int i = 0; i < 16; ++i)
        for (int j = 0; j < 8; ++j) {
#ifdef CUSIM_GPU_NUMERICS
            double prod[K];
            for (int k = 0; k < K; ++k) prod[k] = double(A[i][k]) * double(B[k][j]);
            D[i][j] = cusim::tensor_core_dot(C[i][j], prod, K);
#else
            double acc = C[i][j];
            for (int k = 0; k < K; ++k) acc += double(A[i][k]) * double(B[k][j]);
            D[i][j] = float(acc);
#endif
        }
    for (unsigned l = 0; l < 32; ++l) {
        const unsigned g = l / 4, c = 2 * (l % 4);
        slots[l].out[0] = cusim::f32_bits(D[g][c]);
        slots[l].out[1] = cusim::f32_bits(D[g][c + 1]);
        slots[l].out[2] = cusim::f32_bits(D[g + 8][c]);
        slots[l].out[3] = cusim::f32_bits(D[g + 8][c + 1]);
    }
}

// One element of D = A * B + C: the 16 products of 16-bit values are exact in double; the sum is
// rounded once to float by default, or as measured on tensor cores with gpu_numerics
// (cusim::tensor_core_dot, cuflash/sim/cusim_sm90.h, shared with wgmma).
// D = A * B + C for m16n8k16.
template <bool BF16>
CUSIM_NOSAN inline void mma_m16n8k16_compute(cusim::Slot* slots, unsigned lanes) {
    if (lanes != 0xffffffffu) cusim::fail("mma.sync: all 32 lanes must execute it (live lanes 0x%08x)", lanes);
    float A[16][16], B[16][8], C[16][8];
    for (unsigned l = 0; l < 32; ++l) {
        uint32_t reg[10];
        std::memcpy(reg, slots[l].in, sizeof reg);
        const unsigned g = l / 4, c = 2 * (l % 4);
        for (int h = 0; h < 2; ++h) {
            A[g][c + h] = unpack<BF16>(reg[0], h);
            A[g + 8][c + h] = unpack<BF16>(reg[1], h);
            A[g][c + 8 + h] = unpack<BF16>(reg[2], h);
            A[g + 8][c + 8 + h] = unpack<BF16>(reg[3], h);
            B[c + h][g] = unpack<BF16>(reg[4], h);
            B[c + 8 + h][g] = unpack<BF16>(reg[5], h);
        }
        C[g][c] = cusim::bits_f32(reg[6]);
        C[g][c + 1] = cusim::bits_f32(reg[7]);
        C[g + 8][c] = cusim::bits_f32(reg[8]);
        C[g + 8][c + 1] = cusim::bits_f32(reg[9]);
    }
    mma_d_out<16>(slots, A, B, C);
}

template <bool BF16>
CUSIM_NOSAN inline void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], const float (&c)[4]) {
    require_sm80(BF16 ? "mma.m16n8k16.bf16" : "mma.m16n8k16.f16");
    uint32_t reg[10] = {a[0], a[1], a[2], a[3], b[0], b[1],
                        cusim::f32_bits(c[0]), cusim::f32_bits(c[1]), cusim::f32_bits(c[2]), cusim::f32_bits(c[3])};
    cusim::Slot& s = cusim::collective(0xffffffffu, reg, sizeof reg, &mma_m16n8k16_compute<BF16>,
                                       BF16 ? "mma.m16n8k16.bf16" : "mma.m16n8k16.f16");
    for (int i = 0; i < 4; ++i) d[i] = cusim::bits_f32(s.out[i]);
}

// D = A * B + C for m16n8k8 .f16 (sm_75+; PTX ISA 9.7.14.5.7 "Matrix Fragments for mma.m16n8k8",
// .f16/.bf16 A: a0, a1 at row g, a2, a3 at row g + 8, column 2t + (i & 1): register 0 holds
// A[g][2t..2t+1], register 1 A[g+8][2t..2t+1]; B (8 x 8): b0, b1 at rows 2t, 2t + 1 of column g,
// one register; C/D as for m16n8k16). The 8 products are exact in double and their sum with C is
// rounded once (with gpu_numerics, cusim::tensor_core_dot over 8 products). The .bf16 form needs
// sm_80 and is not emulated: on sm_75 only .f16 exists.
CUSIM_NOSAN inline void mma_m16n8k8_compute(cusim::Slot* slots, unsigned lanes) {
    if (lanes != 0xffffffffu) cusim::fail("mma.sync: all 32 lanes must execute it (live lanes 0x%08x)", lanes);
    float A[16][8], B[8][8], C[16][8];
    for (unsigned l = 0; l < 32; ++l) {
        uint32_t reg[7];
        std::memcpy(reg, slots[l].in, sizeof reg);
        const unsigned g = l / 4, c = 2 * (l % 4);
        for (int h = 0; h < 2; ++h) {
            A[g][c + h] = unpack<false>(reg[0], h);
            A[g + 8][c + h] = unpack<false>(reg[1], h);
            B[c + h][g] = unpack<false>(reg[2], h);
        }
        C[g][c] = cusim::bits_f32(reg[3]);
        C[g][c + 1] = cusim::bits_f32(reg[4]);
        C[g + 8][c] = cusim::bits_f32(reg[5]);
        C[g + 8][c + 1] = cusim::bits_f32(reg[6]);
    }
    mma_d_out<8>(slots, A, B, C);
}

CUSIM_NOSAN inline void mma_m16n8k8(float (&d)[4], const uint32_t (&a)[2], uint32_t b, const float (&c)[4]) {
    uint32_t reg[7] = {a[0], a[1], b, cusim::f32_bits(c[0]), cusim::f32_bits(c[1]), cusim::f32_bits(c[2]),
                       cusim::f32_bits(c[3])};
    cusim::Slot& s = cusim::collective(0xffffffffu, reg, sizeof reg, &mma_m16n8k8_compute, "mma.m16n8k8.f16");
    for (int i = 0; i < 4; ++i) d[i] = cusim::bits_f32(s.out[i]);
}

// cp.async of `size` bytes (4, 8 or 16), the first `src_bytes` of them read, the rest zero-filled.
CUSIM_NOSAN inline void cp_async(void* dst, const void* src, uint32_t size, uint32_t src_bytes) {
    require_sm80("cp.async");
    const uintptr_t align = size - 1;
    if (reinterpret_cast<uintptr_t>(dst) & align || reinterpret_cast<uintptr_t>(src) & align)
        cusim::fail("cp.async: addresses %p (shared) and %p (global) must be %u-byte aligned", dst, src, size);
    if (!cusim::is_shared(dst, size)) cusim::fail("cp.async: destination %p is not in the block's shared memory", dst);
    if (src_bytes && cusim::is_shared(src, 1)) cusim::fail("cp.async: source %p is shared, not global, memory", src);
    if (src_bytes > size) cusim::fail("cp.async: src-size %u exceeds the copy size %u", src_bytes, size);
    cusim::Fiber* f = cusim::fiber();
    cusim::AsyncCopy c;
    c.dst = dst;
    c.bytes = size;
    c.group = f->async_committed;
    if (src_bytes) cusim::checked_copy(c.data, src, src_bytes);   // the global read, checked
    std::memset(c.data + src_bytes, 0, size - src_bytes);
    if (cusim::async_lands_early()) {   // normal mode, by the seed: the copy completes at once
        std::memcpy(dst, c.data, size);
        return;
    }
    if (f->nasync == cusim::kMaxAsync)
        cusim::fail("cp.async: more than %u copies of this thread are in flight (no cp.async.wait_group)",
                    cusim::kMaxAsync);
    cusim::check_async_issue(dst, size);   // checked mode: a write now, in flight until the wait
    f->async[f->nasync++] = c;
}

CUSIM_NOSAN inline void cp_async_16(void* dst, const void* src, uint32_t src_bytes) { cp_async(dst, src, 16, src_bytes); }

CUSIM_NOSAN inline void cp_async_commit() { ++cusim::fiber()->async_committed; }

// Land every committed group except the newest `pending` ones.
CUSIM_NOSAN inline void cp_async_wait(uint32_t pending) {
    cusim::Fiber* f = cusim::fiber();
    if (f->async_committed < pending) return;
    const uint32_t limit = f->async_committed - pending;
    uint32_t keep = 0;
    for (uint32_t i = 0; i < f->nasync; ++i) {
        cusim::AsyncCopy& c = f->async[i];
        if (c.group < limit) {
            cusim::check_async_land(c.dst, c.bytes);
            cusim::checked_copy(c.dst, c.data, c.bytes);   // lands: the shared bytes count as written
        }
        else {
            f->async[keep++] = c;
        }
    }
    f->nasync = keep;
}

}  // namespace cuflash_ptx_sim

__device__ __forceinline__ void ptx_ldmatrix_x1(unsigned (&r)[1], const void* row_addr) { cuflash_ptx_sim::ldmatrix<1, false>(r, row_addr); }
__device__ __forceinline__ void ptx_ldmatrix_x2(unsigned (&r)[2], const void* row_addr) { cuflash_ptx_sim::ldmatrix<2, false>(r, row_addr); }
__device__ __forceinline__ void ptx_ldmatrix_x4(unsigned (&r)[4], const void* row_addr) { cuflash_ptx_sim::ldmatrix<4, false>(r, row_addr); }
__device__ __forceinline__ void ptx_ldmatrix_x1_trans(unsigned (&r)[1], const void* row_addr) { cuflash_ptx_sim::ldmatrix<1, true>(r, row_addr); }
__device__ __forceinline__ void ptx_ldmatrix_x2_trans(unsigned (&r)[2], const void* row_addr) { cuflash_ptx_sim::ldmatrix<2, true>(r, row_addr); }
__device__ __forceinline__ void ptx_ldmatrix_x4_trans(unsigned (&r)[4], const void* row_addr) { cuflash_ptx_sim::ldmatrix<4, true>(r, row_addr); }
// ldmatrix at `base` plus a byte offset (GPU branch: the offset is added to the shared-window
// address in 32 bits, so a per-thread offset held in a register plus a constant becomes one
// [R + immediate] operand).
__device__ __forceinline__ void ptx_ldmatrix_x4_at(unsigned (&r)[4], const void* base, unsigned byte_off) {
    cuflash_ptx_sim::ldmatrix<4, false>(r, static_cast<const unsigned char*>(base) + byte_off);
}
__device__ __forceinline__ void ptx_ldmatrix_x4_trans_at(unsigned (&r)[4], const void* base, unsigned byte_off) {
    cuflash_ptx_sim::ldmatrix<4, true>(r, static_cast<const unsigned char*>(base) + byte_off);
}
// mma.m16n8k8.row.col.f32.f16.f16.f32 (sm_75+): the sm_75 form of m16n8k16 (section "sm_75 form").
__device__ __forceinline__ void ptx_mma_m16n8k8_f16_f32(float (&d)[4], const unsigned (&a)[2], unsigned b, const float (&c)[4]) {
    cuflash_ptx_sim::mma_m16n8k8(d, a, b, c);
}
// (bf16 has no sm_75 form: built for sm_75, the emulation fails, as the GPU build traps)
__device__ __forceinline__ void ptx_mma_m16n8k16_bf16_f32(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2], const float (&c)[4]) {
    cuflash_ptx_sim::mma_m16n8k16<true>(d, a, b, c);
}
#if !CUFLASH_SM75_FORM
__device__ __forceinline__ void ptx_mma_m16n8k16_f16_f32(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2], const float (&c)[4]) {
    cuflash_ptx_sim::mma_m16n8k16<false>(d, a, b, c);
}
__device__ __forceinline__ void ptx_cp_async_16(void* smem, const void* gmem) { cuflash_ptx_sim::cp_async_16(smem, gmem, 16); }
__device__ __forceinline__ void ptx_cp_async_16_zfill(void* smem, const void* gmem, int src_bytes) {
    cuflash_ptx_sim::cp_async_16(smem, gmem, uint32_t(src_bytes));
}
// cp.async.cg with the ignore-src predicate: when `ignore`, the source is not read at all (its
// address need not be valid) and the 16 bytes are zeros.
__device__ __forceinline__ void ptx_cp_async_16_ignore_src(void* smem, const void* gmem, bool ignore) {
    cuflash_ptx_sim::cp_async_16(smem, gmem, ignore ? 0u : 16u);
}
// cp.async.ca with cp-size 4 (4-byte-aligned addresses): src_bytes 0 zero-fills.
__device__ __forceinline__ void ptx_cp_async_4_zfill(void* smem, const void* gmem, int src_bytes) {
    cuflash_ptx_sim::cp_async(smem, gmem, 4, uint32_t(src_bytes));
}
// ... the same with cp.async's ignore-src predicate: ignore, the source is not read at all (zeros).
__device__ __forceinline__ void ptx_cp_async_4_ignore_src(void* smem, const void* gmem, bool ignore) {
    cuflash_ptx_sim::cp_async(smem, gmem, 4, ignore ? 0u : 4u);
}
// cp.async.ca with cp-size 8 (8-byte-aligned addresses): src_bytes 0 zero-fills.
__device__ __forceinline__ void ptx_cp_async_8_zfill(void* smem, const void* gmem, int src_bytes) {
    cuflash_ptx_sim::cp_async(smem, gmem, 8, uint32_t(src_bytes));
}
#endif  // !CUFLASH_SM75_FORM
// `x` itself (see the GPU branch: an optimization barrier there, nothing here).
__device__ __forceinline__ int ptx_opaque(int x) { return x; }
__device__ __forceinline__ long long ptx_opaque(long long x) { return x; }
// lop3.b32 with the table of a & b & c (0xF0 & 0xCC & 0xAA = 0x80): one instruction for three words.
__device__ __forceinline__ unsigned ptx_and3(unsigned a, unsigned b, unsigned c) { return a & b & c; }
// set.ge.u32.f16x2: per 16-bit half, 0xFFFF where a's half >= b's half (as float16), else 0 (the rule of
// cuda_fp16.hpp's __hge2_mask, which issues this instruction).
__device__ __forceinline__ unsigned ptx_set_ge_f16x2(unsigned a, unsigned b) {
    unsigned r = 0;
    for (int i = 0; i < 2; ++i)
        if (cusim::f16_bits_to_f32(uint16_t(a >> (16 * i))) >= cusim::f16_bits_to_f32(uint16_t(b >> (16 * i)))) r |= 0xFFFFu << (16 * i);
    return r;
}
// shf.l.clamp.b32 of the pair {hi 0, lo all ones} by n: the low min(n, 32) bits set (n unsigned).
__device__ __forceinline__ unsigned ptx_ones_below(unsigned n) { return n >= 32 ? ~0u : (1u << n) - 1u; }
// red.global.add.v2.f32 (sm_90; two scalar atomic adds before): p[0] += a, p[1] += b, p 8-byte aligned.
__device__ __forceinline__ void ptx_red_add_f32x2(float* p, float a, float b) {
    if (reinterpret_cast<uintptr_t>(p) & 7u) cusim::fail("red.v2.f32: address %p must be 8-byte aligned", (void*)p);
    atomicAdd(p, a);
    atomicAdd(p + 1, b);
}
// The same under a predicate; off: no access at all. (GPU: setp and `@q red` in one asm block; ptxas
// 12.9 and 13.0 still emit a branch around the REDG, BSSY/BRA/BSYNC, as for any predicated red/atom.)
__device__ __forceinline__ void ptx_red_add_f32x2_if(bool pred, float* p, float a, float b) {
    if (pred) ptx_red_add_f32x2(p, a, b);
}
#if !CUFLASH_SM75_FORM
__device__ __forceinline__ void ptx_cp_async_commit() { cuflash_ptx_sim::cp_async_commit(); }
template <int N> __device__ __forceinline__ void ptx_cp_async_wait() { cuflash_ptx_sim::cp_async_wait(uint32_t(N)); }
__device__ __forceinline__ void ptx_cp_async_wait_all() { cuflash_ptx_sim::cp_async_commit(); cuflash_ptx_sim::cp_async_wait(0); }
#endif
// cvt.rn.f16x2.f32 / cvt.rn.bf16x2.f32: `lo` goes to the low 16 bits, `hi` to the high 16 bits.
__device__ __forceinline__ unsigned ptx_cvt_pack_f16x2(float lo, float hi) {
    return unsigned(cusim::f32_to_f16_bits(lo)) | (unsigned(cusim::f32_to_f16_bits(hi)) << 16);
}
__device__ __forceinline__ unsigned ptx_cvt_pack_bf16x2(float lo, float hi) {
    return unsigned(cusim::f32_to_bf16_bits(lo)) | (unsigned(cusim::f32_to_bf16_bits(hi)) << 16);
}

// ---------------------------------------------------------------- sm_90a (cusim_sm90.h)
#if __CUDA_ARCH__ >= 900
__device__ __forceinline__ unsigned ptx_smem_addr(const void* p) { return cusim::shared_window_address(p); }
__device__ __forceinline__ void ptx_wgmma_fence() { cusim::wgmma_fence(); }
__device__ __forceinline__ void ptx_wgmma_commit() { cusim::wgmma_commit(); }
template <int N> __device__ __forceinline__ void ptx_wgmma_wait() { cusim::wgmma_wait(uint32_t(N)); }
template <int N, bool BF16, int TRANS_A, int TRANS_B>
__device__ __forceinline__ void ptx_wgmma_ss(float (&d)[N / 2], unsigned long long desc_a, unsigned long long desc_b, int scale_d) {
    cusim::wgmma<N, BF16>(d, desc_a, nullptr, desc_b, TRANS_A != 0, TRANS_B != 0, scale_d != 0);
}
template <int N, bool BF16, int TRANS_B>
__device__ __forceinline__ void ptx_wgmma_rs(float (&d)[N / 2], const unsigned (&a)[4], unsigned long long desc_b, int scale_d) {
    cusim::wgmma<N, BF16>(d, 0, a, desc_b, false, TRANS_B != 0, scale_d != 0);
}
// wgmma.mma_async m64nNk32.f32.e4m3.e4m3 (both operands K-major: fp8 has no transpose), A from
// shared memory or from four registers of four e4m3 each (cusim::wgmma_e4m3 states the layout).
template <int N>
__device__ __forceinline__ void ptx_wgmma_ss_e4m3(float (&d)[N / 2], unsigned long long desc_a, unsigned long long desc_b, int scale_d) {
    cusim::wgmma_e4m3<N>(d, desc_a, nullptr, desc_b, scale_d != 0);
}
template <int N>
__device__ __forceinline__ void ptx_wgmma_rs_e4m3(float (&d)[N / 2], const unsigned (&a)[4], unsigned long long desc_b, int scale_d) {
    cusim::wgmma_e4m3<N>(d, 0, a, desc_b, scale_d != 0);
}
__device__ __forceinline__ void ptx_mbarrier_init(unsigned long long* bar, unsigned count) { cusim::mbar_init(bar, count); }
__device__ __forceinline__ void ptx_fence_mbarrier_init() { cusim::fence_mbarrier_init(); }
__device__ __forceinline__ void ptx_mbarrier_arrive(unsigned long long* bar) { cusim::mbar_arrive(bar, 0, "mbarrier.arrive"); }
__device__ __forceinline__ void ptx_mbarrier_arrive_expect_tx(unsigned long long* bar, unsigned bytes) {
    cusim::mbar_arrive(bar, bytes, "mbarrier.arrive.expect_tx");
}
__device__ __forceinline__ bool ptx_mbarrier_try_wait(unsigned long long* bar, unsigned parity) { return cusim::mbar_try_wait(bar, parity); }
__device__ __forceinline__ void ptx_mbarrier_wait(unsigned long long* bar, unsigned parity) { cusim::mbar_wait(bar, parity); }
// the same two at a barrier's shared-window address (ptx_smem_addr), which a loop can carry
__device__ __forceinline__ void ptx_mbarrier_arrive(unsigned bar) {
    cusim::mbar_arrive(cusim::shared_window_pointer(bar), 0, "mbarrier.arrive");
}
__device__ __forceinline__ void ptx_mbarrier_wait(unsigned bar, unsigned parity) { cusim::mbar_wait(cusim::shared_window_pointer(bar), parity); }
__device__ __forceinline__ void ptx_tma_load_2d(void* dst, const cuflash_tensor_map* map, int c0, int c1, unsigned long long* bar) {
    const int32_t c[2] = {c0, c1};
    cusim::tma_load(dst, map, c, 2, bar);
}
__device__ __forceinline__ void ptx_tma_load_3d(void* dst, const cuflash_tensor_map* map, int c0, int c1, int c2, unsigned long long* bar) {
    const int32_t c[3] = {c0, c1, c2};
    cusim::tma_load(dst, map, c, 3, bar);
}
__device__ __forceinline__ void ptx_tma_load_4d(void* dst, const cuflash_tensor_map* map, int c0, int c1, int c2, int c3, unsigned long long* bar) {
    const int32_t c[4] = {c0, c1, c2, c3};
    cusim::tma_load(dst, map, c, 4, bar);
}
__device__ __forceinline__ void ptx_tma_load_5d(void* dst, const cuflash_tensor_map* map, int c0, int c1, int c2, int c3, int c4, unsigned long long* bar) {
    const int32_t c[5] = {c0, c1, c2, c3, c4};
    cusim::tma_load(dst, map, c, 5, bar);
}
__device__ __forceinline__ void ptx_tma_store_2d(const cuflash_tensor_map* map, int c0, int c1, const void* src) {
    const int32_t c[2] = {c0, c1};
    cusim::tma_store(map, c, 2, src);
}
__device__ __forceinline__ void ptx_tma_store_3d(const cuflash_tensor_map* map, int c0, int c1, int c2, const void* src) {
    const int32_t c[3] = {c0, c1, c2};
    cusim::tma_store(map, c, 3, src);
}
__device__ __forceinline__ void ptx_tma_store_4d(const cuflash_tensor_map* map, int c0, int c1, int c2, int c3, const void* src) {
    const int32_t c[4] = {c0, c1, c2, c3};
    cusim::tma_store(map, c, 4, src);
}
__device__ __forceinline__ void ptx_tma_store_5d(const cuflash_tensor_map* map, int c0, int c1, int c2, int c3, int c4, const void* src) {
    const int32_t c[5] = {c0, c1, c2, c3, c4};
    cusim::tma_store(map, c, 5, src);
}
__device__ __forceinline__ void ptx_bulk_reduce_add_f32(float* gmem, const void* smem, unsigned bytes) {
    cusim::bulk_reduce_add_f32(gmem, smem, bytes);
}
__device__ __forceinline__ void ptx_bulk_commit() { cusim::bulk_commit(); }
template <int N> __device__ __forceinline__ void ptx_bulk_wait() { cusim::bulk_wait(uint32_t(N), true); }
template <int N> __device__ __forceinline__ void ptx_bulk_wait_read() { cusim::bulk_wait(uint32_t(N)); }
__device__ __forceinline__ void ptx_fence_proxy_async() { cusim::fence_proxy_async(); }
__device__ __forceinline__ void ptx_fence_proxy_async_global() { cusim::fence_proxy_async_global(); }
__device__ __forceinline__ void ptx_wait_eq_acquire(const int* p, int value) { cusim::wait_eq_acquire(p, value); }
__device__ __forceinline__ void ptx_red_release_add(int* p, int v) { cusim::red_release_add(p, v); }
__device__ __forceinline__ void ptx_bar_sync(int id, int count) { cusim::bar_sync(unsigned(id), unsigned(count)); }
__device__ __forceinline__ void ptx_bar_arrive(int id, int count) { cusim::bar_arrive(unsigned(id), unsigned(count)); }
template <int R> __device__ __forceinline__ void ptx_setmaxnreg_inc() { cusim::setmaxnreg(unsigned(R), true); }
template <int R> __device__ __forceinline__ void ptx_setmaxnreg_dec() { cusim::setmaxnreg(unsigned(R), false); }
__device__ __forceinline__ bool ptx_elect_one() { return cusim::elect_one(0xffffffffu); }

namespace cuflash_ptx_sim {
// stmatrix m8n8 (x1/x2/x4, .trans): ldmatrix's inverse: lanes 8j..8j+7 give the 16-byte-aligned
// row addresses of matrix j; r[j] of lane 4g + t is row g, columns 2t..2t+1 of matrix j (.trans:
// rows 2t..2t+1 of column g).
template <int X, bool TRANS>
CUSIM_NOSAN inline void stmatrix_compute(cusim::Slot* slots, unsigned lanes) {
    if (lanes != 0xffffffffu) cusim::fail("stmatrix: all 32 lanes must execute it (live lanes 0x%08x)", lanes);
    for (unsigned l = 0; l < 32; ++l) {
        const unsigned g = l / 4, t = l % 4;
        for (int j = 0; j < X; ++j) {
            const uint32_t v = uint32_t(slots[l].in[1 + j / 2] >> (32 * (j % 2)));
            uint16_t *plo, *phi;
            if (!TRANS) {
                uint16_t* row = reinterpret_cast<uint16_t*>(slots[8 * j + g].in[0]);
                plo = row + 2 * t;
                phi = row + 2 * t + 1;
            } else {
                plo = reinterpret_cast<uint16_t*>(slots[8 * j + 2 * t].in[0]) + g;
                phi = reinterpret_cast<uint16_t*>(slots[8 * j + 2 * t + 1].in[0]) + g;
            }
#ifdef CUSIM_CHECKED
            cusim::check_access(reinterpret_cast<uintptr_t>(plo), 2, true);
            cusim::check_access(reinterpret_cast<uintptr_t>(phi), 2, true);
#endif
            *plo = uint16_t(v & 0xffffu);
            *phi = uint16_t(v >> 16);
        }
    }
}

template <int X, bool TRANS>
CUSIM_NOSAN inline void stmatrix(void* row_addr, const uint32_t* r) {
    static const char* const names[2][3] = {{"stmatrix.x1", "stmatrix.x2", "stmatrix.x4"},
                                            {"stmatrix.x1.trans", "stmatrix.x2.trans", "stmatrix.x4.trans"}};
    const char* what = names[TRANS][X == 1 ? 0 : X == 2 ? 1 : 2];
    if (cusim::lane_id() < 8u * X) check_shared16(row_addr, what);
    uint64_t in[3] = {reinterpret_cast<uintptr_t>(row_addr), 0, 0};
    for (int j = 0; j < X; ++j) in[1 + j / 2] |= uint64_t(r[j]) << (32 * (j % 2));
    cusim::collective(0xffffffffu, in, sizeof in, &stmatrix_compute<X, TRANS>, what);
}
}  // namespace cuflash_ptx_sim
__device__ __forceinline__ void ptx_stmatrix_x1(void* row_addr, const unsigned (&r)[1]) { cuflash_ptx_sim::stmatrix<1, false>(row_addr, r); }
__device__ __forceinline__ void ptx_stmatrix_x2(void* row_addr, const unsigned (&r)[2]) { cuflash_ptx_sim::stmatrix<2, false>(row_addr, r); }
__device__ __forceinline__ void ptx_stmatrix_x4(void* row_addr, const unsigned (&r)[4]) { cuflash_ptx_sim::stmatrix<4, false>(row_addr, r); }
__device__ __forceinline__ void ptx_stmatrix_x1_trans(void* row_addr, const unsigned (&r)[1]) { cuflash_ptx_sim::stmatrix<1, true>(row_addr, r); }
__device__ __forceinline__ void ptx_stmatrix_x2_trans(void* row_addr, const unsigned (&r)[2]) { cuflash_ptx_sim::stmatrix<2, true>(row_addr, r); }
__device__ __forceinline__ void ptx_stmatrix_x4_trans(void* row_addr, const unsigned (&r)[4]) { cuflash_ptx_sim::stmatrix<4, true>(row_addr, r); }
#endif  // __CUDA_ARCH__ >= 900

#else
// ============================================================== GPU
__device__ __forceinline__ unsigned ptx_smem_addr(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }
// `x`, opaque to the optimizer (an empty volatile asm; no instruction): a value formed inside a
// loop from this opaque copy stays there, instead of the compiler re-associating it into
// per-thread loop invariants that occupy registers the loop needs (the backward's offsets;
// ptxas spilled them). The input itself may still be hoisted, so pass a value that is live anyway
// (the thread index) or one that varies per iteration.
__device__ __forceinline__ int ptx_opaque(int x) {
    asm volatile("" : "+r"(x));
    return x;
}
__device__ __forceinline__ long long ptx_opaque(long long x) {
    asm volatile("" : "+l"(x));
    return x;
}
// lop3.b32 a & b & c (kept one instruction: NVVM would AND b and c once for two uses, then each use)
__device__ __forceinline__ unsigned ptx_and3(unsigned a, unsigned b, unsigned c) {
    unsigned r;
    asm("lop3.b32 %0, %1, %2, %3, 0x80;\n" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}
// set.ge.u32.f16x2 (the simulator's branch states the rule)
__device__ __forceinline__ unsigned ptx_set_ge_f16x2(unsigned a, unsigned b) {
    unsigned r;
    asm("set.ge.u32.f16x2 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
// shf.l.clamp.b32 of the pair {hi 0, lo all ones} by n: the low min(n, 32) bits set (n unsigned).
__device__ __forceinline__ unsigned ptx_ones_below(unsigned n) {
    unsigned r;
    asm("shf.l.clamp.b32 %0, %1, %2, %3;\n" : "=r"(r) : "r"(~0u), "r"(0u), "r"(n));
    return r;
}

__device__ __forceinline__ void ptx_ldmatrix_x1(unsigned (&r)[1], const void* row_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(ptx_smem_addr(row_addr)));
}
__device__ __forceinline__ void ptx_ldmatrix_x2(unsigned (&r)[2], const void* row_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(ptx_smem_addr(row_addr)));
}
__device__ __forceinline__ void ptx_ldmatrix_x4(unsigned (&r)[4], const void* row_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(ptx_smem_addr(row_addr)));
}
__device__ __forceinline__ void ptx_ldmatrix_x1_trans(unsigned (&r)[1], const void* row_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(ptx_smem_addr(row_addr)));
}
__device__ __forceinline__ void ptx_ldmatrix_x2_trans(unsigned (&r)[2], const void* row_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(ptx_smem_addr(row_addr)));
}
__device__ __forceinline__ void ptx_ldmatrix_x4_trans(unsigned (&r)[4], const void* row_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(ptx_smem_addr(row_addr)));
}
__device__ __forceinline__ void ptx_ldmatrix_x4_at(unsigned (&r)[4], const void* base, unsigned byte_off) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(ptx_smem_addr(base) + byte_off));
}
__device__ __forceinline__ void ptx_ldmatrix_x4_trans_at(unsigned (&r)[4], const void* base, unsigned byte_off) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(ptx_smem_addr(base) + byte_off));
}

__device__ __forceinline__ void ptx_mma_m16n8k8_f16_f32(float (&d)[4], const unsigned (&a)[2], unsigned b, const float (&c)[4]) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%7, %8, %9, %10};\n"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(b), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}
#if __CUDA_ARCH__ >= 800
#if !CUFLASH_SM75_FORM
__device__ __forceinline__ void ptx_mma_m16n8k16_f16_f32(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2], const float (&c)[4]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}
#endif
__device__ __forceinline__ void ptx_mma_m16n8k16_bf16_f32(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2], const float (&c)[4]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}
#if !CUFLASH_SM75_FORM
__device__ __forceinline__ void ptx_cp_async_16(void* smem, const void* gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(ptx_smem_addr(smem)), "l"(gmem) : "memory");
}
__device__ __forceinline__ void ptx_cp_async_16_zfill(void* smem, const void* gmem, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(ptx_smem_addr(smem)), "l"(gmem), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void ptx_cp_async_16_ignore_src(void* smem, const void* gmem, bool ignore) {
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n cp.async.cg.shared.global [%0], [%1], 16, p;\n}\n"
                 ::"r"(ptx_smem_addr(smem)), "l"(gmem), "r"(int(ignore)) : "memory");
}
__device__ __forceinline__ void ptx_cp_async_4_zfill(void* smem, const void* gmem, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(ptx_smem_addr(smem)), "l"(gmem), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void ptx_cp_async_4_ignore_src(void* smem, const void* gmem, bool ignore) {
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n cp.async.ca.shared.global [%0], [%1], 4, p;\n}\n"
                 ::"r"(ptx_smem_addr(smem)), "l"(gmem), "r"(int(ignore)) : "memory");
}
__device__ __forceinline__ void ptx_cp_async_8_zfill(void* smem, const void* gmem, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(ptx_smem_addr(smem)), "l"(gmem), "r"(src_bytes) : "memory");
}
#endif
__device__ __forceinline__ void ptx_red_add_f32x2(float* p, float a, float b) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(a), "f"(b) : "memory");
#else
    asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(p), "f"(a) : "memory");
    asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(p + 1), "f"(b) : "memory");
#endif
}
__device__ __forceinline__ void ptx_red_add_f32x2_if(bool pred, float* p, float a, float b) {
#if __CUDA_ARCH__ >= 900
    asm volatile("{\n .reg .pred q;\n setp.ne.b32 q, %3, 0;\n @q red.global.add.v2.f32 [%0], {%1, %2};\n}\n"
                 ::"l"(p), "f"(a), "f"(b), "r"(int(pred)) : "memory");
#else
    asm volatile("{\n .reg .pred q;\n setp.ne.b32 q, %3, 0;\n @q red.global.add.f32 [%0], %1;\n @q red.global.add.f32 [%0+4], %2;\n}\n"
                 ::"l"(p), "f"(a), "f"(b), "r"(int(pred)) : "memory");
#endif
}
#if !CUFLASH_SM75_FORM
__device__ __forceinline__ void ptx_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void ptx_cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
__device__ __forceinline__ void ptx_cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
#endif
__device__ __forceinline__ unsigned ptx_cvt_pack_f16x2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));   // first source -> upper half
    return r;
}
__device__ __forceinline__ unsigned ptx_cvt_pack_bf16x2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
#else  // sm_75: no bf16 mma or packed cvt (m16n8k16 .f16 and the copies: section "sm_75 form")
__device__ __forceinline__ void ptx_mma_m16n8k16_bf16_f32(float (&d)[4], const unsigned (&)[4], const unsigned (&)[2], const float (&)[4]) {
    d[0] = d[1] = d[2] = d[3] = 0.0f;
    __trap();   // bf16 tensor-core mma needs sm_80
}
__device__ __forceinline__ void ptx_red_add_f32x2(float* p, float a, float b) {
    atomicAdd(p, a);
    atomicAdd(p + 1, b);
}
__device__ __forceinline__ void ptx_red_add_f32x2_if(bool pred, float* p, float a, float b) {
    if (pred) ptx_red_add_f32x2(p, a, b);
}
__device__ __forceinline__ unsigned ptx_cvt_pack_f16x2(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&h);
}
__device__ __forceinline__ unsigned ptx_cvt_pack_bf16x2(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&h);
}
#endif
// ---------------------------------------------------------------- sm_90 / sm_90a
#if __CUDA_ARCH__ >= 900
__device__ __forceinline__ void ptx_mbarrier_init(unsigned long long* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(ptx_smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void ptx_fence_mbarrier_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
__device__ __forceinline__ void ptx_mbarrier_arrive(unsigned long long* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(ptx_smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void ptx_mbarrier_arrive_expect_tx(unsigned long long* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(ptx_smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ bool ptx_mbarrier_try_wait(unsigned long long* bar, unsigned parity) {
    unsigned ok;
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(ok) : "r"(ptx_smem_addr(bar)), "r"(parity) : "memory");
    return ok != 0;
}
__device__ __forceinline__ void ptx_mbarrier_wait(unsigned long long* bar, unsigned parity) {
    while (!ptx_mbarrier_try_wait(bar, parity)) {
    }
}
// the same two at a barrier's shared-window address (ptx_smem_addr), which a loop can carry
__device__ __forceinline__ void ptx_mbarrier_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void ptx_mbarrier_wait(unsigned bar, unsigned parity) {
    unsigned ok;
    do {
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(ok) : "r"(bar), "r"(parity) : "memory");
    } while (ok == 0);
}
__device__ __forceinline__ void ptx_tma_load_2d(void* dst, const cuflash_tensor_map* map, int c0, int c1, unsigned long long* bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
                 ::"r"(ptx_smem_addr(dst)), "l"(map), "r"(c0), "r"(c1), "r"(ptx_smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void ptx_tma_load_3d(void* dst, const cuflash_tensor_map* map, int c0, int c1, int c2, unsigned long long* bar) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n"
                 ::"r"(ptx_smem_addr(dst)), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(ptx_smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void ptx_tma_load_4d(void* dst, const cuflash_tensor_map* map, int c0, int c1, int c2, int c3, unsigned long long* bar) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
                 ::"r"(ptx_smem_addr(dst)), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(ptx_smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void ptx_tma_load_5d(void* dst, const cuflash_tensor_map* map, int c0, int c1, int c2, int c3, int c4, unsigned long long* bar) {
    asm volatile("cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5, %6}], [%7];\n"
                 ::"r"(ptx_smem_addr(dst)), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(ptx_smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void ptx_tma_store_2d(const cuflash_tensor_map* map, int c0, int c1, const void* src) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n"
                 ::"l"(map), "r"(c0), "r"(c1), "r"(ptx_smem_addr(src)) : "memory");
}
__device__ __forceinline__ void ptx_tma_store_3d(const cuflash_tensor_map* map, int c0, int c1, int c2, const void* src) {
    asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%1, %2, %3}], [%4];\n"
                 ::"l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(ptx_smem_addr(src)) : "memory");
}
__device__ __forceinline__ void ptx_tma_store_4d(const cuflash_tensor_map* map, int c0, int c1, int c2, int c3, const void* src) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n"
                 ::"l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(ptx_smem_addr(src)) : "memory");
}
__device__ __forceinline__ void ptx_tma_store_5d(const cuflash_tensor_map* map, int c0, int c1, int c2, int c3, int c4, const void* src) {
    asm volatile("cp.async.bulk.tensor.5d.global.shared::cta.bulk_group [%0, {%1, %2, %3, %4, %5}], [%6];\n"
                 ::"l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(ptx_smem_addr(src)) : "memory");
}
// cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 (PTX ISA "cp.reduce.async.bulk"; SASS UBLKRED):
// adds `bytes` (a multiple of 16; both addresses 16-byte aligned) of float32 from shared memory into
// global memory; completes with the bulk group (commit_group, then wait_group.read before reusing smem).
__device__ __forceinline__ void ptx_bulk_reduce_add_f32(float* gmem, const void* smem, unsigned bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(gmem),
                 "r"(ptx_smem_addr(smem)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void ptx_bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void ptx_bulk_wait() { asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory"); }
template <int N> __device__ __forceinline__ void ptx_bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory"); }
__device__ __forceinline__ void ptx_fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// fence.proxy.async.global: orders this thread's generic and async-proxy accesses of global memory
// (the deterministic backward: after the ld.acquire wait, before its cp.reduce.async.bulk; after the
// full cp.async.bulk.wait_group, before the red.release).
__device__ __forceinline__ void ptx_fence_proxy_async_global() { asm volatile("fence.proxy.async.global;\n" ::: "memory"); }
// Spin until [p] == value, each read an ld.acquire.gpu.global (another block's counter).
__device__ __forceinline__ void ptx_wait_eq_acquire(const int* p, int value) {
    int v;
    do {
        asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    } while (v != value);
}
// red.release.gpu.global.add.s32 [p], v: publishes this thread's earlier writes with the count.
__device__ __forceinline__ void ptx_red_release_add(int* p, int v) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void ptx_bar_sync(int id, int count) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory"); }
__device__ __forceinline__ void ptx_bar_arrive(int id, int count) { asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory"); }
__device__ __forceinline__ bool ptx_elect_one() {
    unsigned ok;
    asm volatile("{\n .reg .pred p;\n .reg .b32 r;\n elect.sync r|p, 0xffffffff;\n selp.u32 %0, 1, 0, p;\n}\n" : "=r"(ok));
    return ok != 0;
}
__device__ __forceinline__ void ptx_stmatrix_x1(void* row_addr, const unsigned (&r)[1]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x1.shared.b16 [%0], {%1};\n" ::"r"(ptx_smem_addr(row_addr)), "r"(r[0]) : "memory");
}
__device__ __forceinline__ void ptx_stmatrix_x2(void* row_addr, const unsigned (&r)[2]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x2.shared.b16 [%0], {%1, %2};\n" ::"r"(ptx_smem_addr(row_addr)), "r"(r[0]), "r"(r[1]) : "memory");
}
__device__ __forceinline__ void ptx_stmatrix_x4(void* row_addr, const unsigned (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
                 ::"r"(ptx_smem_addr(row_addr)), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}
__device__ __forceinline__ void ptx_stmatrix_x1_trans(void* row_addr, const unsigned (&r)[1]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x1.trans.shared.b16 [%0], {%1};\n" ::"r"(ptx_smem_addr(row_addr)), "r"(r[0]) : "memory");
}
__device__ __forceinline__ void ptx_stmatrix_x2_trans(void* row_addr, const unsigned (&r)[2]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x2.trans.shared.b16 [%0], {%1, %2};\n" ::"r"(ptx_smem_addr(row_addr)), "r"(r[0]), "r"(r[1]) : "memory");
}
__device__ __forceinline__ void ptx_stmatrix_x4_trans(void* row_addr, const unsigned (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n"
                 ::"r"(ptx_smem_addr(row_addr)), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void ptx_wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void ptx_wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void ptx_wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
template <int R> __device__ __forceinline__ void ptx_setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R)); }
template <int R> __device__ __forceinline__ void ptx_setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R)); }
// ptx_wgmma_ss<N, BF16, TRANS_A, TRANS_B> and ptx_wgmma_rs<N, BF16, TRANS_B>, N = 16..256 in steps of
// 16: one asm statement per N (its N/2 accumulator operands), generated by cuflash/runtime/ptx_gen.py;
// likewise ptx_wgmma_ss_e4m3<N> / ptx_wgmma_rs_e4m3<N> (m64nNk32.f32.e4m3.e4m3, K-major operands).
#include "ptx_wgmma.gen.cuh"
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
#endif  // __CUDA_ARCH__ >= 900
#endif

// ---------------------------------------------------------------- sm_75 form (Turing)
// Compiled by the GPU build and the simulator alike (plain C++ over the wrappers above), so the
// simulator runs exactly what a T4 runs.
//
// mma m16n8k16 .f16 as two mma.m16n8k8 (sm_75+): by the fragment tables of PTX ISA 9.7.14.5.7
// ("Matrix Fragments for mma.m16n8k8": A a0..a3 at rows g, g, g + 8, g + 8, column 2t + (i & 1);
// B b0, b1 at rows 2t, 2t + 1 of column g) and 9.7.14.5.8 ("... mma.m16n8k16 with floating point
// type": A registers 0, 1 hold columns 2t..2t+1 of rows g, g + 8, registers 2, 3 columns 2t+8..2t+9;
// B register 0 rows 2t..2t+1, register 1 rows 2t+8..2t+9), k 0..7 is m16n8k8 with A {a[0], a[1]}
// and B b[0], and k 8..15 is m16n8k8 with A {a[2], a[3]} and B b[1], accumulating into the first's
// D; C/D have the same layout in both shapes. The f32 sum is rounded after each k8 step.
//
// cp.async (sm_80+) does not exist: each copy wrapper is a register-staged synchronous copy (one
// ld.global of the chunk into registers, then one st.shared), complete when the wrapper returns, so
// commit and wait have nothing left to order and are empty. A kernel's copy of tile j + 1 issued
// before the math of tile j therefore stalls its warp on the load's latency (the other resident
// warps run meanwhile); load_tile_async (mma_tile.cuh) issues all of a tile's loads of a thread
// before its first store, so a tile waits one latency, not one per chunk. Zero-fill takes src_bytes
// 0 (nothing read) or the full size: partial sizes are not used by the kernels and are refused by
// the simulator.
#if CUFLASH_SM75_FORM
__device__ __forceinline__ void ptx_mma_m16n8k16_f16_f32(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2], const float (&c)[4]) {
    const unsigned lo[2] = {a[0], a[1]}, hi[2] = {a[2], a[3]};
    float t[4];
    ptx_mma_m16n8k8_f16_f32(t, lo, b[0], c);
    ptx_mma_m16n8k8_f16_f32(d, hi, b[1], t);
}
__device__ __forceinline__ void cuflash_sm75_zfill_check(int src_bytes, int size) {
#if defined(CUFLASH_SIM)
    if (src_bytes != 0 && src_bytes != size)
        cusim::fail("sm_75 copy: src_bytes %d must be 0 or the copy size %d (register-staged copies read all or nothing)",
                    src_bytes, size);
#else
    (void)src_bytes, (void)size;
#endif
}
template <typename V>
__device__ __forceinline__ void cuflash_sm75_copy(void* smem, const void* gmem, int src_bytes, int size) {
    cuflash_sm75_zfill_check(src_bytes, size);
    V v = {};
    if (src_bytes) v = *static_cast<const V*>(gmem);   // ld.global into registers
    *static_cast<V*>(smem) = v;                         // st.shared
}
__device__ __forceinline__ void ptx_cp_async_16(void* smem, const void* gmem) {
    const uint4 v = *static_cast<const uint4*>(gmem);
    *static_cast<uint4*>(smem) = v;
}
__device__ __forceinline__ void ptx_cp_async_16_zfill(void* smem, const void* gmem, int src_bytes) {
    cuflash_sm75_copy<uint4>(smem, gmem, src_bytes, 16);
}
__device__ __forceinline__ void ptx_cp_async_16_ignore_src(void* smem, const void* gmem, bool ignore) {
    cuflash_sm75_copy<uint4>(smem, gmem, ignore ? 0 : 16, 16);   // (ignored: not read)
}
__device__ __forceinline__ void ptx_cp_async_4_zfill(void* smem, const void* gmem, int src_bytes) {
    cuflash_sm75_copy<unsigned>(smem, gmem, src_bytes, 4);
}
__device__ __forceinline__ void ptx_cp_async_4_ignore_src(void* smem, const void* gmem, bool ignore) {
    cuflash_sm75_copy<unsigned>(smem, gmem, ignore ? 0 : 4, 4);   // (ignored: not read)
}
__device__ __forceinline__ void ptx_cp_async_8_zfill(void* smem, const void* gmem, int src_bytes) {
    cuflash_sm75_copy<uint2>(smem, gmem, src_bytes, 8);
}
__device__ __forceinline__ void ptx_cp_async_commit() {}
template <int N> __device__ __forceinline__ void ptx_cp_async_wait() {}
__device__ __forceinline__ void ptx_cp_async_wait_all() {}
// ld.global.nc.v4.u32 (16 bytes, 16-byte aligned; data the kernel never writes) into registers, in
// an asm volatile: NVVM keeps it where it is written, before a barrier or a tile's math that
// follows, where a plain load of const __restrict__ data is sunk to its first use (the forward's
// staged K/V tile: its loads moved past the math, next to their stores). The simulator reads the
// 16 bytes.
__device__ __forceinline__ uint4 ptx_ld_global_16(const void* gmem) {
#if defined(CUFLASH_SIM)
    return *static_cast<const uint4*>(gmem);
#else
    uint4 v;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(gmem));
    return v;
#endif
}
#endif  // CUFLASH_SM75_FORM

#if __CUDA_ARCH__ >= 900
// The 64-bit wgmma matrix descriptor (PTX ISA 9.7.15.5.1.2 "Matrix Descriptor Format"): bits 0-13
// start address, 16-29 leading-dimension byte offset, 32-45 stride-dimension byte offset (each
// (x & 0x3FFFF) >> 4), 49-51 base offset (0: tiles start where their swizzle pattern does),
// 62-63 swizzle: 0 none, 1 128 B, 2 64 B, 3 32 B. `swizzle_bytes` is 0, 32, 64 or 128.
__device__ __forceinline__ unsigned long long ptx_wgmma_desc(const void* smem, unsigned lbo_bytes, unsigned sbo_bytes, int swizzle_bytes) {
    const unsigned long long enc_start = (ptx_smem_addr(smem) & 0x3FFFFu) >> 4;
    const unsigned long long enc_lbo = (lbo_bytes & 0x3FFFFu) >> 4, enc_sbo = (sbo_bytes & 0x3FFFFu) >> 4;
    const unsigned long long mode = swizzle_bytes == 128 ? 1ull : swizzle_bytes == 64 ? 2ull : swizzle_bytes == 32 ? 3ull : 0ull;
    return enc_start | (enc_lbo << 16) | (enc_sbo << 32) | (mode << 62);
}
// The descriptor of the matrix `bytes` (a multiple of 16) past the one `desc` describes: its
// start-address field advanced by bytes >> 4, on the low 32 bits only (a shared-memory address
// is below 2^18, so the 14-bit field cannot carry into the leading byte offset). A loop builds a
// base descriptor once and steps it by constants, instead of masking and shifting an address
// for every wgmma.
__device__ __forceinline__ unsigned long long ptx_wgmma_desc_advance(unsigned long long desc, unsigned bytes) {
    return (desc & 0xFFFFFFFF00000000ull) | (unsigned)((unsigned)desc + (bytes >> 4));
}
// `x`, opaque to the compiler: an empty asm that reads and writes it (no instruction), so that
// what it is built from is not rebuilt or folded where it is used. The simulator has nothing to hide.
__device__ __forceinline__ unsigned long long ptx_opaque(unsigned long long x) {
#if !defined(CUFLASH_SIM)
    asm volatile("" : "+l"(x));
#endif
    return x;
}
// `x` pinned in its register here: an empty asm that reads and writes it (no instruction; CUTLASS's
// warpgroup_fence_operand). Around a wgmma batch it keeps NVVM from copying accumulators an
// unfinished wgmma still writes, after which ptxas serializes every wgmma (C7511). The simulator
// has no registers to pin.
__device__ __forceinline__ void ptx_fence_operand(float& x) {
#if !defined(CUFLASH_SIM)
    asm volatile("" : "+f"(x)::"memory");
#endif
}
// The first 1024-byte-aligned byte of a dynamic shared-memory area (the 128-byte swizzle's pattern
// boundary; the plan asks for 1 KB more than the tiles).
__device__ __forceinline__ unsigned char* ptx_align_smem_1024(unsigned char* smem) {
    return smem + ((1024u - (ptx_smem_addr(smem) & 1023u)) & 1023u);
}
#endif

// ---------------------------------------------------------------- fp8 (OCP E4M3) conversion
// cvt.rn.satfinite.e4m3x2.f32 (PTX ISA "cvt", sm_89+): two floats to two float8_e4m3fn bytes, `lo`
// in the low byte; round to nearest even, subnormals kept, a magnitude past 448 (and inf) saturates
// to +-448, NaN gives the canonical NaN 0x7f. Below sm_89, cuda_fp8.h's conversion with
// __NV_SATFINITE (the same rounding and saturation, in software); on the simulator,
// cusim::f32_to_e4m3_satfinite_bits (cusim_half.h).
#if defined(CUFLASH_SIM)
__device__ __forceinline__ unsigned short ptx_cvt_pack_e4m3x2(float lo, float hi) {
    return (unsigned short)(unsigned(cusim::f32_to_e4m3_satfinite_bits(lo)) |
                            (unsigned(cusim::f32_to_e4m3_satfinite_bits(hi)) << 8));
}
#elif __CUDA_ARCH__ >= 890
__device__ __forceinline__ unsigned short ptx_cvt_pack_e4m3x2(float lo, float hi) {
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(r) : "f"(hi), "f"(lo));   // first source -> upper byte
    return r;
}
#else
#include <cuda_fp8.h>
__device__ __forceinline__ unsigned short ptx_cvt_pack_e4m3x2(float lo, float hi) {
    return (unsigned short)__nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3);
}
#endif

// cvt.rn.f16x2.e4m3x2 (PTX ISA "cvt", sm_89+): two float8_e4m3fn bytes to two binary16 values, the
// low byte of `b` to the low half (as the f16x2 -> e4m3x2 direction packs upper to upper). Exact:
// every e4m3 value (subnormals m * 2^-9 included, largest 448) is a binary16 value; the NaN bytes
// 0x7f / 0xff give NaN. Below sm_89 and on the simulator, the same values decoded in software
// (cuflash_e4m3_to_f32: exact, no float subnormal involved) and packed by cvt.rn.f16x2.f32.
__device__ __forceinline__ float cuflash_e4m3_to_f32(unsigned b) {
    const unsigned em = b & 0x7fu;   // exponent and mantissa bits
    float mag = em >= 8u ? __uint_as_float((em + (120u << 3)) << 20) : float(em) * 0.001953125f;   // bias 7 -> 127; m * 2^-9
    if (em == 0x7fu) mag = __uint_as_float(0x7fc00000u);
    return (b & 0x80u) ? -mag : mag;
}
#if defined(CUFLASH_SIM) || __CUDA_ARCH__ < 890
__device__ __forceinline__ unsigned ptx_cvt_f16x2_e4m3x2(unsigned short b) {
    return ptx_cvt_pack_f16x2(cuflash_e4m3_to_f32(b & 0xffu), cuflash_e4m3_to_f32(unsigned(b) >> 8));
}
#else
__device__ __forceinline__ unsigned ptx_cvt_f16x2_e4m3x2(unsigned short b) {
    unsigned r;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(r) : "h"(b));
    return r;
}
#endif
