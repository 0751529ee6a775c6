/*
 * bench-decode.c -- end-to-end decode speed of a model against its roofline:
 * the time a step needs to read the weights and the KV once at the memory
 * bandwidth measured in the same run.
 *
 *   bench-decode -m MODEL [--device cpu|cuda] [--ctx 4096,32768,131072] [--steps 32]
 *                [--fill synthetic|prefill|synthetic,prefill] [--real N] [-t threads]
 *                [--bw-mib 1024] [-j out.jsonl] [--skip OPS ...]
 *
 * For each context N and each fill, a fresh session (policy full, KV blocks
 * of 64 tokens, the whole KV in the compute tier) gets N tokens of context;
 * then 2 warm-up steps and `steps` timed decode steps (greedy; tkv_decode
 * brings the logits to the host, so its wall time is a whole step).
 *
 *   prefill    a real prefill of N random token ids
 *   synthetic  a real prefill of the first --real tokens (default 512), the
 *              rest of the KV copies of those blocks (runtime/kv-synth.h):
 *              the same bytes for a step to read, without minutes of prefill
 *              at 128K on an 8B model. Labelled in the table and the JSON.
 *
 * roofline = (weight bytes a step reads + KV bytes it reads) / bandwidth
 *   weights    every layer matrix and norm, the output norm and matrix, one
 *              embedding row, as the file stores them. The CUDA backend
 *              dequantizes quantized files to f16 at load, so for them a
 *              second ratio counts the matrices at 2 bytes per weight.
 *   KV         layers x KV heads x keys x head_dim x 2 (K and V) x 2 bytes,
 *              averaged over the timed steps' key counts
 *   bandwidth  cuda: a device-to-device copy of --bw-mib MiB through the
 *              backend (ops->copy; bytes read + written; best of 5 batches of
 *              10), with the rate of the `add` op beside it. cpu: a read of
 *              --bw-mib MiB by -t threads and a memcpy of it (bytes read +
 *              written), best of 5 each; the faster is the roofline's.
 *              Measured before the runs and again after them; the roofline
 *              uses the first.
 * ratio = mean step time / roofline time (1.0: the step runs at the bandwidth).
 * wait = the host's time a step inside the backend's download (a patched op
 *   table wraps it): on CUDA, where tkv_decode waits for the device to finish
 *   the step and copy the logits. A wait near 0 means the device ran out of
 *   queued work: the step was bound by the host issuing it. (On the CPU the
 *   backend computes in its ops, so the wait is only the logits' memcpy.)
 * Prints a Markdown table; -j writes one JSON object per row to a file.
 * With TKV_CUDA_PROFILE=1 (CUDA), each row's timed steps' op profile goes to
 * stderr (docs/gpu.md, "Op profile"); the profile slows the steps down a little.
 *
 * --skip OPS (repeatable; each one more run per context and fill): a
 * leave-one-out timing. The timed steps run with the named ops turned into
 * no-ops (a patched copy of the backend's op table; the session's own ops run
 * the fill and are untouched), so the step time falls by what those ops cost
 * inside the real launch chain, their overlap with their neighbours included
 * -- what an op profile, which puts events between ops, cannot show. The
 * logits are meaningless (garbage in, finiteness not checked); only the time
 * is. OPS: "none" or a comma list of norm (add_rmsnorm and rmsnorm), rope
 * (rope_qk), kvw (kv_write_heads), attn (attention), qkv (matmul_group), ffn
 * (matmul_swiglu), and the three plain matmuls of a fused decode step, told
 * apart by their order (per step 2 per layer, wo then down, then the output):
 * wo, down, output.
 */
#include "runtime/backend.h"
#include "runtime/kv-synth.h"

#include "bench.h"
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define WARMUP_STEPS 2
#define MAX_SKIPS 16
#define MIN_(a, b) ((a) < (b) ? (a) : (b))

static void usage(void)
{
    fprintf(stderr, "usage: bench-decode -m MODEL [--device cpu|cuda] [--ctx 4096,32768,131072] [--steps 32]\n"
                    "                    [--fill synthetic|prefill|synthetic,prefill] [--real 512] [-t threads]\n"
                    "                    [--bw-mib 1024] [-j out.jsonl] [--skip none|OP,OP.. ...]\n");
}

static int die(const char *what)
{
    fprintf(stderr, "bench-decode: %s: %s\n", what, tkv_last_error());
    return 1;
}

static int cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* ---- bandwidth ---------------------------------------------------------------- */

struct bw {
    const char *kind;    /* what the roofline uses: "copy" or "read" (or "add") */
    double gbps;         /* its rate                                            */
    const char *kind2;   /* the other measure, for reference                    */
    double gbps2;
};

/* CPU: T threads each read (or copy) a slice of the buffer. */
struct cpu_job {
    const uint64_t *src;
    uint64_t *dst;
    size_t words;
    uint64_t sum;
};
static volatile uint64_t bw_sink;

/* Sums the slice in four 64-byte vectors (whatever SIMD the build targets):
 * the loads, not the adds, are the limit. */
typedef uint64_t v8u64 __attribute__((vector_size(64)));
static void *read_slice(void *arg)
{
    struct cpu_job *j = arg;
    const size_t nv = j->words / 8;
    v8u64 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    size_t i = 0;
    for (; i + 4 <= nv; i += 4) {
        v8u64 x0, x1, x2, x3;
        memcpy(&x0, j->src + 8 * i, 64), memcpy(&x1, j->src + 8 * (i + 1), 64);
        memcpy(&x2, j->src + 8 * (i + 2), 64), memcpy(&x3, j->src + 8 * (i + 3), 64);
        a0 += x0, a1 += x1, a2 += x2, a3 += x3;
    }
    a0 += a1 + a2 + a3;
    uint64_t sum = 0;
    for (int k = 0; k < 8; k++)
        sum += a0[k];
    for (i *= 8; i < j->words; i++)
        sum += j->src[i];
    j->sum = sum;
    return NULL;
}

static void *copy_slice(void *arg)
{
    struct cpu_job *j = arg;
    memcpy(j->dst, j->src, j->words * 8);
    return NULL;
}

/* Seconds for T threads to run fn over `words` words; -1 if a thread failed to start. */
static double run_threads(void *(*fn)(void *), const uint64_t *src, uint64_t *dst, size_t words, int T)
{
    pthread_t th[256];
    struct cpu_job jobs[256];
    const size_t per = (words / T + 7) / 8 * 8; /* 64-byte slices */
    const double t0 = now();
    int started = 0;
    for (int i = 0; i < T; i++) {
        const size_t o = MIN_((size_t)i * per, words);
        jobs[i] = (struct cpu_job){src + o, dst ? dst + o : NULL, MIN_(per, words - o), 0};
        if (pthread_create(&th[i], NULL, fn, &jobs[i]) != 0)
            break;
        started++;
    }
    uint64_t sum = 0;
    for (int i = 0; i < started; i++) {
        pthread_join(th[i], NULL);
        sum += jobs[i].sum;
    }
    const double t = now() - t0;
    bw_sink = sum;
    return started == T ? t : -1;
}

static int cpu_bandwidth(size_t bytes, int T, struct bw *out)
{
    const size_t words = bytes / 8;
    uint64_t *a = malloc(words * 8), *b = malloc(words * 8);
    if (!a || !b) {
        fprintf(stderr, "bench-decode: cannot allocate 2 x %zu MiB for the bandwidth\n", bytes >> 20);
        free(a), free(b);
        return 1;
    }
    for (size_t i = 0; i < words; i++) /* touches every page before the timing */
        a[i] = i, b[i] = 0;
    double best_read = 0, best_copy = 0;
    for (int r = 0; r < 6; r++) { /* the first round warms up */
        const double tr = run_threads(read_slice, a, NULL, words, T);
        const double tc = run_threads(copy_slice, a, b, words, T);
        if (tr <= 0 || tc <= 0) {
            fprintf(stderr, "bench-decode: cannot start %d threads\n", T);
            free(a), free(b);
            return 1;
        }
        if (r > 0) {
            best_read = fmax(best_read, words * 8.0 / tr / 1e9);
            best_copy = fmax(best_copy, words * 16.0 / tc / 1e9);
        }
    }
    free(a), free(b);
    /* the faster of the two is the bandwidth the roofline holds a step to */
    *out = best_read >= best_copy ? (struct bw){"read", best_read, "copy", best_copy}
                                  : (struct bw){"copy", best_copy, "read", best_read};
    return 0;
}

static int check(tkv_status st, const char *what)
{
    if (st != TKV_OK)
        fprintf(stderr, "bench-decode: bandwidth, %s: %s\n", what, tkv_last_error());
    return st != TKV_OK;
}

/* Best of 5 batches of 10 calls of `call`, as GB/s over bytes_per_call. */
#define BEST_RATE(be, bytes_per_call, call, out)                                \
    do {                                                                      \
        double best_ = 0;                                                     \
        for (int b_ = 0; b_ < 6 && !failed; b_++) {                            \
            const double t0_ = now();                                         \
            for (int r_ = 0; r_ < 10 && !failed; r_++)                         \
                failed = check(call, #call);                                  \
            failed = failed || check((be)->ops->synchronize(be), "synchronize"); \
            if (b_ > 0) /* the first batch warms up */                        \
                best_ = fmax(best_, 10.0 * (bytes_per_call) / (now() - t0_) / 1e9); \
        }                                                                     \
        (out) = best_;                                                        \
    } while (0)

/* A backend's memory through its ops: copy (if it has the op) and add. */
static int backend_bandwidth(const char *device, size_t bytes, struct bw *out)
{
    struct tkv_backend *be;
    if (tkv_backend_create(device, 0, &be) != TKV_OK)
        return die("bandwidth: backend");
    void *a = NULL, *b = NULL;
    int failed = check(be->ops->alloc(be, bytes, &a), "alloc") || check(be->ops->alloc(be, bytes, &b), "alloc");
    const size_t chunk = (size_t)64 << 20;
    void *zeros = calloc(1, chunk);
    failed = failed || !zeros;
    for (size_t o = 0; o < bytes && !failed; o += chunk) {
        const size_t n = MIN_(chunk, bytes - o);
        failed = check(be->ops->upload(be, (char *)a + o, zeros, n), "upload") ||
                 check(be->ops->upload(be, (char *)b + o, zeros, n), "upload");
    }
    double copy = 0, add = 0;
    if (be->ops->copy)
        BEST_RATE(be, 2.0 * bytes, be->ops->copy(be, b, a, bytes), copy);
    const size_t count = bytes / sizeof(float);
    BEST_RATE(be, 12.0 * count, be->ops->add(be, (float *)b, (const float *)a, count), add);
    free(zeros);
    if (a)
        be->ops->release(be, a);
    if (b)
        be->ops->release(be, b);
    be->ops->free(be);
    if (failed)
        return 1;
    *out = copy > 0 ? (struct bw){"copy", copy, "add", add} : (struct bw){"add", add, "-", 0};
    return 0;
}

/* ---- leave-one-out: ops turned into no-ops (--skip) ---------------------------------- */

enum {
    SKIP_NORM = 1 << 0,
    SKIP_ROPE = 1 << 1,
    SKIP_KVW = 1 << 2,
    SKIP_ATTN = 1 << 3,
    SKIP_QKV = 1 << 4,
    SKIP_FFN = 1 << 5,
    SKIP_WO = 1 << 6,
    SKIP_DOWN = 1 << 7,
    SKIP_OUTPUT = 1 << 8,
};
static const char *const skip_names[] = {"norm", "rope", "kvw", "attn", "qkv", "ffn", "wo", "down", "output"};

/* "none" or a comma list of skip_names -> a mask; -1 on an unknown name */
static int skip_parse(const char *list)
{
    if (!strcmp(list, "none"))
        return 0;
    int mask = 0;
    char *dup = strdup(list), *save = NULL;
    for (char *p = strtok_r(dup, ",", &save); p; p = strtok_r(NULL, ",", &save)) {
        int bit = -1;
        for (int i = 0; i < (int)(sizeof skip_names / sizeof *skip_names); i++)
            if (!strcmp(p, skip_names[i]))
                bit = i;
        if (bit < 0) {
            fprintf(stderr, "bench-decode: --skip: no op '%s' (norm rope kvw attn qkv ffn wo down output)\n", p);
            mask = -1;
            break;
        }
        mask |= 1 << bit;
    }
    free(dup);
    return mask;
}

/* The patched op table's state (run_one; one run at a time): the backend's
 * own ops, the leave-one-out's mask and counters, and the host's wait. */
static struct {
    const struct tkv_backend_ops *real;
    int mask;                  /* --skip: the ops made no-ops */
    uint32_t matmuls_per_step; /* 2 per layer + the output; 1 with matmul_add */
    uint64_t matmul_calls;     /* since the patch, which starts at a step */
    uint64_t matmul_add_calls; /* wo, down, wo, ... (the backend's matmul_add) */
    double wait_s;             /* seconds inside download since the timed steps began */
} patch;

static tkv_status skip_matmul(struct tkv_backend *b, const struct tkv_bweight *w, const float *x, float *y, uint32_t n)
{
    const uint64_t k = patch.matmul_calls++ % patch.matmuls_per_step;
    const int role = k + 1 == patch.matmuls_per_step ? SKIP_OUTPUT : k % 2 ? SKIP_DOWN : SKIP_WO;
    return patch.mask & role ? TKV_OK : patch.real->matmul(b, w, x, y, n);
}
static tkv_status skip_matmul_add(struct tkv_backend *b, const struct tkv_bweight *w, const float *x, float *y,
                                  uint32_t n)
{
    const int role = patch.matmul_add_calls++ % 2 ? SKIP_DOWN : SKIP_WO;
    return patch.mask & role ? TKV_OK : patch.real->matmul_add(b, w, x, y, n);
}
static tkv_status skip_rmsnorm(struct tkv_backend *b, const float *x, const struct tkv_bweight *w, float *y,
                               uint32_t n, uint32_t dim, float eps)
{
    (void)b, (void)x, (void)w, (void)y, (void)n, (void)dim, (void)eps;
    return TKV_OK;
}
static tkv_status skip_add_rmsnorm(struct tkv_backend *b, float *y, const float *x, const struct tkv_bweight *w,
                                   float *h, uint32_t n, uint32_t dim, float eps)
{
    (void)b, (void)y, (void)x, (void)w, (void)h, (void)n, (void)dim, (void)eps;
    return TKV_OK;
}
static tkv_status skip_rope_qk(struct tkv_backend *b, float *q, float *k, uint32_t n, uint32_t n_head,
                               uint32_t n_head_kv, uint32_t head_dim, uint32_t rot_dim, const int32_t *pos,
                               float base, float freq_scale)
{
    (void)b, (void)q, (void)k, (void)n, (void)n_head, (void)n_head_kv, (void)head_dim, (void)rot_dim, (void)pos;
    (void)base, (void)freq_scale;
    return TKV_OK;
}
static tkv_status skip_kv_write_heads(struct tkv_backend *b, const float *k, const float *v, size_t stride,
                                      uint16_t *const *kdst, uint16_t *const *vdst, uint32_t n_heads,
                                      uint32_t n_rows, uint32_t head_dim)
{
    (void)b, (void)k, (void)v, (void)stride, (void)kdst, (void)vdst, (void)n_heads, (void)n_rows, (void)head_dim;
    return TKV_OK;
}
static tkv_status skip_attention(struct tkv_backend *b, const struct tkv_attn_args *a)
{
    (void)b, (void)a;
    return TKV_OK;
}
static tkv_status skip_matmul_group(struct tkv_backend *b, const struct tkv_bweight *const *w, uint32_t nw,
                                    const float *x, float *const *y, uint32_t n)
{
    (void)b, (void)w, (void)nw, (void)x, (void)y, (void)n;
    return TKV_OK;
}
static tkv_status skip_matmul_qkv_rope(struct tkv_backend *b, const struct tkv_bweight *const *w, const float *x,
                                       float *q, float *k, float *v, uint32_t n, uint32_t head_dim, uint32_t rot_dim,
                                       const int32_t *pos, float base, float freq_scale)
{
    (void)b, (void)w, (void)x, (void)q, (void)k, (void)v, (void)n, (void)head_dim, (void)rot_dim, (void)pos;
    (void)base, (void)freq_scale;
    return TKV_OK;
}
static tkv_status skip_matmul_swiglu(struct tkv_backend *b, const struct tkv_bweight *w_gate,
                                     const struct tkv_bweight *w_up, const float *x, float *out, uint32_t n)
{
    (void)b, (void)w_gate, (void)w_up, (void)x, (void)out, (void)n;
    return TKV_OK;
}

/* The backend's download, timed into patch.wait_s (the wait column: the
 * file's comment). */
static tkv_status timed_download(struct tkv_backend *b, void *dst_host, const void *src, size_t bytes)
{
    const double t = now();
    const tkv_status st = patch.real->download(b, dst_host, src, bytes);
    patch.wait_s += now() - t;
    return st;
}

/* Makes the ops in mask no-ops in *patched, a copy of patch.real (the
 * backend's own ops). The fused ops must be there (the step must be the
 * fused one the roles assume). */
static int skip_patch(int mask, uint32_t n_layer, struct tkv_backend_ops *patched)
{
    const struct tkv_backend_ops *o = patch.real;
    if (!o->matmul_group || !o->matmul_swiglu || !o->add_rmsnorm || !o->rope_qk || !o->kv_write_heads) {
        fprintf(stderr, "bench-decode: --skip needs the backend's fused decode ops (CUDA, TKV_FUSE unset)\n");
        return 1;
    }
    patch.mask = mask;
    patch.matmuls_per_step = o->matmul_add ? 1 : 2 * n_layer + 1;
    patch.matmul_calls = patch.matmul_add_calls = 0;
    if (mask & (SKIP_WO | SKIP_DOWN | SKIP_OUTPUT))
        patched->matmul = skip_matmul;
    if (o->matmul_add && (mask & (SKIP_WO | SKIP_DOWN)))
        patched->matmul_add = skip_matmul_add;
    if (mask & SKIP_NORM)
        patched->rmsnorm = skip_rmsnorm, patched->add_rmsnorm = skip_add_rmsnorm;
    if (mask & SKIP_ROPE)
        patched->rope_qk = skip_rope_qk;
    if (mask & SKIP_KVW)
        patched->kv_write_heads = skip_kv_write_heads;
    if (mask & SKIP_ATTN)
        patched->attention = skip_attention;
    if (mask & SKIP_QKV) /* with matmul_qkv_rope, the rotation goes with the products */
        patched->matmul_group = skip_matmul_group, patched->matmul_qkv_rope = skip_matmul_qkv_rope;
    if (mask & SKIP_FFN)
        patched->matmul_swiglu = skip_matmul_swiglu;
    return 0;
}

/* ---- one run ------------------------------------------------------------------ */

struct run {
    const char *fill;
    uint32_t ctx, real;            /* context; tokens really prefilled */
    double fill_s;
    double step_mean, step_median; /* seconds */
    double keys_mean;              /* keys a timed step attends to, on average */
    double wait_mean;              /* seconds a timed step waits for the device (timed_download) */
    int finite;                    /* the last logits are all finite */
};

static int run_one(const tkv_model *m, const char *device, uint32_t threads, uint32_t ctx, uint32_t steps,
                   const char *fill, uint32_t real, int skip_mask, struct run *r)
{
    struct tkv_model_info info;
    tkv_model_get_info(m, &info);
    tkv_token *toks = malloc((size_t)ctx * sizeof *toks);
    double *dt = malloc((size_t)steps * sizeof *dt);
    if (!toks || !dt) {
        free(toks), free(dt);
        fprintf(stderr, "bench-decode: out of memory\n");
        return 1;
    }
    for (uint32_t i = 0; i < ctx; i++)
        toks[i] = (tkv_token)(rnd() % info.n_vocab);
    struct tkv_session_params sp = tkv_session_default_params();
    sp.n_ctx = ctx + WARMUP_STEPS + steps;
    sp.n_threads = threads;
    sp.device = device;
    tkv_session *s;
    if (tkv_session_init(m, &sp, &s) != TKV_OK) {
        free(toks), free(dt);
        return die("session");
    }
    *r = (struct run){.fill = fill, .ctx = ctx, .real = ctx};
    const double t0 = now();
    tkv_status st = !strcmp(fill, "prefill") ? tkv_prefill(s, toks, ctx)
                                             : tkv_session_fill_synthetic(s, toks, ctx, real, &r->real);
    r->fill_s = now() - t0;
    free(toks);
    if (st != TKV_OK) {
        tkv_session_free(s);
        free(dt);
        return die(fill);
    }
    tkv_token tok = tkv_argmax(tkv_logits(s), info.n_vocab);
    double keys = 0;
    struct tkv_backend *be = tkv_session_backend(s); /* its op profile, when it keeps one */
    const struct tkv_backend_ops *own_ops = be->ops;
    struct tkv_backend_ops patched = *own_ops;
    patch.real = own_ops;
    if (skip_mask > 0 && skip_patch(skip_mask, info.n_layer, &patched)) {
        tkv_session_free(s);
        free(dt);
        return 1;
    }
    patched.download = timed_download;
    be->ops = &patched;
    for (uint32_t i = 0; i < WARMUP_STEPS + steps; i++) {
        if (i == WARMUP_STEPS) {
            patch.wait_s = 0;
            if (be->ops->profile_reset)
                be->ops->profile_reset(be);
        }
        const double t1 = now();
        if (tkv_decode(s, tok) != TKV_OK) {
            be->ops = own_ops;
            tkv_session_free(s);
            free(dt);
            return die("decode");
        }
        const double t = now() - t1;
        if (i >= WARMUP_STEPS) {
            dt[i - WARMUP_STEPS] = t;
            keys += (double)tkv_session_n_past(s);
        }
        tok = tkv_argmax(tkv_logits(s), info.n_vocab);
    }
    char label[128]; /* TKV_CUDA_PROFILE=1: the timed steps' ops, to stderr */
    snprintf(label, sizeof label, "ctx %u, fill %s, %u timed decode steps", ctx, fill, steps);
    bench_profile_print(be, label, steps);
    const float *lg = tkv_logits(s);
    r->finite = 1;
    for (uint32_t i = 0; i < info.n_vocab; i++)
        r->finite &= isfinite(lg[i]) != 0;
    r->finite |= skip_mask > 0; /* skipped ops leave garbage: only the time counts */
    be->ops = own_ops;
    tkv_session_free(s);
    double sum = 0;
    for (uint32_t i = 0; i < steps; i++)
        sum += dt[i];
    qsort(dt, steps, sizeof *dt, cmp_double);
    r->step_mean = sum / steps;
    r->step_median = steps % 2 ? dt[steps / 2] : (dt[steps / 2 - 1] + dt[steps / 2]) / 2;
    r->keys_mean = keys / steps;
    r->wait_mean = patch.wait_s / steps;
    free(dt);
    return 0;
}

int main(int argc, char **argv)
{
    const char *model = NULL, *device = NULL, *ctxs = "4096,32768,131072", *fills = "synthetic", *json_path = NULL;
    uint32_t steps = 32, real = 512, threads = 0, bw_mib = 1024;
    const char *skip_label[MAX_SKIPS] = {"none"};
    int skip_mask[MAX_SKIPS] = {0}, n_skip = 0; /* no --skip: one run, nothing skipped */
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) {
            usage();
            return 2;
        }
        if (!strcmp(a, "-m"))
            model = v;
        else if (!strcmp(a, "--device"))
            device = v;
        else if (!strcmp(a, "--ctx"))
            ctxs = v;
        else if (!strcmp(a, "--steps"))
            steps = (uint32_t)atoi(v);
        else if (!strcmp(a, "--fill"))
            fills = v;
        else if (!strcmp(a, "--real"))
            real = (uint32_t)atoi(v);
        else if (!strcmp(a, "-t"))
            threads = (uint32_t)atoi(v);
        else if (!strcmp(a, "--bw-mib"))
            bw_mib = (uint32_t)atoi(v);
        else if (!strcmp(a, "-j"))
            json_path = v;
        else if (!strcmp(a, "--skip")) {
            if (n_skip == MAX_SKIPS || (skip_mask[n_skip] = skip_parse(v)) < 0) {
                fprintf(stderr, "bench-decode: at most %d --skip, each known ops\n", MAX_SKIPS);
                return 2;
            }
            skip_label[n_skip++] = v;
        } else {
            usage();
            return 2;
        }
        i++;
    }
    if (!model || steps == 0 || real == 0 || bw_mib == 0) {
        usage();
        return 2;
    }
    if (!device)
        device = tkv_backend_cuda_devices() > 0 ? "cuda" : "cpu";
    const bool cuda = !strcmp(device, "cuda");
    if (!cuda && strcmp(device, "cpu") != 0) {
        fprintf(stderr, "bench-decode: --device is cpu or cuda, not '%s'\n", device);
        return 2;
    }
    if (cuda && tkv_backend_cuda_devices() == 0) {
        fprintf(stderr, "bench-decode: no CUDA device\n");
        return 77;
    }
    char *fcheck = strdup(fills), *save_chk = NULL;
    for (char *p = strtok_r(fcheck, ",", &save_chk); p; p = strtok_r(NULL, ",", &save_chk))
        if (strcmp(p, "synthetic") != 0 && strcmp(p, "prefill") != 0) {
            fprintf(stderr, "bench-decode: --fill takes synthetic and/or prefill, not '%s'\n", p);
            return 2;
        }
    free(fcheck);
    char *ccheck = strdup(ctxs);
    for (char *p = strtok_r(ccheck, ",", &save_chk); p; p = strtok_r(NULL, ",", &save_chk)) {
        char *end;
        const unsigned long c = strtoul(p, &end, 10);
        if (*end || c == 0 || c > UINT32_MAX) {
            fprintf(stderr, "bench-decode: --ctx takes positive token counts, not '%s'\n", p);
            free(ccheck);
            return 2;
        }
    }
    free(ccheck);
    FILE *json = NULL;
    if (json_path && !(json = fopen(json_path, "w"))) {
        fprintf(stderr, "bench-decode: cannot write %s\n", json_path);
        return 1;
    }
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    const int T = threads ? (int)threads : (int)(cores > 0 ? MIN_(cores, 256) : 1);
    if (T > 256) {
        fprintf(stderr, "bench-decode: at most 256 threads\n");
        return 2;
    }

    const size_t bw_bytes = (size_t)bw_mib << 20;
    struct bw bw, bw_after;
    if (cuda ? backend_bandwidth(device, bw_bytes, &bw) : cpu_bandwidth(bw_bytes, T, &bw))
        return 1;

    tkv_model *m;
    if (tkv_model_load(model, &m) != TKV_OK)
        return die("load");
    struct tkv_model_info info;
    tkv_model_get_info(m, &info);
    struct tkv_decode_bytes wb;
    tkv_model_decode_bytes(m, &wb);
    const double kv_per_key = (double)info.n_layer * info.n_head_kv * info.head_dim * 2 * 2;
    const bool quantized_on_gpu = cuda && wb.weights_f16 != wb.weights;
    const char *base = strrchr(model, '/') ? strrchr(model, '/') + 1 : model;
    char commit[64];
    build_commit(commit, sizeof commit);

    printf("bench-decode: %s (%u layers, %u/%u heads, head_dim %u, vocab %u, matrices %s), device %s, %d threads, "
           "commit %s\n",
           base, info.n_layer, info.n_head, info.n_head_kv, info.head_dim, info.n_vocab, wb.matrix_type, device, T,
           commit);
    printf("per step: weights %.1f MB as stored (%.1f MB with f16 matrices), KV %.1f KB per key\n", wb.weights / 1e6,
           wb.weights_f16 / 1e6, kv_per_key / 1e3);
    printf("bandwidth (%zu MiB): %s %.1f GB/s (the roofline's), %s %.1f GB/s\n\n", bw_bytes >> 20, bw.kind, bw.gbps,
           bw.kind2, bw.gbps2);
    const bool skipping = n_skip > 0;
    if (!skipping)
        n_skip = 1; /* one run, skip_mask[0] = 0 */
    printf("| model | device | weights | ctx | fill |%s step ms (mean) | step ms (median) | tok/s | roofline ms "
           "| ratio |%s wait ms | fill s |\n",
           skipping ? " skipped |" : "", quantized_on_gpu ? " ratio, f16 matrices |" : "");
    printf("|---|---|---|---:|---|%s---:|---:|---:|---:|---:|%s---:|---:|\n", skipping ? "---|" : "",
           quantized_on_gpu ? "---:|" : "");
    fflush(stdout);

    int rc = 0;
    char *list = strdup(ctxs), *save_c = NULL;
    for (char *c = strtok_r(list, ",", &save_c); c && !rc; c = strtok_r(NULL, ",", &save_c)) {
        const uint32_t ctx = (uint32_t)strtoul(c, NULL, 10); /* checked above */
        char *fl = strdup(fills), *save_f = NULL;
        for (char *f = strtok_r(fl, ",", &save_f); f && !rc; f = strtok_r(NULL, ",", &save_f)) {
            for (int k = 0; k < n_skip && !rc; k++) {
                struct run r;
                if ((rc = run_one(m, device, threads, ctx, steps, f, real, skip_mask[k], &r)) != 0)
                    break;
                const double roof = (wb.weights + kv_per_key * r.keys_mean) / (bw.gbps * 1e9);
                const double roof16 = (wb.weights_f16 + kv_per_key * r.keys_mean) / (bw.gbps * 1e9);
                char fill_label[64];
                if (!strcmp(f, "synthetic"))
                    snprintf(fill_label, sizeof fill_label, "synthetic (%u real)", r.real);
                else
                    snprintf(fill_label, sizeof fill_label, "prefill");
                char extra[32] = "";
                if (quantized_on_gpu)
                    snprintf(extra, sizeof extra, " %.2f |", r.step_mean / roof16);
                char skip_col[96] = "";
                if (skipping)
                    snprintf(skip_col, sizeof skip_col, " %s |", skip_label[k]);
                printf("| %s | %s | %s | %u | %s |%s %.3f | %.3f | %.1f | %.3f | %.2f |%s %.3f | %.1f |%s\n", base,
                       device, wb.matrix_type, ctx, fill_label, skip_col, r.step_mean * 1e3, r.step_median * 1e3,
                       1.0 / r.step_mean, roof * 1e3, r.step_mean / roof, extra, r.wait_mean * 1e3, r.fill_s,
                       r.finite ? "" : " (non-finite logits!)");
                fflush(stdout);
                if (json) {
                    fprintf(json,
                            "{\"bench\": \"decode\", \"model\": \"%s\", \"matrix_type\": \"%s\", \"device\": \"%s\", "
                            "\"threads\": %d, \"ctx\": %u, \"fill\": \"%s\", \"real_tokens\": %u, \"fill_s\": %.3f, "
                            "\"steps\": %u, \"keys_mean\": %.1f, \"step_ms_mean\": %.4f, \"step_ms_median\": %.4f, "
                            "\"wait_ms_mean\": %.4f, "
                            "\"tok_s\": %.3f, \"weight_bytes\": %llu, \"weight_bytes_f16\": %llu, "
                            "\"kv_bytes_per_step\": %.0f, \"bw_kind\": \"%s\", \"bw_gbps\": %.2f, "
                            "\"bw2_kind\": \"%s\", \"bw2_gbps\": %.2f, \"roofline_ms\": %.4f, \"ratio\": %.4f, "
                            "\"roofline_ms_f16_matrices\": %.4f, \"ratio_f16_matrices\": %.4f, \"logits_finite\": %s, "
                            "\"skipped\": \"%s\", \"commit\": \"%s\"}\n",
                            base, wb.matrix_type, device, T, ctx, f, r.real, r.fill_s, steps, r.keys_mean,
                            r.step_mean * 1e3, r.step_median * 1e3, r.wait_mean * 1e3, 1.0 / r.step_mean,
                            (unsigned long long)wb.weights,
                            (unsigned long long)wb.weights_f16, kv_per_key * r.keys_mean, bw.kind, bw.gbps, bw.kind2,
                            bw.gbps2, roof * 1e3, r.step_mean / roof, roof16 * 1e3, r.step_mean / roof16,
                            r.finite ? "true" : "false", skip_label[k], commit);
                    fflush(json);
                }
                if (!r.finite)
                    rc = 1;
            }
        }
        free(fl);
    }
    free(list);
    tkv_model_free(m);
    if (!rc && (cuda ? backend_bandwidth(device, bw_bytes, &bw_after) : cpu_bandwidth(bw_bytes, T, &bw_after)) == 0)
        printf("\nbandwidth again after the runs: %s %.1f GB/s, %s %.1f GB/s\n", bw_after.kind, bw_after.gbps,
               bw_after.kind2, bw_after.gbps2);
    printf("ratio = mean step / roofline; roofline = (weights + KV a step reads) / %s bandwidth; wait = the host's "
           "time a step inside the backend's download, waiting for the device (near 0: the step is host-bound); "
           "fill: synthetic = "
           "the first tokens prefilled, the rest of the KV copies of their blocks (runtime/kv-synth.h); %u timed "
           "steps after %d warm-up\n",
           bw.kind, steps, WARMUP_STEPS);
    if (json)
        fclose(json);
    return rc;
}
