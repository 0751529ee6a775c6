/*
 * bench-stall.c -- the KV store's begin_layer at decode, alone: where the
 * recall stall goes (tkv_kvs_stats.stall) with a selection per step, at the
 * page-table scale of a long context but without a model or a GPU.
 *
 *   bench-stall [--ctx 131072] [--layers 32] [--heads 8] [--head-dim 16] [--block-tokens 64]
 *               [--compute-frac 0.5] [--read 0.10] [--fresh 0.25] [--host-read 0]
 *               [--steps 8] [--warmup 2] [--seed 1] [--evict-ref] [--walk-ref] [--device-crc]
 *               [--write-back] [--evict-cycle]
 *
 * The compute tier is a "device": the CPU backend behind a wrapper that
 * says its memory is not host memory and queues block uploads (copied at
 * once; checksums left to the store's CPU threads, or with --device-crc
 * checked by the "device" as each copy lands, as the CUDA backend's kernel
 * does: that time is then upload issue, not verify), so the store takes its
 * GPU path: a pinned host tier below (holding the whole context), recalls
 * as one upload batch per layer, dirty victims spilled to the host tier.
 * The defaults give llama3-8b's page table at 128K (32 layers x 8 KV heads
 * x 2048 blocks = 524K blocks; a compute tier of half of them, 262K slots,
 * as --gpu-kv-mem 8G holds of 32 KiB blocks) with 4 KiB blocks (head_dim 16),
 * so the per-block bookkeeping is the H200 run's and the bytes are 1/8.
 *
 * Fill: every block imported (tkv_kvs_import_n per head: what does not fit
 * goes to the host tier), then --warmup steps reading every block (as the
 * rabitq index's first decode step does), then --steps timed steps. Each
 * step, per (layer, head), reads --read of the blocks: a fixed "hot" set
 * and a --fresh share of it drawn anew, plus the block being written; with
 * --host-read, that share of the needed host-tier blocks is read in place
 * (begin_layer_split, the heterogeneous path). --evict-ref: the store's
 * reference eviction (every slot scanned, the cut bucket sorted whole).
 * --evict-cycle: eviction by the layer cycle alone (no stale blocks first;
 * docs/kv-layout.md, "Eviction").
 * --write-back: tkv_kvs_write_back after the fill, as the engine does after
 * a prefill (the fill's blocks on the "device" get host copies, so that
 * evicting them writes nothing down; compare with --warmup 0).
 * --walk-ref: the store's reference begin_layer (every block of the layer
 * walked, pinned and stamped; with --read 1 the steps are whole-layer reads,
 * which otherwise look only at the blocks that can have changed).
 */
#include "cpu/cpu.h"
#include "tiers/crc32c.h"
#include "tiers/kv-store.h"

#include "bench.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the "device": the CPU backend with queued block uploads ------------------ */

struct dev {
    struct tkv_backend base;
    struct tkv_backend *cpu;
    struct tkv_backend_ops ops;
    uint64_t seq;
    bool crc; /* --device-crc */
};

static struct tkv_backend *cpu_of(struct tkv_backend *b) { return ((struct dev *)b)->cpu; }
static tkv_status dev_alloc(struct tkv_backend *b, size_t n, void **out) { return cpu_of(b)->ops->alloc(cpu_of(b), n, out); }
static void dev_release(struct tkv_backend *b, void *p) { cpu_of(b)->ops->release(cpu_of(b), p); }
static tkv_status dev_upload(struct tkv_backend *b, void *d, const void *s, size_t n)
{
    memcpy(d, s, n);
    (void)b;
    return TKV_OK;
}
static tkv_status dev_download(struct tkv_backend *b, void *d, const void *s, size_t n)
{
    memcpy(d, s, n);
    (void)b;
    return TKV_OK;
}
static tkv_status dev_download_blocks(struct tkv_backend *b, void *const *dst, const void *const *src, uint32_t n,
                                      size_t bytes)
{
    (void)b;
    for (uint32_t j = 0; j < n; j++)
        memcpy(dst[j], src[j], bytes);
    return TKV_OK;
}
static tkv_status dev_sync(struct tkv_backend *b)
{
    (void)b;
    return TKV_OK;
}
static tkv_status dev_upload_blocks(struct tkv_backend *b, void *const *dst, const void *const *src, uint32_t n,
                                    size_t bytes, const uint32_t *crc, uint8_t *bad, uint64_t *ticket)
{
    if (crc && !((struct dev *)b)->crc)
        return tkv_err(TKV_ERR_UNSUPPORTED, "bench device: no checks on the device");
    for (uint32_t j = 0; j < n; j++) {
        memcpy(dst[j], src[j], bytes);
        if (crc) /* what landed */
            bad[j] = tkv_crc32c(0, dst[j], bytes) != crc[j];
    }
    if (ticket)
        *ticket = n ? ++((struct dev *)b)->seq : 0;
    return TKV_OK;
}
static tkv_status dev_upload_fence(struct tkv_backend *b, uint64_t upto)
{
    (void)b, (void)upto;
    return TKV_OK;
}
static tkv_status dev_upload_wait(struct tkv_backend *b, uint64_t upto, bool block, bool *done)
{
    (void)b, (void)upto, (void)block;
    if (done)
        *done = true;
    return TKV_OK;
}

/* Page-locking faults the pages in (cudaHostRegister does): the host tier's
 * first writes then cost what they cost on the GPU host, no page faults. */
static tkv_status dev_host_register(struct tkv_backend *b, void *p, size_t bytes)
{
    (void)b;
    for (size_t o = 0; o < bytes; o += 4096)
        ((volatile uint8_t *)p)[o] = 0;
    return TKV_OK;
}
static void dev_host_unregister(struct tkv_backend *b, void *p) { (void)b, (void)p; }

/* ---- the run ------------------------------------------------------------------- */

static int die(const char *what)
{
    fprintf(stderr, "bench-stall: %s: %s\n", what, tkv_last_error());
    return 1;
}

int main(int argc, char **argv)
{
    uint32_t ctx = 131072, L = 32, H = 8, hd = 16, B = 64, steps = 8, warmup = 2;
    double compute_frac = 0.5, read = 0.10, fresh = 0.25, host_read = 0;
    bool evict_ref = false, walk_ref = false, device_crc = false, write_back = false, evict_cycle = false;
    for (int i = 1; i < argc; i += 2) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : "";
        if (!strcmp(a, "--evict-ref")) evict_ref = true, i--;
        else if (!strcmp(a, "--walk-ref")) walk_ref = true, i--;
        else if (!strcmp(a, "--evict-cycle")) evict_cycle = true, i--;
        else if (!strcmp(a, "--device-crc")) device_crc = true, i--;
        else if (!strcmp(a, "--write-back")) write_back = true, i--;
        else if (!strcmp(a, "--ctx")) ctx = (uint32_t)atoi(v);
        else if (!strcmp(a, "--layers")) L = (uint32_t)atoi(v);
        else if (!strcmp(a, "--heads")) H = (uint32_t)atoi(v);
        else if (!strcmp(a, "--head-dim")) hd = (uint32_t)atoi(v);
        else if (!strcmp(a, "--block-tokens")) B = (uint32_t)atoi(v);
        else if (!strcmp(a, "--compute-frac")) compute_frac = atof(v);
        else if (!strcmp(a, "--read")) read = atof(v);
        else if (!strcmp(a, "--fresh")) fresh = atof(v);
        else if (!strcmp(a, "--host-read")) host_read = atof(v);
        else if (!strcmp(a, "--steps")) steps = (uint32_t)atoi(v);
        else if (!strcmp(a, "--warmup")) warmup = (uint32_t)atoi(v);
        else if (!strcmp(a, "--seed")) bench_rng_state ^= (uint64_t)atoll(v) * 0x2545F4914F6CDD1Dull;
        else {
            fprintf(stderr, "bench-stall: unknown option %s (see the top of bench/bench-stall.c)\n", a);
            return 2;
        }
    }
    struct dev d = {.crc = device_crc};
    if (tkv_cpu_backend_create(1, &d.cpu) != TKV_OK)
        return die("cpu backend");
    d.ops = (struct tkv_backend_ops){.name = "bench-device", .alloc = dev_alloc, .release = dev_release,
                                     .upload = dev_upload, .download = dev_download, .synchronize = dev_sync,
                                     .upload_blocks = dev_upload_blocks, .upload_fence = dev_upload_fence,
                                     .upload_wait = dev_upload_wait, .host_register = dev_host_register,
                                     .host_unregister = dev_host_unregister, .download_blocks = dev_download_blocks};
    d.base.ops = &d.ops;
    const uint32_t S = 4 * B * hd, nb = ctx / B, MB = (ctx + steps + warmup + B - 1) / B + 1;
    const uint64_t total = (uint64_t)L * H * MB;
    struct tkv_kvs_params p = {.n_layer = L, .n_head_kv = H, .head_dim = hd, .block_tokens = B,
                               .max_tokens = MB * B, .compute_bytes = (uint64_t)(compute_frac * total) * S,
                               .host_bytes = total * S, .evict_ref = evict_ref,
                               .walk_ref = walk_ref, .evict_cycle = evict_cycle};
    struct tkv_kvs *s;
    if (tkv_kvs_init(&p, &d.base, &s) != TKV_OK)
        return die("init");
    /* fill: each head's blocks in one run (random payloads, 64 distinct) */
    uint8_t *pay = malloc((size_t)64 * S);
    const void **src = malloc((size_t)nb * sizeof *src);
    for (size_t j = 0; j < (size_t)64 * S; j++)
        pay[j] = (uint8_t)(rnd() >> 56);
    for (uint32_t b = 0; b < nb; b++)
        src[b] = pay + (size_t)(b % 64) * S;
    if (tkv_kvs_reserve(s, ctx + steps + warmup) != TKV_OK)
        return die("reserve");
    tkv_kvs_set_length(s, ctx);
    double t0 = now();
    for (uint32_t l = 0; l < L; l++)
        for (uint32_t h = 0; h < H; h++)
            if (tkv_kvs_import_n(s, l, h, 0, nb, src) != TKV_OK)
                return die("import");
    const double fill_s = now() - t0;
    uint32_t n_back = 0;
    t0 = now();
    if (write_back && tkv_kvs_write_back(s, &n_back) != TKV_OK)
        return die("write_back");
    const double back_s = now() - t0;
    const uint32_t MBs = tkv_kvs_max_blocks(s);
    uint8_t *need = calloc((size_t)H * MBs, 1), *host_ok = calloc((size_t)H * MBs, 1);
    uint8_t *hot = calloc((size_t)L * H * MBs, 1);
    for (size_t j = 0; j < (size_t)L * H * MBs; j++)
        hot[j] = (uint32_t)(rnd() % 1000000) < (uint32_t)(read * (1 - fresh) * 1e6);
    struct tkv_kvs_stats a, z;
    const bool whole = read >= 1 && host_read <= 0; /* no selection to make */
    uint32_t pos = ctx;
    double step_s = 0;
    for (uint32_t st = 0; st < warmup + steps; st++, pos++) {
        if (st == warmup) {
            tkv_kvs_get_stats(s, &a);
            t0 = now();
        }
        tkv_kvs_set_length(s, pos + 1);
        const uint32_t n_b = (pos + 1 + B - 1) / B;
        for (uint32_t l = 0; l < L; l++) {
            if (whole || st < warmup) { /* every block: the engine's begin_layer without a selection */
                if (tkv_kvs_begin_layer(s, l, pos, 1) != TKV_OK)
                    return die("begin_layer");
                tkv_kvs_end_layer(s, l);
                continue;
            }
            for (uint32_t h = 0; h < H; h++)
                for (uint32_t b = 0; b < n_b; b++) {
                    const size_t r = (size_t)h * MBs + b;
                    need[r] = st < warmup || hot[((size_t)l * H + h) * MBs + b] ||
                              (uint32_t)(rnd() % 1000000) < (uint32_t)(read * fresh * 1e6);
                    host_ok[r] = (uint32_t)(rnd() % 1000000) < (uint32_t)(host_read * 1e6);
                }
            tkv_status e = tkv_kvs_begin_layer_split(s, l, pos, 1, need, host_read > 0 ? host_ok : NULL, NULL);
            if (e != TKV_OK)
                return die("begin_layer");
            tkv_kvs_end_layer(s, l);
        }
    }
    step_s = (now() - t0) / steps;
    tkv_kvs_get_stats(s, &z);
    const struct tkv_kvs_stall *x = &z.stall, *y = &a.stall;
    const double k = steps;
#define D(f) ((x->f - y->f) / k)
    printf("bench-stall: ctx %u, %u layers x %u KV heads x %u blocks of %u B (%u tokens), compute tier %.0f%% "
           "(%llu slots), host tier below; read %.2f (fresh %.2f), host reads %.2f; eviction %s; uploads checked %s; "
           "fill %.2f s; write-back %u blocks in %.2f s; %u warm-up, %u steps\n\n",
           ctx, L, H, nb, S, B, compute_frac * 100, (unsigned long long)(compute_frac * total), read, fresh, host_read,
           evict_ref     ? "reference (full scan)"
           : evict_cycle ? "scoped, by the layer cycle alone"
                         : "scoped",
           device_crc ? "by the device" : "on the CPU", fill_s, n_back, back_s, warmup, steps);
    if (whole)
        printf("steps: whole-layer reads (no selection)%s\n\n", walk_ref ? ", every block walked (--walk-ref)" : "");
    printf("| step ms | stall ms | settle | evict | verify | upload issue | upload wait | nvme | other | recalls | "
           "evict passes | scanned K slots | evicted | spilled | uploads | waits | CPU CRC MB | us/recall |\n");
    printf("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    const double stall = (z.stall_seconds - a.stall_seconds) / k;
    printf("| %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.0f | %.1f | %.1f | %.0f | %.0f | %.1f "
           "| %.1f | %.2f | %.2f |\n",
           step_s * 1e3, stall * 1e3, D(settle_s) * 1e3, D(evict_s) * 1e3, D(verify_s) * 1e3, D(upload_issue_s) * 1e3,
           D(upload_wait_s) * 1e3, D(nvme_s) * 1e3, D(other_s) * 1e3, D(recalled_blocks), D(evict_passes),
           D(evict_scanned) / 1e3, D(evicted_blocks), D(spilled_blocks), D(upload_calls), D(upload_waits),
           D(verify_bytes) / 1e6, D(recalled_blocks) > 0 ? stall / D(recalled_blocks) * 1e6 : 0.0);
#undef D
    tkv_kvs_free(s);
    d.cpu->ops->free(d.cpu);
    free(pay), free(src), free(need), free(host_ok), free(hot);
    return 0;
}
