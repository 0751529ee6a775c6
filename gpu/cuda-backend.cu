/*
 * cuda-backend.cu -- the CUDA implementation of struct tkv_backend_ops: the
 * vtable, device memory, weights, and the one place that turns cudaError_t
 * and cublasStatus_t into tkv_status.
 *
 * Everything runs in order on one non-blocking stream per backend, so ops are
 * asynchronous until download() or synchronize(). Host-side arguments (token
 * ids, positions) travel through a ring of pinned staging slots, each paired
 * with a device buffer and an event that says when the slot's last copy has
 * left the host buffer; an attention call's KV block table has a ring of its
 * own, copied on a second stream (attn.cu, tkv_cuda_attn_run).
 *
 * Weights: matrices are dequantized on the GPU to f16 once at load
 * (dequant.cu) and multiplied with cuBLAS (f16 x f16 -> f32, f32 accumulate)
 * or, for up to 8 tokens, with a GEMV kernel that reads the f32 activations
 * directly; vectors (norm weights) are kept in f32. Q4_0, Q4_1 and Q8_0
 * matrices also keep their GGUF blocks, and for up to 8 tokens the
 * quantized GEMV multiplies those with activations quantized to 8 bits
 * (gemv-quant.cu; TKV_CUDA_GEMV_QUANT=0 when the backend is created: the
 * f16 path instead, =ref: the reference kernel).
 *
 * Validation mode: with TKV_CUDA_WEIGHTS=f32 in the environment when the
 * backend is created, matrices are kept as exact f32 dequantizations and
 * multiplied in f32 (cuBLAS, no TF32): 2x the memory of f16, for measuring
 * what the f16 storage costs (tests/test-gpu-e2e.c), not for serving.
 */
#include "attn.cuh"
#include "common.cuh"
#include "copy.cuh"
#include "dequant.cuh"
#include "gemv-quant.cuh"
#include "kv-table.cuh"
#include "ops.cuh"
#include "rabitq.cuh"
#include "rabitq-select.cuh"
#include "stats.cuh"

extern "C" {
#include "tkv-cuda.h"
#include "../runtime/rabitq/rabitq.h" /* struct tkv_rabitq_query */
}

#include <cublas_v2.h>
#include <stdio.h>
#include <time.h>
#include <stdlib.h>

#define N_STAGE 16                  /* staging slots in the ring               */
#define STAGE_MIN_BYTES (64 << 10)  /* initial size of each slot               */
#define N_GATHER 16                 /* block-upload tables in flight: two layers'
                                       recalls of 4-8 pieces each              */

/* The table of one upload_blocks call: filled on the host, copied to the
 * device and read by the gather kernel (or handed to cudaMemcpyBatchAsync);
 * reused once `ev` (recorded after the copies) has passed. */
struct gather_slot {
    struct tkv_cuda_copy *host;  /* pinned [cap]                              */
    struct tkv_cuda_copy *dev;   /* device [cap]                              */
    void **dsts; const void **srcs; size_t *sizes; /* [cap] for the memcpy path */
    uint32_t cap;
    uint32_t n;                  /* copies of the last use                    */
    uint8_t *bad;                /* the caller's verdicts, filled at upload_wait */
    uint64_t seq;                /* the upload's ticket                       */
    cudaEvent_t ev;
    bool pending;
};

struct stage_slot {
    void *host;      /* pinned [cap] */
    void *dev;       /* device [cap] */
    size_t cap;
    cudaEvent_t ev;  /* recorded after the slot's last host-to-device copy */
    bool pending;
};

/* An op whose output a quantized GEMV may read next: that output (out, dim
 * columns) and the block order gb the GEMV quantized it in last time (0:
 * not yet), so that the op can quantize in its own launch (q8_target). */
struct q8_producer {
    const float *out;
    uint32_t dim, gb;
};

struct cuda_backend {
    struct tkv_backend base;       /* first: ops dispatch on &base */
    int device, n_sm;
    uint32_t smem_sm;              /* shared memory per SM (the quantized GEMV's plan) */
    char pci_bus_id[32];           /* "0000:3b:00.0"                          */
    cudaStream_t stream;
    cublasHandle_t blas;
    struct stage_slot stage[N_STAGE];
    unsigned next_stage;
    __half *act16;                 /* [act16_cap] f16 activations for cuBLAS  */
    size_t act16_cap;              /* elements                                */
    struct tkv_cuda_attn_state *attn; /* block tables, partials (attn.cu)  */
    void *stats_work;              /* [stats_work_cap] attn_stats work memory */
    uint32_t *rq_bad;              /* rabitq_encode's first non-finite row      */
    void *rqs_dev, *rqs_host;      /* rabitq_select: device work, pinned results */
    void *ks_dev;                  /* rabitq_key_sums: [dim] u64 units, [dim] u32 counts */
    size_t rqs_dev_cap, rqs_host_cap; /* bytes                                  */
    struct tkv_cuda_kvt_sync kvt;  /* kv_table's rounds' totals (kv-table.cuh) */
    size_t stats_work_cap;         /* bytes                                   */
    bool f32_weights;              /* TKV_CUDA_WEIGHTS=f32: validation mode   */
    bool f16_rounded;              /* =f16round: f32, holding the f16 values  */
    /* block uploads: a second stream, so recalls and prefetches overlap the
     * compute queued after them until upload_fence */
    cudaStream_t copy_stream;
    cudaEvent_t ev_main, ev_copy;  /* compute -> copy and copy -> compute order */
    struct gather_slot gather[N_GATHER];
    unsigned next_gather;
    uint64_t upload_seq;           /* tickets handed out (upload_blocks calls)  */
    bool uploads_pending;          /* some slot's copies are not waited for yet */
    bool gather_kernel;            /* the device reads registered host memory at
                                      its host address: use the gather kernel;
                                      else (or TKV_CUDA_UPLOAD=memcpy) batched
                                      cudaMemcpy                               */
    bool failed;                   /* a sticky CUDA error: the context is gone */
    char failed_msg[128];
    int gemv;                      /* decode matmul: GEMV_AUTO, or TKV_CUDA_GEMV=fast|ref|cublas|u8 */
    bool pdl;                      /* the decode path's kernels as programmatic
                                      dependent launches (TKV_CUDA_PDL=0: not) */
    bool rqs_mma;                  /* rabitq_select's popcounts of 128-bit codes on the
                                      tensor cores (sm_80 and later, and built for it;
                                      TKV_CUDA_RQS_MMA=0: the scalar kernel, for A/B
                                      measurements) */
    float *fuse_work;              /* [fuse_work_cap bytes] matmul_swiglu's up product off the GEMV path */
    size_t fuse_work_cap;
    /* rope_qk's positions: the last ones uploaded (host copy, pos_n of them)
     * stay in pos_dev, so the layers of one chunk upload them once */
    int32_t *pos_dev, *pos_last;
    uint32_t pos_n, pos_cap;
    /* matmul_qkv_rope's angles of the positions in pos_dev (rope_table):
     * [rope_n][rope_pairs] (cos, sin) for the constants rope_ts, rope_fs;
     * rope_ok is cleared whenever pos_dev changes */
    float2 *rope_tab;
    size_t rope_tab_cap;
    uint32_t rope_n, rope_pairs;
    float rope_ts, rope_fs;
    bool rope_ok;
    struct cuda_prof *prof;        /* TKV_CUDA_PROFILE=1: the op profile, else NULL */
    int gemv_quant;                /* QGEMV_FAST, or TKV_CUDA_GEMV_QUANT=0|ref */
    int qgemv_pairs;               /* PAIRS_AUTO, or TKV_CUDA_GEMV_QUANT=pair|single */
    uint32_t q4p_u, q4p_warps;     /* TKV_CUDA_Q4P=U,WARPS: tkv_cuda_qgemv's (0,0: its rule) */
    void *q8_work;                 /* [q8_work_cap bytes] quantized activations (tkv_cuda_q8_act) */
    size_t q8_work_cap;
    /* The quantized activations an op left in q8_work beside its output (a
     * decode norm, rmsnorm_q8_kernel; the decode attention, attn-decode.cu
     * q8_out): x [n][n_in] in block order gb, valid only for the op right
     * after op number `op` (ops counts every op: ALIVE). Each such op takes
     * the order from the last GEMV that had to quantize its output itself
     * (q8_prepare sets gb of the producer whose out and dim it read). */
    uint64_t ops;
    struct {
        const float *x;
        uint32_t n, n_in, gb;
        uint64_t op;
    } q8_memo;
    struct q8_producer norm_next, attn_next;
    uint64_t q8_reads;             /* q8_prepare calls that found the planes ready */
    bool norm_q8;                  /* TKV_CUDA_NORM_Q8=0: never (for A/B measurements) */
    bool attn_q8;                  /* TKV_CUDA_ATTN_Q8=0: never (for A/B measurements) */
    bool qkv_rope;                 /* matmul_qkv_rope rotates in the GEMV's epilogue
                                      (TKV_CUDA_QKV_ROPE=0: the two ops, for A/B) */
    size_t weight_bytes, weight_raw_bytes; /* device bytes of the weights: all, and the kept GGUF blocks */
};

/* How Q4_0 / Q4_1 / Q8_0 matrices multiply few tokens, from
 * TKV_CUDA_GEMV_QUANT when the backend is created: the quantized GEMV's fast
 * kernel (default; its reference where the fast one cannot take the shape),
 * its reference kernel ("ref"), or not at all ("0": their blocks are not
 * kept and the f16 path of TKV_CUDA_GEMV serves them, for A/B measuring). */
enum { QGEMV_FAST, QGEMV_REF, QGEMV_OFF };

/* Whether the fast kernel's lanes take rows in pairs (struct
 * tkv_cuda_qgemv's pair): by default always for Q4_0 (qgemv_pairs), else
 * for calls of at least QGEMV_PAIR_MIN_BYTES of weights (docs/gpu.md,
 * "Row pairs": on the H200 the staged kernel's pairs gain from the 33 MB
 * FFN matrices up and lose ~0.4-1 us on 2-9 MB ones);
 * TKV_CUDA_GEMV_QUANT=pair always, =single never (A/B measuring). */
enum { PAIRS_AUTO, PAIRS_ALWAYS, PAIRS_NEVER };
#define QGEMV_PAIR_MIN_BYTES ((size_t)16 << 20)

/* How matmul multiplies few tokens (n <= TKV_CUDA_GEMV_MAX_N), chosen with
 * TKV_CUDA_GEMV when the backend is created: "auto" (default, below), the
 * fast GEMV with 4 loads per lane in flight everywhere ("fast"), with 8
 * ("u8"), its reference kernel ("ref"), or cuBLAS as for prefill
 * ("cublas"); the others exist to measure and test the default. */
enum { GEMV_FAST, GEMV_REF, GEMV_CUBLAS, GEMV_U8, GEMV_AUTO };

/* "auto": the fast GEMV per shape, from bench-gemv on the H200: the 8-load
 * kernel for rows of at least GEMV_U8_MIN_IN columns (4096 x 14336, the
 * down matrix: 35.4 us against 39.3), the 4-load one elsewhere; the fused
 * ops run their fused kernels. With PDL, 3.5-3.7% off a llama3-8b decode
 * step on the H200 (docs/benchmarks.md). */
#define GEMV_U8_MIN_IN 8192u


/* Unless TKV_CUDA_PDL=0 when the backend is created (sm_90 and later): the
 * kernels of the decode path (the fast GEMVs, the fused ops, rmsnorm,
 * kv_write_heads, the decode attention kernel) are queued as programmatic
 * dependent launches, so each one's launch and first weight loads overlap
 * the previous kernel's tail (docs/gpu.md "Programmatic dependent launch").
 * Same kernels, same results (test-gpu-backend's pdl section: bit for bit). */

struct tkv_bweight {
    const struct tkv_gguf_tensor *t;
    uint32_t n_in, n_out;
    bool is_vec;   /* 1-D tensor: kept as f32 in v32                       */
    __half *w16;   /* matrices: [n_out, n_in] f16                           */
    float *w32;    /* matrices in the f32 validation mode: [n_out, n_in]    */
    float *v32;    /* vectors:  [n_in] f32                                  */
    void *wq;      /* Q4_0 / Q4_1 / Q8_0 matrices (unless TKV_CUDA_GEMV_QUANT=0
                      or f32 mode): the GGUF blocks, [n_out][n_in / 32] blocks,
                      for the quantized decode GEMV; else NULL              */
    size_t bytes, bytes_wq; /* device bytes of w16 / w32 / v32 + wq, and of wq
                               (counted in the backend's totals once loaded) */
};

static struct cuda_backend *cuda_of(struct tkv_backend *b) { return (struct cuda_backend *)b; }

/* Whether matmul's GEMV takes the 8-load kernel for w. */
static bool gemv_u8_for(int mode, const struct tkv_bweight *w)
{
    return mode == GEMV_U8 || (mode == GEMV_AUTO && w->n_in >= GEMV_U8_MIN_IN);
}

/* ---- errors --------------------------------------------------------------- */

/* Errors after which the CUDA context cannot be used again. */
static bool cuda_sticky(cudaError_t e)
{
    switch (e) {
    case cudaErrorIllegalAddress: case cudaErrorLaunchFailure: case cudaErrorMisalignedAddress:
    case cudaErrorIllegalInstruction: case cudaErrorInvalidAddressSpace: case cudaErrorInvalidPc:
    case cudaErrorHardwareStackError: case cudaErrorLaunchTimeout: case cudaErrorAssert:
    case cudaErrorECCUncorrectable: case cudaErrorContextIsDestroyed: case cudaErrorUnknown:
        return true;
    default:
        return false;
    }
}

static tkv_status cu_fail(struct cuda_backend *cb, cudaError_t e, const char *op, const char *call)
{
    (void)cudaGetLastError(); /* clear a non-sticky error so later calls work */
    if (cb && cuda_sticky(e)) {
        cb->failed = true;
        snprintf(cb->failed_msg, sizeof cb->failed_msg, "%s in %s", cudaGetErrorName(e), op);
    }
    return tkv_err(e == cudaErrorMemoryAllocation ? TKV_ERR_NOMEM : TKV_ERR_DEVICE, "cuda: %s: %s: %s (%s)", op,
                   call, cudaGetErrorName(e), cudaGetErrorString(e));
}

static tkv_status blas_fail(cublasStatus_t s, const char *op)
{
    return tkv_err(s == CUBLAS_STATUS_ALLOC_FAILED ? TKV_ERR_NOMEM : TKV_ERR_DEVICE, "cuda: %s: cuBLAS: %s", op,
                   cublasGetStatusString(s));
}

/* CU(op, call): a failed CUDA call returns its tkv_status from the function. */
#define CU(op, call)                                     \
    do {                                                 \
        cudaError_t cu_e_ = (call);                      \
        if (cu_e_ != cudaSuccess)                        \
            return cu_fail(cb, cu_e_, op, #call);        \
    } while (0)

/* The device this library last made current on this thread (-1: none). */
static thread_local int tkv_cuda_current = -1;

/* Every op starts here: after a sticky error the device is not touched
 * again; otherwise the backend's device becomes current on this thread. */
#define ALIVE(op)                                                                                               \
    do {                                                                                                        \
        cb->ops++;                                                                                              \
        if (cb->failed)                                                                                         \
            return tkv_err(TKV_ERR_DEVICE, "cuda: %s: the device failed earlier (%s); create a new backend", op, \
                           cb->failed_msg);                                                                     \
        if (tkv_cuda_current != cb->device) {                                                                   \
            CU(op, cudaSetDevice(cb->device));                                                                  \
            tkv_cuda_current = cb->device;                                                                      \
        }                                                                                                       \
    } while (0)

/* ---- staging of host-side arguments ---------------------------------------- */

/* Takes the next slot, large enough for bytes; its host buffer is free to
 * write once this returns. */
static tkv_status stage_take(struct cuda_backend *cb, size_t bytes, struct stage_slot **out, const char *op)
{
    struct stage_slot *sl = &cb->stage[cb->next_stage++ % N_STAGE];
    if (sl->pending) {
        CU(op, cudaEventSynchronize(sl->ev));
        sl->pending = false;
    }
    if (bytes > sl->cap) {
        size_t cap = TKV_MAX(bytes, TKV_MAX(2 * sl->cap, (size_t)STAGE_MIN_BYTES));
        /* the old device buffer may still be read by queued kernels */
        CU(op, cudaStreamSynchronize(cb->stream));
        cudaFreeHost(sl->host);
        cudaFree(sl->dev);
        sl->host = sl->dev = NULL;
        sl->cap = 0;
        CU(op, cudaMallocHost(&sl->host, cap));
        CU(op, cudaMalloc(&sl->dev, cap));
        sl->cap = cap;
    }
    *out = sl;
    return TKV_OK;
}

/* Queues the copy of the slot's first bytes to its device buffer. Kernels
 * queued after this on the stream see the data. */
static tkv_status stage_send(struct cuda_backend *cb, struct stage_slot *sl, size_t bytes, const char *op)
{
    CU(op, cudaMemcpyAsync(sl->dev, sl->host, bytes, cudaMemcpyHostToDevice, cb->stream));
    CU(op, cudaEventRecord(sl->ev, cb->stream));
    sl->pending = true;
    return TKV_OK;
}

/* Grows a device work buffer to at least `bytes`, keeping it otherwise. */
static tkv_status work_reserve(struct cuda_backend *cb, void **buf, size_t *cap_bytes, size_t bytes, const char *op)
{
    if (bytes <= *cap_bytes)
        return TKV_OK;
    size_t cap = TKV_MAX(bytes, *cap_bytes + *cap_bytes / 2);
    CU(op, cudaStreamSynchronize(cb->stream));
    cudaFree(*buf);
    *buf = NULL;
    *cap_bytes = 0;
    CU(op, cudaMalloc(buf, cap));
    *cap_bytes = cap;
    return TKV_OK;
}

/* ---- memory ------------------------------------------------------------------ */

static tkv_status cuda_alloc(struct tkv_backend *b, size_t bytes, void **out)
{
    struct cuda_backend *cb = cuda_of(b);
    *out = NULL;
    ALIVE("alloc");
    cudaError_t e = cudaMalloc(out, bytes ? bytes : 1);
    if (e != cudaSuccess) {
        *out = NULL;
        if (e == cudaErrorMemoryAllocation) {
            (void)cudaGetLastError();
            size_t free_b = 0, total_b = 0;
            cudaMemGetInfo(&free_b, &total_b);
            (void)cudaGetLastError();
            return tkv_err(TKV_ERR_NOMEM, "cuda: cannot allocate %zu bytes of device memory (%zu of %zu free)",
                           bytes, free_b, total_b);
        }
        return cu_fail(cb, e, "alloc", "cudaMalloc");
    }
    return TKV_OK;
}

static void cuda_release(struct tkv_backend *b, void *p)
{
    struct cuda_backend *cb = cuda_of(b);
    if (!p)
        return;
    cudaError_t e = cudaFree(p);
    if (e != cudaSuccess) {
        cu_fail(cb, e, "release", "cudaFree");
        TKV_LOG_W("%s", tkv_last_error());
    }
}

/* Returns once src may be reused: a pageable src is staged by the driver
 * before cudaMemcpyAsync returns; a page-locked one (host_register, or
 * cudaMallocHost'ed) is read by the DMA engine later, so we wait for it. */
static tkv_status cuda_upload(struct tkv_backend *b, void *dst, const void *src_host, size_t bytes)
{
    struct cuda_backend *cb = cuda_of(b);
    ALIVE("upload");
    if (!bytes)
        return TKV_OK;
    CU("upload", cudaMemcpyAsync(dst, src_host, bytes, cudaMemcpyHostToDevice, cb->stream));
    cudaPointerAttributes attr;
    if (cudaPointerGetAttributes(&attr, src_host) == cudaSuccess && attr.type == cudaMemoryTypeHost)
        CU("upload", cudaStreamSynchronize(cb->stream));
    (void)cudaGetLastError();
    return TKV_OK;
}

static tkv_status cuda_copy(struct tkv_backend *b, void *dst, const void *src, size_t bytes)
{
    struct cuda_backend *cb = cuda_of(b);
    ALIVE("copy");
    if (!bytes)
        return TKV_OK;
    CU("copy", cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, cb->stream));
    return TKV_OK;
}

static tkv_status cuda_download(struct tkv_backend *b, void *dst_host, const void *src, size_t bytes)
{
    struct cuda_backend *cb = cuda_of(b);
    ALIVE("download");
    if (bytes)
        CU("download", cudaMemcpyAsync(dst_host, src, bytes, cudaMemcpyDeviceToHost, cb->stream));
    CU("download", cudaStreamSynchronize(cb->stream));
    return TKV_OK;
}

/* One stream-ordered copy per block, one wait for all (a download per
 * block waited ~10 us each: the KV store's spills of dirty blocks). */
static tkv_status cuda_download_blocks(struct tkv_backend *b, void *const *dst_host, const void *const *src, uint32_t n,
                                       size_t bytes)
{
    struct cuda_backend *cb = cuda_of(b);
    ALIVE("download_blocks");
    for (uint32_t j = 0; j < n && bytes; j++)
        CU("download_blocks", cudaMemcpyAsync(dst_host[j], src[j], bytes, cudaMemcpyDeviceToHost, cb->stream));
    CU("download_blocks", cudaStreamSynchronize(cb->stream));
    return TKV_OK;
}

static const char *cuda_pci_bus_id(struct tkv_backend *b)
{
    struct cuda_backend *cb = cuda_of(b);
    return cb->pci_bus_id[0] ? cb->pci_bus_id : NULL;
}

static tkv_status cuda_host_register(struct tkv_backend *b, void *p, size_t bytes)
{
    struct cuda_backend *cb = cuda_of(b);
    ALIVE("host_register");
    /* mapped: the gather kernel reads it at its host address */
    CU("host_register", cudaHostRegister(p, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable));
    return TKV_OK;
}

static void cuda_host_unregister(struct tkv_backend *b, void *p)
{
    struct cuda_backend *cb = cuda_of(b);
    if (!p)
        return;
    cudaError_t e = cudaHostUnregister(p);
    if (e != cudaSuccess) {
        cu_fail(cb, e, "host_unregister", "cudaHostUnregister");
        TKV_LOG_W("%s", tkv_last_error());
    }
}

/* ---- asynchronous block uploads ------------------------------------------ */

/* A slot's copies have finished: hand its verdicts to the caller. */
static void gather_slot_done(struct gather_slot *sl)
{
    if (sl->bad)
        for (uint32_t j = 0; j < sl->n; j++)
            sl->bad[j] = (uint8_t)(sl->host[j].bad != 0);
    sl->bad = NULL;
    sl->pending = false;
}

/* Completes slot sl's previous use (block) or reports whether it is done. */
static tkv_status gather_slot_finish(struct cuda_backend *cb, struct gather_slot *sl, bool block, bool *done)
{
    const char *op = "upload_wait";
    *done = true;
    if (!sl->pending)
        return TKV_OK;
    if (block) {
        CU(op, cudaEventSynchronize(sl->ev));
    } else {
        cudaError_t e = cudaEventQuery(sl->ev);
        if (e == cudaErrorNotReady) {
            (void)cudaGetLastError();
            *done = false;
            return TKV_OK;
        }
        CU(op, e);
    }
    gather_slot_done(sl);
    return TKV_OK;
}

/* Makes sure slot sl can hold n copies (after its previous use completed). */
static tkv_status gather_slot_take(struct cuda_backend *cb, uint32_t n, struct gather_slot **out)
{
    const char *op = "upload_blocks";
    struct gather_slot *sl = &cb->gather[cb->next_gather++ % N_GATHER];
    bool done;
    TKV_TRY(gather_slot_finish(cb, sl, true, &done));
    if (n > sl->cap) {
        uint32_t cap = TKV_MAX(n, TKV_MAX(2 * sl->cap, 1024u));
        cudaFreeHost(sl->host);
        cudaFree(sl->dev);
        free(sl->dsts);
        free(sl->srcs);
        free(sl->sizes);
        memset(sl, 0, offsetof(struct gather_slot, n));
        CU(op, cudaMallocHost(&sl->host, cap * sizeof *sl->host));
        CU(op, cudaMalloc(&sl->dev, cap * sizeof *sl->dev));
        sl->dsts = (void **)malloc(cap * sizeof *sl->dsts);
        sl->srcs = (const void **)malloc(cap * sizeof *sl->srcs);
        sl->sizes = (size_t *)malloc(cap * sizeof *sl->sizes);
        if (!sl->dsts || !sl->srcs || !sl->sizes)
            return tkv_err(TKV_ERR_NOMEM, "cuda: upload_blocks: out of host memory for %u copies", cap);
        sl->cap = cap;
    }
    *out = sl;
    return TKV_OK;
}

static tkv_status cuda_upload_blocks(struct tkv_backend *b, void *const *dst, const void *const *src, uint32_t n,
                                     size_t bytes, const uint32_t *crc, uint8_t *bad, uint64_t *ticket)
{
    struct cuda_backend *cb = cuda_of(b);
    const char *op = "upload_blocks";
    if (ticket)
        *ticket = 0;
    ALIVE(op);
    if (crc && !tkv_cuda_verify_ok(bytes))
        return tkv_err(TKV_ERR_UNSUPPORTED, "cuda: upload_blocks: cannot verify blocks of %zu bytes on the device "
                                            "(a multiple of 4096 is needed)", bytes);
    if (n == 0 || bytes == 0)
        return TKV_OK;
    struct gather_slot *sl;
    TKV_TRY(gather_slot_take(cb, n, &sl));
    bool kernel = cb->gather_kernel;
    for (uint32_t j = 0; j < n; j++) {
        sl->host[j] = (struct tkv_cuda_copy){src[j], dst[j], crc ? crc[j] : 0u, 0u};
        kernel = kernel && tkv_cuda_gather_ok(src[j], dst[j], bytes);
    }
    sl->n = n;
    /* the copies come after everything queued so far on the compute stream
     * (a destination slot may still be read there) */
    CU(op, cudaEventRecord(cb->ev_main, cb->stream));
    CU(op, cudaStreamWaitEvent(cb->copy_stream, cb->ev_main, 0));
    if (kernel || crc)
        CU(op, cudaMemcpyAsync(sl->dev, sl->host, n * sizeof *sl->host, cudaMemcpyHostToDevice, cb->copy_stream));
    if (kernel) {
        CU(op, tkv_cuda_gather(sl->dev, n, bytes, cb->copy_stream));
    } else {
        for (uint32_t j = 0; j < n; j++) {
            sl->dsts[j] = dst[j];
            sl->srcs[j] = src[j];
            sl->sizes[j] = bytes;
        }
        struct cudaMemcpyAttributes attr;
        memset(&attr, 0, sizeof attr);
        attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
        attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
        size_t attr_idx = 0;
        cudaError_t e = cudaMemcpyBatchAsync(sl->dsts, (const void *const *)sl->srcs, sl->sizes, n, &attr, &attr_idx,
                                             1, cb->copy_stream);
        if (e == cudaErrorNotSupported || e == cudaErrorInvalidValue) { /* older driver: one copy each */
            (void)cudaGetLastError();
            for (uint32_t j = 0; j < n; j++)
                CU(op, cudaMemcpyAsync(dst[j], src[j], bytes, cudaMemcpyHostToDevice, cb->copy_stream));
        } else if (e != cudaSuccess) {
            return cu_fail(cb, e, op, "cudaMemcpyBatchAsync");
        }
    }
    if (crc) { /* check what landed; the verdicts come back with the table */
        CU(op, tkv_cuda_verify(sl->dev, n, bytes, cb->copy_stream));
        CU(op, cudaMemcpyAsync(sl->host, sl->dev, n * sizeof *sl->host, cudaMemcpyDeviceToHost, cb->copy_stream));
        sl->bad = bad;
    }
    CU(op, cudaEventRecord(sl->ev, cb->copy_stream));
    sl->seq = ++cb->upload_seq;
    sl->pending = true;
    cb->uploads_pending = true;
    if (ticket)
        *ticket = sl->seq;
    return TKV_OK;
}

/* The pending slot of the latest upload numbered at most upto, or NULL.
 * Slot events are recorded on the copy stream in ticket order, so waiting
 * for this one covers every earlier upload; a slot reused since held an
 * upload the host already waited for (gather_slot_take). */
static struct gather_slot *latest_pending(struct cuda_backend *cb, uint64_t upto)
{
    struct gather_slot *last = NULL;
    for (int i = 0; i < N_GATHER; i++) {
        struct gather_slot *sl = &cb->gather[i];
        if (sl->pending && sl->seq <= upto && (!last || sl->seq > last->seq))
            last = sl;
    }
    return last;
}

static tkv_status cuda_upload_fence(struct tkv_backend *b, uint64_t upto)
{
    struct cuda_backend *cb = cuda_of(b);
    ALIVE("upload_fence");
    const struct gather_slot *sl = cb->uploads_pending ? latest_pending(cb, upto) : NULL;
    if (sl)
        CU("upload_fence", cudaStreamWaitEvent(cb->stream, sl->ev, 0));
    return TKV_OK;
}

static tkv_status cuda_upload_wait(struct tkv_backend *b, uint64_t upto, bool block, bool *done)
{
    struct cuda_backend *cb = cuda_of(b);
    ALIVE("upload_wait");
    if (done)
        *done = true;
    if (!cb->uploads_pending)
        return TKV_OK;
    bool all = true, pending = false;
    for (int i = 0; i < N_GATHER; i++) {
        struct gather_slot *sl = &cb->gather[i];
        if (sl->pending && sl->seq <= upto) {
            bool d;
            TKV_TRY(gather_slot_finish(cb, sl, block, &d));
            all = all && d;
        }
        pending = pending || sl->pending;
    }
    if (done)
        *done = all;
    cb->uploads_pending = pending;
    return TKV_OK;
}

static tkv_status cuda_sync(struct tkv_backend *b)
{
    struct cuda_backend *cb = cuda_of(b);
    ALIVE("synchronize");
    CU("synchronize", cudaStreamSynchronize(cb->stream));
    if (cb->uploads_pending) /* copies not fenced into the stream yet */
        TKV_TRY(cuda_upload_wait(b, TKV_UPLOADS_ALL, true, NULL));
    return TKV_OK;
}

/* ---- weights ------------------------------------------------------------------- */

static void cuda_weight_free(struct tkv_backend *b, struct tkv_bweight *w)
{
    if (!w)
        return;
    cuda_release(b, w->w16);
    cuda_release(b, w->w32);
    cuda_release(b, w->v32);
    cuda_release(b, w->wq);
    struct cuda_backend *cb = cuda_of(b);
    cb->weight_bytes -= w->bytes;
    cb->weight_raw_bytes -= w->bytes_wq;
    free(w);
}

static tkv_status weight_load(struct cuda_backend *cb, const struct tkv_gguf_tensor *t, struct tkv_bweight *w,
                              size_t n_elems, size_t raw_bytes, void **raw)
{
    const char *op = "weight_init";
    const size_t stored = n_elems * (w->is_vec || cb->f32_weights ? sizeof(float) : sizeof(__half));
    if (w->is_vec)
        CU(op, cudaMalloc((void **)&w->v32, stored));
    else if (cb->f32_weights)
        CU(op, cudaMalloc((void **)&w->w32, stored));
    else
        CU(op, cudaMalloc((void **)&w->w16, stored));
    size_t kept = 0;
    /* the quantized GEMV's copy: the blocks as uploaded, or packed (Q4_0:
     * tkv_cuda_q4_0_pack, from the blocks uploaded to raw); rounded up to
     * 16 bytes: the staged kernel copies whole 16-byte chunks */
    const bool keep = w->w16 && cb->gemv_quant != QGEMV_OFF && tkv_cuda_qgemv_supported(t->type);
    if (keep) {
        kept = (raw_bytes + 15) / 16 * 16;
        CU(op, cudaMalloc(&w->wq, kept));
        CU(op, cudaMemsetAsync((uint8_t *)w->wq + raw_bytes, 0, kept - raw_bytes, cb->stream));
        void *blocks = w->wq;
        if (t->type == TKV_TYPE_Q4_0) {
            CU(op, cudaMalloc(raw, raw_bytes));
            blocks = *raw;
        }
        CU(op, cudaMemcpyAsync(blocks, t->data, raw_bytes, cudaMemcpyHostToDevice, cb->stream));
        CU(op, tkv_cuda_dequant(t->type, blocks, n_elems, w->w16, NULL, cb->stream));
        if (t->type == TKV_TYPE_Q4_0)
            CU(op, tkv_cuda_q4_0_pack(blocks, w->wq, n_elems / 32, cb->stream));
    } else if (t->type == TKV_TYPE_F16 && w->w16) { /* already the storage format */
        CU(op, cudaMemcpyAsync(w->w16, t->data, raw_bytes, cudaMemcpyHostToDevice, cb->stream));
    } else {
        CU(op, cudaMalloc(raw, raw_bytes));
        CU(op, cudaMemcpyAsync(*raw, t->data, raw_bytes, cudaMemcpyHostToDevice, cb->stream));
        CU(op, cb->f16_rounded && w->w32 ? tkv_cuda_dequant_f16_rounded(t->type, *raw, n_elems, w->w32, cb->stream)
                                         : tkv_cuda_dequant(t->type, *raw, n_elems, w->w16,
                                                            w->is_vec ? w->v32 : w->w32, cb->stream));
    }
    CU(op, cudaStreamSynchronize(cb->stream));
    w->bytes = stored + kept;
    w->bytes_wq = kept;
    cb->weight_bytes += w->bytes;
    cb->weight_raw_bytes += kept;
    if (keep)
        TKV_LOG_D("cuda: %s: %zu bytes of %s blocks kept beside the f16 copy for the decode GEMV (weights: %.1f MiB, "
                  "%.1f MiB of them blocks)", t->name, kept, tkv_type_name(t->type),
                  cb->weight_bytes / 1048576.0, cb->weight_raw_bytes / 1048576.0);
    return TKV_OK;
}

static tkv_status cuda_weight_init(struct tkv_backend *b, const struct tkv_gguf_tensor *t, struct tkv_bweight **out)
{
    struct cuda_backend *cb = cuda_of(b);
    *out = NULL;
    ALIVE("weight_init");
    const struct tkv_type_traits *tr = tkv_type_traits(t->type);
    if (!tr || !tr->weights_ok || !tkv_cuda_dequant_supported(t->type))
        return tkv_err(TKV_ERR_UNSUPPORTED, "cuda: unsupported type %s in tensor %s", tkv_type_name(t->type), t->name);
    if (t->n_dims < 1 || t->n_dims > 2 || t->ne[0] < 1 || t->ne[0] > UINT32_MAX || t->ne[1] < 1 ||
        t->ne[1] > UINT32_MAX || t->ne[0] % tr->block_elems != 0)
        return tkv_err(TKV_ERR_UNSUPPORTED, "cuda: tensor %s is not a matrix or vector of whole %s blocks", t->name,
                       tr->name);
    const size_t n_in = (size_t)t->ne[0], n_out = t->n_dims == 2 ? (size_t)t->ne[1] : 1, n_elems = n_in * n_out;
    const size_t raw_bytes = n_elems / tr->block_elems * tr->block_bytes;
    if (!t->data || raw_bytes > t->nbytes)
        return tkv_err(TKV_ERR_INVALID_ARG, "cuda: tensor %s has %llu bytes of data, %zu expected", t->name,
                       (unsigned long long)t->nbytes, raw_bytes);
    struct tkv_bweight *w = (struct tkv_bweight *)calloc(1, sizeof *w);
    if (!w)
        return tkv_err(TKV_ERR_NOMEM, "cuda: out of memory");
    w->t = t;
    w->n_in = (uint32_t)n_in;
    w->n_out = (uint32_t)n_out;
    w->is_vec = t->n_dims == 1;
    void *raw = NULL;
    tkv_status st = weight_load(cb, t, w, n_elems, raw_bytes, &raw);
    if (raw)
        cudaFree(raw);
    if (st != TKV_OK) {
        cuda_weight_free(b, w);
        return st;
    }
    *out = w;
    return TKV_OK;
}

/* ---- ops -------------------------------------------------------------------------- */

static tkv_status cuda_get_rows(struct tkv_backend *b, const struct tkv_bweight *w, const int32_t *ids, uint32_t n,
                                float *out)
{
    struct cuda_backend *cb = cuda_of(b);
    const char *op = "get_rows";
    ALIVE(op);
    if (w->is_vec)
        return tkv_err(TKV_ERR_INVALID_ARG, "cuda: get_rows: %s is not a matrix", w->t->name);
    for (uint32_t i = 0; i < n; i++)
        if (ids[i] < 0 || (uint32_t)ids[i] >= w->n_out)
            return tkv_err(TKV_ERR_INVALID_ARG, "cuda: token id %d out of range [0, %u) for %s", ids[i], w->n_out,
                           w->t->name);
    if (n == 0)
        return TKV_OK;
    struct stage_slot *sl;
    TKV_TRY(stage_take(cb, (size_t)n * sizeof(int32_t), &sl, op));
    memcpy(sl->host, ids, (size_t)n * sizeof(int32_t));
    TKV_TRY(stage_send(cb, sl, (size_t)n * sizeof(int32_t), op));
    if (w->w32)
        CU(op, tkv_cuda_get_rows_f32(w->w32, w->n_in, (const int32_t *)sl->dev, n, out, cb->stream));
    else
        CU(op, tkv_cuda_get_rows_f16(w->w16, w->n_in, (const int32_t *)sl->dev, n, out, cb->stream));
    return TKV_OK;
}

/* ---- the quantized decode GEMV (gemv-quant.cu) ---- */

/* Which quantized kernel matmul runs for w and n tokens: QGEMV_FAST,
 * QGEMV_REF, or QGEMV_OFF when w is multiplied in f16 / f32 (no blocks
 * kept, or n > TKV_CUDA_GEMV_MAX_N: prefill). */
static int qgemv_path(const struct cuda_backend *cb, const struct tkv_bweight *w, uint32_t n)
{
    if (!w->wq || n < 1 || n > TKV_CUDA_GEMV_MAX_N)
        return QGEMV_OFF;
    return cb->gemv_quant == QGEMV_FAST && tkv_cuda_qgemv_fast_ok(w->t->type, w->wq, w->n_in) ? QGEMV_FAST
                                                                                               : QGEMV_REF;
}

/* x [n][n_in] -> the backend's quantized-activation buffer (grown on demand,
 * kept), in the block order of the GEMVs of `type` (tkv_cuda_q8_order).
 * Queued after whatever reads the buffer: those kernels end before this one
 * writes it (stream order; under PDL its griddepcontrol.wait). */
static tkv_status q8_prepare(struct cuda_backend *cb, uint32_t type, const float *x, uint32_t n, uint32_t n_in,
                             struct tkv_cuda_q8_act *a, const char *op)
{
    const uint32_t gb = tkv_cuda_q8_order(type, n_in);
    const bool ready = cb->q8_memo.op + 1 == cb->ops && cb->q8_memo.x == x && cb->q8_memo.n == n &&
                       cb->q8_memo.n_in == n_in && cb->q8_memo.gb == gb;
    cb->q8_memo.x = NULL;
    struct q8_producer *const prod[2] = {&cb->norm_next, &cb->attn_next};
    for (int i = 0; i < 2; i++)
        if (x == prod[i]->out && n_in == prod[i]->dim) /* it quantizes in this order next time */
            prod[i]->gb = gb;
    TKV_TRY(work_reserve(cb, &cb->q8_work, &cb->q8_work_cap, tkv_cuda_q8_act_bytes(n, n_in), op));
    *a = tkv_cuda_q8_act_at(cb->q8_work, n, n_in, gb);
    if (ready)
        cb->q8_reads++;
    else
        CU(op, tkv_cuda_q8_quantize(x, n, n_in, *a, cb->pdl, cb->stream));
    return TKV_OK;
}

/* Whether producer p, about to write y [n][dim], should also quantize it:
 * *on, with the planes in *a, when a quantized GEMV read p's output of this
 * shape last time and n fits the GEMVs; a new output or shape starts over. */
static tkv_status q8_target(struct cuda_backend *cb, struct q8_producer *p, const float *y, uint32_t n, uint32_t dim,
                            struct tkv_cuda_q8_act *a, bool *on, const char *op)
{
    *on = false;
    if (y != p->out || dim != p->dim) {
        p->out = y, p->dim = dim, p->gb = 0;
        return TKV_OK;
    }
    if (!p->gb || n > TKV_CUDA_GEMV_MAX_N || dim % 32 || (dim / 32) % p->gb)
        return TKV_OK;
    TKV_TRY(work_reserve(cb, &cb->q8_work, &cb->q8_work_cap, tkv_cuda_q8_act_bytes(n, dim), op));
    *a = tkv_cuda_q8_act_at(cb->q8_work, n, dim, p->gb);
    *on = true;
    return TKV_OK;
}

/* After a producer's launch that quantized y into a: the very next op may read the planes. */
static void q8_memo_set(struct cuda_backend *cb, const float *y, uint32_t n, uint32_t dim, uint32_t gb)
{
    cb->q8_memo.x = y;
    cb->q8_memo.n = n;
    cb->q8_memo.n_in = dim;
    cb->q8_memo.gb = gb;
    cb->q8_memo.op = cb->ops;
}

/* One descriptor for the grouped GEMVs' grid over the rows of w[0 .. nw-1]
 * (end[i] = their rows so far), with each weight's copy that kernel reads:
 * f16 (struct tkv_cuda_gemv_group) or the GGUF blocks (struct
 * tkv_cuda_qgemv; its swiglu fields left unset). */
static void group_weight(const __half **slot, const struct tkv_bweight *w) { *slot = w->w16; }
static void group_weight(const void **slot, const struct tkv_bweight *w) { *slot = w->wq; }
template <typename G>
static void group_build(G *g, const struct tkv_bweight *const *w, uint32_t nw, float *const *y)
{
    memset(g, 0, sizeof *g);
    g->nw = nw;
    for (uint32_t i = 0, end = 0; i < nw; i++) {
        group_weight(&g->w[i], w[i]);
        g->y[i] = y[i];
        g->end[i] = end += w[i]->n_out;
    }
}

/* Whether one quantized GEMV call over w[0 .. nw-1] takes rows in pairs:
 * by default always for Q4_0 (the packed kernel: gpu/probe/packed-probe.cu
 * measured pairs faster on every Llama-3-8B shape), else from
 * QGEMV_PAIR_MIN_BYTES of weights. */
static bool qgemv_pairs(const struct cuda_backend *cb, const struct tkv_bweight *const *w, uint32_t nw)
{
    size_t bytes = 0;
    for (uint32_t i = 0; i < nw; i++)
        bytes += w[i]->bytes_wq;
    const bool by_default = w[0]->t->type == TKV_TYPE_Q4_0 || bytes >= QGEMV_PAIR_MIN_BYTES;
    return cb->qgemv_pairs == PAIRS_ALWAYS || (cb->qgemv_pairs == PAIRS_AUTO && by_default);
}

/* The fast kernel over g on the backend's device and stream. */
static tkv_status qgemv_run(struct cuda_backend *cb, uint32_t type, struct tkv_cuda_qgemv *g, struct tkv_cuda_q8_act a,
                            uint32_t n_in, uint32_t n, const char *op)
{
    g->q4p_u = cb->q4p_u;
    g->q4p_warps = cb->q4p_warps;
    CU(op, tkv_cuda_qgemv(type, g, a, n_in, n, (uint32_t)cb->n_sm, cb->smem_sm, cb->pdl, cb->stream));
    return TKV_OK;
}

/* y = x . w^T on the quantized path (add: y += it; the fast kernel only) */
static tkv_status qgemv_matmul(struct cuda_backend *cb, const struct tkv_bweight *w, const float *x, float *y,
                               uint32_t n, int path, bool add, const char *op)
{
    struct tkv_cuda_q8_act a;
    TKV_TRY(q8_prepare(cb, w->t->type, x, n, w->n_in, &a, op));
    if (path == QGEMV_REF) {
        CU(op, tkv_cuda_qgemv_ref(w->t->type, w->wq, a, y, w->n_in, w->n_out, n, cb->stream));
        return TKV_OK;
    }
    struct tkv_cuda_qgemv g;
    group_build(&g, &w, 1, &y);
    g.pair = qgemv_pairs(cb, &w, 1);
    g.acc = add;
    return qgemv_run(cb, w->t->type, &g, a, w->n_in, n, op);
}

/* The ways matmul_run multiplies, in the order of the op profile's rows
 * (matmul_path_name). */
enum matmul_path {
    MP_GEMV,       /* the f16 GEMV (gemv2_kernel)                  */
    MP_GEMV_REF,   /* its reference (TKV_CUDA_GEMV=ref)             */
    MP_CUBLAS,     /* x to f16, then cublasGemmEx                   */
    MP_CUBLAS_F32, /* the f32 validation mode                       */
    MP_GEMV_U8,    /* the f16 GEMV with 8 loads a lane              */
    MP_GEMV_Q4_0,  /* the quantized GEMV, by weight type ...        */
    MP_GEMV_Q4_1,
    MP_GEMV_Q8_0,
    MP_GEMV_QREF,  /* ... and its reference                         */
};

/* The quantized GEMV's path for w's type. */
static enum matmul_path qgemv_fast_path(const struct tkv_bweight *w)
{
    return w->t->type == TKV_TYPE_Q4_0 ? MP_GEMV_Q4_0 : w->t->type == TKV_TYPE_Q4_1 ? MP_GEMV_Q4_1 : MP_GEMV_Q8_0;
}

/* matmul_run's path for w, x and n tokens. */
static enum matmul_path matmul_path(const struct cuda_backend *cb, const struct tkv_bweight *w, const float *x,
                                    uint32_t n)
{
    if (w->w32)
        return MP_CUBLAS_F32;
    switch (qgemv_path(cb, w, n)) { /* QGEMV_OFF for vectors */
    case QGEMV_FAST: return qgemv_fast_path(w);
    case QGEMV_REF: return MP_GEMV_QREF;
    default: break;
    }
    if (cb->gemv == GEMV_CUBLAS || !tkv_cuda_gemv_ok(w->w16, x, w->n_in, n))
        return MP_CUBLAS;
    return cb->gemv == GEMV_REF ? MP_GEMV_REF : gemv_u8_for(cb->gemv, w) ? MP_GEMV_U8 : MP_GEMV;
}

/* matmul and matmul_add: y = x . w^T, or y += it (add). The fast GEMVs (f16
 * and quantized) add in their epilogue, y + x rounded once as the add
 * kernel does; every other path multiplies into a work buffer, then adds. */
static tkv_status matmul_run(struct cuda_backend *cb, const struct tkv_bweight *w, const float *x, float *y,
                             uint32_t n, bool add, const char *op)
{
    const enum matmul_path path = matmul_path(cb, w, x, n);
    const bool epilogue = path == MP_GEMV || path == MP_GEMV_U8 || path == MP_GEMV_Q4_0 || path == MP_GEMV_Q4_1 ||
                          path == MP_GEMV_Q8_0;
    if (add && !epilogue) {
        const size_t count = (size_t)n * w->n_out;
        TKV_TRY(work_reserve(cb, (void **)&cb->fuse_work, &cb->fuse_work_cap, count * sizeof(float), op));
        TKV_TRY(matmul_run(cb, w, x, cb->fuse_work, n, false, op));
        CU(op, tkv_cuda_add(y, cb->fuse_work, count, cb->stream));
        return TKV_OK;
    }
    const float one = 1.0f, zero = 0.0f;
    cublasStatus_t s;
    switch (path) {
    case MP_CUBLAS_F32: /* plain f32 (the handle's default math mode has no TF32) */
        s = cublasGemmEx(cb->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)w->n_out, (int)n, (int)w->n_in, &one, w->w32,
                         CUDA_R_32F, (int)w->n_in, x, CUDA_R_32F, (int)w->n_in, &zero, y, CUDA_R_32F, (int)w->n_out,
                         CUBLAS_COMPUTE_32F_PEDANTIC, CUBLAS_GEMM_DEFAULT);
        return s == CUBLAS_STATUS_SUCCESS ? TKV_OK : blas_fail(s, op);
    case MP_GEMV_QREF: return qgemv_matmul(cb, w, x, y, n, QGEMV_REF, add, op);
    case MP_GEMV_Q4_0:
    case MP_GEMV_Q4_1:
    case MP_GEMV_Q8_0: return qgemv_matmul(cb, w, x, y, n, QGEMV_FAST, add, op);
    case MP_GEMV_REF: CU(op, tkv_cuda_gemv_f16_ref(w->w16, x, y, w->n_in, w->n_out, n, cb->stream)); return TKV_OK;
    case MP_GEMV_U8:
        CU(op, tkv_cuda_gemv_f16_u8(w->w16, x, y, w->n_in, w->n_out, n, (uint32_t)cb->n_sm, add, cb->pdl, cb->stream));
        return TKV_OK;
    case MP_GEMV:
        CU(op, tkv_cuda_gemv_f16(w->w16, x, y, w->n_in, w->n_out, n, (uint32_t)cb->n_sm, add, cb->pdl, cb->stream));
        return TKV_OK;
    case MP_CUBLAS: break;
    }
    const size_t count = (size_t)n * w->n_in;
    TKV_TRY(work_reserve(cb, (void **)&cb->act16, &cb->act16_cap, count * sizeof(__half), op));
    CU(op, tkv_cuda_f32_to_f16(x, cb->act16, count, cb->stream));
    /* column-major view: y^T[n_out, n] = W[n_in, n_out]^T . x^T[n_in, n] */
    s = cublasGemmEx(cb->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)w->n_out, (int)n, (int)w->n_in, &one, w->w16,
                     CUDA_R_16F, (int)w->n_in, cb->act16, CUDA_R_16F, (int)w->n_in, &zero, y, CUDA_R_32F,
                     (int)w->n_out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    return s == CUBLAS_STATUS_SUCCESS ? TKV_OK : blas_fail(s, op);
}

static tkv_status cuda_matmul(struct tkv_backend *b, const struct tkv_bweight *w, const float *x, float *y, uint32_t n)
{
    struct cuda_backend *cb = cuda_of(b);
    const char *op = "matmul";
    ALIVE(op);
    if (w->is_vec)
        return tkv_err(TKV_ERR_INVALID_ARG, "cuda: matmul: %s is not a matrix", w->t->name);
    return n == 0 ? TKV_OK : matmul_run(cb, w, x, y, n, false, op);
}

static tkv_status cuda_matmul_add(struct tkv_backend *b, const struct tkv_bweight *w, const float *x, float *y,
                                  uint32_t n)
{
    struct cuda_backend *cb = cuda_of(b);
    const char *op = "matmul_add";
    ALIVE(op);
    if (w->is_vec)
        return tkv_err(TKV_ERR_INVALID_ARG, "cuda: matmul_add: %s is not a matrix", w->t->name);
    return n == 0 ? TKV_OK : matmul_run(cb, w, x, y, n, true, op);
}

/* ---- fused decode ops (optional members; docs/gpu.md "Fused decode ops") ---- */

/* Whether the fast GEMV serves w for x and n tokens (else matmul's cuBLAS,
 * reference or f32 paths, which the fused ops then run one by one). */
static bool fast_gemv(const struct cuda_backend *cb, const struct tkv_bweight *w, const float *x, uint32_t n)
{
    return (cb->gemv == GEMV_FAST || cb->gemv == GEMV_AUTO) && w->w16 && tkv_cuda_gemv_ok(w->w16, x, w->n_in, n);
}

/* How a grouped op (matmul_group over w[0..nw), matmul_swiglu over {gate,
 * up}) runs: one quantized-GEMV grid when every weight takes the quantized
 * fast kernel with one type; one f16 grid when none is quantized and every
 * one takes the fast f16 GEMV; else the sequence of matmuls. The op and its
 * profile row both ask here. */
enum { GROUP_QUANT, GROUP_F16, GROUP_SEQ };
static int group_path(const struct cuda_backend *cb, const struct tkv_bweight *const *w, uint32_t nw, const float *x,
                      uint32_t n)
{
    if (nw == 0 || nw > TKV_CUDA_GEMV_GROUP_MAX)
        return GROUP_SEQ;
    bool quant = false, qfast = true, fast = true;
    uint64_t rows = 0;
    for (uint32_t i = 0; i < nw; i++) {
        const int p = qgemv_path(cb, w[i], n); /* QGEMV_OFF for vectors: no blocks kept */
        quant = quant || p != QGEMV_OFF;
        qfast = qfast && p == QGEMV_FAST && w[i]->t->type == w[0]->t->type;
        fast = fast && fast_gemv(cb, w[i], x, n);
        rows += w[i]->n_out;
    }
    if (rows > UINT32_MAX) /* a grid's row count */
        return GROUP_SEQ;
    return quant ? (qfast ? GROUP_QUANT : GROUP_SEQ) : fast ? GROUP_F16 : GROUP_SEQ;
}

/* group_path's GROUP_QUANT: the quantized GEMV over w[0 .. nw-1] into
 * y[i], rows in pairs as qgemv_pairs says. rope (NULL: none): the angle
 * table (rope_table) with which the epilogue rotates the first two
 * weights' outputs (q and k: heads of head_dim, n_pairs pairs each). */
static tkv_status group_qgemv(struct cuda_backend *cb, const struct tkv_bweight *const *w, uint32_t nw,
                              const float *x, float *const *y, uint32_t n, const float2 *rope, uint32_t head_dim,
                              uint32_t n_pairs, const char *op)
{
    struct tkv_cuda_q8_act a;
    TKV_TRY(q8_prepare(cb, w[0]->t->type, x, n, w[0]->n_in, &a, op));
    struct tkv_cuda_qgemv g;
    group_build(&g, w, nw, y);
    g.pair = qgemv_pairs(cb, w, nw);
    if (rope)
        g.rope = rope, g.rope_segs = 2, g.head_dim = head_dim, g.n_pairs = n_pairs;
    return qgemv_run(cb, w[0]->t->type, &g, a, w[0]->n_in, n, op);
}

static tkv_status cuda_matmul_group(struct tkv_backend *b, const struct tkv_bweight *const *w, uint32_t nw,
                                    const float *x, float *const *y, uint32_t n)
{
    struct cuda_backend *cb = cuda_of(b);
    const char *op = "matmul_group";
    ALIVE(op);
    if (nw == 0 || nw > TKV_CUDA_GEMV_GROUP_MAX)
        return tkv_err(TKV_ERR_INVALID_ARG, "cuda: matmul_group: %u weights (1 to %d)", nw, TKV_CUDA_GEMV_GROUP_MAX);
    for (uint32_t i = 0; i < nw; i++)
        if (w[i]->is_vec || w[i]->n_in != w[0]->n_in)
            return tkv_err(TKV_ERR_INVALID_ARG, "cuda: matmul_group: %s is not a matrix of %u columns", w[i]->t->name,
                           w[0]->n_in);
    if (n == 0)
        return TKV_OK;
    const int path = group_path(cb, w, nw, x, n);
    if (path == GROUP_QUANT)
        return group_qgemv(cb, w, nw, x, y, n, NULL, 0, 0, op);
    if (path == GROUP_SEQ) {
        for (uint32_t i = 0; i < nw; i++)
            TKV_TRY(cuda_matmul(b, w[i], x, y[i], n));
        return TKV_OK;
    }
    struct tkv_cuda_gemv_group g;
    group_build(&g, w, nw, y);
    CU(op, tkv_cuda_gemv_group(&g, x, w[0]->n_in, n, (uint32_t)cb->n_sm, cb->pdl, cb->stream));
    return TKV_OK;
}

static tkv_status cuda_matmul_swiglu(struct tkv_backend *b, const struct tkv_bweight *wg, const struct tkv_bweight *wu,
                                     const float *x, float *out, uint32_t n)
{
    struct cuda_backend *cb = cuda_of(b);
    const char *op = "matmul_swiglu";
    ALIVE(op);
    if (wg->is_vec || wu->is_vec || wg->n_in != wu->n_in || wg->n_out != wu->n_out)
        return tkv_err(TKV_ERR_INVALID_ARG, "cuda: matmul_swiglu: %s and %s are not matrices of one shape",
                       wg->t->name, wu->t->name);
    if (n == 0)
        return TKV_OK;
    const struct tkv_bweight *const gu[2] = {wg, wu};
    const int path = group_path(cb, gu, 2, x, n);
    if (path == GROUP_QUANT) {
        struct tkv_cuda_q8_act a;
        TKV_TRY(q8_prepare(cb, wg->t->type, x, n, wg->n_in, &a, op));
        struct tkv_cuda_qgemv g;
        group_build(&g, &wg, 1, &out);
        g.wu = wu->wq;
        g.swiglu = true;
        return qgemv_run(cb, wg->t->type, &g, a, wg->n_in, n, op);
    }
    if (path == GROUP_F16) {
        CU(op, tkv_cuda_gemv_swiglu(wg->w16, wu->w16, x, out, wg->n_in, wg->n_out, n, (uint32_t)cb->n_sm, cb->pdl,
                                    cb->stream));
        return TKV_OK;
    }
    /* the sequence, the up product in a work buffer */
    const size_t count = (size_t)n * wg->n_out;
    TKV_TRY(work_reserve(cb, (void **)&cb->fuse_work, &cb->fuse_work_cap, count * sizeof(float), op));
    TKV_TRY(cuda_matmul(b, wg, x, out, n));
    TKV_TRY(cuda_matmul(b, wu, x, cb->fuse_work, n));
    CU(op, tkv_cuda_swiglu(out, cb->fuse_work, out, count, cb->stream));
    return TKV_OK;
}

static tkv_status cuda_add_rmsnorm(struct tkv_backend *b, float *y, const float *x, const struct tkv_bweight *w,
                                   float *h, uint32_t n, uint32_t dim, float eps)
{
    struct cuda_backend *cb = cuda_of(b);
    ALIVE("add_rmsnorm");
    if (!w->is_vec || w->n_in != dim)
        return tkv_err(TKV_ERR_INVALID_ARG, "cuda: add_rmsnorm weight %s must be a vector [%u]", w->t->name, dim);
    if (dim == 0)
        return TKV_OK;
    CU("add_rmsnorm", tkv_cuda_add_rmsnorm(y, x, w->v32, h, n, dim, eps, cb->pdl, cb->stream));
    return TKV_OK;
}

/* Makes pos_dev hold pos[0..n): a copy is queued only when they differ from
 * the last ones uploaded. Queued kernels that read the old values ran
 * before the copy (one stream). */
static tkv_status pos_upload(struct cuda_backend *cb, const int32_t *pos, uint32_t n, const char *op)
{
    if (cb->pos_n == n && !memcmp(cb->pos_last, pos, (size_t)n * sizeof *pos))
        return TKV_OK;
    cb->pos_n = 0; /* unknown until the copy is queued */
    cb->rope_ok = false;
    if (n > cb->pos_cap) {
        const uint32_t cap = TKV_MAX(n, TKV_MAX(2 * cb->pos_cap, 256u));
        CU(op, cudaStreamSynchronize(cb->stream)); /* kernels may still read the old buffer */
        cudaFree(cb->pos_dev);
        cb->pos_dev = NULL;
        cb->pos_cap = 0;
        int32_t *last = (int32_t *)realloc(cb->pos_last, (size_t)cap * sizeof *last);
        if (!last)
            return tkv_err(TKV_ERR_NOMEM, "cuda: %s: out of host memory for %u positions", op, cap);
        cb->pos_last = last;
        CU(op, cudaMalloc((void **)&cb->pos_dev, (size_t)cap * sizeof *cb->pos_dev));
        cb->pos_cap = cap;
    }
    struct stage_slot *sl;
    TKV_TRY(stage_take(cb, (size_t)n * sizeof *pos, &sl, op));
    memcpy(sl->host, pos, (size_t)n * sizeof *pos);
    CU(op, cudaMemcpyAsync(cb->pos_dev, sl->host, (size_t)n * sizeof *pos, cudaMemcpyHostToDevice, cb->stream));
    CU(op, cudaEventRecord(sl->ev, cb->stream));
    sl->pending = true;
    memcpy(cb->pos_last, pos, (size_t)n * sizeof *pos);
    cb->pos_n = n;
    return TKV_OK;
}

/* The rotation dimension every rope op accepts, and theta_scale, the ratio
 * of successive pairs' frequencies (the CPU's value, bit for bit). */
static tkv_status rope_check(uint32_t rot_dim, uint32_t head_dim)
{
    if (rot_dim > head_dim || rot_dim % 2)
        return tkv_err(TKV_ERR_INVALID_ARG, "cuda: rope dimension %u invalid for head_dim %u", rot_dim, head_dim);
    if (rot_dim > 1024)
        return tkv_err(TKV_ERR_INVALID_ARG, "cuda: rope dimension %u too large", rot_dim);
    return TKV_OK;
}
static float rope_theta_scale(float base, uint32_t rot_dim) { return powf(base, -2.0f / (float)rot_dim); }

/* Makes rope_tab hold the angles of pos_dev's n positions for n_pairs
 * pairs (tkv_cuda_rope_table), computed again only when they change. */
static tkv_status rope_table(struct cuda_backend *cb, uint32_t n, uint32_t n_pairs, float theta_scale, float freq_scale,
                             const char *op)
{
    if (cb->rope_ok && cb->rope_n == n && cb->rope_pairs == n_pairs && cb->rope_ts == theta_scale &&
        cb->rope_fs == freq_scale)
        return TKV_OK;
    cb->rope_ok = false;
    TKV_TRY(work_reserve(cb, (void **)&cb->rope_tab, &cb->rope_tab_cap, (size_t)n * n_pairs * sizeof(float2), op));
    CU(op, tkv_cuda_rope_table(cb->pos_dev, n, n_pairs, theta_scale, freq_scale, cb->rope_tab, cb->pdl, cb->stream));
    cb->rope_n = n, cb->rope_pairs = n_pairs, cb->rope_ts = theta_scale, cb->rope_fs = freq_scale;
    cb->rope_ok = true;
    return TKV_OK;
}

static tkv_status cuda_rope_qk(struct tkv_backend *b, float *q, float *k, uint32_t n, uint32_t n_head,
                               uint32_t n_head_kv, uint32_t head_dim, uint32_t rot_dim, const int32_t *pos, float base,
                               float freq_scale)
{
    struct cuda_backend *cb = cuda_of(b);
    const char *op = "rope_qk";
    ALIVE(op);
    TKV_TRY(rope_check(rot_dim, head_dim));
    if (n == 0 || rot_dim == 0 || n_head + n_head_kv == 0)
        return TKV_OK;
    const float theta_scale = rope_theta_scale(base, rot_dim);
    TKV_TRY(pos_upload(cb, pos, n, op));
    CU(op, tkv_cuda_rope_qk(q, k, n, n_head, n_head_kv, head_dim, rot_dim, cb->pos_dev, theta_scale, freq_scale,
                            cb->pdl, cb->stream));
    return TKV_OK;
}

/* matmul_group over {q, k, v} then rope_qk: one quantized GEMV rotating q
 * and k in its epilogue (tkv_cuda_qgemv's rope) where the group takes the
 * quantized path; else the two ops. */
static tkv_status cuda_matmul_qkv_rope(struct tkv_backend *b, const struct tkv_bweight *const *w, const float *x,
                                       float *q, float *k, float *v, uint32_t n, uint32_t head_dim, uint32_t rot_dim,
                                       const int32_t *pos, float base, float freq_scale)
{
    struct cuda_backend *cb = cuda_of(b);
    const char *op = "matmul_qkv_rope";
    ALIVE(op);
    if (head_dim == 0)
        return tkv_err(TKV_ERR_INVALID_ARG, "cuda: %s: head_dim 0", op);
    TKV_TRY(rope_check(rot_dim, head_dim));
    for (int i = 0; i < 3; i++)
        if (w[i]->is_vec || w[i]->n_in != w[0]->n_in || (i < 2 && w[i]->n_out % head_dim))
            return tkv_err(TKV_ERR_INVALID_ARG, "cuda: %s: %s is not a matrix of %u columns%s", op, w[i]->t->name,
                           w[0]->n_in, i < 2 ? " and whole heads" : "");
    if (n == 0)
        return TKV_OK;
    float *const y[3] = {q, k, v};
    if (cb->qkv_rope && rot_dim > 0 && group_path(cb, w, 3, x, n) == GROUP_QUANT) {
        const float theta_scale = rope_theta_scale(base, rot_dim);
        TKV_TRY(pos_upload(cb, pos, n, op));
        TKV_TRY(rope_table(cb, n, rot_dim / 2, theta_scale, freq_scale, op));
        return group_qgemv(cb, w, 3, x, y, n, cb->rope_tab, head_dim, rot_dim / 2, op);
    }
    TKV_TRY(cuda_matmul_group(b, w, 3, x, y, n));
    return cuda_rope_qk(b, q, k, n, w[0]->n_out / head_dim, w[1]->n_out / head_dim, head_dim, rot_dim, pos, base,
                        freq_scale);
}

static tkv_status cuda_rmsnorm(struct tkv_backend *b, const float *x, const struct tkv_bweight *w, float *y,
                               uint32_t n, uint32_t dim, float eps)
{
    struct cuda_backend *cb = cuda_of(b);
    ALIVE("rmsnorm");
    if (!w->is_vec || w->n_in != dim)
        return tkv_err(TKV_ERR_INVALID_ARG, "cuda: rmsnorm weight %s must be a vector [%u]", w->t->name, dim);
    if (dim == 0)
        return TKV_OK;
    /* a decode step's norm whose output a quantized GEMV read last time:
     * quantized here, in the order that GEMV took (q8_prepare) */
    struct tkv_cuda_q8_act a;
    bool q8 = false;
    if (cb->norm_q8 && x != y)
        TKV_TRY(q8_target(cb, &cb->norm_next, y, n, dim, &a, &q8, "rmsnorm"));
    if (q8) {
        CU("rmsnorm", tkv_cuda_rmsnorm_q8(x, w->v32, y, n, dim, eps, a, cb->pdl, cb->stream));
        q8_memo_set(cb, y, n, dim, a.gb);
        return TKV_OK;
    }
    CU("rmsnorm", tkv_cuda_rmsnorm(x, w->v32, y, n, dim, eps, cb->pdl, cb->stream));
    return TKV_OK;
}

static tkv_status cuda_rope(struct tkv_backend *b, float *x, uint32_t n, uint32_t n_heads, uint32_t head_dim,
                            uint32_t rot_dim, const int32_t *pos, float base, float freq_scale)
{
    struct cuda_backend *cb = cuda_of(b);
    const char *op = "rope";
    ALIVE(op);
    TKV_TRY(rope_check(rot_dim, head_dim));
    if (n == 0 || rot_dim == 0 || n_heads == 0)
        return TKV_OK;
    const float theta_scale = rope_theta_scale(base, rot_dim);
    struct stage_slot *sl;
    TKV_TRY(stage_take(cb, (size_t)n * sizeof(int32_t), &sl, op));
    memcpy(sl->host, pos, (size_t)n * sizeof(int32_t));
    TKV_TRY(stage_send(cb, sl, (size_t)n * sizeof(int32_t), op));
    CU(op, tkv_cuda_rope(x, n, n_heads, head_dim, rot_dim, (const int32_t *)sl->dev, theta_scale, freq_scale,
                         cb->stream));
    return TKV_OK;
}

static tkv_status cuda_swiglu(struct tkv_backend *b, const float *gate, const float *up, float *out, size_t count)
{
    struct cuda_backend *cb = cuda_of(b);
    ALIVE("swiglu");
    CU("swiglu", tkv_cuda_swiglu(gate, up, out, count, cb->stream));
    return TKV_OK;
}

static tkv_status cuda_add(struct tkv_backend *b, float *y, const float *x, size_t count)
{
    struct cuda_backend *cb = cuda_of(b);
    ALIVE("add");
    CU("add", tkv_cuda_add(y, x, count, cb->stream));
    return TKV_OK;
}

static tkv_status cuda_kv_write(struct tkv_backend *b, const float *src, size_t src_stride, uint16_t *dst,
                                uint32_t n_rows, uint32_t head_dim)
{
    struct cuda_backend *cb = cuda_of(b);
    ALIVE("kv_write");
    CU("kv_write", tkv_cuda_kv_write(src, src_stride, dst, n_rows, head_dim, cb->stream));
    return TKV_OK;
}

static tkv_status cuda_kv_write_heads(struct tkv_backend *b, const float *k, const float *v, size_t stride,
                                      uint16_t *const *kdst, uint16_t *const *vdst, uint32_t n_heads, uint32_t n_rows,
                                      uint32_t head_dim)
{
    struct cuda_backend *cb = cuda_of(b);
    const char *op = "kv_write_heads";
    ALIVE(op);
    struct tkv_cuda_kv_dst dst;
    for (uint32_t h0 = 0; h0 < n_heads; h0 += TKV_CUDA_KV_HEADS_MAX) { /* one launch per 64 heads */
        const uint32_t nh = TKV_MIN(n_heads - h0, (uint32_t)TKV_CUDA_KV_HEADS_MAX);
        for (uint32_t h = 0; h < nh; h++) {
            dst.k[h] = kdst[h0 + h];
            dst.v[h] = vdst[h0 + h];
        }
        CU(op, tkv_cuda_kv_write_heads(k + (size_t)h0 * head_dim, v + (size_t)h0 * head_dim, stride, &dst, nh, n_rows,
                                       head_dim, cb->pdl, cb->stream));
    }
    return TKV_OK;
}

/* Attention: validated here, run by attn.cu (block table, plan, kernels).
 * TKV_CUDA_ATTN_DECODE in the environment when the backend is created picks
 * the kernels of calls with at most 8 query rows per KV head: unset (or "1",
 * "runs", "pdl") the decode kernel with its fused merge over the view as
 * strided runs in its launch parameters where the view fits them (attn.cuh),
 * else over the packed block table; "fused" always the packed table;
 * "merge" the decode kernel and a separate merge kernel; "0" the general
 * (reference) kernel. */
static tkv_status cuda_attention(struct tkv_backend *b, const struct tkv_attn_args *a)
{
    struct cuda_backend *cb = cuda_of(b);
    const char *op = "attention";
    ALIVE(op);
    if (!a || !a->q || !a->out || !a->q_pos || !a->kv)
        return tkv_err(TKV_ERR_INVALID_ARG, "attention: NULL argument");
    if (a->n_head == 0 || a->n_head_kv == 0 || a->n_head % a->n_head_kv != 0)
        return tkv_err(TKV_ERR_INVALID_ARG, "attention: %u query heads not a multiple of %u KV heads", a->n_head,
                       a->n_head_kv);
    if (a->head_dim == 0 || a->head_dim > 1024)
        return tkv_err(TKV_ERR_INVALID_ARG, "attention: head_dim %u out of range", a->head_dim);
    if (!tkv_cuda_attn_supported(a->head_dim))
        return tkv_err(TKV_ERR_UNSUPPORTED, "cuda: attention: head_dim %u (needs a multiple of 8, at most 256)",
                       a->head_dim);
    if (a->n_q == 0)
        return TKV_OK;
    uint64_t total = 0;
    for (uint32_t g = 0; g < a->n_head_kv; g++)
        total += a->kv[g].n_blocks;
    if (total > UINT32_MAX / 2)
        return tkv_err(TKV_ERR_INVALID_ARG, "attention: %llu KV blocks in one call", (unsigned long long)total);
    /* a decode step's attention whose output a quantized GEMV (wo) read
     * last time: the decode kernels quantize it as they write it */
    const uint32_t dim = a->n_head * a->head_dim;
    struct tkv_cuda_q8_act qa;
    bool q8 = false, q8_done = false;
    if (cb->attn_q8)
        TKV_TRY(q8_target(cb, &cb->attn_next, a->out, a->n_q, dim, &qa, &q8, op));
    CU(op, tkv_cuda_attn_run(cb->attn, a, q8 ? &qa : NULL, cb->n_sm, cb->stream, &q8_done));
    if (q8_done)
        q8_memo_set(cb, a->out, a->n_q, dim, qa.gb);
    return TKV_OK;
}

/* The policies' statistics (gpu/stats.cu). The keys' block table goes
 * through a staging slot as for attention,
 *     q [n_q, n_head*head_dim] f32 (q_host only) | q_pos [n_q] i32 (WINDOW) |
 *     head_off [n_head_kv + 1] u32 | entries [total]      (16-byte aligned parts)
 * and the results come back to the host arrays of the call, which returns
 * once they are there. */
static tkv_status cuda_attn_stats(struct tkv_backend *b, const struct tkv_attn_stats_args *a)
{
    struct cuda_backend *cb = cuda_of(b);
    const char *op = "attn_stats";
    ALIVE(op);
    uint32_t nb;
    TKV_TRY(tkv_attn_stats_check(a, &nb));
    if (!tkv_cuda_stats_supported(a->head_dim))
        return tkv_err(TKV_ERR_UNSUPPORTED, "cuda: attn_stats: head_dim %u (at most 256)", a->head_dim);
    const uint32_t H = a->n_head_kv;
    const bool window = a->kind == TKV_ATTN_STATS_WINDOW;
    if (!window && nb == 0) { /* no block before the segment: the reference writes no P, H = 0 */
        if (a->entropy)
            memset(a->entropy, 0, H * sizeof(double));
        return TKV_OK;
    }
    if (window && a->n_prefix == 0)
        return TKV_OK;
    if (window && (a->n_q == 0 || a->n_past == 0)) { /* no query or no key: every score is 0 */
        memset(a->scores, 0, (size_t)H * a->n_prefix * sizeof(float));
        return TKV_OK;
    }
    if (window && (uint64_t)(a->n_head / H) * a->n_q > (1u << 24))
        return tkv_err(TKV_ERR_UNSUPPORTED, "cuda: attn_stats: %u window queries x %u heads per group", a->n_q,
                       a->n_head / H);
    uint64_t total = 0;
    uint32_t max_blocks = 0;
    for (uint32_t g = 0; g < H; g++) {
        total += a->kv[g].n_blocks;
        max_blocks = TKV_MAX(max_blocks, a->kv[g].n_blocks);
    }
    if (total > UINT32_MAX / 2)
        return tkv_err(TKV_ERR_INVALID_ARG, "attn_stats: %llu KV blocks in one call", (unsigned long long)total);
    const uint32_t n_qpos = window ? a->n_q : 0;
    const size_t q_bytes = a->q_host ? (size_t)a->n_q * a->n_head * a->head_dim * sizeof(float) : 0;
    const size_t off_p = tkv_align_up(q_bytes, 16);
    const size_t off_h = off_p + tkv_align_up((size_t)n_qpos * sizeof(int32_t), 16);
    const size_t off_e = off_h + tkv_align_up(((size_t)H + 1) * sizeof(uint32_t), 16);
    const size_t bytes = off_e + (size_t)total * sizeof(struct tkv_cuda_stats_block);
    struct stage_slot *sl;
    TKV_TRY(stage_take(cb, bytes, &sl, op));
    uint8_t *h = (uint8_t *)sl->host;
    if (q_bytes)
        memcpy(h, a->q, q_bytes);
    if (n_qpos)
        memcpy(h + off_p, a->q_pos, (size_t)n_qpos * sizeof(int32_t));
    uint32_t *head_off = (uint32_t *)(h + off_h);
    struct tkv_cuda_stats_block *ent = (struct tkv_cuda_stats_block *)(h + off_e);
    uint32_t k = 0;
    for (uint32_t g = 0; g < H; g++) {
        head_off[g] = k;
        for (uint32_t i = 0; i < a->kv[g].n_blocks; i++, k++) {
            const struct tkv_kv_block_ref *r = &a->kv[g].blocks[i];
            ent[k] = (struct tkv_cuda_stats_block){r->k, r->pos0, r->n};
        }
    }
    head_off[H] = k;
    TKV_TRY(stage_send(cb, sl, bytes, op));

    struct tkv_cuda_stats_params p;
    memset(&p, 0, sizeof p);
    p.kind = (int)a->kind;
    p.q = q_bytes ? (const float *)sl->dev : a->q;
    p.q_pos = n_qpos ? (const int32_t *)((uint8_t *)sl->dev + off_p) : NULL;
    p.blocks = (const struct tkv_cuda_stats_block *)((uint8_t *)sl->dev + off_e);
    p.head_off = (const uint32_t *)((uint8_t *)sl->dev + off_h);
    p.n_q = a->n_q;
    p.n_head = a->n_head;
    p.n_head_kv = H;
    p.head_dim = a->head_dim;
    p.n_past = a->n_past;
    p.max_blocks = max_blocks;
    p.block = a->block;
    p.n_blocks = nb;
    p.n_prefix = a->n_prefix;
    p.pool = a->pool;
    p.pool_max = a->pool_kind == 'm';
    p.scale = 1.0f / sqrtf((float)a->head_dim); /* as tkv_policy_window_scores computes it */
    const size_t work = tkv_cuda_stats_plan(&p, cb->n_sm);
    TKV_TRY(work_reserve(cb, &cb->stats_work, &cb->stats_work_cap, work, op));
    p.work = cb->stats_work;
    CU(op, tkv_cuda_stats(&p, cb->stream));
    if (window) {
        CU(op, cudaMemcpyAsync(a->scores, p.scores, (size_t)H * a->n_prefix * sizeof(float), cudaMemcpyDeviceToHost,
                               cb->stream));
    } else {
        if (a->probs)
            CU(op, cudaMemcpy2DAsync(a->probs, (size_t)a->probs_stride * sizeof(float), p.probs,
                                     (size_t)nb * sizeof(float), (size_t)nb * sizeof(float), H,
                                     cudaMemcpyDeviceToHost, cb->stream));
        if (a->entropy)
            CU(op, cudaMemcpyAsync(a->entropy, p.entropy, H * sizeof(double), cudaMemcpyDeviceToHost, cb->stream));
    }
    CU(op, cudaStreamSynchronize(cb->stream));
    return TKV_OK;
}

/* ---- lifetime ------------------------------------------------------------------- */

/* ---- RaBitQ (gpu/rabitq.cuh) ------------------------------------------------ */

static_assert(TKV_CUDA_RQ_MAX_WORDS == TKV_RABITQ_MAX_WORDS, "query planes of the same width");

static struct tkv_cuda_rq_index rq_index(const struct tkv_rabitq_dev *ix)
{
    return (struct tkv_cuda_rq_index){ix->dim, ix->dim_pad, ix->words, ix->rot_scale, ix->sign, ix->ck, ix->cq,
                                      ix->code, ix->a, ix->e, ix->t, ix->pc};
}

/* A prepared query (runtime/rabitq/rabitq.h) as the kernels take it. */
static struct tkv_rabitq_dev_query rq_query(const struct tkv_rabitq_query *q)
{
    struct tkv_rabitq_dev_query c;
    tkv_rabitq_query_to_dev(q, &c);
    return c;
}

/* The page-table stores: values and indexes go up through a staging slot
 * (so the caller may reuse its arrays at once), one scatter kernel. */
static tkv_status cuda_table_write(struct tkv_backend *b, uint64_t *table, const uint32_t *idx, const uint64_t *val,
                                   uint32_t n)
{
    struct cuda_backend *cb = cuda_of(b);
    const char *op = "table_write";
    ALIVE(op);
    if (n && (!table || !idx || !val))
        return tkv_err(TKV_ERR_INVALID_ARG, "cuda: table_write: NULL argument");
    if (n == 0)
        return TKV_OK;
    struct stage_slot *sl;
    const size_t bytes = (size_t)n * (sizeof *val + sizeof *idx);
    TKV_TRY(stage_take(cb, bytes, &sl, op));
    memcpy(sl->host, val, (size_t)n * sizeof *val); /* the 8-byte values first: aligned */
    memcpy((uint8_t *)sl->host + (size_t)n * sizeof *val, idx, (size_t)n * sizeof *idx);
    TKV_TRY(stage_send(cb, sl, bytes, op));
    CU(op, tkv_cuda_table_write(table, (const uint32_t *)((uint8_t *)sl->dev + (size_t)n * sizeof *val),
                                (const uint64_t *)sl->dev, n, cb->stream));
    return TKV_OK;
}

/* The decode attention table: the heads' sel_n travel in the kernel's
 * parameters, a CTA per (head, round of blocks); nothing waits. */
static tkv_status cuda_kv_table(struct tkv_backend *b, const struct tkv_kv_table_args *a)
{
    struct cuda_backend *cb = cuda_of(b);
    const char *op = "kv_table";
    ALIVE(op);
    TKV_TRY(tkv_kv_table_check(a));
    CU(op, tkv_cuda_kvt_sync_reserve(&cb->kvt, a, cb->stream));
    CU(op, tkv_cuda_kv_table(a, &cb->kvt, cb->pdl, cb->stream));
    return TKV_OK;
}

/* A layer's queries prepared on the compute stream from the device q (the
 * item table goes up through a staging slot); nothing waits. */
static tkv_status cuda_rabitq_prepare(struct tkv_backend *b, const struct tkv_rabitq_prepare_args *a)
{
    struct cuda_backend *cb = cuda_of(b);
    const char *op = "rabitq_prepare";
    ALIVE(op);
    if (!a || (a->n && (!a->q || !a->items || !a->out)))
        return tkv_err(TKV_ERR_INVALID_ARG, "cuda: rabitq_prepare: NULL argument");
    if (!(a->eps0 >= 0) || !isfinite(a->eps0))
        return tkv_err(TKV_ERR_INVALID_ARG, "cuda: rabitq_prepare: eps0 %g must be >= 0", (double)a->eps0);
    for (uint32_t i = 0; i < a->n; i++) {
        const struct tkv_rabitq_dev *ix = a->items[i].ix;
        if (!ix || ix->dim == 0 || ix->dim > ix->dim_pad || !tkv_cuda_rq_shape_ok(ix->dim_pad, ix->words))
            return tkv_err(TKV_ERR_INVALID_ARG, "cuda: rabitq_prepare: item %u: no index or dim %u, dim_pad %u", i,
                           ix ? ix->dim : 0, ix ? ix->dim_pad : 0);
    }
    if (a->bad)
        CU(op, tkv_cuda_fill32(a->bad, UINT32_MAX, 1, cb->pdl, cb->stream));
    if (a->n == 0)
        return TKV_OK;
    struct tkv_cuda_rq_preps g; /* a launch per group, its items in the parameters: nothing staged */
    memset(&g, 0, sizeof g);
    for (uint32_t b0 = 0; b0 < a->n; b0 += TKV_CUDA_RQ_PREP_GROUP) {
        const uint32_t m = TKV_MIN(a->n - b0, (uint32_t)TKV_CUDA_RQ_PREP_GROUP);
        for (uint32_t i = 0; i < m; i++) {
            const struct tkv_rabitq_prepare_item *it = &a->items[b0 + i];
            g.it[i] = (struct tkv_cuda_rq_prep){rq_index(it->ix), it->ix->cqck, it->head, it->rows};
        }
        CU(op, tkv_cuda_rq_prepare(a->q, a->head_stride, &g, b0, m, a->eps0 == 0 ? TKV_RABITQ_EPS0 : a->eps0, a->out,
                                   a->bad, cb->pdl, cb->stream));
    }
    return TKV_OK;
}

/* Encodes every span's rows in one grid on the compute stream (the span
 * table goes up through a staging slot) and waits once for the verdict. */
static tkv_status cuda_rabitq_encode(struct tkv_backend *b, const struct tkv_rabitq_dev *ix,
                                     const struct tkv_rabitq_span *spans, uint32_t n_spans, size_t row_stride,
                                     uint32_t at)
{
    struct cuda_backend *cb = cuda_of(b);
    const char *op = "rabitq_encode";
    ALIVE(op);
    if (!tkv_cuda_rq_shape_ok(ix->dim_pad, ix->words))
        return tkv_err(TKV_ERR_INVALID_ARG, "cuda: rabitq_encode: dim_pad %u (a power of two, 64 .. %u)", ix->dim_pad,
                       TKV_CUDA_RQ_MAX_DIM);
    uint64_t n = 0;
    uint32_t m = 0; /* non-empty spans */
    for (uint32_t s = 0; s < n_spans; s++) {
        n += spans[s].n;
        m += spans[s].n > 0;
    }
    if (n > UINT32_MAX - at)
        return tkv_err(TKV_ERR_INVALID_ARG, "cuda: rabitq_encode of %llu keys at %u", (unsigned long long)n, at);
    if (n == 0)
        return TKV_OK;
    if (!cb->rq_bad)
        CU(op, cudaMalloc(&cb->rq_bad, sizeof *cb->rq_bad));
    struct stage_slot *sl;
    const size_t bytes = (size_t)m * sizeof(struct tkv_cuda_rq_span);
    TKV_TRY(stage_take(cb, bytes, &sl, op));
    struct tkv_cuda_rq_span *tab = (struct tkv_cuda_rq_span *)sl->host;
    uint32_t first = 0, j = 0;
    for (uint32_t s = 0; s < n_spans; first += spans[s].n, s++)
        if (spans[s].n)
            tab[j++] = (struct tkv_cuda_rq_span){spans[s].k, first, 0};
    TKV_TRY(stage_send(cb, sl, bytes, op));
    CU(op, cudaMemsetAsync(cb->rq_bad, 0xff, sizeof *cb->rq_bad, cb->stream));
    const struct tkv_cuda_rq_index d = rq_index(ix);
    CU(op, tkv_cuda_rq_encode(&d, (const struct tkv_cuda_rq_span *)sl->dev, m, (uint32_t)n, row_stride, at,
                              cb->rq_bad, cb->stream));
    uint32_t bad = 0;
    CU(op, cudaMemcpyAsync(&bad, cb->rq_bad, sizeof bad, cudaMemcpyDeviceToHost, cb->stream));
    CU(op, cudaStreamSynchronize(cb->stream));
    if (bad != UINT32_MAX)
        return tkv_rabitq_encode_error(spans, n_spans, at, bad);
    return TKV_OK;
}

static tkv_status cuda_rabitq_estimate(struct tkv_backend *b, const struct tkv_rabitq_dev *ix,
                                       const struct tkv_rabitq_query *q, uint32_t first, uint32_t n, float *est,
                                       float *bound)
{
    struct cuda_backend *cb = cuda_of(b);
    const char *op = "rabitq_estimate";
    ALIVE(op);
    if (ix->words == 0 || ix->words > TKV_CUDA_RQ_MAX_WORDS || q->words != ix->words)
        return tkv_err(TKV_ERR_INVALID_ARG, "cuda: rabitq_estimate: %u code words, query %u", ix->words, q->words);
    const struct tkv_rabitq_dev_query cq = rq_query(q);
    const struct tkv_cuda_rq_index d = rq_index(ix);
    CU(op, tkv_cuda_rq_estimate(&d, &cq, first, n, est, bound, cb->stream));
    return TKV_OK;
}

/* A key centroid's sums where the keys are: the span table up through a
 * staging slot, one grid, the sums down, one wait. */
static tkv_status cuda_rabitq_key_sums(struct tkv_backend *b, const struct tkv_rabitq_span *spans, uint32_t n_spans,
                                       size_t row_stride, uint32_t dim, int64_t *units, uint32_t *nonfinite)
{
    struct cuda_backend *cb = cuda_of(b);
    const char *op = "rabitq_key_sums";
    ALIVE(op);
    if (!units || !nonfinite || (n_spans && !spans) || dim == 0 || dim > TKV_CUDA_RQ_MAX_DIM || row_stride < dim)
        return tkv_err(TKV_ERR_INVALID_ARG, "cuda: rabitq_key_sums: NULL argument, dim %u or row stride %zu", dim,
                       row_stride);
    uint64_t rows = 0;
    uint32_t m = 0, max_rows = 0; /* non-empty spans */
    for (uint32_t x = 0; x < n_spans; x++) {
        if (spans[x].n && !spans[x].k)
            return tkv_err(TKV_ERR_INVALID_ARG, "cuda: rabitq_key_sums: span %u: NULL rows", x);
        rows += spans[x].n, m += spans[x].n > 0, max_rows = TKV_MAX(max_rows, spans[x].n);
    }
    if (rows > TKV_RABITQ_MEAN_MAX_ROWS)
        return tkv_err(TKV_ERR_INVALID_ARG, "cuda: rabitq_key_sums of %llu rows: more than %llu",
                       (unsigned long long)rows, (unsigned long long)TKV_RABITQ_MEAN_MAX_ROWS);
    if (rows == 0)
        return TKV_OK;
    if (!cb->ks_dev)
        CU(op, cudaMalloc(&cb->ks_dev, TKV_CUDA_RQ_MAX_DIM * (sizeof(unsigned long long) + sizeof(uint32_t))));
    unsigned long long *du = (unsigned long long *)cb->ks_dev;
    uint32_t *dn = (uint32_t *)(du + TKV_CUDA_RQ_MAX_DIM);
    struct stage_slot *sl;
    const size_t bytes = (size_t)m * sizeof(struct tkv_cuda_rq_rows);
    TKV_TRY(stage_take(cb, bytes, &sl, op));
    struct tkv_cuda_rq_rows *tab = (struct tkv_cuda_rq_rows *)sl->host;
    for (uint32_t x = 0, j = 0; x < n_spans; x++)
        if (spans[x].n)
            tab[j++] = (struct tkv_cuda_rq_rows){spans[x].k, spans[x].n, 0};
    TKV_TRY(stage_send(cb, sl, bytes, op));
    CU(op, cudaMemsetAsync(cb->ks_dev, 0, TKV_CUDA_RQ_MAX_DIM * (sizeof *du + sizeof *dn), cb->stream));
    CU(op, tkv_cuda_rq_key_sums((const struct tkv_cuda_rq_rows *)sl->dev, m, max_rows, row_stride, dim, du, dn,
                                cb->stream));
    unsigned long long hu[TKV_CUDA_RQ_MAX_DIM];
    uint32_t hn[TKV_CUDA_RQ_MAX_DIM];
    CU(op, cudaMemcpyAsync(hu, du, dim * sizeof *du, cudaMemcpyDeviceToHost, cb->stream));
    CU(op, cudaMemcpyAsync(hn, dn, dim * sizeof *dn, cudaMemcpyDeviceToHost, cb->stream));
    CU(op, cudaStreamSynchronize(cb->stream));
    for (uint32_t d = 0; d < dim; d++)
        units[d] += (int64_t)hu[d], nonfinite[d] += hn[d];
    return TKV_OK;
}

/* One layer's selection (gpu/rabitq-select.cuh): the heads' descriptors and
 * queries go up in one copy through a staging slot, the bitmaps and
 * per-pair results come down in one copy, one wait -- none when the bitmap
 * stays in device memory and nothing else is asked for. */
static tkv_status cuda_rabitq_select(struct tkv_backend *b, const struct tkv_rabitq_select_args *a)
{
    struct cuda_backend *cb = cuda_of(b);
    const char *op = "rabitq_select";
    ALIVE(op);
    uint32_t n_max;
    TKV_TRY(tkv_rabitq_select_check(a, "cuda: rabitq_select", &n_max));
    n_max = tkv_cuda_rqs_row_len(n_max);
    if (a->n_heads == 0)
        return TKV_OK;
    static_assert(TKV_CUDA_RQS_MAX_G == TKV_RABITQ_SELECT_MAX_G &&
                      TKV_CUDA_RQS_MAX_FORCED == TKV_RABITQ_SELECT_MAX_FORCED,
                  "the same limits");
    uint32_t code_words = a->heads[0].ix->words; /* 0: the heads' widths differ */
    bool host_q = false; /* some head's queries come from the host: staged */
    for (uint32_t h = 0; h < a->n_heads; h++) {
        const struct tkv_rabitq_select_head *hd = &a->heads[h];
        if (hd->ix->words == 0 || hd->ix->words > TKV_CUDA_RQ_MAX_WORDS) /* the kernels' code widths */
            return tkv_err(TKV_ERR_INVALID_ARG, "cuda: rabitq_select: head %u: codes of %u words (1..%d)", h,
                           hd->ix->words, TKV_CUDA_RQ_MAX_WORDS);
        code_words = hd->ix->words == code_words ? code_words : 0;
        host_q |= hd->q != NULL;
    }
    const uint32_t H = a->n_heads, G = a->G, P = H * G;
    /* the heads go into the kernels' parameters (tkv_cuda_rqs_run); queries
     * the host prepared go up through a slot of the staging ring (the host
     * need not wait for the last call's copy). Device: state | scratch
     * [3][P][n_max] | list [P][n_max] | mass [P] | n_chosen [P] | bitmap
     * (the bitmap there only when it comes down; with bitmap_dev the
     * kernels write the caller's rows) */
    const size_t b_q = (size_t)P * sizeof(struct tkv_rabitq_dev_query);
    const size_t b_state = tkv_align_up(tkv_cuda_rqs_state_bytes(P), 256);
    const size_t b_scratch = tkv_align_up((size_t)3 * P * n_max * sizeof(float), 256);
    const size_t b_list = tkv_align_up((size_t)P * n_max * sizeof(uint32_t), 256);
    const size_t b_out = (size_t)P * (sizeof(double) + sizeof(uint32_t)) +
                         (a->bitmap_dev ? 0 : (size_t)H * a->words * sizeof(uint32_t));
    const size_t dev_bytes = b_state + b_scratch + b_list + b_out;
    if (dev_bytes > cb->rqs_dev_cap) {
        CU(op, cudaStreamSynchronize(cb->stream));
        cudaFree(cb->rqs_dev);
        cb->rqs_dev = NULL, cb->rqs_dev_cap = 0;
        CU(op, cudaMalloc(&cb->rqs_dev, dev_bytes));
        cb->rqs_dev_cap = dev_bytes;
    }
    if (b_out > cb->rqs_host_cap) {
        cudaFreeHost(cb->rqs_host); /* (only calls that waited for their copies used it) */
        cb->rqs_host = NULL, cb->rqs_host_cap = 0;
        CU(op, cudaMallocHost(&cb->rqs_host, b_out));
        cb->rqs_host_cap = b_out;
    }
    struct stage_slot *sl = NULL;
    if (host_q) {
        TKV_TRY(stage_take(cb, b_q, &sl, op));
        struct tkv_rabitq_dev_query *hq = (struct tkv_rabitq_dev_query *)sl->host;
        for (uint32_t h = 0; h < H; h++)
            for (uint32_t j = 0; j < G && a->heads[h].q; j++)
                hq[h * G + j] = rq_query(&a->heads[h].q[j]);
        TKV_TRY(stage_send(cb, sl, b_q, op));
    }
    uint8_t *dm = (uint8_t *)cb->rqs_dev, *out = dm + b_state + b_scratch + b_list;
    const struct tkv_cuda_rqs_work w = {dm, (float *)(dm + b_state), (uint32_t *)(dm + b_state + b_scratch),
                                        (double *)out, (uint32_t *)(out + (size_t)P * sizeof(double)),
                                        a->bitmap_dev ? a->bitmap_dev
                                                      : (uint32_t *)(out + (size_t)P * (sizeof(double) + sizeof(uint32_t)))};
    const struct tkv_cuda_rqs_params pp = {H, G, n_max, a->words, a->whole, a->p, a->scale, a->extra_lse,
                                           a->safe ? 1 : 0, a->coarse ? 1 : 0, code_words, (uint32_t)cb->n_sm,
                                           cb->rqs_mma ? 1u : 0u};
    CU(op, tkv_cuda_rqs_clear(&w, P, cb->pdl, cb->stream));
    struct tkv_cuda_rqs_heads hs; /* a group of heads a launch, in its parameters: nothing staged */
    for (uint32_t h0 = 0; h0 < H; h0 += TKV_CUDA_RQS_GROUP) {
        const uint32_t m = TKV_MIN(H - h0, (uint32_t)TKV_CUDA_RQS_GROUP);
        memset(&hs, 0, sizeof hs);
        for (uint32_t i = 0; i < m; i++) {
            const uint32_t h = h0 + i;
            const struct tkv_rabitq_select_head *hd = &a->heads[h];
            struct tkv_cuda_rqs_head *x = &hs.h[i];
            x->ix = rq_index(hd->ix);
            x->n = hd->n;
            x->n_forced = hd->n_forced;
            x->row = a->bitmap_dev ? hd->row : h;
            for (uint32_t r = 0; r < hd->n_forced; r++)
                x->fb[r] = hd->forced[r].begin, x->fe[r] = hd->forced[r].end;
            x->q = hd->q ? (const struct tkv_rabitq_dev_query *)sl->dev + (size_t)h * G /* staged above */
                         : hd->q_dev;                                               /* prepared on the device */
        }
        CU(op, tkv_cuda_rqs_run(&pp, &hs, h0, m, &w, cb->pdl, cb->stream));
    }
    if (a->bitmap_dev && !a->n_chosen && !a->mass) /* nothing comes down: no wait */
        return TKV_OK;
    uint8_t *ho = (uint8_t *)cb->rqs_host;
    CU(op, cudaMemcpyAsync(ho, out, b_out, cudaMemcpyDeviceToHost, cb->stream));
    CU(op, cudaStreamSynchronize(cb->stream));
    if (a->mass)
        memcpy(a->mass, ho, (size_t)P * sizeof(double));
    if (a->n_chosen)
        memcpy(a->n_chosen, ho + (size_t)P * sizeof(double), (size_t)P * sizeof(uint32_t));
    if (a->bitmap)
        memcpy(a->bitmap, ho + (size_t)P * (sizeof(double) + sizeof(uint32_t)),
               (size_t)H * a->words * sizeof(uint32_t));
    return TKV_OK;
}

/* ---- op profiler (TKV_CUDA_PROFILE=1) ------------------------------------------
 *
 * With TKV_CUDA_PROFILE=1 when the backend is created, its vtable is
 * cuda_prof_ops: every op goes through a wrapper that counts the call, adds
 * the host time spent inside it (CLOCK_MONOTONIC), and brackets the work it
 * queues on the compute stream with a pair of timing events from a ring
 * made at creation. When the ring is full, at profile_read and at free, the
 * backend waits for the last event and folds the pairs' elapsed times into
 * the rows: no allocation and no synchronization per op. Without the
 * variable the vtable is cuda_ops and nothing here runs.
 *
 * Costs when on: two cudaEventRecord per timed op (~1-2 us of host time each,
 * outside the op's host time), and a wait for the stream every PROF_RING ops
 * (the host stops running ahead of the device there). */
#define PROF_RING 2048
#define PROF_ROWS 96

struct prof_pair {
    cudaEvent_t start, end;
    uint32_t row;
};

struct cuda_prof {
    struct tkv_op_profile_row rows[PROF_ROWS];
    char names[PROF_ROWS][48];
    const char *key_op[PROF_ROWS];      /* rows are keyed by the op's name (a literal) and up to 3 numbers */
    uint32_t key[PROF_ROWS][3];
    uint32_t n_rows;
    struct prof_pair ring[PROF_RING];
    uint32_t n_ring;                    /* pairs recorded since the last fold */
    cudaEvent_t first;                  /* before the first timed op since the reset */
    bool have_first;
    double dev_span_s;                  /* first -> the end of the last folded pair */
    double t_first, t_last;             /* host clock; t_first < 0: no op yet */
};

static double prof_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The row of (op, a, b, c); timed: the op's work is bracketed by events. */
static uint32_t prof_row(struct cuda_prof *p, const char *op, bool timed, uint32_t a = 0, uint32_t b = 0,
                         uint32_t c = 0, const char *fmt = NULL)
{
    for (uint32_t i = 0; i < p->n_rows; i++)
        if (p->key_op[i] == op && p->key[i][0] == a && p->key[i][1] == b && p->key[i][2] == c)
            return i;
    if (p->n_rows == PROF_ROWS) /* full: the last row takes the rest */
        return PROF_ROWS - 1;
    const uint32_t i = p->n_rows++;
    p->key_op[i] = op;
    p->key[i][0] = a, p->key[i][1] = b, p->key[i][2] = c;
    if (fmt)
        snprintf(p->names[i], sizeof p->names[i], fmt, op, a, b);
    else
        snprintf(p->names[i], sizeof p->names[i], "%s", op);
    if (i == PROF_ROWS - 1)
        snprintf(p->names[i], sizeof p->names[i], "(other ops)");
    p->rows[i] = (struct tkv_op_profile_row){p->names[i], 0, 0.0, timed ? 0.0 : -1.0};
    return i;
}

/* Waits for the recorded pairs and adds their device times to the rows.
 * Profiling is best effort: a failed event call drops its pair. */
static void prof_fold(struct cuda_prof *p)
{
    if (p->n_ring == 0)
        return;
    if (cudaEventSynchronize(p->ring[p->n_ring - 1].end) == cudaSuccess) {
        for (uint32_t i = 0; i < p->n_ring; i++) {
            float ms;
            struct tkv_op_profile_row *r = &p->rows[p->ring[i].row];
            if (cudaEventElapsedTime(&ms, p->ring[i].start, p->ring[i].end) == cudaSuccess && r->dev_s >= 0)
                r->dev_s += ms * 1e-3;
        }
        float span;
        if (p->have_first && cudaEventElapsedTime(&span, p->first, p->ring[p->n_ring - 1].end) == cudaSuccess)
            p->dev_span_s = span * 1e-3;
    }
    (void)cudaGetLastError();
    p->n_ring = 0;
}

/* Brackets one op call: the constructor runs before the op's work is
 * queued, the destructor after (also on an early return). */
struct prof_scope {
    struct cuda_backend *cb;
    uint32_t row;
    int slot;
    double t0;
    prof_scope(struct cuda_backend *cb_, uint32_t row_) : cb(cb_), row(row_), slot(-1)
    {
        struct cuda_prof *p = cb->prof;
        if (p->rows[row].dev_s >= 0) {
            if (p->n_ring == PROF_RING)
                prof_fold(p);
            if (!p->have_first)
                p->have_first = cudaEventRecord(p->first, cb->stream) == cudaSuccess;
            if (cudaEventRecord(p->ring[p->n_ring].start, cb->stream) == cudaSuccess)
                slot = (int)p->n_ring;
            (void)cudaGetLastError();
        }
        t0 = prof_now();
        if (p->t_first < 0)
            p->t_first = t0;
    }
    ~prof_scope()
    {
        struct cuda_prof *p = cb->prof;
        const double t1 = prof_now();
        p->rows[row].calls++;
        p->rows[row].host_s += t1 - t0;
        p->t_last = t1;
        if (slot >= 0) {
            if (cudaEventRecord(p->ring[slot].end, cb->stream) == cudaSuccess) {
                p->ring[slot].row = row;
                p->n_ring++;
            }
            (void)cudaGetLastError();
        }
    }
    prof_scope(const prof_scope &) = delete;
    prof_scope &operator=(const prof_scope &) = delete;
};

static void prof_zero(struct cuda_prof *p)
{
    for (uint32_t i = 0; i < p->n_rows; i++) {
        p->rows[i].calls = 0;
        p->rows[i].host_s = 0;
        p->rows[i].dev_s = p->rows[i].dev_s >= 0 ? 0.0 : -1.0;
    }
    p->have_first = false;
    p->dev_span_s = 0;
    p->t_first = -1;
    p->t_last = 0;
}

static tkv_status prof_read(struct tkv_backend *b, struct tkv_op_profile *out)
{
    struct cuda_backend *cb = cuda_of(b);
    ALIVE("profile_read");
    struct cuda_prof *p = cb->prof;
    prof_fold(p);
    double busy = 0;
    for (uint32_t i = 0; i < p->n_rows; i++)
        busy += p->rows[i].dev_s > 0 ? p->rows[i].dev_s : 0.0;
    *out = (struct tkv_op_profile){p->rows, p->n_rows, p->t_first >= 0 ? p->t_last - p->t_first : 0.0,
                                   p->dev_span_s, busy};
    return TKV_OK;
}

static void prof_reset(struct tkv_backend *b)
{
    struct cuda_backend *cb = cuda_of(b);
    prof_fold(cb->prof);
    prof_zero(cb->prof);
}

static tkv_status prof_create(struct cuda_backend *cb)
{
    const char *op = "init (TKV_CUDA_PROFILE)";
    struct cuda_prof *p = (struct cuda_prof *)calloc(1, sizeof *p);
    if (!p)
        return tkv_err(TKV_ERR_NOMEM, "cuda: out of memory for the op profile");
    cb->prof = p;
    CU(op, cudaEventCreate(&p->first));
    for (uint32_t i = 0; i < PROF_RING; i++) {
        CU(op, cudaEventCreate(&p->ring[i].start));
        CU(op, cudaEventCreate(&p->ring[i].end));
    }
    prof_zero(p);
    return TKV_OK;
}

/* At free: prints what was not read and reset, then lets the events go. */
static void prof_free(struct cuda_backend *cb)
{
    struct cuda_prof *p = cb->prof;
    if (!p)
        return;
    uint64_t calls = 0;
    for (uint32_t i = 0; i < p->n_rows; i++)
        calls += p->rows[i].calls;
    struct tkv_op_profile out;
    if (calls && !cb->failed && prof_read(&cb->base, &out) == TKV_OK) {
        char label[64];
        snprintf(label, sizeof label, "cuda:%d, at backend free", cb->device);
        tkv_op_profile_print(label, &out, 0);
    }
    if (p->first)
        cudaEventDestroy(p->first);
    for (uint32_t i = 0; i < PROF_RING; i++) {
        if (p->ring[i].start)
            cudaEventDestroy(p->ring[i].start);
        if (p->ring[i].end)
            cudaEventDestroy(p->ring[i].end);
    }
    free(p);
    cb->prof = NULL;
}

/* The wrappers: PROF(name, timed-row expression, call) makes the backend's
 * device current (ALIVE), then times `call` in the row. */
#define PROF(op_name, row_expr, call)             \
    struct cuda_backend *cb = cuda_of(b);         \
    ALIVE(op_name);                               \
    prof_scope prof_scope_(cb, (row_expr));       \
    return (call)

static tkv_status pw_upload(struct tkv_backend *b, void *dst, const void *src, size_t bytes)
{
    PROF("upload", prof_row(cb->prof, "upload", true), cuda_upload(b, dst, src, bytes));
}
static tkv_status pw_download(struct tkv_backend *b, void *dst, const void *src, size_t bytes)
{
    PROF("download", prof_row(cb->prof, "download", true), cuda_download(b, dst, src, bytes));
}
static tkv_status pw_download_blocks(struct tkv_backend *b, void *const *dst, const void *const *src, uint32_t n,
                                     size_t bytes)
{
    PROF("download_blocks", prof_row(cb->prof, "download_blocks", true), cuda_download_blocks(b, dst, src, n, bytes));
}
static tkv_status pw_synchronize(struct tkv_backend *b)
{
    PROF("synchronize", prof_row(cb->prof, "synchronize", false), cuda_sync(b));
}
static tkv_status pw_copy(struct tkv_backend *b, void *dst, const void *src, size_t bytes)
{
    PROF("copy", prof_row(cb->prof, "copy", true), cuda_copy(b, dst, src, bytes));
}
static tkv_status pw_get_rows(struct tkv_backend *b, const struct tkv_bweight *w, const int32_t *ids, uint32_t n,
                              float *out)
{
    PROF("get_rows", prof_row(cb->prof, "get_rows", true), cuda_get_rows(b, w, ids, n, out));
}
/* matmul rows by weight shape (n_out x n_in) and path (enum matmul_path) */
static const char *const matmul_path_name[] = {"gemv",      "gemv-ref",  "cublas",    "cublas-f32", "gemv-u8",
                                                "gemv-q4_0", "gemv-q4_1", "gemv-q8_0", "gemv-q-ref"};
/* A grouped op's row: MP_GEMV the f16 group kernel, MP_GEMV_REF ("seq")
 * the sequence, the quantized one by type */
static uint32_t group_path_row(const struct cuda_backend *cb, const struct tkv_bweight *const *w, uint32_t nw,
                               const float *x, uint32_t n)
{
    const int p = group_path(cb, w, nw, x, n);
    return p == GROUP_QUANT ? qgemv_fast_path(w[0]) : p == GROUP_F16 ? MP_GEMV : MP_GEMV_REF;
}
static tkv_status pw_matmul(struct tkv_backend *b, const struct tkv_bweight *w, const float *x, float *y, uint32_t n)
{
    const uint32_t path = matmul_path(cuda_of(b), w, x, n);
    char fmt[48];
    snprintf(fmt, sizeof fmt, "%%s %%ux%%u %s", matmul_path_name[path]);
    PROF("matmul", prof_row(cb->prof, "matmul", true, w->n_out, w->n_in, path, fmt), cuda_matmul(b, w, x, y, n));
}
/* the product's path (paths without an epilogue add also run the add) */
static tkv_status pw_matmul_add(struct tkv_backend *b, const struct tkv_bweight *w, const float *x, float *y,
                                uint32_t n)
{
    const uint32_t path = matmul_path(cuda_of(b), w, x, n);
    char fmt[48];
    snprintf(fmt, sizeof fmt, "%%s %%ux%%u %s", matmul_path_name[path]);
    PROF("matmul_add", prof_row(cb->prof, "matmul_add", true, w->n_out, w->n_in, path, fmt),
         cuda_matmul_add(b, w, x, y, n));
}
/* the fused ops: a row per shape (total rows x n_in) and path ("gemv" when
 * one fused kernel runs, "seq" when the op runs the plain sequence) */
static tkv_status pw_matmul_group(struct tkv_backend *b, const struct tkv_bweight *const *w, uint32_t nw,
                                  const float *x, float *const *y, uint32_t n)
{
    uint32_t rows = 0;
    for (uint32_t i = 0; nw <= TKV_CUDA_GEMV_GROUP_MAX && i < nw; i++)
        rows += w[i]->n_out;
    const uint32_t path = group_path_row(cuda_of(b), w, nw, x, n);
    char fmt[48];
    snprintf(fmt, sizeof fmt, "%%s %%ux%%u %s", path == MP_GEMV_REF ? "seq" : matmul_path_name[path]);
    PROF("matmul_group", prof_row(cb->prof, "matmul_group", true, rows, nw ? w[0]->n_in : 0, path, fmt),
         cuda_matmul_group(b, w, nw, x, y, n));
}
static tkv_status pw_matmul_swiglu(struct tkv_backend *b, const struct tkv_bweight *wg, const struct tkv_bweight *wu,
                                   const float *x, float *out, uint32_t n)
{
    const struct tkv_bweight *const gu[2] = {wg, wu};
    const uint32_t path = group_path_row(cuda_of(b), gu, 2, x, n);
    char fmt[48];
    snprintf(fmt, sizeof fmt, "%%s %%ux%%u %s", path == MP_GEMV_REF ? "seq" : matmul_path_name[path]);
    PROF("matmul_swiglu", prof_row(cb->prof, "matmul_swiglu", true, 2 * wg->n_out, wg->n_in, path, fmt),
         cuda_matmul_swiglu(b, wg, wu, x, out, n));
}
static tkv_status pw_matmul_qkv_rope(struct tkv_backend *b, const struct tkv_bweight *const *w, const float *x,
                                     float *q, float *k, float *v, uint32_t n, uint32_t head_dim, uint32_t rot_dim,
                                     const int32_t *pos, float base, float freq_scale)
{
    const uint32_t rows = w[0]->n_out + w[1]->n_out + w[2]->n_out;
    const uint32_t path = group_path_row(cuda_of(b), w, 3, x, n);
    char fmt[48];
    snprintf(fmt, sizeof fmt, "%%s %%ux%%u %s", path == MP_GEMV_REF ? "seq" : matmul_path_name[path]);
    PROF("matmul_qkv_rope", prof_row(cb->prof, "matmul_qkv_rope", true, rows, w[0]->n_in, path, fmt),
         cuda_matmul_qkv_rope(b, w, x, q, k, v, n, head_dim, rot_dim, pos, base, freq_scale));
}
static tkv_status pw_add_rmsnorm(struct tkv_backend *b, float *y, const float *x, const struct tkv_bweight *w, float *h,
                                 uint32_t n, uint32_t dim, float eps)
{
    PROF("add_rmsnorm", prof_row(cb->prof, "add_rmsnorm", true), cuda_add_rmsnorm(b, y, x, w, h, n, dim, eps));
}
static tkv_status pw_rope_qk(struct tkv_backend *b, float *q, float *k, uint32_t n, uint32_t n_head, uint32_t n_head_kv,
                             uint32_t head_dim, uint32_t rot_dim, const int32_t *pos, float base, float freq_scale)
{
    PROF("rope_qk", prof_row(cb->prof, "rope_qk", true),
         cuda_rope_qk(b, q, k, n, n_head, n_head_kv, head_dim, rot_dim, pos, base, freq_scale));
}
static tkv_status pw_rmsnorm(struct tkv_backend *b, const float *x, const struct tkv_bweight *w, float *y, uint32_t n,
                             uint32_t dim, float eps)
{
    PROF("rmsnorm", prof_row(cb->prof, "rmsnorm", true), cuda_rmsnorm(b, x, w, y, n, dim, eps));
}
static tkv_status pw_rope(struct tkv_backend *b, float *x, uint32_t n, uint32_t n_heads, uint32_t head_dim,
                          uint32_t rot_dim, const int32_t *pos, float base, float freq_scale)
{
    PROF("rope", prof_row(cb->prof, "rope", true), cuda_rope(b, x, n, n_heads, head_dim, rot_dim, pos, base, freq_scale));
}
static tkv_status pw_swiglu(struct tkv_backend *b, const float *gate, const float *up, float *out, size_t count)
{
    PROF("swiglu", prof_row(cb->prof, "swiglu", true), cuda_swiglu(b, gate, up, out, count));
}
static tkv_status pw_add(struct tkv_backend *b, float *y, const float *x, size_t count)
{
    PROF("add", prof_row(cb->prof, "add", true), cuda_add(b, y, x, count));
}
static tkv_status pw_kv_write(struct tkv_backend *b, const float *src, size_t src_stride, uint16_t *dst,
                              uint32_t n_rows, uint32_t head_dim)
{
    PROF("kv_write", prof_row(cb->prof, "kv_write", true), cuda_kv_write(b, src, src_stride, dst, n_rows, head_dim));
}
static tkv_status pw_kv_write_heads(struct tkv_backend *b, const float *k, const float *v, size_t stride,
                                    uint16_t *const *kdst, uint16_t *const *vdst, uint32_t n_heads, uint32_t n_rows,
                                    uint32_t head_dim)
{
    PROF("kv_write_heads", prof_row(cb->prof, "kv_write_heads", true),
         cuda_kv_write_heads(b, k, v, stride, kdst, vdst, n_heads, n_rows, head_dim));
}
static tkv_status pw_attention(struct tkv_backend *b, const struct tkv_attn_args *a)
{
    /* decode: at most 8 query rows per KV head (the decode kernel's calls) */
    const bool dec = a && a->n_head_kv && (uint64_t)a->n_q * (a->n_head / a->n_head_kv) <= 8;
    PROF("attention", prof_row(cb->prof, dec ? "attention decode" : "attention prefill", true),
         cuda_attention(b, a));
}
static tkv_status pw_attn_stats(struct tkv_backend *b, const struct tkv_attn_stats_args *a)
{
    PROF("attn_stats", prof_row(cb->prof, "attn_stats", true), cuda_attn_stats(b, a));
}
/* the block uploads run on the copy stream: host time only */
static tkv_status pw_upload_blocks(struct tkv_backend *b, void *const *dst, const void *const *src, uint32_t n,
                                   size_t bytes, const uint32_t *crc, uint8_t *bad, uint64_t *ticket)
{
    PROF("upload_blocks", prof_row(cb->prof, "upload_blocks", false),
         cuda_upload_blocks(b, dst, src, n, bytes, crc, bad, ticket));
}
static tkv_status pw_upload_fence(struct tkv_backend *b, uint64_t upto)
{
    PROF("upload_fence", prof_row(cb->prof, "upload_fence", false), cuda_upload_fence(b, upto));
}
static tkv_status pw_upload_wait(struct tkv_backend *b, uint64_t upto, bool block, bool *done)
{
    PROF("upload_wait", prof_row(cb->prof, "upload_wait", false), cuda_upload_wait(b, upto, block, done));
}
static tkv_status pw_rabitq_encode(struct tkv_backend *b, const struct tkv_rabitq_dev *ix,
                                   const struct tkv_rabitq_span *spans, uint32_t n_spans, size_t row_stride,
                                   uint32_t at)
{
    PROF("rabitq_encode", prof_row(cb->prof, "rabitq_encode", true),
         cuda_rabitq_encode(b, ix, spans, n_spans, row_stride, at));
}
static tkv_status pw_rabitq_key_sums(struct tkv_backend *b, const struct tkv_rabitq_span *spans, uint32_t n_spans,
                                     size_t row_stride, uint32_t dim, int64_t *units, uint32_t *nonfinite)
{
    PROF("rabitq_key_sums", prof_row(cb->prof, "rabitq_key_sums", true),
         cuda_rabitq_key_sums(b, spans, n_spans, row_stride, dim, units, nonfinite));
}
static tkv_status pw_rabitq_select(struct tkv_backend *b, const struct tkv_rabitq_select_args *a)
{
    PROF("rabitq_select", prof_row(cb->prof, "rabitq_select", true), cuda_rabitq_select(b, a));
}
static tkv_status pw_table_write(struct tkv_backend *b, uint64_t *table, const uint32_t *idx, const uint64_t *val,
                                 uint32_t n)
{
    PROF("table_write", prof_row(cb->prof, "table_write", true), cuda_table_write(b, table, idx, val, n));
}
static tkv_status pw_kv_table(struct tkv_backend *b, const struct tkv_kv_table_args *a)
{
    PROF("kv_table", prof_row(cb->prof, "kv_table", true), cuda_kv_table(b, a));
}
static tkv_status pw_rabitq_prepare(struct tkv_backend *b, const struct tkv_rabitq_prepare_args *a)
{
    PROF("rabitq_prepare", prof_row(cb->prof, "rabitq_prepare", true), cuda_rabitq_prepare(b, a));
}
static tkv_status pw_rabitq_estimate(struct tkv_backend *b, const struct tkv_rabitq_dev *ix,
                                     const struct tkv_rabitq_query *q, uint32_t first, uint32_t n, float *est,
                                     float *bound)
{
    PROF("rabitq_estimate", prof_row(cb->prof, "rabitq_estimate", true),
         cuda_rabitq_estimate(b, ix, q, first, n, est, bound));
}
#undef PROF

static void cuda_free(struct tkv_backend *b)
{
    struct cuda_backend *cb = cuda_of(b);
    if (!cb)
        return;
    if (cudaSetDevice(cb->device) == cudaSuccess) /* its streams and memory */
        tkv_cuda_current = cb->device;
    if (cb->stream)
        cudaStreamSynchronize(cb->stream);
    if (cb->copy_stream)
        cudaStreamSynchronize(cb->copy_stream);
    prof_free(cb);
    for (int i = 0; i < N_GATHER; i++) {
        struct gather_slot *sl = &cb->gather[i];
        cudaFreeHost(sl->host);
        cudaFree(sl->dev);
        free(sl->dsts);
        free(sl->srcs);
        free(sl->sizes);
        if (sl->ev)
            cudaEventDestroy(sl->ev);
    }
    if (cb->ev_main)
        cudaEventDestroy(cb->ev_main);
    if (cb->ev_copy)
        cudaEventDestroy(cb->ev_copy);
    if (cb->copy_stream)
        cudaStreamDestroy(cb->copy_stream);
    cudaFree(cb->rq_bad);
    cudaFree(cb->rqs_dev);
    cudaFree(cb->ks_dev);
    cudaFreeHost(cb->rqs_host);
    tkv_cuda_kvt_sync_free(&cb->kvt);
    if (cb->blas)
        cublasDestroy(cb->blas);
    for (int i = 0; i < N_STAGE; i++) {
        struct stage_slot *sl = &cb->stage[i];
        if (sl->host)
            cudaFreeHost(sl->host);
        if (sl->dev)
            cudaFree(sl->dev);
        if (sl->ev)
            cudaEventDestroy(sl->ev);
    }
    if (cb->act16)
        cudaFree(cb->act16);
    cudaFree(cb->fuse_work);
    cudaFree(cb->q8_work);
    cudaFree(cb->pos_dev);
    free(cb->pos_last);
    tkv_cuda_attn_state_free(cb->attn);
    if (cb->stats_work)
        cudaFree(cb->stats_work);
    if (cb->stream)
        cudaStreamDestroy(cb->stream);
    (void)cudaGetLastError();
    free(cb);
}

/* Filled by member name (C++ has no designated initializers before C++20),
 * so optional members added to the interface stay NULL. */
static struct tkv_backend_ops cuda_make_ops(void)
{
    struct tkv_backend_ops o;
    memset(&o, 0, sizeof o);
    o.name = "cuda";
    o.free = cuda_free;
    o.alloc = cuda_alloc;
    o.release = cuda_release;
    o.upload = cuda_upload;
    o.download = cuda_download;
    o.copy = cuda_copy;
    o.synchronize = cuda_sync;
    o.weight_init = cuda_weight_init;
    o.weight_free = cuda_weight_free;
    o.get_rows = cuda_get_rows;
    o.matmul = cuda_matmul;
    o.rmsnorm = cuda_rmsnorm;
    o.rope = cuda_rope;
    o.swiglu = cuda_swiglu;
    o.add = cuda_add;
    o.kv_write = cuda_kv_write;
    o.kv_write_heads = cuda_kv_write_heads;
    o.matmul_group = cuda_matmul_group;
    o.matmul_swiglu = cuda_matmul_swiglu;
    o.add_rmsnorm = cuda_add_rmsnorm;
    o.matmul_add = cuda_matmul_add;
    o.matmul_qkv_rope = cuda_matmul_qkv_rope;
    o.rope_qk = cuda_rope_qk;
    o.attention = cuda_attention;
    o.attn_stats = cuda_attn_stats;
    o.pci_bus_id = cuda_pci_bus_id;
    o.host_register = cuda_host_register;
    o.host_unregister = cuda_host_unregister;
    o.upload_blocks = cuda_upload_blocks;
    o.upload_fence = cuda_upload_fence;
    o.upload_wait = cuda_upload_wait;
    o.download_blocks = cuda_download_blocks;
    o.rabitq_encode = cuda_rabitq_encode;
    o.rabitq_estimate = cuda_rabitq_estimate;
    o.rabitq_select = cuda_rabitq_select;
    o.rabitq_prepare = cuda_rabitq_prepare;
    o.rabitq_key_sums = cuda_rabitq_key_sums;
    o.table_write = cuda_table_write;
    o.kv_table = cuda_kv_table;
    return o;
}
static const struct tkv_backend_ops cuda_ops = cuda_make_ops();

/* The vtable with TKV_CUDA_PROFILE=1: the same ops behind the wrappers. */
static struct tkv_backend_ops cuda_make_prof_ops(void)
{
    struct tkv_backend_ops o = cuda_make_ops();
    o.upload = pw_upload;
    o.download = pw_download;
    o.synchronize = pw_synchronize;
    o.copy = pw_copy;
    o.get_rows = pw_get_rows;
    o.matmul = pw_matmul;
    o.rmsnorm = pw_rmsnorm;
    o.rope = pw_rope;
    o.swiglu = pw_swiglu;
    o.add = pw_add;
    o.kv_write = pw_kv_write;
    o.kv_write_heads = pw_kv_write_heads;
    o.matmul_group = pw_matmul_group;
    o.matmul_swiglu = pw_matmul_swiglu;
    o.add_rmsnorm = pw_add_rmsnorm;
    o.matmul_add = pw_matmul_add;
    o.matmul_qkv_rope = pw_matmul_qkv_rope;
    o.rope_qk = pw_rope_qk;
    o.attention = pw_attention;
    o.attn_stats = pw_attn_stats;
    o.upload_blocks = pw_upload_blocks;
    o.upload_fence = pw_upload_fence;
    o.upload_wait = pw_upload_wait;
    o.download_blocks = pw_download_blocks;
    o.rabitq_encode = pw_rabitq_encode;
    o.rabitq_estimate = pw_rabitq_estimate;
    o.rabitq_select = pw_rabitq_select;
    o.rabitq_prepare = pw_rabitq_prepare;
    o.rabitq_key_sums = pw_rabitq_key_sums;
    o.table_write = pw_table_write;
    o.kv_table = pw_kv_table;
    o.profile_read = prof_read;
    o.profile_reset = prof_reset;
    return o;
}
static const struct tkv_backend_ops cuda_prof_ops = cuda_make_prof_ops();


extern "C" int tkv_cuda_device_count(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError(); /* clear the sticky "no driver" error */
        return 0;
    }
    return n;
}

static tkv_status cuda_init(struct cuda_backend *cb)
{
    const char *op = "init";
    cudaDeviceProp prop;
    CU(op, cudaSetDevice(cb->device));
    tkv_cuda_current = cb->device;
    CU(op, cudaGetDeviceProperties(&prop, cb->device));
    cb->n_sm = prop.multiProcessorCount;
    cb->smem_sm = (uint32_t)prop.sharedMemPerMultiprocessor;
    cb->pdl = cb->pdl && prop.major >= 9; /* griddepcontrol is sm_90's */
    if (cudaDeviceGetPCIBusId(cb->pci_bus_id, sizeof cb->pci_bus_id, cb->device) != cudaSuccess) {
        (void)cudaGetLastError();
        cb->pci_bus_id[0] = 0;
    }
    CU(op, cudaStreamCreateWithFlags(&cb->stream, cudaStreamNonBlocking));
    CU(op, cudaStreamCreateWithFlags(&cb->copy_stream, cudaStreamNonBlocking));
    CU(op, cudaEventCreateWithFlags(&cb->ev_main, cudaEventDisableTiming));
    CU(op, cudaEventCreateWithFlags(&cb->ev_copy, cudaEventDisableTiming));
    for (int i = 0; i < N_GATHER; i++)
        CU(op, cudaEventCreateWithFlags(&cb->gather[i].ev, cudaEventDisableTiming));
    int host_ptr_ok = 0;
    CU(op, cudaDeviceGetAttribute(&host_ptr_ok, cudaDevAttrCanUseHostPointerForRegisteredMem, cb->device));
    const char *up = getenv("TKV_CUDA_UPLOAD");
    cb->gather_kernel = host_ptr_ok && !(up && !strcmp(up, "memcpy"));
    cublasStatus_t s = cublasCreate(&cb->blas);
    if (s != CUBLAS_STATUS_SUCCESS) {
        cb->blas = NULL;
        return blas_fail(s, op);
    }
    if ((s = cublasSetStream(cb->blas, cb->stream)) != CUBLAS_STATUS_SUCCESS)
        return blas_fail(s, op);
    CU(op, tkv_cuda_attn_init());
    bool mma_built; /* (for sm_80 or later, so the device is too: it runs the kernel) */
    CU(op, tkv_cuda_rqs_init(&mma_built));
    cb->rqs_mma = cb->rqs_mma && mma_built;
    const char *dec = getenv("TKV_CUDA_ATTN_DECODE");
    const int attn_mode = dec && !strcmp(dec, "0")       ? TKV_ATTN_DECODE_OFF
                          : dec && !strcmp(dec, "merge") ? TKV_ATTN_DECODE_MERGE
                          : dec && !strcmp(dec, "fused") ? TKV_ATTN_DECODE_FUSED
                                                         : TKV_ATTN_DECODE_RUNS;
    CU(op, tkv_cuda_attn_state_create(attn_mode, cb->pdl, &cb->attn));
    for (int i = 0; i < N_STAGE; i++) {
        struct stage_slot *sl = &cb->stage[i];
        CU(op, cudaEventCreateWithFlags(&sl->ev, cudaEventDisableTiming));
        CU(op, cudaMallocHost(&sl->host, STAGE_MIN_BYTES));
        CU(op, cudaMalloc(&sl->dev, STAGE_MIN_BYTES));
        sl->cap = STAGE_MIN_BYTES;
    }
    TKV_LOG_I("cuda: device %d (%s): %s, %d SMs, %.1f GiB, compute capability %d.%d%s%s%s", cb->device,
              cb->pci_bus_id, prop.name, cb->n_sm, prop.totalGlobalMem / 1073741824.0, prop.major, prop.minor,
              cb->f16_rounded   ? " (f32 weights holding their f16 values: validation mode)"
              : cb->f32_weights ? " (f32 weights: validation mode)"
                                : "",
              cb->pdl ? " (programmatic dependent launches)" : "",
              cb->f32_weights || cb->gemv_quant == QGEMV_OFF ? ""
              : cb->gemv_quant == QGEMV_REF                  ? " (quantized decode GEMV: reference kernel)"
              : cb->qgemv_pairs == PAIRS_ALWAYS              ? " (quantized decode GEMV: row pairs)"
              : cb->qgemv_pairs == PAIRS_NEVER               ? " (quantized decode GEMV: single rows)"
                                                             : " (quantized decode GEMV)");
    return TKV_OK;
}

extern "C" tkv_status tkv_cuda_backend_set_prefill_variant(struct tkv_backend *b, int variant)
{
    if (!b || (b->ops != &cuda_ops && b->ops != &cuda_prof_ops))
        return tkv_err(TKV_ERR_INVALID_ARG, "cuda: prefill variant: not a CUDA backend");
    struct cuda_backend *cb = (struct cuda_backend *)b;
    if (!tkv_cuda_attn_state_set_prefill_variant(cb->attn, variant))
        return tkv_err(TKV_ERR_INVALID_ARG, "cuda: prefill variant %d does not exist (0 .. %d)", variant,
                       TKV_ATTN_PREFILL_VARIANTS - 1);
    return TKV_OK;
}

extern "C" tkv_status tkv_cuda_backend_quantize_act(struct tkv_backend *b, uint32_t weight_type, const float *x,
                                                    uint32_t n, uint32_t n_in, void *dst)
{
    if (!b || (b->ops != &cuda_ops && b->ops != &cuda_prof_ops))
        return tkv_err(TKV_ERR_INVALID_ARG, "cuda: quantize_act: not a CUDA backend");
    struct cuda_backend *cb = cuda_of(b);
    const char *op = "quantize_act";
    ALIVE(op);
    if (!tkv_cuda_qgemv_supported(weight_type) || n_in % 32 != 0)
        return tkv_err(TKV_ERR_INVALID_ARG, "cuda: quantize_act: weight type %s, %u columns (Q4_0, Q4_1 or Q8_0, "
                       "whole blocks of 32)", tkv_type_name(weight_type), n_in);
    if (n == 0)
        return TKV_OK;
    struct tkv_cuda_q8_act a;
    TKV_TRY(q8_prepare(cb, weight_type, x, n, n_in, &a, op));
    CU(op, tkv_cuda_q8_pack(a, n, n_in, weight_type == TKV_TYPE_Q4_1, dst, cb->stream));
    return TKV_OK;
}

extern "C" uint64_t tkv_cuda_backend_q8_reads(struct tkv_backend *b)
{
    return b && (b->ops == &cuda_ops || b->ops == &cuda_prof_ops) ? cuda_of(b)->q8_reads : 0;
}

extern "C" const char *tkv_cuda_prefill_variant_desc(int variant)
{
    return tkv_cuda_attn_prefill_variant_desc(variant);
}

extern "C" tkv_status tkv_cuda_backend_create(int device, uint32_t n_threads, struct tkv_backend **out)
{
    (void)n_threads;
    *out = NULL;
    const int count = tkv_cuda_device_count();
    if (count == 0)
        return tkv_err(TKV_ERR_DEVICE, "cuda: no usable CUDA device (driver missing or no GPU)");
    if (device < 0 || device >= count)
        return tkv_err(TKV_ERR_DEVICE, "cuda: device %d does not exist (%d usable: cuda:0 .. cuda:%d)", device, count,
                       count - 1);
    struct cuda_backend *cb = (struct cuda_backend *)calloc(1, sizeof *cb);
    if (!cb)
        return tkv_err(TKV_ERR_NOMEM, "cuda: out of memory");
    cb->base.ops = &cuda_ops;
    cb->device = device;
    const char *mode = getenv("TKV_CUDA_WEIGHTS");
    cb->f16_rounded = mode && !strcmp(mode, "f16round");
    cb->f32_weights = (mode && !strcmp(mode, "f32")) || cb->f16_rounded;
    const char *gemv = getenv("TKV_CUDA_GEMV");
    cb->gemv = gemv && !strcmp(gemv, "ref")      ? GEMV_REF
               : gemv && !strcmp(gemv, "cublas") ? GEMV_CUBLAS
               : gemv && !strcmp(gemv, "u8")     ? GEMV_U8
               : gemv && !strcmp(gemv, "fast")   ? GEMV_FAST
                                                 : GEMV_AUTO;
    const char *quant = getenv("TKV_CUDA_GEMV_QUANT");
    cb->gemv_quant = quant && !strcmp(quant, "0")     ? QGEMV_OFF
                     : quant && !strcmp(quant, "ref") ? QGEMV_REF
                                                      : QGEMV_FAST;
    cb->qgemv_pairs = quant && !strcmp(quant, "pair")     ? PAIRS_ALWAYS
                      : quant && !strcmp(quant, "single") ? PAIRS_NEVER
                                                          : PAIRS_AUTO;
    const char *q4p = getenv("TKV_CUDA_Q4P"); /* "U,WARPS": the Q4_0 kernel's shape, for A/B measuring */
    if (q4p && sscanf(q4p, "%u,%u", &cb->q4p_u, &cb->q4p_warps) != 2)
        cb->q4p_u = cb->q4p_warps = 0;
    const char *pdl = getenv("TKV_CUDA_PDL");
    cb->pdl = !(pdl && !strcmp(pdl, "0"));
    const char *norm_q8 = getenv("TKV_CUDA_NORM_Q8");
    cb->norm_q8 = !(norm_q8 && !strcmp(norm_q8, "0"));
    const char *attn_q8 = getenv("TKV_CUDA_ATTN_Q8");
    cb->attn_q8 = !(attn_q8 && !strcmp(attn_q8, "0"));
    const char *qkv_rope = getenv("TKV_CUDA_QKV_ROPE");
    cb->qkv_rope = !(qkv_rope && !strcmp(qkv_rope, "0"));
    const char *rqs_mma = getenv("TKV_CUDA_RQS_MMA");
    cb->rqs_mma = !(rqs_mma && !strcmp(rqs_mma, "0"));
    const char *prof = getenv("TKV_CUDA_PROFILE");
    tkv_status st = cuda_init(cb);
    if (st == TKV_OK && prof && !strcmp(prof, "1")) {
        st = prof_create(cb);
        cb->base.ops = &cuda_prof_ops;
    }
    if (st != TKV_OK) {
        cuda_free(&cb->base);
        return st;
    }
    *out = &cb->base;
    return TKV_OK;
}
