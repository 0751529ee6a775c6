/*
 * eval.h -- RULER-style long-context tasks for `tierkv eval`: deterministic
 * prompt generators, the RULER scorers, and the word lists they draw from.
 * docs/eval.md describes the tasks, the mechanics and the scoring.
 *
 *   struct tkv_eval_lm lm;   tkv_eval_lm_init(model, &lm);
 *   struct tkv_eval_sample s;
 *   tkv_eval_generate(&lm, TKV_EVAL_NIAH_SINGLE, 4096, 42, 0, &s);
 *   ... tokenize s.prompt with TKV_EVAL_TOK_FLAGS, prefill, generate ...
 *   double score = tkv_eval_score(&s, generated_text);     // 0..1
 *   tkv_eval_sample_free(&s);   tkv_eval_lm_free(&lm);
 *
 * A sample is a pure function of (task, ctx, seed, index) and the tokenizer:
 * the generators use their own PRNG (xoshiro256** seeded through splitmix64),
 * never rand(), so the same arguments give the same bytes on every machine.
 */
#ifndef TKV_EVAL_H
#define TKV_EVAL_H

#include "tierkv.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* ---- tasks ------------------------------------------------------------------- */

enum tkv_eval_task {
    TKV_EVAL_NIAH_SINGLE,     /* RULER niah_single_1: 1 key, 1 value                  */
    TKV_EVAL_NIAH_MULTIKEY,   /* niah_multikey_1: 4 keys, one of them asked           */
    TKV_EVAL_NIAH_MULTIVALUE, /* niah_multivalue: 1 key with 4 values                 */
    TKV_EVAL_NIAH_MULTIQUERY, /* niah_multiquery: 4 keys, all asked                   */
    TKV_EVAL_VT,              /* variable tracking: 1 chain of 4 hops                 */
    TKV_EVAL_CWE,             /* common words extraction: the 10 common words         */
    TKV_EVAL_FWE,             /* frequent words extraction: the 3 most frequent words */
    TKV_EVAL_PASSKEY,         /* Landmark/LongLoRA pass key (5 digits)                */
    TKV_EVAL_TASK_COUNT
};

struct tkv_eval_task_info {
    const char *name;             /* "niah_single", ... (the --task names)                 */
    uint32_t tokens_to_generate;  /* RULER's: reserved in the length search, max answer   */
    const char *unit;             /* what the length search counts: "lines", "words", ... */
};

const struct tkv_eval_task_info *tkv_eval_task_get(enum tkv_eval_task task);
/* The task named name, or -1. */
int tkv_eval_task_parse(const char *name);

/* ---- the tokenizer side of the generators -------------------------------------- */

/* Flags the prompt is tokenized with (the chat template's control tokens are
 * parsed; BOS is added where the model asks for it). */
#define TKV_EVAL_TOK_FLAGS (TKV_TOK_PARSE_SPECIAL | TKV_TOK_ADD_BOS)

/* What a generator needs from the model: the chat wrapper and a token count.
 * Tests without a model plug in their own functions. */
struct tkv_eval_lm {
    /* *out = malloc'd chat(body) + answer_prefix (RULER: model template around
     * the task body, then the answer prefix). */
    tkv_status (*wrap)(void *user, const char *body, const char *answer_prefix, char **out);
    /* Tokens text needs. */
    tkv_status (*count)(void *user, const char *text, uint32_t *n_tokens);
    void *user;
    uint64_t n_counts; /* count calls so far (statistics) */
};

/* The model's chat template (tkv_chat_prompt, default system prompt) and
 * tokenizer (TKV_EVAL_TOK_FLAGS). The model must outlive lm. */
tkv_status tkv_eval_lm_init(const tkv_model *model, struct tkv_eval_lm *lm);
void       tkv_eval_lm_free(struct tkv_eval_lm *lm);

/* ---- samples ---------------------------------------------------------------------- */

#define TKV_EVAL_MAX_REFS 10
#define TKV_EVAL_REF_LEN  48

struct tkv_eval_sample {
    enum tkv_eval_task task;
    uint32_t ctx, index;
    uint64_t seed;
    uint32_t units;          /* haystack size the length search chose (task's unit)  */
    uint32_t n_tokens;       /* tokens of prompt                                      */
    char *body;              /* the user turn: task template with the context        */
    char *answer_prefix;     /* RULER's answer prefix (after the assistant header)    */
    char *prompt;            /* what the model reads: chat(body) + answer_prefix      */
    uint32_t n_refs;         /* reference answers (RULER's "outputs")                  */
    char refs[TKV_EVAL_MAX_REFS][TKV_EVAL_REF_LEN];
};

/* Sample `index` of `task` for a context of ctx tokens: the largest haystack
 * with tokens(prompt) + tokens_to_generate <= ctx (binary search on the
 * haystack size, granularity one unit, as RULER searches). A context too
 * small for the task's smallest prompt is TKV_ERR_INVALID_ARG. */
tkv_status tkv_eval_generate(struct tkv_eval_lm *lm, enum tkv_eval_task task, uint32_t ctx, uint64_t seed,
                             uint32_t index, struct tkv_eval_sample *out);

/* The same sample rendered with a given haystack size (no length limit):
 * what the search evaluates at each step. */
tkv_status tkv_eval_render(struct tkv_eval_lm *lm, enum tkv_eval_task task, uint32_t ctx, uint64_t seed,
                           uint32_t index, uint32_t units, struct tkv_eval_sample *out);

void tkv_eval_sample_free(struct tkv_eval_sample *s);

/* ---- scoring (RULER's scripts/eval) ---------------------------------------------- */

/* RULER's postprocess_pred: strip whitespace, replace every byte in
 * [\x00-\x1f] with '\n', strip again. Writes to out (room for len + 1 bytes;
 * out == in is allowed) and returns the new length. */
size_t tkv_eval_postprocess(const char *in, size_t len, char *out);

/* RULER's string_match_all for one sample: the fraction of refs found in
 * pred as case-insensitive (ASCII) substrings; 0 when n_refs == 0. */
double tkv_eval_string_match_all(const char *pred, const char *const *refs, uint32_t n_refs);

/* Pass key: 1 when the first run of digits in pred, read as an integer,
 * equals key (a string of digits); else 0. */
double tkv_eval_passkey_match(const char *pred, const char *key);

/* Postprocess pred and score it with the task's metric (string_match_all;
 * passkey_match for passkey). 0..1. */
double tkv_eval_score(const struct tkv_eval_sample *s, const char *pred);

/* ---- PRNG ------------------------------------------------------------------------ */

struct tkv_eval_rng {
    uint64_t s[4];
};
void     tkv_eval_rng_seed(struct tkv_eval_rng *r, uint64_t seed); /* splitmix64 -> xoshiro256** */
uint64_t tkv_eval_rng_next(struct tkv_eval_rng *r);
uint64_t tkv_eval_rng_below(struct tkv_eval_rng *r, uint64_t n);   /* uniform in [0, n), unbiased */
double   tkv_eval_rng_unit(struct tkv_eval_rng *r);                 /* uniform in [0, 1)           */
/* A well-mixed 64-bit function of (a, b), for deriving stream seeds. */
uint64_t tkv_eval_mix(uint64_t a, uint64_t b);

/* ---- word lists (words.c) -------------------------------------------------------- */

extern const char *const tkv_eval_nouns[];
extern const uint32_t tkv_eval_nouns_count;
extern const char *const tkv_eval_adjectives[];
extern const uint32_t tkv_eval_adjectives_count;
extern const char *const tkv_eval_verbs[];
extern const uint32_t tkv_eval_verbs_count;

#endif
