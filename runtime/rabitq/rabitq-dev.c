/*
 * rabitq-dev.c -- the device twin of a RaBitQ index (rabitq.h): its arrays
 * in backend memory, filled and read by the backend's rabitq ops.
 */
#include "rabitq-impl.h"

#include <stdlib.h>

_Static_assert(TKV_RABITQ_DEV_QUERY_WORDS == TKV_RABITQ_MAX_WORDS, "device query planes as wide as the host's");

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
                                   .rot_scale = ix->rot_scale, .cqck = ix->cqck,
                                   .sign = (const float *)(m + off[0]),
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

tkv_status tkv_rabitq_dev_append_spans(struct tkv_rabitq_dev_index *d, const struct tkv_rabitq_span *spans,
                                       uint32_t n_spans, size_t row_stride)
{
    if (!d || (!spans && n_spans))
        return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: dev_append: index or spans NULL");
    if (row_stride < d->d.dim)
        return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: dev_append: row stride %zu < head_dim %u", row_stride, d->d.dim);
    uint64_t n = 0;
    for (uint32_t s = 0; s < n_spans; s++) {
        if (!spans[s].k && spans[s].n)
            return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: dev_append: span %u of %u rows is NULL", s, spans[s].n);
        n += spans[s].n;
    }
    if (n > d->cap - d->n)
        return tkv_err(TKV_ERR_TOO_SMALL, "rabitq: dev_append of %llu keys to %u of %u reserved",
                       (unsigned long long)n, d->n, d->cap);
    if (n == 0)
        return TKV_OK;
    TKV_TRY(d->be->ops->rabitq_encode(d->be, &d->d, spans, n_spans, row_stride, d->n));
    d->n += (uint32_t)n;
    return TKV_OK;
}

tkv_status tkv_rabitq_dev_append(struct tkv_rabitq_dev_index *d, const uint16_t *k, size_t row_stride, uint32_t n)
{
    if (!d || (!k && n))
        return tkv_err(TKV_ERR_INVALID_ARG, "rabitq: dev_append: index or rows NULL");
    const struct tkv_rabitq_span sp = {k, n};
    return tkv_rabitq_dev_append_spans(d, &sp, 1, row_stride);
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

static void set_bits(uint32_t *row, uint32_t b0, uint32_t b1)
{
    for (uint32_t x = b0; x < b1; x++)
        row[x / 32] |= 1u << (x % 32);
}

tkv_status tkv_rabitq_select_check_out(const struct tkv_rabitq_select_args *a, const char *who)
{
    if (!a || !a->heads)
        return tkv_err(TKV_ERR_INVALID_ARG, "%s: NULL arguments or heads", who);
    if (!a->bitmap == !a->bitmap_dev)
        return tkv_err(TKV_ERR_INVALID_ARG, "%s: bitmap and bitmap_dev both %s (exactly one is the output)", who,
                       a->bitmap ? "set" : "NULL");
    if (!a->bitmap_dev)
        return TKV_OK;
    for (uint32_t h = 0; h < a->n_heads; h++) {
        if (a->heads[h].row >= a->n_rows)
            return tkv_err(TKV_ERR_INVALID_ARG, "%s: head %u: bitmap_dev row %u of %u", who, h, a->heads[h].row,
                           a->n_rows);
        for (uint32_t j = 0; j < h; j++)
            if (a->heads[j].row == a->heads[h].row)
                return tkv_err(TKV_ERR_INVALID_ARG, "%s: heads %u and %u both write bitmap_dev row %u", who, j, h,
                               a->heads[h].row);
    }
    return TKV_OK;
}

tkv_status tkv_rabitq_select_check(const struct tkv_rabitq_select_args *a, const char *who, uint32_t *n_max)
{
    TKV_TRY(tkv_rabitq_select_check_out(a, who));
    if (a->G == 0 || a->G > TKV_RABITQ_SELECT_MAX_G)
        return tkv_err(TKV_ERR_INVALID_ARG, "%s: G = %u (1..%d)", who, a->G, TKV_RABITQ_SELECT_MAX_G);
    /* top-p's own refusals, here so that they are not taken for a
     * non-finite estimate (tkv_rabitq_select_pair: the whole head) */
    if (!(a->p > 0 && a->p <= 1) || !(a->scale > 0) || !isfinite(a->scale) || isnan(a->extra_lse) ||
        a->extra_lse == INFINITY)
        return tkv_err(TKV_ERR_INVALID_ARG, "%s: p %g (0 < p <= 1), scale %g (finite, > 0), extra_lse %g", who,
                       (double)a->p, (double)a->scale, (double)a->extra_lse);
    *n_max = 0;
    for (uint32_t h = 0; h < a->n_heads; h++) {
        const struct tkv_rabitq_select_head *hd = &a->heads[h];
        if (!hd->ix || (!hd->q && !hd->q_dev) || hd->n == 0 || hd->n > TKV_RABITQ_SELECT_MAX_N ||
            hd->n_forced > TKV_RABITQ_SELECT_MAX_FORCED)
            return tkv_err(TKV_ERR_INVALID_ARG, "%s: head %u: %u keys (1..%u), %u forced ranges (at most %d)", who, h,
                           hd->n, TKV_RABITQ_SELECT_MAX_N, hd->n_forced, TKV_RABITQ_SELECT_MAX_FORCED);
        for (uint32_t r = 0; r < hd->n_forced; r++)
            if (hd->forced[r].begin > hd->forced[r].end || hd->forced[r].end > hd->n ||
                (r && hd->forced[r].begin < hd->forced[r - 1].end))
                return tkv_err(TKV_ERR_INVALID_ARG, "%s: head %u: forced range %u [%u, %u) not ascending within [0, %u)",
                               who, h, r, hd->forced[r].begin, hd->forced[r].end, hd->n);
        for (uint32_t j = 0; j < a->G && hd->q; j++) /* (q_dev: rabitq_prepare wrote the twin's words) */
            if (hd->q[j].words != hd->ix->words)
                return tkv_err(TKV_ERR_INVALID_ARG, "%s: head %u query %u: %u words, index %u", who, h, j,
                               hd->q[j].words, hd->ix->words);
        *n_max = TKV_MAX(*n_max, hd->n);
    }
    if ((uint64_t)a->words * 32 < *n_max)
        return tkv_err(TKV_ERR_INVALID_ARG, "%s: %u bitmap words for %u keys", who, a->words, *n_max);
    return TKV_OK;
}

size_t tkv_rabitq_select_pair_bytes(uint32_t n)
{
    return 3 * tkv_align_up((size_t)n * sizeof(float), 8) + tkv_rabitq_topp_work_bytes(n);
}

tkv_status tkv_rabitq_select_pair(const struct tkv_rabitq_select_args *a, uint32_t h, uint32_t j, void *scratch,
                                  uint32_t *row)
{
    const struct tkv_rabitq_select_head *hd = &a->heads[h];
    const size_t nb = tkv_align_up((size_t)hd->n * sizeof(float), 8);
    float *est = scratch, *bound = (float *)((char *)scratch + nb);
    uint32_t *pos = (uint32_t *)((char *)scratch + 2 * nb);
    void *work = (char *)scratch + 3 * nb;
    struct tkv_range forced[TKV_RABITQ_SELECT_MAX_FORCED];
    for (uint32_t r = 0; r < hd->n_forced; r++)
        forced[r] = (struct tkv_range){hd->forced[r].begin, hd->forced[r].end};
    const struct tkv_rabitq_topp_params tp = {.p = a->p, .scale = a->scale, .extra_lse = a->extra_lse, .pos0 = 0,
                                              .forced = forced, .n_forced = hd->n_forced, .coarse = a->coarse};
    struct tkv_rabitq_query qd;
    if (!hd->q) /* prepared by rabitq_prepare: the fields estimate reads */
        tkv_rabitq_query_from_dev(&hd->q_dev[j], NULL, &qd);
    TKV_TRY(tkv_rabitq_host_estimate(hd->ix, hd->q ? &hd->q[j] : &qd, 0, hd->n, est, a->safe ? bound : NULL));
    struct tkv_rabitq_topp_result res;
    tkv_status st = tkv_rabitq_select_topp(est, a->safe ? bound : NULL, hd->n, &tp, work,
                                           tkv_rabitq_topp_work_bytes(hd->n), pos, hd->n, &res);
    if (st == TKV_ERR_INVALID_ARG) { /* a non-finite estimate: the whole head */
        set_bits(row, 0, hd->n);
        res.n_chosen = UINT32_MAX, res.mass = NAN;
    } else if (st != TKV_OK) {
        return st;
    } else {
        for (uint32_t x = 0; x < res.n_pos; x++)
            row[pos[x] / 32] |= 1u << (pos[x] % 32);
    }
    if (a->n_chosen)
        a->n_chosen[h * a->G + j] = res.n_chosen;
    if (a->mass)
        a->mass[h * a->G + j] = res.mass;
    return TKV_OK;
}

uint32_t *tkv_rabitq_select_row(const struct tkv_rabitq_select_args *a, uint32_t h)
{
    return a->bitmap ? a->bitmap + (size_t)h * a->words : a->bitmap_dev + (size_t)a->heads[h].row * a->words;
}

void tkv_rabitq_select_widen(const struct tkv_rabitq_select_args *a, uint32_t h, uint32_t *row)
{
    const uint32_t n = a->heads[h].n;
    for (uint32_t b0 = 0; a->whole && b0 < n; b0 += a->whole) {
        const uint32_t b1 = TKV_MIN(b0 + a->whole, n);
        bool any = false;
        for (uint32_t x = b0; x < b1 && !any; x++)
            any = row[x / 32] >> (x % 32) & 1;
        if (any)
            set_bits(row, b0, b1);
    }
}

tkv_status tkv_rabitq_host_select(const struct tkv_rabitq_select_args *a)
{
    uint32_t n_max;
    TKV_TRY(tkv_rabitq_select_check(a, "rabitq: host_select", &n_max));
    void *scratch = malloc(tkv_rabitq_select_pair_bytes(n_max));
    tkv_status st = scratch ? TKV_OK : tkv_err(TKV_ERR_NOMEM, "rabitq: host_select: out of memory");
    for (uint32_t h = 0; h < a->n_heads && st == TKV_OK; h++) {
        uint32_t *row = tkv_rabitq_select_row(a, h);
        memset(row, 0, (size_t)a->words * sizeof *row);
        for (uint32_t j = 0; j < a->G && st == TKV_OK; j++)
            st = tkv_rabitq_select_pair(a, h, j, scratch, row);
        tkv_rabitq_select_widen(a, h, row);
    }
    free(scratch);
    return st;
}
