/*
 * hetero.c -- see hetero.h: the exact merge of two partial attentions, and
 * the measurement of the CPU's attention rate for the cost model.
 */
#include "hetero.h"

#include "../tiers/crc32c.h"

#include <math.h>
#include <stdlib.h>

void tkv_attn_merge(float *o, float *lse, const float *o2, const float *lse2, uint32_t n_rows, uint32_t head_dim)
{
    for (uint32_t r = 0; r < n_rows; r++) {
        const float a = lse[r], b = lse2[r];
        float *x = o + (size_t)r * head_dim;
        const float *y = o2 + (size_t)r * head_dim;
        if (b == -INFINITY) { /* nothing on the second side: the first as it is */
            if (a == -INFINITY)
                memset(x, 0, head_dim * sizeof *x);
            continue;
        }
        if (a == -INFINITY) {
            memcpy(x, y, head_dim * sizeof *x);
            lse[r] = b;
            continue;
        }
        /* weights relative to the larger side, so one of them is exactly 1 */
        const float m = a > b ? a : b, wa = expf(a - m), wb = expf(b - m), sum = wa + wb;
        const float ca = wa / sum, cb = wb / sum;
        for (uint32_t d = 0; d < head_dim; d++)
            x[d] = ca * x[d] + cb * y[d];
        lse[r] = m + logf(sum);
    }
}

void tkv_attn_merge_ref(float *o, float *lse, const float *o2, const float *lse2, uint32_t n_rows,
                        uint32_t head_dim)
{
    for (uint32_t r = 0; r < n_rows; r++) {
        const double a = lse[r], b = lse2[r];
        float *x = o + (size_t)r * head_dim;
        const float *y = o2 + (size_t)r * head_dim;
        if (a == -INFINITY && b == -INFINITY) {
            for (uint32_t d = 0; d < head_dim; d++)
                x[d] = 0;
            continue;
        }
        const double l = a == -INFINITY ? b : b == -INFINITY ? a : fmax(a, b) + log1p(exp(-fabs(a - b)));
        const double ca = a == -INFINITY ? 0 : exp(a - l), cb = b == -INFINITY ? 0 : exp(b - l);
        for (uint32_t d = 0; d < head_dim; d++)
            x[d] = (float)(ca * x[d] + cb * y[d]);
        lse[r] = (float)l;
    }
}

bool tkv_hetero_choose(struct tkv_hetero_head *h, double cpu_s, double recall_s)
{
    const double now[2] = {cpu_s, recall_s};
    if (h->last) { /* the host blocks this step finds are the last choice's consequence */
        const int m = h->last - 1;
        h->cost[m] = (float)(h->cost[m] < 0 ? now[m] : 0.5 * (h->cost[m] + now[m]));
        if (h->cost[1 - m] >= 0) /* unobserved since: stale */
            h->cost[1 - m] += (float)((now[1 - m] - h->cost[1 - m]) / 8);
    }
    double price[2];
    for (int m = 0; m < 2; m++)
        price[m] = h->cost[m] >= 0 ? h->cost[m] : now[m];
    int pick = price[0] < price[1] ? 0 : 1;
    if (h->last && h->cost[1 - pick] < 0 && now[1 - pick] <= 2 * price[pick])
        pick = 1 - pick; /* never observed and not far off: try it once */
    h->last = (uint8_t)(pick + 1);
    return pick == 0;
}

void tkv_hetero_arms_init(struct tkv_hetero_arms *a)
{
    *a = (struct tkv_hetero_arms){.arm = TKV_HETERO_ARM_MODEL, .switched = true};
    for (int m = 0; m < TKV_HETERO_ARMS; m++) {
        a->mean[m] = -1;
        a->wait[m] = TKV_HETERO_ARM_WAIT / 2; /* doubled at the first trial it loses */
    }
}

enum tkv_hetero_arm tkv_hetero_arm_next(struct tkv_hetero_arms *a, double secs)
{
    a->steps[a->arm]++;
    if (!a->switched) {
        a->sum += secs;
        a->n++;
    }
    a->switched = false;
    if (a->n < TKV_HETERO_ARM_TRIAL)
        return a->arm;
    const int cur = (int)a->arm;
    a->mean[cur] = a->sum / a->n;
    a->sum = 0, a->n = 0;
    int best = -1;
    uint32_t step = 0; /* steps so far */
    for (int m = 0; m < TKV_HETERO_ARMS; m++) {
        step += a->steps[m];
        if (a->mean[m] >= 0 && (best < 0 || a->mean[m] < a->mean[best]))
            best = m;
    }
    /* due = 0: no re-trial scheduled (the best needs none). An arm that has
     * just lost, or that the best has just passed, waits twice as long as
     * the last time; the best's wait starts over. */
    for (int m = 0; m < TKV_HETERO_ARMS; m++) {
        if (m == best) {
            a->wait[m] = TKV_HETERO_ARM_WAIT / 2;
            a->due[m] = 0;
        } else if (a->mean[m] >= 0 && (m == cur || a->due[m] == 0)) {
            a->wait[m] = a->wait[m] < TKV_HETERO_ARM_WAIT_MAX / 2 ? 2 * a->wait[m] : TKV_HETERO_ARM_WAIT_MAX;
            a->due[m] = step + a->wait[m];
        }
    }
    int next = -1;
    for (int m = 0; m < TKV_HETERO_ARMS && next < 0; m++)
        if (a->mean[m] < 0)
            next = m; /* never tried: first */
    for (int m = 0; m < TKV_HETERO_ARMS && next < 0; m++)
        if (a->due[m] && step >= a->due[m])
            next = m; /* due again */
    if (next < 0)
        next = best;
    if (next != cur) {
        a->arm = (enum tkv_hetero_arm)next;
        a->switched = true;
    }
    return a->arm;
}

void tkv_hetero_rate_observe(struct tkv_hetero_rate *r, double work, double secs, double prior, double min_s)
{
    if (!(work > 0) || !(secs > 0) || !(work >= min_s * tkv_hetero_rate_get(r, prior)))
        return;
    r->work = 0.9 * r->work + work;
    r->secs = 0.9 * r->secs + secs;
}

double tkv_hetero_rate_get(const struct tkv_hetero_rate *r, double prior)
{
    return r->secs > 0 ? r->work / r->secs : prior;
}

tkv_status tkv_hetero_measure_cpu(struct tkv_backend *cpu, uint32_t n_head_kv, uint32_t group, uint32_t head_dim,
                                  uint32_t block, double *flops)
{
    enum { TOKENS = 2048 };
    *flops = 0;
    if (!n_head_kv || !group || !head_dim || !block || block > TOKENS)
        return tkv_err(TKV_ERR_INVALID_ARG, "hetero: measuring the CPU with a zero or oversized shape");
    const uint32_t nb = TOKENS / block, H = n_head_kv * group;
    const size_t kv_halves = (size_t)n_head_kv * nb * block * head_dim; /* f16 per K (and per V) */
    uint16_t *kv = malloc(2 * kv_halves * sizeof *kv);
    float *q = malloc((size_t)H * head_dim * sizeof *q), *out = malloc((size_t)H * head_dim * sizeof *out);
    float *lse = malloc(H * sizeof *lse);
    struct tkv_kv_block_ref *refs = malloc((size_t)n_head_kv * nb * sizeof *refs);
    struct tkv_kv_head_view *views = malloc(n_head_kv * sizeof *views);
    tkv_status st = TKV_OK;
    if (!kv || !q || !out || !lse || !refs || !views) {
        st = tkv_err(TKV_ERR_NOMEM, "hetero: out of memory measuring the CPU");
        goto done;
    }
    /* keys and values of unit scale, a deterministic pattern: the rate does
     * not depend on the values */
    uint32_t x = 12345;
    for (size_t i = 0; i < 2 * kv_halves; i++) {
        x = x * 1664525u + 1013904223u;
        kv[i] = tkv_fp32_to_fp16((float)(x >> 8) / (float)(1u << 24) - 0.5f);
    }
    for (size_t i = 0; i < (size_t)H * head_dim; i++)
        q[i] = (float)((i * 7) % 13) / 13.0f - 0.5f;
    const size_t blk_halves = (size_t)block * head_dim;
    for (uint32_t g = 0; g < n_head_kv; g++) {
        for (uint32_t b = 0; b < nb; b++) {
            uint16_t *k = kv + ((size_t)g * nb + b) * blk_halves;
            refs[(size_t)g * nb + b] = (struct tkv_kv_block_ref){.k = k, .v = k + kv_halves, .pos0 = (int32_t)(b * block),
                                                                 .n = block};
        }
        views[g] = (struct tkv_kv_head_view){.blocks = refs + (size_t)g * nb, .n_blocks = nb};
    }
    const int32_t pos = TOKENS;
    const struct tkv_attn_args a = {.q = q, .q_pos = &pos, .out = out, .lse = lse, .n_q = 1, .n_head = H,
                                    .n_head_kv = n_head_kv, .head_dim = head_dim,
                                    .scale = 1.0f / sqrtf((float)head_dim), .kv = views};
    double best = INFINITY;
    for (int rep = 0; rep < 4 && st == TKV_OK; rep++) {
        const double t0 = tkv_now_seconds();
        st = cpu->ops->attention(cpu, &a);
        const double dt = tkv_now_seconds() - t0;
        if (rep > 0 && dt < best) /* rep 0 warms the pool and the caches */
            best = dt;
    }
    if (st == TKV_OK)
        *flops = (double)n_head_kv * TOKENS * group * head_dim * 4.0 / (best > 0 ? best : 1e-9);
done:
    free(kv), free(q), free(out), free(lse), free(refs), free(views);
    return st;
}

double tkv_hetero_measure_crc(void)
{
    enum { BYTES = 4 << 20 };
    uint8_t *buf = malloc(BYTES);
    if (!buf)
        return 0;
    for (size_t i = 0; i < BYTES; i++)
        buf[i] = (uint8_t)(i * 131u >> 3);
    double best = INFINITY;
    volatile uint32_t sink; /* the sums are stored, so they are computed */
    for (int rep = 0; rep < 4; rep++) {
        const double t0 = tkv_now_seconds();
        sink = tkv_crc32c(0, buf, BYTES);
        const double dt = tkv_now_seconds() - t0;
        if (rep > 0 && dt < best)
            best = dt;
    }
    (void)sink;
    free(buf);
    return BYTES / (best > 0 ? best : 1e-9);
}
