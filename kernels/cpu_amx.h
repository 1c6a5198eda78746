/* AMX tiles for cpu_kernels.c's items of many rows in bf16: the AVX-512 build compiles them under a
 * target attribute and calls them only where the CPU has AMX-BF16 and the OS granted the tile
 * state (rs_amx_ready; native.py asks it once). tdpbf16ps multiplies 16 x 32 by 32 x 16 bf16 into
 * 16 x 16 fp32 sums, an order of magnitude more products per cycle than the FMAs. Per key block:
 *
 *   S^T = K Q^T  A: K rows gathered into kb [keys][d]; B: Q^T as pairs qt2 [d / 2][QB][2]; C: 16 keys
 *                x 16 rows of s [keys][QB], the layout softmax_block reads (q is unscaled: scaled q
 *                would be rounded to bf16 again, so softmax_block scales the scores).
 *   O += P V     A: P [rows][keys] in bf16 (rounded: the one approximation beyond fp32 sums; the softmax
 *                sum l stays fp32 over the unrounded p): softmax_block writes it as key pairs pp [keys / 2]
 *                [rows] (32 bits a pair, as for vdpbf16ps), p_rows transposes those 32-bit pairs; B: V as
 *                key pairs vb [keys / 2][d][2] (v_pairs, cpu_attn_dp.h); C: 16 x 16 tiles of o [rows][d].
 *
 * Keys come in multiples of 32 (the block's tail repeats a key, masked to p = 0) and rows in
 * multiples of 16 (padding rows see nothing). Tiles 0-3 accumulate, 4 and 5 are the operands.
 */
#include "cpu_tiles.h"

#if HAVE_AMX
/* Six tiles of 16 rows x 64 bytes. */
AMX_TARGET static inline void amx_begin(tile_config *saved) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 6; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    amx_enter(saved, &cfg);
}

/* s[j][i] = K[j] . Q[i] for keys j < nkp and rows i < np (at most 64: one accumulator tile per 16). */
AMX_TARGET static inline void qk_amx(const uint16_t *kb, const uint16_t *qt2, int d, int nkp, int np, float *s) {
#define QK_ROWS(T)                                                  \
    if (16 * (T) < np) {                                            \
        _tile_loadd(5, qt2 + c * QB + 32 * (T), 4 * QB);           \
        _tile_dpbf16ps(T, 4, 5);                                    \
    }
#define S_STORE(T) \
    if (16 * (T) < np) _tile_stored(T, s + j * QB + 16 * (T), 4 * QB);
    for (int j = 0; j < nkp; j += 16) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int c = 0; c < d; c += 32) {
            _tile_loadd(4, kb + j * d + c, 2 * d);
            QK_ROWS(0) QK_ROWS(1) QK_ROWS(2) QK_ROWS(3)
        }
        S_STORE(0) S_STORE(1) S_STORE(2) S_STORE(3)
    }
#undef QK_ROWS
#undef S_STORE
}

/* The permutations of transpose16: per scale h = 8, 4, 2, 1 (step t), lanes for row i and row i + h. */
AMX_TARGET static inline void transpose_indices(__m512i idx[4][2]) {
    for (int t = 0, h = 8; t < 4; ++t, h /= 2) {
        int lo[16], hi[16];
        for (int j = 0; j < 16; ++j) {
            lo[j] = j & h ? 16 + j - h : j; /* row i keeps its left part and takes row i + h's */
            hi[j] = j & h ? 16 + j : j + h;
        }
        idx[t][0] = _mm512_loadu_si512(lo), idx[t][1] = _mm512_loadu_si512(hi);
    }
}

/* r[i][j] := r[j][i] for 16 x 16 floats: off-diagonal blocks swapped at every scale. */
AMX_TARGET static inline void transpose16(__m512 r[16], const __m512i idx[4][2]) {
    for (int t = 0, h = 8; t < 4; ++t, h /= 2)
        for (int i = 0; i < 16; ++i)
            if (!(i & h)) {
                const __m512 a = r[i], b = r[i + h];
                r[i] = _mm512_permutex2var_ps(a, idx[t][0], b), r[i + h] = _mm512_permutex2var_ps(a, idx[t][1], b);
            }
}

/* pb[i][2t, 2t + 1] = pp[t][i] for rows i < np and key pairs t < nkp / 2: 16 x 16 blocks of 32-bit pairs. */
AMX_TARGET static inline void p_rows(const uint32_t *pp, int nkp, int np, uint16_t *pb) {
    __m512i idx[4][2];
    transpose_indices(idx);
    for (int t = 0; t < nkp / 2; t += 16)
        for (int i = 0; i < np; i += 16) {
            __m512 r[16];
            for (int k = 0; k < 16; ++k) r[k] = _mm512_load_ps((const float *)(pp + (t + k) * QB + i));
            transpose16(r, idx);
            for (int k = 0; k < 16; ++k) _mm512_storeu_ps((float *)(pb + (i + k) * KB + 2 * t), r[k]);
        }
}

/* o[i][c] += sum_j P[i][j] V[j][c] for rows i < np, keys j < nkp, columns c < d (64 at a time). */
AMX_TARGET static inline void pv_amx(const uint16_t *pb, const uint16_t *vb, int d, int nkp, int np, float *o) {
#define O_LOAD(T) \
    if (c + 16 * (T) < d) _tile_loadd(T, o + i * d + c + 16 * (T), 4 * d);
#define PV_COLS(T)                                                   \
    if (c + 16 * (T) < d) {                                          \
        _tile_loadd(5, vb + j * d + 2 * (c + 16 * (T)), 4 * d);     \
        _tile_dpbf16ps(T, 4, 5);                                     \
    }
#define O_STORE(T) \
    if (c + 16 * (T) < d) _tile_stored(T, o + i * d + c + 16 * (T), 4 * d);
    for (int i = 0; i < np; i += 16)
        for (int c = 0; c < d; c += 64) {
            O_LOAD(0) O_LOAD(1) O_LOAD(2) O_LOAD(3)
            for (int j = 0; j < nkp; j += 32) { /* key pairs j / 2 .. j / 2 + 15 */
                _tile_loadd(4, pb + i * KB + j, 2 * KB);
                PV_COLS(0) PV_COLS(1) PV_COLS(2) PV_COLS(3)
            }
            O_STORE(0) O_STORE(1) O_STORE(2) O_STORE(3)
        }
#undef O_LOAD
#undef PV_COLS
#undef O_STORE
}
#endif
