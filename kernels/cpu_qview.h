/* The packed quantized weight as the non-tile kernels read it (cpu_quant_vec.c, cpu_quant_f32.c): quant.py's
 * PackedQuant, its format flags, and the shapes those kernels take. */
#ifndef RS_CPU_QVIEW_H
#define RS_CPU_QVIEW_H
#include <stddef.h>
#include <stdint.h>

#define QF_INT4 1 /* int4 affine (values 0..15, a scale and a min per group), else int8 */
#define QF_HALF 2 /* scales and mins fp16, else fp32 */
#define QF_TWO_LEVEL 4 /* two-level scales and mins (kernels/quant_levels.py): per QV_SUPER inputs of a 16-column
                        * block, the 16 columns' fp16 factors, then each group's 16 int8 sub-scales */
#define QV_SUPER 256
#define QF_SYM 8 /* int4 without mins: a group's min is -8 times its scale (GGUF's Q4_0) */

typedef struct {
    int int4, half, two;
    const uint8_t *data;
    const void *scales, *mins; /* [N / 16][K / g][16]; mins only for int4 */
    int64_t K, g;
    int64_t groups, supers, per_log2; /* K / g, K / QV_SUPER, log2(QV_SUPER / g): what qview_group indexes by */
} qview;

/* N in 16-column blocks, K in 32-input tiles, groups of a multiple of 16 that divide K (two-level: QV_SUPER
 * divides K and the group QV_SUPER); int4 needs its mins unless symmetric (QF_SYM), and then has none. */
static inline int qview_valid(int64_t N, int64_t K, int64_t g, const void *mins, int flags) {
    return N % 16 == 0 && K % 32 == 0 && g > 0 && g % 16 == 0 && K % g == 0 &&
           (!(flags & QF_INT4) || (mins != NULL) != ((flags & QF_SYM) != 0)) &&
           (!(flags & QF_TWO_LEVEL) || (K % QV_SUPER == 0 && QV_SUPER % g == 0));
}

static inline qview qview_of(int flags, const uint8_t *data, const void *scales, const void *mins, int64_t K,
                             int64_t g) {
    int64_t per_log2 = 0;
    while ((g << per_log2) < QV_SUPER) ++per_log2; /* exact where two-level (g divides QV_SUPER, both powers of 2) */
    const qview w = {flags & QF_INT4, (flags & QF_HALF) != 0, (flags & QF_TWO_LEVEL) != 0, data, scales,
                     (flags & QF_INT4) ? mins : NULL, K, g, K / g, K / QV_SUPER, per_log2};
    return w;
}

/* Where group gi of column block blk keeps its 16 scales (or mins, s the one or the other): one level, at element
 * (blk K / g + gi) 16 of an fp16 (half) or fp32 array, *factors NULL; two-level, the returned 16 int8 sub-scales
 * times the 16 fp16 *factors of the group's QV_SUPER inputs. */
static inline const void *qview_group(const qview *w, const void *s, int64_t blk, int64_t gi,
                                      const uint16_t **factors) {
    if (!w->two) {
        const int64_t at = (blk * w->groups + gi) * 16;
        *factors = NULL;
        return w->half ? (const void *)((const uint16_t *)s + at) : (const void *)((const float *)s + at);
    }
    const int64_t per = (int64_t)1 << w->per_log2; /* shifts, not divisions: this runs once per group */
    const uint8_t *b = (const uint8_t *)s + (blk * w->supers + (gi >> w->per_log2)) * (32 + 16 * per);
    *factors = (const uint16_t *)b;
    return b + 32 + 16 * (gi & (per - 1));
}
#endif
