/* bf16 linears for the few rows of a decode step, on the checkpoint's own row-major weights.
 *
 * rs_linear_bf16: y[m, n] = bf16(sum_k x[m, k] w[n, k] + b[n]) for x [M, K], w [N, K] and b [N]
 * in bf16, accumulated in fp32 and rounded once (as oneDNN's bf16 matmul). With a few rows, a
 * linear is a stream over its weights: threads split the output columns, each reads NB weight
 * rows at a time once and dots them with up to 4 input rows held in registers (an input row
 * group past the first re-reads the NB rows from L1). The weights stay as the checkpoint has them,
 * so the tied embedding is the LM head as it is, with no second copy.
 *
 * Two inner products: `use_dp` takes AVX512-BF16's vdpbf16ps (32 pairs a step, fp32 sums), built
 * with a target attribute inside the AVX-512 library and called only where the CPU has the flag
 * (native.py decides); otherwise bf16 is widened to fp32 (a shift) and multiplied with FMAs in the
 * vector layer of cpu_simd.h, on every instruction set.
 */
#include <stdint.h>
#include <string.h>

#include "cpu_simd.h"

#define NB 4 /* weight rows per tile */
#define MB 4 /* input rows per group */

RS_INLINE uint16_t f32_to_bf16(float f) { /* round to nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* out[j * NB + i] = x_j . w_i over k in [0, K), for j < mm, i < nn (widening path). Inlined with a
 * constant mm (tile_fma's switch), so the accumulators stay in registers. */
RS_INLINE void dot_fma(const uint16_t *x, int64_t K, const uint16_t *w, int nn, const int mm, float *out) {
    vf acc[NB][MB];
    for (int i = 0; i < NB; ++i)
        for (int j = 0; j < mm; ++j) acc[i][j] = vf_zero();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        vf xv[MB];
        for (int j = 0; j < mm; ++j) xv[j] = vf_load_bf16(x + j * K + k);
        for (int i = 0; i < NB; ++i) {
            if (i >= nn) break;
            const vf wv = vf_load_bf16(w + i * K + k);
            for (int j = 0; j < mm; ++j) acc[i][j] = vf_fmadd(wv, xv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < nn; ++i)
        for (int j = 0; j < mm; ++j) {
            float s = vf_hsum(acc[i][j]);
            for (int64_t t = k; t < K; ++t) s += bf16_to_f32(x[j * K + t]) * bf16_to_f32(w[i * K + t]);
            out[j * NB + i] = s;
        }
}

static void tile_fma(const uint16_t *x, int64_t K, const uint16_t *w, int nn, int mm, float *out) {
    switch (mm) {
    case 1: dot_fma(x, K, w, nn, 1, out); break;
    case 2: dot_fma(x, K, w, nn, 2, out); break;
    case 3: dot_fma(x, K, w, nn, 3, out); break;
    default: dot_fma(x, K, w, nn, MB, out);
    }
}

#if defined(__AVX512F__)
/* The same with vdpbf16ps (32 elements a step, masked tail). */
DP_TARGET RS_INLINE void dot_dp(const uint16_t *x, int64_t K, const uint16_t *w, int nn, const int mm, float *out) {
    __m512 acc[NB][MB];
    for (int i = 0; i < NB; ++i)
        for (int j = 0; j < mm; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        const __mmask32 m = K - k >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (K - k)) - 1u);
        __m512bh xv[MB];
        for (int j = 0; j < mm; ++j) xv[j] = (__m512bh)_mm512_maskz_loadu_epi16(m, x + j * K + k);
        for (int i = 0; i < NB; ++i) {
            if (i >= nn) break;
            const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(m, w + i * K + k);
            for (int j = 0; j < mm; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv, xv[j]);
        }
    }
    for (int i = 0; i < nn; ++i)
        for (int j = 0; j < mm; ++j) out[j * NB + i] = _mm512_reduce_add_ps(acc[i][j]);
}

DP_TARGET static void tile_dp(const uint16_t *x, int64_t K, const uint16_t *w, int nn, int mm, float *out) {
    switch (mm) {
    case 1: dot_dp(x, K, w, nn, 1, out); break;
    case 2: dot_dp(x, K, w, nn, 2, out); break;
    case 3: dot_dp(x, K, w, nn, 3, out); break;
    default: dot_dp(x, K, w, nn, MB, out);
    }
}
#endif

/* Returns 0, or -1 when use_dp is asked of a library built without AVX-512. */
int rs_linear_bf16(const uint16_t *x, int64_t M, const uint16_t *w, int64_t N, int64_t K, const uint16_t *b,
                   uint16_t *y, int num_threads, int use_dp) {
#if !defined(__AVX512F__)
    if (use_dp) return -1;
#endif
    const int64_t tiles = (N + NB - 1) / NB;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < tiles; ++t) {
        const int64_t n0 = t * NB;
        const int nn = N - n0 < NB ? (int)(N - n0) : NB;
        for (int64_t m0 = 0; m0 < M; m0 += MB) {
            const int mm = M - m0 < MB ? (int)(M - m0) : MB;
            float out[MB * NB];
#if defined(__AVX512F__)
            if (use_dp)
                tile_dp(x + m0 * K, K, w + n0 * K, nn, mm, out);
            else
#endif
                tile_fma(x + m0 * K, K, w + n0 * K, nn, mm, out);
            for (int j = 0; j < mm; ++j)
                for (int i = 0; i < nn; ++i)
                    y[(m0 + j) * N + n0 + i] = f32_to_bf16(out[j * NB + i] + (b ? bf16_to_f32(b[n0 + i]) : 0.0f));
        }
    }
    return 0;
}
