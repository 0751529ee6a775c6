/*
 * cli-util.h -- helpers the `tierkv` commands share: strict number parsing,
 * option matching, a monotonic clock, whole-text (de)tokenization.
 */
#ifndef TKV_CLI_UTIL_H
#define TKV_CLI_UTIL_H

#include "tierkv.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Returns a failing tkv_status from the enclosing function. */
#define CLI_TRY(expr)                      \
    do {                                   \
        tkv_status cli_try_s_ = (expr);    \
        if (cli_try_s_ != TKV_OK)          \
            return cli_try_s_;             \
    } while (0)

/* Decimal integers with nothing before or after (no sign, no spaces). */
bool cli_parse_u32(const char *s, uint32_t *out);
bool cli_parse_u64(const char *s, uint64_t *out);
bool cli_parse_float(const char *s, float *out);
/* "512M", "8G", "64K", "1T" (optionally with a B) or a plain byte count. */
bool cli_parse_size(const char *s, uint64_t *out);

/* arg equals short_name or (if given) long_name. */
bool cli_is_opt(const char *arg, const char *short_name, const char *long_name);

/* Seconds on a monotonic clock. */
double cli_now(void);

/* NUL-terminated text -> malloc'd ids (*n of them); NULL on failure
 * (tkv_last_error() explains a tokenizer error; else out of memory). */
tkv_token *cli_tokenize(const tkv_model *m, const char *text, unsigned flags, size_t *n);
/* ids -> malloc'd NUL-terminated text; NULL on failure. */
char *cli_detokenize(const tkv_model *m, const tkv_token *toks, size_t n);

#endif
