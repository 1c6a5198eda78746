/* rs_attend's items of at most FEW rows (cpu_attn.h has the contract; cpu_kernels.c the items of many rows). */
#include "cpu_attn.h"

/* Items of at most FEW rows (a decode's stacked GQA heads): a register tile of 16 or 32 rows would
 * be mostly padding, so scores are dot products along d (one horizontal sum per key and row),
 * and O, Q stay in registers (nd = d / 16 and nr are constants after inlining). bf16 K/V are
 * widened as they are loaded, int8 too (K's scale then multiplies the score, V's the probability): the
 * horizontal sums, not the products, bound this path. */
RS_INLINE void attend_few_impl(const args_t *a, int b, int h, int r0, const int nr, const int nd, const int bf16,
                               const int i8) {
    float s[FEW][KB] __attribute__((aligned(64))), vsc[KB];
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
    const int row_bytes = nd * 16 * (i8 ? 1 : bf16 ? 2 : 4);
    const vf ninf = vf_set1(-INFINITY);
    for (int j0 = jmin; j0 < jmax; j0 += KB) {
        const int nk = jmax - j0 < KB ? jmax - j0 : KB;
        for (int j = 0; j < nk; ++j) {
            const int64_t slot = slots ? slots[j0 + j] : j0 + j, off = slot * a->kv_ss + h_off;
            const void *kr = kv_at(a->kc, off, bf16, i8);
            if (j0 + j + 16 < jmax) /* decode keys lie on scattered slots: K 16 keys ahead, V for the P V pass */
                PREFETCH_ROW(kv_at(a->kc, (slots ? slots[j0 + j + 16] : j0 + j + 16) * a->kv_ss + h_off, bf16, i8),
                             row_bytes, PREFETCH_T0);
            PREFETCH_ROW(kv_at(a->vc, off, bf16, i8), row_bytes, PREFETCH_T1);
            vf acc[FEW];
            for (int r = 0; r < nr; ++r) acc[r] = vf_mul(q[r][0], kv_load(kr, 0, bf16, i8));
            for (int c = 1; c < nd; ++c) {
                const vf kv = kv_load(kr, 16 * c, bf16, i8);
                for (int r = 0; r < nr; ++r) acc[r] = vf_fmadd(q[r][c], kv, acc[r]);
            }
            const float ksc = i8 ? kv_scale(a, a->ks, slot, h) : 1.0f; /* int8: K's scale on the score */
            if (i8) vsc[j] = kv_scale(a, a->vs, slot, h);
            for (int r = 0; r < nr; ++r) s[r][j] = i8 ? vf_hsum(acc[r]) * ksc : vf_hsum(acc[r]);
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
        for (int c0 = 0; c0 < nd; c0 += FEW_PV_CHUNKS) { /* the chunks of O that fit in registers (cpu_simd.h) */
            const int nc = nd - c0 < FEW_PV_CHUNKS ? nd - c0 : FEW_PV_CHUNKS;
            vf oc[FEW][FEW_PV_CHUNKS];
            for (int r = 0; r < nr; ++r)
                for (int i = 0; i < nc; ++i) oc[r][i] = o[r][c0 + i];
            for (int j = 0; j < nk; ++j) {
                const void *vr = kv_at(a->vc, (slots ? slots[j0 + j] : j0 + j) * a->kv_ss + h_off, bf16, i8);
                for (int i = 0; i < nc; ++i) { /* int8: V's scale on the probability (l holds the unscaled sum) */
                    const vf vv = kv_load(vr, 16 * (c0 + i), bf16, i8);
                    for (int r = 0; r < nr; ++r)
                        oc[r][i] = vf_fmadd(vf_set1(i8 ? s[r][j] * vsc[j] : s[r][j]), vv, oc[r][i]);
                }
            }
            for (int r = 0; r < nr; ++r)
                for (int i = 0; i < nc; ++i) o[r][c0 + i] = oc[r][i];
        }
    }
    for (int r = 0; r < nr; ++r) {
        float row[DMAX] __attribute__((aligned(64)));
        for (int c = 0; c < nd; ++c) vf_store(row + 16 * c, o[r][c]);
        put_row(a, b, h, r0 + r, row, m[r], l[r]);
    }
}

/* attend_few_impl specialised on the rows, d / 16 (d is a multiple of 32, at most DMAX = 128) and
 * the element types (q's; K / V's: q's or int8). */
#define FEW_D(NR, BF16, I8)                                                                \
    if (!FEW_CONST_D) { attend_few_impl(a, b, h, r0, NR, a->d / 16, BF16, I8); return; } \
    switch (a->d) {                                                                        \
    case 32: attend_few_impl(a, b, h, r0, NR, 2, BF16, I8); return;                        \
    case 64: attend_few_impl(a, b, h, r0, NR, 4, BF16, I8); return;                        \
    case 96: attend_few_impl(a, b, h, r0, NR, 6, BF16, I8); return;                        \
    default: attend_few_impl(a, b, h, r0, NR, 8, BF16, I8); return;                        \
    }
#define FEW_ENTRY(NAME, BF16, I8)                                     \
    static void NAME(const args_t *a, int b, int h, int r0, int nr) { \
        switch (nr) {                                                 \
        case 1: FEW_D(1, BF16, I8)                                    \
        case 2: FEW_D(2, BF16, I8)                                    \
        case 3: FEW_D(3, BF16, I8)                                    \
        default: FEW_D(4, BF16, I8)                                   \
        }                                                             \
    }
FEW_ENTRY(attend_few_f32, 0, 0)
FEW_ENTRY(attend_few_bf16, 1, 0)
FEW_ENTRY(attend_few_f32_i8, 0, 1)
FEW_ENTRY(attend_few_bf16_i8, 1, 1)

void rs_attend_few(const args_t *a, int b, int h, int r0, int nr) {
    if (a->kv_i8)
        (a->bf16 ? attend_few_bf16_i8 : attend_few_f32_i8)(a, b, h, r0, nr);
    else
        (a->bf16 ? attend_few_bf16 : attend_few_f32)(a, b, h, r0, nr);
}

