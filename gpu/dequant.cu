/*
 * dequant.cu -- see dequant.cuh. One thread per block of the format (per
 * 64- or 128-element part of a K-quant super-block); load-time only, so
 * simple beats fast here.
 */
#include "dequant.cuh"

namespace {

__device__ __forceinline__ float ld_f16(const uint8_t *p)
{
    return __half2float(__ushort_as_half((unsigned short)(p[0] | (p[1] << 8))));
}

__device__ __forceinline__ void put(__half *y, size_t i, float v) { y[i] = __float2half_rn(v); }
__device__ __forceinline__ void put(float *y, size_t i, float v) { y[i] = v; }
/* an f32 output holding the f16 copy's values (tkv_cuda_dequant_f16_rounded) */
struct f16_in_f32 {
    float f;
};
__device__ __forceinline__ void put(f16_in_f32 *y, size_t i, float v) { y[i].f = __half2float(__float2half_rn(v)); }

/* 6-bit scale and min of sub-block j of a Q4_K super-block (spec 2.2). */
__device__ __forceinline__ void q4k_scale_min(int j, const uint8_t *s, int *sc, int *m)
{
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

template <typename T>
__global__ void dequant_plain(uint32_t type, const uint8_t *src, size_t n, T *y)
{
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n)
        return;
    float v;
    if (type == TKV_TYPE_F32)
        v = ((const float *)src)[i];
    else if (type == TKV_TYPE_F16)
        v = __half2float(__ushort_as_half(((const unsigned short *)src)[i]));
    else /* BF16 */
        v = __uint_as_float((uint32_t)((const unsigned short *)src)[i] << 16);
    put(y, i, v);
}

/* Q4_0 (18 B), Q4_1 (20 B), Q8_0 (34 B): 32 elements per block. */
template <typename T>
__global__ void dequant_q32(uint32_t type, const uint8_t *src, size_t nb, T *y)
{
    const size_t ib = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (ib >= nb)
        return;
    const size_t o = ib * 32;
    if (type == TKV_TYPE_Q4_0) {
        const uint8_t *p = src + ib * 18;
        const float d = ld_f16(p);
        for (int j = 0; j < 16; j++) {
            const int q = p[2 + j];
            put(y, o + j, (float)((q & 15) - 8) * d);
            put(y, o + j + 16, (float)((q >> 4) - 8) * d);
        }
    } else if (type == TKV_TYPE_Q4_1) {
        const uint8_t *p = src + ib * 20;
        const float d = ld_f16(p), m = ld_f16(p + 2);
        for (int j = 0; j < 16; j++) {
            const int q = p[4 + j];
            put(y, o + j, __fmul_rn((float)(q & 15), d) + m);
            put(y, o + j + 16, __fmul_rn((float)(q >> 4), d) + m);
        }
    } else { /* Q8_0 */
        const uint8_t *p = src + ib * 34;
        const float d = ld_f16(p);
        for (int j = 0; j < 32; j++)
            put(y, o + j, (float)(int8_t)p[2 + j] * d);
    }
}

/* Q4_K (144 B per 256): thread per 64-element part c of super-block ib. */
template <typename T>
__global__ void dequant_q4_k(const uint8_t *src, size_t nb, T *y)
{
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= nb * 4)
        return;
    const size_t ib = i / 4;
    const int c = (int)(i % 4);
    const uint8_t *p = src + ib * 144;
    const float d = ld_f16(p), dmin = ld_f16(p + 2);
    const uint8_t *scales = p + 4, *q = p + 16 + 32 * c;
    int sc, m;
    q4k_scale_min(2 * c, scales, &sc, &m);
    const float d1 = d * (float)sc, m1 = dmin * (float)m;
    q4k_scale_min(2 * c + 1, scales, &sc, &m);
    const float d2 = d * (float)sc, m2 = dmin * (float)m;
    const size_t o = ib * 256 + 64 * c;
    for (int l = 0; l < 32; l++) {
        put(y, o + l, __fmul_rn(d1, (float)(q[l] & 0xF)) - m1);
        put(y, o + l + 32, __fmul_rn(d2, (float)(q[l] >> 4)) - m2);
    }
}

/* Q6_K (210 B per 256): thread per 128-element half h of super-block ib. */
template <typename T>
__global__ void dequant_q6_k(const uint8_t *src, size_t nb, T *y)
{
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= nb * 2)
        return;
    const size_t ib = i / 2;
    const int h = (int)(i % 2);
    const uint8_t *p = src + ib * 210;
    const float d = ld_f16(p + 208);
    const uint8_t *ql = p + 64 * h, *qh = p + 128 + 32 * h;
    const int8_t *sc = (const int8_t *)(p + 192) + 8 * h;
    const size_t o = ib * 256 + 128 * h;
    for (int l = 0; l < 32; l++) {
        const int is = l / 16;
        const int q1 = (int)((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = (int)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        put(y, o + l, d * (float)sc[is + 0] * (float)q1);
        put(y, o + l + 32, d * (float)sc[is + 2] * (float)q2);
        put(y, o + l + 64, d * (float)sc[is + 4] * (float)q3);
        put(y, o + l + 96, d * (float)sc[is + 6] * (float)q4);
    }
}

template <typename T>
cudaError_t launch(uint32_t type, const uint8_t *src, size_t n, T *y, cudaStream_t s)
{
    const unsigned TB = 256;
    switch (type) {
    case TKV_TYPE_F32:
    case TKV_TYPE_F16:
    case TKV_TYPE_BF16:
        dequant_plain<T><<<tkv_cuda_blocks(n, TB), TB, 0, s>>>(type, src, n, y);
        break;
    case TKV_TYPE_Q4_0:
    case TKV_TYPE_Q4_1:
    case TKV_TYPE_Q8_0:
        dequant_q32<T><<<tkv_cuda_blocks(n / 32, TB), TB, 0, s>>>(type, src, n / 32, y);
        break;
    case TKV_TYPE_Q4_K:
        dequant_q4_k<T><<<tkv_cuda_blocks(n / 256 * 4, TB), TB, 0, s>>>(src, n / 256, y);
        break;
    case TKV_TYPE_Q6_K:
        dequant_q6_k<T><<<tkv_cuda_blocks(n / 256 * 2, TB), TB, 0, s>>>(src, n / 256, y);
        break;
    default:
        return cudaErrorInvalidValue;
    }
    TKV_CUDA_LAUNCHED();
    return cudaSuccess;
}

} // namespace

bool tkv_cuda_dequant_supported(uint32_t type)
{
    switch (type) {
    case TKV_TYPE_F32: case TKV_TYPE_F16: case TKV_TYPE_BF16: case TKV_TYPE_Q4_0:
    case TKV_TYPE_Q4_1: case TKV_TYPE_Q8_0: case TKV_TYPE_Q4_K: case TKV_TYPE_Q6_K:
        return true;
    default:
        return false;
    }
}

cudaError_t tkv_cuda_dequant(uint32_t type, const void *src, size_t n_elems, __half *dst16, float *dst32,
                             cudaStream_t stream)
{
    if (n_elems == 0)
        return cudaSuccess;
    if (dst16)
        return launch(type, (const uint8_t *)src, n_elems, dst16, stream);
    return launch(type, (const uint8_t *)src, n_elems, dst32, stream);
}

cudaError_t tkv_cuda_dequant_f16_rounded(uint32_t type, const void *src, size_t n_elems, float *dst, cudaStream_t stream)
{
    if (n_elems == 0)
        return cudaSuccess;
    return launch(type, (const uint8_t *)src, n_elems, (f16_in_f32 *)dst, stream);
}
