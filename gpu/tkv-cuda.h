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

#ifdef __cplusplus
}
#endif
#endif
