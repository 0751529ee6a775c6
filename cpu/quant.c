/*
 * quant.c -- the fast (SIMD) quant kernels of cpu/quant.h. The scalar
 * references, the weight quantizers and the activation-row layout live in
 * quant-ref.c.
 *
 * Paths, chosen at compile time (the build uses -march=native):
 *   AVX-512 VBMI + VNNI  vec_dot of Q4_0, Q4_1, Q8_0 in groups of 16 blocks:
 *                        the group's weight bytes come in as 64-byte chunks,
 *                        vpermi2b picks the quants and the f16 scales out of
 *                        them, and the activation side is read from the
 *                        row's repacked copy (quant.h), which already has
 *                        the quants in the matching order, the f16 scales as
 *                        f32 and the zero-point corrections as int32.
 *   AVX-512 (F/BW/VL)    F32/F16/BF16 dots, activation quantization, f16 rows.
 *   AVX2 + FMA + F16C    everything else (per-block kernels on llama.cpp's
 *                        layouts; VNNI dpbusd where the build has it), and
 *                        the above when AVX-512 is not there.
 *   none                 the references.
 *
 * Dequantization rounds every product before adding (tkv_vnofuse), so it is
 * bit-identical to the reference. vec_dot only reorders float sums.
 */
#include "quant.h"

#include <math.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TKV_Q_AVX2 1
#endif
#if defined(TKV_Q_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__)
#define TKV_Q_AVX512 1
#endif
#if defined(TKV_Q_AVX512) && defined(__AVX512VBMI__) && defined(__AVX512VNNI__)
#define TKV_Q_VBMI 1
#endif

#if defined(TKV_Q_AVX2)

/* Compiler barrier: the product stays a separate rounding (no FMA). */
#define tkv_vnofuse(v) __asm__("" : "+v"(v))

static inline float h2f(uint16_t h) { return _cvtsh_ss(h); }

/* acc + sum of 4 adjacent u8*s8 products per int32 lane. Without VNNI the
 * maddubs route saturates at int16: callers keep |u| <= 128, |s| <= 127. */
static inline __m256i dpbusd256(__m256i acc, __m256i u, __m256i s)
{
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

/* acc + sum of 2 adjacent s16*s16 products per int32 lane. */
static inline __m256i dpwssd256(__m256i acc, __m256i a, __m256i b)
{
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, a, b);
#elif defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

static inline float hsum256(__m256 v)
{
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

static inline int32_t hsum256_epi32(__m256i v)
{
    __m128i r = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    r = _mm_add_epi32(r, _mm_unpackhi_epi64(r, r));
    r = _mm_add_epi32(r, _mm_shuffle_epi32(r, 1));
    return _mm_cvtsi128_si32(r);
}

/* 16 bytes of nibbles -> 32 bytes: low nibbles then high nibbles. */
static inline __m256i nibbles32(const uint8_t *qs)
{
    const __m128i q = _mm_loadu_si128((const __m128i *)qs);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(0x0F));
}

/* 8 bytes -> 8 floats (signed or unsigned). */
static inline __m256 i8x8_ps(const void *p)
{
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline __m256 u8x8_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }

/* ---- dequantization (AVX2) ------------------------------------------------ */

static void dequant_q4_0(const tkv_block_q4_0 *x, float *y, int64_t nb)
{
    const __m128i m4 = _mm_set1_epi8(0x0F), e8 = _mm_set1_epi8(8);
    for (int64_t i = 0; i < nb; i++, y += 32) {
        const __m256 d = _mm256_set1_ps(h2f(x[i].d));
        const __m128i q = _mm_loadu_si128((const __m128i *)x[i].qs);
        const __m128i lo = _mm_sub_epi8(_mm_and_si128(q, m4), e8);
        const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), m4), e8);
        _mm256_storeu_ps(y + 0, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), d));
        _mm256_storeu_ps(y + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), d));
        _mm256_storeu_ps(y + 16, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), d));
        _mm256_storeu_ps(y + 24, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), d));
    }
}

static inline void store_axpb(float *y, __m256 q, __m256 d, __m256 m)
{
    __m256 p = _mm256_mul_ps(q, d);
    tkv_vnofuse(p);
    _mm256_storeu_ps(y, _mm256_add_ps(p, m));
}

static void dequant_q4_1(const tkv_block_q4_1 *x, float *y, int64_t nb)
{
    const __m128i m4 = _mm_set1_epi8(0x0F);
    for (int64_t i = 0; i < nb; i++, y += 32) {
        const __m256 d = _mm256_set1_ps(h2f(x[i].d)), m = _mm256_set1_ps(h2f(x[i].m));
        const __m128i q = _mm_loadu_si128((const __m128i *)x[i].qs);
        const __m128i lo = _mm_and_si128(q, m4), hi = _mm_and_si128(_mm_srli_epi16(q, 4), m4);
        store_axpb(y + 0, u8x8_ps(lo), d, m);
        store_axpb(y + 8, u8x8_ps(_mm_srli_si128(lo, 8)), d, m);
        store_axpb(y + 16, u8x8_ps(hi), d, m);
        store_axpb(y + 24, u8x8_ps(_mm_srli_si128(hi, 8)), d, m);
    }
}

static void dequant_q8_0(const tkv_block_q8_0 *x, float *y, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++, y += 32) {
        const __m256 d = _mm256_set1_ps(h2f(x[i].d));
        for (int j = 0; j < 32; j += 8)
            _mm256_storeu_ps(y + j, _mm256_mul_ps(i8x8_ps(x[i].qs + j), d));
    }
}

/* Scale and min of sub-blocks j (< 8) of a Q4_K block, as in the spec. */
static inline void q4k_sm(const uint8_t *s, int j, int *sc, int *m)
{
    if (j < 4) {
        *sc = s[j] & 63;
        *m  = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *m  = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

static void dequant_q4_K(const tkv_block_q4_K *x, float *y, int64_t nb)
{
    const __m128i m4 = _mm_set1_epi8(0x0F);
    for (int64_t i = 0; i < nb; i++) {
        const float d = h2f(x[i].d), dmin = h2f(x[i].dmin);
        for (int c = 0; c < 4; c++, y += 64) {
            int sc, m;
            q4k_sm(x[i].scales, 2 * c, &sc, &m);
            const __m256 d1 = _mm256_set1_ps(d * (float)sc), m1 = _mm256_set1_ps(-(dmin * (float)m));
            q4k_sm(x[i].scales, 2 * c + 1, &sc, &m);
            const __m256 d2 = _mm256_set1_ps(d * (float)sc), m2 = _mm256_set1_ps(-(dmin * (float)m));
            for (int h = 0; h < 2; h++) {
                const __m128i q = _mm_loadu_si128((const __m128i *)(x[i].qs + 32 * c + 16 * h));
                const __m128i lo = _mm_and_si128(q, m4), hi = _mm_and_si128(_mm_srli_epi16(q, 4), m4);
                /* x - m == x + (-m) exactly */
                store_axpb(y + 16 * h + 0, u8x8_ps(lo), d1, m1);
                store_axpb(y + 16 * h + 8, u8x8_ps(_mm_srli_si128(lo, 8)), d1, m1);
                store_axpb(y + 32 + 16 * h + 0, u8x8_ps(hi), d2, m2);
                store_axpb(y + 32 + 16 * h + 8, u8x8_ps(_mm_srli_si128(hi, 8)), d2, m2);
            }
        }
    }
}

static void dequant_q6_K(const tkv_block_q6_K *x, float *y, int64_t nb)
{
    const __m128i m4 = _mm_set1_epi8(0x0F), m3 = _mm_set1_epi8(3), e32 = _mm_set1_epi8(32);
    for (int64_t i = 0; i < nb; i++) {
        const float d = h2f(x[i].d);
        const uint8_t *ql = x[i].ql, *qh = x[i].qh;
        const int8_t *sc = x[i].scales;
        for (int h = 0; h < 2; h++, ql += 64, qh += 32, sc += 8, y += 128) {
            for (int is = 0; is < 2; is++) { /* l = 16*is .. 16*is+15 */
                const __m128i a = _mm_loadu_si128((const __m128i *)(ql + 16 * is));
                const __m128i b = _mm_loadu_si128((const __m128i *)(ql + 32 + 16 * is));
                const __m128i hb = _mm_loadu_si128((const __m128i *)(qh + 16 * is));
                __m128i q[4];
                q[0] = _mm_or_si128(_mm_and_si128(a, m4), _mm_slli_epi16(_mm_and_si128(hb, m3), 4));
                q[1] = _mm_or_si128(_mm_and_si128(b, m4), _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(hb, 2), m3), 4));
                q[2] = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(a, 4), m4),
                                    _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(hb, 4), m3), 4));
                q[3] = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(b, 4), m4),
                                    _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(hb, 6), m3), 4));
                for (int k = 0; k < 4; k++) {
                    const __m128i s = _mm_sub_epi8(q[k], e32);
                    const __m256 sd = _mm256_set1_ps(d * (float)sc[is + 2 * k]);
                    float *o = y + 32 * k + 16 * is;
                    _mm256_storeu_ps(o, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s)), sd));
                    _mm256_storeu_ps(o + 8, _mm256_mul_ps(
                        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(s, 8))), sd));
                }
            }
        }
    }
}

static void bf16_to_fp32_row(const uint16_t *x, float *y, int64_t n)
{
    int64_t i = 0;
#if defined(TKV_Q_AVX512)
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i, _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x + i))), 16)));
#endif
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(x + i))), 16)));
    for (; i < n; i++)
        y[i] = tkv_bf16_to_fp32(x[i]);
}

#endif /* TKV_Q_AVX2 */

void tkv_dequant_row(uint32_t type, const void *src, float *dst, int64_t n)
{
#if defined(TKV_Q_AVX2)
    if (n <= 0)
        return;
    int64_t done = n;
    switch (type) {
    case TKV_TYPE_F32:  memcpy(dst, src, (size_t)n * sizeof *dst); return;
    case TKV_TYPE_F16:  tkv_fp16_to_fp32_row(src, dst, n); return;
    case TKV_TYPE_BF16: bf16_to_fp32_row(src, dst, n); return;
    case TKV_TYPE_Q4_0: done = n / 32 * 32;   dequant_q4_0(src, dst, n / 32); break;
    case TKV_TYPE_Q4_1: done = n / 32 * 32;   dequant_q4_1(src, dst, n / 32); break;
    case TKV_TYPE_Q8_0: done = n / 32 * 32;   dequant_q8_0(src, dst, n / 32); break;
    case TKV_TYPE_Q4_K: done = n / 256 * 256; dequant_q4_K(src, dst, n / 256); break;
    case TKV_TYPE_Q6_K: done = n / 256 * 256; dequant_q6_K(src, dst, n / 256); break;
    default:            done = 0; break;
    }
    if (done < n)
        memset(dst + done, 0, (size_t)(n - done) * sizeof *dst);
#else
    tkv_dequant_row_ref(type, src, dst, n);
#endif
}

/* ---- f16 rows -------------------------------------------------------------- */

void tkv_fp16_to_fp32_row(const uint16_t *src, float *dst, int64_t n)
{
    int64_t i = 0;
#if defined(TKV_Q_AVX512)
    for (; i + 32 <= n; i += 32) {
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + i))));
        _mm512_storeu_ps(dst + i + 16, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + i + 16))));
    }
    if (i < n) { /* masked: the tail goes through the same instruction */
        for (; i < n; i += 16) {
            const __mmask16 k = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
            _mm512_mask_storeu_ps(dst + i, k, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, src + i)));
        }
    }
#elif defined(TKV_Q_AVX2)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    if (i < n) {
        uint16_t t[8] = {0};
        float f[8];
        memcpy(t, src + i, (size_t)(n - i) * 2);
        _mm256_storeu_ps(f, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)t)));
        memcpy(dst + i, f, (size_t)(n - i) * 4);
    }
#else
    for (; i < n; i++)
        dst[i] = tkv_fp16_to_fp32(src[i]);
#endif
}

void tkv_fp32_to_fp16_row(const float *src, uint16_t *dst, int64_t n)
{
    int64_t i = 0;
#if defined(TKV_Q_AVX512)
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i), _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    if (i < n) {
        const __mmask16 k = (__mmask16)((1u << (n - i)) - 1);
        _mm256_mask_storeu_epi16(dst + i, k, _mm512_cvtps_ph(_mm512_maskz_loadu_ps(k, src + i), _MM_FROUND_TO_NEAREST_INT));
    }
#elif defined(TKV_Q_AVX2)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    if (i < n) {
        float f[8] = {0};
        uint16_t t[8];
        memcpy(f, src + i, (size_t)(n - i) * 4);
        _mm_storeu_si128((__m128i *)t, _mm256_cvtps_ph(_mm256_loadu_ps(f), _MM_FROUND_TO_NEAREST_INT));
        memcpy(dst + i, t, (size_t)(n - i) * 2);
    }
#else
    for (; i < n; i++)
        dst[i] = tkv_fp32_to_fp16(src[i]);
#endif
}

/* ---- activation quantization ----------------------------------------------- */

#if defined(TKV_Q_AVX512)
/* roundf(): half away from zero, exact (trunc, then step by the sign). */
static inline __m512 round_away(__m512 v)
{
    const __m512 t = _mm512_roundscale_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(v, t); /* exact */
    const __mmask16 up = _mm512_cmp_ps_mask(_mm512_abs_ps(f), _mm512_set1_ps(0.5f), _CMP_GE_OQ);
    const __m512 one = _mm512_or_ps(_mm512_set1_ps(1.0f), _mm512_and_ps(v, _mm512_set1_ps(-0.0f)));
    return _mm512_mask_add_ps(t, up, t, one);
}

/* One llama.cpp Q8_0/Q8_1 block: d (f32, before rounding to f16) in *d_f;
 * returns sum(qs). */
static inline int32_t q8_block(const float *x, uint16_t *d_out, float *d_f, int8_t *qs)
{
    const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    const __m512 vid = _mm512_set1_ps(id);
    const __m512i q0 = _mm512_cvttps_epi32(round_away(_mm512_mul_ps(x0, vid)));
    const __m512i q1 = _mm512_cvttps_epi32(round_away(_mm512_mul_ps(x1, vid)));
    _mm_storeu_si128((__m128i *)qs, _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128((__m128i *)(qs + 16), _mm512_cvtepi32_epi8(q1));
    *d_out = _cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT);
    *d_f = d;
    return _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
}

static void q8k_block(const float *x, tkv_block_q8_K *y)
{
    __m512 am = _mm512_setzero_ps();
    for (int j = 0; j < 256; j += 16)
        am = _mm512_max_ps(am, _mm512_abs_ps(_mm512_loadu_ps(x + j)));
    const float amax = _mm512_reduce_max_ps(am);
    if (!(amax > 0.0f)) {
        memset(y, 0, sizeof *y);
        return;
    }
    float max = 0.0f; /* the first element of largest magnitude, as the reference scans */
    for (int j = 0; j < 256; j += 16) {
        const __mmask16 k = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_loadu_ps(x + j)), _mm512_set1_ps(amax), _CMP_EQ_OQ);
        if (k) {
            max = x[j + __builtin_ctz(k)];
            break;
        }
    }
    const float iscale = -127.0f / max;
    const __m512 vs = _mm512_set1_ps(iscale);
    const __m512i lim = _mm512_set1_epi32(127);
    for (int j = 0; j < 256; j += 16) {
        __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + j), vs)); /* nearest even */
        q = _mm512_min_epi32(q, lim);
        _mm_storeu_si128((__m128i *)(y->qs + j), _mm512_cvtepi32_epi8(q));
        y->bsums[j / 16] = (int16_t)_mm512_reduce_add_epi32(q);
    }
    y->d = 1.0f / iscale;
}
#endif

void tkv_quantize_act(uint32_t weight_type, const float *x, void *dst, int64_t n)
{
#if defined(TKV_Q_AVX512)
    if (n <= 0)
        return;
    switch (tkv_act_type(weight_type)) {
    case TKV_TYPE_F32:
        memcpy(dst, x, (size_t)n * sizeof *x);
        return;
    case TKV_TYPE_Q8_0: {
        tkv_block_q8_0 *y = dst;
        float d;
        for (int64_t i = 0; i < n / 32; i++)
            q8_block(x + 32 * i, &y[i].d, &d, y[i].qs);
        break;
    }
    case TKV_TYPE_Q8_1: {
        tkv_block_q8_1 *y = dst;
        for (int64_t i = 0; i < n / 32; i++) {
            float d;
            const int32_t sum = q8_block(x + 32 * i, &y[i].d, &d, y[i].qs);
            y[i].s = _cvtss_sh((float)sum * d, _MM_FROUND_TO_NEAREST_INT);
        }
        break;
    }
    case TKV_TYPE_Q8_K: {
        tkv_block_q8_K *y = dst;
        for (int64_t i = 0; i < n / 256; i++)
            q8k_block(x + 256 * i, &y[i]);
        return;
    }
    default:
        return;
    }
    tkv_act_pack_(weight_type, dst, n);
#else
    tkv_quantize_act_ref(weight_type, x, dst, n);
#endif
}

/* ---- dot products: AVX-512 VBMI group kernels --------------------------------- */

#if defined(TKV_Q_VBMI)

/* Index tables, generated by macros: X64(F, j) lists F(j, 0) .. F(j, 63). */
#define X4(F, j, p)  F(j, p), F(j, (p) + 1), F(j, (p) + 2), F(j, (p) + 3)
#define X16(F, j, p) X4(F, j, p), X4(F, j, (p) + 4), X4(F, j, (p) + 8), X4(F, j, (p) + 12)
#define X64(F, j)    {X16(F, j, 0), X16(F, j, 16), X16(F, j, 32), X16(F, j, 48)}
#define X16S(F, j)   {X4(F, j, 0), X4(F, j, 4), X4(F, j, 8), X4(F, j, 12)}

/* The 4-bit kernels sum each block's lanes with a 4x4 transpose (see
 * sum4x4), which leaves block k in slot 4*(k%4) + k/4; the scales are
 * gathered into the same slot order (and the repacked activation stores its
 * d and s in it too). The map is its own inverse: */
#define KOF(e) (4 * ((e) % 4) + (e) / 4)
#define X4O(F, j, p)  (F(j, p) | F(j, (p) + 1) | F(j, (p) + 2) | F(j, (p) + 3))
#define X16O(F, j, p) (X4O(F, j, p) | X4O(F, j, (p) + 4) | X4O(F, j, (p) + 8) | X4O(F, j, (p) + 12))
#define X64O(F, j)    (X16O(F, j, 0) | X16O(F, j, 16) | X16O(F, j, 32) | X16O(F, j, 48))

/* Q4_1 (20-byte blocks, 320 bytes = 5 chunks per group).
 * Quants of blocks 4j..4j+3, relative to chunk j: */
#define Q41_Q(j, p)   (16 * (j) + 20 * ((p) / 16) + 4 + (p) % 16)
/* f16 d of the 16 slots in bytes 0..31, m in 32..63: block and its byte */
#define Q41_K(p)      KOF((p) < 32 ? (p) / 2 : ((p) - 32) / 2)
#define Q41_DMB(p)    (20 * Q41_K(p) + ((p) < 32 ? 0 : 2) + (p) % 2)
#define Q41_DM(t, p)  ((Q41_DMB(p) - 128 * (t)) & 127)
/* blocks 0..6 come from chunks 0-1, 7..12 from chunks 2-3, 13..15 from 4 */
#define Q41_T(p)      (Q41_K(p) <= 6 ? 0 : Q41_K(p) <= 12 ? 1 : 2)
#define Q41_MB(t, p)  ((uint64_t)(Q41_T(p) == (t)) << (p))
static const uint8_t q41_qidx[4][64] = {X64(Q41_Q, 0), X64(Q41_Q, 1), X64(Q41_Q, 2), X64(Q41_Q, 3)};
static const uint8_t q41_dmidx[3][64] = {X64(Q41_DM, 0), X64(Q41_DM, 1), X64(Q41_DM, 2)};
#define Q41_DM_M0 X64O(Q41_MB, 0)
#define Q41_DM_M1 X64O(Q41_MB, 1)
#define Q41_DM_M2 X64O(Q41_MB, 2)

/* Q4_0 (18-byte blocks, 288 bytes = 4.5 chunks per group). */
#define Q40_Q(j, p)   (8 * (j) + 18 * ((p) / 16) + 2 + (p) % 16)
#define Q40_K(p)      KOF(((p) % 32) / 2)
#define Q40_D(t, p)   ((18 * Q40_K(p) + (p) % 2 - 128 * (t)) & 127)
/* d of blocks 0..7 from chunks 0-1, 8..14 from chunks 2-3, 15 from 4 */
#define Q40_T(p)      (Q40_K(p) <= 7 ? 0 : Q40_K(p) <= 14 ? 1 : 2)
#define Q40_MB(t, p)  ((uint64_t)((p) < 32 && Q40_T(p) == (t)) << (p))
static const uint8_t q40_qidx[4][64] = {X64(Q40_Q, 0), X64(Q40_Q, 1), X64(Q40_Q, 2), X64(Q40_Q, 3)};
static const uint8_t q40_didx[3][64] = {X64(Q40_D, 0), X64(Q40_D, 1), X64(Q40_D, 2)};
#define Q40_D_M0 X64O(Q40_MB, 0)
#define Q40_D_M1 X64O(Q40_MB, 1)
#define Q40_D_M2 X64O(Q40_MB, 2)

/* Q8_0 (34-byte blocks, 544 bytes = 8.5 chunks per group). Quants of blocks
 * 2p, 2p+1, relative to chunk p: */
#define Q80_W(j, p)  (4 * (j) + 2 + (p) + ((p) >= 32 ? 2 : 0))
#define Q80_D(t, p)  ((34 * (((p) % 32) / 2) + (p) % 2 - 128 * (t)) & 127)
static const uint8_t q80_widx[8][64] = {X64(Q80_W, 0), X64(Q80_W, 1), X64(Q80_W, 2), X64(Q80_W, 3),
                                        X64(Q80_W, 4), X64(Q80_W, 5), X64(Q80_W, 6), X64(Q80_W, 7)};
static const uint8_t q80_didx[4][64] = {X64(Q80_D, 0), X64(Q80_D, 1), X64(Q80_D, 2), X64(Q80_D, 3)};

/* Lane l of the scale vector for blocks 2j, 2j+1 (8 lanes each). */
#define S2(j, l) (2 * (j) + (l) / 8)
static const int32_t sidx2[8][16] = {X16S(S2, 0), X16S(S2, 1), X16S(S2, 2), X16S(S2, 3),
                                     X16S(S2, 4), X16S(S2, 5), X16S(S2, 6), X16S(S2, 7)};

#define LD(p) _mm512_loadu_si512((const void *)(p))

/* Bytes [64c, 64c+64) of a group of `bytes` bytes (masked past the end). */
static inline __attribute__((always_inline)) __m512i chunk(const uint8_t *w, int c, int64_t bytes)
{
    const int64_t r = bytes - 64 * c;
    if (r >= 64)
        return LD(w + 64 * c);
    if (r <= 0)
        return _mm512_setzero_si512();
    return _mm512_maskz_loadu_epi8((__mmask64)((1ull << r) - 1), w + 64 * c);
}

/* s[j] holds 4 int32 lanes per block 4j+i (i = 128-bit lane): returns the
 * block sums, block 4j+i in slot 4i+j. */
static inline __attribute__((always_inline)) __m512i sum4x4(const __m512i s[4])
{
    const __m512i x = _mm512_add_epi32(_mm512_unpacklo_epi32(s[0], s[1]), _mm512_unpackhi_epi32(s[0], s[1]));
    const __m512i y = _mm512_add_epi32(_mm512_unpacklo_epi32(s[2], s[3]), _mm512_unpackhi_epi32(s[2], s[3]));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(x, y), _mm512_unpackhi_epi64(x, y));
}

/* Integer dot products of the 4-bit quants of one group with the repacked
 * activation a (s[j] starts from init[j], or 0). */
static inline __attribute__((always_inline)) void dot4_group(const __m512i z[5], const uint8_t qidx[4][64], const uint8_t *a, const uint8_t *init,
                              int nj, __m512i s[4])
{
    const __m512i m4 = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        s[j] = init ? LD(init + 64 * j) : _mm512_setzero_si512();
        if (j >= nj) /* the last group may be short */
            continue;
        const __m512i q = _mm512_permutex2var_epi8(z[j], LD(qidx[j]), z[j + 1]);
        const __m512i lo = _mm512_and_si512(q, m4), hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
        s[j] = _mm512_dpbusd_epi32(s[j], lo, LD(a + 128 * j));
        s[j] = _mm512_dpbusd_epi32(s[j], hi, LD(a + 128 * j + 64));
    }
}

static float dot_q4_1_vbmi(const uint8_t *w, const uint8_t *act, int64_t nb)
{
    __m512 acc = _mm512_setzero_ps(), macc = _mm512_setzero_ps();
    for (int64_t g = 0; g < nb; g += 16, w += 320, act += TKV_ACT_GROUP_Q4_1) {
        __m512i z[5], s[4];
        if (nb - g >= 16) {
#pragma GCC unroll 16
            for (int c = 0; c < 5; c++)
                z[c] = LD(w + 64 * c);
        } else {
#pragma GCC unroll 16
            for (int c = 0; c < 5; c++)
                z[c] = chunk(w, c, (nb - g) * 20);
        }
        dot4_group(z, q41_qidx, act + 128, NULL, nb - g >= 16 ? 4 : (int)(nb - g + 3) / 4, s);
        const __m512i dm = _mm512_ternarylogic_epi64(
            _mm512_maskz_permutex2var_epi8(Q41_DM_M0, z[0], LD(q41_dmidx[0]), z[1]),
            _mm512_maskz_permutex2var_epi8(Q41_DM_M1, z[2], LD(q41_dmidx[1]), z[3]),
            _mm512_maskz_permutexvar_epi8(Q41_DM_M2, LD(q41_dmidx[2]), z[4]), 0xFE);
        const __m512 wd = _mm512_cvtph_ps(_mm512_castsi512_si256(dm));
        const __m512 wm = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(dm, 1));
        const __m512 dd = _mm512_mul_ps(wd, _mm512_loadu_ps((const float *)act));
        macc = _mm512_fmadd_ps(wm, _mm512_loadu_ps((const float *)(act + 64)), macc);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum4x4(s)), dd, acc);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc, macc));
}

static float dot_q4_0_vbmi(const uint8_t *w, const uint8_t *act, int64_t nb)
{
    __m512 acc = _mm512_setzero_ps();
    for (int64_t g = 0; g < nb; g += 16, w += 288, act += TKV_ACT_GROUP_Q4_0) {
        __m512i z[5], s[4];
        if (nb - g >= 16) {
#pragma GCC unroll 16
            for (int c = 0; c < 4; c++)
                z[c] = LD(w + 64 * c);
            z[4] = _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)(w + 256)));
        } else {
#pragma GCC unroll 16
            for (int c = 0; c < 5; c++)
                z[c] = chunk(w, c, (nb - g) * 18);
        }
        /* init: -8*sum(a) per block (the quants are stored +8) */
        dot4_group(z, q40_qidx, act + 320, act + 64, nb - g >= 16 ? 4 : (int)(nb - g + 3) / 4, s);
        const __m512i dv = _mm512_ternarylogic_epi64(
            _mm512_maskz_permutex2var_epi8(Q40_D_M0, z[0], LD(q40_didx[0]), z[1]),
            _mm512_maskz_permutex2var_epi8(Q40_D_M1, z[2], LD(q40_didx[1]), z[3]),
            _mm512_maskz_permutexvar_epi8(Q40_D_M2, LD(q40_didx[2]), z[4]), 0xFE);
        const __m512 dd = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(dv)), _mm512_loadu_ps((const float *)act));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum4x4(s)), dd, acc);
    }
    return _mm512_reduce_add_ps(acc);
}

static float dot_q8_0_vbmi(const uint8_t *w, const uint8_t *act, int64_t nb)
{
    const __m512i x80 = _mm512_set1_epi8((char)0x80);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    for (int64_t g = 0; g < nb; g += 16, w += 544, act += TKV_ACT_GROUP_Q8_0) {
        __m512i z[9];
        if (nb - g >= 16) {
#pragma GCC unroll 16
            for (int c = 0; c < 8; c++)
                z[c] = LD(w + 64 * c);
            z[8] = _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)(w + 512)));
        } else {
#pragma GCC unroll 16
            for (int c = 0; c < 9; c++)
                z[c] = chunk(w, c, (nb - g) * 34);
        }
        const __m512i dv = _mm512_or_si512(
            _mm512_ternarylogic_epi64(_mm512_maskz_permutex2var_epi8(0xFFull, z[0], LD(q80_didx[0]), z[1]),
                                      _mm512_maskz_permutex2var_epi8(0xFF00ull, z[2], LD(q80_didx[1]), z[3]),
                                      _mm512_maskz_permutex2var_epi8(0xFF0000ull, z[4], LD(q80_didx[2]), z[5]), 0xFE),
            _mm512_maskz_permutex2var_epi8(0xFF000000ull, z[6], LD(q80_didx[3]), z[7]));
        const __m512 dd = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(dv)), _mm512_loadu_ps((const float *)act));
        const uint8_t *init = act + 64, *a = act + 576;
        const int np = nb - g >= 16 ? 8 : (int)(nb - g + 1) / 2;
#pragma GCC unroll 8
        for (int p = 0; p < 8; p++, a += 64, init += 64) {
            if (p >= np)
                break;
            /* (w ^ 0x80) = w + 128 as u8; init holds -128*sum(a) */
            const __m512i q = _mm512_xor_si512(_mm512_permutex2var_epi8(z[p], LD(q80_widx[p]), z[p + 1]), x80);
            const __m512i s = _mm512_dpbusd_epi32(LD(init), q, LD(a));
            const __m512 sc = _mm512_permutexvar_ps(LD(sidx2[p]), dd);
            if (p & 1)
                acc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), sc, acc1);
            else
                acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), sc, acc0);
        }
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

#endif /* TKV_Q_VBMI */

/* ---- dot products: AVX2 per-block kernels ------------------------------------- */

#if defined(TKV_Q_AVX2)

TKV_UNUSED static float dot_q4_0_avx2(const tkv_block_q4_0 *x, const tkv_block_q8_0 *y, int64_t nb)
{
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const __m256i q = _mm256_sub_epi8(nibbles32(x[i].qs), _mm256_set1_epi8(8));
        const __m256i a = _mm256_loadu_si256((const __m256i *)y[i].qs);
        const __m256i s = dpbusd256(_mm256_setzero_si256(), _mm256_sign_epi8(q, q), _mm256_sign_epi8(a, q));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(h2f(x[i].d) * h2f(y[i].d)), acc);
    }
    return hsum256(acc);
}

TKV_UNUSED static float dot_q4_1_avx2(const tkv_block_q4_1 *x, const tkv_block_q8_1 *y, int64_t nb)
{
    __m256 acc = _mm256_setzero_ps();
    float ms = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        const __m256i s = dpbusd256(_mm256_setzero_si256(), nibbles32(x[i].qs),
                                    _mm256_loadu_si256((const __m256i *)y[i].qs));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(h2f(x[i].d) * h2f(y[i].d)), acc);
        ms += h2f(x[i].m) * h2f(y[i].s);
    }
    return hsum256(acc) + ms;
}

TKV_UNUSED static float dot_q8_0_avx2(const tkv_block_q8_0 *x, const tkv_block_q8_0 *y, int64_t nb)
{
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)x[i].qs);
        const __m256i a = _mm256_loadu_si256((const __m256i *)y[i].qs);
        const __m256i s = dpbusd256(_mm256_setzero_si256(), _mm256_sign_epi8(q, q), _mm256_sign_epi8(a, q));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(h2f(x[i].d) * h2f(y[i].d)), acc);
    }
    return hsum256(acc);
}

static float dot_q4_K_avx2(const tkv_block_q4_K *x, const tkv_block_q8_K *y, int64_t nb)
{
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256 acc = _mm256_setzero_ps();
    float macc = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        int sc[8], mn[8];
        for (int j = 0; j < 8; j++)
            q4k_sm(x[i].scales, j, &sc[j], &mn[j]);
        /* mins: sum_j m[j/2] * bsums[j] */
        const __m256i mins16 = _mm256_setr_epi16((short)mn[0], (short)mn[0], (short)mn[1], (short)mn[1],
                                                 (short)mn[2], (short)mn[2], (short)mn[3], (short)mn[3],
                                                 (short)mn[4], (short)mn[4], (short)mn[5], (short)mn[5],
                                                 (short)mn[6], (short)mn[6], (short)mn[7], (short)mn[7]);
        const int32_t summ = hsum256_epi32(_mm256_madd_epi16(
            _mm256_loadu_si256((const __m256i *)y[i].bsums), mins16));
        __m256i s = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(x[i].qs + 32 * c));
            const __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            const __m256i plo = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)(y[i].qs + 64 * c)));
            const __m256i phi = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(y[i].qs + 64 * c + 32)));
            s = dpwssd256(s, plo, _mm256_set1_epi16((short)sc[2 * c]));
            s = dpwssd256(s, phi, _mm256_set1_epi16((short)sc[2 * c + 1]));
        }
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(h2f(x[i].d) * y[i].d), acc);
        macc += (h2f(x[i].dmin) * y[i].d) * (float)summ;
    }
    return hsum256(acc) - macc;
}

static float dot_q6_K_avx2(const tkv_block_q6_K *x, const tkv_block_q8_K *y, int64_t nb)
{
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *ql = x[i].ql, *qh = x[i].qh;
        const int8_t *q8 = y[i].qs;
        /* the -32 offset: 32 * sum_j scales[j] * bsums[j] */
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)x[i].scales));
        __m256i s = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(
            _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)y[i].bsums), sc16), 5));
        for (int h = 0; h < 2; h++, ql += 64, qh += 32, q8 += 128) {
            const __m256i a = _mm256_loadu_si256((const __m256i *)ql);
            const __m256i b = _mm256_loadu_si256((const __m256i *)(ql + 32));
            const __m256i hb = _mm256_loadu_si256((const __m256i *)qh);
            __m256i q[4];
            q[0] = _mm256_or_si256(_mm256_and_si256(a, m4), _mm256_slli_epi16(_mm256_and_si256(hb, m3), 4));
            q[1] = _mm256_or_si256(_mm256_and_si256(b, m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), m3), 4));
            q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), m3), 4));
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 6), m3), 4));
            const int8_t *sc = x[i].scales + 8 * h;
            for (int k = 0; k < 4; k++) {
                const __m256i p = _mm256_maddubs_epi16(q[k], _mm256_loadu_si256((const __m256i *)(q8 + 32 * k)));
                const __m256i scv = _mm256_set_m128i(_mm_set1_epi16(sc[2 * k + 1]), _mm_set1_epi16(sc[2 * k]));
                s = dpwssd256(s, p, scv);
            }
        }
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(h2f(x[i].d) * y[i].d), acc);
    }
    return hsum256(acc);
}

#endif /* TKV_Q_AVX2 */

/* ---- dot products: float weights ------------------------------------------------ */

#if defined(TKV_Q_AVX512)
/* 16 weights at w[i] as f32; the masked form reads only lanes in k. */
static inline __m512 wload(uint32_t type, const void *w, int64_t i, __mmask16 k)
{
    switch (type) {
    case TKV_TYPE_F16:
        return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, (const uint16_t *)w + i));
    case TKV_TYPE_BF16:
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, (const uint16_t *)w + i)), 16));
    default:
        return _mm512_maskz_loadu_ps(k, (const float *)w + i);
    }
}

static inline float dot_float_avx512(uint32_t type, const void *w, const float *a, int64_t n)
{
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps(), s2 = _mm512_setzero_ps(), s3 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        s0 = _mm512_fmadd_ps(wload(type, w, i + 0, 0xFFFF), _mm512_loadu_ps(a + i + 0), s0);
        s1 = _mm512_fmadd_ps(wload(type, w, i + 16, 0xFFFF), _mm512_loadu_ps(a + i + 16), s1);
        s2 = _mm512_fmadd_ps(wload(type, w, i + 32, 0xFFFF), _mm512_loadu_ps(a + i + 32), s2);
        s3 = _mm512_fmadd_ps(wload(type, w, i + 48, 0xFFFF), _mm512_loadu_ps(a + i + 48), s3);
    }
    for (; i < n; i += 16) {
        const __mmask16 k = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        s0 = _mm512_fmadd_ps(wload(type, w, i, k), _mm512_maskz_loadu_ps(k, a + i), s0);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
}
#elif defined(TKV_Q_AVX2)
static inline __m256 wload8(uint32_t type, const void *w, int64_t i)
{
    switch (type) {
    case TKV_TYPE_F16:
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i)));
    case TKV_TYPE_BF16:
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i))), 16));
    default:
        return _mm256_loadu_ps((const float *)w + i);
    }
}

static inline float dot_float_avx2(uint32_t type, const void *w, const float *a, int64_t n)
{
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        s0 = _mm256_fmadd_ps(wload8(type, w, i + 0), _mm256_loadu_ps(a + i + 0), s0);
        s1 = _mm256_fmadd_ps(wload8(type, w, i + 8), _mm256_loadu_ps(a + i + 8), s1);
        s2 = _mm256_fmadd_ps(wload8(type, w, i + 16), _mm256_loadu_ps(a + i + 16), s2);
        s3 = _mm256_fmadd_ps(wload8(type, w, i + 24), _mm256_loadu_ps(a + i + 24), s3);
    }
    for (; i + 8 <= n; i += 8)
        s0 = _mm256_fmadd_ps(wload8(type, w, i), _mm256_loadu_ps(a + i), s0);
    float t = hsum256(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
    for (; i < n; i++) { /* (w need not be aligned to its element: loads by memcpy) */
        float wi;
        if (type == TKV_TYPE_F16 || type == TKV_TYPE_BF16) {
            uint16_t h;
            memcpy(&h, (const uint16_t *)w + i, 2);
            wi = type == TKV_TYPE_F16 ? _cvtsh_ss(h) : tkv_bf16_to_fp32(h);
        } else {
            memcpy(&wi, (const float *)w + i, 4);
        }
        t += wi * a[i];
    }
    return t;
}
#endif

float tkv_vec_dot(uint32_t type, const void *w, const void *act, int64_t n)
{
#if defined(TKV_Q_AVX2)
    if (n <= 0)
        return 0.0f;
    switch (type) {
    case TKV_TYPE_F32:
    case TKV_TYPE_F16:
    case TKV_TYPE_BF16:
#if defined(TKV_Q_AVX512)
        return dot_float_avx512(type, w, act, n);
#else
        return dot_float_avx2(type, w, act, n);
#endif
#if defined(TKV_Q_VBMI)
    case TKV_TYPE_Q4_0:
        return dot_q4_0_vbmi(w, (const uint8_t *)act + tkv_act_pack_offset_(type, n), n / 32);
    case TKV_TYPE_Q4_1:
        return dot_q4_1_vbmi(w, (const uint8_t *)act + tkv_act_pack_offset_(type, n), n / 32);
    case TKV_TYPE_Q8_0:
        return dot_q8_0_vbmi(w, (const uint8_t *)act + tkv_act_pack_offset_(type, n), n / 32);
#else
    case TKV_TYPE_Q4_0: return dot_q4_0_avx2(w, act, n / 32);
    case TKV_TYPE_Q4_1: return dot_q4_1_avx2(w, act, n / 32);
    case TKV_TYPE_Q8_0: return dot_q8_0_avx2(w, act, n / 32);
#endif
    case TKV_TYPE_Q4_K: return dot_q4_K_avx2(w, act, n / 256);
    case TKV_TYPE_Q6_K: return dot_q6_K_avx2(w, act, n / 256);
    default:            return 0.0f;
    }
#else
    return tkv_vec_dot_ref(type, w, act, n);
#endif
}
