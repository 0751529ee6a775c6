/*
 * bench-hetero.c -- the CPU side of heterogeneous decode (docs/rabitq.md):
 * what it costs the CPU to attend selected host-tier blocks where they are,
 * against what recalling them over a link of a given rate costs.
 *
 *   bench-hetero [-t threads] [-r reps] [--link GBPS] [--busy K] [--quick]
 *
 * Per model shape (SmolLM2-135M 9/3/64 and Llama-3-8B 32/8/128 heads, KV
 * blocks of 64 tokens) and per count of selected host tokens per KV head,
 * one decode query over every KV head of a layer:
 *   cpu attn   the CPU backend's attention op (split-K; rows of a KV head
 *              <= 8: the fused AVX2 f16 kernels where the CPU has them),
 *              median of r calls; GFLOP/s as the cost model counts them
 *              (tokens x G x head_dim x 4) and the KV bytes it read per s;
 *              beside it the same op on the sgemm path (TKV_CPU_ATTN=blas:
 *              f32 tiles, OpenBLAS) in the same run, and the ratio
 *   crc        CRC-32C of the blocks the CPU reads, on one thread (the
 *              store verifies host reads before use, on up to 8 threads
 *              below a GPU)
 *   recall     the same blocks' bytes over the link at --link GB/s (40)
 * for dense selections (whole blocks) and sparse ones (8 of every 64 tokens
 * selected: the CPU reads 1/8 of the bytes a recall moves). The merge of
 * the two partials (n_head rows) is timed once per shape. --busy K gives
 * only the first K KV heads of a layer blocks (the heterogeneous split
 * hands the CPU a few of a layer's heads; counts are then of those K).
 * Markdown out.
 */
#include "runtime/backend.h"
#include "runtime/hetero.h"
#include "tiers/crc32c.h"

#include "bench.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

struct shape {
    const char *name;
    uint32_t hkv, g, hd, b;
};

static uint32_t crc_total;

static int cmp_d(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* The median time of reps calls of be's attention on a, after a warm-up
 * call; t: reps doubles of work memory. */
static double median_attention(struct tkv_backend *be, const struct tkv_attn_args *a, uint32_t reps, double *t)
{
    be->ops->attention(be, a);
    for (uint32_t r = 0; r < reps; r++) {
        const double t0 = now();
        be->ops->attention(be, a);
        t[r] = now() - t0;
    }
    qsort(t, reps, sizeof *t, cmp_d);
    return t[reps / 2];
}

int main(int argc, char **argv)
{
    uint32_t threads = 0, reps = 9, busy = UINT32_MAX;
    double link_gbs = 40;
    bool quick = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-t") && i + 1 < argc)
            threads = (uint32_t)atoi(argv[++i]);
        else if (!strcmp(argv[i], "-r") && i + 1 < argc)
            reps = (uint32_t)atoi(argv[++i]);
        else if (!strcmp(argv[i], "--link") && i + 1 < argc)
            link_gbs = atof(argv[++i]);
        else if (!strcmp(argv[i], "--busy") && i + 1 < argc && atoi(argv[i + 1]) > 0)
            busy = (uint32_t)atoi(argv[++i]);
        else if (!strcmp(argv[i], "--quick"))
            quick = true;
        else {
            fprintf(stderr, "usage: bench-hetero [-t threads] [-r reps] [--link GBPS] [--busy K>0] [--quick]\n");
            return 2;
        }
    }
    if (reps == 0)
        reps = 1;
    struct tkv_backend *cpu = NULL, *blas = NULL;
    if (tkv_backend_create("cpu", threads, &cpu) != TKV_OK) {
        fprintf(stderr, "bench-hetero: %s\n", tkv_last_error());
        return 1;
    }
    const char *attn_env = getenv("TKV_CPU_ATTN");
    setenv("TKV_CPU_ATTN", "blas", 1); /* a second backend on the sgemm path */
    const tkv_status bst = tkv_backend_create("cpu", threads, &blas);
    if (attn_env)
        setenv("TKV_CPU_ATTN", attn_env, 1);
    else
        unsetenv("TKV_CPU_ATTN");
    if (bst != TKV_OK) {
        fprintf(stderr, "bench-hetero: %s\n", tkv_last_error());
        return 1;
    }
    char commit[64];
    build_commit(commit, sizeof commit);
    char nth[16];
    snprintf(nth, sizeof nth, threads ? "%u" : "all", threads);
    char nbusy[16];
    snprintf(nbusy, sizeof nbusy, busy == UINT32_MAX ? "all" : "%u", busy);
    printf("bench-hetero: commit %s, %s threads, link %.1f GB/s, median of %u, KV heads with blocks: %s\n\n", commit,
           nth, link_gbs, reps, nbusy);
    printf("| shape | selection | host tokens / KV head | cpu attn ms | GFLOP/s | KV GB/s read | sgemm path ms | "
           "GFLOP/s | speedup | crc ms (1 thread) | recall ms | cost model picks |\n"
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n");
    static const struct shape shapes[] = {{"SmolLM2 9/3/64", 3, 3, 64, 64}, {"Llama-3-8B 32/8/128", 8, 4, 128, 64}};
    static const uint32_t counts[] = {512, 2048, 8192, 32768};
    const uint32_t n_counts = quick ? 1 : 4, max_tokens = quick ? 512 : 32768;
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const struct shape *sh = &shapes[si];
        const uint32_t H = sh->hkv * sh->g, B = sh->b, nb_max = max_tokens / B, hb = TKV_MIN(busy, sh->hkv);
        const size_t blk_halves = (size_t)B * sh->hd, S = 4 * blk_halves; /* K then V: bytes */
        uint16_t *kv = malloc((size_t)sh->hkv * nb_max * 2 * blk_halves * sizeof *kv);
        float *q = malloc((size_t)H * sh->hd * sizeof *q), *out = malloc((size_t)H * sh->hd * sizeof *out);
        float *out2 = malloc((size_t)H * sh->hd * sizeof *out2), *lse = malloc(H * sizeof *lse);
        float *lse2 = malloc(H * sizeof *lse2);
        struct tkv_kv_block_ref *refs = malloc((size_t)sh->hkv * nb_max * sizeof *refs);
        struct tkv_kv_head_view *views = malloc(sh->hkv * sizeof *views);
        double *t = malloc(reps * sizeof *t);
        if (!kv || !q || !out || !out2 || !lse || !lse2 || !refs || !views || !t) {
            fprintf(stderr, "bench-hetero: out of memory\n");
            return 1;
        }
        for (size_t i = 0; i < (size_t)sh->hkv * nb_max * 2 * blk_halves; i++)
            kv[i] = tkv_fp32_to_fp16((float)(rnd() >> 40) / (float)(1u << 24) - 0.5f);
        for (size_t i = 0; i < (size_t)H * sh->hd; i++)
            q[i] = (float)(rnd() >> 40) / (float)(1u << 24) - 0.5f;
        for (uint32_t ci = 0; ci < n_counts; ci++)
            for (int sparse = 0; sparse < 2; sparse++) {
                /* dense: T tokens in T/B whole blocks; sparse: 8 tokens of each
                 * of 8*T/B blocks (the recall moves all of them) */
                const uint32_t T = counts[ci], per = sparse ? 8 : B, nb = T / per;
                if (nb > nb_max)
                    continue;
                for (uint32_t g = 0; g < sh->hkv; g++) {
                    for (uint32_t b = 0; b < nb; b++) {
                        uint16_t *k = kv + (((size_t)g * nb_max + b) * 2) * blk_halves;
                        refs[(size_t)g * nb_max + b] = (struct tkv_kv_block_ref){
                            .k = k + (size_t)(B - per) * sh->hd, .v = k + blk_halves + (size_t)(B - per) * sh->hd,
                            .pos0 = (int32_t)(b * B + B - per), .n = per};
                    }
                    views[g] = (struct tkv_kv_head_view){.blocks = refs + (size_t)g * nb_max,
                                                         .n_blocks = g < hb ? nb : 0};
                }
                const int32_t pos = (int32_t)(nb * B);
                const struct tkv_attn_args a = {.q = q, .q_pos = &pos, .out = out, .lse = lse, .n_q = 1, .n_head = H,
                                                .n_head_kv = sh->hkv, .head_dim = sh->hd,
                                                .scale = 1.0f / sqrtf((float)sh->hd), .kv = views};
                const double att = median_attention(cpu, &a, reps, t);
                struct tkv_attn_args ab = a;
                ab.out = out2, ab.lse = lse2;
                const double att_blas = median_attention(blas, &ab, reps, t);
                float dmax = 0; /* the two paths agree (rounding only) */
                for (size_t i = 0; i < (size_t)H * sh->hd; i++)
                    dmax = fmaxf(dmax, fabsf(out[i] - out2[i]));
                if (!(dmax < 1e-3f)) {
                    fprintf(stderr, "bench-hetero: the fused and sgemm paths differ by %g\n", dmax);
                    return 1;
                }
                const double flop = (double)hb * T * sh->g * sh->hd * 4.0;
                const double read_bytes = (double)hb * T * 4.0 * sh->hd; /* the selected K and V rows */
                const double moved = (double)hb * nb * S;                 /* whole blocks */
                uint32_t acc = 0;
                const double c0 = now();
                for (uint32_t g = 0; g < hb; g++)
                    for (uint32_t b = 0; b < nb; b++)
                        acc ^= tkv_crc32c(0, kv + (((size_t)g * nb_max + b) * 2) * blk_halves, S);
                const double crc = now() - c0;
                crc_total ^= acc;
                const double recall = moved / (link_gbs * 1e9);
                /* as the engine's auto mode: the checksums on one thread here */
                const bool cpu_wins = tkv_hetero_prefer_cpu(nb, T, (uint32_t)S, sh->g, sh->hd, link_gbs * 1e9,
                                                            flop / att, moved / crc);
                printf("| %s | %s | %u | %.3f | %.1f | %.1f | %.3f | %.1f | %.2fx | %.3f | %.3f | %s |\n", sh->name,
                       sparse ? "8 of 64 per block" : "whole blocks", T, att * 1e3, flop / att / 1e9,
                       read_bytes / att / 1e9, att_blas * 1e3, flop / att_blas / 1e9, att_blas / att, crc * 1e3,
                       recall * 1e3, cpu_wins ? "cpu" : "recall");
            }
        /* the merge of two partials of one layer (n_head rows) */
        for (size_t i = 0; i < (size_t)H * sh->hd; i++)
            out2[i] = out[i] * 0.5f;
        for (uint32_t h = 0; h < H; h++)
            lse2[h] = lse[h] - 1.0f;
        const uint32_t n_merge = 10000;
        const double m0 = now();
        for (uint32_t i = 0; i < n_merge; i++)
            tkv_attn_merge(out, lse, out2, lse2, H, sh->hd);
        printf("| %s | merge of %u rows | | %.5f | | | | | | | | |\n", sh->name, H, (now() - m0) / n_merge * 1e3);
        free(kv), free(q), free(out), free(out2), free(lse), free(lse2), free(refs), free(views), free(t);
    }
    printf("\n(the inputs' checksums fold to %08x)\n", crc_total); /* the sums are used: not optimised away */
    cpu->ops->free(cpu);
    blas->ops->free(blas);
    return 0;
}
