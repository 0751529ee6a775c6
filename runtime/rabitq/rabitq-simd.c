/*
 * rabitq-simd.c -- AVX2 and AVX-512 kernels of the RaBitQ index, chosen at
 * run time (rabitq.c), each bit-identical to the scalar reference in
 * rabitq.c under the rules of rabitq-impl.h.
 *
 *   avx2    AVX2 + FMA + F16C: rotation 8 floats per register; codes by
 *           movemask; popcounts by the nibble table (vpshufb), the 4 planes
 *           weighted 1,2,4,8 in bytes (at most 8*15 per byte) and summed by
 *           vpsadbw; 8 keys per iteration.
 *   avx512  F/BW/VL/DQ + VPOPCNTDQ: rotation 16 floats per register; codes
 *           by compare masks; vpopcntq on the code words; 16 keys per
 *           iteration.
 * Both take head dims of 1 or 2 code words (64, 128) in vector form and
 * other widths with scalar popcounts feeding the same vector epilogue.
 * The top-p kernels (rabitq-impl.h) are the exception to bit-identity:
 * their e^x and log x are the polynomials below, within a few ulp of
 * libm's; their bins, masks and maxima are exact.
 * Functions carry target attributes, so the file builds without
 * -march=native; rabitq.c calls them only where the CPU has the features.
 */
#include "rabitq-impl.h"

#if defined(__x86_64__) && defined(__GNUC__)

#include <float.h>
#include <immintrin.h>
#include <string.h>

#define RQ_AVX2   __attribute__((target("avx2,fma,f16c,popcnt")))
#define RQ_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vpopcntdq,avx2,fma,f16c,popcnt")))

/* f16 row -> x[dim_pad] f32, zero past dim (F16C conversion is exact, as the
 * reference's). */
RQ_AVX2 static void load_row_f16(const struct tkv_rabitq *ix, const uint16_t *row, float *x)
{
    uint32_t i = 0;
    for (; i + 8 <= ix->dim; i += 8)
        _mm256_storeu_ps(x + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + i))));
    for (; i < ix->dim; i++)
        x[i] = tkv_fp16_to_fp32(row[i]);
    for (; i < ix->dim_pad; i++)
        x[i] = 0.0f;
}

// --- top-p: e^x and log x ------------------------------------------------------
/*
 * e^x for x <= 0: x = t ln2 + r, t = round(x / ln2), |r| <= ln2/2, ln2 split
 * in two (RQ_LN2_HI has 15 significant bits: t * RQ_LN2_HI is exact for
 * |t| < 2^9, and here t >= -150), e^r by its Taylor series to r^7 (the
 * first term left out, r^8/8! <= 5.2e-9, is under float's half ulp), times
 * 2^t, rounded once: into the subnormals below -87.3 as libm's, so p = 1
 * keeps the same keys (those whose e^x is not 0); 0 below -104 and for
 * -inf. log a for a in (0, 1]: a = m 2^e with m in [sqrt(1/2), sqrt 2),
 * log m = 2 atanh(t), t = (m-1)/(m+1), by its series to t^9 (|t| <= 0.172:
 * the first term left out, t^11/11 against t, is 2e-9 relative).
 */
#define RQ_LN2_HI 0x1.62e4p-1f            /* ln 2 to 15 significant bits */
#define RQ_LN2_LO 1.428606765330187e-06f  /* ln 2 - RQ_LN2_HI            */
#define RQ_LOG2E  1.44269504088896341f
#define RQ_EXP_MIN (-104.0f)  /* e^x < 2^-150 below: 0 */

// --- AVX2 ----------------------------------------------------------------------

/* in-register butterflies h = 1, 2, 4: lower lane a + b, upper lane a - b
 * (perm - x there is x[j] - x[j+h], as the reference's a - b) */
RQ_AVX2 static inline __m256 avx2_fwht8(__m256 x)
{
    __m256 p = _mm256_permute_ps(x, 0xB1);
    x = _mm256_blend_ps(_mm256_add_ps(x, p), _mm256_sub_ps(p, x), 0xAA);
    p = _mm256_permute_ps(x, 0x4E);
    x = _mm256_blend_ps(_mm256_add_ps(x, p), _mm256_sub_ps(p, x), 0xCC);
    p = _mm256_permute2f128_ps(x, x, 0x01);
    x = _mm256_blend_ps(_mm256_add_ps(x, p), _mm256_sub_ps(p, x), 0xF0);
    return x;
}

RQ_AVX2 static void avx2_rotate(const struct tkv_rabitq *ix, float *y)
{
    const uint32_t D = ix->dim_pad, nv = D / 8;
    for (int r = 0; r < 3; r++) {
        const float *s = ix->sign + (size_t)r * D;
        for (uint32_t v = 0; v < nv; v++)
            _mm256_storeu_ps(y + 8 * v, avx2_fwht8(_mm256_mul_ps(_mm256_loadu_ps(y + 8 * v), _mm256_loadu_ps(s + 8 * v))));
        for (uint32_t h = 8; h < D; h <<= 1)
            for (uint32_t i = 0; i < D; i += 2 * h)
                for (uint32_t j = i; j < i + h; j += 8) {
                    const __m256 a = _mm256_loadu_ps(y + j), b = _mm256_loadu_ps(y + j + h);
                    _mm256_storeu_ps(y + j, _mm256_add_ps(a, b));
                    _mm256_storeu_ps(y + j + h, _mm256_sub_ps(a, b));
                }
    }
    const __m256 sc = _mm256_set1_ps(ix->rot_scale);
    for (uint32_t v = 0; v < nv; v++)
        _mm256_storeu_ps(y + 8 * v, _mm256_mul_ps(_mm256_loadu_ps(y + 8 * v), sc));
}

/* 16 lanes as (lo = lanes 0-7, hi = lanes 8-15), folded like rq_fold16 */
RQ_AVX2 static inline float avx2_fold16(__m256 lo, __m256 hi)
{
    const __m256 s8 = _mm256_add_ps(lo, hi);
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    const __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
    return _mm_cvtss_f32(s1);
}

RQ_AVX2 static void avx2_encode(struct tkv_rabitq *ix, const uint16_t *k, size_t row_stride, uint32_t n, uint32_t at)
{
    const uint32_t D = ix->dim_pad, W = ix->words;
    float kf[TKV_RABITQ_MAX_DIM] __attribute__((aligned(64))), y[TKV_RABITQ_MAX_DIM] __attribute__((aligned(64)));
    const __m256 zero = _mm256_setzero_ps(), absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (uint32_t r = 0; r < n; r++) {
        load_row_f16(ix, k + r * row_stride, kf);
        __m256 rr[2] = {zero, zero}, t[2] = {zero, zero}, l1[2] = {zero, zero};
        for (uint32_t i = 0; i < D; i += 8) {
            const __m256 kv = _mm256_load_ps(kf + i), c = _mm256_loadu_ps(ix->ck + i);
            const __m256 rv = _mm256_sub_ps(kv, c);
            _mm256_store_ps(y + i, rv);
            const int l = (i / 8) & 1;
            rr[l] = _mm256_fmadd_ps(rv, rv, rr[l]);
            t[l] = _mm256_fmadd_ps(_mm256_loadu_ps(ix->cq + i), kv, t[l]);
        }
        avx2_rotate(ix, y);
        uint64_t *code = ix->code + (size_t)(at + r) * W;
        uint32_t pc = 0;
        for (uint32_t w = 0; w < W; w++) {
            uint64_t bits = 0;
            for (uint32_t c = 0; c < 8; c++) {
                const uint32_t i = 64 * w + 8 * c;
                const __m256 v = _mm256_load_ps(y + i);
                l1[c & 1] = _mm256_add_ps(l1[c & 1], _mm256_and_ps(v, absm));
                bits |= (uint64_t)(uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(v, zero, _CMP_GT_OQ)) << (8 * c);
            }
            code[w] = bits;
            pc += (uint32_t)_mm_popcnt_u64(bits);
        }
        ix->pc[at + r] = (uint16_t)pc;
        ix->a[at + r] = avx2_fold16(rr[0], rr[1]);
        ix->e[at + r] = avx2_fold16(l1[0], l1[1]);
        ix->t[at + r] = avx2_fold16(t[0], t[1]);
    }
}

/* sum over the 4 planes of 2^j * popcount(x & plane_j), per 64-bit lane */
RQ_AVX2 static inline __m256i avx2_ip64(__m256i x, const __m256i *pl)
{
    const __m256i lut = _mm256_setr_epi8(0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4, 0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2,
                                         3, 2, 3, 3, 4);
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m256i acc = _mm256_setzero_si256();
    for (int j = 3; j >= 0; j--) {
        const __m256i y = _mm256_and_si256(x, pl[j]);
        const __m256i c = _mm256_add_epi8(_mm256_shuffle_epi8(lut, _mm256_and_si256(y, m4)),
                                          _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(y, 4), m4)));
        acc = _mm256_add_epi8(_mm256_add_epi8(acc, acc), c); /* acc*2 + c: ends as c0 + 2c1 + 4c2 + 8c3 <= 120 */
    }
    return _mm256_sad_epu8(acc, _mm256_setzero_si256());
}

/* est/bound of 8 keys from their inner products ip (int32, in key order) */
RQ_AVX2 static inline void avx2_epilogue(const struct tkv_rabitq *ix, const struct tkv_rabitq_query *q, uint32_t i,
                                         __m256i ip, float *est, float *bound)
{
    const __m256i pc = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(ix->pc + i)));
    const __m256 xa = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_add_epi32(ip, ip), _mm256_set1_epi32(q->sum_q)));
    const __m256 xb = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_add_epi32(pc, pc), _mm256_set1_epi32((int)ix->dim_pad)));
    const __m256 x = _mm256_fmadd_ps(_mm256_set1_ps(q->delta), xa, _mm256_mul_ps(_mm256_set1_ps(q->vl), xb));
    const __m256 a = _mm256_loadu_ps(ix->a + i);
    _mm256_storeu_ps(est, _mm256_fmadd_ps(a, x, _mm256_add_ps(_mm256_loadu_ps(ix->t + i), _mm256_set1_ps(q->add))));
    if (bound) {
        const __m256 e = _mm256_loadu_ps(ix->e + i);
        const __m256 v = _mm256_fmadd_ps(_mm256_mul_ps(e, e), _mm256_set1_ps(q->bound_u),
                                         _mm256_mul_ps(_mm256_mul_ps(a, a), _mm256_set1_ps(q->bound_w)));
        _mm256_storeu_ps(bound, _mm256_sqrt_ps(v));
    }
}

RQ_AVX2 static void avx2_estimate(const struct tkv_rabitq *ix, const struct tkv_rabitq_query *q, uint32_t first,
                                  uint32_t n, float *est, float *bound)
{
    const uint32_t W = ix->words;
    __m256i pl[4];
    for (int j = 0; j < 4; j++)
        pl[j] = W == 1 ? _mm256_set1_epi64x((long long)q->plane[j][0])
              : W == 2 ? _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)q->plane[j]))
                       : _mm256_setzero_si256();
    uint32_t o = 0;
    for (; o + 8 <= n; o += 8) {
        const uint32_t i = first + o;
        const __m256i *c = (const __m256i *)(ix->code + (size_t)i * W);
        __m256i ip;
        if (W == 1) { /* r0 = keys 0-3, r1 = keys 4-7 (64-bit lanes) */
            const __m256i r0 = avx2_ip64(_mm256_loadu_si256(c), pl), r1 = avx2_ip64(_mm256_loadu_si256(c + 1), pl);
            const __m256i p = _mm256_or_si256(r0, _mm256_slli_epi64(r1, 32)); /* k0 k4 k1 k5 k2 k6 k3 k7 */
            ip = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
        } else if (W == 2) { /* each register: 2 keys x 2 words */
            const __m256i r0 = avx2_ip64(_mm256_loadu_si256(c), pl), r1 = avx2_ip64(_mm256_loadu_si256(c + 1), pl);
            const __m256i r2 = avx2_ip64(_mm256_loadu_si256(c + 2), pl), r3 = avx2_ip64(_mm256_loadu_si256(c + 3), pl);
            __m256i p = _mm256_or_si256(r0, _mm256_slli_epi64(r1, 32)); /* 32-bit: k0w0 k2w0 k0w1 k2w1 | k1.. k3.. */
            __m256i s = _mm256_or_si256(r2, _mm256_slli_epi64(r3, 32));
            p = _mm256_add_epi32(p, _mm256_shuffle_epi32(p, 0x4E)); /* k0 k2 . . | k1 k3 . . */
            s = _mm256_add_epi32(s, _mm256_shuffle_epi32(s, 0x4E)); /* k4 k6 . . | k5 k7 . . */
            const __m256i u = _mm256_unpacklo_epi64(p, s);          /* k0 k2 k4 k6 | k1 k3 k5 k7 */
            ip = _mm256_permutevar8x32_epi32(u, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        } else {
            int32_t tmp[8];
            for (int k = 0; k < 8; k++) {
                const uint64_t *ck = ix->code + (size_t)(i + k) * W;
                uint32_t acc = 0;
                for (int j = 0; j < 4; j++) {
                    uint32_t s = 0;
                    for (uint32_t w = 0; w < W; w++)
                        s += (uint32_t)_mm_popcnt_u64(ck[w] & q->plane[j][w]);
                    acc += s << j;
                }
                tmp[k] = (int32_t)acc;
            }
            ip = _mm256_loadu_si256((const __m256i *)tmp);
        }
        avx2_epilogue(ix, q, i, ip, est + o, bound ? bound + o : NULL);
    }
    for (; o < n; o++)
        rq_estimate_one(ix, q, first + o, est + o, bound ? bound + o : NULL);
}

// --- AVX2: top-p ---------------------------------------------------------------------

RQ_AVX2 static inline __m256 avx2_exp(__m256 x)
{
    const __m256 t = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(RQ_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(t, _mm256_set1_ps(RQ_LN2_HI), x);
    r = _mm256_fnmadd_ps(t, _mm256_set1_ps(RQ_LN2_LO), r);
    __m256 e = _mm256_set1_ps(1.0f / 5040);
    e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.0f / 720));
    e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.0f / 120));
    e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.0f / 24));
    e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.0f / 6));
    e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(0.5f));
    e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.0f));
    e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.0f));
    const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(RQ_EXP_MIN), _CMP_GE_OQ); /* then t in [-150, 0] */
    /* 2^t = 2^t1 2^t2, t1 >= -100: e 2^t1 is exact, the second product the one rounding */
    const __m256i ti = _mm256_cvtps_epi32(t), t1 = _mm256_max_epi32(ti, _mm256_set1_epi32(-100)),
                  bias = _mm256_set1_epi32(127);
    const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(t1, bias), 23)),
                 f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ti, t1), bias), 23));
    return _mm256_and_ps(keep, _mm256_mul_ps(_mm256_mul_ps(e, f1), f2));
}

/* a in (0, 1]; below FLT_MIN taken as FLT_MIN (p < 1.2e-38 only) */
RQ_AVX2 static inline __m256 avx2_log(__m256 a)
{
    const __m256i bits = _mm256_castps_si256(_mm256_max_ps(a, _mm256_set1_ps(FLT_MIN)));
    __m256 e = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(127)));
    __m256 m = _mm256_castsi256_ps(
        _mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffff)), _mm256_set1_epi32(0x3f800000)));
    const __m256 big = _mm256_cmp_ps(m, _mm256_set1_ps((float)M_SQRT2), _CMP_GT_OQ);
    m = _mm256_blendv_ps(m, _mm256_mul_ps(m, _mm256_set1_ps(0.5f)), big);
    e = _mm256_add_ps(e, _mm256_and_ps(big, _mm256_set1_ps(1.0f)));
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 t = _mm256_div_ps(_mm256_sub_ps(m, one), _mm256_add_ps(m, one)), t2 = _mm256_mul_ps(t, t);
    __m256 q = _mm256_fmadd_ps(t2, _mm256_set1_ps(1.0f / 9), _mm256_set1_ps(1.0f / 7));
    q = _mm256_fmadd_ps(q, t2, _mm256_set1_ps(1.0f / 5));
    q = _mm256_fmadd_ps(q, t2, _mm256_set1_ps(1.0f / 3));
    q = _mm256_fmadd_ps(q, t2, one);
    const __m256 lm = _mm256_mul_ps(_mm256_add_ps(t, t), q);
    return _mm256_fmadd_ps(e, _mm256_set1_ps(RQ_LN2_HI), _mm256_fmadd_ps(e, _mm256_set1_ps(RQ_LN2_LO), lm));
}

/* lanes j < n of 8 */
RQ_AVX2 static inline __m256i avx2_lanes(uint32_t n)
{
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)TKV_MIN(n, 8u)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* the largest of the 8 lanes */
RQ_AVX2 static inline float avx2_hmax(__m256 v)
{
    const __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 q = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(q, _mm_shuffle_ps(q, q, 1)));
}

/* s and d of keys i .. i+7 (lanes past n: 0) */
RQ_AVX2 static inline void avx2_sd(const float *est, const float *bound, uint32_t i, __m256i in, __m256 scale,
                                   __m256 *s, __m256 *d)
{
    const __m256 z = _mm256_setzero_ps();
    *s = _mm256_fmadd_ps(scale, _mm256_maskload_ps(est + i, in), z);
    *d = bound ? _mm256_fmadd_ps(scale, _mm256_maskload_ps(bound + i, in), z) : z;
}

RQ_AVX2 static uint32_t avx2_topp_logvalues(const float *est, const float *bound, uint32_t n, float scale, float p,
                                            float *g, float *umax)
{
    const __m256 vs = _mm256_set1_ps(scale), inf = _mm256_set1_ps(INFINITY), z = _mm256_setzero_ps();
    __m256 vm = _mm256_set1_ps(*umax);
    for (uint32_t i = 0; i < n; i += 8) {
        const __m256i in = avx2_lanes(n - i);
        __m256 s, d;
        avx2_sd(est, bound, i, in, vs, &s, &d);
        const __m256 sd = _mm256_add_ps(s, d);
        const __m256 bad = _mm256_or_ps(
            _mm256_or_ps(_mm256_cmp_ps(s, s, _CMP_UNORD_Q), _mm256_cmp_ps(s, inf, _CMP_EQ_OQ)),
            _mm256_or_ps(_mm256_or_ps(_mm256_cmp_ps(d, z, _CMP_NGE_UQ), _mm256_cmp_ps(d, inf, _CMP_EQ_OQ)),
                         _mm256_cmp_ps(sd, inf, _CMP_EQ_OQ)));
        const int nb = _mm256_movemask_ps(_mm256_and_ps(bad, _mm256_castsi256_ps(in)));
        if (nb)
            return i + (uint32_t)__builtin_ctz((unsigned)nb);
        __m256 gv = s;
        if (bound) {
            const __m256 a = _mm256_fmadd_ps(_mm256_set1_ps(1 - p), avx2_exp(_mm256_mul_ps(d, _mm256_set1_ps(-2.0f))),
                                             _mm256_set1_ps(p));
            gv = _mm256_add_ps(sd, avx2_log(a));
        }
        _mm256_maskstore_ps(g + i, in, gv);
        vm = _mm256_blendv_ps(vm, _mm256_max_ps(vm, sd), _mm256_castsi256_ps(in));
    }
    *umax = avx2_hmax(vm);
    return n;
}

RQ_AVX2 static float avx2_topp_max(const float *g, uint32_t n, float m0)
{
    __m256 vm = _mm256_set1_ps(m0);
    for (uint32_t i = 0; i < n; i += 8) {
        const __m256i in = avx2_lanes(n - i);
        vm = _mm256_blendv_ps(vm, _mm256_max_ps(vm, _mm256_maskload_ps(g + i, in)), _mm256_castsi256_ps(in));
    }
    return avx2_hmax(vm);
}

RQ_AVX2 static void avx2_topp_weights(const float *est, const float *bound, uint32_t n, float scale, float M, float *l,
                                      float *u)
{
    const __m256 vs = _mm256_set1_ps(scale), vM = _mm256_set1_ps(M);
    for (uint32_t i = 0; i < n; i += 8) {
        const __m256i in = avx2_lanes(n - i);
        __m256 s, d;
        avx2_sd(est, bound, i, in, vs, &s, &d);
        const __m256 vu = avx2_exp(_mm256_sub_ps(_mm256_add_ps(s, d), vM));
        _mm256_maskstore_ps(u + i, in, vu);
        _mm256_maskstore_ps(l + i, in, bound ? avx2_exp(_mm256_sub_ps(_mm256_sub_ps(s, d), vM)) : vu);
    }
}

RQ_AVX2 static void avx2_topp_bins(const float *g, uint32_t n, float gmax, uint16_t *bin)
{
    const __m256 vg = _mm256_set1_ps(gmax), bpn = _mm256_set1_ps((float)TKV_RABITQ_TOPP_BPN),
                 last = _mm256_set1_ps((float)(TKV_RABITQ_TOPP_BINS - 1)), z = _mm256_setzero_ps();
    for (uint32_t i = 0; i < n; i += 8) {
        const __m256i in = avx2_lanes(n - i);
        __m256 d = _mm256_mul_ps(_mm256_sub_ps(vg, _mm256_maskload_ps(g + i, in)), bpn);
        d = _mm256_max_ps(_mm256_min_ps(d, last), z); /* min: NaN -> last, as rq_topp_bin */
        const __m256i b = _mm256_add_epi32(_mm256_cvttps_epi32(d), _mm256_set1_epi32(1));
        const __m128i b16 = _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(b, b), 0x08));
        if (n - i >= 8) {
            _mm_storeu_si128((__m128i *)(bin + i), b16);
        } else {
            uint16_t t[8];
            _mm_storeu_si128((__m128i *)t, b16);
            memcpy(bin + i, t, (n - i) * sizeof *t);
        }
    }
}

RQ_AVX2 static void avx2_topp_mask(const uint16_t *bin, uint32_t n, uint32_t lo, uint32_t hi, uint64_t *mask)
{
    /* bins are <= TKV_RABITQ_TOPP_BINS: signed 16-bit compares are exact */
    const __m256i vlo = _mm256_set1_epi16((int16_t)lo), vhi = _mm256_set1_epi16((int16_t)hi);
    for (uint32_t w = 0; w < (n + 63) / 64; w++) {
        uint64_t m = 0;
        for (uint32_t h = 0; h < 2; h++) {
            const uint32_t i = 64 * w + 32 * h;
            if (i >= n)
                break;
            const uint16_t *src = bin + i;
            uint16_t t[32];
            if (n - i < 32) { /* the tail: padded with bins no range holds */
                memset(t, 0xff, sizeof t);
                memcpy(t, src, (n - i) * sizeof *t);
                src = t;
            }
            __m256i in[2];
            for (int k = 0; k < 2; k++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(src + 16 * k));
                in[k] = _mm256_andnot_si256(_mm256_or_si256(_mm256_cmpgt_epi16(vlo, v), _mm256_cmpgt_epi16(v, vhi)),
                                            _mm256_set1_epi16(-1));
            }
            const __m256i bytes = _mm256_permute4x64_epi64(_mm256_packs_epi16(in[0], in[1]), 0xD8);
            m |= (uint64_t)(uint32_t)_mm256_movemask_epi8(bytes) << (32 * h);
        }
        mask[w] = m;
    }
}

static const struct rq_kernels avx2_kernels = {
    avx2_rotate,       avx2_encode,      avx2_estimate,  avx2_topp_logvalues,
    avx2_topp_max,     avx2_topp_weights, avx2_topp_bins, avx2_topp_mask,
};
const struct rq_kernels *const rq_kernels_avx2 = &avx2_kernels;

// --- AVX-512 ----------------------------------------------------------------------

RQ_AVX512 static inline __m512 avx512_fwht16(__m512 x)
{
    __m512 p = _mm512_permute_ps(x, 0xB1);
    x = _mm512_mask_sub_ps(_mm512_add_ps(x, p), 0xAAAA, p, x);
    p = _mm512_permute_ps(x, 0x4E);
    x = _mm512_mask_sub_ps(_mm512_add_ps(x, p), 0xCCCC, p, x);
    p = _mm512_shuffle_f32x4(x, x, 0xB1);
    x = _mm512_mask_sub_ps(_mm512_add_ps(x, p), 0xF0F0, p, x);
    p = _mm512_shuffle_f32x4(x, x, 0x4E);
    x = _mm512_mask_sub_ps(_mm512_add_ps(x, p), 0xFF00, p, x);
    return x;
}

RQ_AVX512 static void avx512_rotate(const struct tkv_rabitq *ix, float *y)
{
    const uint32_t D = ix->dim_pad, nv = D / 16;
    for (int r = 0; r < 3; r++) {
        const float *s = ix->sign + (size_t)r * D;
        for (uint32_t v = 0; v < nv; v++)
            _mm512_storeu_ps(y + 16 * v, avx512_fwht16(_mm512_mul_ps(_mm512_loadu_ps(y + 16 * v), _mm512_loadu_ps(s + 16 * v))));
        for (uint32_t h = 16; h < D; h <<= 1)
            for (uint32_t i = 0; i < D; i += 2 * h)
                for (uint32_t j = i; j < i + h; j += 16) {
                    const __m512 a = _mm512_loadu_ps(y + j), b = _mm512_loadu_ps(y + j + h);
                    _mm512_storeu_ps(y + j, _mm512_add_ps(a, b));
                    _mm512_storeu_ps(y + j + h, _mm512_sub_ps(a, b));
                }
    }
    const __m512 sc = _mm512_set1_ps(ix->rot_scale);
    for (uint32_t v = 0; v < nv; v++)
        _mm512_storeu_ps(y + 16 * v, _mm512_mul_ps(_mm512_loadu_ps(y + 16 * v), sc));
}

RQ_AVX512 static inline float avx512_fold16(__m512 x)
{
    const __m256 lo = _mm512_castps512_ps256(x), hi = _mm512_extractf32x8_ps(x, 1);
    const __m256 s8 = _mm256_add_ps(lo, hi);
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    const __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
    return _mm_cvtss_f32(s1);
}

RQ_AVX512 static void avx512_encode(struct tkv_rabitq *ix, const uint16_t *k, size_t row_stride, uint32_t n,
                                    uint32_t at)
{
    const uint32_t D = ix->dim_pad, W = ix->words;
    float kf[TKV_RABITQ_MAX_DIM] __attribute__((aligned(64))), y[TKV_RABITQ_MAX_DIM] __attribute__((aligned(64)));
    const __m512 zero = _mm512_setzero_ps();
    for (uint32_t r = 0; r < n; r++) {
        const uint16_t *row = k + r * row_stride;
        if (ix->dim % 16 == 0 && ix->dim == D)
            for (uint32_t i = 0; i < D; i += 16)
                _mm512_store_ps(kf + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(row + i))));
        else
            load_row_f16(ix, row, kf);
        __m512 rr = zero, t = zero, l1 = zero;
        for (uint32_t i = 0; i < D; i += 16) {
            const __m512 kv = _mm512_load_ps(kf + i), rv = _mm512_sub_ps(kv, _mm512_loadu_ps(ix->ck + i));
            _mm512_store_ps(y + i, rv);
            rr = _mm512_fmadd_ps(rv, rv, rr);
            t = _mm512_fmadd_ps(_mm512_loadu_ps(ix->cq + i), kv, t);
        }
        avx512_rotate(ix, y);
        uint64_t *code = ix->code + (size_t)(at + r) * W;
        uint32_t pc = 0;
        for (uint32_t w = 0; w < W; w++) {
            uint64_t bits = 0;
            for (uint32_t c = 0; c < 4; c++) {
                const __m512 v = _mm512_load_ps(y + 64 * w + 16 * c);
                l1 = _mm512_add_ps(l1, _mm512_abs_ps(v));
                bits |= (uint64_t)_mm512_cmp_ps_mask(v, zero, _CMP_GT_OQ) << (16 * c);
            }
            code[w] = bits;
            pc += (uint32_t)_mm_popcnt_u64(bits);
        }
        ix->pc[at + r] = (uint16_t)pc;
        ix->a[at + r] = avx512_fold16(rr);
        ix->e[at + r] = avx512_fold16(l1);
        ix->t[at + r] = avx512_fold16(t);
    }
}

RQ_AVX512 static inline __m512i avx512_ip64(__m512i x, const __m512i *pl)
{
    __m512i acc = _mm512_popcnt_epi64(_mm512_and_si512(x, pl[3]));
    for (int j = 2; j >= 0; j--)
        acc = _mm512_add_epi64(_mm512_add_epi64(acc, acc), _mm512_popcnt_epi64(_mm512_and_si512(x, pl[j])));
    return acc;
}

/* 8 keys' ip from two registers of 4 keys x 2 words */
RQ_AVX512 static inline __m256i avx512_pairs(__m512i a, __m512i b)
{
    const __m512i ev = _mm512_setr_epi64(0, 2, 4, 6, 8, 10, 12, 14), od = _mm512_setr_epi64(1, 3, 5, 7, 9, 11, 13, 15);
    return _mm512_cvtepi64_epi32(_mm512_add_epi64(_mm512_permutex2var_epi64(a, ev, b), _mm512_permutex2var_epi64(a, od, b)));
}

RQ_AVX512 static void avx512_estimate(const struct tkv_rabitq *ix, const struct tkv_rabitq_query *q, uint32_t first,
                                      uint32_t n, float *est, float *bound)
{
    const uint32_t W = ix->words;
    __m512i pl[4];
    for (int j = 0; j < 4; j++)
        pl[j] = W == 1 ? _mm512_set1_epi64((long long)q->plane[j][0])
              : W == 2 ? _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)q->plane[j]))
                       : _mm512_setzero_si512();
    const __m512i sumq = _mm512_set1_epi32(q->sum_q), dpad = _mm512_set1_epi32((int)ix->dim_pad);
    const __m512 delta = _mm512_set1_ps(q->delta), vl = _mm512_set1_ps(q->vl), add = _mm512_set1_ps(q->add);
    const __m512 bu = _mm512_set1_ps(q->bound_u), bw = _mm512_set1_ps(q->bound_w);
    uint32_t o = 0;
    for (; o + 16 <= n; o += 16) {
        const uint32_t i = first + o;
        const __m512i *c = (const __m512i *)(ix->code + (size_t)i * W);
        __m512i ip;
        if (W == 1) {
            const __m256i lo = _mm512_cvtepi64_epi32(avx512_ip64(_mm512_loadu_si512(c), pl));
            const __m256i hi = _mm512_cvtepi64_epi32(avx512_ip64(_mm512_loadu_si512(c + 1), pl));
            ip = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        } else if (W == 2) {
            const __m256i lo = avx512_pairs(avx512_ip64(_mm512_loadu_si512(c), pl), avx512_ip64(_mm512_loadu_si512(c + 1), pl));
            const __m256i hi = avx512_pairs(avx512_ip64(_mm512_loadu_si512(c + 2), pl), avx512_ip64(_mm512_loadu_si512(c + 3), pl));
            ip = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        } else {
            int32_t tmp[16];
            for (int k = 0; k < 16; k++) {
                const uint64_t *ck = ix->code + (size_t)(i + k) * W;
                uint32_t acc = 0;
                for (int j = 0; j < 4; j++) {
                    uint32_t s = 0;
                    for (uint32_t w = 0; w < W; w++)
                        s += (uint32_t)_mm_popcnt_u64(ck[w] & q->plane[j][w]);
                    acc += s << j;
                }
                tmp[k] = (int32_t)acc;
            }
            ip = _mm512_loadu_si512(tmp);
        }
        const __m512i pc = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(ix->pc + i)));
        const __m512 xa = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_add_epi32(ip, ip), sumq));
        const __m512 xb = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_add_epi32(pc, pc), dpad));
        const __m512 x = _mm512_fmadd_ps(delta, xa, _mm512_mul_ps(vl, xb));
        const __m512 a = _mm512_loadu_ps(ix->a + i);
        _mm512_storeu_ps(est + o, _mm512_fmadd_ps(a, x, _mm512_add_ps(_mm512_loadu_ps(ix->t + i), add)));
        if (bound) {
            const __m512 e = _mm512_loadu_ps(ix->e + i);
            const __m512 v = _mm512_fmadd_ps(_mm512_mul_ps(e, e), bu, _mm512_mul_ps(_mm512_mul_ps(a, a), bw));
            _mm512_storeu_ps(bound + o, _mm512_sqrt_ps(v));
        }
    }
    for (; o < n; o++)
        rq_estimate_one(ix, q, first + o, est + o, bound ? bound + o : NULL);
}

// --- AVX-512: top-p -------------------------------------------------------------------

RQ_AVX512 static inline __m512 avx512_exp(__m512 x)
{
    const __m512 t = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(RQ_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(t, _mm512_set1_ps(RQ_LN2_HI), x);
    r = _mm512_fnmadd_ps(t, _mm512_set1_ps(RQ_LN2_LO), r);
    __m512 e = _mm512_set1_ps(1.0f / 5040);
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f / 720));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f / 120));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f / 24));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f / 6));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(0.5f));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f));
    const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(RQ_EXP_MIN), _CMP_GE_OQ);
    return _mm512_maskz_scalef_ps(keep, e, t);
}

/* a in (0, 1] */
RQ_AVX512 static inline __m512 avx512_log(__m512 a)
{
    __m512 e = _mm512_getexp_ps(a), m = _mm512_getmant_ps(a, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_src);
    const __mmask16 big = _mm512_cmp_ps_mask(m, _mm512_set1_ps((float)M_SQRT2), _CMP_GT_OQ);
    m = _mm512_mask_mul_ps(m, big, m, _mm512_set1_ps(0.5f));
    e = _mm512_mask_add_ps(e, big, e, _mm512_set1_ps(1.0f));
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 t = _mm512_div_ps(_mm512_sub_ps(m, one), _mm512_add_ps(m, one)), t2 = _mm512_mul_ps(t, t);
    __m512 q = _mm512_fmadd_ps(t2, _mm512_set1_ps(1.0f / 9), _mm512_set1_ps(1.0f / 7));
    q = _mm512_fmadd_ps(q, t2, _mm512_set1_ps(1.0f / 5));
    q = _mm512_fmadd_ps(q, t2, _mm512_set1_ps(1.0f / 3));
    q = _mm512_fmadd_ps(q, t2, one);
    const __m512 lm = _mm512_mul_ps(_mm512_add_ps(t, t), q);
    return _mm512_fmadd_ps(e, _mm512_set1_ps(RQ_LN2_HI), _mm512_fmadd_ps(e, _mm512_set1_ps(RQ_LN2_LO), lm));
}

RQ_AVX512 static inline __mmask16 avx512_lanes(uint32_t n) { return n >= 16 ? 0xFFFF : (__mmask16)((1u << n) - 1); }

RQ_AVX512 static inline void avx512_sd(const float *est, const float *bound, uint32_t i, __mmask16 in, __m512 scale,
                                       __m512 *s, __m512 *d)
{
    const __m512 z = _mm512_setzero_ps();
    *s = _mm512_fmadd_ps(scale, _mm512_maskz_loadu_ps(in, est + i), z);
    *d = bound ? _mm512_fmadd_ps(scale, _mm512_maskz_loadu_ps(in, bound + i), z) : z;
}

RQ_AVX512 static uint32_t avx512_topp_logvalues(const float *est, const float *bound, uint32_t n, float scale, float p,
                                                float *g, float *umax)
{
    const __m512 vs = _mm512_set1_ps(scale), inf = _mm512_set1_ps(INFINITY), z = _mm512_setzero_ps();
    __m512 vm = _mm512_set1_ps(*umax);
    for (uint32_t i = 0; i < n; i += 16) {
        const __mmask16 in = avx512_lanes(n - i);
        __m512 s, d;
        avx512_sd(est, bound, i, in, vs, &s, &d);
        const __m512 sd = _mm512_add_ps(s, d);
        const __mmask16 bad = in & (_mm512_cmp_ps_mask(s, s, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(s, inf, _CMP_EQ_OQ) |
                                    _mm512_cmp_ps_mask(d, z, _CMP_NGE_UQ) | _mm512_cmp_ps_mask(d, inf, _CMP_EQ_OQ) |
                                    _mm512_cmp_ps_mask(sd, inf, _CMP_EQ_OQ));
        if (bad)
            return i + (uint32_t)__builtin_ctz(bad);
        __m512 gv = s;
        if (bound) {
            const __m512 a = _mm512_fmadd_ps(_mm512_set1_ps(1 - p), avx512_exp(_mm512_mul_ps(d, _mm512_set1_ps(-2.0f))),
                                             _mm512_set1_ps(p));
            gv = _mm512_add_ps(sd, avx512_log(a));
        }
        _mm512_mask_storeu_ps(g + i, in, gv);
        vm = _mm512_mask_max_ps(vm, in, vm, sd);
    }
    *umax = _mm512_reduce_max_ps(vm);
    return n;
}

RQ_AVX512 static float avx512_topp_max(const float *g, uint32_t n, float m)
{
    __m512 vm = _mm512_set1_ps(m);
    for (uint32_t i = 0; i < n; i += 16) {
        const __mmask16 in = avx512_lanes(n - i);
        vm = _mm512_mask_max_ps(vm, in, vm, _mm512_maskz_loadu_ps(in, g + i));
    }
    return _mm512_reduce_max_ps(vm);
}

RQ_AVX512 static void avx512_topp_weights(const float *est, const float *bound, uint32_t n, float scale, float M,
                                          float *l, float *u)
{
    const __m512 vs = _mm512_set1_ps(scale), vM = _mm512_set1_ps(M);
    for (uint32_t i = 0; i < n; i += 16) {
        const __mmask16 in = avx512_lanes(n - i);
        __m512 s, d;
        avx512_sd(est, bound, i, in, vs, &s, &d);
        const __m512 vu = avx512_exp(_mm512_sub_ps(_mm512_add_ps(s, d), vM));
        _mm512_mask_storeu_ps(u + i, in, vu);
        _mm512_mask_storeu_ps(l + i, in, bound ? avx512_exp(_mm512_sub_ps(_mm512_sub_ps(s, d), vM)) : vu);
    }
}

RQ_AVX512 static void avx512_topp_bins(const float *g, uint32_t n, float gmax, uint16_t *bin)
{
    const __m512 vg = _mm512_set1_ps(gmax), bpn = _mm512_set1_ps((float)TKV_RABITQ_TOPP_BPN),
                 last = _mm512_set1_ps((float)(TKV_RABITQ_TOPP_BINS - 1)), z = _mm512_setzero_ps();
    for (uint32_t i = 0; i < n; i += 16) {
        const __mmask16 in = avx512_lanes(n - i);
        __m512 d = _mm512_mul_ps(_mm512_sub_ps(vg, _mm512_maskz_loadu_ps(in, g + i)), bpn);
        d = _mm512_max_ps(_mm512_min_ps(d, last), z); /* min: NaN -> last, as rq_topp_bin */
        const __m512i b = _mm512_add_epi32(_mm512_cvttps_epi32(d), _mm512_set1_epi32(1));
        _mm256_mask_storeu_epi16(bin + i, in, _mm512_cvtepi32_epi16(b));
    }
}

RQ_AVX512 static void avx512_topp_mask(const uint16_t *bin, uint32_t n, uint32_t lo, uint32_t hi, uint64_t *mask)
{
    const __m512i vlo = _mm512_set1_epi16((short)lo), vhi = _mm512_set1_epi16((short)hi);
    for (uint32_t w = 0; w < (n + 63) / 64; w++) {
        uint64_t m = 0;
        for (uint32_t h = 0; h < 2 && 64 * w + 32 * h < n; h++) {
            const uint32_t i = 64 * w + 32 * h, k = n - i;
            const __mmask32 in = k >= 32 ? 0xFFFFFFFFu : (__mmask32)((1u << k) - 1);
            const __m512i v = _mm512_maskz_loadu_epi16(in, bin + i);
            m |= (uint64_t)(_mm512_mask_cmpge_epu16_mask(in, v, vlo) & _mm512_cmple_epu16_mask(v, vhi)) << (32 * h);
        }
        mask[w] = m;
    }
}

static const struct rq_kernels avx512_kernels = {
    avx512_rotate,      avx512_encode,        avx512_estimate,  avx512_topp_logvalues,
    avx512_topp_max,    avx512_topp_weights,  avx512_topp_bins, avx512_topp_mask,
};
const struct rq_kernels *const rq_kernels_avx512 = &avx512_kernels;

#else /* not x86-64: the scalar reference only */

const struct rq_kernels *const rq_kernels_avx2 = NULL;
const struct rq_kernels *const rq_kernels_avx512 = NULL;

#endif
