/*
 * bench-gemv.c -- the CUDA backend's decode matmul (f16 weights, few tokens)
 * against its reference kernel, cuBLAS and a device-to-device copy of the
 * same bytes, for the Llama-3-8B shapes (docs/gpu.md, "GEMV").
 *
 *   bench-gemv [-r reps] [-n tokens] [-j out.jsonl]
 *
 * Three CUDA backends, all through the backend interface: the default one
 * (the fast GEMV), TKV_CUDA_GEMV=ref (the reference kernel) and
 * TKV_CUDA_GEMV=cublas (cublasGemmEx, f16 x f16 -> f32, f32 compute: the
 * prefill path), each created with TKV_CUDA_PROFILE=1. Times per call are
 * device times from the op profile's events, not host clocks: a 1024x4096
 * GEMV takes ~2 us, about what queuing a launch costs, so host clocks would
 * measure the launch rate. The weights are cycled through copies larger
 * than the L2 together (512 MiB); the copy moves the same bytes between
 * buffers as large. Rates: GEMV = weight bytes / time; copy = bytes read +
 * written / time (bench-decode's roofline bandwidth); "of copy" = their
 * ratio (target >= 0.9). Exits 77 without a GPU.
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

static struct tkv_backend *make_backend(const char *gemv)
{
    struct tkv_backend *be;
    setenv("TKV_CUDA_PROFILE", "1", 1);
    if (gemv)
        setenv("TKV_CUDA_GEMV", gemv, 1);
    die_if(tkv_backend_create("cuda", 0, &be), "backend");
    unsetenv("TKV_CUDA_GEMV");
    unsetenv("TKV_CUDA_PROFILE");
    if (!be->ops->profile_read) {
        fprintf(stderr, "bench-gemv: the CUDA backend keeps no op profile\n");
        exit(1);
    }
    return be;
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

static double rel_diff(const float *a, const float *b, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        den += (double)b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

int main(int argc, char **argv)
{
    int reps = 200;
    uint32_t n = 1;
    const char *json_path = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-r") && i + 1 < argc)
            reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "-n") && i + 1 < argc)
            n = (uint32_t)atoi(argv[++i]);
        else if (!strcmp(argv[i], "-j") && i + 1 < argc)
            json_path = argv[++i];
        else {
            fprintf(stderr, "usage: bench-gemv [-r reps] [-n tokens (1..8)] [-j out.jsonl]\n");
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
    char commit[64];
    build_commit(commit, sizeof commit);

    /* n_out x n_in: wq/wo, wk/wv, gate/up, down, the output matrix */
    static const uint32_t shapes[][2] = {{4096, 4096}, {1024, 4096}, {14336, 4096}, {4096, 14336}, {128256, 4096}};
    static const uint32_t per_layer[] = {2, 2, 2, 1, 0}; /* how many a Llama-3-8B layer has */
    const size_t n_shapes = sizeof shapes / sizeof shapes[0];
    printf("bench-gemv: f16 weights, n = %u token%s, %d calls per case (device times from the op profile), "
           "commit %s\n\n",
           n, n > 1 ? "s" : "", reps, commit);
    printf("| n_out x n_in | MB | ours us | ours GB/s | of copy | ref us | ref GB/s | cuBLAS us | cuBLAS GB/s | copy us "
           "| copy GB/s | ours host us/call | ours vs cuBLAS |\n");
    printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    double layer_ours = 0, layer_copy = 0, layer_ref = 0;
    for (size_t si = 0; si < n_shapes; si++) {
        const uint32_t n_out = shapes[si][0], n_in = shapes[si][1];
        const size_t bytes = (size_t)n_out * n_in * 2;
        uint32_t copies = (uint32_t)((ROTATE_BYTES + bytes - 1) / bytes);
        copies = copies < 1 ? 1 : copies > MAX_COPIES ? MAX_COPIES : copies;
        /* random f16 weights in [-1, 1): 1M random values tiled */
        uint16_t *h = malloc(bytes);
        float *x = malloc((size_t)n * n_in * sizeof *x);
        if (!h || !x) {
            fprintf(stderr, "bench-gemv: out of host memory\n");
            return 1;
        }
        const size_t tile = (size_t)1 << 20, elems = bytes / 2;
        for (size_t i = 0; i < elems; i++)
            h[i] = i < tile ? (uint16_t)(0x3000 + (rnd() % 0x0C00)) ^ (uint16_t)((rnd() & 1) << 15) : h[i % tile];
        for (size_t i = 0; i < (size_t)n * n_in; i++)
            x[i] = (float)((rnd() >> 40) / 16777216.0 * 2.0 - 1.0);
        struct tkv_gguf_tensor t;
        memset(&t, 0, sizeof t);
        snprintf(t.name, sizeof t.name, "bench.%ux%u", n_out, n_in);
        t.n_dims = 2;
        t.ne[0] = n_in;
        t.ne[1] = n_out;
        t.ne[2] = t.ne[3] = 1;
        t.type = TKV_TYPE_F16;
        t.n_elems = (uint64_t)n_in * n_out;
        t.nbytes = bytes;
        t.data = h;
        struct result rf, rr, rb;
        time_matmul(fast, &t, copies, x, n, reps, &rf);
        time_matmul(ref, &t, copies, x, n, reps, &rr);
        time_matmul(blas, &t, copies, x, n, reps, &rb);
        const double copy_us = time_copy(fast, bytes, copies, reps) * 1e6;
        const double gb = bytes / 1e9;
        const double ours = gb / (rf.us * 1e-6), copy = 2 * gb / (copy_us * 1e-6);
        const double diff = rel_diff(rf.y, rb.y, (size_t)n * n_out);
        printf("| %ux%u | %.1f | %.2f | %.0f | %.2f | %.2f | %.0f | %.2f | %.0f | %.2f | %.0f | %.2f | %.1e |\n", n_out,
               n_in, bytes / 1e6, rf.us, ours, ours / copy, rr.us, gb / (rr.us * 1e-6), rb.us, gb / (rb.us * 1e-6),
               copy_us, copy, rf.host_us, diff);
        fflush(stdout);
        layer_ours += per_layer[si] * rf.us;
        layer_ref += per_layer[si] * rr.us;
        layer_copy += per_layer[si] * bytes / (copy * 1e9) * 1e6;
        if (json)
            fprintf(json,
                    "{\"bench\": \"gemv\", \"n_out\": %u, \"n_in\": %u, \"n\": %u, \"bytes\": %zu, \"copies\": %u, "
                    "\"reps\": %d, \"ours_us\": %.3f, \"ours_gbps\": %.1f, \"of_copy\": %.4f, \"ref_us\": %.3f, "
                    "\"cublas_us\": %.3f, \"copy_us\": %.3f, \"copy_gbps\": %.1f, \"ours_host_us\": %.3f, "
                    "\"ours_vs_cublas\": %.3e, \"commit\": \"%s\"}\n",
                    n_out, n_in, n, bytes, copies, reps, rf.us, ours, ours / copy, rr.us, rb.us, copy_us, copy,
                    rf.host_us, diff, commit);
        free(rf.y), free(rr.y), free(rb.y);
        free(h), free(x);
    }
    printf("\na Llama-3-8B layer's 7 matmuls: ours %.1f us, reference %.1f us, at the copy rate %.1f us (ours / copy "
           "%.2f)\n",
           layer_ours, layer_ref, layer_copy, layer_copy / layer_ours);
    printf("of copy = (weight bytes / GEMV time) / ((read + written bytes) / copy time); host us/call: wall time per "
           "call of back-to-back calls (launch-bound when above the device time)\n");
    /* the profiles were read and reset: nothing left to print at free */
    fast->ops->free(fast);
    ref->ops->free(ref);
    blas->ops->free(blas);
    if (json)
        fclose(json);
    return 0;
}
