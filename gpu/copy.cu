/* copy.cu -- see copy.cuh. */
#include "copy.cuh"

#define GATHER_THREADS 256
#define GATHER_UNROLL 4
#define GATHER_CHUNK (GATHER_THREADS * GATHER_UNROLL * 16) /* bytes per CTA: 16 KiB */

/* blockIdx.x: chunk within a block, blockIdx.y: the copy. All loads of a
 * thread are issued before its stores, so each thread keeps GATHER_UNROLL
 * reads in flight across the link. */
__global__ void gather_kernel(const struct tkv_cuda_copy *table, size_t n16)
{
    const struct tkv_cuda_copy c = table[blockIdx.y];
    const uint4 *src = (const uint4 *)c.src;
    uint4 *dst = (uint4 *)c.dst;
    const size_t base = (size_t)blockIdx.x * (GATHER_CHUNK / 16) + threadIdx.x;
    uint4 v[GATHER_UNROLL];
#pragma unroll
    for (int u = 0; u < GATHER_UNROLL; u++) {
        size_t i = base + (size_t)u * GATHER_THREADS;
        if (i < n16)
            v[u] = src[i];
    }
#pragma unroll
    for (int u = 0; u < GATHER_UNROLL; u++) {
        size_t i = base + (size_t)u * GATHER_THREADS;
        if (i < n16)
            dst[i] = v[u];
    }
}

cudaError_t tkv_cuda_gather(const struct tkv_cuda_copy *table, uint32_t n, size_t bytes, cudaStream_t s)
{
    if (n == 0 || bytes == 0)
        return cudaSuccess;
    if (bytes % 16 != 0)
        return cudaErrorInvalidValue;
    const size_t chunks = (bytes + GATHER_CHUNK - 1) / GATHER_CHUNK;
    /* grid.y is limited to 65535: longer lists go in several launches */
    for (uint32_t j0 = 0; j0 < n; j0 += 65535u) {
        dim3 grid((unsigned)chunks, TKV_MIN(65535u, n - j0));
        gather_kernel<<<grid, GATHER_THREADS, 0, s>>>(table + j0, bytes / 16);
        cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess)
            return e;
    }
    return cudaSuccess;
}
