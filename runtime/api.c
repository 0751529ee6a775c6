/* api.c -- model loading and the tokenizer entry points of tierkv.h. */
#include "engine.h"

#include <stdlib.h>

tkv_status tkv_model_load(const char *path, tkv_model **out)
{
    if (!out)
        return tkv_err(TKV_ERR_INVALID_ARG, "tkv_model_load: out is NULL");
    *out = NULL;
    if (!path)
        return tkv_err(TKV_ERR_INVALID_ARG, "tkv_model_load: path is NULL");
    tkv_model *m = calloc(1, sizeof *m);
    if (!m)
        return tkv_err(TKV_ERR_NOMEM, "tkv_model_load: out of memory");
    tkv_status st = tkv_gguf_open(path, &m->gguf);
    if (st == TKV_OK)
        st = tkv_llama_from_gguf(m->gguf, &m->llama);
    if (st == TKV_OK)
        st = tkv_tokenizer_init(m->gguf, &m->tok);
    if (st == TKV_OK && tkv_tokenizer_n_vocab(m->tok) != m->llama.info.n_vocab)
        st = tkv_err(TKV_ERR_FORMAT, "vocabulary of %u tokens does not match token_embd.weight (%u rows)",
                     tkv_tokenizer_n_vocab(m->tok), m->llama.info.n_vocab);
    if (st != TKV_OK) {
        tkv_err_wrap(st, "%s", path);
        tkv_model_free(m);
        return st;
    }
    *out = m;
    return TKV_OK;
}

void tkv_model_free(tkv_model *m)
{
    if (!m)
        return;
    tkv_tokenizer_free(m->tok);
    tkv_llama_free(&m->llama);
    tkv_gguf_close(m->gguf);
    free(m);
}

tkv_status tkv_model_get_info(const tkv_model *m, struct tkv_model_info *out)
{
    if (!m || !out)
        return tkv_err(TKV_ERR_INVALID_ARG, "tkv_model_get_info: NULL argument");
    *out = m->llama.info;
    return TKV_OK;
}

uint32_t tkv_model_n_vocab(const tkv_model *m) { return m ? m->llama.info.n_vocab : 0; }

tkv_status tkv_tokenize(const tkv_model *m, const char *text, ptrdiff_t len, unsigned flags, tkv_token *out,
                        size_t cap, size_t *n_out)
{
    if (!m || !text || !n_out || (cap && !out))
        return tkv_err(TKV_ERR_INVALID_ARG, "tkv_tokenize: NULL argument");
    return tkv_tokenizer_encode(m->tok, text, len < 0 ? strlen(text) : (size_t)len, flags, out, cap, n_out);
}

tkv_status tkv_detokenize(const tkv_model *m, const tkv_token *toks, size_t n, unsigned flags, char *buf, size_t cap,
                          size_t *len_out)
{
    if (!m || (n && !toks) || !len_out || (cap && !buf))
        return tkv_err(TKV_ERR_INVALID_ARG, "tkv_detokenize: NULL argument");
    return tkv_tokenizer_decode(m->tok, toks, n, flags, buf, cap, len_out);
}

tkv_status tkv_chat_prompt(const tkv_model *m, const char *system, const char *user, char *buf, size_t cap,
                           size_t *len_out)
{
    if (!m || !user || !len_out || (cap && !buf))
        return tkv_err(TKV_ERR_INVALID_ARG, "tkv_chat_prompt: NULL argument");
    return tkv_tokenizer_chat(m->tok, system, user, buf, cap, len_out);
}

int tkv_token_is_eog(const tkv_model *m, tkv_token tok) { return m && tkv_tokenizer_is_eog(m->tok, tok); }
