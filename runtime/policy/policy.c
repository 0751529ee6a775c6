/* policy.c -- parsing policy specs and the policy registry. */
#include "policy.h"

#include <stdio.h>
#include <stdlib.h>

static const struct tkv_policy_ops *const registry[] = {
    &tkv_policy_full,
    &tkv_policy_streaming,
    &tkv_policy_snapkv,
    &tkv_policy_adakv,
    &tkv_policy_critiprefill,
    &tkv_policy_entropy,
    &tkv_policy_rabitq,
    &tkv_policy_entropy_rabitq,
};
#define N_POLICIES (sizeof registry / sizeof registry[0])

const char *tkv_policy_names(void)
{
    static char names[256];
    if (!names[0])
        for (size_t i = 0; i < N_POLICIES; i++) {
            size_t len = strlen(names);
            snprintf(names + len, sizeof names - len, "%s%s", i ? ", " : "", registry[i]->name);
        }
    return names;
}

/* "k=v,k=v" -> args */
static tkv_status parse_args(const char *policy, const char *s, struct tkv_policy_args *args)
{
    args->n = 0;
    while (s && *s) {
        const char *end = strchr(s, ','), *eq = strchr(s, '=');
        size_t len = end ? (size_t)(end - s) : strlen(s);
        if (!eq || eq >= s + len || eq == s)
            return tkv_err(TKV_ERR_INVALID_ARG, "policy '%s': expected key=value, got '%.*s'", policy, (int)len, s);
        size_t klen = (size_t)(eq - s), vlen = len - klen - 1;
        if (args->n == TKV_POLICY_MAX_ARGS)
            return tkv_err(TKV_ERR_INVALID_ARG, "policy '%s': more than %d parameters", policy, TKV_POLICY_MAX_ARGS);
        if (klen >= sizeof args->key[0] || vlen >= sizeof args->value[0] || vlen == 0)
            return tkv_err(TKV_ERR_INVALID_ARG, "policy '%s': parameter '%.*s' is empty or too long", policy,
                           (int)len, s);
        memcpy(args->key[args->n], s, klen);
        args->key[args->n][klen] = 0;
        memcpy(args->value[args->n], eq + 1, vlen);
        args->value[args->n][vlen] = 0;
        args->n++;
        s = end ? end + 1 : NULL;
    }
    return TKV_OK;
}

tkv_status tkv_policy_create(const char *spec, const struct tkv_policy_env *env, struct tkv_policy **out)
{
    *out = NULL;
    if (!spec || !*spec)
        spec = "full";
    char name[64];
    const char *colon = strchr(spec, ':');
    size_t nlen = colon ? (size_t)(colon - spec) : strlen(spec);
    if (nlen == 0 || nlen >= sizeof name || (colon && colon[1] == 0))
        return tkv_err(TKV_ERR_INVALID_ARG, "policy: bad spec '%s' (expected NAME[:key=value,...])", spec);
    memcpy(name, spec, nlen);
    name[nlen] = 0;
    const struct tkv_policy_ops *ops = NULL;
    for (size_t i = 0; i < N_POLICIES; i++)
        if (!strcmp(registry[i]->name, name))
            ops = registry[i];
    if (!ops)
        return tkv_err(TKV_ERR_INVALID_ARG, "policy: unknown policy '%s' (known: %s)", name, tkv_policy_names());
    struct tkv_policy_args args;
    TKV_TRY(parse_args(name, colon ? colon + 1 : NULL, &args));
    struct tkv_policy *p = calloc(1, sizeof *p);
    if (!p)
        return tkv_err(TKV_ERR_NOMEM, "policy: out of memory");
    p->ops = ops;
    p->env = *env;
    tkv_status st = ops->create ? ops->create(env, &args, &p->state) : TKV_OK;
    if (st != TKV_OK) {
        free(p);
        return st;
    }
    *out = p;
    return TKV_OK;
}

void tkv_policy_free(struct tkv_policy *p)
{
    if (!p)
        return;
    if (p->ops->destroy)
        p->ops->destroy(p->state);
    free(p);
}
