/*
 * rabitq.cu -- RaBitQ encoding and estimation on the GPU (rabitq.cuh says
 * what and why they match the CPU bit for bit).
 */
#include "rabitq.cuh"

#define RQ_FULL  0xffffffffu
#define RQ_WARPS 4 /* keys (one warp each) per block of the encoder */

/* The fixed-order fold of 16 lane sums (lanes 0..15 of the warp): lane j
 * adds lane j+s for s = 8, 4, 2, 1, as rq_fold16 does with acc[j] += acc[j+s].
 * Lane 0 returns the result; every lane must call it. */
static __device__ __forceinline__ float rq_fold16(float v)
{
#pragma unroll
    for (int s = 8; s >= 1; s >>= 1)
        v = __fadd_rn(v, __shfl_down_sync(RQ_FULL, v, s));
    return v;
}

/* rq_rotate_warp for dim_pad = 32 E, in registers: lane l holds elements
 * l E .. l E + E - 1, so the butterflies of stage h < E pair two of a lane's
 * own and those of stage h >= E pair lane l with lane l ^ (h / E), the same
 * slot of each (the lower element of a pair takes a + c, the upper a - c:
 * the host's operations on the host's operands, in the host's stage order).
 * Every sign is loaded before the first round (one memory latency, not one
 * per round and element). */
template <int E>
static __device__ __forceinline__ void rq_rotate_regs(float *y, const struct tkv_cuda_rq_index &ix, unsigned lane)
{
    constexpr uint32_t D = 32 * E;
    float sg[3][E], v[E];
#pragma unroll
    for (int r = 0; r < 3; r++)
#pragma unroll
        for (int k = 0; k < E; k++)
            sg[r][k] = __ldg(ix.sign + r * D + lane * E + k);
#pragma unroll
    for (int k = 0; k < E; k++)
        v[k] = y[lane * E + k];
#pragma unroll
    for (int r = 0; r < 3; r++) {
#pragma unroll
        for (int k = 0; k < E; k++)
            v[k] = __fmul_rn(v[k], sg[r][k]);
#pragma unroll
        for (int h = 1; h < E; h <<= 1)
#pragma unroll
            for (int k = 0; k < E; k++)
                if (!(k & h)) {
                    const float a = v[k], c = v[k + h];
                    v[k] = __fadd_rn(a, c);
                    v[k + h] = __fsub_rn(a, c);
                }
#pragma unroll
        for (int m = 1; m < 32; m <<= 1) { /* stage h = m E */
            const bool upper = (lane & m) != 0;
#pragma unroll
            for (int k = 0; k < E; k++) {
                const float o = __shfl_xor_sync(RQ_FULL, v[k], m);
                v[k] = upper ? __fsub_rn(o, v[k]) : __fadd_rn(v[k], o);
            }
        }
    }
    __syncwarp(); /* every lane has read y */
#pragma unroll
    for (int k = 0; k < E; k++)
        y[lane * E + k] = __fmul_rn(v[k], ix.rot_scale);
    __syncwarp();
}

/* y[dim_pad] (the warp's, in shared memory) <- P y: three rounds of signs
 * and Walsh-Hadamard butterflies (stage h = 1, 2, 4, ... as the host's
 * rotate), then the scale; every lane calls it, after the warp's writes to
 * y are ordered before it (a __syncwarp or a shuffle). The key encoder and
 * the query preparation both rotate here; dim_pad is 64 .. 512 (a power of
 * two, checked by their launchers). */
static __device__ void rq_rotate_warp(float *y, const struct tkv_cuda_rq_index &ix, unsigned lane)
{
    switch (ix.dim_pad) {
    case 64: rq_rotate_regs<2>(y, ix, lane); break;
    case 128: rq_rotate_regs<4>(y, ix, lane); break;
    case 256: rq_rotate_regs<8>(y, ix, lane); break;
    default: rq_rotate_regs<16>(y, ix, lane); break;
    }
}

/* One warp per key: f16 row -> r = k - c_k -> y = P r (three rounds of signs
 * and Walsh-Hadamard butterflies, then the scale) -> code bits y > 0, and the
 * sums |r|^2, |y|_1, c_q . k, finished into a, e, t in double. Row r of the
 * call is in the last span whose first is <= r. */
__global__ void rq_encode_kernel(struct tkv_cuda_rq_index ix, const struct tkv_cuda_rq_span *spans, uint32_t n_spans,
                                 uint32_t n, size_t row_stride, uint32_t at, uint32_t *bad)
{
    __shared__ float ys[RQ_WARPS][TKV_CUDA_RQ_MAX_DIM], ks[RQ_WARPS][TKV_CUDA_RQ_MAX_DIM];
    const unsigned wp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const uint32_t r = blockIdx.x * RQ_WARPS + wp;
    if (r >= n) /* the whole warp leaves: only warp-level synchronisation below */
        return;
    float *y = ys[wp], *kf = ks[wp];
    const uint32_t D = ix.dim_pad;
    uint32_t lo = 0, hi = n_spans - 1; /* every lane the same search: spans[0].first = 0 <= r */
    while (lo < hi) {
        const uint32_t mid = hi - (hi - lo) / 2;
        if (spans[mid].first <= r)
            lo = mid;
        else
            hi = mid - 1;
    }
    const __half *row = (const __half *)(spans[lo].k + (size_t)(r - spans[lo].first) * row_stride);
    for (uint32_t i = lane; i < D; i += 32) {
        const float x = i < ix.dim ? __half2float(row[i]) : 0.0f;
        kf[i] = x;
        y[i] = __fsub_rn(x, ix.ck[i]);
    }
    __syncwarp();
    float rr = 0.0f, t = 0.0f; /* lane j < 16: elements j, j+16, ... ascending */
    if (lane < 16)
        for (uint32_t i = lane; i < D; i += 16) {
            rr = fmaf(y[i], y[i], rr);
            t = fmaf(ix.cq[i], kf[i], t);
        }
    rr = rq_fold16(rr);
    t = rq_fold16(t);
    rq_rotate_warp(y, ix, lane);
    uint32_t pc = 0;
    uint64_t *code = ix.code + (size_t)(at + r) * ix.words;
    for (uint32_t w = 0; w < ix.words; w++) {
        const uint64_t lo = __ballot_sync(RQ_FULL, y[64 * w + lane] > 0.0f);
        const uint64_t hi = __ballot_sync(RQ_FULL, y[64 * w + 32 + lane] > 0.0f);
        const uint64_t bits = lo | hi << 32;
        if (lane == 0)
            code[w] = bits;
        pc += (uint32_t)__popcll(bits);
    }
    float l1 = 0.0f;
    if (lane < 16)
        for (uint32_t i = lane; i < D; i += 16)
            l1 = __fadd_rn(l1, fabsf(y[i]));
    l1 = rq_fold16(l1);
    if (lane != 0)
        return;
    /* finish_keys (runtime/rabitq/rabitq.c), in double */
    const double rrd = rr, l1d = l1;
    if (!isfinite(rrd) || !isfinite(l1d) || !isfinite(t))
        atomicMin(bad, r);
    float a_out = 0.0f, e_out = 0.0f;
    if (rrd > 0 && l1d > 0) {
        const double nk = sqrt(rrd);
        double alpha = __ddiv_rn(l1d, __dmul_rn(sqrt((double)D), nk));
        if (alpha > 1)
            alpha = 1;
        a_out = (float)__ddiv_rn(rrd, l1d);
        e_out = (float)__ddiv_rn(__dmul_rn(nk, sqrt(fma(-alpha, alpha, 1.0))), alpha);
    }
    ix.a[at + r] = a_out;
    ix.e[at + r] = e_out;
    ix.t[at + r] = t;
    ix.pc[at + r] = (uint16_t)pc;
}

/* the first of (v, i) and (w, j): the smaller value (or larger, with max),
 * of equal ones (+0 and -0 too) the lower index: where the host's
 * sequential "u[i] < lo ? u[i] : lo" ends */
static __device__ __forceinline__ void rq_pick(float &v, uint32_t &i, float w, uint32_t j, bool max)
{
    if ((max ? w > v : w < v) || (w == v && j < i))
        v = w, i = j;
}

/* One warp per query (tkv_rabitq_query_prepare, runtime/rabitq/rabitq.c):
 * q the item's row or the mean of its rows (tkv_rabitq_query_mean's
 * operations), u = q - c_q zero-padded, |u|^2 and q . c_k summed in double
 * in the host's order (lanes 0 and 1, one sum each, over products the whole warp
 * formed first; every product of two floats is exact in double, so the
 * host's contraction cannot change it), u rotated, lo / hi with the host's
 * choice among equal values, the levels floor((u - lo) / delta + 0.5) with
 * the same IEEE operations, the planes by ballots, the scalars in double.
 * (Each query is a chain of dependent steps on one warp, so what counts is
 * the length of that chain: no memory round trip inside a loop.) */
__global__ void rq_prepare_kernel(const float *q, size_t head_stride, const __grid_constant__ struct tkv_cuda_rq_preps items,
                                  uint32_t first, uint32_t n, float eps0, struct tkv_rabitq_dev_query *out, uint32_t *bad)
{
    __shared__ float ys[RQ_WARPS][TKV_CUDA_RQ_MAX_DIM];
    __shared__ double prods[RQ_WARPS][2][TKV_CUDA_RQ_MAX_DIM]; /* u_i^2, q_i c_k,i */
    tkv_pdl_wait(); /* q: the step's, written by the ops before */
    tkv_pdl_trigger();
    const unsigned wp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const uint32_t gi = blockIdx.x * RQ_WARPS + wp, it = first + gi; /* item gi of the launch, it of the call */
    if (gi >= n) /* the whole warp leaves */
        return;
    const struct tkv_cuda_rq_index &ix = items.it[gi].ix;
    const uint32_t D = ix.dim_pad, dim = ix.dim;
    const float *row = q + (size_t)items.it[gi].head * head_stride;
    const uint32_t rows = items.it[gi].rows;
    float *y = ys[wp];
    bool fin = true;
    for (uint32_t i = lane; i < D; i += 32) {
        float x = i < dim ? row[i] : 0.0f;
        if (rows > 1 && i < dim) { /* a group query: tkv_rabitq_query_mean's sum in row order, one division */
            for (uint32_t j = 1; j < rows; j++)
                x = __fadd_rn(x, row[(size_t)j * head_stride + i]);
            x = __fdiv_rn(x, (float)rows);
        }
        fin &= isfinite(x);
        const float u = i < dim ? __fsub_rn(x, ix.cq[i]) : 0.0f;
        y[i] = u;
        prods[wp][0][i] = __dmul_rn((double)u, (double)u);
        prods[wp][1][i] = __dmul_rn((double)x, (double)ix.ck[i]);
    }
    __syncwarp();
    /* lane 0: nn = sum over i < D of u_i^2; lane 1: qck = sum over i < dim
     * of q_i c_k,i; ascending, one rounding per add as the host's loop */
    double acc = 0.0;
    if (lane < 2) {
        const double *pr = prods[wp][lane];
        const uint32_t m = lane == 0 ? D : dim;
        for (uint32_t i = 0; i < m; i++)
            acc = __dadd_rn(acc, pr[i]);
    }
    const double nn = __shfl_sync(RQ_FULL, acc, 0), qck = __shfl_sync(RQ_FULL, acc, 1);
    rq_rotate_warp(y, ix, lane); /* (y's writes above ordered by the __syncwarp) */
    float lo = y[lane], hi = lo;  /* D >= 64: every lane has an element */
    uint32_t ilo = lane, ihi = lane;
    for (uint32_t i = lane; i < D; i += 32) {
        fin &= isfinite(y[i]);
        rq_pick(lo, ilo, y[i], i, false);
        rq_pick(hi, ihi, y[i], i, true);
    }
#pragma unroll
    for (int s = 16; s >= 1; s >>= 1) {
        rq_pick(lo, ilo, __shfl_xor_sync(RQ_FULL, lo, s), __shfl_xor_sync(RQ_FULL, ilo, s), false);
        rq_pick(hi, ihi, __shfl_xor_sync(RQ_FULL, hi, s), __shfl_xor_sync(RQ_FULL, ihi, s), true);
    }
    const float delta = __fdiv_rn(__fsub_rn(hi, lo), 15.0f);
    fin = __all_sync(RQ_FULL, fin && isfinite(delta));
    struct tkv_rabitq_dev_query *o = &out[it];
    if (!fin) { /* refused: poisoned (backend.h), as tkv_rabitq_query_poison writes it */
        const float qnan = __uint_as_float(0x7fc00000u);
        for (uint32_t x = lane; x < 4 * TKV_CUDA_RQ_MAX_WORDS; x += 32)
            o->plane[x / TKV_CUDA_RQ_MAX_WORDS][x % TKV_CUDA_RQ_MAX_WORDS] = 0;
        if (lane == 0) {
            o->delta = o->vl = o->add = o->norm = o->bound_u = o->bound_w = qnan;
            o->sum_q = 0;
            o->eps0 = eps0;
            o->words = ix.words;
            o->dim_pad = D;
            if (bad)
                atomicMin(bad, it);
        }
        return;
    }
    int32_t sum = 0;
    const uint32_t W = ix.words; /* the same for every lane */
    for (uint32_t w = 0; w < W; w++) {
        uint64_t pl[4] = {0, 0, 0, 0};
#pragma unroll
        for (uint32_t half = 0; half < 2; half++) {
            const float u = y[64 * w + 32 * half + lane];
            int v = delta > 0 ? (int)floorf(__fadd_rn(__fdiv_rn(__fsub_rn(u, lo), delta), 0.5f)) : 0;
            v = v < 0 ? 0 : v > 15 ? 15 : v;
            sum += v;
#pragma unroll
            for (int j = 0; j < 4; j++)
                pl[j] |= (uint64_t)__ballot_sync(RQ_FULL, (v >> j) & 1) << (32 * half);
        }
        if (lane < 4) /* lane j writes plane j */
            o->plane[lane][w] = lane == 0 ? pl[0] : lane == 1 ? pl[1] : lane == 2 ? pl[2] : pl[3];
    }
    for (uint32_t x = lane; x < 4 * TKV_CUDA_RQ_MAX_WORDS; x += 32) /* the planes past W are 0 */
        if (x % TKV_CUDA_RQ_MAX_WORDS >= W)
            o->plane[x / TKV_CUDA_RQ_MAX_WORDS][x % TKV_CUDA_RQ_MAX_WORDS] = 0;
    sum = __reduce_add_sync(RQ_FULL, sum); /* integers: any order */
    if (lane != 0)
        return;
    const double e2 = __dmul_rn((double)eps0, (double)eps0);
    o->delta = delta;
    o->vl = lo;
    o->sum_q = sum;
    o->add = (float)__dsub_rn(qck, items.it[gi].cqck);
    o->norm = (float)__dsqrt_rn(nn);
    o->bound_u = (float)__ddiv_rn(__dmul_rn(e2, nn), (double)(D - 1));
    o->bound_w = (float)__ddiv_rn(__dmul_rn(__dmul_rn(__dmul_rn(e2, (double)delta), (double)delta), (double)D), 12.0);
    o->eps0 = eps0;
    o->words = ix.words;
    o->dim_pad = D;
}

/* One thread per key: rq_estimate_one (runtime/rabitq/rabitq-impl.h). */
__global__ void rq_estimate_kernel(struct tkv_cuda_rq_index ix, struct tkv_rabitq_dev_query q, uint32_t first,
                                   uint32_t n, float *est, float *bound)
{
    const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n)
        return;
    const uint32_t key = first + i;
    const uint64_t *c = ix.code + (size_t)key * ix.words;
    uint64_t cw[TKV_CUDA_RQ_MAX_WORDS];
    for (uint32_t w = 0; w < ix.words; w++)
        cw[w] = c[w];
    const int32_t xb = 2 * (int32_t)ix.pc[key] - (int32_t)ix.dim_pad;
    const float a = ix.a[key];
    est[i] = tkv_cuda_rq_est(cw, ix.words, q, xb, a, ix.t[key]);
    if (bound)
        bound[i] = tkv_cuda_rq_bound(a, ix.e[key], q);
}

cudaError_t tkv_cuda_rq_encode(const struct tkv_cuda_rq_index *ix, const struct tkv_cuda_rq_span *spans,
                               uint32_t n_spans, uint32_t n_rows, size_t row_stride, uint32_t at, uint32_t *bad,
                               cudaStream_t s)
{
    if (n_rows == 0)
        return cudaSuccess;
    if (n_spans == 0 || !tkv_cuda_rq_shape_ok(ix->dim_pad, ix->words))
        return cudaErrorInvalidValue;
    rq_encode_kernel<<<tkv_cuda_blocks(n_rows, RQ_WARPS), RQ_WARPS * 32, 0, s>>>(*ix, spans, n_spans, n_rows,
                                                                                 row_stride, at, bad);
    TKV_CUDA_LAUNCHED();
    return cudaSuccess;
}

/* 4 KiB: the parameter space every driver takes (as attn-decode.cu's) */
static_assert(sizeof(struct tkv_cuda_rq_preps) + 64 <= 4096, "kernel parameters");

cudaError_t tkv_cuda_rq_prepare(const float *q, size_t head_stride, const struct tkv_cuda_rq_preps *g, uint32_t first,
                                uint32_t n, float eps0, struct tkv_rabitq_dev_query *out, uint32_t *bad, bool pdl,
                                cudaStream_t s)
{
    if (n == 0)
        return cudaSuccess;
    if (!(eps0 > 0) || n > TKV_CUDA_RQ_PREP_GROUP)
        return cudaErrorInvalidValue;
    return tkv_cuda_launch(pdl, tkv_cuda_blocks(n, RQ_WARPS), RQ_WARPS * 32, 0, s, rq_prepare_kernel, q, head_stride,
                           *g, first, n, eps0, out, bad);
}

#define KS_ROWS 64 /* rows of a span one block of the key-sum kernel adds */

/* grid (n_spans, ceil(max_rows / KS_ROWS)), one thread per element: rows
 * y KS_ROWS .. of span x, then one atomic per element (and one per element
 * that met a value not finite) */
__global__ void rq_key_sums_kernel(const struct tkv_cuda_rq_rows *spans, size_t row_stride, uint32_t dim,
                                   unsigned long long *units, uint32_t *nonfinite)
{
    const struct tkv_cuda_rq_rows sp = spans[blockIdx.x];
    const uint32_t r0 = blockIdx.y * KS_ROWS, r1 = min(r0 + KS_ROWS, sp.n);
    for (uint32_t d = threadIdx.x; d < dim; d += blockDim.x) {
        long long acc = 0;
        uint32_t bad = 0;
        for (uint32_t r = r0; r < r1; r++) {
            const uint16_t h = sp.k[(size_t)r * row_stride + d];
            if (TKV_RABITQ_F16_FINITE(h))
                acc += TKV_RABITQ_F16_UNITS(h);
            else
                bad++;
        }
        if (acc)
            atomicAdd(&units[d], (unsigned long long)acc);
        if (bad)
            atomicAdd(&nonfinite[d], bad);
    }
}

cudaError_t tkv_cuda_rq_key_sums(const struct tkv_cuda_rq_rows *spans, uint32_t n_spans, uint32_t max_rows,
                                 size_t row_stride, uint32_t dim, unsigned long long *units, uint32_t *nonfinite,
                                 cudaStream_t s)
{
    if (n_spans == 0 || max_rows == 0)
        return cudaSuccess;
    const uint32_t gy = tkv_cuda_blocks(max_rows, KS_ROWS);
    if (dim == 0 || dim > TKV_CUDA_RQ_MAX_DIM || gy > 65535)
        return cudaErrorInvalidValue;
    rq_key_sums_kernel<<<dim3(n_spans, gy), dim < 128 ? 128 : dim, 0, s>>>(spans, row_stride, dim, units, nonfinite);
    TKV_CUDA_LAUNCHED();
    return cudaSuccess;
}

cudaError_t tkv_cuda_rq_estimate(const struct tkv_cuda_rq_index *ix, const struct tkv_rabitq_dev_query *q,
                                 uint32_t first, uint32_t n, float *est, float *bound, cudaStream_t s)
{
    if (n == 0)
        return cudaSuccess;
    if (ix->words == 0 || ix->words > TKV_CUDA_RQ_MAX_WORDS)
        return cudaErrorInvalidValue;
    rq_estimate_kernel<<<tkv_cuda_blocks(n, 256), 256, 0, s>>>(*ix, *q, first, n, est, bound);
    TKV_CUDA_LAUNCHED();
    return cudaSuccess;
}
