/*
 * quant-ref.c -- scalar references of the quant kernels (cpu/quant.h), the
 * weight quantizers, the activation-row layout and its repacking.
 *
 * The references follow the formulas of the spec (shared/specs
 * eval_gguf_tokenizer.md section 2.2) and llama.cpp's quantize_row_*_ref
 * literally: one element at a time, float32, products rounded before any
 * add (tkv_nofuse_), integer sums per block. quant.c's SIMD kernels are
 * tested against them.
 */
#include "quant.h"

#include <float.h>
#include <math.h>
#include <string.h>

/* ---- helpers ---------------------------------------------------------------- */

static inline float f16(uint16_t h) { return tkv_fp16_to_fp32(h); }

/* llama.cpp's nearest_int: round half to even, for |x| <= 2^22. */
static inline int nearest_int(float x)
{
    float v = tkv_nofuse_(x) + 12582912.f;
    int i;
    memcpy(&i, &v, sizeof i);
    return (i & 0x007fffff) - 0x00400000;
}

/* llama.cpp's ggml_compute_fp32_to_bf16: round to nearest even, NaN quieted. */
static inline uint16_t fp32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 64);
    return (uint16_t)((u + (0x7fffu + ((u >> 16) & 1))) >> 16);
}

/* 6-bit scale and min of sub-block j of a Q4_K super-block (spec 2.2). */
static inline void q4k_scale_min(int j, const uint8_t *s, int *sc, int *m)
{
    if (j < 4) {
        *sc = s[j] & 63;
        *m  = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *m  = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Block size and bytes of the weight types quant.h handles; 0 if unknown. */
static int blk(uint32_t type, size_t *bytes)
{
    switch (type) {
    case TKV_TYPE_F32:  *bytes = 4;   return 1;
    case TKV_TYPE_F16:  *bytes = 2;   return 1;
    case TKV_TYPE_BF16: *bytes = 2;   return 1;
    case TKV_TYPE_Q4_0: *bytes = 18;  return 32;
    case TKV_TYPE_Q4_1: *bytes = 20;  return 32;
    case TKV_TYPE_Q8_0: *bytes = 34;  return 32;
    case TKV_TYPE_Q8_1: *bytes = 36;  return 32;
    case TKV_TYPE_Q4_K: *bytes = 144; return 256;
    case TKV_TYPE_Q6_K: *bytes = 210; return 256;
    case TKV_TYPE_Q8_K: *bytes = 292; return 256;
    default:            *bytes = 0;   return 0;
    }
}

/* ---- dequantization ------------------------------------------------------- */

void tkv_dequant_row_ref(uint32_t type, const void *src, float *dst, int64_t n)
{
    size_t bb;
    int qk = blk(type, &bb);
    if (n <= 0)
        return;
    if (qk == 0 || type == TKV_TYPE_Q8_1 || type == TKV_TYPE_Q8_K) {
        memset(dst, 0, (size_t)n * sizeof *dst);
        return;
    }
    const int64_t nb = n / qk;
    const uint8_t *p = src;
    for (int64_t i = 0; i < nb; i++, p += bb) {
        float *y = dst + i * qk;
        switch (type) {
        case TKV_TYPE_F32:
            memcpy(y, p, 4);
            break;
        case TKV_TYPE_F16: {
            uint16_t h;
            memcpy(&h, p, 2);
            y[0] = f16(h);
            break;
        }
        case TKV_TYPE_BF16: {
            uint16_t h;
            memcpy(&h, p, 2);
            y[0] = tkv_bf16_to_fp32(h);
            break;
        }
        case TKV_TYPE_Q4_0: {
            const tkv_block_q4_0 *b = (const void *)p;
            const float d = f16(b->d);
            for (int j = 0; j < 16; j++) {
                y[j]      = (float)((b->qs[j] & 15) - 8) * d;
                y[j + 16] = (float)((b->qs[j] >> 4) - 8) * d;
            }
            break;
        }
        case TKV_TYPE_Q4_1: {
            const tkv_block_q4_1 *b = (const void *)p;
            const float d = f16(b->d), m = f16(b->m);
            for (int j = 0; j < 16; j++) {
                y[j]      = tkv_nofuse_((float)(b->qs[j] & 15) * d) + m;
                y[j + 16] = tkv_nofuse_((float)(b->qs[j] >> 4) * d) + m;
            }
            break;
        }
        case TKV_TYPE_Q8_0: {
            const tkv_block_q8_0 *b = (const void *)p;
            const float d = f16(b->d);
            for (int j = 0; j < 32; j++)
                y[j] = (float)b->qs[j] * d;
            break;
        }
        case TKV_TYPE_Q4_K: {
            const tkv_block_q4_K *b = (const void *)p;
            const float d = f16(b->d), dmin = f16(b->dmin);
            const uint8_t *q = b->qs;
            for (int c = 0; c < 4; c++, q += 32, y += 64) {
                int sc, m;
                q4k_scale_min(2 * c, b->scales, &sc, &m);
                const float d1 = d * (float)sc, m1 = dmin * (float)m;
                q4k_scale_min(2 * c + 1, b->scales, &sc, &m);
                const float d2 = d * (float)sc, m2 = dmin * (float)m;
                for (int l = 0; l < 32; l++)
                    y[l] = tkv_nofuse_(d1 * (float)(q[l] & 0xF)) - m1;
                for (int l = 0; l < 32; l++)
                    y[l + 32] = tkv_nofuse_(d2 * (float)(q[l] >> 4)) - m2;
            }
            break;
        }
        case TKV_TYPE_Q6_K: {
            const tkv_block_q6_K *b = (const void *)p;
            const float d = f16(b->d);
            const uint8_t *ql = b->ql, *qh = b->qh;
            const int8_t *sc = b->scales;
            for (int h = 0; h < 2; h++, ql += 64, qh += 32, sc += 8, y += 128) {
                for (int l = 0; l < 32; l++) {
                    const int is = l / 16;
                    const int q1 = (int)((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                    const int q2 = (int)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                    const int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                    const int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                    y[l]      = d * (float)sc[is + 0] * (float)q1;
                    y[l + 32] = d * (float)sc[is + 2] * (float)q2;
                    y[l + 64] = d * (float)sc[is + 4] * (float)q3;
                    y[l + 96] = d * (float)sc[is + 6] * (float)q4;
                }
            }
            break;
        }
        }
    }
    if (nb * qk < n)
        memset(dst + nb * qk, 0, (size_t)(n - nb * qk) * sizeof *dst);
}

/* ---- activation rows ------------------------------------------------------ */

uint32_t tkv_act_type(uint32_t weight_type)
{
    switch (weight_type) {
    case TKV_TYPE_F32: case TKV_TYPE_F16: case TKV_TYPE_BF16: return TKV_TYPE_F32;
    case TKV_TYPE_Q4_0: case TKV_TYPE_Q8_0:                   return TKV_TYPE_Q8_0;
    case TKV_TYPE_Q4_1:                                       return TKV_TYPE_Q8_1;
    case TKV_TYPE_Q4_K: case TKV_TYPE_Q6_K:                   return TKV_TYPE_Q8_K;
    default:                                                  return TKV_TYPE_COUNT;
    }
}

static size_t act_group_bytes(uint32_t weight_type)
{
    switch (weight_type) {
    case TKV_TYPE_Q4_0: return TKV_ACT_GROUP_Q4_0;
    case TKV_TYPE_Q4_1: return TKV_ACT_GROUP_Q4_1;
    case TKV_TYPE_Q8_0: return TKV_ACT_GROUP_Q8_0;
    default:            return 0;
    }
}

size_t tkv_act_pack_offset_(uint32_t weight_type, int64_t n)
{
    size_t bb;
    if (n <= 0 || act_group_bytes(weight_type) == 0)
        return 0;
    int qk = blk(tkv_act_type(weight_type), &bb);
    return (size_t)tkv_align_up((uint64_t)(n / qk) * bb, 64);
}

size_t tkv_act_row_bytes(uint32_t weight_type, int64_t n)
{
    uint32_t at = tkv_act_type(weight_type);
    size_t bb;
    int qk = blk(at, &bb);
    if (n <= 0 || qk == 0)
        return 0;
    int64_t nb = n / qk;
    size_t gb = act_group_bytes(weight_type);
    if (gb == 0)
        return (size_t)nb * bb;
    int64_t ng = (nb + TKV_ACT_GROUP - 1) / TKV_ACT_GROUP;
    return tkv_act_pack_offset_(weight_type, n) + (size_t)ng * gb;
}

static int32_t sum_qs(const int8_t *q)
{
    int32_t s = 0;
    for (int j = 0; j < 32; j++)
        s += q[j];
    return s;
}

void tkv_act_pack_(uint32_t weight_type, void *act, int64_t n)
{
    const size_t off = tkv_act_pack_offset_(weight_type, n), gb = act_group_bytes(weight_type);
    if (off == 0)
        return;
    const int64_t nb = n / 32, ng = (nb + TKV_ACT_GROUP - 1) / TKV_ACT_GROUP;
    uint8_t *base = act;
    size_t bb;
    blk(tkv_act_type(weight_type), &bb);
    memset(base + nb * bb, 0, off - nb * bb);
    for (int64_t g = 0; g < ng; g++) {
        uint8_t *G = base + off + (size_t)g * gb;
        memset(G, 0, gb);
        float d[TKV_ACT_GROUP] = {0}, s[TKV_ACT_GROUP] = {0};
        for (int k = 0; k < TKV_ACT_GROUP; k++) {
            const int64_t b = g * TKV_ACT_GROUP + k;
            /* the 4-bit kernels keep block k in slot 4*(k%4) + k/4 */
            const int e = weight_type == TKV_TYPE_Q8_0 ? k : 4 * (k % 4) + k / 4;
            if (b >= nb)
                continue;
            if (weight_type == TKV_TYPE_Q4_1) {
                const tkv_block_q8_1 *y = (const tkv_block_q8_1 *)base + b;
                d[e] = f16(y->d);
                s[e] = f16(y->s);
                int8_t *a = (int8_t *)G + 128 + (k / 4) * 128 + (k % 4) * 16;
                memcpy(a, y->qs, 16);
                memcpy(a + 64, y->qs + 16, 16);
            } else {
                const tkv_block_q8_0 *y = (const tkv_block_q8_0 *)base + b;
                d[e] = f16(y->d);
                const int32_t asum = sum_qs(y->qs);
                if (weight_type == TKV_TYPE_Q4_0) {
                    int32_t init = -8 * asum;
                    memcpy(G + 64 + (k / 4) * 64 + (k % 4) * 16, &init, 4);
                    int8_t *a = (int8_t *)G + 320 + (k / 4) * 128 + (k % 4) * 16;
                    memcpy(a, y->qs, 16);
                    memcpy(a + 64, y->qs + 16, 16);
                } else {
                    int32_t init = -128 * asum;
                    memcpy(G + 64 + (k / 2) * 64 + (k % 2) * 32, &init, 4);
                    memcpy(G + 576 + k * 32, y->qs, 32);
                }
            }
        }
        memcpy(G, d, sizeof d);
        if (weight_type == TKV_TYPE_Q4_1)
            memcpy(G + 64, s, sizeof s);
    }
}

/* llama.cpp's quantize_row_q8_0_ref (and q8_1 with the sum when s != NULL). */
static void q8_block_ref(const float *x, uint16_t *d_out, uint16_t *s_out, int8_t *qs)
{
    float amax = 0.0f;
    for (int j = 0; j < 32; j++)
        amax = TKV_MAX(amax, fabsf(x[j]));
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    int sum = 0;
    for (int j = 0; j < 32; j++) {
        qs[j] = (int8_t)roundf(x[j] * id);
        sum += qs[j];
    }
    *d_out = tkv_fp32_to_fp16(d);
    if (s_out)
        *s_out = tkv_fp32_to_fp16((float)sum * d);
}

/* llama.cpp's quantize_row_q8_K_ref (bsums are zeroed for an all-zero block,
 * where llama.cpp leaves them unwritten). */
static void q8k_block_ref(const float *x, tkv_block_q8_K *y)
{
    float max = 0.0f, amax = 0.0f;
    for (int j = 0; j < 256; j++) {
        const float ax = fabsf(x[j]);
        if (ax > amax) {
            amax = ax;
            max  = x[j];
        }
    }
    if (amax == 0.0f) {
        memset(y, 0, sizeof *y);
        return;
    }
    const float iscale = -127.0f / max;
    for (int j = 0; j < 256; j++) {
        const int v = nearest_int(iscale * x[j]);
        y->qs[j] = (int8_t)TKV_MIN(127, v);
    }
    for (int j = 0; j < 16; j++) {
        int sum = 0;
        for (int i = 0; i < 16; i++)
            sum += y->qs[j * 16 + i];
        y->bsums[j] = (int16_t)sum;
    }
    y->d = 1.0f / iscale;
}

void tkv_quantize_act_ref(uint32_t weight_type, const float *x, void *dst, int64_t n)
{
    const uint32_t at = tkv_act_type(weight_type);
    if (n <= 0)
        return;
    switch (at) {
    case TKV_TYPE_F32:
        memcpy(dst, x, (size_t)n * sizeof *x);
        return;
    case TKV_TYPE_Q8_0: {
        tkv_block_q8_0 *y = dst;
        for (int64_t i = 0; i < n / 32; i++)
            q8_block_ref(x + i * 32, &y[i].d, NULL, y[i].qs);
        break;
    }
    case TKV_TYPE_Q8_1: {
        tkv_block_q8_1 *y = dst;
        for (int64_t i = 0; i < n / 32; i++)
            q8_block_ref(x + i * 32, &y[i].d, &y[i].s, y[i].qs);
        break;
    }
    case TKV_TYPE_Q8_K: {
        tkv_block_q8_K *y = dst;
        for (int64_t i = 0; i < n / 256; i++)
            q8k_block_ref(x + i * 256, &y[i]);
        return;
    }
    default:
        return;
    }
    tkv_act_pack_(weight_type, dst, n);
}

/* ---- dot products ------------------------------------------------------------ */

float tkv_vec_dot_ref(uint32_t type, const void *w, const void *act, int64_t n)
{
    if (n <= 0)
        return 0.0f;
    const float *a = act;
    switch (type) {
    case TKV_TYPE_F32: { /* memcpy: the row need not be 4-byte aligned */
        const uint8_t *x = w;
        double s = 0;
        for (int64_t i = 0; i < n; i++) {
            float xi;
            memcpy(&xi, x + 4 * i, 4);
            s += (double)xi * a[i];
        }
        return (float)s;
    }
    case TKV_TYPE_F16: {
        const uint16_t *x = w;
        double s = 0;
        for (int64_t i = 0; i < n; i++)
            s += (double)f16(x[i]) * a[i];
        return (float)s;
    }
    case TKV_TYPE_BF16: {
        const uint16_t *x = w;
        double s = 0;
        for (int64_t i = 0; i < n; i++)
            s += (double)tkv_bf16_to_fp32(x[i]) * a[i];
        return (float)s;
    }
    case TKV_TYPE_Q4_0: {
        const tkv_block_q4_0 *x = w;
        const tkv_block_q8_0 *y = act;
        float sumf = 0.0f;
        for (int64_t i = 0; i < n / 32; i++) {
            int sumi = 0;
            for (int j = 0; j < 16; j++)
                sumi += ((x[i].qs[j] & 15) - 8) * y[i].qs[j] + ((x[i].qs[j] >> 4) - 8) * y[i].qs[j + 16];
            sumf += (f16(x[i].d) * f16(y[i].d)) * (float)sumi;
        }
        return sumf;
    }
    case TKV_TYPE_Q4_1: {
        const tkv_block_q4_1 *x = w;
        const tkv_block_q8_1 *y = act;
        float sumf = 0.0f;
        for (int64_t i = 0; i < n / 32; i++) {
            int sumi = 0;
            for (int j = 0; j < 16; j++)
                sumi += (x[i].qs[j] & 15) * y[i].qs[j] + (x[i].qs[j] >> 4) * y[i].qs[j + 16];
            sumf += (f16(x[i].d) * f16(y[i].d)) * (float)sumi + f16(x[i].m) * f16(y[i].s);
        }
        return sumf;
    }
    case TKV_TYPE_Q8_0: {
        const tkv_block_q8_0 *x = w;
        const tkv_block_q8_0 *y = act;
        float sumf = 0.0f;
        for (int64_t i = 0; i < n / 32; i++) {
            int sumi = 0;
            for (int j = 0; j < 32; j++)
                sumi += x[i].qs[j] * y[i].qs[j];
            sumf += (f16(x[i].d) * f16(y[i].d)) * (float)sumi;
        }
        return sumf;
    }
    case TKV_TYPE_Q4_K: {
        const tkv_block_q4_K *x = w;
        const tkv_block_q8_K *y = act;
        float sumf = 0.0f;
        for (int64_t i = 0; i < n / 256; i++) {
            int sumi = 0, summ = 0;
            for (int j = 0; j < 8; j++) {
                int sc, m, sq = 0, sa = 0;
                q4k_scale_min(j, x[i].scales, &sc, &m);
                const uint8_t *q = x[i].qs + (j / 2) * 32;
                const int8_t *q8 = y[i].qs + j * 32;
                for (int l = 0; l < 32; l++) {
                    sq += ((j & 1) ? q[l] >> 4 : q[l] & 0xF) * q8[l];
                    sa += q8[l];
                }
                sumi += sc * sq;
                summ += m * sa;
            }
            sumf += (f16(x[i].d) * y[i].d) * (float)sumi - (f16(x[i].dmin) * y[i].d) * (float)summ;
        }
        return sumf;
    }
    case TKV_TYPE_Q6_K: {
        const tkv_block_q6_K *x = w;
        const tkv_block_q8_K *y = act;
        float sumf = 0.0f;
        for (int64_t i = 0; i < n / 256; i++) {
            int sumi = 0;
            const uint8_t *ql = x[i].ql, *qh = x[i].qh;
            const int8_t *sc = x[i].scales, *q8 = y[i].qs;
            for (int h = 0; h < 2; h++, ql += 64, qh += 32, sc += 8, q8 += 128) {
                for (int l = 0; l < 32; l++) {
                    const int is = l / 16;
                    const int q1 = (int)((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                    const int q2 = (int)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                    const int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                    const int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                    sumi += sc[is + 0] * q1 * q8[l] + sc[is + 2] * q2 * q8[l + 32] +
                            sc[is + 4] * q3 * q8[l + 64] + sc[is + 6] * q4 * q8[l + 96];
                }
            }
            sumf += (f16(x[i].d) * y[i].d) * (float)sumi;
        }
        return sumf;
    }
    default:
        return 0.0f;
    }
}

/* ---- weight quantizers ----------------------------------------------------- */

bool tkv_quantize_row(uint32_t type, const float *x, void *dst, int64_t n)
{
    if (n < 0)
        return false;
    switch (type) {
    case TKV_TYPE_F32:
        memcpy(dst, x, (size_t)n * sizeof *x);
        return true;
    case TKV_TYPE_F16:
        tkv_fp32_to_fp16_row(x, dst, n);
        return true;
    case TKV_TYPE_BF16: {
        uint16_t *y = dst;
        for (int64_t i = 0; i < n; i++)
            y[i] = fp32_to_bf16(x[i]);
        return true;
    }
    case TKV_TYPE_Q4_0: { /* quantize_row_q4_0_ref */
        tkv_block_q4_0 *y = dst;
        for (int64_t i = 0; i < n / 32; i++, x += 32) {
            float amax = 0.0f, max = 0.0f;
            for (int j = 0; j < 32; j++) {
                if (amax < fabsf(x[j])) {
                    amax = fabsf(x[j]);
                    max  = x[j];
                }
            }
            const float d = max / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            y[i].d = tkv_fp32_to_fp16(d);
            for (int j = 0; j < 16; j++) {
                const int q0 = TKV_MIN(15, (int)(tkv_nofuse_(x[j] * id) + 8.5f));
                const int q1 = TKV_MIN(15, (int)(tkv_nofuse_(x[j + 16] * id) + 8.5f));
                y[i].qs[j] = (uint8_t)(q0 | (q1 << 4));
            }
        }
        return true;
    }
    case TKV_TYPE_Q4_1: { /* quantize_row_q4_1_ref */
        tkv_block_q4_1 *y = dst;
        for (int64_t i = 0; i < n / 32; i++, x += 32) {
            float min = FLT_MAX, max = -FLT_MAX;
            for (int j = 0; j < 32; j++) {
                if (x[j] < min) min = x[j];
                if (x[j] > max) max = x[j];
            }
            const float d = (max - min) / 15.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            y[i].d = tkv_fp32_to_fp16(d);
            y[i].m = tkv_fp32_to_fp16(min);
            for (int j = 0; j < 16; j++) {
                const int q0 = TKV_MIN(15, (int)(tkv_nofuse_((x[j] - min) * id) + 0.5f));
                const int q1 = TKV_MIN(15, (int)(tkv_nofuse_((x[j + 16] - min) * id) + 0.5f));
                y[i].qs[j] = (uint8_t)(q0 | (q1 << 4));
            }
        }
        return true;
    }
    case TKV_TYPE_Q8_0: {
        tkv_block_q8_0 *y = dst;
        for (int64_t i = 0; i < n / 32; i++)
            q8_block_ref(x + i * 32, &y[i].d, NULL, y[i].qs);
        return true;
    }
    default:
        return false;
    }
}
