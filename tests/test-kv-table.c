/*
 * test-kv-table.c -- the pieces of a decode step without a host round trip
 * per layer (docs/rabitq.md, "Decode without a host round trip per layer"),
 * on the CPU:
 *   - kv_table (the decode attention table from a selection bitmap and a
 *     page table) and table_write on the CPU backend and on the opaque one
 *     (tagged pointers: the op must not read through the page table's
 *     entries), against an oracle on fresh random inputs (kv-table-cases.h;
 *     test-gpu-rabitq runs the same cases on CUDA);
 *   - the KV store's device page table (tkv_kvs_page_table): decode-like
 *     traffic with evictions, NVMe spills, prefetches in flight and
 *     truncations, and after every layer a sync and the whole table compared
 *     with each block's record and, inside begin/end, with the views (on the
 *     CPU, opaque and -- where there is a device -- CUDA backends); the
 *     store's verdict that a layer is mapped (every block below the length
 *     has an entry: a decode table can miss nothing) against the table.
 */
#include "test.h"
#include "opaque-backend.h"
#include "kv-table-cases.h"
#include "tiers/kv-store.h"

#include <errno.h>
#include <sys/stat.h>
#include <unistd.h>

enum { L = 3, H = 2, HD = 64, BT = 16, CTX = 1024 };

static uint64_t rng;
static char spill_dir[256];

static uint64_t n_mapped, n_unmapped; /* check_layer's verdicts of tkv_kvs_layer_mapped */

/* Syncs layer l and compares its whole device table with the records (and,
 * with views, with the views of the blocks they point at); the store at
 * length len says the layer is mapped exactly when every block below len
 * has an entry. */
static void check_layer(struct tkv_backend *be, struct tkv_kvs *s, uint32_t l, uint32_t len, bool views,
                        const char *when)
{
    const uint32_t MB = tkv_kvs_max_blocks(s);
    uint64_t *t = malloc((size_t)H * MB * sizeof *t);
    REQUIRE_VOID(t);
    uint32_t n_written = 0;
    CHECK(tkv_kvs_page_table_sync(s, l, &n_written) == TKV_OK, "%s: sync(%u): %s", when, l, tkv_last_error());
    CHECK(be->ops->download(be, t, tkv_kvs_page_table(s, l), (size_t)H * MB * sizeof *t) == TKV_OK, "%s",
          tkv_last_error());
    int bad = 0;
    for (uint32_t h = 0; h < H; h++) {
        const struct tkv_kv_head_view v = views ? tkv_kvs_view(s, l, h) : (struct tkv_kv_head_view){0};
        for (uint32_t b = 0; b < MB && bad < 4; b++) {
            const uint64_t slot = tkv_kvs_test_compute_addr(s, l, h, b), got = t[(size_t)h * MB + b];
            const uint64_t want = tkv_kvs_block_tier(s, l, h, b) == TKV_TIER_COMPUTE ? slot : 0;
            CHECK(tkv_kvs_block_tier(s, l, h, b) != TKV_TIER_COMPUTE || slot, "%s: a current copy without a slot",
                  when);
            const bool in_view = b < v.n_blocks && v.blocks[b].k;
            const bool ok = got == want && (!in_view || got == (uint64_t)(uintptr_t)v.blocks[b].k);
            CHECK(ok, "%s: layer %u head %u block %u: table %#llx, record %#llx, view %p", when, l, h, b,
                  (unsigned long long)got, (unsigned long long)want, in_view ? (void *)v.blocks[b].k : NULL);
            bad += !ok;
        }
    }
    bool all = true;
    for (uint32_t h = 0; h < H; h++)
        for (uint32_t b = 0; b < (len + BT - 1) / BT; b++)
            all &= t[(size_t)h * MB + b] != 0;
    CHECK(tkv_kvs_layer_mapped(s, l) == all, "%s: layer %u %s mapped, the store says otherwise", when, l,
          all ? "is" : "is not");
    n_mapped += all, n_unmapped += !all;
    /* a second sync with nothing moved writes nothing (blocks still arriving
     * are 0 either way) */
    CHECK(tkv_kvs_page_table_sync(s, l, &n_written) == TKV_OK && n_written == 0, "%s: a repeated sync wrote %u",
          when, n_written);
    free(t);
}

/* Decode-like traffic on a store with a compute tier of a bit more than one
 * layer: prompts, steps with random selections, prefetches, truncations. */
static void store_traffic(struct tkv_backend *be, bool compute_is_host, const char *name)
{
    const uint32_t S = 4 * BT * HD, MB = CTX / BT;
    struct tkv_kvs_params p = {.n_layer = L, .n_head_kv = H, .head_dim = HD, .block_tokens = BT, .max_tokens = CTX,
                               .compute_is_host = compute_is_host,
                               .compute_bytes = (uint64_t)(H * MB + 40) * S,
                               .host_bytes = compute_is_host ? 0 : (uint64_t)(H * MB) * S,
                               .nvme_dir = spill_dir, .page_table = true};
    struct tkv_kvs *s = NULL;
    REQUIRE_VOID(tkv_kvs_init(&p, be, &s) == TKV_OK);
    CHECK(tkv_kvs_page_table(s, 0) && !tkv_kvs_page_table(s, L), "%s: page table pointers", name);
    n_mapped = n_unmapped = 0;
    for (uint32_t l = 0; l < L; l++)
        check_layer(be, s, l, 0, false, "fresh");
    uint8_t *need = malloc((size_t)H * MB);
    REQUIRE_VOID(need);
    uint32_t len = 0;
    char when[96];
    for (int step = 0; step < 160; step++) {
        const uint64_t r = test_rand_u64(&rng) % 40;
        uint32_t n_write = 1;
        /* truncate, once 40 steps have run past the compute tier: a
         * truncation at step 1 or 2 left some seeds no recall to check
         * (seed 43780398117402: 33 tokens, 0 recalled) */
        if (r == 0 && len > 0 && step >= 40) {
            len = (uint32_t)(test_rand_u64(&rng) % len);
            tkv_kvs_set_length(s, len);
            snprintf(when, sizeof when, "%s step %d: truncated to %u", name, step, len);
            for (uint32_t l = 0; l < L; l++)
                check_layer(be, s, l, len, false, when);
            continue;
        }
        if (step == 0) /* a prompt past the compute tier: the later steps evict and recall */
            n_write = 500;
        else if (r < 3 || len == 0) /* a prompt chunk */
            n_write = 1 + (uint32_t)(test_rand_u64(&rng) % 200);
        if (len + n_write > CTX)
            break;
        REQUIRE_VOID(tkv_kvs_reserve(s, len + n_write) == TKV_OK);
        tkv_kvs_set_length(s, len + n_write);
        const uint32_t nb = (len + n_write + BT - 1) / BT;
        for (uint32_t l = 0; l < L; l++) {
            const int mode = (int)(test_rand_u64(&rng) % 4); /* whole, sparse, dense, none */
            for (size_t i = 0; i < (size_t)H * MB; i++)
                need[i] = mode == 2 ? test_rand_u64(&rng) % 4 != 0 : mode == 1 ? test_rand_u64(&rng) % 8 == 0 : 0;
            if (test_rand_u64(&rng) % 2)
                tkv_kvs_prefetch(s, (l + 1) % L);
            const tkv_status st = tkv_kvs_begin_layer_sel(s, l, len, n_write, mode ? need : NULL);
            CHECK(st == TKV_OK, "%s: begin_layer(%u): %s", name, l, tkv_last_error());
            if (st != TKV_OK)
                continue;
            snprintf(when, sizeof when, "%s step %d layer %u (mode %d, %u blocks)", name, step, l, mode, nb);
            check_layer(be, s, l, len + n_write, true, when);
            tkv_kvs_end_layer(s, l);
            /* another layer, which may have prefetches in flight and evictions */
            const uint32_t o = (uint32_t)(test_rand_u64(&rng) % L);
            check_layer(be, s, o, len + n_write, false, when);
        }
        len += n_write;
    }
    struct tkv_kvs_stats stats;
    tkv_kvs_get_stats(s, &stats);
    fprintf(stderr, "%s: %u tokens, %llu evictions, %llu prefetched, %llu recalled\n", name, len,
            (unsigned long long)stats.stall.evicted_blocks, (unsigned long long)stats.prefetched_blocks,
            (unsigned long long)stats.stall.recalled_blocks);
    CHECK(stats.stall.evicted_blocks > 0 && stats.stall.recalled_blocks > 0, "%s: the traffic never moved a block",
          name);
    CHECK(n_mapped > 0 && n_unmapped > 0, "%s: layers mapped %llu times, not %llu: one verdict untested", name,
          (unsigned long long)n_mapped, (unsigned long long)n_unmapped);
    /* a store without the table refuses the sync */
    struct tkv_kvs *plain = NULL;
    p.page_table = false;
    p.nvme_dir = NULL;
    p.compute_bytes = 0;
    p.host_bytes = 0;
    p.compute_is_host = true;
    REQUIRE_VOID(tkv_kvs_init(&p, be, &plain) == TKV_OK);
    CHECK(!tkv_kvs_page_table(plain, 0) && tkv_kvs_page_table_sync(plain, 0, NULL) == TKV_ERR_INVALID_ARG,
          "%s: a store without the table", name);
    CHECK(tkv_kvs_page_table_sync(s, L, NULL) == TKV_ERR_INVALID_ARG, "%s: sync of layer %u", name, L);
    CHECK(!tkv_kvs_layer_mapped(plain, 0) && !tkv_kvs_layer_mapped(s, L), "%s: mapped without a table, or past the "
          "layers", name);
    tkv_kvs_free(plain);
    tkv_kvs_free(s);
    free(need);
}

int main(void)
{
    rng = test_seed();
    const char *base = getenv("TKV_BUILD_DIR") ? getenv("TKV_BUILD_DIR") : "/var/tmp";
    snprintf(spill_dir, sizeof spill_dir, "%s/test-kv-table-spill.%d", base, getpid());
    REQUIRE(mkdir(spill_dir, 0700) == 0, "mkdir %s: %s", spill_dir, strerror(errno));
    struct tkv_backend *cpu = NULL, *opq = NULL;
    REQUIRE(tkv_backend_create("cpu", 1, &cpu) == TKV_OK, "%s", tkv_last_error());
    REQUIRE(opaque_create("opaque", 1, &opq) == TKV_OK, "%s", tkv_last_error());

    kvt_all(cpu, &rng, 200);
    kvt_all(opq, &rng, 100);
    CHECK(opaque_kv_table_calls > 0, "the opaque backend's kv_table never ran");

    /* refusals name the field */
    const uint32_t sel_n[2] = {10, 5};
    uint64_t pt[4] = {0};
    uint32_t bm[2] = {0, 0}, counts[8]; /* bm: [n_heads][words]; counts: [n_heads][4] */
    struct tkv_kv_block_ref refs[8], miss[8];
    struct tkv_kv_table_args a = {.bitmap = bm, .words = 1, .sel_n = sel_n, .ptab = pt, .ptab_stride = 2,
                                  .n_heads = 2, .block_tokens = 8, .head_dim = 64, .n_past = 12, .refs = refs,
                                  .miss = miss, .cap = 4, .counts = counts};
    CHECK(cpu->ops->kv_table(cpu, &a) == TKV_OK, "%s", tkv_last_error());
    a.ptab_stride = 1;
    CHECK(cpu->ops->kv_table(cpu, &a) == TKV_ERR_INVALID_ARG && strstr(tkv_last_error(), "ptab_stride"), "%s",
          tkv_last_error());
    a.ptab_stride = 2, a.n_past = 9;
    CHECK(cpu->ops->kv_table(cpu, &a) == TKV_ERR_INVALID_ARG && strstr(tkv_last_error(), "head 0"), "%s",
          tkv_last_error());
    a.n_past = 12, a.block_tokens = 0;
    CHECK(cpu->ops->kv_table(cpu, &a) == TKV_ERR_INVALID_ARG, "block_tokens 0 accepted");
    a.block_tokens = 8, a.counts = NULL;
    CHECK(cpu->ops->kv_table(cpu, &a) == TKV_ERR_INVALID_ARG, "NULL counts accepted");
    uint32_t marks[2];
    a.counts = counts, a.marks = marks, a.mark_words = 0; /* 12 tokens in blocks of 8: one word a head */
    CHECK(cpu->ops->kv_table(cpu, &a) == TKV_ERR_INVALID_ARG && strstr(tkv_last_error(), "mark_words"), "%s",
          tkv_last_error());
    a.mark_words = 1;
    CHECK(cpu->ops->kv_table(cpu, &a) == TKV_OK && marks[0] == 2u && marks[1] == 3u,
          "marks %08x %08x: head 0 reads the tail [10, 12) in block 1, head 1 [5, 12) in blocks 0 and 1", marks[0],
          marks[1]);
    CHECK(cpu->ops->kv_table(cpu, NULL) == TKV_ERR_INVALID_ARG, "NULL args accepted");

    store_traffic(cpu, true, "cpu");
    store_traffic(opq, false, "opaque");
    /* a backend without table_write: the store uploads entry by entry */
    static struct tkv_backend_ops no_tw;
    no_tw = *opq->ops;
    no_tw.table_write = NULL;
    const struct tkv_backend_ops *had = opq->ops;
    opq->ops = &no_tw;
    store_traffic(opq, false, "opaque, no table_write");
    opq->ops = had;

    struct tkv_backend *gpu = NULL; /* where there is one: the store's table in device memory */
    if (tkv_backend_cuda_devices() > 0 && tkv_backend_create("cuda", 0, &gpu) == TKV_OK) {
        kvt_all(gpu, &rng, 100);
        store_traffic(gpu, false, "cuda");
        gpu->ops->free(gpu);
    }
    opq->ops->free(opq);
    cpu->ops->free(cpu);
    rmdir(spill_dir);
    return test_done();
}
