/*
 * attn.cuh -- attention of query tokens over paged f16 KV blocks (the GPU
 * side of backend.h's attention op): grouped-query, causal by positions,
 * online softmax in f32, optional log-sum-exp output, split-K over blocks
 * with an exact log-sum-exp merge.
 *
 * Paged KV descriptor (device memory), FlashInfer style:
 *     blocks   [head_off[n_head_kv]]  one entry per block, the blocks of KV
 *                                     head g at [head_off[g], head_off[g+1]),
 *                                     in position order
 *     entry.k, entry.v               [B, head_dim] f16, rows 0..n-1 valid,
 *                                     row j at position pos0 + j
 * Queries q [n_q, n_head*head_dim] f32, positions q_pos [n_q] (device,
 * non-decreasing); query head h reads KV head h / (n_head / n_head_kv).
 *
 * Work split: the query rows of one KV head (n_q tokens x G heads of the
 * group, flattened token-major) are cut into tiles of R rows; one CTA per
 * (row tile, KV head, key split) walks its share of the blocks in tiles of
 * 64 keys held in shared memory (S = Q K^T, online softmax, O += P V, all
 * f32 on CUDA cores). With n_split > 1 each CTA writes an unnormalised
 * partial (O, m, l) and a merge kernel combines them.
 *
 * Limits: head_dim a multiple of 8, at most 256 (tkv_cuda_attn_supported).
 */
#ifndef TKV_GPU_ATTN_CUH
#define TKV_GPU_ATTN_CUH

#include "common.cuh"

struct tkv_cuda_kv_entry {
    const uint16_t *k; /* [B, head_dim] f16 */
    const uint16_t *v; /* [B, head_dim] f16 */
    int32_t pos0;
    uint32_t n;
};

struct tkv_cuda_attn_params {
    const float *q;                         /* [n_q, n_head*head_dim]           */
    const int32_t *q_pos;                   /* [n_q]                            */
    float *out;                             /* [n_q, n_head*head_dim]           */
    float *lse;                             /* [n_q, n_head] or NULL            */
    const struct tkv_cuda_kv_entry *blocks; /* [head_off[n_head_kv]]            */
    const uint32_t *head_off;               /* [n_head_kv + 1]                  */
    float *part;                            /* [n_split][n_q*n_head][hd + 2]    */
    uint32_t n_q, n_head, n_head_kv, head_dim;
    uint32_t n_split;                       /* set by tkv_cuda_attn_plan        */
    float scale_log2;                       /* scale * log2(e)                  */
    int vec16;                              /* all K/V rows 16-byte aligned     */
    int decode_kernel;                      /* allow the decode kernel (opt-in,
                                               not yet validated on a GPU)      */
};

/* head_dim the kernels handle. */
bool tkv_cuda_attn_supported(uint32_t head_dim);

/* Once per process and device: raises the kernels' shared-memory limit. */
cudaError_t tkv_cuda_attn_init(void);

/* Chooses p->n_split for a view of at most max_blocks blocks per KV head on
 * a device of n_sm multiprocessors; returns the floats of p->part needed (0
 * when the keys are not split). */
size_t tkv_cuda_attn_plan(struct tkv_cuda_attn_params *p, uint32_t max_blocks, int n_sm);

/* Runs the attention (and the merge when split). */
cudaError_t tkv_cuda_attention(const struct tkv_cuda_attn_params *p, cudaStream_t s);

#endif
