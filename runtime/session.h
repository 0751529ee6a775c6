/*
 * session.h -- private: the state of a tkv_session, shared by engine.c
 * (sessions, forward pass) and kv-file.c (save and restore).
 */
#ifndef TKV_SESSION_H
#define TKV_SESSION_H

#include "../tiers/kv-store.h"
#include "backend.h"
#include "engine.h"
#include "hetero.h"
#include "policy/policy.h"

#include <stdio.h>

#define DEFAULT_KV_BLOCK 64
#define OBS_QUERIES 32
#define DEFAULT_PREFILL_CHUNK 512
/* KV storage is reserved this many tokens ahead during decode, so blocks are
 * allocated once per span rather than on every token. */
#define DECODE_RESERVE_AHEAD 256
/* Private session flag (beside the public TKV_SESSION_*), set by
 * tkv_session_set_phase_sync (runtime/kv-synth.h): the decode phase timers
 * synchronize the backend at their edges, so that on an asynchronous device
 * each phase's time includes its device work and no earlier op's. */
#define TKV_SESSION_PHASE_SYNC (1u << 30)

struct layer_weights {
    struct tkv_bweight *attn_norm, *wq, *wk, *wv, *wo, *ffn_norm, *w_gate, *w_up, *w_down;
};

struct tkv_session {
    const tkv_model *model;
    struct tkv_model_info hp;
    uint32_t n_ctx, chunk, kv_block;
    char device[16], policy_spec[128];
    uint32_t kv_budget;
    tkv_progress_fn progress;
    void *progress_user;

    struct tkv_backend *be;
    bool be_host;  /* the backend's memory is host memory (the CPU backend) */
    struct tkv_bweight *tok_embd, *output_norm, *output;
    struct layer_weights *layers;
    struct tkv_kvs *kv;
    struct tkv_policy *policy;

    /* activations, backend memory, sized for `chunk` tokens */
    float *x;      /* [chunk, E]          residual stream                 */
    float *h;      /* [chunk, max(E, H*hd)] normed input / matmul output  */
    float *q;      /* [chunk, H*hd]                                       */
    float *k, *v;  /* [chunk, Hkv*hd]                                     */
    float *att;    /* [chunk, H*hd]       attention output                */
    float *gate;   /* [chunk, F]                                          */
    float *up;     /* [chunk, F]                                          */
    float *logits_dev; /* [V]                                             */

    float *logits;   /* host [V]; valid when have_logits                  */
    bool have_logits;
    int32_t *pos;    /* host [chunk]                                      */
    float *q_step;   /* host [H*hd]: a decode step's query, for policies that
                        read it on the host (decode_reads_query and
                        decode_query_host) on a device backend, and for the
                        CPU half of a split attention                      */
    struct tkv_kv_head_view *views;   /* host [Hkv]                       */
    struct tkv_kv_block_ref *sel_refs;/* host [Hkv][max_refs] policy-selected block slices */
    uint32_t max_blocks;              /* blocks per head of the whole context */

    uint32_t n_past;
    uint32_t n_prompt;               /* tokens the prefill calls processed */
    uint32_t prefill_end;            /* where the running prefill call ends */
    uint32_t step;                   /* decode steps since the last prefill */
    bool in_decode;                  /* the chunk being run is a decode step */
    tkv_token *tokens;               /* host [n_ctx]: the context's token ids */
    unsigned flags;                  /* TKV_SESSION_* */

    /* the observation window: the last OBS_QUERIES prompt queries of every
     * layer (post-RoPE), for policies that compress after the prefill */
    float *obs_q;                    /* host [n_layer][OBS_QUERIES][n_head*head_dim] */
    int32_t obs_pos[OBS_QUERIES];
    bool fuse;                       /* use the backend's fused decode ops (TKV_FUSE) */
    FILE *trace;                     /* TKV_TRACE=FILE: the residual stream after
                                        every layer (engine.c, trace_layer) */
    float *trace_buf;                /* host [chunk, E] for it                */
    uint32_t obs_n;

    /* policy selections turned into block lists */
    struct tkv_range *plan_ranges;   /* host [n_head_kv][max_ranges]: each head's selection (a decode plan) */
    uint8_t *need;                   /* host [n_head_kv][max blocks]: blocks a plan touches */
    uint32_t max_ranges, max_refs;   /* per head */
    /* attention-mass measurement (TKV_SESSION_MEASURE_MASS) */
    float *att_full, *lse_full, *lse_sel; /* backend [n_head*head_dim], [n_head], [n_head] */
    double mass_sum;
    uint64_t mass_count;
    /* what decode attention read (select_views): sums over (step, layer,
     * KV head) of the share of the context's tokens and blocks; over (step,
     * layer) of its largest head's share of the tokens (head_max: the
     * current layer's so far) */
    double read_tokens, read_blocks, read_tokens_max, head_max;
    uint64_t read_count, read_layers;
    /* heterogeneous decode (hetero.h; docs/rabitq.md): selected blocks in
     * the host tier below a device attended on the CPU where they are */
    struct tkv_backend *be_cpu;      /* a CPU backend for that; NULL: never (no host tier below a
                                        device, or TKV_HETERO_RECALL) */
    enum tkv_hetero hetero;
    double link_bps, cpu_flops;      /* the cost model's rates, as given or measured at start */
    bool het_observe;                /* auto with measured rates: price with what use observes */
    struct tkv_hetero_rate cpu_seen, link_seen; /* the CPU's attention flop/s, the recalls' bytes/s,
                                                   one observation per decode step (engine.c) */
    double het_observe_min_s;        /* a step's work observed if it takes this long at the
                                        rate in use (TKV_HETERO_OBSERVE_MIN_S; tests: 0) */
    struct tkv_hetero_arms arms;     /* het_observe: how each decode step is decided (hetero.h) */
    double crc_bps;                  /* host-read verification: one thread's CRC-32C rate times the
                                        store's verifying threads (0 with given rates: not counted) */
    struct tkv_hetero_head *het_heads; /* TKV_HETERO_AUTO: [n_layer][n_head_kv], what each head's
                                          choices cost (hetero.h); else NULL */
    uint8_t *host_ok;                /* host [n_head_kv][max blocks]: may stay on the host tier */
    bool hsplit;                     /* this layer has blocks read on the host tier */
    struct tkv_kv_head_view *hviews; /* host [Hkv]: the CPU's part of the selection */
    struct tkv_kv_block_ref *hrefs;  /* host [Hkv][max_refs] */
    uint8_t *ref_host;               /* host [max_refs]: which of a head's slices are on the host */
    float *att_cpu, *lse_cpu;        /* be_cpu memory [H*hd], [H]: the CPU's partial result */
    float *att_mrg, *lse_mrg;        /* host [H*hd], [H]: the device's partial, then the merge */
    float *lse_dev;                  /* backend [H]: the device partial's log-sum-exp */
    /* sums over decode steps and layers: KV heads whose host-tier blocks
     * were attended on the CPU / recalled, their tokens and blocks */
    uint64_t het_cpu_heads, het_recall_heads, het_cpu_tokens, het_cpu_blocks, het_recall_blocks;
    /* the device decode table (TKV_RABITQ_DEVICE_TABLE=1 and a backend
     * with kv_table; docs/rabitq.md, "Decode from the device table"): the
     * store keeps its page table, the policy leaves its selection in
     * backend memory (decode_bitmap), kv_table builds each decode layer's
     * block lists from the two, and the attention reads them there
     * (table_layer), missing blocks recalled or attended on the CPU first */
    bool dev_table;
    struct tkv_kv_block_ref *dt_refs, *dt_miss; /* backend [Hkv][max_refs] */
    uint32_t *dt_counts;                        /* backend [layer][Hkv][4], then dt_marks */
    uint32_t *dt_marks;                         /* backend [layer][Hkv][mark_words]: kv_table's read marks,
                                                   in dt_counts's allocation after the counts */
    uint32_t *dt_sel_n;                         /* host [L][Hkv]            */
    struct tkv_kv_block_ref *dt_hmiss;          /* host [Hkv][max_refs]: the heads' missing slices */
    uint32_t *dt_hcounts;                       /* host [layer][Hkv][4], in dt_hmiss's allocation, after it */
    uint32_t *dt_hmarks;                        /* host: dt_marks's copy, in the same allocation after the counts */
    bool dt_hmiss_pinned;                       /* that allocation registered with the backend  */
    bool logits_pinned;                         /* logits registered with the backend           */
    /* layers of this step attended with their counts left on the backend
     * (every block mapped: nothing to check first; table_layer), accounted
     * at the step's end (table_flush): dt_defer[l] set, dt_n_defer of them */
    bool *dt_defer;                             /* host [layer] */
    uint32_t dt_n_defer;
    /* layers whose table was built this step: their read marks go to the
     * KV store at the step's end (table_flush; tkv_kvs_mark_reads) */
    bool *dt_marked;                            /* host [layer] */
    bool dt_marks_due;                          /* some dt_marked set */
    uint64_t dt_layers, dt_fallbacks;           /* decode layers attended from the table;
                                                   those that took the host path instead */
    uint64_t dt_brought;                        /* of dt_layers: missing blocks recalled or
                                                   attended on the CPU first (table_bring) */
    /* decode phase timers, seconds summed over decode steps (wall clock; with
     * TKV_SESSION_PHASE_SYNC bounded by backend synchronizations): the
     * policy's selection (decode_select calls), the device's attention op
     * (with a split: its queueing, the wait for its partial and the merge),
     * the CPU's attention over host-tier blocks. Read by kv-synth.c. */
    double ph_select, ph_attn, ph_cpu_attn;
    /* statistics */
    uint64_t prefill_tokens, decode_tokens, prefill_chunks;
    double prefill_seconds, decode_seconds;
};

/* Runs the policy's after-prefill hook on every layer, with the observation
 * window of obs_src (the session itself, or the source of a fork). */
tkv_status tkv_session_after_prefill(tkv_session *s, const tkv_session *obs_src);

#endif
