/* radixserve's compiled CPU kernels, built and loaded by native.py: one source for every
 * instruction set, which the vector layer (cpu_simd.h) maps to AVX-512, AVX2 + FMA or plain C.
 *
 * rs_attend: for every (batch entry b, kv head h) and every query row r of q[b, h], attention
 * over the keys j in [lo[b, r], hi[b, r]) of that entry, where key j lives in pool slot
 * slots[b, j] (slots == NULL: slot j). Writes out[b, h, r, :] and the natural-log LSE
 * lse[b, h, r]; a row that sees no key gets out 0 and lse -inf. K/V are read in place from the
 * paged pool [slot, kv_head, d] (nothing gathered); GQA rows come stacked by the caller.
 *
 * q, K and V are all fp32 or all bf16 (the model's dtype); sums, softmax and merges are fp32, and
 * so are out / lse. The element type and the product path are constant parameters of the
 * always-inline bodies, specialised per entry point. bf16 is widened to fp32 as it is read (a
 * shift) for the same FMAs, except with `amx` in items of many rows: both products on AMX tiles
 * (cpu_amx.h; native.py decides where). vdpbf16ps, tried for S^T = K Q^T, ran slower than the
 * widened FMAs: only the linears use it (cpu_linear.c).
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
 * products are register-blocked tiles (AVX-512: 8 keys x 32 rows, 8 rows x 32 columns, 16
 * accumulators; the scalar side broadcast), so the FMA units, not the loads, bound them.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_simd.h"

#define QB 64   /* query rows per work item */
#define KB 128  /* keys per block */
#define DMAX 128
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

/* s[k][i] = sum_c K[k][c] qt[c][i] for TILE keys and 16 * nv rows (nv = 1 .. QK_NV, a constant after inlining). */
static inline __attribute__((always_inline)) void qk_tile(const float *const *kp, const float *qt, int d,
                                                          float *s, const int nv) {
    vf acc[TILE][QK_NV];
    for (int k = 0; k < TILE; ++k)
        for (int v = 0; v < nv; ++v) acc[k][v] = vf_zero();
    for (int c = 0; c < d; ++c) {
        vf b[QK_NV];
        for (int v = 0; v < nv; ++v) b[v] = vf_load(qt + c * QB + 16 * v);
#pragma GCC unroll 8
        for (int k = 0; k < TILE; ++k) {
            const vf a = vf_set1(kp[k][c]);
            for (int v = 0; v < nv; ++v) acc[k][v] = vf_fmadd(a, b[v], acc[k][v]);
        }
    }
    for (int k = 0; k < TILE; ++k)
        for (int v = 0; v < nv; ++v) vf_store(s + k * QB + 16 * v, acc[k][v]);
}

#include "cpu_amx.h"

/* o[i0 + k][c0 : c0 + 16 * PV_NV] += sum_j p[j][i0 + k] V[j][c0 : c0 + 16 * PV_NV] for k < TILE, j < nk. */
RS_INLINE void pv_tile(const float *p, int i0, const void *const *vp, int c0, int nk, float *o, int d,
                       const int bf16) {
    vf acc[TILE][PV_NV];
    for (int k = 0; k < TILE; ++k)
        for (int v = 0; v < PV_NV; ++v) acc[k][v] = vf_load(o + (i0 + k) * d + c0 + 16 * v);
    for (int j = 0; j < nk; ++j) {
        vf b[PV_NV];
        for (int v = 0; v < PV_NV; ++v) b[v] = row_load(vp[j], c0 + 16 * v, bf16);
        const float *pj = p + j * QB + i0;
#pragma GCC unroll 8
        for (int k = 0; k < TILE; ++k) {
            const vf a = vf_set1(pj[k]);
            for (int v = 0; v < PV_NV; ++v) acc[k][v] = vf_fmadd(a, b[v], acc[k][v]);
        }
    }
    for (int k = 0; k < TILE; ++k)
        for (int v = 0; v < PV_NV; ++v) vf_store(o + (i0 + k) * d + c0 + 16 * v, acc[k][v]);
}

/* The call's arguments; native.py mirrors this layout (ctypes.Structure _Args), field for field. */
typedef struct {
    const void *q; int64_t q_sb, q_sh, q_sr;      /* strides in elements, as K / V's */
    const void *kc, *vc; int64_t kv_ss, kv_sh;    /* pool [slot, kv_head, d]: slot / head strides */
    const int64_t *slots; int64_t slots_sb;       /* [b, keys] or NULL: key j is slot j */
    const int32_t *lo, *hi; int64_t bnd_sb;       /* [b, rows] or NULL: every key */
    const int32_t *tok; int64_t tok_sb;           /* [b, rows / group] or NULL: strided rows */
    float *out; int64_t o_sb, o_sh, o_sr;
    float *lse; int64_t l_sb, l_sh, l_sr;
    int32_t num_b, num_h, num_rows, num_keys, d, group, merge, num_threads;
    int32_t bf16, amx;                            /* q, K, V bf16 (else fp32); amx: AMX tiles (cpu_amx.h) */
    float scale;
} args_t;

/* Software prefetch of one K or V row of `bytes` bytes. The hardware prefetchers stop at 4 KB pages,
 * which hold only 8 slots of a 2-kv-head pool, and cannot guess scattered slots: DRAM-resident
 * shared prefixes streamed at a fraction of the bandwidth a plain read gets. */
#define PREFETCH_ROW(row, bytes, PREFETCH)                                              \
    for (int c_ = 0; c_ < (bytes); c_ += 64) PREFETCH((const char *)(row) + c_)

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

/* Per block: scale s by sscale (scores in log2 units), mask (when some row does not see every key
 * of it), update the running max m and sum l of each row, turn s into probabilities, rescale o by
 * exp2(old max - new max). */
static void softmax_block(float *s, float sscale, int j0, int nk, int nkp, int np, int masked, const int32_t *lo,
                          const int32_t *hi, float *m, float *l, float *o, int d) {
    const vf ninf = vf_set1(-INFINITY);
    for (int v = 0; v < np / 16; ++v) {
        const vi lov = vi_load(lo + 16 * v), hiv = vi_load(hi + 16 * v);
        const vf m_old = vf_load(m + 16 * v);
        vf mx = m_old;
        for (int j = 0; j < nkp; ++j) {
            vf x = vf_mul(vf_load(s + j * QB + 16 * v), vf_set1(sscale));
            if (masked) {
                const vi jj = vi_set1(j0 + j);
                vm seen = vm_and(vi_ge(jj, lov), vi_lt(jj, hiv));
                x = vf_blend(j < nk ? seen : vm_none(), x, ninf);
            }
            vf_store(s + j * QB + 16 * v, x);
            mx = vf_max(mx, x);
        }
        /* A row with no key so far keeps max -inf; subtract 0 instead (its scores are all -inf). */
        const vf ref = vf_maskz(vf_ne(mx, ninf), mx);
        const vf alpha = exp2_ps(vf_sub(m_old, ref));
        vf sum = vf_zero();
        for (int j = 0; j < nkp; ++j) {
            const vf p = exp2_ps(vf_sub(vf_load(s + j * QB + 16 * v), ref));
            vf_store(s + j * QB + 16 * v, p);
            sum = vf_add(sum, p);
        }
        vf_store(l + 16 * v, vf_fmadd(vf_load(l + 16 * v), alpha, sum));
        vf_store(m + 16 * v, mx);
        float al[16] __attribute__((aligned(64)));
        vf_store(al, alpha);
        for (int i = 0; i < 16; ++i) {
            float *row = o + (16 * v + i) * d;
            const vf a = vf_set1(al[i]);
            for (int c = 0; c < d; c += 16) vf_store(row + c, vf_mul(a, vf_load(row + c)));
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

/* One item: rows r0 .. r0 + nr of (b, h). bf16 and amx are constants (see the entry points below):
 * fp32 reads K in place; bf16 widens each key block into scratch first (the tile broadcasts K
 * element by element, so widening once per block beats widening in the tile) and reads V in place,
 * widened by the vector load; amx gathers the block's K rows and V key pairs into scratch and
 * multiplies on tiles (cpu_amx.h). */
RS_INLINE void attend_item_impl(const args_t *a, int b, int h, int r0, int nr, void *scratch, const int bf16,
                                const int amx) {
    const int d = a->d, np = (nr + 15) / 16 * 16, key_grain = amx ? 32 : TILE;
    float qt[DMAX * QB] __attribute__((aligned(64))); /* amx: unscaled bf16 pairs [d / 2][QB][2] */
    float s[KB * QB] __attribute__((aligned(64)));
    float o[QB * DMAX] __attribute__((aligned(64)));
    float m[QB] __attribute__((aligned(64))), l[QB] __attribute__((aligned(64)));
    int32_t lo[QB] __attribute__((aligned(64))), hi[QB] __attribute__((aligned(64)));
    const void *kp[KB], *vp[KB];
    uint16_t *qt2 = (uint16_t *)qt, *kb = scratch; /* amx: K rows, then V pairs, then P rows */
    float *kw = scratch;
    int jmin = a->num_keys, jmax = 0;
    const float qscale = a->scale * LOG2E;
    for (int i = 0; i < np; ++i) {
        const int64_t at = i < nr ? row_at(a, b, h, r0 + i, a->q_sb, a->q_sh, a->q_sr) : -1;
        lo[i] = 0, hi[i] = 0; /* padding rows: no key */
        if (at >= 0) row_bounds(a, b, r0 + i, &lo[i], &hi[i], &jmin, &jmax);
        m[i] = -INFINITY, l[i] = 0.0f;
        for (int c = 0; c < d; ++c) {
            if (amx)
                qt2[(c & ~1) * QB + 2 * i + (c & 1)] = at >= 0 ? ((const uint16_t *)a->q)[at + c] : 0;
            else
                qt[c * QB + i] = at >= 0 ? elt(a->q, at + c, bf16) * qscale : 0.0f;
        }
    }
    memset(o, 0, sizeof(float) * np * d);
    const int64_t h_off = h * a->kv_sh;
    const int64_t *slots = a->slots ? a->slots + b * a->slots_sb : NULL;
    const int row_bytes = d * (bf16 ? 2 : 4);
    for (int j0 = jmin; j0 < jmax; j0 += KB) {
        const int nk = jmax - j0 < KB ? jmax - j0 : KB, nkp = (nk + key_grain - 1) / key_grain * key_grain;
        for (int j = 0; j < nkp; ++j) { /* the tail of the last tile repeats a key (masked) */
            const int64_t key = j0 + (j < nk ? j : nk - 1), slot = slots ? slots[key] : key;
            kp[j] = at_elt(a->kc, slot * a->kv_ss + h_off, bf16), vp[j] = at_elt(a->vc, slot * a->kv_ss + h_off, bf16);
            if (amx) {
                for (int c = 0; c < d; c += 32) memcpy(kb + j * d + c, (const uint16_t *)kp[j] + c, 64);
            } else if (bf16) {
                for (int c = 0; c < d; c += 16) vf_store(kw + j * d + c, row_load(kp[j], c, 1));
                kp[j] = kw + j * d;
            }
        }
        int masked = nkp != nk;
        for (int i = 0; i < nr && !masked; ++i) masked = lo[i] > j0 || hi[i] < j0 + nk;
        for (int j = 0; j < nkp; j += TILE) {
            /* the next block, spread over tiles */
            for (int jj = j0 + KB + j; jj < jmax && jj < j0 + KB + j + TILE; ++jj) {
                const int64_t off = (slots ? slots[jj] : jj) * a->kv_ss + h_off;
                PREFETCH_ROW(at_elt(a->kc, off, bf16), row_bytes, PREFETCH_T1);
                PREFETCH_ROW(at_elt(a->vc, off, bf16), row_bytes, PREFETCH_T1);
            }
            if (amx) continue;
            int i = 0;
            for (; i + 16 * QK_NV <= np; i += 16 * QK_NV)
                qk_tile((const float *const *)kp + j, qt + i, d, s + j * QB + i, QK_NV);
            if (i < np) qk_tile((const float *const *)kp + j, qt + i, d, s + j * QB + i, 1);
        }
#if HAVE_AMX
        if (amx) {
            qk_amx(kb, qt2, d, nkp, np, s);
            v_pairs(vp, d, nkp, kb + KB * DMAX);
        }
#endif
        softmax_block(s, amx ? qscale : 1.0f, j0, nk, nkp, np, masked, lo, hi, m, l, o, d);
#if HAVE_AMX
        if (amx) {
            p_rows(s, nkp, np, kb + 2 * KB * DMAX);
            pv_amx(kb + 2 * KB * DMAX, kb + KB * DMAX, d, nkp, np, o);
            continue;
        }
#endif
        for (int i = 0; i < np; i += TILE)
            for (int c = 0; c < d; c += 16 * PV_NV) pv_tile(s, i, vp, c, nkp, o, d, bf16);
    }
    for (int i = 0; i < nr; ++i) put_row(a, b, h, r0 + i, o + i * d, m[i], l[i]);
}

static void attend_item_f32(const args_t *a, int b, int h, int r0, int nr) {
    attend_item_impl(a, b, h, r0, nr, NULL, 0, 0);
}
static void attend_item_bf16(const args_t *a, int b, int h, int r0, int nr) {
    float kw[KB * DMAX] __attribute__((aligned(64))); /* a key block widened to fp32 */
    attend_item_impl(a, b, h, r0, nr, kw, 1, 0);
}
#if HAVE_AMX
AMX_TARGET __attribute__((flatten)) static void attend_item_amx(const args_t *a, int b, int h, int r0, int nr) {
    uint16_t scratch[2 * KB * DMAX + QB * KB] __attribute__((aligned(64))); /* K rows, V pairs, P rows */
    tile_config saved __attribute__((aligned(64)));
    amx_begin(&saved);
    attend_item_impl(a, b, h, r0, nr, scratch, 1, 1);
    amx_end(&saved);
}
#endif

/* Items of at most FEW rows (a decode's stacked GQA heads): a register tile of 16 or 32 rows would
 * be mostly padding, so scores are dot products along d (one horizontal sum per key and row),
 * and O, Q stay in registers (nd = d / 16 and nr are constants after inlining). bf16 K/V are
 * widened as they are loaded: the horizontal sums, not the products, bound this path. */
#define FEW 4

RS_INLINE void attend_few_impl(const args_t *a, int b, int h, int r0, const int nr, const int nd, const int bf16) {
    float s[FEW][KB] __attribute__((aligned(64)));
    vf q[FEW][DMAX / 16], o[FEW][DMAX / 16];
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
            q[r][c] = at >= 0 ? vf_mul(row_load(a->q, at + 16 * c, bf16), vf_set1(qscale)) : vf_zero();
            o[r][c] = vf_zero();
        }
    }
    const int64_t h_off = h * a->kv_sh;
    const int64_t *slots = a->slots ? a->slots + b * a->slots_sb : NULL;
    const int row_bytes = nd * 16 * (bf16 ? 2 : 4);
    const vf ninf = vf_set1(-INFINITY);
    for (int j0 = jmin; j0 < jmax; j0 += KB) {
        const int nk = jmax - j0 < KB ? jmax - j0 : KB;
        for (int j = 0; j < nk; ++j) {
            const int64_t off = (slots ? slots[j0 + j] : j0 + j) * a->kv_ss + h_off;
            const void *kr = at_elt(a->kc, off, bf16);
            if (j0 + j + 16 < jmax) /* decode keys lie on scattered slots: K 16 keys ahead, V for the P V pass */
                PREFETCH_ROW(at_elt(a->kc, (slots ? slots[j0 + j + 16] : j0 + j + 16) * a->kv_ss + h_off, bf16),
                             row_bytes, PREFETCH_T0);
            PREFETCH_ROW(at_elt(a->vc, off, bf16), row_bytes, PREFETCH_T1);
            vf acc[FEW];
            for (int r = 0; r < nr; ++r) acc[r] = vf_mul(q[r][0], row_load(kr, 0, bf16));
            for (int c = 1; c < nd; ++c) {
                const vf kv = row_load(kr, 16 * c, bf16);
                for (int r = 0; r < nr; ++r) acc[r] = vf_fmadd(q[r][c], kv, acc[r]);
            }
            for (int r = 0; r < nr; ++r) s[r][j] = vf_hsum(acc[r]);
        }
        for (int r = 0; r < nr; ++r) {
            vf mx = ninf;
            const vi lov = vi_set1(lo[r]), hiv = vi_set1(hi[r]);
            for (int j = 0; j < nk; j += 16) {
                const vi jj = vi_iota(j0 + j);
                const vm seen = vm_and(vm_and(vi_ge(jj, lov), vi_lt(jj, hiv)), vm_first(nk - j));
                const vf x = vf_blend(seen, vf_load(s[r] + j), ninf);
                vf_store(s[r] + j, x);
                mx = vf_max(mx, x);
            }
            const float bmax = vf_hmax(mx), m_new = bmax > m[r] ? bmax : m[r];
            const float ref = m_new == -INFINITY ? 0.0f : m_new;
            const vf refv = vf_set1(ref);
            vf sum = vf_zero();
            for (int j = 0; j < nk; j += 16) {
                const vf p = exp2_ps(vf_sub(vf_load(s[r] + j), refv));
                vf_store(s[r] + j, p);
                sum = vf_add(sum, p);
            }
            const float alpha = m[r] == -INFINITY ? 0.0f : exp2f(m[r] - ref);
            l[r] = l[r] * alpha + vf_hsum(sum);
            m[r] = m_new;
            for (int c = 0; c < nd; ++c) o[r][c] = vf_mul(o[r][c], vf_set1(alpha));
        }
        for (int j = 0; j < nk; ++j) {
            const void *vr = at_elt(a->vc, (slots ? slots[j0 + j] : j0 + j) * a->kv_ss + h_off, bf16);
            for (int c = 0; c < nd; ++c) {
                const vf vv = row_load(vr, 16 * c, bf16);
                for (int r = 0; r < nr; ++r) o[r][c] = vf_fmadd(vf_set1(s[r][j]), vv, o[r][c]);
            }
        }
    }
    for (int r = 0; r < nr; ++r) {
        float row[DMAX] __attribute__((aligned(64)));
        for (int c = 0; c < nd; ++c) vf_store(row + 16 * c, o[r][c]);
        put_row(a, b, h, r0 + r, row, m[r], l[r]);
    }
}

/* attend_few_impl specialised on the rows, d / 16 (d is a multiple of 32, at most DMAX = 128) and
 * the element type. */
#define FEW_D(NR, BF16)                                                                \
    if (!FEW_CONST_D) { attend_few_impl(a, b, h, r0, NR, a->d / 16, BF16); return; } \
    switch (a->d) {                                                                    \
    case 32: attend_few_impl(a, b, h, r0, NR, 2, BF16); return;                        \
    case 64: attend_few_impl(a, b, h, r0, NR, 4, BF16); return;                        \
    case 96: attend_few_impl(a, b, h, r0, NR, 6, BF16); return;                        \
    default: attend_few_impl(a, b, h, r0, NR, 8, BF16); return;                        \
    }
#define FEW_ENTRY(NAME, BF16)                                         \
    static void NAME(const args_t *a, int b, int h, int r0, int nr) { \
        switch (nr) {                                                 \
        case 1: FEW_D(1, BF16)                                        \
        case 2: FEW_D(2, BF16)                                        \
        case 3: FEW_D(3, BF16)                                        \
        default: FEW_D(4, BF16)                                       \
        }                                                             \
    }
FEW_ENTRY(attend_few_f32, 0)
FEW_ENTRY(attend_few_bf16, 1)

/* Returns 0, or 1 when d is not a multiple of 32 up to DMAX, group < 1, or amx is asked without
 * bf16 or where it cannot run (not the AVX-512 build, or the OS refused the tile state). */
int rs_attend(const args_t *a) {
    if (a->d % 32 != 0 || a->d > DMAX || a->num_rows <= 0 || a->group < 1) return 1;
    if (a->amx && (!a->bf16 || !amx_ready())) return 1;
    const int blocks = (a->num_rows + QB - 1) / QB, items = a->num_b * a->num_h * blocks;
#pragma omp parallel for schedule(dynamic, 1) num_threads(a->num_threads) if (items > 1)
    for (int it = 0; it < items; ++it) {
        const int b = it / (a->num_h * blocks), h = it / blocks % a->num_h, r0 = it % blocks * QB;
        const int nr = a->num_rows - r0 < QB ? a->num_rows - r0 : QB;
        if (nr <= FEW)
            (a->bf16 ? attend_few_bf16 : attend_few_f32)(a, b, h, r0, nr);
#if HAVE_AMX
        else if (a->amx)
            attend_item_amx(a, b, h, r0, nr);
#endif
        else
            (a->bf16 ? attend_item_bf16 : attend_item_f32)(a, b, h, r0, nr);
    }
    return 0;
}

/* 1 where this process may use AMX tiles (native.py asks before it calls any tile code). */
int rs_amx_ready(void) { return amx_ready(); }

/* The instruction set this library was compiled for (native.py checks it against what it asked for). */
const char *rs_isa(void) { return RS_ISA; }
