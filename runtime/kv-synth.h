/*
 * kv-synth.h -- private, for benchmarks (bench/bench-decode.c): a long
 * context without computing all of it, and the bytes one decode step reads.
 *
 * A real prefill of an 8B model at 128K tokens takes minutes; the speed of a
 * decode step depends on how many keys it reads, not on what they say. So
 * tkv_session_fill_synthetic prefills a short real prompt and makes the rest
 * of the context out of copies of its KV blocks: K/V values with the
 * statistics of the model's own (norms, outliers, RoPE phases), at positions
 * they were not computed for. Good for timing; meaningless for output
 * quality, and labelled "synthetic" wherever it is reported.
 */
#ifndef TKV_KV_SYNTH_H
#define TKV_KV_SYNTH_H

#include "tierkv.h"
#include "../tiers/kv-store.h" /* struct tkv_kvs_stall */

#include <stdbool.h>

/* How the synthetic part of the context is made (tkv_session_fill_synthetic_ex).
 *
 * Plain copies of a few real blocks make every copy of a block score alike,
 * so decode attention spreads evenly over the copies and a top-p selection
 * has to keep nearly all of them. To make attention concentrate the way it
 * does over long documents, the keys of each copied block are moved towards
 * or away from m, the mean key of that (layer, KV head)'s real prefix:
 *
 *     k' = m + gain * (k - m)     (f32, rounded to f16; values untouched)
 *
 * so that q.k' = q.m + gain * q.(k - m): every key of the head shares q.m,
 * and the gain scales the part of the logit that differs between keys. The
 * gain is set per (layer, KV head) from sd, the standard deviation of
 * scale * q.(k - m) over the real prefix's keys and the observation window's
 * queries (the last prompt queries of the head's query group, post-RoPE:
 * what the decode queries resemble most), so that the copies' logits spread
 * by a chosen number of nats whatever the model's own spread (random-weight
 * models from gen-model have small ones): gain = spread / sd.
 *
 * "Hot" blocks get hot_spread (several nats: a few of their keys stand far
 * above the rest), the others cold_spread (a fraction of a nat: a flat
 * background). Hot: the last recent_blocks copied blocks (a recent window)
 * and about one copied block in hot_every, scattered by a hash of (seed,
 * layer, head, block) (each head attends elsewhere, as retrieval heads do).
 * The real prefix stays as computed (the sinks). How much of the context a
 * policy must then read depends on these knobs and the context length; a
 * benchmark reports the fraction each step read, never the knob, as what a
 * policy achieved. Both spreads 0: plain copies (the timing-only fill). */
struct tkv_synth_params {
    uint32_t n_real;        /* tokens really prefilled (>= one KV block)        */
    float    hot_spread;    /* sd of the hot copies' logits about q.m, nats     */
    float    cold_spread;   /* the same for the other copies                    */
    uint32_t hot_every;     /* ~1 copied block in hot_every is hot; 0: none     */
    uint32_t recent_blocks; /* the last copied blocks, hot                      */
    uint64_t seed;          /* the scatter of hot blocks                        */
};

/* What the fill did. */
struct tkv_synth_report {
    uint32_t n_real;        /* tokens really prefilled                          */
    double   natural_sd;    /* mean over (layer, KV head) of the real logits' sd
                               (nats; 0 for plain copies: not measured)          */
    uint64_t hot_blocks, copied_blocks; /* over every (layer, KV head)          */
};

/* Plain copies of 512 real tokens (spreads 0, no hot blocks). */
struct tkv_synth_params tkv_synth_default_params(void);

/* Fills the empty session s with n_tokens of context, toks being their ids
 * (the session keeps them as it would after a prefill). The first p->n_real
 * tokens (at least one KV block; rounded down to whole blocks when fewer than
 * n_tokens) are prefilled for real; every KV block after them, per (layer, KV
 * head), is a copy of one of that head's real blocks, taken in turn, its keys
 * moved as tkv_synth_params says (a head whose sd is 0 or not finite gets
 * plain copies). The blocks go in through the KV store's import, so those
 * beyond the compute tier's capacity spill to the tiers below (host, then
 * NVMe) as in any long session. rep (may be NULL) says what was done. The
 * logits stay those of the real prefill.
 *
 * Any policy that does not change the prefill (not changes_prefill) may
 * hold s: whatever its after-prefill hook built saw the real prefix only.
 * A rabitq index catches up with the synthetic keys by itself at the first
 * decode step (its pending keys exceed a batch: that step reads every block
 * and encodes them), which a benchmark's warm-up steps absorb. On failure
 * the session holds at most the real part. */
tkv_status tkv_session_fill_synthetic_ex(tkv_session *s, const tkv_token *toks, uint32_t n_tokens,
                                         const struct tkv_synth_params *p, struct tkv_synth_report *rep);
/* tkv_session_fill_synthetic_ex with plain copies of n_real real tokens. */
tkv_status tkv_session_fill_synthetic(tkv_session *s, const tkv_token *toks, uint32_t n_tokens, uint32_t n_real,
                                      uint32_t *n_real_out);

/* Running totals of a session's decode steps, for a benchmark to difference
 * around its timed steps (all sums since the session began). */
struct tkv_step_counters {
    uint64_t decode_steps;
    double   decode_s;       /* wall time inside tkv_decode                               */
    double   select_s;       /* the policy's decode selection (estimate + top-p)         */
    double   attn_s;         /* the device's attention op (with a split: + wait, merge)  */
    double   cpu_attn_s;     /* the CPU's attention over blocks left on the host tier    */
    double   store_s;        /* inside the store's begin_layer: recalls issued and waited
                                for, host reads verified (and the same in prefill chunks) */
    double   read_tokens, read_blocks; /* sums over (step, layer, KV head) of the share of
                                          the context's tokens / blocks attention read    */
    uint64_t read_count;     /* (step, layer, KV head) triples in those sums              */
    double   read_tokens_max; /* sum over (step, layer) of its largest KV head's share of
                                 the tokens (how unevenly a layer's heads read)           */
    uint64_t read_layers;    /* (step, layer) pairs in that sum                           */
    uint64_t recall_bytes;   /* written into the compute tier (recalls; imports too)      */
    uint64_t host_out_bytes, nvme_out_bytes; /* read back from the host / NVMe tier       */
    uint64_t cpu_heads, cpu_tokens, recall_heads, recall_blocks, host_read_blocks; /* hetero */
    uint64_t table_layers, table_fallbacks; /* decode layers attended from the device table;
                                               those that took the host path instead    */
    uint64_t table_brought;                 /* of table_layers: missing blocks recalled or
                                               attended on the CPU first                */
    uint64_t table_marked;                  /* layers whose tables' read marks the store
                                               took (one per table layer and step)      */
    struct tkv_kvs_stall store; /* store_s split into its parts, and the work behind them */
};
void tkv_session_step_counters(const tkv_session *s, struct tkv_step_counters *out);
/* out = now - then, every sum (the counters of the steps between two reads) */
void tkv_step_counters_since(const struct tkv_step_counters *now, const struct tkv_step_counters *then,
                             struct tkv_step_counters *out);

/* Phase timing with backend synchronizations at the phases' edges
 * (TKV_SESSION_PHASE_SYNC, runtime/session.h): on a GPU the phases' times
 * then hold their own device work and the rest of the step is the weights'
 * (at the cost of a few synchronizations per layer). Off: wall time of the
 * host's calls, which on an asynchronous device may hold waits for earlier
 * ops. May be switched between steps. */
void tkv_session_set_phase_sync(tkv_session *s, bool on);

/* The weight bytes one decode step reads: every matrix and norm of every
 * layer, the output norm and matrix, one row of the embedding table. */
struct tkv_decode_bytes {
    uint64_t weights;      /* as the file stores them (the CPU reads these)    */
    uint64_t weights_f16;  /* matrices at 2 bytes per weight, norms in f32:
                              what the CUDA backend keeps (gpu/cuda-backend.cu) */
    const char *matrix_type; /* type of the layer matrices ("Q4_0", "F16", ...) */
};
void tkv_model_decode_bytes(const tkv_model *m, struct tkv_decode_bytes *out);

/* The session's compute backend (runtime/backend.h), e.g. for its op
 * profile (profile_read / profile_reset); owned by the session. */
struct tkv_backend *tkv_session_backend(tkv_session *s);

#endif
