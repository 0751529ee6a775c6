/*
 * test-attn-runs.c -- the decode kernel's inline block table (gpu/attn-runs.h)
 * on the host, no GPU needed.
 *
 * On fresh random views (stretches of blocks at random strides, some of
 * them the stride that joins blocks in memory; slices continuing a block;
 * refs of no rows; jumps in memory and position; misaligned rows; the last
 * query cutting a block) the stretches give exactly the runs of the
 * per-block walk, the reference; and the runs of either describe exactly
 * the rows the view holds up to the last query's position, key by key, in
 * order, with every run's blocks but the last whole and a multiple of the
 * chunk. Then the layouts the engine makes: a resident head in home-slot
 * segments (docs/kv-layout.md) is one run a segment, and a view of more
 * runs than the table holds does not fit. The rows are never read: the
 * views point into an array of addresses only.
 */
#include "gpu/attn-runs.h"
#include "test.h"

#include <stdlib.h>
#include <string.h>

static uint64_t rng;
static uint32_t rnd(uint32_t n) { return (uint32_t)(test_rand_u64(&rng) % n); }

enum { HD = 64, MAX_REFS = 256, MAX_HEADS = 8 };
static uint16_t arena[1 << 24]; /* addresses only */

/* One key as the kernel reads it. */
struct key {
    const uint16_t *k, *v;
    int32_t pos;
};

/* The keys of head g of view a up to the last query's position, as the
 * attention reads them; returns their count. */
static uint32_t view_keys(const struct tkv_attn_args *a, uint32_t g, struct key *out)
{
    const int32_t pos_max = a->q_pos[a->n_q - 1];
    uint32_t n = 0;
    for (uint32_t i = 0; i < a->kv[g].n_blocks; i++) {
        const struct tkv_kv_block_ref *x = &a->kv[g].blocks[i];
        for (uint32_t j = 0; j < x->n && x->pos0 + (int32_t)j <= pos_max; j++) {
            const size_t row = (size_t)j * a->head_dim;
            out[n++] = (struct key){x->k + row, x->v + row, x->pos0 + (int32_t)j};
        }
    }
    return n;
}

/* The keys runs [r0, r1) describe, checking each run's shape against the
 * chunk; returns their count, or UINT32_MAX on a malformed run. */
static uint32_t run_keys(const struct tkv_cuda_attn_runs *r, uint32_t r0, uint32_t r1, uint32_t chunk, size_t hd,
                         struct key *out, uint32_t *chunks)
{
    uint32_t n = 0;
    *chunks = 0;
    for (uint32_t i = r0; i < r1; i++) {
        const struct tkv_cuda_kv_run *R = &r->runs[i];
        if (R->n == 0 || R->bsz == 0 || R->c0 != *chunks || (R->n > R->bsz && R->bsz % chunk))
            return UINT32_MAX;
        for (uint32_t j = 0; j < R->n; j++) {
            const uint32_t blk = j / R->bsz, row = j % R->bsz;
            out[n++] = (struct key){R->k + (int64_t)blk * R->kstride + (size_t)row * hd,
                                    R->v + (int64_t)blk * R->vstride + (size_t)row * hd, R->pos0 + (int32_t)j};
        }
        *chunks += (R->n + chunk - 1) / chunk;
    }
    return n;
}

/* Builds a's runs both ways; true when they agree (and, where the view
 * fits, describe its keys exactly). *fits: whether it fit. */
static bool check_view(const struct tkv_attn_args *a, uint32_t chunk, bool *fits, const char *what)
{
    static struct tkv_cuda_attn_runs fast, ref;
    static struct key want[MAX_REFS * 256], got[MAX_REFS * 256];
    memset(&fast, 0, sizeof fast);
    memset(&ref, 0, sizeof ref);
    uint32_t mc_fast = 0, mc_ref = 0;
    const bool ok_fast = tkv_attn_runs_build(&fast, a, chunk, false, &mc_fast);
    const bool ok_ref = tkv_attn_runs_build(&ref, a, chunk, true, &mc_ref);
    *fits = ok_ref;
    if (ok_fast != ok_ref || (ok_ref && (mc_fast != mc_ref || memcmp(&fast, &ref, sizeof fast)))) {
        CHECK(false, "%s: the stretches give other runs than the per-block walk (fit %d / %d, max chunks %u / %u)",
              what, ok_fast, ok_ref, mc_fast, mc_ref);
        return false;
    }
    if (!ok_ref)
        return true;
    uint32_t most = 0;
    for (uint32_t g = 0; g < a->n_head_kv; g++) {
        uint32_t chunks;
        const uint32_t nw = view_keys(a, g, want);
        const uint32_t ng = run_keys(&ref, ref.run_off[g], ref.run_off[g + 1], chunk, a->head_dim, got, &chunks);
        if (ng != nw || memcmp(got, want, (size_t)nw * sizeof *want) || chunks != ref.n_chunks[g]) {
            CHECK(false, "%s: head %u: the runs hold %u keys (%u chunks, %u counted), the view %u", what, g, ng,
                  chunks, ref.n_chunks[g], nw);
            return false;
        }
        most = chunks > most ? chunks : most;
    }
    CHECK(most == mc_ref, "%s: max chunks %u, want %u", what, mc_ref, most);
    return most == mc_ref;
}

/* A random view of H heads: see the file's comment. */
static void random_view(struct tkv_kv_block_ref refs[MAX_HEADS][MAX_REFS], struct tkv_kv_head_view *views, uint32_t H,
                        uint32_t bsz)
{
    for (uint32_t h = 0; h < H; h++) {
        uint32_t n = 0;
        int32_t pos = 0;
        uint16_t *k = arena + 8 * rnd(1 << 16), *v = arena + (1 << 23) + 8 * rnd(1 << 16);
        const uint32_t want = rnd(60);
        while (n < want) {
            const uint32_t kind = rnd(8);
            if (kind <= 3) { /* a stretch at one stride (sometimes the one that joins blocks) */
                const uint32_t m = 1 + rnd(12);
                const int64_t dk = rnd(3) == 0 ? (int64_t)bsz * HD : 8 * (int64_t)(1 + rnd(3000));
                const int64_t dv = rnd(3) == 0 ? (int64_t)bsz * HD : 8 * (int64_t)(1 + rnd(3000));
                for (uint32_t j = 0; j < m && n < want; j++) {
                    const uint32_t rows = rnd(6) ? bsz : 1 + rnd(bsz);
                    refs[h][n++] = (struct tkv_kv_block_ref){k, v, pos, rows};
                    pos += (int32_t)rows;
                    k += dk, v += dv;
                    if (k >= arena + (1 << 22))
                        k = arena + 8 * rnd(1 << 16);
                    if (v >= arena + (1 << 24) - (1 << 20))
                        v = arena + (1 << 23) + 8 * rnd(1 << 16);
                }
            } else if (kind == 4 && n) { /* a slice continuing the last ref in memory */
                const struct tkv_kv_block_ref *x = &refs[h][n - 1];
                const uint32_t rows = 1 + rnd(bsz);
                refs[h][n] = (struct tkv_kv_block_ref){x->k + (size_t)x->n * HD, x->v + (size_t)x->n * HD,
                                                       x->pos0 + (int32_t)x->n, rows};
                pos = refs[h][n].pos0 + (int32_t)rows;
                k = refs[h][n].k + (size_t)rows * HD, v = refs[h][n].v + (size_t)rows * HD;
                n++;
            } else if (kind == 5) { /* a ref of no rows */
                refs[h][n++] = (struct tkv_kv_block_ref){k, v, pos, 0};
            } else { /* a jump; now and then to a misaligned row */
                pos += (int32_t)rnd(100);
                k = arena + 8 * rnd(1 << 18) + (rnd(50) == 0 ? 3 : 0);
                v = arena + (1 << 23) + 8 * rnd(1 << 18);
            }
        }
        views[h] = (struct tkv_kv_head_view){refs[h], n};
    }
}

/* Blocks of refs[0, n) that a stretch could take: whole, after two whole
 * ones at the same K stride, which is not the joining one. */
static uint32_t stretch_blocks(const struct tkv_kv_block_ref *refs, uint32_t n, uint32_t bsz)
{
    uint32_t m = 0;
    for (uint32_t i = 2; i < n; i++) {
        const int64_t d1 = refs[i].k - refs[i - 1].k, d0 = refs[i - 1].k - refs[i - 2].k;
        m += refs[i].n == bsz && refs[i - 1].n == bsz && refs[i - 2].n == bsz && d1 == d0 && d1 != (int64_t)bsz * HD;
    }
    return m;
}

int main(void)
{
    rng = test_seed();
    static struct tkv_kv_block_ref refs[MAX_HEADS][MAX_REFS];
    struct tkv_kv_head_view views[MAX_HEADS];
    int32_t q_pos[2];
    uint32_t fit = 0, cases = 20000, stretched = 0;
    for (uint32_t c = 0; c < cases && !test_failures_; c++) {
        const uint32_t H = 1 + rnd(MAX_HEADS), bsz = 16 * (1 + rnd(4)), chunk = 16 * (1 + rnd(2));
        random_view(refs, views, H, bsz);
        const uint32_t n_q = 1 + rnd(2);
        q_pos[0] = (int32_t)rnd(3000);
        q_pos[1] = q_pos[0] + (int32_t)rnd(3);
        const struct tkv_attn_args a = {.q_pos = q_pos, .n_q = n_q, .n_head = H, .n_head_kv = H, .head_dim = HD,
                                        .kv = views};
        char what[64];
        snprintf(what, sizeof what, "random view %u", c);
        bool fits;
        check_view(&a, chunk, &fits, what);
        fit += fits;
        for (uint32_t h = 0; h < H; h++)
            stretched += stretch_blocks(refs[h], views[h].n_blocks, bsz);
    }
    fprintf(stderr, "%u random views: %u fit the table, %u blocks at a stretch's stride\n", cases, fit, stretched);
    CHECK(fit > cases / 4 && fit < cases, "%u of %u random views fit: the cases miss a side", fit, cases);
    CHECK(stretched > cases, "the random views held few stretches (%u blocks)", stretched);

    /* a resident context in home segments: 8 heads of 64 + 32 blocks of 64
     * rows, each segment head after head (block stride: one block's K|V) */
    const uint32_t B = 64, S = 4 * B * HD / 2, segs[2] = {64, 32}; /* S in elements */
    uint32_t first = 0;
    for (uint32_t s = 0, b0 = 0; s < 2; b0 += segs[s], first += 8 * segs[s], s++)
        for (uint32_t h = 0; h < 8; h++)
            for (uint32_t j = 0; j < segs[s]; j++) {
                uint16_t *k = arena + (size_t)(first + h * segs[s] + j) * S;
                refs[h][b0 + j] = (struct tkv_kv_block_ref){k, k + B * HD, (int32_t)((b0 + j) * B), B};
            }
    for (uint32_t h = 0; h < 8; h++)
        views[h] = (struct tkv_kv_head_view){refs[h], 96};
    q_pos[0] = 96 * 64 - 1 - 10; /* the last block cut by the query */
    const struct tkv_attn_args home = {.q_pos = q_pos, .n_q = 1, .n_head = 32, .n_head_kv = 8, .head_dim = HD,
                                       .kv = views};
    static struct tkv_cuda_attn_runs r;
    uint32_t mc;
    bool fits;
    check_view(&home, 16, &fits, "home segments");
    CHECK(fits && tkv_attn_runs_build(&r, &home, 16, false, &mc) && r.run_off[8] == 16,
          "home segments: %u runs for 8 heads of 2 segments, want 16", r.run_off[8]);
    /* blocks at growing distances (3 j^2 units): a run every two blocks,
     * 80 for 8 heads of 20, more than the table holds */
    for (uint32_t h = 0; h < 8; h++)
        for (uint32_t j = 0; j < 20; j++) {
            uint16_t *k = arena + (size_t)(h * 2000 + 3 * j * j) * 16;
            refs[h][j] = (struct tkv_kv_block_ref){k, k + (1 << 20), (int32_t)(j * B), B};
        }
    for (uint32_t h = 0; h < 8; h++)
        views[h] = (struct tkv_kv_head_view){refs[h], 20};
    q_pos[0] = 20 * 64 - 1;
    check_view(&home, 16, &fits, "scattered blocks");
    CHECK(!fits, "160 scattered blocks fit a table of %u runs", TKV_ATTN_RUNS_MAX);
    views[0].n_blocks = views[1].n_blocks = 4; /* 2 + 2 + 6 x 10 = 64 runs: just fits */
    check_view(&home, 16, &fits, "scattered blocks, 64 runs");
    CHECK(fits, "64 runs do not fit a table of %u", TKV_ATTN_RUNS_MAX);
    return test_done();
}
