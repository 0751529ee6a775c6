/*
 * sampler.c -- turning logits into a token: greedy, or temperature with
 * top-k and top-p (nucleus) filtering, from a seeded PRNG so a run is
 * reproducible for a given seed.
 *
 * Order, as llama.cpp applies them: top-k, then softmax at the temperature,
 * then top-p over the sorted candidates, then a draw.
 */
#include "tkv-impl.h"

#include <math.h>
#include <stdlib.h>

struct tkv_candidate {
    tkv_token id;
    float logit;
};

struct tkv_sampler {
    struct tkv_sampler_params p;
    uint32_t n_vocab;
    uint64_t rng;
    struct tkv_candidate *cand; /* [n_vocab] */
    float *prob;                /* [n_vocab] */
};

struct tkv_sampler_params tkv_sampler_default_params(void)
{
    return (struct tkv_sampler_params){.temperature = 0.0f, .top_k = 0, .top_p = 1.0f, .seed = 0};
}

tkv_status tkv_sampler_init(const struct tkv_sampler_params *params, uint32_t n_vocab, tkv_sampler **out)
{
    if (!out)
        return tkv_err(TKV_ERR_INVALID_ARG, "sampler: out is NULL");
    *out = NULL;
    struct tkv_sampler_params p = params ? *params : tkv_sampler_default_params();
    if (n_vocab == 0)
        return tkv_err(TKV_ERR_INVALID_ARG, "sampler: empty vocabulary");
    if (!(p.temperature >= 0.0f) || !isfinite(p.temperature))
        return tkv_err(TKV_ERR_INVALID_ARG, "sampler: temperature %g must be finite and >= 0", p.temperature);
    if (!(p.top_p > 0.0f && p.top_p <= 1.0f))
        return tkv_err(TKV_ERR_INVALID_ARG, "sampler: top_p %g must be in (0, 1]", p.top_p);
    tkv_sampler *s = calloc(1, sizeof *s);
    if (!s)
        return tkv_err(TKV_ERR_NOMEM, "sampler: out of memory");
    s->p = p;
    s->n_vocab = n_vocab;
    s->rng = p.seed * 0x9E3779B97F4A7C15ull + 0x2545F4914F6CDD1Dull;
    s->cand = malloc((size_t)n_vocab * sizeof *s->cand);
    s->prob = malloc((size_t)n_vocab * sizeof *s->prob);
    if (!s->cand || !s->prob) {
        tkv_sampler_free(s);
        return tkv_err(TKV_ERR_NOMEM, "sampler: out of memory");
    }
    *out = s;
    return TKV_OK;
}

void tkv_sampler_free(tkv_sampler *s)
{
    if (!s)
        return;
    free(s->cand);
    free(s->prob);
    free(s);
}

tkv_token tkv_argmax(const float *logits, uint32_t n_vocab)
{
    tkv_token best = 0;
    for (uint32_t i = 1; i < n_vocab; i++)
        if (logits[i] > logits[best])
            best = (tkv_token)i;
    return best;
}

/* splitmix64: a fine generator for sampling; 53-bit uniform in [0, 1). */
static double next_uniform(uint64_t *state)
{
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (double)(z >> 11) * (1.0 / 9007199254740992.0);
}

static int cand_desc(const void *a, const void *b)
{
    const struct tkv_candidate *x = a, *y = b;
    if (x->logit != y->logit)
        return x->logit < y->logit ? 1 : -1;
    return x->id - y->id; /* lower id first on ties: deterministic */
}

tkv_token tkv_sampler_sample(tkv_sampler *s, const float *logits)
{
    if (s->p.temperature == 0.0f)
        return tkv_argmax(logits, s->n_vocab);
    uint32_t n = s->n_vocab;
    for (uint32_t i = 0; i < n; i++)
        s->cand[i] = (struct tkv_candidate){(tkv_token)i, logits[i]};
    qsort(s->cand, n, sizeof *s->cand, cand_desc);
    if (s->p.top_k > 0 && s->p.top_k < n)
        n = s->p.top_k;
    /* softmax at the temperature over the surviving candidates */
    const float mx = s->cand[0].logit;
    double sum = 0;
    for (uint32_t i = 0; i < n; i++) {
        s->prob[i] = expf((s->cand[i].logit - mx) / s->p.temperature);
        sum += s->prob[i];
    }
    /* top-p: the smallest prefix whose mass reaches p (at least one token) */
    if (s->p.top_p < 1.0f) {
        double acc = 0;
        uint32_t keep = n;
        for (uint32_t i = 0; i < n; i++) {
            acc += s->prob[i] / sum;
            if (acc >= s->p.top_p) {
                keep = i + 1;
                break;
            }
        }
        n = keep;
        sum = 0;
        for (uint32_t i = 0; i < n; i++)
            sum += s->prob[i];
    }
    double r = next_uniform(&s->rng) * sum, acc = 0;
    for (uint32_t i = 0; i < n; i++) {
        acc += s->prob[i];
        if (r < acc)
            return s->cand[i].id;
    }
    return s->cand[n - 1].id;
}
