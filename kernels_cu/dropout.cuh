// cuflash: attention dropout's keep decisions, the same bits on every backend
// (cuflash/reference/dropout.py is the NumPy twin and says the convention).
//
// Pair (batch b, query head h, query row i, key j) is kept iff word j % 4 of
// Philox4x32-10(counter = (j / 4, i, h, b), key = (seed, offset)) is below `threshold` (an
// integer the host computes once); survivors are scaled by `scale` = 1 / (1 - p). Philox 4x32
// (Salmon et al., SC 2011; Random123's constants): each round multiplies words 0 and 2 by
// M0 / M1 (hi and lo halves, __umulhi), mixes in the key, and the key is bumped by the Weyl
// constants W0 / W1 between rounds.
#pragma once

#define CUFLASH_PHILOX_M0 0xD2511F53u
#define CUFLASH_PHILOX_M1 0xCD9E8D57u
#define CUFLASH_PHILOX_W0 0x9E3779B9u
#define CUFLASH_PHILOX_W1 0xBB67AE85u
#ifndef CUFLASH_PHILOX_UNROLL
#define CUFLASH_PHILOX_UNROLL 10   // rounds unrolled (a kernel short of registers may ask for fewer)
#endif

__device__ __forceinline__ uint4 philox4x32_10(uint4 c, unsigned k0, unsigned k1) {
#pragma unroll CUFLASH_PHILOX_UNROLL
    for (int r = 0; r < 10; ++r) {
        const unsigned hi0 = __umulhi(CUFLASH_PHILOX_M0, c.x), lo0 = CUFLASH_PHILOX_M0 * c.x;
        const unsigned hi1 = __umulhi(CUFLASH_PHILOX_M1, c.z), lo1 = CUFLASH_PHILOX_M1 * c.z;
        c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
        k0 += CUFLASH_PHILOX_W0;
        k1 += CUFLASH_PHILOX_W1;
    }
    return c;
}

// One call's dropout parameters (kernel arguments of the CUFLASH_DROPOUT variants).
struct DropoutArgs {
    unsigned seed, offset, threshold;
    float scale;
};

// The keep bits of keys `col` and `col + 1` of query row `row`: bit 0 for col, bit 1 for col + 1.
// One Philox call gives both unless they straddle two counters (col % 4 == 3: a second call for
// the next counter's word 0); a forward tile starts at the first key its rows see, so col may be
// odd.
__device__ __forceinline__ unsigned dropout_keep2(const DropoutArgs& d, unsigned batch, unsigned head, unsigned row,
                                                  unsigned col) {
    const uint4 w = philox4x32_10(make_uint4(col >> 2, row, head, batch), d.seed, d.offset);
    const unsigned sel = col & 3u;
    unsigned a, b;
    if (sel == 3u) {
        a = w.w;
        b = philox4x32_10(make_uint4((col >> 2) + 1u, row, head, batch), d.seed, d.offset).x;
    } else {
        a = sel == 0u ? w.x : (sel == 1u ? w.y : w.z);
        b = sel == 0u ? w.y : (sel == 1u ? w.z : w.w);
    }
    return (a < d.threshold ? 1u : 0u) | (b < d.threshold ? 2u : 0u);
}

// The keep bit of the one pair (row, col): word col % 4 of its counter, one Philox call (for a
// kernel whose threads hold keys that are not consecutive: the portable tier's).
__device__ __forceinline__ bool dropout_keep1(const DropoutArgs& d, unsigned batch, unsigned head, unsigned row,
                                              unsigned col) {
    const uint4 w = philox4x32_10(make_uint4(col >> 2, row, head, batch), d.seed, d.offset);
    const unsigned sel = col & 3u;
    const unsigned a = sel == 0u ? w.x : (sel == 1u ? w.y : (sel == 2u ? w.z : w.w));
    return a < d.threshold;
}

// A lane's keep bits for its part of an mma.sync S tile (m16n8 accumulator fragments: MF row
// fragments of 16 rows, NF column blocks of 8 keys; the lane holds rows row_base + 16 f + 8 h
// and keys col_base + 8 n + {0, 1}): bit 2 ((f * 2 + h) * NF + n) + c for key col_base + 8 n + c.
// Drawn one key pair at a time in a loop that is not unrolled, so that only one Philox call's
// registers are live beside the kernel's accumulators.
template <int MF, int NF>
__device__ __forceinline__ unsigned dropout_tile_bits(const DropoutArgs& d, unsigned batch, unsigned head, int row_base,
                                                      int col_base) {
    static_assert(MF * 2 * NF * 2 <= 32, "a lane's keep bits fit one register");
    unsigned bits = 0;
#pragma unroll 1
    for (int fhn = 0; fhn < MF * 2 * NF; ++fhn) {
        const int f = fhn / (2 * NF), h = fhn / NF % 2, n = fhn % NF;
        bits |= dropout_keep2(d, batch, head, (unsigned)(row_base + 16 * f + 8 * h), (unsigned)(col_base + 8 * n))
                << (2 * fhn);
    }
    return bits;
}
