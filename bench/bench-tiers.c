/*
 * bench-tiers.c -- each KV tier link: our path's bytes/s next to the raw
 * limit measured in the same run.
 *
 *   bench-tiers [--dir DIR] [--mib N] [--block-tokens B] [--head-dim D] [--device cpu|cuda] [-o md|jsonl]
 *
 *   nvme -> compute   recall of whole layers (batched, as begin_layer does)
 *                     vs one large sequential O_DIRECT read of a file of the
 *                     same size in the same directory (io_uring, 1 MiB x QD 16)
 *   nvme random       single-block recalls of random blocks (QD 1), blocks/s
 *   host -> gpu       (cuda only) recall of layers from the pinned host tier
 *                     vs one large upload of the same bytes
 *
 * Each link is measured on two paths: recall (begin_layer alone, a compute
 * tier of one layer, so every layer is recalled on demand each pass) and
 * prefetch (the engine's order: prefetch(l+1), then begin_layer(l), a
 * compute tier of two layers, so the next layer moves while the current one
 * is settled). The store holds N MiB of KV.
 */
#include "io/io.h"
#include "tiers/kv-store.h"

#include "bench.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static int die(const char *what)
{
    fprintf(stderr, "bench-tiers: %s: %s\n", what, tkv_last_error());
    return 1;
}

/* A same-size file in the same directory, read sequentially with O_DIRECT
 * (1 MiB x QD 16): the raw limit of the NVMe link. */
struct raw_file {
    struct tkv_io *io;
    struct tkv_io_file *f;
    uint8_t *buf;
    uint64_t bytes;
};
#define RAW_CHUNK (1u << 20)
#define RAW_QD 16u

static int raw_open(struct raw_file *r, const char *dir, uint64_t bytes)
{
    struct tkv_io_params p = tkv_io_default_params();
    r->bytes = bytes;
    if (tkv_io_init(&p, &r->io) < 0 || tkv_io_file_open_tmp(r->io, dir, &r->f) < 0 ||
        !(r->buf = tkv_io_alloc_aligned((size_t)RAW_CHUNK * RAW_QD)) || tkv_io_file_resize(r->f, bytes) < 0)
        return -1;
    memset(r->buf, 0x5a, (size_t)RAW_CHUNK * RAW_QD);
    struct tkv_io_cqe c[16];
    for (uint64_t off = 0; off < bytes; off += RAW_CHUNK) { /* written once */
        tkv_io_write(r->io, r->f, r->buf, RAW_CHUNK, off, 0);
        tkv_io_submit(r->io);
        tkv_io_wait(r->io, 1, c, 16);
    }
    return 0;
}

static double raw_read_gbs(struct raw_file *r)
{
    struct tkv_io_cqe c[RAW_QD];
    double t0 = now();
    uint64_t issued = 0, done = 0;
    while (done < r->bytes) {
        while (issued < r->bytes && issued - done < (uint64_t)RAW_QD * RAW_CHUNK) {
            tkv_io_read(r->io, r->f, r->buf + (issued / RAW_CHUNK % RAW_QD) * RAW_CHUNK, RAW_CHUNK, issued, 0);
            issued += RAW_CHUNK;
        }
        tkv_io_submit(r->io);
        int got = tkv_io_wait(r->io, 1, c, RAW_QD);
        if (got <= 0)
            return 0;
        done += (uint64_t)got * RAW_CHUNK;
    }
    return r->bytes / (now() - t0) / 1e9;
}

static void raw_close(struct raw_file *r)
{
    tkv_io_free_aligned(r->buf);
    tkv_io_file_close(r->f);
    tkv_io_free(r->io);
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* A store of L layers x H heads holding `ctx` tokens, every layer written
 * once and pushed below; its compute tier holds `compute_layers` layers
 * (and 64 blocks). */
static struct tkv_kvs *store_open(struct tkv_backend *be, const struct tkv_kvs_params *base, uint32_t compute_layers,
                                  uint64_t layer_bytes)
{
    struct tkv_kvs_params p = *base;
    p.compute_bytes = compute_layers * layer_bytes + 64 * (uint64_t)(4 * p.block_tokens * p.head_dim);
    struct tkv_kvs *s;
    if (tkv_kvs_init(&p, be, &s) != TKV_OK)
        return NULL;
    if (tkv_kvs_reserve(s, p.max_tokens) != TKV_OK)
        return tkv_kvs_free(s), NULL;
    tkv_kvs_set_length(s, p.max_tokens);
    for (uint32_t l = 0; l < p.n_layer; l++) {
        if (tkv_kvs_begin_layer(s, l, 0, p.max_tokens) != TKV_OK)
            return tkv_kvs_free(s), NULL;
        tkv_kvs_end_layer(s, l);
    }
    return s;
}

/* One pass over the layers; GB/s read from tier `below`. recall: each layer
 * on demand (begin_layer alone; the compute tier holds one layer, so every
 * layer misses); prefetch: the engine's order, prefetch(l + 1) then
 * begin_layer(l), with room for two layers. */
static double store_pass(struct tkv_kvs *s, struct tkv_backend *be, uint32_t L, int below, bool prefetch)
{
    struct tkv_kvs_stats st0, st1;
    tkv_kvs_get_stats(s, &st0);
    double t0 = now();
    for (uint32_t l = 0; l < L; l++) {
        if (prefetch)
            tkv_kvs_prefetch(s, l + 1);
        if (tkv_kvs_begin_layer(s, l, 0, 0) != TKV_OK)
            return -1;
        tkv_kvs_end_layer(s, l);
    }
    if (tkv_kvs_prefetch_wait(s) != TKV_OK) /* the next pass's first layer: counted here */
        return -1;
    be->ops->synchronize(be); /* the recalled bytes have landed */
    double dt = now() - t0;
    tkv_kvs_get_stats(s, &st1);
    return (st1.tier[below].bytes_out - st0.tier[below].bytes_out) / dt / 1e9;
}

int main(int argc, char **argv)
{
    const char *dir = "/var/tmp", *device = "cpu", *fmt = "md";
    uint32_t mib = 256, B = 64, hd = 128, piece_kib = 0; /* 0: the store's default pieces */
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--dir") && v)
            dir = v, i++;
        else if (!strcmp(a, "--mib") && v)
            mib = (uint32_t)atoi(v), i++;
        else if (!strcmp(a, "--block-tokens") && v)
            B = (uint32_t)atoi(v), i++;
        else if (!strcmp(a, "--head-dim") && v)
            hd = (uint32_t)atoi(v), i++;
        else if (!strcmp(a, "--device") && v)
            device = v, i++;
        else if (!strcmp(a, "--piece-kib") && v)
            piece_kib = (uint32_t)atoi(v), i++;
        else if (!strcmp(a, "-o") && v)
            fmt = v, i++;
        else {
            fprintf(stderr, "usage: bench-tiers [--dir DIR] [--mib N] [--block-tokens B] [--head-dim D] "
                            "[--device cpu|cuda] [--piece-kib N] [-o md|jsonl]\n");
            return 2;
        }
    }
    struct tkv_backend *be;
    if (tkv_backend_create(device, 0, &be) != TKV_OK)
        return die(device);
    const bool on_host = !strcmp(be->ops->name, "cpu");
    /* 8 layers x 8 KV heads; the context sized to hold `mib` MiB */
    const uint32_t L = 8, H = 8, S = 4 * B * hd;
    const uint32_t blocks_per_head = (uint32_t)(((uint64_t)mib << 20) / S / L / H);
    const uint32_t ctx = blocks_per_head * B;
    const uint64_t layer_bytes = (uint64_t)H * blocks_per_head * S, total = layer_bytes * L;
    struct tkv_kvs_params p = {.n_layer = L, .n_head_kv = H, .head_dim = hd, .block_tokens = B, .max_tokens = ctx,
                               .compute_is_host = on_host, .host_bytes = on_host ? 0 : total,
                               .nvme_dir = on_host ? dir : NULL, .upload_piece_bytes = piece_kib << 10};
    struct tkv_kvs *s = store_open(be, &p, 1, layer_bytes), *s2 = store_open(be, &p, 2, layer_bytes);
    if (!s || !s2)
        return die("kv store");
    const char *link = on_host ? "nvme -> host" : "host -> gpu";
    const int below = on_host ? TKV_TIER_NVME : TKV_TIER_HOST;
    /* rounds alternate our paths and the raw limit, so all see the same
     * machine state; the medians are reported */
    enum { ROUNDS = 5 };
    double ours_r[ROUNDS], raw_r[ROUNDS], ratio_r[ROUNDS], copy_r[ROUNDS] = {0}, pf_r[ROUNDS], pf_ratio_r[ROUNDS];
    struct raw_file rf = {0};
    void *dev = NULL, *host = NULL;
    if (on_host && raw_open(&rf, dir, total) != 0)
        return die("raw file");
    if (!on_host) {
        host = tkv_io_alloc_aligned(total);
        if (!host || be->ops->alloc(be, total, &dev) != TKV_OK)
            return die("raw buffers");
        memset(host, 1, total);
        if (be->ops->host_register)
            be->ops->host_register(be, host, total);
    }
    if (store_pass(s2, be, L, below, true) < 0) /* warm-up: the pipeline's first layer */
        return die("prefetch");
    for (int r = 0; r < ROUNDS; r++) {
        if ((ours_r[r] = store_pass(s, be, L, below, false)) < 0)
            return die("recall");
        if ((pf_r[r] = store_pass(s2, be, L, below, true)) < 0)
            return die("prefetch");
        if (on_host) {
            raw_r[r] = raw_read_gbs(&rf);
        } else {
            be->ops->synchronize(be);
            double u0 = now();
            be->ops->upload(be, dev, host, total);
            be->ops->synchronize(be);
            raw_r[r] = total / (now() - u0) / 1e9;
            if (be->ops->upload_blocks) { /* the block copies alone, one layer per call, scattered */
                const uint32_t nl = (uint32_t)(layer_bytes / S);
                void **dst = malloc(nl * sizeof *dst);
                const void **src = malloc(nl * sizeof *src);
                if (!dst || !src)
                    return die("gather lists");
                double g0 = now();
                for (uint32_t l = 0; l < L; l++) {
                    for (uint32_t j = 0; j < nl; j++) {
                        src[j] = (const uint8_t *)host + ((uint64_t)l * nl + j) * S;
                        dst[j] = (uint8_t *)dev + ((uint64_t)l * nl + (uint64_t)j * 7919 % nl) * S;
                    }
                    be->ops->upload_blocks(be, dst, src, nl, S, NULL, NULL, NULL);
                }
                be->ops->upload_wait(be, TKV_UPLOADS_ALL, true, NULL);
                copy_r[r] = total / (now() - g0) / 1e9;
                free(dst);
                free(src);
            }
        }
        ratio_r[r] = raw_r[r] > 0 ? ours_r[r] / raw_r[r] : 0;
        pf_ratio_r[r] = raw_r[r] > 0 ? pf_r[r] / raw_r[r] : 0;
    }
    qsort(pf_r, ROUNDS, sizeof(double), cmp_double);
    qsort(pf_ratio_r, ROUNDS, sizeof(double), cmp_double);
    tkv_kvs_free(s2);
    qsort(ours_r, ROUNDS, sizeof(double), cmp_double);
    qsort(raw_r, ROUNDS, sizeof(double), cmp_double);
    qsort(ratio_r, ROUNDS, sizeof(double), cmp_double);
    qsort(copy_r, ROUNDS, sizeof(double), cmp_double);
    const double copies = copy_r[ROUNDS / 2];
    const double ours = ours_r[ROUNDS / 2], raw = raw_r[ROUNDS / 2], ratio = ratio_r[ROUNDS / 2];
    const int passes = ROUNDS;
    if (on_host)
        raw_close(&rf);
    if (dev)
        be->ops->release(be, dev);
    if (host) {
        if (be->ops->host_unregister)
            be->ops->host_unregister(be, host);
        tkv_io_free_aligned(host);
    }

    /* random single-block recalls (QD 1) */
    double rand_rate = 0;
    if (on_host) {
        uint8_t *payload = tkv_io_alloc_aligned(S);
        uint64_t x = 88172645463325252ull;
        int n = 0;
        double r0 = now();
        while (now() - r0 < 1.0 && n < 100000) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            uint32_t l = (uint32_t)(x % L), h = (uint32_t)(x / L % H), b = (uint32_t)(x / L / H % blocks_per_head);
            if (tkv_kvs_block_tier(s, l, h, b) != TKV_TIER_NVME)
                continue;
            if (tkv_kvs_export(s, l, h, b, payload) != TKV_OK)
                return die("random recall");
            n++;
        }
        rand_rate = n / (now() - r0);
        tkv_io_free_aligned(payload);
    }
    struct tkv_kvs_stats st1;
    tkv_kvs_get_stats(s, &st1);
    const double pf = pf_r[ROUNDS / 2], pf_ratio = pf_ratio_r[ROUNDS / 2];
    if (!strcmp(fmt, "md")) {
        printf("| link | path | block | data | ours GB/s | raw GB/s | ours / raw | block copies alone GB/s | random "
               "block recalls/s (QD 1) |\n");
        printf("|---|---|---:|---:|---:|---:|---:|---:|---:|\n");
        char cp[32] = "—";
        if (copies > 0)
            snprintf(cp, sizeof cp, "%.2f (%.0f%%)", copies, raw > 0 ? 100 * copies / raw : 0);
        printf("| %s | recall | %u KiB | %u MiB | %.2f | %.2f | %.0f%% (%.0f-%.0f%%) | %s | %.0f |\n", link, S >> 10,
               mib, ours, raw, 100 * ratio, 100 * ratio_r[0], 100 * ratio_r[ROUNDS - 1], cp, rand_rate);
        printf("| %s | prefetch | %u KiB | %u MiB | %.2f | %.2f | %.0f%% (%.0f-%.0f%%) | | |\n", link, S >> 10, mib, pf,
               raw, 100 * pf_ratio, 100 * pf_ratio_r[0], 100 * pf_ratio_r[ROUNDS - 1]);
        printf("\nrecall: whole layers brought in by begin_layer alone (the compute tier holds one layer); "
               "prefetch: the engine's order, prefetch(l+1) then begin_layer(l), room for two layers. Checksums "
               "verified on both. raw: %s. Medians of %d alternating rounds (ratio range in brackets).\n",
               on_host ? "one sequential O_DIRECT read (1 MiB x QD 16) of a same-size file in the same dir"
                       : "one large pinned upload of the same bytes",
               passes);
        if (on_host)
            printf("io engine %s, O_DIRECT %s\n", st1.io_engine ? st1.io_engine : "-", st1.nvme_direct ? "yes" : "no");
    } else {
        printf("{\"link\": \"%s\", \"block_bytes\": %u, \"mib\": %u, \"ours_gbs\": %.3f, \"raw_gbs\": %.3f, "
               "\"ratio\": %.3f, \"prefetch_gbs\": %.3f, \"prefetch_ratio\": %.3f, \"copies_gbs\": %.3f, "
               "\"random_recalls_per_s\": %.0f}\n",
               link, S, mib, ours, raw, ratio, pf, pf_ratio, copies, rand_rate);
    }
    tkv_kvs_free(s);
    be->ops->free(be);
    return 0;
}
