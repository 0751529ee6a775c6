/*
 * test-tokenizer.c -- the tokenizer without the real model: byte map, Unicode
 * classes, pre-tokenizer splits (expected pieces checked against Python's
 * `regex` module running the same patterns), and BPE / special tokens /
 * decoding / chat / error paths on small synthetic GGUF vocabularies.
 * tests/test-tokenizer-model.c covers the real SmolLM2 tokenizer.
 */
#include "test.h"

#include "runtime/tokenizer.h"
#include "runtime/unicode-data.h"

#include <pthread.h>
#include <string.h>

/* ---- byte map ------------------------------------------------------------- */

static void test_byte_map(void)
{
    int seen[0x200] = {0};
    for (int b = 0; b < 256; b++) {
        uint32_t cp = tkv_tokenizer_byte_to_cp_((uint8_t)b);
        CHECK(cp < 0x200, "byte 0x%02x -> U+%04X", b, cp);
        if (cp < 0x200) {
            CHECK(!seen[cp], "U+%04X used twice", cp);
            seen[cp] = 1;
        }
        CHECK(tkv_tokenizer_cp_to_byte_(cp) == b, "round trip of byte 0x%02x via U+%04X", b, cp);
    }
    CHECK(tkv_tokenizer_byte_to_cp_(' ') == 0x120, "space -> U+0120");
    CHECK(tkv_tokenizer_byte_to_cp_('\n') == 0x10A, "newline -> U+010A");
    CHECK(tkv_tokenizer_byte_to_cp_('\t') == 0x109, "tab -> U+0109");
    CHECK(tkv_tokenizer_byte_to_cp_(0x00) == 0x100, "0x00 -> U+0100");
    CHECK(tkv_tokenizer_byte_to_cp_(0x7F) == 0x121, "0x7F -> U+0121");
    CHECK(tkv_tokenizer_byte_to_cp_(0xA0) == 0x142, "0xA0 -> U+0142");
    CHECK(tkv_tokenizer_byte_to_cp_(0xAD) == 0x143, "0xAD -> U+0143");
    CHECK(tkv_tokenizer_byte_to_cp_('A') == 'A' && tkv_tokenizer_byte_to_cp_(0xE9) == 0xE9, "identity bytes");
    CHECK(tkv_tokenizer_cp_to_byte_(0x144) == -1 && tkv_tokenizer_cp_to_byte_(0x20) == -1 &&
              tkv_tokenizer_cp_to_byte_(0x4E00) == -1,
          "code points outside the map");
}

/* ---- Unicode classes ---------------------------------------------------------- */

static void test_unicode(void)
{
    CHECK(strcmp(tkv_unicode_version, "15.1.0") == 0, "unicode version %s", tkv_unicode_version);
    for (uint32_t i = 1; i < tkv_unicode_n_ranges; i++)
        CHECK(tkv_unicode_ranges[i - 1].last < tkv_unicode_ranges[i].first, "ranges sorted and disjoint at %u", i);
    static const struct {
        uint32_t cp, flags;
    } cases[] = {
        {'a', TKV_UCP_L},     {'Z', TKV_UCP_L},      {0xE9, TKV_UCP_L},    {0x65E5, TKV_UCP_L},  /* a Z é 日 */
        {0x2EBF0, TKV_UCP_L}, /* CJK Extension I: new in Unicode 15.1 */
        {0x0301, 0},          /* combining acute: Mn, not a letter */
        {'0', TKV_UCP_N},     {'9', TKV_UCP_N},      {0xB2, TKV_UCP_N},    {0xBD, TKV_UCP_N},    /* ² ½ */
        {0x216B, TKV_UCP_N},  {0x663, TKV_UCP_N},    {0x96B, TKV_UCP_N},   /* Ⅻ (Nl) ٣ ५ */
        {' ', TKV_UCP_WS},    {'\t', TKV_UCP_WS},    {'\n', TKV_UCP_WS},   {'\r', TKV_UCP_WS},
        {0x0B, TKV_UCP_WS},   {0x85, TKV_UCP_WS},    {0xA0, TKV_UCP_WS},   {0x3000, TKV_UCP_WS},
        {0x2003, TKV_UCP_WS}, {0x1C, 0},             {0x180E, 0},          {0x200B, 0}, /* not White_Space */
        {'!', TKV_UCP_P},     {'_', TKV_UCP_P},      {0x2019, TKV_UCP_P},  {0x3002, TKV_UCP_P}, /* ’ 。 */
        {'$', 0},             {'+', 0},              {'`', 0},             {0x1F600, 0},         /* 😀 */
        {0xFFFD, 0},          {0xD800, 0},           {0x10FFFF, 0},        {0x110000, 0},
        {0xFFFFFFFF, 0},      {0, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        CHECK(tkv_unicode_flags(cases[i].cp) == cases[i].flags, "U+%04X: flags %u, expected %u", cases[i].cp,
              tkv_unicode_flags(cases[i].cp), cases[i].flags);
    CHECK(tkv_unicode_is_letter(0x4E00) && tkv_unicode_is_number(0x0660) && tkv_unicode_is_whitespace(0x2028) &&
              tkv_unicode_is_punct(0x00BF),
          "class helpers");
    /* ASCII table agrees with the ranges */
    for (uint32_t cp = 0; cp < 128; cp++) {
        uint32_t f = 0;
        for (uint32_t i = 0; i < tkv_unicode_n_ranges; i++)
            if (tkv_unicode_ranges[i].first <= cp && cp <= tkv_unicode_ranges[i].last)
                f = tkv_unicode_ranges[i].flags;
        CHECK(f == tkv_unicode_ascii[cp], "ascii table at 0x%02x", cp);
    }
}

/* ---- pre-tokenizers ------------------------------------------------------------ */

/* Expected piece byte lengths, from Python's `regex` applying the same
 * patterns stage by stage (gaps kept). */
static void check_split(const char *pre, const char *text, size_t len, const size_t *want, size_t n_want)
{
    size_t got[64], n = 0;
    tkv_status st = tkv_tokenizer_pretokenize_(pre, text, len, got, 64, &n);
    CHECK(st == TKV_OK, "%s: split failed: %s", pre, tkv_last_error());
    bool same = st == TKV_OK && n == n_want;
    for (size_t i = 0; same && i < n; i++)
        same = got[i] == want[i];
    if (!same) {
        char buf[512];
        int o = 0;
        for (size_t i = 0; i < n && i < 64 && o < 400; i++)
            o += snprintf(buf + o, sizeof buf - (size_t)o, "%zu ", got[i]);
        buf[o] = 0;
        CHECK(same, "%s: split of \"%.*s\": got %zu pieces [%s]", pre, (int)len, text, n, buf);
    }
}

#define SPLIT(pre, text, ...)                                                                  \
    do {                                                                                       \
        static const size_t want_[] = {__VA_ARGS__};                                            \
        check_split(pre, text, sizeof(text) - 1, want_, sizeof want_ / sizeof want_[0]);       \
    } while (0)

static void test_pretokenizers(void)
{
    /* smollm: every \p{N} alone, then the GPT-2 regex */
    SPLIT("smollm", "Hello world! 123", 5, 6, 1, 1, 1, 1, 1); /* Hello|␠world|!|␠|1|2|3 */
    SPLIT("smollm", "  multiple   spaces", 1, 9, 2, 7);       /* ␠|␠multiple|␠␠|␠spaces */
    SPLIT("smollm", "\n", 1);
    SPLIT("smollm", "a\n\nb", 1, 1, 1, 1);
    SPLIT("smollm", "I'm don't they'll", 1, 2, 4, 2, 5, 3);
    SPLIT("smollm", "abc123def", 3, 1, 1, 1, 3);
    SPLIT("smollm", "It's", 2, 2);
    SPLIT("smollm", "IT'S", 2, 1, 1);                    /* contractions are lower case only */
    SPLIT("smollm", "I\xe2\x80\x99m", 1, 3, 1);          /* curly apostrophe: not a contraction */
    SPLIT("smollm", "x  ", 1, 2);                        /* trailing whitespace is one piece */
    SPLIT("smollm", "\xc2\xbd\xc2\xb2", 2, 2);           /* ½² are numbers */
    SPLIT("smollm", " 123", 1, 1, 1, 1);                 /* digits never take the space */
    SPLIT("smollm", "hi\tthere", 2, 1, 5);
    SPLIT("smollm", "\t\tindented", 1, 1, 8);
    SPLIT("smollm", "x  \n  y", 1, 4, 2);                /* x|␠␠\n␠|␠y */
    SPLIT("smollm", "a\xff" "b", 1, 1, 1);               /* an invalid byte is U+FFFD: not a letter */
    SPLIT("smollm", "\xe6\x97\xa5\xe6\x9c\xac", 6);      /* 日本 */
    {
        size_t n = 99;
        CHECK(tkv_tokenizer_pretokenize_("smollm", "", 0, NULL, 0, &n) == TKV_OK && n == 0, "empty text: no pieces");
    }
    /* llama-bpe: case-insensitive contractions, one optional non-letter before letters, digits in threes */
    SPLIT("llama-bpe", "Hello world! 12345", 5, 6, 1, 1, 3, 2);
    SPLIT("llama-bpe", "IT'S", 2, 2);
    SPLIT("llama-bpe", "\r\n\r\nx", 4, 1);
    SPLIT("llama-bpe", "a  b", 1, 1, 2);
    SPLIT("llama-bpe", "...\n\nx", 5, 1);
    SPLIT("llama-bpe", "x  \n  y", 1, 3, 1, 2);
    SPLIT("llama-bpe", " 1234567", 1, 3, 3, 1);
    /* qwen2: like llama-bpe with single digits */
    SPLIT("qwen2", "12345", 1, 1, 1, 1, 1);
    SPLIT("qwen2", "IT'S x", 2, 2, 2);
    /* gpt2: digits grouped with an optional space */
    SPLIT("gpt2", "abc123 456", 3, 3, 4);
    SPLIT("gpt2", "a  b", 1, 1, 2);
    /* llama.cpp "default": punctuation runs, GPT-2, \p{N}+, [0-9]{3} */
    SPLIT("default", "a+b=12345!!", 1, 1, 1, 1, 3, 2, 2);
    SPLIT("default", "x 1234567 y", 1, 1, 3, 3, 1, 2);
    SPLIT("default", "$5.00", 1, 1, 1, 2);

    size_t lens[2], n;
    CHECK(tkv_tokenizer_pretokenize_("smollm", "a b c", 5, lens, 2, &n) == TKV_ERR_TOO_SMALL && n == 3,
          "pretokenize: TOO_SMALL with the needed count");
    CHECK(tkv_tokenizer_pretokenize_("nope", "a", 1, lens, 2, &n) == TKV_ERR_UNSUPPORTED, "unknown pre-tokenizer");
}

/* ---- synthetic vocabularies ------------------------------------------------------ */

/* Token strings are in byte-level spelling: "Ġ" is a space, "Ċ" a newline. */
static const char *const syn_tokens[] = {
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<user_tok>", "<|im", /* 0-4: special */
    "a", "b", "c", "d", "\xc4\xa0", "\xc4\x8a", "!", "1",                 /* 5-12: a b c d Ġ Ċ ! 1 */
    "ab", "bc", "abc", "\xc4\xa0" "a", "aa",                              /* 13-17: merge results */
    "\xc3\x83", "\xc2\xa9", "\xc3\x83\xc2\xa9",                           /* 18-20: Ã © Ã© (é)  */
    "x", "cab",                                                           /* 21, 22 */
};
enum { SYN_N = sizeof syn_tokens / sizeof syn_tokens[0] };
static const int32_t syn_types[SYN_N] = {3, 3, 3, 4, 3, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
static const char *const syn_merges[] = {
    "a b",                 /* 0 -> ab  */
    "b c",                 /* 1 -> bc  */
    "ab c",                /* 2 -> abc */
    "\xc4\xa0 a",          /* 3 -> Ġa  */
    "a a",                 /* 4 -> aa  */
    "\xc3\x83 \xc2\xa9",   /* 5 -> é   */
    "d d",                 /* 6 -> dd, which is not a token: falls back to d d */
    "a b",                 /* 7: repeated pair keeps rank 0 */
    "nospace",             /* 8: malformed, ignored */
};

struct syn_opts {
    const char *model, *pre, *tmpl;
    bool        no_tokens, no_merges, bad_types, add_bos, add_bos_key, no_ids;
    int64_t     bos;
    int         n_tokens; /* 0 = all */
};

static tkv_status syn_build(const struct syn_opts *o, tkv_tokenizer **out)
{
    tkv_gguf_writer *w;
    void *mem = NULL;
    size_t size = 0;
    tkv_gguf *g = NULL;
    tkv_status st = tkv_gguf_writer_init(&w);
    if (st != TKV_OK)
        return st;
    int n = o->n_tokens ? o->n_tokens : SYN_N;
    if (st == TKV_OK)
        st = tkv_gguf_add_str(w, "tokenizer.ggml.model", o->model ? o->model : "gpt2");
    if (st == TKV_OK && o->pre)
        st = tkv_gguf_add_str(w, "tokenizer.ggml.pre", o->pre);
    if (st == TKV_OK && !o->no_tokens)
        st = tkv_gguf_add_arr_str(w, "tokenizer.ggml.tokens", syn_tokens, (uint64_t)n);
    if (st == TKV_OK)
        st = tkv_gguf_add_arr(w, "tokenizer.ggml.token_type", TKV_GGUF_I32, syn_types,
                              o->bad_types ? (uint64_t)n - 1 : (uint64_t)n);
    if (st == TKV_OK && !o->no_merges)
        st = tkv_gguf_add_arr_str(w, "tokenizer.ggml.merges", syn_merges, sizeof syn_merges / sizeof syn_merges[0]);
    if (st == TKV_OK && !o->no_ids)
        st = tkv_gguf_add_u32(w, "tokenizer.ggml.bos_token_id", (uint32_t)(o->bos ? o->bos : 1));
    if (st == TKV_OK && !o->no_ids)
        st = tkv_gguf_add_u32(w, "tokenizer.ggml.eos_token_id", 2);
    if (st == TKV_OK && o->add_bos_key)
        st = tkv_gguf_add_bool(w, "tokenizer.ggml.add_bos_token", o->add_bos);
    if (st == TKV_OK && o->tmpl)
        st = tkv_gguf_add_str(w, "tokenizer.chat_template", o->tmpl);
    if (st == TKV_OK)
        st = tkv_gguf_write_mem(w, &mem, &size);
    tkv_gguf_writer_free(w);
    if (st == TKV_OK)
        st = tkv_gguf_open_memory(mem, size, &g);
    if (st == TKV_OK)
        st = tkv_tokenizer_init(g, out);
    tkv_gguf_close(g);
    free(mem);
    return st;
}

/* Encodes text and compares with the expected ids. */
static void check_enc(const tkv_tokenizer *t, const char *text, unsigned flags, const tkv_token *want, size_t n_want)
{
    tkv_token got[64];
    size_t n = 0;
    tkv_status st = tkv_tokenizer_encode(t, text, strlen(text), flags, got, 64, &n);
    bool same = st == TKV_OK && n == n_want;
    for (size_t i = 0; same && i < n; i++)
        same = got[i] == want[i];
    char buf[256];
    int o = 0;
    for (size_t i = 0; i < n && i < 32; i++)
        o += snprintf(buf + o, sizeof buf - (size_t)o, "%d ", got[i]);
    buf[o] = 0;
    CHECK(same, "encode \"%s\" (flags %u): status %s, got [%s]", text, flags, tkv_status_str(st), buf);
}

#define ENC(t, text, flags, ...)                                                               \
    do {                                                                                       \
        static const tkv_token want_[] = {__VA_ARGS__};                                         \
        check_enc(t, text, flags, want_, sizeof want_ / sizeof want_[0]);                      \
    } while (0)
#define ENC_NONE(t, text, flags) check_enc(t, text, flags, NULL, 0)

static void check_dec(const tkv_tokenizer *t, const tkv_token *toks, size_t n, unsigned flags, const char *want)
{
    char buf[256];
    size_t len = 0;
    tkv_status st = tkv_tokenizer_decode(t, toks, n, flags, buf, sizeof buf, &len);
    CHECK(st == TKV_OK && len == strlen(want) && memcmp(buf, want, len) == 0 && buf[len] == 0,
          "decode: status %s, got \"%.*s\", want \"%s\"", tkv_status_str(st), (int)len, buf, want);
}

struct thread_arg {
    const tkv_tokenizer *t;
    int ok;
};

static void *enc_thread(void *p)
{
    struct thread_arg *a = p;
    a->ok = 1;
    for (int i = 0; i < 2000; i++) {
        tkv_token got[16];
        size_t n;
        const char *text = "abc aa<|im_start|>\xc3\xa9";
        tkv_status st = tkv_tokenizer_encode(a->t, text, strlen(text), TKV_TOK_PARSE_SPECIAL, got, 16, &n);
        static const tkv_token want[] = {15, 16, 5, 1, 20};
        if (st != TKV_OK || n != 5 || memcmp(got, want, sizeof want) != 0)
            a->ok = 0;
    }
    return NULL;
}

static void test_synthetic(void)
{
    tkv_tokenizer *t = NULL;
    struct syn_opts o = {.pre = "smollm", .tmpl = "... You are a helpful AI assistant named SmolLM, trained by Hugging Face ..."};
    tkv_status st = syn_build(&o, &t);
    CHECK(st == TKV_OK, "synthetic tokenizer: %s", tkv_last_error());
    if (st != TKV_OK)
        return;
    CHECK(tkv_tokenizer_n_vocab(t) == SYN_N, "n_vocab %u", tkv_tokenizer_n_vocab(t));
    CHECK(tkv_tokenizer_bos(t) == 1 && tkv_tokenizer_eos(t) == 2, "bos/eos");

    /* BPE: lowest rank first */
    ENC(t, "abc", 0, 15);             /* a b -> ab (0), ab c -> abc (2) */
    ENC(t, "bc", 0, 14);
    ENC(t, "aaa", 0, 17, 5);          /* equal ranks: leftmost pair first */
    ENC(t, "aaaa", 0, 17, 17);
    ENC(t, " a", 0, 16);              /* Ġa */
    ENC(t, "a1", 0, 5, 12);
    ENC(t, "cab", 0, 7, 13);          /* whole word in the vocabulary, but BPE decides */
    ENC(t, "\xc3\xa9", 0, 20);        /* é from its two byte symbols */
    ENC(t, "dd", 0, 8, 8);            /* merge result not in the vocabulary: one-byte tokens */
    ENC_NONE(t, "z", 0);              /* a byte with no token is dropped */
    ENC_NONE(t, "\xff", 0);           /* invalid UTF-8 -> U+FFFD -> no tokens here */
    ENC_NONE(t, "", 0);
    ENC_NONE(t, "", TKV_TOK_PARSE_SPECIAL);
    ENC(t, "a\n", 0, 5, 10);

    /* special tokens: control only with PARSE_SPECIAL, longest first; user-defined always */
    ENC(t, "<|im_start|>a", TKV_TOK_PARSE_SPECIAL, 1, 5);
    ENC(t, "<|imx", TKV_TOK_PARSE_SPECIAL, 4, 21);
    ENC(t, "x<|im_end|><|im_end|>x", TKV_TOK_PARSE_SPECIAL, 21, 2, 2, 21);
    ENC(t, "<|im_start|>a", 0, 5, 5);     /* plain text: of "<|im_start|>" only the 'a' is a token here */
    ENC(t, "a<user_tok>b", 0, 5, 3, 6);
    ENC(t, "a<user_tok>b", TKV_TOK_PARSE_SPECIAL, 5, 3, 6);

    /* BOS: only when the caller asks and the model wants it (add_bos_token absent: false for smollm) */
    ENC(t, "a", TKV_TOK_ADD_BOS, 5);

    /* decoding */
    static const tkv_token d1[] = {1, 16, 18, 19, 10, 3, 2};
    check_dec(t, d1, 7, 0, " a\xc3\xa9\n<user_tok>");
    check_dec(t, d1, 7, TKV_TOK_RENDER_SPECIAL, "<|im_start|> a\xc3\xa9\n<user_tok><|im_end|>");
    check_dec(t, NULL, 0, 0, "");

    /* EOG and control */
    CHECK(tkv_tokenizer_is_eog(t, 2) && tkv_tokenizer_is_eog(t, 0) && !tkv_tokenizer_is_eog(t, 1) &&
              !tkv_tokenizer_is_eog(t, 5) && !tkv_tokenizer_is_eog(t, -1),
          "eog set");
    CHECK(tkv_tokenizer_is_control(t, 1) && !tkv_tokenizer_is_control(t, 3) && !tkv_tokenizer_is_control(t, 5) &&
              !tkv_tokenizer_is_control(t, 999) && !tkv_tokenizer_is_control(t, -3),
          "control tokens");

    /* chat */
    char buf[512];
    size_t len;
    CHECK(tkv_tokenizer_chat(t, NULL, "hi", buf, sizeof buf, &len) == TKV_OK &&
              strcmp(buf, "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
                          "Face<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n") == 0 &&
              len == strlen(buf),
          "chat with the default system prompt: \"%s\"", buf);
    CHECK(tkv_tokenizer_chat(t, "Be brief.", "hi", buf, sizeof buf, &len) == TKV_OK &&
              strcmp(buf, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                          "<|im_start|>assistant\n") == 0,
          "chat with a system prompt: \"%s\"", buf);
    CHECK(tkv_tokenizer_chat(t, NULL, "hi", buf, 10, &len) == TKV_ERR_TOO_SMALL && len > 10, "chat: TOO_SMALL");
    CHECK(tkv_tokenizer_chat(t, NULL, "hi", NULL, 0, &len) == TKV_ERR_TOO_SMALL && len > 100, "chat: size query");
    CHECK(tkv_tokenizer_chat(t, NULL, NULL, buf, sizeof buf, &len) == TKV_ERR_INVALID_ARG, "chat: NULL user");

    /* size contracts */
    tkv_token few[2] = {-7, -7};
    size_t n = 0;
    CHECK(tkv_tokenizer_encode(t, "a1b", 3, 0, few, 2, &n) == TKV_ERR_TOO_SMALL && n == 3 && few[0] == 5 &&
              few[1] == 12,
          "encode: TOO_SMALL, count and prefix (n %zu)", n);
    CHECK(tkv_tokenizer_encode(t, "a1b", 3, 0, NULL, 0, &n) == TKV_ERR_TOO_SMALL && n == 3, "encode: count only");
    char small[4];
    static const tkv_token d2[] = {15, 15};
    CHECK(tkv_tokenizer_decode(t, d2, 2, 0, small, 4, &len) == TKV_ERR_TOO_SMALL && len == 6, "decode: TOO_SMALL");
    CHECK(tkv_tokenizer_decode(t, d2, 2, 0, small, 3, &len) == TKV_ERR_TOO_SMALL && len == 6, "decode: TOO_SMALL");
    char exact[6];
    CHECK(tkv_tokenizer_decode(t, d2, 2, 0, exact, 6, &len) == TKV_OK && len == 6 && memcmp(exact, "abcabc", 6) == 0,
          "decode: exact fit without NUL");

    /* argument errors */
    static const tkv_token bad[] = {5, SYN_N};
    CHECK(tkv_tokenizer_decode(t, bad, 2, 0, buf, sizeof buf, &len) == TKV_ERR_INVALID_ARG &&
              strstr(tkv_last_error(), "index 1"),
          "decode: out-of-range id: %s", tkv_last_error());
    static const tkv_token neg[] = {-1};
    CHECK(tkv_tokenizer_decode(t, neg, 1, 0, buf, sizeof buf, &len) == TKV_ERR_INVALID_ARG, "decode: negative id");
    CHECK(tkv_tokenizer_encode(t, "a", 1, 0x80, few, 2, &n) == TKV_ERR_INVALID_ARG, "encode: unknown flag");
    CHECK(tkv_tokenizer_encode(t, NULL, 1, 0, few, 2, &n) == TKV_ERR_INVALID_ARG, "encode: NULL text");
    CHECK(tkv_tokenizer_encode(t, NULL, 0, 0, few, 2, &n) == TKV_OK && n == 0, "encode: NULL empty text");
    CHECK(tkv_tokenizer_encode(t, "a", 1, 0, NULL, 2, &n) == TKV_ERR_INVALID_ARG, "encode: NULL out");
    CHECK(tkv_tokenizer_encode(t, "a", 1, 0, few, 2, NULL) == TKV_ERR_INVALID_ARG, "encode: NULL n_out");
    CHECK(tkv_tokenizer_encode(NULL, "a", 1, 0, few, 2, &n) == TKV_ERR_INVALID_ARG, "encode: NULL tokenizer");
    CHECK(tkv_tokenizer_decode(t, d2, 2, 0x100, buf, sizeof buf, &len) == TKV_ERR_INVALID_ARG, "decode: bad flag");
    CHECK(tkv_tokenizer_n_vocab(NULL) == 0 && tkv_tokenizer_bos(NULL) == -1 && !tkv_tokenizer_is_eog(NULL, 2),
          "NULL tokenizer queries");

    /* concurrent encodes on one tokenizer */
    pthread_t th[4];
    struct thread_arg args[4];
    for (int i = 0; i < 4; i++) {
        args[i] = (struct thread_arg){t, 0};
        pthread_create(&th[i], NULL, enc_thread, &args[i]);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        CHECK(args[i].ok, "thread %d got different tokens", i);
    }
    tkv_tokenizer_free(t);
    tkv_tokenizer_free(NULL);

    /* BOS when the model asks for it */
    struct syn_opts ob = {.pre = "smollm", .add_bos_key = true, .add_bos = true};
    CHECK(syn_build(&ob, &t) == TKV_OK, "add_bos model: %s", tkv_last_error());
    ENC(t, "a", TKV_TOK_ADD_BOS, 1, 5);
    ENC(t, "a", 0, 5);
    CHECK(tkv_tokenizer_chat(t, NULL, "hi", buf, sizeof buf, &len) == TKV_OK &&
              strncmp(buf, "<|im_start|>user\n", 17) == 0,
          "chat without the SmolLM template: no system turn: \"%s\"", buf);
    tkv_tokenizer_free(t);

    /* llama-bpe: add_bos defaults to true; a whole-word vocabulary hit skips BPE */
    struct syn_opts ol = {.pre = "llama-bpe"};
    CHECK(syn_build(&ol, &t) == TKV_OK, "llama-bpe model: %s", tkv_last_error());
    ENC(t, "a", TKV_TOK_ADD_BOS, 1, 5);
    ENC(t, "abc", 0, 15);
    ENC(t, "cab", 0, 22);             /* smollm BPE gives c|ab */
    tkv_tokenizer_free(t);

    /* a vocabulary without <|im_start|> has no chat template */
    struct syn_opts oc = {.pre = "smollm", .n_tokens = 1, .no_ids = true};
    CHECK(syn_build(&oc, &t) == TKV_OK, "one-token model: %s", tkv_last_error());
    CHECK(tkv_tokenizer_chat(t, NULL, "hi", buf, sizeof buf, &len) == TKV_ERR_UNSUPPORTED &&
              strstr(tkv_last_error(), "model has no chat template tierkv knows"),
          "chat unsupported: %s", tkv_last_error());
    tkv_tokenizer_free(t);

    /* model errors: each one a status and a message, never an abort */
    struct {
        struct syn_opts o;
        tkv_status      want;
        const char     *msg;
    } errs[] = {
        {{.model = "llama"}, TKV_ERR_UNSUPPORTED,
         "tokenizer model 'llama' (SentencePiece) is not supported yet; tierkv supports gpt2 BPE"},
        {{.model = "bert"}, TKV_ERR_UNSUPPORTED, "'bert'"},
        {{.pre = "chameleon"}, TKV_ERR_UNSUPPORTED, "'chameleon'"},
        {{.pre = "smollm", .no_tokens = true}, TKV_ERR_FORMAT, "tokenizer.ggml.tokens"},
        {{.pre = "smollm", .no_merges = true}, TKV_ERR_FORMAT, "tokenizer.ggml.merges"},
        {{.pre = "smollm", .bad_types = true}, TKV_ERR_FORMAT, "token_type"},
        {{.pre = "smollm", .bos = 1000}, TKV_ERR_FORMAT, "bos_token_id"},
    };
    for (size_t i = 0; i < sizeof errs / sizeof errs[0]; i++) {
        t = NULL;
        st = syn_build(&errs[i].o, &t);
        CHECK(st == errs[i].want && t == NULL && strstr(tkv_last_error(), errs[i].msg),
              "error case %zu: got %s \"%s\", want %s containing \"%s\"", i, tkv_status_str(st), tkv_last_error(),
              tkv_status_str(errs[i].want), errs[i].msg);
        tkv_tokenizer_free(t);
    }
    CHECK(tkv_tokenizer_init(NULL, &t) == TKV_ERR_INVALID_ARG, "init: NULL gguf");
}

int main(void)
{
    test_byte_map();
    test_unicode();
    test_pretokenizers();
    test_synthetic();
    return test_done();
}
