/*
 * kv-table.cu -- the page-table stores and the decode attention table
 * (kv-table.cuh; contract in backend.h).
 */
#include "kv-table.cuh"

#include <cub/block/block_scan.cuh>

/* a CTA per round of KVT_THREADS blocks of a head: 4 rounds for 128K keys
 * in blocks of 64 (one CTA per head walking its rounds in turn took 13 us of
 * a decode layer at 128K on the H200, session 18; 256 threads a round took
 * 33-43 us in session 15; 1024 spill at 64 registers) */
#define KVT_THREADS 512

__global__ void table_write_kernel(uint64_t *table, const uint32_t *idx, const uint64_t *val, uint32_t n)
{
    const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n)
        table[idx[i]] = val[i];
}

cudaError_t tkv_cuda_table_write(uint64_t *table, const uint32_t *idx, const uint64_t *val, uint32_t n,
                                 cudaStream_t s)
{
    if (n == 0)
        return cudaSuccess;
    table_write_kernel<<<tkv_cuda_blocks(n, 256), 256, 0, s>>>(table, idx, val, n);
    TKV_CUDA_LAUNCHED();
    return cudaSuccess;
}

/* The positions [p, p + 32) head h reads, bit j for position p + j: the
 * bitmap's bits below sel_n, every position of the tail [sel_n, n_past),
 * nothing at or past n_past. */
__device__ static uint32_t read_bits(const uint32_t *row, uint32_t words, uint32_t sel_n, uint32_t n_past,
                                     uint32_t p)
{
    uint32_t x = 0;
    if (p < sel_n) {
        const uint32_t w = p / 32, sh = p % 32;
        x = row[w] >> sh;
        if (sh && w + 1 < words)
            x |= row[w + 1] << (32 - sh);
        if (sel_n - p < 32)
            x &= (1u << (sel_n - p)) - 1;
    }
    const uint32_t t0 = max(p, sel_n);
    const uint32_t t1 = n_past - p < 32 ? n_past : p + 32;
    if (t0 < t1) { /* bits [t0 - p, t1 - p) */
        const uint32_t lo = t0 - p, len = t1 - t0;
        x |= (len >= 32 ? ~0u : ((1u << len) - 1)) << lo;
    }
    if (n_past - p < 32)
        x &= (1u << (n_past - p)) - 1;
    return x;
}

/* Walks the slices of block [lo, hi) of one head: emit(start, end) for each
 * maximal run of read positions, in order, 32 positions at a time. */
template <typename Emit>
__device__ static void walk_block(const struct tkv_kv_table_args &p, const uint32_t *row, uint32_t sel_n,
                                  uint32_t lo, uint32_t hi, Emit emit)
{
    bool open = false;
    uint32_t start = 0;
    for (uint32_t c = lo; c < hi; c += 32) {
        const uint32_t len = hi - c < 32 ? hi - c : 32;
        const uint32_t valid = len == 32 ? ~0u : (1u << len) - 1;
        const uint32_t x = read_bits(row, p.words, sel_n, p.n_past, c) & valid;
        uint32_t j = 0;
        while (j < len) {
            const uint32_t from = ~0u << j; /* j < 32 */
            if (open) {
                const uint32_t z = ~x & valid & from;
                if (!z)
                    break; /* the run goes on into the next word */
                const uint32_t e = (uint32_t)__ffs(z) - 1;
                emit(start, c + e);
                open = false;
                j = e;
            } else {
                const uint32_t o = x & from;
                if (!o)
                    break;
                const uint32_t b = (uint32_t)__ffs(o) - 1;
                start = c + b;
                open = true;
                j = b;
            }
        }
    }
    if (open)
        emit(start, hi);
}

/* the sel_n of a launch's heads */
struct kvt_sel_n {
    uint32_t n[TKV_CUDA_KVT_GROUP];
};

/* the sync slots of a launch: head h's round r at h * rounds + r */
struct kvt_slots {
    uint32_t *flag;
    uint4 *tot;
    uint32_t rounds, seq;
};

static __device__ __forceinline__ uint32_t load_acquire(const uint32_t *p)
{
    uint32_t v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
static __device__ __forceinline__ void store_release(uint32_t *p, uint32_t v)
{
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

/* grid (rounds, heads): CTA (r, h) walks head h's blocks [r, r + 1)
 * KVT_THREADS. CTAs start in block order, so the rounds a CTA waits for
 * have started and wait for none after them: the grid always progresses,
 * in one wave or several (and the attention after it launches only once
 * every CTA of this grid has started: the trigger comes first). */
__global__ void __launch_bounds__(KVT_THREADS)
    kv_table_kernel(struct tkv_kv_table_args p, const __grid_constant__ struct kvt_sel_n sel, struct kvt_slots sy)
{
    tkv_pdl_wait(); /* the bitmap, the page table: earlier ops' */
    tkv_pdl_trigger();
    typedef cub::BlockScan<unsigned long long, KVT_THREADS> Scan;
    __shared__ typename Scan::TempStorage scan_tmp;
    __shared__ uint32_t positions, touched; /* read, in this round */
    __shared__ uint4 before;                /* the earlier rounds' totals */
    if (threadIdx.x == 0)
        positions = touched = 0;
    __syncthreads(); /* before any thread adds to them */
    const uint32_t r = blockIdx.x, h = blockIdx.y, B = p.block_tokens;
    const uint32_t sel_n = sel.n[h];
    const uint32_t *row = p.bitmap ? p.bitmap + (size_t)h * p.words : NULL;
    const uint64_t *pt = p.ptab + (size_t)h * p.ptab_stride;
    struct tkv_kv_block_ref *refs = p.refs ? p.refs + (size_t)h * p.cap : NULL;
    struct tkv_kv_block_ref *miss = p.miss ? p.miss + (size_t)h * p.cap : NULL;
    const uint32_t nb = (uint32_t)(((uint64_t)p.n_past + B - 1) / B);
    const uint32_t b = r * KVT_THREADS + threadIdx.x;
    const uint32_t lo = b * B, hi = b < nb ? min(lo + B, p.n_past) : lo;
    const uint64_t e = b < nb ? pt[b] : 0;
    uint32_t cnt = 0, len = 0;
    if (b < nb)
        walk_block(p, row, sel_n, lo, hi, [&](uint32_t s0, uint32_t s1) { cnt++, len += s1 - s0; });
    if (cnt) {
        atomicAdd(&positions, len);
        atomicAdd(&touched, 1u);
    }
    /* the read marks: a warp's 32 blocks are one word (KVT_THREADS is a
     * multiple of 32, so a round's words are whole) */
    const uint32_t touched_bits = __ballot_sync(0xffffffffu, cnt != 0);
    if (p.marks && (threadIdx.x & 31) == 0 && b / 32 < (nb + 31) / 32)
        p.marks[(size_t)h * p.mark_words + b / 32] = touched_bits;
    /* resident slices counted in the high word, missing ones in the low */
    unsigned long long off, total;
    Scan(scan_tmp).ExclusiveSum(e ? (unsigned long long)cnt << 32 : (unsigned long long)cnt, off, total);
    __syncthreads(); /* positions, touched complete */
    const size_t slot = (size_t)h * sy.rounds + r;
    if (threadIdx.x == 0) { /* this round's totals, then its flag */
        sy.tot[slot] = make_uint4((uint32_t)(total >> 32), (uint32_t)total, positions, touched);
        store_release(&sy.flag[slot], sy.seq);
    }
    if (threadIdx.x < 32) { /* the earlier rounds' totals, a lane per round */
        uint4 t = make_uint4(0, 0, 0, 0);
        for (uint32_t q = threadIdx.x; q < r; q += 32) {
            const size_t sq = (size_t)h * sy.rounds + q;
            while (load_acquire(&sy.flag[sq]) != sy.seq)
                __nanosleep(64);
            const uint4 x = __ldcg(&sy.tot[sq]);
            t.x += x.x, t.y += x.y, t.z += x.z, t.w += x.w;
        }
        t.x = __reduce_add_sync(0xffffffffu, t.x), t.y = __reduce_add_sync(0xffffffffu, t.y);
        t.z = __reduce_add_sync(0xffffffffu, t.z), t.w = __reduce_add_sync(0xffffffffu, t.w);
        if (threadIdx.x == 0)
            before = t;
    }
    __syncthreads();
    const uint4 bf = before;
    uint32_t at = e ? bf.x + (uint32_t)(off >> 32) : bf.y + (uint32_t)off;
    if (cnt)
        walk_block(p, row, sel_n, lo, hi, [&](uint32_t s0, uint32_t s1) {
            if (at < p.cap) {
                struct tkv_kv_block_ref rf;
                rf.pos0 = (int32_t)s0;
                rf.n = s1 - s0;
                if (e) {
                    const uint64_t k = e + (uint64_t)(s0 - lo) * p.head_dim * sizeof(uint16_t);
                    rf.k = (uint16_t *)(uintptr_t)k;
                    rf.v = (uint16_t *)(uintptr_t)(k + (uint64_t)B * p.head_dim * sizeof(uint16_t));
                    refs[at] = rf;
                } else {
                    rf.k = rf.v = NULL;
                    miss[at] = rf;
                }
            }
            at++;
        });
    if (r == gridDim.x - 1 && threadIdx.x == 0) { /* the last round: the head's counts */
        p.counts[4 * h] = bf.x + (uint32_t)(total >> 32);
        p.counts[4 * h + 1] = bf.y + (uint32_t)total;
        p.counts[4 * h + 2] = bf.z + positions;
        p.counts[4 * h + 3] = bf.w + touched;
    }
}

static uint32_t kvt_rounds(const struct tkv_kv_table_args *a)
{
    const uint64_t nb = ((uint64_t)a->n_past + a->block_tokens - 1) / a->block_tokens;
    return nb > KVT_THREADS ? (uint32_t)((nb + KVT_THREADS - 1) / KVT_THREADS) : 1;
}

cudaError_t tkv_cuda_kvt_sync_reserve(struct tkv_cuda_kvt_sync *sy, const struct tkv_kv_table_args *a, cudaStream_t s)
{
    const uint64_t need = (uint64_t)(a->n_heads < TKV_CUDA_KVT_GROUP ? a->n_heads : TKV_CUDA_KVT_GROUP) * kvt_rounds(a);
    if (need <= sy->cap)
        return cudaSuccess;
    if (need > UINT32_MAX / 2)
        return cudaErrorInvalidValue;
    const uint32_t cap = (uint32_t)(need > 2ull * sy->cap ? need : 2ull * sy->cap);
    TKV_CUDA_TRY(cudaStreamSynchronize(s)); /* the old slots' last kernels are done */
    tkv_cuda_kvt_sync_free(sy);
    TKV_CUDA_TRY(cudaMalloc((void **)&sy->flag, (size_t)cap * sizeof *sy->flag));
    TKV_CUDA_TRY(cudaMalloc((void **)&sy->tot, (size_t)cap * sizeof *sy->tot));
    TKV_CUDA_TRY(cudaMemsetAsync(sy->flag, 0, (size_t)cap * sizeof *sy->flag, s)); /* below every seq */
    sy->cap = cap;
    return cudaSuccess;
}

void tkv_cuda_kvt_sync_free(struct tkv_cuda_kvt_sync *sy)
{
    cudaFree(sy->flag);
    cudaFree(sy->tot);
    sy->flag = NULL, sy->tot = NULL, sy->cap = 0; /* (seq kept: it only grows) */
}

cudaError_t tkv_cuda_kv_table(const struct tkv_kv_table_args *a, struct tkv_cuda_kvt_sync *sy, bool pdl, cudaStream_t s)
{
    const uint32_t rounds = kvt_rounds(a);
    for (uint32_t h0 = 0; h0 < a->n_heads; h0 += TKV_CUDA_KVT_GROUP) { /* the group's rows of every array */
        struct tkv_kv_table_args g = *a;
        g.n_heads = a->n_heads - h0 < TKV_CUDA_KVT_GROUP ? a->n_heads - h0 : TKV_CUDA_KVT_GROUP;
        if ((uint64_t)g.n_heads * rounds > sy->cap)
            return cudaErrorInvalidValue; /* not reserved */
        g.sel_n = NULL;
        if (g.bitmap)
            g.bitmap += (size_t)h0 * a->words;
        g.ptab += (size_t)h0 * a->ptab_stride;
        if (g.refs)
            g.refs += (size_t)h0 * a->cap;
        if (g.miss)
            g.miss += (size_t)h0 * a->cap;
        g.counts += (size_t)h0 * 4;
        if (g.marks)
            g.marks += (size_t)h0 * a->mark_words;
        struct kvt_sel_n sel;
        memset(&sel, 0, sizeof sel);
        memcpy(sel.n, a->sel_n + h0, g.n_heads * sizeof *sel.n);
        const struct kvt_slots sl = {sy->flag, sy->tot, rounds, ++sy->seq ? sy->seq : ++sy->seq}; /* (0: unset) */
        TKV_CUDA_TRY(tkv_cuda_launch(pdl, dim3(rounds, g.n_heads), KVT_THREADS, 0, s, kv_table_kernel, g, sel, sl));
    }
    return cudaSuccess;
}
