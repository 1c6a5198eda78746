/* The packed quantized weight as the non-tile kernels read it (cpu_quant_vec.c, cpu_quant_f32.c): quant.py's
 * PackedQuant, its format flags, and the shapes those kernels take. */
#ifndef RS_CPU_QVIEW_H
#define RS_CPU_QVIEW_H
#include <stddef.h>
#include <stdint.h>

#define QF_INT4 1 /* int4 affine (values 0..15, a scale and a min per group), else int8 */
#define QF_HALF 2 /* scales and mins fp16, else fp32 */

typedef struct {
    int int4, half;
    const uint8_t *data;
    const void *scales, *mins; /* [N / 16][K / g][16]; mins only for int4 */
    int64_t K, g;
} qview;

/* N in 16-column blocks, K in 32-input tiles, groups of a multiple of 16 that divide K; int4 needs its mins. */
static inline int qview_valid(int64_t N, int64_t K, int64_t g, const void *mins, int flags) {
    return N % 16 == 0 && K % 32 == 0 && g > 0 && g % 16 == 0 && K % g == 0 && (!(flags & QF_INT4) || mins);
}

static inline qview qview_of(int flags, const uint8_t *data, const void *scales, const void *mins, int64_t K,
                             int64_t g) {
    const qview w = {flags & QF_INT4, (flags & QF_HALF) != 0, data, scales, (flags & QF_INT4) ? mins : NULL, K, g};
    return w;
}
#endif
