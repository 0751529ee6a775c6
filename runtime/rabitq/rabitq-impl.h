/*
 * rabitq-impl.h -- private to runtime/rabitq/: the index struct, the kernel
 * table, and the per-key pieces every kernel variant shares so that they
 * all round identically.
 *
 * Bit-exactness across variants rests on three rules:
 *   - the rotation is a fixed sequence of exact sign flips and a + b / a - b
 *     butterflies, stage h = 1, 2, 4, ... in order, then one multiply;
 *   - every float sum over a key's dimensions is kept in 16 lanes (element i
 *     in lane i % 16, fmaf for products, ascending i), then folded
 *     j += j+8, j += j+4, j += j+2, j += j+1 (rq_fold16);
 *   - every a*b+c of the estimate is an explicit fmaf / _mm*_fmadd_ps and
 *     no other product meets an add (GCC would otherwise contract them in
 *     some variants and not in others under -ffp-contract=fast).
 */
#ifndef TKV_RABITQ_IMPL_H
#define TKV_RABITQ_IMPL_H

#include "rabitq.h"
#include "../tkv-impl.h"

#include <math.h>

struct rq_kernels {
    /* y[dim_pad] <- P y in place */
    void (*rotate)(const struct tkv_rabitq *ix, float *y);
    /* keys at .. at+n-1 from f16 rows: writes code and pc, and the raw sums
     * a[i] = |r|^2, e[i] = |P r|_1, t[i] = c_q . k (rq_finish turns them
     * into the stored scalars) */
    void (*encode)(struct tkv_rabitq *ix, const uint16_t *k, size_t row_stride, uint32_t n, uint32_t at);
    /* est (and bound unless NULL) for keys first .. first+n-1 */
    void (*estimate)(const struct tkv_rabitq *ix, const struct tkv_rabitq_query *q, uint32_t first, uint32_t n,
                     float *est, float *bound);

    /* The per-key loops of tkv_rabitq_select_topp (rabitq.c explains the
     * search). With s = scale*est[i] and d = scale*bound[i] (0 without
     * bound), each product one rounding (fmaf with +0):                     */
    /* g[i] = s + d + log(p + (1-p) e^(-2d)) with bound, s without; *umax =
     * max(*umax, s + d). Returns the first key whose s is NaN or +inf, or
     * whose d is negative, NaN or +inf, or whose s + d overflows; n if none
     * (g and umax then cover all n keys). */
    uint32_t (*topp_logvalues)(const float *est, const float *bound, uint32_t n, float scale, float p, float *g,
                               float *umax);
    /* max(m, g[0 .. n)) */
    float (*topp_max)(const float *g, uint32_t n, float m);
    /* l[j] = e^(s-d-M), u[j] = e^(s+d-M) for j < n <= RQ_TOPP_CHUNK (both
     * <= 1 as M >= s + d; l = u without bound) */
    void (*topp_weights)(const float *est, const float *bound, uint32_t n, float scale, float M, float *l, float *u);
    /* bin[j] = rq_topp_bin(g[j], gmax) + 1 for j < n */
    void (*topp_bins)(const float *g, uint32_t n, float gmax, uint16_t *bin);
    /* bit j of mask (word j/64, bit j%64) = lo <= bin[j] <= hi, for j < n <=
     * RQ_TOPP_CHUNK; words (n+63)/64 written, their bits past n 0 */
    void (*topp_mask)(const uint16_t *bin, uint32_t n, uint32_t lo, uint32_t hi, uint64_t *mask);
};

/* Keys per call of topp_weights and topp_mask: the caller's buffers. */
#define RQ_TOPP_CHUNK 512

/* The top-p histogram's bin of log-value g: NBINS bins of 1/BPN nat below
 * the largest, gmax (backend.h); the last bin takes everything lower,
 * g = -inf (and NaN, were gmax -inf too) included. */
static inline uint32_t rq_topp_bin(float g, float gmax)
{
    float d = (gmax - g) * (float)TKV_RABITQ_TOPP_BPN; /* >= 0 */
    d = d < (float)(TKV_RABITQ_TOPP_BINS - 1) ? d : (float)(TKV_RABITQ_TOPP_BINS - 1);
    return (uint32_t)(int32_t)(d > 0 ? d : 0);
}

struct tkv_rabitq {
    uint32_t dim, dim_pad, words;
    uint64_t seed;
    enum tkv_rabitq_isa isa;
    const struct rq_kernels *kern;
    float rot_scale;          /* dim_pad^-3/2: three unnormalised transforms      */
    float *sign;              /* [3, dim_pad] +-1.0f, 64-byte aligned             */
    float *ck, *cq;           /* [dim_pad] centroids, zero past dim               */
    double cqck;              /* c_q . c_k                                        */
    uint32_t gen;             /* bumped by set_centroids: stale queries refused   */
    bool centred;             /* set_centroids was called                         */
    uint32_t n, cap;          /* keys encoded, keys reserved                      */
    uint64_t *code;           /* [cap, words]                                     */
    float *a, *e, *t;         /* [cap] each                                       */
    uint16_t *pc;             /* [cap]                                            */
};

extern const struct rq_kernels rq_kernels_scalar;
/* NULL when the build has no such variant (not x86-64) */
extern const struct rq_kernels *const rq_kernels_avx2;
extern const struct rq_kernels *const rq_kernels_avx512;

/* acc[0] = the fixed-order fold of 16 lanes */
static inline float rq_fold16(float *acc)
{
    for (int s = 8; s >= 1; s >>= 1)
        for (int j = 0; j < s; j++)
            acc[j] = acc[j] + acc[j + s];
    return acc[0];
}

/* The estimate and bound of one key: the scalar reference, also used for the
 * tail of the vector loops. */
static inline void rq_estimate_one(const struct tkv_rabitq *ix, const struct tkv_rabitq_query *q, uint32_t i,
                                   float *est, float *bound)
{
    const uint64_t *c = ix->code + (size_t)i * ix->words;
    uint32_t ip = 0;
    for (int j = 0; j < 4; j++) {
        uint32_t s = 0;
        for (uint32_t w = 0; w < ix->words; w++)
            s += (uint32_t)__builtin_popcountll(c[w] & q->plane[j][w]);
        ip += s << j;
    }
    const int32_t xa = 2 * (int32_t)ip - q->sum_q, xb = 2 * (int32_t)ix->pc[i] - (int32_t)ix->dim_pad;
    const float x = fmaf(q->delta, (float)xa, q->vl * (float)xb);
    *est = fmaf(ix->a[i], x, ix->t[i] + q->add);
    if (bound) {
        const float e = ix->e[i], a = ix->a[i];
        *bound = sqrtf(fmaf(e * e, q->bound_u, (a * a) * q->bound_w));
    }
}

#endif /* TKV_RABITQ_IMPL_H */
