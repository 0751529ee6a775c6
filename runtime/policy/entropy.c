/*
 * entropy.c -- EntropyInfer: entropy-guided segment-sparse prefill and
 * decode-time compression (shared spec entropyinfer.md, sections 3-4).
 *
 * Prefill, per layer and prefill segment (chunk), per KV head g: the block
 * distribution P of the segment estimator (tkv_segment_block_probs, blocks
 * of `block` tokens) and its entropy H. A head whose entropy stays below e_t
 * is Rigid (budget: base); otherwise Dynamic, with the budget recurrence
 *   ratio = clamp((H_s - H_{s-1}) / H_{s-1}, 0, 1 + delta)   (delta at s = 1)
 *   b_s   = clamp(b_{s-1} + alpha * base * (ratio - delta), base, 3 * base)
 * The segment attends to its top budget/block blocks plus itself. Dense:
 * layers < layer_skip, segments starting before `threshold`, the last one.
 *
 * Decode: after `gap` generated tokens, the cache is scored once SnapKV-style
 * with the last window/2 prompt queries and the first window/2 generated
 * ones (avg-pool 5) and each KV head keeps `keep` tokens (the recent window
 * included); tokens generated later are always attended. The default
 * variant fills the window with more prompt queries where fewer than
 * window/2 were generated (gap=0: the last `window`).
 *
 * Two variants share this file:
 *   entropy:faithful=1  as the released code behaves: Rigid only if below e_t
 *       in every segment so far (the released test looks at all segments;
 *       a chunked prefill can only look back), the layer's maximum block
 *       count for every head, threshold 4096, base 2048, keep = --kv-budget
 *       (1024 as released), one compression, evicted tokens dropped.
 *   entropy (default)  classification online with hysteresis (Rigid after
 *       `rigid_after` consecutive near-zero segments, Dynamic again on the
 *       first segment above e_t), per-head budgets, Rigid heads at base/4,
 *       re-selection every `resel` steps from the latest generated queries,
 *       budgets scaled to the prompt (base <= prompt/4, threshold <=
 *       prompt/4, both at least one segment), keep = --kv-budget.
 */
#include "policy.h"

#include <math.h>
#include <stdlib.h>

#define MAX_WINDOW 64

struct head_state {
    double h_prev;
    float budget;
    uint32_t low_run;   /* consecutive segments below e_t */
    bool rigid, dynamic_seen;
    uint32_t last_seg;  /* segment index of the last update */
};

struct entropy {
    struct tkv_policy_env env;
    bool faithful;
    uint32_t segment, block, threshold, layer_skip, base, gap, window, keep, resel, rigid_after, drop;
    float e_t, delta, alpha;
    struct head_state *hs;            /* [layer][head] */
    struct tkv_range *sel;            /* [head][max_ranges] selection of the current (layer, segment) */
    uint32_t *n_sel;                  /* [head]; UINT32_MAX = dense */
    uint32_t max_ranges;
    float *P;                         /* [head][max_blocks] this segment's distributions */
    uint32_t *idx;                    /* [max_blocks] + top-k scratch [2 max_blocks] */
    uint32_t max_blocks;
    /* decode */
    float *obs;                       /* [layer][window][QD] last prompt queries */
    int32_t obs_pos[MAX_WINDOW];
    uint32_t n_obs;
    float *gen;                       /* [layer][window][QD] generated queries, ring */
    int32_t *gen_pos;                 /* [layer][window] */
    uint32_t *n_gen;                  /* [layer] recorded so far */
    uint32_t compressed_at;           /* keys before this were scored at the last compression; 0 = never */
    uint32_t compress_now;            /* this step compresses: 1 first time, 2 re-selection */
    struct tkv_kept kept;
};

static uint32_t ent_segment(void *state) { return ((struct entropy *)state)->segment; }

static void ent_destroy(void *state)
{
    struct entropy *e = state;
    if (!e)
        return;
    tkv_kept_free(&e->kept);
    free(e->hs), free(e->sel), free(e->n_sel), free(e->P), free(e->idx), free(e->obs), free(e->gen),
        free(e->gen_pos), free(e->n_gen);
    free(e);
}

static void ent_reset(void *state)
{
    struct entropy *e = state;
    memset(e->hs, 0, (size_t)e->env.n_layer * e->env.n_head_kv * sizeof *e->hs);
    memset(e->n_gen, 0, e->env.n_layer * sizeof *e->n_gen);
    e->n_obs = 0;
    e->compressed_at = 0;
    e->compress_now = 0;
    tkv_kept_reset(&e->kept);
}

static tkv_status ent_create(const struct tkv_policy_env *env, const struct tkv_policy_args *args, void **state)
{
    uint32_t faithful = 0;
    TKV_TRY(tkv_policy_arg_u32("entropy", args, "faithful", &faithful));
    struct entropy p = {.env = *env, .faithful = faithful != 0, .segment = 512, .block = 8,
                        .threshold = faithful ? 4096 : 1024, .layer_skip = 1, .base = 2048, .gap = 16, .window = 32,
                        .keep = env->budget ? env->budget : 1024, .resel = faithful ? 0 : 64,
                        .rigid_after = 2, .drop = faithful ? 1 : 0, .e_t = 1e-5f, .delta = 0.4f, .alpha = 0.5f};
    if (!faithful && env->budget)
        p.base = env->budget;
    static const char *const known[] = {"faithful", "segment", "block", "threshold", "layer_skip", "base", "budget",
                                        "gap", "window", "keep", "resel", "rigid_after", "drop", "e_t", "delta",
                                        "alpha", NULL};
    const char *n = "entropy";
    TKV_TRY(tkv_policy_arg_u32(n, args, "segment", &p.segment));
    TKV_TRY(tkv_policy_arg_u32(n, args, "block", &p.block));
    TKV_TRY(tkv_policy_arg_u32(n, args, "threshold", &p.threshold));
    TKV_TRY(tkv_policy_arg_u32(n, args, "layer_skip", &p.layer_skip));
    TKV_TRY(tkv_policy_arg_u32(n, args, "base", &p.base));
    TKV_TRY(tkv_policy_arg_u32(n, args, "budget", &p.keep));
    TKV_TRY(tkv_policy_arg_u32(n, args, "keep", &p.keep));
    TKV_TRY(tkv_policy_arg_u32(n, args, "gap", &p.gap));
    TKV_TRY(tkv_policy_arg_u32(n, args, "window", &p.window));
    TKV_TRY(tkv_policy_arg_u32(n, args, "resel", &p.resel));
    TKV_TRY(tkv_policy_arg_u32(n, args, "rigid_after", &p.rigid_after));
    TKV_TRY(tkv_policy_arg_u32(n, args, "drop", &p.drop));
    TKV_TRY(tkv_policy_arg_f32(n, args, "e_t", &p.e_t));
    TKV_TRY(tkv_policy_arg_f32(n, args, "delta", &p.delta));
    TKV_TRY(tkv_policy_arg_f32(n, args, "alpha", &p.alpha));
    TKV_TRY(tkv_policy_args_done(n, args, known));
    if (env->n_head_kv > 256)
        return tkv_err(TKV_ERR_UNSUPPORTED, "policy 'entropy': %u KV heads per layer (at most 256)", env->n_head_kv);
    if (p.block == 0 || p.segment % p.block || p.base < p.block || p.window < 2 || p.window > MAX_WINDOW ||
        p.keep <= p.window || p.rigid_after == 0)
        return tkv_err(TKV_ERR_INVALID_ARG, "policy 'entropy': need block | segment, base >= block, 2 <= window <= %d, "
                                            "keep > window, rigid_after >= 1",
                       MAX_WINDOW);
    struct entropy *e = calloc(1, sizeof *e);
    if (!e)
        return tkv_err(TKV_ERR_NOMEM, "policy 'entropy': out of memory");
    *e = p;
    const size_t QD = (size_t)env->n_head * env->head_dim, L = env->n_layer, H = env->n_head_kv;
    e->max_blocks = env->n_ctx / p.block + 1;
    e->max_ranges = e->max_blocks + 2;
    e->hs = calloc(L * H, sizeof *e->hs);
    e->sel = malloc(H * e->max_ranges * sizeof *e->sel);
    e->n_sel = malloc(H * sizeof *e->n_sel);
    e->P = malloc(H * e->max_blocks * sizeof *e->P);
    e->idx = malloc((size_t)3 * e->max_blocks * sizeof *e->idx);
    e->obs = malloc(L * p.window * QD * sizeof *e->obs);
    e->gen = malloc(L * p.window * QD * sizeof *e->gen);
    e->gen_pos = malloc(L * p.window * sizeof *e->gen_pos);
    e->n_gen = calloc(L, sizeof *e->n_gen);
    tkv_status st = e->hs && e->sel && e->n_sel && e->P && e->idx && e->obs && e->gen && e->gen_pos && e->n_gen
                        ? tkv_kept_init(&e->kept, env->n_layer, env->n_head_kv)
                        : tkv_err(TKV_ERR_NOMEM, "policy 'entropy': out of memory");
    if (st != TKV_OK) {
        ent_destroy(e);
        return st;
    }
    *state = e;
    return TKV_OK;
}

/* ---- prefill ------------------------------------------------------------------- */

/* Updates head g's class and budget with this segment's entropy h. */
static void update_head(const struct entropy *e, struct head_state *s, double h, uint32_t seg, float base)
{
    if (s->last_seg == 0 || seg == 1) { /* first scored segment of the prompt */
        *s = (struct head_state){.h_prev = h, .budget = base, .last_seg = seg};
    } else {
        double ratio = (h - s->h_prev) / (s->h_prev + 1e-9);
        ratio = ratio < 0 ? 0 : ratio > 1 + e->delta ? 1 + e->delta : ratio;
        s->budget = fminf(fmaxf(s->budget + e->alpha * base * (float)(ratio - e->delta), base), 3 * base);
        s->h_prev = h;
        s->last_seg = seg;
    }
    const bool low = h < e->e_t;
    s->low_run = low ? s->low_run + 1 : 0;
    if (e->faithful) { /* Rigid while every segment so far was below e_t */
        s->dynamic_seen |= !low;
        s->rigid = !s->dynamic_seen;
    } else { /* hysteresis: Rigid after a run of low segments, Dynamic on the first high one */
        s->rigid = low && s->low_run >= e->rigid_after;
    }
    if (s->rigid)
        s->budget = base;
}

/* Scores every head for the segment in v and fills sel / n_sel. */
static void select_segment(struct entropy *e, const struct tkv_policy_view *v)
{
    const uint32_t H = e->env.n_head_kv, seg_start = v->n_past - v->n_q, seg = seg_start / e->segment;
    /* budgets and threshold scaled to the prompt (improved variant) */
    float base = (float)e->base;
    uint32_t threshold = e->threshold;
    if (!e->faithful) {
        const uint32_t quarter = v->prefill_end / 4 / e->segment * e->segment;
        base = fminf(base, fmaxf((float)e->segment, (float)(v->prefill_end / 4)));
        threshold = TKV_MIN(threshold, TKV_MAX(e->segment, quarter));
    }
    const bool dense = v->layer < e->layer_skip || seg_start < threshold || v->n_past >= v->prefill_end;
    /* pass 1: every head's distribution and entropy (one backend call),
     * class and block count */
    uint32_t kc[256], nb[256], k_max = 0, n_blocks = 0;
    double ent[256];
    for (uint32_t g = 0; g < H; g++)
        e->n_sel[g] = UINT32_MAX;
    if (v->layer < e->layer_skip)
        return;
    tkv_status st = tkv_policy_segment_stats(v, &e->env, e->block, e->P, e->max_blocks, ent, &n_blocks);
    if (st != TKV_OK) { /* the segment stays dense, the classes as they were */
        TKV_LOG_W("policy 'entropy': layer %u: %s", v->layer, tkv_last_error());
        return;
    }
    for (uint32_t g = 0; g < H; g++) {
        kc[g] = nb[g] = 0;
        if ((nb[g] = n_blocks) == 0)
            continue;
        struct head_state *s = &e->hs[(size_t)v->layer * H + g];
        update_head(e, s, ent[g], seg, base);
        float b = s->rigid && !e->faithful ? base / 4 : s->budget;
        kc[g] = TKV_MIN((uint32_t)(b / (float)e->block), nb[g]);
        k_max = TKV_MAX(k_max, kc[g]);
    }
    if (dense)
        return;
    /* pass 2: the blocks -- faithful: every head takes the layer's maximum
     * count; ours: its own */
    for (uint32_t g = 0; g < H; g++) {
        if (nb[g] == 0)
            continue;
        const uint32_t k = tkv_policy_top_k_scratch(e->P + (size_t)g * e->max_blocks, nb[g], e->faithful ? k_max : kc[g],
                                                            e->idx, e->idx + e->max_blocks);
        e->n_sel[g] = tkv_policy_block_ranges(e->idx, k, e->block, e->sel + (size_t)g * e->max_ranges, e->max_ranges);
    }
}

static int ent_prefill(void *state, const struct tkv_policy_view *v, uint32_t head, struct tkv_range *out,
                       uint32_t cap)
{
    struct entropy *e = state;
    if (head == 0)
        select_segment(e, v);
    if (e->n_sel[head] == UINT32_MAX)
        return -1;
    const uint32_t m = TKV_MIN(e->n_sel[head], cap);
    memcpy(out, e->sel + (size_t)head * e->max_ranges, m * sizeof *out);
    return (int)m;
}

/* ---- after the prefill: keep the last window/2 prompt queries ---------------------- */

static tkv_status ent_after_prefill(void *state, const struct tkv_policy_view *v)
{
    struct entropy *e = state;
    const size_t QD = (size_t)e->env.n_head * e->env.head_dim;
    const uint32_t n = TKV_MIN(e->window, v->n_q);
    memcpy(e->obs + (size_t)v->layer * e->window * QD, v->q + (size_t)(v->n_q - n) * QD, n * QD * sizeof(float));
    if (v->layer == 0) {
        memcpy(e->obs_pos, v->q_pos + (v->n_q - n), n * sizeof *e->obs_pos);
        e->n_obs = n;
        e->compressed_at = 0;
        e->compress_now = 0;
        memset(e->n_gen, 0, e->env.n_layer * sizeof *e->n_gen);
        tkv_kept_reset(&e->kept);
    }
    return TKV_OK;
}

/* ---- decode ------------------------------------------------------------------------ */

/* Scores the cache of one layer with window queries and stores kept sets. */
static tkv_status compress_layer(struct entropy *e, const struct tkv_policy_view *v, bool first)
{
    const size_t QD = (size_t)e->env.n_head * e->env.head_dim;
    const uint32_t half = e->window / 2, l = v->layer, ng = TKV_MIN(e->n_gen[l], e->window);
    float *wq = malloc((size_t)e->window * QD * sizeof *wq);
    int32_t wpos[MAX_WINDOW];
    if (!wq)
        return tkv_err(TKV_ERR_NOMEM, "policy 'entropy': out of memory");
    uint32_t n = 0;
    /* the first compression: the last window/2 prompt queries + the first
     * window/2 generated ones (faithful); ours fills the window with prompt
     * queries where fewer were generated (gap < window/2: at gap=0, the
     * last `window` prompt queries, as SnapKV observes); re-selection: the
     * latest generated ones */
    if (first) {
        const uint32_t want = e->faithful ? half : e->window - TKV_MIN(ng, half), np = TKV_MIN(e->n_obs, want);
        const uint32_t skip = e->n_obs - np; /* the oldest rows not taken */
        memcpy(wq, e->obs + ((size_t)l * e->window + skip) * QD, np * QD * sizeof *wq);
        memcpy(wpos, e->obs_pos + skip, np * sizeof *wpos);
        n = np;
    }
    const uint32_t take = first ? TKV_MIN(ng, e->window - n) : ng;
    for (uint32_t i = 0; i < take; i++) {
        /* oldest first: ring slot of the i-th of the last `take` recorded */
        const uint32_t seq = e->n_gen[l] - take + i, slot = seq % e->window;
        memcpy(wq + (size_t)n * QD, e->gen + ((size_t)l * e->window + slot) * QD, QD * sizeof *wq);
        wpos[n++] = e->gen_pos[(size_t)l * e->window + slot];
    }
    const uint32_t n_ctx = v->n_past - 1; /* keys before this step's own */
    tkv_status st = TKV_OK;
    if (n_ctx > e->keep && n > 0) {
        const uint32_t recent = TKV_MIN(e->window, n_ctx), n_prefix = n_ctx - recent, keep = e->keep - recent;
        struct tkv_policy_view w = *v; /* the window's queries, the layer's keys */
        w.q = wq;
        w.q_host = true;
        w.q_pos = wpos;
        w.n_q = n;
        w.n_past = n_ctx;
        float *score = malloc((size_t)e->env.n_head_kv * n_prefix * sizeof *score);
        uint32_t *idx = malloc((size_t)n_prefix * sizeof *idx);
        struct tkv_range *r = malloc(((size_t)n_prefix + 2) * sizeof *r);
        if (!score || !idx || !r)
            st = tkv_err(TKV_ERR_NOMEM, "policy 'entropy': out of memory");
        if (st == TKV_OK) /* every head's scores, average-pooled over 5 */
            st = tkv_policy_window_stats(&w, &e->env, n_prefix, 5, 'a', score);
        for (uint32_t g = 0; g < e->env.n_head_kv && st == TKV_OK; g++) {
            const uint32_t k = tkv_policy_top_k(score + (size_t)g * n_prefix, n_prefix, keep, idx);
            const int m = tkv_policy_ranges(idx, k, n_prefix, n_ctx, r, n_prefix + 2);
            st = tkv_kept_set(&e->kept, l, g, r, (uint32_t)m);
        }
        free(score), free(idx), free(r);
    }
    free(wq);
    return st;
}

/* The compressing steps score every key; the others only replay kept sets. */
static bool ent_needs_keys(void *state, const struct tkv_policy_view *v)
{
    const struct entropy *e = state;
    const uint32_t step = v->step + 1;
    const bool first = step == e->gap + 1 && e->compressed_at == 0;
    const bool again = !e->faithful && e->resel && e->compressed_at && (step - e->gap - 1) % e->resel == 0;
    return first || again;
}

static int ent_decode(void *state, const struct tkv_policy_view *v, uint32_t head, struct tkv_range *out,
                      uint32_t cap)
{
    struct entropy *e = state;
    const uint32_t l = v->layer, step = v->step + 1; /* 1-based generated token */
    if (head == 0) {
        if (l == 0) { /* all layers compress on the same step */
            const bool first = step == e->gap + 1 && e->compressed_at == 0;
            const bool again = !e->faithful && e->resel && e->compressed_at && (step - e->gap - 1) % e->resel == 0;
            e->compress_now = first ? 1 : again ? 2 : 0;
        }
        if (e->compress_now && compress_layer(e, v, e->compress_now == 1) != TKV_OK) {
            /* no memory, or the backend failed: attend everything rather than stale sets */
            TKV_LOG_W("policy 'entropy': decode compression, layer %u: %s", l, tkv_last_error());
            tkv_kept_reset(&e->kept);
        }
        if (e->compress_now && l + 1 == e->env.n_layer)
            e->compressed_at = v->n_past - 1;
        /* record this step's query after scoring: the first compression's
         * window holds the `gap` generated queries before its step */
        const size_t QD = (size_t)e->env.n_head * e->env.head_dim;
        const uint32_t slot = e->n_gen[l] % e->window;
        memcpy(e->gen + ((size_t)l * e->window + slot) * QD, v->q, QD * sizeof(float));
        e->gen_pos[(size_t)l * e->window + slot] = v->q_pos[0];
        e->n_gen[l]++;
    }
    if (e->compress_now || e->compressed_at == 0) /* a compressing step still attends everything */
        return -1;
    return tkv_kept_select(&e->kept, l, head, e->compressed_at, v->n_past, out, cap);
}

bool tkv_entropy_rigid(const void *state, uint32_t layer, uint32_t head)
{
    const struct entropy *e = state;
    return layer < e->env.n_layer && head < e->env.n_head_kv && e->hs[(size_t)layer * e->env.n_head_kv + head].rigid;
}

/* faithful: dense when every segment starts before the threshold or is the
 * last one; the online variant scales its threshold to the prompt: never. */
static bool ent_dense(void *state, uint32_t n)
{
    const struct entropy *e = state;
    if (!e->faithful)
        return false;
    const uint32_t n_seg = (n + e->segment - 1) / e->segment, dense_segs = (e->threshold + e->segment - 1) / e->segment;
    return n_seg <= dense_segs + 1;
}

const struct tkv_policy_ops tkv_policy_entropy = {
    .name = "entropy",
    .help = "EntropyInfer (faithful=1: as released); default: online Rigid/Dynamic, per-head budgets, re-selection",
    .changes_prefill = true,
    .decode_reads_query = true, /* it records the generated queries */
    .create = ent_create,
    .destroy = ent_destroy,
    .prefill_select = ent_prefill,
    .after_prefill = ent_after_prefill,
    .decode_select = ent_decode,
    .decode_needs_keys = ent_needs_keys,
    .reset = ent_reset,
    .segment = ent_segment,
    .prefill_dense = ent_dense,
};
