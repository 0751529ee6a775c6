/*
 * tkv-cuda.h -- the CUDA backend's plain-C entry points (no CUDA types), so
 * the backend registry can include it without CUDA headers. Only built when
 * TKV_CUDA is on; only gpu/ includes CUDA headers.
 */
#ifndef TKV_CUDA_H
#define TKV_CUDA_H

#include "../runtime/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Number of CUDA devices the runtime can use (0 if none or no driver). */
int tkv_cuda_device_count(void);

/* Creates the CUDA backend on device `device` (0 .. count-1). Its ops make
 * that device current on the calling thread when it is not the one this
 * library last made current there. */
tkv_status tkv_cuda_backend_create(int device, uint32_t n_threads, struct tkv_backend **out);

/* The tensor-core prefill attention kernel's variant (tile shape, docs/gpu.md)
 * for the calls b queues from now on: 0 or 1 (until set: v1 in f16, v0 in
 * split precision). TKV_ERR_INVALID_ARG when b is not a CUDA backend or
 * variant is out of range. */
tkv_status tkv_cuda_backend_set_prefill_variant(struct tkv_backend *b, int variant);

/* tkv_backend_cuda_quantize_act (runtime/backend.h): the activation rows the
 * quantized decode GEMV reads, as llama.cpp blocks. */
tkv_status tkv_cuda_backend_quantize_act(struct tkv_backend *b, uint32_t weight_type, const float *x, uint32_t n,
                                         uint32_t n_in, void *dst);

/* tkv_backend_cuda_q8_reads (runtime/backend.h). */
uint64_t tkv_cuda_backend_q8_reads(struct tkv_backend *b);

/* "vN: ..." describing variant N (static); NULL past the last one. */
const char *tkv_cuda_prefill_variant_desc(int variant);

#ifdef __cplusplus
}
#endif
#endif
