/*
 * test-tokenizer-model.c -- the real SmolLM2 tokenizer (skips without the
 * model): the third-party vectors of the shared spec (section 3.3), the
 * llama.cpp reference cases in tests/data/smollm2-tokens.txt (required: the
 * test fails when the file is missing), round trips on fixed and random
 * UTF-8, the chat prompt, and concurrent encodes. Tokens per second are
 * printed for information only; nothing here is timed against a limit.
 */
#include "test.h"

#include "runtime/tokenizer.h"

#include <pthread.h>
#include <string.h>
#include <time.h>

static const tkv_tokenizer *tok;

static tkv_token *encode(const char *text, size_t len, unsigned flags, size_t *n)
{
    size_t need = 0;
    tkv_status st = tkv_tokenizer_encode(tok, text, len, flags, NULL, 0, &need);
    if (st != TKV_OK && st != TKV_ERR_TOO_SMALL) {
        fprintf(stderr, "encode failed: %s\n", tkv_last_error());
        *n = 0;
        return NULL;
    }
    tkv_token *out = malloc((need ? need : 1) * sizeof *out);
    if (!out)
        return NULL;
    st = tkv_tokenizer_encode(tok, text, len, flags, out, need, n);
    if (st != TKV_OK) {
        fprintf(stderr, "encode failed: %s\n", tkv_last_error());
        free(out);
        return NULL;
    }
    return out;
}

/* decode(encode(text)) == text */
static bool round_trip(const char *text, size_t len, unsigned enc_flags, unsigned dec_flags)
{
    size_t n, blen;
    tkv_token *ids = encode(text, len, enc_flags, &n);
    if (!ids && len)
        return false;
    char *buf = malloc(len + 1);
    tkv_status st = tkv_tokenizer_decode(tok, ids, n, dec_flags, buf, len + 1, &blen);
    bool ok = st == TKV_OK && blen == len && memcmp(buf, text, len) == 0 && buf[len] == 0;
    free(ids);
    free(buf);
    return ok;
}

static void check_ids(const char *what, const char *text, size_t len, unsigned flags, const tkv_token *want,
                      size_t n_want)
{
    size_t n;
    tkv_token *got = encode(text, len, flags, &n);
    size_t first_diff = 0;
    while (got && first_diff < n && first_diff < n_want && got[first_diff] == want[first_diff])
        first_diff++;
    bool same = (got || !len) && n == n_want && first_diff == n;
    CHECK(same, "%s \"%.40s\"%s: got %zu ids, want %zu; first difference at %zu (got %d, want %d)", what, text,
          len > 40 ? "..." : "", n, n_want, first_diff, got && first_diff < n ? got[first_diff] : -1,
          first_diff < n_want ? want[first_diff] : -1);
    free(got);
}

/* ---- the spec's third-party vectors (eval_gguf_tokenizer.md 3.3) ------------- */

static void test_spec_vectors(void)
{
    static const struct {
        const char *text;
        tkv_token   ids[20];
        size_t      n;
    } v[] = {
        {"Hello, we can use", {19556, 28, 392, 416, 722}, 5},
        {"The capital of France is", {504, 3575, 282, 4649, 314}, 5},
        {"You are a helpful AI assistant named SmolLM, trained by Hugging Face",
         {2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182}, 16},
        {"\n", {198}, 1},
        {"Hello world! 123", {19556, 905, 17, 216, 33, 34, 35}, 7},
        {"Caf\xc3\xa9 d\xc3\xa9j\xc3\xa0 vu.", {51, 1939, 2756, 32564, 90, 16739, 386, 101, 30}, 9},
        {"  multiple   spaces", {216, 2701, 256, 5600}, 4},
    };
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++)
        check_ids("spec vector", v[i].text, strlen(v[i].text), 0, v[i].ids, v[i].n);
}

/* ---- llama.cpp reference (scripts/gen-reference.py) ----------------------------- */

static int hexval(int c) { return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1; }

static void test_reference(void)
{
    const char *path = test_data_path("smollm2-tokens.txt");
    FILE *f = fopen(path, "rb");
    CHECK(f != NULL, "reference data %s is missing (generate it with scripts/gen-reference.py)", path);
    if (!f)
        return;
    static char line[1 << 20];
    static char text[1 << 19];
    static tkv_token want[1 << 17];
    int n_cases = 0, n_bad = 0;
    while (fgets(line, sizeof line, f)) {
        char *t1 = strchr(line, '\t'), *t2 = t1 ? strchr(t1 + 1, '\t') : NULL;
        if (!t1 || !t2) {
            CHECK(line[0] == '\n' || line[0] == 0, "malformed reference line %d", n_cases + 1);
            continue;
        }
        size_t hl = (size_t)(t1 - line), len = hl / 2;
        bool ok = hl % 2 == 0 && len <= sizeof text;
        for (size_t i = 0; ok && i < len; i++) {
            int hi = hexval(line[2 * i]), lo = hexval(line[2 * i + 1]);
            ok = hi >= 0 && lo >= 0;
            text[i] = (char)(hi * 16 + lo);
        }
        CHECK(ok, "bad hex on reference line %d", n_cases + 1);
        unsigned flags = t1[1] == '1' ? TKV_TOK_PARSE_SPECIAL : 0;
        size_t n = 0;
        for (char *p = t2 + 1; *p && *p != '\n';) {
            char *end;
            long id = strtol(p, &end, 10);
            if (end == p)
                break;
            if (n < sizeof want / sizeof want[0])
                want[n++] = (tkv_token)id;
            p = end;
        }
        int before = test_failures_;
        check_ids("llama.cpp reference", text, len, flags, want, n);
        n_bad += test_failures_ != before;
        /* and every reference text round-trips */
        CHECK(round_trip(text, len, flags, flags ? TKV_TOK_RENDER_SPECIAL : 0), "round trip of reference case %d",
              n_cases + 1);
        n_cases++;
    }
    fclose(f);
    fprintf(stderr, "llama.cpp reference: %d cases, %d mismatches\n", n_cases, n_bad);
    CHECK(n_cases >= 10, "only %d reference cases", n_cases);
}

/* ---- round trips ----------------------------------------------------------------- */

/* Appends a random code point as UTF-8, from ranges the vocabulary can spell:
 * not U+40000..U+BFFFF (lead bytes F1/F2 have no token) and not the control
 * characters 0x04 0x06 0x13 0x14 0x16 0x1D (no token either), no surrogates. */
static size_t rand_utf8(uint64_t *s, char *out)
{
    uint32_t cp;
    for (;;) {
        uint64_t r = test_rand_u64(s);
        switch (r % 6) {
        case 0: cp = 0x20 + (uint32_t)(r >> 8) % 0x5F; break;      /* printable ASCII */
        case 1: cp = "\n\t\r \n "[(r >> 8) % 6]; break;             /* whitespace */
        case 2: cp = (uint32_t)(r >> 8) % 0x80; break;              /* any ASCII */
        case 3: cp = 0x80 + (uint32_t)(r >> 8) % 0x780; break;      /* two bytes */
        case 4: cp = 0x800 + (uint32_t)(r >> 8) % 0xF800; break;    /* three bytes */
        default: cp = 0x10000 + (uint32_t)(r >> 8) % 0x30000; break; /* four bytes, planes 1-3 */
        }
        if ((cp >= 0xD800 && cp <= 0xDFFF) || cp == 0x04 || cp == 0x06 || cp == 0x13 || cp == 0x14 || cp == 0x16 ||
            cp == 0x1D)
            continue;
        break;
    }
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | (cp >> 18));
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

static void test_round_trips(void)
{
    static const char *const fixed[] = {
        "", " ", "  ", "\n", "\r\n", "\t", "Hello world! 123", "  multiple   spaces", "trailing   ",
        "I'm sure they'll say we don't know", "I\xe2\x80\x99m", "abc123def", "12345678901234567890",
        "na\xc3\xafve fa\xc3\xa7" "ade r\xc3\xa9sum\xc3\xa9 \xc3\x85ngstr\xc3\xb6m stra\xc3\x9f" "e",
        "\xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e\xe3\x81\xae\xe3\x83\x86\xe3\x82\xad\xe3\x82\xb9\xe3\x83\x88",
        "\xf0\x9f\x98\x80\xf0\x9f\x9a\x80\xf0\x9f\x91\x8d\xf0\x9f\x8f\xbd",
        "x\xc2\xb2 + \xc2\xbd", "<|im_start|>user\nhi<|im_end|>", "<|endoftext|>", "\x7f\x01\x02\x03\x05",
        "#include <stdio.h>\n\nint main(void) {\n    return 0;\n}\n",
    };
    for (size_t i = 0; i < sizeof fixed / sizeof fixed[0]; i++) {
        CHECK(round_trip(fixed[i], strlen(fixed[i]), 0, 0), "round trip of \"%s\"", fixed[i]);
        CHECK(round_trip(fixed[i], strlen(fixed[i]), TKV_TOK_PARSE_SPECIAL, TKV_TOK_RENDER_SPECIAL),
              "round trip with specials of \"%s\"", fixed[i]);
    }
    /* special tokens parse, and render only when asked */
    size_t n, len;
    tkv_token *ids = encode("<|im_start|>hi<|im_end|>", 24, TKV_TOK_PARSE_SPECIAL, &n);
    char buf[64];
    CHECK(ids && n == 3 && ids[0] == 1 && ids[2] == 2, "specials parsed (n %zu)", n);
    CHECK(ids && tkv_tokenizer_decode(tok, ids, n, 0, buf, sizeof buf, &len) == TKV_OK && strcmp(buf, "hi") == 0,
          "control tokens are not rendered by default: \"%s\"", buf);
    free(ids);

    uint64_t seed = test_seed();
    static char text[4096];
    int bad = 0;
    for (int i = 0; i < 3000; i++) {
        size_t len = 0, n_cp = test_rand_u64(&seed) % 200;
        for (size_t k = 0; k < n_cp; k++)
            len += rand_utf8(&seed, text + len);
        if (!round_trip(text, len, 0, 0)) {
            if (bad++ < 5)
                CHECK(false, "round trip of random UTF-8 case %d (%zu bytes)", i, len);
        }
    }
    CHECK(bad == 0, "%d random round trips failed", bad);

    /* documented losses: bytes with no token are dropped */
    ids = encode("a\x04" "b", 3, 0, &n);
    CHECK(ids && tkv_tokenizer_decode(tok, ids, n, 0, buf, sizeof buf, &len) == TKV_OK && strcmp(buf, "ab") == 0,
          "0x04 has no token and is dropped: \"%s\"", buf);
    free(ids);
    /* invalid UTF-8: each bad byte becomes U+FFFD, like llama.cpp */
    ids = encode("a\xff" "b", 3, 0, &n);
    CHECK(ids && tkv_tokenizer_decode(tok, ids, n, 0, buf, sizeof buf, &len) == TKV_OK &&
              strcmp(buf, "a\xef\xbf\xbd" "b") == 0,
          "invalid byte -> U+FFFD: \"%s\"", buf);
    free(ids);
}

/* ---- chat, metadata ------------------------------------------------------------------ */

static void test_chat_and_meta(void)
{
    CHECK(tkv_tokenizer_n_vocab(tok) == 49152, "n_vocab %u", tkv_tokenizer_n_vocab(tok));
    CHECK(tkv_tokenizer_bos(tok) == 1 && tkv_tokenizer_eos(tok) == 2, "bos %d eos %d", tkv_tokenizer_bos(tok),
          tkv_tokenizer_eos(tok));
    CHECK(tkv_tokenizer_is_eog(tok, 2) && tkv_tokenizer_is_eog(tok, 0) && !tkv_tokenizer_is_eog(tok, 1) &&
              !tkv_tokenizer_is_eog(tok, 198),
          "eog set");
    for (tkv_token id = 0; id < 17; id++)
        CHECK(tkv_tokenizer_is_control(tok, id), "token %d is control", id);
    CHECK(!tkv_tokenizer_is_control(tok, 17), "token 17 is normal");

    /* SmolLM2 never gets a BOS: add_bos_token is false */
    size_t n;
    tkv_token *ids = encode("Hi", 2, TKV_TOK_ADD_BOS, &n);
    CHECK(ids && n >= 1 && ids[0] != 1, "no BOS for SmolLM2");
    free(ids);

    static const char want[] = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
                               "Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                               "<|im_start|>assistant\n";
    char buf[512];
    size_t len;
    CHECK(tkv_tokenizer_chat(tok, NULL, "What is the capital of France?", buf, sizeof buf, &len) == TKV_OK &&
              len == strlen(want) && strcmp(buf, want) == 0,
          "chat prompt: \"%s\"", buf);
    ids = encode(buf, len, TKV_TOK_PARSE_SPECIAL, &n);
    CHECK(ids && n > 20 && ids[0] == 1 && ids[n - 1] == 198 && ids[n - 2] != 1, "chat prompt tokens (n %zu)", n);
    free(ids);
}

/* ---- concurrency and throughput (printed, never asserted) ------------------------- */

struct job {
    const char      *text;
    size_t           len, n_want;
    const tkv_token *want;
    int              ok;
};

static void *job_run(void *p)
{
    struct job *j = p;
    size_t n;
    tkv_token *ids = encode(j->text, j->len, 0, &n);
    j->ok = ids && n == j->n_want && memcmp(ids, j->want, n * sizeof *ids) == 0;
    free(ids);
    return NULL;
}

static void test_bulk(void)
{
    static const char para[] =
        "The history of computing is a story of layered abstractions. Early machines were programmed by "
        "rewiring panels and flipping switches; every instruction had to be understood in terms of the "
        "hardware. In 1957, FORTRAN turned formulas into machine code (about 2,000 lines per day), and "
        "operating systems hid the details of disks, terminals and memory behind uniform interfaces.\n\n";
    size_t plen = strlen(para), reps = (1u << 20) / plen + 1, len = plen * reps;
    char *text = malloc(len);
    for (size_t i = 0; i < reps; i++)
        memcpy(text + i * plen, para, plen);

    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    size_t n;
    tkv_token *ids = encode(text, len, 0, &n);
    clock_gettime(CLOCK_MONOTONIC, &b);
    double s = (double)(b.tv_sec - a.tv_sec) + (double)(b.tv_nsec - a.tv_nsec) * 1e-9;
    fprintf(stderr, "info: encoded %zu bytes into %zu tokens in %.3f s (%.2f M tokens/s, %.1f MB/s)\n", len, n, s,
            (double)n / s * 1e-6, (double)len / s * 1e-6);
    CHECK(ids && n > len / 6, "bulk encode (n %zu)", n);

    /* the same text from four threads at once gives the same tokens */
    pthread_t th[4];
    struct job jobs[4];
    for (int i = 0; i < 4; i++) {
        jobs[i] = (struct job){text, len / 4 + (size_t)i * 1000, 0, NULL, 0};
        size_t m;
        tkv_token *w = encode(jobs[i].text, jobs[i].len, 0, &m);
        jobs[i].want = w;
        jobs[i].n_want = m;
    }
    for (int i = 0; i < 4; i++)
        pthread_create(&th[i], NULL, job_run, &jobs[i]);
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        CHECK(jobs[i].ok, "thread %d: tokens differ from the single-threaded run", i);
        free((void *)jobs[i].want);
    }
    free(ids);
    free(text);
}

int main(void)
{
    const char *path = test_model_path();
    tkv_gguf *g;
    tkv_status st = tkv_gguf_open(path, &g); /* REQUIRE evaluates its condition twice: no calls inside */
    REQUIRE(st == TKV_OK, "open %s: %s", path, tkv_last_error());
    tkv_tokenizer *t;
    st = tkv_tokenizer_init(g, &t);
    tkv_gguf_close(g); /* the tokenizer keeps copies */
    REQUIRE(st == TKV_OK, "tokenizer init: %s", tkv_last_error());
    tok = t;

    test_spec_vectors();
    test_chat_and_meta();
    test_round_trips();
    test_reference();
    test_bulk();

    tkv_tokenizer_free(t);
    return test_done();
}
