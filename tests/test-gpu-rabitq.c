/*
 * Description: the RaBitQ index on the GPU (backend ops rabitq_encode /
 * rabitq_estimate through runtime/rabitq/rabitq-dev.c) gives the CPU
 * kernels' codes, popcounts, scalars, estimates and bounds bit for bit, for
 * head_dim 64, 96 (padded to 128), 128 and 256, keys appended in uneven
 * batches from strided rows, on fresh random keys and queries; a non-finite
 * key, a full index and a query of another index are refused. The batched
 * encode (dev_append_spans: one rabitq_encode call, one grid, over 160
 * spans of 0 .. 200 rows scattered in device memory) gives the host index's
 * bytes, as one call, as three, and as one call per span; a call with
 * non-finite keys in its middle names the first (key, span, row) and keeps
 * nothing (tests/rabitq-spans.h).
 *
 * rabitq_prepare (a layer's queries prepared on the device from device q)
 * writes tkv_rabitq_query_prepare's bytes for every query, D = 64, 96, 128,
 * 256 and 512, three rounds of fresh inputs each, against the scalar and
 * the best SIMD host kernels: gaussian queries of many scales, q = c_q,
 * tied and one-hot q - c_q; a NaN, an inf and an overflowing query come
 * back poisoned and reported; rabitq_select fed by the device's queries
 * selects exactly (bitmap, n_chosen, mass) what it selects from the
 * host's, and reads a group with a refused query whole
 * (tests/rabitq-prepare.h).
 *
 * rabitq_select (one layer's top-p on the device, docs/rabitq.md "Device
 * top-p"), on random, peaked, flat (every estimate equal) and tied (4
 * distinct keys) indexes of 1 .. 200K keys of dimension 64 .. 512, plain and safe, 0-4 forced
 * ranges, with and without extra_lse: per query head (calls with G = 1)
 * the forced keys are kept; every kept key's score is >= every dropped
 * key's (plain: exactly, ties by position; safe: within 1e-5 of the
 * double log-value); the kept mass recomputed in double from the (bit-
 * identical) estimates is >= p and the device's mass matches it; dropping
 * the last key taken falls below p (minimal); n_chosen counts the kept
 * candidates; the symmetric difference with tkv_rabitq_select_topp is
 * counted, reported and at most 4 + 1e-5 n keys. A call with G query heads
 * gives the OR of its G single calls bit for bit (G = 1..8), `whole` the
 * widening to groups (64 positions in safe cases, 16 in plain ones), and a
 * second call the same bits; `coarse` (the boundary bin whole) a superset
 * of the exact set with n_chosen its count, a kept mass >= p, and at most
 * 4 + 1e-5 n keys off the host's coarse set. kv_table and
 * table_write (the decode table from a bitmap and the KV store's device
 * page table) equal kv-table-cases.h's oracle entry for entry on random
 * block sizes, residencies and selections, overflowing tables included.
 * rabitq_key_sums gives the exact sums of a key centroid (the long double
 * reference of tests/rabitq-key-sums.h) and counts the values not finite.
 * Skips (77) without a CUDA device.
 */
#include "test.h"
#include "rabitq-key-sums.h"
#include "rabitq-prepare.h"
#include "rabitq-spans.h"
#include "kv-table-cases.h"

#include "runtime/backend.h"
#include "runtime/rabitq/rabitq.h"
#include "runtime/tkv-impl.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static uint64_t rng;
static struct tkv_backend *be;

static float gauss(void)
{
    float u1 = test_rand_f32(&rng, 1e-7f, 1.0f), u2 = test_rand_f32(&rng, 0.0f, 1.0f);
    return sqrtf(-2.0f * logf(u1)) * cosf(6.2831853f * u2);
}

/* device buffer of n bytes holding host[0..n) */
static void *to_device(const void *host, size_t n)
{
    void *p = NULL;
    if (be->ops->alloc(be, n, &p) != TKV_OK || be->ops->upload(be, p, host, n) != TKV_OK)
        return NULL;
    return p;
}

static bool same_download(const void *dev, const void *want, size_t n, const char *what, uint32_t D)
{
    void *got = malloc(n ? n : 1);
    bool ok = got && be->ops->download(be, got, dev, n) == TKV_OK && be->ops->synchronize(be) == TKV_OK &&
              memcmp(got, want, n) == 0;
    if (!ok && got) { /* say where */
        const uint8_t *g = got, *w = want;
        size_t i = 0;
        while (i < n && g[i] == w[i])
            i++;
        fprintf(stderr, "  D=%u %s: first difference at byte %zu of %zu\n", D, what, i, n);
    }
    free(got);
    CHECK(ok, "D=%u: %s differ between the GPU and the CPU", D, what);
    return ok;
}

static void run_dim(uint32_t D, enum tkv_rabitq_isa isa)
{
    enum { N = 1500, Q = 24 };
    const size_t stride = D + 8; /* rows with a gap, as KV blocks are not */
    uint16_t *k = malloc((size_t)N * stride * sizeof *k);
    float *off = malloc(D * sizeof *off), *gain = malloc(D * sizeof *gain), *q = malloc(D * sizeof *q);
    float *est = malloc(N * sizeof *est), *bound = malloc(N * sizeof *bound);
    REQUIRE_VOID(k && off && gain && q && est && bound);
    for (uint32_t i = 0; i < D; i++) {
        off[i] = 0.5f * gauss();
        gain[i] = i % 17 == 3 ? 6.0f : 0.3f + test_rand_f32(&rng, 0.0f, 1.5f); /* a few outlier channels */
    }
    for (uint32_t r = 0; r < N; r++)
        for (size_t i = 0; i < stride; i++)
            k[r * stride + i] = tkv_fp32_to_fp16(i < D ? off[i] + gain[i] * gauss() : NAN); /* gap: poison */

    /* the host index: centroids from the first 256 keys, every key appended */
    struct tkv_rabitq *ix = NULL;
    struct tkv_rabitq_mean mk, mq;
    float ck[TKV_RABITQ_MAX_DIM], cq[TKV_RABITQ_MAX_DIM];
    REQUIRE_VOID(tkv_rabitq_init(D, 0x5eedull + D, &ix) == TKV_OK);
    CHECK(tkv_rabitq_set_isa(ix, isa) == TKV_OK, "isa %s", tkv_rabitq_isa_name(isa));
    tkv_rabitq_mean_init(&mk, D);
    tkv_rabitq_mean_init(&mq, D);
    tkv_rabitq_mean_add_f16(&mk, k, stride, 256);
    for (uint32_t j = 0; j < 64; j++) {
        for (uint32_t i = 0; i < D; i++)
            q[i] = 2.0f * gauss() + off[i];
        tkv_rabitq_mean_add_f32(&mq, q, D, 1);
    }
    tkv_rabitq_mean_get(&mk, ck);
    tkv_rabitq_mean_get(&mq, cq);
    REQUIRE_VOID(tkv_rabitq_set_centroids(ix, ck, cq) == TKV_OK);
    REQUIRE_VOID(tkv_rabitq_reserve(ix, N) == TKV_OK);
    REQUIRE_VOID(tkv_rabitq_append_f16(ix, k, stride, N) == TKV_OK);

    /* the device twin, appended in uneven batches */
    uint16_t *k_dev = to_device(k, (size_t)N * stride * sizeof *k);
    struct tkv_rabitq_dev_index *dx = NULL;
    REQUIRE_VOID(k_dev);
    tkv_status st = tkv_rabitq_dev_create(be, ix, N, &dx);
    REQUIRE_VOID(st == TKV_OK);
    const uint32_t cuts[] = {0, 1, 64, 100, 777, N};
    for (size_t c = 0; c + 1 < sizeof cuts / sizeof *cuts; c++) {
        st = tkv_rabitq_dev_append(dx, k_dev + cuts[c] * stride, stride, cuts[c + 1] - cuts[c]);
        CHECK(st == TKV_OK, "D=%u: dev_append [%u, %u): %s", D, cuts[c], cuts[c + 1], tkv_last_error());
    }
    CHECK(tkv_rabitq_dev_size(dx) == N, "D=%u: %u keys on the device", D, tkv_rabitq_dev_size(dx));

    struct tkv_rabitq_arrays h;
    tkv_rabitq_get_arrays(ix, &h);
    const struct tkv_rabitq_dev *d = tkv_rabitq_dev_arrays(dx);
    same_download(d->code, h.code, (size_t)N * h.words * sizeof *h.code, "codes", D);
    same_download(d->pc, h.pc, N * sizeof *h.pc, "popcounts", D);
    same_download(d->a, h.a, N * sizeof *h.a, "scalars a", D);
    same_download(d->e, h.e, N * sizeof *h.e, "scalars e", D);
    same_download(d->t, h.t, N * sizeof *h.t, "scalars t", D);

    /* estimates and bounds for fresh queries, over all keys and a sub-range */
    float *est_dev = NULL, *bound_dev = NULL;
    REQUIRE_VOID(be->ops->alloc(be, N * sizeof(float), (void **)&est_dev) == TKV_OK &&
                 be->ops->alloc(be, N * sizeof(float), (void **)&bound_dev) == TKV_OK);
    for (int j = 0; j < Q; j++) {
        const float s = j % 3 == 0 ? 0.05f : 3.0f; /* some queries nearly the centroid */
        for (uint32_t i = 0; i < D; i++)
            q[i] = cq[i] + s * gauss();
        struct tkv_rabitq_query qq;
        REQUIRE_VOID(tkv_rabitq_query_prepare(ix, q, j % 2 ? 1.5f : 0.0f, &qq) == TKV_OK);
        const uint32_t first = j % 4 == 1 ? 333 : 0, n = N - first - (j % 4 == 1 ? 100 : 0);
        REQUIRE_VOID(tkv_rabitq_estimate(ix, &qq, first, n, est, bound) == TKV_OK);
        st = tkv_rabitq_dev_estimate(dx, &qq, first, n, est_dev, j % 5 == 4 ? NULL : bound_dev);
        CHECK(st == TKV_OK, "D=%u: dev_estimate: %s", D, tkv_last_error());
        same_download(est_dev, est, n * sizeof *est, "estimates", D);
        if (j % 5 != 4)
            same_download(bound_dev, bound, n * sizeof *bound, "bounds", D);
    }

    /* refusals: full, a query of another index, a non-finite key */
    CHECK(tkv_rabitq_dev_append(dx, k_dev, stride, 1) == TKV_ERR_TOO_SMALL, "D=%u: append past the capacity", D);
    struct tkv_rabitq *other = NULL;
    struct tkv_rabitq_query qo;
    if (tkv_rabitq_init(D, 99, &other) == TKV_OK && tkv_rabitq_set_centroids(other, ck, cq) == TKV_OK &&
        tkv_rabitq_query_prepare(other, q, 0, &qo) == TKV_OK)
        CHECK(tkv_rabitq_dev_estimate(dx, &qo, 0, 1, est_dev, NULL) == TKV_ERR_INVALID_ARG,
              "D=%u: a query of another index must be refused", D);
    tkv_rabitq_free(other);
    tkv_rabitq_dev_free(dx);
    REQUIRE_VOID(tkv_rabitq_dev_create(be, ix, 8, &dx) == TKV_OK);
    k[2 * stride + D / 2] = tkv_fp32_to_fp16(INFINITY);
    REQUIRE_VOID(be->ops->upload(be, k_dev, k, (size_t)N * stride * sizeof *k) == TKV_OK);
    st = tkv_rabitq_dev_append(dx, k_dev, stride, 5);
    CHECK(st == TKV_ERR_INVALID_ARG && strstr(tkv_last_error(), "row 2"),
          "D=%u: an infinite key: %s (%s)", D, tkv_status_str(st), tkv_last_error());
    CHECK(tkv_rabitq_dev_size(dx) == 0, "D=%u: the bad batch was kept", D);
    CHECK(tkv_rabitq_dev_append(dx, k_dev + 3 * stride, stride, 5) == TKV_OK, "D=%u: a good batch after: %s", D,
          tkv_last_error());

    tkv_rabitq_dev_free(dx);
    be->ops->release(be, est_dev);
    be->ops->release(be, bound_dev);
    be->ops->release(be, k_dev);
    tkv_rabitq_free(ix);
    free(k), free(off), free(gain), free(q), free(est), free(bound);
}

/* ---- rabitq_select ----------------------------------------------------------- */

enum shape { RANDOM, PEAKED, FLAT, TIES };
static const char *const shape_name[] = {"random", "peaked", "flat", "ties"};
static uint64_t sel_symdiff, sel_pairs, sel_keys, sel_coarse_extra;

struct sel_case {
    uint32_t n, G, dim;
    enum shape shape;
    bool safe;
    uint32_t n_forced;
    float extra_lse, p;
};

static double log_value(double s, double d, double p) { return s + d + log(p + (1 - p) * exp(-2 * d)); }

static void run_select(const struct sel_case *c)
{
    enum { MAXD = 512 };
    const uint32_t D = c->dim, n = c->n, G = c->G, words = (n + 31) / 32;
    uint16_t *k = malloc((size_t)n * D * sizeof *k);
    float *est = malloc((size_t)n * sizeof *est), *bound = malloc((size_t)n * sizeof *bound);
    static float q[TKV_RABITQ_SELECT_MAX_G][MAXD], dir[MAXD], base[4][MAXD];
    uint32_t *bm1 = calloc((size_t)G * words, 4), *bmG = calloc(words, 4), *bmW = calloc(words, 4), *bm2 = calloc(words, 4);
    uint32_t *bmC = calloc((size_t)G * words, 4); /* coarse, one query head per row */
    uint32_t *pos = malloc((size_t)n * sizeof *pos), nch[TKV_RABITQ_SELECT_MAX_G], nchG[TKV_RABITQ_SELECT_MAX_G];
    uint32_t nchC[TKV_RABITQ_SELECT_MAX_G];
    double mass[TKV_RABITQ_SELECT_MAX_G], massG[TKV_RABITQ_SELECT_MAX_G], massC[TKV_RABITQ_SELECT_MAX_G];
    const size_t wb = tkv_rabitq_topp_work_bytes(n);
    void *work = malloc(wb);
    REQUIRE_VOID(k && est && bound && bm1 && bmG && bmW && bm2 && bmC && pos && work);
    for (uint32_t i = 0; i < D; i++) {
        dir[i] = gauss();
        for (int b = 0; b < 4; b++)
            base[b][i] = gauss();
    }
    for (uint32_t r = 0; r < n; r++)
        for (uint32_t i = 0; i < D; i++) {
            float x = c->shape == FLAT ? base[0][i] : c->shape == TIES ? base[r % 4][i] : gauss();
            if (c->shape == PEAKED && r % 997 == 5)
                x += 2.5f * dir[i]; /* a few needles along the query */
            k[(size_t)r * D + i] = tkv_fp32_to_fp16(x);
        }
    struct tkv_rabitq *ix = NULL;
    struct tkv_rabitq_mean mk;
    float ck[MAXD];
    REQUIRE_VOID(tkv_rabitq_init(D, 0xabcull + n, &ix) == TKV_OK);
    tkv_rabitq_mean_init(&mk, D);
    tkv_rabitq_mean_add_f16(&mk, k, D, TKV_MIN(n, 4096u));
    tkv_rabitq_mean_get(&mk, ck);
    REQUIRE_VOID(tkv_rabitq_set_centroids(ix, ck, NULL) == TKV_OK && tkv_rabitq_reserve(ix, n) == TKV_OK &&
                 tkv_rabitq_append_f16(ix, k, D, n) == TKV_OK);
    uint16_t *k_dev = to_device(k, (size_t)n * D * sizeof *k);
    struct tkv_rabitq_dev_index *dx = NULL;
    REQUIRE_VOID(k_dev && tkv_rabitq_dev_create(be, ix, n, &dx) == TKV_OK && tkv_rabitq_dev_append(dx, k_dev, D, n) == TKV_OK);
    struct tkv_rabitq_query qq[TKV_RABITQ_SELECT_MAX_G];
    for (uint32_t j = 0; j < G; j++) {
        const float amp = c->shape == PEAKED ? 3.0f : 1.0f + j;
        for (uint32_t i = 0; i < D; i++)
            q[j][i] = amp * (c->shape == PEAKED ? dir[i] + 0.3f * gauss() : gauss());
        REQUIRE_VOID(tkv_rabitq_query_prepare(ix, q[j], 0, &qq[j]) == TKV_OK);
    }
    /* forced ranges: sinks, one or two in the middle, the recent end */
    struct tkv_rabitq_select_head h1[TKV_RABITQ_SELECT_MAX_G], hG;
    memset(&hG, 0, sizeof hG);
    hG.ix = tkv_rabitq_dev_arrays(dx), hG.q = qq, hG.n = n;
    uint32_t cuts[8] = {0, n / 50, n / 3, n / 3 + n / 40, n / 2, n / 2 + 3, n - n / 30, n};
    for (int x = 1; x < 8; x++) /* ascending, within [0, n] */
        cuts[x] = TKV_MIN(TKV_MAX(cuts[x], cuts[x - 1]), n);
    static const uint32_t pick[5][4] = {{0}, {6}, {0, 6}, {0, 2, 6}, {0, 2, 4, 6}};
    for (uint32_t f = 0; f < c->n_forced; f++) {
        const uint32_t x = pick[c->n_forced][f];
        if (cuts[x + 1] > cuts[x])
            hG.forced[hG.n_forced++] = (struct tkv_rabitq_select_range){cuts[x], cuts[x + 1]};
    }
    struct tkv_range forced[TKV_RABITQ_SELECT_MAX_FORCED];
    for (uint32_t f = 0; f < hG.n_forced; f++)
        forced[f] = (struct tkv_range){hG.forced[f].begin, hG.forced[f].end};
    for (uint32_t j = 0; j < G; j++)
        h1[j] = hG, h1[j].q = &qq[j];
    const float scale = 1.0f / sqrtf((float)D);
    struct tkv_rabitq_select_args a = {.heads = h1, .n_heads = G, .G = 1, .p = c->p, .scale = scale,
                                       .extra_lse = c->extra_lse, .safe = c->safe, .bitmap = bm1, .words = words,
                                       .n_chosen = nch, .mass = mass};
    tkv_status st = be->ops->rabitq_select(be, &a);
    CHECK(st == TKV_OK, "select n=%u: %s", n, tkv_last_error());
    const struct tkv_rabitq_select_args aG = {.heads = &hG, .n_heads = 1, .G = G, .p = c->p, .scale = scale,
                                              .extra_lse = c->extra_lse, .safe = c->safe, .bitmap = bmG,
                                              .words = words, .n_chosen = nchG, .mass = massG};
    CHECK(be->ops->rabitq_select(be, &aG) == TKV_OK, "select G=%u: %s", G, tkv_last_error());
    struct tkv_rabitq_select_args aW = aG;
    const uint32_t WW = c->safe ? 64 : 16; /* a KV block, or the decode kernel's chunk of keys */
    aW.bitmap = bmW, aW.whole = WW;
    CHECK(be->ops->rabitq_select(be, &aW) == TKV_OK, "select whole: %s", tkv_last_error());
    struct tkv_rabitq_select_args aC = a;
    aC.coarse = true, aC.bitmap = bmC, aC.n_chosen = nchC, aC.mass = massC;
    CHECK(be->ops->rabitq_select(be, &aC) == TKV_OK, "select coarse: %s", tkv_last_error());
    struct tkv_rabitq_select_args a2 = aG;
    a2.bitmap = bm2;
    CHECK(be->ops->rabitq_select(be, &a2) == TKV_OK, "select again: %s", tkv_last_error());
    CHECK(!memcmp(bm2, bmG, (size_t)words * 4), "n=%u: a second call gave other bits", n);
    /* 19 heads in one call (more than one launch of the CUDA kernels takes,
     * 8), head i the call a's head i % G: every head's row, count and mass
     * a's bit for bit */
    enum { NM = 19 };
    struct tkv_rabitq_select_head hM[NM];
    uint32_t *bmM = calloc((size_t)NM * words, 4), nchM[NM];
    double massM[NM];
    REQUIRE_VOID(bmM);
    for (uint32_t i = 0; i < NM; i++)
        hM[i] = h1[i % G];
    struct tkv_rabitq_select_args aM = a;
    aM.heads = hM, aM.n_heads = NM, aM.bitmap = bmM, aM.n_chosen = nchM, aM.mass = massM;
    CHECK(be->ops->rabitq_select(be, &aM) == TKV_OK, "select %u heads: %s", NM, tkv_last_error());
    for (uint32_t i = 0; i < NM; i++)
        CHECK(!memcmp(bmM + (size_t)i * words, bm1 + (size_t)(i % G) * words, (size_t)words * 4) &&
                  nchM[i] == nch[i % G] && !memcmp(&massM[i], &mass[i % G], sizeof mass[0]),
              "n=%u: head %u of %u differs from its twin in a call of %u", n, i, NM, G);
    free(bmM);

    const double p = c->p, lp = 1 - p;
    char what[96];
    snprintf(what, sizeof what, "%s n=%u G=%u %s forced=%u lse=%g p=%g", shape_name[c->shape], n, G,
             c->safe ? "safe" : "plain", hG.n_forced, (double)c->extra_lse, p);
    for (uint32_t j = 0; j < G; j++) {
        const uint32_t *row = bm1 + (size_t)j * words;
        REQUIRE_VOID(tkv_rabitq_estimate(ix, &qq[j], 0, n, est, bound) == TKV_OK);
        if (!c->safe)
            memset(bound, 0, (size_t)n * sizeof *bound);
        double M = c->extra_lse;
        for (uint32_t i = 0; i < n; i++)
            M = fmax(M, (double)(scale * est[i]) + (double)(scale * bound[i]));
        double N = exp((double)c->extra_lse - M), C = 0, kept_min = INFINITY, drop_max = -INFINITY;
        uint32_t kept_arg = UINT32_MAX, drop_arg = UINT32_MAX, cnt = 0, bad_forced = 0, r = 0;
        for (uint32_t i = 0; i < n; i++) {
            const bool kept = row[i / 32] >> (i % 32) & 1;
            while (r < hG.n_forced && forced[r].end <= i)
                r++;
            const bool f = r < hG.n_forced && forced[r].begin <= i;
            const double s = (double)(scale * est[i]), d = (double)(scale * bound[i]);
            bad_forced += f && !kept;
            if (kept)
                N += exp(s - d - M);
            else
                C += exp(s + d - M);
            if (f)
                continue;
            const double g = c->safe ? log_value(s, d, p) : s;
            if (kept) {
                cnt++;
                if (g < kept_min || (g == kept_min && i > kept_arg)) /* the last taken: smallest g, then latest */
                    kept_min = g, kept_arg = i;
            } else if (g > drop_max || (g == drop_max && i < drop_arg)) {
                drop_max = g, drop_arg = i;
            }
        }
        CHECK(bad_forced == 0, "%s: %u forced keys dropped", what, bad_forced);
        CHECK(nch[j] == cnt, "%s q%u: n_chosen %u, %u kept candidates", what, j, nch[j], cnt);
        const double tol = c->safe ? 1e-5 * fmax(1.0, fabs(kept_min)) : 0.0;
        CHECK(kept_arg == UINT32_MAX || drop_arg == UINT32_MAX || kept_min > drop_max + tol ||
                  (fabs(kept_min - drop_max) <= tol && (c->safe || kept_arg < drop_arg)),
              "%s q%u: kept key %u (g %.9g) after dropped key %u (g %.9g)", what, j, kept_arg, kept_min, drop_arg,
              drop_max);
        const double mk = N / (N + C);
        CHECK(mk >= p - 1e-6, "%s q%u: kept mass %.9f < p", what, j, mk);
        CHECK(fabs(mk - mass[j]) <= 1e-5, "%s q%u: device mass %.9f, recomputed %.9f", what, j, mass[j], mk);
        if (kept_arg != UINT32_MAX) { /* minimal: without the last key taken the rule fails */
            const double s = (double)(scale * est[kept_arg]), d = (double)(scale * bound[kept_arg]);
            const double N2 = N - exp(s - d - M), C2 = C + exp(s + d - M);
            CHECK(lp * N2 < p * C2 * (1 + 1e-6) + 1e-12, "%s q%u: not minimal: %.9f without key %u", what, j,
                  N2 / (N2 + C2), kept_arg);
        }
        /* the host's set */
        const struct tkv_rabitq_topp_params tp = {.p = c->p, .scale = scale, .extra_lse = c->extra_lse,
                                                  .forced = forced, .n_forced = hG.n_forced};
        struct tkv_rabitq_topp_result res;
        REQUIRE_VOID(tkv_rabitq_select_topp(est, c->safe ? bound : NULL, n, &tp, work, wb, pos, n, &res) == TKV_OK);
        uint32_t x = 0, diff = 0;
        for (uint32_t i = 0; i < n; i++) {
            const bool host = x < res.n_pos && pos[x] == i;
            x += host;
            diff += host != (bool)(row[i / 32] >> (i % 32) & 1);
        }
        sel_symdiff += diff, sel_pairs++, sel_keys += n;
        CHECK(diff <= 4 + n / 100000, "%s q%u: %u keys differ from the host's top-p (%u vs %u chosen)", what, j, diff,
              cnt, res.n_chosen);
        /* coarse: a superset of the exact set, n_chosen its count, a kept
         * mass >= p, and the host's coarse set but for as many keys as the
         * exact sets may differ by */
        const uint32_t *rowC = bmC + (size_t)j * words;
        struct tkv_rabitq_topp_params tc = tp;
        tc.coarse = true;
        REQUIRE_VOID(tkv_rabitq_select_topp(est, c->safe ? bound : NULL, n, &tc, work, wb, pos, n, &res) == TKV_OK);
        uint32_t lost = 0, cntC = 0, diffC = 0;
        double NC = exp((double)c->extra_lse - M), CC = 0;
        x = 0, r = 0;
        for (uint32_t i = 0; i < n; i++) {
            const bool kc = rowC[i / 32] >> (i % 32) & 1, host = x < res.n_pos && pos[x] == i;
            x += host;
            diffC += host != kc;
            lost += (row[i / 32] >> (i % 32) & 1) && !kc;
            while (r < hG.n_forced && forced[r].end <= i)
                r++;
            cntC += kc && !(r < hG.n_forced && forced[r].begin <= i);
            const double s = (double)(scale * est[i]), d = (double)(scale * bound[i]);
            if (kc)
                NC += exp(s - d - M);
            else
                CC += exp(s + d - M);
        }
        sel_coarse_extra += cntC > cnt ? cntC - cnt : 0;
        CHECK(lost == 0, "%s q%u: coarse dropped %u keys of the exact set", what, j, lost);
        CHECK(nchC[j] == cntC, "%s q%u: coarse n_chosen %u, %u kept candidates", what, j, nchC[j], cntC);
        CHECK(NC / (NC + CC) >= p - 1e-6, "%s q%u: coarse kept mass %.9f < p", what, j, NC / (NC + CC));
        CHECK(diffC <= 4 + n / 100000, "%s q%u: coarse: %u keys differ from the host's (%u vs %u chosen)", what, j,
              diffC, cntC, res.n_chosen);
    }
    /* the union of the G calls, and its widening */
    uint32_t bad_or = 0, bad_whole = 0;
    for (uint32_t w = 0; w < words; w++) {
        uint32_t u = 0;
        for (uint32_t j = 0; j < G; j++)
            u |= bm1[(size_t)j * words + w];
        bad_or += u != bmG[w];
    }
    for (uint32_t b0 = 0; b0 < n; b0 += WW) {
        bool any = false;
        for (uint32_t i = b0; i < TKV_MIN(b0 + WW, n); i++)
            any |= bmG[i / 32] >> (i % 32) & 1;
        for (uint32_t i = b0; i < TKV_MIN(b0 + WW, n); i++)
            bad_whole += (bool)(bmW[i / 32] >> (i % 32) & 1) != any;
    }
    CHECK(bad_or == 0, "%s: the G-query call is not the OR of the single calls (%u words)", what, bad_or);
    CHECK(bad_whole == 0, "%s: whole=%u widened %u positions wrongly", what, WW, bad_whole);
    CHECK(n % 32 == 0 || !(bmW[words - 1] >> (n % 32)), "%s: bits past n", what);
    tkv_rabitq_dev_free(dx);
    be->ops->release(be, k_dev);
    tkv_rabitq_free(ix);
    free(k), free(est), free(bound), free(bm1), free(bmG), free(bmW), free(bm2), free(bmC), free(pos), free(work);
}

static void test_select(void)
{
    REQUIRE_VOID(be->ops->rabitq_select);
    static const uint32_t ns[] = {1, 7, 100, 5000, 65537, 200000};
    uint32_t t = 0;
    for (size_t a = 0; a < sizeof ns / sizeof *ns; a++)
        for (int shape = RANDOM; shape <= TIES; shape++)
            for (int safe = 0; safe <= 1; safe++, t++) {
                static const uint32_t dims[] = {128, 64, 256, 512, 96}; /* dim_pad 64 .. 512: the estimate's chunks */
                const struct sel_case c = {.n = ns[a], .G = 1 + t % 8, .dim = dims[t / 2 % 5],
                                           .shape = (enum shape)shape, .safe = safe != 0,
                                           .n_forced = t % 5, .extra_lse = t % 3 == 2 ? 2.0f : -INFINITY,
                                           .p = t % 4 == 3 ? 0.99f : t % 4 == 1 ? 1.0f : 0.9f};
                run_select(&c);
            }
    fprintf(stderr, "rabitq_select: %llu query heads, %llu keys: %llu differ from the host's top-p; coarse keeps "
            "%llu keys more\n", (unsigned long long)sel_pairs, (unsigned long long)sel_keys,
            (unsigned long long)sel_symdiff, (unsigned long long)sel_coarse_extra);
}

/* rabitq_key_sums: per element the exact sums of the finite f16 of every
 * span (units of 2^-24) and the count of the others, as the reference has
 * them, added into what the arrays held; spans of 0 .. 200 rows (several
 * blocks of the grid each) scattered in device memory, rows wider than dim;
 * bad arguments refused. */
static void test_key_sums(void)
{
    enum { NS = 40, MAXR = 200, STRIDE = 520 };
    REQUIRE_VOID(be->ops->rabitq_key_sums);
    const uint32_t dims[] = {64, 96, 128, 256, 512};
    for (size_t di = 0; di < sizeof dims / sizeof *dims; di++) {
        const uint32_t dim = dims[di];
        const size_t stride = dim == 512 ? 512 : STRIDE;
        struct tkv_rabitq_span spans[NS];
        void *dev[NS] = {0};
        long double ref[TKV_RABITQ_MAX_DIM] = {0};
        uint32_t bad_ref[TKV_RABITQ_MAX_DIM] = {0}, bad[TKV_RABITQ_MAX_DIM];
        int64_t units[TKV_RABITQ_MAX_DIM];
        uint16_t *rows = malloc((size_t)MAXR * stride * sizeof *rows);
        REQUIRE_VOID(rows);
        for (uint32_t x = 0; x < NS; x++) {
            const uint32_t n = x % 7 == 3 ? 0 : (uint32_t)(test_rand_u64(&rng) % (MAXR + 1));
            ks_rows(&rng, rows, n, stride, dim, di % 2 == 1);
            ks_reference(rows, n, stride, dim, ref, bad_ref);
            dev[x] = n ? to_device(rows, (size_t)n * stride * sizeof *rows) : NULL;
            REQUIRE_VOID(!n || dev[x]);
            spans[x] = (struct tkv_rabitq_span){dev[x], n};
        }
        for (uint32_t d = 0; d < dim; d++) /* the op adds into what the arrays hold */
            units[d] = (int64_t)d - 7, bad[d] = d % 3;
        tkv_status st = be->ops->rabitq_key_sums(be, spans, NS, stride, dim, units, bad);
        CHECK(st == TKV_OK, "key_sums dim %u: %s", dim, tkv_last_error());
        uint32_t wrong = 0, nbad = 0;
        for (uint32_t d = 0; d < dim; d++) {
            wrong += ldexpl((long double)(units[d] - ((int64_t)d - 7)), -24) != ref[d] || bad[d] - d % 3 != bad_ref[d];
            nbad += bad_ref[d];
        }
        CHECK(wrong == 0, "key_sums dim %u: %u of %u elements differ from the exact sums", dim, wrong, dim);
        fprintf(stderr, "  key sums dim %u: %u spans, %u values not finite, %u elements differ\n", dim, NS, nbad,
                wrong);
        for (uint32_t x = 0; x < NS; x++)
            if (dev[x])
                be->ops->release(be, dev[x]);
        free(rows);
    }
    int64_t u[TKV_RABITQ_MAX_DIM];
    uint32_t b[TKV_RABITQ_MAX_DIM];
    const struct tkv_rabitq_span one = {(const uint16_t *)u, 1};
    CHECK(be->ops->rabitq_key_sums(be, &one, 1, 64, 0, u, b) == TKV_ERR_INVALID_ARG &&
              be->ops->rabitq_key_sums(be, &one, 1, 64, 513, u, b) == TKV_ERR_INVALID_ARG &&
              be->ops->rabitq_key_sums(be, &one, 1, 32, 64, u, b) == TKV_ERR_INVALID_ARG,
          "key_sums: dim 0, dim 513 or a row stride below dim was not refused");
}

int main(void)
{
    rng = test_seed();
    if (tkv_backend_cuda_devices() == 0)
        SKIP("no usable CUDA device");
    REQUIRE(tkv_backend_create("cuda", 0, &be) == TKV_OK, "%s", tkv_last_error());
    /* TKV_TEST_ONLY=kv_table: the decode table's cases alone (for
     * compute-sanitizer, or a short device run) */
    const char *only = getenv("TKV_TEST_ONLY");
    if (only && !strcmp(only, "kv_table")) {
        kvt_all(be, &rng, 400);
        be->ops->free(be);
        return test_done();
    }
    struct tkv_rabitq_dev_index *dx = NULL;
    struct tkv_rabitq *ix = NULL;
    REQUIRE(tkv_rabitq_init(64, 1, &ix) == TKV_OK, "init");
    CHECK(tkv_rabitq_dev_create(be, ix, 4, &dx) == TKV_ERR_INVALID_ARG, "dev_create before centroids");
    tkv_rabitq_free(ix);
    const uint32_t dims[] = {64, 96, 128, 256};
    for (size_t i = 0; i < sizeof dims / sizeof *dims; i++) {
        run_dim(dims[i], TKV_RABITQ_ISA_SCALAR);
        enum tkv_rabitq_isa best = tkv_rabitq_isa_supported(TKV_RABITQ_ISA_AVX512) ? TKV_RABITQ_ISA_AVX512
                                   : tkv_rabitq_isa_supported(TKV_RABITQ_ISA_AVX2) ? TKV_RABITQ_ISA_AVX2
                                                                                   : TKV_RABITQ_ISA_SCALAR;
        if (best != TKV_RABITQ_ISA_SCALAR)
            run_dim(dims[i], best);
        check_spans(be, dims[i], TKV_RABITQ_ISA_SCALAR, &rng);
        if (best != TKV_RABITQ_ISA_SCALAR)
            check_spans(be, dims[i], best, &rng);
    }
    REQUIRE(be->ops->rabitq_prepare, "the CUDA backend has no rabitq_prepare");
    const uint32_t prep_dims[] = {64, 96, 128, 256, 512};
    for (size_t i = 0; i < sizeof prep_dims / sizeof *prep_dims; i++)
        for (int round = 0; round < 3; round++) { /* fresh indexes, centroids and queries each round */
            check_prepare(be, prep_dims[i], TKV_RABITQ_ISA_SCALAR, &rng);
            if (tkv_rabitq_isa_supported(TKV_RABITQ_ISA_AVX512))
                check_prepare(be, prep_dims[i], TKV_RABITQ_ISA_AVX512, &rng);
            else if (tkv_rabitq_isa_supported(TKV_RABITQ_ISA_AVX2))
                check_prepare(be, prep_dims[i], TKV_RABITQ_ISA_AVX2, &rng);
        }
    test_key_sums();
    test_select();
    /* the decode attention table from a selection and a page table, and the
     * page table's stores, against the oracle (kv-table-cases.h) */
    REQUIRE(be->ops->kv_table && be->ops->table_write, "the CUDA backend has no kv_table or table_write");
    kvt_all(be, &rng, 400);
    be->ops->free(be);
    return test_done();
}
