/*
 * rabitq-key-sums.h -- random f16 key rows for the key centroid's exact
 * sums (tkv_rabitq_mean's f16 path, the backends' rabitq_key_sums), and
 * their reference: per element the values converted by tkv_fp16_to_fp32
 * and summed in long double (a 64-bit significand holds every sum of up to
 * 2^23 finite f16 exactly), the others counted. Header-only; include it
 * after test.h in one test file.
 */
#ifndef TKV_TEST_RABITQ_KEY_SUMS_H
#define TKV_TEST_RABITQ_KEY_SUMS_H

#include "runtime/backend.h"
#include "runtime/tkv-impl.h"

#include <math.h>

/* n rows of `stride` f16 (the first dim used): random bits of every class
 * (normal of any exponent, subnormal, +-0, +-65504), and with `specials`
 * some infinities and NaNs in elements 1 and 2 (element 0 stays finite) */
static void ks_rows(uint64_t *rng, uint16_t *rows, uint32_t n, size_t stride, uint32_t dim, bool specials)
{
    static const uint16_t edge[] = {0x0000, 0x8000, 0x0001, 0x8001, 0x03ff, 0x7bff, 0xfbff, 0x0400};
    for (uint32_t r = 0; r < n; r++)
        for (size_t d = 0; d < stride; d++) {
            const uint64_t x = test_rand_u64(rng);
            uint16_t h = (uint16_t)(x >> 20);
            if ((x & 7) == 0)
                h = edge[(x >> 3) % (sizeof edge / sizeof edge[0])];
            if (!specials || d == 0 || d > 2)
                h = (h & 0x7c00) == 0x7c00 ? (uint16_t)(h & 0x83ff) : h; /* finite */
            else if ((x & 0xf0) == 0)
                h = d == 1 ? (uint16_t)((x & 0x100) ? 0x7c00 : 0xfc00) : 0x7e01; /* +-inf, NaN */
            rows[r * stride + d] = d < dim ? h : 0x7e00; /* past dim: NaN, never summed */
        }
}

/* sum[d] (long double) and bad[d] over n rows */
static void ks_reference(const uint16_t *rows, uint32_t n, size_t stride, uint32_t dim, long double *sum,
                         uint32_t *bad)
{
    for (uint32_t r = 0; r < n; r++)
        for (uint32_t d = 0; d < dim; d++) {
            const float v = tkv_fp16_to_fp32(rows[r * stride + d]);
            if (isfinite(v))
                sum[d] += v;
            else
                bad[d]++;
        }
}

#endif /* TKV_TEST_RABITQ_KEY_SUMS_H */
