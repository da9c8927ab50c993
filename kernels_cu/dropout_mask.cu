// cuflash: the dropout keep mask and the raw generator, as kernels (cuflash.kernels.dropout_mask):
// the same text the attention kernels include (dropout.cuh), run so that tests compare its bits
// with the NumPy path's and with Random123's known-answer vectors, and users can see the mask.
//
// CUFLASH_DROPOUT_RAW 0: the mask of (B, H, Sq, Sk) pairs as uint8 (one thread per key pair);
// 1: Philox4x32-10 of n given counters under one key.
#include "common.cuh"
#include "dropout.cuh"

#if !CUFLASH_DROPOUT_RAW
extern "C" __global__ void CUFLASH_ENTRY(unsigned char* __restrict__ keep, int batch, int heads, int seqlen_q,
                                         int seqlen_k, long long batch0, unsigned seed, unsigned offset,
                                         unsigned threshold) {
    const long long pair = (long long)blockIdx.x * blockDim.x + threadIdx.x;   // (b, h, i, j / 2)
    const int half = (seqlen_k + 1) / 2;
    const long long total = (long long)batch * heads * seqlen_q * half;
    if (pair >= total) return;
    const int j = (int)(pair % half) * 2;
    const long long bhi = pair / half;
    const int i = (int)(bhi % seqlen_q);
    const int h = (int)(bhi / seqlen_q % heads);
    const long long b = bhi / seqlen_q / heads;
    DropoutArgs d = {seed, offset, threshold, 1.0f};
    const unsigned bits = dropout_keep2(d, (unsigned)(b + batch0), (unsigned)h, (unsigned)i, (unsigned)j);
    unsigned char* row = keep + bhi * seqlen_k;
    row[j] = bits & 1u;
    if (j + 1 < seqlen_k) row[j + 1] = (bits >> 1) & 1u;
}

#else
extern "C" __global__ void CUFLASH_ENTRY(const unsigned* __restrict__ counters, unsigned* __restrict__ words, int n,
                                        unsigned k0, unsigned k1) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const uint4 w = philox4x32_10(make_uint4(counters[4 * i], counters[4 * i + 1], counters[4 * i + 2],
                                             counters[4 * i + 3]), k0, k1);
    words[4 * i] = w.x, words[4 * i + 1] = w.y, words[4 * i + 2] = w.z, words[4 * i + 3] = w.w;
}
#endif
