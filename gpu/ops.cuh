/*
 * ops.cuh -- the small kernels of the forward pass: RMSNorm, RoPE, SwiGLU,
 * add, KV row write (f32 -> f16; one head, or all of a layer's heads in one
 * launch), embedding rows, f32 -> f16 activations and the f16-weight GEMV
 * used for few-token matmuls (a fast kernel and its reference).
 *
 * All pointers are device memory; activations are row-major f32. Semantics
 * are runtime/backend.h's, computed as cpu/cpu-backend.c does (same formula
 * and operation order; see each launcher for what may differ in rounding).
 *
 * Launchers with a `pdl` argument launch their kernel as a programmatic
 * dependent launch when it is true (common.cuh: the kernel may start while
 * the previous one drains and waits for it before touching activations);
 * the kernels and their results are the same either way.
 */
#ifndef TKV_GPU_OPS_CUH
#define TKV_GPU_OPS_CUH

#include "gemv-common.cuh"

/* y[n, dim] = x / sqrt(mean(x^2) + eps) * w; sum of squares in double as on
 * the CPU. y may alias x. */
cudaError_t tkv_cuda_rmsnorm(const float *x, const float *w, float *y, uint32_t n, uint32_t dim, float eps, bool pdl,
                             cudaStream_t s);

/* tkv_cuda_rmsnorm (the same bits in y) and tkv_cuda_q8_quantize of y into a
 * (gemv-quant.cuh) in one launch of several CTAs a row, each summing the
 * row's squares itself. dim % 32 == 0; y must not alias x. */
cudaError_t tkv_cuda_rmsnorm_q8(const float *x, const float *w, float *y, uint32_t n, uint32_t dim, float eps,
                                struct tkv_cuda_q8_act a, bool pdl, cudaStream_t s);

/* In place on x[n, n_heads*head_dim], positions pos[n] (device). The angle of
 * pair i is pos * theta_scale^i * freq_scale with theta_scale^i built by i
 * successive float multiplies, exactly as cpu_rope does (so angles match
 * bit for bit; cos/sin may differ from glibc by an ulp). */
cudaError_t tkv_cuda_rope(float *x, uint32_t n, uint32_t n_heads, uint32_t head_dim, uint32_t rot_dim,
                          const int32_t *pos, float theta_scale, float freq_scale, cudaStream_t s);

/* out = silu(gate) * up (out may alias gate or up). */
cudaError_t tkv_cuda_swiglu(const float *gate, const float *up, float *out, size_t count, cudaStream_t s);

/* y += x */
cudaError_t tkv_cuda_add(float *y, const float *x, size_t count, cudaStream_t s);

/* p[0 .. n) = v: cudaMemsetAsync as a kernel, so that it can take part in a
 * chain of programmatic dependent launches (a memset node between two
 * kernels ends the chain). */
cudaError_t tkv_cuda_fill32(uint32_t *p, uint32_t v, size_t n, bool pdl, cudaStream_t s);

/* dst[r, :hd] = f16(src[r*src_stride + :hd]), round to nearest even (as
 * tkv_fp32_to_fp16: overflow gives Inf). */
cudaError_t tkv_cuda_kv_write(const float *src, size_t src_stride, uint16_t *dst, uint32_t n_rows, uint32_t head_dim,
                              cudaStream_t s);

/* kv_write for n_heads <= TKV_CUDA_KV_HEADS_MAX heads in one launch:
 * dst->k[h][r*hd + d] = f16(k[r*stride + h*hd + d]), dst->v[h] likewise
 * from v (the backend op kv_write_heads). The destinations travel as a
 * kernel parameter (1 KiB), so nothing is staged. */
#define TKV_CUDA_KV_HEADS_MAX 64
struct tkv_cuda_kv_dst {
    uint16_t *k[TKV_CUDA_KV_HEADS_MAX];
    uint16_t *v[TKV_CUDA_KV_HEADS_MAX];
};
cudaError_t tkv_cuda_kv_write_heads(const float *k, const float *v, size_t stride, const struct tkv_cuda_kv_dst *dst,
                                    uint32_t n_heads, uint32_t n_rows, uint32_t head_dim, bool pdl, cudaStream_t s);

/* out[i, :] = f32(w[ids[i], :]) for w [n_rows, n_in] f16; ids in device
 * memory, already range-checked. */
cudaError_t tkv_cuda_get_rows_f16(const __half *w, uint32_t n_in, const int32_t *ids, uint32_t n, float *out,
                                  cudaStream_t s);
/* Same for f32 weights (the TKV_CUDA_WEIGHTS=f32 validation mode). */
cudaError_t tkv_cuda_get_rows_f32(const float *w, uint32_t n_in, const int32_t *ids, uint32_t n, float *out,
                                  cudaStream_t s);

/* y = f16(x), saturating at +-65504 (NaN stays NaN): activations for the
 * tensor-core GEMM. */
cudaError_t tkv_cuda_f32_to_f16(const float *x, __half *y, size_t count, cudaStream_t s);

/* y[n, n_out] = x[n, n_in] . w^T for w [n_out, n_in] f16, f32 activations
 * and f32 accumulation; for 1 <= n <= TKV_CUDA_GEMV_MAX_N. Needs n_in % 8 == 0
 * and 16-byte aligned w and x (tkv_cuda_gemv_ok). */
#define TKV_CUDA_GEMV_MAX_N 8
bool tkv_cuda_gemv_ok(const __half *w, const float *x, uint32_t n_in, uint32_t n);
/* The fast kernel: U = 4 independent 16-byte weight loads per lane in flight,
 * a row split over S warps (tkv_cuda_gemv_split) when n_out is small for
 * the n_sm SMs. Sums in another order than the reference (below). With add,
 * y += the product (y + x rounded once, as tkv_cuda_add). */
cudaError_t tkv_cuda_gemv_f16(const __half *w, const float *x, float *y, uint32_t n_in, uint32_t n_out, uint32_t n,
                              uint32_t n_sm, bool add, bool pdl, cudaStream_t s);
/* Warps per row the fast kernel uses (1, 2, 4 or 8). */
uint32_t tkv_cuda_gemv_split(uint32_t n_in, uint32_t n_out, uint32_t n_sm);
/* The fast kernel with U = 8 loads per lane in flight (TKV_CUDA_GEMV=u8), a
 * variant for the mid shapes (4096 x 4096: one round of loads per thread
 * instead of two); its split is tkv_cuda_gemv_split_u8. Same arithmetic per
 * chunk, other summation order. */
cudaError_t tkv_cuda_gemv_f16_u8(const __half *w, const float *x, float *y, uint32_t n_in, uint32_t n_out,
                                 uint32_t n, uint32_t n_sm, bool add, bool pdl, cudaStream_t s);
uint32_t tkv_cuda_gemv_split_u8(uint32_t n_in, uint32_t n_out, uint32_t n_sm);
/* The reference: one warp per row, one 16-byte load per lane at a time
 * (TKV_CUDA_GEMV=ref). */
cudaError_t tkv_cuda_gemv_f16_ref(const __half *w, const float *x, float *y, uint32_t n_in, uint32_t n_out,
                                  uint32_t n, cudaStream_t s);

/* ---- fused decode ops (the backend's optional matmul_group, matmul_swiglu,
 * add_rmsnorm, rope_qk; runtime/backend.h) ---- */

/* Grouped GEMV: y[i][n, n_out_i] = x[n, n_in] . w[i]^T for i < nw, every w[i]
 * [n_out_i, n_in] f16 (tkv_cuda_gemv_ok for each), one grid over the
 * concatenated rows; end[i] = rows of w[0..i]. Each row is summed as the
 * fast kernel sums it at the split the total row count gives, so a weight's
 * results equal its own tkv_cuda_gemv_f16 within f32 reassociation (bit for
 * bit when the split is the same). Travels as a kernel parameter. */
#define TKV_CUDA_GEMV_GROUP_MAX 8
struct tkv_cuda_gemv_group {
    const __half *w[TKV_CUDA_GEMV_GROUP_MAX];
    float *y[TKV_CUDA_GEMV_GROUP_MAX];
    uint32_t end[TKV_CUDA_GEMV_GROUP_MAX];
    uint32_t nw;
};
cudaError_t tkv_cuda_gemv_group(const struct tkv_cuda_gemv_group *g, const float *x, uint32_t n_in, uint32_t n,
                                uint32_t n_sm, bool pdl, cudaStream_t s);

/* out[n, n_out] = silu(x . wg^T) * (x . wu^T), wg and wu [n_out, n_in] f16:
 * the fast GEMV of both at the split tkv_cuda_gemv_f16 takes for one, and
 * swiglu's formula on the two sums (the same bits as gemv + gemv + swiglu
 * unless nvcc contracts differently). out does not overlap x. */
cudaError_t tkv_cuda_gemv_swiglu(const __half *wg, const __half *wu, const float *x, float *out, uint32_t n_in,
                                 uint32_t n_out, uint32_t n, uint32_t n_sm, bool pdl, cudaStream_t s);

/* y += x; h = rmsnorm(y) * w over n rows of dim: add + rmsnorm's arithmetic
 * in one pass (bit-identical). h may alias x, not y. */
cudaError_t tkv_cuda_add_rmsnorm(float *y, const float *x, const float *w, float *h, uint32_t n, uint32_t dim,
                                 float eps, bool pdl, cudaStream_t s);

/* table[t][p] = (cos, sin) of rotated pair p's angle at position pos[t]
 * (device memory), for t < n, p < n_pairs: the angles tkv_cuda_rope takes,
 * for the quantized GEMV's epilogue (tkv_cuda_qgemv, rope). */
cudaError_t tkv_cuda_rope_table(const int32_t *pos, uint32_t n, uint32_t n_pairs, float theta_scale, float freq_scale,
                                float2 *table, bool pdl, cudaStream_t s);

/* tkv_cuda_rope on q [n, n_head*hd] and k [n, n_head_kv*hd] in one launch,
 * positions pos[n] in device memory. */
cudaError_t tkv_cuda_rope_qk(float *q, float *k, uint32_t n, uint32_t n_head, uint32_t n_head_kv, uint32_t head_dim,
                             uint32_t rot_dim, const int32_t *pos, float theta_scale, float freq_scale, bool pdl,
                             cudaStream_t s);

#endif
