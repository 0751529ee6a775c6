/*
 * Description: the RaBitQ key index (runtime/rabitq): rotation orthonormal
 * and deterministic per seed; the estimator unbiased over random rotations
 * (D = 64, 128); the popcount X equal to the float <2b-1, u'> up to the
 * 4-bit query error; the error bound covering >= 99% of keys at eps0 = 3 on
 * random data and on real SmolLM2 keys (K rows read from the session's KV
 * store after a prefill, queries from its observation window); every SIMD
 * variant bit-identical to the scalar reference (codes, scalars, estimates,
 * bounds); safe top-p keeping >= p of the exact softmax mass in >= 99% of
 * trials, plain top-p's kept mass reported, both the smallest set for their
 * rule; every SIMD variant of top-p's kernels selecting the scalar
 * reference's sets (up to a rounding tie) with its masses to 1e-6, its own
 * sets reaching p; bad input refused with a status. The batched encode of the device
 * twin (dev_append_spans: many spans in one rabitq_encode call) on the CPU
 * backend equals per-span appends and the host index byte for byte, and
 * names the first non-finite key of a call (tests/rabitq-spans.h). The
 * rabitq_prepare op's host reference (tkv_rabitq_host_prepare) writes
 * tkv_rabitq_query_prepare's bytes for every query of a layer, poisons and
 * reports the refused ones, and rabitq_select's reference selects alike
 * from them and from host-prepared queries (tests/rabitq-prepare.h). The
 * key centroid's f16 sums are exact (the long double reference) and its
 * mean independent of the rows' order (tests/rabitq-key-sums.h).
 */
#include "test.h"

#include "runtime/rabitq/rabitq.h"
#include "runtime/session.h"
#include "runtime/tkv-impl.h"

#include "rabitq-key-sums.h"
#include "rabitq-prepare.h"
#include "rabitq-spans.h"

#include <stdlib.h>
#include <string.h>

static uint64_t rng;

static float gauss(uint64_t *s)
{
    float u1 = test_rand_f32(s, 1e-7f, 1.0f), u2 = test_rand_f32(s, 0.0f, 1.0f);
    return sqrtf(-2.0f * logf(u1)) * cosf(6.2831853f * u2);
}

/* keys ~ offset + gain .* N(0, 1), rounded to f16; gain > 1 on a few "outlier" channels */
static void make_keys(uint16_t *k, uint32_t n, uint32_t D, const float *offset, const float *gain)
{
    for (uint32_t r = 0; r < n; r++)
        for (uint32_t i = 0; i < D; i++)
            k[(size_t)r * D + i] = tkv_fp32_to_fp16(offset[i] + gain[i] * gauss(&rng));
}

static double dot_f16(const float *q, const uint16_t *k, uint32_t D)
{
    double s = 0;
    for (uint32_t i = 0; i < D; i++)
        s += (double)q[i] * tkv_fp16_to_fp32(k[i]);
    return s;
}

static double norm_res(const uint16_t *k, const float *c, uint32_t D)
{
    double s = 0;
    for (uint32_t i = 0; i < D; i++) {
        const double d = (double)tkv_fp16_to_fp32(k[i]) - c[i];
        s += d * d;
    }
    return sqrt(s);
}

static struct tkv_rabitq *make_index(uint32_t D, uint64_t seed, const uint16_t *keys, uint32_t n, const float *ck,
                                     const float *cq, enum tkv_rabitq_isa isa)
{
    struct tkv_rabitq *ix = NULL;
    if (tkv_rabitq_init(D, seed, &ix) != TKV_OK || tkv_rabitq_set_isa(ix, isa) != TKV_OK ||
        tkv_rabitq_set_centroids(ix, ck, cq) != TKV_OK || tkv_rabitq_reserve(ix, n) != TKV_OK ||
        tkv_rabitq_append_f16(ix, keys, D, n) != TKV_OK) {
        fprintf(stderr, "make_index: %s\n", tkv_last_error());
        tkv_rabitq_free(ix);
        return NULL;
    }
    return ix;
}

static void mean_keys(const uint16_t *keys, uint32_t n, uint32_t D, float *out)
{
    struct tkv_rabitq_mean m;
    tkv_rabitq_mean_init(&m, D);
    tkv_rabitq_mean_add_f16(&m, keys, D, n);
    tkv_rabitq_mean_get(&m, out);
}

// --- (5) rotation ---------------------------------------------------------------

static void test_rotation(void)
{
    const uint32_t dims[] = {64, 96, 128, 256, 512};
    for (size_t di = 0; di < sizeof dims / sizeof *dims; di++) {
        const uint32_t D = dims[di];
        const uint64_t seed = test_rand_u64(&rng);
        struct tkv_rabitq *a, *b, *c;
        REQUIRE_VOID(tkv_rabitq_init(D, seed, &a) == TKV_OK && tkv_rabitq_init(D, seed, &b) == TKV_OK &&
                     tkv_rabitq_init(D, seed ^ 1, &c) == TKV_OK);
        struct tkv_rabitq_arrays ar;
        tkv_rabitq_get_arrays(a, &ar);
        double worst_norm = 0, worst_ip = 0;
        int same = 1, differs = 0;
        float x[512], x2[512], y[512], y2[512], yb[512], yc[512];
        for (int t = 0; t < 200; t++) {
            for (uint32_t i = 0; i < D; i++) {
                x[i] = gauss(&rng) * (t % 2 ? 10.0f : 0.01f);
                x2[i] = gauss(&rng);
            }
            tkv_rabitq_rotate(a, x, y);
            tkv_rabitq_rotate(a, x2, y2);
            tkv_rabitq_rotate(b, x, yb);
            tkv_rabitq_rotate(c, x, yc);
            double nx = 0, ny = 0, nx2 = 0, ixx = 0, iyy = 0;
            for (uint32_t i = 0; i < D; i++) {
                nx += (double)x[i] * x[i];
                nx2 += (double)x2[i] * x2[i];
                ixx += (double)x[i] * x2[i];
            }
            for (uint32_t i = 0; i < ar.dim_pad; i++) {
                ny += (double)y[i] * y[i];
                iyy += (double)y[i] * y2[i];
            }
            worst_norm = fmax(worst_norm, fabs(sqrt(ny) - sqrt(nx)) / sqrt(nx));
            worst_ip = fmax(worst_ip, fabs(iyy - ixx) / sqrt(nx * nx2));
            same &= !memcmp(y, yb, ar.dim_pad * sizeof *y);
            differs |= memcmp(y, yc, ar.dim_pad * sizeof *y) != 0;
        }
        fprintf(stderr, "rotation D=%u (padded %u), seed %llu: max relative norm change %.2e, max inner-product change %.2e\n",
                D, ar.dim_pad, (unsigned long long)seed, worst_norm, worst_ip);
        CHECK(worst_norm < 1e-5, "D=%u: rotation changes a norm by %.3g (relative)", D, worst_norm);
        CHECK(worst_ip < 1e-5, "D=%u: rotation changes an inner product by %.3g", D, worst_ip);
        CHECK(same, "D=%u: same seed, different rotation", D);
        CHECK(differs, "D=%u: seeds %llu and %llu give the same rotation", D, (unsigned long long)seed,
              (unsigned long long)(seed ^ 1));
        tkv_rabitq_free(a);
        tkv_rabitq_free(b);
        tkv_rabitq_free(c);
    }
    CHECK(tkv_rabitq_seed(7, 1, 2) == tkv_rabitq_seed(7, 1, 2) && tkv_rabitq_seed(7, 1, 2) != tkv_rabitq_seed(7, 2, 1) &&
              tkv_rabitq_seed(7, 1, 2) != tkv_rabitq_seed(8, 1, 2),
          "tkv_rabitq_seed must be a function of (base, layer, head)");
}

// --- (1) unbiasedness, and the popcount X vs the float inner product ----------------

static void test_unbiased(uint32_t D, uint32_t n_seeds)
{
    enum { NK = 64, NQ = 4 };
    uint16_t *keys = malloc((size_t)NK * D * sizeof *keys);
    float off[512], gain[512], ck[512], cq[512], q[NQ][512];
    for (uint32_t i = 0; i < D; i++) {
        off[i] = gauss(&rng);
        gain[i] = i % 16 == 3 ? 4.0f : 1.0f;
        cq[i] = 0.5f * gauss(&rng);
    }
    make_keys(keys, NK, D, off, gain);
    mean_keys(keys, NK, D, ck);
    for (int j = 0; j < NQ; j++) /* queries: a key direction plus noise, off-centre */
        for (uint32_t i = 0; i < D; i++)
            q[j][i] = cq[i] + 0.7f * (tkv_fp16_to_fp32(keys[(size_t)j * D + i]) - ck[i]) + gauss(&rng);
    double exact[NQ][NK], scale[NQ][NK];
    double sum[NQ][NK] = {{0}}, sum2[NQ][NK] = {{0}}, ms = 0, ms2 = 0, zz = 0, xerr2 = 0, xn2 = 0, xq2 = 0;
    uint64_t nx = 0;
    float est[NK];
    for (uint32_t s = 0; s < n_seeds; s++) {
        struct tkv_rabitq *ix = make_index(D, 1000003ull * s + 17, keys, NK, ck, cq, TKV_RABITQ_ISA_SCALAR);
        REQUIRE_VOID(ix);
        struct tkv_rabitq_arrays ar;
        tkv_rabitq_get_arrays(ix, &ar);
        double m = 0;
        for (int j = 0; j < NQ; j++) {
            struct tkv_rabitq_query qq;
            REQUIRE_VOID(tkv_rabitq_query_prepare(ix, q[j], 0, &qq) == TKV_OK);
            REQUIRE_VOID(tkv_rabitq_estimate(ix, &qq, 0, NK, est, NULL) == TKV_OK);
            if (s == 0)
                for (int k = 0; k < NK; k++) {
                    exact[j][k] = dot_f16(q[j], keys + (size_t)k * D, D);
                    scale[j][k] = qq.norm * norm_res(keys + (size_t)k * D, ck, D);
                }
            for (int k = 0; k < NK; k++) {
                const double z = (est[k] - exact[j][k]) / scale[j][k];
                sum[j][k] += z;
                sum2[j][k] += z * z;
                m += z;
                zz += z * z;
            }
            /* popcount X vs the float <2b-1, u'> (spec 3.9 test 1), first seeds only */
            if (s < 20) {
                float u[512], uq[512];
                for (uint32_t i = 0; i < D; i++)
                    uq[i] = q[j][i] - cq[i];
                tkv_rabitq_rotate(ix, uq, u);
                for (int k = 0; k < NK; k++) {
                    double xf = 0;
                    uint32_t ip = 0;
                    for (uint32_t i = 0; i < ar.dim_pad; i++) {
                        const int b = (ar.code[(size_t)k * ar.words + i / 64] >> (i % 64)) & 1;
                        xf += b ? u[i] : -u[i];
                        int qb = 0;
                        for (int p = 0; p < 4; p++)
                            qb |= (int)((qq.plane[p][i / 64] >> (i % 64)) & 1) << p;
                        ip += b ? (uint32_t)qb : 0;
                    }
                    const double xi = (double)qq.delta * (2.0 * ip - qq.sum_q) + (double)qq.vl * (2.0 * ar.pc[k] - ar.dim_pad);
                    /* in units of <o_bar, u'/|u'|> = X / (sqrt(D) |u'|) */
                    xerr2 += (xi - xf) * (xi - xf);
                    xn2 += (double)qq.norm * qq.norm * ar.dim_pad;
                    xq2 += (double)qq.delta * qq.delta / 12 / ((double)qq.norm * qq.norm);
                    nx++;
                    /* and est = a X + t + add, recomputed here in double */
                    const double e2 = (double)ar.a[k] * xi + ar.t[k] + qq.add;
                    CHECK(fabs(e2 - est[k]) <= 1e-4 * (fabs(e2) + scale[j][k]), "D=%u key %d: est %g vs a*X+t+add %g", D,
                          k, (double)est[k], e2);
                }
            }
        }
        m /= NQ * NK;
        ms += m;
        ms2 += m * m;
        tkv_rabitq_free(ix);
    }
    const double N = n_seeds, mean = ms / N, se = sqrt(fmax(ms2 / N - mean * mean, 0) / (N - 1));
    double tmax = 0;
    for (int j = 0; j < NQ; j++)
        for (int k = 0; k < NK; k++) {
            const double mu = sum[j][k] / N, sd = sqrt(fmax(sum2[j][k] / N - mu * mu, 1e-30) * N / (N - 1));
            tmax = fmax(tmax, fabs(mu) / (sd / sqrt(N)));
        }
    const double rms = sqrt(zz / (N * NQ * NK)), theory = 0.75 / sqrt(D - 1.0);
    fprintf(stderr,
            "unbiased D=%u: %u rotations x %d keys x %d queries: mean unit error %+.2e, its standard error %.2e (%.1f SE); "
            "max |t| over the %d (query, key) pairs %.2f; unit error rms %.4f (theory ~%.4f); 4-bit query error on "
            "<o_bar,u'/|u'|>: rms %.4f (uniform rounding model %.4f)\n",
            D, n_seeds, NK, NQ, mean, se, fabs(mean) / se, NQ * NK, tmax, rms, theory, sqrt(xerr2 / xn2), sqrt(xq2 / nx));
    CHECK(fabs(mean) < 4 * se, "D=%u: mean error %.3g is %.1f standard errors from 0", D, mean, fabs(mean) / se);
    CHECK(tmax < 5.5, "D=%u: a (query, key) pair's mean error is %.1f standard errors from 0", D, tmax);
    CHECK(rms > 0.7 * theory && rms < 1.3 * theory, "D=%u: unit error rms %.4f, theory %.4f", D, rms, theory);
    CHECK(sqrt(xerr2 / xn2) < 1.5 * sqrt(xq2 / nx), "D=%u: popcount X differs from <2b-1,u'> by %.4f rms, rounding model %.4f", D,
          sqrt(xerr2 / xn2), sqrt(xq2 / nx));
    free(keys);
}

// --- (2) coverage of the bound on random data ------------------------------------------

struct cover {
    uint64_t n, in[3];    /* eps0 = 1.9, 2.5, 3.0 */
    double alpha_sum, alpha_min, alpha_max;
    uint64_t n_alpha;
};
static const float cover_eps[3] = {1.9f, 2.5f, 3.0f};

static void cover_init(struct cover *c)
{
    memset(c, 0, sizeof *c);
    c->alpha_min = 1;
}

/* Coverage of every (query, key) pair of an index; slack covers float rounding only. */
static void cover_add(struct cover *c, struct tkv_rabitq *ix, const uint16_t *keys, uint32_t D, const float *q, uint32_t nq,
                      size_t q_stride)
{
    const uint32_t n = tkv_rabitq_size(ix);
    float *est = malloc(n * sizeof *est), *bnd = malloc(n * sizeof *bnd);
    for (uint32_t j = 0; j < nq; j++) {
        for (int e = 0; e < 3; e++) {
            struct tkv_rabitq_query qq;
            REQUIRE_VOID(tkv_rabitq_query_prepare(ix, q + j * q_stride, cover_eps[e], &qq) == TKV_OK);
            REQUIRE_VOID(tkv_rabitq_estimate(ix, &qq, 0, n, est, bnd) == TKV_OK);
            for (uint32_t k = 0; k < n; k++) {
                const double ex = dot_f16(q + j * q_stride, keys + (size_t)k * D, D);
                c->in[e] += fabs(est[k] - ex) <= bnd[k] + 1e-5 * (fabs(ex) + 1);
            }
        }
        c->n += n;
    }
    struct tkv_rabitq_arrays ar;
    tkv_rabitq_get_arrays(ix, &ar);
    for (uint32_t k = 0; k < n; k++)
        if (ar.a[k] > 0) { /* e/a = sqrt(D) sqrt(1 - alpha^2) */
            const double r = ar.e[k] / ar.a[k], al = sqrt(fmax(0, 1 - r * r / ar.dim_pad));
            c->alpha_sum += al;
            c->alpha_min = fmin(c->alpha_min, al);
            c->alpha_max = fmax(c->alpha_max, al);
            c->n_alpha++;
        }
    free(est);
    free(bnd);
}

static void cover_report(const struct cover *c, const char *what)
{
    fprintf(stderr, "coverage %s: %llu pairs, eps0 1.9 / 2.5 / 3.0: %.4f / %.4f / %.4f; alpha mean %.3f [%.3f, %.3f]\n", what,
            (unsigned long long)c->n, (double)c->in[0] / c->n, (double)c->in[1] / c->n, (double)c->in[2] / c->n,
            c->alpha_sum / c->n_alpha, c->alpha_min, c->alpha_max);
    CHECK((double)c->in[2] / c->n >= 0.99, "%s: the eps0 = 3 bound covers only %.4f of the keys", what,
          (double)c->in[2] / c->n);
}

static void test_coverage_random(uint32_t D)
{
    const uint32_t N = 4096, NQ = 16;
    uint16_t *keys = malloc((size_t)N * D * sizeof *keys);
    float off[512], gain[512], ck[512], cq[512], *q = malloc((size_t)NQ * D * sizeof *q);
    for (uint32_t i = 0; i < D; i++) {
        off[i] = 2 * gauss(&rng);
        gain[i] = i % 13 == 0 ? 6.0f : 0.5f + test_rand_f32(&rng, 0, 1);
        cq[i] = gauss(&rng);
    }
    make_keys(keys, N, D, off, gain);
    mean_keys(keys, N, D, ck);
    for (uint32_t j = 0; j < NQ; j++)
        for (uint32_t i = 0; i < D; i++)
            q[j * D + i] = cq[i] + 2 * gauss(&rng);
    struct tkv_rabitq *ix = make_index(D, test_rand_u64(&rng), keys, N, ck, cq, TKV_RABITQ_ISA_SCALAR);
    REQUIRE_VOID(ix);
    struct cover c;
    cover_init(&c);
    cover_add(&c, ix, keys, D, q, NQ, D);
    char what[64];
    snprintf(what, sizeof what, "random D=%u", D);
    cover_report(&c, what);
    tkv_rabitq_free(ix);
    free(keys);
    free(q);
}

// --- (3) SIMD variants vs the scalar reference --------------------------------------------

static void test_simd(void)
{
    const uint32_t dims[] = {64, 128, 96, 256, 512, 40};
    int tested = 0;
    for (int isa = 1; isa < TKV_RABITQ_ISA_COUNT; isa++) {
        if (!tkv_rabitq_isa_supported((enum tkv_rabitq_isa)isa)) {
            fprintf(stderr, "simd: %s not available here, not compared\n", tkv_rabitq_isa_name((enum tkv_rabitq_isa)isa));
            continue;
        }
        tested++;
        for (size_t di = 0; di < sizeof dims / sizeof *dims; di++) {
            const uint32_t D = dims[di], N = 16 * 37 + 11;
            uint16_t *keys = malloc((size_t)N * D * sizeof *keys);
            float off[512], gain[512], ck[512], cq[512], q[512];
            for (uint32_t i = 0; i < D; i++) {
                off[i] = gauss(&rng);
                gain[i] = test_rand_f32(&rng, 0.1f, 3.0f);
                cq[i] = gauss(&rng);
            }
            make_keys(keys, N, D, off, gain);
            memcpy(keys + 5 * D, keys + 6 * D, D * sizeof *keys); /* some edge rows: a duplicate, */
            mean_keys(keys, N, D, ck);
            for (uint32_t i = 0; i < D; i++)
                keys[7 * D + i] = tkv_fp32_to_fp16(ck[i]); /* one near the centroid */
            const uint64_t seed = test_rand_u64(&rng);
            struct tkv_rabitq *ref = make_index(D, seed, keys, N, ck, cq, TKV_RABITQ_ISA_SCALAR);
            struct tkv_rabitq *fast = NULL;
            REQUIRE_VOID(ref && tkv_rabitq_init(D, seed, &fast) == TKV_OK);
            REQUIRE_VOID(tkv_rabitq_set_isa(fast, (enum tkv_rabitq_isa)isa) == TKV_OK &&
                         tkv_rabitq_set_centroids(fast, ck, cq) == TKV_OK && tkv_rabitq_reserve(fast, 10) == TKV_OK);
            /* batches of odd sizes, reserving as we go (growth keeps what is there) */
            for (uint32_t at = 0; at < N;) {
                const uint32_t want = 1 + (uint32_t)(test_rand_u64(&rng) % 100), b = TKV_MIN(N - at, want);
                REQUIRE_VOID(tkv_rabitq_reserve(fast, at + b) == TKV_OK);
                REQUIRE_VOID(tkv_rabitq_append_f16(fast, keys + (size_t)at * D, D, b) == TKV_OK);
                at += b;
            }
            struct tkv_rabitq_arrays ra, fa;
            tkv_rabitq_get_arrays(ref, &ra);
            tkv_rabitq_get_arrays(fast, &fa);
            const char *name = tkv_rabitq_isa_name((enum tkv_rabitq_isa)isa);
            CHECK(!memcmp(ra.code, fa.code, (size_t)N * ra.words * 8), "%s D=%u: codes differ", name, D);
            CHECK(!memcmp(ra.pc, fa.pc, N * 2), "%s D=%u: popcounts differ", name, D);
            CHECK(!memcmp(ra.a, fa.a, N * 4) && !memcmp(ra.e, fa.e, N * 4) && !memcmp(ra.t, fa.t, N * 4),
                  "%s D=%u: per-key scalars differ", name, D);
            float *e1 = malloc(N * sizeof(float)), *e2 = malloc(N * sizeof(float));
            float *b1 = malloc(N * sizeof(float)), *b2 = malloc(N * sizeof(float));
            int est_same = 1, q_same = 1;
            for (int t = 0; t < 8; t++) {
                for (uint32_t i = 0; i < D; i++)
                    q[i] = cq[i] + (t == 7 ? 0.0f : 3 * gauss(&rng)); /* the last: q = c_q */
                struct tkv_rabitq_query q1, q2;
                REQUIRE_VOID(tkv_rabitq_query_prepare(ref, q, 0, &q1) == TKV_OK &&
                             tkv_rabitq_query_prepare(fast, q, 0, &q2) == TKV_OK);
                q_same &= !memcmp(q1.plane, q2.plane, sizeof q1.plane) && q1.delta == q2.delta && q1.vl == q2.vl &&
                          q1.sum_q == q2.sum_q && q1.add == q2.add && q1.bound_u == q2.bound_u && q1.bound_w == q2.bound_w;
                const uint32_t first = (uint32_t)t * 3, n = N - first - (uint32_t)t;
                REQUIRE_VOID(tkv_rabitq_estimate(ref, &q1, first, n, e1, b1) == TKV_OK);
                REQUIRE_VOID(tkv_rabitq_estimate(fast, &q2, first, n, e2, t % 2 ? NULL : b2) == TKV_OK);
                est_same &= !memcmp(e1, e2, n * sizeof *e1) && (t % 2 || !memcmp(b1, b2, n * sizeof *b1));
            }
            CHECK(q_same, "%s D=%u: prepared queries differ", name, D);
            CHECK(est_same, "%s D=%u: estimates or bounds differ from the scalar reference", name, D);
            fprintf(stderr, "simd %s D=%u: %u keys: codes, scalars, queries, estimates, bounds %s\n", name, D, N,
                    est_same && q_same ? "bit-identical to scalar" : "DIFFER");
            free(e1);
            free(e2);
            free(b1);
            free(b2);
            free(keys);
            tkv_rabitq_free(ref);
            tkv_rabitq_free(fast);
        }
    }
    if (!tested)
        fprintf(stderr, "simd: no SIMD variant on this CPU; nothing compared\n");

    /* TKV_RABITQ_FORCE picks the default variant */
    struct tkv_rabitq *ix = NULL;
    setenv("TKV_RABITQ_FORCE", "scalar", 1);
    CHECK(tkv_rabitq_init(64, 1, &ix) == TKV_OK && tkv_rabitq_get_isa(ix) == TKV_RABITQ_ISA_SCALAR,
          "TKV_RABITQ_FORCE=scalar not honoured");
    tkv_rabitq_free(ix);
    setenv("TKV_RABITQ_FORCE", "sse9", 1);
    CHECK(tkv_rabitq_init(64, 1, &ix) == TKV_ERR_INVALID_ARG && !ix, "TKV_RABITQ_FORCE=sse9 must be refused");
    unsetenv("TKV_RABITQ_FORCE");
}

// --- (4) top-p --------------------------------------------------------------------------

/* The smallest count of non-forced keys reaching the rule, by brute force:
 * sort by value v, add until sum_S v >= need. */
struct kvu {
    double v, l, u, c;
};
static int cmp_kv(const void *a, const void *b)
{
    const double x = ((const struct kvu *)a)->v, y = ((const struct kvu *)b)->v;
    return x < y ? 1 : x > y ? -1 : 0;
}

static int cmp_desc(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? 1 : x > y ? -1 : 0;
}

struct topp_stats {
    uint64_t trials, safe_ok, plain_ok;
    double plain_mass_sum, plain_mass_min, safe_mass_sum;
    double n_oracle, n_plain, n_safe;
    uint64_t min_set_ok;
    uint64_t coarse_ok;      /* coarse selections that are a superset within one bin */
    double n_coarse_extra;   /* keys coarse adds (sum over selections)              */
};

static void topp_stats_init(struct topp_stats *t)
{
    memset(t, 0, sizeof *t);
    t->plain_mass_min = 1;
}

/* Key i's log-value as the top-p search orders the keys: s + d + log(p +
 * (1-p) e^(-2d)) with bounds (safe), s without (bnd NULL), in float. */
static float key_logvalue(const float *est, const float *bnd, uint32_t i, float p, float scale)
{
    const float s = scale * est[i], d = bnd ? scale * bnd[i] : 0.0f;
    return bnd ? s + d + logf(p + (1 - p) * expf(-2 * d)) : s;
}

/* One trial: keys [0, n) of which [n_enc, n) are the unencoded tail; sinks [0, n_sink).
 * est/bnd cover [0, n_enc); ex[] are the exact logits (unscaled) of all n. */
static void topp_trial(struct topp_stats *st, const float *est, const float *bnd, const double *ex, uint32_t n,
                       uint32_t n_enc, uint32_t n_sink, float p, float scale)
{
    const size_t wb = tkv_rabitq_topp_work_bytes(n_enc);
    void *work = malloc(wb);
    uint32_t *pos = malloc(n * sizeof *pos), *pos_c = malloc(n * sizeof *pos_c);
    uint8_t *in_exact = malloc(n);
    double *w = malloc(n * sizeof *w), *v = malloc(n * sizeof *v);
    struct kvu *kv = malloc(n * sizeof *kv);
    double lse_tail = -INFINITY, mx = -INFINITY;
    for (uint32_t i = 0; i < n; i++)
        mx = fmax(mx, scale * ex[i]);
    double z = 0;
    for (uint32_t i = 0; i < n; i++)
        z += w[i] = exp(scale * ex[i] - mx);
    double zt = 0;
    for (uint32_t i = n_enc; i < n; i++)
        zt += exp(scale * ex[i] - mx);
    if (zt > 0)
        lse_tail = log(zt) + mx;
    struct tkv_range forced[2] = {{0, n_sink}, {n_enc, n}};
    struct tkv_rabitq_topp_params tp = {.p = p, .scale = scale, .extra_lse = (float)lse_tail, .pos0 = 0,
                                        .forced = forced, .n_forced = 2};
    struct tkv_rabitq_topp_result r[2];
    double kept[2];
    for (int safe = 0; safe < 2; safe++) {
        REQUIRE_VOID(tkv_rabitq_select_topp(est, safe ? bnd : NULL, n_enc, &tp, work, wb, pos, n, &r[safe]) == TKV_OK);
        double m = 0;
        int asc = 1, has_forced = 1;
        for (uint32_t j = 0; j < r[safe].n_pos; j++) {
            m += w[pos[j]];
            asc &= j == 0 || pos[j] > pos[j - 1];
        }
        /* forced positions present: count them */
        uint32_t nf = 0;
        for (uint32_t j = 0; j < r[safe].n_pos; j++)
            nf += pos[j] < n_sink || pos[j] >= n_enc;
        has_forced = nf == n_sink + (n - n_enc);
        CHECK(asc && has_forced && r[safe].n_pos == nf + r[safe].n_chosen,
              "topp: output not ascending or forced tokens missing (%u forced of %u)", nf, n_sink + (n - n_enc));
        kept[safe] = m / z;
        /* the count is the minimum for the rule (brute force): keys by decreasing
         * v = (1-p) l + p u, until (1-p) N >= p C, C summed from the smallest up */
        const double lp = 1 - (double)p;
        double N = exp((double)(float)lse_tail - mx);
        uint32_t nv = 0;
        for (uint32_t i = 0; i < n_enc; i++) {
            const double s = (double)(scale * est[i]), d = safe ? (double)(scale * bnd[i]) : 0.0;
            const double l = exp(s - d - mx), u = exp(s + d - mx);
            if (i < n_sink)
                N += l;
            else {
                kv[nv].v = lp * l + p * u;
                kv[nv].l = l;
                kv[nv++].u = u;
            }
        }
        qsort(kv, nv, sizeof *kv, cmp_kv);
        double acc = 0;
        for (uint32_t k = nv; k-- > 0;)
            kv[k].c = acc += kv[k].u;
        uint32_t cnt = 0;
        while (cnt < nv && lp * N < p * kv[cnt].c)
            N += kv[cnt++].l;
        /* float-rounded keys near the cut may swap; allow one */
        st->min_set_ok += r[safe].n_chosen + 1 >= cnt && r[safe].n_chosen <= cnt + 1;

        /* coarse: a superset whose extra keys lie in the exact boundary's
         * bin -- within one bin (1/BPN nat of log-value) below the lowest
         * key the exact selection chose, or, where that key is in the last
         * bin (64 nats or more below the largest log-value: the last bin
         * holds all of them), anywhere in the last bin (TKV_SEED=177429701,
         * safe: 1444 such keys kept for 536) -- and a kept mass (as
         * reported) no lower */
        struct tkv_rabitq_topp_params tc = tp;
        tc.coarse = true;
        struct tkv_rabitq_topp_result rc;
        REQUIRE_VOID(tkv_rabitq_select_topp(est, safe ? bnd : NULL, n_enc, &tc, work, wb, pos_c, n, &rc) == TKV_OK);
        memset(in_exact, 0, n);
        float gmin = INFINITY;
        for (uint32_t j = 0; j < r[safe].n_pos; j++) {
            const uint32_t i = pos[j];
            in_exact[i] = 1;
            if (i >= n_sink && i < n_enc)
                gmin = fminf(gmin, key_logvalue(est, safe ? bnd : NULL, i, p, scale));
        }
        float gmax = -INFINITY;
        for (uint32_t i = n_sink; i < n_enc; i++)
            gmax = fmaxf(gmax, key_logvalue(est, safe ? bnd : NULL, i, p, scale));
        const float last_bin = (float)(TKV_RABITQ_TOPP_BINS - 1) / TKV_RABITQ_TOPP_BPN; /* nats below gmax */
        const bool in_last = gmax - gmin >= last_bin - 1e-3f;
        uint32_t extra = 0, far = 0;
        for (uint32_t j = 0; j < rc.n_pos; j++) {
            const uint32_t i = pos_c[j];
            if (in_exact[i])
                continue;
            extra++;
            const float g = key_logvalue(est, safe ? bnd : NULL, i, p, scale);
            far += in_last ? !(gmax - g >= last_bin - 1e-3f) : !(g >= gmin - 1.0f / TKV_RABITQ_TOPP_BPN - 1e-3f);
        }
        const uint32_t missing = r[safe].n_pos + extra - rc.n_pos; /* exact's positions coarse lacks */
        const bool ok = missing == 0 && far == 0 && rc.n_chosen == r[safe].n_chosen + extra &&
                        rc.mass >= r[safe].mass - 1e-12;
        CHECK(ok, "topp coarse (%s): %u of the exact set missing, %u extra keys more than a bin below it, %u chosen "
              "for %u + %u, mass %.6f for %.6f", safe ? "safe" : "plain", missing, far, rc.n_chosen, r[safe].n_chosen,
              extra, rc.mass, r[safe].mass);
        st->coarse_ok += ok;
        st->n_coarse_extra += extra;
    }
    /* the oracle: fewest keys by exact weight reaching p, forced included */
    double fm = 0;
    uint32_t no = 0;
    for (uint32_t i = 0; i < n; i++)
        if (i < n_sink || i >= n_enc)
            fm += w[i];
        else
            v[no++] = w[i];
    qsort(v, no, sizeof *v, cmp_desc);
    uint32_t oc = 0;
    for (double acc = fm; oc < no && acc < p * z; oc++)
        acc += v[oc];
    st->trials++;
    st->safe_ok += kept[1] >= p;
    st->plain_ok += kept[0] >= p;
    st->plain_mass_sum += kept[0];
    st->plain_mass_min = fmin(st->plain_mass_min, kept[0]);
    st->safe_mass_sum += kept[1];
    st->n_oracle += oc;
    st->n_plain += r[0].n_chosen;
    st->n_safe += r[1].n_chosen;
    free(work);
    free(pos);
    free(pos_c);
    free(in_exact);
    free(w);
    free(v);
    free(kv);
}

static void topp_report(const struct topp_stats *t, const char *what, float p, float eps0, bool check)
{
    fprintf(stderr,
            "top-p %s, p=%.2f, %llu trials: safe (eps0 %.0f) keeps >= p of the exact mass in %.2f%% (mean %.4f); plain "
            "keeps >= p in %.1f%%, mean %.4f, min %.4f; keys chosen (mean): oracle %.1f, plain %.1f, safe %.1f; set "
            "minimal for its rule in %llu of %llu; coarse: a superset within a bin in %llu, %.1f keys more (mean)\n",
            what, p, (unsigned long long)t->trials, eps0, 100.0 * t->safe_ok / t->trials, t->safe_mass_sum / t->trials,
            100.0 * t->plain_ok / t->trials, t->plain_mass_sum / t->trials, t->plain_mass_min, t->n_oracle / t->trials,
            t->n_plain / t->trials, t->n_safe / t->trials, (unsigned long long)t->min_set_ok,
            (unsigned long long)(2 * t->trials), (unsigned long long)t->coarse_ok,
            t->n_coarse_extra / (2.0 * t->trials));
    CHECK(!check || t->safe_ok >= 0.99 * t->trials, "%s: safe top-p kept >= p in only %llu of %llu trials", what,
          (unsigned long long)t->safe_ok, (unsigned long long)t->trials);
    CHECK(t->min_set_ok == 2 * t->trials, "%s: a selection was not the smallest for its rule", what);
}

static void test_topp_random(void)
{
    const uint32_t D = 128, N = 2048, TAIL = 64, SINK = 4, NTRIALS = 150;
    const float p = 0.9f, scale = 1.0f / sqrtf((float)D);
    uint16_t *keys = malloc((size_t)N * D * sizeof *keys);
    float off[128], gain[128], ck[128], cq[128], q[128], *est = malloc(N * sizeof(float)), *bnd = malloc(N * sizeof(float));
    double *ex = malloc(N * sizeof *ex);
    struct topp_stats st;
    topp_stats_init(&st);
    for (uint32_t t = 0; t < NTRIALS; t++) {
        if (t % 10 == 0) { /* a fresh key set every 10 trials */
            for (uint32_t i = 0; i < D; i++) {
                off[i] = gauss(&rng);
                gain[i] = i % 11 == 0 ? 4.0f : 1.0f;
                cq[i] = 0.5f * gauss(&rng);
            }
            make_keys(keys, N, D, off, gain);
            mean_keys(keys, N - TAIL, D, ck);
        }
        /* a query pointing at a few "needle" keys, so attention is peaked but not one-hot */
        for (uint32_t i = 0; i < D; i++)
            q[i] = cq[i] + gauss(&rng);
        const int needles = 1 + (int)(test_rand_u64(&rng) % 8);
        const float strength = test_rand_f32(&rng, 0.5f, 2.5f);
        for (int nd = 0; nd < needles; nd++) {
            const uint32_t k = (uint32_t)(test_rand_u64(&rng) % N);
            for (uint32_t i = 0; i < D; i++)
                q[i] += strength * (tkv_fp16_to_fp32(keys[(size_t)k * D + i]) - ck[i]) / sqrtf((float)needles);
        }
        struct tkv_rabitq *ix = make_index(D, test_rand_u64(&rng), keys, N - TAIL, ck, cq, TKV_RABITQ_ISA_SCALAR);
        REQUIRE_VOID(ix);
        struct tkv_rabitq_query qq;
        REQUIRE_VOID(tkv_rabitq_query_prepare(ix, q, 0, &qq) == TKV_OK);
        REQUIRE_VOID(tkv_rabitq_estimate(ix, &qq, 0, N - TAIL, est, bnd) == TKV_OK);
        for (uint32_t k = 0; k < N; k++)
            ex[k] = dot_f16(q, keys + (size_t)k * D, D);
        topp_trial(&st, est, bnd, ex, N, N - TAIL, SINK, p, scale);
        tkv_rabitq_free(ix);
    }
    topp_report(&st, "random D=128 n=2048", p, 3, true);
    free(keys);
    free(est);
    free(bnd);
    free(ex);
}

/* Edge behaviour of select_topp on small hand-made inputs. */
static void test_topp_edges(void)
{
    float est[8] = {10, 0, 0, 0, 0, 0, 0, 9};
    uint32_t pos[32];
    char work[1 << 17] __attribute__((aligned(8)));
    const size_t wb = tkv_rabitq_topp_work_bytes(8);
    REQUIRE_VOID(wb <= sizeof work);
    struct tkv_rabitq_topp_result r;
    struct tkv_rabitq_topp_params tp = {.p = 0.5f, .scale = 1.0f, .extra_lse = -INFINITY};
    CHECK(tkv_rabitq_select_topp(est, NULL, 8, &tp, work, wb, pos, 32, &r) == TKV_OK && r.n_pos == 1 && pos[0] == 0,
          "topp: p=0.5 on a dominant key must pick just it");
    tp.p = 0.9f;
    CHECK(tkv_rabitq_select_topp(est, NULL, 8, &tp, work, wb, pos, 32, &r) == TKV_OK && r.n_pos == 2 && pos[0] == 0 &&
              pos[1] == 7 && r.mass >= 0.9,
          "topp: p=0.9 must pick keys 0 and 7 (n=%u)", r.n_pos);
    tp.p = 1.0f;
    CHECK(tkv_rabitq_select_topp(est, NULL, 8, &tp, work, wb, pos, 32, &r) == TKV_OK && r.n_pos == 8, "topp: p=1 keeps all");
    tp.p = 0.9f;
    tp.max_keep = 1;
    CHECK(tkv_rabitq_select_topp(est, NULL, 8, &tp, work, wb, pos, 32, &r) == TKV_OK && r.n_pos == 1 && r.mass < 0.9,
          "topp: max_keep=1 caps the set");
    tp.max_keep = 0;
    /* forced ranges before, inside and past est; pos0 shifts est */
    struct tkv_range f[3] = {{2, 12}, {14, 15}, {20, 23}};
    tp.pos0 = 10;
    tp.forced = f;
    tp.n_forced = 3;
    tp.extra_lse = 0;
    REQUIRE_VOID(tkv_rabitq_select_topp(est, NULL, 8, &tp, work, wb, pos, 32, &r) == TKV_OK);
    const uint32_t want[] = {2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 14, 17, 20, 21, 22};
    int ok = r.n_pos == sizeof want / sizeof *want;
    for (uint32_t i = 0; ok && i < r.n_pos; i++)
        ok = pos[i] == want[i];
    CHECK(ok, "topp: forced ranges merged wrongly (n=%u)", r.n_pos);
    CHECK(tkv_rabitq_select_topp(est, NULL, 8, &tp, work, wb, pos, 4, &r) == TKV_ERR_TOO_SMALL && r.n_pos == 15,
          "topp: a short output must be TKV_ERR_TOO_SMALL with the count needed");
    struct tkv_range bad[2] = {{5, 9}, {7, 8}};
    tp.forced = bad;
    tp.n_forced = 2;
    CHECK(tkv_rabitq_select_topp(est, NULL, 8, &tp, work, wb, pos, 32, &r) == TKV_ERR_INVALID_ARG, "overlapping ranges");
    tp.n_forced = 0;
    CHECK(tkv_rabitq_select_topp(est, NULL, 8, &tp, work, wb - 1, pos, 32, &r) == TKV_ERR_TOO_SMALL, "short work");
    est[3] = NAN;
    CHECK(tkv_rabitq_select_topp(est, NULL, 8, &tp, work, wb, pos, 32, &r) == TKV_ERR_INVALID_ARG, "NaN estimate");
    est[3] = -INFINITY; /* a masked key: allowed, never chosen */
    tp.p = 1.0f;
    CHECK(tkv_rabitq_select_topp(est, NULL, 8, &tp, work, wb, pos, 32, &r) == TKV_OK, "-inf estimate must be accepted");
    tp.p = 0;
    CHECK(tkv_rabitq_select_topp(est, NULL, 8, &tp, work, wb, pos, 32, &r) == TKV_ERR_INVALID_ARG, "p = 0");
    tp.p = 0.5f;
    tp.scale = -1;
    CHECK(tkv_rabitq_select_topp(est, NULL, 8, &tp, work, wb, pos, 32, &r) == TKV_ERR_INVALID_ARG, "negative scale");
    tp.scale = 1;
    float bnd[8] = {0, 0, 0, -1, 0, 0, 0, 0};
    CHECK(tkv_rabitq_select_topp(est, bnd, 8, &tp, work, wb, pos, 32, &r) == TKV_ERR_INVALID_ARG, "negative bound");
    /* safe with a wide bound on the runner-up needs both top keys where plain needs one */
    float e2[4] = {5, 4, -10, -10}, b2[4] = {0.1f, 2.0f, 0, 0};
    tp = (struct tkv_rabitq_topp_params){.p = 0.7f, .scale = 1.0f, .extra_lse = -INFINITY};
    CHECK(tkv_rabitq_select_topp(e2, NULL, 4, &tp, work, wb, pos, 32, &r) == TKV_OK && r.n_pos == 1, "plain: 1 key");
    CHECK(tkv_rabitq_select_topp(e2, b2, 4, &tp, work, wb, pos, 32, &r) == TKV_OK && r.n_pos == 2 && r.mass >= 0.7,
          "safe: 2 keys, lower bound >= p (n=%u, mass %.3f)", r.n_pos, r.mass);
    CHECK(tkv_rabitq_select_topp(NULL, NULL, 0, &tp, NULL, 0, pos, 32, &r) == TKV_OK && r.n_pos == 0, "empty input");
}

/* Every SIMD variant of select_topp against the scalar reference on fresh
 * random inputs: 1 .. 20000 keys, estimates gaussian (scales 0.1 .. 30),
 * peaked, flat (all equal), tied (4 values) or with -inf keys; plain and
 * safe; 0-3 forced ranges; p 0.5 .. 1; extra_lse; coarse; max_keep. The
 * same status (and message, for a bad key); the same forced positions and
 * ascending output; the sets differ by at most 4 + n/1e5 keys (a rule on a
 * rounding tie); masses within 1e-6; and, uncapped, the variant's own set
 * keeps >= p of the mass recomputed in double (its lower bound, safe). */
static void test_topp_simd(void)
{
    enum { N_MAX = 20000, TRIALS = 400 };
    float *est = malloc(N_MAX * sizeof *est), *bnd = malloc(N_MAX * sizeof *bnd);
    uint32_t *pr = malloc(N_MAX * sizeof *pr), *pf = malloc(N_MAX * sizeof *pf);
    uint8_t *in_ref = malloc(N_MAX + 3 * 64); /* forced ranges may end past n */
    const size_t wb = tkv_rabitq_topp_work_bytes(N_MAX);
    void *work = malloc(wb);
    REQUIRE_VOID(est && bnd && pr && pf && in_ref && work);
    for (int isa = 1; isa < TKV_RABITQ_ISA_COUNT; isa++) {
        const char *name = tkv_rabitq_isa_name((enum tkv_rabitq_isa)isa);
        if (!tkv_rabitq_isa_supported((enum tkv_rabitq_isa)isa)) {
            fprintf(stderr, "topp simd: %s not available here, not compared\n", name);
            continue;
        }
        uint64_t keys = 0, differ = 0, bad_inputs = 0;
        double mass_dev = 0;
        for (uint32_t t = 0; t < TRIALS; t++) {
            const uint32_t n = t % 7 == 0 ? 1 + (uint32_t)(test_rand_u64(&rng) % 40)
                                          : 1 + (uint32_t)(test_rand_u64(&rng) % N_MAX);
            const int shape = (int)(t % 5); /* gaussian, peaked, flat, tied, -inf keys */
            const float sd = test_rand_f32(&rng, 0.1f, 30.0f);
            for (uint32_t i = 0; i < n; i++) {
                est[i] = shape == 2 ? 1.5f : shape == 3 ? (float)(test_rand_u64(&rng) % 4) : sd * gauss(&rng);
                if (shape == 1 && test_rand_u64(&rng) % 500 == 0)
                    est[i] += 40.0f;
                if (shape == 4 && test_rand_u64(&rng) % 3 == 0)
                    est[i] = -INFINITY;
                bnd[i] = test_rand_u64(&rng) % 8 == 0 ? 0.0f : test_rand_f32(&rng, 0.0f, 6.0f);
            }
            const bool safe = t % 2, poison = t % 31 == 30;
            if (poison) { /* a bad key: the same refusal */
                const uint32_t at = (uint32_t)(test_rand_u64(&rng) % n);
                if (safe && t % 4 == 1)
                    bnd[at] = -1.0f;
                else
                    est[at] = t % 3 ? NAN : INFINITY;
            }
            struct tkv_range forced[3];
            uint32_t nf = (uint32_t)(test_rand_u64(&rng) % 4), b0 = 0;
            for (uint32_t r = 0; r < nf; r++) {
                const uint32_t b = b0 + (uint32_t)(test_rand_u64(&rng) % (n / 4 + 1));
                forced[r] = (struct tkv_range){b, b + (uint32_t)(test_rand_u64(&rng) % 64)};
                b0 = forced[r].end;
            }
            static const float ps[] = {0.5f, 0.9f, 0.95f, 0.99f, 1.0f};
            struct tkv_rabitq_topp_params tp = {
                .p = ps[test_rand_u64(&rng) % 5], .scale = test_rand_f32(&rng, 0.05f, 1.0f),
                .extra_lse = t % 3 == 0 ? test_rand_f32(&rng, -5.0f, 20.0f) : -INFINITY, .pos0 = 0,
                .forced = forced, .n_forced = nf, .max_keep = t % 9 == 8 ? 1 + (uint32_t)(test_rand_u64(&rng) % 50) : 0,
                .coarse = t % 6 == 5};
            struct tkv_rabitq_topp_result rr, rf;
            const float *b = safe ? bnd : NULL;
            const tkv_status sr = tkv_rabitq_select_topp_isa(TKV_RABITQ_ISA_SCALAR, est, b, n, &tp, work, wb, pr,
                                                             N_MAX, &rr);
            char msg[256];
            snprintf(msg, sizeof msg, "%s", tkv_last_error());
            const tkv_status sf = tkv_rabitq_select_topp_isa((enum tkv_rabitq_isa)isa, est, b, n, &tp, work, wb, pf,
                                                             N_MAX, &rf);
            CHECK(sr == sf, "topp %s trial %u: status %d, the reference's %d", name, t, (int)sf, (int)sr);
            if (sr != TKV_OK || sf != TKV_OK) {
                CHECK(sr == TKV_ERR_INVALID_ARG && poison && !strcmp(msg, tkv_last_error()),
                      "topp %s trial %u: '%s', the reference's '%s'", name, t, tkv_last_error(), msg);
                bad_inputs++;
                continue;
            }
            memset(in_ref, 0, n + 64 * 3);
            uint32_t diff = 0, forced_missing = 0, asc = 1;
            for (uint32_t j = 0; j < rr.n_pos; j++)
                in_ref[pr[j]] = 1;
            for (uint32_t j = 0; j < rf.n_pos; j++) {
                asc &= j == 0 || pf[j] > pf[j - 1];
                diff += !in_ref[pf[j]];
                in_ref[pf[j]] |= 2;
            }
            for (uint32_t j = 0; j < rr.n_pos; j++)
                diff += !(in_ref[pr[j]] & 2);
            for (uint32_t r = 0; r < nf; r++)
                for (uint32_t x = forced[r].begin; x < forced[r].end; x++)
                    forced_missing += !(in_ref[x] & 2);
            CHECK(asc && forced_missing == 0, "topp %s trial %u: output not ascending or %u forced missing", name, t,
                  forced_missing);
            CHECK(diff <= 4 + n / 100000, "topp %s trial %u (n %u, %s, p %.2f): %u keys differ (%u vs %u chosen)",
                  name, t, n, safe ? "safe" : "plain", (double)tp.p, diff, rf.n_chosen, rr.n_chosen);
            CHECK(fabs(rf.mass - rr.mass) <= 1e-6, "topp %s trial %u: mass %.9f, the reference's %.9f", name, t,
                  rf.mass, rr.mass);
            mass_dev = fmax(mass_dev, fabs(rf.mass - rr.mass));
            if (!tp.max_keep) { /* the variant's own set reaches p */
                double M = tp.extra_lse, N = 0, C = 0;
                for (uint32_t i = 0; i < n; i++)
                    M = fmax(M, (double)(tp.scale * est[i]) + (b ? (double)(tp.scale * bnd[i]) : 0.0));
                M = M == -INFINITY ? 0 : M; /* every key -inf */
                N = exp((double)tp.extra_lse - M);
                for (uint32_t i = 0; i < n; i++) {
                    const double s = (double)(tp.scale * est[i]), d = b ? (double)(tp.scale * bnd[i]) : 0.0;
                    if (in_ref[i] & 2)
                        N += exp(s - d - M);
                    else
                        C += exp(s + d - M);
                }
                const double kept = N + C > 0 ? N / (N + C) : 1.0; /* nothing but -inf: all of nothing */
                CHECK(kept >= tp.p - 1e-6, "topp %s trial %u: kept mass %.9f < p %.2f", name, t, kept, (double)tp.p);
            }
            keys += n;
            differ += diff;
        }
        fprintf(stderr, "topp simd %s: %u trials, %llu keys: %llu differ from the scalar reference's sets, masses "
                "within %.2g, %llu bad inputs refused alike\n", name, TRIALS, (unsigned long long)keys,
                (unsigned long long)differ, mass_dev, (unsigned long long)bad_inputs);
    }
    free(est), free(bnd), free(pr), free(pf), free(in_ref), free(work);
}

// --- bad input ---------------------------------------------------------------------------

static void test_errors(void)
{
    struct tkv_rabitq *ix = NULL;
    CHECK(tkv_rabitq_init(0, 1, &ix) == TKV_ERR_INVALID_ARG && !ix, "head_dim 0");
    CHECK(tkv_rabitq_init(513, 1, &ix) == TKV_ERR_INVALID_ARG, "head_dim 513");
    CHECK(tkv_rabitq_init(64, 1, NULL) == TKV_ERR_INVALID_ARG, "NULL out");
    REQUIRE_VOID(tkv_rabitq_init(64, 1, &ix) == TKV_OK);
    uint16_t k[4 * 64];
    for (int i = 0; i < 4 * 64; i++)
        k[i] = tkv_fp32_to_fp16((float)(i % 7) - 3);
    CHECK(tkv_rabitq_append_f16(ix, k, 64, 1) == TKV_ERR_INVALID_ARG, "append before centroids");
    CHECK(tkv_rabitq_set_centroids(ix, NULL, NULL) == TKV_OK, "zero centroids");
    CHECK(tkv_rabitq_append_f16(ix, k, 64, 1) == TKV_ERR_TOO_SMALL, "append without reserve");
    CHECK(tkv_rabitq_reserve(ix, 3) == TKV_OK && tkv_rabitq_capacity(ix) == 3, "reserve");
    CHECK(tkv_rabitq_append_f16(ix, k, 63, 1) == TKV_ERR_INVALID_ARG, "stride < head_dim");
    CHECK(tkv_rabitq_append_f16(ix, k, 64, 4) == TKV_ERR_TOO_SMALL && tkv_rabitq_size(ix) == 0, "append past capacity");
    k[64 + 5] = 0x7e00; /* NaN in row 1 */
    CHECK(tkv_rabitq_append_f16(ix, k, 64, 2) == TKV_ERR_INVALID_ARG && tkv_rabitq_size(ix) == 0, "NaN key");
    k[64 + 5] = 0;
    CHECK(tkv_rabitq_append_f16(ix, k, 64, 2) == TKV_OK && tkv_rabitq_size(ix) == 2, "append");
    float c[64] = {0}, q[64];
    CHECK(tkv_rabitq_set_centroids(ix, c, c) == TKV_ERR_INVALID_ARG, "centroids on a non-empty index");
    for (int i = 0; i < 64; i++)
        q[i] = (float)i;
    struct tkv_rabitq_query qq;
    float est[4], bnd[4];
    CHECK(tkv_rabitq_query_prepare(ix, q, -1, &qq) == TKV_ERR_INVALID_ARG, "negative eps0");
    REQUIRE_VOID(tkv_rabitq_query_prepare(ix, q, 0, &qq) == TKV_OK);
    CHECK(qq.eps0 == TKV_RABITQ_EPS0, "eps0 0 means the default");
    CHECK(tkv_rabitq_estimate(ix, &qq, 1, 2, est, bnd) == TKV_ERR_INVALID_ARG, "estimate past the end");
    CHECK(tkv_rabitq_estimate(ix, &qq, 0, 2, est, bnd) == TKV_OK, "estimate");
    CHECK(tkv_rabitq_estimate(ix, &qq, 2, 0, NULL, NULL) == TKV_OK, "empty estimate");
    /* the zero-residual key (row 0 is not zero; use centroid = row 0 below) */
    tkv_rabitq_reset(ix);
    CHECK(tkv_rabitq_size(ix) == 0 && tkv_rabitq_capacity(ix) == 3, "reset keeps capacity");
    for (int i = 0; i < 64; i++)
        c[i] = tkv_fp16_to_fp32(k[i]);
    CHECK(tkv_rabitq_set_centroids(ix, c, NULL) == TKV_OK, "centroids after reset");
    CHECK(tkv_rabitq_estimate(ix, &qq, 0, 0, est, bnd) == TKV_ERR_INVALID_ARG, "a stale query must be refused");
    CHECK(tkv_rabitq_append_f16(ix, k, 64, 1) == TKV_OK, "append the centroid itself");
    REQUIRE_VOID(tkv_rabitq_query_prepare(ix, q, 0, &qq) == TKV_OK);
    CHECK(tkv_rabitq_estimate(ix, &qq, 0, 1, est, bnd) == TKV_OK && bnd[0] == 0 &&
              fabs(est[0] - dot_f16(q, k, 64)) < 1e-3,
          "k = c_k: the estimate is the exact cross terms (est %g, exact %g, bound %g)", (double)est[0], dot_f16(q, k, 64),
          (double)bnd[0]);
    q[3] = NAN;
    CHECK(tkv_rabitq_query_prepare(ix, q, 0, &qq) == TKV_ERR_INVALID_ARG, "NaN query");
    c[2] = INFINITY;
    tkv_rabitq_reset(ix);
    CHECK(tkv_rabitq_set_centroids(ix, c, NULL) == TKV_ERR_INVALID_ARG, "non-finite centroid");
    CHECK(tkv_rabitq_rotate(ix, NULL, c) == TKV_ERR_INVALID_ARG, "rotate NULL");
    CHECK(tkv_rabitq_set_isa(ix, TKV_RABITQ_ISA_COUNT) == TKV_ERR_INVALID_ARG, "bad isa");
    tkv_rabitq_free(ix);
    tkv_rabitq_free(NULL);
}

// --- (2, 4) real keys: SmolLM2 after a prefill ---------------------------------------------

static void test_real_keys(void)
{
    const char *path = getenv("TKV_MODEL");
    FILE *fm = path ? fopen(path, "rb") : NULL;
    if (!fm) {
        fprintf(stderr, "real keys: model not found (TKV_MODEL=%s): coverage on real keys NOT checked\n",
                path ? path : "unset");
        return;
    }
    fclose(fm);
    tkv_model *m;
    REQUIRE_VOID(tkv_model_load(path, &m) == TKV_OK);
    /* a few hundred tokens of English (the GPL preamble) */
    FILE *f = fopen(test_data_path("prompt-long.txt"), "rb");
    REQUIRE_VOID(f);
    static char text[8192];
    const size_t len = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[len] = 0;
    static tkv_token toks[4096];
    size_t nt = 0;
    REQUIRE_VOID(tkv_tokenize(m, text, (ptrdiff_t)len, TKV_TOK_ADD_BOS, toks, 4096, &nt) == TKV_OK);
    const uint32_t n_prompt = (uint32_t)TKV_MIN(nt, 400);
    struct tkv_session_params sp = tkv_session_default_params();
    sp.n_threads = 2;
    sp.n_ctx = 512;
    tkv_session *s;
    REQUIRE_VOID(tkv_session_init(m, &sp, &s) == TKV_OK);
    REQUIRE_VOID(tkv_prefill(s, toks, n_prompt) == TKV_OK);
    const struct tkv_model_info *hp = &s->hp;
    const uint32_t D = hp->head_dim, G = hp->n_head / hp->n_head_kv, QD = hp->n_head * D, NOBS = s->obs_n;
    REQUIRE_VOID(NOBS >= 8);
    const uint32_t n_cq = NOBS / 2; /* queries for c_q; the rest are the test queries */
    fprintf(stderr, "real keys: %s, %u tokens, %u layers x %u KV heads, head_dim %u, %u query heads per KV head, %u obs queries (%u for c_q)\n",
            hp->name, n_prompt, hp->n_layer, hp->n_head_kv, D, G, NOBS, n_cq);
    uint16_t *keys = malloc((size_t)n_prompt * D * sizeof *keys);
    float *qt = malloc((size_t)(NOBS - n_cq) * G * D * sizeof *qt), *est = malloc(n_prompt * sizeof(float)),
          *bnd = malloc(n_prompt * sizeof(float));
    double *ex = malloc(n_prompt * sizeof *ex);
    struct cover c;
    cover_init(&c);
    struct topp_stats st[3]; /* safe with eps0 = 1, 2, 3 (bounds scale with eps0) */
    for (int e = 0; e < 3; e++)
        topp_stats_init(&st[e]);
    float *bnd_e = malloc(n_prompt * sizeof(float));
    const uint64_t base = test_rand_u64(&rng);
    for (uint32_t l = 0; l < hp->n_layer; l++) {
        REQUIRE_VOID(tkv_kvs_begin_layer(s->kv, l, s->n_past, 0) == TKV_OK);
        for (uint32_t h = 0; h < hp->n_head_kv; h++) {
            struct tkv_kv_head_view v = tkv_kvs_view(s->kv, l, h);
            uint32_t n = 0;
            for (uint32_t b = 0; b < v.n_blocks; b++)
                for (uint32_t r = 0; r < v.blocks[b].n && n < n_prompt; r++, n++)
                    memcpy(keys + (size_t)n * D, v.blocks[b].k + (size_t)r * D, D * sizeof *keys);
            REQUIRE_VOID(n == n_prompt);
            float ck[512], cq[512];
            mean_keys(keys, n, D, ck);
            struct tkv_rabitq_mean mq;
            tkv_rabitq_mean_init(&mq, D);
            const float *obs = s->obs_q + (size_t)l * OBS_QUERIES * QD;
            for (uint32_t g = 0; g < G; g++)
                tkv_rabitq_mean_add_f32(&mq, obs + (h * G + g) * D, QD, n_cq);
            tkv_rabitq_mean_get(&mq, cq);
            uint32_t nq = 0;
            for (uint32_t j = n_cq; j < NOBS; j++)
                for (uint32_t g = 0; g < G; g++)
                    memcpy(qt + (size_t)nq++ * D, obs + (size_t)j * QD + (h * G + g) * D, D * sizeof *qt);
            struct tkv_rabitq *ix = make_index(D, tkv_rabitq_seed(base, l, h), keys, n, ck, cq, TKV_RABITQ_ISA_SCALAR);
            REQUIRE_VOID(ix);
            cover_add(&c, ix, keys, D, qt, nq, D);
            /* top-p on the last 4 queries of the head: 4 sinks, a 32-token unencoded tail */
            for (uint32_t j = nq - 4; j < nq; j++) {
                const uint32_t tail = 32;
                struct tkv_rabitq_query qq;
                REQUIRE_VOID(tkv_rabitq_query_prepare(ix, qt + (size_t)j * D, 0, &qq) == TKV_OK);
                REQUIRE_VOID(tkv_rabitq_estimate(ix, &qq, 0, n - tail, est, bnd) == TKV_OK);
                for (uint32_t k = 0; k < n; k++)
                    ex[k] = dot_f16(qt + (size_t)j * D, keys + (size_t)k * D, D);
                for (int e = 0; e < 3; e++) {
                    for (uint32_t k = 0; k < n - tail; k++)
                        bnd_e[k] = bnd[k] * (float)(e + 1) / 3.0f;
                    topp_trial(&st[e], est, bnd_e, ex, n, n - tail, 4, 0.9f, 1.0f / sqrtf((float)D));
                }
            }
            tkv_rabitq_free(ix);
        }
        tkv_kvs_end_layer(s->kv, l);
    }
    cover_report(&c, "real SmolLM2 keys");
    for (int e = 0; e < 3; e++)
        topp_report(&st[e], "real SmolLM2 keys", 0.9f, (float)(e + 1), e == 2);
    free(bnd_e);
    free(keys);
    free(qt);
    free(est);
    free(bnd);
    free(ex);
    tkv_session_free(s);
    tkv_model_free(m);
}

/* The device twin's batched encode on the CPU backend (host memory stands
 * in for the device's), for every kernel variant this CPU has. */
static void test_spans_cpu(void)
{
    struct tkv_backend *be = NULL;
    REQUIRE_VOID(tkv_backend_create("cpu", 1, &be) == TKV_OK);
    const uint32_t dims[] = {64, 96, 128, 256, 512};
    for (size_t i = 0; i < sizeof dims / sizeof *dims; i++)
        for (int isa = 0; isa < TKV_RABITQ_ISA_COUNT; isa++)
            if (tkv_rabitq_isa_supported((enum tkv_rabitq_isa)isa)) {
                if (dims[i] <= 256)
                    check_spans(be, dims[i], (enum tkv_rabitq_isa)isa, &rng);
                check_prepare(be, dims[i], (enum tkv_rabitq_isa)isa, &rng); /* the CPU backend: the op's reference */
            }
    be->ops->free(be);
}

/* The key centroid's f16 sums are exact: units equal to the long double
 * reference, the mean the same bits whatever the order and the split of the
 * rows (forward, backward, in chunks, through mean_add_units), infinities
 * and NaNs kept to their own elements; more rows than the cap refused. */
static void test_mean_exact(void)
{
    enum { N = 700, STRIDE = 136 };
    for (uint32_t dim = 64; dim <= 128; dim += 64)
        for (int specials = 0; specials <= 1; specials++) {
            static uint16_t rows[N * STRIDE];
            ks_rows(&rng, rows, N, STRIDE, dim, specials);
            long double ref[TKV_RABITQ_MAX_DIM] = {0};
            uint32_t bad[TKV_RABITQ_MAX_DIM] = {0};
            ks_reference(rows, N, STRIDE, dim, ref, bad);
            struct tkv_rabitq_mean fwd, bwd, chunk;
            tkv_rabitq_mean_init(&fwd, dim), tkv_rabitq_mean_init(&bwd, dim), tkv_rabitq_mean_init(&chunk, dim);
            CHECK(tkv_rabitq_mean_add_f16(&fwd, rows, STRIDE, N) == TKV_OK, "mean_add_f16: %s", tkv_last_error());
            for (uint32_t r = N; r-- > 0;)
                tkv_rabitq_mean_add_f16(&bwd, rows + (size_t)r * STRIDE, STRIDE, 1);
            for (uint32_t r = 0; r < N; r += 97)
                tkv_rabitq_mean_add_f16(&chunk, rows + (size_t)r * STRIDE, STRIDE, N - r < 97 ? N - r : 97);
            float mf[TKV_RABITQ_MAX_DIM], mb[TKV_RABITQ_MAX_DIM], mc[TKV_RABITQ_MAX_DIM];
            tkv_rabitq_mean_get(&fwd, mf), tkv_rabitq_mean_get(&bwd, mb), tkv_rabitq_mean_get(&chunk, mc);
            uint32_t order = 0; /* (NaNs may carry another payload) */
            for (uint32_t d = 0; d < dim; d++)
                order += !(isnan(mf[d]) ? isnan(mb[d]) && isnan(mc[d])
                                        : !memcmp(&mf[d], &mb[d], 4) && !memcmp(&mf[d], &mc[d], 4));
            CHECK(order == 0, "dim %u: %u elements' means depend on the rows' order", dim, order);
            uint32_t wrong = 0, odd = 0;
            for (uint32_t d = 0; d < dim; d++) {
                wrong += ldexpl((long double)fwd.units[d], -24) != ref[d];
                if (bad[d])
                    odd += isfinite(mf[d]); /* an infinity or a NaN reached the element's mean */
                else
                    odd += !isfinite(mf[d]) || fabsl((long double)mf[d] - ref[d] / N) > 1e-6L * (fabsl(ref[d] / N) + 1e-3L);
            }
            CHECK(wrong == 0 && odd == 0, "dim %u%s: %u sums differ from the exact ones, %u means are off", dim,
                  specials ? " (infinities, NaNs)" : "", wrong, odd);
            if (!specials) { /* the same units from a backend's rabitq_key_sums */
                struct tkv_rabitq_mean mu;
                tkv_rabitq_mean_init(&mu, dim);
                CHECK(tkv_rabitq_mean_add_units(&mu, fwd.units, N) == TKV_OK, "mean_add_units: %s", tkv_last_error());
                float mm[TKV_RABITQ_MAX_DIM];
                tkv_rabitq_mean_get(&mu, mm);
                CHECK(!memcmp(mf, mm, dim * sizeof *mf), "dim %u: mean_add_units gave another mean", dim);
            }
        }
    struct tkv_rabitq_mean m;
    tkv_rabitq_mean_init(&m, 64);
    static int64_t zero[TKV_RABITQ_MAX_DIM];
    CHECK(tkv_rabitq_mean_add_units(&m, zero, TKV_RABITQ_MEAN_MAX_ROWS) == TKV_OK &&
              tkv_rabitq_mean_add_units(&m, zero, 1) == TKV_ERR_INVALID_ARG && strstr(tkv_last_error(), "more than"),
          "a mean past %llu rows was not refused: %s", (unsigned long long)TKV_RABITQ_MEAN_MAX_ROWS, tkv_last_error());
}

int main(void)
{
    const uint64_t seed = test_seed();
    rng = seed;
    test_errors();
    test_rotation();
    test_simd();
    test_unbiased(64, 2000);
    test_unbiased(128, 2000);
    test_coverage_random(64);
    test_coverage_random(128);
    test_topp_edges();
    test_topp_simd();
    test_topp_random();
    test_real_keys();
    test_spans_cpu();
    test_mean_exact();
    fprintf(stderr, "seed %llu (TKV_SEED to replay)\n", (unsigned long long)seed);
    return test_done();
}
