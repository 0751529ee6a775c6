/*
 * snapkv.c -- SnapKV and AdaKV: compress once after the prefill, scoring
 * every prompt position by the attention the last `window` prompt queries
 * pay it (averaged over the group's query heads: one kept set per KV head),
 * pooled over neighbouring positions.
 *
 *   snapkv  per head: the top (budget - window) positions + the window.
 *   adakv   the layer's top H*(budget - window) positions over all heads
 *           together decide how many each head keeps, with a floor of
 *           alpha*(budget - window) per head; then per-head top-k + window.
 *
 * Tokens generated later are always attended. Parameters: window (32),
 * kernel (7), pool (max|avg), budget (--kv-budget, default 1024), and for
 * adakv alpha (0.2). Evicted tokens are not attended (dropped); see
 * docs/policies.md.
 */
#include "policy.h"

#include <math.h>
#include <stdlib.h>

struct snapkv {
    struct tkv_policy_env env;
    uint32_t window, kernel, budget;
    char pool;
    bool ada;
    float alpha;
    struct tkv_kept kept;
};

static tkv_status create(const struct tkv_policy_env *env, const struct tkv_policy_args *args, void **state, bool ada)
{
    const char *name = ada ? "adakv" : "snapkv";
    struct snapkv p = {.env = *env, .window = 32, .kernel = 7, .budget = env->budget ? env->budget : 1024,
                       .pool = 'm', .ada = ada, .alpha = 0.2f};
    static const char *const known_snap[] = {"window", "kernel", "pool", "budget", NULL};
    static const char *const known_ada[] = {"window", "kernel", "pool", "budget", "alpha", NULL};
    TKV_TRY(tkv_policy_arg_u32(name, args, "window", &p.window));
    TKV_TRY(tkv_policy_arg_u32(name, args, "kernel", &p.kernel));
    TKV_TRY(tkv_policy_arg_u32(name, args, "budget", &p.budget));
    if (ada)
        TKV_TRY(tkv_policy_arg_f32(name, args, "alpha", &p.alpha));
    for (uint32_t i = 0; i < args->n; i++)
        if (!strcmp(args->key[i], "pool")) {
            if (strcmp(args->value[i], "max") && strcmp(args->value[i], "avg"))
                return tkv_err(TKV_ERR_INVALID_ARG, "policy '%s': pool=%s (expected max or avg)", name, args->value[i]);
            p.pool = args->value[i][0] == 'm' ? 'm' : 'a';
        }
    TKV_TRY(tkv_policy_args_done(name, args, ada ? known_ada : known_snap));
    if (p.window == 0 || p.window > 32 || p.budget <= p.window || p.kernel % 2 == 0 || p.kernel > 1025 ||
        p.alpha < 0 || p.alpha > 1)
        return tkv_err(TKV_ERR_INVALID_ARG,
                       "policy '%s': need 0 < window <= 32 < budget, an odd kernel <= 1025 and alpha in [0, 1] (window=%u, "
                       "budget=%u, kernel=%u)",
                       name, p.window, p.budget, p.kernel);
    struct snapkv *s = malloc(sizeof *s);
    if (!s)
        return tkv_err(TKV_ERR_NOMEM, "policy '%s': out of memory", name);
    *s = p;
    tkv_status st = tkv_kept_init(&s->kept, env->n_layer, env->n_head_kv);
    if (st != TKV_OK) {
        free(s);
        return st;
    }
    *state = s;
    return TKV_OK;
}

static tkv_status snapkv_create(const struct tkv_policy_env *env, const struct tkv_policy_args *args, void **state)
{
    return create(env, args, state, false);
}

static tkv_status adakv_create(const struct tkv_policy_env *env, const struct tkv_policy_args *args, void **state)
{
    return create(env, args, state, true);
}

static void destroy(void *state)
{
    struct snapkv *s = state;
    tkv_kept_free(&s->kept);
    free(s);
}

static void reset(void *state) { tkv_kept_reset(&((struct snapkv *)state)->kept); }

static tkv_status after_prefill(void *state, const struct tkv_policy_view *v)
{
    struct snapkv *s = state;
    const uint32_t n = v->n_past, w = TKV_MIN(s->window, v->n_q), H = s->env.n_head_kv;
    if (n <= s->budget || w == 0)
        return TKV_OK; /* nothing to compress: attend everything */
    const uint32_t n_prefix = n - w, keep = s->budget - w;
    struct tkv_policy_view win = *v; /* the last w observation queries */
    win.q = v->q + (size_t)(v->n_q - w) * s->env.n_head * s->env.head_dim;
    win.q_pos = v->q_pos + (v->n_q - w);
    win.n_q = w;
    float *score = malloc((size_t)H * n_prefix * sizeof *score);
    uint32_t *idx = malloc((size_t)n_prefix * sizeof *idx), cap[256];
    struct tkv_range *r = malloc(((size_t)n_prefix + 2) * sizeof *r);
    tkv_status st = TKV_OK;
    if (!score || !idx || !r || H > 256) {
        st = tkv_err(TKV_ERR_NOMEM, "policy: out of memory");
        goto out;
    }
    /* every head's pooled scores in one backend call */
    if ((st = tkv_policy_window_stats(&win, &s->env, n_prefix, s->kernel, s->pool, score)) != TKV_OK)
        goto out;
    if (s->ada) {
        const float *rows[256];
        for (uint32_t g = 0; g < H; g++)
            rows[g] = score + (size_t)g * n_prefix;
        tkv_adakv_allocate(rows, H, n_prefix, keep, s->alpha, cap);
    } else {
        for (uint32_t g = 0; g < H; g++)
            cap[g] = keep;
    }
    for (uint32_t g = 0; g < H && st == TKV_OK; g++) {
        uint32_t k = tkv_policy_top_k(score + (size_t)g * n_prefix, n_prefix, cap[g], idx);
        int m = tkv_policy_ranges(idx, k, n_prefix, n, r, n_prefix + 2);
        st = tkv_kept_set(&s->kept, v->layer, g, r, (uint32_t)m);
    }
out:
    free(score);
    free(idx);
    free(r);
    return st;
}

static int decode_select(void *state, const struct tkv_policy_view *v, uint32_t head, struct tkv_range *out,
                         uint32_t cap)
{
    const struct snapkv *s = state;
    return tkv_kept_select(&s->kept, v->layer, head, v->n_prompt, v->n_past, out, cap);
}

void tkv_adakv_allocate(const float *const *score, uint32_t n_head, uint32_t n, uint32_t per_head, float alpha,
                        uint32_t *cap)
{
    const uint64_t total = (uint64_t)n_head * per_head;
    /* the threshold: the total-th largest score over all heads */
    float *all = malloc((size_t)n_head * n * sizeof *all);
    uint32_t cnt[256] = {0};
    if (all && total < (uint64_t)n_head * n) {
        for (uint32_t g = 0; g < n_head; g++)
            memcpy(all + (size_t)g * n, score[g], n * sizeof *all);
        uint32_t *idx = malloc((size_t)total * sizeof *idx);
        if (idx) {
            uint32_t k = tkv_policy_top_k(all, n_head * n, (uint32_t)total, idx);
            for (uint32_t i = 0; i < k; i++)
                cnt[idx[i] / n]++;
            free(idx);
        }
    } else {
        for (uint32_t g = 0; g < n_head; g++)
            cnt[g] = TKV_MIN(per_head, n);
    }
    free(all);
    /* the floor: cap = cnt*(1-alpha) + floor(alpha*per_head), then fix the
     * rounding so the caps sum to exactly the total (none above n) */
    int64_t sum = 0;
    for (uint32_t g = 0; g < n_head; g++) {
        cap[g] = (uint32_t)lroundf(cnt[g] * (1 - alpha) + floorf(alpha * per_head));
        cap[g] = TKV_MIN(cap[g], n);
        sum += cap[g];
    }
    const int64_t target = (int64_t)TKV_MIN(total, (uint64_t)n_head * n);
    for (uint32_t g = 0; sum != target; g = (g + 1) % n_head) {
        if (sum < target && cap[g] < n)
            cap[g]++, sum++;
        else if (sum > target && cap[g] > 0)
            cap[g]--, sum--;
    }
}

const struct tkv_policy_ops tkv_policy_snapkv = {
    .name = "snapkv",
    .help = "SnapKV after prefill: window=32, kernel=7, pool=max, budget tokens per KV head",
    .create = snapkv_create,
    .destroy = destroy,
    .after_prefill = after_prefill,
    .decode_select = decode_select,
    .reset = reset,
};

const struct tkv_policy_ops tkv_policy_adakv = {
    .name = "adakv",
    .help = "AdaKV after prefill: SnapKV scores, shared top-k across heads, alpha=0.2 floor",
    .create = adakv_create,
    .destroy = destroy,
    .after_prefill = after_prefill,
    .decode_select = decode_select,
    .reset = reset,
};
