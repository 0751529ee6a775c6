/*
 * cpu-backend.c -- the CPU implementation of struct tkv_backend_ops.
 *
 * Matmul has two paths, chosen by the number of tokens:
 *   - one token (decode): the activations are quantized once to the weight
 *     type's partner format and every output is one quantized dot product
 *     (cpu/quant.h), output rows split across threads; Q8_0 matrices (the
 *     output projection) take f32 activations instead;
 *   - more tokens (prefill): each thread dequantizes a tile of weight rows
 *     to f32 and multiplies it with all tokens at once (OpenBLAS sgemm,
 *     single-threaded inside our pool).
 * Memory is plain host memory; weights are used in place from the mapping.
 */
#include "cpu.h"
#include "quant.h"
#include "../runtime/rabitq/rabitq.h"

#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* A single token (decode) uses quantized dot products; two or more use f32
 * activations against dequantized tiles (sgemm). Prefill therefore computes
 * with exact activations: its logits match a float64 evaluation of the
 * quantized model to ~1e-3, where 8-bit activations (llama.cpp's choice
 * everywhere) move them by ~0.1-0.5 (tests/test-reference.c prints both). */
#define MATMUL_BLAS_MIN_TOKENS 2
/* Weight rows per dequantized tile in the sgemm path. */
#define MATMUL_TILE_ROWS 64

void openblas_set_num_threads(int num_threads);
char *openblas_get_corename(void);

struct tkv_bweight {
    const struct tkv_gguf_tensor *t;
    uint32_t type;
    uint32_t n_in, n_out;
    size_t row_bytes;
    const uint8_t *data;
};

static struct tkv_cpu_backend *cpu_of(struct tkv_backend *b) { return (struct tkv_cpu_backend *)b; }

float *tkv_cpu_scratch(struct tkv_cpu_backend *cb, uint32_t ith, size_t n)
{
    struct tkv_cpu_scratch *s = &cb->scratch[ith];
    if (n > s->cap) {
        float *p = realloc(s->buf, n * sizeof(float));
        if (!p)
            return NULL;
        s->buf = p;
        s->cap = n;
    }
    return s->buf;
}

/* ---- memory --------------------------------------------------------------- */

static tkv_status cpu_alloc(struct tkv_backend *b, size_t bytes, void **out)
{
    *out = NULL;
    if (bytes == 0)
        bytes = 1;
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes) != 0)
        return tkv_err(TKV_ERR_NOMEM, "cpu: cannot allocate %zu bytes of host memory", bytes);
    *out = p;
    return TKV_OK;
}

static void cpu_release(struct tkv_backend *b, void *p) { free(p); }

static tkv_status cpu_copy(struct tkv_backend *b, void *dst, const void *src, size_t bytes)
{
    memcpy(dst, src, bytes);
    return TKV_OK;
}

static tkv_status cpu_sync(struct tkv_backend *b) { return TKV_OK; }

/* ---- weights -------------------------------------------------------------- */

static tkv_status cpu_weight_init(struct tkv_backend *b, const struct tkv_gguf_tensor *t, struct tkv_bweight **out)
{
    const struct tkv_type_traits *tr = tkv_type_traits(t->type);
    if (!tr || !tr->weights_ok)
        return tkv_err(TKV_ERR_UNSUPPORTED, "cpu: unsupported type %s in tensor %s", tkv_type_name(t->type), t->name);
    if (t->n_dims > 2 || t->ne[0] > UINT32_MAX || t->ne[1] > UINT32_MAX)
        return tkv_err(TKV_ERR_UNSUPPORTED, "cpu: tensor %s is not a matrix or vector", t->name);
    struct tkv_bweight *w = calloc(1, sizeof *w);
    if (!w)
        return tkv_err(TKV_ERR_NOMEM, "cpu: out of memory");
    w->t = t;
    w->type = t->type;
    w->n_in = (uint32_t)t->ne[0];
    w->n_out = (uint32_t)t->ne[1];
    w->row_bytes = (size_t)(t->ne[0] / tr->block_elems) * tr->block_bytes;
    w->data = t->data;
    *out = w;
    return TKV_OK;
}

static void cpu_weight_free(struct tkv_backend *b, struct tkv_bweight *w) { free(w); }

static tkv_status cpu_get_rows(struct tkv_backend *b, const struct tkv_bweight *w, const int32_t *ids, uint32_t n,
                               float *out)
{
    for (uint32_t i = 0; i < n; i++) {
        if (ids[i] < 0 || (uint32_t)ids[i] >= w->n_out)
            return tkv_err(TKV_ERR_INVALID_ARG, "cpu: token id %d out of range [0, %u) for %s", ids[i], w->n_out,
                           w->t->name);
        tkv_dequant_row(w->type, w->data + (size_t)ids[i] * w->row_bytes, out + (size_t)i * w->n_in, w->n_in);
    }
    return TKV_OK;
}

/* ---- matmul ------------------------------------------------------------- */

struct matmul_job {
    struct tkv_cpu_backend *cb;
    const struct tkv_bweight *w;
    const float *x;
    float *y;
    uint32_t n;
    size_t act_bytes; /* per token, quantized path */
    bool oom;
};

/* Q8_0 weights times an f32 activation row (dequantized on the fly). Used
 * for Q8_0 matrices at decode -- in llama.cpp files typically the output
 * projection, where 8-bit activations would cost ~0.1 in every logit. */
static float dot_q8_0_f32(const tkv_block_q8_0 *w, const float *x, int64_t n)
{
    const int64_t nb = n / TKV_QK8_0;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const __m512 d = _mm512_set1_ps(tkv_fp16_to_fp32(w[b].d));
        const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)w[b].qs)));
        const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w[b].qs + 16))));
        const __m512 s = _mm512_fmadd_ps(q1, _mm512_loadu_ps(x + b * 32 + 16), _mm512_mul_ps(q0, _mm512_loadu_ps(x + b * 32)));
        acc = _mm512_fmadd_ps(d, s, acc);
    }
    return _mm512_reduce_add_ps(acc);
#else
    float acc = 0;
    for (int64_t b = 0; b < nb; b++) {
        float s = 0;
        for (int j = 0; j < TKV_QK8_0; j++)
            s += (float)w[b].qs[j] * x[b * 32 + j];
        acc += tkv_fp16_to_fp32(w[b].d) * s;
    }
    return acc;
#endif
}

static void matmul_q8_0_f32_worker(void *ctx, uint32_t ith, uint32_t nth)
{
    struct matmul_job *j = ctx;
    const struct tkv_bweight *w = j->w;
    uint64_t r0, r1;
    tkv_split(w->n_out, ith, nth, &r0, &r1);
    for (uint64_t r = r0; r < r1; r++) {
        const tkv_block_q8_0 *row = (const tkv_block_q8_0 *)(w->data + r * w->row_bytes);
        for (uint32_t i = 0; i < j->n; i++)
            j->y[(size_t)i * w->n_out + r] = dot_q8_0_f32(row, j->x + (size_t)i * w->n_in, w->n_in);
    }
}

static void matmul_dot_worker(void *ctx, uint32_t ith, uint32_t nth)
{
    struct matmul_job *j = ctx;
    const struct tkv_bweight *w = j->w;
    uint64_t r0, r1;
    tkv_split(w->n_out, ith, nth, &r0, &r1);
    const uint8_t *act = j->cb->act;
    for (uint64_t r = r0; r < r1; r++) {
        const uint8_t *row = w->data + r * w->row_bytes;
        for (uint32_t i = 0; i < j->n; i++)
            j->y[(size_t)i * w->n_out + r] = tkv_vec_dot(w->type, row, act + i * j->act_bytes, w->n_in);
    }
}

static void matmul_blas_worker(void *ctx, uint32_t ith, uint32_t nth)
{
    struct matmul_job *j = ctx;
    const struct tkv_bweight *w = j->w;
    const uint64_t n_tiles = (w->n_out + MATMUL_TILE_ROWS - 1) / MATMUL_TILE_ROWS;
    uint64_t t0, t1;
    tkv_split(n_tiles, ith, nth, &t0, &t1);
    float *tile = NULL;
    if (w->type != TKV_TYPE_F32 && t1 > t0) {
        tile = tkv_cpu_scratch(j->cb, ith, (size_t)MATMUL_TILE_ROWS * w->n_in);
        if (!tile) {
            j->oom = true;
            return;
        }
    }
    for (uint64_t t = t0; t < t1; t++) {
        const uint32_t r0 = (uint32_t)(t * MATMUL_TILE_ROWS), rows = TKV_MIN(MATMUL_TILE_ROWS, w->n_out - r0);
        const float *wt;
        if (w->type == TKV_TYPE_F32)
            wt = (const float *)(w->data + (size_t)r0 * w->row_bytes);
        else {
            for (uint32_t r = 0; r < rows; r++)
                tkv_dequant_row(w->type, w->data + (size_t)(r0 + r) * w->row_bytes, tile + (size_t)r * w->n_in,
                                w->n_in);
            wt = tile;
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)j->n, (int)rows, (int)w->n_in, 1.0f, j->x,
                    (int)w->n_in, wt, (int)w->n_in, 0.0f, j->y + r0, (int)w->n_out);
    }
}

static tkv_status cpu_matmul(struct tkv_backend *b, const struct tkv_bweight *w, const float *x, float *y, uint32_t n)
{
    struct tkv_cpu_backend *cb = cpu_of(b);
    struct matmul_job job = {.cb = cb, .w = w, .x = x, .y = y, .n = n};
    if (n >= MATMUL_BLAS_MIN_TOKENS) {
        tkv_pool_run(cb->pool, matmul_blas_worker, &job);
    } else if (w->type == TKV_TYPE_Q8_0) {
        tkv_pool_run(cb->pool, matmul_q8_0_f32_worker, &job);
    } else {
        job.act_bytes = tkv_act_row_bytes(w->type, w->n_in);
        size_t need = job.act_bytes * n;
        if (need > cb->act_cap) { /* 64-byte aligned rows for the AVX-512 kernels */
            void *p = NULL;
            if (posix_memalign(&p, 64, need) != 0)
                return tkv_err(TKV_ERR_NOMEM, "cpu: out of memory for activations");
            free(cb->act);
            cb->act = p;
            cb->act_cap = need;
        }
        for (uint32_t i = 0; i < n; i++)
            tkv_quantize_act(w->type, x + (size_t)i * w->n_in, (uint8_t *)cb->act + i * job.act_bytes, w->n_in);
        tkv_pool_run(cb->pool, matmul_dot_worker, &job);
    }
    if (job.oom)
        return tkv_err(TKV_ERR_NOMEM, "cpu: out of memory for a weight tile of %s", w->t->name);
    return TKV_OK;
}

/* ---- element-wise ops ------------------------------------------------------ */

static tkv_status cpu_rmsnorm(struct tkv_backend *b, const float *x, const struct tkv_bweight *w, float *y, uint32_t n,
                              uint32_t dim, float eps)
{
    if (w->type != TKV_TYPE_F32 || w->n_in != dim)
        return tkv_err(TKV_ERR_INVALID_ARG, "cpu: rmsnorm weight %s must be F32 [%u]", w->t->name, dim);
    const float *g = (const float *)w->data;
    for (uint32_t i = 0; i < n; i++) {
        const float *xi = x + (size_t)i * dim;
        float *yi = y + (size_t)i * dim;
        double ss = 0; /* ggml accumulates the sum of squares in double too */
        for (uint32_t d = 0; d < dim; d++)
            ss += (double)xi[d] * xi[d];
        const float scale = 1.0f / sqrtf((float)(ss / dim) + eps);
        for (uint32_t d = 0; d < dim; d++)
            yi[d] = xi[d] * scale * g[d];
    }
    return TKV_OK;
}

static tkv_status cpu_rope(struct tkv_backend *b, float *x, uint32_t n, uint32_t n_heads, uint32_t head_dim,
                           uint32_t rot_dim, const int32_t *pos, float base, float freq_scale)
{
    if (rot_dim > head_dim || rot_dim % 2)
        return tkv_err(TKV_ERR_INVALID_ARG, "cpu: rope dimension %u invalid for head_dim %u", rot_dim, head_dim);
    const float theta_scale = powf(base, -2.0f / (float)rot_dim);
    float cs[2 * 512];
    if (rot_dim > 1024)
        return tkv_err(TKV_ERR_INVALID_ARG, "cpu: rope dimension %u too large", rot_dim);
    for (uint32_t t = 0; t < n; t++) {
        /* angles in the order ggml computes them: theta *= theta_scale per pair */
        float theta = (float)pos[t];
        for (uint32_t i = 0; i < rot_dim / 2; i++) {
            const float th = theta * freq_scale;
            cs[2 * i] = cosf(th);
            cs[2 * i + 1] = sinf(th);
            theta *= theta_scale;
        }
        for (uint32_t h = 0; h < n_heads; h++) {
            float *v = x + (size_t)t * n_heads * head_dim + (size_t)h * head_dim;
            for (uint32_t i = 0; i < rot_dim / 2; i++) {
                const float c = cs[2 * i], s = cs[2 * i + 1], x0 = v[2 * i], x1 = v[2 * i + 1];
                v[2 * i] = x0 * c - x1 * s;
                v[2 * i + 1] = x0 * s + x1 * c;
            }
        }
    }
    return TKV_OK;
}

struct swiglu_job {
    const float *gate, *up;
    float *out;
    size_t count;
};

static void swiglu_worker(void *ctx, uint32_t ith, uint32_t nth)
{
    struct swiglu_job *j = ctx;
    uint64_t i0, i1;
    tkv_split(j->count, ith, nth, &i0, &i1);
    for (uint64_t i = i0; i < i1; i++) {
        const float g = j->gate[i];
        j->out[i] = g / (1.0f + expf(-g)) * j->up[i];
    }
}

static tkv_status cpu_swiglu(struct tkv_backend *b, const float *gate, const float *up, float *out, size_t count)
{
    struct swiglu_job job = {gate, up, out, count};
    if (count < 4096)
        swiglu_worker(&job, 0, 1);
    else
        tkv_pool_run(cpu_of(b)->pool, swiglu_worker, &job);
    return TKV_OK;
}

static tkv_status cpu_add(struct tkv_backend *b, float *y, const float *x, size_t count)
{
    for (size_t i = 0; i < count; i++)
        y[i] += x[i];
    return TKV_OK;
}

static tkv_status cpu_kv_write(struct tkv_backend *b, const float *src, size_t src_stride, uint16_t *dst,
                               uint32_t n_rows, uint32_t head_dim)
{
    for (uint32_t r = 0; r < n_rows; r++)
        tkv_fp32_to_fp16_row(src + r * src_stride, dst + (size_t)r * head_dim, head_dim);
    return TKV_OK;
}

static tkv_status cpu_kv_write_heads(struct tkv_backend *b, const float *k, const float *v, size_t stride,
                                     uint16_t *const *kdst, uint16_t *const *vdst, uint32_t n_heads, uint32_t n_rows,
                                     uint32_t head_dim)
{
    for (uint32_t h = 0; h < n_heads; h++) {
        cpu_kv_write(b, k + (size_t)h * head_dim, stride, kdst[h], n_rows, head_dim);
        cpu_kv_write(b, v + (size_t)h * head_dim, stride, vdst[h], n_rows, head_dim);
    }
    return TKV_OK;
}

static tkv_status cpu_attention(struct tkv_backend *b, const struct tkv_attn_args *a)
{
    return tkv_cpu_attention(cpu_of(b), a); /* (kv_dev_n: host memory here, read where each head's count is) */
}

/* The RaBitQ ops: the index's own CPU kernels over the arrays (host memory). */
static tkv_status cpu_rabitq_encode(struct tkv_backend *b, const struct tkv_rabitq_dev *ix,
                                    const struct tkv_rabitq_span *spans, uint32_t n_spans, size_t row_stride,
                                    uint32_t at)
{
    (void)b;
    return tkv_rabitq_host_encode(ix, spans, n_spans, row_stride, at);
}

static tkv_status cpu_rabitq_estimate(struct tkv_backend *b, const struct tkv_rabitq_dev *ix,
                                      const struct tkv_rabitq_query *q, uint32_t first, uint32_t n, float *est,
                                      float *bound)
{
    (void)b;
    return tkv_rabitq_host_estimate(ix, q, first, n, est, bound);
}

/* rabitq_select: the host reference's pieces, a (head, query head) pair per
 * task on the pool (each pair's estimates and top-p are independent), each
 * into its own row of select_rows; then each head's row is the OR of its
 * pairs' rows, widened. The same bitmaps as tkv_rabitq_host_select. */
struct select_job {
    const struct tkv_rabitq_select_args *a;
    struct tkv_cpu_backend *cb;
    size_t scratch_floats; /* a pair's scratch (tkv_rabitq_select_pair_bytes of the longest head) */
    int failed;            /* set once, by the first task that fails (atomic) */
    tkv_status st;         /* its status and message (the message is per thread: carried back) */
    char msg[256];
};

static void select_worker(void *ctx, uint32_t ith, uint32_t nth)
{
    struct select_job *j = ctx;
    const struct tkv_rabitq_select_args *a = j->a;
    void *scratch = NULL;
    for (uint32_t k = ith; k < a->n_heads * a->G && !__atomic_load_n(&j->failed, __ATOMIC_RELAXED); k += nth) {
        uint32_t *row = j->cb->select_rows + (size_t)k * a->words;
        memset(row, 0, (size_t)a->words * sizeof *row);
        if (!scratch) /* the thread's, once */
            scratch = tkv_cpu_scratch(j->cb, ith, j->scratch_floats);
        tkv_status st = scratch ? tkv_rabitq_select_pair(a, k / a->G, k % a->G, scratch, row)
                                : tkv_err(TKV_ERR_NOMEM, "cpu: rabitq_select: out of memory for a thread's scratch");
        if (st != TKV_OK && !__atomic_exchange_n(&j->failed, 1, __ATOMIC_ACQ_REL)) {
            j->st = st;
            snprintf(j->msg, sizeof j->msg, "%s", tkv_last_error());
        }
    }
}

static tkv_status cpu_rabitq_select(struct tkv_backend *b, const struct tkv_rabitq_select_args *a)
{
    struct tkv_cpu_backend *cb = cpu_of(b);
    uint32_t n_max;
    TKV_TRY(tkv_rabitq_select_check(a, "cpu: rabitq_select", &n_max));
    const size_t rows = (size_t)a->n_heads * a->G * a->words;
    if (rows > cb->select_rows_cap) {
        uint32_t *p = realloc(cb->select_rows, rows * sizeof *p);
        if (!p)
            return tkv_err(TKV_ERR_NOMEM, "cpu: rabitq_select: out of memory for %zu bitmap words", rows);
        cb->select_rows = p, cb->select_rows_cap = rows;
    }
    struct select_job job = {.a = a, .cb = cb,
                             .scratch_floats = (tkv_rabitq_select_pair_bytes(n_max) + sizeof(float) - 1) / sizeof(float)};
    tkv_pool_run(cb->pool, select_worker, &job);
    if (job.failed)
        return tkv_err(job.st, "%s", job.msg);
    for (uint32_t h = 0; h < a->n_heads; h++) {
        uint32_t *row = tkv_rabitq_select_row(a, h);
        const uint32_t *pr = cb->select_rows + (size_t)h * a->G * a->words;
        for (uint32_t w = 0; w < a->words; w++) {
            uint32_t x = 0;
            for (uint32_t j = 0; j < a->G; j++)
                x |= pr[(size_t)j * a->words + w];
            row[w] = x;
        }
        tkv_rabitq_select_widen(a, h, row);
    }
    return TKV_OK;
}

/* The page-table stores and the decode table: host memory, so the stores
 * are plain and the table is the reference itself. */
static tkv_status cpu_table_write(struct tkv_backend *b, uint64_t *table, const uint32_t *idx, const uint64_t *val,
                                  uint32_t n)
{
    (void)b;
    if (n && (!table || !idx || !val))
        return tkv_err(TKV_ERR_INVALID_ARG, "cpu: table_write: NULL argument");
    for (uint32_t i = 0; i < n; i++)
        table[idx[i]] = val[i];
    return TKV_OK;
}

static tkv_status cpu_kv_table(struct tkv_backend *b, const struct tkv_kv_table_args *a)
{
    (void)b;
    return tkv_kv_table_ref(a);
}

static tkv_status cpu_attn_stats(struct tkv_backend *b, const struct tkv_attn_stats_args *a)
{
    return tkv_cpu_attn_stats(cpu_of(b), a);
}

/* ---- lifetime ------------------------------------------------------------- */

static void cpu_free(struct tkv_backend *b)
{
    struct tkv_cpu_backend *cb = cpu_of(b);
    if (!cb)
        return;
    tkv_pool_free(cb->pool);
    if (cb->scratch)
        for (uint32_t i = 0; i < cb->n_threads; i++)
            free(cb->scratch[i].buf);
    free(cb->scratch);
    free(cb->act);
    free(cb->partials);
    free(cb->select_rows);
    free(cb);
}

static const struct tkv_backend_ops cpu_ops = {
    .name = "cpu",
    .free = cpu_free,
    .alloc = cpu_alloc,
    .release = cpu_release,
    .upload = cpu_copy,
    .download = cpu_copy,
    .synchronize = cpu_sync,
    .weight_init = cpu_weight_init,
    .weight_free = cpu_weight_free,
    .get_rows = cpu_get_rows,
    .matmul = cpu_matmul,
    .rmsnorm = cpu_rmsnorm,
    .rope = cpu_rope,
    .swiglu = cpu_swiglu,
    .add = cpu_add,
    .kv_write = cpu_kv_write,
    .kv_write_heads = cpu_kv_write_heads,
    .attention = cpu_attention,
    .attn_stats = cpu_attn_stats,
    .rabitq_encode = cpu_rabitq_encode,
    .rabitq_estimate = cpu_rabitq_estimate,
    .rabitq_select = cpu_rabitq_select,
    .table_write = cpu_table_write,
    .kv_table = cpu_kv_table,
};

const char *tkv_blas_coretype_advice(void)
{
    static const char *const generic[] = {"prescott", "core2", "penryn", "dunnington", "nehalem", "atom", "unknown"};
    if (getenv("OPENBLAS_CORETYPE"))
        return NULL;
    const char *core = openblas_get_corename();
    bool fallback = false;
    for (size_t i = 0; core && i < sizeof generic / sizeof *generic; i++)
        fallback |= strcasecmp(core, generic[i]) == 0;
    if (!fallback)
        return NULL;
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
        return "SKYLAKEX";
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return "HASWELL";
    return NULL;
}

tkv_status tkv_cpu_backend_create(uint32_t n_threads, struct tkv_backend **out)
{
    *out = NULL;
    if (n_threads == 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = n > 0 ? (uint32_t)n : 1;
    }
    struct tkv_cpu_backend *cb = calloc(1, sizeof *cb);
    if (!cb)
        return tkv_err(TKV_ERR_NOMEM, "cpu: out of memory");
    cb->base.ops = &cpu_ops;
    cb->n_threads = n_threads;
    cb->scratch = calloc(n_threads, sizeof *cb->scratch);
    tkv_status st = cb->scratch ? tkv_pool_init(n_threads, &cb->pool) : tkv_err(TKV_ERR_NOMEM, "cpu: out of memory");
    if (st != TKV_OK) {
        cpu_free(&cb->base);
        return st;
    }
    /* attention: the fused kernels where the CPU has them, unless told */
    const char *attn = getenv("TKV_CPU_ATTN");
    if (attn && strcmp(attn, "blas") && strcmp(attn, "fused")) {
        cpu_free(&cb->base);
        return tkv_err(TKV_ERR_INVALID_ARG, "cpu: TKV_CPU_ATTN=%s: expected blas or fused", attn);
    }
    if (attn && !strcmp(attn, "fused") && !tkv_cpu_attn_fused_ok()) {
        cpu_free(&cb->base);
        return tkv_err(TKV_ERR_UNSUPPORTED, "cpu: TKV_CPU_ATTN=fused: this CPU lacks AVX2, FMA or F16C");
    }
    cb->attn_fused = tkv_cpu_attn_fused_ok() && !(attn && !strcmp(attn, "blas"));
    /* our pool provides the parallelism; each sgemm runs on one thread */
    openblas_set_num_threads(1);
    static bool warned; /* once per process */
    const char *advice = tkv_blas_coretype_advice();
    if (advice && !warned) {
        warned = true;
        TKV_LOG_W("cpu: OpenBLAS runs its generic '%s' kernels on this CPU; prefill is ~3x faster with "
                  "OPENBLAS_CORETYPE=%s in the environment",
                  openblas_get_corename(), advice);
    }
    *out = &cb->base;
    return TKV_OK;
}
