/*
 * persist-probe.cu -- an experiment, not part of the build: how much of a
 * Q4_0 decode step's distance from its roofline is the kernel boundaries?
 *
 * The decode step streams a layer's weights through four GEMVs (q/k/v 6144 x
 * 4096, wo 4096 x 4096, gate/up 28672 x 4096, down 4096 x 14336 for
 * Llama-3-8B) with short dependent ops between them. Each GEMV is its own
 * kernel: it ramps up, streams, and drains, and its one or two waves leave
 * SMs idle at the tail (docs/gpu.md, "What is left": 36-62% of the copy
 * rate for the one- and two-wave grids). One persistent kernel could instead
 * keep every SM streaming: a warp issues the next GEMV's weights before the
 * grid barrier that waits for this GEMV's outputs (weights depend on no op),
 * so the copies never stop.
 *
 * This probe runs the same GEMV code both ways over 32 layers of Llama-3-8B
 * Q4_0 shapes (3.93 GB of weights, so nothing stays in L2):
 *   chain    one launch per GEMV (128 a step), programmatic dependent launch:
 *            the first stages are issued before griddepcontrol.wait;
 *   persist  one launch for the step, a grid barrier between GEMVs, each
 *            warp's ring of stages running ahead across the barriers;
 * and reports each step's time against the weights' bytes at the copy rate
 * measured in the same run (cudaMemcpy device to device). Two more rows
 * bound what is left: persist without the grid barriers (each GEMV reads
 * whatever its activations hold: the step if no op waited for another) and
 * persist without the arithmetic (the weights streamed through the same
 * rings and waits, no dot products: the loads alone), and persist without
 * barriers whose CTAs load activations once (no per-GEMV reload and CTA
 * sync: the weights' stream alone). The attention,
 * norms and activation quantization are left out; the GEMV's activations
 * are the previous GEMV's int8 outputs (the same dependency and bytes as
 * the backend's Q8 planes). Both variants compute every row with the same
 * lanes in the same order, so their outputs must agree bit for bit (checked).
 *
 * Build: nvcc -O3 -arch=sm_90 -o persist-probe gpu/probe/persist-probe.cu (from the
 *        project root)
 * Run:   ./persist-probe [-w warps] [-s stages] [-l layers] [-r reps] [-x shape] [-p ahead]
 *        (-x 0..3: every op of that shape, q/k/v, wo, gate/up, down; -p N: each
 *        warp prefetches into L2 the stage N past the one it copies, across
 *        the barriers, and in a chain into the next op's first stages)
 */
#include "probe.cuh"

#include <string.h>

const char *const probe_name = "persist-probe";

/* Q4_0: blocks of 32 weights, 18 bytes (an f16 scale, 16 bytes of nibbles);
 * a lane's unit of work is a group of 8 blocks (144 bytes, 9 chunks of 16). */
constexpr int GROUP_BYTES = 144, GROUP_CHUNKS = 9, GROUP_W = 256;
constexpr int K_MAX = 14336;

struct op {
    const uint8_t *w;   /* rows x (K / 32) blocks */
    const int8_t *act;  /* K: the previous op's output (or the input) */
    int8_t *out;        /* rows */
    float *outf;        /* rows: the sums, for the check */
    uint32_t rows, K;
};

struct step {
    const op *ops;
    uint32_t n_ops;
    const float *ascale; /* K_MAX / 32 activation scales (every op the same) */
    unsigned *barrier;   /* persist: CTAs arrived, summed over the barriers */
    uint32_t warps, stages;
    uint32_t ahead;      /* a warp prefetches into L2 the stage this many past the one it
                            copies into its ring (0: none); in a chain, into the next op */
};

/* A warp's share of op o: units of 32 / L rows (L lanes a row), each unit
 * NP stages (passes over the row's groups). */
struct plan {
    uint32_t L, NP, RPS, G, u0, u1;
};

__device__ __forceinline__ plan plan_of(const op &o, uint32_t gw, uint32_t W)
{
    plan p;
    p.G = o.K / GROUP_W;
    p.L = p.G >= 32 ? 32 : p.G; /* 16 for K = 4096 */
    p.NP = (p.G + p.L - 1) / p.L;
    p.RPS = 32 / p.L;
    const uint32_t U = o.rows / p.RPS;
    p.u0 = (uint32_t)((uint64_t)U * gw / W);
    p.u1 = (uint32_t)((uint64_t)U * (gw + 1) / W);
    return p;
}

/* A cursor over a warp's stages, op by op. */
struct cursor {
    uint32_t o, s, n; /* op, stage in it, its stage count */
};

__device__ __forceinline__ void cursor_settle(cursor &c, const step &st, uint32_t o_end, uint32_t gw, uint32_t W)
{
    while (c.o < o_end && c.s >= c.n) {
        c.o++;
        c.s = 0;
        if (c.o < o_end) {
            const plan p = plan_of(st.ops[c.o], gw, W);
            c.n = (p.u1 - p.u0) * p.NP;
        }
    }
}

/* Issues stage c.s of op c.o into ring slot `slot` (one commit group, empty
 * past the end). */
__device__ __forceinline__ void issue(const step &st, const cursor &c, uint32_t o_end, uint32_t gw, uint32_t W,
                                      uint8_t *slot, uint32_t lane)
{
    if (c.o < o_end) {
        const op &o = st.ops[c.o];
        const plan p = plan_of(o, gw, W);
        const uint32_t unit = p.u0 + c.s / p.NP, pass = c.s % p.NP;
        const size_t row_bytes = (size_t)(o.K / 32) * 18;
#pragma unroll
        for (int i = 0; i < GROUP_CHUNKS; i++) {
            const uint32_t ch = i * 32 + lane, gl = ch / GROUP_CHUNKS, cc = ch % GROUP_CHUNKS;
            const uint32_t row = unit * p.RPS + gl / p.L, gi = pass * p.L + gl % p.L;
            if (gi < p.G)
                tkv_cp_async16(slot + ch * 16, o.w + row * row_bytes + (size_t)gi * GROUP_BYTES + cc * 16, true);
        }
    }
    tkv_cp_async_commit();
}

/* Prefetches stage c.s of op c.o into L2: each of the stage's RPS row
 * pieces (L groups of a row, contiguous) as one bulk prefetch. */
__device__ __forceinline__ void prefetch(const step &st, const cursor &c, uint32_t gw, uint32_t W, uint32_t lane)
{
    const op &o = st.ops[c.o];
    const plan p = plan_of(o, gw, W);
    if (lane >= p.RPS)
        return;
    const uint32_t unit = p.u0 + c.s / p.NP, pass = c.s % p.NP, row = unit * p.RPS + lane, g0 = pass * p.L;
    const uint32_t ng = min(p.L, p.G - g0);
    const uint8_t *src = o.w + row * (size_t)(o.K / 32) * 18 + (size_t)g0 * GROUP_BYTES;
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(src), "r"(ng * GROUP_BYTES) : "memory");
}

/* Where chunk c (16 activations) of group gi lies in shared memory: the
 * group's 16 chunks rotated by gi, so the 8 lanes of a 16-byte load phase
 * (consecutive groups, the same c) read 8 different bank quads. */
__device__ __forceinline__ uint32_t act_chunk(uint32_t c, uint32_t gi) { return gi * 16 + ((c + gi) & 15); }

/* One Q4_0 group (8 blocks, 144 bytes read as 36 words) against its 256
 * int8 activations and their 8 scales. */
__device__ __forceinline__ float group_dot(const uint4 *wg, const int4 *a4, uint32_t gi, const float *as)
{
    uint32_t w[36];
#pragma unroll
    for (int i = 0; i < 9; i++) {
        const uint4 v = wg[i];
        w[4 * i] = v.x;
        w[4 * i + 1] = v.y;
        w[4 * i + 2] = v.z;
        w[4 * i + 3] = v.w;
    }
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        /* block j at byte 18 j: its scale, then 16 bytes of nibbles at 18 j + 2 */
        const int b = 18 * j, wi = b / 4;
        const uint32_t dbits = (b % 4) ? (w[wi] >> 16) : (w[wi] & 0xffffu);
        const float d = __half2float(__ushort_as_half((unsigned short)dbits));
        const int4 lo = a4[act_chunk(2 * j, gi)], hi = a4[act_chunk(2 * j + 1, gi)]; /* activations 0-15, 16-31 */
        const int alo[4] = {lo.x, lo.y, lo.z, lo.w}, ahi[4] = {hi.x, hi.y, hi.z, hi.w};
        int isum = 0, asum = 0;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const int nb = b + 2 + 4 * k, nwi = nb / 4;
            const uint32_t q = (nb % 4) ? __funnelshift_r(w[nwi], w[nwi + 1], 16) : w[nwi];
            isum = __dp4a((int)(q & 0x0f0f0f0fu), alo[k], isum);
            isum = __dp4a((int)((q >> 4) & 0x0f0f0f0fu), ahi[k], isum);
            asum = __dp4a(0x01010101, alo[k], asum);
            asum = __dp4a(0x01010101, ahi[k], asum);
        }
        acc = fmaf(d * as[j], (float)(isum - 8 * asum), acc);
    }
    return acc;
}

__device__ __forceinline__ unsigned ld_acquire(const unsigned *p)
{
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}

/* Every CTA of the grid past this point has finished the ops before it and
 * made its outputs visible (the grid is resident: one CTA an SM). */
__device__ void grid_barrier(unsigned *count, unsigned target)
{
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(count, 1u);
        while (ld_acquire(count) < target)
            ;
    }
    __syncthreads();
}

/* step_kernel's modes */
enum { PERSIST = 1, NO_BARRIER = 2, NO_DOT = 4, NO_ACT = 8 };

/* Ops [o_begin, o_end) of the step: PERSIST = grid barriers between them
 * (unless NO_BARRIER); else one op, after griddepcontrol.wait. NO_DOT: the
 * stages are waited for and skipped. NO_ACT: each CTA loads activations
 * for the first op only (no per-op reload and __syncthreads). */
template <int S>
__global__ void __launch_bounds__(512, 1) step_kernel(const step st, uint32_t o_begin, uint32_t o_end, unsigned mode)
{
    extern __shared__ __align__(16) uint8_t smem[];
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const uint32_t W = gridDim.x * st.warps, gw = blockIdx.x * st.warps + warp;
    uint8_t *ring = smem + (size_t)warp * S * 32 * GROUP_BYTES;
    int8_t *act = (int8_t *)(smem + (size_t)st.warps * S * 32 * GROUP_BYTES);
    float *as = (float *)(act + K_MAX);

    cursor ci{o_begin, 0, 0}; /* the next stage to issue */
    {
        const plan p = plan_of(st.ops[o_begin], gw, W);
        ci.n = (p.u1 - p.u0) * p.NP;
    }
    uint32_t issued = 0;
    for (int k = 0; k < S - 1; k++) { /* weights only: no op writes them */
        cursor_settle(ci, st, o_end, gw, W);
        issue(st, ci, o_end, gw, W, ring + (issued % S) * 32 * GROUP_BYTES, lane);
        ci.s++, issued++;
    }
    /* the prefetch cursor: stage `pf` of the warp's sequence, up to the next op in a chain */
    const uint32_t o_pf_end = min(st.n_ops, o_end + 1);
    cursor cp = ci;
    uint32_t pf = issued;
    auto prefetch_to = [&](uint32_t target) {
        for (; pf < target; pf++, cp.s++) {
            cursor_settle(cp, st, o_pf_end, gw, W);
            if (cp.o >= o_pf_end)
                return;
            prefetch(st, cp, gw, W, lane);
        }
    };
    if (st.ahead)
        prefetch_to(issued + st.ahead);
    tkv_pdl_trigger();
    tkv_pdl_wait();
    uint32_t consumed = 0;
    for (uint32_t o = o_begin; o < o_end; o++) {
        if ((mode & PERSIST) && !(mode & NO_BARRIER) && o > o_begin)
            grid_barrier(st.barrier, o * gridDim.x);
        const op &op_ = st.ops[o];
        if (!(mode & NO_ACT) || o == o_begin) {
            const uint32_t K = (mode & NO_ACT) ? K_MAX : op_.K; /* NO_ACT: enough for every op */
            for (uint32_t i = threadIdx.x; i < K / 16; i += blockDim.x)
                ((int4 *)act)[act_chunk(i % 16, i / 16)] = i < op_.K / 16 ? __ldcg((const int4 *)op_.act + i) : int4{};
            for (uint32_t i = threadIdx.x; i < K / 32; i += blockDim.x)
                as[i] = st.ascale[i];
            __syncthreads();
        }
        const plan p = plan_of(op_, gw, W);
        const uint32_t n = (p.u1 - p.u0) * p.NP;
        float acc = 0.0f;
        for (uint32_t s = 0; s < n; s++) {
            cursor_settle(ci, st, o_end, gw, W);
            issue(st, ci, o_end, gw, W, ring + (issued % S) * 32 * GROUP_BYTES, lane);
            ci.s++, issued++;
            if (st.ahead)
                prefetch_to(issued + st.ahead);
            tkv_cp_async_wait<S - 1>();
            __syncwarp();
            const uint32_t unit = p.u0 + s / p.NP, pass = s % p.NP;
            const uint32_t row = unit * p.RPS + lane / p.L, gi = pass * p.L + lane % p.L;
            if (gi < p.G && !(mode & NO_DOT))
                acc += group_dot((const uint4 *)(ring + (consumed % S) * 32 * GROUP_BYTES + lane * GROUP_BYTES),
                                 (const int4 *)act, gi, as + gi * 8);
            __syncwarp();
            consumed++;
            if (pass == p.NP - 1) {
                for (uint32_t m = p.L / 2; m >= 1; m /= 2)
                    acc += __shfl_xor_sync(0xffffffffu, acc, m);
                if (lane % p.L == 0) {
                    op_.outf[row] = acc;
                    op_.out[row] = (int8_t)fmaxf(-127.0f, fminf(127.0f, rintf(acc * 0.05f)));
                }
                acc = 0.0f;
            }
        }
    }
    tkv_cp_async_wait<0>();
}

__global__ void fill_kernel(uint8_t *w, size_t n_blocks, uint32_t seed)
{
    for (size_t b = blockIdx.x * (size_t)blockDim.x + threadIdx.x; b < n_blocks; b += (size_t)gridDim.x * blockDim.x) {
        uint32_t h = (uint32_t)b * 2654435761u ^ seed;
        uint8_t *p = w + b * 18;
        const __half d = __float2half(0.001f + (h % 1000) * 1e-5f);
        memcpy(p, &d, 2);
        for (int i = 0; i < 16; i++) {
            h = h * 1664525u + 1013904223u;
            p[2 + i] = (uint8_t)(h >> 24);
        }
    }
}

int main(int argc, char **argv)
{
    uint32_t warps = 12, stages = 3, layers = 32, reps = 10, shape = 4, ahead = 0;
    const probe_opt opts[] = {{'w', &warps}, {'s', &stages}, {'l', &layers}, {'r', &reps}, {'x', &shape}, {'p', &ahead}};
    if (!probe_options(argc, argv, opts, sizeof opts / sizeof *opts, "[-w warps] [-s stages 2..4] [-l layers] [-r reps] [-x 0..3] [-p stages]"))
        return 2;
    if (stages < 2 || stages > 4 || warps < 1 || warps > 16 || layers < 1 || shape > 4) {
        fprintf(stderr, "persist-probe: bad arguments\n");
        return 2;
    }
    const cudaDeviceProp prop = probe_device();
    const int n_sm = prop.multiProcessorCount;

    auto shape_of = [&](uint32_t i) { return PROBE_SHAPES[shape < 4 ? shape : i % 4]; }; /* op i's */
    size_t layer_bytes = 0;
    for (uint32_t i = 0; i < 4; i++)
        layer_bytes += (size_t)shape_of(i)[0] * (shape_of(i)[1] / 32) * 18;
    const size_t w_bytes = layer_bytes * layers;
    uint8_t *w;
    CK(cudaMalloc(&w, w_bytes));
    fill_kernel<<<4 * n_sm, 256>>>(w, w_bytes / 18, 12345u);
    CK(cudaGetLastError());

    /* outputs: one buffer an op, so no op overwrites what another reads */
    const uint32_t n_ops = 4 * layers;
    int8_t *outs, *input;
    float *outf, *ascale;
    unsigned *barrier;
    CK(cudaMalloc(&outs, (size_t)n_ops * 28672));
    CK(cudaMalloc(&outf, (size_t)n_ops * 28672 * sizeof(float)));
    CK(cudaMalloc(&input, 4096));
    CK(cudaMalloc(&ascale, K_MAX / 32 * sizeof(float)));
    CK(cudaMalloc(&barrier, sizeof(unsigned)));
    std::vector<int8_t> hin(4096);
    for (int i = 0; i < 4096; i++)
        hin[i] = (int8_t)((i * 37) % 201 - 100);
    std::vector<float> hs(K_MAX / 32, 1.0f / 64);
    CK(cudaMemcpy(input, hin.data(), 4096, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(ascale, hs.data(), hs.size() * sizeof(float), cudaMemcpyHostToDevice));

    std::vector<op> hops(n_ops);
    size_t off = 0;
    for (uint32_t i = 0; i < n_ops; i++) {
        op &o = hops[i];
        o.rows = shape_of(i)[0];
        o.K = shape_of(i)[1];
        o.w = w + off;
        off += (size_t)o.rows * (o.K / 32) * 18;
        o.act = i ? outs + (size_t)(i - 1) * 28672 : input;
        o.out = outs + (size_t)i * 28672;
        o.outf = outf + (size_t)i * 28672;
    }
    op *dops;
    CK(cudaMalloc(&dops, n_ops * sizeof(op)));
    CK(cudaMemcpy(dops, hops.data(), n_ops * sizeof(op), cudaMemcpyHostToDevice));

    const size_t smem = (size_t)warps * stages * 32 * GROUP_BYTES + K_MAX + K_MAX / 32 * sizeof(float);
    void (*kern)(const step, uint32_t, uint32_t, unsigned) =
        stages == 2 ? step_kernel<2> : stages == 3 ? step_kernel<3> : step_kernel<4>;
    CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    int per_sm = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, (int)(warps * 32), smem));
    if (per_sm < 1) {
        fprintf(stderr, "persist-probe: %u warps x %u stages (%zu B of shared memory) do not fit an SM\n", warps,
                stages, smem);
        return 1;
    }
    const uint32_t grid = (uint32_t)n_sm * (uint32_t)per_sm; /* all resident: the barrier needs it */
    const step st{dops, n_ops, ascale, barrier, warps, stages, ahead};

    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    auto launch = [&](uint32_t b, uint32_t e, unsigned mode, bool pdl) {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(grid);
        cfg.blockDim = dim3(warps * 32);
        cfg.dynamicSmemBytes = smem;
        cfg.stream = s;
        cudaLaunchAttribute at[1];
        at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        at[0].val.programmaticStreamSerializationAllowed = pdl ? 1 : 0;
        cfg.attrs = at;
        cfg.numAttrs = 1;
        CK(cudaLaunchKernelEx(&cfg, kern, st, b, e, mode));
    };
    /* 0 chain (PDL), 1 chain (no PDL), 2 persist, 3 persist without barriers, 4 persist without arithmetic,
     * 5 persist without barriers or activation reloads */
    const unsigned persist_mode[6] = {0, 0, PERSIST, PERSIST | NO_BARRIER, PERSIST | NO_DOT, PERSIST | NO_BARRIER | NO_ACT};
    auto run = [&](int variant) {
        if (variant >= 2) {
            CK(cudaMemsetAsync(barrier, 0, sizeof(unsigned), s));
            launch(0, n_ops, persist_mode[variant], false);
        } else {
            for (uint32_t o = 0; o < n_ops; o++)
                launch(o, o + 1, 0, variant == 0);
        }
    };

    /* the copy rate: within the weights */
    const double copy_gbs = probe_copy_gbs(s, w, std::min<size_t>(w_bytes / 2, (size_t)1 << 31), reps);

    /* outputs of the chain and the persistent kernel, bit for bit */
    std::vector<float> ref((size_t)n_ops * 28672), got(ref.size());
    CK(cudaMemsetAsync(outf, 0, ref.size() * sizeof(float), s));
    run(1);
    CK(cudaMemcpyAsync(ref.data(), outf, ref.size() * sizeof(float), cudaMemcpyDeviceToHost, s));
    CK(cudaMemsetAsync(outf, 0, ref.size() * sizeof(float), s));
    run(2);
    CK(cudaMemcpyAsync(got.data(), outf, got.size() * sizeof(float), cudaMemcpyDeviceToHost, s));
    CK(cudaStreamSynchronize(s));
    size_t differ = 0;
    for (uint32_t i = 0; i < n_ops; i++)
        differ += memcmp(&ref[(size_t)i * 28672], &got[(size_t)i * 28672], hops[i].rows * sizeof(float)) != 0;

    const char *names[6] = {"chain, PDL", "chain, no PDL", "persist", "persist, no barriers (wrong sums)",
                            "persist, no arithmetic", "persist, no barriers, one activation load (wrong sums)"};
    const double roof_ms = w_bytes / (copy_gbs * 1e9) * 1e3;
    printf("| %s, %d SMs | %u CTAs x %u warps, %u stages, %zu B smem, L2 prefetch %u stages ahead | weights %.3f GB, %u "
           "layers | copy %.0f GB/s |\n",
           prop.name, n_sm, grid, warps, stages, smem, ahead, w_bytes / 1e9, layers, copy_gbs);
    printf("| variant | step ms | us a layer | GB/s | x roofline |\n|---|---:|---:|---:|---:|\n");
    printf("| roofline | %.3f | %.2f | %.0f | 1.00 |\n", roof_ms, roof_ms * 1e3 / layers, copy_gbs);
    for (int variant = 0; variant < 6; variant++) {
        const float ms = probe_time(s, reps, [&] { run(variant); });
        printf("| %s | %.3f | %.2f | %.0f | %.2f |\n", names[variant], ms, ms * 1e3 / layers,
               w_bytes / (ms * 1e-3) / 1e9, ms / roof_ms);
    }
    printf("ops whose outputs differ between chain and persist: %zu of %u\n", differ, n_ops);
    return differ ? 1 : 0;
}
