/*
 * model.c -- a llama model from a validated GGUF: hyperparameters from the
 * llama.* keys, every tensor looked up and checked against them (shape and
 * type), names for tkv_model_info. After this, nothing downstream rechecks.
 */
#include "model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#define MODEL_MAX_LAYERS 4096u
#define MODEL_MAX_DIM    (1u << 20) /* embedding, FFN and head counts */

// ---- helpers ---------------------------------------------------------------

/* Copies s into dst[cap] NUL-terminated, stopping at an embedded NUL and
 * never splitting a UTF-8 sequence when it has to truncate. */
static void copy_name(char *dst, size_t cap, struct tkv_gguf_str s)
{
    size_t n = (size_t)TKV_MIN(s.len, (uint64_t)cap - 1);
    const char *nul = n ? memchr(s.ptr, 0, n) : NULL;
    if (nul)
        n = (size_t)(nul - s.ptr);
    else if (n < s.len)
        while (n > 0 && ((unsigned char)s.ptr[n] & 0xC0) == 0x80)
            n--;
    memcpy(dst, s.ptr, n);
    dst[n] = '\0';
}

/* An optional/required u32 key within [lo, hi]; *out untouched when absent. */
static tkv_status get_dim(const tkv_gguf *g, const char *key, bool required, uint32_t lo, uint32_t hi,
                          uint32_t *out)
{
    uint32_t v = *out;
    TKV_TRY(tkv_gguf_get_u32(g, key, required, &v));
    if (!tkv_gguf_find_kv(g, key))
        return TKV_OK;
    if (v < lo || v > hi)
        return tkv_err(TKV_ERR_FORMAT, "model: %s = %u is out of range [%u, %u]", key, v, lo, hi);
    *out = v;
    return TKV_OK;
}

static void fmt_shape(char *buf, size_t cap, const int64_t ne[TKV_GGUF_MAX_DIMS])
{
    int n = TKV_GGUF_MAX_DIMS;
    while (n > 1 && ne[n - 1] == 1)
        n--;
    size_t len = (size_t)snprintf(buf, cap, "[");
    for (int j = 0; j < n && len < cap; j++)
        len += (size_t)snprintf(buf + len, cap - len, "%s%lld", j ? ", " : "", (long long)ne[j]);
    if (len < cap)
        snprintf(buf + len, cap - len, "]");
}

struct finder {
    const tkv_gguf *g;
    bool *used;     /* [n_tensors]: claimed by the model */
};

/* Finds tensor `name` with shape [ne0, ne1] (ne1 = 1 for vectors), checks
 * its type (F32 for norms, a runnable weight type otherwise) and claims it.
 * *out = NULL without error when it is absent and optional. */
static tkv_status want(struct finder *f, const char *name, int64_t ne0, int64_t ne1, bool norm, bool optional,
                       const struct tkv_gguf_tensor **out)
{
    const struct tkv_gguf_tensor *t = tkv_gguf_find_tensor(f->g, name);
    *out = t;
    if (!t)
        return optional ? TKV_OK : tkv_err(TKV_ERR_FORMAT, "model: required tensor '%s' is missing", name);
    const int64_t want_ne[TKV_GGUF_MAX_DIMS] = {ne0, ne1, 1, 1};
    if (memcmp(t->ne, want_ne, sizeof want_ne) != 0) {
        char have[96], exp[96];
        fmt_shape(have, sizeof have, t->ne);
        fmt_shape(exp, sizeof exp, want_ne);
        return tkv_err(TKV_ERR_FORMAT, "model: tensor '%s' has shape %s, expected %s", name, have, exp);
    }
    const struct tkv_type_traits *tt = tkv_type_traits(t->type); /* non-NULL: the reader checked */
    if (norm ? t->type != TKV_TYPE_F32 : !tt->weights_ok)
        return tkv_err(TKV_ERR_UNSUPPORTED, "model: unsupported type %s in tensor %s%s", tt->name, name,
                       norm ? " (norms must be F32)" : "");
    f->used[t - tkv_gguf_tensor_at(f->g, 0)] = true;
    return TKV_OK;
}

// ---- hyperparameters -------------------------------------------------------

static tkv_status read_rope_scaling(const tkv_gguf *g, float *scale)
{
    struct tkv_gguf_str type = {"none", 4};
    float factor = 0.0f;
    TKV_TRY(tkv_gguf_get_str(g, "llama.rope.scaling.type", false, &type));
    if (type.len == 4 && memcmp(type.ptr, "none", 4) == 0) {
        /* older converters wrote only this key (ref: llama.cpp LLM_KV_ROPE_SCALE_LINEAR) */
        TKV_TRY(tkv_gguf_get_f32(g, "llama.rope.scale_linear", false, &factor));
    } else if (type.len == 6 && memcmp(type.ptr, "linear", 6) == 0) {
        TKV_TRY(tkv_gguf_get_f32(g, "llama.rope.scaling.factor", false, &factor));
    } else {
        return tkv_err(TKV_ERR_UNSUPPORTED, "model: rope scaling '%.*s' is not supported (llama.rope.scaling.type; "
                       "tierkv runs none and linear)", (int)TKV_MIN(type.len, 32), type.ptr);
    }
    if (!isfinite(factor) || factor < 0.0f)
        return tkv_err(TKV_ERR_FORMAT, "model: rope scaling factor %g is not a positive number", (double)factor);
    *scale = factor == 0.0f ? 1.0f : 1.0f / factor; /* 0 means unset, as in llama.cpp */
    return TKV_OK;
}

static tkv_status read_hparams(const tkv_gguf *g, struct tkv_model_info *in)
{
    TKV_TRY(get_dim(g, "llama.block_count", true, 1, MODEL_MAX_LAYERS, &in->n_layer));
    TKV_TRY(get_dim(g, "llama.context_length", true, 1, UINT32_MAX, &in->n_ctx_train));
    TKV_TRY(get_dim(g, "llama.embedding_length", true, 1, MODEL_MAX_DIM, &in->n_embd));
    TKV_TRY(get_dim(g, "llama.feed_forward_length", true, 1, MODEL_MAX_DIM, &in->n_ff));
    TKV_TRY(get_dim(g, "llama.attention.head_count", true, 1, MODEL_MAX_DIM, &in->n_head));
    in->n_head_kv = in->n_head;
    TKV_TRY(get_dim(g, "llama.attention.head_count_kv", false, 1, MODEL_MAX_DIM, &in->n_head_kv));
    if (in->n_head % in->n_head_kv)
        return tkv_err(TKV_ERR_FORMAT, "model: llama.attention.head_count (%u) is not a multiple of "
                       "llama.attention.head_count_kv (%u)", in->n_head, in->n_head_kv);

    uint32_t n_expert = 0;
    TKV_TRY(tkv_gguf_get_u32(g, "llama.expert_count", false, &n_expert));
    if (n_expert > 0)
        return tkv_err(TKV_ERR_UNSUPPORTED, "model: mixture-of-experts llama (llama.expert_count = %u) is not "
                       "supported", n_expert);

    uint32_t k_len = 0, v_len = 0;
    TKV_TRY(get_dim(g, "llama.attention.key_length", false, 1, MODEL_MAX_DIM, &k_len));
    TKV_TRY(get_dim(g, "llama.attention.value_length", false, 1, MODEL_MAX_DIM, &v_len));
    if (k_len) {
        in->head_dim = k_len;
    } else {
        if (in->n_embd % in->n_head)
            return tkv_err(TKV_ERR_FORMAT, "model: llama.embedding_length (%u) is not a multiple of "
                           "llama.attention.head_count (%u)", in->n_embd, in->n_head);
        in->head_dim = in->n_embd / in->n_head;
    }
    if (v_len && v_len != in->head_dim)
        return tkv_err(TKV_ERR_UNSUPPORTED, "model: llama.attention.value_length (%u) differs from the key "
                       "length (%u)", v_len, in->head_dim);
    if (in->head_dim % 2)
        return tkv_err(TKV_ERR_FORMAT, "model: head_dim %u is odd (rope rotates pairs)", in->head_dim);

    in->rope_dim = in->head_dim;
    TKV_TRY(get_dim(g, "llama.rope.dimension_count", false, 1, MODEL_MAX_DIM, &in->rope_dim));
    if (in->rope_dim > in->head_dim || in->rope_dim % 2)
        return tkv_err(TKV_ERR_FORMAT, "model: llama.rope.dimension_count (%u) must be even and at most head_dim "
                       "(%u)", in->rope_dim, in->head_dim);

    in->rope_base = 10000.0f;
    TKV_TRY(tkv_gguf_get_f32(g, "llama.rope.freq_base", false, &in->rope_base));
    if (!isfinite(in->rope_base) || in->rope_base <= 0.0f)
        return tkv_err(TKV_ERR_FORMAT, "model: llama.rope.freq_base = %g must be positive", (double)in->rope_base);
    TKV_TRY(read_rope_scaling(g, &in->rope_scale));

    TKV_TRY(tkv_gguf_get_f32(g, "llama.attention.layer_norm_rms_epsilon", true, &in->rms_eps));
    if (!isfinite(in->rms_eps) || in->rms_eps <= 0.0f || in->rms_eps > 1.0f)
        return tkv_err(TKV_ERR_FORMAT, "model: llama.attention.layer_norm_rms_epsilon = %g must be in (0, 1]",
                       (double)in->rms_eps);
    return TKV_OK;
}

/* tokenizer.ggml.<which>_token_id as a token below n_vocab, or -1. */
static tkv_status read_special(const tkv_gguf *g, const char *key, uint32_t n_vocab, tkv_token *out)
{
    uint32_t id = 0;
    *out = -1;
    if (!tkv_gguf_find_kv(g, key))
        return TKV_OK;
    TKV_TRY(tkv_gguf_get_u32(g, key, true, &id));
    if (id >= n_vocab)
        return tkv_err(TKV_ERR_FORMAT, "model: %s = %u is not below n_vocab %u", key, id, n_vocab);
    *out = (tkv_token)id;
    return TKV_OK;
}

static tkv_status read_names(const tkv_gguf *g, struct tkv_model_info *in)
{
    struct tkv_gguf_str s = {"", 0};
    TKV_TRY(tkv_gguf_get_str(g, "general.name", false, &s));
    copy_name(in->name, sizeof in->name, s);
    s = (struct tkv_gguf_str){"", 0};
    TKV_TRY(tkv_gguf_get_str(g, "tokenizer.ggml.model", false, &s));
    copy_name(in->tokenizer, sizeof in->tokenizer, s);
    s = (struct tkv_gguf_str){"", 0};
    TKV_TRY(tkv_gguf_get_str(g, "tokenizer.ggml.pre", false, &s));
    copy_name(in->pretokenizer, sizeof in->pretokenizer, s);
    TKV_TRY(tkv_gguf_get_u32(g, "general.file_type", false, &in->file_type));
    TKV_TRY(read_special(g, "tokenizer.ggml.bos_token_id", in->n_vocab, &in->bos));
    TKV_TRY(read_special(g, "tokenizer.ggml.eos_token_id", in->n_vocab, &in->eos));
    return TKV_OK;
}

// ---- tensors ---------------------------------------------------------------

static tkv_status read_tensors(const tkv_gguf *g, struct finder *f, struct tkv_llama *m)
{
    struct tkv_model_info *in = &m->info;
    const struct tkv_gguf_tensor *te = tkv_gguf_find_tensor(g, "token_embd.weight");
    if (!te)
        return tkv_err(TKV_ERR_FORMAT, "model: required tensor 'token_embd.weight' is missing");
    if (te->ne[1] > INT32_MAX)
        return tkv_err(TKV_ERR_FORMAT, "model: token_embd.weight has %lld rows, more than a token id can address",
                       (long long)te->ne[1]);
    in->n_vocab = (uint32_t)te->ne[1];
    TKV_TRY(want(f, "token_embd.weight", in->n_embd, in->n_vocab, false, false, &m->tok_embd));

    uint32_t vocab_key = in->n_vocab;
    TKV_TRY(tkv_gguf_get_u32(g, "llama.vocab_size", false, &vocab_key));
    if (vocab_key != in->n_vocab)
        return tkv_err(TKV_ERR_FORMAT, "model: llama.vocab_size (%u) differs from the %u rows of token_embd.weight",
                       vocab_key, in->n_vocab);
    const struct tkv_gguf_kv *tokens;
    TKV_TRY(tkv_gguf_get_arr(g, "tokenizer.ggml.tokens", false, TKV_GGUF_STRING, &tokens));
    if (tokens && tokens->v.arr.n != in->n_vocab)
        return tkv_err(TKV_ERR_FORMAT, "model: tokenizer.ggml.tokens has %llu entries but token_embd.weight has %u "
                       "rows", (unsigned long long)tokens->v.arr.n, in->n_vocab);

    TKV_TRY(want(f, "output_norm.weight", in->n_embd, 1, true, false, &m->output_norm));
    TKV_TRY(want(f, "output.weight", in->n_embd, in->n_vocab, false, true, &m->output));
    m->tied_output = m->output == NULL;
    if (m->tied_output)
        m->output = m->tok_embd;

    int64_t q_dim = (int64_t)in->n_head * in->head_dim, kv_dim = (int64_t)in->n_head_kv * in->head_dim;
    for (uint32_t il = 0; il < in->n_layer; il++) {
        struct tkv_llama_layer *l = &m->layers[il];
        char name[TKV_GGUF_MAX_NAME + 1];
#define WANT(field, suffix, ne0, ne1, norm)                                   \
        snprintf(name, sizeof name, "blk.%u." suffix ".weight", il);          \
        TKV_TRY(want(f, name, ne0, ne1, norm, false, &l->field))
        WANT(attn_norm, "attn_norm", in->n_embd, 1, true);
        WANT(wq, "attn_q", in->n_embd, q_dim, false);
        WANT(wk, "attn_k", in->n_embd, kv_dim, false);
        WANT(wv, "attn_v", in->n_embd, kv_dim, false);
        WANT(wo, "attn_output", q_dim, in->n_embd, false);
        WANT(ffn_norm, "ffn_norm", in->n_embd, 1, true);
        WANT(w_gate, "ffn_gate", in->n_embd, in->n_ff, false);
        WANT(w_up, "ffn_up", in->n_embd, in->n_ff, false);
        WANT(w_down, "ffn_down", in->n_ff, in->n_embd, false);
#undef WANT
    }

    /* Anything left over means the file is not the model the keys describe
     * (llama.cpp refuses such files too). */
    for (size_t i = 0; i < tkv_gguf_n_tensors(g); i++) {
        const struct tkv_gguf_tensor *t = tkv_gguf_tensor_at(g, i);
        if (f->used[i])
            continue;
        if (strcmp(t->name, "rope_freqs.weight") == 0)
            return tkv_err(TKV_ERR_UNSUPPORTED, "model: tensor 'rope_freqs.weight' (Llama 3 rope frequency "
                           "factors) is not supported");
        return tkv_err(TKV_ERR_FORMAT, "model: unexpected tensor '%s' (not part of a llama model with %u layers)",
                       t->name, in->n_layer);
    }
    return TKV_OK;
}

// ---- public ------------------------------------------------------------------

static tkv_status load(const tkv_gguf *g, struct tkv_llama *out)
{
    struct tkv_model_info *in = &out->info;
    struct tkv_gguf_str arch;
    TKV_TRY(tkv_gguf_get_str(g, "general.architecture", true, &arch));
    copy_name(in->arch, sizeof in->arch, arch);
    if (arch.len != 5 || memcmp(arch.ptr, "llama", 5) != 0)
        return tkv_err(TKV_ERR_UNSUPPORTED, "model architecture '%.*s' is not supported (tierkv runs llama)",
                       (int)TKV_MIN(arch.len, 64), arch.ptr);
    TKV_TRY(read_hparams(g, in));

    out->layers = calloc(in->n_layer, sizeof *out->layers);
    struct finder f = {g, calloc(tkv_gguf_n_tensors(g) + 1, sizeof(bool))};
    tkv_status st = TKV_OK;
    if (!f.used || !out->layers)
        st = tkv_err(TKV_ERR_NOMEM, "model: no memory for %u layers", in->n_layer);
    if (st == TKV_OK)
        st = read_tensors(g, &f, out);
    free(f.used);
    TKV_TRY(st);
    TKV_TRY(read_names(g, in));
    for (size_t i = 0; i < tkv_gguf_n_tensors(g); i++)
        in->n_params += tkv_gguf_tensor_at(g, i)->n_elems;
    in->file_bytes = tkv_gguf_file_size(g);
    return TKV_OK;
}

tkv_status tkv_llama_from_gguf(const tkv_gguf *g, struct tkv_llama *out)
{
    if (!g || !out)
        return tkv_err(TKV_ERR_INVALID_ARG, "model: NULL argument");
    memset(out, 0, sizeof *out);
    tkv_status st = load(g, out);
    if (st != TKV_OK)
        tkv_llama_free(out); /* leaves *out zeroed */
    return st;
}

void tkv_llama_free(struct tkv_llama *m)
{
    if (!m)
        return;
    free(m->layers);
    memset(m, 0, sizeof *m);
}
