/*
 * gemv-bulk.cu -- see gemv-bulk.cuh.
 *
 * Per CTA: thread 0 is the producer (it also computes): it arms stage s's
 * "full" barrier with the stage's byte count and issues the stage's bulk
 * copies (one per contiguous source range: a stage crosses at most a
 * matrix boundary or the gate/up boundary); it refills slot s % NS with
 * stage s + NS once every warp has arrived on that slot's "empty" barrier.
 * The 8 warps wait on "full" (parity = which use of the slot), take their
 * pieces, and arrive on "empty". Phases: use u of a slot completes phase u,
 * whose parity is u & 1.
 */
#include "gemv-bulk.cuh"
#include "common.cuh"

namespace {

constexpr int NW = 8;                   /* warps per CTA                          */
constexpr int NTH = NW * 32;            /* threads per CTA                        */
constexpr uint32_t SB = 16384;          /* bytes per stage                        */
constexpr int NS = 4;                   /* stages (all in flight at the start)    */
constexpr uint32_t PIECE = 512;         /* a warp's share of a stage at a time    */
constexpr uint32_t RMAX = 128;          /* local rows per CTA (partials in smem)  */

struct bulk_params {
    const __half *w[TKV_CUDA_GEMV_GROUP_MAX];
    float *y[TKV_CUDA_GEMV_GROUP_MAX];
    uint32_t end[TKV_CUDA_GEMV_GROUP_MAX];
    uint32_t nw;
    const float *x;
    float *out;      /* SwiGLU's output, or NULL */
    uint32_t n_in;
    uint32_t rows;   /* rows split over the CTAs: the group's total, or SwiGLU's n_out */
    uint32_t n_cta;
};

__device__ __forceinline__ uint32_t smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(uint64_t *bar, uint32_t count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t *bar)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t *bar, uint32_t bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t *bar, uint32_t parity)
{
    uint32_t done = 0;
    while (!done)
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     " selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(smem_u32(bar)), "r"(parity)
                     : "memory");
}

/* bytes (a multiple of 16, both addresses 16-byte aligned) from global to
 * shared memory, counted on bar when they land */
__device__ __forceinline__ void bulk_copy(void *dst, const void *src, uint32_t bytes, uint64_t *bar)
{
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                     smem_u32(dst)),
                 "l"(src), "r"(bytes), "r"(smem_u32(bar))
                 : "memory");
}

/* Local row lr of the CTA whose rows are [r0, r0 + nr): its first byte, and
 * how many local rows from lr on follow it contiguously in memory. */
__device__ __forceinline__ const char *row_src(const bulk_params &p, uint32_t r0, uint32_t nr, uint32_t lr,
                                               uint32_t *run)
{
    if (p.out) { /* SwiGLU: gate rows, then up rows */
        const uint32_t m = lr >= nr ? 1u : 0u;
        *run = (m + 1) * nr - lr;
        return (const char *)(p.w[m] + (size_t)(r0 + lr - m * nr) * p.n_in);
    }
    const uint32_t v = r0 + lr;
    uint32_t m = 0, start = 0;
    while (v >= p.end[m])
        start = p.end[m++];
    *run = min(p.end[m], r0 + nr) - v;
    return (const char *)(p.w[m] + (size_t)(v - start) * p.n_in);
}

/* Thread 0: stage s (local bytes [s SB, ...)) into dst, counted on full. */
__device__ void issue_stage(const bulk_params &p, uint32_t r0, uint32_t nr, uint32_t total, uint32_t s, char *dst,
                            uint64_t *full)
{
    const uint32_t b0 = s * SB, b1 = min(b0 + SB, total), rb = 2 * p.n_in;
    mbar_arrive_expect_tx(full, b1 - b0);
    for (uint32_t b = b0; b < b1;) {
        const uint32_t lr = b / rb;
        uint32_t run;
        const char *src = row_src(p, r0, nr, lr, &run) + (b - lr * rb);
        const uint32_t e = min(b1, (lr + run) * rb);
        bulk_copy(dst + (b - b0), src, e - b, full);
        b = e;
    }
}

template <int NT>
__global__ void __launch_bounds__(NTH) gemv_bulk_kernel(const bulk_params p)
{
    extern __shared__ __align__(128) unsigned char smem[];
    char *stage = (char *)smem;
    float *part = (float *)(smem + NS * SB);          /* [RMAX][NW][NT] */
    uint64_t *full = (uint64_t *)(part + RMAX * NW * NT), *empty = full + NS;

    const uint32_t tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const uint32_t c = blockIdx.x;
    const uint32_t r0 = (uint32_t)((uint64_t)p.rows * c / p.n_cta);
    const uint32_t nr = (uint32_t)((uint64_t)p.rows * (c + 1) / p.n_cta) - r0;
    const uint32_t L = p.out ? 2 * nr : nr, rb = 2 * p.n_in, total = L * rb;
    const uint32_t ns = (total + SB - 1) / SB;

    tkv_pdl_trigger();
    if (tid == 0) {
        for (int i = 0; i < NS; i++) {
            mbar_init(&full[i], 1);
            mbar_init(&empty[i], NW);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        for (uint32_t s = 0; s < ns && s < (uint32_t)NS; s++) /* weights: no earlier op writes them */
            issue_stage(p, r0, nr, total, s, stage + s * SB, &full[s]);
    }
    for (uint32_t i = tid; i < L * NW * NT; i += NTH)
        part[i] = 0.0f;
    __syncthreads();
    tkv_pdl_wait(); /* x is the previous kernel's output; y may be read by it */

    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; t++)
        acc[t] = 0.0f;
    uint32_t cur = UINT32_MAX; /* the local row acc holds */
    for (uint32_t s = 0; s < ns; s++) {
        const uint32_t slot = s % NS, par = (s / NS) & 1u;
        mbar_wait(&full[slot], par);
        const char *st = stage + slot * SB;
        const uint32_t b0 = s * SB, nb = min(SB, total - b0);
        for (uint32_t q = warp; q * PIECE < nb; q += NW) {
            const uint32_t b = b0 + q * PIECE, lr = b / rb;
            if (lr != cur) { /* warp-uniform */
                if (cur != UINT32_MAX) {
#pragma unroll
                    for (int t = 0; t < NT; t++) {
                        const float v = tkv_warp_sum(acc[t]);
                        if (lane == 0)
                            part[(cur * NW + warp) * NT + t] = v;
                        acc[t] = 0.0f;
                    }
                }
                cur = lr;
            }
            const uint32_t k = (b - lr * rb) / 16 + lane; /* 8-element index in the row */
            const uint4 raw = *(const uint4 *)(st + q * PIECE + lane * 16);
            const __half2 *h2 = (const __half2 *)&raw;
            float wf[8];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const float2 f = __half22float2(h2[j]);
                wf[2 * j] = f.x;
                wf[2 * j + 1] = f.y;
            }
#pragma unroll
            for (int t = 0; t < NT; t++) {
                const float4 *xr = (const float4 *)(p.x + (size_t)t * p.n_in) + 2 * k;
                const float4 a = __ldg(xr), bb = __ldg(xr + 1);
                acc[t] += wf[0] * a.x + wf[1] * a.y + wf[2] * a.z + wf[3] * a.w + wf[4] * bb.x + wf[5] * bb.y +
                          wf[6] * bb.z + wf[7] * bb.w;
            }
        }
        __syncwarp();
        if (lane == 0)
            mbar_arrive(&empty[slot]);
        if (tid == 0 && s + NS < ns) { /* every warp is done with the slot: refill it */
            mbar_wait(&empty[slot], par);
            issue_stage(p, r0, nr, total, s + NS, stage + slot * SB, &full[slot]);
        }
    }
    if (cur != UINT32_MAX) {
#pragma unroll
        for (int t = 0; t < NT; t++) {
            const float v = tkv_warp_sum(acc[t]);
            if (lane == 0)
                part[(cur * NW + warp) * NT + t] = v;
        }
    }
    __syncthreads();

    /* the rows' sums, warps in order */
    for (uint32_t i = tid; i < nr * NT; i += NTH) {
        const uint32_t lr = i / NT, t = i % NT;
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < NW; w++)
            v += part[(lr * NW + w) * NT + t];
        if (p.out) {
            float u = 0.0f;
#pragma unroll
            for (int w = 0; w < NW; w++)
                u += part[((lr + nr) * NW + w) * NT + t];
            p.out[(size_t)t * p.rows + r0 + lr] = v / (1.0f + expf(-v)) * u; /* swiglu_kernel's formula */
        } else {
            const uint32_t row = r0 + lr;
            uint32_t m = 0, start = 0;
            while (row >= p.end[m])
                start = p.end[m++];
            p.y[m][(size_t)t * (p.end[m] - start) + (row - start)] = v;
        }
    }
}

constexpr size_t smem_bytes(int nt) { return (size_t)NS * SB + (size_t)RMAX * NW * nt * 4 + 2 * NS * 8; }

template <int NT> cudaError_t bulk_launch(bulk_params &p, uint32_t n_sm, bool pdl, cudaStream_t s)
{
    /* once per instantiation (per process): the dynamic shared memory
     * ceiling, and how many CTAs an SM holds */
    static int per_sm = 0;
    if (per_sm == 0) {
        cudaError_t e = cudaFuncSetAttribute(gemv_bulk_kernel<NT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             (int)smem_bytes(NT));
        int k = 0;
        if (e == cudaSuccess)
            e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&k, gemv_bulk_kernel<NT>, NTH, smem_bytes(NT));
        if (e != cudaSuccess)
            return e;
        if (k < 1)
            return cudaErrorInvalidConfiguration;
        per_sm = k;
    }
    /* one wave, unless a CTA's rows would not fit its partials */
    const uint32_t rmax = p.out ? RMAX / 2 : RMAX;
    uint32_t n_cta = n_sm * (uint32_t)per_sm;
    n_cta = max(n_cta, (p.rows + rmax - 1) / rmax);
    p.n_cta = min(n_cta, p.rows);
    return tkv_cuda_launch(pdl, dim3(p.n_cta), dim3(NTH), smem_bytes(NT), s, gemv_bulk_kernel<NT>, p);
}

} // namespace

bool tkv_cuda_gemv_bulk_ok(const __half *w, const float *x, uint32_t n_in, uint32_t n)
{
    return w && x && n >= 1 && n <= TKV_CUDA_GEMV_MAX_N && n_in > 0 && n_in % 256 == 0 && n_in <= (1u << 20) &&
           (uintptr_t)w % 16 == 0 && (uintptr_t)x % 16 == 0;
}

cudaError_t tkv_cuda_gemv_bulk(const struct tkv_cuda_gemv_group *g, const float *x, uint32_t n_in, uint32_t n,
                               float *swiglu_out, uint32_t n_sm, bool pdl, cudaStream_t s)
{
    if (!g || g->nw == 0 || g->nw > TKV_CUDA_GEMV_GROUP_MAX || (swiglu_out && g->nw != 2) || n_sm == 0)
        return cudaErrorInvalidValue;
    for (uint32_t i = 0; i < g->nw; i++)
        if (!tkv_cuda_gemv_bulk_ok(g->w[i], x, n_in, n) || (i > 0 && g->end[i] < g->end[i - 1]))
            return cudaErrorInvalidValue;
    bulk_params p;
    memset(&p, 0, sizeof p);
    for (uint32_t i = 0; i < g->nw; i++) {
        p.w[i] = g->w[i];
        p.y[i] = g->y[i];
        p.end[i] = g->end[i];
    }
    p.nw = g->nw;
    p.x = x;
    p.out = swiglu_out;
    p.n_in = n_in;
    p.rows = swiglu_out ? g->end[0] : g->end[g->nw - 1];
    if (swiglu_out && g->end[1] != 2 * g->end[0])
        return cudaErrorInvalidValue; /* gate and up of one shape */
    if (p.rows == 0)
        return cudaSuccess;
    switch (n) {
    case 1: return bulk_launch<1>(p, n_sm, pdl, s);
    case 2: return bulk_launch<2>(p, n_sm, pdl, s);
    case 3: return bulk_launch<3>(p, n_sm, pdl, s);
    case 4: return bulk_launch<4>(p, n_sm, pdl, s);
    case 5: return bulk_launch<5>(p, n_sm, pdl, s);
    case 6: return bulk_launch<6>(p, n_sm, pdl, s);
    case 7: return bulk_launch<7>(p, n_sm, pdl, s);
    case 8: return bulk_launch<8>(p, n_sm, pdl, s);
    default: return cudaErrorInvalidValue;
    }
}
