/*
 * rabitq.c -- decode-time top-p selection from a RaBitQ key index
 * (runtime/rabitq/, docs/rabitq.md; spec shared/specs/rabitqcache.md, 3.3-3.7):
 *
 *   rabitq          every KV head of the layers >= `dense`;
 *   entropy+rabitq  EntropyInfer's prefill as is (segment-sparse, Rigid or
 *                   Dynamic per KV head); at decode its Dynamic heads read
 *                   everything and its Rigid heads are selected by top-p.
 *                   EntropyInfer's own decode compression is not used.
 *
 * After the prefill, per (layer, KV head) selected by top-p: c_k = the mean
 * of the prompt keys, c_q = the mean of the observation window (the last 32
 * prompt queries of the group's query heads, post-RoPE: what a fork carries
 * and what the decode queries resemble most); then every prompt key is
 * encoded. At each decode step, per KV head and per query head of its group
 * (GQA handling (a) of the spec, 3.7): the query prepared (4 bits), every
 * indexed key estimated, top-p on the estimates with the sinks and the
 * `recent` window forced (safe=1: using the error bound, so that the kept
 * set holds >= p of the query head's true attention mass; safe=0: the
 * estimated mass reaches p). The KV head reads the union of its query heads'
 * sets -- a superset of each, so each query head keeps >= p -- plus the
 * tail of keys not yet encoded. The top-p normalises over the indexed keys
 * only (the tail's exact logits would need its keys): leaving the tail's
 * mass out of both sides only raises the kept fraction.
 *
 * Lazy encoding (spec 3.5): keys generated at decode join the index once
 * `batch` of them are pending; until then they are the tail, always read.
 * Encoding needs the keys, so the step where a batch completes answers yes
 * to decode_needs_keys (the store brings the layer in); every other step
 * selects without keys, before anything is recalled, and the store recalls
 * only the blocks the selection touches.
 *
 * Where the KV is in backend memory (a GPU), the keys never come to the
 * host: the index's codes live beside them as a device twin
 * (tkv_rabitq_dev_*: the backend's rabitq ops encode and estimate, bit for
 * bit as the CPU kernels), the prompt-key mean is taken over downloaded
 * blocks once after the prefill, and each layer of a step is selected on
 * the device in one call (rabitq_select; without it, per head the estimates
 * come down for the host's top-p). The host index then holds only the
 * rotation and the centroids; it prepares the queries, unless the backend
 * prepares them itself from the step's q in its memory (rabitq_prepare,
 * bit for bit the host's): then q never comes to the host.
 *
 * Parameters: p (0.9, in (0, 1]), safe (1), eps (3, the bound's width eps0,
 * > 0), sink (64), recent (64), batch (64), dense (2: layers below it are
 * read whole), whole (0; 1: widen each touched KV block to all its tokens --
 * the store brings whole blocks in anyway; N > 1: widen to the aligned
 * groups of N positions; a superset of the top-p set either way; not given:
 * RQ_DEVICE_GROUP where a device selects, else 0), exact (1: the
 * shortest prefix of the keys that meets p; 0: the top-p search's boundary
 * bin kept whole, tkv_rabitq_topp_params.coarse; not given: 0 where a
 * device selects, else 1), hold (16; 0 where the KV is paged) and wide
 * (0.75): a head whose selection kept more than `wide` of its indexed keys
 * reads everything for the next `hold` steps without selecting, then
 * selects again (hold=0: never). Reading more only raises the kept mass;
 * where top-p keeps most keys anyway (safe mode on real text at a few
 * thousand tokens keeps 75-95%), the selection is pure cost. Not where the
 * compute tier is capped (env.kv_paged): there reading a head whole
 * recalls every block of it that is not resident, for `hold` steps, which
 * costs more than the selection it saves (docs/bench-decode.md, "The
 * synthetic fill against real text": 5.28 against 0.68 MB recalled per
 * step on the CPU), so holds are off unless asked for. Where a
 * selection's sets come to the host (the host's top-p, a backend's
 * rabitq_select into a host bitmap) they are counted there; on the device
 * table path, where they never do, from the table's counts
 * (rq_table_read). mean (0; 1: each KV head selects once, with the mean of
 * its group's queries -- GQA handling (b) of the spec, 3.7, formed as
 * tkv_rabitq_query_mean forms it on every backend: G times fewer estimates
 * and top-p passes and one set instead of a union of G, but top-p then
 * holds p of the softmax of the group-mean logit, not of each query head's
 * mass; docs/quality.md measures what that costs).
 */
#include "policy.h"
#include "../rabitq/rabitq.h"

#include <math.h>
#include <stdlib.h>

#define SEED_BASE 0x7261626974714b56ull /* "rabitqKV": rotations are fixed per (layer, head) */

/* whole's default where the backend selects (and so attends) on the device:
 * the CUDA decode kernel walks a slice 16 keys at a time (head_dim 128, up
 * to 4 query heads per KV head), so a run of 1-15 selected keys costs a full
 * 16-key step. Reading the aligned 16-position groups of the top-p set
 * instead: 9% of the keys for 7% at 128K on the H200, and 1.13x the tokens
 * per second (docs/rabitq.md, "Session 17"). */
#define RQ_DEVICE_GROUP 16
/* exact's default where the backend selects: 0. Cutting the boundary bin
 * key by key costs the device two of its seven kernels (~38 us a layer at
 * 128K keys on the H200), for the keys within 1/16 nat of the boundary
 * (which the groups of 16 mostly cover anyway): 1.20x the tokens per second
 * at 128K, the same share of the keys read (docs/rabitq.md, "Session 17"). */
#define RQ_DEVICE_EXACT 0

/* A head's hold (wide, hold): it reads whole at the decode steps in
 * (from, to] -- the `hold` steps after a selection that kept more than
 * `wide` of its keys. {0, 0}: none. */
struct rq_hold {
    uint64_t from, to;
};

struct rabitq {
    struct tkv_policy_env env;
    float p, eps;
    uint32_t safe, sink, recent, batch, dense;
    uint32_t whole;         /* 0, or the positions of a group read whole */
    uint32_t exact;         /* 1: the shortest prefix; 0: the boundary bin whole */
    uint32_t mean;          /* 1: one query per KV head, its group's mean; 0: each query head's */
    bool whole_auto;        /* whole not given: RQ_DEVICE_GROUP once a device selects */
    bool exact_auto;        /* exact not given: RQ_DEVICE_EXACT once a device selects */
    float wide;             /* a selection keeping more than this share of its keys ...   */
    uint32_t hold;          /* ... makes its head read whole for the next `hold` steps      */
    struct rq_hold *holds;  /* [layer][head]                                                */
    struct tkv_rabitq **ix; /* [layer][head]: the index, NULL until first built */
    /* the KV in backend memory: the indexes' codes live there too */
    struct tkv_backend *be;              /* NULL: host indexes only          */
    struct tkv_rabitq_dev_index **dx;    /* [layer][head] device twins       */
    float *est_dev, *bound_dev;          /* backend [n_ctx]                  */
    uint16_t *kbuf;                      /* host [block_tokens, head_dim]    */
    struct tkv_rabitq_span *spans;       /* [n_spans]: one encode call's blocks */
    uint32_t n_spans;
    bool *use;              /* [layer][head]: selected by top-p (else read whole) */
    bool *ready;            /* [layer][head]: the index holds the prompt's keys */
    /* scratch of one selection, for n_ctx keys: no allocation per step */
    float *est, *bound;     /* [n_ctx] */
    void *work;             /* tkv_rabitq_topp_work_bytes(n_ctx) */
    size_t work_bytes;
    uint32_t *pos;          /* [n_ctx] positions top-p kept */
    uint8_t *mark;          /* [n_ctx] union over the group's query heads */
    /* selection on the device (the backend's rabitq_select; off with
     * TKV_RABITQ_DEVICE_TOPP=0): one call per layer at its first head, the
     * KV heads' bitmaps cached for the later heads of the same step */
    bool dev_sel;
    struct tkv_rabitq_query *qs;           /* [n_head_kv * G] the layer's prepared queries */
    struct tkv_rabitq_select_head *sh;     /* [n_head_kv]                                   */
    uint32_t *bitmap;                      /* [n_head_kv][words]                            */
    uint32_t words;                        /* (n_ctx + 31) / 32                             */
    int32_t *slot;                         /* [n_head_kv] head's row in bitmap, -1: read all */
    uint32_t *sel_n;                       /* [n_head_kv] keys the row covers               */
    uint32_t c_layer, c_n_past, c_step;    /* what the cache holds                          */
    const float *c_q;
    bool c_valid;
    bool c_rows_host;                      /* bitmap holds the cached selection's rows      */
    uint32_t *n_chosen;                    /* [n_head_kv * G] rabitq_select's per query head */
    /* with dev_sel, the queries prepared on the device too (the backend's
     * rabitq_prepare; off with TKV_RABITQ_DEVICE_QPREP=0): from the step's q
     * in backend memory, which then stays there (rq_query_host) */
    bool dev_prep;
    struct tkv_rabitq_dev_query *qd;       /* backend [n_head_kv * G] the layer's queries   */
    struct tkv_rabitq_prepare_item *items; /* [n_head_kv * G]                               */
    /* with dev_sel, the bitmaps left in backend memory (env.device_table and
     * a backend with kv_table): row g for KV head g, for the engine's
     * decode table (decode_bitmap), selected without a wait (nothing comes
     * down: a head with a non-finite estimate has every key in its row);
     * the host path downloads them into bitmap (same rows) when it asks
     * for ranges */
    uint32_t *bitmap_dev;                  /* backend [n_head_kv][words]                    */
};

#define RQ_KEYS "p", "safe", "eps", "sink", "recent", "batch", "dense", "whole", "exact", "hold", "wide", "mean"
static const char *const rq_keys[] = {RQ_KEYS, NULL};

static void rq_destroy(void *state)
{
    struct rabitq *r = state;
    if (!r)
        return;
    if (r->ix)
        for (size_t i = 0; i < (size_t)r->env.n_layer * r->env.n_head_kv; i++) {
            tkv_rabitq_free(r->ix[i]);
            tkv_rabitq_dev_free(r->dx[i]);
        }
    if (r->be) {
        r->be->ops->release(r->be, r->est_dev);
        r->be->ops->release(r->be, r->bound_dev);
        if (r->qd)
            r->be->ops->release(r->be, r->qd);
        if (r->bitmap_dev)
            r->be->ops->release(r->be, r->bitmap_dev);
    }
    free(r->ix), free(r->dx), free(r->kbuf), free(r->spans), free(r->use), free(r->ready), free(r->est), free(r->bound), free(r->work), free(r->pos),
        free(r->mark), free(r->holds);
    free(r->qs), free(r->sh), free(r->bitmap), free(r->slot), free(r->sel_n), free(r->n_chosen), free(r->items);
    free(r);
}

/* Heads [i0, i1) hold nothing. */
static void holds_clear(struct rabitq *r, size_t i0, size_t i1)
{
    for (size_t i = i0; i < i1; i++)
        r->holds[i] = (struct rq_hold){0, 0};
}

static void rq_reset(void *state)
{
    struct rabitq *r = state;
    const size_t LH = (size_t)r->env.n_layer * r->env.n_head_kv;
    memset(r->ready, 0, LH * sizeof *r->ready);
    holds_clear(r, 0, LH);
    r->c_valid = false;
}

/* Parses the rabitq parameters of args (all of them: the caller has checked
 * for unknown keys) and allocates the state; name is for messages. */
static tkv_status rq_make(const char *name, const struct tkv_policy_env *env, const struct tkv_policy_args *args,
                          struct rabitq **out)
{
    *out = NULL;
    struct rabitq p = {.env = *env, .p = 0.9f, .eps = TKV_RABITQ_EPS0, .safe = 1, .sink = 64, .recent = 64,
                       .batch = 64, .dense = 2, .whole = UINT32_MAX, .exact = UINT32_MAX, .hold = UINT32_MAX,
                       .wide = 0.75f};
    TKV_TRY(tkv_policy_arg_f32(name, args, "p", &p.p));
    TKV_TRY(tkv_policy_arg_u32(name, args, "safe", &p.safe));
    TKV_TRY(tkv_policy_arg_f32(name, args, "eps", &p.eps));
    TKV_TRY(tkv_policy_arg_u32(name, args, "sink", &p.sink));
    TKV_TRY(tkv_policy_arg_u32(name, args, "recent", &p.recent));
    TKV_TRY(tkv_policy_arg_u32(name, args, "batch", &p.batch));
    TKV_TRY(tkv_policy_arg_u32(name, args, "dense", &p.dense));
    TKV_TRY(tkv_policy_arg_u32(name, args, "whole", &p.whole));
    TKV_TRY(tkv_policy_arg_u32(name, args, "exact", &p.exact));
    TKV_TRY(tkv_policy_arg_u32(name, args, "hold", &p.hold));
    TKV_TRY(tkv_policy_arg_f32(name, args, "wide", &p.wide));
    TKV_TRY(tkv_policy_arg_u32(name, args, "mean", &p.mean));
    if (!(p.p > 0 && p.p <= 1))
        return tkv_err(TKV_ERR_INVALID_ARG, "policy '%s': p=%g must be in (0, 1]", name, (double)p.p);
    if (!(p.eps > 0))
        return tkv_err(TKV_ERR_INVALID_ARG, "policy '%s': eps=%g must be > 0 (the bound's width eps0)", name,
                       (double)p.eps);
    if (p.safe > 1)
        return tkv_err(TKV_ERR_INVALID_ARG, "policy '%s': safe is 0 or 1 (safe=%u)", name, p.safe);
    if (p.whole == UINT32_MAX) /* not given */
        p.whole = 0, p.whole_auto = true;
    if (p.exact == UINT32_MAX)
        p.exact = 1, p.exact_auto = true;
    if (p.hold == UINT32_MAX) /* not given */
        p.hold = env->kv_paged ? 0 : 16;
    if (!(p.wide > 0 && p.wide <= 1))
        return tkv_err(TKV_ERR_INVALID_ARG, "policy '%s': wide=%g must be in (0, 1] (the share of a head's keys "
                       "above which it holds)", name, (double)p.wide);
    if (p.exact > 1)
        return tkv_err(TKV_ERR_INVALID_ARG, "policy '%s': exact is 0 or 1 (exact=%u)", name, p.exact);
    if (p.mean > 1)
        return tkv_err(TKV_ERR_INVALID_ARG, "policy '%s': mean is 0 or 1 (mean=%u)", name, p.mean);
    if (p.whole > 1u << 16)
        return tkv_err(TKV_ERR_INVALID_ARG, "policy '%s': whole=%u (0, 1: whole KV blocks, or a group of at most "
                       "65536 positions)", name, p.whole);
    if (p.whole == 1)
        p.whole = env->block_tokens ? env->block_tokens : 64;
    if (p.batch == 0)
        return tkv_err(TKV_ERR_INVALID_ARG, "policy '%s': batch=0 (keys are encoded in batches of >= 1)", name);
    if (env->head_dim == 0 || env->head_dim > TKV_RABITQ_MAX_DIM || env->n_head_kv == 0 ||
        env->n_head % env->n_head_kv)
        return tkv_err(TKV_ERR_UNSUPPORTED, "policy '%s': head_dim %u (at most %u) or %u heads over %u KV heads", name,
                       env->head_dim, TKV_RABITQ_MAX_DIM, env->n_head, env->n_head_kv);
    struct rabitq *r = calloc(1, sizeof *r);
    if (!r)
        return tkv_err(TKV_ERR_NOMEM, "policy '%s': out of memory", name);
    *r = p;
    const size_t LH = (size_t)env->n_layer * env->n_head_kv, n = env->n_ctx ? env->n_ctx : 1;
    r->ix = calloc(LH, sizeof *r->ix);
    r->dx = calloc(LH, sizeof *r->dx);
    r->use = calloc(LH, sizeof *r->use);
    r->ready = calloc(LH, sizeof *r->ready);
    r->est = malloc(n * sizeof *r->est);
    r->bound = malloc(n * sizeof *r->bound);
    r->work_bytes = tkv_rabitq_topp_work_bytes((uint32_t)n);
    r->work = malloc(r->work_bytes);
    r->pos = malloc(n * sizeof *r->pos);
    r->mark = malloc(n);
    r->holds = malloc(LH * sizeof *r->holds);
    if (!r->ix || !r->dx || !r->use || !r->ready || !r->est || !r->bound || !r->work || !r->pos || !r->mark ||
        !r->holds) {
        rq_destroy(r);
        return tkv_err(TKV_ERR_NOMEM, "policy '%s': out of memory", name);
    }
    holds_clear(r, 0, LH);
    for (uint32_t l = p.dense; l < env->n_layer; l++) /* plain rabitq: every head of the sparse layers */
        for (uint32_t g = 0; g < env->n_head_kv; g++)
            r->use[(size_t)l * env->n_head_kv + g] = true;
    *out = r;
    return TKV_OK;
}

static tkv_status rq_create(const struct tkv_policy_env *env, const struct tkv_policy_args *args, void **state)
{
    TKV_TRY(tkv_policy_args_done("rabitq", args, rq_keys));
    return rq_make("rabitq", env, args, (struct rabitq **)state);
}

/* Makes room for n keys in the index (geometric growth: called after the
 * prefill and at batch encodes, never per token). */
static tkv_status rq_reserve(struct rabitq *r, struct tkv_rabitq *ix, uint32_t n)
{
    const uint32_t cap = tkv_rabitq_capacity(ix);
    if (n <= cap)
        return TKV_OK;
    uint64_t want = (uint64_t)cap + cap / 4 + r->batch;
    want = TKV_MIN(want, (uint64_t)TKV_MAX(r->env.n_ctx, n));
    return tkv_rabitq_reserve(ix, (uint32_t)TKV_MAX(want, (uint64_t)n));
}

/* Keys the index of head i holds (on the host or in its device twin). */
static uint32_t indexed(const struct rabitq *r, size_t i)
{
    return r->dx[i] ? tkv_rabitq_dev_size(r->dx[i]) : tkv_rabitq_size(r->ix[i]);
}

/* Appends the keys of positions [from, to) of head view kv to index i: on
 * the host block by block, to a device twin in one encode call over the
 * blocks (r->n_spans of them at a time), which waits once. TKV_ERR_INTERNAL
 * if a block holding them is not in memory. */
static tkv_status append_keys(struct rabitq *r, size_t i, const struct tkv_kv_head_view *kv, uint32_t from,
                              uint32_t to)
{
    const uint32_t hd = r->env.head_dim;
    uint32_t at = from, m = 0;
    for (uint32_t b = 0; b < kv->n_blocks && at < to; b++) {
        const struct tkv_kv_block_ref *blk = &kv->blocks[b];
        const uint32_t p0 = (uint32_t)blk->pos0, p1 = p0 + blk->n;
        if (p1 <= at || p0 > at)
            continue;
        if (!blk->k)
            return tkv_err(TKV_ERR_INTERNAL, "rabitq: the block of position %u is not in memory", at);
        const uint32_t n = TKV_MIN(p1, to) - at;
        const uint16_t *rows = blk->k + (size_t)(at - p0) * hd;
        if (!r->dx[i]) {
            TKV_TRY(tkv_rabitq_append_f16(r->ix[i], rows, hd, n));
        } else {
            if (m == r->n_spans) { /* more blocks than n_ctx / block_tokens + 1: encode what is gathered */
                TKV_TRY(tkv_rabitq_dev_append_spans(r->dx[i], r->spans, m, hd));
                m = 0;
            }
            r->spans[m++] = (struct tkv_rabitq_span){rows, n};
        }
        at += n;
    }
    if (m > 0)
        TKV_TRY(tkv_rabitq_dev_append_spans(r->dx[i], r->spans, m, hd));
    if (at < to)
        return tkv_err(TKV_ERR_INTERNAL, "rabitq: keys [%u, %u) missing from the layer's view", at, to);
    return TKV_OK;
}

/* Whether be selects a whole layer in one call (rabitq_select; off with
 * TKV_RABITQ_DEVICE_TOPP=0) at this model's group size and context. */
static bool backend_selects(const struct rabitq *r, const struct tkv_backend *be)
{
    const char *env = getenv("TKV_RABITQ_DEVICE_TOPP");
    const size_t n = r->env.n_ctx ? r->env.n_ctx : 1;
    return be->ops->rabitq_select && !(env && !strcmp(env, "0")) &&
           r->env.n_head / r->env.n_head_kv <= TKV_RABITQ_SELECT_MAX_G && n <= TKV_RABITQ_SELECT_MAX_N;
}

/* Whether the indexes of v's keys live on its backend as twins
 * (tkv_rabitq_dev): always where the keys are in backend memory; where they
 * are in host memory (the CPU backend), when that backend selects a layer
 * in one call, on its threads, instead of a head at a time here. */
static bool index_on_backend(const struct rabitq *r, const struct tkv_policy_view *v)
{
    return v->be && (!v->kv_host || backend_selects(r, v->be));
}

/* The first view whose index goes to its backend (index_on_backend):
 * estimates go there. */
static tkv_status attach_backend(struct rabitq *r, struct tkv_backend *be)
{
    if (r->be)
        return r->be == be ? TKV_OK : tkv_err(TKV_ERR_INTERNAL, "rabitq: views from two backends");
    const size_t n = r->env.n_ctx ? r->env.n_ctx : 1, B = r->env.block_tokens ? r->env.block_tokens : 64;
    r->be = be; /* from here on destroy releases what was allocated */
    r->kbuf = malloc(B * r->env.head_dim * sizeof *r->kbuf);
    r->n_spans = (uint32_t)((n + B - 1) / B + 1);
    r->spans = malloc(r->n_spans * sizeof *r->spans);
    if (!r->kbuf || !r->spans)
        return tkv_err(TKV_ERR_NOMEM, "rabitq: out of memory");
    const uint32_t G = r->env.n_head / r->env.n_head_kv, H = r->env.n_head_kv;
    r->dev_sel = backend_selects(r, be);
    if (r->dev_sel) {
        r->words = (uint32_t)((n + 31) / 32);
        r->qs = malloc((size_t)H * G * sizeof *r->qs);
        r->sh = malloc(H * sizeof *r->sh);
        r->bitmap = malloc((size_t)H * r->words * sizeof *r->bitmap);
        r->slot = malloc(H * sizeof *r->slot);
        r->sel_n = malloc(H * sizeof *r->sel_n);
        r->n_chosen = malloc((size_t)H * G * sizeof *r->n_chosen);
        if (!r->qs || !r->sh || !r->bitmap || !r->slot || !r->sel_n || !r->n_chosen)
            return tkv_err(TKV_ERR_NOMEM, "rabitq: out of memory");
        const char *env_prep = getenv("TKV_RABITQ_DEVICE_QPREP");
        if (be->ops->rabitq_prepare && !(env_prep && !strcmp(env_prep, "0"))) {
            r->items = malloc((size_t)H * G * sizeof *r->items);
            if (!r->items)
                return tkv_err(TKV_ERR_NOMEM, "rabitq: out of memory");
            TKV_TRY(be->ops->alloc(be, (size_t)H * G * sizeof *r->qd, (void **)&r->qd));
            r->dev_prep = true;
        }
        if (r->env.device_table && be->ops->kv_table)
            TKV_TRY(be->ops->alloc(be, (size_t)H * r->words * sizeof *r->bitmap_dev, (void **)&r->bitmap_dev));
        /* the device's defaults where the selection runs in device memory
         * (the backend prepares queries there: rabitq_prepare); the CPU
         * backend's selection (its threads over host memory) keeps the
         * host's, whose sets its attention reads at any granularity */
        if (r->whole_auto && be->ops->rabitq_prepare)
            r->whole = RQ_DEVICE_GROUP;
        if (r->exact_auto && be->ops->rabitq_prepare)
            r->exact = RQ_DEVICE_EXACT;
    }
    TKV_TRY(be->ops->alloc(be, n * sizeof(float), (void **)&r->est_dev));
    return be->ops->alloc(be, n * sizeof(float), (void **)&r->bound_dev);
}

/* Rows k (rows of head_dim f16) into mk, brought to the host first when
 * they are in backend memory (a wait each). */
static tkv_status add_rows(struct rabitq *r, const struct tkv_policy_view *v, const uint16_t *k, uint32_t rows,
                           bool on_device, struct tkv_rabitq_mean *mk)
{
    const uint32_t hd = r->env.head_dim;
    if (on_device) {
        TKV_TRY(v->be->ops->download(v->be, r->kbuf, k, (size_t)rows * hd * sizeof *r->kbuf));
        k = r->kbuf;
    }
    return tkv_rabitq_mean_add_f16(mk, k, hd, rows);
}

/* The prompt's keys of KV head g (positions < n) into mk. Where the backend
 * has rabitq_key_sums, the blocks are gathered as spans and summed beside
 * the keys (one call: exact integers, so the same mean as the host's);
 * otherwise, or when a key is not finite, they are added block by block. */
static tkv_status key_sums(struct rabitq *r, const struct tkv_policy_view *v, uint32_t g, uint32_t n, bool on_device,
                           struct tkv_rabitq_mean *mk)
{
    const uint32_t hd = r->env.head_dim;
    const struct tkv_kv_head_view *kv = &v->kv[g];
    const bool dev_sums = on_device && v->be->ops->rabitq_key_sums && kv->n_blocks <= r->n_spans;
    uint32_t m = 0;
    uint64_t rows = 0;
    for (uint32_t b = 0; b < kv->n_blocks; b++) {
        const struct tkv_kv_block_ref *blk = &kv->blocks[b];
        if ((uint32_t)blk->pos0 >= n)
            continue;
        if (!blk->k)
            return tkv_err(TKV_ERR_INTERNAL, "rabitq: block at position %d is not in memory", blk->pos0);
        const uint32_t nr = TKV_MIN(blk->n, n - (uint32_t)blk->pos0);
        if (dev_sums)
            r->spans[m++] = (struct tkv_rabitq_span){blk->k, nr}, rows += nr;
        else
            TKV_TRY(add_rows(r, v, blk->k, nr, on_device, mk));
    }
    if (!dev_sums)
        return TKV_OK;
    int64_t units[TKV_RABITQ_MAX_DIM] = {0};
    uint32_t nonfinite[TKV_RABITQ_MAX_DIM] = {0}, any = 0;
    TKV_TRY(v->be->ops->rabitq_key_sums(v->be, r->spans, m, hd, hd, units, nonfinite));
    for (uint32_t d = 0; d < hd; d++)
        any |= nonfinite[d];
    if (!any)
        return tkv_rabitq_mean_add_units(mk, units, rows);
    for (uint32_t j = 0; j < m; j++) /* a key not finite: the double sums take it, on the host */
        TKV_TRY(add_rows(r, v, r->spans[j].k, r->spans[j].n, true, mk));
    return TKV_OK;
}

/* Builds the index of (layer, g) from the prompt's keys and the window. */
static tkv_status build_head(struct rabitq *r, const struct tkv_policy_view *v, uint32_t g)
{
    const uint32_t hd = r->env.head_dim, G = r->env.n_head / r->env.n_head_kv, n = v->n_past;
    const size_t QD = (size_t)r->env.n_head * hd, i = (size_t)v->layer * r->env.n_head_kv + g;
    const bool keys_on_backend = v->be && !v->kv_host, twin = index_on_backend(r, v);
    if (twin)
        TKV_TRY(attach_backend(r, v->be));
    if (!r->ix[i])
        TKV_TRY(tkv_rabitq_init(hd, tkv_rabitq_seed(SEED_BASE, v->layer, g), &r->ix[i]));
    struct tkv_rabitq *ix = r->ix[i];
    struct tkv_rabitq_mean mk, mq;
    float ck[TKV_RABITQ_MAX_DIM], cq[TKV_RABITQ_MAX_DIM];
    TKV_TRY(tkv_rabitq_mean_init(&mk, hd));
    TKV_TRY(tkv_rabitq_mean_init(&mq, hd));
    TKV_TRY(key_sums(r, v, g, n, keys_on_backend, &mk));
    const struct tkv_kv_head_view *kv = &v->kv[g];
    for (uint32_t hh = 0; hh < G; hh++) /* the group's query heads, every window query */
        TKV_TRY(tkv_rabitq_mean_add_f32(&mq, v->q + (size_t)(g * G + hh) * hd, QD, v->n_q));
    TKV_TRY(tkv_rabitq_mean_get(&mk, ck));
    TKV_TRY(tkv_rabitq_mean_get(&mq, cq));
    tkv_rabitq_reset(ix);
    TKV_TRY(tkv_rabitq_set_centroids(ix, ck, cq));
    tkv_rabitq_dev_free(r->dx[i]); /* the rotation's centroids changed: a new twin */
    r->dx[i] = NULL;
    if (twin)
        TKV_TRY(tkv_rabitq_dev_create(v->be, ix, r->env.n_ctx ? r->env.n_ctx : n, &r->dx[i]));
    else
        TKV_TRY(rq_reserve(r, ix, n));
    return append_keys(r, i, kv, 0, n);
}

static tkv_status rq_after_prefill(void *state, const struct tkv_policy_view *v)
{
    struct rabitq *r = state;
    holds_clear(r, (size_t)v->layer * r->env.n_head_kv, (size_t)(v->layer + 1) * r->env.n_head_kv);
    for (uint32_t g = 0; g < r->env.n_head_kv; g++) {
        const size_t i = (size_t)v->layer * r->env.n_head_kv + g;
        r->ready[i] = false;
        if (!r->use[i] || v->n_past == 0)
            continue;
        TKV_TRY(build_head(r, v, g));
        r->ready[i] = true;
    }
    return TKV_OK;
}

/* Keys of (layer, head) pending encoding: before this step's own token. */
static uint32_t pending(const struct rabitq *r, const struct tkv_policy_view *v, size_t i)
{
    const uint32_t n_enc = indexed(r, i);
    return v->n_past > n_enc + 1 ? v->n_past - 1 - n_enc : 0;
}

static bool rq_needs_keys(void *state, const struct tkv_policy_view *v)
{
    const struct rabitq *r = state;
    for (uint32_t g = 0; g < r->env.n_head_kv; g++) {
        const size_t i = (size_t)v->layer * r->env.n_head_kv + g;
        if (r->ready[i] && pending(r, v, i) >= r->batch)
            return true;
    }
    return false;
}

/* r->est (and r->bound with safe) for the first n keys of index i, on the
 * host: from its device twin, the estimates come back from the backend. */
static tkv_status estimate(struct rabitq *r, size_t i, const struct tkv_rabitq_query *qq, uint32_t n)
{
    if (!r->dx[i])
        return tkv_rabitq_estimate(r->ix[i], qq, 0, n, r->est, r->safe ? r->bound : NULL);
    TKV_TRY(tkv_rabitq_dev_estimate(r->dx[i], qq, 0, n, r->est_dev, r->safe ? r->bound_dev : NULL));
    TKV_TRY(r->be->ops->download(r->be, r->est, r->est_dev, n * sizeof *r->est));
    return r->safe ? r->be->ops->download(r->be, r->bound, r->bound_dev, n * sizeof *r->bound) : TKV_OK;
}

/* The keys head i selects from this step, and its forced ranges (sinks and
 * the recent window): false when nothing is left to choose. */
static bool head_plan(const struct rabitq *r, const struct tkv_policy_view *v, size_t i, uint32_t *n_out,
                      struct tkv_range *forced, uint32_t *n_forced)
{
    const uint32_t n = TKV_MIN(indexed(r, i), v->n_past), sink_end = TKV_MIN(r->sink, n);
    const uint32_t recent_begin = TKV_MAX(sink_end, v->n_past > r->recent ? v->n_past - r->recent : 0);
    if (TKV_MIN(recent_begin, n) <= sink_end || n > r->env.n_ctx) /* nothing to choose: all of it is forced */
        return false;
    *n_forced = 0;
    if (sink_end > 0)
        forced[(*n_forced)++] = (struct tkv_range){0, sink_end};
    if (recent_begin < n)
        forced[(*n_forced)++] = (struct tkv_range){recent_begin, n};
    *n_out = n;
    return true;
}

/* Appends the tail not yet encoded ([n, n_past), this step's token
 * included) to the m ranges of out; -1 when cap is short. */
static int add_tail(struct tkv_range *out, uint32_t m, uint32_t cap, uint32_t n, uint32_t n_past)
{
    if (n < n_past) {
        if (m > 0 && out[m - 1].end == n)
            out[m - 1].end = n_past;
        else if (m < cap)
            out[m++] = (struct tkv_range){n, n_past};
        else
            return -1;
    }
    return (int)m;
}

/* A completed batch of head i joins the index when the keys are at hand
 * (the step decode_needs_keys asked for them); false: the head is read
 * whole from now on (out of memory, or a full twin). */
static bool catch_up(struct rabitq *r, const struct tkv_policy_view *v, uint32_t head, size_t i)
{
    if (v->kv && pending(r, v, i) >= r->batch) {
        const uint32_t from = indexed(r, i), to = v->n_past - 1;
        if ((!r->dx[i] && rq_reserve(r, r->ix[i], to) != TKV_OK) || append_keys(r, i, &v->kv[head], from, to) != TKV_OK) {
            r->ready[i] = false;
            return false;
        }
    }
    return true;
}

/* Whether head i reads everything at this step without selecting (the
 * hold); every ask of a step gets the same answer. */
static bool holding(const struct rabitq *r, size_t i, uint32_t step)
{
    return step > r->holds[i].from && step <= r->holds[i].to;
}

/* Head i's selection at this step kept `kept` of its n indexed keys: more
 * than `wide` of them, and it holds for the next `hold` steps. */
static void selected(struct rabitq *r, size_t i, uint32_t step, uint64_t kept, uint32_t n)
{
    if (kept > (double)r->wide * n)
        r->holds[i] = (struct rq_hold){step, (uint64_t)step + r->hold};
}

/* Set bits among the first n of a bitmap row. */
static uint32_t row_count(const uint32_t *row, uint32_t n)
{
    uint32_t c = 0;
    for (uint32_t x = 0; x < n / 32; x++)
        c += (uint32_t)__builtin_popcount(row[x]);
    if (n % 32)
        c += (uint32_t)__builtin_popcount(row[n / 32] & ((1u << n % 32) - 1));
    return c;
}

/* Whether v->q is in host memory (be NULL: everything is). */
static bool q_in_host(const struct tkv_policy_view *v) { return v->q_host || !v->be; }

/* Queries a KV head selects with: each of its group's query heads, or with
 * mean the one group query. */
static uint32_t sel_queries(const struct rabitq *r)
{
    return r->mean ? 1 : r->env.n_head / r->env.n_head_kv;
}

/* Query hh (< sel_queries) of KV head g, from q, the step's rows of every
 * query head in host memory: query head g * G + hh's row, or with mean the
 * group's mean, formed in buf ([head_dim]). */
static const float *sel_query(const struct rabitq *r, const float *q, uint32_t g, uint32_t hh, float *buf)
{
    const uint32_t hd = r->env.head_dim, G = r->env.n_head / r->env.n_head_kv;
    const float *row = q + (size_t)(g * G + hh) * hd;
    if (!r->mean)
        return row;
    tkv_rabitq_query_mean(row, hd, G, hd, buf);
    return buf;
}

/* The layer's selection on the device, one call for every KV head that
 * selects (rabitq_select): the queries prepared on the device from v->q
 * (rabitq_prepare, queued: no wait) where it is in backend memory, else
 * here; the union of each head's G query heads comes back as a bitmap.
 * Fills r->slot / sel_n. */
static void select_layer(struct rabitq *r, const struct tkv_policy_view *v)
{
    const uint32_t H = r->env.n_head_kv, hd = r->env.head_dim, G = r->env.n_head / H, S = sel_queries(r);
    const size_t QD = (size_t)r->env.n_head * hd;
    float buf[TKV_RABITQ_MAX_DIM];
    const float *q = v->q + (size_t)(v->n_q - 1) * QD; /* this step's query */
    const bool prep = r->dev_prep && !q_in_host(v);
    uint32_t ns = 0;
    for (uint32_t g = 0; g < H; g++) {
        const size_t i = (size_t)v->layer * H + g;
        r->slot[g] = -1;
        if (!r->ready[i] || !r->dx[i] || !catch_up(r, v, g, i) || holding(r, i, v->step))
            continue;
        struct tkv_range forced[2];
        uint32_t n, nf;
        if (!head_plan(r, v, i, &n, forced, &nf))
            continue;
        bool ok = true;
        for (uint32_t hh = 0; hh < S && ok; hh++)
            if (prep) /* (a refused query comes back poisoned: n_chosen = UINT32_MAX below) */
                r->items[(size_t)ns * S + hh] = (struct tkv_rabitq_prepare_item){
                    tkv_rabitq_dev_arrays(r->dx[i]), g * G + hh, r->mean ? G : 1};
            else
                ok = tkv_rabitq_query_prepare(r->ix[i], sel_query(r, q, g, hh, buf), r->eps,
                                              &r->qs[(size_t)ns * S + hh]) == TKV_OK;
        if (!ok)
            continue; /* a non-finite query: read everything */
        struct tkv_rabitq_select_head *s = &r->sh[ns];
        memset(s, 0, sizeof *s);
        s->ix = tkv_rabitq_dev_arrays(r->dx[i]);
        if (prep)
            s->q_dev = r->qd + (size_t)ns * S;
        else
            s->q = &r->qs[(size_t)ns * S];
        s->n = n;
        s->n_forced = nf;
        s->row = g;
        for (uint32_t f = 0; f < nf; f++)
            s->forced[f].begin = forced[f].begin, s->forced[f].end = forced[f].end;
        r->slot[g] = (int32_t)ns;
        r->sel_n[g] = n;
        ns++;
    }
    if (ns == 0)
        return;
    const struct tkv_rabitq_prepare_args pa = {.q = q, .head_stride = hd, .items = r->items, .n = ns * S,
                                               .eps0 = r->eps, .out = r->qd};
    const struct tkv_rabitq_select_args a = {
        .heads = r->sh, .n_heads = ns, .G = S, .p = r->p, .scale = 1.0f / sqrtf((float)hd), .extra_lse = -INFINITY,
        .safe = r->safe != 0, .coarse = !r->exact, .whole = r->whole,
        .bitmap = r->bitmap_dev ? NULL : r->bitmap, .words = r->words, .bitmap_dev = r->bitmap_dev, .n_rows = H,
        .n_chosen = r->bitmap_dev ? NULL : r->n_chosen};
    if ((prep && r->be->ops->rabitq_prepare(r->be, &pa) != TKV_OK) || r->be->ops->rabitq_select(r->be, &a) != TKV_OK) {
        for (uint32_t g = 0; g < H; g++)
            r->slot[g] = -1; /* read everything this step */
        return;
    }
    if (r->bitmap_dev)
        return; /* rows in backend memory; a non-finite head's row is every key */
    /* a query head whose estimates are not finite (its query refused on the
     * device, or overflowing scalars): the head reads everything, as on the
     * host path */
    for (uint32_t g = 0; g < H; g++) {
        for (uint32_t hh = 0; r->slot[g] >= 0 && hh < S; hh++)
            if (r->n_chosen[(size_t)r->slot[g] * S + hh] == UINT32_MAX)
                r->slot[g] = -1;
        if (r->slot[g] >= 0)
            selected(r, (size_t)v->layer * H + g, v->step,
                     row_count(r->bitmap + (size_t)r->slot[g] * r->words, r->sel_n[g]), r->sel_n[g]);
    }
}

/* This step's selection of v->layer on the device, made once (the cache). */
static void ensure_selected(struct rabitq *r, const struct tkv_policy_view *v)
{
    if (r->c_valid && r->c_layer == v->layer && r->c_n_past == v->n_past && r->c_step == v->step && r->c_q == v->q)
        return;
    select_layer(r, v);
    r->c_valid = true, r->c_layer = v->layer, r->c_n_past = v->n_past, r->c_step = v->step, r->c_q = v->q;
    r->c_rows_host = !r->bitmap_dev;
}

/* rq_decode with the selection on the device: the layer's selection made
 * once per step (ensure_selected; its rows brought down here when they were
 * left in backend memory for the decode table), the head's row of the bitmap
 * turned into ranges. */
static int dev_decode(struct rabitq *r, const struct tkv_policy_view *v, uint32_t head, struct tkv_range *out,
                      uint32_t cap)
{
    ensure_selected(r, v);
    if (!r->c_rows_host) { /* left in backend memory for the decode table: bring the rows down */
        if (r->be->ops->download(r->be, r->bitmap, r->bitmap_dev,
                                 (size_t)r->env.n_head_kv * r->words * sizeof *r->bitmap) != TKV_OK)
            for (uint32_t g = 0; g < r->env.n_head_kv; g++)
                r->slot[g] = -1; /* read everything this step */
        r->c_rows_host = true;
    }
    if (r->slot[head] < 0)
        return -1;
    const uint32_t n = r->sel_n[head], row_i = r->bitmap_dev ? head : (uint32_t)r->slot[head];
    const uint32_t *row = r->bitmap + (size_t)row_i * r->words;
    const uint32_t nw = (n + 31) / 32;
    uint32_t m = 0;
    for (uint32_t j = 0; j < n;) {
        uint32_t w = j / 32, x = row[w] & (~0u << (j % 32)); /* the next set bit */
        while (!x && ++w < nw)
            x = row[w];
        if (!x || (j = w * 32 + (uint32_t)__builtin_ctz(x)) >= n)
            break;
        const uint32_t b = j;
        x = ~row[w] & (~0u << (j % 32)); /* the next clear bit */
        while (!x && ++w < nw)
            x = ~row[w];
        j = TKV_MIN(x ? w * 32 + (uint32_t)__builtin_ctz(x) : nw * 32, n);
        if (m == cap)
            return -1;
        out[m++] = (struct tkv_range){b, j};
    }
    return add_tail(out, m, cap, n, v->n_past);
}

/* decode_bitmap: the layer's rows in backend memory, this step's selection
 * of v->layer made on the device with bitmap_dev if it was not yet. */
static bool rq_bitmap(void *state, const struct tkv_policy_view *v, const uint32_t **bitmap, uint32_t *words,
                      uint32_t *sel_n)
{
    struct rabitq *r = state;
    const uint32_t H = r->env.n_head_kv;
    if (v->n_q == 0)
        return false;
    if (!r->dev_sel || !r->bitmap_dev) { /* no selection on the device: there only if no head selects */
        for (uint32_t g = 0; g < H; g++)
            if (r->ready[(size_t)v->layer * H + g])
                return false; /* the host path selects with this head's index */
        memset(sel_n, 0, H * sizeof *sel_n);
        *bitmap = NULL, *words = 0;
        return true;
    }
    ensure_selected(r, v); /* (a head without a device index does not select: read whole) */
    for (uint32_t g = 0; g < r->env.n_head_kv; g++)
        sel_n[g] = r->slot[g] < 0 ? 0 : r->sel_n[g];
    *bitmap = r->bitmap_dev, *words = r->words;
    return true;
}

/* decode_table_read: the holds of the selections whose rows stayed in
 * backend memory. The table read counts[4g + 2] positions of head g: the
 * row's set bits below sel_n[g] plus the tail [sel_n[g], n_past), so the
 * selection kept counts[4g + 2] - (n_past - sel_n[g]) of its indexed keys,
 * what row_count gives where the rows come to the host (sel_n[g] = 0: read
 * whole, no selection). (A head whose query the device refused has every
 * key in its row: kept all, it holds, where the host path would read it
 * whole for the step only.) */
static void rq_table_read(void *state, uint32_t layer, uint32_t step, uint32_t n_past, const uint32_t *sel_n,
                          const uint32_t *counts)
{
    struct rabitq *r = state;
    const uint32_t H = r->env.n_head_kv;
    for (uint32_t g = 0; g < H; g++)
        if (sel_n[g])
            selected(r, (size_t)layer * H + g, step, counts[4 * g + 2] - (n_past - sel_n[g]), sel_n[g]);
}

static int rq_decode(void *state, const struct tkv_policy_view *v, uint32_t head, struct tkv_range *out, uint32_t cap)
{
    struct rabitq *r = state;
    const uint32_t hd = r->env.head_dim;
    const size_t i = (size_t)v->layer * r->env.n_head_kv + head, QD = (size_t)r->env.n_head * hd;
    if (v->n_q == 0)
        return -1;
    if (r->dev_sel && r->dx[i])
        return dev_decode(r, v, head, out, cap);
    if (!r->ready[i])
        return -1;
    struct tkv_rabitq *ix = r->ix[i];
    if (!q_in_host(v) || !catch_up(r, v, head, i) || holding(r, i, v->step))
        return -1; /* (the query left in backend memory is only for the device path) */
    struct tkv_range forced[2];
    uint32_t n, n_forced;
    if (!head_plan(r, v, i, &n, forced, &n_forced))
        return -1;
    const struct tkv_rabitq_topp_params tp = {.p = r->p, .scale = 1.0f / sqrtf((float)hd), .extra_lse = -INFINITY,
                                              .pos0 = 0, .forced = forced, .n_forced = n_forced,
                                              .coarse = !r->exact};
    memset(r->mark, 0, n);
    const float *q = v->q + (size_t)(v->n_q - 1) * QD; /* this step's query */
    float buf[TKV_RABITQ_MAX_DIM];
    for (uint32_t hh = 0; hh < sel_queries(r); hh++) {
        struct tkv_rabitq_query qq;
        struct tkv_rabitq_topp_result res;
        if (tkv_rabitq_query_prepare(ix, sel_query(r, q, head, hh, buf), r->eps, &qq) != TKV_OK ||
            estimate(r, i, &qq, n) != TKV_OK ||
            tkv_rabitq_select_topp(r->est, r->safe ? r->bound : NULL, n, &tp, r->work, r->work_bytes, r->pos, n,
                                   &res) != TKV_OK)
            return -1; /* a non-finite query: read everything */
        for (uint32_t j = 0; j < res.n_pos; j++)
            r->mark[r->pos[j]] = 1;
    }
    if (r->whole) { /* every token of a touched group */
        const uint32_t B = r->whole;
        for (uint32_t b0 = 0; b0 < n; b0 += B) {
            const uint32_t b1 = TKV_MIN(b0 + B, n);
            if (memchr(r->mark + b0, 1, b1 - b0))
                memset(r->mark + b0, 1, b1 - b0);
        }
    }
    uint32_t m = 0, kept = 0;
    for (uint32_t j = 0; j < n;) {
        if (!r->mark[j]) {
            j++;
            continue;
        }
        const uint32_t b = j;
        while (j < n && r->mark[j])
            j++;
        if (m == cap)
            return -1;
        out[m++] = (struct tkv_range){b, j};
        kept += j - b;
    }
    selected(r, i, v->step, kept, n);
    return add_tail(out, m, cap, n, v->n_past); /* the tail not yet encoded, this step's token included */
}

static size_t rq_memory(void *state)
{
    const struct rabitq *r = state;
    size_t bytes = sizeof *r + r->work_bytes + (size_t)r->env.n_ctx * (2 * sizeof(float) + sizeof(uint32_t) + 1);
    if (r->dev_sel)
        bytes += (size_t)r->env.n_head * (sizeof *r->qs + sizeof *r->n_chosen) +
                 r->env.n_head_kv * (sizeof *r->sh + r->words * sizeof *r->bitmap + sizeof *r->slot + sizeof *r->sel_n);
    if (r->dev_prep) /* (qd is backend memory, counted as the twins' arrays are) */
        bytes += (size_t)r->env.n_head * (sizeof *r->items + sizeof *r->qd);
    for (size_t i = 0; i < (size_t)r->env.n_layer * r->env.n_head_kv; i++)
        bytes += tkv_rabitq_bytes(r->ix[i]) + tkv_rabitq_dev_bytes(r->dx[i]) + sizeof r->ix[i] + sizeof r->dx[i] +
                 2 * sizeof(bool) + sizeof *r->holds;
    return bytes;
}

/* The step's query stays in backend memory when the queries are prepared there. */
static bool rq_query_host(void *state) { return !((const struct rabitq *)state)->dev_prep; }

const struct tkv_policy_ops tkv_policy_rabitq = {
    .name = "rabitq",
    .help = "RaBitQ top-p at decode: p=0.9, safe=1, eps=3, sink=64, recent=64, batch=64, dense=2, hold=16, "
            "wide=0.75; whole=16 and exact=0 where the backend selects, else whole=0 and exact=1",
    .decode_reads_query = true,
    .decode_query_host = rq_query_host,
    .needs_rabitq_ops = true, /* the index is built and grown where the keys are */
    .create = rq_create,
    .destroy = rq_destroy,
    .after_prefill = rq_after_prefill,
    .decode_select = rq_decode,
    .decode_needs_keys = rq_needs_keys,
    .decode_bitmap = rq_bitmap,
    .decode_table_read = rq_table_read,
    .reset = rq_reset,
    .memory_bytes = rq_memory,
};

/* ---- entropy+rabitq ------------------------------------------------------------------ */

struct entropy_rabitq {
    void *ent;        /* the entropy policy's state: prefill and classification */
    struct rabitq *rq;
};

/* entropy's parameters that act at decode, where the composition uses top-p */
static const char *const ent_decode_keys[] = {"gap", "window", "keep", "budget", "resel", "drop", NULL};

static void er_destroy(void *state)
{
    struct entropy_rabitq *c = state;
    if (!c)
        return;
    if (c->ent)
        tkv_policy_entropy.destroy(c->ent);
    rq_destroy(c->rq);
    free(c);
}

static tkv_status er_create(const struct tkv_policy_env *env, const struct tkv_policy_args *args, void **state)
{
    const char *name = "entropy+rabitq";
    static const char *const known[] = {RQ_KEYS,     "faithful", "segment", "block", "threshold", "layer_skip",
                                        "base",      "rigid_after", "e_t",  "delta", "alpha",     NULL};
    for (uint32_t i = 0; i < args->n; i++)
        for (const char *const *k = ent_decode_keys; *k; k++)
            if (!strcmp(*k, args->key[i]))
                return tkv_err(TKV_ERR_INVALID_ARG,
                               "policy '%s': '%s' is an entropy decode parameter; here decode is rabitq top-p", name,
                               *k);
    TKV_TRY(tkv_policy_args_done(name, args, known));
    struct tkv_policy_args ra = {0}, ea = {0}; /* split: rabitq's keys, the rest entropy's */
    for (uint32_t i = 0; i < args->n; i++) {
        bool mine = false;
        for (const char *const *k = rq_keys; *k && !mine; k++)
            mine = !strcmp(*k, args->key[i]);
        struct tkv_policy_args *to = mine ? &ra : &ea;
        memcpy(to->key[to->n], args->key[i], sizeof to->key[0]);
        memcpy(to->value[to->n], args->value[i], sizeof to->value[0]);
        to->n++;
    }
    struct entropy_rabitq *c = calloc(1, sizeof *c);
    if (!c)
        return tkv_err(TKV_ERR_NOMEM, "policy '%s': out of memory", name);
    tkv_status st = tkv_policy_entropy.create(env, &ea, &c->ent);
    if (st == TKV_OK)
        st = rq_make(name, env, &ra, &c->rq);
    if (st != TKV_OK) {
        er_destroy(c);
        return st;
    }
    memset(c->rq->use, 0, (size_t)env->n_layer * env->n_head_kv * sizeof *c->rq->use); /* set after the prefill */
    *state = c;
    return TKV_OK;
}

static int er_prefill(void *state, const struct tkv_policy_view *v, uint32_t head, struct tkv_range *out,
                      uint32_t cap)
{
    return tkv_policy_entropy.prefill_select(((struct entropy_rabitq *)state)->ent, v, head, out, cap);
}

/* The prefill has classified every head: top-p for the Rigid ones. */
static tkv_status er_after_prefill(void *state, const struct tkv_policy_view *v)
{
    struct entropy_rabitq *c = state;
    const uint32_t H = c->rq->env.n_head_kv;
    for (uint32_t g = 0; g < H; g++)
        c->rq->use[(size_t)v->layer * H + g] = v->layer >= c->rq->dense && tkv_entropy_rigid(c->ent, v->layer, g);
    return rq_after_prefill(c->rq, v);
}

static int er_decode(void *state, const struct tkv_policy_view *v, uint32_t head, struct tkv_range *out, uint32_t cap)
{
    return rq_decode(((struct entropy_rabitq *)state)->rq, v, head, out, cap);
}

static bool er_needs_keys(void *state, const struct tkv_policy_view *v)
{
    return rq_needs_keys(((struct entropy_rabitq *)state)->rq, v);
}

static bool er_bitmap(void *state, const struct tkv_policy_view *v, const uint32_t **bitmap, uint32_t *words,
                      uint32_t *sel_n)
{
    return rq_bitmap(((struct entropy_rabitq *)state)->rq, v, bitmap, words, sel_n);
}

static void er_table_read(void *state, uint32_t layer, uint32_t step, uint32_t n_past, const uint32_t *sel_n,
                          const uint32_t *counts)
{
    rq_table_read(((struct entropy_rabitq *)state)->rq, layer, step, n_past, sel_n, counts);
}

static bool er_query_host(void *state) { return rq_query_host(((struct entropy_rabitq *)state)->rq); }

static void er_reset(void *state)
{
    struct entropy_rabitq *c = state;
    tkv_policy_entropy.reset(c->ent);
    rq_reset(c->rq);
}

static uint32_t er_segment(void *state) { return tkv_policy_entropy.segment(((struct entropy_rabitq *)state)->ent); }

static bool er_dense(void *state, uint32_t n)
{
    return tkv_policy_entropy.prefill_dense(((struct entropy_rabitq *)state)->ent, n);
}

static size_t er_memory(void *state) { return rq_memory(((struct entropy_rabitq *)state)->rq); }

const struct tkv_policy_ops tkv_policy_entropy_rabitq = {
    .name = "entropy+rabitq",
    .help = "EntropyInfer's prefill; at decode Dynamic heads dense, Rigid heads rabitq top-p (rabitq's and "
            "entropy's prefill parameters)",
    .changes_prefill = true,
    .decode_reads_query = true,
    .decode_query_host = er_query_host,
    .needs_rabitq_ops = true,
    .create = er_create,
    .destroy = er_destroy,
    .prefill_select = er_prefill,
    .after_prefill = er_after_prefill,
    .decode_select = er_decode,
    .decode_needs_keys = er_needs_keys,
    .decode_bitmap = er_bitmap,
    .decode_table_read = er_table_read,
    .reset = er_reset,
    .segment = er_segment,
    .prefill_dense = er_dense,
    .memory_bytes = er_memory,
};
