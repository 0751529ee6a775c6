/*
 * rabitq-prepare.h -- the check of a backend's RaBitQ query preparation
 * (the rabitq_prepare op; where the backend has none, the op's host
 * reference tkv_rabitq_host_prepare on the backend's memory, which is then
 * the host's) and of rabitq_select fed by what it prepared (the same
 * fallback to tkv_rabitq_host_select), shared by test-rabitq (the CPU
 * backend) and test-gpu-rabitq (CUDA).
 *
 * Three host indexes of head_dim D (fresh seeds, random centroids on a
 * 1/64 grid, the kernels of `isa`) and a layer's q of NH query heads in
 * backend memory, rows a padded stride apart. One call prepares every head
 * for the first two indexes and a few for the third, in a shuffled order:
 * each item's bytes must equal those tkv_rabitq_query_prepare writes for
 * the same row and index (planes past `words` zero). The rows: gaussian
 * queries of scales 1e-30 .. 1e6; q = c_q exactly (u = 0: delta 0, signed
 * zeros after the rotation); q - c_q of two values, and one-hot (ties: every
 * rotated |u| equal, levels at exact halves); a NaN, a +inf, and a q whose
 * rotation overflows (1e37): refused by the host, so poisoned
 * (tkv_rabitq_query_poison's bytes) and *bad the first of them. The third
 * index's items are group queries (rows 2-4: the rows' mean, formed here
 * as the contract words it, then prepared), or single rows.
 * Then rabitq_select over the first index's keys, groups of G = 4 of its
 * items, with the prepared queries (q_dev) and, for the groups the host can
 * prepare, with the host's (q): the same bitmap, n_chosen and mass, bit for
 * bit; a group holding a refused query reads its head whole, n_chosen
 * UINT32_MAX for that query.
 *
 * Header-only; include it in one test file after test.h.
 */
#ifndef TKV_TEST_RABITQ_PREPARE_H
#define TKV_TEST_RABITQ_PREPARE_H

#include "runtime/backend.h"
#include "runtime/rabitq/rabitq.h"
#include "runtime/tkv-impl.h"
#include "test.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { PREP_NH = 16, PREP_G = 4, PREP_IX = 3, PREP_KEYS = 3000 };

static float prep_gauss(uint64_t *rng)
{
    const float u1 = test_rand_f32(rng, 1e-7f, 1.0f), u2 = test_rand_f32(rng, 0.0f, 1.0f);
    return sqrtf(-2.0f * logf(u1)) * cosf(6.2831853f * u2);
}

/* Row h of the layer's q for index centroid cq (D values): the kinds above. */
static void prep_row(float *row, uint32_t h, uint32_t D, const float *cq, uint64_t *rng)
{
    static const float scales[] = {1e-3f, 0.1f, 1.0f, 10.0f, 1e3f, 1e6f};
    const float sc = scales[test_rand_u64(rng) % (sizeof scales / sizeof *scales)];
    for (uint32_t i = 0; i < D; i++) {
        switch (h) {
        case 0: row[i] = cq[i]; break;                                 /* u = 0                        */
        case 1: row[i] = cq[i] + (i % 3 ? 0.5f : -0.25f); break;         /* two values of q - c_q (exact) */
        case 2: row[i] = cq[i] + (i == D / 2 ? 2.0f : 0.0f); break;      /* one-hot u                    */
        case 3: row[i] = 1e-30f * prep_gauss(rng); break;               /* tiny: u ~ -c_q               */
        case 4: row[i] = i == D - 1 ? NAN : prep_gauss(rng); break;     /* refused                      */
        case 5: row[i] = i == 0 ? INFINITY : prep_gauss(rng); break;    /* refused                      */
        case 6: row[i] = 1e37f; break;                                  /* refused: the rotation overflows */
        default: row[i] = cq[i] + sc * prep_gauss(rng); break;
        }
    }
}

/* dst (host) <- n bytes of backend memory src */
static bool prep_down(struct tkv_backend *be, void *dst, const void *src, size_t n)
{
    return be->ops->download(be, dst, src, n) == TKV_OK && be->ops->synchronize(be) == TKV_OK;
}

static tkv_status prep_call(struct tkv_backend *be, const struct tkv_rabitq_prepare_args *a)
{
    return be->ops->rabitq_prepare ? be->ops->rabitq_prepare(be, a) : tkv_rabitq_host_prepare(a);
}

static tkv_status prep_select(struct tkv_backend *be, const struct tkv_rabitq_select_args *a)
{
    return be->ops->rabitq_select ? be->ops->rabitq_select(be, a) : tkv_rabitq_host_select(a);
}

static void check_prepare(struct tkv_backend *be, uint32_t D, enum tkv_rabitq_isa isa, uint64_t *rng)
{
    const size_t stride = D + 5; /* rows a padded stride apart */
    const uint32_t n_items = 2 * PREP_NH + 5, N = PREP_KEYS, words = (N + 31) / 32;
    struct tkv_rabitq *ix[PREP_IX] = {NULL};
    struct tkv_rabitq_dev_index *dx[PREP_IX] = {NULL};
    float *q = malloc(PREP_NH * stride * sizeof *q), *cq = malloc(PREP_IX * D * sizeof *cq);
    float *ck = malloc(D * sizeof *ck);
    uint16_t *k = malloc((size_t)N * D * sizeof *k);
    struct tkv_rabitq_prepare_item items[2 * PREP_NH + 5];
    uint32_t ix_of[2 * PREP_NH + 5];
    struct tkv_rabitq_dev_query *got = malloc(n_items * sizeof *got), want;
    REQUIRE_VOID(q && cq && ck && k && got);
    for (uint32_t j = 0; j < PREP_IX; j++) {
        for (uint32_t i = 0; i < D; i++) {
            ck[i] = (float)((int)(test_rand_u64(rng) % 257) - 128) / 64.0f;
            cq[j * D + i] = (float)((int)(test_rand_u64(rng) % 257) - 128) / 64.0f;
        }
        REQUIRE_VOID(tkv_rabitq_init(D, test_rand_u64(rng), &ix[j]) == TKV_OK &&
                     tkv_rabitq_set_isa(ix[j], isa) == TKV_OK &&
                     tkv_rabitq_set_centroids(ix[j], ck, cq + (size_t)j * D) == TKV_OK);
        REQUIRE_VOID(tkv_rabitq_dev_create(be, ix[j], j == 0 ? N : 1, &dx[j]) == TKV_OK);
    }
    for (uint32_t h = 0; h < PREP_NH; h++)
        prep_row(q + h * stride, h, D, cq, rng); /* the special rows are made for index 0's c_q */
    /* items: index 0's heads shuffled, index 1's in order, five of index 2's */
    uint32_t perm[PREP_NH];
    for (uint32_t h = 0; h < PREP_NH; h++)
        perm[h] = h;
    for (uint32_t h = PREP_NH - 1; h > 0; h--) {
        const uint32_t j = (uint32_t)(test_rand_u64(rng) % (h + 1)), t = perm[h];
        perm[h] = perm[j], perm[j] = t;
    }
    for (uint32_t i = 0; i < n_items; i++) {
        ix_of[i] = i < PREP_NH ? 0 : i < 2 * PREP_NH ? 1 : 2;
        /* index 2's items are group queries of 1-4 rows (rows 0 and 1: one row) */
        const uint32_t rows = i < 2 * PREP_NH ? 0 : i % 5;
        const uint32_t head = i < PREP_NH       ? perm[i]
                              : i < 2 * PREP_NH ? i - PREP_NH
                                                : (i * 7) % (PREP_NH - TKV_MAX(rows, 1) + 1);
        items[i] = (struct tkv_rabitq_prepare_item){tkv_rabitq_dev_arrays(dx[ix_of[i]]), head, rows};
    }
    float *q_dev = NULL;
    struct tkv_rabitq_dev_query *out_dev = NULL;
    uint32_t *bad_dev = NULL, bad = 0;
    REQUIRE_VOID(be->ops->alloc(be, PREP_NH * stride * sizeof *q, (void **)&q_dev) == TKV_OK &&
                 be->ops->upload(be, q_dev, q, PREP_NH * stride * sizeof *q) == TKV_OK &&
                 be->ops->alloc(be, n_items * sizeof *got, (void **)&out_dev) == TKV_OK &&
                 be->ops->alloc(be, sizeof bad, (void **)&bad_dev) == TKV_OK);
    const float eps0 = test_rand_u64(rng) % 2 ? 1.5f : 0.0f;
    const struct tkv_rabitq_prepare_args pa = {.q = q_dev, .head_stride = stride, .items = items, .n = n_items,
                                               .eps0 = eps0, .out = out_dev, .bad = bad_dev};
    tkv_status st = prep_call(be, &pa);
    CHECK(st == TKV_OK, "D=%u: rabitq_prepare: %s", D, tkv_last_error());
    REQUIRE_VOID(prep_down(be, got, out_dev, n_items * sizeof *got) && prep_down(be, &bad, bad_dev, sizeof bad));

    /* every item against tkv_rabitq_query_prepare */
    uint32_t first_bad = UINT32_MAX, n_diff = 0, n_refused = 0;
    bool refused[2 * PREP_NH + 5];
    struct tkv_rabitq_query host_q[PREP_NH];
    for (uint32_t i = 0; i < n_items; i++) {
        const float *row = q + items[i].head * stride;
        float mean[TKV_RABITQ_MAX_DIM];
        if (items[i].rows > 1) { /* a group query: the rows summed in order in f32, divided once */
            for (uint32_t d = 0; d < D; d++) {
                float sum = row[d];
                for (uint32_t j = 1; j < items[i].rows; j++)
                    sum += row[j * stride + d];
                mean[d] = sum / (float)items[i].rows;
            }
            row = mean;
        }
        struct tkv_rabitq_query qq;
        refused[i] = tkv_rabitq_query_prepare(ix[ix_of[i]], row, eps0, &qq) != TKV_OK;
        if (refused[i]) {
            struct tkv_rabitq_arrays ar;
            tkv_rabitq_get_arrays(ix[ix_of[i]], &ar);
            tkv_rabitq_query_poison(ar.dim_pad, eps0, &want);
            first_bad = first_bad == UINT32_MAX ? i : first_bad;
            n_refused++;
        } else {
            tkv_rabitq_query_to_dev(&qq, &want);
            if (i < PREP_NH)
                host_q[i] = qq;
        }
        if (memcmp(&got[i], &want, sizeof want)) {
            const uint8_t *g = (const uint8_t *)&got[i], *w = (const uint8_t *)&want;
            size_t b = 0;
            while (g[b] == w[b])
                b++;
            if (n_diff++ < 4)
                fprintf(stderr, "  D=%u %s item %u (index %u, head %u, rows %u%s): first difference at byte %zu of %zu\n",
                        D, tkv_rabitq_isa_name(isa), i, ix_of[i], items[i].head, items[i].rows,
                        refused[i] ? ", refused" : "", b, sizeof want);
        }
    }
    CHECK(n_diff == 0, "D=%u %s: %u of %u prepared queries differ from tkv_rabitq_query_prepare's", D,
          tkv_rabitq_isa_name(isa), n_diff, n_items);
    CHECK(n_refused >= 3 && bad == first_bad, "D=%u: %u refused, *bad = %u, the first refused is item %u", D, n_refused,
          bad, first_bad);

    /* rabitq_select over index 0's keys: device-prepared vs host-prepared queries */
    for (uint32_t r = 0; r < N; r++)
        for (uint32_t i = 0; i < D; i++)
            k[(size_t)r * D + i] = tkv_fp32_to_fp16(ck[i] + 1.5f * prep_gauss(rng) + (r % 101 == 7 ? 2.0f : 0.0f));
    uint16_t *k_dev = NULL;
    REQUIRE_VOID(be->ops->alloc(be, (size_t)N * D * sizeof *k, (void **)&k_dev) == TKV_OK &&
                 be->ops->upload(be, k_dev, k, (size_t)N * D * sizeof *k) == TKV_OK &&
                 tkv_rabitq_dev_append(dx[0], k_dev, D, N) == TKV_OK);
    enum { NGR = PREP_NH / PREP_G };
    struct tkv_rabitq_select_head hd[NGR], hh[NGR];
    uint32_t bm_d[NGR * ((PREP_KEYS + 31) / 32)], bm_h[NGR * ((PREP_KEYS + 31) / 32)];
    uint32_t nch_d[PREP_NH], nch_h[PREP_NH], clean[NGR], n_clean = 0;
    double mass_d[PREP_NH], mass_h[PREP_NH];
    for (uint32_t g = 0; g < NGR; g++) {
        memset(&hd[g], 0, sizeof hd[g]);
        hd[g].ix = tkv_rabitq_dev_arrays(dx[0]);
        hd[g].q_dev = out_dev + g * PREP_G;
        hd[g].n = N;
        hd[g].n_forced = 2;
        hd[g].forced[0] = (struct tkv_rabitq_select_range){0, 16};
        hd[g].forced[1] = (struct tkv_rabitq_select_range){N - 32, N};
        bool ok = true;
        for (uint32_t j = 0; j < PREP_G; j++)
            ok = ok && !refused[g * PREP_G + j];
        if (ok) { /* the same head with the host's queries */
            hh[n_clean] = hd[g];
            hh[n_clean].q_dev = NULL;
            hh[n_clean].q = &host_q[g * PREP_G];
            clean[n_clean++] = g;
        }
    }
    const bool safe = test_rand_u64(rng) % 2;
    struct tkv_rabitq_select_args sa = {.heads = hd, .n_heads = NGR, .G = PREP_G, .p = 0.9f,
                                        .scale = 1.0f / sqrtf((float)D), .extra_lse = -INFINITY, .safe = safe,
                                        .whole = test_rand_u64(rng) % 2 ? 64 : 0, .bitmap = bm_d, .words = words,
                                        .n_chosen = nch_d, .mass = mass_d};
    st = prep_select(be, &sa);
    CHECK(st == TKV_OK, "D=%u: rabitq_select on prepared queries: %s", D, tkv_last_error());
    if (n_clean) {
        struct tkv_rabitq_select_args sh = sa;
        sh.heads = hh, sh.n_heads = n_clean, sh.bitmap = bm_h, sh.n_chosen = nch_h, sh.mass = mass_h;
        st = prep_select(be, &sh);
        CHECK(st == TKV_OK, "D=%u: rabitq_select on host-prepared queries: %s", D, tkv_last_error());
    }
    for (uint32_t c = 0, g = 0; g < NGR; g++) {
        const uint32_t *row = bm_d + (size_t)g * words;
        if (c < n_clean && clean[c] == g) {
            CHECK(!memcmp(row, bm_h + (size_t)c * words, words * sizeof *row) &&
                      !memcmp(nch_d + g * PREP_G, nch_h + c * PREP_G, PREP_G * sizeof *nch_d) &&
                      !memcmp(mass_d + g * PREP_G, mass_h + c * PREP_G, PREP_G * sizeof *mass_d),
                  "D=%u %s: group %u selects otherwise with the device's queries than with the host's", D,
                  safe ? "safe" : "plain", g);
            c++;
            continue;
        }
        uint32_t whole = 0, refused_nch = 0;
        for (uint32_t x = 0; x < N; x++)
            whole += row[x / 32] >> (x % 32) & 1;
        for (uint32_t j = 0; j < PREP_G; j++)
            refused_nch += refused[g * PREP_G + j] && nch_d[g * PREP_G + j] == UINT32_MAX;
        uint32_t want_nch = 0;
        for (uint32_t j = 0; j < PREP_G; j++)
            want_nch += refused[g * PREP_G + j];
        CHECK(whole == N && refused_nch == want_nch,
              "D=%u: group %u with a refused query: %u of %u keys kept, %u of %u n_chosen = UINT32_MAX", D, g, whole,
              N, refused_nch, want_nch);
    }
    be->ops->release(be, k_dev);
    be->ops->release(be, q_dev);
    be->ops->release(be, out_dev);
    be->ops->release(be, bad_dev);
    for (uint32_t j = 0; j < PREP_IX; j++) {
        tkv_rabitq_dev_free(dx[j]);
        tkv_rabitq_free(ix[j]);
    }
    free(q), free(cq), free(ck), free(k), free(got);
}

#endif
