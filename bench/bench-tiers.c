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
 * The store holds N MiB of KV; its compute tier holds one layer, so every
 * layer is recalled from below each pass.
 */
#include "io/io.h"
#include "tiers/kv-store.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int die(const char *what)
{
    fprintf(stderr, "bench-tiers: %s: %s\n", what, tkv_last_error());
    return 1;
}

/* Raw sequential O_DIRECT read rate of a `bytes` file in dir (GB/s). */
static double raw_sequential_read(const char *dir, uint64_t bytes)
{
    struct tkv_io *io;
    struct tkv_io_file *f;
    struct tkv_io_params p = tkv_io_default_params();
    if (tkv_io_init(&p, &io) < 0 || tkv_io_file_open_tmp(io, dir, &f) < 0)
        return 0;
    const size_t chunk = 1 << 20, qd = 16;
    uint8_t *buf = tkv_io_alloc_aligned(chunk * qd);
    memset(buf, 0x5a, chunk * qd);
    tkv_io_file_resize(f, bytes);
    struct tkv_io_cqe c[16];
    for (uint64_t off = 0; off < bytes; off += chunk) { /* write it once */
        tkv_io_write(io, f, buf, chunk, off, 0);
        tkv_io_submit(io);
        tkv_io_wait(io, 1, c, 16);
    }
    double t0 = now();
    uint64_t issued = 0, done = 0;
    while (done < bytes) {
        while (issued < bytes && issued - done < qd * chunk) {
            tkv_io_read(io, f, buf + (issued / chunk % qd) * chunk, chunk, issued, 0);
            issued += chunk;
        }
        tkv_io_submit(io);
        int got = tkv_io_wait(io, 1, c, 16);
        if (got <= 0)
            break;
        done += (uint64_t)got * chunk;
    }
    double dt = now() - t0;
    tkv_io_free_aligned(buf);
    tkv_io_file_close(f);
    tkv_io_free(io);
    return bytes / dt / 1e9;
}

int main(int argc, char **argv)
{
    const char *dir = "/var/tmp", *device = "cpu", *fmt = "md";
    uint32_t mib = 256, B = 64, hd = 128;
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
        else if (!strcmp(a, "-o") && v)
            fmt = v, i++;
        else {
            fprintf(stderr, "usage: bench-tiers [--dir DIR] [--mib N] [--block-tokens B] [--head-dim D] "
                            "[--device cpu|cuda] [-o md|jsonl]\n");
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
                               .compute_is_host = on_host, .compute_bytes = layer_bytes + 64 * (uint64_t)S,
                               .host_bytes = on_host ? 0 : total, .nvme_dir = on_host ? dir : NULL};
    struct tkv_kvs *s;
    if (tkv_kvs_init(&p, be, &s) != TKV_OK)
        return die("kv store");
    if (tkv_kvs_reserve(s, ctx) != TKV_OK)
        return die("reserve");
    tkv_kvs_set_length(s, ctx);
    for (uint32_t l = 0; l < L; l++) { /* fill: every layer written once, then pushed below */
        if (tkv_kvs_begin_layer(s, l, 0, ctx) != TKV_OK)
            return die("fill");
        tkv_kvs_end_layer(s, l);
    }
    struct tkv_kvs_stats st0, st1;
    const char *link = on_host ? "nvme -> host" : "host -> gpu";
    /* our path: recall layer after layer (each pass misses every layer) */
    tkv_kvs_get_stats(s, &st0);
    double t0 = now();
    const int passes = 3;
    for (int pass = 0; pass < passes; pass++)
        for (uint32_t l = 0; l < L; l++) {
            if (tkv_kvs_begin_layer(s, l, 0, 0) != TKV_OK)
                return die("recall");
            tkv_kvs_end_layer(s, l);
        }
    double dt = now() - t0;
    tkv_kvs_get_stats(s, &st1);
    const int below = on_host ? TKV_TIER_NVME : TKV_TIER_HOST;
    const double ours = (st1.tier[below].bytes_out - st0.tier[below].bytes_out) / dt / 1e9;

    /* the raw limit of the same link */
    double raw = 0;
    if (on_host) {
        raw = raw_sequential_read(dir, total);
    } else {
        void *dev, *host = tkv_io_alloc_aligned(total);
        if (host && be->ops->alloc(be, total, &dev) == TKV_OK) {
            memset(host, 1, total);
            if (be->ops->host_register)
                be->ops->host_register(be, host, total);
            be->ops->upload(be, dev, host, total);
            be->ops->synchronize(be);
            double u0 = now();
            for (int r = 0; r < 3; r++)
                be->ops->upload(be, dev, host, total);
            be->ops->synchronize(be);
            raw = 3.0 * total / (now() - u0) / 1e9;
            if (be->ops->host_unregister)
                be->ops->host_unregister(be, host);
            be->ops->release(be, dev);
        }
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
    if (!strcmp(fmt, "md")) {
        printf("| link | block | data | ours GB/s | raw GB/s | ours / raw | random block recalls/s (QD 1) |\n");
        printf("|---|---:|---:|---:|---:|---:|---:|\n");
        printf("| %s | %u KiB | %u MiB | %.2f | %.2f | %.0f%% | %.0f |\n", link, S >> 10, mib, ours, raw,
               raw > 0 ? 100 * ours / raw : 0, rand_rate);
        printf("\nours: whole-layer recalls through the store (checksums verified), %d passes over %u layers; raw: %s\n",
               passes, L, on_host ? "one sequential O_DIRECT read (1 MiB x QD 16) of a same-size file in the same dir"
                                  : "one large pinned upload of the same bytes");
        if (on_host)
            printf("io engine %s, O_DIRECT %s\n", st1.io_engine ? st1.io_engine : "-", st1.nvme_direct ? "yes" : "no");
    } else {
        printf("{\"link\": \"%s\", \"block_bytes\": %u, \"mib\": %u, \"ours_gbs\": %.3f, \"raw_gbs\": %.3f, "
               "\"ratio\": %.3f, \"random_recalls_per_s\": %.0f}\n",
               link, S, mib, ours, raw, raw > 0 ? ours / raw : 0, rand_rate);
    }
    tkv_kvs_free(s);
    be->ops->free(be);
    return 0;
}
