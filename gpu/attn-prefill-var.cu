/*
 * attn-prefill-var.cu -- variants v1 .. v6 of the tensor-core prefill kernel
 * (attn-prefill.cuh; v0 is attn-prefill.cu's kernel), kept side by side so
 * that tile shapes can be measured against each other on the same inputs
 * (p->prefill_variant; TKV_CUDA_ATTN_PREFILL_VARIANT, attn.cuh). Each does
 * all v0 does: f16 or split precision (SPLIT), the packed or per-ref walk
 * (PACK, the same fill code: attn-prefill-walk.cuh), causal by positions,
 * lse, split-K partials, head_dim 64 and 128.
 *
 * One template, pv_kernel<HD, SPLIT, PACK, W, MT, ST, QREG, F>: W warps, each
 * owning MT m16 tiles (16 MT consecutive query rows), so a CTA's row tile is
 * BM = 16 W MT rows (of n_q tokens x G heads, token-major, as v0: the G query
 * heads of a KV head share every K/V tile); ST K/V stages of 64 keys; the Q
 * fragments kept in registers for the whole walk (QREG) or read from shared
 * memory by ldmatrix at every step (fewer registers); F, flags of the loop's
 * schedule (PV_*, below; none for v1 .. v4).
 *
 *   v1  W 4, MT 1, ST 2, Q in registers: v0's shape (64 rows), with what
 *       every variant has over v0 (below); measures those changes alone
 *   v2  W 4, MT 2, ST 2, Q from shared memory: 128 rows, each warp 32, so
 *       every K/V fragment an ldmatrix brings feeds two m-tiles (half the
 *       shared-memory reads per MMA), as FlashAttention-2's 128 x 64 tile
 *   v3  W 8, MT 1, ST 2, Q in registers: 128 rows, 8 warps of 16 sharing
 *       each K/V stage (half the K/V fill and L2 reads per query row)
 *   v4  v3 with 3 stages (two tiles in flight while one is computed)
 *   v5  v2 + PV_ONEBAR (one CTA barrier per tile, not two), PV_PEARLY (P
 *       packed to f16 at the exponential), PV_LAZY (O rescaled only when a
 *       row max of the warp moved: after the first tiles of a long row,
 *       almost never)
 *   v6  v5 + PV_HALF (32-key softmax steps): v2's shape without spills in
 *       split precision (v2's 255 registers spill there)
 *
 * Common to v1 .. v6, against v0:
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
 *   - only the first 4 warps fill K/V stages (the walks are written for 4
 *     warps of 16 rows); a stage's key count goes to the others through
 *     shared memory, read after the barrier that publishes the stage
 *
 * Shared memory (KSTR = HD + 8 halves per row):
 *     Qh, Ql [BM][KSTR]          f16  queries (hi, lo; Ql only when SPLIT)
 *     Ks, Vs [ST][64][KSTR]      f16  K/V stages, rows past the keys zero
 *     rp [4][32]                 ptr  packed walk: the fill warps' row addresses
 *     kpos [ST][64], qpos [BM], nks [ST]  i32
 */
#include "attn-prefill.cuh"
#include "attn-prefill-walk.cuh"

#include <cuda_pipeline.h>

namespace {

using namespace tkv_pf;

constexpr float LN2v = 0.693147180559945309f;

/* Flags of pv_kernel's F (v5 on; v1 .. v4 have none). */
enum {
    PV_ONEBAR = 1, /* one CTA barrier per tile: the fill of tile t + ST - 1
                      is issued after the barrier that publishes tile t (it
                      proves every warp finished tile t - 1, whose stage it
                      reuses) instead of a second barrier after each tile */
    PV_PEARLY = 2, /* P packed to f16 (hi, lo) right after each exponential,
                      the f32 scores dead before P V starts */
    PV_LAZY = 4,   /* O rescaled only when some row of the warp has a new
                      max (the factor is exactly 1 otherwise) */
    PV_HALF = 8,   /* each 64-key tile in two steps of 32 keys (an online
                      softmax step each): S of 32 keys live beside O instead
                      of 64 (32 registers fewer at MT 2); the same K/V
                      fragment loads, Q's loaded twice when not in registers */
};

template <int HD, bool SPLIT, int W, int MT, int ST> struct pv_cfg {
    static constexpr int BM = 16 * W * MT;
    static constexpr int THREADS = 32 * W;
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

/* Fills one stage by the CTA's walk (called by the first NT threads only). */
template <int HD, bool PACK>
__device__ __forceinline__ int pv_fill(const tkv_cuda_attn_params &p, pk_cursor &pc, kv_cursor &cur, int32_t pos_max,
                                       __half *Ks, __half *Vs, int *kpos, const uint16_t **rp)
{
    return PACK ? fill_packed<HD>(p, pc, pos_max, Ks, Vs, kpos, rp) : fill_tile<HD>(p, cur, pos_max, Ks, Vs, kpos);
}

template <int HD, bool SPLIT, bool PACK, int W, int MT, int ST, bool QREG, int F>
__global__ void __launch_bounds__(32 * W, W == 4 ? 2 : 1) pv_kernel(const tkv_cuda_attn_params p)
{
    constexpr bool ONEBAR = (F & PV_ONEBAR) != 0, PEARLY = (F & PV_PEARLY) != 0, LAZY = (F & PV_LAZY) != 0;
    constexpr int NK = (F & PV_HALF) ? BN / 2 : BN, NNT = NK / 8; /* keys, n-tiles per step */
    using C = pv_cfg<HD, SPLIT, W, MT, ST>;
    constexpr int BM = C::BM, NTH = C::THREADS, KSTR = C::KSTR, KK = HD / 16, DT = HD / 8;
    static_assert(W * 32 >= NT, "the walks need 4 warps");
    extern __shared__ __align__(16) unsigned char smem[];
    __half *Qh = (__half *)smem;
    __half *Ql = (__half *)(smem + C::Q_BYTES); /* only when SPLIT */
    __half *Ks_st = (__half *)(smem + C::Q_BYTES * (SPLIT ? 2 : 1));
    __half *Vs_st = Ks_st + ST * BN * KSTR;
    const uint16_t **rp_all = (const uint16_t **)(Vs_st + ST * BN * KSTR); /* [4][32], PACK only */
    int *kpos_st = (int *)(rp_all + NT), *qpos = kpos_st + ST * BN, *nks = qpos + BM;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const uint32_t G = p.n_head / p.n_head_kv, ld = p.n_head * HD;
    /* heaviest row tiles first: blockIdx.x = (n_tiles - 1 - tile) * n_head_kv + KV head */
    const uint32_t n_tiles = gridDim.x / p.n_head_kv;
    const uint32_t tile = n_tiles - 1 - blockIdx.x / p.n_head_kv, gk = blockIdx.x % p.n_head_kv;
    const uint32_t split = blockIdx.y;
    const uint32_t r0 = tile * BM;
    const int R = (int)min((uint32_t)BM, p.n_q * G - r0);

    /* the tile's queries: f32 -> f16 (hi, lo) */
    for (int i = tid; i < BM * HD / 2; i += NTH) {
        const int r = i / (HD / 2), d = 2 * (i % (HD / 2));
        float x0 = 0.0f, x1 = 0.0f;
        if (r < R) {
            const uint32_t rr = r0 + r, tok = rr / G, h = gk * G + rr % G;
            const float *src = p.q + (size_t)tok * ld + (size_t)h * HD + d;
            x0 = src[0];
            x1 = src[1];
        }
        uint32_t hi, lo;
        split_h2(x0, x1, hi, lo);
        *(uint32_t *)(Qh + r * KSTR + d) = hi;
        if (SPLIT)
            *(uint32_t *)(Ql + r * KSTR + d) = lo;
    }
    for (int r = tid; r < BM; r += NTH)
        qpos[r] = r < R ? p.q_pos[(r0 + r) / G] : INT_MIN;
    const int32_t pos_max = p.q_pos[(r0 + R - 1) / G];

    /* this split's keys (the fill warps' cursors), the first ST - 1 tiles */
    const bool filler = tid < NT;
    const uint16_t **rp = rp_all + 32 * (warp & 3);
    pk_cursor pc = {};
    kv_cursor cur = {};
    if (filler) {
        if (PACK) {
            pk_start(p, gk, split, pc);
        } else {
            const uint32_t hb = p.head_off[gk], nbh = p.head_off[gk + 1] - hb;
            cur.b = hb + (uint32_t)((uint64_t)nbh * split / p.n_split);
            cur.b_end = hb + (uint32_t)((uint64_t)nbh * (split + 1) / p.n_split);
            cur.off = 0;
        }
    }
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

    /* Q fragments in registers (QREG): qa[mt][kk] covers dims kk*16 .. +15 */
    uint32_t qa[QREG ? MT : 1][QREG ? KK : 1][4], qla[QREG && SPLIT ? MT : 1][QREG && SPLIT ? KK : 1][4];
    if (QREG) {
        const int col = (lane >> 4) * 8;
#pragma unroll
        for (int mt = 0; mt < (QREG ? MT : 0); mt++) {
            const int row = wr0 + mt * 16 + (lane & 15);
#pragma unroll
            for (int kk = 0; kk < (QREG ? KK : 0); kk++) {
                ldsm_x4(smem_u32(Qh + row * KSTR + kk * 16 + col), qa[mt][kk][0], qa[mt][kk][1], qa[mt][kk][2],
                        qa[mt][kk][3]);
                if (SPLIT)
                    ldsm_x4(smem_u32(Ql + row * KSTR + kk * 16 + col), qla[mt][kk][0], qla[mt][kk][1],
                            qla[mt][kk][2], qla[mt][kk][3]);
            }
        }
    }

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
        if (ONEBAR) {
            /* tile t (the oldest group in flight) has landed; the barrier
             * publishes it and proves that every warp finished computing
             * tile t - 1, so its stage (fstage) takes tile t + ST - 1 now,
             * with no second barrier after the computation */
            __pipeline_wait_prior(ST - 2);
            __syncthreads();
            if (nks[stage] == 0) /* (uniform) the walk is done */
                break;
        }
        /* the tile ST - 1 ahead into the stage computed last (every warp
         * passed the barrier that ended that computation) */
        if (filler) {
            const int nk = pv_fill<HD, PACK>(p, pc, cur, pos_max, Ks_st + fstage * BN * KSTR,
                                             Vs_st + fstage * BN * KSTR, kpos_st + fstage * BN, rp);
            if (tid == 0)
                nks[fstage] = nk;
        }
        __pipeline_commit();
        if (!ONEBAR) {
            __pipeline_wait_prior(ST - 1);
            __syncthreads();
            if (nks[stage] == 0) /* (uniform) the walk is done */
                break;
        }
        const __half *Ks = Ks_st + stage * BN * KSTR, *Vs = Vs_st + stage * BN * KSTR;
        const int *kpos = kpos_st + stage * BN;

        /* HALF: the tile in two steps of 32 keys (S of 32 keys live, not 64) */
#pragma unroll 1
        for (int kb = 0; kb < BN; kb += NK) {
        if (kpos[kb] <= q_hi) { /* (warp-uniform) some row of the warp sees the step's first key */
            const bool masked = !(kpos[kb + NK - 1] <= q_lo); /* INT_MAX past the keys: masked */

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
                        if (QREG) {
#pragma unroll
                            for (int i = 0; i < 4; i++) {
                                a[mt][i] = qa[QREG ? mt : 0][QREG ? kk : 0][i];
                                if (SPLIT)
                                    al[SPLIT ? mt : 0][i] = qla[QREG && SPLIT ? mt : 0][QREG && SPLIT ? kk : 0][i];
                            }
                        } else {
                            const int row = wr0 + mt * 16 + (lane & 15), col = kk * 16 + (lane >> 4) * 8;
                            ldsm_x4(smem_u32(Qh + row * KSTR + col), a[mt][0], a[mt][1], a[mt][2], a[mt][3]);
                            if (SPLIT)
                                ldsm_x4(smem_u32(Ql + row * KSTR + col), al[SPLIT ? mt : 0][0],
                                        al[SPLIT ? mt : 0][1], al[SPLIT ? mt : 0][2], al[SPLIT ? mt : 0][3]);
                        }
                    }
#pragma unroll
                    for (int np = 0; np < NNT / 2; np++) {
                        uint32_t b0, b1, b2, b3;
                        ldsm_x4(smem_u32(Ks + (kb + np * 16 + key_l) * KSTR + kk * 16 + col_l), b0, b1, b2, b3);
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

            /* ---- mask (diagonal tiles), online softmax in log2 units */
            /* PEARLY: P as f16 (hi, lo when SPLIT) as soon as each
             * exponential is taken, the A fragments of P V: ph[mt][nt] holds
             * n-tile nt's rows g (0) and g + 8 (1), so k-step kq's A is
             * ph[2kq][0], ph[2kq][1], ph[2kq+1][0], ph[2kq+1][1] */
            uint32_t ph[PEARLY ? MT : 1][PEARLY ? NNT : 1][2];
            uint32_t pq[PEARLY && SPLIT ? MT : 1][PEARLY && SPLIT ? NNT : 1][2];
            float cf[MT][2];    /* the rows' rescale factors (LAZY) */
            bool moved = false; /* LAZY: some factor is not 1 */
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
                for (int nt = 0; nt < NNT; nt++)
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        if (masked) {
                            const int kp = kpos[kb + nt * 8 + 2 * t + e];
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
                    if (PEARLY) {
                        uint32_t *h = ph[PEARLY ? mt : 0][PEARLY ? nt : 0];
                        if (SPLIT) {
                            uint32_t *q = pq[PEARLY && SPLIT ? mt : 0][PEARLY && SPLIT ? nt : 0];
                            split_h2(s[mt][nt][0], s[mt][nt][1], h[0], q[0]);
                            split_h2(s[mt][nt][2], s[mt][nt][3], h[1], q[1]);
                        } else {
                            h[0] = pack_h2(s[mt][nt][0], s[mt][nt][1]);
                            h[1] = pack_h2(s[mt][nt][2], s[mt][nt][3]);
                        }
                    }
                }
                l[mt][0] = l[mt][0] * c0 + sum0; /* this thread's share; the row's 4 threads add up at the end */
                l[mt][1] = l[mt][1] * c1 + sum1;
                if (LAZY) { /* the rescale below, once for all m-tiles */
                    cf[mt][0] = c0;
                    cf[mt][1] = c1;
                    moved |= c0 != 1.0f || c1 != 1.0f;
                } else {
#pragma unroll
                    for (int dt = 0; dt < DT; dt++) {
                        o[mt][dt][0] *= c0;
                        o[mt][dt][1] *= c0;
                        o[mt][dt][2] *= c1;
                        o[mt][dt][3] *= c1;
                    }
                }
            }
            /* LAZY: once the row maxima settle (most tiles of a long causal
             * row), every factor is exactly 1 (2^0) and the warp skips the
             * MT * HD / 2 multiplies: the same result bit for bit (x * 1 is
             * x; a row whose m was -inf has l = 0 and O = 0 before and after). */
            if (LAZY && __any_sync(0xffffffffu, moved)) {
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
                for (int kq = 0; kq < NNT / 2; kq++) { /* keys kb + kq*16 .. +15 */
                    uint32_t pa[MT][4], pl[SPLIT ? MT : 1][4];
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        const float *s0 = s[mt][2 * kq], *s1 = s[mt][2 * kq + 1];
                        if (PEARLY) {
                            const uint32_t *h0 = ph[PEARLY ? mt : 0][PEARLY ? 2 * kq : 0];
                            const uint32_t *h1 = ph[PEARLY ? mt : 0][PEARLY ? 2 * kq + 1 : 0];
                            pa[mt][0] = h0[0];
                            pa[mt][1] = h0[1];
                            pa[mt][2] = h1[0];
                            pa[mt][3] = h1[1];
                            if (SPLIT) {
                                const uint32_t *q0 = pq[PEARLY && SPLIT ? mt : 0][PEARLY && SPLIT ? 2 * kq : 0];
                                const uint32_t *q1 = pq[PEARLY && SPLIT ? mt : 0][PEARLY && SPLIT ? 2 * kq + 1 : 0];
                                uint32_t *lo = pl[SPLIT ? mt : 0];
                                lo[0] = q0[0];
                                lo[1] = q0[1];
                                lo[2] = q1[0];
                                lo[3] = q1[1];
                            }
                        } else if (SPLIT) {
                            uint32_t *lo = pl[SPLIT ? mt : 0];
                            split_h2(s0[0], s0[1], pa[mt][0], lo[0]);
                            split_h2(s0[2], s0[3], pa[mt][1], lo[1]);
                            split_h2(s1[0], s1[1], pa[mt][2], lo[2]);
                            split_h2(s1[2], s1[3], pa[mt][3], lo[3]);
                        } else {
                            pa[mt][0] = pack_h2(s0[0], s0[1]);
                            pa[mt][1] = pack_h2(s0[2], s0[3]);
                            pa[mt][2] = pack_h2(s1[0], s1[1]);
                            pa[mt][3] = pack_h2(s1[2], s1[3]);
                        }
                    }
#pragma unroll
                    for (int dp = 0; dp < HD / 16; dp++) {
                        uint32_t b0, b1, b2, b3;
                        ldsm_x4_t(smem_u32(Vs + (kb + kq * 16 + key_l) * KSTR + dp * 16 + col_l), b0, b1, b2, b3);
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
        }
        if (!ONEBAR)
            __syncthreads(); /* before the next fill overwrites this stage */
        stage = stage + 1 == ST ? 0 : stage + 1;
        fstage = fstage + 1 == ST ? 0 : fstage + 1;
    }

    /* ---- results */
    const uint32_t n_rows = p.n_q * p.n_head;
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int half = 0; half < 2; half++) {
            float L = l[mt][half];
            L += __shfl_xor_sync(0xffffffffu, L, 1);
            L += __shfl_xor_sync(0xffffffffu, L, 2);
            const int r = wr0 + mt * 16 + g + 8 * half;
            if (r >= R)
                continue;
            const float M = m[mt][half];
            const uint32_t rr = r0 + r, tok = rr / G, h = gk * G + rr % G, row = tok * p.n_head + h;
            if (p.n_split == 1) {
                const float inv = L > 0.0f ? 1.0f / L : 0.0f;
                float *out = p.out + (size_t)row * HD;
#pragma unroll
                for (int dt = 0; dt < DT; dt++) {
                    out[dt * 8 + 2 * t] = o[mt][dt][2 * half] * inv;
                    out[dt * 8 + 2 * t + 1] = o[mt][dt][2 * half + 1] * inv;
                }
                if (p.lse && t == 0)
                    p.lse[row] = L > 0.0f ? (M + log2f(L)) * LN2v : -INFINITY;
            } else {
                float *po = p.part + ((size_t)split * n_rows + row) * (HD + 2);
#pragma unroll
                for (int dt = 0; dt < DT; dt++) {
                    po[dt * 8 + 2 * t] = o[mt][dt][2 * half];
                    po[dt * 8 + 2 * t + 1] = o[mt][dt][2 * half + 1];
                }
                if (t == 0) {
                    po[HD] = M;
                    po[HD + 1] = L;
                }
            }
        }
    }
}

/* ---- the variants' table, launch and init --------------------------------------- */

struct pv_shape {
    int W, MT, ST;
    bool QREG;
    int F; /* PV_* */
    const char *desc;
};

constexpr int N_VAR = TKV_ATTN_PREFILL_VARIANTS;

/* [0] is v0 (attn-prefill.cu), listed for its description */
constexpr pv_shape pv_shapes[N_VAR] = {
    {4, 1, 2, true, 0, "v0: 64 rows (4 warps x 16), Q in registers, 2 stages (attn-prefill.cu)"},
    {4, 1, 2, true, 0, "v1: v0's shape; folded scale + ex2, diagonal-only mask, heaviest tiles first"},
    {4, 2, 2, false, 0, "v2: 128 rows (4 warps x 32: 2 m-tiles per K/V fragment), Q from smem, 2 stages"},
    {8, 1, 2, true, 0, "v3: 128 rows (8 warps x 16 sharing each K/V stage), Q in registers, 2 stages"},
    {8, 1, 3, true, 0, "v4: v3 with 3 stages"},
    {4, 2, 2, false, PV_ONEBAR | PV_PEARLY | PV_LAZY,
     "v5: v2 + one barrier per tile, P to f16 at the exponential, O rescaled only when a max moves"},
    {4, 2, 2, false, PV_ONEBAR | PV_PEARLY | PV_LAZY | PV_HALF, "v6: v5 in steps of 32 keys (S of 32 keys live)"},
};

template <int HD, bool SPLIT, int W, int MT, int ST, bool QREG, int F>
cudaError_t pv_launch(const tkv_cuda_attn_params *p, cudaStream_t s)
{
    using C = pv_cfg<HD, SPLIT, W, MT, ST>;
    const uint32_t rows = p->n_q * (p->n_head / p->n_head_kv), tiles = (rows + C::BM - 1) / C::BM;
    const dim3 grid(tiles * p->n_head_kv, p->n_split);
    if (tkv_cuda_attn_prefill_packed(p))
        pv_kernel<HD, SPLIT, true, W, MT, ST, QREG, F><<<grid, C::THREADS, C::SMEM, s>>>(*p);
    else
        pv_kernel<HD, SPLIT, false, W, MT, ST, QREG, F><<<grid, C::THREADS, C::SMEM, s>>>(*p);
    TKV_CUDA_LAUNCHED();
    return cudaSuccess;
}

/* Both walks of one instance: the shared-memory limit, and CTAs per SM (the
 * smaller of the two). */
template <int HD, bool SPLIT, int W, int MT, int ST, bool QREG, int F> cudaError_t pv_init(int *ctas)
{
    using C = pv_cfg<HD, SPLIT, W, MT, ST>;
    int c[2];
    TKV_CUDA_TRY(cudaFuncSetAttribute(pv_kernel<HD, SPLIT, false, W, MT, ST, QREG, F>,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize, (int)C::SMEM));
    TKV_CUDA_TRY(cudaFuncSetAttribute(pv_kernel<HD, SPLIT, true, W, MT, ST, QREG, F>,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize, (int)C::SMEM));
    TKV_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&c[0], pv_kernel<HD, SPLIT, false, W, MT, ST, QREG, F>,
                                                               C::THREADS, C::SMEM));
    TKV_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&c[1], pv_kernel<HD, SPLIT, true, W, MT, ST, QREG, F>,
                                                               C::THREADS, C::SMEM));
    *ctas = c[0] < c[1] ? c[0] : c[1];
    if (*ctas < 1)
        *ctas = 1;
    return cudaSuccess;
}

/* CTAs per SM: [variant][head_dim 64, 128][f16, split] (set by init) */
int g_pv_ctas[N_VAR][2][2];

/* Instance (V, HD, SPLIT): launch, or init when p is NULL. */
template <int V, int HD, bool SPLIT> cudaError_t pv_call(const tkv_cuda_attn_params *p, cudaStream_t s)
{
    constexpr int W = pv_shapes[V].W, MT = pv_shapes[V].MT, ST = pv_shapes[V].ST;
    constexpr bool QREG = pv_shapes[V].QREG;
    constexpr int F = pv_shapes[V].F;
    if (!p)
        return pv_init<HD, SPLIT, W, MT, ST, QREG, F>(&g_pv_ctas[V][HD == 64 ? 0 : 1][SPLIT ? 1 : 0]);
    return pv_launch<HD, SPLIT, W, MT, ST, QREG, F>(p, s);
}

template <int V> cudaError_t pv_dispatch(const tkv_cuda_attn_params *p, uint32_t hd, bool split, cudaStream_t s)
{
    if (hd == 64)
        return split ? pv_call<V, 64, true>(p, s) : pv_call<V, 64, false>(p, s);
    return split ? pv_call<V, 128, true>(p, s) : pv_call<V, 128, false>(p, s);
}

cudaError_t pv_any(int v, const tkv_cuda_attn_params *p, uint32_t hd, bool split, cudaStream_t s)
{
    static_assert(N_VAR == 7, "a variant without a case here");
    switch (v) {
    case 1: return pv_dispatch<1>(p, hd, split, s);
    case 2: return pv_dispatch<2>(p, hd, split, s);
    case 3: return pv_dispatch<3>(p, hd, split, s);
    case 4: return pv_dispatch<4>(p, hd, split, s);
    case 5: return pv_dispatch<5>(p, hd, split, s);
    default: return pv_dispatch<6>(p, hd, split, s);
    }
}

} // namespace

cudaError_t tkv_cuda_attn_prefill_var_init(void)
{
    for (int v = 1; v < N_VAR; v++)
        for (int hd = 64; hd <= 128; hd += 64)
            for (int sp = 0; sp < 2; sp++)
                TKV_CUDA_TRY(pv_any(v, NULL, (uint32_t)hd, sp != 0, 0));
    return cudaSuccess;
}

cudaError_t tkv_cuda_attn_prefill_var(const tkv_cuda_attn_params *p, cudaStream_t s)
{
    /* the variant as resolved (p->prefill_variant is -1 by default) */
    return pv_any(tkv_cuda_attn_prefill_variant(p), p, p->head_dim, p->prefill_mode == TKV_ATTN_PREFILL_SPLIT, s);
}

uint32_t tkv_cuda_attn_prefill_var_rows(int variant)
{
    return (uint32_t)(16 * pv_shapes[variant].W * pv_shapes[variant].MT);
}

int tkv_cuda_attn_prefill_var_ctas_per_sm(int variant, uint32_t head_dim, int mode)
{
    const int c = g_pv_ctas[variant][head_dim == 64 ? 0 : 1][mode == TKV_ATTN_PREFILL_SPLIT ? 1 : 0];
    return c > 0 ? c : 1;
}

const char *tkv_cuda_attn_prefill_variant_desc(int variant)
{
    return variant >= 0 && variant < N_VAR ? pv_shapes[variant].desc : NULL;
}
