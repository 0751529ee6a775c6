/*
 * test-cpu-backend.c -- the CPU backend's fast paths against slow references
 * on fresh random inputs: attention (prefill tiles, split-K decode, GQA,
 * partial and selected blocks, log-sum-exp), matmul (quantized-dot and sgemm
 * paths), RoPE, RMSNorm, SwiGLU, rabitq_select (threaded, against the host
 * reference), and the thread pool.
 */
#include "cpu/cpu.h"
#include "cpu/quant.h"
#include "runtime/rabitq/rabitq.h"
#include "test.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

static uint64_t rng;

/* ---- attention ---------------------------------------------------------- */

struct kv_fixture {
    uint32_t n_head_kv, head_dim, B, n_tokens;
    uint16_t *storage;                 /* [Hkv][blocks][K|V][B][hd] */
    struct tkv_kv_block_ref *refs;     /* [Hkv][blocks] */
    struct tkv_kv_head_view *views;    /* [Hkv] */
};

static void kv_make(struct kv_fixture *f, uint32_t Hkv, uint32_t hd, uint32_t B, uint32_t n_tokens, bool sparse)
{
    uint32_t nb = (n_tokens + B - 1) / B;
    f->n_head_kv = Hkv, f->head_dim = hd, f->B = B, f->n_tokens = n_tokens;
    f->storage = malloc((size_t)Hkv * nb * 2 * B * hd * sizeof(uint16_t));
    f->refs = calloc((size_t)Hkv * nb, sizeof *f->refs);
    f->views = calloc(Hkv, sizeof *f->views);
    for (size_t i = 0; i < (size_t)Hkv * nb * 2 * B * hd; i++)
        f->storage[i] = tkv_fp32_to_fp16(test_rand_f32(&rng, -2, 2));
    for (uint32_t h = 0; h < Hkv; h++) {
        uint32_t kept = 0;
        for (uint32_t b = 0; b < nb; b++) {
            /* sparse: drop some middle blocks, as a selecting policy would */
            if (sparse && b > 0 && b + 1 < nb && (test_rand_u64(&rng) & 1))
                continue;
            uint16_t *k = f->storage + (((size_t)h * nb + b) * 2) * B * hd;
            f->refs[(size_t)h * nb + kept++] = (struct tkv_kv_block_ref){
                .k = k, .v = k + (size_t)B * hd, .pos0 = (int32_t)(b * B), .n = TKV_MIN(B, n_tokens - b * B)};
        }
        f->views[h] = (struct tkv_kv_head_view){.blocks = f->refs + (size_t)h * nb, .n_blocks = kept};
    }
}

static void kv_free(struct kv_fixture *f)
{
    free(f->storage);
    free(f->refs);
    free(f->views);
}

/* The fast path against the reference on random queries over a fixture
 * whose KV heads g with bit g of busy_mask set have blocks (the others
 * none: the heterogeneous split hands the CPU a few heads of a layer, and
 * their keys are split over the threads): outputs and the busy rows' lse
 * within 2e-4, the empty heads' rows 0 with lse -inf on both. */
static void attention_case(struct tkv_cpu_backend *cb, uint32_t H, uint32_t Hkv, uint32_t hd, uint32_t B,
                           uint32_t n_ctx, uint32_t n_q, bool sparse, uint32_t busy_mask)
{
    struct kv_fixture f;
    kv_make(&f, Hkv, hd, B, n_ctx, sparse);
    for (uint32_t h = 0; h < Hkv; h++)
        if (!(busy_mask >> h & 1))
            f.views[h].n_blocks = 0;
    size_t qn = (size_t)n_q * H * hd;
    float *q = malloc(qn * sizeof *q), *o1 = malloc(qn * sizeof *o1), *o2 = malloc(qn * sizeof *o2);
    float *l1 = malloc((size_t)n_q * H * sizeof *l1), *l2 = malloc((size_t)n_q * H * sizeof *l2);
    int32_t *pos = malloc(n_q * sizeof *pos);
    for (size_t i = 0; i < qn; i++)
        q[i] = test_rand_f32(&rng, -1, 1);
    for (uint32_t t = 0; t < n_q; t++) /* the last n_q positions, as in a prefill chunk */
        pos[t] = (int32_t)(n_ctx - n_q + t);
    struct tkv_attn_args a = {.q = q, .q_pos = pos, .out = o1, .lse = l1, .n_q = n_q, .n_head = H, .n_head_kv = Hkv,
                              .head_dim = hd, .scale = 1.0f / sqrtf((float)hd), .kv = f.views};
    CHECK(tkv_cpu_attention(cb, &a) == TKV_OK, "%s", tkv_last_error());
    a.out = o2;
    a.lse = l2;
    CHECK(tkv_cpu_attention_ref(&a) == TKV_OK, "%s", tkv_last_error());
    double max_err = 0, max_lse = 0;
    int bad_empty = 0;
    for (size_t r = 0; r < (size_t)n_q * H; r++) { /* rows [n_q][H] */
        const bool busy = busy_mask >> (r % H / (H / Hkv)) & 1;
        if (busy)
            max_lse = fmax(max_lse, fabs(l1[r] - l2[r]));
        else
            bad_empty += l1[r] != -INFINITY || l2[r] != -INFINITY;
        for (uint32_t d = 0; d < hd; d++) {
            max_err = fmax(max_err, fabs(o1[r * hd + d] - o2[r * hd + d]));
            bad_empty += !busy && o1[r * hd + d] != 0.0f;
        }
    }
    CHECK(max_err < 2e-4 && max_lse < 2e-4 && bad_empty == 0,
          "attention H=%u Hkv=%u hd=%u B=%u ctx=%u n_q=%u sparse=%d KV heads busy 0x%x: max |out| err %.3g, "
          "|lse| err %.3g, %d bad empty values",
          H, Hkv, hd, B, n_ctx, n_q, sparse, busy_mask, max_err, max_lse, bad_empty);
    free(q), free(o1), free(o2), free(l1), free(l2), free(pos);
    kv_free(&f);
}

static void test_attention_case(struct tkv_cpu_backend *cb, uint32_t H, uint32_t Hkv, uint32_t hd, uint32_t B,
                                uint32_t n_ctx, uint32_t n_q, bool sparse)
{
    attention_case(cb, H, Hkv, hd, B, n_ctx, n_q, sparse, UINT32_MAX);
}

/* A decode step of 32/8 heads, d = 128, where only the KV heads in
 * busy_mask have blocks. */
static void test_attention_few_heads(struct tkv_cpu_backend *cb, uint32_t busy_mask)
{
    attention_case(cb, 32, 8, 128, 64, 3000, 1, true, busy_mask);
}

/* Splitting the keys in two and merging by log-sum-exp equals one pass. */
static void test_attention_merge(struct tkv_cpu_backend *cb)
{
    const uint32_t H = 4, Hkv = 2, hd = 32, B = 16, n = 200;
    struct kv_fixture f;
    kv_make(&f, Hkv, hd, B, n, false);
    float q[H * hd], full[H * hd], pa[H * hd], pb[H * hd], la[H], lb[H], lf[H];
    int32_t pos = n - 1;
    for (uint32_t i = 0; i < H * hd; i++)
        q[i] = test_rand_f32(&rng, -1, 1);
    struct tkv_attn_args a = {.q = q, .q_pos = &pos, .out = full, .lse = lf, .n_q = 1, .n_head = H, .n_head_kv = Hkv,
                              .head_dim = hd, .scale = 0.2f, .kv = f.views};
    CHECK(tkv_cpu_attention(cb, &a) == TKV_OK, "%s", tkv_last_error());
    struct tkv_kv_head_view first[2], second[2];
    for (uint32_t h = 0; h < Hkv; h++) {
        first[h] = (struct tkv_kv_head_view){f.views[h].blocks, 5};
        second[h] = (struct tkv_kv_head_view){f.views[h].blocks + 5, f.views[h].n_blocks - 5};
    }
    a.kv = first, a.out = pa, a.lse = la;
    CHECK(tkv_cpu_attention(cb, &a) == TKV_OK, "%s", tkv_last_error());
    a.kv = second, a.out = pb, a.lse = lb;
    CHECK(tkv_cpu_attention(cb, &a) == TKV_OK, "%s", tkv_last_error());
    double err = 0;
    for (uint32_t h = 0; h < H; h++) {
        float m = fmaxf(la[h], lb[h]), wa = expf(la[h] - m), wb = expf(lb[h] - m);
        for (uint32_t d = 0; d < hd; d++) {
            float merged = (pa[h * hd + d] * wa + pb[h * hd + d] * wb) / (wa + wb);
            err = fmax(err, fabs(merged - full[h * hd + d]));
        }
        err = fmax(err, fabs(m + logf(wa + wb) - lf[h]));
    }
    CHECK(err < 1e-5, "merged partial attention differs from one pass by %.3g", err);
    kv_free(&f);
}

/* ---- matmul -------------------------------------------------------------- */

struct fake_tensor {
    struct tkv_gguf_tensor t;
    void *data;
};

static void make_weight(struct fake_tensor *ft, uint32_t type, uint32_t n_in, uint32_t n_out)
{
    const struct tkv_type_traits *tr = tkv_type_traits(type);
    size_t row = (size_t)n_in / tr->block_elems * tr->block_bytes;
    ft->data = malloc(row * n_out);
    float *x = malloc(n_in * sizeof *x);
    for (uint32_t r = 0; r < n_out; r++) {
        for (uint32_t i = 0; i < n_in; i++)
            x[i] = test_rand_f32(&rng, -1, 1);
        tkv_quantize_row(type, x, (uint8_t *)ft->data + row * r, n_in);
    }
    free(x);
    memset(&ft->t, 0, sizeof ft->t);
    snprintf(ft->t.name, sizeof ft->t.name, "w_%s", tr->name);
    ft->t.n_dims = 2;
    ft->t.ne[0] = n_in, ft->t.ne[1] = n_out, ft->t.ne[2] = ft->t.ne[3] = 1;
    ft->t.type = type;
    ft->t.data = ft->data;
    ft->t.nbytes = row * n_out;
}

static void test_matmul(struct tkv_backend *be, uint32_t type, uint32_t n_in, uint32_t n_out, uint32_t n_tok)
{
    struct fake_tensor ft;
    make_weight(&ft, type, n_in, n_out);
    struct tkv_bweight *w;
    REQUIRE_VOID(be->ops->weight_init(be, &ft.t, &w) == TKV_OK);
    float *x = malloc((size_t)n_tok * n_in * sizeof *x), *y = malloc((size_t)n_tok * n_out * sizeof *y);
    float *wrow = malloc(n_in * sizeof *wrow);
    for (size_t i = 0; i < (size_t)n_tok * n_in; i++)
        x[i] = test_rand_f32(&rng, -1, 1);
    CHECK(be->ops->matmul(be, w, x, y, n_tok) == TKV_OK, "%s", tkv_last_error());
    const struct tkv_type_traits *tr = tkv_type_traits(type);
    size_t row = (size_t)n_in / tr->block_elems * tr->block_bytes;
    double worst = 0;
    for (uint32_t r = 0; r < n_out; r++) {
        tkv_dequant_row_ref(type, (uint8_t *)ft.data + row * r, wrow, n_in);
        for (uint32_t t = 0; t < n_tok; t++) {
            double ref = 0, mag = 0;
            for (uint32_t i = 0; i < n_in; i++) {
                ref += (double)wrow[i] * x[(size_t)t * n_in + i];
                mag += fabs((double)wrow[i] * x[(size_t)t * n_in + i]);
            }
            /* the decode path quantizes activations to 8 bits: error <~ 1% of sum|w x| */
            double tol = (n_tok < 8 && type != TKV_TYPE_F32 && type != TKV_TYPE_F16 && type != TKV_TYPE_BF16) ? 1e-2 : 1e-5;
            worst = fmax(worst, fabs(y[(size_t)t * n_out + r] - ref) / (mag * tol + 1e-6));
        }
    }
    CHECK(worst <= 1.0, "matmul %s %ux%u n=%u: error %.3g x tolerance", tr->name, n_in, n_out, n_tok, worst);
    be->ops->weight_free(be, w);
    free(x), free(y), free(wrow), free(ft.data);
}

/* ---- element-wise ops --------------------------------------------------------- */

static void test_rope_rmsnorm_swiglu(struct tkv_backend *be)
{
    const uint32_t n = 3, heads = 2, hd = 16, rot = 12;
    float x[3 * 2 * 16], orig[3 * 2 * 16];
    int32_t pos[3] = {0, 7, 1000};
    for (uint32_t i = 0; i < n * heads * hd; i++)
        orig[i] = x[i] = test_rand_f32(&rng, -1, 1);
    CHECK(be->ops->rope(be, x, n, heads, hd, rot, pos, 10000.0f, 0.5f) == TKV_OK, "%s", tkv_last_error());
    double err = 0;
    for (uint32_t t = 0; t < n; t++)
        for (uint32_t h = 0; h < heads; h++)
            for (uint32_t i = 0; i < hd / 2; i++) {
                const float *a = orig + (t * heads + h) * hd, *b = x + (t * heads + h) * hd;
                if (2 * i >= rot) { /* beyond the rotated dims: untouched */
                    err = fmax(err, fabs(a[2 * i] - b[2 * i]) + fabs(a[2 * i + 1] - b[2 * i + 1]));
                    continue;
                }
                double th = pos[t] * 0.5 * pow(10000.0, -2.0 * i / rot);
                double r0 = a[2 * i] * cos(th) - a[2 * i + 1] * sin(th), r1 = a[2 * i] * sin(th) + a[2 * i + 1] * cos(th);
                err = fmax(err, fabs(r0 - b[2 * i]) + fabs(r1 - b[2 * i + 1]));
            }
    CHECK(err < 2e-3, "rope differs from the formula by %.3g", err); /* float angle accumulation at pos 1000 */

    float g[16], y[2 * 16], in[2 * 16];
    for (uint32_t i = 0; i < 16; i++)
        g[i] = test_rand_f32(&rng, 0.5f, 1.5f);
    for (uint32_t i = 0; i < 32; i++)
        in[i] = test_rand_f32(&rng, -3, 3);
    struct tkv_gguf_tensor gt = {.name = "norm", .n_dims = 1, .ne = {16, 1, 1, 1}, .type = TKV_TYPE_F32, .data = g};
    struct tkv_bweight *gw;
    REQUIRE_VOID(be->ops->weight_init(be, &gt, &gw) == TKV_OK);
    CHECK(be->ops->rmsnorm(be, in, gw, y, 2, 16, 1e-5f) == TKV_OK, "%s", tkv_last_error());
    err = 0;
    for (uint32_t t = 0; t < 2; t++) {
        double ss = 0;
        for (uint32_t i = 0; i < 16; i++)
            ss += in[t * 16 + i] * in[t * 16 + i];
        for (uint32_t i = 0; i < 16; i++)
            err = fmax(err, fabs(in[t * 16 + i] / sqrt(ss / 16 + 1e-5) * g[i] - y[t * 16 + i]));
    }
    CHECK(err < 1e-5, "rmsnorm differs from the formula by %.3g", err);
    be->ops->weight_free(be, gw);

    enum { N = 10000 };
    float *ga = malloc(N * sizeof(float)), *ua = malloc(N * sizeof(float)), *oa = malloc(N * sizeof(float));
    for (int i = 0; i < N; i++)
        ga[i] = test_rand_f32(&rng, -8, 8), ua[i] = test_rand_f32(&rng, -2, 2);
    CHECK(be->ops->swiglu(be, ga, ua, oa, N) == TKV_OK, "swiglu");
    err = 0;
    for (int i = 0; i < N; i++)
        err = fmax(err, fabs(ga[i] / (1 + exp(-ga[i])) * ua[i] - oa[i]));
    CHECK(err < 1e-5, "swiglu differs from the formula by %.3g", err);
    free(ga), free(ua), free(oa);
}

/* ---- thread pool ------------------------------------------------------------ */

static void count_worker(void *ctx, uint32_t ith, uint32_t nth)
{
    uint64_t *sums = ctx, b, e;
    tkv_split(1000003, ith, nth, &b, &e);
    for (uint64_t i = b; i < e; i++)
        sums[ith] += i;
}

/* A job of the oversubscribed pool: each share counts its runs and which
 * thread ran it. */
struct share_log {
    _Atomic uint32_t runs[32]; /* (room for shares past the 16 there are) */
    _Atomic uint32_t wrong_nth; /* shares told another count than 16 */
    pthread_t who[32];
};

static void log_worker(void *ctx, uint32_t ith, uint32_t nth)
{
    struct share_log *l = ctx;
    if (ith < 32) {
        atomic_fetch_add(&l->runs[ith], 1);
        l->who[ith] = pthread_self();
    }
    if (nth != 16)
        atomic_fetch_add(&l->wrong_nth, 1);
    volatile uint64_t x = 0;
    for (uint32_t i = 0; i < 200 * (ith % 4 + 1); i++) /* uneven shares */
        x += i;
}

static void test_pool(void)
{
    struct tkv_pool *p;
    REQUIRE_VOID(tkv_pool_init(3, &p) == TKV_OK);
    for (int rep = 0; rep < 2000; rep++) { /* many tiny jobs, as decode issues */
        uint64_t sums[3] = {0, 0, 0};
        tkv_pool_run(p, count_worker, sums);
        if (sums[0] + sums[1] + sums[2] != 1000003ull * 1000002ull / 2) {
            CHECK(false, "pool job %d summed wrong", rep);
            break;
        }
    }
    tkv_pool_free(p);
    /* more threads than cores (CI has 2): every share of every job runs
     * exactly once, some thread or other -- the caller takes the shares of
     * workers not running -- and the job returns only when all are done */
    REQUIRE_VOID(tkv_pool_init(16, &p) == TKV_OK);
    uint32_t bad = 0, by_caller = 0;
    for (int rep = 0; rep < 3000 && !bad; rep++) {
        struct share_log l = {.wrong_nth = 0};
        tkv_pool_run(p, log_worker, &l);
        for (uint32_t k = 0; k < 32; k++) {
            bad += atomic_load(&l.runs[k]) != (k < 16);
            by_caller += k && k < 16 && pthread_equal(l.who[k], pthread_self());
        }
        bad += atomic_load(&l.wrong_nth);
    }
    CHECK(bad == 0, "oversubscribed pool: %u shares run other than once", bad);
    fprintf(stderr, "pool of 16 threads: 3000 jobs, each share once; %u shares other than 0 run by the caller\n",
            by_caller);
    tkv_pool_free(p);
    CHECK(tkv_pool_init(0, &p) == TKV_ERR_INVALID_ARG, "0 threads must be refused");
}

/* ---- rabitq_select ------------------------------------------------------- */

/* Bad arguments of a selection are refused by the CPU op and by the host
 * reference alike, with TKV_ERR_INVALID_ARG and a message that names the
 * bad value -- not taken for a non-finite estimate, which selects the whole
 * head and succeeds. heads[0] has two forced ranges and host queries. */
static void test_rabitq_select_refusals(struct tkv_backend *be, const struct tkv_rabitq_select_head *heads, uint32_t nh,
                                        uint32_t G, uint32_t words, uint32_t *bitmap)
{
    enum { CASES = 11 };
    /* what the message must name */
    static const char *const expect[CASES] = {"p 0 ",          "p 1.5",         "p nan",  "scale 0 ",
                                              "scale inf",     "extra_lse nan", "extra_lse inf", "range 0 [9, 3)",
                                              "range 1 [4, 8)", "range 1 [0, 4)", "query 1: 9 words"};
    struct tkv_rabitq_select_head h[8];
    struct tkv_rabitq_query q0[8];
    REQUIRE_VOID(nh <= 8 && G <= 8 && heads[0].n_forced == 2 && heads[0].q);
    for (int c = 0; c < CASES; c++) {
        memcpy(h, heads, nh * sizeof *h);
        memcpy(q0, heads[0].q, G * sizeof *q0);
        h[0].q = q0;
        struct tkv_rabitq_select_args a = {.heads = h, .n_heads = nh, .G = G, .p = 0.9f, .scale = 0.125f,
                                           .extra_lse = -INFINITY, .bitmap = bitmap, .words = words};
        switch (c) {
        case 0: a.p = 0.0f; break;
        case 1: a.p = 1.5f; break;
        case 2: a.p = NAN; break;
        case 3: a.scale = 0.0f; break;
        case 4: a.scale = INFINITY; break;
        case 5: a.extra_lse = NAN; break;
        case 6: a.extra_lse = INFINITY; break;
        case 7: h[0].forced[0] = (struct tkv_rabitq_select_range){9, 3}; break;          /* begin > end */
        case 8: h[0].forced[0] = (struct tkv_rabitq_select_range){2, 6}, /* overlapping */
                h[0].forced[1] = (struct tkv_rabitq_select_range){4, 8}; break;
        case 9: h[0].forced[1] = (struct tkv_rabitq_select_range){0, 4}; break;          /* not ascending */
        default: q0[1].words = 9; break;                                                  /* another width */
        }
        for (int r = 0; r < 2; r++) {
            const tkv_status st = r ? tkv_rabitq_host_select(&a) : be->ops->rabitq_select(be, &a);
            const char *err = tkv_last_error();
            CHECK(st == TKV_ERR_INVALID_ARG && strstr(err, r ? "rabitq: host_select" : "cpu: rabitq_select") &&
                      strstr(err, expect[c]),
                  "%s: '%s' must be refused, naming it: %s (%s)", r ? "host_select" : "cpu op", expect[c],
                  tkv_status_str(st), err);
        }
    }
}

/* The backend's op (a (head, query head) pair per task on its threads)
 * against tkv_rabitq_host_select on the same heads: the same bitmaps, counts
 * and masses, bit for bit, for plain and safe, exact and coarse top-p, with
 * and without whole groups, on 1 to 3 threads; heads of different lengths
 * (each its own index), sinks and a recent window forced, one head whose
 * keys are mostly copies of one (ties). A bad call is refused by name. */
static void test_rabitq_select(void)
{
    enum { NH = 5, G = 4, D = 64 };
    static const uint32_t lens[NH] = {700, 3001, 64, 1800, 2500};
    struct tkv_backend *be;
    REQUIRE_VOID(tkv_backend_create("cpu", 1, &be) == TKV_OK);
    struct tkv_rabitq *ix[NH];
    struct tkv_rabitq_dev_index *dx[NH];
    struct tkv_rabitq_query q[NH][G];
    struct tkv_rabitq_select_head heads[NH];
    uint32_t words = 0;
    for (uint32_t h = 0; h < NH; h++) {
        const uint32_t n = lens[h];
        words = TKV_MAX(words, (n + 31) / 32);
        uint16_t *k = malloc((size_t)n * D * sizeof *k);
        REQUIRE_VOID(k);
        float one[D], c[D], qv[D];
        for (uint32_t i = 0; i < D; i++)
            one[i] = test_rand_f32(&rng, -2.0f, 2.0f);
        for (uint32_t r = 0; r < n; r++)
            for (uint32_t i = 0; i < D; i++) /* head 3: nine keys in ten the same */
                k[(size_t)r * D + i] = tkv_fp32_to_fp16(h == 3 && r % 10 ? one[i] : test_rand_f32(&rng, -2.0f, 2.0f));
        struct tkv_rabitq_mean mk;
        REQUIRE_VOID(tkv_rabitq_init(D, 0x5e1ull + h, &ix[h]) == TKV_OK && tkv_rabitq_mean_init(&mk, D) == TKV_OK);
        tkv_rabitq_mean_add_f16(&mk, k, D, n);
        tkv_rabitq_mean_get(&mk, c);
        REQUIRE_VOID(tkv_rabitq_set_centroids(ix[h], c, NULL) == TKV_OK && tkv_rabitq_reserve(ix[h], n) == TKV_OK &&
                     tkv_rabitq_append_f16(ix[h], k, D, n) == TKV_OK);
        REQUIRE_VOID(tkv_rabitq_dev_create(be, ix[h], n, &dx[h]) == TKV_OK && tkv_rabitq_dev_append(dx[h], k, D, n) == TKV_OK);
        free(k);
        for (uint32_t j = 0; j < G; j++) {
            for (uint32_t i = 0; i < D; i++)
                qv[i] = (1 + j) * test_rand_f32(&rng, -2.0f, 2.0f);
            REQUIRE_VOID(tkv_rabitq_query_prepare(ix[h], qv, 3.0f, &q[h][j]) == TKV_OK);
        }
        heads[h] = (struct tkv_rabitq_select_head){.ix = tkv_rabitq_dev_arrays(dx[h]), .q = q[h], .n = n};
        if (n > 16) /* sinks, and the last 16 keys */
            heads[h].forced[heads[h].n_forced++] = (struct tkv_rabitq_select_range){0, 4},
            heads[h].forced[heads[h].n_forced++] = (struct tkv_rabitq_select_range){n - 16, n};
    }
    uint32_t *want = malloc((size_t)NH * words * 4), *got = malloc((size_t)NH * words * 4);
    uint32_t wn[NH * G], gn[NH * G];
    double wm[NH * G], gm[NH * G];
    REQUIRE_VOID(want && got);
    uint32_t cases = 0, kept = 0;
    for (uint32_t threads = 1; threads <= 3; threads++) {
        struct tkv_backend *bt;
        REQUIRE_VOID(tkv_backend_create("cpu", threads, &bt) == TKV_OK);
        for (int v = 0; v < 8; v++) {
            const bool safe = v & 1, coarse = v & 2;
            const uint32_t whole = v & 4 ? 16 : 0;
            struct tkv_rabitq_select_args a = {.heads = heads, .n_heads = NH, .G = G, .p = 0.9f,
                                               .scale = 1.0f / sqrtf((float)D), .extra_lse = -INFINITY,
                                               .safe = safe, .coarse = coarse, .whole = whole, .bitmap = want,
                                               .words = words, .n_chosen = wn, .mass = wm};
            memset(want, 0xa5, (size_t)NH * words * 4);
            REQUIRE_VOID(tkv_rabitq_host_select(&a) == TKV_OK);
            a.bitmap = got, a.n_chosen = gn, a.mass = gm;
            memset(got, 0x5a, (size_t)NH * words * 4);
            tkv_status st = bt->ops->rabitq_select(bt, &a);
            CHECK(st == TKV_OK, "rabitq_select (%u threads): %s", threads, tkv_last_error());
            CHECK(!memcmp(want, got, (size_t)NH * words * 4) && !memcmp(wn, gn, sizeof wn) && !memcmp(wm, gm, sizeof wm),
                  "rabitq_select on %u threads (safe %d, coarse %d, whole %u) differs from the host reference",
                  threads, safe, coarse, whole);
            for (size_t w = 0; w < (size_t)NH * words; w++)
                kept += (uint32_t)__builtin_popcount(got[w]);
            cases++;
        }
        struct tkv_rabitq_select_args bad = {.heads = heads, .n_heads = NH, .G = 0, .bitmap = got, .words = words};
        CHECK(bt->ops->rabitq_select(bt, &bad) == TKV_ERR_INVALID_ARG && strstr(tkv_last_error(), "cpu: rabitq_select"),
              "G = 0 must be refused by name: %s", tkv_last_error());
        bt->ops->free(bt);
    }
    fprintf(stderr, "rabitq_select: %u cases on 1-3 threads equal the host reference (%u keys kept in all)\n", cases,
            kept);
    test_rabitq_select_refusals(be, heads, NH, G, words, got);
    for (uint32_t h = 0; h < NH; h++) {
        tkv_rabitq_dev_free(dx[h]);
        tkv_rabitq_free(ix[h]);
    }
    free(want), free(got);
    be->ops->free(be);
}

int main(void)
{
    rng = test_seed();
    test_pool();
    test_rabitq_select();
    struct tkv_backend *be;
    REQUIRE(tkv_backend_create("cpu", 2, &be) == TKV_OK, "%s", tkv_last_error());
    struct tkv_cpu_backend *cb = (struct tkv_cpu_backend *)be;

    /* prefill-like (many queries) and decode-like (one query: split-K);
     * items of <= 8 rows on the fused kernels where this CPU has them, and
     * every case again on the sgemm path */
    const bool fused_ok = tkv_cpu_attn_fused_ok();
    CHECK(cb->attn_fused == fused_ok, "fused kernels %s by default on a CPU %s them", cb->attn_fused ? "on" : "off",
          fused_ok ? "with" : "without");
    for (int fused = fused_ok; fused >= 0; fused--) {
        cb->attn_fused = fused;
        test_attention_case(cb, 9, 3, 64, 64, 300, 300, false);  /* SmolLM2 shape, whole prompt */
        test_attention_case(cb, 9, 3, 64, 64, 700, 128, false);  /* a later prefill chunk */
        test_attention_case(cb, 9, 3, 64, 64, 1000, 1, false);   /* decode: 3 rows */
        test_attention_case(cb, 8, 2, 128, 32, 513, 3, false);   /* GQA 4, hd 128: 12 rows */
        test_attention_case(cb, 4, 4, 16, 8, 77, 77, false);     /* MHA, small blocks */
        test_attention_case(cb, 6, 2, 64, 16, 400, 1, true);     /* policy-selected blocks */
        test_attention_case(cb, 6, 2, 64, 16, 400, 40, true);
        test_attention_case(cb, 32, 8, 128, 64, 3000, 1, false); /* Llama-3-8B decode: 4 rows */
        test_attention_case(cb, 32, 8, 128, 64, 3000, 1, true);
        test_attention_case(cb, 16, 2, 128, 64, 777, 1, false);  /* 8 rows */
        test_attention_case(cb, 8, 2, 128, 16, 500, 2, false);   /* 2 tokens x 4: the mask inside a tile */
        test_attention_case(cb, 8, 8, 64, 7, 301, 1, false);     /* 1 row, blocks of 7 (odd keys) */
        test_attention_case(cb, 6, 2, 40, 9, 333, 1, true);      /* hd 40: a pass of 8 dims after 16s */
        test_attention_case(cb, 12, 2, 40, 5, 90, 1, false);     /* 6 rows, hd 40 */
        test_attention_case(cb, 4, 1, 16, 64, 10, 2, false);     /* 8 rows, a single partial block */
        test_attention_case(cb, 4, 4, 64, 16, 200, 2, false);    /* 2 rows (MHA, 2 tokens) */
        test_attention_case(cb, 10, 2, 64, 64, 300, 1, true);    /* 5 rows */
        test_attention_case(cb, 14, 2, 128, 32, 250, 1, false);  /* 7 rows */
        test_attention_case(cb, 12, 2, 64, 7, 200, 1, false);    /* 6 rows, blocks of 7 (a lone last key) */
        test_attention_few_heads(cb, 0x04);                      /* one KV head of 8 has blocks */
        test_attention_few_heads(cb, 0x24);                      /* two */
        test_attention_few_heads(cb, 0x00);                      /* none */
        test_attention_case(cb, 9, 3, 64, 5, 203, 1, true);      /* 3 rows, blocks of 5 */
        test_attention_case(cb, 2, 1, 256, 16, 100, 1, false);   /* 2 rows, hd 256 */
        test_attention_merge(cb);
    }
    cb->attn_fused = fused_ok;

    static const uint32_t types[] = {TKV_TYPE_F32, TKV_TYPE_F16, TKV_TYPE_BF16, TKV_TYPE_Q8_0, TKV_TYPE_Q4_0,
                                     TKV_TYPE_Q4_1};
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        test_matmul(be, types[i], 256, 67, 1);  /* decode: quantized dots */
        test_matmul(be, types[i], 256, 67, 3);
        test_matmul(be, types[i], 576, 130, 40); /* prefill: sgemm on dequantized tiles */
    }
    test_rope_rmsnorm_swiglu(be);
    be->ops->free(be);
    return test_done();
}
