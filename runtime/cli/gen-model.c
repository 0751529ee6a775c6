/*
 * gen-model.c -- `tierkv gen-model`: a synthetic Llama model with random
 * weights of a real model's shape, as GGUF (runtime/gen-model.h,
 * docs/gen-model.md).
 *
 *   tierkv gen-model --shape llama3-8b --type q4_0 --seed 1 --out m.gguf [-t N]
 *
 * Exit status: 0 written, 1 runtime failure (I/O, memory), 2 bad usage
 * (including a bad shape). Progress (on a terminal) and the summary go to
 * stderr; stdout stays empty.
 */
#include "cli-util.h"
#include "runtime/gen-model.h"
#include "runtime/gguf.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int cmd_gen_model(int argc, char **argv);

static void gen_help(void)
{
    printf("usage: tierkv gen-model --shape SHAPE --type TYPE --out FILE.gguf [options]\n"
           "\n"
           "Writes a llama-architecture GGUF model with random weights at realistic scales\n"
           "(tierkv and llama.cpp load it). Same seed, shape and type: the same bytes.\n"
           "\n"
           "  --shape SHAPE   llama3-8b, qwen2.5-7b, tiny, or custom:L,E,H,HKV,F,V\n"
           "                  (layers, embedding, heads, KV heads, feed-forward, vocabulary)\n"
           "  --type TYPE     f16, q8_0 or q4_0 (every matrix; norms are f32)\n"
           "  --out FILE      output path (written as FILE.tmp.PID, renamed when complete)\n"
           "  --seed S        weight seed (default 1)\n"
           "  --ctx N         llama.context_length (default: the shape's; custom 4096)\n"
           "  -t, --threads N threads (default: all cores)\n");
}

static int gen_usage(const char *fmt, const char *arg)
{
    fprintf(stderr, "tierkv: gen-model: ");
    fprintf(stderr, fmt, arg);
    fprintf(stderr, " (see 'tierkv gen-model --help')\n");
    return 2;
}

/* The library's message without its "gen-model: " prefix (ours says it). */
static const char *lib_msg(void)
{
    const char *m = tkv_last_error();
    return strncmp(m, "gen-model: ", 11) == 0 ? m + 11 : m;
}

struct gen_progress {
    double t0;
    int last_pct;
};

static void on_progress(uint64_t done, uint64_t total, void *user)
{
    struct gen_progress *gp = user;
    int pct = total ? (int)(100 * done / total) : 100;
    if (pct == gp->last_pct)
        return;
    gp->last_pct = pct;
    double dt = cli_now() - gp->t0;
    fprintf(stderr, "\rgen-model: %3d%%  %.2f / %.2f GB  %.0f MB/s", pct, done / 1e9, total / 1e9,
            dt > 0 ? done / dt / 1e6 : 0.0);
    if (done == total)
        fputs("\r\033[K", stderr);
    fflush(stderr);
}

int cmd_gen_model(int argc, char **argv)
{
    const char *shape = NULL, *type = NULL, *out = NULL;
    uint64_t seed = 1;
    uint32_t threads = 0, ctx = 0;
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (cli_is_opt(a, "-h", "--help")) {
            gen_help();
            return 0;
        }
        bool known = cli_is_opt(a, "--shape", NULL) || cli_is_opt(a, "--type", NULL) ||
                     cli_is_opt(a, "--out", "-o") || cli_is_opt(a, "--seed", NULL) || cli_is_opt(a, "--ctx", NULL) ||
                     cli_is_opt(a, "-t", "--threads");
        if (!known)
            return gen_usage("unknown option '%s'", a);
        if (!v)
            return gen_usage("option '%s' needs a value", a);
        i++;
        if (cli_is_opt(a, "--shape", NULL)) {
            shape = v;
        } else if (cli_is_opt(a, "--type", NULL)) {
            type = v;
        } else if (cli_is_opt(a, "--out", "-o")) {
            out = v;
        } else if (cli_is_opt(a, "--seed", NULL)) {
            if (!cli_parse_u64(v, &seed))
                return gen_usage("--seed expects a non-negative integer, got '%s'", v);
        } else if (cli_is_opt(a, "--ctx", NULL)) {
            if (!cli_parse_u32(v, &ctx) || ctx == 0)
                return gen_usage("--ctx expects a token count >= 1, got '%s'", v);
        } else if (!cli_parse_u32(v, &threads) || threads == 0 || threads > 1024) {
            return gen_usage("-t expects 1..1024 threads, got '%s'", v);
        }
    }
    if (!shape)
        return gen_usage("%s", "no shape: give --shape llama3-8b|qwen2.5-7b|tiny|custom:L,E,H,HKV,F,V");
    if (!type)
        return gen_usage("%s", "no type: give --type f16|q8_0|q4_0");
    if (!out || !*out)
        return gen_usage("%s", "no output file: give --out FILE.gguf");

    struct tkv_gen_params p = {.seed = seed, .n_threads = threads};
    if (!strcmp(type, "f16"))
        p.type = TKV_TYPE_F16;
    else if (!strcmp(type, "q8_0"))
        p.type = TKV_TYPE_Q8_0;
    else if (!strcmp(type, "q4_0"))
        p.type = TKV_TYPE_Q4_0;
    else
        return gen_usage("unknown type '%s' (expected f16, q8_0 or q4_0)", type);
    /* a bad shape is bad usage: the library's message says what is wrong */
    if (tkv_gen_shape_parse(shape, &p.shape) != TKV_OK)
        return gen_usage("%s", lib_msg());
    if (ctx)
        p.shape.n_ctx = ctx;
    if (tkv_gen_shape_check(&p.shape, p.type) != TKV_OK)
        return gen_usage("%s", lib_msg());

    struct gen_progress gp = {.t0 = cli_now(), .last_pct = -1};
    if (isatty(2)) {
        p.progress = on_progress;
        p.progress_user = &gp;
    }
    tkv_status st = tkv_gen_model(&p, out);
    if (st != TKV_OK) {
        fprintf(stderr, "tierkv: gen-model: %s (%s)\n", tkv_last_error(), tkv_status_str(st));
        return 1;
    }
    double dt = cli_now() - gp.t0;
    struct stat sb;
    double bytes = stat(out, &sb) == 0 ? (double)sb.st_size : 0.0;
    fprintf(stderr, "gen-model: wrote %s: %s %s seed %llu, %.3f GB in %.2f s (%.0f MB/s, %u threads)\n", out, shape,
            type, (unsigned long long)seed, bytes / 1e9, dt, dt > 0 ? bytes / dt / 1e6 : 0.0,
            threads ? threads : (unsigned)sysconf(_SC_NPROCESSORS_ONLN));
    return 0;
}
