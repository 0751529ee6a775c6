/*
 * rabitq-dev.c -- the device twin of a RaBitQ index (rabitq.h): its arrays
 * in backend memory, filled and read by the backend's rabitq ops.
 */
#include "rabitq-impl.h"

#include <stdlib.h>

struct tkv_rabitq_dev_index {
    struct tkv_backend *be;
    const struct tkv_rabitq *host; /* prepares the queries; its rotation and centroids */
    uint32_t gen;                  /* host->gen when the rotation was copied            */
    struct tkv_rabitq_dev d;
    void *mem;                     /* one allocation holds every array                  */
    size_t bytes;                  /* its size                                          */
    uint32_t n, cap;
};

tkv_status tkv_rabitq_dev_create(struct tkv_backend *be, const struct tkv_rabitq *ix, uint32_t cap,
                                 struct tkv_rabitq_dev_index **out)
{
    *out = NULL;
    if (!be || !ix)
        return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: dev_create: NULL argument");
    if (!be->ops->rabitq_encode || !be->ops->rabitq_estimate)
        return tkv_err(TKV_ERR_UNSUPPORTED, "rabitq: the %s backend has no RaBitQ kernels", be->ops->name);
    if (!ix->centred)
        return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: dev_create before set_centroids");
    const size_t D = ix->dim_pad, W = ix->words;
    /* layout, each piece 256-byte aligned: sign, ck, cq | code | a, e, t | pc */
    size_t off[8], total = 0;
    const size_t bytes[8] = {3 * D * sizeof(float), D * sizeof(float), D * sizeof(float),
                             (size_t)cap * W * sizeof(uint64_t), (size_t)cap * sizeof(float),
                             (size_t)cap * sizeof(float), (size_t)cap * sizeof(float), (size_t)cap * sizeof(uint16_t)};
    for (int i = 0; i < 8; i++) {
        off[i] = total;
        total += tkv_align_up(bytes[i] ? bytes[i] : 1, 256);
    }
    struct tkv_rabitq_dev_index *d = calloc(1, sizeof *d);
    if (!d)
        return tkv_err(TKV_ERR_NOMEM, "rabitq: dev_create: out of memory");
    tkv_status st = be->ops->alloc(be, total, &d->mem);
    if (st != TKV_OK) {
        free(d);
        return tkv_err_wrap(st, "rabitq: device index of %u keys", cap);
    }
    uint8_t *m = d->mem;
    d->bytes = total;
    d->be = be;
    d->host = ix;
    d->gen = ix->gen;
    d->cap = cap;
    d->d = (struct tkv_rabitq_dev){.dim = ix->dim, .dim_pad = ix->dim_pad, .words = ix->words,
                                   .rot_scale = ix->rot_scale, .sign = (const float *)(m + off[0]),
                                   .ck = (const float *)(m + off[1]), .cq = (const float *)(m + off[2]),
                                   .code = (uint64_t *)(m + off[3]), .a = (float *)(m + off[4]),
                                   .e = (float *)(m + off[5]), .t = (float *)(m + off[6]),
                                   .pc = (uint16_t *)(m + off[7])};
    if ((st = be->ops->upload(be, m + off[0], ix->sign, bytes[0])) != TKV_OK ||
        (st = be->ops->upload(be, m + off[1], ix->ck, bytes[1])) != TKV_OK ||
        (st = be->ops->upload(be, m + off[2], ix->cq, bytes[2])) != TKV_OK) {
        tkv_rabitq_dev_free(d);
        return st;
    }
    *out = d;
    return TKV_OK;
}

void tkv_rabitq_dev_free(struct tkv_rabitq_dev_index *d)
{
    if (!d)
        return;
    if (d->mem)
        d->be->ops->release(d->be, d->mem);
    free(d);
}

uint32_t tkv_rabitq_dev_size(const struct tkv_rabitq_dev_index *d) { return d ? d->n : 0; }

const struct tkv_rabitq_dev *tkv_rabitq_dev_arrays(const struct tkv_rabitq_dev_index *d) { return d ? &d->d : NULL; }

size_t tkv_rabitq_dev_bytes(const struct tkv_rabitq_dev_index *d) { return d ? sizeof *d + d->bytes : 0; }

tkv_status tkv_rabitq_dev_append(struct tkv_rabitq_dev_index *d, const uint16_t *k, size_t row_stride, uint32_t n)
{
    if (!d || (!k && n))
        return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: dev_append: index or rows NULL");
    if (row_stride < d->d.dim)
        return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: dev_append: row stride %zu < head_dim %u", row_stride, d->d.dim);
    if (n > d->cap - d->n)
        return tkv_err(TKV_ERR_TOO_SMALL, "rabitq: dev_append of %u keys to %u of %u reserved", n, d->n, d->cap);
    if (n == 0)
        return TKV_OK;
    TKV_TRY(d->be->ops->rabitq_encode(d->be, &d->d, k, row_stride, n, d->n));
    d->n += n;
    return TKV_OK;
}

tkv_status tkv_rabitq_dev_estimate(const struct tkv_rabitq_dev_index *d, const struct tkv_rabitq_query *q,
                                   uint32_t first, uint32_t n, float *est, float *bound)
{
    if (!d || !q || (!est && n))
        return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: dev_estimate: NULL argument");
    if (q->ix != d->host || q->gen != d->gen)
        return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: dev_estimate: the query was prepared for another index");
    if (first > d->n || n > d->n - first)
        return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: dev_estimate: keys [%u, %llu) outside the %u encoded", first,
                       (unsigned long long)first + n, d->n);
    return n ? d->be->ops->rabitq_estimate(d->be, &d->d, q, first, n, est, bound) : TKV_OK;
}
