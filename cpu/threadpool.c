/* threadpool.c -- see threadpool.h. */
#include "threadpool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#if defined(__x86_64__)
#include <immintrin.h>
#define tkv_cpu_relax() _mm_pause()
#else
#define tkv_cpu_relax() ((void)0)
#endif

/* Spin iterations before a worker sleeps (~50-100 us on current x86). */
#define TKV_POOL_SPINS 20000

struct tkv_pool {
    uint32_t n;                       /* threads, including the caller; shares per job */
    pthread_t *threads;               /* [n - 1] the workers            */
    tkv_pool_fn fn;
    void *ctx;
    atomic_uint_fast64_t generation;  /* bumped once per job            */
    atomic_uint next;                 /* the job's shares claimed       */
    atomic_uint done;                 /* the job's shares finished      */
    atomic_bool stop;
    atomic_uint sleepers;
    pthread_mutex_t mu;
    pthread_cond_t wake;
};

/* Runs shares of the current job until every one is claimed. A claim that
 * reads the counter tkv_pool_run reset is a share of that job, whose fn
 * and ctx were written before the reset (release / acquire); one that comes
 * late, after the job's last share was claimed, claims nothing -- or, if
 * the next job has reset the counter meanwhile, a share of that one. */
static void run_shares(struct tkv_pool *p)
{
    for (;;) {
        const uint32_t k = atomic_fetch_add_explicit(&p->next, 1, memory_order_acq_rel);
        if (k >= p->n)
            return;
        p->fn(p->ctx, k, p->n);
        atomic_fetch_add_explicit(&p->done, 1, memory_order_release);
    }
}

static void *tkv_pool_main(void *arg)
{
    struct tkv_pool *p = arg;
    uint64_t seen = 0;
    for (;;) {
        uint64_t gen;
        int spins = 0;
        while ((gen = atomic_load_explicit(&p->generation, memory_order_acquire)) == seen &&
               !atomic_load_explicit(&p->stop, memory_order_acquire)) {
            if (++spins < TKV_POOL_SPINS) {
                if (spins % 1024 == 0)
                    sched_yield();
                else
                    tkv_cpu_relax();
                continue;
            }
            pthread_mutex_lock(&p->mu);
            atomic_fetch_add(&p->sleepers, 1);
            while (atomic_load(&p->generation) == seen && !atomic_load(&p->stop))
                pthread_cond_wait(&p->wake, &p->mu);
            atomic_fetch_sub(&p->sleepers, 1);
            pthread_mutex_unlock(&p->mu);
            spins = 0;
        }
        if (atomic_load_explicit(&p->stop, memory_order_acquire))
            return NULL;
        seen = gen;
        run_shares(p);
    }
}

tkv_status tkv_pool_init(uint32_t n_threads, struct tkv_pool **out)
{
    *out = NULL;
    if (n_threads == 0 || n_threads > 1024)
        return tkv_err(TKV_ERR_INVALID_ARG, "threadpool: %u threads is out of range (1..1024)", n_threads);
    struct tkv_pool *p = calloc(1, sizeof *p);
    if (!p)
        return tkv_err(TKV_ERR_NOMEM, "threadpool: out of memory");
    p->n = n_threads;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->wake, NULL);
    if (n_threads > 1) {
        p->threads = calloc(n_threads - 1, sizeof *p->threads);
        if (!p->threads) {
            tkv_pool_free(p);
            return tkv_err(TKV_ERR_NOMEM, "threadpool: out of memory");
        }
    }
    for (uint32_t i = 1; i < n_threads; i++) {
        if (pthread_create(&p->threads[i - 1], NULL, tkv_pool_main, p) != 0) {
            p->n = i; /* only the threads started so far get joined */
            tkv_pool_free(p);
            return tkv_err(TKV_ERR_NOMEM, "threadpool: cannot start thread %u of %u", i, n_threads);
        }
    }
    *out = p;
    return TKV_OK;
}

void tkv_pool_free(struct tkv_pool *p)
{
    if (!p)
        return;
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->stop, true);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    for (uint32_t i = 1; i < p->n; i++)
        pthread_join(p->threads[i - 1], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->wake);
    free(p->threads);
    free(p);
}

uint32_t tkv_pool_size(const struct tkv_pool *p) { return p->n; }

void tkv_pool_run(struct tkv_pool *p, tkv_pool_fn fn, void *ctx)
{
    if (p->n == 1) {
        fn(ctx, 0, 1);
        return;
    }
    p->fn = fn;
    p->ctx = ctx;
    atomic_store_explicit(&p->done, 0, memory_order_relaxed);
    atomic_store_explicit(&p->next, 0, memory_order_release); /* (the previous job's shares all done) */
    atomic_fetch_add(&p->generation, 1); /* seq_cst: pairs with the sleepers check */
    if (atomic_load(&p->sleepers) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->wake);
        pthread_mutex_unlock(&p->mu);
    }
    /* the caller takes shares too, so a worker not running (cores
     * oversubscribed: other processes, parallel tests) leaves its share to
     * us instead of costing a time slice; we wait only for shares begun */
    run_shares(p);
    for (int spins = 0; atomic_load_explicit(&p->done, memory_order_acquire) != p->n; spins++) {
        if (spins < TKV_POOL_SPINS)
            tkv_cpu_relax();
        else
            sched_yield();
    }
}
