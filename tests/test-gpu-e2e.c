/*
 * test-gpu-e2e.c -- Description: the real model (TKV_MODEL) end to end on the
 * CPU and the CUDA backends through the public API (tkv_session_params.device).
 * Skips (77) without a CUDA device or without the model.
 *
 * For each prompt:
 *   1. free-running greedy generation on "cpu" and on "cuda": the tokens must
 *      be identical, except after a near tie: a step where the CPU's own
 *      top-2 logit margin is below NEAR_TIE, i.e. within the logit noise of
 *      either backend's arithmetic (then the divergence is reported and the
 *      comparison goes on with step 2);
 *   2. teacher-forced: the CUDA sessions are fed the CPU's tokens, and the
 *      logits after the prompt and after every generated token must agree:
 *      ||gpu - cpu|| / ||cpu|| < LOGIT_REL and max |gpu - cpu| < LOGIT_ABS;
 *      the argmax must agree wherever the CPU margin is at least NEAR_TIE;
 *   3. attribution: the same teacher-forced run with TKV_CUDA_WEIGHTS=f32
 *      (exact f32 weights and f32 GEMMs on the GPU) tells how much of the
 *      difference the GPU's f16 storage makes and how much is the CPU's own
 *      rounding (its decode matmuls quantize activations to 8 bits).
 *
 * Prompts: a chat prompt with 32 greedy tokens (one 512-token chunk, KV
 * blocks of 64), and a ~480-token prompt prefilled in chunks of 256 with KV
 * blocks of 32 (chunks end inside blocks), then 8 greedy tokens.
 */
#include "runtime/backend.h"
#include "test.h"
#include "tierkv.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_GEN 32
#define LOGIT_REL 3e-2  /* logits are O(10): see the header comment */
#define LOGIT_ABS 1.0
#define NEAR_TIE 0.25   /* top-2 margin under which a flip is rounding, not a bug */

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
static tkv_status generate(tkv_model *m, const char *device, const tkv_token *prompt, size_t n_prompt, uint32_t chunk,
                           uint32_t kv_block, int n_gen, const tkv_token *forced, struct run *r)
{
    const uint32_t V = tkv_model_n_vocab(m);
    struct tkv_session_params sp = tkv_session_default_params();
    sp.device = device;
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
    if (st == TKV_OK && strcmp(device, "cpu")) {
        char json[2048];
        size_t len;
        if (tkv_session_stats_json(s, json, sizeof json, &len) == TKV_OK)
            CHECK(strstr(json, "\"device\": \"cuda\"") != NULL, "stats do not name the cuda backend: %s", json);
    }
    tkv_session_free(s);
    return st;
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

static void run_case(tkv_model *m, const char *name, const tkv_token *prompt, size_t n_prompt, uint32_t chunk,
                     uint32_t kv_block, int n_gen)
{
    const uint32_t V = tkv_model_n_vocab(m);
    struct run cpu = {0}, gpu = {0}, gpu_tf = {0}, f32_tf = {0};
    fprintf(stderr, "%s: %zu prompt tokens, chunk %u, KV block %u, %d greedy tokens\n", name, n_prompt, chunk,
            kv_block, n_gen);

    /* 1. free-running greedy on both */
    tkv_status st = generate(m, "cpu", prompt, n_prompt, chunk, kv_block, n_gen, NULL, &cpu);
    CHECK(st == TKV_OK, "cpu: %s", tkv_last_error());
    if (st != TKV_OK)
        return;
    st = generate(m, "cuda", prompt, n_prompt, chunk, kv_block, n_gen, NULL, &gpu);
    CHECK(st == TKV_OK, "cuda: %s", tkv_last_error());
    if (st != TKV_OK)
        return;
    print_text(m, "cpu :", cpu.tok, n_gen);
    print_text(m, "cuda:", gpu.tok, n_gen);
    int first_diff = -1;
    for (int i = 0; i < n_gen && first_diff < 0; i++)
        if (cpu.tok[i] != gpu.tok[i])
            first_diff = i;
    if (first_diff < 0) {
        fprintf(stderr, "  greedy: %d of %d tokens identical\n", n_gen, n_gen);
    } else {
        const float mc = top2_margin(cpu.logits + (size_t)first_diff * V, V);
        fprintf(stderr, "  greedy: first different token at step %d (cpu %d, cuda %d), cpu top-2 margin there %.3f: %s\n",
                first_diff, cpu.tok[first_diff], gpu.tok[first_diff], mc,
                mc < NEAR_TIE ? "a near tie" : "NOT a near tie");
        CHECK(mc < NEAR_TIE, "%s: greedy tokens differ from step %d where the CPU margin is %.3f >= %.2f", name,
              first_diff, mc, NEAR_TIE);
    }
    fprintf(stderr, "  time: cpu prefill %.1f ms, decode %.1f tok/s | cuda prefill %.1f ms, decode %.1f tok/s\n",
            cpu.t_prefill * 1e3, n_gen / cpu.t_decode, gpu.t_prefill * 1e3, n_gen / gpu.t_decode);

    /* 2. teacher-forced on the CPU's tokens: f16 (default) and f32 validation mode */
    st = generate(m, "cuda", prompt, n_prompt, chunk, kv_block, n_gen, cpu.tok, &gpu_tf);
    CHECK(st == TKV_OK, "cuda (forced): %s", tkv_last_error());
    setenv("TKV_CUDA_WEIGHTS", "f32", 1);
    tkv_status st32 = generate(m, "cuda", prompt, n_prompt, chunk, kv_block, n_gen, cpu.tok, &f32_tf);
    unsetenv("TKV_CUDA_WEIGHTS");
    CHECK(st32 == TKV_OK, "cuda f32 (forced): %s", tkv_last_error());
    if (st == TKV_OK && st32 == TKV_OK) {
        double worst_rel = 0, worst_abs = 0, sum_rel[3] = {0};
        int flips = 0, ties = 0;
        for (int i = 0; i <= n_gen; i++) {
            const float *lc = cpu.logits + (size_t)i * V, *lg = gpu_tf.logits + (size_t)i * V;
            const float *l32 = f32_tf.logits + (size_t)i * V;
            double rel, mx, rel2, mx2, rel3, mx3;
            logit_diff(lg, lc, V, &rel, &mx);    /* cuda f16 vs cpu  */
            logit_diff(lg, l32, V, &rel2, &mx2); /* cuda f16 vs f32  */
            logit_diff(lc, l32, V, &rel3, &mx3); /* cpu vs cuda f32  */
            worst_rel = fmax(worst_rel, rel);
            worst_abs = fmax(worst_abs, mx);
            sum_rel[0] += rel, sum_rel[1] += rel2, sum_rel[2] += rel3;
            const float margin = top2_margin(lc, V);
            const bool same = tkv_argmax(lg, V) == tkv_argmax(lc, V);
            if (margin < NEAR_TIE)
                ties++;
            else if (!same)
                flips++;
            if (i == 0 || i == n_gen || !same)
                fprintf(stderr,
                        "    step %2d: cuda-vs-cpu rel %.2e max %.3f | cuda-vs-cuda32 rel %.2e max %.3f | "
                        "cpu-vs-cuda32 rel %.2e max %.3f | cpu margin %.3f%s\n",
                        i, rel, mx, rel2, mx2, rel3, mx3, margin, same ? "" : " (argmax differs)");
        }
        fprintf(stderr,
                "  teacher-forced, %d steps: worst cuda-vs-cpu rel %.2e, max %.3f; mean rel: cuda-vs-cpu %.2e, "
                "cuda-vs-cuda32 %.2e, cpu-vs-cuda32 %.2e; near ties %d, argmax flips elsewhere %d\n",
                n_gen + 1, worst_rel, worst_abs, sum_rel[0] / (n_gen + 1), sum_rel[1] / (n_gen + 1),
                sum_rel[2] / (n_gen + 1), ties, flips);
        CHECK(worst_rel < LOGIT_REL && worst_abs < LOGIT_ABS, "%s: logits differ: rel %.3g, max %.3g", name,
              worst_rel, worst_abs);
        CHECK(flips == 0, "%s: %d argmax flips at steps with a clear margin", name, flips);
    }
    free(cpu.logits), free(gpu.logits), free(gpu_tf.logits), free(f32_tf.logits);
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

    tkv_model_free(m);
    return test_done();
}
