/* The vector layer of cpu_kernels.c and cpu_linear.c: 16-float vectors (vf), 16-int vectors (vi) and
 * 16-lane masks (vm), once per instruction set, so that the kernels' algorithm is written once; bf16
 * inputs are widened to fp32 on load (vf_load_bf16, bf16_to_f32), int8 too (vf_load_i8: the int8 KV cache).
 *
 * AVX-512 (compiled with -mavx512f ...): thin wrappers over the intrinsics, one zmm register per
 * vector and a k register per mask. Everything else (AVX2 + FMA, or the plain baseline of the
 * target: SSE2 on x86-64, NEON on arm64) takes GNU C vectors of the hardware's width (VW floats),
 * a vf being 16 / VW of them (two ymm or four xmm registers); the compiler contracts a * b + c into
 * an FMA where -mfma allows. Masks there are vi lanes of -1 / 0.
 *
 * TILE (keys per S tile, rows per O tile) and QK_NV / PV_NV (vectors per tile row) size the
 * register tiles of cpu_kernels.c to the target's register file: AVX-512 has 32 zmm registers,
 * AVX2 16 ymm registers holding half a vf each. FEW_CONST_D: the few-row decode path is compiled
 * once per head dim, its Q and O rows held in registers; where they would not fit, once for all.
 * FEW_PV_CHUNKS: the 16-float chunks of the few-row path's O rows that one pass over a block's keys
 * accumulates (each pass re-reads the block's probabilities): all of them on AVX-512, one on AVX2,
 * whose 16 registers hold 4 rows x one chunk but not 4 rows x d / 16.
 */
#include <stdint.h>
#include <string.h>

#define RS_INLINE static inline __attribute__((always_inline))
#define PREFETCH_T0(p) __builtin_prefetch((p), 0, 3)
#define PREFETCH_T1(p) __builtin_prefetch((p), 0, 2)

#if defined(__AVX512F__)
#include <immintrin.h>

#define RS_ISA "avx512"
#define TILE 8
#define QK_NV 2
#define PV_NV 2
#define FEW_CONST_D 1
#define FEW_PV_CHUNKS 8 /* DMAX / 16: every chunk of O in one pass over the keys */
/* AVX512-BF16 code (vdpbf16ps) inside this build, called only where the CPU has the flag (native.py
 * decides): a function-level target, since the library must also run on AVX-512 CPUs without it. */
#define DP_TARGET __attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl")))
typedef __m512 vf;
typedef __m512i vi;
typedef __mmask16 vm;

RS_INLINE vf vf_load(const float *p) { return _mm512_load_ps(p); } /* 64-byte aligned */
RS_INLINE vf vf_loadu(const float *p) { return _mm512_loadu_ps(p); }
RS_INLINE void vf_store(float *p, vf x) { _mm512_store_ps(p, x); }
RS_INLINE void vf_storeu(float *p, vf x) { _mm512_storeu_ps(p, x); }
RS_INLINE vf vf_set1(float s) { return _mm512_set1_ps(s); }
RS_INLINE vf vf_zero(void) { return _mm512_setzero_ps(); }
RS_INLINE vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
RS_INLINE vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
RS_INLINE vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
RS_INLINE vf vf_fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
RS_INLINE vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); } /* b where either is NaN */
RS_INLINE float vf_hsum(vf x) { return _mm512_reduce_add_ps(x); }
RS_INLINE float vf_hmax(vf x) { return _mm512_reduce_max_ps(x); }
RS_INLINE vf vf_blend(vm m, vf yes, vf no) { return _mm512_mask_mov_ps(no, m, yes); }
RS_INLINE vf vf_maskz(vm m, vf x) { return _mm512_maskz_mov_ps(m, x); }
RS_INLINE vm vm_first(int64_t n) { return n >= 16 ? (vm)0xFFFF : (vm)((1u << n) - 1); } /* lanes < n */
/* The first n floats at p, lanes from n on `fill` (nothing read past p + n). */
RS_INLINE vf vf_loadu_first(const float *p, int64_t n, float fill) {
    return _mm512_mask_loadu_ps(_mm512_set1_ps(fill), vm_first(n), p);
}
RS_INLINE vf vf_load_bf16(const uint16_t *p) { /* 16 bf16 widened to fp32 (exact: a shift) */
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
RS_INLINE vf vf_load_i8(const int8_t *p) { /* 16 int8 widened to fp32 (exact) */
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
RS_INLINE vf vf_load_u8(const uint8_t *p) { /* 16 uint8 widened to fp32 (exact) */
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
RS_INLINE vf vf_set1_pair(const float *p) { /* p[0], p[1], p[0], p[1], ... */
    double d;
    memcpy(&d, p, sizeof d);
    return _mm512_castpd_ps(_mm512_set1_pd(d));
}
RS_INLINE vf vf_load_f16(const uint16_t *p) { /* 16 fp16 widened to fp32 (exact) */
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
RS_INLINE void vf_dup_pairs(vf v, vf *lo, vf *hi) { /* lo = v0, v0, v1, v1, .., v7, v7; hi the same of v8..v15 */
    const __m512i idx = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    *lo = _mm512_permutexvar_ps(idx, v);
    *hi = _mm512_permutexvar_ps(_mm512_add_epi32(idx, _mm512_set1_epi32(8)), v);
}
RS_INLINE vi vi_load(const int32_t *p) { return _mm512_load_si512(p); } /* 64-byte aligned */
RS_INLINE vi vi_set1(int32_t s) { return _mm512_set1_epi32(s); }
RS_INLINE vi vi_iota(int32_t j) { /* j, j + 1, ..., j + 15 */
    return _mm512_add_epi32(_mm512_set1_epi32(j),
                            _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
}
RS_INLINE vm vi_ge(vi a, vi b) { return _mm512_cmpge_epi32_mask(a, b); }
RS_INLINE vm vi_lt(vi a, vi b) { return _mm512_cmplt_epi32_mask(a, b); }
RS_INLINE vm vf_ge(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
RS_INLINE vm vf_eq(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
RS_INLINE vm vf_ne(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_NEQ_OQ); } /* false where NaN */
RS_INLINE vm vf_isnan(vf a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
RS_INLINE vm vm_and(vm a, vm b) { return a & b; }
RS_INLINE vm vm_or(vm a, vm b) { return a | b; }
RS_INLINE vm vm_none(void) { return 0; }
RS_INLINE int vm_any(vm m) { return m != 0; }
RS_INLINE int vm_first_set(vm m) { return __builtin_ctz(m); } /* m must not be empty */

/* 2^t; exactly 0 below 2^-126 (masked scores are -inf), no denormals. */
RS_INLINE vf exp2_poly(vf f);
RS_INLINE vf exp2_ps(vf t) {
    const vm normal = vf_ge(t, vf_set1(-126.0f));
    t = vf_max(t, vf_set1(-126.0f));
    const vf n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return vf_maskz(normal, _mm512_scalef_ps(exp2_poly(vf_sub(t, n)), n));
}

#else /* AVX2 + FMA, or the target's baseline: GNU C vectors */

#if defined(__AVX2__)
#define RS_ISA "avx2"
#else
#define RS_ISA "portable"
#endif
#define TILE 4
#define QK_NV 1
#define PV_NV 1
#define FEW_CONST_D 0
#define FEW_PV_CHUNKS 1
#if defined(__AVX2__)
#define VW 8 /* floats per hardware vector */
#else
#define VW 4
#endif
/* A vf is 16 / VW hardware-width vectors: the compiler splits wider GNU vectors badly (per lane
 * for compares and blends), but keeps each part of a struct in a register. */
typedef float vn __attribute__((vector_size(4 * VW)));
typedef int32_t vni __attribute__((vector_size(4 * VW)));
typedef struct { vn p[16 / VW]; } vf;
typedef struct { vni p[16 / VW]; } vi;
typedef vi vm; /* lanes -1 (set) or 0 */
#define EACH(i) for (int i = 0; i < 16 / VW; ++i)

/* memcpy per part: aligned or not, one vector load or store each (a whole-struct copy goes
 * through the stack). */
RS_INLINE vf vf_loadu(const float *p) { vf x; EACH(i) memcpy(&x.p[i], p + VW * i, sizeof x.p[i]); return x; }
RS_INLINE vf vf_load(const float *p) { return vf_loadu(p); }
RS_INLINE void vf_storeu(float *p, vf x) { EACH(i) memcpy(p + VW * i, &x.p[i], sizeof x.p[i]); }
RS_INLINE void vf_store(float *p, vf x) { vf_storeu(p, x); }
RS_INLINE vf vf_set1(float s) { vf x; EACH(i) x.p[i] = s - (vn){0}; return x; } /* s - 0 is s, -0 too */
RS_INLINE vf vf_zero(void) { return vf_set1(0.0f); }
RS_INLINE vf vf_add(vf a, vf b) { EACH(i) a.p[i] += b.p[i]; return a; }
RS_INLINE vf vf_sub(vf a, vf b) { EACH(i) a.p[i] -= b.p[i]; return a; }
RS_INLINE vf vf_mul(vf a, vf b) { EACH(i) a.p[i] *= b.p[i]; return a; }
RS_INLINE vf vf_fmadd(vf a, vf b, vf c) { EACH(i) c.p[i] += a.p[i] * b.p[i]; return c; }
RS_INLINE vf vf_blend(vm m, vf yes, vf no) {
    EACH(i) yes.p[i] = (vn)(((vni)yes.p[i] & m.p[i]) | ((vni)no.p[i] & ~m.p[i]));
    return yes;
}
RS_INLINE vf vf_maskz(vm m, vf x) { EACH(i) x.p[i] = (vn)((vni)x.p[i] & m.p[i]); return x; }
RS_INLINE vm vf_gt(vf a, vf b) { vm m; EACH(i) m.p[i] = a.p[i] > b.p[i]; return m; }
RS_INLINE vf vf_max(vf a, vf b) { return vf_blend(vf_gt(a, b), a, b); } /* b where either is NaN, as maxps */
RS_INLINE float vf_lane(vf x, int i) { return x.p[i / VW][i % VW]; }
RS_INLINE float vf_hsum(vf x) { /* a tree (lanes VW apart, then halves): 4 dependent adds, not 15 in a row */
    vn s = x.p[0];
    for (int i = 1; i < 16 / VW; ++i) s += x.p[i];
    float l[VW];
    memcpy(l, &s, sizeof l);
    for (int w = VW / 2; w > 0; w /= 2)
        for (int i = 0; i < w; ++i) l[i] += l[i + w];
    return l[0];
}
RS_INLINE float vf_hmax(vf x) {
    float m = vf_lane(x, 0);
    for (int i = 1; i < 16; ++i) m = vf_lane(x, i) > m ? vf_lane(x, i) : m;
    return m;
}
RS_INLINE vi vi_load(const int32_t *p) { vi x; EACH(i) memcpy(&x.p[i], p + VW * i, sizeof x.p[i]); return x; }
RS_INLINE vi vi_set1(int32_t s) { vi x; EACH(i) x.p[i] = (vni){0} + s; return x; }
RS_INLINE vi vi_iota(int32_t j) { /* j, j + 1, ..., j + 15 */
    const int32_t lanes[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    vi x = vi_load(lanes);
    EACH(i) x.p[i] += j;
    return x;
}
RS_INLINE vm vi_ge(vi a, vi b) { vm m; EACH(i) m.p[i] = a.p[i] >= b.p[i]; return m; }
RS_INLINE vm vi_lt(vi a, vi b) { vm m; EACH(i) m.p[i] = a.p[i] < b.p[i]; return m; }
RS_INLINE vm vm_and(vm a, vm b) { EACH(i) a.p[i] &= b.p[i]; return a; }
RS_INLINE vm vm_or(vm a, vm b) { EACH(i) a.p[i] |= b.p[i]; return a; }
RS_INLINE vm vm_first(int64_t n) { return vi_lt(vi_iota(0), vi_set1(n < 16 ? (int32_t)n : 16)); } /* lanes < n */
RS_INLINE vf vf_loadu_first(const float *p, int64_t n, float fill) {
    if (n >= 16) return vf_loadu(p);
    float lanes[16];
    for (int i = 0; i < 16; ++i) lanes[i] = i < n ? p[i] : fill;
    return vf_loadu(lanes);
}
typedef uint16_t vh __attribute__((vector_size(2 * VW)));
RS_INLINE vf vf_load_bf16(const uint16_t *p) { /* 16 bf16 widened to fp32 (exact: a shift) */
    vf x;
    EACH(i) {
        vh h;
        memcpy(&h, p + VW * i, sizeof h);
        x.p[i] = (vn)(__builtin_convertvector(h, vni) << 16);
    }
    return x;
}
#if defined(__AVX2__) /* GCC widens byte vectors lane by lane (a scalar convert each): by intrinsic here */
#include <immintrin.h>
RS_INLINE vf vf_load_i8(const int8_t *p) { /* 16 int8 widened to fp32 (exact) */
    vf x;
    EACH(i) x.p[i] = (vn)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + VW * i))));
    return x;
}
RS_INLINE vf vf_load_u8(const uint8_t *p) { /* 16 uint8 widened to fp32 (exact) */
    vf x;
    EACH(i) x.p[i] = (vn)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + VW * i))));
    return x;
}
#else
typedef int8_t vq8 __attribute__((vector_size(VW)));
RS_INLINE vf vf_load_i8(const int8_t *p) { /* 16 int8 widened to fp32 (exact) */
    vf x;
    EACH(i) {
        vq8 q;
        memcpy(&q, p + VW * i, sizeof q);
        x.p[i] = __builtin_convertvector(q, vn);
    }
    return x;
}
typedef uint8_t vu8 __attribute__((vector_size(VW)));
RS_INLINE vf vf_load_u8(const uint8_t *p) { /* 16 uint8 widened to fp32 (exact) */
    vf x;
    EACH(i) {
        vu8 q;
        memcpy(&q, p + VW * i, sizeof q);
        x.p[i] = __builtin_convertvector(q, vn);
    }
    return x;
}
#endif
RS_INLINE vni widen_u16(const uint16_t *p) { /* VW uint16 zero-extended */
#if defined(__AVX2__)
    return (vni)_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
#else
    int32_t lanes[VW];
    for (int i = 0; i < VW; ++i) lanes[i] = p[i];
    vni x;
    memcpy(&x, lanes, sizeof x);
    return x;
#endif
}
RS_INLINE vf vf_load_f16(const uint16_t *p) { /* 16 fp16 widened to fp32 (exact) */
    vf x;
#if defined(__F16C__) && VW == 8
    EACH(i) x.p[i] = (vn)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + VW * i)));
#else
    EACH(i) { /* without branches */
        const vni h = widen_u16(p + VW * i), e = h & 0x7c00, m = h & 0x3ff, sign = (h & 0x8000) << 16;
        const vni sub = (vni)(__builtin_convertvector(m, vn) * 0x1p-24f); /* exponent 0: m * 2^-24 (exact) */
        const vni normal = ((h & 0x7fff) << 13) + (112 << 23), special = 0x7f800000 | (m << 13); /* inf, NaN */
        const vni is_special = e == 0x7c00, is_normal = (e != 0) & ~is_special;
        x.p[i] = (vn)(sign | (is_special & special) | (is_normal & normal) | (~(is_special | is_normal) & sub));
    }
#endif
    return x;
}
RS_INLINE void vf_dup_pairs(vf v, vf *lo, vf *hi) { /* lo = v0, v0, v1, v1, .., v7, v7; hi the same of v8..v15 */
#if defined(__AVX2__)
    const __m256i first = _mm256_set_epi32(3, 3, 2, 2, 1, 1, 0, 0), second = _mm256_set_epi32(7, 7, 6, 6, 5, 5, 4, 4);
    lo->p[0] = (vn)_mm256_permutevar8x32_ps((__m256)v.p[0], first);
    lo->p[1] = (vn)_mm256_permutevar8x32_ps((__m256)v.p[0], second);
    hi->p[0] = (vn)_mm256_permutevar8x32_ps((__m256)v.p[1], first);
    hi->p[1] = (vn)_mm256_permutevar8x32_ps((__m256)v.p[1], second);
#else
    float in[16], out[32];
    vf_storeu(in, v);
    for (int c = 0; c < 16; ++c) out[2 * c] = out[2 * c + 1] = in[c];
    *lo = vf_loadu(out), *hi = vf_loadu(out + 16);
#endif
}
typedef double vnd __attribute__((vector_size(4 * VW)));
RS_INLINE vf vf_set1_pair(const float *p) { /* p[0], p[1], p[0], p[1], ... */
    double d;
    memcpy(&d, p, sizeof d);
    vf x;
    EACH(i) x.p[i] = (vn)(d - (vnd){0});
    return x;
}
RS_INLINE vm vf_ge(vf a, vf b) { vm m; EACH(i) m.p[i] = a.p[i] >= b.p[i]; return m; }
RS_INLINE vm vf_eq(vf a, vf b) { vm m; EACH(i) m.p[i] = a.p[i] == b.p[i]; return m; }
RS_INLINE vm vf_ne(vf a, vf b) { return vm_or(vf_gt(a, b), vf_gt(b, a)); } /* false where NaN */
RS_INLINE vm vf_isnan(vf a) { vm m; EACH(i) m.p[i] = a.p[i] != a.p[i]; return m; }
RS_INLINE vm vm_none(void) { return vi_set1(0); }
RS_INLINE int vm_first_set(vm m) {
    for (int i = 0; i < 16; ++i)
        if (m.p[i / VW][i % VW]) return i;
    return 16;
}
RS_INLINE int vm_any(vm m) {
    vni any = m.p[0];
    EACH(i) any |= m.p[i];
    for (int i = 0; i < VW; ++i)
        if (any[i]) return 1;
    return 0;
}

RS_INLINE vf exp2_poly(vf f);
RS_INLINE vf exp2_ps(vf t) { /* as the AVX-512 one; round and scale by hand */
    const vm normal = vf_ge(t, vf_set1(-126.0f));
    t = vf_max(t, vf_set1(-126.0f));
    /* Round to nearest by the 1.5 * 2^23 trick: t lies in [-126, 2^22) here. */
    const vf n = vf_sub(vf_add(t, vf_set1(12582912.0f)), vf_set1(12582912.0f));
    vf two_n; /* 2^n from its exponent bits (n >= -126; the kernels' t are <= 0) */
    EACH(i) two_n.p[i] = (vn)((__builtin_convertvector(n.p[i], vni) + 127) << 23);
    return vf_maskz(normal, vf_mul(exp2_poly(vf_sub(t, n)), two_n));
}
#endif

RS_INLINE float bf16_to_f32(uint16_t h) { /* one bf16 widened (vf_load_bf16's scalar twin) */
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* 16 elements of a row of fp32 or bf16 (a constant after inlining) from element c on, as fp32. */
RS_INLINE vf row_load(const void *row, int64_t c, const int bf16) {
    return bf16 ? vf_load_bf16((const uint16_t *)row + c) : vf_loadu((const float *)row + c);
}

/* Element i of an fp32 or bf16 array as fp32. */
RS_INLINE float elt(const void *base, int64_t i, const int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

/* The address of element i of an fp32 or bf16 array. */
RS_INLINE const void *at_elt(const void *base, int64_t i, const int bf16) {
    return (const char *)base + i * (bf16 ? 2 : 4);
}

/* 2^f for f in [-0.5, 0.5]: degree 5, fitted for the least maximum relative error with 2^0 = 1 exact;
 * 1.9e-7 evaluated in fp32 (the rounding of the evaluation dominates). */
RS_INLINE vf exp2_poly(vf f) {
    vf p = vf_set1(1.3264705194160342e-3f);
    p = vf_fmadd(p, f, vf_set1(9.67149157077074e-3f));
    p = vf_fmadd(p, f, vf_set1(5.550733581185341e-2f));
    p = vf_fmadd(p, f, vf_set1(2.4022242426872253e-1f));
    p = vf_fmadd(p, f, vf_set1(6.931470036506653e-1f));
    return vf_fmadd(p, f, vf_set1(1.0f));
}
