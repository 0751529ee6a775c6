/*
 * rabitq.c -- the RaBitQ key index (rabitq.h): lifecycle, centroids, query
 * preparation, top-p selection, kernel dispatch, and the scalar reference
 * kernels that the SIMD ones (rabitq-simd.c) must match bit for bit (the
 * top-p ones up to their exponentials' and logarithms' rounding).
 */
#include "rabitq-impl.h"

#include <float.h>
#include <stdlib.h>

// --- small helpers --------------------------------------------------------

static uint64_t splitmix64(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

uint64_t tkv_rabitq_seed(uint64_t base, uint32_t layer, uint32_t head)
{
    uint64_t s = base ^ ((uint64_t)layer << 32 | head);
    splitmix64(&s);
    return splitmix64(&s);
}

static void *rq_alloc(size_t bytes)
{
    return aligned_alloc(64, tkv_align_up(bytes ? bytes : 1, 64));
}

// --- scalar reference kernels ----------------------------------------------

/* Unnormalised Walsh-Hadamard transform, stage h = 1, 2, 4, ... */
static void fwht_ref(float *x, uint32_t n)
{
    for (uint32_t h = 1; h < n; h <<= 1)
        for (uint32_t i = 0; i < n; i += 2 * h)
            for (uint32_t j = i; j < i + h; j++) {
                const float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
}

static void rotate_ref(const struct tkv_rabitq *ix, float *y)
{
    const uint32_t D = ix->dim_pad;
    for (int r = 0; r < 3; r++) {
        const float *s = ix->sign + (size_t)r * D;
        for (uint32_t i = 0; i < D; i++)
            y[i] *= s[i];
        fwht_ref(y, D);
    }
    for (uint32_t i = 0; i < D; i++)
        y[i] *= ix->rot_scale;
}

static void encode_ref(struct tkv_rabitq *ix, const uint16_t *k, size_t row_stride, uint32_t n, uint32_t at)
{
    const uint32_t D = ix->dim_pad, W = ix->words;
    float kf[TKV_RABITQ_MAX_DIM], y[TKV_RABITQ_MAX_DIM];
    for (uint32_t r = 0; r < n; r++) {
        const uint16_t *row = k + r * row_stride;
        for (uint32_t i = 0; i < D; i++)
            kf[i] = i < ix->dim ? tkv_fp16_to_fp32(row[i]) : 0.0f;
        float rr[16] = {0}, t[16] = {0}, l1[16] = {0};
        for (uint32_t i = 0; i < D; i++) {
            y[i] = kf[i] - ix->ck[i];
            rr[i % 16] = fmaf(y[i], y[i], rr[i % 16]);
            t[i % 16] = fmaf(ix->cq[i], kf[i], t[i % 16]);
        }
        rotate_ref(ix, y);
        uint64_t *code = ix->code + (size_t)(at + r) * W;
        uint32_t pc = 0;
        for (uint32_t w = 0; w < W; w++) {
            uint64_t bits = 0;
            for (uint32_t j = 0; j < 64; j++) {
                const float v = y[64 * w + j];
                l1[j % 16] = l1[j % 16] + fabsf(v);
                bits |= (uint64_t)(v > 0.0f) << j;
            }
            code[w] = bits;
            pc += (uint32_t)__builtin_popcountll(bits);
        }
        ix->pc[at + r] = (uint16_t)pc;
        ix->a[at + r] = rq_fold16(rr);
        ix->e[at + r] = rq_fold16(l1);
        ix->t[at + r] = rq_fold16(t);
    }
}

static void estimate_ref(const struct tkv_rabitq *ix, const struct tkv_rabitq_query *q, uint32_t first, uint32_t n,
                         float *est, float *bound)
{
    for (uint32_t i = 0; i < n; i++)
        rq_estimate_one(ix, q, first + i, est + i, bound ? bound + i : NULL);
}

// --- dispatch -----------------------------------------------------------------

static const struct rq_kernels *kernels_of(enum tkv_rabitq_isa isa)
{
    switch (isa) {
    case TKV_RABITQ_ISA_SCALAR: return &rq_kernels_scalar;
    case TKV_RABITQ_ISA_AVX2:   return rq_kernels_avx2;
    case TKV_RABITQ_ISA_AVX512: return rq_kernels_avx512;
    default:                    return NULL;
    }
}

bool tkv_rabitq_isa_supported(enum tkv_rabitq_isa isa)
{
    if (!kernels_of(isa))
        return false;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (isa == TKV_RABITQ_ISA_AVX2)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("popcnt");
    if (isa == TKV_RABITQ_ISA_AVX512)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
               __builtin_cpu_supports("avx512vpopcntdq");
#endif
    return isa == TKV_RABITQ_ISA_SCALAR;
}

const char *tkv_rabitq_isa_name(enum tkv_rabitq_isa isa)
{
    static const char *const names[] = {"scalar", "avx2", "avx512"};
    return (unsigned)isa < TKV_RABITQ_ISA_COUNT ? names[isa] : "?";
}

tkv_status tkv_rabitq_set_isa(struct tkv_rabitq *ix, enum tkv_rabitq_isa isa)
{
    if (!ix || (unsigned)isa >= TKV_RABITQ_ISA_COUNT)
        return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: set_isa: bad index or isa %d", (int)isa);
    if (!tkv_rabitq_isa_supported(isa))
        return tkv_err(TKV_ERR_UNSUPPORTED, "rabitq: %s kernels are not available on this CPU or build",
                       tkv_rabitq_isa_name(isa));
    ix->isa = isa;
    ix->kern = kernels_of(isa);
    return TKV_OK;
}

enum tkv_rabitq_isa tkv_rabitq_get_isa(const struct tkv_rabitq *ix) { return ix ? ix->isa : TKV_RABITQ_ISA_SCALAR; }

/* The best variant, or the one TKV_RABITQ_FORCE names. */
static tkv_status default_isa(enum tkv_rabitq_isa *out)
{
    const char *f = getenv("TKV_RABITQ_FORCE");
    if (f && *f) {
        for (int i = 0; i < TKV_RABITQ_ISA_COUNT; i++)
            if (!strcmp(f, tkv_rabitq_isa_name((enum tkv_rabitq_isa)i))) {
                if (!tkv_rabitq_isa_supported((enum tkv_rabitq_isa)i))
                    return tkv_err(TKV_ERR_UNSUPPORTED, "rabitq: TKV_RABITQ_FORCE=%s: not available on this CPU", f);
                *out = (enum tkv_rabitq_isa)i;
                return TKV_OK;
            }
        return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: TKV_RABITQ_FORCE=%s: expected scalar, avx2 or avx512", f);
    }
    *out = tkv_rabitq_isa_supported(TKV_RABITQ_ISA_AVX512) ? TKV_RABITQ_ISA_AVX512
         : tkv_rabitq_isa_supported(TKV_RABITQ_ISA_AVX2)   ? TKV_RABITQ_ISA_AVX2
                                                           : TKV_RABITQ_ISA_SCALAR;
    return TKV_OK;
}

// --- lifecycle ------------------------------------------------------------------

tkv_status tkv_rabitq_init(uint32_t head_dim, uint64_t seed, struct tkv_rabitq **out)
{
    if (!out)
        return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: init: out is NULL");
    *out = NULL;
    if (head_dim == 0 || head_dim > TKV_RABITQ_MAX_DIM)
        return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: head_dim %u outside 1..%u", head_dim, TKV_RABITQ_MAX_DIM);
    enum tkv_rabitq_isa isa = TKV_RABITQ_ISA_SCALAR;
    TKV_TRY(default_isa(&isa));
    uint32_t D = 64;
    while (D < head_dim)
        D <<= 1;
    struct tkv_rabitq *ix = calloc(1, sizeof *ix);
    float *f = rq_alloc((size_t)5 * D * sizeof(float));
    if (!ix || !f) {
        free(ix);
        free(f);
        return tkv_err(TKV_ERR_NOMEM, "rabitq: init: out of memory");
    }
    ix->dim = head_dim;
    ix->dim_pad = D;
    ix->words = D / 64;
    ix->seed = seed;
    ix->isa = isa;
    ix->kern = kernels_of(isa);
    ix->rot_scale = (float)pow((double)D, -1.5);
    ix->sign = f;
    ix->ck = f + 3 * D;
    ix->cq = f + 4 * D;
    uint64_t s = seed, bits = 0;
    for (uint32_t i = 0; i < 3 * D; i++) {
        if (i % 64 == 0)
            bits = splitmix64(&s);
        ix->sign[i] = (bits >> (i % 64)) & 1 ? -1.0f : 1.0f;
    }
    memset(ix->ck, 0, (size_t)2 * D * sizeof(float));
    *out = ix;
    return TKV_OK;
}

static void free_arrays(struct tkv_rabitq *ix)
{
    free(ix->code);
    free(ix->a);
    free(ix->e);
    free(ix->t);
    free(ix->pc);
}

void tkv_rabitq_free(struct tkv_rabitq *ix)
{
    if (!ix)
        return;
    free_arrays(ix);
    free(ix->sign);
    free(ix);
}

tkv_status tkv_rabitq_set_centroids(struct tkv_rabitq *ix, const float *c_k, const float *c_q)
{
    if (!ix)
        return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: set_centroids: index is NULL");
    if (ix->n)
        return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: set_centroids on an index holding %u keys (reset it first)", ix->n);
    for (uint32_t i = 0; i < ix->dim; i++)
        if ((c_k && !isfinite(c_k[i])) || (c_q && !isfinite(c_q[i])))
            return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: set_centroids: %s[%u] is not finite",
                           c_k && !isfinite(c_k[i]) ? "c_k" : "c_q", i);
    double cc = 0;
    for (uint32_t i = 0; i < ix->dim; i++) {
        ix->ck[i] = c_k ? c_k[i] : 0.0f;
        ix->cq[i] = c_q ? c_q[i] : 0.0f;
        cc += (double)ix->ck[i] * ix->cq[i];
    }
    ix->cqck = cc;
    ix->gen++;
    ix->centred = true;
    return TKV_OK;
}

tkv_status tkv_rabitq_reserve(struct tkv_rabitq *ix, uint32_t n_keys)
{
    if (!ix)
        return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: reserve: index is NULL");
    if (n_keys <= ix->cap)
        return TKV_OK;
    const size_t n = n_keys, W = ix->words;
    uint64_t *code = rq_alloc(n * W * sizeof *code);
    float *a = rq_alloc(n * sizeof *a), *e = rq_alloc(n * sizeof *e), *t = rq_alloc(n * sizeof *t);
    uint16_t *pc = rq_alloc(n * sizeof *pc);
    if (!code || !a || !e || !t || !pc) {
        free(code);
        free(a);
        free(e);
        free(t);
        free(pc);
        return tkv_err(TKV_ERR_NOMEM, "rabitq: reserve: no memory for %u keys", n_keys);
    }
    if (ix->n) {
        memcpy(code, ix->code, (size_t)ix->n * W * sizeof *code);
        memcpy(a, ix->a, (size_t)ix->n * sizeof *a);
        memcpy(e, ix->e, (size_t)ix->n * sizeof *e);
        memcpy(t, ix->t, (size_t)ix->n * sizeof *t);
        memcpy(pc, ix->pc, (size_t)ix->n * sizeof *pc);
    }
    free_arrays(ix);
    ix->code = code;
    ix->a = a;
    ix->e = e;
    ix->t = t;
    ix->pc = pc;
    ix->cap = n_keys;
    return TKV_OK;
}

/* Raw sums -> stored scalars (spec 1.4, 1.7), in double. */
static bool finish_keys(struct tkv_rabitq *ix, uint32_t at, uint32_t n, uint32_t *bad)
{
    const double sqrt_d = sqrt((double)ix->dim_pad);
    for (uint32_t i = at; i < at + n; i++) {
        const double rr = ix->a[i], l1 = ix->e[i];
        if (!isfinite(rr) || !isfinite(l1) || !isfinite(ix->t[i])) {
            *bad = i - at;
            return false;
        }
        if (rr > 0 && l1 > 0) {
            const double nk = sqrt(rr);
            double alpha = l1 / (sqrt_d * nk);
            if (alpha > 1)
                alpha = 1;
            ix->a[i] = (float)(rr / l1);
            /* explicit fma: with -ffp-contract=fast GCC fuses 1 - alpha*alpha
             * where the ISA has FMA, and the GPU encoder must round alike */
            ix->e[i] = (float)(nk * sqrt(fma(-alpha, alpha, 1.0)) / alpha);
        } else {
            ix->a[i] = 0;
            ix->e[i] = 0;
        }
    }
    return true;
}

tkv_status tkv_rabitq_append_f16(struct tkv_rabitq *ix, const uint16_t *k, size_t row_stride, uint32_t n)
{
    if (!ix || (!k && n))
        return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: append: index or rows NULL");
    if (n == 0)
        return TKV_OK;
    if (!ix->centred)
        return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: append before set_centroids");
    if (row_stride < ix->dim)
        return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: append: row stride %zu < head_dim %u", row_stride, ix->dim);
    if (n > ix->cap - ix->n)
        return tkv_err(TKV_ERR_TOO_SMALL, "rabitq: append of %u keys to %u of %u reserved (reserve %u more)", n, ix->n,
                       ix->cap, n - (ix->cap - ix->n));
    ix->kern->encode(ix, k, row_stride, n, ix->n);
    uint32_t bad;
    if (!finish_keys(ix, ix->n, n, &bad))
        return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: append: key row %u of the batch is not finite", bad);
    ix->n += n;
    return TKV_OK;
}

void tkv_rabitq_reset(struct tkv_rabitq *ix)
{
    if (ix)
        ix->n = 0;
}

uint32_t tkv_rabitq_size(const struct tkv_rabitq *ix) { return ix ? ix->n : 0; }
uint32_t tkv_rabitq_capacity(const struct tkv_rabitq *ix) { return ix ? ix->cap : 0; }

size_t tkv_rabitq_bytes(const struct tkv_rabitq *ix)
{
    if (!ix)
        return 0;
    const size_t n = ix->cap; /* each array is rounded up to 64 bytes, as rq_alloc does */
    return sizeof *ix + tkv_align_up((size_t)5 * ix->dim_pad * sizeof(float), 64) +
           tkv_align_up(n * ix->words * sizeof(uint64_t), 64) + 3 * tkv_align_up(n * sizeof(float), 64) +
           tkv_align_up(n * sizeof(uint16_t), 64);
}

void tkv_rabitq_get_arrays(const struct tkv_rabitq *ix, struct tkv_rabitq_arrays *out)
{
    if (!out)
        return;
    memset(out, 0, sizeof *out);
    if (!ix)
        return;
    *out = (struct tkv_rabitq_arrays){.code = ix->code, .a = ix->a, .e = ix->e, .t = ix->t, .pc = ix->pc,
                                      .n = ix->n, .words = ix->words, .dim = ix->dim, .dim_pad = ix->dim_pad,
                                      .sign = ix->sign, .ck = ix->ck, .cq = ix->cq, .rot_scale = ix->rot_scale,
                                      .cqck = ix->cqck};
}

/* An index struct over a device twin's arrays in host memory, with this
 * CPU's kernels (the CPU backend's rabitq ops). */
static tkv_status host_view(const struct tkv_rabitq_dev *d, uint32_t n_keys, struct tkv_rabitq *ix)
{
    if (!d || d->dim == 0 || d->dim_pad < 64 || d->dim_pad > TKV_RABITQ_MAX_DIM || d->words * 64 != d->dim_pad)
        return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: device arrays with dim_pad %u", d ? d->dim_pad : 0);
    enum tkv_rabitq_isa isa = TKV_RABITQ_ISA_SCALAR;
    TKV_TRY(default_isa(&isa));
    *ix = (struct tkv_rabitq){.dim = d->dim, .dim_pad = d->dim_pad, .words = d->words, .isa = isa,
                              .kern = kernels_of(isa), .rot_scale = d->rot_scale, .sign = (float *)d->sign,
                              .ck = (float *)d->ck, .cq = (float *)d->cq, .cqck = d->cqck, .centred = true, .n = n_keys,
                              .cap = n_keys, .code = d->code, .a = d->a, .e = d->e, .t = d->t, .pc = d->pc};
    return TKV_OK;
}

tkv_status tkv_rabitq_encode_error(const struct tkv_rabitq_span *spans, uint32_t n_spans, uint32_t at, uint32_t row)
{
    uint32_t sp = 0, r = row;
    while (sp + 1 < n_spans && r >= spans[sp].n)
        r -= spans[sp++].n;
    return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: append: key %llu (row %u of span %u) is not finite",
                   (unsigned long long)at + row, r, sp);
}

tkv_status tkv_rabitq_host_encode(const struct tkv_rabitq_dev *d, const struct tkv_rabitq_span *spans,
                                  uint32_t n_spans, size_t row_stride, uint32_t at)
{
    uint64_t n = 0;
    for (uint32_t s = 0; s < n_spans; s++)
        n += spans[s].n;
    if (n > UINT32_MAX - at)
        return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: encode of %llu keys at %u", (unsigned long long)n, at);
    struct tkv_rabitq ix;
    TKV_TRY(host_view(d, at + (uint32_t)n, &ix));
    if (n == 0)
        return TKV_OK;
    uint32_t off = at;
    for (uint32_t s = 0; s < n_spans; off += spans[s].n, s++)
        if (spans[s].n)
            ix.kern->encode(&ix, spans[s].k, row_stride, spans[s].n, off);
    uint32_t bad;
    if (!finish_keys(&ix, at, (uint32_t)n, &bad))
        return tkv_rabitq_encode_error(spans, n_spans, at, bad);
    return TKV_OK;
}

tkv_status tkv_rabitq_host_estimate(const struct tkv_rabitq_dev *d, const struct tkv_rabitq_query *q, uint32_t first,
                                    uint32_t n, float *est, float *bound)
{
    struct tkv_rabitq ix;
    TKV_TRY(host_view(d, first + n, &ix));
    if (q->words != ix.words)
        return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: estimate: query of %u words for keys of %u", q->words, ix.words);
    if (n)
        ix.kern->estimate(&ix, q, first, n, est, bound);
    return TKV_OK;
}

/* struct tkv_rabitq_dev_query is the first fields of struct tkv_rabitq_query */
#define RQ_SAME_FIELD(f)                                                                                  \
    _Static_assert(offsetof(struct tkv_rabitq_query, f) == offsetof(struct tkv_rabitq_dev_query, f) &&    \
                       sizeof(((struct tkv_rabitq_query *)0)->f) == sizeof(((struct tkv_rabitq_dev_query *)0)->f), \
                   "rabitq: the device query's " #f " is the host query's")
RQ_SAME_FIELD(plane);
RQ_SAME_FIELD(delta);
RQ_SAME_FIELD(vl);
RQ_SAME_FIELD(sum_q);
RQ_SAME_FIELD(add);
RQ_SAME_FIELD(norm);
RQ_SAME_FIELD(bound_u);
RQ_SAME_FIELD(bound_w);
RQ_SAME_FIELD(eps0);
RQ_SAME_FIELD(words);
RQ_SAME_FIELD(dim_pad);
#undef RQ_SAME_FIELD
_Static_assert(sizeof(struct tkv_rabitq_dev_query) == offsetof(struct tkv_rabitq_query, dim_pad) + sizeof(uint32_t),
               "rabitq: the device query is a prefix of the host query");

void tkv_rabitq_query_to_dev(const struct tkv_rabitq_query *q, struct tkv_rabitq_dev_query *out)
{
    memcpy(out, q, sizeof *out);
}

void tkv_rabitq_query_from_dev(const struct tkv_rabitq_dev_query *q, const struct tkv_rabitq *ix,
                               struct tkv_rabitq_query *out)
{
    memset(out, 0, sizeof *out);
    memcpy(out, q, sizeof *q);
    out->ix = ix;
    out->gen = ix ? ix->gen : 0;
}

void tkv_rabitq_query_poison(uint32_t dim_pad, float eps0, struct tkv_rabitq_dev_query *out)
{
    const uint32_t qnan = 0x7fc00000u; /* the bits the GPU writes too */
    float nan;
    memcpy(&nan, &qnan, sizeof nan);
    memset(out, 0, sizeof *out);
    out->delta = out->vl = out->add = out->norm = out->bound_u = out->bound_w = nan;
    out->eps0 = eps0 == 0 ? TKV_RABITQ_EPS0 : eps0;
    out->words = dim_pad / 64;
    out->dim_pad = dim_pad;
}

void tkv_rabitq_query_mean(const float *q, size_t stride, uint32_t n, uint32_t dim, float *out)
{
    memcpy(out, q, dim * sizeof *out);
    if (n <= 1)
        return;
    for (uint32_t j = 1; j < n; j++)
        for (uint32_t i = 0; i < dim; i++)
            out[i] += q[(size_t)j * stride + i];
    for (uint32_t i = 0; i < dim; i++)
        out[i] /= (float)n;
}

tkv_status tkv_rabitq_host_prepare(const struct tkv_rabitq_prepare_args *a)
{
    if (!a || (a->n && (!a->q || !a->items || !a->out)))
        return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: host_prepare: NULL argument");
    if (!(a->eps0 >= 0) || !isfinite(a->eps0))
        return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: host_prepare: eps0 %g must be >= 0", (double)a->eps0);
    if (a->bad)
        *a->bad = UINT32_MAX;
    for (uint32_t i = 0; i < a->n; i++) {
        struct tkv_rabitq ix;
        TKV_TRY(host_view(a->items[i].ix, 0, &ix));
        const float *row = a->q + (size_t)a->items[i].head * a->head_stride;
        float mean[TKV_RABITQ_MAX_DIM];
        if (a->items[i].rows > 1) {
            tkv_rabitq_query_mean(row, a->head_stride, a->items[i].rows, ix.dim, mean);
            row = mean;
        }
        struct tkv_rabitq_query qq;
        if (tkv_rabitq_query_prepare(&ix, row, a->eps0, &qq) == TKV_OK) {
            tkv_rabitq_query_to_dev(&qq, &a->out[i]);
        } else {
            tkv_rabitq_query_poison(ix.dim_pad, a->eps0, &a->out[i]);
            if (a->bad && *a->bad == UINT32_MAX)
                *a->bad = i;
        }
    }
    return TKV_OK;
}

tkv_status tkv_rabitq_rotate(const struct tkv_rabitq *ix, const float *x, float *y)
{
    if (!ix || !x || !y)
        return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: rotate: NULL argument");
    float buf[TKV_RABITQ_MAX_DIM] __attribute__((aligned(64)));
    for (uint32_t i = 0; i < ix->dim_pad; i++)
        buf[i] = i < ix->dim ? x[i] : 0.0f;
    ix->kern->rotate(ix, buf);
    memcpy(y, buf, ix->dim_pad * sizeof *y);
    return TKV_OK;
}

// --- centroid means ---------------------------------------------------------------

tkv_status tkv_rabitq_mean_init(struct tkv_rabitq_mean *m, uint32_t dim)
{
    if (!m || dim == 0 || dim > TKV_RABITQ_MAX_DIM)
        return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: mean_init: NULL or dim %u outside 1..%u", dim, TKV_RABITQ_MAX_DIM);
    m->dim = dim;
    m->n = 0;
    memset(m->sum, 0, sizeof m->sum);
    memset(m->units, 0, sizeof m->units);
    return TKV_OK;
}

static tkv_status mean_room(const struct tkv_rabitq_mean *m, uint64_t n)
{
    if (n > TKV_RABITQ_MEAN_MAX_ROWS - m->n)
        return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: mean of %llu + %llu rows: more than %llu",
                       (unsigned long long)m->n, (unsigned long long)n, (unsigned long long)TKV_RABITQ_MEAN_MAX_ROWS);
    return TKV_OK;
}

tkv_status tkv_rabitq_mean_add_f16(struct tkv_rabitq_mean *m, const uint16_t *rows, size_t row_stride, uint32_t n)
{
    if (!m || (!rows && n) || row_stride < m->dim)
        return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: mean_add: NULL or row stride %zu < dim", row_stride);
    TKV_TRY(mean_room(m, n));
    for (uint32_t r = 0; r < n; r++)
        for (uint32_t i = 0; i < m->dim; i++) {
            const uint16_t h = rows[r * row_stride + i];
            if (TKV_RABITQ_F16_FINITE(h))
                m->units[i] += TKV_RABITQ_F16_UNITS(h);
            else
                m->sum[i] += tkv_fp16_to_fp32(h);
        }
    m->n += n;
    return TKV_OK;
}

tkv_status tkv_rabitq_mean_add_units(struct tkv_rabitq_mean *m, const int64_t *units, uint64_t n)
{
    if (!m || !units)
        return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: mean_add_units: NULL argument");
    TKV_TRY(mean_room(m, n));
    for (uint32_t i = 0; i < m->dim; i++)
        m->units[i] += units[i];
    m->n += n;
    return TKV_OK;
}

tkv_status tkv_rabitq_mean_add_f32(struct tkv_rabitq_mean *m, const float *rows, size_t row_stride, uint32_t n)
{
    if (!m || (!rows && n) || row_stride < m->dim)
        return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: mean_add: NULL or row stride %zu < dim", row_stride);
    TKV_TRY(mean_room(m, n));
    for (uint32_t r = 0; r < n; r++)
        for (uint32_t i = 0; i < m->dim; i++)
            m->sum[i] += rows[r * row_stride + i];
    m->n += n;
    return TKV_OK;
}

tkv_status tkv_rabitq_mean_get(const struct tkv_rabitq_mean *m, float *out)
{
    if (!m || !out)
        return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: mean_get: NULL argument");
    for (uint32_t i = 0; i < m->dim; i++) /* units: exact integers, rounded once into the double */
        out[i] = m->n ? (float)((m->sum[i] + ldexp((double)m->units[i], -24)) / (double)m->n) : 0.0f;
    return TKV_OK;
}

// --- query and estimate --------------------------------------------------------------

tkv_status tkv_rabitq_query_prepare(const struct tkv_rabitq *ix, const float *q, float eps0,
                                    struct tkv_rabitq_query *out)
{
    if (!ix || !q || !out)
        return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: query_prepare: NULL argument");
    if (!(eps0 >= 0) || !isfinite(eps0))
        return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: query_prepare: eps0 %g must be >= 0", (double)eps0);
    if (eps0 == 0)
        eps0 = TKV_RABITQ_EPS0;
    const uint32_t D = ix->dim_pad;
    float u[TKV_RABITQ_MAX_DIM] __attribute__((aligned(64)));
    double nn = 0, qck = 0;
    for (uint32_t i = 0; i < D; i++) {
        if (i < ix->dim && !isfinite(q[i]))
            return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: query_prepare: q[%u] is not finite", i);
        u[i] = i < ix->dim ? q[i] - ix->cq[i] : 0.0f;
        nn += (double)u[i] * u[i];
        if (i < ix->dim)
            qck += (double)q[i] * ix->ck[i];
    }
    ix->kern->rotate(ix, u);
    /* explicit compares, not fminf / fmaxf: of equal values (+0 and -0) the
     * first is kept, whatever the libm does with signed zeros, and the GPU's
     * rabitq_prepare (gpu/rabitq.cu) keeps the same one */
    float lo = u[0], hi = u[0];
    bool finite = isfinite(u[0]);
    for (uint32_t i = 1; i < D; i++) {
        lo = u[i] < lo ? u[i] : lo;
        hi = u[i] > hi ? u[i] : hi;
        finite &= isfinite(u[i]);
    }
    const float delta = (hi - lo) / 15.0f;
    if (!finite || !isfinite(delta)) /* |q - c_q| near FLT_MAX: the rotation or hi - lo overflowed */
        return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: query_prepare: the rotation of q - c_q overflows");
    memset(out, 0, sizeof *out);
    int32_t sum = 0;
    for (uint32_t i = 0; i < D; i++) {
        int v = delta > 0 ? (int)floorf((u[i] - lo) / delta + 0.5f) : 0;
        v = v < 0 ? 0 : v > 15 ? 15 : v;
        sum += v;
        for (int j = 0; j < 4; j++)
            out->plane[j][i / 64] |= (uint64_t)((v >> j) & 1) << (i % 64);
    }
    out->delta = delta;
    out->vl = lo;
    out->sum_q = sum;
    out->add = (float)(qck - ix->cqck);
    out->norm = (float)sqrt(nn);
    const double e2 = (double)eps0 * eps0;
    out->bound_u = (float)(e2 * nn / (D - 1));
    out->bound_w = (float)(e2 * (double)delta * delta * D / 12.0);
    out->eps0 = eps0;
    out->words = ix->words;
    out->dim_pad = D;
    out->gen = ix->gen;
    out->ix = ix;
    return TKV_OK;
}

tkv_status tkv_rabitq_estimate(const struct tkv_rabitq *ix, const struct tkv_rabitq_query *q, uint32_t first,
                               uint32_t n, float *est, float *bound)
{
    if (!ix || !q || (!est && n))
        return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: estimate: NULL argument");
    if (q->ix != ix || q->gen != ix->gen || q->words != ix->words)
        return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: estimate: the query was prepared for another index or centroids");
    if (first > ix->n || n > ix->n - first)
        return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: estimate: keys [%u, %llu) outside the %u encoded", first,
                       (unsigned long long)first + n, ix->n);
    if (n)
        ix->kern->estimate(ix, q, first, n, est, bound);
    return TKV_OK;
}

// --- top-p selection ------------------------------------------------------------------
/*
 * With l_i = e^(s_i - d_i), u_i = e^(s_i + d_i) (s, d scaled; d = 0 for plain
 * top-p, so l = u), F the exact mass of forced tokens outside est, S the kept
 * set (forced keys included) and N = sum_S l + F, C = sum_notS u, the rule is
 *     N / (N + C) >= p   <=>   (1 - p) N >= p C.
 * Moving key i into S raises (1-p) N - p C by v_i = (1-p) l_i + p u_i, so the
 * fewest keys come in by decreasing v (log-value g = log v). The test is made
 * on N and C themselves, C summed from the smallest terms up: written as
 * sum v >= p U - ..., it would cancel catastrophically when d is large (l << u).
 *
 * No sort of all keys: a histogram of g (NBINS bins of 1/BPN nat below the
 * largest g, the last bin taking everything lower: the device's bins too,
 * backend.h) finds the bin where the rule is met; only that bin's members
 * are sorted.
 *
 * The per-key loops (log-values, maxima, l and u, bins, the masks of kept
 * keys) are kernels (rq_kernels): the scalar ones below, SIMD ones in
 * rabitq-simd.c; this function is the rest, the same for all.
 */
#define NBINS TKV_RABITQ_TOPP_BINS

struct cand {
    double   c;  /* after sorting: sum of u over this member and the ones after it */
    float    g;  /* log-value; after sorting, l                                     */
    uint32_t i;
};

static inline bool cand_before(const struct cand *a, const struct cand *b)
{
    return a->g > b->g || (a->g == b->g && a->i < b->i);
}

/* min-heap on cand_before (the last in order at the root), for an in-place heapsort into order */
static void sift_down(struct cand *h, size_t n, size_t i)
{
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n)
            return;
        if (c + 1 < n && cand_before(&h[c], &h[c + 1]))
            c++;
        if (!cand_before(&h[i], &h[c]))
            return;
        struct cand t = h[i];
        h[i] = h[c];
        h[c] = t;
        i = c;
    }
}

static void sort_cands(struct cand *h, size_t n)
{
    for (size_t i = n / 2; i-- > 0;)
        sift_down(h, n, i);
    for (size_t e = n; e > 1; e--) { /* the root is the last in order: move it to the end */
        struct cand t = h[0];
        h[0] = h[e - 1];
        h[e - 1] = t;
        sift_down(h, e - 1, 0);
    }
}

struct topp_work {
    float *g;             /* [n] log-value of each key                                          */
    uint16_t *bin;        /* [n] a candidate's bin + 1 (topp_bins, pass 2); 0 once taken from the
                             threshold bin: kept <=> bin[i] <= bstar                             */
    struct cand *cand;    /* [n] members of the threshold bin                                   */
    double *hl, *hu;      /* [NBINS] sums of l and u per bin (hu: then suffix sums)             */
    uint32_t *hc;         /* [NBINS] counts                                                     */
};

size_t tkv_rabitq_topp_work_bytes(uint32_t n)
{
    return tkv_align_up((size_t)n * sizeof(float), 8) + tkv_align_up((size_t)n * sizeof(uint16_t), 8) +
           (size_t)n * sizeof(struct cand) + NBINS * (2 * sizeof(double) + sizeof(uint32_t));
}

static struct topp_work topp_carve(void *work, uint32_t n)
{
    struct topp_work w;
    char *p = work;
    w.g = (float *)p;
    p += tkv_align_up((size_t)n * sizeof(float), 8);
    w.bin = (uint16_t *)p;
    p += tkv_align_up((size_t)n * sizeof(uint16_t), 8);
    w.cand = (struct cand *)p;
    p += (size_t)n * sizeof(struct cand);
    w.hl = (double *)p;
    w.hu = w.hl + NBINS;
    w.hc = (uint32_t *)(w.hu + NBINS);
    return w;
}

/* The scalar reference of the per-key loops (rq_kernels, rabitq-impl.h),
 * libm's expf and logf. */

/* scale * x rounded on its own. Under gnu11 GCC may fuse a product into a
 * later add (-ffp-contract=fast), and differently at each inlined use: s - d
 * then differs in its last bits between the passes below, which e^(s-d-M)
 * turns into ~1e-6 relative where d is large (TKV_SEED=10000217 of
 * test-rabitq: the same keys, two masses). fma with +0 is one rounding of
 * the product (+0 for -0) and cannot be fused further. */
static inline float scaled(float scale, float x) { return fmaf(scale, x, 0.0f); }

static uint32_t topp_logvalues_ref(const float *est, const float *bound, uint32_t n, float scale, float p, float *g,
                                   float *umax)
{
    float m = *umax;
    for (uint32_t i = 0; i < n; i++) {
        const float s = scaled(scale, est[i]), d = bound ? scaled(scale, bound[i]) : 0.0f;
        if (isnan(s) || s == INFINITY || !(d >= 0) || d == INFINITY || s + d == INFINITY)
            return i;
        /* g = log((1-p) e^(s-d) + p e^(s+d)) = s + d + log(p + (1-p) e^(-2d)) */
        g[i] = bound ? s + d + logf(p + (1 - p) * expf(-2 * d)) : s;
        m = m > s + d ? m : s + d;
    }
    *umax = m;
    return n;
}

static float topp_max_ref(const float *g, uint32_t n, float m)
{
    for (uint32_t i = 0; i < n; i++)
        m = m > g[i] ? m : g[i];
    return m;
}

static void topp_weights_ref(const float *est, const float *bound, uint32_t n, float scale, float M, float *l,
                             float *u)
{
    for (uint32_t i = 0; i < n; i++) {
        const float s = scaled(scale, est[i]), d = bound ? scaled(scale, bound[i]) : 0.0f;
        u[i] = expf(s + d - M);
        l[i] = bound ? expf(s - d - M) : u[i];
    }
}

static void topp_bins_ref(const float *g, uint32_t n, float gmax, uint16_t *bin)
{
    for (uint32_t i = 0; i < n; i++)
        bin[i] = (uint16_t)(rq_topp_bin(g[i], gmax) + 1);
}

static void topp_mask_ref(const uint16_t *bin, uint32_t n, uint32_t lo, uint32_t hi, uint64_t *mask)
{
    for (uint32_t w = 0; w < (n + 63) / 64; w++)
        mask[w] = 0;
    for (uint32_t i = 0; i < n; i++)
        mask[i / 64] |= (uint64_t)(lo <= bin[i] && bin[i] <= hi) << (i % 64);
}

/* the scalar variant: the reference of every kernel */
const struct rq_kernels rq_kernels_scalar = {
    rotate_ref,   encode_ref,       estimate_ref,  topp_logvalues_ref, topp_max_ref,
    topp_weights_ref, topp_bins_ref, topp_mask_ref,
};

/* Splits est indices [0, n) into runs, all forced or none: returns the end
 * of the run starting at i (position pos0 + i); *r walks the ranges. */
static inline uint32_t run_end(const struct tkv_rabitq_topp_params *pp, uint32_t n, uint32_t i, uint32_t *r,
                               bool *forced)
{
    const uint64_t x = (uint64_t)pp->pos0 + i;
    while (*r < pp->n_forced && pp->forced[*r].end <= x)
        (*r)++;
    if (*r < pp->n_forced && pp->forced[*r].begin <= x) {
        *forced = true;
        return (uint32_t)TKV_MIN((uint64_t)pp->forced[*r].end - pp->pos0, (uint64_t)n);
    }
    *forced = false;
    return *r < pp->n_forced ? (uint32_t)TKV_MIN((uint64_t)pp->forced[*r].begin - pp->pos0, (uint64_t)n) : n;
}

/* Writes to out base + j for the keys j in [c, c+k) (k <= RQ_TOPP_CHUNK)
 * with lo <= bin[j] <= hi, ascending; returns their count (<= k). */
static uint32_t keys_in_bins(const struct rq_kernels *kern, const uint16_t *bin, uint32_t c, uint32_t k, uint32_t lo,
                             uint32_t hi, uint32_t base, uint32_t *out)
{
    uint64_t mask[RQ_TOPP_CHUNK / 64];
    kern->topp_mask(bin + c, k, lo, hi, mask);
    uint32_t n = 0;
    for (uint32_t x = 0; x < (k + 63) / 64; x++)
        for (uint64_t bits = mask[x]; bits; bits &= bits - 1)
            out[n++] = base + c + 64 * x + (uint32_t)__builtin_ctzll(bits);
    return n;
}

/* The kernels of select_topp: the best this CPU has, or TKV_RABITQ_FORCE's;
 * chosen on the first call (threads racing there choose the same). */
static tkv_status topp_kernels(const struct rq_kernels **out)
{
    static const struct rq_kernels *chosen;
    const struct rq_kernels *k = __atomic_load_n(&chosen, __ATOMIC_ACQUIRE);
    if (!k) {
        enum tkv_rabitq_isa isa;
        TKV_TRY(default_isa(&isa));
        k = kernels_of(isa);
        __atomic_store_n(&chosen, k, __ATOMIC_RELEASE);
    }
    *out = k;
    return TKV_OK;
}

static tkv_status select_topp(const struct rq_kernels *kern, const float *est, const float *bound, uint32_t n,
                              const struct tkv_rabitq_topp_params *pp, void *work, size_t work_bytes, uint32_t *pos,
                              uint32_t cap, struct tkv_rabitq_topp_result *res)
{
    if (!pp || !res || (n && !est) || (cap && !pos))
        return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: topp: NULL argument");
    memset(res, 0, sizeof *res);
    const float p = pp->p, scale = pp->scale;
    if (!(p > 0 && p <= 1))
        return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: topp: p %g outside (0, 1]", (double)p);
    if (!(scale > 0) || !isfinite(scale))
        return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: topp: scale %g must be positive", (double)scale);
    if (isnan(pp->extra_lse) || pp->extra_lse == INFINITY)
        return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: topp: extra_lse %g", (double)pp->extra_lse);
    if ((uint64_t)pp->pos0 + n > UINT32_MAX)
        return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: topp: positions %u + %u overflow", pp->pos0, n);
    if (pp->n_forced && !pp->forced)
        return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: topp: forced ranges NULL");
    for (uint32_t r = 0; r < pp->n_forced; r++)
        if (pp->forced[r].begin > pp->forced[r].end || (r && pp->forced[r].begin < pp->forced[r - 1].end))
            return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: topp: forced range %u [%u, %u) not ascending and disjoint", r,
                           pp->forced[r].begin, pp->forced[r].end);
    if (n && (!work || work_bytes < tkv_rabitq_topp_work_bytes(n) || ((uintptr_t)work & 7)))
        return tkv_err(TKV_ERR_TOO_SMALL, "rabitq: topp: work of %zu bytes, %zu needed (8-byte aligned)", work_bytes,
                       tkv_rabitq_topp_work_bytes(n));

    struct topp_work w = {0};
    if (n)
        w = topp_carve(work, n);
    const double lp = 1 - (double)p;
    float lb[RQ_TOPP_CHUNK], ub[RQ_TOPP_CHUNK]; /* one chunk's l and u */
    uint32_t idx[RQ_TOPP_CHUNK];                /* one chunk's keys in some bins */
    /* pass 1: log-values, maxima, input checks */
    float gmax = -INFINITY, umax = -INFINITY;
    const uint32_t bad = kern->topp_logvalues(est, bound, n, scale, p, w.g, &umax);
    if (bad < n)
        return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: topp: key %u: estimate %g or bound %g", bad, (double)est[bad],
                       bound ? (double)bound[bad] : 0.0);
    uint32_t n_cand = 0, r = 0;
    for (uint32_t i = 0, e; i < n; i = e) {
        bool forced;
        e = run_end(pp, n, i, &r, &forced);
        if (!forced) {
            gmax = kern->topp_max(w.g + i, e - i, gmax);
            n_cand += e - i;
        }
    }
    float M = umax > pp->extra_lse ? umax : pp->extra_lse; /* every exp below is of something <= 0 */
    if (M == -INFINITY)
        M = 0;
    /* pass 2: the forced keys' l, and the histogram of the candidates */
    double N = expf(pp->extra_lse - M);
    if (n)
        memset(w.hl, 0, NBINS * 2 * sizeof(double) + NBINS * sizeof(uint32_t));
    r = 0;
    for (uint32_t i = 0, e; i < n; i = e) {
        bool forced;
        e = run_end(pp, n, i, &r, &forced);
        for (uint32_t c = i; c < e; c += RQ_TOPP_CHUNK) {
            const uint32_t k = TKV_MIN(e - c, (uint32_t)RQ_TOPP_CHUNK);
            kern->topp_weights(est + c, bound ? bound + c : NULL, k, scale, M, lb, ub);
            if (forced) {
                for (uint32_t j = 0; j < k; j++)
                    N += lb[j];
                continue;
            }
            kern->topp_bins(w.g + c, k, gmax, w.bin + c);
            if (bound) {
                for (uint32_t j = 0; j < k; j++) {
                    const uint32_t b = w.bin[c + j] - 1u;
                    w.hl[b] += lb[j];
                    w.hu[b] += ub[j];
                    w.hc[b]++;
                }
            } else { /* l = u: hl below */
                for (uint32_t j = 0; j < k; j++) {
                    const uint32_t b = w.bin[c + j] - 1u;
                    w.hu[b] += ub[j];
                    w.hc[b]++;
                }
            }
        }
    }
    if (n && !bound)
        memcpy(w.hl, w.hu, NBINS * sizeof *w.hl);
    /* hu[b] <- sum of u over bins b.. (from the smallest up) */
    for (int b = NBINS - 2; b >= 0 && n; b--)
        w.hu[b] += w.hu[b + 1];
    /* bins < bstar are kept whole; with partial, bin bstar's first members too */
    uint32_t bstar = 0, cnt = 0;
    const uint32_t keep_cap = pp->max_keep ? pp->max_keep : UINT32_MAX;
    double C = n ? w.hu[0] : 0.0;
    bool partial = false;
    if (n_cand && !(lp * N >= p * C)) {
        for (; bstar < NBINS; bstar++) {
            if (!w.hc[bstar])
                continue;
            const double C_after = bstar + 1 < NBINS ? w.hu[bstar + 1] : 0.0;
            const bool capped = w.hc[bstar] > keep_cap - cnt;
            if (lp * (N + w.hl[bstar]) >= p * C_after || capped) {
                /* (the last non-empty bin always ends here: C_after = 0) */
                if (pp->coarse && !capped) { /* the boundary bin whole */
                    N += w.hl[bstar];
                    C = C_after;
                    cnt += w.hc[bstar];
                    bstar++;
                } else {
                    partial = true;
                }
                break;
            }
            N += w.hl[bstar];
            C = C_after;
            cnt += w.hc[bstar];
            if (cnt == keep_cap) {
                bstar++;
                break;
            }
        }
    }
    if (partial) {
        /* the members, in order; then their l and u by the histogram's kernel */
        uint32_t m = 0;
        r = 0;
        for (uint32_t i = 0, e; i < n; i = e) {
            bool forced;
            e = run_end(pp, n, i, &r, &forced);
            for (uint32_t c = i; c < e && !forced; c += RQ_TOPP_CHUNK) {
                const uint32_t nk = keys_in_bins(kern, w.bin, c, TKV_MIN(e - c, (uint32_t)RQ_TOPP_CHUNK), bstar + 1,
                                                 bstar + 1, 0, idx);
                for (uint32_t x = 0; x < nk; x++)
                    w.cand[m++] = (struct cand){0, w.g[idx[x]], idx[x]};
            }
        }
        sort_cands(w.cand, m);
        float eb[RQ_TOPP_CHUNK], bb[RQ_TOPP_CHUNK];
        for (uint32_t c = 0; c < m; c += RQ_TOPP_CHUNK) {
            const uint32_t k = TKV_MIN(m - c, (uint32_t)RQ_TOPP_CHUNK);
            for (uint32_t j = 0; j < k; j++) {
                eb[j] = est[w.cand[c + j].i];
                bb[j] = bound ? bound[w.cand[c + j].i] : 0.0f;
            }
            kern->topp_weights(eb, bound ? bb : NULL, k, scale, M, lb, ub);
            for (uint32_t j = 0; j < k; j++) {
                w.cand[c + j].c = ub[j];
                w.cand[c + j].g = lb[j];
            }
        }
        const double C_after = bstar + 1 < NBINS ? w.hu[bstar + 1] : 0.0;
        double acc = C_after;
        for (uint32_t j = m; j-- > 0;)
            w.cand[j].c = acc += w.cand[j].c;
        for (uint32_t j = 0; j < m; j++) {
            C = w.cand[j].c;
            if (lp * N >= p * C || cnt >= keep_cap)
                break;
            N += w.cand[j].g; /* l */
            w.bin[w.cand[j].i] = 0; /* taken */
            cnt++;
            C = j + 1 < m ? w.cand[j + 1].c : C_after;
        }
    }
    /* pass 3: the output, ascending, forced ranges merged in */
    uint64_t count = 0; /* (forced ranges can be long) */
    const uint32_t end = pp->pos0 + n;
#define EMIT(x)                          \
    do {                                 \
        if (count < cap)                 \
            pos[count] = (x);            \
        count++;                         \
    } while (0)
    r = 0;
    for (; r < pp->n_forced && pp->forced[r].begin < pp->pos0; r++) { /* forced positions before est */
        for (uint32_t x = pp->forced[r].begin; x < TKV_MIN(pp->forced[r].end, pp->pos0); x++)
            EMIT(x);
        if (pp->forced[r].end > pp->pos0)
            break; /* it goes on into est (and maybe past it) */
    }
    uint32_t r2 = r;
    for (uint32_t i = 0, e; i < n; i = e) {
        bool forced;
        e = run_end(pp, n, i, &r2, &forced);
        if (forced) {
            for (uint32_t j = i; j < e; j++)
                EMIT(pp->pos0 + j);
            continue;
        }
        for (uint32_t c = i; c < e; c += RQ_TOPP_CHUNK) {
            const uint32_t k = TKV_MIN(e - c, (uint32_t)RQ_TOPP_CHUNK);
            if (count + k <= cap) { /* room for all: straight into pos */
                count += keys_in_bins(kern, w.bin, c, k, 0, bstar, pp->pos0, pos + count);
                continue;
            }
            const uint32_t nk = keys_in_bins(kern, w.bin, c, k, 0, bstar, pp->pos0, idx);
            for (uint32_t x = 0; x < nk; x++)
                EMIT(idx[x]);
        }
    }
    for (; r < pp->n_forced; r++) /* forced positions at or past the end of est */
        for (uint32_t x = TKV_MAX(pp->forced[r].begin, end); x < pp->forced[r].end; x++)
            EMIT(x);
#undef EMIT
    res->n_pos = (uint32_t)TKV_MIN(count, (uint64_t)UINT32_MAX);
    res->n_chosen = cnt;
    res->mass = N + C > 0 ? N / (N + C) : 1.0;
    if (count > cap)
        return tkv_err(TKV_ERR_TOO_SMALL, "rabitq: topp: %llu positions selected, room for %u", (unsigned long long)count,
                       cap);
    return TKV_OK;
}

tkv_status tkv_rabitq_select_topp(const float *est, const float *bound, uint32_t n,
                                  const struct tkv_rabitq_topp_params *params, void *work, size_t work_bytes,
                                  uint32_t *pos, uint32_t cap, struct tkv_rabitq_topp_result *res)
{
    const struct rq_kernels *kern;
    TKV_TRY(topp_kernels(&kern));
    return select_topp(kern, est, bound, n, params, work, work_bytes, pos, cap, res);
}

tkv_status tkv_rabitq_select_topp_isa(enum tkv_rabitq_isa isa, const float *est, const float *bound, uint32_t n,
                                      const struct tkv_rabitq_topp_params *params, void *work, size_t work_bytes,
                                      uint32_t *pos, uint32_t cap, struct tkv_rabitq_topp_result *res)
{
    if (!tkv_rabitq_isa_supported(isa))
        return tkv_err(TKV_ERR_UNSUPPORTED, "rabitq: topp: %s kernels are not available on this CPU or build",
                       tkv_rabitq_isa_name(isa));
    return select_topp(kernels_of(isa), est, bound, n, params, work, work_bytes, pos, cap, res);
}
