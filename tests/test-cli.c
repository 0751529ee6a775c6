/*
 * test-cli.c -- the `tierkv` command line as a user meets it: bad usage and
 * bad inputs end with one clear line on stderr and a non-zero exit (never a
 * crash), stdout carries only generated text, and `run`, `info`, `tokenize`
 * work on the real model (those parts skip without it).
 */
#include "test.h"

/* command lines are built from short test paths into fixed buffers */
#pragma GCC diagnostic ignored "-Wformat-truncation"

#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static char tierkv[4096];

struct result {
    int status;      /* exit status, or 128 + signal */
    char out[8192];  /* stdout */
    char err[8192];  /* stderr */
};

static void slurp(const char *path, char *buf, size_t cap)
{
    FILE *f = fopen(path, "rb");
    size_t n = f ? fread(buf, 1, cap - 1, f) : 0;
    buf[n] = 0;
    if (f)
        fclose(f);
}

/* Runs `tierkv ARGS` through the shell, capturing stdout and stderr. */
static void run(struct result *r, const char *args)
{
    char cmd[16384];
    snprintf(cmd, sizeof cmd, "%s %s >/tmp/tkv-cli-out.%d 2>/tmp/tkv-cli-err.%d </dev/null", tierkv, args, getpid(),
             getpid());
    int st = system(cmd);
    r->status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
    char p[64];
    snprintf(p, sizeof p, "/tmp/tkv-cli-out.%d", getpid());
    slurp(p, r->out, sizeof r->out);
    unlink(p);
    snprintf(p, sizeof p, "/tmp/tkv-cli-err.%d", getpid());
    slurp(p, r->err, sizeof r->err);
    unlink(p);
}

static int count_lines(const char *s)
{
    int n = 0;
    for (; *s; s++)
        n += *s == '\n';
    return n;
}

/* A usage or input error: the expected exit status, one line on stderr that
 * contains `needle`, nothing on stdout, no crash (a sanitizer report or a
 * signal would show as a different status or extra lines). */
static void expect_error(const char *args, int status, const char *needle)
{
    struct result r;
    run(&r, args);
    CHECK(r.status == status, "'tierkv %s': exit %d, expected %d (stderr: %s)", args, r.status, status, r.err);
    CHECK(count_lines(r.err) == 1, "'tierkv %s': stderr should be one line, got: %s", args, r.err);
    CHECK(strstr(r.err, needle) != NULL, "'tierkv %s': stderr lacks '%s': %s", args, needle, r.err);
    CHECK(r.out[0] == 0, "'tierkv %s': stdout should be empty, got: %s", args, r.out);
}

int main(void)
{
    const char *dir = getenv("TKV_BUILD_DIR");
    snprintf(tierkv, sizeof tierkv, "%s/tierkv", dir ? dir : ".");
    REQUIRE(access(tierkv, X_OK) == 0, "tierkv binary not found at %s", tierkv);

    /* usage errors: exit 2 */
    expect_error("", 2, "no command");
    expect_error("frobnicate", 2, "unknown command 'frobnicate'");
    expect_error("run -m x.gguf --bogus", 2, "unknown option '--bogus'");
    expect_error("run -m", 2, "needs a value");
    expect_error("run -p hi", 2, "no model");
    expect_error("run -m /dev/null -n many -p hi", 2, "-n expects a count");
    expect_error("run -m /dev/null -p hi --top-p 1.5", 2, "--top-p");
    expect_error("run -m /dev/null -p hi --temp -1", 2, "--temp");
    expect_error("run -m /dev/null -p hi -t 0", 2, "-t expects");

    /* input errors: exit 1 with what was wrong and where */
    expect_error("run -m /nonexistent/model.gguf -p hi", 1, "/nonexistent/model.gguf");
    expect_error("info -m /dev/null", 1, "gguf");
    char junk[] = "/tmp/tkv-cli-junk-XXXXXX";
    int fd = mkstemp(junk);
    REQUIRE(fd >= 0, "mkstemp");
    REQUIRE(write(fd, "GGUF\x03\x00\x00\x00garbage", 15) == 15, "write");
    close(fd);
    char args[8192];
    snprintf(args, sizeof args, "info -m %s", junk);
    expect_error(args, 1, "TKV_ERR_FORMAT");
    unlink(junk);

    struct result r;
    run(&r, "--help");
    CHECK(r.status == 0 && strstr(r.out, "usage: tierkv"), "--help: exit %d", r.status);

    /* with the real model */
    const char *model = getenv("TKV_MODEL");
    if (!model || access(model, R_OK) != 0) {
        fprintf(stderr, "model not present: skipping the model checks\n");
        return test_done();
    }
    snprintf(args, sizeof args, "info -m %s", model);
    run(&r, args);
    CHECK(r.status == 0 && strstr(r.out, "valid         yes") && strstr(r.out, "layers        30"), "info: %d %s",
          r.status, r.out);

    snprintf(args, sizeof args, "tokenize -m %s -p 'Hello world! 123'", model);
    run(&r, args);
    CHECK(r.status == 0 && !strcmp(r.out, "19556 905 17 216 33 34 35\n"), "tokenize: '%s'", r.out);

    snprintf(args, sizeof args, "run -m %s -f /nonexistent/doc.txt -p hi", model);
    expect_error(args, 1, "/nonexistent/doc.txt");
    snprintf(args, sizeof args, "run -m %s -p 'the the the the the the the the the the' -c 4", model);
    expect_error(args, 1, "context");
    snprintf(args, sizeof args, "run -m %s -p hi --policy nonsense", model);
    expect_error(args, 1, "unknown policy 'nonsense'");
    snprintf(args, sizeof args, "run -m %s -p hi --device tpu", model);
    expect_error(args, 1, "unknown device 'tpu'");
    snprintf(args, sizeof args, "run -m %s -p hi --device cuda:x", model);
    expect_error(args, 1, "expected cuda:N");
    snprintf(args, sizeof args, "run -m %s -p hi --device cuda:99", model); /* no such GPU anywhere here */
    expect_error(args, 1, "cuda");

    /* greedy generation: stdout holds only the text; it is deterministic */
    snprintf(args, sizeof args, "run -m %s -p 'The capital of France is' -n 8 --temp 0 -t 2", model);
    run(&r, args);
    CHECK(r.status == 0 && strstr(r.out, "Paris"), "run: exit %d, out '%s', err '%s'", r.status, r.out, r.err);
    CHECK(r.err[0] == 0, "run without --stats printed to stderr: %s", r.err);
    struct result r2;
    run(&r2, args);
    CHECK(!strcmp(r.out, r2.out), "greedy runs differ: '%s' vs '%s'", r.out, r2.out);

    /* sampling: the same seed gives the same text; statistics as JSON */
    char json[] = "/tmp/tkv-cli-stats-XXXXXX";
    fd = mkstemp(json);
    close(fd);
    snprintf(args, sizeof args,
             "run -m %s -p 'Once upon a time' -n 12 --temp 0.9 --top-k 40 --top-p 0.9 --seed 7 -t 2 --stats-json %s",
             model, json);
    run(&r, args);
    run(&r2, args);
    CHECK(r.status == 0 && r.out[0] && !strcmp(r.out, r2.out), "seeded runs differ: '%s' vs '%s'", r.out, r2.out);
    char stats[4096];
    slurp(json, stats, sizeof stats);
    unlink(json);
    CHECK(strstr(stats, "\"decode\"") && strstr(stats, "\"prefill\""), "stats json: %s", stats);

    /* the KV spilled to NVMe, and saved/restored, gives the same tokens */
    const char *doc = test_data_path("prompt-long.txt");
    char base_args[4096], spill_dir[256], kv[256];
    snprintf(spill_dir, sizeof spill_dir, "/tmp/tkv-cli-spill.%d", getpid());
    snprintf(kv, sizeof kv, "/tmp/tkv-cli-kv.%d", getpid());
    REQUIRE(mkdir(spill_dir, 0700) == 0, "mkdir %s", spill_dir);
    snprintf(base_args, sizeof base_args, "run -m %s -f %s -p Summary: -n 12 --temp 0 -t 2 --ignore-eos", model, doc);
    run(&r, base_args);
    CHECK(r.status == 0 && r.out[0], "all-in-RAM run: exit %d err %s", r.status, r.err);
    snprintf(args, sizeof args, "%s --host-kv-mem 8M --nvme-dir %s --stats-json %s", base_args, spill_dir, json);
    run(&r2, args);
    CHECK(r2.status == 0 && !strcmp(r.out, r2.out), "spilled run differs: '%s' vs '%s' (%s)", r.out, r2.out, r2.err);
    slurp(json, stats, sizeof stats);
    CHECK(strstr(stats, "\"nvme\": {\"present\": true") != NULL, "the spilled run has no NVMe tier: %s", stats);
    const char *nv = strstr(stats, "\"nvme\"");
    const char *in = nv ? strstr(nv, "\"bytes_out\": ") : NULL;
    CHECK(in && strtoull(in + 13, NULL, 10) > 0, "nothing was read back from NVMe: %s", stats);
    unlink(json);
    CHECK(rmdir(spill_dir) == 0, "spill files left in %s", spill_dir);
    snprintf(args, sizeof args, "run -m %s -f %s -p Summary: -n 0 -t 2 --save-kv %s", model, doc, kv);
    run(&r2, args);
    CHECK(r2.status == 0 && r2.out[0] == 0, "save-kv: exit %d err %s", r2.status, r2.err);
    snprintf(args, sizeof args, "run -m %s --load-kv %s -n 12 --temp 0 -t 2 --ignore-eos", model, kv);
    run(&r2, args);
    CHECK(r2.status == 0 && !strcmp(r.out, r2.out), "restored run differs: '%s' vs '%s' (%s)", r.out, r2.out, r2.err);
    unlink(kv);
    snprintf(args, sizeof args, "run -m %s --load-kv /nonexistent/kv.bin -n 4", model);
    expect_error(args, 1, "/nonexistent/kv.bin");

    /* -n 0: prefill only, no output */
    snprintf(args, sizeof args, "run -m %s -p 'Hello' -n 0", model);
    run(&r, args);
    CHECK(r.status == 0 && r.out[0] == 0, "-n 0: exit %d out '%s'", r.status, r.out);
    return test_done();
}
