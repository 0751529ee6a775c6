/*
 * test-forward.c -- the engine's forward pass against a naive reference on a
 * tiny random Llama model written by our own GGUF writer.
 *
 * The reference below is written from the math (double accumulation, angles
 * from the formula, one score at a time); it shares with the engine only the
 * scalar dequantization reference and the f16 rounding of stored K/V (the KV
 * cache is f16 by design). Checked: prefill in several chunks with partial KV
 * blocks, then decode steps, for F32/F16 weights (tight tolerance) and
 * Q8_0/Q4_1 weights (8-bit activation quantization on the decode path).
 */
#include "tierkv.h"
#include "tiny-model.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- the reference forward pass -------------------------------------------------- */

static void matvec(const float *w, const double *x, int n_in, int n_out, double *y)
{
    for (int r = 0; r < n_out; r++) {
        double s = 0;
        for (int i = 0; i < n_in; i++)
            s += (double)w[(size_t)r * n_in + i] * x[i];
        y[r] = s;
    }
}

static void rmsnorm(const double *x, const float *g, double *y)
{
    double ss = 0;
    for (int i = 0; i < E; i++)
        ss += x[i] * x[i];
    double s = 1.0 / sqrt(ss / E + EPS);
    for (int i = 0; i < E; i++)
        y[i] = x[i] * s * g[i];
}

static void rope(double *v, int pos)
{
    for (int i = 0; i < ROT / 2; i++) {
        double th = pos * pow(ROPE_BASE, -2.0 * i / ROT), a = v[2 * i], b = v[2 * i + 1];
        v[2 * i] = a * cos(th) - b * sin(th);
        v[2 * i + 1] = a * sin(th) + b * cos(th);
    }
}

static double f16_round(double x) { return tkv_fp16_to_fp32(tkv_fp32_to_fp16((float)x)); }

/* Logits after the last of n tokens. */
static void ref_forward(const struct ref_model *rm, const tkv_token *toks, int n, double *logits)
{
    static double x[CTX][E], K[L][CTX][HKV * HD], Vv[L][CTX][HKV * HD];
    double h[E], q[H * HD], att[H * HD], tmp[F], g[F], u[F];
    for (int t = 0; t < n; t++) {
        for (int i = 0; i < E; i++)
            x[t][i] = rm->embd[(size_t)toks[t] * E + i];
        for (int l = 0; l < L; l++) {
            rmsnorm(x[t], rm->attn_norm[l], h);
            matvec(rm->wq[l], h, E, H * HD, q);
            matvec(rm->wk[l], h, E, HKV * HD, K[l][t]);
            matvec(rm->wv[l], h, E, HKV * HD, Vv[l][t]);
            for (int hh = 0; hh < H; hh++)
                rope(q + hh * HD, t);
            for (int hh = 0; hh < HKV; hh++)
                rope(K[l][t] + hh * HD, t);
            for (int i = 0; i < HKV * HD; i++) /* the KV cache stores f16 */
                K[l][t][i] = f16_round(K[l][t][i]), Vv[l][t][i] = f16_round(Vv[l][t][i]);
            for (int hh = 0; hh < H; hh++) {
                int kv = hh / (H / HKV);
                double sc[CTX], mx = -1e300, sum = 0;
                for (int j = 0; j <= t; j++) {
                    double s = 0;
                    for (int d = 0; d < HD; d++)
                        s += q[hh * HD + d] * K[l][j][kv * HD + d];
                    sc[j] = s / sqrt((double)HD);
                    mx = fmax(mx, sc[j]);
                }
                for (int j = 0; j <= t; j++)
                    sum += (sc[j] = exp(sc[j] - mx));
                for (int d = 0; d < HD; d++) {
                    double o = 0;
                    for (int j = 0; j <= t; j++)
                        o += sc[j] * Vv[l][j][kv * HD + d];
                    att[hh * HD + d] = o / sum;
                }
            }
            matvec(rm->wo[l], att, H * HD, E, tmp);
            for (int i = 0; i < E; i++)
                x[t][i] += tmp[i];
            rmsnorm(x[t], rm->ffn_norm[l], h);
            matvec(rm->wg[l], h, E, F, g);
            matvec(rm->wu[l], h, E, F, u);
            for (int i = 0; i < F; i++)
                g[i] = g[i] / (1 + exp(-g[i])) * u[i];
            matvec(rm->wd[l], g, F, E, tmp);
            for (int i = 0; i < E; i++)
                x[t][i] += tmp[i];
        }
    }
    rmsnorm(x[n - 1], rm->out_norm, h);
    matvec(rm->output, h, E, V, logits);
}

/* Largest logit difference, relative to the largest reference logit. */
static double max_diff(const float *a, const double *b)
{
    double m = 0, scale = 1e-6;
    for (int i = 0; i < V; i++) {
        m = fmax(m, fabs(a[i] - b[i]));
        scale = fmax(scale, fabs(b[i]));
    }
    return m / scale;
}

static void run_case(uint32_t wtype, double tol_prefill, double tol_decode)
{
    char path[] = "/tmp/tkv-test-forward-XXXXXX";
    int fd = mkstemp(path);
    REQUIRE_VOID(fd >= 0);
    close(fd);
    struct ref_model rm;
    write_model(path, wtype, &rm);
    tkv_model *m;
    tkv_status st = tkv_model_load(path, &m);
    unlink(path);
    REQUIRE_VOID(st == TKV_OK || (fprintf(stderr, "%s\n", tkv_last_error()), 0));

    struct tkv_session_params sp = tkv_session_default_params();
    sp.n_threads = 2;
    sp.kv_block = 8;       /* several blocks, the last one partial */
    sp.prefill_chunk = 16; /* the prompt spans several chunks */
    tkv_session *s;
    st = tkv_session_init(m, &sp, &s);
    REQUIRE_VOID(st == TKV_OK || (fprintf(stderr, "%s\n", tkv_last_error()), 0));

    tkv_token toks[CTX];
    const int n_prompt = 37, n_decode = 6;
    for (int i = 0; i < n_prompt + n_decode; i++)
        toks[i] = (tkv_token)(test_rand_u64(&rng) % V);
    double ref[V];
    CHECK(tkv_prefill(s, toks, n_prompt) == TKV_OK, "prefill: %s", tkv_last_error());
    ref_forward(&rm, toks, n_prompt, ref);
    double d = max_diff(tkv_logits(s), ref);
    CHECK(d < tol_prefill, "%s prefill logits differ from the reference by %.3g (tolerance %.3g)",
          tkv_type_name(wtype), d, tol_prefill);
    for (int i = 0; i < n_decode; i++) {
        CHECK(tkv_decode(s, toks[n_prompt + i]) == TKV_OK, "decode: %s", tkv_last_error());
        ref_forward(&rm, toks, n_prompt + i + 1, ref);
        d = max_diff(tkv_logits(s), ref);
        CHECK(d < tol_decode, "%s decode step %d logits differ from the reference by %.3g (tolerance %.3g)",
              tkv_type_name(wtype), i, d, tol_decode);
    }
    CHECK(tkv_session_n_past(s) == (size_t)(n_prompt + n_decode), "n_past %zu", tkv_session_n_past(s));

    /* the context limit: nothing is appended when a prefill does not fit */
    tkv_token many[CTX];
    memset(many, 0, sizeof many);
    CHECK(tkv_prefill(s, many, CTX) == TKV_ERR_CONTEXT_FULL, "overlong prefill must be refused");
    CHECK(tkv_session_n_past(s) == (size_t)(n_prompt + n_decode), "a refused prefill changed n_past");
    tkv_token bad = V + 5;
    CHECK(tkv_decode(s, bad) == TKV_ERR_INVALID_ARG, "out-of-vocabulary token must be refused");

    /* reset, then the same prompt again gives the same logits */
    tkv_session_reset(s);
    CHECK(tkv_prefill(s, toks, n_prompt) == TKV_OK, "prefill after reset: %s", tkv_last_error());
    ref_forward(&rm, toks, n_prompt, ref);
    d = max_diff(tkv_logits(s), ref);
    CHECK(d < tol_prefill, "after reset: logits differ by %.3g", d);

    tkv_session_free(s);
    tkv_model_free(m);
    ref_free(&rm);
}

int main(void)
{
    rng = test_seed();
    /* tolerances are relative to the largest logit. F32/F16 weights: f32
     * activations everywhere; only float rounding */
    run_case(TKV_TYPE_F32, 1e-4, 1e-4);
    run_case(TKV_TYPE_F16, 1e-4, 1e-4);
    /* quantized weights: chunks of >= 8 tokens dequantize exactly, shorter
     * ones (the prompt's 5-token tail, decode) quantize the activations to
     * 8 bits as llama.cpp does: ~1-3% of the largest logit on this random 2-layer model; layout bugs give O(1) */
    run_case(TKV_TYPE_Q8_0, 0.05, 0.05);
    run_case(TKV_TYPE_Q4_1, 0.05, 0.05);
    return test_done();
}
