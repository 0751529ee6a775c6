/*
 * rabitq-spans.h -- the check of a backend's batched RaBitQ encode (the
 * rabitq_encode op over many spans, through tkv_rabitq_dev_append_spans),
 * shared by test-rabitq (the CPU backend) and test-gpu-rabitq (CUDA).
 *
 * Keys in spans of odd sizes (1 .. 200 rows, some empty), each span's rows
 * at its own place in backend memory (spans laid out in reverse, with a
 * poisoned gap in every row), appended to three twins of one host index:
 * one dev_append per span; dev_append_spans over all spans at once; and
 * dev_append_spans in three calls whose first key is not 0. The codes,
 * popcounts and scalars of all three must equal the host index's
 * (tkv_rabitq_append_f16 per span) byte for byte. Then non-finite keys in
 * the middle of a call: refused with TKV_ERR_INVALID_ARG naming the first
 * one (its key index, span and row), the twin's size unchanged, and the
 * same call with the key repaired gives the host's bytes.
 *
 * Header-only; include it in one test file after test.h.
 */
#ifndef TKV_TEST_RABITQ_SPANS_H
#define TKV_TEST_RABITQ_SPANS_H

#include "runtime/backend.h"
#include "runtime/rabitq/rabitq.h"
#include "runtime/tkv-impl.h"
#include "test.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Whether the twin's first n keys are the host index's, byte for byte. */
static bool spans_same(struct tkv_backend *be, const struct tkv_rabitq_dev_index *dx, const struct tkv_rabitq *ix,
                       uint32_t n, const char *what, uint32_t D)
{
    struct tkv_rabitq_arrays h;
    tkv_rabitq_get_arrays(ix, &h);
    const struct tkv_rabitq_dev *d = tkv_rabitq_dev_arrays(dx);
    const struct { const void *dev, *host; size_t bytes; const char *name; } arr[] = {
        {d->code, h.code, (size_t)n * h.words * sizeof *h.code, "codes"},
        {d->pc, h.pc, (size_t)n * sizeof *h.pc, "popcounts"},
        {d->a, h.a, (size_t)n * sizeof *h.a, "scalars a"},
        {d->e, h.e, (size_t)n * sizeof *h.e, "scalars e"},
        {d->t, h.t, (size_t)n * sizeof *h.t, "scalars t"},
    };
    bool all = true;
    for (size_t j = 0; j < sizeof arr / sizeof *arr; j++) {
        uint8_t *got = malloc(arr[j].bytes ? arr[j].bytes : 1);
        bool ok = got && be->ops->download(be, got, arr[j].dev, arr[j].bytes) == TKV_OK &&
                  be->ops->synchronize(be) == TKV_OK && memcmp(got, arr[j].host, arr[j].bytes) == 0;
        if (!ok && got) {
            size_t i = 0;
            while (i < arr[j].bytes && got[i] == ((const uint8_t *)arr[j].host)[i])
                i++;
            fprintf(stderr, "  D=%u %s %s: first difference at byte %zu of %zu\n", D, what, arr[j].name, i,
                    arr[j].bytes);
        }
        free(got);
        CHECK(ok, "D=%u %s: %s differ from the host index's", D, what, arr[j].name);
        all = all && ok;
    }
    return all;
}

static void check_spans(struct tkv_backend *be, uint32_t D, enum tkv_rabitq_isa isa, uint64_t *rng)
{
    enum { NS = 160 };
    const size_t stride = D + 8;
    uint32_t len[NS], n = 0;
    for (uint32_t s = 0; s < NS; s++) { /* odd sizes, a few whole 64-row blocks, some empty */
        const uint32_t r = (uint32_t)(test_rand_u64(rng) % 8);
        len[s] = s % 23 == 5 ? 0 : r == 0 ? 64 : r == 1 ? 1 : (uint32_t)(test_rand_u64(rng) % 200) + 1;
        n += len[s];
    }
    /* span s's rows at off[s]: the spans in reverse order in memory */
    size_t *off = malloc(NS * sizeof *off), rows = 0;
    for (uint32_t s = NS; s-- > 0;)
        off[s] = rows, rows += len[s];
    uint16_t *k = malloc(rows * stride * sizeof *k);
    float gain[TKV_RABITQ_MAX_DIM], ck[TKV_RABITQ_MAX_DIM], cq[TKV_RABITQ_MAX_DIM];
    REQUIRE_VOID(off && k);
    for (uint32_t i = 0; i < D; i++) {
        gain[i] = i % 13 == 4 ? 5.0f : test_rand_f32(rng, 0.2f, 2.0f);
        ck[i] = test_rand_f32(rng, -0.5f, 0.5f);
        cq[i] = test_rand_f32(rng, -1.0f, 1.0f);
    }
    for (size_t r = 0; r < rows; r++)
        for (size_t i = 0; i < stride; i++)
            k[r * stride + i] =
                tkv_fp32_to_fp16(i < D ? ck[i] + gain[i] * test_rand_f32(rng, -1.0f, 1.0f) : NAN); /* gap: poison */

    /* the host reference: one append_f16 per span */
    struct tkv_rabitq *ix = NULL;
    REQUIRE_VOID(tkv_rabitq_init(D, 0xb10cull + D, &ix) == TKV_OK);
    CHECK(tkv_rabitq_set_isa(ix, isa) == TKV_OK, "isa %s", tkv_rabitq_isa_name(isa));
    REQUIRE_VOID(tkv_rabitq_set_centroids(ix, ck, cq) == TKV_OK && tkv_rabitq_reserve(ix, n) == TKV_OK);
    for (uint32_t s = 0; s < NS; s++)
        REQUIRE_VOID(tkv_rabitq_append_f16(ix, k + off[s] * stride, stride, len[s]) == TKV_OK);

    uint16_t *k_dev = NULL;
    REQUIRE_VOID(be->ops->alloc(be, rows * stride * sizeof *k, (void **)&k_dev) == TKV_OK &&
                 be->ops->upload(be, k_dev, k, rows * stride * sizeof *k) == TKV_OK);
    struct tkv_rabitq_span sp[NS];
    for (uint32_t s = 0; s < NS; s++)
        sp[s] = (struct tkv_rabitq_span){k_dev + off[s] * stride, len[s]};

    /* per span; all spans in one call; three calls (keys from 0, then from the middle) */
    struct tkv_rabitq_dev_index *d1 = NULL, *d2 = NULL, *d3 = NULL;
    REQUIRE_VOID(tkv_rabitq_dev_create(be, ix, n, &d1) == TKV_OK && tkv_rabitq_dev_create(be, ix, n, &d2) == TKV_OK &&
                 tkv_rabitq_dev_create(be, ix, n, &d3) == TKV_OK);
    for (uint32_t s = 0; s < NS; s++)
        CHECK(tkv_rabitq_dev_append(d1, sp[s].k, stride, sp[s].n) == TKV_OK, "D=%u: dev_append span %u: %s", D, s,
              tkv_last_error());
    CHECK(tkv_rabitq_dev_append_spans(d2, sp, NS, stride) == TKV_OK, "D=%u: dev_append_spans: %s", D,
          tkv_last_error());
    const uint32_t cut[] = {0, 1, 77, NS};
    for (int c = 0; c < 3; c++)
        CHECK(tkv_rabitq_dev_append_spans(d3, sp + cut[c], cut[c + 1] - cut[c], stride) == TKV_OK,
              "D=%u: dev_append_spans [%u, %u): %s", D, cut[c], cut[c + 1], tkv_last_error());
    CHECK(tkv_rabitq_dev_size(d1) == n && tkv_rabitq_dev_size(d2) == n && tkv_rabitq_dev_size(d3) == n,
          "D=%u: %u / %u / %u keys of %u", D, tkv_rabitq_dev_size(d1), tkv_rabitq_dev_size(d2),
          tkv_rabitq_dev_size(d3), n);
    spans_same(be, d1, ix, n, "per span", D);
    spans_same(be, d2, ix, n, "one call over all spans", D);
    spans_same(be, d3, ix, n, "three calls", D);
    CHECK(tkv_rabitq_dev_append_spans(d2, sp, 1, stride) == TKV_ERR_TOO_SMALL, "D=%u: spans past the capacity", D);

    /* non-finite keys in the middle of a call: the first one named, nothing kept */
    struct tkv_rabitq_dev_index *d4 = NULL;
    REQUIRE_VOID(tkv_rabitq_dev_create(be, ix, n, &d4) == TKV_OK);
    REQUIRE_VOID(tkv_rabitq_dev_append_spans(d4, sp, 3, stride) == TKV_OK);
    uint32_t s_bad = NS / 2, at0 = 0, key = 0;
    while (s_bad + 2 < NS && len[s_bad] < 3)
        s_bad++;
    for (uint32_t s = 0; s < 3; s++)
        at0 += len[s];
    for (uint32_t s = 3; s < s_bad; s++)
        key += len[s];
    const uint32_t row = len[s_bad] / 2;
    key += at0 + row;
    uint16_t *bad = k + (off[s_bad] + row) * stride, *later = k + (off[NS - 1] + len[NS - 1] - 1) * stride;
    const uint16_t keep = bad[D / 3], keep2 = later[0];
    bad[D / 3] = tkv_fp32_to_fp16(INFINITY);
    later[0] = tkv_fp32_to_fp16(NAN); /* a second one, later in the call: the first is named */
    REQUIRE_VOID(be->ops->upload(be, k_dev, k, rows * stride * sizeof *k) == TKV_OK);
    tkv_status st = tkv_rabitq_dev_append_spans(d4, sp + 3, NS - 3, stride);
    char want[96];
    snprintf(want, sizeof want, "key %u (row %u of span %u)", key, row, s_bad - 3);
    CHECK(st == TKV_ERR_INVALID_ARG && strstr(tkv_last_error(), want), "D=%u: non-finite key: %s (%s), want '%s'",
          D, tkv_status_str(st), tkv_last_error(), want);
    CHECK(tkv_rabitq_dev_size(d4) == at0, "D=%u: the bad call was kept (%u keys)", D, tkv_rabitq_dev_size(d4));
    bad[D / 3] = keep, later[0] = keep2;
    REQUIRE_VOID(be->ops->upload(be, k_dev, k, rows * stride * sizeof *k) == TKV_OK);
    CHECK(tkv_rabitq_dev_append_spans(d4, sp + 3, NS - 3, stride) == TKV_OK, "D=%u: the repaired call: %s", D,
          tkv_last_error());
    spans_same(be, d4, ix, n, "after a refused call", D);

    tkv_rabitq_dev_free(d1), tkv_rabitq_dev_free(d2), tkv_rabitq_dev_free(d3), tkv_rabitq_dev_free(d4);
    be->ops->release(be, k_dev);
    tkv_rabitq_free(ix);
    free(off), free(k);
}

#endif /* TKV_TEST_RABITQ_SPANS_H */
