/*
 * attn.c -- attention over f16 KV blocks on the CPU.
 *
 * Fast path: the work is cut into items (KV head g, query tokens [t0, t1),
 * key blocks [b0, b1)). An item gathers the queries of g's query heads into
 * Q[R, hd] (R = tokens x heads per group, so the KV tile is read once for the
 * whole group), then walks its key blocks in tiles of up to TILE_KEYS keys:
 *     S = scale * Q . K^T        (OpenBLAS sgemm, K converted f16 -> f32)
 *     causal mask, online softmax (running max m and sum l per row)
 *     O = O * corr + P . V      (sgemm)
 * Prefill has many query tokens, so items split the queries; decode has one,
 * so items split the keys (flash-decoding) and a merge step combines the
 * partial results exactly by their log-sum-exp.
 *
 * Items of at most 8 rows (decode: one token x G heads) take the fused
 * kernels where the CPU has AVX2, FMA and F16C (cb->attn_fused): scores and
 * P . V straight from the f16 blocks, no f32 copy of the tile and no sgemm
 * (whose per-call cost and conversion pass dominate at 4-8 rows, and whose
 * kernels OpenBLAS may not pick for the CPU: its generic SSE3 ones ran at
 * ~5 GFLOP/s per core on the H200's host).
 *
 * Reference: one score at a time in double precision, for the tests.
 */
#include "cpu.h"
#include "quant.h"

#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TKV_X86 1
#endif

#define TILE_KEYS 256   /* keys per tile (a few KV blocks)                 */
#define ROWS_TARGET 128 /* query rows (tokens x group heads) per item       */

static tkv_status attn_check(const struct tkv_attn_args *a)
{
    if (!a || !a->q || !a->out || !a->q_pos || !a->kv)
        return tkv_err(TKV_ERR_INVALID_ARG, "attention: NULL argument");
    if (a->n_head == 0 || a->n_head_kv == 0 || a->n_head % a->n_head_kv != 0)
        return tkv_err(TKV_ERR_INVALID_ARG, "attention: %u query heads not a multiple of %u KV heads",
                       a->n_head, a->n_head_kv);
    if (a->head_dim == 0 || a->head_dim > 1024)
        return tkv_err(TKV_ERR_INVALID_ARG, "attention: head_dim %u out of range", a->head_dim);
    return TKV_OK;
}

/* ---- reference ---------------------------------------------------------- */

tkv_status tkv_cpu_attention_ref(const struct tkv_attn_args *a)
{
    TKV_TRY(attn_check(a));
    const uint32_t hd = a->head_dim, G = a->n_head / a->n_head_kv, ld = a->n_head * hd;
    double *acc = malloc(hd * sizeof *acc);
    if (!acc)
        return tkv_err(TKV_ERR_NOMEM, "attention: out of memory");
    for (uint32_t t = 0; t < a->n_q; t++) {
        for (uint32_t h = 0; h < a->n_head; h++) {
            const float *q = a->q + (size_t)t * ld + (size_t)h * hd;
            const struct tkv_kv_head_view *view = &a->kv[h / G];
            const uint32_t nb = tkv_attn_head_blocks(a, h / G);
            double m = -INFINITY, l = 0;
            for (uint32_t d = 0; d < hd; d++)
                acc[d] = 0;
            for (uint32_t b = 0; b < nb; b++) {
                const struct tkv_kv_block_ref *blk = &view->blocks[b];
                for (uint32_t j = 0; j < blk->n; j++) {
                    if (blk->pos0 + (int32_t)j > a->q_pos[t])
                        continue;
                    double s = 0;
                    for (uint32_t d = 0; d < hd; d++)
                        s += (double)q[d] * tkv_fp16_to_fp32(blk->k[(size_t)j * hd + d]);
                    s *= a->scale;
                    double m_new = s > m ? s : m, corr = exp(m - m_new), p = exp(s - m_new);
                    l = l * corr + p;
                    for (uint32_t d = 0; d < hd; d++)
                        acc[d] = acc[d] * corr + p * tkv_fp16_to_fp32(blk->v[(size_t)j * hd + d]);
                    m = m_new;
                }
            }
            float *o = a->out + (size_t)t * ld + (size_t)h * hd;
            for (uint32_t d = 0; d < hd; d++)
                o[d] = l > 0 ? (float)(acc[d] / l) : 0.0f;
            if (a->lse)
                a->lse[(size_t)t * a->n_head + h] = l > 0 ? (float)(m + log(l)) : -INFINITY;
        }
    }
    free(acc);
    return TKV_OK;
}

/* ---- vectorized exp ---------------------------------------------------- */

/* x[j] = exp(x[j] - m), returns the sum. Inputs of -inf give exactly 0.
 * Relative error ~2e-7 (degree-6 polynomial after range reduction). */
static float exp_sub_sum(float *x, uint32_t n, float m)
{
    uint32_t j = 0;
    float sum = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 vm = _mm256_set1_ps(m), log2e = _mm256_set1_ps(1.44269504088896341f);
    const __m256 ln2_hi = _mm256_set1_ps(0.693359375f), ln2_lo = _mm256_set1_ps(-2.12194440e-4f);
    const __m256 lo = _mm256_set1_ps(-87.0f), hi = _mm256_set1_ps(88.0f);
    const __m256 c2 = _mm256_set1_ps(1.0f / 2), c3 = _mm256_set1_ps(1.0f / 6), c4 = _mm256_set1_ps(1.0f / 24);
    const __m256 c5 = _mm256_set1_ps(1.0f / 120), c6 = _mm256_set1_ps(1.0f / 720), one = _mm256_set1_ps(1.0f);
    __m256 vsum = _mm256_setzero_ps();
    for (; j + 8 <= n; j += 8) {
        __m256 v = _mm256_sub_ps(_mm256_loadu_ps(x + j), vm);
        __m256 under = _mm256_cmp_ps(v, lo, _CMP_LT_OQ);
        v = _mm256_min_ps(_mm256_max_ps(v, lo), hi);
        __m256 k = _mm256_round_ps(_mm256_mul_ps(v, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m256 r = _mm256_fnmadd_ps(k, ln2_hi, v);
        r = _mm256_fnmadd_ps(k, ln2_lo, r);
        __m256 p = _mm256_fmadd_ps(c6, r, c5);
        p = _mm256_fmadd_ps(p, r, c4);
        p = _mm256_fmadd_ps(p, r, c3);
        p = _mm256_fmadd_ps(p, r, c2);
        p = _mm256_fmadd_ps(p, r, one);
        p = _mm256_fmadd_ps(p, r, one);
        __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
        p = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
        p = _mm256_andnot_ps(under, p);
        _mm256_storeu_ps(x + j, p);
        vsum = _mm256_add_ps(vsum, p);
    }
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(vsum), _mm256_extractf128_ps(vsum, 1));
    s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    s4 = _mm_add_ss(s4, _mm_shuffle_ps(s4, s4, 1));
    sum = _mm_cvtss_f32(s4);
#endif
    for (; j < n; j++) {
        x[j] = expf(x[j] - m);
        sum += x[j];
    }
    return sum;
}

/* The largest of x[0, n) (NaNs skipped, -inf for none), in 8 independent
 * lanes: one running max is a chain of dependent maxss, 4 cycles per key
 * and row (a quarter of the fused decode's time, perf). */
static float row_max(const float *x, uint32_t n)
{
    uint32_t j = 0;
    float mx = -INFINITY;
#if defined(__AVX__)
    __m256 v = _mm256_set1_ps(-INFINITY);
    for (; j + 8 <= n; j += 8)
        v = _mm256_max_ps(_mm256_loadu_ps(x + j), v); /* a NaN in x yields v */
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    mx = _mm_cvtss_f32(h);
#endif
    for (; j < n; j++)
        mx = x[j] > mx ? x[j] : mx;
    return mx;
}

/* ---- fused kernels for items of <= 8 rows (AVX2, FMA, F16C) --------------- */

#define FUSED_ROWS 8 /* items of at most this many rows take the fused kernels */

/* the kernels of one row count: scores of a tile, then O += P V (below) */
typedef void (*scores_fn)(const float *Q, uint32_t hd, const struct tkv_kv_block_ref *blk, uint32_t nb, float *S,
                          uint32_t ld);
typedef void (*pv_fn)(float *O, uint32_t hd, const float *S, uint32_t ld, const struct tkv_kv_block_ref *blk,
                      uint32_t nb);

#if defined(TKV_X86)
bool tkv_cpu_attn_fused_ok(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

#define TKV_FUSED __attribute__((target("avx2,fma,f16c")))

/* lane i of the result: the sum of the 8 lanes of ai */
TKV_FUSED static inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6,
                                     __m256 a7)
{
    const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

TKV_FUSED static inline __m256 load_h8(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* Asks for the n rows of hd f16 at p in cache, a line at a time. A macro,
 * not a function: GCC takes a function of prefetches alone for pure and
 * drops its calls. */
#define PREFETCH_ROWS(p, n, hd)                                                                                         \
    do {                                                                                                               \
        const char *pf_ = (const char *)(p);                                                                           \
        for (size_t o_ = 0; o_ < (size_t)(n) * (hd) * 2; o_ += 64)                                                     \
            _mm_prefetch(pf_ + o_, _MM_HINT_T0);                                                                       \
    } while (0)

/* S[r * ld + c] = Q[r] . k_c for the RR rows of Q (hd floats each) and the
 * nb blocks' keys (c counts them): two keys per step for up to 4 rows, one
 * for more, so that up to 8 independent accumulators hide the FMA latency
 * (an odd block's last key is paired with itself) and one horizontal-sum
 * shuffle yields 8 scores. hd a multiple of 8.
 * Each step also asks for the V rows of its keys, which pv_rows reads once
 * the tile's scores are done: decode attention reads every K/V row once,
 * from memory, and without it P . V waited for each V row (1.5x on one
 * core of the build VM, SmolLM2 at 8K: docs/benchmarks.md). */
TKV_FUSED static inline __attribute__((always_inline)) void scores_rows(const float *Q, uint32_t hd,
                                                                       const struct tkv_kv_block_ref *blk,
                                                                       uint32_t nb, float *S, uint32_t ld,
                                                                       const uint32_t RR)
{
    const uint32_t KS = RR <= 4 ? 2 : 1; /* keys per step */
    uint32_t c = 0;
    for (uint32_t b = 0; b < nb; b++)
        for (uint32_t j = 0; j < blk[b].n; j += KS) {
            const bool pair = KS == 2 && j + 1 < blk[b].n;
            const uint16_t *k0 = blk[b].k + (size_t)j * hd, *k1 = pair ? k0 + hd : k0;
            PREFETCH_ROWS(blk[b].v + (size_t)j * hd, pair ? 2 : 1, hd);
            __m256 a[8];
            for (int i = 0; i < 8; i++)
                a[i] = _mm256_setzero_ps();
            for (uint32_t d = 0; d < hd; d += 8) {
                const __m256 x0 = load_h8(k0 + d), x1 = KS == 2 ? load_h8(k1 + d) : x0;
                for (uint32_t r = 0; r < RR; r++) {
                    const __m256 q = _mm256_loadu_ps(Q + (size_t)r * hd + d);
                    a[r] = _mm256_fmadd_ps(q, x0, a[r]);
                    if (KS == 2)
                        a[4 + r] = _mm256_fmadd_ps(q, x1, a[4 + r]);
                }
            }
            float t[8];
            _mm256_storeu_ps(t, hsum8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]));
            for (uint32_t r = 0; r < RR; r++) {
                S[r * ld + c] = t[r];
                if (pair)
                    S[r * ld + c + 1] = t[4 + r];
            }
            c += pair ? 2 : 1;
        }
}

/* O[r][d, d + W) += sum_c S[r * ld + c] v_c[d, d + W) over the nb blocks'
 * keys, for RR rows (O: RR rows of hd floats), with those W dims of the
 * RR rows in registers while every key of the tile passes. */
TKV_FUSED static inline __attribute__((always_inline)) void pv_pass(float *O, uint32_t hd, const float *S, uint32_t ld,
                                                                   const struct tkv_kv_block_ref *blk, uint32_t nb,
                                                                   const uint32_t RR, const uint32_t d, const uint32_t W)
{
    __m256 o[16];
    for (uint32_t r = 0; r < RR; r++)
        for (uint32_t h = 0; h < W / 8; h++)
            o[r * 2 + h] = _mm256_loadu_ps(O + (size_t)r * hd + d + 8 * h);
    uint32_t c = 0;
    for (uint32_t b = 0; b < nb; b++)
        for (uint32_t j = 0; j < blk[b].n; j++, c++) {
            const uint16_t *v = blk[b].v + (size_t)j * hd + d;
            __m256 x[2];
            for (uint32_t h = 0; h < W / 8; h++)
                x[h] = load_h8(v + 8 * h);
            for (uint32_t r = 0; r < RR; r++) {
                const __m256 p = _mm256_broadcast_ss(S + r * ld + c);
                for (uint32_t h = 0; h < W / 8; h++)
                    o[r * 2 + h] = _mm256_fmadd_ps(p, x[h], o[r * 2 + h]);
            }
        }
    for (uint32_t r = 0; r < RR; r++)
        for (uint32_t h = 0; h < W / 8; h++)
            _mm256_storeu_ps(O + (size_t)r * hd + d + 8 * h, o[r * 2 + h]);
}

/* O[r] += sum_c S[r * ld + c] v_c over the tile for RR rows: 16 dims per
 * pass for up to 4 rows (up to 8 accumulators), 8 for more; the tile's V
 * stays in L1/L2 across the passes. hd a multiple of 8. */
TKV_FUSED static inline __attribute__((always_inline)) void pv_rows(float *O, uint32_t hd, const float *S, uint32_t ld,
                                                                   const struct tkv_kv_block_ref *blk, uint32_t nb,
                                                                   const uint32_t RR)
{
    uint32_t d = 0;
    if (RR <= 4)
        for (; d + 16 <= hd; d += 16)
            pv_pass(O, hd, S, ld, blk, nb, RR, d, 16);
    for (; d < hd; d += 8)
        pv_pass(O, hd, S, ld, blk, nb, RR, d, 8);
}

/* one instance of each per row count, the rows' loops unrolled */
#define FUSED_INSTANCES(R)                                                                                             \
    TKV_FUSED static void scores_##R(const float *Q, uint32_t hd, const struct tkv_kv_block_ref *blk, uint32_t nb,    \
                                     float *S, uint32_t ld)                                                            \
    {                                                                                                                  \
        scores_rows(Q, hd, blk, nb, S, ld, R);                                                                         \
    }                                                                                                                  \
    TKV_FUSED static void pv_##R(float *O, uint32_t hd, const float *S, uint32_t ld,                                  \
                                 const struct tkv_kv_block_ref *blk, uint32_t nb)                                      \
    {                                                                                                                  \
        pv_rows(O, hd, S, ld, blk, nb, R);                                                                             \
    }
FUSED_INSTANCES(1)
FUSED_INSTANCES(2)
FUSED_INSTANCES(3)
FUSED_INSTANCES(4)
FUSED_INSTANCES(5)
FUSED_INSTANCES(6)
FUSED_INSTANCES(7)
FUSED_INSTANCES(8)
static const scores_fn fused_scores[FUSED_ROWS + 1] = {NULL,     scores_1, scores_2, scores_3, scores_4,
                                                      scores_5, scores_6, scores_7, scores_8};
static const pv_fn fused_pv[FUSED_ROWS + 1] = {NULL, pv_1, pv_2, pv_3, pv_4, pv_5, pv_6, pv_7, pv_8};

#else /* not x86: the sgemm path only (the tables are never read) */
bool tkv_cpu_attn_fused_ok(void) { return false; }
static const scores_fn fused_scores[FUSED_ROWS + 1];
static const pv_fn fused_pv[FUSED_ROWS + 1];
#endif

/* ---- fast path ------------------------------------------------------------ */

struct attn_job {
    struct tkv_cpu_backend *cb;
    const struct tkv_attn_args *a;
    uint32_t G, tok_per_item, n_tok_chunks, n_split;
    uint32_t n_items;
    bool fused; /* items of <= FUSED_ROWS rows take the fused kernels */
    float *partials; /* n_split > 1: per item [R][hd + 2] (O, m, l) */
    size_t partial_stride;
    tkv_status status;
};

/* Blocks [b0, b1) of a view with n_blocks split in n_split even parts. */
static void split_blocks(uint32_t n_blocks, uint32_t s, uint32_t n_split, uint32_t *b0, uint32_t *b1)
{
    uint64_t lo, hi;
    tkv_split(n_blocks, s, n_split, &lo, &hi);
    *b0 = (uint32_t)lo;
    *b1 = (uint32_t)hi;
}

static void attn_item(struct attn_job *job, uint32_t item, uint32_t ith)
{
    const struct tkv_attn_args *a = job->a;
    const uint32_t hd = a->head_dim, G = job->G, ld = a->n_head * hd;
    const uint32_t s = item % job->n_split, rest = item / job->n_split;
    const uint32_t chunk = rest % job->n_tok_chunks, g = rest / job->n_tok_chunks;
    const uint32_t t0 = chunk * job->tok_per_item, t1 = TKV_MIN(a->n_q, t0 + job->tok_per_item);
    const uint32_t R = (t1 - t0) * G;
    const struct tkv_kv_head_view *view = &a->kv[g];
    uint32_t b0, b1;
    split_blocks(tkv_attn_head_blocks(a, g), s, job->n_split, &b0, &b1);
    /* the fused kernels (Q pre-scaled) or sgemm (K and V converted per tile) */
    const bool fused = job->fused && R <= FUSED_ROWS;

    /* scratch: Q[R,hd] O[R,hd] m[R] l[R] S[R,TILE] K[TILE,hd] V[TILE,hd] kpos[TILE] */
    size_t need = (size_t)R * hd * 2 + (size_t)R * 2 + (size_t)R * TILE_KEYS + (size_t)TILE_KEYS * hd * 2 + TILE_KEYS;
    float *Q = tkv_cpu_scratch(job->cb, ith, need);
    if (!Q) {
        job->status = TKV_ERR_NOMEM;
        return;
    }
    float *O = Q + (size_t)R * hd, *M = O + (size_t)R * hd, *L = M + R, *S = L + R;
    float *K = S + (size_t)R * TILE_KEYS, *V = K + (size_t)TILE_KEYS * hd;
    int32_t *kpos = (int32_t *)(V + (size_t)TILE_KEYS * hd);

    /* row r = (t - t0) * G + hh holds query head g*G + hh of token t */
    for (uint32_t t = t0; t < t1; t++)
        for (uint32_t hh = 0; hh < G; hh++)
            memcpy(Q + ((size_t)(t - t0) * G + hh) * hd, a->q + (size_t)t * ld + (size_t)(g * G + hh) * hd,
                   hd * sizeof(float));
    if (fused)
        for (size_t i = 0; i < (size_t)R * hd; i++)
            Q[i] *= a->scale;
    memset(O, 0, (size_t)R * hd * sizeof(float));
    for (uint32_t r = 0; r < R; r++) {
        M[r] = -INFINITY;
        L[r] = 0;
    }
    const int32_t pos_min = a->q_pos[t0], pos_max = a->q_pos[t1 - 1];

    uint32_t b = b0;
    while (b < b1 && view->blocks[b].pos0 <= pos_max) {
        /* gather whole blocks into one tile of at most TILE_KEYS keys
         * (converted to f32 for sgemm; the fused kernels read them as they are) */
        const uint32_t bt = b;
        uint32_t nk = 0;
        while (b < b1 && view->blocks[b].pos0 <= pos_max && nk + view->blocks[b].n <= TILE_KEYS) {
            const struct tkv_kv_block_ref *blk = &view->blocks[b];
            if (!fused) {
                tkv_fp16_to_fp32_row(blk->k, K + (size_t)nk * hd, (int64_t)blk->n * hd);
                tkv_fp16_to_fp32_row(blk->v, V + (size_t)nk * hd, (int64_t)blk->n * hd);
            }
            for (uint32_t j = 0; j < blk->n; j++)
                kpos[nk + j] = blk->pos0 + (int32_t)j;
            nk += blk->n;
            b++;
        }
        if (nk == 0) { /* a single block larger than a tile: cannot happen for B <= TILE_KEYS */
            job->status = TKV_ERR_INTERNAL;
            return;
        }
        if (fused)
            fused_scores[R](Q, hd, view->blocks + bt, b - bt, S, nk);
        else
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)R, (int)nk, (int)hd, a->scale, Q, (int)hd, K,
                        (int)hd, 0.0f, S, (int)nk);
        const bool need_mask = kpos[nk - 1] > pos_min;
        for (uint32_t r = 0; r < R; r++) {
            float *srow = S + (size_t)r * nk;
            if (need_mask) {
                const int32_t qp = a->q_pos[t0 + r / G];
                for (uint32_t j = 0; j < nk; j++)
                    if (kpos[j] > qp)
                        srow[j] = -INFINITY;
            }
            const float mx = row_max(srow, nk);
            if (mx == -INFINITY) { /* nothing visible to this row in this tile */
                memset(srow, 0, nk * sizeof(float));
                continue;
            }
            const float m_new = mx > M[r] ? mx : M[r];
            const float corr = expf(M[r] - m_new); /* 0 when M[r] = -inf */
            L[r] = L[r] * corr + exp_sub_sum(srow, nk, m_new);
            M[r] = m_new;
            if (corr != 1.0f)
                cblas_sscal((int)hd, corr, O + (size_t)r * hd, 1);
        }
        if (fused) {
            fused_pv[R](O, hd, S, nk, view->blocks + bt, b - bt);
        } else {
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)R, (int)hd, (int)nk, 1.0f, S, (int)nk, V,
                        (int)hd, 1.0f, O, (int)hd);
        }
    }

    if (job->n_split == 1) { /* final: normalise into out / lse */
        for (uint32_t r = 0; r < R; r++) {
            const uint32_t t = t0 + r / G, h = g * G + r % G;
            float *o = a->out + (size_t)t * ld + (size_t)h * hd;
            const float inv = L[r] > 0 ? 1.0f / L[r] : 0.0f;
            for (uint32_t d = 0; d < hd; d++)
                o[d] = O[(size_t)r * hd + d] * inv;
            if (a->lse)
                a->lse[(size_t)t * a->n_head + h] = L[r] > 0 ? M[r] + logf(L[r]) : -INFINITY;
        }
    } else { /* partial: O unnormalised, then m and l */
        float *p = job->partials + (size_t)item * job->partial_stride;
        for (uint32_t r = 0; r < R; r++) {
            memcpy(p + (size_t)r * (hd + 2), O + (size_t)r * hd, hd * sizeof(float));
            p[(size_t)r * (hd + 2) + hd] = M[r];
            p[(size_t)r * (hd + 2) + hd + 1] = L[r];
        }
    }
}

static void attn_worker(void *ctx, uint32_t ith, uint32_t nth)
{
    struct attn_job *job = ctx;
    uint64_t i0, i1;
    tkv_split(job->n_items, ith, nth, &i0, &i1);
    for (uint64_t i = i0; i < i1; i++)
        attn_item(job, (uint32_t)i, ith);
}

/* Combines the n_split partials of every (token, head) by log-sum-exp. */
static void attn_merge(struct attn_job *job)
{
    const struct tkv_attn_args *a = job->a;
    const uint32_t hd = a->head_dim, G = job->G, ld = a->n_head * hd;
    for (uint32_t g = 0; g < a->n_head_kv; g++) {
        for (uint32_t chunk = 0; chunk < job->n_tok_chunks; chunk++) {
            const uint32_t t0 = chunk * job->tok_per_item, t1 = TKV_MIN(a->n_q, t0 + job->tok_per_item);
            for (uint32_t r = 0; r < (t1 - t0) * G; r++) {
                const uint32_t base = (g * job->n_tok_chunks + chunk) * job->n_split;
                float m = -INFINITY, l = 0;
                for (uint32_t s = 0; s < job->n_split; s++) {
                    const float *p = job->partials + (size_t)(base + s) * job->partial_stride + (size_t)r * (hd + 2);
                    m = p[hd] > m ? p[hd] : m;
                }
                const uint32_t t = t0 + r / G, h = g * G + r % G;
                float *o = a->out + (size_t)t * ld + (size_t)h * hd;
                memset(o, 0, hd * sizeof(float));
                if (m != -INFINITY) {
                    for (uint32_t s = 0; s < job->n_split; s++) {
                        const float *p = job->partials + (size_t)(base + s) * job->partial_stride + (size_t)r * (hd + 2);
                        if (p[hd + 1] == 0)
                            continue;
                        const float w = expf(p[hd] - m);
                        l += p[hd + 1] * w;
                        for (uint32_t d = 0; d < hd; d++)
                            o[d] += p[d] * w;
                    }
                    for (uint32_t d = 0; d < hd; d++)
                        o[d] /= l;
                }
                if (a->lse)
                    a->lse[(size_t)t * a->n_head + h] = l > 0 ? m + logf(l) : -INFINITY;
            }
        }
    }
}

tkv_status tkv_cpu_attention(struct tkv_cpu_backend *cb, const struct tkv_attn_args *a)
{
    TKV_TRY(attn_check(a));
    for (uint32_t g = 0; g < a->n_head_kv; g++)
        for (uint32_t b = 0; b < tkv_attn_head_blocks(a, g); b++)
            if (a->kv[g].blocks[b].n > TILE_KEYS)
                return tkv_err(TKV_ERR_INVALID_ARG, "attention: KV block of %u rows exceeds %u",
                               a->kv[g].blocks[b].n, TILE_KEYS);
    if (a->n_q == 0)
        return TKV_OK;
    struct attn_job job = {.cb = cb, .a = a, .G = a->n_head / a->n_head_kv, .status = TKV_OK,
                           .fused = cb->attn_fused && a->head_dim % 8 == 0};
    job.tok_per_item = TKV_MAX(1u, ROWS_TARGET / job.G);
    job.n_tok_chunks = (a->n_q + job.tok_per_item - 1) / job.tok_per_item;
    /* split the keys only when queries alone give too few items; heads
     * with no block give empty items, so only the others count (the
     * heterogeneous split hands the CPU a few of a layer's heads) */
    uint32_t max_blocks = 0, busy = 0;
    for (uint32_t g = 0; g < a->n_head_kv; g++) {
        const uint32_t nb = tkv_attn_head_blocks(a, g);
        max_blocks = TKV_MAX(max_blocks, nb);
        busy += nb > 0;
    }
    const uint32_t busy_items = TKV_MAX(busy, 1u) * job.n_tok_chunks, want = 4 * cb->n_threads;
    job.n_split = 1;
    if (busy_items < want && max_blocks > 1)
        job.n_split = TKV_MIN(max_blocks, (want + busy_items - 1) / busy_items);
    job.n_items = a->n_head_kv * job.n_tok_chunks * job.n_split;
    if (job.n_split > 1) {
        job.partial_stride = (size_t)job.tok_per_item * job.G * (a->head_dim + 2);
        size_t need = job.partial_stride * job.n_items;
        if (need > cb->partials_cap) {
            float *p = realloc(cb->partials, need * sizeof(float));
            if (!p)
                return tkv_err(TKV_ERR_NOMEM, "attention: out of memory for %zu partial floats", need);
            cb->partials = p;
            cb->partials_cap = need;
        }
        job.partials = cb->partials;
    }
    tkv_pool_run(cb->pool, attn_worker, &job);
    if (job.status != TKV_OK)
        return tkv_err(job.status, "attention: %s in a worker (scratch allocation)", tkv_status_str(job.status));
    if (job.n_split > 1)
        attn_merge(&job);
    return TKV_OK;
}
