/*
 * attn-stats.c -- the CPU backend's attn_stats op (backend.h): the policies'
 * own statistics (tkv_attn_stats_heads, runtime/policy/policy-util.c), one
 * KV head per thread of the pool. Each head is computed by exactly the code
 * the policies run without a backend, so the results are theirs bit for
 * bit; this is the reference the CUDA kernels (gpu/stats.cu) are checked
 * against.
 */
#include "../runtime/policy/policy.h"
#include "cpu.h"

struct stats_job {
    struct tkv_cpu_backend *cb;
    const struct tkv_attn_stats_args *a;
    uint32_t n_blocks, scratch;
    bool failed; /* out of memory in some thread (the heads' only failure) */
};

static void stats_worker(void *ctx, uint32_t ith, uint32_t nth)
{
    struct stats_job *j = ctx;
    uint64_t g0, g1;
    tkv_split(j->a->n_head_kv, ith, nth, &g0, &g1);
    if (g0 == g1)
        return;
    float *scratch = tkv_cpu_scratch(j->cb, ith, j->scratch);
    if (!scratch || tkv_attn_stats_heads(j->a, j->n_blocks, (uint32_t)g0, (uint32_t)g1, scratch) != TKV_OK)
        j->failed = true;
}

tkv_status tkv_cpu_attn_stats(struct tkv_cpu_backend *cb, const struct tkv_attn_stats_args *a)
{
    uint32_t nb;
    TKV_TRY(tkv_attn_stats_check(a, &nb));
    struct stats_job job = {.cb = cb, .a = a, .n_blocks = nb};
    job.scratch = TKV_MAX(TKV_MAX(nb, a->kind == TKV_ATTN_STATS_WINDOW ? a->n_prefix : 0u), 1u);
    tkv_pool_run(cb->pool, stats_worker, &job);
    if (job.failed)
        return tkv_err(TKV_ERR_NOMEM, "cpu: attn_stats: out of memory");
    return TKV_OK;
}
