/*
 * policy.h -- the KV policy seam.
 *
 * A policy decides which keys each (layer, KV head) attends to, in three
 * places of a session's life; it never touches memory: the engine shows it
 * a read-only view (queries, and the layer's K blocks in the backend's
 * memory) and turns its answers -- token ranges -- into the block lists
 * attention reads. The attention statistics a policy scores keys with go
 * through the backend's attn_stats op (tkv_policy_segment_stats,
 * tkv_policy_window_stats below), so the same hooks run on the CPU and the
 * CUDA backend.
 *
 *   prefill_select  before each prefill chunk's attention (block-sparse
 *                   prefill: CritiPrefill, EntropyInfer). The chunk always
 *                   also sees its own keys (causally), added by the engine.
 *   after_prefill   once per layer after the prefill, with the observation
 *                   window (the last queries of the prompt, host memory):
 *                   post-prefill compression (SnapKV, AdaKV, StreamingLLM).
 *   decode_select   before each decode step's attention, with the step's
 *                   query: the keys each head reads now (kept set plus the
 *                   tokens generated since, re-selection, sliding windows).
 *
 * A hook left NULL means "everything". Selections are ascending, disjoint
 * token ranges [begin, end) of positions < n_past. At decode, the engine
 * recalls only the blocks a selection touches (unless decode_needs_keys),
 * so what a policy leaves out can stay paged to a lower tier.
 *
 * Spec strings: "NAME" or "NAME:key=value,key=value"; each policy lists the
 * keys it accepts; an unknown policy or key is TKV_ERR_INVALID_ARG naming it.
 */
#ifndef TKV_POLICY_H
#define TKV_POLICY_H

#include "../backend.h"

/* What a policy may know about the session it serves. */
struct tkv_policy_env {
    uint32_t n_layer, n_head, n_head_kv, head_dim;
    uint32_t n_ctx, block_tokens;
    uint32_t budget;          /* --kv-budget tokens per KV head; 0 = policy default */
    bool device_table;        /* the session builds the device decode table
                                 (TKV_RABITQ_DEVICE_TABLE=1, session.h): a
                                 selecting policy leaves its bitmaps in backend
                                 memory for it (decode_bitmap) */
    bool kv_paged;            /* the compute tier is capped below the context's
                                 KV: reading a block may mean recalling it (or
                                 attending it on the CPU where it lives) */
};

#define TKV_POLICY_MAX_ARGS 16
struct tkv_policy_args {
    uint32_t n;
    char key[TKV_POLICY_MAX_ARGS][32];
    char value[TKV_POLICY_MAX_ARGS][64];
};

struct tkv_range {
    uint32_t begin, end;
};

/* A read-only view of one layer for a hook. q and kv are in be's memory
 * (device memory on the CUDA backend): a policy hands them to the
 * statistics helpers and reads them itself only where its ops say so
 * (decode_reads_query, reads_keys). be == NULL: everything is in host
 * memory and the statistics run on the calling thread (unit tests). */
struct tkv_policy_view {
    uint32_t layer;
    uint32_t n_past;              /* tokens in the context, the current ones included */
    uint32_t n_prompt;            /* tokens the prefill processed                       */
    uint32_t step;                /* decode steps so far (0 during prefill)             */
    uint32_t prefill_end;         /* position where the running prefill call ends       */
    const float   *q;             /* [n_q, n_head*head_dim] post-RoPE queries           */
    bool           q_host;        /* q is in host memory (always after_prefill's window) */
    const int32_t *q_pos;         /* host [n_q]                                          */
    uint32_t n_q;
    const struct tkv_kv_head_view *kv; /* host [n_head_kv]: all blocks of the layer    */
    struct tkv_backend *be;       /* whose memory q and kv are in; NULL: host memory     */
    bool           kv_host;       /* the blocks' K/V are in host memory (be NULL or the CPU's) */
};

struct tkv_policy_ops {
    const char *name;
    const char *help;             /* one line for `tierkv run --help` and docs */
    bool changes_prefill;         /* prefill_select restricts the prefill      */
    /* decode_select reads the step's query itself (v->q): the engine hands
     * it over in host memory (q_host) on every backend */
    bool decode_reads_query;
    /* Optional, with decode_reads_query: false when decode_select reads the
     * step's query in backend memory instead (v->q left there, q_host
     * false: it hands it to backend ops such as rabitq_prepare), so the
     * engine does not bring it to the host, a wait per layer. NULL: true.
     * Asked per layer of a decode step; the answer must not change within
     * a step. */
    bool (*decode_query_host)(void *state);
    /* the hooks read the keys (v->kv's blocks) themselves, so they need them
     * in host memory: the engine refuses the policy on a device backend */
    bool reads_keys;
    /* the hooks keep a RaBitQ index of the keys: on the backend through its
     * rabitq ops, which the engine then requires, where the KV is in backend
     * memory or the backend selects a whole layer in one call (the CPU
     * backend's rabitq_select); else in host memory */
    bool needs_rabitq_ops;
    tkv_status (*create)(const struct tkv_policy_env *env, const struct tkv_policy_args *args, void **state);
    void (*destroy)(void *state);
    /* Each returns the number of ranges written to out[cap] for `head`, or
     * -1 for "all keys". cap >= n_past / 2 + 2. */
    int (*prefill_select)(void *state, const struct tkv_policy_view *v, uint32_t head, struct tkv_range *out,
                          uint32_t cap);
    tkv_status (*after_prefill)(void *state, const struct tkv_policy_view *v);
    int (*decode_select)(void *state, const struct tkv_policy_view *v, uint32_t head, struct tkv_range *out,
                         uint32_t cap);
    /* Whether decode_select needs the layer's keys (v->kv) at this step.
     * NULL or false: decode_select is called with v->kv == NULL, before the
     * store brings the layer in, and only the blocks it names are recalled
     * -- the rest stay paged out. */
    bool (*decode_needs_keys)(void *state, const struct tkv_policy_view *v);
    /* Optional: this step's selection of v->layer in backend memory
     * (rabitq_select's bitmap_dev), made now if decode_select has not made
     * it yet (decode_select then answers from the same selection), as the
     * backend's kv_table takes it: *bitmap [n_head_kv][*words], KV head h's
     * row h, and sel_n[h] (host [n_head_kv]) the positions that row covers,
     * 0 for a head read whole. Called before the store brings anything in,
     * as decode_select is where decode_needs_keys is false. false: not
     * there (the engine asks decode_select for ranges). NULL: never. */
    bool (*decode_bitmap)(void *state, const struct tkv_policy_view *v, const uint32_t **bitmap, uint32_t *words,
                          uint32_t *sel_n);
    /* Optional, with decode_bitmap: what the backend's decode table read of
     * `layer` at decode step `step` from the bitmap decode_bitmap gave with
     * sel_n, counts [n_head_kv][4] as kv_table (backend.h) wrote them --
     * counts[4h + 2] the positions head h read: its row's set bits below
     * sel_n[h] and the tail [sel_n[h], n_past) -- with n_past the table's.
     * Called once they are on the host (where the engine waits for them,
     * at once; else at the step's end), before the next step. NULL: not
     * wanted. */
    void (*decode_table_read)(void *state, uint32_t layer, uint32_t step, uint32_t n_past, const uint32_t *sel_n,
                              const uint32_t *counts);
    /* Forget everything about the context (session reset). */
    void (*reset)(void *state);
    /* Prefill chunk length the policy's segments need (0: any). */
    uint32_t (*segment)(void *state);
    /* For a policy that changes_prefill: whether a prompt of n tokens gets a
     * dense prefill anyway (its rules make every segment dense), so a fork
     * of a dense prefill is exactly what it would compute. NULL: never. */
    bool (*prefill_dense)(void *state, uint32_t n_tokens);
    /* Bytes of memory the policy holds (indexes, kept sets), for the
     * session statistics. NULL: negligible. */
    size_t (*memory_bytes)(void *state);
};

struct tkv_policy {
    const struct tkv_policy_ops *ops;
    void *state;
    struct tkv_policy_env env;
};

/* Parses spec and creates the policy. */
tkv_status tkv_policy_create(const char *spec, const struct tkv_policy_env *env, struct tkv_policy **out);
void       tkv_policy_free(struct tkv_policy *p);

/* Comma-separated names of the registered policies (for messages, --help). */
const char *tkv_policy_names(void);

/* ---- helpers shared by the policies (policy-util.c) ---------------------------- */

/* Parameter lookup: sets *out from args[key] (and marks it used); unknown or
 * malformed values are TKV_ERR_INVALID_ARG naming policy and key. */
tkv_status tkv_policy_arg_u32(const char *policy, const struct tkv_policy_args *a, const char *key, uint32_t *out);
tkv_status tkv_policy_arg_f32(const char *policy, const struct tkv_policy_args *a, const char *key, float *out);
/* After all lookups: an argument nobody asked for is an error. */
tkv_status tkv_policy_args_done(const char *policy, const struct tkv_policy_args *a, const char *const *known);

/* ---- statistics: every KV head of v's layer in one backend call ---------------- */

/* The segment estimator (tkv_segment_block_probs, tkv_entropy) of every KV
 * head for the segment in v: P[g * stride + j] (or P == NULL) and H[g] (or
 * H == NULL), *n_blocks = the blocks before the segment. Through
 * v->be->ops->attn_stats (TKV_ATTN_STATS_SEGMENT), or on the host when
 * v->be is NULL; bit-identical on the CPU either way. */
tkv_status tkv_policy_segment_stats(const struct tkv_policy_view *v, const struct tkv_policy_env *env, uint32_t block,
                                    float *P, uint32_t stride, double *H, uint32_t *n_blocks);
/* SnapKV's window scores (tkv_policy_window_scores, then tkv_policy_pool
 * with kernel pool and kind pool_kind; pool <= 1: none) of every KV head:
 * score[g * n_prefix + j], the window being v's queries. Through
 * TKV_ATTN_STATS_WINDOW, or on the host when v->be is NULL. */
tkv_status tkv_policy_window_stats(const struct tkv_policy_view *v, const struct tkv_policy_env *env,
                                   uint32_t n_prefix, uint32_t pool, char pool_kind, float *score);
/* The reference behind both and behind the CPU backend's attn_stats: KV
 * heads [g0, g1) of a (checked, n_blocks from tkv_attn_stats_check) in host
 * memory, by the functions below. scratch: max(n_blocks, n_prefix, 1)
 * floats. TKV_ERR_NOMEM when a function's own scratch fails. */
tkv_status tkv_attn_stats_heads(const struct tkv_attn_stats_args *a, uint32_t n_blocks, uint32_t g0, uint32_t g1,
                                float *scratch);

/* ---- the statistics themselves, one KV head, host memory -------------------------- */

/* SnapKV scores of KV head g: for every prefix position j < n_prefix, the
 * attention probability the observation queries (v->q, causal by q_pos) put
 * on key j, averaged over the queries and the group's query heads
 * (softmax over all keys < n_past, scale 1/sqrt(d)). score[n_prefix].
 * TKV_ERR_NOMEM (scores all zero) when its scratch cannot be allocated. */
tkv_status tkv_policy_window_scores(const struct tkv_policy_view *v, const struct tkv_policy_env *env, uint32_t g,
                                    uint32_t n_prefix, float *score);

/* 1-D max (kind 'm') or average (kind 'a') pooling, stride 1, zero padding
 * k/2, in place (tmp: n floats). */
void tkv_policy_pool(float *x, float *tmp, uint32_t n, uint32_t k, char kind);

/* Indices of the k largest of x[n] (ties: lower index; NaN counts as
 * -inf), sorted ascending; returns min(k, n), or 0 when out of memory.
 * O(n) (a radix select of the k-th value, then one scan): the
 * segment policies call it per (layer, segment, head) over up to n_ctx / 8
 * blocks. tkv_policy_top_k_ref is the sort-based reference the tests hold
 * it to. */
uint32_t tkv_policy_top_k(const float *x, uint32_t n, uint32_t k, uint32_t *idx);
/* The same with the caller's scratch of 2 n words (no allocation: the
 * per-segment callers keep one). */
uint32_t tkv_policy_top_k_scratch(const float *x, uint32_t n, uint32_t k, uint32_t *idx, uint32_t *scratch);
uint32_t tkv_policy_top_k_ref(const float *x, uint32_t n, uint32_t k, uint32_t *idx);

/* Sorted positions -> ranges (merging neighbours); appends [tail_begin,
 * tail_end) when non-empty. Returns the count (<= cap). */
int tkv_policy_ranges(const uint32_t *pos, uint32_t n, uint32_t tail_begin, uint32_t tail_end, struct tkv_range *out,
                      uint32_t cap);

/* The CritiPrefill/EntropyInfer block-score distribution of KV head g for
 * the segment of queries in v (v->q rows, positions [v->n_past - v->n_q,
 * v->n_past)): candidate key blocks are the whole `block`-token blocks
 * before the segment; each is scored max(q·k+, q·k-) with q the segment's
 * midrange query (per query head, averaged over the group) and k+/k- the
 * block's element-wise max/min keys, unscaled; P = softmax over blocks.
 * Writes P[n] and returns n (0 if no block precedes the segment). */
uint32_t tkv_segment_block_probs(const struct tkv_policy_view *v, const struct tkv_policy_env *env, uint32_t g,
                                 uint32_t block, float *P);
/* Block indices (ascending) of `block` tokens each -> merged token ranges. */
uint32_t tkv_policy_block_ranges(const uint32_t *idx, uint32_t k, uint32_t block, struct tkv_range *out, uint32_t cap);

/* Shannon entropy (nats) of P[n]: -sum P ln(P + 1e-9). */
double tkv_entropy(const float *P, uint32_t n);

/* AdaKV's allocation: head g's count of the n_head*per_head largest scores
 * over all heads (score[g][n]), floored at alpha*per_head and rescaled as
 * cap = cnt*(1-alpha) + floor(alpha*per_head), rounded so the caps sum to
 * exactly min(n_head*per_head, n_head*n). n_head <= 256. */
void tkv_adakv_allocate(const float *const *score, uint32_t n_head, uint32_t n, uint32_t per_head, float alpha,
                        uint32_t *cap);

/* The registered policies, one file each. */
extern const struct tkv_policy_ops tkv_policy_full;
extern const struct tkv_policy_ops tkv_policy_streaming;
extern const struct tkv_policy_ops tkv_policy_snapkv;
extern const struct tkv_policy_ops tkv_policy_adakv;
extern const struct tkv_policy_ops tkv_policy_critiprefill;
extern const struct tkv_policy_ops tkv_policy_entropy;
extern const struct tkv_policy_ops tkv_policy_rabitq;
extern const struct tkv_policy_ops tkv_policy_entropy_rabitq;

/* Whether the entropy policy (state from tkv_policy_entropy.create) has
 * classified KV head `head` of `layer` Rigid so far (for entropy+rabitq). */
bool tkv_entropy_rigid(const void *state, uint32_t layer, uint32_t head);

/* Per (layer, KV head) kept sets, for policies that compress once. */
struct tkv_kept {
    uint32_t n_layer, n_head_kv;
    struct tkv_range **r; /* [layer * n_head_kv + head] -> ranges, NULL = all */
    uint32_t *n;
};
tkv_status tkv_kept_init(struct tkv_kept *k, uint32_t n_layer, uint32_t n_head_kv);
void       tkv_kept_free(struct tkv_kept *k);
void       tkv_kept_reset(struct tkv_kept *k);
/* Stores a copy of ranges for (layer, head). */
tkv_status tkv_kept_set(struct tkv_kept *k, uint32_t layer, uint32_t head, const struct tkv_range *r, uint32_t n);
/* Kept ranges of (layer, head) plus [from, n_past): what decode attends.
 * -1 when nothing was compressed for that head. */
int tkv_kept_select(const struct tkv_kept *k, uint32_t layer, uint32_t head, uint32_t from, uint32_t n_past,
                    struct tkv_range *out, uint32_t cap);

#endif
