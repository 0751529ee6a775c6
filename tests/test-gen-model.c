/*
 * test-gen-model.c -- synthetic models (runtime/gen-model.h, `tierkv
 * gen-model`) and the streaming GGUF writer under them:
 *   - shapes: presets and custom lists parse; bad ones fail with a message;
 *   - tiny and a small custom shape in f16, q8_0 and q4_0 load with our
 *     loader and run a prefill and greedy decode with finite logits of O(1)
 *     spread;
 *   - the same seed gives the same bytes with 1, 2 and 3 threads; another
 *     seed gives other bytes;
 *   - the streaming writer writes what the in-memory writer writes, in any
 *     chunking, and leaves nothing behind when it fails;
 *   - the CLI: clear one-line errors, exit 2 for bad usage and 1 for an
 *     unwritable path, no file left behind.
 */
#include "cpu/quant.h"
#include "runtime/gen-model.h"
#include "runtime/gguf.h"
#include "test.h"

#pragma GCC diagnostic ignored "-Wformat-truncation"

#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static char dir[256];

static const char *tmp_path(const char *name)
{
    static char buf[4][512];
    static int k;
    char *p = buf[k++ % 4];
    snprintf(p, sizeof buf[0], "%s/%s", dir, name);
    return p;
}

static bool exists(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0;
}

/* FNV-1a 64 of a whole file; 0 if unreadable. */
static uint64_t file_hash(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return 0;
    uint64_t h = 0xcbf29ce484222325ull;
    unsigned char buf[1 << 16];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, f)) > 0)
        for (size_t i = 0; i < n; i++)
            h = (h ^ buf[i]) * 0x100000001b3ull;
    fclose(f);
    return h;
}

static tkv_status gen(const char *spec, uint32_t type, uint64_t seed, uint32_t threads, const char *path)
{
    struct tkv_gen_params p = {.type = type, .seed = seed, .n_threads = threads};
    TKV_TRY(tkv_gen_shape_parse(spec, &p.shape));
    return tkv_gen_model(&p, path);
}

// ---- shapes ------------------------------------------------------------------

static void expect_bad_shape(const char *spec, const char *needle)
{
    struct tkv_gen_shape s;
    tkv_status st = tkv_gen_shape_parse(spec, &s);
    CHECK(st == TKV_ERR_INVALID_ARG, "'%s': status %d", spec, st);
    CHECK(strstr(tkv_last_error(), needle) != NULL, "'%s': message '%s' lacks '%s'", spec, tkv_last_error(), needle);
}

static void test_shapes(void)
{
    struct tkv_gen_shape s;
    CHECK(tkv_gen_shape_parse("llama3-8b", &s) == TKV_OK && s.n_layer == 32 && s.n_embd == 4096 && s.n_head == 32 &&
              s.n_head_kv == 8 && s.n_ff == 14336 && s.n_vocab == 128256 && s.rope_base == 500000.0f &&
              s.n_ctx == 131072,
          "llama3-8b: %s", tkv_last_error());
    CHECK(tkv_gen_shape_parse("qwen2.5-7b", &s) == TKV_OK && s.n_layer == 28 && s.n_embd == 3584 && s.n_head == 28 &&
              s.n_head_kv == 4 && s.n_ff == 18944 && s.n_vocab == 152064 && s.rope_base == 1e6f,
          "qwen2.5-7b: %s", tkv_last_error());
    CHECK(tkv_gen_shape_parse("tiny", &s) == TKV_OK, "tiny: %s", tkv_last_error());
    CHECK(tkv_gen_shape_parse("custom:3,128,4,1,256,600", &s) == TKV_OK && s.n_layer == 3 && s.n_embd == 128 &&
              s.n_head == 4 && s.n_head_kv == 1 && s.n_ff == 256 && s.n_vocab == 600 && !strcmp(s.name, "custom"),
          "custom: %s", tkv_last_error());
    /* both presets fit every type */
    for (int t = 0; t < 3; t++) {
        const uint32_t types[] = {TKV_TYPE_F16, TKV_TYPE_Q8_0, TKV_TYPE_Q4_0};
        tkv_gen_shape_parse("qwen2.5-7b", &s);
        CHECK(tkv_gen_shape_check(&s, types[t]) == TKV_OK, "qwen2.5-7b %u: %s", types[t], tkv_last_error());
        tkv_gen_shape_parse("llama3-8b", &s);
        CHECK(tkv_gen_shape_check(&s, types[t]) == TKV_OK, "llama3-8b %u: %s", types[t], tkv_last_error());
    }

    expect_bad_shape("llama3", "unknown shape 'llama3'");
    expect_bad_shape("", "unknown shape");
    expect_bad_shape("custom:", "bad custom shape");
    expect_bad_shape("custom:1,2,3", "bad custom shape");
    expect_bad_shape("custom:2,64,4,2,128", "bad custom shape");
    expect_bad_shape("custom:2,64,4,2,128,300,7", "bad custom shape");
    expect_bad_shape("custom:2,,4,2,128,300", "bad custom shape");
    expect_bad_shape("custom:2,64,4,2,128,x", "bad custom shape");
    expect_bad_shape("custom:-2,64,4,2,128,300", "bad custom shape");
    expect_bad_shape("custom: 2,64,4,2,128,300", "bad custom shape");
    expect_bad_shape("custom:2,64,4,2,128,99999999999", "bad custom shape");
    expect_bad_shape("custom:0,64,4,2,128,300", "layers (L) = 0");
    expect_bad_shape("custom:2,0,4,2,128,300", "embedding (E) = 0");
    expect_bad_shape("custom:2,64,0,2,128,300", "heads (H) = 0");
    expect_bad_shape("custom:2,64,4,0,128,300", "KV heads (HKV) = 0");
    expect_bad_shape("custom:2,64,4,2,0,300", "feed-forward (F) = 0");
    expect_bad_shape("custom:2,64,4,2,128,0", "vocabulary (V) = 0");
    expect_bad_shape("custom:2,64,4,2,128,257", "vocabulary (V) = 257");
    expect_bad_shape("custom:5000,64,4,2,128,300", "layers (L) = 5000");
    expect_bad_shape("custom:2,64,5,1,128,300", "E = 64 is not a multiple of the head count H = 5");
    expect_bad_shape("custom:2,64,4,3,128,300", "H = 4 is not a multiple of the KV head count HKV = 3");
    expect_bad_shape("custom:2,96,32,1,128,300", "head_dim E/H = 3 is odd");

    /* block sizes: E = 48 is fine for f16 but not for q4_0 rows */
    CHECK(tkv_gen_shape_parse("custom:2,48,4,2,128,300", &s) == TKV_OK, "E=48 f16: %s", tkv_last_error());
    CHECK(tkv_gen_shape_check(&s, TKV_TYPE_Q4_0) == TKV_ERR_INVALID_ARG &&
              strstr(tkv_last_error(), "multiples of 32"),
          "E=48 q4_0: %s", tkv_last_error());
    CHECK(tkv_gen_shape_check(&s, TKV_TYPE_Q4_1) == TKV_ERR_INVALID_ARG && strstr(tkv_last_error(), "not one of"),
          "q4_1: %s", tkv_last_error());
    CHECK(tkv_gen_shape_parse(NULL, &s) == TKV_ERR_INVALID_ARG, "NULL spec");
    CHECK(tkv_gen_model(NULL, "x") == TKV_ERR_INVALID_ARG, "NULL params");
}

// ---- generated models run ------------------------------------------------------

/* Loads path, checks the shape, prefills a text and decodes greedily: every
 * logit finite, spread O(1) (random weights: std ~1), nothing saturated. */
static void check_runs(const char *path, const char *spec, uint32_t type)
{
    struct tkv_gen_shape s;
    tkv_gen_shape_parse(spec, &s);
    tkv_model *m = NULL;
    tkv_status st = tkv_model_load(path, &m);
    CHECK(st == TKV_OK, "%s %s: load: %s", spec, tkv_type_name(type), tkv_last_error());
    if (st != TKV_OK)
        return;
    struct tkv_model_info in;
    tkv_model_get_info(m, &in);
    CHECK(in.n_layer == s.n_layer && in.n_embd == s.n_embd && in.n_head == s.n_head && in.n_head_kv == s.n_head_kv &&
              in.n_ff == s.n_ff && in.n_vocab == s.n_vocab && in.head_dim == s.n_embd / s.n_head,
          "%s: info shape", spec);
    CHECK(in.bos == (tkv_token)s.n_vocab - 2 && in.eos == (tkv_token)s.n_vocab - 1, "%s: bos %d eos %d", spec, in.bos,
          in.eos);
    CHECK(in.file_type == (type == TKV_TYPE_Q4_0 ? 2u : type == TKV_TYPE_Q8_0 ? 7u : 1u), "%s: file_type %u", spec,
          in.file_type);
    CHECK(!strcmp(in.tokenizer, "gpt2") && !strcmp(in.pretokenizer, "llama-bpe"), "%s: tokenizer %s/%s", spec,
          in.tokenizer, in.pretokenizer);

    tkv_token toks[128];
    size_t n = 0;
    st = tkv_tokenize(m, "hello world, the quick brown fox jumps", -1, TKV_TOK_ADD_BOS, toks, 128, &n);
    CHECK(st == TKV_OK && n > 2 && toks[0] == in.bos, "%s: tokenize: %s (n %zu)", spec, tkv_last_error(), n);
    /* the merges make multi-letter tokens: fewer tokens than bytes */
    CHECK(n < 38, "%s: %zu tokens (BOS included) for 38 bytes", spec, n);
    char text[256];
    size_t len;
    st = tkv_detokenize(m, toks + 1, n - 1, 0, text, sizeof text, &len);
    CHECK(st == TKV_OK && len == 38 && !memcmp(text, "hello world, the quick brown fox jumps", 38),
          "%s: detokenize round trip: '%.*s'", spec, (int)len, text);

    struct tkv_session_params sp = tkv_session_default_params();
    sp.n_ctx = 128;
    sp.n_threads = 2;
    tkv_session *ses = NULL;
    st = tkv_session_init(m, &sp, &ses);
    CHECK(st == TKV_OK, "%s: session: %s", spec, tkv_last_error());
    if (st == TKV_OK)
        st = tkv_prefill(ses, toks, n);
    CHECK(st == TKV_OK, "%s: prefill: %s", spec, tkv_last_error());
    for (int step = 0; step < 5 && st == TKV_OK; step++) {
        const float *lg = tkv_logits(ses);
        double sum = 0, sum2 = 0, mx = -1e30;
        bool finite = true;
        for (uint32_t i = 0; i < in.n_vocab; i++) {
            finite &= isfinite(lg[i]) != 0;
            sum += lg[i];
            sum2 += (double)lg[i] * lg[i];
            mx = lg[i] > mx ? lg[i] : mx;
        }
        double mean = sum / in.n_vocab, sd = sqrt(sum2 / in.n_vocab - mean * mean);
        CHECK(finite, "%s %s step %d: non-finite logits", spec, tkv_type_name(type), step);
        CHECK(sd > 0.3 && sd < 5 && fabs(mean) < 1 && mx - mean < 10, "%s %s step %d: logits mean %g std %g max %g",
              spec, tkv_type_name(type), step, mean, sd, mx);
        st = tkv_decode(ses, tkv_argmax(lg, in.n_vocab));
        CHECK(st == TKV_OK, "%s: decode: %s", spec, tkv_last_error());
    }
    tkv_session_free(ses);
    tkv_model_free(m);
}

static void test_models(void)
{
    const char *specs[] = {"tiny", "custom:3,128,4,1,256,600"};
    const uint32_t types[] = {TKV_TYPE_F16, TKV_TYPE_Q8_0, TKV_TYPE_Q4_0};
    for (int i = 0; i < 2; i++) {
        for (int t = 0; t < 3; t++) {
            const char *path = tmp_path("m.gguf");
            tkv_status st = gen(specs[i], types[t], 1234, 2, path);
            CHECK(st == TKV_OK, "%s %s: %s", specs[i], tkv_type_name(types[t]), tkv_last_error());
            if (st == TKV_OK)
                check_runs(path, specs[i], types[t]);
            unlink(path);
        }
    }
    /* f16 needs no blocks: E = 48 works there */
    const char *path = tmp_path("m48.gguf");
    CHECK(gen("custom:2,48,4,2,80,300", TKV_TYPE_F16, 5, 1, path) == TKV_OK, "E=48 f16: %s", tkv_last_error());
    check_runs(path, "custom:2,48,4,2,80,300", TKV_TYPE_F16);
    unlink(path);
}

// ---- determinism -------------------------------------------------------------

static void test_determinism(void)
{
    const char *specs[] = {"tiny", "custom:3,128,4,1,256,600"};
    for (int i = 0; i < 2; i++) {
        uint64_t h[4] = {0};
        const uint32_t threads[4] = {1, 2, 3, 2};
        const uint64_t seeds[4] = {42, 42, 42, 43};
        for (int k = 0; k < 4; k++) {
            const char *path = tmp_path("d.gguf");
            CHECK(gen(specs[i], TKV_TYPE_Q4_0, seeds[k], threads[k], path) == TKV_OK, "%s: %s", specs[i],
                  tkv_last_error());
            h[k] = file_hash(path);
            unlink(path);
        }
        CHECK(h[0] != 0 && h[0] == h[1] && h[0] == h[2], "%s: hashes differ across thread counts: %llx %llx %llx",
              specs[i], (unsigned long long)h[0], (unsigned long long)h[1], (unsigned long long)h[2]);
        CHECK(h[3] != h[0], "%s: seeds 42 and 43 give the same file", specs[i]);
    }
    /* the same seed in another type is the same model: f16 weights agree
     * with the q8_0 ones to q8_0 precision */
    const char *pf = tmp_path("f.gguf"), *pq = tmp_path("q.gguf");
    CHECK(gen("tiny", TKV_TYPE_F16, 9, 1, pf) == TKV_OK && gen("tiny", TKV_TYPE_Q8_0, 9, 2, pq) == TKV_OK, "gen: %s",
          tkv_last_error());
    tkv_gguf *gf = NULL, *gq = NULL;
    CHECK(tkv_gguf_open(pf, &gf) == TKV_OK && tkv_gguf_open(pq, &gq) == TKV_OK, "open: %s", tkv_last_error());
    if (gf && gq) {
        const struct tkv_gguf_tensor *tf = tkv_gguf_find_tensor(gf, "blk.1.ffn_down.weight");
        const struct tkv_gguf_tensor *tq = tkv_gguf_find_tensor(gq, "blk.1.ffn_down.weight");
        REQUIRE_VOID(tf && tq && tf->n_elems == tq->n_elems);
        int64_t n0 = tf->ne[0];
        float *a = malloc(n0 * sizeof *a), *b = malloc(n0 * sizeof *b);
        double err = 0, ref = 0;
        for (int64_t r = 0; r < tf->ne[1]; r++) {
            tkv_dequant_row_ref(TKV_TYPE_F16, (const uint8_t *)tf->data + r * n0 * 2, a, n0);
            tkv_dequant_row_ref(TKV_TYPE_Q8_0, (const uint8_t *)tq->data + r * (n0 / 32 * 34), b, n0);
            for (int64_t j = 0; j < n0; j++) {
                err += (a[j] - b[j]) * (a[j] - b[j]);
                ref += a[j] * a[j];
            }
        }
        CHECK(ref > 0 && sqrt(err / ref) < 0.01, "f16 vs q8_0 weights: relative error %g", sqrt(err / ref));
        /* scale: ffn_down is 1/sqrt(F)/sqrt(2L) */
        double want = 1.0 / sqrt(192.0) / 2.0, have = sqrt(ref / (double)tf->n_elems);
        CHECK(fabs(have / want - 1) < 0.05, "ffn_down rms %g, expected %g", have, want);
        free(a);
        free(b);
    }
    tkv_gguf_close(gf);
    tkv_gguf_close(gq);
    unlink(pf);
    unlink(pq);
}

// ---- streaming writer ----------------------------------------------------------

/* Three tensors of different types and shapes, data from a formula. */
static const int64_t st_ne[3][2] = {{64, 7}, {96, 5}, {33, 1}};
static const uint32_t st_type[3] = {TKV_TYPE_Q8_0, TKV_TYPE_F16, TKV_TYPE_F32};

static size_t st_row_bytes(int i)
{
    const struct tkv_type_traits *tr = tkv_type_traits(st_type[i]);
    return (size_t)st_ne[i][0] / tr->block_elems * tr->block_bytes;
}

static void st_row(int i, uint64_t r, void *dst)
{
    float x[128];
    for (int64_t j = 0; j < st_ne[i][0]; j++)
        x[j] = (float)(i + 1) * 0.01f * (float)((int64_t)(r * 31 + j * 7) % 23 - 11);
    tkv_quantize_row(st_type[i], x, dst, st_ne[i][0]);
}

struct st_ctx {
    int calls, fail_at;
    uint64_t max_bytes;
};

static tkv_status st_fill(void *user, size_t i, uint64_t row0, uint64_t n_rows, void *buf)
{
    struct st_ctx *c = user;
    if (++c->calls == c->fail_at)
        return tkv_err(TKV_ERR_CANCELLED, "test: fail at call %d", c->calls);
    uint64_t bytes = n_rows * st_row_bytes((int)i);
    c->max_bytes = bytes > c->max_bytes ? bytes : c->max_bytes;
    for (uint64_t r = 0; r < n_rows; r++)
        st_row((int)i, row0 + r, (uint8_t *)buf + r * st_row_bytes((int)i));
    return TKV_OK;
}

static void test_stream_writer(void)
{
    static uint8_t data[3][8192];
    tkv_gguf_writer *w;
    REQUIRE_VOID(tkv_gguf_writer_init(&w) == TKV_OK);
    tkv_gguf_add_str(w, "general.architecture", "test");
    tkv_gguf_add_u32(w, "x.count", 3);
    const char *names[3] = {"a", "bb", "ccc"};
    for (int i = 0; i < 3; i++) {
        for (int64_t r = 0; r < st_ne[i][1]; r++)
            st_row(i, (uint64_t)r, data[i] + r * st_row_bytes(i));
        CHECK(tkv_gguf_add_tensor(w, names[i], st_type[i], st_ne[i][1] > 1 ? 2 : 1, st_ne[i], data[i]) == TKV_OK,
              "add %s: %s", names[i], tkv_last_error());
    }
    void *mem;
    size_t size;
    REQUIRE_VOID(tkv_gguf_write_mem(w, &mem, &size) == TKV_OK);

    /* chunks of 1 byte (one row per call), 2 rows, 500 bytes, everything */
    const size_t chunks[] = {1, 2 * 68, 500, 1 << 20};
    const char *path = tmp_path("s.gguf");
    for (int k = 0; k < 4; k++) {
        struct st_ctx c = {0};
        tkv_status st = tkv_gguf_write_file_stream(w, path, chunks[k], st_fill, &c);
        CHECK(st == TKV_OK, "stream chunk %zu: %s", chunks[k], tkv_last_error());
        CHECK(c.max_bytes <= (chunks[k] < 192 ? 192 : chunks[k]), "chunk %zu: a call filled %llu bytes", chunks[k],
              (unsigned long long)c.max_bytes);
        FILE *f = fopen(path, "rb");
        uint8_t *got = malloc(size + 1);
        size_t n = f ? fread(got, 1, size + 1, f) : 0;
        if (f)
            fclose(f);
        CHECK(n == size && !memcmp(got, mem, size), "chunk %zu: streamed file (%zu bytes) differs from write_mem "
              "(%zu bytes)", chunks[k], n, size);
        free(got);
        tkv_gguf *g = NULL;
        CHECK(tkv_gguf_open(path, &g) == TKV_OK && tkv_gguf_n_tensors(g) == 3, "reopen: %s", tkv_last_error());
        tkv_gguf_close(g);
    }

    /* a failing producer: its status comes back, nothing at the path, and
     * an existing file there is left as it was */
    unlink(path);
    struct st_ctx c = {.fail_at = 3};
    tkv_status st = tkv_gguf_write_file_stream(w, path, 1, st_fill, &c);
    CHECK(st == TKV_ERR_CANCELLED && strstr(tkv_last_error(), "fail at call 3"), "fail: %d %s", st, tkv_last_error());
    CHECK(!exists(path), "a failed write left %s", path);
    char tmp[600];
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
    CHECK(!exists(tmp), "a failed write left %s", tmp);
    FILE *f = fopen(path, "wb");
    fputs("old", f);
    fclose(f);
    c = (struct st_ctx){.fail_at = 5};
    CHECK(tkv_gguf_write_file_stream(w, path, 1, st_fill, &c) == TKV_ERR_CANCELLED, "fail 2");
    char old[8] = {0};
    f = fopen(path, "rb");
    CHECK(f && fread(old, 1, sizeof old, f) == 3 && !strcmp(old, "old"), "existing file changed: '%s'", old);
    if (f)
        fclose(f);
    unlink(path);

    /* unwritable places */
    st = tkv_gguf_write_file_stream(w, "/nonexistent-dir/s.gguf", 1, st_fill, &c);
    CHECK(st == TKV_ERR_IO && strstr(tkv_last_error(), "/nonexistent-dir/s.gguf"), "bad dir: %d %s", st,
          tkv_last_error());
    CHECK(tkv_gguf_write_file_stream(w, path, 1, NULL, NULL) == TKV_ERR_INVALID_ARG, "NULL fn");
    free(mem);
    tkv_gguf_writer_free(w);

    struct tkv_gen_params p = {.type = TKV_TYPE_Q4_0, .seed = 1, .n_threads = 1};
    tkv_gen_shape_parse("tiny", &p.shape);
    st = tkv_gen_model(&p, "/nonexistent-dir/m.gguf");
    CHECK(st == TKV_ERR_IO && strstr(tkv_last_error(), "/nonexistent-dir/m.gguf"), "gen bad dir: %d %s", st,
          tkv_last_error());
}

// ---- the CLI -----------------------------------------------------------------

static char tierkv[4096];

struct result {
    int status;
    char out[4096], err[4096];
};

static void slurp(const char *path, char *buf, size_t cap)
{
    FILE *f = fopen(path, "rb");
    size_t n = f ? fread(buf, 1, cap - 1, f) : 0;
    buf[n] = 0;
    if (f)
        fclose(f);
    unlink(path);
}

static void run(struct result *r, const char *args)
{
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "%s %s >%s 2>%s </dev/null", tierkv, args, tmp_path("out"), tmp_path("err"));
    int st = system(cmd);
    r->status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
    slurp(tmp_path("out"), r->out, sizeof r->out);
    slurp(tmp_path("err"), r->err, sizeof r->err);
}

static void expect_cli_error(const char *args, int status, const char *needle)
{
    struct result r;
    char full[4096];
    snprintf(full, sizeof full, "gen-model %s", args);
    run(&r, full);
    int lines = 0;
    for (const char *s = r.err; *s; s++)
        lines += *s == '\n';
    CHECK(r.status == status, "'%s': exit %d, expected %d (%s)", full, r.status, status, r.err);
    CHECK(lines == 1 && strstr(r.err, needle), "'%s': stderr should be one line with '%s': %s", full, needle, r.err);
    CHECK(r.out[0] == 0, "'%s': stdout: %s", full, r.out);
    CHECK(!exists(tmp_path("cli.gguf")), "'%s' left a file", full);
}

static void test_cli(void)
{
    const char *bd = getenv("TKV_BUILD_DIR");
    snprintf(tierkv, sizeof tierkv, "%s/tierkv", bd ? bd : ".");
    if (access(tierkv, X_OK) != 0) {
        fprintf(stderr, "tierkv binary not found at %s: skipping the CLI checks\n", tierkv);
        return;
    }
    char out[512], args[2048];
    snprintf(out, sizeof out, "%s", tmp_path("cli.gguf"));
    struct result r;
    snprintf(args, sizeof args, "gen-model --shape tiny --type q8_0 --seed 3 --ctx 512 -t 2 --out %s", out);
    run(&r, args);
    CHECK(r.status == 0 && r.out[0] == 0 && strstr(r.err, "wrote"), "gen-model: exit %d out '%s' err '%s'", r.status,
          r.out, r.err);
    snprintf(args, sizeof args, "info -m %s", out);
    run(&r, args);
    CHECK(r.status == 0 && strstr(r.out, "context       512 tokens") && strstr(r.out, "valid         yes"),
          "info: %d %s", r.status, r.out);
    snprintf(args, sizeof args, "run -m %s -p 'hello there' -n 4 --temp 0 -t 1", out);
    run(&r, args);
    CHECK(r.status == 0, "run: %d %s", r.status, r.err);
    unlink(out);

    run(&r, "gen-model --help");
    CHECK(r.status == 0 && strstr(r.out, "--shape"), "--help: %d", r.status);

#define OUT_ARG " --out %s"
    const struct { const char *args; int status; const char *needle; } bad[] = {
        {"--shape llama3 --type q4_0" OUT_ARG, 2, "unknown shape 'llama3'"},
        {"--shape custom:1,2,3 --type q4_0" OUT_ARG, 2, "bad custom shape"},
        {"--shape custom:2,64,4,2,128,abc --type q4_0" OUT_ARG, 2, "bad custom shape"},
        {"--shape custom:0,64,4,2,128,300 --type q4_0" OUT_ARG, 2, "layers (L) = 0"},
        {"--shape custom:2,64,4,2,0,300 --type q4_0" OUT_ARG, 2, "feed-forward (F) = 0"},
        {"--shape custom:2,64,5,1,128,300 --type q4_0" OUT_ARG, 2, "not a multiple of the head count"},
        {"--shape custom:2,48,4,2,128,300 --type q4_0" OUT_ARG, 2, "multiples of 32"},
        {"--shape tiny --type q5_0" OUT_ARG, 2, "unknown type 'q5_0'"},
        {"--shape tiny --type q4_0 --seed -1" OUT_ARG, 2, "--seed"},
        {"--shape tiny --type q4_0 -t 0" OUT_ARG, 2, "-t expects"},
        {"--shape tiny --type q4_0 --ctx 0" OUT_ARG, 2, "--ctx"},
        {"--shape tiny --type q4_0 --bogus 1" OUT_ARG, 2, "unknown option '--bogus'"},
        {"--type q4_0" OUT_ARG, 2, "no shape"},
        {"--shape tiny" OUT_ARG, 2, "no type"},
        {"--shape tiny --type q4_0 --out", 2, "needs a value"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        snprintf(args, sizeof args, bad[i].args, out);
        expect_cli_error(args, bad[i].status, bad[i].needle);
    }
    expect_cli_error("--shape tiny --type q4_0", 2, "no output file");
    expect_cli_error("--shape tiny --type q4_0 --out /nonexistent-dir/x.gguf", 1, "/nonexistent-dir/x.gguf");
    snprintf(args, sizeof args, "--shape tiny --type q4_0 --out %s", dir);
    expect_cli_error(args, 1, "is a directory");
    CHECK(!exists("/nonexistent-dir/x.gguf"), "?");
}

int main(void)
{
    snprintf(dir, sizeof dir, "/tmp/tkv-gen-model-XXXXXX");
    REQUIRE(mkdtemp(dir) != NULL, "mkdtemp");
    tkv_set_log(NULL, NULL, TKV_LOG_ERROR);
    test_shapes();
    test_models();
    test_determinism();
    test_stream_writer();
    test_cli();
    rmdir(dir); /* fails (and says so below) if a test left a file behind */
    CHECK(!exists(dir), "files left in %s", dir);
    return test_done();
}
