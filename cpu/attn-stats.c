/*
 * attn-stats.c -- the CPU backend's attn_stats op (backend.h): the policies'
 * own statistics (runtime/policy/policy-util.c), one KV head per thread of
 * the pool. Each head is computed by exactly the code the policies call, so
 * the results are theirs bit for bit; this is the reference the CUDA kernels
 * (gpu/stats.cu) are checked against.
 */
#include "../runtime/policy/policy.h"
#include "cpu.h"

#include <stdlib.h>

struct stats_job {
    struct tkv_cpu_backend *cb;
    const struct tkv_attn_stats_args *a;
    struct tkv_policy_view v;
    struct tkv_policy_env env;
    uint32_t n_blocks;
    bool failed; /* out of memory in some thread */
};

static void stats_worker(void *ctx, uint32_t ith, uint32_t nth)
{
    struct stats_job *j = ctx;
    const struct tkv_attn_stats_args *a = j->a;
    uint64_t g0, g1;
    tkv_split(a->n_head_kv, ith, nth, &g0, &g1);
    if (g0 == g1)
        return;
    if (a->kind == TKV_ATTN_STATS_SEGMENT) {
        float *P = a->probs ? NULL : tkv_cpu_scratch(j->cb, ith, TKV_MAX(j->n_blocks, 1u));
        if (!a->probs && !P) {
            j->failed = true;
            return;
        }
        for (uint64_t g = g0; g < g1; g++) {
            float *row = a->probs ? a->probs + g * a->probs_stride : P;
            const uint32_t nb = tkv_segment_block_probs(&j->v, &j->env, (uint32_t)g, a->block, row);
            if (nb != j->n_blocks) { /* 0 where blocks exist: its scratch allocation failed */
                j->failed = true;
                return;
            }
            if (a->entropy)
                a->entropy[g] = tkv_entropy(row, nb);
        }
        return;
    }
    float *tmp = tkv_cpu_scratch(j->cb, ith, TKV_MAX(a->n_prefix, 1u));
    if (!tmp) {
        j->failed = true;
        return;
    }
    for (uint64_t g = g0; g < g1; g++) {
        float *score = a->scores + g * a->n_prefix;
        if (tkv_policy_window_scores(&j->v, &j->env, (uint32_t)g, a->n_prefix, score) != TKV_OK) {
            j->failed = true;
            return;
        }
        if (a->pool > 1)
            tkv_policy_pool(score, tmp, a->n_prefix, a->pool, a->pool_kind);
    }
}

tkv_status tkv_cpu_attn_stats(struct tkv_cpu_backend *cb, const struct tkv_attn_stats_args *a)
{
    uint32_t nb;
    TKV_TRY(tkv_attn_stats_check(a, &nb));
    struct stats_job job = {
        .cb = cb,
        .a = a,
        .v = {.n_past = a->n_past, .q = a->q, .q_pos = a->q_pos, .n_q = a->n_q, .kv = a->kv},
        .env = {.n_head = a->n_head, .n_head_kv = a->n_head_kv, .head_dim = a->head_dim},
        .n_blocks = nb,
    };
    if (a->kind == TKV_ATTN_STATS_WINDOW && a->n_prefix == 0)
        return TKV_OK;
    if (a->kind == TKV_ATTN_STATS_WINDOW && (a->n_q == 0 || a->n_past == 0)) { /* no query or no key */
        memset(a->scores, 0, (size_t)a->n_head_kv * a->n_prefix * sizeof(float));
        return TKV_OK;
    }
    tkv_pool_run(cb->pool, stats_worker, &job);
    if (job.failed)
        return tkv_err(TKV_ERR_NOMEM, "cpu: attn_stats: out of memory");
    return TKV_OK;
}
