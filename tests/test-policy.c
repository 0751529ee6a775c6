/*
 * test-policy.c -- KV policies on hand-made attention patterns with known
 * answers: a sink-only head is Rigid and a head with spread attention is
 * Dynamic (EntropyInfer); CritiPrefill selects the blocks the segment's
 * queries point at; SnapKV keeps a needle the observation window attends
 * to, and EntropyInfer at gap=0 with the whole observation window (its
 * faithful variant with the newest half, as released); AdaKV's per-head budgets sum to the total and follow the scores;
 * StreamingLLM keeps sinks and a window; spec parsing names what is wrong;
 * the O(n) top-k equals its sort-based reference on random scores.
 */
#include "runtime/policy/policy.h"
#include "test.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { HD = 16, HKV = 2, H = 4, B = 64, CTX = 2048 };

static uint64_t rng;

static const struct tkv_policy_env env = {
    .n_layer = 2, .n_head = H, .n_head_kv = HKV, .head_dim = HD, .n_ctx = CTX, .block_tokens = B, .budget = 0};

/* Keys of both heads for positions [0, n): storage blocks of B tokens. */
struct keys {
    uint16_t k[HKV][CTX][HD], v[HKV][CTX][HD];
    struct tkv_kv_block_ref refs[HKV][CTX / B];
    struct tkv_kv_head_view view[HKV];
};

static void keys_views(struct keys *K, uint32_t n)
{
    for (uint32_t g = 0; g < HKV; g++) {
        uint32_t nb = (n + B - 1) / B;
        for (uint32_t b = 0; b < nb; b++)
            K->refs[g][b] = (struct tkv_kv_block_ref){.k = &K->k[g][b * B][0], .v = &K->v[g][b * B][0],
                                                      .pos0 = (int32_t)(b * B), .n = TKV_MIN(B, n - b * B)};
        K->view[g] = (struct tkv_kv_head_view){.blocks = K->refs[g], .n_blocks = nb};
    }
}

static void set_key(struct keys *K, uint32_t g, uint32_t pos, const float *x)
{
    for (uint32_t d = 0; d < HD; d++)
        K->k[g][pos][d] = tkv_fp32_to_fp16(x[d]);
}

static struct tkv_policy *make(const char *spec, uint32_t budget)
{
    struct tkv_policy_env e = env;
    e.budget = budget;
    struct tkv_policy *p = NULL;
    tkv_status st = tkv_policy_create(spec, &e, &p);
    CHECK(st == TKV_OK, "create %s: %s", spec, tkv_last_error());
    return p;
}

static uint32_t covered(const struct tkv_range *r, int n)
{
    uint32_t c = 0;
    for (int i = 0; i < n; i++)
        c += r[i].end - r[i].begin;
    return c;
}

static bool contains(const struct tkv_range *r, int n, uint32_t pos)
{
    for (int i = 0; i < n; i++)
        if (pos >= r[i].begin && pos < r[i].end)
            return true;
    return false;
}

/* ---- EntropyInfer: Rigid vs Dynamic ------------------------------------------------- */

static void test_entropy_classes(void)
{
    static struct keys K;
    static float q[512][H * HD];
    static int32_t pos[512];
    float dir[HD], x[HD];
    for (uint32_t d = 0; d < HD; d++)
        dir[d] = d < 4 ? 3.0f : 0.0f;
    /* head 0: a sink -- the first block's keys are huge along the queries'
     * direction, every other key is orthogonal: block 0 takes all the mass.
     * head 1: random keys of small size: attention is spread (high entropy) */
    for (uint32_t p = 0; p < CTX; p++) {
        for (uint32_t d = 0; d < HD; d++)
            x[d] = p < 8 ? 8.0f * dir[d] : (d < 4 ? 0.0f : test_rand_f32(&rng, -0.5f, 0.5f));
        set_key(&K, 0, p, x);
        for (uint32_t d = 0; d < HD; d++)
            x[d] = test_rand_f32(&rng, -0.3f, 0.3f);
        set_key(&K, 1, p, x);
    }
    keys_views(&K, CTX);
    /* base 128 tokens: Rigid heads take base/4 = 32 tokens (4 blocks of 8),
     * Dynamic ones at least 128 */
    struct tkv_policy *p = make("entropy:threshold=512,base=128,block=8,segment=512", 0);
    REQUIRE_VOID(p);
    static struct tkv_range r[1024];
    uint32_t got[HKV] = {0, 0};
    for (uint32_t seg = 1; seg < 4; seg++) { /* segments 1..3 of a 2048-token prompt */
        for (uint32_t t = 0; t < 512; t++) {
            pos[t] = (int32_t)(seg * 512 + t);
            for (uint32_t h = 0; h < H; h++)
                for (uint32_t d = 0; d < HD; d++)
                    q[t][h * HD + d] = dir[d] + test_rand_f32(&rng, -0.1f, 0.1f);
        }
        /* the prompt continues past these segments: none of them is the (dense) last one */
        struct tkv_policy_view v = {.layer = 1, .n_past = (seg + 1) * 512, .prefill_end = 2 * CTX, .q = &q[0][0],
                                    .q_pos = pos, .n_q = 512, .kv = K.view};
        for (uint32_t g = 0; g < HKV; g++) {
            int m = p->ops->prefill_select(p->state, &v, g, r, 1024);
            got[g] = m < 0 ? UINT32_MAX : covered(r, m);
            if (g == 0 && m > 0)
                CHECK(contains(r, m, 0), "segment %u: the sink head must keep its sink block", seg);
        }
        if (seg >= 2) { /* after two near-zero segments the sink head is Rigid */
            CHECK(got[0] == 32, "segment %u: sink head selected %u tokens, expected 32 (Rigid: base/4)", seg, got[0]);
            CHECK(got[1] >= 128 && got[1] != UINT32_MAX, "segment %u: spread head selected %u tokens, expected >= 128",
                  seg, got[1]);
        }
    }
    tkv_policy_free(p);

    /* faithful: the layer's maximum count for every head (both the same) */
    p = make("entropy:faithful=1,threshold=512,base=128", 0);
    REQUIRE_VOID(p);
    for (uint32_t seg = 1; seg < 3; seg++) {
        struct tkv_policy_view v = {.layer = 1, .n_past = (seg + 1) * 512, .prefill_end = CTX, .q = &q[0][0],
                                    .q_pos = pos, .n_q = 512, .kv = K.view};
        int m0 = p->ops->prefill_select(p->state, &v, 0, r, 1024);
        uint32_t c0 = m0 < 0 ? 0 : covered(r, m0);
        int m1 = p->ops->prefill_select(p->state, &v, 1, r, 1024);
        uint32_t c1 = m1 < 0 ? 0 : covered(r, m1);
        CHECK(c0 == c1 && c0 >= 128, "faithful: heads select %u and %u tokens; expected the same layer maximum", c0, c1);
    }
    tkv_policy_free(p);
}

/* ---- CritiPrefill: the blocks the segment points at ------------------------------------ */

static void test_critiprefill(void)
{
    static struct keys K;
    static float q[512][H * HD];
    static int32_t pos[512];
    float x[HD];
    for (uint32_t p = 0; p < CTX; p++)
        for (uint32_t g = 0; g < HKV; g++) {
            for (uint32_t d = 0; d < HD; d++)
                x[d] = test_rand_f32(&rng, -0.2f, 0.2f);
            /* blocks 3 and 7 (of 32 tokens) hold keys along the queries */
            if (p / 32 == 3 || p / 32 == 7)
                x[5] = 4.0f;
            set_key(&K, g, p, x);
        }
    keys_views(&K, CTX);
    for (uint32_t t = 0; t < 512; t++) {
        pos[t] = (int32_t)(1024 + t);
        for (uint32_t j = 0; j < H * HD; j++)
            q[t][j] = (j % HD == 5) ? 1.0f : test_rand_f32(&rng, -0.05f, 0.05f);
    }
    /* budget 64 tokens = 2 blocks of 32; segment 2 (positions 1024..1535) is sparse */
    struct tkv_policy *p = make("critiprefill:threshold=512,budget=64,fusion=0", 0);
    REQUIRE_VOID(p);
    struct tkv_policy_view v = {.layer = 1, .n_past = 1536, .prefill_end = CTX, .q = &q[0][0], .q_pos = pos,
                                .n_q = 512, .kv = K.view};
    static struct tkv_range r[256];
    for (uint32_t g = 0; g < HKV; g++) {
        int m = p->ops->prefill_select(p->state, &v, g, r, 256);
        CHECK(m == 2 && r[0].begin == 96 && r[0].end == 128 && r[1].begin == 224 && r[1].end == 256,
              "head %u: expected blocks [96,128) and [224,256), got %d ranges starting %u", g, m, m > 0 ? r[0].begin : 0);
    }
    /* dense where the rules say so: layer 0, early segments, the last segment */
    v.layer = 0;
    CHECK(p->ops->prefill_select(p->state, &v, 0, r, 256) == -1, "layer 0 must be dense");
    v.layer = 1;
    v.prefill_end = 1536;
    CHECK(p->ops->prefill_select(p->state, &v, 0, r, 256) == -1, "the last segment must be dense");
    tkv_policy_free(p);
}

/* ---- SnapKV: a needle the window attends to ---------------------------------------------- */

/* n random keys per KV head, the one at `needle` with a large component 2;
 * the 32 observed queries at positions n-32 .. n-1, component 2 of the
 * older 16 `older`, of the newer 16 `newer` (1: towards the needle). */
static void needle_case(struct keys *K, float q[32][H * HD], int32_t pos[32], uint32_t n, uint32_t needle, float older,
                        float newer)
{
    float x[HD];
    for (uint32_t p = 0; p < n; p++)
        for (uint32_t g = 0; g < HKV; g++) {
            for (uint32_t d = 0; d < HD; d++)
                x[d] = test_rand_f32(&rng, -0.5f, 0.5f);
            if (p == needle)
                x[2] = 12.0f;
            set_key(K, g, p, x);
        }
    keys_views(K, n);
    for (uint32_t t = 0; t < 32; t++) {
        pos[t] = (int32_t)(n - 32 + t);
        for (uint32_t j = 0; j < H * HD; j++)
            q[t][j] = (j % HD == 2) ? (t < 16 ? older : newer) : test_rand_f32(&rng, -0.3f, 0.3f);
    }
}

static void test_snapkv_needle(void)
{
    static struct keys K;
    static float q[32][H * HD];
    static int32_t pos[32];
    const uint32_t n = 1500, needle = 700;
    needle_case(&K, q, pos, n, needle, 1.0f, 1.0f);
    const char *specs[] = {"snapkv", "adakv"};
    for (int i = 0; i < 2; i++) {
        struct tkv_policy *p = make(specs[i], 128);
        REQUIRE_VOID(p);
        struct tkv_policy_view v = {.layer = 1, .n_past = n, .n_prompt = n, .q = &q[0][0], .q_pos = pos, .n_q = 32,
                                    .kv = K.view};
        CHECK(p->ops->after_prefill(p->state, &v) == TKV_OK, "%s: %s", specs[i], tkv_last_error());
        static struct tkv_range r[1024];
        v.n_past = n + 5; /* five generated tokens since */
        v.step = 5;
        uint32_t total = 0;
        for (uint32_t g = 0; g < HKV; g++) {
            int m = p->ops->decode_select(p->state, &v, g, r, 1024);
            REQUIRE_VOID(m > 0);
            CHECK(contains(r, m, needle), "%s head %u dropped the needle", specs[i], g);
            CHECK(contains(r, m, n - 1) && contains(r, m, n + 4), "%s head %u: window or new tokens missing", specs[i], g);
            total += covered(r, m);
        }
        CHECK(total == HKV * (128 + 5), "%s: %u tokens kept, expected %u (budget + generated)", specs[i], total,
              HKV * (128 + 5));
        tkv_policy_free(p);
    }
}

/* ---- EntropyInfer's decode window at gap=0 --------------------------------------------------- */

/* The needle is attended only by the oldest 16 of the 32 observed prompt
 * queries (the newest 16 point away from it). Compressing at the first
 * generated token (gap=0), the default variant scores with all 32 prompt
 * queries and keeps it; the faithful one takes window/2 = 16, the newest,
 * and drops it. */
static void test_entropy_window(void)
{
    static struct keys K;
    static float q[32][H * HD];
    static int32_t pos[32];
    const uint32_t n = 1500, needle = 700;
    needle_case(&K, q, pos, n, needle, 1.0f, -1.0f);
    const char *specs[] = {"entropy:gap=0", "entropy:faithful=1,gap=0"};
    for (int i = 0; i < 2; i++) {
        struct tkv_policy *p = make(specs[i], 128);
        REQUIRE_VOID(p);
        struct tkv_policy_view v = {.n_past = n, .n_prompt = n, .q = &q[0][0], .q_pos = pos, .n_q = 32, .kv = K.view};
        for (v.layer = 0; v.layer < env.n_layer; v.layer++)
            CHECK(p->ops->after_prefill(p->state, &v) == TKV_OK, "%s: %s", specs[i], tkv_last_error());
        static struct tkv_range r[1024];
        /* step 1 compresses every layer (and still reads everything), step 2 reads the kept sets */
        for (uint32_t step = 0; step < 2; step++) {
            v.step = step;
            v.n_past = n + 1 + step;
            v.n_q = 1;
            v.q_pos = &pos[31];
            for (v.layer = 0; v.layer < env.n_layer; v.layer++)
                for (uint32_t g = 0; g < HKV; g++) {
                    const int m = p->ops->decode_select(p->state, &v, g, r, 1024);
                    if (step == 0) {
                        CHECK(m < 0, "%s: the compressing step reads everything (got %d ranges)", specs[i], m);
                        continue;
                    }
                    REQUIRE_VOID(m > 0);
                    CHECK(contains(r, m, needle) == (i == 0), "%s layer %u head %u: needle %s", specs[i], v.layer, g,
                          i == 0 ? "dropped" : "kept by the newest 16 queries");
                    CHECK(contains(r, m, n - 1), "%s: recent window missing", specs[i]);
                }
        }
        tkv_policy_free(p);
    }
}

/* ---- AdaKV allocation -------------------------------------------------------------------- */

static void test_adakv_allocation(void)
{
    enum { NH = 4, N = 1000 };
    static float s[NH][N];
    const float *rows[NH];
    for (int g = 0; g < NH; g++) {
        for (int j = 0; j < N; j++) /* head 0 has the strongest scores */
            s[g][j] = test_rand_f32(&rng, 0, 1) * (g == 0 ? 10.0f : 1.0f);
        rows[g] = s[g];
    }
    uint32_t cap[NH];
    const uint32_t per_head = 96;
    tkv_adakv_allocate(rows, NH, N, per_head, 0.2f, cap);
    uint32_t sum = 0;
    for (int g = 0; g < NH; g++) {
        sum += cap[g];
        CHECK(cap[g] >= (uint32_t)(0.2f * per_head) - 1, "head %d got %u, below the floor", g, cap[g]);
    }
    CHECK(sum == NH * per_head, "AdaKV budgets sum to %u, expected %u", sum, NH * per_head);
    CHECK(cap[0] > cap[1] && cap[0] > cap[2] && cap[0] > cap[3], "the strongest head should get the most: %u %u %u %u",
          cap[0], cap[1], cap[2], cap[3]);
}

/* ---- streaming, parsing --------------------------------------------------------------------- */

static void test_streaming_and_specs(void)
{
    struct tkv_policy *p = make("streaming:sink=4", 100);
    REQUIRE_VOID(p);
    struct tkv_range r[8];
    struct tkv_policy_view v = {.layer = 0, .n_past = 500};
    int m = p->ops->decode_select(p->state, &v, 0, r, 8);
    CHECK(m == 2 && r[0].begin == 0 && r[0].end == 4 && r[1].begin == 404 && r[1].end == 500,
          "streaming: got %d ranges", m);
    v.n_past = 80;
    CHECK(p->ops->decode_select(p->state, &v, 0, r, 8) == -1, "streaming below the budget keeps everything");
    tkv_policy_free(p);

    struct tkv_policy *bad = NULL;
    struct {
        const char *spec, *needle;
    } cases[] = {{"nonsense", "unknown policy 'nonsense'"}, {"snapkv:windo=8", "unknown parameter 'windo'"},
                 {"snapkv:window=x", "window=x"},          {"full:a=1", "unknown parameter 'a'"},
                 {"snapkv:pool=median", "pool=median"},    {"streaming:sink=5000", "budget"},
                 {"entropy:block=7", "block"},             {"critiprefill:", "bad spec"}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        tkv_status st = tkv_policy_create(cases[i].spec, &env, &bad);
        CHECK(st == TKV_ERR_INVALID_ARG && !bad && strstr(tkv_last_error(), cases[i].needle),
              "spec '%s': got %s: %s", cases[i].spec, tkv_status_str(st), tkv_last_error());
    }
    CHECK(strstr(tkv_policy_names(), "entropy") && strstr(tkv_policy_names(), "adakv"), "registry: %s",
          tkv_policy_names());
}

/* ---- top-k: quickselect vs the sort ------------------------------------------------------ */

static void test_top_k(void)
{
    enum { N = 5000 };
    static float x[N];
    static uint32_t a[N], b[N];
    uint32_t cases = 0, differ = 0;
    for (uint32_t round = 0; round < 200; round++) {
        const uint32_t n = 1 + (uint32_t)(test_rand_u64(&rng) % N);
        /* 0: distinct values, 1: few levels (ties), 2: constant, 3: sorted ramps */
        const uint32_t kind = round % 4, levels = 1 + (uint32_t)(test_rand_u64(&rng) % 7);
        for (uint32_t i = 0; i < n; i++) {
            const float u = test_rand_f32(&rng, 0.0f, 1.0f);
            x[i] = kind == 0 ? u : kind == 1 ? (float)(uint32_t)(u * (float)levels) : kind == 2 ? 0.25f
                                                                                      : (float)(i % 97);
        }
        if (round % 10 == 9)
            x[test_rand_u64(&rng) % n] = NAN; /* counts as -inf in both */
        const uint32_t ks[] = {0, 1, n / 2, n - 1, n, n + 3, (uint32_t)(test_rand_u64(&rng) % (n + 1))};
        for (size_t j = 0; j < sizeof ks / sizeof *ks; j++) {
            const uint32_t ma = tkv_policy_top_k(x, n, ks[j], a), mb = tkv_policy_top_k_ref(x, n, ks[j], b);
            cases++;
            differ += ma != mb || ma != TKV_MIN(ks[j], n) || memcmp(a, b, ma * sizeof *a) != 0;
        }
    }
    CHECK(differ == 0, "top-k: %u of %u cases differ from the sort", differ, cases);
    printf("top-k: %u cases (distinct, tied, constant, ramps, NaN) equal the sort\n", cases);
}

int main(void)
{
    rng = test_seed();
    test_entropy_classes();
    test_critiprefill();
    test_snapkv_needle();
    test_entropy_window();
    test_adakv_allocation();
    test_streaming_and_specs();
    test_top_k();
    return test_done();
}
