/*
 * tkv-impl.h -- private helpers shared by every module: error reporting,
 * logging, checked arithmetic, half-precision conversion.
 *
 * Error contract: a function that fails calls tkv_err(), which records the
 * message for tkv_last_error() and returns the status, so failures read
 *     return tkv_err(TKV_ERR_FORMAT, "gguf: tensor '%s': offset %llu past end", ...);
 * Messages start with the module ("gguf:", "tokenizer:", ...) and name the
 * field, tensor or file involved.
 */
#ifndef TKV_IMPL_H
#define TKV_IMPL_H

#include "tierkv.h"

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__)
#define TKV_PRINTF(a, b) __attribute__((format(printf, a, b)))
#define TKV_UNUSED       __attribute__((unused))
#else
#define TKV_PRINTF(a, b)
#define TKV_UNUSED
#endif

/* Records a formatted message for tkv_last_error() and returns status. */
tkv_status tkv_err(tkv_status status, const char *fmt, ...) TKV_PRINTF(2, 3);

/* Prefixes the current error message with "ctx: " (keeps the status). */
tkv_status tkv_err_wrap(tkv_status status, const char *fmt, ...) TKV_PRINTF(2, 3);

void tkv_log(enum tkv_log_level level, const char *fmt, ...) TKV_PRINTF(2, 3);
#define TKV_LOG_E(...) tkv_log(TKV_LOG_ERROR, __VA_ARGS__)
#define TKV_LOG_W(...) tkv_log(TKV_LOG_WARN, __VA_ARGS__)
#define TKV_LOG_I(...) tkv_log(TKV_LOG_INFO, __VA_ARGS__)
#define TKV_LOG_D(...) tkv_log(TKV_LOG_DEBUG, __VA_ARGS__)

/* Propagates a failure: TKV_TRY(f(x)); */
#define TKV_TRY(expr)                      \
    do {                                   \
        tkv_status tkv_try_s_ = (expr);    \
        if (tkv_try_s_ != TKV_OK)          \
            return tkv_try_s_;             \
    } while (0)

#define TKV_MIN(a, b) ((a) < (b) ? (a) : (b))
#define TKV_MAX(a, b) ((a) > (b) ? (a) : (b))

/* Overflow-checked size arithmetic: return false on overflow. */
static inline bool tkv_mul_ok(uint64_t a, uint64_t b, uint64_t *out) { return !__builtin_mul_overflow(a, b, out); }
static inline bool tkv_add_ok(uint64_t a, uint64_t b, uint64_t *out) { return !__builtin_add_overflow(a, b, out); }

static inline uint64_t tkv_align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

/* Seconds on a monotonic clock (for statistics). */
double tkv_now_seconds(void);

/* IEEE half <-> float, exact for all finite values, NaN and Inf (scalar
 * reference; the CPU kernels use F16C where the build allows). */
static inline float tkv_fp16_to_fp32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) /* Inf, or NaN made quiet as F16C does */
        bits = sign | 0x7f800000u | (man << 13) | (man ? 0x400000u : 0);
    else if (exp != 0)
        bits = sign | ((exp + 112) << 23) | (man << 13);
    else if (man == 0)
        bits = sign;
    else { /* subnormal: normalise */
        int e = -1;
        do { man <<= 1; e++; } while (!(man & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Round to nearest even, like F16C's _cvtps_ph(x, 0). */
static inline uint16_t tkv_fp32_to_fp16(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000, ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) /* Inf or NaN */
        return (uint16_t)(sign | 0x7c00 | (ax > 0x7f800000u ? 0x200 | ((ax >> 13) & 0x3ff) : 0));
    if (ax >= 0x477ff000u) /* rounds to >= 65520: overflow to Inf */
        return (uint16_t)(sign | 0x7c00);
    if (ax < 0x38800000u) { /* result is subnormal or zero */
        if (ax < 0x33000000u)
            return (uint16_t)sign;
        uint32_t e = ax >> 23, m = (ax & 0x7fffff) | 0x800000, shift = 126 - e;
        uint32_t r = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (r & 1)))
            r++;
        return (uint16_t)(sign | r);
    }
    uint32_t r = ax - 0x38000000u; /* rebias exponent 127 -> 15 */
    uint32_t h = r >> 13, rem = r & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (h & 1)))
        h++;
    return (uint16_t)(sign | h);
}

static inline float tkv_bf16_to_fp32(uint16_t b)
{
    uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

#endif /* TKV_IMPL_H */
