/*
 * bench.h -- what the benchmark programs share: a monotonic clock, a small
 * deterministic generator for synthetic inputs, the build's commit for
 * their reports, a backend's op profile and a number read from a stats
 * JSON (header-only).
 */
#ifndef TKV_BENCH_H
#define TKV_BENCH_H

#include "runtime/backend.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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

/* splitmix64's finalizer: x mixed into a uniform 64-bit value, so draw i
 * of a stream keyed k is bench_mix64(k + i) (no state to keep). */
static inline uint64_t bench_mix64(uint64_t x)
{
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* `git describe --always --dirty` of the source tree, "unknown" outside a
 * checkout (bench targets define TKV_SOURCE_DIR). */
static inline void build_commit(char *out, size_t cap)
{
    snprintf(out, cap, "unknown");
    FILE *p = popen("git -C '" TKV_SOURCE_DIR "' describe --always --dirty 2>/dev/null", "r");
    if (!p)
        return;
    if (fgets(out, (int)cap, p))
        out[strcspn(out, "\n")] = 0;
    pclose(p);
}

/* The op profile of a backend that keeps one (TKV_CUDA_PROFILE=1 when it
 * was created; runtime/backend.h): printed to stderr for the `steps` timed
 * steps since the last reset, then reset. Nothing without a profile. */
static inline void bench_profile_print(struct tkv_backend *be, const char *label, uint32_t steps)
{
    if (!be->ops->profile_read)
        return;
    struct tkv_op_profile prof;
    if (be->ops->profile_read(be, &prof) == TKV_OK)
        tkv_op_profile_print(label, &prof, steps);
    be->ops->profile_reset(be);
}

/* The number after the first "key": in a JSON text (e.g. a session's
 * tkv_session_stats_json), 0 if absent. */
static inline double bench_json_number(const char *json, const char *key)
{
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\":", key);
    const char *p = strstr(json, pat);
    return p ? strtod(p + strlen(pat), NULL) : 0;
}

#endif
