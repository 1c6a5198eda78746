/* The contract of rs_attend (cpu_kernels.c: items of many rows; cpu_attn_few.c: items of a few rows) and
 * what both sides share: the arguments, row addressing, the bounds and the merge of a row's result.
 *
 * rs_attend: for every (batch entry b, kv head h) and every query row r of q[b, h], attention
 * over the keys j in [lo[b, r], hi[b, r]) of that entry, where key j lives in pool slot
 * slots[b, j] (slots == NULL: slot j). Writes out[b, h, r, :] and the natural-log LSE
 * lse[b, h, r]; a row that sees no key gets out 0 and lse -inf. K/V are read in place from the
 * paged pool [slot, kv_head, d] (nothing gathered); GQA rows come stacked by the caller.
 *
 * q, K and V are all fp32 or all bf16 (the model's dtype), or (kv_i8) q fp32 / bf16 over an int8 pool
 * whose row (slot, head) dequantizes as ks / vs[slot * sc_ss + head * sc_sh] times its ints: the ints
 * are widened exactly, K's scale multiplies the row's scores and V's its probabilities in P V (the
 * softmax sum stays over the unscaled ones); never on AMX tiles. Sums, softmax and merges are fp32, and
 * so are out / lse. The element type and the product path are constant parameters of the
 * always-inline bodies, specialised per entry point. bf16 is widened to fp32 as it is read (a
 * shift) for the same FMAs, except in items of many rows with `prod` (native.py decides where):
 * both products on AMX tiles (cpu_amx.h) or with vdpbf16ps (cpu_attn_dp.h), P rounded to bf16.
 *
 * Rows are addressed one of two ways. Strided: row r of (b, h) of q / out / lse sits at
 * b * sb + h * sh + r * sr. By token (tok != NULL): stacked row r of entry b is token
 * t = tok[b, r / group] and q head h * group + r % group, so it sits at t * sb + h * sh +
 * (r % group) * sr of token-major [tokens, q_heads, d] tensors (t < 0: a padding row, neither
 * read nor written). With merge set, a row's result is log-sum-exp merged into what out / lse
 * already hold (a partial over disjoint keys) instead of overwriting it: the caller then must not
 * give one output row to two rows of a call (items run in parallel).
 */
#ifndef RS_CPU_ATTN_H
#define RS_CPU_ATTN_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_simd.h"

#define QB 64   /* query rows per work item */
#define KB 128  /* keys per block */
#define DMAX 128
#define FEW 4   /* items of at most FEW rows take cpu_attn_few.c */
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

/* The call's arguments; native.py mirrors this layout (ctypes.Structure _Args), field for field. */
enum { PROD_FMA, PROD_AMX, PROD_DP }; /* how items of many rows multiply bf16 (fp32: always FMAs) */
typedef struct {
    const void *q; int64_t q_sb, q_sh, q_sr;      /* strides in elements, as K / V's */
    const void *kc, *vc; int64_t kv_ss, kv_sh;    /* pool [slot, kv_head, d]: slot / head strides */
    const int64_t *slots; int64_t slots_sb;       /* [b, keys] or NULL: key j is slot j */
    const int32_t *lo, *hi; int64_t bnd_sb;       /* [b, rows] or NULL: every key */
    const int32_t *tok; int64_t tok_sb;           /* [b, rows / group] or NULL: strided rows */
    float *out; int64_t o_sb, o_sh, o_sr;
    float *lse; int64_t l_sb, l_sh, l_sr;
    int32_t num_b, num_h, num_rows, num_keys, d, group, merge, num_threads;
    int32_t bf16, prod; /* q, K, V bf16 (else fp32); prod: PROD_AMX tiles (cpu_amx.h), PROD_DP (cpu_attn_dp.h) */
    int32_t kv_i8;      /* K, V int8 with per-row scales ks / vs (q still fp32 or bf16, as bf16 says) */
    float scale;
    const float *ks, *vs; int64_t sc_ss, sc_sh; /* kv_i8: scales [slot, kv_head] */
} args_t;

/* Software prefetch of one K or V row of `bytes` bytes. The hardware prefetchers stop at 4 KB pages,
 * which hold only 8 slots of a 2-kv-head pool, and cannot guess scattered slots: DRAM-resident
 * shared prefixes streamed at a fraction of the bandwidth a plain read gets. */
#define PREFETCH_ROW(row, bytes, PREFETCH)                                              \
    for (int c_ = 0; c_ < (bytes); c_ += 64) PREFETCH((const char *)(row) + c_)

/* K / V rows: of q's type (bf16 or fp32), or int8 (i8); both constants after inlining. */
RS_INLINE vf kv_load(const void *row, int64_t c, const int bf16, const int i8) {
    return i8 ? vf_load_i8((const int8_t *)row + c) : row_load(row, c, bf16);
}
RS_INLINE const void *kv_at(const void *base, int64_t i, const int bf16, const int i8) {
    return (const char *)base + i * (i8 ? 1 : bf16 ? 2 : 4);
}
/* The dequantization scale of (slot, head) in ks or vs (kv_i8). */
RS_INLINE float kv_scale(const args_t *a, const float *sc, int64_t slot, int h) {
    return sc[slot * a->sc_ss + h * a->sc_sh];
}

/* Offset of row r of (b, h) in a tensor with strides (sb, sh, sr); -1 for a padding row. */
static inline int64_t row_at(const args_t *a, int b, int h, int r, int64_t sb, int64_t sh, int64_t sr) {
    if (!a->tok) return b * sb + h * sh + r * sr;
    const int64_t t = a->tok[b * a->tok_sb + r / a->group];
    return t < 0 ? -1 : t * sb + h * sh + (r % a->group) * sr;
}

/* Writes a row's result, o_row / l in log2 units with max m (l = 0: it saw no key), into out /
 * lse at (b, h, r): overwriting, or merged by log-sum-exp with the partial already there. */
static inline void put_row(const args_t *a, int b, int h, int r, const float *o_row, float m, float l) {
    const int64_t at = row_at(a, b, h, r, a->o_sb, a->o_sh, a->o_sr);
    if (at < 0) return;
    float *dst = a->out + at, *lse = a->lse + row_at(a, b, h, r, a->l_sb, a->l_sh, a->l_sr);
    const float mine = l > 0.0f ? m + log2f(l) : -INFINITY; /* this call's LSE, log2 */
    float w_old = 0.0f, w_new = l > 0.0f ? 1.0f / l : 0.0f, top = mine;
    if (a->merge) {
        const float old = *lse * LOG2E;
        if (mine == -INFINITY) return; /* nothing seen here: the partial stands */
        if (old != -INFINITY) {
            top = old > mine ? old : mine;
            const float e_old = exp2f(old - top), e_new = exp2f(mine - top), inv = 1.0f / (e_old + e_new);
            w_old = e_old * inv, w_new = e_new * inv / l;
            top += log2f(e_old + e_new);
        }
    }
    const vf wn = vf_set1(w_new), wo = vf_set1(w_old);
    for (int c = 0; c < a->d; c += 16) {
        vf x = vf_mul(vf_loadu(o_row + c), wn);
        if (w_old != 0.0f) x = vf_fmadd(vf_loadu(dst + c), wo, x);
        vf_storeu(dst + c, x);
    }
    *lse = top == -INFINITY ? -INFINITY : top * LN2;
}

/* Row `row` of entry b sees keys [lo, hi), clamped to the entry's keys; [jmin, jmax) grows to cover it. */
static inline void row_bounds(const args_t *a, int b, int row, int32_t *lo, int32_t *hi, int *jmin, int *jmax) {
    const int64_t at = b * a->bnd_sb + row;
    *lo = a->lo && a->lo[at] > 0 ? a->lo[at] : 0;
    *hi = a->hi && a->hi[at] < a->num_keys ? a->hi[at] : a->num_keys;
    if (*lo < *hi) {
        *jmin = *lo < *jmin ? *lo : *jmin;
        *jmax = *hi > *jmax ? *hi : *jmax;
    }
}

/* Items of at most FEW rows (cpu_attn_few.c). */
void rs_attend_few(const args_t *a, int b, int h, int r0, int nr);

#endif
