/* ops.cu -- see ops.cuh. */
#include "ops.cuh"
#include <stdlib.h>

namespace {

/* ---- RMSNorm: one CTA per row ------------------------------------------------ */

/* The CTA's sum of every thread's v, in a fixed order (warps, then their
 * partial sums): the same bits on every run. partial: 32 doubles of shared
 * memory; every thread gets the sum. */
__device__ double row_sum(double v, double *partial)
{
    v = tkv_warp_sum_d(v);
    const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32, n_warps = blockDim.x / 32;
    if (lane == 0)
        partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < n_warps ? partial[lane] : 0.0;
        v = tkv_warp_sum_d(v);
        if (lane == 0)
            partial[0] = v;
    }
    __syncthreads();
    return partial[0];
}

/* 1 / sqrt(mean(xr^2) + eps) of a row of dim, the squares summed in double
 * in the same order by every CTA of the same blockDim (rmsnorm_kernel and
 * rmsnorm_q8_kernel: the same bits). Every thread of the CTA calls it. */
__device__ float rms_scale(const float *xr, uint32_t dim, float eps, double *partial)
{
    double ss = 0;
    for (uint32_t d = threadIdx.x; d < dim; d += blockDim.x)
        ss += (double)xr[d] * xr[d];
    return 1.0f / sqrtf((float)(row_sum(ss, partial) / dim) + eps);
}

/* threads a CTA of the rmsnorm kernels has for rows of dim */
static unsigned rmsnorm_threads(uint32_t dim) { return dim >= 1024 ? 1024 : (dim + 31) / 32 * 32; }

__global__ void rmsnorm_kernel(const float *x, const float *w, float *y, uint32_t dim, float eps)
{
    __shared__ double partial[32];
    tkv_pdl_trigger();
    tkv_pdl_wait();
    const float *xr = x + (size_t)blockIdx.x * dim;
    float *yr = y + (size_t)blockIdx.x * dim;
    const float scale = rms_scale(xr, dim, eps, partial);
    /* each thread reads x[d] before writing y[d]: y may alias x */
    for (uint32_t d = threadIdx.x; d < dim; d += blockDim.x)
        yr[d] = xr[d] * scale * w[d];
}

/* rmsnorm_kernel and the activations' quantization (q8_quantize_kernel,
 * gemv-quant.cu) in one grid, for a decode step's norm whose output feeds a
 * quantized GEMV: CTA (c, t) has rmsnorm_kernel's threads, so it sums token
 * t's squares in that kernel's order and gets its scale bit for bit, then
 * normalizes blocks [c W, c W + W) of the row (W = its warps, a warp a
 * 32-element block), writes them to y and quantizes them into a. Every CTA
 * reads the whole row and writes only its blocks: y must not alias x. */
__global__ void rmsnorm_q8_kernel(const float *__restrict__ x, const float *__restrict__ w, float *__restrict__ y,
                                  uint32_t dim, float eps, struct tkv_cuda_q8_act a)
{
    __shared__ double partial[32];
    tkv_pdl_trigger();
    const uint32_t nb = dim / 32, kb = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    const uint32_t d = kb * 32 + lane;
    /* the norm's weight is no kernel's output: read before the wait, its
     * round trip overlaps the previous kernel's tail */
    const float wd = kb < nb ? w[d] : 0.0f;
    tkv_pdl_wait(); /* x is the previous kernel's output; a may still be read by it */
    const float *xr = x + (size_t)blockIdx.y * dim;
    const float scale = rms_scale(xr, dim, eps, partial);
    if (kb >= nb)
        return;
    const float v = xr[d] * scale * wd;
    y[(size_t)blockIdx.y * dim + d] = v;
    tkv_q8_block_put(tkv_q8_block_of(v), lane, a, (size_t)blockIdx.y * nb + tkv_q8_pos(kb, nb, a.gb));
}

/* ---- RoPE: one thread per (token, head, rotated pair) -------------------------------- */

/* Item i = (token, head, rotated pair), pairs fastest: a decode step's
 * query is n_heads x n_pairs threads (2048 for Llama-3-8B) rather than
 * n_pairs threads each walking every head (64 threads: 11 us per call on an
 * H200). Each thread derives its angle by the CPU's sequence of roundings
 * (tkv_rope_cs, gemv-common.cuh) and rotates with tkv_rope_rotate, as the
 * quantized GEMV's epilogue does. rope_kernel and rope_qk_kernel both
 * rotate through it. */
__device__ __forceinline__ void rope_item(float *x, uint32_t n_heads, uint32_t head_dim, uint32_t n_pairs, size_t i,
                                          const int32_t *pos, float theta_scale, float freq_scale)
{
    const uint32_t p = (uint32_t)(i % n_pairs), h = (uint32_t)(i / n_pairs % n_heads);
    const uint32_t t = (uint32_t)(i / n_pairs / n_heads);
    float *v = x + ((size_t)t * n_heads + h) * head_dim + 2 * p;
    tkv_rope_rotate(v[0], v[1], tkv_rope_cs(pos[t], p, theta_scale, freq_scale), &v[0], &v[1]);
}

/* table[t][p] = tkv_rope_cs(pos[t], p, ...) for t < n, p < n_pairs */
__global__ void rope_table_kernel(const int32_t *pos, uint32_t n, uint32_t n_pairs, float theta_scale,
                                  float freq_scale, float2 *table)
{
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    tkv_pdl_trigger();
    tkv_pdl_wait(); /* the table may still be read by the kernels before */
    if (i < (size_t)n * n_pairs)
        table[i] = tkv_rope_cs(pos[i / n_pairs], (uint32_t)(i % n_pairs), theta_scale, freq_scale);
}

__global__ void rope_kernel(float *x, uint32_t n, uint32_t n_heads, uint32_t head_dim, uint32_t n_pairs,
                            const int32_t *pos, float theta_scale, float freq_scale)
{
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < (size_t)n * n_heads * n_pairs)
        rope_item(x, n_heads, head_dim, n_pairs, i, pos, theta_scale, freq_scale);
}

__global__ void swiglu_kernel(const float *gate, const float *up, float *out, size_t count)
{
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count)
        return;
    const float g = gate[i];
    out[i] = g / (1.0f + expf(-g)) * up[i];
}

__global__ void add_kernel(float *y, const float *x, size_t count)
{
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count)
        y[i] += x[i];
}

__global__ void kv_write_kernel(const float *src, size_t stride, uint16_t *dst, uint32_t n_rows, uint32_t hd)
{
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)n_rows * hd)
        return;
    const size_t r = i / hd, d = i % hd;
    dst[i] = __half_as_ushort(__float2half_rn(src[r * stride + d]));
}

/* i runs over [K or V][head][row][dim]: consecutive threads write consecutive
 * f16 of one destination row */
__global__ void kv_write_heads_kernel(const float *k, const float *v, size_t stride, struct tkv_cuda_kv_dst dst,
                                      uint32_t n_heads, uint32_t n_rows, uint32_t hd)
{
    const size_t per_head = (size_t)n_rows * hd, per_side = per_head * n_heads;
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    tkv_pdl_trigger();
    tkv_pdl_wait();
    if (i >= 2 * per_side)
        return;
    const bool is_v = i >= per_side;
    const size_t j = is_v ? i - per_side : i;
    const uint32_t h = (uint32_t)(j / per_head);
    const size_t e = j % per_head, r = e / hd, d = e % hd;
    const float *src = is_v ? v : k;
    uint16_t *out = is_v ? dst.v[h] : dst.k[h];
    out[e] = __half_as_ushort(__float2half_rn(src[r * stride + (size_t)h * hd + d]));
}

__device__ __forceinline__ float to_f32(__half h) { return __half2float(h); }
__device__ __forceinline__ float to_f32(float f) { return f; }

template <typename T>
__global__ void get_rows_kernel(const T *w, uint32_t n_in, const int32_t *ids, uint32_t n, float *out)
{
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)n * n_in)
        return;
    const size_t r = i / n_in, d = i % n_in;
    out[i] = to_f32(w[(size_t)ids[r] * n_in + d]);
}

__global__ void f32_to_f16_kernel(const float *x, __half *y, size_t count)
{
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count)
        return;
    float v = x[i];
    if (fabsf(v) > 65504.0f) /* false for NaN */
        v = copysignf(65504.0f, v);
    y[i] = __float2half_rn(v);
}

/* ---- GEMV, the reference: one warp per output row, 8 rows per CTA ----------------- */

constexpr int GEMV_WARPS = 8;

/* acc[i] += the dot product of 8 f16 weights (raw) with the 8 activations
 * of token i at index 8k .. 8k+7: the arithmetic both GEMV kernels share. */
template <int NT>
__device__ __forceinline__ void gemv_dot8(const uint4 raw, const float *x, uint32_t n_in, uint32_t k, float *acc)
{
    const __half2 *h2 = (const __half2 *)&raw;
    float wf[8];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const float2 f = __half22float2(h2[j]);
        wf[2 * j] = f.x;
        wf[2 * j + 1] = f.y;
    }
#pragma unroll
    for (int i = 0; i < NT; i++) {
        const float4 *xr = (const float4 *)(x + (size_t)i * n_in) + 2 * k;
        const float4 a = __ldg(xr), b = __ldg(xr + 1);
        acc[i] += wf[0] * a.x + wf[1] * a.y + wf[2] * a.z + wf[3] * a.w + wf[4] * b.x + wf[5] * b.y + wf[6] * b.z +
                  wf[7] * b.w;
    }
}

template <int NT>
__global__ void __launch_bounds__(GEMV_WARPS * 32)
    gemv_kernel(const __half *w, const float *x, float *y, uint32_t n_in, uint32_t n_out)
{
    const uint32_t lane = threadIdx.x % 32;
    const uint32_t row = blockIdx.x * GEMV_WARPS + threadIdx.x / 32;
    if (row >= n_out)
        return;
    const uint4 *w8 = (const uint4 *)(w + (size_t)row * n_in);
    const uint32_t n8 = n_in / 8;
    float acc[NT];
#pragma unroll
    for (int i = 0; i < NT; i++)
        acc[i] = 0.0f;
    for (uint32_t k = lane; k < n8; k += 32)
        gemv_dot8<NT>(__ldg(w8 + k), x, n_in, k, acc);
#pragma unroll
    for (int i = 0; i < NT; i++) {
        const float s = tkv_warp_sum(acc[i]);
        if (lane == 0)
            y[(size_t)i * n_out + row] = s;
    }
}

template <int NT>
cudaError_t gemv_launch(const __half *w, const float *x, float *y, uint32_t n_in, uint32_t n_out, cudaStream_t s)
{
    gemv_kernel<NT><<<tkv_cuda_blocks(n_out, GEMV_WARPS), GEMV_WARPS * 32, 0, s>>>(w, x, y, n_in, n_out);
    TKV_CUDA_LAUNCHED();
    return cudaSuccess;
}

/* ---- GEMV with more bytes in flight ----------------------------------------------
 *
 * The kernel above keeps one 16-byte load per lane in flight: 8 warps x 512
 * bytes = 4 KiB per CTA. Decode reads each weight once, so the GEMV is a
 * stream from HBM, and an H200 needs ~25-30 KiB in flight per SM (4.8 TB/s
 * x ~0.7 us of latency / 132 SMs) to keep it busy; with n_out = 1024 (wk,
 * wv of Llama-3-8B) the kernel above has 128 CTAs, under one per SM.
 *
 * Here each lane issues U independent 16-byte weight loads before it uses
 * any (predicated, so any n_in % 8 == 0 works), and a row can be split over
 * S warps of the CTA (split-K inside the CTA, partial sums combined through
 * shared memory in warp order) when there are too few rows to fill the
 * GPU. A CTA is 8 warps: 8 / S rows. Weights bypass L1 (read once); the f32
 * activations, re-read by every row, go through the read-only cache. */
constexpr int GEMV2_U = 4;

__device__ __forceinline__ uint4 ld_stream(const uint4 *p)
{
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
    return r;
}

/* Thread t's share of one row (T threads on the row): chunks k = t, t + T,
 * ..., U loads issued before any is used; acc[i] += token i's products. The
 * grouped and SwiGLU kernels below run the same sequence, so a row's sums
 * are the plain kernel's, bit for bit, at the same S.
 *
 * Split in three so that a kernel can issue its first round of loads
 * (gemv2_load at k0 = t) before tkv_pdl_wait: weights are written at load
 * and by no kernel, so under a programmatic dependent launch those loads
 * overlap the previous kernel's tail. gemv2_row then goes on from there;
 * the order of the products is the same either way. */
template <uint32_t T, int U>
__device__ __forceinline__ void gemv2_load(const uint4 *w8, uint32_t n8, uint32_t k0, uint4 *raw)
{
#pragma unroll
    for (int u = 0; u < U; u++) {
        const uint32_t k = k0 + u * T;
        raw[u] = k < n8 ? ld_stream(w8 + k) : make_uint4(0, 0, 0, 0);
    }
}

template <int NT, uint32_t T, int U>
__device__ __forceinline__ void gemv2_use(const uint4 *raw, const float *x, uint32_t n_in, uint32_t n8, uint32_t k0,
                                          float *acc)
{
#pragma unroll
    for (int u = 0; u < U; u++) {
        const uint32_t k = k0 + u * T;
        if (k >= n8)
            break;
        gemv_dot8<NT>(raw[u], x, n_in, k, acc);
    }
}

/* first: the round at k0 = t, from gemv2_load */
template <int NT, uint32_t T, int U = GEMV2_U>
__device__ __forceinline__ void gemv2_row(const uint4 *w8, const float *x, uint32_t n_in, uint32_t n8, uint32_t t,
                                          const uint4 *first, float *acc)
{
    gemv2_use<NT, T, U>(first, x, n_in, n8, t, acc);
    for (uint32_t k0 = t + T * U; k0 < n8; k0 += T * U) {
        uint4 raw[U];
        gemv2_load<T, U>(w8, n8, k0, raw);
        gemv2_use<NT, T, U>(raw, x, n_in, n8, k0, acc);
    }
}

/* gemv2_row over two rows (gate and up) at once: 2U loads in flight, each
 * row's accumulators in gemv2_row's order; first_a, first_b as for
 * gemv2_row. */
template <int NT, uint32_t T>
__device__ __forceinline__ void gemv2_row2(const uint4 *wa, const uint4 *wb, const float *x, uint32_t n_in,
                                           uint32_t n8, uint32_t t, const uint4 *first_a, const uint4 *first_b,
                                           float *acc_a, float *acc_b)
{
    gemv2_use<NT, T, GEMV2_U>(first_a, x, n_in, n8, t, acc_a);
    gemv2_use<NT, T, GEMV2_U>(first_b, x, n_in, n8, t, acc_b);
    for (uint32_t k0 = t + T * GEMV2_U; k0 < n8; k0 += T * GEMV2_U) {
        uint4 ra[GEMV2_U], rb[GEMV2_U];
#pragma unroll
        for (int u = 0; u < GEMV2_U; u++) {
            const uint32_t k = k0 + u * T;
            ra[u] = k < n8 ? ld_stream(wa + k) : make_uint4(0, 0, 0, 0);
            rb[u] = k < n8 ? ld_stream(wb + k) : make_uint4(0, 0, 0, 0);
        }
        gemv2_use<NT, T, GEMV2_U>(ra, x, n_in, n8, k0, acc_a);
        gemv2_use<NT, T, GEMV2_U>(rb, x, n_in, n8, k0, acc_b);
    }
}

template <int NT, int S, int U>
__global__ void __launch_bounds__(GEMV_WARPS * 32)
    gemv2_kernel(const __half *__restrict__ w, const float *__restrict__ x, float *__restrict__ y, uint32_t n_in,
                 uint32_t n_out, bool add)
{
    constexpr int ROWS = GEMV_WARPS / S;
    constexpr uint32_t T = 32 * S; /* threads on one row */
    __shared__ float part[GEMV_WARPS][NT];
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const uint32_t r_local = warp / S, t = (warp % S) * 32 + lane;
    const uint32_t row = blockIdx.x * ROWS + r_local;
    const uint32_t n8 = n_in / 8;
    const uint4 *w8 = (const uint4 *)(w + (size_t)row * n_in);
    tkv_pdl_trigger();
    uint4 first[U];
    gemv2_load<T, U>(w8, row < n_out ? n8 : 0, t, first);
    tkv_pdl_wait(); /* x is the previous kernel's output; y may be read by it */
    /* with add, the thread that writes y[lane][row] (tkv_row_reduce: lane <
     * NT of the row's first warp) reads it now, not after the row's sum */
    float *yr = y + (size_t)lane * n_out + row;
    const float y_old = add && row < n_out && warp % S == 0 && lane < (uint32_t)NT ? *yr : 0.0f;
    float acc[NT];
#pragma unroll
    for (int i = 0; i < NT; i++)
        acc[i] = 0.0f;
    if (row < n_out) /* no early return: the CTA meets at the barrier in tkv_row_reduce */
        gemv2_row<NT, T, U>(w8, x, n_in, n8, t, first, acc);
    float v;
    if (tkv_row_reduce<NT, T>(acc, &part[0][0], warp, lane, &v) && row < n_out)
        *yr = add ? y_old + v : v; /* y + x, as the add kernel adds */
}

template <int NT, int S, int U>
cudaError_t gemv2_launch(const __half *w, const float *x, float *y, uint32_t n_in, uint32_t n_out, bool add,
                         bool pdl, cudaStream_t s)
{
    return tkv_cuda_launch(pdl, tkv_cuda_blocks(n_out, GEMV_WARPS / S), GEMV_WARPS * 32, 0, s,
                           gemv2_kernel<NT, S, U>, w, x, y, n_in, n_out, add);
}

template <int NT, int U>
cudaError_t gemv2_pick(const __half *w, const float *x, float *y, uint32_t n_in, uint32_t n_out, uint32_t S,
                       bool add, bool pdl, cudaStream_t s)
{
    switch (S) {
    case 1: return gemv2_launch<NT, 1, U>(w, x, y, n_in, n_out, add, pdl, s);
    case 2: return gemv2_launch<NT, 2, U>(w, x, y, n_in, n_out, add, pdl, s);
    case 4: return gemv2_launch<NT, 4, U>(w, x, y, n_in, n_out, add, pdl, s);
    case 8: return gemv2_launch<NT, 8, U>(w, x, y, n_in, n_out, add, pdl, s);
    default: return cudaErrorInvalidValue;
    }
}

template <int U>
cudaError_t gemv2_n(const __half *w, const float *x, float *y, uint32_t n_in, uint32_t n_out, uint32_t n, uint32_t S,
                    bool add, bool pdl, cudaStream_t s)
{
    switch (n) {
    case 1: return gemv2_pick<1, U>(w, x, y, n_in, n_out, S, add, pdl, s);
    case 2: return gemv2_pick<2, U>(w, x, y, n_in, n_out, S, add, pdl, s);
    case 3: return gemv2_pick<3, U>(w, x, y, n_in, n_out, S, add, pdl, s);
    case 4: return gemv2_pick<4, U>(w, x, y, n_in, n_out, S, add, pdl, s);
    case 5: return gemv2_pick<5, U>(w, x, y, n_in, n_out, S, add, pdl, s);
    case 6: return gemv2_pick<6, U>(w, x, y, n_in, n_out, S, add, pdl, s);
    case 7: return gemv2_pick<7, U>(w, x, y, n_in, n_out, S, add, pdl, s);
    case 8: return gemv2_pick<8, U>(w, x, y, n_in, n_out, S, add, pdl, s);
    default: return cudaErrorInvalidValue;
    }
}

/* ---- grouped GEMV: several weights sharing x, one grid over their rows ---------
 *
 * Row r of the concatenation belongs to the weight whose rows end first
 * after it (g.end); its CTA computes it as gemv2_kernel would a row of that
 * weight. One launch instead of nw, and the small matrices (k, v) no longer
 * run their own tail: the grid is sized for the sum of the rows. */
template <int NT, int S>
__global__ void __launch_bounds__(GEMV_WARPS * 32)
    gemv_group_kernel(const struct tkv_cuda_gemv_group g, const float *__restrict__ x, uint32_t n_in)
{
    constexpr int ROWS = GEMV_WARPS / S;
    constexpr uint32_t T = 32 * S;
    __shared__ float part[GEMV_WARPS][NT];
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const uint32_t row = blockIdx.x * ROWS + warp / S, t = (warp % S) * 32 + lane;
    const uint32_t total = g.end[g.nw - 1];
    uint32_t seg = 0;
    while (seg + 1 < g.nw && row >= g.end[seg])
        seg++;
    const uint32_t first = seg ? g.end[seg - 1] : 0, n_out = g.end[seg] - first, local = row - first;
    const uint32_t n8 = n_in / 8;
    const uint4 *w8 = (const uint4 *)(g.w[seg] + (size_t)local * n_in);
    tkv_pdl_trigger();
    uint4 first_round[GEMV2_U];
    gemv2_load<T, GEMV2_U>(w8, row < total ? n8 : 0, t, first_round);
    tkv_pdl_wait();
    float acc[NT];
#pragma unroll
    for (int i = 0; i < NT; i++)
        acc[i] = 0.0f;
    if (row < total)
        gemv2_row<NT, T>(w8, x, n_in, n8, t, first_round, acc);
    float v;
    if (tkv_row_reduce<NT, T>(acc, &part[0][0], warp, lane, &v) && row < total)
        g.y[seg][(size_t)lane * n_out + local] = v;
}

/* ---- GEMV of gate and up with SwiGLU: out = silu(x . wg^T) * (x . wu^T) -----------
 *
 * A row's threads stream row r of both matrices (2U loads in flight) and
 * the row's first warp writes silu(g) * u, as swiglu_kernel computes it:
 * the two products never go to memory. */
template <int NT, int S>
__global__ void __launch_bounds__(GEMV_WARPS * 32)
    gemv_swiglu_kernel(const __half *__restrict__ wg, const __half *__restrict__ wu, const float *__restrict__ x,
                       float *__restrict__ out, uint32_t n_in, uint32_t n_out)
{
    constexpr int ROWS = GEMV_WARPS / S;
    constexpr uint32_t T = 32 * S;
    __shared__ float part_g[GEMV_WARPS][NT], part_u[GEMV_WARPS][NT];
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const uint32_t row = blockIdx.x * ROWS + warp / S, t = (warp % S) * 32 + lane;
    const uint32_t n8 = n_in / 8;
    const uint4 *wg8 = (const uint4 *)(wg + (size_t)row * n_in), *wu8 = (const uint4 *)(wu + (size_t)row * n_in);
    tkv_pdl_trigger();
    uint4 first_g[GEMV2_U], first_u[GEMV2_U];
    gemv2_load<T, GEMV2_U>(wg8, row < n_out ? n8 : 0, t, first_g);
    gemv2_load<T, GEMV2_U>(wu8, row < n_out ? n8 : 0, t, first_u);
    tkv_pdl_wait();
    float acc_g[NT], acc_u[NT];
#pragma unroll
    for (int i = 0; i < NT; i++)
        acc_g[i] = acc_u[i] = 0.0f;
    if (row < n_out)
        gemv2_row2<NT, T>(wg8, wu8, x, n_in, n8, t, first_g, first_u, acc_g, acc_u);
    float g, u;
    const bool mine = tkv_row_reduce<NT, T>(acc_g, &part_g[0][0], warp, lane, &g);
    tkv_row_reduce<NT, T>(acc_u, &part_u[0][0], warp, lane, &u);
    if (mine && row < n_out)
        out[(size_t)lane * n_out + row] = g / (1.0f + expf(-g)) * u;
}

template <int NT, int S>
cudaError_t gemv_fused_launch(const struct tkv_cuda_gemv_group *g, const __half *wg, const __half *wu,
                              const float *x, float *out, uint32_t n_in, uint32_t rows, bool pdl, cudaStream_t s)
{
    const unsigned blocks = tkv_cuda_blocks(rows, GEMV_WARPS / S);
    if (g)
        return tkv_cuda_launch(pdl, blocks, GEMV_WARPS * 32, 0, s, gemv_group_kernel<NT, S>, *g, x, n_in);
    return tkv_cuda_launch(pdl, blocks, GEMV_WARPS * 32, 0, s, gemv_swiglu_kernel<NT, S>, wg, wu, x, out, n_in, rows);
}

template <int NT>
cudaError_t gemv_fused_pick(const struct tkv_cuda_gemv_group *g, const __half *wg, const __half *wu, const float *x,
                            float *out, uint32_t n_in, uint32_t rows, uint32_t S, bool pdl, cudaStream_t s)
{
    switch (S) {
    case 1: return gemv_fused_launch<NT, 1>(g, wg, wu, x, out, n_in, rows, pdl, s);
    case 2: return gemv_fused_launch<NT, 2>(g, wg, wu, x, out, n_in, rows, pdl, s);
    case 4: return gemv_fused_launch<NT, 4>(g, wg, wu, x, out, n_in, rows, pdl, s);
    case 8: return gemv_fused_launch<NT, 8>(g, wg, wu, x, out, n_in, rows, pdl, s);
    default: return cudaErrorInvalidValue;
    }
}

/* Either kernel for n tokens: g != NULL the grouped GEMV over g's rows,
 * else gate/up with SwiGLU over `rows` rows. */
cudaError_t gemv_fused(const struct tkv_cuda_gemv_group *g, const __half *wg, const __half *wu, const float *x,
                       float *out, uint32_t n_in, uint32_t rows, uint32_t n, uint32_t S, bool pdl, cudaStream_t s)
{
    switch (n) {
    case 1: return gemv_fused_pick<1>(g, wg, wu, x, out, n_in, rows, S, pdl, s);
    case 2: return gemv_fused_pick<2>(g, wg, wu, x, out, n_in, rows, S, pdl, s);
    case 3: return gemv_fused_pick<3>(g, wg, wu, x, out, n_in, rows, S, pdl, s);
    case 4: return gemv_fused_pick<4>(g, wg, wu, x, out, n_in, rows, S, pdl, s);
    case 5: return gemv_fused_pick<5>(g, wg, wu, x, out, n_in, rows, S, pdl, s);
    case 6: return gemv_fused_pick<6>(g, wg, wu, x, out, n_in, rows, S, pdl, s);
    case 7: return gemv_fused_pick<7>(g, wg, wu, x, out, n_in, rows, S, pdl, s);
    case 8: return gemv_fused_pick<8>(g, wg, wu, x, out, n_in, rows, S, pdl, s);
    default: return cudaErrorInvalidValue;
    }
}

/* ---- residual add + RMSNorm: one CTA per row ------------------------------------------
 * rmsnorm_kernel's loops with the add folded into the first: the same
 * threads own the same elements in both loops, so y[d] is read back by the
 * thread that wrote it and h may alias x (x[d] is read before h[d] is
 * written, by the same thread). */
__global__ void add_rmsnorm_kernel(float *y, const float *x, const float *w, float *h, uint32_t dim, float eps)
{
    __shared__ double partial[32];
    tkv_pdl_trigger();
    tkv_pdl_wait();
    float *yr = y + (size_t)blockIdx.x * dim;
    const float *xr = x + (size_t)blockIdx.x * dim;
    float *hr = h + (size_t)blockIdx.x * dim;
    double ss = 0;
    for (uint32_t d = threadIdx.x; d < dim; d += blockDim.x) {
        const float v = yr[d] + xr[d];
        yr[d] = v;
        ss += (double)v * v;
    }
    const float scale = 1.0f / sqrtf((float)(row_sum(ss, partial) / dim) + eps);
    for (uint32_t d = threadIdx.x; d < dim; d += blockDim.x)
        hr[d] = yr[d] * scale * w[d];
}

/* ---- RoPE of q and k in one launch ------------------------------------------------------
 * Items [0, n*n_head*n_pairs) rotate q, the rest k, each exactly as
 * rope_kernel does (same angle sequence). */

__global__ void rope_qk_kernel(float *q, float *k, uint32_t n, uint32_t n_head, uint32_t n_head_kv, uint32_t head_dim,
                               uint32_t n_pairs, const int32_t *pos, float theta_scale, float freq_scale)
{
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x, n_q = (size_t)n * n_head * n_pairs;
    tkv_pdl_trigger();
    tkv_pdl_wait();
    if (i < n_q)
        rope_item(q, n_head, head_dim, n_pairs, i, pos, theta_scale, freq_scale);
    else if (i - n_q < (size_t)n * n_head_kv * n_pairs)
        rope_item(k, n_head_kv, head_dim, n_pairs, i - n_q, pos, theta_scale, freq_scale);
}

__global__ void fill32_kernel(uint32_t *p, uint32_t v, size_t n)
{
    tkv_pdl_wait(); /* an earlier op may still read p */
    tkv_pdl_trigger();
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        p[i] = v;
}

constexpr unsigned TB = 256;

} // namespace

cudaError_t tkv_cuda_gemv_group(const struct tkv_cuda_gemv_group *g, const float *x, uint32_t n_in, uint32_t n,
                                uint32_t n_sm, bool pdl, cudaStream_t s)
{
    if (g->nw == 0 || g->nw > TKV_CUDA_GEMV_GROUP_MAX)
        return cudaErrorInvalidValue;
    const uint32_t rows = g->end[g->nw - 1];
    if (rows == 0)
        return cudaSuccess;
    return gemv_fused(g, NULL, NULL, x, NULL, n_in, rows, n, tkv_cuda_gemv_split(n_in, rows, n_sm), pdl, s);
}

cudaError_t tkv_cuda_gemv_swiglu(const __half *wg, const __half *wu, const float *x, float *out, uint32_t n_in,
                                 uint32_t n_out, uint32_t n, uint32_t n_sm, bool pdl, cudaStream_t s)
{
    if (n_out == 0)
        return cudaSuccess;
    return gemv_fused(NULL, wg, wu, x, out, n_in, n_out, n, tkv_cuda_gemv_split(n_in, n_out, n_sm), pdl, s);
}

cudaError_t tkv_cuda_add_rmsnorm(float *y, const float *x, const float *w, float *h, uint32_t n, uint32_t dim,
                                 float eps, bool pdl, cudaStream_t s)
{
    if (n == 0)
        return cudaSuccess;
    return tkv_cuda_launch(pdl, n, rmsnorm_threads(dim), 0, s, add_rmsnorm_kernel, y, x, w, h, dim, eps);
}

cudaError_t tkv_cuda_rope_qk(float *q, float *k, uint32_t n, uint32_t n_head, uint32_t n_head_kv, uint32_t head_dim,
                             uint32_t rot_dim, const int32_t *pos, float theta_scale, float freq_scale, bool pdl,
                             cudaStream_t s)
{
    const size_t items = (size_t)n * (n_head + n_head_kv) * (rot_dim / 2);
    if (items == 0)
        return cudaSuccess;
    return tkv_cuda_launch(pdl, tkv_cuda_blocks(items, TB), TB, 0, s, rope_qk_kernel, q, k, n, n_head, n_head_kv,
                           head_dim, rot_dim / 2, pos, theta_scale, freq_scale);
}

cudaError_t tkv_cuda_rope_table(const int32_t *pos, uint32_t n, uint32_t n_pairs, float theta_scale, float freq_scale,
                                float2 *table, bool pdl, cudaStream_t s)
{
    const size_t items = (size_t)n * n_pairs;
    if (items == 0)
        return cudaSuccess;
    return tkv_cuda_launch(pdl, tkv_cuda_blocks(items, TB), TB, 0, s, rope_table_kernel, pos, n, n_pairs, theta_scale,
                           freq_scale, table);
}

cudaError_t tkv_cuda_rmsnorm(const float *x, const float *w, float *y, uint32_t n, uint32_t dim, float eps, bool pdl,
                             cudaStream_t s)
{
    if (n == 0)
        return cudaSuccess;
    return tkv_cuda_launch(pdl, n, rmsnorm_threads(dim), 0, s, rmsnorm_kernel, x, w, y, dim, eps);
}

cudaError_t tkv_cuda_rmsnorm_q8(const float *x, const float *w, float *y, uint32_t n, uint32_t dim, float eps,
                                struct tkv_cuda_q8_act a, bool pdl, cudaStream_t s)
{
    if (dim % 32 || x == y)
        return cudaErrorInvalidValue;
    if (n == 0 || dim == 0)
        return cudaSuccess;
    const unsigned threads = rmsnorm_threads(dim); /* rmsnorm_kernel's: its sums' order */
    const dim3 grid((dim / 32 + threads / 32 - 1) / (threads / 32), n);
    return tkv_cuda_launch(pdl, grid, threads, 0, s, rmsnorm_q8_kernel, x, w, y, dim, eps, a);
}

cudaError_t tkv_cuda_rope(float *x, uint32_t n, uint32_t n_heads, uint32_t head_dim, uint32_t rot_dim,
                          const int32_t *pos, float theta_scale, float freq_scale, cudaStream_t s)
{
    const size_t items = (size_t)n * n_heads * (rot_dim / 2);
    if (items == 0)
        return cudaSuccess;
    rope_kernel<<<tkv_cuda_blocks(items, TB), TB, 0, s>>>(x, n, n_heads, head_dim, rot_dim / 2, pos, theta_scale,
                                                         freq_scale);
    TKV_CUDA_LAUNCHED();
    return cudaSuccess;
}

cudaError_t tkv_cuda_swiglu(const float *gate, const float *up, float *out, size_t count, cudaStream_t s)
{
    if (count == 0)
        return cudaSuccess;
    swiglu_kernel<<<tkv_cuda_blocks(count, TB), TB, 0, s>>>(gate, up, out, count);
    TKV_CUDA_LAUNCHED();
    return cudaSuccess;
}

cudaError_t tkv_cuda_add(float *y, const float *x, size_t count, cudaStream_t s)
{
    if (count == 0)
        return cudaSuccess;
    add_kernel<<<tkv_cuda_blocks(count, TB), TB, 0, s>>>(y, x, count);
    TKV_CUDA_LAUNCHED();
    return cudaSuccess;
}

cudaError_t tkv_cuda_fill32(uint32_t *p, uint32_t v, size_t n, bool pdl, cudaStream_t s)
{
    if (n == 0)
        return cudaSuccess;
    const unsigned blocks = tkv_cuda_blocks(n, TB);
    return tkv_cuda_launch(pdl, blocks < 1024 ? blocks : 1024, TB, 0, s, fill32_kernel, p, v, n);
}

cudaError_t tkv_cuda_kv_write(const float *src, size_t src_stride, uint16_t *dst, uint32_t n_rows, uint32_t head_dim,
                              cudaStream_t s)
{
    const size_t count = (size_t)n_rows * head_dim;
    if (count == 0)
        return cudaSuccess;
    kv_write_kernel<<<tkv_cuda_blocks(count, TB), TB, 0, s>>>(src, src_stride, dst, n_rows, head_dim);
    TKV_CUDA_LAUNCHED();
    return cudaSuccess;
}

cudaError_t tkv_cuda_kv_write_heads(const float *k, const float *v, size_t stride, const struct tkv_cuda_kv_dst *dst,
                                    uint32_t n_heads, uint32_t n_rows, uint32_t head_dim, bool pdl, cudaStream_t s)
{
    const size_t count = 2 * (size_t)n_heads * n_rows * head_dim;
    if (count == 0)
        return cudaSuccess;
    if (n_heads > TKV_CUDA_KV_HEADS_MAX)
        return cudaErrorInvalidValue;
    return tkv_cuda_launch(pdl, tkv_cuda_blocks(count, TB), TB, 0, s, kv_write_heads_kernel, k, v, stride, *dst,
                           n_heads, n_rows, head_dim);
}

cudaError_t tkv_cuda_get_rows_f16(const __half *w, uint32_t n_in, const int32_t *ids, uint32_t n, float *out,
                                  cudaStream_t s)
{
    const size_t count = (size_t)n * n_in;
    if (count == 0)
        return cudaSuccess;
    get_rows_kernel<__half><<<tkv_cuda_blocks(count, TB), TB, 0, s>>>(w, n_in, ids, n, out);
    TKV_CUDA_LAUNCHED();
    return cudaSuccess;
}

cudaError_t tkv_cuda_get_rows_f32(const float *w, uint32_t n_in, const int32_t *ids, uint32_t n, float *out,
                                  cudaStream_t s)
{
    const size_t count = (size_t)n * n_in;
    if (count == 0)
        return cudaSuccess;
    get_rows_kernel<float><<<tkv_cuda_blocks(count, TB), TB, 0, s>>>(w, n_in, ids, n, out);
    TKV_CUDA_LAUNCHED();
    return cudaSuccess;
}

cudaError_t tkv_cuda_f32_to_f16(const float *x, __half *y, size_t count, cudaStream_t s)
{
    if (count == 0)
        return cudaSuccess;
    f32_to_f16_kernel<<<tkv_cuda_blocks(count, TB), TB, 0, s>>>(x, y, count);
    TKV_CUDA_LAUNCHED();
    return cudaSuccess;
}

bool tkv_cuda_gemv_ok(const __half *w, const float *x, uint32_t n_in, uint32_t n)
{
    return n >= 1 && n <= TKV_CUDA_GEMV_MAX_N && n_in % 8 == 0 && ((uintptr_t)w % 16) == 0 &&
           ((uintptr_t)x % 16) == 0;
}

/* TKV_CUDA_GEMV_SPLIT=1|2|4|8 in the environment (read once per process):
 * every fast-kernel row on that many warps where the row holds a full set
 * of loads for each, for measuring the rule below (bench-gemv). */
static uint32_t gemv_split_forced(void)
{
    /* a function-local static: initialized once, thread-safe (C++11) */
    static const uint32_t forced = [] {
        const char *e = getenv("TKV_CUDA_GEMV_SPLIT");
        const int v = e ? atoi(e) : 0;
        return v == 1 || v == 2 || v == 4 || v == 8 ? (uint32_t)v : 0u;
    }();
    return forced;
}

uint32_t tkv_cuda_gemv_split(uint32_t n_in, uint32_t n_out, uint32_t n_sm)
{
    const uint32_t n8 = n_in / 8;
    uint32_t S = 1;
    if (gemv_split_forced()) {
        while (S < gemv_split_forced() && n8 >= 2 * 32 * S * GEMV2_U)
            S *= 2;
        return S;
    }
    /* split while the CTAs (8 / S rows each) are fewer than 3 per SM and
     * every thread of a row still has a full set of U loads. (4 per SM
     * split 4096-row matrices in two: bench-gemv on the H200 with
     * TKV_CUDA_GEMV_SPLIT=1, 2026-12-03: 4096 x 4096 13.55 us unsplit
     * against 15.79 split, 4096 x 14336 36.4 either way.) */
    while (S < GEMV_WARPS && ((uint64_t)n_out * S + GEMV_WARPS - 1) / GEMV_WARPS < 3ull * n_sm &&
           n8 >= 2 * 32 * S * GEMV2_U)
        S *= 2;
    return S;
}

cudaError_t tkv_cuda_gemv_f16(const __half *w, const float *x, float *y, uint32_t n_in, uint32_t n_out, uint32_t n,
                              uint32_t n_sm, bool add, bool pdl, cudaStream_t s)
{
    if (n_out == 0)
        return cudaSuccess;
    return gemv2_n<GEMV2_U>(w, x, y, n_in, n_out, n, tkv_cuda_gemv_split(n_in, n_out, n_sm), add, pdl, s);
}

uint32_t tkv_cuda_gemv_split_u8(uint32_t n_in, uint32_t n_out, uint32_t n_sm)
{
    const uint32_t n8 = n_in / 8;
    uint32_t S = 1;
    /* as tkv_cuda_gemv_split, with every thread of a row given a full set of 8 loads */
    while (S < GEMV_WARPS && ((uint64_t)n_out * S + GEMV_WARPS - 1) / GEMV_WARPS < 4ull * n_sm &&
           n8 >= 2 * 32 * S * 8)
        S *= 2;
    return S;
}

cudaError_t tkv_cuda_gemv_f16_u8(const __half *w, const float *x, float *y, uint32_t n_in, uint32_t n_out,
                                 uint32_t n, uint32_t n_sm, bool add, bool pdl, cudaStream_t s)
{
    if (n_out == 0)
        return cudaSuccess;
    return gemv2_n<8>(w, x, y, n_in, n_out, n, tkv_cuda_gemv_split_u8(n_in, n_out, n_sm), add, pdl, s);
}

cudaError_t tkv_cuda_gemv_f16_ref(const __half *w, const float *x, float *y, uint32_t n_in, uint32_t n_out,
                                  uint32_t n, cudaStream_t s)
{
    if (n_out == 0)
        return cudaSuccess;
    switch (n) {
    case 1: return gemv_launch<1>(w, x, y, n_in, n_out, s);
    case 2: return gemv_launch<2>(w, x, y, n_in, n_out, s);
    case 3: return gemv_launch<3>(w, x, y, n_in, n_out, s);
    case 4: return gemv_launch<4>(w, x, y, n_in, n_out, s);
    case 5: return gemv_launch<5>(w, x, y, n_in, n_out, s);
    case 6: return gemv_launch<6>(w, x, y, n_in, n_out, s);
    case 7: return gemv_launch<7>(w, x, y, n_in, n_out, s);
    case 8: return gemv_launch<8>(w, x, y, n_in, n_out, s);
    default: return cudaErrorInvalidValue;
    }
}
