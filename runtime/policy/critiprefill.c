/*
 * critiprefill.c -- CritiPrefill: segment-sparse prefill.
 *
 * Queries are taken in segments (the prefill chunks, `segment` tokens) and
 * keys in `block`-token blocks. Each segment's queries attend to the top
 * budget/block blocks by the segment estimator (tkv_segment_block_probs),
 * optionally smoothed across layers (P = fusion*P_prev + (1-fusion)*P for
 * layers >= 2), plus the segment itself. Dense: layers < layer_skip,
 * segments starting before `threshold`, and the last segment of the prompt.
 * Decode attends the whole cache. Defaults (the paper's experiment scripts):
 * segment 512, block 32, budget 2048, threshold 4096, fusion 0.25,
 * layer_skip 1.
 */
#include "policy.h"

#include <stdlib.h>

struct critiprefill {
    struct tkv_policy_env env;
    uint32_t segment, block, budget, threshold, layer_skip;
    float fusion;
    float *P, *prev;          /* [n_head_kv][max_blocks]        */
    uint32_t nb;              /* blocks in P (0: dense)           */
    uint32_t p_layer, p_past, p_nq; /* the segment P was scored for  */
    uint32_t *n_prev;         /* [n_head_kv] valid entries        */
    uint32_t *prev_layer, *prev_seg; /* [n_head_kv] what prev holds */
    uint32_t *idx;            /* [max_blocks] + top-k scratch [2 max_blocks] */
    uint32_t max_blocks;
};

static uint32_t crit_segment(void *state) { return ((struct critiprefill *)state)->segment; }

static void crit_destroy(void *state)
{
    struct critiprefill *c = state;
    if (!c)
        return;
    free(c->P), free(c->prev), free(c->n_prev), free(c->prev_layer), free(c->prev_seg), free(c->idx);
    free(c);
}

static tkv_status crit_create(const struct tkv_policy_env *env, const struct tkv_policy_args *args, void **state)
{
    struct critiprefill p = {.env = *env, .segment = 512, .block = 32, .budget = env->budget ? env->budget : 2048,
                             .threshold = 4096, .layer_skip = 1, .fusion = 0.25f};
    static const char *const known[] = {"segment", "block", "budget", "threshold", "layer_skip", "fusion", NULL};
    TKV_TRY(tkv_policy_arg_u32("critiprefill", args, "segment", &p.segment));
    TKV_TRY(tkv_policy_arg_u32("critiprefill", args, "block", &p.block));
    TKV_TRY(tkv_policy_arg_u32("critiprefill", args, "budget", &p.budget));
    TKV_TRY(tkv_policy_arg_u32("critiprefill", args, "threshold", &p.threshold));
    TKV_TRY(tkv_policy_arg_u32("critiprefill", args, "layer_skip", &p.layer_skip));
    TKV_TRY(tkv_policy_arg_f32("critiprefill", args, "fusion", &p.fusion));
    TKV_TRY(tkv_policy_args_done("critiprefill", args, known));
    if (p.block == 0 || p.segment == 0 || p.segment % p.block || p.budget < p.block || p.fusion < 0 || p.fusion >= 1)
        return tkv_err(TKV_ERR_INVALID_ARG,
                       "policy 'critiprefill': need block > 0 dividing segment, budget >= block, fusion in [0, 1)");
    struct critiprefill *c = calloc(1, sizeof *c);
    if (!c)
        return tkv_err(TKV_ERR_NOMEM, "policy 'critiprefill': out of memory");
    *c = p;
    c->max_blocks = env->n_ctx / p.block + 1;
    const size_t n = (size_t)env->n_head_kv * c->max_blocks;
    c->P = malloc(n * sizeof *c->P);
    c->prev = malloc(n * sizeof *c->prev);
    c->n_prev = calloc(env->n_head_kv, sizeof *c->n_prev);
    c->prev_layer = calloc(env->n_head_kv, sizeof *c->prev_layer);
    c->prev_seg = calloc(env->n_head_kv, sizeof *c->prev_seg);
    c->idx = malloc((size_t)3 * c->max_blocks * sizeof *c->idx);
    if (!c->P || !c->prev || !c->n_prev || !c->prev_layer || !c->prev_seg || !c->idx) {
        crit_destroy(c);
        return tkv_err(TKV_ERR_NOMEM, "policy 'critiprefill': out of memory");
    }
    *state = c;
    return TKV_OK;
}

static int crit_prefill(void *state, const struct tkv_policy_view *v, uint32_t head, struct tkv_range *out,
                        uint32_t cap)
{
    struct critiprefill *c = state;
    const uint32_t seg_start = v->n_past - v->n_q;
    if (v->layer < c->layer_skip || seg_start < c->threshold || v->n_past >= v->prefill_end)
        return -1;
    /* every head's distribution in one backend call, at head 0 (or for a
     * segment not scored yet) */
    if (head == 0 || c->p_layer != v->layer || c->p_past != v->n_past || c->p_nq != v->n_q) {
        c->p_layer = v->layer, c->p_past = v->n_past, c->p_nq = v->n_q;
        if (tkv_policy_segment_stats(v, &c->env, c->block, c->P, c->max_blocks, NULL, &c->nb) != TKV_OK) {
            TKV_LOG_W("policy 'critiprefill': layer %u: %s", v->layer, tkv_last_error());
            c->nb = 0; /* the segment stays dense */
        }
    }
    float *P = c->P + (size_t)head * c->max_blocks, *prev = c->prev + (size_t)head * c->max_blocks;
    const uint32_t nb = c->nb;
    if (nb == 0)
        return -1;
    /* cross-layer smoothing with the previous layer's distribution for this segment */
    if (c->fusion > 0 && v->layer >= 2 && c->prev_layer[head] + 1 == v->layer && c->prev_seg[head] == seg_start &&
        c->n_prev[head] == nb)
        for (uint32_t j = 0; j < nb; j++)
            P[j] = c->fusion * prev[j] + (1 - c->fusion) * P[j];
    memcpy(prev, P, nb * sizeof *P);
    c->n_prev[head] = nb;
    c->prev_layer[head] = v->layer;
    c->prev_seg[head] = seg_start;
    const uint32_t k = tkv_policy_top_k_scratch(P, nb, c->budget / c->block, c->idx, c->idx + c->max_blocks);
    return (int)tkv_policy_block_ranges(c->idx, k, c->block, out, cap);
}

/* Every segment starts before the threshold, or is the last one. */
static bool crit_dense(void *state, uint32_t n)
{
    const struct critiprefill *c = state;
    const uint32_t n_seg = (n + c->segment - 1) / c->segment, dense_segs = (c->threshold + c->segment - 1) / c->segment;
    return n_seg <= dense_segs + 1;
}

const struct tkv_policy_ops tkv_policy_critiprefill = {
    .name = "critiprefill",
    .help = "segment-sparse prefill (CritiPrefill): segment=512, block=32, budget=2048, threshold=4096, fusion=0.25",
    .changes_prefill = true,
    .create = crit_create,
    .destroy = crit_destroy,
    .prefill_select = crit_prefill,
    .segment = crit_segment,
    .prefill_dense = crit_dense,
};
