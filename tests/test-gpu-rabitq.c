/*
 * Description: the RaBitQ index on the GPU (backend ops rabitq_encode /
 * rabitq_estimate through runtime/rabitq/rabitq-dev.c) gives the CPU
 * kernels' codes, popcounts, scalars, estimates and bounds bit for bit, for
 * head_dim 64, 96 (padded to 128), 128 and 256, keys appended in uneven
 * batches from strided rows, on fresh random keys and queries; a non-finite
 * key, a full index and a query of another index are refused. Skips (77)
 * without a CUDA device.
 */
#include "test.h"

#include "runtime/backend.h"
#include "runtime/rabitq/rabitq.h"
#include "runtime/tkv-impl.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static uint64_t rng;
static struct tkv_backend *be;

static float gauss(void)
{
    float u1 = test_rand_f32(&rng, 1e-7f, 1.0f), u2 = test_rand_f32(&rng, 0.0f, 1.0f);
    return sqrtf(-2.0f * logf(u1)) * cosf(6.2831853f * u2);
}

/* device buffer of n bytes holding host[0..n) */
static void *to_device(const void *host, size_t n)
{
    void *p = NULL;
    if (be->ops->alloc(be, n, &p) != TKV_OK || be->ops->upload(be, p, host, n) != TKV_OK)
        return NULL;
    return p;
}

static bool same_download(const void *dev, const void *want, size_t n, const char *what, uint32_t D)
{
    void *got = malloc(n ? n : 1);
    bool ok = got && be->ops->download(be, got, dev, n) == TKV_OK && be->ops->synchronize(be) == TKV_OK &&
              memcmp(got, want, n) == 0;
    if (!ok && got) { /* say where */
        const uint8_t *g = got, *w = want;
        size_t i = 0;
        while (i < n && g[i] == w[i])
            i++;
        fprintf(stderr, "  D=%u %s: first difference at byte %zu of %zu\n", D, what, i, n);
    }
    free(got);
    CHECK(ok, "D=%u: %s differ between the GPU and the CPU", D, what);
    return ok;
}

static void run_dim(uint32_t D, enum tkv_rabitq_isa isa)
{
    enum { N = 1500, Q = 24 };
    const size_t stride = D + 8; /* rows with a gap, as KV blocks are not */
    uint16_t *k = malloc((size_t)N * stride * sizeof *k);
    float *off = malloc(D * sizeof *off), *gain = malloc(D * sizeof *gain), *q = malloc(D * sizeof *q);
    float *est = malloc(N * sizeof *est), *bound = malloc(N * sizeof *bound);
    REQUIRE_VOID(k && off && gain && q && est && bound);
    for (uint32_t i = 0; i < D; i++) {
        off[i] = 0.5f * gauss();
        gain[i] = i % 17 == 3 ? 6.0f : 0.3f + test_rand_f32(&rng, 0.0f, 1.5f); /* a few outlier channels */
    }
    for (uint32_t r = 0; r < N; r++)
        for (size_t i = 0; i < stride; i++)
            k[r * stride + i] = tkv_fp32_to_fp16(i < D ? off[i] + gain[i] * gauss() : NAN); /* gap: poison */

    /* the host index: centroids from the first 256 keys, every key appended */
    struct tkv_rabitq *ix = NULL;
    struct tkv_rabitq_mean mk, mq;
    float ck[TKV_RABITQ_MAX_DIM], cq[TKV_RABITQ_MAX_DIM];
    REQUIRE_VOID(tkv_rabitq_init(D, 0x5eedull + D, &ix) == TKV_OK);
    CHECK(tkv_rabitq_set_isa(ix, isa) == TKV_OK, "isa %s", tkv_rabitq_isa_name(isa));
    tkv_rabitq_mean_init(&mk, D);
    tkv_rabitq_mean_init(&mq, D);
    tkv_rabitq_mean_add_f16(&mk, k, stride, 256);
    for (uint32_t j = 0; j < 64; j++) {
        for (uint32_t i = 0; i < D; i++)
            q[i] = 2.0f * gauss() + off[i];
        tkv_rabitq_mean_add_f32(&mq, q, D, 1);
    }
    tkv_rabitq_mean_get(&mk, ck);
    tkv_rabitq_mean_get(&mq, cq);
    REQUIRE_VOID(tkv_rabitq_set_centroids(ix, ck, cq) == TKV_OK);
    REQUIRE_VOID(tkv_rabitq_reserve(ix, N) == TKV_OK);
    REQUIRE_VOID(tkv_rabitq_append_f16(ix, k, stride, N) == TKV_OK);

    /* the device twin, appended in uneven batches */
    uint16_t *k_dev = to_device(k, (size_t)N * stride * sizeof *k);
    struct tkv_rabitq_dev_index *dx = NULL;
    REQUIRE_VOID(k_dev);
    tkv_status st = tkv_rabitq_dev_create(be, ix, N, &dx);
    REQUIRE_VOID(st == TKV_OK);
    const uint32_t cuts[] = {0, 1, 64, 100, 777, N};
    for (size_t c = 0; c + 1 < sizeof cuts / sizeof *cuts; c++) {
        st = tkv_rabitq_dev_append(dx, k_dev + cuts[c] * stride, stride, cuts[c + 1] - cuts[c]);
        CHECK(st == TKV_OK, "D=%u: dev_append [%u, %u): %s", D, cuts[c], cuts[c + 1], tkv_last_error());
    }
    CHECK(tkv_rabitq_dev_size(dx) == N, "D=%u: %u keys on the device", D, tkv_rabitq_dev_size(dx));

    struct tkv_rabitq_arrays h;
    tkv_rabitq_get_arrays(ix, &h);
    const struct tkv_rabitq_dev *d = tkv_rabitq_dev_arrays(dx);
    same_download(d->code, h.code, (size_t)N * h.words * sizeof *h.code, "codes", D);
    same_download(d->pc, h.pc, N * sizeof *h.pc, "popcounts", D);
    same_download(d->a, h.a, N * sizeof *h.a, "scalars a", D);
    same_download(d->e, h.e, N * sizeof *h.e, "scalars e", D);
    same_download(d->t, h.t, N * sizeof *h.t, "scalars t", D);

    /* estimates and bounds for fresh queries, over all keys and a sub-range */
    float *est_dev = NULL, *bound_dev = NULL;
    REQUIRE_VOID(be->ops->alloc(be, N * sizeof(float), (void **)&est_dev) == TKV_OK &&
                 be->ops->alloc(be, N * sizeof(float), (void **)&bound_dev) == TKV_OK);
    for (int j = 0; j < Q; j++) {
        const float s = j % 3 == 0 ? 0.05f : 3.0f; /* some queries nearly the centroid */
        for (uint32_t i = 0; i < D; i++)
            q[i] = cq[i] + s * gauss();
        struct tkv_rabitq_query qq;
        REQUIRE_VOID(tkv_rabitq_query_prepare(ix, q, j % 2 ? 1.5f : 0.0f, &qq) == TKV_OK);
        const uint32_t first = j % 4 == 1 ? 333 : 0, n = N - first - (j % 4 == 1 ? 100 : 0);
        REQUIRE_VOID(tkv_rabitq_estimate(ix, &qq, first, n, est, bound) == TKV_OK);
        st = tkv_rabitq_dev_estimate(dx, &qq, first, n, est_dev, j % 5 == 4 ? NULL : bound_dev);
        CHECK(st == TKV_OK, "D=%u: dev_estimate: %s", D, tkv_last_error());
        same_download(est_dev, est, n * sizeof *est, "estimates", D);
        if (j % 5 != 4)
            same_download(bound_dev, bound, n * sizeof *bound, "bounds", D);
    }

    /* refusals: full, a query of another index, a non-finite key */
    CHECK(tkv_rabitq_dev_append(dx, k_dev, stride, 1) == TKV_ERR_TOO_SMALL, "D=%u: append past the capacity", D);
    struct tkv_rabitq *other = NULL;
    struct tkv_rabitq_query qo;
    if (tkv_rabitq_init(D, 99, &other) == TKV_OK && tkv_rabitq_set_centroids(other, ck, cq) == TKV_OK &&
        tkv_rabitq_query_prepare(other, q, 0, &qo) == TKV_OK)
        CHECK(tkv_rabitq_dev_estimate(dx, &qo, 0, 1, est_dev, NULL) == TKV_ERR_INVALID_ARG,
              "D=%u: a query of another index must be refused", D);
    tkv_rabitq_free(other);
    tkv_rabitq_dev_free(dx);
    REQUIRE_VOID(tkv_rabitq_dev_create(be, ix, 8, &dx) == TKV_OK);
    k[2 * stride + D / 2] = tkv_fp32_to_fp16(INFINITY);
    REQUIRE_VOID(be->ops->upload(be, k_dev, k, (size_t)N * stride * sizeof *k) == TKV_OK);
    st = tkv_rabitq_dev_append(dx, k_dev, stride, 5);
    CHECK(st == TKV_ERR_INVALID_ARG && strstr(tkv_last_error(), "row 2"),
          "D=%u: an infinite key: %s (%s)", D, tkv_status_str(st), tkv_last_error());
    CHECK(tkv_rabitq_dev_size(dx) == 0, "D=%u: the bad batch was kept", D);
    CHECK(tkv_rabitq_dev_append(dx, k_dev + 3 * stride, stride, 5) == TKV_OK, "D=%u: a good batch after: %s", D,
          tkv_last_error());

    tkv_rabitq_dev_free(dx);
    be->ops->release(be, est_dev);
    be->ops->release(be, bound_dev);
    be->ops->release(be, k_dev);
    tkv_rabitq_free(ix);
    free(k), free(off), free(gain), free(q), free(est), free(bound);
}

int main(void)
{
    rng = test_seed();
    if (tkv_backend_cuda_devices() == 0)
        SKIP("no usable CUDA device");
    REQUIRE(tkv_backend_create("cuda", 0, &be) == TKV_OK, "%s", tkv_last_error());
    struct tkv_rabitq_dev_index *dx = NULL;
    struct tkv_rabitq *ix = NULL;
    REQUIRE(tkv_rabitq_init(64, 1, &ix) == TKV_OK, "init");
    CHECK(tkv_rabitq_dev_create(be, ix, 4, &dx) == TKV_ERR_INVALID_ARG, "dev_create before centroids");
    tkv_rabitq_free(ix);
    const uint32_t dims[] = {64, 96, 128, 256};
    for (size_t i = 0; i < sizeof dims / sizeof *dims; i++) {
        run_dim(dims[i], TKV_RABITQ_ISA_SCALAR);
        enum tkv_rabitq_isa best = tkv_rabitq_isa_supported(TKV_RABITQ_ISA_AVX512) ? TKV_RABITQ_ISA_AVX512
                                   : tkv_rabitq_isa_supported(TKV_RABITQ_ISA_AVX2) ? TKV_RABITQ_ISA_AVX2
                                                                                   : TKV_RABITQ_ISA_SCALAR;
        if (best != TKV_RABITQ_ISA_SCALAR)
            run_dim(dims[i], best);
    }
    be->ops->free(be);
    return test_done();
}
