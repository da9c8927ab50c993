// cuflash: the split-KV combine of cuflash.attention_with_kvcache (flash-decoding, Dao et al.
// 2023): the num_splits partial results of one query row, each a normalized float32 O_s and its
// LSE_s over a disjoint run of keys, become lse = log sum_s exp(LSE_s) and O = sum_s exp(LSE_s -
// lse) O_s (the same identity as cuflash.merge_attention and the online softmax).
//
// One warp per row (CUFLASH_THREADS / 32 rows per block). Partial row `row` of split s is
// o_partial[(s * partial_rows + row) * Dv + c] and lse_partial[s * partial_rows + row]; rows are
// ordered (batch, head, query row), as the attention kernel writes them. A split with LSE -inf
// (it saw no key) adds nothing and its O is never read, whatever it holds; a row with no key
// anywhere gives 0 and -inf. Every other split counts (cuflash.merge_attention's rule): a NaN LSE
// (a sequence whose index was out of range, a NaN input) makes the whole row NaN (the maximum
// skips it, fmaxf, but its weight exp(NaN) reaches the sum), and a NaN in the O of a split with a
// finite LSE reaches the row even when its weight rounds to 0.
//
// Variant prelude (cuflash/kernels/attention_combine.py): CUFLASH_ENTRY, CUFLASH_T (the output's
// element type), CUFLASH_THREADS, CUFLASH_MAX_SPLITS.
#include "common.cuh"

typedef CUFLASH_T elem_t;
#define WARPS (CUFLASH_THREADS / 32)

extern "C" __global__ void __launch_bounds__(CUFLASH_THREADS)
CUFLASH_ENTRY(const float* __restrict__ o_partial, const float* __restrict__ lse_partial, elem_t* __restrict__ out,
              float* __restrict__ lse, long long partial_rows, int num_splits, int num_heads_q, int seqlen_q,
              int head_dim_v, long long o_batch_stride, long long o_row_stride, long long o_head_stride,
              long long lse_batch_stride, long long lse_head_stride) {
    __shared__ float weight[WARPS][CUFLASH_MAX_SPLITS];
    __shared__ bool counted[WARPS][CUFLASH_MAX_SPLITS];   // LSE != -inf: the split's O is read
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const long long row = (long long)blockIdx.x * WARPS + warp;
    if (row >= partial_rows) return;   // warp-uniform; no block-wide barrier follows
    float m = CUFLASH_NEG_INF;
    for (int s = lane; s < num_splits; s += 32) m = fmaxf(m, lse_partial[s * partial_rows + row]);
#pragma unroll
    for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(CUFLASH_FULL_MASK, m, o));
    const float shift = m == CUFLASH_NEG_INF ? 0.0f : m;   // every split empty: weights exp(-inf) = 0
    float sum = 0.0f;
    for (int s = lane; s < num_splits; s += 32) {
        const float l = lse_partial[s * partial_rows + row];
        const float w = expf(l - shift);
        weight[warp][s] = w;
        counted[warp][s] = l != CUFLASH_NEG_INF;
        sum += w;
    }
#pragma unroll
    for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(CUFLASH_FULL_MASK, sum, o);
    __syncwarp();   // the weights are in shared memory for every lane
    const float inv = sum != 0.0f ? 1.0f / sum : 0.0f;   // NaN sum stays NaN
    const int h = (int)(row / seqlen_q % num_heads_q);
    const int i = (int)(row % seqlen_q);
    const long long b = row / seqlen_q / num_heads_q;
    elem_t* o_row = out + b * o_batch_stride + i * o_row_stride + h * o_head_stride;
    for (int c = lane; c < head_dim_v; c += 32) {
        float acc = 0.0f;
        for (int s = 0; s < num_splits; ++s) {
            if (counted[warp][s]) acc += weight[warp][s] * o_partial[(s * partial_rows + row) * head_dim_v + c];
        }
        o_row[c] = from_float<elem_t>(acc * inv);
    }
    if (lane == 0) lse[b * lse_batch_stride + h * lse_head_stride + i] = sum != 0.0f ? shift + logf(sum) : CUFLASH_NEG_INF;
}
