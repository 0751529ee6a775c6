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

/* Where the CTAs of one kv_table launch publish their rounds' totals for
 * each other (device memory, [cap] slots of a (head, round) each, zero
 * when allocated): a slot's totals count for a launch once its flag holds
 * the launch's seq, which grows by one per launch, so nothing is cleared
 * between launches. One per backend (tkv_cuda_kvt_sync_reserve). */
struct tkv_cuda_kvt_sync {
    uint32_t *flag;
    uint4 *tot;     /* slices resident, slices missing, positions, blocks touched */
    uint32_t cap;   /* slots                                                     */
    uint32_t seq;   /* the last launch's                                         */
};

/* Grows sy to hold the slots of a call's launches (up to
 * TKV_CUDA_KVT_GROUP heads x the call's rounds; waits for the stream first
 * when it must reallocate). */
cudaError_t tkv_cuda_kvt_sync_reserve(struct tkv_cuda_kvt_sync *sy, const struct tkv_kv_table_args *a, cudaStream_t s);
void tkv_cuda_kvt_sync_free(struct tkv_cuda_kvt_sync *sy);

/* backend.h's kv_table: every pointer of a in device memory but a->sel_n
 * (host), which goes into the kernel's parameters (a launch per
 * TKV_CUDA_KVT_GROUP heads), so nothing is staged before it. A CTA per (KV
 * head, round of KVT_THREADS blocks): each thread counts its block's slices
 * word by word and a block-wide scan places them within the round; the
 * round's totals go to sy, and each CTA starts its slices after the sum of
 * the earlier rounds' (it waits for their flags; CTAs start in block
 * order, so the ones it waits for have started), so the slices keep
 * position order and every entry is the one-CTA-per-head walk's. pdl: a
 * programmatic dependent launch (common.cuh). sy reserved for the call. */
#define TKV_CUDA_KVT_GROUP 64
cudaError_t tkv_cuda_kv_table(const struct tkv_kv_table_args *a, struct tkv_cuda_kvt_sync *sy, bool pdl, cudaStream_t s);

#endif /* TKV_GPU_KV_TABLE_CUH */
