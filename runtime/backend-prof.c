/*
 * backend-prof.c -- prints a backend's op profile (runtime/backend.h,
 * profile_read): one table format for every caller (the CUDA backend at
 * free, bench-decode per context, bench-gemv).
 */
#include "backend.h"

#include <stdio.h>
#include <stdlib.h>

static int by_dev_time(const void *a, const void *b)
{
    const struct tkv_op_profile_row *x = *(const struct tkv_op_profile_row *const *)a;
    const struct tkv_op_profile_row *y = *(const struct tkv_op_profile_row *const *)b;
    const double dx = x->dev_s >= 0 ? x->dev_s : -1.0 / (1.0 + x->host_s);
    const double dy = y->dev_s >= 0 ? y->dev_s : -1.0 / (1.0 + y->host_s);
    return dx < dy ? 1 : dx > dy ? -1 : 0;
}

void tkv_op_profile_print(const char *label, const struct tkv_op_profile *p, uint32_t steps)
{
    if (!p)
        return;
    const struct tkv_op_profile_row **order = malloc((p->n_rows ? p->n_rows : 1) * sizeof *order);
    if (!order)
        return;
    uint64_t calls = 0;
    double host = 0;
    for (uint32_t i = 0; i < p->n_rows; i++) {
        order[i] = &p->rows[i];
        calls += p->rows[i].calls;
        host += p->rows[i].host_s;
    }
    qsort(order, p->n_rows, sizeof *order, by_dev_time);
    const bool per = steps > 0;
    fprintf(stderr, "\nop profile: %s\n\n", label ? label : "");
    fprintf(stderr, "| op | calls |%s host us/call | dev us/call | dev ms total |%s share of dev time |\n",
            per ? " calls/step |" : "", per ? " dev ms/step |" : "");
    fprintf(stderr, "|---|---:|%s---:|---:|---:|%s---:|\n", per ? "---:|" : "", per ? "---:|" : "");
    for (uint32_t i = 0; i < p->n_rows; i++) {
        const struct tkv_op_profile_row *r = order[i];
        if (!r->calls)
            continue;
        char cps[32] = "", dev_call[32] = "-", dev_tot[32] = "-", dev_step[32] = "", share[32] = "-";
        if (per)
            snprintf(cps, sizeof cps, " %.1f |", (double)r->calls / steps);
        if (r->dev_s >= 0) {
            snprintf(dev_call, sizeof dev_call, "%.2f", r->dev_s * 1e6 / r->calls);
            snprintf(dev_tot, sizeof dev_tot, "%.3f", r->dev_s * 1e3);
            if (p->dev_busy_s > 0)
                snprintf(share, sizeof share, "%.1f%%", 100.0 * r->dev_s / p->dev_busy_s);
        }
        if (per && r->dev_s >= 0)
            snprintf(dev_step, sizeof dev_step, " %.4f |", r->dev_s * 1e3 / steps);
        else if (per)
            snprintf(dev_step, sizeof dev_step, " - |");
        fprintf(stderr, "| %s | %llu |%s %.2f | %s | %s |%s %s |\n", r->name, (unsigned long long)r->calls, cps,
                r->host_s * 1e6 / r->calls, dev_call, dev_tot, dev_step, share);
    }
    fprintf(stderr, "\ncalls %llu; host: %.3f ms from the first op to the last, %.3f ms (%.1f%%) inside ops; "
                    "device: %.3f ms busy of a %.3f ms span (%.1f%% busy)",
            (unsigned long long)calls, p->host_wall_s * 1e3, host * 1e3,
            p->host_wall_s > 0 ? 100.0 * host / p->host_wall_s : 0.0, p->dev_busy_s * 1e3, p->dev_span_s * 1e3,
            p->dev_span_s > 0 ? 100.0 * p->dev_busy_s / p->dev_span_s : 0.0);
    if (per)
        fprintf(stderr, "; per step: %.1f calls, host %.3f ms, device busy %.3f ms", (double)calls / steps,
                p->host_wall_s * 1e3 / steps, p->dev_busy_s * 1e3 / steps);
    fprintf(stderr, "\n\n");
    free(order);
}
