/*
 * dequant.cuh -- GGUF weight blocks -> f16 (matrices, for cuBLAS and the
 * GEMV kernel) or f32 (vectors such as norm weights), on the GPU, once at
 * load.
 *
 * Each value is first computed in f32 exactly as cpu/quant-ref.c does it
 * (same operation order, products rounded before the following add: the
 * kernels use __fmul_rn so nvcc cannot fuse them into an FMA), then rounded
 * to f16 (round to nearest even) for matrices. So an f32 output equals the
 * CPU dequantization bit for bit, and an f16 output is its correctly rounded
 * half. Block layouts: cpu/quant.h (byte-compatible with ggml).
 */
#ifndef TKV_GPU_DEQUANT_CUH
#define TKV_GPU_DEQUANT_CUH

#include "common.cuh"

/* True for the weight types the kernels below handle: F32, F16, BF16,
 * Q4_0, Q4_1, Q8_0, Q4_K, Q6_K. */
bool tkv_cuda_dequant_supported(uint32_t type);

/* src: n_elems elements of `type` in device memory (n_elems a multiple of the
 * type's block). Exactly one of dst16 / dst32 is non-NULL: [n_elems]. */
cudaError_t tkv_cuda_dequant(uint32_t type, const void *src, size_t n_elems, __half *dst16, float *dst32,
                             cudaStream_t stream);

/* As tkv_cuda_dequant to f32, each value then rounded to f16 and back: the
 * f16 copy's values in f32 (what f16 storage alone costs, measured with f32
 * arithmetic: TKV_CUDA_WEIGHTS=f16round). */
cudaError_t tkv_cuda_dequant_f16_rounded(uint32_t type, const void *src, size_t n_elems, float *dst, cudaStream_t stream);

#endif
