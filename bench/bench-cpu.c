/*
 * bench-cpu.c -- prefill and decode speed on the CPU, side by side with
 * llama.cpp (through llama-cpp-python) in the same run.
 *
 *   bench-cpu -m MODEL [-c 512,2048,8192] [-t 2] [-d 32] [-r 2]
 *             [--peer-python PY] [--no-peer] [-o md|jsonl]
 *   bench-cpu -m MODEL -c 8192 --policies 'full;critiprefill;entropy:faithful=1;entropy'
 *             (prefill time per KV policy, speedup over full, in one run)
 *
 * For each context N: an N-token prompt (the GPL-3 text, repeated) is
 * prefilled in a fresh session, then D tokens are decoded greedily; the best
 * of r repetitions is kept. The peer runs bench/peer_llamacpp.py with the
 * same N, D, threads and repetitions. Prints a Markdown table (or JSON lines)
 * with the ratio ours / llama.cpp (> 1 means we are faster).
 */
#include "runtime/tierkv.h"

#include "bench.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static int die(const char *what)
{
    fprintf(stderr, "bench-cpu: %s: %s\n", what, tkv_last_error());
    return 1;
}

/* n tokens of English text: the GPL-3, repeated as needed. */
static tkv_token *make_prompt(const tkv_model *m, size_t n)
{
    FILE *f = fopen("/usr/share/common-licenses/GPL-3", "rb");
    if (!f) {
        fprintf(stderr, "bench-cpu: cannot read /usr/share/common-licenses/GPL-3\n");
        return NULL;
    }
    static char text[1 << 17];
    size_t len = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[len] = 0;
    size_t cap = len + 16, got;
    tkv_token *base = malloc(cap * sizeof *base), *out = malloc(n * sizeof *out);
    if (!base || !out || tkv_tokenize(m, text, (ptrdiff_t)len, 0, base, cap, &got) != TKV_OK || got == 0) {
        free(base), free(out);
        return NULL;
    }
    for (size_t i = 0; i < n; i++)
        out[i] = base[i % got];
    free(base);
    return out;
}

struct result {
    double prefill_tok_s, decode_tok_s;
};

static int run_ours(const tkv_model *m, size_t n, uint32_t d, uint32_t threads, int reps, const char *policy,
                    struct result *r)
{
    tkv_token *prompt = make_prompt(m, n);
    if (!prompt)
        return 1;
    r->prefill_tok_s = r->decode_tok_s = 0;
    for (int rep = 0; rep < reps; rep++) {
        struct tkv_session_params sp = tkv_session_default_params();
        sp.n_ctx = (uint32_t)n + d + 16;
        sp.n_threads = threads;
        sp.policy = policy;
        tkv_session *s;
        if (tkv_session_init(m, &sp, &s) != TKV_OK)
            return die("session");
        double t0 = now();
        if (tkv_prefill(s, prompt, n) != TKV_OK)
            return die("prefill");
        double t1 = now();
        for (uint32_t i = 0; i < d; i++)
            if (tkv_decode(s, tkv_argmax(tkv_logits(s), tkv_model_n_vocab(m))) != TKV_OK)
                return die("decode");
        double t2 = now();
        tkv_session_free(s);
        if (n / (t1 - t0) > r->prefill_tok_s)
            r->prefill_tok_s = n / (t1 - t0);
        if (d / (t2 - t1) > r->decode_tok_s)
            r->decode_tok_s = d / (t2 - t1);
    }
    free(prompt);
    return 0;
}

static int run_peer(const char *python, const char *model, size_t n, uint32_t d, uint32_t threads, int reps,
                    struct result *r, char *version, size_t vcap)
{
    char out[] = "/tmp/bench-cpu-peer-XXXXXX";
    int fd = mkstemp(out);
    if (fd < 0)
        return 1;
    close(fd);
    char cmd[4096];
    snprintf(cmd, sizeof cmd,
             "%s %s/bench/peer_llamacpp.py --model '%s' --ctx %zu --threads %u --decode %u --reps %d --json '%s' "
             ">/dev/null 2>&1",
             python, TKV_SOURCE_DIR, model, n, threads, d, reps, out);
    int rc = system(cmd);
    FILE *f = fopen(out, "rb");
    char json[4096] = "";
    if (f) {
        size_t len = fread(json, 1, sizeof json - 1, f);
        json[len] = 0;
        fclose(f);
    }
    unlink(out);
    if (rc != 0 || !json[0]) {
        fprintf(stderr, "bench-cpu: the llama.cpp peer failed (%s); is llama-cpp-python installed for '%s'?\n", cmd,
                python);
        return 1;
    }
    r->prefill_tok_s = bench_json_number(json, "prefill_tok_s");
    r->decode_tok_s = bench_json_number(json, "decode_tok_s");
    const char *v = strstr(json, "\"version\":");
    if (v && (v = strchr(v + 10, '"'))) {
        size_t i = 0;
        for (v++; *v && *v != '"' && i + 1 < vcap; v++)
            version[i++] = *v;
        version[i] = 0;
    }
    return 0;
}

int main(int argc, char **argv)
{
    const char *model = NULL, *ctxs = "512,2048,8192", *python = "python3", *fmt = "md";
    uint32_t threads = 2, d = 32;
    int reps = 2;
    int peer = 1;
    const char *policies = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "-m") && v)
            model = v, i++;
        else if (!strcmp(a, "-c") && v)
            ctxs = v, i++;
        else if (!strcmp(a, "-t") && v)
            threads = (uint32_t)atoi(v), i++;
        else if (!strcmp(a, "-d") && v)
            d = (uint32_t)atoi(v), i++;
        else if (!strcmp(a, "-r") && v)
            reps = atoi(v), i++;
        else if (!strcmp(a, "-o") && v)
            fmt = v, i++;
        else if (!strcmp(a, "--peer-python") && v)
            python = v, i++;
        else if (!strcmp(a, "--no-peer"))
            peer = 0;
        else if (!strcmp(a, "--policies") && v)
            policies = v, i++;
        else {
            fprintf(stderr, "usage: bench-cpu -m MODEL [-c 512,2048,8192] [-t 2] [-d 32] [-r 2] [--peer-python PY] "
                            "[--no-peer] [-o md|jsonl] [--policies 'full;critiprefill;entropy']\n");
            return 2;
        }
    }
    if (!model || threads == 0 || reps < 1) {
        fprintf(stderr, "bench-cpu: -m MODEL is required; -t and -r must be positive\n");
        return 2;
    }
    tkv_model *m;
    if (tkv_model_load(model, &m) != TKV_OK)
        return die("load");
    const int md = !strcmp(fmt, "md");
    if (policies) { /* prefill time per KV policy, against full, in one run */
        printf("| ctx | policy | prefill s | prefill tok/s | speedup vs full | decode tok/s |\n|---:|---|---:|---:|---:|---:|\n");
        char *list = strdup(ctxs);
        for (char *tok = strtok(list, ","); tok; tok = strtok(NULL, ",")) {
            size_t n = (size_t)atol(tok);
            double full_tps = 0;
            char *pl = strdup(policies), *save = NULL;
            for (char *p = strtok_r(pl, ";", &save); p; p = strtok_r(NULL, ";", &save)) {
                struct result r;
                if (run_ours(m, n, d, threads, reps, p, &r))
                    return 1;
                if (!strcmp(p, "full"))
                    full_tps = r.prefill_tok_s;
                printf("| %zu | %s | %.2f | %.1f | %.2f | %.1f |\n", n, p, n / r.prefill_tok_s, r.prefill_tok_s,
                       full_tps > 0 ? r.prefill_tok_s / full_tps : 0, r.decode_tok_s);
                fflush(stdout);
            }
            free(pl);
        }
        free(list);
        tkv_model_free(m);
        return 0;
    }
    if (md) {
        printf("| ctx | threads | prefill tok/s (tierkv) | prefill tok/s (llama.cpp) | ratio | decode tok/s (tierkv) | "
               "decode tok/s (llama.cpp) | ratio |\n");
        printf("|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    }
    char version[64] = "";
    char *list = strdup(ctxs);
    for (char *tok = strtok(list, ","); tok; tok = strtok(NULL, ",")) {
        size_t n = (size_t)atol(tok);
        if (n == 0)
            continue;
        struct result ours, theirs = {0, 0};
        if (run_ours(m, n, d, threads, reps, "full", &ours))
            return 1;
        if (peer && run_peer(python, model, n, d, threads, reps, &theirs, version, sizeof version))
            peer = 0;
        double rp = theirs.prefill_tok_s > 0 ? ours.prefill_tok_s / theirs.prefill_tok_s : 0;
        double rd = theirs.decode_tok_s > 0 ? ours.decode_tok_s / theirs.decode_tok_s : 0;
        if (md)
            printf("| %zu | %u | %.1f | %.1f | %.2f | %.1f | %.1f | %.2f |\n", n, threads, ours.prefill_tok_s,
                   theirs.prefill_tok_s, rp, ours.decode_tok_s, theirs.decode_tok_s, rd);
        else
            printf("{\"ctx\": %zu, \"threads\": %u, \"decode_tokens\": %u, \"reps\": %d, \"tierkv_prefill_tok_s\": %.2f, "
                   "\"llamacpp_prefill_tok_s\": %.2f, \"prefill_ratio\": %.3f, \"tierkv_decode_tok_s\": %.2f, "
                   "\"llamacpp_decode_tok_s\": %.2f, \"decode_ratio\": %.3f, \"llamacpp_version\": \"%s\"}\n",
                   n, threads, d, reps, ours.prefill_tok_s, theirs.prefill_tok_s, rp, ours.decode_tok_s,
                   theirs.decode_tok_s, rd, version);
        fflush(stdout);
    }
    if (md)
        printf("\nratio = tierkv / llama.cpp (> 1: tierkv faster); decode = %u greedy tokens after the prompt; best of "
               "%d; peer: %s\n",
               d, reps, version[0] ? version : "(not run)");
    free(list);
    tkv_model_free(m);
    return 0;
}
