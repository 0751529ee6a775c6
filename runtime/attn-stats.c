/* attn-stats.c -- the argument check every backend's attn_stats op shares
 * (the contract is in backend.h). */
#include "backend.h"

tkv_status tkv_attn_stats_check(const struct tkv_attn_stats_args *a, uint32_t *n_blocks)
{
    *n_blocks = 0;
    if (!a || !a->kv)
        return tkv_err(TKV_ERR_INVALID_ARG, "attn_stats: NULL argument");
    if (a->kind != TKV_ATTN_STATS_SEGMENT && a->kind != TKV_ATTN_STATS_WINDOW)
        return tkv_err(TKV_ERR_INVALID_ARG, "attn_stats: unknown kind %d", (int)a->kind);
    if (a->n_head == 0 || a->n_head_kv == 0 || a->n_head % a->n_head_kv != 0)
        return tkv_err(TKV_ERR_INVALID_ARG, "attn_stats: %u query heads not a multiple of %u KV heads", a->n_head,
                       a->n_head_kv);
    if (a->head_dim == 0 || a->head_dim > 1024)
        return tkv_err(TKV_ERR_INVALID_ARG, "attn_stats: head_dim %u out of range", a->head_dim);
    if (a->n_past > INT32_MAX)
        return tkv_err(TKV_ERR_INVALID_ARG, "attn_stats: n_past %u out of range", a->n_past);
    if (a->n_q && !a->q)
        return tkv_err(TKV_ERR_INVALID_ARG, "attn_stats: q is NULL");
    if (a->kind == TKV_ATTN_STATS_SEGMENT) {
        if (a->block == 0)
            return tkv_err(TKV_ERR_INVALID_ARG, "attn_stats: block of 0 tokens");
        if (a->n_q > a->n_past)
            return tkv_err(TKV_ERR_INVALID_ARG, "attn_stats: a segment of %u queries ending at %u", a->n_q, a->n_past);
        const uint32_t nb = a->n_q ? (a->n_past - a->n_q) / a->block : 0;
        if (a->probs && a->probs_stride < nb)
            return tkv_err(TKV_ERR_INVALID_ARG, "attn_stats: probs_stride %u below the %u blocks", a->probs_stride,
                           nb);
        *n_blocks = nb;
        return TKV_OK;
    }
    if (a->n_q && !a->q_pos)
        return tkv_err(TKV_ERR_INVALID_ARG, "attn_stats: q_pos is NULL");
    if (a->n_prefix && !a->scores)
        return tkv_err(TKV_ERR_INVALID_ARG, "attn_stats: scores is NULL");
    if (a->pool > 1 && (a->pool % 2 == 0 || a->pool > 1025 || (a->pool_kind != 'm' && a->pool_kind != 'a')))
        return tkv_err(TKV_ERR_INVALID_ARG, "attn_stats: pooling '%c' with kernel %u (odd, at most 1025; m or a)",
                       a->pool_kind ? a->pool_kind : '?', a->pool);
    return TKV_OK;
}
