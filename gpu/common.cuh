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

/* ---- programmatic dependent launch (sm_90; docs/gpu.md "Programmatic
 * dependent launch") ------------------------------------------------------
 *
 * tkv_cuda_launch(pdl = true, ...) lets a kernel start while the previous
 * kernel of the stream drains, so its launch and prologue overlap that
 * kernel's tail. The kernel's side of the contract:
 *   - it calls tkv_pdl_wait() in every thread before it reads anything an
 *     earlier op of the stream writes (activations, K/V, counters, work
 *     buffers) and before it writes anything: before the wait it may read
 *     only its parameters and memory no op of the stream writes (weights,
 *     written at load);
 *   - every thread reaches the wait (no return before it), so the grid
 *     completes only after its predecessor did: a later kernel that waits
 *     on this one then also sees everything before it.
 * tkv_pdl_trigger() lets the next kernel launch once every CTA of this one
 * has run it (or exited); both compile to nothing below sm_90 and do
 * nothing when the kernel was launched without the attribute. */
static __device__ __forceinline__ void tkv_pdl_wait(void)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

static __device__ __forceinline__ void tkv_pdl_trigger(void)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/* kernel<<<grid, block, smem, s>>>(args...), as a programmatic dependent
 * launch when pdl (the kernel keeping the contract above); the launch's
 * error is returned. */
template <typename... KArgs, typename... Args>
static inline cudaError_t tkv_cuda_launch(bool pdl, dim3 grid, dim3 block, size_t smem, cudaStream_t s,
                                          void (*kernel)(KArgs...), Args... args)
{
    cudaLaunchConfig_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    cudaLaunchAttribute at[1];
    memset(at, 0, sizeof at);
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at;
    cfg.numAttrs = pdl ? 1 : 0;
    return cudaLaunchKernelEx(&cfg, kernel, args...);
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

/* ---- asynchronous copies global -> shared (cp.async, sm_80 and later) ----- */

/* 16 bytes, .cg (not through L1); !valid: nothing is read and the 16 bytes
 * are zero-filled (src-size 0) */
static __device__ __forceinline__ void tkv_cp_async16(void *smem, const void *gmem, bool valid)
{
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(valid ? 16 : 0)
                 : "memory");
}
static __device__ __forceinline__ void tkv_cp_async_commit(void) { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
/* until at most N of this thread's committed groups are still in flight */
template <int N> static __device__ __forceinline__ void tkv_cp_async_wait(void)
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
static __device__ __forceinline__ void tkv_cp_async_wait_all(void) { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

/* Word k (0..3, a compile-time constant once unrolled) of a 16-byte load. */
static __device__ __forceinline__ uint32_t tkv_u4_word(const uint4 &v, int k)
{
    return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w;
}

/* 16 bytes at p (16-byte aligned) that no kernel writes while this one
 * runs, read once: through the non-coherent path, not allocated in L1. */
static __device__ __forceinline__ uint4 tkv_ld_stream16(const void *p)
{
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

/* Asks L2 for bytes (a multiple of 16) at p (16-byte aligned): a hint that
 * reads nothing into registers or shared memory. L2 is where every SM's
 * reads and writes meet, so a prefetch issued before griddepcontrol.wait,
 * while an earlier kernel may still write those bytes, cannot make a later
 * read stale. Nothing below sm_90. */
static __device__ __forceinline__ void tkv_prefetch_l2(const void *p, uint32_t bytes)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

#endif /* TKV_GPU_COMMON_CUH */
