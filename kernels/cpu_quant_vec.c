/* Weight-only quantized linears without AMX: AVX512-BF16 (vdpbf16ps) on the packed layout of kernels/quant.py
 * (the same bytes cpu_quant.c's tile kernel reads), for CPUs with AVX-512 and BF16 but no tiles (AMD Zen 4 / 5).
 *
 * rs_quant_rows: y = x W^T + b for up to 16 rows x [M, K] bf16 (decode). Threads split the 16-column blocks;
 * a block's weights are read once, 32 inputs at a time: its 16 pair rows become bf16 operands holding the
 * integer values themselves (exact: int4 by a 16-entry word table, int8 through fp32), and each row's dot
 * products over half a tile (16 inputs, 8 vdpbf16ps in two chains) add up per group; a group's sum is scaled in
 * fp32 (acc += scale * sum + min * the group's input sum), so the weights are never rounded.
 *
 * rs_quant_dequant_t: the dequantized weights of columns [n0, n1) as bf16 (each weight rounded once, nearest
 * even), transposed: out [K][n1 - n0], so that a prefill's many rows run as one bf16 matmul (torch's oneDNN).
 *
 * flags: QF_INT4 (int4 affine, else int8), QF_HALF (scales and mins fp16, else fp32); scales (and mins)
 * [N / 16][K / g][16]; the compact forms (QF_TWO_LEVEL, QF_SYM: cpu_qview.h) are cpu_quant_f32.c's, refused here. Both return -1 where this build or the shape cannot run them, -2 out of memory.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_qview.h"
#include "cpu_simd.h"

#if defined(__AVX512F__)
#define PREFETCH_INPUTS 128 /* inputs ahead that a block asks the weight stream for */

/* bf16 of 0..15 (an int4 value's exact bf16 by one word permute), twice over the 32 words of a table */
static const uint16_t INT4_WORDS[32] __attribute__((aligned(64))) = {
    0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};

/* 16 scales (or mins) at element `at`, in fp32 (fp16 widened: exact). */
DP_TARGET static inline __m512 load16(const void *s, int64_t at, int half) {
    if (half) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)s + at)));
    return _mm512_loadu_ps((const float *)s + at);
}

static inline int64_t bytes_per_k(int int4) { return int4 ? 8 : 16; }

/* The 16 pair rows of one 32-input tile (src: its packed bytes) as bf16 values, unscaled. */
DP_TARGET static inline void tile_values(int int4, const uint8_t *src, __m512i *v) {
    if (int4) { /* 32 bytes per two pair rows: low nibbles pair row 2r, high 2r + 1 */
        const __m512i table = _mm512_load_si512((const void *)INT4_WORDS), low = _mm512_set1_epi16(15);
        for (int r = 0; r < 8; ++r) {
            const __m512i u = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(src + 32 * r)));
            v[2 * r] = _mm512_permutexvar_epi16(_mm512_and_si512(u, low), table);
            v[2 * r + 1] = _mm512_permutexvar_epi16(_mm512_srli_epi16(u, 4), table);
        }
        return;
    }
    for (int p = 0; p < 16; ++p) {
        const __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + 32 * p))));
        const __m512 f1 =
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + 32 * p + 16))));
        v[p] = (__m512i)_mm512_cvtne2ps_pbh(f1, f0);
    }
}

/* sum over 8 pair rows of v * row's input pairs (xp: 8 uint32 = 16 bf16 inputs), in two chains */
DP_TARGET static inline __m512 dot_half(const __m512i *v, const uint32_t *xp, __m512 p0) {
    __m512 p1 = _mm512_setzero_ps();
    for (int j = 0; j < 8; j += 2) {
        p0 = _mm512_dpbf16_ps(p0, (__m512bh)v[j], (__m512bh)_mm512_set1_epi32((int)xp[j]));
        p1 = _mm512_dpbf16_ps(p1, (__m512bh)v[j + 1], (__m512bh)_mm512_set1_epi32((int)xp[j + 1]));
    }
    return _mm512_add_ps(p0, p1);
}

/* Rows [0, M <= 16) x block blk's 16 columns into y (bf16(acc + bias)); xsum [M][K / g] the rows' group sums. */
DP_TARGET static void block_rows(const uint16_t *x, int M, const qview *w, int64_t blk, const float *xsum,
                                 const uint16_t *b, uint16_t *y, int64_t N) {
    const int64_t K = w->K, g = w->g, groups = K / g, bpk = bytes_per_k(w->int4), sat = blk * groups * 16;
    float acc[16 * 16] __attribute__((aligned(64))), part[16 * 16] __attribute__((aligned(64)));
    const uint8_t *src = w->data + blk * K * bpk;
    __m512i v[16];
    int64_t gstart = 0, gi = 0;
    memset(acc, 0, sizeof(float) * 16 * (size_t)M);
    for (int64_t k = 0; k < K; k += 32, src += 32 * bpk) {
        if (k + PREFETCH_INPUTS < K)
            for (int64_t line = 0; line < 32 * bpk; line += 64)
                _mm_prefetch((const char *)(src + PREFETCH_INPUTS * bpk + line), _MM_HINT_T0);
        tile_values(w->int4, src, v);
        for (int h = 0; h < 2; ++h) {
            const int64_t kh = k + 16 * h;
            const int starts = kh == gstart, ends = kh + 16 == gstart + g;
            const __m512 s = ends ? load16(w->scales, sat + gi * 16, w->half) : _mm512_setzero_ps();
            const __m512 mn = ends && w->mins ? load16(w->mins, sat + gi * 16, w->half) : _mm512_setzero_ps();
            for (int m = 0; m < M; ++m) {
                const __m512 p = dot_half(v + 8 * h, (const uint32_t *)(x + m * K + kh),
                                          starts ? _mm512_setzero_ps() : _mm512_load_ps(part + 16 * m));
                if (!ends) {
                    _mm512_store_ps(part + 16 * m, p);
                    continue;
                }
                __m512 a = _mm512_fmadd_ps(p, s, _mm512_load_ps(acc + 16 * m));
                if (w->mins) a = _mm512_fmadd_ps(mn, _mm512_set1_ps(xsum[m * groups + gi]), a);
                _mm512_store_ps(acc + 16 * m, a);
            }
            if (ends) gstart += g, ++gi;
        }
    }
    const __m512 bias = b ? vf_load_bf16(b + blk * 16) : _mm512_setzero_ps();
    for (int m = 0; m < M; ++m)
        _mm256_storeu_si256((__m256i *)(y + m * N + blk * 16),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(acc + 16 * m), bias)));
}

/* xsum[m][gi] = the sum of row m's inputs over group gi (fp32, in input order). */
static void group_sums(const uint16_t *x, int64_t M, int64_t K, int64_t g, float *xsum) {
    for (int64_t m = 0; m < M; ++m)
        for (int64_t gi = 0; gi < K / g; ++gi) {
            float s = 0.0f;
            for (int64_t k = gi * g; k < (gi + 1) * g; ++k) {
                const uint32_t u = (uint32_t)x[m * K + k] << 16;
                float f;
                memcpy(&f, &u, sizeof f);
                s += f;
            }
            xsum[m * (K / g) + gi] = s;
        }
}

/* The 16 column scales of a group spread over a pair row's 32 lanes: lo = columns 0-7, hi = 8-15, each twice. */
DP_TARGET static inline void spread(__m512 v, __m512 *lo, __m512 *hi) {
    const __m512i idx = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    *lo = _mm512_permutexvar_ps(idx, v);
    *hi = _mm512_permutexvar_ps(_mm512_add_epi32(idx, _mm512_set1_epi32(8)), v);
}

/* Block blk's dequantized weights at inputs [k, k + 32) into out rows k.. (out [K][ld], columns from col). */
DP_TARGET static void dequant_tile_t(const qview *w, int64_t blk, int64_t k, uint16_t *out, int64_t ld) {
    const int64_t groups = w->K / w->g, at = (blk * groups + k / w->g) * 16, bpk = bytes_per_k(w->int4);
    __m512i v[16];
    __m512 s0, s1, m0 = _mm512_setzero_ps(), m1 = m0;
    /* words 0, 2, .., 30 (input k + 2p of the 16 columns), then 1, 3, .., 31 (input k + 2p + 1) */
    const __m512i split = _mm512_set_epi16(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1, 30, 28, 26,
                                           24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    tile_values(w->int4, w->data + (blk * w->K + k) * bpk, v);
    for (int p = 0; p < 16; ++p) {
        if (p == 0 || (k + 2 * p) % w->g == 0) { /* a group of 16 starts mid-tile */
            const int64_t a = at + ((k + 2 * p) / w->g - k / w->g) * 16;
            spread(load16(w->scales, a, w->half), &s0, &s1);
            if (w->mins) spread(load16(w->mins, a, w->half), &m0, &m1);
        }
        /* bf16 integers back to fp32: a shift (exact) */
        const __m512 f0 =
            _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v[p])), 16));
        const __m512 f1 =
            _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v[p], 1)), 16));
        const __m512 d0 = _mm512_fmadd_ps(f0, s0, m0), d1 = _mm512_fmadd_ps(f1, s1, m1);
        const __m512i pairs = _mm512_permutexvar_epi16(split, (__m512i)_mm512_cvtne2ps_pbh(d1, d0));
        _mm256_storeu_si256((__m256i *)(out + (k + 2 * p) * ld), _mm512_castsi512_si256(pairs));
        _mm256_storeu_si256((__m256i *)(out + (k + 2 * p + 1) * ld), _mm512_extracti64x4_epi64(pairs, 1));
    }
}

#endif

int rs_quant_rows(const uint16_t *x, int64_t M, int flags, const uint8_t *data, const void *scales, const void *mins,
                  int64_t N, int64_t K, int64_t g, const uint16_t *b, uint16_t *y, int num_threads) {
#if defined(__AVX512F__)
    if (M < 0 || M > 16 || !qview_valid(N, K, g, mins, flags) || (flags & (QF_TWO_LEVEL | QF_SYM))) return -1;
    const qview w = qview_of(flags, data, scales, mins, K, g);
    float *xsum = w.mins ? malloc(sizeof(float) * (size_t)(M * (K / g) + 1)) : NULL;
    if (w.mins && !xsum) return -2;
    if (xsum) group_sums(x, M, K, g, xsum);
#pragma omp parallel for num_threads(num_threads) schedule(static) if (N > 16)
    for (int64_t blk = 0; blk < N / 16; ++blk) block_rows(x, (int)M, &w, blk, xsum, b, y, N);
    free(xsum);
    return 0;
#else
    (void)x, (void)M, (void)flags, (void)data, (void)scales, (void)mins, (void)N, (void)K, (void)g, (void)b, (void)y,
        (void)num_threads;
    return -1;
#endif
}

int rs_quant_dequant_t(int flags, const uint8_t *data, const void *scales, const void *mins, int64_t N, int64_t K,
                       int64_t g, int64_t n0, int64_t n1, uint16_t *out, int num_threads) {
#if defined(__AVX512F__)
    if (!qview_valid(N, K, g, mins, flags) || (flags & (QF_TWO_LEVEL | QF_SYM)) || n0 % 16 || n1 % 16 || n0 < 0 ||
        n1 > N || n1 <= n0)
        return -1;
    const qview w = qview_of(flags, data, scales, mins, K, g);
#pragma omp parallel for num_threads(num_threads) schedule(static) collapse(2)
    for (int64_t blk = n0 / 16; blk < n1 / 16; ++blk)
        for (int64_t k = 0; k < K; k += 32) dequant_tile_t(&w, blk, k, out + (blk * 16 - n0), n1 - n0);
    return 0;
#else
    (void)flags, (void)data, (void)scales, (void)mins, (void)N, (void)K, (void)g, (void)n0, (void)n1, (void)out,
        (void)num_threads;
    return -1;
#endif
}
