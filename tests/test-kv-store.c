/*
 * test-kv-store.c -- the tiered KV store against an in-memory mirror.
 *
 * A randomized model-based test: thousands of random appends, layer reads,
 * prefetches, demotions, exports, imports and truncations, with every K/V
 * row checked byte for byte against a mirror after each operation, on three
 * configurations (host compute tier + NVMe; a "device" compute tier + pinned
 * host tier + NVMe, using the CPU backend's memory as the device; the
 * synchronous I/O engine). Then fault injection through the I/O hook: a
 * failing write, ENOSPC, short transfers, a flipped bit in a spilled block;
 * each gives the expected error and loses no data; a host copy is summed
 * once after it lands, and a bit flipped after that is still caught. Bulk imports
 * (tkv_kvs_import_n, the synthetic fill's path) past the compute tier's
 * capacity: the blocks the compute tier keeps against a one-at-a-time
 * reference of the eviction order, every block's bytes from whichever tier
 * holds it, and failures (no tier below, EIO, a failed upload) leaving each
 * block whole or empty. File descriptors and
 * spill files are checked for leaks. Seeds are printed (TKV_SEED replays).
 */
#include "io/io.h"
#include "test.h"
#include "tiers/crc32c.h"
#include "tiers/host-mem.h"
#include "tiers/kv-store.h"

#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

enum { L = 3, H = 2, HD = 64, B = 16, CTX = 256, NB = CTX / B };

static uint64_t rng;
static struct tkv_backend *be;  /* the compute tier's backend: cpu, or cuda where a GPU is */
static char spill_dir[256];

/* mirror[l][h][pos][K|V][d] */
static uint16_t mirror[L][H][CTX][2][HD];
static uint32_t length;

static int count_fds(void)
{
    int n = 0;
    DIR *d = opendir("/proc/self/fd");
    if (!d)
        return -1;
    while (readdir(d))
        n++;
    closedir(d);
    return n;
}

/* Prints what the open descriptors are (when a leak is reported). */
static void list_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    struct dirent *e;
    while (d && (e = readdir(d))) {
        char path[300], target[256];
        snprintf(path, sizeof path, "/proc/self/fd/%s", e->d_name);
        ssize_t n = readlink(path, target, sizeof target - 1);
        if (n > 0) {
            target[n] = 0;
            fprintf(stderr, "  fd %s -> %s\n", e->d_name, target);
        }
    }
    if (d)
        closedir(d);
}

static int dir_entries(const char *path)
{
    int n = 0;
    DIR *d = opendir(path);
    struct dirent *e;
    while (d && (e = readdir(d)))
        n += strcmp(e->d_name, ".") && strcmp(e->d_name, "..");
    if (d)
        closedir(d);
    return n;
}

/* Compares the views of one layer (inside begin/end) with the mirror. */
static bool check_layer_views(struct tkv_kvs *s, uint32_t l, const char *when)
{
    for (uint32_t h = 0; h < H; h++) {
        struct tkv_kv_head_view v = tkv_kvs_view(s, l, h);
        uint32_t want = (length + B - 1) / B;
        if (v.n_blocks != want) {
            CHECK(false, "%s: layer %u head %u has %u blocks, expected %u", when, l, h, v.n_blocks, want);
            return false;
        }
        for (uint32_t b = 0; b < v.n_blocks; b++) {
            const struct tkv_kv_block_ref *r = &v.blocks[b];
            if (r->pos0 != (int32_t)(b * B) || r->n != TKV_MIN((uint32_t)B, length - b * B)) {
                CHECK(false, "%s: block %u has pos0 %d n %u", when, b, r->pos0, r->n);
                return false;
            }
            uint16_t k[B][HD], v[B][HD]; /* through the backend: the rows may be GPU memory */
            be->ops->download(be, k, r->k, (size_t)r->n * HD * 2);
            be->ops->download(be, v, r->v, (size_t)r->n * HD * 2);
            for (uint32_t j = 0; j < r->n; j++) {
                uint32_t pos = b * B + j;
                if (memcmp(k[j], mirror[l][h][pos][0], HD * 2) || memcmp(v[j], mirror[l][h][pos][1], HD * 2)) {
                    CHECK(false, "%s: layer %u head %u position %u differs from the mirror", when, l, h, pos);
                    return false;
                }
            }
        }
    }
    return true;
}

static tkv_status append(struct tkv_kvs *s, uint32_t n)
{
    TKV_TRY(tkv_kvs_reserve(s, length + n));
    const uint32_t old = length;
    tkv_kvs_set_length(s, length + n);
    length += n;
    for (uint32_t l = 0; l < L; l++) {
        tkv_status st = tkv_kvs_begin_layer(s, l, old, n);
        if (st != TKV_OK) {
            tkv_kvs_set_length(s, old);
            length = old;
            return st;
        }
        for (uint32_t h = 0; h < H; h++)
            for (uint32_t p = old; p < old + n; p++) {
                uint16_t *k, *v;
                tkv_kvs_locate(s, l, h, p, &k, &v);
                for (uint32_t d = 0; d < HD; d++) {
                    mirror[l][h][p][0][d] = (uint16_t)test_rand_u64(&rng);
                    mirror[l][h][p][1][d] = (uint16_t)test_rand_u64(&rng);
                }
                be->ops->upload(be, k, mirror[l][h][p][0], HD * 2);
                be->ops->upload(be, v, mirror[l][h][p][1], HD * 2);
            }
        check_layer_views(s, l, "after append");
        tkv_kvs_end_layer(s, l);
    }
    return TKV_OK;
}

static void check_all(struct tkv_kvs *s, const char *when)
{
    for (uint32_t l = 0; l < L; l++) {
        tkv_status st = tkv_kvs_begin_layer(s, l, 0, 0);
        CHECK(st == TKV_OK, "%s: begin_layer(%u): %s", when, l, tkv_last_error());
        if (st == TKV_OK) {
            check_layer_views(s, l, when);
            tkv_kvs_end_layer(s, l);
        }
    }
}

static bool evict_cycle; /* make_store's stores evict by the layer cycle alone */
static bool page_table;  /* make_store's stores keep a device page table (and read marks) */
static bool no_homes;    /* make_store's stores take no home slots (docs/kv-layout.md) */

static struct tkv_kvs *make_store(bool compute_is_host, uint32_t compute_blocks, uint32_t host_blocks, bool nvme)
{
    const uint32_t S = 4 * B * HD;
    struct tkv_kvs_params p = {.n_layer = L, .n_head_kv = H, .head_dim = HD, .block_tokens = B, .max_tokens = CTX,
                               .compute_is_host = compute_is_host, .compute_bytes = (uint64_t)compute_blocks * S,
                               .host_bytes = (uint64_t)host_blocks * S, .nvme_dir = nvme ? spill_dir : NULL,
                               .upload_piece_bytes = 3 * S, /* recalls in several pieces */
                               .staging_blocks = 3,         /* NVMe recalls cycle the staging halves */
                               .evict_cycle = evict_cycle, .page_table = page_table, .no_homes = no_homes};
    struct tkv_kvs *s = NULL;
    tkv_status st = tkv_kvs_init(&p, be, &s);
    CHECK(st == TKV_OK, "kvs_init: %s", tkv_last_error());
    length = 0;
    return s;
}

/* ---- a device whose block uploads land late ------------------------------------- */

/* Wraps the CPU backend as a "device" with asynchronous block uploads: the
 * copies of upload_blocks are only carried out at upload_fence, upload_wait
 * or synchronize of their ticket -- the latest a GPU's copy stream may land
 * them (uploads and downloads on the compute stream are not ordered after
 * them). A store that used an uploaded block before fencing its upload
 * would read stale bytes, and the mirror check would catch it. */
enum { MAX_DEFERRED = 4096 };
static struct deferred {
    struct tkv_backend base;
    struct tkv_backend *inner;
    struct { void *dst; const void *src; size_t bytes; uint32_t crc; uint8_t *bad; uint64_t seq; } q[MAX_DEFERRED];
    uint32_t n;
    uint64_t queued, fences, seq, downloads; /* downloads: download_blocks calls */
    bool fail_uploads; /* upload_blocks fails (a device error) */
    uint32_t refuse_allocs; /* the next this many allocs fail (out of device memory) */
    bool no_checks;    /* upload_blocks refuses checksums (TKV_ERR_UNSUPPORTED): the store checks on the CPU */
} dfr;

/* Lands the queued copies of uploads 1 .. upto, in order. */
static void dfr_flush(uint64_t upto)
{
    uint32_t keep = 0;
    for (uint32_t j = 0; j < dfr.n; j++) {
        if (dfr.q[j].seq > upto) {
            dfr.q[keep++] = dfr.q[j];
            continue;
        }
        memcpy(dfr.q[j].dst, dfr.q[j].src, dfr.q[j].bytes);
        if (dfr.q[j].bad) /* the "device" checks what landed */
            *dfr.q[j].bad = tkv_crc32c(0, dfr.q[j].dst, dfr.q[j].bytes) != dfr.q[j].crc;
    }
    dfr.n = keep;
}
static void dfr_free(struct tkv_backend *b) { (void)b; }
static tkv_status dfr_alloc(struct tkv_backend *b, size_t n, void **out)
{
    (void)b;
    if (dfr.refuse_allocs) {
        dfr.refuse_allocs--;
        return tkv_err(TKV_ERR_NOMEM, "deferred: %zu bytes refused (a test's out of memory)", n);
    }
    return dfr.inner->ops->alloc(dfr.inner, n, out);
}
static void dfr_release(struct tkv_backend *b, void *p) { (void)b; dfr.inner->ops->release(dfr.inner, p); }
static tkv_status dfr_upload(struct tkv_backend *b, void *dst, const void *src, size_t n)
{
    (void)b; /* the compute stream: not ordered after unfenced block uploads */
    return dfr.inner->ops->upload(dfr.inner, dst, src, n);
}
static tkv_status dfr_download(struct tkv_backend *b, void *dst, const void *src, size_t n)
{
    (void)b;
    return dfr.inner->ops->download(dfr.inner, dst, src, n);
}
static tkv_status dfr_sync(struct tkv_backend *b) { (void)b; dfr_flush(TKV_UPLOADS_ALL); return TKV_OK; }
static tkv_status dfr_download_blocks(struct tkv_backend *b, void *const *dst, const void *const *src, uint32_t n,
                                      size_t bytes)
{
    (void)b; /* the compute stream, like download */
    dfr.downloads++;
    for (uint32_t j = 0; j < n; j++)
        TKV_TRY(dfr.inner->ops->download(dfr.inner, dst[j], src[j], bytes));
    return TKV_OK;
}
static tkv_status dfr_upload_blocks(struct tkv_backend *b, void *const *dst, const void *const *src, uint32_t n,
                                    size_t bytes, const uint32_t *crc, uint8_t *bad, uint64_t *ticket)
{
    (void)b;
    if (dfr.fail_uploads)
        return tkv_err(TKV_ERR_DEVICE, "deferred: injected upload failure");
    if (crc && dfr.no_checks)
        return tkv_err(TKV_ERR_UNSUPPORTED, "deferred: no checks on this device");
    if (ticket)
        *ticket = n ? dfr.seq + 1 : 0;
    if (n == 0)
        return TKV_OK;
    dfr.seq++;
    for (uint32_t j = 0; j < n; j++) {
        if (dfr.n == MAX_DEFERRED)
            dfr_flush(dfr.q[0].seq); /* the oldest upload lands early: allowed */
        dfr.q[dfr.n++] =
            (typeof(dfr.q[0])){dst[j], src[j], bytes, crc ? crc[j] : 0, crc ? &bad[j] : NULL, dfr.seq};
        if (bad)
            bad[j] = 0xAA; /* not known until the wait */
    }
    dfr.queued += n;
    return TKV_OK;
}
static tkv_status dfr_fence(struct tkv_backend *b, uint64_t upto)
{
    (void)b;
    dfr.fences++;
    dfr_flush(upto);
    return TKV_OK;
}
static tkv_status dfr_wait(struct tkv_backend *b, uint64_t upto, bool block, bool *done)
{
    (void)b, (void)block;
    dfr_flush(upto);
    if (done)
        *done = true;
    return TKV_OK;
}
/* Copies still queued (not landed). */
static uint32_t dfr_pending(void) { return dfr.n; }
static struct tkv_backend_ops dfr_ops;

static struct tkv_backend *deferred_backend(struct tkv_backend *inner)
{
    dfr_ops = (struct tkv_backend_ops){.name = "deferred", .free = dfr_free, .alloc = dfr_alloc,
                                       .release = dfr_release, .upload = dfr_upload, .download = dfr_download,
                                       .synchronize = dfr_sync, .upload_blocks = dfr_upload_blocks,
                                       .upload_fence = dfr_fence, .upload_wait = dfr_wait,
                                       .download_blocks = dfr_download_blocks};
    dfr.base.ops = &dfr_ops;
    dfr.inner = inner;
    return &dfr.base;
}

/* ---- the randomized model-based test ---------------------------------------------- */

static void random_ops(struct tkv_kvs *s, int n_ops, const char *name)
{
    uint8_t payload[4 * B * HD];
    const int fail0 = test_failures_; /* stop this configuration at its first failure */
    for (int op = 0; op < n_ops && test_failures_ == fail0; op++) {
        uint32_t r = (uint32_t)(test_rand_u64(&rng) % 100);
        if (r < 35 && length < CTX) { /* append 1..40 tokens */
            uint32_t n = 1 + (uint32_t)(test_rand_u64(&rng) % 40);
            n = TKV_MIN(n, CTX - length);
            tkv_status st = append(s, n);
            CHECK(st == TKV_OK, "%s op %d: append %u: %s", name, op, n, tkv_last_error());
        } else if (r < 55 && length > 0) { /* read a layer */
            uint32_t l = (uint32_t)(test_rand_u64(&rng) % L);
            tkv_status st = tkv_kvs_begin_layer(s, l, 0, 0);
            CHECK(st == TKV_OK, "%s op %d: begin_layer: %s", name, op, tkv_last_error());
            if (st == TKV_OK) {
                check_layer_views(s, l, name);
                tkv_kvs_end_layer(s, l);
            }
        } else if (r < 65) { /* prefetch a layer */
            tkv_kvs_prefetch(s, (uint32_t)(test_rand_u64(&rng) % L));
        } else if (r < 75 && length > 0) { /* demote a block */
            uint32_t b = (uint32_t)(test_rand_u64(&rng) % ((length + B - 1) / B));
            tkv_status st = tkv_kvs_demote(s, (uint32_t)(test_rand_u64(&rng) % L), (uint32_t)(test_rand_u64(&rng) % H), b);
            CHECK(st == TKV_OK, "%s op %d: demote: %s", name, op, tkv_last_error());
        } else if (r < 85 && length > 0) { /* export a block and compare */
            uint32_t l = (uint32_t)(test_rand_u64(&rng) % L), h = (uint32_t)(test_rand_u64(&rng) % H);
            uint32_t b = (uint32_t)(test_rand_u64(&rng) % ((length + B - 1) / B));
            tkv_status st = tkv_kvs_export(s, l, h, b, payload);
            CHECK(st == TKV_OK, "%s op %d: export: %s", name, op, tkv_last_error());
            for (uint32_t j = 0; st == TKV_OK && j < B && b * B + j < length; j++) {
                if (memcmp(payload + (size_t)j * HD * 2, mirror[l][h][b * B + j][0], HD * 2) ||
                    memcmp(payload + (size_t)(B + j) * HD * 2, mirror[l][h][b * B + j][1], HD * 2)) {
                    CHECK(false, "%s op %d: export of (%u,%u,%u) row %u differs", name, op, l, h, b, j);
                    break;
                }
            }
        } else if (r < 92 && length > 0) { /* import a block (as a restore does) */
            uint32_t l = (uint32_t)(test_rand_u64(&rng) % L), h = (uint32_t)(test_rand_u64(&rng) % H);
            uint32_t b = (uint32_t)(test_rand_u64(&rng) % ((length + B - 1) / B));
            for (size_t i = 0; i < sizeof payload; i++)
                payload[i] = (uint8_t)test_rand_u64(&rng);
            tkv_status st = tkv_kvs_import(s, l, h, b, payload);
            CHECK(st == TKV_OK, "%s op %d: import: %s", name, op, tkv_last_error());
            for (uint32_t j = 0; j < B && b * B + j < length; j++) {
                memcpy(mirror[l][h][b * B + j][0], payload + (size_t)j * HD * 2, HD * 2);
                memcpy(mirror[l][h][b * B + j][1], payload + (size_t)(B + j) * HD * 2, HD * 2);
            }
        } else if (r < 96 && length > 0) { /* truncate and refill in runs, as the synthetic fill does */
            uint32_t keep = (uint32_t)(test_rand_u64(&rng) % (length + 1)), n = length;
            tkv_kvs_set_length(s, keep);
            tkv_kvs_set_length(s, n); /* the kept partial block holds data: the per-block path */
            length = n;
            static uint8_t run[NB][4 * B * HD];
            const void *src[NB];
            for (uint32_t l = 0; l < L; l++)
                for (uint32_t h = 0; h < H; h++)
                    for (uint32_t b0 = keep / B; b0 * B < length;) {
                        const uint32_t want = 1 + (uint32_t)(test_rand_u64(&rng) % 9); /* TKV_MIN evaluates twice */
                        const uint32_t m = TKV_MIN(want, (length + B - 1) / B - b0);
                        for (uint32_t j = 0; j < m; j++) {
                            for (size_t i = 0; i < sizeof run[j]; i++)
                                run[j][i] = (uint8_t)test_rand_u64(&rng);
                            src[j] = run[j];
                        }
                        tkv_status st = tkv_kvs_import_n(s, l, h, b0, m, src);
                        CHECK(st == TKV_OK, "%s op %d: import_n: %s", name, op, tkv_last_error());
                        for (uint32_t j = 0; j < m; j++)
                            for (uint32_t p = (b0 + j) * B; p < (b0 + j + 1) * B && p < length; p++) {
                                memcpy(mirror[l][h][p][0], run[j] + (size_t)(p % B) * HD * 2, HD * 2);
                                memcpy(mirror[l][h][p][1], run[j] + (size_t)(B + p % B) * HD * 2, HD * 2);
                            }
                        b0 += m;
                    }
        } else if (length > 0) { /* truncate */
            uint32_t n = (uint32_t)(test_rand_u64(&rng) % (length + 1));
            tkv_kvs_set_length(s, n);
            length = n;
        }
    }
    check_all(s, name);
    struct tkv_kvs_stats st;
    tkv_kvs_get_stats(s, &st);
    fprintf(stderr, "%s: %d ops; compute hits %llu misses %llu; nvme in %llu out %llu bytes; prefetched %llu\n", name,
            n_ops, (unsigned long long)st.tier[0].hits, (unsigned long long)st.tier[0].misses,
            (unsigned long long)st.tier[2].bytes_in, (unsigned long long)st.tier[2].bytes_out,
            (unsigned long long)st.prefetched_blocks);
    CHECK(st.tier[2].bytes_in > 0 && st.tier[2].bytes_out > 0, "%s: the test never spilled and recalled", name);
}

/* ---- bulk import ------------------------------------------------------------------ */

static uint8_t imp_pay[L][H][NB][4 * B * HD]; /* the payloads imported */

/* Imports blocks [b_from, NB) of every (layer, head) with tkv_kvs_import_n,
 * in the fill's order, in runs of 1..max_run blocks; payloads random (kept
 * in imp_pay and the mirror). Stops at the first error and returns it. */
static tkv_status import_runs(struct tkv_kvs *s, uint32_t b_from, uint32_t max_run)
{
    const void *src[NB];
    for (uint32_t l = 0; l < L; l++)
        for (uint32_t h = 0; h < H; h++)
            for (uint32_t b0 = b_from; b0 < NB;) {
                const uint32_t want = 1 + (uint32_t)(test_rand_u64(&rng) % max_run); /* TKV_MIN evaluates twice */
                const uint32_t m = TKV_MIN(want, NB - b0);
                for (uint32_t j = 0; j < m; j++) {
                    for (size_t i = 0; i < sizeof imp_pay[l][h][b0 + j]; i++)
                        imp_pay[l][h][b0 + j][i] = (uint8_t)test_rand_u64(&rng);
                    src[j] = imp_pay[l][h][b0 + j];
                    for (uint32_t r = 0; r < B; r++) {
                        memcpy(mirror[l][h][(b0 + j) * B + r][0], imp_pay[l][h][b0 + j] + (size_t)r * HD * 2, HD * 2);
                        memcpy(mirror[l][h][(b0 + j) * B + r][1], imp_pay[l][h][b0 + j] + (size_t)(B + r) * HD * 2,
                               HD * 2);
                    }
                }
                TKV_TRY(tkv_kvs_import_n(s, l, h, b0, m, src));
                b0 += m;
            }
    return TKV_OK;
}

/* Blocks [b_from, NB) of every (layer, head) export as imp_pay; returns how
 * many hold nothing (export says so) when holes_ok, else checks none does. */
static uint32_t check_exports(struct tkv_kvs *s, uint32_t b_from, bool holes_ok, const char *when)
{
    uint8_t got[4 * B * HD];
    uint32_t holes = 0;
    for (uint32_t l = 0; l < L; l++)
        for (uint32_t h = 0; h < H; h++)
            for (uint32_t b = b_from; b < NB; b++) {
                tkv_status st = tkv_kvs_export(s, l, h, b, got);
                if (st == TKV_ERR_INVALID_ARG && holes_ok && tkv_kvs_block_tier(s, l, h, b) < 0) {
                    holes++;
                    continue;
                }
                CHECK(st == TKV_OK, "%s: export (%u,%u,%u): %s", when, l, h, b, tkv_last_error());
                CHECK(st != TKV_OK || !memcmp(got, imp_pay[l][h][b], sizeof got),
                      "%s: block (%u,%u,%u) on tier %d differs from what was imported", when, l, h, b,
                      tkv_kvs_block_tier(s, l, h, b));
            }
    return holes;
}

/* A fresh context imported in runs past the compute tier's capacity (the
 * synthetic fill's pattern). Checks
 *   - which blocks the compute tier keeps: exactly those of a reference
 *     importing one block at a time that evicts one block per import when
 *     full -- the block whose layer comes furthest after the current one
 *     (kv-layout.md: Belady's order for the layer cycle), least recently
 *     used among those, never the block being imported;
 *   - every block's bytes, exported from whichever tier holds it, and every
 *     layer's views (recalls verify the checksums made on the way down);
 *   - a second import over the same blocks (the per-block path). */
static void test_import_n(bool compute_is_host, uint32_t cap, uint32_t host_blocks, const char *name)
{
    struct tkv_kvs *s = make_store(compute_is_host, cap, host_blocks, true);
    REQUIRE_VOID(s);
    REQUIRE_VOID(tkv_kvs_reserve(s, CTX) == TKV_OK);
    tkv_kvs_set_length(s, CTX);
    length = CTX;
    const uint64_t rng0 = rng;
    tkv_status st = import_runs(s, 0, 7);
    CHECK(st == TKV_OK, "%s: import_n: %s", name, tkv_last_error());

    /* the reference: the same imports one by one; a fresh store measures
     * distances from layer 0, and every import has its own LRU stamp */
    enum { NBLK = L * H * NB };
    static bool in[NBLK];
    static uint64_t stamp[NBLK];
    uint32_t n_in = 0;
    memset(in, 0, sizeof in);
    for (uint32_t i = 0; i < NBLK; i++) { /* the fill's order: layer, head, block */
        if (n_in == cap) {
            int64_t v = -1;
            for (uint32_t c = 0; c < NBLK; c++) {
                if (!in[c])
                    continue;
                const uint32_t lc = c / (H * NB), lv = v < 0 ? 0 : (uint32_t)v / (H * NB);
                if (v < 0 || lc > lv || (lc == lv && stamp[c] < stamp[v]))
                    v = c;
            }
            in[v] = false;
            n_in--;
        }
        in[i] = true;
        stamp[i] = i + 1;
        n_in++;
    }
    uint32_t wrong = 0, on_compute = 0, below = 0;
    for (uint32_t i = 0; i < NBLK; i++) {
        const uint32_t l = i / (H * NB), h = i / NB % H, b = i % NB;
        const int t = tkv_kvs_block_tier(s, l, h, b);
        on_compute += t == TKV_TIER_COMPUTE;
        below += t == TKV_TIER_HOST || t == TKV_TIER_NVME;
        if ((t == TKV_TIER_COMPUTE) != in[i] && wrong++ < 5)
            CHECK(false, "%s: block (%u,%u,%u) is on tier %d; the eviction order keeps it %s", name, l, h, b, t,
                  in[i] ? "in the compute tier" : "below");
    }
    CHECK(wrong == 0, "%s: %u blocks placed against the eviction order", name, wrong);
    CHECK(on_compute == cap && on_compute + below == NBLK, "%s: %u blocks on the compute tier (cap %u), %u below",
          name, on_compute, cap, below);
    check_exports(s, 0, false, name);
    check_all(s, name);
    /* again over blocks that hold data: one import each, same contract */
    st = import_runs(s, NB / 2, 5);
    CHECK(st == TKV_OK, "%s: import_n over stored blocks: %s", name, tkv_last_error());
    check_exports(s, 0, false, name);
    check_all(s, name);
    fprintf(stderr, "%s: import_n of %d blocks, %u kept in the compute tier as the eviction order says (seed %llu)\n",
            name, NBLK, on_compute, (unsigned long long)rng0);
    tkv_kvs_free(s);
}

/* tkv_kvs_write_back: with room on the host tier every compute-tier block
 * without a copy below gets one (the GPU copy stays), the data is intact,
 * and reading every layer afterwards -- an eviction for most blocks --
 * writes nothing down; with the host tier full, or the compute tier not,
 * it copies nothing and evicts nothing. */
static void test_write_back(void)
{
    static const struct { uint32_t compute, host; bool copies; const char *name; } cases[] = {
        {40, 200, true, "write_back: room below"},
        {40, 40, false, "write_back: host tier full"},
        {200, 200, false, "write_back: compute tier with room"},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const char *name = cases[c].name;
        struct tkv_kvs *s = make_store(false, cases[c].compute, cases[c].host, true);
        REQUIRE_VOID(s);
        REQUIRE_VOID(tkv_kvs_reserve(s, CTX) == TKV_OK);
        tkv_kvs_set_length(s, CTX);
        length = CTX;
        tkv_status st = import_runs(s, 0, 7);
        CHECK(st == TKV_OK, "%s: import_n: %s", name, tkv_last_error());
        struct tkv_kvs_stats a, b;
        tkv_kvs_get_stats(s, &a);
        uint32_t n_done = UINT32_MAX;
        st = tkv_kvs_write_back(s, &n_done);
        CHECK(st == TKV_OK, "%s: %s", name, tkv_last_error());
        tkv_kvs_get_stats(s, &b);
        const uint64_t host_in = b.tier[TKV_TIER_HOST].bytes_in - a.tier[TKV_TIER_HOST].bytes_in;
        const uint32_t S = 4 * B * HD;
        CHECK(cases[c].copies ? n_done == cases[c].compute && host_in == (uint64_t)n_done * S
                              : n_done == 0 && host_in == 0,
              "%s: %u blocks written back, %llu bytes into the host tier", name, n_done, (unsigned long long)host_in);
        CHECK(b.stall.evicted_blocks == a.stall.evicted_blocks, "%s: the write-back evicted %llu blocks", name,
              (unsigned long long)(b.stall.evicted_blocks - a.stall.evicted_blocks));
        check_exports(s, 0, false, name);
        check_all(s, name); /* every layer read: the compute tier turns over */
        check_exports(s, 0, false, name);
        tkv_kvs_get_stats(s, &a);
        if (cases[c].copies)
            CHECK(a.stall.spilled_blocks == b.stall.spilled_blocks && a.stall.evicted_blocks > b.stall.evicted_blocks,
                  "%s: after the write-back %llu evictions wrote %llu blocks down", name,
                  (unsigned long long)(a.stall.evicted_blocks - b.stall.evicted_blocks),
                  (unsigned long long)(a.stall.spilled_blocks - b.stall.spilled_blocks));
        tkv_kvs_free(s);
    }
}

/* Failures inside tkv_kvs_import_n: each block holds its payload or
 * nothing, the error names what failed, and the import can be retried. */
static void test_import_n_faults(void)
{
    /* 1. nowhere to spill: a full compute tier with no tier below */
    struct tkv_kvs *s = make_store(true, 40, 0, false);
    REQUIRE_VOID(s);
    REQUIRE_VOID(tkv_kvs_reserve(s, CTX) == TKV_OK);
    tkv_kvs_set_length(s, CTX);
    length = CTX;
    tkv_status st = import_runs(s, 0, 7);
    CHECK(st == TKV_ERR_NOMEM && strstr(tkv_last_error(), "no NVMe tier"), "no tier below: %s (%s)",
          tkv_status_str(st), tkv_last_error());
    uint32_t holes = check_exports(s, 0, true, "no tier below");
    CHECK(holes >= L * H * NB - 40, "no tier below: only %u blocks hold nothing (40 fit)", holes); /* the rest never went in */
    tkv_kvs_free(s);

    /* 2. NVMe writes fail (EIO) while a run goes straight below */
    s = make_store(true, 40, 0, true);
    REQUIRE_VOID(s);
    REQUIRE_VOID(tkv_kvs_reserve(s, CTX) == TKV_OK);
    tkv_kvs_set_length(s, CTX);
    length = CTX;
    struct tkv_io_fault f = {.ops_skip = 0, .ops_count = 1000, .op_err = EIO};
    tkv_io_set_fault(tkv_kvs_io(s), &f);
    st = import_runs(s, 0, 7);
    CHECK(st == TKV_ERR_IO && strstr(tkv_last_error(), "block (layer"), "EIO on spill: %s (%s)", tkv_status_str(st),
          tkv_last_error());
    holes = check_exports(s, 0, true, "after EIO");
    CHECK(holes > 0, "EIO: every block holds data");
    tkv_io_set_fault(tkv_kvs_io(s), NULL);
    CHECK(import_runs(s, 0, 7) == TKV_OK, "retry after EIO: %s", tkv_last_error());
    check_exports(s, 0, false, "retry after EIO");
    check_all(s, "retry after EIO");
    tkv_kvs_free(s);

    /* 3. a device whose block uploads fail */
    struct tkv_backend *saved = be;
    be = deferred_backend(saved);
    s = make_store(false, 40, 40, true);
    if (s) {
        REQUIRE_VOID(tkv_kvs_reserve(s, CTX) == TKV_OK);
        tkv_kvs_set_length(s, CTX);
        length = CTX;
        dfr.fail_uploads = true;
        st = import_runs(s, 0, 7);
        dfr.fail_uploads = false;
        CHECK(st == TKV_ERR_DEVICE && strstr(tkv_last_error(), "importing") &&
                  strstr(tkv_last_error(), "injected upload failure"),
              "failed upload: %s (%s)", tkv_status_str(st), tkv_last_error());
        holes = check_exports(s, 0, true, "after a failed upload");
        CHECK(holes > 0, "failed upload: every block holds data");
        CHECK(import_runs(s, 0, 7) == TKV_OK, "retry after a failed upload: %s", tkv_last_error());
        check_exports(s, 0, false, "retry after a failed upload");
        check_all(s, "retry after a failed upload");
        tkv_kvs_free(s);
    }
    be = saved;
}

/* ---- prefetch pipeline ------------------------------------------------------------ */

/* The engine's order on a GPU: prefetch(l + 1), then begin_layer(l). The
 * next layer's uploads must stay in flight while l is settled and used (the
 * link never waits for the host), and every view must still match the
 * mirror: a block used before its own upload was fenced would be stale. */
static void fill_until_spilling(struct tkv_kvs *s);

static void test_prefetch_pipeline(void)
{
    struct tkv_backend *cpu_be = be;
    be = deferred_backend(cpu_be);
    /* the compute tier holds two layers and a little; the host tier all */
    struct tkv_kvs *s = make_store(false, 2 * H * NB + 4, L * H * NB, false);
    if (!s) {
        be = cpu_be;
        return;
    }
    fill_until_spilling(s);
    struct tkv_kvs_stats st0, st1;
    tkv_kvs_get_stats(s, &st0);
    uint32_t in_flight[2] = {0, 0};
    for (int pass = 0; pass < 2; pass++)
        for (uint32_t l = 0; l < L; l++) {
            tkv_kvs_prefetch(s, l + 1);
            tkv_status st = tkv_kvs_begin_layer(s, l, 0, 0);
            CHECK(st == TKV_OK, "pipeline pass %d: begin_layer(%u): %s", pass, l, tkv_last_error());
            if (st != TKV_OK)
                continue;
            in_flight[pass] += dfr_pending() > 0; /* layer l+1's copies not landed yet */
            check_layer_views(s, l, "pipelined begin_layer");
            tkv_kvs_end_layer(s, l);
        }
    tkv_kvs_get_stats(s, &st1);
    fprintf(stderr, "prefetch pipeline: next layer in flight at %u/%u and %u/%u begin_layers, %llu blocks prefetched, "
                    "%llu compute misses\n",
            in_flight[0], L, in_flight[1], L, (unsigned long long)(st1.prefetched_blocks - st0.prefetched_blocks),
            (unsigned long long)(st1.tier[0].misses - st0.tier[0].misses));
    CHECK(in_flight[1] == L, "steady state: the next layer was in flight at only %u of %u begin_layers", in_flight[1],
          L);
    CHECK(st1.prefetched_blocks - st0.prefetched_blocks >= (uint64_t)(L - 1) * H * NB,
          "the pipeline prefetched only %llu blocks", (unsigned long long)(st1.prefetched_blocks - st0.prefetched_blocks));
    check_all(s, "after the pipeline");
    tkv_kvs_free(s);
    be = cpu_be;
}

/* tkv_kvs_prefetch_last: after a selective read of layer l and reads of the
 * other layers that pushed its blocks out, it brings back exactly the
 * listed blocks that left the compute tier (the next read of the same
 * selection then misses nothing), and none of the others; after a
 * whole-layer read it prefetches the whole layer. From NVMe into a host
 * compute tier (io_uring) and from the host tier to a device whose uploads
 * land late. */
static uint32_t count_out(struct tkv_kvs *s, uint32_t l, const uint8_t *need, uint32_t MB)
{
    uint32_t n = 0;
    for (uint32_t h = 0; h < H; h++)
        for (uint32_t b = 0; b < NB; b++)
            n += (!need || need[h * MB + b]) && tkv_kvs_block_tier(s, l, h, b) != TKV_TIER_COMPUTE;
    return n;
}

/* Every layer but l read whole, once. */
static void read_other_layers(struct tkv_kvs *s, uint32_t l)
{
    for (uint32_t o = 0; o < L; o++)
        if (o != l && tkv_kvs_begin_layer(s, o, 0, 0) == TKV_OK)
            tkv_kvs_end_layer(s, o);
}

static void test_prefetch_last(void)
{
    struct tkv_backend *cpu_be = be;
    for (int c = 0; c < 2; c++) {
        const char *name = c ? "device (late uploads)+host" : "host+nvme";
        be = c ? deferred_backend(cpu_be) : cpu_be;
        struct tkv_kvs *s = c ? make_store(false, H * NB + 8, L * H * NB, false) : make_store(true, H * NB + 8, 0, true);
        if (!s)
            break;
        fill_until_spilling(s);
        const uint32_t l = 1, MB = tkv_kvs_max_blocks(s);
        static uint8_t need[H * CTX];
        memset(need, 0, sizeof need);
        for (uint32_t h = 0; h < H; h++)
            for (uint32_t b = 0; b < NB; b++)
                need[h * MB + b] = test_rand_u64(&rng) % 4 == 0 || b == h;
        tkv_status st = tkv_kvs_begin_layer_sel(s, l, 0, 0, need);
        CHECK(st == TKV_OK, "%s: selective read: %s", name, tkv_last_error());
        if (st == TKV_OK)
            tkv_kvs_end_layer(s, l);
        read_other_layers(s, l); /* layer l's blocks go */
        const uint32_t out = count_out(s, l, need, MB), out_all = count_out(s, l, NULL, MB);
        CHECK(out > 0, "%s: no selected block left the compute tier: nothing to test", name);
        int tier[H][NB];
        for (uint32_t h = 0; h < H; h++)
            for (uint32_t b = 0; b < NB; b++)
                tier[h][b] = tkv_kvs_block_tier(s, l, h, b);
        struct tkv_kvs_stats k0, k1;
        tkv_kvs_get_stats(s, &k0);
        tkv_kvs_prefetch_last(s, l);
        CHECK(tkv_kvs_prefetch_wait(s) == TKV_OK, "%s: prefetch: %s", name, tkv_last_error());
        tkv_kvs_get_stats(s, &k1);
        CHECK(k1.prefetched_blocks - k0.prefetched_blocks == out, "%s: %llu blocks prefetched, %u selected were out",
              name, (unsigned long long)(k1.prefetched_blocks - k0.prefetched_blocks), out);
        for (uint32_t h = 0; h < H; h++)
            for (uint32_t b = 0; b < NB; b++)
                CHECK(need[h * MB + b] ? tkv_kvs_block_tier(s, l, h, b) == TKV_TIER_COMPUTE
                                       : tkv_kvs_block_tier(s, l, h, b) == tier[h][b],
                      "%s: head %u block %u (%s) on tier %d after the prefetch, %d before", name, h, b,
                      need[h * MB + b] ? "selected" : "not selected", tkv_kvs_block_tier(s, l, h, b), tier[h][b]);
        /* the same selection again: every block a hit, each as the mirror has it */
        tkv_kvs_get_stats(s, &k0);
        st = tkv_kvs_begin_layer_sel(s, l, 0, 0, need);
        tkv_kvs_get_stats(s, &k1);
        CHECK(st == TKV_OK && k1.tier[TKV_TIER_COMPUTE].misses == k0.tier[TKV_TIER_COMPUTE].misses,
              "%s: the read after the prefetch: %s, %llu misses", name, tkv_status_str(st),
              (unsigned long long)(k1.tier[TKV_TIER_COMPUTE].misses - k0.tier[TKV_TIER_COMPUTE].misses));
        for (uint32_t h = 0; h < H && st == TKV_OK; h++)
            for (uint32_t b = 0; b < NB; b++) {
                const struct tkv_kv_block_ref *r = &tkv_kvs_view(s, l, h).blocks[b];
                if (!need[h * MB + b])
                    continue;
                uint16_t k[B][HD], v[B][HD];
                be->ops->download(be, k, r->k, (size_t)B * HD * 2);
                be->ops->download(be, v, r->v, (size_t)B * HD * 2);
                bool same = true;
                for (uint32_t j = 0; j < B; j++)
                    same &= !memcmp(k[j], mirror[l][h][b * B + j][0], HD * 2) &&
                            !memcmp(v[j], mirror[l][h][b * B + j][1], HD * 2);
                CHECK(same, "%s: head %u block %u differs from the mirror after the prefetch", name, h, b);
            }
        if (st == TKV_OK)
            tkv_kvs_end_layer(s, l);
        /* after a whole-layer read: the whole layer */
        if (tkv_kvs_begin_layer(s, l, 0, 0) == TKV_OK)
            tkv_kvs_end_layer(s, l);
        read_other_layers(s, l);
        const uint32_t out_whole = count_out(s, l, NULL, MB);
        tkv_kvs_get_stats(s, &k0);
        tkv_kvs_prefetch_last(s, l);
        CHECK(tkv_kvs_prefetch_wait(s) == TKV_OK, "%s: prefetch: %s", name, tkv_last_error());
        tkv_kvs_get_stats(s, &k1);
        CHECK(out_whole > out && k1.prefetched_blocks - k0.prefetched_blocks == out_whole,
              "%s: after a whole read %llu blocks prefetched, %u were out (%u selected before; %u then)", name,
              (unsigned long long)(k1.prefetched_blocks - k0.prefetched_blocks), out_whole, out, out_all);
        check_all(s, name);
        tkv_kvs_free(s);
    }
    be = cpu_be;
}

/* ---- faults -------------------------------------------------------------------------- */

static void fill_until_spilling(struct tkv_kvs *s)
{
    while (length < CTX) {
        tkv_status st = append(s, 32);
        CHECK(st == TKV_OK, "fill: %s", tkv_last_error());
        if (st != TKV_OK)
            return;
    }
}

/* The spill file grows by doubling its reservation (a reserve, not a
 * fallocate per block); a disk with room for the blocks but not for the
 * doubled reserve must still take them (the growth falls back to what the
 * slot needs), and one without room for the blocks fails with ENOSPC and
 * loses nothing. The room needed is learnt from a first fill without a limit
 * (a fill takes NVMe slots in order and frees none). */
static void test_spill_room(void)
{
    const uint64_t S = 4 * B * HD;
    struct tkv_kvs *s = make_store(true, 34, 0, true);
    REQUIRE_VOID(s);
    fill_until_spilling(s);
    struct tkv_kvs_stats st;
    tkv_kvs_get_stats(s, &st);
    const uint64_t need = st.tier[TKV_TIER_NVME].peak_bytes, reserved = st.nvme_file_bytes;
    tkv_kvs_free(s);
    CHECK(need > 0 && need % S == 0 && reserved > need,
          "the fill should spill whole blocks into a doubled reserve: %llu bytes used, %llu reserved",
          (unsigned long long)need, (unsigned long long)reserved);

    /* room for exactly the blocks: every one spills, the file stays within it */
    s = make_store(true, 34, 0, true);
    REQUIRE_VOID(s);
    tkv_io_set_fault(tkv_kvs_io(s), &(struct tkv_io_fault){.resize_max = need});
    fill_until_spilling(s);
    tkv_kvs_get_stats(s, &st);
    CHECK(length == CTX && st.nvme_file_bytes <= need,
          "a disk with room for the blocks: %u of %u tokens stored, spill file %llu bytes of %llu",
          length, CTX, (unsigned long long)st.nvme_file_bytes, (unsigned long long)need);
    tkv_io_set_fault(tkv_kvs_io(s), NULL);
    check_all(s, "spilled into a tight disk");
    tkv_kvs_free(s);

    /* one block short: ENOSPC, named, and what was stored is intact */
    s = make_store(true, 34, 0, true);
    REQUIRE_VOID(s);
    tkv_io_set_fault(tkv_kvs_io(s), &(struct tkv_io_fault){.resize_max = need - S});
    tkv_status rc = TKV_OK;
    while (length < CTX && (rc = append(s, 32)) == TKV_OK) {
    }
    CHECK(rc == TKV_ERR_IO && strstr(tkv_last_error(), "space"),
          "a disk one block short: expected TKV_ERR_IO naming the space, got %s (%s)", tkv_status_str(rc),
          tkv_last_error());
    tkv_io_set_fault(tkv_kvs_io(s), NULL);
    check_all(s, "after the disk ran out");
    tkv_kvs_free(s);
}

/* The first block of head h (in block order, then layer order, among the
 * first nb blocks) whose copy of record is on tier t: *l, *b; false if none. */
static bool first_block_on(struct tkv_kvs *s, uint32_t h, int t, uint32_t nb, uint32_t *l, uint32_t *b)
{
    for (uint32_t bb = 0; bb < nb; bb++)
        for (uint32_t ll = 0; ll < L; ll++)
            if (tkv_kvs_block_tier(s, ll, h, bb) == t) {
                *l = ll, *b = bb;
                return true;
            }
    return false;
}

static void test_faults(void)
{
    /* compute tier of 34 blocks (one layer is 32): most of the KV lives on NVMe */
    struct tkv_kvs *s = make_store(true, 34, 0, true);
    REQUIRE_VOID(s);
    fill_until_spilling(s);
    struct tkv_io *io = tkv_kvs_io(s);
    REQUIRE_VOID(io != NULL);

    /* 1. the next reads fail with EIO: a clear error, then everything still there */
    struct tkv_io_fault f = {.ops_skip = 0, .ops_count = 1000, .op_err = EIO};
    tkv_io_set_fault(io, &f);
    tkv_status st = tkv_kvs_begin_layer(s, 0, 0, 0);
    CHECK(st == TKV_ERR_IO, "EIO on recall: expected TKV_ERR_IO, got %s", tkv_status_str(st));
    CHECK(strstr(tkv_last_error(), "block (layer"), "EIO message should name the block: %s", tkv_last_error());
    tkv_io_set_fault(io, NULL);
    check_all(s, "after EIO");

    /* 2. short transfers are continued: same data */
    f = (struct tkv_io_fault){.ops_skip = 0, .ops_count = 1000, .short_bytes = 4096};
    tkv_io_set_fault(io, &f);
    check_all(s, "with short transfers");
    tkv_io_set_fault(io, NULL);

    /* 3. ENOSPC while spilling: the append fails, nothing stored is lost */
    tkv_kvs_set_length(s, 128);
    length = 128;
    check_all(s, "after truncation");
    f = (struct tkv_io_fault){.ops_skip = 0, .ops_count = 1000, .op_err = ENOSPC};
    tkv_io_set_fault(io, &f);
    bool saw_enospc = false;
    for (int i = 0; i < 8 && length < CTX; i++) {
        st = append(s, 16);
        if (st != TKV_OK) {
            saw_enospc = strstr(tkv_last_error(), "space") != NULL;
            CHECK(st == TKV_ERR_IO, "ENOSPC: expected TKV_ERR_IO, got %s (%s)", tkv_status_str(st), tkv_last_error());
            break;
        }
    }
    CHECK(saw_enospc, "ENOSPC never surfaced (or its message lacks 'space'): %s", tkv_last_error());
    tkv_io_set_fault(io, NULL);
    check_all(s, "after ENOSPC");

    /* 4. a flipped bit in a spilled block: TKV_ERR_CORRUPT naming it, data never used */
    uint32_t bad_l = 0, bad_h = 1, bad_b = NB;
    REQUIRE_VOID(first_block_on(s, bad_h, TKV_TIER_NVME, (length + B - 1) / B, &bad_l, &bad_b));
    CHECK(tkv_kvs_test_flip_bit(s, bad_l, bad_h, bad_b, TKV_TIER_NVME) == TKV_OK, "flip: %s", tkv_last_error());
    st = tkv_kvs_begin_layer(s, bad_l, 0, 0);
    CHECK(st == TKV_ERR_CORRUPT, "flipped bit: expected TKV_ERR_CORRUPT, got %s", tkv_status_str(st));
    char want[96];
    snprintf(want, sizeof want, "block (layer %u, head %u, block %u)", bad_l, bad_h, bad_b);
    CHECK(strstr(tkv_last_error(), want), "corruption message should name %s: %s", want, tkv_last_error());
    uint8_t payload[4 * B * HD];
    CHECK(tkv_kvs_export(s, bad_l, bad_h, bad_b, payload) == TKV_ERR_CORRUPT, "export of a corrupt block must fail");
    struct tkv_kvs_stats ks;
    tkv_kvs_get_stats(s, &ks);
    CHECK(ks.corrupt_blocks >= 1, "corrupt_blocks %llu", (unsigned long long)ks.corrupt_blocks);
    tkv_kvs_free(s);

    /* 5. the host tier below a device compute tier is checked the same way,
     * on a recall and on a prefetch (synchronous uploads; asynchronous ones
     * checked by the device, and by the CPU) */
    struct tkv_backend *const backends[3] = {be, deferred_backend(be), deferred_backend(be)};
    for (int bi = 0; bi < 3; bi++) {
        struct tkv_backend *saved = be;
        be = backends[bi];
        dfr.no_checks = bi == 2;
        for (int via_prefetch = 0; via_prefetch < 2; via_prefetch++) {
            s = make_store(false, 34, 40, true);
            REQUIRE_VOID(s);
            fill_until_spilling(s);
            bad_h = 0;
            if (first_block_on(s, bad_h, TKV_TIER_HOST, NB, &bad_l, &bad_b)) {
                CHECK(tkv_kvs_test_flip_bit(s, bad_l, bad_h, bad_b, TKV_TIER_HOST) == TKV_OK, "flip: %s",
                      tkv_last_error());
                if (via_prefetch) {
                    struct tkv_kvs_stats k0, k1;
                    uint32_t on_compute0 = 0, on_compute1 = 0;
                    for (uint32_t h = 0; h < H; h++)
                        for (uint32_t b = 0; b < NB; b++)
                            on_compute0 += tkv_kvs_block_tier(s, bad_l, h, b) == TKV_TIER_COMPUTE;
                    tkv_kvs_get_stats(s, &k0);
                    tkv_kvs_prefetch(s, bad_l);
                    CHECK(tkv_kvs_prefetch_wait(s) == TKV_OK, "prefetch wait: %s", tkv_last_error());
                    CHECK(tkv_kvs_prefetch_done(s), "prefetch not done after wait");
                    CHECK(tkv_kvs_block_tier(s, bad_l, bad_h, bad_b) == TKV_TIER_HOST,
                          "%s: a corrupt block was prefetched", be->ops->name);
                    /* the intact blocks it moved are current on the compute tier */
                    tkv_kvs_get_stats(s, &k1);
                    for (uint32_t h = 0; h < H; h++)
                        for (uint32_t b = 0; b < NB; b++)
                            on_compute1 += tkv_kvs_block_tier(s, bad_l, h, b) == TKV_TIER_COMPUTE;
                    const uint64_t moved = k1.prefetched_blocks - k0.prefetched_blocks;
                    CHECK(bi == 0 || moved > 1, "%s: the prefetch moved %llu blocks", be->ops->name,
                          (unsigned long long)moved);
                    CHECK(on_compute1 - on_compute0 + 1 >= moved, "%s: %llu blocks prefetched, %u became current",
                          be->ops->name, (unsigned long long)moved, on_compute1 - on_compute0);
                }
                st = tkv_kvs_begin_layer(s, bad_l, 0, 0);
                CHECK(st == TKV_ERR_CORRUPT, "%s host bit flip%s: expected TKV_ERR_CORRUPT, got %s", be->ops->name,
                      via_prefetch ? " (after a prefetch)" : "", tkv_status_str(st));
            } else {
                CHECK(false, "no block was left on the host tier to corrupt");
            }
            tkv_kvs_free(s);
        }
        be = saved;
        dfr.no_checks = false;
    }

    /* 5b. an NVMe copy below a device compute tier goes up through the
     * staging pipeline: checked by the device (the deferred backend), by the
     * CPU (no_checks) or on the synchronous path (cpu); the flipped block
     * is TKV_ERR_CORRUPT, and every other layer still reads back intact */
    for (int bi = 0; bi < 3; bi++) {
        struct tkv_backend *saved = be;
        be = backends[bi];
        dfr.no_checks = bi == 2;
        s = make_store(false, 34, 32, true);
        REQUIRE_VOID(s);
        fill_until_spilling(s);
        bad_h = 1;
        const bool found = first_block_on(s, bad_h, TKV_TIER_NVME, NB, &bad_l, &bad_b);
        CHECK(found, "%s: no block was left on NVMe alone to corrupt", be->ops->name);
        if (found) {
            CHECK(tkv_kvs_test_flip_bit(s, bad_l, bad_h, bad_b, TKV_TIER_NVME) == TKV_OK, "flip: %s",
                  tkv_last_error());
            st = tkv_kvs_begin_layer(s, bad_l, 0, 0);
            CHECK(st == TKV_ERR_CORRUPT, "%s nvme bit flip below a device: expected TKV_ERR_CORRUPT, got %s",
                  be->ops->name, tkv_status_str(st));
            for (uint32_t l = 0; l < L; l++) {
                if (l == bad_l)
                    continue;
                st = tkv_kvs_begin_layer(s, l, 0, 0);
                CHECK(st == TKV_OK, "%s: after the corrupt recall, begin_layer(%u): %s", be->ops->name, l,
                      tkv_last_error());
                if (st == TKV_OK) {
                    check_layer_views(s, l, "after a corrupt NVMe recall");
                    tkv_kvs_end_layer(s, l);
                }
            }
        }
        tkv_kvs_free(s);
        be = saved;
        dfr.no_checks = false;
    }

    /* 6. without a lower tier, a full compute tier is a clear error */
    s = make_store(true, 34, 0, false);
    REQUIRE_VOID(s);
    st = TKV_OK;
    while (st == TKV_OK && length < CTX)
        st = append(s, 32);
    CHECK(st == TKV_ERR_NOMEM && strstr(tkv_last_error(), "nvme-dir"),
          "no NVMe tier: expected TKV_ERR_NOMEM mentioning --nvme-dir, got %s: %s", tkv_status_str(st), tkv_last_error());
    check_all(s, "after a full compute tier");
    tkv_kvs_free(s);

    /* 7. a compute tier smaller than one layer is refused at init */
    struct tkv_kvs_params p = {.n_layer = L, .n_head_kv = H, .head_dim = HD, .block_tokens = B, .max_tokens = CTX,
                               .compute_is_host = true, .compute_bytes = 4096 * 8};
    struct tkv_kvs *bad = NULL;
    CHECK(tkv_kvs_init(&p, be, &bad) == TKV_ERR_INVALID_ARG && !bad, "tiny compute tier must be refused");
}

/* A host copy is checked once after it lands (kv-layout.md, "Integrity"):
 * recalled twice, the second recall sums nothing on the CPU; a bit flipped
 * after that check is still caught at the next read; a host copy written
 * anew (the block changed, then spilled) is checked again. On the three
 * recall paths below a device: synchronous uploads (CPU backend), uploads
 * the device checks, uploads the CPU checks. */
static void test_host_checked_once(void)
{
    struct tkv_backend *const cpu_be = be;
    for (int bi = 0; bi < 3; bi++) {
        be = bi == 0 ? cpu_be : deferred_backend(cpu_be);
        dfr.no_checks = bi == 2;
        const bool cpu_sums = bi != 1; /* the device sums on path 1 */
        const char *name = bi == 0 ? "sync" : bi == 1 ? "device-checked" : "cpu-checked";
        struct tkv_kvs *s = make_store(false, 34, 40, true);
        if (!s)
            break;
        fill_until_spilling(s);
        uint32_t l = 0, h = 0, b = NB;
        for (uint32_t ll = 0; ll < L && b == NB; ll++)
            for (uint32_t bb = 0; bb < NB && b == NB; bb++)
                if (tkv_kvs_block_tier(s, ll, 1, bb) == TKV_TIER_HOST)
                    l = ll, h = 1, b = bb;
        CHECK(b < NB, "%s: no block on the host tier", name);
        if (b == NB) {
            tkv_kvs_free(s);
            continue;
        }
        const uint32_t MB = tkv_kvs_max_blocks(s), S = tkv_kvs_block_bytes(s);
        static uint8_t need[H * CTX];
        memset(need, 0, sizeof need);
        need[h * MB + b] = 1;
        /* one selective read of the block (a recall), then back to the host tier;
         * returns the CPU bytes the read summed, or UINT64_MAX on an error */
        uint64_t summed[4];
        tkv_status st = TKV_OK;
        for (int r = 0; r < 4 && st == TKV_OK; r++) {
            if (r == 2) /* corruption at rest after the check */
                CHECK(tkv_kvs_test_flip_bit(s, l, h, b, TKV_TIER_HOST) == TKV_OK, "flip: %s", tkv_last_error());
            if (r == 3) { /* repaired, then the block changes: a new host copy */
                CHECK(tkv_kvs_test_flip_bit(s, l, h, b, TKV_TIER_HOST) == TKV_OK, "flip: %s", tkv_last_error());
                st = tkv_kvs_begin_layer_sel(s, l, b * B, 1, need);
                CHECK(st == TKV_OK, "%s: write begin: %s", name, tkv_last_error());
                if (st != TKV_OK)
                    break;
                uint16_t *k, *v;
                tkv_kvs_locate(s, l, h, b * B, &k, &v);
                for (uint32_t d = 0; d < HD; d++)
                    mirror[l][h][b * B][0][d] = (uint16_t)test_rand_u64(&rng);
                be->ops->upload(be, k, mirror[l][h][b * B][0], HD * 2);
                tkv_kvs_end_layer(s, l);
                CHECK(tkv_kvs_demote(s, l, h, b) == TKV_OK, "%s: demote: %s", name, tkv_last_error());
            }
            CHECK(tkv_kvs_block_tier(s, l, h, b) == TKV_TIER_HOST, "%s read %d: the block is not on the host tier",
                  name, r);
            struct tkv_kvs_stats k0, k1;
            tkv_kvs_get_stats(s, &k0);
            st = tkv_kvs_begin_layer_sel(s, l, 0, 0, need);
            tkv_kvs_get_stats(s, &k1);
            summed[r] = k1.stall.verify_bytes - k0.stall.verify_bytes;
            if (r == 2) {
                char want[96];
                snprintf(want, sizeof want, "(layer %u, head %u, block %u)", l, h, b);
                CHECK(st == TKV_ERR_CORRUPT && strstr(tkv_last_error(), want),
                      "%s: a bit flipped after the check gave %s: %s", name, tkv_status_str(st), tkv_last_error());
                CHECK(tkv_kvs_block_tier(s, l, h, b) == TKV_TIER_HOST, "%s: the corrupt block moved", name);
                st = TKV_OK;
                continue;
            }
            CHECK(st == TKV_OK, "%s read %d: %s", name, r, tkv_last_error());
            if (st != TKV_OK)
                break;
            const struct tkv_kv_block_ref *ref = &tkv_kvs_view(s, l, h).blocks[b];
            uint16_t kk[B][HD];
            be->ops->download(be, kk, ref->k, (size_t)ref->n * HD * 2);
            CHECK(!memcmp(kk[0], mirror[l][h][b * B][0], HD * 2), "%s read %d: the block differs", name, r);
            tkv_kvs_end_layer(s, l);
            CHECK(tkv_kvs_demote(s, l, h, b) == TKV_OK, "%s: demote: %s", name, tkv_last_error());
        }
        if (st == TKV_OK) {
            CHECK(summed[1] == 0, "%s: a host copy checked before was summed again (%llu bytes)", name,
                  (unsigned long long)summed[1]);
            CHECK(summed[2] == (cpu_sums ? S : 0), "%s: the flipped copy: %llu bytes summed", name,
                  (unsigned long long)summed[2]);
            CHECK(summed[3] == (cpu_sums ? S : 0), "%s: the new host copy: %llu bytes summed", name,
                  (unsigned long long)summed[3]);
        }
        tkv_kvs_free(s);
    }
    dfr.no_checks = false;
    be = cpu_be;
}

/* One decode step of selective reads: layer l reads need[l], and the first
 * n_sel blocks sel[l][h][] of each head are checked against the mirror;
 * returns the blocks the step recalled. */
static uint64_t stale_step(struct tkv_kvs *s, uint8_t (*need)[H * CTX], uint32_t (*sel)[H][8], uint32_t n_sel)
{
    struct tkv_kvs_stats k0, k1;
    tkv_kvs_get_stats(s, &k0);
    for (uint32_t l = 0; l < L; l++) {
        CHECK(tkv_kvs_begin_layer_sel(s, l, 0, 0, need[l]) == TKV_OK, "layer %u: %s", l, tkv_last_error());
        for (uint32_t h = 0; h < H; h++) /* the selection's bytes */
            for (uint32_t j = 0; j < n_sel; j++) {
                const uint32_t b = sel[l][h][j];
                const struct tkv_kv_block_ref *r = &tkv_kvs_view(s, l, h).blocks[b];
                uint16_t k[B][HD];
                be->ops->download(be, k, r->k, (size_t)r->n * HD * 2);
                for (uint32_t r0 = 0; r0 < r->n; r0++)
                    CHECK(!memcmp(k[r0], mirror[l][h][b * B + r0][0], HD * 2),
                          "layer %u head %u block %u differs from the mirror", l, h, b);
            }
        tkv_kvs_end_layer(s, l);
    }
    tkv_kvs_get_stats(s, &k1);
    return k1.stall.recalled_blocks - k0.stall.recalled_blocks;
}

enum { HOT = 3, EXTRA = 7 }; /* the stale-block scenarios' selection, and layer 1's blocks read once */

/* The stale-block scenarios' start: a store (evicting by the layer cycle
 * alone with cycle, keeping a device page table with table) whose compute
 * tier holds one layer's blocks, filled until it spills, then emptied; need
 * and sel hold every layer's selection (blocks 0 .. HOT-1 of every head)
 * and, for step 0, EXTRA more blocks of layer 1 per head. NULL when the
 * store could not be made. */
static struct tkv_kvs *selection_store(bool cycle, bool table, uint8_t (*need)[H * CTX], uint32_t (*sel)[H][8])
{
    evict_cycle = cycle, page_table = table;
    struct tkv_kvs *s = make_store(false, H * NB, L * H * NB, false); /* one layer's blocks */
    evict_cycle = page_table = false;
    if (!s)
        return NULL;
    fill_until_spilling(s);
    for (uint32_t l = 0; l < L; l++) /* an empty compute tier */
        for (uint32_t h = 0; h < H; h++)
            for (uint32_t b = 0; b < NB; b++)
                CHECK(tkv_kvs_demote(s, l, h, b) == TKV_OK, "demote: %s", tkv_last_error());
    const uint32_t MB = tkv_kvs_max_blocks(s);
    memset(need, 0, L * sizeof *need);
    for (uint32_t l = 0; l < L; l++)
        for (uint32_t h = 0; h < H; h++)
            for (uint32_t j = 0; j < HOT; j++)
                sel[l][h][j] = j, need[l][h * MB + j] = 1;
    for (uint32_t h = 0; h < H; h++)
        for (uint32_t b = HOT; b < HOT + EXTRA; b++)
            need[1][h * MB + b] = 1;
    return s;
}

/* The stale blocks go first. The compute tier (one layer's worth of
 * blocks) holds each layer's selection, read at every step, and 14 more
 * blocks of layer 1 read once; then layer 0 reads one block more. By the
 * layer cycle alone the victim would be a block of layer 2 -- the farthest
 * layer, whose resident blocks are its selection -- and layer 2 would
 * recall it at its turn (so it goes with evict_cycle, the A/B switch); with
 * blocks no read has touched for two steps evicted first, the victim is one
 * of layer 1's unread blocks, and the step recalls just the new block. */
static void test_evict_stale(bool cycle)
{
    static uint8_t need[L][H * CTX];
    uint32_t sel[L][H][8];
    struct tkv_kvs *s = selection_store(cycle, false, need, sel);
    if (!s)
        return;
    const uint32_t MB = tkv_kvs_max_blocks(s);
    const uint64_t r0 = stale_step(s, need, sel, HOT);
    for (uint32_t h = 0; h < H; h++)
        for (uint32_t b = HOT; b < HOT + EXTRA; b++)
            need[1][h * MB + b] = 0;
    uint64_t r[3];
    for (int t = 0; t < 3; t++)
        r[t] = stale_step(s, need, sel, HOT);
    need[0][NB - 1] = 1; /* head 0's last block, off the compute tier */
    sel[0][0][HOT] = NB - 1;
    CHECK(tkv_kvs_block_tier(s, 0, 0, NB - 1) != TKV_TIER_COMPUTE, "the new block is in already");
    const uint64_t r4 = stale_step(s, need, sel, HOT);
    fprintf(stderr, "%s eviction: blocks recalled at steps 0-4: %llu %llu %llu %llu %llu\n",
            cycle ? "layer-cycle" : "stale-first", (unsigned long long)r0, (unsigned long long)r[0], (unsigned long long)r[1], (unsigned long long)r[2],
            (unsigned long long)r4);
    CHECK(r0 == (uint64_t)L * H * HOT + H * EXTRA && r[0] + r[1] + r[2] == 0,
          "the tier did not settle: %llu, then %llu %llu %llu blocks recalled", (unsigned long long)r0,
          (unsigned long long)r[0], (unsigned long long)r[1], (unsigned long long)r[2]);
    if (cycle) {
        CHECK(r4 == 2, "by the layer cycle one new block cost %llu recalls, not 2", (unsigned long long)r4);
    } else {
        CHECK(r4 == 1, "one new block cost %llu recalls (a selection's block was evicted)", (unsigned long long)r4);
        for (uint32_t l = 0; l < L; l++)
            for (uint32_t h = 0; h < H; h++)
                for (uint32_t j = 0; j < HOT; j++)
                    CHECK(tkv_kvs_block_tier(s, l, h, j) == TKV_TIER_COMPUTE,
                          "block (%u,%u,%u) of the selection left the compute tier", l, h, j);
    }
    tkv_kvs_free(s);
}

/* Read marks (tkv_kvs_mark_reads): blocks read in place, as through the
 * device decode table, with no begin_layer naming them. The compute tier
 * holds each layer's selection (blocks 0-2 of every head) and 14 more
 * blocks of layer 1, all brought in at step 0; at steps 1-3 every layer
 * begins naming nothing and reads its selection in place, and layer 0
 * then needs one block more. With the reads marked, the victim is one of
 * layer 1's unread blocks and every selection block stays; without marks
 * the selections look as stale as those blocks, and the farthest layer's
 * selection goes first. */
static void test_mark_reads(bool marks)
{
    static uint8_t need[L][H * CTX], none[H * CTX];
    uint32_t sel[L][H][8];
    struct tkv_kvs *s = selection_store(false, true, need, sel);
    if (!s)
        return;
    const uint32_t W = tkv_kvs_mark_words(s);
    uint32_t rows[H * (CTX / 32 + 1)]; /* [H][W]: the selection's bits */
    REQUIRE_VOID(W == (tkv_kvs_max_blocks(s) + 31) / 32 && W <= CTX / 32 + 1);
    memset(rows, 0, sizeof rows);
    for (uint32_t h = 0; h < H; h++)
        rows[h * W] = (1u << HOT) - 1;
    uint64_t r = stale_step(s, need, sel, HOT);
    CHECK(r == (uint64_t)L * H * HOT + H * EXTRA, "step 0 recalled %llu blocks", (unsigned long long)r);
    for (int t = 1; t <= 3; t++) {
        for (uint32_t l = 0; l < L; l++) {
            CHECK(tkv_kvs_begin_layer_sel(s, l, 0, 0, none) == TKV_OK, "layer %u: %s", l, tkv_last_error());
            for (uint32_t h = 0; h < H; h++)
                for (uint32_t j = 0; j < HOT; j++)
                    CHECK(tkv_kvs_block_tier(s, l, h, j) == TKV_TIER_COMPUTE, "step %d: block (%u,%u,%u) not in place",
                          t, l, h, j);
            tkv_kvs_end_layer(s, l);
        }
        for (uint32_t l = 0; marks && l < L; l++) /* at the step's end, as the engine */
            CHECK(tkv_kvs_mark_reads(s, l, rows) == TKV_OK, "mark_reads: %s", tkv_last_error());
    }
    memset(need, 0, sizeof need);
    need[0][NB - 1] = 1; /* head 0's last block, off the compute tier */
    CHECK(tkv_kvs_begin_layer_sel(s, 0, 0, 0, need[0]) == TKV_OK, "%s", tkv_last_error());
    tkv_kvs_end_layer(s, 0);
    uint32_t left = 0;
    for (uint32_t l = 0; l < L; l++)
        for (uint32_t h = 0; h < H; h++)
            for (uint32_t j = 0; j < HOT; j++)
                left += tkv_kvs_block_tier(s, l, h, j) != TKV_TIER_COMPUTE;
    fprintf(stderr, "read marks %s: %u selection blocks left the compute tier\n", marks ? "given" : "not given", left);
    if (marks)
        CHECK(left == 0, "%u blocks read in place and marked were evicted", left);
    else
        CHECK(left == 1, "%u selection blocks evicted without marks, not 1 (the farthest layer's)", left);
    CHECK(tkv_kvs_mark_reads(s, L, rows) == TKV_ERR_INVALID_ARG && strstr(tkv_last_error(), "layer"), "%s",
          tkv_last_error());
    tkv_kvs_free(s);
    s = make_store(false, H * NB, L * H * NB, false); /* no page table: no marks */
    if (s) {
        CHECK(tkv_kvs_mark_reads(s, 0, rows) == TKV_ERR_INVALID_ARG && strstr(tkv_last_error(), "page table"),
              "%s", tkv_last_error());
        tkv_kvs_free(s);
    }
}

/* The backend's block uploads on their own: n scattered blocks from
 * registered host memory to device memory, in a random order, sizes that
 * take the gather kernel (multiples of 16) and the copy-engine path. */
static void test_gpu_upload_blocks(struct tkv_backend *g)
{
    enum { NBLK = 300 };
    const size_t sizes[] = {16384, 4096 + 16, 1000};
    for (int si = 0; si < 3; si++) {
        const size_t S = sizes[si], total = (size_t)NBLK * S;
        uint8_t *host = tkv_io_alloc_aligned(total), *back = malloc(total);
        void *dev = NULL;
        REQUIRE_VOID(host && back && g->ops->alloc(g, total, &dev) == TKV_OK);
        REQUIRE_VOID(g->ops->host_register(g, host, total) == TKV_OK);
        for (size_t i = 0; i < total; i++)
            host[i] = (uint8_t)test_rand_u64(&rng);
        void *dst[NBLK];
        const void *src[NBLK];
        for (uint32_t j = 0; j < NBLK; j++) { /* block j goes to slot (j * 7) % NBLK */
            src[j] = host + (size_t)j * S;
            dst[j] = (uint8_t *)dev + (size_t)((j * 7) % NBLK) * S;
        }
        /* checksums of what should land; two deliberately wrong */
        uint32_t crc[NBLK];
        uint8_t bad[NBLK];
        for (uint32_t j = 0; j < NBLK; j++)
            crc[j] = tkv_crc32c(0, src[j], S) ^ (j == 5 || j == 250 ? 0x100u : 0u);
        const bool verify = S % 4096 == 0;
        uint64_t ticket = 0;
        tkv_status ust = g->ops->upload_blocks(g, dst, src, NBLK, S, crc, bad, &ticket);
        CHECK(verify ? ust == TKV_OK : ust == TKV_ERR_UNSUPPORTED, "upload_blocks with checksums of %zu bytes: %s", S,
              tkv_status_str(ust));
        if (ust != TKV_OK)
            ust = g->ops->upload_blocks(g, dst, src, NBLK, S, NULL, NULL, &ticket);
        CHECK(ust == TKV_OK, "upload_blocks: %s", tkv_last_error());
        CHECK(ust != TKV_OK || ticket > 0, "upload_blocks gave no ticket");
        CHECK(g->ops->upload_fence(g, ticket) == TKV_OK, "upload_fence: %s", tkv_last_error());
        bool done = false;
        CHECK(g->ops->upload_wait(g, ticket, false, &done) == TKV_OK, "upload_wait (poll): %s", tkv_last_error());
        CHECK(g->ops->upload_wait(g, ticket, true, &done) == TKV_OK && done, "upload_wait: %s", tkv_last_error());
        if (verify) {
            uint32_t flagged = 0, right = 0;
            for (uint32_t j = 0; j < NBLK; j++) {
                flagged += bad[j] == 1;
                right += bad[j] == (j == 5 || j == 250);
            }
            CHECK(right == NBLK, "device checksums of %zu-byte blocks: %u of %d verdicts right (%u flagged, want 2)",
                  S, right, NBLK, flagged);
        }
        CHECK(g->ops->download(g, back, dev, total) == TKV_OK, "download: %s", tkv_last_error());
        uint32_t wrong = 0;
        for (uint32_t j = 0; j < NBLK; j++)
            wrong += memcmp(back + (size_t)((j * 7) % NBLK) * S, host + (size_t)j * S, S) != 0;
        CHECK(wrong == 0, "upload_blocks of %zu bytes: %u of %d blocks differ", S, wrong, NBLK);
        fprintf(stderr, "upload_blocks: %d blocks of %zu bytes, %u differ\n", NBLK, S, wrong);
        g->ops->host_unregister(g, host);
        g->ops->release(g, dev);
        tkv_io_free_aligned(host);
        free(back);
    }
}

/* The fast CRC-32C (three interleaved streams joined by GF(2) products)
 * against the bitwise reference: random lengths around the interleaving
 * threshold and block sizes, random starting values and alignments. */
/* ---- scoped eviction against the full pass --------------------------------------- */

/* Decode-like traffic (appends, whole-layer reads, selections of a layer's
 * blocks, split reads on the host tier, prefetches, demotions, bulk imports)
 * on two stores in lockstep: one with the fast paths (eviction listing the
 * farthest layers' slots only, the cut bucket's first places selected;
 * whole-layer reads pinned and stamped as one, walking only the blocks that
 * can have changed; selective reads pinning, unpinning and clearing the
 * views of only the blocks they read), one with the reference passes
 * (evict_ref, walk_ref). After every operation each block must sit on the
 * same tier in both and the tier counters must agree: the same victims, in
 * the same order. A layer's views must be byte-identical across the two, and
 * every entry's position and length equal, with pointers or without. With more layers than the mirror
 * test, so that a pass really takes only a few. */
enum { EL = 12, EH = 2, EB = 16, EHD = 64, ECTX = 512, ENB = ECTX / EB, ES = 4 * EB * EHD };

static bool evict_same(struct tkv_kvs *a, struct tkv_kvs *r, const char *name, int op)
{
    for (uint32_t l = 0; l < EL; l++)
        for (uint32_t h = 0; h < EH; h++)
            for (uint32_t b = 0; b < ENB; b++)
                if (tkv_kvs_block_tier(a, l, h, b) != tkv_kvs_block_tier(r, l, h, b)) {
                    CHECK(false, "%s op %d: block (%u,%u,%u) on tier %d scoped, %d reference", name, op, l, h, b,
                          tkv_kvs_block_tier(a, l, h, b), tkv_kvs_block_tier(r, l, h, b));
                    return false;
                }
    struct tkv_kvs_stats x, y;
    tkv_kvs_get_stats(a, &x);
    tkv_kvs_get_stats(r, &y);
    for (int t = 0; t < TKV_TIER_COUNT; t++)
        if (x.tier[t].bytes_in != y.tier[t].bytes_in || x.tier[t].bytes_out != y.tier[t].bytes_out ||
            x.tier[t].used_bytes != y.tier[t].used_bytes || x.tier[t].hits != y.tier[t].hits) {
            CHECK(false, "%s op %d: tier %d counters differ (in %llu/%llu out %llu/%llu)", name, op, t,
                  (unsigned long long)x.tier[t].bytes_in, (unsigned long long)y.tier[t].bytes_in,
                  (unsigned long long)x.tier[t].bytes_out, (unsigned long long)y.tier[t].bytes_out);
            return false;
        }
    return true;
}

static bool views_same(struct tkv_kvs *a, struct tkv_kvs *r, uint32_t l, bool host, const char *name, int op)
{
    static uint8_t pa[ES], pr[ES];
    for (uint32_t h = 0; h < EH; h++) {
        struct tkv_kv_head_view va = host ? tkv_kvs_host_view(a, l, h) : tkv_kvs_view(a, l, h);
        struct tkv_kv_head_view vr = host ? tkv_kvs_host_view(r, l, h) : tkv_kvs_view(r, l, h);
        for (uint32_t b = 0; b < va.n_blocks; b++) {
            const struct tkv_kv_block_ref *x = &va.blocks[b], *y = &vr.blocks[b];
            if (x->pos0 != y->pos0 || x->n != y->n || x->pos0 != (int32_t)(b * EB)) { /* with pointers or not */
                CHECK(false, "%s op %d: layer %u head %u block %u: pos0 %d n %u, reference pos0 %d n %u", name, op,
                      l, h, b, x->pos0, x->n, y->pos0, y->n);
                return false;
            }
            if (!x->k != !y->k) {
                CHECK(false, "%s op %d: layer %u head %u block %u present in one view only", name, op, l, h, b);
                return false;
            }
            if (!x->k)
                continue;
            const size_t n = (size_t)x->n * EHD * 2;
            if (host) {
                memcpy(pa, x->k, n), memcpy(pa + n, x->v, n), memcpy(pr, y->k, n), memcpy(pr + n, y->v, n);
            } else {
                be->ops->download(be, pa, x->k, n), be->ops->download(be, pa + n, x->v, n);
                be->ops->download(be, pr, y->k, n), be->ops->download(be, pr + n, y->v, n);
            }
            if (memcmp(pa, pr, 2 * n)) {
                CHECK(false, "%s op %d: layer %u head %u block %u differs between the stores", name, op, l, h, b);
                return false;
            }
        }
    }
    return true;
}

static void test_evict_scoped(bool compute_is_host, const char *name)
{
    struct tkv_kvs *st[2] = {NULL, NULL}; /* scoped, reference */
    for (int i = 0; i < 2; i++) {
        struct tkv_kvs_params p = {.n_layer = EL, .n_head_kv = EH, .head_dim = EHD, .block_tokens = EB,
                                   .max_tokens = ECTX, .compute_is_host = compute_is_host,
                                   .compute_bytes = (uint64_t)3 * EH * ENB * ES, /* 3 of 12 layers */
                                   .host_bytes = compute_is_host ? 0 : (uint64_t)5 * EH * ENB * ES,
                                   .nvme_dir = spill_dir, .upload_piece_bytes = 5 * ES, .evict_ref = i == 1,
                                   .walk_ref = i == 1};
        tkv_status e = tkv_kvs_init(&p, be, &st[i]);
        CHECK(e == TKV_OK, "%s: kvs_init: %s", name, tkv_last_error());
    }
    static uint8_t need[EH * (ENB + 1)], host_ok[EH * (ENB + 1)], row[2 * EHD * 2], run[ENB][ES];
    const void *src[ENB];
    uint32_t len = 0;
    const int fail0 = test_failures_;
    const uint32_t MB = st[0] ? tkv_kvs_max_blocks(st[0]) : 0;
    for (int op = 0; st[0] && st[1] && op < 1500 && test_failures_ == fail0; op++) {
        const uint32_t r = (uint32_t)(test_rand_u64(&rng) % 100), l = (uint32_t)(test_rand_u64(&rng) % EL);
        const uint32_t nb = (len + EB - 1) / EB;
        uint64_t seed = test_rand_u64(&rng); /* the same draws for both stores */
        if (r < 30 && len < ECTX) { /* a decode step's worth of layers writing, or a prefill chunk */
            const uint32_t n = TKV_MIN(r < 10 ? 1 + (uint32_t)(seed % 48) : 1u, ECTX - len);
            for (int i = 0; i < 2; i++) {
                CHECK(tkv_kvs_reserve(st[i], len + n) == TKV_OK, "%s: reserve: %s", name, tkv_last_error());
                tkv_kvs_set_length(st[i], len + n);
            }
            /* layer by layer on both stores: the whole-layer reads' views
             * (the shortcut's against every block walked) compared after
             * the writes */
            for (uint32_t ll = 0; ll < EL && test_failures_ == fail0; ll++) {
                for (int i = 0; i < 2; i++) {
                    uint64_t g = seed ^ ll;
                    tkv_status e = tkv_kvs_begin_layer(st[i], ll, len, n);
                    CHECK(e == TKV_OK, "%s op %d: begin_layer: %s", name, op, tkv_last_error());
                    if (e != TKV_OK)
                        break;
                    for (uint32_t h = 0; h < EH; h++)
                        for (uint32_t q = len; q < len + n; q++) {
                            uint16_t *k, *v;
                            tkv_kvs_locate(st[i], ll, h, q, &k, &v);
                            for (size_t j = 0; j < sizeof row; j++)
                                row[j] = (uint8_t)test_rand_u64(&g);
                            be->ops->upload(be, k, row, EHD * 2);
                            be->ops->upload(be, v, row + EHD * 2, EHD * 2);
                        }
                }
                if (test_failures_ == fail0)
                    views_same(st[0], st[1], ll, false, name, op);
                tkv_kvs_end_layer(st[0], ll);
                tkv_kvs_end_layer(st[1], ll);
            }
            len += n;
        } else if (r < 40 && nb > 0) { /* a whole layer read (no write) */
            for (int i = 0; i < 2; i++)
                CHECK(tkv_kvs_begin_layer(st[i], l, 0, 0) == TKV_OK, "%s op %d: begin_layer: %s", name, op,
                      tkv_last_error());
            if (test_failures_ == fail0)
                views_same(st[0], st[1], l, false, name, op);
            for (uint32_t h = 0; h < EH; h++) { /* nothing read on the host tier */
                const struct tkv_kv_head_view hv = tkv_kvs_host_view(st[0], l, h);
                for (uint32_t b = 0; b < hv.n_blocks; b++)
                    if (hv.blocks[b].k) {
                        CHECK(false, "%s op %d: whole-layer read, host view of (%u, %u, %u) holds a pointer", name,
                              op, l, h, b);
                        break;
                    }
            }
            tkv_kvs_end_layer(st[0], l);
            tkv_kvs_end_layer(st[1], l);
        } else if (r < 75 && nb > 0) { /* a selection (and some blocks read on the host tier) */
            uint64_t g = seed;
            memset(need, 0, sizeof need);
            for (uint32_t h = 0; h < EH; h++)
                for (uint32_t b = 0; b < nb; b++) {
                    need[h * MB + b] = test_rand_u64(&g) % 4 == 0;
                    host_ok[h * MB + b] = test_rand_u64(&g) % 2 == 0;
                }
            const bool split = !compute_is_host && r >= 60;
            for (int i = 0; i < 2; i++) {
                tkv_status e = tkv_kvs_begin_layer_split(st[i], l, 0, 0, need, split ? host_ok : NULL, NULL);
                CHECK(e == TKV_OK, "%s op %d: begin_layer_split: %s", name, op, tkv_last_error());
            }
            if (test_failures_ == fail0)
                if (views_same(st[0], st[1], l, false, name, op)) /* (without a split: no host pointers) */
                    views_same(st[0], st[1], l, true, name, op);
            tkv_kvs_end_layer(st[0], l);
            tkv_kvs_end_layer(st[1], l);
        } else if (r < 85) { /* the next layer's prefetch */
            for (int i = 0; i < 2; i++) {
                tkv_kvs_prefetch(st[i], l);
                /* NVMe reads land when the disk says: the stores would part
                 * ways on timing, not on eviction (the late uploads land
                 * only when asked: those stay in flight) */
                if (compute_is_host)
                    CHECK(tkv_kvs_prefetch_wait(st[i]) == TKV_OK, "%s: prefetch_wait: %s", name, tkv_last_error());
            }
        } else if (r < 92 && nb > 0) {
            const uint32_t h = (uint32_t)(seed % EH), b = (uint32_t)(seed >> 8) % nb;
            for (int i = 0; i < 2; i++)
                CHECK(tkv_kvs_demote(st[i], l, h, b) == TKV_OK, "%s: demote: %s", name, tkv_last_error());
        } else if (nb > 1) { /* truncate to a block boundary and refill a head in one run (the fill) */
            const uint32_t keep = (uint32_t)(seed % nb) * EB;
            uint64_t g = seed;
            for (uint32_t b = keep / EB; b < nb; b++) {
                for (size_t j = 0; j < ES; j++)
                    run[b - keep / EB][j] = (uint8_t)test_rand_u64(&g);
                src[b - keep / EB] = run[b - keep / EB];
            }
            for (int i = 0; i < 2; i++) {
                tkv_kvs_set_length(st[i], keep);
                tkv_kvs_set_length(st[i], len);
                for (uint32_t ll = 0; ll < EL; ll++)
                    for (uint32_t hh = 0; hh < EH; hh++) {
                        /* every head refilled: a block left empty holds no defined bytes */
                        const uint32_t b0 = keep / EB, m = nb - b0;
                        CHECK(tkv_kvs_import_n(st[i], ll, hh, b0, m, src) == TKV_OK, "%s: import_n: %s", name,
                              tkv_last_error());
                    }
            }
        }
        if (test_failures_ == fail0)
            evict_same(st[0], st[1], name, op);
    }
    struct tkv_kvs_stats x;
    if (st[0]) {
        tkv_kvs_get_stats(st[0], &x);
        fprintf(stderr, "%s: %llu begin_layer, %llu eviction passes, %llu evicted, %llu spilled, %llu recalled\n", name,
                (unsigned long long)x.stall.layers, (unsigned long long)x.stall.evict_passes,
                (unsigned long long)x.stall.evicted_blocks, (unsigned long long)x.stall.spilled_blocks,
                (unsigned long long)x.stall.recalled_blocks);
        CHECK(x.stall.evict_passes > 100 && x.stall.spilled_blocks > 0, "%s: too little eviction to compare", name);
        const double parts = x.stall.settle_s + x.stall.evict_s + x.stall.verify_s + x.stall.upload_issue_s +
                             x.stall.upload_wait_s + x.stall.nvme_s + x.stall.other_s;
        CHECK(fabs(parts - x.stall_seconds) <= 1e-9 + 1e-9 * x.stall_seconds,
              "%s: the stall's parts sum to %.9f s, the stall is %.9f s", name, parts, x.stall_seconds);
    }
    /* a corrupt block among a layer's many recalls: named, the rest intact */
    if (st[0] && !compute_is_host && test_failures_ == fail0) {
        struct tkv_kvs *s = st[0];
        /* prefetches landed first: a block they bring up is not recalled */
        CHECK(tkv_kvs_prefetch_wait(s) == TKV_OK, "%s: prefetch_wait: %s", name, tkv_last_error());
        uint32_t bl = EL, bh = 0, bb = 0, n_host = 0;
        for (uint32_t l = 0; l < EL && bl == EL; l++) {
            n_host = 0;
            for (uint32_t h = 0; h < EH; h++)
                for (uint32_t b = 0; b < (len + EB - 1) / EB; b++)
                    if (tkv_kvs_block_tier(s, l, h, b) == TKV_TIER_HOST && ++n_host == 7)
                        bl = l, bh = h, bb = b;
        }
        CHECK(bl < EL, "%s: no layer with 7 blocks on the host tier", name);
        if (bl < EL) {
            static uint8_t before[ES];
            const uint32_t ob = bb == 0 ? 1 : 0; /* another block of the batch */
            CHECK(tkv_kvs_export(s, bl, bh, ob, before) == TKV_OK, "export: %s", tkv_last_error());
            CHECK(tkv_kvs_test_flip_bit(s, bl, bh, bb, TKV_TIER_HOST) == TKV_OK, "flip: %s", tkv_last_error());
            tkv_status e = tkv_kvs_begin_layer(s, bl, 0, 0);
            char want[96];
            snprintf(want, sizeof want, "(layer %u, head %u, block %u)", bl, bh, bb);
            CHECK(e == TKV_ERR_CORRUPT && strstr(tkv_last_error(), want), "%s: corrupt block in a batch: %s (%s)",
                  name, tkv_status_str(e), tkv_last_error());
            static uint8_t after[ES];
            CHECK(tkv_kvs_export(s, bl, bh, ob, after) == TKV_OK && !memcmp(before, after, ES),
                  "%s: a good block of the corrupt batch changed", name);
        }
    }
    tkv_kvs_free(st[0]);
    tkv_kvs_free(st[1]);
}

/* Home slots (docs/kv-layout.md): a compute tier that holds the whole
 * context gives each head's blocks one stride within each home segment,
 * whatever order they are written in -- a prompt reserved at once and
 * written in chunks through every layer, then tokens one at a time with
 * the engine's reservation ahead -- and the bytes stay the mirror's.
 * Without homes (no_homes), or when a segment's allocation fails, the same
 * writes interleave the heads' blocks and nothing else changes. Returns
 * the blocks (of all heads) not at one block's stride after their
 * predecessor, over the first 13 blocks a head (the writes stop there:
 * past them this tier, exactly the context, has no room for a third
 * segment, as each segment's allocation is rounded up to whole slabs, and
 * the last blocks take the leftover slots). */
static uint32_t homes_run(bool compute_is_host, bool homes, const char *name)
{
    const uint32_t S = 4 * B * HD;
    no_homes = !homes;
    struct tkv_kvs *s = make_store(compute_is_host, L * H * NB, 0, false);
    no_homes = false;
    if (!s)
        return 0;
    const uint32_t prompt = 100, ahead = 32;
    CHECK(tkv_kvs_reserve(s, prompt) == TKV_OK, "%s: %s", name, tkv_last_error());
    while (length < prompt)
        CHECK(append(s, TKV_MIN(24u, prompt - length)) == TKV_OK, "%s: %s", name, tkv_last_error());
    const uint32_t nb = 13;
    while (length < nb * B) {
        CHECK(tkv_kvs_reserve(s, TKV_MIN((uint32_t)CTX, length + 1 + ahead)) == TKV_OK, "%s: %s", name,
              tkv_last_error());
        CHECK(append(s, 1) == TKV_OK, "%s: %s", name, tkv_last_error());
    }
    check_all(s, name);
    uint32_t breaks = 0;
    for (uint32_t l = 0; l < L; l++)
        for (uint32_t h = 0; h < H; h++)
            for (uint32_t b = 0; b + 1 < nb; b++) {
                const uint64_t a0 = tkv_kvs_test_compute_addr(s, l, h, b);
                const uint64_t a1 = tkv_kvs_test_compute_addr(s, l, h, b + 1);
                CHECK(a0 && a1, "%s: block %u of (%u, %u) has no compute slot", name, a0 ? b + 1 : b, l, h);
                breaks += a1 != a0 + S;
            }
    tkv_kvs_free(s);
    fprintf(stderr, "%s: %u of %u blocks off their head's stride\n", name, breaks, L * H * (nb - 1));
    return breaks;
}

static void test_homes(void)
{
    /* the prompt's 7 blocks get a segment of 8 a head (HOME_MIN_W), the
     * first decode reserve past it one of what the tier has left (5 a head:
     * 96 slots, the first segment's 48 rounded up to 64): each head's 13
     * blocks in two runs, one break a head */
    CHECK(homes_run(true, true, "home slots, host compute tier") == L * H, "home slots: not one break a head");
    CHECK(homes_run(false, true, "home slots, device compute tier") == L * H, "home slots: not one break a head");
    const uint32_t plain = homes_run(true, false, "no home slots (no_homes)");
    CHECK(plain > 2 * L * H, "no_homes: %u breaks; the chunked writes should interleave the heads", plain);
    /* a segment's allocation fails: plain slabs, the same bytes */
    struct tkv_backend *cpu_be = be;
    be = deferred_backend(cpu_be);
    dfr.refuse_allocs = 1; /* the first: the prompt's segment */
    CHECK(homes_run(false, true, "home slots, the segment's allocation refused") == plain,
          "a refused segment did not fall back to the plain layout");
    CHECK(dfr.refuse_allocs == 0, "the segment's allocation was not asked for");
    be = cpu_be;
    /* the randomized operations on stores whose compute tier holds the context */
    struct tkv_kvs *s = make_store(true, L * H * NB, 0, true);
    if (s) {
        random_ops(s, 1500, "homes host+nvme");
        tkv_kvs_free(s);
    }
    s = make_store(false, L * H * NB, 0, true);
    if (s) {
        random_ops(s, 1500, "homes device+nvme");
        tkv_kvs_free(s);
    }
}

static void test_crc32c(void)
{
    static uint8_t buf[70000];
    for (size_t i = 0; i < sizeof buf; i++)
        buf[i] = (uint8_t)test_rand_u64(&rng);
    const size_t lens[] = {0, 1, 7, 8, 23, 3071, 3072, 3073, 3095, 4096, 16384, 16385, 65536, 65536 + 13};
    int bad = 0;
    for (int r = 0; r < 200; r++) {
        size_t len = r < 14 ? lens[r] : (size_t)(test_rand_u64(&rng) % 66000);
        size_t off = (size_t)(test_rand_u64(&rng) % 64);
        uint32_t c0 = r % 2 ? (uint32_t)test_rand_u64(&rng) : 0;
        uint32_t fast = tkv_crc32c(c0, buf + off, len), ref = tkv_crc32c_ref(c0, buf + off, len);
        if (fast != ref && bad++ < 5)
            CHECK(false, "crc32c of %zu bytes at +%zu from %08x: fast %08x, reference %08x", len, off, c0, fast, ref);
    }
    CHECK(tkv_crc32c(0, "123456789", 9) == 0xE3069283u, "crc32c check value");
    /* the algebra the GPU verification joins slices with */
    for (int r = 0; r < 20; r++) {
        size_t a = (size_t)(test_rand_u64(&rng) % 5000), b = (size_t)(test_rand_u64(&rng) % 5000);
        uint32_t ra = ~tkv_crc32c_ref(0xFFFFFFFFu, buf, a), rb = ~tkv_crc32c_ref(0xFFFFFFFFu, buf + a, b);
        uint32_t joined = tkv_crc32c_mulmod(ra, tkv_crc32c_x8n(b)) ^ rb;
        uint32_t std = ~(joined ^ tkv_crc32c_mulmod(0xFFFFFFFFu, tkv_crc32c_x8n(a + b)));
        CHECK(std == tkv_crc32c_ref(0, buf, a + b), "crc join of %zu + %zu bytes", a, b);
    }
}

int main(void)
{
    rng = test_seed();
    const char *base = getenv("TKV_BUILD_DIR") ? getenv("TKV_BUILD_DIR") : "/var/tmp";
    snprintf(spill_dir, sizeof spill_dir, "%s/test-kv-store-spill.%d", base, getpid());
    REQUIRE(mkdir(spill_dir, 0700) == 0, "mkdir %s: %s", spill_dir, strerror(errno));
    REQUIRE(tkv_backend_create("cpu", 1, &be) == TKV_OK, "%s", tkv_last_error());
    /* The hwloc topology is loaded once per process, with its I/O devices:
     * on a GPU machine that opens the driver's device files for good. Load
     * it before counting, so the count sees only descriptors we own. */
    (void)tkv_host_numa_nodes();
    const int fds_before = count_fds();
    test_crc32c();

    struct tkv_kvs *s = make_store(true, 40, 0, true);
    if (s) {
        random_ops(s, 3000, "host+nvme");
        tkv_kvs_free(s);
    }
    s = make_store(false, 36, 40, true);
    if (s) {
        random_ops(s, 3000, "device+host+nvme");
        tkv_kvs_free(s);
    }
    /* the asynchronous upload path (recalls, prefetches, staged NVMe reads) */
    struct tkv_backend *cpu_be = be;
    be = deferred_backend(cpu_be);
    s = make_store(false, 36, 40, true);
    if (s) {
        random_ops(s, 3000, "device (late uploads)+host+nvme");
        tkv_kvs_free(s);
    }
    CHECK(dfr.queued > 0 && dfr.fences > 0, "the asynchronous uploads were never used (%llu queued)",
          (unsigned long long)dfr.queued);
    CHECK(dfr.downloads > 0, "the batched spill downloads were never used");
    be = cpu_be;
    test_prefetch_pipeline();
    test_prefetch_last();
    setenv("TKV_IO_FORCE_SYNC", "1", 1);
    s = make_store(true, 40, 0, true);
    if (s) {
        random_ops(s, 1500, "host+nvme (sync io)");
        tkv_kvs_free(s);
    }
    unsetenv("TKV_IO_FORCE_SYNC");
    test_faults();
    test_spill_room();
    test_host_checked_once();
    test_evict_stale(false);
    test_evict_stale(true);
    test_mark_reads(true);
    test_mark_reads(false);
    test_import_n(true, 40, 0, "import_n host+nvme");
    test_import_n(false, 40, 40, "import_n device+host+nvme");
    test_write_back();
    be = deferred_backend(cpu_be);
    test_import_n(false, 40, 40, "import_n device (late uploads)+host+nvme");
    be = cpu_be;
    test_import_n_faults();
    test_homes();
    test_evict_scoped(true, "scoped eviction host+nvme");
    test_evict_scoped(false, "scoped eviction device+host+nvme");
    be = deferred_backend(cpu_be);
    test_evict_scoped(false, "scoped eviction device (late uploads)+host+nvme");
    be = cpu_be;
    /* before the GPU part: the CUDA driver keeps its device files open */
    const int fds_after = count_fds();
    CHECK(fds_after == fds_before, "file descriptors leaked: %d before, %d after", fds_before, fds_after);
    if (fds_after != fds_before)
        list_fds();

    /* the real GPU tiers where a GPU is: device memory, pinned host tier
     * (hwloc, registered with CUDA), NVMe */
    struct tkv_backend *cpu = be, *gpu = NULL;
    if (tkv_backend_create("cuda", 1, &gpu) == TKV_OK) {
        be = gpu;
        s = make_store(false, 36, 40, true);
        if (s) {
            random_ops(s, 3000, "gpu+host+nvme");
            tkv_kvs_free(s);
        }
        test_gpu_upload_blocks(gpu);
        be = cpu;
        gpu->ops->free(gpu);
    } else {
        fprintf(stderr, "no usable GPU (%s): the gpu+host+nvme configuration did not run\n", tkv_last_error());
    }

    CHECK(dir_entries(spill_dir) == 0, "spill files left in %s", spill_dir);
    rmdir(spill_dir);
    be->ops->free(be);
    return test_done();
}
