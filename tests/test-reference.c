/*
 * test-reference.c -- tierkv against two independent implementations on the
 * real SmolLM2 model (tests/data/README.md: versions, how to regenerate):
 *   - llama.cpp (llama-cpp-python): token ids, next-token top-10 logits and a
 *     32-token greedy continuation for a short prompt, a ChatML chat prompt
 *     and a ~2K-token document (smollm2-logits.txt);
 *   - a float64 numpy evaluation of the same quantized weights (gguf-py's
 *     dequantizer): the exact next-token logits (smollm2-exact.txt).
 *
 * Checked: identical token ids; log-probabilities of the top-10 within
 * EXACT_TOL of float64 and LLAMA_TOL of llama.cpp; a top-1 that one of them
 * shares; the greedy continuation identical to llama.cpp's for every step up
 * to the first near-tie (llama.cpp top-2 margin < GREEDY_MARGIN), after which
 * two correct implementations may fork.
 *
 * Why llama.cpp is the looser reference: it quantizes activations to 8 bits
 * in every matmul, which moves its logits ~0.1-0.25 from the exact values
 * (printed on every run); our prefill uses f32 activations and lands within
 * ~0.006. On the chat prompt the exact first token differs from llama.cpp's
 * (a 0.09 margin), so there the continuations fork at step 0.
 */
#include "test.h"
#include "tierkv.h"

#include <stdlib.h>
#include <string.h>

#define LLAMA_TOL 0.30f    /* max |log p| vs llama.cpp (its own error ~0.25)  */
#define EXACT_TOL 0.02f    /* max |log p| vs the float64 evaluation           */
#define GREEDY_MARGIN 0.5f /* top-2 logit gaps below this are near-ties     */
#define MAX_TOKENS 4096

struct record {
    char name[32];
    char *text;
    int parse_special;
    int n_tokens;
    tkv_token tokens[MAX_TOKENS];
    int top_id[10];
    float top_logit[10];
    float logsumexp;
    tkv_token greedy[32];
    float margin[32];
    /* float64 reference (tests/data/smollm2-exact.txt) */
    int exact_id[10];
    float exact_logit[10];
    float exact_lse;
};

static char *hex_decode(const char *hex)
{
    size_t n = strlen(hex) / 2;
    char *out = malloc(n + 1);
    for (size_t i = 0; i < n; i++) {
        unsigned v;
        sscanf(hex + 2 * i, "%2x", &v);
        out[i] = (char)v;
    }
    out[n] = 0;
    return out;
}

/* Reads the next record; 0 at end of file. */
static int read_record(FILE *f, struct record *r)
{
    static char line[1 << 20];
    memset(r, 0, sizeof *r);
    int got = 0;
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = 0;
        if (!line[0]) {
            if (got)
                break;
            continue;
        }
        got = 1;
        char *val = strchr(line, ' ');
        if (!val)
            continue;
        *val++ = 0;
        if (!strcmp(line, "name"))
            snprintf(r->name, sizeof r->name, "%s", val);
        else if (!strcmp(line, "text_hex"))
            r->text = hex_decode(val);
        else if (!strcmp(line, "parse_special"))
            r->parse_special = atoi(val);
        else if (!strcmp(line, "tokens")) {
            for (char *t = strtok(val, " "); t && r->n_tokens < MAX_TOKENS; t = strtok(NULL, " "))
                r->tokens[r->n_tokens++] = atoi(t);
        } else if (!strcmp(line, "top10")) {
            int k = 0;
            for (char *t = strtok(val, " "); t && k < 10; t = strtok(NULL, " "), k++)
                sscanf(t, "%d:%f", &r->top_id[k], &r->top_logit[k]);
        } else if (!strcmp(line, "exact_top10")) {
            int k = 0;
            for (char *t = strtok(val, " "); t && k < 10; t = strtok(NULL, " "), k++)
                sscanf(t, "%d:%f", &r->exact_id[k], &r->exact_logit[k]);
        } else if (!strcmp(line, "exact_logsumexp")) {
            r->exact_lse = strtof(val, NULL);
        } else if (!strcmp(line, "logsumexp"))
            r->logsumexp = strtof(val, NULL);
        else if (!strcmp(line, "greedy")) {
            int k = 0;
            for (char *t = strtok(val, " "); t && k < 32; t = strtok(NULL, " "))
                r->greedy[k++] = atoi(t);
        } else if (!strcmp(line, "greedy_margin")) {
            int k = 0;
            for (char *t = strtok(val, " "); t && k < 32; t = strtok(NULL, " "))
                r->margin[k++] = strtof(t, NULL);
        }
    }
    return got;
}

static double logsumexp(const float *x, uint32_t n)
{
    double m = x[0], s = 0;
    for (uint32_t i = 1; i < n; i++)
        m = x[i] > m ? x[i] : m;
    for (uint32_t i = 0; i < n; i++)
        s += exp(x[i] - m);
    return m + log(s);
}

/* max |log p_a - log p_b| over ids[0..n) */
static float max_logprob_diff(const int *ids, const float *a, float lse_a, const float *b_at, float lse_b, int n)
{
    float m = 0;
    for (int k = 0; k < n; k++)
        m = fmaxf(m, fabsf((a[ids[k]] - lse_a) - (b_at[k] - lse_b)));
    return m;
}

int main(void)
{
    const char *model_path = test_model_path();
    FILE *f = fopen(test_data_path("smollm2-logits.txt"), "r");
    REQUIRE(f, "cannot open %s", test_data_path("smollm2-logits.txt"));
    FILE *fx = fopen(test_data_path("smollm2-exact.txt"), "r");
    REQUIRE(fx, "cannot open %s", test_data_path("smollm2-exact.txt"));
    tkv_model *m;
    REQUIRE(tkv_model_load(model_path, &m) == TKV_OK, "%s", tkv_last_error());
    const uint32_t V = tkv_model_n_vocab(m);
    static struct record r, x;
    int n_records = 0;
    while (read_record(f, &r)) {
        REQUIRE(read_record(fx, &x) && !strcmp(x.name, r.name), "exact record for %s missing", r.name);
        n_records++;
        /* 1. token ids */
        static tkv_token ours[MAX_TOKENS];
        size_t n = 0;
        tkv_status st = tkv_tokenize(m, r.text, -1, r.parse_special ? TKV_TOK_PARSE_SPECIAL : 0, ours, MAX_TOKENS, &n);
        CHECK(st == TKV_OK && n == (size_t)r.n_tokens && !memcmp(ours, r.tokens, n * sizeof *ours),
              "%s: token ids differ from llama.cpp (%zu vs %d tokens)", r.name, n, r.n_tokens);

        /* 2. next-token log-probabilities after the prompt (fed llama.cpp's
         * ids), against llama.cpp and against the float64 reference */
        struct tkv_session_params sp = tkv_session_default_params();
        sp.n_ctx = 4096;
        sp.n_threads = 2;
        tkv_session *s;
        REQUIRE(tkv_session_init(m, &sp, &s) == TKV_OK, "%s", tkv_last_error());
        REQUIRE(tkv_prefill(s, r.tokens, (size_t)r.n_tokens) == TKV_OK, "%s", tkv_last_error());
        const float *lg = tkv_logits(s);
        const float lse = (float)logsumexp(lg, V);
        const float d_llama = max_logprob_diff(r.top_id, lg, lse, r.top_logit, r.logsumexp, 10);
        const float d_exact = max_logprob_diff(x.exact_id, lg, lse, x.exact_logit, x.exact_lse, 10);
        /* llama.cpp vs float64, on the ids both top-10 lists share */
        float d_llama_exact = 0;
        for (int i = 0; i < 10; i++)
            for (int k = 0; k < 10; k++)
                if (r.top_id[i] == x.exact_id[k])
                    d_llama_exact = fmaxf(d_llama_exact, fabsf((r.top_logit[i] - r.logsumexp) -
                                                               (x.exact_logit[k] - x.exact_lse)));
        const tkv_token top1 = tkv_argmax(lg, V);
        fprintf(stderr,
                "%-5s %4d tokens: max |log p| diff on the top 10: tierkv vs llama.cpp %.4f, tierkv vs float64 %.4f, "
                "llama.cpp vs float64 %.4f; top-1 %d (llama.cpp %d, float64 %d)\n",
                r.name, r.n_tokens, d_llama, d_exact, d_llama_exact, top1, r.top_id[0], x.exact_id[0]);
        CHECK(d_llama <= LLAMA_TOL, "%s: log-probs differ from llama.cpp by %.4f (tolerance %.2f)", r.name, d_llama,
              LLAMA_TOL);
        CHECK(d_exact <= EXACT_TOL, "%s: log-probs differ from float64 by %.4f (tolerance %.2f)", r.name, d_exact,
              EXACT_TOL);
        CHECK(top1 == r.top_id[0] || top1 == x.exact_id[0], "%s: top-1 %d is neither llama.cpp's nor float64's",
              r.name, top1);

        /* 3. greedy continuation: identical to llama.cpp at every step whose
         * choice is numerically determined (llama.cpp's top-2 margin above
         * GREEDY_MARGIN); after the first near-tie the two may fork */
        int same = 0, decided = 32;
        for (int k = 0; k < 32; k++)
            if (r.margin[k] < GREEDY_MARGIN) {
                decided = k;
                break;
            }
        for (int k = 0; k < 32; k++) {
            tkv_token t = tkv_argmax(tkv_logits(s), V);
            if (t != r.greedy[k]) {
                fprintf(stderr, "%-5s greedy step %d: tierkv %d, llama.cpp %d (llama.cpp's top-2 margin %.4f)\n",
                        r.name, k, t, r.greedy[k], r.margin[k]);
                break;
            }
            same++;
            if (k < 31 && tkv_decode(s, t) != TKV_OK)
                break;
        }
        fprintf(stderr, "%-5s greedy: %d of 32 tokens identical; the first %d are decided (margin >= %.2f)\n", r.name,
                same, decided, GREEDY_MARGIN);
        CHECK(same >= decided, "%s: greedy continuation diverges at step %d, before the first near-tie (step %d)",
              r.name, same, decided);
        tkv_session_free(s);
        free(r.text);
    }
    fclose(f);
    fclose(fx);
    CHECK(n_records >= 3, "expected at least 3 reference prompts, read %d", n_records);
    tkv_model_free(m);
    return test_done();
}
