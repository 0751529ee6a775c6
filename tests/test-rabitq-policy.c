/*
 * test-rabitq-policy.c -- the `rabitq` and `entropy+rabitq` policies.
 *
 * On synthetic keys (the hooks called directly, as the engine does):
 *   - safe top-p keeps >= p of every query head's true attention mass,
 *     computed exactly over all keys; plain top-p keeps fewer keys;
 *   - sinks, the recent window and the tail not yet encoded are always
 *     selected; decode_needs_keys asks for the keys exactly when a batch is
 *     pending, and the batch then joins the index;
 *   - whole=1 widens the selection to whole KV blocks; p=1 selects all;
 *   - a head whose selection kept more than `wide` of its keys reads
 *     everything for the next `hold` steps, then selects again; asked again
 *     within a step, it answers the same;
 *   - entropy+rabitq reads Dynamic heads whole and selects Rigid ones;
 *   - bad parameters are refused with a message naming them.
 * On the tiny random model (tests/tiny-model.h), through the engine:
 *   - rabitq:p=1 generates exactly what `full` does (same tokens, logits
 *     bit for bit: the selection is every key, in the same blocks);
 *   - at p=0.9 the selection is the same whether the policy answers before
 *     the KV is brought in (no keys) or with them (mass measurement on), and
 *     the measured mass kept is >= p;
 *   - the CPU backend's layer selection on 3 threads (index twins,
 *     rabitq_select) gives the per-head path's logits bit for bit.
 */
#include "runtime/policy/policy.h"
#include "tierkv.h"
#include "tiny-model.h"

#include <unistd.h>

enum { S_HD = 64, S_HKV = 2, S_H = 4, S_G = S_H / S_HKV, S_B = 64, S_CTX = 2048 };

static const struct tkv_policy_env s_env = {.n_layer = 2, .n_head = S_H, .n_head_kv = S_HKV, .head_dim = S_HD,
                                            .n_ctx = S_CTX, .block_tokens = S_B, .budget = 0};

/* Keys of both KV heads for positions [0, S_CTX), in blocks of S_B. */
struct keys {
    uint16_t k[S_HKV][S_CTX][S_HD], v[S_HKV][S_CTX][S_HD];
    struct tkv_kv_block_ref refs[S_HKV][S_CTX / S_B];
    struct tkv_kv_head_view view[S_HKV];
};

static void keys_views(struct keys *K, uint32_t n)
{
    for (uint32_t g = 0; g < S_HKV; g++) {
        const uint32_t nb = (n + S_B - 1) / S_B;
        for (uint32_t b = 0; b < nb; b++)
            K->refs[g][b] = (struct tkv_kv_block_ref){.k = &K->k[g][b * S_B][0], .v = &K->v[g][b * S_B][0],
                                                      .pos0 = (int32_t)(b * S_B), .n = TKV_MIN(S_B, n - b * S_B)};
        K->view[g] = (struct tkv_kv_head_view){.blocks = K->refs[g], .n_blocks = nb};
    }
}

static float gauss(void)
{
    const float u = test_rand_f32(&rng, 1e-7f, 1.0f), w = test_rand_f32(&rng, 0.0f, 6.2831853f);
    return sqrtf(-2.0f * logf(u)) * cosf(w);
}

static struct tkv_policy *make_in(const char *spec, const struct tkv_policy_env *env)
{
    struct tkv_policy *p = NULL;
    tkv_status st = tkv_policy_create(spec, env, &p);
    CHECK(st == TKV_OK, "create %s: %s", spec, tkv_last_error());
    return p;
}

static struct tkv_policy *make(const char *spec) { return make_in(spec, &s_env); }

static bool contains(const struct tkv_range *r, int n, uint32_t pos)
{
    for (int i = 0; i < n; i++)
        if (pos >= r[i].begin && pos < r[i].end)
            return true;
    return false;
}

static uint32_t covered(const struct tkv_range *r, int n)
{
    uint32_t c = 0;
    for (int i = 0; i < n; i++)
        c += r[i].end - r[i].begin;
    return c;
}

static bool ascending(const struct tkv_range *r, int n, uint32_t n_past)
{
    for (int i = 0; i < n; i++)
        if (r[i].begin >= r[i].end || r[i].end > n_past || (i && r[i].begin <= r[i - 1].end))
            return false;
    return true;
}

/* The share of query q's attention (softmax of q.k / sqrt(d) over keys
 * [0, n) of head g) that falls on the ranges. */
static double true_mass(const struct keys *K, uint32_t g, const float *q, uint32_t n, const struct tkv_range *r,
                        int m)
{
    static double s[S_CTX];
    double mx = -INFINITY;
    for (uint32_t j = 0; j < n; j++) {
        double d = 0;
        for (uint32_t c = 0; c < S_HD; c++)
            d += (double)q[c] * tkv_fp16_to_fp32(K->k[g][j][c]);
        s[j] = d / sqrt((double)S_HD);
        mx = fmax(mx, s[j]);
    }
    double all = 0, kept = 0;
    for (uint32_t j = 0; j < n; j++)
        all += exp(s[j] - mx);
    for (int i = 0; i < m; i++)
        for (uint32_t j = r[i].begin; j < r[i].end; j++)
            kept += exp(s[j] - mx);
    return kept / all;
}

/* Keys around a per-head mean with anisotropic spread, and a few needles
 * along the direction the decode queries take; the window queries of the
 * prefill look the same way. */
static struct keys K;
static float dir[S_HKV][S_HD];
static float window_q[32][S_H * S_HD];
static int32_t window_pos[32];

static void make_keys(uint32_t n_prompt)
{
    for (uint32_t g = 0; g < S_HKV; g++) {
        float mean[S_HD], sd[S_HD];
        for (uint32_t c = 0; c < S_HD; c++) {
            dir[g][c] = gauss();
            mean[c] = 0.5f * gauss();
            sd[c] = test_rand_f32(&rng, 0.3f, 1.5f);
        }
        for (uint32_t j = 0; j < S_CTX; j++) {
            const bool needle = j % 97 == 13 && j > 64;
            for (uint32_t c = 0; c < S_HD; c++)
                K.k[g][j][c] = tkv_fp32_to_fp16(mean[c] + sd[c] * gauss() + (needle ? 0.6f * dir[g][c] : 0.0f));
        }
    }
    for (uint32_t t = 0; t < 32; t++) {
        window_pos[t] = (int32_t)(n_prompt - 32 + t);
        for (uint32_t h = 0; h < S_H; h++)
            for (uint32_t c = 0; c < S_HD; c++)
                window_q[t][h * S_HD + c] = 2.0f * dir[h / S_G][c] + gauss();
    }
}

static void decode_query(float *q)
{
    for (uint32_t h = 0; h < S_H; h++)
        for (uint32_t c = 0; c < S_HD; c++)
            q[h * S_HD + c] = test_rand_f32(&rng, 1.0f, 3.0f) * dir[h / S_G][c] + gauss();
}

static tkv_status prefill_done(struct tkv_policy *p, uint32_t n_prompt)
{
    keys_views(&K, n_prompt);
    for (uint32_t l = 0; l < s_env.n_layer; l++) {
        struct tkv_policy_view v = {.layer = l, .n_past = n_prompt, .n_prompt = n_prompt, .q = &window_q[0][0],
                                    .q_pos = window_pos, .n_q = 32, .kv = K.view};
        TKV_TRY(p->ops->after_prefill(p->state, &v));
    }
    return TKV_OK;
}

/* ---- safe top-p keeps >= p of the true mass, per query head ----------------------------- */

static void test_safe_mass(void)
{
    const uint32_t n_prompt = 1500;
    make_keys(n_prompt);
    static struct tkv_range r[S_CTX];
    const float ps[] = {0.5f, 0.9f, 0.95f};
    for (int pi = 0; pi < 3; pi++) {
        char spec[128], plain_spec[128];
        snprintf(spec, sizeof spec, "rabitq:p=%g,dense=0,sink=16,recent=16", (double)ps[pi]);
        snprintf(plain_spec, sizeof plain_spec, "rabitq:p=%g,dense=0,sink=16,recent=16,safe=0", (double)ps[pi]);
        struct tkv_policy *safe = make(spec), *plain = make(plain_spec);
        REQUIRE_VOID(safe && plain);
        CHECK(prefill_done(safe, n_prompt) == TKV_OK && prefill_done(plain, n_prompt) == TKV_OK, "after_prefill: %s",
              tkv_last_error());
        double worst = 1, plain_worst = 1;
        uint64_t kept_safe = 0, kept_plain = 0;
        for (uint32_t trial = 0; trial < 30; trial++) {
            float q[S_H * S_HD];
            int32_t qpos = (int32_t)n_prompt;
            decode_query(q);
            struct tkv_policy_view v = {.layer = trial % 2, .n_past = n_prompt + 1, .n_prompt = n_prompt,
                                        .step = 0, .q = q, .q_pos = &qpos, .n_q = 1, .kv = NULL};
            for (uint32_t g = 0; g < S_HKV; g++) {
                CHECK(!safe->ops->decode_needs_keys(safe->state, &v), "no batch is pending");
                int m = safe->ops->decode_select(safe->state, &v, g, r, S_CTX);
                REQUIRE_VOID(m > 0 && ascending(r, m, v.n_past));
                CHECK(contains(r, m, 0) && contains(r, m, 15) && contains(r, m, n_prompt - 15) &&
                          contains(r, m, n_prompt),
                      "sinks, recent window and this step's token must be selected");
                kept_safe += covered(r, m);
                /* every query head of the group keeps >= p of its softmax over all the
                 * keys, this step's own included */
                for (uint32_t hh = 0; hh < S_G; hh++)
                    worst = fmin(worst, true_mass(&K, g, q + (g * S_G + hh) * S_HD, v.n_past, r, m));
                m = plain->ops->decode_select(plain->state, &v, g, r, S_CTX);
                REQUIRE_VOID(m > 0 && ascending(r, m, v.n_past));
                kept_plain += covered(r, m);
                for (uint32_t hh = 0; hh < S_G; hh++)
                    plain_worst = fmin(plain_worst, true_mass(&K, g, q + (g * S_G + hh) * S_HD, v.n_past, r, m));
            }
        }
        CHECK(worst >= ps[pi] - 1e-6, "p=%g: safe top-p kept only %.4f of a query head's mass", (double)ps[pi], worst);
        CHECK(kept_plain < kept_safe, "p=%g: plain top-p should keep fewer keys (%llu) than safe (%llu)",
              (double)ps[pi], (unsigned long long)kept_plain, (unsigned long long)kept_safe);
        fprintf(stderr, "p=%.2f: safe keeps %.1f%% of the keys (worst mass %.4f), plain %.1f%% (worst %.4f)\n",
                (double)ps[pi], 100.0 * kept_safe / (60.0 * (n_prompt + 1)), worst,
                100.0 * kept_plain / (60.0 * (n_prompt + 1)), plain_worst);
        CHECK(safe->ops->memory_bytes(safe->state) > (size_t)2 * 2 * n_prompt * 22, "index memory is accounted");
        tkv_policy_free(safe);
        tkv_policy_free(plain);
    }
}

/* ---- lazy encoding, the tail, whole blocks, p = 1 ------------------------------------ */

static void test_lazy_tail(void)
{
    const uint32_t n_prompt = 1000, batch = 48;
    make_keys(n_prompt);
    /* (hold=0: every step selects, so that each shows its tail; test_hold has the holds) */
    struct tkv_policy *p = make("rabitq:dense=1,batch=48,sink=8,recent=8,hold=0");
    REQUIRE_VOID(p);
    REQUIRE_VOID(prefill_done(p, n_prompt) == TKV_OK);
    static struct tkv_range r[S_CTX];
    uint32_t n_enc = n_prompt, encodes = 0;
    for (uint32_t step = 0; step < 150; step++) {
        const uint32_t n_past = n_prompt + step + 1; /* this step's token at n_past - 1 */
        float q[S_H * S_HD];
        int32_t qpos = (int32_t)(n_past - 1);
        decode_query(q);
        keys_views(&K, n_past);
        struct tkv_policy_view v = {.layer = 1, .n_past = n_past, .n_prompt = n_prompt, .step = step, .q = q,
                                    .q_pos = &qpos, .n_q = 1, .kv = NULL};
        const bool needs = p->ops->decode_needs_keys(p->state, &v);
        CHECK(needs == (n_past - 1 - n_enc >= batch), "step %u: needs_keys %d with %u keys pending", step, needs,
              n_past - 1 - n_enc);
        if (needs) { /* the engine brings the layer in and shows the keys */
            v.kv = K.view;
            n_enc = n_past - 1;
            encodes++;
        }
        for (uint32_t g = 0; g < S_HKV; g++) {
            int m = p->ops->decode_select(p->state, &v, g, r, S_CTX);
            REQUIRE_VOID(m > 0 && ascending(r, m, n_past));
            CHECK(r[m - 1].end == n_past && covered(r, m) >= n_past - n_enc,
                  "step %u head %u: the tail [%u, %u) must be read", step, g, n_enc, n_past);
            for (uint32_t j = n_enc; j < n_past; j++)
                CHECK(contains(r, m, j), "step %u: tail position %u missing", step, j);
            CHECK(contains(r, m, 0) && contains(r, m, 7) && contains(r, m, n_past - 8), "sinks / recent missing");
        }
        v.kv = NULL;
        CHECK(!p->ops->decode_needs_keys(p->state, &v), "step %u: the batch was not encoded", step);
        /* layer 0 is below dense=1: read whole, never asks for keys */
        v.layer = 0;
        CHECK(p->ops->decode_select(p->state, &v, 0, r, S_CTX) == -1 && !p->ops->decode_needs_keys(p->state, &v),
              "layer 0 must be dense");
    }
    CHECK(encodes == 3, "150 steps in batches of 48: %u encodes, expected 3", encodes);
    p->ops->reset(p->state);
    struct tkv_policy_view v = {.layer = 1, .n_past = n_prompt + 1, .q = &window_q[0][0], .n_q = 1};
    CHECK(p->ops->decode_select(p->state, &v, 0, r, S_CTX) == -1, "after a reset, no index: read everything");
    tkv_policy_free(p);

    /* whole=1: the blocks whole=0 touches, each read whole; whole=16: the
     * aligned 16-position groups it touches; p=1: everything */
    const char *specs[] = {"rabitq:dense=0,safe=0", "rabitq:dense=0,safe=0,whole=1", "rabitq:dense=0,safe=0,whole=16",
                           "rabitq:dense=0,p=1", "rabitq:dense=0,p=1,safe=0"};
    float q[S_H * S_HD];
    int32_t qpos = (int32_t)n_prompt;
    decode_query(q);
    static uint8_t touched[S_CTX / S_B], touched16[S_CTX / 16];
    for (int i = 0; i < 5; i++) {
        p = make(specs[i]);
        REQUIRE_VOID(p);
        REQUIRE_VOID(prefill_done(p, n_prompt) == TKV_OK);
        v = (struct tkv_policy_view){.layer = 1, .n_past = n_prompt + 1, .q = q, .q_pos = &qpos, .n_q = 1};
        int m = p->ops->decode_select(p->state, &v, 1, r, S_CTX);
        REQUIRE_VOID(m > 0 && ascending(r, m, v.n_past));
        if (i == 0) {
            memset(touched, 0, sizeof touched);
            memset(touched16, 0, sizeof touched16);
            uint32_t n_read = 0;
            for (int j = 0; j < m; j++)
                for (uint32_t x = r[j].begin; x < r[j].end; x++)
                    touched[x / S_B] = touched16[x / 16] = 1, n_read++;
            CHECK(n_read < v.n_past, "whole=0 must leave some keys out for the whole= cases to mean anything");
        } else if (i == 1 || i == 2) {
            bool same = true;
            for (uint32_t x = 0; x < v.n_past; x++)
                same &= contains(r, m, x) == ((i == 1 ? touched[x / S_B] : touched16[x / 16]) != 0);
            CHECK(same, "%s must read exactly the %s whole=0 touches, each whole", specs[i],
                  i == 1 ? "blocks" : "16-position groups");
        } else {
            CHECK(m == 1 && r[0].begin == 0 && r[0].end == v.n_past, "%s: everything expected, got %d ranges",
                  specs[i], m);
        }
        tkv_policy_free(p);
    }
}

/* ---- holds: a head that keeps most of its keys reads everything for a while --------------- */

/* What head g of layer 1 reads at decode step `step` (the same query at
 * every step): -1 everything, else the share of the n_past keys its ranges
 * cover (> 0). */
static double read_at(struct tkv_policy *p, uint32_t n_prompt, uint32_t step, uint32_t g, const float *q)
{
    static struct tkv_range r[S_CTX];
    int32_t qpos = (int32_t)(n_prompt + step);
    const struct tkv_policy_view v = {.layer = 1, .n_past = n_prompt + step + 1, .n_prompt = n_prompt, .step = step,
                                      .q = q, .q_pos = &qpos, .n_q = 1, .kv = NULL};
    CHECK(!p->ops->decode_needs_keys(p->state, &v), "step %u: no batch is pending (batch=1000)", step);
    const int m = p->ops->decode_select(p->state, &v, g, r, S_CTX);
    if (m < 0)
        return -1;
    CHECK(m > 0 && ascending(r, m, v.n_past), "step %u head %u: %d ranges, not ascending", step, g, m);
    return (double)covered(r, m) / v.n_past;
}

static void test_hold(void)
{
    const uint32_t n_prompt = 1200;
    make_keys(n_prompt);
    float q[S_H * S_HD];
    decode_query(q);
    /* p = 1 keeps every key: each head holds for the 3 steps after each of
     * its selections (head 1 asked first at every step: a count per head) */
    struct tkv_policy *p = make("rabitq:p=1,dense=0,batch=1000,hold=3");
    REQUIRE_VOID(p && prefill_done(p, n_prompt) == TKV_OK);
    for (uint32_t step = 0; step < 10; step++) {
        const bool selects = step % 4 == 0; /* 0 selects, 1-3 hold, 4 selects, ... */
        for (uint32_t g = S_HKV; g-- > 0;) {
            const double x = read_at(p, n_prompt, step, g, q);
            CHECK(selects ? x >= 1.0 : x == -1, "p=1, hold=3: step %u head %u read %g (%s expected)", step, g, x,
                  selects ? "a selection of everything" : "-1, a hold");
            CHECK(read_at(p, n_prompt, step, g, q) == x, "step %u head %u: asked again, another answer", step, g);
        }
    }
    tkv_policy_free(p);
    /* where the KV is paged, holds are off unless hold is given (a held
     * head read whole would recall all of it) */
    struct tkv_policy_env paged = s_env;
    paged.kv_paged = true;
    const char *paged_specs[] = {"rabitq:p=1,dense=0,batch=1000", "rabitq:p=1,dense=0,batch=1000,hold=3"};
    for (int i = 0; i < 2; i++) {
        p = make_in(paged_specs[i], &paged);
        REQUIRE_VOID(p && prefill_done(p, n_prompt) == TKV_OK);
        for (uint32_t step = 0; step < 4; step++) {
            const double x = read_at(p, n_prompt, step, 0, q);
            CHECK(i == 0 || step == 0 ? x >= 1.0 : x == -1, "KV paged, %s: step %u read %g", paged_specs[i], step,
                  x);
        }
        tkv_policy_free(p);
    }
    /* hold=0, or wide=1 (no selection keeps more than all): no holds */
    const char *never[] = {"rabitq:p=1,dense=0,batch=1000,hold=0", "rabitq:p=1,dense=0,batch=1000,wide=1"};
    for (int i = 0; i < 2; i++) {
        p = make(never[i]);
        REQUIRE_VOID(p && prefill_done(p, n_prompt) == TKV_OK);
        for (uint32_t step = 0; step < 4; step++)
            CHECK(read_at(p, n_prompt, step, 0, q) >= 1.0, "%s: step %u did not select", never[i], step);
        tkv_policy_free(p);
    }
    /* plain top-p keeps a few keys: it selects at every step (a share of
     * the keys, which moves a little with the recent window and the tail);
     * wide= just below what it keeps at step 0 makes it hold, just above
     * does not */
    p = make("rabitq:p=0.9,safe=0,dense=0,batch=1000");
    REQUIRE_VOID(p && prefill_done(p, n_prompt) == TKV_OK);
    const double share = read_at(p, n_prompt, 0, 0, q);
    CHECK(share > 0 && share < 0.75, "plain top-p read %g of the keys", share);
    for (uint32_t step = 1; step < 4; step++) {
        const double x = read_at(p, n_prompt, step, 0, q);
        CHECK(x > 0 && x < 0.75, "plain top-p, step %u read %g", step, x);
    }
    tkv_policy_free(p);
    /* the share over the indexed keys, n_prompt of them (the tail is not in it) */
    const double kept = share * (n_prompt + 1) - 1;
    for (int above = 0; above <= 1; above++) {
        char spec[96];
        snprintf(spec, sizeof spec, "rabitq:p=0.9,safe=0,dense=0,batch=1000,wide=%.6f",
                 kept / n_prompt + (above ? 1e-4 : -1e-4));
        p = make(spec);
        REQUIRE_VOID(p && prefill_done(p, n_prompt) == TKV_OK);
        CHECK(read_at(p, n_prompt, 0, 0, q) == share, "%s: step 0 selected otherwise", spec);
        const double x = read_at(p, n_prompt, 1, 0, q);
        CHECK(above ? x > 0 && x < 0.75 : x == -1, "%s: step 1 read %g", spec, x);
        /* a new prefill forgets the holds */
        REQUIRE_VOID(prefill_done(p, n_prompt) == TKV_OK);
        CHECK(read_at(p, n_prompt, 1, 0, q) > 0, "%s: after a new prefill, step 1 held", spec);
        tkv_policy_free(p);
    }
}

/* ---- entropy+rabitq: Dynamic heads whole, Rigid heads by top-p -------------------------- */

static void test_composition(void)
{
    static float q[512][S_H * S_HD];
    static int32_t pos[512];
    float d0[S_HD];
    for (uint32_t c = 0; c < S_HD; c++)
        d0[c] = c < 4 ? 3.0f : 0.0f;
    /* head 0: a sink (block 0 takes all the mass) -> Rigid; head 1: spread -> Dynamic */
    for (uint32_t j = 0; j < S_CTX; j++)
        for (uint32_t c = 0; c < S_HD; c++) {
            K.k[0][j][c] = tkv_fp32_to_fp16(j < 8 ? 8.0f * d0[c] : (c < 4 ? 0.0f : test_rand_f32(&rng, -0.5f, 0.5f)));
            K.k[1][j][c] = tkv_fp32_to_fp16(test_rand_f32(&rng, -0.3f, 0.3f));
        }
    keys_views(&K, S_CTX);
    struct tkv_policy *p = make("entropy+rabitq:threshold=512,base=128,block=8,segment=512,dense=1,sink=4,recent=4");
    REQUIRE_VOID(p);
    CHECK(p->ops->changes_prefill && p->ops->segment(p->state) == 512, "the prefill is entropy's");
    static struct tkv_range r[S_CTX];
    for (uint32_t seg = 1; seg < 4; seg++) {
        for (uint32_t t = 0; t < 512; t++) {
            pos[t] = (int32_t)(seg * 512 + t);
            for (uint32_t h = 0; h < S_H; h++)
                for (uint32_t c = 0; c < S_HD; c++)
                    q[t][h * S_HD + c] = d0[c] + test_rand_f32(&rng, -0.1f, 0.1f);
        }
        struct tkv_policy_view v = {.layer = 1, .n_past = (seg + 1) * 512, .prefill_end = 2 * S_CTX, .q = &q[0][0],
                                    .q_pos = pos, .n_q = 512, .kv = K.view};
        for (uint32_t g = 0; g < S_HKV; g++)
            p->ops->prefill_select(p->state, &v, g, r, S_CTX);
    }
    struct tkv_policy_view v = {.layer = 1, .n_past = S_CTX, .n_prompt = S_CTX, .q = &q[480][0], .q_pos = pos + 480,
                                .n_q = 32, .kv = K.view};
    REQUIRE_VOID(p->ops->after_prefill(p->state, &v) == TKV_OK);
    v.layer = 0;
    REQUIRE_VOID(p->ops->after_prefill(p->state, &v) == TKV_OK);
    float dq[S_H * S_HD];
    for (uint32_t j = 0; j < S_H * S_HD; j++)
        dq[j] = d0[j % S_HD];
    int32_t qpos = S_CTX - 1;
    v = (struct tkv_policy_view){.layer = 1, .n_past = S_CTX, .n_prompt = S_CTX - 1, .q = dq, .q_pos = &qpos, .n_q = 1};
    int m0 = p->ops->decode_select(p->state, &v, 0, r, S_CTX);
    CHECK(m0 > 0 && contains(r, m0, 0) && covered(r, m0) < S_CTX / 2,
          "the Rigid head is selected by top-p: %d ranges, %u keys", m0, m0 > 0 ? covered(r, m0) : 0);
    CHECK(p->ops->decode_select(p->state, &v, 1, r, S_CTX) == -1, "the Dynamic head is read whole");
    v.layer = 0;
    CHECK(p->ops->decode_select(p->state, &v, 0, r, S_CTX) == -1, "layers below dense are read whole");
    CHECK(p->ops->memory_bytes(p->state) > 0, "memory accounted");
    tkv_policy_free(p);
}

/* ---- parameters ------------------------------------------------------------------------ */

static void test_specs(void)
{
    struct {
        const char *spec, *needle;
    } cases[] = {{"rabitq:p=0", "p=0 must be in (0, 1]"},
                 {"rabitq:p=1.5", "p=1.5 must be in (0, 1]"},
                 {"rabitq:p=-0.1", "must be in (0, 1]"},
                 {"rabitq:p=abc", "p=abc is not a number"},
                 {"rabitq:eps=0", "eps=0 must be > 0"},
                 {"rabitq:eps=-2", "eps=-2 must be > 0"},
                 {"rabitq:safe=2", "safe is 0 or 1"},
                 {"rabitq:whole=70000", "whole=70000"},
                 {"rabitq:exact=2", "exact is 0 or 1"},
                 {"rabitq:batch=0", "batch=0"},
                 {"rabitq:wide=0", "wide=0 must be in (0, 1]"},
                 {"rabitq:wide=1.5", "wide=1.5 must be in (0, 1]"},
                 {"rabitq:hold=-1", "hold=-1 is not a non-negative integer"},
                 {"rabitq:sink=-1", "sink=-1 is not a non-negative integer"},
                 {"rabitq:foo=1", "policy 'rabitq': unknown parameter 'foo'"},
                 {"entropy+rabitq:foo=1", "policy 'entropy+rabitq': unknown parameter 'foo'"},
                 {"entropy+rabitq:keep=64", "'keep' is an entropy decode parameter"},
                 {"entropy+rabitq:p=2", "p=2 must be in (0, 1]"},
                 {"entropy+rabitq:block=7", "block"},
                 {"rabitq+entropy", "unknown policy 'rabitq+entropy'"}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct tkv_policy *bad = NULL;
        tkv_status st = tkv_policy_create(cases[i].spec, &s_env, &bad);
        CHECK(st == TKV_ERR_INVALID_ARG && !bad && strstr(tkv_last_error(), cases[i].needle), "spec '%s': got %s: %s",
              cases[i].spec, tkv_status_str(st), tkv_last_error());
    }
    const char *good[] = {"rabitq", "rabitq:p=0.95",
                          "rabitq:p=1,safe=0,eps=1.5,sink=0,recent=0,batch=1,dense=0,whole=1",
                          "rabitq:hold=0", "rabitq:hold=100,wide=1",
                          "entropy+rabitq", "entropy+rabitq:p=0.9,safe=1,eps=3,segment=256,block=8"};
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        struct tkv_policy *p = make(good[i]);
        tkv_policy_free(p);
    }
    CHECK(strstr(tkv_policy_names(), "rabitq") && strstr(tkv_policy_names(), "entropy+rabitq"), "registry: %s",
          tkv_policy_names());
}

/* ---- through the engine, on the tiny model ----------------------------------------------- */

static tkv_session *open_session_t(tkv_model *m, const char *policy, unsigned flags, uint32_t n_threads)
{
    struct tkv_session_params sp = tkv_session_default_params();
    sp.n_threads = n_threads;
    sp.n_ctx = CTX;
    sp.kv_block = 8;
    sp.policy = policy;
    sp.flags = flags;
    tkv_session *s = NULL;
    tkv_status st = tkv_session_init(m, &sp, &s);
    CHECK(st == TKV_OK, "session %s: %s", policy, tkv_last_error());
    return s;
}

static tkv_session *open_session(tkv_model *m, const char *policy, unsigned flags)
{
    return open_session_t(m, policy, flags, 1);
}

static size_t policy_bytes(tkv_session *s)
{
    char json[4096];
    size_t len;
    const char *at = tkv_session_stats_json(s, json, sizeof json, &len) == TKV_OK ? strstr(json, "\"policy_bytes\": ") : NULL;
    return at ? (size_t)strtoull(at + strlen("\"policy_bytes\": "), NULL, 10) : 0;
}

/* Greedy generation of n tokens after prompt; tokens and every step's logits out. */
static void generate(tkv_session *s, const tkv_token *prompt, uint32_t n_prompt, uint32_t n, tkv_token *toks,
                     float *logits)
{
    tkv_status st = tkv_prefill(s, prompt, n_prompt);
    CHECK(st == TKV_OK, "prefill: %s", tkv_last_error());
    for (uint32_t i = 0; i < n && st == TKV_OK; i++) {
        memcpy(logits + (size_t)i * V, tkv_logits(s), V * sizeof(float));
        toks[i] = tkv_argmax(tkv_logits(s), V);
        if (toks[i] == 0) /* keep the tiny vocabulary's end token out of the context */
            toks[i] = 1;
        st = tkv_decode(s, toks[i]);
        CHECK(st == TKV_OK, "decode %u: %s", i, tkv_last_error());
    }
}

static void test_engine(void)
{
    tkv_model *m = tiny_model_load(TKV_TYPE_F32);
    REQUIRE_VOID(m != NULL);
    enum { NP = 60, NG = 60 };
    tkv_token prompt[NP];
    for (int i = 0; i < NP; i++)
        prompt[i] = (tkv_token)(1 + test_rand_u64(&rng) % (V - 2));
    static tkv_token t_full[NG], t_rq[NG];
    static float l_full[NG * V], l_rq[NG * V], l_plan[NG * V];

    /* p = 1: the same tokens and logits as full, through 7 lazy batch encodes */
    tkv_session *a = open_session(m, "full", 0), *b = open_session(m, "rabitq:p=1,dense=0,sink=2,recent=2,batch=8", 0);
    REQUIRE_VOID(a && b);
    generate(a, prompt, NP, NG, t_full, l_full);
    generate(b, prompt, NP, NG, t_rq, l_rq);
    CHECK(!memcmp(t_full, t_rq, sizeof t_full), "rabitq:p=1 generated other tokens than full");
    CHECK(!memcmp(l_full, l_rq, sizeof l_full), "rabitq:p=1 logits differ from full's");
    double tok, blk;
    tkv_session_kv_read(b, &tok, &blk);
    CHECK(tok == 1.0 && blk == 1.0, "p=1 reads everything: %g %g", tok, blk);
    char json[4096];
    size_t len;
    CHECK(tkv_session_stats_json(b, json, sizeof json, &len) == TKV_OK && strstr(json, "\"selection\": {") &&
              !strstr(json, "\"policy_bytes\": 0}"),
          "stats: %s", json);
    tkv_session_free(a);
    tkv_session_free(b);

    /* p = 0.9: planned (no keys) and measured (keys shown) select alike;
     * the measured mass is >= p */
    const char *spec = "rabitq:p=0.9,dense=0,sink=2,recent=2,batch=8";
    a = open_session(m, spec, 0);
    b = open_session(m, spec, TKV_SESSION_MEASURE_MASS);
    REQUIRE_VOID(a && b);
    generate(a, prompt, NP, NG, t_full, l_plan);
    generate(b, prompt, NP, NG, t_rq, l_rq);
    CHECK(!memcmp(l_plan, l_rq, sizeof l_rq), "the selection must not depend on whether keys were shown");
    const double mass = tkv_session_mass_kept(b);
    tkv_session_kv_read(b, &tok, &blk);
    fprintf(stderr, "tiny model, rabitq:p=0.9: mass kept %.4f, tokens read %.3f, blocks %.3f\n", mass, tok, blk);
    CHECK(mass >= 0.9, "safe top-p at p=0.9 kept %.4f of the mass", mass);
    CHECK(tok < 1.0 && blk <= 1.0, "reads: tokens %g, blocks %g", tok, blk);
    tkv_session_free(a);
    tkv_session_free(b);

    /* the CPU backend selects a layer in one call on its threads (the
     * indexes as its twins, rabitq_select); with TKV_RABITQ_DEVICE_TOPP=0
     * a head at a time on the calling thread from host indexes: the same
     * selections, so the same logits bit for bit (both sessions on 3
     * threads: the other ops split their work by the thread count) and
     * other memory (the twins and the layer's bitmaps) */
    setenv("TKV_RABITQ_DEVICE_TOPP", "0", 1);
    a = open_session_t(m, spec, 0, 3);
    REQUIRE_VOID(a);
    generate(a, prompt, NP, NG, t_full, l_plan);
    unsetenv("TKV_RABITQ_DEVICE_TOPP");
    b = open_session_t(m, spec, 0, 3);
    REQUIRE_VOID(b);
    generate(b, prompt, NP, NG, t_rq, l_rq);
    CHECK(!memcmp(l_plan, l_rq, sizeof l_rq), "the CPU backend's layer selection differs from the per-head path");
    const size_t bytes_head = policy_bytes(a), bytes_layer = policy_bytes(b);
    CHECK(bytes_head && bytes_layer && bytes_head != bytes_layer,
          "policy bytes %zu (per head) and %zu (layer): the layer path did not run", bytes_head, bytes_layer);
    tkv_session_free(a);
    tkv_session_free(b);

    /* entropy+rabitq runs end to end (prefill segments of 32 tokens) */
    a = open_session(m, "entropy+rabitq:segment=32,block=8,dense=0,sink=2,recent=2,batch=8", TKV_SESSION_MEASURE_MASS);
    REQUIRE_VOID(a);
    generate(a, prompt, NP, 20, t_rq, l_rq);
    CHECK(tkv_session_mass_kept(a) >= 0.9, "entropy+rabitq kept %.4f", tkv_session_mass_kept(a));
    tkv_session_free(a);
    tkv_model_free(m);
}

int main(void)
{
    rng = test_seed();
    test_specs();
    test_safe_mass();
    test_lazy_tail();
    test_hold();
    test_composition();
    test_engine();
    return test_done();
}
