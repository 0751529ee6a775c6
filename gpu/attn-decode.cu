/*
 * attn-decode.cu -- see attn-decode.cuh. Decode is bound by reading K and V
 * once (HBM); the design keeps enough bytes in flight and the arithmetic per
 * byte small:
 *
 *   - a key's head_dim is spread over LPK = HD/8 lanes (16 bytes of K and of
 *     V per lane), so a warp covers NG = 32/LPK keys per 16-byte load; a
 *     chunk is U loads deep (CH = NG*U keys, 8 KiB of K+V per warp for U = 8);
 *   - each lane copies its own 16-byte pieces with cp.async into a private
 *     slice of shared memory and reads them back itself: no barrier in the
 *     main loop; 3 stages, so two chunks are in flight while one is computed;
 *   - each lane multiplies its 8 dims of K with the 8 dims of every query row
 *     (q in registers, pre-scaled to log2 units), then the LPK partial dot
 *     products of U keys x DR rows are summed by a transposing butterfly:
 *     each step halves the values a lane holds, so after log2(LPK) steps
 *     lane dl holds the NF = U*DR/LPK full scores [dl*NF, dl*NF+NF) of the
 *     list ordered (row, key): one row per lane, W = LPK/DR lanes per row;
 *   - online softmax once per chunk; the probabilities go through a small
 *     per-warp buffer to every lane, which adds p * V over its 8 dims.
 *
 * Shared memory (dynamic), NW = 4 warps, NS stages (see cfg0):
 *     pipe [NW][NS][K|V][U][32 lanes] uint4    the cp.async stages
 *     pbuf [NW][NG][U*DR + 4] f32              probabilities of a chunk
 *     cm, cl [NW*NG][DR] f32                   each lane group's (m, l)
 *     flag                                      "this CTA merges"
 * After the main loop pipe is reused for so [NW*NG][DR][HD] (each lane
 * group's O), then for the merge's (m, l) per split and row.
 *
 * Scores are in log2 units (q scaled by scale*log2 e), so exp2f is the
 * exponential and lse = (m + log2 l) * ln 2, as in attn.cu.
 */
#include "attn-decode.cuh"
#include "attn-prefill-walk.cuh" /* the PTX wrappers of the tensor-core kernels (ldmatrix, mma, f16 hi/lo) */

namespace {

constexpr int NT = 128;      /* threads per CTA */
constexpr int NW = NT / 32;  /* warps per CTA   */
constexpr float LN2f = 0.693147180559945309f;
constexpr int MERGE_DR = 8;  /* row stride of the merge's arrays */

template <int HD_, int DR_, int U_, int NS_, bool MMA_ = false> struct dec_cfg {
    static constexpr bool MMA = MMA_;           /* scores and P.V on the tensor cores (decode_cta_mma) */
    static constexpr int HD = HD_;              /* head_dim class                                   */
    static constexpr int DR = DR_;              /* query rows (registers)                           */
    static constexpr int U = U_;                /* 16-byte loads of K (and of V) per lane per chunk */
    static constexpr int NS = NS_;              /* cp.async stages (NS - 1 chunks in flight)        */
    static constexpr int LPK = HD / 8;          /* lanes per key                                    */
    static constexpr int NG = 32 / LPK;         /* keys per warp-wide load                          */
    static constexpr int CH = NG * U;           /* keys per chunk                                   */
    static constexpr int V = U * DR;            /* partial sums per lane                            */
    static constexpr int NF = V / LPK;          /* full sums per lane after the butterfly           */
    static constexpr int W = LPK / DR;          /* lanes sharing one row's scores                   */
    static constexpr int SLOTS = NW * NG;       /* lane groups per CTA                              */
    static constexpr int SLOT_STEP = MMA ? NG : 1; /* slots holding a result: the tensor-core body
                                                      fills a warp's first only                     */
    static constexpr size_t PIPE = (size_t)NW * NS * 2 * U * 32 * 16;
    static constexpr int PSTRIDE = V + 4;       /* floats per lane group in pbuf (bank offset)      */
    static constexpr size_t SMEM = PIPE + (size_t)NW * NG * PSTRIDE * 4 + 2 * (size_t)SLOTS * DR * 4 + 16;
    static_assert(NF >= 1 && NF <= U && U % NF == 0 && W >= 1, "lane mapping");
    static_assert((size_t)SLOTS * DR * HD * 4 <= PIPE, "so[] must fit in the pipeline buffer");
    static_assert((2 * (size_t)TKV_ATTN_DECODE_MAX_SPLIT * MERGE_DR + 2 * MERGE_DR) * 4 <= PIPE,
                  "the merge's arrays must fit");
};

/* The configuration: chunks of 8 loads, 3 stages. Measured on the H200
 * (docs/gpu.md), 32/8/128 at 32K-1M keys: chunks of 4 loads with 6 stages
 * (5/6 of the same buffer in flight) were 3-11% slower, and 4 loads x 4
 * stages (3 CTAs per SM) 8-42% slower: the per-chunk work (butterfly,
 * softmax update, cursor) counts. With 5-8 rows too (session 34, H100,
 * 28/4/128: 1M keys 6-11% faster than chunks of 4 loads, 128K within 2%;
 * 255 registers either way, no spills). */
template <int HD, int DR> using cfg0 = dec_cfg<HD, DR, 8, 3>;
/* The tensor-core instance (decode_cta_mma): head_dim class 128, the same
 * chunks (16 keys a warp), so a plan is the same for both. */
template <int DR> using cfg_mma = dec_cfg<128, DR, 8, 3, true>;

__device__ __forceinline__ void h8_to_f32(const uint4 r, float f[8])
{
    const unsigned w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        __half2 h;
        memcpy(&h, &w[i], 4);
        const float2 t = __half22float2(h);
        f[2 * i] = t.x;
        f[2 * i + 1] = t.y;
    }
}

/* Transposing butterfly over the lanes of a group (bits below 2*OFF of the
 * lane id): s[0..N) per lane become s[0..N/(2*OFF)) holding full sums. */
template <int N, int OFF> __device__ __forceinline__ void xreduce(float *s, int lane)
{
    if constexpr (OFF >= 1) {
        const bool up = (lane & OFF) != 0;
#pragma unroll
        for (int i = 0; i < N / 2; i++) {
            const float send = up ? s[i] : s[i + N / 2];
            const float keep = up ? s[i + N / 2] : s[i];
            s[i] = keep + __shfl_xor_sync(0xffffffffu, send, OFF);
        }
        xreduce<N / 2, OFF / 2>(s, lane);
    }
}

/* A chunk the warp has in flight: keys at positions kpos0 + kk, kk < nvalid
 * (nvalid < 0: no chunk, the warp is done). */
struct chunk_meta {
    int32_t kpos0;
    int nvalid;
};

/* Where a chunk's keys are: key kk of it at k + kk * head_dim (V likewise). */
struct chunk_src {
    const uint16_t *k, *v;
    int32_t kpos0;
    int nvalid; /* < 0: no chunk */
};

/* The warp's walk over its chunks: chunk j of block b, then j + NW (chunks
 * numbered across the CTA's blocks). en is the next block's entry, loaded one
 * block ahead. */
struct dec_cursor {
    uint32_t b, b_end;
    int j;
    tkv_cuda_kv_entry e, en;
};

__device__ __forceinline__ tkv_cuda_kv_entry load_entry(const tkv_cuda_kv_entry *blocks, uint32_t b)
{
    tkv_cuda_kv_entry e;
    e.k = (const uint16_t *)__ldg((const unsigned long long *)&blocks[b].k);
    e.v = (const uint16_t *)__ldg((const unsigned long long *)&blocks[b].v);
    e.pos0 = __ldg(&blocks[b].pos0);
    e.n = __ldg(&blocks[b].n);
    return e;
}

/* Moves the cursor `step` chunks on (skipping to later blocks as needed). */
template <int CH>
__device__ __forceinline__ void cursor_advance(dec_cursor &c, int step, const tkv_cuda_kv_entry *blocks,
                                               int32_t pos_max)
{
    c.j += step;
    while (c.b < c.b_end && c.j * CH >= (int)c.e.n) {
        c.j -= ((int)c.e.n + CH - 1) / CH;
        c.b++;
        if (c.b < c.b_end) {
            c.e = c.en;
            if (c.b + 1 < c.b_end)
                c.en = load_entry(blocks, c.b + 1);
            if (c.e.pos0 > pos_max) /* blocks are in position order: none later is visible */
                c.b = c.b_end;
        }
    }
}

/* The walk over the packed table (device memory): a CTA's contiguous range
 * of its head's blocks. */
struct tab_walk {
    dec_cursor c;
    const tkv_cuda_kv_entry *blocks;
    int32_t pos_max;

    template <int CH> __device__ __forceinline__ void advance(int step) { cursor_advance<CH>(c, step, blocks, pos_max); }
    template <int CH> __device__ __forceinline__ chunk_src src(uint32_t hd) const
    {
        chunk_src s;
        s.k = s.v = nullptr;
        s.kpos0 = 0;
        s.nvalid = -1;
        if (c.b < c.b_end) {
            const int k0 = c.j * CH;
            s.k = c.e.k + (size_t)k0 * hd;
            s.v = c.e.v + (size_t)k0 * hd;
            s.kpos0 = c.e.pos0 + k0;
            s.nvalid = min(CH, (int)c.e.n - k0);
        }
        return s;
    }
};

/* The walk over inline runs (kernel parameters): a CTA's contiguous range
 * [c, c_end) of its head's chunks; chunk j of run r is the current one. */
struct run_walk {
    const tkv_cuda_kv_run *runs;
    uint32_t r, j, c, c_end;

    template <int CH> __device__ __forceinline__ static uint32_t n_chunks(const tkv_cuda_kv_run &R)
    {
        return (R.n + CH - 1) / CH;
    }
    /* at chunk c of the head whose runs are [r0, r1) */
    template <int CH> __device__ __forceinline__ void start(uint32_t r0, uint32_t r1)
    {
        r = r0;
        j = 0;
        if (c >= c_end)
            return;
        while (r + 1 < r1 && runs[r + 1].c0 <= c)
            r++;
        j = c - runs[r].c0;
    }
    template <int CH> __device__ __forceinline__ void advance(int step)
    {
        c += (uint32_t)step;
        j += (uint32_t)step;
        if (c >= c_end)
            return;
        /* c < c_end <= the head's chunks: a run holds chunk c */
        for (uint32_t nc = n_chunks<CH>(runs[r]); j >= nc; nc = n_chunks<CH>(runs[r])) {
            j -= nc;
            r++;
        }
    }
    template <int CH> __device__ __forceinline__ chunk_src src(uint32_t hd) const
    {
        chunk_src s;
        s.k = s.v = nullptr;
        s.kpos0 = 0;
        s.nvalid = -1;
        if (c < c_end) {
            const tkv_cuda_kv_run &R = runs[r];
            const uint32_t k0 = j * CH, blk = k0 / R.bsz, row = k0 - blk * R.bsz;
            s.k = R.k + (int64_t)blk * R.kstride + (size_t)row * hd;
            s.v = R.v + (int64_t)blk * R.vstride + (size_t)row * hd;
            s.kpos0 = R.pos0 + (int32_t)k0;
            s.nvalid = (int)min((uint32_t)CH, R.n - k0);
        }
        return s;
    }
};

/* Issues the cp.async copies of chunk c into one stage (always commits a
 * group, empty when the walk is over). */
template <class C>
__device__ __forceinline__ chunk_meta issue_chunk(const chunk_src &c, uint4 *kst, uint4 *vst, int lane, int sub,
                                                  int dl, uint32_t hd)
{
    /* key kk's 16-byte unit dl at kk * LPK + dl (the lane's own slot,
     * u * 32 + lane); the tensor-core instance swizzles the unit by the
     * key (dl ^ kk % 8), so the 8 rows an ldmatrix reads lie in different
     * banks */
    chunk_meta m;
    m.nvalid = c.nvalid;
    m.kpos0 = c.kpos0;
    if (c.nvalid >= 0) {
        const bool dim_ok = dl * 8 < (int)hd;
#pragma unroll
        for (int u = 0; u < C::U; u++) {
            const int kk = u * C::NG + sub;
            const bool ok = dim_ok && kk < c.nvalid;
            const size_t off = ok ? (size_t)kk * hd + (size_t)dl * 8 : 0;
            const int at = C::MMA ? kk * C::LPK + (dl ^ (kk & 7)) : u * 32 + lane;
            tkv_cp_async16(kst + at, c.k + off, ok);
            tkv_cp_async16(vst + at, c.v + off, ok);
        }
    }
    tkv_cp_async_commit();
    return m;
}

/* Elements d .. d + 3 of output row `row` (o): quantized into the planes
 * p.q8 (block order p.q8.gb) as the quantized GEMV would quantize p.out.
 * Warp-collective: every lane of the warp calls it, on items i = (row, d /
 * 4) with i consecutive across the lanes, so that the 8 lanes of an aligned
 * group hold one 32-element block (head_dim % 32 == 0); ok false (a whole
 * group past the last item): nothing stored. */
__device__ __forceinline__ void q8_out(const tkv_cuda_attn_params &p, uint32_t row, uint32_t d, float4 o, bool ok)
{
    const float v[4] = {o.x, o.y, o.z, o.w};
    const tkv_q8_part<4> b = tkv_q8_part_of<4>(v);
    if (!ok)
        return;
    const uint32_t nb = p.n_head * p.head_dim / 32, t = row / p.n_head;
    const uint32_t c = row % p.n_head * p.head_dim + d; /* the column in the token's row */
    tkv_q8_part_put<4>(b, c % 32, p.q8, (size_t)t * nb + tkv_q8_pos(c / 32, nb, p.q8.gb));
}

/* Merges the S partials of KV head g (decode layout; the partials' arrays
 * sized for p.n_split) into out / lse. All NT threads; smem: 2 * S *
 * MERGE_DR + 2 * MERGE_DR floats. The loads of each phase are independent,
 * so they are in flight together. */
__device__ void merge_head(const tkv_cuda_attn_params &p, uint32_t g, int S, float *smem)
{
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const uint32_t G = p.n_head / p.n_head_kv, hd = p.head_dim, n_rows = p.n_q * p.n_head;
    const int R = (int)(p.n_q * G);
    const float *po = p.part, *pml = p.part + (size_t)p.n_split * n_rows * hd;
    float *ms = smem, *ls = ms + (size_t)S * MERGE_DR, *Mr = ls + (size_t)S * MERGE_DR, *Lr = Mr + MERGE_DR;
    for (int i = tid; i < S * R; i += NT) {
        const int s = i / R, r = i % R;
        const uint32_t row = (uint32_t)r / G * p.n_head + g * G + (uint32_t)r % G;
        const float2 ml = __ldcg((const float2 *)(pml + ((size_t)s * n_rows + row) * 2));
        ms[s * MERGE_DR + r] = ml.x;
        ls[s * MERGE_DR + r] = ml.y;
    }
    __syncthreads();
    for (int r = warp; r < R; r += NW) { /* a warp per row: its max, the weights, its sum */
        float mx = -INFINITY;
        for (int s = lane; s < S; s += 32)
            if (ls[s * MERGE_DR + r] > 0.0f)
                mx = fmaxf(mx, ms[s * MERGE_DR + r]);
        mx = tkv_warp_max(mx);
        float sum = 0.0f;
        for (int s = lane; s < S; s += 32) {
            const float l = ls[s * MERGE_DR + r];
            const float w = l > 0.0f ? exp2f(ms[s * MERGE_DR + r] - mx) : 0.0f; /* then mx is finite */
            ms[s * MERGE_DR + r] = w;                                            /* m -> weight */
            sum += l * w;
        }
        sum = tkv_warp_sum(sum);
        if (lane == 0) {
            Mr[r] = mx;
            Lr[r] = sum;
        }
    }
    __syncthreads();
    const int nd4 = (int)hd / 4;
    /* a thread per (row, 4 dims); whole warps at a time (q8_out) */
    for (int i0 = tid - lane; i0 < R * nd4; i0 += NT) {
        const int i = i0 + lane, r = i / nd4, d4 = i % nd4;
        const bool ok = i < R * nd4;
        const uint32_t row = (uint32_t)r / G * p.n_head + g * G + (uint32_t)r % G;
        float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (ok) {
            const float4 *src = (const float4 *)(po + (size_t)row * hd) + d4;
            const size_t stride4 = (size_t)n_rows * hd / 4; /* one split, in float4 */
            float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 16
            for (int s = 0; s < S; s++) {
                const float w = ms[s * MERGE_DR + r];
                const float4 v = __ldcg(src + (size_t)s * stride4);
                acc.x += w * v.x;
                acc.y += w * v.y;
                acc.z += w * v.z;
                acc.w += w * v.w;
            }
            const float L = Lr[r], inv = L > 0.0f ? 1.0f / L : 0.0f;
            o = make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
            float *out = p.out + (size_t)row * hd + 4 * d4;
            out[0] = o.x;
            out[1] = o.y;
            out[2] = o.z;
            out[3] = o.w;
            if (p.lse && d4 == 0)
                p.lse[row] = L > 0.0f ? (Mr[r] + log2f(L)) * LN2f : -INFINITY;
        }
        if (p.q8.q)
            q8_out(p, row, 4 * d4, o, ok);
    }
}

/* Which part of the call a CTA computes: split `split` of the n splits of
 * KV head g (n <= p.n_split, the partials' arrays are sized for p.n_split;
 * the last of the n CTAs to finish merges them). */
struct dec_part {
    uint32_t g, split, n;
};

/* The plain grid: KV head blockIdx.x, split blockIdx.y of p.n_split. */
__device__ __forceinline__ dec_part grid_part(const tkv_cuda_attn_params &p)
{
    return dec_part{blockIdx.x, blockIdx.y, p.n_split};
}

/* The pool (p.head_keys): the call's p.n_split CTAs (a 1-D grid) shared
 * among the H heads by their keys k_g, head g taking 1 + (T - H) k_g / K of
 * the T (K = the sum) in head order, so a head that reads most of the keys
 * gets most of the GPU where equal splits per head would leave the CTAs of
 * the others idle and that head's few running long. At most H - 1 CTAs are
 * left over; false for them. Heads reading (nearly) alike, K = 0 among
 * them, get T / H each: the plain grid's splits (the caller makes T a
 * multiple of H). The shares depend on the counts only: the same bits
 * each run. */
__device__ __forceinline__ bool pool_part(const tkv_cuda_attn_params &p, dec_part *part)
{
    const uint32_t H = p.n_head_kv, T = p.n_split, c = blockIdx.x;
    uint64_t K = 0, kmax = 0;
    for (uint32_t g = 0; g < H; g++) {
        const uint64_t k = __ldg(&p.head_keys[(size_t)g * p.head_cnt_stride]);
        K += k;
        kmax = max(kmax, k);
    }
    /* heads within 1/16 of reading alike: the equal splits (shares a CTA
     * or two off them measured slower there, docs/rabitq.md "Session 34") */
    const bool even = kmax * H * 16 <= K * 17;
    for (uint32_t g = 0, first = 0; g < H; g++) {
        const uint64_t k = __ldg(&p.head_keys[(size_t)g * p.head_cnt_stride]);
        const uint32_t n = even ? T / H : 1 + (uint32_t)((uint64_t)(T - H) * k / K);
        if (c < first + n) {
            *part = dec_part{g, c - first, n};
            return true;
        }
        first += n;
    }
    return false;
}

/* A warp's NS-stage cp.async pipeline over the chunks its cursor walks:
 * the constructor puts NS - 1 chunks in flight; next() refills the stage
 * computed last (every lane's reads of it done: __syncwarp), waits for the
 * oldest chunk's copies and returns it (nvalid < 0: the walk is over), its
 * K and V at k, v. The tensor-core instance reads other lanes' copies
 * (ldmatrix): a second __syncwarp after the wait. */
template <class C, class Walk> struct dec_pipe {
    static constexpr int NS = C::NS, STAGE = C::U * 32; /* uint4 of K (or V) a stage */
    Walk &cur;
    uint4 *wpipe; /* [NS][K|V][STAGE] */
    int lane, sub, dl, it = 0;
    uint32_t hd;
    chunk_meta meta[NS];
    const uint4 *k = nullptr, *v = nullptr;

    __device__ __forceinline__ dec_pipe(Walk &c, uint4 *w, int lane_, int sub_, int dl_, uint32_t hd_)
        : cur(c), wpipe(w), lane(lane_), sub(sub_), dl(dl_), hd(hd_)
    {
#pragma unroll
        for (int st = 0; st < NS - 1; st++)
            meta[st] = issue(st);
    }
    __device__ __forceinline__ chunk_meta issue(int st)
    {
        const chunk_meta m = issue_chunk<C>(cur.template src<C::CH>(hd), wpipe + (st * 2) * STAGE,
                                            wpipe + (st * 2 + 1) * STAGE, lane, sub, dl, hd);
        cur.template advance<C::CH>(NW);
        return m;
    }
    __device__ __forceinline__ chunk_meta next()
    {
        const int sc = it % NS, sn = (it + NS - 1) % NS;
        it++;
        __syncwarp();
        meta[NS - 1] = issue(sn);
        tkv_cp_async_wait<NS - 1>(); /* this thread's copies of the chunk have landed */
        if (C::MMA)
            __syncwarp();
        const chunk_meta mc = meta[0];
#pragma unroll
        for (int st = 0; st < NS - 1; st++)
            meta[st] = meta[st + 1];
        k = wpipe + (sc * 2) * STAGE, v = wpipe + (sc * 2 + 1) * STAGE;
        return mc;
    }
};

/* The end of a CTA, after its lane groups' results are in shared memory
 * (so [SLOTS][DR][HD] over the pipeline, cm and cl [SLOTS][DR]: the slots
 * 0, SLOT_STEP, ...; a group's row with l = 0 is skipped) and a barrier:
 * they are combined into the output (one split), or into this split's
 * partial and, by the last CTA of the KV head to finish, the merge. */
template <class C> __device__ __forceinline__ void decode_finish(const tkv_cuda_attn_params &p, const dec_part part)
{
    constexpr int HD = C::HD, DR = C::DR, SLOTS = C::SLOTS;
    extern __shared__ __align__(16) unsigned char smem[];
    const float *so = (const float *)smem;
    float *cm = (float *)(smem + C::PIPE) + NW * C::NG * C::PSTRIDE, *cl = cm + SLOTS * DR;
    int *flag = (int *)(cl + SLOTS * DR);
    const int tid = threadIdx.x;
    const uint32_t g = part.g, split = part.split, G = p.n_head / p.n_head_kv, hd = p.head_dim;
    const int R = (int)(p.n_q * G);
    const uint32_t n_rows = p.n_q * p.n_head;
    /* a thread per (row, 4 dims): the row's max and weights once for the 4,
     * so[]'s 4 in one 16-byte read (hd is a multiple of 8 on these calls);
     * each dim's sums in the slots' order, as one dim a thread did */
    const int nd4 = (int)hd / 4, lane = tid & 31;
    for (int i0 = tid - lane; i0 < R * nd4; i0 += NT) { /* whole warps at a time (q8_out) */
        const int i = i0 + lane, r = i / nd4, d = 4 * (i % nd4);
        const bool ok = i < R * nd4;
        const uint32_t row = (uint32_t)r / G * p.n_head + g * G + (uint32_t)r % G;
        float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f); /* the output (one split) */
        if (ok) {
            float M = -INFINITY;
#pragma unroll
            for (int sl = 0; sl < SLOTS; sl += C::SLOT_STEP)
                if (cl[sl * DR + r] > 0.0f)
                    M = fmaxf(M, cm[sl * DR + r]);
            float L = 0.0f;
            float4 O = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (M != -INFINITY) {
#pragma unroll
                for (int sl = 0; sl < SLOTS; sl += C::SLOT_STEP)
                    if (cl[sl * DR + r] > 0.0f) {
                        const float w = exp2f(cm[sl * DR + r] - M);
                        const float4 v = *(const float4 *)&so[((size_t)sl * DR + r) * HD + d];
                        L += cl[sl * DR + r] * w;
                        O.x += v.x * w;
                        O.y += v.y * w;
                        O.z += v.z * w;
                        O.w += v.w * w;
                    }
            }
            if (part.n == 1) {
                if (L > 0.0f)
                    o = make_float4(O.x / L, O.y / L, O.z / L, O.w / L);
                float *out = p.out + (size_t)row * hd + d;
                out[0] = o.x;
                out[1] = o.y;
                out[2] = o.z;
                out[3] = o.w;
                if (p.lse && d == 0)
                    p.lse[row] = L > 0.0f ? (M + log2f(L)) * LN2f : -INFINITY;
            } else {
                *(float4 *)&p.part[((size_t)split * n_rows + row) * hd + d] = O; /* (16-byte aligned: hd % 4 == 0) */
                if (d == 0) {
                    float *ml = p.part + (size_t)p.n_split * n_rows * hd + ((size_t)split * n_rows + row) * 2;
                    ml[0] = M;
                    ml[1] = L;
                }
            }
        }
        if (part.n == 1 && p.q8.q)
            q8_out(p, row, d, o, ok);
    }
    if (part.n == 1 || p.decode_mode == TKV_ATTN_DECODE_MERGE)
        return;

    /* ---- the last CTA of this KV head to finish merges the head's splits */
    __threadfence(); /* this thread's partials are visible device-wide ... */
    __syncthreads(); /* ... for every thread, before the count goes up */
    if (tid == 0) {
        const unsigned done = atomicAdd(&p.counters[g], 1u);
        const int last = done == part.n - 1;
        if (last)
            atomicExch(&p.counters[g], 0u); /* ready for the next call */
        *flag = last;
    }
    __syncthreads();
    if (*flag) {
        __threadfence();
        merge_head(p, g, (int)part.n, (float *)smem);
    }
}

/* decode_cta's work on the CUDA cores (the module comment at the top). */
template <class C, class Walk>
__device__ __forceinline__ void decode_cta_cores(const tkv_cuda_attn_params &p, const dec_part part, Walk &cur,
                                                 const int32_t *q_pos)
{
    constexpr int HD = C::HD, DR = C::DR, U = C::U, NS = C::NS, LPK = C::LPK, NG = C::NG, V = C::V, NF = C::NF,
                  W = C::W, SLOTS = C::SLOTS;
    extern __shared__ __align__(16) unsigned char smem[];
    uint4 *pipe = (uint4 *)smem;
    float *pbuf = (float *)(smem + C::PIPE);
    float *cm = pbuf + NW * NG * C::PSTRIDE, *cl = cm + SLOTS * DR;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int sub = lane / LPK, dl = lane % LPK, slot = warp * NG + sub;
    const uint32_t g = part.g;
    const uint32_t G = p.n_head / p.n_head_kv, hd = p.head_dim, ld = p.n_head * hd;
    const int R = (int)(p.n_q * G);
    const bool dim_ok = dl * 8 < (int)hd;

    /* the first chunks' copies go out before the query is read: its round
     * trip overlaps theirs */
    dec_pipe<C, Walk> pl(cur, pipe + (size_t)warp * NS * 2 * U * 32, lane, sub, dl, hd);

    /* the rows' queries (8 dims of this lane), in log2 units */
    float q[DR][8];
#pragma unroll
    for (int r = 0; r < DR; r++) {
        const uint32_t t = (uint32_t)r / G, h = g * G + (uint32_t)r % G;
#pragma unroll
        for (int i = 0; i < 8; i++)
            q[r][i] = (r < R && dim_ok) ? p.q[(size_t)t * ld + (size_t)h * hd + dl * 8 + i] * p.scale_log2 : 0.0f;
    }
    /* the row whose scores this lane holds after the butterfly */
    const int r_own = dl / W, u_own = (dl % W) * NF;
    const int32_t qp_own = r_own < R ? q_pos[(uint32_t)r_own / G] : INT_MIN;

    float o[DR][8], m[DR];
#pragma unroll
    for (int r = 0; r < DR; r++) {
        m[r] = -INFINITY;
#pragma unroll
        for (int i = 0; i < 8; i++)
            o[r][i] = 0.0f;
    }
    float m_own = -INFINITY, l_own = 0.0f;

    float *pb = pbuf + (size_t)(warp * NG + sub) * C::PSTRIDE;

    for (;;) {
        const chunk_meta mc = pl.next();
        if (mc.nvalid < 0) /* warp-uniform: every lane walks the same cursor */
            break;
        const uint4 *ks = pl.k, *vs = pl.v;

        /* ---- partial scores: s[r*U + u] over this lane's 8 dims */
        float s[V];
#pragma unroll
        for (int u = 0; u < U; u++) {
            float kf[8];
            h8_to_f32(ks[u * 32 + lane], kf);
#pragma unroll
            for (int r = 0; r < DR; r++) {
                float a = 0.0f;
#pragma unroll
                for (int i = 0; i < 8; i++)
                    a = fmaf(q[r][i], kf[i], a);
                s[r * U + u] = a;
            }
        }
        xreduce<V, LPK / 2>(s, lane);

        /* ---- mask; this lane's row: max over the chunk */
        float mx = -INFINITY;
#pragma unroll
        for (int j = 0; j < NF; j++) {
            const int kk = (u_own + j) * NG + sub;
            const bool ok = kk < mc.nvalid && mc.kpos0 + kk <= qp_own;
            s[j] = ok ? s[j] : -INFINITY;
            mx = fmaxf(mx, s[j]);
        }
#pragma unroll
        for (int off = W / 2; off > 0; off >>= 1)
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));

        /* ---- online softmax: every row's correction (for o), own row's sum */
        const int gbase = lane & ~(LPK - 1);
#pragma unroll
        for (int r = 0; r < DR; r++) {
            const float mt = __shfl_sync(0xffffffffu, mx, gbase + r * W);
            const float mn = fmaxf(m[r], mt);
            const float corr = exp2f(m[r] - (mn == -INFINITY ? 0.0f : mn)); /* 0 when m[r] = -inf */
            m[r] = mn;
#pragma unroll
            for (int i = 0; i < 8; i++)
                o[r][i] *= corr;
        }
        {
            const float mn = fmaxf(m_own, mx), mu = mn == -INFINITY ? 0.0f : mn;
            const float corr = exp2f(m_own - mu);
            float ps = 0.0f;
#pragma unroll
            for (int j = 0; j < NF; j++) {
                s[j] = exp2f(s[j] - mu); /* 0 for masked keys */
                ps += s[j];
            }
            l_own = l_own * corr + ps;
            m_own = mn;
        }

        /* ---- probabilities to every lane of the group, then O += P V */
        __syncwarp(); /* the previous chunk's reads of pb are done */
#pragma unroll
        for (int j = 0; j < NF; j++)
            pb[dl * NF + j] = s[j];
        __syncwarp();
#pragma unroll
        for (int u = 0; u < U; u++) {
            float vf[8];
            h8_to_f32(vs[u * 32 + lane], vf);
#pragma unroll
            for (int r = 0; r < DR; r++) {
                const float pr = pb[r * U + u];
#pragma unroll
                for (int i = 0; i < 8; i++)
                    o[r][i] = fmaf(pr, vf[i], o[r][i]);
            }
        }
    }
    tkv_cp_async_wait_all();

    /* ---- combine the CTA's lane groups */
#pragma unroll
    for (int off = W / 2; off > 0; off >>= 1)
        l_own += __shfl_xor_sync(0xffffffffu, l_own, off);
    __syncthreads(); /* every warp is done with pipe: so[] reuses it */
    float *so = (float *)smem; /* [SLOTS][DR][HD] */
#pragma unroll
    for (int r = 0; r < DR; r++)
        if (r < R && dim_ok) {
            float4 *dst = (float4 *)(so + ((size_t)slot * DR + r) * HD + dl * 8);
            dst[0] = make_float4(o[r][0], o[r][1], o[r][2], o[r][3]);
            dst[1] = make_float4(o[r][4], o[r][5], o[r][6], o[r][7]);
        }
    if (dl % W == 0) {
        cm[slot * DR + r_own] = m_own;
        cl[slot * DR + r_own] = l_own;
    }
    __syncthreads();
    decode_finish<C>(p, part);
}

/* decode_cta's work on the tensor cores (C::MMA: head_dim class 128, up
 * to 8 rows; sm_80 and later). The chunks are decode_cta's (16 keys a warp,
 * K and V [key][128] f16 in the stage, each row's 16-byte units swizzled by
 * the key: issue_chunk), the arithmetic per chunk a warp's:
 *   S^T [16 keys x 8 rows] = K Q^T   8 m16n8k16 (A = K by ldmatrix, B = Q^T
 *                                    from registers), twice: Q as f16 hi +
 *                                    lo (what hi left out), so the scores
 *                                    are those of the f32 query to ~2^-22;
 *   online softmax per row           a lane holds rows 2t, 2t + 1 of keys g,
 *                                    g + 8 (g = lane / 4, t = lane % 4): the
 *                                    row max over 3 shuffles, the sum per
 *                                    lane until the end;
 *   O^T [128 x 8 rows] += V^T P^T    8 m16n8k16 (A = V^T by ldmatrix.trans,
 *                                    B = P^T: S^T's accumulators as f16 hi
 *                                    and lo, transposed by movmatrix), twice.
 * Where decode_cta's CUDA cores spend ~1300 instructions a chunk of 16 keys
 * and 8 rows, this spends ~150. The warp's (m, l, O) go to its first slot
 * of so / cm / cl (SLOT_STEP), then decode_finish. */
template <class C, class Walk>
__device__ __forceinline__ void decode_cta_mma(const tkv_cuda_attn_params &p, const dec_part part, Walk &cur,
                                               const int32_t *q_pos)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    using tkv_pf::ldsm_x4, tkv_pf::ldsm_x4_t, tkv_pf::mma16816, tkv_pf::movmatrix_t, tkv_pf::smem_u32, tkv_pf::split_h2;
    constexpr int HD = C::HD, DR = C::DR, U = C::U, NS = C::NS, LPK = C::LPK, NG = C::NG;
    static_assert(HD == 128 && LPK == 16 && NG == 2 && U == 8 && DR <= 8, "16 keys of 128 dims a chunk, 8 rows");
    extern __shared__ __align__(16) unsigned char smem[];
    uint4 *pipe = (uint4 *)smem;
    float *cm = (float *)(smem + C::PIPE) + NW * NG * C::PSTRIDE, *cl = cm + C::SLOTS * DR;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int sub = lane / LPK, dl = lane % LPK, gq = lane >> 2, tq = lane & 3;
    const uint32_t g = part.g, G = p.n_head / p.n_head_kv, hd = p.head_dim, ld = p.n_head * hd;
    const int R = (int)(p.n_q * G);

    /* the first chunks' copies go out before the query is read: its round
     * trip overlaps theirs. A stage: [K|V][16 keys][16 units] */
    dec_pipe<C, Walk> pl(cur, pipe + (size_t)warp * NS * 2 * U * 32, lane, sub, dl, hd);

    /* Q^T's B fragments: row gq, dims 16c + 2tq (+1) and 16c + 2tq + 8 (+9),
     * in log2 units, f16 hi and lo; rows past R and dims past hd zero */
    uint32_t qh[8][2], ql[8][2];
    {
        const bool row_ok = gq < R;
        const uint32_t t = row_ok ? (uint32_t)gq / G : 0, h = g * G + (row_ok ? (uint32_t)gq % G : 0);
        const float *qr = p.q + (size_t)t * ld + (size_t)h * hd;
#pragma unroll
        for (int c = 0; c < 8; c++)
#pragma unroll
            for (int x = 0; x < 2; x++) {
                const uint32_t d = 16 * c + 2 * tq + 8 * x;
                const bool ok = row_ok && d < hd; /* (hd is a multiple of 8) */
                split_h2(ok ? qr[d] * p.scale_log2 : 0.0f, ok ? qr[d + 1] * p.scale_log2 : 0.0f, qh[c][x], ql[c][x]);
            }
    }
    /* the positions of this lane's rows 2tq, 2tq + 1 (past R: none visible) */
    int32_t qp[2];
#pragma unroll
    for (int x = 0; x < 2; x++)
        qp[x] = 2 * tq + x < R ? q_pos[(uint32_t)(2 * tq + x) / G] : INT_MIN;

    float o[8][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
#pragma unroll
    for (int c = 0; c < 8; c++)
        o[c][0] = o[c][1] = o[c][2] = o[c][3] = 0.0f;

    /* ldmatrix row addresses: K (A = 16 keys x 16 dims): matrices (keys 0-7 |
     * 8-15) x (units 2c | 2c + 1); V (A = V^T, 16 dims x 16 keys, .trans):
     * (keys 0-7, 2c), (0-7, 2c + 1), (8-15, 2c), (8-15, 2c + 1) */
    const int krow = (lane & 7) + ((lane >> 3) & 1) * 8, kcol = lane >> 4;
    const int vrow = (lane & 7) + (lane >> 4) * 8, vcol = (lane >> 3) & 1;

    for (;;) {
        const chunk_meta mc = pl.next();
        if (mc.nvalid < 0)
            break;
        const uint32_t ks = smem_u32(pl.k), vs = smem_u32(pl.v);

        /* ---- S^T = K Q^T: s[0], s[1] key gq, rows 2tq, 2tq + 1; s[2], s[3] key gq + 8 */
        float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int c = 0; c < 8; c++) {
            uint32_t a[4];
            const int u = 2 * c + kcol;
            ldsm_x4(ks + (uint32_t)(krow * 16 + (u ^ (krow & 7))) * 16, a[0], a[1], a[2], a[3]);
            mma16816(s, a, qh[c][0], qh[c][1]);
            mma16816(s, a, ql[c][0], ql[c][1]);
        }
        /* ---- mask; the rows' max over the chunk; online softmax */
#pragma unroll
        for (int x = 0; x < 4; x++) {
            const int kk = gq + 8 * (x >> 1);
            s[x] = kk < mc.nvalid && mc.kpos0 + kk <= qp[x & 1] ? s[x] : -INFINITY;
        }
        float corr[2], mu[2];
#pragma unroll
        for (int x = 0; x < 2; x++) {
            float mx = fmaxf(s[x], s[x + 2]);
#pragma unroll
            for (int off = 4; off < 32; off <<= 1)
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
            const float mn = fmaxf(m[x], mx);
            mu[x] = mn == -INFINITY ? 0.0f : mn;
            corr[x] = exp2f(m[x] - mu[x]); /* 0 when m was -inf */
            m[x] = mn;
        }
#pragma unroll
        for (int x = 0; x < 4; x++)
            s[x] = exp2f(s[x] - mu[x & 1]); /* 0 for masked keys */
        l[0] = l[0] * corr[0] + s[0] + s[2];
        l[1] = l[1] * corr[1] + s[1] + s[3];
#pragma unroll
        for (int c = 0; c < 8; c++)
#pragma unroll
            for (int x = 0; x < 4; x++)
                o[c][x] *= corr[x & 1];
        /* ---- O^T += V^T P^T: P^T's B fragments (keys 2tq.., row gq) by transposing S^T's */
        uint32_t ph0, pl0, ph1, pl1;
        split_h2(s[0], s[1], ph0, pl0);
        split_h2(s[2], s[3], ph1, pl1);
        const uint32_t bh0 = movmatrix_t(ph0), bh1 = movmatrix_t(ph1), bl0 = movmatrix_t(pl0), bl1 = movmatrix_t(pl1);
#pragma unroll
        for (int c = 0; c < 8; c++) {
            uint32_t a[4];
            const int u = 2 * c + vcol;
            ldsm_x4_t(vs + (uint32_t)(vrow * 16 + (u ^ (vrow & 7))) * 16, a[0], a[1], a[2], a[3]);
            mma16816(o[c], a, bh0, bh1);
            mma16816(o[c], a, bl0, bl1);
        }
    }
    tkv_cp_async_wait_all();

    /* ---- the warp's rows: l summed over its lanes; (m, l, O) to its first slot */
#pragma unroll
    for (int x = 0; x < 2; x++)
#pragma unroll
        for (int off = 4; off < 32; off <<= 1)
            l[x] += __shfl_xor_sync(0xffffffffu, l[x], off);
    __syncthreads(); /* every warp is done with pipe: so[] reuses it */
    float *so = (float *)smem; /* [SLOTS][DR][HD] */
    const int slot = warp * NG;
#pragma unroll
    for (int x = 0; x < 2; x++) {
        const int r = 2 * tq + x;
        if (r < DR) {
#pragma unroll
            for (int c = 0; c < 8; c++) {
                so[((size_t)slot * DR + r) * HD + 16 * c + gq] = o[c][x];
                so[((size_t)slot * DR + r) * HD + 16 * c + gq + 8] = o[c][2 + x];
            }
            if (gq == 0)
                cm[slot * DR + r] = m[x], cl[slot * DR + r] = l[x];
        }
    }
    __syncthreads();
    decode_finish<C>(p, part);
#endif
}

/* One CTA of the decode kernel: part's split, its chunks walked by cur
 * (positioned at the CTA's first chunk); q_pos [n_q] (device or parameter
 * memory). */
template <class C, class Walk>
__device__ __forceinline__ void decode_cta(const tkv_cuda_attn_params &p, const dec_part part, Walk &cur,
                                           const int32_t *q_pos)
{
    if constexpr (C::MMA)
        decode_cta_mma<C>(p, part, cur, q_pos);
    else
        decode_cta_cores<C>(p, part, cur, q_pos);
}

/* A CTA over the packed table in device memory: part's split of KV head
 * part.g's entries [hb, he); q_pos [n_q]. */
template <class C>
__device__ __forceinline__ void decode_table(const tkv_cuda_attn_params &p, const dec_part part,
                                             const int32_t *q_pos, uint32_t hb, uint32_t he)
{
    const uint32_t split = part.split, G = p.n_head / p.n_head_kv;
    const int R = (int)(p.n_q * G);
    int32_t pos_max = INT_MIN;
#pragma unroll
    for (int r = 0; r < C::DR; r++)
        if (r < R)
            pos_max = max(pos_max, q_pos[(uint32_t)r / G]);

    /* this split's blocks; the warp's first chunk */
    tab_walk w;
    w.blocks = p.blocks;
    w.pos_max = pos_max;
    dec_cursor &cur = w.c;
    const uint32_t nbh = he - hb;
    cur.e.k = cur.e.v = nullptr;
    cur.e.pos0 = 0;
    cur.e.n = 0;
    cur.en = cur.e;
    cur.b = hb + (uint32_t)((uint64_t)nbh * split / part.n);
    cur.b_end = hb + (uint32_t)((uint64_t)nbh * (split + 1) / part.n);
    cur.j = 0;
    if (cur.b < cur.b_end) {
        cur.e = load_entry(p.blocks, cur.b);
        cur.en = cur.b + 1 < cur.b_end ? load_entry(p.blocks, cur.b + 1) : cur.e;
        if (cur.e.pos0 > pos_max)
            cur.b = cur.b_end;
    }
    w.template advance<C::CH>((int)(threadIdx.x >> 5));
    decode_cta<C>(p, part, w, q_pos);
}

/* The decode kernel over the packed table in device memory. Under a
 * programmatic dependent launch (p.pdl) it waits at once: everything it
 * reads but its parameters (the table, q, K/V) an earlier op writes. */
template <class C> __global__ void __launch_bounds__(NT, 2) attn_decode_kernel(const tkv_cuda_attn_params p)
{
    tkv_pdl_trigger();
    tkv_pdl_wait();
    const dec_part part = grid_part(p);
    decode_table<C>(p, part, p.q_pos, p.head_off[part.g], tkv_cuda_head_end(p, part.g));
}

/* The same over device views whose positions and head ranges travel in the
 * parameters (tkv_cuda_attn_views): nothing staged before it. With
 * p.head_keys a pool (pool_part), else the plain grid. */
template <class C>
__global__ void __launch_bounds__(NT, 2)
    attn_decode_views_kernel(const tkv_cuda_attn_params p, const __grid_constant__ tkv_cuda_attn_views v)
{
    tkv_pdl_trigger();
    tkv_pdl_wait();
    dec_part part = grid_part(p);
    if (p.head_keys && !pool_part(p, &part))
        return;
    const uint32_t g = part.g, hb = v.head_off[g];
    const uint32_t he = p.head_cnt ? min(v.head_end[g], hb + p.head_cnt[(size_t)g * p.head_cnt_stride]) : v.head_end[g];
    decode_table<C>(p, part, v.q_pos, hb, he);
}

/* 4 KiB: the parameter space every driver takes (CUDA 12.1 raised it to
 * 32 KiB on Volta and later; larger parameters also cost more per launch). */
static_assert(sizeof(tkv_cuda_attn_params) + sizeof(tkv_cuda_attn_runs) <= 4096, "kernel parameters");

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
/* Asks L2 for the K and V of the walk's next n chunks of this warp (a copy
 * of the walk: the caller's is unchanged; tkv_prefetch_l2 says why it may
 * run before the wait, while the step's own K/V row is still being
 * written). Chunk rows are whole 16-byte units (vec16), as it needs. */
template <class C> __device__ __forceinline__ void prefetch_chunks(run_walk w, uint32_t n, uint32_t hd)
{
    for (uint32_t i = 0; i < n; i++) {
        const chunk_src c = w.template src<C::CH>(hd);
        if (!c.k)
            return;
        const uint32_t bytes = (uint32_t)c.nvalid * hd * (uint32_t)sizeof(uint16_t);
        tkv_prefetch_l2(c.k, bytes);
        tkv_prefetch_l2(c.v, bytes);
        w.template advance<C::CH>(NW);
    }
}
#endif

/* The decode kernel over inline runs. Before griddepcontrol.wait it reads
 * only its parameters: under a programmatic dependent launch that part
 * overlaps the previous kernel's drain, and no global memory the previous
 * kernels write (q, K/V, out, part, counters) is touched before they end.
 * Without the launch attribute both instructions do nothing. */
template <class C>
__global__ void __launch_bounds__(NT, 2)
    attn_decode_runs_kernel(const tkv_cuda_attn_params p, const __grid_constant__ tkv_cuda_attn_runs rp)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    const uint32_t g = blockIdx.x, split = blockIdx.y, nc = rp.n_chunks[g];
    run_walk w;
    w.runs = rp.runs;
    w.c = (uint32_t)((uint64_t)nc * split / p.n_split);
    w.c_end = (uint32_t)((uint64_t)nc * (split + 1) / p.n_split);
    w.template start<C::CH>(rp.run_off[g], rp.run_off[g + 1]);
    w.template advance<C::CH>((int)(threadIdx.x >> 5));
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (p.prefetch && (threadIdx.x & 31) == 0)
        prefetch_chunks<C>(w, p.prefetch, p.head_dim);
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    decode_cta<C>(p, grid_part(p), w, rp.q_pos);
}

__global__ void __launch_bounds__(NT) attn_decode_merge_kernel(const tkv_cuda_attn_params p)
{
    extern __shared__ __align__(16) unsigned char smem[];
    merge_head(p, blockIdx.x, (int)p.n_split, (float *)smem);
}

/* The launches, each for the configuration C that by_shape picks; pdl:
 * the launch attribute that lets the kernel start while the previous
 * kernel of the stream drains (the kernel waits for it, griddepcontrol). */
struct launch_table {
    const tkv_cuda_attn_params *p;
    cudaStream_t s;
    template <class C> cudaError_t go() const
    {
        return tkv_cuda_launch(p->pdl != 0, dim3(p->n_head_kv, p->n_split), NT, C::SMEM, s, attn_decode_kernel<C>,
                               *p);
    }
};
struct launch_views {
    const tkv_cuda_attn_params *p;
    const tkv_cuda_attn_views *v;
    cudaStream_t s;
    template <class C> cudaError_t go() const
    {
        const dim3 grid = p->head_keys ? dim3(p->n_split) : dim3(p->n_head_kv, p->n_split);
        return tkv_cuda_launch(p->pdl != 0, grid, NT, C::SMEM, s, attn_decode_views_kernel<C>, *p, *v);
    }
};
struct launch_runs {
    const tkv_cuda_attn_params *p;
    const tkv_cuda_attn_runs *r;
    bool pdl;
    cudaStream_t s;
    template <class C> cudaError_t go() const
    {
        return tkv_cuda_launch(pdl, dim3(p->n_head_kv, p->n_split), dim3(NT), C::SMEM, s, attn_decode_runs_kernel<C>,
                               *p, *r);
    }
};
struct chunk_keys_of {
    template <class C> uint32_t go() const { return (uint32_t)C::CH; }
};

template <class C> cudaError_t init_decode(int *ctas)
{
    TKV_CUDA_TRY(cudaFuncSetAttribute(attn_decode_runs_kernel<C>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      (int)C::SMEM));
    TKV_CUDA_TRY(cudaFuncSetAttribute(attn_decode_kernel<C>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)C::SMEM));
    TKV_CUDA_TRY(cudaFuncSetAttribute(attn_decode_views_kernel<C>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      (int)C::SMEM));
    TKV_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(ctas, attn_decode_kernel<C>, NT, C::SMEM));
    if (*ctas < 1)
        *ctas = 1;
    return cudaSuccess;
}

int hd_index(uint32_t hd) { return hd <= 64 ? 0 : hd <= 128 ? 1 : 2; }

/* CTAs per SM of each instance: [head_dim class][rows <= 4, <= 8], and of
 * the tensor-core ones (head_dim class 128) */
int g_ctas[3][2], g_ctas_mma[2];
bool g_mma_built; /* the tensor-core instances have a body (compiled for sm_80 or later) */

cudaError_t init_all(void)
{
    TKV_CUDA_TRY((init_decode<cfg0<64, 4>>(&g_ctas[0][0])));
    TKV_CUDA_TRY((init_decode<cfg0<64, 8>>(&g_ctas[0][1])));
    TKV_CUDA_TRY((init_decode<cfg0<128, 4>>(&g_ctas[1][0])));
    TKV_CUDA_TRY((init_decode<cfg0<128, 8>>(&g_ctas[1][1])));
    TKV_CUDA_TRY((init_decode<cfg0<256, 4>>(&g_ctas[2][0])));
    TKV_CUDA_TRY((init_decode<cfg0<256, 8>>(&g_ctas[2][1])));
    TKV_CUDA_TRY((init_decode<cfg_mma<4>>(&g_ctas_mma[0])));
    TKV_CUDA_TRY((init_decode<cfg_mma<8>>(&g_ctas_mma[1])));
    /* a build for older targets JIT-compiled on a newer device has an empty
     * body, which must not run */
    cudaFuncAttributes fa;
    g_mma_built = cudaFuncGetAttributes(&fa, attn_decode_kernel<cfg_mma<8>>) == cudaSuccess && fa.ptxVersion >= 80;
    return cudaSuccess;
}

/* whether a call runs the tensor-core instance */
bool use_mma(uint32_t hd, bool mma) { return mma && g_mma_built && hd_index(hd) == 1; }

/* f.go<C>() for the configuration C that serves head_dim hd and `rows`
 * query rows per KV head (mma: the tensor-core one where it serves hd) */
template <class F> auto by_shape(uint32_t hd, uint32_t rows, bool mma, const F &f)
{
    const bool small = rows <= 4;
    if (use_mma(hd, mma))
        return small ? f.template go<cfg_mma<4>>() : f.template go<cfg_mma<8>>();
    switch (hd_index(hd)) {
    case 0: return small ? f.template go<cfg0<64, 4>>() : f.template go<cfg0<64, 8>>();
    case 1: return small ? f.template go<cfg0<128, 4>>() : f.template go<cfg0<128, 8>>();
    default: return small ? f.template go<cfg0<256, 4>>() : f.template go<cfg0<256, 8>>();
    }
}

uint32_t rows_of(const tkv_cuda_attn_params *p) { return p->n_q * (p->n_head / p->n_head_kv); }

/* the merge kernel after the decode kernel in TKV_ATTN_DECODE_MERGE mode */
cudaError_t merge_after(const tkv_cuda_attn_params *p, cudaStream_t s)
{
    if (p->n_split > 1 && p->decode_mode == TKV_ATTN_DECODE_MERGE) {
        const size_t smem = (2 * (size_t)p->n_split * MERGE_DR + 2 * MERGE_DR) * sizeof(float);
        attn_decode_merge_kernel<<<p->n_head_kv, NT, smem, s>>>(*p);
        TKV_CUDA_LAUNCHED();
    }
    return cudaSuccess;
}

} // namespace

uint32_t tkv_cuda_attn_decode_chunk_keys(uint32_t head_dim, uint32_t rows)
{
    static_assert(cfg_mma<4>::CH == cfg0<128, 4>::CH && cfg_mma<8>::CH == cfg0<128, 8>::CH,
                  "the tensor-core instances chunk as the others do: one plan for both");
    return by_shape(head_dim, rows, false, chunk_keys_of{});
}

cudaError_t tkv_cuda_attn_decode_runs(const struct tkv_cuda_attn_params *p, const struct tkv_cuda_attn_runs *r, bool pdl,
                                      cudaStream_t s)
{
    TKV_CUDA_TRY(by_shape(p->head_dim, rows_of(p), p->decode_mma != 0, launch_runs{p, r, pdl, s}));
    TKV_CUDA_LAUNCHED();
    return cudaSuccess;
}

cudaError_t tkv_cuda_attn_decode_init(void)
{
    return init_all();
}

int tkv_cuda_attn_decode_ctas_per_sm(uint32_t head_dim, uint32_t rows, bool mma)
{
    const int c = use_mma(head_dim, mma) ? g_ctas_mma[rows <= 4 ? 0 : 1] : g_ctas[hd_index(head_dim)][rows <= 4 ? 0 : 1];
    return c > 0 ? c : 1;
}

cudaError_t tkv_cuda_attn_decode(const struct tkv_cuda_attn_params *p, cudaStream_t s)
{
    TKV_CUDA_TRY(by_shape(p->head_dim, rows_of(p), p->decode_mma != 0, launch_table{p, s}));
    return merge_after(p, s);
}

cudaError_t tkv_cuda_attn_decode_views(const struct tkv_cuda_attn_params *p, const struct tkv_cuda_attn_views *v,
                                       cudaStream_t s)
{
    TKV_CUDA_TRY(by_shape(p->head_dim, rows_of(p), p->decode_mma != 0, launch_views{p, v, s}));
    return merge_after(p, s);
}
