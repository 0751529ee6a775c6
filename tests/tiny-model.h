/*
 * tiny-model.h -- a tiny random Llama model written with our GGUF writer, for
 * tests that need a whole model without the real one (2 layers, GQA 4/2,
 * head_dim 16, a 40-token byte-ish gpt2 vocabulary). Header-only: include it
 * in one test file; it uses that file's `rng` through test.h's generator.
 */
#ifndef TKV_TINY_MODEL_H
#define TKV_TINY_MODEL_H

#include "cpu/quant.h"
#include "runtime/gguf.h"
#include "test.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { L = 2, E = 64, H = 4, HKV = 2, HD = 16, F = 96, V = 40, ROT = 16, CTX = 128 };
#define ROPE_BASE 10000.0f
#define EPS 1e-5f

static uint64_t rng;

/* The model's weights as the reference sees them: dequantized f32. */
struct ref_model {
    float *embd, *out_norm, *output;
    float *attn_norm[L], *wq[L], *wk[L], *wv[L], *wo[L], *ffn_norm[L], *wg[L], *wu[L], *wd[L];
};

static void *quantized(uint32_t type, int64_t n_in, int64_t n_out, float scale, float **deq)
{
    const struct tkv_type_traits *tr = tkv_type_traits(type);
    size_t row = (size_t)n_in / tr->block_elems * tr->block_bytes;
    uint8_t *q = malloc(row * n_out);
    float *x = malloc(n_in * sizeof *x);
    *deq = malloc((size_t)n_in * n_out * sizeof **deq);
    for (int64_t r = 0; r < n_out; r++) {
        for (int64_t i = 0; i < n_in; i++)
            x[i] = test_rand_f32(&rng, -scale, scale);
        tkv_quantize_row(type, x, q + row * r, n_in);
        tkv_dequant_row_ref(type, q + row * r, *deq + r * n_in, n_in);
    }
    free(x);
    return q;
}

/* Writes the tiny model with matrices of type wtype; fills the reference. */
static void write_model(const char *path, uint32_t wtype, struct ref_model *rm)
{
    tkv_gguf_writer *w;
    tkv_gguf_writer_init(&w);
    tkv_gguf_add_str(w, "general.architecture", "llama");
    tkv_gguf_add_str(w, "general.name", "tiny-test");
    tkv_gguf_add_u32(w, "llama.context_length", CTX);
    tkv_gguf_add_u32(w, "llama.embedding_length", E);
    tkv_gguf_add_u32(w, "llama.block_count", L);
    tkv_gguf_add_u32(w, "llama.feed_forward_length", F);
    tkv_gguf_add_u32(w, "llama.rope.dimension_count", ROT);
    tkv_gguf_add_u32(w, "llama.attention.head_count", H);
    tkv_gguf_add_u32(w, "llama.attention.head_count_kv", HKV);
    tkv_gguf_add_f32(w, "llama.attention.layer_norm_rms_epsilon", EPS);
    tkv_gguf_add_f32(w, "llama.rope.freq_base", ROPE_BASE);
    /* a byte-ish gpt2 vocabulary: one control token and 39 letters */
    const char *toks[V];
    int32_t types[V];
    static char names[V][8];
    for (int i = 0; i < V; i++) {
        if (i == 0)
            strcpy(names[i], "<|end|>");
        else if (i == V - 1)
            strcpy(names[i], "12"); /* the result of the one merge */
        else
            snprintf(names[i], sizeof names[i], "%c", (char)('0' + i));
        toks[i] = names[i];
        types[i] = i == 0 ? 3 : 1;
    }
    tkv_gguf_add_str(w, "tokenizer.ggml.model", "gpt2");
    tkv_gguf_add_str(w, "tokenizer.ggml.pre", "smollm");
    tkv_gguf_add_arr_str(w, "tokenizer.ggml.tokens", toks, V);
    tkv_gguf_add_arr(w, "tokenizer.ggml.token_type", TKV_GGUF_I32, types, V);
    const char *merges[] = {"1 2"};
    tkv_gguf_add_arr_str(w, "tokenizer.ggml.merges", merges, 1);
    tkv_gguf_add_u32(w, "tokenizer.ggml.eos_token_id", 0);

    static void *keep[64];
    int nkeep = 0;
    int64_t ne[2];
#define ADD_MATRIX(name, n_in, n_out, type, scale, ref)                       \
    do {                                                                      \
        ne[0] = n_in, ne[1] = n_out;                                          \
        keep[nkeep] = quantized(type, n_in, n_out, scale, &(ref));            \
        tkv_gguf_add_tensor(w, name, type, 2, ne, keep[nkeep++]);             \
    } while (0)
#define ADD_NORM(name, ref)                                                   \
    do {                                                                      \
        ne[0] = E;                                                            \
        ref = malloc(E * sizeof(float));                                      \
        for (int i_ = 0; i_ < E; i_++)                                        \
            ref[i_] = test_rand_f32(&rng, 0.8f, 1.2f);                        \
        tkv_gguf_add_tensor(w, name, TKV_TYPE_F32, 1, ne, ref);               \
    } while (0)
    char name[64];
    ADD_MATRIX("token_embd.weight", E, V, wtype, 1.0f, rm->embd);
    ADD_NORM("output_norm.weight", rm->out_norm);
    ADD_MATRIX("output.weight", E, V, wtype, 0.3f, rm->output);
    for (int l = 0; l < L; l++) {
#define LAYER(suffix) (snprintf(name, sizeof name, "blk.%d.%s.weight", l, suffix), name)
        ADD_NORM(LAYER("attn_norm"), rm->attn_norm[l]);
        ADD_MATRIX(LAYER("attn_q"), E, H * HD, wtype, 0.25f, rm->wq[l]);
        ADD_MATRIX(LAYER("attn_k"), E, HKV * HD, wtype, 0.25f, rm->wk[l]);
        ADD_MATRIX(LAYER("attn_v"), E, HKV * HD, wtype, 0.25f, rm->wv[l]);
        ADD_MATRIX(LAYER("attn_output"), H * HD, E, wtype, 0.15f, rm->wo[l]);
        ADD_NORM(LAYER("ffn_norm"), rm->ffn_norm[l]);
        ADD_MATRIX(LAYER("ffn_gate"), E, F, wtype, 0.2f, rm->wg[l]);
        ADD_MATRIX(LAYER("ffn_up"), E, F, wtype, 0.2f, rm->wu[l]);
        ADD_MATRIX(LAYER("ffn_down"), F, E, wtype, 0.15f, rm->wd[l]);
#undef LAYER
    }
    tkv_status st = tkv_gguf_write_file(w, path);
    CHECK(st == TKV_OK, "write %s: %s", path, tkv_last_error());
    tkv_gguf_writer_free(w);
    for (int i = 0; i < nkeep; i++)
        free(keep[i]);
}

static void ref_free(struct ref_model *rm)
{
    free(rm->embd), free(rm->out_norm), free(rm->output);
    for (int l = 0; l < L; l++)
        free(rm->attn_norm[l]), free(rm->wq[l]), free(rm->wk[l]), free(rm->wv[l]), free(rm->wo[l]),
            free(rm->ffn_norm[l]), free(rm->wg[l]), free(rm->wu[l]), free(rm->wd[l]);
}

/* The tiny model with weights of type wtype, written to a private temporary
 * file, loaded and the file removed; NULL (with a failed check) on error.
 * For tests that need the model but not its reference weights. */
static inline tkv_model *tiny_model_load(uint32_t wtype)
{
    char path[] = "/tmp/tkv-tiny-model-XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0, "mkstemp: %s", strerror(errno));
    if (fd < 0)
        return NULL;
    close(fd);
    struct ref_model rm;
    write_model(path, wtype, &rm);
    ref_free(&rm);
    tkv_model *m = NULL;
    const tkv_status st = tkv_model_load(path, &m);
    unlink(path);
    CHECK(st == TKV_OK, "load the tiny model: %s", tkv_last_error());
    return st == TKV_OK ? m : NULL;
}

#endif
