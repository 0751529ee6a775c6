/*
 * test-attn-stats.c -- Description: the CPU backend's attn_stats op (the
 * policies' statistics as a backend op, backend.h) on fresh random inputs:
 *   1. bit for bit what the policies compute today (tkv_segment_block_probs
 *      + tkv_entropy, tkv_policy_window_scores + tkv_policy_pool), with 1
 *      and 3 threads, any probs stride, probs omitted;
 *   2. the documented definitions, against an independent double-precision
 *      evaluation: relative 1e-4 (the reference rounds each block score and
 *      each logit to f32 before the softmax: up to ~4e-6 relative on P for
 *      logits of ~50, and the window's f32 accumulation);
 *   3. the selections the policies make (snapkv's kept set, critiprefill's
 *      blocks) are exactly the top-k of the op's outputs;
 *   4. bad arguments are TKV_ERR_INVALID_ARG; empty cases give zeros.
 */
#include "cpu/cpu.h"
#include "runtime/policy/policy.h"
#include "test.h"

#include <stdlib.h>
#include <string.h>

static uint64_t rng;

/* ---- inputs ---------------------------------------------------------------------------------- */

/* Keys of Hkv heads for positions [0, n) in storage blocks of B tokens (the
 * last one partial), f16. */
struct fixture {
    uint32_t Hkv, hd, B, n, nb;
    uint16_t *k;                       /* [Hkv][nb*B][hd]  */
    struct tkv_kv_block_ref *refs;     /* [Hkv][nb]        */
    struct tkv_kv_head_view *views;    /* [Hkv]            */
};

/* Random keys in [-1, 1); every 8-token block j with j % 5 == 2 is scaled
 * by `hot` (peaked block distributions); head 0's first 8 keys are a sink
 * of size `sink` along sign(dir) (0: none). */
static void fixture_make(struct fixture *f, uint32_t Hkv, uint32_t hd, uint32_t B, uint32_t n, float hot, float sink,
                         const float *dir)
{
    f->Hkv = Hkv, f->hd = hd, f->B = B, f->n = n, f->nb = (n + B - 1) / B;
    const size_t per_head = (size_t)f->nb * B * hd;
    f->k = malloc(Hkv * per_head * sizeof *f->k);
    f->refs = calloc((size_t)Hkv * f->nb, sizeof *f->refs);
    f->views = calloc(Hkv, sizeof *f->views);
    for (uint32_t g = 0; g < Hkv; g++) {
        for (uint32_t p = 0; p < f->nb * B; p++)
            for (uint32_t c = 0; c < hd; c++) {
                float x = test_rand_f32(&rng, -1, 1);
                if ((p / 8) % 5 == 2)
                    x *= hot;
                if (g == 0 && sink != 0 && p < 8)
                    x = dir[c] >= 0 ? sink : -sink;
                f->k[g * per_head + (size_t)p * hd + c] = tkv_fp32_to_fp16(x);
            }
        for (uint32_t b = 0; b < f->nb; b++)
            f->refs[(size_t)g * f->nb + b] = (struct tkv_kv_block_ref){
                .k = f->k + g * per_head + (size_t)b * B * hd, .v = NULL, .pos0 = (int32_t)(b * B),
                .n = TKV_MIN(B, n - b * B)};
        f->views[g] = (struct tkv_kv_head_view){.blocks = f->refs + (size_t)g * f->nb, .n_blocks = f->nb};
    }
}

static void fixture_free(struct fixture *f) { free(f->k), free(f->refs), free(f->views); }

static float key_at(const struct fixture *f, uint32_t g, uint32_t p, uint32_t c)
{
    return tkv_fp16_to_fp32(f->k[(size_t)g * f->nb * f->B * f->hd + (size_t)p * f->hd + c]);
}

/* Queries [n_q][H*hd]: a per-(head, dim) bias in [-1, 1) plus noise of
 * size `noise` (the midrange is then about the bias). */
static float *queries(uint32_t n_q, uint32_t H, uint32_t hd, float noise, float *bias)
{
    float *q = malloc((size_t)n_q * H * hd * sizeof *q);
    for (uint32_t j = 0; j < H * hd; j++)
        bias[j] = test_rand_f32(&rng, -1, 1);
    for (uint32_t t = 0; t < n_q; t++)
        for (uint32_t j = 0; j < H * hd; j++)
            q[(size_t)t * H * hd + j] = bias[j] + test_rand_f32(&rng, -noise, noise);
    return q;
}

/* ---- independent references (double) ------------------------------------------------------------ */

static void ref_segment(const struct fixture *f, const float *q, uint32_t n_q, uint32_t H, uint32_t n_past,
                        uint32_t block, uint32_t g, double *P, double *Hent)
{
    const uint32_t hd = f->hd, G = H / f->Hkv, nb = (n_past - n_q) / block;
    double mx = -INFINITY;
    for (uint32_t j = 0; j < nb; j++) {
        double a = 0;
        for (uint32_t hh = 0; hh < G; hh++) {
            double s1 = 0, s2 = 0;
            for (uint32_t c = 0; c < hd; c++) {
                double qx = -INFINITY, qn = INFINITY, kx = -INFINITY, kn = INFINITY;
                for (uint32_t t = 0; t < n_q; t++) {
                    const double x = q[(size_t)t * H * hd + (size_t)(g * G + hh) * hd + c];
                    qx = x > qx ? x : qx, qn = x < qn ? x : qn;
                }
                for (uint32_t p = j * block; p < (j + 1) * block; p++) {
                    const double x = key_at(f, g, p, c);
                    kx = x > kx ? x : kx, kn = x < kn ? x : kn;
                }
                const double qm = 0.5 * (qx + qn);
                s1 += qm * kx, s2 += qm * kn;
            }
            a += s1 > s2 ? s1 : s2;
        }
        P[j] = a / G;
        mx = P[j] > mx ? P[j] : mx;
    }
    double sum = 0, h = 0;
    for (uint32_t j = 0; j < nb; j++)
        sum += (P[j] = exp(P[j] - mx));
    for (uint32_t j = 0; j < nb; j++) {
        P[j] /= sum;
        h -= P[j] * log(P[j] + 1e-9);
    }
    *Hent = h;
}

static void ref_window(const struct fixture *f, const float *q, const int32_t *q_pos, uint32_t n_q, uint32_t H,
                       uint32_t n_past, uint32_t n_prefix, uint32_t pool, char kind, uint32_t g, double *score)
{
    const uint32_t hd = f->hd, G = H / f->Hkv;
    double *row = malloc((size_t)n_past * sizeof *row), *raw = calloc(n_prefix + 1, sizeof *raw);
    for (uint32_t hh = 0; hh < G; hh++)
        for (uint32_t i = 0; i < n_q; i++) {
            const float *qr = q + (size_t)i * H * hd + (size_t)(g * G + hh) * hd;
            double mx = -INFINITY, sum = 0;
            for (uint32_t j = 0; j < n_past; j++) {
                double s = 0;
                for (uint32_t c = 0; c < hd; c++)
                    s += (double)qr[c] * key_at(f, g, j, c);
                row[j] = (int32_t)j <= q_pos[i] ? s / sqrt((double)hd) : -INFINITY;
                mx = row[j] > mx ? row[j] : mx;
            }
            for (uint32_t j = 0; j < n_past; j++)
                sum += row[j] == -INFINITY ? 0 : exp(row[j] - mx);
            for (uint32_t j = 0; j < n_prefix && j < n_past; j++)
                raw[j] += row[j] == -INFINITY ? 0 : exp(row[j] - mx) / sum / (G * n_q);
        }
    const int32_t half = (int32_t)(pool / 2);
    for (int32_t i = 0; i < (int32_t)n_prefix; i++) {
        if (pool <= 1) {
            score[i] = raw[i];
            continue;
        }
        double acc = kind == 'm' ? -INFINITY : 0;
        for (int32_t j = i - half; j <= i + half; j++) {
            const double v = j < 0 || j >= (int32_t)n_prefix ? 0 : raw[j];
            acc = kind == 'm' ? (v > acc ? v : acc) : acc + v;
        }
        score[i] = kind == 'm' ? acc : acc / pool;
    }
    free(row), free(raw);
}

/* max over i of |a - ref| / (|ref| + floor) */
static double rel_err(const float *a, const double *ref, uint32_t n, double floor)
{
    double e = 0;
    for (uint32_t i = 0; i < n; i++) {
        const double d = fabs(a[i] - ref[i]) / (fabs(ref[i]) + floor);
        e = d > e || isnan(d) ? (isnan(d) ? INFINITY : d) : e;
    }
    return e;
}

/* ---- 1 + 2: the op against the policies' functions and the definitions ---------------------------- */

static void segment_case(struct tkv_backend *be, uint32_t H, uint32_t Hkv, uint32_t hd, uint32_t B, uint32_t seg_start,
                         uint32_t n_q, uint32_t block, float hot, float sink)
{
    const uint32_t n_past = seg_start + n_q, nb = seg_start / block, stride = nb + 3;
    float *bias = malloc((size_t)H * hd * sizeof *bias);
    float *q = queries(n_q, H, hd, 0.3f, bias);
    struct fixture f;
    fixture_make(&f, Hkv, hd, B, n_past, hot, sink, bias);
    float *probs = malloc((size_t)Hkv * stride * sizeof *probs), *mine = malloc(((size_t)nb + 1) * sizeof *mine);
    double *ent = malloc(Hkv * sizeof *ent), *ent2 = malloc(Hkv * sizeof *ent2);
    double *P = malloc(((size_t)nb + 1) * sizeof *P);
    for (size_t i = 0; i < (size_t)Hkv * stride; i++)
        probs[i] = NAN;
    struct tkv_attn_stats_args a = {.kind = TKV_ATTN_STATS_SEGMENT, .q = q, .n_q = n_q, .n_head = H, .n_head_kv = Hkv,
                                    .head_dim = hd, .n_past = n_past, .kv = f.views, .block = block, .probs = probs,
                                    .probs_stride = stride, .entropy = ent};
    CHECK(be->ops->attn_stats(be, &a) == TKV_OK, "%s", tkv_last_error());
    a.probs = NULL;
    a.entropy = ent2;
    CHECK(be->ops->attn_stats(be, &a) == TKV_OK, "%s", tkv_last_error());
    const struct tkv_policy_env env = {.n_head = H, .n_head_kv = Hkv, .head_dim = hd};
    const struct tkv_policy_view v = {.n_past = n_past, .q = q, .n_q = n_q, .kv = f.views};
    double worst_p = 0, worst_h = 0, h_min = INFINITY, h_max = 0;
    for (uint32_t g = 0; g < Hkv; g++) {
        const uint32_t n = tkv_segment_block_probs(&v, &env, g, block, mine);
        const double h = tkv_entropy(mine, n);
        CHECK(n == nb && memcmp(mine, probs + (size_t)g * stride, nb * sizeof *mine) == 0,
              "segment H=%u Hkv=%u hd=%u head %u: P differs from tkv_segment_block_probs", H, Hkv, hd, g);
        CHECK(memcmp(&h, &ent[g], sizeof h) == 0 && memcmp(&h, &ent2[g], sizeof h) == 0,
              "segment head %u: entropy %.17g / %.17g, policies %.17g", g, ent[g], ent2[g], h);
        CHECK(isnan(probs[(size_t)g * stride + nb]), "segment head %u: wrote past its %u blocks", g, nb);
        double hr;
        ref_segment(&f, q, n_q, H, n_past, block, g, P, &hr);
        /* the entropy relative to H + 1e-3 nats: P is f32, and a probability
         * near 1 is off by up to 2^-24 from the exact one; its term -p ln p
         * ~ 1 - p moves by as much, so an entropy of ~1e-9 (one key taking
         * everything) is only known to ~6e-8 nats absolute */
        const double ep = rel_err(probs + (size_t)g * stride, P, nb, 1e-30), eh = fabs(ent[g] - hr) / (hr + 1e-3);
        worst_p = ep > worst_p ? ep : worst_p;
        worst_h = eh > worst_h ? eh : worst_h;
        h_min = ent[g] < h_min ? ent[g] : h_min;
        h_max = ent[g] > h_max ? ent[g] : h_max;
    }
    fprintf(stderr, "  segment H=%-2u Hkv=%u hd=%-3u B=%-3u block=%-2u start=%-4u n_q=%-3u  H in [%.2e, %.2f]  "
                    "vs double: P %.1e H %.1e\n",
            H, Hkv, hd, B, block, seg_start, n_q, h_min, h_max, worst_p, worst_h);
    CHECK(worst_p <= 1e-4 && worst_h <= 1e-4, "segment vs the double definition: P %.3g, H %.3g", worst_p, worst_h);
    free(bias), free(q), free(probs), free(mine), free(ent), free(ent2), free(P);
    fixture_free(&f);
}

static void window_case(struct tkv_backend *be, uint32_t H, uint32_t Hkv, uint32_t hd, uint32_t B, uint32_t n_past,
                        uint32_t extra, uint32_t W, uint32_t n_prefix, uint32_t pool, char kind)
{
    float *bias = malloc((size_t)H * hd * sizeof *bias);
    float *q = queries(W, H, hd, 1.0f, bias);
    int32_t *pos = malloc(W * sizeof *pos);
    for (uint32_t t = 0; t < W; t++) /* the last W positions of the context */
        pos[t] = (int32_t)(n_past - W + t);
    struct fixture f; /* `extra` keys past n_past in the view (a decode step's own) */
    fixture_make(&f, Hkv, hd, B, n_past + extra, 3.0f, 0, NULL);
    float *scores = malloc((size_t)Hkv * n_prefix * sizeof *scores), *mine = malloc(n_prefix * sizeof *mine);
    float *tmp = malloc(n_prefix * sizeof *tmp);
    double *ref = malloc(n_prefix * sizeof *ref);
    struct tkv_attn_stats_args a = {.kind = TKV_ATTN_STATS_WINDOW, .q = q, .q_pos = pos, .n_q = W, .n_head = H,
                                    .n_head_kv = Hkv, .head_dim = hd, .n_past = n_past, .kv = f.views,
                                    .n_prefix = n_prefix, .pool = pool, .pool_kind = kind, .scores = scores};
    CHECK(be->ops->attn_stats(be, &a) == TKV_OK, "%s", tkv_last_error());
    const struct tkv_policy_env env = {.n_head = H, .n_head_kv = Hkv, .head_dim = hd};
    const struct tkv_policy_view v = {.n_past = n_past, .q = q, .q_pos = pos, .n_q = W, .kv = f.views};
    double worst = 0;
    for (uint32_t g = 0; g < Hkv; g++) {
        CHECK(tkv_policy_window_scores(&v, &env, g, n_prefix, mine) == TKV_OK, "%s", tkv_last_error());
        if (pool > 1)
            tkv_policy_pool(mine, tmp, n_prefix, pool, kind);
        CHECK(memcmp(mine, scores + (size_t)g * n_prefix, n_prefix * sizeof *mine) == 0,
              "window H=%u Hkv=%u hd=%u n=%u head %u: scores differ from tkv_policy_window_scores", H, Hkv, hd, n_past,
              g);
        ref_window(&f, q, pos, W, H, n_past, n_prefix, pool, kind, g, ref);
        const double e = rel_err(scores + (size_t)g * n_prefix, ref, n_prefix, 1e-30);
        worst = e > worst ? e : worst;
    }
    fprintf(stderr, "  window  H=%-2u Hkv=%u hd=%-3u B=%-3u n_past=%-5u(+%u) W=%-2u n_prefix=%-5u pool %c%u  "
                    "vs double %.1e\n",
            H, Hkv, hd, B, n_past, extra, W, n_prefix, pool > 1 ? kind : '-', pool, worst);
    CHECK(worst <= 1e-4, "window vs the double definition: %.3g", worst);
    free(bias), free(q), free(pos), free(scores), free(mine), free(tmp), free(ref);
    fixture_free(&f);
}

static void test_equal(struct tkv_backend *be)
{
    /* EntropyInfer (block 8), CritiPrefill (block 32); storage blocks that
     * are not multiples of the key block, a partial last storage block */
    segment_case(be, 9, 3, 64, 64, 1024, 512, 8, 3.0f, 6.0f);
    segment_case(be, 8, 2, 128, 20, 600, 300, 8, 1.0f, 0);
    segment_case(be, 4, 4, 64, 32, 1536, 512, 32, 4.0f, 8.0f);
    segment_case(be, 8, 1, 64, 12, 333, 77, 8, 2.0f, 0);
    /* SnapKV (max 7), EntropyInfer's decode compression (avg 5, keys past n_past in the view) */
    window_case(be, 9, 3, 64, 64, 1500, 0, 32, 1468, 7, 'm');
    window_case(be, 8, 2, 128, 32, 777, 1, 32, 745, 5, 'a');
    window_case(be, 4, 4, 64, 20, 300, 0, 32, 268, 0, 'm');
    window_case(be, 16, 2, 64, 64, 2000, 0, 16, 1984, 7, 'm');
}

/* ---- 3: the policies' selections from the op's outputs ------------------------------------------- */

static bool same_ranges(const struct tkv_range *a, int na, const struct tkv_range *b, int nb)
{
    if (na != nb)
        return false;
    for (int i = 0; i < na; i++)
        if (a[i].begin != b[i].begin || a[i].end != b[i].end)
            return false;
    return true;
}

static void test_selections(struct tkv_backend *be)
{
    enum { H = 6, HKV = 2, HD = 64, N = 1200, W = 32, BUDGET = 160 };
    /* snapkv: after the prefill, its kept set is the top (budget - window)
     * pooled scores of the last W queries + the window */
    float *bias = malloc((size_t)H * HD * sizeof *bias);
    float *q = queries(W, H, HD, 1.0f, bias);
    int32_t pos[W];
    for (uint32_t t = 0; t < W; t++)
        pos[t] = (int32_t)(N - W + t);
    struct fixture f;
    fixture_make(&f, HKV, HD, 64, N, 3.0f, 0, NULL);
    const struct tkv_policy_env env = {.n_layer = 2, .n_head = H, .n_head_kv = HKV, .head_dim = HD, .n_ctx = 4096,
                                       .block_tokens = 64, .budget = BUDGET};
    struct tkv_policy *p = NULL;
    REQUIRE_VOID(tkv_policy_create("snapkv", &env, &p) == TKV_OK);
    struct tkv_policy_view v = {.layer = 1, .n_past = N, .n_prompt = N, .q = q, .q_pos = pos, .n_q = W, .kv = f.views};
    CHECK(p->ops->after_prefill(p->state, &v) == TKV_OK, "%s", tkv_last_error());
    const uint32_t n_prefix = N - W;
    float *scores = malloc((size_t)HKV * n_prefix * sizeof *scores);
    uint32_t *idx = malloc(n_prefix * sizeof *idx);
    struct tkv_range *r1 = malloc((n_prefix + 2) * sizeof *r1), *r2 = malloc((n_prefix + 2) * sizeof *r2);
    struct tkv_attn_stats_args a = {.kind = TKV_ATTN_STATS_WINDOW, .q = q, .q_pos = pos, .n_q = W, .n_head = H,
                                    .n_head_kv = HKV, .head_dim = HD, .n_past = N, .kv = f.views,
                                    .n_prefix = n_prefix, .pool = 7, .pool_kind = 'm', .scores = scores};
    CHECK(be->ops->attn_stats(be, &a) == TKV_OK, "%s", tkv_last_error());
    for (uint32_t g = 0; g < HKV; g++) {
        const uint32_t k = tkv_policy_top_k(scores + (size_t)g * n_prefix, n_prefix, BUDGET - W, idx);
        const int m1 = tkv_policy_ranges(idx, k, n_prefix, N, r1, n_prefix + 2);
        const int m2 = p->ops->decode_select(p->state, &v, g, r2, n_prefix + 2);
        CHECK(same_ranges(r1, m1, r2, m2), "snapkv head %u: kept set differs from the op's top-k", g);
    }
    tkv_policy_free(p);
    free(q), free(scores), free(idx);
    fixture_free(&f);

    /* critiprefill (no fusion): a sparse segment attends the top budget/block blocks of P */
    enum { SEG = 512, START = 1024, BLOCK = 32, CBUDGET = 128 };
    q = queries(SEG, H, HD, 0.3f, bias);
    int32_t spos[SEG];
    for (uint32_t t = 0; t < SEG; t++)
        spos[t] = (int32_t)(START + t);
    fixture_make(&f, HKV, HD, 64, START + SEG, 4.0f, 0, NULL);
    REQUIRE_VOID(tkv_policy_create("critiprefill:threshold=512,budget=128,fusion=0", &env, &p) == TKV_OK);
    v = (struct tkv_policy_view){.layer = 1, .n_past = START + SEG, .prefill_end = 4096, .q = q, .q_pos = spos,
                                 .n_q = SEG, .kv = f.views};
    const uint32_t nb = START / BLOCK;
    float *probs = malloc((size_t)HKV * nb * sizeof *probs);
    a = (struct tkv_attn_stats_args){.kind = TKV_ATTN_STATS_SEGMENT, .q = q, .n_q = SEG, .n_head = H,
                                     .n_head_kv = HKV, .head_dim = HD, .n_past = START + SEG, .kv = f.views,
                                     .block = BLOCK, .probs = probs, .probs_stride = nb};
    CHECK(be->ops->attn_stats(be, &a) == TKV_OK, "%s", tkv_last_error());
    uint32_t bidx[START / BLOCK];
    for (uint32_t g = 0; g < HKV; g++) {
        const uint32_t k = tkv_policy_top_k(probs + (size_t)g * nb, nb, CBUDGET / BLOCK, bidx);
        const int m1 = (int)tkv_policy_block_ranges(bidx, k, BLOCK, r1, n_prefix);
        const int m2 = p->ops->prefill_select(p->state, &v, g, r2, n_prefix);
        CHECK(same_ranges(r1, m1, r2, m2), "critiprefill head %u: blocks differ from the op's top-k", g);
    }
    tkv_policy_free(p);
    free(bias), free(q), free(probs), free(r1), free(r2);
    fixture_free(&f);
}

/* ---- 4: arguments, empty cases ----------------------------------------------------------------------- */

static void test_args(struct tkv_backend *be)
{
    struct fixture f;
    fixture_make(&f, 2, 64, 32, 100, 1.0f, 0, NULL);
    float q[4 * 64] = {0}, out[2 * 100];
    double ent[2] = {7, 7};
    int32_t pos[1] = {99};
    const struct tkv_attn_stats_args ok = {.kind = TKV_ATTN_STATS_WINDOW, .q = q, .q_pos = pos, .n_q = 1,
                                           .n_head = 4, .n_head_kv = 2, .head_dim = 64, .n_past = 100, .kv = f.views,
                                           .n_prefix = 100, .pool = 7, .pool_kind = 'm', .scores = out};
    CHECK(be->ops->attn_stats(be, &ok) == TKV_OK, "%s", tkv_last_error());
    struct tkv_attn_stats_args a = ok;
    a.kv = NULL;
    CHECK(be->ops->attn_stats(be, &a) == TKV_ERR_INVALID_ARG, "NULL kv accepted");
    a = ok, a.kind = 0;
    CHECK(be->ops->attn_stats(be, &a) == TKV_ERR_INVALID_ARG, "kind 0 accepted");
    a = ok, a.n_head = 5;
    CHECK(be->ops->attn_stats(be, &a) == TKV_ERR_INVALID_ARG, "5 heads over 2 KV heads accepted");
    a = ok, a.pool = 6;
    CHECK(be->ops->attn_stats(be, &a) == TKV_ERR_INVALID_ARG && strstr(tkv_last_error(), "kernel 6"),
          "even pooling kernel: %s", tkv_last_error());
    a = ok, a.pool_kind = 'x';
    CHECK(be->ops->attn_stats(be, &a) == TKV_ERR_INVALID_ARG, "pool kind x accepted");
    a = ok, a.scores = NULL;
    CHECK(be->ops->attn_stats(be, &a) == TKV_ERR_INVALID_ARG, "NULL scores accepted");
    a = ok, a.q_pos = NULL;
    CHECK(be->ops->attn_stats(be, &a) == TKV_ERR_INVALID_ARG, "NULL q_pos accepted");
    a = ok, a.head_dim = 2000;
    CHECK(be->ops->attn_stats(be, &a) == TKV_ERR_INVALID_ARG, "head_dim 2000 accepted");
    /* no query: every score is 0 */
    a = ok, a.n_q = 0;
    for (int i = 0; i < 200; i++)
        out[i] = NAN;
    CHECK(be->ops->attn_stats(be, &a) == TKV_OK, "%s", tkv_last_error());
    bool zero = true;
    for (int i = 0; i < 200; i++)
        zero &= out[i] == 0;
    CHECK(zero, "window without queries: scores are not all 0");

    const struct tkv_attn_stats_args seg = {.kind = TKV_ATTN_STATS_SEGMENT, .q = q, .n_q = 1, .n_head = 4,
                                            .n_head_kv = 2, .head_dim = 64, .n_past = 50, .kv = f.views, .block = 8,
                                            .probs = out, .probs_stride = 6, .entropy = ent};
    CHECK(be->ops->attn_stats(be, &seg) == TKV_OK, "%s", tkv_last_error());
    a = seg, a.probs_stride = 5;
    CHECK(be->ops->attn_stats(be, &a) == TKV_ERR_INVALID_ARG && strstr(tkv_last_error(), "probs_stride"),
          "probs_stride below the block count: %s", tkv_last_error());
    a = seg, a.block = 0;
    CHECK(be->ops->attn_stats(be, &a) == TKV_ERR_INVALID_ARG, "block 0 accepted");
    a = seg, a.n_q = 60;
    CHECK(be->ops->attn_stats(be, &a) == TKV_ERR_INVALID_ARG, "segment longer than n_past accepted");
    /* no block before the segment: H = 0, as the policies' tkv_entropy of nothing */
    a = seg, a.n_past = 5;
    ent[0] = ent[1] = 7;
    CHECK(be->ops->attn_stats(be, &a) == TKV_OK && ent[0] == 0 && ent[1] == 0, "segment without blocks: H %g %g",
          ent[0], ent[1]);
    fixture_free(&f);
}

int main(void)
{
    rng = test_seed();
    const uint32_t threads[] = {1, 3};
    for (size_t i = 0; i < 2; i++) {
        struct tkv_backend *be = NULL;
        REQUIRE(tkv_cpu_backend_create(threads[i], &be) == TKV_OK, "%s", tkv_last_error());
        REQUIRE(be->ops->attn_stats != NULL, "the CPU backend has no attn_stats");
        fprintf(stderr, "cpu backend, %u thread%s:\n", threads[i], threads[i] > 1 ? "s" : "");
        test_equal(be);
        if (i == 1) {
            test_selections(be);
            test_args(be);
        }
        be->ops->free(be);
    }
    return test_done();
}
