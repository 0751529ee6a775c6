/*
 * stats.cuh -- the attention statistics the KV policies score keys with, on
 * the GPU (the device side of backend.h's attn_stats op):
 *
 *   SEGMENT  per KV head, the block distribution of a prefill segment
 *            (CritiPrefill/EntropyInfer estimator) and its Shannon entropy;
 *   WINDOW   per KV head, SnapKV's window scores over every key, pooled.
 *
 * Paged KV descriptor (device memory), as for attention but keys only:
 *     blocks   [head_off[n_head_kv]]  the blocks of KV head g at
 *                                     [head_off[g], head_off[g+1]), in
 *                                     position order, no gaps
 *     entry.k                         [B, head_dim] f16, rows 0..n-1 valid,
 *                                     row j at position pos0 + j
 * Queries q [n_q, n_head*head_dim] f32 (device); query head h belongs to KV
 * head h / (n_head / n_head_kv).
 *
 * Both statistics are computed with the reference's own operations in its
 * order wherever the order changes the rounding (runtime/policy/policy-util.c:
 * f32 dot products summed in order, f64 block scores,
 * softmax sums in f64, per-key accumulation over the window's rows in row
 * order), so the results match the CPU backend to a few ulps (docs/gpu.md).
 *
 * Limits: head_dim at most 256 (tkv_cuda_stats_supported).
 */
#ifndef TKV_GPU_STATS_CUH
#define TKV_GPU_STATS_CUH

#include "common.cuh"

struct tkv_cuda_stats_block {
    const uint16_t *k; /* [B, head_dim] f16 */
    int32_t pos0;
    uint32_t n;
};

struct tkv_cuda_stats_params {
    int kind;                                  /* TKV_ATTN_STATS_SEGMENT or _WINDOW   */
    const float *q;                            /* [n_q, n_head*head_dim]              */
    const int32_t *q_pos;                      /* [n_q] (WINDOW)                      */
    const struct tkv_cuda_stats_block *blocks; /* [head_off[n_head_kv]]               */
    const uint32_t *head_off;                  /* [n_head_kv + 1]                     */
    uint32_t n_q, n_head, n_head_kv, head_dim;
    uint32_t n_past;                           /* keys at positions < n_past           */
    uint32_t max_blocks;                       /* most blocks of one KV head           */
    /* SEGMENT */
    uint32_t block, n_blocks;                  /* n_blocks = (n_past - n_q) / block    */
    /* WINDOW */
    uint32_t n_prefix, pool;                   /* pool <= 1: none                      */
    int pool_max;                              /* 1: max pooling, 0: average           */
    float scale;                               /* 1/sqrt(head_dim), computed as the CPU does */
    uint32_t n_split;                          /* key splits per head (plan)           */
    void *work;                                /* device, tkv_cuda_stats_plan's bytes  */
    /* outputs, in work (set by tkv_cuda_stats) */
    float *probs;                              /* SEGMENT [n_head_kv][n_blocks]        */
    double *entropy;                           /* SEGMENT [n_head_kv]                  */
    float *scores;                             /* WINDOW  [n_head_kv][n_prefix]        */
};

/* head_dim the kernels handle. */
bool tkv_cuda_stats_supported(uint32_t head_dim);

/* Chooses p->n_split for a device of n_sm multiprocessors and returns the
 * bytes of device work memory p->work must hold. */
size_t tkv_cuda_stats_plan(struct tkv_cuda_stats_params *p, int n_sm);

/* Queues the statistic on s and sets p->probs / entropy / scores (inside
 * p->work), which hold the results once s reaches them. Needs n_blocks > 0
 * (SEGMENT) or n_q > 0 and n_prefix > 0 (WINDOW). */
cudaError_t tkv_cuda_stats(struct tkv_cuda_stats_params *p, cudaStream_t s);

#endif
