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

/* Fills the empty session s (policy 'full') with n_tokens of context, toks
 * being their ids (the session keeps them as it would after a prefill). The
 * first n_real tokens (at least one KV block; rounded down to whole blocks
 * when fewer than n_tokens) are prefilled for real; every KV block after
 * them, per (layer, KV head), is a copy of one of that head's real blocks,
 * taken in turn. *n_real_out (may be NULL) gets the count really computed.
 * The logits stay those of the real prefill. On failure the session holds
 * at most the real part. */
tkv_status tkv_session_fill_synthetic(tkv_session *s, const tkv_token *toks, uint32_t n_tokens, uint32_t n_real,
                                      uint32_t *n_real_out);

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
