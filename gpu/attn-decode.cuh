/*
 * attn-decode.cuh -- the decode attention kernel (a few query rows per KV
 * head): split-K flash decoding over paged f16 KV blocks, streamed with
 * cp.async, merged by log-sum-exp. Internal to gpu/attn*.cu; the backend
 * reaches it through tkv_cuda_attention (attn.cuh).
 *
 * Work split: one CTA of 4 warps per (KV head, key split); a split is a
 * contiguous range of the head's blocks. Inside a CTA the range is cut into
 * chunks of keys (8 16-byte loads of K and of V per lane, 4 for 8 rows),
 * dealt to the warps round-robin, each warp streaming its chunks through a
 * 3-stage cp.async pipeline of its own. All query rows of the KV head (the G
 * query heads of the group x n_q tokens, at most TKV_ATTN_DECODE_ROWS) are
 * computed together from each K/V chunk, so the KV is read once per head.
 *
 * With n_split > 1 every CTA writes an unnormalised partial in the decode
 * layout
 *     O  part[(split * n_rows + row) * head_dim + d]            f32
 *     ML part[n_split * n_rows * head_dim + (split * n_rows + row) * 2 + {0,1}]
 *                                                  (m in log2 units, l)
 * (n_rows = n_q * n_head) and the partials are merged either by the last CTA
 * of each KV head to finish (every mode but MERGE: needs p->counters) or by
 * a second kernel (TKV_ATTN_DECODE_MERGE).
 *
 * Two ways to find the blocks: the packed table in device memory (head_off,
 * blocks; a CTA takes a contiguous range of its head's blocks), or the
 * inline runs of tkv_cuda_attn_runs (attn.cuh; a CTA takes a contiguous
 * range of its head's chunks, so the splits are equal to a chunk whatever
 * the block count, and the first loads wait on no table read).
 */
#ifndef TKV_GPU_ATTN_DECODE_CUH
#define TKV_GPU_ATTN_DECODE_CUH

#include "attn.cuh"

/* Query rows per KV head (n_q x G) the decode kernel takes. */
#define TKV_ATTN_DECODE_ROWS 8u
/* Most key splits per KV head (bounds the merge's shared memory). */
#define TKV_ATTN_DECODE_MAX_SPLIT 512u

/* Once per process and device: shared-memory limits, occupancy. */
cudaError_t tkv_cuda_attn_decode_init(void);

/* CTAs of the kernel that serves (head_dim, rows) resident per SM (mma:
 * tkv_cuda_attn_params.decode_mma). */
int tkv_cuda_attn_decode_ctas_per_sm(uint32_t head_dim, uint32_t rows, bool mma);

/* Runs the decode kernel (and the merge kernel in TKV_ATTN_DECODE_MERGE
 * mode). Needs p->vec16 and n_q * G <= TKV_ATTN_DECODE_ROWS. */
cudaError_t tkv_cuda_attn_decode(const struct tkv_cuda_attn_params *p, cudaStream_t s);

/* The same over device views whose query positions and head ranges are
 * in v (p->q_pos, head_off and head_end unused): no table to stage. Needs
 * n_q * G <= TKV_ATTN_DECODE_ROWS and n_head_kv <= TKV_ATTN_RUNS_HEADS. */
cudaError_t tkv_cuda_attn_decode_views(const struct tkv_cuda_attn_params *p, const struct tkv_cuda_attn_views *v,
                                       cudaStream_t s);

/* Keys per chunk of the kernel that serves (head_dim, rows): a run of more
 * than one block needs blocks of a multiple of it (attn.cuh). */
uint32_t tkv_cuda_attn_decode_chunk_keys(uint32_t head_dim, uint32_t rows);

/* The decode kernel over inline runs r (p->blocks, head_off, q_pos unused;
 * p->n_split set by the caller, at most TKV_ATTN_DECODE_MAX_SPLIT). pdl:
 * launched as a programmatic dependent launch. Needs n_q * G <=
 * TKV_ATTN_DECODE_ROWS, n_head_kv <= TKV_ATTN_RUNS_HEADS, 16-byte aligned
 * rows; the fused merge (p->counters) when split. */
cudaError_t tkv_cuda_attn_decode_runs(const struct tkv_cuda_attn_params *p, const struct tkv_cuda_attn_runs *r,
                                      bool pdl, cudaStream_t s);

#endif
