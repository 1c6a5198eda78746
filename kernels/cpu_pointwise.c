/* The elementwise steps of a decoder layer between its matmuls, one call each, so that a decode step of a few
 * rows does not pay a dozen torch dispatches per step of a layer (on model L at batch 1 those were ~5 ms of a
 * 30 ms step). Plain C loops the compiler vectorizes for whichever instruction set the library is built for.
 *
 * Numerics are the torch ops' they replace (kernels/layers.py), rounding where they round:
 *   rs_add_rms_norm  x = x + r (rounded to x's dtype, in place, when r is given); out = w * (x / rms(x)), the
 *                    statistics in fp32; bf16 rounds x / rms(x) to bf16 before the weight multiplies it
 *                    (transformers' order), fp32 multiplies in fp32.
 *   rs_rotary        each pair (a, b) of the first `heads` heads of a row, in place: (a c - b s, b c + a s); bf16
 *                    rounds each product and the sum, as torch's bf16 ops do one at a time.
 *   rs_silu_mul      out = silu(g) * u over [g | u] rows; bf16 rounds silu(g), then the product.
 * dtype: 0 fp32, 1 bf16. Rows are split over threads only when there is enough work to pay for them.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define ROWS_PER_THREAD_MIN 16 /* below this many rows a call stays on one thread */
#define LANES 16               /* partial sums of a row's squares, so that the sum vectorizes */

static inline float bf(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t to_bf(float f) { /* round to nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float rb(float f) { return bf(to_bf(f)); } /* f rounded to bf16, as fp32 */

/* e^x in fp32 to ~2 ulp for |x| < 88 (saturating beyond), branch free so that loops over it vectorize. */
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x;
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest (1.5 x 2^23) */
    const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static void norm_row_f32(float *x, const float *r, const float *w, float *out, int64_t d, float eps) {
    if (r)
        for (int64_t i = 0; i < d; ++i) x[i] += r[i];
    float lanes[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= d; i += LANES)
        for (int j = 0; j < LANES; ++j) lanes[j] += x[i + j] * x[i + j];
    float ss = 0.0f;
    for (; i < d; ++i) ss += x[i] * x[i];
    for (int j = 0; j < LANES; ++j) ss += lanes[j];
    const float inv = 1.0f / sqrtf(ss / (float)d + eps);
    for (i = 0; i < d; ++i) out[i] = x[i] * inv * w[i];
}

static void norm_row_bf16(uint16_t *x, const uint16_t *r, const uint16_t *w, uint16_t *out, int64_t d, float eps) {
    if (r)
        for (int64_t i = 0; i < d; ++i) x[i] = to_bf(bf(x[i]) + bf(r[i]));
    float lanes[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= d; i += LANES)
        for (int j = 0; j < LANES; ++j) lanes[j] += bf(x[i + j]) * bf(x[i + j]);
    float ss = 0.0f;
    for (; i < d; ++i) ss += bf(x[i]) * bf(x[i]);
    for (int j = 0; j < LANES; ++j) ss += lanes[j];
    const float inv = 1.0f / sqrtf(ss / (float)d + eps);
    for (i = 0; i < d; ++i) out[i] = to_bf(bf(w[i]) * rb(bf(x[i]) * inv));
}

static int threads_for(int64_t rows, int num_threads) {
    const int64_t most = rows / ROWS_PER_THREAD_MIN;
    return most < 1 ? 1 : most < num_threads ? (int)most : num_threads;
}

int rs_add_rms_norm(void *x, const void *r, const void *w, void *out, int64_t rows, int64_t d, float eps, int dtype,
                    int num_threads) {
    const int64_t esz = dtype ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(threads_for(rows, num_threads)) if (rows >= 2 * ROWS_PER_THREAD_MIN)
    for (int64_t i = 0; i < rows; ++i) {
        char *xi = (char *)x + i * d * esz, *oi = (char *)out + i * d * esz;
        const char *ri = r ? (const char *)r + i * d * esz : NULL;
        if (dtype)
            norm_row_bf16((uint16_t *)xi, (const uint16_t *)ri, (const uint16_t *)w, (uint16_t *)oi, d, eps);
        else
            norm_row_f32((float *)xi, (const float *)ri, (const float *)w, (float *)oi, d, eps);
    }
    return 0;
}

int rs_rotary(void *x, int64_t rows, int64_t row_stride, int64_t heads, int64_t head_dim, const void *cos,
              const void *sin, int dtype, int num_threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) num_threads(threads_for(rows, num_threads)) if (rows >= 2 * ROWS_PER_THREAD_MIN)
    for (int64_t t = 0; t < rows; ++t) {
        for (int64_t h = 0; h < heads; ++h) {
            if (dtype) { /* a pair as one 32-bit word (a low, b high), so that the loop vectorizes */
                uint32_t *p = (uint32_t *)((uint16_t *)x + t * row_stride + h * head_dim);
                const uint16_t *c = (const uint16_t *)cos + t * half, *s = (const uint16_t *)sin + t * half;
                for (int64_t i = 0; i < half; ++i) {
                    const float a = bf((uint16_t)p[i]), b = bf((uint16_t)(p[i] >> 16)), ci = bf(c[i]), si = bf(s[i]);
                    p[i] = (uint32_t)to_bf(rb(a * ci) - rb(b * si)) | (uint32_t)to_bf(rb(b * ci) + rb(a * si)) << 16;
                }
            } else {
                float *p = (float *)x + t * row_stride + h * head_dim;
                const float *c = (const float *)cos + t * half, *s = (const float *)sin + t * half;
                for (int64_t i = 0; i < half; ++i) {
                    const float a = p[2 * i], b = p[2 * i + 1];
                    p[2 * i] = a * c[i] - b * s[i];
                    p[2 * i + 1] = b * c[i] + a * s[i];
                }
            }
        }
    }
    return 0;
}

int rs_silu_mul(const void *gu, void *out, int64_t rows, int64_t inter, int dtype, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(threads_for(rows, num_threads)) if (rows >= 2 * ROWS_PER_THREAD_MIN)
    for (int64_t t = 0; t < rows; ++t) {
        if (dtype) {
            const uint16_t *g = (const uint16_t *)gu + t * 2 * inter, *u = g + inter;
            uint16_t *o = (uint16_t *)out + t * inter;
            for (int64_t i = 0; i < inter; ++i) {
                const float gi = bf(g[i]);
                o[i] = to_bf(rb(gi / (1.0f + exp_approx(-gi))) * bf(u[i]));
            }
        } else {
            const float *g = (const float *)gu + t * 2 * inter, *u = g + inter;
            float *o = (float *)out + t * inter;
            for (int64_t i = 0; i < inter; ++i) o[i] = g[i] / (1.0f + exp_approx(-g[i])) * u[i];
        }
    }
    return 0;
}
