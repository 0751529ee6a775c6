/*
 * gen-model.h -- synthetic Llama models with random weights, written as
 * standard GGUF (tierkv gen-model; docs/gen-model.md).
 *
 * Real 8B weights cannot reach the GPU machine, so benchmarks generate
 * models of the real shapes there. The file is a `llama` architecture model
 * that tierkv and llama.cpp both load: weights at scales that keep the
 * residual stream and the logits O(1), F32 norms near 1, and a synthetic
 * byte-level BPE vocabulary (gpt2 model, llama-bpe pre-tokenizer).
 *
 * Determinism: every row of every tensor is a function of (seed, tensor
 * name, row) only, computed with integer arithmetic and one float multiply,
 * so the same seed, shape and type give a byte-identical file for any
 * thread count (and on any x86-64 machine). The same seed in another type is
 * the same model at another precision.
 *
 * Generation streams: memory use is one chunk of rows (64 MiB) plus the
 * tokenizer metadata, whatever the model size.
 */
#ifndef TKV_GEN_MODEL_H
#define TKV_GEN_MODEL_H

#include "tkv-impl.h"

#include <stdint.h>

struct tkv_gen_shape {
    char     name[32];     /* "llama3-8b", "tiny", "custom", ...                */
    uint32_t n_layer;      /* L                                                  */
    uint32_t n_embd;       /* E                                                  */
    uint32_t n_head;       /* H (query heads); head_dim = E / H                  */
    uint32_t n_head_kv;    /* HKV (divides H)                                    */
    uint32_t n_ff;         /* F                                                  */
    uint32_t n_vocab;      /* V (>= 258: 256 bytes + BOS + EOS)                  */
    uint32_t n_ctx;        /* llama.context_length                               */
    float    rope_base;    /* llama.rope.freq_base                               */
    float    rms_eps;      /* llama.attention.layer_norm_rms_epsilon             */
};

/* Parses "llama3-8b", "qwen2.5-7b", "tiny" or "custom:L,E,H,HKV,F,V" into
 * *out (custom shapes get n_ctx 4096, rope base 10000, eps 1e-5) and checks
 * it with tkv_gen_shape_check(.., TKV_TYPE_F16). Anything else is
 * TKV_ERR_INVALID_ARG with a message naming the problem. */
tkv_status tkv_gen_shape_parse(const char *spec, struct tkv_gen_shape *out);

/* Checks that a shape makes a model tierkv and llama.cpp run with weights of
 * `type`: every dimension >= 1 and within tierkv's limits, H divides E, HKV
 * divides H, an even head_dim, E and F multiples of the type's block size
 * (32 for Q8_0 / Q4_0), V in [258, 2^31). TKV_ERR_INVALID_ARG otherwise. */
tkv_status tkv_gen_shape_check(const struct tkv_gen_shape *shape, uint32_t type);

/* Called after each chunk: bytes of tensor data done and in all. */
typedef void (*tkv_gen_progress_fn)(uint64_t done, uint64_t total, void *user);

struct tkv_gen_params {
    struct tkv_gen_shape shape;
    uint32_t type;                /* TKV_TYPE_F16, TKV_TYPE_Q8_0 or TKV_TYPE_Q4_0 */
    uint64_t seed;
    uint32_t n_threads;           /* 0 = all online cores                      */
    tkv_gen_progress_fn progress; /* may be NULL                               */
    void    *progress_user;
};

/* Generates the model and writes it to path (through a temporary file that
 * is renamed at the end: on failure nothing is left at path). Returns
 * TKV_ERR_INVALID_ARG for a bad shape or type (before touching the disk),
 * TKV_ERR_IO naming the path, TKV_ERR_NOMEM. */
tkv_status tkv_gen_model(const struct tkv_gen_params *params, const char *path);

#endif /* TKV_GEN_MODEL_H */
