/*
 * Description: GGUF writer/reader round trip, hostile files (truncation at
 * every header byte, huge counts, bad types, offsets, names, alignment) and
 * llama validation of writer-made models. No model file needed.
 */
#include "runtime/gguf.h"
#include "runtime/model.h"
#include "test.h"

#include <string.h>
#include <unistd.h>

#define GGUF_MAGIC 0x46554747u

/* A status and a message substring: the error must name what was wrong.
 * TKV_TEST_VERBOSE=1 prints every message. */
#define CHECK_ERR(st, want, sub, label)                                                             \
    do {                                                                                            \
        tkv_status st_ = (st);                                                                      \
        if (getenv("TKV_TEST_VERBOSE"))                                                             \
            fprintf(stderr, "%-36s %s\n", (label), tkv_last_error());                               \
        CHECK(st_ == (want) && strstr(tkv_last_error(), (sub)) != NULL,                             \
              "%s: got %s \"%s\", want %s containing \"%s\"", (label), tkv_status_str(st_),         \
              tkv_last_error(), tkv_status_str(want), (sub));                                       \
    } while (0)

static uint64_t rng;

// ---- a tiny llama, built with the writer -------------------------------------

struct spec {
    const char *arch;
    uint32_t n_layer, n_embd, n_head, n_head_kv, n_ff, n_vocab, n_ctx;
    uint32_t rope_dim, vocab_key, key_length, value_length; /* 0: key absent */
    int64_t  n_tokens;                                     /* entries in tokenizer.ggml.tokens; -1: absent */
    uint32_t bos, eos;
    bool     untied;
    const char *rope_scaling;                              /* NULL: absent */
    float    rope_factor;
    const char *omit_key, *omit_tensor, *bad_shape, *extra;
    const char *retype;                                    /* this tensor gets type retype_to */
    uint32_t retype_to;
};

static struct spec base_spec(void)
{
    return (struct spec){
        .arch = "llama", .n_layer = 2, .n_embd = 64, .n_head = 4, .n_head_kv = 2, .n_ff = 128, .n_vocab = 32,
        .n_ctx = 256, .rope_dim = 16, .n_tokens = 32, .bos = 1, .eos = 2,
    };
}

/* Tensor data the writer references, kept for comparison after reading. */
struct blob {
    char     name[TKV_GGUF_MAX_NAME + 1];
    uint32_t type, n_dims;
    int64_t  ne[4];
    uint8_t *data;
    uint64_t nbytes;
};
static struct blob blobs[64];
static size_t n_blobs;

static void free_blobs(void)
{
    for (size_t i = 0; i < n_blobs; i++)
        free(blobs[i].data);
    n_blobs = 0;
}

static uint32_t default_type(const char *name)
{
    static const struct { const char *suffix; uint32_t type; } types[] = {
        {"norm.weight", TKV_TYPE_F32},   {"token_embd.weight", TKV_TYPE_Q8_0}, {"output.weight", TKV_TYPE_F16},
        {"attn_q.weight", TKV_TYPE_F16}, {"attn_k.weight", TKV_TYPE_Q8_0},     {"attn_v.weight", TKV_TYPE_Q8_0},
        {"attn_output.weight", TKV_TYPE_F16}, {"ffn_gate.weight", TKV_TYPE_Q4_0},
        {"ffn_up.weight", TKV_TYPE_BF16}, {"ffn_down.weight", TKV_TYPE_Q4_1},
    };
    size_t n = strlen(name);
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        size_t k = strlen(types[i].suffix);
        if (n >= k && strcmp(name + n - k, types[i].suffix) == 0)
            return types[i].type;
    }
    return TKV_TYPE_F32;
}

static tkv_status add_tensor(tkv_gguf_writer *w, const struct spec *s, const char *name, int64_t ne0, int64_t ne1)
{
    if (s->omit_tensor && strcmp(name, s->omit_tensor) == 0)
        return TKV_OK;
    struct blob *b = &blobs[n_blobs];
    uint32_t n_dims = ne1 > 0 ? 2 : 1;
    if (s->bad_shape && strcmp(name, s->bad_shape) == 0) {
        if (n_dims == 2)
            ne1 += 1;
        else
            ne0 += 32;
    }
    snprintf(b->name, sizeof b->name, "%s", name);
    b->type = s->retype && strcmp(name, s->retype) == 0 ? s->retype_to : default_type(name);
    b->n_dims = n_dims;
    b->ne[0] = ne0, b->ne[1] = n_dims == 2 ? ne1 : 1, b->ne[2] = b->ne[3] = 1;
    const struct tkv_type_traits *t = tkv_type_traits(b->type);
    b->nbytes = (uint64_t)(ne0 / t->block_elems) * t->block_bytes * (uint64_t)b->ne[1];
    b->data = malloc(b->nbytes);
    if (b->type == TKV_TYPE_F32)
        for (uint64_t i = 0; i < b->nbytes / 4; i++) {
            float v = test_rand_f32(&rng, 0.5f, 1.5f);
            memcpy(b->data + 4 * i, &v, 4);
        }
    else
        for (uint64_t i = 0; i < b->nbytes; i++)
            b->data[i] = (uint8_t)test_rand_u64(&rng);
    n_blobs++;
    return tkv_gguf_add_tensor(w, name, b->type, n_dims, b->ne, b->data);
}

/* Skips keys named by s->omit_key. */
#define ADD(fn, key, ...) ((s->omit_key && strcmp(key, s->omit_key) == 0) ? TKV_OK : fn(w, key, __VA_ARGS__))

static tkv_status fill(tkv_gguf_writer *w, const struct spec *s)
{
    static char tok_text[256][16];
    const char *toks[256];
    int32_t tok_type[256];
    float scores[256];
    for (int64_t i = 0; i < s->n_tokens && i < 256; i++) {
        snprintf(tok_text[i], sizeof tok_text[i], i == 1 ? "<|im_start|>" : i == 2 ? "<|im_end|>" : "t%lld",
                 (long long)i);
        toks[i] = tok_text[i];
        tok_type[i] = i < 3 ? 3 : 1;
        scores[i] = -(float)i;
    }
    static const uint8_t bytes[5] = {1, 2, 3, 254, 255};
    uint32_t head_dim = s->key_length ? s->key_length : s->n_embd / s->n_head;
    int64_t q_dim = (int64_t)s->n_head * head_dim, kv_dim = (int64_t)s->n_head_kv * head_dim;

    TKV_TRY(ADD(tkv_gguf_add_str, "general.architecture", s->arch));
    TKV_TRY(ADD(tkv_gguf_add_str, "general.name", "tiny llama"));
    TKV_TRY(ADD(tkv_gguf_add_u32, "general.file_type", 7));
    TKV_TRY(ADD(tkv_gguf_add_u32, "llama.context_length", s->n_ctx));
    TKV_TRY(ADD(tkv_gguf_add_u32, "llama.embedding_length", s->n_embd));
    TKV_TRY(ADD(tkv_gguf_add_u32, "llama.block_count", s->n_layer));
    TKV_TRY(ADD(tkv_gguf_add_u32, "llama.feed_forward_length", s->n_ff));
    TKV_TRY(ADD(tkv_gguf_add_u32, "llama.attention.head_count", s->n_head));
    TKV_TRY(ADD(tkv_gguf_add_u32, "llama.attention.head_count_kv", s->n_head_kv));
    TKV_TRY(ADD(tkv_gguf_add_f32, "llama.attention.layer_norm_rms_epsilon", 1e-5f));
    TKV_TRY(ADD(tkv_gguf_add_f32, "llama.rope.freq_base", 100000.0f));
    if (s->rope_dim)
        TKV_TRY(ADD(tkv_gguf_add_u32, "llama.rope.dimension_count", s->rope_dim));
    if (s->vocab_key)
        TKV_TRY(ADD(tkv_gguf_add_u32, "llama.vocab_size", s->vocab_key));
    if (s->key_length)
        TKV_TRY(ADD(tkv_gguf_add_u32, "llama.attention.key_length", s->key_length));
    if (s->value_length)
        TKV_TRY(ADD(tkv_gguf_add_u32, "llama.attention.value_length", s->value_length));
    if (s->rope_scaling) {
        TKV_TRY(ADD(tkv_gguf_add_str, "llama.rope.scaling.type", s->rope_scaling));
        TKV_TRY(ADD(tkv_gguf_add_f32, "llama.rope.scaling.factor", s->rope_factor));
    }
    TKV_TRY(ADD(tkv_gguf_add_str, "tokenizer.ggml.model", "gpt2"));
    TKV_TRY(ADD(tkv_gguf_add_str, "tokenizer.ggml.pre", "smollm"));
    if (s->n_tokens >= 0) {
        TKV_TRY(ADD(tkv_gguf_add_arr_str, "tokenizer.ggml.tokens", toks, (uint64_t)s->n_tokens));
        TKV_TRY(ADD(tkv_gguf_add_arr, "tokenizer.ggml.token_type", TKV_GGUF_I32, tok_type, (uint64_t)s->n_tokens));
        TKV_TRY(ADD(tkv_gguf_add_arr, "tokenizer.ggml.scores", TKV_GGUF_F32, scores, (uint64_t)s->n_tokens));
    }
    TKV_TRY(ADD(tkv_gguf_add_u32, "tokenizer.ggml.bos_token_id", s->bos));
    TKV_TRY(ADD(tkv_gguf_add_u32, "tokenizer.ggml.eos_token_id", s->eos));
    TKV_TRY(ADD(tkv_gguf_add_bool, "tokenizer.ggml.add_bos_token", true));
    TKV_TRY(ADD(tkv_gguf_add_i32, "test.i32", -5));
    TKV_TRY(ADD(tkv_gguf_add_u32, "test.big_u32", 3000000000u));
    TKV_TRY(ADD(tkv_gguf_add_arr, "test.u8_arr", TKV_GGUF_U8, bytes, 5));

    TKV_TRY(add_tensor(w, s, "token_embd.weight", s->n_embd, s->n_vocab));
    TKV_TRY(add_tensor(w, s, "output_norm.weight", s->n_embd, 0));
    if (s->untied)
        TKV_TRY(add_tensor(w, s, "output.weight", s->n_embd, s->n_vocab));
    for (uint32_t l = 0; l < s->n_layer; l++) {
        char n[80];
#define T(suffix, ne0, ne1) snprintf(n, sizeof n, "blk.%u." suffix ".weight", l); TKV_TRY(add_tensor(w, s, n, ne0, ne1))
        T("attn_norm", s->n_embd, 0);
        T("attn_q", s->n_embd, q_dim);
        T("attn_k", s->n_embd, kv_dim);
        T("attn_v", s->n_embd, kv_dim);
        T("attn_output", q_dim, s->n_embd);
        T("ffn_norm", s->n_embd, 0);
        T("ffn_gate", s->n_embd, s->n_ff);
        T("ffn_up", s->n_embd, s->n_ff);
        T("ffn_down", s->n_ff, s->n_embd);
#undef T
    }
    if (s->extra)
        TKV_TRY(add_tensor(w, s, s->extra, 32, 0));
    return TKV_OK;
}

/* The file image of s (malloc'd); the tensor data stays in blobs[]. */
static void *build(const struct spec *s, size_t *size)
{
    tkv_gguf_writer *w = NULL;
    void *img = NULL;
    free_blobs();
    tkv_status st = tkv_gguf_writer_init(&w);
    if (st == TKV_OK)
        st = fill(w, s);
    if (st == TKV_OK)
        st = tkv_gguf_write_mem(w, &img, size);
    tkv_gguf_writer_free(w);
    CHECK(st == TKV_OK, "build: %s %s", tkv_status_str(st), tkv_last_error());
    return st == TKV_OK ? img : NULL;
}

// ---- (1) round trip ------------------------------------------------------------

static void check_contents(const tkv_gguf *g, const struct spec *s)
{
    CHECK(tkv_gguf_version(g) == 3, "version %u", tkv_gguf_version(g));
    CHECK(tkv_gguf_alignment(g) == 32, "alignment %u", tkv_gguf_alignment(g));
    CHECK(tkv_gguf_n_kv(g) == 23, "n_kv %zu", tkv_gguf_n_kv(g));
    for (size_t i = 0; i < tkv_gguf_n_kv(g); i++) {
        const struct tkv_gguf_kv *kv = tkv_gguf_kv_at(g, i);
        char key[128];
        snprintf(key, sizeof key, "%.*s", (int)kv->key.len, kv->key.ptr);
        CHECK(tkv_gguf_find_kv(g, key) == kv, "find_kv(%s)", key);
    }
    CHECK(tkv_gguf_kv_at(g, tkv_gguf_n_kv(g)) == NULL, "kv_at past the end");
    CHECK(tkv_gguf_find_kv(g, "general") == NULL && tkv_gguf_find_kv(g, "general.architecturex") == NULL,
          "prefix lookups must miss");

    struct tkv_gguf_str str = {0};
    uint32_t u = 0;
    int32_t i32 = 0;
    float f = 0;
    bool b = false;
    CHECK(tkv_gguf_get_str(g, "general.architecture", true, &str) == TKV_OK && str.len == 5 &&
          memcmp(str.ptr, "llama", 5) == 0, "architecture");
    CHECK(tkv_gguf_get_str(g, "general.name", true, &str) == TKV_OK && str.len == 10 &&
          memcmp(str.ptr, "tiny llama", 10) == 0, "name");
    CHECK(tkv_gguf_get_u32(g, "llama.embedding_length", true, &u) == TKV_OK && u == s->n_embd, "n_embd %u", u);
    CHECK(tkv_gguf_get_u32(g, "llama.attention.head_count_kv", true, &u) == TKV_OK && u == 2, "n_head_kv %u", u);
    CHECK(tkv_gguf_get_i32(g, "llama.block_count", true, &i32) == TKV_OK && i32 == 2, "u32 as i32 %d", i32);
    CHECK(tkv_gguf_get_f32(g, "llama.rope.freq_base", true, &f) == TKV_OK && f == 100000.0f, "freq_base %g", f);
    CHECK(tkv_gguf_get_f32(g, "llama.attention.layer_norm_rms_epsilon", true, &f) == TKV_OK && f == 1e-5f, "eps");
    CHECK(tkv_gguf_get_bool(g, "tokenizer.ggml.add_bos_token", true, &b) == TKV_OK && b, "add_bos_token");
    CHECK(tkv_gguf_get_i32(g, "test.i32", true, &i32) == TKV_OK && i32 == -5, "i32 %d", i32);

    /* absent optional: OK and untouched; absent required, wrong type, out of range: FORMAT naming the key */
    u = 12345;
    CHECK(tkv_gguf_get_u32(g, "no.such.key", false, &u) == TKV_OK && u == 12345, "absent optional");
    CHECK_ERR(tkv_gguf_get_u32(g, "no.such.key", true, &u), TKV_ERR_FORMAT, "no.such.key", "absent required");
    CHECK_ERR(tkv_gguf_get_u32(g, "test.i32", true, &u), TKV_ERR_FORMAT, "test.i32", "negative as u32");
    CHECK_ERR(tkv_gguf_get_i32(g, "test.big_u32", true, &i32), TKV_ERR_FORMAT, "test.big_u32", "3e9 as i32");
    CHECK(tkv_gguf_get_u32(g, "test.big_u32", true, &u) == TKV_OK && u == 3000000000u, "big u32");
    CHECK_ERR(tkv_gguf_get_u32(g, "general.name", true, &u), TKV_ERR_FORMAT, "general.name", "string as u32");
    CHECK_ERR(tkv_gguf_get_str(g, "llama.block_count", true, &str), TKV_ERR_FORMAT, "llama.block_count", "u32 as str");
    CHECK_ERR(tkv_gguf_get_f32(g, "llama.block_count", true, &f), TKV_ERR_FORMAT, "llama.block_count", "u32 as f32");
    CHECK_ERR(tkv_gguf_get_bool(g, "test.i32", true, &b), TKV_ERR_FORMAT, "test.i32", "i32 as bool");

    const struct tkv_gguf_kv *arr = NULL;
    CHECK(tkv_gguf_get_arr(g, "tokenizer.ggml.tokens", true, TKV_GGUF_STRING, &arr) == TKV_OK && arr &&
          arr->v.arr.n == 32, "tokens");
    if (arr) {
        struct tkv_gguf_str t1 = tkv_gguf_arr_str(g, arr, 1), t31 = tkv_gguf_arr_str(g, arr, 31);
        CHECK(t1.len == 12 && memcmp(t1.ptr, "<|im_start|>", 12) == 0, "token 1");
        CHECK(t31.len == 3 && memcmp(t31.ptr, "t31", 3) == 0, "token 31");
    }
    CHECK(tkv_gguf_get_arr(g, "tokenizer.ggml.token_type", true, TKV_GGUF_I32, &arr) == TKV_OK && arr &&
          tkv_gguf_arr_i64(arr, 0) == 3 && tkv_gguf_arr_i64(arr, 31) == 1, "token_type");
    CHECK(tkv_gguf_get_arr(g, "tokenizer.ggml.scores", true, TKV_GGUF_F32, &arr) == TKV_OK && arr &&
          tkv_gguf_arr_f32(arr, 7) == -7.0f, "scores");
    CHECK(tkv_gguf_get_arr(g, "test.u8_arr", true, TKV_GGUF_I32, &arr) == TKV_OK && arr && arr->v.arr.n == 5 &&
          tkv_gguf_arr_i64(arr, 4) == 255, "u8 array read as integers");
    CHECK_ERR(tkv_gguf_get_arr(g, "tokenizer.ggml.scores", true, TKV_GGUF_STRING, &arr), TKV_ERR_FORMAT,
              "tokenizer.ggml.scores", "f32 array as strings");
    CHECK_ERR(tkv_gguf_get_arr(g, "general.name", true, TKV_GGUF_STRING, &arr), TKV_ERR_FORMAT, "general.name",
              "string as array");
    CHECK(tkv_gguf_get_arr(g, "no.such.key", false, TKV_GGUF_STRING, &arr) == TKV_OK && arr == NULL, "absent arr");

    CHECK(tkv_gguf_n_tensors(g) == n_blobs, "n_tensors %zu, wrote %zu", tkv_gguf_n_tensors(g), n_blobs);
    for (size_t i = 0; i < n_blobs && i < tkv_gguf_n_tensors(g); i++) {
        const struct tkv_gguf_tensor *t = tkv_gguf_tensor_at(g, i);
        const struct blob *bl = &blobs[i];
        CHECK(strcmp(t->name, bl->name) == 0, "tensor %zu is '%s', wrote '%s'", i, t->name, bl->name);
        CHECK(tkv_gguf_find_tensor(g, bl->name) == t, "find_tensor(%s)", bl->name);
        CHECK(t->type == bl->type && t->n_dims == bl->n_dims && memcmp(t->ne, bl->ne, sizeof t->ne) == 0,
              "tensor '%s' type %s dims %u", t->name, tkv_type_name(t->type), t->n_dims);
        CHECK(t->n_elems == (uint64_t)(bl->ne[0] * bl->ne[1]) && t->nbytes == bl->nbytes, "tensor '%s' size",
              t->name);
        CHECK(t->file_offset % 32 == 0 && t->file_offset + t->nbytes <= tkv_gguf_file_size(g), "tensor '%s' offset",
              t->name);
        CHECK(memcmp(t->data, bl->data, bl->nbytes) == 0, "tensor '%s' data differs", t->name);
    }
    CHECK(tkv_gguf_find_tensor(g, "blk.9.attn_q.weight") == NULL, "absent tensor");
}

static void test_round_trip(void)
{
    struct spec s = base_spec();
    size_t size = 0;
    uint64_t rng0 = rng;
    void *img = build(&s, &size);
    if (!img)
        return;
    tkv_gguf *g = NULL;
    tkv_status st = tkv_gguf_open_memory(img, size, &g);
    CHECK(st == TKV_OK, "open_memory: %s", tkv_last_error());
    if (g) {
        CHECK(tkv_gguf_file_size(g) == size, "file size");
        check_contents(g, &s);
        tkv_gguf_close(g);
    }

    /* The same through a file and mmap: byte-identical to write_mem. */
    char path[] = "/tmp/tkv-test-gguf-XXXXXX";
    int fd = mkstemp(path);
    REQUIRE_VOID(fd >= 0);
    close(fd);
    tkv_gguf_writer *w = NULL;
    tkv_gguf_writer_init(&w);
    free_blobs();
    rng = rng0; /* the same tensor data as img */
    CHECK(fill(w, &s) == TKV_OK, "fill: %s", tkv_last_error());
    CHECK(tkv_gguf_write_file(w, path) == TKV_OK, "write_file: %s", tkv_last_error());
    g = NULL;
    CHECK(tkv_gguf_open(path, &g) == TKV_OK, "open: %s", tkv_last_error());
    if (g) {
        CHECK(tkv_gguf_file_size(g) == size, "mmap'ed size %llu != %zu", (unsigned long long)tkv_gguf_file_size(g),
              size);
        check_contents(g, &s);
        tkv_gguf_close(g);
    }
    FILE *f = fopen(path, "rb");
    if (f) {
        void *buf = malloc(size + 1);
        size_t n = fread(buf, 1, size + 1, f);
        CHECK(n == size && memcmp(buf, img, size) == 0, "file (%zu bytes) differs from write_mem (%zu)", n, size);
        fclose(f);
        free(buf);
    }

    /* I/O errors name the path; a full device fails the write. */
    CHECK_ERR(tkv_gguf_open("/nonexistent-dir/x.gguf", &g), TKV_ERR_IO, "/nonexistent-dir/x.gguf", "open missing");
    CHECK_ERR(tkv_gguf_open("/tmp", &g), TKV_ERR_IO, "/tmp", "open a directory");
    CHECK_ERR(tkv_gguf_write_file(w, "/nonexistent-dir/x.gguf"), TKV_ERR_IO, "/nonexistent-dir/x.gguf",
              "write to a missing directory");
    if (access("/dev/full", W_OK) == 0)
        CHECK_ERR(tkv_gguf_write_file(w, "/dev/full"), TKV_ERR_IO, "/dev/full", "write to a full device");
    FILE *e = fopen(path, "wb"); /* an empty file */
    if (e)
        fclose(e);
    CHECK_ERR(tkv_gguf_open(path, &g), TKV_ERR_FORMAT, "empty", "empty file");
    tkv_gguf_writer_free(w);
    unlink(path);
    free(img);
    free_blobs();
}

static void test_writer_args(void)
{
    tkv_gguf_writer *w = NULL;
    tkv_status st = tkv_gguf_writer_init(&w);
    REQUIRE_VOID(st == TKV_OK);
    int64_t ne[2] = {32, 2};
    char long_name[70];
    memset(long_name, 'x', 65);
    long_name[65] = '\0';
    CHECK(tkv_gguf_add_u32(w, "a.key", 1) == TKV_OK, "add");
    CHECK_ERR(tkv_gguf_add_u32(w, "a.key", 2), TKV_ERR_INVALID_ARG, "a.key", "duplicate key");
    CHECK_ERR(tkv_gguf_add_u32(w, "", 2), TKV_ERR_INVALID_ARG, "empty key", "empty key");
    CHECK(tkv_gguf_add_tensor(w, "t", TKV_TYPE_Q8_0, 2, ne, NULL) == TKV_OK, "add_tensor");
    CHECK_ERR(tkv_gguf_add_tensor(w, "t", TKV_TYPE_F32, 2, ne, NULL), TKV_ERR_INVALID_ARG, "'t'", "duplicate tensor");
    CHECK_ERR(tkv_gguf_add_tensor(w, long_name, TKV_TYPE_F32, 2, ne, NULL), TKV_ERR_INVALID_ARG, "xxxxxxxx",
              "name of 65");
    CHECK_ERR(tkv_gguf_add_tensor(w, "u", 4, 2, ne, NULL), TKV_ERR_INVALID_ARG, "unknown type id 4", "removed type");
    ne[0] = 33;
    CHECK_ERR(tkv_gguf_add_tensor(w, "v", TKV_TYPE_Q8_0, 2, ne, NULL), TKV_ERR_INVALID_ARG, "'v'", "partial block");
    ne[0] = 0;
    CHECK_ERR(tkv_gguf_add_tensor(w, "z", TKV_TYPE_F32, 2, ne, NULL), TKV_ERR_INVALID_ARG, "'z'", "ne 0");
    CHECK_ERR(tkv_gguf_add_tensor(w, "d", TKV_TYPE_F32, 5, ne, NULL), TKV_ERR_INVALID_ARG, "'d'", "n_dims 5");
    uint8_t bad_bool = 2;
    CHECK_ERR(tkv_gguf_add_arr(w, "b.arr", TKV_GGUF_BOOL, &bad_bool, 1), TKV_ERR_INVALID_ARG, "b.arr", "bool 2");

    /* zeros for NULL data; the failed calls left nothing behind */
    void *img = NULL;
    size_t size = 0;
    tkv_gguf *g = NULL;
    CHECK(tkv_gguf_write_mem(w, &img, &size) == TKV_OK, "write_mem");
    CHECK(img && tkv_gguf_open_memory(img, size, &g) == TKV_OK, "reopen: %s", tkv_last_error());
    if (g) {
        CHECK(tkv_gguf_n_kv(g) == 1 && tkv_gguf_n_tensors(g) == 1, "counts");
        const struct tkv_gguf_tensor *t = tkv_gguf_find_tensor(g, "t");
        bool zero = t && t->nbytes == 2 * 34;
        for (uint64_t i = 0; zero && i < t->nbytes; i++)
            zero = ((const uint8_t *)t->data)[i] == 0;
        CHECK(zero, "NULL data writes zeros");
        tkv_gguf_close(g);
    }
    free(img);
    tkv_gguf_writer_free(w);
    tkv_gguf_writer_free(NULL);
    tkv_gguf_close(NULL);
}

// ---- (2) hostile files -------------------------------------------------------------

/* Opens exactly n bytes of p from a malloc'd copy (so ASan sees any overread). */
static tkv_status open_copy(const void *p, size_t n)
{
    void *copy = malloc(n ? n : 1);
    memcpy(copy, p, n);
    tkv_gguf *g = NULL;
    tkv_status st = tkv_gguf_open_memory(n ? copy : NULL, n, &g);
    if (st == TKV_OK && !g)
        st = TKV_ERR_INTERNAL;
    tkv_gguf_close(g);
    free(copy);
    return st;
}

static void test_truncation(void)
{
    struct spec s = base_spec();
    size_t size = 0;
    uint8_t *img = build(&s, &size);
    if (!img)
        return;
    tkv_gguf *g = NULL;
    tkv_status st = tkv_gguf_open_memory(img, size, &g);
    REQUIRE_VOID(st == TKV_OK);
    uint64_t data_start = UINT64_MAX, data_end = 0;
    for (size_t i = 0; i < tkv_gguf_n_tensors(g); i++) {
        const struct tkv_gguf_tensor *t = tkv_gguf_tensor_at(g, i);
        data_start = TKV_MIN(data_start, t->file_offset);
        data_end = TKV_MAX(data_end, t->file_offset + t->nbytes);
    }
    tkv_gguf_close(g);

    int bad = 0;
    for (uint64_t n = 0; n < data_end; n += n <= data_start ? 1 : 61) {
        tkv_status st = open_copy(img, (size_t)n);
        if (st != TKV_ERR_FORMAT && bad++ < 5)
            CHECK(0, "truncated to %llu of %zu bytes: %s %s", (unsigned long long)n, size, tkv_status_str(st),
                  tkv_last_error());
    }
    if (getenv("TKV_TEST_VERBOSE")) {
        open_copy(img, (size_t)data_start - 40);
        fprintf(stderr, "%-36s %s\n", "truncated in a tensor info", tkv_last_error());
    }
    CHECK(open_copy(img, (size_t)data_end - 1) == TKV_ERR_FORMAT, "last data byte missing");
    CHECK(open_copy(img, (size_t)data_end) == TKV_OK, "trailing padding is optional: %s", tkv_last_error());
    CHECK(bad == 0, "%d truncations accepted (of %llu header bytes)", bad, (unsigned long long)data_start);

    /* Random corruption of the header region: any status, never a crash. */
    uint8_t *m = malloc(size);
    int ok = 0;
    for (int it = 0; it < 3000; it++) {
        memcpy(m, img, size);
        for (int k = 0, nk = 1 + (int)(test_rand_u64(&rng) % 4); k < nk; k++) {
            size_t at = (size_t)(test_rand_u64(&rng) % data_start);
            uint64_t r = test_rand_u64(&rng);
            m[at] = r & 256 ? (uint8_t)r : m[at] ^ (uint8_t)(1u << (r % 8));
        }
        tkv_gguf *h = NULL;
        tkv_status st = tkv_gguf_open_memory(m, size, &h);
        ok += st == TKV_OK;
        if (h) {
            struct tkv_llama l;
            if (tkv_llama_from_gguf(h, &l) == TKV_OK)
                tkv_llama_free(&l);
            tkv_gguf_close(h);
        }
    }
    fprintf(stderr, "random header corruption: %d of 3000 still parse\n", ok);
    free(m);
    free(img);
    free_blobs();
}

/* A raw byte builder for files the writer refuses to make. */
struct rb {
    uint8_t *p;
    size_t   n, cap;
};

static void rb_put(struct rb *b, const void *p, size_t n)
{
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2 + 256;
        b->p = realloc(b->p, b->cap);
    }
    memcpy(b->p + b->n, p, n);
    b->n += n;
}
static void rb_u32(struct rb *b, uint32_t v) { rb_put(b, &v, 4); }
static void rb_u64(struct rb *b, uint64_t v) { rb_put(b, &v, 8); }
static void rb_str(struct rb *b, const char *s) { rb_u64(b, strlen(s)); rb_put(b, s, strlen(s)); }
static void rb_zeros(struct rb *b, size_t n) { while (n--) rb_put(b, "", 1); }
static void rb_pad(struct rb *b, size_t a) { rb_zeros(b, (a - b->n % a) % a); }
static void rb_hdr(struct rb *b, uint64_t n_tensors, uint64_t n_kv)
{
    b->n = 0;
    rb_u32(b, GGUF_MAGIC);
    rb_u32(b, 3);
    rb_u64(b, n_tensors);
    rb_u64(b, n_kv);
}
static void rb_key(struct rb *b, const char *key, uint32_t type) { rb_str(b, key); rb_u32(b, type); }

struct tinfo {
    const char *name;
    uint32_t n_dims;
    int64_t  ne[5];
    uint32_t type;
    uint64_t offset;
};

/* Tensor infos, padding to align and data_bytes of zeros. */
static void rb_tensors(struct rb *b, const struct tinfo *t, size_t n, size_t align, size_t data_bytes)
{
    for (size_t i = 0; i < n; i++) {
        rb_str(b, t[i].name);
        rb_u32(b, t[i].n_dims);
        for (uint32_t j = 0; j < t[i].n_dims && j < 5; j++)
            rb_u64(b, (uint64_t)t[i].ne[j]);
        rb_u32(b, t[i].type);
        rb_u64(b, t[i].offset);
    }
    rb_pad(b, align);
    rb_zeros(b, data_bytes);
}

/* Two valid tensors a [32, 2] F32 at 0 (256 bytes) and b [32] Q8_0 at 256
 * (34 bytes), one kv, 320 data bytes. */
static void two_tensors(struct rb *b, struct tinfo ta, struct tinfo tb)
{
    struct tinfo t[2] = {ta, tb};
    rb_hdr(b, 2, 1);
    rb_key(b, "test.key", TKV_GGUF_U32);
    rb_u32(b, 7);
    rb_tensors(b, t, 2, 32, 320);
}
#define TA {"a", 2, {32, 2}, TKV_TYPE_F32, 0}
#define TB {"b", 1, {32}, TKV_TYPE_Q8_0, 256}

static void test_hostile(void)
{
    struct rb b = {0};
    struct tinfo ta = TA, tb = TB;

    two_tensors(&b, ta, tb);
    CHECK(open_copy(b.p, b.n) == TKV_OK, "hand-made baseline: %s", tkv_last_error());

    /* header */
    two_tensors(&b, ta, tb);
    memcpy(b.p, "GGUG", 4);
    CHECK_ERR(open_copy(b.p, b.n), TKV_ERR_FORMAT, "magic", "bad magic");
    uint32_t versions[] = {0, 1, 4, 0xffffffffu};
    for (size_t i = 0; i < 4; i++) {
        two_tensors(&b, ta, tb);
        memcpy(b.p + 4, &versions[i], 4);
        CHECK_ERR(open_copy(b.p, b.n), TKV_ERR_FORMAT, "version", "bad version");
    }
    uint32_t be3 = 0x03000000u;
    memcpy(b.p + 4, &be3, 4);
    CHECK_ERR(open_copy(b.p, b.n), TKV_ERR_UNSUPPORTED, "big-endian", "big-endian");
    two_tensors(&b, ta, tb);
    uint64_t big = 1ull << 62;
    memcpy(b.p + 8, &big, 8);
    CHECK_ERR(open_copy(b.p, b.n), TKV_ERR_FORMAT, "tensor_count", "tensor_count 2^62");
    two_tensors(&b, ta, tb);
    big = 1ull << 40;
    memcpy(b.p + 16, &big, 8);
    CHECK_ERR(open_copy(b.p, b.n), TKV_ERR_FORMAT, "kv_count", "kv_count 2^40");
    big = UINT64_MAX;
    memcpy(b.p + 8, &big, 8);
    memcpy(b.p + 16, &big, 8);
    CHECK_ERR(open_copy(b.p, b.n), TKV_ERR_FORMAT, "tensor_count", "both counts 2^64-1");

    /* keys and values */
    two_tensors(&b, ta, tb);
    big = 1ull << 63;
    memcpy(b.p + 24, &big, 8); /* the length of the first key */
    CHECK_ERR(open_copy(b.p, b.n), TKV_ERR_FORMAT, "kv #0", "key length 2^63");
    two_tensors(&b, ta, tb);
    big = 0;
    memcpy(b.p + 24, &big, 8);
    CHECK_ERR(open_copy(b.p, b.n), TKV_ERR_FORMAT, "empty key", "empty key");

    rb_hdr(&b, 0, 1);
    rb_key(&b, "test.s", TKV_GGUF_STRING);
    rb_u64(&b, 1ull << 63);
    rb_zeros(&b, 64);
    CHECK_ERR(open_copy(b.p, b.n), TKV_ERR_FORMAT, "test.s", "string value length 2^63");

    uint32_t elem_types[] = {TKV_GGUF_U32, TKV_GGUF_STRING, TKV_GGUF_U8};
    for (size_t i = 0; i < 3; i++) {
        rb_hdr(&b, 0, 1);
        rb_key(&b, "test.arr", TKV_GGUF_ARRAY);
        rb_u32(&b, elem_types[i]);
        rb_u64(&b, 1ull << 61);
        rb_zeros(&b, 64);
        CHECK_ERR(open_copy(b.p, b.n), TKV_ERR_FORMAT, "test.arr", "array count 2^61");
    }
    rb_hdr(&b, 0, 1);
    rb_key(&b, "test.strs", TKV_GGUF_ARRAY);
    rb_u32(&b, TKV_GGUF_STRING);
    rb_u64(&b, 2);
    rb_str(&b, "ok");
    rb_u64(&b, 100); /* second element runs past the end */
    rb_zeros(&b, 16);
    CHECK_ERR(open_copy(b.p, b.n), TKV_ERR_FORMAT, "element 1 of key 'test.strs'", "string element past end");

    rb_hdr(&b, 0, 1);
    rb_key(&b, "test.nested", TKV_GGUF_ARRAY);
    rb_u32(&b, TKV_GGUF_ARRAY);
    rb_u64(&b, 1);
    rb_u32(&b, TKV_GGUF_U8);
    rb_u64(&b, 1);
    rb_zeros(&b, 8);
    CHECK_ERR(open_copy(b.p, b.n), TKV_ERR_FORMAT, "test.nested", "nested array");
    CHECK(strstr(tkv_last_error(), "nested") != NULL, "nested: %s", tkv_last_error());

    uint32_t bad_types[] = {13, 0xffffffffu};
    for (size_t i = 0; i < 2; i++) {
        rb_hdr(&b, 0, 1);
        rb_key(&b, "test.weird", bad_types[i]);
        rb_zeros(&b, 16);
        CHECK_ERR(open_copy(b.p, b.n), TKV_ERR_FORMAT, "test.weird", "unknown value type");
        rb_hdr(&b, 0, 1);
        rb_key(&b, "test.weird_arr", TKV_GGUF_ARRAY);
        rb_u32(&b, bad_types[i]);
        rb_u64(&b, 1);
        rb_zeros(&b, 16);
        CHECK_ERR(open_copy(b.p, b.n), TKV_ERR_FORMAT, "test.weird_arr", "unknown array element type");
    }

    rb_hdr(&b, 0, 1);
    rb_key(&b, "test.flag", TKV_GGUF_BOOL);
    rb_put(&b, "\x02", 1);
    CHECK_ERR(open_copy(b.p, b.n), TKV_ERR_FORMAT, "test.flag", "bool 2");
    rb_hdr(&b, 0, 1);
    rb_key(&b, "test.flags", TKV_GGUF_ARRAY);
    rb_u32(&b, TKV_GGUF_BOOL);
    rb_u64(&b, 3);
    rb_put(&b, "\x01\x00\xff", 3);
    CHECK_ERR(open_copy(b.p, b.n), TKV_ERR_FORMAT, "test.flags", "bool array element 255");

    rb_hdr(&b, 0, 3);
    rb_key(&b, "test.dup", TKV_GGUF_U32);
    rb_u32(&b, 1);
    rb_key(&b, "test.other", TKV_GGUF_U8);
    rb_put(&b, "\x01", 1);
    rb_key(&b, "test.dup", TKV_GGUF_STRING);
    rb_str(&b, "x");
    CHECK_ERR(open_copy(b.p, b.n), TKV_ERR_FORMAT, "duplicate key 'test.dup'", "duplicate key");

    /* general.alignment */
    uint32_t bad_align[] = {0, 3, 7, 4, 24, 0x80000001u};
    for (size_t i = 0; i < sizeof bad_align / sizeof bad_align[0]; i++) {
        rb_hdr(&b, 1, 1);
        rb_key(&b, "general.alignment", TKV_GGUF_U32);
        rb_u32(&b, bad_align[i]);
        rb_tensors(&b, &ta, 1, 32, 256);
        CHECK_ERR(open_copy(b.p, b.n), TKV_ERR_FORMAT, "general.alignment", "bad alignment value");
    }
    rb_hdr(&b, 1, 1);
    rb_key(&b, "general.alignment", TKV_GGUF_U64);
    rb_u64(&b, 32);
    rb_tensors(&b, &ta, 1, 32, 256);
    CHECK_ERR(open_copy(b.p, b.n), TKV_ERR_FORMAT, "general.alignment", "alignment as U64");
    rb_hdr(&b, 1, 1);
    rb_key(&b, "general.alignment", TKV_GGUF_STRING);
    rb_str(&b, "32");
    rb_tensors(&b, &ta, 1, 32, 256);
    CHECK_ERR(open_copy(b.p, b.n), TKV_ERR_FORMAT, "general.alignment", "alignment as string");
    {
        struct tinfo t2[2] = {ta, tb};
        t2[1].offset = 256; /* a multiple of 64 */
        rb_hdr(&b, 2, 1);
        rb_key(&b, "general.alignment", TKV_GGUF_U32);
        rb_u32(&b, 64);
        rb_tensors(&b, t2, 2, 64, 320);
        tkv_gguf *g = NULL;
        CHECK(tkv_gguf_open_memory(b.p, b.n, &g) == TKV_OK && tkv_gguf_alignment(g) == 64 &&
              tkv_gguf_find_tensor(g, "a")->file_offset % 64 == 0, "alignment 64: %s", tkv_last_error());
        tkv_gguf_close(g);
        t2[1].offset = 288; /* 32-aligned, not 64 */
        rb_hdr(&b, 2, 1);
        rb_key(&b, "general.alignment", TKV_GGUF_U32);
        rb_u32(&b, 64);
        rb_tensors(&b, t2, 2, 64, 384);
        CHECK_ERR(open_copy(b.p, b.n), TKV_ERR_FORMAT, "'b'", "offset misaligned for 64");
    }

    /* tensor infos */
    struct tinfo t;
#define TENSOR_CASE(which, field_assign, substr, label)                              \
    do {                                                                             \
        struct tinfo a_ = TA, b_ = TB;                                               \
        t = which == 0 ? a_ : b_;                                                    \
        field_assign;                                                                \
        two_tensors(&b, which == 0 ? t : a_, which == 0 ? b_ : t);                   \
        CHECK_ERR(open_copy(b.p, b.n), TKV_ERR_FORMAT, substr, label);               \
    } while (0)
    TENSOR_CASE(1, t.offset = 320, "'b'", "data past the end");
    TENSOR_CASE(1, t.offset = 1ull << 63, "'b'", "offset 2^63");
    TENSOR_CASE(1, t.offset = UINT64_MAX - 31, "'b'", "offset wraps");
    TENSOR_CASE(1, t.offset = 260, "'b'", "misaligned offset");
    TENSOR_CASE(1, t.offset = 224, "overlap", "overlapping data");
    TENSOR_CASE(1, t.offset = 0, "'a'", "same offset");
    TENSOR_CASE(1, t.type = 4, "unknown type id 4 in tensor b", "removed type id");
    TENSOR_CASE(1, t.type = 31, "unknown type id 31 in tensor b", "removed type id 31");
    TENSOR_CASE(1, t.type = 40, "unknown type id 40 in tensor b", "type id 40");
    TENSOR_CASE(1, t.type = 0xffffffffu, "in tensor b", "type id 2^32-1");
    TENSOR_CASE(1, t.ne[0] = 33, "'b'", "ne[0] not a multiple of the block");
    TENSOR_CASE(0, t.ne[1] = 0, "'a'", "ne 0");
    TENSOR_CASE(0, t.ne[1] = -1, "'a'", "ne negative");
    TENSOR_CASE(0, (t.ne[0] = 1ll << 32, t.ne[1] = 1ll << 32), "'a'", "ne product 2^64");
    TENSOR_CASE(0, (t.ne[0] = 1ll << 62, t.ne[1] = 2), "'a'", "ne product 2^63");
    TENSOR_CASE(0, (t.n_dims = 4, t.ne[0] = 1ll << 16, t.ne[1] = 1ll << 16, t.ne[2] = 1ll << 16, t.ne[3] = 1ll << 16),
                "'a'", "4-d product 2^64");
    TENSOR_CASE(0, t.ne[0] = 1ll << 61, "'a'", "byte size past the end");
    TENSOR_CASE(0, t.n_dims = 0, "'a'", "n_dims 0");
    TENSOR_CASE(0, (t.n_dims = 5, t.ne[2] = t.ne[3] = t.ne[4] = 1), "'a'", "n_dims 5");
    TENSOR_CASE(1, t.name = "a", "duplicate tensor name 'a'", "duplicate tensor name");
    TENSOR_CASE(1, t.name = "", "empty tensor name", "empty tensor name");
    static const char name65[] = "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx";
    static const char name64[] = "yyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyy";
    TENSOR_CASE(1, t.name = name65, name65, "name length 65");
    {
        struct tinfo a_ = TA, b_ = TB;
        b_.name = name64;
        two_tensors(&b, a_, b_);
        CHECK(open_copy(b.p, b.n) == TKV_OK, "name length 64: %s", tkv_last_error());
    }
#undef TENSOR_CASE

    /* A huge tensor_count with a plausible body: rejected before any allocation. */
    rb_hdr(&b, (1ull << 62) / 33, 0);
    rb_tensors(&b, &ta, 1, 32, 256);
    CHECK_ERR(open_copy(b.p, b.n), TKV_ERR_FORMAT, "tensor_count", "tensor_count 2^62/33");

    free(b.p);
}

// ---- (3) llama validation ----------------------------------------------------

/* Builds s, opens it and runs tkv_llama_from_gguf; returns its status. */
static tkv_status llama_status(const struct spec *s, struct tkv_llama *out_copy)
{
    size_t size = 0;
    void *img = build(s, &size);
    if (!img)
        return TKV_ERR_INTERNAL;
    tkv_gguf *g = NULL;
    tkv_status st = tkv_gguf_open_memory(img, size, &g);
    if (st == TKV_OK) {
        struct tkv_llama m;
        st = tkv_llama_from_gguf(g, &m);
        if (st == TKV_OK && out_copy) {
            *out_copy = m;
            out_copy->layers = NULL; /* pointers into g do not survive */
        }
        if (st == TKV_OK)
            tkv_llama_free(&m);
        else
            CHECK(m.layers == NULL && m.info.n_layer == 0, "failed load leaves *out zeroed");
        tkv_gguf_close(g);
    }
    free(img);
    free_blobs();
    return st;
}

static void test_llama(void)
{
    /* the valid model, tied and untied */
    struct spec s = base_spec();
    size_t size = 0;
    void *img = build(&s, &size);
    tkv_gguf *g = NULL;
    tkv_status st = img ? tkv_gguf_open_memory(img, size, &g) : TKV_ERR_INTERNAL;
    REQUIRE_VOID(st == TKV_OK);
    struct tkv_llama m;
    st = tkv_llama_from_gguf(g, &m);
    CHECK(st == TKV_OK, "valid tiny llama: %s", tkv_last_error());
    if (st == TKV_OK) {
        const struct tkv_model_info *in = &m.info;
        CHECK(strcmp(in->arch, "llama") == 0 && strcmp(in->name, "tiny llama") == 0, "names");
        CHECK(in->n_layer == 2 && in->n_embd == 64 && in->n_head == 4 && in->n_head_kv == 2 && in->head_dim == 16,
              "dims %u %u %u %u %u", in->n_layer, in->n_embd, in->n_head, in->n_head_kv, in->head_dim);
        CHECK(in->n_ff == 128 && in->n_vocab == 32 && in->n_ctx_train == 256 && in->rope_dim == 16, "more dims");
        CHECK(in->rope_base == 100000.0f && in->rope_scale == 1.0f && in->rms_eps == 1e-5f, "floats");
        CHECK(in->file_type == 7 && in->bos == 1 && in->eos == 2, "file_type/bos/eos");
        CHECK(strcmp(in->tokenizer, "gpt2") == 0 && strcmp(in->pretokenizer, "smollm") == 0, "tokenizer names");
        uint64_t n_params = 64 * 32 + 64 + 2 * (64 + 64 * 64 + 2 * 64 * 32 + 64 * 64 + 64 + 3 * 64 * 128);
        CHECK(in->n_params == n_params, "n_params %llu want %llu", (unsigned long long)in->n_params,
              (unsigned long long)n_params);
        CHECK(in->file_bytes == size, "file_bytes");
        CHECK(m.tied_output && m.output == m.tok_embd, "tied output");
        CHECK(strcmp(m.layers[1].w_down->name, "blk.1.ffn_down.weight") == 0 &&
              strcmp(m.layers[0].wk->name, "blk.0.attn_k.weight") == 0 &&
              strcmp(m.output_norm->name, "output_norm.weight") == 0, "tensor wiring");
        tkv_llama_free(&m);
        CHECK(m.layers == NULL, "free zeroes");
    }
    tkv_llama_free(NULL);
    tkv_gguf_close(g);
    free(img);
    free_blobs();

    struct tkv_llama info;
    s = base_spec();
    s.untied = true;
    CHECK(llama_status(&s, &info) == TKV_OK && !info.tied_output, "untied: %s", tkv_last_error());
    s = base_spec();
    s.rope_dim = 0;
    s.omit_key = "llama.rope.freq_base";
    s.n_tokens = -1;
    s.vocab_key = 32;
    CHECK(llama_status(&s, &info) == TKV_OK && info.info.rope_dim == 16 && info.info.rope_base == 10000.0f,
          "defaults: %s", tkv_last_error());
    s = base_spec();
    s.omit_key = "llama.attention.head_count_kv";
    s.n_head_kv = 4;
    CHECK(llama_status(&s, &info) == TKV_OK && info.info.n_head_kv == 4, "MHA default: %s", tkv_last_error());
    s = base_spec();
    s.omit_key = "tokenizer.ggml.bos_token_id";
    CHECK(llama_status(&s, &info) == TKV_OK && info.info.bos == -1 && info.info.eos == 2, "no bos");
    s = base_spec();
    s.rope_scaling = "linear";
    s.rope_factor = 4.0f;
    CHECK(llama_status(&s, &info) == TKV_OK && info.info.rope_scale == 0.25f, "linear rope: %s", tkv_last_error());
    s = base_spec();
    s.key_length = s.value_length = 32; /* head_dim from the keys, not n_embd / n_head */
    s.rope_dim = 32;
    CHECK(llama_status(&s, &info) == TKV_OK && info.info.head_dim == 32, "key_length: %s", tkv_last_error());
    s = base_spec(); /* every runnable weight type, K-quants on 256-wide rows */
    s.n_embd = 256, s.n_ff = 256, s.rope_dim = 0;
    s.retype = "blk.0.ffn_down.weight", s.retype_to = TKV_TYPE_Q6_K;
    CHECK(llama_status(&s, NULL) == TKV_OK, "Q6_K weight: %s", tkv_last_error());
    s.retype_to = TKV_TYPE_Q4_K;
    CHECK(llama_status(&s, NULL) == TKV_OK, "Q4_K weight: %s", tkv_last_error());

    /* failures, each naming what is wrong */
    s = base_spec();
    s.omit_tensor = "blk.1.ffn_up.weight";
    CHECK_ERR(llama_status(&s, NULL), TKV_ERR_FORMAT, "blk.1.ffn_up.weight", "missing tensor");
    s = base_spec();
    s.omit_tensor = "token_embd.weight";
    CHECK_ERR(llama_status(&s, NULL), TKV_ERR_FORMAT, "token_embd.weight", "missing token_embd");
    s = base_spec();
    s.omit_tensor = "output_norm.weight";
    CHECK_ERR(llama_status(&s, NULL), TKV_ERR_FORMAT, "output_norm.weight", "missing output_norm");
    s = base_spec();
    s.bad_shape = "blk.0.attn_k.weight";
    CHECK_ERR(llama_status(&s, NULL), TKV_ERR_FORMAT, "blk.0.attn_k.weight", "wrong shape");
    CHECK(strstr(tkv_last_error(), "[64, 33]") && strstr(tkv_last_error(), "[64, 32]"), "shapes in message: %s",
          tkv_last_error());
    s = base_spec();
    s.bad_shape = "blk.1.ffn_norm.weight";
    CHECK_ERR(llama_status(&s, NULL), TKV_ERR_FORMAT, "blk.1.ffn_norm.weight", "wrong norm shape");
    s = base_spec();
    s.untied = true;
    s.bad_shape = "output.weight";
    CHECK_ERR(llama_status(&s, NULL), TKV_ERR_FORMAT, "output.weight", "wrong output shape");
    s = base_spec();
    s.n_head_kv = 3;
    CHECK_ERR(llama_status(&s, NULL), TKV_ERR_FORMAT, "head_count_kv", "heads not dividing");
    s = base_spec();
    s.rope_dim = 32;
    CHECK_ERR(llama_status(&s, NULL), TKV_ERR_FORMAT, "llama.rope.dimension_count", "rope dim > head_dim");
    s = base_spec();
    s.rope_dim = 7;
    CHECK_ERR(llama_status(&s, NULL), TKV_ERR_FORMAT, "llama.rope.dimension_count", "odd rope dim");
    s = base_spec();
    s.n_tokens = 31;
    CHECK_ERR(llama_status(&s, NULL), TKV_ERR_FORMAT, "tokenizer.ggml.tokens", "token list shorter than vocab");
    s = base_spec();
    s.vocab_key = 33;
    CHECK_ERR(llama_status(&s, NULL), TKV_ERR_FORMAT, "llama.vocab_size", "vocab_size mismatch");
    s = base_spec();
    s.arch = "gpt2";
    CHECK_ERR(llama_status(&s, NULL), TKV_ERR_UNSUPPORTED, "'gpt2' is not supported", "non-llama arch");
    s = base_spec();
    s.omit_key = "general.architecture";
    CHECK_ERR(llama_status(&s, NULL), TKV_ERR_FORMAT, "general.architecture", "no arch");
    s = base_spec();
    s.n_ff = 256;
    s.retype = "blk.1.ffn_down.weight", s.retype_to = 13; /* Q5_K */
    CHECK_ERR(llama_status(&s, NULL), TKV_ERR_UNSUPPORTED, "unsupported type Q5_K in tensor blk.1.ffn_down.weight",
              "Q5_K weight");
    s = base_spec();
    s.retype = "blk.0.attn_q.weight", s.retype_to = 6; /* Q5_0 */
    CHECK_ERR(llama_status(&s, NULL), TKV_ERR_UNSUPPORTED, "Q5_0 in tensor blk.0.attn_q.weight", "Q5_0 weight");
    s = base_spec();
    s.retype = "blk.0.attn_norm.weight", s.retype_to = TKV_TYPE_F16;
    CHECK_ERR(llama_status(&s, NULL), TKV_ERR_UNSUPPORTED, "blk.0.attn_norm.weight", "F16 norm");
    s = base_spec();
    s.extra = "blk.2.attn_q.weight";
    CHECK_ERR(llama_status(&s, NULL), TKV_ERR_FORMAT, "blk.2.attn_q.weight", "extra tensor");
    s = base_spec();
    s.extra = "rope_freqs.weight";
    CHECK_ERR(llama_status(&s, NULL), TKV_ERR_UNSUPPORTED, "rope_freqs.weight", "llama3 rope factors");
    s = base_spec();
    s.omit_key = "llama.block_count";
    CHECK_ERR(llama_status(&s, NULL), TKV_ERR_FORMAT, "llama.block_count", "missing block_count");
    s = base_spec();
    s.n_layer = 0;
    CHECK_ERR(llama_status(&s, NULL), TKV_ERR_FORMAT, "llama.block_count", "block_count 0");
    s = base_spec();
    s.n_ctx = 0;
    CHECK_ERR(llama_status(&s, NULL), TKV_ERR_FORMAT, "llama.context_length", "context_length 0");
    s = base_spec();
    s.omit_key = "llama.attention.layer_norm_rms_epsilon";
    CHECK_ERR(llama_status(&s, NULL), TKV_ERR_FORMAT, "layer_norm_rms_epsilon", "missing eps");
    s = base_spec();
    s.rope_scaling = "yarn";
    s.rope_factor = 4.0f;
    CHECK_ERR(llama_status(&s, NULL), TKV_ERR_UNSUPPORTED, "yarn", "yarn rope");
    s = base_spec();
    s.key_length = 16, s.value_length = 32;
    CHECK_ERR(llama_status(&s, NULL), TKV_ERR_UNSUPPORTED, "value_length", "key_length != value_length");
    s = base_spec();
    s.bos = 32;
    CHECK_ERR(llama_status(&s, NULL), TKV_ERR_FORMAT, "bos_token_id", "bos out of range");
    s = base_spec();
    s.n_embd = 64, s.n_head = 64, s.n_head_kv = 64, s.rope_dim = 0; /* head_dim 1 */
    CHECK_ERR(llama_status(&s, NULL), TKV_ERR_FORMAT, "head_dim 1", "odd head_dim");
}

int main(void)
{
    rng = test_seed();
    test_round_trip();
    test_writer_args();
    test_truncation();
    test_hostile();
    test_llama();
    return test_done();
}
