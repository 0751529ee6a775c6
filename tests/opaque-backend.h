/*
 * opaque-backend.h -- a test backend: the CPU backend behind tagged
 * pointers. Its memory is the CPU backend's, but every pointer it hands out
 * is moved into non-canonical addresses (bit 62), so any code that reads
 * "device" memory directly (a policy, the engine's host-side code) faults,
 * and a host pointer passed to it as backend memory fails a CHECK. It has no
 * asynchronous uploads: the KV store moves blocks with upload/download.
 * This is how the CPU-only CI exercises device-backend code paths.
 * Header-only; include it in one test file after test.h.
 */
#ifndef TKV_OPAQUE_BACKEND_H
#define TKV_OPAQUE_BACKEND_H

#include "runtime/backend.h"
#include "runtime/rabitq/rabitq.h" /* tkv_rabitq_host_select */
#include "test.h"

#include <stdlib.h>
#include <string.h>

/* Bit 62 set: non-canonical on x86-64 and AArch64, so a dereference faults;
 * adding and subtracting it is linear, so the engine's pointer arithmetic
 * on tagged pointers stays valid. */
#define TAG ((uintptr_t)1 << 62)

struct opaque {
    struct tkv_backend base;
    struct tkv_backend *cpu;
    struct tkv_kv_head_view *views;  /* untagged copies of a call's views */
    struct tkv_kv_block_ref *refs;
    size_t cap_views, cap_refs;
};

static uint64_t opaque_stats_calls;     /* attn_stats calls on every opaque backend */
static uint64_t opaque_attention_calls; /* attention calls on every opaque backend */
static uint64_t opaque_attention_dev_calls; /* of them, over device views (kv_dev) */
static uint64_t opaque_attention_counted_calls; /* of those, with the counts in backend memory (kv_dev_n) */

static void *tag(void *p) { return p ? (void *)((uintptr_t)p + TAG) : NULL; }
static void *untag(const void *p)
{
    if (!p)
        return NULL;
    CHECK(((uintptr_t)p & TAG) != 0, "a host pointer %p reached the opaque backend as backend memory", p);
    return (void *)((uintptr_t)p - TAG);
}
#define U(p) ((__typeof__(p))untag(p))

static struct opaque *op_of(struct tkv_backend *b) { return (struct opaque *)b; }

/* Untagged copies of n_head_kv head views; dev: their block arrays are in
 * backend memory too (tkv_attn_args.kv_dev); counted (or NULL): an
 * attention's args whose kv is kv and whose kv_dev_n is readable here, each
 * head's entries then up to its count (tkv_attn_head_blocks; those past it
 * are not the op's to read). */
static tkv_status untag_views(struct opaque *o, const struct tkv_kv_head_view *kv, uint32_t n, bool dev,
                              const struct tkv_attn_args *counted, const struct tkv_kv_head_view **out)
{
    size_t total = 0;
    for (uint32_t g = 0; g < n; g++)
        total += counted ? tkv_attn_head_blocks(counted, g) : kv[g].n_blocks;
    if (n > o->cap_views) {
        free(o->views);
        o->views = malloc(n * sizeof *o->views), o->cap_views = n;
    }
    if (total > o->cap_refs) {
        free(o->refs);
        o->refs = malloc(total * sizeof *o->refs), o->cap_refs = total;
    }
    if (!o->views || (total && !o->refs))
        return tkv_err(TKV_ERR_NOMEM, "opaque: out of memory");
    size_t k = 0;
    for (uint32_t g = 0; g < n; g++) {
        const uint32_t nb = counted ? tkv_attn_head_blocks(counted, g) : kv[g].n_blocks;
        o->views[g] = (struct tkv_kv_head_view){.blocks = o->refs + k, .n_blocks = nb};
        const struct tkv_kv_block_ref *blocks = dev ? U(kv[g].blocks) : kv[g].blocks;
        for (uint32_t i = 0; i < nb; i++, k++) {
            o->refs[k] = blocks[i];
            o->refs[k].k = U(o->refs[k].k);
            o->refs[k].v = U(o->refs[k].v);
        }
    }
    *out = o->views;
    return TKV_OK;
}

static void o_free(struct tkv_backend *b)
{
    struct opaque *o = op_of(b);
    o->cpu->ops->free(o->cpu);
    free(o->views), free(o->refs), free(o);
}
static tkv_status o_alloc(struct tkv_backend *b, size_t bytes, void **out)
{
    TKV_TRY(op_of(b)->cpu->ops->alloc(op_of(b)->cpu, bytes, out));
    *out = tag(*out);
    return TKV_OK;
}
static void o_release(struct tkv_backend *b, void *p) { op_of(b)->cpu->ops->release(op_of(b)->cpu, U(p)); }
static tkv_status o_upload(struct tkv_backend *b, void *dst, const void *src, size_t n)
{
    return op_of(b)->cpu->ops->upload(op_of(b)->cpu, U(dst), src, n);
}
static tkv_status o_download(struct tkv_backend *b, void *dst, const void *src, size_t n)
{
    return op_of(b)->cpu->ops->download(op_of(b)->cpu, dst, U(src), n);
}
/* one block at a time (the CPU backend has no batch op), with the translation */
static uint64_t opaque_download_batches; /* download_blocks calls */
static tkv_status o_download_blocks(struct tkv_backend *b, void *const *dst, const void *const *src, uint32_t n,
                                    size_t bytes)
{
    opaque_download_batches++;
    for (uint32_t j = 0; j < n; j++)
        TKV_TRY(o_download(b, dst[j], src[j], bytes));
    return TKV_OK;
}
static tkv_status o_sync(struct tkv_backend *b) { return op_of(b)->cpu->ops->synchronize(op_of(b)->cpu); }
static tkv_status o_weight_init(struct tkv_backend *b, const struct tkv_gguf_tensor *t, struct tkv_bweight **out)
{
    return op_of(b)->cpu->ops->weight_init(op_of(b)->cpu, t, out);
}
static void o_weight_free(struct tkv_backend *b, struct tkv_bweight *w) { op_of(b)->cpu->ops->weight_free(op_of(b)->cpu, w); }
static tkv_status o_get_rows(struct tkv_backend *b, const struct tkv_bweight *w, const int32_t *ids, uint32_t n,
                             float *out)
{
    return op_of(b)->cpu->ops->get_rows(op_of(b)->cpu, w, ids, n, U(out));
}
static tkv_status o_matmul(struct tkv_backend *b, const struct tkv_bweight *w, const float *x, float *y, uint32_t n)
{
    return op_of(b)->cpu->ops->matmul(op_of(b)->cpu, w, U(x), U(y), n);
}
static tkv_status o_rmsnorm(struct tkv_backend *b, const float *x, const struct tkv_bweight *w, float *y, uint32_t n,
                            uint32_t dim, float eps)
{
    return op_of(b)->cpu->ops->rmsnorm(op_of(b)->cpu, U(x), w, U(y), n, dim, eps);
}
static tkv_status o_rope(struct tkv_backend *b, float *x, uint32_t n, uint32_t nh, uint32_t hd, uint32_t rot,
                         const int32_t *pos, float base, float fs)
{
    return op_of(b)->cpu->ops->rope(op_of(b)->cpu, U(x), n, nh, hd, rot, pos, base, fs);
}
static tkv_status o_swiglu(struct tkv_backend *b, const float *g, const float *u, float *out, size_t n)
{
    return op_of(b)->cpu->ops->swiglu(op_of(b)->cpu, U(g), U(u), U(out), n);
}
static tkv_status o_add(struct tkv_backend *b, float *y, const float *x, size_t n)
{
    return op_of(b)->cpu->ops->add(op_of(b)->cpu, U(y), U(x), n);
}
static tkv_status o_kv_write(struct tkv_backend *b, const float *src, size_t stride, uint16_t *dst, uint32_t rows,
                             uint32_t hd)
{
    return op_of(b)->cpu->ops->kv_write(op_of(b)->cpu, U(src), stride, U(dst), rows, hd);
}
static tkv_status o_attention(struct tkv_backend *b, const struct tkv_attn_args *a)
{
    struct opaque *o = op_of(b);
    struct tkv_attn_args c = *a;
    c.q = U(a->q), c.out = U(a->out), c.lse = U(a->lse);
    opaque_attention_calls++;
    opaque_attention_dev_calls += a->kv_dev;
    c.kv_dev = false;
    opaque_attention_counted_calls += a->kv_dev_n != NULL;
    c.kv_dev_n = U(a->kv_dev_n); /* the counts read through their translation (the CPU backend reads them too) */
    TKV_TRY(untag_views(o, a->kv, a->n_head_kv, a->kv_dev, &c, &c.kv));
    return o->cpu->ops->attention(o->cpu, &c);
}
static tkv_status o_attn_stats(struct tkv_backend *b, const struct tkv_attn_stats_args *a)
{
    struct opaque *o = op_of(b);
    struct tkv_attn_stats_args c = *a;
    if (!a->q_host)
        c.q = U(a->q);
    TKV_TRY(untag_views(o, a->kv, a->n_head_kv, false, NULL, &c.kv));
    opaque_stats_calls++;
    return o->cpu->ops->attn_stats(o->cpu, &c);
}

static uint64_t opaque_rabitq_calls; /* rabitq ops on every opaque backend */

/* The device twin's arrays, untagged. */
static struct tkv_rabitq_dev untag_rabitq(const struct tkv_rabitq_dev *ix)
{
    struct tkv_rabitq_dev c = *ix;
    c.sign = U(ix->sign), c.ck = U(ix->ck), c.cq = U(ix->cq), c.code = U(ix->code), c.a = U(ix->a);
    c.e = U(ix->e), c.t = U(ix->t), c.pc = U(ix->pc);
    return c;
}
static uint64_t opaque_encode_calls, opaque_encode_spans; /* rabitq_encode calls, and spans they carried */
static tkv_status o_rabitq_encode(struct tkv_backend *b, const struct tkv_rabitq_dev *ix,
                                  const struct tkv_rabitq_span *spans, uint32_t n_spans, size_t stride, uint32_t at)
{
    const struct tkv_rabitq_dev c = untag_rabitq(ix);
    struct tkv_rabitq_span *u = malloc((n_spans ? n_spans : 1) * sizeof *u);
    if (!u)
        return tkv_err(TKV_ERR_NOMEM, "opaque: rabitq_encode of %u spans", n_spans);
    for (uint32_t s = 0; s < n_spans; s++)
        u[s] = (struct tkv_rabitq_span){U(spans[s].k), spans[s].n};
    opaque_rabitq_calls++;
    opaque_encode_calls++;
    opaque_encode_spans += n_spans;
    tkv_status st = op_of(b)->cpu->ops->rabitq_encode(op_of(b)->cpu, &c, u, n_spans, stride, at);
    free(u);
    return st;
}
/* the spans walked last to first: the sums are exact, so any order gives them */
static uint64_t opaque_key_sums_calls;
static tkv_status o_rabitq_key_sums(struct tkv_backend *b, const struct tkv_rabitq_span *spans, uint32_t n_spans,
                                    size_t stride, uint32_t dim, int64_t *units, uint32_t *nonfinite)
{
    (void)b;
    opaque_key_sums_calls++;
    for (uint32_t s = n_spans; s-- > 0;) {
        const uint16_t *k = U(spans[s].k);
        for (uint32_t r = spans[s].n; r-- > 0;)
            for (uint32_t d = 0; d < dim; d++) {
                const uint16_t h = k[(size_t)r * stride + d];
                if (TKV_RABITQ_F16_FINITE(h))
                    units[d] += TKV_RABITQ_F16_UNITS(h);
                else
                    nonfinite[d]++;
            }
    }
    return TKV_OK;
}
static tkv_status o_rabitq_estimate(struct tkv_backend *b, const struct tkv_rabitq_dev *ix,
                                    const struct tkv_rabitq_query *q, uint32_t first, uint32_t n, float *est,
                                    float *bound)
{
    const struct tkv_rabitq_dev c = untag_rabitq(ix);
    opaque_rabitq_calls++;
    return op_of(b)->cpu->ops->rabitq_estimate(op_of(b)->cpu, &c, q, first, n, U(est), U(bound));
}

/* rabitq_select through the host reference (a stand-in for a device's op:
 * the policies' one-call-per-layer path runs in the CPU-only tests too). */
static uint64_t opaque_select_calls;
static tkv_status o_rabitq_select(struct tkv_backend *b, const struct tkv_rabitq_select_args *a)
{
    (void)b;
    enum { MAXH = 64 };
    struct tkv_rabitq_dev ix[MAXH];
    struct tkv_rabitq_select_head hd[MAXH];
    if (!a || !a->heads)
        return tkv_rabitq_host_select(a); /* (its refusal) */
    if (a->n_heads > MAXH)
        return tkv_err(TKV_ERR_UNSUPPORTED, "opaque: rabitq_select of %u heads", a->n_heads);
    for (uint32_t h = 0; h < a->n_heads; h++) {
        hd[h] = a->heads[h];
        if (a->heads[h].ix) /* (a NULL one goes on: the reference refuses it) */
            ix[h] = untag_rabitq(a->heads[h].ix), hd[h].ix = &ix[h];
        hd[h].q_dev = U(a->heads[h].q_dev);
    }
    struct tkv_rabitq_select_args c = *a;
    c.heads = hd;
    c.bitmap_dev = U(a->bitmap_dev);
    opaque_rabitq_calls++;
    opaque_select_calls++;
    return tkv_rabitq_host_select(&c);
}

/* rabitq_prepare through the host reference, an item at a time (its twin
 * untagged): the queries stay in the opaque memory, so the policies'
 * device-prepared path runs here too. */
static uint64_t opaque_prepare_calls, opaque_prepare_groups; /* calls; items with rows > 1 */
static tkv_status o_rabitq_prepare(struct tkv_backend *b, const struct tkv_rabitq_prepare_args *a)
{
    (void)b;
    uint32_t *bad = U(a->bad);
    if (bad)
        *bad = UINT32_MAX;
    opaque_rabitq_calls++;
    opaque_prepare_calls++;
    for (uint32_t i = 0; i < a->n; i++) {
        const struct tkv_rabitq_dev ix = untag_rabitq(a->items[i].ix);
        const struct tkv_rabitq_prepare_item it = {&ix, a->items[i].head, a->items[i].rows};
        opaque_prepare_groups += it.rows > 1;
        uint32_t one_bad;
        const struct tkv_rabitq_prepare_args c = {.q = U(a->q), .head_stride = a->head_stride, .items = &it, .n = 1,
                                                  .eps0 = a->eps0, .out = U(a->out) + i, .bad = &one_bad};
        TKV_TRY(tkv_rabitq_host_prepare(&c));
        if (bad && one_bad != UINT32_MAX && *bad == UINT32_MAX)
            *bad = i;
    }
    return TKV_OK;
}

/* The page-table stores and the decode table through the CPU reference,
 * the table and argument arrays untagged; the entries (tagged compute-slot
 * addresses) are only copied and offset, so the refs come out tagged. */
static tkv_status o_table_write(struct tkv_backend *b, uint64_t *table, const uint32_t *idx, const uint64_t *val,
                                uint32_t n)
{
    struct tkv_backend *cpu = op_of(b)->cpu;
    return cpu->ops->table_write(cpu, U(table), idx, val, n);
}

static uint64_t opaque_kv_table_calls;
static bool opaque_kv_table_skew; /* test hook: every kv_table's first resident slice one row short */
static tkv_status o_kv_table(struct tkv_backend *b, const struct tkv_kv_table_args *a)
{
    (void)b;
    opaque_kv_table_calls++;
    if (!a)
        return tkv_kv_table_ref(a);
    struct tkv_kv_table_args c = *a;
    c.bitmap = U(a->bitmap), c.ptab = U(a->ptab), c.refs = U(a->refs), c.miss = U(a->miss), c.counts = U(a->counts);
    c.marks = U(a->marks);
    TKV_TRY(tkv_kv_table_ref(&c));
    for (uint32_t h = 0; opaque_kv_table_skew && h < c.n_heads; h++)
        if (c.counts[4 * h] > 0 && c.refs[(size_t)h * c.cap].n > 1) {
            c.refs[(size_t)h * c.cap].n--;
            break;
        }
    return TKV_OK;
}

static const struct tkv_backend_ops opaque_ops = {
    .name = "opaque", .free = o_free, .alloc = o_alloc, .release = o_release, .upload = o_upload,
    .download = o_download, .download_blocks = o_download_blocks, .synchronize = o_sync,
    .weight_init = o_weight_init, .weight_free = o_weight_free,
    .get_rows = o_get_rows, .matmul = o_matmul, .rmsnorm = o_rmsnorm, .rope = o_rope, .swiglu = o_swiglu,
    .add = o_add, .kv_write = o_kv_write, .attention = o_attention, .attn_stats = o_attn_stats,
    .rabitq_encode = o_rabitq_encode, .rabitq_estimate = o_rabitq_estimate, .rabitq_select = o_rabitq_select,
    .rabitq_prepare = o_rabitq_prepare, .rabitq_key_sums = o_rabitq_key_sums, .table_write = o_table_write,
    .kv_table = o_kv_table};

static tkv_status opaque_create(const char *device, uint32_t n_threads, struct tkv_backend **out)
{
    *out = NULL;
    if (strcmp(device, "opaque"))
        return TKV_ERR_UNSUPPORTED;
    struct opaque *o = calloc(1, sizeof *o);
    if (!o)
        return tkv_err(TKV_ERR_NOMEM, "opaque: out of memory");
    tkv_status st = tkv_backend_create("cpu", n_threads, &o->cpu);
    if (st != TKV_OK) {
        free(o);
        return st;
    }
    o->base.ops = &opaque_ops;
    *out = &o->base;
    return TKV_OK;
}

#endif
