/*
 * gemv-bulk.cuh -- the decode GEMV streamed through Hopper's bulk copy
 * engine (cp.async.bulk into shared memory, mbarrier completion), for f16
 * weights and 1 .. TKV_CUDA_GEMV_MAX_N tokens of f32 activations.
 *
 * Why: a decode step reads every weight once, so its matmuls are streams
 * from HBM, and a stream runs at the memory's rate only with enough bytes in
 * flight per SM (~30 KiB at 4.8 TB/s and ~0.8 us of latency, more under
 * load). The register GEMVs of ops.cu keep U 16-byte loads per lane in
 * flight and then wait for them, round after round; on the mid shapes of
 * Llama-3-8B (4096 x 4096, 4096 x 14336) they run at 0.6-0.8 of the copy
 * rate. Here one thread per CTA keeps NS stages of 16 KiB in flight with a
 * single instruction each, for the whole of the CTA's rows, while its 8
 * warps compute from shared memory.
 *
 * Layout: a CTA owns a contiguous range of rows (of one matrix, of a group's
 * concatenation, or of the gate and the up matrix for SwiGLU), so its
 * weights are one or a few contiguous byte ranges; the grid is a whole
 * number of CTAs per SM (one wave) unless the rows per CTA would exceed
 * what shared memory holds. Each 512-byte piece of a stage (32 lanes x 16
 * bytes) lies in one row (n_in % 256 == 0), and warp w takes pieces w, w +
 * 8, ...: a row's pieces reach each warp as one contiguous run, so a warp
 * sums a row in registers and writes one partial per (row, warp); the CTA
 * adds the 8 partials in warp order. No atomics: every run gives the same
 * bits. The summation order differs from ops.cu's kernels (tests hold both
 * to the same tolerance against the reference).
 *
 * Under a programmatic dependent launch the first NS stages are requested
 * before griddepcontrol.wait (weights are written at load only).
 */
#ifndef TKV_GPU_GEMV_BULK_CUH
#define TKV_GPU_GEMV_BULK_CUH

#include "ops.cuh"

/* Whether the bulk GEMV takes this shape: sm_90 or later (checked by the
 * caller: the backend's device), n_in % 256 == 0, 1 <= n <= 8, w and x
 * 16-byte aligned. */
bool tkv_cuda_gemv_bulk_ok(const __half *w, const float *x, uint32_t n_in, uint32_t n);

/* y[i][n, n_out_i] = x[n, n_in] . w[i]^T for the g->nw weights of g (one
 * weight: a plain matmul; several: matmul_group), or with swiglu_out:
 * swiglu_out[n, n_out] = silu(x . g->w[0]^T) * (x . g->w[1]^T) for two
 * weights of n_out = g->end[0] rows each (g->y unused). */
cudaError_t tkv_cuda_gemv_bulk(const struct tkv_cuda_gemv_group *g, const float *x, uint32_t n_in, uint32_t n,
                               float *swiglu_out, uint32_t n_sm, bool pdl, cudaStream_t s);

#endif
