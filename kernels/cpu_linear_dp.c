/* bf16 linears with AVX512-BF16's vdpbf16ps over the weights native.pack_tiles packs for AMX, for CPUs that
 * have AVX512-BF16 but no AMX (AMD Zen 4 / 5, Intel Cooper Lake).
 *
 * rs_linear_dp keeps rs_linear_tiles' contract (cpu_linear_amx.c): y[m, n] = bf16(sum_k x[m, k] w[n, k] + b[n])
 * for x [M, K] and b [N] in bf16, fp32 sums rounded once, w packed as [N / 16][K / 32][16][16][2]. The tile
 * layout is what vdpbf16ps wants too: for a 16-column block and the input pair r of a 32-input step, the 64
 * bytes [nb][kb][r] are one zmm of 16 column pairs, and vdpbf16ps of it with the input row's pair
 * (k = 32 kb + 2 r, + 1) broadcast as 32 bits adds both products to 16 outputs.
 *
 * Micro-kernel: up to MR rows x NR column blocks of fp32 accumulators; per input pair, NR weight loads and MR
 * broadcasts feed MR x NR vdpbf16ps, so a weight vector loaded once serves every row of the group. Threads
 * split the columns in groups of NR blocks (a group's weights one contiguous stream per block). The rows go
 * in blocks whose inputs fit in half of L2, each over every group; within a row block the inputs go in chunks
 * of KC: the group's weights of a chunk (NR x KC x 32 bytes, 96 KB) stay in L2 while every row group of the
 * block multiplies them, the partial sums kept in a per-thread buffer between chunks. A decode step's few
 * rows are then one pass over the weights (prefetched a little ahead: the hardware's prefetch alone left 8-32
 * rows ~10% slower), and the last row group of a chunk, which runs from L2, prefetches the next chunk (16 and 64
 * rows 5% faster, 512 level; Zen 5); with exactly two row groups (9-16 rows: a decode batch) both prefetch the
 * next chunk, so the stream runs while either computes (16 rows 4-5% faster again); a prefill's are compute-bound at MR x NR products per MR + NR loads. The sizes are
 * measured ones (Zen 5, one thread): 4 x 4 with 256-input chunks and 64-row blocks ran prefill shapes 5-15%
 * behind oneDNN; 6 x 4 and 8 x 3 with 1,024 and up to ~256 rows level with it or ahead, 8 x 3 ahead at 8-32.
 */
#include <stdint.h>
#include <string.h>

#include "cpu_simd.h"

#if defined(__AVX512F__)
#define MR 8                     /* rows of the micro-kernel */
#define NR 3                     /* column blocks of 16 of the micro-kernel, and of a thread's work item */
#define KC 1024                  /* inputs per chunk: a group's chunk of weights is NR x 32 KB */
#define RB_MAX 256               /* rows of a row block at most (the partial sums' buffer) */
#define AHEAD 1024               /* the weights are prefetched this many elements (2 KB) ahead in their block */
#define X_BLOCK_BYTES (1 << 19) /* inputs of a row block: half of a 1 MB L2 */

typedef struct {
    float c[RB_MAX][NR * 16]; /* partial sums of a row block x a group, between chunks */
} dp_sums;

DP_TARGET RS_INLINE __m512bh pair_of(const uint16_t *p) { /* x[k], x[k + 1] in every 32-bit lane */
    int32_t v;
    memcpy(&v, p, sizeof v);
    return (__m512bh)_mm512_set1_epi32(v);
}

/* Rows [0, mr) of x (row stride K) x blocks [0, nr) of the group's weights wg ([nr][K / 32][16][16][2]) over
 * inputs [k0, k1): the sums start at zero (first) or from c (row stride NR * 16 floats); at the last chunk
 * they go to y (row stride N, at the group's first column) as bf16(sum + b), else back to c. */
DP_TARGET RS_INLINE void micro(const uint16_t *x, int64_t K, const uint16_t *wg, int64_t k0, int64_t k1,
                               const int mr, const int nr, float *c, int first, int last, const uint16_t *b,
                               uint16_t *y, int64_t N, int64_t pf) {
    __m512 acc[MR][NR];
    for (int i = 0; i < mr; ++i)
        for (int j = 0; j < nr; ++j)
            acc[i][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + i * NR * 16 + 16 * j);
    for (int64_t k = k0; k < k1; k += 32) {
        const uint16_t *wk = wg + k * 16; /* step k / 32 of block 0: 512 elements a step */
        for (int r = 0; r < 16; ++r) {
            __m512bh w[NR];
            for (int j = 0; j < nr; ++j) {
                _mm_prefetch((const char *)(wk + j * K * 16 + r * 32 + pf), _MM_HINT_T0);
                w[j] = (__m512bh)_mm512_loadu_si512(wk + j * K * 16 + r * 32);
            }
            for (int i = 0; i < mr; ++i) {
                const __m512bh xi = pair_of(x + i * K + k + 2 * r);
                for (int j = 0; j < nr; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xi, w[j]);
            }
        }
    }
    for (int j = 0; j < nr; ++j) {
        const __m512 bias = last && b ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                            _mm256_loadu_si256((const __m256i *)(b + 16 * j))), 16))
                                      : _mm512_setzero_ps();
        for (int i = 0; i < mr; ++i) {
            if (last)
                _mm256_storeu_si256((__m256i *)(y + i * N + 16 * j),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[i][j], bias)));
            else
                _mm512_storeu_ps(c + i * NR * 16 + 16 * j, acc[i][j]);
        }
    }
}

typedef void (*micro_fn)(const uint16_t *, int64_t, const uint16_t *, int64_t, int64_t, float *, int, int,
                         const uint16_t *, uint16_t *, int64_t, int64_t);

/* micro with constant mr, nr (so the accumulators stay in registers), one function per pair. */
#define MICRO(mr, nr)                                                                                             \
    DP_TARGET static void micro_##mr##_##nr(const uint16_t *x, int64_t K, const uint16_t *wg, int64_t k0,         \
                                            int64_t k1, float *c, int first, int last, const uint16_t *b,        \
                                            uint16_t *y, int64_t N, int64_t pf) {                                 \
        micro(x, K, wg, k0, k1, mr, nr, c, first, last, b, y, N, pf);                                             \
    }
#define MICRO_ROWS(mr) MICRO(mr, 1) MICRO(mr, 2) MICRO(mr, 3)
MICRO_ROWS(1)
MICRO_ROWS(2)
MICRO_ROWS(3)
MICRO_ROWS(4)
MICRO_ROWS(5)
MICRO_ROWS(6)
MICRO_ROWS(7)
MICRO_ROWS(8)
#define ROW_OF(mr) {micro_##mr##_1, micro_##mr##_2, micro_##mr##_3}
static const micro_fn MICROS[MR][NR] = {ROW_OF(1), ROW_OF(2), ROW_OF(3), ROW_OF(4),
                                        ROW_OF(5), ROW_OF(6), ROW_OF(7), ROW_OF(8)};

/* Rows [r0, r1) (at most RB_MAX) x the group of nr blocks at column n0 (weights from wg), chunk by chunk. */
DP_TARGET static void group_rows(const uint16_t *x, int64_t r0, int64_t r1, const uint16_t *wg, int64_t n0, int nr,
                                 int64_t K, const uint16_t *b, uint16_t *y, int64_t N, dp_sums *s) {
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t k1 = K - k0 < KC ? K : k0 + KC;
        /* The last of several row groups reads the chunk from L2, the memory idle: it prefetches what the next
         * chunk's first row group streams (the same offsets one chunk on, or in the next group after the last). */
        const int64_t next = k1 < K ? (k1 - k0) * 16 : NR * K * 16 - k0 * 16;
        for (int64_t m = r0; m < r1; m += MR) {
            const int mr = r1 - m < MR ? (int)(r1 - m) : MR;
            const int64_t pf = (r1 - r0 > MR && r1 - r0 <= 2 * MR) || (m > r0 && m + MR >= r1) ? next : AHEAD;
            MICROS[mr - 1][nr - 1](x + m * K, K, wg, k0, k1, s->c[m - r0], k0 == 0, k1 == K, b ? b + n0 : NULL,
                                   y + m * N + n0, N, pf);
        }
    }
}

DP_TARGET static void linear_dp(const uint16_t *x, int64_t M, const uint16_t *w, int64_t N, int64_t K,
                                const uint16_t *b, uint16_t *y, int num_threads) {
    const int64_t blocks = N / 16, groups = (blocks + NR - 1) / NR;
    const int64_t fit = X_BLOCK_BYTES / (2 * K) / MR * MR;
    const int64_t rb = fit < MR ? MR : fit > RB_MAX ? RB_MAX : fit;
    const int64_t row_blocks = (M + rb - 1) / rb;
    /* One pass over (row block, group) pairs, each thread a contiguous range of them: no barrier per row block
     * (on a loaded machine a thread waiting for a descheduled one lost most of a prefill). */
#pragma omp parallel num_threads(num_threads) if (groups * row_blocks > 1)
    {
        dp_sums s __attribute__((aligned(64)));
#pragma omp for schedule(static) collapse(2)
        for (int64_t i = 0; i < row_blocks; ++i)
            for (int64_t g = 0; g < groups; ++g) {
                const int64_t r0 = i * rb, r1 = M - r0 < rb ? M : r0 + rb;
                const int nr = blocks - g * NR < NR ? (int)(blocks - g * NR) : NR;
                group_rows(x, r0, r1, w + g * NR * K * 16, g * NR * 16, nr, K, b, y, N, &s);
            }
    }
}
#endif

/* Returns 0, or -1 where the library is not the AVX-512 build or the shape does not tile (N a multiple of 16,
 * K of 32). The caller makes sure the CPU has AVX512-BF16 (native.py). */
int rs_linear_dp(const uint16_t *x, int64_t M, const uint16_t *w, int64_t N, int64_t K, const uint16_t *b,
                 uint16_t *y, int num_threads) {
#if defined(__AVX512F__)
    if (N % 16 != 0 || K % 32 != 0) return -1;
    if (M > 0) linear_dp(x, M, w, N, K, b, y, num_threads);
    return 0;
#else
    (void)x, (void)M, (void)w, (void)N, (void)K, (void)b, (void)y, (void)num_threads;
    return -1;
#endif
}
