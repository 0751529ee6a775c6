/*
 * attn-prefill-var.cu -- variant v1 of the tensor-core prefill kernel
 * (attn-prefill.cuh; v0 is attn-prefill.cu's kernel), the default in f16
 * (p->prefill_variant; TKV_CUDA_ATTN_PREFILL_VARIANT, attn.cuh). It does all
 * v0 does: f16 or split precision (SPLIT), the packed or per-ref walk (PACK,
 * the same fill code: attn-prefill-walk.cuh), causal by positions, lse,
 * split-K partials, head_dim 64 and 128. Measured on the H200 as "v5" beside
 * five other variants, since dropped (docs/gpu.md, docs/benchmarks.md).
 *
 * Shape: 4 warps, each owning MT = 2 m16 tiles (32 consecutive query rows),
 * so a CTA's row tile is BM = 128 rows (of n_q tokens x G heads,
 * token-major, as v0: the G query heads of a KV head share every K/V tile)
 * and every K/V fragment an ldmatrix brings feeds two m-tiles (half v0's
 * shared-memory reads per MMA), as FlashAttention-2's 128 x 64 tile. Two
 * K/V stages of 64 keys. The Q fragments are read from shared memory by
 * ldmatrix at every step instead of being kept in registers (fewer
 * registers: O alone takes HD accumulators per thread).
 *
 * Schedule:
 *   - one CTA barrier per tile: the fill of tile t + 1 is issued after the
 *     barrier that publishes tile t, which also proves that every warp
 *     finished tile t - 1, whose stage it reuses
 *   - P packed to f16 (hi + lo when SPLIT) right after each exponential,
 *     the f32 scores dead before P V starts
 *   - O rescaled only when some row max of the warp moved (the factor is
 *     exactly 1 otherwise): after the first tiles of a long causal row,
 *     almost never
 *
 * Against v0, besides the shape and the schedule:
 *   - scores stay unscaled until the exponential: the row max is taken on
 *     raw scores (the scale is positive: the dispatcher sends scale <= 0 to
 *     v0) and p = 2^(s * scale_log2 - m) is one FFMA and one ex2.approx.ftz
 *     (v0: a multiply, then exp2f with its denormal handling)
 *   - the position mask is applied only on tiles that reach past a warp's
 *     lowest query position (the diagonal), and a warp whose rows all
 *     precede the tile's first key skips the tile (its scores would all be
 *     masked: no change to m, l, O)
 *   - row tiles are launched heaviest first (causal: later rows see more
 *     keys), tile i of every KV head before tile i - 1, so the last wave is
 *     made of the short tiles
 *
 * Shared memory (KSTR = HD + 8 halves per row):
 *     Qh, Ql [128][KSTR]         f16  queries (hi, lo; Ql only when SPLIT)
 *     Ks, Vs [2][64][KSTR]       f16  K/V stages, rows past the keys zero
 *     rp [4][32]                 ptr  packed walk: each warp's row addresses
 *     kpos [2][64], qpos [128], nks [2]  i32
 */
#include "attn-prefill.cuh"
#include "attn-prefill-walk.cuh"

#include <cuda_pipeline.h>

namespace {

using namespace tkv_pf;

constexpr int MT = 2;           /* m16 tiles per warp */
constexpr int BM = 16 * 4 * MT; /* query rows per CTA (TKV_ATTN_PREFILL_VAR_ROWS) */
constexpr int ST = 2;           /* K/V stages */
static_assert(BM == TKV_ATTN_PREFILL_VAR_ROWS, "the rows the plan counts");

template <int HD, bool SPLIT> struct pv_cfg {
    static constexpr int KSTR = HD + 8;
    static constexpr size_t Q_BYTES = (size_t)BM * KSTR * 2;
    static constexpr size_t STAGE_BYTES = (size_t)BN * KSTR * 2; /* K or V of one stage */
    static constexpr size_t SMEM = Q_BYTES * (SPLIT ? 2 : 1) + 2 * ST * STAGE_BYTES + (size_t)NT * sizeof(void *) +
                                   (size_t)ST * BN * 4 + (size_t)BM * 4 + (size_t)ST * 4;
};

__device__ __forceinline__ float ex2(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

/* Fills one stage by the CTA's walk. */
template <int HD, bool PACK>
__device__ __forceinline__ int pv_fill(const tkv_cuda_attn_params &p, pk_cursor &pc, kv_cursor &cur, int32_t pos_max,
                                       __half *Ks, __half *Vs, int *kpos, const uint16_t **rp)
{
    return PACK ? fill_packed<HD>(p, pc, pos_max, Ks, Vs, kpos, rp) : fill_tile<HD>(p, cur, pos_max, Ks, Vs, kpos);
}

template <int HD, bool SPLIT, bool PACK>
__global__ void __launch_bounds__(NT, 2) pv_kernel(const tkv_cuda_attn_params p)
{
    constexpr int NNT = BN / 8; /* n-tiles per 64-key step */
    using C = pv_cfg<HD, SPLIT>;
    constexpr int KSTR = C::KSTR, KK = HD / 16, DT = HD / 8;
    extern __shared__ __align__(16) unsigned char smem[];
    __half *Qh = (__half *)smem;
    __half *Ql = (__half *)(smem + C::Q_BYTES); /* only when SPLIT */
    __half *Ks_st = (__half *)(smem + C::Q_BYTES * (SPLIT ? 2 : 1));
    __half *Vs_st = Ks_st + ST * BN * KSTR;
    const uint16_t **rp_all = (const uint16_t **)(Vs_st + ST * BN * KSTR); /* [4][32], PACK only */
    int *kpos_st = (int *)(rp_all + NT), *qpos = kpos_st + ST * BN, *nks = qpos + BM;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const cta_rows cr = cta_rows_of<BM>(p);
    const uint32_t G = cr.G, gk = cr.gk, split = cr.split, r0 = cr.r0;
    const int R = cr.R;

    const int32_t pos_max = p.q_pos[(r0 + R - 1) / G];

    /* this split's keys, the first tile. The CTA is the walks' 4 warps, so
     * `filler` is always true and `warp & 3` is warp; both stay because
     * they steer ptxas (CUDA 13.0, sm_90): the kernel then compiles to the
     * SASS measured on the H200 (as "v5"), and without `filler` the f16
     * head_dim-128 packed instance spills 56 bytes instead of 12. */
    const bool filler = tid < NT;
    const uint16_t **rp = rp_all + 32 * (warp & 3);
    pk_cursor pc = {};
    kv_cursor cur = {};
    if (filler)
        walk_start<PACK>(p, gk, split, pc, cur);
#pragma unroll
    for (int st = 0; st < ST - 1; st++) {
        if (filler) {
            const int nk = pv_fill<HD, PACK>(p, pc, cur, pos_max, Ks_st + st * BN * KSTR, Vs_st + st * BN * KSTR,
                                             kpos_st + st * BN, rp);
            if (tid == 0)
                nks[st] = nk;
        }
        __pipeline_commit();
    }
    /* the tile's queries (f32 -> f16 hi, lo) while the first tiles' copies fly */
    load_queries<HD, BM, NT, SPLIT, q_pad<HD>>(p, gk, r0, R, Qh, Ql, qpos);
    __syncthreads(); /* Q and qpos in shared memory */

    /* this warp's rows: wr0 .. wr0 + 16 MT - 1; m-tile mt holds wr0 + 16 mt + g and + 8 */
    const int wr0 = warp * 16 * MT;
    int32_t qp[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        qp[mt][0] = qpos[wr0 + mt * 16 + g];
        qp[mt][1] = qpos[wr0 + mt * 16 + g + 8];
    }
    /* the warp's lowest and highest query positions (INT_MIN when it has no
     * rows: then it skips every tile) */
    const int32_t q_lo = qpos[wr0];
    const int32_t q_hi = wr0 < R ? qpos[min(wr0 + 16 * MT, R) - 1] : INT_MIN;

    float o[MT][DT][4];
    float m[MT][2], l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int dt = 0; dt < DT; dt++)
            o[mt][dt][0] = o[mt][dt][1] = o[mt][dt][2] = o[mt][dt][3] = 0.0f;
        m[mt][0] = m[mt][1] = -INFINITY;
        l[mt][0] = l[mt][1] = 0.0f;
    }
    const float sc = p.scale_log2;

    int stage = 0, fstage = ST - 1;
    for (;;) {
        /* tile t (the oldest group in flight) has landed; the barrier
         * publishes it and proves that every warp finished computing
         * tile t - 1, so its stage (fstage) takes tile t + ST - 1 now,
         * with no second barrier after the computation */
        __pipeline_wait_prior(ST - 2);
        __syncthreads();
        if (nks[stage] == 0) /* (uniform) the walk is done */
            break;
        if (filler) {
            const int nk = pv_fill<HD, PACK>(p, pc, cur, pos_max, Ks_st + fstage * BN * KSTR,
                                             Vs_st + fstage * BN * KSTR, kpos_st + fstage * BN, rp);
            if (tid == 0)
                nks[fstage] = nk;
        }
        __pipeline_commit();
        const __half *Ks = Ks_st + stage * BN * KSTR, *Vs = Vs_st + stage * BN * KSTR;
        const int *kpos = kpos_st + stage * BN;

        if (kpos[0] <= q_hi) { /* (warp-uniform) some row of the warp sees the tile's first key */
            const bool masked = !(kpos[BN - 1] <= q_lo); /* INT_MAX past the keys: masked */

            /* ---- S = Q K^T (unscaled) */
            float s[MT][NNT][4];
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int nt = 0; nt < NNT; nt++)
                    s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.0f;
            {
                const int mi = lane >> 3, key_l = (mi >> 1) * 8 + (lane & 7), col_l = (mi & 1) * 8;
#pragma unroll
                for (int kk = 0; kk < KK; kk++) {
                    uint32_t a[MT][4], al[SPLIT ? MT : 1][4];
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        const int row = wr0 + mt * 16 + (lane & 15), col = kk * 16 + (lane >> 4) * 8;
                        ldsm_x4(smem_u32(Qh + row * KSTR + col), a[mt][0], a[mt][1], a[mt][2], a[mt][3]);
                        if (SPLIT)
                            ldsm_x4(smem_u32(Ql + row * KSTR + col), al[SPLIT ? mt : 0][0], al[SPLIT ? mt : 0][1],
                                    al[SPLIT ? mt : 0][2], al[SPLIT ? mt : 0][3]);
                    }
#pragma unroll
                    for (int np = 0; np < NNT / 2; np++) {
                        uint32_t b0, b1, b2, b3;
                        ldsm_x4(smem_u32(Ks + (np * 16 + key_l) * KSTR + kk * 16 + col_l), b0, b1, b2, b3);
#pragma unroll
                        for (int mt = 0; mt < MT; mt++) {
                            mma16816(s[mt][2 * np], a[mt], b0, b1);
                            mma16816(s[mt][2 * np + 1], a[mt], b2, b3);
                            if (SPLIT) {
                                mma16816(s[mt][2 * np], al[SPLIT ? mt : 0], b0, b1);
                                mma16816(s[mt][2 * np + 1], al[SPLIT ? mt : 0], b2, b3);
                            }
                        }
                    }
                }
            }

            /* ---- mask (diagonal tiles), online softmax in log2 units; P as
             * f16 (hi, lo when SPLIT) as soon as each exponential is taken,
             * the A fragments of P V: ph[mt][nt] holds n-tile nt's rows g
             * (0) and g + 8 (1), so k-step kq's A is ph[2kq][0], ph[2kq][1],
             * ph[2kq+1][0], ph[2kq+1][1] */
            uint32_t ph[MT][NNT][2];
            uint32_t pq[SPLIT ? MT : 1][SPLIT ? NNT : 1][2];
            float cf[MT][2];    /* the rows' rescale factors */
            bool moved = false; /* some factor is not 1 */
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
                for (int nt = 0; nt < NNT; nt++)
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        if (masked) {
                            const int kp = kpos[nt * 8 + 2 * t + e];
                            if (kp > qp[mt][0])
                                s[mt][nt][e] = -INFINITY;
                            if (kp > qp[mt][1])
                                s[mt][nt][2 + e] = -INFINITY;
                        }
                        mx0 = fmaxf(mx0, s[mt][nt][e]);
                        mx1 = fmaxf(mx1, s[mt][nt][2 + e]);
                    }
#pragma unroll
                for (int off = 1; off <= 2; off <<= 1) {
                    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
                    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
                }
                /* scale > 0: the max of the scaled scores is the scaled max */
                const float mn0 = fmaxf(m[mt][0], mx0 * sc), mn1 = fmaxf(m[mt][1], mx1 * sc);
                const float mu0 = mn0 == -INFINITY ? 0.0f : mn0, mu1 = mn1 == -INFINITY ? 0.0f : mn1;
                const float c0 = ex2(m[mt][0] - mu0), c1 = ex2(m[mt][1] - mu1); /* 0 when m was -inf */
                m[mt][0] = mn0;
                m[mt][1] = mn1;
                float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
                for (int nt = 0; nt < NNT; nt++) {
                    s[mt][nt][0] = ex2(fmaf(s[mt][nt][0], sc, -mu0)); /* -inf (masked) -> 0 */
                    s[mt][nt][1] = ex2(fmaf(s[mt][nt][1], sc, -mu0));
                    s[mt][nt][2] = ex2(fmaf(s[mt][nt][2], sc, -mu1));
                    s[mt][nt][3] = ex2(fmaf(s[mt][nt][3], sc, -mu1));
                    sum0 += s[mt][nt][0] + s[mt][nt][1];
                    sum1 += s[mt][nt][2] + s[mt][nt][3];
                    uint32_t *h = ph[mt][nt];
                    if (SPLIT) {
                        uint32_t *q = pq[SPLIT ? mt : 0][SPLIT ? nt : 0];
                        split_h2(s[mt][nt][0], s[mt][nt][1], h[0], q[0]);
                        split_h2(s[mt][nt][2], s[mt][nt][3], h[1], q[1]);
                    } else {
                        h[0] = pack_h2(s[mt][nt][0], s[mt][nt][1]);
                        h[1] = pack_h2(s[mt][nt][2], s[mt][nt][3]);
                    }
                }
                l[mt][0] = l[mt][0] * c0 + sum0; /* this thread's share; the row's 4 threads add up at the end */
                l[mt][1] = l[mt][1] * c1 + sum1;
                cf[mt][0] = c0; /* the rescale below, once for all m-tiles */
                cf[mt][1] = c1;
                moved |= c0 != 1.0f || c1 != 1.0f;
            }
            /* once the row maxima settle (most tiles of a long causal row),
             * every factor is exactly 1 (2^0) and the warp skips the
             * MT * HD / 2 multiplies: the same result bit for bit (x * 1 is
             * x; a row whose m was -inf has l = 0 and O = 0 before and after). */
            if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
                for (int mt = 0; mt < MT; mt++)
#pragma unroll
                    for (int dt = 0; dt < DT; dt++) {
                        o[mt][dt][0] *= cf[mt][0];
                        o[mt][dt][1] *= cf[mt][0];
                        o[mt][dt][2] *= cf[mt][1];
                        o[mt][dt][3] *= cf[mt][1];
                    }
            }

            /* ---- O += P V */
            {
                const int mi = lane >> 3, key_l = (mi & 1) * 8 + (lane & 7), col_l = (mi >> 1) * 8;
#pragma unroll
                for (int kq = 0; kq < NNT / 2; kq++) { /* keys kq*16 .. +15 */
                    uint32_t pa[MT][4], pl[SPLIT ? MT : 1][4];
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        const uint32_t *h0 = ph[mt][2 * kq], *h1 = ph[mt][2 * kq + 1];
                        pa[mt][0] = h0[0];
                        pa[mt][1] = h0[1];
                        pa[mt][2] = h1[0];
                        pa[mt][3] = h1[1];
                        if (SPLIT) {
                            const uint32_t *q0 = pq[SPLIT ? mt : 0][SPLIT ? 2 * kq : 0];
                            const uint32_t *q1 = pq[SPLIT ? mt : 0][SPLIT ? 2 * kq + 1 : 0];
                            uint32_t *lo = pl[SPLIT ? mt : 0];
                            lo[0] = q0[0];
                            lo[1] = q0[1];
                            lo[2] = q1[0];
                            lo[3] = q1[1];
                        }
                    }
#pragma unroll
                    for (int dp = 0; dp < HD / 16; dp++) {
                        uint32_t b0, b1, b2, b3;
                        ldsm_x4_t(smem_u32(Vs + (kq * 16 + key_l) * KSTR + dp * 16 + col_l), b0, b1, b2, b3);
#pragma unroll
                        for (int mt = 0; mt < MT; mt++) {
                            mma16816(o[mt][2 * dp], pa[mt], b0, b1);
                            mma16816(o[mt][2 * dp + 1], pa[mt], b2, b3);
                            if (SPLIT) {
                                mma16816(o[mt][2 * dp], pl[SPLIT ? mt : 0], b0, b1);
                                mma16816(o[mt][2 * dp + 1], pl[SPLIT ? mt : 0], b2, b3);
                            }
                        }
                    }
                }
            }
        }
        stage = stage + 1 == ST ? 0 : stage + 1;
        fstage = fstage + 1 == ST ? 0 : fstage + 1;
    }

    /* ---- results */
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int half = 0; half < 2; half++) {
            float L = l[mt][half];
            L += __shfl_xor_sync(0xffffffffu, L, 1);
            L += __shfl_xor_sync(0xffffffffu, L, 2);
            const int r = wr0 + mt * 16 + g + 8 * half;
            if (r < R)
                store_row<HD>(p, gk, split, r0 + r, m[mt][half], L,
                              [&](int dt, int e) { return o[mt][dt][2 * half + e]; });
        }
    }
}

template <int HD, bool SPLIT> cudaError_t pv_launch(const tkv_cuda_attn_params *p, cudaStream_t s)
{
    return tkv_pf_launch(p, s, BM, NT, pv_cfg<HD, SPLIT>::SMEM, pv_kernel<HD, SPLIT, true>, pv_kernel<HD, SPLIT, false>);
}

template <int HD, bool SPLIT> cudaError_t pv_init(int *ctas)
{
    return tkv_pf_setup(ctas, NT, pv_cfg<HD, SPLIT>::SMEM, pv_kernel<HD, SPLIT, true>, pv_kernel<HD, SPLIT, false>);
}

tkv_pf_ctas g_pv_ctas; /* set by init */

} // namespace

cudaError_t tkv_cuda_attn_prefill_var_init(void)
{
    return tkv_pf_each([](auto hd, auto split) {
        return pv_init<decltype(hd)::value, decltype(split)::value>(&g_pv_ctas.at(hd, split));
    });
}

cudaError_t tkv_cuda_attn_prefill_var(const tkv_cuda_attn_params *p, cudaStream_t s)
{
    return tkv_pf_one(p->head_dim, p->prefill_mode == TKV_ATTN_PREFILL_SPLIT, [&](auto hd, auto split) {
        return pv_launch<decltype(hd)::value, decltype(split)::value>(p, s);
    });
}

int tkv_cuda_attn_prefill_var_ctas_per_sm(uint32_t head_dim, int mode) { return g_pv_ctas.get(head_dim, mode); }
