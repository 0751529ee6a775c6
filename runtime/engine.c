/*
 * engine.c -- sessions and the Llama forward pass, written once against the
 * backend interface (runtime/backend.h).
 *
 * One forward call processes a chunk of n tokens at positions
 * [n_past, n_past + n):
 *
 *     x = embed(tokens)                                   x[n, E]
 *     for each layer:
 *         h = rmsnorm(x) * attn_norm
 *         q, k, v = h Wq, h Wk, h Wv ; rope(q), rope(k)   q[n, H*hd] k,v[n, Hkv*hd]
 *         K/V rows -> the layer's KV blocks (f16)
 *         x += attention(q, KV blocks the policy selects) Wo
 *         h = rmsnorm(x) * ffn_norm
 *         x += (silu(h Wgate) * (h Wup)) Wdown
 *     logits = (rmsnorm(x[n-1]) * output_norm) Wout      (last chunk only)
 *
 * Prefill runs the prompt in chunks of `prefill_chunk` tokens; decode is a
 * chunk of one. All activation buffers are sized at session init.
 */
#include "hetero.h"
#include "session.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>


struct tkv_session_params tkv_session_default_params(void)
{
    return (struct tkv_session_params){
        .n_ctx = 0,
        .n_threads = 0,
        .device = "cpu",
        .policy = "full",
        .kv_budget = 0,
        .kv_block = DEFAULT_KV_BLOCK,
        .prefill_chunk = DEFAULT_PREFILL_CHUNK,
    };
}

/* ---- init / free ----------------------------------------------------------- */

static tkv_status weight(tkv_session *s, const struct tkv_gguf_tensor *t, struct tkv_bweight **out)
{
    tkv_status st = s->be->ops->weight_init(s->be, t, out);
    return st == TKV_OK ? st : tkv_err_wrap(st, "loading %s on %s", t->name, s->be->ops->name);
}

/* Page-locks host memory that the backend copies to or from every step, so
 * that those copies run as true asynchronous DMA instead of through the
 * driver's staging of pageable memory; false where the backend cannot (the
 * memory then works as it is: nothing depends on the pinning). */
static bool pin_host(tkv_session *s, void *p, size_t bytes)
{
    const struct tkv_backend_ops *ops = s->be->ops;
    return ops->host_register && ops->host_unregister && ops->host_register(s->be, p, bytes) == TKV_OK;
}

static tkv_status alloc_act(tkv_session *s, size_t floats, float **out)
{
    return s->be->ops->alloc(s->be, floats * sizeof(float), (void **)out);
}

void tkv_session_free(tkv_session *s)
{
    if (!s)
        return;
    struct tkv_backend *be = s->be;
    tkv_policy_free(s->policy); /* first: it may hold backend memory (a RaBitQ index's device twin) */
    if (be) {
        struct tkv_bweight *single[] = {s->tok_embd, s->output_norm, s->output != s->tok_embd ? s->output : NULL};
        for (size_t i = 0; i < 3; i++)
            if (single[i])
                be->ops->weight_free(be, single[i]);
        if (s->layers)
            for (uint32_t l = 0; l < s->hp.n_layer; l++) {
                struct tkv_bweight **w = (struct tkv_bweight **)&s->layers[l];
                for (size_t i = 0; i < sizeof(struct layer_weights) / sizeof(void *); i++)
                    if (w[i])
                        be->ops->weight_free(be, w[i]);
            }
        float *acts[] = {s->x, s->h, s->q, s->k, s->v, s->att, s->gate, s->up, s->logits_dev,
                         s->att_full, s->lse_full, s->lse_sel, s->lse_dev};
        for (size_t i = 0; i < sizeof acts / sizeof acts[0]; i++)
            if (acts[i])
                be->ops->release(be, acts[i]);
        void *dt[] = {s->dt_refs, s->dt_miss, s->dt_counts};
        for (size_t i = 0; i < sizeof dt / sizeof dt[0]; i++)
            if (dt[i])
                be->ops->release(be, dt[i]);
        if (s->dt_hmiss_pinned)
            be->ops->host_unregister(be, s->dt_hmiss);
        if (s->logits_pinned)
            be->ops->host_unregister(be, s->logits);
        tkv_kvs_free(s->kv);
        be->ops->free(be);
    }
    if (s->be_cpu) {
        s->be_cpu->ops->release(s->be_cpu, s->att_cpu);
        s->be_cpu->ops->release(s->be_cpu, s->lse_cpu);
        s->be_cpu->ops->free(s->be_cpu);
    }
    if (s->trace)
        fclose(s->trace);
    free(s->trace_buf);
    free(s->dt_hmiss);
    free(s->dt_sel_n);
    free(s->dt_defer);
    free(s->dt_marked);
    free(s->host_ok);
    free(s->het_heads);
    free(s->hviews);
    free(s->hrefs);
    free(s->ref_host);
    free(s->att_mrg);
    free(s->lse_mrg);
    free(s->layers);
    free(s->logits);
    free(s->pos);
    free(s->views);
    free(s->sel_refs);
    free(s->tokens);
    free(s->obs_q);
    free(s->q_step);
    free(s->plan_ranges);
    free(s->need);
    free(s);
}

/* Heterogeneous decode (hetero.h): a CPU backend that attends the host
 * tier's selected blocks where they are, its buffers, and the cost model's
 * rates. Only below a device with a host tier, and not when every block is
 * to be recalled anyway. */
static tkv_status hetero_init(tkv_session *s, const struct tkv_session_params *p)
{
    const struct tkv_model_info *hp = &s->hp;
    s->hetero = p->hetero;
    if (p->hetero > TKV_HETERO_CPU)
        return tkv_err(TKV_ERR_INVALID_ARG, "session: hetero mode %d is not auto (0), recall (1) or cpu (2)",
                       (int)p->hetero);
    if (!(p->hetero_link_gbs >= 0) || !(p->hetero_cpu_gflops >= 0))
        return tkv_err(TKV_ERR_INVALID_ARG, "session: hetero rates must be >= 0 (link %g GB/s, cpu %g GFLOP/s)",
                       p->hetero_link_gbs, p->hetero_cpu_gflops);
    s->link_bps = p->hetero_link_gbs > 0 ? p->hetero_link_gbs * 1e9 : TKV_HETERO_LINK_BPS;
    s->cpu_flops = p->hetero_cpu_gflops * 1e9;
    if (s->be_host || p->host_kv_mem == 0 || p->hetero == TKV_HETERO_RECALL)
        return TKV_OK;
    const size_t QD = (size_t)hp->n_head * hp->head_dim;
    TKV_TRY(tkv_backend_create("cpu", p->n_threads, &s->be_cpu));
    TKV_TRY(s->be_cpu->ops->alloc(s->be_cpu, QD * sizeof(float), (void **)&s->att_cpu));
    TKV_TRY(s->be_cpu->ops->alloc(s->be_cpu, hp->n_head * sizeof(float), (void **)&s->lse_cpu));
    TKV_TRY(alloc_act(s, hp->n_head, &s->lse_dev));
    s->host_ok = calloc((size_t)hp->n_head_kv * tkv_kvs_max_blocks(s->kv), 1);
    s->hviews = calloc(hp->n_head_kv, sizeof *s->hviews);
    s->hrefs = calloc((size_t)hp->n_head_kv * s->max_refs, sizeof *s->hrefs);
    s->ref_host = calloc(s->max_refs, 1);
    s->att_mrg = malloc(QD * sizeof(float));
    s->lse_mrg = malloc(hp->n_head * sizeof(float));
    if (!s->host_ok || !s->hviews || !s->hrefs || !s->ref_host || !s->att_mrg || !s->lse_mrg)
        return tkv_err(TKV_ERR_NOMEM, "session: out of memory");
    if (p->hetero != TKV_HETERO_AUTO)
        return TKV_OK;
    const size_t n = (size_t)hp->n_layer * hp->n_head_kv;
    if (!(s->het_heads = malloc(n * sizeof *s->het_heads)))
        return tkv_err(TKV_ERR_NOMEM, "session: out of memory");
    for (size_t i = 0; i < n; i++)
        s->het_heads[i] = TKV_HETERO_HEAD_INIT;
    if (s->cpu_flops == 0) { /* measured: the verification's cost too, and then observed */
        s->het_observe = true;
        s->het_observe_min_s = TKV_HETERO_OBSERVE_MIN_S;
        tkv_hetero_arms_init(&s->arms);
        tkv_status st = tkv_hetero_measure_cpu(s->be_cpu, hp->n_head_kv, hp->n_head / hp->n_head_kv, hp->head_dim,
                                               s->kv_block, &s->cpu_flops);
        if (st != TKV_OK)
            return tkv_err_wrap(st, "session: measuring the CPU's attention rate");
        s->crc_bps = tkv_hetero_measure_crc() * tkv_kvs_verify_threads(s->kv);
    }
    return TKV_OK;
}

static tkv_status session_build(tkv_session *s, const struct tkv_session_params *p)
{
    const struct tkv_llama *m = &s->model->llama;
    const struct tkv_model_info *hp = &s->hp;
    TKV_TRY(tkv_backend_create(s->device, p->n_threads, &s->be));
    s->be_host = !strcmp(s->be->ops->name, "cpu");
    /* TKV_FUSE=0: the plain op sequence even where the backend has fused
     * ops (to measure them; the results agree within their tolerances);
     * read once here, not per forward call */
    const char *fuse_env = getenv("TKV_FUSE");
    s->fuse = !(fuse_env && !strcmp(fuse_env, "0"));
    /* the device decode table (session.h), on a backend with kv_table: by
     * default where the backend's memory is not the host's (the table saves
     * a host round trip per decode layer there; docs/rabitq.md measures it);
     * TKV_RABITQ_DEVICE_TABLE=1 or 0 turns it on or off anywhere */
    const char *table_env = getenv("TKV_RABITQ_DEVICE_TABLE");
    if (table_env && strcmp(table_env, "0") && strcmp(table_env, "1"))
        return tkv_err(TKV_ERR_INVALID_ARG, "session: TKV_RABITQ_DEVICE_TABLE='%s' is not 0 or 1", table_env);
    s->dev_table = (table_env ? !strcmp(table_env, "1") : !s->be_host) && s->be->ops->kv_table;
    /* TKV_TRACE=FILE: a diagnostic, for comparing two runs layer by layer
     * (scripts/trace-diff.py) */
    const char *trace_env = getenv("TKV_TRACE");
    if (trace_env && *trace_env) {
        s->trace = fopen(trace_env, "wb");
        if (!s->trace)
            return tkv_err(TKV_ERR_IO, "session: TKV_TRACE=%s: %s", trace_env, strerror(errno));
    }

    TKV_TRY(weight(s, m->tok_embd, &s->tok_embd));
    TKV_TRY(weight(s, m->output_norm, &s->output_norm));
    if (m->tied_output)
        s->output = s->tok_embd;
    else
        TKV_TRY(weight(s, m->output, &s->output));
    s->layers = calloc(hp->n_layer, sizeof *s->layers);
    if (!s->layers)
        return tkv_err(TKV_ERR_NOMEM, "session: out of memory");
    for (uint32_t l = 0; l < hp->n_layer; l++) {
        const struct tkv_llama_layer *src = &m->layers[l];
        struct layer_weights *dst = &s->layers[l];
        TKV_TRY(weight(s, src->attn_norm, &dst->attn_norm));
        TKV_TRY(weight(s, src->wq, &dst->wq));
        TKV_TRY(weight(s, src->wk, &dst->wk));
        TKV_TRY(weight(s, src->wv, &dst->wv));
        TKV_TRY(weight(s, src->wo, &dst->wo));
        TKV_TRY(weight(s, src->ffn_norm, &dst->ffn_norm));
        TKV_TRY(weight(s, src->w_gate, &dst->w_gate));
        TKV_TRY(weight(s, src->w_up, &dst->w_up));
        TKV_TRY(weight(s, src->w_down, &dst->w_down));
    }

    const bool on_host = s->be_host;
    /* TKV_KV_EVICT=cycle: the KV store evicts by the layer cycle alone (no
     * stale blocks first; for A/B runs, docs/kv-layout.md) */
    const char *evict_env = getenv("TKV_KV_EVICT");
    if (evict_env && strcmp(evict_env, "cycle") && strcmp(evict_env, "stale"))
        return tkv_err(TKV_ERR_INVALID_ARG, "session: TKV_KV_EVICT='%s' is not cycle or stale", evict_env);
    /* TKV_KV_HOMES=0: no home slots (the compute tier's layout before
     * session 44, for A/B runs, docs/kv-layout.md) */
    const char *homes_env = getenv("TKV_KV_HOMES");
    if (homes_env && strcmp(homes_env, "0") && strcmp(homes_env, "1"))
        return tkv_err(TKV_ERR_INVALID_ARG, "session: TKV_KV_HOMES='%s' is not 0 or 1", homes_env);
    struct tkv_kvs_params kp = {.n_layer = hp->n_layer, .n_head_kv = hp->n_head_kv, .head_dim = hp->head_dim,
                                .block_tokens = s->kv_block, .max_tokens = s->n_ctx, .compute_is_host = on_host,
                                .compute_bytes = on_host ? p->host_kv_mem : p->gpu_kv_mem,
                                .host_bytes = on_host ? 0 : p->host_kv_mem, .nvme_dir = p->nvme_dir,
                                .nvme_bytes = p->nvme_kv_max,
                                .pci_bus_id = s->be->ops->pci_bus_id ? s->be->ops->pci_bus_id(s->be) : NULL,
                                .page_table = s->dev_table,
                                .evict_cycle = evict_env && !strcmp(evict_env, "cycle"),
                                .no_homes = homes_env && !strcmp(homes_env, "0")};
    TKV_TRY(tkv_kvs_init(&kp, s->be, &s->kv));

    struct tkv_policy_env env = {.n_layer = hp->n_layer, .n_head = hp->n_head, .n_head_kv = hp->n_head_kv,
                                 .head_dim = hp->head_dim, .n_ctx = s->n_ctx, .block_tokens = s->kv_block,
                                 .budget = s->kv_budget, .device_table = s->dev_table,
                                 .kv_paged = !tkv_kvs_compute_holds_all(s->kv)};
    TKV_TRY(tkv_policy_create(s->policy_spec, &env, &s->policy));
    /* policies compute their statistics through the backend's attn_stats op
     * (policy.h); one that reads the keys itself needs them in host memory */
    const struct tkv_policy_ops *po = s->policy->ops;
    if (!s->be_host && po->reads_keys)
        return tkv_err(TKV_ERR_UNSUPPORTED, "policy '%s' reads the keys in host memory: use --device cpu", po->name);
    if (!s->be_host && po->needs_rabitq_ops && !(s->be->ops->rabitq_encode && s->be->ops->rabitq_estimate))
        return tkv_err(TKV_ERR_UNSUPPORTED, "policy '%s' needs RaBitQ kernels, which backend '%s' lacks", po->name,
                       s->be->ops->name);
    if (!s->be->ops->attn_stats && !po->reads_keys &&
        (po->prefill_select || (po->after_prefill && !po->needs_rabitq_ops))) /* rabitq's own needs no statistics */
        return tkv_err(TKV_ERR_UNSUPPORTED, "policy '%s' needs attention statistics, which backend '%s' lacks",
                       po->name, s->be->ops->name);
    if (s->policy->ops->segment) /* the policy's segments are the prefill chunks */
        s->chunk = TKV_MIN(TKV_MIN(s->policy->ops->segment(s->policy->state), s->n_ctx), 8192u);
    const size_t C = s->chunk, E = hp->n_embd, QD = (size_t)hp->n_head * hp->head_dim;
    const size_t KD = (size_t)hp->n_head_kv * hp->head_dim, F = hp->n_ff;
    TKV_TRY(alloc_act(s, C * E, &s->x));
    TKV_TRY(alloc_act(s, C * TKV_MAX(E, QD), &s->h));
    TKV_TRY(alloc_act(s, C * QD, &s->q));
    TKV_TRY(alloc_act(s, C * KD, &s->k));
    TKV_TRY(alloc_act(s, C * KD, &s->v));
    TKV_TRY(alloc_act(s, C * QD, &s->att));
    TKV_TRY(alloc_act(s, C * F, &s->gate));
    TKV_TRY(alloc_act(s, C * F, &s->up));
    TKV_TRY(alloc_act(s, hp->n_vocab, &s->logits_dev));

    s->max_blocks = (s->n_ctx + s->kv_block - 1) / s->kv_block;
    /* a selection of ranges splits at block boundaries into at most
     * ranges + blocks references */
    s->max_ranges = s->n_ctx / 2 + 4;
    s->max_refs = s->max_ranges + s->max_blocks;
    s->logits = malloc((size_t)hp->n_vocab * sizeof(float));
    s->pos = malloc(C * sizeof(int32_t));
    s->views = calloc(hp->n_head_kv, sizeof *s->views);
    s->sel_refs = calloc((size_t)hp->n_head_kv * s->max_refs, sizeof *s->sel_refs);
    s->tokens = malloc((size_t)s->n_ctx * sizeof *s->tokens);
    s->plan_ranges = malloc((size_t)hp->n_head_kv * s->max_ranges * sizeof *s->plan_ranges);
    s->need = malloc((size_t)hp->n_head_kv * tkv_kvs_max_blocks(s->kv));
    s->obs_q = malloc((size_t)hp->n_layer * OBS_QUERIES * QD * sizeof(float));
    s->q_step = malloc(QD * sizeof(float));
    if (s->trace)
        s->trace_buf = malloc(C * E * sizeof(float));
    if (!s->logits || !s->pos || !s->views || !s->sel_refs || !s->tokens || !s->obs_q || !s->q_step ||
        !s->plan_ranges || !s->need || (s->trace && !s->trace_buf))
        return tkv_err(TKV_ERR_NOMEM, "session: out of memory");
    /* every step brings the logits down (513 KB for a 128K vocabulary) */
    s->logits_pinned = pin_host(s, s->logits, (size_t)hp->n_vocab * sizeof(float));
    if (s->dev_table) {
        const size_t refs = (size_t)hp->n_head_kv * s->max_refs * sizeof(struct tkv_kv_block_ref);
        TKV_TRY(s->be->ops->alloc(s->be, refs, (void **)&s->dt_refs));
        TKV_TRY(s->be->ops->alloc(s->be, refs, (void **)&s->dt_miss));
        /* the counts, then the read marks: one region each side, so that
         * one copy brings down both (table_flush) */
        const size_t hcounts = (size_t)hp->n_layer * hp->n_head_kv * 4 * sizeof *s->dt_hcounts;
        const size_t hmarks = (size_t)hp->n_layer * hp->n_head_kv * tkv_kvs_mark_words(s->kv) * sizeof *s->dt_hmarks;
        TKV_TRY(s->be->ops->alloc(s->be, hcounts + hmarks, (void **)&s->dt_counts));
        s->dt_marks = (uint32_t *)((char *)s->dt_counts + hcounts);
        s->dt_sel_n = malloc((size_t)hp->n_layer * hp->n_head_kv * sizeof *s->dt_sel_n);
        s->dt_defer = calloc(hp->n_layer, sizeof *s->dt_defer);
        s->dt_marked = calloc(hp->n_layer, sizeof *s->dt_marked);
        /* the miss lists, the counts, the marks (one region: a page can be pinned once) */
        const size_t hmiss = (size_t)hp->n_head_kv * s->max_refs * sizeof *s->dt_hmiss;
        s->dt_hmiss = calloc(1, hmiss + hcounts + hmarks);
        if (!s->dt_sel_n || !s->dt_hmiss || !s->dt_defer || !s->dt_marked)
            return tkv_err(TKV_ERR_NOMEM, "session: out of memory");
        s->dt_hcounts = (uint32_t *)((char *)s->dt_hmiss + hmiss);
        s->dt_hmarks = (uint32_t *)((char *)s->dt_hcounts + hcounts);
        /* no marks yet (kv_table writes only the words of a context's blocks) */
        TKV_TRY(s->be->ops->upload(s->be, s->dt_marks, s->dt_hmarks, hmarks));
        /* the counts (every decode layer) and the miss lists (one batch) come down */
        s->dt_hmiss_pinned = pin_host(s, s->dt_hmiss, hmiss + hcounts + hmarks);
    }
    if (s->flags & TKV_SESSION_MEASURE_MASS) {
        TKV_TRY(alloc_act(s, QD, &s->att_full));
        TKV_TRY(alloc_act(s, hp->n_head, &s->lse_full));
        TKV_TRY(alloc_act(s, hp->n_head, &s->lse_sel));
    }
    return hetero_init(s, p);
}

tkv_status tkv_session_init(const tkv_model *model, const struct tkv_session_params *params, tkv_session **out)
{
    if (!out)
        return tkv_err(TKV_ERR_INVALID_ARG, "tkv_session_init: out is NULL");
    *out = NULL;
    if (!model)
        return tkv_err(TKV_ERR_INVALID_ARG, "tkv_session_init: model is NULL");
    struct tkv_session_params p = params ? *params : tkv_session_default_params();
    const struct tkv_model_info *hp = &model->llama.info;
    if (p.n_ctx == 0)
        p.n_ctx = hp->n_ctx_train;
    if (p.n_ctx > (1u << 24))
        return tkv_err(TKV_ERR_INVALID_ARG, "session: context of %u tokens is above the limit of %u", p.n_ctx, 1u << 24);
    if (p.kv_block == 0)
        p.kv_block = DEFAULT_KV_BLOCK;
    if (p.kv_block > 256 || p.kv_block % 8)
        return tkv_err(TKV_ERR_INVALID_ARG, "session: kv_block %u must be a multiple of 8 in [8, 256]", p.kv_block);
    if (p.prefill_chunk == 0)
        p.prefill_chunk = DEFAULT_PREFILL_CHUNK;
    if (p.prefill_chunk > 8192)
        return tkv_err(TKV_ERR_INVALID_ARG, "session: prefill_chunk %u is above 8192", p.prefill_chunk);
    if (p.n_threads > 1024)
        return tkv_err(TKV_ERR_INVALID_ARG, "session: %u threads is above 1024", p.n_threads);
    const char *device = p.device ? p.device : "cpu", *policy = p.policy ? p.policy : "full";
    tkv_session *s = calloc(1, sizeof *s);
    if (!s)
        return tkv_err(TKV_ERR_NOMEM, "session: out of memory");
    if (strlen(device) >= sizeof s->device || strlen(policy) >= sizeof s->policy_spec) {
        free(s);
        return tkv_err(TKV_ERR_INVALID_ARG, "session: device or policy string too long");
    }
    s->model = model;
    s->hp = *hp;
    s->n_ctx = p.n_ctx;
    s->chunk = TKV_MIN(p.prefill_chunk, p.n_ctx);
    s->kv_block = p.kv_block;
    s->kv_budget = p.kv_budget;
    s->progress = p.progress;
    s->progress_user = p.progress_user;
    s->flags = p.flags;
    strcpy(s->device, device);
    strcpy(s->policy_spec, policy);
    tkv_status st = session_build(s, &p);
    if (st != TKV_OK) {
        tkv_session_free(s);
        return st;
    }
    *out = s;
    return TKV_OK;
}

/* ---- forward pass ---------------------------------------------------------- */

/* Writes the chunk's K and V rows of one layer into the KV blocks, one
 * piece per block the chunk touches (blocks start at multiples of B, the
 * same for every head): with kv_write_heads, one call per piece for all
 * heads (a decode step: one call; a 512-token prefill chunk in 64-token
 * blocks: 8 instead of 2 * Hkv * 8 kv_write calls, each a launch on the
 * GPU), else per head and piece with kv_write. */
static tkv_status store_kv(tkv_session *s, uint32_t layer, uint32_t n)
{
    const struct tkv_backend_ops *ops = s->be->ops;
    const uint32_t hd = s->hp.head_dim, Hkv = s->hp.n_head_kv, B = s->kv_block;
    const size_t stride = (size_t)Hkv * hd;
    const bool heads = ops->kv_write_heads && Hkv <= 256;
    for (uint32_t i = 0; i < n;) {
        const uint32_t pos = s->n_past + i, rows = TKV_MIN(n - i, B - pos % B);
        const float *k = s->k + i * stride, *v = s->v + i * stride;
        uint16_t *kd[256], *vd[256];
        for (uint32_t h = 0; h < Hkv; h++) {
            uint16_t *kh, *vh;
            tkv_kvs_locate(s->kv, layer, h, pos, &kh, &vh);
            if (heads) {
                kd[h] = kh, vd[h] = vh;
                continue;
            }
            TKV_TRY(ops->kv_write(s->be, k + (size_t)h * hd, stride, kh, rows, hd));
            TKV_TRY(ops->kv_write(s->be, v + (size_t)h * hd, stride, vh, rows, hd));
        }
        if (heads)
            TKV_TRY(ops->kv_write_heads(s->be, k, v, stride, kd, vd, Hkv, rows, hd));
        i += rows;
    }
    return TKV_OK;
}

/* A decode phase timer's edge: the time now, after the backend has finished
 * its queued work when the session times phases synchronously
 * (TKV_SESSION_PHASE_SYNC); a failed synchronize is left for the next op to
 * report. */
static double phase_edge(tkv_session *s)
{
    if (s->flags & TKV_SESSION_PHASE_SYNC)
        (void)s->be->ops->synchronize(s->be);
    return tkv_now_seconds();
}

/* Turns token ranges into block references (slices of the layer's blocks).
 * host: NULL, or the blocks read on the host tier (tkv_kvs_host_view),
 * which stand in for the compute view's empty entries; on_host[j] (when
 * host is given) says which of the two slice j comes from. */
static uint32_t ranges_to_refs(const struct tkv_kv_head_view *all, const struct tkv_kv_head_view *host, uint32_t B,
                               const struct tkv_range *r, uint32_t n, uint32_t hd, struct tkv_kv_block_ref *out,
                               uint32_t cap, uint8_t *on_host)
{
    uint32_t m = 0;
    for (uint32_t i = 0; i < n; i++)
        for (uint32_t p = r[i].begin; p < r[i].end && m < cap;) {
            const uint32_t b = p / B;
            if (b >= all->n_blocks)
                break;
            const struct tkv_kv_block_ref *blk = &all->blocks[b];
            const bool below = host && !blk->k && host->blocks[b].k;
            if (below)
                blk = &host->blocks[b];
            if (host)
                on_host[m] = below;
            const uint32_t off = p - (uint32_t)blk->pos0;
            if (off >= blk->n)
                break;
            const uint32_t len = TKV_MIN(r[i].end - p, blk->n - off);
            out[m++] = (struct tkv_kv_block_ref){.k = blk->k + (size_t)off * hd, .v = blk->v + (size_t)off * hd,
                                                 .pos0 = (int32_t)p, .n = len};
            p += len;
        }
    return m;
}

/* Accounts KV head h's read at a decode step of `tokens` positions in
 * `blocks` blocks of a context of n tokens; all_in: the store brought every
 * block in. A layer's heads come one after another, head 0 first. */
static void account_counts(tkv_session *s, uint32_t h, uint32_t tokens, uint32_t blocks, uint32_t n, bool all_in)
{
    const uint32_t nb = (n + s->kv_block - 1) / s->kv_block;
    const double share = n ? (double)tokens / n : 1.0;
    s->read_tokens += share;
    s->read_blocks += all_in || !nb ? 1.0 : (double)blocks / nb;
    s->read_count++;
    /* the sum of the layers' largest shares grows by what each head adds
     * to its layer's */
    if (h == 0) {
        s->read_layers++;
        s->read_tokens_max += share;
        s->head_max = share;
    } else if (share > s->head_max) {
        s->read_tokens_max += share - s->head_max;
        s->head_max = share;
    }
}

/* Accounts KV head h's read at a decode step: refs[nr] (ascending slices,
 * none across a block boundary) of a context of n tokens; all_in: the store
 * brought every block in. */
static void account_read(tkv_session *s, uint32_t h, const struct tkv_kv_block_ref *refs, uint32_t nr, uint32_t n,
                         bool all_in)
{
    uint32_t tokens = 0, blocks = 0, last = UINT32_MAX;
    for (uint32_t i = 0; i < nr; i++) {
        const uint32_t b = (uint32_t)refs[i].pos0 / s->kv_block;
        tokens += refs[i].n;
        blocks += b != last;
        last = b;
    }
    account_counts(s, h, tokens, blocks, n, all_in);
}

/* Whether layer_forward copies a decode step's query to s->q_step for the
 * policy: on a device backend, for a policy that reads it on the host. */
static bool query_to_host(const tkv_session *s)
{
    const struct tkv_policy_ops *po = s->policy->ops;
    return s->in_decode && !s->be_host && po->decode_reads_query &&
           (!po->decode_query_host || po->decode_query_host(s->policy->state));
}

/* The policy's view of `layer` for the n queries in s->q (kv: NULL or the
 * layer's head views). A decode step's query is in host memory for a policy
 * that reads it there (layer_forward copied it to s->q_step on a device
 * backend). */
static struct tkv_policy_view policy_view(const tkv_session *s, uint32_t layer, uint32_t n,
                                          const struct tkv_kv_head_view *kv)
{
    const bool copied = query_to_host(s);
    return (struct tkv_policy_view){.layer = layer, .n_past = s->n_past + n, .n_prompt = s->n_prompt,
                                    .step = s->step, .prefill_end = s->prefill_end, .q = copied ? s->q_step : s->q,
                                    .q_host = copied || s->be_host, .q_pos = s->pos, .n_q = n, .kv = kv,
                                    .be = s->be, .kv_host = s->be_host};
}

/* The keys each KV head of `layer` attends to for n queries, as the policy
 * decides; returns whether any head was restricted. During prefill a
 * selecting policy names past keys and the chunk's own keys are added. */
static bool select_views(tkv_session *s, uint32_t layer, uint32_t n, const int *plan)
{
    const struct tkv_policy_ops *po = s->policy->ops;
    const bool decode = s->in_decode;
    int (*hook)(void *, const struct tkv_policy_view *, uint32_t, struct tkv_range *, uint32_t) =
        decode ? po->decode_select : po->prefill_select;
    bool restricted = false;
    const struct tkv_policy_view v = policy_view(s, layer, n, s->views);
    for (uint32_t h = 0; h < s->hp.n_head_kv; h++)
        s->views[h] = tkv_kvs_view(s->kv, layer, h);
    if (!hook)
        return false;
    /* (asked before the hook runs: a policy may catch up on keys in it) */
    const bool all_in = decode && po->decode_needs_keys && po->decode_needs_keys(s->policy->state, &v);
    for (uint32_t h = 0; h < s->hp.n_head_kv; h++) {
        struct tkv_range *ranges = s->plan_ranges + (size_t)h * s->max_ranges;
        const double t0 = decode && !plan ? phase_edge(s) : 0;
        int m = plan ? plan[h] : hook(s->policy->state, &v, h, ranges, s->max_ranges - 1);
        if (decode && !plan)
            s->ph_select += phase_edge(s) - t0;
        const bool whole = m < 0;
        if (whole) {
            if (decode)
                account_read(s, h, NULL, 0, 0, true);
            if (!s->hsplit)
                continue;
            /* read whole, part of it on the host tier: one range, split below */
            ranges[0] = (struct tkv_range){0, v.n_past};
            m = 1;
        }
        if (!decode) { /* the chunk always sees its own keys (causally) */
            if (m > 0 && ranges[m - 1].end >= s->n_past)
                ranges[m - 1].end = TKV_MAX(ranges[m - 1].end, s->n_past + n);
            else
                ranges[m++] = (struct tkv_range){s->n_past, s->n_past + n};
        }
        struct tkv_kv_block_ref *refs = s->sel_refs + (size_t)h * s->max_refs;
        const struct tkv_kv_head_view hv = s->hsplit ? tkv_kvs_host_view(s->kv, layer, h) : (struct tkv_kv_head_view){0};
        uint32_t nr = ranges_to_refs(&s->views[h], s->hsplit ? &hv : NULL, s->kv_block, ranges, (uint32_t)m,
                                     s->hp.head_dim, refs, s->max_refs, s->ref_host);
        restricted = true;
        if (decode && !whole)
            account_read(s, h, refs, nr, v.n_past, all_in);
        if (s->hsplit) { /* the device's slices stay in refs, the host's go to hrefs (both in order) */
            struct tkv_kv_block_ref *hrefs = s->hrefs + (size_t)h * s->max_refs;
            uint32_t nd = 0, nh = 0;
            for (uint32_t j = 0; j < nr; j++) {
                if (s->ref_host[j])
                    hrefs[nh++] = refs[j];
                else
                    refs[nd++] = refs[j];
            }
            nr = nd;
            s->hviews[h] = (struct tkv_kv_head_view){.blocks = hrefs, .n_blocks = nh};
        }
        s->views[h] = (struct tkv_kv_head_view){.blocks = refs, .n_blocks = nr};
    }
    return restricted;
}

/* Decode with a policy that can answer without keys: asks it which keys each
 * head reads (plan[h] ranges, or -1 for all) and marks the blocks they touch
 * in s->need, so the store recalls only those. False: bring in everything. */
static bool plan_decode(tkv_session *s, uint32_t layer, int *plan)
{
    const struct tkv_policy_ops *po = s->policy->ops;
    if (!s->in_decode || !po->decode_select || (s->flags & TKV_SESSION_MEASURE_MASS))
        return false;
    const struct tkv_policy_view v = policy_view(s, layer, 1, NULL);
    if (po->decode_needs_keys && po->decode_needs_keys(s->policy->state, &v))
        return false;
    const uint32_t MB = tkv_kvs_max_blocks(s->kv), B = s->kv_block, nb = (s->n_past + 1 + B - 1) / B;
    memset(s->need, 0, (size_t)s->hp.n_head_kv * MB);
    const double t0 = phase_edge(s);
    for (uint32_t h = 0; h < s->hp.n_head_kv; h++) {
        struct tkv_range *r = s->plan_ranges + (size_t)h * s->max_ranges;
        plan[h] = po->decode_select(s->policy->state, &v, h, r, s->max_ranges - 1);
        uint8_t *need = s->need + (size_t)h * MB;
        if (plan[h] < 0)
            memset(need, 1, nb);
        else
            for (int i = 0; i < plan[h]; i++)
                for (uint32_t b = r[i].begin / B; b < nb && b * B < r[i].end; b++)
                    need[b] = 1;
    }
    s->ph_select += phase_edge(s) - t0;
    return true;
}

/* Whether block b of (layer, head), needed at this decode step, would be
 * read on the host tier by the CPU: its current copy is there, and it is
 * not the block this step writes. */
static bool host_readable(const tkv_session *s, uint32_t layer, uint32_t head, uint32_t b)
{
    return b != s->n_past / s->kv_block && tkv_kvs_block_tier(s->kv, layer, head, b) == TKV_TIER_HOST;
}

/* The heterogeneous choice for KV head `head` of `layer`, whose host-tier
 * blocks (blocks, holding `tokens` selected tokens) are needed: true, the
 * CPU attends them where they are -- always, never, or as auto's cost model
 * and its observations of the head so far say (tkv_hetero_choose), as
 * s->hetero says; auto with measured rates, as the arm of the step says
 * (s->arms: the model, or every head one way). */
static bool hetero_to_cpu(tkv_session *s, uint32_t layer, uint32_t head, uint64_t blocks, uint64_t tokens)
{
    if (s->hetero != TKV_HETERO_AUTO)
        return s->hetero == TKV_HETERO_CPU;
    if (s->het_observe && s->arms.arm != TKV_HETERO_ARM_MODEL)
        return s->arms.arm == TKV_HETERO_ARM_CPU;
    const double link = s->het_observe ? tkv_hetero_rate_get(&s->link_seen, s->link_bps) : s->link_bps;
    const double cpu = s->het_observe ? tkv_hetero_rate_get(&s->cpu_seen, s->cpu_flops) : s->cpu_flops;
    double cpu_s, recall_s;
    tkv_hetero_costs(blocks, tokens, tkv_kvs_block_bytes(s->kv), s->hp.n_head / s->hp.n_head_kv, s->hp.head_dim, link,
                     cpu, s->crc_bps, &cpu_s, &recall_s);
    return tkv_hetero_choose(&s->het_heads[(size_t)layer * s->hp.n_head_kv + head], cpu_s, recall_s);
}

/* Heterogeneous decode, after plan_decode: per KV head, the planned blocks
 * whose current copy is in the host tier (not the compute tier; never the
 * block this step writes) are either recalled or left there for the CPU
 * (s->host_ok), as s->hetero says: always, never, or by the cost model on
 * the head's count of such blocks and of the tokens it selects in them.
 * Counts the choices; false: nothing is to stay on the host. */
static bool hetero_plan(tkv_session *s, uint32_t layer, const int *plan)
{
    if (!s->be_cpu)
        return false;
    const uint32_t MB = tkv_kvs_max_blocks(s->kv), B = s->kv_block, ctx = s->n_past + 1, nb = (ctx + B - 1) / B;
    bool any = false;
    for (uint32_t h = 0; h < s->hp.n_head_kv; h++) {
        const uint8_t *need = s->need + (size_t)h * MB;
        uint8_t *ok = s->host_ok + (size_t)h * MB;
        const struct tkv_range *r = s->plan_ranges + (size_t)h * s->max_ranges;
        const uint32_t m = plan[h] < 0 ? 0 : (uint32_t)plan[h];
        uint64_t blocks = 0, tokens = 0;
        uint32_t ri = 0; /* the first range that may reach block b (ranges ascend) */
        memset(ok, 0, nb);
        for (uint32_t b = 0; b < nb; b++) {
            if (!need[b] || !host_readable(s, layer, h, b))
                continue;
            const uint32_t lo = b * B, hi = TKV_MIN(lo + B, ctx);
            uint32_t t = 0;
            if (plan[h] < 0) {
                t = hi - lo;
            } else {
                while (ri < m && r[ri].end <= lo)
                    ri++;
                for (uint32_t j = ri; j < m && r[j].begin < hi; j++)
                    t += TKV_MIN(hi, r[j].end) - TKV_MAX(lo, r[j].begin);
            }
            ok[b] = 1;
            blocks++;
            tokens += t;
        }
        if (blocks == 0)
            continue;
        if (hetero_to_cpu(s, layer, h, blocks, tokens)) {
            s->het_cpu_heads++;
            s->het_cpu_blocks += blocks;
            s->het_cpu_tokens += tokens;
            any = true;
        } else {
            memset(ok, 0, nb);
            s->het_recall_heads++;
            s->het_recall_blocks += blocks;
        }
    }
    return any;
}

/* How the observation window moves with an n-token prefill chunk: the rows
 * of it that stay (the newest ones) and the chunk's rows that enter. */
static void obs_shift(const tkv_session *s, uint32_t n, uint32_t *keep_old, uint32_t *take)
{
    *keep_old = n >= OBS_QUERIES ? 0 : TKV_MIN(s->obs_n, OBS_QUERIES - n);
    *take = TKV_MIN(n, OBS_QUERIES);
}

/* Keeps the last OBS_QUERIES prefill queries of `layer` (the window that
 * after-prefill policies observe); s->obs_n is updated after the chunk.
 * A chunk that ends OBS_QUERIES or more before the end of this prefill
 * holds none of the window's queries: the chunks after it replace every
 * row it would enter, so it is not brought down (on a GPU each download
 * is a wait for the stream, once per layer and chunk). */
static void observe_queries(tkv_session *s, uint32_t layer, uint32_t n)
{
    if (s->n_past + n + OBS_QUERIES <= s->prefill_end)
        return;
    const size_t QD = (size_t)s->hp.n_head * s->hp.head_dim;
    float *buf = s->obs_q + (size_t)layer * OBS_QUERIES * QD;
    uint32_t keep_old, take;
    obs_shift(s, n, &keep_old, &take);
    memmove(buf, buf + (size_t)(s->obs_n - keep_old) * QD, (size_t)keep_old * QD * sizeof(float));
    s->be->ops->download(s->be, buf + (size_t)keep_old * QD, s->q + (size_t)(n - take) * QD, (size_t)take * QD * sizeof(float));
}

static tkv_status layer_attention(tkv_session *s, uint32_t l, uint32_t n, const int *plan);

static tkv_status hetero_attention(tkv_session *s, const struct tkv_attn_args *a);

/* Layer l's host copy of its decode table's counts ([Hkv][4]). */
static uint32_t *layer_hcounts(const tkv_session *s, uint32_t l)
{
    return s->dt_hcounts + (size_t)l * s->hp.n_head_kv * 4;
}

/* Layer l's sel_n ([Hkv]) as the policy's decode_bitmap gave it this step:
 * kept per layer until its counts come down (table_read). */
static uint32_t *layer_sel_n(const tkv_session *s, uint32_t l)
{
    return s->dt_sel_n + (size_t)l * s->hp.n_head_kv;
}

/* Layer l's rows ([Hkv][mark_words]) of a read-marks array laid out as
 * dt_marks ([layer][Hkv][mark_words]). */
static uint32_t *layer_marks(const tkv_session *s, uint32_t *marks, uint32_t l)
{
    return marks + (size_t)l * s->hp.n_head_kv * tkv_kvs_mark_words(s->kv);
}

/* Layer l's decode table from the policy's selection (bitmap, words; NULL
 * when no head selects) and the store's page table, its counts brought
 * down into layer_hcounts -- unless `mapped` is given and the page table
 * maps every block of the layer (tkv_kvs_layer_mapped): then nothing can be
 * missing nor any list overflow (max_refs bounds the slices of any
 * selection), *mapped is set, and the counts stay on the backend, the host
 * not waiting for them. */
static tkv_status table_build(tkv_session *s, uint32_t l, uint32_t n_past, const uint32_t *bitmap, uint32_t words,
                              bool *mapped)
{
    const uint32_t Hkv = s->hp.n_head_kv;
    TKV_TRY(tkv_kvs_page_table_sync(s->kv, l, NULL));
    uint32_t *counts = s->dt_counts + (size_t)l * Hkv * 4;
    const struct tkv_kv_table_args a = {.bitmap = bitmap, .words = words, .sel_n = layer_sel_n(s, l),
                                        .ptab = tkv_kvs_page_table(s->kv, l), .ptab_stride = tkv_kvs_max_blocks(s->kv),
                                        .n_heads = Hkv, .block_tokens = s->kv_block, .head_dim = s->hp.head_dim,
                                        .n_past = n_past, .refs = s->dt_refs, .miss = s->dt_miss, .cap = s->max_refs,
                                        .counts = counts, .marks = layer_marks(s, s->dt_marks, l),
                                        .mark_words = tkv_kvs_mark_words(s->kv)};
    const double t0 = phase_edge(s);
    tkv_status st = s->be->ops->kv_table(s->be, &a);
    if (st != TKV_OK)
        return tkv_err_wrap(st, "device table: layer %u", l);
    s->dt_marked[l] = s->dt_marks_due = true;
    if (mapped)
        *mapped = tkv_kvs_layer_mapped(s->kv, l);
    if (!mapped || !*mapped)
        st = s->be->ops->download(s->be, layer_hcounts(s, l), counts, (size_t)Hkv * 4 * sizeof *s->dt_hcounts);
    s->ph_select += phase_edge(s) - t0;
    return st;
}

/* Tells the policy what layer l's decode table read at this step (its
 * sel_n, counts c, the table's n_past): decode_table_read, where it has one. */
static void table_read(tkv_session *s, uint32_t l, uint32_t n_past, const uint32_t *c)
{
    const struct tkv_policy_ops *po = s->policy->ops;
    if (po->decode_table_read)
        po->decode_table_read(s->policy->state, l, s->step, n_past, layer_sel_n(s, l), c);
}

/* At the end of a decode step, in one copy: the counts of the layers
 * whose counts stayed on the backend (s->dt_defer), accounted as reads of a
 * context of n_past tokens and told to the policy; and the read marks of
 * the layers whose table was built (s->dt_marked), handed to the KV store
 * (tkv_kvs_mark_reads: the blocks the device read in place are in use,
 * not stale). */
static tkv_status table_flush(tkv_session *s, uint32_t n_past)
{
    if (!s->dt_n_defer && !s->dt_marks_due)
        return TKV_OK;
    const uint32_t L = s->hp.n_layer, Hkv = s->hp.n_head_kv;
    const size_t counts = (size_t)L * Hkv * 4 * sizeof *s->dt_hcounts;
    const size_t marks = s->dt_marks_due ? (size_t)L * Hkv * tkv_kvs_mark_words(s->kv) * sizeof *s->dt_hmarks : 0;
    /* (failed: the flags stay, and the next forward clears them) */
    TKV_TRY(s->be->ops->download(s->be, s->dt_hcounts, s->dt_counts, counts + marks));
    for (uint32_t l = 0; l < L && s->dt_marks_due; l++)
        if (s->dt_marked[l]) {
            TKV_TRY(tkv_kvs_mark_reads(s->kv, l, layer_marks(s, s->dt_hmarks, l)));
            s->dt_marked[l] = false;
        }
    s->dt_marks_due = false;
    for (uint32_t l = 0; l < L && s->dt_n_defer; l++) {
        if (!s->dt_defer[l])
            continue;
        const uint32_t *c = layer_hcounts(s, l);
        for (uint32_t h = 0; h < Hkv; h++)
            account_counts(s, h, c[4 * h + 2], c[4 * h + 3], n_past, false);
        table_read(s, l, n_past, c);
        s->dt_defer[l] = false;
    }
    s->dt_n_defer = 0;
    return TKV_OK;
}

/* Every head's missing slices of the last table, head h's into row h of
 * s->dt_hmiss ([Hkv][max_refs]; layer l's counts checked against max_refs by the
 * caller): one batch and one wait where the backend has download_blocks
 * (each row copied up to the longest list), else a download per head. */
static tkv_status table_misses(tkv_session *s, uint32_t l)
{
    const uint32_t Hkv = s->hp.n_head_kv, cap = s->max_refs, *c = layer_hcounts(s, l);
    void *dst[256];
    const void *src[256];
    uint32_t nm[256], n = 0, most = 0;
    for (uint32_t h = 0; h < Hkv; h++) {
        if (!(nm[n] = c[4 * h + 1]))
            continue;
        most = TKV_MAX(most, nm[n]);
        dst[n] = s->dt_hmiss + (size_t)h * cap, src[n++] = s->dt_miss + (size_t)h * cap;
    }
    if (n > 1 && s->be->ops->download_blocks)
        return s->be->ops->download_blocks(s->be, dst, src, n, most * sizeof *s->dt_hmiss);
    for (uint32_t j = 0; j < n; j++)
        TKV_TRY(s->be->ops->download(s->be, dst[j], src[j], nm[j] * sizeof *s->dt_hmiss));
    return TKV_OK;
}

/* After a table with missing slices: per KV head the missing blocks are
 * recalled or -- the heterogeneous split, decided as hetero_plan decides --
 * left on the host tier for the CPU; the layer is begun again with them
 * (s->need: the written block and every missing one; s->host_ok: the CPU's)
 * and its table rebuilt. *ok: the rebuilt table misses only what the CPU
 * reads where it is; s->hviews then holds those slices (host pointers) and
 * s->hsplit says whether there are any. *ok false: a recall evicted a
 * selected block, or a list did not fit -- the caller takes the host path.
 * *begun false: the layer could not be begun again (the error returned). */
static tkv_status table_bring(tkv_session *s, uint32_t l, uint32_t n, uint32_t n_past, const uint32_t *bitmap,
                              uint32_t words, bool *ok, bool *begun)
{
    *ok = false, *begun = true;
    const uint32_t Hkv = s->hp.n_head_kv, cap = s->max_refs, MB = tkv_kvs_max_blocks(s->kv), B = s->kv_block;
    const uint32_t hd = s->hp.head_dim, *c = layer_hcounts(s, l);
    bool cpu_head[256], any_cpu = false;
    uint64_t cpu_heads = 0, cpu_blocks = 0, cpu_tokens = 0, recall_heads = 0, recall_blocks = 0; /* if *ok */
    TKV_TRY(table_misses(s, l));
    for (uint32_t h = 0; h < Hkv; h++) {
        const uint32_t nm = c[4 * h + 1];
        const struct tkv_kv_block_ref *miss = s->dt_hmiss + (size_t)h * cap;
        uint8_t *need = s->need + (size_t)h * MB, *host_ok = s->host_ok ? s->host_ok + (size_t)h * MB : NULL;
        cpu_head[h] = false;
        if (host_ok)
            memset(host_ok, 0, MB);
        if (!nm)
            continue;
        uint64_t blocks = 0, tokens = 0; /* on the host tier: what the CPU would read (marked in host_ok) */
        uint32_t last = UINT32_MAX;
        for (uint32_t j = 0; j < nm; j++) {
            const uint32_t b = (uint32_t)miss[j].pos0 / B;
            need[b] = 1;
            if (!host_ok || !host_readable(s, l, h, b))
                continue;
            host_ok[b] = 1;
            tokens += miss[j].n;
            blocks += b != last;
            last = b;
        }
        if (blocks && hetero_to_cpu(s, l, h, blocks, tokens)) {
            cpu_head[h] = any_cpu = true;
            cpu_heads++, cpu_blocks += blocks, cpu_tokens += tokens;
        } else if (blocks) { /* recalled: the marks go */
            for (uint32_t j = 0; j < nm; j++)
                host_ok[(uint32_t)miss[j].pos0 / B] = 0;
            recall_heads++, recall_blocks += blocks;
        }
    }
    tkv_kvs_end_layer(s->kv, l);
    uint32_t n_host = 0;
    tkv_status st = tkv_kvs_begin_layer_split(s->kv, l, s->n_past, n, s->need, any_cpu ? s->host_ok : NULL, &n_host);
    if (st != TKV_OK) {
        *begun = false;
        return st;
    }
    TKV_TRY(table_build(s, l, n_past, bitmap, words, NULL));
    for (uint32_t h = 0; h < Hkv; h++) {
        const uint32_t nr = c[4 * h], nm = c[4 * h + 1];
        if (nr > cap || nm > cap || (nm && !cpu_head[h]))
            return TKV_OK; /* not *ok */
    }
    TKV_TRY(table_misses(s, l));
    bool split = false;
    for (uint32_t h = 0; h < Hkv; h++) {
        const uint32_t nm = c[4 * h + 1];
        const struct tkv_kv_block_ref *miss = s->dt_hmiss + (size_t)h * cap;
        if (s->hviews)
            s->hviews[h] = (struct tkv_kv_head_view){.blocks = s->hrefs + (size_t)h * cap, .n_blocks = nm};
        if (!nm)
            continue;
        const struct tkv_kv_head_view hv = tkv_kvs_host_view(s->kv, l, h);
        struct tkv_kv_block_ref *out = s->hrefs + (size_t)h * cap;
        for (uint32_t j = 0; j < nm; j++) { /* the slice where the CPU reads it */
            const uint32_t b = (uint32_t)miss[j].pos0 / B;
            const struct tkv_kv_block_ref *blk = b < hv.n_blocks ? &hv.blocks[b] : NULL;
            if (!blk || !blk->k)
                return TKV_OK; /* not *ok */
            const size_t off = (size_t)(miss[j].pos0 - blk->pos0) * hd;
            out[j] = (struct tkv_kv_block_ref){.k = blk->k + off, .v = blk->v + off, .pos0 = miss[j].pos0,
                                               .n = miss[j].n};
        }
        split = true;
    }
    s->hsplit = split;
    *ok = true;
    s->het_cpu_heads += cpu_heads, s->het_cpu_blocks += cpu_blocks, s->het_cpu_tokens += cpu_tokens;
    s->het_recall_heads += recall_heads, s->het_recall_blocks += recall_blocks;
    return TKV_OK;
}

/* A decode layer from the device table (s->dev_table; docs/rabitq.md,
 * "Decode from the device table"): the policy selects on the device
 * (decode_bitmap: nothing comes down), the store brings in only the block
 * this step writes, kv_table turns the selection and the store's page table
 * into per-head lists of resident and missing slices, and one download of
 * their counts tells whether every selected block is resident -- unless
 * the store maps every block of the layer: then the attention reads the
 * counts where they are and the host goes on without waiting (the reads
 * accounted at the step's end, table_flush). Where a block is missing,
 * table_bring recalls it or leaves it to the CPU and rebuilds the table.
 * Then the attention reads the resident lists where they are (kv_dev), the
 * CPU's part merged with it (hetero_attention): no ranges, views or block
 * table built on the host. *done false: not applicable, or the missing
 * blocks could not be settled that way -- the layer is ended untouched but
 * for the step's K/V row, and the caller takes the host path with the same
 * selection (the policy keeps it for the step). */
static tkv_status table_layer(tkv_session *s, uint32_t l, uint32_t n, bool *done)
{
    *done = false;
    const struct tkv_policy_ops *po = s->policy->ops;
    const uint32_t Hkv = s->hp.n_head_kv, cap = s->max_refs;
    if (!s->dev_table || !s->in_decode || !po->decode_bitmap || (s->flags & TKV_SESSION_MEASURE_MASS) || Hkv > 256)
        return TKV_OK;
    const struct tkv_policy_view v = policy_view(s, l, n, NULL);
    if (po->decode_needs_keys && po->decode_needs_keys(s->policy->state, &v))
        return TKV_OK;
    const uint32_t *bitmap = NULL;
    uint32_t words = 0;
    const double t0 = phase_edge(s);
    const bool on_dev = po->decode_bitmap(s->policy->state, &v, &bitmap, &words, layer_sel_n(s, l));
    s->ph_select += phase_edge(s) - t0;
    if (!on_dev)
        return TKV_OK;
    /* the store: only the block this step writes (the rest is what it is) */
    const uint32_t MB = tkv_kvs_max_blocks(s->kv), written = s->n_past / s->kv_block;
    memset(s->need, 0, (size_t)Hkv * MB);
    for (uint32_t h = 0; h < Hkv; h++)
        s->need[(size_t)h * MB + written] = 1;
    uint32_t n_host = 0;
    TKV_TRY(tkv_kvs_begin_layer_split(s->kv, l, s->n_past, n, s->need, NULL, &n_host));
    tkv_status st = store_kv(s, l, n);
    bool mapped = false;
    if (st == TKV_OK)
        st = table_build(s, l, v.n_past, bitmap, words, &mapped);
    const uint32_t *c = layer_hcounts(s, l);
    if (st == TKV_OK && !mapped) /* (mapped: the counts come down at the step's end) */
        table_read(s, l, v.n_past, c);
    bool ok = st == TKV_OK, missing = false, begun = true;
    for (uint32_t h = 0; h < Hkv && ok && !mapped; h++) {
        ok = c[4 * h] <= cap && c[4 * h + 1] <= cap;
        missing |= c[4 * h + 1] > 0;
    }
    if (ok && missing)
        st = table_bring(s, l, n, v.n_past, bitmap, words, &ok, &begun);
    if (st == TKV_OK && ok) {
        /* mapped: the counts stay on the backend (the attention reads them
         * there), this layer's reads are accounted at the step's end */
        for (uint32_t h = 0; h < Hkv; h++) {
            s->views[h] = (struct tkv_kv_head_view){.blocks = s->dt_refs + (size_t)h * cap,
                                                    .n_blocks = mapped ? cap : c[4 * h]};
            if (!mapped)
                account_counts(s, h, c[4 * h + 2], c[4 * h + 3], v.n_past, false);
        }
        if (mapped) {
            s->dt_n_defer += !s->dt_defer[l];
            s->dt_defer[l] = true;
        }
        /* kv_table's counts, [Hkv][4] (backend.h): slices, misses, positions
         * read, blocks touched; the positions are the heads' keys */
        const uint32_t *dev_counts = mapped ? s->dt_counts + (size_t)l * Hkv * 4 : NULL;
        const struct tkv_attn_args att = {.q = s->q, .q_pos = s->pos, .out = s->att, .n_q = n,
                                          .n_head = s->hp.n_head, .n_head_kv = Hkv, .head_dim = s->hp.head_dim,
                                          .scale = 1.0f / sqrtf((float)s->hp.head_dim), .kv = s->views,
                                          .kv_dev = true,
                                          .kv_dev_n = dev_counts, .kv_dev_n_stride = 4,
                                          .kv_dev_keys = dev_counts ? dev_counts + 2 : NULL};
        if (s->hsplit) {
            st = hetero_attention(s, &att);
        } else {
            const double t1 = phase_edge(s);
            st = s->be->ops->attention(s->be, &att);
            s->ph_attn += phase_edge(s) - t1;
        }
        *done = st == TKV_OK;
        s->dt_layers++;
        s->dt_brought += missing;
    } else if (st == TKV_OK) {
        s->dt_fallbacks++;
    }
    s->hsplit = false;
    if (begun)
        tkv_kvs_end_layer(s->kv, l);
    return st;
}

/* A residual product of layer_forward: x += in . W^T, then with norm
 * s->h = rmsnorm(x) * norm. fuse: in one call with the backend's
 * matmul_add (then the norm), or the product into s->h and add_rmsnorm;
 * else (and as the reference) matmul into s->h, add, rmsnorm. */
static tkv_status residual_product(tkv_session *s, uint32_t n, bool fuse, const struct tkv_bweight *W, const float *in,
                                   const struct tkv_bweight *norm)
{
    const struct tkv_backend_ops *ops = s->be->ops;
    struct tkv_backend *be = s->be;
    const uint32_t E = s->hp.n_embd;
    const float eps = s->hp.rms_eps;
    if (fuse && ops->matmul_add) {
        TKV_TRY(ops->matmul_add(be, W, in, s->x, n));
    } else {
        TKV_TRY(ops->matmul(be, W, in, s->h, n));
        if (norm && fuse && ops->add_rmsnorm)
            return ops->add_rmsnorm(be, s->x, s->h, norm, s->h, n, E, eps);
        TKV_TRY(ops->add(be, s->x, s->h, (size_t)n * E));
    }
    return norm ? ops->rmsnorm(be, s->x, norm, s->h, n, E, eps) : TKV_OK;
}

/* layer_forward's attention input: s->q, s->k, s->v = s->h . w^T for wq,
 * wk, wv, then q and k rotated at s->pos. fuse: as one call with the
 * backend's matmul_qkv_rope, or its matmul_group and rope_qk where it has
 * them; else (and as the reference) three matmuls and two ropes. */
static tkv_status qkv_product(tkv_session *s, uint32_t n, bool fuse, const struct layer_weights *w)
{
    const struct tkv_backend_ops *ops = s->be->ops;
    struct tkv_backend *be = s->be;
    const struct tkv_model_info *hp = &s->hp;
    const uint32_t H = hp->n_head, Hkv = hp->n_head_kv, hd = hp->head_dim;
    const struct tkv_bweight *qkv[3] = {w->wq, w->wk, w->wv};
    float *out[3] = {s->q, s->k, s->v};
    if (fuse && ops->matmul_qkv_rope)
        return ops->matmul_qkv_rope(be, qkv, s->h, s->q, s->k, s->v, n, hd, hp->rope_dim, s->pos, hp->rope_base,
                                    hp->rope_scale);
    if (fuse && ops->matmul_group) {
        TKV_TRY(ops->matmul_group(be, qkv, 3, s->h, out, n));
    } else {
        for (int i = 0; i < 3; i++)
            TKV_TRY(ops->matmul(be, qkv[i], s->h, out[i], n));
    }
    if (fuse && ops->rope_qk)
        return ops->rope_qk(be, s->q, s->k, n, H, Hkv, hd, hp->rope_dim, s->pos, hp->rope_base, hp->rope_scale);
    TKV_TRY(ops->rope(be, s->q, n, H, hd, hp->rope_dim, s->pos, hp->rope_base, hp->rope_scale));
    return ops->rope(be, s->k, n, Hkv, hd, hp->rope_dim, s->pos, hp->rope_base, hp->rope_scale);
}

/* One transformer layer on the chunk in s->x: brings the layer's KV in (all
 * of it, or at decode what the policy selects), runs it, lets the KV go.
 * fuse: use the backend's fused ops where it has them (backend.h; the
 * plain sequence is their reference). *h_ready: on entry, s->h already
 * holds rmsnorm(x) * attn_norm (the previous layer's fused add made it);
 * next_norm (fuse only): the norm after this layer, whose output the final
 * residual product then leaves in s->h, setting *h_ready. */
static tkv_status layer_forward(tkv_session *s, uint32_t l, uint32_t n, bool fuse, const struct tkv_bweight *next_norm,
                                bool *h_ready)
{
    const struct tkv_backend_ops *ops = s->be->ops;
    struct tkv_backend *be = s->be;
    const struct tkv_model_info *hp = &s->hp;
    const uint32_t E = hp->n_embd, H = hp->n_head, Hkv = hp->n_head_kv, hd = hp->head_dim, F = hp->n_ff;
    const struct layer_weights *w = &s->layers[l];
    /* attention block */
    if (!*h_ready)
        TKV_TRY(ops->rmsnorm(be, s->x, w->attn_norm, s->h, n, E, hp->rms_eps));
    *h_ready = false;
    TKV_TRY(qkv_product(s, n, fuse, w));
    if (query_to_host(s)) /* the policy reads the query on the host */
        TKV_TRY(ops->download(be, s->q_step, s->q, (size_t)H * hd * sizeof(float)));
    bool done;
    TKV_TRY(table_layer(s, l, n, &done));
    if (!done) {
        int plan[256];
        const bool planned = Hkv <= 256 && plan_decode(s, l, plan);
        if (!planned) /* the next layer's recall overlaps this one's (and its settling) */
            tkv_kvs_prefetch(s->kv, l + 1);
        const bool split = planned && hetero_plan(s, l, plan);
        uint32_t n_host = 0;
        TKV_TRY(tkv_kvs_begin_layer_split(s->kv, l, s->n_past, n, planned ? s->need : NULL,
                                          split ? s->host_ok : NULL, &n_host));
        /* the next layer's selection of the step before, while this one
         * runs (after this layer's own recalls, which it would delay) */
        if (planned && !(s->flags & TKV_SESSION_NO_SELECTION_PREFETCH))
            tkv_kvs_prefetch_last(s->kv, l + 1);
        s->hsplit = n_host > 0;
        tkv_status st = layer_attention(s, l, n, planned ? plan : NULL);
        s->hsplit = false;
        tkv_kvs_end_layer(s->kv, l);
        TKV_TRY(st);
    }
    /* feed-forward block */
    TKV_TRY(residual_product(s, n, fuse, w->wo, s->att, w->ffn_norm));
    if (fuse && ops->matmul_swiglu) {
        TKV_TRY(ops->matmul_swiglu(be, w->w_gate, w->w_up, s->h, s->gate, n));
    } else {
        TKV_TRY(ops->matmul(be, w->w_gate, s->h, s->gate, n));
        TKV_TRY(ops->matmul(be, w->w_up, s->h, s->up, n));
        TKV_TRY(ops->swiglu(be, s->gate, s->up, s->gate, (size_t)n * F));
    }
    const struct tkv_bweight *norm = fuse ? next_norm : NULL;
    TKV_TRY(residual_product(s, n, fuse, w->w_down, s->gate, norm));
    *h_ready = norm != NULL;
    return TKV_OK;
}

/* A decode step's attention when some selected blocks stay on the host tier
 * (s->hsplit): the device attends the rest (s->views) with its log-sum-exp,
 * queued first so that the CPU's part over the host blocks (s->hviews, the
 * CPU backend, the query downloaded) runs meanwhile; then the device's
 * partial comes down, the two merge exactly (tkv_attn_merge) and the result
 * goes up into s->att. The round trip is H*(hd+1) floats down and H*hd up
 * per layer, one wait for the device: simpler than a device merge op, and
 * no more waiting than the selecting policies' own downloads. */
static tkv_status hetero_attention(tkv_session *s, const struct tkv_attn_args *a)
{
    const struct tkv_backend_ops *ops = s->be->ops;
    struct tkv_backend *be = s->be;
    const uint32_t H = a->n_head, hd = a->head_dim;
    if (!query_to_host(s)) /* else layer_forward brought it down already */
        TKV_TRY(ops->download(be, s->q_step, s->q, (size_t)H * hd * sizeof(float)));
    struct tkv_attn_args dev = *a;
    dev.lse = s->lse_dev;
    /* timed as device attention: the device's queueing, below the wait for
     * its partial and the merge; as CPU attention: the CPU's part (no
     * synchronization around it: the device's part runs meanwhile) */
    double t0 = phase_edge(s);
    TKV_TRY(ops->attention(be, &dev));
    double t1 = tkv_now_seconds();
    s->ph_attn += t1 - t0;
    struct tkv_attn_args cpu = *a;
    cpu.q = s->q_step;
    cpu.out = s->att_cpu;
    cpu.lse = s->lse_cpu;
    cpu.kv = s->hviews;
    cpu.kv_dev = false;
    TKV_TRY(s->be_cpu->ops->attention(s->be_cpu, &cpu));
    t0 = tkv_now_seconds();
    s->ph_cpu_attn += t0 - t1;
    TKV_TRY(ops->download(be, s->att_mrg, s->att, (size_t)H * hd * sizeof(float)));
    TKV_TRY(ops->download(be, s->lse_mrg, s->lse_dev, H * sizeof(float)));
    tkv_attn_merge(s->att_mrg, s->lse_mrg, s->att_cpu, s->lse_cpu, H, hd);
    tkv_status st = ops->upload(be, s->att, s->att_mrg, (size_t)H * hd * sizeof(float));
    s->ph_attn += phase_edge(s) - t0;
    return st;
}

/* The attention of layer l for the chunk (its KV brought in): K/V rows into
 * the blocks, the policy's selection, attention into s->att. */
static tkv_status layer_attention(tkv_session *s, uint32_t l, uint32_t n, const int *plan)
{
    const struct tkv_backend_ops *ops = s->be->ops;
    struct tkv_backend *be = s->be;
    const uint32_t H = s->hp.n_head, Hkv = s->hp.n_head_kv, hd = s->hp.head_dim;
    TKV_TRY(store_kv(s, l, n));
    const bool decode = s->in_decode;
    if (!decode)
        observe_queries(s, l, n);
    const bool restricted = select_views(s, l, n, plan);
    struct tkv_attn_args a = {.q = s->q, .q_pos = s->pos, .out = s->att, .lse = NULL, .n_q = n, .n_head = H,
                              .n_head_kv = Hkv, .head_dim = hd, .scale = 1.0f / sqrtf((float)hd), .kv = s->views};
    if (restricted && decode && (s->flags & TKV_SESSION_MEASURE_MASS)) {
        /* the mass the selection keeps: lse over the selection vs over all keys */
        struct tkv_attn_args full = a;
        struct tkv_kv_head_view all[256];
        for (uint32_t h = 0; h < Hkv && h < 256; h++)
            all[h] = tkv_kvs_view(s->kv, l, h);
        full.kv = all;
        full.out = s->att_full;
        full.lse = s->lse_full;
        a.lse = s->lse_sel;
        TKV_TRY(ops->attention(be, &full));
    }
    if (s->hsplit)
        return hetero_attention(s, &a);
    const double t0 = decode ? phase_edge(s) : 0;
    TKV_TRY(ops->attention(be, &a));
    if (decode)
        s->ph_attn += phase_edge(s) - t0;
    if (a.lse) {
        float lf[256], ls[256];
        TKV_TRY(ops->download(be, lf, s->lse_full, H * sizeof(float)));
        TKV_TRY(ops->download(be, ls, s->lse_sel, H * sizeof(float)));
        for (uint32_t h = 0; h < H && h < 256; h++)
            s->mass_sum += ls[h] == -INFINITY ? 0.0 : exp((double)ls[h] - lf[h]);
        s->mass_count += TKV_MIN(H, 256u);
    }
    return TKV_OK;
}

/* With TKV_TRACE: one record per layer and chunk -- uint32 layer, n_past,
 * n, n_embd, then the residual stream x [n, n_embd] (f32) after the layer,
 * in host byte order. Costs a download and a wait per layer. */
static tkv_status trace_layer(tkv_session *s, uint32_t l, uint32_t n)
{
    const uint32_t E = s->hp.n_embd, head[4] = {l, s->n_past, n, E};
    TKV_TRY(s->be->ops->download(s->be, s->trace_buf, s->x, (size_t)n * E * sizeof(float)));
    if (fwrite(head, sizeof head, 1, s->trace) != 1 || fwrite(s->trace_buf, sizeof(float) * E, n, s->trace) != n)
        return tkv_err(TKV_ERR_IO, "session: writing the trace: %s", strerror(errno));
    return TKV_OK;
}

static tkv_status forward(tkv_session *s, const tkv_token *toks, uint32_t n, bool want_logits)
{
    const struct tkv_backend_ops *ops = s->be->ops;
    struct tkv_backend *be = s->be;
    const struct tkv_model_info *hp = &s->hp;
    const uint32_t E = hp->n_embd;

    for (uint32_t i = 0; i < n; i++)
        s->pos[i] = (int32_t)(s->n_past + i);
    TKV_TRY(ops->get_rows(be, s->tok_embd, toks, n, s->x));

    if (s->dt_n_defer || s->dt_marks_due) { /* left by a step that failed */
        memset(s->dt_defer, 0, hp->n_layer * sizeof *s->dt_defer);
        memset(s->dt_marked, 0, hp->n_layer * sizeof *s->dt_marked);
        s->dt_n_defer = 0;
        s->dt_marks_due = false;
    }
    const bool fuse = s->fuse;
    /* a layer's last add leaves the next norm's output in s->h: the next
     * layer's attn_norm, after the last layer the output norm (one row) */
    bool h_ready = false;
    for (uint32_t l = 0; l < hp->n_layer; l++) {
        const struct tkv_bweight *next = l + 1 < hp->n_layer ? s->layers[l + 1].attn_norm
                                         : want_logits && n == 1 ? s->output_norm
                                                                 : NULL;
        TKV_TRY(layer_forward(s, l, n, fuse, next, &h_ready));
        if (s->trace)
            TKV_TRY(trace_layer(s, l, n));
    }

    if (want_logits) {
        if (!h_ready)
            TKV_TRY(ops->rmsnorm(be, s->x + (size_t)(n - 1) * E, s->output_norm, s->h, 1, E, hp->rms_eps));
        TKV_TRY(ops->matmul(be, s->output, s->h, s->logits_dev, 1));
        TKV_TRY(ops->download(be, s->logits, s->logits_dev, (size_t)hp->n_vocab * sizeof(float)));
    }
    return table_flush(s, s->n_past + n); /* (the policy view's n_past) */
}

/* Runs one chunk: reserves KV, marks it valid, and rolls back on failure. */
static tkv_status run_chunk(tkv_session *s, const tkv_token *toks, uint32_t n, bool want_logits)
{
    for (uint32_t i = 0; i < n; i++)
        if (toks[i] < 0 || (uint32_t)toks[i] >= s->hp.n_vocab)
            return tkv_err(TKV_ERR_INVALID_ARG, "token %d at position %u is outside the vocabulary [0, %u)", toks[i],
                           s->n_past + i, s->hp.n_vocab);
    const uint32_t end = s->n_past + n;
    TKV_TRY(tkv_kvs_reserve(s->kv, TKV_MIN(s->n_ctx, n == 1 ? end + DECODE_RESERVE_AHEAD : end)));
    tkv_kvs_set_length(s->kv, end);
    s->have_logits = false;
    tkv_status st = forward(s, toks, n, want_logits);
    if (st != TKV_OK) {
        tkv_kvs_set_length(s->kv, s->n_past);
        return st;
    }
    memcpy(s->tokens + s->n_past, toks, (size_t)n * sizeof *toks);
    const bool decode = s->in_decode;
    if (!decode) { /* the observation window moved with this chunk */
        uint32_t keep_old, take;
        obs_shift(s, n, &keep_old, &take);
        memmove(s->obs_pos, s->obs_pos + (s->obs_n - keep_old), keep_old * sizeof *s->obs_pos);
        for (uint32_t i = 0; i < take; i++)
            s->obs_pos[keep_old + i] = (int32_t)(end - take + i);
        s->obs_n = keep_old + take;
    }
    s->n_past = end;
    s->have_logits = want_logits;
    return TKV_OK;
}

tkv_status tkv_prefill(tkv_session *s, const tkv_token *toks, size_t n)
{
    if (!s || (n && !toks))
        return tkv_err(TKV_ERR_INVALID_ARG, "tkv_prefill: NULL argument");
    if (n == 0)
        return TKV_OK;
    if (n > s->n_ctx - s->n_past)
        return tkv_err(TKV_ERR_CONTEXT_FULL, "prefill of %zu tokens does not fit: %u of %u context tokens in use", n,
                       s->n_past, s->n_ctx);
    /* reserve the whole prompt up front: one explicit allocation step */
    TKV_TRY(tkv_kvs_reserve(s->kv, s->n_past + (uint32_t)n));
    s->prefill_end = s->n_past + (uint32_t)n;
    const double t0 = tkv_now_seconds();
    size_t done = 0;
    tkv_status st = TKV_OK;
    while (done < n) {
        const uint32_t c = (uint32_t)TKV_MIN((size_t)s->chunk, n - done);
        st = run_chunk(s, toks + done, c, done + c == n);
        if (st != TKV_OK)
            break;
        done += c;
        s->prefill_chunks++;
        if (s->progress && s->progress(done, n, s->progress_user) && done < n) {
            st = tkv_err(TKV_ERR_CANCELLED, "prefill cancelled after %zu of %zu tokens", done, n);
            break;
        }
    }
    s->n_prompt = s->n_past;
    s->step = 0;
    if (st == TKV_OK && s->policy->ops->after_prefill)
        st = tkv_session_after_prefill(s, s);
    if (st == TKV_OK) /* the decode's evictions then drop the prompt's blocks for free */
        st = tkv_kvs_write_back(s->kv, NULL);
    s->prefill_tokens += done;
    s->prefill_seconds += tkv_now_seconds() - t0;
    return st;
}

tkv_status tkv_session_after_prefill(tkv_session *s, const tkv_session *src)
{
    s->n_prompt = s->n_past;
    s->step = 0;
    if (!s->policy->ops->after_prefill || src->obs_n == 0)
        return TKV_OK;
    const size_t QD = (size_t)s->hp.n_head * s->hp.head_dim;
    for (uint32_t l = 0; l < s->hp.n_layer; l++) {
        TKV_TRY(tkv_kvs_begin_layer(s->kv, l, 0, 0));
        for (uint32_t h = 0; h < s->hp.n_head_kv; h++)
            s->views[h] = tkv_kvs_view(s->kv, l, h);
        struct tkv_policy_view v = {.layer = l, .n_past = s->n_past, .n_prompt = s->n_prompt, .step = 0,
                                    .q = src->obs_q + (size_t)l * OBS_QUERIES * QD, .q_host = true,
                                    .q_pos = src->obs_pos, .n_q = src->obs_n, .kv = s->views, .be = s->be,
                                    .kv_host = s->be_host};
        tkv_status st = s->policy->ops->after_prefill(s->policy->state, &v);
        tkv_kvs_end_layer(s->kv, l);
        if (st != TKV_OK)
            return tkv_err_wrap(st, "policy '%s' after the prefill, layer %u", s->policy->ops->name, l);
    }
    return TKV_OK;
}

/* What auto's rate observations difference over a decode step: the
 * tokens the step attended on the CPU (as the cost model counts them) and
 * the CPU attention's time; the blocks recalled and the stall spent
 * bringing them in (settle, evict, upload, NVMe reads; not the CPU path's
 * checksums nor the page-table passes that both paths pay). */
struct het_mark {
    uint64_t cpu_tokens, recalled;
    double cpu_s, recall_s;
};

static struct het_mark het_mark_now(const tkv_session *s)
{
    struct tkv_kvs_stats ks;
    tkv_kvs_get_stats(s->kv, &ks);
    const struct tkv_kvs_stall *t = &ks.stall;
    return (struct het_mark){.cpu_tokens = s->het_cpu_tokens, .recalled = t->recalled_blocks,
                             .cpu_s = s->ph_cpu_attn,
                             .recall_s = t->settle_s + t->evict_s + t->upload_issue_s + t->upload_wait_s + t->nvme_s};
}

/* One observation of each rate auto prices with (s->cpu_seen, s->link_seen)
 * over the decode step since m0; a path whose work that step was too little
 * to measure its throughput is not observed (tkv_hetero_rate_observe). */
static void observe_rates(tkv_session *s, const struct het_mark *m0)
{
    const struct het_mark m = het_mark_now(s);
    const double group = s->hp.n_head / s->hp.n_head_kv;
    tkv_hetero_rate_observe(&s->cpu_seen, (double)(m.cpu_tokens - m0->cpu_tokens) * group * s->hp.head_dim * 4.0,
                            m.cpu_s - m0->cpu_s, s->cpu_flops, s->het_observe_min_s);
    tkv_hetero_rate_observe(&s->link_seen, (double)(m.recalled - m0->recalled) * tkv_kvs_block_bytes(s->kv),
                            m.recall_s - m0->recall_s, s->link_bps, s->het_observe_min_s);
}

/* auto with measured rates, after a decode step of dt seconds: the step's
 * rate observations, then the arm of the next step; a return to the model
 * starts its heads afresh (their last choice was not theirs). */
static void next_arm(tkv_session *s, const struct het_mark *m0, double dt)
{
    observe_rates(s, m0);
    const enum tkv_hetero_arm was = s->arms.arm;
    if (tkv_hetero_arm_next(&s->arms, dt) == TKV_HETERO_ARM_MODEL && was != TKV_HETERO_ARM_MODEL)
        for (size_t i = 0; i < (size_t)s->hp.n_layer * s->hp.n_head_kv; i++)
            s->het_heads[i].last = 0;
}

tkv_status tkv_decode(tkv_session *s, tkv_token tok)
{
    if (!s)
        return tkv_err(TKV_ERR_INVALID_ARG, "tkv_decode: session is NULL");
    if (s->n_past >= s->n_ctx)
        return tkv_err(TKV_ERR_CONTEXT_FULL, "decode: the context of %u tokens is full", s->n_ctx);
    const double t0 = tkv_now_seconds();
    const struct het_mark m0 = s->het_observe ? het_mark_now(s) : (struct het_mark){0};
    s->in_decode = true;
    tkv_status st = run_chunk(s, &tok, 1, true);
    s->in_decode = false;
    if (st == TKV_OK) {
        s->step++;
        s->decode_tokens++;
        const double dt = tkv_now_seconds() - t0;
        s->decode_seconds += dt;
        if (s->het_observe)
            next_arm(s, &m0, dt);
    }
    return st;
}

const float *tkv_logits(const tkv_session *s) { return s && s->have_logits ? s->logits : NULL; }

size_t tkv_session_n_past(const tkv_session *s) { return s ? s->n_past : 0; }

const tkv_token *tkv_session_tokens(const tkv_session *s) { return s ? s->tokens : NULL; }

void tkv_session_reset(tkv_session *s)
{
    if (!s)
        return;
    s->n_past = 0;
    s->n_prompt = 0;
    s->step = 0;
    s->obs_n = 0;
    s->have_logits = false;
    tkv_kvs_set_length(s->kv, 0);
    if (s->policy->ops->reset)
        s->policy->ops->reset(s->policy->state);
}

double tkv_session_mass_kept(const tkv_session *s)
{
    return s && s->mass_count ? s->mass_sum / (double)s->mass_count : 1.0;
}

void tkv_session_kv_read(const tkv_session *s, double *tokens, double *blocks)
{
    const bool any = s && s->read_count;
    if (tokens)
        *tokens = any ? s->read_tokens / (double)s->read_count : 1.0;
    if (blocks)
        *blocks = any ? s->read_blocks / (double)s->read_count : 1.0;
}

tkv_status tkv_session_stats_json(const tkv_session *s, char *buf, size_t cap, size_t *len_out)
{
    if (!s || !len_out || (cap && !buf))
        return tkv_err(TKV_ERR_INVALID_ARG, "tkv_session_stats_json: NULL argument");
    struct tkv_kvs_stats ks;
    tkv_kvs_get_stats(s->kv, &ks);
    char tmp[4096];
    size_t n = 0;
#define OUT(...) (n += (size_t)snprintf(tmp + n, n < sizeof tmp ? sizeof tmp - n : 0, __VA_ARGS__))
    OUT("{\"device\": \"%s\", \"policy\": \"%s\", \"n_ctx\": %u, \"n_past\": %u,\n", s->be->ops->name,
        s->policy_spec, s->n_ctx, s->n_past);
    OUT(" \"prefill\": {\"tokens\": %llu, \"seconds\": %.6f, \"tok_s\": %.3f},\n", (unsigned long long)s->prefill_tokens,
        s->prefill_seconds, s->prefill_seconds > 0 ? s->prefill_tokens / s->prefill_seconds : 0.0);
    OUT(" \"decode\": {\"tokens\": %llu, \"seconds\": %.6f, \"tok_s\": %.3f},\n", (unsigned long long)s->decode_tokens,
        s->decode_seconds, s->decode_seconds > 0 ? s->decode_tokens / s->decode_seconds : 0.0);
    double read_tok, read_blk;
    tkv_session_kv_read(s, &read_tok, &read_blk);
    const struct tkv_policy_ops *po = s->policy->ops;
    OUT(" \"selection\": {\"read_tokens\": %.6f, \"read_blocks\": %.6f, \"policy_bytes\": %llu},\n", read_tok,
        read_blk, (unsigned long long)(po->memory_bytes ? po->memory_bytes(s->policy->state) : 0));
    OUT(" \"kv\": {\"block_tokens\": %u, \"block_bytes\": %u, \"bytes_per_token\": %llu, \"io_engine\": \"%s\", "
        "\"nvme_direct\": %s, \"prefetched_blocks\": %llu, \"corrupt_blocks\": %llu,\n",
        s->kv_block, tkv_kvs_block_bytes(s->kv), (unsigned long long)s->hp.n_layer * s->hp.n_head_kv * s->hp.head_dim * 4,
        ks.io_engine ? ks.io_engine : "none", ks.nvme_direct ? "true" : "false",
        (unsigned long long)ks.prefetched_blocks, (unsigned long long)ks.corrupt_blocks);
    const uint64_t n_steps = s->prefill_chunks + s->decode_tokens;
    OUT("  \"stall_seconds\": %.6f, \"stall_seconds_per_step\": %.6f, \"steps\": %llu},\n", ks.stall_seconds,
        n_steps ? ks.stall_seconds / n_steps : 0.0, (unsigned long long)n_steps);
    /* heterogeneous decode: KV heads (summed over layers) whose host-tier
     * blocks the CPU attended or that were recalled, per decode step */
    static const char *const modes[] = {"auto", "recall", "cpu"}, *const arms[] = {"model", "recall", "cpu"};
    const double steps = s->decode_tokens ? (double)s->decode_tokens : 1.0;
    OUT(" \"hetero\": {\"mode\": \"%s\", \"active\": %s, \"link_gbs\": %.3f, \"cpu_gflops\": %.3f, \"crc_gbs\": %.3f, "
        "\"observed\": %s, \"link_gbs_seen\": %.3f, \"cpu_gflops_seen\": %.3f, \"arm\": \"%s\", "
        "\"arm_steps\": {\"model\": %llu, \"recall\": %llu, \"cpu\": %llu}, "
        "\"cpu_heads\": %llu, \"cpu_blocks\": %llu, \"cpu_tokens\": %llu, \"recall_heads\": %llu, "
        "\"recall_blocks\": %llu, \"host_read_blocks\": %llu,\n  \"per_step\": {\"cpu_heads\": %.3f, "
        "\"cpu_tokens\": %.3f, \"recall_heads\": %.3f, \"recall_blocks\": %.3f}},\n",
        modes[s->hetero], s->be_cpu ? "true" : "false", s->link_bps / 1e9, s->cpu_flops / 1e9, s->crc_bps / 1e9,
        s->het_observe ? "true" : "false", tkv_hetero_rate_get(&s->link_seen, 0) / 1e9,
        tkv_hetero_rate_get(&s->cpu_seen, 0) / 1e9, s->het_observe ? arms[s->arms.arm] : "none",
        (unsigned long long)s->arms.steps[TKV_HETERO_ARM_MODEL],
        (unsigned long long)s->arms.steps[TKV_HETERO_ARM_RECALL],
        (unsigned long long)s->arms.steps[TKV_HETERO_ARM_CPU], (unsigned long long)s->het_cpu_heads,
        (unsigned long long)s->het_cpu_blocks,
        (unsigned long long)s->het_cpu_tokens, (unsigned long long)s->het_recall_heads,
        (unsigned long long)s->het_recall_blocks, (unsigned long long)ks.host_read_blocks,
        s->het_cpu_heads / steps, s->het_cpu_tokens / steps, s->het_recall_heads / steps,
        s->het_recall_blocks / steps);
    /* decode layers attended from the device table, those of them whose
     * missing blocks were recalled or left to the CPU first, and those that
     * fell back to the host path (a recall evicted a selected block) */
    OUT(" \"device_table\": {\"active\": %s, \"layers\": %llu, \"brought\": %llu, \"fallbacks\": %llu},\n",
        s->dev_table ? "true" : "false", (unsigned long long)s->dt_layers, (unsigned long long)s->dt_brought,
        (unsigned long long)s->dt_fallbacks);
    /* tiers by role: compute is "gpu" or "host" */
    static const char *const names[3] = {"gpu", "host", "nvme"};
    OUT(" \"tiers\": {");
    for (int k = 0; k < 3; k++) {
        const struct tkv_tier_stats *t = NULL;
        for (int i = 0; i < TKV_TIER_COUNT; i++)
            if (ks.tier[i].name && !strcmp(ks.tier[i].name, names[k]))
                t = &ks.tier[i];
        OUT("%s\n  \"%s\": ", k ? "," : "", names[k]);
        if (!t)
            OUT("{\"present\": false}");
        else
            OUT("{\"present\": true, \"capacity_bytes\": %llu, \"bytes_in\": %llu, \"bytes_out\": %llu, "
                "\"used_bytes\": %llu, \"peak_bytes\": %llu, \"hits\": %llu, \"misses\": %llu}",
                (unsigned long long)t->capacity_bytes, (unsigned long long)t->bytes_in,
                (unsigned long long)t->bytes_out, (unsigned long long)t->used_bytes, (unsigned long long)t->peak_bytes,
                (unsigned long long)t->hits, (unsigned long long)t->misses);
    }
    OUT("}}");
#undef OUT
    *len_out = n;
    if (n >= sizeof tmp)
        return tkv_err(TKV_ERR_INTERNAL, "stats: JSON longer than %zu bytes", sizeof tmp);
    if (n >= cap)
        return tkv_err(TKV_ERR_TOO_SMALL, "stats: %zu bytes needed", n + 1);
    memcpy(buf, tmp, n + 1);
    return TKV_OK;
}
