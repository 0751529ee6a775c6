/*
 * copy.cuh -- gathering KV blocks from page-locked host memory into device
 * memory with one kernel launch (the KV store's recalls and prefetches).
 *
 * The store moves many small blocks (16-64 KiB) at once. One cudaMemcpyAsync
 * per block costs a few microseconds of driver and copy-engine setup each,
 * more than the transfer itself at PCIe 5 rates, so a layer's recall ran at a
 * few percent of the link. Here every CTA of one launch copies a 16 KiB chunk
 * of one block, reading the host memory directly over the link (mapped,
 * registered memory that the device addresses with the host pointer), with
 * four 16-byte loads in flight per thread; enough CTAs keep the link busy.
 */
#ifndef TKV_GPU_COPY_CUH
#define TKV_GPU_COPY_CUH

#include "common.cuh"

/* One copy: `bytes` from src (host pointer, device-accessible) to dst;
 * with verification, crc is the expected CRC-32C of the bytes and bad is set
 * to 1 when the copy that landed does not match it (else 0). */
struct tkv_cuda_copy {
    const void *src;
    void *dst;
    uint32_t crc;
    uint32_t bad;
};

/* Copies table[0..n) of `bytes` each; table is device-readable memory (a
 * pinned host buffer works). bytes must be a multiple of 16 and src/dst
 * 16-byte aligned (tkv_cuda_gather_ok). */
cudaError_t tkv_cuda_gather(const struct tkv_cuda_copy *table, uint32_t n, size_t bytes, cudaStream_t s);

/* Sets table[j].bad for j < n: the CRC-32C of table[j].dst's `bytes` (device
 * memory) against table[j].crc. One CTA per copy: each of 256 threads takes
 * the CRC register of a 1/256 slice, and a tree joins them with the shift
 * constants of tiers/crc32c.h. bytes must be a multiple of 4096
 * (tkv_cuda_verify_ok). */
cudaError_t tkv_cuda_verify(struct tkv_cuda_copy *table, uint32_t n, size_t bytes, cudaStream_t s);

static inline bool tkv_cuda_verify_ok(size_t bytes) { return bytes > 0 && bytes % 4096 == 0; }

static inline bool tkv_cuda_gather_ok(const void *src, const void *dst, size_t bytes)
{
    return bytes % 16 == 0 && (uintptr_t)src % 16 == 0 && (uintptr_t)dst % 16 == 0;
}

#endif
