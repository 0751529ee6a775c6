/* full.c -- the `full` policy: every head attends to all of its KV. */
#include "policy.h"

static tkv_status full_create(const struct tkv_policy_env *env, const struct tkv_policy_args *args, void **state)
{
    *state = NULL;
    if (args->n > 0)
        return tkv_err(TKV_ERR_INVALID_ARG, "policy 'full': unknown parameter '%s' (it takes none)", args->key[0]);
    return TKV_OK;
}

const struct tkv_policy_ops tkv_policy_full = {
    .name = "full",
    .help = "keep and attend to the whole KV cache (exact attention)",
    .create = full_create,
    .destroy = NULL,
    .select = NULL,
};
