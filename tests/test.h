/*
 * test.h -- the tiny harness every tests/test-*.c uses.
 *
 *   CHECK(cond, fmt, ...)  records a failure with file:line and continues
 *   REQUIRE(cond, ...)     same, then returns from main with failure
 *   REQUIRE_VOID(cond)     same, returning from a void function
 *   SKIP(fmt, ...)         prints why and exits 77 (ctest: skipped)
 *   return test_done();    prints the summary, 0 on success, 1 on failure
 */
#ifndef TKV_TEST_H
#define TKV_TEST_H

#include <stdint.h>
#include <stdio.h>
#include <time.h>
#include <stdlib.h>
#include <math.h>

static int test_failures_, test_checks_;

#define CHECK(cond, ...)                                                             \
    do {                                                                             \
        test_checks_++;                                                              \
        if (!(cond)) {                                                               \
            test_failures_++;                                                        \
            fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                            \
            fputc('\n', stderr);                                                     \
        }                                                                            \
    } while (0)

#define REQUIRE(cond, ...)                 \
    do {                                   \
        int req_ok_ = (cond) ? 1 : 0;      \
        CHECK(req_ok_, __VA_ARGS__);       \
        if (!req_ok_)                      \
            return test_done();            \
    } while (0)

/* REQUIRE for functions returning void. */
#define REQUIRE_VOID(cond)                 \
    do {                                   \
        int req_ok_ = (cond) ? 1 : 0;      \
        CHECK(req_ok_, "%s", #cond);       \
        if (!req_ok_)                      \
            return;                        \
    } while (0)

#define SKIP(...)                          \
    do {                                   \
        fprintf(stderr, "SKIP: ");         \
        fprintf(stderr, __VA_ARGS__);      \
        fputc('\n', stderr);               \
        exit(77);                          \
    } while (0)

static inline int test_done(void)
{
    fprintf(stderr, "%d checks, %d failures\n", test_checks_, test_failures_);
    return test_failures_ ? 1 : 0;
}

/* Path of the real model, or SKIP when it was not fetched. */
static inline const char *test_model_path(void)
{
    const char *p = getenv("TKV_MODEL");
    FILE *f = p ? fopen(p, "rb") : NULL;
    if (!f)
        SKIP("model not found (run scripts/get-model.sh; TKV_MODEL=%s)", p ? p : "unset");
    fclose(f);
    return p;
}

/* Path of a file in tests/data. */
static inline const char *test_data_path(const char *name)
{
    static char buf[4096];
    const char *d = getenv("TKV_TEST_DATA");
    snprintf(buf, sizeof buf, "%s/%s", d ? d : "tests/data", name);
    return buf;
}

/* A fresh seed per run (TKV_SEED=N replays one), printed so a failure can be
 * reproduced. */
static inline uint64_t test_seed(void)
{
    const char *e = getenv("TKV_SEED");
    uint64_t s = e ? strtoull(e, NULL, 0) : (uint64_t)time(NULL) ^ ((uint64_t)clock() << 32);
    if (s == 0)
        s = 1;
    fprintf(stderr, "seed %llu (TKV_SEED to replay)\n", (unsigned long long)s);
    return s;
}

/* xorshift64*: deterministic per seed, seed printed by tests for replay. */
static inline uint64_t test_rand_u64(uint64_t *s)
{
    *s ^= *s >> 12; *s ^= *s << 25; *s ^= *s >> 27;
    return *s * 0x2545F4914F6CDD1DULL;
}
static inline float test_rand_f32(uint64_t *s, float lo, float hi)
{
    return lo + (hi - lo) * (float)((test_rand_u64(s) >> 40) * (1.0 / 16777216.0));
}

#endif
