/*
 * tokenizer.c -- GPT-2 byte-level BPE from GGUF metadata, matching llama.cpp.
 *
 * Encoding, for each call (nothing is cached between calls, so a tokenizer is
 * read-only after init and may be shared by threads):
 *
 *   1. special-token partition: the text is cut at occurrences of special
 *      token strings, longest token first (llama.cpp's
 *      tokenizer_st_partition); each occurrence becomes its id directly;
 *   2. each remaining text fragment is decoded to code points (an invalid
 *      UTF-8 byte becomes U+FFFD, like llama.cpp) and split into pieces by
 *      the model's pre-tokenizer (hand-written matchers for the regexes, one
 *      stage after the other, unmatched gaps kept as pieces);
 *   3. each piece is re-encoded as UTF-8 and every byte is a starting symbol
 *      (the GPT-2 bytes_to_unicode character of that byte);
 *   4. BPE: repeatedly merge the adjacent pair with the lowest merge rank,
 *      leftmost on ties (a binary heap, O(m log m) per piece of m bytes);
 *   5. each final symbol is looked up in the vocabulary; a symbol that is not
 *      there falls back, like llama.cpp, to looking up each byte of its
 *      (mapped) text as a one-byte token and dropping the bytes that are not.
 *
 * Strings are interned: every vocabulary string has its token id, and every
 * merge part or merge result that is not in the vocabulary gets a private
 * symbol id >= n_vocab. The merge table then maps a pair of symbol ids to
 * (rank, merged symbol id), so BPE never hashes strings.
 *
 * docs/tokenizer.md describes the supported models and the edge cases.
 */
#include "tokenizer.h"

#include "unicode-data.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- pre-tokenizers --------------------------------------------------------- */

enum tkv_pre {
    TKV_PRE_SMOLLM,  /* \p{N} isolated, then the GPT-2 regex                        */
    TKV_PRE_GPT2,    /* the GPT-2 regex alone                                        */
    TKV_PRE_LLAMA3,  /* Llama 3 regex, \p{N}{1,3}; whole-word vocab hits skip BPE    */
    TKV_PRE_QWEN2,   /* Llama 3 regex with \p{N} (single digits)                     */
    TKV_PRE_DEFAULT, /* llama.cpp "default": punct runs, GPT-2, \p{N}+, [0-9]{3}     */
};

static const struct {
    const char  *name;
    enum tkv_pre pre;
} tkv_pre_names[] = {
    {"smollm", TKV_PRE_SMOLLM},       {"gpt2", TKV_PRE_GPT2},         {"gpt-2", TKV_PRE_GPT2},
    {"llama-bpe", TKV_PRE_LLAMA3},    {"llama3", TKV_PRE_LLAMA3},     {"llama-v3", TKV_PRE_LLAMA3},
    {"qwen2", TKV_PRE_QWEN2},         {"deepseek-r1-qwen", TKV_PRE_QWEN2},
    {"default", TKV_PRE_DEFAULT},
};

/* ---- token types (tokenizer.ggml.token_type, llama.cpp's llama_token_type) -- */

enum {
    TKV_TT_UNDEFINED = 0, TKV_TT_NORMAL = 1, TKV_TT_UNKNOWN = 2, TKV_TT_CONTROL = 3,
    TKV_TT_USER_DEFINED = 4, TKV_TT_UNUSED = 5, TKV_TT_BYTE = 6,
};

#define TKV_TOK_ALL_FLAGS (TKV_TOK_PARSE_SPECIAL | TKV_TOK_ADD_BOS | TKV_TOK_RENDER_SPECIAL)
#define TKV_MAX_EOG       8

static const char tkv_smollm_system[] = "You are a helpful AI assistant named SmolLM, trained by Hugging Face";

struct tkv_merge_slot {
    uint64_t key;    /* (left id << 32 | right id) + 1; 0 = empty slot */
    int32_t  rank;
    int32_t  result; /* symbol id of left + right                       */
};

struct tkv_tokenizer {
    uint32_t n_vocab;       /* real tokens: ids [0, n_vocab)                        */
    uint32_t n_sym;         /* plus merge-only strings: ids [n_vocab, n_sym)        */
    char    *blob;          /* all symbol strings, back to back                     */
    uint64_t *off;          /* [n_sym + 1]: symbol i is blob[off[i], off[i+1])      */
    uint8_t *type;          /* [n_vocab] TKV_TT_*                                    */

    int32_t *str_slots;     /* open addressing: symbol id or -1; string -> id       */
    uint64_t str_mask;

    struct tkv_merge_slot *merge_slots; /* (left, right) -> (rank, result)          */
    uint64_t merge_mask;

    char    *dec_blob;      /* decoded bytes of every token (normal: byte map undone) */
    uint64_t *dec_off;      /* [n_vocab + 1]                                         */

    int32_t  byte_sym[256]; /* symbol id of bytes_to_unicode(b), -1 if none          */
    int32_t  byte_tok[256]; /* token whose text is exactly the byte b (fallback), -1  */
    uint8_t  map_utf8[256][2], map_len[256]; /* bytes_to_unicode(b) as UTF-8         */

    int32_t *special;       /* ids of unknown/control/user-defined tokens,           */
    uint32_t n_special;     /* longest text first                                    */
    bool     has_user_defined;

    enum tkv_pre pre;
    char     pre_name[32];
    bool     ignore_merges; /* a piece that is a whole token skips BPE (llama3)     */
    bool     add_bos;       /* the model asks for BOS (with TKV_TOK_ADD_BOS)         */
    tkv_token bos, eos, im_start, im_end;
    tkv_token eog[TKV_MAX_EOG];
    uint32_t n_eog;
    bool     chat_smollm_system; /* chat_template carries SmolLM2's default system prompt */
};

/* ---- byte <-> unicode map (GPT-2 bytes_to_unicode) -------------------------- */

/* Bytes 0x21-0x7E, 0xA1-0xAC and 0xAE-0xFF stand for themselves; the other 68,
 * in increasing order, map to U+0100, U+0101, ... (space -> U+0120 'Ġ'). */
uint32_t tkv_tokenizer_byte_to_cp_(uint8_t b)
{
    if ((b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE)
        return b;
    /* count the unmapped bytes below b */
    uint32_t n = b <= 0x20 ? b : b <= 0xA0 ? 0x21 + (b - 0x7F) : 0x21 + 0x22;
    return 0x100 + n;
}

int tkv_tokenizer_cp_to_byte_(uint32_t cp)
{
    if ((cp >= 0x21 && cp <= 0x7E) || (cp >= 0xA1 && cp <= 0xAC) || (cp >= 0xAE && cp <= 0xFF))
        return (int)cp;
    if (cp < 0x100 || cp >= 0x100 + 68)
        return -1;
    uint32_t n = cp - 0x100;
    return n <= 0x20 ? (int)n : n <= 0x20 + 0x22 ? (int)(0x7F + (n - 0x21)) : 0xAD;
}

/* ---- UTF-8 ------------------------------------------------------------------- */

/* Decodes one code point at s[0..n) (n >= 1) the way llama.cpp's
 * unicode_cpt_from_utf8 does: lead and continuation bits are checked, but
 * overlong forms and surrogates are accepted. Anything else, including a
 * sequence that would decode above U+10FFFF, is one invalid byte, returned as
 * U+FFFD with *len = 1. */
static uint32_t utf8_decode(const uint8_t *s, size_t n, uint32_t *len)
{
    uint8_t b0 = s[0];
    if (b0 < 0x80) {
        *len = 1;
        return b0;
    }
    uint32_t need, cp;
    if ((b0 & 0xE0) == 0xC0) {
        need = 1;
        cp = b0 & 0x1F;
    } else if ((b0 & 0xF0) == 0xE0) {
        need = 2;
        cp = b0 & 0x0F;
    } else if ((b0 & 0xF8) == 0xF0) {
        need = 3;
        cp = b0 & 0x07;
    } else {
        *len = 1; /* continuation byte as lead, or 0xF8-0xFF */
        return 0xFFFD;
    }
    if (need >= n) {
        *len = 1;
        return 0xFFFD;
    }
    for (uint32_t k = 1; k <= need; k++) {
        if ((s[k] & 0xC0) != 0x80) {
            *len = 1;
            return 0xFFFD;
        }
        cp = (cp << 6) | (s[k] & 0x3F);
    }
    if (cp > 0x10FFFF) {
        *len = 1;
        return 0xFFFD;
    }
    *len = need + 1;
    return cp;
}

/* Writes cp (<= 0x10FFFF) as UTF-8; returns the byte count. */
static uint32_t utf8_encode(uint32_t cp, uint8_t *out)
{
    if (cp < 0x80) {
        out[0] = (uint8_t)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (uint8_t)(0xC0 | (cp >> 6));
        out[1] = (uint8_t)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (uint8_t)(0xE0 | (cp >> 12));
        out[1] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (uint8_t)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (uint8_t)(0xF0 | (cp >> 18));
    out[1] = (uint8_t)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (uint8_t)(0x80 | (cp & 0x3F));
    return 4;
}

/* ---- hashing ------------------------------------------------------------------ */

static uint64_t hash_bytes(const char *s, uint64_t n)
{
    uint64_t h = 0xcbf29ce484222325ULL; /* FNV-1a */
    for (uint64_t i = 0; i < n; i++)
        h = (h ^ (uint8_t)s[i]) * 0x100000001b3ULL;
    return h ^ (h >> 29);
}

static uint64_t hash_u64(uint64_t x)
{
    x ^= x >> 30; /* splitmix64 finaliser */
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

static uint64_t pow2_at_least(uint64_t n)
{
    uint64_t p = 16;
    while (p < n)
        p <<= 1;
    return p;
}

static inline const char *sym_str(const tkv_tokenizer *t, int32_t id, uint64_t *len)
{
    *len = t->off[id + 1] - t->off[id];
    return t->blob + t->off[id];
}

/* Slot of string s in the string table: holds its id, or -1 where it would go. */
static uint64_t str_slot(const tkv_tokenizer *t, const char *s, uint64_t n)
{
    uint64_t i = hash_bytes(s, n) & t->str_mask;
    for (;;) {
        int32_t id = t->str_slots[i];
        if (id < 0)
            return i;
        uint64_t len;
        const char *p = sym_str(t, id, &len);
        if (len == n && memcmp(p, s, n) == 0)
            return i;
        i = (i + 1) & t->str_mask;
    }
}

/* Symbol id of a string, or -1 when it is neither a token nor a merge string. */
static int32_t str_lookup(const tkv_tokenizer *t, const char *s, uint64_t n)
{
    return t->str_slots[str_slot(t, s, n)];
}

static const struct tkv_merge_slot *merge_find(const tkv_tokenizer *t, int32_t a, int32_t b)
{
    uint64_t key = (((uint64_t)(uint32_t)a << 32) | (uint32_t)b) + 1;
    uint64_t i = hash_u64(key) & t->merge_mask;
    for (;;) {
        const struct tkv_merge_slot *s = &t->merge_slots[i];
        if (s->key == key)
            return s;
        if (s->key == 0)
            return NULL;
        i = (i + 1) & t->merge_mask;
    }
}

/* ---- output sinks ------------------------------------------------------------- */

struct tok_sink {
    tkv_token *out;
    size_t     cap, n;
};

static inline void sink_put(struct tok_sink *k, tkv_token id)
{
    if (k->n < k->cap)
        k->out[k->n] = id;
    k->n++;
}

/* ---- pre-tokenizer matchers ------------------------------------------------------ *
 *
 * A fragment is an array of code points cp[] with class bits fl[] (TKV_UCP_*).
 * Each stage takes one piece [a, b) and appends the ends of its sub-pieces to
 * a list; a match and the unmatched text before it are both pieces. Outside
 * the piece, class() answers OOR, which no class test matches, so lookahead
 * stops at the piece boundary like llama.cpp's _get_flags() does.
 */

#define OOR 0x80u

struct ends {
    uint32_t *v;
    size_t    n, cap;
    bool      oom;
};

static void ends_push(struct ends *e, uint32_t end)
{
    if (e->n == e->cap) {
        size_t cap = e->cap ? e->cap * 2 : 256;
        uint32_t *v = realloc(e->v, cap * sizeof *v);
        if (!v) {
            e->oom = true;
            return;
        }
        e->v = v;
        e->cap = cap;
    }
    e->v[e->n++] = end;
}

struct frag {
    const uint32_t *cp;
    const uint8_t  *fl;
};

struct splitter {
    const struct frag *f;
    size_t      a, b, prev;
    struct ends *out;
};

static inline uint32_t cls(const struct splitter *s, size_t p) { return p < s->b ? s->f->fl[p] : OOR; }
static inline uint32_t cpt(const struct splitter *s, size_t p) { return p < s->b ? s->f->cp[p] : 0xFFFFFFFFu; }
static inline bool is_other(uint32_t c) { return !(c & (TKV_UCP_L | TKV_UCP_N | TKV_UCP_WS | OOR)); }

/* Emits [prev, end) if non-empty; returns its length. */
static size_t emit(struct splitter *s, size_t end)
{
    size_t len = end - s->prev;
    if (len)
        ends_push(s->out, (uint32_t)end);
    s->prev = end;
    return len;
}

/* 's|'t|'re|'ve|'m|'ll|'d at p (lower case only unless fold); returns its
 * length or 0. */
static size_t contraction(const struct splitter *s, size_t p, bool fold)
{
    if (cpt(s, p) != '\'' || p + 1 >= s->b)
        return 0;
    uint32_t c1 = cpt(s, p + 1);
    if (fold && c1 >= 'A' && c1 <= 'Z')
        c1 += 32;
    if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd')
        return 2;
    if (p + 2 >= s->b)
        return 0;
    uint32_t c2 = cpt(s, p + 2);
    if (fold && c2 >= 'A' && c2 <= 'Z')
        c2 += 32;
    if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l'))
        return 3;
    return 0;
}

/* GPT-2: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ */
static void split_gpt2(struct splitter *s)
{
    size_t pos = s->a;
    while (pos < s->b) {
        uint32_t c = cpt(s, pos), f = cls(s, pos);
        size_t k = contraction(s, pos, false);
        if (k) {
            pos += emit(s, pos + k);
            continue;
        }
        uint32_t f2 = c == ' ' ? cls(s, pos + 1) : f;
        if (f2 & TKV_UCP_L) { /* ' ?\p{L}+' */
            pos += c == ' ';
            while (cls(s, pos) & TKV_UCP_L)
                pos++;
            emit(s, pos);
            continue;
        }
        if (f2 & TKV_UCP_N) { /* ' ?\p{N}+' */
            pos += c == ' ';
            while (cls(s, pos) & TKV_UCP_N)
                pos++;
            emit(s, pos);
            continue;
        }
        if (is_other(f2)) { /* ' ?[^\s\p{L}\p{N}]+' */
            pos += c == ' ';
            while (is_other(cls(s, pos)))
                pos++;
            emit(s, pos);
            continue;
        }
        size_t nws = 0;
        while (cls(s, pos + nws) & TKV_UCP_WS)
            nws++;
        if (nws > 1 && pos + nws < s->b) { /* '\s+(?!\S)': leave the last one for the next word */
            pos += nws - 1;
            emit(s, pos);
            continue;
        }
        if (nws > 0) { /* '\s+' */
            pos += nws;
            emit(s, pos);
            continue;
        }
        emit(s, ++pos); /* not reached: every code point matches one branch */
    }
}

/* Llama 3 (max_digits 3) and Qwen2 (max_digits 1):
 * (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,max}|
 *  ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+ */
static void split_llama3(struct splitter *s, size_t max_digits)
{
    size_t pos = s->a;
    while (pos < s->b) {
        uint32_t c = cpt(s, pos), f = cls(s, pos);
        size_t k = contraction(s, pos, true);
        if (k) {
            pos += emit(s, pos + k);
            continue;
        }
        if (!(c == '\r' || c == '\n' || (f & TKV_UCP_N)) && ((f & TKV_UCP_L) || (cls(s, pos + 1) & TKV_UCP_L))) {
            pos++; /* the optional non-letter prefix, or the first letter */
            while (cls(s, pos) & TKV_UCP_L)
                pos++;
            emit(s, pos);
            continue;
        }
        if (f & TKV_UCP_N) {
            size_t ini = pos;
            while (cls(s, pos) & TKV_UCP_N) {
                if (++pos - ini >= max_digits) {
                    emit(s, pos);
                    ini = pos;
                }
            }
            emit(s, pos);
            continue;
        }
        uint32_t f2 = c == ' ' ? cls(s, pos + 1) : f;
        if (!(f2 & (TKV_UCP_L | TKV_UCP_N | TKV_UCP_WS))) { /* ' ?[^\s\p{L}\p{N}]+[\r\n]*' */
            pos += c == ' ';
            while (is_other(cls(s, pos)))
                pos++;
            while (cpt(s, pos) == '\r' || cpt(s, pos) == '\n')
                pos++;
            emit(s, pos);
            continue;
        }
        size_t nws = 0, last_rn = 0;
        while (cls(s, pos + nws) & TKV_UCP_WS) {
            uint32_t c2 = cpt(s, pos + nws);
            if (c2 == '\r' || c2 == '\n')
                last_rn = pos + nws + 1;
            nws++;
        }
        if (last_rn > 0) { /* '\s*[\r\n]+' */
            pos = last_rn;
            emit(s, pos);
            continue;
        }
        if (nws > 1 && pos + nws < s->b) { /* '\s+(?!\S)' */
            pos += nws - 1;
            emit(s, pos);
            continue;
        }
        if (nws > 0) {
            pos += nws;
            emit(s, pos);
            continue;
        }
        emit(s, ++pos);
    }
}

/* Splits [a, b) into runs of code points for which in(cp, class) holds, and
 * the gaps between them; each run is one piece, or (single) one piece per
 * code point. */
static void split_runs(struct splitter *s, bool (*in)(uint32_t cp, uint32_t cls), bool single)
{
    size_t pos = s->a;
    while (pos < s->b) {
        if (!in(cpt(s, pos), cls(s, pos))) {
            pos++;
            continue;
        }
        emit(s, pos); /* the gap before the run */
        if (single)
            pos++;
        else
            while (pos < s->b && in(cpt(s, pos), cls(s, pos)))
                pos++;
        emit(s, pos);
    }
    emit(s, s->b);
}

static bool in_number(uint32_t cp, uint32_t c) { return (c & TKV_UCP_N) != 0; }

/* llama.cpp "default" stage 1: [\p{P}\$\+<=>\^~\|]+ */
static bool in_punct(uint32_t cp, uint32_t c)
{
    return (c & TKV_UCP_P) || (cp != 0 && cp < 128 && strchr("$+<=>^~|", (int)cp) != NULL);
}

/* llama.cpp "default" stage 4: [0-9][0-9][0-9], leftmost, non-overlapping. */
static void split_digits3(struct splitter *s)
{
    size_t pos = s->a;
    while (pos + 3 <= s->b) {
        bool d3 = true;
        for (size_t k = 0; k < 3; k++)
            d3 = d3 && cpt(s, pos + k) >= '0' && cpt(s, pos + k) <= '9';
        if (!d3) {
            pos++;
            continue;
        }
        emit(s, pos);
        pos += 3;
        emit(s, pos);
    }
    emit(s, s->b);
}

enum stage { ST_NUM_EACH, ST_NUM_RUNS, ST_GPT2, ST_LLAMA3, ST_QWEN2, ST_PUNCT, ST_DIGITS3 };

static void run_stage(enum stage st, struct splitter *s)
{
    switch (st) {
    case ST_NUM_EACH: split_runs(s, in_number, true); break;
    case ST_NUM_RUNS: split_runs(s, in_number, false); break;
    case ST_GPT2: split_gpt2(s); emit(s, s->b); break;
    case ST_LLAMA3: split_llama3(s, 3); emit(s, s->b); break;
    case ST_QWEN2: split_llama3(s, 1); emit(s, s->b); break;
    case ST_PUNCT: split_runs(s, in_punct, false); break;
    case ST_DIGITS3: split_digits3(s); break;
    }
}

static uint32_t pre_stages(enum tkv_pre pre, enum stage *st)
{
    switch (pre) {
    case TKV_PRE_SMOLLM: st[0] = ST_NUM_EACH; st[1] = ST_GPT2; return 2;
    case TKV_PRE_GPT2: st[0] = ST_GPT2; return 1;
    case TKV_PRE_LLAMA3: st[0] = ST_LLAMA3; return 1;
    case TKV_PRE_QWEN2: st[0] = ST_QWEN2; return 1;
    case TKV_PRE_DEFAULT:
        st[0] = ST_PUNCT; st[1] = ST_GPT2; st[2] = ST_NUM_RUNS; st[3] = ST_DIGITS3;
        return 4;
    }
    return 0;
}

/* Splits cp[0, n) into pieces; on success *ends (caller frees ends->v) holds
 * the end offset of every piece, in order. */
static tkv_status pretokenize(enum tkv_pre pre, const struct frag *f, size_t n, struct ends *out)
{
    enum stage st[4];
    uint32_t n_st = pre_stages(pre, st);
    struct ends cur = {0}, next = {0};
    ends_push(&cur, (uint32_t)n);
    for (uint32_t i = 0; i < n_st && !cur.oom; i++) {
        next.n = 0;
        size_t a = 0;
        for (size_t j = 0; j < cur.n && !next.oom; j++) {
            struct splitter s = {f, a, cur.v[j], a, &next};
            run_stage(st[i], &s);
            a = cur.v[j];
        }
        struct ends tmp = cur;
        cur = next;
        next = tmp;
        if (next.oom)
            cur.oom = true;
    }
    free(next.v);
    if (cur.oom) {
        free(cur.v);
        return tkv_err(TKV_ERR_NOMEM, "tokenizer: out of memory splitting %zu code points", n);
    }
    *out = cur;
    return TKV_OK;
}

/* ---- BPE ------------------------------------------------------------------------ */

struct bigram {
    int32_t rank, left, right, size, result;
};

/* Per-call scratch, grown as needed; never shared between calls. */
struct scratch {
    uint8_t  *bytes;          /* the piece re-encoded as UTF-8 */
    int32_t  *id, *len, *prev, *next;
    struct bigram *heap;
    size_t    cap, heap_cap, n_heap;
    char     *mapped;         /* the piece through bytes_to_unicode (ignore_merges) */
};

static bool scratch_reserve(struct scratch *w, size_t m)
{
    if (m <= w->cap)
        return true;
    size_t cap = m < 64 ? 64 : m * 2;
    uint8_t *b = realloc(w->bytes, cap);
    if (b)
        w->bytes = b;
    int32_t **arrs[4] = {&w->id, &w->len, &w->prev, &w->next};
    bool ok = b != NULL;
    for (int i = 0; i < 4 && ok; i++) {
        int32_t *p = realloc(*arrs[i], cap * sizeof(int32_t));
        if (p)
            *arrs[i] = p;
        ok = p != NULL;
    }
    char *mp = ok ? realloc(w->mapped, cap * 2) : NULL;
    if (mp)
        w->mapped = mp;
    ok = ok && mp;
    if (ok)
        w->cap = cap;
    return ok;
}

static void scratch_free(struct scratch *w)
{
    free(w->bytes);
    free(w->id);
    free(w->len);
    free(w->prev);
    free(w->next);
    free(w->heap);
    free(w->mapped);
}

static inline bool bigram_less(const struct bigram *x, const struct bigram *y)
{
    return x->rank < y->rank || (x->rank == y->rank && x->left < y->left);
}

static bool heap_push(struct scratch *w, struct bigram g)
{
    if (w->n_heap == w->heap_cap) {
        size_t cap = w->heap_cap ? w->heap_cap * 2 : 64;
        struct bigram *h = realloc(w->heap, cap * sizeof *h);
        if (!h)
            return false;
        w->heap = h;
        w->heap_cap = cap;
    }
    size_t i = w->n_heap++;
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (!bigram_less(&g, &w->heap[parent]))
            break;
        w->heap[i] = w->heap[parent];
        i = parent;
    }
    w->heap[i] = g;
    return true;
}

static struct bigram heap_pop(struct scratch *w)
{
    struct bigram top = w->heap[0], last = w->heap[--w->n_heap];
    size_t i = 0, n = w->n_heap;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n)
            break;
        if (c + 1 < n && bigram_less(&w->heap[c + 1], &w->heap[c]))
            c++;
        if (!bigram_less(&w->heap[c], &last))
            break;
        w->heap[i] = w->heap[c];
        i = c;
    }
    if (n)
        w->heap[i] = last;
    return top;
}

static bool try_bigram(const tkv_tokenizer *t, struct scratch *w, int32_t l, int32_t r)
{
    if (l < 0 || r < 0 || w->id[l] < 0 || w->id[r] < 0)
        return true;
    const struct tkv_merge_slot *m = merge_find(t, w->id[l], w->id[r]);
    if (!m)
        return true;
    struct bigram g = {m->rank, l, r, w->len[l] + w->len[r], m->result};
    return heap_push(w, g);
}

/* Emits the final symbol covering piece bytes [start, start + len) with
 * symbol id `id`: its token, or llama.cpp's byte fallback. */
static void emit_symbol(const tkv_tokenizer *t, const struct scratch *w, int32_t id, int32_t start, int32_t len,
                        struct tok_sink *k)
{
    if (id >= 0 && (uint32_t)id < t->n_vocab) {
        sink_put(k, id);
        return;
    }
    for (int32_t i = start; i < start + len; i++) {
        uint8_t b = w->bytes[i];
        for (uint32_t j = 0; j < t->map_len[b]; j++) {
            int32_t tok = t->byte_tok[t->map_utf8[b][j]];
            if (tok >= 0)
                sink_put(k, tok);
        }
    }
}

/* BPE over the m bytes in w->bytes. */
static tkv_status bpe_piece(const tkv_tokenizer *t, struct scratch *w, size_t m, struct tok_sink *k)
{
    if (m == 1) {
        emit_symbol(t, w, t->byte_sym[w->bytes[0]], 0, 1, k);
        return TKV_OK;
    }
    if (t->ignore_merges) {
        size_t n = 0;
        for (size_t i = 0; i < m; i++)
            for (uint32_t j = 0; j < t->map_len[w->bytes[i]]; j++)
                w->mapped[n++] = (char)t->map_utf8[w->bytes[i]][j];
        int32_t id = str_lookup(t, w->mapped, n);
        if (id >= 0 && (uint32_t)id < t->n_vocab) {
            sink_put(k, id);
            return TKV_OK;
        }
    }
    for (size_t i = 0; i < m; i++) {
        w->id[i] = t->byte_sym[w->bytes[i]];
        w->len[i] = 1;
        w->prev[i] = (int32_t)i - 1;
        w->next[i] = i + 1 < m ? (int32_t)i + 1 : -1;
    }
    w->n_heap = 0;
    bool ok = true;
    for (size_t i = 1; i < m && ok; i++)
        ok = try_bigram(t, w, (int32_t)i - 1, (int32_t)i);
    while (ok && w->n_heap) {
        struct bigram g = heap_pop(w);
        int32_t l = g.left, r = g.right;
        /* stale: one side was merged away or grew since the pair was queued */
        if (w->len[l] == 0 || w->len[r] == 0 || w->len[l] + w->len[r] != g.size)
            continue;
        w->id[l] = g.result;
        w->len[l] += w->len[r];
        w->len[r] = 0;
        w->next[l] = w->next[r];
        if (w->next[r] >= 0)
            w->prev[w->next[r]] = l;
        ok = try_bigram(t, w, w->prev[l], l) && try_bigram(t, w, l, w->next[l]);
    }
    if (!ok)
        return tkv_err(TKV_ERR_NOMEM, "tokenizer: out of memory in BPE (piece of %zu bytes)", m);
    for (int32_t i = 0; i >= 0; i = w->next[i])
        emit_symbol(t, w, w->id[i], i, w->len[i], k);
    return TKV_OK;
}

/* ---- text fragments ----------------------------------------------------------- */

/* Decodes text[0, n) into code points; cp/fl/src are malloc'd [n]. src[i] is
 * the number of input bytes code point i came from. */
static tkv_status decode_fragment(const char *text, size_t n, uint32_t **cp_out, uint8_t **fl_out, uint8_t **src_out,
                                  size_t *n_cp)
{
    uint32_t *cp = malloc((n ? n : 1) * sizeof *cp);
    uint8_t *fl = malloc(n ? n : 1), *src = malloc(n ? n : 1);
    if (!cp || !fl || !src) {
        free(cp);
        free(fl);
        free(src);
        return tkv_err(TKV_ERR_NOMEM, "tokenizer: out of memory decoding %zu bytes", n);
    }
    const uint8_t *s = (const uint8_t *)text;
    size_t i = 0, k = 0;
    while (i < n) {
        uint32_t len;
        cp[k] = utf8_decode(s + i, n - i, &len);
        fl[k] = (uint8_t)tkv_unicode_flags(cp[k]);
        src[k] = (uint8_t)len;
        k++;
        i += len;
    }
    *cp_out = cp;
    *fl_out = fl;
    *src_out = src;
    *n_cp = k;
    return TKV_OK;
}

static tkv_status encode_fragment(const tkv_tokenizer *t, struct scratch *w, const char *text, size_t n,
                                  struct tok_sink *k)
{
    if (n > UINT32_MAX - 1)
        return tkv_err(TKV_ERR_INVALID_ARG, "tokenizer: text fragment of %zu bytes is too long (max %u)", n,
                       UINT32_MAX - 1);
    uint32_t *cp;
    uint8_t *fl, *src;
    size_t n_cp;
    TKV_TRY(decode_fragment(text, n, &cp, &fl, &src, &n_cp));
    struct frag f = {cp, fl};
    struct ends e = {0};
    tkv_status st = pretokenize(t->pre, &f, n_cp, &e);
    size_t a = 0;
    for (size_t i = 0; st == TKV_OK && i < e.n; i++) {
        size_t b = e.v[i], m = 0;
        if (!scratch_reserve(w, 4 * (b - a))) {
            st = tkv_err(TKV_ERR_NOMEM, "tokenizer: out of memory (piece of %zu code points)", b - a);
            break;
        }
        for (size_t j = a; j < b; j++)
            m += utf8_encode(cp[j], w->bytes + m);
        st = bpe_piece(t, w, m, k);
        a = b;
    }
    free(e.v);
    free(cp);
    free(fl);
    free(src);
    return st;
}

/* ---- special-token partition --------------------------------------------------- */

struct fragment {
    size_t    off, len; /* raw text, when tok < 0 */
    tkv_token tok;
};

struct frag_list {
    struct fragment *v;
    size_t n, cap;
};

static bool frags_push(struct frag_list *l, struct fragment f)
{
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 16;
        struct fragment *v = realloc(l->v, cap * sizeof *v);
        if (!v)
            return false;
        l->v = v;
        l->cap = cap;
    }
    l->v[l->n++] = f;
    return true;
}

/* llama.cpp's tokenizer_st_partition: for each special token, longest first,
 * cut every raw fragment at each of its occurrences (left to right). User-
 * defined tokens are always cut out; unknown and control tokens only when
 * parse_special. On success *l holds the fragments in order. */
static tkv_status partition(const tkv_tokenizer *t, const char *text, size_t n, bool parse_special,
                            struct frag_list *l)
{
    struct frag_list next = {0};
    l->n = 0;
    if (n && !frags_push(l, (struct fragment){0, n, -1}))
        goto oom;
    if (!parse_special && !t->has_user_defined)
        return TKV_OK;
    for (uint32_t si = 0; si < t->n_special && l->n; si++) {
        int32_t id = t->special[si];
        if (!parse_special && t->type[id] != TKV_TT_USER_DEFINED)
            continue;
        uint64_t slen;
        const char *s = sym_str(t, id, &slen);
        next.n = 0;
        for (size_t fi = 0; fi < l->n; fi++) {
            struct fragment f = l->v[fi];
            while (f.tok < 0 && f.len >= slen) {
                const char *hit = memmem(text + f.off, f.len, s, slen);
                if (!hit)
                    break;
                size_t before = (size_t)(hit - (text + f.off));
                if (before && !frags_push(&next, (struct fragment){f.off, before, -1}))
                    goto oom;
                if (!frags_push(&next, (struct fragment){0, 0, id}))
                    goto oom;
                f.off += before + slen;
                f.len -= before + slen;
            }
            if ((f.tok >= 0 || f.len) && !frags_push(&next, f))
                goto oom;
        }
        struct frag_list tmp = *l;
        *l = next;
        next = tmp;
    }
    free(next.v);
    return TKV_OK;
oom:
    free(next.v);
    return tkv_err(TKV_ERR_NOMEM, "tokenizer: out of memory partitioning special tokens");
}

/* ---- public: encode / decode / chat ------------------------------------------- */

tkv_status tkv_tokenizer_encode(const tkv_tokenizer *t, const char *text, size_t len, unsigned flags,
                                tkv_token *out, size_t cap, size_t *n_out)
{
    if (!t || !n_out || (!text && len) || (!out && cap))
        return tkv_err(TKV_ERR_INVALID_ARG, "tokenizer: encode: %s is NULL",
                       !t ? "tokenizer" : !n_out ? "n_out" : !out && cap ? "out (with cap > 0)" : "text");
    if (flags & ~TKV_TOK_ALL_FLAGS)
        return tkv_err(TKV_ERR_INVALID_ARG, "tokenizer: encode: unknown flags 0x%x", flags & ~TKV_TOK_ALL_FLAGS);
    *n_out = 0;
    struct tok_sink k = {out, cap, 0};
    if ((flags & TKV_TOK_ADD_BOS) && t->add_bos && t->bos >= 0)
        sink_put(&k, t->bos);

    struct frag_list l = {0};
    struct scratch w = {0};
    tkv_status st = partition(t, text, len, (flags & TKV_TOK_PARSE_SPECIAL) != 0, &l);
    for (size_t i = 0; st == TKV_OK && i < l.n; i++) {
        if (l.v[i].tok >= 0)
            sink_put(&k, l.v[i].tok);
        else
            st = encode_fragment(t, &w, text + l.v[i].off, l.v[i].len, &k);
    }
    free(l.v);
    scratch_free(&w);
    if (st != TKV_OK)
        return st;
    *n_out = k.n;
    if (k.n > cap)
        return tkv_err(TKV_ERR_TOO_SMALL, "tokenizer: encode: the text needs %zu tokens, out has room for %zu", k.n,
                       cap);
    return TKV_OK;
}

/* Copies n bytes to buf at *pos if they fit (always counts them). */
static void put_bytes(char *buf, size_t cap, size_t *pos, const char *s, size_t n)
{
    if (*pos < cap)
        memcpy(buf + *pos, s, TKV_MIN(n, cap - *pos));
    *pos += n;
}

static tkv_status finish_text(char *buf, size_t cap, size_t len, size_t *len_out, const char *what)
{
    *len_out = len;
    if (len > cap)
        return tkv_err(TKV_ERR_TOO_SMALL, "tokenizer: %s needs %zu bytes, buf has %zu", what, len, cap);
    if (len < cap)
        buf[len] = '\0';
    return TKV_OK;
}

tkv_status tkv_tokenizer_decode(const tkv_tokenizer *t, const tkv_token *toks, size_t n, unsigned flags,
                                char *buf, size_t cap, size_t *len_out)
{
    if (!t || !len_out || (!toks && n) || (!buf && cap))
        return tkv_err(TKV_ERR_INVALID_ARG, "tokenizer: decode: %s is NULL",
                       !t ? "tokenizer" : !len_out ? "len_out" : !buf && cap ? "buf (with cap > 0)" : "toks");
    if (flags & ~TKV_TOK_ALL_FLAGS)
        return tkv_err(TKV_ERR_INVALID_ARG, "tokenizer: decode: unknown flags 0x%x", flags & ~TKV_TOK_ALL_FLAGS);
    *len_out = 0;
    for (size_t i = 0; i < n; i++)
        if (toks[i] < 0 || (uint32_t)toks[i] >= t->n_vocab)
            return tkv_err(TKV_ERR_INVALID_ARG, "tokenizer: decode: token %d at index %zu is out of range [0, %u)",
                           (int)toks[i], i, t->n_vocab);
    bool render = (flags & TKV_TOK_RENDER_SPECIAL) != 0;
    size_t pos = 0;
    for (size_t i = 0; i < n; i++) {
        uint8_t ty = t->type[toks[i]];
        if ((ty == TKV_TT_CONTROL || ty == TKV_TT_UNKNOWN) && !render)
            continue;
        put_bytes(buf, cap, &pos, t->dec_blob + t->dec_off[toks[i]], t->dec_off[toks[i] + 1] - t->dec_off[toks[i]]);
    }
    return finish_text(buf, cap, pos, len_out, "decode");
}

tkv_status tkv_tokenizer_chat(const tkv_tokenizer *t, const char *system, const char *user, char *buf, size_t cap,
                              size_t *len_out)
{
    if (!t || !user || !len_out || (!buf && cap))
        return tkv_err(TKV_ERR_INVALID_ARG, "tokenizer: chat: %s is NULL",
                       !t ? "tokenizer" : !user ? "user" : !len_out ? "len_out" : "buf (with cap > 0)");
    *len_out = 0;
    if (t->im_start < 0 || t->im_end < 0)
        return tkv_err(TKV_ERR_UNSUPPORTED, "tokenizer: model has no chat template tierkv knows "
                                            "(only ChatML: no <|im_start|>/<|im_end|> tokens in the vocabulary)");
    if (!system && t->chat_smollm_system)
        system = tkv_smollm_system;
    size_t pos = 0;
#define PUT(s) put_bytes(buf, cap, &pos, (s), strlen(s))
    if (system) {
        PUT("<|im_start|>system\n");
        PUT(system);
        PUT("<|im_end|>\n");
    }
    PUT("<|im_start|>user\n");
    PUT(user);
    PUT("<|im_end|>\n<|im_start|>assistant\n");
#undef PUT
    return finish_text(buf, cap, pos, len_out, "chat prompt");
}

/* ---- internal, for tests ------------------------------------------------------- */

tkv_status tkv_tokenizer_pretokenize_(const char *pre, const char *text, size_t len, size_t *lens, size_t cap,
                                      size_t *n_out)
{
    if (!pre || !n_out || (!text && len) || (!lens && cap))
        return tkv_err(TKV_ERR_INVALID_ARG, "tokenizer: pretokenize: NULL argument");
    *n_out = 0;
    int found = -1;
    for (size_t i = 0; i < sizeof tkv_pre_names / sizeof tkv_pre_names[0]; i++)
        if (strcmp(pre, tkv_pre_names[i].name) == 0)
            found = (int)i;
    if (found < 0)
        return tkv_err(TKV_ERR_UNSUPPORTED, "tokenizer: pre-tokenizer '%s' is not supported", pre);
    if (len > UINT32_MAX - 1)
        return tkv_err(TKV_ERR_INVALID_ARG, "tokenizer: pretokenize: text too long");
    uint32_t *cp;
    uint8_t *fl, *src;
    size_t n_cp;
    TKV_TRY(decode_fragment(text, len, &cp, &fl, &src, &n_cp));
    struct frag f = {cp, fl};
    struct ends e = {0};
    tkv_status st = pretokenize(tkv_pre_names[found].pre, &f, n_cp, &e);
    if (st == TKV_OK) {
        size_t a = 0;
        for (size_t i = 0; i < e.n; i++) {
            size_t bytes = 0;
            for (size_t j = a; j < e.v[i]; j++)
                bytes += src[j];
            if (i < cap)
                lens[i] = bytes;
            a = e.v[i];
        }
        *n_out = e.n;
        if (e.n > cap)
            st = tkv_err(TKV_ERR_TOO_SMALL, "tokenizer: pretokenize: %zu pieces, room for %zu", e.n, cap);
    }
    free(e.v);
    free(cp);
    free(fl);
    free(src);
    return st;
}

/* ---- init ----------------------------------------------------------------------- */

/* Build state for interning strings into t during init. */
struct builder {
    uint64_t blob_cap, sym_cap;
};

/* Id of string s, adding it as a merge-only symbol when new; -1 on overflow. */
static int32_t intern(tkv_tokenizer *t, struct builder *bd, const char *s, uint64_t n)
{
    uint64_t slot = str_slot(t, s, n);
    if (t->str_slots[slot] >= 0)
        return t->str_slots[slot];
    uint64_t at = t->off[t->n_sym];
    if (t->n_sym >= bd->sym_cap || at + n > bd->blob_cap)
        return -1; /* cannot happen: capacities are computed from the merges */
    memmove(t->blob + at, s, n);
    t->off[t->n_sym + 1] = at + n;
    t->str_slots[slot] = (int32_t)t->n_sym;
    return (int32_t)t->n_sym++;
}

static int cmp_special(const void *pa, const void *pb, void *ctx)
{
    const tkv_tokenizer *t = ctx;
    int32_t a = *(const int32_t *)pa, b = *(const int32_t *)pb;
    uint64_t la = t->off[a + 1] - t->off[a], lb = t->off[b + 1] - t->off[b];
    if (la != lb)
        return la > lb ? -1 : 1;
    return a < b ? -1 : a > b;
}

static bool gstr_eq(struct tkv_gguf_str s, const char *lit)
{
    return s.len == strlen(lit) && memcmp(s.ptr, lit, s.len) == 0;
}

static bool gstr_contains(struct tkv_gguf_str s, const char *lit)
{
    return s.len >= strlen(lit) && memmem(s.ptr, s.len, lit, strlen(lit)) != NULL;
}

static tkv_status read_token_id(const tkv_gguf *g, const char *key, uint32_t n_vocab, tkv_token *out)
{
    uint32_t v = UINT32_MAX;
    TKV_TRY(tkv_gguf_get_u32(g, key, false, &v));
    if (v == UINT32_MAX)
        return TKV_OK;
    if (v >= n_vocab)
        return tkv_err(TKV_ERR_FORMAT, "tokenizer: %s = %u is not a token id (vocabulary has %u tokens)", key, v,
                       n_vocab);
    *out = (tkv_token)v;
    return TKV_OK;
}

static void add_eog(tkv_tokenizer *t, tkv_token id)
{
    if (id < 0)
        return;
    for (uint32_t i = 0; i < t->n_eog; i++)
        if (t->eog[i] == id)
            return;
    if (t->n_eog < TKV_MAX_EOG)
        t->eog[t->n_eog++] = id;
}

static tkv_status load_model_kind(tkv_tokenizer *t, const tkv_gguf *g)
{
    struct tkv_gguf_str model, pre = {"default", 7};
    TKV_TRY(tkv_gguf_get_str(g, "tokenizer.ggml.model", true, &model));
    if (gstr_eq(model, "llama"))
        return tkv_err(TKV_ERR_UNSUPPORTED, "tokenizer model 'llama' (SentencePiece) is not supported yet; "
                                            "tierkv supports gpt2 BPE");
    if (!gstr_eq(model, "gpt2"))
        return tkv_err(TKV_ERR_UNSUPPORTED, "tokenizer model '%.*s' is not supported; tierkv supports gpt2 BPE",
                       (int)TKV_MIN(model.len, 64), model.ptr);
    TKV_TRY(tkv_gguf_get_str(g, "tokenizer.ggml.pre", false, &pre));
    for (size_t i = 0; i < sizeof tkv_pre_names / sizeof tkv_pre_names[0]; i++) {
        if (gstr_eq(pre, tkv_pre_names[i].name)) {
            t->pre = tkv_pre_names[i].pre;
            snprintf(t->pre_name, sizeof t->pre_name, "%s", tkv_pre_names[i].name);
            t->ignore_merges = t->pre == TKV_PRE_LLAMA3;
            t->add_bos = t->pre == TKV_PRE_LLAMA3; /* llama.cpp's default; the GGUF key overrides */
            return TKV_OK;
        }
    }
    return tkv_err(TKV_ERR_UNSUPPORTED,
                   "tokenizer: pre-tokenizer '%.*s' (tokenizer.ggml.pre) is not supported; tierkv supports "
                   "smollm, llama-bpe, qwen2, gpt2 and default",
                   (int)TKV_MIN(pre.len, 64), pre.ptr);
}

static tkv_status load_vocab(tkv_tokenizer *t, const tkv_gguf *g, const struct tkv_gguf_kv *toks,
                             const struct tkv_gguf_kv *merges, struct builder *bd)
{
    uint64_t n = toks->v.arr.n, n_merges = merges->v.arr.n, tok_bytes = 0, merge_bytes = 0;
    if (n == 0 || n > INT32_MAX / 4)
        return tkv_err(TKV_ERR_FORMAT, "tokenizer: tokenizer.ggml.tokens has %llu entries (expected 1..%d)",
                       (unsigned long long)n, INT32_MAX / 4);
    if (n_merges > INT32_MAX / 4)
        return tkv_err(TKV_ERR_FORMAT, "tokenizer: tokenizer.ggml.merges has %llu entries (max %d)",
                       (unsigned long long)n_merges, INT32_MAX / 4);
    for (uint64_t i = 0; i < n; i++)
        tok_bytes += tkv_gguf_arr_str(g, toks, i).len;
    for (uint64_t i = 0; i < n_merges; i++)
        merge_bytes += tkv_gguf_arr_str(g, merges, i).len;
    /* each merge adds at most three strings: its two parts and their concatenation */
    bd->sym_cap = n + 3 * n_merges;
    bd->blob_cap = tok_bytes + 2 * merge_bytes;
    t->n_vocab = (uint32_t)n;
    t->blob = malloc(bd->blob_cap ? bd->blob_cap : 1);
    t->off = malloc((bd->sym_cap + 1) * sizeof *t->off);
    t->type = malloc(n);
    t->str_mask = pow2_at_least(2 * bd->sym_cap) - 1;
    t->str_slots = malloc((t->str_mask + 1) * sizeof *t->str_slots);
    t->merge_mask = pow2_at_least(2 * n_merges) - 1;
    t->merge_slots = calloc(t->merge_mask + 1, sizeof *t->merge_slots);
    if (!t->blob || !t->off || !t->type || !t->str_slots || !t->merge_slots)
        return tkv_err(TKV_ERR_NOMEM, "tokenizer: out of memory for %llu tokens and %llu merges",
                       (unsigned long long)n, (unsigned long long)n_merges);
    memset(t->str_slots, 0xff, (t->str_mask + 1) * sizeof *t->str_slots);

    /* vocabulary: a repeated string maps to its last id, like llama.cpp */
    t->off[0] = 0;
    for (uint64_t i = 0; i < n; i++) {
        struct tkv_gguf_str s = tkv_gguf_arr_str(g, toks, i);
        memcpy(t->blob + t->off[i], s.ptr, s.len);
        t->off[i + 1] = t->off[i] + s.len;
        t->type[i] = TKV_TT_NORMAL;
        if (s.len)
            t->str_slots[str_slot(t, s.ptr, s.len)] = (int32_t)i;
    }
    t->n_sym = (uint32_t)n;

    /* merges "A B", split at the first space after position 0; rank = index;
     * a repeated pair keeps its first (lowest) rank */
    for (uint64_t i = 0; i < n_merges; i++) {
        struct tkv_gguf_str s = tkv_gguf_arr_str(g, merges, i);
        const char *sp = s.len > 1 ? memchr(s.ptr + 1, ' ', s.len - 1) : NULL;
        if (!sp || sp + 1 == s.ptr + s.len)
            continue; /* no second part: can never match two symbols */
        uint64_t la = (uint64_t)(sp - s.ptr), lb = s.len - la - 1;
        int32_t a = intern(t, bd, s.ptr, la);
        int32_t b = a >= 0 ? intern(t, bd, sp + 1, lb) : -1;
        /* the concatenation is built at the end of the blob, then interned in place */
        uint64_t at = t->off[t->n_sym];
        int32_t r = -1;
        if (b >= 0 && at + la + lb <= bd->blob_cap) {
            memcpy(t->blob + at, s.ptr, la);
            memcpy(t->blob + at + la, sp + 1, lb);
            r = intern(t, bd, t->blob + at, la + lb);
        }
        if (r < 0)
            return tkv_err(TKV_ERR_INTERNAL, "tokenizer: symbol table overflow at merge %llu",
                           (unsigned long long)i);
        uint64_t key = (((uint64_t)(uint32_t)a << 32) | (uint32_t)b) + 1;
        uint64_t j = hash_u64(key) & t->merge_mask;
        while (t->merge_slots[j].key && t->merge_slots[j].key != key)
            j = (j + 1) & t->merge_mask;
        if (!t->merge_slots[j].key)
            t->merge_slots[j] = (struct tkv_merge_slot){key, (int32_t)i, r};
    }
    return TKV_OK;
}

static tkv_status load_types(tkv_tokenizer *t, const tkv_gguf *g)
{
    const struct tkv_gguf_kv *types;
    TKV_TRY(tkv_gguf_get_arr(g, "tokenizer.ggml.token_type", false, TKV_GGUF_I32, &types));
    if (!types)
        return TKV_OK; /* all normal, like llama.cpp */
    if (types->v.arr.n != t->n_vocab)
        return tkv_err(TKV_ERR_FORMAT, "tokenizer: tokenizer.ggml.token_type has %llu entries, tokens has %u",
                       (unsigned long long)types->v.arr.n, t->n_vocab);
    for (uint32_t i = 0; i < t->n_vocab; i++) {
        int64_t ty = tkv_gguf_arr_i64(types, i);
        t->type[i] = ty >= TKV_TT_NORMAL && ty <= TKV_TT_BYTE ? (uint8_t)ty : TKV_TT_UNDEFINED;
    }
    return TKV_OK;
}

/* Writes (out != NULL) or counts the decoded bytes of token text s[0, len):
 * llama.cpp's llama_decode_text, the inverse byte map, where a character
 * outside the map becomes "[UNK_BYTE_0x<its UTF-8 in hex><whole text>]". */
static uint64_t decode_normal(const char *s, uint64_t len, char *out)
{
    static const char hex[] = "0123456789abcdef";
    uint64_t pos = 0;
    for (uint64_t j = 0; j < len;) {
        uint32_t n;
        uint32_t cp = utf8_decode((const uint8_t *)s + j, len - j, &n);
        int b = tkv_tokenizer_cp_to_byte_(cp);
        if (b >= 0) {
            if (out)
                out[pos] = (char)b;
            pos++;
        } else {
            uint8_t u[4];
            uint32_t ul = utf8_encode(cp, u);
            if (out) {
                memcpy(out + pos, "[UNK_BYTE_0x", 12);
                for (uint32_t q = 0; q < ul; q++) {
                    out[pos + 12 + 2 * q] = hex[u[q] >> 4];
                    out[pos + 13 + 2 * q] = hex[u[q] & 15];
                }
                memcpy(out + pos + 12 + 2 * ul, s, len);
                out[pos + 12 + 2 * ul + len] = ']';
            }
            pos += 12 + 2 * (uint64_t)ul + len + 1;
        }
        j += n;
    }
    return pos;
}

/* A BYTE token's "<0xXX>" value, or -1. */
static int byte_token_value(const char *s, uint64_t len)
{
    if (len != 6 || memcmp(s, "<0x", 3) != 0 || s[5] != '>')
        return -1;
    int v = 0;
    for (int i = 3; i < 5; i++) {
        char c = s[i];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (d < 0)
            return -1;
        v = v * 16 + d;
    }
    return v;
}

/* Writes or counts the decoded bytes of token i (llama.cpp's token_to_piece
 * for BPE): normal tokens through decode_normal, control, unknown and
 * user-defined tokens as their text (control/unknown are skipped at decode
 * time unless TKV_TOK_RENDER_SPECIAL), "<0xXX>" byte tokens as the byte, the
 * rest (undefined, unused) as nothing. */
static uint64_t decoded_token(const tkv_tokenizer *t, uint32_t i, char *out)
{
    uint64_t len;
    const char *s = sym_str(t, (int32_t)i, &len);
    switch (t->type[i]) {
    case TKV_TT_NORMAL:
        return decode_normal(s, len, out);
    case TKV_TT_CONTROL:
    case TKV_TT_UNKNOWN:
    case TKV_TT_USER_DEFINED:
        if (out)
            memcpy(out, s, len);
        return len;
    case TKV_TT_BYTE: {
        int b = byte_token_value(s, len);
        if (b < 0)
            return 0;
        if (out)
            out[0] = (char)b;
        return 1;
    }
    default:
        return 0;
    }
}

static tkv_status build_decoded(tkv_tokenizer *t)
{
    uint64_t total = 0;
    for (uint32_t i = 0; i < t->n_vocab; i++)
        total += decoded_token(t, i, NULL);
    if (total > SIZE_MAX / 2)
        return tkv_err(TKV_ERR_NOMEM, "tokenizer: decode table of %llu bytes is too large",
                       (unsigned long long)total);
    t->dec_blob = malloc(total ? (size_t)total : 1);
    t->dec_off = malloc(((size_t)t->n_vocab + 1) * sizeof *t->dec_off);
    if (!t->dec_blob || !t->dec_off)
        return tkv_err(TKV_ERR_NOMEM, "tokenizer: out of memory for the decode table (%llu bytes)",
                       (unsigned long long)total);
    t->dec_off[0] = 0;
    for (uint32_t i = 0; i < t->n_vocab; i++)
        t->dec_off[i + 1] = t->dec_off[i] + decoded_token(t, i, t->dec_blob + t->dec_off[i]);
    return TKV_OK;
}

tkv_status tkv_tokenizer_init(const tkv_gguf *g, tkv_tokenizer **out)
{
    if (!g || !out)
        return tkv_err(TKV_ERR_INVALID_ARG, "tokenizer: init: %s is NULL", !g ? "gguf" : "out");
    *out = NULL;
    tkv_tokenizer *t = calloc(1, sizeof *t);
    if (!t)
        return tkv_err(TKV_ERR_NOMEM, "tokenizer: out of memory");
    t->bos = t->eos = t->im_start = t->im_end = -1;
    tkv_status st = load_model_kind(t, g);

    const struct tkv_gguf_kv *toks = NULL, *merges = NULL;
    if (st == TKV_OK)
        st = tkv_gguf_get_arr(g, "tokenizer.ggml.tokens", true, TKV_GGUF_STRING, &toks);
    if (st == TKV_OK)
        st = tkv_gguf_get_arr(g, "tokenizer.ggml.merges", true, TKV_GGUF_STRING, &merges);
    struct builder bd = {0};
    if (st == TKV_OK)
        st = load_vocab(t, g, toks, merges, &bd);
    if (st == TKV_OK)
        st = load_types(t, g);
    if (st == TKV_OK)
        st = read_token_id(g, "tokenizer.ggml.bos_token_id", t->n_vocab, &t->bos);
    if (st == TKV_OK)
        st = read_token_id(g, "tokenizer.ggml.eos_token_id", t->n_vocab, &t->eos);
    tkv_token eot = -1, eom = -1;
    if (st == TKV_OK)
        st = read_token_id(g, "tokenizer.ggml.eot_token_id", t->n_vocab, &eot);
    if (st == TKV_OK)
        st = read_token_id(g, "tokenizer.ggml.eom_token_id", t->n_vocab, &eom);
    if (st == TKV_OK)
        st = tkv_gguf_get_bool(g, "tokenizer.ggml.add_bos_token", false, &t->add_bos);
    struct tkv_gguf_str tmpl = {"", 0};
    if (st == TKV_OK)
        st = tkv_gguf_get_str(g, "tokenizer.chat_template", false, &tmpl);
    if (st == TKV_OK)
        st = build_decoded(t);
    if (st == TKV_OK) {
        t->special = malloc(((size_t)t->n_vocab) * sizeof *t->special);
        if (!t->special)
            st = tkv_err(TKV_ERR_NOMEM, "tokenizer: out of memory");
    }
    if (st != TKV_OK) {
        tkv_tokenizer_free(t);
        return st;
    }

    /* per-byte tables: the starting symbol of each byte, and the one-byte
     * tokens of llama.cpp's fallback */
    for (int b = 0; b < 256; b++) {
        t->map_len[b] = (uint8_t)utf8_encode(tkv_tokenizer_byte_to_cp_((uint8_t)b), t->map_utf8[b]);
        t->byte_sym[b] = str_lookup(t, (const char *)t->map_utf8[b], t->map_len[b]);
        char c = (char)b;
        int32_t id = str_lookup(t, &c, 1);
        t->byte_tok[b] = id >= 0 && (uint32_t)id < t->n_vocab ? id : -1;
    }

    for (uint32_t i = 0; i < t->n_vocab; i++) {
        uint8_t ty = t->type[i];
        if ((ty == TKV_TT_CONTROL || ty == TKV_TT_UNKNOWN || ty == TKV_TT_USER_DEFINED) && t->off[i + 1] > t->off[i]) {
            t->special[t->n_special++] = (int32_t)i;
            t->has_user_defined |= ty == TKV_TT_USER_DEFINED;
        }
    }
    qsort_r(t->special, t->n_special, sizeof *t->special, cmp_special, t);

    static const char *const eog_names[] = {"<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>"};
    add_eog(t, t->eos);
    add_eog(t, eot);
    add_eog(t, eom);
    for (size_t i = 0; i < sizeof eog_names / sizeof eog_names[0]; i++) {
        int32_t id = str_lookup(t, eog_names[i], strlen(eog_names[i]));
        add_eog(t, id >= 0 && (uint32_t)id < t->n_vocab ? id : -1);
    }
    int32_t id = str_lookup(t, "<|im_start|>", 12);
    t->im_start = id >= 0 && (uint32_t)id < t->n_vocab ? id : -1;
    id = str_lookup(t, "<|im_end|>", 10);
    t->im_end = id >= 0 && (uint32_t)id < t->n_vocab ? id : -1;
    t->chat_smollm_system = gstr_contains(tmpl, tkv_smollm_system);

    TKV_LOG_D("tokenizer: gpt2/%s, %u tokens, %u merge symbols, %u special, bos %d eos %d add_bos %d", t->pre_name,
              t->n_vocab, t->n_sym - t->n_vocab, t->n_special, t->bos, t->eos, t->add_bos);
    *out = t;
    return TKV_OK;
}

void tkv_tokenizer_free(tkv_tokenizer *t)
{
    if (!t)
        return;
    free(t->blob);
    free(t->off);
    free(t->type);
    free(t->str_slots);
    free(t->merge_slots);
    free(t->dec_blob);
    free(t->dec_off);
    free(t->special);
    free(t);
}

/* ---- queries ---------------------------------------------------------------------- */

uint32_t tkv_tokenizer_n_vocab(const tkv_tokenizer *t) { return t ? t->n_vocab : 0; }
tkv_token tkv_tokenizer_bos(const tkv_tokenizer *t) { return t ? t->bos : -1; }
tkv_token tkv_tokenizer_eos(const tkv_tokenizer *t) { return t ? t->eos : -1; }

bool tkv_tokenizer_is_eog(const tkv_tokenizer *t, tkv_token tok)
{
    if (!t)
        return false;
    for (uint32_t i = 0; i < t->n_eog; i++)
        if (t->eog[i] == tok)
            return true;
    return false;
}

bool tkv_tokenizer_is_control(const tkv_tokenizer *t, tkv_token tok)
{
    return t && tok >= 0 && (uint32_t)tok < t->n_vocab && t->type[tok] == TKV_TT_CONTROL;
}
