/*
 * attn-prefill.cu -- see attn-prefill.cuh.
 *
 * Shared memory of one CTA (HD = head_dim, 64 or 128; rows padded by 8 halves
 * so that the 8 rows an ldmatrix reads fall in different banks):
 *     Qh, Ql [64][HD + 8]      f16   the tile's queries (hi, lo parts; Ql only
 *                                    when split)
 *     Ks, Vs [2][64][HD + 8]   f16   two stages of keys / values, rows past
 *                                    the tile's keys zeroed
 *     rp [4][32]               ptr   packed walk: each warp's rows' K (0-15)
 *                                    and V (16-31) addresses
 *     kpos [2][64], qpos [64]  i32
 *
 * Per warp (rows w*16 .. w*16+15) and 64-key step, with the m16n8k16 fragment
 * layouts (g = lane / 4, t = lane % 4; a thread holds rows g and g + 8):
 *     S[16 x 64]  = Q K^T:  A = Q from registers (loaded once by ldmatrix),
 *                           B = K rows by ldmatrix (K is [key][dim], i.e.
 *                           B^T row-major)
 *     masked by positions, scaled to log2 units; online softmax per row
 *     (the 4 threads of a row combine by shuffles);
 *     O[16 x HD] += P V:    A = P straight from S's accumulators (the C
 *                           layout of two n-tiles is the A layout of one
 *                           k-step), B = V rows by ldmatrix.trans.
 */
#include "attn-prefill.cuh"
#include "attn-prefill-walk.cuh"

#include <cuda_pipeline.h>

namespace {

using namespace tkv_pf;

constexpr int BM = 64;

template <int HD, bool SPLIT> struct pf_cfg {
    static constexpr int KSTR = HD + 8; /* halves per smem row */
    static constexpr size_t Q_BYTES = (size_t)BM * KSTR * 2;
    static constexpr size_t KV_BYTES = (size_t)2 * BN * KSTR * 2; /* two stages */
    static constexpr size_t RP_BYTES = (size_t)NT * sizeof(void *); /* packed walk: [4 warps][32] row addresses */
    static constexpr size_t SMEM = Q_BYTES * (SPLIT ? 2 : 1) + 2 * KV_BYTES + RP_BYTES + 2 * BN * 4 + BM * 4;
};

template <int HD, bool SPLIT, bool PACK>
__global__ void __launch_bounds__(NT, 2) attn_prefill_kernel(const tkv_cuda_attn_params p)
{
    using C = pf_cfg<HD, SPLIT>;
    constexpr int KSTR = C::KSTR, KK = HD / 16, DT = HD / 8;
    extern __shared__ __align__(16) unsigned char smem[];
    __half *Qh = (__half *)smem;
    __half *Ql = (__half *)(smem + C::Q_BYTES); /* only when SPLIT */
    __half *Ks_st = (__half *)(smem + C::Q_BYTES * (SPLIT ? 2 : 1));
    __half *Vs_st = Ks_st + 2 * BN * KSTR;
    const uint16_t **rp_all = (const uint16_t **)(Vs_st + 2 * BN * KSTR); /* [4][32], PACK only */
    int *kpos_st = (int *)(rp_all + NT), *qpos = kpos_st + 2 * BN;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const uint32_t gk = blockIdx.y, split = blockIdx.z;
    const uint32_t G = p.n_head / p.n_head_kv;
    const uint32_t r0 = blockIdx.x * BM;
    const int R = (int)min((uint32_t)BM, p.n_q * G - r0);

    const int32_t pos_max = p.q_pos[(r0 + R - 1) / G];

    /* this split's keys: packed tiles, or its share of the refs */
    const uint16_t **rp = rp_all + 32 * warp;
    pk_cursor pc = {};
    kv_cursor cur = {};
    int nk;
    if (PACK) {
        pk_start(p, gk, split, pc);
        nk = fill_packed<HD>(p, pc, pos_max, Ks_st, Vs_st, kpos_st, rp);
    } else {
        kv_start(p, gk, split, cur);
        nk = fill_tile<HD>(p, cur, pos_max, Ks_st, Vs_st, kpos_st);
    }
    int stage = 0;
    __pipeline_commit();
    /* the tile's queries (f32 -> f16 hi, lo) while the first tile's copies fly */
    load_queries<HD, BM, NT, SPLIT, q_pad<HD>>(p, gk, r0, R, Qh, Ql, qpos);
    __syncthreads(); /* Q in shared memory */

    /* Q fragments, kept in registers: a[kk] covers dims kk*16 .. +15 */
    uint32_t qa[KK][4], qla[SPLIT ? KK : 1][4];
    {
        const int row = warp * 16 + (lane & 15), col = (lane >> 4) * 8;
#pragma unroll
        for (int kk = 0; kk < KK; kk++) {
            ldsm_x4(smem_u32(Qh + row * KSTR + kk * 16 + col), qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3]);
            if (SPLIT)
                ldsm_x4(smem_u32(Ql + row * KSTR + kk * 16 + col), qla[kk][0], qla[kk][1], qla[kk][2], qla[kk][3]);
        }
    }
    const int row0 = warp * 16 + g, row1 = row0 + 8;
    const int32_t qp0 = qpos[row0], qp1 = qpos[row1];

    float o[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; dt++)
        o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;

    while (nk > 0) {
        const __half *Ks = Ks_st + stage * BN * KSTR, *Vs = Vs_st + stage * BN * KSTR;
        const int *kpos = kpos_st + stage * BN;
        __half *Kn = Ks_st + (stage ^ 1) * BN * KSTR, *Vn = Vs_st + (stage ^ 1) * BN * KSTR;
        int *kposn = kpos_st + (stage ^ 1) * BN;
        const int nk_next = PACK ? fill_packed<HD>(p, pc, pos_max, Kn, Vn, kposn, rp)
                                 : fill_tile<HD>(p, cur, pos_max, Kn, Vn, kposn);
        __pipeline_commit();
        __pipeline_wait_prior(1);
        __syncthreads();

        /* ---- S = Q K^T */
        float s[8][4];
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
        {
            const int mi = lane >> 3, key_l = (mi >> 1) * 8 + (lane & 7), col_l = (mi & 1) * 8;
#pragma unroll
            for (int kk = 0; kk < KK; kk++) {
#pragma unroll
                for (int np = 0; np < 4; np++) {
                    uint32_t b0, b1, b2, b3;
                    ldsm_x4(smem_u32(Ks + (np * 16 + key_l) * KSTR + kk * 16 + col_l), b0, b1, b2, b3);
                    mma16816(s[2 * np], qa[kk], b0, b1);
                    mma16816(s[2 * np + 1], qa[kk], b2, b3);
                    if (SPLIT) {
                        mma16816(s[2 * np], qla[kk], b0, b1);
                        mma16816(s[2 * np + 1], qla[kk], b2, b3);
                    }
                }
            }
        }

        /* ---- mask, scale to log2 units, online softmax (rows row0, row1) */
        float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int kp = kpos[nt * 8 + 2 * t + e]; /* INT_MAX past the keys */
                s[nt][e] = kp <= qp0 ? s[nt][e] * p.scale_log2 : -INFINITY;
                s[nt][2 + e] = kp <= qp1 ? s[nt][2 + e] * p.scale_log2 : -INFINITY;
                mx0 = fmaxf(mx0, s[nt][e]);
                mx1 = fmaxf(mx1, s[nt][2 + e]);
            }
#pragma unroll
        for (int off = 1; off <= 2; off <<= 1) {
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
        }
        const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
        const float mu0 = mn0 == -INFINITY ? 0.0f : mn0, mu1 = mn1 == -INFINITY ? 0.0f : mn1;
        const float c0 = exp2f(m0 - mu0), c1 = exp2f(m1 - mu1); /* 0 when m was -inf */
        m0 = mn0;
        m1 = mn1;
        float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
        for (int nt = 0; nt < 8; nt++) {
            s[nt][0] = exp2f(s[nt][0] - mu0);
            s[nt][1] = exp2f(s[nt][1] - mu0);
            s[nt][2] = exp2f(s[nt][2] - mu1);
            s[nt][3] = exp2f(s[nt][3] - mu1);
            sum0 += s[nt][0] + s[nt][1];
            sum1 += s[nt][2] + s[nt][3];
        }
        l0 = l0 * c0 + sum0; /* this thread's share; the row's 4 threads add up at the end */
        l1 = l1 * c1 + sum1;
#pragma unroll
        for (int dt = 0; dt < DT; dt++) {
            o[dt][0] *= c0;
            o[dt][1] *= c0;
            o[dt][2] *= c1;
            o[dt][3] *= c1;
        }

        /* ---- O += P V */
        {
            const int mi = lane >> 3, key_l = (mi & 1) * 8 + (lane & 7), col_l = (mi >> 1) * 8;
#pragma unroll
            for (int kq = 0; kq < 4; kq++) { /* keys kq*16 .. +15 */
                uint32_t pa[4], pl[4];
                if (SPLIT) {
                    split_h2(s[2 * kq][0], s[2 * kq][1], pa[0], pl[0]);
                    split_h2(s[2 * kq][2], s[2 * kq][3], pa[1], pl[1]);
                    split_h2(s[2 * kq + 1][0], s[2 * kq + 1][1], pa[2], pl[2]);
                    split_h2(s[2 * kq + 1][2], s[2 * kq + 1][3], pa[3], pl[3]);
                } else {
                    pa[0] = pack_h2(s[2 * kq][0], s[2 * kq][1]);
                    pa[1] = pack_h2(s[2 * kq][2], s[2 * kq][3]);
                    pa[2] = pack_h2(s[2 * kq + 1][0], s[2 * kq + 1][1]);
                    pa[3] = pack_h2(s[2 * kq + 1][2], s[2 * kq + 1][3]);
                }
#pragma unroll
                for (int dp = 0; dp < HD / 16; dp++) {
                    uint32_t b0, b1, b2, b3;
                    ldsm_x4_t(smem_u32(Vs + (kq * 16 + key_l) * KSTR + dp * 16 + col_l), b0, b1, b2, b3);
                    mma16816(o[2 * dp], pa, b0, b1);
                    mma16816(o[2 * dp + 1], pa, b2, b3);
                    if (SPLIT) {
                        mma16816(o[2 * dp], pl, b0, b1);
                        mma16816(o[2 * dp + 1], pl, b2, b3);
                    }
                }
            }
        }
        __syncthreads(); /* before the next fill overwrites this stage */
        stage ^= 1;
        nk = nk_next;
    }

    /* ---- results */
#pragma unroll
    for (int off = 1; off <= 2; off <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, off);
        l1 += __shfl_xor_sync(0xffffffffu, l1, off);
    }
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int r = half ? row1 : row0;
        if (r < R)
            store_row<HD>(p, gk, split, r0 + r, half ? m1 : m0, half ? l1 : l0,
                          [&](int dt, int e) { return o[dt][2 * half + e]; });
    }
}

template <int HD, bool SPLIT> cudaError_t launch_pf(const tkv_cuda_attn_params *p, cudaStream_t s)
{
    const uint32_t rows = p->n_q * (p->n_head / p->n_head_kv);
    const dim3 grid((rows + BM - 1) / BM, p->n_head_kv, p->n_split);
    if (tkv_cuda_attn_prefill_packed(p))
        attn_prefill_kernel<HD, SPLIT, true><<<grid, NT, pf_cfg<HD, SPLIT>::SMEM, s>>>(*p);
    else
        attn_prefill_kernel<HD, SPLIT, false><<<grid, NT, pf_cfg<HD, SPLIT>::SMEM, s>>>(*p);
    TKV_CUDA_LAUNCHED();
    return cudaSuccess;
}

/* Both walks of one (HD, SPLIT) instance: the same shared memory and, by
 * __launch_bounds__, the same CTAs per SM (the smaller count is kept). */
template <int HD, bool SPLIT> cudaError_t init_pf(int *ctas)
{
    int c[2];
    TKV_CUDA_TRY(cudaFuncSetAttribute(attn_prefill_kernel<HD, SPLIT, false>,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize, (int)pf_cfg<HD, SPLIT>::SMEM));
    TKV_CUDA_TRY(cudaFuncSetAttribute(attn_prefill_kernel<HD, SPLIT, true>,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize, (int)pf_cfg<HD, SPLIT>::SMEM));
    TKV_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&c[0], attn_prefill_kernel<HD, SPLIT, false>, NT,
                                                               pf_cfg<HD, SPLIT>::SMEM));
    TKV_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&c[1], attn_prefill_kernel<HD, SPLIT, true>, NT,
                                                               pf_cfg<HD, SPLIT>::SMEM));
    *ctas = c[0] < c[1] ? c[0] : c[1];
    if (*ctas < 1)
        *ctas = 1;
    return cudaSuccess;
}

/* CTAs per SM: [head_dim 64, 128][f16, split] */
tkv_pf_ctas g_pf_ctas; /* set by init */

} // namespace

cudaError_t tkv_cuda_attn_prefill_init(void)
{
    TKV_CUDA_TRY(tkv_pf_each([](auto hd, auto split) {
        return init_pf<decltype(hd)::value, decltype(split)::value>(&g_pf_ctas.at(hd, split));
    }));
    TKV_CUDA_TRY(tkv_cuda_attn_prefill_wg_init());
    TKV_CUDA_TRY(tkv_cuda_attn_prefill_ws_init());
    return tkv_cuda_attn_prefill_var_init();
}

bool tkv_cuda_attn_prefill_ok(const tkv_cuda_attn_params *p)
{
    return p->prefill_mode != TKV_ATTN_PREFILL_GENERAL && p->vec16 && ((uintptr_t)p->q & 15u) == 0 &&
           (p->head_dim == 64 || p->head_dim == 128);
}

bool tkv_cuda_attn_prefill_packed(const tkv_cuda_attn_params *p) { return p->prefill_pack && p->kofs != NULL; }

int tkv_cuda_attn_prefill_variant(const tkv_cuda_attn_params *p)
{
    /* unset: the fastest measured on the H200 (docs/benchmarks.md) -- v3
     * (wgmma, specialized warps) where the device runs it, in both
     * precisions; elsewhere v1 (4 warps x 32 rows, one barrier per tile, P
     * packed after the exponential) for f16 and v0 for split precision (v1
     * is slower there) */
    int v = p->prefill_variant;
    if (v < 0)
        v = tkv_cuda_attn_prefill_wg_ok() ? 3 : p->prefill_mode == TKV_ATTN_PREFILL_F16 ? 1 : 0;
    if (v == 0 || !(p->scale_log2 > 0.0f))
        return 0;
    if (v >= 2 && !tkv_cuda_attn_prefill_wg_ok()) /* v1 serves v2 and v3, in split precision too */
        return 1;
    return v;
}

uint32_t tkv_cuda_attn_prefill_rows(const tkv_cuda_attn_params *p)
{
    return tkv_cuda_attn_prefill_variant(p) ? TKV_ATTN_PREFILL_VAR_ROWS : TKV_ATTN_PREFILL_ROWS;
}

int tkv_cuda_attn_prefill_ctas_per_sm(const tkv_cuda_attn_params *p)
{
    const int v = tkv_cuda_attn_prefill_variant(p);
    if (v == 3)
        return tkv_cuda_attn_prefill_ws_ctas_per_sm(p->head_dim, p->prefill_mode);
    if (v == 2)
        return tkv_cuda_attn_prefill_wg_ctas_per_sm(p->head_dim, p->prefill_mode);
    if (v == 1)
        return tkv_cuda_attn_prefill_var_ctas_per_sm(p->head_dim, p->prefill_mode);
    return g_pf_ctas.get(p->head_dim, p->prefill_mode);
}

cudaError_t tkv_cuda_attn_prefill(const tkv_cuda_attn_params *p, cudaStream_t s)
{
    const int v = tkv_cuda_attn_prefill_variant(p);
    if (v == 3)
        return tkv_cuda_attn_prefill_ws(p, s);
    if (v == 2)
        return tkv_cuda_attn_prefill_wg(p, s);
    if (v == 1)
        return tkv_cuda_attn_prefill_var(p, s);
    return tkv_pf_one(p->head_dim, p->prefill_mode == TKV_ATTN_PREFILL_SPLIT, [&](auto hd, auto split) {
        return launch_pf<decltype(hd)::value, decltype(split)::value>(p, s);
    });
}

const char *tkv_cuda_attn_prefill_variant_desc(int variant)
{
    static const char *const desc[TKV_ATTN_PREFILL_VARIANTS] = {
        "v0: 64 rows (4 warps x 16), Q in registers, 2 stages (attn-prefill.cu)",
        "v1: 128 rows (4 warps x 32), Q from smem, 2 stages, one barrier per tile, P to f16 at the exponential, "
        "O rescaled only when a max moves (was v5; attn-prefill-var.cu)",
        "v2: v1's schedule on wgmma (2 warpgroups x 64 rows, Q/K/V by swizzled descriptors; compute capability 9.0, "
        "else v1; attn-prefill-wg.cu)",
        "v3: v2 with specialized warps (a producer warpgroup, mbarriers per stage, the 2 consumer warpgroups "
        "taking turns; compute capability 9.0, else v1; attn-prefill-ws.cu)",
    };
    return variant >= 0 && variant < TKV_ATTN_PREFILL_VARIANTS ? desc[variant] : NULL;
}
