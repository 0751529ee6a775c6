/*
 * threadpool.h -- a fixed pool of worker threads for data-parallel kernels.
 *
 * tkv_pool_run(pool, fn, ctx) calls fn(ctx, ith, nth) once for every
 * share ith in [0, nth), nth the pool's size, and returns when all have
 * finished. The shares are claimed in turn by whichever threads are
 * running, the caller included: a share is not tied to a thread (per-share
 * scratch indexed by ith is still used by one thread at a time), and a
 * worker that is not running when a job starts (more threads than free
 * cores) costs nothing. Workers spin briefly between jobs (decode issues
 * hundreds of small jobs per token) and then sleep, so an idle pool costs
 * no CPU.
 * One job at a time: tkv_pool_run is not reentrant and not thread-safe.
 */
#ifndef TKV_THREADPOOL_H
#define TKV_THREADPOOL_H

#include "../runtime/tkv-impl.h"

struct tkv_pool;
typedef void (*tkv_pool_fn)(void *ctx, uint32_t ith, uint32_t nth);

tkv_status tkv_pool_init(uint32_t n_threads, struct tkv_pool **out);
void       tkv_pool_free(struct tkv_pool *pool);
uint32_t   tkv_pool_size(const struct tkv_pool *pool);
void       tkv_pool_run(struct tkv_pool *pool, tkv_pool_fn fn, void *ctx);

/* [begin, end) of item range [0, n) assigned to thread ith of nth. */
static inline void tkv_split(uint64_t n, uint32_t ith, uint32_t nth, uint64_t *begin, uint64_t *end)
{
    uint64_t per = n / nth, rem = n % nth;
    *begin = ith * per + (ith < rem ? ith : rem);
    *end = *begin + per + (ith < rem ? 1 : 0);
}

#endif
