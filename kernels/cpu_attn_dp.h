/* vdpbf16ps products for cpu_kernels.c's items of many rows in bf16, where the CPU has AVX512-BF16 but
 * no AMX tiles: the AVX-512 build compiles them under DP_TARGET and calls them only where native.py
 * says the CPU has the flag. vdpbf16ps multiplies 16 lanes of bf16 pairs and adds both products to
 * fp32 sums: twice the products of an fp32 FMA per instruction, at the FMA's rate. Per key block:
 *
 *   S^T = K Q^T  a K pair (K[k][c], K[k][c + 1]) broadcast from the pool row in place, times Q^T as
 *                pairs qt2 [d / 2][QB][2] (16 rows a vector); register tiles of TILE keys x 16 * nv rows.
 *                q is unscaled (scaled q would be rounded to bf16 again): softmax_block scales the scores.
 *   O += P V     a P pair (p[2t][i], p[2t + 1][i]) broadcast from pp [keys / 2][QB] (written by
 *                softmax_block, rounded to bf16: the one approximation beyond fp32 sums; the softmax sum l
 *                stays fp32 over the unrounded p) times V as key pairs vb [keys / 2][d][2] (v_pairs,
 *                once per key block); register tiles of TILE rows x 16 * PV_NV columns.
 *
 * Keys come in multiples of TILE (the block's tail repeats a key, masked to p = 0), rows in multiples of 16.
 * The helpers are plain `inline` under the target attribute: cpu_kernels.c's item function for this path
 * (itself under DP_TARGET) flattens them in, so the tiles' loop bounds are constants there.
 */
#if defined(__AVX512F__)
#define HAVE_DP 1

DP_TARGET static inline __m512bh pair_set1(const void *p) { /* one 32-bit pair broadcast to every lane */
    int32_t pair;
    memcpy(&pair, p, sizeof pair);
    return (__m512bh)_mm512_set1_epi32(pair);
}

/* s[k][i] = sum_c K[k][c] Q[i][c] for TILE keys and 16 * nv rows (nv a constant after inlining). */
DP_TARGET static inline void qk_dp_tile(const void *const *kp, const uint16_t *qt2, int d, float *s, const int nv) {
    __m512 acc[TILE][QK_NV];
    for (int k = 0; k < TILE; ++k)
        for (int v = 0; v < nv; ++v) acc[k][v] = _mm512_setzero_ps();
    for (int c = 0; c < d; c += 2) {
        __m512bh b[QK_NV];
        for (int v = 0; v < nv; ++v) b[v] = (__m512bh)_mm512_load_si512(qt2 + c * QB + 32 * v);
#pragma GCC unroll 8
        for (int k = 0; k < TILE; ++k) {
            const __m512bh a = pair_set1((const uint16_t *)kp[k] + c);
            for (int v = 0; v < nv; ++v) acc[k][v] = _mm512_dpbf16_ps(acc[k][v], a, b[v]);
        }
    }
    for (int k = 0; k < TILE; ++k)
        for (int v = 0; v < nv; ++v) _mm512_store_ps(s + k * QB + 16 * v, acc[k][v]);
}

/* s[j][i] = K[j] . Q[i] for keys j < nkp and rows i < np. */
DP_TARGET static inline void qk_dp(const void *const *kp, const uint16_t *qt2, int d, int nkp, int np, float *s) {
    for (int j = 0; j < nkp; j += TILE) {
        int i = 0;
        for (; i + 16 * QK_NV <= np; i += 16 * QK_NV) qk_dp_tile(kp + j, qt2 + 2 * i, d, s + j * QB + i, QK_NV);
        if (i < np) qk_dp_tile(kp + j, qt2 + 2 * i, d, s + j * QB + i, 1);
    }
}

/* pp[t][i..i + 15] = the pairs (p0[lane], p1[lane]) rounded to bf16: p0 of key 2t, p1 of key 2t + 1. */
DP_TARGET static inline void put_pairs(uint32_t *pp, __m512 p0, __m512 p1) {
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                                22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    _mm512_store_si512(pp, _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(p1, p0)));
}

/* vb[t][c][0 / 1] = V[2t][c] / V[2t + 1][c] for key pairs t < nkp / 2: the pairs P V multiplies. */
DP_TARGET static inline void v_pairs(const void *const *vp, int d, int nkp, uint16_t *vb) {
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                        37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24, 55, 23, 54,
                                        22, 53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);
    for (int t = 0; t < nkp / 2; ++t)
        for (int c = 0; c < d; c += 32) {
            const __m512i a = _mm512_loadu_si512((const uint16_t *)vp[2 * t] + c);
            const __m512i b = _mm512_loadu_si512((const uint16_t *)vp[2 * t + 1] + c);
            _mm512_store_si512(vb + 2 * (t * d + c), _mm512_permutex2var_epi16(a, lo, b));
            _mm512_store_si512(vb + 2 * (t * d + c + 16), _mm512_permutex2var_epi16(a, hi, b));
        }
}

/* dst[0 .. d) = the int8 row src as bf16 (exact: |x| <= 127 has 7 significant bits), for the int8 KV cache. */
DP_TARGET static inline void i8_to_bf16(const void *src, uint16_t *dst, int d) {
    for (int c = 0; c < d; c += 32) {
        const __m128i *at = (const __m128i *)((const int8_t *)src + c);
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(at)));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(at + 1)));
        _mm512_storeu_si512(dst + c, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

/* o[i0 + k][c0 : c0 + 16 * PV_NV] += sum_t pp[t][i0 + k] . vb[t][c0 : ...] for k < TILE, key pairs t < nt. */
DP_TARGET static inline void pv_dp_tile(const uint32_t *pp, int i0, const uint16_t *vb, int c0, int nt, float *o,
                                    int d) {
    __m512 acc[TILE][PV_NV];
    for (int k = 0; k < TILE; ++k)
        for (int v = 0; v < PV_NV; ++v) acc[k][v] = _mm512_load_ps(o + (i0 + k) * d + c0 + 16 * v);
    for (int t = 0; t < nt; ++t) {
        __m512bh b[PV_NV];
        for (int v = 0; v < PV_NV; ++v) b[v] = (__m512bh)_mm512_load_si512(vb + 2 * (t * d + c0 + 16 * v));
        const uint32_t *pt = pp + t * QB + i0;
#pragma GCC unroll 8
        for (int k = 0; k < TILE; ++k) {
            const __m512bh a = pair_set1(pt + k);
            for (int v = 0; v < PV_NV; ++v) acc[k][v] = _mm512_dpbf16_ps(acc[k][v], a, b[v]);
        }
    }
    for (int k = 0; k < TILE; ++k)
        for (int v = 0; v < PV_NV; ++v) _mm512_store_ps(o + (i0 + k) * d + c0 + 16 * v, acc[k][v]);
}

/* o[i][c] += sum_j P[i][j] V[j][c] for rows i < np, keys j < nkp, columns c < d. */
DP_TARGET static inline void pv_dp(const uint32_t *pp, const uint16_t *vb, int d, int nkp, int np, float *o) {
    for (int i = 0; i < np; i += TILE)
        for (int c = 0; c < d; c += 16 * PV_NV) pv_dp_tile(pp, i, vb, c, nkp / 2, o, d);
}
#else
#define HAVE_DP 0
#endif
