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
// fp8 cache (CUFLASH_CACHE_FP8): the caches hold float8_e4m3fn bytes and each new element is
// quantized as it is stored: its value in the new rows' type (a rotated key rounded to that type
// first, as the NumPy path rounds it), divided by its (sequence, kv head) descale in float32
// (k_descale / v_descale, FA3's (B, Hk); absent: 1), rounded to e4m3 by
// cvt.rn.satfinite.e4m3x2.f32 (ptx.cuh): nearest even, +-448 past the range (480 and inf become
// 448), NaN the canonical 0x7f. cuflash/reference/fp8.py's quantize_e4m3 computes the same bytes.
// (The division is IEEE div.rn under -ftz=true: inputs and quotients below 2^-126 flush to 0, which
// e4m3, whose smallest subnormal is 2^-9, rounds to 0 anyway unless a descale is below ~1e-35.)
//
// Variant prelude (cuflash/kernels/kvcache_append.py): CUFLASH_ENTRY, CUFLASH_T (element type),
// CUFLASH_ROT_T (rotary table type: the element type or float), CUFLASH_THREADS, CUFLASH_CACHE_FP8
// (0 or 1).
#include "common.cuh"
#include "ptx.cuh"

typedef CUFLASH_T elem_t;
typedef CUFLASH_ROT_T rot_t;
#if CUFLASH_CACHE_FP8
typedef unsigned char cache_t;
#else
typedef elem_t cache_t;
#endif

// One element of a new row (or of a rotated query) stored: as it is, or quantized into an fp8 cache.
__device__ __forceinline__ void store_elem(elem_t* p, elem_t x, float) { *p = x; }
#if CUFLASH_CACHE_FP8
__device__ __forceinline__ void store_elem(unsigned char* p, elem_t x, float descale) {
    *p = (unsigned char)(ptx_cvt_pack_e4m3x2(to_float(x) / descale, 0.0f) & 0xffu);
}
#endif

// Rotate the pair (x1, x2) by the angle whose cosine and sine are c, s.
__device__ __forceinline__ void rotate_pair(float x1, float x2, float c, float s, float& y1, float& y2) {
    y1 = __fadd_rn(__fmul_rn(x1, c), -__fmul_rn(x2, s));
    y2 = __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s));
}

// Row `src` -> row `dst` (head_dim columns), the first rotary_dim rotated at table row `pos`
// (pos outside [0, seqlen_ro): NaN); into an fp8 cache each element quantized with `descale`.
template <class D>
__device__ __forceinline__ void copy_rotated(D* __restrict__ dst, const elem_t* __restrict__ src, int head_dim,
                                             int rotary_dim, int interleaved, const rot_t* __restrict__ cos_row,
                                             const rot_t* __restrict__ sin_row, bool pos_ok, float descale) {
    const int half = rotary_dim / 2;
    for (int c = threadIdx.x; c < head_dim; c += CUFLASH_THREADS) {
        if (c >= rotary_dim) {
            store_elem(dst + c, src[c], descale);
            continue;
        }
        const bool first = interleaved ? (c % 2 == 0) : (c < half);
        if (!first) continue;   // its pair's first column writes both
        const int j = interleaved ? c / 2 : c;
        const int c2 = interleaved ? c + 1 : c + half;
        float y1 = __int_as_float(0x7fffffff), y2 = y1;
        if (pos_ok) rotate_pair(to_float(src[c]), to_float(src[c2]), to_float(cos_row[j]), to_float(sin_row[j]), y1, y2);
        store_elem(dst + c, from_float<elem_t>(y1), descale);
        store_elem(dst + c2, from_float<elem_t>(y2), descale);
    }
}

extern "C" __global__ void __launch_bounds__(CUFLASH_THREADS)
CUFLASH_ENTRY(const elem_t* __restrict__ k_new, const elem_t* __restrict__ v_new, cache_t* __restrict__ k_cache,
              cache_t* __restrict__ v_cache, const elem_t* __restrict__ q, elem_t* __restrict__ q_rot,
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
              int capacity, int cache_flags, const float* __restrict__ k_descale,
              const float* __restrict__ v_descale, long long kd_batch_stride, long long kd_head_stride,
              long long vd_batch_stride, long long vd_head_stride) {
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
        cache_t* kd = k_cache + slot_b * kc_batch_stride + slot_row * kc_row_stride + h * kc_head_stride;
        cache_t* vd = v_cache + slot_b * vc_batch_stride + slot_row * vc_row_stride + h * vc_head_stride;
        // the descales of an fp8 cache (flags 16, 32: given; else 1)
        const float k_scale = (cache_flags & 16) ? k_descale[b * kd_batch_stride + h * kd_head_stride] : 1.0f;
        const float v_scale = (cache_flags & 32) ? v_descale[b * vd_batch_stride + h * vd_head_stride] : 1.0f;
        const bool pos_ok = p < seqlen_ro;
        const long long r = pos_ok ? p : 0;
        copy_rotated(kd, ks, head_dim, rotary_dim, interleaved, rot_cos + r * rot_row_stride, rot_sin + r * rot_row_stride,
                     pos_ok, k_scale);
        for (int c = threadIdx.x; c < head_dim_v; c += CUFLASH_THREADS) store_elem(vd + c, vs[c], v_scale);
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
                 rot_cos + r * rot_row_stride, rot_sin + r * rot_row_stride, pos_ok, 1.0f);
}
