/*
 * attn.cu -- see attn.cuh. The general kernel: f32 CUDA-core math over
 * shared-memory tiles, for any number of query rows; it is also the
 * reference the faster kernels are checked against (TKV_CUDA_ATTN_DECODE=0
 * runs it for decode too). The host side of the attention op (block tables,
 * plan, work buffers) is at the end of this file.
 *
 * Shared memory of one CTA (HD = head_dim rounded up to 64/128/256,
 * R = 4096 / HD query rows, KT = 64 keys):
 *     Qs  [R][HD]          f32   the tile's queries (zero past head_dim)
 *     Ks  [2][KT][HD + 8]  f16   keys, two stages (rows padded: conflict-free
 *                                16 B reads)
 *     Vs  [2][KT][HD]      f16   values, two stages
 *     Ss  [R][KT + 1]      f32   scores, then probabilities
 *     Ms, Ls, Cs [R]       f32   running max (log2 units), sum, correction
 *     kpos [2][KT], qpos [R] i32
 * Key tiles are double-buffered: the next tile's K/V rows are in flight
 * (cp.async, 16 B each) while the current one is computed.
 * Scores are kept in log2 units (scaled by scale*log2 e) so exp2f is the
 * exponential; lse = (m + log2 l) * ln 2.
 */
#include "attn.cuh"
#include "attn-decode.cuh"
#include "attn-prefill.cuh"

#include <cuda_pipeline.h>
#include <stdlib.h>

namespace {

constexpr int KT = 64;
constexpr int NT = 128; /* threads per CTA */
constexpr float LN2 = 0.693147180559945309f;

template <int HD> struct attn_cfg {
    static constexpr int R = 4096 / HD;         /* query rows per tile            */
    static constexpr int KSTRIDE = HD + 8;      /* halves per Ks row              */
    static constexpr int RS = R / 2;            /* rows per thread, S phase       */
    static constexpr int PAIRS = HD / 2;        /* d pairs per row                */
    static constexpr int RG = NT / PAIRS;       /* row groups, PV phase           */
    static constexpr int RO = R / RG;           /* rows per thread, PV phase      */
    static constexpr size_t SMEM = (size_t)R * HD * 4 + 2 * ((size_t)KT * KSTRIDE * 2 + (size_t)KT * HD * 2) +
                                   (size_t)R * (KT + 1) * 4 + 3 * (size_t)R * 4 + 2 * (size_t)KT * 4 + (size_t)R * 4;
};

/* The blocks of one (KV head, split) still to read: block b from row off. */
struct kv_cursor {
    uint32_t b, b_end, off;
};

/* Gathers up to KT keys at the cursor into Ks/Vs/kpos (every thread walks
 * the same cursor) and advances it; returns the number of keys. The 16-byte
 * path only issues cp.async copies: wait for them before reading. */
template <int HD>
__device__ int fill_tile(const tkv_cuda_attn_params &p, kv_cursor &c, int32_t pos_max, __half *Ks, __half *Vs,
                         int *kpos)
{
    constexpr int KSTRIDE = attn_cfg<HD>::KSTRIDE;
    const int tid = threadIdx.x, hd = (int)p.head_dim;
    int nk = 0;
    while (nk < KT && c.b < c.b_end) {
        const tkv_cuda_kv_entry e = p.blocks[c.b];
        if (e.pos0 > pos_max) { /* blocks are in position order: none later is visible */
            c.b = c.b_end;
            break;
        }
        const int take = min((int)(e.n - min(c.off, e.n)), KT - nk);
        if (take > 0) {
            const uint16_t *ks = e.k + (size_t)c.off * hd, *vs = e.v + (size_t)c.off * hd;
            if (p.vec16) {
                const int per_row = hd / 8, total = take * per_row;
                for (int u = tid; u < total; u += NT) {
                    const int row = u / per_row, col = u % per_row;
                    __pipeline_memcpy_async(Ks + (nk + row) * KSTRIDE + col * 8, (const uint4 *)ks + u, 16);
                    __pipeline_memcpy_async(Vs + (nk + row) * HD + col * 8, (const uint4 *)vs + u, 16);
                }
            } else {
                const int total = take * hd;
                for (int u = tid; u < total; u += NT) {
                    const int row = u / hd, col = u % hd;
                    Ks[(nk + row) * KSTRIDE + col] = __ushort_as_half(ks[u]);
                    Vs[(nk + row) * HD + col] = __ushort_as_half(vs[u]);
                }
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
    return nk;
}

template <int HD>
__global__ void __launch_bounds__(NT) attn_kernel(const tkv_cuda_attn_params p)
{
    using C = attn_cfg<HD>;
    constexpr int R_MAX = C::R, KSTRIDE = C::KSTRIDE, RS = C::RS, PAIRS = C::PAIRS, RG = C::RG, RO = C::RO;
    extern __shared__ __align__(16) unsigned char smem[];
    float *Qs = (float *)smem;
    __half *Ks_st = (__half *)(Qs + R_MAX * HD);   /* [2][KT][KSTRIDE] */
    __half *Vs_st = Ks_st + 2 * KT * KSTRIDE;      /* [2][KT][HD]      */
    float *Ss = (float *)(Vs_st + 2 * KT * HD);
    float *Ms = Ss + R_MAX * (KT + 1), *Ls = Ms + R_MAX, *Cs = Ls + R_MAX;
    int *kpos_st = (int *)(Cs + R_MAX), *qpos = kpos_st + 2 * KT;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const uint32_t g = blockIdx.y, split = blockIdx.z;
    const uint32_t G = p.n_head / p.n_head_kv, hd = p.head_dim, ld = p.n_head * hd;
    const uint32_t r0 = blockIdx.x * R_MAX;
    const int R = (int)min((uint32_t)R_MAX, p.n_q * G - r0);

    /* queries of the tile: row r = (token, head of the group) */
    for (int i = tid; i < R * HD; i += NT) {
        const int r = i / HD, d = i % HD;
        const uint32_t rr = r0 + r, t = rr / G, h = g * G + rr % G;
        Qs[i] = d < (int)hd ? p.q[(size_t)t * ld + (size_t)h * hd + d] : 0.0f;
    }
    for (int r = tid; r < R_MAX; r += NT) {
        qpos[r] = r < R ? p.q_pos[(r0 + r) / G] : INT_MIN;
        Ms[r] = -INFINITY;
        Ls[r] = 0.0f;
        Cs[r] = 1.0f;
    }
    const int32_t pos_max = p.q_pos[(r0 + R - 1) / G];

    /* this split's blocks */
    const uint32_t hb = p.head_off[g], nbh = tkv_cuda_head_end(p, g) - hb;
    kv_cursor cur;
    cur.b = hb + (uint32_t)((uint64_t)nbh * split / p.n_split);
    cur.b_end = hb + (uint32_t)((uint64_t)nbh * (split + 1) / p.n_split);
    cur.off = 0;

    float2 o[RO];
#pragma unroll
    for (int i = 0; i < RO; i++)
        o[i] = make_float2(0.0f, 0.0f);
    const int dp = tid % PAIRS, rg = tid / PAIRS; /* PV-phase ownership */
    __syncthreads();

    int stage = 0;
    int nk = fill_tile<HD>(p, cur, pos_max, Ks_st, Vs_st, kpos_st);
    __pipeline_commit();
    while (nk > 0) {
        const __half *Ks = Ks_st + stage * KT * KSTRIDE, *Vs = Vs_st + stage * KT * HD;
        const int *kpos = kpos_st + stage * KT;
        /* start the next tile's copies, then wait for the current one */
        const int nk_next = fill_tile<HD>(p, cur, pos_max, Ks_st + (stage ^ 1) * KT * KSTRIDE,
                                          Vs_st + (stage ^ 1) * KT * HD, kpos_st + (stage ^ 1) * KT);
        __pipeline_commit();
        __pipeline_wait_prior(1);
        __syncthreads();

        /* ---- S = Q K^T (log2 units), masked: thread = key j, rows rp + 2i */
        {
            const int j = lane + 32 * (warp & 1), rp = warp >> 1;
            float acc[RS];
#pragma unroll
            for (int i = 0; i < RS; i++)
                acc[i] = 0.0f;
            if (j < nk) {
                for (int d8 = 0; d8 < (int)hd / 8; d8++) {
                    const uint4 kr = *(const uint4 *)(Ks + j * KSTRIDE + d8 * 8);
                    const __half2 *k2 = (const __half2 *)&kr;
                    const float2 k01 = __half22float2(k2[0]), k23 = __half22float2(k2[1]);
                    const float2 k45 = __half22float2(k2[2]), k67 = __half22float2(k2[3]);
#pragma unroll
                    for (int i = 0; i < RS; i++) {
                        const int r = rp + 2 * i;
                        if (r < R) {
                            const float4 qa = *(const float4 *)(Qs + r * HD + d8 * 8);
                            const float4 qb = *(const float4 *)(Qs + r * HD + d8 * 8 + 4);
                            acc[i] += qa.x * k01.x + qa.y * k01.y + qa.z * k23.x + qa.w * k23.y + qb.x * k45.x +
                                      qb.y * k45.y + qb.z * k67.x + qb.w * k67.y;
                        }
                    }
                }
            }
            const int kp = j < nk ? kpos[j] : INT_MAX;
#pragma unroll
            for (int i = 0; i < RS; i++) {
                const int r = rp + 2 * i;
                if (r < R)
                    Ss[r * (KT + 1) + j] = (j < nk && kp <= qpos[r]) ? acc[i] * p.scale_log2 : -INFINITY;
            }
        }
        __syncthreads();

        /* ---- online softmax: warp per row */
        for (int r = warp; r < R; r += NT / 32) {
            float *srow = Ss + r * (KT + 1);
            const float s0 = srow[lane], s1 = srow[lane + 32];
            const float mx = tkv_warp_max(fmaxf(s0, s1));
            const float m_old = Ms[r], m_new = fmaxf(m_old, mx);
            if (m_new == -INFINITY) { /* nothing visible to this row yet */
                srow[lane] = 0.0f;
                srow[lane + 32] = 0.0f;
                __syncwarp();
                if (lane == 0)
                    Cs[r] = 1.0f;
                continue;
            }
            const float corr = exp2f(m_old - m_new); /* 0 when m_old = -inf */
            const float p0 = exp2f(s0 - m_new), p1 = exp2f(s1 - m_new);
            srow[lane] = p0;
            srow[lane + 32] = p1;
            const float sum = tkv_warp_sum(p0 + p1);
            __syncwarp(); /* every lane has read Ms[r] before lane 0 writes it */
            if (lane == 0) {
                Ms[r] = m_new;
                Ls[r] = Ls[r] * corr + sum;
                Cs[r] = corr;
            }
        }
        __syncthreads();

        /* ---- O = O * corr + P V: thread = d pair dp, rows rg + RG*i */
#pragma unroll
        for (int i = 0; i < RO; i++) {
            const int r = rg + RG * i;
            if (r < R) {
                const float c = Cs[r];
                o[i].x *= c;
                o[i].y *= c;
            }
        }
        if (2 * dp < (int)hd) {
            for (int j = 0; j < nk; j++) {
                const float2 v = __half22float2(*(const __half2 *)(Vs + j * HD + 2 * dp));
#pragma unroll
                for (int i = 0; i < RO; i++) {
                    const int r = rg + RG * i;
                    if (r < R) {
                        const float pj = Ss[r * (KT + 1) + j];
                        o[i].x += pj * v.x;
                        o[i].y += pj * v.y;
                    }
                }
            }
        }
        __syncthreads(); /* before the next fill overwrites this stage and Ss */
        stage ^= 1;
        nk = nk_next;
    }

    /* ---- results: normalised output + lse, or the split's partial */
    const uint32_t n_rows = p.n_q * p.n_head;
#pragma unroll
    for (int i = 0; i < RO; i++) {
        const int r = rg + RG * i;
        if (r >= R || 2 * dp >= (int)hd)
            continue;
        const uint32_t rr = r0 + r, t = rr / G, h = g * G + rr % G, row = t * p.n_head + h;
        const float L = Ls[r], M = Ms[r];
        if (p.n_split == 1) {
            const float inv = L > 0.0f ? 1.0f / L : 0.0f;
            float *out = p.out + (size_t)row * hd + 2 * dp;
            out[0] = o[i].x * inv;
            out[1] = o[i].y * inv;
            if (p.lse && dp == 0)
                p.lse[row] = L > 0.0f ? (M + log2f(L)) * LN2 : -INFINITY;
        } else {
            float *po = p.part + ((size_t)split * n_rows + row) * (hd + 2);
            po[2 * dp] = o[i].x;
            po[2 * dp + 1] = o[i].y;
            if (dp == 0) {
                po[hd] = M;
                po[hd + 1] = L;
            }
        }
    }
}

/* One warp per (token, head): combine the splits by their log-sum-exp. */
__global__ void attn_merge_kernel(const float *part, uint32_t n_split, uint32_t n_rows, uint32_t hd, float *out,
                                  float *lse)
{
    const uint32_t row = blockIdx.x, lane = threadIdx.x;
    const size_t stride = (size_t)n_rows * (hd + 2);
    const float *p0 = part + (size_t)row * (hd + 2);
    float m = -INFINITY;
    for (uint32_t s = 0; s < n_split; s++) {
        const float *ps = p0 + s * stride;
        if (ps[hd + 1] > 0.0f)
            m = fmaxf(m, ps[hd]);
    }
    float l = 0.0f;
    if (m != -INFINITY)
        for (uint32_t s = 0; s < n_split; s++) {
            const float *ps = p0 + s * stride;
            if (ps[hd + 1] > 0.0f)
                l += ps[hd + 1] * exp2f(ps[hd] - m);
        }
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    for (uint32_t d = lane; d < hd; d += 32) {
        float acc = 0.0f;
        if (m != -INFINITY)
            for (uint32_t s = 0; s < n_split; s++) {
                const float *ps = p0 + s * stride;
                if (ps[hd + 1] > 0.0f)
                    acc += ps[d] * exp2f(ps[hd] - m);
            }
        out[(size_t)row * hd + d] = acc * inv;
    }
    if (lse && lane == 0)
        lse[row] = l > 0.0f ? (m + log2f(l)) * LN2 : -INFINITY;
}

bool use_decode(const tkv_cuda_attn_params *p)
{
    return p->decode_mode != TKV_ATTN_DECODE_OFF && p->vec16 &&
           p->n_q * (p->n_head / p->n_head_kv) <= TKV_ATTN_DECODE_ROWS;
}

template <int HD>
cudaError_t launch(const tkv_cuda_attn_params *p, cudaStream_t s)
{
    const uint32_t rows = p->n_q * (p->n_head / p->n_head_kv);
    const dim3 grid((rows + attn_cfg<HD>::R - 1) / attn_cfg<HD>::R, p->n_head_kv, p->n_split);
    attn_kernel<HD><<<grid, NT, attn_cfg<HD>::SMEM, s>>>(*p);
    TKV_CUDA_LAUNCHED();
    return cudaSuccess;
}

int hd_class(uint32_t hd) { return hd <= 64 ? 64 : hd <= 128 ? 128 : 256; }

} // namespace

bool tkv_cuda_attn_supported(uint32_t head_dim) { return head_dim >= 8 && head_dim <= 256 && head_dim % 8 == 0; }

/* CTAs of the general kernel of each head_dim class that fit on one
 * multiprocessor (set at init). */
static int g_ctas_per_sm[3] = {1, 1, 1};

template <int HD> static cudaError_t init_class(int *ctas)
{
    TKV_CUDA_TRY(cudaFuncSetAttribute(attn_kernel<HD>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      (int)attn_cfg<HD>::SMEM));
    TKV_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(ctas, attn_kernel<HD>, NT, attn_cfg<HD>::SMEM));
    if (*ctas < 1)
        *ctas = 1;
    return cudaSuccess;
}

cudaError_t tkv_cuda_attn_init(void)
{
    TKV_CUDA_TRY(init_class<64>(&g_ctas_per_sm[0]));
    TKV_CUDA_TRY(init_class<128>(&g_ctas_per_sm[1]));
    TKV_CUDA_TRY(init_class<256>(&g_ctas_per_sm[2]));
    TKV_CUDA_TRY(tkv_cuda_attn_decode_init());
    TKV_CUDA_TRY(tkv_cuda_attn_prefill_init());
    return cudaSuccess;
}

/* Floats of a call's split-K partials, [n_split][n_q*n_head][hd + 2]; 0
 * unsplit. */
static size_t part_floats(const tkv_cuda_attn_params *p)
{
    return p->n_split > 1 ? (size_t)p->n_split * p->n_q * p->n_head * (p->head_dim + 2) : 0;
}

size_t tkv_cuda_attn_plan(tkv_cuda_attn_params *p, uint32_t max_blocks, uint32_t max_tiles, int n_sm)
{
    const int cls = hd_class(p->head_dim), ci = cls == 64 ? 0 : cls == 128 ? 1 : 2;
    const uint32_t rows = p->n_q * (p->n_head / p->n_head_kv);
    uint32_t items, target, cap = 1024;
    if (use_decode(p)) { /* one CTA per (KV head, split) */
        items = p->n_head_kv;
        target = (uint32_t)(n_sm > 0 ? n_sm : 1) *
                 (uint32_t)tkv_cuda_attn_decode_ctas_per_sm(p->head_dim, rows, p->decode_mma != 0);
        cap = TKV_ATTN_DECODE_MAX_SPLIT;
    } else if (tkv_cuda_attn_prefill_ok(p)) {
        const uint32_t R = tkv_cuda_attn_prefill_rows(p);
        items = (rows + R - 1) / R * p->n_head_kv;
        target = (uint32_t)(n_sm > 0 ? n_sm : 1) * (uint32_t)tkv_cuda_attn_prefill_ctas_per_sm(p);
        if (tkv_cuda_attn_prefill_packed(p)) /* splits are cut between 64-key tiles */
            max_blocks = max_tiles;
    } else {
        const uint32_t R = 4096 / cls;
        items = (rows + R - 1) / R * p->n_head_kv;
        target = (uint32_t)(n_sm > 0 ? n_sm : 1) * (uint32_t)g_ctas_per_sm[ci];
    }
    /* enough CTAs for one full wave */
    p->n_split = 1;
    if (items < target && max_blocks > 1) {
        const uint32_t want = (target + items - 1) / items;
        p->n_split = want < max_blocks ? want : max_blocks;
        if (p->n_split > cap)
            p->n_split = cap;
        /* as few splits as give the same largest split: equal work per CTA
         * (512 blocks in 33 splits take as long as in 32 of 16 each) */
        const uint32_t per = (max_blocks + p->n_split - 1) / p->n_split;
        p->n_split = (max_blocks + per - 1) / per;
    }
    return part_floats(p);
}

cudaError_t tkv_cuda_attention(const tkv_cuda_attn_params *p, cudaStream_t s)
{
    if (p->n_q == 0)
        return cudaSuccess;
    if (use_decode(p))
        return tkv_cuda_attn_decode(p, s);
    if (tkv_cuda_attn_prefill_ok(p)) {
        TKV_CUDA_TRY(tkv_cuda_attn_prefill(p, s));
    } else {
        switch (hd_class(p->head_dim)) {
        case 64: TKV_CUDA_TRY(launch<64>(p, s)); break;
        case 128: TKV_CUDA_TRY(launch<128>(p, s)); break;
        default: TKV_CUDA_TRY(launch<256>(p, s)); break;
        }
    }
    if (p->n_split > 1) {
        const uint32_t n_rows = p->n_q * p->n_head;
        attn_merge_kernel<<<n_rows, 32, 0, s>>>(p->part, p->n_split, n_rows, p->head_dim, p->out, p->lse);
        TKV_CUDA_LAUNCHED();
    }
    return cudaSuccess;
}

/* ---- the attention op's host side ----------------------------------------------- */

#define N_TABLES 4 /* block tables in flight */
/* Chunks of K/V a warp of the decode kernel over inline runs asks L2 for
 * before its dependency wait. Measured (H100, session 44, llama3-8b Q4_0
 * step, docs/benchmarks.md): 2 gained 1% at 4K and 0.7-2.7% at 32K over
 * none; 8 the same at 4K and nothing at 32K (there a call's first 8 chunks
 * a warp are 68 MB, more than the H100's 50 MB of L2). */
#define ATTN_PREFETCH_DEFAULT 2u
/* kofs: entries past the last one, UINT32_MAX (the packed walk's windows
 * read kofs[i .. i+64] for any entry i) */
#define KOFS_PAD 64u
/* the packed walk's key numbers stay clear of 2^31 (x + 64 never wraps);
 * a table of more keys (all heads together) is walked per ref */
#define KOFS_MAX_KEYS ((uint64_t)1 << 31)

struct attn_table {
    void *host;           /* pinned [cap]                                         */
    void *dev;            /* device [cap]                                         */
    size_t cap;
    cudaEvent_t copied;   /* on the copy stream: the table is on the device        */
    cudaEvent_t used;     /* on the compute stream: the kernels that read it ended */
    bool pending;         /* `used` was recorded and may not have passed           */
};

struct tkv_cuda_attn_state {
    cudaStream_t copy;             /* host-to-device copies of the tables */
    struct attn_table tab[N_TABLES];
    unsigned next;
    float *part;                   /* [part_cap] split-K partials          */
    size_t part_cap;               /* floats                               */
    uint32_t *counters;            /* [counters_cap], zero between calls   */
    uint32_t counters_cap;
    int decode_mode, prefill_mode;
    int prefill_pack;              /* 0 with TKV_CUDA_ATTN_PACK=0          */
    int prefill_variant;           /* TKV_CUDA_ATTN_PREFILL_VARIANT, setter; -1: by precision */
    struct tkv_cuda_attn_runs runs;/* the inline table being built          */
    bool table_on_main;            /* TKV_CUDA_ATTN_TABLE=main             */
    bool runs_per_block;           /* tkv_attn_runs_build per block (the reference):
                                      TKV_CUDA_ATTN_RUNS_SCAN=block          */
    bool pdl;                      /* decode kernel: programmatic dependent launch */
    bool ws_pingpong;              /* prefill v3's warpgroups take turns; 0 with
                                      TKV_CUDA_ATTN_WS_PINGPONG=0            */
    uint32_t decode_splits;        /* TKV_CUDA_ATTN_DECODE_SPLITS: the decode kernel's
                                      splits per KV head (at most the blocks); 0: the plan's */
    bool pool;                     /* the decode kernel over device views with their
                                      keys as a pool (run_device_views); 0 with
                                      TKV_CUDA_ATTN_POOL=0, for A/B measurements */
    bool decode_mma;               /* tkv_cuda_attn_params.decode_mma; 0 with
                                      TKV_CUDA_ATTN_DECODE_MMA=0 (the CUDA-core kernel) */
    uint32_t prefetch;             /* tkv_cuda_attn_params.prefetch: TKV_CUDA_ATTN_PREFETCH
                                      (chunks a warp; unset: ATTN_PREFETCH_DEFAULT) */
    struct tkv_cuda_q8_act q8;     /* this call's planes to quantize out into (q8.q NULL: none) */
    bool q8_done;                  /* this call's kernels quantize out (launched) */
};

void tkv_cuda_attn_state_free(tkv_cuda_attn_state *st)
{
    if (!st)
        return;
    if (st->copy)
        cudaStreamSynchronize(st->copy);
    for (int i = 0; i < N_TABLES; i++) {
        struct attn_table *t = &st->tab[i];
        if (t->pending)
            cudaEventSynchronize(t->used);
        if (t->host)
            cudaFreeHost(t->host);
        if (t->dev)
            cudaFree(t->dev);
        if (t->copied)
            cudaEventDestroy(t->copied);
        if (t->used)
            cudaEventDestroy(t->used);
    }
    if (st->part)
        cudaFree(st->part);
    if (st->counters)
        cudaFree(st->counters);
    if (st->copy)
        cudaStreamDestroy(st->copy);
    free(st);
}

cudaError_t tkv_cuda_attn_state_create(int decode_mode, bool pdl, tkv_cuda_attn_state **out)
{
    *out = NULL;
    tkv_cuda_attn_state *st = (tkv_cuda_attn_state *)calloc(1, sizeof *st);
    if (!st)
        return cudaErrorMemoryAllocation;
    st->decode_mode = decode_mode;
    st->pdl = pdl;
    const char *splits = getenv("TKV_CUDA_ATTN_DECODE_SPLITS"); /* an experiment's knob (bench-attn -s decode-short) */
    st->decode_splits = splits ? (uint32_t)strtoul(splits, NULL, 10) : 0;
    st->prefill_variant = -1; /* by precision (tkv_cuda_attn_prefill_variant) */
    const char *tab = getenv("TKV_CUDA_ATTN_TABLE"), *pf = getenv("TKV_CUDA_ATTN_PREFILL");
    const char *pack = getenv("TKV_CUDA_ATTN_PACK"), *var = getenv("TKV_CUDA_ATTN_PREFILL_VARIANT");
    st->table_on_main = tab && !strcmp(tab, "main");
    const char *scan = getenv("TKV_CUDA_ATTN_RUNS_SCAN");
    st->runs_per_block = scan && !strcmp(scan, "block");
    st->prefill_pack = !(pack && !strcmp(pack, "0"));
    const char *pp = getenv("TKV_CUDA_ATTN_WS_PINGPONG");
    st->ws_pingpong = !(pp && !strcmp(pp, "0"));
    const char *pool = getenv("TKV_CUDA_ATTN_POOL");
    st->pool = !(pool && !strcmp(pool, "0"));
    const char *dmma = getenv("TKV_CUDA_ATTN_DECODE_MMA");
    st->decode_mma = !(dmma && !strcmp(dmma, "0"));
    const char *pfch = getenv("TKV_CUDA_ATTN_PREFETCH");
    st->prefetch = pfch ? (uint32_t)strtoul(pfch, NULL, 10) : ATTN_PREFETCH_DEFAULT;
    st->prefill_mode = pf && !strcmp(pf, "general") ? TKV_ATTN_PREFILL_GENERAL
                       : pf && !strcmp(pf, "mma16") ? TKV_ATTN_PREFILL_F16
                                                    : TKV_ATTN_PREFILL_SPLIT;
    /* "v1" or "1" (one digit, v optional): that variant where it exists;
     * anything else (or none): by precision */
    if (var && (var[0] == 'v' || var[0] == 'V'))
        var++;
    if (var && var[0] >= '0' && var[0] <= '9' && !var[1])
        tkv_cuda_attn_state_set_prefill_variant(st, var[0] - '0');
    cudaError_t e = cudaStreamCreateWithFlags(&st->copy, cudaStreamNonBlocking);
    for (int i = 0; i < N_TABLES && e == cudaSuccess; i++) {
        e = cudaEventCreateWithFlags(&st->tab[i].copied, cudaEventDisableTiming);
        if (e == cudaSuccess)
            e = cudaEventCreateWithFlags(&st->tab[i].used, cudaEventDisableTiming);
    }
    if (e != cudaSuccess) {
        tkv_cuda_attn_state_free(st);
        return e;
    }
    *out = st;
    return cudaSuccess;
}

bool tkv_cuda_attn_state_set_prefill_variant(tkv_cuda_attn_state *st, int variant)
{
    if (variant < 0 || variant >= TKV_ATTN_PREFILL_VARIANTS)
        return false;
    st->prefill_variant = variant;
    return true;
}

/* Grows *buf to at least n elements of size el; the old buffer may still be
 * read by kernels queued on s, so s is drained first. zero: clear the new one. */
static cudaError_t grow(void **buf, size_t *cap, size_t n, size_t el, bool zero, cudaStream_t s)
{
    if (n <= *cap)
        return cudaSuccess;
    const size_t c = n > *cap + *cap / 2 ? n : *cap + *cap / 2;
    TKV_CUDA_TRY(cudaStreamSynchronize(s));
    if (*buf)
        TKV_CUDA_TRY(cudaFree(*buf));
    *buf = NULL;
    *cap = 0;
    TKV_CUDA_TRY(cudaMalloc(buf, c * el));
    if (zero)
        TKV_CUDA_TRY(cudaMemsetAsync(*buf, 0, c * el, s));
    *cap = c;
    return cudaSuccess;
}

/* ---- decode over inline runs (TKV_ATTN_DECODE_RUNS) ---- */

/* The kernel parameters every path takes from the call and the state: the
 * query, outputs and shape, the scale in log2 units, the decode mode. */
static tkv_cuda_attn_params params_of(const tkv_cuda_attn_state *st, const struct tkv_attn_args *a)
{
    tkv_cuda_attn_params p;
    memset(&p, 0, sizeof p);
    p.q = a->q;
    p.out = a->out;
    p.lse = a->lse;
    p.n_q = a->n_q;
    p.n_head = a->n_head;
    p.n_head_kv = a->n_head_kv;
    p.head_dim = a->head_dim;
    p.scale_log2 = a->scale * 1.44269504088896341f;
    p.decode_mode = st->decode_mode;
    p.decode_mma = st->decode_mma;
    p.prefetch = st->prefetch;
    if (a->head_dim % 32 == 0) /* the planes' blocks: whole lane groups (q8_out) */
        p.q8 = st->q8;
    return p;
}

/* Right before p's launch: only the decode kernels quantize out (p->q8);
 * notes whether these will. */
static void q8_settle(tkv_cuda_attn_state *st, tkv_cuda_attn_params *p)
{
    if (!use_decode(p))
        p->q8.q = NULL;
    st->q8_done = p->q8.q != NULL;
}

/* A table buffer of at least `bytes` whose last kernels have finished
 * (host and device side free). */
static cudaError_t table_take(tkv_cuda_attn_state *st, size_t bytes, struct attn_table **out)
{
    struct attn_table *t = &st->tab[st->next++ % N_TABLES];
    if (t->pending) {
        TKV_CUDA_TRY(cudaEventSynchronize(t->used));
        t->pending = false;
    }
    if (bytes > t->cap) {
        const size_t cap = bytes > 2 * t->cap ? (bytes > (64u << 10) ? bytes : (64u << 10)) : 2 * t->cap;
        if (t->host)
            TKV_CUDA_TRY(cudaFreeHost(t->host));
        if (t->dev)
            TKV_CUDA_TRY(cudaFree(t->dev));
        t->host = t->dev = NULL;
        t->cap = 0;
        TKV_CUDA_TRY(cudaMallocHost(&t->host, cap));
        TKV_CUDA_TRY(cudaMalloc(&t->dev, cap));
        t->cap = cap;
    }
    *out = t;
    return cudaSuccess;
}

/* Copies the first `used` bytes of t on the copy stream (overlapping the
 * compute queued before) and makes the compute stream s wait for them; the
 * caller records t->used on s after the kernels that read it. */
static cudaError_t table_send(tkv_cuda_attn_state *st, struct attn_table *t, size_t used, cudaStream_t s)
{
    cudaStream_t cs = st->table_on_main ? s : st->copy;
    TKV_CUDA_TRY(cudaMemcpyAsync(t->dev, t->host, used, cudaMemcpyHostToDevice, cs));
    TKV_CUDA_TRY(cudaEventRecord(t->used, cs)); /* until the kernels are queued */
    t->pending = true;
    if (cs != s) {
        TKV_CUDA_TRY(cudaEventRecord(t->copied, cs));
        TKV_CUDA_TRY(cudaStreamWaitEvent(s, t->copied, 0));
    }
    return cudaSuccess;
}

/* Sets up the split-K partials and the fused merge's counters for p (planned). */
static cudaError_t splits_ready(tkv_cuda_attn_state *st, tkv_cuda_attn_params *p, size_t part, cudaStream_t s)
{
    if (part) {
        TKV_CUDA_TRY(grow((void **)&st->part, &st->part_cap, part, sizeof(float), false, s));
        p->part = st->part;
    }
    if (use_decode(p) && p->n_split > 1 && p->decode_mode != TKV_ATTN_DECODE_MERGE) { /* the fused merge */
        size_t cap = st->counters_cap;
        TKV_CUDA_TRY(grow((void **)&st->counters, &cap, p->n_head_kv, sizeof(uint32_t), true, s));
        st->counters_cap = (uint32_t)cap;
        p->counters = st->counters;
    }
    return cudaSuccess;
}

/* A decode call over device views (a->kv_dev): the entries stay where they
 * are (one array in device memory, head g's from kv[g].blocks); only the
 * query positions and each head's first and end entry travel (with
 * kv_dev_n the end a bound, the kernels reading the counts), as
 *     q_pos [n_q] i32 | head_off [n_head_kv + 1] u32 | head_end [n_head_kv] u32 */
static cudaError_t run_device_views(tkv_cuda_attn_state *st, const struct tkv_attn_args *a, int n_sm, cudaStream_t s)
{
    const uint32_t H = a->n_head_kv;
    const struct tkv_kv_block_ref *base = NULL;
    uint32_t max_blocks = 0;
    for (uint32_t g = 0; g < H; g++) {
        if (a->kv[g].n_blocks && (!base || a->kv[g].blocks < base))
            base = a->kv[g].blocks;
        max_blocks = a->kv[g].n_blocks > max_blocks ? a->kv[g].n_blocks : max_blocks;
    }
    tkv_cuda_attn_params p = params_of(st, a);
    p.blocks = (const struct tkv_cuda_kv_entry *)base;
    p.head_cnt = a->kv_dev_n, p.head_cnt_stride = a->kv_dev_n_stride; /* (n_blocks: bounds then) */
    p.vec16 = a->head_dim % 8 == 0;
    p.pdl = st->pdl;
    /* each head's entries [off, end) from base, off + n_blocks <= 2^32 */
    const auto range = [&](uint32_t g, uint32_t *off, uint32_t *end) {
        const size_t o = a->kv[g].n_blocks ? (size_t)(a->kv[g].blocks - base) : 0;
        if (o + a->kv[g].n_blocks > UINT32_MAX)
            return false; /* views farther apart than 2^32 entries */
        *off = (uint32_t)o;
        *end = (uint32_t)o + a->kv[g].n_blocks;
        return true;
    };
    if (use_decode(&p) && H <= TKV_ATTN_RUNS_HEADS) { /* the tables in the parameters: nothing staged */
        tkv_cuda_attn_views v;
        memset(&v, 0, sizeof v);
        memcpy(v.q_pos, a->q_pos, (size_t)a->n_q * sizeof(int32_t)); /* n_q <= rows <= 8 */
        for (uint32_t g = 0; g < H; g++)
            if (!range(g, &v.head_off[g], &v.head_end[g]))
                return cudaErrorInvalidValue;
        size_t part = tkv_cuda_attn_plan(&p, max_blocks, max_blocks, n_sm);
        if (a->kv_dev_n && a->kv_dev_keys && st->pool && p.n_split > 1 && p.decode_mode != TKV_ATTN_DECODE_MERGE &&
            (uint64_t)H * p.n_split <= TKV_ATTN_DECODE_MAX_SPLIT) {
            /* the plan's T = H x n_split CTAs as one pool the heads share by
             * their keys (attn-decode.cu, pool_part; equal keys give the
             * plan's splits), each head's partials sized for T */
            p.n_split *= H;
            p.head_keys = a->kv_dev_keys;
            part = part_floats(&p);
        }
        TKV_CUDA_TRY(splits_ready(st, &p, part, s));
        q8_settle(st, &p);
        return tkv_cuda_attn_decode_views(&p, &v, s);
    }
    const size_t off_h = ((size_t)a->n_q * sizeof(int32_t) + 7) & ~(size_t)7;
    const size_t off_e = off_h + ((size_t)H + 1) * sizeof(uint32_t), used = off_e + (size_t)H * sizeof(uint32_t);
    struct attn_table *t;
    TKV_CUDA_TRY(table_take(st, used, &t));
    uint8_t *h = (uint8_t *)t->host;
    memcpy(h, a->q_pos, (size_t)a->n_q * sizeof(int32_t));
    uint32_t *head_off = (uint32_t *)(h + off_h), *head_end = (uint32_t *)(h + off_e);
    for (uint32_t g = 0; g < H; g++)
        if (!range(g, &head_off[g], &head_end[g]))
            return cudaErrorInvalidValue;
    head_off[H] = H ? head_end[H - 1] : 0;
    TKV_CUDA_TRY(table_send(st, t, used, s));

    p.q_pos = (const int32_t *)t->dev;
    p.head_off = (const uint32_t *)((uint8_t *)t->dev + off_h);
    p.head_end = (const uint32_t *)((uint8_t *)t->dev + off_e);
    const size_t part = tkv_cuda_attn_plan(&p, max_blocks, max_blocks, n_sm);
    TKV_CUDA_TRY(splits_ready(st, &p, part, s));
    q8_settle(st, &p);
    TKV_CUDA_TRY(tkv_cuda_attention(&p, s));
    TKV_CUDA_TRY(cudaEventRecord(t->used, s));
    return cudaSuccess;
}

/* The fewest chunks a split of the decode kernel over inline runs takes
 * (run_inline): 4 a warp. */
#define RUN_SPLIT_CHUNKS 16u

/* Runs a decode call over inline runs; *done false when the view does not
 * fit them (nothing queued: the packed table serves the call). */
static cudaError_t run_inline(tkv_cuda_attn_state *st, const struct tkv_attn_args *a, int n_sm, cudaStream_t s,
                              bool *done)
{
    *done = false;
    const uint32_t G = a->n_head / a->n_head_kv, rows = a->n_q * G;
    if (rows > TKV_ATTN_DECODE_ROWS)
        return cudaSuccess;
    uint32_t max_chunks;
    if (!tkv_attn_runs_build(&st->runs, a, tkv_cuda_attn_decode_chunk_keys(a->head_dim, rows), st->runs_per_block,
                             &max_chunks))
        return cudaSuccess;
    tkv_cuda_attn_params p = params_of(st, a);
    p.vec16 = 1;
    /* one full wave: every CTA slot of the device busy, each split of a head
     * the same number of chunks to one; but no fewer than RUN_SPLIT_CHUNKS
     * chunks a split, so that at short contexts (4K keys on Llama-3-8B's
     * heads) the call takes one CTA an SM, not two: inside the decode step
     * the other slot then holds the next GEMV's CTAs, whose weight loads go
     * out before their wait (measured: docs/benchmarks.md, "Session 47") */
    const uint32_t slots = (uint32_t)(n_sm > 0 ? n_sm : 1) *
                           (uint32_t)tkv_cuda_attn_decode_ctas_per_sm(a->head_dim, rows, p.decode_mma != 0);
    const uint32_t wave = (slots + a->n_head_kv - 1) / a->n_head_kv;
    const uint32_t by_chunks = (max_chunks + RUN_SPLIT_CHUNKS - 1) / RUN_SPLIT_CHUNKS;
    uint32_t n_split = st->decode_splits ? st->decode_splits : wave < by_chunks ? wave : by_chunks;
    n_split = n_split < max_chunks ? n_split : max_chunks;
    n_split = n_split < TKV_ATTN_DECODE_MAX_SPLIT ? n_split : TKV_ATTN_DECODE_MAX_SPLIT;
    p.n_split = n_split > 0 ? n_split : 1;
    TKV_CUDA_TRY(splits_ready(st, &p, part_floats(&p), s));
    q8_settle(st, &p);
    TKV_CUDA_TRY(tkv_cuda_attn_decode_runs(&p, &st->runs, st->pdl, s));
    *done = true;
    return cudaSuccess;
}

/* tkv_cuda_attn_run with the quantization request in st->q8 */
static cudaError_t run_call(tkv_cuda_attn_state *st, const struct tkv_attn_args *a, int n_sm, cudaStream_t s)
{
    if (a->n_q == 0)
        return cudaSuccess;
    if (a->kv_dev)
        return run_device_views(st, a, n_sm, s);
    if (st->decode_mode == TKV_ATTN_DECODE_RUNS) {
        bool done;
        TKV_CUDA_TRY(run_inline(st, a, n_sm, s, &done));
        if (done)
            return cudaSuccess;
    }
    uint64_t total = 0;
    for (uint32_t g = 0; g < a->n_head_kv; g++)
        total += a->kv[g].n_blocks;
    const size_t off_h = ((size_t)a->n_q * sizeof(int32_t) + 7) & ~(size_t)7;
    const size_t off_e = off_h + ((((size_t)a->n_head_kv + 1) * sizeof(uint32_t) + 7) & ~(size_t)7);
    const size_t off_k = off_e + (size_t)total * sizeof(struct tkv_cuda_kv_entry);
    const size_t bytes = off_k + ((size_t)total + 1 + KOFS_PAD) * sizeof(uint32_t);
    struct attn_table *t;
    TKV_CUDA_TRY(table_take(st, bytes, &t));

    /* pack; refs of no rows are left out (the packed walk needs every ref to
     * hold a row; no kernel reads anything from them) */
    uint8_t *h = (uint8_t *)t->host;
    memcpy(h, a->q_pos, (size_t)a->n_q * sizeof(int32_t));
    uint32_t *head_off = (uint32_t *)(h + off_h);
    struct tkv_cuda_kv_entry *ent = (struct tkv_cuda_kv_entry *)(h + off_e);
    uint32_t *kofs = (uint32_t *)(h + off_k);
    uintptr_t addr_bits = 0;
    uint32_t k = 0, max_blocks = 0, max_tiles = 0;
    uint64_t keys = 0; /* kofs[k]: keys before entry k, over all heads */
    for (uint32_t g = 0; g < a->n_head_kv; g++) {
        head_off[g] = k;
        const uint64_t keys0 = keys;
        const struct tkv_kv_block_ref *r = a->kv[g].blocks;
        for (uint32_t i = 0; i < a->kv[g].n_blocks; i++) {
            if (r[i].n == 0)
                continue;
            ent[k].k = r[i].k;
            ent[k].v = r[i].v;
            ent[k].pos0 = r[i].pos0;
            ent[k].n = r[i].n;
            addr_bits |= (uintptr_t)r[i].k | (uintptr_t)r[i].v;
            kofs[k++] = (uint32_t)keys; /* wraps only past KOFS_MAX_KEYS: then unused */
            keys += r[i].n;
        }
        const uint32_t nb = k - head_off[g];
        const uint64_t tiles = (keys - keys0 + 63) / 64;
        max_blocks = nb > max_blocks ? nb : max_blocks;
        max_tiles = tiles > max_tiles ? (uint32_t)(tiles < UINT32_MAX ? tiles : UINT32_MAX) : max_tiles;
    }
    head_off[a->n_head_kv] = k;
    kofs[k] = (uint32_t)keys;
    for (uint32_t i = 1; i <= KOFS_PAD; i++) /* the packed walk's windows read up to 64 entries on */
        kofs[k + i] = UINT32_MAX;
    const size_t used = off_k + ((size_t)k + 1 + KOFS_PAD) * sizeof(uint32_t);

    TKV_CUDA_TRY(table_send(st, t, used, s));

    tkv_cuda_attn_params p = params_of(st, a);
    p.q_pos = (const int32_t *)t->dev;
    p.blocks = (const struct tkv_cuda_kv_entry *)((uint8_t *)t->dev + off_e);
    p.head_off = (const uint32_t *)((uint8_t *)t->dev + off_h);
    p.kofs = keys <= KOFS_MAX_KEYS ? (const uint32_t *)((uint8_t *)t->dev + off_k) : NULL;
    p.vec16 = (addr_bits % 16) == 0 && a->head_dim % 8 == 0;
    p.prefill_mode = st->prefill_mode;
    p.prefill_pack = st->prefill_pack;
    p.prefill_variant = st->prefill_variant;
    p.pdl = st->pdl;
    p.ws_pingpong = st->ws_pingpong;
    size_t part = tkv_cuda_attn_plan(&p, max_blocks, max_tiles, n_sm);
    if (st->decode_splits && use_decode(&p)) {
        uint32_t n = st->decode_splits < max_blocks ? st->decode_splits : max_blocks;
        n = n < (uint32_t)TKV_ATTN_DECODE_MAX_SPLIT ? n : (uint32_t)TKV_ATTN_DECODE_MAX_SPLIT;
        p.n_split = n > 0 ? n : 1;
        part = part_floats(&p);
    }
    TKV_CUDA_TRY(splits_ready(st, &p, part, s));
    q8_settle(st, &p);
    TKV_CUDA_TRY(tkv_cuda_attention(&p, s));
    TKV_CUDA_TRY(cudaEventRecord(t->used, s));
    return cudaSuccess;
}

cudaError_t tkv_cuda_attn_run(tkv_cuda_attn_state *st, const struct tkv_attn_args *a, const struct tkv_cuda_q8_act *q8,
                              int n_sm, cudaStream_t s, bool *q8_done)
{
    if (q8)
        st->q8 = *q8;
    else
        memset(&st->q8, 0, sizeof st->q8);
    st->q8_done = false;
    const cudaError_t e = run_call(st, a, n_sm, s);
    *q8_done = e == cudaSuccess && st->q8_done;
    return e;
}
