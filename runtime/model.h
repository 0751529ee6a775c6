/*
 * model.h -- a Llama-architecture model described by a validated GGUF file.
 *
 * tkv_llama_from_gguf() checks the llama hyperparameters against the tensor
 * shapes (heads divide, head_dim consistent, vocab matches token_embd, rope
 * dimension <= head_dim, required tensors present with the right shapes,
 * supported types) and fails with TKV_ERR_FORMAT / TKV_ERR_UNSUPPORTED and
 * a message naming the key or tensor. After success, the forward pass can
 * trust every shape here without checking again.
 */
#ifndef TKV_MODEL_H
#define TKV_MODEL_H

#include "gguf.h"

struct tkv_llama_layer {
    const struct tkv_gguf_tensor *attn_norm; /* [n_embd] F32                     */
    const struct tkv_gguf_tensor *wq;        /* [n_embd, n_head*head_dim]        */
    const struct tkv_gguf_tensor *wk;        /* [n_embd, n_head_kv*head_dim]     */
    const struct tkv_gguf_tensor *wv;        /* [n_embd, n_head_kv*head_dim]     */
    const struct tkv_gguf_tensor *wo;        /* [n_head*head_dim, n_embd]        */
    const struct tkv_gguf_tensor *ffn_norm;  /* [n_embd] F32                     */
    const struct tkv_gguf_tensor *w_gate;    /* [n_embd, n_ff]                   */
    const struct tkv_gguf_tensor *w_up;      /* [n_embd, n_ff]                   */
    const struct tkv_gguf_tensor *w_down;    /* [n_ff, n_embd]                   */
};

struct tkv_llama {
    struct tkv_model_info info;              /* hyperparameters and names         */
    const struct tkv_gguf_tensor *tok_embd;  /* [n_embd, n_vocab]                 */
    const struct tkv_gguf_tensor *output_norm;
    const struct tkv_gguf_tensor *output;    /* == tok_embd when tied             */
    bool tied_output;
    struct tkv_llama_layer *layers;          /* [n_layer], malloc'd               */
};

/* Fills *out from g (which must outlive *out). */
tkv_status tkv_llama_from_gguf(const tkv_gguf *g, struct tkv_llama *out);
void       tkv_llama_free(struct tkv_llama *m);

#endif /* TKV_MODEL_H */
