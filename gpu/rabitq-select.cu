/*
 * rabitq-select.cu -- one layer's RaBitQ top-p on the GPU (rabitq-select.cuh).
 *
 * Per (KV head h, query head j) pair, with s = scale * est, d = scale * bound
 * (0 in plain mode), l = e^(s-d-M), u = e^(s+d-M) and the log-value
 * g = s + d + log(p + (1-p) e^(-2d)) (= s in plain mode) of
 * tkv_rabitq_select_topp, the kernels run in stream order:
 *   1 estimate  a thread per key (or 4), the code loaded once for the G
 *               queries (128-bit codes: the popcounts on the tensor cores,
 *               rqs_estimate_mma): s, d, g to scratch; the largest g of the
 *               candidates (keys not forced) and the largest s + d of all keys
 *               per pair
 *   2 hist      the forced keys' l summed; the candidates' l, u and count in
 *               the host's bins of 1/TKV_RABITQ_TOPP_BPN nat below the largest g
 *               (backend.h: 1024 of 1/16 nat)
 *   3 scan      one block per pair: prefix sums over the bins give the first
 *               bin where keeping it whole meets (1-p) N >= p C: the boundary
 *               (coarse: kept whole, and 4 and 5 do not run)
 *   4 members   the boundary bin's keys listed (order immaterial: sums are
 *               integers)
 *   5 refine    one block per pair: radix select over the members' 64-bit
 *               key (g's order bits, then the position inverted, so "larger"
 *               is "taken first", ties by position), 8 bits a pass, keeping the
 *               invariant "the rule fails at the region's start and holds at its
 *               end", down to the last key taken
 *   6 output    kept = forced, or a bin before the boundary (g at or above
 *               the scan's threshold, bin_threshold), or in it with a
 *               key >= the last one taken; ORed over the G pairs, a ballot per
 *               32 positions (and widened to groups of `whole` positions
 *               there when whole divides 32)
 *   7 whole     (whole > 1 not dividing 32) every block of `whole` positions
 *               with a kept key kept whole
 * Sums: within a bin (and within the boundary bin's radix digits) 64-bit
 * fixed point, so they do not depend on the order the threads add them in;
 * N's terms rounded down and C's up. Each bin has its own units for l and
 * for u, 2^(E-40) with 2^(E-1) >= every term the bin can hold (bin_exps):
 *   u <= e^(g-M) / p      (e^g = (1-p) l + p u; plain: u = e^(g-M)),
 *   l <= min(e^(g-M) / (1-p), Lref)   (Lref: the largest l of any key or
 *                                      e^(extra_lse-M)),
 * with g <= gmax - b/64 in bin b; the forced keys' l and e^(extra_lse-M)
 * in units of Lref. Terms are then <= 2^39 units and 2^23 keys
 * (TKV_RABITQ_SELECT_MAX_N) sum below 2^63; a term of 2^40 units or more (the
 * bounds broken) marks the pair bad: read whole. Across bins the sums are
 * doubles, added in a fixed order (the scan's tree) with directed rounding
 * (N down, C up; the rule's products too), so the rule the device checks
 * implies the rule on the float exponentials, and every run gives the
 * same bits.
 *
 * Why per-bin units: one fixed point of 2^-40 relative to M (the first
 * version) has no relative precision for terms far below the largest u. In
 * safe mode a needle's kept l is e^(-2d) of its u (d ~ 20 nat on peaked
 * heads: l ~ 4e-18 < 2^-40 rounds to 0), while every dropped background key
 * (u ~ e^-80) rounds UP to one unit: the rule could only be met by keeping
 * almost every key (H200: 108938 kept where the host keeps 184). Here a
 * u term's rounding is < 4 e^(1/BPN) 2^-40 / p of itself (u >= e^g, and g
 * within 1/BPN nat of its bin's top, which set the units: only
 * the last bin, g < gmax - 64 nat, is coarser, its error < n 2^-38
 * e^(gmax-64-M) / p in all), and N's error is < n 2^-38 Lref, relative to
 * N < n 2^-38 max(1, (1-p)/p) wherever the rule holds (the Lref term is
 * in N, or dropped with u >= Lref, so that (1-p) N >= p Lref).
 */
#include "rabitq-select.cuh"
#include "ops.cuh"

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#define NB        TKV_CUDA_RQS_NBINS
#define BPN       ((float)TKV_RABITQ_TOPP_BPN)
#define CHUNK     8192 /* keys per block of the members kernel */
#define HCHUNK    4096 /* keys per block of the hist kernel: its bins' sums of 20-bit halves of terms
                          below 2^40 units stay below 2^32 */
#define HALF      20
#define HU        4    /* keys a thread of the hist and members kernels loads at once */
#define FX_BITS   40 /* a bin's largest possible term is <= 2^(FX_BITS-1) units */
#define E_MIN     (-149) /* bin exponents: floats are >= 2^-149; clamped, the units only coarsen */
#define E_MAX     300
#define LOG2E     1.4426950408889634

typedef unsigned long long u64;

struct rqs_state {
    unsigned gmax_o, umax_o, lo_o; /* ordered-bit maxima of g, s+d, s-d; 0 = none       */
    unsigned bad, m;               /* a non-finite estimate or a term past its units;
                                      members listed                                    */
    uint32_t bstar, partial, cnt;
    u64 nf;                        /* forced keys' l, units of Lref (bin_exps)           */
    double N, C;                   /* at the boundary: kept before it (rounded down),
                                      dropped after it (rounded up)                     */
    u64 kstar;                     /* the last member of the boundary bin taken          */
    float M, gmax;
    float thr;                     /* bin_threshold(the boundary, gmax): g >= thr is in a
                                      bin before it                                      */
    u64 hl[NB], hu[NB];            /* per bin, in the bin's own units (bin_exps)         */
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
/* 2^k, exactly, for -1022 <= k <= 1023 */
static __device__ __forceinline__ double pow2(int k) { return __longlong_as_double((long long)(k + 1023) << 52); }
/* x >= 0 in units of 2^(E-FX_BITS), rounded down / up; *over set past 2^FX_BITS
 * units (the bound that chose E broken). The scaling is exact (a power of 2). */
static __device__ __forceinline__ u64 fx_down(float x, int E, bool *over)
{
    const double v = __dmul_rn((double)x, pow2(FX_BITS - E));
    *over |= !(v <= (double)(1ull << FX_BITS));
    return __double2ull_rz(v);
}
static __device__ __forceinline__ u64 fx_up(float x, int E, bool *over)
{
    const double v = __dmul_rn((double)x, pow2(FX_BITS - E));
    *over |= !(v <= (double)(1ull << FX_BITS));
    return __double2ull_ru(v);
}
/* a sum of units 2^(E-FX_BITS) as a double: N's rounded down, C's up */
static __device__ __forceinline__ double fx_dbl_dn(u64 q, int E) { return __dmul_rn(__ull2double_rd(q), pow2(E - FX_BITS)); }
static __device__ __forceinline__ double fx_dbl_up(u64 q, int E) { return __dmul_rn(__ull2double_ru(q), pow2(E - FX_BITS)); }
/* the exponent of units for terms <= 2^x: 2^(E-1) >= 2^x, clamped (NaN, -inf: E_MIN) */
static __device__ __forceinline__ int exp_of(double x)
{
    return !(x > E_MIN) ? E_MIN : x > E_MAX ? E_MAX : (int)ceil(x) + 1;
}

/* the host's rq_topp_bin (runtime/rabitq/rabitq-impl.h) */
static __device__ __forceinline__ uint32_t bin_of(float g, float gmax)
{
    float d = __fmul_rn(__fsub_rn(gmax, g), BPN);
    d = d < (float)(NB - 1) ? d : (float)(NB - 1);
    return (uint32_t)(int32_t)(d > 0 ? d : 0);
}

/* The least g with bin_of(g, gmax) < B, as a float: NaN where no g has it,
 * -inf where every g does. bin_of does not increase with g (each of its
 * roundings is monotone), so {g : bin_of(g, gmax) < B} is {g : g >= thr}:
 * the output kernel compares g with thr where it would compute g's bin.
 * Bisection over the floats in order (ord_f): 32 steps, once a pair (a
 * search started at gmax - B / BPN, a few ulps off, was measured no
 * faster in the call: session 35). */
static __device__ float bin_threshold(uint32_t B, float gmax)
{
    if (B == 0 || !(bin_of(INFINITY, gmax) < B))
        return nanf("");
    if (bin_of(-INFINITY, gmax) < B)
        return -INFINITY;
    unsigned lo = ord_f(-INFINITY), hi = ord_f(INFINITY); /* below B: not at lo, at hi */
    while (hi - lo > 1) {
        const unsigned mid = lo + (hi - lo) / 2;
        if (bin_of(unord_f(mid), gmax) < B)
            hi = mid;
        else
            lo = mid;
    }
    return unord_f(hi);
}

/* A head's forced ranges in registers: read through the head's reference,
 * each use would load them again after every global store the compiler
 * cannot tell apart from them. */
struct rqs_forced {
    uint32_t n, fb[TKV_CUDA_RQS_MAX_FORCED], fe[TKV_CUDA_RQS_MAX_FORCED];
};
static __device__ __forceinline__ struct rqs_forced forced_of(const struct tkv_cuda_rqs_head &h)
{
    struct rqs_forced f;
    f.n = h.n_forced;
#pragma unroll
    for (int r = 0; r < TKV_CUDA_RQS_MAX_FORCED; r++)
        f.fb[r] = h.fb[r], f.fe[r] = h.fe[r];
    return f;
}
static __device__ __forceinline__ bool is_forced(const struct rqs_forced &f, uint32_t i)
{
    bool x = false;
#pragma unroll
    for (uint32_t r = 0; r < TKV_CUDA_RQS_MAX_FORCED; r++)
        x |= r < f.n && i >= f.fb[r] && i < f.fe[r];
    return x;
}
/* whether any forced range meets positions [lo, hi): where none does (most
 * of a long head), a kernel skips is_forced for a whole run of keys */
static __device__ __forceinline__ bool any_forced(const struct rqs_forced &f, uint32_t lo, uint32_t hi)
{
    bool x = false;
#pragma unroll
    for (uint32_t r = 0; r < TKV_CUDA_RQS_MAX_FORCED; r++)
        x |= r < f.n && f.fb[r] < hi && f.fe[r] > lo;
    return x;
}

/* the scalar topp_weights of the host (runtime/rabitq/rabitq.c), from the stored s and d */
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

/* The estimate kernels' rows of a pair: plain mode's one row (g) offset by
 * the thread's first key i0, so its stores index from there; safe mode's
 * three at their starts (three offset bases cost the safe instances the
 * registers of a block per multiprocessor: session 36) */
static __device__ __forceinline__ struct rqs_ptrs pair_rows(const struct tkv_cuda_rqs_params &pp,
                                                            const struct tkv_cuda_rqs_work &w, uint32_t pair, uint32_t i0)
{
    const struct rqs_ptrs pt = pair_ptrs(pp, w, pair);
    return {pt.g + i0, pt.s, pt.d};
}

#define RQS_EST_T   256
#define RQS_EST_KPT 4 /* keys a thread of the estimate kernels takes on long heads (the tensor-core
                         kernel: groups of 32 a warp) */

/* One key's outputs for one pair, from its scaled estimate s: g (and, safe,
 * s and d) to scratch at index i of pt (pair_rows), and the thread's
 * running maxima (go over candidates, uo of s + d, lo of s - d) and bad
 * flag. Both estimate kernels use it. */
template <bool SAFE>
static __device__ __forceinline__ void rqs_key_out(const struct tkv_cuda_rqs_params &pp, const struct rqs_ptrs &pt,
                                                   uint32_t i, float s, float d, bool forced, unsigned &go,
                                                   unsigned &uo, unsigned &lo, unsigned &bad)
{
    if (!SAFE) { /* d = 0: s + d = s - d = g = s (ord_f takes -0 as +0, as the sum did) */
        const bool bk = isnan(s) || s == INFINITY;
        pt.g[i] = s;
        bad |= bk;
        if (!bk) {
            const unsigned o = ord_f(s);
            uo = max(uo, o);
            if (!forced)
                go = max(go, o);
        }
        return;
    }
    const float sd = __fadd_rn(s, d);
    const bool bk = isnan(s) || s == INFINITY || !(d >= 0) || d == INFINITY || sd == INFINITY;
    const float g = __fadd_rn(sd, logf(__fadd_rn(pp.p, __fmul_rn(1.0f - pp.p, expf(__fmul_rn(-2.0f, d))))));
    pt.g[i] = g;
    pt.s[i] = s;
    pt.d[i] = d;
    bad |= bk;
    if (!bk) {
        uo = max(uo, ord_f(sd));
        lo = max(lo, ord_f(__fsub_rn(s, d)));
        if (!forced)
            go = max(go, ord_f(g));
    }
}

/* A warp's maxima of a pair to the block's table; after the last pair, the
 * block's to the pair's state, one atomic per (pair, value): the warps'
 * would queue thousands deep on the same few words. */
template <bool SAFE>
static __device__ __forceinline__ void rqs_warp_max(unsigned (*red)[TKV_CUDA_RQS_MAX_G][4], uint32_t j, unsigned go,
                                                    unsigned uo, unsigned lo, unsigned bad)
{
    go = __reduce_max_sync(0xffffffffu, go);
    uo = __reduce_max_sync(0xffffffffu, uo);
    lo = SAFE ? __reduce_max_sync(0xffffffffu, lo) : uo; /* plain: d = 0, s - d = s + d */
    bad = __reduce_or_sync(0xffffffffu, bad);
    if (threadIdx.x % 32 == 0) {
        unsigned *r = red[threadIdx.x / 32][j];
        r[0] = go, r[1] = uo, r[2] = lo, r[3] = bad;
    }
}
static __device__ __forceinline__ void rqs_block_max(const struct tkv_cuda_rqs_params &pp,
                                                     unsigned (*red)[TKV_CUDA_RQS_MAX_G][4],
                                                     const struct tkv_cuda_rqs_work &w, uint32_t h)
{
    tkv_pdl_trigger(); /* late: the hist kernel's CTAs would otherwise sit on the slots this grid's later waves need */
    __syncthreads();
    if (threadIdx.x < 4 * pp.G) {
        const uint32_t j = threadIdx.x / 4, v = threadIdx.x % 4;
        unsigned x = 0;
        for (uint32_t k = 0; k < RQS_EST_T / 32; k++)
            x = v == 3 ? x | red[k][j][v] : max(x, red[k][j][v]);
        struct rqs_state *st = (struct rqs_state *)w.state + h * pp.G + j;
        if (x)
            atomicMax(v == 0 ? &st->gmax_o : v == 1 ? &st->umax_o : v == 2 ? &st->lo_o : &st->bad, x);
    }
}

/* The head's G prepared queries into shared memory (then a barrier). */
static __device__ __forceinline__ void rqs_load_queries(struct tkv_rabitq_dev_query *q, const struct tkv_cuda_rqs_head &hd,
                                                        uint32_t G)
{
    for (uint32_t x = threadIdx.x; x < G * sizeof(struct tkv_rabitq_dev_query) / 4; x += blockDim.x)
        ((uint32_t *)q)[x] = ((const uint32_t *)hd.q)[x];
    __syncthreads();
}

/* 1: grid (keys / (RQS_EST_T KPT), n_heads); a thread takes the KPT keys
 * i0 + k RQS_EST_T. W > 0: every head's codes are W words (pp.code_words),
 * held in registers; 0: any width, through local memory (KPT 1). SAFE is
 * pp.safe. Several keys a thread share each query's loads from shared
 * memory and the pair's warp reductions. The maxima are order-free and
 * every key's arithmetic is the same, so the outputs do not depend on KPT. */
template <int W, bool SAFE, int KPT>
__global__ void __launch_bounds__(RQS_EST_T) rqs_estimate(struct tkv_cuda_rqs_params pp,
                                                          const __grid_constant__ struct tkv_cuda_rqs_heads heads,
                                                          struct tkv_cuda_rqs_work w)
{
    static_assert(W > 0 || KPT == 1, "codes of any width: one key a thread");
    __shared__ struct tkv_rabitq_dev_query q[TKV_CUDA_RQS_MAX_G];
    __shared__ unsigned red[RQS_EST_T / 32][TKV_CUDA_RQS_MAX_G][4]; /* per warp and pair: go, uo, lo, bad */
    tkv_pdl_wait(); /* (common.cuh's contract, in every kernel here: before any read of the stream's data) */
    const uint32_t h = blockIdx.y, i0 = blockIdx.x * RQS_EST_T * KPT + threadIdx.x;
    const struct tkv_cuda_rqs_head &hd = heads.h[h];
    rqs_load_queries(q, hd, pp.G);
    const struct rqs_forced fr = forced_of(hd);
    const struct tkv_cuda_rq_index &ix = hd.ix;
    const uint32_t words = W > 0 ? (uint32_t)W : ix.words;
    uint64_t cw[KPT][W > 0 ? W : TKV_CUDA_RQ_MAX_WORDS];
    float a[KPT], e[KPT], t[KPT];
    int32_t xb[KPT];
    bool valid[KPT], forced[KPT];
#pragma unroll
    for (int k = 0; k < KPT; k++) { /* every key's loads in flight before any is used */
        const uint32_t i = i0 + k * RQS_EST_T;
        valid[k] = i < hd.n;
        forced[k] = valid[k] && is_forced(fr, i);
        a[k] = e[k] = t[k] = 0, xb[k] = 0;
        if (valid[k]) {
#pragma unroll
            for (uint32_t x = 0; x < words; x++)
                cw[k][x] = ix.code[(size_t)i * words + x];
            a[k] = ix.a[i], t[k] = ix.t[i];
            if (SAFE)
                e[k] = ix.e[i];
            xb[k] = 2 * (int32_t)ix.pc[i] - (int32_t)ix.dim_pad;
        }
    }
    for (uint32_t j = 0; j < pp.G; j++) {
        const struct tkv_rabitq_dev_query &qq = q[j];
        const struct rqs_ptrs pk = pair_rows(pp, w, h * pp.G + j, SAFE ? 0 : i0);
        unsigned go = 0, uo = 0, lo = 0, bad = 0;
#pragma unroll
        for (int k = 0; k < KPT; k++)
            if (valid[k]) {
                const float s = __fmul_rn(pp.scale, tkv_cuda_rq_est<W>(cw[k], words, qq, xb[k], a[k], t[k]));
                const float d = SAFE ? __fmul_rn(pp.scale, tkv_cuda_rq_bound(a[k], e[k], qq)) : 0.0f;
                rqs_key_out<SAFE>(pp, pk, (SAFE ? i0 : 0) + k * RQS_EST_T, s, d, forced[k], go, uo, lo, bad);
            }
        rqs_warp_max<SAFE>(red, j, go, uo, lo, bad);
    }
    rqs_block_max(pp, red, w, h);
}

/* 1 on the tensor cores, for 128-bit codes (dim_pad 128, pp.code_words 2)
 * on sm_80 and later: the 16 popcounts a key and query head cost the
 * scalar kernel one cycle of its multiprocessor's popcount unit (16 a cycle:
 * ncu put that unit at 84% busy at 1M keys), where one
 * mma.m16n8k256.b1.and.popc counts 32 keys x 4 planes of a query (H100:
 * 37x the scalar rate, session 35). A warp takes GROUPS groups of 32 keys:
 * row r of A holds the codes of keys r (k < 128) and 16 + r (k >= 128) of
 * the group, column n of B plane n of the query against the first half
 * (n < 4) or plane n - 4 against the second, so D[r][n] is popcount(code &
 * plane) of one key and plane. Lane (g, t) = (lane / 4, lane % 4) holds
 * columns 2t, 2t + 1 of rows g and g + 8: two planes of one key per row;
 * it keeps the key of row g + 8 (t & 1) in half t / 2 and takes the other
 * two planes of it from lane ^ 1. The integers are the scalar kernel's,
 * so every output is. */
template <bool SAFE, int GROUPS>
__global__ void __launch_bounds__(RQS_EST_T) rqs_estimate_mma(struct tkv_cuda_rqs_params pp,
                                                              const __grid_constant__ struct tkv_cuda_rqs_heads heads,
                                                              struct tkv_cuda_rqs_work w)
{
#if __CUDA_ARCH__ >= 800
    __shared__ struct tkv_rabitq_dev_query q[TKV_CUDA_RQS_MAX_G];
    __shared__ unsigned red[RQS_EST_T / 32][TKV_CUDA_RQS_MAX_G][4];
    tkv_pdl_wait();
    const uint32_t h = blockIdx.y, lane = threadIdx.x % 32, gr = lane / 4, tg = lane % 4;
    const struct tkv_cuda_rqs_head &hd = heads.h[h];
    rqs_load_queries(q, hd, pp.G);
    const struct rqs_forced fr = forced_of(hd);
    const struct tkv_cuda_rq_index &ix = hd.ix;
    const uint32_t *code = (const uint32_t *)ix.code; /* 4 words a key */
    const uint32_t base = (blockIdx.x * (RQS_EST_T / 32) + threadIdx.x / 32) * 32 * GROUPS;
    const uint32_t mine = (tg / 2) * 16 + gr + 8 * (tg & 1); /* this lane's key in a group */
    uint32_t A[GROUPS][4];
    float a[GROUPS], e[GROUPS], t[GROUPS];
    int32_t xb[GROUPS];
    bool valid[GROUPS], forced[GROUPS];
#pragma unroll
    for (int k = 0; k < GROUPS; k++) {
        const uint32_t kb = base + k * 32, i = kb + mine;
#pragma unroll
        for (int r = 0; r < 4; r++) { /* rows gr, gr + 8 of the first half, then of the second */
            const uint32_t key = kb + gr + 8 * (r & 1) + 16 * (r >> 1);
            A[k][r] = key < hd.n ? code[(size_t)key * 4 + tg] : 0u;
        }
        /* (a key's scalars loaded as the scalar kernel loads them: a helper
         * shared by the two changed ptxas's register counts of measured
         * instances -- session 36, by reference, force-inlined: the safe
         * tensor-core one 60 -> 64, the scalar safe ones 48 -> 62 (W 1, 4
         * keys a thread: 5 -> 4 blocks a multiprocessor) and 32 -> 40 (W 4,
         * one key: 8 -> 6) -- and no device time was left to re-measure
         * them; sessions 35, 36. Session 38: returning the scalars by value
         * in a struct changed them too -- the scalar safe W 1 instance 48 ->
         * 56, the plain tensor-core one 62 -> 48 -- and the SASS) */
        valid[k] = i < hd.n;
        forced[k] = valid[k] && is_forced(fr, i);
        a[k] = e[k] = t[k] = 0, xb[k] = 0;
        if (valid[k]) {
            a[k] = ix.a[i], t[k] = ix.t[i];
            if (SAFE)
                e[k] = ix.e[i];
            xb[k] = 2 * (int32_t)ix.pc[i] - (int32_t)ix.dim_pad;
        }
    }
    for (uint32_t j = 0; j < pp.G; j++) {
        const struct tkv_rabitq_dev_query &qq = q[j];
        const uint32_t *plane = (const uint32_t *)qq.plane; /* plane p's word tg at p 2 QW + tg */
        const uint32_t b0 = gr < 4 ? plane[gr * 2 * TKV_RABITQ_DEV_QUERY_WORDS + tg] : 0u;
        const uint32_t b1 = gr >= 4 ? plane[(gr - 4) * 2 * TKV_RABITQ_DEV_QUERY_WORDS + tg] : 0u;
        const uint32_t i0 = base + mine; /* this lane's key of group k: i0 + 32 k */
        const struct rqs_ptrs pk = pair_rows(pp, w, h * pp.G + j, SAFE ? 0 : i0);
        unsigned go = 0, uo = 0, lo = 0, bad = 0;
#pragma unroll
        for (int k = 0; k < GROUPS; k++) {
            int c0, c1, c2, c3;
            asm("mma.sync.aligned.m16n8k256.row.col.s32.b1.b1.s32.and.popc {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                "{%8, %9}, {%10, %10, %10, %10};"
                : "=r"(c0), "=r"(c1), "=r"(c2), "=r"(c3)
                : "r"(A[k][0]), "r"(A[k][1]), "r"(A[k][2]), "r"(A[k][3]), "r"(b0), "r"(b1), "r"(0));
            const uint32_t sh = 2 * (tg & 1); /* planes 0, 1 (tg even) or 2, 3 (odd) */
            const uint32_t row_g = ((uint32_t)c0 + 2u * (uint32_t)c1) << sh, row_g8 = ((uint32_t)c2 + 2u * (uint32_t)c3) << sh;
            const uint32_t ip = ((tg & 1) ? row_g8 : row_g) + __shfl_xor_sync(0xffffffffu, (tg & 1) ? row_g : row_g8, 1);
            if (valid[k]) {
                const float s = __fmul_rn(pp.scale, tkv_cuda_rq_est_ip(ip, qq, xb[k], a[k], t[k]));
                const float d = SAFE ? __fmul_rn(pp.scale, tkv_cuda_rq_bound(a[k], e[k], qq)) : 0.0f;
                rqs_key_out<SAFE>(pp, pk, (SAFE ? i0 : 0) + k * 32, s, d, forced[k], go, uo, lo, bad);
            }
        }
        rqs_warp_max<SAFE>(red, j, go, uo, lo, bad);
    }
    rqs_block_max(pp, red, w, h);
#endif
}

/* The estimate's grid and instance: KPT keys a thread (or GROUPS of 32 a
 * warp) where that still leaves every multiprocessor 8 blocks or more
 * (measured: at 128K keys x 4 heads, 512 blocks of 4 keys a thread took
 * longer than 2048 of one); 128-bit codes on the tensor cores where the
 * device has them (pp.mma). */
template <int W, bool SAFE>
static cudaError_t rqs_estimate_launch(const struct tkv_cuda_rqs_params &gp, const struct tkv_cuda_rqs_heads &h,
                                       uint32_t n, const struct tkv_cuda_rqs_work &gw, bool pdl, cudaStream_t s)
{
    const uint32_t wide = tkv_cuda_blocks(gp.n_max, RQS_EST_T * RQS_EST_KPT), one = tkv_cuda_blocks(gp.n_max, RQS_EST_T);
    const bool many = (uint64_t)wide * n >= 8ull * gp.n_sm;
    if (W == 2 && gp.mma)
        return many ? tkv_cuda_launch(pdl, dim3(wide, n), RQS_EST_T, 0, s, rqs_estimate_mma<SAFE, RQS_EST_KPT>, gp, h, gw)
                    : tkv_cuda_launch(pdl, dim3(one, n), RQS_EST_T, 0, s, rqs_estimate_mma<SAFE, 1>, gp, h, gw);
    if (W > 0 && many)
        return tkv_cuda_launch(pdl, dim3(wide, n), RQS_EST_T, 0, s, rqs_estimate<W, SAFE, (W > 0 ? RQS_EST_KPT : 1)>, gp,
                               h, gw);
    return tkv_cuda_launch(pdl, dim3(one, n), RQS_EST_T, 0, s, rqs_estimate<W, SAFE, 1>, gp, h, gw);
}
template <int W>
static cudaError_t rqs_estimate_launch(const struct tkv_cuda_rqs_params &gp, const struct tkv_cuda_rqs_heads &h,
                                       uint32_t n, const struct tkv_cuda_rqs_work &gw, bool pdl, cudaStream_t s)
{
    return gp.safe ? rqs_estimate_launch<W, true>(gp, h, n, gw, pdl, s) : rqs_estimate_launch<W, false>(gp, h, n, gw, pdl, s);
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

/* A pair's units (the comment at the top): log2 of the bounds of bin b's
 * terms are a0 - b log2(e)/64 + lu_off (u) and min(that + ll_off, log2L)
 * (l). One function for every kernel, explicit roundings (no contraction),
 * so each computes the same exponents. */
struct rqs_units {
    float M, gmax;
    double a0, lu_off, ll_off, log2L;
    int Ef; /* forced keys' l and e^(extra_lse-M) */
};
static __device__ __forceinline__ struct rqs_units pair_units(const struct tkv_cuda_rqs_params &pp,
                                                              const struct rqs_state *st)
{
    struct rqs_units c;
    pair_max(pp, st, &c.M, &c.gmax);
    const float lo = st->lo_o ? unord_f(st->lo_o) : -INFINITY;
    const float lk = expf(__fsub_rn(lo, c.M)), le = expf(__fsub_rn(pp.extra_lse, c.M));
    c.log2L = log2((double)(lk > le ? lk : le)); /* -inf when both are 0: E_MIN */
    c.a0 = __dmul_rn(__dsub_rn((double)c.gmax, (double)c.M), LOG2E);
    c.lu_off = pp.safe ? -log2((double)pp.p) : 0.0;
    c.ll_off = pp.safe ? -log2(__dsub_rn(1.0, (double)pp.p)) : 0.0; /* p = 1: +inf, log2L bounds */
    c.Ef = exp_of(c.log2L);
    return c;
}
static __device__ __forceinline__ void bin_exps(const struct rqs_units &c, uint32_t b, int *El, int *Eu)
{
    const double a = __fma_rn(-(double)b, LOG2E / BPN, c.a0);
    const double lu = __dadd_rn(a, c.lu_off), ll = __dadd_rn(a, c.ll_off);
    *Eu = exp_of(lu);
    *El = exp_of(ll < c.log2L ? ll : c.log2L);
}

/* the rule (1-p) N >= p C, rounded against it */
static __device__ __forceinline__ bool rule(double lp, float p, double N, double C)
{
    return __dmul_rd(lp, N) >= __dmul_ru((double)p, C);
}

/* A key's u term, as its low and high HALF bits, and its count into bin b */
static __device__ __forceinline__ void hist_add_u(uint32_t b, uint32_t lo, uint32_t hi, uint32_t *hu_lo,
                                                  uint32_t *hu_hi, uint32_t *hc)
{
    atomicAdd(&hu_lo[b], lo);
    atomicAdd(&hu_hi[b], hi);
    atomicAdd(&hc[b], 1u);
}

/* A key's terms (l rounded down, u up, in bin b's units) into the block's
 * bins: each sum as two 32-bit sums of the terms' low and high HALF bits */
static __device__ __forceinline__ void hist_add(uint32_t b, u64 tl, u64 tu, uint32_t *hl_lo, uint32_t *hl_hi,
                                                uint32_t *hu_lo, uint32_t *hu_hi, uint32_t *hc, bool *over)
{
    const u64 lo_mask = (1ull << HALF) - 1;
    *over |= ((tl | tu) >> (2 * HALF)) != 0;
    hist_add_u(b, (uint32_t)(tu & lo_mask), (uint32_t)(tu >> HALF), hu_lo, hu_hi, hc);
    atomicAdd(&hl_lo[b], (uint32_t)(tl & lo_mask));
    atomicAdd(&hl_hi[b], (uint32_t)(tl >> HALF));
}

/* A plain-mode key's term (l = u) into the block's bins. In a bin whose l
 * and u units agree (El = Eu) the sums are u's, rounded up, and the count
 * of keys where rounding down gives one unit less (hl_lo; the fold takes
 * l's sum as u's less that count); elsewhere hist_add's. sc: the bin's
 * 2^(FX_BITS - E) as a float (bscale), or 0. The common case is done in
 * float arithmetic: u sc is u in units, exact (a power of two), and where
 * it is at least 2^23 (every term of every bin but the last, which are
 * >= 2^37 units) it is an integer, so both roundings are it; its 20-bit
 * halves come from adding 2^23 (the sums are those of the double path,
 * which takes the rest). */
static __device__ __forceinline__ void hist_add_plain(uint32_t b, float u, float sc, int2 E, uint32_t *hl_lo,
                                                      uint32_t *hl_hi, uint32_t *hu_lo, uint32_t *hu_hi, uint32_t *hc,
                                                      bool *over)
{
    static_assert(HALF == 20 && FX_BITS == 40, "the halves below");
    const float v = __fmul_rn(u, sc);
    if (v >= 0x1p23f && v < 0x1p40f) { /* an integer below 2^(2 HALF): tl = tu = v */
        const float t = __fadd_rd(__fmul_rn(v, 0x1p-20f), 0x1p23f); /* 2^23 + floor(v / 2^20), exactly */
        const float lo = __fmaf_rn(-__fsub_rn(t, 0x1p23f), 0x1p20f, v); /* v mod 2^20, exactly */
        hist_add_u(b, __float_as_uint(__fadd_rn(lo, 0x1p23f)) - 0x4b000000u, __float_as_uint(t) - 0x4b000000u, hu_lo,
                   hu_hi, hc);
        return;
    }
    const u64 tl = fx_down(u, E.x, over), tu = fx_up(u, E.y, over);
    if (E.x != E.y) {
        hist_add(b, tl, tu, hl_lo, hl_hi, hu_lo, hu_hi, hc, over);
        return;
    }
    *over |= (tu >> (2 * HALF)) != 0;
    hist_add_u(b, (uint32_t)(tu & ((1ull << HALF) - 1)), (uint32_t)(tu >> HALF), hu_lo, hu_hi, hc);
    if (tl != tu)
        atomicAdd(&hl_lo[b], 1u);
}

#define HIST_T   512
#define HIST_SUB 4 /* at most this many HCHUNK-key sub-chunks a block of the hist kernel walks */
#define HIST_BPT (NB / HIST_T) /* bins a thread of it folds */
static_assert(NB % HIST_T == 0, "the hist kernel's threads fold whole bins");

/* 2: grid (n_max / (HCHUNK sub), P), HIST_T threads, dynamic shared
 * memory NB * 20 bytes. The block's bins hold each sum as two 32-bit sums
 * of the terms' low and high HALF bits (shared-memory atomics on 64 bits
 * are compare-and-swap loops on sm_90; these are native): HCHUNK terms
 * below 2^(2 HALF) units keep both below 2^32, and a term at or past that
 * marks the pair bad anyway. After each sub-chunk of HCHUNK keys every
 * thread folds its HIST_BPT bins into 64-bit sums in registers, which go to
 * the pair's state at the end: the units and the global atomics are paid
 * once per `sub` (1 .. HIST_SUB) sub-chunks. The sums are integers, so
 * the grid's shape does not change them.
 *
 * Plain mode (SAFE false) takes a shorter way to the same sums: there l = u
 * and, in a bin whose l and u units agree (El = Eu: every bin but, where
 * the float rounding of Lref falls just so, the first), tl and tu are the
 * same value rounded down and up, so they differ by one unit where it is
 * not an integer number of units and not at all where it is (every term
 * of a bin but the last: u >= 2^(E-3), whose ulp is >= 2^(E-26), one unit
 * being 2^(E-40)). Such a bin sums tu and counts the keys where tl = tu - 1
 * (in hl_lo; hl_hi stays 0): its l sum is the u sum less that count. Three
 * shared atomics a key where there were five, and one product (the bin's
 * scale, 2^(FX_BITS - E), from a table). Its thread takes 4 consecutive
 * keys in one 16-byte load. (Session 36: the keys' loads, the units' two
 * products and the forced test had made ~70 instructions a key of this
 * issue-bound kernel.) */
template <bool SAFE>
__global__ void __launch_bounds__(HIST_T, 3) rqs_hist(struct tkv_cuda_rqs_params pp,
                                                   const __grid_constant__ struct tkv_cuda_rqs_heads heads, struct tkv_cuda_rqs_work w,
                                                   uint32_t sub)
{
    tkv_pdl_wait();
    tkv_pdl_trigger();
    extern __shared__ uint32_t sh[]; /* HIST_SMEM: one base for every table the keys index */
    uint32_t *hl_lo = sh, *hl_hi = sh + NB, *hu_lo = sh + 2 * NB, *hu_hi = sh + 3 * NB, *hc = sh + 4 * NB;
    int2 *bexp = (int2 *)(sh + 5 * NB); /* bin_exps of every bin: El, Eu */
    float *bscale = (float *)(sh + 7 * NB); /* plain: 2^(FX_BITS - E) where El = Eu = E and it is a float, else 0 */
    const uint32_t pair = blockIdx.y, h = pair / pp.G;
    const struct tkv_cuda_rqs_head &hd = heads.h[h];
    struct rqs_state *st = (struct rqs_state *)w.state + pair;
    __shared__ struct rqs_units cs;
    const uint32_t i0 = blockIdx.x * HCHUNK * sub;
    if (i0 >= hd.n)
        return;
    if (threadIdx.x == 0) /* the units once per block (doubles, logarithms) */
        cs = pair_units(pp, st);
    for (uint32_t b = threadIdx.x; b < 5 * NB; b += blockDim.x)
        sh[b] = 0;
    __syncthreads();
    const struct rqs_units c = cs;
    for (uint32_t b = threadIdx.x; b < NB; b += blockDim.x) {
        int El, Eu;
        bin_exps(c, b, &El, &Eu);
        bexp[b] = make_int2(El, Eu);
        if (!SAFE)
            bscale[b] = El == Eu && FX_BITS - Eu <= 127 ? (float)pow2(FX_BITS - Eu) : 0.0f;
    }
    __syncthreads();
    const struct rqs_forced fr = forced_of(hd);
    const struct rqs_ptrs pt = pair_ptrs(pp, w, pair);
    const uint32_t iend = min(i0 + HCHUNK * sub, hd.n);
    u64 nf = 0, al[HIST_BPT], au[HIST_BPT]; /* the thread's bins threadIdx.x + k HIST_T */
    uint32_t ac[HIST_BPT];
#pragma unroll
    for (int k = 0; k < HIST_BPT; k++)
        al[k] = au[k] = 0, ac[k] = 0;
    bool over = false;
    for (uint32_t c0 = i0; c0 < iend; c0 += HCHUNK) {
        const uint32_t i1 = min(c0 + HCHUNK, iend);
        const bool some_forced = any_forced(fr, c0, i1);
        if (SAFE)
            for (uint32_t i = c0 + threadIdx.x; i < i1; i += HU * blockDim.x) {
                float g[HU], s[HU], d[HU]; /* HU keys' loads in flight before any is used */
#pragma unroll
                for (int x = 0; x < HU; x++) {
                    const uint32_t k = i + x * blockDim.x;
                    g[x] = k < i1 ? pt.g[k] : 0.0f;
                    s[x] = k < i1 ? pt.s[k] : 0.0f;
                    d[x] = k < i1 ? pt.d[k] : 0.0f;
                }
#pragma unroll
                for (int x = 0; x < HU; x++) {
                    const uint32_t k = i + x * blockDim.x;
                    if (k >= i1)
                        break;
                    float l, u;
                    key_lu(s[x], d[x], c.M, true, &l, &u);
                    if (some_forced && is_forced(fr, k)) {
                        nf += fx_down(l, c.Ef, &over);
                        continue;
                    }
                    const uint32_t b = bin_of(g[x], c.gmax);
                    hist_add(b, fx_down(l, bexp[b].x, &over), fx_up(u, bexp[b].y, &over), hl_lo, hl_hi, hu_lo, hu_hi,
                             hc, &over);
                }
            }
        else { /* 4 consecutive keys a thread (one 16-byte load: pp.n_max is a multiple of 4), 2 such in flight */
            auto key = [&](float g, uint32_t k) {
                const float u = expf(__fsub_rn(g, c.M)); /* key_lu's l = u (plain: d = 0) */
                if (some_forced && is_forced(fr, k)) {
                    nf += fx_down(u, c.Ef, &over);
                    return;
                }
                const uint32_t b = bin_of(g, c.gmax);
                hist_add_plain(b, u, bscale[b], bexp[b], hl_lo, hl_hi, hu_lo, hu_hi, hc, &over);
            };
            for (uint32_t i = c0 + 4 * threadIdx.x; i < i1; i += 2 * 4 * HIST_T) {
                float4 g4[2];
#pragma unroll
                for (int x = 0; x < 2; x++) {
                    const uint32_t k = i + x * 4 * HIST_T;
                    g4[x] = k < i1 ? *(const float4 *)(pt.g + k) : make_float4(0, 0, 0, 0);
                }
                if (i + 4 * HIST_T + 4 <= i1) /* both whole (all but a head's last sub-chunk) */
#pragma unroll
                    for (int x = 0; x < 2; x++) {
                        const uint32_t k = i + x * 4 * HIST_T;
                        key(g4[x].x, k), key(g4[x].y, k + 1), key(g4[x].z, k + 2), key(g4[x].w, k + 3);
                    }
                else
#pragma unroll
                    for (int x = 0; x < 2; x++) {
                        const uint32_t k = i + x * 4 * HIST_T;
                        const float gx[4] = {g4[x].x, g4[x].y, g4[x].z, g4[x].w};
                        for (int e = 0; e < 4 && k + e < i1; e++)
                            key(gx[e], k + e);
                    }
            }
        }
        __syncthreads(); /* the sub-chunk's bins complete: fold mine, empty them */
#pragma unroll
        for (int k = 0; k < HIST_BPT; k++) {
            const uint32_t b = threadIdx.x + k * HIST_T;
            const u64 su = ((u64)hu_hi[b] << HALF) + hu_lo[b];
            const int2 E = bexp[b];
            al[k] += !SAFE && E.x == E.y ? su - hl_lo[b] : ((u64)hl_hi[b] << HALF) + hl_lo[b];
            au[k] += su;
            ac[k] += hc[b];
            hl_lo[b] = hl_hi[b] = hu_lo[b] = hu_hi[b] = hc[b] = 0;
        }
        __syncthreads();
    }
    if (nf)
        atomicAdd(&st->nf, nf);
    if (over) /* cannot happen (the bounds above): read the head whole */
        atomicOr(&st->bad, 1u);
#pragma unroll
    for (int k = 0; k < HIST_BPT; k++)
        if (ac[k]) {
            const uint32_t b = threadIdx.x + k * HIST_T;
            atomicAdd(&st->hl[b], al[k]);
            atomicAdd(&st->hu[b], au[k]);
            atomicAdd(&st->hc[b], ac[k]);
        }
}

#define SCAN_T (NB < 1024 ? NB : 1024)
#define SCAN_B (NB / SCAN_T)
static_assert((NB & (NB - 1)) == 0 && NB >= 32 && NB / BPN == 64.0f, "bins: a power of two, 64 nats in all");

/* The outputs of a pair whose kept set is whole bins (no boundary bin cut:
 * none, or coarse), or that is bad. */
static __device__ void whole_bins_out(const struct rqs_state *st, const struct tkv_cuda_rqs_work &w, uint32_t pair)
{
    if (st->bad)
        w.n_chosen[pair] = UINT32_MAX, w.mass[pair] = nan("");
    else
        w.n_chosen[pair] = st->cnt, w.mass[pair] = st->N + st->C > 0 ? st->N / (st->N + st->C) : 1.0;
}

/* 3: one block of SCAN_T threads per pair; thread t owns bins SCAN_B t ..
 * Each bin's sums become doubles (l down, u up); N before a bin is nf plus
 * an exclusive prefix, C after it a suffix, all added rounding down (N) or
 * up (C) in a fixed tree, so the boundary and the N, C stored with it are
 * the same bits on every run. */
__global__ void rqs_scan(struct tkv_cuda_rqs_params pp, struct tkv_cuda_rqs_work w)
{
    __shared__ double sl[SCAN_T], su[SCAN_T];
    __shared__ uint32_t sc[SCAN_T];
    __shared__ uint32_t bmin;
    struct rqs_state *st = (struct rqs_state *)w.state + blockIdx.x;
    tkv_pdl_wait();
    tkv_pdl_trigger();
    const uint32_t t = threadIdx.x;
    const struct rqs_units un = pair_units(pp, st);
    double bl[SCAN_B], bu[SCAN_B], l = 0, u = 0;
    uint32_t c = 0;
    for (int k = 0; k < SCAN_B; k++) {
        const uint32_t b = t * SCAN_B + k;
        int El, Eu;
        bin_exps(un, b, &El, &Eu);
        bl[k] = fx_dbl_dn(st->hl[b], El), bu[k] = fx_dbl_up(st->hu[b], Eu);
        l = __dadd_rd(l, bl[k]), u = __dadd_ru(u, bu[k]), c += st->hc[b];
    }
    sl[t] = l, su[t] = u, sc[t] = c;
    if (t == 0)
        bmin = UINT32_MAX;
    __syncthreads();
    /* inclusive scans: sl, sc prefix (ascending); su suffix (descending) */
    for (uint32_t o = 1; o < SCAN_T; o <<= 1) {
        const double al = t >= o ? sl[t - o] : 0, au = t + o < SCAN_T ? su[t + o] : 0;
        const uint32_t ac = t >= o ? sc[t - o] : 0;
        __syncthreads();
        sl[t] = __dadd_rd(sl[t], al), su[t] = __dadd_ru(su[t], au), sc[t] += ac;
        __syncthreads();
    }
    bool over = false;
    const u64 nfq = st->nf + fx_down(expf(__fsub_rn(pp.extra_lse, un.M)), un.Ef, &over); /* (<= Lref: no over) */
    const double nf = fx_dbl_dn(nfq, un.Ef);
    const double lp = 1 - (double)pp.p;
    const double ctot = su[0];
    const uint32_t ncand = sc[SCAN_T - 1];
    const bool none = st->bad || ncand == 0 || rule(lp, pp.p, nf, ctot);
    /* N before my bins: nf + the threads before mine; C after bin k of mine */
    double Nb = t ? __dadd_rd(nf, sl[t - 1]) : nf, Ca[SCAN_B];
    Ca[SCAN_B - 1] = t + 1 < SCAN_T ? su[t + 1] : 0.0;
    for (int k = SCAN_B - 2; k >= 0; k--)
        Ca[k] = __dadd_ru(Ca[k + 1], bu[k + 1]);
    uint32_t cb = sc[t] - c, mine = UINT32_MAX;
    double mN = 0, mC = 0, mL = 0;
    if (!none)
        for (int k = 0; k < SCAN_B; k++) {
            const uint32_t b = t * SCAN_B + k;
            if (st->hc[b] && rule(lp, pp.p, __dadd_rd(Nb, bl[k]), Ca[k])) {
                mine = b, mN = Nb, mC = Ca[k], mL = bl[k];
                atomicMin(&bmin, b);
                break;
            }
            Nb = __dadd_rd(Nb, bl[k]);
            cb += st->hc[b];
        }
    __syncthreads();
    if (none) {
        if (t == 0) {
            st->bstar = 0, st->partial = 0, st->cnt = 0, st->N = nf, st->C = ctot, st->M = un.M, st->gmax = un.gmax;
            st->thr = bin_threshold(0, un.gmax);
            if (pp.coarse)
                whole_bins_out(st, w, blockIdx.x);
        }
        return;
    }
    /* the owner: N and C at the start of the boundary bin (exactly the
     * values its rule was checked with, which rqs_refine continues from);
     * coarse: after it, the bin kept whole (its rule, checked above).
     * A bin always qualifies: after the last non-empty one, C = 0. */
    if (mine == bmin) {
        st->M = un.M, st->gmax = un.gmax;
        if (pp.coarse) {
            st->bstar = bmin + 1, st->partial = 0, st->cnt = cb + st->hc[bmin], st->N = __dadd_rd(mN, mL), st->C = mC;
            whole_bins_out(st, w, blockIdx.x);
        } else {
            st->bstar = bmin, st->partial = 1, st->cnt = cb, st->N = mN, st->C = mC;
        }
        st->thr = bin_threshold(st->bstar, un.gmax);
    }
}

/* 4: grid (n_max / CHUNK, P) */
__global__ void rqs_members(struct tkv_cuda_rqs_params pp, const __grid_constant__ struct tkv_cuda_rqs_heads heads,
                            struct tkv_cuda_rqs_work w)
{
    tkv_pdl_wait();
    tkv_pdl_trigger();
    const uint32_t pair = blockIdx.y;
    const struct tkv_cuda_rqs_head &hd = heads.h[pair / pp.G];
    struct rqs_state *st = (struct rqs_state *)w.state + pair;
    if (!st->partial)
        return;
    const struct rqs_forced fr = forced_of(hd);
    const struct rqs_ptrs pt = pair_ptrs(pp, w, pair);
    const uint32_t i1 = min((blockIdx.x + 1) * CHUNK, hd.n), bstar = st->bstar;
    const float gmax = st->gmax;
    uint32_t *list = w.list + (size_t)pair * pp.n_max;
    const uint32_t lane = threadIdx.x % 32;
    /* whole warps walk the chunk (the ballot), HU keys loaded at once; a
     * warp's members take their places with one atomic */
    for (uint32_t i0 = blockIdx.x * CHUNK; i0 < i1; i0 += HU * blockDim.x) {
        float g[HU];
#pragma unroll
        for (int x = 0; x < HU; x++) {
            const uint32_t i = i0 + x * blockDim.x + threadIdx.x;
            g[x] = i < i1 ? pt.g[i] : 0.0f;
        }
#pragma unroll
        for (int x = 0; x < HU; x++) {
            const uint32_t i = i0 + x * blockDim.x + threadIdx.x;
            const bool take = i < i1 && bin_of(g[x], gmax) == bstar && !is_forced(fr, i);
            const unsigned bal = __ballot_sync(0xffffffffu, take);
            if (!bal)
                continue;
            uint32_t base = 0;
            if (lane == 0)
                base = atomicAdd(&st->m, (uint32_t)__popc(bal));
            base = __shfl_sync(0xffffffffu, base, 0);
            if (take)
                list[base + __popc(bal & ((1u << lane) - 1))] = i;
        }
    }
}

#define REF_T 256
#define RCAP  2048 /* boundary-bin members the refine kernel keeps in shared memory */

/* The warp's terms added into their digits' sums (dg 256: none), one atomic
 * per (digit, sum) and warp: the members of a boundary bin share their
 * leading digits, and 64-bit shared-memory atomics are compare-and-swap
 * loops, which lanes on the same word would take one at a time. Integer
 * sums: the grouping does not change them. All 32 lanes call it. */
static __device__ __forceinline__ void digit_add(uint32_t dg, u64 tl, u64 tu, u64 *dl, u64 *du, uint32_t *dc)
{
    const unsigned peers = __match_any_sync(0xffffffffu, dg), lane = threadIdx.x % 32;
    u64 sl = 0, su = 0;
    for (int src = 0; src < 32; src++) {
        const u64 vl = __shfl_sync(0xffffffffu, tl, src), vu = __shfl_sync(0xffffffffu, tu, src);
        if ((peers >> src) & 1)
            sl += vl, su += vu;
    }
    if (dg < 256 && lane == (unsigned)__ffs(peers) - 1) {
        atomicAdd(&dl[dg], sl);
        atomicAdd(&du[dg], su);
        atomicAdd(&dc[dg], (uint32_t)__popc(peers));
    }
}

/* 5: one block of REF_T threads per pair: the last key taken (kstar). The
 * boundary bin's taken l (ni) and dropped u (ci) stay integers in the bin's
 * units, checked as N + ni, C + ci with N, C rqs_scan's: at a region's end
 * that is the same sum, the same bits, as the check that chose the region
 * (at the first pass the scan's own), so "the rule holds at its end" is
 * exact. */
/* Member i's terms in the boundary bin's units: l rounded down (*tl), u up
 * (*tu); *over set where one does not fit. */
static __device__ __forceinline__ void member_terms(const struct tkv_cuda_rqs_params &pp, const struct rqs_ptrs &pt,
                                                    uint32_t i, float M, int El, int Eu, bool *over, u64 *tl, u64 *tu)
{
    const float g = pt.g[i];
    float l, u;
    key_lu(pp.safe ? pt.s[i] : g, pp.safe ? pt.d[i] : 0.0f, M, pp.safe, &l, &u);
    *tl = fx_down(l, El, over), *tu = fx_up(u, Eu, over);
}

__global__ void rqs_refine(struct tkv_cuda_rqs_params pp, struct tkv_cuda_rqs_work w)
{
    typedef cub::BlockScan<u64, REF_T> Scan;
    typedef cub::BlockReduce<u64, REF_T> Reduce;
    __shared__ union {
        typename Scan::TempStorage scan;
        typename Reduce::TempStorage reduce;
    } tmp;
    __shared__ u64 dl[256], du[256], sl[256]; /* sl[d]: the l of digits above d */
    tkv_pdl_wait();
    tkv_pdl_trigger();
    __shared__ uint32_t dc[256], sc[256];     /* sc[d]: the members of digits above d */
    __shared__ int dstar;
    __shared__ u64 sni, sci, skey, kand, kor;
    __shared__ uint32_t scnt, shere;
    static_assert(REF_T == 256, "one thread per digit");
    const uint32_t pair = blockIdx.x, t = threadIdx.x;
    struct rqs_state *st = (struct rqs_state *)w.state + pair;
    const struct rqs_ptrs pt = pair_ptrs(pp, w, pair);
    const uint32_t *list = w.list + (size_t)pair * pp.n_max;
    const double lp = 1 - (double)pp.p;
    if (st->bad || !st->partial) {
        if (t == 0)
            whole_bins_out(st, w, pair);
        return;
    }
    const uint32_t m = st->m;
    const struct rqs_units un = pair_units(pp, st);
    const float M = un.M;
    const double N0 = st->N, C0 = st->C;
    int El, Eu;
    bin_exps(un, st->bstar, &El, &Eu);
    bool over = false; /* (the hist kernel's terms, which did not overflow) */
    if (t == 0)
        sni = 0, sci = 0, scnt = st->cnt, skey = 0;
    /* up to RCAP members' keys and terms kept in shared memory for the
     * passes (each would gather them again and redo the exponentials) */
    extern __shared__ u64 cache[]; /* [3][RCAP]: K, l's term, u's term */
    const bool cached = m <= RCAP;
    /* the digits every member shares: a pass over them would take that
     * digit whole and leave the sums as they are, so they are skipped */
    u64 ka = ~0ull, ko = 0;
    for (uint32_t x = t; x < m; x += REF_T) {
        const uint32_t i = list[x];
        const u64 K = key_of(pt.g[i], i);
        ka &= K, ko |= K;
        if (cached) {
            cache[x] = K;
            member_terms(pp, pt, i, M, El, Eu, &over, &cache[RCAP + x], &cache[2 * RCAP + x]);
        }
    }
    ka = Reduce(tmp.reduce).Reduce(ka, [](u64 x, u64 y) { return x & y; });
    __syncthreads();
    ko = Reduce(tmp.reduce).Reduce(ko, [](u64 x, u64 y) { return x | y; });
    if (t == 0)
        kand = ka, kor = ko;
    __syncthreads();
    u64 prefix = 0, mask = 0;
    int shift = 56;
    for (; shift > 0 && !(((kand ^ kor) >> shift) & 255u); shift -= 8)
        prefix |= kand & ((u64)255 << shift), mask |= (u64)255 << shift;
    bool found = false;
    for (; shift >= 0 && !found; shift -= 8) {
        dl[t] = du[t] = 0, dc[t] = 0;
        if (t == 0)
            dstar = -1;
        __syncthreads();
        for (uint32_t x0 = 0; x0 < m; x0 += REF_T) { /* whole warps: digit_add */
            const uint32_t x = x0 + t;
            uint32_t dg = 256; /* none */
            u64 tl = 0, tu = 0;
            if (x < m && cached) {
                const u64 K = cache[x];
                if ((K & mask) == prefix)
                    dg = (uint32_t)(K >> shift) & 255u, tl = cache[RCAP + x], tu = cache[2 * RCAP + x];
            } else if (x < m) {
                const uint32_t i = list[x];
                const u64 K = key_of(pt.g[i], i);
                if ((K & mask) == prefix) {
                    dg = (uint32_t)(K >> shift) & 255u;
                    member_terms(pp, pt, i, M, El, Eu, &over, &tl, &tu);
                }
            }
            digit_add(dg, tl, tu, dl, du, dc);
        }
        __syncthreads();
        /* digit t: taken after the digits above it (their l, Lb), before
         * those below (their u, Ua); integer sums: any order gives them */
        u64 Ua, Lb, rev;
        Scan(tmp.scan).ExclusiveSum(du[t], Ua);
        __syncthreads();
        Scan(tmp.scan).ExclusiveSum(dl[255 - t], rev); /* thread t: digits above 255 - t */
        sl[255 - t] = rev;
        __syncthreads();
        Scan(tmp.scan).ExclusiveSum((u64)dc[255 - t], rev);
        sc[255 - t] = (uint32_t)rev;
        __syncthreads();
        Lb = sl[t];
        if (dc[t] && rule(lp, pp.p, __dadd_rd(N0, fx_dbl_dn(sni + Lb + dl[t], El)),
                          __dadd_ru(C0, fx_dbl_up(sci + Ua, Eu))))
            atomicMax(&dstar, (int)t);
        __syncthreads();
        const int ds = dstar;
        if (ds < 0) /* cannot happen: the rule holds at the region's end */
            break;
        if ((int)t == ds)
            sni += Lb, sci += Ua, scnt += sc[t], shere = dc[t];
        __syncthreads();
        prefix |= (u64)ds << shift;
        mask |= (u64)255 << shift;
        if (shere == 1) { /* one member left: find it */
            for (uint32_t x = t; x < m; x += REF_T) {
                const u64 K = cached ? cache[x] : key_of(pt.g[list[x]], list[x]);
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
        whole_bins_out(st, w, pair);
    }
    if (t == 0 && found) {
        u64 tl, tu; /* (the last key's l joins N; its u is not in C) */
        member_terms(pp, pt, ~(uint32_t)skey, M, El, Eu, &over, &tl, &tu);
        const double N = __dadd_rd(N0, fx_dbl_dn(sni + tl, El)), C = __dadd_ru(C0, fx_dbl_up(sci, Eu));
        st->kstar = skey;
        w.n_chosen[pair] = scnt + 1;
        w.mass[pair] = N + C > 0 ? N / (N + C) : 1.0;
    }
}

/* Groups of W positions (W dividing 32) of one bitmap word: a group with a
 * set bit set whole, nothing at or past n (the word holds positions
 * [base, base + 32)). */
static __device__ __forceinline__ unsigned widen_word(unsigned bits, uint32_t W, uint32_t base, uint32_t n)
{
    const unsigned ones = W == 32 ? 0xffffffffu : (1u << W) - 1;
    unsigned out = 0;
    for (uint32_t b = 0; b < 32; b += W)
        if (bits >> b & ones)
            out |= ones << b;
    return base >= n ? 0u : n - base >= 32 ? out : out & ((1u << (n - base)) - 1);
}

#define RQS_OUT_T 256
#define RQS_OUT_K 128 /* keys a warp of the output kernel takes at a time: 4 consecutive a lane */

/* 6: grid (words / (RQS_OUT_T / 32 * 4), n_heads): bit i of head h = any of
 * its G pairs keeps i; widened here to groups of pp.whole when whole
 * divides 32 (else kernel 7 widens). A warp takes RQS_OUT_K keys (4 bitmap
 * words) at a time, a lane 4 consecutive keys of a pair in one 16-byte
 * load (pp.n_max is a multiple of 4), and walks spans sp, sp + the grid's
 * warps, ...: the pairs' boundaries, the forced ranges and the widening
 * mask are set up once per thread. (Session 36: a key a lane and a ballot
 * per word had made the kernel bound by its instructions.) */
__global__ void __launch_bounds__(RQS_OUT_T) rqs_output(struct tkv_cuda_rqs_params pp,
                                                        const __grid_constant__ struct tkv_cuda_rqs_heads heads,
                                                        struct tkv_cuda_rqs_work w)
{
    /* the G pairs' boundaries, read once per block: a key is kept by pair
     * j where g >= thr (a bin before the boundary) or, in the boundary bin
     * cut key by key, where its key is >= the last one taken (such a key's
     * g is in a bin up to the boundary: its own, or an earlier one) */
    __shared__ struct {
        u64 kstar;
        float thr;
        uint32_t partial;
    } ps[TKV_CUDA_RQS_MAX_G];
    __shared__ uint32_t any_bad, any_partial;
    const uint32_t h = blockIdx.y, G = pp.G, lane = threadIdx.x % 32;
    tkv_pdl_wait();
    tkv_pdl_trigger();
    const struct tkv_cuda_rqs_head &hd = heads.h[h];
    if (threadIdx.x == 0)
        any_bad = 0, any_partial = 0;
    __syncthreads();
    if (threadIdx.x < G) {
        const struct rqs_state *st = (const struct rqs_state *)w.state + h * G + threadIdx.x;
        ps[threadIdx.x].kstar = st->kstar, ps[threadIdx.x].thr = st->thr, ps[threadIdx.x].partial = st->partial;
        if (st->bad)
            any_bad = 1;
        if (st->partial)
            any_partial = 1;
    }
    __syncthreads();
    const uint32_t n = hd.n, W = pp.whole;
    const struct rqs_forced fr = forced_of(hd);
    const float *const g0 = pair_ptrs(pp, w, h * G).g; /* pair (h, j)'s: g0 + j n_max */
    uint32_t *const row = w.bitmap + (size_t)hd.row * pp.words;
    /* a bad pair reads the head whole; key_of only where a boundary bin was cut */
    const bool widen = W > 1 && 32 % W == 0, all = any_bad != 0, cut = any_partial != 0;
    const uint32_t warps = gridDim.x * (blockDim.x / 32), spans = (pp.words + RQS_OUT_K / 32 - 1) / (RQS_OUT_K / 32);
    for (uint32_t sp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; sp < spans; sp += warps) {
        const uint32_t i = sp * RQS_OUT_K + 4 * lane; /* keys i .. i + 3 */
        unsigned nib = 0;                             /* bit e: key i + e kept */
        if (i < n) {
            float4 g[TKV_CUDA_RQS_MAX_G]; /* the G pairs' loads in flight at once (estimate wrote every key's) */
#pragma unroll
            for (uint32_t j = 0; j < TKV_CUDA_RQS_MAX_G; j++)
                g[j] = j < G ? *(const float4 *)(g0 + (size_t)j * pp.n_max + i) : make_float4(0, 0, 0, 0);
#pragma unroll
            for (uint32_t j = 0; j < TKV_CUDA_RQS_MAX_G; j++) {
                if (j >= G)
                    break;
                const float t = ps[j].thr;
                nib |= (unsigned)(g[j].x >= t) | (unsigned)(g[j].y >= t) << 1 | (unsigned)(g[j].z >= t) << 2 |
                       (unsigned)(g[j].w >= t) << 3;
                if (cut && ps[j].partial) {
                    const u64 ks = ps[j].kstar;
                    nib |= (unsigned)(key_of(g[j].x, i) >= ks) | (unsigned)(key_of(g[j].y, i + 1) >= ks) << 1 |
                           (unsigned)(key_of(g[j].z, i + 2) >= ks) << 2 | (unsigned)(key_of(g[j].w, i + 3) >= ks) << 3;
                }
            }
            if (any_forced(fr, i, i + 4))
                for (uint32_t e = 0; e < 4; e++)
                    nib |= (unsigned)is_forced(fr, i + e) << e;
            if (all)
                nib = 0xfu;
            if (n - i < 4) /* keys past n: none */
                nib &= (1u << (n - i)) - 1;
        }
        /* word q of the span: lanes 8q .. 8q + 7, 4 bits each; lane q < 4 writes it */
        const unsigned part = nib << (4 * (lane % 8));
        unsigned mine = 0;
#pragma unroll
        for (uint32_t q = 0; q < 4; q++) {
            const unsigned wq = __reduce_or_sync(0xffffffffu, lane / 8 == q ? part : 0u);
            mine = lane == q ? wq : mine;
        }
        const uint32_t wd = sp * 4 + lane;
        if (lane < 4 && wd < pp.words)
            row[wd] = widen ? widen_word(mine, W, wd * 32, n) : mine;
    }
}

/* 7: grid (blocks / 256, n_heads): a block of `whole` positions with a kept
 * key is kept whole. Threads only set bits of their own block, so what each
 * reads is kernel 6's output. */
__global__ void rqs_whole(struct tkv_cuda_rqs_params pp, const __grid_constant__ struct tkv_cuda_rqs_heads heads,
                          struct tkv_cuda_rqs_work w)
{
    tkv_pdl_wait();
    tkv_pdl_trigger();
    const uint32_t h = blockIdx.y, b = blockIdx.x * blockDim.x + threadIdx.x, W = pp.whole;
    const uint32_t n = heads.h[h].n;
    if ((uint64_t)b * W >= n)
        return;
    const uint32_t b0 = b * W, b1 = min(b0 + W, n);
    uint32_t *row = w.bitmap + (size_t)heads.h[h].row * pp.words;
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

/* dynamic shared memory: rqs_hist's bins (hl and hu as two 32-bit halves
 * each, hc), rqs_refine's member cache (set once: tkv_cuda_rqs_init) */
#define HIST_SMEM (NB * 8 * sizeof(uint32_t))
#define REF_SMEM  (3 * RCAP * sizeof(u64))

cudaError_t tkv_cuda_rqs_init(bool *mma)
{
    /* the tensor-core estimate has a body only where compiled for sm_80 or
     * later: a build for older targets JIT-compiled on a newer device has
     * an empty one, which must not run */
    cudaFuncAttributes fa;
    *mma = cudaFuncGetAttributes(&fa, rqs_estimate_mma<false, 1>) == cudaSuccess && fa.ptxVersion >= 80;
    (void)cudaGetLastError();
    TKV_CUDA_TRY(cudaFuncSetAttribute(rqs_hist<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)HIST_SMEM));
    TKV_CUDA_TRY(cudaFuncSetAttribute(rqs_hist<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)HIST_SMEM));
    return cudaFuncSetAttribute(rqs_refine, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)REF_SMEM);
}

cudaError_t tkv_cuda_rqs_clear(const struct tkv_cuda_rqs_work *w, uint32_t P, bool pdl, cudaStream_t s)
{
    return tkv_cuda_fill32((uint32_t *)w->state, 0, tkv_cuda_rqs_state_bytes(P) / 4, pdl, s);
}

cudaError_t tkv_cuda_rqs_run(const struct tkv_cuda_rqs_params *pp, const struct tkv_cuda_rqs_heads *hs, uint32_t h0,
                             uint32_t n, const struct tkv_cuda_rqs_work *w, bool pdl, cudaStream_t s)
{
    if (pp->n_heads == 0 || pp->G == 0 || pp->G > TKV_CUDA_RQS_MAX_G || pp->n_max == 0 ||
        pp->n_max != tkv_cuda_rqs_row_len(pp->n_max) ||
        pp->words * 32ull < pp->n_max || n == 0 || n > TKV_CUDA_RQS_GROUP || h0 + n > pp->n_heads)
        return cudaErrorInvalidValue;
    /* the group's pairs are the call's [base, base + Pg): its own slices of the work */
    struct tkv_cuda_rqs_params gp = *pp;
    gp.n_heads = n;
    const size_t base = (size_t)h0 * pp->G;
    const struct tkv_cuda_rqs_work gw = {(struct rqs_state *)w->state + base,
                                         w->scratch + 3 * base * pp->n_max,
                                         w->list + base * pp->n_max,
                                         w->mass + base,
                                         w->n_chosen + base,
                                         w->bitmap};
    const struct tkv_cuda_rqs_heads &h = *hs;
    const uint32_t Pg = n * gp.G, chunks = tkv_cuda_blocks(gp.n_max, CHUNK);
    switch (gp.code_words) { /* dim_pad / 64, dim_pad a power of two */
    case 1: TKV_CUDA_TRY(rqs_estimate_launch<1>(gp, h, n, gw, pdl, s)); break;
    case 2: TKV_CUDA_TRY(rqs_estimate_launch<2>(gp, h, n, gw, pdl, s)); break;
    case 4: TKV_CUDA_TRY(rqs_estimate_launch<4>(gp, h, n, gw, pdl, s)); break;
    case 8: TKV_CUDA_TRY(rqs_estimate_launch<8>(gp, h, n, gw, pdl, s)); break;
    default: TKV_CUDA_TRY(rqs_estimate_launch<0>(gp, h, n, gw, pdl, s)); break;
    }
    /* hist: HIST_SUB sub-chunks a block where that still gives every
     * multiprocessor a block, fewer where it would not (short contexts;
     * one query a head: a quarter of the pairs) */
    uint32_t sub = HIST_SUB;
    while (sub > 1 && (uint64_t)tkv_cuda_blocks(gp.n_max, HCHUNK * sub) * Pg < gp.n_sm)
        sub /= 2;
    const dim3 hg(tkv_cuda_blocks(gp.n_max, HCHUNK * sub), Pg);
    TKV_CUDA_TRY(gp.safe ? tkv_cuda_launch(pdl, hg, HIST_T, HIST_SMEM, s, rqs_hist<true>, gp, h, gw, sub)
                         : tkv_cuda_launch(pdl, hg, HIST_T, HIST_SMEM, s, rqs_hist<false>, gp, h, gw, sub));
    TKV_CUDA_TRY(tkv_cuda_launch(pdl, Pg, SCAN_T, 0, s, rqs_scan, gp, gw));
    if (!gp.coarse) {
        TKV_CUDA_TRY(tkv_cuda_launch(pdl, dim3(chunks, Pg), 512, 0, s, rqs_members, gp, h, gw));
        TKV_CUDA_TRY(tkv_cuda_launch(pdl, Pg, REF_T, REF_SMEM, s, rqs_refine, gp, gw));
    }
    TKV_CUDA_TRY(tkv_cuda_launch(pdl, dim3(tkv_cuda_blocks(gp.words, RQS_OUT_T / 32 * (RQS_OUT_K / 32)), n), RQS_OUT_T, 0,
                                 s, rqs_output, gp, h, gw));
    if (gp.whole > 1 && 32 % gp.whole) /* (groups that divide 32: done by rqs_output) */
        TKV_CUDA_TRY(tkv_cuda_launch(pdl, dim3(tkv_cuda_blocks(tkv_cuda_blocks(gp.n_max, gp.whole), 256), n), 256, 0, s,
                                     rqs_whole, gp, h, gw));
    return cudaSuccess;
}
