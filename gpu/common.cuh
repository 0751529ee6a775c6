/*
 * common.cuh -- what every gpu/ file shares: the project's C headers (inside
 * extern "C"), the CUDA headers, and the error helpers of the kernel layer.
 *
 * Kernel launchers (gpu/<op>.cuh) take raw device pointers, sizes and a
 * stream, and return cudaError_t; they never abort, allocate or synchronize.
 * The backend glue (cuda-backend.cu) turns a failure into a tkv_status.
 */
#ifndef TKV_GPU_COMMON_CUH
#define TKV_GPU_COMMON_CUH

/* system headers first, so the project's includes of them inside the
 * extern "C" block below are no-ops */
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

extern "C" {
#include "../runtime/backend.h"
}

#include <cuda_fp16.h>
#include <cuda_runtime.h>

/* Returns a failed CUDA call's error to the caller: TKV_CUDA_TRY(cudaMemsetAsync(...)). */
#define TKV_CUDA_TRY(expr)                      \
    do {                                        \
        cudaError_t tkv_cuda_e_ = (expr);       \
        if (tkv_cuda_e_ != cudaSuccess)         \
            return tkv_cuda_e_;                 \
    } while (0)

/* After every <<<...>>>: a bad configuration shows up here, not later. */
#define TKV_CUDA_LAUNCHED() TKV_CUDA_TRY(cudaGetLastError())

static inline unsigned tkv_cuda_blocks(size_t n, unsigned per_block)
{
    return (unsigned)((n + per_block - 1) / per_block);
}

/* ---- warp reductions (device) --------------------------------------------- */

static __device__ __forceinline__ float tkv_warp_sum(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

static __device__ __forceinline__ float tkv_warp_max(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

static __device__ __forceinline__ double tkv_warp_sum_d(double v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

#endif /* TKV_GPU_COMMON_CUH */
