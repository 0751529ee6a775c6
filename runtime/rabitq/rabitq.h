/*
 * rabitq.h -- the RaBitQ key index of one (sequence, layer, KV head): keys
 * centred and randomly rotated, kept as 1 bit per dimension plus 3 floats;
 * a query centred, rotated and quantized to 4 bits; a popcount estimate of
 * every q.k with a per-key error bound; top-p selection on the estimates.
 * Math, layout and measured numbers: docs/rabitq.md. Source of the method:
 * shared/specs/rabitqcache.md (sections 1.2-1.7 and 3.4).
 *
 * Life of an index (all calls return a tkv_status, none aborts):
 *
 *     tkv_rabitq_init(head_dim, tkv_rabitq_seed(base, layer, head), &ix);
 *     tkv_rabitq_set_centroids(ix, c_k, c_q);    // prefill means, then frozen
 *     tkv_rabitq_reserve(ix, n_prompt + 512);    // the only growth point
 *     tkv_rabitq_append_f16(ix, k_rows, head_dim, n);   // K rows of KV blocks;
 *                                                // lazily, a batch at a time
 *     per decode step and query head:
 *         tkv_rabitq_query_prepare(ix, q, 0, &qq);        // 0: eps0 = 3
 *         tkv_rabitq_estimate(ix, &qq, 0, n, est, bound); // est ~ q.k
 *         tkv_rabitq_select_topp(est, bound, n, &tp, work, work_bytes, pos, cap, &res);
 *     tkv_rabitq_free(ix);
 *
 * Only init and reserve allocate. query_prepare, estimate and get_arrays only
 * read the index: any number of threads may call them at once, as long as
 * no thread appends, reserves or sets centroids meanwhile.
 *
 * Kernels: scalar reference, AVX2 (+FMA, F16C) and AVX-512 (F/BW/VL/DQ +
 * VPOPCNTDQ), picked at init by __builtin_cpu_supports; the environment
 * variable TKV_RABITQ_FORCE=scalar|avx2|avx512 overrides the choice. All
 * variants give bit-identical codes, scalars, estimates and bounds.
 */
#ifndef TKV_RABITQ_H
#define TKV_RABITQ_H

#include "../policy/policy.h" /* struct tkv_range */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define TKV_RABITQ_MAX_DIM   512  /* padded head_dim limit                        */
#define TKV_RABITQ_MAX_WORDS (TKV_RABITQ_MAX_DIM / 64)
#define TKV_RABITQ_EPS0      3.0f /* default eps0: ~99.8% per-key coverage (spec 1.7) */

struct tkv_rabitq;

enum tkv_rabitq_isa {
    TKV_RABITQ_ISA_SCALAR = 0,
    TKV_RABITQ_ISA_AVX2   = 1,
    TKV_RABITQ_ISA_AVX512 = 2,
    TKV_RABITQ_ISA_COUNT  = 3,
};

/* ---- index ------------------------------------------------------------- */

/* A seed for the rotation of (layer, head), mixed from a base seed (splitmix64). */
uint64_t tkv_rabitq_seed(uint64_t base, uint32_t layer, uint32_t head);

/* Creates an empty index for keys of head_dim dimensions (1..512). Keys are
 * zero-padded to dim_pad = the next power of two >= max(head_dim, 64) (the
 * Walsh-Hadamard transform needs a power of two). The rotation is 3 rounds
 * of random +-1 signs then a Walsh-Hadamard transform, scaled to be
 * orthonormal; it depends only on seed. The kernels are chosen here
 * (TKV_RABITQ_FORCE: TKV_ERR_INVALID_ARG for an unknown name,
 * TKV_ERR_UNSUPPORTED when this CPU lacks it). The caller frees *out. */
tkv_status tkv_rabitq_init(uint32_t head_dim, uint64_t seed, struct tkv_rabitq **out);
void       tkv_rabitq_free(struct tkv_rabitq *ix); /* NULL: no-op */

/* Sets the key and query centroids c_k, c_q ([head_dim] each; NULL = zero,
 * the "no centering" ablation). Only on an empty index (codes depend on
 * c_k): TKV_ERR_INVALID_ARG otherwise; tkv_rabitq_reset empties it. Queries
 * prepared before are invalidated. */
tkv_status tkv_rabitq_set_centroids(struct tkv_rabitq *ix, const float *c_k, const float *c_q);

/* Makes room for n_keys keys in total (never shrinks). The only call that
 * grows the index: append does not allocate. */
tkv_status tkv_rabitq_reserve(struct tkv_rabitq *ix, uint32_t n_keys);

/* Encodes n keys, row r at k + r*row_stride (f16, head_dim values each;
 * row_stride in elements, >= head_dim), as keys size .. size+n-1. Needs the
 * centroids set and room reserved (TKV_ERR_TOO_SMALL naming the shortfall
 * otherwise). A non-finite key is TKV_ERR_INVALID_ARG naming its row, and
 * nothing of the batch is kept. */
tkv_status tkv_rabitq_append_f16(struct tkv_rabitq *ix, const uint16_t *k, size_t row_stride, uint32_t n);

/* Forgets all keys (capacity and centroids stay). */
void tkv_rabitq_reset(struct tkv_rabitq *ix);

uint32_t tkv_rabitq_size(const struct tkv_rabitq *ix);
uint32_t tkv_rabitq_capacity(const struct tkv_rabitq *ix);
/* Bytes the index holds: its struct, rotation signs and centroids, and the
 * per-key arrays at their reserved capacity (0 for NULL). */
size_t   tkv_rabitq_bytes(const struct tkv_rabitq *ix);

/* The encoded keys, borrowed: valid until the next reserve/reset/free.
 * With r = k - c_k and y = P r (P the rotation, dim_pad wide):
 *   code[i*words + w] bit j = [y_(64w+j) > 0]                (same order as the query planes)
 *   a[i]  = |r|^2 / |y|_1              the factor of X in the estimate (= |r| / (sqrt(dim_pad) alpha))
 *   e[i]  = |r| sqrt(1 - alpha^2) / alpha, alpha = |y|_1 / (sqrt(dim_pad) |r|)   (bound factor)
 *   t[i]  = c_q . k
 *   pc[i] = popcount of the code
 * (r = 0 gives a = e = 0: the estimate is then the exact cross terms). */
struct tkv_rabitq_arrays {
    const uint64_t *code; /* [n, words] */
    const float    *a;    /* [n] */
    const float    *e;    /* [n] */
    const float    *t;    /* [n] */
    const uint16_t *pc;   /* [n] */
    uint32_t n, words, dim, dim_pad;
    /* what an encoder elsewhere (the GPU's) needs to reproduce the codes */
    const float    *sign;      /* [3, dim_pad] the rotation's +-1 rounds */
    const float    *ck, *cq;   /* [dim_pad] centroids, zero past dim     */
    float           rot_scale; /* dim_pad^-3/2                            */
    double          cqck;      /* c_q . c_k, the query's add subtracts it  */
};
void tkv_rabitq_get_arrays(const struct tkv_rabitq *ix, struct tkv_rabitq_arrays *out);

/* y[dim_pad] = P x, x[head_dim] zero-padded (for tests and other backends:
 * the GPU encoder must reproduce it). */
tkv_status tkv_rabitq_rotate(const struct tkv_rabitq *ix, const float *x, float *y);

/* Which kernels an index runs; set_isa: TKV_ERR_UNSUPPORTED when this CPU
 * (or this build) lacks them. */
bool                tkv_rabitq_isa_supported(enum tkv_rabitq_isa isa);
const char         *tkv_rabitq_isa_name(enum tkv_rabitq_isa isa); /* "scalar", "avx2", "avx512" */
tkv_status          tkv_rabitq_set_isa(struct tkv_rabitq *ix, enum tkv_rabitq_isa isa);
enum tkv_rabitq_isa tkv_rabitq_get_isa(const struct tkv_rabitq *ix);

/* Running mean of rows, to make the centroids from prefill keys (f16, from
 * KV blocks) or queries (f32). Caller-owned, no allocation. f16 rows are
 * summed exactly (finite values in units of 2^-24, backend.h's
 * TKV_RABITQ_F16_UNITS; infinities and NaNs in the double sums), so their
 * mean does not depend on the order the rows come in: a backend's
 * rabitq_key_sums gives the same units (mean_add_units). f32 rows go into
 * the double sums in the order given. At most TKV_RABITQ_MEAN_MAX_ROWS
 * rows. */
struct tkv_rabitq_mean {
    uint32_t dim;
    uint64_t n;
    double   sum[TKV_RABITQ_MAX_DIM];
    int64_t  units[TKV_RABITQ_MAX_DIM];
};
tkv_status tkv_rabitq_mean_init(struct tkv_rabitq_mean *m, uint32_t dim);
tkv_status tkv_rabitq_mean_add_f16(struct tkv_rabitq_mean *m, const uint16_t *rows, size_t row_stride, uint32_t n);
tkv_status tkv_rabitq_mean_add_f32(struct tkv_rabitq_mean *m, const float *rows, size_t row_stride, uint32_t n);
/* n f16 rows (all finite) whose sums rabitq_key_sums made: units[dim] */
tkv_status tkv_rabitq_mean_add_units(struct tkv_rabitq_mean *m, const int64_t *units, uint64_t n);
/* out[dim] = the mean (zeros when no row was added). */
tkv_status tkv_rabitq_mean_get(const struct tkv_rabitq_mean *m, float *out);

/* ---- the device twin -------------------------------------------------------- */

/* An index's keys in backend memory, encoded and estimated by the backend's
 * rabitq_encode / rabitq_estimate ops (bit-identical to the CPU kernels):
 * on a GPU the index stays beside the KV it summarises. The rotation and
 * centroids are those of a host index (tkv_rabitq_set_centroids done),
 * which also prepares the queries. TKV_ERR_UNSUPPORTED when the backend
 * lacks the ops. */
struct tkv_rabitq_dev_index;
tkv_status tkv_rabitq_dev_create(struct tkv_backend *be, const struct tkv_rabitq *ix, uint32_t cap,
                                 struct tkv_rabitq_dev_index **out);
void       tkv_rabitq_dev_free(struct tkv_rabitq_dev_index *d); /* NULL: no-op */
uint32_t   tkv_rabitq_dev_size(const struct tkv_rabitq_dev_index *d);
/* Appends n keys from f16 rows in backend memory (row r at k + r*row_stride):
 * TKV_ERR_TOO_SMALL past the capacity, TKV_ERR_INVALID_ARG for a non-finite
 * key (nothing of the batch kept). */
tkv_status tkv_rabitq_dev_append(struct tkv_rabitq_dev_index *d, const uint16_t *k, size_t row_stride, uint32_t n);
/* The same for the rows of every span in order (backend.h: struct
 * tkv_rabitq_span; e.g. one per KV block of a range), in one backend call
 * with one wait; the keys as one dev_append per span would make them. A
 * non-finite key: TKV_ERR_INVALID_ARG naming its key index (= position when
 * the index holds positions 0, 1, ...), span and row; none of the spans kept. */
tkv_status tkv_rabitq_dev_append_spans(struct tkv_rabitq_dev_index *d, const struct tkv_rabitq_span *spans,
                                       uint32_t n_spans, size_t row_stride);
/* est / bound (backend memory, bound may be NULL) for keys first .. first+n-1
 * with a query prepared by the host index d was created from. */
tkv_status tkv_rabitq_dev_estimate(const struct tkv_rabitq_dev_index *d, const struct tkv_rabitq_query *q,
                                   uint32_t first, uint32_t n, float *est, float *bound);
/* The arrays in backend memory (tests download and compare them). */
const struct tkv_rabitq_dev *tkv_rabitq_dev_arrays(const struct tkv_rabitq_dev_index *d);
/* Bytes of backend memory the twin holds (0 for NULL). */
size_t     tkv_rabitq_dev_bytes(const struct tkv_rabitq_dev_index *d);

/* The ops on arrays in host memory, with this CPU's kernels: the CPU
 * backend's rabitq_encode / rabitq_estimate. */
tkv_status tkv_rabitq_host_encode(const struct tkv_rabitq_dev *d, const struct tkv_rabitq_span *spans,
                                  uint32_t n_spans, size_t row_stride, uint32_t at);
/* rabitq_encode's refusal (every backend words it alike): key at + row, the
 * row-th of the spans' rows, is not finite. Returns TKV_ERR_INVALID_ARG. */
tkv_status tkv_rabitq_encode_error(const struct tkv_rabitq_span *spans, uint32_t n_spans, uint32_t at, uint32_t row);
tkv_status tkv_rabitq_host_estimate(const struct tkv_rabitq_dev *d, const struct tkv_rabitq_query *q, uint32_t first,
                                    uint32_t n, float *est, float *bound);

/* A group query (GQA handling (b) of the spec, 3.7): out[i] = the mean of
 * the n rows' i-th values, row j at q + j * stride (dim values each),
 * summed in row order in f32 (one rounding per add) and divided once by n
 * (IEEE: correctly rounded, so rabitq_prepare on any backend forms the
 * same bits). n <= 1 copies the first row. out may not alias q. */
void tkv_rabitq_query_mean(const float *q, size_t stride, uint32_t n, uint32_t dim, float *out);

/* The reference of the backend op rabitq_prepare (backend.h), on arrays and
 * queries in host memory: per item tkv_rabitq_query_prepare with the twin's
 * rotation and centroids, its first fields copied to out[i]; a refused
 * query poisoned and *bad set as the op does. TKV_ERR_INVALID_ARG for bad
 * arguments (eps0, a NULL pointer, a twin's dim_pad); never for a query. */
tkv_status tkv_rabitq_host_prepare(const struct tkv_rabitq_prepare_args *a);

/* A prepared query's fields as backend memory holds them (the first fields
 * of struct tkv_rabitq_query, byte for byte), and back: to_dev copies them,
 * from_dev also sets ix and gen (what tkv_rabitq_estimate checks) from ix. */
void tkv_rabitq_query_to_dev(const struct tkv_rabitq_query *q, struct tkv_rabitq_dev_query *out);
void tkv_rabitq_query_from_dev(const struct tkv_rabitq_dev_query *q, const struct tkv_rabitq *ix,
                               struct tkv_rabitq_query *out);
/* The poisoned query rabitq_prepare writes for a refused one (backend.h). */
void tkv_rabitq_query_poison(uint32_t dim_pad, float eps0, struct tkv_rabitq_dev_query *out);

/* The reference of the backend op rabitq_select (backend.h), on arrays in
 * host memory: per head and query head tkv_rabitq_host_estimate then
 * tkv_rabitq_select_topp, the sets ORed into the bitmap, widened to whole
 * blocks. A non-finite estimate gives n_chosen = UINT32_MAX, mass NaN and
 * every key of the head, as the device does. Allocates its scratch per
 * call (tests, and test backends standing in for a device). */
tkv_status tkv_rabitq_host_select(const struct tkv_rabitq_select_args *a);

/* Its pieces, for a backend that runs them its own way (the CPU backend: a
 * (head, query head) pair per task on its threads):
 *   select_check  the arguments (outputs, G, p, scale and extra_lse, each
 *                 head's keys, forced ranges and host queries' widths, the
 *                 bitmap width: every backend's op calls it); *n_max the
 *                 most keys of a head;
 *   select_pair   query head j of head h: estimates and top-p in scratch
 *                 (tkv_rabitq_select_pair_bytes(n) for a head of n keys,
 *                 8-byte aligned), the positions ORed into row (a
 *                 non-finite estimate: every key), n_chosen and mass written
 *                 where the args have them;
 *   select_row    head h's row of the output bitmap;
 *   select_widen  row widened to whole groups of a->whole positions (0: as it is). */
tkv_status tkv_rabitq_select_check(const struct tkv_rabitq_select_args *a, const char *who, uint32_t *n_max);
size_t     tkv_rabitq_select_pair_bytes(uint32_t n);
tkv_status tkv_rabitq_select_pair(const struct tkv_rabitq_select_args *a, uint32_t h, uint32_t j, void *scratch,
                                  uint32_t *row);
uint32_t  *tkv_rabitq_select_row(const struct tkv_rabitq_select_args *a, uint32_t h);
void       tkv_rabitq_select_widen(const struct tkv_rabitq_select_args *a, uint32_t h, uint32_t *row);

/* ---- query and estimate --------------------------------------------------- */

/* A query prepared for one index: u' = P (q - c_q), quantized as
 * u'_i ~ vl + delta * qb_i, qb_i in 0..15 (nearest, half up). Caller-owned
 * (stack is fine); only valid with the index and centroids it came from. */
struct tkv_rabitq_query {
    uint64_t plane[4][TKV_RABITQ_MAX_WORDS]; /* bit j of qb, packed like the codes */
    float    delta, vl;
    int32_t  sum_q;             /* sum of qb_i                                     */
    float    add;               /* q.c_k - c_q.c_k, part of every estimate         */
    float    norm;              /* |q - c_q|                                       */
    float    bound_u, bound_w;  /* bound_k^2 = e_k^2 bound_u + a_k^2 bound_w       */
    float    eps0;
    uint32_t words, dim_pad, gen;
    const struct tkv_rabitq *ix;
};

/* Prepares q[head_dim] (f32, post-RoPE) with error-bound width eps0 (0 =
 * TKV_RABITQ_EPS0). TKV_ERR_INVALID_ARG for a non-finite q, a q whose
 * centred rotation overflows (|q - c_q| near FLT_MAX), or eps0 < 0; *out is
 * then untouched. */
tkv_status tkv_rabitq_query_prepare(const struct tkv_rabitq *ix, const float *q, float eps0,
                                    struct tkv_rabitq_query *out);

/* For keys first .. first+n-1: est[i] ~ q.k (unscaled logit) and, when
 * bound != NULL, bound[i] such that |q.k - est[i]| <= bound[i] with high
 * probability over the rotation (eps0 = 3: ~99.8% of keys):
 *   X       = delta (2 ip - sum_q) + vl (2 pc - dim_pad),  ip = sum_j 2^j popc(code & plane_j)
 *   est     = a X + t + add
 *   bound^2 = eps0^2 (e^2 |u'|^2 / (dim_pad - 1) + a^2 delta^2 dim_pad / 12)
 * (the second term covers the 4-bit query). */
tkv_status tkv_rabitq_estimate(const struct tkv_rabitq *ix, const struct tkv_rabitq_query *q, uint32_t first,
                               uint32_t n, float *est, float *bound);

/* ---- top-p selection -------------------------------------------------------- */

struct tkv_rabitq_topp_params {
    float    p;         /* attention mass to keep, (0, 1]                                 */
    float    scale;     /* logit = scale * q.k: usually 1/sqrt(head_dim)                  */
    float    extra_lse; /* log sum exp(logit) over forced tokens that have no estimate
                           (exact logits of the sinks and tail outside est), so that p
                           is a fraction of the whole softmax; -INFINITY: normalise over
                           the estimated keys (and forced ones among them) only           */
    uint32_t pos0;      /* position of est[0]                                             */
    const struct tkv_range *forced; /* ascending, disjoint position ranges always kept:
                                       sinks, the not-yet-encoded tail                    */
    uint32_t n_forced;
    uint32_t max_keep;  /* at most this many keys chosen besides the forced; 0 = no cap   */
    bool     coarse;    /* keep the boundary bin whole (below)                            */
};

struct tkv_rabitq_topp_result {
    uint32_t n_pos;    /* positions written (or needed, with TKV_ERR_TOO_SMALL)              */
    uint32_t n_chosen; /* of those, chosen from the estimates (not forced)                    */
    double   mass;     /* plain: the estimated kept fraction; safe: its lower bound            */
};

/* Bytes of work memory select_topp needs for n estimates. */
size_t tkv_rabitq_topp_work_bytes(uint32_t n);

/* Writes to pos[] the ascending positions of the forced ranges and of the
 * fewest estimated keys that reach the target:
 *   bound == NULL (plain top-p): estimated softmax mass of the kept set >= p;
 *   bound != NULL (safe top-p): with every true logit within est +- bound,
 *     the kept set's true mass is >= p for sure: the lower bound
 *     sum_S e^(s-d) / (sum_S e^(s-d) + sum_notS e^(s+d)) >= p (s, d scaled).
 *     Keys go in by decreasing (1-p) e^(s-d) + p e^(s+d), which minimises
 *     the count.
 * Ties are broken by position. With max_keep the target may be missed (see
 * res->mass). coarse: the search's boundary bin (TKV_RABITQ_TOPP_BINS of
 * 1/TKV_RABITQ_TOPP_BPN nat below the largest log-value, backend.h) is kept
 * whole instead of up to its last key needed: a superset that also meets
 * the target, larger by the candidates within one bin of the boundary, and
 * on a GPU two kernels fewer (unless max_keep ends the search in that bin:
 * then as without). The last bin holds every log-value 64 nats or more
 * below the largest: a boundary there (log-values spread that wide, as the
 * safe mode's bounds can make them) keeps all of those keys.
 * TKV_ERR_TOO_SMALL (res->n_pos = the count needed) when cap is short; work: tkv_rabitq_topp_work_bytes(n) bytes, 8-byte aligned.
 *
 * Kernels: as the index's (TKV_RABITQ_FORCE honoured, chosen at the first
 * call). The SIMD variants compute the exponentials and logarithms with
 * their own polynomials (within a few ulp of libm's, which the scalar
 * reference calls): l, u and the masses agree to ~1e-7 relative, the
 * order of plain top-p is the same, and a set may differ from the
 * reference's by the keys whose rule sits on a rounding tie. */
tkv_status tkv_rabitq_select_topp(const float *est, const float *bound, uint32_t n,
                                  const struct tkv_rabitq_topp_params *params, void *work, size_t work_bytes,
                                  uint32_t *pos, uint32_t cap, struct tkv_rabitq_topp_result *res);
/* The same with one variant's kernels (TKV_ERR_UNSUPPORTED where this CPU
 * or build lacks it): tests and benchmarks compare them. */
tkv_status tkv_rabitq_select_topp_isa(enum tkv_rabitq_isa isa, const float *est, const float *bound, uint32_t n,
                                      const struct tkv_rabitq_topp_params *params, void *work, size_t work_bytes,
                                      uint32_t *pos, uint32_t cap, struct tkv_rabitq_topp_result *res);

#endif /* TKV_RABITQ_H */
