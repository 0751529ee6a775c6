/*
 * gen-model.c -- synthetic Llama models (see gen-model.h, docs/gen-model.md).
 *
 * Weights. Every matrix row is drawn from a counter-based generator keyed by
 * (seed, tensor name, row): element i is the sum of the four 16-bit lanes of
 * mix64(key + (i+1)*golden), centred -- an Irwin-Hall(4) variate, a close
 * approximation of a normal one, bounded at 3.46 sigma -- times one float
 * scale. Integer arithmetic and a single rounding make the values identical
 * for any thread count and any compiler contraction setting. Scales:
 *     token_embd          sigma 0.02                      (small, as trained models)
 *     attn_q, attn_k,     1/sqrt(E)                       (q, k, v entries ~ N(0, 1);
 *       attn_v                                             scores q.k/sqrt(d) ~ N(0, 1))
 *     ffn_gate, ffn_up    1/sqrt(E)
 *     attn_output         1/sqrt(E) / sqrt(2L)            (GPT-2's residual scaling: the
 *     ffn_down            1/sqrt(F) / sqrt(2L)             2L residual updates add up to O(1))
 *     output              1/sqrt(E)                       (logits ~ N(0, 1))
 *     norms (F32)         1 + 0.02 * z
 * Matrices use the requested type (output and token_embd included), norms
 * F32, as llama.cpp's own converters do.
 *
 * Vocabulary (V tokens): ids 0..255 are the bytes in GPT-2's bytes_to_unicode
 * form; ids 256..V-3 come from merges built breadth-first over lowercase
 * letters ("Ġ a", "a a", ..., then "<level-k token> <letter>"), so every
 * merge joins two existing tokens and produces a new, unique one; V-2 and
 * V-1 are the control tokens <|begin_of_text|> (BOS) and <|end_of_text|>
 * (EOS). It depends on V only, not on the seed.
 *
 * The quantizers come from cpu/quant.h (llama.cpp's reference rounding) and
 * the parallel loop from cpu/threadpool.h: format code, not backend state.
 */
#include "gen-model.h"

#include "../cpu/quant.h"
#include "../cpu/threadpool.h"
#include "gguf.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#define GEN_CHUNK_BYTES  ((size_t)64 << 20) /* rows produced per writer call  */
#define GEN_MIN_VOCAB    258u               /* 256 bytes + BOS + EOS          */
#define GEN_MAX_LAYERS   4096u              /* model.c's limits               */
#define GEN_MAX_DIM      (1u << 20)
#define GEN_VERSION      1                  /* bump when the bytes change     */
#define GEN_MIN_PARALLEL (1u << 14)         /* elements worth the thread pool */

/* Irwin-Hall(4) of 16-bit lanes: mean 4 * 32767.5, sigma sqrt(4 (2^32 - 1) / 12). */
#define GEN_IH_MEAN  131070
#define GEN_IH_SIGMA 37837.2262

static const struct tkv_gen_shape gen_presets[] = {
    /* name          L   E     H   HKV  F      V       ctx     rope base  eps  */
    {"llama3-8b",  32, 4096, 32,  8, 14336, 128256, 131072, 500000.0f, 1e-5f},
    {"qwen2.5-7b", 28, 3584, 28,  4, 18944, 152064,  32768, 1000000.0f, 1e-6f},
    {"tiny",        2,   64,  4,  2,   192,    512,   2048,  10000.0f, 1e-5f},
};

// ---- shapes ----------------------------------------------------------------

tkv_status tkv_gen_shape_check(const struct tkv_gen_shape *s, uint32_t type)
{
    if (!s)
        return tkv_err(TKV_ERR_INVALID_ARG, "gen-model: NULL shape");
    if (type != TKV_TYPE_F16 && type != TKV_TYPE_Q8_0 && type != TKV_TYPE_Q4_0)
        return tkv_err(TKV_ERR_INVALID_ARG, "gen-model: type %s is not one of f16, q8_0, q4_0", tkv_type_name(type));
    const struct { const char *what; uint32_t v, max; } dims[] = {
        {"layers (L)", s->n_layer, GEN_MAX_LAYERS}, {"embedding (E)", s->n_embd, GEN_MAX_DIM},
        {"heads (H)", s->n_head, GEN_MAX_DIM},      {"KV heads (HKV)", s->n_head_kv, GEN_MAX_DIM},
        {"feed-forward (F)", s->n_ff, GEN_MAX_DIM}, {"context", s->n_ctx, UINT32_MAX},
    };
    for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++)
        if (dims[i].v < 1 || dims[i].v > dims[i].max)
            return tkv_err(TKV_ERR_INVALID_ARG, "gen-model: %s = %u is out of range [1, %u]", dims[i].what,
                           dims[i].v, dims[i].max);
    if (s->n_vocab < GEN_MIN_VOCAB || s->n_vocab > INT32_MAX)
        return tkv_err(TKV_ERR_INVALID_ARG, "gen-model: vocabulary (V) = %u is out of range [%u, %d] (256 bytes + "
                       "BOS + EOS at least)", s->n_vocab, GEN_MIN_VOCAB, INT32_MAX);
    if (s->n_embd % s->n_head)
        return tkv_err(TKV_ERR_INVALID_ARG, "gen-model: embedding E = %u is not a multiple of the head count H = %u",
                       s->n_embd, s->n_head);
    if (s->n_head % s->n_head_kv)
        return tkv_err(TKV_ERR_INVALID_ARG, "gen-model: head count H = %u is not a multiple of the KV head count "
                       "HKV = %u", s->n_head, s->n_head_kv);
    if ((s->n_embd / s->n_head) % 2)
        return tkv_err(TKV_ERR_INVALID_ARG, "gen-model: head_dim E/H = %u is odd (rope rotates pairs)",
                       s->n_embd / s->n_head);
    const uint32_t blk = tkv_type_traits(type)->block_elems;
    if (s->n_embd % blk || s->n_ff % blk)
        return tkv_err(TKV_ERR_INVALID_ARG, "gen-model: %s rows need E and F to be multiples of %u (E = %u, F = %u)",
                       tkv_type_name(type), blk, s->n_embd, s->n_ff);
    if (!isfinite(s->rope_base) || s->rope_base <= 0.0f || !isfinite(s->rms_eps) || s->rms_eps <= 0.0f ||
        s->rms_eps > 1.0f)
        return tkv_err(TKV_ERR_INVALID_ARG, "gen-model: rope base %g / rms eps %g out of range",
                       (double)s->rope_base, (double)s->rms_eps);
    return TKV_OK;
}

/* One decimal u32 field of a custom list ending at ',' (or the end for the
 * last); advances *p past the separator. */
static bool parse_field(const char **p, bool last, uint32_t *out)
{
    const char *s = *p;
    uint64_t v = 0;
    if (*s < '0' || *s > '9')
        return false;
    for (; *s >= '0' && *s <= '9'; s++)
        if ((v = v * 10 + (uint64_t)(*s - '0')) > UINT32_MAX)
            return false;
    if (last ? *s != '\0' : *s != ',')
        return false;
    *out = (uint32_t)v;
    *p = last ? s : s + 1;
    return true;
}

tkv_status tkv_gen_shape_parse(const char *spec, struct tkv_gen_shape *out)
{
    if (!spec || !out)
        return tkv_err(TKV_ERR_INVALID_ARG, "gen-model: NULL shape argument");
    for (size_t i = 0; i < sizeof gen_presets / sizeof gen_presets[0]; i++) {
        if (strcmp(spec, gen_presets[i].name) == 0) {
            *out = gen_presets[i];
            return tkv_gen_shape_check(out, TKV_TYPE_F16);
        }
    }
    if (strncmp(spec, "custom:", 7) != 0)
        return tkv_err(TKV_ERR_INVALID_ARG, "gen-model: unknown shape '%.64s' (expected llama3-8b, qwen2.5-7b, tiny "
                       "or custom:L,E,H,HKV,F,V)", spec);
    struct tkv_gen_shape s = {.name = "custom", .n_ctx = 4096, .rope_base = 10000.0f, .rms_eps = 1e-5f};
    uint32_t *fields[] = {&s.n_layer, &s.n_embd, &s.n_head, &s.n_head_kv, &s.n_ff, &s.n_vocab};
    const char *p = spec + 7;
    for (int i = 0; i < 6; i++)
        if (!parse_field(&p, i == 5, fields[i]))
            return tkv_err(TKV_ERR_INVALID_ARG, "gen-model: bad custom shape '%.64s': expected custom:L,E,H,HKV,F,V "
                           "with six decimal numbers (e.g. custom:2,256,4,2,512,1024)", spec);
    TKV_TRY(tkv_gen_shape_check(&s, TKV_TYPE_F16));
    *out = s;
    return TKV_OK;
}

// ---- random rows -----------------------------------------------------------

static inline uint64_t mix64(uint64_t z) /* splitmix64's finalizer */
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t fnv1a(const char *s)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (; *s; s++)
        h = (h ^ (uint8_t)*s) * 0x100000001b3ull;
    return h;
}

/* x[i] = (bias + IH4(mix64(key + (i+1) * golden))) * scale, i < n. */
static void gen_row(uint64_t key, int32_t bias, float scale, float *x, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        uint64_t r = mix64(key + (uint64_t)(i + 1) * 0x9e3779b97f4a7c15ull);
        int32_t z = (int32_t)((r & 0xffff) + ((r >> 16) & 0xffff) + ((r >> 32) & 0xffff) + (r >> 48)) - GEN_IH_MEAN;
        x[i] = (float)(bias + z) * scale;
    }
}

// ---- the model's tensors ---------------------------------------------------

struct gen_tensor {
    char     name[TKV_GGUF_MAX_NAME + 1];
    uint32_t type;
    int64_t  ne0, ne1;      /* row length, rows                               */
    uint64_t key;           /* mix of seed and name                           */
    int32_t  bias;          /* added before scaling (norms: 1/0.02 sigmas)    */
    float    scale;         /* per unit of the integer variate                */
    size_t   row_bytes;
};

struct gen {
    const struct tkv_gen_params *p;
    struct gen_tensor *t;   /* [n_t] in file order                            */
    size_t n_t;
    struct tkv_pool *pool;
    float *scratch;         /* [n_threads][max_ne0]                           */
    int64_t max_ne0;
    uint64_t done, total;   /* data bytes, for progress                       */
    /* the chunk being filled (set before each pool run) */
    const struct gen_tensor *cur;
    uint64_t row0, n_rows;
    uint8_t *buf;
};

static void add_t(struct gen *g, const char *name, uint32_t type, int64_t ne0, int64_t ne1, double sigma, bool norm)
{
    struct gen_tensor *t = &g->t[g->n_t++];
    snprintf(t->name, sizeof t->name, "%s", name);
    t->type = type;
    t->ne0 = ne0;
    t->ne1 = ne1;
    t->key = mix64(g->p->seed ^ mix64(fnv1a(name)));
    /* norms: 1 + sigma*z/IH_SIGMA = (ONE + z) / ONE with ONE = IH_SIGMA/sigma */
    t->bias = norm ? (int32_t)lround(GEN_IH_SIGMA / sigma) : 0;
    t->scale = norm ? (float)(1.0 / t->bias) : (float)(sigma / GEN_IH_SIGMA);
    const struct tkv_type_traits *tr = tkv_type_traits(type);
    t->row_bytes = (size_t)ne0 / tr->block_elems * tr->block_bytes;
    g->total += t->row_bytes * (uint64_t)ne1;
    g->max_ne0 = TKV_MAX(g->max_ne0, ne0);
}

/* The tensor list in file order: token_embd, the blocks, output_norm, output. */
static void plan_tensors(struct gen *g)
{
    const struct tkv_gen_shape *s = &g->p->shape;
    const uint32_t ty = g->p->type, L = s->n_layer;
    const int64_t E = s->n_embd, F = s->n_ff, V = s->n_vocab, KV = (int64_t)s->n_head_kv * (E / s->n_head);
    const double in_e = 1.0 / sqrt((double)E), in_f = 1.0 / sqrt((double)F), res = 1.0 / sqrt(2.0 * L);
    char name[TKV_GGUF_MAX_NAME + 1];
    add_t(g, "token_embd.weight", ty, E, V, 0.02, false);
    for (uint32_t l = 0; l < L; l++) {
#define BLK(suffix, type, ne0, ne1, sigma, norm)                         \
        snprintf(name, sizeof name, "blk.%u." suffix ".weight", l);      \
        add_t(g, name, type, ne0, ne1, sigma, norm)
        BLK("attn_norm", TKV_TYPE_F32, E, 1, 0.02, true);
        BLK("attn_q", ty, E, E, in_e, false);
        BLK("attn_k", ty, E, KV, in_e, false);
        BLK("attn_v", ty, E, KV, in_e, false);
        BLK("attn_output", ty, E, E, in_e * res, false);
        BLK("ffn_norm", TKV_TYPE_F32, E, 1, 0.02, true);
        BLK("ffn_gate", ty, E, F, in_e, false);
        BLK("ffn_up", ty, E, F, in_e, false);
        BLK("ffn_down", ty, F, E, in_f * res, false);
#undef BLK
    }
    add_t(g, "output_norm.weight", TKV_TYPE_F32, E, 1, 0.02, true);
    add_t(g, "output.weight", ty, E, V, in_e, false);
}

/* Pool job: this thread's share of the current chunk's rows. */
static void fill_job(void *ctx, uint32_t ith, uint32_t nth)
{
    struct gen *g = ctx;
    const struct gen_tensor *t = g->cur;
    float *x = g->scratch + (size_t)ith * (size_t)g->max_ne0;
    uint64_t a, b;
    tkv_split(g->n_rows, ith, nth, &a, &b);
    for (uint64_t r = a; r < b; r++) {
        gen_row(mix64(t->key + g->row0 + r), t->bias, t->scale, x, t->ne0);
        tkv_quantize_row(t->type, x, g->buf + r * t->row_bytes, t->ne0); /* type checked up front */
    }
}

/* tkv_gguf_rows_fn: rows [row0, row0 + n_rows) of tensor i. */
static tkv_status fill_rows(void *user, size_t i, uint64_t row0, uint64_t n_rows, void *buf)
{
    struct gen *g = user;
    if (i >= g->n_t)
        return tkv_err(TKV_ERR_INTERNAL, "gen-model: writer asked for tensor %zu of %zu", i, g->n_t);
    g->cur = &g->t[i];
    g->row0 = row0;
    g->n_rows = n_rows;
    g->buf = buf;
    if (n_rows * (uint64_t)g->cur->ne0 < GEN_MIN_PARALLEL)
        fill_job(g, 0, 1); /* waking the pool costs more than this */
    else
        tkv_pool_run(g->pool, fill_job, g);
    g->done += n_rows * g->cur->row_bytes;
    if (g->p->progress)
        g->p->progress(g->done, g->total, g->p->progress_user);
    return TKV_OK;
}

// ---- vocabulary ------------------------------------------------------------

/* GPT-2 bytes_to_unicode: printable Latin-1 bytes map to themselves, the
 * other 68 to U+0100.. in byte order. ref: openai/gpt-2 src/encoder.py */
static uint32_t byte_to_cp(uint32_t b)
{
    if ((b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff))
        return b;
    uint32_t n = 0;
    for (uint32_t c = 0; c < b; c++)
        n += !((c >= 0x21 && c <= 0x7e) || (c >= 0xa1 && c <= 0xac) || (c >= 0xae && c <= 0xff));
    return 256 + n;
}

/* Appends the UTF-8 of cp (< 0x800 here) at *p. */
static void put_cp(char **p, uint32_t cp)
{
    if (cp < 0x80) {
        *(*p)++ = (char)cp;
    } else {
        *(*p)++ = (char)(0xc0 | (cp >> 6));
        *(*p)++ = (char)(0x80 | (cp & 0x3f));
    }
}

struct vocab {
    char  *blob;            /* all strings, NUL-terminated                    */
    const char **tokens;    /* [V]                                            */
    const char **merges;    /* [V - 258]                                      */
    int32_t *types;         /* [V]: 1 normal, 3 control                       */
};

static void vocab_free(struct vocab *v)
{
    free(v->blob);
    free(v->tokens);
    free(v->merges);
    free(v->types);
}

/* Merge j (0-based) joins parent(j) and a letter: the first 27*26 merges
 * join "Ġ" or a letter with a letter, merge j >= 702 extends merge
 * (j - 702) / 26 by a letter. Token 256 + j is the result. */
static tkv_status vocab_build(uint32_t V, struct vocab *v)
{
    const uint32_t n_merge = V - GEN_MIN_VOCAB;
    /* a merge token has at most depth+2 characters of 2 UTF-8 bytes; depth
     * grows by one per factor 26, so 32 bytes per string is plenty */
    const size_t per = 32;
    v->blob = malloc((size_t)V * 2 * per);
    v->tokens = malloc((size_t)V * sizeof *v->tokens);
    v->merges = malloc(((size_t)n_merge + 1) * sizeof *v->merges);
    v->types = malloc((size_t)V * sizeof *v->types);
    if (!v->blob || !v->tokens || !v->merges || !v->types)
        return tkv_err(TKV_ERR_NOMEM, "gen-model: no memory for a vocabulary of %u tokens", V);
    char *p = v->blob;
    for (uint32_t b = 0; b < 256; b++) {
        v->tokens[b] = p;
        put_cp(&p, byte_to_cp(b));
        *p++ = 0;
    }
    for (uint32_t j = 0; j < n_merge; j++) {
        const char *first;
        char letter = (char)('a' + j % 26);
        if (j < 27 * 26)
            first = j / 26 == 0 ? v->tokens[' '] : v->tokens['a' + j / 26 - 1]; /* "Ġ" is the space byte */
        else
            first = v->tokens[256 + (j - 27 * 26) / 26];
        size_t lf = strlen(first);
        if (lf + 2 >= per)
            return tkv_err(TKV_ERR_INTERNAL, "gen-model: merge %u is too long", j);
        v->merges[j] = p;
        memcpy(p, first, lf);
        p[lf] = ' ';
        p[lf + 1] = letter;
        p[lf + 2] = 0;
        p += lf + 3;
        v->tokens[256 + j] = p;
        memcpy(p, first, lf);
        p[lf] = letter;
        p[lf + 1] = 0;
        p += lf + 2;
    }
    v->tokens[V - 2] = "<|begin_of_text|>";
    v->tokens[V - 1] = "<|end_of_text|>";
    for (uint32_t i = 0; i < V; i++)
        v->types[i] = i >= V - 2 ? 3 : 1;
    return TKV_OK;
}

// ---- the file ---------------------------------------------------------------

static uint32_t file_type_of(uint32_t type) /* llama_ftype */
{
    return type == TKV_TYPE_Q4_0 ? 2 : type == TKV_TYPE_Q8_0 ? 7 : 1;
}

static const char *type_arg(uint32_t type)
{
    return type == TKV_TYPE_Q4_0 ? "q4_0" : type == TKV_TYPE_Q8_0 ? "q8_0" : "f16";
}

static tkv_status add_metadata(tkv_gguf_writer *w, const struct tkv_gen_params *p, const struct vocab *v)
{
    const struct tkv_gen_shape *s = &p->shape;
    char buf[256];
    snprintf(buf, sizeof buf, "tierkv synthetic %s %s seed %llu", s->name, type_arg(p->type),
             (unsigned long long)p->seed);
    TKV_TRY(tkv_gguf_add_str(w, "general.architecture", "llama"));
    TKV_TRY(tkv_gguf_add_str(w, "general.name", buf));
    TKV_TRY(tkv_gguf_add_u32(w, "general.file_type", file_type_of(p->type)));
    TKV_TRY(tkv_gguf_add_u32(w, "general.quantization_version", 2));
    snprintf(buf, sizeof buf, "version=%d shape=%s:%u,%u,%u,%u,%u,%u type=%s seed=%llu", GEN_VERSION, s->name,
             s->n_layer, s->n_embd, s->n_head, s->n_head_kv, s->n_ff, s->n_vocab, type_arg(p->type),
             (unsigned long long)p->seed);
    TKV_TRY(tkv_gguf_add_str(w, "tierkv.gen_model", buf));
    TKV_TRY(tkv_gguf_add_u32(w, "llama.vocab_size", s->n_vocab));
    TKV_TRY(tkv_gguf_add_u32(w, "llama.context_length", s->n_ctx));
    TKV_TRY(tkv_gguf_add_u32(w, "llama.embedding_length", s->n_embd));
    TKV_TRY(tkv_gguf_add_u32(w, "llama.block_count", s->n_layer));
    TKV_TRY(tkv_gguf_add_u32(w, "llama.feed_forward_length", s->n_ff));
    TKV_TRY(tkv_gguf_add_u32(w, "llama.rope.dimension_count", s->n_embd / s->n_head));
    TKV_TRY(tkv_gguf_add_u32(w, "llama.attention.head_count", s->n_head));
    TKV_TRY(tkv_gguf_add_u32(w, "llama.attention.head_count_kv", s->n_head_kv));
    TKV_TRY(tkv_gguf_add_f32(w, "llama.rope.freq_base", s->rope_base));
    TKV_TRY(tkv_gguf_add_f32(w, "llama.attention.layer_norm_rms_epsilon", s->rms_eps));
    TKV_TRY(tkv_gguf_add_str(w, "tokenizer.ggml.model", "gpt2"));
    TKV_TRY(tkv_gguf_add_str(w, "tokenizer.ggml.pre", "llama-bpe"));
    TKV_TRY(tkv_gguf_add_arr_str(w, "tokenizer.ggml.tokens", v->tokens, s->n_vocab));
    TKV_TRY(tkv_gguf_add_arr(w, "tokenizer.ggml.token_type", TKV_GGUF_I32, v->types, s->n_vocab));
    TKV_TRY(tkv_gguf_add_arr_str(w, "tokenizer.ggml.merges", v->merges, s->n_vocab - GEN_MIN_VOCAB));
    TKV_TRY(tkv_gguf_add_u32(w, "tokenizer.ggml.bos_token_id", s->n_vocab - 2));
    TKV_TRY(tkv_gguf_add_u32(w, "tokenizer.ggml.eos_token_id", s->n_vocab - 1));
    TKV_TRY(tkv_gguf_add_bool(w, "tokenizer.ggml.add_bos_token", true));
    TKV_TRY(tkv_gguf_add_bool(w, "tokenizer.ggml.add_eos_token", false));
    return TKV_OK;
}

static tkv_status generate(struct gen *g, const char *path)
{
    const struct tkv_gen_params *p = g->p;
    struct vocab v = {0};
    tkv_gguf_writer *w = NULL;
    tkv_status st = vocab_build(p->shape.n_vocab, &v);
    if (st == TKV_OK)
        st = tkv_gguf_writer_init(&w);
    if (st == TKV_OK)
        st = add_metadata(w, p, &v);
    for (size_t i = 0; i < g->n_t && st == TKV_OK; i++) {
        const struct gen_tensor *t = &g->t[i];
        const int64_t ne[2] = {t->ne0, t->ne1};
        st = tkv_gguf_add_tensor(w, t->name, t->type, t->ne1 > 1 ? 2 : 1, ne, NULL);
    }
    if (st == TKV_OK)
        st = tkv_gguf_write_file_stream(w, path, GEN_CHUNK_BYTES, fill_rows, g);
    tkv_gguf_writer_free(w);
    vocab_free(&v);
    return st;
}

tkv_status tkv_gen_model(const struct tkv_gen_params *params, const char *path)
{
    if (!params || !path || !*path)
        return tkv_err(TKV_ERR_INVALID_ARG, "gen-model: %s", !params ? "NULL params" : "no output path");
    TKV_TRY(tkv_gen_shape_check(&params->shape, params->type));
    uint32_t n_threads = params->n_threads;
    if (n_threads == 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = n > 0 ? (uint32_t)TKV_MIN(n, 1024) : 1;
    }
    if (n_threads > 1024)
        return tkv_err(TKV_ERR_INVALID_ARG, "gen-model: %u threads is above 1024", n_threads);

    struct gen g = {.p = params, .n_t = 0};
    const size_t n_t = 3 + 9 * (size_t)params->shape.n_layer;
    g.t = malloc(n_t * sizeof *g.t);
    if (!g.t)
        return tkv_err(TKV_ERR_NOMEM, "gen-model: no memory for %zu tensors", n_t);
    plan_tensors(&g);
    tkv_status st = tkv_pool_init(n_threads, &g.pool);
    if (st == TKV_OK && !(g.scratch = malloc((size_t)n_threads * (size_t)g.max_ne0 * sizeof *g.scratch)))
        st = tkv_err(TKV_ERR_NOMEM, "gen-model: no memory for %u rows of scratch", n_threads);
    if (st == TKV_OK)
        st = generate(&g, path);
    free(g.scratch);
    tkv_pool_free(g.pool);
    free(g.t);
    return st;
}
