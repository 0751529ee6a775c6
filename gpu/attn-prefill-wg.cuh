/*
 * attn-prefill-wg.cuh -- the warpgroup-MMA (wgmma) pieces that the Hopper
 * prefill kernels share (internal to gpu/attn-prefill-wg.cu, v2, and
 * gpu/attn-prefill-ws.cu, v3; both built for sm_90a only): PTX wrappers for
 * wgmma, shared-memory descriptors, proxy fences, mbarriers and named
 * barriers, and the steps of one 64-key tile for one warpgroup of 64 query rows -- issue S =
 * Q K^T, the online softmax of S into P, the rescale of O, issue O += P V,
 * store the rows. Layouts and descriptors are described in
 * attn-prefill-wg.cu.
 */
#ifndef TKV_GPU_ATTN_PREFILL_WG_CUH
#define TKV_GPU_ATTN_PREFILL_WG_CUH

#include "attn-prefill.cuh"
#include "attn-prefill-walk.cuh"

namespace tkv_wg {

using namespace tkv_pf;

/* Everything below is device code of sm_90a's pass only (the kernels'
 * bodies are under the same condition). */
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

/* the Q tile's layout: BM rows of the 128-byte swizzle (sw128_layout's, BM rows per region) */
template <int BM> struct q_sw128 {
    static __device__ __forceinline__ int at(int r, int d)
    {
        const int u = d >> 3;
        return (u >> 3) * BM * 64 + r * 64 + (((u & 7) ^ (r & 7)) << 3) + (d & 7);
    }
};

__device__ __forceinline__ float ex2w(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

/* A shared-memory matrix descriptor, 128-byte swizzle (addresses and
 * offsets in bytes, 16-byte units in the descriptor). */
__device__ __forceinline__ uint64_t desc_sw128(uint32_t addr, uint32_t lbo, uint32_t sbo)
{
    return (uint64_t)((addr & 0x3FFFFu) >> 4) | (uint64_t)((lbo & 0x3FFFFu) >> 4) << 16 |
           (uint64_t)((sbo & 0x3FFFFu) >> 4) << 32 | 1ull << 62;
}

__device__ __forceinline__ void wg_fence(void) { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit(void) { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait(void)
{
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
/* x through a register move the compiler cannot see into: the P registers
 * of the next P V get their own registers, not the ones the P V in flight
 * reads (else ptxas serializes the wgmma, C7513) */
__device__ __forceinline__ uint32_t opaque(uint32_t x)
{
    uint32_t y;
    asm volatile("mov.b32 %0, %1;\n" : "=r"(y) : "r"(x));
    return y;
}

/* this thread's generic-proxy shared-memory writes (st.shared, landed
 * cp.async copies), made visible to the async proxy that wgmma reads through */
__device__ __forceinline__ void fence_proxy_async(void)
{
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

/* d (+)= A B, m64n64k16: A (64 x 16, K-major) and B (16 x 64, K-major)
 * from shared memory by descriptor; acc 0: d = A B */
__device__ __forceinline__ void wgmma_ss_n64(float d[32], uint64_t da, uint64_t db, int acc)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
                 "%32, %33, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "l"(da), "l"(db), "r"(acc));
}

/* d += A B, m64n64k16: A (64 x 16) from registers (per warp, the mma.sync
 * m16n8k16 A fragment), B (16 x 64, N-major) from shared memory by descriptor */
__device__ __forceinline__ void wgmma_rs_n64(float d[32], const uint32_t a[4], uint64_t db)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
                 "{%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

/* d += A B, m64n128k16: A (64 x 16) from registers (per warp, the mma.sync
 * m16n8k16 A fragment), B (16 x 128, N-major) from shared memory by descriptor */
__device__ __forceinline__ void wgmma_rs_n128(float d[64], const uint32_t a[4], uint64_t db)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
                 "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
                   "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
                   "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
                   "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

/* O += P V over one 16-key step, N = HD */
template <int HD> __device__ __forceinline__ void wg_pv(float (&o)[HD / 2], const uint32_t a[4], uint64_t db)
{
    if constexpr (HD == 128)
        wgmma_rs_n128(o, a, db);
    else
        wgmma_rs_n64(o, a, db);
}

/* Issues O += P V for one 64-key tile as one wgmma group (not waited for):
 * P's A fragments from ph (and pq, the low parts, when SPLIT): ph[nt] holds
 * n-tile nt's rows g and g + 8, so 16-key step kq's A is ph[2kq][0],
 * ph[2kq][1], ph[2kq+1][0], ph[2kq+1][1]; V from the stage at shared address
 * v (keys 16 kq .. 16 kq + 15 start 2048 kq bytes in; N-major, the two
 * 64-column halves of head_dim 128 BN * 128 bytes apart). */
template <int HD, bool SPLIT>
__device__ __forceinline__ void issue_pv(float (&o)[HD / 2], const uint32_t (&ph)[BN / 8][2],
                                         const uint32_t (&pq)[SPLIT ? BN / 8 : 1][2], uint32_t v)
{
#pragma unroll
    for (int kq = 0; kq < BN / 16; kq++) {
        const uint64_t db = desc_sw128(v + kq * 2048, BN * 128, 1024);
        const uint32_t a[4] = {ph[2 * kq][0], ph[2 * kq][1], ph[2 * kq + 1][0], ph[2 * kq + 1][1]};
        wg_pv<HD>(o, a, db);
        if (SPLIT) {
            const uint32_t al[4] = {pq[SPLIT ? 2 * kq : 0][0], pq[SPLIT ? 2 * kq : 0][1],
                                    pq[SPLIT ? 2 * kq + 1 : 0][0], pq[SPLIT ? 2 * kq + 1 : 0][1]};
            wg_pv<HD>(o, al, db);
        }
    }
    wg_commit();
}


/* An mbarrier in shared memory (PTX ISA, "Parallel Synchronization and
 * Communication Instructions: mbarrier"): init by one thread before a CTA
 * barrier; arrive has release semantics, the wait acquire (CTA scope). */
__device__ __forceinline__ void mbar_init(uint64_t *bar, uint32_t count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t *bar)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
/* Waits until the phase of parity `parity` has completed. */
__device__ __forceinline__ void mbar_wait(uint64_t *bar, uint32_t parity)
{
    asm volatile("{\n.reg .pred done;\nwait_%=:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra wait_%=;\n}\n" ::"r"(smem_u32(bar)),
                 "r"(parity)
                 : "memory");
}
/* Named barriers 1..15 (0 is __syncthreads'): sync waits for `n` threads'
 * arrivals including its own; arrive only counts this thread's */
__device__ __forceinline__ void named_sync(int id, int n) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void named_arrive(int id, int n)
{
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}

/* ---- one 64-key tile of one warpgroup (64 query rows; this warp's rows g
 * and g + 8 of its 16) ------------------------------------------------------ */

/* Issues S = Q K^T (unscaled) as one wgmma group, not waited for: Q from the
 * warpgroup's rows at shared address qh (ql: the low parts, SPLIT), K from a
 * stage at ks; the Q tile has BM rows per 64-column region, so k-step kk is
 * 32 bytes into region kk / 4 of each. s[4 nt + e]: rows g (e < 2) and
 * g + 8, keys 8 nt + 2 t + (e & 1). */
template <int HD, bool SPLIT, int BM>
__device__ __forceinline__ void issue_s(float (&s)[BN / 2], uint32_t qh, uint32_t ql, uint32_t ks)
{
#pragma unroll
    for (int i = 0; i < BN / 2; i++)
        s[i] = 0.0f;
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++) {
        const uint32_t ko = (kk >> 2) * (uint32_t)(BN * 128) + (kk & 3) * 32;
        const uint32_t qo = (kk >> 2) * (uint32_t)(BM * 128) + (kk & 3) * 32;
        const uint64_t db = desc_sw128(ks + ko, 16, 1024);
        wgmma_ss_n64(s, desc_sw128(qh + qo, 16, 1024), db, kk > 0);
        if (SPLIT)
            wgmma_ss_n64(s, desc_sw128(ql + qo, 16, 1024), db, 1);
    }
    wg_commit();
}

/* The online softmax of a landed S (log2 units, scale sc): masks the keys
 * past each row's position when `masked` (kpos: the tile's key positions,
 * INT_MAX past its keys), moves the row maxima m0, m1 and the sums l0, l1
 * (this thread's share; the row's 4 threads add up at the end), writes P as
 * f16 (nh; nq the low parts when SPLIT) in the A-fragment layout, and
 * returns the factors c0, c1 by which O must be rescaled. */
template <bool SPLIT>
__device__ __forceinline__ void softmax_tile(float (&s)[BN / 2], const int *kpos, bool masked, int32_t qp0,
                                             int32_t qp1, float sc, float &m0, float &m1, float &l0, float &l1,
                                             uint32_t (&nh)[BN / 8][2], uint32_t (&nq)[SPLIT ? BN / 8 : 1][2],
                                             float &c0, float &c1)
{
    constexpr int NNT = BN / 8;
    const int t = threadIdx.x & 3;
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < NNT; nt++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            if (masked) {
                const int kp = kpos[nt * 8 + 2 * t + e];
                if (kp > qp0)
                    s[4 * nt + e] = -INFINITY;
                if (kp > qp1)
                    s[4 * nt + 2 + e] = -INFINITY;
            }
            mx0 = fmaxf(mx0, s[4 * nt + e]);
            mx1 = fmaxf(mx1, s[4 * nt + 2 + e]);
        }
#pragma unroll
    for (int off = 1; off <= 2; off <<= 1) {
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
    }
    const float mn0 = fmaxf(m0, mx0 * sc), mn1 = fmaxf(m1, mx1 * sc);
    const float mu0 = mn0 == -INFINITY ? 0.0f : mn0, mu1 = mn1 == -INFINITY ? 0.0f : mn1;
    c0 = ex2w(m0 - mu0); /* 0 when m was -inf */
    c1 = ex2w(m1 - mu1);
    m0 = mn0;
    m1 = mn1;
    float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
    for (int nt = 0; nt < NNT; nt++) {
        float *x = s + 4 * nt;
        x[0] = ex2w(fmaf(x[0], sc, -mu0)); /* -inf (masked) -> 0 */
        x[1] = ex2w(fmaf(x[1], sc, -mu0));
        x[2] = ex2w(fmaf(x[2], sc, -mu1));
        x[3] = ex2w(fmaf(x[3], sc, -mu1));
        sum0 += x[0] + x[1];
        sum1 += x[2] + x[3];
        if (SPLIT) {
            split_h2(x[0], x[1], nh[nt][0], nq[SPLIT ? nt : 0][0]);
            split_h2(x[2], x[3], nh[nt][1], nq[SPLIT ? nt : 0][1]);
        } else {
            nh[nt][0] = pack_h2(x[0], x[1]);
            nh[nt][1] = pack_h2(x[2], x[3]);
        }
    }
    l0 = l0 * c0 + sum0;
    l1 = l1 * c1 + sum1;
}

/* After the previous tile's P V landed in O: O *= (c0, c1) by row (skipped
 * when every factor of the warp is exactly 1, as once the row maxima
 * settle), and the new P becomes the one the next P V multiplies (through
 * opaque moves: see opaque). */
template <int HD, bool SPLIT>
__device__ __forceinline__ void rescale_keep(float (&o)[HD / 2], float c0, float c1, uint32_t (&ph)[BN / 8][2],
                                             uint32_t (&pq)[SPLIT ? BN / 8 : 1][2], const uint32_t (&nh)[BN / 8][2],
                                             const uint32_t (&nq)[SPLIT ? BN / 8 : 1][2])
{
    if (__any_sync(0xffffffffu, c0 != 1.0f || c1 != 1.0f)) {
#pragma unroll
        for (int dt = 0; dt < HD / 8; dt++) {
            o[4 * dt] *= c0;
            o[4 * dt + 1] *= c0;
            o[4 * dt + 2] *= c1;
            o[4 * dt + 3] *= c1;
        }
    }
#pragma unroll
    for (int nt = 0; nt < BN / 8; nt++) {
        ph[nt][0] = opaque(nh[nt][0]);
        ph[nt][1] = opaque(nh[nt][1]);
        if (SPLIT) {
            pq[SPLIT ? nt : 0][0] = opaque(nq[SPLIT ? nt : 0][0]);
            pq[SPLIT ? nt : 0][1] = opaque(nq[SPLIT ? nt : 0][1]);
        }
    }
}

/* The warp's 16 rows of O into out / the split's partials: o[4 dt + e]
 * holds row g (e < 2) or g + 8, column 8 dt + 2 t + (e & 1); wr0: the
 * warp's first row among the CTA's R, r0 the CTA's first row. */
template <int HD>
__device__ __forceinline__ void store_rows(const tkv_cuda_attn_params &p, uint32_t gk, uint32_t split, uint32_t r0,
                                           int wr0, int R, const float (&o)[HD / 2], float m0, float m1, float l0,
                                           float l1)
{
    const int g = (threadIdx.x & 31) >> 2;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        float L = half ? l1 : l0;
        L += __shfl_xor_sync(0xffffffffu, L, 1);
        L += __shfl_xor_sync(0xffffffffu, L, 2);
        const int r = wr0 + g + 8 * half;
        if (r < R)
            store_row<HD>(p, gk, split, r0 + r, half ? m1 : m0, L,
                          [&](int dt, int e) { return o[4 * dt + 2 * half + e]; });
    }
}

#endif /* __CUDA_ARCH_FEAT_SM90_ALL */

} // namespace tkv_wg

#endif
