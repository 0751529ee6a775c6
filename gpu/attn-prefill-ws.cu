/*
 * attn-prefill-ws.cu -- variant v3 of the tensor-core prefill kernel
 * (attn-prefill.cuh): v2's warpgroup MMA (attn-prefill-wg.cu, the layouts
 * and descriptors are described there) with the warps specialized, as
 * FlashAttention-3 does. Built for sm_90a only, run only on compute
 * capability 9.0 (v1 serves it elsewhere).
 *
 * Why: v2's two warpgroups meet at a CTA barrier every 64-key tile, and its
 * first warpgroup also walks the block table and issues the next tiles'
 * copies; so both take their exponentials at the same time while the tensor
 * cores wait, and the faster one waits for the filler. Here
 *
 *   - warpgroup 2, the producer, only walks the table and fills the
 *     stages (fill_packed / fill_tile, a warp per 16 rows as in v2): per
 *     tile t it first publishes tile t - PREF once its copies have landed
 *     (each thread makes its own visible to the async proxy,
 *     fence.proxy.async, and arrives on the stage's `full` mbarrier), then
 *     waits for stage t % ST to be empty and issues tile t's copies. Two
 *     earlier versions were slower than v2 on the H200: one producer warp
 *     filling the 64 rows 16 at a time (0.6x: its rounds' dependent table
 *     loads came one after the other, and all its copy instructions ran
 *     on one SM sub-partition), and this warpgroup publishing tile t - PREF
 *     only after issuing tile t (0.95-1.02x: every tile then waited for a
 *     free stage and for the next fill's table loads);
 *   - warps 0-3 and 4-7, the consumers (warpgroups of 64 query rows each),
 *     wait on `full`, issue S = Q K^T and the previous tile's O += P V,
 *     take the softmax while the P V runs, and once that P V has landed
 *     arrive on the previous stage's `empty` mbarrier (a warp each);
 *   - with ping-pong (p.ws_pingpong; TKV_CUDA_ATTN_WS_PINGPONG=0 turns it
 *     off, read with the other attention switches in attn.cu) the two
 *     consumer warpgroups take turns to issue their MMAs (named barriers 2
 *     and 3), so that one's exponentials overlap the other's MMAs.
 *
 * 384 threads, one CTA per SM: up to 168 registers each (the consumers
 * need 120-166, without setmaxnreg). Q is loaded by the consumers while
 * the producer's first copies fly. Stages: ST = PREF + 2. A stage is free
 * once the P V that read it has landed, one tile after its S; the producer
 * never waits for the consumers before publishing, so ST >= PREF + 1 is
 * free of deadlock, and the second spare stage lets it issue tile t while
 * the consumers still compute t - 3.
 */
#include "attn-prefill-wg.cuh"

#include <cuda_pipeline.h>

namespace {

using namespace tkv_wg;

constexpr int NCW = 8;              /* consumer warps: 2 warpgroups  */
constexpr int NTH = 32 * (NCW + 4); /* and the producer warpgroup    */
constexpr int BM = 128;             /* query rows per CTA           */
static_assert(BM == TKV_ATTN_PREFILL_VAR_ROWS, "the rows the plan counts");

constexpr int PREF = 2;      /* tiles whose copies the producer keeps in flight */
constexpr int ST = PREF + 2; /* K/V stages */

template <int HD, bool SPLIT> struct ws_cfg {
    static constexpr int REG = HD / 64;
    static constexpr size_t Q_BYTES = (size_t)REG * BM * 128;
    static constexpr size_t KV_BYTES = (size_t)REG * BN * 128; /* K or V of one stage */
    /* full[ST], empty[ST]; the producer warps' 4 x 32 row pointers; kpos, qpos, nks */
    static constexpr size_t TAIL = (size_t)2 * ST * 8 + NT * sizeof(void *) + (size_t)ST * BN * 4 + (size_t)BM * 4 +
                                   (size_t)ST * 4;
    static constexpr size_t SMEM = 1024 + Q_BYTES * (SPLIT ? 2 : 1) + 2 * ST * KV_BYTES + TAIL;
};

template <int HD, bool SPLIT, bool PACK>
__global__ void __launch_bounds__(NTH, 1) ws_kernel(const tkv_cuda_attn_params p)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using C = ws_cfg<HD, SPLIT>;
    constexpr int NNT = BN / 8;
    constexpr int KV_H = (int)(C::KV_BYTES / 2); /* a stage's K (or V), in halves */
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const uint32_t raw = smem_u32(smem_raw);
    unsigned char *smem = smem_raw + (((raw + 1023u) & ~1023u) - raw);
    __half *Qh = (__half *)smem;
    __half *Ql = (__half *)(smem + C::Q_BYTES); /* only when SPLIT */
    __half *Ks_st = (__half *)(smem + C::Q_BYTES * (SPLIT ? 2 : 1));
    __half *Vs_st = Ks_st + ST * KV_H;
    uint64_t *full = (uint64_t *)(Vs_st + ST * KV_H), *empty = full + ST;
    const uint16_t **rp_all = (const uint16_t **)(empty + ST);
    int *kpos_st = (int *)(rp_all + NT), *qpos = kpos_st + ST * BN, *nks = qpos + BM;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const cta_rows cr = cta_rows_of<BM>(p);
    const uint32_t G = cr.G, gk = cr.gk, split = cr.split, r0 = cr.r0;
    const int R = cr.R;

    if (tid == 0)
        for (int st = 0; st < ST; st++) {
            mbar_init(full + st, NT);   /* the producer's threads */
            mbar_init(empty + st, NCW); /* a lane of each consumer warp */
        }
    __syncthreads();

    if (warp >= NCW) {
        /* ---- the producer: tile t into stage t % ST */
        const int32_t pos_max = p.q_pos[(r0 + R - 1) / G];
        const uint16_t **rp = rp_all + 32 * (warp - NCW);
        pk_cursor pc = {};
        kv_cursor cur = {};
        walk_start<PACK>(p, gk, split, pc, cur);
        for (int t = 0;; t++) {
            const int st = t % ST;
            /* tile t - PREF landed: publish it first, so that a consumer
             * never waits for the producer's next free stage (which waits
             * for the consumers) or for the table loads of the next fill */
            if (t >= PREF) {
                __pipeline_wait_prior(PREF - 1);
                fence_proxy_async();
                mbar_arrive(full + (t - PREF) % ST);
            }
            if (t >= ST) /* the stage's previous tile, t - ST, released */
                mbar_wait(empty + st, (uint32_t)(t / ST - 1) & 1u);
            __half *Kf = Ks_st + st * KV_H, *Vf = Vs_st + st * KV_H;
            int *kf = kpos_st + st * BN;
            const int nk = PACK ? fill_packed<HD, sw128_layout<HD>, NCW>(p, pc, pos_max, Kf, Vf, kf, rp)
                                : fill_tile<HD, sw128_layout<HD>, NCW>(p, cur, pos_max, Kf, Vf, kf);
            if (nk == 0 && t == 0) /* nothing to attend: the consumers' last P V reads this V with P = 0 */
                for (int i = tid - 32 * NCW; i < KV_H / 8; i += NT)
                    ((uint4 *)Vf)[i] = make_uint4(0, 0, 0, 0);
            if (tid == 32 * NCW)
                nks[st] = nk;
            __pipeline_commit();
            if (nk == 0) { /* the walk is done: publish the rest, the last one empty */
                __pipeline_wait_prior(0);
                fence_proxy_async();
                for (int u = t - PREF + 1; u <= t; u++)
                    if (u >= 0)
                        mbar_arrive(full + u % ST);
                return;
            }
        }
    }

    /* ---- the consumers: warpgroup wg owns rows 64 wg .. 64 wg + 63 */
    const int wg = warp >> 2, wwarp = warp & 3, g = lane >> 2;
    load_queries<HD, BM, 32 * NCW, SPLIT, q_sw128<BM>>(p, gk, r0, R, Qh, Ql, qpos);
    fence_proxy_async(); /* the Q stores, for wgmma */
    named_sync(1, 32 * NCW);

    const int wg0 = wg * 64, wr0 = wg0 + wwarp * 16;
    const int32_t qp0 = qpos[wr0 + g], qp1 = qpos[wr0 + g + 8];
    const int32_t q_lo = qpos[wr0]; /* the warp's lowest */

    float o[HD / 2];
#pragma unroll
    for (int i = 0; i < HD / 2; i++)
        o[i] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
    const float sc = p.scale_log2;
    const uint32_t qh_a = smem_u32(Qh) + wg0 * 128, ql_a = smem_u32(Ql) + wg0 * 128;
    const bool pp = p.ws_pingpong != 0;

    /* P of the last tile and where its V is, as in v2: P = 0 against stage
     * 0's V before the first tile (the producer zeroes that V when the walk
     * is empty) */
    uint32_t ph[NNT][2], pq[SPLIT ? NNT : 1][2];
#pragma unroll
    for (int nt = 0; nt < NNT; nt++) {
        ph[nt][0] = ph[nt][1] = 0;
        pq[SPLIT ? nt : 0][0] = pq[SPLIT ? nt : 0][1] = 0;
    }
    uint32_t pv_v = smem_u32(Vs_st);

    /* ping-pong: warpgroup w issues after a sync on barrier 2 + w, which the
     * other one's arrive after its issue completes; warpgroup 0 goes first */
    if (pp && wg == 1)
        named_arrive(2, 32 * NCW);
    int stage = 0, prev = -1;
    uint32_t phase = 0;
    for (;;) {
        mbar_wait(full + stage, phase);
        if (nks[stage] == 0) /* (uniform) the walk is done */
            break;
        const uint32_t ks_a = smem_u32(Ks_st + stage * KV_H), vs_a = smem_u32(Vs_st + stage * KV_H);
        const int *kpos = kpos_st + stage * BN;

        if (pp)
            named_sync(2 + wg, 32 * NCW);
        float s[NNT * 4];
        issue_s<HD, SPLIT, BM>(s, qh_a, ql_a, ks_a);
        issue_pv<HD, SPLIT>(o, ph, pq, pv_v);
        if (pp)
            named_arrive(2 + (wg ^ 1), 32 * NCW);
        wg_wait<1>(); /* S landed; P V may still run */
        {
            const bool masked = !(kpos[BN - 1] <= q_lo); /* (warp-uniform) */
            uint32_t nh[NNT][2], nq[SPLIT ? NNT : 1][2];
            float c0, c1;
            softmax_tile<SPLIT>(s, kpos, masked, qp0, qp1, sc, m0, m1, l0, l1, nh, nq, c0, c1);
            wg_wait<0>(); /* the previous tile's P V is in O: its stage is free */
            if (prev >= 0 && lane == 0)
                mbar_arrive(empty + prev);
            rescale_keep<HD, SPLIT>(o, c0, c1, ph, pq, nh, nq);
        }
        pv_v = vs_a;
        prev = stage;
        if (++stage == ST) {
            stage = 0;
            phase ^= 1u;
        }
    }
    if (pp && wg == 0) /* the arrive of warpgroup 1's last issue */
        named_sync(2, 32 * NCW);
    /* the last tile's P V (its stage is not refilled: the walk is done) */
    wg_fence();
    issue_pv<HD, SPLIT>(o, ph, pq, pv_v);
    wg_wait<0>();

    store_rows<HD>(p, gk, split, r0, wr0, R, o, m0, m1, l0, l1);
#endif
}

template <int HD, bool SPLIT> cudaError_t ws_launch(const tkv_cuda_attn_params *p, cudaStream_t s)
{
    return tkv_pf_launch(p, s, BM, NTH, ws_cfg<HD, SPLIT>::SMEM, ws_kernel<HD, SPLIT, true>,
                         ws_kernel<HD, SPLIT, false>);
}

template <int HD, bool SPLIT> cudaError_t ws_init(int *ctas)
{
    return tkv_pf_setup(ctas, NTH, ws_cfg<HD, SPLIT>::SMEM, ws_kernel<HD, SPLIT, true>, ws_kernel<HD, SPLIT, false>);
}

tkv_pf_ctas g_ws_ctas; /* set by init */

} // namespace

cudaError_t tkv_cuda_attn_prefill_ws_init(void)
{
    if (!tkv_cuda_attn_prefill_wg_ok()) /* (set by tkv_cuda_attn_prefill_wg_init, called first) */
        return cudaSuccess;
    return tkv_pf_each([](auto hd, auto split) {
        return ws_init<decltype(hd)::value, decltype(split)::value>(&g_ws_ctas.at(hd, split));
    });
}

cudaError_t tkv_cuda_attn_prefill_ws(const tkv_cuda_attn_params *p, cudaStream_t s)
{
    return tkv_pf_one(p->head_dim, p->prefill_mode == TKV_ATTN_PREFILL_SPLIT, [&](auto hd, auto split) {
        return ws_launch<decltype(hd)::value, decltype(split)::value>(p, s);
    });
}

int tkv_cuda_attn_prefill_ws_ctas_per_sm(uint32_t head_dim, int mode) { return g_ws_ctas.get(head_dim, mode); }
