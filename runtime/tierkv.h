/*
 * tierkv.h -- the public C API of tierkv.
 *
 * tierkv runs Llama-family GGUF models with a KV cache that is stored per
 * (layer, KV head) in blocks of B tokens, the unit that KV policies select and
 * the tiered store moves between GPU, pinned host memory and NVMe.
 *
 * Minimal use (error handling elided; every call returns a tkv_status):
 *
 *     tkv_model *m;   tkv_model_load("model.gguf", &m);
 *     struct tkv_session_params sp = tkv_session_default_params();
 *     tkv_session *s; tkv_session_init(m, &sp, &s);
 *     tkv_token toks[512]; size_t n;
 *     tkv_tokenize(m, "The capital of France is", -1, 0, toks, 512, &n);
 *     tkv_prefill(s, toks, n);
 *     tkv_token t = tkv_argmax(tkv_logits(s), tkv_model_n_vocab(m));
 *     tkv_decode(s, t);   ...
 *     tkv_session_free(s); tkv_model_free(m);
 *
 * Contracts that hold for every function:
 *   - Nothing aborts or exits on bad input: failures return a negative
 *     tkv_status, and tkv_last_error() says what was wrong and where.
 *   - Handles are opaque; every init or load function has a matching free,
 *     and freeing NULL is a no-op.
 *   - A model may be shared by several sessions (read-only after load); one
 *     session must not be used from two threads at once.
 */
#ifndef TIERKV_H
#define TIERKV_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TKV_VERSION_MAJOR 0
#define TKV_VERSION_MINOR 1
#define TKV_VERSION_PATCH 0

/* ---- status codes and errors ------------------------------------------ */

typedef enum tkv_status {
    TKV_OK               =  0,
    TKV_ERR_INVALID_ARG  = -1,  /* a parameter is out of range or NULL        */
    TKV_ERR_FORMAT       = -2,  /* a file is malformed (GGUF, KV file)        */
    TKV_ERR_UNSUPPORTED  = -3,  /* valid, but not something tierkv can run    */
    TKV_ERR_IO           = -4,  /* open/read/write/mmap failed                */
    TKV_ERR_NOMEM        = -5,  /* an allocation failed on some tier          */
    TKV_ERR_CONTEXT_FULL = -6,  /* the session's context has no room left     */
    TKV_ERR_DEVICE       = -7,  /* the GPU backend failed or is absent        */
    TKV_ERR_CORRUPT      = -8,  /* a checksum did not match                   */
    TKV_ERR_CANCELLED    = -9,  /* a callback asked to stop                   */
    TKV_ERR_TOO_SMALL    = -10, /* an output buffer is too small              */
    TKV_ERR_INTERNAL     = -11, /* a bug in tierkv: please report it          */
} tkv_status;

/* Static name of a status, e.g. "TKV_ERR_FORMAT". */
const char *tkv_status_str(tkv_status status);

/* Message of the last failure on the calling thread ("" if none). The text
 * says what was wrong and where; it stays valid until the next tierkv call
 * on this thread fails. */
const char *tkv_last_error(void);

/* ---- logging -------------------------------------------------------------- */

enum tkv_log_level { TKV_LOG_ERROR = 0, TKV_LOG_WARN = 1, TKV_LOG_INFO = 2, TKV_LOG_DEBUG = 3 };

/* Receives one line (no trailing newline). */
typedef void (*tkv_log_fn)(enum tkv_log_level level, const char *msg, void *user);

/* Sets the process-wide log sink and the most verbose level passed to it.
 * Default: WARN and ERROR go to stderr. fn = NULL silences all logging. */
void tkv_set_log(tkv_log_fn fn, void *user, enum tkv_log_level max_level);

/* OpenBLAS picks its kernels from the CPU model at load time and falls back
 * to generic SSE3 ones ("Prescott") on models it does not know yet, e.g.
 * newer Xeons under an older distribution's OpenBLAS: prefill then runs ~3x
 * slower. Returns the OPENBLAS_CORETYPE value ("SKYLAKEX", "HASWELL") that
 * selects this CPU's vector kernels when that happened and
 * OPENBLAS_CORETYPE is unset, else NULL. The variable must be in the
 * environment before the process starts (the tierkv CLI re-executes itself
 * with it); library users may set it or ignore this. */
const char *tkv_blas_coretype_advice(void);

/* ---- model ------------------------------------------------------------- */

typedef int32_t tkv_token;
typedef struct tkv_model tkv_model;

/* Maps, validates (every field, see docs/gguf.md) and loads a GGUF model. */
tkv_status tkv_model_load(const char *path, tkv_model **out);
void       tkv_model_free(tkv_model *model);

struct tkv_model_info {
    char     arch[32];        /* general.architecture ("llama")           */
    char     name[128];       /* general.name, "" if absent               */
    uint32_t n_layer, n_embd, n_head, n_head_kv, head_dim, n_ff, n_vocab;
    uint32_t n_ctx_train;     /* llama.context_length                     */
    uint32_t rope_dim;        /* rotated dimensions per head              */
    float    rope_base, rope_scale, rms_eps;
    uint32_t file_type;       /* general.file_type, 0 if absent           */
    uint64_t n_params;        /* elements over all tensors                */
    uint64_t file_bytes;
    tkv_token bos, eos;       /* -1 where the model has none              */
    char     tokenizer[16];   /* tokenizer.ggml.model ("gpt2")            */
    char     pretokenizer[16];/* tokenizer.ggml.pre ("smollm", ...)       */
};
tkv_status tkv_model_get_info(const tkv_model *model, struct tkv_model_info *out);
uint32_t   tkv_model_n_vocab(const tkv_model *model);

/* ---- tokenizer --------------------------------------------------------- */

/* Flags for tkv_tokenize / tkv_detokenize. */
#define TKV_TOK_PARSE_SPECIAL  1u  /* "<|im_start|>" in text becomes the control token */
#define TKV_TOK_ADD_BOS        2u  /* prepend BOS if the model asks for it (add_bos)  */
#define TKV_TOK_RENDER_SPECIAL 4u  /* detokenize control tokens as their text        */

/* Tokenizes len bytes of UTF-8 text (len < 0: NUL-terminated). Writes at most
 * cap ids; *n_out is the number of ids the text needs. Returns
 * TKV_ERR_TOO_SMALL (with *n_out set) when cap is too small. */
tkv_status tkv_tokenize(const tkv_model *model, const char *text, ptrdiff_t len, unsigned flags,
                        tkv_token *out, size_t cap, size_t *n_out);

/* Writes the bytes of n tokens to buf (not NUL-terminated unless room is left,
 * in which case a NUL follows). *len_out is the byte count needed.
 * TKV_ERR_TOO_SMALL when cap is too small. A token's bytes may end inside a
 * UTF-8 sequence: stream by concatenating bytes, not characters. */
tkv_status tkv_detokenize(const tkv_model *model, const tkv_token *toks, size_t n, unsigned flags,
                          char *buf, size_t cap, size_t *len_out);

/* Renders a single-turn chat prompt with the model's template (ChatML for
 * SmolLM2-Instruct, with its default system prompt when system == NULL) and
 * the assistant header, ready to tokenize with TKV_TOK_PARSE_SPECIAL. */
tkv_status tkv_chat_prompt(const tkv_model *model, const char *system, const char *user,
                           char *buf, size_t cap, size_t *len_out);

/* 1 if tok ends generation (EOS, end-of-turn), else 0. */
int tkv_token_is_eog(const tkv_model *model, tkv_token tok);

/* ---- session ----------------------------------------------------------- */

typedef struct tkv_session tkv_session;

/* Called during prefill after each chunk; return nonzero to cancel
 * (tkv_prefill then returns TKV_ERR_CANCELLED, the tokens already done stay). */
typedef int (*tkv_progress_fn)(size_t done, size_t total, void *user);

struct tkv_session_params {
    uint32_t    n_ctx;          /* tokens of context; 0 = the model's trained context */
    uint32_t    n_threads;      /* CPU threads; 0 = all online cores                  */
    const char *device;         /* "cpu", "cuda" (= "cuda:0"), "cuda:N" or "auto"     */
    const char *policy;         /* KV policy spec, "NAME[:key=value,...]"; "full"     */
    uint32_t    kv_budget;      /* tokens kept per KV head by the policy; 0 = policy default */
    uint32_t    kv_block;       /* tokens per KV block (B); 0 = default (64)           */
    uint32_t    prefill_chunk;  /* tokens per prefill segment; 0 = default (512)        */
    tkv_progress_fn progress;   /* may be NULL                                         */
    void       *progress_user;
    /* KV tiers (docs/kv-layout.md). Capacities in bytes; 0 = unlimited. */
    uint64_t    gpu_kv_mem;     /* KV in GPU memory (CUDA device)                      */
    uint64_t    host_kv_mem;    /* KV in host memory (the CPU device computes on it;
                                   below a GPU it is the pinned host tier, 0 = none)   */
    const char *nvme_dir;       /* spill directory for the NVMe tier; NULL = none      */
    uint64_t    nvme_kv_max;    /* NVMe tier capacity                                   */
    unsigned    flags;          /* TKV_SESSION_* below                                  */
    /* Heterogeneous decode (docs/rabitq.md): at a decode step of a selecting
     * policy, selected blocks in the pinned host tier below a GPU are
     * recalled or attended on the CPU where they are, per KV head by a cost
     * model (auto) or always one way. No effect without a host tier. */
    enum tkv_hetero {
        TKV_HETERO_AUTO = 0,    /* the cost model: CPU when tokens*G*hd*4/cpu rate < bytes/link rate;
                                   with measured rates, that model, all recall or all CPU, whichever
                                   decode steps are measured fastest under (docs/rabitq.md)      */
        TKV_HETERO_RECALL = 1,  /* always recall (the store's path before heterogeneous decode) */
        TKV_HETERO_CPU = 2,     /* always attend host-tier blocks on the CPU */
    } hetero;
    double      hetero_link_gbs;   /* the cost model's host -> GPU rate, GB/s; 0 = 40    */
    double      hetero_cpu_gflops; /* its CPU attention rate, GFLOP/s; 0 = measured at
                                      session start (a few ms, auto only), and then
                                      both rates follow what the steps observe: the
                                      CPU attention's flop/s, the recalls' bytes per
                                      second of stall                                   */
};

/* Measure, at every decode step, the fraction of the full attention mass
 * that falls on the keys the policy lets attention read (an extra dense
 * attention pass per layer: for evaluation, not for speed). */
#define TKV_SESSION_MEASURE_MASS 1u
/* At decode, with a policy that selects blocks, do not prefetch the next
 * layer's selection of the step before while a layer runs (for measuring
 * what that prefetch gives). */
#define TKV_SESSION_NO_SELECTION_PREFETCH 2u
struct tkv_session_params tkv_session_default_params(void);

tkv_status tkv_session_init(const tkv_model *model, const struct tkv_session_params *params,
                            tkv_session **out);
void       tkv_session_free(tkv_session *session);

/* Appends n tokens to the context and computes the logits of the last one.
 * TKV_ERR_CONTEXT_FULL if they do not fit (nothing is appended then). */
tkv_status tkv_prefill(tkv_session *session, const tkv_token *toks, size_t n);

/* Appends one token and computes its logits: one step of generation. */
tkv_status tkv_decode(tkv_session *session, tkv_token tok);

/* Logits (n_vocab floats) after the last prefill/decode; NULL before any.
 * Valid until the next call that changes the session. */
const float *tkv_logits(const tkv_session *session);

/* Tokens currently in the context. */
size_t tkv_session_n_past(const tkv_session *session);

/* Forgets the context (keeps allocations). */
void tkv_session_reset(tkv_session *session);

/* Saves the context (token ids, KV blocks with checksums, the last logits)
 * to a file that tkv_session_load restores instead of recomputing it. */
tkv_status tkv_session_save(tkv_session *session, const char *path);
/* Replaces the context with a saved one. The file is verified completely
 * (format, version, model fingerprint, sizes, every checksum) before any of
 * it is used: TKV_ERR_FORMAT / TKV_ERR_CORRUPT / TKV_ERR_UNSUPPORTED with
 * what did not match. */
tkv_status tkv_session_load(tkv_session *session, const char *path);

/* A new session holding a copy of src's context (KV, token ids, last logits
 * and the queries a policy observes at the end of the prefill), with its own
 * params (policy, budget, tiers). Policies that act after the prefill
 * (streaming, snapkv, adakv, ...) then compress the copy exactly as if they
 * had seen the prefill themselves, so one dense prefill can serve many of
 * them. Policies that change the prefill itself (critiprefill, entropy)
 * return TKV_ERR_UNSUPPORTED -- run their own prefill instead -- unless their
 * rules make this prompt's prefill dense anyway (e.g. critiprefill below its
 * threshold). src must have
 * been prefilled with the `full` policy. */
tkv_status tkv_session_fork(const tkv_session *src, const struct tkv_session_params *params, tkv_session **out);

/* Mean fraction of the full attention mass on the keys attention read, over
 * the decode steps, layers and heads measured (TKV_SESSION_MEASURE_MASS);
 * 1.0 when nothing was left out or nothing was measured. */
double tkv_session_mass_kept(const tkv_session *session);

/* Mean share of the context that decode attention read, over the decode
 * steps, layers and KV heads so far: *tokens attended, and *blocks the KV
 * store had to bring in for them (all of a layer's blocks on a step where
 * the policy needed every key). 1.0 when the policy left nothing out. */
void tkv_session_kv_read(const tkv_session *session, double *tokens, double *blocks);

/* The token ids in the context (n_past of them); valid until the next call
 * that changes the session. */
const tkv_token *tkv_session_tokens(const tkv_session *session);

/* Writes the session's statistics as a JSON object (tiers, policy, timings)
 * into buf; same size contract as tkv_detokenize. */
tkv_status tkv_session_stats_json(const tkv_session *session, char *buf, size_t cap, size_t *len_out);

/* ---- sampler ----------------------------------------------------------- */

typedef struct tkv_sampler tkv_sampler;

struct tkv_sampler_params {
    float    temperature;  /* 0 = greedy (argmax)                     */
    uint32_t top_k;        /* 0 = off                                 */
    float    top_p;        /* 1 = off; (0, 1]                          */
    uint64_t seed;
};
struct tkv_sampler_params tkv_sampler_default_params(void); /* greedy */

tkv_status tkv_sampler_init(const struct tkv_sampler_params *params, uint32_t n_vocab, tkv_sampler **out);
void       tkv_sampler_free(tkv_sampler *sampler);
/* Draws one token from logits[n_vocab]. */
tkv_token  tkv_sampler_sample(tkv_sampler *sampler, const float *logits);
/* Index of the largest logit (the lowest index on ties). */
tkv_token  tkv_argmax(const float *logits, uint32_t n_vocab);

#ifdef __cplusplus
}
#endif
#endif /* TIERKV_H */
