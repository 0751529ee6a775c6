/* policy-util.c -- helpers the policies share: arguments, key access,
 * SnapKV window scores, pooling, top-k, ranges. */
#include "policy.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

/* f16 -> f32: the F16C instruction where the build has it (same results as
 * tkv_fp16_to_fp32 for every non-NaN half), the scalar reference otherwise */
static inline float f16(uint16_t h)
{
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    return tkv_fp16_to_fp32(h);
#endif
}

static void f16_row(const uint16_t *src, float *dst, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        dst[i] = f16(src[i]);
}

static const char *arg_value(const struct tkv_policy_args *a, const char *key)
{
    for (uint32_t i = 0; i < a->n; i++)
        if (!strcmp(a->key[i], key))
            return a->value[i];
    return NULL;
}

tkv_status tkv_policy_arg_u32(const char *policy, const struct tkv_policy_args *a, const char *key, uint32_t *out)
{
    const char *v = arg_value(a, key);
    if (!v)
        return TKV_OK;
    char *end;
    errno = 0;
    unsigned long long x = strtoull(v, &end, 10);
    if (errno || *end || end == v || v[0] == '-' || x > UINT32_MAX)
        return tkv_err(TKV_ERR_INVALID_ARG, "policy '%s': %s=%s is not a non-negative integer", policy, key, v);
    *out = (uint32_t)x;
    return TKV_OK;
}

tkv_status tkv_policy_arg_f32(const char *policy, const struct tkv_policy_args *a, const char *key, float *out)
{
    const char *v = arg_value(a, key);
    if (!v)
        return TKV_OK;
    char *end;
    errno = 0;
    float x = strtof(v, &end);
    if (errno || *end || end == v || !isfinite(x))
        return tkv_err(TKV_ERR_INVALID_ARG, "policy '%s': %s=%s is not a number", policy, key, v);
    *out = x;
    return TKV_OK;
}

tkv_status tkv_policy_args_done(const char *policy, const struct tkv_policy_args *a, const char *const *known)
{
    for (uint32_t i = 0; i < a->n; i++) {
        bool ok = false;
        for (const char *const *k = known; *k && !ok; k++)
            ok = !strcmp(*k, a->key[i]);
        if (!ok) {
            char list[256] = "";
            for (const char *const *k = known; *k; k++) {
                size_t len = strlen(list);
                snprintf(list + len, sizeof list - len, "%s%s", len ? ", " : "", *k);
            }
            return tkv_err(TKV_ERR_INVALID_ARG, "policy '%s': unknown parameter '%s' (known: %s)", policy, a->key[i],
                           list[0] ? list : "none");
        }
    }
    return TKV_OK;
}

tkv_status tkv_policy_window_scores(const struct tkv_policy_view *v, const struct tkv_policy_env *env, uint32_t g,
                                    uint32_t n_prefix, float *score)
{
    const uint32_t G = env->n_head / env->n_head_kv, d = env->head_dim, n = v->n_past, R = G * v->n_q;
    const float scale = 1.0f / sqrtf((float)d);
    for (uint32_t j = 0; j < n_prefix; j++)
        score[j] = 0;
    /* logits[r][pos] for the R = group heads x window queries; each key row
     * is converted once and dotted with all of them */
    float *logit = malloc((size_t)R * n * sizeof *logit), *kf = malloc((size_t)d * sizeof *kf);
    if (!logit || !kf) {
        free(logit), free(kf);
        return tkv_err(TKV_ERR_NOMEM, "policy: out of memory for window scores");
    }
    const struct tkv_kv_head_view *kv = &v->kv[g];
    uint32_t m = 0; /* positions seen */
    for (uint32_t b = 0; b < kv->n_blocks; b++) {
        const struct tkv_kv_block_ref *blk = &kv->blocks[b];
        for (uint32_t t = 0; t < blk->n; t++) {
            const uint32_t pos = (uint32_t)blk->pos0 + t;
            if (pos >= n) /* keys past the view's context (e.g. this step's own) */
                break;
            f16_row(blk->k + (size_t)t * d, kf, d);
            for (uint32_t r = 0; r < R; r++) {
                const uint32_t hh = r / v->n_q, i = r % v->n_q;
                const float *q = v->q + (size_t)i * env->n_head * d + (size_t)(g * G + hh) * d;
                float s = 0;
                for (uint32_t c = 0; c < d; c++)
                    s += q[c] * kf[c];
                logit[(size_t)r * n + pos] = (int32_t)pos <= v->q_pos[i] ? s * scale : -INFINITY;
            }
            m = pos + 1 > m ? pos + 1 : m;
        }
    }
    for (uint32_t r = 0; r < R; r++) { /* softmax per query, averaged into the scores */
        float *row = logit + (size_t)r * n, mx = -INFINITY;
        for (uint32_t j = 0; j < m; j++)
            mx = row[j] > mx ? row[j] : mx;
        double sum = 0;
        for (uint32_t j = 0; j < m; j++)
            sum += row[j] == -INFINITY ? 0.0 : exp(row[j] - mx);
        const double w = 1.0 / (sum * R);
        for (uint32_t j = 0; j < n_prefix && j < m; j++)
            if (row[j] != -INFINITY)
                score[j] += (float)(exp(row[j] - mx) * w);
    }
    free(logit);
    free(kf);
    return TKV_OK;
}

void tkv_policy_pool(float *x, float *tmp, uint32_t n, uint32_t k, char kind)
{
    if (k <= 1 || n == 0)
        return;
    const int32_t half = (int32_t)(k / 2);
    for (int32_t i = 0; i < (int32_t)n; i++) {
        float acc = kind == 'm' ? -INFINITY : 0.0f;
        for (int32_t j = i - half; j <= i + half; j++) {
            float val = (j < 0 || j >= (int32_t)n) ? 0.0f : x[j]; /* zero padding, as PyTorch */
            if (kind == 'm')
                acc = val > acc ? val : acc;
            else
                acc += val;
        }
        tmp[i] = kind == 'm' ? acc : acc / (float)k;
    }
    memcpy(x, tmp, n * sizeof *x);
}

struct scored {
    float s;
    uint32_t i;
};

static int cmp_scored(const void *a, const void *b)
{
    const struct scored *x = a, *y = b;
    if (x->s != y->s)
        return x->s > y->s ? -1 : 1;
    return x->i < y->i ? -1 : x->i > y->i;
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

uint32_t tkv_policy_top_k_ref(const float *x, uint32_t n, uint32_t k, uint32_t *idx)
{
    if (k >= n) {
        for (uint32_t i = 0; i < n; i++)
            idx[i] = i;
        return n;
    }
    struct scored *s = malloc((size_t)n * sizeof *s);
    if (!s)
        return 0;
    for (uint32_t i = 0; i < n; i++)
        s[i] = (struct scored){isnan(x[i]) ? -INFINITY : x[i], i};
    qsort(s, n, sizeof *s, cmp_scored);
    for (uint32_t i = 0; i < k; i++)
        idx[i] = s[i].i;
    free(s);
    qsort(idx, k, sizeof *idx, cmp_u32);
    return k;
}

/* A float's bits as an unsigned key that sorts DESCENDING with the value
 * (largest -> 0): NaN is taken as -inf and -0 as +0, as the scans below
 * compare them. */
static uint32_t desc_key(float f)
{
    if (isnan(f))
        f = -INFINITY;
    if (f == 0.0f)
        f = 0.0f;
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return ~(u & 0x80000000u ? ~u : u | 0x80000000u);
}

/* The key of rank r (0 = largest value) among key[0..n), r < n: a radix
 * select in three rounds of 11, 11 and 10 bits, each a histogram of the
 * keys still in the running and a filter of them to the bin that holds
 * rank r (cand: n words of scratch). O(n), branch-free passes. */
static uint32_t rank_key(const uint32_t *key, uint32_t n, uint32_t r, uint32_t *cand)
{
    static const uint32_t shift[3] = {21, 10, 0}, bits[3] = {11, 11, 10};
    const uint32_t *in = key;
    uint32_t m = n;
    for (int round = 0; round < 3; round++) {
        uint32_t hist[2048] = {0};
        const uint32_t mask = (1u << bits[round]) - 1;
        for (uint32_t i = 0; i < m; i++)
            hist[(in[i] >> shift[round]) & mask]++;
        uint32_t bin = 0;
        while (r >= hist[bin])
            r -= hist[bin++];
        uint32_t w = 0;
        for (uint32_t i = 0; i < m; i++) {
            const uint32_t k = in[i];
            cand[w] = k;
            w += ((k >> shift[round]) & mask) == bin;
        }
        m = w;
        in = cand;
    }
    return cand[0];
}

uint32_t tkv_policy_top_k(const float *x, uint32_t n, uint32_t k, uint32_t *idx)
{
    if (k >= n || k == 0)
        return tkv_policy_top_k_scratch(x, n, k, idx, NULL);
    uint32_t *key = malloc((size_t)2 * n * sizeof *key);
    if (!key)
        return 0;
    const uint32_t m = tkv_policy_top_k_scratch(x, n, k, idx, key);
    free(key);
    return m;
}

uint32_t tkv_policy_top_k_scratch(const float *x, uint32_t n, uint32_t k, uint32_t *idx, uint32_t *key)
{
    if (k >= n) {
        for (uint32_t i = 0; i < n; i++)
            idx[i] = i;
        return n;
    }
    if (k == 0)
        return 0;
    for (uint32_t i = 0; i < n; i++)
        key[i] = desc_key(x[i]);
    const uint32_t t = rank_key(key, n, k - 1, key + n); /* the k-th largest value's key */
    /* everything above it, then ties by ascending index, in one ascending
     * scan: the first k of (score desc, index asc), sorted by index */
    uint32_t above = 0;
    for (uint32_t i = 0; i < n; i++)
        above += key[i] < t;
    uint32_t m = 0, ties = k - above;
    for (uint32_t i = 0; i < n && m < k; i++)
        if (key[i] < t || (key[i] == t && ties > 0 && ties--))
            idx[m++] = i;
    return m;
}

int tkv_policy_ranges(const uint32_t *pos, uint32_t n, uint32_t tail_begin, uint32_t tail_end, struct tkv_range *out,
                      uint32_t cap)
{
    uint32_t m = 0;
    for (uint32_t i = 0; i < n && m < cap; i++) {
        if (m > 0 && out[m - 1].end == pos[i])
            out[m - 1].end++;
        else
            out[m++] = (struct tkv_range){pos[i], pos[i] + 1};
    }
    if (tail_end > tail_begin) {
        if (m > 0 && out[m - 1].end >= tail_begin)
            out[m - 1].end = tail_end > out[m - 1].end ? tail_end : out[m - 1].end;
        else if (m < cap)
            out[m++] = (struct tkv_range){tail_begin, tail_end};
    }
    return (int)m;
}

/* ---- kept sets -------------------------------------------------------------- */

tkv_status tkv_kept_init(struct tkv_kept *k, uint32_t n_layer, uint32_t n_head_kv)
{
    k->n_layer = n_layer;
    k->n_head_kv = n_head_kv;
    k->r = calloc((size_t)n_layer * n_head_kv, sizeof *k->r);
    k->n = calloc((size_t)n_layer * n_head_kv, sizeof *k->n);
    if (!k->r || !k->n) {
        tkv_kept_free(k);
        return tkv_err(TKV_ERR_NOMEM, "policy: out of memory");
    }
    return TKV_OK;
}

void tkv_kept_reset(struct tkv_kept *k)
{
    if (!k->r)
        return;
    for (size_t i = 0; i < (size_t)k->n_layer * k->n_head_kv; i++) {
        free(k->r[i]);
        k->r[i] = NULL;
        k->n[i] = 0;
    }
}

void tkv_kept_free(struct tkv_kept *k)
{
    tkv_kept_reset(k);
    free(k->r);
    free(k->n);
    k->r = NULL;
    k->n = NULL;
}

tkv_status tkv_kept_set(struct tkv_kept *k, uint32_t layer, uint32_t head, const struct tkv_range *r, uint32_t n)
{
    const size_t i = (size_t)layer * k->n_head_kv + head;
    struct tkv_range *copy = malloc((n ? n : 1) * sizeof *copy);
    if (!copy)
        return tkv_err(TKV_ERR_NOMEM, "policy: out of memory");
    memcpy(copy, r, n * sizeof *copy);
    free(k->r[i]);
    k->r[i] = copy;
    k->n[i] = n;
    return TKV_OK;
}

int tkv_kept_select(const struct tkv_kept *k, uint32_t layer, uint32_t head, uint32_t from, uint32_t n_past,
                    struct tkv_range *out, uint32_t cap)
{
    const size_t i = (size_t)layer * k->n_head_kv + head;
    if (!k->r || !k->r[i])
        return -1;
    uint32_t m = TKV_MIN(k->n[i], cap);
    memcpy(out, k->r[i], m * sizeof *out);
    if (n_past > from) {
        if (m > 0 && out[m - 1].end >= from)
            out[m - 1].end = TKV_MAX(out[m - 1].end, n_past);
        else if (m < cap)
            out[m++] = (struct tkv_range){from, n_past};
    }
    return (int)m;
}

/* ---- segment block scores (CritiPrefill / EntropyInfer) --------------------------- */

uint32_t tkv_segment_block_probs(const struct tkv_policy_view *v, const struct tkv_policy_env *env, uint32_t g,
                                 uint32_t block, float *P)
{
    const uint32_t d = env->head_dim, G = env->n_head / env->n_head_kv, QD = env->n_head * d;
    const uint32_t seg_start = v->n_past - v->n_q, nb = seg_start / block;
    if (nb == 0 || v->n_q == 0)
        return 0;
    float *qmid = malloc((size_t)G * d * sizeof *qmid), *kmax = malloc((size_t)d * sizeof *kmax),
          *kmin = malloc((size_t)d * sizeof *kmin);
    if (!qmid || !kmax || !kmin) {
        free(qmid), free(kmax), free(kmin);
        return 0;
    }
    for (uint32_t hh = 0; hh < G; hh++) /* midrange query of the segment, per query head */
        for (uint32_t c = 0; c < d; c++) {
            float mx = -INFINITY, mn = INFINITY;
            for (uint32_t t = 0; t < v->n_q; t++) {
                float x = v->q[(size_t)t * QD + (size_t)(g * G + hh) * d + c];
                mx = x > mx ? x : mx;
                mn = x < mn ? x : mn;
            }
            qmid[hh * d + c] = 0.5f * (mx + mn);
        }
    const struct tkv_kv_head_view *kv = &v->kv[g];
    uint32_t b = 0; /* storage block holding the next position */
    float mx = -INFINITY;
    for (uint32_t j = 0; j < nb; j++) {
        for (uint32_t c = 0; c < d; c++)
            kmax[c] = -INFINITY, kmin[c] = INFINITY;
        for (uint32_t p = j * block; p < (j + 1) * block; p++) {
            while (b < kv->n_blocks && p >= (uint32_t)kv->blocks[b].pos0 + kv->blocks[b].n)
                b++;
            if (b == kv->n_blocks)
                break;
            const uint16_t *k = kv->blocks[b].k + (size_t)(p - (uint32_t)kv->blocks[b].pos0) * d;
            for (uint32_t c = 0; c < d; c++) {
                float x = f16(k[c]);
                kmax[c] = x > kmax[c] ? x : kmax[c];
                kmin[c] = x < kmin[c] ? x : kmin[c];
            }
        }
        double a = 0;
        for (uint32_t hh = 0; hh < G; hh++) {
            double s1 = 0, s2 = 0;
            for (uint32_t c = 0; c < d; c++) {
                s1 += (double)qmid[hh * d + c] * kmax[c];
                s2 += (double)qmid[hh * d + c] * kmin[c];
            }
            a += s1 > s2 ? s1 : s2;
        }
        P[j] = (float)(a / G);
        mx = P[j] > mx ? P[j] : mx;
    }
    double sum = 0;
    for (uint32_t j = 0; j < nb; j++)
        sum += (P[j] = expf(P[j] - mx));
    for (uint32_t j = 0; j < nb; j++)
        P[j] = (float)(P[j] / sum);
    free(qmid), free(kmax), free(kmin);
    return nb;
}

double tkv_entropy(const float *P, uint32_t n)
{
    double h = 0;
    for (uint32_t j = 0; j < n; j++)
        h -= P[j] * log(P[j] + 1e-9);
    return h;
}

uint32_t tkv_policy_block_ranges(const uint32_t *idx, uint32_t k, uint32_t block, struct tkv_range *out, uint32_t cap)
{
    uint32_t m = 0;
    for (uint32_t i = 0; i < k; i++) {
        const uint32_t b0 = idx[i] * block;
        if (m > 0 && out[m - 1].end == b0)
            out[m - 1].end += block;
        else if (m < cap)
            out[m++] = (struct tkv_range){b0, b0 + block};
    }
    return m;
}

/* ---- statistics through the backend op ------------------------------------------ */

tkv_status tkv_attn_stats_heads(const struct tkv_attn_stats_args *a, uint32_t n_blocks, uint32_t g0, uint32_t g1,
                                float *scratch)
{
    const struct tkv_policy_view v = {.n_past = a->n_past, .q = a->q, .q_pos = a->q_pos, .n_q = a->n_q, .kv = a->kv};
    const struct tkv_policy_env env = {.n_head = a->n_head, .n_head_kv = a->n_head_kv, .head_dim = a->head_dim};
    for (uint32_t g = g0; g < g1; g++) {
        if (a->kind == TKV_ATTN_STATS_SEGMENT) {
            float *row = a->probs ? a->probs + (size_t)g * a->probs_stride : scratch;
            if (tkv_segment_block_probs(&v, &env, g, a->block, row) != n_blocks) /* 0: its scratch failed */
                return tkv_err(TKV_ERR_NOMEM, "policy: out of memory for segment statistics");
            if (a->entropy)
                a->entropy[g] = tkv_entropy(row, n_blocks);
        } else if (a->n_prefix) {
            float *score = a->scores + (size_t)g * a->n_prefix;
            if (a->n_q == 0 || a->n_past == 0) { /* no query or no key: every score is 0 */
                memset(score, 0, (size_t)a->n_prefix * sizeof *score);
                continue;
            }
            TKV_TRY(tkv_policy_window_scores(&v, &env, g, a->n_prefix, score));
            if (a->pool > 1)
                tkv_policy_pool(score, scratch, a->n_prefix, a->pool, a->pool_kind);
        }
    }
    return TKV_OK;
}

/* Runs a: on v's backend, or here on the host. */
static tkv_status run_stats(const struct tkv_policy_view *v, const struct tkv_attn_stats_args *a)
{
    if (v->be) {
        if (!v->be->ops->attn_stats)
            return tkv_err(TKV_ERR_UNSUPPORTED, "policy: backend '%s' has no attn_stats op", v->be->ops->name);
        return v->be->ops->attn_stats(v->be, a);
    }
    uint32_t nb;
    TKV_TRY(tkv_attn_stats_check(a, &nb));
    const uint32_t n = TKV_MAX(TKV_MAX(nb, a->kind == TKV_ATTN_STATS_WINDOW ? a->n_prefix : 0u), 1u);
    float *scratch = malloc((size_t)n * sizeof *scratch);
    if (!scratch)
        return tkv_err(TKV_ERR_NOMEM, "policy: out of memory for statistics");
    tkv_status st = tkv_attn_stats_heads(a, nb, 0, a->n_head_kv, scratch);
    free(scratch);
    return st;
}

tkv_status tkv_policy_segment_stats(const struct tkv_policy_view *v, const struct tkv_policy_env *env, uint32_t block,
                                    float *P, uint32_t stride, double *H, uint32_t *n_blocks)
{
    const struct tkv_attn_stats_args a = {
        .kind = TKV_ATTN_STATS_SEGMENT, .q = v->q, .q_host = v->q_host, .q_pos = v->q_pos, .n_q = v->n_q,
        .n_head = env->n_head, .n_head_kv = env->n_head_kv, .head_dim = env->head_dim, .n_past = v->n_past,
        .kv = v->kv, .block = block, .probs = P, .probs_stride = stride, .entropy = H};
    *n_blocks = 0;
    uint32_t nb;
    TKV_TRY(tkv_attn_stats_check(&a, &nb));
    TKV_TRY(run_stats(v, &a));
    *n_blocks = nb;
    return TKV_OK;
}

tkv_status tkv_policy_window_stats(const struct tkv_policy_view *v, const struct tkv_policy_env *env,
                                   uint32_t n_prefix, uint32_t pool, char pool_kind, float *score)
{
    const struct tkv_attn_stats_args a = {
        .kind = TKV_ATTN_STATS_WINDOW, .q = v->q, .q_host = v->q_host, .q_pos = v->q_pos, .n_q = v->n_q,
        .n_head = env->n_head, .n_head_kv = env->n_head_kv, .head_dim = env->head_dim, .n_past = v->n_past,
        .kv = v->kv, .n_prefix = n_prefix, .pool = pool > 1 ? pool : 0, .pool_kind = pool_kind, .scores = score};
    return run_stats(v, &a);
}
