/*
 * rabitq-select.cu -- one layer's RaBitQ top-p on the GPU (rabitq-select.cuh).
 *
 * Per (KV head h, query head j) pair, with s = scale * est, d = scale * bound
 * (0 in plain mode), l = e^(s-d-M), u = e^(s+d-M) and the log-value
 * g = s + d + log(p + (1-p) e^(-2d)) (= s in plain mode) of
 * tkv_rabitq_select_topp, the kernels run in stream order:
 *   1 estimate  one thread per key, the code loaded once for the G queries:
 *               s, d, g to scratch; the largest g of the candidates (keys not
 *               forced) and the largest s + d of all keys per pair
 *   2 hist      the forced keys' l summed; the candidates' l, u and count in
 *               4096 bins of 1/64 nat below the largest g (the host's bins)
 *   3 scan      one block per pair: prefix sums over the bins give the first
 *               bin where keeping it whole meets (1-p) N >= p C: the boundary
 *   4 members   the boundary bin's keys listed (order immaterial: sums are
 *               integers)
 *   5 refine    one block per pair: radix select over the members' 64-bit
 *               key (g's order bits, then the position inverted, so "larger"
 *               is "taken first", ties by position), 8 bits a pass, keeping the
 *               invariant "the rule fails at the region's start and holds at its
 *               end", down to the last key taken
 *   6 output    kept = forced, or a bin before the boundary, or in it with a
 *               key >= the last one taken; ORed over the G pairs, a ballot per
 *               32 positions
 *   7 whole     (optional) every block of `whole` positions with a kept key
 *               kept whole
 * Sums are 64-bit fixed point in units of 2^-40 (every term is <= 1 after
 * subtracting M; TKV_RABITQ_SELECT_MAX_N = 2^23 keys keep them below 2^64):
 * N's terms rounded down and C's up, so the rule the device checks implies
 * the rule on the float exponentials themselves.
 */
#include "rabitq-select.cuh"

#define NB        TKV_CUDA_RQS_NBINS
#define BPN       64.0f
#define CHUNK     8192 /* keys per block of the hist and members kernels */
#define FX_SCALE  1099511627776.0 /* 2^40 */

typedef unsigned long long u64;

struct rqs_state {
    unsigned gmax_o, umax_o; /* ordered-bit maxima; 0 = none                      */
    unsigned bad, m;         /* a non-finite estimate; members listed             */
    u64 nf;                  /* forced keys' l                                    */
    u64 N, C;                /* at the boundary: kept before it, dropped after it */
    u64 kstar;               /* the last member of the boundary bin taken          */
    uint32_t bstar, partial, cnt, pad;
    float M, gmax;
    u64 hl[NB], hu[NB];
    uint32_t hc[NB];
};

size_t tkv_cuda_rqs_state_bytes(uint32_t P) { return (size_t)P * sizeof(struct rqs_state); }

/* floats in an order-preserving unsigned encoding: larger float, larger code */
static __device__ __forceinline__ unsigned ord_f(float f)
{
    const unsigned u = __float_as_uint(__fadd_rn(f, 0.0f)); /* -0 -> +0: the host's == */
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
static __device__ __forceinline__ float unord_f(unsigned o)
{
    return __uint_as_float((o & 0x80000000u) ? (o & 0x7fffffffu) : ~o);
}
/* Composite key: larger = taken first (g descending, then position ascending). */
static __device__ __forceinline__ u64 key_of(float g, uint32_t i)
{
    return ((u64)ord_f(g) << 32) | (u64)(~i);
}
static __device__ __forceinline__ u64 fx_down(float x) { return __double2ull_rz((double)x * FX_SCALE); }
static __device__ __forceinline__ u64 fx_up(float x) { return __double2ull_ru((double)x * FX_SCALE); }

/* the host's bin_of */
static __device__ __forceinline__ uint32_t bin_of(float g, float gmax)
{
    float d = __fmul_rn(__fsub_rn(gmax, g), BPN);
    d = d < (float)(NB - 1) ? d : (float)(NB - 1);
    return (uint32_t)(int32_t)(d > 0 ? d : 0);
}

static __device__ __forceinline__ bool is_forced(const struct tkv_cuda_rqs_head &h, uint32_t i)
{
    bool f = false;
    for (uint32_t r = 0; r < h.n_forced; r++)
        f |= i >= h.fb[r] && i < h.fe[r];
    return f;
}

/* the host's key_lu, from the stored s and d */
static __device__ __forceinline__ void key_lu(float s, float d, float M, bool safe, float *l, float *u)
{
    *u = expf(__fsub_rn(__fadd_rn(s, d), M));
    *l = safe ? expf(__fsub_rn(__fsub_rn(s, d), M)) : *u;
}

struct rqs_ptrs {
    float *g, *s, *d;
};
static __device__ __forceinline__ struct rqs_ptrs pair_ptrs(const struct tkv_cuda_rqs_params &pp,
                                                            const struct tkv_cuda_rqs_work &w, uint32_t pair)
{
    const size_t P = (size_t)pp.n_heads * pp.G, off = (size_t)pair * pp.n_max;
    return {w.scratch + off, w.scratch + P * pp.n_max + off, w.scratch + 2 * P * pp.n_max + off};
}

/* 1: grid (keys / 256, n_heads) */
__global__ void rqs_estimate(struct tkv_cuda_rqs_params pp, const struct tkv_cuda_rqs_head *heads,
                             const struct tkv_cuda_rq_query *qs, struct tkv_cuda_rqs_work w)
{
    __shared__ struct tkv_cuda_rq_query q[TKV_CUDA_RQS_MAX_G];
    const uint32_t h = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
    const struct tkv_cuda_rqs_head &hd = heads[h];
    for (uint32_t x = threadIdx.x; x < pp.G * sizeof(struct tkv_cuda_rq_query) / 4; x += blockDim.x)
        ((uint32_t *)q)[x] = ((const uint32_t *)(qs + (size_t)h * pp.G))[x];
    __syncthreads();
    const bool valid = i < hd.n, forced = valid && is_forced(hd, i);
    const struct tkv_cuda_rq_index &ix = hd.ix;
    uint64_t cw[TKV_CUDA_RQ_MAX_WORDS];
    float a = 0, e = 0, t = 0;
    int32_t xb = 0;
    if (valid) {
        for (uint32_t x = 0; x < ix.words; x++)
            cw[x] = ix.code[(size_t)i * ix.words + x];
        a = ix.a[i], e = ix.e[i], t = ix.t[i];
        xb = 2 * (int32_t)ix.pc[i] - (int32_t)ix.dim_pad;
    }
    for (uint32_t j = 0; j < pp.G; j++) {
        const uint32_t pair = h * pp.G + j;
        struct rqs_state *st = (struct rqs_state *)w.state + pair;
        unsigned go = 0, uo = 0, bad = 0;
        if (valid) {
            const struct tkv_cuda_rq_query &qq = q[j];
            uint32_t ip = 0;
#pragma unroll
            for (int b = 0; b < 4; b++) {
                uint32_t c = 0;
                for (uint32_t x = 0; x < ix.words; x++)
                    c += (uint32_t)__popcll(cw[x] & qq.plane[b][x]);
                ip += c << b;
            }
            const int32_t xa = 2 * (int32_t)ip - qq.sum_q;
            const float xx = fmaf(qq.delta, (float)xa, __fmul_rn(qq.vl, (float)xb));
            const float est = fmaf(a, xx, __fadd_rn(t, qq.add));
            const float s = __fmul_rn(pp.scale, est);
            float d = 0.0f;
            if (pp.safe) {
                const float bound = __fsqrt_rn(fmaf(__fmul_rn(e, e), qq.bound_u, __fmul_rn(__fmul_rn(a, a), qq.bound_w)));
                d = __fmul_rn(pp.scale, bound);
            }
            const float sd = __fadd_rn(s, d);
            bad = isnan(s) || s == INFINITY || !(d >= 0) || d == INFINITY || sd == INFINITY;
            const float g = pp.safe
                                ? __fadd_rn(sd, logf(__fadd_rn(pp.p, __fmul_rn(1.0f - pp.p, expf(__fmul_rn(-2.0f, d))))))
                                : s;
            const struct rqs_ptrs pt = pair_ptrs(pp, w, pair);
            pt.g[i] = g;
            if (pp.safe) {
                pt.s[i] = s;
                pt.d[i] = d;
            }
            uo = bad ? 0 : ord_f(sd);
            go = bad || forced ? 0 : ord_f(g);
        }
        go = __reduce_max_sync(0xffffffffu, go);
        uo = __reduce_max_sync(0xffffffffu, uo);
        bad = __reduce_or_sync(0xffffffffu, bad);
        if (threadIdx.x % 32 == 0) {
            if (go)
                atomicMax(&st->gmax_o, go);
            if (uo)
                atomicMax(&st->umax_o, uo);
            if (bad)
                atomicOr(&st->bad, 1u);
        }
    }
}

/* M and gmax of a pair, as the host computes them */
static __device__ __forceinline__ void pair_max(const struct tkv_cuda_rqs_params &pp, const struct rqs_state *st,
                                                float *M, float *gmax)
{
    const float umax = st->umax_o ? unord_f(st->umax_o) : -INFINITY;
    float m = umax > pp.extra_lse ? umax : pp.extra_lse;
    *M = m == -INFINITY ? 0.0f : m;
    *gmax = st->gmax_o ? unord_f(st->gmax_o) : -INFINITY;
}

/* 2: grid (n_max / CHUNK, P), dynamic shared memory NB * 20 bytes */
__global__ void rqs_hist(struct tkv_cuda_rqs_params pp, const struct tkv_cuda_rqs_head *heads,
                         struct tkv_cuda_rqs_work w)
{
    extern __shared__ u64 sh[];
    u64 *hl = sh, *hu = sh + NB;
    uint32_t *hc = (uint32_t *)(sh + 2 * NB);
    const uint32_t pair = blockIdx.y, h = pair / pp.G;
    const struct tkv_cuda_rqs_head &hd = heads[h];
    struct rqs_state *st = (struct rqs_state *)w.state + pair;
    const uint32_t i0 = blockIdx.x * CHUNK;
    if (i0 >= hd.n)
        return;
    for (uint32_t b = threadIdx.x; b < NB; b += blockDim.x)
        hl[b] = hu[b] = 0, hc[b] = 0;
    __syncthreads();
    float M, gmax;
    pair_max(pp, st, &M, &gmax);
    const struct rqs_ptrs pt = pair_ptrs(pp, w, pair);
    const uint32_t i1 = min(i0 + CHUNK, hd.n);
    u64 nf = 0;
    for (uint32_t i = i0 + threadIdx.x; i < i1; i += blockDim.x) {
        const float g = pt.g[i], s = pp.safe ? pt.s[i] : g, d = pp.safe ? pt.d[i] : 0.0f;
        float l, u;
        key_lu(s, d, M, pp.safe, &l, &u);
        if (is_forced(hd, i)) {
            nf += fx_down(l);
        } else {
            const uint32_t b = bin_of(g, gmax);
            atomicAdd(&hl[b], fx_down(l));
            atomicAdd(&hu[b], fx_up(u));
            atomicAdd(&hc[b], 1u);
        }
    }
    if (nf)
        atomicAdd(&st->nf, nf);
    __syncthreads();
    for (uint32_t b = threadIdx.x; b < NB; b += blockDim.x)
        if (hc[b]) {
            atomicAdd(&st->hl[b], hl[b]);
            atomicAdd(&st->hu[b], hu[b]);
            atomicAdd(&st->hc[b], hc[b]);
        }
}

/* the rule (1-p) N >= p C on fixed-point sums */
static __device__ __forceinline__ bool rule(double lp, float p, u64 N, u64 C)
{
    return lp * (double)N >= (double)p * (double)C;
}

#define SCAN_T 1024
#define SCAN_B (NB / SCAN_T)

/* 3: one block of SCAN_T threads per pair; thread t owns bins SCAN_B t .. */
__global__ void rqs_scan(struct tkv_cuda_rqs_params pp, struct tkv_cuda_rqs_work w)
{
    __shared__ u64 sl[SCAN_T], su[SCAN_T];
    __shared__ uint32_t sc[SCAN_T];
    __shared__ uint32_t bmin;
    struct rqs_state *st = (struct rqs_state *)w.state + blockIdx.x;
    const uint32_t t = threadIdx.x;
    u64 l = 0, u = 0;
    uint32_t c = 0;
    for (int k = 0; k < SCAN_B; k++)
        l += st->hl[t * SCAN_B + k], u += st->hu[t * SCAN_B + k], c += st->hc[t * SCAN_B + k];
    sl[t] = l, su[t] = u, sc[t] = c;
    if (t == 0)
        bmin = UINT32_MAX;
    __syncthreads();
    /* inclusive scans: sl, sc prefix (ascending); su suffix (descending) */
    for (uint32_t o = 1; o < SCAN_T; o <<= 1) {
        const u64 al = t >= o ? sl[t - o] : 0, au = t + o < SCAN_T ? su[t + o] : 0;
        const uint32_t ac = t >= o ? sc[t - o] : 0;
        __syncthreads();
        sl[t] += al, su[t] += au, sc[t] += ac;
        __syncthreads();
    }
    float M, gmax;
    pair_max(pp, st, &M, &gmax);
    const u64 nf = st->nf + fx_down(expf(__fsub_rn(pp.extra_lse, M)));
    const double lp = 1 - (double)pp.p;
    const u64 ctot = su[0];
    const uint32_t ncand = sc[SCAN_T - 1];
    const bool none = st->bad || ncand == 0 || rule(lp, pp.p, nf, ctot);
    /* bins before mine: prefix minus my own; after mine: suffix minus my own */
    u64 Nb = nf + sl[t] - l, Ca = su[t];
    uint32_t cb = sc[t] - c;
    if (!none)
        for (int k = 0; k < SCAN_B; k++) {
            const uint32_t b = t * SCAN_B + k;
            const u64 hl = st->hl[b], hu = st->hu[b];
            Ca -= hu;
            if (st->hc[b] && rule(lp, pp.p, Nb + hl, Ca)) {
                atomicMin(&bmin, b);
                break;
            }
            Nb += hl;
            cb += st->hc[b];
        }
    __syncthreads();
    if (none) {
        if (t == 0)
            st->bstar = 0, st->partial = 0, st->cnt = 0, st->N = nf, st->C = ctot, st->M = M, st->gmax = gmax;
        return;
    }
    if (bmin / SCAN_B == t) { /* the owner: N and C at the start of the boundary bin */
        u64 N = nf + sl[t] - l, C = su[t] - u;
        uint32_t cnt = sc[t] - c;
        for (uint32_t b = t * SCAN_B; b < bmin; b++)
            N += st->hl[b], cnt += st->hc[b];
        for (uint32_t b = bmin; b < (t + 1) * SCAN_B; b++)
            C += st->hu[b];
        st->bstar = bmin, st->partial = 1, st->cnt = cnt, st->N = N, st->C = C - st->hu[bmin], st->M = M,
        st->gmax = gmax;
    }
}

/* 4: grid (n_max / CHUNK, P) */
__global__ void rqs_members(struct tkv_cuda_rqs_params pp, const struct tkv_cuda_rqs_head *heads,
                            struct tkv_cuda_rqs_work w)
{
    const uint32_t pair = blockIdx.y;
    const struct tkv_cuda_rqs_head &hd = heads[pair / pp.G];
    struct rqs_state *st = (struct rqs_state *)w.state + pair;
    if (!st->partial)
        return;
    const struct rqs_ptrs pt = pair_ptrs(pp, w, pair);
    const uint32_t i1 = min((blockIdx.x + 1) * CHUNK, hd.n), bstar = st->bstar;
    const float gmax = st->gmax;
    uint32_t *list = w.list + (size_t)pair * pp.n_max;
    for (uint32_t i = blockIdx.x * CHUNK + threadIdx.x; i < i1; i += blockDim.x)
        if (bin_of(pt.g[i], gmax) == bstar && !is_forced(hd, i))
            list[atomicAdd(&st->m, 1u)] = i;
}

#define REF_T 256

/* 5: one block of REF_T threads per pair: the last key taken (kstar) */
__global__ void rqs_refine(struct tkv_cuda_rqs_params pp, struct tkv_cuda_rqs_work w)
{
    __shared__ u64 dl[256], du[256];
    __shared__ uint32_t dc[256];
    __shared__ int dstar;
    __shared__ u64 sN, sC, skey;
    __shared__ uint32_t scnt, shere;
    const uint32_t pair = blockIdx.x, t = threadIdx.x;
    struct rqs_state *st = (struct rqs_state *)w.state + pair;
    const struct rqs_ptrs pt = pair_ptrs(pp, w, pair);
    const uint32_t *list = w.list + (size_t)pair * pp.n_max;
    const double lp = 1 - (double)pp.p;
    if (st->bad) {
        if (t == 0)
            w.n_chosen[pair] = UINT32_MAX, w.mass[pair] = nan("");
        return;
    }
    if (!st->partial) {
        if (t == 0) {
            w.n_chosen[pair] = st->cnt;
            w.mass[pair] = st->N + st->C > 0 ? (double)st->N / ((double)st->N + (double)st->C) : 1.0;
        }
        return;
    }
    const uint32_t m = st->m;
    const float M = st->M;
    if (t == 0)
        sN = st->N, sC = st->C, scnt = st->cnt, skey = 0;
    u64 prefix = 0, mask = 0;
    bool found = false;
    for (int shift = 56; shift >= 0 && !found; shift -= 8) {
        dl[t] = du[t] = 0, dc[t] = 0;
        if (t == 0)
            dstar = -1;
        __syncthreads();
        for (uint32_t x = t; x < m; x += REF_T) {
            const uint32_t i = list[x];
            const float g = pt.g[i];
            const u64 K = key_of(g, i);
            if ((K & mask) != prefix)
                continue;
            float l, u;
            key_lu(pp.safe ? pt.s[i] : g, pp.safe ? pt.d[i] : 0.0f, M, pp.safe, &l, &u);
            const uint32_t dg = (uint32_t)(K >> shift) & 255u;
            atomicAdd(&dl[dg], fx_down(l));
            atomicAdd(&du[dg], fx_up(u));
            atomicAdd(&dc[dg], 1u);
        }
        __syncthreads();
        /* digit t: taken after the digits above it, before those below */
        u64 Lb = 0, Ua = 0;
        for (uint32_t k = t + 1; k < 256; k++)
            Lb += dl[k];
        for (uint32_t k = 0; k < t; k++)
            Ua += du[k];
        if (dc[t] && rule(lp, pp.p, sN + Lb + dl[t], sC + Ua))
            atomicMax(&dstar, (int)t);
        __syncthreads();
        const int ds = dstar;
        if (ds < 0) /* cannot happen: the rule holds at the region's end */
            break;
        if ((int)t == ds) {
            uint32_t cb = 0;
            for (uint32_t k = t + 1; k < 256; k++)
                cb += dc[k];
            sN += Lb, sC += Ua, scnt += cb, shere = dc[t];
        }
        __syncthreads();
        prefix |= (u64)ds << shift;
        mask |= (u64)255 << shift;
        if (shere == 1) { /* one member left: find it */
            for (uint32_t x = t; x < m; x += REF_T) {
                const uint32_t i = list[x];
                const u64 K = key_of(pt.g[i], i);
                if ((K & mask) == prefix)
                    skey = K;
            }
            found = true;
        } else if (shift == 0) {
            if (t == 0)
                skey = prefix;
            found = true;
        }
        __syncthreads();
    }
    if (t == 0 && !found) { /* cannot happen (the invariant): read the head whole */
        st->bad = 1;
        w.n_chosen[pair] = UINT32_MAX, w.mass[pair] = nan("");
    }
    if (t == 0 && found) {
        const uint32_t i = ~(uint32_t)skey;
        const float g = pt.g[i];
        float l, u;
        key_lu(pp.safe ? pt.s[i] : g, pp.safe ? pt.d[i] : 0.0f, M, pp.safe, &l, &u);
        const u64 N = sN + fx_down(l), C = sC;
        st->kstar = skey;
        w.n_chosen[pair] = scnt + 1;
        w.mass[pair] = N + C > 0 ? (double)N / ((double)N + (double)C) : 1.0;
    }
}

/* 6: grid (words * 32 / 256, n_heads): bit i of head h = any of its G pairs keeps i */
__global__ void rqs_output(struct tkv_cuda_rqs_params pp, const struct tkv_cuda_rqs_head *heads,
                           struct tkv_cuda_rqs_work w)
{
    const uint32_t h = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
    const struct tkv_cuda_rqs_head &hd = heads[h];
    if (i - threadIdx.x % 32 >= pp.words * 32) /* whole warps leave */
        return;
    bool kept = false;
    if (i < hd.n) {
        const bool forced = is_forced(hd, i);
        for (uint32_t j = 0; j < pp.G; j++) {
            const uint32_t pair = h * pp.G + j;
            const struct rqs_state *st = (const struct rqs_state *)w.state + pair;
            if (st->bad || forced) {
                kept = true;
                break;
            }
            const float g = pair_ptrs(pp, w, pair).g[i];
            const uint32_t b = bin_of(g, st->gmax);
            kept |= b < st->bstar || (st->partial && b == st->bstar && key_of(g, i) >= st->kstar);
        }
    }
    const unsigned bits = __ballot_sync(0xffffffffu, kept);
    if (threadIdx.x % 32 == 0)
        w.bitmap[(size_t)h * pp.words + i / 32] = bits;
}

/* 7: grid (blocks / 256, n_heads): a block of `whole` positions with a kept
 * key is kept whole. Threads only set bits of their own block, so what each
 * reads is kernel 6's output. */
__global__ void rqs_whole(struct tkv_cuda_rqs_params pp, const struct tkv_cuda_rqs_head *heads,
                          struct tkv_cuda_rqs_work w)
{
    const uint32_t h = blockIdx.y, b = blockIdx.x * blockDim.x + threadIdx.x, W = pp.whole;
    const uint32_t n = heads[h].n;
    if ((uint64_t)b * W >= n)
        return;
    const uint32_t b0 = b * W, b1 = min(b0 + W, n);
    uint32_t *row = w.bitmap + (size_t)h * pp.words;
    bool any = false;
    for (uint32_t x = b0; x < b1 && !any;) {
        const uint32_t wd = x / 32, lo = x % 32, hi = min(b1 - wd * 32, 32u);
        const uint32_t msk = (hi == 32 ? 0xffffffffu : (1u << hi) - 1) & ~((1u << lo) - 1);
        any = (row[wd] & msk) != 0;
        x = wd * 32 + hi;
    }
    if (!any)
        return;
    for (uint32_t x = b0; x < b1;) {
        const uint32_t wd = x / 32, lo = x % 32, hi = min(b1 - wd * 32, 32u);
        atomicOr(&row[wd], (hi == 32 ? 0xffffffffu : (1u << hi) - 1) & ~((1u << lo) - 1));
        x = wd * 32 + hi;
    }
}

cudaError_t tkv_cuda_rqs_run(const struct tkv_cuda_rqs_params *pp, const struct tkv_cuda_rqs_head *heads,
                             const struct tkv_cuda_rq_query *q, const struct tkv_cuda_rqs_work *w, cudaStream_t s)
{
    if (pp->n_heads == 0 || pp->G == 0 || pp->G > TKV_CUDA_RQS_MAX_G || pp->n_max == 0 ||
        pp->words * 32ull < pp->n_max)
        return cudaErrorInvalidValue;
    const uint32_t P = pp->n_heads * pp->G, chunks = tkv_cuda_blocks(pp->n_max, CHUNK);
    const size_t hist_smem = NB * (2 * sizeof(u64) + sizeof(uint32_t));
    TKV_CUDA_TRY(cudaMemsetAsync(w->state, 0, tkv_cuda_rqs_state_bytes(P), s));
    rqs_estimate<<<dim3(tkv_cuda_blocks(pp->n_max, 256), pp->n_heads), 256, 0, s>>>(*pp, heads, q, *w);
    TKV_CUDA_LAUNCHED();
    TKV_CUDA_TRY(cudaFuncSetAttribute(rqs_hist, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)hist_smem));
    rqs_hist<<<dim3(chunks, P), 512, hist_smem, s>>>(*pp, heads, *w);
    TKV_CUDA_LAUNCHED();
    rqs_scan<<<P, SCAN_T, 0, s>>>(*pp, *w);
    TKV_CUDA_LAUNCHED();
    rqs_members<<<dim3(chunks, P), 512, 0, s>>>(*pp, heads, *w);
    TKV_CUDA_LAUNCHED();
    rqs_refine<<<P, REF_T, 0, s>>>(*pp, *w);
    TKV_CUDA_LAUNCHED();
    rqs_output<<<dim3(tkv_cuda_blocks((size_t)pp->words * 32, 256), pp->n_heads), 256, 0, s>>>(*pp, heads, *w);
    TKV_CUDA_LAUNCHED();
    if (pp->whole) {
        rqs_whole<<<dim3(tkv_cuda_blocks(tkv_cuda_blocks(pp->n_max, pp->whole), 256), pp->n_heads), 256, 0, s>>>(
            *pp, heads, *w);
        TKV_CUDA_LAUNCHED();
    }
    return cudaSuccess;
}
