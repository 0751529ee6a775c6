/*
 * backend.h -- the interface every compute backend implements (cpu/, gpu/).
 *
 * The forward pass (runtime/engine.c) is written once against this vtable.
 * All float/half pointers passed to ops are in the backend's own memory
 * (host memory for the CPU backend, device memory for CUDA), allocated with
 * ops->alloc; index arrays marked "host" are always in host memory. Ops may
 * run asynchronously; ops->synchronize waits for all of them, download()
 * implies it. Every op returns a tkv_status and never aborts.
 *
 * Layouts: activations are row-major [n_tokens, width] f32. Q/K/V rows hold
 * heads side by side: q[t, h*head_dim + d]. KV blocks (tiers/kv-store.h)
 * hold B tokens of one (layer, KV head): K and V each [B, head_dim] f16.
 */
#ifndef TKV_BACKEND_H
#define TKV_BACKEND_H

#include "gguf.h"

struct tkv_backend;
struct tkv_bweight; /* a weight tensor prepared by a backend (opaque) */

/* One block of KV for one (layer, KV head), in backend memory. */
struct tkv_kv_block_ref {
    uint16_t *k;      /* [B, head_dim] f16 */
    uint16_t *v;      /* [B, head_dim] f16 */
    int32_t   pos0;   /* position of row 0; rows hold pos0 .. pos0+n-1 */
    uint32_t  n;      /* valid rows */
};

/* The keys one KV head attends to: a list of blocks, in position order. */
struct tkv_kv_head_view {
    const struct tkv_kv_block_ref *blocks;
    uint32_t n_blocks;
};

/* Attention of n_q query tokens over a KV view, grouped-query:
 * query head h reads KV head h / (n_head / n_head_kv). Causal: query t at
 * position q_pos[t] sees keys with position <= q_pos[t]. */
struct tkv_attn_args {
    const float   *q;          /* [n_q, n_head*head_dim]                      */
    const int32_t *q_pos;      /* host [n_q], non-decreasing                  */
    float         *out;        /* [n_q, n_head*head_dim]                      */
    float         *lse;        /* optional [n_q, n_head]: log-sum-exp of the
                                  scaled scores, to merge partial attentions  */
    uint32_t n_q, n_head, n_head_kv, head_dim;
    float    scale;            /* usually 1/sqrt(head_dim)                    */
    const struct tkv_kv_head_view *kv; /* host [n_head_kv]                   */
};

struct tkv_backend_ops {
    const char *name;
    void (*free)(struct tkv_backend *b);

    /* memory in the backend's address space */
    tkv_status (*alloc)(struct tkv_backend *b, size_t bytes, void **out);
    void       (*release)(struct tkv_backend *b, void *p);
    tkv_status (*upload)(struct tkv_backend *b, void *dst, const void *src_host, size_t bytes);
    tkv_status (*download)(struct tkv_backend *b, void *dst_host, const void *src, size_t bytes);
    tkv_status (*synchronize)(struct tkv_backend *b);

    /* weights: t's data stays mapped for the lifetime of the weight */
    tkv_status (*weight_init)(struct tkv_backend *b, const struct tkv_gguf_tensor *t, struct tkv_bweight **out);
    void       (*weight_free)(struct tkv_backend *b, struct tkv_bweight *w);

    /* out[i, :] = row ids[i] of w (embedding lookup), ids in host memory */
    tkv_status (*get_rows)(struct tkv_backend *b, const struct tkv_bweight *w, const int32_t *ids,
                           uint32_t n, float *out);
    /* y[n, n_out] = x[n, n_in] . w^T, for w of GGUF shape [n_in, n_out] */
    tkv_status (*matmul)(struct tkv_backend *b, const struct tkv_bweight *w, const float *x, float *y, uint32_t n);
    /* y[n, dim] = x / sqrt(mean(x^2) + eps) * w  (y may alias x) */
    tkv_status (*rmsnorm)(struct tkv_backend *b, const float *x, const struct tkv_bweight *w, float *y,
                          uint32_t n, uint32_t dim, float eps);
    /* In place on x[n, n_heads*head_dim]: rotate adjacent pairs (2i, 2i+1),
     * i < rot_dim/2, by angle pos*freq_scale*base^(-2i/rot_dim) (GGUF/ggml
     * "normal" RoPE). pos in host memory. */
    tkv_status (*rope)(struct tkv_backend *b, float *x, uint32_t n, uint32_t n_heads, uint32_t head_dim,
                       uint32_t rot_dim, const int32_t *pos, float base, float freq_scale);
    /* out = silu(gate) * up, count elements (out may alias gate) */
    tkv_status (*swiglu)(struct tkv_backend *b, const float *gate, const float *up, float *out, size_t count);
    /* y += x, count elements */
    tkv_status (*add)(struct tkv_backend *b, float *y, const float *x, size_t count);
    /* dst[r, :] = f16(src[r*src_stride + :head_dim]) for r < n_rows */
    tkv_status (*kv_write)(struct tkv_backend *b, const float *src, size_t src_stride, uint16_t *dst,
                           uint32_t n_rows, uint32_t head_dim);
    tkv_status (*attention)(struct tkv_backend *b, const struct tkv_attn_args *a);

    /* optional members: NULL where they do not apply (the CPU backend) */
    /* PCI bus id of the device ("0000:3b:00.0"), for NUMA placement */
    const char *(*pci_bus_id)(struct tkv_backend *b);
    /* page-lock host memory for fast asynchronous copies, and undo it */
    tkv_status (*host_register)(struct tkv_backend *b, void *p, size_t bytes);
    void       (*host_unregister)(struct tkv_backend *b, void *p);
    /* Asynchronous block uploads (the KV store's recalls and prefetches).
     * upload_blocks queues n copies of `bytes` each, src[i] (host memory
     * registered with host_register) -> dst[i] (device memory), after all work
     * queued so far, and returns at once; the copies overlap ops queued later
     * until upload_fence. Until upload_wait reports them done, the sources
     * must not change and the host must not reuse dst and src arrays' targets.
     * upload_fence: every op queued after it sees the copies (no host wait).
     * upload_wait: block = true waits for the copies; false polls: *done says
     * whether they have finished. */
    tkv_status (*upload_blocks)(struct tkv_backend *b, void *const *dst, const void *const *src, uint32_t n,
                                size_t bytes);
    tkv_status (*upload_fence)(struct tkv_backend *b);
    tkv_status (*upload_wait)(struct tkv_backend *b, bool block, bool *done);
};

struct tkv_backend {
    const struct tkv_backend_ops *ops;
};

/* Creates the backend for a device name: "cpu", "cuda" or "auto".
 * n_threads: CPU threads the backend may use (0 = all online cores). */
tkv_status tkv_backend_create(const char *device, uint32_t n_threads, struct tkv_backend **out);

/* Number of usable CUDA devices; 0 when built without CUDA or none usable. */
int tkv_backend_cuda_devices(void);

#endif /* TKV_BACKEND_H */
