/*
 * bench-recall.c -- decode speed with the KV spread over the tiers and a
 * selecting policy recalling what each step reads (issue 6, item 7), beside
 * `full` with all KV in the compute tier; per-step time split and link use.
 *
 *   bench-recall -m MODEL [--device cpu|cuda] [--ctx 32768,131072] [--steps 16] [--warmup 3]
 *                [--split-steps 8] [--policy SPEC]... [--cap-full]
 *                [--gpu-kv-mem SIZE] [--host-kv-mem SIZE] [--nvme-dir DIR] [--nvme-kv-max SIZE]
 *                [--hetero auto|recall|cpu] [--kv-block N] [-t threads] [--real 512] [--seed S]
 *                [--hot-spread 4] [--cold-spread 0.25] [--hot-every 64] [--recent-blocks 2] [--uniform]
 *                [--forced] [-j out.jsonl]
 *
 * A separate program from bench-decode (whose table is the roofline of
 * `full` with the whole KV in the compute tier): here every row is a
 * (context, policy) pair under tier caps, with columns bench-decode has no
 * use for. Policies are given one --policy each (specs hold commas; default
 * `full` and `rabitq:p=0.9`; "SPEC;no-prefetch": SPEC without the prefetch
 * of the next layer's selection of the step before). The tier options go
 * into the session exactly as `tierkv run` passes them, and so does --kv-block
 * (tokens per KV block: what a recall moves, 64 by default); `full` rows leave the caps out (all KV in the
 * compute tier, "where it fits": a session that cannot hold it is a row
 * saying so) unless --cap-full.
 *
 * Per row: a fresh session; the context made by the synthetic fill
 * (runtime/kv-synth.h: --real tokens prefilled, the rest copies of their KV
 * blocks with their keys moved so that attention concentrates on hot blocks:
 * the knobs --hot-spread and --cold-spread (the copies' logit sd in nats, set
 * per head against the model's own), --hot-every, --recent-blocks; --uniform:
 * plain copies); the same token ids for every row of a context (random, from
 * the context and --seed: the fill's concentration, and so what a selection
 * reads and recalls, varies widely with them -- docs/bench-decode.md). Then
 * --warmup untimed steps (a rabitq index encodes the synthetic keys in the
 * first: the fill leaves them pending), --steps timed steps (tok/s), and
 * --split-steps more with the phase timers synchronizing the backend at their
 * edges (kv-synth.h, tkv_session_set_phase_sync), from which the split comes:
 *
 *   select   the policy's selection (index estimate + top-p), per step
 *   attn     the device's attention op (with a host split: + the wait for
 *            its partial and the merge)
 *   cpu attn the CPU's attention over blocks left on the host tier
 *   stall    inside the store's begin_layer: recalls issued and waited for,
 *            host reads verified -- the exposed recall stall
 *   rest     the split step's time less the four above: the weights' ops
 *            (matmuls, norms, RoPE, embedding, logits) and small host work;
 *            a residual, so the columns sum to the split step by construction
 *
 * hot blk: the share of the copied blocks the fill made hot (per head:
 * what a selection that found exactly them would read beyond the real
 * prefix and the recent tokens).
 * read tok / read blk: the share of the context's tokens / KV blocks decode
 * attention read, averaged over the timed steps, layers and KV heads (1 for
 * `full`); head max: a layer's largest KV head share of the tokens,
 * averaged over the timed steps and layers (how unevenly a layer's heads
 * read). This is what the synthetic fill's concentration made the policy
 * read, not what a real model would: printed beside every row.
 * recall: bytes written into the compute tier per timed step (from host or
 * NVMe), their time at the measured link rate, the rate they reached over
 * the step (GB/s), and that rate over the link rate (PCIe util). Link rate
 * (cuda): pinned host -> device copies of 64 MiB through the backend, best
 * of 5; on the CPU there is no link (the compute tier is host memory; the
 * recalls come from NVMe) and the util column is "-".
 * = ref: timed-step tokens equal to the context's first row's (greedy:
 * the steps before the first that differs).
 * --forced: every step decodes the next of a fixed random token sequence
 * (from the context and --seed) instead of the greedy token, so every row
 * of a context decodes the same tokens: an A/B of two builds or knobs then
 * compares the same steps, where greedy tokens part at the first last-bit
 * difference and with them the selections; = ref then counts the steps
 * whose greedy prediction is the first row's, wherever they are.
 *
 * A second table splits the stall (tkv_kvs_stats.stall, per split step:
 * settle, evict, verify, upload issue / wait, nvme, other, summing to the
 * stall column) with the store's per-step work: recalled blocks, eviction
 * passes, slots scanned, blocks evicted and spilled, upload calls and
 * waits, bytes checksummed on the CPU (docs/bench-decode.md).
 *
 * With TKV_CUDA_PROFILE=1 (CUDA), each row's timed steps' op profile goes to
 * stderr (device time per op, events around each; the profiling itself
 * costs ~10% of the step).
 */
#include "runtime/backend.h"
#include "runtime/kv-synth.h"

#include "bench.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_POLICIES 8

static void usage(void)
{
    fprintf(stderr,
            "usage: bench-recall -m MODEL [--device cpu|cuda] [--ctx 32768,131072] [--steps 16] [--warmup 3]\n"
            "                    [--split-steps 8] [--policy SPEC]... [--cap-full]\n"
            "                    [--gpu-kv-mem SIZE] [--host-kv-mem SIZE] [--nvme-dir DIR] [--nvme-kv-max SIZE]\n"
            "                    [--hetero auto|recall|cpu] [--kv-block N] [-t threads] [--real 512] [--seed S]\n"
            "                    [--hot-spread 4] [--cold-spread 0.25] [--hot-every 64] [--recent-blocks 2] [--uniform]\n"
            "                    [--forced] [-j out.jsonl]\n");
}

static int die(const char *what)
{
    fprintf(stderr, "bench-recall: %s: %s\n", what, tkv_last_error());
    return 1;
}

/* "512M", "8G", "64K" (optionally with a B) or bytes; false if malformed. */
static bool parse_size(const char *s, uint64_t *out)
{
    char *end;
    const double v = strtod(s, &end);
    if (end == s || !(v >= 0))
        return false;
    double mul = 1;
    switch (*end) {
    case 'K': case 'k': mul = 1024.0, end++; break;
    case 'M': case 'm': mul = 1024.0 * 1024, end++; break;
    case 'G': case 'g': mul = 1024.0 * 1024 * 1024, end++; break;
    case 'T': case 't': mul = 1024.0 * 1024 * 1024 * 1024, end++; break;
    default: break;
    }
    if (*end == 'B' || *end == 'b')
        end++;
    if (*end)
        return false;
    *out = (uint64_t)(v * mul);
    return true;
}

static void fmt_size(char *out, size_t cap, uint64_t b)
{
    if (b >= (1ull << 30))
        snprintf(out, cap, "%.4gG", b / (double)(1ull << 30));
    else
        snprintf(out, cap, "%.4gM", b / (double)(1ull << 20));
}

/* Pinned host -> device rate through the backend: 64 MiB registered host
 * memory uploaded whole, best of 5 after a warm-up; 0 if it cannot. */
static double link_rate(const char *device)
{
    struct tkv_backend *be;
    if (tkv_backend_create(device, 0, &be) != TKV_OK)
        return 0;
    const size_t bytes = (size_t)64 << 20;
    void *host = NULL, *dev = NULL;
    double best = 0;
    if (posix_memalign(&host, 4096, bytes) == 0 && be->ops->alloc(be, bytes, &dev) == TKV_OK) {
        memset(host, 1, bytes);
        const bool pinned = be->ops->host_register && be->ops->host_register(be, host, bytes) == TKV_OK;
        for (int r = 0; r < 6; r++) {
            const double t0 = now();
            if (be->ops->upload(be, dev, host, bytes) != TKV_OK || be->ops->synchronize(be) != TKV_OK)
                break;
            if (r > 0)
                best = fmax(best, bytes / (now() - t0) / 1e9);
        }
        if (pinned)
            be->ops->host_unregister(be, host);
    }
    if (dev)
        be->ops->release(be, dev);
    free(host);
    be->ops->free(be);
    return best;
}

struct opts {
    const char *model, *device, *ctxs, *nvme_dir, *json;
    const char *policies[MAX_POLICIES];
    uint32_t n_policies, steps, warmup, split_steps, threads, kv_block, seed;
    uint64_t gpu_kv, host_kv, nvme_max;
    enum tkv_hetero hetero;
    bool cap_full, forced;
    struct tkv_synth_params synth;
};

struct row {
    bool fits;
    char err[160];
    uint32_t real;
    double natural_sd, hot_share;    /* the fill's report                      */
    double fill_s, warm_s;
    double step_s;                   /* mean timed step                        */
    double read_tok, read_blk;       /* shares read, timed steps              */
    double head_max;                 /* a layer's largest head share, mean    */
    double recall_b, host_out_b, nvme_out_b; /* bytes per timed step          */
    double cpu_heads;                /* per timed step                        */
    double table_share;              /* decode layers attended from the device table, of those it
                                        was built for; -1: none                  */
    double brought_share;            /* of those, the share with missing blocks settled first */
    double split_step_s, select_s, attn_s, cpu_attn_s, stall_s; /* per split step */
    struct tkv_kvs_stall stall;      /* the stall's parts and counts, summed over the split steps */
    char rates[320];                 /* --hetero auto's rates and arms at the end, when it observed them */
    double stall_steps;              /* the steps they are summed over          */
    tkv_token *toks_out;             /* [steps] timed tokens                  */
};

/* r->rates: what --hetero auto priced the two paths with at the end of the
 * run, from the session's stats JSON, where it observed its rates in use
 * (runtime/hetero.h, struct tkv_hetero_rate; a rate no step did enough
 * work to observe is "none observed": its prior priced it), and the decode
 * steps each arm decided (struct tkv_hetero_arms; warm-up included) with
 * the arm in use at the end; else empty. */
static void hetero_rates(const tkv_session *s, struct row *r)
{
    static char json[1 << 16];
    size_t len;
    r->rates[0] = 0;
    if (tkv_session_stats_json(s, json, sizeof json, &len) != TKV_OK || !strstr(json, "\"observed\": true"))
        return;
    char cpu[32] = "none observed", link[32] = "none observed";
    const double cpu_seen = bench_json_number(json, "cpu_gflops_seen");
    const double link_seen = bench_json_number(json, "link_gbs_seen");
    if (cpu_seen > 0)
        snprintf(cpu, sizeof cpu, "%.1f observed", cpu_seen);
    if (link_seen > 0)
        snprintf(link, sizeof link, "%.1f observed", link_seen);
    static const char arm_key[] = "\"arm\": \"";
    const char *as = strstr(json, "\"arm_steps\""), *arm = strstr(json, arm_key);
    arm = arm ? arm + sizeof arm_key - 1 : "";
    as = as ? as : ""; /* the steps by arm: read after their key */
    snprintf(r->rates, sizeof r->rates,
             "CPU attention %.1f GFLOP/s measured at start, %s; recalls %.1f GB/s default, %s; decode steps by arm: "
             "model %.0f, recall %.0f, cpu %.0f, at the end %.*s",
             bench_json_number(json, "cpu_gflops"), cpu, bench_json_number(json, "link_gbs"), link,
             bench_json_number(as, "model"), bench_json_number(as, "recall"), bench_json_number(as, "cpu"),
             (int)strcspn(arm, "\""), arm);
}

static bool is_full(const char *policy) { return !strncmp(policy, "full", 4) && (!policy[4] || policy[4] == ':'); }

/* A row "SPEC;no-prefetch" runs SPEC without the selection prefetch
 * (TKV_SESSION_NO_SELECTION_PREFETCH), to set beside the row with it. */
#define NO_PREFETCH ";no-prefetch"

/* TKV_CUDA_PROFILE=1: the op profile of a row's timed steps, to stderr. */
static void timed_profile(tkv_session *s, uint32_t ctx, const char *policy, uint32_t steps)
{
    char label[160];
    snprintf(label, sizeof label, "ctx %u, %s, %u timed decode steps", ctx, policy, steps);
    bench_profile_print(tkv_session_backend(s), label, steps);
}

/* --forced: the token decode step i takes, the same for every row of a
 * context. */
static tkv_token forced_token(const struct opts *o, uint32_t ctx, uint32_t i, uint32_t n_vocab)
{
    const uint64_t key = 0xD1B54A32D192ED03ull ^ ((uint64_t)ctx << 32) ^ o->seed;
    return (tkv_token)(bench_mix64(key + i) % n_vocab);
}

static int run_row(const tkv_model *m, const struct opts *o, uint32_t ctx, const char *policy, struct row *r)
{
    struct tkv_model_info info;
    tkv_model_get_info(m, &info);
    *r = (struct row){.fits = true};
    tkv_token *toks = malloc((size_t)ctx * sizeof *toks);
    r->toks_out = malloc((size_t)o->steps * sizeof *r->toks_out);
    if (!toks || !r->toks_out) {
        free(toks);
        fprintf(stderr, "bench-recall: out of memory\n");
        return 1;
    }
    /* the same ids for every row of a context; seed 0: those of the runs before --seed */
    bench_rng_state = 0x9E3779B97F4A7C15ull ^ ctx ^ ((uint64_t)o->seed << 32);
    for (uint32_t i = 0; i < ctx; i++)
        toks[i] = (tkv_token)(rnd() % info.n_vocab);
    struct tkv_session_params sp = tkv_session_default_params();
    sp.n_ctx = ctx + o->warmup + o->steps + o->split_steps;
    sp.n_threads = o->threads;
    sp.device = o->device;
    sp.kv_block = o->kv_block;
    char spec[256];
    snprintf(spec, sizeof spec, "%s", policy);
    char *suffix = strstr(spec, NO_PREFETCH);
    if (suffix && !suffix[strlen(NO_PREFETCH)]) {
        *suffix = 0;
        sp.flags |= TKV_SESSION_NO_SELECTION_PREFETCH;
    }
    sp.policy = spec;
    if (!is_full(policy) || o->cap_full) {
        sp.gpu_kv_mem = o->gpu_kv;
        sp.host_kv_mem = o->host_kv;
        sp.nvme_dir = o->nvme_dir;
        sp.nvme_kv_max = o->nvme_max;
    }
    sp.hetero = o->hetero;
    tkv_session *s = NULL;
    tkv_status st = tkv_session_init(m, &sp, &s);
    const double t0 = now();
    struct tkv_synth_report rep = {0};
    if (st == TKV_OK)
        st = tkv_session_fill_synthetic_ex(s, toks, ctx, &o->synth, &rep);
    r->real = rep.n_real;
    r->natural_sd = rep.natural_sd;
    r->hot_share = rep.copied_blocks ? (double)rep.hot_blocks / rep.copied_blocks : 0;
    r->fill_s = now() - t0;
    free(toks);
    if (st == TKV_ERR_NOMEM || st == TKV_ERR_CONTEXT_FULL || st == TKV_ERR_DEVICE) {
        /* "where it fits": the row says it does not */
        r->fits = false;
        snprintf(r->err, sizeof r->err, "%s", tkv_last_error());
        tkv_session_free(s);
        return 0;
    }
    if (st != TKV_OK) {
        tkv_session_free(s);
        return die(policy);
    }
    tkv_token tok = o->forced ? forced_token(o, ctx, 0, info.n_vocab) : tkv_argmax(tkv_logits(s), info.n_vocab);
    struct tkv_step_counters c0, c1, c2, d;
    const double w0 = now();
    for (uint32_t i = 0; i < o->warmup + o->steps + o->split_steps && st == TKV_OK; i++) {
        if (i == o->warmup) {
            r->warm_s = now() - w0;
            struct tkv_backend *be = tkv_session_backend(s);
            if (be->ops->profile_reset) /* TKV_CUDA_PROFILE=1: the timed steps' ops, to stderr */
                be->ops->profile_reset(be);
            tkv_session_step_counters(s, &c0);
        }
        if (i == o->warmup + o->steps) {
            tkv_session_step_counters(s, &c1);
            timed_profile(s, ctx, policy, o->steps);
            tkv_session_set_phase_sync(s, true);
        }
        if ((st = tkv_decode(s, tok)) != TKV_OK)
            break;
        const tkv_token next = tkv_argmax(tkv_logits(s), info.n_vocab);
        if (i >= o->warmup && i < o->warmup + o->steps)
            r->toks_out[i - o->warmup] = next; /* (forced: the prediction, what = ref compares) */
        tok = o->forced ? forced_token(o, ctx, i + 1, info.n_vocab) : next;
    }
    if (st != TKV_OK) {
        tkv_session_free(s);
        return die("decode");
    }
    tkv_session_step_counters(s, &c2);
    if (o->split_steps == 0) {
        c1 = c2;
        timed_profile(s, ctx, policy, o->steps);
    }
    hetero_rates(s, r);
    tkv_session_free(s);
    tkv_step_counters_since(&c1, &c0, &d);
    const double n = d.decode_steps ? (double)d.decode_steps : 1;
    r->step_s = d.decode_s / n;
    r->read_tok = d.read_count ? d.read_tokens / d.read_count : 1.0;
    r->read_blk = d.read_count ? d.read_blocks / d.read_count : 1.0;
    r->head_max = d.read_layers ? d.read_tokens_max / d.read_layers : 1.0;
    r->recall_b = d.recall_bytes / n;
    r->host_out_b = d.host_out_bytes / n;
    r->nvme_out_b = d.nvme_out_bytes / n;
    r->cpu_heads = d.cpu_heads / n;
    r->table_share = d.table_layers + d.table_fallbacks
                         ? (double)d.table_layers / (double)(d.table_layers + d.table_fallbacks)
                         : -1;
    r->brought_share = d.table_layers ? (double)d.table_brought / (double)d.table_layers : 0;
    r->stall = d.store; /* the timed steps', unless split steps follow */
    r->stall_steps = n;
    if (o->split_steps) {
        tkv_step_counters_since(&c2, &c1, &d);
        const double k = d.decode_steps ? (double)d.decode_steps : 1;
        r->split_step_s = d.decode_s / k;
        r->select_s = d.select_s / k;
        r->attn_s = d.attn_s / k;
        r->cpu_attn_s = d.cpu_attn_s / k;
        r->stall_s = d.store_s / k;
        r->stall = d.store;
        r->stall_steps = k;
    }
    return 0;
}

/* Appends a line to a growing buffer (*buf, *len); on out of memory the
 * line is dropped (it is only printed). */
static void append_line(char **buf, size_t *len, const char *line)
{
    const size_t w = strlen(line);
    char *nb = realloc(*buf, *len + w + 1);
    if (!nb)
        return;
    memcpy(nb + *len, line, w + 1);
    *buf = nb;
    *len += w;
}

/* One row of the stall split table (per step, over the steps the stall
 * column comes from), appended to *buf (the row's JSON fields are written
 * with the main table's, in main). */
static void stall_row(char **buf, size_t *len, uint32_t ctx, const char *policy, const struct row *r)
{
    const struct tkv_kvs_stall *t = &r->stall;
    const double k = r->stall_steps > 0 ? r->stall_steps : 1;
    const double total = t->settle_s + t->evict_s + t->verify_s + t->upload_issue_s + t->upload_wait_s + t->nvme_s +
                         t->other_s;
    char line[512];
    snprintf(line, sizeof line,
             "| %u | %s | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.0f | %.2f | %.1f | %.0f | %.0f "
             "| %.1f | %.1f | %.1f | %.2f |\n",
             ctx, policy, total / k * 1e3, t->settle_s / k * 1e3, t->evict_s / k * 1e3, t->verify_s / k * 1e3,
             t->upload_issue_s / k * 1e3, t->upload_wait_s / k * 1e3, t->nvme_s / k * 1e3, t->other_s / k * 1e3,
             t->recalled_blocks / k, t->evict_passes / k, t->evict_scanned / k / 1e3, t->evicted_blocks / k,
             t->spilled_blocks / k, t->upload_calls / k, t->upload_waits / k, t->verify_bytes / k / 1e6,
             t->recalled_blocks ? total / t->recalled_blocks * 1e6 : 0.0);
    append_line(buf, len, line);
}

int main(int argc, char **argv)
{
    struct opts o = {.ctxs = "32768,131072", .steps = 16, .warmup = 3, .split_steps = 8,
                     .hetero = TKV_HETERO_AUTO, .synth = tkv_synth_default_params(),
                     .kv_block = tkv_session_default_params().kv_block};
    o.synth.hot_spread = 4.0f, o.synth.cold_spread = 0.25f, o.synth.hot_every = 64, o.synth.recent_blocks = 2;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--cap-full")) {
            o.cap_full = true;
            continue;
        }
        if (!strcmp(a, "--forced")) {
            o.forced = true;
            continue;
        }
        if (!strcmp(a, "--uniform")) {
            o.synth.hot_spread = o.synth.cold_spread = 0;
            continue;
        }
        const char *v = i + 1 < argc ? argv[++i] : NULL;
        bool ok = v != NULL;
        if (!ok)
            ;
        else if (!strcmp(a, "-m"))
            o.model = v;
        else if (!strcmp(a, "--device"))
            o.device = v;
        else if (!strcmp(a, "--ctx"))
            o.ctxs = v;
        else if (!strcmp(a, "--steps"))
            o.steps = (uint32_t)atoi(v);
        else if (!strcmp(a, "--warmup"))
            o.warmup = (uint32_t)atoi(v);
        else if (!strcmp(a, "--split-steps"))
            o.split_steps = (uint32_t)atoi(v);
        else if (!strcmp(a, "--policy") && o.n_policies < MAX_POLICIES)
            o.policies[o.n_policies++] = v;
        else if (!strcmp(a, "--gpu-kv-mem"))
            ok = parse_size(v, &o.gpu_kv);
        else if (!strcmp(a, "--host-kv-mem"))
            ok = parse_size(v, &o.host_kv);
        else if (!strcmp(a, "--nvme-kv-max"))
            ok = parse_size(v, &o.nvme_max);
        else if (!strcmp(a, "--nvme-dir"))
            o.nvme_dir = v;
        else if (!strcmp(a, "--hetero"))
            ok = !strcmp(v, "auto") ? (o.hetero = TKV_HETERO_AUTO, true)
                 : !strcmp(v, "recall") ? (o.hetero = TKV_HETERO_RECALL, true)
                 : !strcmp(v, "cpu") ? (o.hetero = TKV_HETERO_CPU, true) : false;
        else if (!strcmp(a, "-t"))
            o.threads = (uint32_t)atoi(v);
        else if (!strcmp(a, "--kv-block"))
            ok = (o.kv_block = (uint32_t)atoi(v)) > 0;
        else if (!strcmp(a, "--seed"))
            o.seed = (uint32_t)strtoul(v, NULL, 10);
        else if (!strcmp(a, "--real"))
            o.synth.n_real = (uint32_t)atoi(v);
        else if (!strcmp(a, "--hot-spread"))
            o.synth.hot_spread = (float)atof(v);
        else if (!strcmp(a, "--cold-spread"))
            o.synth.cold_spread = (float)atof(v);
        else if (!strcmp(a, "--hot-every"))
            o.synth.hot_every = (uint32_t)atoi(v);
        else if (!strcmp(a, "--recent-blocks"))
            o.synth.recent_blocks = (uint32_t)atoi(v);
        else if (!strcmp(a, "-j"))
            o.json = v;
        else
            ok = false;
        if (!ok) {
            usage();
            return 2;
        }
    }
    if (!o.model || o.steps == 0 || o.synth.n_real == 0) {
        usage();
        return 2;
    }
    if (o.n_policies == 0) {
        o.policies[o.n_policies++] = "full";
        o.policies[o.n_policies++] = "rabitq:p=0.9";
    }
    if (!o.device)
        o.device = tkv_backend_cuda_devices() > 0 ? "cuda" : "cpu";
    const bool cuda = !strcmp(o.device, "cuda");
    if (!cuda && strcmp(o.device, "cpu") != 0) {
        fprintf(stderr, "bench-recall: --device is cpu or cuda, not '%s'\n", o.device);
        return 2;
    }
    if (cuda && tkv_backend_cuda_devices() == 0) {
        fprintf(stderr, "bench-recall: no CUDA device\n");
        return 77;
    }
    FILE *json = NULL;
    if (o.json && !(json = fopen(o.json, "w"))) {
        fprintf(stderr, "bench-recall: cannot write %s\n", o.json);
        return 1;
    }
    const double link = cuda ? link_rate(o.device) : 0; /* GB/s */

    tkv_model *m;
    if (tkv_model_load(o.model, &m) != TKV_OK)
        return die("load");
    struct tkv_model_info info;
    tkv_model_get_info(m, &info);
    struct tkv_decode_bytes wb;
    tkv_model_decode_bytes(m, &wb);
    const double kv_per_token = (double)info.n_layer * info.n_head_kv * info.head_dim * 2 * 2;
    const char *base = strrchr(o.model, '/') ? strrchr(o.model, '/') + 1 : o.model;
    char commit[64], tiers[160], g[32], h[32], nv[32];
    build_commit(commit, sizeof commit);
    fmt_size(g, sizeof g, o.gpu_kv), fmt_size(h, sizeof h, o.host_kv), fmt_size(nv, sizeof nv, o.nvme_max);
    if (cuda)
        snprintf(tiers, sizeof tiers, "gpu %s / host %s / nvme %s", o.gpu_kv ? g : "all", o.host_kv ? h : "none",
                 o.nvme_dir ? (o.nvme_max ? nv : "rest") : "none");
    else
        snprintf(tiers, sizeof tiers, "host (compute) %s / nvme %s", o.host_kv ? h : "all",
                 o.nvme_dir ? (o.nvme_max ? nv : "rest") : "none");
    char synth[160];
    if (o.synth.hot_spread == 0 && o.synth.cold_spread == 0)
        snprintf(synth, sizeof synth, "synthetic (%u real, plain copies)", o.synth.n_real);
    else
        snprintf(synth, sizeof synth, "synthetic (%u real; hot: 1/%u + last %u blocks, sd %g nats; cold: sd %g nats)",
                 o.synth.n_real, o.synth.hot_every, o.synth.recent_blocks, (double)o.synth.hot_spread,
                 (double)o.synth.cold_spread);

    printf("bench-recall: %s (%u layers, %u/%u heads, head_dim %u, matrices %s), device %s, commit %s\n", base,
           info.n_layer, info.n_head, info.n_head_kv, info.head_dim, wb.matrix_type, o.device, commit);
    printf("KV %.1f KB per token, blocks of %u tokens; capped rows: %s; fill: %s, token seed %u; %u warm-up, %u timed, "
           "%u split steps; decode tokens %s\n", kv_per_token / 1e3, o.kv_block, tiers, synth, o.seed, o.warmup, o.steps,
           o.split_steps, o.forced ? "forced (--forced)" : "greedy");
    if (cuda)
        printf("link: pinned host -> GPU %.1f GB/s (64 MiB copies, best of 5)\n", link);
    printf("\n| ctx | policy | KV tiers | tok/s | step ms | x full | read tok | read blk | head max | hot blk | split step ms | rest ms | "
           "attn ms | select ms | cpu attn ms | stall ms | recall MB/step | recall ms @link | PCIe GB/s | PCIe util "
           "| from table (brought first) | = ref |\n");
    printf("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n");
    fflush(stdout);

    int rc = 0;
    char *split_tab = NULL, *rates = NULL; /* the stall split table and auto's rates, after the main one */
    size_t split_len = 0, rates_len = 0;
    char *list = strdup(o.ctxs), *save = NULL;
    for (char *c = strtok_r(list, ",", &save); c && !rc; c = strtok_r(NULL, ",", &save)) {
        const uint32_t ctx = (uint32_t)strtoul(c, NULL, 10);
        if (ctx == 0)
            continue;
        double full_s = 0;
        tkv_token *ref = NULL;
        for (uint32_t p = 0; p < o.n_policies && !rc; p++) {
            struct row r;
            if ((rc = run_row(m, &o, ctx, o.policies[p], &r)) != 0) {
                free(r.toks_out);
                break;
            }
            const bool capped = !is_full(o.policies[p]) || o.cap_full;
            const char *row_tiers = capped ? tiers : cuda ? "all on the GPU" : "all in host memory";
            if (!r.fits) {
                printf("| %u | %s | %s | does not fit: %s ||||||||||||||||\n", ctx, o.policies[p], row_tiers, r.err);
                if (json)
                    fprintf(json, "{\"bench\": \"recall\", \"model\": \"%s\", \"ctx\": %u, \"policy\": \"%s\", "
                                  "\"tiers\": \"%s\", \"fits\": false, \"error\": \"%s\", \"commit\": \"%s\"}\n",
                            base, ctx, o.policies[p], row_tiers, r.err, commit);
                free(r.toks_out);
                continue;
            }
            if (is_full(o.policies[p]) && full_s == 0)
                full_s = r.step_s;
            char same[32] = "ref";
            if (!ref) {
                ref = r.toks_out;
                r.toks_out = NULL;
            } else {
                /* greedy: the steps until the first that differs (the
                 * tokens part there); forced: every step that agrees */
                uint32_t eq = 0;
                for (uint32_t i = 0; i < o.steps && (o.forced || eq == i); i++)
                    eq += r.toks_out[i] == ref[i];
                snprintf(same, sizeof same, "%u/%u", eq, o.steps);
            }
            char ratio[32] = "-", util[32] = "-", at_link[32] = "-";
            if (full_s > 0)
                snprintf(ratio, sizeof ratio, "%.2f", full_s / r.step_s);
            const double pcie = r.recall_b / r.step_s / 1e9;
            if (link > 0) {
                snprintf(util, sizeof util, "%.1f%%", 100.0 * pcie / link);
                snprintf(at_link, sizeof at_link, "%.3f", r.recall_b / (link * 1e9) * 1e3);
            }
            const double rest = r.split_step_s - r.select_s - r.attn_s - r.cpu_attn_s - r.stall_s;
            stall_row(&split_tab, &split_len, ctx, o.policies[p], &r);
            if (r.rates[0]) {
                char line[448];
                snprintf(line, sizeof line, "- %u, %s: %s\n", ctx, o.policies[p], r.rates);
                append_line(&rates, &rates_len, line);
            }
            char table[32] = "-";
            if (r.table_share >= 0)
                snprintf(table, sizeof table, "%.1f%% (%.0f%% brought)", 100.0 * r.table_share,
                         100.0 * r.brought_share);
            printf("| %u | %s | %s | %.2f | %.3f | %s | %.4f | %.4f | %.4f | %.4f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | "
                   "%.2f | %s | %.2f | %s | %s | %s |\n",
                   ctx, o.policies[p], row_tiers, 1.0 / r.step_s, r.step_s * 1e3, ratio, r.read_tok, r.read_blk,
                   r.head_max, r.hot_share, r.split_step_s * 1e3, rest * 1e3, r.attn_s * 1e3, r.select_s * 1e3, r.cpu_attn_s * 1e3,
                   r.stall_s * 1e3, r.recall_b / 1e6, at_link, pcie, util, table, same);
            fflush(stdout);
            if (json) {
                fprintf(json,
                        "{\"bench\": \"recall\", \"model\": \"%s\", \"matrix_type\": \"%s\", \"device\": \"%s\", "
                        "\"ctx\": %u, \"kv_block\": %u, \"seed\": %u, \"policy\": \"%s\", \"tiers\": \"%s\", "
                        "\"fits\": true, \"fill\": \"%s\", "
                        "\"real_tokens\": %u, \"natural_logit_sd\": %.4f, \"hot_block_share\": %.5f, \"fill_s\": %.3f, \"warmup_s\": %.3f, \"steps\": %u, "
                        "\"step_ms\": %.4f, \"tok_s\": %.3f, \"x_full\": %.4f, \"read_tokens\": %.6f, "
                        "\"read_blocks\": %.6f, \"head_max_tokens\": %.6f, \"split_steps\": %u, \"split_step_ms\": %.4f, \"rest_ms\": %.4f, "
                        "\"attn_ms\": %.4f, \"select_ms\": %.4f, \"cpu_attn_ms\": %.4f, \"stall_ms\": %.4f, "
                        "\"recall_bytes_per_step\": %.0f, \"host_out_bytes_per_step\": %.0f, "
                        "\"nvme_out_bytes_per_step\": %.0f, \"cpu_heads_per_step\": %.2f, \"link_gbs\": %.3f, "
                        "\"pcie_gbs\": %.4f, \"same_tokens_as_ref\": \"%s\", \"commit\": \"%s\", "
                        "\"device_table_share\": %.4f, \"device_table_brought_share\": %.4f, ",
                        base, wb.matrix_type, o.device, ctx, o.kv_block, o.seed, o.policies[p], row_tiers, synth, r.real,
                        r.natural_sd, r.hot_share, r.fill_s,
                        r.warm_s, o.steps, r.step_s * 1e3, 1.0 / r.step_s, full_s > 0 ? full_s / r.step_s : 0.0,
                        r.read_tok, r.read_blk, r.head_max, o.split_steps, r.split_step_s * 1e3, rest * 1e3, r.attn_s * 1e3,
                        r.select_s * 1e3, r.cpu_attn_s * 1e3, r.stall_s * 1e3, r.recall_b, r.host_out_b,
                        r.nvme_out_b, r.cpu_heads, link, pcie, same, commit, r.table_share, r.brought_share);
                const struct tkv_kvs_stall *t = &r.stall;
                const double k = r.stall_steps > 0 ? r.stall_steps : 1;
                fprintf(json,
                        "\"stall_split_ms\": {\"settle\": %.4f, \"evict\": %.4f, \"verify\": %.4f, "
                        "\"upload_issue\": %.4f, \"upload_wait\": %.4f, \"nvme\": %.4f, \"other\": %.4f}, "
                        "\"stall_per_step\": {\"layers\": %.1f, \"recalled_blocks\": %.1f, \"evict_passes\": %.2f, "
                        "\"evict_scanned_slots\": %.0f, \"evicted_blocks\": %.1f, \"spilled_blocks\": %.1f, \"upload_calls\": %.2f, "
                        "\"upload_waits\": %.2f, \"verify_bytes\": %.0f}}\n",
                        t->settle_s / k * 1e3, t->evict_s / k * 1e3, t->verify_s / k * 1e3, t->upload_issue_s / k * 1e3,
                        t->upload_wait_s / k * 1e3, t->nvme_s / k * 1e3, t->other_s / k * 1e3, t->layers / k,
                        t->recalled_blocks / k, t->evict_passes / k, t->evict_scanned / k, t->evicted_blocks / k,
                        t->spilled_blocks / k, t->upload_calls / k, t->upload_waits / k, t->verify_bytes / k);
                fflush(json);
            }
            free(r.toks_out);
        }
        free(ref);
    }
    free(list);
    tkv_model_free(m);
    if (split_tab) {
        printf("\nWhere the stall goes (per step, over the split steps; the parts sum to `stall ms`):\n\n"
               "| ctx | policy | stall ms | settle | evict | verify | upload issue | upload wait | nvme | other | "
               "recalls | evict passes | scanned K slots | evicted | spilled | uploads | waits | CPU CRC MB | us/recall |\n"
               "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n%s",
               split_tab);
        printf("\nsettle: this layer's prefetches waited for; evict: make_room (slot scans, victim order, drops, "
               "spills; spilled: victims written down first); verify: CRC-32C on the CPU; upload issue / wait: host -> compute copies queued / waited for "
               "(and fences); nvme: NVMe reads; other: page-table passes, slots taken, lists. Counts per step.\n");
        free(split_tab);
    }
    if (rates) {
        printf("\nhetero rates: what --hetero auto priced the two paths with at the end of each run, and the "
               "arms that decided its steps (runtime/hetero.h):\n%s", rates);
        free(rates);
    }
    printf("\nfill: %s -- attention concentrates by construction, so read tok / read blk say what this fill made "
           "the policy read, not what a real model would. x full: full's step / this row's (the context's full "
           "row). rest: split step less attn, select, cpu attn and stall (the weights' ops; a residual).\n",
           synth);
    if (json)
        fclose(json);
    return rc;
}
