/*
 * eval.c -- `tierkv eval`: RULER-style long-context tasks, scored for every
 * (task, KV policy, budget) against the dense `full` policy on the same
 * prompts. docs/eval.md has the tasks, the mechanics and the measurements.
 *
 * Per sample:
 *   1. P = a `full` session prefilled with the prompt (chat template + task
 *      body + RULER's answer prefix). It is never decoded: every other
 *      session is a fork of it.
 *   2. The reference: R = fork(P, full), greedy decoding to an end-of-
 *      generation token or --max-gen tokens, keeping the log-probabilities
 *      of every answer step. Its answer is full's score.
 *   3. For each (policy, budget): A = fork(P, policy) with the attention-mass
 *      measurement on (or, for policies that change the prefill itself and
 *      refuse the fork, a fresh session that prefills the prompt). A is
 *      teacher-forced with full's answer: at every answer step the KL
 *      divergence KL(full || policy) of the next-token distributions and
 *      whether the two argmaxes agree. While they agree at every step, the
 *      policy's own greedy answer is full's answer, token for token (the
 *      same inputs give the same logits), so it needs no generation of its
 *      own. Only when they disagree somewhere does a second session B =
 *      fork(P, policy) generate greedily, free-running, for the score.
 */
#include "cli-util.h"
#include "eval.h"
#include "eval/eval.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define EXIT_USAGE 2
#define MAX_POLICIES 32
#define MAX_BUDGETS  64

static const char *prog = "tierkv eval";

static void print_eval_help(void)
{
    printf("usage: tierkv eval -m MODEL --task T[,T...] --out FILE.json [options]\n"
           "\n"
           "Generates RULER-style prompts of exactly --ctx tokens (answer room included), runs the\n"
           "dense `full` policy on them and every (policy, budget), and writes per (task, policy,\n"
           "budget): score (RULER's metric, 0-1), kl (mean next-token KL(full || policy) over full's\n"
           "answer tokens), top1 (argmax agreement with full), mass_kept (attention mass on the keys\n"
           "the policy kept), kv_read and kv_read_blocks (share of the context's tokens and KV blocks\n"
           "decode attention read per step).\n"
           "\n"
           "  -m, --model FILE     GGUF model\n"
           "      --task LIST      comma-separated, or 'all': niah_single, niah_multikey, niah_multivalue,\n"
           "                       niah_multiquery, vt, cwe, fwe, passkey\n"
           "  -c, --ctx N          context length of the prompts in tokens (default 4096)\n"
           "      --samples N      samples per task (default 10)\n"
           "      --first-sample I run samples I .. I+N-1 of each task (default 0): runs of one\n"
           "                       protocol over disjoint ranges merge exactly (scripts/eval-merge.py)\n"
           "      --seed K         generator seed (default 42, RULER's)\n"
           "      --policy LIST    KV policies, comma-separated NAME[:key=value,...] specs (a piece with\n"
           "                       '=' and no ':' continues the previous spec); default full\n"
           "      --budget LIST    KV budgets in tokens per head, comma-separated (default 0 = the\n"
           "                       policy's default)\n"
           "      --max-gen N      cap on generated tokens (default: RULER's tokens_to_generate of\n"
           "                       each task: niah 128, vt 30, cwe 120, fwe 50, passkey 16)\n"
           "      --out FILE       results as JSON\n"
           "      --plot FILE.png  score vs budget, one line per policy, one panel per task (gnuplot)\n"
           "      --keep-going     report a policy that fails and go on without it (default: stop)\n"
           "  -t, --threads N      CPU threads per session (default: all cores)\n"
           "      --device D       cpu, cuda, cuda:N or auto (default cpu)\n"
           "      --kv-block N     tokens per KV block (default 64)\n"
           "  -v, --verbose        print every answer\n");
}

static int usage_error(const char *fmt, const char *arg)
{
    fprintf(stderr, "%s: ", prog);
    fprintf(stderr, fmt, arg);
    fprintf(stderr, " (see 'tierkv eval --help')\n");
    return EXIT_USAGE;
}

/* ---- options ---------------------------------------------------------------------- */

struct opts {
    const char *model, *out, *plot, *device;
    int tasks[TKV_EVAL_TASK_COUNT];
    uint32_t n_tasks;
    char *policies[MAX_POLICIES];
    uint32_t n_policies;
    uint32_t budgets[MAX_BUDGETS];
    uint32_t n_budgets;
    uint32_t ctx, samples, first_sample, max_gen, threads, kv_block;
    uint64_t seed;
    bool keep_going, verbose;
};

static void opts_free(struct opts *o)
{
    for (uint32_t i = 0; i < o->n_policies; i++)
        free(o->policies[i]);
    o->n_policies = 0;
}

static int add_tasks(struct opts *o, const char *list)
{
    char *copy = strdup(list), *save = NULL;
    if (!copy)
        return usage_error("%s", "out of memory");
    int rc = 0;
    for (char *t = strtok_r(copy, ",", &save); t && !rc; t = strtok_r(NULL, ",", &save)) {
        if (!strcmp(t, "all")) {
            for (int i = 0; i < TKV_EVAL_TASK_COUNT; i++) {
                bool have = false;
                for (uint32_t j = 0; j < o->n_tasks; j++)
                    have |= o->tasks[j] == i;
                if (!have)
                    o->tasks[o->n_tasks++] = i;
            }
            continue;
        }
        int id = tkv_eval_task_parse(t);
        if (id < 0) {
            rc = usage_error("unknown task '%s' (niah_single, niah_multikey, niah_multivalue, niah_multiquery, "
                             "vt, cwe, fwe, passkey or all)", t);
            break;
        }
        bool have = false;
        for (uint32_t j = 0; j < o->n_tasks; j++)
            have |= o->tasks[j] == id;
        if (!have)
            o->tasks[o->n_tasks++] = id;
    }
    free(copy);
    return rc;
}

/* "snapkv:window=32,kernel=7,streaming" -> "snapkv:window=32,kernel=7", "streaming" */
static int add_policies(struct opts *o, const char *list)
{
    const char *p = list;
    while (*p) {
        const char *end = strchr(p, ',');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        if (len == 0)
            return usage_error("empty policy in '%s'", list);
        const bool continuation = memchr(p, '=', len) && !memchr(p, ':', len) && o->n_policies > 0;
        if (continuation) {
            char *prev = o->policies[o->n_policies - 1];
            size_t plen = strlen(prev);
            char *grown = realloc(prev, plen + len + 2);
            if (!grown)
                return usage_error("%s", "out of memory");
            grown[plen] = ',';
            memcpy(grown + plen + 1, p, len);
            grown[plen + 1 + len] = 0;
            o->policies[o->n_policies - 1] = grown;
        } else {
            if (o->n_policies == MAX_POLICIES)
                return usage_error("more than %s policies", "32");
            char *spec = strndup(p, len);
            if (!spec)
                return usage_error("%s", "out of memory");
            o->policies[o->n_policies++] = spec;
        }
        p += len;
        if (*p == ',')
            p++;
    }
    return 0;
}

static int add_budgets(struct opts *o, const char *list)
{
    char *copy = strdup(list), *save = NULL;
    if (!copy)
        return usage_error("%s", "out of memory");
    int rc = 0;
    for (char *t = strtok_r(copy, ",", &save); t && !rc; t = strtok_r(NULL, ",", &save)) {
        uint32_t b;
        if (!cli_parse_u32(t, &b))
            rc = usage_error("--budget expects token counts, got '%s'", t);
        else if (o->n_budgets == MAX_BUDGETS)
            rc = usage_error("more than %s budgets", "64");
        else
            o->budgets[o->n_budgets++] = b;
    }
    free(copy);
    return rc;
}

static int parse_opts(int argc, char **argv, struct opts *o)
{
    *o = (struct opts){.ctx = 4096, .samples = 10, .seed = 42, .device = "cpu"};
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        int rc = 0;
#define IS(s, l) cli_is_opt(a, s, l)
#define VALUE()                                                  \
    do {                                                         \
        if (!v)                                                  \
            return usage_error("option '%s' needs a value", a); \
        i++;                                                     \
    } while (0)
        if (IS("-h", "--help")) {
            print_eval_help();
            opts_free(o);
            exit(0);
        } else if (IS("-m", "--model")) {
            VALUE();
            o->model = v;
        } else if (IS("--task", "--tasks")) {
            VALUE();
            rc = add_tasks(o, v);
        } else if (IS("-c", "--ctx")) {
            VALUE();
            if (!cli_parse_u32(v, &o->ctx) || o->ctx < 64 || o->ctx > (1u << 24))
                return usage_error("--ctx expects 64..16777216 tokens, got '%s'", v);
        } else if (IS("--samples", NULL)) {
            VALUE();
            if (!cli_parse_u32(v, &o->samples) || o->samples == 0)
                return usage_error("--samples expects a count >= 1, got '%s'", v);
        } else if (IS("--first-sample", NULL)) {
            VALUE();
            if (!cli_parse_u32(v, &o->first_sample) || o->first_sample > (1u << 30))
                return usage_error("--first-sample expects a sample index, got '%s'", v);
        } else if (IS("--seed", NULL)) {
            VALUE();
            if (!cli_parse_u64(v, &o->seed))
                return usage_error("--seed expects a non-negative integer, got '%s'", v);
        } else if (IS("--policy", "--policies")) {
            VALUE();
            rc = add_policies(o, v);
        } else if (IS("--budget", "--budgets")) {
            VALUE();
            rc = add_budgets(o, v);
        } else if (IS("--max-gen", NULL)) {
            VALUE();
            if (!cli_parse_u32(v, &o->max_gen) || o->max_gen == 0 || o->max_gen > 65536)
                return usage_error("--max-gen expects 1..65536 tokens, got '%s'", v);
        } else if (IS("--out", "-o")) {
            VALUE();
            o->out = v;
        } else if (IS("--plot", NULL)) {
            VALUE();
            o->plot = v;
        } else if (IS("--keep-going", NULL)) {
            o->keep_going = true;
        } else if (IS("-t", "--threads")) {
            VALUE();
            if (!cli_parse_u32(v, &o->threads) || o->threads == 0 || o->threads > 1024)
                return usage_error("-t expects 1..1024 threads, got '%s'", v);
        } else if (IS("--device", NULL)) {
            VALUE();
            o->device = v;
        } else if (IS("--kv-block", NULL)) {
            VALUE();
            if (!cli_parse_u32(v, &o->kv_block))
                return usage_error("--kv-block expects a token count, got '%s'", v);
        } else if (IS("-v", "--verbose")) {
            o->verbose = true;
        } else {
            return usage_error("unknown option '%s'", a);
        }
        if (rc)
            return rc;
#undef IS
#undef VALUE
    }
    if (!o->model)
        return usage_error("%s", "no model given: use -m FILE.gguf");
    if (o->n_tasks == 0)
        return usage_error("%s", "no task given: use --task niah_single,... or --task all");
    if (!o->out)
        return usage_error("%s", "no output file given: use --out FILE.json");
    if (o->n_policies == 0 && add_policies(o, "full"))
        return 1;
    if (o->n_budgets == 0)
        o->budgets[o->n_budgets++] = 0;
    if (access(o->model, R_OK) != 0) {
        fprintf(stderr, "%s: cannot read model '%s': %s\n", prog, o->model, strerror(errno));
        return 1;
    }
    return 0;
}

/* ---- results ------------------------------------------------------------------------ */

struct cell {
    double score_sum, kl_sum, mass_sum, seconds;
    double read_tok_sum, read_blk_sum; /* share of the context decode read, per sample (mass_n of them) */
    uint64_t steps, agree;
    uint32_t n, mass_n, free_runs, fresh;
    bool failed;
    char error[512];
};

struct task_stats {
    double wall_s, prompt_tokens, units, answer_tokens, full_score;
    uint32_t n;
};

struct run {
    struct opts *o;
    tkv_model *model;
    struct tkv_model_info info;
    struct tkv_eval_lm lm;
    uint32_t n_vocab;
    struct cell *cells;      /* [task][policy][budget] */
    struct task_stats *stats; /* [task] */
    double t0;
};

static struct cell *cell_at(struct run *r, uint32_t t, uint32_t p, uint32_t b)
{
    return &r->cells[((size_t)t * r->o->n_policies + p) * r->o->n_budgets + b];
}

static bool is_full(const char *spec) { return !strcmp(spec, "full"); }

/* One line naming the policy and what went wrong; marks the policy's cells
 * of this task and the later ones failed (the earlier tasks' rows are
 * complete). Returns true to go on (--keep-going). */
static bool policy_failed(struct run *r, uint32_t from_task, uint32_t p, uint32_t b, tkv_status st, const char *what)
{
    const struct opts *o = r->o;
    char msg[512];
    snprintf(msg, sizeof msg, "%s: %s (%s)", what, tkv_last_error(), tkv_status_str(st));
    fprintf(stderr, "%s: policy '%s' (budget %u): %s; %s\n", prog, o->policies[p], o->budgets[b], msg,
            o->keep_going ? "skipping it (--keep-going)" : "stopping (--keep-going skips a failing policy)");
    for (uint32_t t = from_task; t < o->n_tasks; t++) {
        struct cell *c = cell_at(r, t, p, b);
        if (!c->failed) {
            c->failed = true;
            snprintf(c->error, sizeof c->error, "%s", msg);
        }
    }
    return o->keep_going;
}

/* ---- one sample -------------------------------------------------------------------- */

struct reference {
    tkv_token *answer;   /* [max_gen] full's greedy answer (no end token) */
    tkv_token *top;      /* [max_gen + 1] argmax at each answer step       */
    float *logp;         /* [(max_gen + 1) * n_vocab] full's log-probabilities */
    uint32_t n_answer;   /* T */
    uint32_t n_steps;    /* S: T, plus the step that chose the end token  */
    char *text;          /* detokenized answer                             */
};

static void log_softmax(const float *logits, uint32_t n, float *out)
{
    float mx = logits[0];
    for (uint32_t i = 1; i < n; i++)
        mx = logits[i] > mx ? logits[i] : mx;
    double z = 0;
    for (uint32_t i = 0; i < n; i++)
        z += exp((double)logits[i] - mx);
    const double lse = mx + log(z);
    for (uint32_t i = 0; i < n; i++)
        out[i] = (float)((double)logits[i] - lse);
}

/* KL(p || q) with p given as log-probabilities and q as logits. */
static double kl_div(const float *logp, const float *q_logits, uint32_t n)
{
    float mx = q_logits[0];
    for (uint32_t i = 1; i < n; i++)
        mx = q_logits[i] > mx ? q_logits[i] : mx;
    double z = 0;
    for (uint32_t i = 0; i < n; i++)
        z += exp((double)q_logits[i] - mx);
    const double lse = mx + log(z);
    double kl = 0;
    for (uint32_t i = 0; i < n; i++) {
        const double lp = logp[i];
        if (lp > -80.0)
            kl += exp(lp) * (lp - ((double)q_logits[i] - lse));
    }
    return kl > 0 ? kl : 0;
}

static struct tkv_session_params base_params(const struct run *r, uint32_t n_ctx)
{
    struct tkv_session_params sp = tkv_session_default_params();
    sp.n_ctx = n_ctx;
    sp.n_threads = r->o->threads;
    sp.device = r->o->device;
    sp.kv_block = r->o->kv_block;
    sp.policy = "full";
    return sp;
}

/* Greedy decoding from the session's current logits; *out_text = answer. */
static tkv_status greedy(struct run *r, tkv_session *s, uint32_t max_gen, char **out_text)
{
    tkv_token *ans = malloc((size_t)max_gen * sizeof *ans);
    if (!ans)
        return TKV_ERR_NOMEM;
    uint32_t n = 0;
    tkv_status st = TKV_OK;
    while (n < max_gen) {
        const tkv_token t = tkv_argmax(tkv_logits(s), r->n_vocab);
        if (tkv_token_is_eog(r->model, t))
            break;
        ans[n++] = t;
        if (n < max_gen && (st = tkv_decode(s, t)) != TKV_OK)
            break;
    }
    if (st == TKV_OK && !(*out_text = cli_detokenize(r->model, ans, n)))
        st = TKV_ERR_NOMEM;
    free(ans);
    return st;
}

/* The reference pass on R = fork(P, full). */
static tkv_status run_reference(struct run *r, tkv_session *P, uint32_t n_ctx, uint32_t max_gen,
                                struct reference *ref)
{
    struct tkv_session_params sp = base_params(r, n_ctx);
    tkv_session *R = NULL;
    CLI_TRY(tkv_session_fork(P, &sp, &R));
    tkv_status st = TKV_OK;
    ref->n_answer = ref->n_steps = 0;
    for (;;) {
        const float *logits = tkv_logits(R);
        const uint32_t t = ref->n_steps++;
        log_softmax(logits, r->n_vocab, ref->logp + (size_t)t * r->n_vocab);
        const tkv_token top = tkv_argmax(logits, r->n_vocab);
        ref->top[t] = top;
        if (tkv_token_is_eog(r->model, top))
            break;
        ref->answer[ref->n_answer++] = top;
        if (ref->n_answer == max_gen)
            break;
        if ((st = tkv_decode(R, top)) != TKV_OK)
            break;
    }
    tkv_session_free(R);
    if (st == TKV_OK && !(ref->text = cli_detokenize(r->model, ref->answer, ref->n_answer)))
        st = TKV_ERR_NOMEM;
    return st;
}

/* A session holding the prompt under (policy, budget): a fork of P, or a
 * fresh prefill when the policy changes the prefill itself. */
static tkv_status open_policy(struct run *r, tkv_session *P, const tkv_token *toks, size_t n,
                              const struct tkv_session_params *sp, tkv_session **out, bool *fresh)
{
    tkv_status st = tkv_session_fork(P, sp, out);
    *fresh = false;
    if (st != TKV_ERR_UNSUPPORTED)
        return st;
    *fresh = true;
    if ((st = tkv_session_init(r->model, sp, out)) != TKV_OK)
        return st;
    if ((st = tkv_prefill(*out, toks, n)) != TKV_OK) {
        tkv_session_free(*out);
        *out = NULL;
    }
    return st;
}

/* Teacher forcing and, when needed, free-running generation under one
 * (policy, budget). *what names the step that failed. */
static tkv_status run_policy(struct run *r, const struct tkv_eval_sample *smp, tkv_session *P, const tkv_token *toks,
                             size_t n, uint32_t n_ctx, uint32_t max_gen, const struct reference *ref, uint32_t p,
                             uint32_t b, struct cell *c, const char **what)
{
    const struct opts *o = r->o;
    const double t0 = cli_now();
    struct tkv_session_params sp = base_params(r, n_ctx);
    sp.policy = o->policies[p];
    sp.kv_budget = o->budgets[b];
    sp.flags = TKV_SESSION_MEASURE_MASS;
    tkv_session *A = NULL;
    bool fresh;
    *what = "open a session (fork or prefill)";
    CLI_TRY(open_policy(r, P, toks, n, &sp, &A, &fresh));
    double kl = 0;
    uint32_t agree = 0;
    bool diverged = false;
    tkv_status st = TKV_OK;
    *what = "teacher-forced decoding";
    for (uint32_t t = 0; t < ref->n_steps && st == TKV_OK; t++) {
        const float *q = tkv_logits(A);
        kl += kl_div(ref->logp + (size_t)t * r->n_vocab, q, r->n_vocab);
        const bool same = tkv_argmax(q, r->n_vocab) == ref->top[t];
        agree += same;
        diverged |= !same;
        if (t + 1 < ref->n_steps)
            st = tkv_decode(A, ref->answer[t]);
    }
    const double mass = tkv_session_mass_kept(A);
    double read_tok, read_blk;
    tkv_session_kv_read(A, &read_tok, &read_blk);
    tkv_session_free(A);
    if (st != TKV_OK)
        return st;
    char *text = NULL;
    if (diverged) {
        sp.flags = 0;
        tkv_session *B = NULL;
        *what = "free-running generation";
        CLI_TRY(open_policy(r, P, toks, n, &sp, &B, &fresh));
        st = greedy(r, B, max_gen, &text);
        tkv_session_free(B);
        if (st != TKV_OK)
            return st;
        c->free_runs++;
    }
    const double score = tkv_eval_score(smp, text ? text : ref->text);
    if (o->verbose)
        fprintf(stderr, "    %s@%u answer: %s\n", o->policies[p], o->budgets[b], text ? text : "(same as full)");
    free(text);
    c->score_sum += score;
    c->kl_sum += kl;
    c->steps += ref->n_steps;
    c->agree += agree;
    if (ref->n_steps > 1) { /* mass is measured at decode steps */
        c->mass_sum += mass;
        c->read_tok_sum += read_tok;
        c->read_blk_sum += read_blk;
        c->mass_n++;
    }
    c->fresh += fresh;
    c->n++;
    c->seconds += cli_now() - t0;
    fprintf(stderr,
            "    %-28s budget %-6u score %.2f  kl %.4f  top1 %.3f  mass %.3f  read %.3f (blocks %.3f)%s%s  (%.1f s)\n",
            o->policies[p], o->budgets[b], score, kl / ref->n_steps, (double)agree / ref->n_steps,
            ref->n_steps > 1 ? mass : 1.0, ref->n_steps > 1 ? read_tok : 1.0, ref->n_steps > 1 ? read_blk : 1.0,
            fresh ? "  [own prefill]" : "", diverged ? "  [free-running]" : "", cli_now() - t0);
    return TKV_OK;
}

static int run_sample(struct run *r, uint32_t ti, uint32_t index)
{
    const struct opts *o = r->o;
    const enum tkv_eval_task task = (enum tkv_eval_task)o->tasks[ti];
    const struct tkv_eval_task_info *info = tkv_eval_task_get(task);
    const uint32_t max_gen = o->max_gen ? o->max_gen : info->tokens_to_generate;
    struct tkv_eval_sample smp;
    tkv_status st = tkv_eval_generate(&r->lm, task, o->ctx, o->seed, index, &smp);
    if (st != TKV_OK) {
        fprintf(stderr, "%s: cannot generate %s sample %u: %s (%s)\n", prog, info->name, index, tkv_last_error(),
                tkv_status_str(st));
        return 1;
    }
    size_t n = 0;
    tkv_token *toks = cli_tokenize(r->model, smp.prompt, TKV_EVAL_TOK_FLAGS, &n);
    struct reference ref = {0};
    tkv_session *P = NULL;
    int rc = 1;
    if (!toks) {
        fprintf(stderr, "%s: %s sample %u: tokenize: %s\n", prog, info->name, index, tkv_last_error());
        goto out;
    }
    const uint32_t n_ctx = (uint32_t)(n + max_gen + 1 > o->ctx ? n + max_gen + 1 : o->ctx);
    ref.answer = malloc((size_t)max_gen * sizeof *ref.answer);
    ref.top = malloc(((size_t)max_gen + 1) * sizeof *ref.top);
    ref.logp = malloc(((size_t)max_gen + 1) * r->n_vocab * sizeof *ref.logp);
    if (!ref.answer || !ref.top || !ref.logp) {
        fprintf(stderr, "%s: out of memory\n", prog);
        goto out;
    }
    struct tkv_session_params sp = base_params(r, n_ctx);
    const double tp = cli_now();
    if ((st = tkv_session_init(r->model, &sp, &P)) != TKV_OK || (st = tkv_prefill(P, toks, n)) != TKV_OK) {
        fprintf(stderr, "%s: full prefill: %s (%s)\n", prog, tkv_last_error(), tkv_status_str(st));
        goto out;
    }
    const double prefill_s = cli_now() - tp;
    if ((st = run_reference(r, P, n_ctx, max_gen, &ref)) != TKV_OK) {
        fprintf(stderr, "%s: full generation: %s (%s)\n", prog, tkv_last_error(), tkv_status_str(st));
        goto out;
    }
    const double full_score = tkv_eval_score(&smp, ref.text);
    struct task_stats *ts = &r->stats[ti];
    ts->prompt_tokens += (double)n;
    ts->units += smp.units;
    ts->answer_tokens += ref.n_answer;
    ts->full_score += full_score;
    ts->n++;
    fprintf(stderr, "[%s %u/%u] %zu tokens (%u %s), full: prefill %.1f s, %u answer tokens in %.1f s, score %.2f"
                    "  [%.0f s elapsed]\n",
            info->name, index - o->first_sample + 1, o->samples, n, smp.units, info->unit, prefill_s, ref.n_answer,
            cli_now() - tp - prefill_s, full_score, cli_now() - r->t0);
    if (o->verbose) {
        fprintf(stderr, "    references:");
        for (uint32_t i = 0; i < smp.n_refs; i++)
            fprintf(stderr, " %s", smp.refs[i]);
        fprintf(stderr, "\n    full answer: %s\n", ref.text);
    }
    for (uint32_t p = 0; p < o->n_policies; p++)
        for (uint32_t b = 0; b < o->n_budgets; b++) {
            struct cell *c = cell_at(r, ti, p, b);
            if (c->failed)
                continue;
            if (is_full(o->policies[p])) { /* the reference row */
                c->score_sum += full_score;
                c->steps += ref.n_steps;
                c->agree += ref.n_steps;
                c->n++;
                continue;
            }
            const char *what = "";
            if ((st = run_policy(r, &smp, P, toks, n, n_ctx, max_gen, &ref, p, b, c, &what)) != TKV_OK &&
                !policy_failed(r, ti, p, b, st, what))
                goto out;
        }
    rc = 0;
out:
    tkv_session_free(P);
    free(ref.answer);
    free(ref.top);
    free(ref.logp);
    free(ref.text);
    free(toks);
    tkv_eval_sample_free(&smp);
    return rc;
}

/* ---- output ------------------------------------------------------------------------ */

static void json_str(FILE *f, const char *s)
{
    fputc('"', f);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\')
            fprintf(f, "\\%c", *p);
        else if (*p < 0x20)
            fprintf(f, "\\u%04x", *p);
        else
            fputc(*p, f);
    }
    fputc('"', f);
}

static void json_num(FILE *f, double v, bool valid)
{
    if (valid && isfinite(v))
        fprintf(f, "%.6g", v);
    else
        fputs("null", f);
}

/* Writes the results so far to o->out (through a temporary file renamed
 * over it, so a run killed at any moment leaves the last complete file);
 * complete: every sample of every task has run. */
static int write_json(const struct run *r, double wall_s, bool complete)
{
    const struct opts *o = r->o;
    char tmp[4096];
    if (snprintf(tmp, sizeof tmp, "%s.part", o->out) >= (int)sizeof tmp) {
        fprintf(stderr, "%s: output path too long: '%s'\n", prog, o->out);
        return 1;
    }
    FILE *f = fopen(tmp, "w");
    if (!f) {
        fprintf(stderr, "%s: cannot write '%s': %s\n", prog, tmp, strerror(errno));
        return 1;
    }
    fprintf(f, "{\n  \"tool\": \"tierkv eval\",\n  \"version\": \"%d.%d.%d\",\n  \"model\": ", TKV_VERSION_MAJOR,
            TKV_VERSION_MINOR, TKV_VERSION_PATCH);
    json_str(f, o->model);
    fputs(",\n  \"model_name\": ", f);
    json_str(f, r->info.name);
    fprintf(f, ",\n  \"ctx\": %u,\n  \"samples\": %u,\n  \"first_sample\": %u,\n  \"complete\": %s,\n  \"seed\": %llu,\n"
               "  \"max_gen\": ",
            o->ctx, o->samples, o->first_sample, complete ? "true" : "false", (unsigned long long)o->seed);
    if (o->max_gen)
        fprintf(f, "%u", o->max_gen);
    else
        fputs("null", f);
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    fprintf(f, ",\n  \"threads\": %u,\n  \"device\": ", o->threads ? o->threads : (unsigned)(cores > 0 ? cores : 1));
    json_str(f, o->device);
    fprintf(f, ",\n  \"wall_s\": %.3f,\n  \"tasks\": [", wall_s);
    for (uint32_t t = 0; t < o->n_tasks; t++) {
        const struct tkv_eval_task_info *ti = tkv_eval_task_get((enum tkv_eval_task)o->tasks[t]);
        const struct task_stats *ts = &r->stats[t];
        const double n = ts->n ? ts->n : 1;
        fprintf(f, "%s\n    {\"task\": \"%s\", \"tokens_to_generate\": %u, \"max_gen\": %u, \"wall_s\": %.3f, "
                   "\"samples\": %u, \"prompt_tokens_mean\": %.1f, \"haystack_mean\": %.1f, \"haystack_unit\": \"%s\", "
                   "\"full_answer_tokens_mean\": %.1f, \"full_score\": ",
                t ? "," : "", ti->name, ti->tokens_to_generate, o->max_gen ? o->max_gen : ti->tokens_to_generate,
                ts->wall_s, ts->n, ts->prompt_tokens / n, ts->units / n, ti->unit, ts->answer_tokens / n);
        json_num(f, ts->full_score / n, ts->n > 0);
        fputc('}', f);
    }
    fputs("\n  ],\n  \"results\": [", f);
    bool first = true;
    for (uint32_t t = 0; t < o->n_tasks; t++)
        for (uint32_t p = 0; p < o->n_policies; p++)
            for (uint32_t b = 0; b < o->n_budgets; b++) {
                const struct cell *c = cell_at((struct run *)r, t, p, b);
                const bool ok = c->n > 0;
                fprintf(f, "%s\n    {\"task\": \"%s\", \"policy\": ", first ? "" : ",",
                        tkv_eval_task_get((enum tkv_eval_task)o->tasks[t])->name);
                first = false;
                json_str(f, o->policies[p]);
                fprintf(f, ", \"budget\": %u, \"ctx\": %u, \"samples\": %u, \"score\": ", o->budgets[b], o->ctx, c->n);
                json_num(f, c->score_sum / (c->n ? c->n : 1), ok);
                fputs(", \"kl\": ", f);
                json_num(f, c->steps ? c->kl_sum / (double)c->steps : 0.0, ok);
                fputs(", \"top1\": ", f);
                json_num(f, c->steps ? (double)c->agree / (double)c->steps : 1.0, ok);
                fputs(", \"mass_kept\": ", f);
                json_num(f, c->mass_n ? c->mass_sum / c->mass_n : 1.0, ok);
                fputs(", \"kv_read\": ", f);
                json_num(f, c->mass_n ? c->read_tok_sum / c->mass_n : 1.0, ok);
                fputs(", \"kv_read_blocks\": ", f);
                json_num(f, c->mass_n ? c->read_blk_sum / c->mass_n : 1.0, ok);
                fprintf(f, ", \"answer_steps\": %llu, \"mass_samples\": %u, \"policy_s\": %.3f, \"free_runs\": %u, "
                           "\"own_prefills\": %u",
                        (unsigned long long)c->steps, c->mass_n, c->seconds, c->free_runs, c->fresh);
                if (c->failed) {
                    fputs(", \"error\": ", f);
                    json_str(f, c->error);
                }
                fputc('}', f);
            }
    fputs("\n  ]\n}\n", f);
    if (ferror(f) | (fclose(f) != 0) || rename(tmp, o->out) != 0) {
        fprintf(stderr, "%s: cannot write '%s': %s\n", prog, o->out, strerror(errno));
        remove(tmp);
        return 1;
    }
    return 0;
}

/* 'text' for gnuplot: single quotes, a quote doubled. */
static void gp_str(FILE *f, const char *s)
{
    fputc('\'', f);
    for (; *s; s++) {
        if (*s == '\'')
            fputc('\'', f);
        if ((unsigned char)*s >= 0x20)
            fputc(*s, f);
    }
    fputc('\'', f);
}

static bool in_path(const char *name)
{
    const char *path = getenv("PATH");
    if (!path)
        return false;
    char *copy = strdup(path), *save = NULL;
    bool found = false;
    for (char *d = copy ? strtok_r(copy, ":", &save) : NULL; d && !found; d = strtok_r(NULL, ":", &save)) {
        char full[PATH_MAX];
        struct stat st;
        if (snprintf(full, sizeof full, "%s/%s", d, name) < (int)sizeof full && stat(full, &st) == 0 &&
            S_ISREG(st.st_mode) && access(full, X_OK) == 0)
            found = true;
    }
    free(copy);
    return found;
}

static int plot(const struct run *r)
{
    const struct opts *o = r->o;
    if (!in_path("gnuplot")) {
        fprintf(stderr, "%s: --plot needs gnuplot, which is not installed: apt-get install gnuplot-nox\n", prog);
        return 1;
    }
    FILE *f = popen("gnuplot", "w");
    if (!f) {
        fprintf(stderr, "%s: cannot run gnuplot: %s\n", prog, strerror(errno));
        return 1;
    }
    uint32_t cols = 1;
    while (cols * cols < o->n_tasks)
        cols++;
    const uint32_t rows = (o->n_tasks + cols - 1) / cols;
    uint32_t bmin = UINT32_MAX, bmax = 0;
    for (uint32_t b = 0; b < o->n_budgets; b++) {
        bmin = o->budgets[b] < bmin ? o->budgets[b] : bmin;
        bmax = o->budgets[b] > bmax ? o->budgets[b] : bmax;
    }
    /* data blocks: one per (task, policy) with results */
    for (uint32_t t = 0; t < o->n_tasks; t++)
        for (uint32_t p = 0; p < o->n_policies; p++) {
            fprintf(f, "$d%u_%u << EOD\n", t, p);
            uint32_t order[MAX_BUDGETS];
            for (uint32_t b = 0; b < o->n_budgets; b++)
                order[b] = b;
            for (uint32_t i = 1; i < o->n_budgets; i++) /* by budget */
                for (uint32_t j = i; j > 0 && o->budgets[order[j - 1]] > o->budgets[order[j]]; j--) {
                    uint32_t x = order[j];
                    order[j] = order[j - 1];
                    order[j - 1] = x;
                }
            for (uint32_t i = 0; i < o->n_budgets; i++) {
                const struct cell *c = cell_at((struct run *)r, t, p, order[i]);
                if (c->n)
                    fprintf(f, "%u %.6g\n", o->budgets[order[i]], c->score_sum / c->n);
            }
            fputs("EOD\n", f);
        }
    fprintf(f, "if (strstrt(GPVAL_TERMINALS, 'pngcairo') > 0) set terminal pngcairo size %u,%u noenhanced; "
               "else set terminal png size %u,%u\n",
            640 * cols, 420 * rows + 40, 640 * cols, 420 * rows + 40);
    fputs("set output ", f);
    gp_str(f, o->plot);
    fputs("\nset termoption noenhanced\nset grid\nset key outside right top\nset yrange [0:1.05]\n"
          "set xlabel 'KV budget (tokens per KV head)'\nset ylabel 'score'\n",
          f);
    if (bmin > 0 && bmax >= 4 * bmin)
        fputs("set logscale x 2\n", f);
    if (o->n_budgets == 1)
        fprintf(f, "set xrange [%g:%g]\n", bmin * 0.5 - 1, bmax * 1.5 + 1);
    char title[512];
    const char *base = strrchr(o->model, '/');
    snprintf(title, sizeof title, "%s, ctx %u, %u samples per task", base ? base + 1 : o->model, o->ctx, o->samples);
    fprintf(f, "set multiplot layout %u,%u title ", rows, cols);
    gp_str(f, title);
    fputc('\n', f);
    for (uint32_t t = 0; t < o->n_tasks; t++) {
        fputs("set title ", f);
        gp_str(f, tkv_eval_task_get((enum tkv_eval_task)o->tasks[t])->name);
        fputs("\nplot ", f);
        bool any = false;
        for (uint32_t p = 0; p < o->n_policies; p++) {
            bool has = false;
            for (uint32_t b = 0; b < o->n_budgets; b++)
                has |= cell_at((struct run *)r, t, p, b)->n > 0;
            if (!has)
                continue;
            static const int pts[] = {7, 5, 9, 11, 13, 4, 6, 8, 10, 12};
            fprintf(f, "%s$d%u_%u using 1:2 with linespoints lw 2 ps 1.3 pt %d dt %u lc %u title ", any ? ", " : "", t,
                    p, pts[p % 10], p % 5 + 1, p + 1);
            gp_str(f, o->policies[p]);
            any = true;
        }
        if (!any)
            fputs("2 title 'no results'", f);
        fputc('\n', f);
    }
    fputs("unset multiplot\n", f);
    int status = pclose(f);
    if (status != 0) {
        fprintf(stderr, "%s: gnuplot failed (status %d) drawing '%s'\n", prog, status, o->plot);
        return 1;
    }
    fprintf(stderr, "%s: plot written to %s\n", prog, o->plot);
    return 0;
}

static void print_summary(const struct run *r)
{
    const struct opts *o = r->o;
    fprintf(stderr, "\n%-16s %-28s %7s %7s %9s %7s %9s %7s %7s\n", "task", "policy", "budget", "score", "kl", "top1",
            "mass_kept", "kv_read", "blocks");
    for (uint32_t t = 0; t < o->n_tasks; t++)
        for (uint32_t p = 0; p < o->n_policies; p++)
            for (uint32_t b = 0; b < o->n_budgets; b++) {
                const struct cell *c = cell_at((struct run *)r, t, p, b);
                const char *name = tkv_eval_task_get((enum tkv_eval_task)o->tasks[t])->name;
                if (!c->n) {
                    fprintf(stderr, "%-16s %-28s %7u %s\n", name, o->policies[p], o->budgets[b],
                            c->failed ? "failed" : "no samples");
                    continue;
                }
                fprintf(stderr, "%-16s %-28s %7u %7.3f %9.4f %7.3f %9.3f %7.3f %7.3f\n", name, o->policies[p],
                        o->budgets[b], c->score_sum / c->n, c->steps ? c->kl_sum / (double)c->steps : 0.0,
                        c->steps ? (double)c->agree / (double)c->steps : 1.0, c->mass_n ? c->mass_sum / c->mass_n : 1.0,
                        c->mass_n ? c->read_tok_sum / c->mass_n : 1.0, c->mass_n ? c->read_blk_sum / c->mass_n : 1.0);
            }
}

/* ---- the command ------------------------------------------------------------------ */

/* Every non-full (policy, budget) is checked once by opening a small session
 * with it, so a misspelt policy fails in a second, not after the first
 * prefill. Returns false to stop. */
static bool preflight(struct run *r)
{
    const struct opts *o = r->o;
    for (uint32_t p = 0; p < o->n_policies; p++)
        for (uint32_t b = 0; b < o->n_budgets; b++) {
            if (is_full(o->policies[p]))
                continue;
            struct tkv_session_params sp = base_params(r, o->ctx);
            sp.policy = o->policies[p];
            sp.kv_budget = o->budgets[b];
            sp.flags = TKV_SESSION_MEASURE_MASS;
            tkv_session *s = NULL;
            tkv_status st = tkv_session_init(r->model, &sp, &s);
            tkv_session_free(s);
            if (st != TKV_OK && !policy_failed(r, 0, p, b, st, "cannot start a session"))
                return false;
        }
    return true;
}

int cmd_eval(int argc, char **argv)
{
    struct opts o;
    int rc = parse_opts(argc, argv, &o);
    if (rc) {
        opts_free(&o);
        return rc;
    }
    struct run r = {.o = &o, .t0 = cli_now()};
    rc = 1;
    tkv_status st = tkv_model_load(o.model, &r.model);
    if (st != TKV_OK) {
        fprintf(stderr, "%s: cannot load model: %s (%s)\n", prog, tkv_last_error(), tkv_status_str(st));
        goto out;
    }
    tkv_model_get_info(r.model, &r.info);
    r.n_vocab = tkv_model_n_vocab(r.model);
    if ((st = tkv_eval_lm_init(r.model, &r.lm)) != TKV_OK) {
        fprintf(stderr, "%s: %s\n", prog, tkv_last_error());
        goto out;
    }
    r.cells = calloc((size_t)o.n_tasks * o.n_policies * o.n_budgets, sizeof *r.cells);
    r.stats = calloc(o.n_tasks, sizeof *r.stats);
    if (!r.cells || !r.stats) {
        fprintf(stderr, "%s: out of memory\n", prog);
        goto out;
    }
    if (o.ctx > r.info.n_ctx_train)
        fprintf(stderr, "%s: note: --ctx %u is beyond the model's trained context of %u tokens\n", prog, o.ctx,
                r.info.n_ctx_train);
    if (!preflight(&r))
        goto out;
    for (uint32_t t = 0; t < o.n_tasks; t++) {
        const double t0 = cli_now();
        for (uint32_t i = 0; i < o.samples; i++) {
            if (run_sample(&r, t, o.first_sample + i))
                goto out;
            r.stats[t].wall_s = cli_now() - t0;
            /* after every sample: a run stopped early keeps what it measured */
            if (write_json(&r, cli_now() - r.t0, false))
                goto out;
        }
        fprintf(stderr, "%s: %s: %u samples in %.1f s\n", prog,
                tkv_eval_task_get((enum tkv_eval_task)o.tasks[t])->name, o.samples, r.stats[t].wall_s);
    }
    const double wall = cli_now() - r.t0;
    print_summary(&r);
    if ((rc = write_json(&r, wall, true)) != 0)
        goto out;
    fprintf(stderr, "%s: results written to %s (%.1f s in all)\n", prog, o.out, wall);
    if (o.plot)
        rc = plot(&r);
out:
    free(r.cells);
    free(r.stats);
    tkv_eval_lm_free(&r.lm);
    tkv_model_free(r.model);
    opts_free(&o);
    return rc;
}
