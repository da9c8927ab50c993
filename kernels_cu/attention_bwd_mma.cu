// cuflash: the tensor-core attention backward, main stage (fp16/bf16, sm_80 and newer).
//
// Replaces stage 1 of attention_bwd_simt.cu and takes exactly its arguments; stages 0 (Dd =
// rowsum(dO * O)) and 2 (the float32 dQ workspace to the input dtype, with the deterministic
// mode's fixed-order reduction of the partials) are the SIMT file's (cuflash/kernels/attention_bwd_mma.py).
//
// FlashAttention-2's split (Dao 2023, Algorithm 2): one block of NW warps owns a Bc-key tile of
// one (kv head, batch) (the launch covers tiles [tile0, tile_end): block s runs tiles tile0 + s,
// tile0 + s + num_splits, ...; one launch with num_splits = num_k_tiles by default, and in
// deterministic mode num_splits < num_k_tiles, each block looping over its tiles in order); the
// warps form Bc / 16 key groups of DSPLIT warps: warp w owns keys [16 kw, 16 kw + 16), kw =
// w % (NW / DSPLIT), and columns [dc0, dc0 + Dmax / DSPLIT) of their dK and dV (DSPLIT = 2 for
// the 128 bucket keeps dK + dV at 64 registers per thread; the warps of a group each compute
// S^T and dP^T of their keys, a duplicated 2 of the 5 GEMMs, in exchange for no spills). The block loops over the query heads of its kv head
// (GQA) and over the Br-row query tiles that can see the key tile. Per query tile, on tensor cores
// (mma.sync m16n8k16, f32 accumulators; operands from shared memory through ldmatrix):
//
//   S^T  = K Q^T    (warp: 16 keys x Br queries; A = K rows, B = Q rows, both non-transposed)
//   P^T  = exp2(S^T * scale * log2 e - lse * log2 e)     (masked elements 0; lse = -inf -> 0)
//   dP^T = V dO^T   (A = V rows, B = dO rows)
//   dS^T = P^T * (dP^T - Dd)                              (registers)
//   dV  += P^T dO   (A = P^T straight from the S^T accumulators, packed to 16 bits, as the
//                    forward's P; B = dO through ldmatrix.trans)
//   dK  += dS^T Q   (A = dS^T from the dP^T accumulators; B = Q through ldmatrix.trans)
//   dQ  += dS K     (dS^T is staged in shared memory as dS [Br][Bc]; warp (wm, wn) computes 16
//                    query rows x every warps_n-th 16-column chunk: A = dS rows, B = K through
//                    ldmatrix.trans; added to the float32 workspace with atomicAdd, or in
//                    deterministic mode with plain read-modify-writes of this thread's elements
//                    of its split's partial buffer, the key tiles in order, barriers between)
//
// dK and dV stay in registers for the whole loop (16 x Dmax per warp each) and are stored once,
// scaled (dK by softmax_scale), as 4-byte pairs. Masks, the Sk - Sq offset and rows without keys
// as in attention_bwd_simt.cu. Loads are cp.async (16 bytes, zero-filled beyond Sq/Sk and the
// head dims), so rows must be 16-byte aligned: q, k, v, dout and their strides multiples of 8
// elements, D and Dv multiples of 8 (cuflash/kernels/attention_bwd_mma.py: unsupported_reason; the
// dispatcher falls back to the SIMT backward otherwise).
//
// Shared memory (dynamic, 16-bit elements unless noted; row pitch Dmax + 8, an odd number of
// 16-byte chunks, so ldmatrix phases are conflict-free, as in the forward): K [Bc], V [Bc],
// Q [Br], dO [Br], dS [Br][Bc + 8], then lse (log2 domain) and Dd [Br] as float32.
//
// Variant prelude: CUFLASH_ENTRY, CUFLASH_T, CUFLASH_BF16, CUFLASH_HEAD_DIM_MAX, CUFLASH_BLOCK_M
// (Br), CUFLASH_BLOCK_N (Bc = 16 * warps / DSPLIT), CUFLASH_THREADS, CUFLASH_DSPLIT,
// CUFLASH_SMEM_BYTES (checked below).
#include "ptx.cuh"

typedef CUFLASH_T elem_t;

#define BR CUFLASH_BLOCK_M
#define BC CUFLASH_BLOCK_N
#define DMAX CUFLASH_HEAD_DIM_MAX
#define NT CUFLASH_THREADS
#define NWARPS (NT / 32)
#define PITCH (DMAX + 8)           // row pitch of K, V, Q, dO (elements)
#define DSP (BC + 8)               // row pitch of dS
#define CHUNKS (DMAX / 8)          // 16-byte chunks per row
#define KSTEPS_D (DMAX / 16)       // k-steps over the head dim
#define NFRAG_Q (BR / 8)           // 8-query accumulator blocks of S^T / dP^T
#define KSTEPS_Q (BR / 16)         // k-steps over the query tile
#define DSPLIT CUFLASH_DSPLIT      // warps sharing a key group, each owning a slice of dK / dV's columns
#define KWARPS (NWARPS / DSPLIT)   // key groups of 16 keys
#define DCOLS (DMAX / DSPLIT)      // dK / dV columns per warp
#define NFRAG_D (DCOLS / 8)        // 8-column accumulator blocks of dK / dV per warp
#define WARPS_M (BR / 16)          // dQ: warps along the query rows ...
#define WARPS_N (NWARPS / WARPS_M) // ... and along the 16-column chunks
#define LOG2E 1.4426950408889634f

static_assert(BC == 16 * KWARPS && NWARPS % DSPLIT == 0 && DCOLS % 16 == 0, "each key group owns 16 keys");
static_assert(BR % 16 == 0 && NWARPS % WARPS_M == 0, "dQ rows must split over the warps");
static_assert(DMAX % 16 == 0 && (CHUNKS % 2) == 0 && ((DSP / 8) % 2) == 1, "pitches must be odd chunk counts");
static_assert(2 * (2 * BC * PITCH + 2 * BR * PITCH + BR * DSP) + 4 * 2 * BR == CUFLASH_SMEM_BYTES,
              "the variant's shared-memory size (cuflash/kernels/attention_bwd_mma.py) disagrees with this layout");

#include "mma_tile.cuh"

extern "C" __global__ void __launch_bounds__(NT)
CUFLASH_ENTRY(const elem_t* __restrict__ q, const elem_t* __restrict__ k, const elem_t* __restrict__ v,
              const elem_t* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ dd,
              float* __restrict__ dq_accum, elem_t* __restrict__ dk, elem_t* __restrict__ dv,
              long long q_batch_stride, long long q_head_stride, long long q_row_stride,
              long long k_batch_stride, long long k_head_stride, long long k_row_stride,
              long long v_batch_stride, long long v_head_stride, long long v_row_stride,
              long long do_batch_stride, long long do_head_stride, long long do_row_stride,
              long long dk_batch_stride, long long dk_head_stride, long long dk_row_stride,
              long long dv_batch_stride, long long dv_head_stride, long long dv_row_stride,
              long long lse_batch_stride, long long lse_head_stride,
              int num_heads_k, int group_size, int seqlen_q, int seqlen_k, int head_dim, int head_dim_v,
              int num_k_tiles, float softmax_scale, int window_left, int window_right,
              int num_splits, long long dq_split_stride, int deterministic, int tile0, int tile_end) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    elem_t* k_s = reinterpret_cast<elem_t*>(smem_raw);   // [BC][PITCH]
    elem_t* v_s = k_s + BC * PITCH;                      // [BC][PITCH]
    elem_t* q_s = v_s + BC * PITCH;                      // [BR][PITCH]
    elem_t* do_s = q_s + BR * PITCH;                     // [BR][PITCH]
    elem_t* ds_s = do_s + BR * PITCH;                    // [BR][DSP]
    float* lse_s = reinterpret_cast<float*>(ds_s + BR * DSP);   // [BR], log2 domain
    float* dd_s = lse_s + BR;                                   // [BR]

    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int g = lane / 4;
    const int t = lane % 4;
    const GridCoord at = grid_coord(num_splits, num_heads_k);
    const int split = at.tile, head_k = at.head;
    const long long batch = at.batch;
    const int num_heads_q = num_heads_k * group_size;
    const float scale_log2 = softmax_scale * LOG2E;
    float* dq_part = dq_accum + (deterministic ? split * dq_split_stride : 0LL);

    // ldmatrix row addresses of this lane (elements, relative to a tile base), as in the forward:
    //   A, non-transposed (16 rows x 16 k): a_off; B from rows stored n-major: b_off;
    //   B from rows stored k-major (ldmatrix.trans): bt_off.
    const int mat = lane / 8, mrow = lane % 8;
    const int a_off = ((mat % 2) * 8 + mrow) * PITCH + (mat / 2) * 8;
    const int b_off = ((mat / 2) * 8 + mrow) * PITCH + (mat % 2) * 8;
    const int bt_off = ((mat % 2) * 8 + mrow) * PITCH + (mat / 2) * 8;
    const int ds_a_off = ((mat % 2) * 8 + mrow) * DSP + (mat / 2) * 8;
    const int wm = warp % WARPS_M, wn = warp / WARPS_M;   // this warp's dQ rows and column chunks
    const int kw = warp % KWARPS;                         // this warp's key group ...
    const int dc0 = (warp / KWARPS) * DCOLS;              // ... and first dK / dV column

    for (int tile = tile0 + split; tile < tile_end; tile += num_splits) {
        const int col0 = tile * BC;
        const int cols = min(BC, seqlen_k - col0);
        const int kj0 = col0 + 16 * kw + g;   // key of accumulator row g (row g + 8: kj0 + 8)
        const IndexRange key_rows[2] = {   // the query rows that see keys kj0 and kj0 + 8
            window_query_range(kj0, 1, seqlen_q, seqlen_k, window_left, window_right),
            window_query_range(kj0 + 8, 1, seqlen_q, seqlen_k, window_left, window_right)};

        __syncthreads();   // the previous key tile's readers of k_s / v_s are done
        load_tile_async<BC>(k_s, k + batch * k_batch_stride + head_k * k_head_stride + col0 * k_row_stride,
                            k_row_stride, cols, head_dim);
        load_tile_async<BC>(v_s, v + batch * v_batch_stride + head_k * v_head_stride + col0 * v_row_stride,
                            v_row_stride, cols, head_dim_v);
        ptx_cp_async_commit();

        // Query rows that can see a key of this tile: [row_lo, row_hi).
        const IndexRange rows_seen = window_query_range(col0, cols, seqlen_q, seqlen_k, window_left, window_right);
        const int row_lo = rows_seen.lo, row_hi = rows_seen.hi;

        float dk_acc[NFRAG_D][4], dv_acc[NFRAG_D][4];
#pragma unroll
        for (int i = 0; i < NFRAG_D; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) dk_acc[i][e] = dv_acc[i][e] = 0.0f;

        for (int hq = head_k * group_size; hq < (head_k + 1) * group_size; ++hq) {
            const elem_t* q_head = q + batch * q_batch_stride + hq * q_head_stride;
            const elem_t* do_head = dout + batch * do_batch_stride + hq * do_head_stride;
            const float* lse_head = lse + batch * lse_batch_stride + hq * lse_head_stride;
            const long long stat_row0 = (batch * num_heads_q + hq) * (long long)seqlen_q;
            for (int row0 = row_lo - (row_lo % BR); row0 < row_hi; row0 += BR) {
                const int rows = min(BR, seqlen_q - row0);
                // No barrier needed before refilling q_s, do_s, lse_s, dd_s: every read of them (the
                // S/dP and dK/dV mma, P and dS) precedes the "dS is complete" barrier of the previous
                // query tile, and ds_s / k_s, which the dQ step reads after it, are written only after
                // the barrier below (ds_s) or the key tile's own (k_s). (The mutation suite found the
                // barrier once here redundant; tests/test_mutations.py.)
                load_tile_async<BR>(q_s, q_head + row0 * q_row_stride, q_row_stride, rows, head_dim);
                load_tile_async<BR>(do_s, do_head + row0 * do_row_stride, do_row_stride, rows, head_dim_v);
                ptx_cp_async_commit();
                for (int r = tid; r < BR; r += NT) {
                    lse_s[r] = r < rows ? lse_head[row0 + r] * LOG2E : CUFLASH_NEG_INF;   // -inf stays -inf
                    dd_s[r] = r < rows ? dd[stat_row0 + row0 + r] : 0.0f;
                }
                ptx_cp_async_wait<0>();
                __syncthreads();

                // S^T = K Q^T and dP^T = V dO^T for this warp's 16 keys.
                float s[NFRAG_Q][4], dp[NFRAG_Q][4];
#pragma unroll
                for (int n = 0; n < NFRAG_Q; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.0f;
#pragma unroll
                for (int kk = 0; kk < KSTEPS_D; ++kk) {
                    unsigned ak[4], av[4];
                    ptx_ldmatrix_x4(ak, k_s + 16 * kw * PITCH + a_off + kk * 16);
                    ptx_ldmatrix_x4(av, v_s + 16 * kw * PITCH + a_off + kk * 16);
#pragma unroll
                    for (int np = 0; np < NFRAG_Q / 2; ++np) {
                        unsigned b[4];
                        ptx_ldmatrix_x4(b, q_s + b_off + np * 16 * PITCH + kk * 16);
                        const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
                        mma16816(s[2 * np], ak, b0);
                        mma16816(s[2 * np + 1], ak, b1);
                        ptx_ldmatrix_x4(b, do_s + b_off + np * 16 * PITCH + kk * 16);
                        const unsigned c0[2] = {b[0], b[1]}, c1[2] = {b[2], b[3]};
                        mma16816(dp[2 * np], av, c0);
                        mma16816(dp[2 * np + 1], av, c1);
                    }
                }

                // P^T (in s) and dS^T (in dp); element e of block n: key kj0 + 8 * (e >> 1),
                // query row0 + 8n + 2t + (e & 1).
#pragma unroll
                for (int n = 0; n < NFRAG_Q; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int r = 8 * n + 2 * t + (e & 1);
                        const int qi = row0 + r;
                        const int kj = kj0 + 8 * (e >> 1);
                        const float l = lse_s[r];
                        const bool visible = kj < seqlen_k && l != CUFLASH_NEG_INF &&
                                             qi >= key_rows[e >> 1].lo && qi < key_rows[e >> 1].hi;
                        const float p = visible ? exp2f(s[n][e] * scale_log2 - l) : 0.0f;
                        s[n][e] = p;
                        // 0, not 0 * (dP - D): a NaN in a V row or in D that this pair does not
                        // see must not reach dS (DESIGN.md §3: non-finite input travels only
                        // along visible pairs)
                        dp[n][e] = visible ? p * (dp[n][e] - dd_s[r]) : 0.0f;
                    }

                // dV += P^T dO, dK += dS^T Q; and dS^T -> ds_s as dS [query][key].
#pragma unroll
                for (int kk = 0; kk < KSTEPS_Q; ++kk) {
                    const unsigned ap[4] = {pack2(s[2 * kk][0], s[2 * kk][1]), pack2(s[2 * kk][2], s[2 * kk][3]),
                                            pack2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                            pack2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
                    const unsigned as[4] = {pack2(dp[2 * kk][0], dp[2 * kk][1]), pack2(dp[2 * kk][2], dp[2 * kk][3]),
                                            pack2(dp[2 * kk + 1][0], dp[2 * kk + 1][1]),
                                            pack2(dp[2 * kk + 1][2], dp[2 * kk + 1][3])};
#pragma unroll
                    for (int c = 0; c < NFRAG_D / 2; ++c) {
                        unsigned b[4];
                        ptx_ldmatrix_x4_trans(b, do_s + bt_off + kk * 16 * PITCH + dc0 + c * 16);
                        const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
                        mma16816(dv_acc[2 * c], ap, b0);
                        mma16816(dv_acc[2 * c + 1], ap, b1);
                        ptx_ldmatrix_x4_trans(b, q_s + bt_off + kk * 16 * PITCH + dc0 + c * 16);
                        const unsigned c0[2] = {b[0], b[1]}, c1[2] = {b[2], b[3]};
                        mma16816(dk_acc[2 * c], as, c0);
                        mma16816(dk_acc[2 * c + 1], as, c1);
                    }
                    // as[i] holds dS^T (key, query pair): a[0] key g, queries 16kk + 2t, +1;
                    // a[1] key g + 8; a[2], a[3]: queries + 8.
                    unsigned short* col = reinterpret_cast<unsigned short*>(ds_s) + 16 * kw + g;
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        if (dc0 != 0) break;   // one warp of the key group writes dS (warp-uniform)
                        const int qr = 16 * kk + 2 * t + 8 * (i >> 1);
                        const int kc = 8 * (i & 1);
                        col[qr * DSP + kc] = (unsigned short)(as[i] & 0xffffu);   // low half: query qr
                        col[(qr + 1) * DSP + kc] = (unsigned short)(as[i] >> 16);
                    }
                }
                __syncthreads();   // dS is complete

                // dQ (16 rows x 16-column chunks of this warp) += dS K, scaled.
                const int qr0 = 16 * wm;
                for (int c = wn; c < KSTEPS_D; c += WARPS_N) {
                    if (16 * c >= head_dim) break;   // warp-uniform
                    float acc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
                    for (int kk = 0; kk < BC / 16; ++kk) {
                        unsigned a[4], b[4];
                        ptx_ldmatrix_x4(a, ds_s + qr0 * DSP + ds_a_off + kk * 16);
                        ptx_ldmatrix_x4_trans(b, k_s + bt_off + kk * 16 * PITCH + c * 16);
                        const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
                        mma16816(acc[0], a, b0);
                        mma16816(acc[1], a, b1);
                    }
#pragma unroll
                    for (int h = 0; h < 2; ++h)
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const int r = qr0 + g + 8 * (e >> 1);
                            const int cc = 16 * c + 8 * h + 2 * t + (e & 1);
                            if (r < rows && cc < head_dim) {
                                float* dst = dq_part + (stat_row0 + row0 + r) * head_dim + cc;
                                if (deterministic) *dst += acc[h][e] * softmax_scale;   // this thread's element
                                else atomicAdd(dst, acc[h][e] * softmax_scale);
                            }
                        }
                }
            }
        }
        ptx_cp_async_wait<0>();   // with no query tile, K/V's group is still open

        // dK, dV of this warp's 16 keys: rows g, g + 8; columns 8i + 2t, +1.
        elem_t* dk_tile = dk + batch * dk_batch_stride + head_k * dk_head_stride;
        elem_t* dv_tile = dv + batch * dv_batch_stride + head_k * dv_head_stride;
#pragma unroll
        for (int i = 0; i < NFRAG_D; ++i) {
            const int c = dc0 + 8 * i + 2 * t;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int kj = kj0 + 8 * h;
                if (kj < seqlen_k) {
                    if (c < head_dim)
                        *reinterpret_cast<unsigned*>(dk_tile + kj * dk_row_stride + c) =
                            pack2(dk_acc[i][2 * h] * softmax_scale, dk_acc[i][2 * h + 1] * softmax_scale);
                    if (c < head_dim_v)
                        *reinterpret_cast<unsigned*>(dv_tile + kj * dv_row_stride + c) =
                            pack2(dv_acc[i][2 * h], dv_acc[i][2 * h + 1]);
                }
            }
        }
    }
}
