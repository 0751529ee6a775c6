/*
 * bench-rabitq.c -- single-thread throughput of the RaBitQ key index
 * (runtime/rabitq): estimates of q.k per second for every kernel variant,
 * against an exact f16 . f32 dot product over the same keys (the K rows of
 * the KV blocks, [n, head_dim] f16); also encoding and top-p selection.
 *
 *   build/bench/bench-rabitq [--quick]   (--quick: 8K keys only, a smoke run)
 *   build/bench/bench-rabitq --gpu-select [HxG [KEYS [C]]] (CUDA: one layer's
 *       selection, 8 KV heads x 4 query heads unless HxG says (qwen2.5-7b:
 *       4x7), D = 128, at 32K / 128K / 1M keys (or KEYS), by the
 *       union of the query heads' and by their mean's (`mean=1`), exact and
 *       coarse with groups of 16 (the policy's defaults on a GPU; C = 1 .. 4
 *       runs only that one of the four, e.g. under a profiler): the
 *       backend's rabitq_select waited for and queued as the engine queues
 *       it, against the per-head path it replaces -- rabitq_estimate,
 *       download, host select_topp, union -- and the keys where the two
 *       differ)
 *   build/bench/bench-rabitq --cpu-select [T] (the same on the CPU backend,
 *       its rabitq_select on T threads (0: all cores), at 32K and 128K keys)
 *
 * Keys are random (Gaussian, off-centre, a few outlier channels), queries
 * too; every variant's estimates are checked bit-identical to the scalar
 * reference before anything is timed. Each number is the best of several
 * sweeps over all keys: 8K keys sit in L2 either way; at 1M keys the f16 K
 * rows (128 / 256 MB) and the index (22 / 30 MB) come from L3 or memory.
 * The exact baseline is this file's AVX-512 F16C + FMA loop (4 keys in
 * flight), single-threaded like the rest. Markdown on stdout.
 */
#include "runtime/backend.h"
#include "runtime/rabitq/rabitq.h"
#include "runtime/tkv-impl.h"

#include "bench.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

static float gauss(void)
{
    const double u1 = ((rnd() >> 11) + 1) * (1.0 / 9007199254740993.0), u2 = (rnd() >> 11) * (1.0 / 9007199254740992.0);
    return (float)(sqrt(-2 * log(u1)) * cos(6.283185307179586 * u2));
}

static volatile float sink;

/* The exact baseline: out[i] = q . k_i, K rows f16 [n, D], the best this build has. */
static void exact_dots(const uint16_t *k, uint32_t n, uint32_t D, const float *q, float *out)
{
#if defined(__AVX512F__)
    if (D % 16 == 0) { /* 4 keys in flight: independent FMA chains */
        uint32_t i = 0;
        for (; i + 4 <= n; i += 4) {
            const uint16_t *r = k + (size_t)i * D;
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (uint32_t d = 0; d < D; d += 16) {
                const __m512 qv = _mm512_loadu_ps(q + d);
                a0 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(r + d))), qv, a0);
                a1 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(r + D + d))), qv, a1);
                a2 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(r + 2 * D + d))), qv, a2);
                a3 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(r + 3 * D + d))), qv, a3);
            }
            out[i] = _mm512_reduce_add_ps(a0);
            out[i + 1] = _mm512_reduce_add_ps(a1);
            out[i + 2] = _mm512_reduce_add_ps(a2);
            out[i + 3] = _mm512_reduce_add_ps(a3);
        }
        for (; i < n; i++) {
            __m512 a0 = _mm512_setzero_ps();
            for (uint32_t d = 0; d < D; d += 16)
                a0 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(k + (size_t)i * D + d))),
                                     _mm512_loadu_ps(q + d), a0);
            out[i] = _mm512_reduce_add_ps(a0);
        }
        return;
    }
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
    if (D % 16 == 0) {
        for (uint32_t i = 0; i < n; i++) {
            const uint16_t *r = k + (size_t)i * D;
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
            for (uint32_t d = 0; d < D; d += 16) {
                a0 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(r + d))), _mm256_loadu_ps(q + d), a0);
                a1 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(r + d + 8))), _mm256_loadu_ps(q + d + 8),
                                     a1);
            }
            const __m256 s = _mm256_add_ps(a0, a1);
            __m128 x = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
            x = _mm_add_ps(x, _mm_movehl_ps(x, x));
            out[i] = _mm_cvtss_f32(_mm_add_ss(x, _mm_shuffle_ps(x, x, 1)));
        }
        return;
    }
#endif
    for (uint32_t i = 0; i < n; i++) {
        float s = 0;
        for (uint32_t d = 0; d < D; d++)
            s += q[d] * tkv_fp16_to_fp32(k[(size_t)i * D + d]);
        out[i] = s;
    }
}

enum { RUN_EST, RUN_EST_BOUND, RUN_EXACT, RUN_TOPP, RUN_TOPP_SAFE };

struct ctx {
    struct tkv_rabitq *ix;
    const uint16_t *keys;
    uint32_t n, D;
    const float *q;
    struct tkv_rabitq_query *qq;
    float *est, *bnd;
    void *work;
    size_t work_bytes;
    uint32_t *pos;
    enum tkv_rabitq_isa topp_isa; /* the top-p kernels timed */
};

/* Seconds for one pass over all keys, best of a few (about budget seconds in all). */
static double timed(struct ctx *c, int what, double budget)
{
    double best = 1e30;
    const double t_end = now() + budget;
    struct tkv_rabitq_topp_params tp = {.p = 0.9f, .scale = 1.0f / sqrtf((float)c->D), .extra_lse = -INFINITY};
    struct tkv_rabitq_topp_result res;
    for (int rep = 0; rep < 1000 && (rep < 3 || now() < t_end); rep++) {
        const double t0 = now();
        switch (what) {
        case RUN_EST:       tkv_rabitq_estimate(c->ix, c->qq, 0, c->n, c->est, NULL); break;
        case RUN_EST_BOUND: tkv_rabitq_estimate(c->ix, c->qq, 0, c->n, c->est, c->bnd); break;
        case RUN_EXACT:     exact_dots(c->keys, c->n, c->D, c->q, c->est); break;
        case RUN_TOPP:
        case RUN_TOPP_SAFE:
            tkv_rabitq_select_topp_isa(c->topp_isa, c->est, what == RUN_TOPP_SAFE ? c->bnd : NULL, c->n, &tp, c->work,
                                       c->work_bytes, c->pos, c->n, &res);
            break;
        }
        const double dt = now() - t0;
        sink = c->est[rep % c->n];
        if (dt < best)
            best = dt;
    }
    return best;
}

static int fail(const char *what)
{
    fprintf(stderr, "bench-rabitq: %s: %s\n", what, tkv_last_error());
    return 1;
}

/* One configuration of a select_bench row: how the KV head's G query heads
 * select (their union, or once from their mean: `rabitq:mean=1`), and
 * whether the boundary bin is cut exactly or kept whole and the kept keys
 * widened to groups of 16 (the policy's defaults where the backend selects,
 * docs/policies.md). */
struct select_cfg {
    const char *name;
    bool mean, coarse;
};

/* --gpu-select and --cpu-select: see the top of the file. Per size, per
 * configuration, plain and safe: the op as a caller that waits for the
 * bitmaps times it (best of REPS calls), the op as the engine queues it
 * (bitmaps left in backend memory, REPS calls back to back, one
 * synchronize: its cost in the stream), and for the exact configurations
 * the per-query-head path it replaces, whose union must be the op's. */
static int select_bench(bool cuda, uint32_t threads, uint32_t H, uint32_t G, uint32_t only_n, int only_cfg)
{
    enum { H_MAX = 32, D = 128, REPS = 10 };
    static const struct select_cfg cfgs[] = {
        {"union", false, false}, {"union, coarse, whole=16", false, true},
        {"mean", true, false},   {"mean, coarse, whole=16", true, true},
    };
    struct tkv_backend *be = NULL;
    if ((cuda && tkv_backend_cuda_devices() == 0) || tkv_backend_create(cuda ? "cuda" : "cpu", threads, &be) != TKV_OK ||
        !be->ops->rabitq_select) {
        printf("no %s backend with rabitq_select: nothing to time\n", cuda ? "CUDA" : "CPU");
        return 0;
    }
    printf("## One layer's RaBitQ selection on the %s (%u KV heads x %u query heads, D = %d, p = 0.9, sink 64, "
           "recent 64)\n\n", cuda ? "GPU" : "CPU backend", H, G, D);
    if (!cuda && threads)
        printf("rabitq_select on %u threads; the per-head path without it on one\n\n", threads);
    else if (!cuda)
        printf("rabitq_select on a thread per core; the per-head path without it on one\n\n");
    printf("waited: one call and its bitmaps' download, ms (best of %d); queued: the engine's way, bitmaps left "
           "in backend memory, %d calls back to back, us per call; per-head path: estimate, download, host "
           "top-p, union (exact configurations only)\n\n", REPS, REPS);
    printf("| keys | queries | mode | waited ms | queued us | per-head path ms | speedup | keys differing |\n");
    printf("|---:|---|---|---:|---:|---:|---:|---:|\n");
    const uint32_t sizes[] = {32768, 131072, 1048576};
    for (int si = 0; si < (only_n ? 1 : cuda ? 3 : 2); si++) {
        const uint32_t n = only_n ? only_n : sizes[si], words = (n + 31) / 32;
        uint16_t *k = malloc((size_t)n * D * sizeof *k);
        float *est = malloc((size_t)n * 4), *bound = malloc((size_t)n * 4);
        uint32_t *bm = malloc((size_t)H * words * 4), *pos = malloc((size_t)n * 4);
        uint8_t *mark = malloc(n);
        const size_t wb = tkv_rabitq_topp_work_bytes(n);
        void *work = malloc(wb);
        if (!k || !est || !bound || !bm || !pos || !mark || !work)
            return fail("select: out of memory");
        for (size_t i = 0; i < (size_t)n * D; i++)
            k[i] = tkv_fp32_to_fp16(gauss());
        struct tkv_rabitq *ix = NULL;
        struct tkv_rabitq_dev_index *dx = NULL;
        uint16_t *k_dev = NULL;
        float *est_dev = NULL, *bound_dev = NULL;
        uint32_t *bm_dev = NULL;
        if (tkv_rabitq_init(D, 11, &ix) || tkv_rabitq_set_centroids(ix, NULL, NULL) ||
            be->ops->alloc(be, (size_t)n * D * 2, (void **)&k_dev) || be->ops->upload(be, k_dev, k, (size_t)n * D * 2) ||
            tkv_rabitq_dev_create(be, ix, n, &dx) || tkv_rabitq_dev_append(dx, k_dev, D, n) ||
            be->ops->alloc(be, (size_t)n * 4, (void **)&est_dev) || be->ops->alloc(be, (size_t)n * 4, (void **)&bound_dev) ||
            be->ops->alloc(be, (size_t)H * words * 4, (void **)&bm_dev))
            return fail("select: index");
        /* per KV head its G query heads' queries and their mean's */
        static struct tkv_rabitq_query qq[H_MAX * TKV_RABITQ_SELECT_MAX_G], qm[H_MAX];
        static float q[TKV_RABITQ_SELECT_MAX_G][D], mq[D];
        for (uint32_t h = 0; h < H; h++) {
            for (uint32_t j = 0; j < G; j++) {
                for (int i = 0; i < D; i++)
                    q[j][i] = 2.0f * gauss();
                if (tkv_rabitq_query_prepare(ix, q[j], 0, &qq[h * G + j]))
                    return fail("select: query");
            }
            tkv_rabitq_query_mean(q[0], D, G, D, mq);
            if (tkv_rabitq_query_prepare(ix, mq, 0, &qm[h]))
                return fail("select: mean query");
        }
        const struct tkv_range forced[2] = {{0, 64}, {n - 64, n}};
        for (size_t ci = 0; ci < sizeof cfgs / sizeof cfgs[0]; ci++) {
            const struct select_cfg *cf = &cfgs[ci];
            if (only_cfg >= 0 && (size_t)only_cfg != ci)
                continue;
            const uint32_t g = cf->mean ? 1 : G;
            struct tkv_rabitq_select_head heads[H_MAX];
            for (uint32_t h = 0; h < H; h++) { /* (one index stands for every head's own: the same work) */
                memset(&heads[h], 0, sizeof heads[h]);
                heads[h].ix = tkv_rabitq_dev_arrays(dx), heads[h].q = cf->mean ? &qm[h] : &qq[h * G], heads[h].n = n;
                heads[h].row = (uint32_t)h, heads[h].n_forced = 2;
                heads[h].forced[0].begin = 0, heads[h].forced[0].end = 64;
                heads[h].forced[1].begin = n - 64, heads[h].forced[1].end = n;
            }
            for (int safe = 0; safe <= 1; safe++) {
                struct tkv_rabitq_select_args a = {.heads = heads, .n_heads = H, .G = g, .p = 0.9f,
                                                   .scale = 1.0f / sqrtf((float)D), .extra_lse = -INFINITY,
                                                   .safe = safe != 0, .coarse = cf->coarse,
                                                   .whole = cf->coarse ? 16 : 0, .bitmap = bm, .words = words};
                double t_dev = 1e30, t_old = 1e30, t_q = 1e30;
                for (int r = 0; r < REPS + 1; r++) {
                    const double t0 = now();
                    if (be->ops->rabitq_select(be, &a))
                        return fail("select: rabitq_select");
                    if (r)
                        t_dev = fmin(t_dev, now() - t0);
                }
                struct tkv_rabitq_select_args aq = a;
                aq.bitmap = NULL, aq.bitmap_dev = bm_dev, aq.n_rows = H;
                for (int r = 0; r < 3; r++) { /* the first round warms up */
                    const double t0 = now();
                    for (int x = 0; x < REPS; x++)
                        if (be->ops->rabitq_select(be, &aq))
                            return fail("select: rabitq_select (queued)");
                    if (be->ops->synchronize(be))
                        return fail("select: synchronize");
                    if (r)
                        t_q = fmin(t_q, (now() - t0) / REPS);
                }
                if (cf->coarse) {
                    printf("| %uK | %s | %s | %.3f | %.1f | - | - | - |\n", n / 1024, cf->name,
                           safe ? "safe" : "plain", t_dev * 1e3, t_q * 1e6);
                    continue;
                }
                const struct tkv_rabitq_topp_params tp = {.p = 0.9f, .scale = a.scale, .extra_lse = -INFINITY,
                                                          .forced = forced, .n_forced = 2};
                uint64_t differ = 0;
                for (int r = 0; r < 3; r++) {
                    const double t0 = now();
                    for (uint32_t h = 0; h < H; h++) {
                        memset(mark, 0, n);
                        for (uint32_t j = 0; j < g; j++) {
                            struct tkv_rabitq_topp_result res;
                            if (tkv_rabitq_dev_estimate(dx, &heads[h].q[j], 0, n, est_dev, safe ? bound_dev : NULL) ||
                                be->ops->download(be, est, est_dev, (size_t)n * 4) ||
                                (safe && be->ops->download(be, bound, bound_dev, (size_t)n * 4)) ||
                                tkv_rabitq_select_topp(est, safe ? bound : NULL, n, &tp, work, wb, pos, n, &res))
                                return fail("select: old path");
                            for (uint32_t x = 0; x < res.n_pos; x++)
                                mark[pos[x]] = 1;
                        }
                        if (r == 0)
                            for (uint32_t i = 0; i < n; i++)
                                differ += mark[i] != (bm[(size_t)h * words + i / 32] >> (i % 32) & 1);
                    }
                    t_old = fmin(t_old, now() - t0);
                }
                printf("| %uK | %s | %s | %.3f | %.1f | %.3f | %.1fx | %llu of %u |\n", n / 1024, cf->name,
                       safe ? "safe" : "plain", t_dev * 1e3, t_q * 1e6, t_old * 1e3, t_old / t_dev,
                       (unsigned long long)differ, H * n);
            }
        }
        tkv_rabitq_dev_free(dx);
        tkv_rabitq_free(ix);
        be->ops->release(be, k_dev), be->ops->release(be, est_dev), be->ops->release(be, bound_dev);
        be->ops->release(be, bm_dev);
        free(k), free(est), free(bound), free(bm), free(pos), free(mark), free(work);
    }
    be->ops->free(be);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc > 1 && !strcmp(argv[1], "--gpu-select")) {
        /* optional: HxG (KV heads x query heads, 8x4 by default) and a number of keys (all three sizes by default) */
        uint32_t H = 8, G = 4, n = 0;
        if (argc > 2 && (sscanf(argv[2], "%ux%u", &H, &G) != 2 || H < 1 || H > 32 || G < 1 ||
                         G > TKV_RABITQ_SELECT_MAX_G)) {
            fprintf(stderr, "bench-rabitq: --gpu-select %s: want HxG, 1 <= H <= 32, 1 <= G <= %d\n", argv[2],
                    TKV_RABITQ_SELECT_MAX_G);
            return 2;
        }
        if (argc > 3 && (sscanf(argv[3], "%u", &n) != 1 || n < 256 || n > (1u << 23))) {
            fprintf(stderr, "bench-rabitq: --gpu-select %s %s: want 256 .. 2^23 keys\n", argv[2], argv[3]);
            return 2;
        }
        int cfg = -1; /* optional: 1 .. 4, one configuration of the table's (for a profiler) */
        if (argc > 4 && (sscanf(argv[4], "%d", &cfg) != 1 || cfg < 1 || cfg > 4)) {
            fprintf(stderr, "bench-rabitq: --gpu-select ... %s: want a configuration 1 .. 4\n", argv[4]);
            return 2;
        }
        return select_bench(true, 0, H, G, n, cfg > 0 ? cfg - 1 : -1);
    }
    if (argc > 1 && !strcmp(argv[1], "--cpu-select"))
        return select_bench(false, argc > 2 ? (uint32_t)atoi(argv[2]) : 0, 8, 4, 0, -1);
    const int quick = argc > 1 && !strcmp(argv[1], "--quick");
    const uint32_t sizes[] = {8192, 131072, 1048576}, dims[] = {64, 128};
    const int n_sizes = quick ? 1 : 3;
    bool have[TKV_RABITQ_ISA_COUNT];
    for (int i = 0; i < TKV_RABITQ_ISA_COUNT; i++)
        have[i] = tkv_rabitq_isa_supported((enum tkv_rabitq_isa)i);
    const double budget = quick ? 0.02 : 0.4;

    printf("## RaBitQ estimate throughput (1 thread, Mkeys/s; est+bound also writes the error bound)\n\n");
    printf("| D | keys | scalar | AVX2 | AVX-512 | AVX-512 est+bound | exact f16.f32 dot | AVX-512 / exact | index B/key | f16 K B/key |\n");
    printf("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    double topp_ms[2][3][2][TKV_RABITQ_ISA_COUNT]; /* [D][size][safe][isa] */
    memset(topp_ms, 0, sizeof topp_ms);
    for (int di = 0; di < 2; di++) {
        const uint32_t D = dims[di], nmax = sizes[n_sizes - 1];
        uint16_t *keys = malloc((size_t)nmax * D * sizeof *keys);
        float *est = malloc((size_t)nmax * sizeof *est), *bnd = malloc((size_t)nmax * sizeof *bnd), *e2 = malloc(nmax * sizeof *e2);
        uint32_t *pos = malloc((size_t)nmax * sizeof *pos);
        const size_t wb = tkv_rabitq_topp_work_bytes(nmax);
        void *work = aligned_alloc(64, tkv_align_up(wb, 64));
        if (!keys || !est || !bnd || !e2 || !pos || !work)
            return fprintf(stderr, "bench-rabitq: out of memory\n"), 1;
        float off[128], ck[128], cq[128], q[128];
        for (uint32_t i = 0; i < D; i++) {
            off[i] = gauss();
            cq[i] = 0.5f * gauss();
        }
        for (size_t r = 0; r < nmax; r++)
            for (uint32_t i = 0; i < D; i++)
                keys[r * D + i] = tkv_fp32_to_fp16(off[i] + (i % 11 == 0 ? 4.0f : 1.0f) * gauss());
        struct tkv_rabitq_mean m;
        tkv_rabitq_mean_init(&m, D);
        tkv_rabitq_mean_add_f16(&m, keys, D, TKV_MIN(nmax, 4096u));
        tkv_rabitq_mean_get(&m, ck);
        for (uint32_t i = 0; i < D; i++)
            q[i] = cq[i] + 2 * gauss();
        struct tkv_rabitq *ix;
        if (tkv_rabitq_init(D, 42, &ix) || tkv_rabitq_set_centroids(ix, ck, cq) || tkv_rabitq_reserve(ix, nmax) ||
            tkv_rabitq_append_f16(ix, keys, D, nmax))
            return fail("index");
        struct tkv_rabitq_query qq;
        if (tkv_rabitq_query_prepare(ix, q, 0, &qq))
            return fail("query");
        /* every variant must agree with the scalar reference before timing */
        tkv_rabitq_set_isa(ix, TKV_RABITQ_ISA_SCALAR);
        const uint32_t nchk = TKV_MIN(nmax, 65536u);
        tkv_rabitq_estimate(ix, &qq, 0, nchk, e2, NULL);
        for (int isa = 1; isa < TKV_RABITQ_ISA_COUNT; isa++)
            if (have[isa]) {
                tkv_rabitq_set_isa(ix, (enum tkv_rabitq_isa)isa);
                tkv_rabitq_estimate(ix, &qq, 0, nchk, est, NULL);
                if (memcmp(est, e2, nchk * sizeof *est))
                    return fprintf(stderr, "bench-rabitq: %s estimates differ from scalar\n",
                                   tkv_rabitq_isa_name((enum tkv_rabitq_isa)isa)), 1;
            }
        for (int si = 0; si < n_sizes; si++) {
            struct ctx c = {ix, keys, sizes[si], D, q, &qq, est, bnd, work, wb, pos, TKV_RABITQ_ISA_SCALAR};
            double mk[TKV_RABITQ_ISA_COUNT] = {0}, mkb = 0;
            for (int isa = 0; isa < TKV_RABITQ_ISA_COUNT; isa++)
                if (have[isa]) {
                    tkv_rabitq_set_isa(ix, (enum tkv_rabitq_isa)isa);
                    mk[isa] = c.n / timed(&c, RUN_EST, budget) * 1e-6;
                    if (isa == TKV_RABITQ_ISA_AVX512)
                        mkb = c.n / timed(&c, RUN_EST_BOUND, budget) * 1e-6;
                }
            const double ex = c.n / timed(&c, RUN_EXACT, budget) * 1e-6;
            /* top-p on the real estimates and bounds of these keys */
            tkv_rabitq_estimate(ix, &qq, 0, c.n, est, bnd);
            for (int isa = 0; isa < TKV_RABITQ_ISA_COUNT; isa++)
                if (have[isa]) {
                    c.topp_isa = (enum tkv_rabitq_isa)isa;
                    topp_ms[di][si][0][isa] = timed(&c, RUN_TOPP, budget) * 1e3;
                    topp_ms[di][si][1][isa] = timed(&c, RUN_TOPP_SAFE, budget) * 1e3;
                }
            char col[TKV_RABITQ_ISA_COUNT][32], colb[32];
            for (int isa = 0; isa < TKV_RABITQ_ISA_COUNT; isa++)
                snprintf(col[isa], sizeof col[isa], have[isa] ? "%.1f" : "n/a", mk[isa]);
            snprintf(colb, sizeof colb, have[TKV_RABITQ_ISA_AVX512] ? "%.1f" : "n/a", mkb);
            const double best = have[TKV_RABITQ_ISA_AVX512] ? mk[2] : have[1] ? mk[1] : mk[0];
            printf("| %u | %uK | %s | %s | %s | %s | %.1f | %.1fx | %u | %u |\n", D, c.n / 1024, col[0], col[1], col[2], colb,
                   ex, best / ex, D / 8 + 14, 2 * D);
            fflush(stdout);
        }
        tkv_rabitq_free(ix);
        free(keys);
        free(est);
        free(bnd);
        free(e2);
        free(pos);
        free(work);
    }

    printf("\n## Encoding (append_f16: centre, rotate, sign bits, scalars), 1 thread, Mkeys/s\n\n");
    printf("| D | scalar | AVX2 | AVX-512 |\n|---:|---:|---:|---:|\n");
    for (int di = 0; di < 2; di++) {
        const uint32_t D = dims[di], n = quick ? 4096 : 65536;
        uint16_t *keys = malloc((size_t)n * D * sizeof *keys);
        for (size_t r = 0; r < (size_t)n * D; r++)
            keys[r] = tkv_fp32_to_fp16(gauss());
        char col[TKV_RABITQ_ISA_COUNT][32];
        for (int isa = 0; isa < TKV_RABITQ_ISA_COUNT; isa++) {
            snprintf(col[isa], sizeof col[isa], "n/a");
            if (!have[isa])
                continue;
            struct tkv_rabitq *ix;
            if (tkv_rabitq_init(D, 7, &ix) || tkv_rabitq_set_isa(ix, (enum tkv_rabitq_isa)isa) ||
                tkv_rabitq_set_centroids(ix, NULL, NULL) || tkv_rabitq_reserve(ix, n))
                return fail("encode index");
            double best = 1e30;
            for (int rep = 0; rep < 3; rep++) {
                tkv_rabitq_reset(ix);
                const double t0 = now();
                if (tkv_rabitq_append_f16(ix, keys, D, n))
                    return fail("append");
                best = fmin(best, now() - t0);
            }
            snprintf(col[isa], sizeof col[isa], "%.2f", n / best * 1e-6);
            tkv_rabitq_free(ix);
        }
        printf("| %u | %s | %s | %s |\n", D, col[0], col[1], col[2]);
        free(keys);
    }

    printf("\n## Top-p selection (select_topp, p = 0.9, on the estimates above), 1 thread, ms per call by kernels\n\n");
    printf("| D | keys | plain scalar | plain AVX2 | plain AVX-512 | safe scalar | safe AVX2 | safe AVX-512 | "
           "best / scalar plain | best / scalar safe |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    const int best = have[TKV_RABITQ_ISA_AVX512] ? TKV_RABITQ_ISA_AVX512
                   : have[TKV_RABITQ_ISA_AVX2]   ? TKV_RABITQ_ISA_AVX2
                                                 : TKV_RABITQ_ISA_SCALAR;
    for (int di = 0; di < 2; di++)
        for (int si = 0; si < n_sizes; si++) {
            char col[2][TKV_RABITQ_ISA_COUNT][32];
            for (int safe = 0; safe < 2; safe++)
                for (int isa = 0; isa < TKV_RABITQ_ISA_COUNT; isa++)
                    snprintf(col[safe][isa], sizeof col[safe][isa], have[isa] ? "%.3f" : "n/a",
                             topp_ms[di][si][safe][isa]);
            const double(*t)[TKV_RABITQ_ISA_COUNT] = topp_ms[di][si];
            printf("| %u | %uK | %s | %s | %s | %s | %s | %s | %.2fx | %.2fx |\n", dims[di], sizes[si] / 1024,
                   col[0][0], col[0][1], col[0][2], col[1][0], col[1][1], col[1][2], t[0][0] / t[0][best],
                   t[1][0] / t[1][best]);
        }
    return 0;
}
