/*
 * kv-table-cases.h -- backend.h's kv_table and table_write checked on one
 * backend against an oracle, on fresh random inputs: blocks of several sizes
 * (1 .. 256 tokens, not all multiples of 32), contexts that end inside a
 * block, bitmaps empty, full, sparse, in runs and dense, every head's
 * selection length from 0 (the head reads everything) to the context, pages
 * resident none, all or at random, and tables too small (the counts must
 * still be whole and nothing past cap written). Shared by test-kv-table
 * (the CPU and opaque backends) and test-gpu-rabitq (CUDA). Include after
 * test.h in one file.
 */
#ifndef TKV_TEST_KV_TABLE_CASES_H
#define TKV_TEST_KV_TABLE_CASES_H

#include "runtime/backend.h"
#include "test.h"

#include <stdlib.h>
#include <string.h>

/* The oracle: per head, the read positions as ranges (the bitmap's runs,
 * then the tail merged on), each range cut at block boundaries -- as the
 * engine's ranges_to_refs cuts them -- and sent to refs or miss by the
 * block's entry. A different walk from tkv_kv_table_ref's (block by
 * block). Returns false when out of memory. */
static bool kvt_oracle(const struct tkv_kv_table_args *a, struct tkv_kv_block_ref *refs, struct tkv_kv_block_ref *miss,
                       uint32_t per_head, uint32_t *counts, uint32_t *marks)
{
    uint32_t *rb = malloc(((size_t)a->n_past + 2) * sizeof *rb), *re = malloc(((size_t)a->n_past + 2) * sizeof *re);
    if (!rb || !re) {
        free(rb), free(re);
        return false;
    }
    const uint32_t B = a->block_tokens;
    for (uint32_t h = 0; h < a->n_heads; h++) {
        const uint32_t n = a->sel_n[h];
        uint32_t m = 0;
        for (uint32_t p = 0; p < n; p++) {
            if (!((a->bitmap[(size_t)h * a->words + p / 32] >> (p % 32)) & 1))
                continue;
            if (m > 0 && re[m - 1] == p)
                re[m - 1] = p + 1;
            else
                rb[m] = p, re[m++] = p + 1;
        }
        if (n < a->n_past) {
            if (m > 0 && re[m - 1] == n)
                re[m - 1] = a->n_past;
            else
                rb[m] = n, re[m++] = a->n_past;
        }
        uint32_t nr = 0, nm = 0, np = 0, nt = 0, last = UINT32_MAX;
        for (uint32_t i = 0; i < m; i++)
            for (uint32_t p = rb[i]; p < re[i];) {
                const uint32_t b = p / B, end = re[i] < (b + 1) * B ? re[i] : (b + 1) * B;
                np += end - p;
                if (b != last) /* a block touched: its read mark (rows of mark_words, zeroed by the caller) */
                    nt++, marks[(size_t)h * a->mark_words + b / 32] |= 1u << (b % 32);
                last = b;
                const uint64_t e = a->ptab[(size_t)h * a->ptab_stride + b];
                struct tkv_kv_block_ref r = {.pos0 = (int32_t)p, .n = end - p};
                if (e) {
                    r.k = (uint16_t *)(uintptr_t)(e + 2ull * (p - b * B) * a->head_dim);
                    r.v = (uint16_t *)(uintptr_t)(e + 2ull * (p - b * B + B) * a->head_dim);
                    refs[(size_t)h * per_head + nr++] = r;
                } else {
                    miss[(size_t)h * per_head + nm++] = r;
                }
                p = end;
            }
        counts[4 * h] = nr, counts[4 * h + 1] = nm, counts[4 * h + 2] = np, counts[4 * h + 3] = nt;
    }
    free(rb), free(re);
    return true;
}

static bool kvt_ref_eq(const struct tkv_kv_block_ref *x, const struct tkv_kv_block_ref *y)
{
    return x->k == y->k && x->v == y->v && x->pos0 == y->pos0 && x->n == y->n;
}

/* One random case on backend be: sel_mode 0 empty, 1 full, 2 sparse, 3 runs,
 * 4 dense; res_mode 0 none resident, 1 all, 2 half, 3 most; cap_mode 0 room
 * for everything, 1 a few entries (overflow). The read marks are asked for
 * in three cases of four, in rows longer than needed by 0-2 words (which
 * must stay as they were). */
static void kvt_case(struct tkv_backend *be, uint64_t *rng, uint32_t B, uint32_t hd, uint32_t n_past, uint32_t H,
                     int sel_mode, int res_mode, int cap_mode)
{
    const uint32_t nb = (n_past + B - 1) / B, stride = nb + (uint32_t)(test_rand_u64(rng) % 3);
    const uint32_t words = (n_past + 31) / 32 + 1, per_head = n_past + nb + 1; /* the most slices a head can have */
    const uint32_t cap = cap_mode ? (uint32_t)(test_rand_u64(rng) % 4) : per_head;
    const uint32_t mark_used = (nb + 31) / 32, mark_words = mark_used + (uint32_t)(test_rand_u64(rng) % 3);
    const bool with_marks = test_rand_u64(rng) % 4 != 0;
    uint32_t *o_marks = calloc((size_t)H * mark_words + 1, sizeof *o_marks);
    uint32_t *d_marks = malloc(((size_t)H * mark_words + 1) * sizeof *d_marks);
    uint32_t *bitmap = calloc((size_t)H * words, sizeof *bitmap), *sel_n = malloc(H * sizeof *sel_n);
    uint64_t *ptab = malloc(((size_t)H * stride + 1) * sizeof *ptab);
    struct tkv_kv_block_ref *o_refs = calloc((size_t)H * per_head, sizeof *o_refs);
    struct tkv_kv_block_ref *o_miss = calloc((size_t)H * per_head, sizeof *o_miss);
    struct tkv_kv_block_ref *d_refs = malloc(((size_t)H * cap + 1) * sizeof *d_refs);
    struct tkv_kv_block_ref *d_miss = malloc(((size_t)H * cap + 1) * sizeof *d_miss);
    uint32_t *o_counts = malloc(4 * H * sizeof *o_counts), *d_counts = malloc(4 * H * sizeof *d_counts);
    REQUIRE_VOID(bitmap && sel_n && ptab && o_refs && o_miss && d_refs && d_miss && o_counts && d_counts && o_marks &&
                 d_marks);
    for (uint32_t h = 0; h < H; h++) {
        const uint64_t r = test_rand_u64(rng) % 6;
        sel_n[h] = r == 0 ? 0 : r == 1 ? n_past : r == 2 ? (n_past / 32) * 32 : (uint32_t)(test_rand_u64(rng) % (n_past + 1));
        uint32_t *row = bitmap + (size_t)h * words;
        for (uint32_t p = 0; p < sel_n[h];) {
            bool on;
            uint32_t len = 1;
            switch (sel_mode) {
            case 0: on = false; break;
            case 1: on = true; break;
            case 2: on = test_rand_u64(rng) % 20 == 0; break;
            case 3: on = test_rand_u64(rng) % 2; len = 1 + (uint32_t)(test_rand_u64(rng) % (2 * B + 40)); break;
            default: on = test_rand_u64(rng) % 5 != 0; break;
            }
            for (uint32_t j = 0; j < len && p < sel_n[h]; j++, p++)
                if (on)
                    row[p / 32] |= 1u << (p % 32);
        }
        for (uint32_t b = 0; b < stride; b++) {
            const uint64_t r2 = test_rand_u64(rng) % 10;
            const bool res = res_mode == 1 || (res_mode == 2 && r2 < 5) || (res_mode == 3 && r2 < 9);
            /* a fake slot address: never read through, 256-byte aligned, above 4 GiB */
            ptab[(size_t)h * stride + b] = res ? ((test_rand_u64(rng) >> 24) << 8) | (1ull << 40) : 0;
        }
    }
    struct tkv_kv_table_args a = {.bitmap = bitmap, .words = words, .sel_n = sel_n, .ptab = ptab,
                                  .ptab_stride = stride, .n_heads = H, .block_tokens = B, .head_dim = hd,
                                  .n_past = n_past, .refs = NULL, .miss = NULL, .cap = cap, .counts = NULL,
                                  .marks = NULL, .mark_words = mark_words};
    REQUIRE_VOID(kvt_oracle(&a, o_refs, o_miss, per_head, o_counts, o_marks));

    /* the same arguments in backend memory, the outputs poisoned first */
    const size_t bm_bytes = (size_t)H * words * sizeof *bitmap, pt_bytes = (size_t)H * stride * sizeof *ptab;
    const size_t out_bytes = ((size_t)H * cap + 1) * sizeof *d_refs, cnt_bytes = 4 * H * sizeof *d_counts;
    const size_t mark_bytes = ((size_t)H * mark_words + 1) * sizeof *d_marks;
    void *b_bm = NULL, *b_pt = NULL, *b_refs = NULL, *b_miss = NULL, *b_cnt = NULL, *b_marks = NULL;
    REQUIRE_VOID(be->ops->alloc(be, bm_bytes, &b_bm) == TKV_OK && be->ops->alloc(be, pt_bytes, &b_pt) == TKV_OK &&
                 be->ops->alloc(be, out_bytes, &b_refs) == TKV_OK &&
                 be->ops->alloc(be, out_bytes, &b_miss) == TKV_OK && be->ops->alloc(be, cnt_bytes, &b_cnt) == TKV_OK &&
                 be->ops->alloc(be, mark_bytes, &b_marks) == TKV_OK);
    memset(d_refs, 0xa5, out_bytes);
    memset(d_marks, 0xa5, mark_bytes);
    CHECK(be->ops->upload(be, b_bm, bitmap, bm_bytes) == TKV_OK && be->ops->upload(be, b_pt, ptab, pt_bytes) == TKV_OK &&
              be->ops->upload(be, b_refs, d_refs, out_bytes) == TKV_OK &&
              be->ops->upload(be, b_miss, d_refs, out_bytes) == TKV_OK &&
              be->ops->upload(be, b_marks, d_marks, mark_bytes) == TKV_OK,
          "%s: uploads: %s", be->ops->name, tkv_last_error());
    struct tkv_kv_table_args d = a;
    d.bitmap = b_bm, d.ptab = b_pt, d.refs = b_refs, d.miss = b_miss, d.counts = b_cnt;
    d.marks = with_marks ? b_marks : NULL;
    const tkv_status st = be->ops->kv_table(be, &d);
    CHECK(st == TKV_OK, "%s: kv_table: %s", be->ops->name, tkv_last_error());
    CHECK(be->ops->download(be, d_refs, b_refs, out_bytes) == TKV_OK &&
              be->ops->download(be, d_miss, b_miss, out_bytes) == TKV_OK &&
              be->ops->download(be, d_counts, b_cnt, cnt_bytes) == TKV_OK &&
              be->ops->download(be, d_marks, b_marks, mark_bytes) == TKV_OK,
          "%s: downloads: %s", be->ops->name, tkv_last_error());
    struct tkv_kv_block_ref poison;
    memset(&poison, 0xa5, sizeof poison);
    int bad = 0;
    for (uint32_t h = 0; h < H && bad < 4 && st == TKV_OK; h++) {
        for (int w = 2; w < 4; w++) { /* positions read, blocks touched */
            CHECK(d_counts[4 * h + w] == o_counts[4 * h + w], "%s B %u n_past %u sel %d res %d head %u: %s %u, oracle %u",
                  be->ops->name, B, n_past, sel_mode, res_mode, h, w == 2 ? "positions" : "blocks", d_counts[4 * h + w],
                  o_counts[4 * h + w]);
            bad += d_counts[4 * h + w] != o_counts[4 * h + w];
        }
        for (int w = 0; w < 2; w++) {
            const struct tkv_kv_block_ref *got = (w ? d_miss : d_refs) + (size_t)h * cap;
            const struct tkv_kv_block_ref *want = (w ? o_miss : o_refs) + (size_t)h * per_head;
            const uint32_t n = o_counts[4 * h + w];
            CHECK(d_counts[4 * h + w] == n, "%s B %u n_past %u sel %d res %d head %u: %s count %u, oracle %u",
                  be->ops->name, B, n_past, sel_mode, res_mode, h, w ? "miss" : "refs", d_counts[4 * h + w], n);
            bad += d_counts[4 * h + w] != n;
            for (uint32_t j = 0; j < cap && bad < 4; j++) {
                const bool ok = j < n ? kvt_ref_eq(&got[j], &want[j]) : !memcmp(&got[j], &poison, sizeof poison);
                CHECK(ok, "%s B %u n_past %u sel %d res %d head %u: %s[%u] {%p %p %d %u}, want %s {%p %p %d %u}",
                      be->ops->name, B, n_past, sel_mode, res_mode, h, w ? "miss" : "refs", j, (void *)got[j].k,
                      (void *)got[j].v, got[j].pos0, got[j].n, j < n ? "" : "untouched", (void *)want[j].k,
                      (void *)want[j].v, want[j].pos0, want[j].n);
                bad += !ok;
            }
        }
    }
    /* the read marks: each row's words for the blocks as the oracle's, the
     * rest (and everything without marks) as poisoned */
    for (uint32_t h = 0; h < H && bad < 4; h++)
        for (uint32_t w = 0; w < mark_words; w++) {
            const uint32_t got = d_marks[(size_t)h * mark_words + w];
            const uint32_t want = with_marks && w < mark_used ? o_marks[(size_t)h * mark_words + w] : 0xa5a5a5a5u;
            CHECK(got == want, "%s B %u n_past %u sel %d res %d head %u: marks word %u of %u (%u used) %08x, want %08x",
                  be->ops->name, B, n_past, sel_mode, res_mode, h, w, mark_words, with_marks ? mark_used : 0, got, want);
            bad += got != want;
        }
    CHECK(d_marks[(size_t)H * mark_words] == 0xa5a5a5a5u, "%s: kv_table wrote past the marks", be->ops->name);
    /* the one past the last head's cap is never written */
    CHECK(!memcmp(&d_refs[(size_t)H * cap], &poison, sizeof poison) &&
              !memcmp(&d_miss[(size_t)H * cap], &poison, sizeof poison),
          "%s: kv_table wrote past the tables", be->ops->name);
    be->ops->release(be, b_bm), be->ops->release(be, b_pt), be->ops->release(be, b_refs);
    be->ops->release(be, b_miss), be->ops->release(be, b_cnt), be->ops->release(be, b_marks);
    free(bitmap), free(sel_n), free(ptab), free(o_refs), free(o_miss), free(d_refs), free(d_miss);
    free(o_counts), free(d_counts), free(o_marks), free(d_marks);
}

/* table_write: random distinct stores into a table of n entries, in two
 * calls, against the same stores on the host. */
static void kvt_table_write(struct tkv_backend *be, uint64_t *rng, uint32_t n)
{
    uint64_t *want = malloc(n * sizeof *want), *got = malloc(n * sizeof *got), *val = malloc(n * sizeof *val);
    uint32_t *idx = malloc(n * sizeof *idx);
    void *dev = NULL;
    REQUIRE_VOID(want && got && val && idx && be->ops->alloc(be, n * sizeof *want, &dev) == TKV_OK);
    for (uint32_t i = 0; i < n; i++)
        want[i] = test_rand_u64(rng);
    CHECK(be->ops->upload(be, dev, want, n * sizeof *want) == TKV_OK, "%s", tkv_last_error());
    for (int round = 0; round < 2; round++) {
        uint32_t m = 0;
        for (uint32_t i = 0; i < n; i++)
            if (test_rand_u64(rng) % 3 == 0) {
                idx[m] = i, val[m] = test_rand_u64(rng);
                want[i] = val[m++];
            }
        for (uint32_t j = m; j > 1; j--) { /* in no particular order */
            const uint32_t k = (uint32_t)(test_rand_u64(rng) % j), ti = idx[j - 1];
            const uint64_t tv = val[j - 1];
            idx[j - 1] = idx[k], val[j - 1] = val[k], idx[k] = ti, val[k] = tv;
        }
        CHECK(be->ops->table_write(be, (uint64_t *)dev, idx, val, m) == TKV_OK, "%s: table_write: %s", be->ops->name,
              tkv_last_error());
        memset(idx, 0xff, n * sizeof *idx); /* the caller may reuse its arrays at once */
        memset(val, 0, n * sizeof *val);
    }
    CHECK(be->ops->download(be, got, dev, n * sizeof *got) == TKV_OK, "%s", tkv_last_error());
    CHECK(!memcmp(got, want, n * sizeof *got), "%s: table_write of %u entries differs", be->ops->name, n);
    be->ops->release(be, dev);
    free(want), free(got), free(val), free(idx);
}

/* Every combination once with fresh sizes, then random ones. */
static void kvt_all(struct tkv_backend *be, uint64_t *rng, int rounds)
{
    static const uint32_t Bs[] = {1, 7, 16, 32, 48, 64, 100, 128, 256};
    for (int sel = 0; sel < 5; sel++)
        for (int res = 0; res < 4; res++)
            for (int capm = 0; capm < 2; capm++) {
                const uint32_t B = Bs[test_rand_u64(rng) % (sizeof Bs / sizeof *Bs)];
                const uint32_t n_past = (uint32_t)(test_rand_u64(rng) % (B * 9 + 70));
                kvt_case(be, rng, B, 64, n_past, 1 + (uint32_t)(test_rand_u64(rng) % 8), sel, res, capm);
            }
    for (int i = 0; i < rounds; i++) {
        const uint32_t B = Bs[test_rand_u64(rng) % (sizeof Bs / sizeof *Bs)];
        const uint32_t n_past = (uint32_t)(test_rand_u64(rng) % (i % 4 == 0 ? 20000 : B * 40 + 100));
        kvt_case(be, rng, B, 64 + 64 * (uint32_t)(test_rand_u64(rng) % 2), n_past,
                 1 + (uint32_t)(test_rand_u64(rng) % 8), (int)(test_rand_u64(rng) % 5), (int)(test_rand_u64(rng) % 4),
                 test_rand_u64(rng) % 4 == 0);
    }
    kvt_case(be, rng, 64, 128, 0, 3, 4, 2, 0); /* an empty context */
    kvt_case(be, rng, 16, 64, 1000, 70, 2, 1, 0); /* more heads than one CUDA launch takes (64) */
    kvt_table_write(be, rng, 1 + (uint32_t)(test_rand_u64(rng) % 5000));
}

#endif
