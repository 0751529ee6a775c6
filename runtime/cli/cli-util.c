/* cli-util.c -- see cli-util.h. */
#include "cli-util.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* strtoull accepts leading spaces and signs; the CLI does not */
static bool plain_digits(const char *s) { return s[0] >= '0' && s[0] <= '9'; }

bool cli_parse_u64(const char *s, uint64_t *out)
{
    char *end;
    errno = 0;
    if (!plain_digits(s))
        return false;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || *end)
        return false;
    *out = v;
    return true;
}

bool cli_parse_u32(const char *s, uint32_t *out)
{
    uint64_t v;
    if (!cli_parse_u64(s, &v) || v > UINT32_MAX)
        return false;
    *out = (uint32_t)v;
    return true;
}

bool cli_parse_float(const char *s, float *out)
{
    char *end;
    errno = 0;
    float v = strtof(s, &end);
    if (errno || end == s || *end)
        return false;
    *out = v;
    return true;
}

bool cli_parse_size(const char *s, uint64_t *out)
{
    char *end;
    errno = 0;
    if (!plain_digits(s))
        return false;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno)
        return false;
    uint64_t mul = 1;
    switch (*end) {
    case 0: break;
    case 'k': case 'K': mul = 1ull << 10; end++; break;
    case 'm': case 'M': mul = 1ull << 20; end++; break;
    case 'g': case 'G': mul = 1ull << 30; end++; break;
    case 't': case 'T': mul = 1ull << 40; end++; break;
    default: return false;
    }
    if ((*end == 'B' || *end == 'b') && mul > 1)
        end++;
    if (*end || (v && mul > UINT64_MAX / v))
        return false;
    *out = v * mul;
    return true;
}

bool cli_is_opt(const char *arg, const char *short_name, const char *long_name)
{
    return !strcmp(arg, short_name) || (long_name && !strcmp(arg, long_name));
}

double cli_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

tkv_token *cli_tokenize(const tkv_model *m, const char *text, unsigned flags, size_t *n)
{
    size_t need = 0;
    tkv_status st = tkv_tokenize(m, text, -1, flags, NULL, 0, &need);
    if (st != TKV_OK && st != TKV_ERR_TOO_SMALL)
        return NULL;
    tkv_token *toks = malloc((need ? need : 1) * sizeof *toks);
    if (!toks || tkv_tokenize(m, text, -1, flags, toks, need, n) != TKV_OK) {
        free(toks);
        return NULL;
    }
    return toks;
}

char *cli_detokenize(const tkv_model *m, const tkv_token *toks, size_t n)
{
    size_t len = 0;
    tkv_status st = tkv_detokenize(m, toks, n, 0, NULL, 0, &len);
    if (st != TKV_OK && st != TKV_ERR_TOO_SMALL)
        return NULL;
    char *buf = malloc(len + 1);
    if (!buf || tkv_detokenize(m, toks, n, 0, buf, len + 1, &len) != TKV_OK) {
        free(buf);
        return NULL;
    }
    buf[len] = 0;
    return buf;
}
