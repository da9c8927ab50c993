// cuflash: the tensor-core attention forward (fp16/bf16, sm_80 and newer).
//
// Same algorithm, masks, arguments and results as attention_fwd_simt.cu (FlashAttention-2,
// Dao 2023, Algorithm 1, with the corrections of DESIGN.md §1), with the FA2 work split:
//
// * One thread block of NW warps owns a Br = 16 * NW query tile of one (batch, head); warp w owns
//   query rows [16w, 16w + 16) of it. Grid is 1-D (blockIdx.x = tile + num_q_tiles * (head +
//   Hq * batch); grid_coord in common.cuh), so gridDim.y/z never limit B*H.
// * S = Q K^T and O += P V run on tensor cores: mma.sync.aligned.m16n8k16, f16 or bf16 inputs,
//   f32 accumulators. Operands come from shared memory through ldmatrix (.x4; .trans for V,
//   which is stored key-major). Q's A fragments are loaded once into registers when the
//   head-dim bucket is <= 128 (CUFLASH_Q_IN_REGS); for 192/256 they are re-read from shared
//   memory every tile, which keeps the O accumulator (Dmax / 2 floats per lane) spill-free.
// * P never leaves registers: the S accumulator fragment of two adjacent 8-key blocks is exactly
//   the A fragment of one 16-key k-step (c[0..1] -> a[0]/a[2], c[2..3] -> a[1]/a[3]), packed to
//   16 bits with cvt.rn.{f16,bf16}x2.f32.
// * Softmax in the log2 domain (softmax_scale * log2(e) folded into scale_log2, exp2f). Each lane
//   holds two rows (g and g + 8 of its warp's slice); the row max is reduced over the 4 lanes of
//   a quad with __shfl_xor_sync every tile; the row sum stays per-lane (each lane's partial sum
//   is rescaled by the same alpha) and is reduced once, after the K/V loop.
// * Shared memory (dynamic, 16-bit elements): Q [Br][Dmax + 8], then two stages of K [Bc][Dmax+8]
//   and V [Bc][Dmax + 8]. Rows are padded by 16 bytes: the row pitch is an odd number of 16-byte
//   chunks for every bucket (64, 96, 128, 192, 256), so the 8 row addresses of one ldmatrix
//   phase and the 16-byte cp.async writes of 8 consecutive chunks hit distinct bank quads (no
//   bank conflicts, and unlike an XOR swizzle it also works for 12- and 24-chunk rows).
// * Pipeline: cp.async (16 bytes, .cg) with commit/wait groups. The prologue issues Q and the
//   first K/V tile as one group; at the top of iteration j the block issues tile j + 1 into the
//   other stage (its readers of iteration j - 1 are past the barrier) and commits, then waits
//   for all but that newest group, so the copy of tile j + 1 overlaps the math of tile j.
// * Masks are run-time: K/V tiles no row of the block can see are never visited (causal tiles
//   above the diagonal, tiles outside a window), and only tiles that straddle Sk, the diagonal
//   or a window edge pay for the per-element mask; interior tiles run unmasked.
// * Out of view: rows >= Sq / keys >= Sk and columns >= D / Dv are zero-filled by cp.async's
//   src-size (never read); zero V rows keep P * V finite. Output goes through shared memory (the
//   warp's own Q rows) and leaves as 16-byte stores of rows < Sq, columns < Dv.
//
// Needs 16-byte-aligned rows: q, k, v, out and all their strides multiples of 8 elements, and
// D, Dv multiples of 8 (cuflash/kernels/attention_fwd_mma.py: unsupported_reason; the dispatcher falls back
// to the SIMT kernel otherwise).
//
// Variant prelude (cuflash/kernels/attention_fwd_mma.py: AttentionFwdMma.defines()):
//   CUFLASH_ENTRY, CUFLASH_T (__half, __nv_bfloat16), CUFLASH_BF16 (0/1), CUFLASH_HEAD_DIM_MAX,
//   CUFLASH_BLOCK_M (Br = 16 * warps), CUFLASH_BLOCK_N (Bc), CUFLASH_THREADS, CUFLASH_Q_IN_REGS,
//   CUFLASH_SMEM_BYTES (checked below).
#include "ptx.cuh"

typedef CUFLASH_T elem_t;

#define BR CUFLASH_BLOCK_M
#define BC CUFLASH_BLOCK_N
#define DMAX CUFLASH_HEAD_DIM_MAX
#define NT CUFLASH_THREADS
#define NWARPS (NT / 32)
#define PITCH (DMAX + 8)              // shared-memory row pitch, elements
#define CHUNKS (DMAX / 8)             // 16-byte chunks per row
#define KSTEPS_D (DMAX / 16)          // k-steps of Q K^T
#define NFRAG_S (BC / 8)              // 8-key accumulator blocks of S
#define KSTEPS_N (BC / 16)            // k-steps of P V
#define NFRAG_O (DMAX / 8)            // 8-column accumulator blocks of O
#define STAGE_ELEMS (2 * BC * PITCH)  // one K tile and one V tile
#define LN2 0.6931471805599453f

static_assert(BR == 16 * NWARPS, "each warp owns 16 query rows");
static_assert(DMAX % 16 == 0 && BC % 16 == 0, "head-dim bucket and Bc must be multiples of 16");
static_assert(CHUNKS % 2 == 0, "the row pitch must be an odd number of 16-byte chunks");
static_assert(2 * (BR * PITCH + 2 * STAGE_ELEMS) == CUFLASH_SMEM_BYTES,
              "the variant's shared-memory size (cuflash/kernels/attention_fwd_mma.py) disagrees with this layout");

#include "mma_tile.cuh"

extern "C" __global__ void __launch_bounds__(NT)
CUFLASH_ENTRY(const elem_t* __restrict__ q, const elem_t* __restrict__ k, const elem_t* __restrict__ v,
              elem_t* __restrict__ out, float* __restrict__ lse,
              long long q_batch_stride, long long q_head_stride, long long q_row_stride,
              long long k_batch_stride, long long k_head_stride, long long k_row_stride,
              long long v_batch_stride, long long v_head_stride, long long v_row_stride,
              long long o_batch_stride, long long o_head_stride, long long o_row_stride,
              long long lse_batch_stride, long long lse_head_stride,
              int num_heads_q, int group_size, int seqlen_q, int seqlen_k, int head_dim, int head_dim_v,
              int num_q_tiles, float scale_log2, int window_left, int window_right) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    elem_t* q_s = reinterpret_cast<elem_t*>(smem_raw);   // [BR][PITCH]
    elem_t* kv_s = q_s + BR * PITCH;                     // [2 stages][K, V][BC][PITCH]

    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int g = lane / 4;   // fragment row group
    const int t = lane % 4;   // fragment column pair
    const GridCoord at = grid_coord(num_q_tiles, num_heads_q);
    const int tile = at.tile, head = at.head;
    const long long batch = at.batch;
    const int head_k = head / group_size;

    const int row0 = tile * BR;
    const int rows = min(BR, seqlen_q - row0);

    const elem_t* q_tile = q + batch * q_batch_stride + head * q_head_stride + row0 * q_row_stride;
    const elem_t* k_head = k + batch * k_batch_stride + head_k * k_head_stride;
    const elem_t* v_head = v + batch * v_batch_stride + head_k * v_head_stride;

    // Keys any row of this tile can see: [kv_lo, kv_hi).
    const IndexRange keys = window_key_range(row0, rows, seqlen_q, seqlen_k, window_left, window_right);
    const int kv_lo = keys.lo, kv_hi = keys.hi;
    const int n_tiles = (kv_hi - kv_lo + BC - 1) / BC;

    // Prologue: Q and the first K/V tile, one group. A tile that sees no key (causal with
    // Sq > Sk, a window that misses every key) loads nothing: its loop below never runs, so no
    // barrier would order other warps' Q copies before the epilogue's O writes into q_s.
    if (n_tiles > 0) {
        load_tile_async<BR>(q_s, q_tile, q_row_stride, rows, head_dim);
        load_tile_async<BC>(kv_s, k_head + kv_lo * k_row_stride, k_row_stride, min(BC, seqlen_k - kv_lo), head_dim);
        load_tile_async<BC>(kv_s + BC * PITCH, v_head + kv_lo * v_row_stride, v_row_stride, min(BC, seqlen_k - kv_lo),
                            head_dim_v);
    }
    ptx_cp_async_commit();

    // ldmatrix row addresses (elements, relative to a tile base) of this lane:
    //   A (Q, x4): matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15)
    //   B of Q K^T (K, x4): (keys 0-7, k 0-7), (keys 0-7, k 8-15), (keys 8-15, k 0-7), (keys 8-15, k 8-15)
    //   B of P V (V, x4.trans): (keys 0-7, cols 0-7), (keys 8-15, cols 0-7), (keys 0-7, cols 8-15), (keys 8-15, cols 8-15)
    const int mat = lane / 8, mrow = lane % 8;
    const int a_off = (16 * warp + (mat % 2) * 8 + mrow) * PITCH + (mat / 2) * 8;
    const int k_off = ((mat / 2) * 8 + mrow) * PITCH + (mat % 2) * 8;
    const int v_off = ((mat % 2) * 8 + mrow) * PITCH + (mat / 2) * 8;

    float o_acc[NFRAG_O][4];
#pragma unroll
    for (int i = 0; i < NFRAG_O; ++i) o_acc[i][0] = o_acc[i][1] = o_acc[i][2] = o_acc[i][3] = 0.0f;
    float m_row[2] = {CUFLASH_NEG_INF, CUFLASH_NEG_INF};   // running max, rows g and g + 8 (log2 domain)
    float l_row[2] = {0.0f, 0.0f};                         // this lane's part of the running sum
    const int qi0 = row0 + 16 * warp + g;                  // query index of row g (row g + 8: qi0 + 8)

#if CUFLASH_Q_IN_REGS
    unsigned q_frag[KSTEPS_D][4];
#endif

    for (int j = 0; j < n_tiles; ++j) {
        const int kv0 = kv_lo + j * BC;
        __syncthreads();   // every reader of the stage refilled below (iteration j - 1) is done
        if (j + 1 < n_tiles) {
            const int nk = kv0 + BC;
            elem_t* st = kv_s + ((j + 1) % 2) * STAGE_ELEMS;
            load_tile_async<BC>(st, k_head + nk * k_row_stride, k_row_stride, min(BC, seqlen_k - nk), head_dim);
            load_tile_async<BC>(st + BC * PITCH, v_head + nk * v_row_stride, v_row_stride, min(BC, seqlen_k - nk),
                                head_dim_v);
        }
        ptx_cp_async_commit();
        ptx_cp_async_wait<1>();   // everything but tile j + 1 has landed (this thread's copies)
        __syncthreads();          // ... and every thread's

#if CUFLASH_Q_IN_REGS
        if (j == 0) {
#pragma unroll
            for (int kk = 0; kk < KSTEPS_D; ++kk) ptx_ldmatrix_x4(q_frag[kk], q_s + a_off + kk * 16);
        }
#endif
        const elem_t* k_s = kv_s + (j % 2) * STAGE_ELEMS;
        const elem_t* v_s = k_s + BC * PITCH;

        // S = Q K^T (16 x BC per warp)
        float s[NFRAG_S][4];
#pragma unroll
        for (int n = 0; n < NFRAG_S; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < KSTEPS_D; ++kk) {
#if CUFLASH_Q_IN_REGS
            const unsigned(&a)[4] = q_frag[kk];
#else
            unsigned a[4];
            ptx_ldmatrix_x4(a, q_s + a_off + kk * 16);
#endif
#pragma unroll
            for (int np = 0; np < NFRAG_S / 2; ++np) {
                unsigned b[4];
                ptx_ldmatrix_x4(b, k_s + k_off + np * 16 * PITCH + kk * 16);
                const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
                mma16816(s[2 * np], a, b0);
                mma16816(s[2 * np + 1], a, b1);
            }
        }

        // Scale (log2 domain) and mask. A tile needs the per-element mask only if it reaches past
        // Sk or some row of the block has a window edge inside it.
        const bool need_mask = kv0 + BC > seqlen_k ||
                               !tile_in_window(row0, BR, kv0, BC, seqlen_q, seqlen_k, window_left, window_right);
        if (need_mask) {
#pragma unroll
            for (int n = 0; n < NFRAG_S; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int kj = kv0 + 8 * n + 2 * t + (e & 1);
                    const IndexRange keys_seen =   // the keys query row qi0 + 8 * (e >> 1) sees
                        window_key_range(qi0 + (e >> 1) * 8, 1, seqlen_q, seqlen_k, window_left, window_right);
                    const bool visible = kj >= keys_seen.lo && kj < keys_seen.hi;
                    s[n][e] = visible ? s[n][e] * scale_log2 : CUFLASH_NEG_INF;
                }
        } else {
#pragma unroll
            for (int n = 0; n < NFRAG_S; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[n][e] *= scale_log2;
        }

        // Online softmax: rows g (elements 0, 1) and g + 8 (elements 2, 3).
        float alpha[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float mx = m_row[h];
#pragma unroll
            for (int n = 0; n < NFRAG_S; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * h], s[n][2 * h + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(CUFLASH_FULL_MASK, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(CUFLASH_FULL_MASK, mx, 2));
            const float shift = mx == CUFLASH_NEG_INF ? 0.0f : mx;   // no -inf - -inf
            alpha[h] = exp2f(m_row[h] - shift);
            m_row[h] = mx;
            float sum = 0.0f;
#pragma unroll
            for (int n = 0; n < NFRAG_S; ++n) {
                s[n][2 * h] = exp2f(s[n][2 * h] - shift);
                s[n][2 * h + 1] = exp2f(s[n][2 * h + 1] - shift);
                sum += s[n][2 * h] + s[n][2 * h + 1];
            }
            l_row[h] = l_row[h] * alpha[h] + sum;
        }
#pragma unroll
        for (int i = 0; i < NFRAG_O; ++i) {
            o_acc[i][0] *= alpha[0];
            o_acc[i][1] *= alpha[0];
            o_acc[i][2] *= alpha[1];
            o_acc[i][3] *= alpha[1];
        }

        // O += P V: P's A fragments straight from the S accumulators.
#pragma unroll
        for (int kk = 0; kk < KSTEPS_N; ++kk) {
            const unsigned a[4] = {pack2(s[2 * kk][0], s[2 * kk][1]), pack2(s[2 * kk][2], s[2 * kk][3]),
                                   pack2(s[2 * kk + 1][0], s[2 * kk + 1][1]), pack2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int dp = 0; dp < NFRAG_O / 2; ++dp) {
                unsigned b[4];
                ptx_ldmatrix_x4_trans(b, v_s + v_off + kk * 16 * PITCH + dp * 16);
                const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
                mma16816(o_acc[2 * dp], a, b0);
                mma16816(o_acc[2 * dp + 1], a, b1);
            }
        }
    }
    // No cp.async is in flight here: the last iteration issued nothing (its group is empty) and
    // waited for everything before it, and a tile without keys issued nothing at all. (A wait
    // here was redundant; the mutation suite, tests/test_mutations.py, showed no test can tell.)

    // Epilogue: finish the row sums, normalize, stage O in this warp's own Q rows, store.
    float inv_l[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float l = l_row[h];
        l += __shfl_xor_sync(CUFLASH_FULL_MASK, l, 1);
        l += __shfl_xor_sync(CUFLASH_FULL_MASK, l, 2);
        l_row[h] = l;
        inv_l[h] = l != 0.0f ? 1.0f / l : 0.0f;   // l == 0: no key (O = 0); NaN l stays NaN
    }
    __syncwarp();   // this warp's ldmatrix reads of its Q rows are done
    elem_t* o_s = q_s + 16 * warp * PITCH;
#pragma unroll
    for (int i = 0; i < NFRAG_O; ++i) {
        const int c = 8 * i + 2 * t;
        *reinterpret_cast<unsigned*>(o_s + g * PITCH + c) = pack2(o_acc[i][0] * inv_l[0], o_acc[i][1] * inv_l[0]);
        *reinterpret_cast<unsigned*>(o_s + (g + 8) * PITCH + c) = pack2(o_acc[i][2] * inv_l[1], o_acc[i][3] * inv_l[1]);
    }
    __syncwarp();
    const int wrow0 = row0 + 16 * warp;
    elem_t* o_warp = out + batch * o_batch_stride + head * o_head_stride + wrow0 * o_row_stride;
#pragma unroll
    for (int i = 0; i < (16 * CHUNKS + 31) / 32; ++i) {
        const int e = lane + 32 * i;
        const int r = e / CHUNKS;
        const int c = e - r * CHUNKS;
        if ((16 * CHUNKS % 32 == 0 || e < 16 * CHUNKS) && wrow0 + r < seqlen_q && c * 8 < head_dim_v)
            *reinterpret_cast<uint4*>(o_warp + r * o_row_stride + c * 8) = *reinterpret_cast<const uint4*>(o_s + r * PITCH + c * 8);
    }
    if (t == 0) {
        float* lse_head = lse + batch * lse_batch_stride + head * lse_head_stride;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int qi = qi0 + 8 * h;
            if (qi < seqlen_q) lse_head[qi] = l_row[h] != 0.0f ? m_row[h] * LN2 + logf(l_row[h]) : CUFLASH_NEG_INF;
        }
    }
}
