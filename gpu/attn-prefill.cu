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

#include <cuda_pipeline.h>

namespace {

constexpr int NT = 128, BM = 64, BN = 64;
constexpr float LN2f = 0.693147180559945309f;

template <int HD, bool SPLIT> struct pf_cfg {
    static constexpr int KSTR = HD + 8; /* halves per smem row */
    static constexpr size_t Q_BYTES = (size_t)BM * KSTR * 2;
    static constexpr size_t KV_BYTES = (size_t)2 * BN * KSTR * 2; /* two stages */
    static constexpr size_t RP_BYTES = (size_t)NT * sizeof(void *); /* packed walk: [4 warps][32] row addresses */
    static constexpr size_t SMEM = Q_BYTES * (SPLIT ? 2 : 1) + 2 * KV_BYTES + RP_BYTES + 2 * BN * 4 + BM * 4;
};

__device__ __forceinline__ uint32_t smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_t(uint32_t addr, uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

/* d += a b, m16n8k16, f16 inputs, f32 accumulators */
__device__ __forceinline__ void mma16816(float d[4], const uint32_t a[4], uint32_t b0, uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_h2(float lo, float hi)
{
    __half2 h = __floats2half2_rn(lo, hi);
    uint32_t u;
    memcpy(&u, &h, 4);
    return u;
}

/* hi = f16(x), and the f16 of what it left out */
__device__ __forceinline__ void split_h2(float x0, float x1, uint32_t &hi, uint32_t &lo)
{
    const __half2 h = __floats2half2_rn(x0, x1);
    const float2 back = __half22float2(h);
    memcpy(&hi, &h, 4);
    lo = pack_h2(x0 - back.x, x1 - back.y);
}

__device__ __forceinline__ void cp_async16(void *smem, const void *gmem)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(smem)), "l"(gmem) : "memory");
}

/* src-size 0 when !valid: nothing is read, the 16 bytes are zero-filled */
__device__ __forceinline__ void cp_async16z(void *smem, const void *gmem, bool valid)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem),
                 "r"(valid ? 16 : 0)
                 : "memory");
}

/* ---- the packed walk (PACK): tile t of a split = keys [x, x + 64) of the
 * concatenation of the head's refs, whatever their sizes ---------------------- */

/* Where a (KV head, split) stands: keys are numbered by p.kofs (the
 * prefix sums of the refs' lengths over the whole table). Every warp keeps
 * its own copy and computes the same values from the same loads. */
struct pk_cursor {
    uint32_t x, x_end; /* the next tile's first key; the split's end          */
    uint32_t i;        /* the ref holding key x (table index)                 */
    uint32_t w;        /* kofs[i + lane]: loaded one tile ahead, so that the
                          load is in flight while the current tile computes */
};

/* The split's keys: tiles [T*split/n_split, T*(split+1)/n_split) of the
 * head's T = ceil(keys / 64), and the ref holding the first one (a 32-way
 * search over the head's refs: about log32(refs) dependent loads, once per CTA). */
__device__ __forceinline__ void pk_start(const tkv_cuda_attn_params &p, uint32_t g, uint32_t split, pk_cursor &c)
{
    const uint32_t lane = threadIdx.x & 31;
    const uint32_t hb = __ldg(p.head_off + g), he = __ldg(p.head_off + g + 1);
    const uint32_t k0 = __ldg(p.kofs + hb), k1 = __ldg(p.kofs + he);
    const uint32_t T = (k1 - k0 + BN - 1) / BN;
    const uint32_t t0 = (uint32_t)((uint64_t)T * split / p.n_split);
    const uint32_t t1 = (uint32_t)((uint64_t)T * (split + 1) / p.n_split);
    c.x = k0 + t0 * BN;
    c.x_end = min(k1, k0 + t1 * BN);
    c.i = hb;
    c.w = 0;
    if (c.x >= c.x_end)
        return;
    if (t0 > 0) { /* the first ref b in [hb, he) that ends after x: kofs[b + 1] > x */
        uint32_t lo = hb, hi = he; /* it is in [lo, hi) */
        while (hi - lo > 1) {
            const uint32_t step = (hi - lo + 31) / 32, idx = lo + lane * step;
            const bool before = idx < hi && __ldg(p.kofs + idx + 1) <= c.x; /* a prefix of the lanes */
            const uint32_t n = (uint32_t)__popc(__ballot_sync(0xffffffffu, before));
            const uint32_t nhi = min(hi, lo + n * step + 1); /* probe n (if any) is at or after it */
            lo = n ? lo + (n - 1) * step + 1 : lo;          /* probe n - 1 is before it */
            hi = nhi;
        }
        c.i = lo;
    }
    c.w = __ldg(p.kofs + c.i + lane);
}

/* Resolves the 64 rows of the tile at the cursor and issues their cp.async
 * copies into one stage; advances the cursor; returns the tile's keys (0:
 * the split is done, or its next key is past pos_max: keys are in position
 * order, so nothing later is visible).
 *
 * Warp w owns rows 16w .. 16w+15: each of its lanes finds the ref and the
 * K (lanes 0-15) or V (lanes 16-31) address of row 16w + lane % 16 into
 * rp (this warp's 32 slots), then the warp issues the 16-byte copies of its
 * rows; no CTA barrier. Finding the rows: key x + j lies in ref i + (the
 * number of refs i, i+1, ... ending at or before x + j). The refs ending
 * inside the tile are among i .. i+62 (each holds at least one row), whose
 * ends kofs[i+1 .. i+63] are the cursor's window (one load per lane, and a
 * second only when refs i .. i+30 all end inside); bit (end - x) of M marks
 * each, so row j's ref is i + popc(M & bits 0..j) and it starts at the
 * highest of those bits (or at kofs[i]). Rows past the keys are zero-filled
 * (0 * V must stay 0) with position INT_MAX (never visible). */
template <int HD>
__device__ __forceinline__ int fill_packed(const tkv_cuda_attn_params &p, pk_cursor &c, int32_t pos_max,
                                          __half *Ks, __half *Vs, int *kpos, const uint16_t **rp)
{
    constexpr int KSTR = HD + 8, PER_ROW = HD / 8, UNITS = 16 * PER_ROW / 32;
    constexpr unsigned FULL = 0xffffffffu;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (c.x >= c.x_end)
        return 0;
    const uint32_t x = c.x, i = c.i, wa = c.w;
    const uint32_t s0 = __shfl_sync(FULL, wa, 0); /* ref i's first key (<= x) */
    const int32_t pos_i = __ldg(&p.blocks[i].pos0); /* checked below, after the rows' loads are issued */
    const int nk = (int)min(c.x_end - x, (uint32_t)BN);

    /* M: bit d set when one of refs i .. i+62 ends at x + d (1 <= d <= 63) */
    uint64_t bits = 0;
    if (lane > 0 && wa - x - 1u < 63u)
        bits = 1ull << (wa - x);
    const uint32_t a31 = __shfl_sync(FULL, wa, 31); /* end of ref i+30 */
    uint32_t wb = 0;
    if (a31 - x - 1u < 63u) { /* (uniform) refs i+31 .. may end inside too */
        wb = __ldg(p.kofs + i + 32 + lane);
        if (wb - x - 1u < 63u)
            bits |= 1ull << (wb - x);
    }
    const uint64_t M = (uint64_t)__reduce_or_sync(FULL, (uint32_t)(bits >> 32)) << 32 |
                       __reduce_or_sync(FULL, (uint32_t)bits);

    /* this lane's row */
    const int j = warp * 16 + (lane & 15);
    const uint16_t *src = (const uint16_t *)p.q_pos; /* 16-byte aligned; nothing is read from it */
    int32_t kp = INT_MAX;
    if (j < nk) {
        const uint64_t mm = M & ((2ull << j) - 1); /* bits 0 .. j (j = 63: all) */
        const uint32_t st = mm ? x + 63u - (uint32_t)__clzll((long long)mm) : s0;
        const uint32_t off = x + (uint32_t)j - st;
        const tkv_cuda_kv_entry *e = p.blocks + i + (uint32_t)__popcll(mm);
        const uint16_t *base =
            (const uint16_t *)__ldg((const unsigned long long *)(lane < 16 ? (const void *)&e->k : (const void *)&e->v));
        src = base + (size_t)off * HD;
        kp = __ldg(&e->pos0) + (int32_t)off;
    }
    if (pos_i + (int32_t)(x - s0) > pos_max) { /* (uniform) the tile's first key is not visible */
        c.x = c.x_end;
        return 0;
    }
    if (lane < 16)
        kpos[j] = kp;
    rp[lane] = src;
    __syncwarp();
#pragma unroll
    for (int it = 0; it < UNITS; it++) {
        const int u = lane + 32 * it, rr = u / PER_ROW, col = u % PER_ROW, row = warp * 16 + rr;
        const bool ok = row < nk;
        const uint16_t *ks = rp[rr], *vs = rp[16 + rr];
        cp_async16z(Ks + row * KSTR + col * 8, ok ? ks + col * 8 : ks, ok);
        cp_async16z(Vs + row * KSTR + col * 8, ok ? vs + col * 8 : vs, ok);
    }

    /* the ref holding key x + 64: refs i .. i+cnt-1 end inside, so ref
     * i+cnt holds key x + 63; the next one when it ends at x + 64 */
    const int cnt = __popcll(M);
    uint32_t e_next; /* kofs[i + cnt + 1] */
    if (cnt + 1 < 32)
        e_next = __shfl_sync(FULL, wa, cnt + 1);
    else if (cnt + 1 < 64) /* cnt >= 31: ref i+30 ended inside, wb was loaded */
        e_next = __shfl_sync(FULL, wb, cnt + 1 - 32);
    else /* 63 one-row refs */
        e_next = __ldg(p.kofs + i + 64);
    c.i = i + (uint32_t)cnt + (e_next == x + BN ? 1u : 0u);
    c.x = x + BN;
    if (c.x < c.x_end)
        c.w = __ldg(p.kofs + c.i + lane);
    return nk;
}

/* ---- the per-ref walk (!PACK) ------------------------------------------------ */

struct kv_cursor {
    uint32_t b, b_end, off;
};

/* Gathers up to BN keys at the cursor into one stage (cp.async, every thread
 * walking the same cursor), zeroes the rows after them, and advances the
 * cursor; returns the number of keys. */
template <int HD>
__device__ int fill_tile(const tkv_cuda_attn_params &p, kv_cursor &c, int32_t pos_max, __half *Ks, __half *Vs,
                         int *kpos)
{
    constexpr int KSTR = HD + 8, PER_ROW = HD / 8;
    const int tid = threadIdx.x;
    int nk = 0;
    while (nk < BN && c.b < c.b_end) {
        const tkv_cuda_kv_entry e = p.blocks[c.b];
        if (e.pos0 > pos_max) { /* blocks are in position order: none later is visible */
            c.b = c.b_end;
            break;
        }
        const int take = min((int)(e.n - min(c.off, e.n)), BN - nk);
        if (take > 0) {
            const uint4 *ks = (const uint4 *)(e.k + (size_t)c.off * HD), *vs = (const uint4 *)(e.v + (size_t)c.off * HD);
            for (int u = tid; u < take * PER_ROW; u += NT) {
                const int row = u / PER_ROW, col = u % PER_ROW;
                cp_async16(Ks + (nk + row) * KSTR + col * 8, ks + u);
                cp_async16(Vs + (nk + row) * KSTR + col * 8, vs + u);
            }
            for (int j = tid; j < take; j += NT)
                kpos[nk + j] = e.pos0 + (int32_t)(c.off + j);
        }
        nk += take;
        c.off += take;
        if (c.off >= e.n) {
            c.b++;
            c.off = 0;
        }
    }
    /* rows past the keys: zero (0 * V must stay 0), never visible */
    for (int u = tid; u < (BN - nk) * PER_ROW; u += NT) {
        const int row = nk + u / PER_ROW, col = u % PER_ROW;
        *(uint4 *)(Ks + row * KSTR + col * 8) = make_uint4(0, 0, 0, 0);
        *(uint4 *)(Vs + row * KSTR + col * 8) = make_uint4(0, 0, 0, 0);
    }
    for (int j = nk + tid; j < BN; j += NT)
        kpos[j] = INT_MAX;
    return nk;
}

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
    const uint32_t G = p.n_head / p.n_head_kv, ld = p.n_head * HD;
    const uint32_t r0 = blockIdx.x * BM;
    const int R = (int)min((uint32_t)BM, p.n_q * G - r0);

    /* the tile's queries: f32 -> f16 (hi, lo) */
    for (int i = tid; i < BM * HD / 2; i += NT) {
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
    for (int r = tid; r < BM; r += NT)
        qpos[r] = r < R ? p.q_pos[(r0 + r) / G] : INT_MIN;
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
        const uint32_t hb = p.head_off[gk], nbh = p.head_off[gk + 1] - hb;
        cur.b = hb + (uint32_t)((uint64_t)nbh * split / p.n_split);
        cur.b_end = hb + (uint32_t)((uint64_t)nbh * (split + 1) / p.n_split);
        cur.off = 0;
        nk = fill_tile<HD>(p, cur, pos_max, Ks_st, Vs_st, kpos_st);
    }
    int stage = 0;
    __pipeline_commit();
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
    const uint32_t n_rows = p.n_q * p.n_head;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int r = half ? row1 : row0;
        if (r >= R)
            continue;
        const float L = half ? l1 : l0, M = half ? m1 : m0;
        const uint32_t rr = r0 + r, tok = rr / G, h = gk * G + rr % G, row = tok * p.n_head + h;
        if (p.n_split == 1) {
            const float inv = L > 0.0f ? 1.0f / L : 0.0f;
            float *out = p.out + (size_t)row * HD;
#pragma unroll
            for (int dt = 0; dt < DT; dt++) {
                out[dt * 8 + 2 * t] = o[dt][2 * half] * inv;
                out[dt * 8 + 2 * t + 1] = o[dt][2 * half + 1] * inv;
            }
            if (p.lse && t == 0)
                p.lse[row] = L > 0.0f ? (M + log2f(L)) * LN2f : -INFINITY;
        } else {
            float *po = p.part + ((size_t)split * n_rows + row) * (HD + 2);
#pragma unroll
            for (int dt = 0; dt < DT; dt++) {
                po[dt * 8 + 2 * t] = o[dt][2 * half];
                po[dt * 8 + 2 * t + 1] = o[dt][2 * half + 1];
            }
            if (t == 0) {
                po[HD] = M;
                po[HD + 1] = L;
            }
        }
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
int g_pf_ctas[2][2] = {{1, 1}, {1, 1}};

} // namespace

cudaError_t tkv_cuda_attn_prefill_init(void)
{
    TKV_CUDA_TRY((init_pf<64, false>(&g_pf_ctas[0][0])));
    TKV_CUDA_TRY((init_pf<64, true>(&g_pf_ctas[0][1])));
    TKV_CUDA_TRY((init_pf<128, false>(&g_pf_ctas[1][0])));
    TKV_CUDA_TRY((init_pf<128, true>(&g_pf_ctas[1][1])));
    return cudaSuccess;
}

bool tkv_cuda_attn_prefill_ok(const tkv_cuda_attn_params *p)
{
    return p->prefill_mode != TKV_ATTN_PREFILL_GENERAL && p->vec16 && (p->head_dim == 64 || p->head_dim == 128);
}

bool tkv_cuda_attn_prefill_packed(const tkv_cuda_attn_params *p) { return p->prefill_pack && p->kofs != NULL; }

int tkv_cuda_attn_prefill_ctas_per_sm(uint32_t head_dim, int mode)
{
    return g_pf_ctas[head_dim == 64 ? 0 : 1][mode == TKV_ATTN_PREFILL_SPLIT ? 1 : 0];
}

cudaError_t tkv_cuda_attn_prefill(const tkv_cuda_attn_params *p, cudaStream_t s)
{
    const bool split = p->prefill_mode == TKV_ATTN_PREFILL_SPLIT;
    if (p->head_dim == 64)
        return split ? launch_pf<64, true>(p, s) : launch_pf<64, false>(p, s);
    return split ? launch_pf<128, true>(p, s) : launch_pf<128, false>(p, s);
}
