/*
 * bench-attn.c -- times the CUDA backend's attention and matmul through the
 * backend interface (host clock around ops->synchronize; many calls per
 * timing so launch gaps are amortized as in a real forward pass).
 *
 *   bench-attn [-r reps] [-x]
 *
 * -x: only decode attention at 131072 keys (32/8/128), 3 calls, for ncu.
 *
 * Cases: decode attention (n_q = 1) over 1k..128k keys and a 512-token
 * prefill chunk, for a Llama-3-8B-like head layout (32 query heads, 8 KV
 * heads, head_dim 128, KV blocks of 64), and SmolLM2-135M's (9/3/64);
 * matmul GEMV (n = 1) and GEMM (n = 512) on f16 weights. Before timing, each
 * attention case is checked against the CPU backend (max |diff| <= 1e-4).
 * Prints a Markdown table: median time per call, and the rate against the
 * bytes that must be read (KV or weights) or the FLOPs done. Matmul weights
 * are cycled through copies larger than the L2 together; attention KV of
 * less than ~60 MB (decode at 8k keys and below) stays in the L2 between
 * calls, so those rates are L2 rates.
 */
#include "cpu/quant.h"
#include "runtime/backend.h"

#include "bench.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static struct tkv_backend *gpu, *cpu;
static uint64_t rng = 0x9E3779B97F4A7C15ull;

static float frand(void)
{
    rng ^= rng >> 12, rng ^= rng << 25, rng ^= rng >> 27;
    return (float)((rng * 0x2545F4914F6CDD1DULL) >> 40) / 16777216.0f * 2.0f - 1.0f;
}

static void *dalloc(size_t bytes)
{
    void *p;
    if (gpu->ops->alloc(gpu, bytes, &p) != TKV_OK) {
        fprintf(stderr, "%s\n", tkv_last_error());
        exit(1);
    }
    return p;
}

static void die_if(tkv_status st)
{
    if (st != TKV_OK) {
        fprintf(stderr, "bench-attn: %s\n", tkv_last_error());
        exit(1);
    }
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Median over 7 batches of `reps` calls of the seconds per call. */
#define TIME_IT(reps, call)                                   \
    ({                                                        \
        double ts_[7];                                        \
        for (int w_ = 0; w_ < 2; w_++)                        \
            die_if(call);                                     \
        die_if(gpu->ops->synchronize(gpu));                   \
        for (int b_ = 0; b_ < 7; b_++) {                      \
            double t0_ = now();                               \
            for (int r_ = 0; r_ < (reps); r_++)               \
                die_if(call);                                 \
            die_if(gpu->ops->synchronize(gpu));               \
            ts_[b_] = (now() - t0_) / (reps);                 \
        }                                                     \
        qsort(ts_, 7, sizeof(double), cmp_double);            \
        ts_[3];                                               \
    })

static void bench_attention(uint32_t H, uint32_t Hkv, uint32_t hd, uint32_t B, uint32_t ctx, uint32_t n_q, int reps)
{
    const uint32_t nb = (ctx + B - 1) / B;
    const size_t half = (size_t)B * hd, elems = (size_t)Hkv * nb * 2 * half;
    uint16_t *kv = malloc(elems * 2);
    for (size_t i = 0; i < elems; i++)
        kv[i] = tkv_fp32_to_fp16(frand());
    uint16_t *dkv = dalloc(elems * 2);
    die_if(gpu->ops->upload(gpu, dkv, kv, elems * 2));
    struct tkv_kv_block_ref *hr = malloc((size_t)Hkv * nb * sizeof *hr), *dr = malloc((size_t)Hkv * nb * sizeof *dr);
    struct tkv_kv_head_view hv[64], dv[64];
    for (uint32_t h = 0; h < Hkv; h++) {
        for (uint32_t b = 0; b < nb; b++) {
            const size_t o = ((size_t)h * nb + b) * 2 * half;
            const uint32_t n = ctx - b * B < B ? ctx - b * B : B;
            hr[h * nb + b] = (struct tkv_kv_block_ref){kv + o, kv + o + half, (int32_t)(b * B), n};
            dr[h * nb + b] = (struct tkv_kv_block_ref){dkv + o, dkv + o + half, (int32_t)(b * B), n};
        }
        hv[h] = (struct tkv_kv_head_view){hr + (size_t)h * nb, nb};
        dv[h] = (struct tkv_kv_head_view){dr + (size_t)h * nb, nb};
    }
    const size_t qn = (size_t)n_q * H * hd;
    float *q = malloc(qn * 4), *oc = malloc(qn * 4), *og = malloc(qn * 4);
    int32_t *pos = malloc(n_q * 4);
    for (size_t i = 0; i < qn; i++)
        q[i] = frand();
    for (uint32_t t = 0; t < n_q; t++)
        pos[t] = (int32_t)(ctx - n_q + t);
    float *dq = dalloc(qn * 4), *dout = dalloc(qn * 4);
    die_if(gpu->ops->upload(gpu, dq, q, qn * 4));
    struct tkv_attn_args a = {.q = q, .q_pos = pos, .out = oc, .n_q = n_q, .n_head = H, .n_head_kv = Hkv,
                              .head_dim = hd, .scale = 1.0f / sqrtf((float)hd), .kv = hv};
    double err = -1;
    if ((double)n_q * ctx <= 512.0 * 32768) { /* check before timing (CPU time permitting) */
        die_if(cpu->ops->attention(cpu, &a));
        struct tkv_attn_args ga = a;
        ga.q = dq, ga.out = dout, ga.kv = dv;
        die_if(gpu->ops->attention(gpu, &ga));
        die_if(gpu->ops->download(gpu, og, dout, qn * 4));
        err = 0;
        for (size_t i = 0; i < qn; i++)
            err = fmax(err, isnan(og[i]) ? INFINITY : fabs(og[i] - oc[i]));
        if (!(err <= 1e-4)) {
            fprintf(stderr, "bench-attn: attention differs from the CPU: %.3g\n", err);
            exit(1);
        }
    }
    a.q = dq, a.out = dout, a.kv = dv;
    const double t = TIME_IT(reps, gpu->ops->attention(gpu, &a));
    /* bytes: every visible K and V row once; FLOPs: 4 hd per (query head, visible key) */
    const double kv_bytes = (double)Hkv * ctx * hd * 2 * 2;
    double pairs = 0;
    for (uint32_t i = 0; i < n_q; i++)
        pairs += ctx - n_q + i + 1;
    const double flops = 4.0 * hd * H * pairs;
    printf("| attention | H=%u Hkv=%u hd=%u B=%u | ctx %6u, n_q %3u | %9.1f us | %7.1f GB/s | %6.2f TFLOP/s | %s |\n",
           H, Hkv, hd, B, ctx, n_q, t * 1e6, kv_bytes / t / 1e9, flops / t / 1e12,
           err >= 0 ? "checked" : "-");
    gpu->ops->release(gpu, dkv), gpu->ops->release(gpu, dq), gpu->ops->release(gpu, dout);
    free(kv), free(hr), free(dr), free(q), free(oc), free(og), free(pos);
}

static void bench_matmul(uint32_t n_in, uint32_t n_out, uint32_t n, int reps)
{
    uint16_t *w = malloc((size_t)n_in * n_out * 2);
    for (size_t i = 0; i < (size_t)n_in * n_out; i++)
        w[i] = tkv_fp32_to_fp16(frand() * 0.05f);
    struct tkv_gguf_tensor t = {.name = "bench.w", .n_dims = 2, .ne = {n_in, n_out, 1, 1}, .type = TKV_TYPE_F16,
                                .n_elems = (uint64_t)n_in * n_out, .nbytes = (uint64_t)n_in * n_out * 2, .data = w};
    /* copies of the weights, cycled, so together they exceed the 60 MB L2
     * and the time is that of reading HBM */
    const size_t bytes = (size_t)n_in * n_out * 2;
    const int n_copies = bytes >= (128u << 20) ? 1 : (int)((128u << 20) / bytes + 1 > 16 ? 16 : (128u << 20) / bytes + 1);
    struct tkv_bweight *bws[16];
    for (int c = 0; c < n_copies; c++)
        die_if(gpu->ops->weight_init(gpu, &t, &bws[c]));
    unsigned rot = 0;
    float *x = malloc((size_t)n * n_in * 4);
    for (size_t i = 0; i < (size_t)n * n_in; i++)
        x[i] = frand();
    float *dx = dalloc((size_t)n * n_in * 4), *dy = dalloc((size_t)n * n_out * 4);
    die_if(gpu->ops->upload(gpu, dx, x, (size_t)n * n_in * 4));
    const double s = TIME_IT(reps, gpu->ops->matmul(gpu, bws[rot++ % n_copies], dx, dy, n));
    printf("| matmul f16 | %u x %u | n %3u | %9.1f us | %7.1f GB/s | %6.2f TFLOP/s | - |\n", n_in, n_out, n, s * 1e6,
           (double)n_in * n_out * 2 / s / 1e9, 2.0 * n * n_in * n_out / s / 1e12);
    for (int c = 0; c < n_copies; c++)
        gpu->ops->weight_free(gpu, bws[c]);
    gpu->ops->release(gpu, dx), gpu->ops->release(gpu, dy);
    free(w), free(x);
}

int main(int argc, char **argv)
{
    int reps = 50, profile = 0;
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "-r") && i + 1 < argc)
            reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "-x"))
            profile = 1;
    if (tkv_backend_cuda_devices() == 0) {
        fprintf(stderr, "bench-attn: no CUDA device\n");
        return 77;
    }
    die_if(tkv_backend_create("cuda", 0, &gpu));
    die_if(tkv_backend_create("cpu", 0, &cpu));
    printf("| op | shape | size | time/call | bytes rate | compute rate | check |\n");
    printf("| --- | --- | --- | ---: | ---: | ---: | --- |\n");
    if (profile) {
        bench_attention(32, 8, 128, 64, 131072, 1, 1);
        gpu->ops->free(gpu);
        cpu->ops->free(cpu);
        return 0;
    }
    const uint32_t ctxs[] = {1024, 8192, 32768, 131072};
    for (int i = 0; i < 4; i++)
        bench_attention(32, 8, 128, 64, ctxs[i], 1, reps);
    for (int i = 0; i < 3; i++)
        bench_attention(9, 3, 64, 64, ctxs[i], 1, reps);
    bench_attention(32, 8, 128, 64, 8192, 512, reps / 5 + 1);
    bench_attention(32, 8, 128, 64, 32768, 512, reps / 10 + 1);
    bench_attention(9, 3, 64, 64, 4096, 512, reps / 5 + 1);
    bench_matmul(4096, 4096, 1, reps);
    bench_matmul(4096, 14336, 1, reps);
    bench_matmul(576, 1536, 1, reps);
    bench_matmul(4096, 4096, 512, reps);
    bench_matmul(4096, 14336, 512, reps);
    gpu->ops->free(gpu);
    cpu->ops->free(cpu);
    return 0;
}
