/* radixserve's compiled CPU attention, built and loaded by native.py: one source for every
 * instruction set, which the vector layer (cpu_simd.h) maps to AVX-512, AVX2 + FMA or plain C.
 * rs_attend's contract is in cpu_attn.h; items of at most FEW rows go to cpu_attn_few.c.
 *
 * The work: items of QB query rows of one (b, h), spread over OpenMP threads (the libgomp torch
 * already loaded). Per item, keys go in blocks of KB: S^T = K Q^T (keys x rows, Q packed
 * transposed and pre-scaled by scale * log2 e, so softmax is exp2), an online softmax per row
 * that is vectorised across rows (S^T keeps a row's scores in a column), then O += P V. Both
 * products are register-blocked tiles (AVX-512: 8 keys x 32 rows, 8 rows x 32 columns, 16
 * accumulators; the scalar side broadcast), so the FMA units, not the loads, bound them.
 */
#include "cpu_attn.h"

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

#include "cpu_attn_dp.h"
#include "cpu_amx.h"

/* o[i0 + k][c0 : c0 + 16 * PV_NV] += sum_j p[j][i0 + k] V[j][c0 : c0 + 16 * PV_NV] for k < TILE, j < nk. */
RS_INLINE void pv_tile(const float *p, int i0, const void *const *vp, int c0, int nk, float *o, int d,
                       const int bf16, const int i8) {
    vf acc[TILE][PV_NV];
    for (int k = 0; k < TILE; ++k)
        for (int v = 0; v < PV_NV; ++v) acc[k][v] = vf_load(o + (i0 + k) * d + c0 + 16 * v);
    for (int j = 0; j < nk; ++j) {
        vf b[PV_NV];
        for (int v = 0; v < PV_NV; ++v) b[v] = kv_load(vp[j], c0 + 16 * v, bf16, i8);
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

/* Per block: the scores s scaled by sscale (in log2 units; i8: key j's by sscale * ksc[j] too) and masked
 * (when some row does not see every key of it), the running max m and sum l of each row updated, s turned
 * into probabilities (pairs: into pp as bf16 key pairs, cpu_attn_dp.h; i8: key j's times vsc[j] after the
 * sum l took them), o rescaled by exp2(old max - new max). Scaling or masking rewrites s first; a plain
 * block's max is taken unscaled (sscale > 0 commutes with it) and sscale applied inside the exponent. */
RS_INLINE void softmax_block(float *s, float sscale, int j0, int nk, int nkp, int np, int masked, const int32_t *lo,
                             const int32_t *hi, float *m, float *l, float *o, int d, uint32_t *pp, const int pairs,
                             const float *ksc, const float *vsc, const int i8) {
    const vf ninf = vf_set1(-INFINITY);
    const int in_place = i8 || masked || !(sscale > 0.0f);
    const vf ps = vf_set1(in_place ? 1.0f : sscale);
    for (int v = 0; v < np / 16; ++v) {
        const vi lov = vi_load(lo + 16 * v), hiv = vi_load(hi + 16 * v);
        const vf m_old = vf_load(m + 16 * v);
        vf mx = ninf;
        for (int j = 0; j < nkp; ++j) {
            vf x = vf_load(s + j * QB + 16 * v);
            if (in_place) {
                x = vf_mul(x, vf_set1(i8 ? sscale * ksc[j] : sscale));
                if (masked) {
                    const vi jj = vi_set1(j0 + j);
                    vm seen = vm_and(vi_ge(jj, lov), vi_lt(jj, hiv));
                    x = vf_blend(j < nk ? seen : vm_none(), x, ninf);
                }
                vf_store(s + j * QB + 16 * v, x);
            }
            mx = vf_max(mx, x);
        }
        mx = vf_max(m_old, in_place ? mx : vf_mul(mx, ps));
        /* A row with no key so far keeps max -inf; subtract 0 instead (its scores are all -inf). */
        const vf ref = vf_maskz(vf_ne(mx, ninf), mx), nref = vf_sub(vf_zero(), ref);
        const vf alpha = exp2_ps(vf_sub(m_old, ref));
        vf sum = vf_zero();
#if HAVE_DP
        if (pairs) {
            for (int j = 0; j < nkp; j += 2) {
                const vf p0 = exp2_ps(vf_fmadd(vf_load(s + j * QB + 16 * v), ps, nref));
                const vf p1 = exp2_ps(vf_fmadd(vf_load(s + (j + 1) * QB + 16 * v), ps, nref));
                put_pairs(pp + j / 2 * QB + 16 * v, i8 ? vf_mul(p0, vf_set1(vsc[j])) : p0,
                          i8 ? vf_mul(p1, vf_set1(vsc[j + 1])) : p1);
                sum = vf_add(sum, vf_add(p0, p1));
            }
        }
#endif
        for (int j = 0; j < nkp && !pairs; ++j) {
            const vf p = exp2_ps(vf_fmadd(vf_load(s + j * QB + 16 * v), ps, nref));
            vf_store(s + j * QB + 16 * v, i8 ? vf_mul(p, vf_set1(vsc[j])) : p);
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

/* One item: rows r0 .. r0 + nr of (b, h). bf16, i8, amx and dp are constants (see the entry points below):
 * fp32 reads K in place; bf16 and int8 widen each key block into scratch first (the tile broadcasts K
 * element by element, so widening once per block beats widening in the tile) and read V in place,
 * widened by the vector load; amx gathers the block's K rows and V key pairs into scratch and
 * multiplies on tiles (cpu_amx.h); dp reads K in place (int8: its rows and V's converted to bf16 in
 * scratch first, exact), pairs V into scratch and multiplies with vdpbf16ps (cpu_attn_dp.h). int8's
 * scales are applied in softmax_block. */
RS_INLINE void attend_item_impl(const args_t *a, int b, int h, int r0, int nr, void *scratch, const int bf16,
                                const int i8, const int amx, const int dp) {
    const int d = a->d, np = (nr + 15) / 16 * 16, key_grain = amx ? 32 : TILE;
    float qt[DMAX * QB] __attribute__((aligned(64))); /* amx, dp: unscaled bf16 pairs [d / 2][QB][2] */
    float s[KB * QB] __attribute__((aligned(64)));
    float o[QB * DMAX] __attribute__((aligned(64)));
    float m[QB] __attribute__((aligned(64))), l[QB] __attribute__((aligned(64)));
    int32_t lo[QB] __attribute__((aligned(64))), hi[QB] __attribute__((aligned(64)));
    const void *kp[KB], *vp[KB];
    float ksc[KB], vsc[KB]; /* i8: the block's scales */
    uint16_t *qt2 = (uint16_t *)qt, *kb = scratch; /* amx: K rows (then P pairs), V pairs, P rows; dp: V pairs, P pairs */
    float *kw = scratch;
    int jmin = a->num_keys, jmax = 0;
    const float qscale = a->scale * LOG2E;
    for (int i = 0; i < np; ++i) {
        const int64_t at = i < nr ? row_at(a, b, h, r0 + i, a->q_sb, a->q_sh, a->q_sr) : -1;
        lo[i] = 0, hi[i] = 0; /* padding rows: no key */
        if (at >= 0) row_bounds(a, b, r0 + i, &lo[i], &hi[i], &jmin, &jmax);
        m[i] = -INFINITY, l[i] = 0.0f;
        for (int c = 0; c < d; ++c) {
            if (amx || dp)
                qt2[(c & ~1) * QB + 2 * i + (c & 1)] = at >= 0 ? ((const uint16_t *)a->q)[at + c] : 0;
            else
                qt[c * QB + i] = at >= 0 ? elt(a->q, at + c, bf16) * qscale : 0.0f;
        }
    }
    memset(o, 0, sizeof(float) * np * d);
    const int64_t h_off = h * a->kv_sh;
    const int64_t *slots = a->slots ? a->slots + b * a->slots_sb : NULL;
    const int row_bytes = d * (i8 ? 1 : bf16 ? 2 : 4);
    for (int j0 = jmin; j0 < jmax; j0 += KB) {
        const int nk = jmax - j0 < KB ? jmax - j0 : KB, nkp = (nk + key_grain - 1) / key_grain * key_grain;
        for (int j = 0; j < nkp; ++j) { /* the tail of the last tile repeats a key (masked) */
            const int64_t key = j0 + (j < nk ? j : nk - 1), slot = slots ? slots[key] : key;
            kp[j] = kv_at(a->kc, slot * a->kv_ss + h_off, bf16, i8);
            vp[j] = kv_at(a->vc, slot * a->kv_ss + h_off, bf16, i8);
            if (i8) ksc[j] = kv_scale(a, a->ks, slot, h), vsc[j] = kv_scale(a, a->vs, slot, h);
            if (amx) {
                for (int c = 0; c < d; c += 32) memcpy(kb + j * d + c, (const uint16_t *)kp[j] + c, 64);
            } else if ((bf16 || i8) && !dp) {
                for (int c = 0; c < d; c += 16) vf_store(kw + j * d + c, kv_load(kp[j], c, bf16, i8));
                kp[j] = kw + j * d;
            }
#if HAVE_DP
            else if (dp && i8) { /* K and V rows as bf16, after the V pairs and P pairs */
                uint16_t *k16 = kb + KB * DMAX + KB * QB, *v16 = k16 + KB * DMAX;
                i8_to_bf16(kp[j], k16 + j * d, d), i8_to_bf16(vp[j], v16 + j * d, d);
                kp[j] = k16 + j * d, vp[j] = v16 + j * d;
            }
#endif
        }
        int masked = nkp != nk;
        for (int i = 0; i < nr && !masked; ++i) masked = lo[i] > j0 || hi[i] < j0 + nk;
        for (int j = 0; j < nkp; j += TILE) {
            /* the next block, spread over tiles */
            for (int jj = j0 + KB + j; jj < jmax && jj < j0 + KB + j + TILE; ++jj) {
                const int64_t off = (slots ? slots[jj] : jj) * a->kv_ss + h_off;
                PREFETCH_ROW(kv_at(a->kc, off, bf16, i8), row_bytes, PREFETCH_T1);
                PREFETCH_ROW(kv_at(a->vc, off, bf16, i8), row_bytes, PREFETCH_T1);
            }
            if (amx || dp) continue;
            int i = 0;
            for (; i + 16 * QK_NV <= np; i += 16 * QK_NV)
                qk_tile((const float *const *)kp + j, qt + i, d, s + j * QB + i, QK_NV);
            if (i < np) qk_tile((const float *const *)kp + j, qt + i, d, s + j * QB + i, 1);
        }
#if HAVE_DP
        if (dp) {
            qk_dp(kp, qt2, d, nkp, np, s);
            v_pairs(vp, d, nkp, kb);
        }
#endif
#if HAVE_AMX
        if (amx) {
            qk_amx(kb, qt2, d, nkp, np, s);
            v_pairs(vp, d, nkp, kb + KB * DMAX);
        }
#endif
        uint32_t *pp = (uint32_t *)(amx ? kb : kb + KB * DMAX); /* amx: over the K rows, used by now */
        softmax_block(s, amx || dp ? qscale : 1.0f, j0, nk, nkp, np, masked, lo, hi, m, l, o, d, pp, amx || dp, ksc, vsc,
                      i8);
#if HAVE_DP
        if (dp) {
            pv_dp(pp, kb, d, nkp, np, o);
            continue;
        }
#endif
#if HAVE_AMX
        if (amx) {
            p_rows(pp, nkp, np, kb + 2 * KB * DMAX);
            pv_amx(kb + 2 * KB * DMAX, kb + KB * DMAX, d, nkp, np, o);
            continue;
        }
#endif
        for (int i = 0; i < np; i += TILE)
            for (int c = 0; c < d; c += 16 * PV_NV) pv_tile(s, i, vp, c, nkp, o, d, bf16, i8);
    }
    for (int i = 0; i < nr; ++i) put_row(a, b, h, r0 + i, o + i * d, m[i], l[i]);
}

static void attend_item_f32(const args_t *a, int b, int h, int r0, int nr) {
    attend_item_impl(a, b, h, r0, nr, NULL, 0, 0, 0, 0);
}
static void attend_item_bf16(const args_t *a, int b, int h, int r0, int nr) {
    float kw[KB * DMAX] __attribute__((aligned(64))); /* a key block widened to fp32 */
    attend_item_impl(a, b, h, r0, nr, kw, 1, 0, 0, 0);
}
static void attend_item_i8(const args_t *a, int b, int h, int r0, int nr) { /* q fp32 or bf16, K / V int8 */
    float kw[KB * DMAX] __attribute__((aligned(64)));
    if (a->bf16)
        attend_item_impl(a, b, h, r0, nr, kw, 1, 1, 0, 0);
    else
        attend_item_impl(a, b, h, r0, nr, kw, 0, 1, 0, 0);
}
#if HAVE_DP
DP_TARGET __attribute__((flatten)) static void attend_item_dp(const args_t *a, int b, int h, int r0, int nr) {
    uint16_t scratch[KB * DMAX + KB * QB] __attribute__((aligned(64))); /* V pairs, P pairs */
    attend_item_impl(a, b, h, r0, nr, scratch, 1, 0, 0, 1);
}
DP_TARGET __attribute__((flatten)) static void attend_item_dp_i8(const args_t *a, int b, int h, int r0, int nr) {
    uint16_t scratch[3 * KB * DMAX + KB * QB] __attribute__((aligned(64))); /* V pairs, P pairs, K and V rows */
    attend_item_impl(a, b, h, r0, nr, scratch, 1, 1, 0, 1);
}
#endif
#if HAVE_AMX
AMX_TARGET __attribute__((flatten)) static void attend_item_amx(const args_t *a, int b, int h, int r0, int nr) {
    uint16_t scratch[2 * KB * DMAX + QB * KB] __attribute__((aligned(64))); /* K rows, V pairs, P rows */
    tile_config saved __attribute__((aligned(64)));
    amx_begin(&saved);
    attend_item_impl(a, b, h, r0, nr, scratch, 1, 0, 1, 0);
    amx_end(&saved);
}
#endif

/* Returns 0, or 1 when d is not a multiple of 32 up to DMAX, group < 1, or AMX / DP products are asked
 * without bf16 q or where they cannot run (not the AVX-512 build, or the OS refused the tile state), or
 * AMX over int8 K / V. */
int rs_attend(const args_t *a) {
    if (a->d % 32 != 0 || a->d > DMAX || a->num_rows <= 0 || a->group < 1) return 1;
    if ((a->prod != PROD_FMA && !a->bf16) || (a->prod == PROD_AMX && a->kv_i8)) return 1;
    if ((a->prod == PROD_AMX && !amx_ready()) || (a->prod == PROD_DP && !HAVE_DP) || a->prod > PROD_DP) return 1;
    const int blocks = (a->num_rows + QB - 1) / QB, items = a->num_b * a->num_h * blocks;
#pragma omp parallel for schedule(dynamic, 1) num_threads(a->num_threads) if (items > 1)
    for (int it = 0; it < items; ++it) {
        const int b = it / (a->num_h * blocks), h = it / blocks % a->num_h, r0 = it % blocks * QB;
        const int nr = a->num_rows - r0 < QB ? a->num_rows - r0 : QB;
        if (nr <= FEW)
            rs_attend_few(a, b, h, r0, nr);
#if HAVE_AMX
        else if (a->prod == PROD_AMX)
            attend_item_amx(a, b, h, r0, nr);
#endif
#if HAVE_DP
        else if (a->prod == PROD_DP)
            (a->kv_i8 ? attend_item_dp_i8 : attend_item_dp)(a, b, h, r0, nr);
#endif
        else
            (a->kv_i8 ? attend_item_i8 : a->bf16 ? attend_item_bf16 : attend_item_f32)(a, b, h, r0, nr);
    }
    return 0;
}

/* 1 where this process may use AMX tiles (native.py asks before it calls any tile code). */
int rs_amx_ready(void) { return amx_ready(); }

/* The instruction set this library was compiled for (native.py checks it against what it asked for). */
const char *rs_isa(void) { return RS_ISA; }
