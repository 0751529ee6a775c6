/*
 * kv-synth.c -- synthetic long contexts for benchmarks (see kv-synth.h).
 */
#include "kv-synth.h"

#include "session.h"

#include <stdlib.h>

tkv_status tkv_session_fill_synthetic(tkv_session *s, const tkv_token *toks, uint32_t n_tokens, uint32_t n_real,
                                      uint32_t *n_real_out)
{
    if (n_real_out)
        *n_real_out = 0;
    if (!s || !toks || n_tokens == 0)
        return tkv_err(TKV_ERR_INVALID_ARG, "fill_synthetic: NULL argument or no tokens");
    if (s->n_past != 0)
        return tkv_err(TKV_ERR_INVALID_ARG, "fill_synthetic: the session already holds %u tokens", s->n_past);
    if (strcmp(s->policy->ops->name, "full") != 0)
        return tkv_err(TKV_ERR_UNSUPPORTED, "fill_synthetic: policy '%s' would need to see the whole prefill; use 'full'",
                       s->policy->ops->name);
    if (n_tokens > s->n_ctx)
        return tkv_err(TKV_ERR_CONTEXT_FULL, "fill_synthetic: %u tokens exceed the context of %u", n_tokens, s->n_ctx);
    const uint32_t B = s->kv_block;
    uint32_t r = TKV_MIN(TKV_MAX(n_real, B), n_tokens);
    if (r < n_tokens)
        r = r / B * B; /* whole blocks: every copy is a full block */
    TKV_TRY(tkv_prefill(s, toks, r));
    if (n_real_out)
        *n_real_out = r;
    if (r == n_tokens)
        return TKV_OK;

    const uint32_t L = s->hp.n_layer, H = s->hp.n_head_kv, S = tkv_kvs_block_bytes(s->kv);
    const uint32_t nb_real = r / B, nb = (n_tokens + B - 1) / B;
    uint8_t *real = malloc((size_t)nb_real * S);
    if (!real)
        return tkv_err(TKV_ERR_NOMEM, "fill_synthetic: out of memory");
    tkv_status st = tkv_kvs_reserve(s->kv, n_tokens);
    if (st == TKV_OK)
        tkv_kvs_set_length(s->kv, n_tokens);
    for (uint32_t l = 0; l < L && st == TKV_OK; l++)
        for (uint32_t h = 0; h < H && st == TKV_OK; h++) {
            for (uint32_t b = 0; b < nb_real && st == TKV_OK; b++)
                st = tkv_kvs_export(s->kv, l, h, b, real + (size_t)b * S);
            for (uint32_t b = nb_real; b < nb && st == TKV_OK; b++)
                st = tkv_kvs_import(s->kv, l, h, b, real + (size_t)((b - nb_real) % nb_real) * S);
        }
    free(real);
    if (st != TKV_OK) {
        tkv_kvs_set_length(s->kv, r);
        return tkv_err_wrap(st, "fill_synthetic");
    }
    memcpy(s->tokens + r, toks + r, (size_t)(n_tokens - r) * sizeof *toks);
    s->n_past = n_tokens;
    s->n_prompt = n_tokens;
    s->prefill_end = n_tokens;
    s->step = 0;
    return TKV_OK;
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
