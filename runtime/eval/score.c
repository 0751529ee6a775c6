/*
 * score.c -- RULER's scoring (scripts/eval/evaluate.py, scripts/eval/synthetic/
 * constants.py) and the pass-key metric (Landmark attention / LongLoRA).
 *
 * Deviation, documented in docs/eval.md: Python's str.lower() and \d are
 * Unicode-aware; here lower-casing is ASCII and digits are [0-9]. The
 * references are ASCII, so only exotic predictions (e.g. KELVIN SIGN for
 * 'k') could score differently.
 */
#include "eval.h"

#include <stdlib.h>
#include <string.h>

/* Length in bytes of the Python str.isspace() character starting at p
 * (end - p bytes available), or 0. ASCII: \t \n \v \f \r, space and
 * \x1c-\x1f; beyond ASCII: U+0085, U+00A0, U+1680, U+2000-U+200A, U+2028,
 * U+2029, U+202F, U+205F, U+3000 (UTF-8). */
static size_t space_at(const unsigned char *p, const unsigned char *end)
{
    const size_t n = (size_t)(end - p);
    if (n == 0)
        return 0;
    if ((p[0] >= 0x09 && p[0] <= 0x0d) || p[0] == ' ' || (p[0] >= 0x1c && p[0] <= 0x1f))
        return 1;
    if (n >= 2 && p[0] == 0xc2 && (p[1] == 0x85 || p[1] == 0xa0))
        return 2;
    if (n >= 3 && p[0] == 0xe1 && p[1] == 0x9a && p[2] == 0x80)
        return 3;
    if (n >= 3 && p[0] == 0xe2 && p[1] == 0x80 &&
        ((p[2] >= 0x80 && p[2] <= 0x8a) || p[2] == 0xa8 || p[2] == 0xa9 || p[2] == 0xaf))
        return 3;
    if (n >= 3 && p[0] == 0xe2 && p[1] == 0x81 && p[2] == 0x9f)
        return 3;
    if (n >= 3 && p[0] == 0xe3 && p[1] == 0x80 && p[2] == 0x80)
        return 3;
    return 0;
}

/* Length of the whitespace character ending at end (begin..end), or 0. */
static size_t space_before(const unsigned char *begin, const unsigned char *end)
{
    for (size_t k = 1; k <= 3 && (size_t)(end - begin) >= k; k++)
        if (space_at(end - k, end) == k)
            return k;
    return 0;
}

/* Python's str.strip(): the [*b, *e) range without surrounding whitespace. */
static void strip(const unsigned char **b, const unsigned char **e)
{
    size_t k;
    while (*b < *e && (k = space_at(*b, *e)) > 0)
        *b += k;
    while (*e > *b && (k = space_before(*b, *e)) > 0)
        *e -= k;
}

size_t tkv_eval_postprocess(const char *in, size_t len, char *out)
{
    const unsigned char *b = (const unsigned char *)in, *e = b + len;
    strip(&b, &e);
    size_t n = (size_t)(e - b);
    memmove(out, b, n);
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)out[i] < 0x20)
            out[i] = '\n';
    b = (const unsigned char *)out;
    e = b + n;
    strip(&b, &e);
    n = (size_t)(e - b);
    memmove(out, b, n);
    out[n] = 0;
    return n;
}

static unsigned char lower(unsigned char c) { return c >= 'A' && c <= 'Z' ? (unsigned char)(c + 32) : c; }

/* ASCII case-insensitive strstr: 1 if needle occurs in hay. */
static int contains_nocase(const char *hay, const char *needle)
{
    const size_t n = strlen(needle), h = strlen(hay);
    if (n == 0)
        return 1;
    for (size_t i = 0; i + n <= h; i++) {
        size_t j = 0;
        while (j < n && lower((unsigned char)hay[i + j]) == lower((unsigned char)needle[j]))
            j++;
        if (j == n)
            return 1;
    }
    return 0;
}

double tkv_eval_string_match_all(const char *pred, const char *const *refs, uint32_t n_refs)
{
    if (n_refs == 0)
        return 0.0;
    uint32_t hits = 0;
    for (uint32_t i = 0; i < n_refs; i++)
        hits += (uint32_t)contains_nocase(pred, refs[i]);
    return (double)hits / (double)n_refs;
}

/* Digits of s without leading zeros ("0" for all zeros): [*b, *e). */
static void trim_zeros(const char **b, const char *e)
{
    while (*b + 1 < e && **b == '0')
        (*b)++;
}

double tkv_eval_passkey_match(const char *pred, const char *key)
{
    const char *p = pred;
    while (*p && !(*p >= '0' && *p <= '9'))
        p++;
    if (!*p)
        return 0.0;
    const char *pe = p;
    while (*pe >= '0' && *pe <= '9')
        pe++;
    const char *k = key, *ke = key + strlen(key);
    for (const char *c = k; c < ke; c++)
        if (!(*c >= '0' && *c <= '9'))
            return 0.0;
    if (k == ke)
        return 0.0;
    trim_zeros(&p, pe);
    trim_zeros(&k, ke);
    return (pe - p == ke - k && memcmp(p, k, (size_t)(pe - p)) == 0) ? 1.0 : 0.0;
}

double tkv_eval_score(const struct tkv_eval_sample *s, const char *pred)
{
    const size_t len = strlen(pred);
    char *buf = malloc(len + 1);
    if (!buf)
        return 0.0;
    tkv_eval_postprocess(pred, len, buf);
    double score;
    if (s->task == TKV_EVAL_PASSKEY) {
        score = s->n_refs ? tkv_eval_passkey_match(buf, s->refs[0]) : 0.0;
    } else {
        const char *refs[TKV_EVAL_MAX_REFS];
        for (uint32_t i = 0; i < s->n_refs && i < TKV_EVAL_MAX_REFS; i++)
            refs[i] = s->refs[i];
        score = tkv_eval_string_match_all(buf, refs, s->n_refs < TKV_EVAL_MAX_REFS ? s->n_refs : TKV_EVAL_MAX_REFS);
    }
    free(buf);
    return score;
}
