/* status.c -- status names, the per-thread last-error message, logging, the clock. */
#include "tkv-impl.h"

#include <stdarg.h>
#include <stdio.h>
#include <time.h>

static _Thread_local char tkv_last_error_buf[1024];

const char *tkv_status_str(tkv_status status)
{
    switch (status) {
    case TKV_OK: return "TKV_OK";
    case TKV_ERR_INVALID_ARG: return "TKV_ERR_INVALID_ARG";
    case TKV_ERR_FORMAT: return "TKV_ERR_FORMAT";
    case TKV_ERR_UNSUPPORTED: return "TKV_ERR_UNSUPPORTED";
    case TKV_ERR_IO: return "TKV_ERR_IO";
    case TKV_ERR_NOMEM: return "TKV_ERR_NOMEM";
    case TKV_ERR_CONTEXT_FULL: return "TKV_ERR_CONTEXT_FULL";
    case TKV_ERR_DEVICE: return "TKV_ERR_DEVICE";
    case TKV_ERR_CORRUPT: return "TKV_ERR_CORRUPT";
    case TKV_ERR_CANCELLED: return "TKV_ERR_CANCELLED";
    case TKV_ERR_TOO_SMALL: return "TKV_ERR_TOO_SMALL";
    case TKV_ERR_INTERNAL: return "TKV_ERR_INTERNAL";
    }
    return "TKV_ERR_UNKNOWN";
}

const char *tkv_last_error(void) { return tkv_last_error_buf; }

tkv_status tkv_err(tkv_status status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tkv_last_error_buf, sizeof tkv_last_error_buf, fmt, ap);
    va_end(ap);
    return status;
}

tkv_status tkv_err_wrap(tkv_status status, const char *fmt, ...)
{
    char prefix[256], old[sizeof tkv_last_error_buf];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(prefix, sizeof prefix, fmt, ap);
    va_end(ap);
    memcpy(old, tkv_last_error_buf, sizeof old);
    size_t n = strlen(prefix);
    if (n + 2 < sizeof tkv_last_error_buf) {
        memcpy(tkv_last_error_buf, prefix, n);
        memcpy(tkv_last_error_buf + n, ": ", 2);
        size_t room = sizeof tkv_last_error_buf - n - 3, m = strnlen(old, room);
        memcpy(tkv_last_error_buf + n + 2, old, m);
        tkv_last_error_buf[n + 2 + m] = 0;
    }
    return status;
}

static void tkv_log_stderr(enum tkv_log_level level, const char *msg, void *user)
{
    static const char *names[] = {"error", "warning", "info", "debug"};
    fprintf(stderr, "tierkv %s: %s\n", names[level], msg);
}

static tkv_log_fn tkv_log_sink = tkv_log_stderr;
static void *tkv_log_user;
static enum tkv_log_level tkv_log_max = TKV_LOG_WARN;

void tkv_set_log(tkv_log_fn fn, void *user, enum tkv_log_level max_level)
{
    tkv_log_sink = fn;
    tkv_log_user = user;
    tkv_log_max = max_level;
}

void tkv_log(enum tkv_log_level level, const char *fmt, ...)
{
    if (!tkv_log_sink || level > tkv_log_max)
        return;
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    tkv_log_sink(level, msg, tkv_log_user);
}

double tkv_now_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}
