/*
 * main.c -- the `tierkv` command line.
 *
 *   tierkv run      -m MODEL [-f FILE] [-p TEXT] [options]   generate text
 *   tierkv info     -m MODEL                                  validate and describe a model
 *   tierkv tokenize -m MODEL (-p TEXT | -f FILE) [--special]  print token ids
 *   tierkv gen-model --shape S --type T --out FILE             synthetic random-weight model (gen-model.c)
 *
 * stdout carries only the generated text (run) or the requested listing;
 * progress, statistics and errors go to stderr. Exit status: 0 success,
 * 1 runtime failure, 2 bad usage.
 */
#include "cli-util.h"
#include "tierkv.h"
#include "eval.h"
#include "runtime/backend.h" /* tkv_backend_cuda_devices */
#include "runtime/kv-synth.h" /* tkv_session_backend: the op profile */

#include <errno.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define EXIT_USAGE 2

int cmd_gen_model(int argc, char **argv); /* gen-model.c */

static const char *prog = "tierkv";

static int usage_error(const char *fmt, const char *arg)
{
    fprintf(stderr, "%s: ", prog);
    fprintf(stderr, fmt, arg);
    fprintf(stderr, " (see '%s --help')\n", prog);
    return EXIT_USAGE;
}

static int fail(const char *what, tkv_status st)
{
    fprintf(stderr, "%s: %s: %s (%s)\n", prog, what, tkv_last_error(), tkv_status_str(st));
    return 1;
}

static void print_help(void)
{
    printf("usage: tierkv COMMAND [options]\n"
           "\n"
           "commands:\n"
           "  run       generate text from a prompt\n"
           "  info      validate a GGUF model fully and print a summary\n"
           "  tokenize  print the token ids of a text\n"
           "  eval      RULER-style long-context tasks per KV policy and budget (eval --help)\n"
           "  gen-model write a synthetic model with random weights (gen-model --help)\n"
           "\n"
           "run options:\n"
           "  -m, --model FILE      GGUF model (llama architecture)\n"
           "  -f, --file FILE       prompt text from a file (comes first)\n"
           "  -p, --prompt TEXT     prompt text (after the file, if both are given)\n"
           "  -n, --n-predict N     tokens to generate (default 256; 0 = prefill only)\n"
           "  -c, --ctx-size N      context size in tokens (default: the model's)\n"
           "  -t, --threads N       CPU threads (default: all cores)\n"
           "      --chat            wrap the prompt in the model's chat template\n"
           "      --temp T          sampling temperature; 0 = greedy (default 0)\n"
           "      --top-k K         keep the K most likely tokens (default 40; 0 = off)\n"
           "      --top-p P         nucleus sampling mass (default 0.95; 1 = off)\n"
           "      --seed S          sampling seed (default: from the clock, printed with --stats)\n"
           "      --policy SPEC     KV policy NAME[:key=value,...] (default full)\n"
           "      --kv-budget N     KV tokens kept per head by the policy\n"
           "      --kv-block N      tokens per KV block (default 64)\n"
           "      --device D        cpu, cuda, cuda:N or auto (default: cuda when a GPU is present,\n"
           "                        else cpu; a policy or model the GPU cannot run falls\n"
           "                        back to the CPU with a note unless cuda was asked for)\n"
           "      --gpu-kv-mem SIZE KV kept in GPU memory (e.g. 2G; default: all of it)\n"
           "      --host-kv-mem SIZE KV kept in host memory (CPU device: its working memory;\n"
           "                        below a GPU: the pinned host tier). Default: all of it\n"
           "      --nvme-dir DIR    spill KV that does not fit to a private file in DIR\n"
           "      --nvme-kv-max SIZE cap on the NVMe tier (default: the whole context)\n"
           "      --hetero MODE     decode with a selecting policy below a GPU: selected blocks in the\n"
           "                        host tier are recalled or attended on the CPU where they are;\n"
           "                        auto (a cost model per KV head and step, against recalling or\n"
           "                        attending everything by measured step time), recall or cpu\n"
           "      --save-kv FILE    save the context after generation (with -n 0: after the prefill)\n"
           "      --load-kv FILE    start from a saved context instead of recomputing it\n"
           "      --ignore-eos      keep generating past end-of-sequence tokens\n"
           "      --special         parse special tokens such as <|im_start|> in the prompt\n"
           "      --stats           print timing and memory statistics to stderr\n"
           "      --stats-json FILE write the statistics as JSON\n"
           "\n"
           "tokenize options: -m FILE, -p TEXT or -f FILE, --special\n");
}

/* ---- small helpers ---------------------------------------------------------- */

/* Reads a whole file into a NUL-terminated buffer; NULL with a message. */
static char *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "%s: cannot open '%s': %s\n", prog, path, strerror(errno));
        return NULL;
    }
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    while (buf) {
        if (n + 1 >= cap) {
            char *nb = realloc(buf, cap *= 2);
            if (!nb) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = nb;
        }
        size_t got = fread(buf + n, 1, cap - n - 1, f);
        n += got;
        if (got == 0)
            break;
    }
    bool err = ferror(f);
    fclose(f);
    if (!buf || err) {
        fprintf(stderr, "%s: cannot read '%s': %s\n", prog, path, buf ? "read error" : "out of memory");
        free(buf);
        return NULL;
    }
    buf[n] = 0;
    *len = n;
    return buf;
}

/* ---- options shared by the commands --------------------------------------- */

struct options {
    const char *model, *prompt, *file, *policy, *device, *stats_json;
    const char *nvme_dir, *save_kv, *load_kv;
    uint64_t gpu_kv_mem, host_kv_mem, nvme_kv_max;
    enum tkv_hetero hetero;
    uint32_t n_predict, n_ctx, n_threads, top_k, kv_budget, kv_block;
    float temp, top_p;
    uint64_t seed;
    bool seed_set, chat, stats, special, ignore_eos;
};

/* Parses argv[first..]; returns 0 or an exit status. */
static int parse_options(int argc, char **argv, int first, struct options *o)
{
    *o = (struct options){.n_predict = 256, .top_k = 40, .top_p = 0.95f, .temp = 0.0f, .device = NULL,
                          .policy = "full"};
    for (int i = first; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
#define NEEDS_VALUE() \
    do { \
        if (!v) \
            return usage_error("option '%s' needs a value", a); \
        i++; \
    } while (0)
#define IS(s, l) cli_is_opt(a, s, l)
        if (IS("-h", "--help")) {
            print_help();
            exit(0);
        } else if (IS("-m", "--model")) {
            NEEDS_VALUE();
            o->model = v;
        } else if (IS("-p", "--prompt")) {
            NEEDS_VALUE();
            o->prompt = v;
        } else if (IS("-f", "--file")) {
            NEEDS_VALUE();
            o->file = v;
        } else if (IS("-n", "--n-predict")) {
            NEEDS_VALUE();
            if (!cli_parse_u32(v, &o->n_predict))
                return usage_error("-n expects a count, got '%s'", v);
        } else if (IS("-c", "--ctx-size")) {
            NEEDS_VALUE();
            if (!cli_parse_u32(v, &o->n_ctx))
                return usage_error("-c expects a token count, got '%s'", v);
        } else if (IS("-t", "--threads")) {
            NEEDS_VALUE();
            if (!cli_parse_u32(v, &o->n_threads) || o->n_threads == 0 || o->n_threads > 1024)
                return usage_error("-t expects 1..1024 threads, got '%s'", v);
        } else if (IS("--temp", NULL)) {
            NEEDS_VALUE();
            if (!cli_parse_float(v, &o->temp) || o->temp < 0)
                return usage_error("--temp expects a number >= 0, got '%s'", v);
        } else if (IS("--top-k", NULL)) {
            NEEDS_VALUE();
            if (!cli_parse_u32(v, &o->top_k))
                return usage_error("--top-k expects a count, got '%s'", v);
        } else if (IS("--top-p", NULL)) {
            NEEDS_VALUE();
            if (!cli_parse_float(v, &o->top_p) || !(o->top_p > 0 && o->top_p <= 1))
                return usage_error("--top-p expects a number in (0, 1], got '%s'", v);
        } else if (IS("--seed", NULL)) {
            NEEDS_VALUE();
            if (!cli_parse_u64(v, &o->seed))
                return usage_error("--seed expects a non-negative integer, got '%s'", v);
            o->seed_set = true;
        } else if (IS("--policy", NULL)) {
            NEEDS_VALUE();
            o->policy = v;
        } else if (IS("--kv-budget", NULL)) {
            NEEDS_VALUE();
            if (!cli_parse_u32(v, &o->kv_budget))
                return usage_error("--kv-budget expects a token count, got '%s'", v);
        } else if (IS("--kv-block", NULL)) {
            NEEDS_VALUE();
            if (!cli_parse_u32(v, &o->kv_block))
                return usage_error("--kv-block expects a token count, got '%s'", v);
        } else if (IS("--device", NULL)) {
            NEEDS_VALUE();
            o->device = v;
        } else if (IS("--gpu-kv-mem", NULL) || IS("--host-kv-mem", NULL) || IS("--nvme-kv-max", NULL)) {
            NEEDS_VALUE();
            uint64_t *dst = IS("--gpu-kv-mem", NULL) ? &o->gpu_kv_mem
                            : IS("--host-kv-mem", NULL) ? &o->host_kv_mem : &o->nvme_kv_max;
            if (!cli_parse_size(v, dst) || *dst == 0)
                return usage_error("expected a size like 512M or 8G, got '%s'", v);
        } else if (IS("--hetero", NULL)) {
            NEEDS_VALUE();
            if (!strcmp(v, "auto"))
                o->hetero = TKV_HETERO_AUTO;
            else if (!strcmp(v, "recall"))
                o->hetero = TKV_HETERO_RECALL;
            else if (!strcmp(v, "cpu"))
                o->hetero = TKV_HETERO_CPU;
            else
                return usage_error("--hetero expects auto, recall or cpu, got '%s'", v);
        } else if (IS("--nvme-dir", NULL)) {
            NEEDS_VALUE();
            o->nvme_dir = v;
        } else if (IS("--save-kv", NULL)) {
            NEEDS_VALUE();
            o->save_kv = v;
        } else if (IS("--load-kv", NULL)) {
            NEEDS_VALUE();
            o->load_kv = v;
        } else if (IS("--stats-json", NULL)) {
            NEEDS_VALUE();
            o->stats_json = v;
        } else if (IS("--chat", NULL)) {
            o->chat = true;
        } else if (IS("--stats", NULL)) {
            o->stats = true;
        } else if (IS("--special", NULL)) {
            o->special = true;
        } else if (IS("--ignore-eos", NULL)) {
            o->ignore_eos = true;
        } else {
            return usage_error("unknown option '%s'", a);
        }
#undef NEEDS_VALUE
#undef IS
    }
    if (!o->model)
        return usage_error("%s", "no model given: use -m FILE.gguf");
    if (access(o->model, R_OK) != 0) {
        fprintf(stderr, "%s: cannot read model '%s': %s\n", prog, o->model, strerror(errno));
        return 1;
    }
    return 0;
}

/* The prompt text: file first, then -p, separated by a blank line. */
static char *assemble_prompt(const struct options *o)
{
    size_t flen = 0;
    char *file = NULL;
    if (o->file && !(file = read_file(o->file, &flen)))
        return NULL;
    const char *p = o->prompt ? o->prompt : "";
    size_t plen = strlen(p), total = flen + plen + 3;
    char *out = malloc(total);
    if (!out) {
        free(file);
        fprintf(stderr, "%s: out of memory\n", prog);
        return NULL;
    }
    snprintf(out, total, "%s%s%s", file ? file : "", file && plen ? "\n\n" : "", p);
    free(file);
    return out;
}

/* Tokenizes text; NULL after printing why. */
static tkv_token *tokenize_all(const tkv_model *m, const char *text, unsigned flags, size_t *n)
{
    tkv_token *toks = cli_tokenize(m, text, flags, n);
    if (!toks)
        fprintf(stderr, "%s: tokenize: %s\n", prog, tkv_last_error()[0] ? tkv_last_error() : "out of memory");
    return toks;
}

static int load_model(const char *path, tkv_model **m)
{
    tkv_status st = tkv_model_load(path, m);
    return st == TKV_OK ? 0 : fail("cannot load model", st);
}

/* ---- tierkv run ------------------------------------------------------------ */

struct progress_state {
    bool tty;
    double t0;
};

static int on_progress(size_t done, size_t total, void *user)
{
    struct progress_state *ps = user;
    if (!ps->tty)
        return 0;
    const int width = 40, fill = (int)(width * done / (total ? total : 1));
    const double dt = cli_now() - ps->t0;
    fprintf(stderr, "\rprefill [%.*s%*s] %zu/%zu tokens, %.0f tok/s", fill,
            "########################################", width - fill, "", done, total, dt > 0 ? done / dt : 0.0);
    if (done == total)
        fputs("\r\033[K", stderr);
    fflush(stderr);
    return 0;
}

static int cmd_run(int argc, char **argv)
{
    struct options o;
    int rc = parse_options(argc, argv, 2, &o);
    if (rc)
        return rc;
    if (!o.prompt && !o.file && !o.load_kv)
        return usage_error("%s", "no prompt: give -p TEXT and/or -f FILE (or --load-kv FILE)");
    char *text = assemble_prompt(&o);
    if (!text)
        return 1;
    tkv_model *m = NULL;
    tkv_session *s = NULL;
    tkv_sampler *smp = NULL;
    tkv_token *toks = NULL;
    char *chat = NULL;
    rc = 1;
    if (load_model(o.model, &m))
        goto out;

    unsigned flags = o.special ? TKV_TOK_PARSE_SPECIAL : 0;
    const char *to_tokenize = text;
    if (o.chat) {
        size_t need;
        tkv_status st = tkv_chat_prompt(m, NULL, text, NULL, 0, &need);
        if (st != TKV_OK && st != TKV_ERR_TOO_SMALL) {
            fail("chat template", st);
            goto out;
        }
        chat = malloc(need + 1);
        if (!chat || (st = tkv_chat_prompt(m, NULL, text, chat, need + 1, &need)) != TKV_OK) {
            fail("chat template", chat ? st : TKV_ERR_NOMEM);
            goto out;
        }
        to_tokenize = chat;
        flags |= TKV_TOK_PARSE_SPECIAL;
    }
    size_t n_prompt = 0;
    if (to_tokenize[0] && !(toks = tokenize_all(m, to_tokenize, flags | (o.load_kv ? 0 : TKV_TOK_ADD_BOS), &n_prompt)))
        goto out;
    if (n_prompt == 0 && !o.load_kv) {
        fprintf(stderr, "%s: the prompt is empty after tokenization\n", prog);
        goto out;
    }

    struct tkv_model_info info;
    tkv_model_get_info(m, &info);
    const uint32_t n_ctx = o.n_ctx ? o.n_ctx : info.n_ctx_train;
    if (n_prompt > n_ctx) {
        fprintf(stderr, "%s: the prompt has %zu tokens but the context holds %u (raise -c or shorten the prompt)\n",
                prog, n_prompt, n_ctx);
        goto out;
    }

    struct progress_state ps = {.tty = isatty(2) != 0, .t0 = cli_now()};
    struct tkv_session_params sp = tkv_session_default_params();
    sp.n_ctx = n_ctx;
    sp.n_threads = o.n_threads;
    /* default: the GPU when there is one */
    sp.device = o.device ? o.device : tkv_backend_cuda_devices() > 0 ? "cuda" : "cpu";
    sp.policy = o.policy;
    sp.kv_budget = o.kv_budget;
    sp.kv_block = o.kv_block;
    sp.progress = on_progress;
    sp.progress_user = &ps;
    sp.gpu_kv_mem = o.gpu_kv_mem;
    sp.host_kv_mem = o.host_kv_mem;
    sp.nvme_dir = o.nvme_dir;
    sp.nvme_kv_max = o.nvme_kv_max;
    sp.hetero = o.hetero;
    tkv_status st = tkv_session_init(m, &sp, &s);
    if (st == TKV_ERR_UNSUPPORTED && !o.device && strcmp(sp.device, "cpu") != 0) {
        /* the default device cannot run this (a policy that computes its
         * statistics on the CPU, a weight type): the CPU can */
        fprintf(stderr, "%s: note: %s; running on the CPU (--device cpu says so, --device cuda insists)\n", prog,
                tkv_last_error());
        sp.device = "cpu";
        st = tkv_session_init(m, &sp, &s);
    }
    if (st != TKV_OK) {
        fail("cannot start a session", st);
        goto out;
    }
    struct tkv_sampler_params smp_p = {.temperature = o.temp, .top_k = o.top_k, .top_p = o.top_p,
                                       .seed = o.seed_set ? o.seed : (uint64_t)time(NULL)};
    if ((st = tkv_sampler_init(&smp_p, info.n_vocab, &smp)) != TKV_OK) {
        fail("sampler", st);
        goto out;
    }

    if (o.load_kv) {
        double t0 = cli_now();
        if ((st = tkv_session_load(s, o.load_kv)) != TKV_OK) {
            fail("load-kv", st);
            goto out;
        }
        if (o.stats)
            fprintf(stderr, "load-kv: restored %zu tokens from %s in %.3f s\n", tkv_session_n_past(s), o.load_kv,
                    cli_now() - t0);
        if (tkv_session_n_past(s) + n_prompt > n_ctx) {
            fprintf(stderr, "%s: %zu saved + %zu prompt tokens exceed the context of %u\n", prog,
                    tkv_session_n_past(s), n_prompt, n_ctx);
            goto out;
        }
    }
    ps.t0 = cli_now();
    if (n_prompt > 0 && (st = tkv_prefill(s, toks, n_prompt)) != TKV_OK) {
        fail("prefill", st);
        goto out;
    }
    uint32_t generated = 0;
    for (; generated < o.n_predict; generated++) {
        tkv_token t = tkv_sampler_sample(smp, tkv_logits(s));
        if (!o.ignore_eos && tkv_token_is_eog(m, t))
            break;
        char piece[256];
        size_t len;
        if (tkv_detokenize(m, &t, 1, 0, piece, sizeof piece, &len) == TKV_OK)
            fwrite(piece, 1, len, stdout);
        fflush(stdout);
        if (tkv_session_n_past(s) >= n_ctx) {
            fprintf(stderr, "\n%s: context of %u tokens is full; stopping\n", prog, n_ctx);
            generated++;
            break;
        }
        if ((st = tkv_decode(s, t)) != TKV_OK) {
            fail("decode", st);
            goto out;
        }
    }
    if (generated > 0)
        fputc('\n', stdout);
    fflush(stdout);
    if (o.save_kv) {
        double t0 = cli_now();
        if ((st = tkv_session_save(s, o.save_kv)) != TKV_OK) {
            fail("save-kv", st);
            goto out;
        }
        if (o.stats)
            fprintf(stderr, "save-kv: saved %zu tokens to %s in %.3f s\n", tkv_session_n_past(s), o.save_kv,
                    cli_now() - t0);
    }

    if (o.stats || o.stats_json) {
        char json[4096];
        size_t len;
        if ((st = tkv_session_stats_json(s, json, sizeof json, &len)) != TKV_OK) {
            fail("stats", st);
            goto out;
        }
        if (o.stats)
            fprintf(stderr, "prompt %zu tokens, generated %u tokens, seed %llu\n%s\n", n_prompt, generated,
                    (unsigned long long)smp_p.seed, json);
        /* TKV_CUDA_PROFILE=1: the whole run's ops (docs/gpu.md, "Op profile") */
        struct tkv_backend *be = tkv_session_backend(s);
        struct tkv_op_profile prof;
        if (o.stats && be->ops->profile_read && be->ops->profile_read(be, &prof) == TKV_OK)
            tkv_op_profile_print("tierkv run (prefill and decode)", &prof, 0);
        if (o.stats_json) {
            FILE *f = fopen(o.stats_json, "w");
            if (!f || fprintf(f, "%s\n", json) < 0 || fclose(f) != 0) {
                fprintf(stderr, "%s: cannot write '%s': %s\n", prog, o.stats_json, strerror(errno));
                goto out;
            }
        }
    }
    rc = 0;
out:
    tkv_sampler_free(smp);
    tkv_session_free(s);
    tkv_model_free(m);
    free(toks);
    free(chat);
    free(text);
    return rc;
}

/* ---- tierkv info ---------------------------------------------------------- */

static int cmd_info(int argc, char **argv)
{
    struct options o;
    int rc = parse_options(argc, argv, 2, &o);
    if (rc)
        return rc;
    tkv_model *m;
    if (load_model(o.model, &m))
        return 1;
    struct tkv_model_info i;
    tkv_model_get_info(m, &i);
    printf("file          %s (%llu bytes)\n", o.model, (unsigned long long)i.file_bytes);
    printf("name          %s\n", i.name[0] ? i.name : "(none)");
    printf("architecture  %s\n", i.arch);
    printf("parameters    %llu\n", (unsigned long long)i.n_params);
    printf("file type     %u\n", i.file_type);
    printf("layers        %u\n", i.n_layer);
    printf("embedding     %u\n", i.n_embd);
    printf("heads         %u query, %u KV (head_dim %u)\n", i.n_head, i.n_head_kv, i.head_dim);
    printf("feed-forward  %u\n", i.n_ff);
    printf("vocabulary    %u (%s, pre-tokenizer %s)\n", i.n_vocab, i.tokenizer, i.pretokenizer);
    printf("context       %u tokens (trained)\n", i.n_ctx_train);
    printf("rope          base %g, dims %u, freq scale %g\n", i.rope_base, i.rope_dim, i.rope_scale);
    printf("rms eps       %g\n", i.rms_eps);
    printf("bos / eos     %d / %d\n", i.bos, i.eos);
    printf("KV per token  %u bytes (f16)\n", i.n_layer * i.n_head_kv * i.head_dim * 2 * 2);
    printf("valid         yes\n");
    tkv_model_free(m);
    return 0;
}

/* ---- tierkv tokenize ------------------------------------------------------- */

static int cmd_tokenize(int argc, char **argv)
{
    struct options o;
    int rc = parse_options(argc, argv, 2, &o);
    if (rc)
        return rc;
    if (!o.prompt && !o.file)
        return usage_error("%s", "no text: give -p TEXT or -f FILE");
    char *text = assemble_prompt(&o);
    if (!text)
        return 1;
    tkv_model *m;
    if (load_model(o.model, &m)) {
        free(text);
        return 1;
    }
    size_t n;
    tkv_token *toks = tokenize_all(m, text, o.special ? TKV_TOK_PARSE_SPECIAL : 0, &n);
    if (toks) {
        for (size_t i = 0; i < n; i++)
            printf("%s%d", i ? " " : "", toks[i]);
        printf("\n");
    }
    free(toks);
    free(text);
    tkv_model_free(m);
    return toks ? 0 : 1;
}

/* OpenBLAS reads OPENBLAS_CORETYPE once, when it loads: if it fell back to
 * generic kernels on this CPU, run again with the variable set (once: the
 * new process finds it set). */
static void reexec_for_blas(char **argv)
{
    const char *coretype = tkv_blas_coretype_advice();
    if (!coretype || setenv("OPENBLAS_CORETYPE", coretype, 1) != 0)
        return;
    execv("/proc/self/exe", argv);
    unsetenv("OPENBLAS_CORETYPE"); /* could not: carry on with the generic kernels */
}

int main(int argc, char **argv)
{
    reexec_for_blas(argv);
    if (argc < 2)
        return usage_error("%s", "no command given (run, eval, info, tokenize or gen-model)");
    const char *cmd = argv[1];
    if (!strcmp(cmd, "-h") || !strcmp(cmd, "--help") || !strcmp(cmd, "help")) {
        print_help();
        return 0;
    }
    if (!strcmp(cmd, "run"))
        return cmd_run(argc, argv);
    if (!strcmp(cmd, "info"))
        return cmd_info(argc, argv);
    if (!strcmp(cmd, "tokenize"))
        return cmd_tokenize(argc, argv);
    if (!strcmp(cmd, "eval"))
        return cmd_eval(argc, argv);
    if (!strcmp(cmd, "gen-model"))
        return cmd_gen_model(argc, argv);
    return usage_error("unknown command '%s' (expected run, eval, info, tokenize or gen-model)", cmd);
}
