/*
 * bench-gemv.c -- the CUDA backend's decode matmul (f16 weights, few tokens)
 * against its reference kernel, cuBLAS and a device-to-device copy of the
 * same bytes, for the Llama-3-8B shapes (docs/gpu.md, "GEMV").
 *
 *   bench-gemv [-r reps] [-n tokens] [-q auto|pair|single] [-j out.jsonl]
 *
 * Four CUDA backends, all through the backend interface: the default one
 * (the fast GEMV), TKV_CUDA_GEMV=u8 (the fast GEMV with 8 loads per lane in
 * flight), TKV_CUDA_GEMV=ref (the reference kernel) and
 * TKV_CUDA_GEMV=cublas (cublasGemmEx, f16 x f16 -> f32, f32 compute: the
 * prefill path), each created with TKV_CUDA_PROFILE=1. Times per call are
 * device times from the op profile's events, not host clocks: a 1024x4096
 * GEMV takes ~2 us, about what queuing a launch costs, so host clocks would
 * measure the launch rate. The weights are cycled through copies larger
 * than the L2 together (512 MiB); the copy moves the same bytes between
 * buffers as large. Rates: GEMV = weight bytes / time; copy = bytes read +
 * written / time (bench-decode's roofline bandwidth); "of copy" = their
 * ratio (target >= 0.9). Then the fused decode ops (matmul_group on q/k/v
 * and gate/up, matmul_swiglu) against the separate launches they replace,
 * by device busy time, device span (launch gaps included) and host wall
 * time per group. Then the quantized decode GEMV (Q4_0, Q8_0 and Q4_1
 * weights kept as their GGUF blocks, activations quantized to 8 bits in the
 * same op: the matmul row's time includes that kernel) against a device
 * copy of the quantized bytes and against the f16 GEMV of the same matrix
 * (a TKV_CUDA_GEMV_QUANT=0 backend), and the fused ops on Q4_0 weights;
 * -q pair (single) runs those quantized tables on a
 * TKV_CUDA_GEMV_QUANT=pair (=single) backend: rows in pairs always (never)
 * instead of the default's choice by size.
 * Exits 77 without a GPU.
 */
#include "runtime/backend.h"

#include "bench.h"
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define ROTATE_BYTES ((size_t)512 << 20)
#define MAX_COPIES 64

static void die_if(tkv_status st, const char *what)
{
    if (st != TKV_OK) {
        fprintf(stderr, "bench-gemv: %s: %s\n", what, tkv_last_error());
        exit(1);
    }
}

static struct tkv_backend *make_backend_q(const char *gemv, const char *quant)
{
    struct tkv_backend *be;
    setenv("TKV_CUDA_PROFILE", "1", 1);
    if (gemv)
        setenv("TKV_CUDA_GEMV", gemv, 1);
    if (quant)
        setenv("TKV_CUDA_GEMV_QUANT", quant, 1);
    die_if(tkv_backend_create("cuda", 0, &be), "backend");
    unsetenv("TKV_CUDA_GEMV");
    unsetenv("TKV_CUDA_GEMV_QUANT");
    unsetenv("TKV_CUDA_PROFILE");
    if (!be->ops->profile_read) {
        fprintf(stderr, "bench-gemv: the CUDA backend keeps no op profile\n");
        exit(1);
    }
    return be;
}

static struct tkv_backend *make_backend(const char *gemv) { return make_backend_q(gemv, NULL); }

/* How many copies of a weight of `bytes` to cycle through so that together
 * they exceed the L2 (1 .. MAX_COPIES). */
static uint32_t n_copies(size_t bytes)
{
    const uint32_t c = (uint32_t)((ROTATE_BYTES + bytes - 1) / bytes);
    return c < 1 ? 1 : c > MAX_COPIES ? MAX_COPIES : c;
}

/* Device seconds per call of the profile rows whose name starts with op. */
static double dev_per_call(struct tkv_backend *be, const char *op)
{
    struct tkv_op_profile p;
    die_if(be->ops->profile_read(be, &p), "profile_read");
    double s = 0;
    uint64_t calls = 0;
    for (uint32_t i = 0; i < p.n_rows; i++)
        if (!strncmp(p.rows[i].name, op, strlen(op)) && p.rows[i].dev_s >= 0) {
            s += p.rows[i].dev_s;
            calls += p.rows[i].calls;
        }
    be->ops->profile_reset(be);
    return calls ? s / calls : NAN;
}

struct result {
    double us, host_us; /* device us per call; host wall us per call (queued back to back) */
    float *y;           /* host copy of the first call's output [n, n_out] */
};

/* reps matmuls on be, cycling over `copies` copies of the weight t. */
static void time_matmul(struct tkv_backend *be, const struct tkv_gguf_tensor *t, uint32_t copies, const float *x,
                        uint32_t n, int reps, struct result *r)
{
    const uint32_t n_in = (uint32_t)t->ne[0], n_out = (uint32_t)t->ne[1];
    struct tkv_bweight *w[MAX_COPIES];
    for (uint32_t c = 0; c < copies; c++)
        die_if(be->ops->weight_init(be, t, &w[c]), "weight_init");
    void *dx, *dy;
    die_if(be->ops->alloc(be, (size_t)n * n_in * sizeof(float), &dx), "alloc");
    die_if(be->ops->alloc(be, (size_t)n * n_out * sizeof(float), &dy), "alloc");
    die_if(be->ops->upload(be, dx, x, (size_t)n * n_in * sizeof(float)), "upload");
    for (uint32_t c = 0; c < copies + 2; c++) /* warm-up */
        die_if(be->ops->matmul(be, w[c % copies], dx, dy, n), "matmul");
    r->y = malloc((size_t)n * n_out * sizeof(float));
    die_if(be->ops->download(be, r->y, dy, (size_t)n * n_out * sizeof(float)), "download");
    be->ops->profile_reset(be);
    const double t0 = now();
    for (int i = 0; i < reps; i++)
        die_if(be->ops->matmul(be, w[i % copies], dx, dy, n), "matmul");
    die_if(be->ops->synchronize(be), "synchronize");
    r->host_us = (now() - t0) / reps * 1e6;
    r->us = dev_per_call(be, "matmul") * 1e6;
    for (uint32_t c = 0; c < copies; c++)
        be->ops->weight_free(be, w[c]);
    be->ops->release(be, dx);
    be->ops->release(be, dy);
}

/* Device seconds per copy of `bytes` between two buffers of copies x bytes. */
static double time_copy(struct tkv_backend *be, size_t bytes, uint32_t copies, int reps)
{
    void *a, *b;
    die_if(be->ops->alloc(be, bytes * copies, &a), "alloc");
    die_if(be->ops->alloc(be, bytes * copies, &b), "alloc");
    for (uint32_t c = 0; c < copies + 2; c++)
        die_if(be->ops->copy(be, (char *)b + (c % copies) * bytes, (char *)a + (c % copies) * bytes, bytes), "copy");
    die_if(be->ops->synchronize(be), "synchronize");
    be->ops->profile_reset(be);
    for (int i = 0; i < reps; i++)
        die_if(be->ops->copy(be, (char *)b + (i % copies) * bytes, (char *)a + (i % copies) * bytes, bytes), "copy");
    const double s = dev_per_call(be, "copy");
    be->ops->release(be, a);
    be->ops->release(be, b);
    return s;
}

/* Device busy and span seconds per rep of everything profiled since the
 * last reset (busy: the ops' own times; span: first start to last end,
 * gaps between launches included). */
static void dev_busy_span(struct tkv_backend *be, int reps, double *busy, double *span)
{
    struct tkv_op_profile p;
    die_if(be->ops->profile_read(be, &p), "profile_read");
    *busy = p.dev_busy_s / reps;
    *span = p.dev_span_s / reps;
    be->ops->profile_reset(be);
}

/* The grouped decode matmuls: nw weights of the same n_in sharing x, as
 * separate matmuls (+ swiglu when `swiglu`) or as one fused op
 * (matmul_group, or matmul_swiglu when `swiglu`). */
struct group_result {
    double busy_us, span_us, host_us;
    float *y; /* the first output after warm-up: [n, n_out of weight 0] */
};
static void time_group(struct tkv_backend *be, const struct tkv_gguf_tensor *const *t, uint32_t nw, bool swiglu,
                       bool fused, uint32_t copies, const float *x, uint32_t n, int reps, struct group_result *r)
{
    const uint32_t n_in = (uint32_t)t[0]->ne[0];
    struct tkv_bweight *w[MAX_COPIES][4];
    void *dx, *dy[4];
    for (uint32_t c = 0; c < copies; c++)
        for (uint32_t i = 0; i < nw; i++)
            die_if(be->ops->weight_init(be, t[i], &w[c][i]), "weight_init");
    die_if(be->ops->alloc(be, (size_t)n * n_in * sizeof(float), &dx), "alloc");
    for (uint32_t i = 0; i < nw; i++)
        die_if(be->ops->alloc(be, (size_t)n * (size_t)t[i]->ne[1] * sizeof(float), &dy[i]), "alloc");
    die_if(be->ops->upload(be, dx, x, (size_t)n * n_in * sizeof(float)), "upload");
    for (int i = -(int)copies - 2; i < reps; i++) { /* warm-up, then timed */
        if (i == 0) {
            const size_t ny = (size_t)n * (size_t)t[0]->ne[1];
            r->y = malloc(ny * sizeof(float));
            die_if(be->ops->download(be, r->y, dy[0], ny * sizeof(float)), "download");
            be->ops->profile_reset(be);
            r->host_us = now();
        }
        struct tkv_bweight **wc = w[(uint32_t)(i + (int)copies + 2) % copies];
        if (fused && swiglu)
            die_if(be->ops->matmul_swiglu(be, wc[0], wc[1], dx, dy[0], n), "matmul_swiglu");
        else if (fused)
            die_if(be->ops->matmul_group(be, (const struct tkv_bweight *const *)wc, nw, dx, (float *const *)dy, n),
                   "matmul_group");
        else {
            for (uint32_t k = 0; k < nw; k++)
                die_if(be->ops->matmul(be, wc[k], dx, dy[k], n), "matmul");
            if (swiglu)
                die_if(be->ops->swiglu(be, dy[0], dy[1], dy[0], (size_t)n * (size_t)t[0]->ne[1]), "swiglu");
        }
    }
    die_if(be->ops->synchronize(be), "synchronize");
    r->host_us = (now() - r->host_us) / reps * 1e6;
    double busy, span;
    dev_busy_span(be, reps, &busy, &span);
    r->busy_us = busy * 1e6, r->span_us = span * 1e6;
    for (uint32_t c = 0; c < copies; c++)
        for (uint32_t i = 0; i < nw; i++)
            be->ops->weight_free(be, w[c][i]);
    be->ops->release(be, dx);
    for (uint32_t i = 0; i < nw; i++)
        be->ops->release(be, dy[i]);
}

static double rel_diff(const float *a, const float *b, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        den += (double)b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* A tensor of random weights [n_out, n_in]: f16 values in (-1, 1) of
 * magnitude >= 1/8 (1M of them, tiled), or Q4_0 / Q4_1 / Q8_0 blocks of
 * random quants with scales of 1/64 .. 1/128 (1 MiB of them, tiled). */
static void make_weight(struct tkv_gguf_tensor *t, uint32_t type, uint32_t n_out, uint32_t n_in, const char *name)
{
    const size_t bb = type == TKV_TYPE_Q4_0 ? 18 : type == TKV_TYPE_Q4_1 ? 20 : type == TKV_TYPE_Q8_0 ? 34 : 0;
    const size_t bytes = bb ? (size_t)n_out * n_in / 32 * bb : (size_t)n_out * n_in * 2, tile = (size_t)1 << 20;
    uint8_t *h = malloc(bytes);
    if (!h) {
        fprintf(stderr, "bench-gemv: out of host memory\n");
        exit(1);
    }
    if (!bb) {
        uint16_t *h16 = (uint16_t *)h;
        for (size_t i = 0; i < bytes / 2; i++)
            h16[i] = i < tile ? (uint16_t)(0x3000 + (rnd() % 0x0C00)) ^ (uint16_t)((rnd() & 1) << 15) : h16[i % tile];
    } else {
        for (size_t i = 0; i < bytes; i++)
            h[i] = i < tile * bb ? (uint8_t)rnd() : h[i % (tile * bb)];
        for (size_t b = 0; b < bytes / bb; b++) { /* d (and m) as f16 in [1/128, 1/64) */
            const uint16_t d = (uint16_t)(0x2000 + (rnd() % 0x0400));
            memcpy(h + b * bb, &d, 2);
            if (type == TKV_TYPE_Q4_1)
                memcpy(h + b * bb + 2, &d, 2);
        }
    }
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "bench.%s", name);
    t->n_dims = 2;
    t->ne[0] = n_in;
    t->ne[1] = n_out;
    t->ne[2] = t->ne[3] = 1;
    t->type = bb ? type : TKV_TYPE_F16;
    t->n_elems = (uint64_t)n_in * n_out;
    t->nbytes = bytes;
    t->data = h;
}

/* The fused decode ops on Llama-3-8B's groups against separate launches:
 * q/k/v (matmul_group), gate/up (matmul_group, and matmul_swiglu against
 * two matmuls and swiglu). */
static void bench_groups(struct tkv_backend *be, uint32_t type, uint32_t n, int reps, FILE *json, const char *commit)
{
    if (!be->ops->matmul_group || !be->ops->matmul_swiglu)
        return;
    struct tkv_gguf_tensor q, k, v, g, u;
    make_weight(&q, type, 4096, 4096, "wq");
    make_weight(&k, type, 1024, 4096, "wk");
    make_weight(&v, type, 1024, 4096, "wv");
    make_weight(&g, type, 14336, 4096, "gate");
    make_weight(&u, type, 14336, 4096, "up");
    float *x = malloc((size_t)n * 4096 * sizeof *x);
    for (size_t i = 0; i < (size_t)n * 4096; i++)
        x[i] = (float)((rnd() >> 40) / 16777216.0 * 2.0 - 1.0) * 0.05f;
    const struct tkv_gguf_tensor *qkv[3] = {&q, &k, &v}, *gu[2] = {&g, &u};
    static const struct {
        const char *name;
        uint32_t which; /* 0: qkv, 1: gate/up */
        bool swiglu;
    } cases[] = {{"qkv 6144x4096 group", 0, false}, {"gate+up 2x14336x4096 group", 1, false},
                 {"gate+up 2x14336x4096 swiglu", 1, true}};
    printf("\n%s weights: fused decode ops vs separate launches (device busy = the ops' own time; span = first start to last "
           "end, launch gaps included; host = wall per group, back to back)\n\n",
           type == TKV_TYPE_F16 ? "f16" : "Q4_0 (quantized GEMV)");
    printf("| group | MB | separate busy us | span us | host us | fused busy us | span us | host us | span "
           "speed-up | fused GB/s (span) | rel diff |\n");
    printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const struct tkv_gguf_tensor *const *t = cases[c].which ? gu : qkv;
        const uint32_t nw = cases[c].which ? 2 : 3;
        size_t bytes = 0;
        for (uint32_t i = 0; i < nw; i++)
            bytes += t[i]->nbytes;
        const uint32_t copies = n_copies(bytes);
        struct group_result sep, fus;
        time_group(be, t, nw, cases[c].swiglu, false, copies, x, n, reps, &sep);
        time_group(be, t, nw, cases[c].swiglu, true, copies, x, n, reps, &fus);
        const double diff = rel_diff(fus.y, sep.y, (size_t)n * (size_t)t[0]->ne[1]);
        printf("| %s | %.1f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.0f | %.1e |\n", cases[c].name,
               bytes / 1e6, sep.busy_us, sep.span_us, sep.host_us, fus.busy_us, fus.span_us, fus.host_us,
               sep.span_us / fus.span_us, bytes / 1e9 / (fus.span_us * 1e-6), diff);
        fflush(stdout);
        if (json)
            fprintf(json,
                    "{\"bench\": \"gemv-group\", \"type\": \"%s\", \"group\": \"%s\", \"n\": %u, \"bytes\": %zu, \"reps\": %d, "
                    "\"sep_busy_us\": %.3f, \"sep_span_us\": %.3f, \"sep_host_us\": %.3f, \"fused_busy_us\": %.3f, "
                    "\"fused_span_us\": %.3f, \"fused_host_us\": %.3f, \"rel_diff\": %.3e, \"commit\": \"%s\"}\n",
                    tkv_type_name(type), cases[c].name, n, bytes, reps, sep.busy_us, sep.span_us, sep.host_us, fus.busy_us, fus.span_us,
                    fus.host_us, diff, commit);
        free(sep.y), free(fus.y);
    }
    free((void *)q.data), free((void *)k.data), free((void *)v.data), free((void *)g.data), free((void *)u.data);
    free(x);
}

/* ---- the GEMV tables: Llama-3-8B's matrices, one row each ---------------------------- */

/* n_out x n_in: wq/wo, wk/wv, gate/up, down, the output matrix */
static const uint32_t shapes[][2] = {{4096, 4096}, {1024, 4096}, {14336, 4096}, {4096, 14336}, {128256, 4096}};
static const uint32_t per_layer[] = {2, 2, 2, 1, 0}; /* how many a Llama-3-8B layer has */
#define N_SHAPES (sizeof shapes / sizeof shapes[0])
#define MAX_TABLE_BE 4

/* One shape of a table, as measured. */
struct gemv_row {
    uint32_t n_out, n_in;
    size_t bytes;                     /* the weight as stored (f16, or blocks) */
    uint32_t copies;                  /* of it, cycled through on be[0]        */
    double gb;                        /* bytes / 1e9                           */
    double copy_us, copy_gbps;        /* a device copy of bytes: read + written */
    struct result r[MAX_TABLE_BE];    /* the matmul on each be[i]              */
};

/* A GEMV table: its columns' backends, what it measures with, how it prints a row. */
struct gemv_table {
    uint32_t type;                          /* the weights' type              */
    struct tkv_backend *be[MAX_TABLE_BE];   /* columns (run_gemv_table)       */
    int n_be;
    uint32_t n;                             /* tokens                         */
    int reps;
    FILE *json;                             /* JSON lines, or NULL            */
    const char *commit;
    void (*print_row)(const struct gemv_table *tb, const struct gemv_row *row);
    double layer[MAX_TABLE_BE + 1];         /* out: a layer's 7 matmuls, us:
                                               on be[i]; [n_be] at the copy rate */
};

/* For each shape: random weights of tb->type and activations x [n][n_in]
 * (make_weight), the matmul timed on each backend in order -- be[0] keeps
 * the weight as stored, the others as f16 (f16 weights; or a backend that
 * dequantizes at load), each cycling over copies of what it keeps that
 * together exceed the L2 -- then a device copy of the stored bytes on
 * be[0]; print_row as each shape is done, and the layer totals. */
static void run_gemv_table(struct gemv_table *tb)
{
    const uint32_t n = tb->n;
    for (int i = 0; i <= tb->n_be; i++)
        tb->layer[i] = 0;
    for (size_t si = 0; si < N_SHAPES; si++) {
        struct gemv_row w = {.n_out = shapes[si][0], .n_in = shapes[si][1]};
        struct tkv_gguf_tensor t;
        char name[32];
        snprintf(name, sizeof name, "%ux%u", w.n_out, w.n_in);
        make_weight(&t, tb->type, w.n_out, w.n_in, name);
        w.bytes = t.nbytes;
        w.copies = n_copies(w.bytes);
        const uint32_t copies16 = n_copies((size_t)w.n_out * w.n_in * 2);
        float *x = malloc((size_t)n * w.n_in * sizeof *x);
        if (!x) {
            fprintf(stderr, "bench-gemv: out of host memory\n");
            exit(1);
        }
        for (size_t i = 0; i < (size_t)n * w.n_in; i++)
            x[i] = (float)((rnd() >> 40) / 16777216.0 * 2.0 - 1.0);
        for (int b = 0; b < tb->n_be; b++)
            time_matmul(tb->be[b], &t, b == 0 ? w.copies : copies16, x, n, tb->reps, &w.r[b]);
        w.copy_us = time_copy(tb->be[0], w.bytes, w.copies, tb->reps) * 1e6;
        w.gb = w.bytes / 1e9;
        w.copy_gbps = 2 * w.gb / (w.copy_us * 1e-6);
        tb->print_row(tb, &w);
        fflush(stdout);
        for (int b = 0; b < tb->n_be; b++)
            tb->layer[b] += per_layer[si] * w.r[b].us;
        tb->layer[tb->n_be] += per_layer[si] * w.bytes / (w.copy_gbps * 1e9) * 1e6;
        for (int b = 0; b < tb->n_be; b++)
            free(w.r[b].y);
        free(x);
        free((void *)t.data);
    }
}

/* f16 weights: be = the fast GEMV (default), u8, the reference kernel, cuBLAS. */
static void print_f16_row(const struct gemv_table *tb, const struct gemv_row *w)
{
    const struct result *rf = &w->r[0], *r8 = &w->r[1], *rr = &w->r[2], *rb = &w->r[3];
    const double gb = w->gb, copy = w->copy_gbps, ours = gb / (rf->us * 1e-6);
    const double diff = rel_diff(rf->y, rb->y, (size_t)tb->n * w->n_out);
    const double d8 = rel_diff(r8->y, rb->y, (size_t)tb->n * w->n_out);
    printf("| %ux%u | %.1f | %.2f | %.0f | %.2f | %.2f | %.2f | %.2f | %.0f | %.2f | %.0f | %.2f | %.0f | %.2f | "
           "%.1e |\n",
           w->n_out, w->n_in, w->bytes / 1e6, rf->us, ours, ours / copy, r8->us, gb / (r8->us * 1e-6) / copy, rr->us,
           gb / (rr->us * 1e-6), rb->us, gb / (rb->us * 1e-6), w->copy_us, copy, rf->host_us, fmax(diff, d8));
    if (tb->json)
        fprintf(tb->json,
                "{\"bench\": \"gemv\", \"n_out\": %u, \"n_in\": %u, \"n\": %u, \"bytes\": %zu, \"copies\": %u, "
                "\"reps\": %d, \"ours_us\": %.3f, \"ours_gbps\": %.1f, \"of_copy\": %.4f, \"u8_us\": %.3f, "
                "\"ref_us\": %.3f, "
                "\"cublas_us\": %.3f, \"copy_us\": %.3f, \"copy_gbps\": %.1f, \"ours_host_us\": %.3f, "
                "\"ours_vs_cublas\": %.3e, \"commit\": \"%s\"}\n",
                w->n_out, w->n_in, tb->n, w->bytes, w->copies, tb->reps, rf->us, ours, ours / copy, r8->us, rr->us,
                rb->us, w->copy_us, copy, rf->host_us, diff, tb->commit);
}

/* The f16 decode GEMV on Llama-3-8B's shapes against its reference kernel,
 * the 8-load variant, cuBLAS and a copy of the same bytes. */
static void bench_f16(struct tkv_backend *fast, struct tkv_backend *u8, struct tkv_backend *ref,
                      struct tkv_backend *blas, uint32_t n, int reps, FILE *json, const char *commit)
{
    struct gemv_table tb = {.type = TKV_TYPE_F16, .be = {fast, u8, ref, blas}, .n_be = 4, .n = n, .reps = reps,
                            .json = json, .commit = commit, .print_row = print_f16_row};
    printf("bench-gemv: f16 weights, n = %u token%s, %d calls per case (device times from the op profile), "
           "commit %s\n\n",
           n, n > 1 ? "s" : "", reps, commit);
    printf("| n_out x n_in | MB | ours us | ours GB/s | of copy | u8 us | u8 of copy | ref us | ref GB/s | cuBLAS us | "
           "cuBLAS GB/s | copy us | copy GB/s | ours host us/call | ours, u8 vs cuBLAS (max) |\n");
    printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    run_gemv_table(&tb);
    printf("\na Llama-3-8B layer's 7 matmuls: ours %.1f us, u8 %.1f us, reference %.1f us, at the copy rate %.1f us "
           "(ours / copy %.2f)\n",
           tb.layer[0], tb.layer[1], tb.layer[2], tb.layer[4], tb.layer[4] / tb.layer[0]);
}

/* Quantized weights: be = the quantized GEMV (default backend), the f16 GEMV
 * of the same matrix (a TKV_CUDA_GEMV_QUANT=0 backend, dequantized at load). */
static void print_quant_row(const struct gemv_table *tb, const struct gemv_row *w)
{
    const struct result *rq = &w->r[0], *rf = &w->r[1];
    const double copy = w->copy_gbps, rate = w->gb / (rq->us * 1e-6);
    const double diff = rel_diff(rq->y, rf->y, (size_t)tb->n * w->n_out);
    printf("| %ux%u | %.1f | %.2f | %.0f | %.2f | %.2f | %.0f | %.2f | %.2f | %.2f | %.1e |\n", w->n_out, w->n_in,
           w->bytes / 1e6, rq->us, rate, rate / copy, w->copy_us, copy, rf->us, rf->us / rq->us, rq->host_us, diff);
    if (tb->json)
        fprintf(tb->json,
                "{\"bench\": \"gemv-quant\", \"type\": \"%s\", \"n_out\": %u, \"n_in\": %u, \"n\": %u, "
                "\"bytes\": %zu, \"copies\": %u, \"reps\": %d, \"qgemv_us\": %.3f, \"qgemv_gbps\": %.1f, "
                "\"of_copy\": %.4f, \"copy_us\": %.3f, \"copy_gbps\": %.1f, \"f16_us\": %.3f, "
                "\"qgemv_host_us\": %.3f, \"qgemv_vs_f16\": %.3e, \"commit\": \"%s\"}\n",
                tkv_type_name(tb->type), w->n_out, w->n_in, tb->n, w->bytes, w->copies, tb->reps, rq->us, rate,
                rate / copy, w->copy_us, copy, rf->us, rq->host_us, diff, tb->commit);
}

/* The quantized decode GEMV on Llama-3-8B's shapes: q (default backend)
 * against a copy of the quantized bytes and the f16 GEMV (f16: a
 * TKV_CUDA_GEMV_QUANT=0 backend, the same matrix dequantized at load). */
static void bench_quant(struct tkv_backend *q, struct tkv_backend *f16, uint32_t type, uint32_t n, int reps,
                        FILE *json, const char *commit)
{
    struct gemv_table tb = {.type = type, .be = {q, f16}, .n_be = 2, .n = n, .reps = reps, .json = json,
                            .commit = commit, .print_row = print_quant_row};
    printf("\n%s weights, quantized GEMV (activation quantization included), n = %u\n\n", tkv_type_name(type), n);
    printf("| n_out x n_in | MB | qgemv us | GB/s | of copy | copy us | copy GB/s | f16 GEMV us | f16 / qgemv | "
           "qgemv host us/call | qgemv vs f16 (rel) |\n");
    printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    run_gemv_table(&tb);
    printf("\na Llama-3-8B layer's 7 matmuls in %s: quantized GEMV %.1f us, at the copy rate %.1f us (copy / qgemv "
           "%.2f), f16 GEMV %.1f us\n",
           tkv_type_name(type), tb.layer[0], tb.layer[2], tb.layer[2] / tb.layer[0], tb.layer[1]);
}

int main(int argc, char **argv)
{
    int reps = 200;
    uint32_t n = 1;
    const char *json_path = NULL, *qmode = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-r") && i + 1 < argc)
            reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "-n") && i + 1 < argc)
            n = (uint32_t)atoi(argv[++i]);
        else if (!strcmp(argv[i], "-j") && i + 1 < argc)
            json_path = argv[++i];
        else if (!strcmp(argv[i], "-q") && i + 1 < argc &&
                 (!strcmp(argv[i + 1], "auto") || !strcmp(argv[i + 1], "pair") || !strcmp(argv[i + 1], "single")))
            qmode = argv[++i];
        else {
            fprintf(stderr, "usage: bench-gemv [-r reps] [-n tokens (1..8)] [-q auto|pair|single] [-j out.jsonl]\n");
            return 2;
        }
    }
    if (reps < 1 || n < 1 || n > 8) {
        fprintf(stderr, "bench-gemv: -r >= 1, -n in 1..8\n");
        return 2;
    }
    if (tkv_backend_cuda_devices() == 0) {
        fprintf(stderr, "bench-gemv: no CUDA device\n");
        return 77;
    }
    FILE *json = json_path ? fopen(json_path, "w") : NULL;
    if (json_path && !json) {
        fprintf(stderr, "bench-gemv: cannot write %s\n", json_path);
        return 1;
    }
    struct tkv_backend *fast = make_backend(NULL), *ref = make_backend("ref"), *blas = make_backend("cublas");
    struct tkv_backend *u8 = make_backend("u8");
    char commit[64];
    build_commit(commit, sizeof commit);

    bench_f16(fast, u8, ref, blas, n, reps, json, commit);
    bench_groups(fast, TKV_TYPE_F16, n, reps, json, commit);
    struct tkv_backend *f16q = make_backend_q(NULL, "0"), *quant = make_backend_q(NULL, qmode);
    printf("\nquantized tables: TKV_CUDA_GEMV_QUANT=%s\n", qmode ? qmode : "auto (default)");
    static const uint32_t qtypes[] = {TKV_TYPE_Q4_0, TKV_TYPE_Q8_0, TKV_TYPE_Q4_1};
    for (size_t i = 0; i < sizeof qtypes / sizeof qtypes[0]; i++)
        bench_quant(quant, f16q, qtypes[i], n, reps, json, commit);
    bench_groups(quant, TKV_TYPE_Q4_0, n, reps, json, commit);
    f16q->ops->free(f16q);
    quant->ops->free(quant);
    printf("of copy = (weight bytes / GEMV time) / ((read + written bytes) / copy time); host us/call: wall time per "
           "call of back-to-back calls (launch-bound when above the device time)\n");
    /* the profiles were read and reset: nothing left to print at free */
    fast->ops->free(fast);
    ref->ops->free(ref);
    blas->ops->free(blas);
    u8->ops->free(u8);
    if (json)
        fclose(json);
    return 0;
}
