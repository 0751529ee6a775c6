/*
 * test-kv-file.c -- saving and restoring a session's KV (tkv_session_save /
 * tkv_session_load) on a tiny random model: the restored session continues
 * exactly as the original (same logits, bit for bit), also when the KV is
 * spilled to NVMe on either side, and when most of a longer context lands
 * below a tight compute tier (through the store's bulk import); and a
 * truncated, bit-flipped, other-model or mismatched file is refused with the
 * right status while the session keeps what it had.
 */
#include "tierkv.h"
#include "runtime/gen-model.h"
#include "runtime/session.h" /* the session's KV store: where the blocks went, and how */
#include "tiny-model.h"

#include <sys/stat.h>
#include <unistd.h>

static char dir[256];

static tkv_model *load_tiny(uint32_t wtype, const char *name)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s.gguf", dir, name);
    struct ref_model rm;
    write_model(path, wtype, &rm);
    ref_free(&rm);
    tkv_model *m = NULL;
    tkv_status st = tkv_model_load(path, &m);
    CHECK(st == TKV_OK, "load %s: %s", path, tkv_last_error());
    unlink(path);
    return m;
}

static tkv_session *session(tkv_model *m, uint32_t kv_block, bool spill)
{
    struct tkv_session_params sp = tkv_session_default_params();
    sp.n_threads = 2;
    sp.kv_block = kv_block;
    if (spill) { /* one layer (4 blocks of 4 KiB) and one more block fit; the rest spills */
        sp.host_kv_mem = 5 * 4096;
        sp.nvme_dir = dir;
    }
    tkv_session *s = NULL;
    tkv_status st = tkv_session_init(m, &sp, &s);
    CHECK(st == TKV_OK, "session: %s", tkv_last_error());
    return s;
}

static bool same_logits(const tkv_session *a, const tkv_session *b)
{
    const float *x = tkv_logits(a), *y = tkv_logits(b);
    return x && y && !memcmp(x, y, V * sizeof(float));
}

static long file_size(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 ? (long)st.st_size : -1;
}

static void flip_byte(const char *path, long off)
{
    FILE *f = fopen(path, "r+b");
    fseek(f, off, SEEK_SET);
    int c = fgetc(f);
    fseek(f, off, SEEK_SET);
    fputc(c ^ 0x04, f);
    fclose(f);
}

static void copy_file(const char *from, const char *to, long n)
{
    FILE *a = fopen(from, "rb"), *b = fopen(to, "wb");
    char buf[4096];
    while (n > 0) {
        size_t got = fread(buf, 1, (size_t)TKV_MIN(n, (long)sizeof buf), a);
        if (!got)
            break;
        fwrite(buf, 1, got, b);
        n -= (long)got;
    }
    fclose(a);
    fclose(b);
}

/* The session refuses path with `want` and keeps its context. */
static void expect_refused(tkv_session *s, const char *path, tkv_status want, const char *what)
{
    const size_t n_before = tkv_session_n_past(s);
    float before[V];
    memcpy(before, tkv_logits(s), sizeof before);
    tkv_status st = tkv_session_load(s, path);
    CHECK(st == want, "%s: expected %s, got %s (%s)", what, tkv_status_str(want), tkv_status_str(st), tkv_last_error());
    CHECK(tkv_session_n_past(s) == n_before && tkv_logits(s) && !memcmp(before, tkv_logits(s), sizeof before),
          "%s: a refused load changed the session", what);
}

static void round_trip(tkv_model *m, bool spill_save, bool spill_load)
{
    tkv_token toks[100];
    for (int i = 0; i < 100; i++)
        toks[i] = (tkv_token)(1 + test_rand_u64(&rng) % (V - 1));
    tkv_session *a = session(m, 64, spill_save), *b = session(m, 64, spill_load);
    REQUIRE_VOID(a && b);
    REQUIRE_VOID(tkv_prefill(a, toks, 90) == TKV_OK);
    char path[512];
    snprintf(path, sizeof path, "%s/kv.bin", dir);
    tkv_status st = tkv_session_save(a, path);
    CHECK(st == TKV_OK, "save: %s", tkv_last_error());
    st = tkv_session_load(b, path);
    CHECK(st == TKV_OK, "load: %s", tkv_last_error());
    CHECK(tkv_session_n_past(b) == 90 && !memcmp(tkv_session_tokens(b), toks, 90 * sizeof *toks),
          "restored tokens differ");
    CHECK(same_logits(a, b), "restored logits differ (spill %d/%d)", spill_save, spill_load);
    for (int i = 90; i < 100; i++) { /* both continue identically */
        CHECK(tkv_decode(a, toks[i]) == TKV_OK && tkv_decode(b, toks[i]) == TKV_OK, "decode: %s", tkv_last_error());
        CHECK(same_logits(a, b), "decode step %d after restore differs (spill %d/%d)", i, spill_save, spill_load);
    }
    unlink(path);
    tkv_session_free(a);
    tkv_session_free(b);
}

/* A longer context (8 layers, 1000 tokens: 256 blocks of 4 KiB) restored
 * into a session whose compute tier holds one layer and one block: the load
 * goes through tkv_kvs_import_n (counted by the store; the blocks that lose
 * go straight to NVMe, so the compute tier takes in fewer than all of them,
 * which importing one block at a time cannot do), most blocks end below, and
 * decoding continues bit for bit as in the session that was saved. The
 * same for tkv_session_fork of the saved session into that cap. */
static void tight_cap_load(void)
{
    enum { N = 1000, NB = (N + 63) / 64, STEPS = 8 };
    char model_path[512], path[512];
    snprintf(model_path, sizeof model_path, "%s/c.gguf", dir);
    snprintf(path, sizeof path, "%s/long.bin", dir);
    struct tkv_gen_params gp = {.type = TKV_TYPE_F16, .seed = 7, .n_threads = 2};
    REQUIRE_VOID(tkv_gen_shape_parse("custom:8,64,4,2,96,258", &gp.shape) == TKV_OK);
    REQUIRE_VOID(tkv_gen_model(&gp, model_path) == TKV_OK);
    tkv_model *m = NULL;
    tkv_status st = tkv_model_load(model_path, &m);
    unlink(model_path);
    REQUIRE_VOID(st == TKV_OK);
    const uint32_t L = gp.shape.n_layer, HKV = gp.shape.n_head_kv, n_vocab = gp.shape.n_vocab;
    const uint64_t n_blk = (uint64_t)L * HKV * NB, S = 4u * 64 * (gp.shape.n_embd / gp.shape.n_head);

    tkv_token toks[N + STEPS], other[300];
    for (int i = 0; i < N + STEPS; i++)
        toks[i] = (tkv_token)(1 + test_rand_u64(&rng) % (n_vocab - 1));
    for (int i = 0; i < 300; i++)
        other[i] = (tkv_token)(1 + test_rand_u64(&rng) % (n_vocab - 1));
    struct tkv_session_params sp = tkv_session_default_params();
    sp.n_threads = 2;
    sp.n_ctx = 1024; /* one layer of it: 32 blocks */
    sp.kv_block = 64;
    tkv_session *a = NULL, *b = NULL;
    REQUIRE_VOID(tkv_session_init(m, &sp, &a) == TKV_OK);
    sp.host_kv_mem = (HKV * NB + 1) * S; /* one layer and one block */
    sp.nvme_dir = dir;
    REQUIRE_VOID(tkv_session_init(m, &sp, &b) == TKV_OK);
    REQUIRE_VOID(tkv_prefill(a, toks, N) == TKV_OK);
    CHECK(tkv_prefill(b, other, 300) == TKV_OK, "prefill: %s", tkv_last_error()); /* a context of its own, spilled */
    st = tkv_session_save(a, path);
    CHECK(st == TKV_OK, "save: %s", tkv_last_error());
    CHECK(tkv_kvs_block_bytes(b->kv) == S, "block bytes %u, expected %llu", tkv_kvs_block_bytes(b->kv),
          (unsigned long long)S);

    struct tkv_kvs_stats k0, k1;
    tkv_kvs_get_stats(b->kv, &k0);
    st = tkv_session_load(b, path);
    CHECK(st == TKV_OK, "load under a tight cap: %s", tkv_last_error());
    tkv_kvs_get_stats(b->kv, &k1);
    const uint64_t bulk = k1.bulk_blocks - k0.bulk_blocks,
                   compute_in = k1.tier[TKV_TIER_COMPUTE].bytes_in - k0.tier[TKV_TIER_COMPUTE].bytes_in,
                   nvme_in = k1.tier[TKV_TIER_NVME].bytes_in - k0.tier[TKV_TIER_NVME].bytes_in;
    uint64_t below = 0;
    for (uint32_t l = 0; l < L; l++)
        for (uint32_t h = 0; h < HKV; h++)
            for (uint32_t blk = 0; blk < NB; blk++)
                below += tkv_kvs_block_tier(b->kv, l, h, blk) != TKV_TIER_COMPUTE;
    fprintf(stderr, "tight cap: %llu blocks, %llu bulk-imported, %llu below compute; compute took %llu, nvme %llu\n",
            (unsigned long long)n_blk, (unsigned long long)bulk, (unsigned long long)below,
            (unsigned long long)(compute_in / S), (unsigned long long)(nvme_in / S));
    CHECK(bulk == n_blk, "the load bulk-imported %llu of %llu blocks", (unsigned long long)bulk,
          (unsigned long long)n_blk);
    CHECK(compute_in < n_blk * S && nvme_in > 0,
          "every block passed through the compute tier (%llu bytes in): not the bulk path", (unsigned long long)compute_in);
    CHECK(below * 2 > n_blk, "only %llu of %llu blocks below the compute tier", (unsigned long long)below,
          (unsigned long long)n_blk);
    CHECK(tkv_session_n_past(b) == N && !memcmp(tkv_session_tokens(b), toks, N * sizeof *toks),
          "restored tokens differ");
    CHECK(tkv_logits(b) && !memcmp(tkv_logits(a), tkv_logits(b), n_vocab * sizeof(float)), "restored logits differ");
    /* a fork into the same tight cap takes the bulk path too */
    tkv_session *c = NULL;
    st = tkv_session_fork(a, &sp, &c);
    REQUIRE_VOID(st == TKV_OK);
    struct tkv_kvs_stats kc;
    tkv_kvs_get_stats(c->kv, &kc);
    fprintf(stderr, "tight cap fork: %llu of %llu blocks bulk-imported\n", (unsigned long long)kc.bulk_blocks,
            (unsigned long long)n_blk);
    CHECK(kc.bulk_blocks == n_blk, "the fork bulk-imported %llu of %llu blocks", (unsigned long long)kc.bulk_blocks,
          (unsigned long long)n_blk);
    CHECK(kc.tier[TKV_TIER_COMPUTE].bytes_in < n_blk * S, "every forked block passed through the compute tier");
    CHECK(tkv_logits(c) && !memcmp(tkv_logits(a), tkv_logits(c), n_vocab * sizeof(float)), "forked logits differ");
    for (int i = N; i < N + STEPS; i++) {
        CHECK(tkv_decode(a, toks[i]) == TKV_OK && tkv_decode(b, toks[i]) == TKV_OK && tkv_decode(c, toks[i]) == TKV_OK,
              "decode: %s", tkv_last_error());
        CHECK(!memcmp(tkv_logits(a), tkv_logits(b), n_vocab * sizeof(float)),
              "decode step %d after a tight-cap restore differs", i);
        CHECK(!memcmp(tkv_logits(a), tkv_logits(c), n_vocab * sizeof(float)),
              "decode step %d after a tight-cap fork differs", i);
    }
    tkv_session_free(c);
    unlink(path);
    tkv_session_free(a);
    tkv_session_free(b);
    tkv_model_free(m);
}

int main(void)
{
    rng = test_seed();
    snprintf(dir, sizeof dir, "%s/test-kv-file.%d", getenv("TKV_BUILD_DIR") ? getenv("TKV_BUILD_DIR") : "/var/tmp",
             getpid());
    REQUIRE(mkdir(dir, 0700) == 0, "mkdir %s", dir);
    tkv_model *m = load_tiny(TKV_TYPE_F32, "a"), *other = load_tiny(TKV_TYPE_F16, "b");
    REQUIRE(m && other, "tiny models");

    round_trip(m, false, false);
    round_trip(m, true, false); /* saved from NVMe-spilled KV */
    round_trip(m, false, true); /* restored into a session that spills */
    tight_cap_load();

    /* a good file, then damaged copies of it */
    tkv_token toks[60];
    for (int i = 0; i < 60; i++)
        toks[i] = (tkv_token)(1 + test_rand_u64(&rng) % (V - 1));
    tkv_session *s = session(m, 64, false), *t = session(m, 64, false);
    REQUIRE(s && t, "sessions");
    REQUIRE(tkv_prefill(s, toks, 60) == TKV_OK, "prefill");
    REQUIRE(tkv_prefill(t, toks, 7) == TKV_OK, "prefill"); /* t has a context of its own */
    char good[512], bad[512];
    snprintf(good, sizeof good, "%s/good.bin", dir);
    snprintf(bad, sizeof bad, "%s/bad.bin", dir);
    REQUIRE(tkv_session_save(s, good) == TKV_OK, "save: %s", tkv_last_error());
    const long size = file_size(good);
    fprintf(stderr, "saved 60 tokens: %ld bytes\n", size);

    const long cuts[] = {0, 4, 20, 60, 61, 300, size / 2, size - 1};
    for (size_t i = 0; i < sizeof cuts / sizeof cuts[0]; i++) {
        copy_file(good, bad, cuts[i]);
        char what[64];
        snprintf(what, sizeof what, "truncated at %ld", cuts[i]);
        tkv_status st = tkv_session_load(t, bad);
        CHECK(st == TKV_ERR_FORMAT || st == TKV_ERR_CORRUPT, "%s: got %s", what, tkv_status_str(st));
        CHECK(tkv_session_n_past(t) == 7, "%s: the session lost its context", what);
    }
    /* a flipped bit anywhere: header, token ids, logits, checksum table, payload */
    /* layout: 56-byte header, 60 ids + crc, V logits + crc, 4-entry crc table + crc, payloads */
    const long hdr = 56, logits_at = hdr + 60 * 4 + 4, table_at = logits_at + V * 4 + 4;
    const long flips[] = {9, 30, hdr + 8, logits_at + 8, table_at + 6, size - 100, size / 2};
    for (size_t i = 0; i < sizeof flips / sizeof flips[0]; i++) {
        copy_file(good, bad, size);
        flip_byte(bad, flips[i]);
        char what[64];
        snprintf(what, sizeof what, "bit flipped at %ld", flips[i]);
        tkv_status st = tkv_session_load(t, bad);
        CHECK(st == TKV_ERR_CORRUPT || st == TKV_ERR_FORMAT, "%s: got %s (%s)", what, tkv_status_str(st),
              tkv_last_error());
        CHECK(tkv_session_n_past(t) == 7, "%s: the session lost its context", what);
    }
    /* trailing garbage */
    copy_file(good, bad, size);
    FILE *f = fopen(bad, "ab");
    fputs("junk", f);
    fclose(f);
    expect_refused(t, bad, TKV_ERR_FORMAT, "trailing bytes");

    /* another model, other block size, a context too small, no file */
    tkv_session *o = session(other, 64, false), *ob = session(m, 32, false);
    REQUIRE(o && ob, "sessions");
    tkv_prefill(o, toks, 3);
    tkv_prefill(ob, toks, 3);
    expect_refused(o, good, TKV_ERR_UNSUPPORTED, "other model");
    CHECK(strstr(tkv_last_error(), "different model"), "message: %s", tkv_last_error());
    expect_refused(ob, good, TKV_ERR_UNSUPPORTED, "other block size");
    struct tkv_session_params sp = tkv_session_default_params();
    sp.n_ctx = 32;
    tkv_session *small = NULL;
    REQUIRE(tkv_session_init(m, &sp, &small) == TKV_OK, "session");
    tkv_prefill(small, toks, 3);
    expect_refused(small, good, TKV_ERR_CONTEXT_FULL, "context too small");
    snprintf(bad, sizeof bad, "%s/missing.bin", dir);
    expect_refused(t, bad, TKV_ERR_IO, "missing file");

    /* and the good file still loads */
    CHECK(tkv_session_load(t, good) == TKV_OK && same_logits(s, t), "good file after the bad ones: %s",
          tkv_last_error());
    /* a session with nothing to save says so */
    tkv_session *empty = session(m, 64, false);
    CHECK(tkv_session_save(empty, good) == TKV_ERR_INVALID_ARG, "saving an empty session must be refused");

    snprintf(bad, sizeof bad, "%s/bad.bin", dir);
    unlink(bad);
    unlink(good);
    tkv_session_free(empty);
    tkv_session_free(small);
    tkv_session_free(o);
    tkv_session_free(ob);
    tkv_session_free(s);
    tkv_session_free(t);
    tkv_model_free(m);
    tkv_model_free(other);
    CHECK(rmdir(dir) == 0, "files left in %s (spill files must vanish)", dir);
    return test_done();
}
