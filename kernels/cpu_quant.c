/* Weight-only quantized linears (kernels/quant.py owns the formats) on AMX tiles.
 *
 * rs_linear_quant: y[m, n] = bf16(sum_k x[m, k] bf16(w[n, k]) + b[n]) for x [M, K] and b [N] in bf16, fp32
 * sums rounded once, where w is the dequantized weight: int8 fp32(q) * scale, int4 fma(q, scale, min), each
 * rounded to bf16 (nearest even) -- so the result equals the bf16 tile linear (cpu_linear_amx.c) on those
 * bf16 weights. Values come packed in the tile order of native.pack_tiles ([N / 16][K / 32][16 pairs][16
 * columns][2]; int4 two per byte, pair rows 2r / 2r + 1 in the low / high nibbles of row r's 32 bytes), scales
 * (and mins) as [N / 16][K / g][16] fp32.
 *
 * Threads split the columns in groups of up to four blocks of 16 (fewer where K is long, so a group's bf16
 * panel stays within PANEL_BYTES of L2). Each group's weights are read once: dequantized into the thread's
 * panel, the tile layout's B operands, and multiplied by every row on the tiles (rs_tiles_group).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_tiles.h"

#if HAVE_AMX
#define PANEL_BYTES (512 << 10) /* a thread's dequantized bf16 weights: a quarter of a 2 MB L2 */

/* The 16 column scales of a group spread over a pair row's 32 lanes: lo = columns 0-7, hi = 8-15, each twice. */
AMX_TARGET static inline void spread(const float *s, __m512 *lo, __m512 *hi) {
    const __m512 v = _mm512_loadu_ps(s);
    const __m512i idx = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    *lo = _mm512_permutexvar_ps(idx, v);
    *hi = _mm512_permutexvar_ps(_mm512_add_epi32(idx, _mm512_set1_epi32(8)), v);
}

/* One pair row (32 values as int32, columns 0-7 then 8-15) to bf16 at out. */
AMX_TARGET static inline void put_pairs(__m512i q0, __m512i q1, __m512 s0, __m512 s1, const __m512 *m0,
                                        const __m512 *m1, uint16_t *out) {
    __m512 f0 = _mm512_cvtepi32_ps(q0), f1 = _mm512_cvtepi32_ps(q1);
    if (m0) {
        f0 = _mm512_fmadd_ps(f0, s0, *m0);
        f1 = _mm512_fmadd_ps(f1, s1, *m1);
    } else {
        f0 = _mm512_mul_ps(f0, s0);
        f1 = _mm512_mul_ps(f1, s1);
    }
    _mm512_storeu_si512((__m512i *)out, (__m512i)_mm512_cvtne2ps_pbh(f1, f0));
}

/* Bytes of packed values per input of a 16-column block. */
#define BYTES_PER_K(int4) ((int4) ? 8 : 16)

/* The B operand of one block at inputs [k, k + 32) to out [16][16][2] bf16: src = the block's values at k, sc / mn
 * the block's [K / g][16] scales and mins. */
AMX_TARGET static void dequant_tile(int int4, const uint8_t *src, const float *sc, const float *mn, int64_t k,
                                    int64_t g, uint16_t *out) {
    __m512 s0, s1, m0 = _mm512_setzero_ps(), m1 = m0;
    for (int64_t i = k; i < k + 32; i += 4, out += 64) { /* two pair rows: 4 inputs x 16 columns */
        if (i == k || i % g == 0) {
            spread(sc + (i / g) * 16, &s0, &s1);
            if (mn) spread(mn + (i / g) * 16, &m0, &m1);
        }
        if (int4) { /* 32 bytes: low nibbles pair row p, high nibbles p + 1 */
            const __m512i b0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)src));
            const __m512i b1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(src + 16)));
            const __m512i low = _mm512_set1_epi32(15);
            put_pairs(_mm512_and_si512(b0, low), _mm512_and_si512(b1, low), s0, s1, &m0, &m1, out);
            put_pairs(_mm512_srli_epi32(b0, 4), _mm512_srli_epi32(b1, 4), s0, s1, &m0, &m1, out + 32);
            src += 32;
        } else { /* 64 bytes: pair rows p and p + 1 */
            for (int r = 0; r < 2; ++r)
                put_pairs(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + 32 * r))),
                          _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + 32 * r + 16))), s0, s1, NULL,
                          NULL, out + 32 * r);
            src += 64;
        }
    }
}

typedef struct { /* a packed quantized weight (quant.PackedQuant) */
    int int4;
    const uint8_t *data;
    const float *scales, *mins;
    int64_t K, g;
} qweight;

/* Block blk's B operand at inputs [k, k + 32) to out. */
AMX_TARGET static inline void block_tile(const qweight *w, int64_t blk, int64_t k, uint16_t *out) {
    const int64_t per = w->K / w->g * 16;
    dequant_tile(w->int4, w->data + (blk * w->K + k) * BYTES_PER_K(w->int4), w->scales + blk * per,
                 w->mins ? w->mins + blk * per : NULL, k, w->g, out);
}

#define PREFETCH_K 256 /* inputs ahead that a decode group asks the weight stream for */

/* Rows [0, rows <= 16) x the group of nblk <= 4 blocks from blk0, one row tile: per 32 inputs each block's B
 * operand is dequantized into buf (4 KB, L1) and multiplied at once, so the weights are read once and never
 * leave L1 as bf16. */
AMX_TARGET static void decode_group(const uint16_t *x, int rows, const qweight *w, int64_t blk0, int nblk,
                                    const uint16_t *b, uint16_t *y, int64_t N, tile_state *st, uint16_t *buf) {
    const int64_t K = w->K;
    if (st->loaded != rows * 64) {
        rs_tiles_configure(&st->cfg, rows, 0);
        _tile_loadconfig(&st->cfg);
        st->loaded = rows * 64;
    }
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = 0; k < K; k += 32) {
        for (int j = 0; j < nblk; ++j) {
            if (k + PREFETCH_K < K)
                for (int line = 0; line < 32 * BYTES_PER_K(w->int4); line += 64)
                    _mm_prefetch((const char *)(w->data + ((blk0 + j) * K + k + PREFETCH_K) * BYTES_PER_K(w->int4)
                                                + line), _MM_HINT_T0);
            block_tile(w, blk0 + j, k, buf + 512 * j);
        }
        _tile_loadd(4, x + k, 2 * K);
        _tile_loadd(5, buf, 64);
        _tile_dpbf16ps(0, 4, 5);
        if (nblk > 1) {
            _tile_loadd(6, buf + 512, 64);
            _tile_dpbf16ps(1, 4, 6);
        }
        if (nblk > 2) {
            _tile_loadd(7, buf + 1024, 64);
            _tile_dpbf16ps(2, 4, 7);
        }
        if (nblk > 3) {
            _tile_loadd(5, buf + 1536, 64);
            _tile_dpbf16ps(3, 4, 5);
        }
    }
    _tile_stored(0, st->c, 64);
    _tile_stored(1, st->c + 256, 64);
    _tile_stored(2, st->c + 512, 64);
    _tile_stored(3, st->c + 768, 64);
    for (int j = 0; j < nblk; ++j) rs_tiles_put_block(st->c + 256 * j, rows, b, (blk0 + j) * 16, y, N);
}

/* The calling thread's panel of at least `bytes` (kept between calls: OpenMP's threads persist). */
static uint16_t *panel(size_t bytes) {
    static __thread uint16_t *buf;
    static __thread size_t cap;
    if (bytes > cap) {
        free(buf);
        cap = (bytes + 4095) / 4096 * 4096;
        buf = aligned_alloc(64, cap);
        if (!buf) cap = 0;
    }
    return buf;
}

AMX_TARGET static int linear_quant(const uint16_t *x, int64_t M, const qweight *w, int64_t N, const uint16_t *b,
                                   uint16_t *y, int num_threads) {
    const int64_t K = w->K, fit = PANEL_BYTES / (32 * K), blocks = N / 16;
    const int64_t per = M <= 16 ? 4 : fit < 1 ? 1 : fit > 4 ? 4 : fit, groups = (blocks + per - 1) / per;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (groups > 1) reduction(| : failed)
    {
        tile_state st __attribute__((aligned(64)));
        tile_config saved __attribute__((aligned(64)));
        uint16_t *buf = panel(M <= 16 ? 4 * 1024 : (size_t)per * K * 32);
        st.loaded = -1;
        _tile_storeconfig(&saved);
#pragma omp for schedule(static)
        for (int64_t grp = 0; grp < groups; ++grp) {
            const int nblk = blocks - grp * per < per ? (int)(blocks - grp * per) : (int)per;
            if (!buf) {
                failed = 1;
            } else if (M <= 16) {
                decode_group(x, (int)M, w, grp * per, nblk, b, y, N, &st, buf);
            } else { /* the group's bf16 panel once, then every row over it */
                for (int j = 0; j < nblk; ++j)
                    for (int64_t k = 0; k < K; k += 32) block_tile(w, grp * per + j, k, buf + j * K * 16 + k * 16);
                rs_tiles_group(x, M, 0, M, buf, grp * per * 16, nblk, K, b, y, N, &st);
            }
        }
        amx_end(&saved);
    }
    return failed ? -2 : 0;
}
#endif

/* Returns 0; -1 where tiles cannot run (not the AVX-512 build, no AMX permission) or the shape is not one the
 * formats allow (N % 16, K % 32, g a multiple of 16 dividing K); -2 when a panel could not be allocated. */
int rs_linear_quant(const uint16_t *x, int64_t M, int int4, const uint8_t *data, const float *scales,
                    const float *mins, int64_t N, int64_t K, int64_t g, const uint16_t *b, uint16_t *y,
                    int num_threads) {
#if HAVE_AMX
    if (!amx_ready() || N % 16 != 0 || K % 32 != 0 || g <= 0 || g % 16 != 0 || K % g != 0 || (int4 && !mins))
        return -1;
    const qweight w = {int4, data, scales, mins, K, g};
    return M > 0 ? linear_quant(x, M, &w, N, b, y, num_threads) : 0;
#else
    (void)x, (void)M, (void)int4, (void)data, (void)scales, (void)mins, (void)N, (void)K, (void)g, (void)b, (void)y,
        (void)num_threads;
    return -1;
#endif
}
