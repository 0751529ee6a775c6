/*
 * bench.h -- what the benchmark programs share: a monotonic clock and a
 * small deterministic generator for synthetic inputs (header-only).
 */
#ifndef TKV_BENCH_H
#define TKV_BENCH_H

#include <stdint.h>
#include <time.h>

/* Seconds on a monotonic clock. */
static inline double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* xorshift64*: the same inputs on every run. */
static uint64_t bench_rng_state = 0x9E3779B97F4A7C15ull;
static inline uint64_t rnd(void)
{
    bench_rng_state ^= bench_rng_state >> 12;
    bench_rng_state ^= bench_rng_state << 25;
    bench_rng_state ^= bench_rng_state >> 27;
    return bench_rng_state * 0x2545F4914F6CDD1Dull;
}

#endif
