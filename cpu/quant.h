/*
 * quant.h -- block formats of quantized weights (llama.cpp's layouts) and the
 * row kernels the CPU backend is built on.
 *
 * Two families of kernels, each with a scalar reference beside the fast
 * (SIMD) version; tests compare them on fresh random inputs:
 *   - dequantization of a weight row to f32 (prefill: feed OpenBLAS sgemm);
 *   - dot products of a quantized weight row with an activation row that was
 *     quantized once per token into the format that pairs with the weight
 *     type (decode), as llama.cpp does:
 *         weight  Q4_0, Q8_0 -> activation Q8_0
 *         weight  Q4_1       -> activation Q8_1 (carries the block sums)
 *         weight  Q4_K, Q6_K -> activation Q8_K
 *         weight  F32, F16, BF16 -> activation F32 (no quantization)
 * Row lengths are multiples of the weight type's block size (the model
 * loader guarantees it).
 */
#ifndef TKV_QUANT_H
#define TKV_QUANT_H

#include "../runtime/gguf.h"

/* Weight row of n elements -> f32. */
void tkv_dequant_row(uint32_t type, const void *src, float *dst, int64_t n);
void tkv_dequant_row_ref(uint32_t type, const void *src, float *dst, int64_t n);

/* The activation type paired with a weight type (table above). */
uint32_t tkv_act_type(uint32_t weight_type);
/* Bytes of one activation row of n elements for a weight type. */
size_t   tkv_act_row_bytes(uint32_t weight_type, int64_t n);

/* f32 activation row -> the paired activation format (fast and reference). */
void tkv_quantize_act(uint32_t weight_type, const float *x, void *dst, int64_t n);
void tkv_quantize_act_ref(uint32_t weight_type, const float *x, void *dst, int64_t n);

/* Dot product of a weight row with a prepared activation row. */
float tkv_vec_dot(uint32_t weight_type, const void *w, const void *act, int64_t n);
float tkv_vec_dot_ref(uint32_t weight_type, const void *w, const void *act, int64_t n);

/* f32 -> weight type (for tests and the model generator; types Q4_0, Q4_1,
 * Q8_0, F16, BF16, F32). Round-to-nearest like llama.cpp's reference
 * quantizers. Returns false for types it cannot produce. */
bool tkv_quantize_row(uint32_t type, const float *x, void *dst, int64_t n);

/* Bulk f16 <-> f32 conversions (F16C where available). */
void tkv_fp16_to_fp32_row(const uint16_t *src, float *dst, int64_t n);
void tkv_fp32_to_fp16_row(const float *src, uint16_t *dst, int64_t n);

#endif /* TKV_QUANT_H */
