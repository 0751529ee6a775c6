/*
 * test-gpu-backend.c -- Description: every op of the CUDA backend against the
 * CPU backend (and a double-precision reference where the CPU backend itself
 * rounds) on fresh random inputs. Skips (77) when no CUDA device is usable.
 *
 * Tolerances (why in docs/gpu.md):
 *   matmul     ||gpu - ref|| / ||ref|| < 1e-3 (n <= 8: f16 weights, f32
 *              activations; each GEMV kernel: fast, ref, u8) or 2e-3 (cuBLAS:
 *              f16 weights and activations); TKV_CUDA_GEMV=auto bit-identical
 *              to the kernel it picks (8-load for n_in >= 8192, else fast),
 *              ref = double over the exact dequantized weights; and within
 *              2e-2 of the CPU backend (which quantizes decode activations
 *              to 8 bits)
 *   get_rows   |gpu - cpu| <= 2^-11 |cpu| + 2^-25 (f16 storage of the row)
 *   rmsnorm    max |gpu - cpu| <= 1e-5 max |cpu|
 *   rope       max |gpu - cpu| <= 1e-5 (angles equal; cos/sin within ulps)
 *   swiglu     |gpu - cpu| <= 1e-6 max(1, |cpu|);  add: equal
 *   kv_write   bit-identical f16 (kv_write_heads: bit-identical to kv_write per head)
 *   fused      against the plain op sequence on the GPU: matmul_group rel
 *              ||.|| < 1e-5 of the matmuls (and < 1e-3 of double);
 *              matmul_swiglu |.| <= 1e-5 max(1, |seq|) and rel < 1e-6 (< 2e-3
 *              of double silu(g)*u); add_rmsnorm y equal, h <= 1e-6 max|h|
 *              (<= 1e-5 vs the cpu); rope_qk bit-identical to two ropes
 *   quant      the quantized decode GEMV (Q4_0 / Q4_1 / Q8_0 weights, n <= 8):
 *              its activation blocks byte-identical to tkv_quantize_act_ref;
 *              matmul, matmul_group, matmul_swiglu within the float
 *              reassociation bound 2 (blocks + 8) 2^-24 sum |terms| of the
 *              CPU reference (tkv_quantize_act_ref + tkv_vec_dot_ref)
 *   pdl        a decode step's op chain (5 steps x 4 layers, queued back to
 *              back) on a TKV_CUDA_PDL=1 backend bit-identical to the default
 *              one: x, logits, K/V written, attention output
 *   attention  max |gpu - ref| <= 1e-4 on outputs and lse (ref = double),
 *              and the same against the CPU backend's fast path; for each
 *              of the decode kernel (fused or separate merge), the
 *              tensor-core prefill kernel (split precision, on packed
 *              64-key tiles and walking refs one by one; its f16 mode
 *              within 2e-3) and the general kernel, and between them;
 *              views of many small refs included; every variant (tile
 *              shape) of the tensor-core kernel the same way, in both
 *              precisions and both walks, and against v0
 *   attn_stats against the CPU backend (= the policies' own computation):
 *              segment P |gpu - cpu| <= 1e-5 cpu, entropy <= 1e-6 + 1e-5 H;
 *              window scores |gpu - cpu| <= 1e-5 |cpu|
 * Every GPU output is poisoned with NaN first, so an unwritten element fails.
 */
#include "cpu/cpu.h"
#include "cpu/quant.h"
#include "runtime/backend.h"
#include "runtime/policy/policy.h"
#include "test.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

static uint64_t rng;
static struct tkv_backend *cpu, *gpu;
/* the decode matmul's other paths (TKV_CUDA_GEMV=ref, =cublas): the fast
 * GEMV of `gpu` is checked against both */
static struct tkv_backend *gpu_gemv_ref, *gpu_gemv_blas, *gpu_gemv_u8; /* u8: TKV_CUDA_GEMV=u8 */
static struct tkv_backend *gpu_gemv_auto; /* TKV_CUDA_GEMV=auto: u8 for n_in >= 8192, else the default */
static bool f32_mode; /* gpu was created with TKV_CUDA_WEIGHTS=f32 */

/* ---- device helpers ------------------------------------------------------- */

static void *dev_alloc(size_t bytes)
{
    void *p = NULL;
    tkv_status st = gpu->ops->alloc(gpu, bytes, &p);
    if (st != TKV_OK) {
        fprintf(stderr, "device alloc of %zu bytes: %s\n", bytes, tkv_last_error());
        exit(1);
    }
    return p;
}

/* Uploaded through gpu and waited for: other backends (other streams) may
 * read it next, and an upload from pageable memory can return before its
 * copy has landed. */
static void *dev_from(const void *host, size_t bytes)
{
    void *p = dev_alloc(bytes);
    if (gpu->ops->upload(gpu, p, host, bytes) != TKV_OK || gpu->ops->synchronize(gpu) != TKV_OK) {
        fprintf(stderr, "upload: %s\n", tkv_last_error());
        exit(1);
    }
    return p;
}

/* A device buffer of n floats filled with NaN. */
static float *dev_poisoned(size_t n)
{
    float *h = malloc(n * sizeof *h);
    for (size_t i = 0; i < n; i++)
        h[i] = NAN;
    float *d = dev_from(h, n * sizeof *h);
    free(h);
    return d;
}

static void to_host(void *host, const void *dev, size_t bytes)
{
    if (gpu->ops->download(gpu, host, dev, bytes) != TKV_OK) {
        fprintf(stderr, "download: %s\n", tkv_last_error());
        exit(1);
    }
}

static void dev_free(void *p) { gpu->ops->release(gpu, p); }

/* The buffers above are uploaded and downloaded on gpu's stream; a test that
 * runs ops on another backend (its own stream) orders the two with this:
 * before the ops, from = gpu (its uploads landed); before to_host, from =
 * the other backend (its kernels finished). */
static void settle(struct tkv_backend *from)
{
    if (from->ops->synchronize(from) != TKV_OK) {
        fprintf(stderr, "synchronize: %s\n", tkv_last_error());
        exit(1);
    }
}

static void fill(float *x, size_t n, float lo, float hi)
{
    for (size_t i = 0; i < n; i++)
        x[i] = test_rand_f32(&rng, lo, hi);
}

/* ||a - ref|| / ||ref||; infinite when a holds a NaN. */
static double rel_l2(const float *a, const double *ref, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        if (isnan(a[i]))
            return INFINITY;
        num += (a[i] - ref[i]) * (a[i] - ref[i]);
        den += ref[i] * ref[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

static double rel_l2f(const float *a, const float *b, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        if (isnan(a[i]) || isnan(b[i]))
            return INFINITY;
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        den += (double)b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* ---- weights ---------------------------------------------------------------- */

struct test_weight {
    struct tkv_gguf_tensor t;
    void *data;
    float *deq; /* [n_out][n_in], exact dequantization (cpu/quant-ref.c) */
};

static uint16_t rand_f16(float lo, float hi) { return tkv_fp32_to_fp16(test_rand_f32(&rng, lo, hi)); }

/* Random weights of any supported type: quantized from random floats where
 * tkv_quantize_row can, random valid blocks for the K-quants. */
static void weight_make(struct test_weight *w, uint32_t type, uint32_t n_in, uint32_t n_out, uint32_t n_dims)
{
    const struct tkv_type_traits *tr = tkv_type_traits(type);
    const size_t row = (size_t)n_in / tr->block_elems * tr->block_bytes;
    memset(w, 0, sizeof *w);
    snprintf(w->t.name, sizeof w->t.name, "test.%s.%ux%u", tr->name, n_in, n_out);
    w->t.n_dims = n_dims;
    w->t.ne[0] = n_in;
    w->t.ne[1] = n_out;
    w->t.ne[2] = w->t.ne[3] = 1;
    w->t.type = type;
    w->t.n_elems = (uint64_t)n_in * n_out;
    w->t.nbytes = row * n_out;
    w->data = malloc(row * n_out);
    w->deq = malloc((size_t)n_in * n_out * sizeof(float));
    uint8_t *d = w->data;
    if (type == TKV_TYPE_Q4_K) {
        for (size_t b = 0; b < row * n_out / 144; b++) {
            tkv_block_q4_K *q = (tkv_block_q4_K *)(d + b * 144);
            q->d = rand_f16(0.001f, 0.01f);
            q->dmin = rand_f16(0.0f, 0.01f);
            for (int i = 0; i < 12; i++)
                q->scales[i] = (uint8_t)test_rand_u64(&rng);
            for (int i = 0; i < 128; i++)
                q->qs[i] = (uint8_t)test_rand_u64(&rng);
        }
    } else if (type == TKV_TYPE_Q6_K) {
        for (size_t b = 0; b < row * n_out / 210; b++) {
            tkv_block_q6_K *q = (tkv_block_q6_K *)(d + b * 210);
            for (int i = 0; i < 128; i++)
                q->ql[i] = (uint8_t)test_rand_u64(&rng);
            for (int i = 0; i < 64; i++)
                q->qh[i] = (uint8_t)test_rand_u64(&rng);
            for (int i = 0; i < 16; i++)
                q->scales[i] = (int8_t)(test_rand_u64(&rng) % 129) - 64;
            q->d = rand_f16(0.0005f, 0.002f);
        }
    } else {
        float *x = malloc(n_in * sizeof *x);
        for (uint32_t r = 0; r < n_out; r++) {
            fill(x, n_in, -1, 1);
            if (!tkv_quantize_row(type, x, d + row * r, n_in)) {
                fprintf(stderr, "cannot quantize to %s\n", tr->name);
                exit(1);
            }
        }
        free(x);
    }
    for (uint32_t r = 0; r < n_out; r++)
        tkv_dequant_row_ref(type, d + row * r, w->deq + (size_t)r * n_in, n_in);
    w->t.data = w->data;
}

static void weight_free(struct test_weight *w)
{
    free(w->data);
    free(w->deq);
}

static const uint32_t all_types[] = {TKV_TYPE_F32, TKV_TYPE_F16, TKV_TYPE_BF16, TKV_TYPE_Q4_0,
                                     TKV_TYPE_Q4_1, TKV_TYPE_Q8_0, TKV_TYPE_Q4_K, TKV_TYPE_Q6_K};
#define N_TYPES (sizeof all_types / sizeof all_types[0])

/* ---- matmul ----------------------------------------------------------------- */

static void test_matmul_case(uint32_t type, uint32_t n_in, uint32_t n_out, uint32_t n, uint32_t x_offset)
{
    struct test_weight tw;
    weight_make(&tw, type, n_in, n_out, 2);
    struct tkv_bweight *wc = NULL, *wg = NULL;
    CHECK(cpu->ops->weight_init(cpu, &tw.t, &wc) == TKV_OK, "cpu weight_init: %s", tkv_last_error());
    CHECK(gpu->ops->weight_init(gpu, &tw.t, &wg) == TKV_OK, "gpu weight_init: %s", tkv_last_error());
    if (!wc || !wg) {
        weight_free(&tw);
        return;
    }
    const size_t nx = (size_t)n * n_in, ny = (size_t)n * n_out;
    float *x = malloc((nx + x_offset) * sizeof *x), *yc = malloc(ny * sizeof *yc), *yg = malloc(ny * sizeof *yg);
    double *ref = malloc(ny * sizeof *ref);
    fill(x, nx + x_offset, -1, 1);
    const float *xs = x + x_offset;
    for (uint32_t i = 0; i < n; i++)
        for (uint32_t r = 0; r < n_out; r++) {
            double s = 0;
            for (uint32_t k = 0; k < n_in; k++)
                s += (double)tw.deq[(size_t)r * n_in + k] * xs[(size_t)i * n_in + k];
            ref[(size_t)i * n_out + r] = s;
        }
    CHECK(cpu->ops->matmul(cpu, wc, xs, yc, n) == TKV_OK, "cpu matmul: %s", tkv_last_error());
    float *dx = dev_from(x, (nx + x_offset) * sizeof *x), *dy = dev_poisoned(ny);
    CHECK(gpu->ops->matmul(gpu, wg, dx + x_offset, dy, n) == TKV_OK, "gpu matmul: %s", tkv_last_error());
    to_host(yg, dy, ny * sizeof *yg);
    const double e_gpu = rel_l2(yg, ref, ny), e_cpu = rel_l2(yc, ref, ny), e_gc = rel_l2f(yg, yc, ny);
    const bool gemv = n <= 8 && x_offset % 4 == 0 && n_in % 8 == 0;
    const double tol = f32_mode ? 1e-5 : gemv ? 1e-3 : 2e-3;
    fprintf(stderr, "  matmul%s %-5s %5ux%-5u n=%-3u%s  rel err gpu %.2e cpu %.2e gpu-vs-cpu %.2e", f32_mode ? " (f32 mode)" : "",
            tkv_type_name(type), n_in, n_out, n, x_offset ? " (unaligned x)" : "", e_gpu, e_cpu, e_gc);
    CHECK(e_gpu < tol, "matmul %s %ux%u n=%u: gpu rel err %.3g >= %.1g", tkv_type_name(type), n_in, n_out, n, e_gpu,
          tol);
    CHECK(e_gc < 2e-2, "matmul %s %ux%u n=%u: gpu vs cpu rel diff %.3g", tkv_type_name(type), n_in, n_out, n, e_gc);
    /* a decode GEMV: the same on the reference kernel and on cuBLAS, each
     * within its tolerance of the double reference, and the fast kernel
     * within 1e-3 of both (the three sum in different orders) */
    struct tkv_backend *alt[3] = {gpu_gemv_ref, gpu_gemv_blas, gpu_gemv_u8};
    static const char *const alt_name[3] = {"ref", "cublas", "u8"};
    for (int a = 0; a < 3 && gemv && !f32_mode && alt[a]; a++) {
        struct tkv_bweight *wa = NULL;
        CHECK(alt[a]->ops->weight_init(alt[a], &tw.t, &wa) == TKV_OK, "weight_init: %s", tkv_last_error());
        if (!wa)
            break;
        float *ya = malloc(ny * sizeof *ya), *dya = dev_poisoned(ny);
        CHECK(alt[a]->ops->matmul(alt[a], wa, dx + x_offset, dya, n) == TKV_OK, "gpu matmul (%s): %s", alt_name[a],
              tkv_last_error());
        CHECK(alt[a]->ops->synchronize(alt[a]) == TKV_OK, "%s", tkv_last_error());
        to_host(ya, dya, ny * sizeof *ya);
        const double e_a = rel_l2(ya, ref, ny), e_fa = rel_l2f(yg, ya, ny);
        fprintf(stderr, "  %s %.2e fast-vs-%s %.2e", alt_name[a], e_a, alt_name[a], e_fa);
        CHECK(e_a < (a == 1 ? 2e-3 : 1e-3), "matmul %ux%u n=%u (%s): rel err %.3g", n_in, n_out, n, alt_name[a], e_a);
        CHECK(e_fa < 1e-3, "matmul %ux%u n=%u: fast GEMV vs %s rel diff %.3g", n_in, n_out, n, alt_name[a], e_fa);
        dev_free(dya);
        free(ya);
        alt[a]->ops->weight_free(alt[a], wa);
    }
    /* TKV_CUDA_GEMV=auto picks one of two kernels by shape: the same bits
     * as the 8-load kernel for rows of >= 8192 columns, else as the default */
    struct tkv_bweight *w_auto = NULL, *w_u8 = NULL;
    if (gemv && !f32_mode && gpu_gemv_auto &&
        gpu_gemv_auto->ops->weight_init(gpu_gemv_auto, &tw.t, &w_auto) == TKV_OK &&
        gpu_gemv_u8->ops->weight_init(gpu_gemv_u8, &tw.t, &w_u8) == TKV_OK) {
        const bool long_rows = n_in >= 8192;
        float *y_auto = malloc(ny * sizeof *y_auto), *y_want = malloc(ny * sizeof *y_want);
        float *d_auto = dev_poisoned(ny), *d_u8 = dev_poisoned(ny);
        CHECK(gpu_gemv_auto->ops->matmul(gpu_gemv_auto, w_auto, dx + x_offset, d_auto, n) == TKV_OK, "%s",
              tkv_last_error());
        CHECK(gpu_gemv_u8->ops->matmul(gpu_gemv_u8, w_u8, dx + x_offset, d_u8, n) == TKV_OK, "%s", tkv_last_error());
        CHECK(gpu_gemv_auto->ops->synchronize(gpu_gemv_auto) == TKV_OK &&
                  gpu_gemv_u8->ops->synchronize(gpu_gemv_u8) == TKV_OK, "%s", tkv_last_error());
        to_host(y_auto, d_auto, ny * sizeof *y_auto);
        if (long_rows)
            to_host(y_want, d_u8, ny * sizeof *y_want);
        else
            memcpy(y_want, yg, ny * sizeof *y_want);
        const bool same = !memcmp(y_auto, y_want, ny * sizeof *y_auto);
        fprintf(stderr, " auto %s %s", same ? "==" : "!=", long_rows ? "u8" : "fast");
        CHECK(same, "matmul %ux%u n=%u: TKV_CUDA_GEMV=auto differs from the %s kernel", n_in, n_out, n,
              long_rows ? "8-load" : "default");
        dev_free(d_auto), dev_free(d_u8);
        free(y_auto), free(y_want);
    }
    if (w_auto)
        gpu_gemv_auto->ops->weight_free(gpu_gemv_auto, w_auto);
    if (w_u8)
        gpu_gemv_u8->ops->weight_free(gpu_gemv_u8, w_u8);
    fprintf(stderr, "\n");
    dev_free(dx);
    dev_free(dy);
    cpu->ops->weight_free(cpu, wc);
    gpu->ops->weight_free(gpu, wg);
    free(x), free(yc), free(yg), free(ref);
    weight_free(&tw);
}

static void test_matmul(void)
{
    fprintf(stderr, "matmul:\n");
    const uint32_t ns[] = {1, 3, 8, 9, 64, 300};
    for (size_t t = 0; t < N_TYPES; t++) {
        const uint32_t type = all_types[t];
        const bool kq = type == TKV_TYPE_Q4_K || type == TKV_TYPE_Q6_K;
        const uint32_t n_in = kq ? 768 : 576, n_out = type == TKV_TYPE_Q8_0 ? 1537 : 384;
        for (size_t i = 0; i < sizeof ns / sizeof ns[0]; i++)
            test_matmul_case(type, n_in, n_out, ns[i], 0);
    }
    test_matmul_case(TKV_TYPE_Q4_1, 576, 200, 2, 1);  /* unaligned activations: cuBLAS path */
    test_matmul_case(TKV_TYPE_F32, 100, 70, 1, 0);    /* n_in % 8 != 0: cuBLAS path        */
    test_matmul_case(TKV_TYPE_F16, 2048, 5000, 1, 0); /* a wide decode GEMV                */
    /* the fast GEMV's row splits (1 to 8 warps per row, tkv_cuda_gemv_split)
     * on Llama-3-8B's shapes (n_in x n_out) and on rows of 8-element chunks
     * that its unrolled loads do not divide */
    for (uint32_t n = 1; n <= 8; n++) {
        test_matmul_case(TKV_TYPE_F16, 4096, 1024, n, 0); /* wk, wv            */
        test_matmul_case(TKV_TYPE_F16, 4104, 1001, n, 0); /* n_in % 256 != 0   */
    }
    const uint32_t ns_big[] = {1, 3, 8};
    for (size_t i = 0; i < 3; i++) {
        test_matmul_case(TKV_TYPE_F16, 4096, 4096, ns_big[i], 0);  /* wq, wo       */
        test_matmul_case(TKV_TYPE_F16, 14336, 4096, ns_big[i], 0); /* down         */
        test_matmul_case(TKV_TYPE_F16, 8200, 100, ns_big[i], 0);   /* 8 warps/row  */
    }
    test_matmul_case(TKV_TYPE_F16, 4096, 14336, 1, 0);              /* gate, up     */
    test_matmul_case(TKV_TYPE_Q4_0, 4096, 1024, 2, 0);              /* dequantized  */
    test_matmul_case(TKV_TYPE_F16, 72, 33, 5, 0);                   /* short rows   */
}

/* ---- get_rows, weights ----------------------------------------------------------- */

static void test_get_rows(void)
{
    fprintf(stderr, "get_rows:\n");
    for (size_t t = 0; t < N_TYPES; t++) {
        const uint32_t type = all_types[t];
        const uint32_t n_in = 512, n_out = 100, n = 37;
        struct test_weight tw;
        weight_make(&tw, type, n_in, n_out, 2);
        struct tkv_bweight *wc = NULL, *wg = NULL;
        CHECK(cpu->ops->weight_init(cpu, &tw.t, &wc) == TKV_OK, "cpu weight_init: %s", tkv_last_error());
        CHECK(gpu->ops->weight_init(gpu, &tw.t, &wg) == TKV_OK, "gpu weight_init: %s", tkv_last_error());
        if (!wc || !wg) {
            weight_free(&tw);
            continue;
        }
        int32_t ids[37];
        for (uint32_t i = 0; i < n; i++)
            ids[i] = (int32_t)(test_rand_u64(&rng) % n_out);
        ids[0] = 0;
        ids[1] = (int32_t)n_out - 1;
        float *oc = malloc((size_t)n * n_in * sizeof *oc), *og = malloc((size_t)n * n_in * sizeof *og);
        float *d = dev_poisoned((size_t)n * n_in);
        CHECK(cpu->ops->get_rows(cpu, wc, ids, n, oc) == TKV_OK, "cpu get_rows: %s", tkv_last_error());
        CHECK(gpu->ops->get_rows(gpu, wg, ids, n, d) == TKV_OK, "gpu get_rows: %s", tkv_last_error());
        to_host(og, d, (size_t)n * n_in * sizeof *og);
        size_t bad = 0;
        double worst = 0;
        for (size_t i = 0; i < (size_t)n * n_in; i++) {
            const double diff = fabs((double)og[i] - oc[i]), lim = ldexp(fabs(oc[i]), -11) + ldexp(1.0, -25);
            if (!(diff <= lim))
                bad++;
            worst = fmax(worst, diff / lim);
        }
        fprintf(stderr, "  get_rows %-5s worst |gpu-cpu| / bound %.3f\n", tkv_type_name(type), worst);
        CHECK(bad == 0, "get_rows %s: %zu elements beyond f16 rounding", tkv_type_name(type), bad);
        /* ids out of range fail in both, naming the tensor */
        int32_t badid[2] = {3, (int32_t)n_out};
        CHECK(cpu->ops->get_rows(cpu, wc, badid, 2, oc) == TKV_ERR_INVALID_ARG, "cpu accepted a bad id");
        CHECK(gpu->ops->get_rows(gpu, wg, badid, 2, d) == TKV_ERR_INVALID_ARG, "gpu accepted a bad id");
        dev_free(d);
        free(oc), free(og);
        cpu->ops->weight_free(cpu, wc);
        gpu->ops->weight_free(gpu, wg);
        weight_free(&tw);
    }
    /* a type the backend cannot run is refused, not crashed on */
    struct tkv_gguf_tensor bad = {.name = "test.q8_1", .n_dims = 2, .ne = {32, 4, 1, 1}, .type = TKV_TYPE_Q8_1,
                                  .n_elems = 128, .nbytes = 4 * 36};
    static uint8_t zeros[4 * 36];
    bad.data = zeros;
    struct tkv_bweight *w = NULL;
    CHECK(gpu->ops->weight_init(gpu, &bad, &w) == TKV_ERR_UNSUPPORTED && !w, "Q8_1 weights accepted");
}

/* ---- element-wise ops ----------------------------------------------------------------- */

static void test_rmsnorm(void)
{
    const uint32_t dims[] = {576, 1000, 4096}, n = 7;
    for (size_t k = 0; k < 3; k++) {
        const uint32_t dim = dims[k];
        struct test_weight tw;
        float *g = malloc(dim * sizeof *g);
        fill(g, dim, 0.5f, 1.5f);
        memset(&tw, 0, sizeof tw);
        snprintf(tw.t.name, sizeof tw.t.name, "test.norm.%u", dim);
        tw.t.n_dims = 1;
        tw.t.ne[0] = dim;
        tw.t.ne[1] = tw.t.ne[2] = tw.t.ne[3] = 1;
        tw.t.type = TKV_TYPE_F32;
        tw.t.n_elems = dim;
        tw.t.nbytes = dim * sizeof(float);
        tw.t.data = g;
        struct tkv_bweight *wc = NULL, *wg = NULL;
        CHECK(cpu->ops->weight_init(cpu, &tw.t, &wc) == TKV_OK, "%s", tkv_last_error());
        CHECK(gpu->ops->weight_init(gpu, &tw.t, &wg) == TKV_OK, "%s", tkv_last_error());
        float *x = malloc((size_t)n * dim * sizeof *x), *yc = malloc((size_t)n * dim * sizeof *yc);
        float *yg = malloc((size_t)n * dim * sizeof *yg);
        fill(x, (size_t)n * dim, -3, 3);
        CHECK(cpu->ops->rmsnorm(cpu, x, wc, yc, n, dim, 1e-5f) == TKV_OK, "%s", tkv_last_error());
        /* in place on the GPU (y aliases x), as the engine may use it */
        float *d = dev_from(x, (size_t)n * dim * sizeof *x);
        CHECK(gpu->ops->rmsnorm(gpu, d, wg, d, n, dim, 1e-5f) == TKV_OK, "%s", tkv_last_error());
        to_host(yg, d, (size_t)n * dim * sizeof *yg);
        double err = 0, mx = 0;
        for (size_t i = 0; i < (size_t)n * dim; i++) {
            err = isnan(yg[i]) ? INFINITY : fmax(err, fabs(yg[i] - yc[i]));
            mx = fmax(mx, fabs(yc[i]));
        }
        fprintf(stderr, "rmsnorm dim=%u: max |gpu-cpu| %.2e (max |y| %.2f)\n", dim, err, mx);
        CHECK(err <= 1e-5 * mx, "rmsnorm dim %u: err %.3g", dim, err);
        /* a matrix is not a norm weight */
        CHECK(gpu->ops->rmsnorm(gpu, d, wg, d, n, dim + 1, 1e-5f) == TKV_ERR_INVALID_ARG, "bad dim accepted");
        dev_free(d);
        cpu->ops->weight_free(cpu, wc);
        gpu->ops->weight_free(gpu, wg);
        free(x), free(yc), free(yg), free(g);
    }
}

static void test_rope(void)
{
    struct {
        uint32_t n, heads, hd, rot;
        float base, fs;
        int32_t max_pos;
    } cases[] = {
        {37, 9, 64, 64, 10000.0f, 1.0f, 8192},
        {300, 3, 64, 64, 100000.0f, 1.0f, 200000},
        {5, 8, 128, 64, 500000.0f, 0.25f, 1 << 20},
        {1, 32, 128, 128, 10000.0f, 1.0f, 131072},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        const size_t cnt = (size_t)cases[k].n * cases[k].heads * cases[k].hd;
        float *x = malloc(cnt * sizeof *x), *yg = malloc(cnt * sizeof *yg);
        int32_t *pos = malloc(cases[k].n * sizeof *pos);
        fill(x, cnt, -1, 1);
        int32_t p = (int32_t)(test_rand_u64(&rng) % (uint64_t)cases[k].max_pos);
        for (uint32_t t = 0; t < cases[k].n; t++)
            pos[t] = p + (int32_t)t;
        float *d = dev_from(x, cnt * sizeof *x);
        CHECK(gpu->ops->rope(gpu, d, cases[k].n, cases[k].heads, cases[k].hd, cases[k].rot, pos, cases[k].base,
                             cases[k].fs) == TKV_OK,
              "%s", tkv_last_error());
        CHECK(cpu->ops->rope(cpu, x, cases[k].n, cases[k].heads, cases[k].hd, cases[k].rot, pos, cases[k].base,
                             cases[k].fs) == TKV_OK,
              "%s", tkv_last_error());
        to_host(yg, d, cnt * sizeof *yg);
        double err = 0;
        for (size_t i = 0; i < cnt; i++)
            err = isnan(yg[i]) ? INFINITY : fmax(err, fabs(yg[i] - x[i]));
        fprintf(stderr, "rope n=%u heads=%u hd=%u rot=%u pos %d..: max |gpu-cpu| %.2e\n", cases[k].n, cases[k].heads,
                cases[k].hd, cases[k].rot, p, err);
        CHECK(err <= 1e-5, "rope case %zu: err %.3g", k, err);
        dev_free(d);
        free(x), free(yg), free(pos);
    }
    CHECK(gpu->ops->rope(gpu, NULL, 1, 1, 64, 65, (int32_t[]){0}, 1e4f, 1.0f) == TKV_ERR_INVALID_ARG,
          "odd rope dimension accepted");
}

static void test_swiglu_add(void)
{
    const size_t n = 100003;
    float *g = malloc(n * sizeof *g), *u = malloc(n * sizeof *u), *oc = malloc(n * sizeof *oc);
    float *og = malloc(n * sizeof *og);
    fill(g, n, -12, 12);
    fill(u, n, -3, 3);
    CHECK(cpu->ops->swiglu(cpu, g, u, oc, n) == TKV_OK, "%s", tkv_last_error());
    float *dg = dev_from(g, n * sizeof *g), *du = dev_from(u, n * sizeof *u);
    CHECK(gpu->ops->swiglu(gpu, dg, du, dg, n) == TKV_OK, "%s", tkv_last_error()); /* out aliases gate */
    to_host(og, dg, n * sizeof *og);
    size_t bad = 0;
    for (size_t i = 0; i < n; i++)
        bad += !(fabs(og[i] - oc[i]) <= 1e-6 * fmax(1.0, fabs(oc[i])));
    fprintf(stderr, "swiglu: %zu of %zu beyond 1e-6\n", bad, n);
    CHECK(bad == 0, "swiglu: %zu elements differ", bad);

    /* add: y += x, exactly (y = the swiglu output, x = up) */
    float *dy = dev_from(oc, n * sizeof *oc);
    CHECK(cpu->ops->add(cpu, oc, u, n) == TKV_OK, "%s", tkv_last_error());
    CHECK(gpu->ops->add(gpu, dy, du, n) == TKV_OK, "%s", tkv_last_error());
    to_host(og, dy, n * sizeof *og);
    CHECK(memcmp(og, oc, n * sizeof *og) == 0, "add differs");
    dev_free(dg), dev_free(du), dev_free(dy);
    free(g), free(u), free(oc), free(og);
}

static void test_kv_write(void)
{
    const uint32_t rows = 77, hd = 64;
    const size_t stride = 3 * hd + 5;
    float *src = malloc(rows * stride * sizeof *src);
    fill(src, rows * stride, -70000, 70000);
    for (size_t i = 0; i < rows * stride; i += 7) /* small values, f16 subnormals */
        src[i] = test_rand_f32(&rng, -1e-6f, 1e-6f);
    uint16_t *dc = malloc(rows * hd * 2), *dg_h = malloc(rows * hd * 2);
    CHECK(cpu->ops->kv_write(cpu, src + hd, stride, dc, rows, hd) == TKV_OK, "%s", tkv_last_error());
    float *ds = dev_from(src, rows * stride * sizeof *src);
    uint16_t *dd = dev_alloc(rows * hd * 2);
    CHECK(gpu->ops->kv_write(gpu, ds + hd, stride, dd, rows, hd) == TKV_OK, "%s", tkv_last_error());
    to_host(dg_h, dd, rows * hd * 2);
    CHECK(memcmp(dc, dg_h, rows * hd * 2) == 0, "kv_write: f16 bits differ");
    fprintf(stderr, "kv_write: %u rows bit-identical: %s\n", rows, memcmp(dc, dg_h, rows * hd * 2) ? "no" : "yes");
    dev_free(ds), dev_free(dd);
    free(src), free(dc), free(dg_h);
}

/* kv_write_heads against the CPU's kv_write per head: n_heads heads of
 * head_dim, n_rows rows, destinations scattered over one buffer in a
 * shuffled order (more than 64 heads: the CUDA op launches per 64). */
static void test_kv_write_heads_case(uint32_t n_heads, uint32_t n_rows, uint32_t hd)
{
    const size_t stride = (size_t)n_heads * hd, nsrc = n_rows * stride, per = (size_t)n_rows * hd;
    float *k = malloc(nsrc * sizeof *k), *v = malloc(nsrc * sizeof *v);
    fill(k, nsrc, -70000, 70000);
    fill(v, nsrc, -2, 2);
    for (size_t i = 0; i < nsrc; i += 5)
        k[i] = test_rand_f32(&rng, -1e-6f, 1e-6f);
    /* 2 * n_heads slots of per + 8 halves; slot of (side, h) shuffled */
    const size_t slot = per + 8, n_slots = 2 * (size_t)n_heads;
    uint32_t *perm = malloc(n_slots * sizeof *perm);
    for (uint32_t i = 0; i < n_slots; i++)
        perm[i] = i;
    for (uint32_t i = (uint32_t)n_slots - 1; i > 0; i--) {
        const uint32_t j = (uint32_t)(test_rand_u64(&rng) % (i + 1)), t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    uint16_t *want = malloc(n_slots * slot * 2), *got = malloc(n_slots * slot * 2);
    memset(want, 0xAB, n_slots * slot * 2); /* the gaps must stay as they were */
    uint16_t *dbuf = dev_from(want, n_slots * slot * 2);
    uint16_t **kd = malloc(n_heads * sizeof *kd), **vd = malloc(n_heads * sizeof *vd);
    uint16_t **kh = malloc(n_heads * sizeof *kh), **vh = malloc(n_heads * sizeof *vh);
    for (uint32_t h = 0; h < n_heads; h++) {
        kd[h] = dbuf + perm[2 * h] * slot, vd[h] = dbuf + perm[2 * h + 1] * slot;
        kh[h] = want + perm[2 * h] * slot, vh[h] = want + perm[2 * h + 1] * slot;
        CHECK(cpu->ops->kv_write(cpu, k + (size_t)h * hd, stride, kh[h], n_rows, hd) == TKV_OK, "%s", tkv_last_error());
        CHECK(cpu->ops->kv_write(cpu, v + (size_t)h * hd, stride, vh[h], n_rows, hd) == TKV_OK, "%s", tkv_last_error());
    }
    float *dk = dev_from(k, nsrc * sizeof *k), *dv = dev_from(v, nsrc * sizeof *v);
    CHECK(gpu->ops->kv_write_heads != NULL, "cuda has no kv_write_heads");
    if (gpu->ops->kv_write_heads)
        CHECK(gpu->ops->kv_write_heads(gpu, dk, dv, stride, kd, vd, n_heads, n_rows, hd) == TKV_OK, "%s",
              tkv_last_error());
    to_host(got, dbuf, n_slots * slot * 2);
    const bool same = !memcmp(want, got, n_slots * slot * 2);
    CHECK(same, "kv_write_heads %u heads x %u rows x %u: f16 bits differ from kv_write", n_heads, n_rows, hd);
    /* the CPU backend's own kv_write_heads gives the same bits */
    uint16_t *cpu_buf = malloc(n_slots * slot * 2);
    memset(cpu_buf, 0xAB, n_slots * slot * 2);
    for (uint32_t h = 0; h < n_heads; h++)
        kh[h] = cpu_buf + perm[2 * h] * slot, vh[h] = cpu_buf + perm[2 * h + 1] * slot;
    CHECK(cpu->ops->kv_write_heads && cpu->ops->kv_write_heads(cpu, k, v, stride, kh, vh, n_heads, n_rows, hd) == TKV_OK,
          "cpu kv_write_heads");
    CHECK(!memcmp(want, cpu_buf, n_slots * slot * 2), "cpu kv_write_heads differs from kv_write");
    fprintf(stderr, "kv_write_heads: %u heads x %u rows x %u bit-identical to kv_write: %s\n", n_heads, n_rows, hd,
            same ? "yes" : "no");
    dev_free(dbuf), dev_free(dk), dev_free(dv);
    free(k), free(v), free(perm), free(want), free(got), free(cpu_buf), free(kd), free(vd), free(kh), free(vh);
}

static void test_kv_write_heads(void)
{
    test_kv_write_heads_case(8, 1, 128);  /* a Llama-3-8B decode step */
    test_kv_write_heads_case(3, 5, 64);   /* SmolLM2, a few rows      */
    test_kv_write_heads_case(70, 2, 72);  /* two launches             */
    test_kv_write_heads_case(1, 64, 256); /* one head, a whole block  */
}

/* ---- op profile ----------------------------------------------------------------------------- */

/* TKV_CUDA_PROFILE=1: the counts are exact, device times positive and
 * within the span, more calls than the event ring holds are all folded,
 * reset starts over, and the outputs are those of the plain backend. */
static void test_profile(void)
{
    CHECK(gpu->ops->profile_read == NULL, "profiling is off by default");
    setenv("TKV_CUDA_PROFILE", "1", 1);
    struct tkv_backend *pb = NULL;
    tkv_status st = tkv_backend_create("cuda", 0, &pb);
    unsetenv("TKV_CUDA_PROFILE");
    CHECK(st == TKV_OK && pb && pb->ops->profile_read && pb->ops->profile_reset, "profiling backend: %s",
          tkv_last_error());
    if (!pb || !pb->ops->profile_read)
        return;
    struct test_weight tw;
    weight_make(&tw, TKV_TYPE_F16, 4096, 1024, 2);
    struct tkv_bweight *wp = NULL, *wg = NULL;
    CHECK(pb->ops->weight_init(pb, &tw.t, &wp) == TKV_OK, "%s", tkv_last_error());
    CHECK(gpu->ops->weight_init(gpu, &tw.t, &wg) == TKV_OK, "%s", tkv_last_error());
    float *x = malloc(4096 * sizeof *x), *y1 = malloc(1024 * sizeof *y1), *y2 = malloc(1024 * sizeof *y2);
    fill(x, 4096, -1, 1);
    float *dx = dev_from(x, 4096 * sizeof *x), *dy = dev_poisoned(1024), *dz = dev_poisoned(1024);
    const uint32_t n_add = 2500; /* more than the ring's 2048 pairs */
    for (uint32_t i = 0; i < 3; i++)
        CHECK(pb->ops->matmul(pb, wp, dx, dy, 1) == TKV_OK, "%s", tkv_last_error());
    for (uint32_t i = 0; i < n_add; i++)
        CHECK(pb->ops->add(pb, dx, dx, 0) == TKV_OK && pb->ops->add(pb, dz, dz, 1) == TKV_OK, "%s", tkv_last_error());
    CHECK(pb->ops->download(pb, y1, dy, 1024 * sizeof *y1) == TKV_OK, "%s", tkv_last_error());
    CHECK(gpu->ops->matmul(gpu, wg, dx, dy, 1) == TKV_OK, "%s", tkv_last_error());
    to_host(y2, dy, 1024 * sizeof *y2);
    CHECK(!memcmp(y1, y2, 1024 * sizeof *y1), "matmul with profiling differs from without");
    struct tkv_op_profile p;
    CHECK(pb->ops->profile_read(pb, &p) == TKV_OK, "%s", tkv_last_error());
    uint64_t mm = 0, add = 0, dl = 0;
    double busy = 0;
    bool times_ok = true;
    for (uint32_t i = 0; i < p.n_rows; i++) {
        const struct tkv_op_profile_row *r = &p.rows[i];
        if (!strncmp(r->name, "matmul 1024x4096", 16))
            mm += r->calls, times_ok = times_ok && r->dev_s > 0;
        else if (!strcmp(r->name, "add"))
            add += r->calls, times_ok = times_ok && r->dev_s > 0;
        else if (!strcmp(r->name, "download"))
            dl += r->calls, times_ok = times_ok && r->dev_s >= 0;
        times_ok = times_ok && r->host_s >= 0;
        busy += r->dev_s > 0 ? r->dev_s : 0;
    }
    CHECK(mm == 3 && add == 2 * n_add && dl == 1, "profile counts: matmul %llu add %llu download %llu",
          (unsigned long long)mm, (unsigned long long)add, (unsigned long long)dl);
    CHECK(times_ok, "profile: a timed row without device time");
    CHECK(fabs(busy - p.dev_busy_s) <= 1e-9 + 1e-6 * busy, "profile: busy %.9f vs rows %.9f", p.dev_busy_s, busy);
    CHECK(p.dev_span_s > 0 && p.dev_busy_s <= p.dev_span_s * 1.001 + 1e-5 && p.host_wall_s > 0,
          "profile: busy %.6f s, span %.6f s, wall %.6f s", p.dev_busy_s, p.dev_span_s, p.host_wall_s);
    tkv_op_profile_print("test-gpu-backend", &p, 0);
    pb->ops->profile_reset(pb);
    CHECK(pb->ops->profile_read(pb, &p) == TKV_OK, "%s", tkv_last_error());
    uint64_t left = 0;
    for (uint32_t i = 0; i < p.n_rows; i++)
        left += p.rows[i].calls;
    CHECK(left == 0 && p.dev_busy_s == 0, "profile_reset left %llu calls", (unsigned long long)left);
    dev_free(dx), dev_free(dy), dev_free(dz);
    pb->ops->weight_free(pb, wp);
    gpu->ops->weight_free(gpu, wg);
    pb->ops->free(pb);
    weight_free(&tw);
    free(x), free(y1), free(y2);
}

/* ---- attention -------------------------------------------------------------------------- */

/* Every case runs on several CUDA backends: the default one (for <= 8 query
 * rows per KV head the decode kernel with its fused merge, reading the view
 * as strided runs from its launch parameters and asking L2 for each warp's
 * first K/V chunks before its dependency wait; views of too many runs fall
 * back to the packed block table; for more rows the tensor-core kernel in
 * split precision where head_dim is 64 or 128, walking packed 64-key
 * tiles), the general kernel (TKV_CUDA_ATTN_DECODE=0
 * TKV_CUDA_ATTN_PREFILL=general: the reference the fast kernels are checked
 * against), the decode kernel with a separate merge kernel
 * (TKV_CUDA_ATTN_DECODE=merge), the packed table copied on the compute
 * stream (TKV_CUDA_ATTN_DECODE=fused TKV_CUDA_ATTN_TABLE=main), the
 * tensor-core kernel with f16 Q and P (TKV_CUDA_ATTN_PREFILL=mma16, as
 * FlashAttention: held to 2e-3 instead of 1e-4), the tensor-core kernel
 * walking the refs one by one (TKV_CUDA_ATTN_PACK=0), the default without
 * the L2 prefetch and with its runs built block by block
 * (TKV_CUDA_ATTN_PREFETCH=0 TKV_CUDA_ATTN_RUNS_SCAN=block, the reference
 * of the stretches at one stride: the default's bits exactly),
 * and the decode kernel over the packed table always
 * (TKV_CUDA_ATTN_DECODE=fused: the bits the device views must give). The
 * decode kernel at head_dim 65..128 is the tensor-core instance;
 * TKV_CUDA_ATTN_DECODE_MMA=0 runs the CUDA-core one over the packed table
 * ("decode-cores"). */
#define N_ATTN_ALT 8
static struct tkv_backend *gpu_attn_alt[N_ATTN_ALT]; /* [0]: the general kernel */
static const char *const attn_alt_names[N_ATTN_ALT] = {"general", "merge",       "table-main", "mma16",
                                                       "per-ref", "reference-runs", "packed",  "decode-cores"};
static const double attn_alt_tol[N_ATTN_ALT] = {1e-4, 1e-4, 1e-4, 2e-3, 1e-4, 1e-4, 1e-4, 1e-4};

/* The tensor-core prefill kernel's variants (v1: 128-row tiles, v2: wgmma, v3: wgmma with specialized warps;
 * set by tkv_backend_cuda_set_prefill_variant) are run in-process on three backends
 * of their own: split precision on packed tiles, f16 (mma16) on packed
 * tiles, split precision walking the refs one by one; each against the
 * double reference (1e-4; f16 2e-3) and against v0 run on the same backend. */
#define N_PF_VAR_BE 3
static struct tkv_backend *gpu_pf_var[N_PF_VAR_BE];
static const char *const pf_var_names[N_PF_VAR_BE] = {"split", "mma16", "per-ref"};
static const double pf_var_tol[N_PF_VAR_BE] = {1e-4, 2e-3, 1e-4};
static int n_pf_variants;                              /* v0 .. n_pf_variants - 1 */

enum view_kind { VIEW_ALL, VIEW_SPARSE, VIEW_WINDOW, VIEW_SLICES };

struct kv_fixture {
    uint32_t nb, B, hd, Hkv;
    uint16_t *host;                    /* [Hkv][nb][K|V][B][hd] (+ pad)   */
    uint16_t *dev;                     /* same layout on the device       */
    struct tkv_kv_block_ref *hrefs, *drefs;  /* [Hkv][2 nb]             */
    struct tkv_kv_head_view *hviews, *dviews; /* [Hkv]                   */
};

static void kv_make(struct kv_fixture *f, uint32_t Hkv, uint32_t hd, uint32_t B, uint32_t n_tokens,
                    enum view_kind kind, uint32_t shift)
{
    const uint32_t nb = (n_tokens + B - 1) / B;
    const size_t elems = (size_t)Hkv * nb * 2 * B * hd + shift;
    f->nb = nb, f->B = B, f->hd = hd, f->Hkv = Hkv;
    f->host = malloc(elems * 2);
    for (size_t i = 0; i < elems; i++)
        f->host[i] = tkv_fp32_to_fp16(test_rand_f32(&rng, -2, 2));
    f->dev = dev_from(f->host, elems * 2);
    f->hrefs = calloc((size_t)Hkv * nb * 2, sizeof *f->hrefs);
    f->drefs = calloc((size_t)Hkv * nb * 2, sizeof *f->drefs);
    f->hviews = calloc(Hkv, sizeof *f->hviews);
    f->dviews = calloc(Hkv, sizeof *f->dviews);
    for (uint32_t h = 0; h < Hkv; h++) {
        uint32_t kept = 0;
        struct tkv_kv_block_ref *hr = f->hrefs + (size_t)h * nb * 2, *dr = f->drefs + (size_t)h * nb * 2;
        for (uint32_t b = 0; b < nb; b++) {
            if (kind == VIEW_SPARSE && b > 0 && b + 1 < nb && (test_rand_u64(&rng) & 1))
                continue; /* a selecting policy dropped it */
            if (kind == VIEW_WINDOW && b < nb / 2)
                continue; /* only the recent half: early queries see nothing */
            const size_t o = shift + (((size_t)h * nb + b) * 2) * B * hd;
            const uint32_t n = TKV_MIN(B, n_tokens - b * B);
            /* VIEW_SLICES: blocks cut in two at a random row (as the engine's
             * token ranges do), sometimes with rows left out between */
            uint32_t cut = n, skip = 0;
            if (kind == VIEW_SLICES && n > 1 && (test_rand_u64(&rng) % 3)) {
                cut = 1 + (uint32_t)(test_rand_u64(&rng) % (n - 1));
                skip = (test_rand_u64(&rng) & 1) ? (uint32_t)(test_rand_u64(&rng) % (n - cut)) : 0;
            }
            hr[kept] = (struct tkv_kv_block_ref){
                .k = f->host + o, .v = f->host + o + (size_t)B * hd, .pos0 = (int32_t)(b * B), .n = cut};
            dr[kept++] = (struct tkv_kv_block_ref){
                .k = f->dev + o, .v = f->dev + o + (size_t)B * hd, .pos0 = (int32_t)(b * B), .n = cut};
            if (cut + skip < n) {
                const size_t r0 = (size_t)(cut + skip) * hd;
                hr[kept] = (struct tkv_kv_block_ref){.k = f->host + o + r0, .v = f->host + o + (size_t)B * hd + r0,
                                                     .pos0 = (int32_t)(b * B + cut + skip), .n = n - cut - skip};
                dr[kept++] = (struct tkv_kv_block_ref){.k = f->dev + o + r0, .v = f->dev + o + (size_t)B * hd + r0,
                                                       .pos0 = (int32_t)(b * B + cut + skip), .n = n - cut - skip};
            }
        }
        f->hviews[h] = (struct tkv_kv_head_view){.blocks = hr, .n_blocks = kept};
        f->dviews[h] = (struct tkv_kv_head_view){.blocks = dr, .n_blocks = kept};
    }
}

static void kv_free(struct kv_fixture *f)
{
    dev_free(f->dev);
    free(f->host), free(f->hrefs), free(f->drefs), free(f->hviews), free(f->dviews);
}

static double max_err(const float *a, const float *b, size_t n)
{
    double e = 0;
    for (size_t i = 0; i < n; i++) {
        if (isinf(a[i]) && isinf(b[i]) && (a[i] > 0) == (b[i] > 0))
            continue; /* lse of a row that sees nothing: -inf in both */
        const double d = fabs((double)a[i] - b[i]);
        if (!(d <= e)) /* NaN makes it infinite */
            e = isnan(d) ? INFINITY : d;
    }
    return e;
}

/* Runs a (device pointers) on backend be into fresh poisoned outputs. */
static void attn_on(struct tkv_backend *be, struct tkv_attn_args *a, float *o_host, float *l_host)
{
    const size_t qn = (size_t)a->n_q * a->n_head * a->head_dim, ln = (size_t)a->n_q * a->n_head;
    float *dout = dev_poisoned(qn), *dlse = dev_poisoned(ln);
    a->out = dout;
    a->lse = dlse;
    CHECK(be->ops->attention(be, a) == TKV_OK, "%s", tkv_last_error());
    CHECK(be->ops->synchronize(be) == TKV_OK, "%s", tkv_last_error());
    to_host(o_host, dout, qn * sizeof *o_host);
    to_host(l_host, dlse, ln * sizeof *l_host);
    dev_free(dout), dev_free(dlse);
}

/* The call a (f's device views) with its views' block arrays in device
 * memory instead (kv_dev, as the engine's decode table gives them): one
 * array, the heads in reverse order with a poisoned entry between them,
 * refs of no rows left out (the contract). Where the fixture's rows are
 * 16-byte aligned (kv_dev's contract): a decode call (at most 8 rows per KV
 * head) must give the packed table's output bit for bit -- the same
 * entries, the same plan -- and any call the reference's within 1e-4; so
 * must the call with the counts in device memory (kv_dev_n) and bounds one
 * past them in the views. */
static void attn_device_views(const struct kv_fixture *f, const struct tkv_attn_args *a, const float *o_gpu,
                              const float *l_gpu, const float *o_ref, const float *l_ref, const char *label)
{
    const uint32_t Hkv = f->Hkv;
    size_t total = 0;
    bool aligned = true;
    for (uint32_t h = 0; h < Hkv; h++)
        for (uint32_t i = 0; i < f->dviews[h].n_blocks; i++) {
            const struct tkv_kv_block_ref *r = &f->dviews[h].blocks[i];
            total += r->n > 0;
            aligned &= (uintptr_t)r->k % 16 == 0 && (uintptr_t)r->v % 16 == 0;
        }
    if (!aligned || f->hd % 8)
        return;
    struct tkv_kv_block_ref *arr = malloc((total + Hkv) * sizeof *arr);
    struct tkv_kv_head_view *views = malloc(Hkv * sizeof *views);
    size_t at = 0, off[64];
    REQUIRE_VOID(arr && views && Hkv <= 64);
    for (uint32_t h = Hkv; h-- > 0;) {
        off[h] = at;
        for (uint32_t i = 0; i < f->dviews[h].n_blocks; i++)
            if (f->dviews[h].blocks[i].n > 0)
                arr[at++] = f->dviews[h].blocks[i];
        memset(&arr[at++], 0xa5, sizeof *arr);
    }
    struct tkv_kv_block_ref *darr = dev_from(arr, at * sizeof *arr);
    for (uint32_t h = 0; h < Hkv; h++) {
        uint32_t n = 0;
        for (uint32_t i = 0; i < f->dviews[h].n_blocks; i++)
            n += f->dviews[h].blocks[i].n > 0;
        views[h] = (struct tkv_kv_head_view){.blocks = darr + off[h], .n_blocks = n};
    }
    const size_t qn = (size_t)a->n_q * a->n_head * a->head_dim, ln = (size_t)a->n_q * a->n_head;
    float *o = malloc(qn * sizeof *o), *l = malloc(ln * sizeof *l);
    struct tkv_attn_args d = *a;
    d.kv = views;
    d.kv_dev = true;
    attn_on(gpu, &d, o, l);
    const bool decode = a->n_q * (a->n_head / Hkv) <= 8;
    const double eo = max_err(o, o_ref, qn), el = max_err(l, l_ref, ln);
    const double fo = max_err(o, o_gpu, qn), fl = max_err(l, l_gpu, ln);
    fprintf(stderr, ", device views vs ref %.1e %.1e, vs packed %.1e %.1e", eo, el, fo, fl);
    CHECK(eo <= 1e-4 && el <= 1e-4, "attention (device views) %s: out err %.3g lse err %.3g", label, eo, el);
    CHECK(!decode || (fo == 0 && fl == 0), "attention (device views, decode) %s: %.3g / %.3g from the packed table",
          label, fo, fl);
    /* the counts in device memory (kv_dev_n, stride 3), the views' n_blocks
     * one more: the bound takes in the poisoned entry after each head's,
     * which the counts must keep out */
    uint32_t *cnt = calloc((size_t)Hkv * 3, sizeof *cnt);
    REQUIRE_VOID(cnt);
    for (uint32_t h = 0; h < Hkv; h++)
        cnt[3 * h] = views[h].n_blocks, views[h].n_blocks++;
    uint32_t *dcnt = dev_from(cnt, (size_t)Hkv * 3 * sizeof *cnt);
    d.kv_dev_n = dcnt, d.kv_dev_n_stride = 3;
    attn_on(gpu, &d, o, l);
    const double co = max_err(o, o_ref, qn), cl = max_err(l, l_ref, ln);
    fprintf(stderr, ", counts on the device vs ref %.1e %.1e", co, cl);
    CHECK(co <= 1e-4 && cl <= 1e-4, "attention (device views, device counts) %s: out err %.3g lse err %.3g", label,
          co, cl);
    /* with the heads' keys beside the counts (kv_dev_keys, a hint: the
     * decode kernel then shares its CTAs among the heads by them): equal
     * keys give the equal splits' bits; the heads' own keys, and keys all
     * on one head (the others one CTA each), the reference's output */
    float *o2 = malloc(qn * sizeof *o2), *l2 = malloc(ln * sizeof *l2);
    REQUIRE_VOID(o2 && l2);
    d.kv_dev_keys = dcnt + 1;
    for (int hint = 0; hint < 3; hint++) {
        for (uint32_t h = 0; h < Hkv; h++) {
            uint32_t k = 0;
            for (uint32_t i = 0; i < f->dviews[h].n_blocks; i++)
                k += f->dviews[h].blocks[i].n;
            cnt[3 * h + 1] = hint == 0 ? 7 : hint == 1 ? k : h == Hkv / 2 ? 1000000 : 0;
        }
        REQUIRE_VOID(gpu->ops->upload(gpu, dcnt, cnt, (size_t)Hkv * 3 * sizeof *cnt) == TKV_OK);
        attn_on(gpu, &d, o2, l2);
        const double po = max_err(o2, o_ref, qn), pl = max_err(l2, l_ref, ln);
        const double eq = max_err(o2, o, qn) + max_err(l2, l, ln);
        static const char *const hints[] = {"equal", "the heads' own", "all on one head"};
        fprintf(stderr, ", keys %s vs ref %.1e %.1e", hints[hint], po, pl);
        CHECK(po <= 1e-4 && pl <= 1e-4, "attention (device views, device counts, keys %s) %s: out err %.3g lse err %.3g",
              hints[hint], label, po, pl);
        CHECK(hint != 0 || eq == 0, "attention (device views, device counts, equal keys) %s: %.3g from equal splits",
              label, eq);
    }
    free(o2), free(l2);
    dev_free(dcnt);
    free(cnt);
    dev_free(darr);
    free(arr), free(views), free(o), free(l);
}

/* Attention over fixture f with queries at positions pos[n_q] on every
 * backend, against the double reference and the CPU backend; label names
 * the case in the log. */
static void attn_compare(const struct kv_fixture *f, uint32_t H, uint32_t n_q, const int32_t *pos, const char *label)
{
    const uint32_t Hkv = f->Hkv, hd = f->hd;
    const size_t qn = (size_t)n_q * H * hd, ln = (size_t)n_q * H;
    float *q = malloc(qn * sizeof *q), *o_ref = malloc(qn * sizeof *o_ref), *o_cpu = malloc(qn * sizeof *o_cpu);
    float *o_gpu = malloc(qn * sizeof *o_gpu), *l_ref = malloc(ln * sizeof *l_ref), *l_cpu = malloc(ln * sizeof *l_cpu);
    float *l_gpu = malloc(ln * sizeof *l_gpu), *o_x = malloc(qn * sizeof *o_x), *l_x = malloc(ln * sizeof *l_x);
    fill(q, qn, -1, 1);
    struct tkv_attn_args a = {.q = q, .q_pos = pos, .out = o_ref, .lse = l_ref, .n_q = n_q, .n_head = H,
                              .n_head_kv = Hkv, .head_dim = hd, .scale = 1.0f / sqrtf((float)hd), .kv = f->hviews};
    CHECK(tkv_cpu_attention_ref(&a) == TKV_OK, "%s", tkv_last_error());
    a.out = o_cpu;
    a.lse = l_cpu;
    CHECK(cpu->ops->attention(cpu, &a) == TKV_OK, "%s", tkv_last_error());
    float *dq = dev_from(q, qn * sizeof *q);
    a.q = dq;
    a.kv = f->dviews;
    attn_on(gpu, &a, o_gpu, l_gpu);
    const double eo = max_err(o_gpu, o_ref, qn), el = max_err(l_gpu, l_ref, ln);
    const double eoc = max_err(o_gpu, o_cpu, qn), elc = max_err(l_gpu, l_cpu, ln);
    fprintf(stderr, "  attn H=%-2u Hkv=%-2u hd=%-3u %s max|out-ref| %.1e |lse-ref| %.1e, vs cpu %.1e %.1e", H, Hkv,
            hd, label, eo, el, eoc, elc);
    CHECK(eo <= 1e-4 && el <= 1e-4, "attention H=%u Hkv=%u hd=%u %s: out err %.3g lse err %.3g", H, Hkv, hd, label,
          eo, el);
    CHECK(eoc <= 1e-4 && elc <= 1e-4, "attention vs cpu backend: out %.3g lse %.3g", eoc, elc);

    /* the device views give the packed table's bits in decode calls (the
     * same kernel, walk and plan; the default's inline runs cut other splits) */
    if (gpu_attn_alt[6]) {
        attn_on(gpu_attn_alt[6], &a, o_x, l_x);
        attn_device_views(f, &a, o_x, l_x, o_ref, l_ref, label);
    }

    /* the general (reference) kernel and the other paths, on the same inputs */
    double worst_o = 0, worst_l = 0;
    for (int i = 0; i < N_ATTN_ALT; i++) {
        if (!gpu_attn_alt[i])
            continue;
        attn_on(gpu_attn_alt[i], &a, o_x, l_x);
        if (i == 5) /* the L2 prefetch is a hint; the stretches give the per-block walk's runs */
            CHECK(!memcmp(o_gpu, o_x, qn * sizeof *o_x) && !memcmp(l_gpu, l_x, ln * sizeof *l_x),
                  "attention H=%u Hkv=%u hd=%u %s: the default differs from itself without the L2 prefetch, its runs "
                  "built block by block", H, Hkv, hd, label);
        const double xo = max_err(o_x, o_ref, qn), xl = max_err(l_x, l_ref, ln);
        const double fo = max_err(o_gpu, o_x, qn), fl = max_err(l_gpu, l_x, ln), tol = attn_alt_tol[i];
        if (i == 0)
            fprintf(stderr, ", |default-general| %.1e %.1e", fo, fl);
        else if (i == 3)
            fprintf(stderr, ", %s vs ref %.1e %.1e", attn_alt_names[i], xo, xl);
        else if (i == 4)
            fprintf(stderr, ", |default-per-ref| %.1e %.1e", fo, fl);
        else if (i == 5)
            fprintf(stderr, ", runs vs ref %.1e %.1e", xo, xl);
        if (i != 3)
            worst_o = fmax(worst_o, xo), worst_l = fmax(worst_l, xl);
        CHECK(xo <= tol && xl <= tol, "attention (%s) H=%u Hkv=%u hd=%u %s: out err %.3g lse err %.3g",
              attn_alt_names[i], H, Hkv, hd, label, xo, xl);
        CHECK(fo <= tol && fl <= tol, "attention: default vs %s: out %.3g lse %.3g", attn_alt_names[i], fo, fl);
    }
    fprintf(stderr, ", general/merge/table-main/per-ref/reference-runs/packed vs ref %.1e %.1e", worst_o, worst_l);

    /* the prefill kernel's variants, where the call reaches it (more than 8
     * rows per KV head, head_dim 64 or 128) */
    if (n_q * (H / Hkv) > 8 && (hd == 64 || hd == 128)) {
        float *o_0 = malloc(qn * sizeof *o_0), *l_0 = malloc(ln * sizeof *l_0);
        for (int b = 0; b < N_PF_VAR_BE; b++) {
            if (!gpu_pf_var[b])
                continue;
            /* v0 in this setting */
            CHECK(tkv_backend_cuda_set_prefill_variant(gpu_pf_var[b], 0) == TKV_OK, "%s", tkv_last_error());
            attn_on(gpu_pf_var[b], &a, o_0, l_0);
            double wr = fmax(max_err(o_0, o_ref, qn), max_err(l_0, l_ref, ln)), w0 = 0;
            CHECK(wr <= pf_var_tol[b], "attention (prefill v0, %s) H=%u Hkv=%u hd=%u %s: err %.3g vs ref",
                  pf_var_names[b], H, Hkv, hd, label, wr);
            for (int v = 1; v < n_pf_variants; v++) {
                CHECK(tkv_backend_cuda_set_prefill_variant(gpu_pf_var[b], v) == TKV_OK, "%s", tkv_last_error());
                attn_on(gpu_pf_var[b], &a, o_x, l_x);
                const double xo = max_err(o_x, o_ref, qn), xl = max_err(l_x, l_ref, ln);
                const double fo = max_err(o_x, o_0, qn), fl = max_err(l_x, l_0, ln), tol = pf_var_tol[b];
                wr = fmax(wr, fmax(xo, xl)), w0 = fmax(w0, fmax(fo, fl));
                CHECK(xo <= tol && xl <= tol, "attention (prefill v%d, %s) H=%u Hkv=%u hd=%u %s: out err %.3g lse err %.3g",
                      v, pf_var_names[b], H, Hkv, hd, label, xo, xl);
                CHECK(fo <= tol && fl <= tol, "attention: prefill v%d vs v0 (%s) H=%u Hkv=%u hd=%u %s: out %.3g lse %.3g",
                      v, pf_var_names[b], H, Hkv, hd, label, fo, fl);
            }
            CHECK(tkv_backend_cuda_set_prefill_variant(gpu_pf_var[b], 0) == TKV_OK, "%s", tkv_last_error());
            fprintf(stderr, ", v0-v%d %s vs ref %.1e vs v0 %.1e", n_pf_variants - 1,
                    pf_var_names[b], wr, w0);
        }
        free(o_0), free(l_0);
    }
    fprintf(stderr, "\n");

    /* without lse the output is the same */
    float *dout2 = dev_poisoned(qn);
    a.out = dout2;
    a.lse = NULL;
    CHECK(gpu->ops->attention(gpu, &a) == TKV_OK, "%s", tkv_last_error());
    to_host(o_cpu, dout2, qn * sizeof *o_cpu);
    CHECK(max_err(o_cpu, o_ref, qn) <= 1e-4, "attention without lse differs");

    dev_free(dq), dev_free(dout2);
    free(q), free(o_ref), free(o_cpu), free(o_gpu), free(l_ref), free(l_cpu), free(l_gpu), free(o_x), free(l_x);
}

static void test_attention_case(uint32_t H, uint32_t Hkv, uint32_t hd, uint32_t B, uint32_t n_ctx, uint32_t n_q,
                                enum view_kind kind, uint32_t shift)
{
    struct kv_fixture f;
    kv_make(&f, Hkv, hd, B, n_ctx, kind, shift);
    int32_t *pos = malloc(n_q * sizeof *pos);
    for (uint32_t t = 0; t < n_q; t++) /* the last n_q positions, as in a prefill chunk */
        pos[t] = (int32_t)(n_ctx - n_q + t);
    static const char *kinds[] = {"all", "sparse", "window", "slices"};
    char label[96];
    snprintf(label, sizeof label, "B=%-3u ctx=%-5u n_q=%-3u %-6s%s", B, n_ctx, n_q, kinds[kind],
             shift ? " (unaligned)" : "");
    attn_compare(&f, H, n_q, pos, label);
    free(pos);
    kv_free(&f);
}

/* Views of many small refs, as EntropyInfer's 8-token key blocks and the
 * RaBitQ policies' token ranges give them: each KV head's n_tokens positions
 * are cut into runs, each inside one B-row storage block and starting at any
 * row of it (16-byte aligned: head_dim is a multiple of 8), a run kept as a
 * ref with probability keep_pct % (the others are gaps); in the device view,
 * now and then a ref of no rows before a kept one. Run lengths: */
enum ref_lens {
    LENS_MIXED,  /* 1, 7, 8, 63, 64 or 1..64 at random (cut at the block's end) */
    LENS_8,      /* 8 rows at multiples of 8 (EntropyInfer's key blocks)         */
    LENS_1,      /* single rows: 64 refs in a tile                               */
    LENS_FULL,   /* whole blocks (30% of block starts), else 1..3 rows           */
};

static uint32_t draw_len(enum ref_lens lens, uint32_t row)
{
    static const uint32_t picks[] = {1, 7, 8, 63, 64};
    const uint64_t u = test_rand_u64(&rng);
    switch (lens) {
    case LENS_8: return 8;
    case LENS_1: return 1;
    case LENS_FULL: return row == 0 && u % 10 < 3 ? UINT32_MAX : 1 + (uint32_t)(u / 10 % 3);
    default: return u % 2 ? picks[u / 2 % 5] : 1 + (uint32_t)(u / 2 % 64);
    }
}

static void kv_make_refs(struct kv_fixture *f, uint32_t Hkv, uint32_t hd, uint32_t B, uint32_t n_tokens,
                         enum ref_lens lens, uint32_t keep_pct)
{
    const uint32_t nb = (n_tokens + B - 1) / B;
    const size_t elems = (size_t)Hkv * nb * 2 * B * hd, cap = 2 * (size_t)n_tokens + 2;
    f->nb = nb, f->B = B, f->hd = hd, f->Hkv = Hkv;
    f->host = malloc(elems * 2);
    for (size_t i = 0; i < elems; i++)
        f->host[i] = tkv_fp32_to_fp16(test_rand_f32(&rng, -2, 2));
    f->dev = dev_from(f->host, elems * 2);
    f->hrefs = calloc((size_t)Hkv * cap, sizeof *f->hrefs);
    f->drefs = calloc((size_t)Hkv * cap, sizeof *f->drefs);
    f->hviews = calloc(Hkv, sizeof *f->hviews);
    f->dviews = calloc(Hkv, sizeof *f->dviews);
    for (uint32_t h = 0; h < Hkv; h++) {
        struct tkv_kv_block_ref *hr = f->hrefs + (size_t)h * cap, *dr = f->drefs + (size_t)h * cap;
        uint32_t kh = 0, kd = 0;
        for (uint32_t t = 0; t < n_tokens;) {
            const uint32_t b = t / B, row = t % B;
            const uint32_t want = draw_len(lens, row); /* once: TKV_MIN evaluates its arguments twice */
            const uint32_t n = TKV_MIN(TKV_MIN(want, B - row), n_tokens - t);
            if (test_rand_u64(&rng) % 100 < keep_pct) {
                const size_t o = (((size_t)h * nb + b) * 2) * B * hd + (size_t)row * hd;
                /* a ref of no rows first, on the device side only (the CPU
                 * backend's fast path refuses a tile of no rows) */
                if (test_rand_u64(&rng) % 16 == 0)
                    dr[kd++] = (struct tkv_kv_block_ref){
                        .k = f->dev + o, .v = f->dev + o + (size_t)B * hd, .pos0 = (int32_t)t, .n = 0};
                hr[kh++] = (struct tkv_kv_block_ref){
                    .k = f->host + o, .v = f->host + o + (size_t)B * hd, .pos0 = (int32_t)t, .n = n};
                dr[kd++] = (struct tkv_kv_block_ref){
                    .k = f->dev + o, .v = f->dev + o + (size_t)B * hd, .pos0 = (int32_t)t, .n = n};
            }
            t += n;
        }
        f->hviews[h] = (struct tkv_kv_head_view){.blocks = hr, .n_blocks = kh};
        f->dviews[h] = (struct tkv_kv_head_view){.blocks = dr, .n_blocks = kd};
    }
}

/* Queries at q0 + t * step4 / 4 (step4 = 4: consecutive positions; 2: each
 * twice; 12: every third) over a view of small refs: the prefill kernel
 * packs their rows into 64-key tiles, and the queries sit inside the
 * selection, so tiles mix visible and invisible keys. */
static void test_attention_refs(uint32_t H, uint32_t Hkv, uint32_t hd, uint32_t B, uint32_t n_tokens,
                                enum ref_lens lens, uint32_t keep_pct, uint32_t n_q, uint32_t q0, uint32_t step4)
{
    struct kv_fixture f;
    kv_make_refs(&f, Hkv, hd, B, n_tokens, lens, keep_pct);
    int32_t *pos = malloc(n_q * sizeof *pos);
    for (uint32_t t = 0; t < n_q; t++)
        pos[t] = (int32_t)(q0 + (uint64_t)t * step4 / 4);
    uint32_t refs = 0, keys = 0;
    for (uint32_t i = 0; i < f.hviews[0].n_blocks; i++)
        refs++, keys += f.hviews[0].blocks[i].n;
    static const char *names[] = {"mixed", "8-row", "1-row", "full+tiny"};
    char label[128];
    snprintf(label, sizeof label, "B=%-3u ctx=%-5u n_q=%-3u refs %s %u/%u keys, q at %u..%d", B, n_tokens, n_q,
             names[lens], refs, keys, q0, pos[n_q - 1]);
    attn_compare(&f, H, n_q, pos, label);
    free(pos);
    kv_free(&f);
}

/* A CUDA backend created with env (name, value, name, value, ..., NULL;
 * a NULL value: the name is skipped) in the environment; NULL on failure. */
static struct tkv_backend *gpu_with_env(const char *const *env)
{
    char desc[256] = "";
    for (const char *const *e = env; e[0]; e += 2)
        if (e[1]) {
            setenv(e[0], e[1], 1);
            snprintf(desc + strlen(desc), sizeof desc - strlen(desc), "%s=%s ", e[0], e[1]);
        }
    struct tkv_backend *be = NULL;
    const tkv_status st = tkv_backend_create("cuda", 0, &be);
    for (const char *const *e = env; e[0]; e += 2)
        unsetenv(e[0]);
    CHECK(st == TKV_OK, "%s: %s", desc, tkv_last_error());
    return st == TKV_OK ? be : NULL;
}

/* A CUDA backend created with these attention settings in the environment
 * (NULL on failure). */
static struct tkv_backend *gpu_with_attn_env(const char *decode, const char *table, const char *prefill,
                                             const char *pack)
{
    const char *const env[] = {"TKV_CUDA_ATTN_DECODE", decode,  "TKV_CUDA_ATTN_TABLE", table,
                               "TKV_CUDA_ATTN_PREFILL", prefill, "TKV_CUDA_ATTN_PACK", pack, NULL};
    return gpu_with_env(env);
}

static void test_attention(void)
{
    gpu_attn_alt[0] = gpu_with_attn_env("0", "copy", "general", "1");
    gpu_attn_alt[1] = gpu_with_attn_env("merge", "copy", "mma", "1");
    gpu_attn_alt[2] = gpu_with_attn_env("fused", "main", "mma", "1");
    gpu_attn_alt[3] = gpu_with_attn_env("1", "copy", "mma16", "1");
    /* f16 runs v3 (compute capability 9.0) or v1 by default; v0 here, the variants below are each checked */
    if (gpu_attn_alt[3])
        CHECK(tkv_backend_cuda_set_prefill_variant(gpu_attn_alt[3], 0) == TKV_OK, "%s", tkv_last_error());
    gpu_attn_alt[4] = gpu_with_attn_env("1", "copy", "mma", "0");
    static const char *const reference_runs[] = {"TKV_CUDA_ATTN_PREFETCH", "0", "TKV_CUDA_ATTN_RUNS_SCAN", "block",
                                                 NULL};
    gpu_attn_alt[5] = gpu_with_env(reference_runs);
    gpu_attn_alt[6] = gpu_with_attn_env("fused", "copy", "mma", "1");
    static const char *const cores[] = {"TKV_CUDA_ATTN_DECODE", "fused", "TKV_CUDA_ATTN_DECODE_MMA", "0", NULL};
    gpu_attn_alt[7] = gpu_with_env(cores);
    gpu_pf_var[0] = gpu_with_attn_env("1", "copy", "mma", "1");
    gpu_pf_var[1] = gpu_with_attn_env("1", "copy", "mma16", "1");
    gpu_pf_var[2] = gpu_with_attn_env("1", "copy", "mma", "0");
    for (n_pf_variants = 0; tkv_backend_cuda_prefill_variant_desc(n_pf_variants); n_pf_variants++)
        fprintf(stderr, "  prefill %s\n", tkv_backend_cuda_prefill_variant_desc(n_pf_variants));
    CHECK(n_pf_variants >= 2, "%d prefill variants", n_pf_variants);
    /* the setter refuses what does not exist */
    CHECK(tkv_backend_cuda_set_prefill_variant(gpu, n_pf_variants) == TKV_ERR_INVALID_ARG, "variant %d accepted",
          n_pf_variants);
    CHECK(tkv_backend_cuda_set_prefill_variant(gpu, -1) == TKV_ERR_INVALID_ARG, "variant -1 accepted");
    CHECK(tkv_backend_cuda_set_prefill_variant(cpu, 1) == TKV_ERR_INVALID_ARG, "variant set on the CPU backend");
    fprintf(stderr, "attention, prefill:\n");
    test_attention_case(9, 3, 64, 64, 300, 300, VIEW_ALL, 0);      /* SmolLM2 shape, whole prompt */
    test_attention_case(32, 8, 128, 32, 1000, 300, VIEW_ALL, 0);   /* Llama-3 8B shape, later chunk */
    test_attention_case(9, 3, 64, 16, 700, 300, VIEW_SPARSE, 0);   /* selected blocks */
    test_attention_case(4, 2, 64, 32, 512, 300, VIEW_WINDOW, 0);   /* rows that see no key */
    test_attention_case(16, 16, 96, 64, 530, 300, VIEW_ALL, 0);    /* MHA, hd 96 */
    test_attention_case(8, 1, 256, 64, 400, 300, VIEW_ALL, 0);     /* MQA, hd 256 */
    test_attention_case(9, 3, 64, 64, 200, 5, VIEW_ALL, 0);        /* a few tokens */
    test_attention_case(9, 3, 64, 64, 300, 300, VIEW_ALL, 2);      /* K/V not 16-byte aligned */
    test_attention_case(8, 2, 64, 32, 400, 100, VIEW_SLICES, 0);   /* blocks cut in slices */
    test_attention_case(32, 8, 128, 64, 5000, 16, VIEW_ALL, 0);    /* one row tile per head: split keys */
    test_attention_case(9, 3, 64, 48, 3000, 40, VIEW_SLICES, 0);   /* tiles across 48-key slices */
    test_attention_case(32, 8, 128, 64, 700, 700, VIEW_SPARSE, 0); /* causal, many tiles */
    fprintf(stderr, "attention, prefill over small refs (packed tiles):\n");
    test_attention_refs(32, 8, 128, 64, 4000, LENS_MIXED, 60, 300, 1500, 4);  /* G 4, queries mid-selection */
    test_attention_refs(8, 8, 64, 64, 3000, LENS_MIXED, 70, 200, 2000, 4);    /* G 1 */
    test_attention_refs(16, 2, 128, 64, 2500, LENS_8, 50, 100, 1000, 12);     /* G 8, every third position */
    test_attention_refs(8, 1, 64, 64, 3000, LENS_MIXED, 50, 64, 1500, 4);     /* G 8, hd 64 */
    test_attention_refs(9, 3, 64, 64, 2000, LENS_1, 80, 150, 900, 4);         /* 1-row refs: 64 per tile */
    test_attention_refs(9, 3, 128, 64, 1200, LENS_1, 100, 100, 1100, 2);      /* every row its own ref */
    test_attention_refs(8, 2, 64, 128, 3000, LENS_FULL, 90, 300, 1200, 2);    /* 128-row blocks and tiny refs */
    test_attention_refs(4, 4, 128, 32, 1500, LENS_MIXED, 50, 300, 0, 4);      /* early queries see nothing */
    test_attention_refs(32, 8, 128, 64, 20000, LENS_MIXED, 30, 16, 19000, 4); /* one row tile: split over tiles */
    test_attention_refs(32, 8, 128, 64, 16384, LENS_8, 12, 128, 16256, 4);    /* the bench's shape: all visible */
    test_attention_refs(32, 8, 64, 64, 6000, LENS_FULL, 60, 200, 4000, 8);    /* hd 64, many row tiles */
    fprintf(stderr, "attention, decode:\n");
    const uint32_t ctxs[] = {1, 63, 64, 65, 1000, 4097, 20000};
    for (size_t i = 0; i < sizeof ctxs / sizeof ctxs[0]; i++)
        test_attention_case(9, 3, 64, 64, ctxs[i], 1, VIEW_ALL, 0);
    test_attention_case(32, 8, 128, 32, 5000, 1, VIEW_SPARSE, 0);
    test_attention_case(28, 4, 128, 64, 6000, 1, VIEW_SPARSE, 0);  /* qwen2.5-7b's heads: 7 rows of 8 */
    test_attention_case(32, 4, 72, 256, 3001, 1, VIEW_ALL, 0);    /* G = 8, hd 72, B 256 */
    test_attention_case(8, 8, 80, 8, 777, 1, VIEW_WINDOW, 0);
    test_attention_case(16, 2, 256, 64, 3000, 1, VIEW_SPARSE, 0);
    test_attention_case(8, 2, 128, 64, 3000, 2, VIEW_ALL, 0);      /* 2 tokens x G 4 = 8 rows per KV head */
    test_attention_case(4, 4, 64, 32, 512, 3, VIEW_WINDOW, 0);     /* 3 rows, windowed */
    test_attention_case(9, 3, 64, 64, 1000, 1, VIEW_ALL, 2);       /* unaligned K/V: the general kernel */
    test_attention_case(32, 8, 128, 64, 70000, 1, VIEW_ALL, 0);    /* long: many splits, many blocks per warp */
    test_attention_case(32, 8, 128, 64, 9000, 1, VIEW_SLICES, 0);  /* slices of blocks */
    test_attention_case(32, 8, 128, 16, 3000, 2, VIEW_SLICES, 0);  /* 8 rows, slices of 16-key blocks */
    test_attention_case(8, 1, 64, 48, 2500, 1, VIEW_SPARSE, 0);    /* G = 8 at hd 64, B not a power of 2 */
    test_attention_case(32, 8, 128, 64, 1, 1, VIEW_ALL, 0);        /* one key */
    test_attention_case(8, 8, 128, 64, 4000, 1, VIEW_ALL, 0);      /* MHA: 1 row per KV head */
    test_attention_case(40, 40, 64, 64, 700, 1, VIEW_ALL, 0);     /* 40 KV heads: more than a decode's parameters take */
    test_attention_refs(32, 8, 128, 64, 5000, LENS_8, 40, 1, 2500, 4);        /* small refs, decode */
    test_attention_refs(32, 8, 128, 64, 5000, LENS_MIXED, 40, 2, 4990, 4);
    /* views the inline runs (runs, pdl) hold, at most 64 runs in all: one
     * run per head cut into equal chunk ranges across blocks (above: all,
     * window, long), and here several runs per head -- gaps of dropped
     * blocks, slices that join back into their block or leave a gap, a last
     * block of one row, the queries' positions cutting the view */
    test_attention_case(9, 3, 64, 64, 1000, 1, VIEW_SPARSE, 0);    /* <= 8 runs per head */
    test_attention_case(8, 2, 128, 64, 3000, 2, VIEW_SPARSE, 0);   /* 8 rows (GQA 4 x 2 tokens) */
    test_attention_case(8, 2, 64, 32, 400, 1, VIEW_SLICES, 0);     /* slices joined / cut */
    test_attention_case(8, 1, 64, 48, 1000, 1, VIEW_SPARSE, 0);    /* G 8: chunks of 16 in 48-row blocks */
    test_attention_case(9, 3, 64, 64, 4097, 1, VIEW_WINDOW, 0);    /* window; last block one row */
    test_attention_case(8, 2, 128, 64, 2000, 2, VIEW_WINDOW, 0);   /* 2 tokens, window */

    /* what the kernels cannot do is refused */
    struct tkv_kv_head_view v = {0};
    float dummy[20];
    struct tkv_attn_args bad = {.q = dummy, .q_pos = (int32_t[]){0}, .out = dummy, .n_q = 1, .n_head = 1,
                                .n_head_kv = 1, .head_dim = 20, .scale = 1, .kv = &v};
    CHECK(gpu->ops->attention(gpu, &bad) == TKV_ERR_UNSUPPORTED, "head_dim 20 accepted");
    for (int i = 0; i < N_ATTN_ALT; i++) {
        if (gpu_attn_alt[i])
            gpu_attn_alt[i]->ops->free(gpu_attn_alt[i]);
        gpu_attn_alt[i] = NULL;
    }
    for (int i = 0; i < N_PF_VAR_BE; i++) {
        if (gpu_pf_var[i])
            gpu_pf_var[i]->ops->free(gpu_pf_var[i]);
        gpu_pf_var[i] = NULL;
    }
}

/* ---- attention statistics (attn_stats): the policies' scores ------------------------------ */

/* Keys of Hkv heads for positions [0, n) in blocks of B (the last partial),
 * on the host and the device. Random in [-1, 1); 8-token blocks j with
 * j % 5 == 2 scaled by `hot`; head 0's first 8 keys a sink of size `sink`
 * along sign(dir) (peaked and near-one-hot block distributions). */
struct stats_kv {
    uint32_t nb;
    uint16_t *host, *dev;
    struct tkv_kv_block_ref *hrefs, *drefs;
    struct tkv_kv_head_view *hviews, *dviews;
};

static void stats_kv_make(struct stats_kv *f, uint32_t Hkv, uint32_t hd, uint32_t B, uint32_t n, float hot,
                          float sink, const float *dir)
{
    f->nb = (n + B - 1) / B;
    const size_t per_head = (size_t)f->nb * B * hd;
    f->host = malloc(Hkv * per_head * 2);
    for (uint32_t g = 0; g < Hkv; g++)
        for (uint32_t p = 0; p < f->nb * B; p++)
            for (uint32_t c = 0; c < hd; c++) {
                float x = test_rand_f32(&rng, -1, 1);
                if ((p / 8) % 5 == 2)
                    x *= hot;
                if (g == 0 && sink != 0 && p < 8)
                    x = dir[c] >= 0 ? sink : -sink;
                f->host[g * per_head + (size_t)p * hd + c] = tkv_fp32_to_fp16(x);
            }
    f->dev = dev_from(f->host, Hkv * per_head * 2);
    f->hrefs = calloc((size_t)Hkv * f->nb, sizeof *f->hrefs);
    f->drefs = calloc((size_t)Hkv * f->nb, sizeof *f->drefs);
    f->hviews = calloc(Hkv, sizeof *f->hviews);
    f->dviews = calloc(Hkv, sizeof *f->dviews);
    for (uint32_t g = 0; g < Hkv; g++) {
        for (uint32_t b = 0; b < f->nb; b++) {
            const size_t o = g * per_head + (size_t)b * B * hd;
            const uint32_t rows = TKV_MIN(B, n - b * B);
            f->hrefs[(size_t)g * f->nb + b] =
                (struct tkv_kv_block_ref){.k = f->host + o, .pos0 = (int32_t)(b * B), .n = rows};
            f->drefs[(size_t)g * f->nb + b] =
                (struct tkv_kv_block_ref){.k = f->dev + o, .pos0 = (int32_t)(b * B), .n = rows};
        }
        f->hviews[g] = (struct tkv_kv_head_view){.blocks = f->hrefs + (size_t)g * f->nb, .n_blocks = f->nb};
        f->dviews[g] = (struct tkv_kv_head_view){.blocks = f->drefs + (size_t)g * f->nb, .n_blocks = f->nb};
    }
}

static void stats_kv_free(struct stats_kv *f)
{
    dev_free(f->dev);
    free(f->host), free(f->hrefs), free(f->drefs), free(f->hviews), free(f->dviews);
}

/* Queries [n_q][H*hd]: a per-(head, dim) bias in [-1, 1) plus noise. */
static float *stats_queries(uint32_t n_q, uint32_t H, uint32_t hd, float noise, float *bias)
{
    float *q = malloc((size_t)n_q * H * hd * sizeof *q);
    for (uint32_t j = 0; j < H * hd; j++)
        bias[j] = test_rand_f32(&rng, -1, 1);
    for (uint32_t t = 0; t < n_q; t++)
        for (uint32_t j = 0; j < H * hd; j++)
            q[(size_t)t * H * hd + j] = bias[j] + test_rand_f32(&rng, -noise, noise);
    return q;
}

/* Worst |gpu - cpu| / (rel |cpu| + abs) over n (> 1 fails); counts the
 * bit-identical elements. NaN anywhere fails. */
static double stats_err(const float *gpu_v, const float *cpu_v, size_t n, double rel, double abs, size_t *same)
{
    double e = 0;
    for (size_t i = 0; i < n; i++) {
        if (isnan(gpu_v[i]) || isnan(cpu_v[i]))
            return INFINITY;
        *same += memcmp(&gpu_v[i], &cpu_v[i], sizeof(float)) == 0;
        const double d = fabs((double)gpu_v[i] - cpu_v[i]) / (rel * fabs((double)cpu_v[i]) + abs);
        e = d > e ? d : e;
    }
    return e;
}

static double seconds_per_call(const struct tkv_attn_stats_args *a, int reps)
{
    const double t0 = tkv_now_seconds();
    for (int i = 0; i < reps; i++)
        CHECK(gpu->ops->attn_stats(gpu, a) == TKV_OK, "%s", tkv_last_error());
    return (tkv_now_seconds() - t0) / reps;
}

/* SEGMENT: P within 1e-5 relative, H within 1e-6 + 1e-5 H (docs/gpu.md). */
static void test_stats_segment(uint32_t H, uint32_t Hkv, uint32_t hd, uint32_t B, uint32_t seg_start, uint32_t n_q,
                               uint32_t block, float hot, float sink, bool q_host, bool timed)
{
    const uint32_t n_past = seg_start + n_q, nb = seg_start / block, stride = nb + 1;
    float *bias = malloc((size_t)H * hd * sizeof *bias);
    float *q = stats_queries(n_q, H, hd, 0.3f, bias);
    struct stats_kv f;
    stats_kv_make(&f, Hkv, hd, B, n_past, hot, sink, bias);
    float *pc = malloc((size_t)Hkv * stride * sizeof *pc), *pg = malloc((size_t)Hkv * stride * sizeof *pg);
    double *hc = malloc(Hkv * sizeof *hc), *hg = malloc(Hkv * sizeof *hg);
    for (size_t i = 0; i < (size_t)Hkv * stride; i++)
        pc[i] = pg[i] = NAN;
    for (uint32_t g = 0; g < Hkv; g++)
        hg[g] = NAN;
    struct tkv_attn_stats_args a = {.kind = TKV_ATTN_STATS_SEGMENT, .q = q, .n_q = n_q, .n_head = H, .n_head_kv = Hkv,
                                    .head_dim = hd, .n_past = n_past, .kv = f.hviews, .block = block, .probs = pc,
                                    .probs_stride = stride, .entropy = hc};
    const double t_cpu = tkv_now_seconds();
    CHECK(cpu->ops->attn_stats(cpu, &a) == TKV_OK, "%s", tkv_last_error());
    const double cpu_s = tkv_now_seconds() - t_cpu;
    float *dq = dev_from(q, (size_t)n_q * H * hd * sizeof *q);
    a.q = q_host ? q : dq;
    a.q_host = q_host;
    a.kv = f.dviews;
    a.probs = pg;
    a.entropy = hg;
    CHECK(gpu->ops->attn_stats(gpu, &a) == TKV_OK, "%s", tkv_last_error());
    double ep = 0, eh = 0, h_lo = INFINITY, h_hi = -INFINITY;
    size_t same = 0, same_h = 0;
    bool untouched = true;
    for (uint32_t g = 0; g < Hkv; g++) {
        const double e = stats_err(pg + (size_t)g * stride, pc + (size_t)g * stride, nb, 1e-5, 1e-30, &same);
        ep = e > ep ? e : ep;
        const double d = fabs(hg[g] - hc[g]) / (1e-6 + 1e-5 * fabs(hc[g]));
        eh = !(d <= eh) ? (isnan(d) ? INFINITY : d) : eh;
        same_h += hg[g] == hc[g];
        untouched &= isnan(pg[(size_t)g * stride + nb]);
        h_lo = hc[g] < h_lo ? hc[g] : h_lo;
        h_hi = hc[g] > h_hi ? hc[g] : h_hi;
    }
    char timing[96] = "";
    if (timed) {
        a.probs = NULL;
        snprintf(timing, sizeof timing, "  %.3f ms/call (cpu backend %.1f ms)", 1e3 * seconds_per_call(&a, 5),
                 1e3 * cpu_s);
    }
    fprintf(stderr,
            "  segment H=%-2u Hkv=%-2u hd=%-3u B=%-3u block=%-2u start=%-5u n_q=%-3u%s H in [%.1e, %.2f]  "
            "err/tol P %.2f H %.2f  identical P %zu/%zu H %zu/%u%s\n",
            H, Hkv, hd, B, block, seg_start, n_q, q_host ? " (q host)" : "", h_lo, h_hi, ep, eh, same,
            (size_t)Hkv * nb, same_h, Hkv, timing);
    CHECK(ep <= 1 && eh <= 1, "segment H=%u Hkv=%u hd=%u B=%u block=%u: P err/tol %.3g, H err/tol %.3g", H, Hkv, hd, B,
          block, ep, eh);
    CHECK(untouched, "segment: the GPU wrote past n_blocks in a probs row");
    dev_free(dq);
    free(bias), free(q), free(pc), free(pg), free(hc), free(hg);
    stats_kv_free(&f);
}

/* WINDOW: scores within 1e-5 relative (docs/gpu.md). */
static void test_stats_window(uint32_t H, uint32_t Hkv, uint32_t hd, uint32_t B, uint32_t n_past, uint32_t extra,
                              uint32_t W, uint32_t n_prefix, uint32_t pool, char kind, bool q_host, bool timed)
{
    float *bias = malloc((size_t)H * hd * sizeof *bias);
    float *q = stats_queries(W, H, hd, 1.0f, bias);
    int32_t *pos = malloc(W * sizeof *pos);
    for (uint32_t t = 0; t < W; t++)
        pos[t] = (int32_t)(n_past - W + t);
    struct stats_kv f; /* `extra` keys past n_past in the view (a decode step's own) */
    stats_kv_make(&f, Hkv, hd, B, n_past + extra, 3.0f, 0, NULL);
    const size_t n_out = (size_t)Hkv * n_prefix;
    float *sc = malloc(n_out * sizeof *sc), *sg = malloc(n_out * sizeof *sg);
    for (size_t i = 0; i < n_out; i++)
        sg[i] = NAN;
    struct tkv_attn_stats_args a = {.kind = TKV_ATTN_STATS_WINDOW, .q = q, .q_pos = pos, .n_q = W, .n_head = H,
                                    .n_head_kv = Hkv, .head_dim = hd, .n_past = n_past, .kv = f.hviews,
                                    .n_prefix = n_prefix, .pool = pool, .pool_kind = kind, .scores = sc};
    const double t_cpu = tkv_now_seconds();
    CHECK(cpu->ops->attn_stats(cpu, &a) == TKV_OK, "%s", tkv_last_error());
    const double cpu_s = tkv_now_seconds() - t_cpu;
    float *dq = dev_from(q, (size_t)W * H * hd * sizeof *q);
    a.q = q_host ? q : dq;
    a.q_host = q_host;
    a.kv = f.dviews;
    a.scores = sg;
    CHECK(gpu->ops->attn_stats(gpu, &a) == TKV_OK, "%s", tkv_last_error());
    size_t same = 0;
    const double e = stats_err(sg, sc, n_out, 1e-5, 1e-30, &same);
    /* what the policy does with them: the top eighth of positions per head */
    const uint32_t k = TKV_MAX(n_prefix / 8, 1u);
    uint32_t *ic = malloc(k * sizeof *ic), *ig = malloc(k * sizeof *ig);
    bool same_sel = true;
    for (uint32_t g = 0; g < Hkv; g++) {
        const uint32_t kc = tkv_policy_top_k(sc + (size_t)g * n_prefix, n_prefix, k, ic);
        const uint32_t kg = tkv_policy_top_k(sg + (size_t)g * n_prefix, n_prefix, k, ig);
        same_sel &= kc == kg && memcmp(ic, ig, kc * sizeof *ic) == 0;
    }
    char timing[96] = "";
    if (timed)
        snprintf(timing, sizeof timing, "  %.3f ms/call (cpu backend %.1f ms)", 1e3 * seconds_per_call(&a, 5),
                 1e3 * cpu_s);
    fprintf(stderr,
            "  window  H=%-2u Hkv=%-2u hd=%-3u B=%-3u n_past=%-5u(+%u) W=%-2u n_prefix=%-5u pool %c%u%s  "
            "err/tol %.2f  identical %zu/%zu  top-1/8 same: %s%s\n",
            H, Hkv, hd, B, n_past, extra, W, n_prefix, pool > 1 ? kind : '-', pool, q_host ? " (q host)" : "", e,
            same, n_out, same_sel ? "yes" : "no", timing);
    CHECK(e <= 1, "window H=%u Hkv=%u hd=%u B=%u n_past=%u: err/tol %.3g", H, Hkv, hd, B, n_past, e);
    dev_free(dq);
    free(bias), free(q), free(pos), free(sc), free(sg), free(ic), free(ig);
    stats_kv_free(&f);
}

static void test_stats(void)
{
    REQUIRE_VOID(gpu->ops->attn_stats && cpu->ops->attn_stats);
    fprintf(stderr, "attention statistics, segment (EntropyInfer block 8, CritiPrefill block 32):\n");
    test_stats_segment(9, 3, 64, 64, 1024, 512, 8, 3.0f, 6.0f, false, false);      /* SmolLM2, a sink head */
    test_stats_segment(32, 8, 128, 64, 4096, 512, 8, 3.0f, 8.0f, false, false);    /* Llama-3 8B */
    test_stats_segment(8, 2, 128, 20, 600, 300, 8, 1.0f, 0, true, false);          /* key blocks straddle B = 20 */
    test_stats_segment(4, 4, 64, 32, 1536, 512, 32, 4.0f, 8.0f, false, false);     /* MHA, block 32 */
    test_stats_segment(8, 1, 64, 12, 333, 77, 8, 2.0f, 0, true, false);            /* MQA, partial last block */
    test_stats_segment(6, 2, 128, 4, 100, 20, 8, 2.0f, 0, false, false);           /* blocks of 4 < a key block */
    test_stats_segment(64, 1, 128, 64, 2048, 256, 8, 2.0f, 0, false, false);       /* 64 query heads per KV head */
    test_stats_segment(32, 8, 128, 64, 32768, 512, 8, 3.0f, 8.0f, false, true);    /* 32K context */
    fprintf(stderr, "attention statistics, window (SnapKV max 7, EntropyInfer avg 5):\n");
    test_stats_window(9, 3, 64, 64, 1500, 0, 32, 1468, 7, 'm', false, false);
    test_stats_window(32, 8, 128, 64, 8192, 0, 32, 8160, 7, 'm', false, false);
    test_stats_window(8, 2, 128, 32, 777, 1, 32, 745, 5, 'a', true, false);        /* one key past n_past in the view */
    test_stats_window(4, 4, 64, 20, 300, 0, 32, 268, 0, 'm', true, false);         /* no pooling, partial blocks */
    test_stats_window(16, 2, 64, 64, 2000, 0, 16, 1984, 7, 'm', false, false);
    test_stats_window(8, 8, 128, 8, 100, 0, 32, 68, 7, 'm', false, false);
    test_stats_window(64, 1, 64, 64, 1000, 0, 32, 968, 7, 'm', true, false);       /* 2048 rows per KV head */
    test_stats_window(9, 3, 64, 16, 64, 0, 32, 32, 7, 'm', false, false);          /* causal within the window */
    test_stats_window(9, 3, 64, 64, 40, 0, 32, 3, 7, 'm', false, false);           /* fewer positions than the kernel */
    test_stats_window(32, 8, 128, 64, 32768, 0, 32, 32736, 7, 'm', false, true);   /* 32K context */

    /* what the kernels cannot do is refused; empty cases */
    struct stats_kv f;
    stats_kv_make(&f, 1, 300, 16, 20, 1.0f, 0, NULL);
    float *dq = dev_poisoned(300), out[20];
    int32_t pos[1] = {19};
    struct tkv_attn_stats_args a = {.kind = TKV_ATTN_STATS_WINDOW, .q = dq, .q_pos = pos, .n_q = 1, .n_head = 1,
                                    .n_head_kv = 1, .head_dim = 300, .n_past = 20, .kv = f.dviews, .n_prefix = 20,
                                    .scores = out};
    CHECK(gpu->ops->attn_stats(gpu, &a) == TKV_ERR_UNSUPPORTED, "head_dim 300 accepted");
    a.head_dim = 64; /* (the keys' rows are 300 apart: only n_q = 0 is run) */
    a.n_q = 0;
    for (int i = 0; i < 20; i++)
        out[i] = NAN;
    CHECK(gpu->ops->attn_stats(gpu, &a) == TKV_OK && out[0] == 0 && out[19] == 0, "no queries: scores not 0");
    a.kind = TKV_ATTN_STATS_SEGMENT;
    a.n_q = 1;
    a.n_past = 5;
    a.block = 8;
    double h = 7;
    a.entropy = &h;
    CHECK(gpu->ops->attn_stats(gpu, &a) == TKV_OK && h == 0, "segment without blocks: H %g", h);
    a.kind = 0;
    CHECK(gpu->ops->attn_stats(gpu, &a) == TKV_ERR_INVALID_ARG, "kind 0 accepted");
    CHECK(gpu->ops->synchronize(gpu) == TKV_OK, "%s", tkv_last_error());
    dev_free(dq);
    stats_kv_free(&f);
}

/* ---- fused decode ops: each against the plain op sequence on the GPU ------------ */

/* matmul_group of weights of one type against its reference (defined with
 * the quantized references, below). */
static void test_group_case(uint32_t type, uint32_t n_in, const uint32_t *n_out, uint32_t nw, uint32_t n);

/* matmul_swiglu against matmul, matmul, swiglu on the same backend and the
 * double reference silu(g) * u. */
static void test_swiglu_case(uint32_t n_in, uint32_t n_ff, uint32_t n)
{
    struct test_weight tg, tu;
    weight_make(&tg, TKV_TYPE_F16, n_in, n_ff, 2);
    weight_make(&tu, TKV_TYPE_F16, n_in, n_ff, 2);
    struct tkv_bweight *wg = NULL, *wu = NULL;
    CHECK(gpu->ops->weight_init(gpu, &tg.t, &wg) == TKV_OK, "%s", tkv_last_error());
    CHECK(gpu->ops->weight_init(gpu, &tu.t, &wu) == TKV_OK, "%s", tkv_last_error());
    const size_t nx = (size_t)n * n_in, ny = (size_t)n * n_ff;
    float *x = malloc(nx * sizeof *x), *yf = malloc(ny * sizeof *yf), *ys = malloc(ny * sizeof *ys);
    double *ref = malloc(ny * sizeof *ref);
    fill(x, nx, -0.2f, 0.2f); /* gate sums of O(1): silu's curved part */
    float *dx = dev_from(x, nx * sizeof *x), *dout = dev_poisoned(ny), *dg = dev_poisoned(ny), *du = dev_poisoned(ny);
    CHECK(gpu->ops->matmul_swiglu(gpu, wg, wu, dx, dout, n) == TKV_OK, "%s", tkv_last_error());
    CHECK(gpu->ops->matmul(gpu, wg, dx, dg, n) == TKV_OK, "%s", tkv_last_error());
    CHECK(gpu->ops->matmul(gpu, wu, dx, du, n) == TKV_OK, "%s", tkv_last_error());
    CHECK(gpu->ops->swiglu(gpu, dg, du, dg, ny) == TKV_OK, "%s", tkv_last_error());
    to_host(yf, dout, ny * sizeof *yf);
    to_host(ys, dg, ny * sizeof *ys);
    for (uint32_t t = 0; t < n; t++)
        for (uint32_t r = 0; r < n_ff; r++) {
            double g = 0, u = 0;
            for (uint32_t k = 0; k < n_in; k++) {
                g += (double)tg.deq[(size_t)r * n_in + k] * x[(size_t)t * n_in + k];
                u += (double)tu.deq[(size_t)r * n_in + k] * x[(size_t)t * n_in + k];
            }
            ref[(size_t)t * n_ff + r] = g / (1.0 + exp(-g)) * u;
        }
    size_t same = 0, bad = 0;
    for (size_t j = 0; j < ny; j++) {
        same += !memcmp(&yf[j], &ys[j], sizeof *yf);
        bad += !(fabs((double)yf[j] - ys[j]) <= 1e-5 * fmax(1.0, fabs(ys[j])));
    }
    const double e_seq = rel_l2f(yf, ys, ny), e_ref = rel_l2(yf, ref, ny);
    fprintf(stderr, "  matmul_swiglu %ux%u n=%u: vs matmul+matmul+swiglu rel %.2e (%zu of %zu bit-identical), "
                    "vs double %.2e\n", n_ff, n_in, n, e_seq, same, ny, e_ref);
    CHECK(bad == 0 && e_seq < 1e-6, "matmul_swiglu %ux%u n=%u: %zu elements beyond 1e-5, rel %.3g", n_ff, n_in, n,
          bad, e_seq);
    CHECK(e_ref < 2e-3, "matmul_swiglu %ux%u n=%u: rel err %.3g vs double", n_ff, n_in, n, e_ref);
    dev_free(dx), dev_free(dout), dev_free(dg), dev_free(du);
    gpu->ops->weight_free(gpu, wg);
    gpu->ops->weight_free(gpu, wu);
    free(x), free(yf), free(ys), free(ref);
    weight_free(&tg);
    weight_free(&tu);
}

/* add_rmsnorm (h aliasing x, as the engine calls it) against add + rmsnorm
 * on the GPU and on the CPU. */
static void test_add_rmsnorm_case(uint32_t dim, uint32_t n)
{
    struct tkv_gguf_tensor t;
    float *g = malloc(dim * sizeof *g);
    fill(g, dim, 0.5f, 1.5f);
    memset(&t, 0, sizeof t);
    snprintf(t.name, sizeof t.name, "test.norm.%u", dim);
    t.n_dims = 1;
    t.ne[0] = dim;
    t.ne[1] = t.ne[2] = t.ne[3] = 1;
    t.type = TKV_TYPE_F32;
    t.n_elems = dim;
    t.nbytes = dim * sizeof(float);
    t.data = g;
    struct tkv_bweight *wc = NULL, *wg = NULL;
    CHECK(cpu->ops->weight_init(cpu, &t, &wc) == TKV_OK, "%s", tkv_last_error());
    CHECK(gpu->ops->weight_init(gpu, &t, &wg) == TKV_OK, "%s", tkv_last_error());
    const size_t cnt = (size_t)n * dim;
    float *y = malloc(cnt * sizeof *y), *x = malloc(cnt * sizeof *x), *hc = malloc(cnt * sizeof *hc);
    float *yf = malloc(cnt * sizeof *yf), *hf = malloc(cnt * sizeof *hf), *ys = malloc(cnt * sizeof *ys);
    float *hs = malloc(cnt * sizeof *hs);
    fill(y, cnt, -3, 3);
    fill(x, cnt, -3, 3);
    float *dyf = dev_from(y, cnt * sizeof *y), *dxf = dev_from(x, cnt * sizeof *x);
    float *dys = dev_from(y, cnt * sizeof *y), *dxs = dev_from(x, cnt * sizeof *x), *dhs = dev_poisoned(cnt);
    CHECK(gpu->ops->add_rmsnorm(gpu, dyf, dxf, wg, dxf, n, dim, 1e-5f) == TKV_OK, "%s", tkv_last_error());
    CHECK(gpu->ops->add(gpu, dys, dxs, cnt) == TKV_OK, "%s", tkv_last_error());
    CHECK(gpu->ops->rmsnorm(gpu, dys, wg, dhs, n, dim, 1e-5f) == TKV_OK, "%s", tkv_last_error());
    CHECK(cpu->ops->add(cpu, y, x, cnt) == TKV_OK && cpu->ops->rmsnorm(cpu, y, wc, hc, n, dim, 1e-5f) == TKV_OK, "%s",
          tkv_last_error());
    to_host(yf, dyf, cnt * sizeof *yf);
    to_host(hf, dxf, cnt * sizeof *hf);
    to_host(ys, dys, cnt * sizeof *ys);
    to_host(hs, dhs, cnt * sizeof *hs);
    double e_seq = 0, e_cpu = 0, mx = 0;
    size_t same = 0;
    for (size_t i = 0; i < cnt; i++) {
        e_seq = isnan(hf[i]) ? INFINITY : fmax(e_seq, fabs(hf[i] - hs[i]));
        e_cpu = isnan(hf[i]) ? INFINITY : fmax(e_cpu, fabs(hf[i] - hc[i]));
        mx = fmax(mx, fabs(hc[i]));
        same += !memcmp(&hf[i], &hs[i], sizeof *hf);
    }
    fprintf(stderr, "  add_rmsnorm dim=%u n=%u: y %s; h vs add+rmsnorm max %.2e (%zu of %zu bit-identical), vs cpu "
                    "%.2e (max |h| %.2f)\n", dim, n, memcmp(yf, ys, cnt * sizeof *yf) ? "DIFFERS" : "equal", e_seq,
            same, cnt, e_cpu, mx);
    CHECK(!memcmp(yf, ys, cnt * sizeof *yf) && !memcmp(yf, y, cnt * sizeof *yf), "add_rmsnorm dim %u: y != y + x",
          dim);
    CHECK(e_seq <= 1e-6 * mx, "add_rmsnorm dim %u: h differs from add+rmsnorm by %.3g", dim, e_seq);
    CHECK(e_cpu <= 1e-5 * mx, "add_rmsnorm dim %u: h differs from the cpu by %.3g", dim, e_cpu);
    CHECK(gpu->ops->add_rmsnorm(gpu, dyf, dxf, wg, dxf, n, dim + 1, 1e-5f) == TKV_ERR_INVALID_ARG,
          "add_rmsnorm: bad dim accepted");
    dev_free(dyf), dev_free(dxf), dev_free(dys), dev_free(dxs), dev_free(dhs);
    cpu->ops->weight_free(cpu, wc);
    gpu->ops->weight_free(gpu, wg);
    free(g), free(y), free(x), free(hc), free(yf), free(hf), free(ys), free(hs);
}

/* rope_qk at pos0.. against two rope calls on the GPU and the CPU's rope. */
static void rope_qk_case(uint32_t n, uint32_t hq, uint32_t hk, uint32_t hd, uint32_t rot, float base, float fs,
                         int32_t pos0)
{
    const size_t cq = (size_t)n * hq * hd, ck = (size_t)n * hk * hd;
    float *q = malloc(cq * sizeof *q), *k = malloc(ck * sizeof *k);
    float *qf = malloc(cq * sizeof *qf), *kf = malloc(ck * sizeof *kf), *qs = malloc(cq * sizeof *qs);
    float *ks = malloc(ck * sizeof *ks);
    int32_t *pos = malloc(n * sizeof *pos);
    fill(q, cq, -1, 1);
    fill(k, ck, -1, 1);
    for (uint32_t t = 0; t < n; t++)
        pos[t] = pos0 + (int32_t)t;
    float *dqf = dev_from(q, cq * sizeof *q), *dkf = dev_from(k, ck * sizeof *k);
    float *dqs = dev_from(q, cq * sizeof *q), *dks = dev_from(k, ck * sizeof *k);
    CHECK(gpu->ops->rope_qk(gpu, dqf, dkf, n, hq, hk, hd, rot, pos, base, fs) == TKV_OK, "%s", tkv_last_error());
    for (uint32_t t = 0; t < n; t++) /* the op must have taken its copy of the positions */
        pos[t] = -7;
    CHECK(gpu->ops->synchronize(gpu) == TKV_OK, "%s", tkv_last_error());
    for (uint32_t t = 0; t < n; t++)
        pos[t] = pos0 + (int32_t)t;
    CHECK(gpu->ops->rope(gpu, dqs, n, hq, hd, rot, pos, base, fs) == TKV_OK, "%s", tkv_last_error());
    CHECK(gpu->ops->rope(gpu, dks, n, hk, hd, rot, pos, base, fs) == TKV_OK, "%s", tkv_last_error());
    CHECK(cpu->ops->rope(cpu, q, n, hq, hd, rot, pos, base, fs) == TKV_OK, "%s", tkv_last_error());
    CHECK(cpu->ops->rope(cpu, k, n, hk, hd, rot, pos, base, fs) == TKV_OK, "%s", tkv_last_error());
    to_host(qf, dqf, cq * sizeof *qf);
    to_host(kf, dkf, ck * sizeof *kf);
    to_host(qs, dqs, cq * sizeof *qs);
    to_host(ks, dks, ck * sizeof *ks);
    const bool same = !memcmp(qf, qs, cq * sizeof *qf) && !memcmp(kf, ks, ck * sizeof *kf);
    double e_cpu = 0;
    for (size_t i = 0; i < cq; i++)
        e_cpu = isnan(qf[i]) ? INFINITY : fmax(e_cpu, fabs(qf[i] - q[i]));
    for (size_t i = 0; i < ck; i++)
        e_cpu = isnan(kf[i]) ? INFINITY : fmax(e_cpu, fabs(kf[i] - k[i]));
    fprintf(stderr, "  rope_qk n=%u heads %u/%u hd=%u rot=%u pos %d..: %s two rope calls, max |gpu-cpu| %.2e\n", n, hq,
            hk, hd, rot, pos0, same ? "bit-identical to" : "DIFFERS from", e_cpu);
    CHECK(same, "rope_qk n=%u pos %d: differs from two rope calls", n, pos0);
    CHECK(e_cpu <= 1e-5, "rope_qk n=%u pos %d: err %.3g vs cpu", n, pos0, e_cpu);
    dev_free(dqf), dev_free(dkf), dev_free(dqs), dev_free(dks);
    free(q), free(k), free(qf), free(kf), free(qs), free(ks), free(pos);
}

static void test_fused(void)
{
    fprintf(stderr, "fused decode ops:\n");
    REQUIRE_VOID(gpu->ops->matmul_group && gpu->ops->matmul_swiglu && gpu->ops->add_rmsnorm && gpu->ops->rope_qk);
    const uint32_t qkv8b[3] = {4096, 1024, 1024}, qkv_smol[3] = {576, 192, 192};
    const uint32_t mixed[5] = {33, 1001, 8, 2048, 100};
    const uint32_t ns[] = {1, 3, 8};
    for (size_t i = 0; i < 3; i++)
        test_group_case(TKV_TYPE_F16, 4096, qkv8b, 3, ns[i]);
    test_group_case(TKV_TYPE_F16, 576, qkv_smol, 3, 1);
    test_group_case(TKV_TYPE_F16, 4104, mixed, 5, 2); /* rows straddling weights inside a CTA, n_in % 256 != 0 */
    const uint32_t few[3] = {64, 32, 100}, two[2] = {200, 300};
    test_group_case(TKV_TYPE_F16, 8192, few, 3, 1); /* 4 warps per row */
    test_group_case(TKV_TYPE_F16, 8192, few, 3, 5);
    test_group_case(TKV_TYPE_F16, 4096, two, 2, 4); /* 2 warps per row */
    test_group_case(TKV_TYPE_F16, 576, qkv_smol, 3, 9); /* n > 8: the matmuls (cuBLAS) */
    test_group_case(TKV_TYPE_F16, 576, qkv_smol, 1, 1);
    test_swiglu_case(4096, 14336, 1);
    test_swiglu_case(4096, 1024, 3);  /* 2 warps per row */
    test_swiglu_case(8192, 256, 2);   /* 4 warps per row */
    test_swiglu_case(576, 1536, 8);
    test_swiglu_case(576, 1536, 9); /* n > 8: the sequence through the work buffer */
    test_add_rmsnorm_case(4096, 1);
    test_add_rmsnorm_case(576, 7);
    test_add_rmsnorm_case(1000, 3);
    /* the positions are uploaded again only when they change: alternate
     * positions, then a longer chunk (the device buffer grows), then back */
    rope_qk_case(1, 32, 8, 128, 128, 500000.0f, 1.0f, 4096);
    rope_qk_case(1, 32, 8, 128, 128, 500000.0f, 1.0f, 4096);
    rope_qk_case(1, 32, 8, 128, 128, 500000.0f, 1.0f, 4097);
    rope_qk_case(300, 9, 3, 64, 64, 100000.0f, 1.0f, 17);
    rope_qk_case(5, 8, 2, 128, 64, 10000.0f, 0.25f, 1 << 20);
    rope_qk_case(1, 32, 8, 128, 128, 500000.0f, 1.0f, 4096);
    CHECK(gpu->ops->rope_qk(gpu, NULL, NULL, 1, 1, 1, 64, 65, (int32_t[]){0}, 1e4f, 1.0f) == TKV_ERR_INVALID_ARG,
          "rope_qk: odd rope dimension accepted");
    /* the CPU backend has none of them: the engine runs the sequence there */
    CHECK(!cpu->ops->matmul_group && !cpu->ops->matmul_swiglu && !cpu->ops->add_rmsnorm && !cpu->ops->rope_qk,
          "the cpu backend has fused ops");
}

/* ---- the quantized decode GEMV (Q4_0 / Q4_1 / Q8_0 weights, n <= 8) ------------------
 *
 * gpu_q runs the defaults (quantized GEMV, TKV_CUDA_GEMV=auto, PDL; rows in
 * pairs for calls of 16 MiB or more), gpu_q_pair TKV_CUDA_GEMV_QUANT=pair
 * (two rows per lane set wherever every weight's row count is even),
 * gpu_q_single =single (one row per lane set), gpu_q_ref =ref (the
 * reference kernel). The CPU reference
 * is the CPU backend's own decode arithmetic: tkv_quantize_act_ref of each
 * token row, tkv_vec_dot_ref of each weight row. Both sides sum exact
 * integer block sums, so a result may differ from it only by the order of
 * the float block terms: |gpu - ref| <= 2 (blocks + 8) 2^-24 sum |terms|
 * (cpu/quant.h's bound). An f16 path, a dropped Q4_0 offset of 8 or a
 * dropped Q4_1 m * s term misses it by orders of magnitude. */

/* sum over the row's blocks of |each float term| of tkv_vec_dot_ref */
static double qterms_abs(uint32_t type, const void *w, const void *act, uint32_t n_in)
{
    double s = 0;
    for (uint32_t b = 0; b < n_in / 32; b++) {
        int isum = 0;
        double term, extra = 0;
        if (type == TKV_TYPE_Q4_0) {
            const tkv_block_q4_0 *x = (const tkv_block_q4_0 *)w + b;
            const tkv_block_q8_0 *y = (const tkv_block_q8_0 *)act + b;
            for (int j = 0; j < 16; j++)
                isum += ((x->qs[j] & 15) - 8) * y->qs[j] + ((x->qs[j] >> 4) - 8) * y->qs[j + 16];
            term = (double)tkv_fp16_to_fp32(x->d) * tkv_fp16_to_fp32(y->d) * isum;
        } else if (type == TKV_TYPE_Q4_1) {
            const tkv_block_q4_1 *x = (const tkv_block_q4_1 *)w + b;
            const tkv_block_q8_1 *y = (const tkv_block_q8_1 *)act + b;
            for (int j = 0; j < 16; j++)
                isum += (x->qs[j] & 15) * y->qs[j] + (x->qs[j] >> 4) * y->qs[j + 16];
            term = (double)tkv_fp16_to_fp32(x->d) * tkv_fp16_to_fp32(y->d) * isum;
            extra = (double)tkv_fp16_to_fp32(x->m) * tkv_fp16_to_fp32(y->s);
        } else {
            const tkv_block_q8_0 *x = (const tkv_block_q8_0 *)w + b;
            const tkv_block_q8_0 *y = (const tkv_block_q8_0 *)act + b;
            for (int j = 0; j < 32; j++)
                isum += x->qs[j] * y->qs[j];
            term = (double)tkv_fp16_to_fp32(x->d) * tkv_fp16_to_fp32(y->d) * isum;
        }
        s += fabs(term) + fabs(extra);
    }
    return s;
}

/* The CPU reference of x [n][n_in] . w^T: ref[i][r] and its bound. */
static void qref(const struct test_weight *tw, const float *x, uint32_t n, float *ref, double *bound)
{
    const uint32_t type = tw->t.type, n_in = (uint32_t)tw->t.ne[0], n_out = (uint32_t)tw->t.ne[1];
    const size_t row = tw->t.nbytes / n_out, abytes = tkv_act_row_bytes(type, n_in);
    void *act = malloc(abytes);
    for (uint32_t i = 0; i < n; i++) {
        tkv_quantize_act_ref(type, x + (size_t)i * n_in, act, n_in);
        for (uint32_t r = 0; r < n_out; r++) {
            const uint8_t *wr = (const uint8_t *)tw->data + r * row;
            ref[(size_t)i * n_out + r] = tkv_vec_dot_ref(type, wr, act, n_in);
            bound[(size_t)i * n_out + r] = 2.0 * (n_in / 32 + 8) * 0x1p-24 * qterms_abs(type, wr, act, n_in);
        }
    }
    free(act);
}

/* Elements of got beyond ref +- bound (NaN counts); *worst: max |got - ref| / bound. */
static size_t qbeyond(const float *got, const float *ref, const double *bound, size_t count, double *worst)
{
    size_t bad = 0;
    *worst = 0;
    for (size_t j = 0; j < count; j++) {
        const double e = fabs((double)got[j] - ref[j]);
        if (!(e <= bound[j]))
            bad++;
        if (bound[j] > 0)
            *worst = fmax(*worst, e / bound[j]);
        else if (e > 0 || isnan(got[j]))
            *worst = INFINITY;
    }
    return bad;
}

static struct tkv_backend *gpu_q, *gpu_q_pair, *gpu_q_single, *gpu_q_ref; /* quantized GEMV, above */

/* Activation rows that stress the quantizer: [row % 6] random; zeros;
 * exact ties (x * id = m + 0.5: amax = 127 * 2^k gives d = 2^k, id = 2^-k)
 * and the float just below 0.5; large magnitudes (f16 d and s overflow to
 * Inf); tiny ones (f16 d subnormal or 0); a random scale per block. */
static void qact_fill(float *x, uint32_t n, uint32_t n_in)
{
    for (uint32_t i = 0; i < n; i++) {
        float *r = x + (size_t)i * n_in;
        for (uint32_t b = 0; b < n_in / 32; b++) {
            float *v = r + b * 32;
            const int k = (int)(test_rand_u64(&rng) % 21) - 10;
            const float scale = ldexpf(1.0f, k);
            for (int j = 0; j < 32; j++) {
                switch (i % 6) {
                case 0: v[j] = test_rand_f32(&rng, -1, 1); break;
                case 1: v[j] = 0.0f; break;
                case 2: {
                    const int m = (int)(test_rand_u64(&rng) % 253) - 126;
                    v[j] = j == 0 ? 127.0f * scale
                           : j == 1 ? 0.49999997f * scale
                           : j == 2 ? -0.5f * scale
                                    : ((float)m + (m < 0 ? -0.5f : 0.5f)) * scale;
                    break;
                }
                case 3: v[j] = test_rand_f32(&rng, -1, 1) * (b % 2 ? 1e30f : 3e6f); break;
                case 4: v[j] = test_rand_f32(&rng, -1, 1) * 1e-6f; break;
                default: v[j] = test_rand_f32(&rng, -1, 1) * ldexpf(1.0f, 4 * k); break;
                }
            }
        }
    }
}

static void test_q8_act_case(uint32_t wtype, uint32_t n, uint32_t n_in)
{
    const uint32_t nb = n_in / 32;
    const size_t bsz = wtype == TKV_TYPE_Q4_1 ? 36 : 34, bytes = (size_t)n * nb * bsz;
    float *x = malloc((size_t)n * n_in * sizeof *x);
    qact_fill(x, n, n_in);
    uint8_t *want = malloc(bytes), *got = malloc(bytes), *act = malloc(tkv_act_row_bytes(wtype, n_in));
    for (uint32_t i = 0; i < n; i++) {
        tkv_quantize_act_ref(wtype, x + (size_t)i * n_in, act, n_in);
        memcpy(want + (size_t)i * nb * bsz, act, nb * bsz); /* the llama.cpp blocks start the row */
    }
    float *dx = dev_from(x, (size_t)n * n_in * sizeof *x);
    uint8_t *dq = dev_alloc(bytes);
    settle(gpu);
    CHECK(tkv_backend_cuda_quantize_act(gpu_q, wtype, dx, n, n_in, dq) == TKV_OK, "%s", tkv_last_error());
    settle(gpu_q);
    to_host(got, dq, bytes);
    size_t bad = 0, first = SIZE_MAX;
    for (size_t b = 0; b < (size_t)n * nb; b++)
        if (memcmp(got + b * bsz, want + b * bsz, bsz)) {
            bad++;
            first = first == SIZE_MAX ? b : first;
        }
    fprintf(stderr, "  quantize %s rows n=%u x %u: %zu of %zu blocks differ from tkv_quantize_act_ref\n",
            wtype == TKV_TYPE_Q4_1 ? "Q8_1" : "Q8_0", n, n_in, bad, (size_t)n * nb);
    CHECK(bad == 0, "quantize_act %s n=%u x %u: %zu blocks differ, the first block %zu (row %zu: d %04x vs %04x)",
          tkv_type_name(wtype), n, n_in, bad, first, first / nb,
          bad ? (unsigned)(got[first * bsz] | got[first * bsz + 1] << 8) : 0u,
          bad ? (unsigned)(want[first * bsz] | want[first * bsz + 1] << 8) : 0u);
    dev_free(dx), dev_free(dq);
    free(x), free(want), free(got), free(act);
}

/* matmul on gpu_q, gpu_q_pair, gpu_q_single and gpu_q_ref against the CPU
 * reference; for Q4_0 (the packed kernel: each lane adds its blocks' terms
 * in order and the warp sums its lanes by an xor butterfly, as the
 * reference kernel does) also the first three against gpu_q_ref bit for
 * bit. */
static void test_qmatmul_case(uint32_t type, uint32_t n_in, uint32_t n_out, uint32_t n)
{
    struct test_weight tw;
    weight_make(&tw, type, n_in, n_out, 2);
    const size_t nx = (size_t)n * n_in, ny = (size_t)n * n_out;
    float *x = malloc(nx * sizeof *x), *ref = malloc(ny * sizeof *ref), *yg = malloc(ny * sizeof *yg);
    float *yb[3] = {malloc(ny * sizeof *yg), malloc(ny * sizeof *yg), malloc(ny * sizeof *yg)};
    double *bound = malloc(ny * sizeof *bound);
    fill(x, nx, -1, 1);
    if (n > 2) /* a zero row and a row of large values among the tokens */
        for (uint32_t k = 0; k < n_in; k++)
            x[k + n_in] = 0.0f, x[k + 2 * (size_t)n_in] *= 1000.0f;
    qref(&tw, x, n, ref, bound);
    float *dx = dev_from(x, nx * sizeof *x);
    struct tkv_backend *be[4] = {gpu_q, gpu_q_pair, gpu_q_single, gpu_q_ref};
    static const char *const name[4] = {"fast", "pair", "single", "ref"};
    fprintf(stderr, "  qmatmul %-5s %5ux%-5u n=%u:", tkv_type_name(type), n_in, n_out, n);
    for (int b = 0; b < 4; b++) {
        struct tkv_bweight *w = NULL;
        CHECK(be[b]->ops->weight_init(be[b], &tw.t, &w) == TKV_OK, "%s", tkv_last_error());
        if (!w)
            continue;
        float *dy = dev_poisoned(ny);
        settle(gpu);
        CHECK(be[b]->ops->matmul(be[b], w, dx, dy, n) == TKV_OK, "%s", tkv_last_error());
        CHECK(be[b]->ops->synchronize(be[b]) == TKV_OK, "%s", tkv_last_error());
        to_host(yg, dy, ny * sizeof *yg);
        double worst;
        const size_t bad = qbeyond(yg, ref, bound, ny, &worst);
        fprintf(stderr, " %s: worst |gpu-ref|/bound %.3f%s", name[b], worst, bad ? " FAIL" : "");
        CHECK(bad == 0, "qmatmul %s %ux%u n=%u (%s): %zu of %zu beyond the bound (worst %.3g x)", tkv_type_name(type),
              n_in, n_out, n, name[b], bad, ny, worst);
        if (b < 3)
            memcpy(yb[b], yg, ny * sizeof *yg);
        for (int f = 0; type == TKV_TYPE_Q4_0 && b == 3 && f < 3; f++)
            CHECK(!memcmp(yb[f], yg, ny * sizeof *yg), "qmatmul %s %ux%u n=%u: %s differs from the reference kernel",
                  tkv_type_name(type), n_in, n_out, n, name[f]);
        dev_free(dy);
        be[b]->ops->weight_free(be[b], w);
    }
    fprintf(stderr, "\n");
    dev_free(dx);
    free(x), free(ref), free(yg), free(yb[0]), free(yb[1]), free(yb[2]), free(bound);
    weight_free(&tw);
}

/* matmul_group of nw weights of type (n_in x n_out[i]), one output each,
 * against each weight's reference within its bound:
 *   f16 (on gpu): against nw matmul calls on the same backend (rel 1e-5)
 *       and the double product of the dequantized weights (rel 1e-3; 2e-3
 *       for n > 8, cuBLAS)
 *   Q4_0, Q4_1, Q8_0 (on gpu_q and on gpu_q_pair): element by element
 *       against the CPU reference, within its float reassociation bound
 *       (qref) */
static void group_case_on(struct tkv_backend *be, uint32_t type, uint32_t n_in, const uint32_t *n_out, uint32_t nw,
                          uint32_t n)
{
    const bool quant = type != TKV_TYPE_F16;
    struct test_weight tw[TKV_MATMUL_GROUP_MAX];
    struct tkv_bweight *wg[TKV_MATMUL_GROUP_MAX];
    float *dy[TKV_MATMUL_GROUP_MAX], *ds[TKV_MATMUL_GROUP_MAX]; /* ds: the matmuls' outputs (f16) */
    float *x = calloc((size_t)n * n_in, sizeof *x);
    fill(x, (size_t)n * n_in, -1, 1);
    float *dx = dev_from(x, (size_t)n * n_in * sizeof *x);
    uint32_t rows = 0;
    for (uint32_t i = 0; i < nw; i++) {
        weight_make(&tw[i], type, n_in, n_out[i], 2);
        wg[i] = NULL;
        CHECK(be->ops->weight_init(be, &tw[i].t, &wg[i]) == TKV_OK, "%s", tkv_last_error());
        dy[i] = dev_poisoned((size_t)n * n_out[i]);
        ds[i] = quant ? NULL : dev_poisoned((size_t)n * n_out[i]);
        rows += n_out[i];
    }
    if (be != gpu)
        settle(gpu);
    CHECK(be->ops->matmul_group(be, (const struct tkv_bweight *const *)wg, nw, dx, dy, n) == TKV_OK, "%s",
          tkv_last_error());
    for (uint32_t i = 0; i < nw && !quant; i++)
        CHECK(be->ops->matmul(be, wg[i], dx, ds[i], n) == TKV_OK, "%s", tkv_last_error());
    if (be != gpu)
        settle(be);

    double worst_seq = 0, worst_ref = 0; /* f16: rel ||.|| from the matmuls, from double */
    double worst_bound = 0;              /* quantized: max |gpu - ref| / bound */
    size_t same = 0, bad = 0, total = 0;
    for (uint32_t i = 0; i < nw; i++) {
        const size_t ny = (size_t)n * n_out[i];
        float *yg = malloc(ny * sizeof *yg);
        to_host(yg, dy[i], ny * sizeof *yg);
        if (quant) {
            float *ref = malloc(ny * sizeof *ref);
            double *bound = malloc(ny * sizeof *bound), w_i;
            qref(&tw[i], x, n, ref, bound);
            bad += qbeyond(yg, ref, bound, ny, &w_i);
            worst_bound = fmax(worst_bound, w_i);
            free(ref), free(bound);
        } else {
            float *ys = malloc(ny * sizeof *ys);
            double *ref = malloc(ny * sizeof *ref);
            to_host(ys, ds[i], ny * sizeof *ys);
            for (uint32_t t = 0; t < n; t++)
                for (uint32_t r = 0; r < n_out[i]; r++) {
                    double acc = 0;
                    for (uint32_t k = 0; k < n_in; k++)
                        acc += (double)tw[i].deq[(size_t)r * n_in + k] * x[(size_t)t * n_in + k];
                    ref[(size_t)t * n_out[i] + r] = acc;
                }
            for (size_t j = 0; j < ny; j++)
                same += !memcmp(&yg[j], &ys[j], sizeof *yg);
            worst_seq = fmax(worst_seq, rel_l2f(yg, ys, ny));
            worst_ref = fmax(worst_ref, rel_l2(yg, ref, ny));
            free(ys), free(ref);
            dev_free(ds[i]);
        }
        total += ny;
        free(yg);
        dev_free(dy[i]);
        be->ops->weight_free(be, wg[i]);
        weight_free(&tw[i]);
    }
    if (quant) {
        fprintf(stderr, "  qmatmul_group%s %-5s %u weights, %u rows x %u, n=%u: worst |gpu-ref|/bound %.3f\n",
                be == gpu_q_pair ? " (pair)" : "", tkv_type_name(type), nw, rows, n_in, n, worst_bound);
        CHECK(bad == 0, "qmatmul_group%s %s %ux%u n=%u: %zu of %zu beyond the bound",
              be == gpu_q_pair ? " (pair)" : "", tkv_type_name(type), rows, n_in, n, bad, total);
    } else {
        const double tol_ref = n <= 8 ? 1e-3 : 2e-3;
        fprintf(stderr, "  matmul_group %u weights, %u rows x %u, n=%u: vs matmuls rel %.2e (%zu of %zu "
                        "bit-identical), vs double %.2e\n", nw, rows, n_in, n, worst_seq, same, total, worst_ref);
        CHECK(worst_seq < 1e-5, "matmul_group %ux%u n=%u: rel diff %.3g from the matmuls", rows, n_in, n, worst_seq);
        CHECK(worst_ref < tol_ref, "matmul_group %ux%u n=%u: rel err %.3g", rows, n_in, n, worst_ref);
    }
    dev_free(dx);
    free(x);
}

static void test_group_case(uint32_t type, uint32_t n_in, const uint32_t *n_out, uint32_t nw, uint32_t n)
{
    if (type == TKV_TYPE_F16) {
        group_case_on(gpu, type, n_in, n_out, nw, n);
        return;
    }
    group_case_on(gpu_q, type, n_in, n_out, nw, n);
    group_case_on(gpu_q_pair, type, n_in, n_out, nw, n);
}

/* matmul_swiglu on gpu_q against silu(g) * u of the CPU references (bounds
 * carried through silu's slope, <= 1.1, and the product) and against
 * matmul + matmul + swiglu on gpu_q. */
static void test_qswiglu_case(uint32_t type, uint32_t n_in, uint32_t n_ff, uint32_t n)
{
    struct test_weight tg, tu;
    weight_make(&tg, type, n_in, n_ff, 2);
    weight_make(&tu, type, n_in, n_ff, 2);
    struct tkv_bweight *wg = NULL, *wu = NULL;
    CHECK(gpu_q->ops->weight_init(gpu_q, &tg.t, &wg) == TKV_OK, "%s", tkv_last_error());
    CHECK(gpu_q->ops->weight_init(gpu_q, &tu.t, &wu) == TKV_OK, "%s", tkv_last_error());
    const size_t nx = (size_t)n * n_in, ny = (size_t)n * n_ff;
    float *x = malloc(nx * sizeof *x), *yf = malloc(ny * sizeof *yf), *ys = malloc(ny * sizeof *ys);
    float *rg = malloc(ny * sizeof *rg), *ru = malloc(ny * sizeof *ru);
    double *bg = malloc(ny * sizeof *bg), *bu = malloc(ny * sizeof *bu);
    fill(x, nx, -0.5f, 0.5f);
    qref(&tg, x, n, rg, bg);
    qref(&tu, x, n, ru, bu);
    float *dx = dev_from(x, nx * sizeof *x), *dout = dev_poisoned(ny), *dg = dev_poisoned(ny), *du = dev_poisoned(ny);
    settle(gpu);
    CHECK(gpu_q->ops->matmul_swiglu(gpu_q, wg, wu, dx, dout, n) == TKV_OK, "%s", tkv_last_error());
    CHECK(gpu_q->ops->matmul(gpu_q, wg, dx, dg, n) == TKV_OK, "%s", tkv_last_error());
    CHECK(gpu_q->ops->matmul(gpu_q, wu, dx, du, n) == TKV_OK, "%s", tkv_last_error());
    CHECK(gpu_q->ops->swiglu(gpu_q, dg, du, dg, ny) == TKV_OK, "%s", tkv_last_error());
    settle(gpu_q);
    to_host(yf, dout, ny * sizeof *yf);
    to_host(ys, dg, ny * sizeof *ys);
    size_t bad = 0, bad_seq = 0, same = 0;
    double worst = 0;
    for (size_t j = 0; j < ny; j++) {
        const double g = rg[j], u = ru[j], sg = g / (1.0 + exp(-g));
        const double tol = 1.1 * bg[j] * fabs(u) + fabs(sg) * bu[j] + 1.1 * bg[j] * bu[j] + 8 * 0x1p-24 * fabs(sg * u);
        const double e = fabs((double)yf[j] - sg * u);
        bad += !(e <= tol);
        if (tol > 0)
            worst = fmax(worst, e / tol);
        bad_seq += !(fabs((double)yf[j] - ys[j]) <= 2 * tol);
        same += !memcmp(&yf[j], &ys[j], sizeof *yf);
    }
    fprintf(stderr, "  qmatmul_swiglu %-5s %ux%u n=%u: worst |gpu-ref|/bound %.3f, vs matmul+matmul+swiglu %zu of %zu "
                    "bit-identical\n", tkv_type_name(type), n_ff, n_in, n, worst, same, ny);
    CHECK(bad == 0, "qmatmul_swiglu %s %ux%u n=%u: %zu of %zu beyond the bound", tkv_type_name(type), n_ff, n_in, n,
          bad, ny);
    CHECK(bad_seq == 0, "qmatmul_swiglu %s %ux%u n=%u: %zu of %zu beyond the bound of the sequence",
          tkv_type_name(type), n_ff, n_in, n, bad_seq, ny);
    dev_free(dx), dev_free(dout), dev_free(dg), dev_free(du);
    gpu_q->ops->weight_free(gpu_q, wg);
    gpu_q->ops->weight_free(gpu_q, wu);
    free(x), free(yf), free(ys), free(rg), free(ru), free(bg), free(bu);
    weight_free(&tg);
    weight_free(&tu);
}

static void test_quant(void)
{
    fprintf(stderr, "quantized decode GEMV:\n");
    const uint32_t qtypes[3] = {TKV_TYPE_Q4_0, TKV_TYPE_Q4_1, TKV_TYPE_Q8_0};
    /* (a) the activation rows, byte for byte */
    for (int t = 0; t < 3; t += 1) {
        test_q8_act_case(qtypes[t], 6, 32);
        test_q8_act_case(qtypes[t], 8, 4096);
        test_q8_act_case(qtypes[t], 7, 14336);
        test_q8_act_case(qtypes[t], 1, 64);
    }
    CHECK(tkv_backend_cuda_quantize_act(cpu, TKV_TYPE_Q4_0, NULL, 1, 32, NULL) == TKV_ERR_INVALID_ARG,
          "quantize_act took the cpu backend");
    CHECK(tkv_backend_cuda_quantize_act(gpu_q, TKV_TYPE_Q4_K, NULL, 1, 256, NULL) == TKV_ERR_INVALID_ARG,
          "quantize_act took Q4_K");
    /* (b) matmul: short rows (Q4_1, Q8_0: the reference kernel; Q4_0: the
     * packed kernel's partial rounds), odd row counts, the staged kernel's
     * row splits (8 to 128 threads per row: gemv-quant.cu's plan), rows of
     * several rounds (two stages; the packed kernel's 2 and 4 blocks a lane
     * in flight), Llama-3-8B's shapes */
    for (int t = 0; t < 3; t++) {
        const uint32_t ty = qtypes[t];
        for (uint32_t n = 1; n <= 8; n++) {
            test_qmatmul_case(ty, 32, 33, n);
            test_qmatmul_case(ty, 4096, 1024, n); /* wk, wv */
        }
        test_qmatmul_case(ty, 64, 7, 3);
        test_qmatmul_case(ty, 576, 129, 2);     /* not a whole group of blocks (Q4_1, Q8_0: the reference) */
        test_qmatmul_case(ty, 2048, 1001, 5);
        test_qmatmul_case(ty, 4096, 4096, 1);   /* wq, wo */
        test_qmatmul_case(ty, 14336, 515, 4);   /* two rounds per row */
        test_qmatmul_case(ty, 14336, 4096, 1);  /* down */
        test_qmatmul_case(ty, 4096, 14336, 1);  /* gate, up */
        test_qmatmul_case(ty, 16384, 100, 2);   /* 2 warps per row */
        test_qmatmul_case(ty, 32768, 40, 8);    /* 4 warps per row */
    }
    /* (c) the fused ops against their sequence's reference */
    const uint32_t qkv8b[3] = {4096, 1024, 1024}, mixed[5] = {33, 1001, 8, 2048, 100}, few[3] = {64, 32, 100};
    const uint32_t qkv_smol[3] = {576, 192, 192};
    for (int t = 0; t < 3; t++) {
        test_group_case(qtypes[t], 4096, qkv8b, 3, 1);
        test_group_case(qtypes[t], 4096, qkv8b, 3, 8);
        test_group_case(qtypes[t], 4096, mixed, 5, 2); /* rows of two weights in one warp */
        test_group_case(qtypes[t], 16384, few, 3, 3);  /* 2 warps per row */
        test_group_case(qtypes[t], 576, qkv_smol, 3, 1); /* the sequence (reference kernel) */
        test_qswiglu_case(qtypes[t], 4096, 14336, 1);
        test_qswiglu_case(qtypes[t], 4096, 1024, 3);
        test_qswiglu_case(qtypes[t], 16384, 64, 2);     /* 2 warps per row */
        test_qswiglu_case(qtypes[t], 576, 1536, 8);     /* the sequence */
    }
}

/* ---- matmul_add: y += x . w^T ----------------------------------------------------------
 *
 * On each path (the fast f16 GEMVs and the quantized one add in their
 * epilogue; the reference GEMVs, cuBLAS and the quantized reference
 * multiply into a work buffer and add) it must give the bits of the same
 * backend's matmul followed by add. */
static void matmul_add_case(struct tkv_backend *be, const char *label, uint32_t type, uint32_t n_in, uint32_t n_out,
                            uint32_t n)
{
    struct test_weight tw;
    weight_make(&tw, type, n_in, n_out, 2);
    struct tkv_bweight *w = NULL;
    CHECK(be->ops->weight_init(be, &tw.t, &w) == TKV_OK, "%s", tkv_last_error());
    const size_t cx = (size_t)n * n_in, cy = (size_t)n * n_out;
    float *x = malloc(cx * sizeof *x), *y0 = malloc(cy * sizeof *y0);
    float *ya = malloc(cy * sizeof *ya), *yb = malloc(cy * sizeof *yb);
    fill(x, cx, -1, 1);
    fill(y0, cy, -3, 3);
    float *dx = dev_from(x, cx * sizeof *x), *dya = dev_from(y0, cy * sizeof *y0), *dyb = dev_from(y0, cy * sizeof *y0);
    float *dp = dev_poisoned(cy);
    CHECK(be->ops->matmul_add(be, w, dx, dya, n) == TKV_OK, "%s", tkv_last_error());
    CHECK(be->ops->matmul(be, w, dx, dp, n) == TKV_OK, "%s", tkv_last_error());
    CHECK(be->ops->add(be, dyb, dp, cy) == TKV_OK, "%s", tkv_last_error());
    settle(be); /* be's kernels end before gpu's stream copies their outputs down */
    to_host(ya, dya, cy * sizeof *ya);
    to_host(yb, dyb, cy * sizeof *yb);
    size_t differ = 0, moved = 0;
    for (size_t i = 0; i < cy; i++) {
        differ += memcmp(&ya[i], &yb[i], sizeof *ya) != 0;
        moved += ya[i] != y0[i];
    }
    fprintf(stderr, "  matmul_add %s %s %ux%u n=%u: %zu of %zu outputs differ from matmul + add (%zu moved)\n", label,
            tkv_type_name(type), n_out, n_in, n, differ, cy, moved);
    CHECK(differ == 0, "matmul_add %s %s %ux%u n=%u: %zu outputs differ from matmul + add", label,
          tkv_type_name(type), n_out, n_in, n, differ);
    CHECK(moved > cy / 2, "matmul_add %s: y barely changed (%zu of %zu)", label, moved, cy);
    dev_free(dx), dev_free(dya), dev_free(dyb), dev_free(dp);
    be->ops->weight_free(be, w);
    weight_free(&tw);
    free(x), free(y0), free(ya), free(yb);
}

/* rmsnorm followed by a quantized matmul of its output, three times, on
 * gpu_q (from the second time on the norm quantizes the activations in its
 * own launch and the matmul reads them) and on `plain` (TKV_CUDA_NORM_Q8=0):
 * h and y bit for bit; then an add into h between the two, after which the
 * matmul must quantize h again. */
static void norm_q8_case(struct tkv_backend *plain, uint32_t type, uint32_t dim, uint32_t n_out, uint32_t n)
{
    struct tkv_backend *be[2] = {gpu_q, plain};
    struct test_weight tw, tn;
    weight_make(&tw, type, dim, n_out, 2);
    weight_make(&tn, TKV_TYPE_F32, dim, 1, 1);
    struct tkv_bweight *w[2] = {NULL, NULL}, *g[2] = {NULL, NULL};
    for (int b = 0; b < 2; b++)
        CHECK(be[b]->ops->weight_init(be[b], &tw.t, &w[b]) == TKV_OK &&
                  be[b]->ops->weight_init(be[b], &tn.t, &g[b]) == TKV_OK,
              "%s", tkv_last_error());
    const size_t cx = (size_t)n * dim, cy = (size_t)n * n_out;
    float *x = malloc(cx * sizeof *x), *ha = malloc(cx * sizeof *ha), *hb = malloc(cx * sizeof *hb);
    float *ya = malloc(cy * sizeof *ya), *yb = malloc(cy * sizeof *yb);
    float *dx[2], *dh[2], *dy[2]; /* the same buffers every round, as the engine's */
    for (int b = 0; b < 2; b++)
        dx[b] = dev_poisoned(cx), dh[b] = dev_poisoned(cx), dy[b] = dev_poisoned(cy);
    const uint64_t reads0 = tkv_backend_cuda_q8_reads(gpu_q);
    bool same = true;
    for (int round = 0; round < 4; round++) {
        fill(x, cx, -2, 2);
        for (int b = 0; b < 2; b++) {
            const struct tkv_backend_ops *o = be[b]->ops;
            CHECK(o->upload(be[b], dx[b], x, cx * sizeof *x) == TKV_OK, "%s", tkv_last_error());
            CHECK(o->rmsnorm(be[b], dx[b], g[b], dh[b], n, dim, 1e-5f) == TKV_OK, "%s", tkv_last_error());
            if (round == 3) /* h changes after the norm: its planes are stale */
                CHECK(o->add(be[b], dh[b], dx[b], cx) == TKV_OK, "%s", tkv_last_error());
            CHECK(o->matmul(be[b], w[b], dh[b], dy[b], n) == TKV_OK, "%s", tkv_last_error());
            settle(be[b]); /* its kernels end before gpu's stream copies their outputs down */
        }
        to_host(ha, dh[0], cx * sizeof *ha), to_host(hb, dh[1], cx * sizeof *hb);
        to_host(ya, dy[0], cy * sizeof *ya), to_host(yb, dy[1], cy * sizeof *yb);
        same = same && !memcmp(ha, hb, cx * sizeof *ha) && !memcmp(ya, yb, cy * sizeof *ya);
    }
    for (int b = 0; b < 2; b++)
        dev_free(dx[b]), dev_free(dh[b]), dev_free(dy[b]);
    const uint64_t reads = tkv_backend_cuda_q8_reads(gpu_q) - reads0;
    fprintf(stderr, "  rmsnorm + matmul %s %ux%u n=%u, 4 rounds: %s the plain sequence; %llu matmuls read the "
                    "norm's planes (want 2)\n", tkv_type_name(type), n_out, dim, n,
            same ? "bit-identical to" : "DIFFER from", (unsigned long long)reads);
    CHECK(same, "rmsnorm with its planes %s dim %u n %u: differs from the plain sequence", tkv_type_name(type), dim,
          n);
    CHECK(reads == 2, "rmsnorm + matmul %s dim %u: %llu matmuls read the norm's planes, want 2",
          tkv_type_name(type), dim, (unsigned long long)reads);
    for (int b = 0; b < 2; b++)
        be[b]->ops->weight_free(be[b], w[b]), be[b]->ops->weight_free(be[b], g[b]);
    weight_free(&tw), weight_free(&tn);
    free(x), free(ha), free(hb), free(ya), free(yb);
}

/* The views of fixture f in a call's kinds: 0 the host arrays (the packed
 * table, or inline runs), 1 one array in device memory (kv_dev), 2 that
 * with the counts and keys on the device (kv_dev_n, kv_dev_keys: the
 * decode kernel's pool of CTAs). *darr and *dcnt: what to free. */
static void attn_views_of(const struct kv_fixture *f, int kind, struct tkv_attn_args *a,
                          struct tkv_kv_head_view *views, struct tkv_kv_block_ref **darr, uint32_t **dcnt)
{
    *darr = NULL, *dcnt = NULL;
    a->kv = f->dviews;
    if (kind == 0)
        return;
    size_t total = 0;
    for (uint32_t h = 0; h < f->Hkv; h++)
        total += f->dviews[h].n_blocks;
    struct tkv_kv_block_ref *arr = malloc(total * sizeof *arr);
    uint32_t *cnt = malloc((size_t)f->Hkv * 2 * sizeof *cnt);
    REQUIRE_VOID(arr && cnt);
    size_t at = 0;
    for (uint32_t h = 0; h < f->Hkv; h++) {
        memcpy(arr + at, f->dviews[h].blocks, f->dviews[h].n_blocks * sizeof *arr);
        views[h] = (struct tkv_kv_head_view){.blocks = NULL, .n_blocks = f->dviews[h].n_blocks};
        cnt[2 * h] = f->dviews[h].n_blocks;
        cnt[2 * h + 1] = 0;
        for (uint32_t i = 0; i < f->dviews[h].n_blocks; i++)
            cnt[2 * h + 1] += f->dviews[h].blocks[i].n;
        at += f->dviews[h].n_blocks;
    }
    *darr = dev_from(arr, total * sizeof *arr);
    for (uint32_t h = 0, o = 0; h < f->Hkv; o += views[h].n_blocks, h++)
        views[h].blocks = *darr + o;
    a->kv = views;
    a->kv_dev = true;
    if (kind == 2) {
        *dcnt = dev_from(cnt, (size_t)f->Hkv * 2 * sizeof *cnt);
        a->kv_dev_n = *dcnt, a->kv_dev_keys = *dcnt + 1, a->kv_dev_n_stride = 2;
    }
    free(arr), free(cnt);
}

/* attention, then matmul_add of its output by a Q4_0 wo, four rounds on be
 * (from the second round on, the decode kernels quantize the output for wo
 * as they write it) and on plain (TKV_CUDA_ATTN_Q8=0): out and y bit for
 * bit. In the last round an add into out comes between the two, after
 * which wo must quantize out itself. want_reads: 2, or 0 where the decode
 * kernels do not serve the call (more than 8 rows per KV head). kind:
 * attn_views_of's. */
static void attn_q8_case(struct tkv_backend *be, struct tkv_backend *plain, const char *label, int kind, uint32_t H,
                         uint32_t Hkv, uint32_t hd, uint32_t n_q, uint32_t n_ctx, uint64_t want_reads)
{
    struct kv_fixture f;
    kv_make(&f, Hkv, hd, 64, n_ctx, VIEW_ALL, 0);
    const uint32_t dim = H * hd, n_out = 256;
    struct test_weight tw;
    weight_make(&tw, TKV_TYPE_Q4_0, dim, n_out, 2);
    struct tkv_backend *bes[2] = {be, plain};
    struct tkv_bweight *w[2] = {NULL, NULL};
    for (int b = 0; b < 2; b++)
        CHECK(bes[b]->ops->weight_init(bes[b], &tw.t, &w[b]) == TKV_OK, "%s", tkv_last_error());
    int32_t pos[8];
    for (uint32_t t = 0; t < n_q; t++)
        pos[t] = (int32_t)(n_ctx - n_q + t); /* the last query sees every key */
    const size_t cq = (size_t)n_q * dim, cy = (size_t)n_q * n_out;
    float *q = malloc(cq * sizeof *q), *y0 = malloc(cy * sizeof *y0), *oa = malloc(cq * sizeof *oa);
    float *ob = malloc(cq * sizeof *ob), *ya = malloc(cy * sizeof *ya), *yb = malloc(cy * sizeof *yb);
    fill(y0, cy, -1, 1);
    float *dq[2], *dout[2], *dy[2];
    for (int b = 0; b < 2; b++)
        dq[b] = dev_poisoned(cq), dout[b] = dev_poisoned(cq), dy[b] = dev_poisoned(cy);
    struct tkv_kv_head_view views[64];
    struct tkv_kv_block_ref *darr;
    uint32_t *dcnt;
    struct tkv_attn_args a = {.q_pos = pos, .lse = NULL, .n_q = n_q, .n_head = H, .n_head_kv = Hkv,
                              .head_dim = hd, .scale = 1.0f / sqrtf((float)hd)};
    REQUIRE_VOID(Hkv <= 64 && n_q <= 8);
    attn_views_of(&f, kind, &a, views, &darr, &dcnt);
    /* be keeps what a GEMV read of an attention output at that address
     * last time; an earlier case's buffer may have had dout[0]'s address.
     * An attention into another buffer makes round 0 a first call. */
    float *scratch = dev_poisoned(cq);
    fill(q, cq, -1, 1);
    a.q = dq[0], a.out = scratch;
    CHECK(be->ops->upload(be, dq[0], q, cq * sizeof *q) == TKV_OK && be->ops->attention(be, &a) == TKV_OK, "%s",
          tkv_last_error());
    settle(be);
    dev_free(scratch);
    const uint64_t reads0 = tkv_backend_cuda_q8_reads(be);
    bool same = true;
    for (int round = 0; round < 4; round++) {
        fill(q, cq, -1, 1);
        for (int b = 0; b < 2; b++) {
            const struct tkv_backend_ops *o = bes[b]->ops;
            CHECK(o->upload(bes[b], dq[b], q, cq * sizeof *q) == TKV_OK, "%s", tkv_last_error());
            CHECK(o->upload(bes[b], dy[b], y0, cy * sizeof *y0) == TKV_OK, "%s", tkv_last_error());
            a.q = dq[b], a.out = dout[b];
            CHECK(o->attention(bes[b], &a) == TKV_OK, "%s", tkv_last_error());
            if (round == 3) /* out changes after the attention: its planes are stale */
                CHECK(o->add(bes[b], dout[b], dq[b], cq) == TKV_OK, "%s", tkv_last_error());
            CHECK(o->matmul_add(bes[b], w[b], dout[b], dy[b], n_q) == TKV_OK, "%s", tkv_last_error());
            settle(bes[b]); /* its kernels end before gpu's stream copies their outputs down */
        }
        to_host(oa, dout[0], cq * sizeof *oa), to_host(ob, dout[1], cq * sizeof *ob);
        to_host(ya, dy[0], cy * sizeof *ya), to_host(yb, dy[1], cy * sizeof *yb);
        same = same && !memcmp(oa, ob, cq * sizeof *oa) && !memcmp(ya, yb, cy * sizeof *ya);
    }
    const uint64_t reads = tkv_backend_cuda_q8_reads(be) - reads0;
    static const char *const kinds[] = {"host views", "device views", "device views + counts"};
    fprintf(stderr, "  attention + matmul_add %s, %s: %u/%u heads of %u, n_q %u, %u keys, 4 rounds: %s the plain "
                    "sequence; %llu matmuls read the attention's planes (want %llu)\n", label, kinds[kind], H, Hkv, hd,
            n_q, n_ctx, same ? "bit-identical to" : "DIFFER from", (unsigned long long)reads,
            (unsigned long long)want_reads);
    CHECK(same, "attention with its planes %s (%s) H %u hd %u n_q %u keys %u: differs from the plain sequence", label,
          kinds[kind], H, hd, n_q, n_ctx);
    CHECK(reads == want_reads, "attention + matmul_add %s (%s) H %u hd %u n_q %u: %llu matmuls read the planes, want %llu",
          label, kinds[kind], H, hd, n_q, (unsigned long long)reads, (unsigned long long)want_reads);
    for (int b = 0; b < 2; b++) {
        dev_free(dq[b]), dev_free(dout[b]), dev_free(dy[b]);
        bes[b]->ops->weight_free(bes[b], w[b]);
    }
    if (darr)
        dev_free(darr);
    if (dcnt)
        dev_free(dcnt);
    weight_free(&tw);
    kv_free(&f);
    free(q), free(y0), free(oa), free(ob), free(ya), free(yb);
}

/* The decode attention quantizing its output for the next quantized GEMV
 * (docs/gpu.md "Fused decode ops"), in every decode kernel and table kind,
 * against the same kernel with TKV_CUDA_ATTN_Q8=0 (the kernels differ in
 * their sums' order, so each has its own reference). */
static void test_attn_q8(void)
{
    fprintf(stderr, "attention quantizing wo's activations:\n");
    REQUIRE_VOID(gpu_q->ops->matmul_add);
    static const char *const var[4][2] = {
        {"TKV_CUDA_ATTN_DECODE", "fused"}, /* the packed table (device views: their own kernel) */
        {"TKV_CUDA_ATTN_DECODE", "merge"},
        {"TKV_CUDA_ATTN_DECODE", NULL}, /* the default: inline runs where the view fits */
        {"TKV_CUDA_ATTN_DECODE_MMA", "0"}};
    struct tkv_backend *on[4], *off[4];
    bool ok = true;
    for (int i = 0; i < 4; i++) {
        const char *const env_on[] = {var[i][0], var[i][1], NULL};
        const char *const env_off[] = {var[i][0], var[i][1], "TKV_CUDA_ATTN_Q8", "0", NULL};
        on[i] = i == 2 ? gpu_q : gpu_with_env(env_on);
        off[i] = gpu_with_env(env_off);
        ok = ok && on[i] && off[i];
    }
    if (ok) {
        for (int kind = 0; kind < 3; kind++) {
            /* Llama-3-8B's heads: split, the last CTA of a head merges */
            attn_q8_case(on[0], off[0], "fused merge", kind, 32, 8, 128, 1, 3000, 2);
            attn_q8_case(on[0], off[0], "one split", kind, 32, 8, 128, 1, 50, 2); /* no merge */
            attn_q8_case(on[3], off[3], "CUDA cores", kind, 32, 8, 128, 1, 3000, 2);
        }
        attn_q8_case(on[1], off[1], "merge kernel", 0, 32, 8, 128, 1, 3000, 2);
        attn_q8_case(on[2], off[2], "inline runs", 0, 32, 8, 128, 2, 3000, 2);
        attn_q8_case(on[0], off[0], "2 tokens", 0, 16, 4, 64, 2, 700, 2);      /* 8 rows a KV head */
        attn_q8_case(on[0], off[0], "head_dim 256", 2, 8, 2, 256, 1, 900, 2);
        attn_q8_case(on[0], off[0], "one split", 1, 9, 3, 64, 1, 40, 2);       /* SmolLM2's heads */
        attn_q8_case(on[0], off[0], "12 rows", 0, 16, 4, 64, 3, 700, 0);       /* not the decode kernels */
        attn_q8_case(on[0], off[0], "head_dim 96", 0, 8, 2, 96, 1, 700, 2);    /* 3 blocks a head, each in one */
    }
    for (int i = 0; i < 4; i++) {
        if (i != 2 && on[i])
            on[i]->ops->free(on[i]);
        if (off[i])
            off[i]->ops->free(off[i]);
    }
}

/* matmul_qkv_rope against matmul_group + rope_qk on the same backend: the
 * same bits (the quantized GEMV rotates in its epilogue, with one row a
 * unit or rows in pairs; other paths run the two ops). */
static void qkv_rope_case(struct tkv_backend *be, const char *label, uint32_t type, uint32_t n_in, uint32_t hq,
                          uint32_t hk, uint32_t hd, uint32_t rot, uint32_t n, int32_t pos0)
{
    const uint32_t rows[3] = {hq * hd, hk * hd, hk * hd};
    struct test_weight tw[3];
    struct tkv_bweight *w[3] = {NULL, NULL, NULL};
    for (int i = 0; i < 3; i++) {
        weight_make(&tw[i], type, n_in, rows[i], 2);
        CHECK(be->ops->weight_init(be, &tw[i].t, &w[i]) == TKV_OK, "%s", tkv_last_error());
    }
    float *x = malloc((size_t)n * n_in * sizeof *x);
    fill(x, (size_t)n * n_in, -1, 1);
    int32_t *pos = malloc(n * sizeof *pos);
    for (uint32_t t = 0; t < n; t++)
        pos[t] = pos0 + (int32_t)t;
    float *dx = dev_from(x, (size_t)n * n_in * sizeof *x), *ya[3], *yb[3];
    for (int i = 0; i < 3; i++)
        ya[i] = dev_poisoned((size_t)n * rows[i]), yb[i] = dev_poisoned((size_t)n * rows[i]);
    const struct tkv_bweight *const *wc = (const struct tkv_bweight *const *)w;
    CHECK(be->ops->matmul_qkv_rope(be, wc, dx, ya[0], ya[1], ya[2], n, hd, rot, pos, 500000.0f, 1.0f) == TKV_OK, "%s",
          tkv_last_error());
    CHECK(be->ops->matmul_group(be, wc, 3, dx, yb, n) == TKV_OK, "%s", tkv_last_error());
    CHECK(be->ops->rope_qk(be, yb[0], yb[1], n, hq, hk, hd, rot, pos, 500000.0f, 1.0f) == TKV_OK, "%s",
          tkv_last_error());
    settle(be); /* be's kernels end before gpu's stream copies their outputs down */
    size_t differ = 0, total = 0;
    for (int i = 0; i < 3; i++) {
        const size_t c = (size_t)n * rows[i];
        float *a = malloc(c * sizeof *a), *b = malloc(c * sizeof *b);
        to_host(a, ya[i], c * sizeof *a);
        to_host(b, yb[i], c * sizeof *b);
        for (size_t j = 0; j < c; j++)
            differ += memcmp(&a[j], &b[j], sizeof *a) != 0 || isnan(a[j]);
        total += c;
        free(a), free(b);
        dev_free(ya[i]), dev_free(yb[i]);
    }
    fprintf(stderr, "  matmul_qkv_rope %s %s %u -> %u/%u/%u heads of %u (rot %u) n=%u pos %d: %zu of %zu outputs "
                    "differ from matmul_group + rope_qk\n", label, tkv_type_name(type), n_in, hq, hk, hk, hd, rot, n,
            pos0, differ, total);
    CHECK(differ == 0, "matmul_qkv_rope %s %s n_in %u n %u: %zu outputs differ", label, tkv_type_name(type), n_in, n,
          differ);
    dev_free(dx);
    for (int i = 0; i < 3; i++)
        be->ops->weight_free(be, w[i]), weight_free(&tw[i]);
    free(x), free(pos);
}

static void test_matmul_add(void)
{
    fprintf(stderr, "matmul_add:\n");
    REQUIRE_VOID(gpu->ops->matmul_add && !cpu->ops->matmul_add);
    const uint32_t ns[] = {1, 3, 9}; /* 9: past the GEMVs (cuBLAS) */
    for (size_t i = 0; i < 3; i++) {
        matmul_add_case(gpu, "f16-gemv", TKV_TYPE_F16, 4096, 1024, ns[i]);
        matmul_add_case(gpu_gemv_u8, "f16-u8", TKV_TYPE_F16, 8192, 512, ns[i]);
        matmul_add_case(gpu_gemv_ref, "f16-ref", TKV_TYPE_F16, 1024, 300, ns[i]);
        matmul_add_case(gpu_gemv_blas, "cublas", TKV_TYPE_F16, 1024, 300, ns[i]);
        matmul_add_case(gpu_q, "quant", TKV_TYPE_Q4_0, 4096, 1024, ns[i]);
        matmul_add_case(gpu_q, "quant-pairs", TKV_TYPE_Q4_0, 14336, 4096, ns[i]);
        matmul_add_case(gpu_q, "quant", TKV_TYPE_Q4_1, 2048, 512, ns[i]);
        matmul_add_case(gpu_q, "quant", TKV_TYPE_Q8_0, 1024, 256, ns[i]);
        matmul_add_case(gpu_q_ref, "quant-ref", TKV_TYPE_Q4_0, 1024, 300, ns[i]);
        matmul_add_case(gpu_q, "quant-odd", TKV_TYPE_Q4_0, 576, 192, ns[i]); /* n_in % 256: the reference kernel */
    }
    struct tkv_backend *plain = NULL;
    setenv("TKV_CUDA_NORM_Q8", "0", 1);
    tkv_status st = tkv_backend_create("cuda", 0, &plain);
    unsetenv("TKV_CUDA_NORM_Q8");
    CHECK(st == TKV_OK, "%s", tkv_last_error());
    if (st == TKV_OK) {
        norm_q8_case(plain, TKV_TYPE_Q4_0, 4096, 1024, 1); /* Llama-3-8B's width: 4 CTAs a row */
        norm_q8_case(plain, TKV_TYPE_Q4_1, 2048, 512, 3);
        norm_q8_case(plain, TKV_TYPE_Q8_0, 1280, 256, 8);  /* 2 CTAs, the second with 8 of its 32 warps */
        norm_q8_case(plain, TKV_TYPE_Q4_1, 576, 192, 2);   /* SmolLM2: 576 threads, the reference GEMV */
        plain->ops->free(plain);
    }
    fprintf(stderr, "matmul_qkv_rope:\n");
    REQUIRE_VOID(gpu_q->ops->matmul_qkv_rope && !cpu->ops->matmul_qkv_rope);
    for (size_t i = 0; i < 3; i++) {
        qkv_rope_case(gpu_q, "quant", TKV_TYPE_Q4_0, 4096, 32, 8, 128, 128, ns[i], 4096); /* Llama-3-8B: 16 lanes a row */
        qkv_rope_case(gpu_q, "quant-pairs", TKV_TYPE_Q4_0, 16384, 8, 2, 128, 128, ns[i], 77); /* 32 lanes: pairs */
        qkv_rope_case(gpu_q, "quant", TKV_TYPE_Q4_1, 2048, 16, 4, 64, 32, ns[i], 1 << 20); /* partial rotation */
        qkv_rope_case(gpu_q, "quant", TKV_TYPE_Q8_0, 1024, 8, 2, 128, 128, ns[i], 5);
        qkv_rope_case(gpu_q, "quant-ref", TKV_TYPE_Q4_1, 576, 9, 3, 64, 64, ns[i], 300); /* SmolLM2: the two ops */
        qkv_rope_case(gpu, "f16", TKV_TYPE_F16, 2048, 16, 4, 128, 128, ns[i], 1000);
    }
    struct test_weight tv;
    weight_make(&tv, TKV_TYPE_F32, 64, 1, 1);
    struct tkv_bweight *v = NULL;
    CHECK(gpu->ops->weight_init(gpu, &tv.t, &v) == TKV_OK, "%s", tkv_last_error());
    float *d = dev_poisoned(64);
    CHECK(gpu->ops->matmul_add(gpu, v, d, d, 1) == TKV_ERR_INVALID_ARG, "matmul_add of a vector accepted");
    dev_free(d);
    gpu->ops->weight_free(gpu, v);
    weight_free(&tv);
}

/* ---- programmatic dependent launches (TKV_CUDA_PDL=1) ------------------------------------
 *
 * A decode step's op chain, queued back to back with no synchronization,
 * on the default backend and on one created with TKV_CUDA_PDL=1: the
 * kernels are the same, so every output must be bit-identical. A kernel
 * that touched its predecessor's output before griddepcontrol.wait would
 * read stale or half-written values and differ (how often depends on the
 * timing; the chain runs several layers and steps to give it chances). */

struct pdl_model {
    uint32_t E, H, Hkv, hd, F, V, B, nb;
    struct test_weight wq, wk, wv, wo, wg, wu, wd, out, norm;
    struct tkv_bweight *w[3][9]; /* per backend: q k v o gate up down output norm */
};

struct pdl_state {
    float *x, *h, *q, *k, *v, *att, *hb, *gate, *logits; /* device */
    uint16_t *kv;                                          /* [Hkv][nb][K|V][B][hd] */
};

static void pdl_state_make(struct pdl_state *st, const struct pdl_model *m, const float *x0, const uint16_t *kv0)
{
    st->x = dev_from(x0, m->E * sizeof(float));
    st->h = dev_poisoned(m->E), st->hb = dev_poisoned(m->E), st->att = dev_poisoned(m->H * m->hd);
    st->q = dev_poisoned(m->H * m->hd), st->k = dev_poisoned(m->Hkv * m->hd), st->v = dev_poisoned(m->Hkv * m->hd);
    st->gate = dev_poisoned(m->F), st->logits = dev_poisoned(m->V);
    st->kv = dev_from(kv0, (size_t)m->Hkv * m->nb * 2 * m->B * m->hd * sizeof(uint16_t));
}

static void pdl_state_free(struct pdl_state *st)
{
    dev_free(st->x), dev_free(st->h), dev_free(st->hb), dev_free(st->att), dev_free(st->q), dev_free(st->k);
    dev_free(st->v), dev_free(st->gate), dev_free(st->logits), dev_free(st->kv);
}

/* n_layers layers at positions pos, pos+1, ... (one layer's weights and KV
 * reused), then the output norm and matmul: the engine's fused sequence;
 * with add_in_matmul, its sequence on a backend with matmul_add and
 * matmul_qkv_rope (the residual added by wo and down, the norms plain
 * rmsnorm calls, q/k/v and their rotation one call). */
static void pdl_chain(struct tkv_backend *be, const struct pdl_model *m, struct tkv_bweight *const *w,
                      struct pdl_state *st, int32_t pos, uint32_t n_layers, bool add_in_matmul)
{
    const struct tkv_backend_ops *ops = be->ops;
    const uint32_t E = m->E, H = m->H, Hkv = m->Hkv, hd = m->hd, B = m->B;
    struct tkv_kv_block_ref refs[8][64];
    struct tkv_kv_head_view views[8];
    uint16_t *kdst[8], *vdst[8];
    CHECK(ops->rmsnorm(be, st->x, w[8], st->h, 1, E, 1e-5f) == TKV_OK, "%s", tkv_last_error());
    for (uint32_t l = 0; l < n_layers; l++, pos++) {
        const struct tkv_bweight *qkv[3] = {w[0], w[1], w[2]};
        float *outs[3] = {st->q, st->k, st->v};
        if (add_in_matmul) {
            CHECK(ops->matmul_qkv_rope(be, qkv, st->h, st->q, st->k, st->v, 1, hd, hd, &pos, 500000.0f, 1.0f) ==
                      TKV_OK,
                  "%s", tkv_last_error());
        } else {
            CHECK(ops->matmul_group(be, qkv, 3, st->h, outs, 1) == TKV_OK, "%s", tkv_last_error());
            CHECK(ops->rope_qk(be, st->q, st->k, 1, H, Hkv, hd, hd, &pos, 500000.0f, 1.0f) == TKV_OK, "%s",
                  tkv_last_error());
        }
        const uint32_t nblk = (uint32_t)pos / B + 1;
        for (uint32_t g = 0; g < Hkv; g++) {
            uint16_t *base = st->kv + (size_t)g * m->nb * 2 * B * hd;
            for (uint32_t b = 0; b < nblk; b++) {
                uint16_t *kb = base + (size_t)b * 2 * B * hd;
                refs[g][b] = (struct tkv_kv_block_ref){.k = kb, .v = kb + (size_t)B * hd, .pos0 = (int32_t)(b * B),
                                                       .n = b + 1 < nblk ? B : (uint32_t)pos - b * B + 1};
            }
            views[g] = (struct tkv_kv_head_view){.blocks = refs[g], .n_blocks = nblk};
            const uint32_t row = (uint32_t)pos - (nblk - 1) * B;
            kdst[g] = refs[g][nblk - 1].k + (size_t)row * hd;
            vdst[g] = refs[g][nblk - 1].v + (size_t)row * hd;
        }
        CHECK(ops->kv_write_heads(be, st->k, st->v, (size_t)Hkv * hd, kdst, vdst, Hkv, 1, hd) == TKV_OK, "%s",
              tkv_last_error());
        struct tkv_attn_args a = {.q = st->q, .q_pos = &pos, .out = st->att, .lse = NULL, .n_q = 1, .n_head = H,
                                  .n_head_kv = Hkv, .head_dim = hd, .scale = 1.0f / sqrtf((float)hd), .kv = views};
        CHECK(ops->attention(be, &a) == TKV_OK, "%s", tkv_last_error());
        if (add_in_matmul) {
            CHECK(ops->matmul_add(be, w[3], st->att, st->x, 1) == TKV_OK, "%s", tkv_last_error());
            CHECK(ops->rmsnorm(be, st->x, w[8], st->h, 1, E, 1e-5f) == TKV_OK, "%s", tkv_last_error());
            CHECK(ops->matmul_swiglu(be, w[4], w[5], st->h, st->gate, 1) == TKV_OK, "%s", tkv_last_error());
            CHECK(ops->matmul_add(be, w[6], st->gate, st->x, 1) == TKV_OK, "%s", tkv_last_error());
            CHECK(ops->rmsnorm(be, st->x, w[8], st->h, 1, E, 1e-5f) == TKV_OK, "%s", tkv_last_error());
            continue;
        }
        CHECK(ops->matmul(be, w[3], st->att, st->hb, 1) == TKV_OK, "%s", tkv_last_error());
        CHECK(ops->add_rmsnorm(be, st->x, st->hb, w[8], st->h, 1, E, 1e-5f) == TKV_OK, "%s", tkv_last_error());
        CHECK(ops->matmul_swiglu(be, w[4], w[5], st->h, st->gate, 1) == TKV_OK, "%s", tkv_last_error());
        CHECK(ops->matmul(be, w[6], st->gate, st->hb, 1) == TKV_OK, "%s", tkv_last_error());
        CHECK(ops->add_rmsnorm(be, st->x, st->hb, w[8], st->h, 1, E, 1e-5f) == TKV_OK, "%s", tkv_last_error());
    }
    CHECK(ops->matmul(be, w[7], st->h, st->logits, 1) == TKV_OK, "%s", tkv_last_error());
}

static bool dev_equal(const void *a, const void *b, size_t bytes)
{
    void *ha = malloc(bytes), *hb = malloc(bytes);
    to_host(ha, a, bytes);
    to_host(hb, b, bytes);
    const bool same = !memcmp(ha, hb, bytes);
    free(ha), free(hb);
    return same;
}

/* The chain with matrices of wtype on `plain` (no PDL) and on a
 * TKV_CUDA_PDL=1 backend (quantized GEMV on: Q4_0 matrices take it), and
 * the matmul_add sequence on a third: TKV_CUDA_PDL=1, and for Q4_0 the
 * norms quantizing the next product's activations in their own launch
 * (rmsnorm's fused path, whose outputs and planes must be the plain
 * sequence's bits: TKV_CUDA_NORM_Q8=0 on `plain`). */
static void pdl_case(uint32_t wtype, struct tkv_backend *plain)
{
    enum { NB = 3 };
    struct tkv_backend *be[NB] = {plain, NULL, NULL};
    setenv("TKV_CUDA_PDL", "1", 1);
    setenv("TKV_CUDA_GEMV", "fast", 1); /* the reference's GEMV: the bits must match */
    tkv_status cst = tkv_backend_create("cuda", 0, &be[1]);
    if (cst == TKV_OK)
        cst = tkv_backend_create("cuda", 0, &be[2]);
    unsetenv("TKV_CUDA_PDL"), unsetenv("TKV_CUDA_GEMV");
    CHECK(cst == TKV_OK, "TKV_CUDA_PDL=1: %s", tkv_last_error());
    if (cst != TKV_OK) {
        if (be[1])
            be[1]->ops->free(be[1]);
        return;
    }
    REQUIRE_VOID(be[2]->ops->matmul_add && be[2]->ops->matmul_qkv_rope);
    /* Llama-3-8B's widths over 2 (the GEMVs take S = 1, 2 and 4 warps per
     * row), 16 query heads on 4 KV heads, 20 positions past 1000 keys */
    struct pdl_model m = {.E = 2048, .H = 16, .Hkv = 4, .hd = 128, .F = 5632, .V = 8000, .B = 64};
    const int32_t pos0 = 1000;
    const uint32_t steps = 5, layers = 4;
    m.nb = (pos0 + steps * layers) / m.B + 1;
    weight_make(&m.wq, wtype, m.E, m.H * m.hd, 2);
    weight_make(&m.wk, wtype, m.E, m.Hkv * m.hd, 2);
    weight_make(&m.wv, wtype, m.E, m.Hkv * m.hd, 2);
    weight_make(&m.wo, wtype, m.H * m.hd, m.E, 2);
    weight_make(&m.wg, wtype, m.E, m.F, 2);
    weight_make(&m.wu, wtype, m.E, m.F, 2);
    weight_make(&m.wd, wtype, m.F, m.E, 2);
    weight_make(&m.out, wtype, m.E, m.V, 2);
    weight_make(&m.norm, TKV_TYPE_F32, m.E, 1, 1);
    const struct test_weight *tw[9] = {&m.wq, &m.wk, &m.wv, &m.wo, &m.wg, &m.wu, &m.wd, &m.out, &m.norm};
    for (int b = 0; b < NB; b++)
        for (int i = 0; i < 9; i++) {
            m.w[b][i] = NULL;
            CHECK(be[b]->ops->weight_init(be[b], &tw[i]->t, &m.w[b][i]) == TKV_OK, "%s", tkv_last_error());
        }
    const size_t kv_elems = (size_t)m.Hkv * m.nb * 2 * m.B * m.hd;
    uint16_t *kv0 = malloc(kv_elems * sizeof *kv0);
    for (size_t i = 0; i < kv_elems; i++)
        kv0[i] = tkv_fp32_to_fp16(test_rand_f32(&rng, -2, 2));
    float *x0 = malloc(m.E * sizeof *x0);
    fill(x0, m.E, -1, 1);
    struct pdl_state st[NB];
    for (int b = 0; b < NB; b++)
        pdl_state_make(&st[b], &m, x0, kv0);
    /* each backend queues all its steps before anyone waits */
    const uint64_t reads0 = tkv_backend_cuda_q8_reads(be[2]);
    for (int b = 0; b < NB; b++)
        for (uint32_t s = 0; s < steps; s++)
            pdl_chain(be[b], &m, m.w[b], &st[b], pos0 + (int32_t)(s * layers), layers, b == 2);
    for (int b = 0; b < NB; b++)
        CHECK(be[b]->ops->synchronize(be[b]) == TKV_OK, "%s", tkv_last_error());
    const bool x_same = dev_equal(st[0].x, st[1].x, m.E * sizeof(float));
    const bool l_same = dev_equal(st[0].logits, st[1].logits, m.V * sizeof(float));
    const bool kv_same = dev_equal(st[0].kv, st[1].kv, kv_elems * sizeof(uint16_t));
    const bool a_same = dev_equal(st[0].att, st[1].att, m.H * m.hd * sizeof(float));
    float *lg = malloc(m.V * sizeof *lg);
    to_host(lg, st[1].logits, m.V * sizeof *lg);
    size_t finite = 0;
    for (uint32_t i = 0; i < m.V; i++)
        finite += isfinite(lg[i]) != 0;
    fprintf(stderr, "  %s: %u steps x %u layers (E %u, %u/%u heads, F %u, %u keys): pdl vs plain: x %s, logits %s, "
                    "K/V %s, attention %s; %zu of %u logits finite\n", tkv_type_name(wtype), steps, layers, m.E, m.H, m.Hkv, m.F,
            pos0 + steps * layers, x_same ? "bit-identical" : "DIFFER", l_same ? "bit-identical" : "DIFFER",
            kv_same ? "bit-identical" : "DIFFER", a_same ? "bit-identical" : "DIFFER", finite, m.V);
    CHECK(x_same && l_same && kv_same && a_same, "TKV_CUDA_PDL=1 changed the decode chain's results");
    CHECK(finite == m.V, "non-finite logits (%zu of %u finite)", finite, m.V);
    /* the matmul_add sequence: every norm after the first of a step hands
     * its planes to the product after it (q/k/v, gate/up, the output) on
     * the quantized path, and every attention but the first to wo; the
     * first norm and the first attention of the run learn their order */
    const bool ax = dev_equal(st[0].x, st[2].x, m.E * sizeof(float));
    const bool al = dev_equal(st[0].logits, st[2].logits, m.V * sizeof(float));
    const bool ak = dev_equal(st[0].kv, st[2].kv, kv_elems * sizeof(uint16_t));
    const bool aa = dev_equal(st[0].att, st[2].att, m.H * m.hd * sizeof(float));
    const uint64_t reads = tkv_backend_cuda_q8_reads(be[2]) - reads0;
    const uint64_t want =
        wtype == TKV_TYPE_Q4_0 ? (uint64_t)steps * (2 * layers + 1) - 1 + (uint64_t)steps * layers - 1 : 0;
    fprintf(stderr, "  %s: matmul_add + rmsnorm + matmul_qkv_rope vs plain: x %s, logits %s, K/V %s, attention %s; %llu products "
                    "read the planes of a norm or attention (want %llu)\n", tkv_type_name(wtype), ax ? "bit-identical" : "DIFFER",
            al ? "bit-identical" : "DIFFER", ak ? "bit-identical" : "DIFFER", aa ? "bit-identical" : "DIFFER",
            (unsigned long long)reads, (unsigned long long)want);
    CHECK(ax && al && ak && aa, "matmul_add + rmsnorm + matmul_qkv_rope changed the decode chain's results");
    CHECK(reads == want, "%llu products read the planes of a norm or attention, want %llu", (unsigned long long)reads,
          (unsigned long long)want);
    for (int b = 0; b < NB; b++) {
        pdl_state_free(&st[b]);
        for (int i = 0; i < 9; i++)
            be[b]->ops->weight_free(be[b], m.w[b][i]);
    }
    for (int i = 0; i < 9; i++)
        weight_free((struct test_weight *)tw[i]);
    be[1]->ops->free(be[1]);
    be[2]->ops->free(be[2]);
    free(kv0), free(x0), free(lg);
}

static void test_pdl(void)
{
    fprintf(stderr, "programmatic dependent launches:\n");
    REQUIRE_VOID(gpu->ops->matmul_group && gpu->ops->matmul_swiglu && gpu->ops->add_rmsnorm && gpu->ops->rope_qk);
    pdl_case(TKV_TYPE_F16, gpu);
    /* the quantized GEMV and its activation quantization in the chain */
    struct tkv_backend *qplain = NULL;
    setenv("TKV_CUDA_PDL", "0", 1);
    setenv("TKV_CUDA_GEMV", "fast", 1);
    setenv("TKV_CUDA_NORM_Q8", "0", 1);
    setenv("TKV_CUDA_ATTN_Q8", "0", 1);
    tkv_status st = tkv_backend_create("cuda", 0, &qplain);
    unsetenv("TKV_CUDA_PDL"), unsetenv("TKV_CUDA_GEMV"), unsetenv("TKV_CUDA_NORM_Q8"), unsetenv("TKV_CUDA_ATTN_Q8");
    CHECK(st == TKV_OK, "%s", tkv_last_error());
    if (st == TKV_OK) {
        pdl_case(TKV_TYPE_Q4_0, qplain);
        qplain->ops->free(qplain);
    }
}

/* ---- the f32 validation mode (TKV_CUDA_WEIGHTS=f32) -------------------------------- */

static void test_f32_mode(void)
{
    struct tkv_backend *f16_backend = gpu;
    setenv("TKV_CUDA_WEIGHTS", "f32", 1);
    tkv_status st = tkv_backend_create("cuda", 0, &gpu);
    unsetenv("TKV_CUDA_WEIGHTS");
    CHECK(st == TKV_OK, "%s", tkv_last_error());
    if (st == TKV_OK) {
        f32_mode = true;
        fprintf(stderr, "f32 validation mode:\n");
        test_matmul_case(TKV_TYPE_Q4_1, 576, 384, 1, 0);
        test_matmul_case(TKV_TYPE_Q6_K, 768, 384, 64, 0);
        test_matmul_case(TKV_TYPE_F32, 100, 70, 3, 0);
        f32_mode = false;
        gpu->ops->free(gpu);
    }
    gpu = f16_backend;
}

/* ---- optional members: PCI id, page-locked host memory ------------------------- */

static void test_host_memory(void)
{
    const char *bus = gpu->ops->pci_bus_id ? gpu->ops->pci_bus_id(gpu) : NULL;
    fprintf(stderr, "pci bus id: %s\n", bus ? bus : "(none)");
    CHECK(bus && strlen(bus) >= 12 && bus[4] == ':', "pci bus id '%s'", bus ? bus : "");
    REQUIRE_VOID(gpu->ops->host_register && gpu->ops->host_unregister);
    const size_t n = 1 << 20;
    float *h = NULL, *back = malloc(n * sizeof *back);
    REQUIRE_VOID(posix_memalign((void **)&h, 4096, n * sizeof *h) == 0);
    fill(h, n, -1, 1);
    CHECK(gpu->ops->host_register(gpu, h, n * sizeof *h) == TKV_OK, "%s", tkv_last_error());
    float first = h[0], last = h[n - 1];
    float *d = dev_alloc(n * sizeof *h);
    CHECK(gpu->ops->upload(gpu, d, h, n * sizeof *h) == TKV_OK, "%s", tkv_last_error());
    h[0] = h[n - 1] = 12345.0f; /* upload returned: the source may be reused */
    to_host(back, d, n * sizeof *back);
    CHECK(back[0] == first && back[n - 1] == last, "upload from page-locked memory read the source late");
    gpu->ops->host_unregister(gpu, h);
    dev_free(d);
    free(h), free(back);
}

/* ---- errors ------------------------------------------------------------------------------- */

static void test_errors(void)
{
    void *p = NULL;
    tkv_status st = gpu->ops->alloc(gpu, (size_t)1 << 50, &p);
    fprintf(stderr, "alloc 1 PiB: %s: %s\n", tkv_status_str(st), tkv_last_error());
    CHECK(st == TKV_ERR_NOMEM && !p, "huge alloc gave %s", tkv_status_str(st));
    /* not sticky: the backend still works */
    p = dev_alloc(1 << 20);
    CHECK(gpu->ops->synchronize(gpu) == TKV_OK, "%s", tkv_last_error());
    dev_free(p);
}

int main(void)
{
    if (tkv_backend_cuda_devices() == 0)
        SKIP("no usable CUDA device");
    rng = test_seed();
    REQUIRE(tkv_backend_create("cpu", 0, &cpu) == TKV_OK, "%s", tkv_last_error());
    /* the reference configuration: the 4-load GEMV everywhere, plain
     * launches; the defaults (auto, PDL) are each checked against it */
    setenv("TKV_CUDA_GEMV", "fast", 1);
    setenv("TKV_CUDA_PDL", "0", 1);
    setenv("TKV_CUDA_GEMV_QUANT", "0", 1); /* the f16 GEMVs for every weight type; the quantized one: gpu_q */
    REQUIRE(tkv_backend_create("cuda", 0, &gpu) == TKV_OK, "%s", tkv_last_error());
    unsetenv("TKV_CUDA_PDL");
    REQUIRE(!strcmp(gpu->ops->name, "cuda"), "backend %s", gpu->ops->name);
    setenv("TKV_CUDA_GEMV", "ref", 1);
    REQUIRE(tkv_backend_create("cuda", 0, &gpu_gemv_ref) == TKV_OK, "%s", tkv_last_error());
    setenv("TKV_CUDA_GEMV", "cublas", 1);
    REQUIRE(tkv_backend_create("cuda", 0, &gpu_gemv_blas) == TKV_OK, "%s", tkv_last_error());
    setenv("TKV_CUDA_GEMV", "u8", 1);
    REQUIRE(tkv_backend_create("cuda", 0, &gpu_gemv_u8) == TKV_OK, "%s", tkv_last_error());
    setenv("TKV_CUDA_GEMV", "auto", 1);
    REQUIRE(tkv_backend_create("cuda", 0, &gpu_gemv_auto) == TKV_OK, "%s", tkv_last_error());
    unsetenv("TKV_CUDA_GEMV");
    unsetenv("TKV_CUDA_GEMV_QUANT");
    REQUIRE(tkv_backend_create("cuda", 0, &gpu_q) == TKV_OK, "%s", tkv_last_error());
    setenv("TKV_CUDA_GEMV_QUANT", "pair", 1);
    REQUIRE(tkv_backend_create("cuda", 0, &gpu_q_pair) == TKV_OK, "%s", tkv_last_error());
    setenv("TKV_CUDA_GEMV_QUANT", "single", 1);
    REQUIRE(tkv_backend_create("cuda", 0, &gpu_q_single) == TKV_OK, "%s", tkv_last_error());
    setenv("TKV_CUDA_GEMV_QUANT", "ref", 1);
    REQUIRE(tkv_backend_create("cuda", 0, &gpu_q_ref) == TKV_OK, "%s", tkv_last_error());
    unsetenv("TKV_CUDA_GEMV_QUANT");
    const clock_t t0 = clock();
    /* TKV_TEST_ONLY=attention (say) runs one section: for compute-sanitizer */
    const char *only = getenv("TKV_TEST_ONLY");
#define SECTION(name, fn)                     \
    if (!only || !strcmp(only, name))        \
        fn();
    SECTION("matmul", test_matmul);
    SECTION("get_rows", test_get_rows);
    SECTION("rmsnorm", test_rmsnorm);
    SECTION("rope", test_rope);
    SECTION("swiglu", test_swiglu_add);
    SECTION("kv_write", test_kv_write);
    SECTION("kv_write", test_kv_write_heads);
    SECTION("fused", test_fused);
    SECTION("quant", test_quant);
    SECTION("matmul_add", test_matmul_add);
    SECTION("attn_q8", test_attn_q8);
    SECTION("pdl", test_pdl);
    SECTION("profile", test_profile);
    SECTION("attention", test_attention);
    SECTION("stats", test_stats);
    SECTION("f32", test_f32_mode);
    SECTION("host", test_host_memory);
    SECTION("errors", test_errors);
    fprintf(stderr, "(%.1f s of CPU time)\n", (double)(clock() - t0) / CLOCKS_PER_SEC);
    gpu_gemv_ref->ops->free(gpu_gemv_ref);
    gpu_gemv_blas->ops->free(gpu_gemv_blas);
    gpu_gemv_u8->ops->free(gpu_gemv_u8);
    gpu_gemv_auto->ops->free(gpu_gemv_auto);
    gpu_q->ops->free(gpu_q);
    gpu_q_pair->ops->free(gpu_q_pair);
    gpu_q_single->ops->free(gpu_q_single);
    gpu_q_ref->ops->free(gpu_q_ref);
    gpu->ops->free(gpu);
    cpu->ops->free(cpu);
    return test_done();
}
