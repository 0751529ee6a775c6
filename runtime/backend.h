/*
 * backend.h -- the interface every compute backend implements (cpu/, gpu/).
 *
 * The forward pass (runtime/engine.c) is written once against this vtable.
 * All float/half pointers passed to ops are in the backend's own memory
 * (host memory for the CPU backend, device memory for CUDA), allocated with
 * ops->alloc; index arrays marked "host" are always in host memory. Ops may
 * run asynchronously; ops->synchronize waits for all of them, download()
 * implies it. Every op returns a tkv_status and never aborts.
 *
 * Layouts: activations are row-major [n_tokens, width] f32. Q/K/V rows hold
 * heads side by side: q[t, h*head_dim + d]. KV blocks (tiers/kv-store.h)
 * hold B tokens of one (layer, KV head): K and V each [B, head_dim] f16.
 */
#ifndef TKV_BACKEND_H
#define TKV_BACKEND_H

#include "gguf.h"

struct tkv_backend;
struct tkv_bweight; /* a weight tensor prepared by a backend (opaque) */

/* One block of KV for one (layer, KV head), in backend memory. */
struct tkv_kv_block_ref {
    uint16_t *k;      /* [B, head_dim] f16 */
    uint16_t *v;      /* [B, head_dim] f16 */
    int32_t   pos0;   /* position of row 0; rows hold pos0 .. pos0+n-1 */
    uint32_t  n;      /* valid rows */
};

/* The keys one KV head attends to: a list of blocks, in position order. */
struct tkv_kv_head_view {
    const struct tkv_kv_block_ref *blocks;
    uint32_t n_blocks;
};

/* Attention of n_q query tokens over a KV view, grouped-query:
 * query head h reads KV head h / (n_head / n_head_kv). Causal: query t at
 * position q_pos[t] sees keys with position <= q_pos[t]. */
struct tkv_attn_args {
    const float   *q;          /* [n_q, n_head*head_dim]                      */
    const int32_t *q_pos;      /* host [n_q], non-decreasing                  */
    float         *out;        /* [n_q, n_head*head_dim]                      */
    float         *lse;        /* optional [n_q, n_head]: log-sum-exp of the
                                  scaled scores, to merge partial attentions  */
    uint32_t n_q, n_head, n_head_kv, head_dim;
    float    scale;            /* usually 1/sqrt(head_dim)                    */
    const struct tkv_kv_head_view *kv; /* host [n_head_kv]                   */
    /* kv_dev: the views' block arrays (kv[g].blocks) are in BACKEND memory
     * (the decode table kv_table wrote), their counts in kv[g].n_blocks, no
     * entry of n = 0; every K/V row 16-byte aligned where head_dim % 8 == 0
     * (the store's slots are). */
    bool kv_dev;
    /* kv_dev_n (with kv_dev, or NULL): head g's entry count is
     * min(kv[g].n_blocks, kv_dev_n[g * kv_dev_n_stride]), read from BACKEND
     * memory when the work queued before this call has run -- a decode
     * table's counts the host has not brought down (engine.c, table_layer);
     * kv[g].n_blocks is then a bound, for planning, with that many entries
     * of kv[g].blocks addressable. Every backend honours it. */
    const uint32_t *kv_dev_n;
    uint32_t kv_dev_n_stride;
    /* kv_dev_keys (with kv_dev_n, or NULL): head g's key count at
     * kv_dev_keys[g * kv_dev_n_stride] (BACKEND memory, like kv_dev_n), a
     * hint for sharing the call's work among the heads by their keys (the
     * CUDA decode kernel's pool, docs/gpu.md); what the call computes never
     * depends on it, and a backend may ignore it. */
    const uint32_t *kv_dev_keys;
};

/* KV head g's entry count in a: kv[g].n_blocks, or the count kv_dev_n
 * holds where that is smaller -- read through a->kv_dev_n, so for backends
 * whose memory the host reads (the CPU's). */
static inline uint32_t tkv_attn_head_blocks(const struct tkv_attn_args *a, uint32_t g)
{
    const uint32_t n = a->kv[g].n_blocks;
    if (!a->kv_dev_n)
        return n;
    const uint32_t c = a->kv_dev_n[(size_t)g * a->kv_dev_n_stride];
    return c < n ? c : n;
}

/* Attention statistics the KV policies score keys with (runtime/policy/):
 * one call covers every KV head of a layer. The queries are in backend
 * memory, or in host memory with q_host (the policies' observation windows
 * live on the host; the backend copies them), the KV view's blocks in
 * backend memory (host array of device pointers, as for attention); the
 * outputs are HOST memory and are written when the op returns (the CUDA
 * backend waits for its stream). Each KV head's view must
 * hold its blocks in position order and cover the positions the statistic
 * reads without gaps (the layer's whole view, as the engine passes it):
 * [0, n_blocks*block) for SEGMENT, [0, n_past) for WINDOW.
 *
 * TKV_ATTN_STATS_SEGMENT -- CritiPrefill/EntropyInfer's block distribution
 *   of a prefill segment (tkv_segment_block_probs, tkv_entropy): the n_q
 *   queries are positions [n_past - n_q, n_past); candidate key blocks are
 *   the n_blocks = (n_past - n_q) / block whole `block`-token blocks before
 *   the segment. Per KV head g: P[g][j] = softmax_j of the group mean of
 *   max(qmid.kmax_j, qmid.kmin_j) (midrange query per query head, element-
 *   wise max/min keys of block j, unscaled), and H[g] = -sum P ln(P + 1e-9).
 * TKV_ATTN_STATS_WINDOW -- SnapKV's scores (tkv_policy_window_scores, then
 *   tkv_policy_pool): per KV head g, for every position j < n_prefix, the
 *   softmax probability (scale 1/sqrt(head_dim), over all keys < n_past,
 *   causal by q_pos) the n_q window queries of the group's query heads put
 *   on key j, divided by n_q*G; then 1-D max ('m') or average ('a') pooling
 *   with kernel `pool` (odd, zero padding; 0 or 1: none). */
enum tkv_attn_stats_kind {
    TKV_ATTN_STATS_SEGMENT = 1,
    TKV_ATTN_STATS_WINDOW = 2,
};

struct tkv_attn_stats_args {
    enum tkv_attn_stats_kind kind;
    const float   *q;          /* [n_q, n_head*head_dim] post-RoPE queries          */
    bool           q_host;     /* q is in host memory, not backend memory            */
    const int32_t *q_pos;      /* host [n_q]: WINDOW's causal mask (SEGMENT: unused) */
    uint32_t n_q, n_head, n_head_kv, head_dim;
    uint32_t n_past;           /* keys at positions < n_past exist                   */
    const struct tkv_kv_head_view *kv; /* host [n_head_kv]                          */
    /* SEGMENT */
    uint32_t block;            /* key block tokens (EntropyInfer 8, CritiPrefill 32) */
    float   *probs;            /* host [n_head_kv][probs_stride] P, or NULL          */
    uint32_t probs_stride;     /* floats per head row, >= n_blocks                   */
    double  *entropy;          /* host [n_head_kv] H in nats, or NULL                */
    /* WINDOW */
    uint32_t n_prefix;         /* scores for positions [0, n_prefix)                 */
    uint32_t pool;             /* pooling kernel (odd), 0 or 1: none                 */
    char     pool_kind;        /* 'm' max, 'a' average                               */
    float   *scores;           /* host [n_head_kv][n_prefix]                         */
};

/* Checks a's shape and pointers (TKV_ERR_INVALID_ARG naming the field) and
 * returns in *n_blocks the SEGMENT block count (0 for WINDOW). */
tkv_status tkv_attn_stats_check(const struct tkv_attn_stats_args *a, uint32_t *n_blocks);

/* RaBitQ keys in backend memory: the device twin of an index
 * (runtime/rabitq/rabitq.h has the math and the layout; rabitq-dev.c owns
 * these arrays). */
struct tkv_rabitq_query; /* runtime/rabitq/rabitq.h */
struct tkv_rabitq_dev {
    uint32_t dim, dim_pad, words; /* head_dim, its padding, dim_pad / 64        */
    float    rot_scale;
    const float *sign;            /* [3, dim_pad]                                */
    const float *ck, *cq;         /* [dim_pad] centroids                         */
    double   cqck;                /* c_q . c_k (host value; rabitq_prepare's add) */
    uint64_t *code;               /* [cap, words]                                */
    float    *a, *e, *t;          /* [cap]                                       */
    uint16_t *pc;                 /* [cap]                                       */
};

/* A prepared query in backend memory: what rabitq_prepare writes and
 * rabitq_select reads. Its fields, in this order and with these bytes, are
 * the first ones of struct tkv_rabitq_query (runtime/rabitq/rabitq.h; the
 * host's ix and gen follow there), and rabitq_prepare writes the bytes
 * tkv_rabitq_query_prepare writes (planes past `words` zero). A query that
 * tkv_rabitq_query_prepare refuses (q not finite, or its rotation
 * overflowing) is written poisoned instead: planes and sum_q 0, delta, vl,
 * add, norm, bound_u and bound_w the quiet NaN 0x7fc00000 (every estimate
 * with it is NaN, so rabitq_select reads its head whole), eps0, words and
 * dim_pad as for any query. */
#define TKV_RABITQ_DEV_QUERY_WORDS 8 /* = TKV_RABITQ_MAX_WORDS */
struct tkv_rabitq_dev_query {
    uint64_t plane[4][TKV_RABITQ_DEV_QUERY_WORDS];
    float    delta, vl;
    int32_t  sum_q;
    float    add, norm, bound_u, bound_w, eps0;
    uint32_t words, dim_pad;
};

/* One layer's queries prepared on the backend (rabitq_prepare), straight
 * from the step's q in backend memory: item i is query head items[i].head,
 * f32 row q + head * head_stride (ix->dim values), prepared for index twin
 * items[i].ix as tkv_rabitq_query_prepare(host index, row, eps0) prepares it
 * (bit-identical), written to out[i]. With rows > 1 the item is a group
 * query: the mean of the rows of heads head .. head + rows - 1 as
 * tkv_rabitq_query_mean forms it (runtime/rabitq/rabitq.h), prepared. */
struct tkv_rabitq_prepare_item {
    const struct tkv_rabitq_dev *ix; /* the twin (its rotation, centroids, cqck) */
    uint32_t head;                   /* query head: the row of q                  */
    uint32_t rows;                   /* 0 or 1: that row; > 1: the rows' mean     */
};
struct tkv_rabitq_prepare_args {
    const float *q;                             /* backend memory                        */
    size_t   head_stride;                       /* floats from one head's row to the next */
    const struct tkv_rabitq_prepare_item *items; /* host [n]                              */
    uint32_t n;
    float    eps0;                              /* >= 0, 0: TKV_RABITQ_EPS0              */
    struct tkv_rabitq_dev_query *out;           /* backend memory [n]                    */
    /* backend memory, or NULL: set to the first i whose query was refused
     * (poisoned), else UINT32_MAX; valid once the queued work has run (the
     * caller reads it at its next wait, e.g. with rabitq_select's results) */
    uint32_t *bad;
};

/* n consecutive keys' f16 rows in backend memory, row r at k + r * row_stride
 * (e.g. the part of one KV block an encode covers). */
struct tkv_rabitq_span {
    const uint16_t *k;
    uint32_t        n;
};

/* A finite f16 h is TKV_RABITQ_F16_UNITS(h) units of 2^-24 (an integer of
 * magnitude below 2^40: the exponent field e > 0 gives (1024 + mantissa)
 * << (e - 1), e = 0 the mantissa); so TKV_RABITQ_MEAN_MAX_ROWS of them sum
 * exactly, in any order, in an int64_t. Not for infinities and NaNs
 * (exponent field 31). Host and device code alike. */
#define TKV_RABITQ_F16_UNITS(h)                                                                                    \
    ((int64_t)(((h) >> 10 & 31) ? (int64_t)(1024 + ((h) & 1023)) << (((h) >> 10 & 31) - 1) : (int64_t)((h) & 1023)) * \
     (((h) & 0x8000) ? -1 : 1))
#define TKV_RABITQ_F16_FINITE(h)  (((h) & 0x7c00) != 0x7c00)
#define TKV_RABITQ_MEAN_MAX_ROWS (1ull << 23)

/* One layer's RaBitQ top-p selection on the backend (rabitq_select), for
 * the KV heads a policy selects. Per head h and each of its G query heads
 * j: every key 0 .. n-1 of the head's twin estimated as rabitq_estimate
 * does (bit-identical), top-p over them as tkv_rabitq_select_topp with
 * pos0 = 0, the head's forced ranges, p, scale, extra_lse, coarse,
 * max_keep = 0 and the bounds when safe; the G kept sets ORed, forced
 * keys included, widened to whole blocks of `whole` positions when whole
 * > 0 (blocks start at 0).
 * What the device guarantees, and where it may differ from the host's
 * select_topp (rounding at the boundary): docs/rabitq.md, "Device top-p". */
#define TKV_RABITQ_SELECT_MAX_G      8
#define TKV_RABITQ_SELECT_MAX_FORCED 4
#define TKV_RABITQ_SELECT_MAX_N      (1u << 23) /* keys per head (fixed-point sums stay < 2^64) */
/* The histogram both top-p implementations search (tkv_rabitq_select_topp and
 * the device's): TKV_RABITQ_TOPP_BINS bins of 1/TKV_RABITQ_TOPP_BPN nat below
 * the largest log-value, the last taking everything lower (64 nats cut apart
 * in 1024). The bins only narrow the search: the kept set is the shortest
 * prefix in log-value order that meets the rule, whatever the bins (but
 * with coarse, which keeps the boundary bin whole). Fewer,
 * wider bins make the device's histogram cheaper (a block's bins sit in
 * shared memory and are flushed with global atomics) and the boundary bin,
 * which is refined key by key, larger. */
#define TKV_RABITQ_TOPP_BINS 1024
#define TKV_RABITQ_TOPP_BPN  16
struct tkv_rabitq_select_head {
    const struct tkv_rabitq_dev   *ix; /* the head's twin (arrays in backend memory) */
    const struct tkv_rabitq_query *q;  /* host [G]: the group's prepared queries, or
                                          NULL with q_dev                             */
    const struct tkv_rabitq_dev_query *q_dev; /* backend [G]: the queries prepared on the
                                          backend for this twin (rabitq_prepare), read
                                          in stream order; used when q is NULL        */
    uint32_t n;                        /* keys 0 .. n-1, position = key index, >= 1   */
    uint32_t n_forced;                 /* <= TKV_RABITQ_SELECT_MAX_FORCED              */
    uint32_t row;                      /* with bitmap_dev: the row of bitmap_dev this
                                          head's bits go to (the heads' rows distinct,
                                          < n_rows); ignored with bitmap             */
    struct tkv_rabitq_select_range { uint32_t begin, end; } forced[TKV_RABITQ_SELECT_MAX_FORCED];
                                       /* ascending, disjoint, within [0, n)           */
};
struct tkv_rabitq_select_args {
    const struct tkv_rabitq_select_head *heads; /* host [n_heads]                      */
    uint32_t n_heads, G;                        /* G: 1 .. TKV_RABITQ_SELECT_MAX_G      */
    float    p, scale, extra_lse;               /* as tkv_rabitq_topp_params            */
    bool     safe;                              /* with the bounds: safe top-p          */
    bool     coarse;                            /* the boundary bin whole, as
                                                   tkv_rabitq_topp_params.coarse        */
    uint32_t whole;                             /* > 0: widen to blocks of this many    */
    /* outputs, HOST memory, written when the op returns (one download):
     * bitmap[h * words + w] bit b = position 32 w + b of head h kept (bits at
     * or past n are 0); n_chosen[h * G + j], mass[h * G + j] as
     * tkv_rabitq_topp_result's n_chosen and mass for query head j of head h
     * (n_chosen = UINT32_MAX: a non-finite estimate; the head's bitmap is
     * then every key). n_chosen and mass may be NULL. */
    uint32_t *bitmap;
    uint32_t  words;                            /* >= (max n + 31) / 32                 */
    /* or, exactly one of the two non-NULL: the bitmaps left in BACKEND
     * memory, [n_rows][words], head h's in row heads[h].row (rows no head
     * names are not written), in stream order -- nothing of them comes down
     * (a kv_table queued later reads them; docs/rabitq.md, "Device page
     * table and decode table"). n_chosen and mass still come down where
     * given; with both NULL nothing does and the op need not wait (a head
     * with a non-finite estimate has every key in its row). */
    uint32_t *bitmap_dev;
    uint32_t  n_rows;
    uint32_t *n_chosen;
    double   *mass;
};

/* Checks the outputs of a (bitmap or bitmap_dev, bitmap_dev's rows:
 * TKV_ERR_INVALID_ARG naming the field and the head, `who` first in the
 * message); every backend's rabitq_select calls it. */
tkv_status tkv_rabitq_select_check_out(const struct tkv_rabitq_select_args *a, const char *who);

/* One layer's decode attention table built on the backend from a selection
 * and the KV store's device page table (kv_table; docs/rabitq.md, "Decode
 * without a host round trip per layer"), so that the host need not read the
 * bitmaps. Per KV head h of n_heads, with B = block_tokens:
 *   - the positions read are those p < sel_n[h] whose bit is set in row h of
 *     the bitmap (bit p % 32 of bitmap[h * words + p / 32], rabitq_select's
 *     layout) and every p in [sel_n[h], n_past): the tail of keys not
 *     indexed yet, this step's own included (sel_n[h] = 0: the head reads
 *     everything);
 *   - they are cut as the engine cuts ranges into block references: each
 *     maximal run of read positions inside one block b (positions
 *     [b*B, b*B + B)) is one slice {pos0 = its first position, n = its
 *     length};
 *   - a slice of a block whose page-table entry e = ptab[h * ptab_stride + b]
 *     is not 0 (the block is resident: e is the address of its K, its V
 *     follows B*head_dim f16 later, as in a compute slot) goes to
 *     refs[h * cap ..] with k = e + (pos0 - b*B) * head_dim f16 and v
 *     likewise; a slice of a block whose entry is 0 goes to miss[h * cap ..]
 *     with k = v = NULL (the host recalls those blocks, or reads them where
 *     they are). Both lists in position order.
 *   - counts[4h] and counts[4h + 1] receive the number of slices of refs and
 *     of miss, the whole number even past cap: slices past cap are not
 *     written, and a count > cap tells the caller the table overflowed;
 *     counts[4h + 2] the positions read and counts[4h + 3] the blocks with
 *     at least one (resident or not: what the head's read touches);
 *   - where marks is given, bit b % 32 of marks[h * mark_words + b / 32] is
 *     set if block b is one of those touched, clear if not, for every
 *     b < nb = ceil(n_past / B) -- words [0, ceil(nb / 32)) of each row are
 *     written whole, the words past them left as they were (the KV store's
 *     read marks: a block read in place on the device is not stale,
 *     tkv_kvs_mark_reads).
 * The refs' layout is struct tkv_kv_block_ref's, as the attention op takes
 * it. Queued like the other ops; the caller downloads counts (and the short
 * miss lists) when it needs them. */
struct tkv_kv_table_args {
    const uint32_t *bitmap;        /* backend [n_heads][words], or NULL when every sel_n is 0 */
    uint32_t words;                /* >= (max sel_n + 31) / 32                        */
    const uint32_t *sel_n;         /* host [n_heads]: <= n_past, <= 32 * words         */
    const uint64_t *ptab;          /* backend: head h's row at ptab + h * ptab_stride,
                                      entries for blocks [0, (n_past + B - 1) / B)     */
    uint32_t ptab_stride;          /* entries per head row                            */
    uint32_t n_heads, block_tokens, head_dim, n_past;
    struct tkv_kv_block_ref *refs; /* backend [n_heads][cap]                          */
    struct tkv_kv_block_ref *miss; /* backend [n_heads][cap]                          */
    uint32_t cap;
    uint32_t *counts;              /* backend [n_heads][4]                            */
    uint32_t *marks;               /* backend [n_heads][mark_words], or NULL          */
    uint32_t mark_words;           /* >= ceil(ceil(n_past / block_tokens) / 32)       */
};

/* Checks a's shape and pointers (TKV_ERR_INVALID_ARG naming the field and
 * the head); every backend's kv_table calls it first. */
tkv_status tkv_kv_table_check(const struct tkv_kv_table_args *a);
/* The reference kv_table on host memory (every pointer of a is a host
 * pointer; the page-table entries are only copied and offset, never read
 * through): the CPU backend's op, and what the tests compare the device's
 * with. Position by position, as the contract above reads. */
tkv_status tkv_kv_table_ref(const struct tkv_kv_table_args *a);

/* What a profiling backend measured per op (profile_read). An op's device
 * time is the time between two events queued around its work on the
 * backend's compute stream; ops that queue nothing there (or wait only)
 * have dev_s < 0. */
struct tkv_op_profile_row {
    const char *name;  /* "rmsnorm", "matmul 1024x4096 gemv" (n_out x n_in), ... */
    uint64_t calls;
    double   host_s;   /* wall time inside the op's calls (host clock)         */
    double   dev_s;    /* device time of its work; < 0: not timed              */
};
struct tkv_op_profile {
    const struct tkv_op_profile_row *rows;
    uint32_t n_rows;
    double   host_wall_s; /* host clock from the first op's entry to the last op's exit */
    double   dev_span_s;  /* device clock from the first timed op's start to the last one's end */
    double   dev_busy_s;  /* sum of the rows' dev_s: busy / span is the device's busy fraction */
};

/* Prints p to stderr as a Markdown table (rows by device time, largest
 * first) under `label`; steps > 0 adds per-step columns. */
void tkv_op_profile_print(const char *label, const struct tkv_op_profile *p, uint32_t steps);

/* upload_fence / upload_wait: every upload queued so far */
#define TKV_UPLOADS_ALL UINT64_MAX

struct tkv_backend_ops {
    const char *name;
    void (*free)(struct tkv_backend *b);

    /* memory in the backend's address space */
    tkv_status (*alloc)(struct tkv_backend *b, size_t bytes, void **out);
    void       (*release)(struct tkv_backend *b, void *p);
    tkv_status (*upload)(struct tkv_backend *b, void *dst, const void *src_host, size_t bytes);
    tkv_status (*download)(struct tkv_backend *b, void *dst_host, const void *src, size_t bytes);
    tkv_status (*synchronize)(struct tkv_backend *b);
    /* optional (NULL on the CPU, whose memory is the host's: memcpy):
     * dst = src, bytes, both in backend memory, queued like the ops; what
     * bench-decode measures the memory's bandwidth with */
    tkv_status (*copy)(struct tkv_backend *b, void *dst, const void *src, size_t bytes);

    /* weights: t's data stays mapped for the lifetime of the weight */
    tkv_status (*weight_init)(struct tkv_backend *b, const struct tkv_gguf_tensor *t, struct tkv_bweight **out);
    void       (*weight_free)(struct tkv_backend *b, struct tkv_bweight *w);

    /* out[i, :] = row ids[i] of w (embedding lookup), ids in host memory */
    tkv_status (*get_rows)(struct tkv_backend *b, const struct tkv_bweight *w, const int32_t *ids,
                           uint32_t n, float *out);
    /* y[n, n_out] = x[n, n_in] . w^T, for w of GGUF shape [n_in, n_out] */
    tkv_status (*matmul)(struct tkv_backend *b, const struct tkv_bweight *w, const float *x, float *y, uint32_t n);
    /* y[n, dim] = x / sqrt(mean(x^2) + eps) * w  (y may alias x) */
    tkv_status (*rmsnorm)(struct tkv_backend *b, const float *x, const struct tkv_bweight *w, float *y,
                          uint32_t n, uint32_t dim, float eps);
    /* In place on x[n, n_heads*head_dim]: rotate adjacent pairs (2i, 2i+1),
     * i < rot_dim/2, by angle pos*freq_scale*base^(-2i/rot_dim) (GGUF/ggml
     * "normal" RoPE). pos in host memory. */
    tkv_status (*rope)(struct tkv_backend *b, float *x, uint32_t n, uint32_t n_heads, uint32_t head_dim,
                       uint32_t rot_dim, const int32_t *pos, float base, float freq_scale);
    /* out = silu(gate) * up, count elements (out may alias gate) */
    tkv_status (*swiglu)(struct tkv_backend *b, const float *gate, const float *up, float *out, size_t count);
    /* y += x, count elements */
    tkv_status (*add)(struct tkv_backend *b, float *y, const float *x, size_t count);
    /* dst[r, :] = f16(src[r*src_stride + :head_dim]) for r < n_rows */
    tkv_status (*kv_write)(struct tkv_backend *b, const float *src, size_t src_stride, uint16_t *dst,
                           uint32_t n_rows, uint32_t head_dim);
    tkv_status (*attention)(struct tkv_backend *b, const struct tkv_attn_args *a);
    /* optional: kv_write for every KV head of a chunk in one call (a decode
     * step's 2 * n_heads row writes per layer as one launch): for h < n_heads,
     * r < n_rows, d < head_dim
     *     kdst[h][r*head_dim + d] = f16(k[r*stride + h*head_dim + d])
     *     vdst[h][r*head_dim + d] = f16(v[r*stride + h*head_dim + d])
     * rounded as kv_write. kdst, vdst: host arrays [n_heads] of backend
     * pointers; no destination overlaps another or a source. NULL: callers
     * call kv_write per head (the result is the same). */
    tkv_status (*kv_write_heads)(struct tkv_backend *b, const float *k, const float *v, size_t stride,
                                 uint16_t *const *kdst, uint16_t *const *vdst, uint32_t n_heads, uint32_t n_rows,
                                 uint32_t head_dim);

    /* optional fused ops for the decode step (NULL on the CPU backend): each
     * gives what the sequence of plain ops it names gives, within the
     * tolerances docs/gpu.md states, in fewer launches and memory passes.
     * The engine calls the sequence where a member is NULL or TKV_FUSE=0.
     * matmul_group: y[i][n, n_out_i] = x[n, n_in] . w[i]^T for i < nw
     *   (nw <= 8 weights of the same n_in sharing x: q/k/v), = nw matmuls.
     *   No y[i] overlaps x or another y[j].
     * matmul_swiglu: out[n, n_ff] = silu(x . w_gate^T) * (x . w_up^T), = two
     *   matmuls and swiglu, without writing the two products out; out does
     *   not overlap x.
     * add_rmsnorm: y += x, then h = rmsnorm(y) * w (rmsnorm's formula) over
     *   n rows of dim, = add then rmsnorm; h may alias x, not y.
     * matmul_add: y[n, n_out] += x[n, n_in] . w^T, = matmul into a buffer
     *   then add (each sum rounded, then y + it); y does not overlap x. With
     *   it the engine's residual adds move into the wo and down products and
     *   the norms after them are plain rmsnorm calls (which a backend may
     *   then run as one grid with the next product's input preparation).
     * matmul_qkv_rope: matmul_group(w, 3, x, {q, k, v}, n) then rope_qk(q,
     *   k, n, w[0]'s rows / head_dim, w[1]'s rows / head_dim, head_dim, ...)
     *   (a backend may rotate q and k as its product writes them).
     * rope_qk: rope of q[n, n_head*head_dim] and k[n, n_head_kv*head_dim] at
     *   the same host positions pos[n], = two rope calls; a backend may keep
     *   the last positions it was given on the device (a decode step's 32
     *   layers then upload them once). */
    tkv_status (*matmul_group)(struct tkv_backend *b, const struct tkv_bweight *const *w, uint32_t nw,
                               const float *x, float *const *y, uint32_t n);
    tkv_status (*matmul_swiglu)(struct tkv_backend *b, const struct tkv_bweight *w_gate,
                                const struct tkv_bweight *w_up, const float *x, float *out, uint32_t n);
    tkv_status (*add_rmsnorm)(struct tkv_backend *b, float *y, const float *x, const struct tkv_bweight *w,
                              float *h, uint32_t n, uint32_t dim, float eps);
    tkv_status (*matmul_add)(struct tkv_backend *b, const struct tkv_bweight *w, const float *x, float *y,
                             uint32_t n);
    tkv_status (*matmul_qkv_rope)(struct tkv_backend *b, const struct tkv_bweight *const *w, const float *x,
                                  float *q, float *k, float *v, uint32_t n, uint32_t head_dim, uint32_t rot_dim,
                                  const int32_t *pos, float base, float freq_scale);
    tkv_status (*rope_qk)(struct tkv_backend *b, float *q, float *k, uint32_t n, uint32_t n_head,
                          uint32_t n_head_kv, uint32_t head_dim, uint32_t rot_dim, const int32_t *pos, float base,
                          float freq_scale);
#define TKV_MATMUL_GROUP_MAX 8

    /* optional members: NULL where they do not apply (the CPU backend) */
    /* the statistics above, which the policies score keys with
     * (runtime/policy/policy.h); NULL: a policy that needs them is refused
     * (the CPU backend's implementation is the reference) */
    tkv_status (*attn_stats)(struct tkv_backend *b, const struct tkv_attn_stats_args *a);
    /* PCI bus id of the device ("0000:3b:00.0"), for NUMA placement */
    const char *(*pci_bus_id)(struct tkv_backend *b);
    /* page-lock host memory for fast asynchronous copies, and undo it */
    tkv_status (*host_register)(struct tkv_backend *b, void *p, size_t bytes);
    void       (*host_unregister)(struct tkv_backend *b, void *p);
    /* Asynchronous block uploads (the KV store's recalls and prefetches).
     * upload_blocks queues n copies of `bytes` each, src[i] (host memory
     * registered with host_register) -> dst[i] (device memory), after all work
     * queued so far, and returns at once; the copies overlap ops queued later
     * until upload_fence. Each call that queues copies is one upload, and
     * *ticket (when not NULL) receives its number: 1, 2, ... in call order
     * (0 when nothing was queued). Until upload_wait reports them done, the
     * sources must not change. With crc != NULL the device also checks each
     * copy that landed against crc[i] (CRC-32C) and bad[i] (host memory,
     * valid until then) is set to 1 on a mismatch, 0 otherwise, by the time
     * upload_wait reports the copies done; a backend that cannot check this
     * size returns TKV_ERR_UNSUPPORTED and queues nothing.
     * upload_fence: every op queued after it sees the copies of uploads
     * 1 .. upto (no host wait). upload_wait: the same uploads; block = true
     * waits for them, false polls: *done says whether they have finished.
     * Later uploads stay in flight: this is how a prefetch of the next layer
     * keeps the link busy while the current one is settled.
     * TKV_UPLOADS_ALL names every upload queued so far. */
    tkv_status (*upload_blocks)(struct tkv_backend *b, void *const *dst, const void *const *src, uint32_t n,
                                size_t bytes, const uint32_t *crc, uint8_t *bad, uint64_t *ticket);
    /* Optional: n copies of `bytes` each, src[i] (backend memory) -> dst[i]
     * (host memory, registered with host_register where the backend has
     * it), after all work queued so far; returns when all have landed: one
     * wait for the batch (the KV store's spills of dirty blocks to the host
     * tier). NULL: the store calls download once per block. */
    tkv_status (*download_blocks)(struct tkv_backend *b, void *const *dst_host, const void *const *src, uint32_t n,
                                  size_t bytes);
    tkv_status (*upload_fence)(struct tkv_backend *b, uint64_t upto);
    tkv_status (*upload_wait)(struct tkv_backend *b, uint64_t upto, bool block, bool *done);
    /* RaBitQ on the device, bit-identical to the CPU kernels.
     * rabitq_encode: the rows of spans[0 .. n_spans-1] (host array; the rows
     * in backend memory, one row_stride for all) as keys at, at+1, ... in
     * span order (span s from key at + spans[0].n + ... + spans[s-1].n), as
     * tkv_rabitq_append_f16 encodes them; one call, one wait for the result:
     * TKV_ERR_INVALID_ARG naming the first key (its index, and its span and
     * row) that is not finite (the caller then does not count the batch).
     * rabitq_estimate: est[i] and bound[i] (backend memory; bound may be
     * NULL) for keys first .. first+n-1, as tkv_rabitq_estimate; queued. */
    tkv_status (*rabitq_encode)(struct tkv_backend *b, const struct tkv_rabitq_dev *ix,
                                const struct tkv_rabitq_span *spans, uint32_t n_spans, size_t row_stride,
                                uint32_t at);
    tkv_status (*rabitq_estimate)(struct tkv_backend *b, const struct tkv_rabitq_dev *ix,
                                  const struct tkv_rabitq_query *q, uint32_t first, uint32_t n, float *est,
                                  float *bound);
    /* optional (NULL: the policies select head by head, estimates and
     * top-p on the host): the selection above for one layer in one call,
     * one wait. The CPU backend's runs the host reference's (head, query
     * head) pairs on its threads. */
    tkv_status (*rabitq_select)(struct tkv_backend *b, const struct tkv_rabitq_select_args *a);
    /* optional (NULL: the policy downloads the rows and sums them on the
     * host): a key centroid's sums from backend memory. For every element
     * d < dim of the rows of spans[0 .. n_spans-1] (row r of span s at
     * spans[s].k + r * row_stride, f16), the finite values summed exactly in
     * units of 2^-24 (TKV_RABITQ_F16_UNITS: every finite f16 is an integer
     * there) and added into units[d], the others counted into nonfinite[d]
     * (host arrays [dim]); at most TKV_RABITQ_MEAN_MAX_ROWS rows. One call,
     * one wait. */
    tkv_status (*rabitq_key_sums)(struct tkv_backend *b, const struct tkv_rabitq_span *spans, uint32_t n_spans,
                                  size_t row_stride, uint32_t dim, int64_t *units, uint32_t *nonfinite);
    /* optional (NULL on the CPU backend, whose policies prepare on the
     * host): one layer's queries prepared from backend memory (struct
     * tkv_rabitq_prepare_args), queued, no wait; a refused query is
     * poisoned and reported through a->bad, not by the status (which
     * covers the arguments and the device only). */
    tkv_status (*rabitq_prepare)(struct tkv_backend *b, const struct tkv_rabitq_prepare_args *a);
    /* optional: n 64-bit stores into backend memory, table[idx[i]] = val[i]
     * (idx and val host arrays [n], the idx distinct), queued after the work
     * queued so far; idx and val may be reused once it returns. The KV
     * store's device page table takes its changes this way, a small batch
     * per layer (tkv_kvs_page_table_sync). NULL: the store uploads each
     * value with upload. */
    tkv_status (*table_write)(struct tkv_backend *b, uint64_t *table, const uint32_t *idx, const uint64_t *val,
                              uint32_t n);
    /* optional: one layer's decode attention table (struct
     * tkv_kv_table_args), queued, no wait. NULL: the policy builds the
     * table on the host from the downloaded bitmaps. */
    tkv_status (*kv_table)(struct tkv_backend *b, const struct tkv_kv_table_args *a);
    /* Op profile: non-NULL only while the backend profiles its ops (CUDA:
     * TKV_CUDA_PROFILE=1 when it is created; docs/gpu.md). profile_read
     * waits for the queued work and fills *out with the totals since the
     * backend was created or last reset; the rows stay valid until the next
     * call on b. profile_reset starts new totals. */
    tkv_status (*profile_read)(struct tkv_backend *b, struct tkv_op_profile *out);
    void       (*profile_reset)(struct tkv_backend *b);
};


struct tkv_backend {
    const struct tkv_backend_ops *ops;
};

/* Creates the backend for a device name: "cpu", "cuda" or "auto".
 * n_threads: CPU threads the backend may use (0 = all online cores). */
tkv_status tkv_backend_create(const char *device, uint32_t n_threads, struct tkv_backend **out);

/* Tests: a factory tkv_backend_create asks first (NULL: none). It returns
 * TKV_OK with *out set for the device names it makes, anything else (and
 * *out NULL) to leave the name to the built-in backends; e.g. a wrapper
 * backend that keeps its memory out of the policies' reach. Not thread-safe:
 * set it before creating sessions. */
typedef tkv_status (*tkv_backend_factory)(const char *device, uint32_t n_threads, struct tkv_backend **out);
void tkv_backend_set_test_factory(tkv_backend_factory make);

/* Number of usable CUDA devices; 0 when built without CUDA or none usable. */
int tkv_backend_cuda_devices(void);

/* Tests and benchmarks: the CUDA backend b's tensor-core prefill attention
 * variant (tile shape, docs/gpu.md: 0 or 1, the ones that
 * tkv_backend_cuda_prefill_variant_desc names; until set, v1 in f16 and v0
 * in split precision) for the calls it queues from now on.
 * TKV_ERR_INVALID_ARG when b is not a CUDA backend or the variant does not
 * exist, TKV_ERR_UNSUPPORTED in a build without CUDA. */
tkv_status tkv_backend_cuda_set_prefill_variant(struct tkv_backend *b, int variant);

/* Tests: the CUDA backend b's activation quantization for the quantized
 * decode GEMV: x [n][n_in] f32 (device memory, n_in % 32 == 0) -> n rows of
 * n_in / 32 blocks of tkv_act_type(weight_type) (tkv_block_q8_0 or
 * tkv_block_q8_1) at dst (device memory), the bytes the GEMV reads
 * (weight_type Q4_0, Q4_1 or Q8_0). Queued on b's stream. TKV_ERR_INVALID_ARG
 * when b is not a CUDA backend or the type is not one of those,
 * TKV_ERR_UNSUPPORTED in a build without CUDA. */
tkv_status tkv_backend_cuda_quantize_act(struct tkv_backend *b, uint32_t weight_type, const float *x, uint32_t n,
                                         uint32_t n_in, void *dst);

/* Tests: how many quantized GEMV calls of the CUDA backend b read
 * activations the op before them quantized in its own launch (a decode
 * norm or attention, docs/gpu.md "Fused decode ops") instead of quantizing
 * them; 0 for any other backend or without CUDA. */
uint64_t tkv_backend_cuda_q8_reads(struct tkv_backend *b);

/* "vN: <tile shape>" (static) for variant N; NULL past the last one or
 * without CUDA. */
const char *tkv_backend_cuda_prefill_variant_desc(int variant);

#endif /* TKV_BACKEND_H */
