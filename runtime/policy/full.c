/* full.c -- the `full` policy: every head attends to all of its KV. */
#include "policy.h"

static tkv_status full_create(const struct tkv_policy_env *env, const struct tkv_policy_args *args, void **state)
{
    *state = NULL;
    static const char *const known[] = {NULL};
    return tkv_policy_args_done("full", args, known);
}

const struct tkv_policy_ops tkv_policy_full = {
    .name = "full",
    .help = "keep and attend to the whole KV cache (exact attention)",
    .create = full_create,
};
