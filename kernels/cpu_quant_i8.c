/* Weight-only quantized linears with int8 activations, for decode rows on x86 CPUs with AVX2 (FMA, F16C): what
 * llama.cpp does on every CPU. Each row of x is quantized per block of B inputs (B = 32 where the weight's group
 * is a multiple of 32, else 16): d = max |x| / 127, q = nearbyint(x / d) (ties to even; d = 0 gives q = 0), so
 * x^ = d q. The weight's integer values multiply q in integer arithmetic (exact), each block's sums are scaled by
 * its d in fp32, each group's by the weight's scale, and int4's min multiplies the group's sum of x^ (the sum of
 * d * sum(q) over its blocks). The result is F.linear(x^, dequantize(W)) up to the order of the fp32 sums;
 * x^ is x up to d / 2 per element (kernels/quant_act.py's ``quantize_activations`` is the reference).
 *
 * Same packed bytes as the other quantized kernels (quant.py; cpu_qview.h). int4 values 0..15 are unsigned bytes:
 * vpmaddubsw multiplies a pair row's 16 columns x 2 inputs by the broadcast pair of q and adds each column's
 * two products into one int16 lane (|.| <= 2 * 15 * 127), 8 pair rows accumulate in int16 (<= 30,480) before
 * widening. int8 values are signed: widened to int16, vpmaddwd gives each column's pair sum in int32.
 *
 * rs_quant_rows_i8: y [M, N] = x^ [M, K] W^T + b, M <= 16 (fp32 x, b, y); returns -1 where the shape cannot run
 * and -2 where the library was built for a CPU other than x86-64 (the caller takes cpu_quant_f32.c).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_qview.h"

#define MAX_ROWS 16

#if defined(__x86_64__)
#include <immintrin.h>

#define I8_TARGET __attribute__((target("avx2,fma,f16c")))
#define I8_INLINE static inline __attribute__((always_inline)) I8_TARGET

/* Row x [K] quantized per block of B: q [K], d [K / B], and per block the sum of x^ (d * the sum of its q). */
static void quantize_row(const float *x, int64_t K, int64_t B, int8_t *q, float *d, float *xs) {
    for (int64_t b = 0; b < K / B; ++b) {
        float amax = 0.0f;
        for (int64_t k = b * B; k < (b + 1) * B; ++k) amax = fmaxf(amax, fabsf(x[k]));
        const float db = amax / 127.0f;
        int32_t sum = 0;
        for (int64_t k = b * B; k < (b + 1) * B; ++k) {
            const int v = db > 0.0f ? (int)nearbyintf(x[k] / db) : 0;
            q[k] = (int8_t)v, sum += v;
        }
        d[b] = db, xs[b] = db * (float)sum;
    }
}

/* Group gi of block blk's 16 column scales (or mins, s) in fp32 (cpu_qview.h's qview_group): columns 0-7 in lo,
 * 8-15 in hi. */
I8_INLINE void load16(const qview *w, const void *s, int64_t blk, int64_t gi, __m256 *lo, __m256 *hi) {
    const uint16_t *factors;
    const void *p = qview_group(w, s, blk, gi, &factors);
    if (factors) {
        const __m128i sub = _mm_loadu_si128((const __m128i *)p);
        *lo = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)factors)),
                            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sub)));
        *hi = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(factors + 8))),
                            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sub, 8))));
    } else if (w->half) {
        const uint16_t *h = (const uint16_t *)p;
        *lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
        *hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + 8)));
    } else {
        *lo = _mm256_loadu_ps((const float *)p), *hi = _mm256_loadu_ps((const float *)p + 8);
    }
}

/* Two int8 as the int16 pair one vpmaddubsw lane takes (pair16) or widened into the int32 vpmaddwd takes (pair32). */
static inline int16_t pair16(const int8_t *q) { int16_t v; memcpy(&v, q, 2); return v; }
static inline int32_t pair32(const int8_t *q) {
    return (int32_t)((uint32_t)(uint16_t)(int16_t)q[0] | (uint32_t)(uint16_t)(int16_t)q[1] << 16);
}

/* Two int4 sums of 16 columns in int16 lanes (low and high nibbles' pair rows), added in int32: columns 0-7 in lo,
 * 8-15 in hi. */
I8_INLINE void widen_sum(__m256i a0, __m256i a1, __m256i *lo, __m256i *hi) {
    *lo = _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(a0)),
                           _mm256_cvtepi16_epi32(_mm256_castsi256_si128(a1)));
    *hi = _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(a0, 1)),
                           _mm256_cvtepi16_epi32(_mm256_extracti128_si256(a1, 1)));
}

/* Block-of-B sums, int32 per column (lo: columns 0-7, hi: 8-15), of the B inputs from k (tile offset kt within
 * the 32-input tile at `tile`) against row q. */
I8_INLINE void dot_block(const qview *w, const uint8_t *tile, int64_t kt, int64_t B, const int8_t *q, __m256i *lo,
                         __m256i *hi) {
    if (w->int4) { /* byte row r: pair row 2r in the low nibbles, 2r + 1 in the high */
        const __m256i mask = _mm256_set1_epi8(15);
        __m256i a0 = _mm256_setzero_si256(), a1 = a0;
        for (int64_t r = kt / 4; r < (kt + B) / 4; ++r) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(tile + 32 * r));
            const __m256i vl = _mm256_and_si256(v, mask), vh = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
            a0 = _mm256_add_epi16(a0, _mm256_maddubs_epi16(vl, _mm256_set1_epi16(pair16(q + 4 * r))));
            a1 = _mm256_add_epi16(a1, _mm256_maddubs_epi16(vh, _mm256_set1_epi16(pair16(q + 4 * r + 2))));
        }
        widen_sum(a0, a1, lo, hi);
        return;
    }
    __m256i a0 = _mm256_setzero_si256(), a1 = a0;
    for (int64_t p = kt / 2; p < (kt + B) / 2; ++p) { /* pair row p: 16 columns x 2 inputs */
        const __m128i *row = (const __m128i *)(tile + 32 * p);
        const __m256i xp = _mm256_set1_epi32(pair32(q + 2 * p));
        a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128(row)), xp));
        a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128(row + 1)), xp));
    }
    *lo = a0, *hi = a1;
}

/* The B inputs from tile offset kt of the tile at `tile`, unpacked once for several rows: int4 as bytes 0..15,
 * wv[2i] / wv[2i + 1] the pair rows of byte row kt / 4 + i (low / high nibbles); int8 widened to int16, wv[2i] /
 * wv[2i + 1] columns 0-7 / 8-15 of pair row kt / 2 + i. */
I8_INLINE void unpack_block(const qview *w, const uint8_t *tile, int64_t kt, int64_t B, __m256i *wv) {
    if (w->int4) {
        const __m256i mask = _mm256_set1_epi8(15);
        for (int64_t i = 0; i < B / 4; ++i) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(tile + 32 * (kt / 4 + i)));
            wv[2 * i] = _mm256_and_si256(v, mask), wv[2 * i + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
        }
        return;
    }
    for (int64_t i = 0; i < B / 2; ++i) {
        const __m128i *row = (const __m128i *)(tile + 32 * (kt / 2 + i));
        wv[2 * i] = _mm256_cvtepi8_epi16(_mm_loadu_si128(row));
        wv[2 * i + 1] = _mm256_cvtepi8_epi16(_mm_loadu_si128(row + 1));
    }
}

/* dot_block over unpacked vectors (unpack_block's), q at the block's first input. */
I8_INLINE void dot_unpacked(const qview *w, const __m256i *wv, int64_t B, const int8_t *q, __m256i *lo, __m256i *hi) {
    if (w->int4) {
        __m256i a0 = _mm256_setzero_si256(), a1 = a0;
        for (int64_t i = 0; i < B / 4; ++i) {
            a0 = _mm256_add_epi16(a0, _mm256_maddubs_epi16(wv[2 * i], _mm256_set1_epi16(pair16(q + 4 * i))));
            a1 = _mm256_add_epi16(a1, _mm256_maddubs_epi16(wv[2 * i + 1], _mm256_set1_epi16(pair16(q + 4 * i + 2))));
        }
        widen_sum(a0, a1, lo, hi);
        return;
    }
    __m256i a0 = _mm256_setzero_si256(), a1 = a0;
    for (int64_t i = 0; i < B / 2; ++i) {
        const __m256i xp = _mm256_set1_epi32(pair32(q + 2 * i));
        a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(wv[2 * i], xp));
        a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(wv[2 * i + 1], xp));
    }
    *lo = a0, *hi = a1;
}

/* Rows [0, M) x block blk's 16 columns into y (+ bias): rows quantized in q (M x K), d and xs (M x K / B). One row
 * reads the tile straight into its sums; several unpack each block of it once for all. */
I8_INLINE void block_rows(const qview *w, int64_t blk, int M, int64_t B, const int8_t *q, const float *d,
                          const float *xs, const float *b, float *y, int64_t N) {
    const int64_t K = w->K, g = w->g, groups = K / g, bpk = w->int4 ? 8 : 16, nb = K / B;
    __m256 acc[MAX_ROWS][2], gacc[MAX_ROWS][2];
    __m256i wv[32];
    float xsum[MAX_ROWS];
    for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int64_t gi = 0; gi < groups; ++gi) {
        for (int m = 0; m < M; ++m) gacc[m][0] = gacc[m][1] = _mm256_setzero_ps(), xsum[m] = 0.0f;
        for (int64_t k = gi * g; k < (gi + 1) * g; k += B) {
            const uint8_t *tile = w->data + (blk * K + k / 32 * 32) * bpk;
            if (M > 1) unpack_block(w, tile, k % 32, B, wv);
            for (int m = 0; m < M; ++m) {
                __m256i lo, hi;
                const int8_t *qm = q + m * K + k / 32 * 32;
                if (M > 1) dot_unpacked(w, wv, B, qm + k % 32, &lo, &hi);
                else dot_block(w, tile, k % 32, B, qm, &lo, &hi);
                const __m256 db = _mm256_set1_ps(d[m * nb + k / B]);
                gacc[m][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), db, gacc[m][0]);
                gacc[m][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), db, gacc[m][1]);
                xsum[m] += xs[m * nb + k / B];
            }
        }
        __m256 s0, s1, m0 = _mm256_setzero_ps(), m1 = m0;
        load16(w, w->scales, blk, gi, &s0, &s1);
        if (w->mins) load16(w, w->mins, blk, gi, &m0, &m1);
        else if (w->int4) /* QF_SYM: -8 times the scales (exact) */
            m0 = _mm256_mul_ps(s0, _mm256_set1_ps(-8.0f)), m1 = _mm256_mul_ps(s1, _mm256_set1_ps(-8.0f));
        for (int m = 0; m < M; ++m) {
            acc[m][0] = _mm256_fmadd_ps(gacc[m][0], s0, acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(gacc[m][1], s1, acc[m][1]);
            if (w->int4) {
                const __m256 xv = _mm256_set1_ps(xsum[m]);
                acc[m][0] = _mm256_fmadd_ps(m0, xv, acc[m][0]), acc[m][1] = _mm256_fmadd_ps(m1, xv, acc[m][1]);
            }
        }
    }
    for (int m = 0; m < M; ++m) {
        __m256 o0 = acc[m][0], o1 = acc[m][1];
        if (b) {
            o0 = _mm256_add_ps(o0, _mm256_loadu_ps(b + blk * 16));
            o1 = _mm256_add_ps(o1, _mm256_loadu_ps(b + blk * 16 + 8));
        }
        _mm256_storeu_ps(y + m * N + blk * 16, o0), _mm256_storeu_ps(y + m * N + blk * 16 + 8, o1);
    }
}

I8_TARGET static void run_blocks(const qview *w, int64_t N, int M, int64_t B, const int8_t *q, const float *d,
                                 const float *xs, const float *b, float *y, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (N > 16)
    for (int64_t blk = 0; blk < N / 16; ++blk) {
        if (M == 1) block_rows(w, blk, 1, B, q, d, xs, b, y, N); /* constant M: one row's sums stay in registers */
        else block_rows(w, blk, M, B, q, d, xs, b, y, N);
    }
}

int rs_quant_rows_i8(const float *x, int64_t M, int flags, const uint8_t *data, const void *scales, const void *mins,
                     int64_t N, int64_t K, int64_t g, const float *b, float *y, int num_threads) {
    if (M < 0 || M > MAX_ROWS || !qview_valid(N, K, g, mins, flags)) return -1;
    if (M == 0) return 0;
    const qview w = qview_of(flags, data, scales, mins, K, g);
    const int64_t B = g % 32 == 0 ? 32 : 16;
    int8_t *q = malloc((size_t)(M * K));
    float *d = malloc(sizeof(float) * (size_t)(2 * M * (K / B)));
    if (!q || !d) return free(q), free(d), -3;
    float *xs = d + M * (K / B);
    for (int64_t m = 0; m < M; ++m) quantize_row(x + m * K, K, B, q + m * K, d + m * (K / B), xs + m * (K / B));
    run_blocks(&w, N, (int)M, B, q, d, xs, b, y, num_threads);
    free(q), free(d);
    return 0;
}
#else
int rs_quant_rows_i8(const float *x, int64_t M, int flags, const uint8_t *data, const void *scales, const void *mins,
                     int64_t N, int64_t K, int64_t g, const float *b, float *y, int num_threads) {
    (void)x, (void)M, (void)flags, (void)data, (void)scales, (void)mins, (void)N, (void)K, (void)g, (void)b, (void)y;
    (void)num_threads;
    return -2;
}
#endif
