/*
 * attn-prefill-wg.cu -- variant v2 of the tensor-core prefill kernel
 * (attn-prefill.cuh): Hopper's warpgroup MMA (wgmma.mma_async) instead of
 * mma.sync. Built for sm_90a only (its own library, tkv_gpu_sm90a in
 * CMakeLists.txt: wgmma is an arch-specific instruction) and run only on a
 * device of compute capability 9.0; elsewhere variant 2 serves as v1
 * (tkv_cuda_attn_prefill_variant). Everything else is v1's: f16 or split
 * precision, the packed or per-ref walk (attn-prefill-walk.cuh, into the
 * swizzled layout), causal by positions, lse, split-K partials, head_dim 64
 * and 128, row tiles heaviest first.
 *
 * Shape: two warpgroups (8 warps, 256 threads), each owning 64 consecutive
 * query rows (a CTA's row tile is BM = 128 rows, as v1). Per 64-key tile a
 * warpgroup computes S = Q K^T by HD / 16 wgmma m64n64k16 with Q and K both
 * read from shared memory by descriptor, the online softmax in registers
 * (the accumulator's layout per warp is mma.sync's m16n8 C fragment, so the
 * code is v1's with one m-tile), then O += P V by 4 wgmma m64n{HD}k16 with
 * P from registers (the C fragment repacked to f16 is the A fragment) and V
 * from shared memory read N-major (transposed by the descriptor: V is
 * stored as K is, key by key). With SPLIT the low parts (Ql, Pl) are
 * multiplied too, as in v0 and v1.
 *
 * Shared memory, every region 1024-byte aligned (the 128-byte swizzle's
 * period): Qh (and Ql) [HD / 64][BM rows][128 bytes]; per stage K and V
 * [HD / 64][BN rows][128 bytes] (sw128_layout: unit u of a row's 128 bytes
 * at u ^ (row % 8)); then the walk's row pointers, kpos, qpos and nks.
 * Descriptors (PTX ISA, "Matrix Descriptor Format"): K-major operands (Q,
 * K) with the stride between 8-row groups SBO = 1024 and the k-step's 32
 * bytes added to the start address inside the 128-byte row; V N-major with
 * SBO = 1024 between 8-key groups and LBO = BN * 128 between the 64-column
 * halves of head_dim 128.
 *
 * Schedule: one CTA barrier per tile as v1: it publishes tile t (each
 * filling thread first makes its landed cp.async copies visible to the
 * wgmma's async proxy, fence.proxy.async) and proves that both warpgroups
 * finished iteration t - 1. Iteration t issues S_t, then the previous
 * tile's O += P V (so the tensor cores run it while this tile's
 * exponentials are taken), then warpgroup 0's warps (the walks are written
 * for 4 warps) issue the copies of tile t + PREF; it waits for S_t, takes
 * the softmax, waits for the P V, rescales O. ST = PREF + 2 stages: the
 * tiles in flight, the tile computed, the tile whose P V runs beside it;
 * the fill of iteration t takes the stage of tile t - 2, whose P V every
 * warp waited for before the barrier.
 */
#include "attn-prefill-wg.cuh"

#include <cuda_pipeline.h>

namespace {

using namespace tkv_wg;

constexpr int NWG = 2;         /* warpgroups */
constexpr int NTW = 128 * NWG; /* threads */
constexpr int BM = 64 * NWG;   /* query rows per CTA */
static_assert(BM == TKV_ATTN_PREFILL_VAR_ROWS, "the rows the plan counts");

constexpr int PREF = 2; /* tiles whose copies are in flight while one is computed */
constexpr int ST = PREF + 2; /* K/V stages: those, the tile computed, the tile whose P V runs beside it */

template <int HD, bool SPLIT> struct wg_cfg {
    static constexpr int REG = HD / 64;                     /* 64-column regions of a row */
    static constexpr size_t Q_BYTES = (size_t)REG * BM * 128;
    static constexpr size_t KV_BYTES = (size_t)REG * BN * 128; /* K or V of one stage */
    static constexpr size_t TAIL = (size_t)NT * sizeof(void *) + (size_t)ST * BN * 4 + (size_t)BM * 4 + (size_t)ST * 4;
    /* + 1024: the dynamic window is aligned up to the swizzle's period */
    static constexpr size_t SMEM = 1024 + Q_BYTES * (SPLIT ? 2 : 1) + 2 * ST * KV_BYTES + TAIL;
};

template <int HD, bool SPLIT, bool PACK>
__global__ void __launch_bounds__(NTW, 1) wg_kernel(const tkv_cuda_attn_params p)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using C = wg_cfg<HD, SPLIT>;
    constexpr int NNT = BN / 8;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const uint32_t raw = smem_u32(smem_raw);
    unsigned char *smem = smem_raw + (((raw + 1023u) & ~1023u) - raw);
    __half *Qh = (__half *)smem;
    __half *Ql = (__half *)(smem + C::Q_BYTES); /* only when SPLIT */
    __half *Ks_st = (__half *)(smem + C::Q_BYTES * (SPLIT ? 2 : 1));
    __half *Vs_st = (__half *)((unsigned char *)Ks_st + ST * C::KV_BYTES);
    const uint16_t **rp_all = (const uint16_t **)((unsigned char *)Vs_st + ST * C::KV_BYTES); /* [4][32] */
    int *kpos_st = (int *)(rp_all + NT), *qpos = kpos_st + ST * BN, *nks = qpos + BM;
    constexpr int KV_H = (int)(C::KV_BYTES / 2); /* a stage's K (or V), in halves */

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2;
    const int wg = tid >> 7, wwarp = warp & 3; /* warpgroup; warp within it */
    const cta_rows cr = cta_rows_of<BM>(p);
    const uint32_t G = cr.G, gk = cr.gk, split = cr.split, r0 = cr.r0;
    const int R = cr.R;

    const int32_t pos_max = p.q_pos[(r0 + R - 1) / G];

    const bool filler = tid < NT;
    const uint16_t **rp = rp_all + 32 * wwarp;
    pk_cursor pc = {};
    kv_cursor cur = {};
    if (filler)
        walk_start<PACK>(p, gk, split, pc, cur);
#pragma unroll
    for (int st = 0; st < PREF; st++) {
        if (filler) {
            const int nk = PACK ? fill_packed<HD, sw128_layout<HD>>(p, pc, pos_max, Ks_st + st * KV_H,
                                                                    Vs_st + st * KV_H, kpos_st + st * BN, rp)
                                : fill_tile<HD, sw128_layout<HD>>(p, cur, pos_max, Ks_st + st * KV_H,
                                                                  Vs_st + st * KV_H, kpos_st + st * BN);
            if (tid == 0)
                nks[st] = nk;
        }
        __pipeline_commit();
    }
    /* the tile's queries (f32 -> f16 hi, lo; the swizzled layout, BM rows)
     * while the first tiles' copies fly */
    load_queries<HD, BM, NTW, SPLIT, q_sw128<BM>>(p, gk, r0, R, Qh, Ql, qpos);
    fence_proxy_async(); /* the Q stores */
    __syncthreads();     /* Q and qpos in shared memory */

    /* this warp's rows: wr0 + g and wr0 + g + 8 (the warpgroup's rows wg0 .. wg0 + 63) */
    const int wg0 = wg * 64, wr0 = wg0 + wwarp * 16;
    const int32_t qp0 = qpos[wr0 + g], qp1 = qpos[wr0 + g + 8];
    const int32_t q_lo = qpos[wr0];                                                  /* the warp's lowest */
    const int32_t q_hi = wg0 < R ? qpos[min(wg0 + 64, R) - 1] : INT_MIN; /* the warpgroup's highest */

    float o[HD / 2];
#pragma unroll
    for (int i = 0; i < HD / 2; i++)
        o[i] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
    const float sc = p.scale_log2;
    const uint32_t qh_a = smem_u32(Qh) + wg0 * 128, ql_a = smem_u32(Ql) + wg0 * 128;

    /* P of the last tile, whose P V is issued in the next iteration beside
     * that tile's S = Q K^T, and where that tile's V is. Before the first
     * tile: P = 0 against stage 0's V (0 * V adds nothing; an empty walk
     * zeroes that V below). The wgmma groups are issued and waited for on
     * every iteration, in one straight line: under a branch, ptxas
     * serializes them (C7520). */
    uint32_t ph[NNT][2], pq[SPLIT ? NNT : 1][2];
#pragma unroll
    for (int nt = 0; nt < NNT; nt++) {
        ph[nt][0] = ph[nt][1] = 0;
        pq[SPLIT ? nt : 0][0] = pq[SPLIT ? nt : 0][1] = 0;
    }
    uint32_t pv_v = smem_u32(Vs_st);
    if (nks[0] == 0) /* (uniform) nothing to attend: no stage was written */
        for (int i = tid; i < KV_H / 8; i += NTW)
            ((uint4 *)Vs_st)[i] = make_uint4(0, 0, 0, 0);

    int stage = 0, fstage = PREF;
    for (;;) {
        __pipeline_wait_prior(PREF - 1); /* tile t landed */
        fence_proxy_async();             /* this thread's landed copies (and zero rows), for wgmma */
        /* publishes tile t; proves every warp finished iteration t - 1,
         * which waited for the P V of tile t - 2: its stage is free */
        __syncthreads();
        if (nks[stage] == 0) /* (uniform) the walk is done */
            break;
        const uint32_t ks_a = smem_u32(Ks_st + stage * KV_H), vs_a = smem_u32(Vs_st + stage * KV_H);
        const int *kpos = kpos_st + stage * BN;

        /* ---- issue S = Q K^T (unscaled; k-step kk is 32 bytes into region
         * kk / 4), then the previous tile's O += P V: the tensor cores run
         * P V while this tile's exponentials are taken. A tile no row of the
         * warpgroup sees (causal: at most the last one or two of the CTA's
         * walk) is computed and masked whole. */
        float s[NNT * 4];
        issue_s<HD, SPLIT, BM>(s, qh_a, ql_a, ks_a);
        issue_pv<HD, SPLIT>(o, ph, pq, pv_v);
        /* tile t + PREF into the stage of tile t + PREF - ST (= t - 2, whose
         * P V every warp waited for before the barrier), while the MMAs run */
        if (filler) {
            __half *Kf = Ks_st + fstage * KV_H, *Vf = Vs_st + fstage * KV_H;
            int *kf = kpos_st + fstage * BN;
            const int nk = PACK ? fill_packed<HD, sw128_layout<HD>>(p, pc, pos_max, Kf, Vf, kf, rp)
                                : fill_tile<HD, sw128_layout<HD>>(p, cur, pos_max, Kf, Vf, kf);
            if (tid == 0)
                nks[fstage] = nk;
        }
        __pipeline_commit();
        wg_wait<1>(); /* S landed; P V may still run */
        {
            const bool masked = !(kpos[BN - 1] <= q_lo); /* (warp-uniform) INT_MAX past the keys: masked */

            uint32_t nh[NNT][2], nq[SPLIT ? NNT : 1][2];
            float c0, c1;
            softmax_tile<SPLIT>(s, kpos, masked, qp0, qp1, sc, m0, m1, l0, l1, nh, nq, c0, c1);
            wg_wait<0>(); /* the previous tile's P V is in O */
            rescale_keep<HD, SPLIT>(o, c0, c1, ph, pq, nh, nq);
            pv_v = vs_a;
        }
        stage = stage + 1 == ST ? 0 : stage + 1;
        fstage = fstage + 1 == ST ? 0 : fstage + 1;
    }
    /* the last tile's P V (its stage was not refilled: the walk is done) */
    wg_fence();
    issue_pv<HD, SPLIT>(o, ph, pq, pv_v);
    wg_wait<0>();

    store_rows<HD>(p, gk, split, r0, wr0, R, o, m0, m1, l0, l1);
#endif
}

template <int HD, bool SPLIT> cudaError_t wg_launch(const tkv_cuda_attn_params *p, cudaStream_t s)
{
    return tkv_pf_launch(p, s, BM, NTW, wg_cfg<HD, SPLIT>::SMEM, wg_kernel<HD, SPLIT, true>, wg_kernel<HD, SPLIT, false>);
}

template <int HD, bool SPLIT> cudaError_t wg_init(int *ctas)
{
    return tkv_pf_setup(ctas, NTW, wg_cfg<HD, SPLIT>::SMEM, wg_kernel<HD, SPLIT, true>, wg_kernel<HD, SPLIT, false>);
}

tkv_pf_ctas g_wg_ctas; /* set by init */
bool g_wg_ok;        /* the device runs sm_90a code (set by init) */

} // namespace

cudaError_t tkv_cuda_attn_prefill_wg_init(void)
{
    int dev, major, minor;
    TKV_CUDA_TRY(cudaGetDevice(&dev));
    TKV_CUDA_TRY(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    TKV_CUDA_TRY(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
    g_wg_ok = major == 9 && minor == 0;
    if (!g_wg_ok)
        return cudaSuccess;
    return tkv_pf_each([](auto hd, auto split) {
        return wg_init<decltype(hd)::value, decltype(split)::value>(&g_wg_ctas.at(hd, split));
    });
}

bool tkv_cuda_attn_prefill_wg_ok(void) { return g_wg_ok; }

cudaError_t tkv_cuda_attn_prefill_wg(const tkv_cuda_attn_params *p, cudaStream_t s)
{
    return tkv_pf_one(p->head_dim, p->prefill_mode == TKV_ATTN_PREFILL_SPLIT, [&](auto hd, auto split) {
        return wg_launch<decltype(hd)::value, decltype(split)::value>(p, s);
    });
}

int tkv_cuda_attn_prefill_wg_ctas_per_sm(uint32_t head_dim, int mode) { return g_wg_ctas.get(head_dim, mode); }
