/*
 * tasks.c -- deterministic generators for the RULER-style tasks of
 * `tierkv eval` (NVIDIA/RULER scripts/data/synthetic/niah.py and its siblings,
 * re-implemented from their mechanics; the pass key follows Landmark
 * attention / LongLoRA).
 *
 * A sample is rendered from three random streams, all derived from
 * (seed, task, index) by tkv_eval_mix:
 *   A  everything that does not depend on the haystack size (keys, values,
 *      variable names, word choices, the pass key and its depth);
 *   B  everything that does, seeded with the size too (needle positions,
 *      shuffles of the word lists);
 *   R  one stream per (seed, task): RULER shuffles the niah needles with a
 *      fixed-seed Random, the same permutation for every sample.
 * So a render is a pure function of (task, ctx, seed, index, size), and the
 * length search can render any size again and get the same bytes.
 *
 * The length search (RULER's generate_samples): the largest haystack size N
 * with tokens(prompt(N)) + tokens_to_generate <= ctx, where prompt is the
 * chat-wrapped task body plus the answer prefix, exactly what the model
 * reads. It brackets N around an estimate from two probes, then bisects to
 * one unit, keeping prompt(N) fitting and prompt(N + 1) not.
 */
#include "eval.h"
#include "tkv-impl.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- PRNG: splitmix64 seeding xoshiro256** -------------------------------------- */

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

uint64_t tkv_eval_mix(uint64_t a, uint64_t b)
{
    uint64_t x = a;
    uint64_t h = splitmix64(&x);
    x = h ^ (b * 0xd1b54a32d192ed03ull + 0x8cb92ba72f3d8dd7ull);
    return splitmix64(&x);
}

void tkv_eval_rng_seed(struct tkv_eval_rng *r, uint64_t seed)
{
    uint64_t x = seed;
    for (int i = 0; i < 4; i++)
        r->s[i] = splitmix64(&x);
}

static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t tkv_eval_rng_next(struct tkv_eval_rng *r)
{
    uint64_t *s = r->s;
    const uint64_t out = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return out;
}

uint64_t tkv_eval_rng_below(struct tkv_eval_rng *r, uint64_t n)
{
    if (n <= 1)
        return 0;
    const uint64_t limit = UINT64_MAX - UINT64_MAX % n; /* reject the biased tail */
    uint64_t x;
    do
        x = tkv_eval_rng_next(r);
    while (x >= limit);
    return x % n;
}

double tkv_eval_rng_unit(struct tkv_eval_rng *r) { return (double)(tkv_eval_rng_next(r) >> 11) * 0x1.0p-53; }

/* ---- tasks ----------------------------------------------------------------------- */

static const struct tkv_eval_task_info task_info[TKV_EVAL_TASK_COUNT] = {
    [TKV_EVAL_NIAH_SINGLE] = {"niah_single", 128, "lines"},
    [TKV_EVAL_NIAH_MULTIKEY] = {"niah_multikey", 128, "lines"},
    [TKV_EVAL_NIAH_MULTIVALUE] = {"niah_multivalue", 128, "lines"},
    [TKV_EVAL_NIAH_MULTIQUERY] = {"niah_multiquery", 128, "lines"},
    [TKV_EVAL_VT] = {"vt", 30, "lines"},
    [TKV_EVAL_CWE] = {"cwe", 120, "words"},
    [TKV_EVAL_FWE] = {"fwe", 50, "words"},
    [TKV_EVAL_PASSKEY] = {"passkey", 16, "characters"},
};

const struct tkv_eval_task_info *tkv_eval_task_get(enum tkv_eval_task task)
{
    return (unsigned)task < TKV_EVAL_TASK_COUNT ? &task_info[task] : NULL;
}

int tkv_eval_task_parse(const char *name)
{
    for (int i = 0; i < TKV_EVAL_TASK_COUNT; i++)
        if (name && !strcmp(name, task_info[i].name))
            return i;
    return -1;
}

/* ---- the model's side ------------------------------------------------------------ */

static tkv_status model_wrap(void *user, const char *body, const char *prefix, char **out)
{
    const tkv_model *m = user;
    size_t need = 0;
    *out = NULL;
    tkv_status st = tkv_chat_prompt(m, NULL, body, NULL, 0, &need);
    if (st != TKV_OK && st != TKV_ERR_TOO_SMALL)
        return st;
    const size_t plen = strlen(prefix);
    char *buf = malloc(need + plen + 1);
    if (!buf)
        return tkv_err(TKV_ERR_NOMEM, "eval: out of memory for a %zu-byte prompt", need + plen);
    if ((st = tkv_chat_prompt(m, NULL, body, buf, need + 1, &need)) != TKV_OK) {
        free(buf);
        return st;
    }
    memcpy(buf + need, prefix, plen + 1);
    *out = buf;
    return TKV_OK;
}

static tkv_status model_count(void *user, const char *text, uint32_t *n_tokens)
{
    size_t n = 0;
    tkv_status st = tkv_tokenize(user, text, -1, TKV_EVAL_TOK_FLAGS, NULL, 0, &n);
    if (st != TKV_OK && st != TKV_ERR_TOO_SMALL)
        return st;
    if (n > UINT32_MAX)
        return tkv_err(TKV_ERR_INVALID_ARG, "eval: prompt of %zu tokens", n);
    *n_tokens = (uint32_t)n;
    return TKV_OK;
}

tkv_status tkv_eval_lm_init(const tkv_model *model, struct tkv_eval_lm *lm)
{
    if (!model || !lm)
        return tkv_err(TKV_ERR_INVALID_ARG, "tkv_eval_lm_init: NULL argument");
    *lm = (struct tkv_eval_lm){.wrap = model_wrap, .count = model_count, .user = (void *)model};
    return TKV_OK;
}

void tkv_eval_lm_free(struct tkv_eval_lm *lm)
{
    if (lm)
        *lm = (struct tkv_eval_lm){0};
}

/* ---- a growable string ------------------------------------------------------------ */

struct sb {
    char *p;
    size_t n, cap;
    bool oom;
};

static void sb_put(struct sb *b, const char *s, size_t len)
{
    if (b->oom)
        return;
    if (b->n + len + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + len + 1)
            cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) {
            b->oom = true;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, len);
    b->n += len;
    b->p[b->n] = 0;
}

static void sb_puts(struct sb *b, const char *s) { sb_put(b, s, strlen(s)); }

static void sb_printf(struct sb *b, const char *fmt, ...) TKV_PRINTF(2, 3);
static void sb_printf(struct sb *b, const char *fmt, ...)
{
    char tmp[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= sizeof tmp) {
        b->oom = true; /* only short pieces go through here */
        return;
    }
    sb_put(b, tmp, (size_t)n);
}

/* Takes the string out of b ("" when empty); NULL if an allocation failed. */
static char *sb_take(struct sb *b)
{
    if (!b->oom && !b->p)
        sb_put(b, "", 0);
    char *p = b->oom ? NULL : b->p;
    if (b->oom)
        free(b->p);
    *b = (struct sb){0};
    return p;
}

/* ---- sampling helpers ------------------------------------------------------------ */

static void shuffle_u32(struct tkv_eval_rng *r, uint32_t *a, uint32_t n)
{
    for (uint32_t i = n; i > 1; i--) {
        uint32_t j = (uint32_t)tkv_eval_rng_below(r, i);
        uint32_t t = a[i - 1];
        a[i - 1] = a[j];
        a[j] = t;
    }
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x > y) - (x < y);
}

/* m distinct values of [0, n), sorted ascending (Floyd's algorithm; m small). */
static void sample_sorted(struct tkv_eval_rng *r, uint32_t n, uint32_t m, uint32_t *out)
{
    uint32_t k = 0;
    for (uint32_t j = n - m; j < n; j++) {
        uint32_t t = (uint32_t)tkv_eval_rng_below(r, (uint64_t)j + 1);
        bool seen = false;
        for (uint32_t i = 0; i < k; i++)
            seen |= out[i] == t;
        out[k++] = seen ? j : t;
    }
    qsort(out, m, sizeof *out, cmp_u32);
}

static void random_upper(struct tkv_eval_rng *r, char *out, uint32_t len)
{
    for (uint32_t i = 0; i < len; i++)
        out[i] = (char)('A' + tkv_eval_rng_below(r, 26));
    out[len] = 0;
}

/* ---- one sample's context ---------------------------------------------------------- */

#define NOISE "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

struct gen {
    struct tkv_eval_lm *lm;
    enum tkv_eval_task task;
    uint32_t ctx, index;
    uint64_t seed;
    uint64_t sample_seed;  /* (seed, task, index)       */
    uint32_t icl_units;    /* vt: the in-context example's haystack lines */
};

static void stream(const struct gen *g, uint64_t which, uint64_t size, struct tkv_eval_rng *r)
{
    tkv_eval_rng_seed(r, tkv_eval_mix(tkv_eval_mix(g->sample_seed, which), size));
}

enum { STREAM_A = 1, STREAM_B = 2, STREAM_ICL = 3, STREAM_PSEUDO = 4 };

static void set_ref(struct tkv_eval_sample *s, const char *text)
{
    if (s->n_refs < TKV_EVAL_MAX_REFS)
        snprintf(s->refs[s->n_refs++], TKV_EVAL_REF_LEN, "%s", text);
}

/* ---- niah (niah.py, noise haystack) ------------------------------------------------ */

struct niah_cfg {
    uint32_t k, v, q;
};

static struct niah_cfg niah_cfg(enum tkv_eval_task t)
{
    switch (t) {
    case TKV_EVAL_NIAH_MULTIKEY: return (struct niah_cfg){4, 1, 1};
    case TKV_EVAL_NIAH_MULTIVALUE: return (struct niah_cfg){1, 4, 1};
    case TKV_EVAL_NIAH_MULTIQUERY: return (struct niah_cfg){4, 1, 4}; /* k is raised to q */
    default: return (struct niah_cfg){1, 1, 1};
    }
}

static tkv_status render_niah(const struct gen *g, uint32_t n, struct sb *body, struct sb *prefix,
                              struct tkv_eval_sample *s)
{
    const struct niah_cfg c = niah_cfg(g->task);
    const uint32_t m = c.k * c.v;
    if (n < m)
        return tkv_err(TKV_ERR_INVALID_ARG, "eval: niah needs at least %u haystack lines", m);
    struct tkv_eval_rng a, b, r;
    stream(g, STREAM_A, 0, &a);
    stream(g, STREAM_B, n, &b);
    tkv_eval_rng_seed(&r, tkv_eval_mix(tkv_eval_mix(g->seed, (uint64_t)g->task), 0x6e656564)); /* "need" */

    /* keys: adjective-noun; values: 7-digit numbers; both distinct in a sample */
    char keys[4][TKV_EVAL_REF_LEN], values[4][4][8];
    for (uint32_t i = 0; i < c.k; i++) {
        bool dup;
        do {
            snprintf(keys[i], sizeof keys[i], "%s-%s",
                     tkv_eval_adjectives[tkv_eval_rng_below(&a, tkv_eval_adjectives_count)],
                     tkv_eval_nouns[tkv_eval_rng_below(&a, tkv_eval_nouns_count)]);
            dup = false;
            for (uint32_t j = 0; j < i; j++)
                dup |= !strcmp(keys[i], keys[j]);
        } while (dup);
        for (uint32_t j = 0; j < c.v; j++) {
            do {
                const unsigned v = (unsigned)(1000000 + tkv_eval_rng_below(&a, 9000000));
                snprintf(values[i][j], sizeof values[i][j], "%u", v);
                dup = false;
                for (uint32_t i2 = 0; i2 <= i; i2++)
                    for (uint32_t j2 = 0; j2 < (i2 == i ? j : c.v); j2++)
                        dup |= !strcmp(values[i][j], values[i2][j2]);
            } while (dup);
        }
    }
    /* the query: q of the k keys, in sampled order; answers: their values */
    uint32_t kidx[4] = {0, 1, 2, 3};
    for (uint32_t i = 0; i < c.q; i++) {
        uint32_t j = i + (uint32_t)tkv_eval_rng_below(&a, c.k - i);
        uint32_t t = kidx[i];
        kidx[i] = kidx[j];
        kidx[j] = t;
    }
    /* needles (key-major), shuffled by the run's fixed permutation */
    uint32_t order[16];
    for (uint32_t i = 0; i < m; i++)
        order[i] = i;
    shuffle_u32(&r, order, m);
    /* distinct line indices; inserted in descending order, the largest index
     * receives needle 0, so ascending position p holds needle m-1-p */
    uint32_t pos[16];
    sample_sorted(&b, n, m, pos);

    const bool singular = c.q * c.v == 1;
    const char *type = singular ? "number" : "numbers";
    char query[4 * TKV_EVAL_REF_LEN + 16] = "";
    for (uint32_t i = 0; i < c.q; i++) {
        size_t len = strlen(query);
        snprintf(query + len, sizeof query - len, "%s%s", i == 0 ? "" : i + 1 == c.q ? ", and " : ", ",
                 keys[kidx[i]]);
    }
    if (singular)
        sb_printf(body, "A special magic %s is hidden within the following text. Make sure to memorize it. "
                        "I will quiz you about the %s afterwards.\n", type, type);
    else
        sb_printf(body, "Some special magic %s are hidden within the following text. Make sure to memorize it. "
                        "I will quiz you about the %s afterwards.\n", type, type);
    uint32_t next = 0;
    for (uint32_t line = 0; line < n; line++) {
        if (next < m && pos[next] == line) {
            const uint32_t id = order[m - 1 - next], ki = id / c.v, vi = id % c.v;
            sb_printf(body, "One of the special magic %s for %s is: %s.\n", "numbers", keys[ki], values[ki][vi]);
            next++;
        }
        sb_puts(body, NOISE);
        if (line + 1 < n)
            sb_puts(body, "\n");
    }
    sb_puts(body, "\n");
    if (singular)
        sb_printf(body, "What is the special magic %s for %s mentioned in the provided text?", type, query);
    else
        sb_printf(body, "What are all the special magic %s for %s mentioned in the provided text?", type, query);
    sb_printf(prefix, " The special magic %s for %s mentioned in the provided text %s", type, query,
              singular ? "is" : "are");
    for (uint32_t i = 0; i < c.q; i++)
        for (uint32_t j = 0; j < c.v; j++)
            set_ref(s, values[kidx[i]][j]);
    return TKV_OK;
}

/* ---- vt (variable_tracking.py, noise haystack, 1 chain of 4 hops) -------------------- */

#define VT_HOPS 4
#define VT_TEMPLATE_HEAD "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"

struct vt_chain {
    char vars[VT_HOPS + 1][8];
    char value[8];
};

/* The task template and answer prefix around a noise haystack of n lines
 * with the chain's statements at distinct random lines (stream r). */
static void vt_text(const struct vt_chain *ch, uint32_t n, struct tkv_eval_rng *r, struct sb *body, struct sb *prefix)
{
    uint32_t pos[VT_HOPS + 1];
    sample_sorted(r, n, VT_HOPS + 1, pos);
    sb_puts(body, VT_TEMPLATE_HEAD);
    /* statement j goes before original line pos[j]; lines are joined with
     * '\n' (RULER's ". \n" -> ".\n" replacement never matches these lines) */
    uint32_t next = 0;
    for (uint32_t line = 0; line < n; line++) {
        while (next <= VT_HOPS && pos[next] == line) {
            if (next == 0)
                sb_printf(body, "VAR %s = %s\n", ch->vars[0], ch->value);
            else
                sb_printf(body, "VAR %s = VAR %s \n", ch->vars[next], ch->vars[next - 1]);
            next++;
        }
        sb_puts(body, NOISE);
        if (line + 1 < n)
            sb_puts(body, "\n");
    }
    sb_printf(body, "\nQuestion: Find all variables that are assigned the value %s in the text above.", ch->value);
    sb_printf(prefix, " Answer: According to the chain(s) of variable assignment in the text above, %d variables "
                      "are assigned the value %s, they are: ", VT_HOPS + 1, ch->value);
}

static void vt_chain_draw(struct tkv_eval_rng *a, uint32_t name_len, const char *avoid_value, struct vt_chain *ch)
{
    for (uint32_t i = 0; i <= VT_HOPS; i++) {
        bool dup;
        do {
            random_upper(a, ch->vars[i], name_len);
            dup = !strcmp(ch->vars[i], "VAR");
            for (uint32_t j = 0; j < i; j++)
                dup |= !strcmp(ch->vars[i], ch->vars[j]);
        } while (dup);
    }
    do /* numpy randint(10000, 99999): high exclusive */
        snprintf(ch->value, sizeof ch->value, "%u", (unsigned)(10000 + tkv_eval_rng_below(a, 89999)));
    while (avoid_value && !strcmp(ch->value, avoid_value));
}

static void vt_draw(const struct gen *g, struct vt_chain *main_chain, struct vt_chain *icl)
{
    struct tkv_eval_rng a;
    stream(g, STREAM_A, 0, &a);
    vt_chain_draw(&a, 5, NULL, main_chain);
    vt_chain_draw(&a, 3, main_chain->value, icl); /* the example: 3-letter names */
}

/* The in-context example with n lines: its template, answer prefix, then
 * " " and its answer, then "\n" (RULER's randomised icl_example). */
static void vt_icl(const struct gen *g, const struct vt_chain *icl, uint32_t n, struct sb *out)
{
    struct tkv_eval_rng r;
    stream(g, STREAM_ICL, n, &r);
    vt_text(icl, n, &r, out, out);
    sb_puts(out, " ");
    for (uint32_t i = 0; i <= VT_HOPS; i++)
        sb_printf(out, "%s%s", i ? " " : "", icl->vars[i]);
    sb_puts(out, "\n");
}

static tkv_status render_vt(const struct gen *g, uint32_t n, struct sb *body, struct sb *prefix,
                            struct tkv_eval_sample *s)
{
    if (n < VT_HOPS + 1)
        return tkv_err(TKV_ERR_INVALID_ARG, "eval: vt needs at least %d haystack lines", VT_HOPS + 1);
    struct vt_chain ch, icl;
    vt_draw(g, &ch, &icl);
    vt_icl(g, &icl, g->icl_units, body);
    sb_puts(body, "\n");
    struct tkv_eval_rng b;
    stream(g, STREAM_B, n, &b);
    vt_text(&ch, n, &b, body, prefix);
    for (uint32_t i = 0; i <= VT_HOPS; i++)
        set_ref(s, ch.vars[i]);
    return TKV_OK;
}

/* Tokens of the example's text with n lines, before its answer (what RULER
 * counts). */
static tkv_status vt_icl_tokens(struct gen *g, const struct vt_chain *icl, uint32_t n, uint32_t *tokens)
{
    struct sb text = {0};
    struct tkv_eval_rng r;
    stream(g, STREAM_ICL, n, &r);
    vt_text(icl, n, &r, &text, &text);
    char *t = sb_take(&text);
    if (!t)
        return tkv_err(TKV_ERR_NOMEM, "eval: out of memory");
    tkv_status st = g->lm->count(g->lm->user, t, tokens);
    g->lm->n_counts++;
    free(t);
    return st;
}

/* RULER sizes the example once, as the largest that fits 500 tokens: lines
 * from 5 up (5 even if that overflows), its own template without the
 * model's wrapper, nothing reserved for generation. */
#define VT_ICL_TOKENS 500

static tkv_status vt_size_icl(struct gen *g)
{
    struct vt_chain ch, icl;
    vt_draw(g, &ch, &icl);
    uint32_t lo = 5, hi = 10, tokens;
    TKV_TRY(vt_icl_tokens(g, &icl, lo, &tokens));
    if (tokens <= VT_ICL_TOKENS) {
        for (;;) {
            TKV_TRY(vt_icl_tokens(g, &icl, hi, &tokens));
            if (tokens > VT_ICL_TOKENS)
                break;
            lo = hi;
            hi *= 2;
            if (hi > (1u << 20))
                return tkv_err(TKV_ERR_INTERNAL, "eval: vt: the example's length search does not end");
        }
        while (hi - lo > 1) {
            uint32_t mid = lo + (hi - lo) / 2;
            TKV_TRY(vt_icl_tokens(g, &icl, mid, &tokens));
            *(tokens <= VT_ICL_TOKENS ? &lo : &hi) = mid;
        }
    }
    g->icl_units = lo;
    return TKV_OK;
}

/* ---- cwe (common_words_extraction.py) ---------------------------------------------- */

#define CWE_TEMPLATE_HEAD                                                                                   \
    "Below is a numbered list of words. In these words, some appear more often than others. Memorize the " \
    "ones that appear most often.\n"
#define CWE_TEMPLATE_TAIL "\nQuestion: What are the 10 most common words in the above list?"
#define CWE_PREFIX        " Answer: The top 10 words that appear most often in the list are:"
#define CWE_COMMON        10

/* The word pool: nouns, adjectives and verbs (the lists are disjoint). */
static uint32_t pool_size(void) { return tkv_eval_nouns_count + tkv_eval_adjectives_count + tkv_eval_verbs_count; }

static const char *pool_word(uint32_t i)
{
    if (i < tkv_eval_nouns_count)
        return tkv_eval_nouns[i];
    i -= tkv_eval_nouns_count;
    if (i < tkv_eval_adjectives_count)
        return tkv_eval_adjectives[i];
    return tkv_eval_verbs[i - tkv_eval_adjectives_count];
}

/* Beyond the pool (RULER falls back to a large English word list, which we
 * do not have): pronounceable non-words of three consonant-vowel syllables,
 * distinct by construction (an affine bijection of the 421875 syllable
 * triples), skipping any that contain a listed word. */
struct pseudo {
    uint64_t mul, add, next;
    const char *risky[64]; /* listed words spelled only with syllable letters */
    uint32_t n_risky;
};

#define PS_CONS "bdfgklmnprstvwz"
#define PS_VOW  "aeiou"
#define PS_SPACE (15ull * 5 * 15 * 5 * 15 * 5)

static void pseudo_init(const struct gen *g, struct pseudo *p)
{
    struct tkv_eval_rng r;
    stream(g, STREAM_PSEUDO, 0, &r);
    do /* coprime with 3^3 * 5^6 */
        p->mul = 1 + tkv_eval_rng_below(&r, PS_SPACE - 1);
    while (p->mul % 3 == 0 || p->mul % 5 == 0);
    p->add = tkv_eval_rng_below(&r, PS_SPACE);
    p->next = 0;
    p->n_risky = 0;
    for (uint32_t i = 0; i < pool_size(); i++) {
        const char *w = pool_word(i);
        if (strspn(w, PS_CONS PS_VOW) == strlen(w) && p->n_risky < 64)
            p->risky[p->n_risky++] = w;
    }
}

static void pseudo_next(struct pseudo *p, char out[8])
{
    for (;;) {
        uint64_t x = (p->mul * (p->next++ % PS_SPACE) + p->add) % PS_SPACE;
        for (int i = 0; i < 3; i++) {
            out[2 * i] = PS_CONS[x % 15];
            x /= 15;
            out[2 * i + 1] = PS_VOW[x % 5];
            x /= 5;
        }
        out[6] = 0;
        bool bad = false;
        for (uint32_t i = 0; i < p->n_risky && !bad; i++)
            bad = strstr(out, p->risky[i]) != NULL;
        if (!bad)
            return;
    }
}

/* "1. w 2. w ..." of the multiset common x rc + rest x ru, shuffled by r. */
static tkv_status cwe_list(const char *const *words, uint32_t n_words, uint32_t rc, uint32_t ru,
                           struct tkv_eval_rng *r, struct sb *out)
{
    const uint32_t nc = n_words < CWE_COMMON ? n_words : CWE_COMMON;
    const uint64_t total = (uint64_t)nc * rc + (uint64_t)(n_words - nc) * ru;
    uint32_t *list = malloc((total ? total : 1) * sizeof *list);
    if (!list)
        return tkv_err(TKV_ERR_NOMEM, "eval: out of memory");
    uint64_t k = 0;
    for (uint32_t i = 0; i < nc; i++)
        for (uint32_t j = 0; j < rc; j++)
            list[k++] = i;
    for (uint32_t i = nc; i < n_words; i++)
        for (uint32_t j = 0; j < ru; j++)
            list[k++] = i;
    shuffle_u32(r, list, (uint32_t)total);
    for (uint64_t i = 0; i < total; i++)
        sb_printf(out, "%s%llu. %s", i ? " " : "", (unsigned long long)i + 1, words[list[i]]);
    free(list);
    return TKV_OK;
}

static tkv_status render_cwe(const struct gen *g, uint32_t n, struct sb *body, struct sb *prefix,
                             struct tkv_eval_sample *s)
{
    if (n < CWE_COMMON)
        return tkv_err(TKV_ERR_INVALID_ARG, "eval: cwe needs at least %d words", CWE_COMMON);
    const bool short_ctx = g->ctx < 4096; /* RULER: fewer repeats below 4K */
    const uint32_t rc = short_ctx ? 6 : 30, ru = short_ctx ? 1 : 3;
    const uint32_t ex_n = short_ctx ? 20 : 40, ex_rc = short_ctx ? 3 : 10, ex_ru = short_ctx ? 1 : 3;
    const uint32_t P = pool_size();
    struct tkv_eval_rng a, b;
    stream(g, STREAM_A, 0, &a);
    stream(g, STREAM_B, n, &b);

    uint32_t *perm = malloc(P * sizeof *perm);
    const char **words = malloc((size_t)(n > ex_n ? n : ex_n) * sizeof *words);
    char(*pseudo)[8] = n > P ? malloc((size_t)(n - P) * sizeof *pseudo) : NULL;
    tkv_status st = TKV_OK;
    if (!perm || !words || (n > P && !pseudo)) {
        st = tkv_err(TKV_ERR_NOMEM, "eval: out of memory");
        goto out;
    }
    /* the few-shot example: ex_n distinct words, its own shuffle (stream A) */
    for (uint32_t i = 0; i < P; i++)
        perm[i] = i;
    for (uint32_t i = 0; i < ex_n; i++) {
        uint32_t j = i + (uint32_t)tkv_eval_rng_below(&a, P - i);
        uint32_t t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
        words[i] = pool_word(perm[i]);
    }
    sb_puts(body, CWE_TEMPLATE_HEAD);
    if ((st = cwe_list(words, ex_n, ex_rc, ex_ru, &a, body)) != TKV_OK)
        goto out;
    sb_puts(body, CWE_TEMPLATE_TAIL CWE_PREFIX " ");
    for (uint32_t i = 0; i < CWE_COMMON; i++)
        sb_printf(body, "%s%u. %s", i ? " " : "", i + 1, words[i]);
    sb_puts(body, "\n");

    /* the instance: the first n words of a permutation of the pool (stable
     * in n), then non-words; the first 10 are the common ones */
    for (uint32_t i = 0; i < P; i++)
        perm[i] = i;
    shuffle_u32(&a, perm, P);
    for (uint32_t i = 0; i < n && i < P; i++)
        words[i] = pool_word(perm[i]);
    if (n > P) {
        struct pseudo ps;
        pseudo_init(g, &ps);
        for (uint32_t i = P; i < n; i++) {
            pseudo_next(&ps, pseudo[i - P]);
            words[i] = pseudo[i - P];
        }
    }
    sb_puts(body, CWE_TEMPLATE_HEAD);
    if ((st = cwe_list(words, n, rc, ru, &b, body)) != TKV_OK)
        goto out;
    sb_puts(body, CWE_TEMPLATE_TAIL);
    sb_puts(prefix, CWE_PREFIX);
    for (uint32_t i = 0; i < CWE_COMMON; i++)
        set_ref(s, words[i]);
out:
    free(perm);
    free(words);
    free(pseudo);
    return st;
}

/* ---- fwe (freq_words_extraction.py, alpha = 2, coded words of 6 letters) ------------ */

#define FWE_LEN   6
#define FWE_ZETA2 1.6449340668482264 /* scipy.special.zeta(2.0) */

static int cmp_word(const void *a, const void *b) { return strcmp((const char *)a, (const char *)b); }

static tkv_status render_fwe(const struct gen *g, uint32_t n, struct sb *body, struct sb *prefix,
                             struct tkv_eval_sample *s)
{
    const uint32_t tg = task_info[TKV_EVAL_FWE].tokens_to_generate;
    const uint32_t V = g->ctx > tg ? (g->ctx - tg) / 50 : 0; /* RULER's vocab_size */
    if (V < 5)
        return tkv_err(TKV_ERR_INVALID_ARG, "eval: fwe needs a context of at least %u tokens", 5 * 50 + tg);
    struct tkv_eval_rng a, b;
    stream(g, STREAM_A, 0, &a);
    stream(g, STREAM_B, n, &b);
    char(*vocab)[FWE_LEN + 1] = malloc((size_t)V * sizeof *vocab);
    uint32_t *cnt = malloc((size_t)V * sizeof *cnt);
    uint32_t *list = NULL;
    tkv_status st = TKV_OK;
    if (!vocab || !cnt) {
        st = tkv_err(TKV_ERR_NOMEM, "eval: out of memory");
        goto out;
    }
    /* V distinct random lowercase strings, sorted, then shuffled */
    uint32_t have = 0;
    while (have < V) {
        while (have < V) {
            for (int i = 0; i < FWE_LEN; i++)
                vocab[have][i] = (char)('a' + tkv_eval_rng_below(&a, 26));
            vocab[have][FWE_LEN] = 0;
            have++;
        }
        qsort(vocab, have, sizeof *vocab, cmp_word);
        uint32_t u = 0;
        for (uint32_t i = 0; i < have; i++)
            if (u == 0 || strcmp(vocab[i], vocab[u - 1]))
                memcpy(vocab[u++], vocab[i], sizeof *vocab);
        have = u;
    }
    for (uint32_t i = V; i > 1; i--) {
        uint32_t j = (uint32_t)tkv_eval_rng_below(&a, i);
        char t[FWE_LEN + 1];
        memcpy(t, vocab[i - 1], sizeof t);
        memcpy(vocab[i - 1], vocab[j], sizeof t);
        memcpy(vocab[j], t, sizeof t);
    }
    snprintf(vocab[0], sizeof vocab[0], "..."); /* the top rank is noise */

    /* rank k occurs int(n * k^-alpha / zeta(alpha)) times */
    uint64_t total = 0;
    for (uint32_t k = 0; k < V; k++) {
        cnt[k] = (uint32_t)((double)n * pow((double)(k + 1), -2.0) / FWE_ZETA2);
        total += cnt[k];
    }
    if (total > UINT32_MAX / 2 || !(list = malloc((total ? total : 1) * sizeof *list))) {
        st = tkv_err(TKV_ERR_NOMEM, "eval: out of memory");
        goto out;
    }
    uint64_t t = 0;
    for (uint32_t k = 0; k < V; k++)
        for (uint32_t j = 0; j < cnt[k]; j++)
            list[t++] = k;
    shuffle_u32(&b, list, (uint32_t)total);
    sb_puts(body, "Read the following coded text and track the frequency of each coded word. Find the three most "
                  "frequently appeared coded words. ");
    for (uint64_t i = 0; i < total; i++) {
        if (i)
            sb_puts(body, " ");
        sb_puts(body, vocab[list[i]]);
    }
    sb_puts(body, "\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three most "
                  "frequently appeared words in the above coded text?");
    sb_puts(prefix, " Answer: According to the coded text above, the three most frequently appeared words are:");
    for (uint32_t k = 1; k <= 3; k++)
        set_ref(s, vocab[k]);
out:
    free(vocab);
    free(cnt);
    free(list);
    return st;
}

/* ---- passkey (Landmark attention / LongLoRA) ---------------------------------------- */

static tkv_status render_passkey(const struct gen *g, uint32_t n, struct sb *body, struct sb *prefix,
                                 struct tkv_eval_sample *s)
{
    struct tkv_eval_rng a;
    stream(g, STREAM_A, 0, &a);
    char key[8];
    snprintf(key, sizeof key, "%u", (unsigned)(10000 + tkv_eval_rng_below(&a, 90000)));
    const double depth = tkv_eval_rng_unit(&a); /* Landmark: randint(0, n_garbage) characters */
    uint32_t n_prefix = (uint32_t)(depth * (double)n);
    if (n_prefix > n)
        n_prefix = n;
    /* the garbage is NOISE repeated, joined with single spaces; prefix and
     * suffix are both cut from its start, by characters */
    static const char unit[] = NOISE " ";
    const size_t ulen = sizeof unit - 1;
    sb_puts(body, "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
                  "I will quiz you about the important information there.\n");
    for (int part = 0; part < 2; part++) {
        size_t left = part == 0 ? n_prefix : n - n_prefix;
        while (left > 0) {
            size_t take = left < ulen ? left : ulen;
            sb_put(body, unit, take);
            left -= take;
        }
        if (part == 0)
            sb_printf(body, "\nThe pass key is %s. Remember it. %s is the pass key.\n", key, key);
    }
    sb_puts(body, "\nWhat is the pass key?");
    sb_puts(prefix, " The pass key is");
    set_ref(s, key);
    return TKV_OK;
}

/* ---- rendering and the length search ------------------------------------------------- */

static tkv_status render(struct gen *g, uint32_t n, struct tkv_eval_sample *out)
{
    *out = (struct tkv_eval_sample){.task = g->task, .ctx = g->ctx, .index = g->index, .seed = g->seed, .units = n};
    struct sb body = {0}, prefix = {0};
    tkv_status st;
    switch (g->task) {
    case TKV_EVAL_NIAH_SINGLE:
    case TKV_EVAL_NIAH_MULTIKEY:
    case TKV_EVAL_NIAH_MULTIVALUE:
    case TKV_EVAL_NIAH_MULTIQUERY: st = render_niah(g, n, &body, &prefix, out); break;
    case TKV_EVAL_VT: st = render_vt(g, n, &body, &prefix, out); break;
    case TKV_EVAL_CWE: st = render_cwe(g, n, &body, &prefix, out); break;
    case TKV_EVAL_FWE: st = render_fwe(g, n, &body, &prefix, out); break;
    case TKV_EVAL_PASSKEY: st = render_passkey(g, n, &body, &prefix, out); break;
    default: st = tkv_err(TKV_ERR_INVALID_ARG, "eval: unknown task %d", (int)g->task);
    }
    out->body = sb_take(&body);
    out->answer_prefix = sb_take(&prefix);
    if (st == TKV_OK && (!out->body || !out->answer_prefix))
        st = tkv_err(TKV_ERR_NOMEM, "eval: out of memory for a %s prompt", task_info[g->task].name);
    if (st == TKV_OK)
        st = g->lm->wrap(g->lm->user, out->body, out->answer_prefix, &out->prompt);
    if (st == TKV_OK) {
        st = g->lm->count(g->lm->user, out->prompt, &out->n_tokens);
        g->lm->n_counts++;
    }
    if (st != TKV_OK)
        tkv_eval_sample_free(out);
    return st;
}

static tkv_status gen_init(struct gen *g, struct tkv_eval_lm *lm, enum tkv_eval_task task, uint32_t ctx,
                           uint64_t seed, uint32_t index)
{
    if (!lm || !lm->wrap || !lm->count)
        return tkv_err(TKV_ERR_INVALID_ARG, "eval: no tokenizer given");
    if ((unsigned)task >= TKV_EVAL_TASK_COUNT)
        return tkv_err(TKV_ERR_INVALID_ARG, "eval: unknown task %d", (int)task);
    *g = (struct gen){.lm = lm, .task = task, .ctx = ctx, .index = index, .seed = seed,
                      .sample_seed = tkv_eval_mix(tkv_eval_mix(seed, (uint64_t)task + 1), index)};
    if (task == TKV_EVAL_VT)
        TKV_TRY(vt_size_icl(g));
    return TKV_OK;
}

tkv_status tkv_eval_render(struct tkv_eval_lm *lm, enum tkv_eval_task task, uint32_t ctx, uint64_t seed,
                           uint32_t index, uint32_t units, struct tkv_eval_sample *out)
{
    if (!out)
        return tkv_err(TKV_ERR_INVALID_ARG, "tkv_eval_render: out is NULL");
    *out = (struct tkv_eval_sample){0};
    struct gen g;
    TKV_TRY(gen_init(&g, lm, task, ctx, seed, index));
    return render(&g, units, out);
}

static uint32_t min_units(enum tkv_eval_task t)
{
    switch (t) {
    case TKV_EVAL_NIAH_SINGLE:
    case TKV_EVAL_NIAH_MULTIKEY:
    case TKV_EVAL_NIAH_MULTIVALUE:
    case TKV_EVAL_NIAH_MULTIQUERY: return niah_cfg(t).k * niah_cfg(t).v;
    case TKV_EVAL_VT: return VT_HOPS + 1;
    case TKV_EVAL_CWE: return CWE_COMMON;
    case TKV_EVAL_FWE: return 50; /* ranks 2-4 occur at least once */
    default: return 0;
    }
}

#define MAX_UNITS (1u << 26)

/* Renders n; *fits = it meets the length limit; *tokens = its length.
 * Keeps the latest fitting render in *best. */
static tkv_status try_units(struct gen *g, uint32_t n, uint32_t limit, bool *fits, struct tkv_eval_sample *best,
                            uint32_t *tokens)
{
    struct tkv_eval_sample cand;
    TKV_TRY(render(g, n, &cand));
    *tokens = cand.n_tokens;
    *fits = cand.n_tokens <= limit;
    if (*fits) {
        tkv_eval_sample_free(best);
        *best = cand;
    } else {
        tkv_eval_sample_free(&cand);
    }
    return TKV_OK;
}

tkv_status tkv_eval_generate(struct tkv_eval_lm *lm, enum tkv_eval_task task, uint32_t ctx, uint64_t seed,
                             uint32_t index, struct tkv_eval_sample *out)
{
    if (!out)
        return tkv_err(TKV_ERR_INVALID_ARG, "tkv_eval_generate: out is NULL");
    *out = (struct tkv_eval_sample){0};
    struct gen g;
    TKV_TRY(gen_init(&g, lm, task, ctx, seed, index));
    const uint32_t tg = task_info[task].tokens_to_generate;
    if (ctx <= tg)
        return tkv_err(TKV_ERR_INVALID_ARG, "eval: %s: a context of %u tokens leaves no room for the prompt "
                                            "(%u are reserved for the answer)", task_info[task].name, ctx, tg);
    const uint32_t limit = ctx - tg;
    struct tkv_eval_sample best = {0};
    bool fits;
    uint32_t lo = min_units(task), hi = 0, tokens = 0;
    tkv_status st = try_units(&g, lo, limit, &fits, &best, &tokens);
    if (st == TKV_OK && !fits)
        st = tkv_err(TKV_ERR_INVALID_ARG, "eval: %s: a context of %u tokens is too small: the shortest prompt has "
                                          "%u tokens and %u are reserved for the answer",
                     task_info[task].name, ctx, tokens, tg);
    /* estimate from two probes, then bracket: lo fits, hi does not */
    if (st == TKV_OK) {
        const uint32_t t_lo = tokens, probe = lo + (task == TKV_EVAL_PASSKEY ? 1024 : 64);
        st = try_units(&g, probe, limit, &fits, &best, &tokens);
        if (st == TKV_OK && !fits)
            hi = probe;
        else if (st == TKV_OK) {
            const double per_unit = ((double)tokens - (double)t_lo) / (double)(probe - lo);
            const double est = per_unit > 0 ? probe + ((double)limit - (double)tokens) / per_unit : 2.0 * probe;
            lo = probe;
            uint32_t guess = est > MAX_UNITS ? MAX_UNITS : (uint32_t)est;
            if (guess <= lo)
                guess = lo + 1;
            uint32_t step = guess / 128 + 1;
            st = try_units(&g, guess, limit, &fits, &best, &tokens);
            if (st == TKV_OK && fits) { /* gallop up */
                lo = guess;
                while (st == TKV_OK && !hi) {
                    if (lo >= MAX_UNITS) {
                        st = tkv_err(TKV_ERR_INVALID_ARG, "eval: %s: the length search passed %u %s",
                                     task_info[task].name, MAX_UNITS, task_info[task].unit);
                        break;
                    }
                    const uint32_t next = lo + step > MAX_UNITS ? MAX_UNITS : lo + step;
                    st = try_units(&g, next, limit, &fits, &best, &tokens);
                    if (st == TKV_OK)
                        *(fits ? &lo : &hi) = next;
                    step *= 2;
                }
            } else if (st == TKV_OK) { /* gallop down */
                hi = guess;
                while (st == TKV_OK && hi - lo > step) {
                    const uint32_t next = hi - step;
                    st = try_units(&g, next, limit, &fits, &best, &tokens);
                    if (st == TKV_OK && fits) {
                        lo = next;
                        break;
                    }
                    hi = next;
                    step *= 2;
                }
            }
        }
    }
    while (st == TKV_OK && hi - lo > 1) {
        uint32_t mid = lo + (hi - lo) / 2;
        st = try_units(&g, mid, limit, &fits, &best, &tokens);
        if (st == TKV_OK)
            *(fits ? &lo : &hi) = mid;
    }
    if (st == TKV_OK && best.units != lo) /* the last fitting render was not lo's */
        st = try_units(&g, lo, limit, &fits, &best, &tokens);
    if (st != TKV_OK) {
        tkv_eval_sample_free(&best);
        return st;
    }
    *out = best;
    return TKV_OK;
}

void tkv_eval_sample_free(struct tkv_eval_sample *s)
{
    if (!s)
        return;
    free(s->body);
    free(s->answer_prefix);
    free(s->prompt);
    s->body = s->answer_prefix = s->prompt = NULL;
}
