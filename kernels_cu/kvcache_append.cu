// cuflash: the KV-cache append of cuflash.attention_with_kvcache: the new keys and values are
// written into the cache in place (contiguous or paged), the keys rotated first, and the queries
// rotated into a workspace the attention kernel then reads.
//
// One block per row: blocks [0, B * Snew * Hk) take one new (key, value) row each, blocks past
// them (with rotary) one query row each; the block's threads stride over the row's columns.
// Positions are absolute cache indices (cuflash/reference/kvcache.py): new key t of sequence b is
// cache index seqlens[b] + t; query row i is rotated at seqlens[b] + i (q_per_row) or seqlens[b].
//
// Rotary embedding (Su et al. 2021, RoFormer, eq. 34), float32, each product and sum rounded on
// its own (__fmul_rn / __fadd_rn: no contraction into FMA), exactly as the NumPy path computes it,
// so the cache holds the same bits on every backend: x1' = x1 c - x2 s, x2' = x2 c + x1 s, with
// (x1, x2) the columns (j, j + rotary_dim / 2) (GPT-NeoX) or (2 j, 2 j + 1) (interleaved).
//
// Out-of-range indices (device-resident ones the host could not check): a row whose cache index
// lies outside [0, capacity), whose page entry lies outside [0, num_pages) or whose cache batch
// lies outside [0, num_batches) is not written at all (never another sequence's rows); a position
// past the rotary table rotates to NaN (the attention kernel reports the sequence NaN either way).
//
// Variant prelude (cuflash/kernels/kvcache_append.py): CUFLASH_ENTRY, CUFLASH_T (element type),
// CUFLASH_ROT_T (rotary table type: the element type or float), CUFLASH_THREADS.
#include "common.cuh"

typedef CUFLASH_T elem_t;
typedef CUFLASH_ROT_T rot_t;

// Rotate the pair (x1, x2) by the angle whose cosine and sine are c, s.
__device__ __forceinline__ void rotate_pair(float x1, float x2, float c, float s, float& y1, float& y2) {
    y1 = __fadd_rn(__fmul_rn(x1, c), -__fmul_rn(x2, s));
    y2 = __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s));
}

// Row `src` -> row `dst` (head_dim columns), the first rotary_dim rotated at table row `pos`
// (pos outside [0, seqlen_ro): NaN).
__device__ __forceinline__ void copy_rotated(elem_t* __restrict__ dst, const elem_t* __restrict__ src, int head_dim,
                                             int rotary_dim, int interleaved, const rot_t* __restrict__ cos_row,
                                             const rot_t* __restrict__ sin_row, bool pos_ok) {
    const int half = rotary_dim / 2;
    for (int c = threadIdx.x; c < head_dim; c += CUFLASH_THREADS) {
        if (c >= rotary_dim) {
            dst[c] = src[c];
            continue;
        }
        const bool first = interleaved ? (c % 2 == 0) : (c < half);
        if (!first) continue;   // its pair's first column writes both
        const int j = interleaved ? c / 2 : c;
        const int c2 = interleaved ? c + 1 : c + half;
        float y1 = __int_as_float(0x7fffffff), y2 = y1;
        if (pos_ok) rotate_pair(to_float(src[c]), to_float(src[c2]), to_float(cos_row[j]), to_float(sin_row[j]), y1, y2);
        dst[c] = from_float<elem_t>(y1);
        dst[c2] = from_float<elem_t>(y2);
    }
}

extern "C" __global__ void __launch_bounds__(CUFLASH_THREADS)
CUFLASH_ENTRY(const elem_t* __restrict__ k_new, const elem_t* __restrict__ v_new, elem_t* __restrict__ k_cache,
              elem_t* __restrict__ v_cache, const elem_t* __restrict__ q, elem_t* __restrict__ q_rot,
              const rot_t* __restrict__ rot_cos, const rot_t* __restrict__ rot_sin,
              long long kn_batch_stride, long long kn_row_stride, long long kn_head_stride,
              long long vn_batch_stride, long long vn_row_stride, long long vn_head_stride,
              long long kc_batch_stride, long long kc_row_stride, long long kc_head_stride,
              long long vc_batch_stride, long long vc_row_stride, long long vc_head_stride,
              long long q_batch_stride, long long q_row_stride, long long q_head_stride,
              long long qr_batch_stride, long long qr_row_stride, long long qr_head_stride,
              long long rot_row_stride, int batch, int seqlen_new, int seqlen_q, int num_heads_k, int num_heads_q,
              int head_dim, int head_dim_v, int rotary_dim, int interleaved, int q_per_row, int seqlen_ro,
              const int* __restrict__ cache_seqlens, int cache_seqlen, const int* __restrict__ cache_batch_idx,
              const int* __restrict__ block_table, long long block_table_stride, int page_size, int num_pages,
              int capacity, int cache_flags) {
    const long long row = blockIdx.x;
    const long long kv_rows = (long long)batch * seqlen_new * num_heads_k;
    if (row < kv_rows) {   // a new key and value
        const int h = (int)(row % num_heads_k);
        const int t = (int)(row / num_heads_k % seqlen_new);
        const long long b = row / num_heads_k / seqlen_new;
        const int len = (cache_flags & 1) ? cache_seqlens[b] : cache_seqlen;
        const int p = len + t;   // its cache index, and its rotary position
        if (len < 0 || p < 0 || p >= capacity) return;
        long long slot_b = b, slot_row = p;
        if (cache_flags & 8) {   // paged
            const int page = block_table[b * block_table_stride + p / page_size];
            if (page < 0 || page >= num_pages) return;
            slot_b = page, slot_row = p % page_size;
        } else if (cache_flags & 4) {
            const int cb = cache_batch_idx[b];
            if (cb < 0 || cb >= num_pages) return;
            slot_b = cb;
        }
        const elem_t* ks = k_new + b * kn_batch_stride + t * kn_row_stride + h * kn_head_stride;
        const elem_t* vs = v_new + b * vn_batch_stride + t * vn_row_stride + h * vn_head_stride;
        elem_t* kd = k_cache + slot_b * kc_batch_stride + slot_row * kc_row_stride + h * kc_head_stride;
        elem_t* vd = v_cache + slot_b * vc_batch_stride + slot_row * vc_row_stride + h * vc_head_stride;
        const bool pos_ok = p < seqlen_ro;
        const long long r = pos_ok ? p : 0;
        copy_rotated(kd, ks, head_dim, rotary_dim, interleaved, rot_cos + r * rot_row_stride, rot_sin + r * rot_row_stride,
                     pos_ok);
        for (int c = threadIdx.x; c < head_dim_v; c += CUFLASH_THREADS) vd[c] = vs[c];
        return;
    }
    const long long qrow = row - kv_rows;   // a query row to rotate
    const int h = (int)(qrow % num_heads_q);
    const int i = (int)(qrow / num_heads_q % seqlen_q);
    const long long b = qrow / num_heads_q / seqlen_q;
    const int len = (cache_flags & 1) ? cache_seqlens[b] : cache_seqlen;
    const long long p = (long long)len + (q_per_row ? i : 0);
    const bool pos_ok = p >= 0 && p < seqlen_ro;
    const long long r = pos_ok ? p : 0;
    copy_rotated(q_rot + b * qr_batch_stride + i * qr_row_stride + h * qr_head_stride,
                 q + b * q_batch_stride + i * q_row_stride + h * q_head_stride, head_dim, rotary_dim, interleaved,
                 rot_cos + r * rot_row_stride, rot_sin + r * rot_row_stride, pos_ok);
}
