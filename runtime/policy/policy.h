/*
 * policy.h -- the KV policy seam.
 *
 * A policy decides, per (layer, KV head) and per step, which KV blocks the
 * attention reads (and, as policies grow, per-head budgets and placement).
 * Policies never touch memory: the engine asks, the policy answers with
 * block indices, and the engine and the KV store carry the answer out.
 *
 * Spec strings: "NAME" or "NAME:key=value,key=value". Each policy lists the
 * keys it accepts; an unknown policy or key is TKV_ERR_INVALID_ARG naming it.
 */
#ifndef TKV_POLICY_H
#define TKV_POLICY_H

#include "../tkv-impl.h"

/* What a policy may know about the session it serves. */
struct tkv_policy_env {
    uint32_t n_layer, n_head, n_head_kv, head_dim;
    uint32_t n_ctx, block_tokens;
    uint32_t budget;          /* --kv-budget tokens per head; 0 = policy default */
};

#define TKV_POLICY_MAX_ARGS 16
struct tkv_policy_args {
    uint32_t n;
    char key[TKV_POLICY_MAX_ARGS][32];
    char value[TKV_POLICY_MAX_ARGS][64];
};

struct tkv_policy_ops {
    const char *name;
    const char *help;  /* one line for `tierkv run --help` */
    tkv_status (*create)(const struct tkv_policy_env *env, const struct tkv_policy_args *args, void **state);
    void (*destroy)(void *state);
    /* Writes the indices (ascending) of the blocks that (layer, head) attends
     * to into sel[n_blocks] and returns their count. NULL = all blocks. */
    uint32_t (*select)(void *state, uint32_t layer, uint32_t head, uint32_t n_blocks, uint32_t *sel);
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

/* The registered policies, one file each. */
extern const struct tkv_policy_ops tkv_policy_full;

#endif
