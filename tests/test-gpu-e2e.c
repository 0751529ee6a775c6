/*
 * test-gpu-e2e.c -- Description: the real model (TKV_MODEL) end to end on the
 * CPU and the CUDA backends through the public API (tkv_session_params.device).
 * Skips (77) without a CUDA device or without the model.
 *
 * For each prompt, three sessions: "cpu", "cuda", and "cuda" with
 * TKV_CUDA_WEIGHTS=f32 (exact f32 weights, f32 GEMMs: the validation mode).
 *   1. free-running greedy generation: cuda must give the CPU's tokens, and
 *      cuda the cuda-f32 tokens, except after a near tie (a step where the
 *      reference's own top-2 logit margin is below NEAR_TIE / NEAR_TIE_F32:
 *      inside the logit noise below, either token is a correct argmax);
 *   2. teacher-forced on the CPU's tokens, after the prompt and after every
 *      token:
 *        cuda vs cuda-f32: ||d|| / ||ref|| < F32_REL, max |d| < F32_ABS
 *          (what f16 weight storage and f16 prefill activations cost;
 *          measured on the H200 <= 2e-3 relative, <= 0.04 absolute), or,
 *          where f16 storage alone costs more, within F16W_FACTOR times
 *          that cost: a fifth session, "cuda-f16round" (TKV_CUDA_WEIGHTS=
 *          f16round: f32 weights holding the f16 copy's values, f32
 *          arithmetic), measures it on each prompt (the poem: ~1% relative,
 *          0.2 absolute, as the CPU backend shows with f16 and f32 copies
 *          of the model, docs/gpu.md);
 *        cuda vs cpu:      < CPU_REL, < CPU_ABS (the CPU backend quantizes
 *          decode activations to 8 bits, like llama.cpp: measured up to
 *          0.10 relative, 1.2 absolute, the same against cuda-f32, so this
 *          bound is the CPU's rounding, not the GPU's), or, where the CPU's
 *          own distance from cuda-f32 is larger, within CPU_NOISE times it;
 *      and the argmax must agree wherever the CPU margin is >= CPU_ABS.
 *      These sessions run the f16 decode GEMV (TKV_CUDA_GEMV_QUANT=0) for
 *      what they attribute; a fourth, teacher-forced, runs the default
 *      quantized decode GEMV (Q4_1 weights x Q8_1 activations, the CPU
 *      backend's kind of arithmetic): its distance from cuda-f32, averaged
 *      over the steps, must stay within Q_VS_CPU times the CPU's own (rel
 *      and abs), i.e. its rounding is the 8-bit activations' and nothing
 *      worse (a dropped term of the block formula moves logits by whole
 *      units at every step). The mean, not the worst step: two independent
 *      8-bit roundings' worst of 33 steps differ by chance (H200, session
 *      15, the poem: 0.095 against the CPU's 0.059 at one step, 1.6x).
 *      cuda-q vs cpu is printed, not bounded: the two quantize activations
 *      that already differ in their last bits (f16 prefill on the GPU), so
 *      their 8-bit roundings are independent and the distance is ~sqrt(2)
 *      times either's (H200: 0.27 / 0.20 / 0.06 rel against 0.15 / 0.11 /
 *      0.06 for cpu vs cuda-f32).
 * Logits of this model are O(10).
 *
 * Prompts: a chat prompt with 32 greedy tokens (one 512-token chunk, KV
 * blocks of 64), and a ~480-token prompt prefilled in chunks of 256 with KV
 * blocks of 32 (chunks end inside blocks), then 8 greedy tokens.
 *
 * Policies on the GPU (the long prompt, 12 tokens): entropy (online and
 * faithful), critiprefill, snapkv and adakv, whose statistics go through the
 * backend's attn_stats op, on "cuda" vs "cpu":
 *   a. same inputs, same decisions: every attn_stats call of a cuda session
 *      (teacher-forced on the CPU's tokens) is also computed by the CPU
 *      reference (tkv_attn_stats_heads) from the very queries and keys the
 *      GPU used, downloaded; P, window scores and entropies within the op's
 *      tolerance (1e-5 relative, 1e-6 + 1e-5 H), and the top-k sets (k = 1,
 *      2, 4, 8, n/8, n/4, n/2) and the Rigid class (H < 1e-5) identical
 *      except at a near tie (the CPU's k-th and k+1-th values within 2e-5
 *      relative, where either set is a correct answer);
 *   b. cuda vs cpu sessions on the same tokens: the top-n/4 sets of every
 *      call, head by head, overlap (Jaccard) by >= POL_JACCARD on average
 *      (the two backends' queries and keys differ by their rounding -- f16
 *      weights on the GPU, 8-bit decode activations on the CPU -- so a set
 *      can differ at its boundary; in the f32 validation mode by >=
 *      POL_JACCARD_F32), and the Rigid classes agree on >= POL_CLASS;
 *   c. free-running greedy tokens on cuda as on cpu up to a near tie (as 1).
 */
#include "runtime/backend.h"
#include "runtime/policy/policy.h"
#include "test.h"
#include "tierkv.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_GEN 32
#define F32_REL 1e-2      /* cuda vs cuda-f32 (see the header comment) */
#define F32_ABS 0.15
#define CPU_REL 0.15      /* cuda vs cpu */
#define CPU_ABS 2.5
#define NEAR_TIE 0.25     /* cpu top-2 margin under which a greedy flip is rounding */
#define NEAR_TIE_F32 0.1  /* cuda-f32 top-2 margin, likewise */
#define POL_JACCARD 0.90  /* policies: mean top-n/4 overlap, cuda vs cpu sessions */
#define POL_JACCARD_F32 0.97
#define POL_CLASS 0.98    /* share of (call, head) with the same Rigid class */
#define Q_VS_CPU 1.5       /* cuda-q vs cuda-f32 within this times cpu vs cuda-f32 */
#define F16W_FACTOR 1.5   /* cuda vs cuda-f32 within this times cuda-f16round vs cuda-f32 */
#define CPU_NOISE 1.25    /* cuda vs cpu within this times cpu vs cuda-f32 */
#define STATS_REL 1e-5    /* attn_stats gpu vs cpu reference on the same inputs (docs/gpu.md) */

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

struct run {
    tkv_token tok[MAX_GEN];         /* generated (free-running) or forced tokens */
    float *logits;                  /* [MAX_GEN + 1][V]: after the prompt, after each token */
    double t_prefill, t_decode;
};

static float top2_margin(const float *l, uint32_t n)
{
    float a = -INFINITY, b = -INFINITY;
    for (uint32_t i = 0; i < n; i++) {
        if (l[i] > a) {
            b = a;
            a = l[i];
        } else if (l[i] > b)
            b = l[i];
    }
    return a - b;
}

/* Prefill, then n_gen steps: greedy when forced == NULL, else decode forced[i]. */
static tkv_status generate_policy(tkv_model *m, const char *device, const char *policy, const tkv_token *prompt,
                                  size_t n_prompt, uint32_t chunk, uint32_t kv_block, int n_gen,
                                  const tkv_token *forced, struct run *r, double *read)
{
    const uint32_t V = tkv_model_n_vocab(m);
    struct tkv_session_params sp = tkv_session_default_params();
    sp.device = device;
    sp.policy = policy;
    sp.n_ctx = 2048;
    sp.prefill_chunk = chunk;
    sp.kv_block = kv_block;
    tkv_session *s = NULL;
    TKV_TRY(tkv_session_init(m, &sp, &s));
    if (!r->logits)
        r->logits = malloc((size_t)(MAX_GEN + 1) * V * sizeof(float));
    double t0 = now();
    tkv_status st = tkv_prefill(s, prompt, n_prompt);
    r->t_prefill = now() - t0;
    t0 = now();
    for (int i = 0; st == TKV_OK && i <= n_gen; i++) {
        memcpy(r->logits + (size_t)i * V, tkv_logits(s), V * sizeof(float));
        if (i == n_gen)
            break;
        r->tok[i] = forced ? forced[i] : tkv_argmax(tkv_logits(s), V);
        st = tkv_decode(s, r->tok[i]);
    }
    r->t_decode = now() - t0;
    if (read)
        tkv_session_kv_read(s, read, NULL);
    if (st == TKV_OK && strstr(device, "cuda")) {
        char json[2048];
        size_t len;
        if (tkv_session_stats_json(s, json, sizeof json, &len) == TKV_OK)
            CHECK(strstr(json, "\"device\": \"cuda\"") != NULL, "stats do not name the cuda backend: %s", json);
    }
    tkv_session_free(s);
    return st;
}

static tkv_status generate(tkv_model *m, const char *device, const tkv_token *prompt, size_t n_prompt, uint32_t chunk,
                           uint32_t kv_block, int n_gen, const tkv_token *forced, struct run *r)
{
    return generate_policy(m, device, "full", prompt, n_prompt, chunk, kv_block, n_gen, forced, r, NULL);
}

/* Relative L2 and max abs difference of two logit vectors. */
static void logit_diff(const float *a, const float *ref, uint32_t V, double *rel, double *mx)
{
    double num = 0, den = 0;
    *mx = 0;
    for (uint32_t i = 0; i < V; i++) {
        const double d = (double)a[i] - ref[i];
        num += d * d;
        den += (double)ref[i] * ref[i];
        *mx = isnan(d) ? INFINITY : fmax(*mx, fabs(d));
    }
    *rel = isinf(*mx) ? INFINITY : sqrt(num / den);
}

static void print_text(tkv_model *m, const char *label, const tkv_token *t, size_t n)
{
    char buf[4096];
    size_t len;
    if (tkv_detokenize(m, t, n, 0, buf, sizeof buf, &len) == TKV_OK)
        fprintf(stderr, "    %s \"%s\"\n", label, buf);
}

/* Index of the first different token, or -1. */
static int first_difference(const tkv_token *a, const tkv_token *b, int n)
{
    for (int i = 0; i < n; i++)
        if (a[i] != b[i])
            return i;
    return -1;
}

/* Checks free-running greedy tokens against a reference run. */
static void check_greedy(const char *name, const char *what, const struct run *ref, const struct run *r, int n_gen,
                         uint32_t V, float near_tie)
{
    const int k = first_difference(ref->tok, r->tok, n_gen);
    if (k < 0) {
        fprintf(stderr, "  greedy %s: %d of %d tokens identical\n", what, n_gen, n_gen);
        return;
    }
    const float m = top2_margin(ref->logits + (size_t)k * V, V);
    fprintf(stderr, "  greedy %s: first different token at step %d (%d vs %d), reference top-2 margin %.3f: %s\n",
            what, k, ref->tok[k], r->tok[k], m, m < near_tie ? "a near tie" : "NOT a near tie");
    CHECK(m < near_tie, "%s: greedy %s differ from step %d where the margin is %.3f >= %.2f", name, what, k, m,
          near_tie);
}

static void run_case(tkv_model *m, const char *name, const tkv_token *prompt, size_t n_prompt, uint32_t chunk,
                     uint32_t kv_block, int n_gen)
{
    const uint32_t V = tkv_model_n_vocab(m);
    struct run cpu = {0}, gpu = {0}, g32 = {0}, gpu_tf = {0}, g32_tf = {0}, gq_tf = {0}, g16_tf = {0};
    fprintf(stderr, "%s: %zu prompt tokens, chunk %u, KV block %u, %d greedy tokens\n", name, n_prompt, chunk,
            kv_block, n_gen);
    tkv_status st = generate(m, "cpu", prompt, n_prompt, chunk, kv_block, n_gen, NULL, &cpu);
    CHECK(st == TKV_OK, "cpu: %s", tkv_last_error());
    if (st == TKV_OK) {
        st = generate(m, "cuda", prompt, n_prompt, chunk, kv_block, n_gen, NULL, &gpu);
        CHECK(st == TKV_OK, "cuda: %s", tkv_last_error());
    }
    if (st == TKV_OK) {
        st = generate(m, "cuda", prompt, n_prompt, chunk, kv_block, n_gen, cpu.tok, &gpu_tf);
        CHECK(st == TKV_OK, "cuda (forced): %s", tkv_last_error());
    }
    if (st == TKV_OK) {
        setenv("TKV_CUDA_WEIGHTS", "f32", 1);
        st = generate(m, "cuda", prompt, n_prompt, chunk, kv_block, n_gen, NULL, &g32);
        if (st == TKV_OK)
            st = generate(m, "cuda", prompt, n_prompt, chunk, kv_block, n_gen, cpu.tok, &g32_tf);
        unsetenv("TKV_CUDA_WEIGHTS");
        CHECK(st == TKV_OK, "cuda f32: %s", tkv_last_error());
    }
    if (st == TKV_OK) { /* what f16 weight storage alone costs */
        setenv("TKV_CUDA_WEIGHTS", "f16round", 1);
        st = generate(m, "cuda", prompt, n_prompt, chunk, kv_block, n_gen, cpu.tok, &g16_tf);
        unsetenv("TKV_CUDA_WEIGHTS");
        CHECK(st == TKV_OK, "cuda f16round: %s", tkv_last_error());
    }
    if (st == TKV_OK) { /* the default decode path: the quantized GEMV */
        unsetenv("TKV_CUDA_GEMV_QUANT");
        st = generate(m, "cuda", prompt, n_prompt, chunk, kv_block, n_gen, cpu.tok, &gq_tf);
        setenv("TKV_CUDA_GEMV_QUANT", "0", 1);
        CHECK(st == TKV_OK, "cuda, quantized GEMV (forced): %s", tkv_last_error());
    }
    if (st != TKV_OK)
        goto out;

    /* 1. free-running greedy */
    print_text(m, "cpu     :", cpu.tok, n_gen);
    print_text(m, "cuda    :", gpu.tok, n_gen);
    print_text(m, "cuda-f32:", g32.tok, n_gen);
    check_greedy(name, "cuda vs cpu", &cpu, &gpu, n_gen, V, NEAR_TIE);
    check_greedy(name, "cuda vs cuda-f32", &g32, &gpu, n_gen, V, NEAR_TIE_F32);
    fprintf(stderr, "  time: cpu prefill %.1f ms, decode %.1f tok/s | cuda prefill %.1f ms, decode %.1f tok/s\n",
            cpu.t_prefill * 1e3, n_gen / cpu.t_decode, gpu.t_prefill * 1e3, n_gen / gpu.t_decode);

    /* 2. teacher-forced logits */
    double w[3][2] = {{0}}; /* worst (rel, abs): cuda-cpu, cuda-f32, cpu-f32 */
    double wq[2] = {0}, wq32[2] = {0}; /* cuda-q vs cpu, cuda-q vs cuda-f32 */
    double w16[2] = {0};               /* cuda-f16round vs cuda-f32 */
    double mq32[2] = {0}, mc32[2] = {0}; /* sums over steps: cuda-q vs cuda-f32, cpu vs cuda-f32 */
    int flips = 0, ties = 0;
    for (int i = 0; i <= n_gen; i++) {
        const float *lc = cpu.logits + (size_t)i * V, *lg = gpu_tf.logits + (size_t)i * V;
        const float *l32 = g32_tf.logits + (size_t)i * V;
        double d[3][2];
        logit_diff(lg, lc, V, &d[0][0], &d[0][1]);
        logit_diff(lg, l32, V, &d[1][0], &d[1][1]);
        logit_diff(lc, l32, V, &d[2][0], &d[2][1]);
        for (int k = 0; k < 3; k++)
            w[k][0] = fmax(w[k][0], d[k][0]), w[k][1] = fmax(w[k][1], d[k][1]);
        double dq[2];
        logit_diff(gq_tf.logits + (size_t)i * V, lc, V, &dq[0], &dq[1]);
        wq[0] = fmax(wq[0], dq[0]), wq[1] = fmax(wq[1], dq[1]);
        logit_diff(gq_tf.logits + (size_t)i * V, l32, V, &dq[0], &dq[1]);
        wq32[0] = fmax(wq32[0], dq[0]), wq32[1] = fmax(wq32[1], dq[1]);
        mq32[0] += dq[0], mq32[1] += dq[1], mc32[0] += d[2][0], mc32[1] += d[2][1];
        logit_diff(g16_tf.logits + (size_t)i * V, l32, V, &dq[0], &dq[1]);
        w16[0] = fmax(w16[0], dq[0]), w16[1] = fmax(w16[1], dq[1]);
        const float margin = top2_margin(lc, V);
        const bool same = tkv_argmax(lg, V) == tkv_argmax(lc, V);
        ties += margin < NEAR_TIE;
        if (!same && margin >= CPU_ABS)
            flips++;
        if (i == 0 || i == n_gen || !same)
            fprintf(stderr,
                    "    step %2d: cuda-vs-cpu rel %.2e max %.3f | cuda-vs-f32 rel %.2e max %.3f | "
                    "cpu-vs-f32 rel %.2e max %.3f | cpu margin %.3f%s\n",
                    i, d[0][0], d[0][1], d[1][0], d[1][1], d[2][0], d[2][1], margin, same ? "" : " (argmax differs)");
    }
    fprintf(stderr,
            "  teacher-forced, %d steps, worst (rel, max abs): cuda-vs-cpu %.2e %.3f | cuda-vs-f32 %.2e %.3f | "
            "cpu-vs-f32 %.2e %.3f; cpu near ties %d\n",
            n_gen + 1, w[0][0], w[0][1], w[1][0], w[1][1], w[2][0], w[2][1], ties);
    /* the bounds: fixed, or the unavoidable part's multiple where that is larger */
    const double f32_rel = fmax(F32_REL, F16W_FACTOR * w16[0]), f32_abs = fmax(F32_ABS, F16W_FACTOR * w16[1]);
    const double cpu_rel = fmax(CPU_REL, CPU_NOISE * w[2][0]), cpu_abs = fmax(CPU_ABS, CPU_NOISE * w[2][1]);
    fprintf(stderr, "  teacher-forced: f16 weight storage alone (cuda-f16round vs cuda-f32) rel %.2e max %.3f; bounds "
                    "cuda-vs-f32 %.2e %.3f, cuda-vs-cpu %.2e %.3f\n", w16[0], w16[1], f32_rel, f32_abs, cpu_rel, cpu_abs);
    CHECK(w[1][0] < f32_rel && w[1][1] < f32_abs,
          "%s: cuda vs cuda-f32 logits: rel %.3g, max %.3g (bounds %.3g, %.3g; f16 storage alone %.3g, %.3g)", name,
          w[1][0], w[1][1], f32_rel, f32_abs, w16[0], w16[1]);
    CHECK(w[0][0] < cpu_rel && w[0][1] < cpu_abs,
          "%s: cuda vs cpu logits: rel %.3g, max %.3g (bounds %.3g, %.3g; cpu vs cuda-f32 %.3g, %.3g)", name, w[0][0],
          w[0][1], cpu_rel, cpu_abs, w[2][0], w[2][1]);
    CHECK(flips == 0, "%s: %d argmax flips at steps with a CPU margin >= %.1f", name, flips, CPU_ABS);
    const double steps = n_gen + 1;
    for (int k = 0; k < 2; k++)
        mq32[k] /= steps, mc32[k] /= steps;
    fprintf(stderr, "  teacher-forced, quantized decode GEMV: cuda-q-vs-f32 worst rel %.2e max %.3f (cpu-vs-f32 %.2e "
                    "%.3f), mean rel %.2e max %.3f (cpu %.2e %.3f) | cuda-q-vs-cpu rel %.2e max %.3f\n", wq32[0],
            wq32[1], w[2][0], w[2][1], mq32[0], mq32[1], mc32[0], mc32[1], wq[0], wq[1]);
    CHECK(mq32[0] <= Q_VS_CPU * mc32[0] && mq32[1] <= Q_VS_CPU * mc32[1],
          "%s: cuda (quantized GEMV) vs cuda-f32 logits: mean rel %.3g, max %.3g per step, beyond %.1f x the cpu's "
          "%.3g, %.3g",
          name, mq32[0], mq32[1], Q_VS_CPU, mc32[0], mc32[1]);
out:
    free(cpu.logits), free(gpu.logits), free(g32.logits), free(gpu_tf.logits), free(g32_tf.logits);
    free(gq_tf.logits), free(g16_tf.logits);
}

/* ---- policies on the GPU: the attn_stats calls, checked and recorded ------------------------ */

/* A log of decisions: per attn_stats call kind, n_head_kv, n; per head the
 * Rigid bit (SEGMENT) and the top-max(1, n/4) set. */
struct declog {
    uint32_t *v;
    size_t n, cap;
};

static void dl_put(struct declog *d, uint32_t x)
{
    if (d->n == d->cap) {
        d->cap = d->cap ? 2 * d->cap : 1 << 16;
        d->v = realloc(d->v, d->cap * sizeof *d->v);
    }
    d->v[d->n++] = x;
}

static struct declog *rec_log;             /* the session being recorded */
static tkv_status (*inner_stats[2])(struct tkv_backend *, const struct tkv_attn_stats_args *); /* cpu, cuda */
static struct tkv_backend_ops rec_ops[2];
static struct {
    uint64_t calls, values, bitwise, worse, k_checks, k_ties, k_diff, class_diff;
    double worst_rel, worst_h;
} tee;

static void record(const struct tkv_attn_stats_args *a, uint32_t n)
{
    if (!rec_log)
        return;
    const uint32_t k = TKV_MAX(1u, n / 4);
    uint32_t *idx = malloc((size_t)TKV_MAX(n, 1u) * sizeof *idx);
    dl_put(rec_log, (uint32_t)a->kind << 24 | a->n_head_kv);
    dl_put(rec_log, n);
    for (uint32_t g = 0; g < a->n_head_kv; g++) {
        const float *x = a->kind == TKV_ATTN_STATS_SEGMENT ? a->probs + (size_t)g * a->probs_stride
                                                           : a->scores + (size_t)g * a->n_prefix;
        dl_put(rec_log, a->kind == TKV_ATTN_STATS_SEGMENT && a->entropy ? a->entropy[g] < 1e-5 : 0);
        const uint32_t m = n ? tkv_policy_top_k(x, n, k, idx) : 0;
        for (uint32_t i = 0; i < k; i++)
            dl_put(rec_log, i < m ? idx[i] : UINT32_MAX);
    }
    free(idx);
}

static int cmp_desc(const void *a, const void *b)
{
    const float x = *(const float *)a, y = *(const float *)b;
    return x > y ? -1 : x < y;
}

/* The GPU's values x vs the CPU reference's r (n per head): the values,
 * then the top-k sets at several k, a difference excused at a near tie. */
static void compare_row(const float *x, const float *r, uint32_t n)
{
    for (uint32_t j = 0; j < n; j++) {
        const double d = fabs((double)x[j] - r[j]);
        tee.values++;
        tee.bitwise += x[j] == r[j];
        if (r[j] != 0)
            tee.worst_rel = fmax(tee.worst_rel, d / fabs(r[j]));
        tee.worse += !(d <= STATS_REL * fabs(r[j]) + 1e-30);
    }
    float *sorted = malloc(n * sizeof *sorted);
    uint32_t *ia = malloc(n * sizeof *ia), *ib = malloc(n * sizeof *ib);
    memcpy(sorted, r, n * sizeof *sorted);
    qsort(sorted, n, sizeof *sorted, cmp_desc);
    const uint32_t ks[] = {1, 2, 4, 8, n / 8, n / 4, n / 2};
    for (size_t i = 0; i < sizeof ks / sizeof ks[0]; i++) {
        const uint32_t k = ks[i];
        if (k == 0 || k >= n)
            continue;
        tkv_policy_top_k(x, n, k, ia);
        tkv_policy_top_k(r, n, k, ib);
        tee.k_checks++;
        if (!memcmp(ia, ib, k * sizeof *ia))
            continue;
        if (sorted[k - 1] - sorted[k] <= 2 * STATS_REL * fabsf(sorted[k - 1]))
            tee.k_ties++;
        else
            tee.k_diff++;
    }
    free(sorted), free(ia), free(ib);
}

/* The CPU reference of a call from the GPU's own inputs, downloaded. */
static void check_call(struct tkv_backend *b, const struct tkv_attn_stats_args *a, uint32_t nb)
{
    const uint32_t H = a->n_head_kv, hd = a->head_dim;
    const size_t qn = (size_t)a->n_q * a->n_head * hd;
    struct tkv_attn_stats_args c = *a;
    float *q = NULL;
    if (!a->q_host && qn) {
        q = malloc(qn * sizeof *q);
        CHECK(b->ops->download(b, q, a->q, qn * sizeof *q) == TKV_OK, "download q: %s", tkv_last_error());
        c.q = q;
    }
    size_t total = 0;
    for (uint32_t g = 0; g < H; g++)
        total += a->kv[g].n_blocks;
    struct tkv_kv_block_ref *refs = malloc(TKV_MAX(total, (size_t)1) * sizeof *refs);
    struct tkv_kv_head_view *views = malloc(H * sizeof *views);
    size_t k = 0;
    for (uint32_t g = 0; g < H; g++) {
        views[g] = (struct tkv_kv_head_view){.blocks = refs + k, .n_blocks = a->kv[g].n_blocks};
        for (uint32_t i = 0; i < a->kv[g].n_blocks; i++, k++) {
            refs[k] = a->kv[g].blocks[i];
            uint16_t *kh = malloc((size_t)TKV_MAX(refs[k].n, 1u) * hd * sizeof *kh);
            CHECK(b->ops->download(b, kh, refs[k].k, (size_t)refs[k].n * hd * sizeof *kh) == TKV_OK, "download k");
            refs[k].k = kh, refs[k].v = NULL;
        }
    }
    c.kv = views;
    const bool seg = a->kind == TKV_ATTN_STATS_SEGMENT;
    const uint32_t n = seg ? nb : a->n_prefix;
    float *out = malloc((size_t)H * TKV_MAX(n, 1u) * sizeof *out), *scratch = malloc(TKV_MAX(n, 1u) * sizeof *scratch);
    double ent[1024];
    if (seg)
        c.probs = out, c.probs_stride = n, c.entropy = ent;
    else
        c.scores = out;
    CHECK(tkv_attn_stats_heads(&c, nb, 0, H, scratch) == TKV_OK, "cpu reference: %s", tkv_last_error());
    for (uint32_t g = 0; g < H && n; g++) {
        if (seg && a->probs)
            compare_row(a->probs + (size_t)g * a->probs_stride, out + (size_t)g * n, n);
        else if (!seg)
            compare_row(a->scores + (size_t)g * n, out + (size_t)g * n, n);
        if (seg && a->entropy) {
            const double d = fabs(a->entropy[g] - ent[g]);
            tee.worst_h = fmax(tee.worst_h, d);
            CHECK(d <= 1e-6 + 1e-5 * ent[g], "entropy %.9g on the GPU, %.9g on the CPU", a->entropy[g], ent[g]);
            if ((a->entropy[g] < 1e-5) != (ent[g] < 1e-5) && fabs(ent[g] - 1e-5) > 1e-6 + 1e-5 * ent[g])
                tee.class_diff++;
        }
    }
    for (size_t i = 0; i < k; i++)
        free(refs[i].k);
    free(refs), free(views), free(out), free(scratch), free(q);
}

static tkv_status rec_cpu_stats(struct tkv_backend *b, const struct tkv_attn_stats_args *a)
{
    TKV_TRY(inner_stats[0](b, a));
    uint32_t nb;
    TKV_TRY(tkv_attn_stats_check(a, &nb));
    record(a, a->kind == TKV_ATTN_STATS_SEGMENT ? nb : a->n_prefix);
    return TKV_OK;
}

static tkv_status tee_cuda_stats(struct tkv_backend *b, const struct tkv_attn_stats_args *a)
{
    TKV_TRY(inner_stats[1](b, a));
    uint32_t nb;
    TKV_TRY(tkv_attn_stats_check(a, &nb));
    tee.calls++;
    if (a->n_head_kv <= 1024)
        check_call(b, a, nb);
    record(a, a->kind == TKV_ATTN_STATS_SEGMENT ? nb : a->n_prefix);
    return TKV_OK;
}

/* "cpu-rec": the CPU backend recording its decisions; "cuda-tee": the CUDA
 * backend whose every attn_stats call is checked against the CPU reference
 * and recorded. Both keep their backend's name and memory. */
static tkv_status tee_factory(const char *device, uint32_t n_threads, struct tkv_backend **out)
{
    const int i = !strcmp(device, "cpu-rec") ? 0 : !strcmp(device, "cuda-tee") ? 1 : -1;
    if (i < 0)
        return TKV_ERR_UNSUPPORTED;
    TKV_TRY(tkv_backend_create(i ? "cuda" : "cpu", n_threads, out));
    inner_stats[i] = (*out)->ops->attn_stats;
    rec_ops[i] = *(*out)->ops;
    rec_ops[i].attn_stats = i ? tee_cuda_stats : rec_cpu_stats;
    (*out)->ops = &rec_ops[i];
    return TKV_OK;
}

/* A policy's session (prefill in the policy's segments, KV blocks of 32)
 * with its attn_stats decisions recorded in log. */
static tkv_status policy_run(tkv_model *m, const char *device, const char *policy, const tkv_token *prompt,
                             size_t n_prompt, int n_gen, const tkv_token *forced, struct run *r, struct declog *log,
                             double *read)
{
    rec_log = log;
    tkv_status st = generate_policy(m, device, policy, prompt, n_prompt, 256, 32, n_gen, forced, r, read);
    rec_log = NULL;
    return st;
}

/* Mean Jaccard overlap of the top sets of two logs, head by head, and the
 * share of equal Rigid classes; false if the calls do not line up. */
static bool compare_logs(const struct declog *a, const struct declog *b, double *jac, double *cls, uint64_t *sets)
{
    double sum = 0;
    uint64_t n_sets = 0, same_cls = 0;
    size_t i = 0;
    while (i < a->n && i < b->n) {
        if (a->v[i] != b->v[i] || a->v[i + 1] != b->v[i + 1])
            return false;
        const uint32_t H = a->v[i] & 0xffffff, n = a->v[i + 1], k = TKV_MAX(1u, n / 4);
        i += 2;
        for (uint32_t g = 0; g < H; g++, i += 1 + k) {
            same_cls += a->v[i] == b->v[i];
            uint32_t inter = 0, ja = 0, jb = 0;
            const uint32_t *x = a->v + i + 1, *y = b->v + i + 1;
            while (ja < k && jb < k) /* both ascending */
                if (x[ja] == y[jb])
                    inter++, ja++, jb++;
                else if (x[ja] < y[jb])
                    ja++;
                else
                    jb++;
            sum += (double)inter / (2 * k - inter);
            n_sets++;
        }
    }
    *jac = n_sets ? sum / n_sets : 1.0;
    *cls = n_sets ? (double)same_cls / n_sets : 1.0;
    *sets = n_sets;
    return i == a->n && i == b->n;
}

static void run_policies(tkv_model *m, const tkv_token *prompt, size_t n_prompt)
{
    enum { NG = 12 };
    static const char *const specs[] = {
        "entropy:segment=128,block=8,threshold=128,base=64,gap=4,window=16,keep=160,resel=4",
        "entropy:faithful=1,segment=128,block=8,threshold=128,base=64,gap=4,window=16,keep=160",
        "critiprefill:segment=128,block=16,budget=64,threshold=128",
        "snapkv:budget=128,window=16",
        "adakv:budget=128,window=16",
    };
    const uint32_t V = tkv_model_n_vocab(m);
    tkv_backend_set_test_factory(tee_factory);
    fprintf(stderr, "policies on the GPU: %zu prompt tokens, %d tokens\n", n_prompt, NG);
    for (size_t p = 0; p < sizeof specs / sizeof specs[0]; p++) {
        struct run cpu = {0}, gpu = {0}, tf = {0}, tf32 = {0};
        struct declog lc = {0}, lg = {0}, l32 = {0};
        double rc = 0, rg = 0, rt = 0, r32 = 0;
        memset(&tee, 0, sizeof tee);
        tkv_status st = policy_run(m, "cpu-rec", specs[p], prompt, n_prompt, NG, NULL, &cpu, &lc, &rc);
        CHECK(st == TKV_OK, "%s on cpu: %s", specs[p], tkv_last_error());
        if (st == TKV_OK) {
            st = policy_run(m, "cuda-tee", specs[p], prompt, n_prompt, NG, cpu.tok, &tf, &lg, &rt);
            CHECK(st == TKV_OK, "%s on cuda (forced): %s", specs[p], tkv_last_error());
        }
        if (st == TKV_OK) {
            setenv("TKV_CUDA_WEIGHTS", "f32", 1);
            st = policy_run(m, "cuda-tee", specs[p], prompt, n_prompt, NG, cpu.tok, &tf32, &l32, &r32);
            unsetenv("TKV_CUDA_WEIGHTS");
            CHECK(st == TKV_OK, "%s on cuda f32 (forced): %s", specs[p], tkv_last_error());
        }
        if (st == TKV_OK) {
            st = policy_run(m, "cuda", specs[p], prompt, n_prompt, NG, NULL, &gpu, NULL, &rg);
            CHECK(st == TKV_OK, "%s on cuda: %s", specs[p], tkv_last_error());
        }
        if (st == TKV_OK) {
            /* a. same inputs, same decisions */
            fprintf(stderr,
                    "  %s\n    a. %llu attn_stats calls checked: %llu values (%llu bit-identical, %llu beyond %.0e "
                    "rel, worst %.2e), entropies worst |d| %.2e; top-k sets: %llu checks, %llu at near ties, %llu "
                    "different; Rigid classes different: %llu\n",
                    specs[p], (unsigned long long)tee.calls, (unsigned long long)tee.values,
                    (unsigned long long)tee.bitwise, (unsigned long long)tee.worse, STATS_REL, tee.worst_rel,
                    tee.worst_h, (unsigned long long)tee.k_checks, (unsigned long long)tee.k_ties,
                    (unsigned long long)tee.k_diff, (unsigned long long)tee.class_diff);
            CHECK(tee.calls > 0, "%s: no attn_stats call on cuda", specs[p]);
            CHECK(tee.worse == 0 && tee.k_diff == 0 && tee.class_diff == 0,
                  "%s: the GPU's statistics decide otherwise than the CPU's on the same inputs", specs[p]);
            /* b. cuda vs cpu sessions, same tokens */
            double jac, cls, jac32, cls32;
            uint64_t sets, sets32;
            const bool lined = compare_logs(&lc, &lg, &jac, &cls, &sets);
            const bool lined32 = compare_logs(&lc, &l32, &jac32, &cls32, &sets32);
            fprintf(stderr,
                    "    b. cuda vs cpu: %llu head sets, mean top-n/4 overlap %.4f, classes equal %.4f | cuda-f32 "
                    "vs cpu: %.4f, %.4f | decode read %.4f (cpu) %.4f (cuda) %.4f (cuda-f32)\n",
                    (unsigned long long)sets, jac, cls, jac32, cls32, rc, rt, r32);
            CHECK(lined && lined32, "%s: the cuda sessions made other attn_stats calls than the cpu one", specs[p]);
            CHECK(jac >= POL_JACCARD && cls >= POL_CLASS, "%s: cuda vs cpu overlap %.4f, classes %.4f", specs[p],
                  jac, cls);
            CHECK(jac32 >= POL_JACCARD_F32 && cls32 >= POL_CLASS, "%s: cuda-f32 vs cpu overlap %.4f, classes %.4f",
                  specs[p], jac32, cls32);
            /* c. free-running greedy */
            check_greedy(specs[p], "cuda vs cpu", &cpu, &gpu, NG, V, NEAR_TIE);
            (void)rg;
        }
        free(cpu.logits), free(gpu.logits), free(tf.logits), free(tf32.logits);
        free(lc.v), free(lg.v), free(l32.v);
    }
    tkv_backend_set_test_factory(NULL);
}

static const char *story =
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps as his father had "
    "taught him: one hundred and twelve, no more and no less. At the top he trimmed the wick, polished the great "
    "lens and wrote the weather in a leather book whose first pages were older than the town itself. ";

int main(void)
{
    const char *path = test_model_path();
    if (tkv_backend_cuda_devices() == 0)
        SKIP("no usable CUDA device");
    /* the f16 decode GEMV for the sessions whose rounding this test
     * attributes (header comment); run_case lifts it for its cuda-q session */
    setenv("TKV_CUDA_GEMV_QUANT", "0", 1);
    tkv_model *m = NULL;
    REQUIRE(tkv_model_load(path, &m) == TKV_OK, "%s", tkv_last_error());

    char text[8192];
    size_t len, n;
    static tkv_token toks[4096];
    const char *questions[] = {"Write a short poem about the sea at night.", "What is the capital of France?"};
    for (int q = 0; q < 2; q++) {
        REQUIRE(tkv_chat_prompt(m, NULL, questions[q], text, sizeof text, &len) == TKV_OK, "%s", tkv_last_error());
        REQUIRE(tkv_tokenize(m, text, -1, TKV_TOK_PARSE_SPECIAL, toks, 4096, &n) == TKV_OK, "%s", tkv_last_error());
        run_case(m, q == 0 ? "chat: poem" : "chat: capital", toks, n, 512, 64, MAX_GEN);
    }

    size_t used = 0;
    for (int i = 0; i < 7; i++)
        used += (size_t)snprintf(text + used, sizeof text - used, "Chapter %d. %s", i + 1, story);
    snprintf(text + used, sizeof text - used, "How many steps did the keeper count? He counted");
    REQUIRE(tkv_tokenize(m, text, -1, 0, toks, 4096, &n) == TKV_OK, "%s", tkv_last_error());
    run_case(m, "long prompt", toks, n, 256, 32, 8);
    run_policies(m, toks, n);

    tkv_model_free(m);
    return test_done();
}
