/*
 * streaming.c -- StreamingLLM: every head attends to the first `sink` tokens
 * (attention sinks) and the most recent `budget - sink` tokens, at decode.
 * The prefill is dense. Parameters: sink (default 4); the window is the
 * budget (--kv-budget or budget=, default 1024) minus the sinks.
 */
#include "policy.h"

#include <stdlib.h>

struct streaming {
    uint32_t sink, budget;
};

static tkv_status streaming_create(const struct tkv_policy_env *env, const struct tkv_policy_args *args, void **state)
{
    struct streaming p = {.sink = 4, .budget = env->budget ? env->budget : 1024};
    static const char *const known[] = {"sink", "budget", NULL};
    TKV_TRY(tkv_policy_arg_u32("streaming", args, "sink", &p.sink));
    TKV_TRY(tkv_policy_arg_u32("streaming", args, "budget", &p.budget));
    TKV_TRY(tkv_policy_args_done("streaming", args, known));
    if (p.budget <= p.sink)
        return tkv_err(TKV_ERR_INVALID_ARG, "policy 'streaming': budget %u must exceed sink %u", p.budget, p.sink);
    struct streaming *s = malloc(sizeof *s);
    if (!s)
        return tkv_err(TKV_ERR_NOMEM, "policy 'streaming': out of memory");
    *s = p;
    *state = s;
    return TKV_OK;
}

static int streaming_decode(void *state, const struct tkv_policy_view *v, uint32_t head, struct tkv_range *out,
                            uint32_t cap)
{
    const struct streaming *s = state;
    if (v->n_past <= s->budget)
        return -1;
    out[0] = (struct tkv_range){0, s->sink};
    out[1] = (struct tkv_range){v->n_past - (s->budget - s->sink), v->n_past};
    return 2;
}

const struct tkv_policy_ops tkv_policy_streaming = {
    .name = "streaming",
    .help = "attention sinks + a recent window (StreamingLLM): sink=4, budget=1024",
    .create = streaming_create,
    .destroy = free,
    .decode_select = streaming_decode,
};
