/* Weight-only quantized linears (kernels/quant.py owns the formats) on AMX tiles.
 *
 * rs_linear_quant: y = x W^T + b for x [M, K] and b [N] in bf16, W the dequantized weight (int8 fp32(q) * scale,
 * int4 fma(q, scale, min)), fp32 sums, y rounded to bf16 once. Values come packed in the tile order of
 * native.pack_tiles ([N / 16][K / 32][16 pairs][16 columns][2]; int4 two per byte, pair rows 2r / 2r + 1 in the
 * low / high nibbles of row r's 32 bytes), scales (and mins) as [N / 16][K / g][16], fp32 or fp16. `flags`: 1 int4
 * (else int8), 2 fp16 scales and mins (else fp32), as cpu_quant_vec.c's (the kernel for CPUs without tiles).
 *
 * Up to 16 rows (decode) with groups of 32 or more, the B operands are the values themselves (small integers,
 * exact in bf16: int4 by a 16-entry word table, the cheapest conversion), and each group's sums are scaled in fp32
 * (fold_group: acc += scale * sum_k x q + min * sum_k x). Otherwise (more rows, or int8 groups of 16) each weight
 * is dequantized and rounded to bf16 (nearest even), so the result equals the bf16 tile linear
 * (cpu_linear_amx.c) on those bf16 weights.
 *
 * Threads split the columns in groups of up to four blocks of 16 (fewer where K is long, so a group's bf16
 * panel stays within PANEL_BYTES of L2). Each group's weights are read once: up to 16 rows, 32 inputs at a time
 * into a 4 KB buffer (L1) and multiplied at once; for more rows, dequantized into the thread's panel (the tile
 * layout's B operands) and multiplied by every row (rs_tiles_group).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_tiles.h"

#if HAVE_AMX
#define PANEL_BYTES (512 << 10) /* a thread's dequantized bf16 weights: a quarter of a 2 MB L2 */

/* 16 scales (or mins) at element `at`, in fp32 (fp16 widened: exact). */
AMX_TARGET static inline __m512 load16(const void *s, int64_t at, int half) {
    if (half) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)s + at)));
    return _mm512_loadu_ps((const float *)s + at);
}

/* The 16 column scales of a group spread over a pair row's 32 lanes: lo = columns 0-7, hi = 8-15, each twice. */
AMX_TARGET static inline void spread(__m512 v, __m512 *lo, __m512 *hi) {
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

typedef struct { /* a packed quantized weight (quant.PackedQuant) */
    int int4, half; /* half: scales and mins fp16, else fp32 */
    const uint8_t *data;
    const void *scales, *mins;
    int64_t K, g;
} qweight;

/* The B operand of one block at inputs [k, k + 32) to out [16][16][2] bf16: src = the block's values at k, at =
 * the element where the block's [K / g][16] scales (and mins) start. */
AMX_TARGET static void dequant_tile(const qweight *w, const uint8_t *src, int64_t at, int64_t k, uint16_t *out) {
    const int int4 = w->int4, half = w->half;
    const int64_t g = w->g;
    __m512 s0, s1, m0 = _mm512_setzero_ps(), m1 = m0;
    int64_t gi = k / g, next = k; /* one division a tile: the group's index, and where the next one starts */
    for (int64_t i = k; i < k + 32; i += 4, out += 64) { /* two pair rows: 4 inputs x 16 columns */
        if (i == next) {
            gi = i / g;
            next = (gi + 1) * g;
            spread(load16(w->scales, at + gi * 16, half), &s0, &s1);
            if (w->mins) spread(load16(w->mins, at + gi * 16, half), &m0, &m1);
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

/* Block blk's B operand at inputs [k, k + 32) to out. */
AMX_TARGET static inline void block_tile(const qweight *w, int64_t blk, int64_t k, uint16_t *out) {
    const int64_t per = w->K / w->g * 16;
    dequant_tile(w, w->data + (blk * w->K + k) * BYTES_PER_K(w->int4), blk * per, k, out);
}

/* bf16 of 0, 1, ..., 15: an int4 value's exact bf16 by one word permute */
static const uint16_t INT4_BF16[32] __attribute__((aligned(64))) = {
    0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};

/* Block blk's values (not scaled) at inputs [k, k + 32) as the bf16 B operand at out: exact, values are small
 * integers. int4 by table (two pair rows per 32 bytes), int8 through fp32. */
AMX_TARGET static void values_tile(const qweight *w, int64_t blk, int64_t k, uint16_t *out) {
    const uint8_t *src = w->data + (blk * w->K + k) * BYTES_PER_K(w->int4);
    if (w->int4) {
        const __m512i table = _mm512_load_si512((const void *)INT4_BF16), low = _mm512_set1_epi16(15);
        for (int r = 0; r < 8; ++r, src += 32, out += 64) {
            const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)src));
            _mm512_storeu_si512((void *)out, _mm512_permutexvar_epi16(_mm512_and_si512(v, low), table));
            _mm512_storeu_si512((void *)(out + 32), _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table));
        }
        return;
    }
    for (int p = 0; p < 16; ++p, src += 32, out += 32) {
        const __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)src)));
        const __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + 16))));
        _mm512_storeu_si512((void *)out, (__m512i)_mm512_cvtne2ps_pbh(f1, f0));
    }
}

#define PREFETCH_K 128 /* inputs ahead that a decode group asks the weight stream for */

/* The group's B operands at inputs [k, k + 32) into buf (nblk x 1 KB): values only where scales are applied to
 * the sums (`scaled` 0), else dequantized; asking for the weights PREFETCH_K inputs ahead. */
AMX_TARGET static void fill_step(const qweight *w, int64_t blk0, int nblk, int64_t k, int scaled, uint16_t *buf) {
    const int64_t K = w->K, bytes = BYTES_PER_K(w->int4);
    for (int j = 0; j < nblk; ++j) {
        if (k + PREFETCH_K < K)
            for (int64_t line = 0; line < 32 * bytes; line += 64)
                _mm_prefetch((const char *)(w->data + ((blk0 + j) * K + k + PREFETCH_K) * bytes + line), _MM_HINT_T0);
        if (scaled)
            block_tile(w, blk0 + j, k, buf + 512 * j);
        else
            values_tile(w, blk0 + j, k, buf + 512 * j);
    }
}

AMX_TARGET static inline void store_c(float *c) {
    _tile_stored(0, c, 64);
    _tile_stored(1, c + 256, 64);
    _tile_stored(2, c + 512, 64);
    _tile_stored(3, c + 768, 64);
}

/* Group gi's sums of values x inputs (in the C tiles) into acc, scaled: acc += scale * c (+ min * sum of the
 * group's inputs, xsum [rows][K / g]); the C tiles start again from zero. */
AMX_TARGET static void fold_group(const qweight *w, int rows, int64_t blk0, int nblk, int64_t gi, int64_t groups,
                                  const float *xsum, float *c, float *acc) {
    store_c(c);
    for (int j = 0; j < nblk; ++j) {
        const int64_t at = ((blk0 + j) * groups + gi) * 16;
        const __m512 s = load16(w->scales, at, w->half), mn = w->mins ? load16(w->mins, at, w->half) : s;
        for (int m = 0; m < rows; ++m) {
            __m512 a = _mm512_fmadd_ps(_mm512_loadu_ps(c + 256 * j + 16 * m), s, _mm512_load_ps(acc + 256 * j + 16 * m));
            if (w->mins) a = _mm512_fmadd_ps(mn, _mm512_set1_ps(xsum[m * groups + gi]), a);
            _mm512_store_ps(acc + 256 * j + 16 * m, a);
        }
    }
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

/* Rows [0, rows <= 16) x the group of nblk <= 4 blocks from blk0, one row tile: per 32 inputs each block's B
 * operand is made in buf (4 KB, L1) and multiplied at once, so the weights are read once and never leave L1 as
 * bf16. With groups of 32 inputs or more (`xsum` given) the operands are the values alone, exact in bf16, and
 * each group's sums are scaled (and offset) in fp32 (fold_group): the cheapest conversion, and no bf16 rounding
 * of the weights. Otherwise (int8 groups of 16) the operands are the dequantized weights. */
AMX_TARGET static void decode_group(const uint16_t *x, int rows, const qweight *w, int64_t blk0, int nblk,
                                    const float *xsum, const uint16_t *b, uint16_t *y, int64_t N, tile_state *st,
                                    uint16_t *buf) {
    const int64_t K = w->K;
    float acc[4 * 256] __attribute__((aligned(64)));
    if (st->loaded != rows * 64) {
        rs_tiles_configure(&st->cfg, rows, 0);
        _tile_loadconfig(&st->cfg);
        st->loaded = rows * 64;
    }
    memset(acc, 0, sizeof acc);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    fill_step(w, blk0, nblk, 0, xsum == NULL, buf);
    int64_t gi = 0, fold_at = w->g;
    const int64_t groups = K / w->g;
    for (int64_t k = 0; k < K; k += 32) {
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
        /* the next operands before folding this group: the tile products have finished by the time its sums
         * are stored (a tile store right after them waits for their latency) */
        if (k + 32 < K) fill_step(w, blk0, nblk, k + 32, xsum == NULL, buf);
        if (xsum && k + 32 == fold_at) { /* a group ends (counted: no division per step) */
            fold_group(w, rows, blk0, nblk, gi++, groups, xsum, st->c, acc);
            fold_at += w->g;
        }
    }
    if (!xsum) store_c(acc);
    for (int j = 0; j < nblk; ++j) rs_tiles_put_block(acc + 256 * j, rows, b, (blk0 + j) * 16, y, N);
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
    /* decode rows take the values-then-scale path where groups hold whole 32-input steps */
    const int scale_sums = M <= 16 && w->g % 32 == 0;
    float *xsum = scale_sums ? malloc(sizeof(float) * (size_t)(M * (K / w->g))) : NULL;
    if (scale_sums && !xsum) return -2;
    if (xsum) group_sums(x, M, K, w->g, xsum);
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
                decode_group(x, (int)M, w, grp * per, nblk, xsum, b, y, N, &st, buf);
            } else { /* the group's bf16 panel once, then every row over it */
                for (int j = 0; j < nblk; ++j)
                    for (int64_t k = 0; k < K; k += 32) block_tile(w, grp * per + j, k, buf + j * K * 16 + k * 16);
                rs_tiles_group(x, M, 0, M, buf, grp * per * 16, nblk, K, b, y, N, &st);
            }
        }
        amx_end(&saved);
    }
    free(xsum);
    return failed ? -2 : 0;
}
#endif

/* Returns 0; -1 where tiles cannot run (not the AVX-512 build, no AMX permission) or the shape is not one the
 * formats allow (N % 16, K % 32, g a multiple of 16 dividing K); -2 when a panel could not be allocated. */
int rs_linear_quant(const uint16_t *x, int64_t M, int flags, const uint8_t *data, const void *scales,
                    const void *mins, int64_t N, int64_t K, int64_t g, const uint16_t *b, uint16_t *y,
                    int num_threads) {
#if HAVE_AMX
    const int int4 = flags & 1;
    if (!amx_ready() || N % 16 != 0 || K % 32 != 0 || g <= 0 || g % 16 != 0 || K % g != 0 || (int4 && !mins) ||
        (flags & 12)) /* neither two-level scales nor implied mins (quant.linear takes those to cpu_quant_f32.c) */
        return -1;
    const qweight w = {int4, (flags & 2) != 0, data, scales, int4 ? mins : NULL, K, g};
    return M > 0 ? linear_quant(x, M, &w, N, b, y, num_threads) : 0;
#else
    (void)x, (void)M, (void)flags, (void)data, (void)scales, (void)mins, (void)N, (void)K, (void)g, (void)b, (void)y,
        (void)num_threads;
    return -1;
#endif
}
