/*
 * attn-prefill-walk.cuh -- the device pieces the tensor-core kernels share
 * (internal to gpu/): PTX wrappers (ldmatrix, movmatrix, mma.sync m16n8k16,
 * cp.async) and f16 hi/lo splitting, which the decode kernel's tensor-core
 * instance (attn-decode.cu) takes too; and the prefill kernels' two K/V
 * walks (attn-prefill*.cu) that fill one 64-key shared-memory stage: the
 * packed walk (fill_packed: tile t of a split = keys [64t, 64t +
 * 64) of the concatenation of the head's refs) and the per-ref walk
 * (fill_tile). Both are run by NT = 128 threads, 4 warps
 * each filling 16 rows of the stage: the whole CTA of v0 and v1, the first
 * warpgroup of v2, the third of v3 (the producer; W0 = 8, its first warp).
 * Stage layout: K and V each in the kernel's layout (pad_layout or
 * sw128_layout, below), kpos [BN] positions (INT_MAX past the keys).
 */
#ifndef TKV_GPU_ATTN_PREFILL_WALK_CUH
#define TKV_GPU_ATTN_PREFILL_WALK_CUH

#include "attn.cuh"

namespace tkv_pf {

constexpr int NT = 128; /* threads that fill a stage (4 warps) */
constexpr int BN = 64;  /* keys per tile                        */

/* Where 16-byte unit `col` (HD / 8 per row) of a stage's row `row` lies,
 * in f16 elements from the stage's start. pad_layout: rows of HD + 8 halves
 * (the ldmatrix kernels v0, v1: the 8 extra halves spread the rows over the
 * banks). sw128_layout: the layout Hopper's wgmma reads through a 128-byte
 * swizzled descriptor (v2, attn-prefill-wg.cu): the row's halves 64c ..
 * 64c + 63 in region c (BN rows of 128 bytes each), unit u of that range at
 * position u ^ (row % 8) of its row; regions 1024-byte aligned. */
template <int HD> struct pad_layout {
    static __device__ __forceinline__ int at(int row, int col) { return row * (HD + 8) + col * 8; }
};
/* The Q tile of v0 and v1: rows of HD + 8 halves, by element column d */
template <int HD> struct q_pad {
    static __device__ __forceinline__ int at(int r, int d) { return r * (HD + 8) + d; }
};
template <int HD> struct sw128_layout {
    static __device__ __forceinline__ int at(int row, int col)
    {
        return (col >> 3) * BN * 64 + row * 64 + (((col & 7) ^ (row & 7)) << 3);
    }
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

/* The transpose of an 8x8 matrix of 16-bit values, a row pair a lane (lane
 * 4r + c holds elements 2c, 2c + 1 of row r, before and after; sm_75+) */
__device__ __forceinline__ uint32_t movmatrix_t(uint32_t x)
{
    uint32_t y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
    return y;
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


/* ---- the CTA's query rows and results, the same in every variant ---------- */

/* Where a CTA of v1-v3 works (their grid: row tiles of BM rows x KV heads,
 * heaviest row tile first -- blockIdx.x = (n_tiles - 1 - tile) * n_head_kv
 * + KV head -- and the key splits): rows r0 .. r0 + R - 1 of KV head gk's
 * query rows, split `split`; G query heads per KV head. */
struct cta_rows {
    uint32_t G, gk, split, r0;
    int R;
};
template <int BM> __device__ __forceinline__ cta_rows cta_rows_of(const tkv_cuda_attn_params &p)
{
    cta_rows c;
    c.G = p.n_head / p.n_head_kv;
    const uint32_t n_tiles = gridDim.x / p.n_head_kv;
    c.gk = blockIdx.x % p.n_head_kv;
    c.split = blockIdx.y;
    c.r0 = (n_tiles - 1 - blockIdx.x / p.n_head_kv) * BM;
    c.R = (int)min((uint32_t)BM, p.n_q * c.G - c.r0);
    return c;
}

constexpr float LN2 = 0.693147180559945309f;

/* Rows r0 .. r0 + R - 1 of KV head gk's query rows (n_q tokens x G heads,
 * token-major) into shared memory as f16 hi (Qh) and lo (Ql, SPLIT only),
 * rows R .. BM - 1 zero, by NTHR threads; QL::at(r, d): the element offset
 * of row r's columns d, d + 1 (d even). Their positions into qpos (INT_MIN
 * past R).
 *
 * The loads of a batch (up to 8 float4 per thread) are all issued before
 * the first is used: the tile is 32-64 KB and a thread's loads are
 * independent, so one memory latency per batch instead of one per load
 * (the loop with a load at a time cost ~20 us per CTA, measured on the
 * H200 as a fixed cost that made 8K-token prefill 15% slower than 128K).
 * q is 16-byte aligned (tkv_cuda_attn_prefill_ok). */
template <int HD, int BM, int NTHR, bool SPLIT, class QL>
__device__ __forceinline__ void load_queries(const tkv_cuda_attn_params &p, uint32_t gk, uint32_t r0, int R,
                                             __half *Qh, __half *Ql, int *qpos)
{
    const int tid = threadIdx.x;
    const uint32_t G = p.n_head / p.n_head_kv, ld = p.n_head * HD;
    /* element d .. d + 3 of row r (d a multiple of 4): the float4's 2 pairs */
    auto put = [&](int r, int d, float4 x) {
        uint32_t hi, lo;
        split_h2(x.x, x.y, hi, lo);
        *(uint32_t *)(Qh + QL::at(r, d)) = hi;
        if (SPLIT)
            *(uint32_t *)(Ql + QL::at(r, d)) = lo;
        split_h2(x.z, x.w, hi, lo);
        *(uint32_t *)(Qh + QL::at(r, d + 2)) = hi;
        if (SPLIT)
            *(uint32_t *)(Ql + QL::at(r, d + 2)) = lo;
    };
    auto src = [&](int r, int d) {
        const uint32_t rr = r0 + r, tok = rr / G, h = gk * G + rr % G;
        return p.q + (size_t)tok * ld + (size_t)h * HD + d;
    };
    constexpr int UNITS = BM * HD / 4; /* float4s of the tile */
    constexpr int PER = UNITS / NTHR, BATCH = PER < 8 ? PER : 8;
    static_assert(UNITS % NTHR == 0 && PER % BATCH == 0, "whole batches of whole float4s");
    for (int b0 = 0; b0 < PER; b0 += BATCH) {
        float4 x[BATCH];
#pragma unroll
        for (int k = 0; k < BATCH; k++) {
            const int i = tid + (b0 + k) * NTHR, r = i / (HD / 4), d = 4 * (i % (HD / 4));
            x[k] = r < R ? __ldg((const float4 *)src(r, d)) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
#pragma unroll
        for (int k = 0; k < BATCH; k++) {
            const int i = tid + (b0 + k) * NTHR;
            put(i / (HD / 4), 4 * (i % (HD / 4)), x[k]);
        }
    }
    for (int r = tid; r < BM; r += NTHR)
        qpos[r] = r < R ? p.q_pos[(r0 + r) / G] : INT_MIN;
}

/* One query row's result from the 4 threads that hold it (t = lane & 3):
 * this thread's columns 8 dt + 2 t + e (e = 0, 1) of the unnormalized O are
 * o(dt, e); M is the row's max (log2 units), L its sum. One split: out
 * (and lse); else the split's partial row (O, M, L). rr: the row among KV
 * head gk's query rows. */
template <int HD, class O>
__device__ __forceinline__ void store_row(const tkv_cuda_attn_params &p, uint32_t gk, uint32_t split, uint32_t rr,
                                          float M, float L, O o)
{
    const int t = threadIdx.x & 3;
    const uint32_t G = p.n_head / p.n_head_kv, n_rows = p.n_q * p.n_head;
    const uint32_t tok = rr / G, h = gk * G + rr % G, row = tok * p.n_head + h;
    if (p.n_split == 1) {
        const float inv = L > 0.0f ? 1.0f / L : 0.0f;
        float *out = p.out + (size_t)row * HD;
#pragma unroll
        for (int dt = 0; dt < HD / 8; dt++) {
            out[dt * 8 + 2 * t] = o(dt, 0) * inv;
            out[dt * 8 + 2 * t + 1] = o(dt, 1) * inv;
        }
        if (p.lse && t == 0)
            p.lse[row] = L > 0.0f ? (M + log2f(L)) * LN2 : -INFINITY;
    } else {
        float *po = p.part + ((size_t)split * n_rows + row) * (HD + 2);
#pragma unroll
        for (int dt = 0; dt < HD / 8; dt++) {
            po[dt * 8 + 2 * t] = o(dt, 0);
            po[dt * 8 + 2 * t + 1] = o(dt, 1);
        }
        if (t == 0) {
            po[HD] = M;
            po[HD + 1] = L;
        }
    }
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
template <int HD, class L = pad_layout<HD>, int W0 = 0>
__device__ __forceinline__ int fill_packed(const tkv_cuda_attn_params &p, pk_cursor &c, int32_t pos_max,
                                          __half *Ks, __half *Vs, int *kpos, const uint16_t **rp)
{
    constexpr int PER_ROW = HD / 8, UNITS = 16 * PER_ROW / 32;
    constexpr unsigned FULL = 0xffffffffu;
    const int lane = threadIdx.x & 31, warp = (int)(threadIdx.x >> 5) - W0;
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
        tkv_cp_async16(Ks + L::at(row, col), ok ? ks + col * 8 : ks, ok);
        tkv_cp_async16(Vs + L::at(row, col), ok ? vs + col * 8 : vs, ok);
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

/* The split's share of KV head g's refs: [nbh * split / n_split, nbh *
 * (split + 1) / n_split) of its nbh. */
__device__ __forceinline__ void kv_start(const tkv_cuda_attn_params &p, uint32_t g, uint32_t split, kv_cursor &c)
{
    const uint32_t hb = p.head_off[g], nbh = tkv_cuda_head_end(p, g) - hb;
    c.b = hb + (uint32_t)((uint64_t)nbh * split / p.n_split);
    c.b_end = hb + (uint32_t)((uint64_t)nbh * (split + 1) / p.n_split);
    c.off = 0;
}

/* The split's start in the walk the kernel takes (PACK: packed tiles) */
template <bool PACK>
__device__ __forceinline__ void walk_start(const tkv_cuda_attn_params &p, uint32_t g, uint32_t split, pk_cursor &pc,
                                           kv_cursor &kc)
{
    if (PACK)
        pk_start(p, g, split, pc);
    else
        kv_start(p, g, split, kc);
}

/* Gathers up to BN keys at the cursor into one stage (cp.async, every thread
 * walking the same cursor), zeroes the rows after them, and advances the
 * cursor; returns the number of keys. */
template <int HD, class L = pad_layout<HD>, int W0 = 0>
__device__ int fill_tile(const tkv_cuda_attn_params &p, kv_cursor &c, int32_t pos_max, __half *Ks, __half *Vs,
                         int *kpos)
{
    constexpr int PER_ROW = HD / 8;
    const int tid = (int)threadIdx.x - 32 * W0;
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
                cp_async16(Ks + L::at(nk + row, col), ks + u);
                cp_async16(Vs + L::at(nk + row, col), vs + u);
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
        *(uint4 *)(Ks + L::at(row, col)) = make_uint4(0, 0, 0, 0);
        *(uint4 *)(Vs + L::at(row, col)) = make_uint4(0, 0, 0, 0);
    }
    for (int j = nk + tid; j < BN; j += NT)
        kpos[j] = INT_MAX;
    return nk;
}

} // namespace tkv_pf

#endif
