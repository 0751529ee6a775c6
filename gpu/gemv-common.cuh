/*
 * gemv-common.cuh -- device code the two GEMV files (ops.cu: f16 weights;
 * gemv-quant.cu: Q4_0 / Q4_1 / Q8_0 blocks) share, so that each piece of
 * arithmetic exists once:
 *   - the 8-bit activation planes the quantized GEMV reads (their format and
 *     the warp-wide block quantizer that writes them);
 *   - the combine of a row's partial sums over its threads (tkv_row_reduce).
 * Only .cu files include it (device functions).
 */
#ifndef TKV_GPU_GEMV_COMMON_CUH
#define TKV_GPU_GEMV_COMMON_CUH

#include "common.cuh"

/* ---- 8-bit activation planes --------------------------------------------------------
 *
 * Quantized activations of n rows of n_in elements (n_in % 32 == 0), nb =
 * n_in / 32 blocks per row, in device memory:
 *   q    [n][nb][32] int8  the blocks' qs (16-byte aligned)
 *   meta [n][nb]     {f16 d, f16 s, int32 sum}: the block's d and s exactly
 *                    as tkv_block_q8_1 stores them (s = f16(d * sum); Q8_0
 *                    rows ignore it) and sum = the exact integer sum of its qs
 * Block kb of a row sits at position (kb % gb) * (nb / gb) + kb / gb (gb
 * divides nb): with gb = the fast kernel's blocks per lane group, the lanes
 * of a row, which own consecutive groups, read consecutive 32-byte blocks
 * (coalesced) at every step of their group; gb = 1 is the plain order. The
 * planes of Q8_0 and Q8_1 activations are the same bytes (meta always holds
 * d, s and sum); only the block order differs with the weight type. */
struct tkv_cuda_q8_meta {
    __half d, s;
    int32_t sum;
};
struct tkv_cuda_q8_act {
    int8_t *q;
    struct tkv_cuda_q8_meta *meta;
    uint32_t gb; /* the block order above */
};

/* Position of block kb of a row of nb blocks in the planes (block order gb). */
static __device__ __forceinline__ uint32_t tkv_q8_pos(uint32_t kb, uint32_t nb, uint32_t gb)
{
    return (kb % gb) * (nb / gb) + kb / gb;
}

/* roundf: half away from zero. x - trunc(x) is exact (the fraction of a
 * float below 2^23, or 0 above), so the comparison with 0.5 is too. */
static __device__ __forceinline__ float tkv_round_away(float x)
{
    const float t = truncf(x);
    return fabsf(x - t) >= 0.5f ? t + copysignf(1.0f, x) : t;
}

/* One 32-element block, quantized as cpu/quant-ref.c's q8_block_ref does:
 * amax, d = amax / 127, id = d ? 1 / d : 0, q = roundf(x * id), every
 * operation rounded alone (__fdiv_rn, __fmul_rn: nvcc cannot contract or
 * approximate them). The block lies on 32 / E consecutive lanes of a warp,
 * E consecutive elements a lane (E = 1: a warp a block; E = 4: a lane's
 * float4, 8 lanes a block). amax (a max) and sum (of integers) do not
 * depend on the order they are taken in, so every E gives the same bits. */
template <int E> struct tkv_q8_part {
    int q[E];  /* this lane's quants */
    float d;   /* the block's scale (f32, before the f16 rounding) */
    int sum;   /* the exact sum of the block's 32 quants (every lane) */
};
typedef struct tkv_q8_part<1> tkv_q8_block;

/* Warp-collective: every lane of a full warp calls it, each with its E
 * elements of its block in v (lanes 32 / E apart hold different blocks);
 * every lane gets its block's scale and sum and its own quants. */
template <int E> static __device__ __forceinline__ struct tkv_q8_part<E> tkv_q8_part_of(const float (&v)[E])
{
    static_assert(E == 1 || E == 2 || E == 4 || E == 8, "a block on 32 / E lanes");
    float amax = fabsf(v[0]);
#pragma unroll
    for (int e = 1; e < E; e++) /* TKV_MAX(amax, .): order-free for every non-NaN input */
        amax = fabsf(v[e]) > amax ? fabsf(v[e]) : amax;
#pragma unroll
    for (int o = 16 / E; o > 0; o >>= 1) {
        const float other = __shfl_xor_sync(0xffffffffu, amax, o);
        amax = other > amax ? other : amax;
    }
    struct tkv_q8_part<E> b;
    b.d = __fdiv_rn(amax, 127.0f);
    const float id = b.d != 0.0f ? __fdiv_rn(1.0f, b.d) : 0.0f;
    b.sum = 0;
#pragma unroll
    for (int e = 0; e < E; e++) {
        b.q[e] = (int)tkv_round_away(__fmul_rn(v[e], id));
        b.sum += b.q[e];
    }
#pragma unroll
    for (int o = 16 / E; o > 0; o >>= 1)
        b.sum += __shfl_xor_sync(0xffffffffu, b.sum, o);
    return b;
}

/* The warp-a-block case: element `lane` of the block in v. */
static __device__ __forceinline__ tkv_q8_block tkv_q8_block_of(float v)
{
    const float e[1] = {v};
    return tkv_q8_part_of<1>(e);
}

/* Stores the quants of part b (elements at E at of the block at plane
 * position pos of a, at % E == 0) and, from the lane holding element 0,
 * the meta (d and s rounded to f16 as tkv_block_q8_1 stores them). */
template <int E>
static __device__ __forceinline__ void tkv_q8_part_put(const struct tkv_q8_part<E> &b, uint32_t at,
                                                       struct tkv_cuda_q8_act a, size_t pos)
{
    if constexpr (E == 4) { /* one 4-byte store (at % 4 == 0) */
        *(char4 *)(a.q + pos * 32 + at) = make_char4((signed char)b.q[0], (signed char)b.q[1], (signed char)b.q[2],
                                                     (signed char)b.q[3]);
    } else {
#pragma unroll
        for (int e = 0; e < E; e++)
            a.q[pos * 32 + at + e] = (int8_t)b.q[e];
    }
    if (at == 0) {
        struct tkv_cuda_q8_meta m;
        m.d = __float2half_rn(b.d);
        m.s = __float2half_rn(__fmul_rn((float)b.sum, b.d));
        m.sum = b.sum;
        a.meta[pos] = m;
    }
}

/* Stores block b at plane position pos of a: lane j its quant, lane 0 the meta. */
static __device__ __forceinline__ void tkv_q8_block_put(const tkv_q8_block &b, uint32_t lane, struct tkv_cuda_q8_act a,
                                                        size_t pos)
{
    tkv_q8_part_put<1>(b, lane, a, pos);
}

/* ---- RoPE's angles and rotation --------------------------------------------------------
 *
 * ops.cu's rope kernels and the quantized GEMV's epilogue (which rotates
 * q and k as it writes them) share these, so that all give the same bits. */

/* cos and sin (x, y) of rotated pair p's angle at position pos: pos *
 * theta_scale^p * freq_scale, theta_scale^p by p successive multiplies as
 * cpu_rope computes it (the angles match the CPU's bit for bit; sincosf
 * may differ from glibc's by an ulp). */
static __device__ __forceinline__ float2 tkv_rope_cs(int32_t pos, uint32_t p, float theta_scale, float freq_scale)
{
    float theta = (float)pos;
    for (uint32_t k = 0; k < p; k++)
        theta *= theta_scale;
    const float th = theta * freq_scale;
    float2 c;
    sincosf(th, &c.y, &c.x);
    return c;
}

/* (x0, x1) rotated by the angle whose cos and sin are c, every product and
 * sum rounded alone (nvcc cannot contract them, so each kernel that rotates
 * gets the same bits). */
static __device__ __forceinline__ void tkv_rope_rotate(float x0, float x1, float2 c, float *y0, float *y1)
{
    *y0 = __fsub_rn(__fmul_rn(x0, c.x), __fmul_rn(x1, c.y));
    *y1 = __fadd_rn(__fmul_rn(x0, c.y), __fmul_rn(x1, c.x));
}

/* ---- a row's sums over its threads ------------------------------------------------------
 *
 * L threads share a row and each holds acc[i], its part of token i's dot
 * product (i < NT). Afterwards one thread per token holds the row's sum in
 * *out and gets true: thread i < NT of the row (L <= 32: lanes of one warp,
 * summed by an xor butterfly, which leaves the same bits in every lane) or
 * lane i of the row's first warp (L = 32 S > 32: each warp's butterfly sum,
 * then the S warps' sums in warp order through part[warps][NT] in shared
 * memory). Every thread of the CTA calls it (a barrier when L > 32). The
 * f16 GEMVs use L = 32 S, the quantized one 8 .. 128. */
template <int NT, int L>
static __device__ __forceinline__ bool tkv_row_reduce(const float *acc, float *part, uint32_t warp, uint32_t lane,
                                                      float *out)
{
    constexpr int W = L < 32 ? L : 32; /* lanes of a row in one warp */
    float mine = 0.0f;
    const uint32_t t = lane % W;
#pragma unroll
    for (int i = 0; i < NT; i++) {
        float v = acc[i];
#pragma unroll
        for (int o = W / 2; o > 0; o >>= 1)
            v += __shfl_xor_sync(0xffffffffu, v, o);
        if (L <= 32) {
            if (t == (uint32_t)i)
                mine = v;
        } else if (lane == 0) {
            part[warp * NT + i] = v;
        }
    }
    if (L <= 32) {
        *out = mine;
        return t < (uint32_t)NT;
    }
    constexpr int S = L > 32 ? L / 32 : 1;
    __syncthreads();
    if (warp % S != 0 || lane >= (uint32_t)NT)
        return false;
    float v = 0.0f;
#pragma unroll
    for (int p = 0; p < S; p++)
        v += part[(warp + p) * NT + lane];
    *out = v;
    return true;
}

#endif
