/*
 * Description: the real SmolLM2-135M-Instruct Q4_1 GGUF (TKV_MODEL) reads and
 * validates as the llama model the shared spec describes (section 2.5).
 * Skips when the model file is absent.
 */
#include "runtime/gguf.h"
#include "runtime/model.h"
#include "test.h"

#include <string.h>
#include <time.h>

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void check_tensor(const tkv_gguf *g, const char *name, uint32_t type, int64_t ne0, int64_t ne1)
{
    const struct tkv_gguf_tensor *t = tkv_gguf_find_tensor(g, name);
    CHECK(t != NULL, "tensor %s missing", name);
    if (!t)
        return;
    CHECK(t->type == type, "%s is %s, want %s", name, tkv_type_name(t->type), tkv_type_name(type));
    CHECK(t->ne[0] == ne0 && t->ne[1] == ne1 && t->ne[2] == 1 && t->ne[3] == 1, "%s is [%lld, %lld], want [%lld, %lld]",
          name, (long long)t->ne[0], (long long)t->ne[1], (long long)ne0, (long long)ne1);
}

int main(void)
{
    const char *path = test_model_path();
    tkv_gguf *g = NULL;
    double t0 = now_s();
    tkv_status st = tkv_gguf_open(path, &g);
    double t_open = now_s() - t0;
    REQUIRE(st == TKV_OK, "open %s: %s", path, tkv_last_error());
    fprintf(stderr, "opened and validated %s in %.1f ms\n", path, 1e3 * t_open);

    CHECK(tkv_gguf_version(g) == 3, "version %u", tkv_gguf_version(g));
    CHECK(tkv_gguf_alignment(g) == 32, "alignment %u", tkv_gguf_alignment(g));
    CHECK(tkv_gguf_n_tensors(g) == 272, "n_tensors %zu", tkv_gguf_n_tensors(g));

    size_t n_q8 = 0, n_q41 = 0, n_f32 = 0;
    for (size_t i = 0; i < tkv_gguf_n_tensors(g); i++) {
        uint32_t type = tkv_gguf_tensor_at(g, i)->type;
        n_q8 += type == TKV_TYPE_Q8_0;
        n_q41 += type == TKV_TYPE_Q4_1;
        n_f32 += type == TKV_TYPE_F32;
    }
    CHECK(n_q8 == 1 && n_q41 == 210 && n_f32 == 61, "types: %zu Q8_0, %zu Q4_1, %zu F32", n_q8, n_q41, n_f32);
    check_tensor(g, "token_embd.weight", TKV_TYPE_Q8_0, 576, 49152);
    check_tensor(g, "output_norm.weight", TKV_TYPE_F32, 576, 1);
    CHECK(tkv_gguf_find_tensor(g, "output.weight") == NULL, "output.weight present: expected tied embeddings");
    for (int l = 0; l < 30; l++) {
        char n[64];
#define T(suffix, type, ne0, ne1) snprintf(n, sizeof n, "blk.%d." suffix ".weight", l); check_tensor(g, n, type, ne0, ne1)
        T("attn_norm", TKV_TYPE_F32, 576, 1);
        T("attn_q", TKV_TYPE_Q4_1, 576, 576);
        T("attn_k", TKV_TYPE_Q4_1, 576, 192);
        T("attn_v", TKV_TYPE_Q4_1, 576, 192);
        T("attn_output", TKV_TYPE_Q4_1, 576, 576);
        T("ffn_norm", TKV_TYPE_F32, 576, 1);
        T("ffn_gate", TKV_TYPE_Q4_1, 576, 1536);
        T("ffn_up", TKV_TYPE_Q4_1, 576, 1536);
        T("ffn_down", TKV_TYPE_Q4_1, 1536, 576);
#undef T
    }
    const struct tkv_gguf_tensor *te = tkv_gguf_find_tensor(g, "token_embd.weight");
    CHECK(te && te->nbytes == 30081024, "token_embd bytes %llu", te ? (unsigned long long)te->nbytes : 0ull);

    const struct tkv_gguf_kv *arr = NULL;
    CHECK(tkv_gguf_get_arr(g, "tokenizer.ggml.tokens", true, TKV_GGUF_STRING, &arr) == TKV_OK && arr &&
          arr->v.arr.n == 49152, "tokens: %s", tkv_last_error());
    if (arr) {
        struct tkv_gguf_str t0s = tkv_gguf_arr_str(g, arr, 0), t1 = tkv_gguf_arr_str(g, arr, 1),
                            t2 = tkv_gguf_arr_str(g, arr, 2);
        CHECK(t0s.len == 13 && memcmp(t0s.ptr, "<|endoftext|>", 13) == 0, "token 0 '%.*s'", (int)t0s.len, t0s.ptr);
        CHECK(t1.len == 12 && memcmp(t1.ptr, "<|im_start|>", 12) == 0, "token 1 '%.*s'", (int)t1.len, t1.ptr);
        CHECK(t2.len == 10 && memcmp(t2.ptr, "<|im_end|>", 10) == 0, "token 2 '%.*s'", (int)t2.len, t2.ptr);
    }
    CHECK(tkv_gguf_get_arr(g, "tokenizer.ggml.merges", true, TKV_GGUF_STRING, &arr) == TKV_OK && arr &&
          arr->v.arr.n == 48900, "merges: %llu", arr ? (unsigned long long)arr->v.arr.n : 0ull);
    CHECK(tkv_gguf_get_arr(g, "tokenizer.ggml.token_type", true, TKV_GGUF_I32, &arr) == TKV_OK && arr &&
          arr->v.arr.n == 49152 && tkv_gguf_arr_i64(arr, 1) == 3 && tkv_gguf_arr_i64(arr, 1000) == 1, "token_type");

    struct tkv_llama m;
    st = tkv_llama_from_gguf(g, &m);
    CHECK(st == TKV_OK, "llama: %s", tkv_last_error());
    if (st == TKV_OK) {
        const struct tkv_model_info *in = &m.info;
        CHECK(strcmp(in->arch, "llama") == 0, "arch %s", in->arch);
        CHECK(in->n_layer == 30 && in->n_embd == 576 && in->n_head == 9 && in->n_head_kv == 3 && in->head_dim == 64,
              "dims %u %u %u %u %u", in->n_layer, in->n_embd, in->n_head, in->n_head_kv, in->head_dim);
        CHECK(in->n_ff == 1536 && in->n_vocab == 49152 && in->n_ctx_train == 8192 && in->rope_dim == 64,
              "ff %u vocab %u ctx %u rope_dim %u", in->n_ff, in->n_vocab, in->n_ctx_train, in->rope_dim);
        CHECK(in->rope_base == 100000.0f && in->rope_scale == 1.0f && in->rms_eps == 1e-5f, "rope %g %g eps %g",
              in->rope_base, in->rope_scale, in->rms_eps);
        CHECK(in->file_type == 3 && in->bos == 1 && in->eos == 2, "file_type %u bos %d eos %d", in->file_type, in->bos,
              in->eos);
        CHECK(strcmp(in->tokenizer, "gpt2") == 0 && strcmp(in->pretokenizer, "smollm") == 0, "tokenizer %s/%s",
              in->tokenizer, in->pretokenizer);
        CHECK(in->n_params > 134000000 && in->n_params < 135000000, "n_params %llu",
              (unsigned long long)in->n_params);
        CHECK(in->file_bytes == tkv_gguf_file_size(g), "file_bytes");
        CHECK(m.tied_output && m.output == te, "tied output");
        fprintf(stderr, "model '%s': %llu params, %.1f MiB\n", in->name, (unsigned long long)in->n_params,
                (double)in->file_bytes / (1 << 20));
        tkv_llama_free(&m);
    }
    tkv_gguf_close(g);
    return test_done();
}
