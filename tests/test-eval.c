/*
 * test-eval.c -- `tierkv eval`'s generators and scorers (runtime/eval/).
 *
 * Without a model: the RULER scorers on hand-written answers; the word
 * lists; the PRNG; every task's samples are bit-identical for the same
 * (seed, index), differ for others, and hold their answers (needles present
 * and asked for, the vt chain resolves to the references, cwe's common
 * words really are the most frequent, fwe's top three are the references,
 * the pass key is in the text) -- with a stand-in tokenizer.
 * With the real model: the length search is token-exact (prompt + answer
 * room fits the context, one more haystack unit does not), and `tierkv
 * eval` runs end to end, reports a bad policy in one line and keeps going
 * with --keep-going.
 */
#include "test.h"
#include "eval/eval.h"

/* command lines are built from short test paths into fixed buffers */
#pragma GCC diagnostic ignored "-Wformat-truncation"

#include <ctype.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define NOISE "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

/* ---- a stand-in tokenizer: one token per 4 bytes ------------------------------------ */

static tkv_status fake_wrap(void *user, const char *body, const char *prefix, char **out)
{
    (void)user;
    size_t n = strlen(body) + strlen(prefix) + 32;
    *out = malloc(n);
    if (!*out)
        return TKV_ERR_NOMEM;
    snprintf(*out, n, "<user>\n%s\n<assistant>\n%s", body, prefix);
    return TKV_OK;
}

static tkv_status fake_count(void *user, const char *text, uint32_t *n)
{
    (void)user;
    *n = (uint32_t)((strlen(text) + 3) / 4);
    return TKV_OK;
}

static struct tkv_eval_lm fake_lm(void) { return (struct tkv_eval_lm){.wrap = fake_wrap, .count = fake_count}; }

/* ---- scorers ------------------------------------------------------------------------ */

static void check_post(const char *in, const char *want)
{
    char buf[256];
    size_t n = tkv_eval_postprocess(in, strlen(in), buf);
    CHECK(n == strlen(want) && !strcmp(buf, want), "postprocess('%s') = '%s', want '%s'", in, buf, want);
}

static void test_scorers(void)
{
    /* RULER's postprocess: strip, [\x00-\x1f] -> '\n', strip */
    check_post("  hello  ", "hello");
    check_post("\t\n 1234567 \r\n", "1234567");
    check_post("a\tb\x01" "c\x1f" "d", "a\nb\nc\nd");
    check_post("\x01\x02 x \x03", "x");
    check_post("x\x7f", "x\x7f"); /* DEL is not in the class */
    check_post("\xc2\xa0 x \xe3\x80\x80", "x"); /* Unicode spaces strip as in Python */
    check_post("", "");
    check_post(" \n\t ", "");
    char inplace[] = "  a\tb  ";
    tkv_eval_postprocess(inplace, strlen(inplace), inplace);
    CHECK(!strcmp(inplace, "a\nb"), "postprocess in place: '%s'", inplace);

    /* string_match_all: fraction of references found, case-insensitive */
    const char *two[] = {"1234567", "7654321"};
    CHECK(tkv_eval_string_match_all("The numbers are 1234567 and 7654321.", two, 2) == 1.0, "both");
    CHECK(tkv_eval_string_match_all("The number is 1234567.", two, 2) == 0.5, "partial credit");
    CHECK(tkv_eval_string_match_all("123456 and 765432", two, 2) == 0.0, "prefixes are not matches");
    CHECK(tkv_eval_string_match_all("", two, 2) == 0.0, "empty answer");
    const char *words[] = {"Apple", "banana", "CHERRY", "date"};
    CHECK(tkv_eval_string_match_all("1. APPLE 2. Banana 3. cherry", words, 4) == 0.75, "case-insensitive");
    CHECK(tkv_eval_string_match_all("pineapple", words, 4) == 0.25, "substring, as RULER");
    const char *vars[] = {"ABCDE", "FGHIJ", "KLMNO", "PQRST", "UVWXY"};
    CHECK(tkv_eval_string_match_all("abcde FGHIJ klmno", vars, 5) == 0.6, "3 of 5");
    CHECK(tkv_eval_string_match_all("anything", vars, 0) == 0.0, "no references");

    /* pass key: the first integer equals the key */
    CHECK(tkv_eval_passkey_match(" 12345.", "12345") == 1.0, "plain");
    CHECK(tkv_eval_passkey_match("The pass key is 12345. Remember it.", "12345") == 1.0, "in a sentence");
    CHECK(tkv_eval_passkey_match("0012345", "12345") == 1.0, "leading zeros: int()");
    CHECK(tkv_eval_passkey_match("1234 then 12345", "12345") == 0.0, "only the first integer counts");
    CHECK(tkv_eval_passkey_match("123456", "12345") == 0.0, "longer number");
    CHECK(tkv_eval_passkey_match("1234", "12345") == 0.0, "shorter number");
    CHECK(tkv_eval_passkey_match("no digits here", "12345") == 0.0, "no integer");
    CHECK(tkv_eval_passkey_match("", "12345") == 0.0, "empty");
    CHECK(tkv_eval_passkey_match("-12345", "12345") == 1.0, "\\d+ skips the sign");

    /* tkv_eval_score: postprocess + the task's metric */
    struct tkv_eval_sample s = {.task = TKV_EVAL_NIAH_MULTIVALUE, .n_refs = 4};
    strcpy(s.refs[0], "1111111");
    strcpy(s.refs[1], "2222222");
    strcpy(s.refs[2], "3333333");
    strcpy(s.refs[3], "4444444");
    CHECK(tkv_eval_score(&s, "  1111111, 2222222\x01and 3333333 ") == 0.75, "niah score");
    s = (struct tkv_eval_sample){.task = TKV_EVAL_PASSKEY, .n_refs = 1};
    strcpy(s.refs[0], "48213");
    CHECK(tkv_eval_score(&s, " 48213. Remember") == 1.0, "passkey score");
    CHECK(tkv_eval_score(&s, " 4821 3") == 0.0, "passkey split");
    s = (struct tkv_eval_sample){.task = TKV_EVAL_CWE, .n_refs = 10};
    for (int i = 0; i < 10; i++)
        snprintf(s.refs[i], sizeof s.refs[i], "word%c", 'a' + i);
    CHECK(tkv_eval_score(&s, "1. worda 2. WORDB 3. wordc") == 0.3, "cwe score");
}

/* ---- word lists and PRNG ---------------------------------------------------------------- */

static void test_words(void)
{
    const char *const *lists[] = {tkv_eval_nouns, tkv_eval_adjectives, tkv_eval_verbs};
    const uint32_t counts[] = {tkv_eval_nouns_count, tkv_eval_adjectives_count, tkv_eval_verbs_count};
    CHECK(counts[0] >= 400 && counts[1] >= 200 && counts[2] >= 200, "lists: %u nouns, %u adjectives, %u verbs",
          counts[0], counts[1], counts[2]);
    for (int l = 0; l < 3; l++)
        for (uint32_t i = 0; i < counts[l]; i++) {
            const char *w = lists[l][i];
            bool alpha = strlen(w) >= 3;
            for (const char *c = w; *c; c++)
                alpha &= *c >= 'a' && *c <= 'z';
            CHECK(alpha, "word '%s' is not 3+ lowercase letters", w);
            if (i)
                CHECK(strcmp(lists[l][i - 1], w) < 0, "list %d not sorted/unique at '%s'", l, w);
            for (int l2 = 0; l2 < 3; l2++)
                for (uint32_t j = 0; j < counts[l2]; j++)
                    if ((l2 != l || j != i) && strstr(lists[l2][j], w))
                        CHECK(0, "'%s' is inside '%s'", w, lists[l2][j]);
        }
}

static void test_rng(void)
{
    struct tkv_eval_rng a, b;
    tkv_eval_rng_seed(&a, 42);
    tkv_eval_rng_seed(&b, 42);
    bool same = true;
    for (int i = 0; i < 1000; i++)
        same &= tkv_eval_rng_next(&a) == tkv_eval_rng_next(&b);
    CHECK(same, "same seed, same stream");
    tkv_eval_rng_seed(&b, 43);
    CHECK(tkv_eval_rng_next(&a) != tkv_eval_rng_next(&b), "different seeds differ");
    /* bounded draws are in range and roughly uniform */
    uint32_t hist[10] = {0};
    bool in_range = true;
    for (int i = 0; i < 100000; i++) {
        uint64_t x = tkv_eval_rng_below(&a, 10);
        double u = tkv_eval_rng_unit(&a);
        in_range &= x < 10 && u >= 0 && u < 1;
        hist[x < 10 ? x : 0]++;
    }
    CHECK(in_range, "below/unit in range");
    for (int i = 0; i < 10; i++)
        CHECK(hist[i] > 9400 && hist[i] < 10600, "bucket %d has %u of 100000", i, hist[i]);
    CHECK(tkv_eval_rng_below(&a, 1) == 0 && tkv_eval_rng_below(&a, 0) == 0, "below(0 or 1)");
    CHECK(tkv_eval_mix(1, 2) != tkv_eval_mix(2, 1) && tkv_eval_mix(1, 2) == tkv_eval_mix(1, 2), "mix");
}

/* ---- determinism ------------------------------------------------------------------------ */

static bool same_sample(const struct tkv_eval_sample *a, const struct tkv_eval_sample *b)
{
    if (strcmp(a->prompt, b->prompt) || strcmp(a->body, b->body) || strcmp(a->answer_prefix, b->answer_prefix) ||
        a->units != b->units || a->n_tokens != b->n_tokens || a->n_refs != b->n_refs)
        return false;
    for (uint32_t i = 0; i < a->n_refs; i++)
        if (strcmp(a->refs[i], b->refs[i]))
            return false;
    return true;
}

static void test_determinism(uint32_t ctx)
{
    struct tkv_eval_lm lm = fake_lm();
    for (int t = 0; t < TKV_EVAL_TASK_COUNT; t++) {
        const char *name = tkv_eval_task_get((enum tkv_eval_task)t)->name;
        struct tkv_eval_sample a, b, c, d, e;
        tkv_status st = tkv_eval_generate(&lm, (enum tkv_eval_task)t, ctx, 42, 0, &a);
        REQUIRE_VOID(st == TKV_OK);
        REQUIRE_VOID(tkv_eval_generate(&lm, (enum tkv_eval_task)t, ctx, 42, 0, &b) == TKV_OK);
        REQUIRE_VOID(tkv_eval_generate(&lm, (enum tkv_eval_task)t, ctx, 42, 1, &c) == TKV_OK);
        REQUIRE_VOID(tkv_eval_generate(&lm, (enum tkv_eval_task)t, ctx, 43, 0, &d) == TKV_OK);
        REQUIRE_VOID(tkv_eval_render(&lm, (enum tkv_eval_task)t, ctx, 42, 0, a.units, &e) == TKV_OK);
        CHECK(same_sample(&a, &b), "%s ctx %u: the same seed and index give different samples", name, ctx);
        CHECK(same_sample(&a, &e), "%s ctx %u: rendering the chosen size again differs", name, ctx);
        CHECK(strcmp(a.prompt, c.prompt) != 0 && strcmp(a.refs[0], c.refs[0]) != 0,
              "%s ctx %u: samples 0 and 1 are alike", name, ctx);
        CHECK(strcmp(a.prompt, d.prompt) != 0 && strcmp(a.refs[0], d.refs[0]) != 0,
              "%s ctx %u: seeds 42 and 43 give alike samples", name, ctx);
        const uint32_t tg = tkv_eval_task_get((enum tkv_eval_task)t)->tokens_to_generate;
        CHECK(a.n_tokens + tg <= ctx, "%s ctx %u: %u prompt tokens + %u do not fit", name, ctx, a.n_tokens, tg);
        /* with the stand-in tokenizer the search also ends on the boundary */
        struct tkv_eval_sample up;
        REQUIRE_VOID(tkv_eval_render(&lm, (enum tkv_eval_task)t, ctx, 42, 0, a.units + 1, &up) == TKV_OK);
        CHECK(up.n_tokens + tg > ctx, "%s ctx %u: %u %s fit but the search chose %u", name, ctx, a.units + 1,
              tkv_eval_task_get((enum tkv_eval_task)t)->unit, a.units);
        struct tkv_eval_sample *all[] = {&a, &b, &c, &d, &e, &up};
        for (int i = 0; i < 6; i++)
            tkv_eval_sample_free(all[i]);
    }
    /* a context too small for the task: a clear error, nothing allocated */
    struct tkv_eval_sample s;
    CHECK(tkv_eval_generate(&lm, TKV_EVAL_VT, 256, 42, 0, &s) == TKV_ERR_INVALID_ARG &&
              strstr(tkv_last_error(), "too small"),
          "vt at 256 tokens: %s", tkv_last_error());
    CHECK(tkv_eval_generate(&lm, TKV_EVAL_NIAH_SINGLE, 100, 42, 0, &s) == TKV_ERR_INVALID_ARG, "niah at 100 tokens");
    CHECK(tkv_eval_task_parse("vt") == TKV_EVAL_VT && tkv_eval_task_parse("niah") == -1, "task names");
}

/* ---- answers in their prompts ---------------------------------------------------------- */

static uint32_t count_str(const char *hay, const char *needle)
{
    uint32_t n = 0;
    for (const char *p = hay; (p = strstr(p, needle)) != NULL; p += strlen(needle))
        n++;
    return n;
}

static void check_niah(const struct tkv_eval_sample *s, uint32_t n_needles, uint32_t n_queries)
{
    const char *name = tkv_eval_task_get(s->task)->name;
    CHECK(count_str(s->body, "One of the special magic numbers for ") == n_needles, "%s: %u needles expected", name,
          n_needles);
    CHECK(s->n_refs == (s->task == TKV_EVAL_NIAH_MULTIVALUE ? 4u : n_queries), "%s: %u refs", name, s->n_refs);
    /* every line is the noise sentence, a needle, or the template */
    uint32_t lines = 0, noise = 0;
    for (const char *p = s->body; *p;) {
        const char *e = strchr(p, '\n');
        size_t len = e ? (size_t)(e - p) : strlen(p);
        lines++;
        noise += len == strlen(NOISE) && !strncmp(p, NOISE, len);
        p += len + (e ? 1 : 0);
    }
    CHECK(noise == s->units && lines == s->units + n_needles + 2, "%s: %u lines, %u noise, units %u", name, lines,
          noise, s->units);
    const char *question = strrchr(s->body, '\n');
    REQUIRE_VOID(question);
    for (uint32_t i = 0; i < s->n_refs; i++) {
        /* the needle holding the value names a key asked in the question and the prefix */
        char pat[96];
        snprintf(pat, sizeof pat, " is: %s.\n", s->refs[i]);
        const char *hit = strstr(s->body, pat);
        CHECK(hit != NULL, "%s: value %s is not in a needle", name, s->refs[i]);
        if (!hit)
            continue;
        const char *line = hit;
        while (line > s->body && line[-1] != '\n')
            line--;
        char key[64] = "";
        sscanf(line, "One of the special magic numbers for %63s", key);
        CHECK(key[0] && strstr(question, key) && strstr(s->answer_prefix, key), "%s: key '%s' of %s is not asked",
              name, key, s->refs[i]);
    }
    const bool singular = s->n_refs == 1;
    CHECK(singular == (strstr(s->body, "A special magic number is hidden") == s->body), "%s: singular template",
          name);
    CHECK(strstr(s->answer_prefix,
                 singular ? "mentioned in the provided text is" : "mentioned in the provided text are"),
          "%s: answer prefix '%s'", name, s->answer_prefix);
}

static void check_vt(const struct tkv_eval_sample *s)
{
    /* the value in the answer prefix; follow VAR X = VAR Y from it */
    const char *v = strstr(s->answer_prefix, "assigned the value ");
    REQUIRE_VOID(v);
    char value[16] = "";
    sscanf(v + strlen("assigned the value "), "%15[0-9]", value);
    CHECK(strlen(value) == 5, "vt: value '%s'", value);
    CHECK(count_str(s->body, "Memorize and track the chain(s)") == 2, "vt: the example and the task");
    char set[8][8];
    uint32_t n = 0;
    for (bool grew = true; grew;) {
        grew = false;
        for (const char *p = s->body; (p = strstr(p, "VAR ")) != NULL; p++) {
            if (p != s->body && p[-1] != '\n')
                continue; /* the right-hand side of an assignment */
            char lhs[8], rhs[16];
            if (sscanf(p, "VAR %7[A-Z] = %15s", lhs, rhs) != 2)
                continue;
            bool from = !strcmp(rhs, value);
            if (!strcmp(rhs, "VAR")) {
                char src[8];
                if (sscanf(p, "VAR %*[A-Z] = VAR %7[A-Z]", src) == 1)
                    for (uint32_t i = 0; i < n; i++)
                        from |= !strcmp(set[i], src);
            }
            bool have = false;
            for (uint32_t i = 0; i < n; i++)
                have |= !strcmp(set[i], lhs);
            if (from && !have && n < 8) {
                strcpy(set[n++], lhs);
                grew = true;
            }
        }
    }
    CHECK(n == 5 && s->n_refs == 5, "vt: chain of %u variables, %u refs", n, s->n_refs);
    for (uint32_t i = 0; i < s->n_refs; i++) {
        bool found = false;
        for (uint32_t j = 0; j < n; j++)
            found |= !strcmp(set[j], s->refs[i]);
        CHECK(found && strlen(s->refs[i]) == 5, "vt: ref %s is not on the chain from %s", s->refs[i], value);
    }
}

/* Counts of the words in a "1. w 2. w ..." list (numbers checked). */
static uint32_t list_counts(const char *list, const char *end, char (*words)[32], uint32_t *cnt, uint32_t cap,
                            bool *numbered)
{
    uint32_t n = 0, expect = 1;
    *numbered = true;
    const char *p = list;
    while (p < end) {
        unsigned num;
        char w[32];
        int used = 0;
        if (sscanf(p, "%u. %31[a-z]%n", &num, w, &used) != 2 || p + used > end)
            break;
        *numbered &= num == expect++;
        p += used;
        while (p < end && *p == ' ')
            p++;
        uint32_t i = 0;
        while (i < n && strcmp(words[i], w))
            i++;
        if (i == n && n < cap) {
            strcpy(words[n], w);
            cnt[n++] = 0;
        }
        if (i < n)
            cnt[i]++;
    }
    return n;
}

static void check_cwe(const struct tkv_eval_sample *s)
{
    const bool short_ctx = s->ctx < 4096;
    const char *head = "Memorize the ones that appear most often.\n";
    const char *ex = strstr(s->body, head), *main_list = ex ? strstr(ex + 1, head) : NULL;
    REQUIRE_VOID(ex && main_list);
    static char words[4096][32];
    static uint32_t cnt[4096];
    bool numbered;
    /* the example: its 10 listed answers are its 10 most frequent words */
    const char *ex_end = strstr(ex, "\nQuestion:");
    uint32_t n = list_counts(ex + strlen(head), ex_end, words, cnt, 4096, &numbered);
    CHECK(numbered && n == (short_ctx ? 20u : 40u), "cwe example: %u words", n);
    const char *ex_ans = strstr(ex_end, "are: 1. ");
    REQUIRE_VOID(ex_ans);
    char answer_line[1024];
    snprintf(answer_line, sizeof answer_line, "%.*s", (int)strcspn(ex_ans, "\n"), ex_ans);
    for (uint32_t i = 0; i < n; i++) { /* no listed word is inside another */
        const bool listed = strstr(answer_line, words[i]) != NULL;
        const uint32_t want = listed ? (short_ctx ? 3 : 10) : (short_ctx ? 1 : 3);
        CHECK(cnt[i] == want, "cwe example: '%s' occurs %u times, want %u", words[i], cnt[i], want);
    }
    /* the task: the references occur 30 (6) times, every other word 3 (1) */
    const char *end = strstr(main_list, "\nQuestion:");
    n = list_counts(main_list + strlen(head), end, words, cnt, 4096, &numbered);
    CHECK(numbered && n == s->units, "cwe: %u distinct words, units %u", n, s->units);
    uint32_t refs_found = 0;
    for (uint32_t i = 0; i < n; i++) {
        bool is_ref = false;
        for (uint32_t j = 0; j < s->n_refs; j++)
            is_ref |= !strcmp(words[i], s->refs[j]);
        refs_found += is_ref;
        const uint32_t want = is_ref ? (short_ctx ? 6 : 30) : (short_ctx ? 1 : 3);
        CHECK(cnt[i] == want, "cwe: '%s' occurs %u times, want %u", words[i], cnt[i], want);
    }
    CHECK(refs_found == 10 && s->n_refs == 10, "cwe: %u of %u references in the list", refs_found, s->n_refs);
}

static void check_fwe(const struct tkv_eval_sample *s)
{
    const char *start = strstr(s->body, "coded words. "), *end = strstr(s->body, "\nQuestion:");
    REQUIRE_VOID(start && end);
    start += strlen("coded words. ");
    static char words[4096][8];
    static uint32_t cnt[4096];
    uint32_t n = 0;
    for (const char *p = start; p < end;) {
        const char *sp = memchr(p, ' ', (size_t)(end - p));
        size_t len = sp ? (size_t)(sp - p) : (size_t)(end - p);
        char w[8] = "";
        snprintf(w, sizeof w, "%.*s", (int)len, p);
        uint32_t i = 0;
        while (i < n && strcmp(words[i], w))
            i++;
        if (i == n && n < 4096) {
            strcpy(words[n], w);
            cnt[n++] = 0;
        }
        if (i < n)
            cnt[i]++;
        p += len + 1;
    }
    /* the three most frequent real words, strictly above all others */
    uint32_t fourth = 0, min_ref = UINT32_MAX, refs = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (!strcmp(words[i], "..."))
            continue;
        CHECK(strlen(words[i]) == 6, "fwe: word '%s'", words[i]);
        bool is_ref = false;
        for (uint32_t j = 0; j < s->n_refs; j++)
            is_ref |= !strcmp(words[i], s->refs[j]);
        if (is_ref) {
            refs++;
            min_ref = cnt[i] < min_ref ? cnt[i] : min_ref;
        } else {
            fourth = cnt[i] > fourth ? cnt[i] : fourth;
        }
    }
    CHECK(refs == 3 && s->n_refs == 3 && min_ref > fourth, "fwe: refs %u, least ref %u, best other %u", refs, min_ref,
          fourth);
}

static void check_passkey(const struct tkv_eval_sample *s)
{
    char line[128];
    CHECK(s->n_refs == 1 && strlen(s->refs[0]) == 5 && isdigit((unsigned char)s->refs[0][0]), "passkey: key '%s'",
          s->refs[0]);
    snprintf(line, sizeof line, "\nThe pass key is %s. Remember it. %s is the pass key.\n", s->refs[0], s->refs[0]);
    CHECK(count_str(s->body, line) == 1, "passkey: the key line is missing");
    CHECK(!strcmp(s->answer_prefix, " The pass key is"), "passkey: prefix '%s'", s->answer_prefix);
    const size_t bl = strlen(s->body), ql = strlen("\nWhat is the pass key?");
    CHECK(bl > ql && !strcmp(s->body + bl - ql, "\nWhat is the pass key?"), "passkey: question");
    /* the garbage is the noise sentences cut by characters: units of them */
    CHECK(bl == strlen("There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
                       "them. I will quiz you about the important information there.\n") +
                    s->units + strlen(line) + ql,
          "passkey: %zu bytes for %u characters of garbage", bl, s->units);
}

static void test_contents(uint32_t ctx)
{
    struct tkv_eval_lm lm = fake_lm();
    for (uint32_t idx = 0; idx < 3; idx++)
        for (int t = 0; t < TKV_EVAL_TASK_COUNT; t++) {
            struct tkv_eval_sample s;
            REQUIRE_VOID(tkv_eval_generate(&lm, (enum tkv_eval_task)t, ctx, 7, idx, &s) == TKV_OK);
            switch ((enum tkv_eval_task)t) {
            case TKV_EVAL_NIAH_SINGLE: check_niah(&s, 1, 1); break;
            case TKV_EVAL_NIAH_MULTIKEY: check_niah(&s, 4, 1); break;
            case TKV_EVAL_NIAH_MULTIVALUE: check_niah(&s, 4, 1); break;
            case TKV_EVAL_NIAH_MULTIQUERY: check_niah(&s, 4, 4); break;
            case TKV_EVAL_VT: check_vt(&s); break;
            case TKV_EVAL_CWE: check_cwe(&s); break;
            case TKV_EVAL_FWE: check_fwe(&s); break;
            case TKV_EVAL_PASSKEY: check_passkey(&s); break;
            default: break;
            }
            tkv_eval_sample_free(&s);
        }
}

/* ---- with the real model ------------------------------------------------------------------ */

static void test_model_lengths(tkv_model *m)
{
    struct tkv_eval_lm lm;
    REQUIRE_VOID(tkv_eval_lm_init(m, &lm) == TKV_OK);
    const uint32_t ctxs[] = {1024, 2048, 4096};
    for (int t = 0; t < TKV_EVAL_TASK_COUNT; t++)
        for (int c = 0; c < 3; c++) {
            const struct tkv_eval_task_info *ti = tkv_eval_task_get((enum tkv_eval_task)t);
            const uint32_t ctx = ctxs[c];
            struct tkv_eval_sample s, up, again;
            tkv_status st = tkv_eval_generate(&lm, (enum tkv_eval_task)t, ctx, 42, 3, &s);
            if (st == TKV_ERR_INVALID_ARG && ctx == 1024 && (t == TKV_EVAL_VT || t == TKV_EVAL_CWE))
                continue; /* the few-shot example alone nearly fills 1K */
            CHECK(st == TKV_OK, "%s ctx %u: %s", ti->name, ctx, tkv_last_error());
            if (st != TKV_OK)
                continue;
            /* the count is the real tokenization of the prompt */
            size_t n = 0;
            tkv_tokenize(m, s.prompt, -1, TKV_EVAL_TOK_FLAGS, NULL, 0, &n);
            CHECK(n == s.n_tokens, "%s: counted %u, tokenized %zu", ti->name, s.n_tokens, n);
            CHECK(strncmp(s.prompt, "<|im_start|>", 12) == 0 && strstr(s.prompt, "<|im_start|>assistant\n"),
                  "%s: not in the chat template", ti->name);
            const size_t pl = strlen(s.prompt), al = strlen(s.answer_prefix);
            CHECK(pl > al && !strcmp(s.prompt + pl - al, s.answer_prefix) &&
                      !strncmp(s.prompt + pl - al - strlen("assistant\n"), "assistant\n", 10),
                  "%s: the answer prefix must follow the assistant header", ti->name);
            /* token-exact: fits with the answer room; one more unit does not */
            CHECK(s.n_tokens + ti->tokens_to_generate <= ctx, "%s ctx %u: %u + %u tokens", ti->name, ctx, s.n_tokens,
                  ti->tokens_to_generate);
            REQUIRE_VOID(tkv_eval_render(&lm, (enum tkv_eval_task)t, ctx, 42, 3, s.units + 1, &up) == TKV_OK);
            CHECK(up.n_tokens + ti->tokens_to_generate > ctx, "%s ctx %u: %u %s would fit (%u tokens)", ti->name, ctx,
                  s.units + 1, ti->unit, up.n_tokens);
            fprintf(stderr, "  %-16s ctx %4u: %4u %-10s -> %4u tokens + %3u (one more: %u)\n", ti->name, ctx, s.units,
                    ti->unit, s.n_tokens, ti->tokens_to_generate, up.n_tokens);
            /* bit for bit again with the real tokenizer */
            REQUIRE_VOID(tkv_eval_generate(&lm, (enum tkv_eval_task)t, ctx, 42, 3, &again) == TKV_OK);
            CHECK(same_sample(&s, &again), "%s ctx %u: not reproducible", ti->name, ctx);
            tkv_eval_sample_free(&s);
            tkv_eval_sample_free(&up);
            tkv_eval_sample_free(&again);
        }
    tkv_eval_lm_free(&lm);
}

/* ---- the command ------------------------------------------------------------------------- */

struct result {
    int status;
    char err[16384];
};

static void run(const char *tierkv, const char *args, struct result *r)
{
    char cmd[8192], errf[64];
    snprintf(errf, sizeof errf, "/tmp/tkv-eval-err.%d", getpid());
    snprintf(cmd, sizeof cmd, "%s %s >/dev/null 2>%s </dev/null", tierkv, args, errf);
    int st = system(cmd);
    r->status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
    FILE *f = fopen(errf, "rb");
    size_t n = f ? fread(r->err, 1, sizeof r->err - 1, f) : 0;
    r->err[n] = 0;
    if (f)
        fclose(f);
    unlink(errf);
}

static char *slurp(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    static char buf[65536];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = 0;
    fclose(f);
    return buf;
}

static void test_cli(const char *model)
{
    const char *dir = getenv("TKV_BUILD_DIR");
    char tierkv[4096], args[8192], out[64];
    snprintf(tierkv, sizeof tierkv, "%s/tierkv", dir ? dir : ".");
    if (access(tierkv, X_OK) != 0) {
        fprintf(stderr, "tierkv binary not found at %s: command tests skipped\n", tierkv);
        return;
    }
    snprintf(out, sizeof out, "/tmp/tkv-eval-%d.json", getpid());
    struct result r;

    run(tierkv, "eval", &r);
    CHECK(r.status == 2 && strstr(r.err, "no model"), "no arguments: %d %s", r.status, r.err);
    run(tierkv, "eval -m x.gguf --task niah", &r);
    CHECK(r.status == 2 && strstr(r.err, "unknown task 'niah'"), "bad task: %d %s", r.status, r.err);
    run(tierkv, "eval -m x.gguf --task vt --budget 1,x --out o.json", &r);
    CHECK(r.status == 2 && strstr(r.err, "--budget"), "bad budget: %d %s", r.status, r.err);
    if (!model)
        return;

    /* a bad policy stops the run before any work: one line naming it */
    snprintf(args, sizeof args, "eval -m %s --task passkey --ctx 512 --samples 1 --policy full,nosuch --out %s", model,
             out);
    unlink(out);
    run(tierkv, args, &r);
    CHECK(r.status == 1 && strstr(r.err, "policy 'nosuch'") && strstr(r.err, "unknown policy") &&
              strchr(r.err, '\n') == r.err + strlen(r.err) - 1 && access(out, F_OK) != 0,
          "bad policy: %d %s", r.status, r.err);

    /* --keep-going: the bad policy's rows carry its error; the others run */
    snprintf(args, sizeof args,
             "eval -m %s --task passkey,niah_single --ctx 512 --samples 1 --policy full,streaming:sink=4,nosuch "
             "--budget 64 --max-gen 12 --keep-going --out %s -t 2",
             model, out);
    run(tierkv, args, &r);
    CHECK(r.status == 0, "eval run: exit %d: %s", r.status, r.err);
    const char *json = slurp(out);
    CHECK(json != NULL, "no %s", out);
    if (json) {
        CHECK(strstr(json, "\"results\": [") && strstr(json, "\"ctx\": 512") && strstr(json, "\"seed\": 42"),
              "json: %s", json);
        CHECK(count_str(json, "{\"task\": \"passkey\", \"policy\": ") == 3 &&
                  count_str(json, "{\"task\": \"niah_single\", \"policy\": ") == 3,
              "json rows: %s", json);
        CHECK(strstr(json, "\"policy\": \"full\", \"budget\": 64, \"ctx\": 512, \"samples\": 1, \"score\": ") &&
                  strstr(json, "\"kl\": 0, \"top1\": 1, \"mass_kept\": 1"),
              "the full row is the reference: %s", json);
        CHECK(strstr(json, "\"policy\": \"streaming:sink=4\", \"budget\": 64, \"ctx\": 512, \"samples\": 1"),
              "streaming row: %s", json);
        CHECK(count_str(json, "\"error\": \"cannot start a session: policy: unknown policy 'nosuch'") == 2,
              "nosuch rows carry the error: %s", json);
    }
    unlink(out);
}

int main(void)
{
    test_scorers();
    test_words();
    test_rng();
    test_determinism(1500);
    test_determinism(4096);
    test_contents(2000);
    test_contents(6000);

    const char *path = getenv("TKV_MODEL");
    FILE *f = path ? fopen(path, "rb") : NULL;
    if (f)
        fclose(f);
    else
        fprintf(stderr, "model not found (TKV_MODEL=%s): the tokenizer and command tests are skipped\n",
                path ? path : "unset");
    if (f) {
        tkv_model *m = NULL;
        REQUIRE(tkv_model_load(path, &m) == TKV_OK, "load: %s", tkv_last_error());
        test_model_lengths(m);
        tkv_model_free(m);
    }
    test_cli(f ? path : NULL);
    return test_done();
}
