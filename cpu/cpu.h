/*
 * cpu.h -- the CPU backend (always built): quantized matmuls (cpu/quant.h),
 * OpenBLAS sgemm for prefill, attention over f16 KV blocks, all threaded on
 * one pool. Private to cpu/ and the backend registry.
 */
#ifndef TKV_CPU_H
#define TKV_CPU_H

#include "../runtime/backend.h"
#include "threadpool.h"

/* Per-thread scratch, grown on first use to the largest size asked for. */
struct tkv_cpu_scratch {
    float *buf;
    size_t cap; /* floats */
};

struct tkv_cpu_backend {
    struct tkv_backend base;
    struct tkv_pool *pool;
    uint32_t n_threads;
    struct tkv_cpu_scratch *scratch; /* [n_threads] */
    void  *act;                      /* activation rows quantized for vec_dot */
    size_t act_cap;
    float *partials;                 /* split-K attention partial results */
    size_t partials_cap;
    uint32_t *select_rows;           /* rabitq_select: a bitmap row per (head, query head) */
    size_t select_rows_cap;          /* words */
    bool attn_fused;                 /* attention of <= 8 rows per KV head by the
                                        AVX2 f16 kernels (attn.c), else sgemm
                                        tiles; TKV_CPU_ATTN=blas|fused */
};

tkv_status tkv_cpu_backend_create(uint32_t n_threads, struct tkv_backend **out);

/* Ensures thread ith's scratch holds n floats; NULL on out of memory. */
float *tkv_cpu_scratch(struct tkv_cpu_backend *cb, uint32_t ith, size_t n);

/* Attention (backend.h contract): the fast path, and the naive reference
 * (single-threaded, one score at a time) that tests compare it with.
 * tkv_cpu_attn_fused_ok: whether this CPU runs the fused kernels (AVX2,
 * FMA, F16C). */
tkv_status tkv_cpu_attention(struct tkv_cpu_backend *cb, const struct tkv_attn_args *a);
bool tkv_cpu_attn_fused_ok(void);
tkv_status tkv_cpu_attention_ref(const struct tkv_attn_args *a);

/* The policies' attention statistics (backend.h attn_stats; attn-stats.c). */
tkv_status tkv_cpu_attn_stats(struct tkv_cpu_backend *cb, const struct tkv_attn_stats_args *a);

#endif
