/* radixserve's compiled CPU kernels (x86-64 AVX-512, fp32), built and loaded by native.py.
 *
 * rs_attend: for every (batch entry b, kv head h) and every query row r of q[b, h], attention
 * over the keys j in [lo[b, r], hi[b, r]) of that entry, where key j lives in pool slot
 * slots[b, j] (slots == NULL: slot j). Writes out[b, h, r, :] and the natural-log LSE
 * lse[b, h, r]; a row that sees no key gets out 0 and lse -inf. K/V are read in place from the
 * paged pool [slot, kv_head, d] (nothing gathered); GQA rows come stacked by the caller.
 *
 * Rows are addressed one of two ways. Strided: row r of (b, h) of q / out / lse sits at
 * b * sb + h * sh + r * sr. By token (tok != NULL): stacked row r of entry b is token
 * t = tok[b, r / group] and q head h * group + r % group, so it sits at t * sb + h * sh +
 * (r % group) * sr of token-major [tokens, q_heads, d] tensors (t < 0: a padding row, neither
 * read nor written). With merge set, a row's result is log-sum-exp merged into what out / lse
 * already hold (a partial over disjoint keys) instead of overwriting it: the caller then must not
 * give one output row to two rows of a call (items run in parallel).
 *
 * The work: items of QB query rows of one (b, h), spread over OpenMP threads (the libgomp torch
 * already loaded). Per item, keys go in blocks of KB: S^T = K Q^T (keys x rows, Q packed
 * transposed and pre-scaled by scale * log2 e, so softmax is exp2), an online softmax per row
 * that is vectorised across rows (S^T keeps a row's scores in a column), then O += P V. Both
 * products are register-blocked tiles (8 keys x 32 rows, 8 rows x 32 columns: 16 accumulators,
 * the scalar side broadcast), so the FMA units, not the loads, bound them.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define QB 64   /* query rows per work item */
#define KB 128  /* keys per block */
#define DMAX 128
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

/* 2^t; exactly 0 below 2^-126 (masked scores are -inf), no denormals. */
static inline __m512 exp2_ps(__m512 t) {
    const __mmask16 normal = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-126.0f), _CMP_GE_OQ);
    t = _mm512_max_ps(t, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n); /* [-0.5, 0.5]: Taylor of e^(f ln 2) to degree 6, rel. error 1.2e-7 */
    __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129107628477e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550410866482158e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402265069591007e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931471805599453e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_maskz_mov_ps(normal, _mm512_scalef_ps(p, n));
}

/* s[k][i] = sum_c K[k][c] qt[c][i] for 8 keys and 16 * nv rows (nv = 1 or 2, a constant after inlining). */
static inline __attribute__((always_inline)) void qk_tile(const float *const *kp, const float *qt, int d,
                                                          float *s, const int nv) {
    __m512 acc[8][2];
    for (int k = 0; k < 8; ++k)
        for (int v = 0; v < nv; ++v) acc[k][v] = _mm512_setzero_ps();
    for (int c = 0; c < d; ++c) {
        __m512 b[2];
        for (int v = 0; v < nv; ++v) b[v] = _mm512_load_ps(qt + c * QB + 16 * v);
#pragma GCC unroll 8
        for (int k = 0; k < 8; ++k) {
            const __m512 a = _mm512_set1_ps(kp[k][c]);
            for (int v = 0; v < nv; ++v) acc[k][v] = _mm512_fmadd_ps(a, b[v], acc[k][v]);
        }
    }
    for (int k = 0; k < 8; ++k)
        for (int v = 0; v < nv; ++v) _mm512_store_ps(s + k * QB + 16 * v, acc[k][v]);
}

/* o[i0 + k][c0 : c0 + 32] += sum_j p[j][i0 + k] V[j][c0 : c0 + 32] for k < 8, j < nk. */
static inline void pv_tile(const float *p, int i0, const float *const *vp, int c0, int nk, float *o, int d) {
    __m512 acc[8][2];
    for (int k = 0; k < 8; ++k) {
        acc[k][0] = _mm512_load_ps(o + (i0 + k) * d + c0);
        acc[k][1] = _mm512_load_ps(o + (i0 + k) * d + c0 + 16);
    }
    for (int j = 0; j < nk; ++j) {
        const __m512 b0 = _mm512_loadu_ps(vp[j] + c0), b1 = _mm512_loadu_ps(vp[j] + c0 + 16);
        const float *pj = p + j * QB + i0;
#pragma GCC unroll 8
        for (int k = 0; k < 8; ++k) {
            const __m512 a = _mm512_set1_ps(pj[k]);
            acc[k][0] = _mm512_fmadd_ps(a, b0, acc[k][0]);
            acc[k][1] = _mm512_fmadd_ps(a, b1, acc[k][1]);
        }
    }
    for (int k = 0; k < 8; ++k) {
        _mm512_store_ps(o + (i0 + k) * d + c0, acc[k][0]);
        _mm512_store_ps(o + (i0 + k) * d + c0 + 16, acc[k][1]);
    }
}

/* The call's arguments; native.py mirrors this layout (ctypes.Structure _Args), field for field. */
typedef struct {
    const float *q; int64_t q_sb, q_sh, q_sr;
    const float *kc, *vc; int64_t kv_ss, kv_sh;   /* pool [slot, kv_head, d]: slot / head strides */
    const int64_t *slots; int64_t slots_sb;       /* [b, keys] or NULL: key j is slot j */
    const int32_t *lo, *hi; int64_t bnd_sb;       /* [b, rows] or NULL: every key */
    const int32_t *tok; int64_t tok_sb;           /* [b, rows / group] or NULL: strided rows */
    float *out; int64_t o_sb, o_sh, o_sr;
    float *lse; int64_t l_sb, l_sh, l_sr;
    int32_t num_b, num_h, num_rows, num_keys, d, group, merge, num_threads;
    float scale;
} args_t;

/* Software prefetch of one K or V row of d floats. The hardware prefetchers stop at 4 KB pages,
 * which hold only 8 slots of a 2-kv-head pool, and cannot guess scattered slots: DRAM-resident
 * shared prefixes streamed at ~10 GB/s of the ~35 available (measured with a cold cache). */
#define PREFETCH_ROW(row, d, hint)                                                     \
    for (int c_ = 0; c_ < (d); c_ += 16) _mm_prefetch((const char *)((row) + c_), hint)

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
    const __m512 wn = _mm512_set1_ps(w_new), wo = _mm512_set1_ps(w_old);
    for (int c = 0; c < a->d; c += 16) {
        __m512 x = _mm512_mul_ps(_mm512_loadu_ps(o_row + c), wn);
        if (w_old != 0.0f) x = _mm512_fmadd_ps(_mm512_loadu_ps(dst + c), wo, x);
        _mm512_storeu_ps(dst + c, x);
    }
    *lse = top == -INFINITY ? -INFINITY : top * LN2;
}

/* Per block: mask (when some row does not see every key of it), update the running max m and
 * sum l of each row, turn s into probabilities, rescale o by exp2(old max - new max). */
static void softmax_block(float *s, int j0, int nk, int nkp, int np, int masked, const int32_t *lo,
                          const int32_t *hi, float *m, float *l, float *o, int d) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    for (int v = 0; v < np / 16; ++v) {
        const __m512i lov = _mm512_load_si512(lo + 16 * v), hiv = _mm512_load_si512(hi + 16 * v);
        const __m512 m_old = _mm512_load_ps(m + 16 * v);
        __m512 mx = m_old;
        for (int j = 0; j < nkp; ++j) {
            __m512 x = _mm512_load_ps(s + j * QB + 16 * v);
            if (masked) {
                const __m512i jj = _mm512_set1_epi32(j0 + j);
                __mmask16 seen = _mm512_cmpge_epi32_mask(jj, lov) & _mm512_cmplt_epi32_mask(jj, hiv);
                x = _mm512_mask_mov_ps(ninf, j < nk ? seen : 0, x);
            }
            _mm512_store_ps(s + j * QB + 16 * v, x);
            mx = _mm512_max_ps(mx, x);
        }
        /* A row with no key so far keeps max -inf; subtract 0 instead (its scores are all -inf). */
        const __m512 ref = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(mx, ninf, _CMP_NEQ_OQ), mx);
        const __m512 alpha = exp2_ps(_mm512_sub_ps(m_old, ref));
        __m512 sum = _mm512_setzero_ps();
        for (int j = 0; j < nkp; ++j) {
            const __m512 p = exp2_ps(_mm512_sub_ps(_mm512_load_ps(s + j * QB + 16 * v), ref));
            _mm512_store_ps(s + j * QB + 16 * v, p);
            sum = _mm512_add_ps(sum, p);
        }
        _mm512_store_ps(l + 16 * v, _mm512_fmadd_ps(_mm512_load_ps(l + 16 * v), alpha, sum));
        _mm512_store_ps(m + 16 * v, mx);
        float al[16] __attribute__((aligned(64)));
        _mm512_store_ps(al, alpha);
        for (int i = 0; i < 16; ++i) {
            float *row = o + (16 * v + i) * d;
            const __m512 a = _mm512_set1_ps(al[i]);
            for (int c = 0; c < d; c += 16) _mm512_store_ps(row + c, _mm512_mul_ps(a, _mm512_load_ps(row + c)));
        }
    }
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

static void attend_item(const args_t *a, int b, int h, int r0, int nr) {
    const int d = a->d, np = (nr + 15) / 16 * 16;
    float qt[DMAX * QB] __attribute__((aligned(64)));
    float s[KB * QB] __attribute__((aligned(64)));
    float o[QB * DMAX] __attribute__((aligned(64)));
    float m[QB] __attribute__((aligned(64))), l[QB] __attribute__((aligned(64)));
    int32_t lo[QB] __attribute__((aligned(64))), hi[QB] __attribute__((aligned(64)));
    const float *kp[KB], *vp[KB];
    int jmin = a->num_keys, jmax = 0;
    const float qscale = a->scale * LOG2E;
    for (int i = 0; i < np; ++i) {
        const int64_t at = i < nr ? row_at(a, b, h, r0 + i, a->q_sb, a->q_sh, a->q_sr) : -1;
        lo[i] = 0, hi[i] = 0; /* padding rows: no key */
        if (at >= 0) row_bounds(a, b, r0 + i, &lo[i], &hi[i], &jmin, &jmax);
        m[i] = -INFINITY, l[i] = 0.0f;
        for (int c = 0; c < d; ++c) qt[c * QB + i] = at >= 0 ? a->q[at + c] * qscale : 0.0f;
    }
    memset(o, 0, sizeof(float) * np * d);
    const float *kbase = a->kc + h * a->kv_sh, *vbase = a->vc + h * a->kv_sh;
    const int64_t *slots = a->slots ? a->slots + b * a->slots_sb : NULL;
    for (int j0 = jmin; j0 < jmax; j0 += KB) {
        const int nk = jmax - j0 < KB ? jmax - j0 : KB, nkp = (nk + 7) / 8 * 8;
        for (int j = 0; j < nkp; ++j) { /* the tail of the last tile repeats a key (masked) */
            const int64_t key = j0 + (j < nk ? j : nk - 1), slot = slots ? slots[key] : key;
            kp[j] = kbase + slot * a->kv_ss, vp[j] = vbase + slot * a->kv_ss;
        }
        int masked = nkp != nk;
        for (int i = 0; i < nr && !masked; ++i) masked = lo[i] > j0 || hi[i] < j0 + nk;
        for (int j = 0; j < nkp; j += 8) {
            for (int jj = j0 + KB + j; jj < jmax && jj < j0 + KB + j + 8; ++jj) { /* the next block, spread over tiles */
                const int64_t slot = slots ? slots[jj] : jj;
                PREFETCH_ROW(kbase + slot * a->kv_ss, d, _MM_HINT_T1);
                PREFETCH_ROW(vbase + slot * a->kv_ss, d, _MM_HINT_T1);
            }
            int i = 0;
            for (; i + 32 <= np; i += 32) qk_tile(kp + j, qt + i, d, s + j * QB + i, 2);
            if (i < np) qk_tile(kp + j, qt + i, d, s + j * QB + i, 1);
        }
        softmax_block(s, j0, nk, nkp, np, masked, lo, hi, m, l, o, d);
        for (int i = 0; i < np; i += 8)
            for (int c = 0; c < d; c += 32) pv_tile(s, i, vp, c, nkp, o, d);
    }
    for (int i = 0; i < nr; ++i) put_row(a, b, h, r0 + i, o + i * d, m[i], l[i]);
}

/* Items of at most FEW rows (a decode's stacked GQA heads): a register tile of 16 or 32 rows would
 * be mostly padding, so scores are dot products along d (one horizontal sum per key and row),
 * and O, Q stay in registers (nd = d / 16 and nr are constants after inlining). */
#define FEW 4

static inline __attribute__((always_inline)) void attend_few_impl(const args_t *a, int b, int h, int r0,
                                                                  const int nr, const int nd) {
    float s[FEW][KB] __attribute__((aligned(64)));
    __m512 q[FEW][DMAX / 16], o[FEW][DMAX / 16];
    float m[FEW], l[FEW];
    int32_t lo[FEW], hi[FEW];
    int jmin = a->num_keys, jmax = 0;
    const float qscale = a->scale * LOG2E;
    for (int r = 0; r < nr; ++r) {
        const int64_t at = row_at(a, b, h, r0 + r, a->q_sb, a->q_sh, a->q_sr);
        lo[r] = hi[r] = 0; /* a padding row sees nothing */
        if (at >= 0) row_bounds(a, b, r0 + r, &lo[r], &hi[r], &jmin, &jmax);
        m[r] = -INFINITY, l[r] = 0.0f;
        for (int c = 0; c < nd; ++c) {
            q[r][c] = at >= 0 ? _mm512_mul_ps(_mm512_loadu_ps(a->q + at + 16 * c), _mm512_set1_ps(qscale))
                              : _mm512_setzero_ps();
            o[r][c] = _mm512_setzero_ps();
        }
    }
    const float *kbase = a->kc + h * a->kv_sh, *vbase = a->vc + h * a->kv_sh;
    const int64_t *slots = a->slots ? a->slots + b * a->slots_sb : NULL;
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    for (int j0 = jmin; j0 < jmax; j0 += KB) {
        const int nk = jmax - j0 < KB ? jmax - j0 : KB;
        for (int j = 0; j < nk; ++j) {
            const int64_t slot = slots ? slots[j0 + j] : j0 + j;
            const float *kr = kbase + slot * a->kv_ss;
            if (j0 + j + 16 < jmax) /* decode keys lie on scattered slots: K 16 keys ahead, V for the P V pass */
                PREFETCH_ROW(kbase + (slots ? slots[j0 + j + 16] : j0 + j + 16) * a->kv_ss, nd * 16, _MM_HINT_T0);
            PREFETCH_ROW(vbase + slot * a->kv_ss, nd * 16, _MM_HINT_T1);
            __m512 acc[FEW];
            for (int c = 0; c < nd; ++c) {
                const __m512 kv = _mm512_loadu_ps(kr + 16 * c);
                for (int r = 0; r < nr; ++r) acc[r] = c ? _mm512_fmadd_ps(q[r][c], kv, acc[r]) : _mm512_mul_ps(q[r][c], kv);
            }
            for (int r = 0; r < nr; ++r) s[r][j] = _mm512_reduce_add_ps(acc[r]);
        }
        for (int r = 0; r < nr; ++r) {
            __m512 mx = ninf;
            const __m512i lov = _mm512_set1_epi32(lo[r]), hiv = _mm512_set1_epi32(hi[r]);
            for (int j = 0; j < nk; j += 16) {
                const __m512i jj = _mm512_add_epi32(_mm512_set1_epi32(j0 + j),
                                                    _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
                const __mmask16 seen = _mm512_cmpge_epi32_mask(jj, lov) & _mm512_cmplt_epi32_mask(jj, hiv) &
                                       (__mmask16)(nk - j >= 16 ? 0xFFFF : (1u << (nk - j)) - 1);
                const __m512 x = _mm512_mask_mov_ps(ninf, seen, _mm512_load_ps(s[r] + j));
                _mm512_store_ps(s[r] + j, x);
                mx = _mm512_max_ps(mx, x);
            }
            const float bmax = _mm512_reduce_max_ps(mx), m_new = bmax > m[r] ? bmax : m[r];
            const float ref = m_new == -INFINITY ? 0.0f : m_new;
            const __m512 refv = _mm512_set1_ps(ref);
            __m512 sum = _mm512_setzero_ps();
            for (int j = 0; j < nk; j += 16) {
                const __m512 p = exp2_ps(_mm512_sub_ps(_mm512_load_ps(s[r] + j), refv));
                _mm512_store_ps(s[r] + j, p);
                sum = _mm512_add_ps(sum, p);
            }
            const float alpha = m[r] == -INFINITY ? 0.0f : exp2f(m[r] - ref);
            l[r] = l[r] * alpha + _mm512_reduce_add_ps(sum);
            m[r] = m_new;
            for (int c = 0; c < nd; ++c) o[r][c] = _mm512_mul_ps(o[r][c], _mm512_set1_ps(alpha));
        }
        for (int j = 0; j < nk; ++j) {
            const float *vr = vbase + (slots ? slots[j0 + j] : j0 + j) * a->kv_ss;
            for (int c = 0; c < nd; ++c) {
                const __m512 vv = _mm512_loadu_ps(vr + 16 * c);
                for (int r = 0; r < nr; ++r) o[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(s[r][j]), vv, o[r][c]);
            }
        }
    }
    for (int r = 0; r < nr; ++r) {
        float row[DMAX] __attribute__((aligned(64)));
        for (int c = 0; c < nd; ++c) _mm512_store_ps(row + 16 * c, o[r][c]);
        put_row(a, b, h, r0 + r, row, m[r], l[r]);
    }
}

/* attend_few_impl specialised on the rows and d / 16 (d is a multiple of 32, at most DMAX = 128). */
#define FEW_D(NR)                                                                \
    switch (a->d) {                                                              \
    case 32: attend_few_impl(a, b, h, r0, NR, 2); return;                        \
    case 64: attend_few_impl(a, b, h, r0, NR, 4); return;                        \
    case 96: attend_few_impl(a, b, h, r0, NR, 6); return;                        \
    default: attend_few_impl(a, b, h, r0, NR, 8); return;                        \
    }

static void attend_few(const args_t *a, int b, int h, int r0, int nr) {
    switch (nr) {
    case 1: FEW_D(1)
    case 2: FEW_D(2)
    case 3: FEW_D(3)
    default: FEW_D(4)
    }
}

/* Returns 0, or 1 when d is not a multiple of 32 up to DMAX or group < 1 (the caller falls back). */
int rs_attend(const args_t *a) {
    if (a->d % 32 != 0 || a->d > DMAX || a->num_rows <= 0 || a->group < 1) return 1;
    const int blocks = (a->num_rows + QB - 1) / QB, items = a->num_b * a->num_h * blocks;
#pragma omp parallel for schedule(dynamic, 1) num_threads(a->num_threads) if (items > 1)
    for (int it = 0; it < items; ++it) {
        const int b = it / (a->num_h * blocks), h = it / blocks % a->num_h, r0 = it % blocks * QB;
        const int nr = a->num_rows - r0 < QB ? a->num_rows - r0 : QB;
        if (nr <= FEW)
            attend_few(a, b, h, r0, nr);
        else
            attend_item(a, b, h, r0, nr);
    }
    return 0;
}

/* out[r] = the index of the largest value of row r of x [rows, cols] (row stride `stride`): the
 * first one on ties, the first NaN where a row has one (torch.argmax's answer). One pass for
 * the max, one for its first index; rows spread over the threads. */
void rs_argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t stride, int64_t *out, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows >= 8)
    for (int64_t r = 0; r < rows; ++r) {
        const float *row = x + r * stride;
        __m512 mx = _mm512_set1_ps(-INFINITY);
        __mmask16 nan = 0;
        for (int64_t c = 0; c < cols; c += 16) {
            const __mmask16 live = cols - c >= 16 ? 0xFFFF : (__mmask16)((1u << (cols - c)) - 1);
            const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), live, row + c);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            mx = _mm512_max_ps(mx, v);
        }
        const __m512 best = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
        int64_t at = 0;
        for (int64_t c = 0; c < cols; c += 16) {
            const __mmask16 live = cols - c >= 16 ? 0xFFFF : (__mmask16)((1u << (cols - c)) - 1);
            const __m512 v = _mm512_maskz_loadu_ps(live, row + c);
            const __mmask16 hit = live & (nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(v, best, _CMP_EQ_OQ));
            if (hit) { at = c + __builtin_ctz(hit); break; }
        }
        out[r] = at;
    }
}
