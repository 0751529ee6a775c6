/*
 * hetero.h -- private: heterogeneous decode (docs/rabitq.md, "Heterogeneous
 * decode"). At a decode step whose blocks a selecting policy names, the
 * selected blocks of a KV head that sit in the pinned host tier below a GPU
 * are either recalled (the store's usual path) or attended where they are
 * by the CPU, in parallel with the device's attention over the resident
 * blocks; the two partial results merge exactly by log-sum-exp.
 *
 * This header holds the pieces that do not need a session: the merge (a
 * fast path and a double-precision reference), the cost model, and the
 * measurement of the CPU's attention rate. The engine (engine.c) does the
 * rest.
 */
#ifndef TKV_HETERO_H
#define TKV_HETERO_H

#include "backend.h"

/* Merges two partial attentions of the same queries over disjoint key sets.
 * For r < n_rows (a row is one (query token, query head)), with o[r] and
 * o2[r] the rows' normalised outputs ([head_dim] floats each) and lse[r],
 * lse2[r] the log-sum-exp of their scaled scores (as the attention op
 * returns them):
 *     lse'  = log(exp(lse) + exp(lse2))
 *     o'    = exp(lse - lse') o + exp(lse2 - lse') o2
 * written over o and lse. A side with lse = -inf (no key) contributes
 * nothing and the other side is kept bit for bit; both -inf: o = 0,
 * lse = -inf (what the attention op writes for a row that sees no key).
 * In float; tkv_attn_merge_ref is the same in double (the tests' oracle). */
void tkv_attn_merge(float *o, float *lse, const float *o2, const float *lse2, uint32_t n_rows, uint32_t head_dim);
void tkv_attn_merge_ref(float *o, float *lse, const float *o2, const float *lse2, uint32_t n_rows,
                        uint32_t head_dim);

/* The cost model, per KV head and step: the head's selected blocks in the
 * host tier either go up the link (recall_s = blocks * block_bytes /
 * link_bps; the device verifies them as they land) or the CPU reads the
 * selected tokens of them (cpu_s = tokens * G * head_dim * 4 / cpu_flops:
 * q.k and p.v, a multiply and an add each, for each of the G query heads of
 * the KV head) after verifying the whole blocks (+ blocks * block_bytes /
 * crc_bps; crc_bps = 0 leaves that out). Blocks whose only copy is on NVMe
 * are recalled either way and are not counted; blocks already in the
 * compute tier cost neither. */
static inline void tkv_hetero_costs(uint64_t host_blocks, uint64_t host_tokens, uint32_t block_bytes, uint32_t group,
                                    uint32_t head_dim, double link_bps, double cpu_flops, double crc_bps,
                                    double *cpu_s, double *recall_s)
{
    *recall_s = (double)host_blocks * block_bytes / link_bps;
    *cpu_s = (double)host_tokens * group * head_dim * 4.0 / cpu_flops +
             (crc_bps > 0 ? (double)host_blocks * block_bytes / crc_bps : 0.0);
}

/* The model's choice for one step alone: true, the CPU is cheaper. */
static inline bool tkv_hetero_prefer_cpu(uint64_t host_blocks, uint64_t host_tokens, uint32_t block_bytes,
                                         uint32_t group, uint32_t head_dim, double link_bps, double cpu_flops,
                                         double crc_bps)
{
    double cpu_s, recall_s;
    tkv_hetero_costs(host_blocks, host_tokens, block_bytes, group, head_dim, link_bps, cpu_flops, crc_bps, &cpu_s,
                     &recall_s);
    return cpu_s < recall_s;
}

/* What `auto` remembers of one (layer, KV head) between steps. The cost
 * model above predicts from one step's blocks, but a recalled block stays
 * in the compute tier and later steps find it there, while the CPU reads
 * its blocks again at every step they stay selected: where selections
 * repeat, a recall costs far less per step than the prediction says (and
 * where the compute tier is too small to keep them, it does not). So each
 * step also observes what the mode chosen at the last one costs per step
 * now -- the host blocks a step still finds there are that mode's
 * consequence -- and keeps it (cost[0]: the CPU, cost[1]: recall; < 0:
 * never observed). The mode not chosen is not observed, and what it cost
 * when it last was goes stale: each step it moves 1/8 of the way to that
 * mode's prediction for the step (tkv_hetero_choose). Zeroed memory is not
 * a valid state: start with TKV_HETERO_HEAD_INIT. */
struct tkv_hetero_head {
    float cost[2]; /* seconds per step, running mean of the observations  */
    uint8_t last;  /* the mode chosen last: 0 none yet, 1 CPU, 2 recall     */
};
#define TKV_HETERO_HEAD_INIT ((struct tkv_hetero_head){.cost = {-1.0f, -1.0f}, .last = 0})

/* The choice for one head with this step's costs as the model predicts them
 * (cpu_s, recall_s: tkv_hetero_costs). First the last choice's observed
 * cost is folded into h, and the other mode's (if observed) moves 1/8 of
 * the way to its prediction: on the H100 host at 128K, heads whose recall
 * was observed in the first steps' transient (their whole selection still
 * below) stayed on the CPU for good, at 3x the recall's price once the
 * transient had passed (docs/rabitq.md, session 28). Then each mode is
 * priced at its observed cost if it has one, else at the prediction, and
 * the cheaper taken -- unless the other mode was never observed and its
 * prediction is within 2x of that price, when it is taken once to observe
 * it. With nothing observed this is the prediction's choice
 * (tkv_hetero_prefer_cpu). True: the CPU. */
bool tkv_hetero_choose(struct tkv_hetero_head *h, double cpu_s, double recall_s);

/* Which way `auto` decides a decode step, when it measured its rates: the
 * cost model per head (tkv_hetero_choose: MODEL), or every head's host
 * blocks recalled (RECALL) or attended on the CPU (CPU). The model prices
 * blocks one head at a time, and what a step costs is not that sum: an
 * eviction pass, an upload's issue or the thread pool's start are paid per
 * layer, recalls of one head evict another's blocks, the CPU's part adds
 * to the step rather than overlapping the link's. On the H100 host at
 * 128K under the 8G cap the model, its rates observed in use and its stale
 * costs relaxed, still ran 32-35 tok/s where recalling everything ran
 * 48-49 (docs/rabitq.md, session 28). So `auto` also measures what matters,
 * the decode step's time, under each arm: a bandit over whole steps. Each
 * arm is tried first for a trial of TKV_HETERO_ARM_TRIAL counted steps
 * (the first step after a switch pays the switch's transient, e.g. the
 * recall of every block the CPU had been reading, and is not counted),
 * then the arm with the least mean step time of its latest trial is used,
 * its mean refreshed every trial; an arm not in use is tried again after
 * TKV_HETERO_ARM_WAIT steps, that wait doubling each time it loses (up to
 * TKV_HETERO_ARM_WAIT_MAX), so a machine or a context that changes is
 * followed while a losing arm costs less and less. */
enum tkv_hetero_arm { TKV_HETERO_ARM_MODEL, TKV_HETERO_ARM_RECALL, TKV_HETERO_ARM_CPU, TKV_HETERO_ARMS };
#define TKV_HETERO_ARM_TRIAL 3
#define TKV_HETERO_ARM_WAIT 32
#define TKV_HETERO_ARM_WAIT_MAX 1024
struct tkv_hetero_arms {
    double mean[TKV_HETERO_ARMS];   /* seconds per step of the arm's latest trial; < 0: never tried */
    uint32_t due[TKV_HETERO_ARMS];  /* the step from which an arm not in use is tried again        */
    uint32_t wait[TKV_HETERO_ARMS]; /* the steps from its last trial to `due`                      */
    uint32_t steps[TKV_HETERO_ARMS]; /* decode steps each arm decided                              */
    bool switched;                  /* the next step is the first under a new arm: not counted    */
    uint32_t n;                     /* steps counted in the current trial, summing to `sum`        */
    double sum;
    enum tkv_hetero_arm arm;        /* the arm in use                                              */
};
/* Fresh arms: nothing tried, MODEL first. */
void tkv_hetero_arms_init(struct tkv_hetero_arms *a);
/* After a decode step of `secs` under a->arm: the arm for the next step. */
enum tkv_hetero_arm tkv_hetero_arm_next(struct tkv_hetero_arms *a, double secs);

/* A rate observed in use: work units (flops, bytes) per second over the
 * observations so far (the engine makes one per decode step), older ones
 * weighing geometrically less (0.9 per observation), so that it follows
 * the machine under the session's load.
 * Zeroed: nothing observed. auto starts from rates measured in isolation
 * (the CPU's attention on a few cache-resident MiB, the link's default),
 * which can be far off in use -- on the H200 host at 128K the CPU attended
 * host blocks ~4x slower than measured at start, the recalls moved ~0.8x
 * the default rate (366 MB in ~11 ms of recall stall) -- so where the
 * session measured its rates it prices with these once they have an
 * observation. */
struct tkv_hetero_rate {
    double work, secs;
};
/* Adds an observation of `work` done in `secs`, `prior` being the rate
 * assumed before any. Ignored unless work > 0, secs > 0 and the work would
 * take at least min_s at the rate in use (tkv_hetero_rate_get): the cost
 * model prices work by a throughput, and a step that did little measures
 * the path's fixed costs (an eviction pass, an upload's issue, the thread
 * pool's start) more than its throughput. On the H100 host at 128K, auto's
 * steps that recalled ~6 MB observed 5-6 GB/s where steps recalling
 * 366-385 MB moved 35-42 GB/s; priced at the former, every head went to
 * the CPU and the link was never observed again (docs/rabitq.md, session
 * 28). */
void tkv_hetero_rate_observe(struct tkv_hetero_rate *r, double work, double secs, double prior, double min_s);
/* The observed rate, or `prior` when nothing was observed. */
double tkv_hetero_rate_get(const struct tkv_hetero_rate *r, double prior);
/* The engine's min_s: 2 ms of a decode step's work, twice what those ~6 MB
 * steps spent on recalls (1.1 ms, mostly eviction passes and issue). */
#define TKV_HETERO_OBSERVE_MIN_S 2e-3

/* CRC-32C bytes/s on the calling thread (a few MiB, best of 3; ~1 ms). */
double tkv_hetero_measure_crc(void);

/* Default link rate of the cost model (bytes/s) when the session is not
 * given one: pinned host -> H200 over PCIe 5 as the store's recalls reach it
 * for 16-32 KiB blocks (docs/benchmarks.md: 74-86% of the 55 GB/s peak). */
#define TKV_HETERO_LINK_BPS 40e9

/* Measures the CPU backend's decode attention rate (flop/s, counted as in
 * the cost model) on synthetic f16 blocks of the session's shape: n_head_kv
 * KV heads of 2048 tokens in blocks of `block` tokens, G query heads each,
 * one query; the best of 3 runs after a warm-up. A few milliseconds. */
tkv_status tkv_hetero_measure_cpu(struct tkv_backend *cpu, uint32_t n_head_kv, uint32_t group, uint32_t head_dim,
                                  uint32_t block, double *flops);

#endif
