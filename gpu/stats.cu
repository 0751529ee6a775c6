/*
 * stats.cu -- see stats.cuh. The reference is runtime/policy/policy-util.c
 * (tkv_segment_block_probs, tkv_entropy, tkv_policy_window_scores,
 * tkv_policy_pool); each kernel names the reference lines it reproduces.
 *
 * SEGMENT, three launches:
 *   seg_qmid     midrange query qmid[h][c] = (max_t q + min_t q) / 2, f32
 *                (32 columns x 8 row slices per CTA)
 *   seg_scores   one warp per key block j of KV head g: element-wise max/min
 *                of the block's keys into shared memory, then per query head
 *                of the group (one lane each) the f64 dot products with qmid
 *                in c order, max of the two, group mean in head order
 *   seg_softmax  one CTA per KV head: max, exp, f64 sum, P, entropy
 * WINDOW, six launches. Rows r = hh * n_q + i (query head hh of the group,
 * window query i), R = G * n_q; each KV head's blocks are cut into n_split
 * contiguous ranges, one CTA per (range, KV head), walking 32-key tiles
 * (lane = key) with every warp on a subset of the rows:
 *   win_rows<MAX>  per (range, row) the maximum logit
 *   win_reduce<MAX> row maximum M over the ranges
 *   win_rows<SUM>  per (range, row) the f64 sum of exp(logit - M)
 *   win_reduce<SUM> w = 1 / (sum * R), ranges summed in order
 *   win_scores     per key j < n_prefix: sum over rows, in row order, of
 *                  f32(exp(logit - M) * w); the tile's probabilities go
 *                  through shared memory so one thread per key adds them
 *   pool           max / average pooling, zero padding
 * The logit of (row, key) is the same function in every pass (products
 * rounded, summed in order, then times the scale), so the passes agree bit
 * for bit.
 *
 * Shared memory of a WINDOW CTA (hd <= 256):
 *     Ks  [KT][hd + 1]  f32  the tile's keys (odd row stride: lanes reading
 *                            column c of 32 rows hit 32 banks)
 *     kpos [KT]         i32
 *     Pr  [RC][KT + 1]  f32  win_scores only: probabilities of RC rows
 */
#include "stats.cuh"

namespace {

constexpr int KT = 32;   /* keys per tile: one per lane                  */
constexpr int NT = 128;  /* threads per CTA                               */
constexpr int NW = NT / 32;
constexpr int RC = 32;   /* rows per probability chunk in win_scores     */
constexpr int HD_MAX = 256;
constexpr unsigned FULL = 0xffffffffu;

__device__ __forceinline__ float f16_at(const uint16_t *p) { return __half2float(__ushort_as_half(*p)); }

/* ---- SEGMENT ------------------------------------------------------------------------ */

/* policy-util.c: "midrange query of the segment, per query head".
 * CTA (32 columns, QM_ROWS row slices): each thread folds rows ty,
 * ty + QM_ROWS, ... of its column, then the slices meet in shared memory.
 * max/min are exact in any order, so this equals the reference's row loop;
 * one thread per column (16 CTAs at 32 query heads x 128) waited on 512
 * dependent loads per call. */
constexpr int QM_ROWS = 8;

__global__ void seg_qmid(const float *__restrict__ q, uint32_t n_q, uint32_t QD, float *__restrict__ qmid)
{
    __shared__ float smx[QM_ROWS][32], smn[QM_ROWS][32];
    const uint32_t tx = threadIdx.x % 32, ty = threadIdx.x / 32, x = blockIdx.x * 32 + tx;
    float mx = -INFINITY, mn = INFINITY;
    if (x < QD)
        for (uint32_t t = ty; t < n_q; t += QM_ROWS) {
            const float v = q[(size_t)t * QD + x];
            mx = v > mx ? v : mx;
            mn = v < mn ? v : mn;
        }
    smx[ty][tx] = mx, smn[ty][tx] = mn;
    __syncthreads();
    if (ty != 0 || x >= QD)
        return;
    for (int r = 1; r < QM_ROWS; r++) {
        mx = smx[r][tx] > mx ? smx[r][tx] : mx;
        mn = smn[r][tx] < mn ? smn[r][tx] : mn;
    }
    qmid[x] = __fmul_rn(0.5f, __fadd_rn(mx, mn));
}

/* policy-util.c: the block loop of tkv_segment_block_probs up to P[j] =
 * (float)(a / G). Shared memory: per warp kmax[hd], kmin[hd] f32. */
__global__ void seg_scores(const tkv_cuda_stats_params p, const float *__restrict__ qmid, float *__restrict__ logit)
{
    extern __shared__ float seg_sm[];
    const uint32_t g = blockIdx.y, hd = p.head_dim, G = p.n_head / p.n_head_kv, block = p.block;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float *kmax = seg_sm + (size_t)warp * 2 * hd, *kmin = kmax + hd;
    const uint32_t e0 = p.head_off[g], e1 = p.head_off[g + 1];
    for (uint32_t j = blockIdx.x * NW + warp; j < p.n_blocks; j += gridDim.x * NW) {
        for (uint32_t c = lane; c < hd; c += 32)
            kmax[c] = -INFINITY, kmin[c] = INFINITY;
        const int64_t p0 = (int64_t)j * block, p1 = p0 + block;
        /* the first block entry ending after p0 (entries are in position order) */
        uint32_t lo = e0, hi = e1;
        while (lo < hi) {
            const uint32_t mid = lo + (hi - lo) / 2;
            if ((int64_t)p.blocks[mid].pos0 + p.blocks[mid].n <= p0)
                lo = mid + 1;
            else
                hi = mid;
        }
        uint32_t b = lo;
        for (int64_t pos = p0; pos < p1; pos++) { /* uniform across the warp */
            while (b < e1 && pos >= (int64_t)p.blocks[b].pos0 + p.blocks[b].n)
                b++;
            if (b == e1)
                break;
            const tkv_cuda_stats_block e = p.blocks[b];
            if (pos < e.pos0) /* a gap the contract excludes: no key there */
                continue;
            const uint16_t *k = e.k + (size_t)(pos - e.pos0) * hd;
            for (uint32_t c = lane; c < hd; c += 32) {
                const float x = f16_at(k + c);
                kmax[c] = x > kmax[c] ? x : kmax[c];
                kmin[c] = x < kmin[c] ? x : kmin[c];
            }
        }
        __syncwarp();
        /* one lane per query head of the group; f64 sums in c order (the
         * products of two floats are exact in f64, so fma == mul + add) */
        double a = 0;
        for (uint32_t base = 0; base < G; base += 32) {
            double sc = 0;
            const uint32_t hh = base + lane;
            if (hh < G) {
                const float *qm = qmid + (size_t)(g * G + hh) * hd;
                double s1 = 0, s2 = 0;
                for (uint32_t c = 0; c < hd; c++) {
                    const double qc = qm[c];
                    s1 = fma(qc, (double)kmax[c], s1);
                    s2 = fma(qc, (double)kmin[c], s2);
                }
                sc = s1 > s2 ? s1 : s2;
            }
            const uint32_t n_here = min(32u, G - base);
            for (uint32_t t = 0; t < n_here; t++) /* head order, as the reference sums */
                a += __shfl_sync(FULL, sc, (int)t);
        }
        if (lane == 0)
            logit[(size_t)g * p.n_blocks + j] = (float)(a / (double)G);
        __syncwarp(); /* kmax/kmin are rewritten for the next block */
    }
}

/* Block-wide reductions over NT threads (deterministic: fixed tree). */
__device__ float block_max(float v, float *red)
{
    v = tkv_warp_max(v);
    __syncthreads();
    if (threadIdx.x % 32 == 0)
        red[threadIdx.x / 32] = v;
    __syncthreads();
    float m = red[0];
    for (int w = 1; w < NW; w++)
        m = fmaxf(m, red[w]);
    return m;
}

__device__ double block_sum_d(double v, double *red)
{
    v = tkv_warp_sum_d(v);
    __syncthreads();
    if (threadIdx.x % 32 == 0)
        red[threadIdx.x / 32] = v;
    __syncthreads();
    double s = 0;
    for (int w = 0; w < NW; w++)
        s += red[w];
    return s;
}

/* policy-util.c: the softmax at the end of tkv_segment_block_probs, then
 * tkv_entropy. One CTA per KV head; P is normalised in place. */
__global__ void seg_softmax(float *__restrict__ P_all, uint32_t nb, double *__restrict__ entropy)
{
    __shared__ float redf[NW];
    __shared__ double redd[NW];
    float *P = P_all + (size_t)blockIdx.x * nb;
    float m = -INFINITY;
    for (uint32_t j = threadIdx.x; j < nb; j += NT)
        m = P[j] > m ? P[j] : m;
    m = block_max(m, redf);
    double s = 0;
    for (uint32_t j = threadIdx.x; j < nb; j += NT) {
        const float e = (float)exp((double)__fsub_rn(P[j], m)); /* expf, correctly rounded */
        P[j] = e;
        s += e;
    }
    const double sum = block_sum_d(s, redd);
    double h = 0;
    for (uint32_t j = threadIdx.x; j < nb; j += NT) {
        const float pj = (float)((double)P[j] / sum);
        P[j] = pj;
        h -= (double)pj * log((double)pj + 1e-9);
    }
    h = block_sum_d(h, redd);
    if (threadIdx.x == 0)
        entropy[blockIdx.x] = h;
}

/* ---- WINDOW ------------------------------------------------------------------------- */

/* The blocks of one (KV head, range) still to read: block b from row off. */
struct cursor {
    uint32_t b, b_end, off;
};

/* Gathers up to KT keys at positions [0, limit) at the cursor into Ks/kpos
 * (every thread walks the same cursor) and advances it; returns the count.
 * The caller synchronizes before and after. */
__device__ int gather(const tkv_cuda_stats_params &p, cursor &c, int64_t limit, float *Ks, int32_t *kpos)
{
    const uint32_t hd = p.head_dim, KS = hd + 1;
    int nk = 0;
    while (nk < KT && c.b < c.b_end) {
        const tkv_cuda_stats_block e = p.blocks[c.b];
        if ((int64_t)e.pos0 >= limit) { /* in position order: nothing later counts */
            c.b = c.b_end;
            break;
        }
        const int64_t lo = e.pos0 < 0 ? -(int64_t)e.pos0 : 0, hi = min((int64_t)e.n, limit - e.pos0);
        const int64_t off = max((int64_t)c.off, lo);
        const int take = (int)min(hi - off, (int64_t)(KT - nk));
        if (take <= 0) {
            c.b++, c.off = 0;
            continue;
        }
        const uint16_t *k = e.k + (size_t)off * hd;
        for (uint32_t u = threadIdx.x; u < (uint32_t)take * hd; u += NT)
            Ks[(size_t)(nk + u / hd) * KS + u % hd] = f16_at(k + u);
        if ((int)threadIdx.x < take)
            kpos[nk + threadIdx.x] = e.pos0 + (int32_t)off + (int32_t)threadIdx.x;
        nk += take;
        if (off + take >= hi)
            c.b++, c.off = 0;
        else
            c.off = (uint32_t)(off + take);
    }
    return nk;
}

/* policy-util.c: "s += q[c] * kf[c]", then s * scale. GCC (-O3
 * -march=native) vectorizes the products and keeps the sums in order,
 * without contracting them to FMAs; so do we (__fmul_rn/__fadd_rn are never
 * fused). */
__device__ __forceinline__ float logit_of(const float *__restrict__ qr, const float *kr, uint32_t hd, float scale)
{
    float s = 0.0f;
    for (uint32_t c = 0; c < hd; c++)
        s = __fadd_rn(s, __fmul_rn(__ldg(qr + c), kr[c]));
    return __fmul_rn(s, scale);
}

/* The blocks of range s of KV head g. */
__device__ cursor range_of(const tkv_cuda_stats_params &p, uint32_t g, uint32_t s)
{
    const uint32_t e0 = p.head_off[g], nb = p.head_off[g + 1] - e0;
    return cursor{e0 + (uint32_t)((uint64_t)nb * s / p.n_split), e0 + (uint32_t)((uint64_t)nb * (s + 1) / p.n_split),
                  0};
}

enum { PASS_MAX = 0, PASS_SUM = 1 };

/* Per (range, row): the maximum logit (PASS_MAX), or the f64 sum of
 * exp(logit - M[row]) (PASS_SUM): policy-util.c's "mx" and "sum". */
template <int PASS>
__global__ void win_rows(const tkv_cuda_stats_params p, float *__restrict__ part_m, double *__restrict__ part_l,
                         const float *__restrict__ M)
{
    extern __shared__ float win_sm[];
    const uint32_t g = blockIdx.y, s = blockIdx.x, hd = p.head_dim, G = p.n_head / p.n_head_kv;
    const uint32_t R = G * p.n_q, QD = p.n_head * hd, KS = hd + 1;
    float *Ks = win_sm;
    int32_t *kpos = (int32_t *)(Ks + (size_t)KT * KS);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const size_t row0 = ((size_t)g * p.n_split + s) * R;
    for (uint32_t r = warp; r < R; r += NW)
        if (lane == 0) {
            if (PASS == PASS_MAX)
                part_m[row0 + r] = -INFINITY;
            else
                part_l[row0 + r] = 0.0;
        }
    cursor c = range_of(p, g, s);
    for (;;) {
        __syncthreads();
        const int nk = gather(p, c, p.n_past, Ks, kpos);
        __syncthreads();
        if (nk == 0)
            break;
        for (uint32_t r = warp; r < R; r += NW) {
            const uint32_t hh = r / p.n_q, i = r % p.n_q;
            const float *qr = p.q + (size_t)i * QD + (size_t)(g * G + hh) * hd;
            float l = -INFINITY;
            if (lane < nk && kpos[lane] <= p.q_pos[i])
                l = logit_of(qr, Ks + (size_t)lane * KS, hd, p.scale);
            if (PASS == PASS_MAX) {
                l = tkv_warp_max(l);
                if (lane == 0)
                    part_m[row0 + r] = fmaxf(part_m[row0 + r], l);
            } else {
                const float m = M[(size_t)g * R + r];
                double e = (l == -INFINITY) ? 0.0 : exp((double)__fsub_rn(l, m));
                e = tkv_warp_sum_d(e);
                if (lane == 0)
                    part_l[row0 + r] += e;
            }
        }
    }
}

/* Combines the ranges of each row: M = max (PASS_MAX), or
 * w = 1 / (sum * R) with the ranges summed in order (PASS_SUM). */
template <int PASS>
__global__ void win_reduce(const tkv_cuda_stats_params p, const float *__restrict__ part_m,
                           const double *__restrict__ part_l, float *__restrict__ M, double *__restrict__ W)
{
    const uint32_t g = blockIdx.y, R = (p.n_head / p.n_head_kv) * p.n_q;
    const uint32_t r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= R)
        return;
    if (PASS == PASS_MAX) {
        float m = -INFINITY;
        for (uint32_t s = 0; s < p.n_split; s++)
            m = fmaxf(m, part_m[((size_t)g * p.n_split + s) * R + r]);
        M[(size_t)g * R + r] = m;
    } else {
        double sum = 0;
        for (uint32_t s = 0; s < p.n_split; s++)
            sum += part_l[((size_t)g * p.n_split + s) * R + r];
        W[(size_t)g * R + r] = 1.0 / (sum * (double)R);
    }
}

/* policy-util.c: "score[j] += (float)(exp(row[j] - mx) * w)" for r in
 * order, keys j < min(n_prefix, n_past); raw is zero elsewhere (memset). */
__global__ void win_scores(const tkv_cuda_stats_params p, const float *__restrict__ M, const double *__restrict__ W,
                           float *__restrict__ raw)
{
    extern __shared__ float win_sm[];
    const uint32_t g = blockIdx.y, s = blockIdx.x, hd = p.head_dim, G = p.n_head / p.n_head_kv;
    const uint32_t R = G * p.n_q, QD = p.n_head * hd, KS = hd + 1;
    float *Ks = win_sm;
    int32_t *kpos = (int32_t *)(Ks + (size_t)KT * KS);
    float *Pr = (float *)(kpos + KT);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t limit = min((int64_t)p.n_prefix, (int64_t)p.n_past);
    cursor c = range_of(p, g, s);
    for (;;) {
        __syncthreads();
        const int nk = gather(p, c, limit, Ks, kpos);
        __syncthreads();
        if (nk == 0)
            break;
        float acc = 0.0f; /* thread t < nk: key t of the tile */
        for (uint32_t r0 = 0; r0 < R; r0 += RC) {
            for (uint32_t rr = warp; rr < RC; rr += NW) {
                const uint32_t r = r0 + rr;
                float pr = 0.0f;
                if (r < R && lane < nk) {
                    const uint32_t hh = r / p.n_q, i = r % p.n_q;
                    const float m = M[(size_t)g * R + r];
                    if (kpos[lane] <= p.q_pos[i] && m != -INFINITY) {
                        const float *qr = p.q + (size_t)i * QD + (size_t)(g * G + hh) * hd;
                        const float l = logit_of(qr, Ks + (size_t)lane * KS, hd, p.scale);
                        pr = (float)(exp((double)__fsub_rn(l, m)) * W[(size_t)g * R + r]);
                    }
                }
                Pr[rr * (KT + 1) + lane] = pr;
            }
            __syncthreads();
            if ((int)threadIdx.x < nk) {
                const uint32_t n_rows = min((uint32_t)RC, R - r0);
                for (uint32_t rr = 0; rr < n_rows; rr++) /* row order: the reference's rounding */
                    acc = __fadd_rn(acc, Pr[rr * (KT + 1) + threadIdx.x]);
            }
            __syncthreads();
        }
        if ((int)threadIdx.x < nk)
            raw[(size_t)g * p.n_prefix + kpos[threadIdx.x]] = acc;
    }
}

/* policy-util.c: tkv_policy_pool (zero padding, stride 1). */
__global__ void pool_kernel(const float *__restrict__ raw, float *__restrict__ out, uint32_t n, uint32_t k, int is_max)
{
    const uint32_t g = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n)
        return;
    const float *x = raw + (size_t)g * n;
    if (k <= 1) {
        out[(size_t)g * n + i] = x[i];
        return;
    }
    const int64_t half = k / 2;
    float acc = is_max ? -INFINITY : 0.0f;
    for (int64_t j = (int64_t)i - half; j <= (int64_t)i + half; j++) {
        const float val = (j < 0 || j >= (int64_t)n) ? 0.0f : x[j];
        acc = is_max ? (val > acc ? val : acc) : __fadd_rn(acc, val);
    }
    out[(size_t)g * n + i] = is_max ? acc : __fdiv_rn(acc, (float)k);
}

/* ---- work memory ---------------------------------------------------------------------- */

struct carve {
    size_t off;
    template <typename T> T *take(void *base, size_t n)
    {
        off = (off + 15) / 16 * 16;
        T *ptr = base ? (T *)((uint8_t *)base + off) : nullptr;
        off += n * sizeof(T);
        return ptr;
    }
};

/* The work layout, shared by plan (base NULL: sizes only) and run. */
struct win_work {
    float *part_m, *M, *raw, *scores;
    double *part_l, *W;
};
struct seg_work {
    float *qmid, *probs;
    double *entropy;
};

size_t seg_layout(const tkv_cuda_stats_params &p, void *base, seg_work *w)
{
    carve c{0};
    w->qmid = c.take<float>(base, (size_t)p.n_head * p.head_dim);
    w->probs = c.take<float>(base, (size_t)p.n_head_kv * p.n_blocks);
    w->entropy = c.take<double>(base, p.n_head_kv);
    return c.off;
}

size_t win_layout(const tkv_cuda_stats_params &p, void *base, win_work *w)
{
    const size_t R = (size_t)(p.n_head / p.n_head_kv) * p.n_q, H = p.n_head_kv;
    carve c{0};
    w->part_m = c.take<float>(base, H * p.n_split * R);
    w->part_l = c.take<double>(base, H * p.n_split * R);
    w->M = c.take<float>(base, H * R);
    w->W = c.take<double>(base, H * R);
    w->raw = c.take<float>(base, H * p.n_prefix);
    w->scores = c.take<float>(base, H * p.n_prefix);
    return c.off;
}

} // namespace

bool tkv_cuda_stats_supported(uint32_t head_dim) { return head_dim >= 1 && head_dim <= HD_MAX; }

size_t tkv_cuda_stats_plan(struct tkv_cuda_stats_params *p, int n_sm)
{
    if (p->kind == TKV_ATTN_STATS_SEGMENT) {
        seg_work w;
        p->n_split = 1;
        return seg_layout(*p, nullptr, &w);
    }
    /* enough (range, KV head) CTAs for about four per multiprocessor */
    const uint32_t want = (uint32_t)((4 * (uint64_t)(n_sm > 0 ? n_sm : 1) + p->n_head_kv - 1) / p->n_head_kv);
    p->n_split = TKV_MAX(1u, TKV_MIN(TKV_MIN(want, p->max_blocks), 1024u));
    win_work w;
    return win_layout(*p, nullptr, &w);
}

cudaError_t tkv_cuda_stats(struct tkv_cuda_stats_params *p, cudaStream_t s)
{
    if (!tkv_cuda_stats_supported(p->head_dim) || p->n_head_kv == 0 || p->n_head % p->n_head_kv != 0 ||
        p->n_split == 0 || p->n_head_kv > 65535)
        return cudaErrorInvalidValue;
    const uint32_t hd = p->head_dim, H = p->n_head_kv;
    if (p->kind == TKV_ATTN_STATS_SEGMENT) {
        seg_work w;
        seg_layout(*p, p->work, &w);
        p->probs = w.probs;
        p->entropy = w.entropy;
        p->scores = nullptr;
        if (p->n_blocks == 0 || p->n_q == 0)
            return cudaErrorInvalidValue;
        const uint32_t QD = p->n_head * hd;
        seg_qmid<<<tkv_cuda_blocks(QD, 32), 32 * QM_ROWS, 0, s>>>(p->q, p->n_q, QD, w.qmid);
        TKV_CUDA_LAUNCHED();
        const unsigned gx = TKV_MIN(tkv_cuda_blocks(p->n_blocks, NW), 65535u);
        seg_scores<<<dim3(gx, H), NT, (size_t)NW * 2 * hd * sizeof(float), s>>>(*p, w.qmid, w.probs);
        TKV_CUDA_LAUNCHED();
        seg_softmax<<<H, NT, 0, s>>>(w.probs, p->n_blocks, w.entropy);
        TKV_CUDA_LAUNCHED();
        return cudaSuccess;
    }
    if (p->kind != TKV_ATTN_STATS_WINDOW || p->n_q == 0 || p->n_prefix == 0 || p->n_split > 65535)
        return cudaErrorInvalidValue;
    win_work w;
    win_layout(*p, p->work, &w);
    p->probs = nullptr;
    p->entropy = nullptr;
    p->scores = w.scores;
    const uint32_t R = (p->n_head / H) * p->n_q;
    const size_t smem_rows = ((size_t)KT * (hd + 1) + KT) * sizeof(float);
    const size_t smem_scores = smem_rows + (size_t)RC * (KT + 1) * sizeof(float);
    const dim3 grid(p->n_split, H), grid_r(tkv_cuda_blocks(R, 256), H);
    win_rows<PASS_MAX><<<grid, NT, smem_rows, s>>>(*p, w.part_m, w.part_l, w.M);
    TKV_CUDA_LAUNCHED();
    win_reduce<PASS_MAX><<<grid_r, 256, 0, s>>>(*p, w.part_m, w.part_l, w.M, w.W);
    TKV_CUDA_LAUNCHED();
    win_rows<PASS_SUM><<<grid, NT, smem_rows, s>>>(*p, w.part_m, w.part_l, w.M);
    TKV_CUDA_LAUNCHED();
    win_reduce<PASS_SUM><<<grid_r, 256, 0, s>>>(*p, w.part_m, w.part_l, w.M, w.W);
    TKV_CUDA_LAUNCHED();
    TKV_CUDA_TRY(cudaMemsetAsync(w.raw, 0, (size_t)H * p->n_prefix * sizeof(float), s));
    win_scores<<<grid, NT, smem_scores, s>>>(*p, w.M, w.W, w.raw);
    TKV_CUDA_LAUNCHED();
    const unsigned px = tkv_cuda_blocks(p->n_prefix, 256);
    pool_kernel<<<dim3(px, H), 256, 0, s>>>(w.raw, w.scores, p->n_prefix, p->pool, p->pool_max);
    TKV_CUDA_LAUNCHED();
    return cudaSuccess;
}
