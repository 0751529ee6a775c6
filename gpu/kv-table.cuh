/*
 * kv-table.cuh -- the device side of backend.h's table_write and kv_table:
 * the KV store's page-table stores, and one layer's decode attention table
 * built from a selection bitmap and the page table (docs/rabitq.md, "Decode
 * without a host round trip per layer"). The contract, and the reference
 * these kernels must equal entry for entry, are backend.h's
 * (tkv_kv_table_ref in runtime/kv-table.c).
 */
#ifndef TKV_GPU_KV_TABLE_CUH
#define TKV_GPU_KV_TABLE_CUH

#include "common.cuh"

/* table[idx[i]] = val[i] for i < n (all device memory). */
cudaError_t tkv_cuda_table_write(uint64_t *table, const uint32_t *idx, const uint64_t *val, uint32_t n,
                                 cudaStream_t s);

/* backend.h's kv_table: every pointer of a in device memory but a->sel_n
 * (host), which goes into the kernel's parameters (a launch per
 * TKV_CUDA_KVT_GROUP heads), so nothing is staged before it. One CTA per
 * KV head walks the head's blocks a CTA-width at a time: each thread counts
 * its block's slices word by word, a block-wide scan places them, and the
 * thread writes them; the slices keep position order. pdl: a programmatic
 * dependent launch (common.cuh). */
#define TKV_CUDA_KVT_GROUP 64
cudaError_t tkv_cuda_kv_table(const struct tkv_kv_table_args *a, bool pdl, cudaStream_t s);

#endif /* TKV_GPU_KV_TABLE_CUH */
