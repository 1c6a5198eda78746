/* Weight-only quantized linears in fp32, over the vector layer (cpu_simd.h), so in every build (AVX-512, AVX2,
 * portable): the kernel for activations in fp32, and for CPUs without bf16 dot products (AVX2-only x86, most
 * consumer CPUs), where cpu_quant.c and cpu_quant_vec.c cannot run. Same packed bytes (kernels/quant.py).
 *
 * A 32-input tile of a 16-column block is dequantized to fp32 (int8 fp32(q) * scale, int4 q * scale + min: the
 * definition of QuantWeight.dequantize, one rounding each) into 32 vectors kept in the packing's own order: vector
 * 2p + h holds pair row p (inputs k + 2p, k + 2p + 1) of columns 8h..8h+7, lane 2c + j being column 8h + c at
 * input k + 2p + j. A row's inputs k + 2p and k + 2p + 1 broadcast as a pair (vf_set1_pair) then multiply those
 * lanes directly, so the tile is never transposed; a column's two lanes add up at the end. fp32 sums throughout:
 * the result equals F.linear(x, dequantize(W)) up to the order of the fp32 sums.
 *
 * rs_quant_rows_f32: y [M, N] = x [M, K] W^T + b for up to 16 rows (decode), each tile dequantized once for all
 * rows; a single row skips the tile buffer and scales each group's sums of the integer values instead (as
 * cpu_quant_vec.c does), so its error bound is in terms of |q scale| + |min| rather than |w|.
 * rs_quant_dequant_f32: rows [n0, n1) of dequantize(W) as fp32 [n1 - n0][K], so that a prefill's many rows run as
 * one fp32 matmul (torch). flags as cpu_quant_vec.c's. Both return -1 where the shape cannot run.
 */
#include <stdint.h>
#include <string.h>

#include "cpu_qview.h"
#include "cpu_simd.h"

/* Group gi of block blk's 16 column scales (or mins, s) in fp32 (cpu_qview.h's qview_group), spread over the two
 * halves' lanes: lo[2c + j] = s[c], hi[2c + j] = s[8 + c]. */
static inline void spread16(const qview *w, const void *s, int64_t blk, int64_t gi, vf *lo, vf *hi) {
    const uint16_t *factors;
    const void *p = qview_group(w, s, blk, gi, &factors);
    const vf v = factors ? vf_mul(vf_load_f16(factors), vf_load_i8((const int8_t *)p))
                         : w->half ? vf_load_f16((const uint16_t *)p) : vf_loadu((const float *)p);
    vf_dup_pairs(v, lo, hi);
}

/* Group gi's 16 mins spread as its scales s0, s1 are: int4's own, or -8 times the scales (QF_SYM; exact). */
static inline void spread_mins(const qview *w, int64_t blk, int64_t gi, vf s0, vf s1, vf *m0, vf *m1) {
    if (w->mins) spread16(w, w->mins, blk, gi, m0, m1);
    else *m0 = vf_mul(s0, vf_set1(-8.0f)), *m1 = vf_mul(s1, vf_set1(-8.0f));
}

/* The 32 values of pair rows p and p + 1 (p even) of the tile whose bytes start at `tile`, unscaled (exact in
 * fp32): v[0..1] row p's halves, v[2..3] row p + 1's. */
static inline void pair_values(const qview *w, const uint8_t *tile, int p, vf *v) {
    if (!w->int4) {
        for (int r = 0; r < 2; ++r)
            for (int h = 0; h < 2; ++h) v[2 * r + h] = vf_load_i8((const int8_t *)tile + 32 * (p + r) + 16 * h);
        return;
    }
    typedef uint8_t bytes16 __attribute__((vector_size(16)));
    uint8_t nib[4][16];
    for (int h = 0; h < 2; ++h) { /* 32 bytes per two pair rows: low nibbles pair row p, high p + 1 */
        bytes16 b;
        memcpy(&b, tile + 16 * p + 16 * h, sizeof b);
        const bytes16 lo = b & 15, hi = b >> 4;
        memcpy(nib[h], &lo, sizeof lo), memcpy(nib[2 + h], &hi, sizeof hi);
    }
    for (int i = 0; i < 4; ++i) v[i] = vf_load_u8(nib[i]);
}

/* Block blk's tile at inputs [k, k + 32), dequantized into t[2p + h] (the file comment's order). */
static void tile_f32(const qview *w, int64_t blk, int64_t k, vf *t) {
    const int64_t bpk = w->int4 ? 8 : 16;
    const uint8_t *src = w->data + (blk * w->K + k) * bpk;
    vf s0 = vf_zero(), s1 = s0, m0 = s0, m1 = s0, v[4];
    for (int p = 0; p < 16; p += 2) {
        if (p == 0 || (k + 2 * p) % w->g == 0) { /* a group of 16 starts mid-tile (at p = 8) */
            spread16(w, w->scales, blk, (k + 2 * p) / w->g, &s0, &s1);
            if (w->int4) spread_mins(w, blk, (k + 2 * p) / w->g, s0, s1, &m0, &m1);
        }
        pair_values(w, src, p, v);
        for (int i = 0; i < 4; ++i)
            t[2 * p + i] = w->int4 ? vf_fmadd(v[i], i % 2 ? s1 : s0, i % 2 ? m1 : m0) : vf_mul(v[i], i % 2 ? s1 : s0);
    }
}

/* One row (single-stream decode) x block blk's 16 columns into y: no tile buffer; each group's products of the
 * integer values (exact in fp32) are summed, then scaled in fp32: acc += scale * sum + min * the group's inputs. */
static void block_row1_f32(const float *x, const qview *w, int64_t blk, const float *b, float *y) {
    const int64_t K = w->K, g = w->g, groups = K / g, bpk = w->int4 ? 8 : 16;
    vf a0 = vf_zero(), a1 = a0;
    for (int64_t gi = 0; gi < groups; ++gi) {
        vf s0, s1, p0 = vf_zero(), p1 = p0, xs = p0, v[4];
        for (int64_t k = gi * g; k < (gi + 1) * g; k += 4) { /* two pair rows (a group holds a multiple of 16) */
            const vf x0 = vf_set1_pair(x + k), x1 = vf_set1_pair(x + k + 2);
            pair_values(w, w->data + (blk * K + k / 32 * 32) * bpk, (int)(k % 32) / 2, v);
            p0 = vf_fmadd(v[0], x0, p0), p1 = vf_fmadd(v[1], x0, p1);
            p0 = vf_fmadd(v[2], x1, p0), p1 = vf_fmadd(v[3], x1, p1);
            if (w->int4) xs = vf_add(xs, vf_add(x0, x1));
        }
        spread16(w, w->scales, blk, gi, &s0, &s1);
        a0 = vf_fmadd(p0, s0, a0), a1 = vf_fmadd(p1, s1, a1);
        if (w->int4) {
            vf m0, m1;
            spread_mins(w, blk, gi, s0, s1, &m0, &m1);
            a0 = vf_fmadd(xs, m0, a0), a1 = vf_fmadd(xs, m1, a1);
        }
    }
    float acc[32] __attribute__((aligned(64)));
    vf_store(acc, a0), vf_store(acc + 16, a1);
    for (int c = 0; c < 16; ++c) y[blk * 16 + c] = acc[2 * c] + acc[2 * c + 1] + (b ? b[blk * 16 + c] : 0.0f);
}

/* Rows [0, M <= 16) x block blk's 16 columns into y (acc + bias). */
static void block_rows_f32(const float *x, int M, const qview *w, int64_t blk, const float *b, float *y, int64_t N) {
    float acc[16][32] __attribute__((aligned(64)));
    vf t[32];
    memset(acc, 0, sizeof(acc[0]) * (size_t)M);
    for (int64_t k = 0; k < w->K; k += 32) {
        tile_f32(w, blk, k, t);
        for (int m = 0; m < M; ++m) {
            const float *xr = x + m * w->K + k;
            vf a0 = vf_load(acc[m]), a1 = vf_load(acc[m] + 16);
            for (int p = 0; p < 16; ++p) {
                const vf pair = vf_set1_pair(xr + 2 * p);
                a0 = vf_fmadd(t[2 * p], pair, a0);
                a1 = vf_fmadd(t[2 * p + 1], pair, a1);
            }
            vf_store(acc[m], a0), vf_store(acc[m] + 16, a1);
        }
    }
    for (int m = 0; m < M; ++m)
        for (int c = 0; c < 16; ++c)
            y[m * N + blk * 16 + c] = acc[m][2 * c] + acc[m][2 * c + 1] + (b ? b[blk * 16 + c] : 0.0f);
}

int rs_quant_rows_f32(const float *x, int64_t M, int flags, const uint8_t *data, const void *scales,
                      const void *mins, int64_t N, int64_t K, int64_t g, const float *b, float *y, int num_threads) {
    if (M < 0 || M > 16 || !qview_valid(N, K, g, mins, flags)) return -1;
    const qview w = qview_of(flags, data, scales, mins, K, g);
#pragma omp parallel for num_threads(num_threads) schedule(static) if (N > 16)
    for (int64_t blk = 0; blk < N / 16; ++blk) {
        if (M == 1) block_row1_f32(x, &w, blk, b, y);
        else block_rows_f32(x, (int)M, &w, blk, b, y, N);
    }
    return 0;
}

int rs_quant_dequant_f32(int flags, const uint8_t *data, const void *scales, const void *mins, int64_t N, int64_t K,
                         int64_t g, int64_t n0, int64_t n1, float *out, int num_threads) {
    if (!qview_valid(N, K, g, mins, flags) || n0 % 16 || n1 % 16 || n0 < 0 || n1 > N || n1 <= n0) return -1;
    const qview w = qview_of(flags, data, scales, mins, K, g);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t blk = n0 / 16; blk < n1 / 16; ++blk) {
        vf t[32];
        float lanes[32][16] __attribute__((aligned(64)));
        float *rows = out + (blk * 16 - n0) * K;
        for (int64_t k = 0; k < K; k += 32) {
            tile_f32(&w, blk, k, t);
            for (int v = 0; v < 32; ++v) vf_store(lanes[v], t[v]);
            for (int p = 0; p < 16; ++p)
                for (int c = 0; c < 16; ++c)
                    for (int j = 0; j < 2; ++j)
                        rows[c * K + k + 2 * p + j] = lanes[2 * p + c / 8][2 * (c % 8) + j];
        }
    }
    return 0;
}
