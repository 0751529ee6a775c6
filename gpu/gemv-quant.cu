/*
 * gemv-quant.cu -- the quantized decode GEMV (gemv-quant.cuh): activation
 * quantization to Q8_0 / Q8_1 planes, the fast kernels (plain, grouped and
 * gate/up + SwiGLU in one template each) and their reference.
 *
 * Q4_0 matrices are repacked at load (tkv_cuda_q4_0_pack: nibble blocks and
 * scales apart), so the Q4_0 kernel reads 16-byte nibble blocks straight
 * into registers, coalesced (the packed kernel, below).
 *
 * Q4_1 and Q8_0 keep their GGUF blocks, read through a shared-memory stage
 * (the staged kernel). Why the stage: those blocks are 20 and 34 bytes, so
 * a lane that reads its own blocks straight from global memory issues
 * loads at odd offsets or 16-byte loads far apart across the warp. Here a
 * lane owns a group of 4 blocks (Q4_1: 80 bytes) or 8 (Q8_0: 272): 5 or
 * 17 16-byte chunks, an odd number, so the warp copies its 32 groups
 * (contiguous runs of the rows) to a warp-private stage with coalesced
 * 16-byte cp.async, and each lane then reads its group with 128-bit shared
 * loads 5 / 17 chunks apart: conflict-free. The weights never pass through
 * L1 (.cg).
 */
#include "gemv-quant.cuh"

namespace {

enum { QT_Q4_0, QT_Q4_1, QT_Q8_0 };

/* BB: bytes per block; GB: blocks per lane group; CH: 16-byte chunks per group */
template <int QT> struct qtype;
template <> struct qtype<QT_Q4_1> { static constexpr int BB = 20, GB = 4, CH = 5, HALVES = 1; };
template <> struct qtype<QT_Q8_0> { static constexpr int BB = 34, GB = 8, CH = 17, HALVES = 2; };

int qt_of(uint32_t type)
{
    switch (type) {
    case TKV_TYPE_Q4_0: return QT_Q4_0;
    case TKV_TYPE_Q4_1: return QT_Q4_1;
    case TKV_TYPE_Q8_0: return QT_Q8_0;
    default: return -1;
    }
}

/* The staged kernel's group of blocks a lane (Q4_1, Q8_0) and its 16-byte chunks. */
uint32_t group_blocks(int qt) { return qt == QT_Q4_1 ? 4 : 8; }
uint32_t group_chunks(int qt) { return qt == QT_Q4_1 ? 5 : 17; }
/* The blocks a lane of qt's fast kernel takes at a step of its row: the
 * staged kernel's group, the packed kernel's one block. The rows it takes
 * are whole multiples of them, and its activation planes are in that block
 * order (tkv_q8_pos). */
uint32_t lane_blocks(int qt) { return qt == QT_Q4_0 ? 1 : group_blocks(qt); }

constexpr uint32_t QG_SMEM_MAX = 48u << 10; /* no opt-in attribute needed */
constexpr int QG_THREADS_MAX = 256;

/* ---- activation quantization: one warp per 32-element block ------------------------ */

/* One warp per block of the [n][nb] blocks of x; tkv_q8_block_of
 * (gemv-common.cuh) is the arithmetic. */
__global__ void q8_quantize_kernel(const float *__restrict__ x, uint32_t n_blocks, uint32_t nb,
                                   struct tkv_cuda_q8_act a)
{
    tkv_pdl_trigger();
    tkv_pdl_wait(); /* x is the previous kernel's output; q may still be read by it */
    const uint32_t blk = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (blk >= n_blocks)
        return;
    /* rows are n_in = 32 * nb long, so block blk of the [n][nb] blocks starts at 32 * blk */
    const tkv_q8_block b = tkv_q8_block_of(x[(size_t)blk * 32 + lane]);
    tkv_q8_block_put(b, lane, a, (size_t)(blk / nb) * nb + tkv_q8_pos(blk % nb, nb, a.gb));
}

__global__ void q8_pack_kernel(const int8_t *__restrict__ q, const struct tkv_cuda_q8_meta *__restrict__ meta,
                               uint32_t n_blocks, uint32_t nb, uint32_t gb, bool q8_1, uint8_t *__restrict__ dst)
{
    const uint32_t blk = blockIdx.x * blockDim.x + threadIdx.x;
    if (blk >= n_blocks)
        return;
    const size_t pos = (size_t)(blk / nb) * nb + tkv_q8_pos(blk % nb, nb, gb);
    const uint32_t bytes = q8_1 ? 36 : 34;
    uint8_t *o = dst + (size_t)blk * bytes;
    const unsigned short d = __half_as_ushort(meta[pos].d), s = __half_as_ushort(meta[pos].s);
    o[0] = (uint8_t)(d & 255);
    o[1] = (uint8_t)(d >> 8);
    if (q8_1) {
        o[2] = (uint8_t)(s & 255);
        o[3] = (uint8_t)(s >> 8);
    }
    for (int j = 0; j < 32; j++)
        o[bytes - 32 + j] = (uint8_t)q[pos * 32 + j];
}

/* ---- the fast kernel ------------------------------------------------------------------ */

/* The 4 bytes at byte offset o (even, a compile-time constant once the
 * callers are unrolled) of the chunks r[]. */
__device__ __forceinline__ uint32_t word_at(const uint4 *r, int o)
{
    const int i = o / 4;
    const uint32_t a = tkv_u4_word(r[i / 4], i % 4);
    if (o % 4 == 0)
        return a;
    const uint32_t b = tkv_u4_word(r[(i + 1) / 4], (i + 1) % 4);
    return __byte_perm(a, b, 0x5432);
}

__device__ __forceinline__ float half_at(const uint4 *r, int o)
{
    const uint32_t w = tkv_u4_word(r[o / 16], (o / 4) % 4);
    return __half2float(__ushort_as_half((unsigned short)(o % 4 == 0 ? w & 0xffffu : w >> 16)));
}

/* One weight block, unpacked: d (and m for Q4_1) widened to f32, the quant
 * bytes as words (Q4: 4 words of nibble pairs; Q8_0: 8 words). */
struct wblock {
    float d, m;
    uint32_t q[8];
};

template <int QT>
__device__ __forceinline__ wblock wblock_at(const uint4 *r, int o)
{
    wblock b;
    b.d = half_at(r, o);
    b.m = QT == QT_Q4_1 ? half_at(r, o + 2) : 0.0f;
    const int qo = o + (QT == QT_Q4_1 ? 4 : 2), nq = QT == QT_Q8_0 ? 8 : 4;
#pragma unroll
    for (int k = 0; k < 8; k++)
        b.q[k] = k < nq ? word_at(r, qo + 4 * k) : 0u;
    return b;
}

/* The block term of the CPU reference (tkv_vec_dot_ref) for one weight
 * block and one activation block (a0, a1: its 32 quant bytes; md: d | s << 16;
 * asum: the exact sum of its quants). */
template <int QT>
__device__ __forceinline__ float block_term(const wblock &w, const uint4 &a0, const uint4 &a1, uint32_t md, int asum)
{
    const float da = __half2float(__ushort_as_half((unsigned short)(md & 0xffffu)));
    int s = 0;
    if constexpr (QT == QT_Q8_0) {
#pragma unroll
        for (int k = 0; k < 8; k++)
            s = __dp4a((int)w.q[k], (int)(k < 4 ? tkv_u4_word(a0, k) : tkv_u4_word(a1, k - 4)), s);
        return __fmul_rn(__fmul_rn(w.d, da), (float)s);
    } else {
        /* qs[j] & 15 is element j, qs[j] >> 4 element j + 16 */
#pragma unroll
        for (int k = 0; k < 4; k++) {
            s = __dp4a((int)(w.q[k] & 0x0F0F0F0Fu), (int)tkv_u4_word(a0, k), s);
            s = __dp4a((int)((w.q[k] >> 4) & 0x0F0F0F0Fu), (int)tkv_u4_word(a1, k), s);
        }
        if constexpr (QT == QT_Q4_0) { /* sum((q - 8) * a) */
            return __fmul_rn(__fmul_rn(w.d, da), (float)(s - 8 * asum));
        } else {
            const float sa = __half2float(__ushort_as_half((unsigned short)(md >> 16)));
            return __fadd_rn(__fmul_rn(__fmul_rn(w.d, da), (float)s), __fmul_rn(w.m, sa));
        }
    }
}

/* acc[i] (acc2[i]: the second row, swiglu's up matrix or the pair's next
 * row) += the terms of group j of a row (blocks j GB .. j GB + GB - 1)
 * staged at g0 (g1). Activations come through the read-only cache (every
 * row of the grid reads them), in block order GB: block b of group j at
 * position b gpr + j, so the lanes of a row (consecutive j) read
 * consecutive blocks. */
template <int QT, int NT, bool TWO>
__device__ __forceinline__ void group_dot(const uint4 *g0, const uint4 *g1, const int8_t *__restrict__ aq,
                                          const struct tkv_cuda_q8_meta *__restrict__ am, uint32_t n_in,
                                          uint32_t j, float *acc, float *acc2)
{
    using Q = qtype<QT>;
    constexpr int PER = Q::GB / Q::HALVES; /* blocks per half */
    const uint32_t nb = n_in / 32, gpr = nb / Q::GB;
#pragma unroll
    for (int h = 0; h < Q::HALVES; h++) {
        constexpr int NC = (PER * Q::BB + 15) / 16 + 1;
        const int c0 = h * PER * Q::BB / 16, c1 = ((h + 1) * PER * Q::BB - 1) / 16;
        uint4 r0[NC], r1[NC];
#pragma unroll
        for (int c = 0; c < NC; c++) {
            r0[c] = c0 + c <= c1 ? g0[c0 + c] : make_uint4(0, 0, 0, 0);
            if (TWO)
                r1[c] = c0 + c <= c1 ? g1[c0 + c] : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int b = 0; b < PER; b++) {
            const int o = (h * PER + b) * Q::BB - c0 * 16;
            const wblock w0 = wblock_at<QT>(r0, o);
            wblock w1;
            if (TWO)
                w1 = wblock_at<QT>(r1, o);
            const uint32_t kb = (h * PER + b) * gpr + j; /* the block's position */
#pragma unroll
            for (int i = 0; i < NT; i++) {
                const uint4 *ap = (const uint4 *)(aq + (size_t)i * n_in + (size_t)kb * 32);
                const uint4 a0 = __ldg(ap), a1 = __ldg(ap + 1);
                const uint2 m = __ldg((const uint2 *)(am + (size_t)i * nb + kb));
                acc[i] = __fadd_rn(acc[i], block_term<QT>(w0, a0, a1, m.x, (int)m.y));
                if (TWO)
                    acc2[i] = __fadd_rn(acc2[i], block_term<QT>(w1, a0, a1, m.x, (int)m.y));
            }
        }
    }
}

/* What a lane set (the L threads of a unit) computes: one row (PLAIN), one
 * row of the gate and of the up matrix (SWIGLU), or two adjacent rows of
 * one weight (PAIR: every weight's row count even). SWIGLU and PAIR stream
 * two rows' groups through the stage and use each activation load for both. */
enum { MODE_PLAIN, MODE_SWIGLU, MODE_PAIR };

/* CTAs of QG_THREADS_MAX threads an SM must hold at once, by registers
 * (0: no bound; an explicit 1 would move ptxas's choices for the others);
 * plan() counts the residency of a bounded instance from it.
 * The one-token row-pair instance with 32 lanes a unit (Q4_1; measured
 * when Q4_0 ran this kernel, whose instance would take 150) at
 * QG_PAIR32_REGS registers: with one stage (plan) 4 of its 4-warp CTAs
 * then fit an SM, which put the Llama-3-8B `down` (4096 x 14336, 2048
 * pairs) in one wave. Q8_0's would spill. */
constexpr int QG_PAIR32_REGS = 128;
constexpr int qg_min_ctas(int qt, int mode, int nt, int l)
{
    return qt != QT_Q8_0 && mode == MODE_PAIR && nt == 1 && l == 32 ? 65536 / (QG_THREADS_MAX * QG_PAIR32_REGS) : 0;
}

/* Stores token i's results of a unit: v0 for row `local` of weight seg, v1
 * for the next row (MODE_PAIR) or the up row's sum (MODE_SWIGLU); with
 * the epilogue's RoPE (partner: the sum of the other row of v0's pair),
 * SwiGLU, or the residual add. */
template <int MODE, bool CAN_ROPE>
__device__ __forceinline__ void store_unit(const struct tkv_cuda_qgemv &g, uint32_t seg, uint32_t local, uint32_t i,
                                           float v0, float v1, float partner)
{
    const uint32_t n_out = g.end[seg] - (seg ? g.end[seg - 1] : 0);
    float *y = g.y[seg] + (size_t)i * n_out + local;
    if (CAN_ROPE && g.rope && seg < g.rope_segs && local % g.head_dim / 2 < g.n_pairs) {
        const float2 c = g.rope[(size_t)i * g.n_pairs + local % g.head_dim / 2];
        const bool first = local % 2 == 0; /* always, in pairs */
        float r0, r1;
        tkv_rope_rotate(first ? v0 : partner, first ? partner : v0, c, &r0, &r1);
        v0 = first ? r0 : r1;
        v1 = r1;
    }
    if (MODE == MODE_SWIGLU) {
        y[0] = v0 / (1.0f + expf(-v0)) * v1;
        return;
    }
    /* with acc, the residual add: y + x, as add_rmsnorm_kernel adds */
    y[0] = g.acc ? y[0] + v0 : v0;
    if (MODE == MODE_PAIR)
        y[1] = g.acc ? y[1] + v1 : v1;
}

/* Where grid row `row` lies among g's weights: weight *seg, its row *local
 * (0 past the last row: the unit is not live, the return). */
__device__ __forceinline__ bool row_of(const struct tkv_cuda_qgemv &g, uint32_t row, uint32_t *seg, uint32_t *local)
{
    uint32_t i = 0;
    while (i + 1 < g.nw && row >= g.end[i])
        i++;
    const bool live = row < g.end[g.nw - 1];
    *seg = i;
    *local = live ? row - (i ? g.end[i - 1] : 0) : 0;
    return live;
}

/* L threads per unit (8 .. 256); blockDim.x / L units per CTA; nstage 1 or
 * 2 stages of [warps][NM][32 * CH] chunks in dynamic shared memory, then
 * the reduction's part[warps][NM][NT]. */
template <int QT, int NT, int L, int MODE>
__global__ void __launch_bounds__(QG_THREADS_MAX, qg_min_ctas(QT, MODE, NT, L))
    qgemv_kernel(const struct tkv_cuda_qgemv g, const int8_t *__restrict__ aq,
                 const struct tkv_cuda_q8_meta *__restrict__ am, uint32_t n_in, uint32_t nstage)
{
    using Q = qtype<QT>;
    constexpr bool SW = MODE == MODE_SWIGLU, TWO = MODE != MODE_PLAIN;
    constexpr int CH = Q::CH, NM = TWO ? 2 : 1;
    extern __shared__ uint4 qg_smem[];
    const uint32_t warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const uint32_t unit = blockIdx.x * (blockDim.x / L) + threadIdx.x / L, t = threadIdx.x % L;
    const uint32_t row = MODE == MODE_PAIR ? 2 * unit : unit;
    const uint32_t gpr = n_in / (32 * Q::GB); /* groups per row */
    const size_t row_bytes = (size_t)(n_in / 32) * Q::BB;
    uint32_t seg, local;
    const bool live = row_of(g, row, &seg, &local);
    const uint8_t *w0 = (const uint8_t *)g.w[seg] + local * row_bytes;
    const uint8_t *w1 = SW ? (const uint8_t *)g.wu + local * row_bytes : TWO ? w0 + row_bytes : NULL;
    const size_t stage_chunks = (size_t)warps * NM * 32 * CH;
    uint4 *mine = qg_smem + (size_t)warp * NM * 32 * CH; /* this warp's stage 0 */

    /* Copies the groups of this warp's lanes at iteration k0 (lane l's at
     * chunks l * CH .. of the stage): chunk c = i * 32 + lane belongs to
     * lane c / CH, whose row pointer comes by shuffle. */
    auto issue = [&](uint32_t k0, uint32_t st) {
        const uint32_t j = k0 + t;
        const bool ok = live && j < gpr;
#pragma unroll
        for (int m = 0; m < NM; m++) {
            const uint8_t *src = ok ? (m ? w1 : w0) + (size_t)j * (CH * 16) : NULL;
            uint4 *dst = mine + st * stage_chunks + m * 32 * CH;
#pragma unroll
            for (int i = 0; i < CH; i++) {
                const uint32_t c = i * 32 + lane;
                const uint8_t *p = (const uint8_t *)__shfl_sync(0xffffffffu, (unsigned long long)src, c / CH);
                tkv_cp_async16(dst + c, p ? p + (c % CH) * 16 : (const void *)g.w[0], p != NULL);
            }
        }
        tkv_cp_async_commit();
    };

    tkv_pdl_trigger();
    issue(0, 0); /* weights only: written at load, by no kernel */
    tkv_pdl_wait();
    float acc[NT], acc2[NT];
#pragma unroll
    for (int i = 0; i < NT; i++)
        acc[i] = acc2[i] = 0.0f;
    for (uint32_t k0 = 0, it = 0; k0 < gpr; k0 += L, it++) {
        const uint32_t st = nstage == 2 ? it & 1 : 0;
        if (k0 + L < gpr) {
            if (nstage == 2) {
                issue(k0 + L, st ^ 1);
                tkv_cp_async_wait<1>();
            } else {
                tkv_cp_async_wait<0>();
            }
        } else {
            tkv_cp_async_wait<0>();
        }
        __syncwarp(); /* every lane's copies of this stage have landed */
        const uint32_t j = k0 + t;
        if (live && j < gpr) {
            const uint4 *gs = mine + st * stage_chunks + lane * CH;
            group_dot<QT, NT, TWO>(gs, gs + 32 * CH, aq, am, n_in, j, acc, acc2);
        }
        __syncwarp(); /* the stage is read before it is refilled */
        if (nstage == 1 && k0 + L < gpr)
            issue(k0 + L, 0);
    }
    float *part = (float *)(qg_smem + nstage * stage_chunks);
    float v0, v1 = 0.0f;
    const bool out = tkv_row_reduce<NT, L>(acc, part, warp, lane, &v0);
    if (TWO)
        tkv_row_reduce<NT, L>(acc2, part + warps * NT, warp, lane, &v1);
    /* RoPE's partner of this row: the pair's other row (v1), or the next or
     * previous unit's sum, L lanes away in the same warp (L <= 16) */
    constexpr bool CAN_ROPE = MODE == MODE_PAIR || (MODE == MODE_PLAIN && L <= 16);
    float partner = v1;
    if (MODE == MODE_PLAIN && L <= 16 && g.rope)
        partner = __shfl_xor_sync(0xffffffffu, v0, L);
    if (out && live)
        store_unit<MODE, CAN_ROPE>(g, seg, local, L <= 32 ? t : lane, v0, v1, partner);
}

/* two: a unit streams two rows (MODE_SWIGLU, MODE_PAIR) */
uint32_t stage_bytes(int qt, uint32_t warps, bool two)
{
    return warps * (two ? 2 : 1) * 32 * group_chunks(qt) * 16;
}

uint32_t smem_bytes(int qt, uint32_t warps, bool two, uint32_t nstage, uint32_t nt)
{
    return nstage * stage_bytes(qt, warps, two) + warps * (two ? 2 : 1) * nt * (uint32_t)sizeof(float);
}

/* Threads per unit L, warps per CTA and stages for `units` units of n_in
 * of n tokens in `mode` (smem_sm: the device's shared memory per SM, 0 if
 * unknown). */
void plan(int qt, int mode, uint32_t n, uint32_t n_in, uint32_t units, uint32_t n_sm, uint32_t smem_sm,
          uint32_t *L_out, uint32_t *warps_out, uint32_t *nstage_out)
{
    const bool two = mode != MODE_PLAIN; /* a unit streams two rows */
    const uint32_t gpr = n_in / (32 * group_blocks(qt));
    uint32_t L = 8;
    while (L < 32 && 2 * L <= gpr) /* every lane of a row a group, where rows are long enough */
        L *= 2;
    auto ctas = [&](uint32_t l, uint32_t w) { return ((uint64_t)units * l + 32 * w - 1) / (32 * w); };
    auto wmin = [](uint32_t l) { return l > 32 ? l / 32 : 1u; };
    /* few units: split them over more warps while each thread keeps a group
     * (and the unit's warps' stage fits) */
    while (L < 128 && ctas(L, 8) < 2ull * n_sm && 2 * L <= gpr &&
           smem_bytes(qt, wmin(2 * L), two, 1, 8) <= QG_SMEM_MAX)
        L *= 2;
    /* warps a CTA for a stage count: the most whose stages fit, then smaller
     * CTAs while the grid does not fill the GPU twice over */
    auto warps_for = [&](uint32_t nstage) {
        uint32_t w = 8;
        while (w > wmin(L) && smem_bytes(qt, w, two, nstage, 8) > QG_SMEM_MAX)
            w /= 2;
        while (w > 2 && w > wmin(L) && ctas(L, w) < 2ull * n_sm)
            w /= 2;
        return w;
    };
    /* a second stage (the next round's copies in flight during this one's
     * arithmetic) where a unit takes several rounds */
    uint32_t nstage = gpr > L && smem_bytes(qt, wmin(L), two, 2, 8) <= QG_SMEM_MAX ? 2 : 1;
    uint32_t w = warps_for(nstage);
    /* but one stage where that puts the grid in one wave and two do not:
     * a second part-wave starts only as the first ends, which costs more
     * than the overlap of the second stage (session 39, when this kernel
     * ran Q4_0: the Q4_0 `down`,
     * 1024 CTAs of 2 warps and 6 an SM with two stages, 1.29 waves, against
     * 512 CTAs of 4 warps in one wave with one: 21.4 -> 19.7 µs on an
     * H100). Residency by shared memory (1 KB reserved a CTA) and by the
     * registers, known only for an instance that qg_min_ctas bounds. */
    const int min_ctas = qg_min_ctas(qt, mode, (int)n, (int)L);
    if (min_ctas > 0 && nstage == 2 && smem_sm) {
        const uint32_t regs = 65536u / (QG_THREADS_MAX * min_ctas); /* a thread's, at most */
        auto resident = [&](uint32_t w_, uint32_t ns) {
            const uint64_t by_smem = smem_sm / (smem_bytes(qt, w_, two, ns, n) + 1024u);
            const uint64_t by_regs = 65536u / (regs * 32u * w_);
            return (by_smem < by_regs ? by_smem : by_regs) * n_sm;
        };
        const uint32_t w1 = warps_for(1);
        if (ctas(L, w1) <= resident(w1, 1) && ctas(L, w) > resident(w, 2))
            nstage = 1, w = w1;
    }
    *L_out = L;
    *warps_out = w;
    *nstage_out = nstage;
}

template <int QT, int NT, int L, int MODE>
cudaError_t qgemv_launch(const struct tkv_cuda_qgemv *g, struct tkv_cuda_q8_act a, uint32_t n_in, uint32_t units,
                         uint32_t warps, uint32_t nstage, bool pdl, cudaStream_t s)
{
    const uint32_t threads = warps * 32, smem = smem_bytes(QT, warps, MODE != MODE_PLAIN, nstage, NT);
    if (smem > QG_SMEM_MAX || threads < (uint32_t)L)
        return cudaErrorInvalidConfiguration;
    return tkv_cuda_launch(pdl, tkv_cuda_blocks(units, threads / L), threads, smem, s,
                           qgemv_kernel<QT, NT, L, MODE>, *g, (const int8_t *)a.q,
                           (const struct tkv_cuda_q8_meta *)a.meta, n_in, nstage);
}

template <int QT, int NT, int MODE>
cudaError_t qgemv_pick_l(const struct tkv_cuda_qgemv *g, struct tkv_cuda_q8_act a, uint32_t n_in, uint32_t units,
                         uint32_t L, uint32_t warps, uint32_t nstage, bool pdl, cudaStream_t s)
{
    switch (L) {
    case 8: return qgemv_launch<QT, NT, 8, MODE>(g, a, n_in, units, warps, nstage, pdl, s);
    case 16: return qgemv_launch<QT, NT, 16, MODE>(g, a, n_in, units, warps, nstage, pdl, s);
    case 32: return qgemv_launch<QT, NT, 32, MODE>(g, a, n_in, units, warps, nstage, pdl, s);
    case 64: return qgemv_launch<QT, NT, 64, MODE>(g, a, n_in, units, warps, nstage, pdl, s);
    case 128: return qgemv_launch<QT, NT, 128, MODE>(g, a, n_in, units, warps, nstage, pdl, s);
    default: return cudaErrorInvalidValue;
    }
}

template <int QT, int MODE>
cudaError_t qgemv_pick_n(const struct tkv_cuda_qgemv *g, struct tkv_cuda_q8_act a, uint32_t n_in, uint32_t units,
                         uint32_t n, uint32_t L, uint32_t warps, uint32_t nstage, bool pdl, cudaStream_t s)
{
    switch (n) {
    case 1: return qgemv_pick_l<QT, 1, MODE>(g, a, n_in, units, L, warps, nstage, pdl, s);
    case 2: return qgemv_pick_l<QT, 2, MODE>(g, a, n_in, units, L, warps, nstage, pdl, s);
    case 3: return qgemv_pick_l<QT, 3, MODE>(g, a, n_in, units, L, warps, nstage, pdl, s);
    case 4: return qgemv_pick_l<QT, 4, MODE>(g, a, n_in, units, L, warps, nstage, pdl, s);
    case 5: return qgemv_pick_l<QT, 5, MODE>(g, a, n_in, units, L, warps, nstage, pdl, s);
    case 6: return qgemv_pick_l<QT, 6, MODE>(g, a, n_in, units, L, warps, nstage, pdl, s);
    case 7: return qgemv_pick_l<QT, 7, MODE>(g, a, n_in, units, L, warps, nstage, pdl, s);
    case 8: return qgemv_pick_l<QT, 8, MODE>(g, a, n_in, units, L, warps, nstage, pdl, s);
    default: return cudaErrorInvalidValue;
    }
}

template <int QT>
cudaError_t qgemv_pick_mode(int mode, const struct tkv_cuda_qgemv *g, struct tkv_cuda_q8_act a, uint32_t n_in,
                            uint32_t units, uint32_t n, uint32_t L, uint32_t warps, uint32_t nstage, bool pdl,
                            cudaStream_t s)
{
    switch (mode) {
    case MODE_SWIGLU: return qgemv_pick_n<QT, MODE_SWIGLU>(g, a, n_in, units, n, L, warps, nstage, pdl, s);
    case MODE_PAIR: return qgemv_pick_n<QT, MODE_PAIR>(g, a, n_in, units, n, L, warps, nstage, pdl, s);
    default: return qgemv_pick_n<QT, MODE_PLAIN>(g, a, n_in, units, n, L, warps, nstage, pdl, s);
    }
}

/* ---- Q4_0: the packed kernel -----------------------------------------------------------
 *
 * A packed Q4_0 matrix of rows x nb blocks (tkv_cuda_q4_0_pack) holds the
 * rows' 16-byte nibble blocks, row after row, then their f16 scales in the
 * same order: 18 bytes a block, as GGUF. A unit (one row, a row pair or a
 * gate and an up row: R rows) is one warp: lane j reads blocks j, j + 32,
 * ... of the unit's rows straight into registers (16-byte loads, 512
 * contiguous bytes a warp instruction, not kept in L1), U blocks a row at
 * a time while the next U load; the activations, in the plain block order
 * (gb = 1), come through L1, each load serving the unit's rows. The first
 * U are loaded before griddepcontrol.wait (weights: written by no kernel).
 * No shared memory and no barrier, so a CTA's slot frees as soon as its
 * warps end. A lane adds its blocks' terms in order and the warp sums its
 * lanes by an xor butterfly, whatever R: pairs and single rows give the
 * same bits. gpu/probe/packed-probe.cu measured the design against the
 * staged one (docs/gpu.md, "Weights"; docs/benchmarks.md, "Session 45"). */

constexpr uint32_t Q4P_WARPS = 8; /* warps (units) a CTA, at most and by default */

/* The scales of a packed matrix of rows x nb blocks at w. */
__device__ __forceinline__ const __half *q4p_scales(const void *w, uint32_t rows, uint32_t nb)
{
    return (const __half *)((const uint8_t *)w + (size_t)rows * nb * 16);
}

template <int NT, int U, int MODE>
__global__ void __launch_bounds__(Q4P_WARPS * 32)
    q4p_kernel(const struct tkv_cuda_qgemv g, const int8_t *__restrict__ aq,
               const struct tkv_cuda_q8_meta *__restrict__ am, uint32_t n_in)
{
    constexpr bool TWO = MODE != MODE_PLAIN;
    constexpr int R = TWO ? 2 : 1;
    tkv_pdl_trigger();
    const uint32_t lane = threadIdx.x % 32, nb = n_in / 32;
    const uint32_t unit = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const uint32_t row = MODE == MODE_PAIR ? 2 * unit : unit;
    uint32_t seg, local;
    const bool live = row_of(g, row, &seg, &local); /* the same for the whole warp */
    const uint32_t rows = g.end[seg] - (seg ? g.end[seg - 1] : 0);
    const uint4 *qr[R];
    const __half *dr[R];
    qr[0] = (const uint4 *)g.w[seg] + (size_t)local * nb;
    dr[0] = q4p_scales(g.w[seg], rows, nb) + (size_t)local * nb;
    if constexpr (TWO) {
        const bool sw = MODE == MODE_SWIGLU;
        qr[1] = sw ? (const uint4 *)g.wu + (size_t)local * nb : qr[0] + nb;
        dr[1] = sw ? q4p_scales(g.wu, rows, nb) + (size_t)local * nb : dr[0] + nb;
    }
    uint4 wq[R][U], nq[R][U];
    float wd[R][U], nd[R][U];
    auto load = [&](uint32_t b0, uint4 (&q)[R][U], float (&d)[R][U]) {
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int u = 0; u < U; u++) {
                const uint32_t b = b0 + u * 32 + lane;
                const bool ok = live && b < nb;
                q[r][u] = ok ? tkv_ld_stream16(qr[r] + b) : make_uint4(0, 0, 0, 0);
                d[r][u] = ok ? __half2float(dr[r][b]) : 0.0f;
            }
    };
    load(0, wq, wd);
    tkv_pdl_wait();
    float acc[R][NT];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int i = 0; i < NT; i++)
            acc[r][i] = 0.0f;
    for (uint32_t b0 = 0; live && b0 < nb; b0 += 32 * U) {
        if (b0 + 32 * U < nb)
            load(b0 + 32 * U, nq, nd);
#pragma unroll
        for (int u = 0; u < U; u++) {
            const uint32_t b = b0 + u * 32 + lane;
            if (b >= nb)
                continue;
#pragma unroll
            for (int i = 0; i < NT; i++) {
                const uint4 *ap = (const uint4 *)(aq + (size_t)i * n_in + (size_t)b * 32);
                const uint4 a0 = __ldg(ap), a1 = __ldg(ap + 1);
                const uint2 m = __ldg((const uint2 *)(am + (size_t)i * nb + b));
#pragma unroll
                for (int r = 0; r < R; r++) {
                    wblock w;
                    w.d = wd[r][u];
                    w.m = 0.0f;
#pragma unroll
                    for (int k = 0; k < 8; k++)
                        w.q[k] = k < 4 ? tkv_u4_word(wq[r][u], k) : 0u;
                    acc[r][i] = __fadd_rn(acc[r][i], block_term<QT_Q4_0>(w, a0, a1, m.x, (int)m.y));
                }
            }
        }
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int u = 0; u < U; u++)
                wq[r][u] = nq[r][u], wd[r][u] = nd[r][u];
    }
    float v0 = 0.0f, v1 = 0.0f; /* token `lane`'s sums (lanes < NT) */
#pragma unroll
    for (int i = 0; i < NT; i++) {
        float s0 = acc[0][i], s1 = acc[R - 1][i];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            s0 += __shfl_xor_sync(0xffffffffu, s0, o);
            if (TWO)
                s1 += __shfl_xor_sync(0xffffffffu, s1, o);
        }
        if (lane == (uint32_t)i)
            v0 = s0, v1 = s1;
    }
    if (live && lane < (uint32_t)NT)
        store_unit<MODE, MODE == MODE_PAIR>(g, seg, local, lane, v0, v1, v1);
}

template <int NT, int U, int MODE>
cudaError_t q4p_launch(const struct tkv_cuda_qgemv *g, struct tkv_cuda_q8_act a, uint32_t n_in, uint32_t units,
                       bool pdl, cudaStream_t s)
{
    const uint32_t warps = g->q4p_warps ? g->q4p_warps : Q4P_WARPS;
    if (warps > Q4P_WARPS)
        return cudaErrorInvalidConfiguration;
    return tkv_cuda_launch(pdl, tkv_cuda_blocks(units, warps), warps * 32, 0, s, q4p_kernel<NT, U, MODE>, *g,
                           (const int8_t *)a.q, (const struct tkv_cuda_q8_meta *)a.meta, n_in);
}

template <int NT, int MODE>
cudaError_t q4p_pick_u(const struct tkv_cuda_qgemv *g, struct tkv_cuda_q8_act a, uint32_t n_in, uint32_t units,
                       bool pdl, cudaStream_t s)
{
    /* few units (a grid of 256 CTAs or less on Llama-3-8B's wo and down):
     * more bytes in flight a warp; more tokens: fewer registers for loads */
    const uint32_t u = g->q4p_u ? g->q4p_u : units <= 2048 && NT <= 2 ? 4 : 2;
    switch (u) {
    case 2: return q4p_launch<NT, 2, MODE>(g, a, n_in, units, pdl, s);
    case 4: return q4p_launch<NT, 4, MODE>(g, a, n_in, units, pdl, s);
    case 8:
        if constexpr (NT <= 2)
            return q4p_launch<NT, 8, MODE>(g, a, n_in, units, pdl, s);
        return cudaErrorInvalidValue;
    default: return cudaErrorInvalidValue;
    }
}

template <int MODE>
cudaError_t q4p_pick_n(const struct tkv_cuda_qgemv *g, struct tkv_cuda_q8_act a, uint32_t n_in, uint32_t units,
                       uint32_t n, bool pdl, cudaStream_t s)
{
    switch (n) {
    case 1: return q4p_pick_u<1, MODE>(g, a, n_in, units, pdl, s);
    case 2: return q4p_pick_u<2, MODE>(g, a, n_in, units, pdl, s);
    case 3: return q4p_pick_u<3, MODE>(g, a, n_in, units, pdl, s);
    case 4: return q4p_pick_u<4, MODE>(g, a, n_in, units, pdl, s);
    case 5: return q4p_pick_u<5, MODE>(g, a, n_in, units, pdl, s);
    case 6: return q4p_pick_u<6, MODE>(g, a, n_in, units, pdl, s);
    case 7: return q4p_pick_u<7, MODE>(g, a, n_in, units, pdl, s);
    case 8: return q4p_pick_u<8, MODE>(g, a, n_in, units, pdl, s);
    default: return cudaErrorInvalidValue;
    }
}

__global__ void q4_0_pack_kernel(const uint8_t *__restrict__ src, uint8_t *__restrict__ dst, size_t blocks)
{
    const size_t b = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (b >= blocks)
        return;
    const uint8_t *blk = src + b * 18;
    uint8_t *q = dst + b * 16, *d = dst + blocks * 16 + b * 2;
    for (int j = 0; j < 16; j++)
        q[j] = blk[2 + j];
    d[0] = blk[0];
    d[1] = blk[1];
}

/* ---- the reference: one warp per row, a lane per block, byte loads ------------------ */

__device__ __forceinline__ float f16_bytes(const uint8_t *p)
{
    return __half2float(__ushort_as_half((unsigned short)(p[0] | p[1] << 8)));
}

template <int QT>
__global__ void qgemv_ref_kernel(const uint8_t *w, const int8_t *aq, const struct tkv_cuda_q8_meta *am, uint32_t gb,
                                 float *y, uint32_t n_in, uint32_t n_out, uint32_t n)
{
    const uint32_t row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= n_out)
        return;
    /* a block's bytes: GGUF's, or for Q4_0 its nibbles in the packed layout (its scale apart) */
    const uint32_t nb = n_in / 32, bb = QT == QT_Q4_0 ? 16 : QT == QT_Q4_1 ? 20 : 34;
    for (uint32_t i = 0; i < n; i++) {
        float acc = 0.0f;
        for (uint32_t kb = lane; kb < nb; kb += 32) {
            const size_t at = (size_t)row * nb + kb;
            const uint8_t *blk = w + at * bb;
            const uint32_t pos = tkv_q8_pos(kb, nb, gb);
            const int8_t *a = aq + (size_t)i * n_in + (size_t)pos * 32;
            const struct tkv_cuda_q8_meta m = am[(size_t)i * nb + pos];
            const float dw = QT == QT_Q4_0 ? __half2float(q4p_scales(w, n_out, nb)[at]) : f16_bytes(blk);
            const float da = __half2float(m.d);
            int s = 0;
            float term;
            if (QT == QT_Q8_0) {
                for (int j = 0; j < 32; j++)
                    s += (int8_t)blk[2 + j] * a[j];
                term = __fmul_rn(__fmul_rn(dw, da), (float)s);
            } else if (QT == QT_Q4_0) {
                for (int j = 0; j < 16; j++)
                    s += ((blk[j] & 15) - 8) * a[j] + ((blk[j] >> 4) - 8) * a[j + 16];
                term = __fmul_rn(__fmul_rn(dw, da), (float)s);
            } else {
                for (int j = 0; j < 16; j++)
                    s += (blk[4 + j] & 15) * a[j] + (blk[4 + j] >> 4) * a[j + 16];
                term = __fadd_rn(__fmul_rn(__fmul_rn(dw, da), (float)s), __fmul_rn(f16_bytes(blk + 2), __half2float(m.s)));
            }
            acc = __fadd_rn(acc, term);
        }
        acc = tkv_warp_sum(acc);
        if (lane == 0)
            y[(size_t)i * n_out + row] = acc;
    }
}

} // namespace

bool tkv_cuda_qgemv_supported(uint32_t type) { return qt_of(type) >= 0; }

/* The quant bytes of n rows of n_in, rounded up so that the scales after
 * them are 16-byte aligned. */
static size_t q8_codes_bytes(uint32_t n, uint32_t n_in) { return ((size_t)n * n_in + 15) / 16 * 16; }

size_t tkv_cuda_q8_act_bytes(uint32_t n, uint32_t n_in)
{
    return q8_codes_bytes(n, n_in) + (size_t)n * (n_in / 32) * sizeof(struct tkv_cuda_q8_meta);
}

uint32_t tkv_cuda_q8_order(uint32_t type, uint32_t n_in)
{
    const int qt = qt_of(type);
    return qt >= 0 && n_in % (32 * lane_blocks(qt)) == 0 ? lane_blocks(qt) : 1;
}

struct tkv_cuda_q8_act tkv_cuda_q8_act_at(void *buf, uint32_t n, uint32_t n_in, uint32_t gb)
{
    struct tkv_cuda_q8_act a;
    a.gb = gb;
    a.q = (int8_t *)buf;
    a.meta = (struct tkv_cuda_q8_meta *)((uint8_t *)buf + q8_codes_bytes(n, n_in));
    return a;
}

/* The checks of a call over n rows of n_in in a's layout: cudaSuccess with
 * *blocks = 0 (nothing to do) or the row's blocks *nb and their total;
 * invalid when a's group order does not divide a row's blocks. */
static cudaError_t q8_blocks(struct tkv_cuda_q8_act a, uint32_t n, uint32_t n_in, uint32_t *nb, uint32_t *blocks)
{
    *nb = n_in / 32;
    *blocks = n * *nb;
    return *blocks == 0 || (a.gb != 0 && *nb % a.gb == 0) ? cudaSuccess : cudaErrorInvalidValue;
}

cudaError_t tkv_cuda_q8_quantize(const float *x, uint32_t n, uint32_t n_in, struct tkv_cuda_q8_act a, bool pdl,
                                 cudaStream_t s)
{
    uint32_t nb, blocks;
    TKV_CUDA_TRY(q8_blocks(a, n, n_in, &nb, &blocks));
    if (blocks == 0)
        return cudaSuccess;
    return tkv_cuda_launch(pdl, tkv_cuda_blocks(blocks, 8), 256, 0, s, q8_quantize_kernel, x, blocks, nb, a);
}

cudaError_t tkv_cuda_q8_pack(struct tkv_cuda_q8_act a, uint32_t n, uint32_t n_in, bool q8_1, void *dst,
                             cudaStream_t s)
{
    uint32_t nb, blocks;
    TKV_CUDA_TRY(q8_blocks(a, n, n_in, &nb, &blocks));
    if (blocks == 0)
        return cudaSuccess;
    q8_pack_kernel<<<tkv_cuda_blocks(blocks, 256), 256, 0, s>>>(a.q, a.meta, blocks, nb, a.gb, q8_1, (uint8_t *)dst);
    TKV_CUDA_LAUNCHED();
    return cudaSuccess;
}

bool tkv_cuda_qgemv_fast_ok(uint32_t type, const void *w, uint32_t n_in)
{
    const int qt = qt_of(type);
    return qt >= 0 && n_in % (32 * lane_blocks(qt)) == 0 && (uintptr_t)w % 16 == 0;
}

cudaError_t tkv_cuda_q4_0_pack(const void *gguf, void *dst, size_t blocks, cudaStream_t s)
{
    if (blocks == 0)
        return cudaSuccess;
    q4_0_pack_kernel<<<tkv_cuda_blocks(blocks, 256), 256, 0, s>>>((const uint8_t *)gguf, (uint8_t *)dst, blocks);
    TKV_CUDA_LAUNCHED();
    return cudaSuccess;
}

cudaError_t tkv_cuda_qgemv(uint32_t type, const struct tkv_cuda_qgemv *g, struct tkv_cuda_q8_act a, uint32_t n_in,
                           uint32_t n, uint32_t n_sm, uint32_t smem_sm, bool pdl, cudaStream_t s)
{
    const int qt = qt_of(type);
    if (qt < 0 || g->nw == 0 || g->nw > TKV_CUDA_QGEMV_MAX || (g->swiglu && (g->nw != 1 || g->acc)) ||
        a.gb != lane_blocks(qt))
        return cudaErrorInvalidValue;
    if (g->rope) {
        if (g->swiglu || g->acc || g->head_dim == 0 || g->head_dim % 2 || g->n_pairs > g->head_dim / 2 ||
            g->rope_segs > g->nw)
            return cudaErrorInvalidValue;
        for (uint32_t i = 0; i < g->rope_segs; i++)
            if ((g->end[i] - (i ? g->end[i - 1] : 0)) % g->head_dim)
                return cudaErrorInvalidValue;
    }
    for (uint32_t i = 0; i < g->nw; i++)
        if (!tkv_cuda_qgemv_fast_ok(type, g->w[i], n_in) || (g->swiglu && !tkv_cuda_qgemv_fast_ok(type, g->wu, n_in)))
            return cudaErrorInvalidValue;
    const uint32_t rows = g->end[g->nw - 1];
    if (rows == 0 || n == 0)
        return cudaSuccess;
    bool pair = g->pair && !g->swiglu;
    for (uint32_t i = 0; i < g->nw; i++)
        pair = pair && g->end[i] % 2 == 0; /* a pair never straddles two weights */
    int mode = g->swiglu ? MODE_SWIGLU : pair ? MODE_PAIR : MODE_PLAIN;
    uint32_t units = pair ? rows / 2 : rows;
    /* RoPE with single rows whose pair partners would sit in different
     * warps: rows in pairs instead (false: a weight's rows are odd) */
    auto rope_pairs = [&]() {
        for (uint32_t i = 0; i < g->nw; i++)
            if (g->end[i] % 2)
                return false;
        mode = MODE_PAIR;
        units = rows / 2;
        return true;
    };
    if (qt == QT_Q4_0) { /* the packed kernel: a warp a row */
        if (g->rope && mode == MODE_PLAIN && !rope_pairs())
            return cudaErrorInvalidValue;
        switch (mode) {
        case MODE_SWIGLU: return q4p_pick_n<MODE_SWIGLU>(g, a, n_in, units, n, pdl, s);
        case MODE_PAIR: return q4p_pick_n<MODE_PAIR>(g, a, n_in, units, n, pdl, s);
        default: return q4p_pick_n<MODE_PLAIN>(g, a, n_in, units, n, pdl, s);
        }
    }
    uint32_t L, warps, nstage;
    plan(qt, mode, n, n_in, units, n_sm, smem_sm, &L, &warps, &nstage);
    if (g->rope && mode == MODE_PLAIN && L > 16) { /* more than a warp's lanes a row */
        if (!rope_pairs())
            return cudaErrorInvalidValue;
        plan(qt, mode, n, n_in, units, n_sm, smem_sm, &L, &warps, &nstage);
    }
    switch (qt) {
    case QT_Q4_1: return qgemv_pick_mode<QT_Q4_1>(mode, g, a, n_in, units, n, L, warps, nstage, pdl, s);
    default: return qgemv_pick_mode<QT_Q8_0>(mode, g, a, n_in, units, n, L, warps, nstage, pdl, s);
    }
}

cudaError_t tkv_cuda_qgemv_ref(uint32_t type, const void *w, struct tkv_cuda_q8_act a, float *y, uint32_t n_in,
                               uint32_t n_out, uint32_t n, cudaStream_t s)
{
    const int qt = qt_of(type);
    if (qt < 0 || n_in % 32 != 0 || a.gb == 0 || (n_in / 32) % a.gb != 0)
        return cudaErrorInvalidValue;
    if (n_out == 0 || n == 0)
        return cudaSuccess;
    const unsigned grid = tkv_cuda_blocks(n_out, 8);
    const uint8_t *wb = (const uint8_t *)w;
    if (qt == QT_Q4_0)
        qgemv_ref_kernel<QT_Q4_0><<<grid, 256, 0, s>>>(wb, a.q, a.meta, a.gb, y, n_in, n_out, n);
    else if (qt == QT_Q4_1)
        qgemv_ref_kernel<QT_Q4_1><<<grid, 256, 0, s>>>(wb, a.q, a.meta, a.gb, y, n_in, n_out, n);
    else
        qgemv_ref_kernel<QT_Q8_0><<<grid, 256, 0, s>>>(wb, a.q, a.meta, a.gb, y, n_in, n_out, n);
    TKV_CUDA_LAUNCHED();
    return cudaSuccess;
}
