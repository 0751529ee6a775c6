/*
 * kv-synth.c -- synthetic long contexts for benchmarks (see kv-synth.h).
 */
#include "kv-synth.h"

#include "session.h"
#include "../cpu/quant.h" /* tkv_fp16_to_fp32_row, tkv_fp32_to_fp16_row */

#include <math.h>
#include <stdlib.h>

struct tkv_synth_params tkv_synth_default_params(void)
{
    return (struct tkv_synth_params){.n_real = 512, .hot_spread = 0, .cold_spread = 0, .hot_every = 0,
                                     .recent_blocks = 0, .seed = 1};
}

/* splitmix64: the scatter of hot blocks */
static uint64_t mix64(uint64_t x)
{
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* Whether copied block b (of nb) of (l, h) is hot. */
static bool synth_hot(const struct tkv_synth_params *p, uint32_t l, uint32_t h, uint32_t b, uint32_t nb)
{
    if (b + p->recent_blocks >= nb)
        return true;
    return p->hot_every && mix64(p->seed ^ mix64(((uint64_t)l << 40) ^ ((uint64_t)h << 24) ^ b)) % p->hot_every == 0;
}

/* The sd of scale * q.(k - m) over the real keys (nb_real blocks of B rows
 * at `real`, S bytes apart) and the observation window's queries of the
 * group of KV head h in layer l; 0 without queries. kc: scratch of
 * nb_real * B * head_dim floats (the centred keys, converted once, stored
 * by dimension: kc[d * n + t]); x: scratch of nb_real * B doubles; kf: of
 * B * head_dim floats. Sums in
 * double; each q.k is x += q[d] * k[d] for d ascending, as a plain loop
 * over d would do it, but computed for every key at once (the inner loop
 * runs over keys, so it vectorizes without reordering any key's sum). */
static double logit_sd(const tkv_session *s, uint32_t l, uint32_t h, const uint8_t *real, uint32_t nb_real,
                       uint32_t S, const float *m, float *kc, double *x, float *kf)
{
    const uint32_t hd = s->hp.head_dim, G = s->hp.n_head / s->hp.n_head_kv, B = s->kv_block, n = nb_real * B;
    const size_t QD = (size_t)s->hp.n_head * hd;
    const double scale = 1.0 / sqrt((double)hd);
    for (uint32_t b = 0; b < nb_real; b++) {
        tkv_fp16_to_fp32_row((const uint16_t *)(real + (size_t)b * S), kf, (int64_t)B * hd); /* exact */
        for (uint32_t t = 0; t < B; t++)
            for (uint32_t d = 0; d < hd; d++)
                kc[(size_t)d * n + b * B + t] = kf[(size_t)t * hd + d] - m[d];
    }
    double sum = 0, sum2 = 0, cnt = 0;
    for (uint32_t i = 0; i < s->obs_n; i++)
        for (uint32_t g = 0; g < G; g++) {
            const float *q = s->obs_q + ((size_t)l * OBS_QUERIES + i) * QD + (size_t)(h * G + g) * hd;
            for (uint32_t t = 0; t < n; t++)
                x[t] = 0;
            for (uint32_t d = 0; d < hd; d++) {
                const double qd = q[d];
                const float *kd = kc + (size_t)d * n;
                for (uint32_t t = 0; t < n; t++)
                    x[t] += qd * kd[t];
            }
            for (uint32_t t = 0; t < n; t++) {
                double xt = x[t];
                xt *= scale;
                sum += xt, sum2 += xt * xt, cnt++;
            }
        }
    if (cnt < 2)
        return 0;
    const double mean = sum / cnt, var = sum2 / cnt - mean * mean;
    return var > 0 ? sqrt(var) : 0;
}

/* dst = src with its K rows moved to m + gain * (k - m); V as it is. kf:
 * scratch of B * hd floats. The conversions are the exact row versions of
 * tkv_fp16_to_fp32 / tkv_fp32_to_fp16 (F16C where the build has it). */
static void synth_block(uint16_t *dst, const uint16_t *src, const float *m, float gain, uint32_t B, uint32_t hd,
                        float *kf)
{
    const size_t kh = (size_t)B * hd;
    tkv_fp16_to_fp32_row(src, kf, (int64_t)kh);
    for (uint32_t t = 0; t < B; t++)
        for (uint32_t d = 0; d < hd; d++) {
            const size_t i = (size_t)t * hd + d;
            kf[i] = m[d] + gain * (kf[i] - m[d]);
        }
    tkv_fp32_to_fp16_row(kf, dst, (int64_t)kh);
    memcpy(dst + kh, src + kh, kh * sizeof *dst);
}

tkv_status tkv_session_fill_synthetic_ex(tkv_session *s, const tkv_token *toks, uint32_t n_tokens,
                                         const struct tkv_synth_params *p, struct tkv_synth_report *rep)
{
    if (rep)
        *rep = (struct tkv_synth_report){0};
    if (!s || !toks || !p || n_tokens == 0)
        return tkv_err(TKV_ERR_INVALID_ARG, "fill_synthetic: NULL argument or no tokens");
    if (s->n_past != 0)
        return tkv_err(TKV_ERR_INVALID_ARG, "fill_synthetic: the session already holds %u tokens", s->n_past);
    if (s->policy->ops->changes_prefill)
        return tkv_err(TKV_ERR_UNSUPPORTED,
                       "fill_synthetic: policy '%s' changes the prefill, which would need to see all of it",
                       s->policy->ops->name);
    if (!(p->hot_spread >= 0 && p->hot_spread <= 64) || !(p->cold_spread >= 0 && p->cold_spread <= 64))
        return tkv_err(TKV_ERR_INVALID_ARG, "fill_synthetic: logit spreads %g / %g must be in [0, 64] nats",
                       (double)p->hot_spread, (double)p->cold_spread);
    if (n_tokens > s->n_ctx)
        return tkv_err(TKV_ERR_CONTEXT_FULL, "fill_synthetic: %u tokens exceed the context of %u", n_tokens, s->n_ctx);
    const uint32_t B = s->kv_block, hd = s->hp.head_dim;
    uint32_t r = TKV_MIN(TKV_MAX(p->n_real, B), n_tokens);
    if (r < n_tokens)
        r = r / B * B; /* whole blocks: every copy is a full block */
    TKV_TRY(tkv_prefill(s, toks, r));
    if (rep)
        rep->n_real = r;
    if (r == n_tokens)
        return TKV_OK;

    const uint32_t L = s->hp.n_layer, H = s->hp.n_head_kv, S = tkv_kvs_block_bytes(s->kv);
    const uint32_t nb_real = r / B, nb = (n_tokens + B - 1) / B;
    const bool plain = p->hot_spread == 0 && p->cold_spread == 0;
    /* the copies go into the store a run at a time (tkv_kvs_import_n: one
     * eviction pass and batched uploads per run): a head's copies (plain:
     * pointers to the real blocks), or as many moved copies as the store's
     * run size holds */
    const uint32_t run = plain ? nb - nb_real : tkv_kvs_import_run(s->kv, nb - nb_real);
    uint8_t *real = malloc((size_t)nb_real * S);
    uint8_t *moved = plain ? NULL : malloc((size_t)run * S); /* the run's moved copies */
    const void **srcs = malloc((size_t)run * sizeof *srcs);
    float *m = malloc(hd * sizeof *m);
    double *acc = malloc(hd * sizeof *acc);
    float *kc = plain ? NULL : malloc((size_t)r * hd * sizeof *kc), *kf = plain ? NULL : malloc(S);
    double *x = plain ? NULL : malloc((size_t)r * sizeof *x);
    if (!real || !srcs || !m || !acc || (!plain && (!moved || !kc || !kf || !x))) {
        free(real), free(moved), free(srcs), free(m), free(acc), free(kc), free(kf), free(x);
        return tkv_err(TKV_ERR_NOMEM, "fill_synthetic: out of memory");
    }
    double sd_sum = 0;
    uint64_t hot = 0;
    tkv_status st = tkv_kvs_reserve(s->kv, n_tokens);
    if (st == TKV_OK)
        tkv_kvs_set_length(s->kv, n_tokens);
    for (uint32_t l = 0; l < L && st == TKV_OK; l++)
        for (uint32_t h = 0; h < H && st == TKV_OK; h++) {
            for (uint32_t b = 0; b < nb_real && st == TKV_OK; b++)
                st = tkv_kvs_export(s->kv, l, h, b, real + (size_t)b * S);
            double sd = 0;
            if (!plain && st == TKV_OK) { /* m: the mean of the real prefix's keys; sd: their logits' */
                memset(acc, 0, hd * sizeof *acc);
                for (uint32_t b = 0; b < nb_real; b++) {
                    const uint16_t *k = (const uint16_t *)(real + (size_t)b * S);
                    for (uint32_t t = 0; t < B; t++)
                        for (uint32_t d = 0; d < hd; d++)
                            acc[d] += tkv_fp16_to_fp32(k[(size_t)t * hd + d]);
                }
                for (uint32_t d = 0; d < hd; d++)
                    m[d] = (float)(acc[d] / r);
                sd = logit_sd(s, l, h, real, nb_real, S, m, kc, x, kf);
                sd_sum += sd;
            }
            const bool move = !plain && sd > 0 && isfinite(sd);
            for (uint32_t b0 = nb_real; b0 < nb && st == TKV_OK; b0 += run) {
                const uint32_t n = TKV_MIN(run, nb - b0);
                for (uint32_t j = 0; j < n; j++) {
                    const uint32_t b = b0 + j;
                    const uint8_t *src = real + (size_t)((b - nb_real) % nb_real) * S;
                    const bool is_hot = synth_hot(p, l, h, b, nb);
                    hot += is_hot;
                    if (move) {
                        const float gain = (float)((is_hot ? p->hot_spread : p->cold_spread) / sd);
                        synth_block((uint16_t *)(moved + (size_t)j * S), (const uint16_t *)src, m, gain, B, hd, kf);
                        src = moved + (size_t)j * S;
                    }
                    srcs[j] = src;
                }
                st = tkv_kvs_import_n(s->kv, l, h, b0, n, srcs);
            }
        }
    free(real), free(moved), free(srcs), free(m), free(acc), free(kc), free(kf), free(x);
    if (st != TKV_OK) {
        tkv_kvs_set_length(s->kv, r);
        return tkv_err_wrap(st, "fill_synthetic");
    }
    if (rep) {
        rep->natural_sd = sd_sum / ((double)L * H);
        rep->hot_blocks = hot;
        rep->copied_blocks = (uint64_t)L * H * (nb - nb_real);
    }
    memcpy(s->tokens + r, toks + r, (size_t)(n_tokens - r) * sizeof *toks);
    s->n_past = n_tokens;
    s->n_prompt = n_tokens;
    s->prefill_end = n_tokens;
    s->step = 0;
    return tkv_kvs_write_back(s->kv, NULL); /* as after a prefill (tkv_prefill) */
}

tkv_status tkv_session_fill_synthetic(tkv_session *s, const tkv_token *toks, uint32_t n_tokens, uint32_t n_real,
                                      uint32_t *n_real_out)
{
    struct tkv_synth_params p = tkv_synth_default_params();
    p.n_real = n_real;
    struct tkv_synth_report rep;
    tkv_status st = tkv_session_fill_synthetic_ex(s, toks, n_tokens, &p, &rep);
    if (n_real_out)
        *n_real_out = rep.n_real;
    return st;
}

void tkv_session_step_counters(const tkv_session *s, struct tkv_step_counters *out)
{
    struct tkv_kvs_stats ks;
    tkv_kvs_get_stats(s->kv, &ks);
    *out = (struct tkv_step_counters){
        .decode_steps = s->decode_tokens, .decode_s = s->decode_seconds, .select_s = s->ph_select,
        .attn_s = s->ph_attn, .cpu_attn_s = s->ph_cpu_attn, .store_s = ks.stall_seconds,
        .read_tokens = s->read_tokens, .read_blocks = s->read_blocks, .read_count = s->read_count,
        .read_tokens_max = s->read_tokens_max, .read_layers = s->read_layers,
        .recall_bytes = ks.tier[TKV_TIER_COMPUTE].bytes_in, .host_out_bytes = ks.tier[TKV_TIER_HOST].bytes_out,
        .nvme_out_bytes = ks.tier[TKV_TIER_NVME].bytes_out, .cpu_heads = s->het_cpu_heads,
        .cpu_tokens = s->het_cpu_tokens, .recall_heads = s->het_recall_heads,
        .recall_blocks = s->het_recall_blocks, .host_read_blocks = ks.host_read_blocks,
        .table_layers = s->dt_layers, .table_fallbacks = s->dt_fallbacks,
        .table_brought = s->dt_brought, .table_marked = ks.marked_layers, .store = ks.stall};
}

void tkv_step_counters_since(const struct tkv_step_counters *now, const struct tkv_step_counters *then,
                             struct tkv_step_counters *out)
{
    const struct tkv_step_counters *a = now, *b = then;
    const struct tkv_kvs_stall *x = &a->store, *y = &b->store;
    *out = (struct tkv_step_counters){
        .decode_steps = a->decode_steps - b->decode_steps, .decode_s = a->decode_s - b->decode_s,
        .select_s = a->select_s - b->select_s, .attn_s = a->attn_s - b->attn_s,
        .cpu_attn_s = a->cpu_attn_s - b->cpu_attn_s, .store_s = a->store_s - b->store_s,
        .read_tokens = a->read_tokens - b->read_tokens, .read_blocks = a->read_blocks - b->read_blocks,
        .read_count = a->read_count - b->read_count, .read_tokens_max = a->read_tokens_max - b->read_tokens_max,
        .read_layers = a->read_layers - b->read_layers, .recall_bytes = a->recall_bytes - b->recall_bytes,
        .host_out_bytes = a->host_out_bytes - b->host_out_bytes, .nvme_out_bytes = a->nvme_out_bytes - b->nvme_out_bytes,
        .cpu_heads = a->cpu_heads - b->cpu_heads, .cpu_tokens = a->cpu_tokens - b->cpu_tokens,
        .recall_heads = a->recall_heads - b->recall_heads, .recall_blocks = a->recall_blocks - b->recall_blocks,
        .host_read_blocks = a->host_read_blocks - b->host_read_blocks, .table_layers = a->table_layers - b->table_layers,
        .table_fallbacks = a->table_fallbacks - b->table_fallbacks, .table_brought = a->table_brought - b->table_brought,
        .table_marked = a->table_marked - b->table_marked,
        .store = {.settle_s = x->settle_s - y->settle_s, .evict_s = x->evict_s - y->evict_s,
                  .verify_s = x->verify_s - y->verify_s, .upload_issue_s = x->upload_issue_s - y->upload_issue_s,
                  .upload_wait_s = x->upload_wait_s - y->upload_wait_s, .nvme_s = x->nvme_s - y->nvme_s,
                  .other_s = x->other_s - y->other_s, .layers = x->layers - y->layers,
                  .recalled_blocks = x->recalled_blocks - y->recalled_blocks,
                  .evict_passes = x->evict_passes - y->evict_passes, .evict_scanned = x->evict_scanned - y->evict_scanned,
                  .evicted_blocks = x->evicted_blocks - y->evicted_blocks,
                  .spilled_blocks = x->spilled_blocks - y->spilled_blocks, .upload_calls = x->upload_calls - y->upload_calls,
                  .upload_waits = x->upload_waits - y->upload_waits, .verify_bytes = x->verify_bytes - y->verify_bytes}};
}

void tkv_session_set_phase_sync(tkv_session *s, bool on)
{
    if (on)
        s->flags |= TKV_SESSION_PHASE_SYNC;
    else
        s->flags &= ~TKV_SESSION_PHASE_SYNC;
}

/* Bytes of a tensor read whole: as stored, and as the CUDA backend keeps it. */
static void add_tensor(const struct tkv_gguf_tensor *t, struct tkv_decode_bytes *out)
{
    out->weights += t->nbytes;
    out->weights_f16 += t->n_dims == 1 ? t->n_elems * 4 : t->n_elems * 2;
}

void tkv_model_decode_bytes(const tkv_model *m, struct tkv_decode_bytes *out)
{
    const struct tkv_llama *ll = &m->llama;
    *out = (struct tkv_decode_bytes){.matrix_type = tkv_type_name(ll->layers[0].wq->type)};
    for (uint32_t l = 0; l < ll->info.n_layer; l++) {
        const struct tkv_llama_layer *y = &ll->layers[l];
        const struct tkv_gguf_tensor *ts[] = {y->attn_norm, y->wq, y->wk, y->wv, y->wo,
                                              y->ffn_norm, y->w_gate, y->w_up, y->w_down};
        for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++)
            add_tensor(ts[i], out);
    }
    add_tensor(ll->output_norm, out);
    add_tensor(ll->output, out); /* the whole table when the output is tied to it */
    /* the embedding lookup reads one row */
    out->weights += ll->tok_embd->nbytes / ll->info.n_vocab;
    out->weights_f16 += (uint64_t)ll->info.n_embd * 2;
}

struct tkv_backend *tkv_session_backend(tkv_session *s) { return s ? s->be : NULL; }
