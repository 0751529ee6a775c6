/*
 * bench-attn.c -- times the CUDA backend's attention and matmul through the
 * backend interface (host clock around ops->synchronize; many calls per
 * timing so launch gaps are amortized as in a real forward pass).
 *
 *   bench-attn [-r reps] [-s all|decode|decode-short|decode-sparse|prefill|prefill-long|prefill-sparse|matmul]
 *              [-V 0,1,..]
 *              [-j out.json] [-x]
 *
 * -x [ctx]: only decode attention at ctx keys (default 131072; 32/8/128), 3
 *     calls, for ncu.
 * -V: the tensor-core prefill kernel's variants (tile shapes, docs/gpu.md)
 *     that prefill-long and prefill-sparse time side by side, each checked
 *     first (default: all; the list is printed at the start); one that
 *     fails its check gets a CHECK FAILED row instead of a time, and the
 *     exit status is 1
 * -j: one JSON object per decode case (the section `decode`) into a file,
 *     for scripts/bench-torch-attn.py, which puts torch SDPA and the copy
 *     bandwidth beside it.
 *
 * Sections:
 *   decode   n_q = 1 over 32K, 128K and 1M keys, Llama-3-8B heads (32/8,
 *            head_dim 128, KV blocks of 64): the default kernel (decode
 *            kernel, fused merge, the view as inline runs in the launch
 *            parameters, PDL, the first K/V asked of L2 before the
 *            dependency wait), the same over device views (the block
 *            arrays already in device memory, as the engine's calls from a
 *            device table come: nothing packed or copied per call; required
 *            to give the packed table's bits) and the other paths (alt_env:
 *            the general kernel, a separate merge kernel, the packed table
 *            copied on the compute stream, the packed table, the default
 *            without the L2 prefetch), each
 *            checked against the general kernel (and the CPU up to 128K);
 *            then a summary table of every path: device time per call, and
 *            beside it the host time of the op call itself (in the same
 *            back-to-back loop, and once on an idle GPU: table packing and
 *            copy, launches, which overlap the GPU's work of earlier calls)
 *   decode-sparse  n_q = 1 over a selection's slices (groups of 16 keys
 *            kept with probability 0.1 / 0.25 in every head, or 0.9 / 0.5
 *            in head 0 and 0.1 in the others; one entry per run inside a
 *            block, as kv_table cuts them) of 128K and 1M keys, 32/8 and
 *            28/4 heads, head_dim 128, the counts in device memory as the
 *            engine's tables have them, beside the same number of keys read
 *            as whole blocks: what the slices cost beyond their bytes, and
 *            what the kernel's pool (CTAs shared by the heads' keys) gains
 *            over equal splits per head (TKV_CUDA_ATTN_POOL=0)
 *   decode-short  n_q = 1 over 4K, 8K, 16K, 32K and 128K keys (32/8/128), the
 *            default path and device views only (TKV_CUDA_ATTN_DECODE_SPLITS=N in the
 *            environment fixes its splits per KV head: the split-count sweep)
 *   prefill-long  a whole 8K, 32K, 128K-token prompt in one call (causal,
 *            32/8/128): the tensor-core kernel in both precisions, each of
 *            its variants (-V), and the general kernel at 8K; TFLOP/s over
 *            the causal FLOPs
 *   prefill  that, and 512-token chunks after 8K/32K keys (the default
 *            kernel: tensor cores, split precision), checked against the CPU
 *   prefill-sparse  a 512- and a 2048-token chunk at the end of 32K keys
 *            (32/8/128, blocks of 64) over: the dense 32K; a selection of
 *            256 refs of 8 rows per KV head (2048 keys, 8-aligned, before
 *            the chunk: EntropyInfer's key blocks); that plus the chunk's own
 *            keys (as the engine passes them, causal). Each on the packed
 *            tiles (default) and the per-ref walk (TKV_CUDA_ATTN_PACK=0),
 *            split precision, each variant of the tensor-core kernel (-V),
 *            outputs checked against the general kernel; TFLOP/s over the
 *            (query head, key) pairs actually attended; the dense / sparse
 *            time ratio of each walk against the ratio of their FLOPs
 *   all      also decode at 1K/8K (L2-resident: L2 rates) and SmolLM2's 9/3/64
 *            heads, a 512-token prefill chunk, and matmul GEMV (n = 1) and
 *            GEMM (n = 512) on f16 weights
 * Prints a Markdown table: median time per call, and the rate against the
 * bytes that must be read (KV or weights) or the FLOPs done. Matmul weights
 * are cycled through copies larger than the L2 together.
 */
#include "cpu/quant.h"
#include "runtime/backend.h"

#include "bench.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* gpu_packed: the decode kernel over the packed block table always
 * (TKV_CUDA_ATTN_DECODE=fused), whose bits the device views must give */
static struct tkv_backend *gpu, *gpu_packed, *cpu;
/* the decode section's other paths: backends created with these attention
 * settings (TKV_CUDA_ATTN_DECODE, _TABLE, _PREFETCH where set); [0] is the
 * general kernel */
#define N_ALT 5
static const struct {
    const char *name, *decode, *table, *prefetch;
} alt_env[N_ALT] = {
    {"general kernel", "0", "copy", NULL},
    {"separate merge", "merge", "copy", NULL},
    {"packed table copied on the compute stream", "fused", "main", NULL},
    {"packed table (TKV_CUDA_ATTN_DECODE=fused; the default before session 44)", "fused", "copy", NULL},
    {"inline runs without the L2 prefetch (TKV_CUDA_ATTN_PREFETCH=0)", "1", "copy", "0"},
};
static struct tkv_backend *alt[N_ALT];
#define gpu_general alt[0]
static FILE *json;
static uint64_t rng = 0x9E3779B97F4A7C15ull;
/* -V: the prefill kernel variants to time (v0 .. n_variants - 1 exist) */
static bool variant_on[32];
static int n_variants;
static bool variant_failed; /* a variant failed its check: not timed, exit 1 at the end */

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

/* KV pool: random f16 values tiled over the KV (generating gigabytes one
 * value at a time would take longer than the benchmark). */
#define POOL_HALVES ((size_t)16 << 20)

/* elems f16 values of device memory, the KV of a benchmark: a random pool
 * (made once) tiled over them; host, when given, gets the same [elems] */
static uint16_t *kv_random_dev(size_t elems, uint16_t *host)
{
    static uint16_t *pool;
    if (!pool) {
        pool = malloc(POOL_HALVES * 2);
        for (size_t i = 0; i < POOL_HALVES; i++)
            pool[i] = tkv_fp32_to_fp16(frand());
    }
    uint16_t *dkv = dalloc(elems * 2);
    for (size_t o = 0; o < elems; o += POOL_HALVES) {
        const size_t n = elems - o < POOL_HALVES ? elems - o : POOL_HALVES;
        die_if(gpu->ops->upload(gpu, dkv + o, pool, n * 2));
        if (host)
            memcpy(host + o, pool, n * 2);
    }
    return dkv;
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

/* Median over 7 of the host time to queue one call on an idle GPU. */
static double host_time(struct tkv_backend *be, const struct tkv_attn_args *a)
{
    double ts[7];
    for (int b = 0; b < 7; b++) {
        die_if(be->ops->synchronize(be));
        const double t0 = now();
        die_if(be->ops->attention(be, a));
        ts[b] = now() - t0;
        die_if(be->ops->synchronize(be));
    }
    qsort(ts, 7, sizeof(double), cmp_double);
    return ts[3];
}

/* Times the attention call `a` on backend be (median of 7 batches of reps). */
static double time_on(struct tkv_backend *be, const struct tkv_attn_args *a, int reps)
{
    struct tkv_backend *saved = gpu;
    gpu = be; /* TIME_IT synchronizes `gpu` */
    const double t = TIME_IT(reps, be->ops->attention(be, a));
    gpu = saved;
    return t;
}

/* The attention op call itself, timed on the host: adds its wall time to
 * *sum (seconds). */
static tkv_status timed_call(struct tkv_backend *be, const struct tkv_attn_args *a, double *sum)
{
    const double t0 = now();
    const tkv_status st = be->ops->attention(be, a);
    *sum += now() - t0;
    return st;
}

/* time_on, and in *host the wall time of the op call itself per call,
 * inside the same back-to-back loop (median batch as for the device time;
 * a call that waits for a free table buffer counts its wait). */
static double time_on_host(struct tkv_backend *be, const struct tkv_attn_args *a, int reps, double *host)
{
    double ts[7], hs[7];
    for (int w = 0; w < 2; w++)
        die_if(be->ops->attention(be, a));
    die_if(be->ops->synchronize(be));
    for (int b = 0; b < 7; b++) {
        double hsum = 0;
        const double t0 = now();
        for (int r = 0; r < reps; r++)
            die_if(timed_call(be, a, &hsum));
        die_if(be->ops->synchronize(be));
        ts[b] = (now() - t0) / reps;
        hs[b] = hsum / reps;
    }
    double tsorted[7];
    memcpy(tsorted, ts, sizeof ts);
    qsort(tsorted, 7, sizeof(double), cmp_double);
    int med = 0; /* the host time of the median batch */
    for (int b = 0; b < 7; b++)
        if (ts[b] == tsorted[3])
            med = b;
    *host = hs[med];
    return tsorted[3];
}

/* The decode section's summary: every path at every size. */
#define N_DEC_ROWS 32
struct dec_result {
    const char *path;
    uint32_t ctx;
    double dev, host, idle, gbps; /* seconds per call; GB/s of KV read */
};
static struct dec_result dec_rows[N_DEC_ROWS];
static int n_dec_rows;

static void dec_row(const char *path, uint32_t ctx, double dev, double host, double idle, double bytes)
{
    if (n_dec_rows < N_DEC_ROWS)
        dec_rows[n_dec_rows++] = (struct dec_result){path, ctx, dev, host, idle, bytes / dev / 1e9};
}

static void dec_rows_print(void)
{
    if (!n_dec_rows)
        return;
    printf("\nDecode attention, 32/8 heads, hd 128, f16 KV in blocks of 64, n_q 1: device = median of 7 batches of "
           "back-to-back calls (host clock around a synchronize); host = wall time of the op call itself in that "
           "loop; idle = one call on an idle GPU.\n\n");
    printf("| path | keys | device us/call | GB/s | host us/call | host us (idle) |\n");
    printf("| --- | ---: | ---: | ---: | ---: | ---: |\n");
    for (int i = 0; i < n_dec_rows; i++)
        printf("| %s | %u | %.1f | %.0f | %.1f | %.1f |\n", dec_rows[i].path, dec_rows[i].ctx, dec_rows[i].dev * 1e6,
               dec_rows[i].gbps, dec_rows[i].host * 1e6, dec_rows[i].idle * 1e6);
}

static double max_abs(const float *a, const float *b, size_t n)
{
    double e = 0;
    for (size_t i = 0; i < n; i++)
        e = fmax(e, isnan(a[i]) || isnan(b[i]) ? INFINITY : fabs(a[i] - b[i]));
    return e;
}

/* Runs a on be into dout and brings the result to host. */
static void run_to(struct tkv_backend *be, struct tkv_attn_args *a, float *dout, float *host, size_t n)
{
    a->out = dout;
    die_if(be->ops->attention(be, a));
    die_if(be->ops->synchronize(be));
    die_if(gpu->ops->download(gpu, host, dout, n * 4));
}

static void bench_attention(uint32_t H, uint32_t Hkv, uint32_t hd, uint32_t B, uint32_t ctx, uint32_t n_q, int reps,
                            bool variants)
{
    const uint32_t nb = (ctx + B - 1) / B;
    const size_t half = (size_t)B * hd, elems = (size_t)Hkv * nb * 2 * half;
    const bool check_cpu = (double)n_q * ctx <= 512.0 * 32768 && ctx <= 131072;
    const bool decode = n_q * (H / Hkv) <= 8; /* the decode kernel's calls (TKV_ATTN_DECODE_ROWS) */
    uint16_t *kv = check_cpu ? malloc(elems * 2) : NULL, *dkv = kv_random_dev(elems, kv);
    struct tkv_kv_block_ref *hr = malloc((size_t)Hkv * nb * sizeof *hr), *dr = malloc((size_t)Hkv * nb * sizeof *dr);
    struct tkv_kv_head_view hv[64], dv[64];
    for (uint32_t h = 0; h < Hkv; h++) {
        for (uint32_t b = 0; b < nb; b++) {
            const size_t o = ((size_t)h * nb + b) * 2 * half;
            const uint32_t n = ctx - b * B < B ? ctx - b * B : B;
            if (kv)
                hr[h * nb + b] = (struct tkv_kv_block_ref){kv + o, kv + o + half, (int32_t)(b * B), n};
            dr[h * nb + b] = (struct tkv_kv_block_ref){dkv + o, dkv + o + half, (int32_t)(b * B), n};
        }
        hv[h] = (struct tkv_kv_head_view){hr + (size_t)h * nb, nb};
        dv[h] = (struct tkv_kv_head_view){dr + (size_t)h * nb, nb};
    }
    const size_t qn = (size_t)n_q * H * hd;
    float *q = malloc(qn * 4), *oc = malloc(qn * 4), *og = malloc(qn * 4), *ox = malloc(qn * 4);
    int32_t *pos = malloc(n_q * 4);
    for (size_t i = 0; i < qn; i++)
        q[i] = frand();
    for (uint32_t t = 0; t < n_q; t++)
        pos[t] = (int32_t)(ctx - n_q + t);
    float *dq = dalloc(qn * 4), *dout = dalloc(qn * 4);
    die_if(gpu->ops->upload(gpu, dq, q, qn * 4));
    struct tkv_attn_args a = {.q = q, .q_pos = pos, .out = oc, .n_q = n_q, .n_head = H, .n_head_kv = Hkv,
                              .head_dim = hd, .scale = 1.0f / sqrtf((float)hd), .kv = hv};
    /* checks before timing: against the CPU (time permitting) and the general kernel */
    double err = -1, err_general = -1;
    struct tkv_attn_args ga = a;
    ga.q = dq, ga.kv = dv;
    run_to(gpu, &ga, dout, og, qn);
    if (check_cpu) {
        die_if(cpu->ops->attention(cpu, &a));
        err = max_abs(og, oc, qn);
    }
    if (gpu_general && decode) {
        run_to(gpu_general, &ga, dout, ox, qn);
        err_general = max_abs(og, ox, qn);
    }
    if (!(err <= 1e-4) && err >= 0) {
        fprintf(stderr, "bench-attn: attention differs from the CPU: %.3g\n", err);
        exit(1);
    }
    if (!(err_general <= 1e-4) && err_general >= 0) {
        fprintf(stderr, "bench-attn: attention differs from the general kernel: %.3g\n", err_general);
        exit(1);
    }
    ga.out = dout;
    double t_host = 0;
    const double t = variants ? time_on_host(gpu, &ga, reps, &t_host) : time_on(gpu, &ga, reps);
    /* bytes: every visible K and V row once; FLOPs: 4 hd per (query head, visible key) */
    const double kv_bytes = (double)Hkv * ctx * hd * 2 * 2;
    double pairs = 0;
    for (uint32_t i = 0; i < n_q; i++)
        pairs += ctx - n_q + i + 1;
    const double flops = 4.0 * hd * H * pairs;
    char check[64];
    snprintf(check, sizeof check, "%s%s", err >= 0 ? "cpu " : "", err_general >= 0 ? "general" : "");
    printf("| attention | H=%u Hkv=%u hd=%u B=%u | ctx %7u, n_q %3u | %9.1f us | %7.1f GB/s | %6.2f TFLOP/s | %s |\n",
           H, Hkv, hd, B, ctx, n_q, t * 1e6, kv_bytes / t / 1e9, flops / t / 1e12, check[0] ? check : "-");
    /* a decode call as the engine makes it: the views' block arrays already
     * in device memory (kv_dev), nothing packed or copied per call; the same
     * kernel and plan as the packed table, so the same bits */
    double tv = -1e-6, tv_host = 0;
    if (decode) {
        struct tkv_kv_block_ref *drd = dalloc((size_t)Hkv * nb * sizeof *drd);
        die_if(gpu->ops->upload(gpu, drd, dr, (size_t)Hkv * nb * sizeof *drd));
        struct tkv_kv_head_view vv[64];
        for (uint32_t h = 0; h < Hkv; h++)
            vv[h] = (struct tkv_kv_head_view){drd + (size_t)h * nb, nb};
        struct tkv_attn_args va = ga;
        va.kv = vv;
        va.kv_dev = true;
        float *ov = malloc(qn * sizeof *ov), *op = malloc(qn * sizeof *op);
        run_to(gpu, &va, dout, ov, qn);
        run_to(gpu_packed, &ga, dout, op, qn);
        if (memcmp(ov, op, qn * sizeof *op)) {
            fprintf(stderr, "bench-attn: device views differ from the packed table (%.3g)\n", max_abs(ov, op, qn));
            exit(1);
        }
        free(ov), free(op);
        tv = variants ? time_on_host(gpu, &va, reps, &tv_host) : time_on(gpu, &va, reps);
        printf("| attention, device views | H=%u Hkv=%u hd=%u B=%u | ctx %7u, n_q %3u | %9.1f us | %7.1f GB/s | %6.2f "
               "TFLOP/s | same bits |\n",
               H, Hkv, hd, B, ctx, n_q, tv * 1e6, kv_bytes / tv / 1e9, flops / tv / 1e12);
        if (variants)
            dec_row("device views (the engine's decode path from a device table)", ctx, tv, tv_host,
                    host_time(gpu, &va), kv_bytes);
        gpu->ops->release(gpu, drd);
    }
    if (variants) {
        const double th = host_time(gpu, &ga);
        dec_row("default (inline runs, PDL, L2 prefetch where the view fits, else the packed table)", ctx, t, t_host,
                th, kv_bytes);
        double ta[N_ALT];
        for (int i = 0; i < N_ALT; i++) {
            ta[i] = -1e-6;
            if (!alt[i])
                continue;
            if (i > 0) { /* every path is checked against the general kernel first */
                run_to(alt[i], &ga, dout, og, qn);
                const double e = max_abs(og, ox, qn);
                if (!(e <= 1e-4)) {
                    fprintf(stderr, "bench-attn: %s differs from the general kernel: %.3g\n", alt_env[i].name, e);
                    exit(1);
                }
            }
            double hi = 0;
            ta[i] = time_on_host(alt[i], &ga, i == 0 ? reps / 10 + 1 : reps, &hi);
            dec_row(alt_env[i].name, ctx, ta[i], hi, host_time(alt[i], &ga), kv_bytes);
        }
        ga.out = dout;
        if (json) {
            fprintf(json,
                    "{\"op\": \"decode_attention\", \"H\": %u, \"Hkv\": %u, \"hd\": %u, \"B\": %u, \"ctx\": %u, "
                    "\"n_q\": %u, \"kv_bytes\": %.0f, \"us\": %.3f, \"gbps\": %.1f, \"host_us_per_call\": %.3f, "
                    "\"max_err_vs_cpu\": %.3g, \"max_err_vs_general\": %.3g, \"us device views\": %.3f",
                    H, Hkv, hd, B, ctx, n_q, kv_bytes, t * 1e6, kv_bytes / t / 1e9, th * 1e6, err, err_general,
                    tv * 1e6);
            for (int i = 0; i < N_ALT; i++)
                fprintf(json, ", \"us %s\": %.3f", alt_env[i].name, ta[i] * 1e6);
            fprintf(json, "}\n");
        }
    }
    gpu->ops->release(gpu, dkv), gpu->ops->release(gpu, dq), gpu->ops->release(gpu, dout);
    free(kv), free(hr), free(dr), free(q), free(oc), free(og), free(ox), free(pos);
}

/* Prefill of a whole N-token prompt in one call (n_q = N, causal), 32/8
 * heads, head_dim 128, blocks of 64: the tensor-core kernel in its two
 * precisions (TKV_CUDA_ATTN_PREFILL=mma, mma16) and, at 8K, the general
 * kernel; outputs compared (general vs both at 8K, f16 vs split above).
 * Times: one warm-up call, then the median of 3 calls, each synchronized. */
static struct tkv_backend *pf_be[2]; /* mma (split precision), mma16 */
static struct tkv_backend *pf_general; /* TKV_CUDA_ATTN_PREFILL=general   */
static const char *const pf_names[2] = {"tensor cores, split precision (mma)", "tensor cores, f16 (mma16)"};

static double time_calls(struct tkv_backend *be, const struct tkv_attn_args *a)
{
    double ts[3];
    die_if(be->ops->attention(be, a));
    die_if(be->ops->synchronize(be));
    for (int i = 0; i < 3; i++) {
        const double t0 = now();
        die_if(be->ops->attention(be, a));
        die_if(be->ops->synchronize(be));
        ts[i] = now() - t0;
    }
    qsort(ts, 3, sizeof(double), cmp_double);
    return ts[1];
}

static void bench_prefill(uint32_t N)
{
    const uint32_t H = 32, Hkv = 8, hd = 128, B = 64, nb = (N + B - 1) / B;
    const size_t half = (size_t)B * hd, elems = (size_t)Hkv * nb * 2 * half, qn = (size_t)N * H * hd;
    uint16_t *pool = malloc(POOL_HALVES * 2);
    for (size_t i = 0; i < POOL_HALVES; i++)
        pool[i] = tkv_fp32_to_fp16(frand());
    uint16_t *dkv = dalloc(elems * 2);
    for (size_t o = 0; o < elems; o += POOL_HALVES)
        die_if(gpu->ops->upload(gpu, dkv + o, pool, (elems - o < POOL_HALVES ? elems - o : POOL_HALVES) * 2));
    float *qpool = malloc(POOL_HALVES * 4);
    for (size_t i = 0; i < POOL_HALVES; i++)
        qpool[i] = frand();
    float *dq = dalloc(qn * 4), *dout = dalloc(qn * 4);
    for (size_t o = 0; o < qn; o += POOL_HALVES)
        die_if(gpu->ops->upload(gpu, dq + o, qpool, (qn - o < POOL_HALVES ? qn - o : POOL_HALVES) * 4));
    struct tkv_kv_block_ref *dr = malloc((size_t)Hkv * nb * sizeof *dr);
    struct tkv_kv_head_view dv[8];
    for (uint32_t h = 0; h < Hkv; h++) {
        for (uint32_t b = 0; b < nb; b++) {
            const size_t o = ((size_t)h * nb + b) * 2 * half;
            dr[h * nb + b] = (struct tkv_kv_block_ref){dkv + o, dkv + o + half, (int32_t)(b * B),
                                                       N - b * B < B ? N - b * B : B};
        }
        dv[h] = (struct tkv_kv_head_view){dr + (size_t)h * nb, nb};
    }
    int32_t *pos = malloc((size_t)N * 4);
    for (uint32_t t = 0; t < N; t++)
        pos[t] = (int32_t)t;
    struct tkv_attn_args a = {.q = dq, .q_pos = pos, .out = dout, .n_q = N, .n_head = H, .n_head_kv = Hkv,
                              .head_dim = hd, .scale = 1.0f / sqrtf((float)hd), .kv = dv};
    const double flops = 4.0 * hd * H * ((double)N * (N + 1) / 2);
    float *ref = malloc(qn * 4), *cur = malloc(qn * 4);
    double t_general = -1, t_pf[2] = {-1, -1}, err[2] = {-1, -1};
    if (N <= 8192 && pf_general) { /* the general kernel: the reference, and the old speed */
        run_to(pf_general, &a, dout, ref, qn);
        t_general = time_calls(pf_general, &a);
        printf("| prefill attention, general kernel | H=%u Hkv=%u hd=%u B=%u | n %6u causal | %9.1f us | | %6.2f TFLOP/s "
               "| - |\n",
               H, Hkv, hd, B, N, t_general * 1e6, flops / t_general / 1e12);
    }
    if (N > 8192) /* the reference: split precision, v0 */
        run_to(pf_be[0], &a, dout, ref, qn);
    for (int i = 0; i < 2; i++) {
        if (!pf_be[i])
            continue;
        for (int v = 0; v < n_variants; v++) {
            if (!variant_on[v])
                continue;
            die_if(tkv_backend_cuda_set_prefill_variant(pf_be[i], v));
            run_to(pf_be[i], &a, dout, cur, qn);
            const double e = max_abs(cur, ref, qn), tol = i == 0 ? 1e-4 : 2e-3;
            if (!(e <= tol)) { /* not timed; the other variants still are */
                printf("| prefill attention, %s, v%d | n %6u causal | CHECK FAILED: max diff %.3g vs %s |\n",
                       pf_names[i], v, N, e, N <= 8192 ? "general" : "mma v0");
                variant_failed = true;
                continue;
            }
            const double tv = time_calls(pf_be[i], &a);
            if (v == 0)
                t_pf[i] = tv, err[i] = e;
            printf("| prefill attention, %s, v%d | H=%u Hkv=%u hd=%u B=%u | n %6u causal | %9.1f us | | %6.2f TFLOP/s "
                   "| max diff %.1e vs %s |\n",
                   pf_names[i], v, H, Hkv, hd, B, N, tv * 1e6, flops / tv / 1e12, e, N <= 8192 ? "general" : "mma v0");
            if (json)
                fprintf(json,
                        "{\"op\": \"prefill_attention_variant\", \"n\": %u, \"precision\": \"%s\", \"variant\": %d, "
                        "\"us\": %.1f, \"tflops\": %.2f, \"max_diff\": %.3g}\n",
                        N, i ? "mma16" : "mma", v, tv * 1e6, flops / tv / 1e12, e);
            fflush(stdout);
        }
        die_if(tkv_backend_cuda_set_prefill_variant(pf_be[i], 0));
    }
    if (json)
        fprintf(json,
                "{\"op\": \"prefill_attention\", \"H\": %u, \"Hkv\": %u, \"hd\": %u, \"B\": %u, \"n\": %u, \"flops\": %.4g, "
                "\"us_general\": %.1f, \"us_mma\": %.1f, \"us_mma16\": %.1f, \"max_diff_mma\": %.3g, "
                "\"max_diff_mma16\": %.3g}\n",
                H, Hkv, hd, B, N, flops, t_general * 1e6, t_pf[0] * 1e6, t_pf[1] * 1e6, err[0], err[1]);
    fflush(stdout);
    gpu->ops->release(gpu, dkv), gpu->ops->release(gpu, dq), gpu->ops->release(gpu, dout);
    free(pool), free(qpool), free(dr), free(pos), free(ref), free(cur);
}

/* The prefill-sparse section (see the top of the file). */
static struct tkv_backend *sp_be[2]; /* packed tiles (default), per-ref walk */
static const char *const sp_walk[2] = {"packed tiles", "per-ref walk"};

static void bench_prefill_sparse(uint32_t n_q, int reps)
{
    const uint32_t H = 32, Hkv = 8, hd = 128, B = 64, ctx = 32768, nb = ctx / B, n_sel = 256, L = 8;
    const uint32_t chunk0 = ctx - n_q, slots = chunk0 / L; /* 8-row slots before the chunk */
    const size_t half = (size_t)B * hd, elems = (size_t)Hkv * nb * 2 * half, qn = (size_t)n_q * H * hd;
    uint16_t *dkv = kv_random_dev(elems, NULL);
    float *q = malloc(qn * 4), *ref = malloc(qn * 4), *cur = malloc(qn * 4);
    for (size_t i = 0; i < qn; i++)
        q[i] = frand();
    float *dq = dalloc(qn * 4), *dout = dalloc(qn * 4);
    die_if(gpu->ops->upload(gpu, dq, q, qn * 4));
    int32_t *pos = malloc(n_q * 4);
    for (uint32_t t = 0; t < n_q; t++)
        pos[t] = (int32_t)(chunk0 + t);

    /* per head: [dense: nb refs] [sparse: n_sel refs, then the chunk's blocks] */
    const uint32_t n_chunk_blocks = n_q / B, per_head = nb + n_sel + n_chunk_blocks;
    struct tkv_kv_block_ref *refs = malloc((size_t)Hkv * per_head * sizeof *refs);
    struct tkv_kv_head_view dense[8], sparse[8], mixed[8];
    uint8_t *taken = calloc(slots, 1);
    for (uint32_t h = 0; h < Hkv; h++) {
        struct tkv_kv_block_ref *r = refs + (size_t)h * per_head;
        uint16_t *base = dkv + (size_t)h * nb * 2 * half; /* block b: K at base + 2b half, V after */
        for (uint32_t b = 0; b < nb; b++)
            r[b] = (struct tkv_kv_block_ref){base + (size_t)2 * b * half, base + (size_t)(2 * b + 1) * half,
                                             (int32_t)(b * B), B};
        memset(taken, 0, slots);
        for (uint32_t i = 0; i < n_sel;) { /* 256 distinct slots, then in position order */
            rng ^= rng >> 12, rng ^= rng << 25, rng ^= rng >> 27;
            const uint32_t sl = (uint32_t)((rng * 0x2545F4914F6CDD1DULL) >> 33) % slots;
            if (!taken[sl])
                taken[sl] = 1, i++;
        }
        struct tkv_kv_block_ref *sr = r + nb;
        uint32_t k = 0;
        for (uint32_t sl = 0; sl < slots; sl++)
            if (taken[sl]) {
                const uint32_t p = sl * L, b = p / B;
                const size_t row = (size_t)(p % B) * hd;
                sr[k++] = (struct tkv_kv_block_ref){base + (size_t)2 * b * half + row,
                                                    base + (size_t)(2 * b + 1) * half + row, (int32_t)p, L};
            }
        for (uint32_t c = 0; c < n_chunk_blocks; c++)
            sr[k++] = r[chunk0 / B + c];
        dense[h] = (struct tkv_kv_head_view){r, nb};
        sparse[h] = (struct tkv_kv_head_view){sr, n_sel};
        mixed[h] = (struct tkv_kv_head_view){sr, n_sel + n_chunk_blocks};
    }
    const struct {
        const char *name;
        const struct tkv_kv_head_view *kv;
        double pairs; /* (query, visible key) pairs per query head */
    } views[3] = {
        {"dense 32K", dense, (double)n_q * chunk0 + (double)n_q * (n_q + 1) / 2},
        {"256 x 8-row refs", sparse, (double)n_q * n_sel * L},
        {"256 x 8-row refs + chunk", mixed, (double)n_q * n_sel * L + (double)n_q * (n_q + 1) / 2},
    };
    double t[3][2] = {{0}};
    for (int v = 0; v < 3; v++) {
        struct tkv_attn_args a = {.q = dq, .q_pos = pos, .out = dout, .n_q = n_q, .n_head = H, .n_head_kv = Hkv,
                                  .head_dim = hd, .scale = 1.0f / sqrtf((float)hd), .kv = views[v].kv};
        run_to(pf_general, &a, dout, ref, qn);
        const double flops = 4.0 * hd * H * views[v].pairs;
        for (int w = 0; w < 2; w++) {
            for (int pv = 0; pv < n_variants; pv++) {
                if (!variant_on[pv])
                    continue;
                die_if(tkv_backend_cuda_set_prefill_variant(sp_be[w], pv));
                run_to(sp_be[w], &a, dout, cur, qn);
                const double err = max_abs(cur, ref, qn);
                if (!(err <= 1e-4)) { /* not timed; the other variants still are */
                    printf("| prefill-sparse, %s, %s, v%d | n_q %4u | CHECK FAILED: max diff %.3g vs general |\n",
                           views[v].name, sp_walk[w], pv, n_q, err);
                    variant_failed = true;
                    continue;
                }
                a.out = dout;
                const double tv = time_on(sp_be[w], &a, reps);
                if (pv == 0)
                    t[v][w] = tv;
                printf("| prefill-sparse, %s, %s, v%d | H=%u Hkv=%u hd=%u B=%u | ctx %u, n_q %4u, %.0f keys/query | "
                       "%9.1f us | | %6.2f TFLOP/s | max diff %.1e vs general |\n",
                       views[v].name, sp_walk[w], pv, H, Hkv, hd, B, ctx, n_q, views[v].pairs / n_q, tv * 1e6,
                       flops / tv / 1e12, err);
                if (json)
                    fprintf(json,
                            "{\"op\": \"prefill_sparse\", \"view\": \"%s\", \"walk\": \"%s\", \"variant\": %d, "
                            "\"n_q\": %u, \"ctx\": %u, \"flops\": %.4g, \"us\": %.2f, \"tflops\": %.2f, "
                            "\"max_diff_vs_general\": %.3g}\n",
                            views[v].name, sp_walk[w], pv, n_q, ctx, flops, tv * 1e6, flops / tv / 1e12, err);
            }
            die_if(tkv_backend_cuda_set_prefill_variant(sp_be[w], 0));
        }
    }
    for (int v = 1; v < 3 && variant_on[0]; v++) /* v0's walks */
        printf("| prefill-sparse, dense / (%s) | n_q %4u | FLOPs ratio %.1f | packed %.2fx, per-ref %.2fx | | | |\n",
               views[v].name, n_q, views[0].pairs / views[v].pairs, t[0][0] / t[v][0], t[0][1] / t[v][1]);
    fflush(stdout);
    gpu->ops->release(gpu, dkv), gpu->ops->release(gpu, dq), gpu->ops->release(gpu, dout);
    free(q), free(ref), free(cur), free(pos), free(refs), free(taken);
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

static struct tkv_backend *gpu_with_attn_env(const char *decode, const char *table, const char *prefill)
{
    struct tkv_backend *be = NULL;
    setenv("TKV_CUDA_ATTN_DECODE", decode, 1);
    setenv("TKV_CUDA_ATTN_TABLE", table, 1);
    setenv("TKV_CUDA_ATTN_PREFILL", prefill, 1);
    die_if(tkv_backend_create("cuda", 0, &be));
    unsetenv("TKV_CUDA_ATTN_DECODE"), unsetenv("TKV_CUDA_ATTN_TABLE"), unsetenv("TKV_CUDA_ATTN_PREFILL");
    return be;
}

/* The same, walking the refs one by one (TKV_CUDA_ATTN_PACK=0). */
static struct tkv_backend *gpu_per_ref(void)
{
    setenv("TKV_CUDA_ATTN_PACK", "0", 1);
    struct tkv_backend *be = gpu_with_attn_env("1", "copy", "mma");
    unsetenv("TKV_CUDA_ATTN_PACK");
    return be;
}

/* decode-sparse: one decode call (n_q = 1) over a selection's slices against
 * the same number of keys read densely. The KV of ctx keys per head lies in
 * blocks of 64 as the store's slots hold them; the selection keeps each
 * aligned group of 16 keys of head 0 with probability share0, of the other
 * heads with probability share (the policy's groups of 16 on a GPU), and
 * cuts them as kv_table does -- one entry per maximal run inside a block --
 * while the dense call reads whole blocks from the start until it has as
 * many keys per head. Both go as the engine's calls over a decode table go
 * (device views, their entry and key counts in device memory), both are
 * checked against the general kernel; the rate is the keys' K and V bytes
 * over the time. Timed on the default backend (the kernel's CTAs a pool
 * the heads share by their keys) and on `plain` (TKV_CUDA_ATTN_POOL=0:
 * the same splits for every head): what the slices cost beyond their bytes
 * (entries, short runs, scattered pages) is slices / dense; what sharing
 * the GPU by keys gains where the heads read unevenly, plain / pool. */
static void bench_sparse_decode(struct tkv_backend *plain, uint32_t H, uint32_t Hkv, uint32_t ctx, double share0,
                                double share, int reps)
{
    const uint32_t hd = 128, B = 64, nb = ctx / B;
    const size_t half = (size_t)B * hd, elems = (size_t)Hkv * nb * 2 * half;
    uint16_t *dkv = kv_random_dev(elems, NULL);
    struct tkv_kv_block_ref *sr = malloc((size_t)Hkv * nb * 2 * sizeof *sr), *dr = malloc((size_t)Hkv * nb * sizeof *dr);
    uint32_t cnt[2][64][2]; /* [slices, dense][head]: entries, keys (the engine's counts' layout, stride 2) */
    uint64_t keys = 0, entries = 0;
    for (uint32_t h = 0; h < Hkv; h++) {
        struct tkv_kv_block_ref *r = sr + (size_t)h * nb * 2;
        const double sh = h == 0 ? share0 : share;
        uint32_t n = 0, k = 0;
        for (uint32_t b = 0; b < nb; b++) {
            const size_t o = ((size_t)h * nb + b) * 2 * half;
            bool in = false; /* a run of kept groups inside block b */
            for (uint32_t g = 0; g < B / 16; g++) {
                const bool keep = (frand() + 1.0f) * 0.5f < sh || (b == nb - 1 && g == B / 16 - 1); /* (the tail) */
                if (keep && in) {
                    r[n - 1].n += 16;
                } else if (keep) {
                    const size_t row = (size_t)g * 16 * hd;
                    r[n++] = (struct tkv_kv_block_ref){dkv + o + row, dkv + o + half + row, (int32_t)(b * B + g * 16), 16};
                }
                in = keep;
                k += keep ? 16 : 0;
            }
        }
        cnt[0][h][0] = n, cnt[0][h][1] = k;
        entries += n;
        /* dense: whole blocks from the start, as many keys (the last block cut) */
        uint32_t m = 0;
        for (uint32_t b = 0, left = k; left > 0; b++, m++) {
            const size_t o = ((size_t)h * nb + b) * 2 * half;
            const uint32_t take = left < B ? left : B;
            dr[(size_t)h * nb + m] = (struct tkv_kv_block_ref){dkv + o, dkv + o + half, (int32_t)(b * B), take};
            left -= take;
        }
        cnt[1][h][0] = m, cnt[1][h][1] = k;
        keys += k;
    }
    /* the refs and counts in device memory, as the engine's tables are; the
     * views' n_blocks are bounds, as the engine's are */
    struct tkv_kv_block_ref *dsr = dalloc((size_t)Hkv * nb * 2 * sizeof *dsr), *ddr = dalloc((size_t)Hkv * nb * sizeof *ddr);
    uint32_t *dcnt = dalloc(sizeof cnt);
    die_if(gpu->ops->upload(gpu, dsr, sr, (size_t)Hkv * nb * 2 * sizeof *dsr));
    die_if(gpu->ops->upload(gpu, ddr, dr, (size_t)Hkv * nb * sizeof *ddr));
    die_if(gpu->ops->upload(gpu, dcnt, cnt, sizeof cnt));
    struct tkv_kv_head_view sv[64], dv[64];
    for (uint32_t h = 0; h < Hkv; h++) {
        sv[h] = (struct tkv_kv_head_view){dsr + (size_t)h * nb * 2, nb * 2};
        dv[h] = (struct tkv_kv_head_view){ddr + (size_t)h * nb, nb};
    }
    const size_t qn = (size_t)H * hd;
    float *q = malloc(qn * 4), *o1 = malloc(qn * 4), *o2 = malloc(qn * 4);
    for (size_t i = 0; i < qn; i++)
        q[i] = frand();
    int32_t pos = (int32_t)ctx - 1;
    float *dq = dalloc(qn * 4), *dout = dalloc(qn * 4);
    die_if(gpu->ops->upload(gpu, dq, q, qn * 4));
    struct tkv_attn_args a = {.q = dq, .q_pos = &pos, .n_q = 1, .n_head = H, .n_head_kv = Hkv, .head_dim = hd,
                              .scale = 1.0f / sqrtf((float)hd), .kv_dev = true, .kv_dev_n_stride = 2};
    double t[2][2]; /* [slices, dense][pool, plain] */
    for (int v = 0; v < 2; v++) {
        a.kv = v ? dv : sv;
        a.kv_dev_n = dcnt + (size_t)v * 64 * 2;
        a.kv_dev_keys = a.kv_dev_n + 1;
        struct tkv_backend *be[2] = {gpu, plain};
        for (int w = 0; w < 2; w++) {
            if (gpu_general) { /* the general kernel over the same device views */
                run_to(be[w], &a, dout, o1, qn);
                run_to(gpu_general, &a, dout, o2, qn);
                const double e = max_abs(o1, o2, qn);
                if (!(e <= 1e-4)) {
                    fprintf(stderr, "bench-attn: decode-sparse (%s, %s) differs from the general kernel: %.3g\n",
                            v ? "dense" : "slices", w ? "plain" : "pool", e);
                    exit(1);
                }
            }
            a.out = dout;
            t[v][w] = time_on(be[w], &a, reps);
        }
    }
    const double bytes = (double)keys * hd * 2 * 2;
    printf("| %u/%u | %uK | %.2f / %.2f | %.1f | %.1f | %.1f | %.0f | %.1f | %.2f | %.2f |\n", H, Hkv, ctx / 1024,
           (double)cnt[0][0][1] / ctx, Hkv > 1 ? (double)(keys - cnt[0][0][1]) / ((double)(Hkv - 1) * ctx) : 0.0,
           (double)keys / (double)entries, t[0][1] * 1e6, t[0][0] * 1e6, bytes / t[0][0] / 1e9, t[1][0] * 1e6,
           t[0][0] / t[1][0], t[0][1] / t[0][0]);
    gpu->ops->release(gpu, dkv), gpu->ops->release(gpu, dsr), gpu->ops->release(gpu, ddr);
    gpu->ops->release(gpu, dcnt), gpu->ops->release(gpu, dq), gpu->ops->release(gpu, dout);
    free(sr), free(dr), free(q), free(o1), free(o2);
}

int main(int argc, char **argv)
{
    int reps = 50, profile = 0;
    const char *section = "all", *json_path = NULL, *variants = NULL;
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "-r") && i + 1 < argc)
            reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "-s") && i + 1 < argc)
            section = argv[++i];
        else if (!strcmp(argv[i], "-j") && i + 1 < argc)
            json_path = argv[++i];
        else if (!strcmp(argv[i], "-x")) {
            profile = 131072;
            if (i + 1 < argc && argv[i + 1][0] >= '1' && argv[i + 1][0] <= '9')
                profile = atoi(argv[++i]);
        }
        else if (!strcmp(argv[i], "-V") && i + 1 < argc)
            variants = argv[++i];
        else {
            fprintf(stderr, "usage: bench-attn [-r reps] [-s all|decode|decode-short|decode-sparse|prefill|prefill-long|prefill-sparse|matmul] "
                            "[-V 0,1,..] [-j out.json] [-x [ctx]]\n");
            return 2;
        }
    if (tkv_backend_cuda_devices() == 0) {
        fprintf(stderr, "bench-attn: no CUDA device\n");
        return 77;
    }
    if (json_path && !(json = fopen(json_path, "w"))) {
        fprintf(stderr, "bench-attn: cannot write %s\n", json_path);
        return 1;
    }
    unsetenv("TKV_CUDA_ATTN_DECODE"), unsetenv("TKV_CUDA_ATTN_TABLE"), unsetenv("TKV_CUDA_ATTN_PREFILL");
    unsetenv("TKV_CUDA_ATTN_PACK");
    die_if(tkv_backend_create("cuda", 0, &gpu));
    gpu_packed = gpu_with_attn_env("fused", "copy", "mma");
    die_if(tkv_backend_create("cpu", 0, &cpu));
    while (n_variants < 32 && tkv_backend_cuda_prefill_variant_desc(n_variants))
        n_variants++;
    for (int v = 0; v < n_variants; v++) /* -V 1 or 0,1: those; default all */
        variant_on[v] = !variants;
    for (const char *c = variants; c && *c;) {
        char *end;
        const long v = strtol(c, &end, 10);
        if (end == c || v < 0 || v >= n_variants) {
            fprintf(stderr, "bench-attn: -V %s: variants are 0 .. %d\n", variants, n_variants - 1);
            return 2;
        }
        variant_on[v] = true;
        c = *end == ',' ? end + 1 : end;
    }
    for (int v = 0; v < n_variants; v++)
        if (variant_on[v])
            printf("prefill %s\n", tkv_backend_cuda_prefill_variant_desc(v));
    printf("\n");
    printf("| op | shape | size | time/call | bytes rate | compute rate | check |\n");
    printf("| --- | --- | --- | ---: | ---: | ---: | --- |\n");
    if (profile) {
        bench_attention(32, 8, 128, 64, (uint32_t)profile, 1, 1, false);
        gpu->ops->free(gpu), gpu_packed->ops->free(gpu_packed);
        cpu->ops->free(cpu);
        return 0;
    }
    const bool all = !strcmp(section, "all");
    if (all || !strcmp(section, "decode")) {
        for (int i = 0; i < N_ALT; i++) {
            if (alt_env[i].prefetch)
                setenv("TKV_CUDA_ATTN_PREFETCH", alt_env[i].prefetch, 1);
            alt[i] = gpu_with_attn_env(alt_env[i].decode, alt_env[i].table, i == 0 ? "general" : "mma");
            unsetenv("TKV_CUDA_ATTN_PREFETCH");
        }
        const uint32_t ctxs[] = {32768, 131072, 1048576};
        for (int i = 0; i < 3; i++)
            bench_attention(32, 8, 128, 64, ctxs[i], 1, reps, true);
        dec_rows_print();
    }
    if (!strcmp(section, "decode-sparse")) {
        alt[0] = gpu_with_attn_env(alt_env[0].decode, alt_env[0].table, "general");
        setenv("TKV_CUDA_ATTN_POOL", "0", 1);
        struct tkv_backend *plain = NULL;
        die_if(tkv_backend_create("cuda", 0, &plain));
        unsetenv("TKV_CUDA_ATTN_POOL");
        printf("| heads | keys | share read (head 0 / others) | keys per entry | slices, plain us | slices, pool us | "
               "GB/s | dense, pool us | slices / dense | plain / pool |\n");
        printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
        const uint32_t ctxs[] = {131072, 1048576};
        const double shares[][2] = {{0.1, 0.1}, {0.25, 0.25}, {0.9, 0.1}, {0.5, 0.1}};
        for (int i = 0; i < 2; i++)
            for (int j = 0; j < 4; j++) {
                bench_sparse_decode(plain, 32, 8, ctxs[i], shares[j][0], shares[j][1], reps);
                bench_sparse_decode(plain, 28, 4, ctxs[i], shares[j][0], shares[j][1], reps);
            }
        plain->ops->free(plain);
    }
    if (!strcmp(section, "decode-short")) { /* the default path only, short to long (split-count sweeps) */
        const uint32_t ctxs[] = {4096, 8192, 16384, 32768, 131072};
        for (int i = 0; i < 5; i++)
            bench_attention(32, 8, 128, 64, ctxs[i], 1, reps, false);
    }
    if (all) {
        bench_attention(32, 8, 128, 64, 1024, 1, reps, false);
        bench_attention(32, 8, 128, 64, 8192, 1, reps, false);
        const uint32_t small[] = {1024, 8192, 32768};
        for (int i = 0; i < 3; i++)
            bench_attention(9, 3, 64, 64, small[i], 1, reps, false);
    }
    if (all || !strcmp(section, "prefill") || !strcmp(section, "prefill-long")) {
        pf_be[0] = gpu_with_attn_env("1", "copy", "mma");
        pf_be[1] = gpu_with_attn_env("1", "copy", "mma16");
        pf_general = gpu_with_attn_env("0", "copy", "general");
        const uint32_t ns[] = {8192, 32768, 131072};
        for (int i = 0; i < 3; i++)
            bench_prefill(ns[i]);
        for (int i = 0; i < 2; i++)
            pf_be[i]->ops->free(pf_be[i]);
        pf_general->ops->free(pf_general);
    }
    if (all || !strcmp(section, "prefill")) {
        bench_attention(32, 8, 128, 64, 8192, 512, reps / 5 + 1, false);
        bench_attention(32, 8, 128, 64, 32768, 512, reps / 10 + 1, false);
        bench_attention(9, 3, 64, 64, 4096, 512, reps / 5 + 1, false);
    }
    if (all || !strcmp(section, "prefill-sparse")) {
        sp_be[0] = gpu_with_attn_env("1", "copy", "mma");
        sp_be[1] = gpu_per_ref();
        pf_general = gpu_with_attn_env("0", "copy", "general");
        bench_prefill_sparse(512, reps / 5 + 1);
        bench_prefill_sparse(2048, reps / 10 + 1);
        for (int i = 0; i < 2; i++)
            sp_be[i]->ops->free(sp_be[i]);
        pf_general->ops->free(pf_general);
    }
    if (all || !strcmp(section, "matmul")) {
        bench_matmul(4096, 4096, 1, reps);
        bench_matmul(4096, 14336, 1, reps);
        bench_matmul(576, 1536, 1, reps);
        bench_matmul(4096, 4096, 512, reps);
        bench_matmul(4096, 14336, 512, reps);
    }
    if (json)
        fclose(json);
    for (int i = 0; i < N_ALT; i++)
        if (alt[i])
            alt[i]->ops->free(alt[i]);
    gpu->ops->free(gpu), gpu_packed->ops->free(gpu_packed);
    cpu->ops->free(cpu);
    if (variant_failed)
        fprintf(stderr, "bench-attn: a prefill variant failed its check (CHECK FAILED rows)\n");
    return variant_failed ? 1 : 0;
}
