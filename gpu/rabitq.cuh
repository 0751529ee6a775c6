/*
 * rabitq.cuh -- the RaBitQ key index on the GPU (the device side of
 * backend.h's rabitq_encode / rabitq_estimate ops): keys encoded into 1-bit
 * codes and three scalars, and the popcount estimate of q.k with its error
 * bound, for every key of an index.
 *
 * The math and the layout are runtime/rabitq/rabitq.h's. The results are
 * bit-identical to the CPU kernels because these kernels follow the same
 * three rules (runtime/rabitq/rabitq-impl.h): the rotation is a fixed
 * sequence of exact sign flips and a + b / a - b butterflies; every sum over
 * a key's dimensions is kept in 16 lanes (element i in lane i % 16, ascending
 * i, fmaf for products) and folded j += j+8, +4, +2, +1; every a*b+c of the
 * estimate is an explicit fmaf and no other product meets an add (the
 * kernels use __fmul_rn / __fadd_rn, which nvcc never contracts). The
 * per-key scalars are finished in double, as finish_keys does.
 */
#ifndef TKV_GPU_RABITQ_CUH
#define TKV_GPU_RABITQ_CUH

#include "common.cuh"

#define TKV_CUDA_RQ_MAX_DIM   512 /* = TKV_RABITQ_MAX_DIM */
#define TKV_CUDA_RQ_MAX_WORDS (TKV_CUDA_RQ_MAX_DIM / 64)

/* One index in device memory. */
struct tkv_cuda_rq_index {
    uint32_t dim, dim_pad, words; /* head_dim, its power-of-two padding (>= 64), dim_pad / 64 */
    float rot_scale;              /* dim_pad^-3/2                                            */
    const float *sign;            /* [3, dim_pad] +-1                                        */
    const float *ck, *cq;         /* [dim_pad] centroids, zero past dim                      */
    uint64_t *code;               /* [cap, words]                                            */
    float *a, *e, *t;             /* [cap]                                                   */
    uint16_t *pc;                 /* [cap]                                                   */
};

/* Whether an index's shape is one the kernels take: dim_pad a power of two
 * in 64 .. TKV_CUDA_RQ_MAX_DIM (the register rotation needs one), words =
 * dim_pad / 64. */
static inline bool tkv_cuda_rq_shape_ok(uint32_t dim_pad, uint32_t words)
{
    return dim_pad >= 64 && dim_pad <= TKV_CUDA_RQ_MAX_DIM && !(dim_pad & (dim_pad - 1)) && words * 64 == dim_pad;
}

/* A prepared query is backend.h's struct tkv_rabitq_dev_query (the host's
 * tkv_rabitq_query_prepare, or tkv_cuda_rq_prepare here), by value. */
static_assert(TKV_RABITQ_DEV_QUERY_WORDS == TKV_CUDA_RQ_MAX_WORDS, "query planes as wide as the codes can be");

/* One key's estimate and error bound, as tkv_rabitq_estimate computes them
 * (the same products and roundings: bit for bit): cw the key's code words,
 * xb = 2 popcount(code) - dim_pad, a and t its scalars (e for the bound).
 * rq_estimate_kernel and the selection's estimate kernels use these;
 * tkv_cuda_rq_est_ip is the part after the popcounts, for an
 * ip = sum_j 2^j popcount(code & plane j) counted elsewhere (on the tensor
 * cores: rabitq-select.cu). */
__device__ __forceinline__ float tkv_cuda_rq_est_ip(uint32_t ip, const struct tkv_rabitq_dev_query &q, int32_t xb,
                                                    float a, float t)
{
    const int32_t xa = 2 * (int32_t)ip - q.sum_q;
    const float x = fmaf(q.delta, (float)xa, __fmul_rn(q.vl, (float)xb));
    return fmaf(a, x, __fadd_rn(t, q.add));
}

template <int W = 0> /* W > 0: words == W, known here (cw then fits in registers) */
__device__ __forceinline__ float tkv_cuda_rq_est(const uint64_t *cw, uint32_t words,
                                                 const struct tkv_rabitq_dev_query &q, int32_t xb, float a, float t)
{
    const uint32_t nw = W > 0 ? (uint32_t)W : words;
    uint32_t ip = 0;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        uint32_t s = 0;
#pragma unroll
        for (uint32_t w = 0; w < nw; w++)
            s += (uint32_t)__popcll(cw[w] & q.plane[j][w]);
        ip += s << j;
    }
    return tkv_cuda_rq_est_ip(ip, q, xb, a, t);
}

__device__ __forceinline__ float tkv_cuda_rq_bound(float a, float e, const struct tkv_rabitq_dev_query &q)
{
    return __fsqrt_rn(fmaf(__fmul_rn(e, e), q.bound_u, __fmul_rn(__fmul_rn(a, a), q.bound_w)));
}

/* One span of an encode call (device memory, a table of n_spans): rows
 * first .. first + n - 1 of the call (n = the next span's first, or n_rows
 * for the last) are at k, k + row_stride, ... (device memory). Spans are in
 * call order with ascending first; the first span's first is 0; none empty. */
struct tkv_cuda_rq_span {
    const uint16_t *k;
    uint32_t first;
    uint32_t pad_;
};

/* Encodes the n_rows rows of the spans as keys at .. at+n_rows-1, all in one
 * grid (one warp per row, which finds its span by binary search). *bad
 * (device) is lowered to the first row of the call whose sums are not
 * finite (the caller sets it to UINT32_MAX first and discards the call's
 * keys if it changed). */
cudaError_t tkv_cuda_rq_encode(const struct tkv_cuda_rq_index *ix, const struct tkv_cuda_rq_span *spans,
                               uint32_t n_spans, uint32_t n_rows, size_t row_stride, uint32_t at, uint32_t *bad,
                               cudaStream_t s);

/* One query to prepare (device memory, a table of n): query head `head`
 * of the call's q (rows > 1: the mean of heads head .. head + rows - 1,
 * tkv_rabitq_query_mean's bits), for index ix (its rotation and centroids;
 * cqck = c_q . c_k). */
struct tkv_cuda_rq_prep {
    struct tkv_cuda_rq_index ix;
    double cqck;
    uint32_t head;
    uint32_t rows;
};

/* Items one launch of the prepare kernel takes: they travel as a kernel
 * parameter (88 bytes each), so nothing is staged before it. */
#define TKV_CUDA_RQ_PREP_GROUP 32
struct tkv_cuda_rq_preps {
    struct tkv_cuda_rq_prep it[TKV_CUDA_RQ_PREP_GROUP];
};

/* Items first .. first + n - 1 of a call (n <= TKV_CUDA_RQ_PREP_GROUP, item
 * first + i at g->it[i]): out[first + i] = query head g->it[i].head (f32 row
 * q + head * head_stride) prepared as tkv_rabitq_query_prepare prepares it,
 * bit for bit (one warp per query: the encoder's rotation, the double sums
 * in the host's order, the 4-bit levels with the host's roundings); a query
 * the host refuses (not finite, or its rotation overflowing) is written
 * poisoned (backend.h: struct tkv_rabitq_dev_query) and lowers *bad
 * (device, set to UINT32_MAX by the caller first; NULL: not reported) to its
 * index in the call. eps0 > 0 (the caller maps 0 to the default). pdl: a
 * programmatic dependent launch (common.cuh). Queued on s. */
cudaError_t tkv_cuda_rq_prepare(const float *q, size_t head_stride, const struct tkv_cuda_rq_preps *g, uint32_t first,
                                uint32_t n, float eps0, struct tkv_rabitq_dev_query *out, uint32_t *bad, bool pdl,
                                cudaStream_t s);

/* A key centroid's sums (backend.h's rabitq_key_sums): rows k .. of a
 * span, n of them, row_stride f16 apart. */
struct tkv_cuda_rq_rows {
    const uint16_t *k;
    uint32_t n;
    uint32_t pad_;
};

/* units[d] += the finite f16 of element d < dim of every span's rows, in
 * units of 2^-24 (TKV_RABITQ_F16_UNITS, exact in any order: two's
 * complement in the unsigned adds), nonfinite[d] += the others (device
 * arrays [dim]); max_rows: the longest span's rows. Queued on s. */
cudaError_t tkv_cuda_rq_key_sums(const struct tkv_cuda_rq_rows *spans, uint32_t n_spans, uint32_t max_rows,
                                 size_t row_stride, uint32_t dim, unsigned long long *units, uint32_t *nonfinite,
                                 cudaStream_t s);

/* est[i] (and bound[i] unless bound is NULL), device memory, for keys
 * first .. first+n-1. */
cudaError_t tkv_cuda_rq_estimate(const struct tkv_cuda_rq_index *ix, const struct tkv_rabitq_dev_query *q,
                                 uint32_t first, uint32_t n, float *est, float *bound, cudaStream_t s);

#endif /* TKV_GPU_RABITQ_CUH */
