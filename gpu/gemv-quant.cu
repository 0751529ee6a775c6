/*
 * gemv-quant.cu -- the quantized decode GEMV (gemv-quant.cuh): activation
 * quantization to Q8_0 / Q8_1 planes, the packed weight layout, the fast
 * kernel (plain, row pairs, grouped, gate/up + SwiGLU: one template) and
 * its reference.
 *
 * Why the packed layout: GGUF blocks are 18 (Q4_0), 20 (Q4_1) or 34 (Q8_0)
 * bytes, so a block's quants sit at a 2- or 4-byte offset, and a lane that
 * reads its own blocks straight from global memory issues small unaligned
 * loads, or 16-byte loads far apart across the warp. Repacked at load
 * (tkv_cuda_qgemv_pack), a matrix is its blocks' quants (16 or 32 bytes a
 * block), row after row, then their scales (d; d and m for Q4_1) in the
 * same order: the same bytes. Lane j of a warp reads blocks j, j + 32, ...
 * of its rows with 16-byte loads (512 contiguous bytes a warp instruction)
 * straight into registers: no shared memory, no barrier. Until session 45
 * the kernel staged GGUF blocks through shared memory with cp.async
 * (docs/gpu.md, "Weights", says what each design measured).
 */
#include "gemv-quant.cuh"

namespace {

enum { QT_Q4_0, QT_Q4_1, QT_Q8_0 };

/* QB: quant bytes a block (QB / 16 chunks of 16 bytes); SB: its scale bytes
 * (d; d and m for Q4_1). QB + SB is the GGUF block, scales first there. */
template <int QT> struct qtype;
template <> struct qtype<QT_Q4_0> { static constexpr int QB = 16, SB = 2; };
template <> struct qtype<QT_Q4_1> { static constexpr int QB = 16, SB = 4; };
template <> struct qtype<QT_Q8_0> { static constexpr int QB = 32, SB = 2; };

int qt_of(uint32_t type)
{
    switch (type) {
    case TKV_TYPE_Q4_0: return QT_Q4_0;
    case TKV_TYPE_Q4_1: return QT_Q4_1;
    case TKV_TYPE_Q8_0: return QT_Q8_0;
    default: return -1;
    }
}

uint32_t quant_bytes(int qt) { return qt == QT_Q8_0 ? 32 : 16; }
uint32_t scale_bytes(int qt) { return qt == QT_Q4_1 ? 4 : 2; }

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

__device__ __forceinline__ uint32_t u4_word(const uint4 &v, int k)
{
    return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w;
}

/* One weight block, unpacked: d (and m for Q4_1) widened to f32, the quant
 * bytes as words (Q4: 4 words of nibble pairs; Q8_0: 8 words). */
struct wblock {
    float d, m;
    uint32_t q[8];
};

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
            s = __dp4a((int)w.q[k], (int)(k < 4 ? u4_word(a0, k) : u4_word(a1, k - 4)), s);
        return __fmul_rn(__fmul_rn(w.d, da), (float)s);
    } else {
        /* qs[j] & 15 is element j, qs[j] >> 4 element j + 16 */
#pragma unroll
        for (int k = 0; k < 4; k++) {
            s = __dp4a((int)(w.q[k] & 0x0F0F0F0Fu), (int)u4_word(a0, k), s);
            s = __dp4a((int)((w.q[k] >> 4) & 0x0F0F0F0Fu), (int)u4_word(a1, k), s);
        }
        if constexpr (QT == QT_Q4_0) { /* sum((q - 8) * a) */
            return __fmul_rn(__fmul_rn(w.d, da), (float)(s - 8 * asum));
        } else {
            const float sa = __half2float(__ushort_as_half((unsigned short)(md >> 16)));
            return __fadd_rn(__fmul_rn(__fmul_rn(w.d, da), (float)s), __fmul_rn(w.m, sa));
        }
    }
}

/* ---- the packed layout ------------------------------------------------------------------
 *
 * A packed matrix of rows x nb blocks at w: the quants of block k = r nb + b
 * at w + k QB, its scales at w + rows nb QB + k SB (16-byte aligned quants,
 * scales aligned to SB). */

__global__ void pack_kernel(const uint8_t *__restrict__ src, uint8_t *__restrict__ dst, size_t blocks, uint32_t qb,
                            uint32_t sb)
{
    const size_t k = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (k >= blocks)
        return;
    const uint8_t *blk = src + k * (qb + sb);
    uint8_t *q = dst + k * qb, *sc = dst + blocks * qb + k * sb;
    for (uint32_t j = 0; j < sb; j++)
        sc[j] = blk[j];
    for (uint32_t j = 0; j < qb; j++)
        q[j] = blk[sb + j];
}

/* Block k's scales of a packed matrix of `blocks` blocks at w: d, and m
 * for Q4_1 (0 otherwise). */
template <int QT>
__device__ __forceinline__ float2 block_scales(const void *w, size_t blocks, size_t k)
{
    using Q = qtype<QT>;
    const uint8_t *sc = (const uint8_t *)w + blocks * Q::QB + k * Q::SB;
    if constexpr (QT == QT_Q4_1)
        return __half22float2(*(const __half2 *)sc);
    return make_float2(__half2float(*(const __half *)sc), 0.0f);
}

/* What a unit (a warp) computes: one row (PLAIN), one row of the gate and
 * of the up matrix (SWIGLU), or two adjacent rows of one weight (PAIR:
 * every weight's row count even). SWIGLU and PAIR stream two rows and use
 * each activation load for both. */
enum { MODE_PLAIN, MODE_SWIGLU, MODE_PAIR };

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

/* ---- the kernel -------------------------------------------------------------------------
 *
 * A unit (one row, a row pair, or a gate and an up row: R rows) is one
 * warp. Lane j reads blocks j, j + 32, ... of the unit's rows straight into
 * registers (their QB / 16 chunks: .nc loads not kept in L1, and their
 * scales), U blocks a row at a time while the next U load; the activations,
 * in the plain block order (gb = 1), come through L1, each load serving the
 * unit's rows. The first U are loaded before griddepcontrol.wait (weights:
 * written by no kernel). No shared memory and no barrier, so a CTA's slot
 * frees as soon as its warps end. A lane adds its blocks' terms in order
 * and the warp sums its lanes by an xor butterfly, as the reference kernel
 * does: every mode gives the reference's bits. gpu/probe/packed-probe.cu
 * measured the design (docs/benchmarks.md, "Session 45"). */

constexpr uint32_t QG_WARPS = 8; /* warps (units) a CTA, at most and by default */

template <int QT, int NT, int U, int MODE>
__global__ void __launch_bounds__(QG_WARPS * 32)
    qgemv_kernel(const struct tkv_cuda_qgemv g, const int8_t *__restrict__ aq,
                 const struct tkv_cuda_q8_meta *__restrict__ am, uint32_t n_in)
{
    using Q = qtype<QT>;
    constexpr int QC = Q::QB / 16; /* chunks a block */
    constexpr bool TWO = MODE != MODE_PLAIN;
    constexpr int R = TWO ? 2 : 1;
    tkv_pdl_trigger();
    const uint32_t lane = threadIdx.x % 32, nb = n_in / 32;
    const uint32_t unit = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const uint32_t row = MODE == MODE_PAIR ? 2 * unit : unit, total = g.end[g.nw - 1];
    uint32_t seg = 0;
    while (seg + 1 < g.nw && row >= g.end[seg])
        seg++;
    const bool live = row < total; /* the same for the whole warp */
    const uint32_t first = seg ? g.end[seg - 1] : 0, local = live ? row - first : 0;
    const size_t blocks = (size_t)(g.end[seg] - first) * nb; /* the weight's */
    const void *wr[R];    /* the rows' matrices */
    size_t k0[R];         /* and their first blocks */
    wr[0] = g.w[seg];
    k0[0] = (size_t)local * nb;
    if constexpr (TWO) {
        wr[1] = MODE == MODE_SWIGLU ? g.wu : g.w[seg];
        k0[1] = MODE == MODE_SWIGLU ? k0[0] : k0[0] + nb;
    }
    uint4 wq[R][U][QC], nq[R][U][QC];
    float2 ws[R][U], ns[R][U];
    auto load = [&](uint32_t b0, uint4 (&q)[R][U][QC], float2 (&sc)[R][U]) {
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int u = 0; u < U; u++) {
                const uint32_t b = b0 + u * 32 + lane;
                const bool ok = live && b < nb;
                const uint4 *src = (const uint4 *)wr[r] + (k0[r] + b) * QC;
#pragma unroll
                for (int c = 0; c < QC; c++)
                    q[r][u][c] = ok ? tkv_ld_stream16(src + c) : make_uint4(0, 0, 0, 0);
                sc[r][u] = ok ? block_scales<QT>(wr[r], blocks, k0[r] + b) : make_float2(0.0f, 0.0f);
            }
    };
    load(0, wq, ws);
    tkv_pdl_wait();
    float acc[R][NT];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int i = 0; i < NT; i++)
            acc[r][i] = 0.0f;
    for (uint32_t b0 = 0; live && b0 < nb; b0 += 32 * U) {
        if (b0 + 32 * U < nb)
            load(b0 + 32 * U, nq, ns);
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
                    w.d = ws[r][u].x;
                    w.m = ws[r][u].y;
#pragma unroll
                    for (int k = 0; k < 8; k++)
                        w.q[k] = k < 4 * QC ? u4_word(wq[r][u][k / 4 < QC ? k / 4 : 0], k % 4) : 0u;
                    acc[r][i] = __fadd_rn(acc[r][i], block_term<QT>(w, a0, a1, m.x, (int)m.y));
                }
            }
        }
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int u = 0; u < U; u++) {
#pragma unroll
                for (int c = 0; c < QC; c++)
                    wq[r][u][c] = nq[r][u][c];
                ws[r][u] = ns[r][u];
            }
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

template <int QT, int NT, int U, int MODE>
cudaError_t qgemv_launch(const struct tkv_cuda_qgemv *g, struct tkv_cuda_q8_act a, uint32_t n_in, uint32_t units,
                         bool pdl, cudaStream_t s)
{
    const uint32_t warps = g->warps ? g->warps : QG_WARPS;
    if (warps > QG_WARPS)
        return cudaErrorInvalidConfiguration;
    return tkv_cuda_launch(pdl, tkv_cuda_blocks(units, warps), warps * 32, 0, s, qgemv_kernel<QT, NT, U, MODE>, *g,
                           (const int8_t *)a.q, (const struct tkv_cuda_q8_meta *)a.meta, n_in);
}

/* Blocks a lane and row in flight: chunks (16 bytes) of them, 4 where the
 * grid is small (2048 units or fewer: Llama-3-8B's wo and down in pairs)
 * and a unit has one or two tokens, else 2 (more tokens: registers). */
template <int QT, int NT, int MODE>
cudaError_t qgemv_pick_u(const struct tkv_cuda_qgemv *g, struct tkv_cuda_q8_act a, uint32_t n_in, uint32_t units,
                         bool pdl, cudaStream_t s)
{
    constexpr int QC = qtype<QT>::QB / 16;
    const uint32_t chunks = g->chunks ? g->chunks : units <= 2048 && NT <= 2 ? 4 : 2;
    switch (chunks) {
    case 2: return qgemv_launch<QT, NT, 2 / QC, MODE>(g, a, n_in, units, pdl, s);
    case 4: return qgemv_launch<QT, NT, 4 / QC, MODE>(g, a, n_in, units, pdl, s);
    default: return cudaErrorInvalidValue;
    }
}

template <int QT, int MODE>
cudaError_t qgemv_pick_n(const struct tkv_cuda_qgemv *g, struct tkv_cuda_q8_act a, uint32_t n_in, uint32_t units,
                         uint32_t n, bool pdl, cudaStream_t s)
{
    switch (n) {
    case 1: return qgemv_pick_u<QT, 1, MODE>(g, a, n_in, units, pdl, s);
    case 2: return qgemv_pick_u<QT, 2, MODE>(g, a, n_in, units, pdl, s);
    case 3: return qgemv_pick_u<QT, 3, MODE>(g, a, n_in, units, pdl, s);
    case 4: return qgemv_pick_u<QT, 4, MODE>(g, a, n_in, units, pdl, s);
    case 5: return qgemv_pick_u<QT, 5, MODE>(g, a, n_in, units, pdl, s);
    case 6: return qgemv_pick_u<QT, 6, MODE>(g, a, n_in, units, pdl, s);
    case 7: return qgemv_pick_u<QT, 7, MODE>(g, a, n_in, units, pdl, s);
    case 8: return qgemv_pick_u<QT, 8, MODE>(g, a, n_in, units, pdl, s);
    default: return cudaErrorInvalidValue;
    }
}

template <int QT>
cudaError_t qgemv_pick_mode(int mode, const struct tkv_cuda_qgemv *g, struct tkv_cuda_q8_act a, uint32_t n_in,
                            uint32_t units, uint32_t n, bool pdl, cudaStream_t s)
{
    switch (mode) {
    case MODE_SWIGLU: return qgemv_pick_n<QT, MODE_SWIGLU>(g, a, n_in, units, n, pdl, s);
    case MODE_PAIR: return qgemv_pick_n<QT, MODE_PAIR>(g, a, n_in, units, n, pdl, s);
    default: return qgemv_pick_n<QT, MODE_PLAIN>(g, a, n_in, units, n, pdl, s);
    }
}

/* ---- the reference: one warp per row, a lane per block, byte loads ------------------ */

template <int QT>
__global__ void qgemv_ref_kernel(const uint8_t *w, const int8_t *aq, const struct tkv_cuda_q8_meta *am, uint32_t gb,
                                 float *y, uint32_t n_in, uint32_t n_out, uint32_t n)
{
    const uint32_t row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= n_out)
        return;
    const uint32_t nb = n_in / 32;
    for (uint32_t i = 0; i < n; i++) {
        float acc = 0.0f;
        for (uint32_t kb = lane; kb < nb; kb += 32) {
            const size_t k = (size_t)row * nb + kb;
            const uint8_t *qs = w + k * qtype<QT>::QB; /* the packed layout */
            const float2 sc = block_scales<QT>(w, (size_t)n_out * nb, k);
            const uint32_t pos = tkv_q8_pos(kb, nb, gb);
            const int8_t *a = aq + (size_t)i * n_in + (size_t)pos * 32;
            const struct tkv_cuda_q8_meta m = am[(size_t)i * nb + pos];
            const float da = __half2float(m.d);
            int s = 0;
            float term;
            if (QT == QT_Q8_0) {
                for (int j = 0; j < 32; j++)
                    s += (int8_t)qs[j] * a[j];
                term = __fmul_rn(__fmul_rn(sc.x, da), (float)s);
            } else if (QT == QT_Q4_0) {
                for (int j = 0; j < 16; j++)
                    s += ((qs[j] & 15) - 8) * a[j] + ((qs[j] >> 4) - 8) * a[j + 16];
                term = __fmul_rn(__fmul_rn(sc.x, da), (float)s);
            } else {
                for (int j = 0; j < 16; j++)
                    s += (qs[j] & 15) * a[j] + (qs[j] >> 4) * a[j + 16];
                term = __fadd_rn(__fmul_rn(__fmul_rn(sc.x, da), (float)s), __fmul_rn(sc.y, __half2float(m.s)));
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
    (void)type, (void)n_in;
    return 1; /* the kernels' lanes read consecutive blocks */
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
    return qt_of(type) >= 0 && n_in % 32 == 0 && (uintptr_t)w % 16 == 0;
}

size_t tkv_cuda_qgemv_packed_bytes(uint32_t type, size_t blocks)
{
    const int qt = qt_of(type);
    return qt < 0 ? 0 : blocks * (quant_bytes(qt) + scale_bytes(qt));
}

cudaError_t tkv_cuda_qgemv_pack(uint32_t type, const void *gguf, void *dst, size_t blocks, cudaStream_t s)
{
    const int qt = qt_of(type);
    if (qt < 0 || (uintptr_t)dst % 16)
        return cudaErrorInvalidValue;
    if (blocks == 0)
        return cudaSuccess;
    pack_kernel<<<tkv_cuda_blocks(blocks, 256), 256, 0, s>>>((const uint8_t *)gguf, (uint8_t *)dst, blocks,
                                                              quant_bytes(qt), scale_bytes(qt));
    TKV_CUDA_LAUNCHED();
    return cudaSuccess;
}

cudaError_t tkv_cuda_qgemv(uint32_t type, const struct tkv_cuda_qgemv *g, struct tkv_cuda_q8_act a, uint32_t n_in,
                           uint32_t n, bool pdl, cudaStream_t s)
{
    const int qt = qt_of(type);
    if (qt < 0 || g->nw == 0 || g->nw > TKV_CUDA_QGEMV_MAX || (g->swiglu && (g->nw != 1 || g->acc)) || a.gb != 1)
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
    bool pair = (g->pair || g->rope) && !g->swiglu; /* RoPE: a pair's rows in one warp */
    for (uint32_t i = 0; i < g->nw; i++)
        pair = pair && g->end[i] % 2 == 0; /* a pair never straddles two weights */
    if (g->rope && !pair)
        return cudaErrorInvalidValue;
    const int mode = g->swiglu ? MODE_SWIGLU : pair ? MODE_PAIR : MODE_PLAIN;
    const uint32_t units = pair ? rows / 2 : rows;
    switch (qt) {
    case QT_Q4_0: return qgemv_pick_mode<QT_Q4_0>(mode, g, a, n_in, units, n, pdl, s);
    case QT_Q4_1: return qgemv_pick_mode<QT_Q4_1>(mode, g, a, n_in, units, n, pdl, s);
    default: return qgemv_pick_mode<QT_Q8_0>(mode, g, a, n_in, units, n, pdl, s);
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
