/* copy.cu -- see copy.cuh. */
#include "copy.cuh"

extern "C" {
#include "../tiers/crc32c.h"
}

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

/* ---- verification ------------------------------------------------------- */

#define VERIFY_THREADS 256
#define CRC32C_POLY 0x82F63B78u

/* the join constants: shift[k] moves a register past 2^k slices; init is
 * what the standard 0xFFFFFFFF start contributes over the whole block */
struct crc_join {
    uint32_t shift[8];
    uint32_t init;
};

/* a * b mod P, reflected (tkv_crc32c_mulmod) */
__device__ static uint32_t crc_mulmod(uint32_t a, uint32_t b)
{
    uint32_t p = 0;
    for (int i = 0; i < 32; i++, a <<= 1) {
        if (a & 0x80000000u)
            p ^= b;
        b = (b >> 1) ^ (CRC32C_POLY & (0u - (b & 1)));
    }
    return p;
}

__device__ static uint32_t crc_word(const uint32_t *tab, uint32_t r, uint32_t w)
{
    r ^= w; /* the word's four bytes in memory (little-endian) order */
    r = (r >> 8) ^ tab[r & 0xff];
    r = (r >> 8) ^ tab[r & 0xff];
    r = (r >> 8) ^ tab[r & 0xff];
    r = (r >> 8) ^ tab[r & 0xff];
    return r;
}

__global__ void verify_kernel(struct tkv_cuda_copy *table, uint32_t slice, struct crc_join j)
{
    __shared__ uint32_t tab[256];
    __shared__ uint32_t part[VERIFY_THREADS];
    uint32_t c = threadIdx.x;
    for (int k = 0; k < 8; k++)
        c = (c >> 1) ^ (CRC32C_POLY & (0u - (c & 1)));
    tab[threadIdx.x] = c;
    __syncthreads();
    const uint4 *p = (const uint4 *)((const uint8_t *)table[blockIdx.x].dst + (size_t)threadIdx.x * slice);
    uint32_t r = 0;
    for (uint32_t i = 0; i < slice / 16; i++) {
        uint4 v = p[i];
        r = crc_word(tab, r, v.x);
        r = crc_word(tab, r, v.y);
        r = crc_word(tab, r, v.z);
        r = crc_word(tab, r, v.w);
    }
    part[threadIdx.x] = r;
    __syncthreads();
    for (int k = 0; k < 8; k++) { /* join slice t with slice t + 2^k */
        const unsigned stride = 1u << k;
        if ((threadIdx.x & (2 * stride - 1)) == 0)
            part[threadIdx.x] = crc_mulmod(part[threadIdx.x], j.shift[k]) ^ part[threadIdx.x + stride];
        __syncthreads();
    }
    if (threadIdx.x == 0)
        table[blockIdx.x].bad = ~(part[0] ^ j.init) != table[blockIdx.x].crc;
}

cudaError_t tkv_cuda_verify(struct tkv_cuda_copy *table, uint32_t n, size_t bytes, cudaStream_t s)
{
    if (n == 0)
        return cudaSuccess;
    if (!tkv_cuda_verify_ok(bytes))
        return cudaErrorInvalidValue;
    const uint32_t slice = (uint32_t)(bytes / VERIFY_THREADS);
    struct crc_join j;
    for (int k = 0; k < 8; k++)
        j.shift[k] = tkv_crc32c_x8n((uint64_t)slice << k);
    j.init = tkv_crc32c_mulmod(0xFFFFFFFFu, tkv_crc32c_x8n(bytes));
    for (uint32_t j0 = 0; j0 < n; j0 += 65535u) { /* grid.x of one launch: any size; keep launches moderate */
        verify_kernel<<<TKV_MIN(65535u, n - j0), VERIFY_THREADS, 0, s>>>(table + j0, slice, j);
        cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess)
            return e;
    }
    return cudaSuccess;
}
