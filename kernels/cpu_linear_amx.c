/* bf16 linears on AMX tiles over weights packed once for them.
 *
 * rs_linear_tiles: y[m, n] = bf16(sum_k x[m, k] w[n, k] + b[n]) for x [M, K] and b [N] in bf16, fp32
 * sums rounded once (as oneDNN's bf16 matmul), with w packed by native.pack_tiles as
 * [N / 16][K / 32][16][16][2]: for 16 output columns and 32 inputs, the 1 KB B operand of
 * tdpbf16ps (16 input pairs x 16 columns x the pair), so a column block's weights are one
 * contiguous stream. tdpbf16ps multiplies up to 16 rows x 32 inputs by it in one instruction: for the
 * few rows of a decode step the weights stream at the machine's read bandwidth whatever the row
 * count, where the FMA and vdpbf16ps kernels become compute-bound from a few rows on.
 *
 * Threads split the columns in groups of 64 (four column blocks). Within a group, rows go 32 at a
 * time (two row tiles x two column blocks, eight tiles in all), or 16 at a time with four column
 * blocks when a step has at most 16 rows, so each weight tile loaded serves every row it can. The
 * group's weights (64 x K x 2 bytes, at most a few hundred KB) stay in L2 across its row tiles; a
 * prefill's rows go in blocks of about 1 MB of inputs, each block over every column group.
 */
#include <stdint.h>
#include <string.h>

#include "cpu_tiles.h"

#if HAVE_AMX
#define GROUP 4                  /* column blocks of 16 per thread work item */
#define X_BLOCK_BYTES (1 << 20) /* inputs of a row block: half of a 2 MB L2 */


/* C tiles 0-3, A tiles 4 (and 5), B tiles 5-7 (or 6-7): one configuration per row split. */
AMX_TARGET void rs_tiles_configure(tile_config *cfg, int rows0, int rows1) {
    memset(cfg, 0, sizeof *cfg);
    cfg->palette = 1;
    for (int t = 0; t < 8; ++t) cfg->colsb[t] = 64, cfg->rows[t] = 16;
    if (rows1 == 0) { /* one row tile: C 0-3 = its columns blocks 0-3, A 4, B 5-7 */
        for (int t = 0; t < 5; ++t) cfg->rows[t] = rows0;
    } else { /* two: C 0-1 = rows0 x blocks 0-1, C 2-3 = rows1 x blocks 0-1, A 4 / 5, B 6-7 */
        cfg->rows[0] = cfg->rows[1] = cfg->rows[4] = rows0;
        cfg->rows[2] = cfg->rows[3] = cfg->rows[5] = rows1;
    }
}

/* y rows [0, rows) of columns [n0, n0 + 16) = bf16(c + bias), c a 16 x 16 fp32 tile image. */
AMX_TARGET void rs_tiles_put_block(const float *c, int rows, const uint16_t *b, int64_t n0, uint16_t *y, int64_t N) {
    const __m512 bias = b ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                _mm256_loadu_si256((const __m256i *)(b + n0))), 16))
                          : _mm512_setzero_ps();
    for (int r = 0; r < rows; ++r)
        _mm256_storeu_si256((__m256i *)(y + r * N + n0),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(c + 16 * r), bias)));
}

AMX_TARGET static inline void zero_c(void) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

/* The four accumulators to c (16 x 16 fp32 each, one after the other). */
AMX_TARGET static inline void store_c(float *c) {
    _tile_stored(0, c, 64);
    _tile_stored(1, c + 256, 64);
    _tile_stored(2, c + 512, 64);
    _tile_stored(3, c + 768, 64);
}

#define B_TILE(blk) (wg + ((blk) * K + k) * 16) /* the 1 KB B operand of the group's block blk at k */

/* Rows [m, m + rows) x blocks [0, nblk) of the group at n0 (weights from wg), one row tile (rows <= 16). */
AMX_TARGET static void rows16(const uint16_t *x, int rows, const uint16_t *wg, int64_t n0, int nblk, int64_t K,
                              const uint16_t *b, uint16_t *y, int64_t N, float *c) {
    zero_c();
    for (int64_t k = 0; k < K; k += 32) {
        _tile_loadd(4, x + k, 2 * K);
        _tile_loadd(5, B_TILE(0), 64);
        _tile_dpbf16ps(0, 4, 5);
        if (nblk > 1) {
            _tile_loadd(6, B_TILE(1), 64);
            _tile_dpbf16ps(1, 4, 6);
        }
        if (nblk > 2) {
            _tile_loadd(7, B_TILE(2), 64);
            _tile_dpbf16ps(2, 4, 7);
        }
        if (nblk > 3) {
            _tile_loadd(5, B_TILE(3), 64);
            _tile_dpbf16ps(3, 4, 5);
        }
    }
    store_c(c);
    for (int j = 0; j < nblk; ++j) rs_tiles_put_block(c + 256 * j, rows, b, n0 + 16 * j, y, N);
}

/* Rows [m, m + rows0 + rows1) x blocks [blk, blk + nblk) (nblk <= 2), two row tiles (rows0 = 16). */
AMX_TARGET static void rows32(const uint16_t *x, int rows1, const uint16_t *wg, int64_t n0, int nblk, int64_t K,
                              const uint16_t *b, uint16_t *y, int64_t N, float *c) {
    zero_c();
    for (int64_t k = 0; k < K; k += 32) {
        _tile_loadd(4, x + k, 2 * K);
        _tile_loadd(5, x + 16 * K + k, 2 * K);
        _tile_loadd(6, B_TILE(0), 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(2, 5, 6);
        if (nblk > 1) {
            _tile_loadd(7, B_TILE(1), 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    store_c(c);
    for (int j = 0; j < nblk; ++j) {
        rs_tiles_put_block(c + 256 * j, 16, b, n0 + 16 * j, y, N);
        rs_tiles_put_block(c + 512 + 256 * j, rows1, b, n0 + 16 * j, y + 16 * N, N);
    }
}
#undef B_TILE

/* Rows [r0, r1) of x (M rows in all) times the column group at n0 (nblk <= GROUP blocks of 16 columns),
 * whose packed weights start at wg ([nblk][K / 32][16][16][2]), into y. `st`: the calling thread's tile
 * configuration (reloaded when the row split changes) and accumulator image. Also run by cpu_quant.c over a
 * panel of weights it dequantized. */
AMX_TARGET void rs_tiles_group(const uint16_t *x, int64_t M, int64_t r0, int64_t r1, const uint16_t *wg, int64_t n0,
                               int nblk, int64_t K, const uint16_t *b, uint16_t *y, int64_t N, tile_state *st) {
    for (int64_t m = r0; m < r1; m += M <= 16 ? 16 : 32) {
        const int left = (int)(r1 - m < 32 ? r1 - m : 32);
        const int rows0 = M <= 16 || left < 16 ? left : 16;
        const int rows1 = M <= 16 || left < 16 ? 0 : left - 16;
        if (st->loaded != rows0 * 64 + rows1) {
            rs_tiles_configure(&st->cfg, rows0, rows1);
            _tile_loadconfig(&st->cfg);
            st->loaded = rows0 * 64 + rows1;
        }
        if (rows1 == 0)
            rows16(x + m * K, rows0, wg, n0, nblk, K, b, y + m * N, N, st->c);
        else
            for (int j = 0; j < nblk; j += 2)
                rows32(x + m * K, rows1, wg + j * K * 16, n0 + 16 * j, nblk - j < 2 ? nblk - j : 2, K, b, y + m * N,
                       N, st->c);
    }
}

AMX_TARGET static void linear_tiles(const uint16_t *x, int64_t M, const uint16_t *w, int64_t N, int64_t K,
                                    const uint16_t *b, uint16_t *y, int num_threads) {
    const int64_t blocks = N / 16, groups = (blocks + GROUP - 1) / GROUP;
    /* Rows in blocks whose inputs fit in half of L2, each block over all columns: every column group
     * then reads its rows from L2, where with all rows at once a prefill re-reads them from L3 per group. */
    const int64_t fit = X_BLOCK_BYTES / (2 * K) / 32 * 32, rb = M * 2 * K <= X_BLOCK_BYTES ? M : (fit > 32 ? fit : 32);
#pragma omp parallel num_threads(num_threads) if (groups > 1)
    {
        tile_state st __attribute__((aligned(64)));
        tile_config saved __attribute__((aligned(64)));
        st.loaded = -1;
        _tile_storeconfig(&saved);
        for (int64_t r0 = 0; r0 < M; r0 += rb) {
            const int64_t r1 = M - r0 < rb ? M : r0 + rb;
#pragma omp for schedule(static)
            for (int64_t g = 0; g < groups; ++g) {
                const int nblk = blocks - g * GROUP < GROUP ? (int)(blocks - g * GROUP) : GROUP;
                rs_tiles_group(x, M, r0, r1, w + g * GROUP * K * 16, g * GROUP * 16, nblk, K, b, y, N, &st);
            }
        }
        amx_end(&saved);
    }
}
#endif

/* Returns 0, or -1 where tiles cannot run (not the AVX-512 build, or no AMX permission) or the shape
 * does not tile (N a multiple of 16 and K of 32). */
int rs_linear_tiles(const uint16_t *x, int64_t M, const uint16_t *w, int64_t N, int64_t K, const uint16_t *b,
                    uint16_t *y, int num_threads) {
#if HAVE_AMX
    if (!amx_ready() || N % 16 != 0 || K % 32 != 0) return -1;
    if (M > 0) linear_tiles(x, M, w, N, K, b, y, num_threads);
    return 0;
#else
    (void)x, (void)M, (void)w, (void)N, (void)K, (void)b, (void)y, (void)num_threads;
    return -1;
#endif
}
